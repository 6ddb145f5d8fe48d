"""The workloads' own promises: the worker's probes and drain, the CronJobs, the hook, scaling.

(The receiver's are in `receiver`, how objects select each other in `wiring`.)

Each check takes one rendering and returns its problems as lines (empty: it holds).
"""

from __future__ import annotations

from typing import Any

from deploy.chart import Manifest
from deploy.rendered import COMPONENT, Rendered, env_of, secret_ref


def check_worker(rendered: Rendered) -> list[str]:
    """Probes on the right paths and port, a grace period longer than the drain, `run`."""
    deployment = rendered.only("Deployment", "worker")
    if deployment is None:
        return ["no worker Deployment rendered"]
    spec = deployment.obj["spec"]["template"]["spec"]
    containers = spec["containers"]
    if len(containers) != 1:
        return [f"worker pod has {len(containers)} containers, expected 1"]
    worker = containers[0]
    problems = []
    if (worker.get("args") or [None])[0] != "run":
        problems.append(f"worker args are {worker.get('args')}, expected run first")
    host = rendered.setting("CHARGE_WORKER_HTTP_HOST")
    if host not in {"0.0.0.0", "::"}:  # noqa: S104  # the kubelet probes the pod's IP
        problems.append(f"CHARGE_WORKER_HTTP_HOST {host} is unreachable for probes and scrapes")
    port = int(rendered.setting("CHARGE_WORKER_METRICS_PORT"))
    ports = {p["name"]: p["containerPort"] for p in worker.get("ports", [])}
    if ports.get("http") != port:
        problems.append(
            f"worker port http is {ports.get('http')}, CHARGE_WORKER_METRICS_PORT {port}"
        )
    problems += probe_problems(worker, ports)
    grace = spec.get("terminationGracePeriodSeconds")
    drain = float(rendered.setting("CHARGE_WORKER_DRAIN_S"))
    if grace is None or grace <= drain:
        problems.append(
            f"terminationGracePeriodSeconds {grace} is not longer than "
            f"CHARGE_WORKER_DRAIN_S {drain:g}"
        )
    keda = rendered.values["keda"]["enabled"]
    if keda == ("replicas" in deployment.obj["spec"]):
        problems.append("the Deployment sets replicas while KEDA scales it (or neither does)")
    return problems


# Both long-running commands serve the same two answers: /healthz "is the loop turning?"
# (liveness, and startup when set), /readyz "should this pod get work?".
PROBE_PATHS = {"livenessProbe": "/healthz", "readinessProbe": "/readyz", "startupProbe": "/healthz"}


def probe_problems(container: dict[str, Any], ports: dict[str, int]) -> list[str]:
    """Liveness and readiness (startup optional) on their paths, on a port the container has."""
    who = container["name"]
    problems = []
    for name, path in PROBE_PATHS.items():
        probe = container.get(name)
        if not probe:
            problems += [] if name == "startupProbe" else [f"{who} has no {name}"]
            continue
        get = probe.get("httpGet") or {}
        if get.get("path") != path:
            problems.append(f"{who} {name} probes {get.get('path')}, expected {path}")
        if get.get("port") not in ports and get.get("port") not in ports.values():
            problems.append(
                f"{who} {name} probes port {get.get('port')}, which the container lacks"
            )
    return problems


def check_cronjobs(rendered: Rendered) -> list[str]:
    """produce daily, reconcile every 15 min, `reconcile --full` and maintain daily, never
    overlapping, in a set time zone, each in the pods its NetworkPolicy and secrets are for
    (the full sweep in reconcile's); maintain as the schema owner, talking to PostgreSQL only."""
    reconcile = rendered.values["reconcile"]
    full = {**reconcile, **reconcile["full"]}
    full["enabled"] = reconcile["enabled"] and reconcile["full"]["enabled"]
    jobs = (
        ("produce", rendered.values["produce"], ["produce"], "produce"),
        ("reconcile", reconcile, ["reconcile"], "reconcile"),
        ("reconcile-full", full, ["reconcile", "--full"], "reconcile"),
        ("maintain", rendered.values["maintain"], ["maintain"], "maintain"),
    )
    problems = []
    for component, values, command, pods in jobs:
        cron = rendered.only("CronJob", component)
        if not values["enabled"]:
            if cron is not None:
                problems.append(f"{component} is disabled but its CronJob is rendered")
            continue
        if cron is None:
            problems.append(f"no {component} CronJob rendered")
            continue
        problems += _cronjob(cron, values, command, pods)
        if component == "maintain":
            problems += _maintain(rendered, cron)
    return problems


