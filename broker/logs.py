"""structlog set-up: JSON lines on stdout for the daemon (journald, log shippers), or
quiet human-readable lines on stderr for interactive commands.

Nothing secret is ever a log field: credentials are read from files or the SDKs' chains
and never passed to a logger; `redact` below also masks any field whose name says it
holds a secret, should one be added by mistake."""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

_SECRET_WORDS = ("password", "secret", "token", "credential", "authorization", "api_key")


def redact(_: object, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key in list(event):
        if any(word in key.lower() for word in _SECRET_WORDS):
            event[key] = "***"
    return event


def configure(*, json: bool = True, level: int = logging.INFO) -> None:
    processors: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        redact,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
    ]
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stdout if json else sys.stderr),
        cache_logger_on_first_use=True,
    )
