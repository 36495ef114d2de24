"""Structured logging (structlog) for every tpserve process, to stderr.

"console" is for people, "json" for log collectors (one JSON object per line).
Worker ranks bind ``rank`` to every line so a group's logs can be told apart.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog


def configure_logging(fmt: Literal["console", "json"] = "console", level: str = "INFO", rank: int | None = None) -> None:
    """Configures structlog and the standard library's logging (used by grpc) once per process."""
    logging.basicConfig(stream=sys.stderr, level=level, format="%(message)s")
    processors: list = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if rank is not None:
        structlog.contextvars.bind_contextvars(rank=rank)
    renderer = structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
