"""The producer against real PostgreSQL and nats-server, and a real worker after it.

What it must keep: every due period of every valid subscription is recorded once and
published once (one stream message per key), refused rows are reported and left where they
are, and however often and however concurrently it runs, each due charge is charged once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
from collections.abc import Awaitable, Callable

import pytest
from asyncpg import Connection
from nats.aio.client import Client
from nats.js.api import DiscardPolicy, PubAck

from charge_worker import events, streams
from charge_worker.messages import parse
from charge_worker.producer.publish import WINDOW, Outgoing, Publisher, publish_scheduled
from charge_worker.producer.schedule import produce, schedule
from charge_worker.producer.summary import Problem, Summary
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import DbSettings, NatsSettings, Settings
from tests.support.harness import eventually, gateway_charges, running_worker, settings_for
from tests.support.producer import (
    DAY,
    Sub,
    add_attempt,
    add_subscriptions,
    all_final,
    attempts,
    connected,
    keys_of,
    next_dates,
    stream_messages,
)

NEXT = dt.date(2027, 1, 1)
Then = Callable[[list[Outgoing]], Awaitable[None]]


@pytest.fixture
def settings(nats_settings: NatsSettings, database_url: str) -> Settings:
    """Producer-only settings: no worker, no simulators."""
    return Settings(nats=nats_settings, db=DbSettings(url=database_url))


@pytest.fixture
def worker_settings(
    nats_settings: NatsSettings, database_url: str, gateway_sim: ServedApp, scoring_sim: ServedApp
) -> Settings:
    """One settings object for the producer and the worker after it (one stream shape)."""
    return settings_for(nats_settings, database_url, gateway_sim.url, scoring_sim.url)


async def test_due_subscriptions_are_published_once_and_advanced(
    nc: Client, settings: Settings, database_url: str
) -> None:
    await add_subscriptions(
        database_url,
        Sub("sub_today", 1),
        Sub("sub_mid_month", 2, next_billing_date=dt.date(2026, 11, 15), currency="EUR"),
        Sub("sub_behind", 3, next_billing_date=dt.date(2026, 10, 1)),
        Sub("sub_tomorrow", 4, next_billing_date=dt.date(2026, 12, 2)),
        Sub("sub_inactive", 5, active=False),
    )
    summary = await produce(settings, DAY)

    keys = keys_of(
        (1, "2026-12-01"),
        (2, "2026-11-15"),
        (3, "2026-10-01"),
        (3, "2026-11-01"),
        (3, "2026-12-01"),
    )
    assert (summary.due, summary.scheduled, summary.published, summary.deduplicated) == (3, 5, 5, 0)
    assert summary.exit_code == 0
    assert await attempts(database_url) == dict.fromkeys(keys, ("scheduled", True))
    messages = await stream_messages(nc.jetstream(), settings.nats.stream)
    assert set(messages) == {f"charge:{key}" for key in keys}
    assert json.loads(messages["charge:2:2026-11-15"]) == {
        "schema": "charge.due/v1",
        "order_id": 2,
        "billing_period": "2026-11-15",
        "subscription_id": "sub_mid_month",
        "customer_id": "cus_ok",
        "amount_minor": 99000,
        "currency": "EUR",
        "due_at": "2026-11-15T00:00:00Z",
    }
    for msg_id, body in messages.items():  # every body keeps the contract and its own key
        assert f"charge:{parse(body).key}" == msg_id
    assert await next_dates(database_url) == {
        "sub_today": dt.date(2027, 1, 1),
        "sub_mid_month": dt.date(2026, 12, 15),
        "sub_behind": dt.date(2027, 1, 1),
        "sub_tomorrow": dt.date(2026, 12, 2),
        "sub_inactive": DAY,
    }
    async with connected(database_url) as conn:
        story = await events.story(conn, 3, dt.date(2026, 11, 1))
    assert [(e.kind, e.actor) for e in story] == [
        ("scheduled", "producer"),
        ("published", "producer"),
    ]
    assert story[0].detail == {
        "subscription_id": "sub_behind",
        "amount_minor": 99000,
        "currency": "RUB",
    }
    assert story[1].detail["msg_id"] == "charge:3:2026-11-01"
    assert story[0].at <= story[1].at  # the row's created_at, then its published_at


async def _billed(database_url: str, order_id: int) -> list[str]:
    async with connected(database_url) as conn:
        rows = await conn.fetch(
            "SELECT billing_period FROM charge_attempts WHERE order_id = $1 ORDER BY 1", order_id
        )
    return [row["billing_period"].isoformat() for row in rows]


@pytest.mark.usefixtures("nc")
async def test_billing_dates_keep_their_anchor_through_short_months(
    settings: Settings, database_url: str
) -> None:
    """Billed on the 31st: the 31st where the month has one, else its last day, never
    drifting to the 28th after February; yearly and every-N-months schedules alike."""
    await add_subscriptions(
        database_url,
        Sub("sub_31st", 1, next_billing_date=dt.date(2027, 1, 31)),
        Sub("sub_leap_day", 2, next_billing_date=dt.date(2028, 2, 29)),
        Sub("sub_quarterly_30th", 3, next_billing_date=dt.date(2027, 11, 30)),
    )
    async with connected(database_url) as conn:
        await conn.execute(
            "UPDATE subscriptions SET billing_interval = 'year' WHERE order_id = 2;"
            "UPDATE subscriptions SET billing_interval_count = 3 WHERE order_id = 3"
        )
    await produce(settings, dt.date(2033, 1, 1))

    assert (await _billed(database_url, 1))[:6] == [
        "2027-01-31", "2027-02-28", "2027-03-31", "2027-04-30", "2027-05-31", "2027-06-30",
    ]  # fmt: skip
    assert await _billed(database_url, 2) == [
        "2028-02-29", "2029-02-28", "2030-02-28", "2031-02-28", "2032-02-29",
    ]  # fmt: skip
    assert (await _billed(database_url, 3))[:5] == [
        "2027-11-30", "2028-02-29", "2028-05-30", "2028-08-30", "2028-11-30",
    ]  # fmt: skip
    assert (await next_dates(database_url))["sub_leap_day"] == dt.date(2033, 2, 28)


@pytest.mark.usefixtures("nc")
async def test_lanes_read_each_due_subscription_once_refused_ones_included(
    settings: Settings, database_url: str
) -> None:
    """A run's lanes share one cursor: with a batch of one, they take turns, and a row
    left behind (it breaks the contract) is not read again by the other lane."""
    await add_subscriptions(
        database_url,
        *(Sub(f"sub_{n:02}", n) for n in range(1, 9)),
        *(Sub(f"sub_{n:02}_bad", n, currency="rub") for n in range(11, 15)),
    )
    summary = await produce(settings, DAY, batch_size=1)

    assert sorted(p.subscription_id for p in summary.invalid) == [
        f"sub_{n:02}_bad" for n in range(11, 15)
    ]
    assert (summary.due, summary.scheduled, summary.published) == (12, 8, 8)


@pytest.mark.usefixtures("nc")
async def test_rows_breaking_the_contract_are_reported_skipped_and_not_advanced(
    settings: Settings, database_url: str
) -> None:
    await add_subscriptions(
        database_url,
        Sub("sub_zero", 1, amount_minor=0),
        Sub("sub_lower", 2, currency="rub"),
        Sub("sub_no_customer", 3, customer_id=""),
        Sub("sub_good", 4),
    )
    summary = await produce(settings, DAY)

    assert summary.invalid == [
        Problem("sub_lower", None, "currency: String should match pattern '^[A-Z]{3}$'"),
        Problem("sub_no_customer", None, "customer_id: String should have at least 1 character"),
        Problem("sub_zero", None, "amount_minor: Input should be greater than 0"),
    ]
    assert (summary.due, summary.scheduled, summary.published) == (4, 1, 1)
    assert summary.exit_code == 0  # reported, but invalid rows alone do not fail the run
    assert await attempts(database_url) == {"4:2026-12-01": ("scheduled", True)}
    assert await next_dates(database_url) == {
        "sub_zero": DAY,
        "sub_lower": DAY,
        "sub_no_customer": DAY,
        "sub_good": dt.date(2027, 1, 1),
    }


async def test_final_rows_are_already_settled_and_conflicts_are_not_advanced(
    nc: Client, settings: Settings, database_url: str
) -> None:
    paid, declined, raised = Sub("sub_paid", 1), Sub("sub_declined", 2), Sub("sub_raised", 3)
    behind = Sub("sub_behind", 4, next_billing_date=dt.date(2026, 11, 1), currency="EUR")
    await add_subscriptions(database_url, paid, declined, raised, behind)
    await add_attempt(database_url, paid, "succeeded", published=True)
    await add_attempt(database_url, declined, "declined")  # final, though never published
    await add_attempt(database_url, raised, "scheduled", amount_minor=50000, published=True)
    await add_attempt(database_url, dataclasses.replace(behind, currency="RUB"), "failed")

    summary = await produce(settings, DAY)

    assert (summary.already_settled, summary.scheduled, summary.published) == (2, 1, 1)
    assert summary.conflicts == [
        Problem(
            "sub_behind",
            "4:2026-12-01",
            "recorded as '99000 RUB cus_ok', the subscription says '99000 EUR cus_ok'",
        ),
        Problem(
            "sub_raised",
            "3:2026-12-01",
            "recorded as '50000 RUB cus_ok', the subscription says '99000 RUB cus_ok'",
        ),
    ]
    assert summary.exit_code == 0  # reported, like invalid rows
    assert await next_dates(database_url) == {
        "sub_paid": dt.date(2027, 1, 1),
        "sub_declined": dt.date(2027, 1, 1),
        "sub_raised": DAY,
        "sub_behind": DAY,  # its November charge went out; December stops at the conflict
    }
    messages = await stream_messages(nc.jetstream(), settings.nats.stream)
    assert set(messages) == {"charge:4:2026-11-01"}
    assert (await attempts(database_url))["2:2026-12-01"] == ("declined", False)


async def test_a_crash_between_the_steps_loses_nothing(
    nc: Client, settings: Settings, database_url: str
) -> None:
    """Rows scheduled but never published, by a run that died or by hand, go out next run."""
    await add_subscriptions(database_url, Sub("sub_a", 1), Sub("sub_b", 2))
    async with connected(database_url) as conn:
        step_one = Summary(DAY)
        await schedule(conn, DAY, step_one)  # the run dies here, before publishing
    assert step_one.scheduled == 2
    await add_attempt(database_url, Sub("sub_by_hand", 9), "scheduled")

    summary = await produce(settings, DAY)

    assert (summary.due, summary.scheduled, summary.published) == (0, 0, 3)
    assert await attempts(database_url) == dict.fromkeys(
        keys_of((1, "2026-12-01"), (2, "2026-12-01"), (9, "2026-12-01")), ("scheduled", True)
    )
    messages = await stream_messages(nc.jetstream(), settings.nats.stream)
    assert set(messages) == {"charge:1:2026-12-01", "charge:2:2026-12-01", "charge:9:2026-12-01"}
    by_hand = parse(messages["charge:9:2026-12-01"])  # its missing due_at: the period's midnight
    assert by_hand.due_at == dt.datetime(2026, 12, 1, tzinfo=dt.UTC)


class _Interrupted(Publisher):
    """A publisher after whose publishes `then` happens, inside the scheduling transaction:
    a worker claiming the message, or the run dying."""

    def __init__(
        self, conn: Connection, nc: Client, cfg: NatsSettings, summary: Summary, then: Then
    ) -> None:
        super().__init__(conn, nc, cfg, summary)
        self.then = then

    async def send(self, outgoing: list[Outgoing]) -> list[PubAck | None]:
        acks = await super().send(outgoing)
        await self.then(outgoing)
        return acks


async def test_a_run_dying_after_its_publish_leaves_a_message_the_worker_charges_once(
    nc: Client, worker_settings: Settings, database_url: str, gateway_sim: ServedApp
) -> None:
    """Messages go out inside the batch's transaction, before its rows: a run dying there
    leaves messages whose rows rolled back. The worker records and charges them; the next
    run finds them recorded and moves the subscriptions on."""
    await add_subscriptions(database_url, Sub("sub_a", 1), Sub("sub_b", 2))
    await streams.provision(nc.jetstream(), worker_settings.nats)

    async def dies(outgoing: list[Outgoing]) -> None:
        raise RuntimeError("the run dies")

    summary = Summary(DAY)
    async with connected(database_url) as conn:
        publisher = _Interrupted(conn, nc, worker_settings.nats, summary, dies)
        with pytest.raises(RuntimeError):
            await schedule(conn, DAY, summary, publisher=publisher)

    assert await attempts(database_url) == {}
    assert await next_dates(database_url) == {"sub_a": DAY, "sub_b": DAY}
    keys = keys_of((1, "2026-12-01"), (2, "2026-12-01"))
    messages = await stream_messages(nc.jetstream(), worker_settings.nats.stream)
    assert set(messages) == {f"charge:{key}" for key in keys}
    async with running_worker(worker_settings):
        await eventually(all_final(database_url, 2), "both charges settled")

    after = await produce(worker_settings, DAY)

    assert (after.due, after.scheduled, after.already_settled, after.published) == (2, 0, 2, 0)
    assert await next_dates(database_url) == {"sub_a": NEXT, "sub_b": NEXT}
    assert await gateway_charges(gateway_sim.url) == dict.fromkeys(keys, 1)


async def test_a_key_a_worker_records_while_its_message_is_published_is_counted_and_marked(
    nc: Client, settings: Settings, database_url: str
) -> None:
    """A worker may claim a message before the producer's insert of its row: the insert
    finds the key taken, the run counts it as already scheduled, and marks the worker's row
    published with the message's sequence all the same."""
    await add_subscriptions(database_url, Sub("sub_a", 1), Sub("sub_b", 2))
    await streams.provision(nc.jetstream(), settings.nats)

    async def claimed(outgoing: list[Outgoing]) -> None:
        await add_attempt(database_url, Sub("sub_a", 1), "pending")

    summary = Summary(DAY)
    async with connected(database_url) as conn:
        publisher = _Interrupted(conn, nc, settings.nats, summary, claimed)
        await schedule(conn, DAY, summary, publisher=publisher)
        rows = await conn.fetch(
            "SELECT order_id, status, published_at >= created_at AS after, published_seq"
            "  FROM charge_attempts ORDER BY order_id"
        )

    assert (summary.scheduled, summary.already_scheduled, summary.published) == (1, 1, 2)
    assert await next_dates(database_url) == {"sub_a": NEXT, "sub_b": NEXT}
    info = await nc.jetstream().stream_info(settings.nats.stream)
    assert [tuple(row) for row in rows] == [(1, "pending", True, 1), (2, "scheduled", True, 2)]
    assert info.state.messages == 2


