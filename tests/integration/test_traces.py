"""One trace per due charge: opened by `produce`, continued by each delivery, across the HTTP
calls to scoring and the gateway. Real nats-server, PostgreSQL and simulators; the spans
kept by the SDK's in-memory exporter."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from nats.aio.client import Client
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from charge_worker import events, streams
from charge_worker.explain import explain_command
from charge_worker.producer.publish import publish_scheduled
from charge_worker.producer.schedule import produce, schedule
from charge_worker.producer.summary import Summary
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import DbSettings, NatsSettings, Settings
from tests.support.harness import (
    PERIOD,
    consumer_idle,
    dead_letters_at_least,
    due,
    eventually,
    gateway_charges,
    provisioned,
    running_worker,
    set_sim,
    settings_for,
)
from tests.support.producer import DAY, Sub, add_subscriptions, connected
from tests.support.spans import (
    children,
    descendants,
    hex_ids,
    in_trace,
    parent_id,
    recorded_spans,
)

OUTSIDE_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
OUTSIDE_PARENT = "00f067aa0ba902b7"
OUTSIDE = f"00-{OUTSIDE_TRACE}-{OUTSIDE_PARENT}-01"


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    with recorded_spans() as exporter:
        yield exporter


async def _traceparents(database_url: str) -> dict[int, str | None]:
    async with connected(database_url) as conn:
        rows = await conn.fetch("SELECT order_id, traceparent FROM charge_attempts")
    return {row["order_id"]: row["traceparent"] for row in rows}


async def _headers(nc: Client, stream: str) -> dict[str, dict[str, str]]:
    js = nc.jetstream()
    count = (await js.stream_info(stream)).state.messages
    messages = [await js.get_msg(stream, seq) for seq in range(1, count + 1)]
    return {(m.headers or {})["Nats-Msg-Id"]: dict(m.headers or {}) for m in messages}


def _named(spans: list[ReadableSpan] | tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


async def test_produce_opens_one_trace_per_due_charge_kept_by_its_row_and_message(
    nc: Client, nats_settings: NatsSettings, database_url: str, exported: InMemorySpanExporter
) -> None:
    settings = Settings(nats=nats_settings, db=DbSettings(url=database_url))
    await add_subscriptions(database_url, Sub("sub_a", 1), Sub("sub_b", 2))

    await produce(settings, DAY)

    traceparents = await _traceparents(database_url)
    headers = await _headers(nc, nats_settings.stream)
    spans = exported.get_finished_spans()
    subject = nats_settings.subject
    creates = _named(spans, f"create {subject}")
    assert len(creates) == 2
    assert len({hex_ids(s)[0] for s in creates}) == 2  # a trace each
    for order_id, traceparent in traceparents.items():
        assert traceparent is not None
        msg_id = f"charge:{order_id}:{DAY}"
        assert headers[msg_id]["traceparent"] == traceparent  # the message carries the row's
        _, trace_id, span_id, flags = traceparent.split("-")
        assert int(flags, 16) & 1  # sampled
        [create] = [s for s in creates if hex_ids(s) == (trace_id, span_id)]
        assert create.parent is None
        assert create.kind is SpanKind.PRODUCER
        assert create.attributes is not None
        assert dict(create.attributes) == {
            "messaging.system": "nats",
            "messaging.operation.type": "create",
            "messaging.operation.name": "create",
            "messaging.destination.name": subject,
            "messaging.message.id": msg_id,
            "charge_worker.order_id": order_id,
            "charge_worker.billing_period": DAY.isoformat(),
        }
        [send] = children(list(spans), create)
        assert send.name == f"send {subject}"
        assert send.kind is SpanKind.CLIENT
        assert send.attributes is not None
        assert send.attributes["messaging.operation.type"] == "send"
        assert send.attributes["charge_worker.duplicate"] is False
        assert send.attributes["charge_worker.stream_seq"] in (1, 2)
        async with connected(database_url) as conn:
            story = await events.story(conn, order_id, DAY)
        assert [e.detail.get("trace_id") for e in story] == [trace_id, trace_id]


async def test_a_charge_scheduled_untraced_gets_its_trace_when_published_traced(
    nc: Client, nats_settings: NatsSettings, database_url: str
) -> None:
    await add_subscriptions(database_url, Sub("sub_a", 1))
    summary = Summary(DAY)
    js = nc.jetstream()
    await streams.provision(js, nats_settings)
    async with connected(database_url) as conn:
        await schedule(conn, DAY, summary)  # no publisher: scheduled, not sent
        assert await _traceparents(database_url) == {1: None}
        with recorded_spans() as exporter:
            await publish_scheduled(conn, nc, nats_settings, summary)
        create, send = exporter.get_finished_spans()

    [traceparent] = (await _traceparents(database_url)).values()
    assert traceparent is not None
    assert (await _headers(nc, nats_settings.stream))[f"charge:1:{DAY}"]["traceparent"] == (
        traceparent
    )
    assert hex_ids(create) == tuple(traceparent.split("-")[1:3])
    assert parent_id(send) == hex_ids(create)[1]


async def test_explain_names_the_trace_of_a_charge(
    nats_settings: NatsSettings,
    database_url: str,
    exported: InMemorySpanExporter,
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings = Settings(nats=nats_settings, db=DbSettings(url=database_url))
    await add_subscriptions(database_url, Sub("sub_a", 1))
    await produce(settings, DAY)
    [traceparent] = (await _traceparents(database_url)).values()
    assert traceparent is not None
    trace_id = traceparent.split("-")[1]
    capsys.readouterr()

    assert await explain_command(settings, 1, DAY, as_json=True, ask_gateway=False) == 0
    document = json.loads(capsys.readouterr().out)
    assert await explain_command(settings, 1, DAY, as_json=False, ask_gateway=False) == 0
    text = capsys.readouterr().out

    assert document["state"]["traceparent"] == traceparent
    assert [e["detail"]["trace_id"] for e in document["events"]] == [trace_id, trace_id]
    named = [line.split()[2] for line in text.splitlines() if f"trace_id {trace_id}" in line]
    assert named == ["scheduled", "published"]  # the story's events, kind third on a line


async def test_with_tracing_off_no_trace_is_kept_or_sent(
    nc: Client, nats_settings: NatsSettings, database_url: str
) -> None:
    settings = Settings(nats=nats_settings, db=DbSettings(url=database_url))
    await add_subscriptions(database_url, Sub("sub_a", 1))
    await produce(settings, DAY)
    assert await _traceparents(database_url) == {1: None}
    [headers] = (await _headers(nc, nats_settings.stream)).values()
    assert "traceparent" not in headers


def _process_spans(spans: list[ReadableSpan], subject: str) -> list[ReadableSpan]:
    return sorted(
        _named(spans, f"process {subject}"),
        key=lambda s: (s.attributes or {}).get("charge_worker.delivery", 0),
    )


def _http(span: ReadableSpan) -> tuple[str, str, int]:
    """Method, path and status of an HTTP client span (the instrumentation's attributes)."""
    attributes = span.attributes or {}
    url = str(attributes.get("http.url") or attributes.get("url.full"))
    path = "/" + url.split("/", 3)[3].split("?", maxsplit=1)[0]
    status = attributes.get("http.status_code") or attributes.get("http.response.status_code")
    assert isinstance(status, int)
    return span.name, path, status


async def test_the_trace_of_a_charge_redelivered_once(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
    exported: InMemorySpanExporter,
) -> None:
    """The gateway says 429 (Retry-After 2) to the first delivery, charges on the second."""
    settings = settings_for(nats_settings, database_url, gateway_sim.url, scoring_sim.url)
    subject = settings.nats.subject
    await add_subscriptions(database_url, Sub("sub_1", 1))
    await set_sim(gateway_sim.url, error_rates={"429": 1.0}, retry_after_s=2)
    await produce(settings, DAY)
    [traceparent] = (await _traceparents(database_url)).values()
    assert traceparent is not None
    trace_id = traceparent.split("-")[1]

    def deliveries() -> list[ReadableSpan]:
        return _process_spans(in_trace(exported.get_finished_spans(), trace_id), subject)

    async with running_worker(settings):
        await eventually(lambda: len(deliveries()) == 1, "the first delivery's span")
        await set_sim(gateway_sim.url, error_rates={})
        await eventually(lambda: len(deliveries()) == 2, "the second delivery's span")
        await eventually(lambda: consumer_idle(nc, settings.nats), "the charge acked")
    assert await gateway_charges(gateway_sim.url) == {f"1:{DAY}": 1}

    spans = in_trace(exported.get_finished_spans(), trace_id)
    [create] = _named(spans, f"create {subject}")
    first, second = deliveries()
    for number, delivery in enumerate((first, second), start=1):
        assert delivery.kind is SpanKind.CONSUMER
        assert parent_id(delivery) == hex_ids(create)[1]  # both continue the producer's trace
        attributes = delivery.attributes or {}
        assert attributes["messaging.system"] == "nats"
        assert attributes["messaging.operation.type"] == "process"
        assert attributes["messaging.destination.name"] == subject
        assert attributes["messaging.consumer.group.name"] == settings.nats.durable
        assert attributes["messaging.message.id"] == f"charge:1:{DAY}"
        assert attributes["charge_worker.delivery"] == number
        assert attributes["charge_worker.stream_seq"] == 1
        assert attributes["charge_worker.order_id"] == 1
        assert attributes["charge_worker.billing_period"] == DAY.isoformat()

    assert {
        k: v
        for k, v in (first.attributes or {}).items()
        if k.endswith(("outcome", "action", "delay_s"))
    } == {
        "charge_worker.outcome": "rate_limited",
        "charge_worker.action": "nak",
        "charge_worker.delay_s": 2.0,
    }
    assert first.status.status_code is StatusCode.UNSET
    assert (second.attributes or {})["charge_worker.outcome"] == "charged"
    assert (second.attributes or {})["charge_worker.action"] == "ack"
    assert "charge_worker.delay_s" not in (second.attributes or {})

    # first delivery: scoring (its HTTP call under it), then the gateway's 429
    [score] = _named(descendants(spans, first), "charge.score")
    assert (score.attributes or {})["charge_worker.scoring"] == "approve"
    [scoring_call] = children(spans, score)
    assert scoring_call.kind is SpanKind.CLIENT
    assert _http(scoring_call) == ("POST", "/v1/score", 200)
    assert _gateway_calls(spans, first) == [("POST", "/v1/charges", 429)]
    # second delivery: the verdict is kept; an earlier call has no outcome, so a lookup first
    assert not _named(descendants(spans, second), "charge.score")
    assert _gateway_calls(spans, second) == [
        ("GET", "/v1/charges", 200),
        ("POST", "/v1/charges", 200),
    ]
    # the steps of each delivery, as its children: the 429 fails the first's gateway step
    steps = [_steps(spans, delivery) for delivery in (first, second)]
    assert steps == [
        [
            ("charge.claim", StatusCode.UNSET),
            ("charge.score", StatusCode.UNSET),
            ("charge.gateway", StatusCode.ERROR),
            ("charge.settle", StatusCode.UNSET),
        ],
        [
            ("charge.claim", StatusCode.UNSET),
            ("charge.lookup", StatusCode.UNSET),
            ("charge.gateway", StatusCode.UNSET),
            ("charge.settle", StatusCode.UNSET),
        ],
    ]
    [lookup] = _named(children(spans, second), "charge.lookup")
    assert [_http(s) for s in children(spans, lookup)] == [("GET", "/v1/charges", 200)]


def _steps(spans: list[ReadableSpan], delivery: ReadableSpan) -> list[tuple[str, StatusCode]]:
    """The delivery's own steps (its internal child spans), in the order they ended."""
    steps = [s for s in children(spans, delivery) if s.kind is SpanKind.INTERNAL]
    return [(s.name, s.status.status_code) for s in steps]


def _gateway_calls(spans: list[ReadableSpan], delivery: ReadableSpan) -> list[tuple[str, str, int]]:
    """The HTTP calls to the gateway under a delivery's span, at whatever depth."""
    calls = [_http(s) for s in descendants(spans, delivery) if s.kind is SpanKind.CLIENT]
    return [call for call in calls if call[1].startswith("/v1/charges")]


async def test_claim_and_settle_are_spans_of_the_delivery(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
    exported: InMemorySpanExporter,
) -> None:
    settings = settings_for(nats_settings, database_url, gateway_sim.url, scoring_sim.url)
    await add_subscriptions(database_url, Sub("sub_1", 1))
    await produce(settings, DAY)
    [traceparent] = (await _traceparents(database_url)).values()
    assert traceparent is not None
    trace_id = traceparent.split("-")[1]
    async with running_worker(settings):
        await eventually(lambda: consumer_idle(nc, settings.nats), "the charge acked")
        await eventually(
            lambda: bool(
                _process_spans(
                    in_trace(exported.get_finished_spans(), trace_id), settings.nats.subject
                )
            ),
            "the delivery's span",
        )
    spans = in_trace(exported.get_finished_spans(), trace_id)
    [delivery] = _process_spans(spans, settings.nats.subject)
    assert [name for name, _ in _steps(spans, delivery)] == [
        "charge.claim",
        "charge.score",
        "charge.gateway",
        "charge.settle",
    ]


async def test_the_trace_of_a_dead_lettered_message(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
    exported: InMemorySpanExporter,
) -> None:
    """A poison message from someone else's trace: its delivery continues that trace and
    says why it was dead-lettered."""
    settings = settings_for(nats_settings, database_url, gateway_sim.url, scoring_sim.url)
    js = await provisioned(nc, settings)
    headers = {"Nats-Msg-Id": "poison:1", "traceparent": OUTSIDE}
    async with running_worker(settings):
        await js.publish(settings.nats.subject, b'{"schema": "charge.due/v1"}', headers=headers)
        await eventually(lambda: dead_letters_at_least(nc, settings.nats), "the dead letter")
        await eventually(
            lambda: bool(in_trace(exported.get_finished_spans(), OUTSIDE_TRACE)), "its span"
        )
    [delivery] = in_trace(exported.get_finished_spans(), OUTSIDE_TRACE)
    assert delivery.name == f"process {settings.nats.subject}"
    assert parent_id(delivery) == OUTSIDE_PARENT
    attributes = delivery.attributes or {}
    assert attributes["charge_worker.outcome"] == "poison"
    assert attributes["charge_worker.action"] == "deadletter"
    assert attributes["charge_worker.dlq_reason"] == "poison"
    assert attributes["charge_worker.delivery"] == 1
    assert "charge_worker.order_id" not in attributes  # nothing could be read from the body
    assert str(attributes["charge_worker.error"]).startswith("order_id")
    assert delivery.status.status_code is StatusCode.ERROR
    assert delivery.status.description == attributes["charge_worker.error"]


async def test_a_duplicate_delivery_s_refused_claim_is_no_error(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
    exported: InMemorySpanExporter,
) -> None:
    """A second copy of a charge already settled: its claim is refused, which is an answer
    (the delivery acks it as a duplicate), not a fault of the claim."""
    settings = settings_for(nats_settings, database_url, gateway_sim.url, scoring_sim.url)
    js = await provisioned(nc, settings)
    subject = settings.nats.subject

    async def charged() -> bool:
        async with connected(database_url) as conn:
            status = await conn.fetchval("SELECT status FROM charge_attempts WHERE order_id = 1")
        return bool(status == "succeeded")

    async with running_worker(settings):
        await js.publish(subject, due(1), headers={"Nats-Msg-Id": "copy:1"})
        # settled in the ledger first: an idle consumer alone was once seen before the
        # first delivery's settle, and the copy then met its lease instead
        await eventually(charged, "the charge settled")
        await eventually(lambda: consumer_idle(nc, settings.nats), "the charge acked")
        await js.publish(subject, due(1), headers={"Nats-Msg-Id": "copy:2", "traceparent": OUTSIDE})
        await eventually(
            lambda: bool(
                _process_spans(in_trace(exported.get_finished_spans(), OUTSIDE_TRACE), subject)
            ),
            "the copy's span",
        )
    spans = in_trace(exported.get_finished_spans(), OUTSIDE_TRACE)
    [delivery] = _process_spans(spans, subject)
    assert (delivery.attributes or {})["charge_worker.outcome"] == "duplicate"
    assert (delivery.attributes or {})["charge_worker.action"] == "ack"
    assert delivery.status.status_code is StatusCode.UNSET
    [claim] = children(spans, delivery)
    assert claim.name == "charge.claim"
    assert claim.status.status_code is StatusCode.UNSET
    assert not claim.events
    assert (claim.attributes or {})["charge_worker.ended_by"] == "AlreadySettled"
    assert await gateway_charges(gateway_sim.url) == {f"1:{PERIOD}": 1}
