"""The webhook receiver's promises: `charge-worker webhooks` on its port, and one route in.

The receiver serves `POST /webhooks/gateway`, `/healthz`, `/readyz` and `/metrics` on one
port (CHARGE_WORKER_WEBHOOK_PORT). The gateway must reach the first from outside; nothing
outside may reach the others, so the Ingress routes exactly that path, `Exact`.
Each check takes one rendering and returns its problems as lines (empty: it holds).
"""

from __future__ import annotations

from typing import Any

from deploy.rendered import COMPONENT, Rendered, env_of
from deploy.workloads import probe_problems

COMMAND = "webhooks"
ROUTE = "/webhooks/gateway"  # webhooks.py: Route(f"/webhooks/{SOURCE}", ...)
ALL_INTERFACES = {"0.0.0.0", "::"}  # noqa: S104  # the kubelet and the Service reach the pod's IP


def check_webhooks(rendered: Rendered) -> list[str]:
    """`webhooks` with its port, probes, replicas and preStop; nothing when disabled."""
    values = rendered.values["webhooks"]
    if not values["enabled"]:
        left = [
            f"{m.kind}/{m.name}"
            for m in rendered.manifests
            if m.obj["metadata"].get("labels", {}).get(COMPONENT) == "webhooks"
        ]
        return [f"webhooks is disabled but {', '.join(left)} rendered"] if left else []
    deployment = rendered.only("Deployment", "webhooks")
    if deployment is None:
        return ["no webhooks Deployment rendered"]
    spec = deployment.obj["spec"]["template"]["spec"]
    if len(spec["containers"]) != 1:
        return [f"the receiver pod has {len(spec['containers'])} containers, expected 1"]
    receiver = spec["containers"][0]
    problems = []
    if (receiver.get("args") or [None])[0] != COMMAND:
        problems.append(f"receiver args are {receiver.get('args')}, expected {COMMAND} first")
    host = rendered.setting("CHARGE_WORKER_WEBHOOK_HOST")
    if host not in ALL_INTERFACES:
        problems.append(f"CHARGE_WORKER_WEBHOOK_HOST {host} is unreachable from outside the pod")
    port = int(rendered.setting("CHARGE_WORKER_WEBHOOK_PORT"))
    ports = {p["name"]: p["containerPort"] for p in receiver.get("ports", [])}
    if ports.get("http") != port:
        problems.append(
            f"receiver port http is {ports.get('http')}, CHARGE_WORKER_WEBHOOK_PORT {port}"
        )
    problems += probe_problems(receiver, ports)
    if deployment.obj["spec"].get("replicas") != values["replicas"]:
        problems.append(
            f"Deployment/{deployment.name} has replicas {deployment.obj['spec'].get('replicas')}, "
            f"webhooks.replicas is {values['replicas']}"
        )
    problems += _stopping(receiver, spec, values["preStopSleepSeconds"])
    if "CHARGE_WORKER_NATS_CREDS_FILE" in env_of(receiver) or any(
        "secret" in v and v["name"] == "nats-credentials" for v in spec.get("volumes", [])
    ):
        problems.append("the receiver gets the NATS credentials, and never talks to NATS")
    return problems


def _stopping(container: dict[str, Any], spec: dict[str, Any], sleep_s: int) -> list[str]:
    """The preStop sleep as configured, and a grace period that outlasts it."""
    command = (((container.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}).get(
        "command"
    )
    wanted = ["sleep", str(sleep_s)] if sleep_s else None
    problems = []
    if command != wanted:
        problems.append(f"receiver preStop runs {command}, expected {wanted}")
    grace = spec.get("terminationGracePeriodSeconds", 30)  # Kubernetes' default
    if grace <= sleep_s:
        problems.append(
            f"terminationGracePeriodSeconds {grace} leaves no time after the {sleep_s} s "
            "preStop sleep"
        )
    return problems


def check_ingress(rendered: Rendered) -> list[str]:
    """When enabled, one Ingress routing only Exact /webhooks/gateway to the receiver Service."""
    values = rendered.values["webhooks"]
    ingresses = rendered.of_kind("Ingress")
    if not (values["enabled"] and values["ingress"]["enabled"]):
        return [f"Ingress/{m.name} rendered while webhooks.ingress is off" for m in ingresses]
    if len(ingresses) != 1:
        return [f"{len(ingresses)} Ingresses rendered, expected 1"]
    ingress = ingresses[0]
    spec = ingress.obj["spec"]
    where = f"Ingress/{ingress.name}"
    service = rendered.only("Service", "webhooks")
    if service is None:
        return [f"{where}: no receiver Service to route to"]
    service_ports = {p["name"] for p in service.obj["spec"]["ports"]} | {
        p["port"] for p in service.obj["spec"]["ports"]
    }
    problems = (
        [f"{where}: a defaultBackend sends every path in"] if "defaultBackend" in spec else []
    )
    paths = [
        path for rule in spec.get("rules", []) for path in (rule.get("http") or {}).get("paths", [])
    ]
    if not paths:
        problems.append(f"{where}: routes nothing")
    for path in paths:
        if (path.get("path"), path.get("pathType")) != (ROUTE, "Exact"):
            problems.append(
                f"{where}: routes {path.get('pathType')} {path.get('path')}; only Exact {ROUTE} "
                "may reach the receiver (/metrics, /healthz, /readyz share its port)"
            )
        backend = (path.get("backend") or {}).get("service") or {}
        port = backend.get("port") or {}
        if backend.get("name") != service.name or (port.get("name") or port.get("number")) not in (
            service_ports
        ):
            problems.append(f"{where}: {path.get('path')} goes to {backend}, not {service.name}")
    return problems