async def test_a_cron_run_twice_charges_once(
    nc: Client, worker_settings: Settings, database_url: str, gateway_sim: ServedApp
) -> None:
    """Twice, and once more as if the first had died after publishing, before recording it."""
    subs = [Sub(f"sub_{n}", n) for n in range(1, 6)]
    await add_subscriptions(database_url, *subs, Sub("sub_behind", 6, dt.date(2026, 10, 1)))
    keys = {f"{n}:2026-12-01" for n in range(1, 7)} | {"6:2026-10-01", "6:2026-11-01"}

    first = await produce(worker_settings, DAY)
    second = await produce(worker_settings, DAY)
    async with connected(database_url) as conn:
        await conn.execute("UPDATE charge_attempts SET published_at = NULL")
    third = await produce(worker_settings, DAY)

    assert (first.scheduled, first.published) == (8, 8)
    assert (second.due, second.scheduled, second.published, second.deduplicated) == (0, 0, 0, 0)
    assert (third.published, third.deduplicated) == (0, 8)  # dropped by JetStream
    assert set(await stream_messages(nc.jetstream(), worker_settings.nats.stream)) == {
        f"charge:{key}" for key in keys
    }
    async with running_worker(worker_settings):
        await eventually(all_final(database_url, len(keys)), "every charge settled")
    assert await gateway_charges(gateway_sim.url) == dict.fromkeys(keys, 1)
    after = await produce(worker_settings, DAY)
    assert (after.due, after.published, after.exit_code) == (0, 0, 0)


