"""structlog setup: JSON lines when stderr is not a TTY, readable console output when it is."""

from __future__ import annotations

import logging
import sys
from typing import TextIO, cast

import structlog


def configure_logging(level: str = "info", json: bool | None = None) -> None:
    if json is None:
        json = not sys.stderr.isatty()
    renderer = (structlog.processors.JSONRenderer() if json
                else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=cast(TextIO, _Stderr())),
        # not cached: a logger made before a later configure (another command run in the same
        # process, as tests and `qworker up` do) keeps to the configuration of the moment
        cache_logger_on_first_use=False,
    )


class _Stderr:
    """sys.stderr as it is when a line is written, not when logging was configured (a stream
    swapped since, or closed, is never written to)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def get_logger(**bind: object) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger("qworker").bind(**bind)
