"""A scheduler's client for gpubroker: place, renew, release and follow leases over MQTT.

::

    async with BrokerClient("mqtt://127.0.0.1:1883", scheduler="train") as c:
        lease = await c.place(gpu=["H100-80GB", "A100-80GB"], gpus=8, market="spot",
                              keep_alive=True)
        print(lease.lease_id, lease.epoch, lease.placement, lease.expires_at)
        async for ev in lease.events():      # failover, renewed, released, expired, failed
            ...
        await lease.release()

What it does for the scheduler (SPEC §3-§5):

* **One connection, kept up.** A unique client id per client and a clean session; when
  the MQTT server goes away it reconnects by itself (jittered backoff, 0.5 s doubling to
  15 s) and subscribes again before anything is sent, so no answer is missed for want of
  a subscription. `BrokerUnavailable` only when the first connection cannot be made
  within `connect_timeout`.
* **Idempotent requests.** `place()` sends the request (QoS 1, never retained) and waits
  for the answer with its `request_id`; an unanswered request is sent again with the same
  `request_id` (2 s, doubling, at most 15 s apart), and at once after a reconnect (the
  answer may have been lost with the connection) or when the daemon comes back online.
  The daemon answers a repeat with the same lease, never a second one. Renew, release
  and report are re-sent the same way.
* **Replies.** On MQTT 5 every request carries a ResponseTopic under
  `P/replies/S/<random>` and a CorrelationData; answers are still taken from
  `P/events/S/...` as well (MQTT 3.1.1, or whichever copy comes first). Every event is
  handled once, by its CloudEvents `id`.
* **Fencing.** A lease's `epoch` grows with each failover; events of a lower epoch than
  the lease has seen (a late re-send) are ignored. After a reconnect the retained lease
  state (`P/leases/S/<id>`) tells of a failover whose event was missed while away.
* **The daemon's status.** `daemon_online` follows `P/status` (`None` until known).
  Requests keep waiting, and re-sending, while the daemon is offline, until their own
  deadline.
* **Leader epochs** (high availability). A `P/status` whose `epoch` is lower than the
  highest leader epoch seen (on a status or in an event's `leaderepoch`) comes from a
  deposed leader, late: it is ignored, so it cannot make the client believe the daemon
  offline while the new leader serves. An event whose `leaderepoch` is lower than the
  highest seen on an event is dropped likewise. (Events are compared with events only:
  a new leader sends the old one's unacknowledged events again, byte for byte, with
  their old `leaderepoch`, after its own `online`.)

Known limit: a lease that ends while the client is disconnected (its end event is lost
with the clean session) is learnt at the next `renew()`, which the keep-alive sends.

This module needs only aiomqtt and the project's vocabulary (`broker.model`): a scheduler
installs `gpubroker` without any cloud SDK and imports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import math
import random
import ssl
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

import aiomqtt
from aiomqtt.exceptions import MqttConnectError
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from broker.model import SCHEDULER_ID, LeaseState, Placement, parse_iso
from gpubroker_client import files
from gpubroker_client.mqtturl import parse_mqtt_url

__all__ = [
    "DEFAULT_PREFIX",
    "BrokerClient",
    "BrokerError",
    "BrokerUnavailable",
    "InvalidRequest",
    "Lease",
    "LeaseChange",
    "LeaseEnded",
    "LeaseEvent",
    "LeaseWatch",
    "PlacementTimeout",
    "Rejected",
    "RequestTimeout",
    "parse_mqtt_url",
]

log = logging.getLogger("gpubroker.client")

DEFAULT_PREFIX = "gpubroker/v1"
MAX_REQUEST = 64 * 1024
"""The daemon answers larger requests "too large" without their request_id."""
SEEN_IDS = 4096
"""Event ids remembered for dropping duplicates (the same event on the event topic and
the ResponseTopic, or sent again by the daemon after a reconnect)."""
HISTORY = 256
"""Events a lease keeps for `Lease.events()` callers that start late."""
SYNC_FALLBACK_SECONDS = 2.0
"""How long a lease watch waits for the retained `P/status`, its end-of-snapshot marker,
before it takes what has come as the snapshot (a daemon that never ran on this prefix
left no status)."""

Protocol = Literal["5", "3.1.1", "auto"]
Callback = Callable[["Lease", "LeaseEvent"], object]


# --- errors ------------------------------------------------------------------------------


class BrokerError(Exception):
    """Base of every error this client raises."""


class BrokerUnavailable(BrokerError):
    """The MQTT server could not be reached (or refused the connection) in time."""


class RequestTimeout(BrokerError, TimeoutError):
    """No answer from the daemon before the deadline (it was asked again meanwhile)."""


class PlacementTimeout(RequestTimeout):
    """`place()` had no answer before its deadline. Calling `place()` again with the same
    `request_id` is safe: it gets the lease if one was decided meanwhile."""

    def __init__(self, message: str, request_id: str) -> None:
        super().__init__(message)
        self.request_id = request_id


class Rejected(BrokerError):
    """`placement.rejected`: `code` is `no_capacity`, `over_price_cap`, `over_budget` or
    `policy_denied`; `retry_after` (seconds) when the daemon suggests one."""

    def __init__(self, code: str, detail: str, retry_after: float | None,
                 request_id: str, event: Mapping[str, Any] | None = None) -> None:
        hint = f" (retry after {retry_after:g}s)" if retry_after is not None else ""
        super().__init__(f"{code}: {detail}{hint}")
        self.code = code
        self.detail = detail
        self.retry_after = retry_after
        self.request_id = request_id
        self.event = event


class InvalidRequest(BrokerError, ValueError):
    """`request.invalid`: `errors` is a list of `{"field", "message"}`."""

    def __init__(self, errors: Sequence[Mapping[str, str]], request_id: str | None = None,
                 event: Mapping[str, Any] | None = None) -> None:
        self.errors = [{"field": str(e.get("field", "")), "message": str(e.get("message", ""))}
                       for e in errors]
        self.request_id = request_id
        self.event = event
        super().__init__("; ".join(f"{e['field'] or '(request)'}: {e['message']}"
                                   for e in self.errors) or "invalid request")

    @property
    def fields(self) -> list[str]:
        return [e["field"] for e in self.errors]


class LeaseEnded(BrokerError):
    """The lease has ended (`state`: released, expired or failed): it cannot be renewed
    or reported on."""

    def __init__(self, lease_id: str, state: LeaseState, detail: str | None = None) -> None:
        super().__init__(f"lease {lease_id} has {state.value}"
                         + (f": {detail}" if detail else ""))
        self.lease_id = lease_id
        self.state = state
        self.detail = detail


# --- values ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LeaseEvent:
    """Something that happened to a lease.

    `kind`: `failover` (a new `epoch` and `placement`; `previous` is where it was),
    `renewed` (a new `expires_at`), or an end: `released`, `expired`, `failed`.
    `reason`/`detail` as the daemon gave them (`None` for a failover learnt from the
    retained lease state after a reconnect, whose event was missed). `envelope` is the
    CloudEvent, when there was one."""

    kind: str
    lease_id: str
    epoch: int
    placement: Placement
    previous: Placement | None = None
    expires_at: datetime | None = None
    reason: str | None = None
    detail: str | None = None
    envelope: Mapping[str, Any] | None = None

    @property
    def ended(self) -> bool:
        return self.kind in _ENDS


_ENDS = {"released": LeaseState.RELEASED, "expired": LeaseState.EXPIRED,
         "failed": LeaseState.FAILED}


@dataclass(frozen=True, slots=True)
class LeaseChange:
    """A change seen by a `LeaseWatch`: `kind` is `placed`, `renewed`, `failover`, or an
    end: `released`, `expired`, `failed` — or `ended` when it is not known how (the end
    event was not readable, or the lease ended while the watch was disconnected).
    `state` is the retained lease state (SPEC's lease JSON), the last one for an end."""

    kind: str
    lease_id: str
    scheduler: str
    state: Mapping[str, Any] | None
    reason: str | None = None
    detail: str | None = None




# --- the lease ------------------------------------------------------------------------


class Lease:
    """GPUs granted to one request, kept current by the client that placed it.

    Fields: `lease_id`, `scheduler`, `request_id`, `epoch` (the fencing token: it grows
    with each failover), `placement` (`broker.model.Placement`: `pool.cloud`,
    `pool.zone`, `pool.instance_type`, `pool.market`, `instances`, `gpu`, `gpus` per
    instance, `total_gpus`, `price_per_hour`, `price_per_gpu_hour`), `expires_at`,
    `state`, `reason` (why it was placed there), `alternatives`, `lease_seconds`.

    `on_failover(lease, event)` and `on_end(lease, event)` are called for those events
    (plain functions or coroutine functions); `events()` iterates over all of them."""

    # Many arguments: one keyword per field of the daemon's answer.
    def __init__(self, client: BrokerClient, *, lease_id: str, scheduler: str,  # noqa: PLR0913
                 request_id: str, epoch: int, placement: Placement, expires_at: datetime,
                 remaining: float, state: LeaseState, reason: str,
                 alternatives: Sequence[Placement], decided: Mapping[str, Any]) -> None:
        self._client = client
        self.lease_id = lease_id
        self.scheduler = scheduler
        self.request_id = request_id
        self.epoch = epoch
        self.placement = placement
        self.expires_at = expires_at
        self.state = state
        self.reason = reason
        self.alternatives = list(alternatives)
        self.decided = decided
        """The `placement.decided` event's data, as received."""
        self.lease_seconds = max(1.0, remaining)
        """The renewal period, as the first answer showed it (expiry minus decision time)."""
        self.on_failover: Callback | None = None
        self.on_end: Callback | None = None
        self.end: LeaseEvent | None = None
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + remaining  # local monotonic expiry
        self._history: deque[LeaseEvent] = deque(maxlen=HISTORY)
        self._count = 0  # events ever appended
        self._pulse = asyncio.Event()
        self._keep_alive: asyncio.Task[None] | None = None
        self.parts: list[Lease] = [self]
        """A request split across pools (`max_parts`): every part's lease, this one
        first; each is renewed, released and failed over on its own. `[self]` for a
        request placed whole."""

    def __repr__(self) -> str:
        p = self.placement
        return (f"<Lease {self.lease_id} {self.state.value} epoch={self.epoch} "
                f"{p.instances}x{p.gpus} {p.gpu} {p.pool} expires={self.expires_at}>")

    @property
    def active(self) -> bool:
        return self.state is LeaseState.ACTIVE

    @property
    def keeping_alive(self) -> bool:
        """Whether a keep-alive renews this lease."""
        task = self._keep_alive
        return task is not None and not task.done() and not task.cancelling()

    @property
    def seconds_left(self) -> float:
        """Seconds until the lease expires unless renewed (local clock, skew-free)."""
        return self._deadline - asyncio.get_running_loop().time()

    # --- verbs -------------------------------------------------------------------------

    async def renew(self, timeout: float = 30.0) -> None:
        """Renew; returns once `lease.renewed` came (`expires_at` is updated). Raises
        `LeaseEnded` if the lease has ended, `RequestTimeout` without an answer."""
        if not self.active:
            raise LeaseEnded(self.lease_id, self.state)
        env = await self._client._lease_verb("renew", self.lease_id, timeout)
        kind, data = _kind(env), env.get("data", {})
        if kind in _ENDS:
            raise LeaseEnded(self.lease_id, _ENDS[kind], data.get("detail"))

    async def release(self, timeout: float = 30.0) -> None:
        """Release; returns once the daemon confirmed the lease has ended (released, or
        expired or failed before). Idempotent: returns at once on an ended lease."""
        if not self.active:
            return
        await self._client._lease_verb("release", self.lease_id, timeout)

    async def report(self, kind: Literal["interrupted", "launch_failed", "unhealthy"],
                     detail: str | None = None, timeout: float = 30.0) -> LeaseEvent:
        """Tell the daemon the placement does not work (SPEC `report`): it moves the
        lease elsewhere. Returns the failover event; raises `LeaseEnded` when it found
        nowhere to go (the lease failed) or the lease had ended."""
        if not self.active:
            raise LeaseEnded(self.lease_id, self.state)
        body: dict[str, Any] = {"lease_id": self.lease_id, "kind": kind}
        if detail is not None:
            body["detail"] = detail
        env = await self._client._lease_verb("report", self.lease_id, timeout, body,
                                             once=True)
        answer, data = _kind(env), env.get("data", {})
        if answer in _ENDS:
            raise LeaseEnded(self.lease_id, _ENDS[answer], data.get("detail"))
        for ev in reversed(self._history):
            if ev.envelope is not None and ev.envelope.get("id") == env.get("id"):
                return ev
        return LeaseEvent("failover", self.lease_id, self.epoch, self.placement,
                          reason=data.get("reason"), detail=data.get("detail"), envelope=env)

    def keep_alive(self, margin: float | None = None) -> None:
        """Renew in the background before expiry, `margin` seconds before it (default:
        half the lease period); stops when the lease ends or the client closes.
        Calling it again changes the margin."""
        if self._keep_alive is not None:
            self._keep_alive.cancel()
        if not self.active:
            return
        m = self.lease_seconds / 2 if margin is None else margin
        if not 0 <= m < self.lease_seconds:
            raise ValueError(f"margin must be at least 0 and under the lease period "
                             f"({self.lease_seconds:g}s)")
        self._keep_alive = self._client._spawn(self._renewing(m))

    async def _renewing(self, margin: float) -> None:
        loop = asyncio.get_running_loop()
        while self.active:
            wait = self._deadline - margin - loop.time()
            if wait > 0:
                pulse = self._pulse
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await pulse.wait()
                continue
            try:
                await self.renew(timeout=max(5.0, margin))
            except LeaseEnded:
                return
            except RequestTimeout:
                log.warning("lease %s: no answer to a renewal; asking again", self.lease_id)
            except BrokerError as exc:  # an invalid answer: the daemon does not know it
                log.error("lease %s: renewal refused (%s); keep-alive stops",
                          self.lease_id, exc)
                return

    # --- events ----------------------------------------------------------------------

    async def events(self) -> AsyncIterator[LeaseEvent]:
        """Every event of this lease since it was placed (the last few hundred), then
        live ones as they come; ends after the lease's end event."""
        i = 0  # the next event's number (events ever recorded, counted from 0)
        while True:
            first = self._count - len(self._history)  # the oldest one kept
            i = max(i, first)
            if i < self._count:
                event = self._history[i - first]
                i += 1
                yield event
                continue
            if not self.active or self._client._closed:
                return
            pulse = self._pulse
            await pulse.wait()

    async def wait_ended(self) -> LeaseEvent:
        """Wait until the lease ends; its end event."""
        while self.end is None:
            if self._client._closed:
                raise BrokerError("the client is closed")
            pulse = self._pulse
            await pulse.wait()
        return self.end

    # --- updates (from the client's message handler) -----------------------------------

    def _changed(self) -> None:
        pulse, self._pulse = self._pulse, asyncio.Event()
        pulse.set()

    def _set_expiry(self, expires_at: datetime, remaining: float) -> None:
        self.expires_at = expires_at
        self._deadline = asyncio.get_running_loop().time() + remaining

    def _record(self, event: LeaseEvent, callback: Callback | None) -> None:
        self._history.append(event)
        self._count += 1
        self._changed()
        if callback is not None:
            self._client._call(callback, self, event)

    def _apply(self, kind: str, env: Mapping[str, Any]) -> None:
        """An event of this lease: fenced by epoch, applied once (ids are deduplicated
        before)."""
        if not self.active:
            return
        d = env["data"]
        if kind in _ENDS:
            self.state = _ENDS[kind]
            self.end = LeaseEvent(kind, self.lease_id, self.epoch, self.placement,
                                  reason=d.get("reason"), detail=d.get("detail"),
                                  envelope=env)
            if self._keep_alive is not None and self._keep_alive is not asyncio.current_task():
                self._keep_alive.cancel()
            self._client._forget(self)
            self._record(self.end, self.on_end)
            return
        epoch = int(d["epoch"])
        if kind == "renewed":
            if epoch < self.epoch:
                return  # stale: from before a failover
            expires = parse_iso(d["expires_at"])
            self._set_expiry(expires, _remaining(expires, env))
            self._record(LeaseEvent("renewed", self.lease_id, self.epoch, self.placement,
                                    expires_at=expires, envelope=env), None)
        elif kind == "failover":
            if epoch <= self.epoch:
                return  # stale or already learnt
            self._move(epoch, Placement.from_json(d["to"]), d.get("reason"), d.get("detail"),
                       env)

    def _move(self, epoch: int, to: Placement, reason: str | None, detail: str | None,
              env: Mapping[str, Any] | None) -> None:
        previous, self.placement, self.epoch = self.placement, to, epoch
        self._record(LeaseEvent("failover", self.lease_id, epoch, to, previous,
                                self.expires_at, reason, detail, env), self.on_failover)

    def _apply_state(self, state: Mapping[str, Any]) -> None:
        """The retained lease state (after a reconnect, or after a change): a higher
        epoch is a failover whose event was missed."""
        if not self.active or state.get("state") != "active":
            return
        epoch = int(state["epoch"])
        if epoch < self.epoch:
            return
        expires = parse_iso(state["expires_at"])
        if expires > self.expires_at:
            updated = parse_iso(state["updated_at"])
            self._set_expiry(expires, (expires - updated).total_seconds())
        if epoch > self.epoch:
            self._move(epoch, Placement.from_json(state["placement"]), None,
                       "learnt from the retained lease state (the failover event was missed)",
                       None)
        else:
            self._changed()


def _kind(env: Mapping[str, Any]) -> str:
    """`gpubroker.lease.renewed.v1` -> `lease.renewed` -> for lease events `renewed`."""
    t = str(env.get("type", "")).removeprefix("gpubroker.").removesuffix(".v1")
    return t.removeprefix("lease.")


def _remaining(expires: datetime, env: Mapping[str, Any]) -> float:
    """Seconds from the event to the expiry, both on the daemon's clock."""
    try:
        return (expires - parse_iso(str(env["time"]))).total_seconds()
    except (KeyError, ValueError):
        return 0.0


# --- waiting for answers ----------------------------------------------------------------


@dataclass(eq=False, slots=True)
class _Waiter:
    match: Callable[[str, Mapping[str, Any]], bool]
    token: bytes = field(default_factory=lambda: uuid.uuid4().bytes)
    answer: Mapping[str, Any] | None = None
    lease: Lease | None = None  # a placement.decided answer's lease
    error: str | None = None  # an answer that could not be read
    kick: asyncio.Event = field(default_factory=asyncio.Event)


# --- the client -----------------------------------------------------------------------


class BrokerClient:
    """An asyncio client of one gpubroker daemon (SPEC §3-§5), for scheduler `scheduler`.

    Connection options mirror the daemon's `mqtt` config: `url` (`mqtt://` or
    `mqtts://`), `topic_prefix`, `username`, `password` or `password_file`, `ca_file`
    (or a ready `ssl_context`), `protocol` (`"5"`, `"3.1.1"`, or `"auto"`: MQTT 5, and
    3.1.1 when the server does not speak 5). `client_id` defaults to a unique one.
    `scheduler=None` makes a read-only client (lease watches, status)."""

    # Many arguments: the public client's options, keyword-only, each documented.
    def __init__(self, url: str = "mqtt://127.0.0.1:1883", *, scheduler: str | None,  # noqa: PLR0913
                 topic_prefix: str = DEFAULT_PREFIX, username: str | None = None,
                 password: str | None = None, password_file: str | Path | None = None,
                 ca_file: str | Path | None = None, ssl_context: ssl.SSLContext | None = None,
                 protocol: Protocol = "auto", client_id: str | None = None,
                 connect_timeout: float = 10.0, resend_after: float = 2.0,
                 resend_max: float = 15.0) -> None:
        self.host, self.port, tls = parse_mqtt_url(url)
        self.url = url
        if scheduler is not None and (not SCHEDULER_ID.match(scheduler)
                                      or scheduler == "_ops"):
            raise ValueError(f"scheduler id {scheduler!r} must match [A-Za-z0-9_.-]{{1,64}} "
                             "and not be the reserved _ops")
        prefix = topic_prefix.strip()
        if not prefix or prefix.startswith("/") or prefix.endswith("/") or \
                any(c in prefix for c in "+#\0"):
            raise ValueError(f"topic prefix {topic_prefix!r} must be a topic path without "
                             "wildcards or a leading or trailing '/'")
        if password is not None and password_file is not None:
            raise ValueError("give password or password_file, not both")
        if protocol not in ("5", "3.1.1", "auto"):
            raise ValueError(f"protocol must be '5', '3.1.1' or 'auto', not {protocol!r}")
        self.scheduler = scheduler
        self.prefix = prefix
        self.username = username
        self._password = password
        self._password_file = Path(password_file) if password_file is not None else None
        self._tls = tls or ssl_context is not None or ca_file is not None
        self._ssl_context = ssl_context
        self._ca_file = Path(ca_file) if ca_file is not None else None
        self.protocol: Protocol = protocol
        self._v5 = protocol != "3.1.1"
        self.client_id = client_id or \
            f"gpubroker-client-{scheduler or 'watch'}-{uuid.uuid4().hex[:12]}"
        self.connect_timeout = connect_timeout
        self.resend_after = resend_after
        self.resend_max = resend_max
        # topics
        self._status_topic = f"{prefix}/status"
        self._events_head = f"{prefix}/events/"
        self._leases_head = f"{prefix}/leases/"
        self._reply_topic = f"{prefix}/replies/{scheduler}/{uuid.uuid4().hex}" \
            if scheduler is not None else None
        # state
        self.daemon_status: Mapping[str, Any] | None = None
        """The last `P/status` payload (of the highest leader epoch seen)."""
        self.leader_epoch = 0
        """The highest leader epoch seen: in a `P/status` or an event's `leaderepoch`."""
        self._event_epoch = 0  # the highest `leaderepoch` seen on an event
        self.connects = 0
        self._generation = 0  # +1 on each connect
        self._online_generation = 0  # +1 each time the daemon comes online
        self._client: aiomqtt.Client | None = None
        self._connected = asyncio.Event()
        self._closed = False
        self._fatal: BaseException | None = None
        self._last_error: str | None = None
        self._run_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._waiters: set[_Waiter] = set()
        self._by_token: dict[bytes, _Waiter] = {}
        self._leases: dict[str, Lease] = {}
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._watches: set[LeaseWatch] = set()
        self._new_watch = asyncio.Event()
        self._was_up = False  # a session was up since the last failure
        self._status_pulse = asyncio.Event()  # set (and replaced) when P/status changes
        self._status_subs = 0  # subscriptions to P/status made (markers)
        self._status_retained = 0  # retained P/status messages received

    # --- life cycle ------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def connect(self) -> None:
        """Connect (once); raises `BrokerUnavailable` when the MQTT server cannot be
        reached, or refuses the connection, within `connect_timeout`."""
        if self._run_task is not None:
            return
        if self._password_file is not None:
            try:
                self._password = files.read_secret(self._password_file)
            except OSError as exc:
                raise ValueError(f"MQTT password file {self._password_file}: "
                                 f"{exc.strerror or exc}") from None
        if self._ssl_context is None and self._tls:
            try:
                self._ssl_context = ssl.create_default_context(
                    cafile=str(self._ca_file) if self._ca_file else None)
            except OSError as exc:  # ssl.SSLError is one
                raise ValueError(f"MQTT CA file {self._ca_file}: "
                                 f"{getattr(exc, 'strerror', None) or exc}") from None
        self._run_task = asyncio.create_task(self._run(), name=f"{self.client_id}-mqtt")
        connected = asyncio.create_task(self._connected.wait())
        try:
            done, _ = await asyncio.wait({connected, self._run_task},
                                         timeout=self.connect_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            connected.cancel()
        if connected in done:
            return
        await self.close()
        if self._fatal is not None:
            raise BrokerUnavailable(f"the MQTT server at {self.host}:{self.port} refused the "
                                    f"connection: {self._fatal}") from None
        why = f": {self._last_error}" if self._last_error else ""
        raise BrokerUnavailable(f"cannot reach the MQTT server at {self.host}:{self.port} "
                                f"within {self.connect_timeout:g}s{why}")

    async def close(self) -> None:
        """Stop keep-alives and callbacks, disconnect. Leases stay as they are at the
        daemon (release them first if they should end)."""
        self._closed = True
        self._kick()
        self._status_pulse.set()
        for lease in list(self._leases.values()):
            if lease._keep_alive is not None:
                lease._keep_alive.cancel()
            lease._changed()  # its events() iterators end
        tasks = [t for t in (self._run_task, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def daemon_online(self) -> bool | None:
        """Whether the daemon says it is online (`P/status`); None until known."""
        if self.daemon_status is None:
            return None
        return self.daemon_status.get("state") == "online"

    @property
    def mqtt_version(self) -> str:
        """The MQTT version in use: "5" or "3.1.1" (with protocol "auto", 3.1.1 once the
        server refused 5)."""
        return "5" if self._v5 else "3.1.1"

    async def wait_daemon_online(self, timeout: float | None = None) -> bool:
        """Wait until the daemon says it is online; False if it did not within
        `timeout` seconds."""
        try:
            async with asyncio.timeout(timeout):
                while not self.daemon_online:
                    if self._closed:
                        raise BrokerError("the client is closed")
                    pulse = self._status_pulse
                    await pulse.wait()
        except TimeoutError:
            return False
        return True

    @property
    def leases(self) -> list[Lease]:
        """The active leases this client placed (or was given by `place`)."""
        return list(self._leases.values())

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

    # --- the connection --------------------------------------------------------------

    def _new_client(self) -> aiomqtt.Client:
        password = self._password
        if self._password_file is not None:  # read again: it may have been rotated
            with contextlib.suppress(OSError):
                password = files.read_secret(self._password_file)
        kwargs: dict[str, Any] = {"clean_start": True} if self._v5 else \
            {"clean_session": True}
        return aiomqtt.Client(
            self.host, self.port, identifier=self.client_id, username=self.username,
            password=password, tls_context=self._ssl_context,
            protocol=aiomqtt.ProtocolVersion.V5 if self._v5 else aiomqtt.ProtocolVersion.V311,
            keepalive=30, timeout=min(10.0, max(1.0, self.connect_timeout)), **kwargs)

    async def _run(self) -> None:
        """Stay connected until closed: every way a session ends means a reconnect after
        a jittered backoff. Only a refusal of the very first connection ends it."""
        failures = 0
        while True:
            try:
                await self._connection()
            except MqttConnectError as exc:  # the server answered: no
                if self.protocol == "auto" and self._v5 and _unsupported_version(exc):
                    log.info("%s:%s does not speak MQTT 5; using 3.1.1", self.host, self.port)
                    self._v5 = False
                    continue
                if self.connects == 0:
                    self._fatal = exc
                    return
                self._last_error = str(exc)
                failures += 1
                log.warning("the MQTT server refused the connection (%s); retrying", exc)
            except Exception as exc:  # any other session failure means: reconnect
                self._last_error = f"{exc}" or type(exc).__name__
                failures = 1 if self._was_up else failures + 1
                if not isinstance(exc, aiomqtt.MqttError | OSError):
                    log.error("MQTT session failed unexpectedly; reconnecting", exc_info=exc)
                elif self._was_up:
                    log.warning("MQTT connection lost (%s); reconnecting", self._last_error)
            self._was_up = False
            delay = min(15.0, 0.5 * 2 ** min(failures - 1, 5)) * random.uniform(0.5, 1.0)
            await asyncio.sleep(delay)

    async def _connection(self) -> None:
        client = self._new_client()
        await client.__aenter__()
        try:
            await self._session(client)
        finally:
            self._client = None
            self._connected.clear()
            self._kick()
            with contextlib.suppress(Exception, TimeoutError):
                async with asyncio.timeout(2.0):
                    await client.__aexit__(None, None, None)
            _settle(client)

    async def _session(self, client: aiomqtt.Client) -> None:
        self._status_retained = self._status_subs  # markers of an old connection are void
        async with asyncio.timeout(10):
            await self._subscribe(client, self._filters(), list(self._watches))
        self._client = client
        self._generation += 1
        self.connects += 1
        self._was_up = True
        self._connected.set()
        self._kick()
        if self.connects > 1:
            log.info("MQTT reconnected to %s:%s", self.host, self.port)
        watching = asyncio.create_task(self._watch_subscriber(client))
        try:
            async for message in client.messages:
                try:
                    self._on_message(message)
                except Exception:  # one bad message must not end the session
                    log.exception("could not handle a message on %s", message.topic)
        finally:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching
        raise aiomqtt.MqttError("the MQTT server ended the session")

    def _filters(self) -> list[str]:
        out = []
        if self.scheduler is not None:
            out += [f"{self._events_head}{self.scheduler}/+",
                    f"{self._leases_head}{self.scheduler}/+"]
            if self._v5 and self._reply_topic is not None:
                out.append(self._reply_topic)
        for watch in self._watches:
            out += [f for f in watch.filters if f not in out]
        return out

    async def _subscribe(self, client: aiomqtt.Client, filters: Sequence[str],
                         watches: Sequence[LeaseWatch]) -> None:
        """Subscribe to `filters`, then (again) to `P/status`. The status's retained
        message comes after the retained messages of the filters (a server sends a
        subscription's retained messages as it acknowledges it, in order): for the
        lease watches given, it marks the end of their snapshot."""
        self._status_subs += 1
        marker = self._status_subs
        for watch in watches:
            watch._begin_sync(marker)
        if filters:
            await client.subscribe([(f, 1) for f in filters], timeout=math.inf)
        await client.subscribe(self._status_topic, qos=1, timeout=math.inf)
        if watches:
            asyncio.get_running_loop().call_later(SYNC_FALLBACK_SECONDS, self._sync_fallback,
                                                  marker)

    async def _watch_subscriber(self, client: aiomqtt.Client) -> None:
        """Take the snapshot of lease watches started while connected."""
        while True:
            await self._new_watch.wait()
            self._new_watch.clear()
            watches = [w for w in self._watches if w._marker is None and not w.is_synced]
            filters = list(dict.fromkeys(f for w in watches for f in w.filters))
            try:
                async with asyncio.timeout(10):
                    await self._subscribe(client, filters, watches)
            except (aiomqtt.MqttError, TimeoutError) as exc:
                log.warning("could not subscribe for a lease watch (%s)", exc)

    def _sync_fallback(self, marker: int) -> None:
        for w in list(self._watches):
            if w._marker == marker:
                log.info("no retained %s; the lease snapshot is what came within %gs",
                         self._status_topic, SYNC_FALLBACK_SECONDS)
                w._end_sync()

    def _kick(self) -> None:
        for w in self._waiters:
            w.kick.set()

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

    def _call(self, callback: Callback, lease: Lease, event: LeaseEvent) -> None:
        try:
            result = callback(lease, event)
        except Exception:
            log.exception("lease %s: %s callback failed", lease.lease_id, event.kind)
            return
        if inspect.isawaitable(result):
            self._spawn(result)

    # --- incoming ----------------------------------------------------------------------

    def _on_message(self, message: aiomqtt.Message) -> None:
        topic = str(message.topic)
        payload = message.payload if isinstance(message.payload, bytes | bytearray) else b""
        if topic == self._status_topic:
            self._on_status(bytes(payload), message.retain)
            return
        for watch in list(self._watches):
            watch._feed(topic, bytes(payload))
        if topic.startswith(self._leases_head):
            lease = self._leases.get(topic.rsplit("/", 1)[-1])
            if lease is not None and payload and topic.startswith(
                    f"{self._leases_head}{self.scheduler}/"):
                state = _json(bytes(payload))
                if state is not None:
                    lease._apply_state(state)
            return
        if not (topic.startswith(f"{self._events_head}{self.scheduler}/")
                or topic == self._reply_topic):
            return
        env = _json(bytes(payload))
        if env is None or not isinstance(env.get("data"), dict):
            log.warning("unreadable event on %s ignored", topic)
            return
        epoch = _epoch(env.get("leaderepoch"))
        if epoch < self._event_epoch:
            log.debug("event %s of leader epoch %d on %s dropped: epoch %d was seen",
                      env.get("id"), epoch, topic, self._event_epoch)
            return
        self._event_epoch = epoch
        self.leader_epoch = max(self.leader_epoch, epoch)
        eid = str(env.get("id", ""))
        if eid in self._seen:
            return
        self._seen[eid] = None
        if len(self._seen) > SEEN_IDS:
            self._seen.popitem(last=False)
        correlation = getattr(message.properties, "CorrelationData", None) \
            if message.properties is not None else None
        self._dispatch(env, bytes(correlation) if correlation else None)

    def _on_status(self, payload: bytes, retained: bool) -> None:
        status = _json(payload)
        if status is not None and _epoch(status.get("epoch")) < self.leader_epoch:
            # A deposed leader's, late (its will, or a status from a connection it made
            # after the new leader's): the new leader is the one that serves.
            log.debug("P/status %r of leader epoch %d ignored: epoch %d was seen",
                      status.get("state"), _epoch(status.get("epoch")), self.leader_epoch)
            status = None
        if status is not None:
            self.leader_epoch = _epoch(status.get("epoch"))
            was = self.daemon_online
            before = self.daemon_status.get("boot_id") if self.daemon_status else None
            self.daemon_status = status
            # Online again, or online from another start (a restart, or another node of
            # the site taking over): what was sent before may be lost; send it again.
            if self.daemon_online and (not was or status.get("boot_id") != before):
                self._online_generation += 1
                if was is False:
                    log.info("the daemon is online again")
            elif was and not self.daemon_online:
                log.warning("the daemon is offline; requests wait for it")
            self._kick()
            pulse, self._status_pulse = self._status_pulse, asyncio.Event()
            pulse.set()
        if retained:
            self._status_retained += 1
            for watch in list(self._watches):
                if watch._marker is not None and watch._marker <= self._status_retained:
                    watch._end_sync()

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


def _full_kind(env: Mapping[str, Any]) -> str:
    return str(env.get("type", "")).removeprefix("gpubroker.").removesuffix(".v1")


def _json(payload: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(payload)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _epoch(value: Any) -> int:
    """A leader epoch from a payload: absent or not an integer (an older daemon) is 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _unsupported_version(exc: MqttConnectError) -> bool:
    rc = exc.rc
    value = getattr(rc, "value", rc)
    return value in (1, 132)  # 3.1.1 "unacceptable protocol version"; 5 "unsupported"


def _settle(client: aiomqtt.Client) -> None:
    """Mark aiomqtt's disconnection error as seen: nobody awaits the future that holds
    it once the session ended, and asyncio would log "exception was never retrieved"."""
    fut = getattr(client, "_disconnected", None)
    if isinstance(fut, asyncio.Future) and fut.done() and not fut.cancelled():
        fut.exception()


# --- watching every lease of a scheduler ---------------------------------------------------


class LeaseWatch:
    """The active leases of a scheduler (or of all: `+`), from the retained
    `P/leases/S/<id>` topics, kept current; the end events say how leases ended.

    ::

        async with client.watch_leases(all_schedulers=True) as watch:
            await watch.synced(timeout=10)
            for state in watch.states.values(): ...   # the snapshot
            async for change in watch.changes(): ...  # then live

    The snapshot is complete when the retained `P/status`, subscribed after the lease
    topics, arrives (a server sends a subscription's retained messages as it
    acknowledges it, in order); without one, after `SYNC_FALLBACK_SECONDS`. After a
    reconnect the snapshot is taken again, and leases missing from it are reported
    `ended`."""

    def __init__(self, client: BrokerClient, scheduler: str) -> None:
        self._client = client
        self.scheduler = scheduler
        self.filters = [f"{client._leases_head}{scheduler}/+"] + [
            f"{client._events_head}{scheduler}/lease.{k}"
            for k in ("failover", "released", "expired", "failed")]
        self.states: dict[str, dict[str, Any]] = {}
        """lease_id -> its retained state: the active leases."""
        self._how: OrderedDict[str, tuple[str, Mapping[str, Any]]] = OrderedDict()
        self._queue: asyncio.Queue[LeaseChange] = asyncio.Queue()
        self._marker: int | None = None  # the P/status retained message ending a snapshot
        self._seen: set[str] = set()  # lease ids seen during the snapshot
        self._synced = asyncio.Event()

    @property
    def is_synced(self) -> bool:
        return self._synced.is_set()

    async def __aenter__(self) -> Self:
        self._client._watches.add(self)
        self._client._new_watch.set()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        # Its subscriptions stay until the connection ends; nobody reads them meanwhile.
        self._client._watches.discard(self)

    async def synced(self, timeout: float = 10.0) -> None:
        """Wait for the first snapshot (raises `BrokerUnavailable` after `timeout`)."""
        try:
            async with asyncio.timeout(timeout):
                await self._synced.wait()
        except TimeoutError:
            raise BrokerUnavailable(f"no lease snapshot within {timeout:g}s") from None

    async def changes(self) -> AsyncIterator[LeaseChange]:
        """The changes after the first snapshot, as they come."""
        while True:
            yield await self._queue.get()

    def _begin_sync(self, marker: int) -> None:
        self._marker = marker
        self._seen = set()

    def _end_sync(self) -> None:
        if self._marker is None:
            return
        self._marker = None
        if self.is_synced:  # a snapshot after a reconnect: what is missing has ended
            for lease_id in [i for i in self.states if i not in self._seen]:
                self._emit("ended", lease_id, self.states.pop(lease_id))
        self._synced.set()

    def _emit(self, kind: str, lease_id: str, state: Mapping[str, Any] | None,
              how: Mapping[str, Any] | None = None) -> None:
        if not self.is_synced:
            return  # part of the first snapshot
        how = how or {}
        scheduler = str(state.get("scheduler", "")) if state else ""
        self._queue.put_nowait(LeaseChange(kind, lease_id, scheduler, state,
                                           how.get("reason"), how.get("detail")))

    def _feed(self, topic: str, payload: bytes) -> None:
        c = self._client
        for head, on in ((c._leases_head, self._state), (c._events_head, self._event)):
            if topic.startswith(head):
                parts = topic[len(head):].split("/")
                if len(parts) == 2 and self.scheduler in ("+", parts[0]):
                    on(parts[0], parts[1], payload)
                return

    def _event(self, _: str, kind: str, payload: bytes) -> None:
        """A lease event: remembered, so the state change it causes can say why; an end
        event ends the lease at once (its retained state is cleared right after)."""
        if kind not in ("lease.failover", "lease.released", "lease.expired", "lease.failed"):
            return
        env = _json(payload)
        data = env.get("data") if env is not None else None
        if not isinstance(data, dict) or not isinstance(data.get("lease_id"), str):
            return
        lease_id, short = data["lease_id"], kind.removeprefix("lease.")
        self._how[lease_id] = (short, data)
        while len(self._how) > SEEN_IDS:
            self._how.popitem(last=False)
        if short != "failover" and lease_id in self.states:
            self._emit(short, lease_id, self.states.pop(lease_id), data)

    def _state(self, scheduler: str, lease_id: str, payload: bytes) -> None:
        if self._marker is not None:
            self._seen.add(lease_id)
        old = self.states.get(lease_id)
        if not payload:  # ended
            if old is not None:
                del self.states[lease_id]
                kind, how = self._how.get(lease_id, ("ended", {}))
                self._emit("ended" if kind == "failover" else kind, lease_id, old, how)
            return
        state = _json(payload)
        if state is None or state.get("state") != "active":
            return
        state.setdefault("scheduler", scheduler)
        self.states[lease_id] = state
        if old is None:
            self._emit("placed", lease_id, state)
        elif state.get("epoch", 0) > old.get("epoch", 0):
            kind, how = self._how.get(lease_id, ("", {}))
            self._emit("failover", lease_id, state, how if kind == "failover" else None)
        elif state.get("expires_at") != old.get("expires_at"):
            self._emit("renewed", lease_id, state)
