"""Traces and logs of the commands as processes: spans over the wire to an OTLP/HTTP
receiver, and every line on stderr JSON, a delivery's lines bound to it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client

from charge_worker.sandbox.embedded import free_port
from charge_worker.sandbox.serve import ServedApp
from charge_worker.settings import NatsSettings, Settings
from tests.support.harness import (
    WorkerProcess,
    due,
    eventually,
    gateway_charges,
    provisioned,
    settings_env,
    settings_for,
)
from tests.support.otlp import OtlpReceiver, Received
from tests.support.producer import DAY, Sub, add_subscriptions

QUICK_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # ms: spans leave a running worker at once
OUTSIDE_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
OUTSIDE = f"00-{OUTSIDE_TRACE}-00f067aa0ba902b7-01"
OTHER_TRACE = "0af7651916cd43dd8448eb211c80319c"
OTHER = f"00-{OTHER_TRACE}-b7ad6b7169203331-01"


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as served:
        yield served


async def _produce(settings: Settings, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("CHARGE_WORKER_", "OTEL_"))}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "charge_worker",
        "produce",
        "--date",
        DAY.isoformat(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=clean | settings_env(settings) | env,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode is not None
    return subprocess.CompletedProcess([], proc.returncode, out.decode(), err.decode())


async def _stop(worker: WorkerProcess) -> None:
    worker.proc.send_signal(signal.SIGTERM)
    assert await worker.exited() == 0


def _lines(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


async def test_produce_and_run_send_one_trace_over_otlp_http(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
    receiver: OtlpReceiver,
    spawn: list[WorkerProcess],
    tmp_path: Path,
) -> None:
    """What the OTLP/HTTP exporter really sends, decoded: `produce` flushes its spans as it
    exits; the worker's delivery continues the same trace, its HTTP calls under it."""
    settings = settings_for(nats_settings, database_url, gateway_sim.url, scoring_sim.url)
    await add_subscriptions(database_url, Sub("sub_1", 1))
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, **QUICK_EXPORT}

    produced = await _produce(settings, **otel)

    assert produced.returncode == 0, produced.stderr
    subject = settings.nats.subject
    [create] = [s for s in receiver.spans() if s.name == f"create {subject}"]
    [send] = [s for s in receiver.spans() if s.name == f"send {subject}"]
    assert (create.kind, create.parent_id, create.trace_id) == ("PRODUCER", "", send.trace_id)
    assert (send.kind, send.parent_id) == ("CLIENT", create.span_id)
    assert create.attributes["messaging.message.id"] == f"charge:1:{DAY}"
    assert create.scope == "charge_worker"
    assert create.resource["service.name"] == "charge-worker"
    assert create.resource["charge_worker.command"] == "produce"

    worker = WorkerProcess(settings, tmp_path / "worker.log", **otel)
    spawn.append(worker)

    def in_trace() -> list[Received]:
        return [s for s in receiver.spans() if s.trace_id == create.trace_id]

    def delivered() -> bool:
        return any(s.name == f"process {subject}" for s in in_trace())

    await eventually(delivered, "the delivery's span at the receiver")
    await _stop(worker)
    assert await gateway_charges(gateway_sim.url) == {f"1:{DAY}": 1}
    [delivery] = [s for s in in_trace() if s.name == f"process {subject}"]
    assert (delivery.kind, delivery.parent_id, delivery.status) == (
        "CONSUMER",
        create.span_id,
        "UNSET",
    )
    assert delivery.resource["charge_worker.command"] == "run"
    assert delivery.attributes["messaging.system"] == "nats"
    assert delivery.attributes["messaging.operation.type"] == "process"
    assert delivery.attributes["charge_worker.delivery"] == 1
    assert delivery.attributes["charge_worker.outcome"] == "charged"
    assert delivery.attributes["charge_worker.action"] == "ack"
    under = _descendants(in_trace(), delivery)
    [score] = [s for s in under if s.name == "charge.score"]
    [scoring_call] = [s for s in under if s.parent_id == score.span_id]
    calls = {s.attributes["http.url"].rsplit("/", 2)[-1]: s for s in under if s.kind == "CLIENT"}
    assert calls.keys() == {"score", "charges"}
    assert calls["score"] == scoring_call
    assert {(s.name, s.scope) for s in calls.values()} == {
        ("POST", "opentelemetry.instrumentation.aiohttp_client")
    }


def _descendants(spans: list[Received], parent: Received) -> list[Received]:
    below = [s for s in spans if s.parent_id == parent.span_id]
    return below + [d for child in below for d in _descendants(spans, child)]


