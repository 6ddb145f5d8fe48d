"""Reading and replaying dead letters against a real nats-server."""

from __future__ import annotations

import json

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from charge_worker import streams
from charge_worker.dlq import DeadLetters, DeadLetterSummary, opened, table
from charge_worker.errors import DependencyUnavailable, ProvisioningError
from charge_worker.sandbox.embedded import free_port
from charge_worker.settings import NatsSettings

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def due(order_id: int, period: str = "2026-12-01") -> bytes:
    return json.dumps(
        {"schema": "charge.due/v1", "order_id": order_id, "billing_period": period}
    ).encode()


@pytest.fixture
async def js(nc: Client, nats_settings: NatsSettings) -> JetStreamContext:
    js = nc.jetstream()
    await streams.provision(js, nats_settings)
    return js


@pytest.fixture
def dead(js: JetStreamContext, nats_settings: NatsSettings) -> DeadLetters:
    return DeadLetters(js, nats_settings)


async def write(
    dead: DeadLetters,
    body: bytes,
    reason: str = "poison",
    *,
    stream_seq: int = 1,
    original: dict[str, str] | None = None,
    error: str = "broken",
) -> None:
    await dead.write(
        body,
        reason=reason,
        error=error,
        stream_seq=stream_seq,
        num_delivered=1,
        original=original,
    )


async def test_summaries_read_the_envelope_and_the_charge_and_skip_deleted(
    dead: DeadLetters, js: JetStreamContext, nats_settings: NatsSettings
) -> None:
    await write(dead, due(41), "max_deliveries", stream_seq=7)
    await write(dead, b"gone", stream_seq=8)
    await write(dead, b"\xff not json", stream_seq=9, error="not UTF-8 JSON")
    await write(dead, b'{"order_id": [1], "billing_period": "2026-12-01"}', stream_seq=10)
    await js.delete_msg(nats_settings.dlq_stream, 2)

    page = await dead.summaries()

    assert not page.more
    assert [row.seq for row in page.items] == [1, 3, 4]
    first, poison, odd = page.items
    assert first.reason == "max_deliveries"
    assert (first.stream_seq, first.num_delivered) == (7, 1)
    assert (first.order_id, first.billing_period) == (41, "2026-12-01")
    assert first.dead_at is not None
    assert first.dead_at.endswith("Z")
    assert (poison.order_id, poison.billing_period, poison.error) == (None, None, "not UTF-8 JSON")
    assert (odd.order_id, odd.billing_period) == (None, "2026-12-01")


async def test_reason_filter_and_limit(dead: DeadLetters) -> None:
    for order_id in range(1, 6):
        await write(
            dead, due(order_id), "rejected" if order_id % 2 else "poison", stream_seq=order_id
        )

    limited = await dead.summaries(reason="rejected", limit=2)
    exact = await dead.summaries(reason="rejected", limit=3)

    assert ([row.order_id for row in limited.items], limited.more) == ([1, 3], True)
    assert ([row.order_id for row in exact.items], exact.more) == ([1, 3, 5], False)
    assert await dead.seqs("poison") == [2, 4]
    assert await dead.seqs() == [1, 2, 3, 4, 5]


async def test_an_empty_dead_letter_stream_has_nothing(dead: DeadLetters) -> None:
    page = await dead.summaries()
    assert (page.items, page.more) == ([], False)
    assert await dead.seqs() == []
    assert await dead.get(1) is None


async def test_get_returns_headers_and_body_byte_for_byte(dead: DeadLetters) -> None:
    body = b"\x00\xff raw bytes"
    await write(dead, body, original={"Nats-Msg-Id": "charge:1:2026-12-01"}, stream_seq=3)

    letter = await dead.get(1)

    assert letter is not None
    assert letter.body == body
    assert letter.headers["Dlq-Reason"] == "poison"
    assert letter.headers["Dlq-Orig-Msg-Id"] == "charge:1:2026-12-01"
    assert letter.headers["Nats-Msg-Id"] == "dlq:3"
    assert letter.pretty_body() == repr(body)
    assert await dead.get(2) is None


async def test_replay_republishes_the_original_body_with_a_fresh_id(
    dead: DeadLetters, js: JetStreamContext, nats_settings: NatsSettings
) -> None:
    body = due(48291)
    original = {"Nats-Msg-Id": "charge:48291:2026-12-01", "traceparent": TRACEPARENT}
    await write(dead, b"no trace", stream_seq=4)
    await write(dead, body, "rejected", stream_seq=5, original=original)
    seen: list[tuple[int, str]] = []

    report = await dead.replay([2, 1], on_each=lambda seq, outcome: seen.append((seq, outcome)))

    assert (report.replayed, report.duplicates, report.missing) == ([2, 1], [], [])
    assert seen == [(2, "replayed"), (1, "replayed")]
    traced = await js.get_msg(nats_settings.stream, 1)
    assert traced.subject == nats_settings.subject
    assert traced.data == body  # byte for byte
    assert traced.headers == {"Nats-Msg-Id": "replay:2", "traceparent": TRACEPARENT}
    untraced = await js.get_msg(nats_settings.stream, 2)
    assert (untraced.data, untraced.headers) == (b"no trace", {"Nats-Msg-Id": "replay:1"})
    assert (await js.stream_info(nats_settings.dlq_stream)).state.messages == 2  # kept


