"""Traces: OpenTelemetry spans, configured only by the standard `OTEL_*` variables.

Off unless a variable names where spans go: `OTEL_EXPORTER_OTLP_ENDPOINT`,
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_TRACES_EXPORTER` (`OTEL_SDK_DISABLED=true` or
`OTEL_TRACES_EXPORTER=none` keep it off). Off, nothing of the SDK is imported and every
helper here returns at once (`span` a shared null context), so tracing off costs nothing
measurable. On, `setup` needs the `otel` extra (the SDK, the OTLP/HTTP exporter and the
aiohttp and httpx client instrumentations); the SDK reads the rest of the `OTEL_*` variables
itself (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`[`_ARG`],
`OTEL_EXPORTER_OTLP_*`, `OTEL_BSP_*`).

A due charge is one trace: `produce` opens it with a `create` span per charge, whose
`traceparent` (W3C Trace Context) the ledger row keeps and every copy of the message
carries; each delivery is a `process` span under it, and the HTTP clients' own
instrumentation adds the calls to scoring and the gateway.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from importlib.metadata import version
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypeVar

from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from charge_worker.errors import SettingsError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

P = ParamSpec("P")
T = TypeVar("T")

TRACER_NAME = "charge_worker"
DEFAULT_SERVICE_NAME = "charge-worker"
EXPORTERS = ("otlp", "console")
SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
PROTOCOLS = ("http/protobuf",)  # the exporter the `otel` extra brings
# on exit, spans still buffered get this long to leave: a collector that is down must not
# hold a stopping pod past its grace period
FLUSH_ON_EXIT_S = 5.0

AttributeValue = str | int | float | bool
Attributes = dict[str, AttributeValue]
_W3C = TraceContextTextMapPropagator()  # docs/contracts/charge-due.md: `traceparent` only
_NOTHING: contextlib.nullcontext[Span] = contextlib.nullcontext(INVALID_SPAN)


class _Instrumentor(Protocol):
    def instrument(self, **kwargs: Any) -> None: ...
    def uninstrument(self, **kwargs: Any) -> None: ...


@dataclass(frozen=True)
class Plan:
    """What the `OTEL_*` variables ask for: the exporters, and the variable that asked."""

    exporters: tuple[str, ...]
    asked_by: str


@dataclass
class _State:
    tracer: Tracer | None = None
    provider: TracerProvider | None = None


_state = _State()


def plan(environ: Mapping[str, str]) -> Plan | None:
    """Whether `environ` turns tracing on, and with which exporters; None when off.

    Raises `SettingsError` naming the variable when a value cannot be honoured."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    named = [e.strip().lower() for e in environ.get("OTEL_TRACES_EXPORTER", "").split(",")]
    named = [e for e in named if e]
    if "none" in named:
        return None
    if unknown := [e for e in named if e not in EXPORTERS]:
        raise SettingsError(
            f"OTEL_TRACES_EXPORTER: {unknown[0]!r} is not one of {', '.join(EXPORTERS)}, none"
        )
    endpoint = next(
        (
            v
            for v in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
            if environ.get(v, "").strip()
        ),
        None,
    )
    if not named and endpoint is None:
        return None
    _check_sampler(environ)
    exporters = tuple(dict.fromkeys(named or ["otlp"]))
    if "otlp" in exporters:
        _check_protocol(environ)
    return Plan(exporters, "OTEL_TRACES_EXPORTER" if named else str(endpoint))


def _check_sampler(environ: Mapping[str, str]) -> None:
    sampler = environ.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    if sampler and sampler not in SAMPLERS:
        raise SettingsError(f"OTEL_TRACES_SAMPLER: {sampler!r} is not one of {', '.join(SAMPLERS)}")
    if sampler.endswith("traceidratio") and (arg := environ.get("OTEL_TRACES_SAMPLER_ARG")):
        try:
            ratio = float(arg)
        except ValueError:
            ratio = -1.0
        if not 0.0 <= ratio <= 1.0:
            raise SettingsError(f"OTEL_TRACES_SAMPLER_ARG: {arg!r} is not a ratio from 0 to 1")


def _check_protocol(environ: Mapping[str, str]) -> None:
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        if (protocol := environ.get(name, "").strip()) and protocol not in PROTOCOLS:
            raise SettingsError(f"{name}: {protocol!r} is not supported; use http/protobuf")