async def test_every_line_of_a_worker_is_json_and_a_delivery_s_lines_are_bound_to_it(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
    spawn: list[WorkerProcess],
    tmp_path: Path,
) -> None:
    """A poison message and a charge whose processing crashes, with tracing on and its
    collector unreachable (the exporter's own stdlib warnings are among the lines)."""
    settings = settings_for(nats_settings, database_url, gateway_sim.url, scoring_sim.url)
    js = await provisioned(nc, settings)
    subject = settings.nats.subject
    await js.publish(subject, b"not json", headers={"traceparent": OUTSIDE})
    await js.publish(subject, due(2), headers={"traceparent": OTHER})
    log = tmp_path / "worker.log"
    worker = WorkerProcess(
        settings,
        log,
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{free_port()}",
        OTEL_EXPORTER_OTLP_TIMEOUT="1",  # s: give up on the absent collector quickly
        CHARGE_WORKER_FAILPOINTS="after_claim:raise",
        **QUICK_EXPORT,
    )
    spawn.append(worker)

    def settled() -> list[dict[str, Any]]:
        return [line for line in _lines(log) if line["event"] == "charge.settled"]

    def exporter_complained() -> bool:
        return any(line["logger"].startswith("opentelemetry") for line in _lines(log))

    await eventually(lambda: len(settled()) >= 2, "both deliveries' canonical lines")
    await eventually(exporter_complained, "the exporter's warning about its collector")
    await _stop(worker)

    lines = _lines(log)  # every line parses: nothing but JSON on stderr
    for line in lines:
        assert {"event", "level", "logger", "timestamp"} <= line.keys(), line
    foreign = [line for line in lines if line["logger"].startswith("opentelemetry")]
    assert all(line["level"] in ("warning", "error") for line in foreign)
    poison, crashed = sorted(settled(), key=lambda line: line["stream_seq"])
    assert poison.items() >= {"stream_seq": 1, "delivery": 1, "order_id": None}.items()
    assert poison["trace_id"] == OUTSIDE_TRACE
    expected = {"stream_seq": 2, "delivery": 1, "order_id": 2, "billing_period": str(DAY)}
    assert crashed.items() >= expected.items()
    assert crashed["trace_id"] == OTHER_TRACE
    assert len(poison["span_id"]) == len(crashed["span_id"]) == 16
    [crash] = [line for line in lines if line["event"] == "charge.crashed"]
    assert crash.items() >= {"stream_seq": 2, "delivery": 1, "trace_id": OTHER_TRACE}.items()
    assert crash["span_id"] == crashed["span_id"]  # the delivery's span, then its line
    assert "FailpointTriggered" in crash["exception"]
    # the context ends with the canonical line: the worker's own lines after it have none
    [stopped] = [line for line in lines if line["event"] == "worker.stopped"]
    assert not stopped.keys() & {"stream_seq", "delivery", "order_id", "billing_period"}
    assert "trace_id" not in stopped


async def test_a_line_written_while_the_charge_is_processed_names_the_charge(
    nc: Client,
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
    spawn: list[WorkerProcess],
    tmp_path: Path,
) -> None:
    settings = settings_for(nats_settings, database_url, gateway_sim.url, scoring_sim.url)
    js = await provisioned(nc, settings)
    await js.publish(settings.nats.subject, due(3))
    log = tmp_path / "worker.log"
    worker = WorkerProcess(settings, log, CHARGE_WORKER_FAILPOINTS="after_claim:raise")
    spawn.append(worker)

    def crashed() -> list[dict[str, Any]]:
        return [line for line in _lines(log) if line["event"] == "charge.crashed"]

    await eventually(crashed, "the crash's line")
    await _stop(worker)
    expected = {"stream_seq": 1, "delivery": 1, "order_id": 3, "billing_period": str(DAY)}
    assert crashed()[0].items() >= expected.items()


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"OTEL_TRACES_EXPORTER": "jaeger"}, "OTEL_TRACES_EXPORTER"),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_TRACES_SAMPLER": "most"},
            "OTEL_TRACES_SAMPLER",
        ),
    ],
)
async def test_a_command_asked_for_traces_it_cannot_make_exits_1_naming_the_variable(
    nats_settings: NatsSettings,
    database_url: str,
    gateway_sim: ServedApp,
    scoring_sim: ServedApp,
    env: dict[str, str],
    named: str,
) -> None:
    settings = settings_for(nats_settings, database_url, gateway_sim.url, scoring_sim.url)
    produced = await _produce(settings, **env)
    assert produced.returncode == 1
    assert produced.stdout == ""
    [line] = produced.stderr.splitlines()
    assert line.startswith(f"Error: SettingsError: {named}: ")
