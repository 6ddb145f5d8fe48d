"""The NetworkPolicies: each component's pods receive and send only what their command needs.

| component | may receive                                  | may connect to (and DNS)          |
|-----------|----------------------------------------------|-----------------------------------|
| worker    | the metrics port, from monitoring            | NATS, PostgreSQL, gateway, scoring |
| webhooks  | the webhook port, from the Ingress controller | PostgreSQL, gateway               |
|           | and from monitoring                          |                                   |
| produce   | nothing                                      | NATS, PostgreSQL                  |
| reconcile | nothing                                      | NATS, PostgreSQL, gateway         |
| migrate   | nothing                                      | PostgreSQL                        |
| maintain  | nothing                                      | PostgreSQL                        |
| toolbox   | nothing (`kubectl exec` is not traffic)      | NATS, PostgreSQL, gateway         |

The ports each target needs are read from the settings where they can be (`NATS_URL`,
`SCORING_URL`, `GATEWAY_URL`; `DATABASE_URL` is a secret: its port is the values'). Each
check takes one rendering and returns its problems as lines (empty: it holds).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from deploy.chart import Manifest
from deploy.rendered import COMPONENT, Rendered

NAMESPACE_LABEL = "kubernetes.io/metadata.name"
EGRESS = {
    "worker": ("nats", "postgresql", "gateway", "scoring"),
    "webhooks": ("postgresql", "gateway"),
    "produce": ("nats", "postgresql"),
    "reconcile": ("nats", "postgresql", "gateway"),
    "migrate": ("postgresql",),
    "maintain": ("postgresql",),
    "toolbox": ("nats", "postgresql", "gateway"),
}
URL_OF = {"nats": "NATS_URL", "gateway": "GATEWAY_URL", "scoring": "SCORING_URL"}
DEFAULT_PORTS = {"nats": 4222, "tls": 4222, "http": 80, "https": 443}
DNS = 53

Port = tuple[str, int]  # (protocol, number)


def url_ports(urls: str) -> set[int]:
    """The ports of a comma-separated list of URLs, the scheme's default where none is given."""
    ports = set()
    for url in urls.split(","):
        parts = urlsplit(url.strip())
        if parts.hostname:
            ports.add(parts.port or DEFAULT_PORTS.get(parts.scheme, 0))
    return ports


def check_network_policy(rendered: Rendered) -> list[str]:
    """One policy per component with pods, selecting exactly them, allowing only its needs."""
    values = rendered.values["networkPolicy"]
    policies = rendered.of_kind("NetworkPolicy")
    if not values["enabled"]:
        return [
            f"NetworkPolicy/{m.name} rendered while networkPolicy.enabled is off" for m in policies
        ]
    components = {pod.component for pod in rendered.pods()}
    problems = [
        f"NetworkPolicy/{m.name} is for {_component(m)!r}, which has no pods"
        for m in policies
        if _component(m) not in components
    ]
    for component in sorted(components):
        policy = rendered.only("NetworkPolicy", component)
        if policy is None:
            problems.append(f"no NetworkPolicy for the {component} pods")
            continue
        problems += _selection(rendered, component, policy)
        problems += _ingress(rendered, component, policy)
        problems += _egress(rendered, component, policy)
    return problems


def _selection(rendered: Rendered, component: str, policy: Manifest) -> list[str]:
    where = f"NetworkPolicy/{policy.name}"
    spec = policy.obj["spec"]
    selector = spec["podSelector"].get("matchLabels") or {}
    selected = {
        pod.component
        for pod in rendered.pods()
        if selector and selector.items() <= pod.labels.items()
    }
    problems = (
        [] if selected == {component} else [f"{where} selects the pods of {sorted(selected)}"]
    )
    if sorted(spec.get("policyTypes", [])) != ["Egress", "Ingress"]:
        problems.append(f"{where} has policyTypes {spec.get('policyTypes')}, not both")
    return problems


def _ingress(rendered: Rendered, component: str, policy: Manifest) -> list[str]:
    values = rendered.values["networkPolicy"]
    monitoring, controller = values["monitoringNamespace"], values["ingressControllerNamespace"]
    metrics = int(rendered.setting("CHARGE_WORKER_METRICS_PORT"))
    webhook = int(rendered.setting("CHARGE_WORKER_WEBHOOK_PORT"))
    expected = {
        "worker": {(monitoring, metrics)},
        "webhooks": {(controller, webhook), (monitoring, webhook)},
    }.get(component, set())
    where = f"NetworkPolicy/{policy.name}"
    allowed: set[tuple[str, int]] = set()
    problems = []
    for rule in policy.obj["spec"].get("ingress") or []:
        peers, ports = rule.get("from"), rule.get("ports")
        if not peers or not ports:
            problems.append(f"{where} lets in {'any source' if not peers else 'any port'}")
            continue
        for peer in peers:
            namespace = ((peer.get("namespaceSelector") or {}).get("matchLabels") or {}).get(
                NAMESPACE_LABEL
            )
            if namespace is None:
                problems.append(f"{where} lets in {peer}, not the pods of one namespace")
            allowed |= {(str(namespace), int(port["port"])) for port in ports}
    if allowed != expected:
        problems.append(
            f"{where} lets in {sorted(allowed)} (namespace, port), expected {sorted(expected)}"
        )
    return problems


def _egress(rendered: Rendered, component: str, policy: Manifest) -> list[str]:
    values = rendered.values["networkPolicy"]
    where = f"NetworkPolicy/{policy.name}"
    problems = []
    allowed: set[Port] = set()
    for rule in policy.obj["spec"].get("egress") or []:
        if not rule.get("ports"):
            problems.append(f"{where} lets out every port to {rule.get('to', 'anywhere')}")
        allowed |= {(p.get("protocol", "TCP"), int(p["port"])) for p in rule.get("ports") or []}
    needed: set[Port] = {("UDP", DNS), ("TCP", DNS)}
    granted: set[Port] = set(needed)
    for target in EGRESS[component]:
        configured = {("TCP", int(port)) for port in values["egress"][target]["ports"]}
        granted |= configured
        if target in URL_OF:
            setting = URL_OF[target]
            wanted = {("TCP", port) for port in url_ports(rendered.setting(setting))}
            if not wanted <= configured:
                problems.append(
                    f"networkPolicy.egress.{target}.ports lack port(s) "
                    f"{sorted(p for _, p in wanted - configured)} of {setting}"
                )
            needed |= wanted
        else:
            needed |= configured
    extra = {
        (p.get("protocol", "TCP"), int(p["port"]))
        for rule in values.get("extraEgress") or []
        for p in rule.get("ports") or []
    }
    if missing := needed - allowed:
        problems.append(f"{where} does not let out {sorted(missing)} (protocol, port)")
    if beyond := allowed - granted - extra:
        problems.append(
            f"{where} lets out {sorted(beyond)} (protocol, port), which {component} never uses"
        )
    return problems


def _component(manifest: Manifest) -> str | None:
    labels: dict[str, Any] = manifest.obj["metadata"].get("labels", {})
    component: str | None = labels.get(COMPONENT)
    return component
