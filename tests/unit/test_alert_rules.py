"""The on-call files: alert rules, their unit tests, the dashboard's PromQL, the runbook.

promtool (Debian package `prometheus`) checks `config/alerts.yml`, runs
`config/alerts.test.yml` and `config/alerts.jobs.test.yml` (the alerts that wait hours and
days, evaluated every 10 minutes there) and parses every expression of
`config/grafana-dashboard.json`; without promtool those tests are skipped, and `pytest -ra`
says why. The pure checks always
run: every alert has a severity, a summary, a description and a runbook_url whose anchor is
a `##` heading of `docs/runbook.md` covering it, and every alert is tested both firing and
quiet.

No YAML library is a dependency, so the two YAML files are read by their layout: a rule is a
`- alert:` item with one key per line, a rule test a `- eval_time:` item. promtool checks
the real structure of both.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parents[2]
ALERTS = ROOT / "config" / "alerts.yml"
ALERT_TESTS = ROOT / "config" / "alerts.test.yml"
# The job alerts wait 26 and 50 hours: evaluated every minute they would take most of a
# minute, so their tests evaluate every 10 minutes in a file of their own.
ALERT_TEST_FILES = (ALERT_TESTS, ROOT / "config" / "alerts.jobs.test.yml")
DASHBOARD = ROOT / "config" / "grafana-dashboard.json"
RUNBOOK = ROOT / "docs" / "runbook.md"
RUNBOOK_URL = "https://github.com/example/charge-worker/blob/main/docs/runbook.md"

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed: apt-get install prometheus"
)

SEVERITIES = {"critical", "warning"}
ANNOTATIONS = ("summary", "description", "runbook_url")
RUNBOOK_PARTS = ("**What it means.**", "**First three commands**", "**Do not**")
# Grafana fills these in before the query reaches Prometheus; any other `$` is a mistake.
GRAFANA_VARIABLES = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$__range": "1h",
    "$namespace": "billing",  # the dashboard's own: the release's namespace, chosen at the top
}
# What the dashboard must show: a metric each panel family is built on.
DASHBOARD_METRICS = (
    "charge_worker_messages_total",
    "charge_worker_redeliveries_total",
    "charge_worker_duplicates_absorbed_total",
    "charge_worker_dead_letters_total",
    "charge_worker_breaker_open",
    "charge_worker_processing_seconds_bucket",
    "charge_worker_consumer_pending",
    "charge_worker_consumer_ack_pending",
    "charge_worker_reconcile_double_charges",
    "charge_worker_reconcile_discrepancies",
    "charge_worker_deferred_checks_pending",
    "charge_worker_outbox_oldest_unsent_seconds",
    "charge_worker_outbox_publishes_total",
    "charge_worker_declines_total",
    "charge_worker_job_last_success_timestamp_seconds",
    "charge_worker_webhook_deliveries_total",
)


def _unquote(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] == "'":
        return value[1:-1].replace("''", "'")
    if len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1]
    return value


def _read_alerts() -> dict[str, dict[str, str]]:
    """Each alert's one-line keys (severity, for, summary, description, runbook_url, ...)."""
    alerts: dict[str, dict[str, str]] = {}
    for block in re.split(r"^\s*- alert:[ \t]*", ALERTS.read_text(), flags=re.MULTILINE)[1:]:
        name, _, body = block.partition("\n")
        assert name.strip() not in alerts, f"alert {name.strip()} defined twice"
        keys = re.findall(r"^[ \t]+(\w+):[ \t]*(.*)$", body, flags=re.MULTILINE)
        alerts[name.strip()] = {key: _unquote(value) for key, value in keys}
    return alerts


def _read_rule_tests() -> set[tuple[str, bool]]:
    """(alertname, fires) for every `alert_rule_test` item of the rule tests."""
    cases: set[tuple[str, bool]] = set()
    text = "\n".join(path.read_text() for path in ALERT_TEST_FILES)
    for item in re.split(r"^\s*- eval_time:", text, flags=re.MULTILINE)[1:]:
        name = re.search(r"^\s*alertname:[ \t]*(\S+)", item, flags=re.MULTILINE)
        expected = re.search(r"^\s*exp_alerts:[ \t]*(\S*)", item, flags=re.MULTILINE)
        assert name, f"a rule test without an alertname: {item[:200]}"
        assert expected, f"a rule test without exp_alerts: {item[:200]}"
        cases.add((name.group(1), expected.group(1) != "[]"))
    return cases


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    kept = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return kept.replace(" ", "-")


def _runbook_sections() -> dict[str, str]:
    """Each `##` section of the runbook by its anchor."""
    parts = re.split(r"^## (.+)$", RUNBOOK.read_text(), flags=re.MULTILINE)
    return {_anchor(title): body for title, body in zip(parts[1::2], parts[2::2], strict=True)}


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # a collapsed row holds its panels


