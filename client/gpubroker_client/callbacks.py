"""The user's lease callbacks (`on_failover`, `on_end`), run apart from everything else:
one task runs them one at a time, in the order their events came, so the message handler
and the keep-alives never wait for user code — a slow callback delays later callbacks
only, never a renewal."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpubroker_client.events import LeaseEvent
    from gpubroker_client.lease import Callback, Lease

__all__ = ["CALLBACK_QUEUE", "Callbacks"]

log = logging.getLogger("gpubroker.client")

CALLBACK_QUEUE = 10_000
"""Callbacks waiting to run (a bounded queue): beyond this many, the oldest waiting one
is dropped and logged (callbacks that keep up never see it)."""


class Callbacks:
    """The queue of callbacks to run, and the task that runs them (started on the first
    one, by `spawn`: the client's, which cancels it on close)."""

    def __init__(self, spawn: Callable[[Awaitable[Any]], asyncio.Task[Any]]) -> None:
        self._spawn = spawn
        self._queue: deque[tuple[Callback, Lease, LeaseEvent]] = deque()
        self._ready = asyncio.Event()
        self._task: asyncio.Task[Any] | None = None
        self.dropped = 0
        """Callbacks dropped because the queue was full."""

    def put(self, callback: Callback, lease: Lease, event: LeaseEvent) -> None:
        if len(self._queue) >= CALLBACK_QUEUE:
            _, old, ev = self._queue.popleft()
            self.dropped += 1
            log.error("callback queue full (%d): the %s callback of lease %s is dropped",
                      CALLBACK_QUEUE, ev.kind, old.lease_id)
        self._queue.append((callback, lease, event))
        self._ready.set()
        if self._task is None:
            self._task = self._spawn(self._run())

    async def _run(self) -> None:
        while True:
            while self._queue:
                callback, lease, event = self._queue.popleft()
                try:
                    result = callback(lease, event)
                    if inspect.isawaitable(result):
                        await result
                except Exception:
                    log.exception("lease %s: %s callback failed", lease.lease_id, event.kind)
            self._ready.clear()
            await self._ready.wait()
