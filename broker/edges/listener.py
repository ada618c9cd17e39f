"""The HTTP listener: aiohttp's server with the connections bounded and timed, so
that HTTP clients cannot take the descriptors the daemon needs.

Every connection costs a file descriptor, and the daemon needs its own (state store,
MQTT, the clouds, the policy file): HTTP clients must not be able to take them all.
* A connection that has not sent a request's whole header `http.header_timeout_seconds`
  after it opened (or after its previous answer) is closed, whatever it is still
  sending: aiohttp has no header-read deadline of its own before 3.14 (its keep-alive
  timer only covers the time between requests there), and the floor is 3.9, so the
  listener's protocol (`_Handler`) keeps one. A body must arrive within
  `http.body_timeout_seconds` (408).
* At most `http.max_connections` are open (default: from the open-file limit,
  `connection_limit`); beyond it a new connection replaces the oldest one that has no
  request in progress, or, when all are busy, is answered 503 and closed.
* Should accept() still run out of descriptors (something else took them), asyncio's
  report of it (a traceback per failed accept, thousands a second) becomes one warning
  a minute.
* A malformed request (bad request line, header, Content-Length, oversized header) is
  answered 4xx by aiohttp and logged in one line at debug; only a handler's own failure
  (a bug: 500) is logged with its traceback.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from broker.daemon.config import HttpConfig
from broker.output.logs import filter_loop_errors
from broker.output.ratelimit import Every

BACKLOG = 128
"""The listen backlog, and so the most connections asyncio accepts in one go (each a
descriptor before anything here sees it)."""
RESERVED_FDS = 256
"""Descriptors kept for the daemon itself at least (state store, MQTT, the clouds'
connection pools, thread pools, the policy and token files): `connection_limit`."""
MAX_DEFAULT_CONNECTIONS = 4096
LOG_EVERY = 60.0

log = structlog.get_logger("gpubroker.http")


class _ServerLog(logging.Logger):
    """The logger aiohttp's protocol reports through. A malformed request (its parser's
    HttpProcessingError, answered 4xx) is the client's mistake: one line at debug, no
    traceback (a full one at error level each time, before). Anything else it reports
    with an exception is a failure of ours and keeps its traceback, at error."""

    def __init__(self) -> None:
        super().__init__("aiohttp.server.gpubroker")
        self.parent = logging.getLogger("aiohttp.server")

    def exception(self, msg: object, *args: object, exc_info: Any = True,
                  **kwargs: Any) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(exc, HttpProcessingError):
            log.debug("http request malformed", detail=str(msg) % args if args else msg,
                      status=exc.code, error=f"{type(exc).__name__}: {exc.message}"[:300])
            return
        log.error("http request failed", detail=str(msg) % args if args else msg,
                  exc_info=exc if exc is not None else False)


_SERVER_LOG = _ServerLog()


def connection_limit(configured: int | None = None) -> int:
    """`http.max_connections`, else what the open-file limit leaves: the soft limit less
    RESERVED_FDS (or an eighth of it, if more) for the daemon's own descriptors and less
    a backlog's worth that asyncio may accept at once before the limit is checked;
    at most MAX_DEFAULT_CONNECTIONS, at least 16."""
    if configured is not None:
        return configured
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    spare = soft - max(RESERVED_FDS, soft // 8) - BACKLOG
    return max(16, min(MAX_DEFAULT_CONNECTIONS, spare))


class _Connections:
    """The listener's open connections, oldest first, each with its header deadline
    (None while a request of it is in progress), kept at most `limit`."""

    def __init__(self, limit: int, header_timeout: float) -> None:
        self.limit = limit
        self.header_timeout = header_timeout
        self.open: dict[_Handler, asyncio.TimerHandle | None] = {}
        self._late = Every(LOG_EVERY)
        self._replaced = Every(LOG_EVERY)
        self._refused = Every(LOG_EVERY)

    def admit(self, conn: _Handler) -> bool:
        """A new connection: room is made for it if need be; False: refuse it."""
        if len(self.open) >= self.limit and not self._make_room():
            if n := self._refused.hit():
                log.warning("http connection refused: every connection is busy",
                            limit=self.limit, count=n)
            return False
        self._arm(conn)
        return True

    def _make_room(self) -> bool:
        idle = next((c for c, deadline in self.open.items() if deadline is not None), None)
        if idle is None:
            return False
        self.forget(idle)
        idle.force_close()
        if n := self._replaced.hit():
            log.info("http connections at the limit: the oldest waiting for a request "
                     "closed for a new one", limit=self.limit, count=n)
        return True

    def _arm(self, conn: _Handler) -> None:
        loop = asyncio.get_running_loop()
        self.open[conn] = loop.call_later(self.header_timeout, self._too_slow, conn)

    def _too_slow(self, conn: _Handler) -> None:
        if self.open.get(conn) is None:  # gone, or busy (its deadline was cancelled)
            return
        del self.open[conn]
        conn.force_close()
        if n := self._late.hit():
            log.info("http connections closed: no request header in time",
                     header_timeout_seconds=self.header_timeout, count=n)

    def busy(self, conn: _Handler) -> None:
        """A request of `conn` is being handled: no deadline, not to be replaced."""
        if (deadline := self.open.get(conn)) is not None:
            deadline.cancel()
            self.open[conn] = None

    def idle(self, conn: _Handler) -> None:
        """Its answer is out: the next request's header is due within the timeout."""
        if conn in self.open and conn.transport is not None:
            self._arm(conn)

    def forget(self, conn: _Handler) -> None:
        if (deadline := self.open.pop(conn, None)) is not None:
            deadline.cancel()