def _cronjob(cron: Manifest, values: dict[str, Any], command: list[str], pods: str) -> list[str]:
    problems = []
    spec = cron.obj["spec"]
    for field, want in (
        ("concurrencyPolicy", "Forbid"),
        ("schedule", values["schedule"]),
        ("timeZone", values["timeZone"]),
    ):
        if spec.get(field) != want:
            problems.append(
                f"CronJob/{cron.name}: {field} is {spec.get(field)!r}, expected {want!r}"
            )
    template = spec["jobTemplate"]["spec"]["template"]
    pod = template["spec"]
    args = pod["containers"][0].get("args") or []
    if args[: len(command)] != command:
        problems.append(f"CronJob/{cron.name}: args {args} do not start with {command}")
    if pod.get("restartPolicy") not in {"Never", "OnFailure"}:
        problems.append(f"CronJob/{cron.name}: restartPolicy {pod.get('restartPolicy')}")
    # its NetworkPolicy and secrets are chosen by this label
    component = template["metadata"]["labels"].get(COMPONENT)
    if component != pods:
        problems.append(f"CronJob/{cron.name}: its pods are {component!r}, not {pods!r}")
    if command[0] == "reconcile":
        problems += _metrics_file(cron.name, values["metricsFile"], pod, args)
    return problems


def _maintain(rendered: Rendered, cron: Manifest) -> list[str]:
    """maintain makes and drops tables: the schema owner's DSN (the migration hook's), a real
    run (a dry run never makes the partitions ahead), and nothing of NATS."""
    where = f"CronJob/{cron.name}"
    pod = cron.obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    problems = []
    if "--dry-run" in (container.get("args") or []):
        problems.append(f"{where}: --dry-run makes no partition, and writes fail a year later")
    owner = schema_owner(rendered)
    ref = secret_ref(env_of(container).get("DATABASE_URL"))
    if ref != owner:
        problems.append(f"{where}: DATABASE_URL from {ref}, not the schema owner's {owner}")
    nats_volumes = [v["name"] for v in pod.get("volumes", []) if _is_nats_credentials(rendered, v)]
    if "CHARGE_WORKER_NATS_CREDS_FILE" in env_of(container) or nats_volumes:
        problems.append(f"{where}: gets the NATS credentials, and never talks to NATS")
    return problems


def schema_owner(rendered: Rendered) -> tuple[str, str]:
    """(Secret, key) of the schema owner's DSN: the migration hook's, for maintain too."""
    migrate = rendered.values["migrate"]
    secret = migrate["existingSecret"] or rendered.values["secrets"]["existingSecret"]
    return secret, migrate["databaseUrlKey"]


def _is_nats_credentials(rendered: Rendered, volume: dict[str, Any]) -> bool:
    wanted = rendered.values["natsCredentials"]["existingSecret"]
    secret = (volume.get("secret") or {}).get("secretName")
    return volume["name"] == "nats-credentials" or (bool(wanted) and secret == wanted)


def _metrics_file(
    name: str, wanted: dict[str, Any], pod: dict[str, Any], args: list[str]
) -> list[str]:
    """--metrics-file only when enabled, into the node-exporter hostPath mounted there."""
    if "--metrics-file" not in args:
        return (
            [f"CronJob/{name}: metricsFile enabled but no --metrics-file"]
            if wanted["enabled"]
            else []
        )
    if not wanted["enabled"]:
        return [f"CronJob/{name}: --metrics-file given though metricsFile is disabled"]
    target = args[args.index("--metrics-file") + 1]
    directory, _, file_name = target.rpartition("/")
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0].get("volumeMounts", [])}
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    host_path = (volumes.get(mounts.get(directory, "")) or {}).get("hostPath", {}).get("path")
    if host_path != wanted["hostPath"] or file_name != wanted["fileName"]:
        return [
            f"CronJob/{name}: {target} is not {wanted['hostPath']}/{wanted['fileName']} on the node"
        ]
    return []


def check_migrate_hook(rendered: Rendered) -> list[str]:
    """A pre-install/pre-upgrade Job running `migrate` that needs nothing the release creates."""
    values = rendered.values["migrate"]
    jobs = [
        m
        for m in rendered.of_kind("Job")
        if m.obj["metadata"]["labels"].get(COMPONENT) == "migrate"
    ]
    if not values["enabled"]:
        return ["migrate is disabled but its Job is rendered"] if jobs else []
    if len(jobs) != 1:
        return [f"{len(jobs)} migration Jobs rendered, expected 1"]
    job = jobs[0]
    hooks = set(job.obj["metadata"].get("annotations", {}).get("helm.sh/hook", "").split(","))
    problems = []
    if not {"pre-install", "pre-upgrade"} <= hooks:
        problems.append(
            f"Job/{job.name}: hooks {sorted(hooks)}, expected pre-install and pre-upgrade"
        )
    pod = job.obj["spec"]["template"]["spec"]
    container = pod["containers"][0]
    if container.get("args") != ["migrate"]:
        problems.append(f"Job/{job.name}: args {container.get('args')}, expected ['migrate']")
    if container.get("envFrom"):
        problems.append(
            f"Job/{job.name}: envFrom needs objects a first install has not created yet"
        )
    ref = secret_ref(env_of(container).get("DATABASE_URL"))
    if ref != schema_owner(rendered):
        problems.append(
            f"Job/{job.name}: DATABASE_URL from {ref}, expected {schema_owner(rendered)}"
        )
    own_account = [m.name for m in rendered.of_kind("ServiceAccount")]
    if pod.get("serviceAccountName") in own_account:
        problems.append(f"Job/{job.name}: uses the release's ServiceAccount, absent at pre-install")
    return problems


