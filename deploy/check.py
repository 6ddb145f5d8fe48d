"""`python -m deploy.check`: render, lint and validate the chart, lint the Dockerfile.

For each value set (the chart's defaults plus the four required values, and
`deploy/values-all-on.yaml`) it prints the rendered objects, then one line per check. It
also renders configurations the chart must refuse, and checks the one-source links and the
image. Exit status 0 when everything holds, 1 otherwise. `make check-deploy` runs it.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deploy import (
    chart,
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
from deploy.chart import DEPLOY, ROOT, Manifest, RenderError
from deploy.rendered import Rendered

Check = Callable[[Rendered], list[str]]

RENDERED_CHECKS: list[tuple[str, Check]] = [
    (
        "worker: run, probes /healthz /readyz on the metrics port, grace > drain",
        workloads.check_worker,
    ),
    (
        "webhooks: `webhooks`, probes /healthz /readyz on the webhook port, preStop < grace",
        receiver.check_webhooks,
    ),
    (
        "ingress: only Exact /webhooks/gateway, to the receiver, when enabled",
        receiver.check_ingress,
    ),
    ("pods: non-root, no escalation, read-only root, caps dropped, /tmp", pods.check_security),
    ("pods: cpu and memory requests and limits", pods.check_resources),
    ("secrets: by reference only, each component its own", pods.check_secrets),
    (
        "nats: each component its own credentials file (docs/nats-permissions.md), no other's",
        pods.check_nats_credentials,
    ),
    (
        "settings: known names, each command's needs, accepted by load_settings(), every container",
        pods.check_settings,
    ),
    (
        "cronjobs: produce, reconcile, reconcile --full and maintain, Forbid, schedule, time zone",
        workloads.check_cronjobs,
    ),
    (
        "migrate: pre-install/pre-upgrade hook, needs nothing the release creates",
        workloads.check_migrate_hook,
    ),
    (
        "wiring: each Deployment, Service, PDB, ServiceMonitor selects only its own workload",
        wiring.check_wiring,
    ),
    (
        "restarts: every Deployment reading the ConfigMap rolls on its change (checksum/config)",
        workloads.check_config_rollout,
    ),
    (
        "toolbox: opt-in, idle, the worker's environment; nats and psql from their own images",
        toolbox.check_toolbox,
    ),
    ("scaling: pods x concurrency <= max_ack_pending, KEDA trigger", workloads.check_scaling),
    (
        "network: one NetworkPolicy per component, in and out only what its command needs",
        network.check_network_policy,
    ),
    ("PrometheusRule == config/alerts.yml less excluded groups", sources.check_alert_rules),
    (
        "dashboard ConfigMap == config/grafana-dashboard.json, sidecar label",
        sources.check_dashboard,
    ),
]


@dataclass(frozen=True)
class Refusal:
    """A configuration the chart must refuse to render, and what the refusal must say."""

    what: str
    overrides: dict[str, Any]
    says: str
    base: list[Path] = field(default_factory=lambda: [DEPLOY / "values-required.yaml"])


REFUSALS = [
    Refusal("the bare chart defaults (no servers, no Secret name)", {}, "is required", base=[]),
    Refusal(
        "the receiver without a Secret of its own",
        {"webhooks": {"secrets": {"existingSecret": ""}}},
        "webhooks.secrets.existingSecret is required",
    ),
    Refusal(
        "the receiver sharing the worker's Secret",
        {"webhooks": {"secrets": {"existingSecret": "charge-worker"}}},
        "must be another Secret than secrets.existingSecret",
    ),
    Refusal(
        "a grace period not longer than the drain",
        {"worker": {"terminationGracePeriodSeconds": 20}},
        "must be longer than CHARGE_WORKER_DRAIN_S",
    ),
    Refusal(
        "pods x concurrency above max_ack_pending",
        {"worker": {"replicas": 80}},
        "CHARGE_WORKER_MAX_ACK_PENDING (1000) must be at least",
    ),
    Refusal(
        "a runbook base with an anchor",
        {"metrics": {"prometheusRule": {"runbookBaseUrl": "https://wiki.example.com/rb#x"}}},
        "runbookBaseUrl",
    ),
    Refusal(
        "an excluded alert group that does not exist",
        {"metrics": {"prometheusRule": {"excludeGroups": ["nope"]}}},
        '"nope"',
    ),
    Refusal(
        "a secret among the settings",
        {"config": {"DATABASE_URL": "postgresql://u:p@db/b"}},
        "DATABASE_URL",
    ),
    Refusal(
        "the webhook signing secrets among the settings",
        {"config": {"CHARGE_WORKER_WEBHOOK_SECRETS": "whsec_c2VjcmV0"}},
        "CHARGE_WORKER_WEBHOOK_SECRETS",
    ),
    Refusal(
        "a secret as a plain extraEnv value",
        {"extraEnv": [{"name": "CHARGE_WORKER_WEBHOOK_SECRETS", "value": "whsec_c2VjcmV0"}]},
        "/extraEnv/0/value",
    ),
    Refusal(
        "the webhook Ingress without the receiver",
        {"webhooks": {"enabled": False, "ingress": {"enabled": True}}},
        "webhooks.ingress.enabled needs webhooks.enabled",
    ),
    Refusal(
        "a receiver grace period not longer than its preStop sleep",
        {"webhooks": {"terminationGracePeriodSeconds": 5, "preStopSleepSeconds": 5}},
        "must be longer than webhooks.preStopSleepSeconds",
    ),
    Refusal(
        "Ingress TLS without a host",
        {"webhooks": {"ingress": {"enabled": True, "tlsSecretName": "webhooks-tls"}}},
        "needs webhooks.ingress.host",
    ),
    Refusal(
        "a misspelt setting",
        {"config": {"CHARGE_WORKER_CONCURENCY": 8}},
        "CHARGE_WORKER_CONCURENCY",
    ),
    Refusal(
        "fault injection in a deployment",
        {"config": {"CHARGE_WORKER_FAILPOINTS": "x:exit"}},
        "CHARGE_WORKER_FAILPOINTS",
    ),
    Refusal(
        "PostgreSQL verified without the CA to verify it by",
        {"postgresTls": {"existingSecret": ""}},
        "postgresTls.existingSecret is required with postgresTls.sslMode verify-full",
    ),
    Refusal(
        "a writable root filesystem",
        {"securityContext": {"readOnlyRootFilesystem": False}},
        "readOnlyRootFilesystem",
    ),
    Refusal(
        "KEDA without the NATS monitoring endpoint",
        {"keda": {"enabled": True}},
        "natsServerMonitoringEndpoint",
    ),
    Refusal(
        "a NetworkPolicy that cuts the pods off from a NATS server",
        {"config": {"NATS_URL": "nats://nats-0.nats:4222,nats://nats-1.nats:4223"}},
        "networkPolicy.egress.nats.ports [4222] lack port 4223 of NATS_URL",
    ),
    Refusal(
        "a NetworkPolicy egress target without ports",
        {"networkPolicy": {"egress": {"postgresql": {"ports": []}}}},
        "/networkPolicy/egress/postgresql/ports",
    ),
    Refusal(
        "maintain in dry-run (it would never make the partitions ahead)",
        {"maintain": {"extraArgs": ["--json", "--dry-run"]}},
        "maintain.extraArgs must not hold --dry-run",
    ),
    Refusal(
        "a toolbox image with neither a tag nor a digest",
        {"toolbox": {"enabled": True, "nats": {"image": {"tag": ""}}}},
        "/toolbox/nats/image",
    ),
    Refusal(
        "KEDA scaling to zero",
        {"keda": {"enabled": True, "minReplicaCount": 0, "natsServerMonitoringEndpoint": "n:8222"}},
        "minReplicaCount",
    ),
]

# The chart's own copies of settings unset: its templates then fall back to numbers of their
# own, which must be charge-worker's defaults (the checks compare with settings.py).
UNSET_SETTINGS: dict[str, Any] = {
    "config": dict.fromkeys(
        [
            "CHARGE_WORKER_CONCURRENCY",
            "CHARGE_WORKER_MAX_ACK_PENDING",
            "CHARGE_WORKER_DRAIN_S",
            "CHARGE_WORKER_METRICS_PORT",
            "CHARGE_WORKER_WEBHOOK_PORT",
        ]
    )
}
# Variants of the "defaults" value set, rendered and checked like it.
VARIANTS: dict[str, dict[str, Any]] = {
    "the chart's copies of settings unset": UNSET_SETTINGS,
    "the webhook receiver off": {"webhooks": {"enabled": False}},
    "the NetworkPolicies off": {"networkPolicy": {"enabled": False}},
    "the toolbox on": {"toolbox": {"enabled": True}},
    "the runbook elsewhere, extra alert labels": {
        "metrics": {
            "prometheusRule": {
                "runbookBaseUrl": "https://wiki.example.com/billing/charge-worker-runbook",
                "additionalLabels": {"team": "billing", "severity": "ignored"},
            }
        }
    },
    "the alerts not scoped to the namespace": {
        "metrics": {"prometheusRule": {"scopeToNamespace": False}}
    },
}


class Report:
    """Prints one line per check and remembers whether any failed."""

    def __init__(self) -> None:
        self.failed = 0
        self.passed = 0

    def check(self, what: str, problems: list[str]) -> None:
        if problems:
            self.failed += 1
            print(f"  FAIL {what}")
            for problem in problems:
                print(f"       - {problem}")
        else:
            self.passed += 1
            print(f"  ok   {what}")


def resource_table(manifests: list[Manifest]) -> Iterator[str]:
    """One line per object: kind/name, [namespace when set], template, hook."""
    rows = []
    for m in manifests:
        namespace = m.obj["metadata"].get("namespace")
        name = f"{m.kind}/{m.name}" + (f" (namespace {namespace})" if namespace else "")
        hook = (
            f"  helm hook {m.obj['metadata']['annotations']['helm.sh/hook']}" if m.is_hook else ""
        )
        rows.append((name, m.template.removeprefix("charge-worker/") + hook))
    width = max(len(name) for name, _ in rows)
    for name, where in rows:
        yield f"    {name:<{width}}  {where}"


def check_value_set(report: Report, label: str, files: list[Path], variant: str = "") -> None:
    values = chart.load_values(files)
    if variant:
        chart.merge(values, copy.deepcopy(VARIANTS[variant]))
    shown = ", ".join(str(path.relative_to(ROOT)) for path in files) or "(none)"
    print(f"\n== {label}: chart defaults + {shown}" + (f" + {variant}" if variant else ""))
    try:
        manifests = chart.render(values)
    except RenderError as error:
        report.check("render", [str(error)])
        return
    print(f"  rendered {len(manifests)} objects:")
    for line in resource_table(manifests):
        print(line)
    versions = validate.kube_versions()
    lint_problems: list[str] = []
    notes: set[str] = set()
    for version in versions:
        linted = chart.lint(values, version)
        lint_problems += [f"(kube {version}) {p}" for p in linted.problems]
        notes.update(linted.notes)
    info = f" (info: {'; '.join(sorted(notes))})" if notes else ""
    report.check(f"helm lint --strict, kube {' and '.join(versions)}{info}", lint_problems)
    schema_problems = [p for m in manifests for p in validate.validate(m, versions)]
    report.check(
        f"schemas: kubernetes-validate --strict {' and '.join(versions)}; CRDs deploy/schemas/",
        schema_problems,
    )
    rendered = Rendered(manifests, chart.coalesced(values))
    for what, check in RENDERED_CHECKS:
        try:
            problems = check(rendered)
        except (KeyError, IndexError, TypeError, AssertionError) as error:
            problems = [f"the rendered objects are not shaped as expected: {error!r}"]
        report.check(what, problems)


def check_refusals(report: Report) -> None:
    print("\n== configurations the chart must refuse")
    for refusal in REFUSALS:
        values = chart.load_values(refusal.base)
        chart.merge(values, refusal.overrides)
        try:
            chart.render(values)
        except RenderError as error:
            message = " ".join(str(error).split())
            ok = refusal.says in message
            report.check(
                f"refuses {refusal.what}",
                [] if ok else [f"refused, but not saying {refusal.says!r}: {message}"],
            )
        else:
            report.check(f"refuses {refusal.what}", ["rendered without complaint"])


def check_sources(report: Report) -> None:
    print("\n== one source of truth")
    report.check("helm/charge-worker/files/* are symlinks to config/*", sources.check_links())
    report.check(
        "helm package: the archive carries the linked files, renders the same",
        chart.check_package(chart.load_values(chart.VALUE_SETS["all-on"])),
    )
    report.check(
        "values.schema.json config == charge_worker.settings (less secrets); extraEnv secrets",
        sources.check_settings_schema(),
    )
    report.check("values.schema.json is a valid JSON Schema", validate.check_values_schema())
    report.check("values.yaml: every key has a comment", sources.check_values_documented())
    report.check("chart README: the values table covers values.yaml", sources.check_chart_readme())
    report.check(
        "values.yaml: no secret defaults, settings == charge-worker's defaults",
        sources.check_chart_defaults(chart.chart_defaults()),
    )
    report.check(
        "Chart.yaml appVersion == pyproject version", sources.check_versions(chart.chart_metadata())
    )


def check_image(report: Report, *, wheel: bool) -> None:
    print(f"\n== Dockerfile ({dockerfile.hadolint_version()})")
    report.check("hadolint, failure threshold style", dockerfile.hadolint())
    report.check(
        "structure: multi-stage, pinned slim base, locked with hashes, no extras, tini, non-root",
        dockerfile.check_structure(dockerfile.DOCKERFILE.read_text()),
    )
    report.check(
        ".dockerignore is an allow-list",
        dockerfile.check_dockerignore(dockerfile.DOCKERIGNORE.read_text()),
    )
    if wheel:
        report.check("the wheel carries migrations/*.sql", dockerfile.check_wheel())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.check", description=__doc__)
    parser.add_argument("--no-wheel", action="store_true", help="skip building the wheel")
    args = parser.parse_args(argv)
    started = time.monotonic()
    print(
        f"charge-worker deployment check: {chart.CHART.relative_to(ROOT)} "
        f"rendered by Helm SDK {chart.helm_version()}"
    )
    report = Report()
    for label, files in chart.VALUE_SETS.items():
        check_value_set(report, label, files)
    for variant in VARIANTS:
        check_value_set(report, "defaults", chart.VALUE_SETS["defaults"], variant)
    check_refusals(report)
    check_sources(report)
    check_image(report, wheel=not args.no_wheel)
    elapsed = time.monotonic() - started
    print(f"\ndeploy check: {report.passed} ok, {report.failed} failed ({elapsed:.1f} s)")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
