"""What the fake clouds (`fake_aws`, `fake_azure`, `fake_alibaba`) share: an aiohttp
server on ``127.0.0.1`` and a free port, served by its own event loop in a daemon
thread, so that blocking SDK clients in the test's thread (or the adapter's executor)
can call it; plus the knobs every fake has.

A subclass sets `thread_name`, writes `_handle` (its routes and its cloud's error
shapes) and calls ``super().__init__()`` first. It may override `_application` (the
aiohttp app), `_astart`/`_astop` (extra set-up and teardown on the server's loop) and
`start`/`stop`.

Knobs: ``url`` (after ``start()``), ``latency = (lo, hi)`` seconds per call (`_delay`),
``calls`` (a Counter of the fake's own call keys) and the list of faults ``_faults``,
each counting down its ``remaining`` uses (`_take`; ``None``: until ``clear_faults()``).
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections import Counter
from collections.abc import Callable
from types import TracebackType
from typing import Any, Generic, Protocol, Self, TypeVar

from aiohttp import web

K = TypeVar("K")  # what `calls` counts
F = TypeVar("F", bound="Fault")


class Fault(Protocol):
    """A fault the fake answers with, `remaining` times (None: until cleared)."""

    remaining: int | None


class FakeServer(Generic[K]):
    thread_name = "fake"

    def __init__(self) -> None:
        self.url = ""
        self.latency: tuple[float, float] | None = None
        self.calls: Counter[K] = Counter()
        self._lock = threading.RLock()
        self._faults: list[Any] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    # ------------------------------------------------------------ knobs
    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def reset_calls(self) -> None:
        with self._lock:
            self.calls.clear()

    def _take(self, faults: list[F], matches: Callable[[F], bool]) -> F | None:
        """The first of `faults` that `matches` and has uses left, one use spent."""
        with self._lock:
            for fault in faults:
                if matches(fault) and (fault.remaining is None or fault.remaining > 0):
                    if fault.remaining is not None:
                        fault.remaining -= 1
                    return fault
        return None

    async def _delay(self) -> None:
        """Wait `latency` (a uniform draw from ``(lo, hi)``), if set."""
        if self.latency is not None:
            await asyncio.sleep(random.uniform(*self.latency))

    # -------------------------------------------------------- lifecycle
    def start(self) -> Self:
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name=self.thread_name,
                                        daemon=True)
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._astart(), loop).result(30)
        return self

    def _application(self) -> web.Application:
        return web.Application()

    async def _astart(self) -> str:
        app = self._application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # A short shutdown timeout: in-flight calls of a finished test (a long-polling
        # receive) must not hold up the next one.
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                     shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert isinstance(server, asyncio.Server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    async def _astop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def stop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._astop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        assert self._thread is not None
        self._thread.join(10)
        loop.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
