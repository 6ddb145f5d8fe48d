"""Spans made in the test's own process, kept in memory (the SDK's `InMemorySpanExporter`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from charge_worker import tracing


@contextlib.contextmanager
def recorded_spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on while inside, every span (ours and the HTTP clients') kept in memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with tracing.recorded(provider):
        yield exporter
    provider.shutdown()


def hex_ids(span: ReadableSpan) -> tuple[str, str]:
    """The span's trace id and span id, as a `traceparent` writes them."""
    assert span.context is not None
    return f"{span.context.trace_id:032x}", f"{span.context.span_id:016x}"


def in_trace(
    spans: tuple[ReadableSpan, ...] | list[ReadableSpan], trace_id: str
) -> list[ReadableSpan]:
    """The spans of one trace, in the order they ended."""
    return [s for s in spans if hex_ids(s)[0] == trace_id]


def children(spans: list[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    """The spans whose parent is `parent`, in the order they ended."""
    assert parent.context is not None
    return [s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id]


def parent_id(span: ReadableSpan) -> str | None:
    """The span id of the span's parent, as hex; None for a root."""
    return f"{span.parent.span_id:016x}" if span.parent is not None else None


def descendants(spans: list[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    """The spans under `parent`, at any depth, in the order they ended."""
    below = {id(s) for s in children(spans, parent)}
    for child in children(spans, parent):
        below |= {id(s) for s in descendants(spans, child)}
    return [s for s in spans if id(s) in below]
