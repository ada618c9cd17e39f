"""structlog set-up: JSON lines on stdout for the daemon (journald, log shippers), or
quiet human-readable lines on stderr for interactive commands.

Nothing secret is ever a log field: credentials are read from files or the SDKs' chains
and never passed to a logger; `redact` below also masks any field whose name says it
holds a secret, should one be added by mistake."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable, MutableMapping
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
        # One write per line (PrintLogger writes the line and its newline separately):
        # records of the standard library's handler, written from SDK threads, must
        # never land between the two and break a JSON line.
        logger_factory=structlog.WriteLoggerFactory(file=stream),
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
    # The cloud SDKs report a failed credential probe or a retried call with warnings
    # and tracebacks (one `gpubroker offers` without Alibaba credentials printed over a
    # thousand lines); the adapter says what went wrong in one line of its own. Their
    # warnings show only when the user asked for debug, and their own debug output
    # (request headers, signatures) never.
    sdk_level = logging.WARNING if level <= logging.DEBUG else logging.CRITICAL + 1
    for noisy in SDK_LOGGERS:
        logging.getLogger(noisy).setLevel(sdk_level)


SDK_LOGGERS = ("azure", "msal", "urllib3", "botocore", "boto3", "s3transfer", "google",
               "google_auth_httplib2", "alibabacloud_credentials", "alibabacloud",
               "alibabacloud_tea_openapi", "Tea", "aiohttp.client")


LoopFilter = Callable[[dict[str, Any]], bool]


def filter_loop_errors(loop: asyncio.AbstractEventLoop, quiet: LoopFilter
                       ) -> Callable[[], None]:
    """Put `quiet` in front of the loop's exception handler: a report it takes (returns
    True for: it logged it its own way, or it is nothing) goes no further; the rest goes
    to the handler that was there, or asyncio's default. Returns what puts that handler
    back. The one way the daemon narrows what asyncio reports with a traceback."""
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if quiet(context):
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
    return lambda: loop.set_exception_handler(previous)