async def test_two_concurrent_runs_charge_once(
    nc: Client, worker_settings: Settings, database_url: str, gateway_sim: ServedApp
) -> None:
    """Small batches interleave the two runs' transactions; SKIP LOCKED splits the rows."""
    await add_subscriptions(
        database_url,
        *(Sub(f"sub_{n:03}", n, dt.date(2026, 11, 1) if n % 3 == 0 else DAY) for n in range(1, 41)),
    )
    keys = {f"{n}:2026-12-01" for n in range(1, 41)} | {f"{n}:2026-11-01" for n in range(3, 41, 3)}

    one, two = await asyncio.gather(
        produce(worker_settings, DAY, batch_size=3), produce(worker_settings, DAY, batch_size=3)
    )

    assert one.due + two.due == 40
    assert one.scheduled + two.scheduled == len(keys)
    assert one.already_scheduled + two.already_scheduled == 0  # no subscription taken twice
    assert one.published + two.published == len(keys)  # the server dropped any second copy
    assert set(await stream_messages(nc.jetstream(), worker_settings.nats.stream)) == {
        f"charge:{key}" for key in keys
    }
    async with running_worker(worker_settings):
        await eventually(all_final(database_url, len(keys)), "every charge settled")
    assert await gateway_charges(gateway_sim.url) == dict.fromkeys(keys, 1)


