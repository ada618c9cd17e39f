"""Watching every lease of a scheduler (or of all), from the retained lease states."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from types import TracebackType
from typing import Any, Protocol, Self

from gpubroker_client.errors import BrokerUnavailable
from gpubroker_client.events import SEEN_IDS, LeaseChange, LeaseChangeKind, _json

__all__ = ["SYNC_FALLBACK_SECONDS", "WATCH_QUEUE", "LeaseWatch"]

WATCH_QUEUE = 10_000
"""Changes a lease watch queues for `changes()` (a bounded queue): beyond this many
unread, the oldest is dropped and counted in `LeaseWatch.dropped` — `states` stays true."""

SYNC_FALLBACK_SECONDS = 2.0
"""How long a lease watch waits for the retained `P/status`, its end-of-snapshot marker,
before it takes what has come as the snapshot (a daemon that never ran on this prefix
left no status)."""


class WatchHost(Protocol):
    """What a lease watch asks of its client (`BrokerClient`)."""

    _leases_head: str
    _events_head: str
    _watches: set[LeaseWatch]
    _new_watch: asyncio.Event


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

    def __init__(self, client: WatchHost, scheduler: str) -> None:
        self._client = client
        self.scheduler = scheduler
        self.filters = [f"{client._leases_head}{scheduler}/+"] + [
            f"{client._events_head}{scheduler}/lease.{k}"
            for k in ("failover", "released", "expired", "failed")]
        self.states: dict[str, dict[str, Any]] = {}
        """lease_id -> its retained state: the active leases."""
        self._how: OrderedDict[str, tuple[str, Mapping[str, Any]]] = OrderedDict()
        self._queue: asyncio.Queue[LeaseChange] = asyncio.Queue(WATCH_QUEUE)
        self.dropped = 0
        """Changes dropped unread because the queue was full (`WATCH_QUEUE`)."""
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
        if self._queue.full():
            self._queue.get_nowait()
            self.dropped += 1
        self._queue.put_nowait(LeaseChange(LeaseChangeKind(kind), lease_id, scheduler, state,
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