def setup(command: str, environ: Mapping[str, str] | None = None) -> None:
    """Start tracing for this process when the `OTEL_*` variables ask for it; else nothing.

    Fails with a `SettingsError` naming the variable when they ask for it and the `otel`
    extra is not installed."""
    environ = os.environ if environ is None else environ
    wanted = plan(environ)
    if wanted is None:
        return
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # noqa: PLC0415
            OTLPSpanExporter,
        )
        from opentelemetry.sdk.resources import Resource  # noqa: PLC0415  # only when on
        from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
        from opentelemetry.sdk.trace.export import (  # noqa: PLC0415
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SimpleSpanProcessor,
        )

        _instrumentors()
    except ImportError as error:
        raise SettingsError(
            f"{wanted.asked_by}: tracing needs the otel extra"
            " (pip install 'charge-worker[otel]'), or unset it"
        ) from error
    resource = Resource.create(
        {"service.version": version("charge-worker"), "charge_worker.command": command}
    )
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": DEFAULT_SERVICE_NAME}))
    provider = TracerProvider(resource=resource)
    if "otlp" in wanted.exporters:
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if "console" in wanted.exporters:  # one JSON line per span, beside the logs on stderr
        console = ConsoleSpanExporter(out=sys.stderr, formatter=lambda s: s.to_json(None) + "\n")
        provider.add_span_processor(SimpleSpanProcessor(console))
    trace.set_tracer_provider(provider)
    install(provider)


def install(provider: TracerProvider) -> None:
    """Send this package's spans and the HTTP clients' to `provider` (`setup` calls it; tests
    call it with an in-memory exporter, then `uninstall`)."""
    uninstall()
    for instrumentor in _instrumentors():
        instrumentor.instrument(tracer_provider=provider)
    _state.provider = provider
    _state.tracer = provider.get_tracer(TRACER_NAME, version("charge-worker"))


def uninstall() -> None:
    """Back to off: no spans, the HTTP clients no longer instrumented."""
    if _state.provider is None:
        return
    for instrumentor in _instrumentors():
        instrumentor.uninstrument()
    _state.provider = _state.tracer = None


def _instrumentors() -> tuple[_Instrumentor, ...]:
    """The HTTP clients' own instrumentations. aiohttp: the transport under the gateway and
    scoring clients (http.py) and under the Stripe SDK; httpx: clients on httpx's own
    transport. No request passes through both."""
    from opentelemetry.instrumentation.aiohttp_client import (  # noqa: PLC0415
        AioHttpClientInstrumentor,
    )
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor  # noqa: PLC0415

    return AioHttpClientInstrumentor(), HTTPXClientInstrumentor()


def shutdown() -> None:
    """Export what is buffered, within `FLUSH_ON_EXIT_S`, and stop (every command, on its
    way out)."""
    provider = _state.provider
    if provider is None:
        return
    uninstall()
    # The SDK's flush retries an export until OTEL_EXPORTER_OTLP_TIMEOUT, and takes as long
    # as a slow collector does: bounded here, in a thread the process does not wait for.
    flushing = threading.Thread(target=provider.shutdown, name="otel-flush", daemon=True)
    flushing.start()
    flushing.join(FLUSH_ON_EXIT_S)


def enabled() -> bool:
    """Whether spans are being made."""
    return _state.tracer is not None


def span(
    name: str,
    attributes: Mapping[str, AttributeValue] | None = None,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    expected: tuple[type[BaseException], ...] = (),
) -> contextlib.AbstractContextManager[Span]:
    """A child of the current span, current while inside; ended on exit, an exception
    recorded on it and failing it, unless it is one of `expected` (an answer, not a fault:
    its class is then the `charge_worker.ended_by` attribute). Off: a shared null context."""
    tracer = _state.tracer
    if tracer is None:
        return _NOTHING
    if not expected:
        return tracer.start_as_current_span(name, kind=kind, attributes=attributes)
    inner = tracer.start_as_current_span(
        name,
        kind=kind,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    )
    return _expecting(inner, expected)


@contextlib.contextmanager
def _expecting(
    inner: contextlib.AbstractContextManager[Span], expected: tuple[type[BaseException], ...]
) -> Iterator[Span]:
    with inner as current:
        try:
            yield current
        except expected as error:
            current.set_attribute("charge_worker.ended_by", type(error).__name__)
            raise
        except Exception as error:  # as the SDK does it for a span without `expected`
            current.record_exception(error)
            current.set_status(StatusCode.ERROR, f"{type(error).__name__}: {error}")
            raise


