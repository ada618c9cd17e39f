"""A lease as the scheduler holds it: its verbs (renew, release, report), its
keep-alive, and its events, kept current by the client's message handler."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, Literal, Protocol

from gpubroker_client.errors import (
    BrokerError,
    LeaseEnded,
    ReportDeclined,
    RequestTimeout,
    StaleEpoch,
)
from gpubroker_client.events import _ENDS, LeaseEvent, LeaseEventKind, _kind, _remaining
from gpubroker_client.model import LeaseState, Placement, parse_iso

__all__ = ["Callback", "Lease"]

log = logging.getLogger("gpubroker.client")

HISTORY = 256
"""Events a lease keeps (its bounded queue): `Lease.events()` callers that start late,
or read slower than events come, skip the oldest beyond this many (overflow drops the
oldest; `Lease.end` and the lease's fields always hold the latest)."""

STALE_RETRIES = 3
"""How often renew and release are sent again with the newer epoch a `lease.current`
answer told (each answer is a failover of the lease, seen meanwhile)."""

Callback = Callable[["Lease", LeaseEvent], object]


class LeaseOwner(Protocol):
    """What a lease asks of the client that placed it (`BrokerClient`)."""

    _closed: bool

    async def _lease_verb(self, verb: str, lease_id: str, timeout: float,
                          body: Mapping[str, Any] | None = None, *,
                          once: bool = False) -> Mapping[str, Any]: ...

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]: ...

    def _call(self, callback: Callback, lease: Lease, event: LeaseEvent) -> None: ...

    def _forget(self, lease: Lease) -> None: ...


