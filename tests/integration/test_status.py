"""`charge-worker status`: what it gathers is exactly the world as seeded (a paused consumer
with its reason, messages waiting, one redelivered, dead letters by reason, each job's
runs, reconcile's findings, an open due charge, an unsent outcome event, a deferred
check, no worker pod), its JSON is that one object, and a dependency away is a part named,
not a crash. (As a command: tests/e2e/test_status_cli.py; the worker pods:
tests/integration/test_worker_pods.py.)
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json

import asyncpg
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from charge_worker.admin.pause import pause
from charge_worker.admin.screen import render
from charge_worker.admin.status import (
    Backlog,
    DeadLetterCounts,
    Failure,
    JobRuns,
    ReconcileRun,
    Status,
    gather,
)
from charge_worker.dlq import DeadLetters
from charge_worker.jobs.figures import RECONCILE_COUNTS
from charge_worker.jobs.pods import BreakerState, Pod, Pods
from charge_worker.jobs.runs import record
from charge_worker.sandbox.embedded import free_port
from charge_worker.settings import NatsSettings, Settings
from charge_worker.streams import PauseState
from tests.integration.test_reconcile import put_row
from tests.support.harness import PERIOD, due, provisioned, publish, settings_for

NOWHERE = "http://127.0.0.1:9"  # status calls neither the gateway nor scoring
PAUSED_AT = dt.datetime(2026, 12, 6, 3, 0, tzinfo=dt.UTC)
FINDINGS = {"double_charges": 2, "refunds": 1, "discrepancies": 1, "unmatched_charges": 3}
# seconds since the oldest open row was due, and since the oldest unsent event occurred
_OLDEST_DUE = """
SELECT extract(epoch FROM now() - min(due_at))::float8
  FROM charge_attempts WHERE status IN ('scheduled', 'pending')
"""
_OLDEST_UNSENT = """
SELECT extract(epoch FROM now() - min(occurred_at))::float8
  FROM charge_outcomes WHERE sent_at IS NULL
