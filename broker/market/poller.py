"""Polling: each adapter's regions, on an interval, into the resource pool.

The poller owns the pool's data (Home Assistant's DataUpdateCoordinator pattern): one
task per adapter region polls within a deadline (the adapters' SDK seams retry each
failed call within it; the poller does not retry again), replaces that slice of the
pool, and logs only on state changes ("failing" once, "recovered" once). A slow or
failing cloud never holds up the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import structlog

from adapters.base import CloudAdapter
from adapters.common import poll_deadline
from adapters.errors import AdapterError, CloudUnavailable, RateLimited
from broker.market.changes import PoolChange, SliceId
from broker.market.pool import ResourcePool

log = structlog.get_logger("gpubroker.poller")


@dataclass(frozen=True, slots=True)
class PollResult:
    slice: SliceId
    change: PoolChange | None
    error: AdapterError | None
    seconds: float


APPLY_WAIT_SECONDS = 0.05
"""The longest a polled slice waits for its `turn` before its offers go into the pool
anyway: the requests come first, but a broker that is never idle must not starve the
polls (a round of 400 slices is then applied within 20 s)."""

DEADLINE_GRACE = 2.0
"""Seconds past the poll's deadline before the poll is cancelled: the seams stop retrying
at the deadline, and a call on the wire may take a moment to end."""


class Poller:
    def __init__(self, pool: ResourcePool, adapters: Sequence[CloudAdapter], *,
                 interval_seconds: float, timeout_seconds: float,
                 on_result: Callable[[PollResult], None] | None = None,
                 turn: Callable[[], Awaitable[object]] | None = None) -> None:
        """`turn`: what a polled slice waits for before its offers go into the pool (the
        daemon's: no request queued or being decided), `APPLY_WAIT_SECONDS` at most,
        once the first round is in."""
        self.pool = pool
        self.adapters = list(adapters)
        self.interval = interval_seconds
        self.timeout = timeout_seconds
        self.on_result = on_result
        self.turn = turn
        self.first_round = asyncio.Event()
        self._first_pending = {(a.name, r) for a in self.adapters for r in a.regions()}
        self._first_delay: dict[SliceId, float] = {}  # the slices taken over (`warmed`)
        self._applying = asyncio.Lock()  # one slice's offers into the pool at a time
        if not self._first_pending:
            self.first_round.set()

    def warmed(self, ages: Mapping[SliceId, float]) -> None:
        """These slices' offers are in the pool already, fresh, polled `ages` seconds ago
        (a new leader took them over from its predecessor's last polls): placement need
        not wait for their first poll, and each is next polled when its schedule says —
        a takeover neither doubles the clouds' API calls nor spends its first seconds
        polling what it has."""
        self._first_pending.difference_update(ages)
        for slice_id, age in ages.items():
            self._first_delay[slice_id] = max(0.0, self.interval - age)
        if not self._first_pending:
            self.first_round.set()

    async def poll_once(self, adapter: CloudAdapter, region: str) -> PollResult:
        """One poll of one region, with retries for throttling and 5xx; never raises
        an AdapterError (it is returned and recorded in the pool's health)."""
        slice_id = (adapter.name, region)
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            # The seams retry each failed call within this deadline; a poll is not
            # retried as a whole (one retry layer). The timeout is the backstop for an
            # adapter that overruns it.
            with poll_deadline(self.timeout):
                try:
                    async with asyncio.timeout(self.timeout + DEADLINE_GRACE):
                        offers = await adapter.poll(region)
                except TimeoutError:
                    raise CloudUnavailable(
                        f"poll timed out after {self.timeout:g}s", cloud=adapter.name,
                        region=region) from None
        except Exception as exc:
            if not isinstance(exc, AdapterError):
                # An adapter that did not expect an answer (a bug, or a cloud's garbled
                # reply): a failed poll of this slice, never the end of the daemon.
                log.error("poll failed unexpectedly", adapter=adapter.name, region=region,
                          exc_info=exc)
                exc = CloudUnavailable(f"unexpected {type(exc).__name__}: {exc}",
                                       cloud=adapter.name, region=region)
            result = PollResult(slice_id, None, exc, loop.time() - started)
            if self.pool.mark_failed(slice_id, f"{type(exc).__name__}: {exc}"):
                log.warning("poll failing", adapter=adapter.name, region=region,
                            error=type(exc).__name__, detail=str(exc))
        else:
            # One slice into the pool at a time, when the requests have had their turn.
            # A round's replies come together (the sim's in one turn of the event loop),
            # and each slice's offers are then placed again in placement's cost lists:
            # applied in one go, a round held the requests for hundreds of milliseconds
            # (bench/README.md). Now each slice lets the loop turn, waits for its `turn`,
            # the others waiting theirs.
            seconds = loop.time() - started  # the poll's own time, not its turn's
            async with self._applying:
                await self._wait_turn()
                was_failing = self.pool.failing(slice_id)
                change = self.pool.replace(slice_id, offers)
            result = PollResult(slice_id, change, None, seconds)
            if was_failing:
                log.info("poll recovered", adapter=adapter.name, region=region)
        self._first_pending.discard(slice_id)
        if not self._first_pending:
            self.first_round.set()
        if self.on_result is not None:
            self.on_result(result)
        return result

    async def _wait_turn(self) -> None:
        await asyncio.sleep(0)
        # Not in the first round: the requests are taken only once it is in.
        if self.turn is not None and self.first_round.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(APPLY_WAIT_SECONDS):
                    await self.turn()

    async def poll_all(self) -> list[PollResult]:
        """Poll every region of every adapter once, concurrently."""
        return await asyncio.gather(*(self.poll_once(a, r)
                                      for a in self.adapters for r in a.regions()))

    async def run(self) -> None:
        """Poll forever; each region on its own schedule, started with a little jitter so
        a large configuration does not hit every API in the same second."""
        async with asyncio.TaskGroup() as tg:
            for adapter in self.adapters:
                for region in adapter.regions():
                    tg.create_task(self._loop(adapter, region))

    async def _loop(self, adapter: CloudAdapter, region: str) -> None:
        loop = asyncio.get_running_loop()
        first = self._first_delay.pop((adapter.name, region), 0.0)
        if first > 0:
            await asyncio.sleep(first * random.uniform(0.95, 1.05))
        while True:
            started = loop.time()
            result = await self.poll_once(adapter, region)
            delay = self.interval - (loop.time() - started)
            if isinstance(result.error, RateLimited) and result.error.retry_after:
                delay = max(delay, result.error.retry_after)
            # Not kept while this slice sleeps: its change holds the whole poll (a dict of
            # every offer, what changed), some 6 MiB over 50,000 offers.
            del result
            await asyncio.sleep(max(0.0, delay) * random.uniform(0.95, 1.05))
