"""What every pod must be: unprivileged, bounded, and given secrets only by reference.

Each check takes one rendering and returns its problems as lines (empty: it holds).
"""

from __future__ import annotations

from typing import Any

from deploy import catalog, toolbox
from deploy.rendered import Pod, Rendered, env_of, secret_ref
from deploy.workloads import schema_owner

# Which secrets each component gets, and no others (least privilege: produce never sees the
# gateway key, only the receiver sees the webhook signing secrets, the migration hook and
# maintain get the schema owner's DSN under DATABASE_URL). The receiver's come from a Secret
# of its own (webhooks.secrets): its own role and read-only key, never the worker's.
SECRETS_OF = {
    "worker": {"DATABASE_URL", "GATEWAY_API_KEY"},
    "webhooks": {"DATABASE_URL", "GATEWAY_API_KEY", "CHARGE_WORKER_WEBHOOK_SECRETS"},
    "produce": {"DATABASE_URL"},
    "reconcile": {"DATABASE_URL", "GATEWAY_API_KEY"},
    "migrate": {"DATABASE_URL"},
    "maintain": {"DATABASE_URL"},
    "toolbox": {"DATABASE_URL", "GATEWAY_API_KEY"},
}
# The components that make and drop tables: their DATABASE_URL is the schema owner's (the
# migration hook's Secret and key); every other pod's is the worker's least-privilege role.
SCHEMA_OWNER = frozenset({"migrate", "maintain"})
# What each command refuses to start without (its `require(...)` calls, and the receiver's
# "no secret, no start"): the pod's environment must set every one, by value or reference.
NEEDS = {
    "worker": {"NATS_URL", "DATABASE_URL", "GATEWAY_URL", "GATEWAY_API_KEY", "SCORING_URL"},
    "webhooks": {"DATABASE_URL", "GATEWAY_URL", "GATEWAY_API_KEY", "CHARGE_WORKER_WEBHOOK_SECRETS"},
    "produce": {"NATS_URL", "DATABASE_URL"},
    "reconcile": {"NATS_URL", "DATABASE_URL", "GATEWAY_URL", "GATEWAY_API_KEY"},
    "migrate": {"DATABASE_URL"},
    "maintain": {"DATABASE_URL"},
    "toolbox": {"NATS_URL", "DATABASE_URL", "GATEWAY_URL", "GATEWAY_API_KEY"},
}


def _tool(pod: Pod, container: dict[str, Any]) -> bool:
    """A container of the toolbox pod that runs a tool (nats, psql), not charge-worker."""
    return pod.component == "toolbox" and container["name"] in toolbox.TOOLS


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
    own = rendered.values["webhooks"]["secrets"]
    roles = {
        "the schema owner": schema_owner(rendered),
        "the worker role": (existing, rendered.values["secrets"]["databaseUrlKey"]),
        "the receiver's role": (own["existingSecret"], own["databaseUrlKey"]),
        "psql's role": toolbox.psql_role(rendered),
    }
    if own["existingSecret"] == existing:
        problems.append(f"webhooks.secrets.existingSecret is the worker's Secret {existing}")
    for pod in rendered.pods():
        if pod.component not in SECRETS_OF:
            problems.append(f"{pod.where}: unknown component {pod.component!r}")
            continue
        for container in pod.containers:
            tool = _tool(pod, container)
            wanted = set(toolbox.TOOLS[container["name"]]) if tool else SECRETS_OF[pod.component]
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
            secret = own["existingSecret"] if pod.component == "webhooks" else existing
            secret = toolbox.psql_role(rendered)[0] if tool else secret
            for entry in env.values():
                ref = secret_ref(entry)
                if ref and pod.component not in SCHEMA_OWNER and ref[0] != secret:
                    problems.append(f"{where}: {entry['name']} from Secret {ref[0]}, not {secret}")
            role = (
                "the schema owner"
                if pod.component in SCHEMA_OWNER
                else "the receiver's role"
                if pod.component == "webhooks"
                else "psql's role"
                if tool
                else "the worker role"
            )
            database = secret_ref(env.get("DATABASE_URL"))
            if database is not None and database != roles[role]:
                problems.append(
                    f"{where}: DATABASE_URL from {database}, not {role}'s {roles[role]}"
                )
    return problems


