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
broker stops (`broker.core`): a request waiting for its answer, or arriving after, gets
503 "state store failed; not executed" at once, as do the lease views.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from broker.core import Command
from broker.model import SCHEDULER_ID, Lease, LeaseState, Market, utcnow
from broker.store import StoreFailed

if TYPE_CHECKING:
    from broker.daemon import Daemon

MAX_BODY = 64 * 1024
LEASE_STATES = tuple(s.value for s in LeaseState)
ANSWER_TIMEOUT = 30.0
DAEMON = web.AppKey("daemon", object)


def _daemon(request: web.Request) -> Daemon:
    return request.app[DAEMON]  # type: ignore[return-value]


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(data, separators=(",", ":")), status=status,
                        content_type="application/json")


def _store_failed() -> web.Response:
    return _json({"error": "state store failed; not executed"}, 503)


async def livez(_: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def readyz(request: web.Request) -> web.Response:
    reasons = _daemon(request).not_ready()
    if reasons:
        return web.Response(text="not ready: " + "; ".join(reasons) + "\n", status=503)
    return web.Response(text="ready\n")


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(_daemon(request).metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _standing_by(d: Daemon) -> web.Response | None:
    """A standby serves reads of the lease book from the database, and nothing else."""
    if d.role != "standby":
        return None
    return _json({"error": f"this node is a {d.not_ready()[0]}; ask the leader"}, 503)


async def _standby_leases(d: Daemon) -> list[Lease] | web.Response:
    assert d.leadership is not None
    if not d.leadership.database_ok:
        return _json({"error": "this node is a standby and cannot reach the database"}, 503)
    try:
        return await d.store.leases(ended_since=utcnow() - d.book.keep_ended)
    except StoreFailed:
        return _store_failed()


async def offers(request: web.Request) -> web.Response:
    d = _daemon(request)
    if (refused := _standing_by(d)) is not None:
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
    d = _daemon(request)
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
    d = _daemon(request)
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
    d = _daemon(request)
    return _json({"hash": d.policy_digest, "file": str(d.cfg.policy_file or ""),
                  "policy": d.broker.policy.model_dump(mode="json")})


async def place(request: web.Request) -> web.Response:
    d = _daemon(request)
    if (refused := _standing_by(d)) is not None:
        return refused
    token = d.http_token
    if token is None:
        return _json({"error": "placing over HTTP needs http.token_file in the config"}, 403)
    auth = request.headers.get("Authorization", "")
    given = auth[7:].encode() if auth.startswith("Bearer ") else b""
    if not hmac.compare_digest(given, token):
        return web.json_response({"error": "a valid bearer token is required"}, status=401,
                                 headers={"WWW-Authenticate": 'Bearer realm="gpubroker"'})
    scheduler = request.match_info["scheduler"]
    if not SCHEDULER_ID.match(scheduler) or scheduler.startswith("_"):
        return _json({"error": "scheduler id must match [A-Za-z0-9_.-]{1,64}"}, 400)
    if request.content_length is not None and request.content_length > MAX_BODY:
        return _json({"error": f"body larger than {MAX_BODY} bytes"}, 413)
    body = await request.content.read(MAX_BODY + 1)
    if len(body) > MAX_BODY:
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


def build_app(daemon: Daemon) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY)
    app[DAEMON] = daemon
    app.router.add_get("/livez", livez)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/offers", offers)
    app.router.add_get("/v1/leases", leases)
    app.router.add_get("/v1/leases/{lease_id}", lease)
    app.router.add_post("/v1/requests/{scheduler}/place", place)
    app.router.add_get("/v1/policy", policy)
    return app


async def serve(daemon: Daemon, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(build_app(daemon), access_log=None, handle_signals=False,
                           shutdown_timeout=2.0)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner

