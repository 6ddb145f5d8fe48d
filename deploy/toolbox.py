"""The on-call's toolbox: the worker's environment in an idle pod, `nats` and `psql` beside it.

Opt-in (`toolbox.enabled`), as the NATS chart's nats-box. Its `toolbox` container is the
worker's image with exactly the worker's environment, mounts included, so charge-worker's
operator commands behave there as in a worker pod; it serves nothing and runs no `run`.
`nats` and `psql` come in containers of their own, from their own images (never the
worker's, which ships charge-worker alone), each given only what its tool uses. No
Service, PodDisruptionBudget or ServiceMonitor selects the pod.

Each check takes one rendering and returns its problems as lines (empty: it holds).
"""

from __future__ import annotations

from typing import Any

from deploy.rendered import COMPONENT, Rendered, env_of, secret_ref

# The tools' containers, by name (also their key under `toolbox`), and the secrets each gets.
TOOLS: dict[str, frozenset[str]] = {
    "nats": frozenset(),
    "psql": frozenset({"DATABASE_URL"}),
}


def image_of(value: dict[str, Any]) -> str:
    """An {repository, tag, digest} value as the image reference (a digest wins)."""
    if value.get("digest"):
        return f"{value['repository']}@{value['digest']}"
    return f"{value['repository']}:{value['tag']}"


def psql_role(rendered: Rendered) -> tuple[str, str]:
    """(Secret, key) of psql's DATABASE_URL: toolbox.psql's, else the worker role's."""
    psql = rendered.values["toolbox"]["psql"]
    secrets = rendered.values["secrets"]
    return (
        psql["existingSecret"] or secrets["existingSecret"],
        psql["databaseUrlKey"] or secrets["databaseUrlKey"],
    )


def nats_credentials_key(rendered: Rendered) -> str:
    """The key of the toolbox's NATS credentials file: its own when set, else the worker's."""
    own: str = rendered.values["toolbox"]["natsCredentialsKey"]
    return own or str(rendered.values["natsCredentials"]["keys"]["worker"])