async def test_a_publish_failing_past_the_horizon_is_counted_and_published_next_run(
    nc: Client, nats_settings: NatsSettings, database_url: str
) -> None:
    """A stream that refuses new messages (full) is a real failure, with no mock."""
    cfg = nats_settings.model_copy(update={"publish_retry_horizon_s": 0.3})
    settings = Settings(nats=cfg, db=DbSettings(url=database_url))
    js = nc.jetstream()
    full = dataclasses.replace(streams.charges_stream(cfg), max_msgs=1, discard=DiscardPolicy.NEW)
    await js.add_stream(full)
    await add_subscriptions(database_url, Sub("sub_1", 1), Sub("sub_2", 2), Sub("sub_3", 3))

    first = await produce(settings, DAY)

    assert (first.scheduled, first.published, first.abandoned, first.exit_code) == (3, 1, 0, 1)
    assert [(f.subscription_id, f.key) for f in first.failed] == [
        ("sub_2", "2:2026-12-01"),
        ("sub_3", "3:2026-12-01"),
    ]
    assert all(f.reason.startswith("not stored after 0.3s of retries: ") for f in first.failed)
    assert await attempts(database_url) == {
        "1:2026-12-01": ("scheduled", True),
        "2:2026-12-01": ("scheduled", False),
        "3:2026-12-01": ("scheduled", False),
    }

    await js.update_stream(dataclasses.replace(full, max_msgs=-1))
    second = await produce(settings, DAY)

    assert (second.scheduled, second.published, second.exit_code) == (0, 2, 0)
    assert set(await stream_messages(js, cfg.stream)) == {
        "charge:1:2026-12-01",
        "charge:2:2026-12-01",
        "charge:3:2026-12-01",
    }


