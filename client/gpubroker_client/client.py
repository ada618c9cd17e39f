"""`BrokerClient`: the scheduler's verbs (place, renew, release, watch) on a `Session`,
and the requests behind them, sent again until answered."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, Literal

import aiomqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from gpubroker_client.errors import (
    BrokerError,
    InvalidRequest,
    LeaseEnded,
    PlacementTimeout,
    Rejected,
    RequestTimeout,
)
from gpubroker_client.events import _ENDS, _full_kind, _kind, _remaining
from gpubroker_client.lease import Callback, Lease
from gpubroker_client.model import SCHEDULER_ID, LeaseState, Placement, parse_iso
from gpubroker_client.session import Session, _Waiter
from gpubroker_client.watch import LeaseWatch

__all__ = ["MAX_REQUEST", "BrokerClient"]

log = logging.getLogger("gpubroker.client")

MAX_REQUEST = 64 * 1024
"""The daemon answers larger requests "too large" without their request_id."""


class BrokerClient(Session):
    """An asyncio client of one gpubroker daemon (SPEC §3-§5), for scheduler `scheduler`.

    Connection options mirror the daemon's `mqtt` config: `url` (`mqtt://` or
    `mqtts://`), `topic_prefix`, `username`, `password` or `password_file`, `ca_file`
    (or a ready `ssl_context`), `protocol` (`"5"`, `"3.1.1"`, or `"auto"`: MQTT 5, and
    3.1.1 when the server does not speak 5). `client_id` defaults to a unique one.
    `scheduler=None` makes a read-only client (lease watches, status)."""

    # --- verbs -------------------------------------------------------------------------

    # Many arguments: the public client's API: one keyword per field of a request.
    async def place(self, gpu: str | Sequence[str], gpus: int, *,  # noqa: PLR0913
                    market: Literal["spot", "on_demand", "reserved", "any"] | None = None,
                    request_id: str | None = None, timeout: float = 60.0,
                    gang: bool | None = None, max_price_per_gpu_hour: float | None = None,
                    clouds: Sequence[str] | None = None, regions: Sequence[str] | None = None,
                    team: str | None = None, duration_hours: float | None = None,
                    lease_seconds: int | None = None, labels: Mapping[str, str] | None = None,
                    max_parts: int | None = None,
                    keep_alive: bool | float = False, on_failover: Callback | None = None,
                    on_end: Callback | None = None, **extra: Any) -> Lease:
        """Ask for `gpus` GPUs of model `gpu` (one name or a list of acceptable ones).

        Returns the `Lease` (`placement.decided`); for a `request_id` whose lease has
        ended since, that ended lease (`lease.active` is False). Raises `Rejected`,
        `InvalidRequest`, or `PlacementTimeout` after `timeout` seconds without an answer
        (re-sent meanwhile with the same `request_id`, so a repeat cannot place twice).
        `keep_alive=True` renews before expiry (a number: that margin in seconds).
        With `gang=False` and `max_parts` above 1 the request may be split across pools:
        the returned lease is the first part, `lease.parts` all of them (the callbacks
        and the keep-alive apply to each).
        Extra keyword arguments are sent as further request fields."""
        scheduler = self._need_scheduler()
        rid = str(uuid.uuid4()) if request_id is None else request_id
        if not isinstance(rid, str) or not 0 < len(rid) <= 128:
            raise InvalidRequest([{"field": "request_id",
                                   "message": "must be a string of 1 to 128 characters"}],
                                 None)
        body: dict[str, Any] = {"request_id": rid,
                                "gpu": gpu if isinstance(gpu, str) else list(gpu),
                                "gpus": gpus}
        optional = {"gang": gang, "market": market,
                    "max_price_per_gpu_hour": max_price_per_gpu_hour,
                    "clouds": None if clouds is None else list(clouds),
                    "regions": None if regions is None else list(regions), "team": team,
                    "duration_hours": duration_hours, "lease_seconds": lease_seconds,
                    "max_parts": max_parts,
                    "labels": None if labels is None else dict(labels), **extra}
        body.update({k: v for k, v in optional.items() if v is not None})
        payload = json.dumps(body, separators=(",", ":")).encode()
        if len(payload) > MAX_REQUEST:
            raise InvalidRequest([{"field": "", "message": f"too large: {len(payload)} "
                                   f"bytes (at most {MAX_REQUEST})"}], rid)

        def match(kind: str, data: Mapping[str, Any]) -> bool:
            return kind in ("placement.decided", "placement.rejected", "request.invalid") \
                and data.get("request_id") == rid

        try:
            answer = await self._request(f"{self.prefix}/requests/{scheduler}/place",
                                         payload, match, timeout)
        except RequestTimeout:
            raise PlacementTimeout(self._timeout_message(f"placement {rid}", timeout),
                                   rid) from None
        env = answer.answer
        assert env is not None
        if answer.error is not None:
            raise BrokerError(f"placement {rid}: {answer.error}")
        kind, data = _full_kind(env), env["data"]
        if kind == "placement.rejected":
            retry = data.get("retry_after_seconds")
            raise Rejected(str(data.get("code", "")), str(data.get("detail", "")),
                           float(retry) if isinstance(retry, int | float) else None, rid, env)
        if kind == "request.invalid":
            raise InvalidRequest(data.get("errors") or [], rid, env)
        lease = answer.lease
        assert lease is not None
        for part in lease.parts:
            if on_failover is not None:
                part.on_failover = on_failover
            if on_end is not None:
                part.on_end = on_end
            if keep_alive is not False and part.active:
                part.keep_alive(None if keep_alive is True else float(keep_alive))
        return lease

    async def release(self, lease_id: str, timeout: float = 30.0) -> LeaseState:
        """Release a lease by id (one this client may not hold: the command line's
        `release`). Returns how it ended (RELEASED, or EXPIRED/FAILED before); raises
        `InvalidRequest` (field `lease_id`) for a lease the scheduler does not have."""
        lease = self._leases.get(lease_id)
        if lease is not None:
            await lease.release(timeout)
            return lease.state
        env = await self._lease_verb("release", lease_id, timeout)
        return _ENDS[_kind(env)]

    async def renew(self, lease_id: str, timeout: float = 30.0) -> datetime:
        """Renew a lease by id; returns the new expiry. Raises `LeaseEnded`."""
        lease = self._leases.get(lease_id)
        if lease is not None:
            await lease.renew(timeout)
            return lease.expires_at
        env = await self._lease_verb("renew", lease_id, timeout)
        kind, data = _kind(env), env["data"]
        if kind in _ENDS:
            raise LeaseEnded(lease_id, _ENDS[kind], data.get("detail"))
        return parse_iso(data["expires_at"])

    def watch_leases(self, scheduler: str | None = None, *,
                     all_schedulers: bool = False) -> LeaseWatch:
        """The retained lease states of one scheduler (default: this client's) or of
        all, as `async with client.watch_leases() as watch:` — see `LeaseWatch`."""
        s = scheduler or self.scheduler
        if all_schedulers:
            s = "+"
        elif s is None or not SCHEDULER_ID.match(s):
            raise ValueError("watch_leases needs a scheduler id or all_schedulers=True")
        return LeaseWatch(self, s)

    async def _lease_verb(self, verb: str, lease_id: str, timeout: float,
                          body: Mapping[str, Any] | None = None, *,
                          once: bool = False) -> Mapping[str, Any]:
        """Send renew/release/report for `lease_id` and wait for its answer: an event of
        that lease (renewed, failover, or how it ended). Raises InvalidRequest."""
        scheduler = self._need_scheduler()
        if not isinstance(lease_id, str) or not 0 < len(lease_id) <= 128:
            raise InvalidRequest([{"field": "lease_id",
                                   "message": "must be a string of 1 to 128 characters"}])
        topic = f"{self.prefix}/requests/{scheduler}/{verb}"
        answers = {"renew": {"lease.renewed"}, "release": set(),
                   "report": {"lease.failover"}}[verb] | \
            {"lease.released", "lease.expired", "lease.failed"}
        quoted = repr(lease_id)

        def match(kind: str, data: Mapping[str, Any]) -> bool:
            if kind in answers:
                return data.get("lease_id") == lease_id
            # 3.1.1 (no CorrelationData): an invalid answer names the topic, and the
            # daemon's message quotes the lease id.
            return kind == "request.invalid" and data.get("topic") == topic and any(
                quoted in str(e.get("message", "")) for e in data.get("errors") or [])

        payload = json.dumps(body or {"lease_id": lease_id}, separators=(",", ":")).encode()
        env = (await self._request(topic, payload, match, timeout, once=once)).answer
        assert env is not None
        if _full_kind(env) == "request.invalid":
            raise InvalidRequest(env["data"].get("errors") or [], None, env)
        return env

    def _need_scheduler(self) -> str:
        if self.scheduler is None:
            raise BrokerError("this client has no scheduler id (scheduler=None): read only")
        return self.scheduler

    def _timeout_message(self, what: str, timeout: float) -> str:
        if not self.connected:
            why = "the MQTT server is unreachable"
        elif self.daemon_online is False:
            why = "the daemon is offline"
        elif self.daemon_online is None:
            why = "no daemon has announced itself on this topic prefix"
        else:
            why = "the daemon is online but did not answer"
        return f"no answer to {what} within {timeout:g}s ({why})"

    async def _request(self, topic: str, payload: bytes,
                       match: Callable[[str, Mapping[str, Any]], bool],
                       timeout: float, *, once: bool = False) -> _Waiter:
        """Publish `payload` and wait for the matching answer; send it again with
        backoff, after every reconnect and when the daemon comes back online, until the
        deadline. `once`: only until the MQTT server has acknowledged it (a request
        whose repeat is not harmless: a report moves the lease each time)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        waiter = _Waiter(match)
        self._waiters.add(waiter)
        self._by_token[waiter.token] = waiter
        props = None
        if self._v5 and self._reply_topic is not None:
            props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
            props.ResponseTopic = self._reply_topic
            props.CorrelationData = waiter.token
        delay = self.resend_after
        sent: tuple[int, int] | None = None  # (connection, daemon online) generations
        delivered = False  # `once` and acknowledged: never again
        next_send = loop.time()
        try:
            while True:
                if waiter.answer is not None:
                    return waiter
                if self._closed:
                    raise BrokerError("the client is closed")
                now = loop.time()
                if now >= deadline:
                    raise RequestTimeout(self._timeout_message(topic, timeout))
                client = self._client
                marks = (self._generation, self._online_generation)
                due = sent != marks or now >= next_send
                if client is not None and self.connected and due and not delivered:
                    waiter.kick.clear()
                    again = sent is not None
                    sent = marks
                    if await self._publish(client, topic, payload, props):
                        if again:
                            log.info("no answer yet; sent again: %s", topic)
                        delivered = once
                        next_send = loop.time() + delay
                        delay = min(delay * 2, self.resend_max)
                    else:  # the connection is likely going: again after it, or in 1 s
                        next_send = loop.time() + 1.0
                    continue
                wake = min(deadline, next_send) if self.connected and not delivered \
                    else deadline
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout_at(wake):
                        await waiter.kick.wait()
                waiter.kick.clear()
        finally:
            self._waiters.discard(waiter)
            self._by_token.pop(waiter.token, None)

    async def _publish(self, client: aiomqtt.Client, topic: str, payload: bytes,
                       props: Properties | None) -> bool:
        """QoS 1, never retained; True once the server acknowledged it. (asyncio.timeout,
        not aiomqtt's own, for the reason in `broker.edges.bus.Bus._publish`.)"""
        try:
            async with asyncio.timeout(10):
                await client.publish(topic, payload, qos=1, retain=False,
                                     properties=props if self._v5 else None,
                                     timeout=math.inf)
        except (aiomqtt.MqttError, TimeoutError) as exc:
            log.info("publish on %s failed (%s); the request is sent again", topic, exc)
            return False
        return True

    def _dispatch(self, env: Mapping[str, Any], correlation: bytes | None) -> None:
        kind, data = _full_kind(env), env["data"]
        # The lease first, so that an answer's waiter sees the lease updated.
        lease = self._leases.get(str(data.get("lease_id", "")))
        if lease is not None and kind.startswith("lease."):
            try:
                lease._apply(_kind(env), env)
            except (KeyError, ValueError, TypeError) as exc:
                log.warning("malformed %s event for %s ignored: %s", kind, lease.lease_id, exc)
        waiter = self._by_token.get(correlation) if correlation else None
        if waiter is None:
            waiter = next((w for w in self._waiters if w.match(kind, data)), None)
        if waiter is None or waiter.answer is not None:
            return
        if kind == "placement.decided":
            try:
                waiter.lease = self._adopt(env)
            except (KeyError, ValueError, TypeError) as exc:
                waiter.error = f"unreadable placement.decided ({type(exc).__name__}: {exc})"
        waiter.answer = env
        waiter.kick.set()

    def _adopt(self, env: Mapping[str, Any]) -> Lease:
        """The lease of a `placement.decided` answer: the one already held (a repeat
        may show a later epoch or an end), or a new one."""
        d = env["data"]
        lease = self._leases.get(d["lease_id"])
        if lease is None:
            return self._lease_of(env)
        if d.get("state") in _ENDS:
            lease._apply(d["state"], {**env, "data": {"lease_id": lease.lease_id}})
        elif int(d["epoch"]) > lease.epoch:
            lease._move(int(d["epoch"]), Placement.from_json(d["placement"]), None,
                        "learnt from a repeated placement", env)
        return lease

    def _lease_of(self, env: Mapping[str, Any]) -> Lease:
        d = env["data"]
        assert self.scheduler is not None
        made: list[Lease] = []
        for part in d.get("parts") or [d]:
            held = self._leases.get(part["lease_id"]) if made else None
            if held is not None:  # a part this client already holds
                made.append(held)
                continue
            expires = parse_iso(part["expires_at"])
            lease = Lease(self, lease_id=part["lease_id"], scheduler=self.scheduler,
                          request_id=d["request_id"], epoch=int(part["epoch"]),
                          placement=Placement.from_json(part["placement"]),
                          expires_at=expires, remaining=_remaining(expires, env),
                          state=LeaseState(part.get("state", "active")),
                          reason=str(d.get("reason", "")),
                          alternatives=[Placement.from_json(a)
                                        for a in d.get("alternatives", [])] if not made else [],
                          decided=d)
            if lease.active:
                self._leases[lease.lease_id] = lease
            made.append(lease)
        for lease in made:
            lease.parts = made
        return made[0]

    def _forget(self, lease: Lease) -> None:
        self._leases.pop(lease.lease_id, None)
