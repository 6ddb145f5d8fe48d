"""A small OTLP/HTTP trace receiver: decodes what the exporter really sends.

`OtlpReceiver` serves `POST /v1/traces` (protobuf, gzip or not) on a free loopback port in a
thread, as a collector would, and keeps every span it was sent, flattened into `Received`.
Point a process at it with `OTEL_EXPORTER_OTLP_ENDPOINT=<receiver.url>`.
"""

from __future__ import annotations

import gzip
import threading
import zlib
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from charge_worker.sandbox.serve import ServedApp

PROTOBUF = "application/x-protobuf"


@dataclass(frozen=True)
class Received:
    """One span as the receiver decoded it; ids in lower-case hex, "" for no parent."""

    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: str  # "SERVER", "CLIENT", "PRODUCER", "CONSUMER", "INTERNAL"
    attributes: dict[str, Any]
    status: str  # "UNSET", "OK", "ERROR"
    resource: dict[str, Any]
    scope: str


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return getattr(value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for pair in pairs:
        assert isinstance(pair, KeyValue)
        found[pair.key] = _value(pair.value)
    return found


def decode(body: bytes) -> list[Received]:
    """Every span of one `ExportTraceServiceRequest`."""
    request = ExportTraceServiceRequest.FromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    Received(
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_id=span.parent_span_id.hex(),
                        name=span.name,
                        kind=Span.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_"),
                        attributes=_attributes(span.attributes),
                        status=Status.StatusCode.Name(span.status.code).removeprefix(
                            "STATUS_CODE_"
                        ),
                        resource=resource,
                        scope=scope_spans.scope.name,
                    )
                )
    return spans


class OtlpReceiver:
    """`with OtlpReceiver() as receiver:` a collector's OTLP/HTTP trace endpoint."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[Received] = []
        self.requests = 0
        self._served = ServedApp(
            Starlette(routes=[Route("/v1/traces", self._export, methods=["POST"])])
        )

    async def _export(self, request: Request) -> Response:
        body = await request.body()
        encoding = request.headers.get("content-encoding", "")
        if encoding == "gzip":
            body = gzip.decompress(body)
        elif encoding == "deflate":
            body = zlib.decompress(body)
        if request.headers.get("content-type") != PROTOBUF:
            return Response(status_code=415)
        spans = decode(body)
        with self._lock:
            self._spans.extend(spans)
            self.requests += 1
        return Response(ExportTraceServiceResponse().SerializeToString(), media_type=PROTOBUF)

    @property
    def url(self) -> str:
        """The value for `OTEL_EXPORTER_OTLP_ENDPOINT`."""
        return self._served.url

    def spans(self) -> list[Received]:
        """Every span received so far, in the order they came."""
        with self._lock:
            return list(self._spans)

    def __enter__(self) -> Self:
        self._served.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._served.stop()
