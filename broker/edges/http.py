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
  filters `scheduler` and `request_id` (with it, every state unless `state` is given: the
  lease, every part of a split, placed with that request_id).
* A standby (high availability) answers /livez, /readyz (503, "standby (…)"), /metrics,
  /v1/policy and the lease reads (from the database); /v1/offers and placing: 503.
* `POST /v1/requests/{S}/<verb>`, for every verb of MQTT's `P/requests/S/<verb>`
  (`place`, `renew`, `release`, `report`, `quote`, ...): same body and answer as MQTT;
  bearer token required.
* `GET /v1/policy`: the policy in force and its hash.

The answer to a POST is the CloudEvents envelope the scheduler also gets on MQTT: 200 for
every answer event (`placement.decided`, `lease.renewed`, `placement.quoted` ...), 422 for
`request.invalid`. Bodies over
64 KiB get 413; a missing or wrong token 401 (compared in constant time); with no token
file configured, the endpoint answers 403. When the state store refuses a commit the
broker stops (`broker.leasing.authority`): a request waiting for its answer, or arriving after, gets
503 "state store failed; not executed" at once, as do the lease views. With
`http.views_need_token` the read-only views (/v1/offers, /v1/leases…, /v1/policy) want
the token too; /livez, /readyz and /metrics never do.

The listener (`broker.edges.listener`) bounds and times the connections.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from broker.daemon.config import Config
from broker.edges.listener import in_progress, listen
from broker.edges.metrics import Metrics
from broker.leasing.authority import Broker
from broker.leasing.book import LeaseBook
from broker.market.pool import ResourcePool
from broker.model import Lease, LeaseState, Market, scheduler_id_problem, utcnow
from broker.state.leadership import Leadership
from broker.state.store import Store, StoreFailed
from broker.wire.commands import VERBS, Command
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


async def _stored_leases(d: Served, state: str, scheduler: str | None,
                         request_id: str | None) -> list[Lease] | web.Response:
    """Leases as committed, from the store: active, and ended within
    `state.keep_ended_hours` (the lease book holds the active ones only)."""
    if d.role == "standby":
        assert d.leadership is not None
        if not d.leadership.database_ok:
            return _json({"error": "this node is a standby and cannot reach the database"},
                         503)
    try:
        return await d.store.leases(ended_since=utcnow() - d.book.keep_ended,
                                    state=None if state == "all" else state,
                                    scheduler=scheduler, request_id=request_id)
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
    # By request_id (a lookup): the lease in any state unless `state` says otherwise.
    state = q.get("state") or ("all" if q.get("request_id") else LeaseState.ACTIVE.value)
    if state != "all" and state not in LEASE_STATES:
        return _json({"error": f"state must be one of {', '.join(LEASE_STATES)} or all"}, 400)
    if d.role != "standby" and state == LeaseState.ACTIVE.value:
        try:
            await d.broker.settled()
        except StoreFailed:
            return _store_failed()
        book = d.book.active()
    else:  # ended leases are read from the store (the book holds the active ones)
        if d.role != "standby":
            try:
                await d.broker.settled()
            except StoreFailed:
                return _store_failed()
        stored = await _stored_leases(d, state, q.get("scheduler") or None,
                                      q.get("request_id") or None)
        if isinstance(stored, web.Response):
            return stored
        book = stored
    rows = [le for le in book
            if (state == "all" or le.state.value == state)
            and (not q.get("scheduler") or le.scheduler == q["scheduler"])
            and (not q.get("request_id") or le.request_id == q["request_id"])]
    rows.sort(key=lambda le: (le.created_at, le.part))
    return _json([le.to_json() for le in rows])


async def lease(request: web.Request) -> web.Response:
    d = _served(request)
    if (refused := _view_refused(d, request)) is not None:
        return refused
    lease_id = request.match_info["lease_id"]
    found = None
    if d.role == "standby":
        assert d.leadership is not None
        if not d.leadership.database_ok:
            return _json({"error": "this node is a standby and cannot reach the database"},
                         503)
    else:
        try:
            await d.broker.settled()
        except StoreFailed:
            return _store_failed()
        found = d.book.get(lease_id)
    if found is None:  # a standby's, or one that has ended and left the book's memory
        try:
            found = await d.store.lease(lease_id)
        except StoreFailed:
            return _store_failed()
    if found is None:
        return _json({"error": "no such lease"}, 404)
    return _json(found.to_json())


async def policy(request: web.Request) -> web.Response:
    d = _served(request)
    if (refused := _view_refused(d, request)) is not None:
        return refused
    return _json({"hash": d.policy_digest, "file": str(d.cfg.policy_file or ""),
                  "policy": d.broker.policy.model_dump(mode="json")})


def requests_of(verb: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The handler of `POST /v1/requests/{S}/<verb>`."""

    async def handler(request: web.Request) -> web.Response:
        return await command(request, verb)

    handler.__name__ = handler.__qualname__ = verb
    return handler


# Many returns: one early return per refusal before the work.
async def command(request: web.Request, verb: str) -> web.Response:  # noqa: PLR0911
    """`POST /v1/requests/{S}/<verb>`: the MQTT request's body, answered with the event
    the scheduler also gets on MQTT, the same bytes (every verb alike)."""
    d = _served(request)
    if (refused := _standing_by(d)) is not None:
        return refused
    what = "placing" if verb == "place" else f"{verb} requests"
    if (refused := _unauthorized(d, request, what)) is not None:
        return refused
    scheduler = request.match_info["scheduler"]
    if (problem := scheduler_id_problem(scheduler)) is not None:
        return _json({"error": problem}, 400)
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
    topic = f"{d.topics.prefix}/requests/{scheduler}/{verb}"
    await d.broker.submit(Command(scheduler, verb, body, topic, answer=answer))
    try:
        async with asyncio.timeout(ANSWER_TIMEOUT):
            envelope = await answer
    except TimeoutError:
        again = "with the same request_id" if verb == "place" else "again"
        return _json({"error": f"no answer in time; ask {again}"}, 504)
    except StoreFailed:
        return _store_failed()
    kind = json.loads(envelope)["type"]
    status = 422 if kind == "gpubroker.request.invalid.v1" else 200
    return web.Response(body=envelope, status=status, content_type="application/json")


def build_app(served: Served) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY, middlewares=[in_progress])
    app[SERVED] = served
    app.router.add_get("/livez", livez)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/offers", offers)
    app.router.add_get("/v1/leases", leases)
    app.router.add_get("/v1/leases/{lease_id}", lease)
    for verb in VERBS:  # every verb MQTT takes, on par
        app.router.add_post(f"/v1/requests/{{scheduler}}/{verb}", requests_of(verb))
    app.router.add_get("/v1/policy", policy)
    return app


async def serve(served: Served, host: str, port: int) -> web.AppRunner:
    return await listen(build_app(served), served.cfg.http, host, port)
