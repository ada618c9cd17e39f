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
    stream = sys.stdout if json else sys.stderr
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=True,
    )
    # Libraries log through the standard library (SDK credential chains, botocore,
    # aiomqtt): render those the same way, on the same stream, and keep their chatter
    # (a multi-line warning per failed credential probe) to warnings and up.
    handler = logging.StreamHandler(stream)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_logger_name, *processors],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer]))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(level, logging.WARNING))
    for noisy in ("azure", "azure.identity", "msal", "urllib3", "botocore", "google"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