def traced(
    name: str, *, kind: SpanKind = SpanKind.INTERNAL
) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Awaitable[T]]]:
    """Decorate a coroutine function: each call is a span called `name`."""

    def decorate(function: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
        @functools.wraps(function)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
            with span(name, kind=kind):
                return await function(*args, **kwargs)

        return wrapper

    return decorate


class _Answer(Protocol):
    status_code: int


A = TypeVar("A", bound=_Answer)


def served(
    method: str, route: str
) -> Callable[[Callable[P, Awaitable[A]]], Callable[P, Awaitable[A]]]:
    """Decorate an HTTP endpoint: each request is a server span `<method> <route>` with the
    semantic conventions' HTTP attributes, an error when it answers 5xx."""

    def decorate(function: Callable[P, Awaitable[A]]) -> Callable[P, Awaitable[A]]:
        @functools.wraps(function)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> A:
            if _state.tracer is None:
                return await function(*args, **kwargs)
            attributes = {"http.request.method": method, "http.route": route}
            with span(f"{method} {route}", attributes, kind=SpanKind.SERVER) as current:
                answer = await function(*args, **kwargs)
                current.set_attribute("http.response.status_code", answer.status_code)
                if answer.status_code >= 500:  # server spans fail on 5xx only (conventions)
                    current.set_status(StatusCode.ERROR)
                return answer

        return wrapper

    return decorate


def note(attributes: Mapping[str, AttributeValue | None]) -> None:
    """Set these attributes (those not None) on the span being recorded, if one is."""
    current = trace.get_current_span() if _state.tracer is not None else INVALID_SPAN
    if current.is_recording():
        current.set_attributes({k: v for k, v in attributes.items() if v is not None})


def failed(description: str) -> None:
    """Mark the span being recorded, if one is, as failed, saying why."""
    current = trace.get_current_span() if _state.tracer is not None else INVALID_SPAN
    if current.is_recording():
        current.set_status(StatusCode.ERROR, description)


def continued(
    name: str,
    traceparent: str | None,
    attributes: Mapping[str, AttributeValue] | None = None,
    *,
    kind: SpanKind = SpanKind.CONSUMER,
) -> contextlib.AbstractContextManager[Span]:
    """Like `span`, as a child of `traceparent` (a message's), or a new trace without one."""
    tracer = _state.tracer
    if tracer is None:
        return _NOTHING
    parent = _W3C.extract({"traceparent": traceparent} if traceparent else {})
    return tracer.start_as_current_span(name, parent, kind=kind, attributes=attributes)


def start(
    name: str,
    traceparent: str | None = None,
    attributes: Mapping[str, AttributeValue] | None = None,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
) -> Span:
    """A span that is not made current, under `traceparent` or a new trace: the caller ends
    it (for spans opened by the thousand, as `produce` does). Off: a span that is nothing."""
    tracer = _state.tracer
    if tracer is None:
        return INVALID_SPAN
    parent = _W3C.extract({"traceparent": traceparent}) if traceparent else None
    return tracer.start_span(name, parent, kind=kind, attributes=attributes)


def messaging(operation: str, destination: str, message_id: str | None = None) -> Attributes:
    """A span's attributes under the semantic conventions for messaging (NATS JetStream)."""
    attributes: Attributes = {
        "messaging.system": "nats",
        "messaging.operation.type": operation,
        "messaging.operation.name": operation,
        "messaging.destination.name": destination,
    }
    if message_id:
        attributes["messaging.message.id"] = message_id
    return attributes


def traceparent_of(span: Span) -> str | None:
    """The W3C `traceparent` naming `span`; None for a span that is nothing."""
    context = span.get_span_context()
    if not context.is_valid:
        return None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def current_ids() -> tuple[str, str] | None:
    """The trace and span id of the current span, as hex, when one is being recorded."""
    if _state.tracer is None:
        return None
    context = trace.get_current_span().get_span_context()
    if not context.is_valid or not context.trace_flags.sampled:
        return None
    return f"{context.trace_id:032x}", f"{context.span_id:016x}"


def trace_id(traceparent: str | None) -> str | None:
    """The trace id a `traceparent` names."""
    parts = (traceparent or "").split("-")
    return parts[1] if len(parts) >= 4 else None


@contextlib.contextmanager
def recorded(provider: TracerProvider) -> Iterator[None]:
    """Spans go to `provider` while inside (tests, benchmarks)."""
    install(provider)
    try:
        yield
    finally:
        uninstall()
