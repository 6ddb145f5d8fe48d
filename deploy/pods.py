"""What every pod must be: unprivileged, bounded, and given secrets only by reference.

Each check takes one rendering and returns its problems as lines (empty: it holds).
"""

from __future__ import annotations

from typing import Any

from deploy import catalog
from deploy.rendered import Pod, Rendered, env_of, secret_ref

# Which secrets each component gets, and no others (least privilege: produce never sees the
# gateway key, the migration hook gets the schema owner's DSN under DATABASE_URL).
SECRETS_OF = {
    "worker": {"DATABASE_URL", "GATEWAY_API_KEY"},
    "produce": {"DATABASE_URL"},
    "reconcile": {"DATABASE_URL", "GATEWAY_API_KEY"},
    "migrate": {"DATABASE_URL"},
}


def check_security(rendered: Rendered) -> list[str]:
    """runAsNonRoot, no escalation, read-only root, no capabilities, a writable /tmp."""
    problems = []
    for pod in rendered.pods():
        context = pod.spec.get("securityContext") or {}
        if context.get("runAsNonRoot") is not True:
            problems.append(f"{pod.where}: pod securityContext.runAsNonRoot is not true")
        if context.get("runAsUser") in (None, 0):
            problems.append(f"{pod.where}: pod securityContext.runAsUser must be a non-zero UID")
        if pod.spec.get("automountServiceAccountToken") is not False:
            problems.append(f"{pod.where}: the service account token is mounted")
        for field in ("hostNetwork", "hostPID", "hostIPC"):
            if pod.spec.get(field):
                problems.append(f"{pod.where}: {field} is on")
        tmp_volumes = {v["name"] for v in pod.spec.get("volumes", []) if "emptyDir" in v}
        for container in pod.containers:
            problems += _container_security(pod, container, tmp_volumes)
    return problems


def _container_security(pod: Pod, container: dict[str, Any], tmp_volumes: set[str]) -> list[str]:
    where = f"{pod.where} container {container['name']}"
    context = container.get("securityContext") or {}
    problems = []
    if context.get("allowPrivilegeEscalation") is not False:
        problems.append(f"{where}: allowPrivilegeEscalation is not false")
    if context.get("readOnlyRootFilesystem") is not True:
        problems.append(f"{where}: readOnlyRootFilesystem is not true")
    if context.get("privileged"):
        problems.append(f"{where}: privileged")
    if context.get("runAsUser") == 0 or context.get("runAsNonRoot") is False:
        problems.append(f"{where}: may run as root")
    capabilities = context.get("capabilities") or {}
    if "ALL" not in (capabilities.get("drop") or []):
        problems.append(f"{where}: capabilities.drop lacks ALL")
    if capabilities.get("add"):
        problems.append(f"{where}: adds capabilities {capabilities['add']}")
    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts") or []}
    if mounts.get("/tmp") not in tmp_volumes:  # noqa: S108  # a path in a manifest, not a file
        problems.append(f"{where}: /tmp is not a writable emptyDir (the root fs is read-only)")
    return problems


def check_resources(rendered: Rendered) -> list[str]:
    """Every container requests and is limited in CPU and memory."""
    problems = []
    for pod in rendered.pods():
        for container in pod.containers:
            resources = container.get("resources") or {}
            for kind in ("requests", "limits"):
                missing = {"cpu", "memory"} - set(resources.get(kind) or {})
                if missing:
                    names = ", ".join(sorted(missing))
                    problems.append(
                        f"{pod.where} container {container['name']}: no {kind} for {names}"
                    )
    return problems


def check_secrets(rendered: Rendered) -> list[str]:
    """Secrets come from existing Secrets by reference: never a value, never a Secret object."""
    problems = [
        f"Secret/{m.name}: the chart must not create Secrets" for m in rendered.of_kind("Secret")
    ]
    secret_names = catalog.secrets()
    for key in sorted(secret_names & set(rendered.settings)):
        problems.append(f"ConfigMap: holds the secret setting {key}")
    existing = rendered.values["secrets"]["existingSecret"]
    for pod in rendered.pods():
        wanted = SECRETS_OF.get(pod.component)
        if wanted is None:
            problems.append(f"{pod.where}: unknown component {pod.component!r}")
            continue
        for container in pod.containers:
            where = f"{pod.where} container {container['name']}"
            env = env_of(container)
            for name in sorted(secret_names & set(env)):
                if secret_ref(env[name]) is None:
                    problems.append(f"{where}: {name} is not taken from a Secret (secretKeyRef)")
            given = secret_names & set(env)
            if given != wanted:
                problems.append(
                    f"{where}: gets secrets {sorted(given)}, should get {sorted(wanted)}"
                )
            for entry in env.values():
                ref = secret_ref(entry)
                if ref and pod.component != "migrate" and ref[0] != existing:
                    problems.append(
                        f"{where}: {entry['name']} from Secret {ref[0]}, not {existing}"
                    )
    return problems


def check_settings(rendered: Rendered) -> list[str]:
    """The ConfigMap names only known settings, and charge-worker accepts the result.

    The pods' environment (ConfigMap, the chart-managed variables, placeholder secrets) goes
    through charge-worker's own `load_settings()`, so a value its validators or cross-field
    rules refuse fails here rather than in a crash-looping pod.
    """
    known = catalog.configurable()
    problems = [
        f"ConfigMap: {key} is not a charge-worker setting (or may not be set there)"
        for key in sorted(set(rendered.settings) - known)
    ]
    worker = next((p for p in rendered.pods() if p.component == "worker"), None)
    if worker is None:
        return [*problems, "no worker pod rendered"]
    environment = dict(rendered.settings)
    for name, entry in env_of(worker.containers[0]).items():
        if "value" in entry:
            environment[name] = str(entry["value"])
        elif secret_ref(entry):
            environment[name] = f"placeholder-for-{name.lower()}"
    why = catalog.charge_worker_accepts(environment)
    if why is not None:
        problems.append(f"charge-worker refuses the rendered settings: {why}")
    return problems
