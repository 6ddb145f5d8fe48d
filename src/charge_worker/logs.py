"""structlog setup: one line per event on stderr, JSON when not on a terminal, for every logger.

Event names are stable `snake.case` (`charge.settled`, `migrate.applied`). Every line has
`event`, `level`, `logger` and `timestamp`, plus the fields bound to the task with
`structlog.contextvars.bind_contextvars`: the worker's name, and on a delivery's lines
`stream_seq`, `delivery`, `order_id` and `billing_period` (each message is processed in a
task of its own, so they end with it); while a span is being recorded (see `tracing`),
`trace_id` and `span_id`.

Bound fields are merged into every line, structlog's and the standard library's alike; a
line's own field wins over a bound one. A task started after a bind carries its fields; a
task's binds never reach its parent or a sibling. The clock is structlog's `TimeStamper`.

The standard library's loggers (uvicorn, asyncio, nats, asyncpg, the stripe SDK, warnings)
reach the same processors and renderer through structlog's stdlib bridge
(`ProcessorFormatter` on the root handler), at warning level and above. structlog's own
lines are written directly: the canonical line of every message stays off the stdlib
machinery's cost.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, MutableMapping
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

from charge_worker import json_text, tracing
from charge_worker.settings import LogSettings

DEFAULT_LOGGER = "charge_worker"
# ISO 8601 in UTC to the microsecond, always six digits (`fmt="iso"` drops them when zero)
TIMESTAMP_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"


class _NamedWriter(structlog.WriteLogger):
    """A `WriteLogger` that knows the name it was asked for (`add_logger_name` reads it)."""

    def __init__(self, file: TextIO | None = None, name: str = DEFAULT_LOGGER) -> None:
        super().__init__(file)
        self.name = name


class _NamedWriterFactory:
    def __init__(self, file: TextIO) -> None:
        self.file = file

    def __call__(self, *args: Any) -> _NamedWriter:
        name = args[0] if args and isinstance(args[0], str) else DEFAULT_LOGGER
        return _NamedWriter(self.file, name)


def add_trace_ids(
    _logger: WrappedLogger, _method: str, event_dict: EventDict
) -> MutableMapping[str, Any]:
    """`trace_id` and `span_id` of the span being recorded, if one is (a structlog processor)."""
    if ids := tracing.current_ids():
        event_dict["trace_id"], event_dict["span_id"] = ids
    return event_dict


def configure(cfg: LogSettings) -> None:
    """Route structlog and stdlib logging to stderr in the configured format."""
    level = logging.getLevelNamesMapping()[cfg.log_level.upper()]
    renderer: Processor = (
        structlog.processors.JSONRenderer(serializer=json_text.dumps)
        if _json(cfg)
        else structlog.dev.ConsoleRenderer()
    )
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_logger_name,
        structlog.processors.add_log_level,
        add_trace_ids,
        structlog.processors.TimeStamper(fmt=TIMESTAMP_FORMAT, utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=_NamedWriterFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    for old in root.handlers:
        root.removeHandler(old)
    root.addHandler(handler)
    # their info lines are the libraries' chatter (connections, pools): warnings and up
    root.setLevel(max(level, logging.WARNING))
    logging.captureWarnings(True)


def _json(cfg: LogSettings) -> bool:
    return cfg.log_format == "json" or (cfg.log_format == "auto" and not sys.stderr.isatty())


def progress(cfg: LogSettings, logger: str) -> Callable[[str], None]:
    """Where a long command reports how far it has got: with JSON lines, a `progress` event
    of `logger` (the line in its `progress` field), so every line of the process parses;
    else the line itself, on stderr."""
    if _json(cfg):
        log = structlog.get_logger(logger)
        return lambda line: log.info("progress", progress=line)
    return lambda line: print(line, file=sys.stderr, flush=True)
