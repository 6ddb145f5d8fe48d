"""Tracing is configured by the standard OTEL_* variables only, and off costs nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import INVALID_SPAN, SpanKind, StatusCode

from charge_worker import tracing
from charge_worker.errors import SettingsError

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
ENDPOINT = "http://127.0.0.1:4318"


@pytest.mark.parametrize(
    ("environ", "exporters"),
    [
        ({}, None),
        ({"OTEL_SERVICE_NAME": "billing"}, None),  # a name alone sends nothing anywhere
        ({"OTEL_TRACES_SAMPLER": "always_on"}, None),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, ("otlp",)),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{ENDPOINT}/v1/traces"}, ("otlp",)),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, ("otlp",)),
        ({"OTEL_TRACES_EXPORTER": "console"}, ("console",)),
        ({"OTEL_TRACES_EXPORTER": "otlp, console"}, ("otlp", "console")),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, None),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, None),
        ({"OTEL_SDK_DISABLED": "false", "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, ("otlp",)),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ""}, None),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT,
                "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                "OTEL_TRACES_SAMPLER_ARG": "0.25",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            },
            ("otlp",),
        ),
    ],
)
def test_tracing_is_on_only_when_a_variable_says_where_spans_go(
    environ: dict[str, str], exporters: tuple[str, ...] | None
) -> None:
    wanted = tracing.plan(environ)
    assert (wanted.exporters if wanted else None) == exporters


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"OTEL_TRACES_EXPORTER": "jaeger"}, "OTEL_TRACES_EXPORTER"),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, "OTEL_TRACES_SAMPLER": "sometimes"},
            "OTEL_TRACES_SAMPLER",
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT,
                "OTEL_TRACES_SAMPLER": "traceidratio",
                "OTEL_TRACES_SAMPLER_ARG": "half",
            },
            "OTEL_TRACES_SAMPLER_ARG",
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT,
                "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                "OTEL_TRACES_SAMPLER_ARG": "1.5",
            },
            "OTEL_TRACES_SAMPLER_ARG",
        ),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"},
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        ),
    ],
)
def test_a_value_that_cannot_be_honoured_fails_naming_the_variable(
    environ: dict[str, str], named: str
) -> None:
    with pytest.raises(SettingsError, match=f"^{named}: "):
        tracing.plan(environ)


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", **env},
        check=False,
    )


def test_off_imports_nothing_of_the_sdk_and_its_helpers_do_nothing() -> None:
    result = _python(
        """
        import sys
        from charge_worker import cli, logs, tracing
        from charge_worker.worker import run  # the worker's whole import graph
        from charge_worker.producer import produce_command

        tracing.setup("run")
        with tracing.span("x") as a, tracing.continued("y", None) as b:
            pass
        assert not tracing.enabled() and tracing.current_ids() is None
        assert tracing.traceparent_of(tracing.start("z")) is None
        loaded = sorted(
            m for m in sys.modules
            if m.startswith(("opentelemetry.sdk", "opentelemetry.instrumentation",
                             "opentelemetry.exporter"))
        )
        print(loaded)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_asked_for_without_the_otel_extra_fails_naming_the_variable() -> None:
    result = _python(
        """
        import sys
        sys.modules["opentelemetry.sdk"] = None  # as if the otel extra were not installed
        from charge_worker import tracing
        from charge_worker.errors import SettingsError
        try:
            tracing.setup("run")
        except SettingsError as error:
            print(error)
        """,
        OTEL_EXPORTER_OTLP_ENDPOINT=ENDPOINT,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("OTEL_EXPORTER_OTLP_ENDPOINT: tracing needs the otel extra")


def test_the_console_exporter_writes_one_json_line_per_span_to_stderr() -> None:
    result = _python(
        """
        from charge_worker import tracing
        tracing.setup("produce")
        with tracing.span("outer"):
            with tracing.span("inner"):
                pass
        tracing.shutdown()
        """,
        OTEL_TRACES_EXPORTER="console",
        OTEL_SERVICE_NAME="billing-test",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    spans = [json.loads(line) for line in result.stderr.splitlines()]
    assert [s["name"] for s in spans] == ["inner", "outer"]
    assert spans[0]["parent_id"] == spans[1]["context"]["span_id"]
    resource = spans[0]["resource"]["attributes"]
    assert resource["service.name"] == "billing-test"
    assert resource["charge_worker.command"] == "produce"


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with tracing.recorded(provider):
        yield exporter
    provider.shutdown()


def test_a_message_span_continues_the_trace_its_traceparent_names(
    exported: InMemorySpanExporter,
) -> None:
    with tracing.continued("process charges.due", TRACEPARENT, {"a": 1}) as span:
        assert tracing.current_ids() == (TRACE_ID, f"{span.get_span_context().span_id:016x}")
        with tracing.span("child"):
            pass
    child, parent = exported.get_finished_spans()
    assert parent.kind is SpanKind.CONSUMER
    assert parent.context is not None
    assert child.parent is not None
    assert f"{parent.context.trace_id:032x}" == TRACE_ID
    assert parent.parent is not None
    assert parent.parent.span_id == 0x00F067AA0BA902B7
    assert child.parent.span_id == parent.context.span_id
    assert parent.attributes == {"a": 1}


def test_a_started_span_names_itself_in_a_traceparent(exported: InMemorySpanExporter) -> None:
    root = tracing.start("create charges.due", kind=SpanKind.PRODUCER)
    named = tracing.traceparent_of(root)
    root.end()
    assert named is not None
    child = tracing.start("send charges.due", named)
    child.end()
    first, second = exported.get_finished_spans()
    assert second.parent is not None
    assert first.context is not None
    assert second.parent.span_id == first.context.span_id
    assert tracing.trace_id(named) == f"{first.context.trace_id:032x}"


async def test_a_traced_coroutine_is_one_span(exported: InMemorySpanExporter) -> None:
    @tracing.traced("charge.claim")
    async def claim(x: int) -> int:
        return x + 1

    assert await claim(1) == 2
    assert [s.name for s in exported.get_finished_spans()] == ["charge.claim"]


def test_off_the_helpers_give_nothing() -> None:
    assert not tracing.enabled()
    with tracing.span("x") as span:
        assert span is INVALID_SPAN
    assert tracing.start("y", TRACEPARENT) is INVALID_SPAN
    assert tracing.current_ids() is None
    assert tracing.trace_id(TRACEPARENT) == TRACE_ID
    assert tracing.trace_id(None) is None


class _Answer:
    def __init__(self, status_code: int) -> None:
        self.status_code = status_code


@pytest.mark.parametrize(("status", "failed"), [(200, False), (401, False), (503, True)])
async def test_an_endpoint_is_a_server_span_failing_only_on_5xx(
    exported: InMemorySpanExporter, status: int, *, failed: bool
) -> None:
    @tracing.served("POST", "/webhooks/gateway")
    async def receive() -> _Answer:
        tracing.note({"charge_worker.event_id": "evt_1", "charge_worker.nothing": None})
        return _Answer(status)

    assert (await receive()).status_code == status
    [span] = exported.get_finished_spans()
    assert span.name == "POST /webhooks/gateway"
    assert span.kind is SpanKind.SERVER
    assert dict(span.attributes or {}) == {
        "http.request.method": "POST",
        "http.route": "/webhooks/gateway",
        "http.response.status_code": status,
        "charge_worker.event_id": "evt_1",
    }
    assert (span.status.status_code is StatusCode.ERROR) is failed


def test_a_failure_is_marked_on_the_span_being_recorded(exported: InMemorySpanExporter) -> None:
    with tracing.span("reconcile.double_charges"):
        tracing.failed("GatewayRejected: no such charge")
    [span] = exported.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == "GatewayRejected: no such charge"


async def test_off_the_decorators_and_notes_do_nothing() -> None:
    @tracing.served("POST", "/x")
    async def receive() -> _Answer:
        tracing.note({"a": 1})
        tracing.failed("no")
        return _Answer(200)

    assert (await receive()).status_code == 200


class _Settled(Exception):
    pass


def test_an_expected_exception_ends_a_span_without_failing_it(
    exported: InMemorySpanExporter,
) -> None:
    for error in (_Settled("already settled"), KeyError("boom")):
        with pytest.raises(type(error)), tracing.span("charge.claim", expected=(_Settled,)):
            raise error
    expected, unexpected = exported.get_finished_spans()
    assert expected.status.status_code is StatusCode.UNSET
    assert not expected.events
    assert dict(expected.attributes or {}) == {"charge_worker.ended_by": "_Settled"}
    assert unexpected.status.status_code is StatusCode.ERROR
    assert unexpected.status.description == "KeyError: 'boom'"
    assert [e.name for e in unexpected.events] == ["exception"]
