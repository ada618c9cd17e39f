"""A blocking `BrokerClient` for schedulers that do not run asyncio.

::

    from gpubroker_client.sync import SyncBrokerClient

    with SyncBrokerClient("mqtt://127.0.0.1:1883", scheduler="train") as c:
        lease = c.place(gpu="H100-80GB", gpus=8, keep_alive=True)
        print(lease.lease_id, lease.placement)
        c.report(lease, "launch_failed", "InsufficientInstanceCapacity")
        c.release(lease)

The client runs on an event loop in a background thread of its own; each method sends its
call there and waits for the result (at most the call's `timeout`, plus a little). The
keep-alives and the callbacks run on that loop too: a plain-function callback is called
in a worker thread (`asyncio.to_thread`), so it may block without stopping the loop.
`place()` interrupted in the calling thread (KeyboardInterrupt) cancels the call, and the
client releases its lease if it is decided later, as `BrokerClient.place` does.

The `Lease` objects returned are the asyncio client's: read their fields from any thread;
call their verbs through this wrapper (`renew(lease)`, `release(lease)`, `report(lease)`).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Coroutine
from datetime import datetime
from types import TracebackType
from typing import Any, Self, TypeVar

from gpubroker_client.client import BrokerClient, ReportKind
from gpubroker_client.events import LeaseEvent
from gpubroker_client.lease import Callback, Lease
from gpubroker_client.model import LeaseState

__all__ = ["SyncBrokerClient"]

T = TypeVar("T")

SLACK = 5.0
"""Seconds a blocking call waits beyond the call's own timeout."""


class SyncBrokerClient:
    """`BrokerClient(url, **options)` behind blocking methods; connects on creation
    (raises `BrokerUnavailable` as `BrokerClient.connect` does)."""

    def __init__(self, url: str = "mqtt://127.0.0.1:1883", **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever,
                                        name="gpubroker-client", daemon=True)
        self._thread.start()
        self._closed = False

        async def make() -> BrokerClient:
            return BrokerClient(url, **options)

        try:
            self.client = self._run(make(), None)
            self._run(self.client.connect(), None)
        except BaseException:
            self._stop_loop()
            raise

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(None if timeout is None else timeout + SLACK)
        except BaseException:  # interrupted, or waited too long: the call is given up
            future.cancel()
            raise

    def place(self, gpu: str | list[str], gpus: int, *, timeout: float = 60.0,
              on_failover: Callback | None = None, on_end: Callback | None = None,
              **options: Any) -> Lease:
        """`BrokerClient.place`, blocking (same arguments)."""
        return self._run(self.client.place(
            gpu, gpus, timeout=timeout, on_failover=_threaded(on_failover),
            on_end=_threaded(on_end), **options), timeout)

    def renew(self, lease: Lease | str, timeout: float = 30.0) -> datetime:
        """Renew a held lease (or one by id); the new expiry."""
        lease_id = lease.lease_id if isinstance(lease, Lease) else lease
        return self._run(self.client.renew(lease_id, timeout), timeout)

    def release(self, lease: Lease | str, timeout: float = 30.0) -> LeaseState:
        """Release a held lease (or one by id); how it ended."""
        lease_id = lease.lease_id if isinstance(lease, Lease) else lease
        return self._run(self.client.release(lease_id, timeout), timeout)

    def report(self, lease: Lease | str, kind: ReportKind, detail: str | None = None, *,
               epoch: int | None = None, timeout: float = 30.0) -> LeaseEvent:
        """Report a held lease (or one by id); the failover event."""
        lease_id = lease.lease_id if isinstance(lease, Lease) else lease
        return self._run(self.client.report(lease_id, kind, detail, epoch=epoch,
                                            timeout=timeout), timeout)

    def new_request_id(self) -> str:
        return self.client.new_request_id()

    def close(self) -> None:
        """Close the client (its leases stay as they are at the daemon) and its thread."""
        if self._closed:
            return
        self._closed = True
        try:
            self._run(self.client.close(), 15.0)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()


def _threaded(callback: Callback | None) -> Callback | None:
    """A plain function runs in a worker thread, so it may block; a coroutine function
    runs on the client's loop as it is."""
    if callback is None or inspect.iscoroutinefunction(callback):
        return callback

    async def in_thread(lease: Lease, event: LeaseEvent) -> None:
        await asyncio.to_thread(callback, lease, event)

    return in_thread