class Lease:
    """GPUs granted to one request, kept current by the client that placed it.

    Fields: `lease_id`, `scheduler`, `request_id`, `epoch` (the fencing token: it grows
    with each failover), `placement` (`gpubroker_client.Placement`: `pool.cloud`,
    `pool.zone`, `pool.instance_type`, `pool.market`, `instances`, `gpu`, `gpus` per
    instance, `total_gpus`, `price_per_hour`, `price_per_gpu_hour`), `expires_at`,
    `state`, `reason` (why it was placed there), `alternatives`, `lease_seconds`.

    `on_failover(lease, event)` and `on_end(lease, event)` are called for those events
    (plain functions or coroutine functions); `events()` iterates over all of them."""

    # Many arguments: one keyword per field of the daemon's answer.
    def __init__(self, client: LeaseOwner, *, lease_id: str, scheduler: str,  # noqa: PLR0913
                 request_id: str, epoch: int, placement: Placement, expires_at: datetime,
                 remaining: float, state: LeaseState, reason: str,
                 alternatives: Sequence[Placement], decided: Mapping[str, Any],
                 lease_seconds: float | None = None) -> None:
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
        self.lease_seconds = float(lease_seconds) if lease_seconds is not None \
            else max(1.0, remaining)
        """The renewal period: the daemon's `lease_seconds` (contract 1.1); from a 1.0
        daemon, as the first answer showed it (expiry minus decision time)."""
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
        """Renew; returns once `lease.renewed` came (`expires_at` is updated). Sends the
        epoch the lease knows; a `lease.current` answer (it moved meanwhile) updates the
        lease — a failover event — and the renewal is sent again at the new epoch.
        Raises `LeaseEnded` if the lease has ended, `RequestTimeout` without an answer."""
        if not self.active:
            raise LeaseEnded(self.lease_id, self.state)
        env = await self._fenced("renew", timeout)
        kind, data = _kind(env), env.get("data", {})
        if kind in _ENDS:
            raise LeaseEnded(self.lease_id, _ENDS[kind], data.get("detail"))

    async def release(self, timeout: float = 30.0) -> None:
        """Release; returns once the daemon confirmed the lease has ended (released, or
        expired or failed before). Idempotent: returns at once on an ended lease. Sent
        with the lease's epoch, again at a newer one if it moved meanwhile."""
        if not self.active:
            return
        await self._fenced("release", timeout)

    async def _fenced(self, verb: str, timeout: float) -> Mapping[str, Any]:
        """`verb` at the lease's epoch, sent again at the newer epoch a `lease.current`
        answer brought (the message handler has applied it to the lease by then)."""
        deadline = asyncio.get_running_loop().time() + timeout
        for _ in range(STALE_RETRIES):
            left = max(0.1, deadline - asyncio.get_running_loop().time())
            env = await self._client._lease_verb(
                verb, self.lease_id, left, {"lease_id": self.lease_id, "epoch": self.epoch})
            if _kind(env) != "current":
                return env
        raise StaleEpoch(self.lease_id, self.epoch, None, env.get("data", {}))

    async def report(self, kind: Literal["interrupted", "launch_failed", "unhealthy"],
                     detail: str | None = None, timeout: float = 30.0) -> LeaseEvent:
        """Tell the daemon the placement does not work (SPEC `report`): it moves the
        lease elsewhere. Sent with the lease's epoch, and sent again until answered (a
        1.1 daemon acts on the first report of an epoch only). Returns the failover
        event — also when the answer is `lease.current` (the lease had moved on from
        that epoch already: the failover learnt from it). Raises `LeaseEnded` when it
        found nowhere to go (the lease failed) or the lease had ended, `ReportDeclined`
        (with `retry_after`) when the anti-flap limits held it back."""
        if not self.active:
            raise LeaseEnded(self.lease_id, self.state)
        epoch = self.epoch
        body: dict[str, Any] = {"lease_id": self.lease_id, "kind": kind, "epoch": epoch}
        if detail is not None:
            body["detail"] = detail
        env = await self._client._lease_verb("report", self.lease_id, timeout, body)
        answer, data = _kind(env), env.get("data", {})
        if answer in _ENDS:
            raise LeaseEnded(self.lease_id, _ENDS[answer], data.get("detail"))
        if answer == "report.declined":
            retry = data.get("retry_after_seconds")
            raise ReportDeclined(self.lease_id, epoch, kind, str(data.get("reason", "")),
                                 float(retry) if isinstance(retry, int | float) else 0.0, env)
        for ev in reversed(self._history):
            if ev.envelope is not None and ev.envelope.get("id") == env.get("id"):
                return ev
        if answer == "current":  # the failover it brought, or one seen before it
            for ev in reversed(self._history):
                if ev.kind is LeaseEventKind.FAILOVER and ev.epoch > epoch:
                    return ev
        return LeaseEvent(LeaseEventKind.FAILOVER, self.lease_id, self.epoch, self.placement,
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
            self.end = LeaseEvent(LeaseEventKind(kind), self.lease_id, self.epoch, self.placement,
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
            self._record(LeaseEvent(LeaseEventKind.RENEWED, self.lease_id, self.epoch,
                                    self.placement, expires_at=expires, envelope=env), None)
        elif kind == "failover":
            if epoch <= self.epoch:
                return  # stale or already learnt
            self._move(epoch, Placement.from_json(d["to"]), d.get("reason"), d.get("detail"),
                       env)
        elif kind == "current":  # a request of an older epoch: the lease as it is now
            self._apply_state(d, env)

    def _move(self, epoch: int, to: Placement, reason: str | None, detail: str | None,
              env: Mapping[str, Any] | None) -> None:
        previous, self.placement, self.epoch = self.placement, to, epoch
        self._record(LeaseEvent(LeaseEventKind.FAILOVER, self.lease_id, epoch, to, previous,
                                self.expires_at, reason, detail, env), self.on_failover)

    def _apply_state(self, state: Mapping[str, Any],
                     env: Mapping[str, Any] | None = None) -> None:
        """The lease's state — retained (after a reconnect, or after a change), or in a
        `lease.current` answer (`env`): a higher epoch is a failover whose event was
        missed."""
        if not self.active or state.get("state", "active") != "active":
            return
        epoch = int(state["epoch"])
        if epoch < self.epoch:
            return
        expires = parse_iso(state["expires_at"])
        if expires > self.expires_at:
            if env is not None:
                self._set_expiry(expires, _remaining(expires, env))
            else:
                updated = parse_iso(state["updated_at"])
                self._set_expiry(expires, (expires - updated).total_seconds())
        if epoch > self.epoch:
            how = "the answer lease.current" if env is not None else \
                "the retained lease state"
            self._move(epoch, Placement.from_json(state["placement"]), None,
                       f"learnt from {how} (the failover event was missed)", env)
        else:
            self._changed()