def _dashboard_exprs() -> list[tuple[str, str]]:
    """(a recording-rule name naming the panel and query, the PromQL) for every query."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = []
    for panel in _panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            name = f"dashboard:panel_{panel['id']}_{target['refId'].lower()}"
            exprs.append((name, target["expr"]))
    return exprs


def _with_grafana_variables(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


ALERT_NAMES = sorted(_read_alerts())


def _promtool(*args: str | Path) -> None:
    assert PROMTOOL is not None
    done = subprocess.run(
        [PROMTOOL, *map(str, args)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, f"promtool {' '.join(map(str, args))}:\n{done.stdout}{done.stderr}"


@needs_promtool
def test_promtool_accepts_the_alert_rules() -> None:
    _promtool("check", "rules", ALERTS)


@needs_promtool
@pytest.mark.parametrize("tests", ALERT_TEST_FILES, ids=lambda path: path.name)
def test_alert_rules_pass_their_promtool_unit_tests(tests: Path) -> None:
    _promtool("test", "rules", tests)


@needs_promtool
def test_every_dashboard_expression_is_valid_promql(tmp_path: Path) -> None:
    rules = [
        {"record": name, "expr": _with_grafana_variables(expr)} for name, expr in _dashboard_exprs()
    ]
    rule_file = tmp_path / "dashboard-rules.yml"  # JSON is YAML: no YAML writer needed
    rule_file.write_text(json.dumps({"groups": [{"name": "grafana-dashboard", "rules": rules}]}))
    _promtool("check", "rules", rule_file)


def test_the_rule_file_has_the_alerts_the_runbook_is_written_for() -> None:
    assert len(ALERT_NAMES) == ALERTS.read_text().count("- alert:")
    assert "ChargeWorkerRedeliveries" in ALERT_NAMES
    assert all(name.startswith("ChargeWorker") for name in ALERT_NAMES)


@pytest.mark.parametrize("alert", ALERT_NAMES)
def test_alert_has_severity_and_annotations(alert: str) -> None:
    fields = _read_alerts()[alert]
    assert fields.get("severity") in SEVERITIES
    for annotation in ANNOTATIONS:
        assert fields.get(annotation), f"{alert} has no {annotation}"
    assert fields["runbook_url"] == f"{RUNBOOK_URL}#{alert.lower()}"


@pytest.mark.parametrize("alert", ALERT_NAMES)
def test_runbook_url_anchor_is_a_runbook_section_covering_the_alert(alert: str) -> None:
    anchor = _read_alerts()[alert]["runbook_url"].partition("#")[2]
    sections = _runbook_sections()
    assert anchor in sections, f"docs/runbook.md has no heading with anchor #{anchor}"
    for part in RUNBOOK_PARTS:
        assert part in sections[anchor], f"the runbook's {alert} section lacks {part}"
    assert "charge-worker " in sections[anchor] or "nats " in sections[anchor]


@pytest.mark.parametrize("alert", ALERT_NAMES)
def test_alert_is_tested_firing_and_quiet(alert: str) -> None:
    cases = _read_rule_tests()
    assert (alert, True) in cases, f"no rule test where {alert} fires"
    assert (alert, False) in cases, f"no rule test where {alert} stays quiet"


def test_rule_tests_name_only_existing_alerts() -> None:
    tested = {name for name, _ in _read_rule_tests()}
    assert tested <= set(ALERT_NAMES), f"unknown alerts tested: {tested - set(ALERT_NAMES)}"


def test_the_rule_tests_show_the_num_redelivered_trap() -> None:
    text = ALERT_TESTS.read_text()
    assert "expr: increase(charge_worker_consumer_redelivered[5m])" in text


def test_every_dashboard_query_is_extracted_and_uses_known_variables() -> None:
    exprs = _dashboard_exprs()
    assert len(exprs) == DASHBOARD.read_text().count('"expr":')
    assert len({name for name, _ in exprs}) == len(exprs), "two queries share a panel id + refId"
    for name, expr in exprs:
        assert "$" not in _with_grafana_variables(expr), f"{name}: unknown variable in {expr}"


def test_dashboard_shows_what_on_call_needs() -> None:
    text = " ".join(expr for _, expr in _dashboard_exprs())
    missing = [metric for metric in DASHBOARD_METRICS if metric not in text]
    assert not missing, f"no dashboard panel queries {missing}"
    assert "histogram_quantile(" in text
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in _panels(dashboard["panels"]):
        if panel["type"] != "row":
            assert panel.get("targets"), f"panel {panel['title']!r} has no query"


def test_every_dashboard_query_reads_only_the_chosen_namespace() -> None:
    """One Grafana, many releases: a panel shows the namespace picked at the top, never a
    sum over all of them (issue 39, item 8)."""
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["namespace"]["type"] == "query"
    assert variables["namespace"]["query"]["query"].startswith("label_values(charge_worker_")
    assert variables["namespace"]["datasource"]["uid"] == "${datasource}"
    for name, expr in _dashboard_exprs():
        series = re.findall(r"\b(charge_worker_\w+)(\{[^}]*\})?", expr)
        assert series, f"{name}: reads no charge_worker_ series: {expr}"
        for metric, matchers in series:
            assert matchers.startswith('{namespace="$namespace"'), f"{name}: {metric} in {expr}"


def test_dashboard_runbook_links_point_at_runbook_sections() -> None:
    sections = _runbook_sections()
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in _panels(dashboard["panels"]):
        for link in panel.get("links", []):
            base, _, anchor = link["url"].partition("#")
            assert base == RUNBOOK_URL
            assert anchor in sections, f"panel {panel['title']!r} links to a missing #{anchor}"
