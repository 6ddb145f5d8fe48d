"""`charge-worker reconcile` as the CronJob runs it: real servers, its output, exit codes."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from charge_worker.reconcile.run import LOCK_KEY
from charge_worker.sandbox.embedded import free_port
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings
from tests.support.cli import Ran, cli

PERIOD = "2026-12-01"
API_KEY = "sk_test_sandbox"


async def reconcile(*args: str, env: dict[str, str]) -> Ran:
    """`charge-worker reconcile ARGS` in this process, off the test's loop."""
    return await asyncio.to_thread(cli, "reconcile", *args, env=env)


@pytest.fixture
def env(nats_settings: NatsSettings, database_url: str, gateway_sim: ServedApp) -> dict[str, str]:
    return {
        "NATS_URL": str(nats_settings.url),
        "CHARGE_WORKER_STREAM": nats_settings.stream,
        "CHARGE_WORKER_SUBJECT": nats_settings.subject,
        "CHARGE_WORKER_DLQ_STREAM": nats_settings.dlq_stream,
        "CHARGE_WORKER_DLQ_SUBJECT": nats_settings.dlq_subject,
        "DATABASE_URL": database_url,
        "GATEWAY_URL": gateway_sim.url,
        "GATEWAY_API_KEY": API_KEY,
    }


async def charged(
    gateway_url: str,
    order_id: int,
    idempotency_key: str,
    *,
    amount: int = 99000,
    customer: str = "cus_ok",
) -> str:
    """A charge made straight at the gateway; returns its id."""
    async with httpx.AsyncClient(base_url=gateway_url) as client:
        response = await client.post(
            "/v1/charges",
            json={
                "amount": amount,
                "currency": "RUB",
                "customer": customer,
                "metadata": {"order_id": str(order_id), "billing_period": PERIOD},
            },
            headers={"Authorization": f"Bearer {API_KEY}", "Idempotency-Key": idempotency_key},
        )
    assert response.status_code == 200, response.text
    return str(response.json()["id"])


async def succeeded_row(conn: asyncpg.Connection, order_id: int, charge_id: str) -> None:
    await conn.execute(
        """
        INSERT INTO charge_attempts (order_id, billing_period, idempotency_key, subscription_id,
            customer_id, amount_minor, currency, status, gateway_charge_id, gateway_calls,
            attempt, settled_at)
        VALUES ($1, $2, $3, $4, 'cus_ok', 99000, 'RUB', 'succeeded', $5, 1, 1, now())
        """,
        order_id,
        dt.date.fromisoformat(PERIOD),
        f"{order_id}:{PERIOD}",
        f"sub_{order_id}",
        charge_id,
    )


async def charges(gateway_url: str) -> dict[str, str]:
    """Each charge at the gateway: `succeeded`, `failed`, or `refunded` (a succeeded charge
    whose money went back: docs/contracts/gateway.md, "Refunds")."""
    async with httpx.AsyncClient() as client:
        data = (await client.get(f"{gateway_url}/_sim/charges")).json()["data"]
    return {c["id"]: "refunded" if c.get("refunded") else c["status"] for c in data}


async def set_sim(gateway_url: str, **config: Any) -> None:
    async with httpx.AsyncClient() as client:
        (await client.post(f"{gateway_url}/_sim/config", json=config)).raise_for_status()


def gauges(path: Path) -> dict[str, float]:
    families = text_string_to_metric_families(path.read_text())
    return {
        s.name.removeprefix("charge_worker_reconcile_"): s.value
        for family in families
        for s in family.samples
    }


async def test_double_charge_dry_run_then_repair_then_nothing(
    env: dict[str, str], conn: asyncpg.Connection, gateway_sim: ServedApp, tmp_path: Path
) -> None:
    kept = await charged(gateway_sim.url, 1, f"1:{PERIOD}")
    await succeeded_row(conn, 1, kept)
    await set_sim(gateway_sim.url, idempotency_enabled=False)
    extra = await charged(gateway_sim.url, 1, "a-second-key")
    metrics = tmp_path / "reconcile.prom"

    dry = await reconcile("--dry-run", "--json", env=env)
    assert dry.returncode == 0, dry.stderr
    report = json.loads(dry.stdout)
    assert report["dry_run"] is True
    assert (report["counts"]["double_charges"], report["counts"]["refunds"]) == (1, 0)
    assert report["double_charges"][0]["extra"] == [extra]
    assert await charges(gateway_sim.url) == {kept: "succeeded", extra: "succeeded"}

    repair = await reconcile("--metrics-file", str(metrics), env=env)
    assert repair.returncode == 0, repair.stderr
    assert f"1:{PERIOD}" in repair.stdout
    assert "refunded" in repair.stdout
    assert await charges(gateway_sim.url) == {kept: "succeeded", extra: "refunded"}
    assert gauges(metrics) | {"last_run_timestamp_seconds": 0} == {
        "last_run_timestamp_seconds": 0,
        "double_charges": 1,
        "refunds": 1,
        "unrecorded_charges": 0,
        "ledger_repaired": 0,
        "discrepancies": 0,
        "unknown_resolved": 0,
        "adopted": 0,
        "adopted_rows": 0,
        "republished": 0,
        "still_waiting": 0,
        "unmatched_charges": 0,
        "errors": 0,
    }

    again = await reconcile("--json", "--metrics-file", str(metrics), env=env)
    assert again.returncode == 0, again.stderr
    assert set(json.loads(again.stdout)["counts"].values()) == {0}
    assert gauges(metrics)["refunds"] == 0
    assert await charges(gateway_sim.url) == {kept: "succeeded", extra: "refunded"}


