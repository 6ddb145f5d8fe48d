"""One rendering of the chart, and the ways the checks look into it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from deploy import catalog
from deploy.chart import Manifest

COMPONENT = "app.kubernetes.io/component"


@dataclass(frozen=True)
class Pod:
    """A pod template inside a workload: the Deployment, a CronJob, the migration Job."""

    owner: Manifest
    component: str
    spec: dict[str, Any]
    labels: dict[str, str]

    @property
    def where(self) -> str:
        return f"{self.owner.kind}/{self.owner.name}"

    @property
    def containers(self) -> list[dict[str, Any]]:
        return [*self.spec.get("initContainers", []), *self.spec.get("containers", [])]


@dataclass(frozen=True)
class Rendered:
    """The objects rendered for one value set, with the values Helm coalesced for it."""

    manifests: list[Manifest]
    values: dict[str, Any]

    def of_kind(self, kind: str) -> list[Manifest]:
        return [m for m in self.manifests if m.kind == kind]

    def only(self, kind: str, component: str | None = None) -> Manifest | None:
        """The one object of `kind` (and component), None when absent; two is an error."""
        found = [
            m
            for m in self.of_kind(kind)
            if component is None or m.obj["metadata"].get("labels", {}).get(COMPONENT) == component
        ]
        if len(found) > 1:
            raise AssertionError(f"{len(found)} {kind} objects for component {component}")
        return found[0] if found else None

    def pods(self) -> Iterator[Pod]:
        for manifest in self.manifests:
            template = _pod_template(manifest)
            if template is not None:
                labels = template.get("metadata", {}).get("labels", {})
                yield Pod(manifest, labels.get(COMPONENT, "?"), template["spec"], labels)

    @property
    def settings(self) -> dict[str, str]:
        """The settings the pods get from the ConfigMap, as their environment has them."""
        config = self.only("ConfigMap", "worker")
        return dict(config.obj.get("data") or {}) if config else {}

    def setting(self, env: str) -> str:
        """A setting as the pods see it: the ConfigMap's, else charge-worker's default."""
        if env in self.settings:
            return self.settings[env]
        return str(catalog.default(env))


def _pod_template(manifest: Manifest) -> dict[str, Any] | None:
    spec = manifest.obj.get("spec", {})
    if manifest.kind in {"Deployment", "Job", "StatefulSet", "DaemonSet"}:
        template: dict[str, Any] = spec["template"]
        return template
    if manifest.kind == "CronJob":
        cron_template: dict[str, Any] = spec["jobTemplate"]["spec"]["template"]
        return cron_template
    return None


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A container's `env` entries by name."""
    return {entry["name"]: entry for entry in container.get("env") or []}


def secret_ref(entry: dict[str, Any] | None) -> tuple[str, str] | None:
    """(Secret name, key) when an env entry takes its value from a Secret."""
    ref = ((entry or {}).get("valueFrom") or {}).get("secretKeyRef")
    return (ref["name"], ref["key"]) if ref else None