def check_scaling(rendered: Rendered) -> list[str]:
    """max_ack_pending >= pods x concurrency; KEDA's trigger reads the worker's consumer."""
    concurrency = int(rendered.setting("CHARGE_WORKER_CONCURRENCY"))
    max_ack_pending = int(rendered.setting("CHARGE_WORKER_MAX_ACK_PENDING"))
    keda = rendered.values["keda"]
    pods = keda["maxReplicaCount"] if keda["enabled"] else rendered.values["worker"]["replicas"]
    problems = []
    if pods * concurrency > max_ack_pending:
        problems.append(
            f"{pods} pods x concurrency {concurrency} exceed max_ack_pending {max_ack_pending}"
        )
    scaled = rendered.of_kind("ScaledObject")
    if not keda["enabled"]:
        return [*problems, *(["a ScaledObject is rendered with keda off"] if scaled else [])]
    if len(scaled) != 1:
        return [*problems, f"{len(scaled)} ScaledObjects rendered, expected 1"]
    spec = scaled[0].obj["spec"]
    deployment = rendered.only("Deployment", "worker")
    if deployment is None or spec["scaleTargetRef"]["name"] != deployment.name:
        problems.append("the ScaledObject does not target the worker Deployment")
    if spec.get("minReplicaCount", 0) < 1:
        problems.append("KEDA may scale the worker to zero (deferred checks and gauges stop)")
    for trigger in spec["triggers"]:
        metadata = trigger.get("metadata", {})
        if trigger.get("type") != "nats-jetstream":
            problems.append(f"ScaledObject trigger {trigger.get('type')}, expected nats-jetstream")
        not_strings = sorted(k for k, v in metadata.items() if not isinstance(v, str))
        if not_strings:
            problems.append(
                f"ScaledObject trigger metadata not strings (KEDA requires): {not_strings}"
            )
        for key, env in (("stream", "CHARGE_WORKER_STREAM"), ("consumer", "CHARGE_WORKER_DURABLE")):
            if metadata.get(key) != rendered.setting(env):
                problems.append(
                    f"ScaledObject {key} {metadata.get(key)!r} is not "
                    f"{env} {rendered.setting(env)!r}"
                )
    return problems


CHECKSUM = "checksum/config"


def check_config_rollout(rendered: Rendered) -> list[str]:
    """Every Deployment whose containers read the chart's ConfigMap carries `checksum/config`
    on its pod template, one value for all: a changed setting rolls its pods (environment
    variables are read when a container starts). A Job's pods start with each run, and the
    migration hook reads its settings inline: neither needs it. The chart renders no Secret,
    so no annotation can follow one (the chart README, "Secrets and restarts")."""
    config_map = rendered.only("ConfigMap", "worker")
    if config_map is None:
        return ["no settings ConfigMap rendered"]
    problems = []
    seen: dict[str, str] = {}
    for deployment in rendered.of_kind("Deployment"):
        template = deployment.obj["spec"]["template"]
        if not any(_reads(c, config_map.name) for c in template["spec"]["containers"]):
            continue
        value = (template["metadata"].get("annotations") or {}).get(CHECKSUM)
        if value is None:
            problems.append(f"Deployment/{deployment.name}: reads the ConfigMap, no {CHECKSUM}")
        else:
            seen[deployment.name] = value
    if len(set(seen.values())) > 1:
        problems.append(f"{CHECKSUM} differs between Deployments: {seen}")
    return problems


def _reads(container: dict[str, Any], config_map: str) -> bool:
    """The container takes settings from the ConfigMap (envFrom or a configMapKeyRef)."""
    sources = [(s.get("configMapRef") or {}).get("name") for s in container.get("envFrom") or []]
    refs = [
        ((e.get("valueFrom") or {}).get("configMapKeyRef") or {}).get("name")
        for e in container.get("env") or []
    ]
    return config_map in sources + refs
