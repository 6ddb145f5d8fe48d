"""structlog setup: JSON lines when not on a terminal, bound context per message.

Event names are stable `snake.case` (`charge.settled`, `migrate.applied`); each message gets
one canonical `charge.settled` line carrying its bound context.
"""

from __future__ import annotations

import logging
import sys

import structlog

from charge_worker.settings import LogSettings


def configure(cfg: LogSettings) -> None:
    """Route structlog and stdlib logging to stderr in the configured format."""
    level = logging.getLevelNamesMapping()[cfg.log_level.upper()]
    as_json = cfg.log_format == "json" or (cfg.log_format == "auto" and not sys.stderr.isatty())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=max(level, logging.WARNING), stream=sys.stderr, force=True)