async def test_a_second_replay_is_a_duplicate_and_unknown_seqs_are_missing(
    dead: DeadLetters, js: JetStreamContext, nats_settings: NatsSettings
) -> None:
    await write(dead, due(7))
    first = await dead.replay([1])

    again = await dead.replay([1, 99])

    assert first.replayed == [1]
    assert (again.replayed, again.duplicates, again.missing) == ([], [1], [99])
    assert again.summary() == "replayed 0, skipped as duplicates 1, missing 1 (seq 99)"
    assert (await js.stream_info(nats_settings.stream)).state.messages == 1


async def test_a_missing_dead_letter_stream_is_a_provisioning_error(
    nc: Client, nats_settings: NatsSettings
) -> None:
    dead = DeadLetters(nc.jetstream(), nats_settings)  # nothing provisioned
    with pytest.raises(ProvisioningError, match="charge-worker provision"):
        await dead.summaries()
    with pytest.raises(ProvisioningError, match=nats_settings.dlq_stream):
        await dead.get(1)


async def test_replay_without_a_charges_stream_stops_naming_its_progress(
    nc: Client, nats_settings: NatsSettings
) -> None:
    js = nc.jetstream()
    await js.add_stream(streams.dlq_stream(nats_settings))  # the DLQ only
    dead = DeadLetters(js, nats_settings)
    await write(dead, due(1))
    with pytest.raises(DependencyUnavailable, match=r"stopped at dead letter 1 \(replayed 0"):
        await dead.replay([1])


async def test_opened_fails_fast_when_nats_is_down() -> None:
    cfg = NatsSettings(url=f"nats://127.0.0.1:{free_port()}")
    with pytest.raises(DependencyUnavailable, match="cannot connect to NATS"):
        async with opened(cfg):
            pass


async def test_opened_reads_the_configured_streams(
    dead: DeadLetters, nats_settings: NatsSettings
) -> None:
    await write(dead, due(3))
    async with opened(nats_settings) as own:
        assert await own.seqs() == [1]


def test_table_cuts_the_error_to_the_width() -> None:
    row = DeadLetterSummary(
        seq=12,
        dead_at="2026-12-01T00:00:05Z",
        reason="poison",
        stream_seq=None,
        num_delivered=1,
        order_id=None,
        billing_period=None,
        error="x" * 300,
    )
    header, line = table([row], width=120)
    assert header.split() == [
        "SEQ",
        "DEAD",
        "AT",
        "REASON",
        "ORIG",
        "SEQ",
        "DELIV",
        "ORDER",
        "PERIOD",
        "ERROR",
    ]
    assert len(line) == 120
    assert line.endswith("x…")
    assert line.split()[:7] == ["12", "2026-12-01T00:00:05Z", "poison", "-", "1", "-", "-"]


async def test_a_non_ascii_error_is_written_ascii_safe_and_listed(dead: DeadLetters) -> None:
    """Found in production: one dead letter whose Dlq-Error held non-ASCII text broke
    `dlq list` (nats-py reads such a header back as an email `Header`, not a string)."""
    await write(dead, due(1), error="field 'überweisung' appears more than once 💳")

    letter = await dead.get(1)
    page = await dead.summaries()

    assert letter is not None
    escaped = "field '\\xfcberweisung' appears more than once \\U0001f4b3"
    assert letter.headers["Dlq-Error"] == escaped
    assert all(isinstance(value, str) for value in letter.headers.values())
    assert [row.error for row in page.items] == [escaped]
    assert table(page.items, width=200)[1].endswith(escaped)


async def test_headers_written_by_anyone_are_read_as_strings(
    dead: DeadLetters, js: JetStreamContext, nats_settings: NatsSettings
) -> None:
    """A dead letter written before the fix, or by another tool, with non-ASCII headers."""
    headers = {
        "Nats-Msg-Id": "dlq:9",
        "Dlq-Reason": "poison",
        "Dlq-Error": "Betrag ungültig: 💳",
        "Dlq-Orig-Msg-Id": "заказ-9",
    }
    await js.publish(nats_settings.dlq_subject, due(9), headers=headers)

    letter = await dead.get(1)
    page = await dead.summaries()

    assert letter is not None
    assert letter.headers == headers
    assert [row.error for row in page.items] == ["Betrag ungültig: 💳"]