_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Content-Length: 40\r\nConnection: close\r\n\r\n"
            b'{"error": "too many connections; retry"}')


class _Handler(RequestHandler):
    """aiohttp's protocol, counted and timed by `_Connections`."""

    def __init__(self, server: web.Server, connections: _Connections, **kwargs: Any) -> None:
        super().__init__(server, **kwargs)
        self.connections = connections
        self.admitted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.admitted = self.connections.admit(self)
        if not self.admitted:
            assert isinstance(transport, asyncio.Transport)
            transport.write(_REFUSED)
            transport.close()
            return
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self.admitted:
            return
        self.connections.forget(self)
        super().connection_lost(exc)


@web.middleware
async def in_progress(request: web.Request,
                       handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                       ) -> web.StreamResponse:
    """Marks the connection busy while its request is handled (see `_Connections`)."""
    conn = request.protocol
    if not isinstance(conn, _Handler):
        return await handler(request)
    conn.connections.busy(conn)
    try:
        return await handler(request)
    finally:
        conn.connections.idle(conn)


def _quiet_accept_errors(loop: asyncio.AbstractEventLoop
                         ) -> Callable[[], None]:
    """asyncio reports an accept() that ran out of descriptors (EMFILE, ENFILE…) through
    the loop's exception handler, with a traceback, and in Python 3.11 once for each of
    a backlog's retries (thousands a second, 171 MB of log in 50 s): one warning a
    minute instead, with the count. Returns what puts the previous handler back."""
    every = Every(LOG_EVERY)

    def quiet(context: dict[str, Any]) -> bool:
        if context.get("message") != "socket.accept() out of system resource":
            return False
        if n := every.hit():
            exc = context.get("exception")
            log.warning("http accept failed: out of descriptors; retried",
                        error=getattr(exc, "strerror", None) or str(exc), count=n)
        return True

    return filter_loop_errors(loop, quiet)


class _Site(web.TCPSite):
    """aiohttp's TCP site with our protocol (`_Handler`) and accept-error reporting."""

    def __init__(self, runner: web.AppRunner, host: str, port: int,
                 connections: _Connections, handler_args: dict[str, Any]) -> None:
        super().__init__(runner, host, port, backlog=BACKLOG)
        self.where = (host, port)
        self.connections = connections
        self.handler_args = handler_args
        self.restore_handler: Callable[[], None] | None = None

    async def start(self) -> None:
        await web.BaseSite.start(self)
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None

        def protocol() -> _Handler:
            return _Handler(server, self.connections, loop=loop, **self.handler_args)

        self.restore_handler = _quiet_accept_errors(loop)
        self._server = await loop.create_server(protocol, *self.where, backlog=BACKLOG)

    async def stop(self) -> None:
        await super().stop()
        if self.restore_handler is not None:
            self.restore_handler()
            self.restore_handler = None



async def listen(app: web.Application, cfg: HttpConfig, host: str,
                 port: int) -> web.AppRunner:
    """Serve `app` on `host:port` with the configured limits; the runner to clean up."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=2.0)
    await runner.setup()
    connections = _Connections(connection_limit(cfg.max_connections),
                               cfg.header_timeout_seconds)
    handler_args: dict[str, Any] = {
        "keepalive_timeout": cfg.header_timeout_seconds, "access_log": None,
        "logger": _SERVER_LOG, "lingering_time": 1.0}
    await _Site(runner, host, port, connections, handler_args).start()
    log.debug("http connection limit", max_connections=connections.limit,
              header_timeout_seconds=cfg.header_timeout_seconds)
    return runner