async def test_a_failure_past_the_first_window_keeps_what_was_acked(
    nc: Client, nats_settings: NatsSettings, database_url: str
) -> None:
    """Publishes go out a window at a time: the acked part of a failing window is kept."""
    cfg = nats_settings.model_copy(update={"publish_retry_horizon_s": 0.3})
    js = nc.jetstream()
    half = WINDOW // 2  # the stream takes a window and a half, then refuses
    full = dataclasses.replace(
        streams.charges_stream(cfg), max_msgs=WINDOW + half, discard=DiscardPolicy.NEW
    )
    await js.add_stream(full)
    subs = (Sub(f"sub_{n}", n) for n in range(1, 2 * WINDOW + half + 1))
    await add_subscriptions(database_url, *subs)

    summary = await produce(Settings(nats=cfg, db=DbSettings(url=database_url)), DAY)

    assert (summary.published, len(summary.failed), summary.abandoned) == (
        WINDOW + half,
        half,
        half,
    )
    published = {k for k, (_, done) in (await attempts(database_url)).items() if done}
    assert len(published) == WINDOW + half
    assert {f"charge:{key}" for key in published} == set(await stream_messages(js, cfg.stream))
    async with connected(database_url) as conn:
        [key, *_] = sorted(published)
        order_id, period = key.split(":")
        story = await events.story(conn, int(order_id), dt.date.fromisoformat(period))
        rows = await conn.fetchval("SELECT count(*) FROM charge_events")
    assert [e.kind for e in story] == ["scheduled", "published"]
    assert rows == 0  # the ledger rows tell the producer's steps: no event row per charge


