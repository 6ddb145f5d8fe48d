"""One log format for every logger: structlog's and the standard library's, as JSON lines."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import re
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
from opentelemetry.sdk.trace import TracerProvider
from starlette.applications import Starlette

from charge_worker import http, logs, tracing
from charge_worker.settings import LogSettings, WebhookSettings
from charge_worker.webhooks import connections
from tests.support.cli import logging_put_back


@pytest.fixture
def json_logs(capsys: pytest.CaptureFixture[str]) -> Iterator[pytest.CaptureFixture[str]]:
    """logs.configure as `run` does it, once the test runs (pytest's capture of stderr is
    in place only then); everything put back after."""
    with logging_put_back():
        yield capsys


def _configure() -> None:
    logs.configure(LogSettings(log_format="json", log_level="info"))


def _lines(capture: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    err = capture.readouterr().err
    return [json.loads(line) for line in err.splitlines()]


def test_stdlib_loggers_write_the_same_json_lines_with_name_and_level(
    json_logs: pytest.CaptureFixture[str],
) -> None:
    _configure()
    structlog.contextvars.bind_contextvars(stream_seq=7, delivery=2)
    structlog.get_logger("charge_worker.worker.consumer").info("charge.settled", outcome="charged")
    logging.getLogger("uvicorn.error").warning("Invalid HTTP request received.")
    logging.getLogger("nats.aio.client").error("nats: encountered error")
    logging.getLogger("asyncpg.pool").info("chatter")  # libraries' info lines are left out
    try:
        int("boom")
    except ValueError:
        logging.getLogger("asyncio").exception("Task exception was never retrieved")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("careful", UserWarning, stacklevel=1)

    lines = _lines(json_logs)

    assert [(line["logger"], line["level"]) for line in lines] == [
        ("charge_worker.worker.consumer", "info"),
        ("uvicorn.error", "warning"),
        ("nats.aio.client", "error"),
        ("asyncio", "error"),
        ("py.warnings", "warning"),
    ]
    assert all(line["stream_seq"] == 7 and line["delivery"] == 2 for line in lines)
    assert all("timestamp" in line and "event" in line for line in lines)
    assert "ValueError: invalid literal" in lines[3]["exception"]


def test_a_line_written_inside_a_recorded_span_names_it(
    json_logs: pytest.CaptureFixture[str],
) -> None:
    _configure()
    provider = TracerProvider()
    log = structlog.get_logger("charge_worker.test")
    with tracing.recorded(provider):
        with tracing.span("process charges.due") as span:
            log.info("inside")
            logging.getLogger("aiohttp.client").warning("inside too")
        log.info("outside")
    provider.shutdown()

    inside, too, outside = _lines(json_logs)

    context = span.get_span_context()
    ids = {"trace_id": f"{context.trace_id:032x}", "span_id": f"{context.span_id:016x}"}
    assert inside.items() >= ids.items()
    assert too.items() >= ids.items()
    assert "trace_id" not in outside
    assert "span_id" not in outside


def test_without_tracing_no_line_has_trace_ids(json_logs: pytest.CaptureFixture[str]) -> None:
    _configure()
    with tracing.span("nothing"):
        structlog.get_logger().info("plain")
    [line] = _lines(json_logs)
    assert line["logger"] == "charge_worker"
    assert "trace_id" not in line


def test_uvicorn_lines_stay_json_once_a_probe_server_is_built(
    json_logs: pytest.CaptureFixture[str],
) -> None:
    _configure()
    http.server(Starlette())
    logging.getLogger("uvicorn.error").warning("Invalid HTTP request received.")
    [line] = _lines(json_logs)
    assert (line["logger"], line["level"]) == ("uvicorn.error", "warning")


def test_uvicorn_lines_stay_json_once_the_webhook_server_is_built(
    json_logs: pytest.CaptureFixture[str],
) -> None:
    _configure()
    connections.server(Starlette(), WebhookSettings(), on_slow=lambda: None)
    logging.getLogger("uvicorn.error").warning("Invalid HTTP request received.")
    [line] = _lines(json_logs)
    assert (line["logger"], line["level"]) == ("uvicorn.error", "warning")


def test_bound_fields_reach_the_tasks_started_after_and_end_with_their_task(
    json_logs: pytest.CaptureFixture[str],
) -> None:
    _configure()
    log = structlog.get_logger("charge_worker.test")

    async def delivery(seq: int) -> None:
        structlog.contextvars.bind_contextvars(stream_seq=seq)
        await asyncio.create_task(child())  # started after the bind: carries it
        structlog.contextvars.bind_contextvars(order_id=seq * 10)
        log.info("settled", stream_seq=-seq)  # a line's own field wins

    async def child() -> None:
        log.info("child")

    async def main() -> None:
        structlog.contextvars.bind_contextvars(worker="w1")
        # a task of its own for each, as the consumer gives every message
        await asyncio.gather(delivery(1), delivery(2))
        log.info("main")

    asyncio.run(main())
    fields = [
        {k: line[k] for k in ("event", "worker", "stream_seq", "order_id") if k in line}
        for line in _lines(json_logs)
    ]
    assert sorted(fields, key=str) == sorted(
        [
            {"event": "child", "worker": "w1", "stream_seq": 1},
            {"event": "child", "worker": "w1", "stream_seq": 2},
            {"event": "settled", "worker": "w1", "stream_seq": -1, "order_id": 10},
            {"event": "settled", "worker": "w1", "stream_seq": -2, "order_id": 20},
            {"event": "main", "worker": "w1"},
        ],
        key=str,
    )


def test_two_concurrent_deliveries_never_see_each_others_fields(
    json_logs: pytest.CaptureFixture[str],
) -> None:
    _configure()
    log = structlog.get_logger("charge_worker.test")

    async def delivery(seq: int, both_bound: asyncio.Barrier) -> None:
        structlog.contextvars.bind_contextvars(stream_seq=seq, delivery=1)
        await both_bound.wait()  # the other one has bound its own by now
        structlog.contextvars.bind_contextvars(order_id=f"o-{seq}")
        await both_bound.wait()
        log.info("charge.settled")

    async def main() -> None:
        both_bound = asyncio.Barrier(2)
        await asyncio.gather(delivery(1, both_bound), delivery(2, both_bound))

    asyncio.run(main())
    lines = _lines(json_logs)
    assert sorted((line["stream_seq"], line["order_id"]) for line in lines) == [
        (1, "o-1"),
        (2, "o-2"),
    ]


def test_timestamps_are_utc_iso_8601_to_the_microsecond(
    json_logs: pytest.CaptureFixture[str],
) -> None:
    _configure()
    before = dt.datetime.now(dt.UTC)
    structlog.get_logger().info("now")
    after = dt.datetime.now(dt.UTC)
    [line] = _lines(json_logs)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", line["timestamp"])
    assert before <= dt.datetime.fromisoformat(line["timestamp"]) <= after


def test_a_timestamp_on_a_whole_second_keeps_its_six_digits() -> None:
    whole = dt.datetime(2026, 12, 1, 9, 30, tzinfo=dt.UTC)
    assert whole.strftime(logs.TIMESTAMP_FORMAT) == "2026-12-01T09:30:00.000000Z"