def check_settings(rendered: Rendered) -> list[str]:
    """Every container's environment names only known settings, has what its command needs,
    and charge-worker accepts it.

    A container's environment is what the pod would see: the ConfigMap (envFrom), its own
    `env` values, and placeholders for secret references. It goes through charge-worker's
    own `load_settings()`, so a value its validators or cross-field rules refuse fails here
    rather than in a crash-looping pod.
    """
    known = catalog.configurable()
    problems = [
        f"ConfigMap: {key} is not a charge-worker setting (or may not be set there)"
        for key in sorted(set(rendered.settings) - known)
    ]
    environments: dict[str, dict[str, str]] = {}
    for pod in rendered.pods():
        for container in pod.containers:
            where = f"{pod.where} container {container['name']}"
            environments[where] = environment = _environment(rendered, container)
            problems += _unknown_names(where, container)
            needs = set() if _tool(pod, container) else NEEDS.get(pod.component, set())
            missing = needs - {k for k, v in environment.items() if v}
            if missing:
                problems.append(f"{where}: lacks {sorted(missing)}, which {pod.component} needs")
    if not any(p.component == "worker" for p in rendered.pods()):
        problems.append("no worker pod rendered")
    refused: dict[str, list[str]] = {}
    verdicts = catalog.charge_worker_accepts(list(environments.values()))
    for where, why in zip(environments, verdicts, strict=True):
        if why is not None:
            refused.setdefault(why, []).append(where)
    problems += [
        f"charge-worker refuses the rendered settings of {', '.join(wheres)}: {why}"
        for why, wheres in refused.items()
    ]
    return problems


def _environment(rendered: Rendered, container: dict[str, Any]) -> dict[str, str]:
    config_map = rendered.only("ConfigMap", "worker")
    sources = {
        (source.get("configMapRef") or {}).get("name") for source in container.get("envFrom") or []
    }
    environment = dict(rendered.settings) if config_map and config_map.name in sources else {}
    for name, entry in env_of(container).items():
        if "value" in entry:
            environment[name] = str(entry["value"])
        elif secret_ref(entry):
            environment[name] = f"placeholder-for-{name.lower()}"
    return environment


def _unknown_names(where: str, container: dict[str, Any]) -> list[str]:
    """charge-worker's own prefix on a name it does not know (a typo), or a test-only one."""
    names = set(env_of(container))
    unknown = {n for n in names if catalog.has_our_prefix(n)} - set(catalog.settings())
    return [f"{where}: {name} is not a charge-worker setting" for name in sorted(unknown)] + [
        f"{where}: {name} is for tests only" for name in sorted(names & catalog.TEST_ONLY)
    ]


# The components that talk to NATS, each as a user of its own (docs/nats-permissions.md):
# the key of natsCredentials.keys each mounts.
NATS_USERS = frozenset({"worker", "produce", "reconcile"})


def _nats_key(rendered: Rendered, component: str) -> str | None:
    """The credentials file a component's pods mount: its own; the toolbox's
    toolbox.natsCredentialsKey, else the worker's; None for those that never talk to NATS."""
    if component == "toolbox":
        return toolbox.nats_credentials_key(rendered)
    if component in NATS_USERS:
        return str(rendered.values["natsCredentials"]["keys"][component])
    return None


def check_nats_credentials(rendered: Rendered) -> list[str]:
    """Each component talking to NATS mounts its own credentials file and no other's, and
    points CHARGE_WORKER_NATS_CREDS_FILE at it; the others mount none."""
    nats = rendered.values["natsCredentials"]
    problems = []
    keys = nats.get("keys") or {}
    if nats["existingSecret"] and len(set(keys.values())) != len(NATS_USERS):
        problems.append(f"natsCredentials.keys must name {len(NATS_USERS)} distinct files")
    for pod in rendered.pods():
        mounted = [
            item["key"]
            for volume in pod.spec.get("volumes", [])
            if volume["name"] == "nats-credentials"
            for item in (volume.get("secret") or {}).get("items") or []
        ]
        key = _nats_key(rendered, pod.component)
        wanted = [key] if nats["existingSecret"] and key else []
        if mounted != wanted:
            problems.append(f"{pod.where}: mounts NATS credentials {mounted}, not {wanted}")
        for container in pod.containers:
            path = (env_of(container).get("CHARGE_WORKER_NATS_CREDS_FILE") or {}).get("value")
            expected = (
                f"{nats['mountPath'].rstrip('/')}/{wanted[0]}"
                if wanted and not _tool(pod, container)
                else None
            )
            if path != expected:
                problems.append(
                    f"{pod.where} container {container['name']}: "
                    f"CHARGE_WORKER_NATS_CREDS_FILE is {path!r}, not {expected!r}"
                )
    return problems