def check_toolbox(rendered: Rendered) -> list[str]:
    """Off: nothing of it. On: one idle pod, the worker's environment, each tool its own image."""
    values = rendered.values["toolbox"]
    objects = [
        m
        for m in rendered.manifests
        if m.obj["metadata"].get("labels", {}).get(COMPONENT) == "toolbox"
    ]
    if not values["enabled"]:
        return [f"{m.kind}/{m.name} rendered while toolbox.enabled is off" for m in objects]
    deployment = rendered.only("Deployment", "toolbox")
    worker = rendered.only("Deployment", "worker")
    if deployment is None or worker is None:
        return ["no toolbox (or no worker) Deployment rendered"]
    where = f"Deployment/{deployment.name}"
    problems = [
        f"{m.kind}/{m.name} selects the toolbox pod, which serves nothing"
        for m in rendered.manifests
        if m.kind in {"Service", "PodDisruptionBudget", "ServiceMonitor", "ScaledObject"}
        and m.obj["metadata"].get("labels", {}).get(COMPONENT) == "toolbox"
    ]
    if deployment.obj["spec"].get("replicas") != 1:
        problems.append(f"{where}: replicas {deployment.obj['spec'].get('replicas')}, not 1")
    pod = deployment.obj["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    expected = ["toolbox", *(name for name in TOOLS if values[name]["enabled"])]
    if list(containers) != expected:
        return [*problems, f"{where}: containers {list(containers)}, expected {expected}"]
    problems += _same_as_worker(rendered, where, containers["toolbox"], worker.obj)
    chart_image = worker.obj["spec"]["template"]["spec"]["containers"][0]["image"]
    for name in expected[1:]:
        container = containers[name]
        image = image_of(values[name]["image"])
        if container["image"] != image:
            problems.append(f"{where} container {name}: image {container['image']}, not {image}")
        if container["image"] == chart_image:
            problems.append(f"{where} container {name}: the worker's image carries no {name}")
        problems += _idle(where, container)
    if "nats" in containers:
        problems += _nats_env(rendered, where, containers["nats"])
    if "psql" in containers:
        ref = secret_ref(env_of(containers["psql"]).get("DATABASE_URL"))
        if ref != psql_role(rendered):
            problems.append(
                f"{where} container psql: DATABASE_URL from {ref}, not {psql_role(rendered)}"
            )
    return problems


def _same_as_worker(
    rendered: Rendered, where: str, toolbox: dict[str, Any], worker: dict[str, Any]
) -> list[str]:
    """The worker's image, settings, secrets and mounts; idle, serving nothing."""
    theirs = worker["spec"]["template"]["spec"]["containers"][0]
    problems = _idle(f"{where} container toolbox", toolbox)
    if toolbox["image"] != theirs["image"]:
        problems.append(f"{where}: image {toolbox['image']}, not the worker's {theirs['image']}")
    if toolbox.get("envFrom") != theirs.get("envFrom"):
        problems.append(f"{where}: envFrom {toolbox.get('envFrom')}, not the worker's")
    mine, others = env_of(toolbox), env_of(theirs)
    creds = "CHARGE_WORKER_NATS_CREDS_FILE"
    if {k: v for k, v in mine.items() if k != creds} != {
        k: v for k, v in others.items() if k != creds
    }:
        problems.append(f"{where}: its environment is not the worker's")
    if (creds in mine) != (creds in others):
        problems.append(f"{where}: {creds} set in one of the worker and the toolbox only")
    elif creds in mine and mine[creds].get("value") != _creds_path(rendered):
        problems.append(
            f"{where}: {creds} is {mine[creds].get('value')}, not {_creds_path(rendered)}"
        )
    if toolbox.get("volumeMounts") != theirs.get("volumeMounts"):
        problems.append(f"{where}: its mounts are not the worker's")
    return problems


def _idle(where: str, container: dict[str, Any]) -> list[str]:
    """It waits for `kubectl exec`: a command that sleeps, no arguments, no port."""
    problems = []
    command = " ".join(container.get("command") or [])
    if "sleep" not in command or container.get("args"):
        problems.append(f"{where}: runs {command} {container.get('args') or ''}, not an idle sleep")
    if container.get("ports"):
        problems.append(f"{where}: has ports; the toolbox serves nothing")
    return problems


def _creds_path(rendered: Rendered) -> str:
    mount = str(rendered.values["natsCredentials"]["mountPath"]).rstrip("/")
    return f"{mount}/{nats_credentials_key(rendered)}"


def _nats_env(rendered: Rendered, where: str, container: dict[str, Any]) -> list[str]:
    """The nats CLI's own variables point at the worker's servers and the mounted files."""
    env = env_of(container)
    problems = []
    url = ((env.get("NATS_URL") or {}).get("valueFrom") or {}).get("configMapKeyRef") or {}
    if url.get("key") != "NATS_URL":
        problems.append(f"{where} container nats: NATS_URL is not the ConfigMap's")
    wanted = {}
    if rendered.values["natsCredentials"]["existingSecret"]:
        wanted["NATS_CREDS"] = _creds_path(rendered)
    tls = rendered.values["natsTls"]
    if tls["existingSecret"]:
        mount = str(tls["mountPath"]).rstrip("/")
        wanted |= {
            "NATS_CERT": f"{mount}/{tls['certKey']}",
            "NATS_KEY": f"{mount}/{tls['keyKey']}",
            "NATS_CA": f"{mount}/{tls['caKey']}",
        }
    got = {
        name: entry.get("value")
        for name, entry in env.items()
        if name in {"NATS_CREDS", "NATS_CERT", "NATS_KEY", "NATS_CA"}
    }
    if got != wanted:
        problems.append(f"{where} container nats: {got}, expected {wanted}")
    return problems
