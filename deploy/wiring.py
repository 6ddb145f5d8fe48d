"""How the objects find each other: by label selectors, and by port names.

Two Deployments run side by side (the worker and the webhook receiver), each with its own
Service, PodDisruptionBudget and ServiceMonitor. A selector that matched both would send the
receiver's scrapes to worker pods, or let a node drain evict the wrong pods, without any
error: so each selector must match exactly its own workload's pods (or Service).
"""

from __future__ import annotations

from typing import Any

from deploy.rendered import COMPONENT, Rendered

# The Deployments with a Service, a PodDisruptionBudget and a ServiceMonitor, by component
# (also their key in the values).
WORKLOADS = ("worker", "webhooks")


def check_wiring(rendered: Rendered) -> list[str]:
    """Each Deployment, Service, PDB and ServiceMonitor selects exactly its own workload."""
    values = rendered.values
    problems = []
    for component in WORKLOADS:
        deployment = rendered.only("Deployment", component)
        enabled = values[component].get("enabled", True)
        if deployment is None:
            problems += [f"no {component} Deployment rendered"] if enabled else []
            continue
        problems += [] if enabled else [f"{component} is disabled but its Deployment is rendered"]
        problems += _deployment(rendered, component, deployment.obj)
    own = {*WORKLOADS}
    for kind in ("Service", "PodDisruptionBudget", "ServiceMonitor"):
        problems += [
            f"{m.kind}/{m.name}: belongs to no workload (component {_component(m.obj)!r})"
            for m in rendered.of_kind(kind)
            if _component(m.obj) not in own
        ]
    return problems


def _deployment(rendered: Rendered, component: str, deployment: dict[str, Any]) -> list[str]:
    selector = deployment["spec"]["selector"]["matchLabels"]
    problems = _selects_only(rendered, f"Deployment/{_name(deployment)}", selector, component)
    service = rendered.only("Service", component)
    if service is None:
        return [*problems, f"no {component} Service rendered"]
    where = f"Service/{service.name}"
    problems += _selects_only(rendered, where, service.obj["spec"]["selector"], component)
    container_ports = {
        p["name"] for c in deployment["spec"]["template"]["spec"]["containers"] for p in c["ports"]
    }
    service_ports = {p["name"]: p["targetPort"] for p in service.obj["spec"]["ports"]}
    if not set(service_ports.values()) <= container_ports:
        problems.append(f"{where} targets ports {service_ports} the {component} pods lack")
    budget = rendered.only("PodDisruptionBudget", component)
    if rendered.values[component]["podDisruptionBudget"]["enabled"] != (budget is not None):
        problems.append(f"the {component} PodDisruptionBudget does not follow its enabled flag")
    if budget is not None and budget.obj["spec"]["selector"].get("matchLabels") != selector:
        problems.append(f"PodDisruptionBudget/{budget.name} selects other pods than its Deployment")
    return problems + _monitor(rendered, component, service.obj, service_ports)


def _monitor(
    rendered: Rendered, component: str, service: dict[str, Any], ports: dict[str, Any]
) -> list[str]:
    monitor = rendered.only("ServiceMonitor", component)
    if rendered.values["metrics"]["serviceMonitor"]["enabled"] != (monitor is not None):
        return [f"the {component} ServiceMonitor does not follow metrics.serviceMonitor.enabled"]
    if monitor is None:
        return []
    spec = monitor.obj["spec"]
    selected = [
        s.name
        for s in rendered.of_kind("Service")
        if _selects(spec["selector"]["matchLabels"], s.obj["metadata"]["labels"])
    ]
    problems = []
    if selected != [_name(service)]:
        problems.append(
            f"ServiceMonitor/{monitor.name} selects Services {selected}, "
            f"expected only {_name(service)}"
        )
    problems += [
        f"ServiceMonitor/{monitor.name}: endpoint {endpoint} is not the Service's /metrics"
        for endpoint in spec["endpoints"]
        if endpoint.get("port") not in ports or endpoint.get("path") != "/metrics"
    ]
    return problems


def _selects_only(
    rendered: Rendered, where: str, selector: dict[str, str], component: str
) -> list[str]:
    selected = {pod.component for pod in rendered.pods() if _selects(selector, pod.labels)}
    if component not in selected:
        return [f"{where} does not select the {component} pods"]
    if selected != {component}:
        others = ", ".join(sorted(selected - {component}))
        return [f"{where} also selects the pods of {others}, not only {component}"]
    return []


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _component(obj: dict[str, Any]) -> str | None:
    component: str | None = obj["metadata"].get("labels", {}).get(COMPONENT)
    return component


def _name(obj: dict[str, Any]) -> str:
    return str(obj["metadata"]["name"])
