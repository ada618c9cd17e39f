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

Random faults, the way real clouds misbehave: ``chaos = Chaos(rate=0.3, seed=1)`` makes
that share of HTTP calls fail with one of the kinds below (an HTTP middleware, so every
route of every fake gets it); ``faulted`` counts them by kind.

* ``throttle`` — the cloud's own throttling answer (`_throttled`, which each fake writes
  in its cloud's error shape), with ``Retry-After: 1``;
* ``5xx`` — a 500 or a 503 (`_server_error`, also the cloud's shape);
* ``timeout`` — the answer comes only after ``Chaos.hang_seconds`` (set it beyond the
  client's read timeout);
* ``truncated`` — a 200 whose body is cut off halfway (mid-JSON or mid-XML).
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Generic, Protocol, Self, TypeVar

from aiohttp import web

K = TypeVar("K")  # what `calls` counts
F = TypeVar("F", bound="Fault")


class Fault(Protocol):
    """A fault the fake answers with, `remaining` times (None: until cleared)."""

    remaining: int | None


CHAOS_KINDS = ("throttle", "5xx", "timeout", "truncated")


@dataclass
class Chaos:
    """Random faults on a share `rate` of calls, drawn from `kinds` with a seeded RNG."""

    rate: float = 0.3
    kinds: tuple[str, ...] = CHAOS_KINDS
    hang_seconds: float = 3.0
    seed: int = 0
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        unknown = set(self.kinds) - set(CHAOS_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {CHAOS_KINDS}")
        self.rng = random.Random(self.seed)

    def draw(self) -> str | None:
        """The fault for the next call, or None."""
        if self.rate <= 0 or self.rng.random() >= self.rate:
            return None
        return self.rng.choice(self.kinds)


class FakeServer(Generic[K]):
    thread_name = "fake"

    def __init__(self) -> None:
        self.url = ""
        self.latency: tuple[float, float] | None = None
        self.calls: Counter[K] = Counter()
        self.chaos: Chaos | None = None
        self.faulted: Counter[str] = Counter()  # random faults answered, by kind
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
        app.middlewares.append(self._chaos_middleware)
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

    # ---------------------------------------------------------- random faults
    @web.middleware
    async def _chaos_middleware(self, request: web.Request,
                                handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                                ) -> web.StreamResponse:
        chaos = self.chaos
        if chaos is None or not self._chaos_applies(request):
            return await handler(request)
        with self._lock:
            kind = chaos.draw()
            if kind is not None:
                self.faulted[kind] += 1
        if kind is None:
            return await handler(request)
        if kind == "throttle":
            return self._throttled(request)
        if kind == "5xx":
            return self._server_error(request, 503 if chaos.rng.random() < 0.5 else 500)
        if kind == "timeout":
            await asyncio.sleep(chaos.hang_seconds)
            return await handler(request)
        response = await handler(request)
        body = getattr(response, "body", None)
        if response.status != 200 or not isinstance(body, bytes) or len(body) < 2:
            return response
        cut = web.Response(status=200, body=body[:len(body) // 2],
                           content_type=response.content_type)
        for name in ("x-amzn-RequestId", "x-acs-request-id", "x-ms-request-id"):
            if name in response.headers:
                cut.headers[name] = response.headers[name]
        return cut

    def _chaos_applies(self, request: web.Request) -> bool:
        """Whether random faults may hit this call (a fake may spare, say, its token
        endpoint, which the SDK does not retry as a cloud call)."""
        return True

    def _throttled(self, request: web.Request) -> web.StreamResponse:
        """The cloud's throttling answer; each fake writes its cloud's shape."""
        return web.Response(status=429, headers={"Retry-After": "1"},
                            text="Too Many Requests")

    def _server_error(self, request: web.Request, status: int) -> web.StreamResponse:
        """The cloud's 5xx answer; each fake writes its cloud's shape."""
        return web.Response(status=status, text="Service Unavailable")

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