"""


@pytest.fixture
def settings(nats_settings: NatsSettings, database_url: str) -> Settings:
    # no backoff: a nak redelivers at once (with one, JetStream waits its first step)
    return settings_for(nats_settings, database_url, NOWHERE, NOWHERE, backoff_s=())


async def seed_nats(js: JetStreamContext, settings: Settings) -> None:
    """Three due charges: one delivered twice and not acked, two waiting; three dead
    letters, two of them poison; then the pause, with its reason."""
    cfg = settings.nats
    await publish(js, cfg.subject, due(1))
    puller = await js.pull_subscribe(cfg.subject, durable=cfg.durable, stream=cfg.stream)
    [first] = await puller.fetch(1, timeout=5)
    await first.nak()
    [again] = await puller.fetch(1, timeout=5)  # the only message: its second delivery
    assert again.metadata.num_delivered == 2
    await puller.unsubscribe()
    for order_id in (2, 3):
        await publish(js, cfg.subject, due(order_id))
    letters = DeadLetters(js, cfg)
    for seq, reason in ((11, "poison"), (12, "max_deliveries"), (13, "poison")):
        await letters.write(
            b"{}", reason=reason, error="seeded", stream_seq=seq, num_delivered=1, original=None
        )
    await pause(js, cfg, reason="gateway incident", by="ann", now=PAUSED_AT)


async def seed_database(conn: asyncpg.Connection) -> None:
    """Each job's runs (produce's latest failed), a finished reconcile run held by the pause
    with double charges; an open due charge, a charged one whose outcome event is unsent
    and whose scoring check is pending, and a check resolved already."""
    started = dt.datetime.now(dt.UTC)
    await record(conn, "produce", started_at=started, ok=True, summary={"due": 3})
    await record(conn, "produce", started_at=started, ok=False, summary={"error": "X"})
    counts = dict.fromkeys(RECONCILE_COUNTS, 0) | FINDINGS
    summary = counts | {"full": False, "held": True}
    await record(conn, "reconcile", started_at=started, ok=True, summary=summary)
    await record(conn, "maintain", started_at=started, ok=True, summary={"created": []})
    await put_row(conn, 1, "scheduled")  # due 2026-12-01, not charged yet
    await put_row(conn, 2, "succeeded", charge_id="ch_2")  # its trigger writes the event
    await put_row(conn, 3, "succeeded", charge_id="ch_3")
    await conn.execute(
        "INSERT INTO deferred_scoring_checks (order_id, billing_period, reason, status)"
        " VALUES (2, $1, 'scoring unavailable', 'pending'),"
        " (3, $1, 'scoring unavailable', 'approved')",
        PERIOD,
    )
    # order 3's event is in the stream already: only order 2's waits
    await conn.execute(
        "UPDATE charge_outcomes SET sent_at = now(), stream_seq = 1 WHERE order_id = 3"
    )


async def test_status_gathers_exactly_the_world_as_seeded(
    nc: Client, settings: Settings, conn: asyncpg.Connection
) -> None:
    js = await provisioned(nc, settings)
    await seed_nats(js, settings)
    await seed_database(conn)
    due_before = await conn.fetchval(_OLDEST_DUE)
    unsent_before = await conn.fetchval(_OLDEST_UNSENT)

    status = await gather(settings)

    due_after = await conn.fetchval(_OLDEST_DUE)
    unsent_after = await conn.fetchval(_OLDEST_UNSENT)
    cfg = settings.nats
    assert status.failed == ()
    assert status.exit_code == 0
    assert status.charging == PauseState(
        stream=cfg.stream,
        consumer=cfg.durable,
        paused=True,
        paused_until=status.charging.paused_until if status.charging else None,
        reason="gateway incident",
        paused_at="2026-12-06T03:00:00Z",
        paused_by="ann",
        pending=2,
        ack_pending=1,
    )
    assert status.backlog == Backlog(
        lag=2, ack_pending=1, max_ack_pending=cfg.max_ack_pending, redelivered=1, waiting_pulls=0
    )
    assert status.dead_letters == DeadLetterCounts(
        stream=cfg.dlq_stream,
        total=3,
        read=3,
        capped=False,
        by_reason={"poison": 2, "max_deliveries": 1},
    )
    rows = {
        (r["job"], r["ok"]): r["finished_at"]
        for r in await conn.fetch("SELECT job, ok, finished_at FROM job_runs")
    }
    assert status.runs == (
        JobRuns("produce", rows["produce", True], rows["produce", False]),
        JobRuns("reconcile", rows["reconcile", True], None),
        JobRuns("maintain", rows["maintain", True], None),
    )
    assert status.reconcile is not None
    assert status.reconcile == ReconcileRun(
        started_at=status.reconcile.started_at,
        finished_at=rows["reconcile", True],
        ok=True,
        held=True,
        counts=dict.fromkeys(RECONCILE_COUNTS, 0) | FINDINGS,
    )
    assert status.oldest_due_s is not None
    assert due_before <= status.oldest_due_s <= due_after
    assert status.outbox_oldest_unsent_s is not None
    assert unsent_before <= status.outbox_oldest_unsent_s <= unsent_after
    assert status.deferred_checks_pending == 1
    assert status.pods == Pods(seen=(), not_seen=0, seen_within_s=120.0)  # no worker ran

    screen = render(status)
    assert 12 <= len(screen) <= 25, screen
    text = "\n".join(screen)
    assert "PAUSED" in text
    assert "since 2026-12-06T03:00:00Z by ann, reason: gateway incident" in text
    assert "2 waiting (lag), 1 ack pending of max" in text
    assert "3 in " + cfg.dlq_stream + ": poison 2, max_deliveries 1" in text
    assert "double charges 2, discrepancies 1, unmatched 3, errors 0; held (paused)" in text
    assert "(the latest run failed)" in text  # produce's
    assert "pods:         0 seen in the last 2m 0s (each writes every 30s), 0 not seen" in text


async def test_the_dead_letters_read_are_capped_and_say_so(nc: Client, settings: Settings) -> None:
    js = await provisioned(nc, settings)
    letters = DeadLetters(js, settings.nats)
    for seq, reason in ((1, "poison"), (2, "poison"), (3, "rejected"), (4, "conflict")):
        await letters.write(
            b"{}", reason=reason, error="seeded", stream_seq=seq, num_delivered=1, original=None
        )
    told: list[tuple[int, int]] = []

    status = await gather(settings, dead_letters_read=2, progress=lambda *p: told.append(p))

    assert status.dead_letters == DeadLetterCounts(
        stream=settings.nats.dlq_stream,
        total=4,
        read=2,
        capped=True,
        by_reason={"rejected": 1, "conflict": 1},  # the newest two
    )
    assert told == [(2, 2)]
    assert "(reasons of the newest 2 only" in "\n".join(render(status))


async def test_nats_away_shows_the_database_parts_names_nats_and_exits_1(
    settings: Settings, conn: asyncpg.Connection
) -> None:
    await seed_database(conn)
    away = settings.nats.model_copy(update={"url": f"nats://127.0.0.1:{free_port()}"})

    status = await gather(settings.model_copy(update={"nats": away}))

    assert [f.part for f in status.failed] == ["nats"]
    assert "cannot connect to NATS" in status.failed[0].error
    assert (status.charging, status.backlog, status.dead_letters) == (None, None, None)
    assert status.deferred_checks_pending == 1
    assert status.runs is not None
    assert status.exit_code == 1
    screen = render(status)
    assert screen[-1].startswith("FAILED:       nats: cannot connect to NATS")
    assert "charging:     not read" in screen


async def test_its_json_is_one_object_of_every_part(settings: Settings) -> None:
    moment = dt.datetime(2026, 12, 6, 3, 0, tzinfo=dt.UTC)
    status = Status(
        checked_at=moment,
        runs=(JobRuns("produce", moment, None),),
        pods=Pods(
            seen=(
                Pod(
                    worker="vm:5027:4cf957",
                    started_at=moment,
                    seen_at=moment,
                    seen_s_ago=3.5,
                    breakers={"gateway": BreakerState("open", moment)},
                    in_flight=2,
                    paused=True,
                ),
            ),
            not_seen=1,
            seen_within_s=120.0,
        ),
        failed=(Failure("database", "cannot connect to the database: refused"),),
    )

    document = json.loads(status.to_json())

    assert set(document) == {f.name for f in dataclasses.fields(Status)} | {"exit_code"}
    assert document["checked_at"] == "2026-12-06T03:00:00+00:00"
    assert document["runs"] == [
        {"job": "produce", "last_ok_at": "2026-12-06T03:00:00+00:00", "last_failed_at": None}
    ]
    assert document["pods"] == {
        "seen": [
            {
                "worker": "vm:5027:4cf957",
                "started_at": "2026-12-06T03:00:00+00:00",
                "seen_at": "2026-12-06T03:00:00+00:00",
                "seen_s_ago": 3.5,
                "breakers": {"gateway": {"state": "open", "since": "2026-12-06T03:00:00+00:00"}},
                "in_flight": 2,
                "paused": True,
            }
        ],
        "not_seen": 1,
        "seen_within_s": 120.0,
    }
    assert document["failed"] == [
        {"part": "database", "error": "cannot connect to the database: refused"}
    ]
    assert document["exit_code"] == 1
