"""Every series `config/alerts.yml` and `config/grafana-dashboard.json` read is exported.

An alert over a series no process exports is never evaluated against anything: it stays
quiet through the very incident it was written for, and promtool cannot tell (its unit
tests feed the series by hand). So the names come from the processes themselves: a live
scrape of a real worker and of a real webhook receiver, and the file reconcile writes with
`--metrics-file`, each after some work (a labelled counter appears only at its first
increment; the worker's gauges of the jobs' runs, reconcile's figures among them, once a
run is recorded: reconcile runs first). A name in a rule's or a panel's `expr`
(`charge_worker_…`, suffixes `_total`, `_bucket`, `_sum`, `_count` included) must be among
them; a histogram's base name counts as exported when its `_bucket` is.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path

import asyncpg
import httpx
from nats.aio.client import Client

from charge_worker.reconcile.run import reconcile_command
from charge_worker.retries.starts import start_due
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings
from tests.support.harness import (
    consumer_idle,
    due,
    eventually,
    provisioned,
    publish,
    running_worker,
    set_sim,
    settings_for,
)
from tests.support.webhooks import event, running_receiver, webhook_settings

ROOT = Path(__file__).parents[2]
ALERTS = ROOT / "config" / "alerts.yml"
DASHBOARD = ROOT / "config" / "grafana-dashboard.json"
SERIES = re.compile(r"\bcharge_worker_[a-z_]+")
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", flags=re.MULTILINE)


def rule_exprs(text: str) -> list[str]:
    """Every rule's `expr` in a rule file, one-line or a `|` block (read by layout: no YAML
    library is a dependency; promtool checks the real structure)."""
    lines = text.splitlines()
    exprs = []
    for at, line in enumerate(lines):
        found = re.match(r"^(\s*)expr:\s*(.*)$", line)
        if found is None:
            continue
        indent, value = len(found.group(1)), found.group(2).strip()
        if value not in ("|", "|-", ">", ">-"):
            exprs.append(value)
            continue
        block = []
        for follow in lines[at + 1 :]:
            if follow.strip() and len(follow) - len(follow.lstrip()) <= indent:
                break
            block.append(follow)
        exprs.append("\n".join(block))
    return exprs


def dashboard_exprs(dashboard: dict[str, object]) -> list[str]:
    """Every panel's queries, rows' panels included."""
    exprs: list[str] = []

    def walk(panels: object) -> None:
        for panel in panels if isinstance(panels, list) else []:
            exprs.extend(str(target["expr"]) for target in panel.get("targets", []))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    return exprs


def referenced() -> dict[str, set[str]]:
    """Each series name the rules and the dashboard query, with where."""
    where: dict[str, set[str]] = {}
    sources = {
        "config/alerts.yml": rule_exprs(ALERTS.read_text()),
        "config/grafana-dashboard.json": dashboard_exprs(json.loads(DASHBOARD.read_text())),
    }
    for source, exprs in sources.items():
        assert exprs, f"no expr found in {source}"
        for expr in exprs:
            for name in SERIES.findall(expr):
                where.setdefault(name, set()).add(source)
    return where


def sample_names(exposition: str) -> set[str]:
    """The series names of a Prometheus text exposition (its samples, not HELP/TYPE)."""
    return set(SAMPLE.findall(exposition))


def unexported(names: dict[str, set[str]], exported: set[str]) -> dict[str, set[str]]:
    return {
        name: sources
        for name, sources in names.items()
        if name not in exported and f"{name}_bucket" not in exported
    }


def test_the_comparison_notices_a_name_nothing_exports() -> None:
    exported = {"charge_worker_a_total", "charge_worker_h_bucket", "charge_worker_h_sum"}
    names = {
        "charge_worker_a_total": {"x"},
        "charge_worker_h": {"x"},
        "charge_worker_h_bucket": {"x"},
        "charge_worker_typo_total": {"x"},
    }
    assert unexported(names, exported) == {"charge_worker_typo_total": {"x"}}
    rules = (
        "  - alert: A\n    expr: |\n      sum(a)\n      > 1\n    for: 5m\n"
        "  - alert: B\n    expr: b\n"
    )
    assert rule_exprs(rules) == ["      sum(a)\n      > 1", "b"]


async def test_every_series_the_alerts_and_the_dashboard_read_is_exported(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
    tmp_path: Path,
) -> None:
    exported: set[str] = set()
    settings = settings_for(
        nats_settings, database_url, gateway_sim.url, scoring_sim.url, deferred_check_interval_s=0.2
    )
    js = await provisioned(nc, settings)
    # recorded in job_runs too: the worker exports its figures and the job's last success
    metrics_file = tmp_path / "reconcile.prom"
    code = await reconcile_command(
        settings,
        since=None,
        dry_run=False,
        as_json=True,
        fail_on_discrepancy=False,
        metrics_file=metrics_file,
    )
    assert code == 0
    exported |= sample_names(metrics_file.read_text())
    # scoring down: the charge goes ahead and leaves a deferred check; a poison message
    # is dead-lettered; a card declined on its first try is charged on its second
    await set_sim(scoring_sim.url, error_rate=1.0)
    await publish(js, settings.nats.subject, due(1))
    await publish(js, settings.nats.subject, b"not json")
    await publish(js, settings.nats.subject, due(3, customer="cus_soft2_3"))
    async with running_worker(settings) as worker, httpx.AsyncClient() as client:
        await eventually(lambda: consumer_idle(nc, settings.nats), "all three settled")
        await set_sim(scoring_sim.url, error_rate=0.0)
        await eventually(
            lambda: (
                worker.metric("charge_worker_deferred_checks_resolved_total", verdict="approved")
                == 2  # order 1's, and order 3's first try: declined, but sent without a verdict
            ),
            "the deferred checks resolved",
        )
        assert worker.metric("charge_worker_dead_letters_total", reason="poison") == 1
        later = dt.datetime.now(dt.UTC) + dt.timedelta(days=30)  # the next try is due by then
        conn = await asyncpg.connect(database_url)
        try:
            assert (await start_due(conn, limit=10, cap=8, now=later)).started == 1
        finally:
            await conn.close()
        await publish(js, settings.nats.subject, due(3, customer="cus_soft2_3", attempt=2))
        await eventually(
            lambda: worker.metric("charge_worker_retry_recovered_minor_total", currency="RUB") > 0,
            "try 2 charged",
        )
        await eventually(
            lambda: worker.metric("charge_worker_reconcile_last_run_timestamp_seconds") > 0,
            "the worker's first read of job_runs",
        )
        worker_series = sample_names((await client.get(f"{worker.http_url}/metrics")).text)
        exported |= worker_series

    receiving = webhook_settings(database_url, gateway_sim.url)
    async with running_receiver(receiving) as receiver:
        body = event("ch_unknown", order_id=2)
        assert (await receiver.post(body)).status_code == 200
        assert (await receiver.post(body)).status_code == 200  # a duplicate, counted
        await eventually(
            lambda: (
                receiver.metric("charge_worker_webhook_events_total", status="awaiting_dependency")
                >= 1
            ),
            "the event processed",
        )
        exported |= sample_names((await receiver.client.get("/metrics")).text)

    assert "process_cpu_seconds_total" in exported  # the scrapes were real expositions
    # every pod exports reconcile's figures as its textfile names them, and the jobs' runs
    assert sample_names(metrics_file.read_text()) <= worker_series
    assert {
        "charge_worker_job_last_success_timestamp_seconds",
        "charge_worker_oldest_due_unsettled_seconds",
    } <= worker_series
    missing = unexported(referenced(), exported)
    assert not missing, "queried but exported by no process: " + "; ".join(
        f"{name} ({', '.join(sorted(sources))})" for name, sources in sorted(missing.items())
    )
