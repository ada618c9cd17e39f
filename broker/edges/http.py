"""The HTTP side (SPEC §8): health, metrics, and a JSON API. Loopback by default.

* `GET /livez`: 200 while the event loop answers.
* `GET /readyz`: 200 once the config is loaded, MQTT is connected and a fresh poll is
  in; else 503 with the reasons.
* `GET /metrics`: Prometheus text format.
* `GET /v1/offers`: the pool, cheapest per GPU-hour first; filters `gpu`, `cloud`,
  `region`, `market`, `fresh=1`, `limit`.
* `GET /v1/leases`, `GET /v1/leases/{id}`: leases in memory (active and recently
  ended), as committed (a change being committed is waited for). The list holds the
  active leases unless `state` says otherwise (`released`, `expired`, `failed`, or `all`);
  filter `scheduler`.
* A standby (high availability) answers /livez, /readyz (503, "standby (…)"), /metrics,
  /v1/policy and the lease reads (from the database); /v1/offers and placing: 503.
* `POST /v1/requests/{S}/place`: a placement request, same body and answer as MQTT;
  bearer token required.
* `GET /v1/policy`: the policy in force and its hash.

The answer to a POST is the CloudEvents envelope the scheduler also gets on MQTT: 200 for
`placement.decided` and `placement.rejected`, 422 for `request.invalid`. Bodies over
64 KiB get 413; a missing or wrong token 401 (compared in constant time); with no token
file configured, the endpoint answers 403. When the state store refuses a commit the
broker stops (`broker.leasing.authority`): a request waiting for its answer, or arriving after, gets
503 "state store failed; not executed" at once, as do the lease views. With
`http.views_need_token` the read-only views (/v1/offers, /v1/leases…, /v1/policy) want
the token too; /livez, /readyz and /metrics never do.

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
import hmac
import json
import logging
import resource
import sys
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from broker.daemon.config import Config
from broker.edges.metrics import Metrics
from broker.leasing.authority import Broker
from broker.leasing.book import LeaseBook
from broker.market.pool import ResourcePool
from broker.model import SCHEDULER_ID, Lease, LeaseState, Market, utcnow
from broker.output.logs import filter_loop_errors
from broker.output.ratelimit import Every
from broker.state.leadership import Leadership
from broker.state.store import Store, StoreFailed
from broker.wire.commands import Command
from broker.wire.messages import Topics


class Served(Protocol):
    """What the HTTP side reads of the daemon it serves (`broker.daemon.assembly.Daemon`
    is one), and nothing more: its configuration and token, its role and readiness, the
    metrics, the pool, the lease book (as committed: through the broker, or from the
    store on a standby), the policy in force, and the broker that takes placements."""

    @property
    def cfg(self) -> Config: ...

    @property
    def http_token(self) -> bytes | None: ...

    @property
    def role(self) -> str: ...

    def not_ready(self) -> list[str]: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def pool(self) -> ResourcePool: ...

    @property
    def book(self) -> LeaseBook: ...

    @property
    def broker(self) -> Broker: ...

    @property
    def store(self) -> Store: ...

    @property
    def leadership(self) -> Leadership | None: ...

    @property
    def topics(self) -> Topics: ...

    @property
    def policy_digest(self) -> str | None: ...


MAX_BODY = 64 * 1024
LEASE_STATES = tuple(s.value for s in LeaseState)
ANSWER_TIMEOUT = 30.0
SERVED: web.AppKey[Served] = web.AppKey("served")
BACKLOG = 128
"""The listen backlog, and so the most connections asyncio accepts in one go (each a
descriptor before anything here sees it)."""
RESERVED_FDS = 256
"""Descriptors kept for the daemon itself at least (state store, MQTT, the clouds'
connection pools, thread pools, the policy and token files): `connection_limit`."""
MAX_DEFAULT_CONNECTIONS = 4096
LOG_EVERY = 60.0

log = structlog.get_logger("gpubroker.http")


def _served(request: web.Request) -> Served:
    return request.app[SERVED]


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(data, separators=(",", ":")), status=status,
                        content_type="application/json")


def _store_failed() -> web.Response:
    return _json({"error": "state store failed; not executed"}, 503)


def _bearer(request: web.Request) -> bytes | None:
    """The token of an `Authorization: Bearer …` header, as the bytes sent. aiohttp
    decodes header bytes as UTF-8 with surrogate escapes; encoding back the same way
    gives the bytes sent (a token that is not UTF-8 then simply does not match, where
    a plain `.encode()` raised and answered 500)."""
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    try:
        return value.strip(" ").encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate no decoding produces; still only a 401
        return None


def _unauthorized(d: Served, request: web.Request, what: str) -> web.Response | None:
    """403 without a configured token, 401 without the right one (constant-time
    comparison), None when the request may go on."""
    token = d.http_token
    if token is None:
        return _json({"error": f"{what} over HTTP needs http.token_file in the config"}, 403)
    given = _bearer(request)
    if given is None or not hmac.compare_digest(given, token):
        return web.json_response({"error": "a valid bearer token is required"}, status=401,
                                 headers={"WWW-Authenticate": 'Bearer realm="gpubroker"'})
    return None


def _view_refused(d: Served, request: web.Request) -> web.Response | None:
    """The read-only views want the token when `http.views_need_token` says so."""
    if not d.cfg.http.views_need_token:
        return None
    return _unauthorized(d, request, "reading this view")


async def livez(_: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def readyz(request: web.Request) -> web.Response:
    reasons = _served(request).not_ready()
    if reasons:
        return web.Response(text="not ready: " + "; ".join(reasons) + "\n", status=503)
    return web.Response(text="ready\n")


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(_served(request).metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _standing_by(d: Served) -> web.Response | None:
    """A standby serves reads of the lease book from the database, and nothing else."""
    if d.role != "standby":
        return None
    return _json({"error": f"this node is a {d.not_ready()[0]}; ask the leader"}, 503)


async def _standby_leases(d: Served) -> list[Lease] | web.Response:
    assert d.leadership is not None
    if not d.leadership.database_ok:
        return _json({"error": "this node is a standby and cannot reach the database"}, 503)
    try:
        return await d.store.leases(ended_since=utcnow() - d.book.keep_ended)
    except StoreFailed:
        return _store_failed()


async def offers(request: web.Request) -> web.Response:
    d = _served(request)
    # `is None`, never `or`: a Response is a mapping, and an empty one is falsy.
    refused = _view_refused(d, request)
    if refused is None:
        refused = _standing_by(d)
    if refused is not None:
        return refused
    q = request.query
    try:
        limit = int(q.get("limit", "1000"))
        market = Market(q["market"]) if "market" in q else None
    except ValueError:
        return _json({"error": "limit must be a number; market spot, on_demand or reserved"}, 400)
    now = utcnow() if q.get("fresh") in ("1", "true") else None
    rows = [o for o in d.pool
            if (not q.get("gpu") or o.gpu == q["gpu"])
            and (not q.get("cloud") or o.pool.cloud == q["cloud"])
            and (not q.get("region") or o.pool.region == q["region"])
            and (market is None or o.pool.market is market)
            and (now is None or d.pool.is_fresh(o.pool, now))]
    rows.sort(key=lambda o: (o.price_per_gpu_hour is None, o.price_per_gpu_hour or 0.0,
                             o.pool))
    return _json([o.to_json() for o in rows[:max(0, limit)]])


async def leases(request: web.Request) -> web.Response:
    d = _served(request)
    if (refused := _view_refused(d, request)) is not None:
        return refused
    q = request.query
    state = q.get("state") or LeaseState.ACTIVE.value
    if state != "all" and state not in LEASE_STATES:
        return _json({"error": f"state must be one of {', '.join(LEASE_STATES)} or all"}, 400)
    if d.role == "standby":
        book = await _standby_leases(d)
        if isinstance(book, web.Response):
            return book
    else:
        try:
            await d.broker.settled()
        except StoreFailed:
            return _store_failed()
        book = d.book.all()
    rows = [le for le in book
            if (state == "all" or le.state.value == state)
            and (not q.get("scheduler") or le.scheduler == q["scheduler"])]
    rows.sort(key=lambda le: le.created_at)
    return _json([le.to_json() for le in rows])


async def lease(request: web.Request) -> web.Response:
    d = _served(request)
    if (refused := _view_refused(d, request)) is not None:
        return refused
    lease_id = request.match_info["lease_id"]
    if d.role == "standby":
        book = await _standby_leases(d)
        if isinstance(book, web.Response):
            return book
        found = next((le for le in book if le.lease_id == lease_id), None)
    else:
        try:
            await d.broker.settled()
        except StoreFailed:
            return _store_failed()
        found = d.book.get(lease_id)
    if found is None:
        return _json({"error": "no such lease"}, 404)
    return _json(found.to_json())


async def policy(request: web.Request) -> web.Response:
    d = _served(request)
    if (refused := _view_refused(d, request)) is not None:
        return refused
    return _json({"hash": d.policy_digest, "file": str(d.cfg.policy_file or ""),
                  "policy": d.broker.policy.model_dump(mode="json")})


# Many returns: one early return per refusal before the work.
async def place(request: web.Request) -> web.Response:  # noqa: PLR0911
    d = _served(request)
    if (refused := _standing_by(d)) is not None:
        return refused
    if (refused := _unauthorized(d, request, "placing")) is not None:
        return refused
    scheduler = request.match_info["scheduler"]
    if not SCHEDULER_ID.match(scheduler) or scheduler.startswith("_"):
        return _json({"error": "scheduler id must match [A-Za-z0-9_.-]{1,64}"}, 400)
    if request.content_length is not None and request.content_length > MAX_BODY:
        return _json({"error": f"body larger than {MAX_BODY} bytes"}, 413)
    try:
        # The whole body (read(n) of the stream returned the first segment only), in
        # bounded time: a client trickling it must not hold the connection for good.
        async with asyncio.timeout(d.cfg.http.body_timeout_seconds):
            body = await request.read()
    except TimeoutError:
        late = _json({"error": "the body did not arrive within "
                               f"{d.cfg.http.body_timeout_seconds:g} s"}, 408)
        late.force_close()
        return late
    except web.HTTPRequestEntityTooLarge:
        return _json({"error": f"body larger than {MAX_BODY} bytes"}, 413)
    answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
    topic = f"{d.topics.prefix}/requests/{scheduler}/place"
    await d.broker.submit(Command(scheduler, "place", body, topic, answer=answer))
    try:
        async with asyncio.timeout(ANSWER_TIMEOUT):
            envelope = await answer
    except TimeoutError:
        return _json({"error": "no decision in time; ask again with the same request_id"},
                     504)
    except StoreFailed:
        return _store_failed()
    kind = json.loads(envelope)["type"]
    status = 422 if kind == "gpubroker.request.invalid.v1" else 200
    return web.Response(body=envelope, status=status, content_type="application/json")


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
async def _in_progress(request: web.Request,
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


def build_app(served: Served) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY, middlewares=[_in_progress])
    app[SERVED] = served
    app.router.add_get("/livez", livez)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/offers", offers)
    app.router.add_get("/v1/leases", leases)
    app.router.add_get("/v1/leases/{lease_id}", lease)
    app.router.add_post("/v1/requests/{scheduler}/place", place)
    app.router.add_get("/v1/policy", policy)
    return app


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


async def serve(served: Served, host: str, port: int) -> web.AppRunner:
    cfg = served.cfg.http
    runner = web.AppRunner(build_app(served), access_log=None, handle_signals=False,
                           shutdown_timeout=2.0)
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