async def test_charges_not_proven_doubles_are_reported_never_refunded(
    env: dict[str, str], conn: asyncpg.Connection, gateway_sim: ServedApp, tmp_path: Path
) -> None:
    """Charges made at the gateway with our metadata but another amount or customer, or
    for a key the ledger has no row for: a plain `reconcile` refunds none of them; they
    are reported for a person (JSON, metrics file, exit 4 when asked)."""
    kept = await charged(gateway_sim.url, 1, f"1:{PERIOD}")
    await succeeded_row(conn, 1, kept)
    await set_sim(gateway_sim.url, idempotency_enabled=False)
    other_amount = await charged(gateway_sim.url, 1, "by-hand-1", amount=5000)
    other_customer = await charged(gateway_sim.url, 1, "by-hand-2", customer="cus_other")
    no_row = [await charged(gateway_sim.url, 2, f"by-hand-{n}") for n in (3, 4)]
    before = await charges(gateway_sim.url)
    metrics = tmp_path / "reconcile.prom"

    plain = await reconcile("--metrics-file", str(metrics), env=env)
    assert plain.returncode == 0, plain.stderr
    assert "unmatched charges" in plain.stdout
    assert await charges(gateway_sim.url) == before  # nothing refunded
    assert (gauges(metrics)["refunds"], gauges(metrics)["unmatched_charges"]) == (0, 4)

    asked = await reconcile("--json", "--fail-on-discrepancy", env=env)
    assert asked.returncode == 4, asked.stderr
    report = json.loads(asked.stdout)
    assert report["counts"]["unmatched_charges"] == 4
    reported = {c.split()[0] for item in report["unmatched_charges"] for c in item["charges"]}
    assert reported == {other_amount, other_customer, *no_row}
    assert await charges(gateway_sim.url) == before


async def test_discrepancy_exits_4_only_when_asked_and_charges_nothing(
    env: dict[str, str], conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    await succeeded_row(conn, 7, "ch_never_made")

    failing = await reconcile("--fail-on-discrepancy", env=env)
    assert failing.returncode == 4, failing.stderr
    assert f"7:{PERIOD}" in failing.stdout
    assert "ch_never_made" in failing.stdout
    reported = await reconcile("--json", env=env)
    assert reported.returncode == 0, reported.stderr
    assert json.loads(reported.stdout)["counts"]["discrepancies"] == 1
    assert await charges(gateway_sim.url) == {}


async def test_another_reconcile_running_is_said_and_exits_0(
    env: dict[str, str], conn: asyncpg.Connection, tmp_path: Path
) -> None:
    metrics = tmp_path / "reconcile.prom"
    assert await conn.fetchval("SELECT pg_try_advisory_lock($1)", LOCK_KEY)

    result = await reconcile("--metrics-file", str(metrics), env=env)

    assert result.returncode == 0, result.stderr
    assert "another reconcile is running" in result.stdout
    assert not metrics.exists()


def test_unreachable_gateway_is_one_line_and_exit_1(env: dict[str, str]) -> None:
    result = cli("reconcile", env=env | {"GATEWAY_URL": f"http://127.0.0.1:{free_port()}"})
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("Error: DependencyUnavailable: gateway")
    assert API_KEY not in result.stdout + result.stderr


def test_unreachable_database_is_one_line_and_exit_1(env: dict[str, str]) -> None:
    url = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    result = cli("reconcile", env=env | {"DATABASE_URL": url})
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("Error: DependencyUnavailable: cannot connect to the database")


async def test_each_run_says_which_history_it_read_and_full_reads_the_window(
    env: dict[str, str], conn: asyncpg.Connection, gateway_sim: ServedApp
) -> None:
    """The CronJob's runs page from the checkpoint; `--full`, the daily one, the window."""
    await succeeded_row(conn, 1, await charged(gateway_sim.url, 1, f"1:{PERIOD}"))

    runs = [await reconcile(*args, "--json", env=env) for args in ((), (), ("--full",))]

    assert [r.returncode for r in runs] == [0, 0, 0], [r.stderr for r in runs]
    first, second, full = (json.loads(r.stdout) for r in runs)
    assert [first["mode"], second["mode"], full["mode"]] == ["window", "incremental", "full"]
    assert first["checkpoint"] == first["until"]
    assert second["since"] < second["until"]
    read = dt.datetime.fromisoformat(full["until"]) - dt.datetime.fromisoformat(full["since"])
    assert read == dt.timedelta(hours=48)  # CHARGE_WORKER_RECONCILE_WINDOW_S
    assert full["history"] == {"pages": 1, "charges": 1}
    assert (full["candidates"], full["lookups"]) == (0, 0)
    plain = await reconcile("--full", env=env)
    assert "(full)" in plain.stdout
    assert "0 key(s) looked at" in plain.stdout