async def test_a_message_is_stored_in_the_configured_stream_or_not_at_all(
    nc: Client, nats_settings: NatsSettings, database_url: str
) -> None:
    """Another stream holding the subject refuses the messages (each names the stream it
    is meant for): nothing is counted as published, nothing is stored elsewhere."""
    cfg = nats_settings.model_copy(update={"publish_retry_horizon_s": 0.3})
    js = nc.jetstream()
    other = dataclasses.replace(streams.charges_stream(cfg), name=f"{cfg.stream}_OTHER")
    await js.add_stream(other)
    await add_subscriptions(database_url, Sub("sub_1", 1), Sub("sub_2", 2))

    summary = Summary(DAY)
    async with connected(database_url) as conn:
        await schedule(conn, DAY, summary, publisher=Publisher(conn, nc, cfg, summary))

    assert (summary.scheduled, summary.published, len(summary.failed)) == (2, 0, 2)
    assert await attempts(database_url) == dict.fromkeys(
        keys_of((1, "2026-12-01"), (2, "2026-12-01")), ("scheduled", False)
    )
    assert (await js.stream_info(other.name)).state.messages == 0


async def test_a_subject_no_stream_holds_fails_each_charge_with_the_reason(
    nc: Client, nats_settings: NatsSettings, database_url: str
) -> None:
    """No stream answers (a 503 status, not an ack): each charge is tried again up to the
    horizon, then reported with why; its row stays unpublished for the next run."""
    cfg = nats_settings.model_copy(update={"publish_retry_horizon_s": 0.3})
    await add_subscriptions(database_url, Sub("sub_1", 1), Sub("sub_2", 2))

    summary = Summary(DAY)
    async with connected(database_url) as conn:
        await schedule(conn, DAY, summary, publisher=Publisher(conn, nc, cfg, summary))

    assert (summary.scheduled, summary.published, summary.deduplicated) == (2, 0, 0)
    assert [(f.key, f.reason) for f in summary.failed] == [
        (f"{n}:2026-12-01", "not stored after 0.3s of retries: nats: no response from stream")
        for n in (1, 2)
    ]
    assert await attempts(database_url) == dict.fromkeys(
        keys_of((1, "2026-12-01"), (2, "2026-12-01")), ("scheduled", False)
    )


async def test_a_lost_connection_fails_at_once_and_leaves_the_rest_scheduled(
    nats_settings: NatsSettings, database_url: str
) -> None:
    """A command's NATS connection is not re-established, so no retry could succeed."""
    await add_subscriptions(database_url, Sub("sub_1", 1), Sub("sub_2", 2))
    lost = await streams.connect(nats_settings, name="tests-lost", reconnect=False)
    await lost.close()
    summary = Summary(DAY)  # the default retry horizon (600 s) is never waited for
    async with connected(database_url) as conn:
        await schedule(conn, DAY, summary)
        await publish_scheduled(conn, lost, nats_settings, summary)

    assert summary.failed == [
        Problem(f"sub_{n}", f"{n}:2026-12-01", "the connection to NATS was lost") for n in (1, 2)
    ]
    assert (summary.scheduled, summary.published, summary.abandoned) == (2, 0, 0)
    assert summary.exit_code == 1
    assert await attempts(database_url) == dict.fromkeys(
        keys_of((1, "2026-12-01"), (2, "2026-12-01")), ("scheduled", False)
    )
