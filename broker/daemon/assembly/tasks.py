"""The daemon's background tasks besides the broker's own: the hazard estimator warmed
from the market history, readiness and systemd's status and watchdog, the clouds'
capacity signals, the capacity summaries and retained states published."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

import structlog

from adapters.base import CloudAdapter
from adapters.errors import AdapterError
from broker.daemon.assembly.process import SHUTDOWN_GRACE_SECONDS
from broker.daemon.config import Config
from broker.edges.bus import Bus, RetainedRead
from broker.edges.sdnotify import Notifier, watchdog_seconds
from broker.leasing.authority import Broker
from broker.leasing.book import LeaseBook
from broker.market import capacity
from broker.market.changes import PoolChange, SliceId
from broker.market.hazard import HazardEstimator
from broker.market.poller import Poller
from broker.market.pool import ResourcePool
from broker.market.recorder import HistoryReader, MarketRecorder
from broker.model import Market, utcnow
from broker.output.ratelimit import Every
from broker.placement import solver
from broker.state.store import Db, Store, StoreFailed, db_errors
from broker.wire.messages import Messages, Topics, dumps
from policies.model import Policy

log = structlog.get_logger("gpubroker.daemon")

PREPARE_COSTS_SECONDS = 1.0
"""How often placement's cost lists are checked for any to make ahead of the requests
(`Tasks._prepare_costs`) when the pool has not changed meanwhile (a change is checked at
once); a check that finds none costs microseconds."""

RETAINED_ENDED_MARGIN = timedelta(hours=1)
"""After a reconnect, retained states are cleared again for leases that ended since up to
this long before the retained state was last made true (the previous connection's
restore): an MQTT server restored from a save of that age may still hold them
(mosquitto's default autosave interval is 30 minutes)."""
RESTORE_ENDED_MAX = 10_000
"""The most ended leases a restore clears again (the most recent ones of its window), so
that the work of a start or a reconnect is bounded whatever the churn before it: at 200
places a second an hour's window holds 720,000 (#31)."""
HAZARD_HISTORY_HALF_LIVES = 4.0
"""How much recorded history warms the hazard estimator at start (older rows weigh
under 2^-4 of its averages)."""


class Tasks:
    """The background tasks' part of the daemon (`Daemon` is made of it)."""

    _ended_to_clear: Sequence[tuple[str, str]] = ()
    """At a reconnect: the ended leases whose retained state the restore clears again."""

    if TYPE_CHECKING:
        cfg: Config
        store: Store
        adapters: list[CloudAdapter]
        pool: ResourcePool
        book: LeaseBook
        broker: Broker
        bus: Bus
        messages: Messages
        topics: Topics
        poller: Poller
        notifier: Notifier
        recorder: MarketRecorder | None
        hazard: HazardEstimator
        hazard_warm: asyncio.Event
        ready: asyncio.Event
        _last_poll: float
        _polled: dict[SliceId, None]
        _polled_due: asyncio.Event

        def status_line(self) -> str: ...

    async def warm_hazard(self) -> int:
        """Feed the hazard estimator the recorded market history of its last few
        half-lives, so a restart does not forget what the pools were like; then placement
        scores with it. The history is read in a thread while the daemon runs (a long one
        must not hold up the first poll); the polls that land meanwhile are kept and fed
        after it, in order. Until then placement scores with the offers' own signals.
        Returns the rows read; a history that cannot be read is logged and skipped."""
        if self.hazard_warm.is_set():
            return 0
        assert self.recorder is not None
        until = utcnow()
        hours = min(HAZARD_HISTORY_HALF_LIVES * self.hazard.half_life_hours,
                    self.cfg.state.market_history_days * 24.0)
        pending: list[tuple[PoolChange, float]] = []
        keep = self.pool.subscribe_timed(lambda change, t: pending.append((change, t)))
        started = time.perf_counter()
        rows = 0
        try:
            rows = await asyncio.to_thread(_read_history, self.store.reader,
                                           until - timedelta(hours=hours), until, self.hazard)
        except db_errors(OSError) as exc:
            log.warning("market history not read for the hazard estimates",
                        error=type(exc).__name__, detail=str(exc))
        finally:
            keep()
        for change, t in pending:
            self.hazard.observe_change(change, t)
        self._use_hazard()
        log.info("hazard estimates warmed from the market history", rows=rows,
                 pools=len(self.hazard), hours=round(hours, 2), polls_meanwhile=len(pending),
                 seconds=round(time.perf_counter() - started, 3))
        return rows

    async def _prepare_costs(self) -> None:
        """Placement's cost lists made ahead of the requests (`Placing.prepare_costs`):
        once the first poll round is in and the hazard estimates are warm, then after
        every change of the pool (a poll's offers placed again in the lists as they come,
        not by the next batch of requests), and at least every `PREPARE_COSTS_SECONDS`,
        which remakes those a refresh of the estimator or a new policy dropped. Made by
        the batches instead, they held the event loop for hundreds of milliseconds
        (bench/README.md)."""
        await self.poller.first_round.wait()
        await self.hazard_warm.wait()
        failures = Every(600.0)
        changed = asyncio.Event()
        unsubscribe = self.pool.subscribe(lambda _change: changed.set())
        try:
            while True:
                changed.clear()
                try:
                    await self.broker.prepare_costs()
                except Exception:  # the batches make what is missing: no reason to stop
                    if n := failures.hit():
                        log.exception("placement's cost lists not made ahead",
                                      occurrences=n)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(PREPARE_COSTS_SECONDS):
                        await changed.wait()
        finally:
            unsubscribe()

    async def _preload_solver(self) -> None:
        """Import the MILP solver in a thread while the first poll runs (placement starts
        after it), not on the event loop when the first batch needs it."""
        if self.cfg.placement.exact_max_batch > 0:
            await asyncio.to_thread(solver.preload)

    def _use_hazard(self) -> None:
        self.pool.feed_hazard(self.hazard)
        self.pool.hazard = self.hazard
        self.hazard_warm.set()

    async def _flush_recorder(self, recording: asyncio.Task[None]) -> None:
        """Write the polls the recorder still holds (briefly: it is best effort)."""
        assert self.recorder is not None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(SHUTDOWN_GRACE_SECONDS / 4):
                await self.recorder.flush()
        recording.cancel()

    async def _mark_ready(self) -> None:
        await self.poller.first_round.wait()
        await self.bus.connected.wait()
        self.ready.set()
        self.notifier.ready(self.status_line())
        log.info("ready", offers=len(self.pool), leases=self.book.active_count)

    def progressing(self, within: float) -> bool:
        """Whether polling and publishing make progress: a poll finished within `within`
        seconds (the poll loop is alive) and the outbox is empty or the MQTT server
        acknowledged something within `within` seconds."""
        now = time.monotonic()
        polling = not self.adapters or now - self._last_poll <= max(
            within, self.cfg.poll.interval_seconds + self.cfg.poll.timeout_seconds)
        publishing = self.bus.outbox_depth == 0 or now - self.bus.last_ack <= within
        return polling and publishing

    async def _systemd(self) -> None:
        """READY comes from _mark_ready; here: STATUS every few seconds, and WATCHDOG=1 at
        half the watchdog period, only while polling and publishing make progress."""
        period = watchdog_seconds()
        every = min(5.0, period / 2) if period else 5.0
        await self.ready.wait()
        while True:
            self.notifier.status(self.status_line())
            if period and self.progressing(period):
                self.notifier.watchdog()
            await asyncio.sleep(every)

    async def _signals(self, adapter: CloudAdapter) -> None:
        failures = 0
        while True:
            try:
                async with contextlib.aclosing(adapter.signals(self.book.leased_pools)) as it:
                    async for sig in it:
                        failures = 0
                        self.broker.signal(sig)
            except Exception as exc:  # a bad notice must not end the daemon
                failures += 1
                if not isinstance(exc, AdapterError):
                    log.error("capacity signals failed unexpectedly", adapter=adapter.name,
                              exc_info=exc)
                elif failures == 1:
                    log.warning("capacity signals failing", adapter=adapter.name,
                                error=type(exc).__name__, detail=str(exc))
                await asyncio.sleep(min(60.0, 2.0 ** failures))

    async def _publish_capacity(self) -> None:
        expiry = int(3 * self.cfg.poll.interval_seconds)
        while True:
            await self._polled_due.wait()
            await self.bus.connected.wait()
            slice_id = next(iter(self._polled))
            del self._polled[slice_id]
            if not self._polled:
                self._polled_due.clear()
            now = utcnow()
            offers = self.pool.slice_offers(slice_id)
            for (cloud, region, gpu), summary in capacity.summaries(offers, self.pool,
                                                                     now).items():
                await self.bus.publish_now(self.topics.capacity(cloud, region, gpu),
                                           dumps(summary), retain=True, expiry_seconds=expiry)

    def _retained_state(self) -> Iterator[tuple[str, RetainedRead, int | None]]:
        """What the retained topics hold when they are true (SPEC §3): every active
        lease's state; an empty payload for each lease that ended since the retained
        state was last made true (`Bus.retained_true_since`, less `RETAINED_ENDED_MARGIN`:
        a server restored from an older save may still hold its state), as read from the
        store at the connect (`_read_ended_to_clear`); the capacity summaries of every
        slice of the pool. Lease states are read when sent, and only once committed.
        `P/status` is published by the bus.

        At the first connection of a start, when the retained state was last made true
        is not known: the leases that ended in the `RETAINED_ENDED_MARGIN` before the
        start, besides the clears the server never acknowledged (the outbox rows the
        start sent again before this: a row leaves the outbox only once acknowledged).
        An ended lease whose clear still waits in the outbox is not cleared twice: the
        outbox sends it on this connection (`Bus.pending_clears`).
        Every window is capped at the `RESTORE_ENDED_MAX` most recent: clearing every
        ended lease of the last day made a start's work grow with the churn before it
        — 95,000 empty messages after eight minutes at 200 places a second (#31). What
        the cap gives up: after more than that many leases ended in the window, a
        server restored from an older save keeps the stale states of the older ones."""
        for lease in self.book.active():
            yield (self.topics.lease(lease.scheduler, lease.lease_id),
                   functools.partial(self._committed_lease_state, lease.lease_id), None)
        ended, self._ended_to_clear = self._ended_to_clear, ()
        cleared = self.bus.pending_clears()  # the outbox sends these clears itself
        for scheduler, lease_id in ended:
            topic = self.topics.lease(scheduler, lease_id)
            if topic not in cleared:
                yield topic, functools.partial(_ready, b""), None
        expiry = int(3 * self.cfg.poll.interval_seconds)
        for health in self.pool.health():
            offers = self.pool.slice_offers(health.slice)
            for (cloud, region, gpu), summary in capacity.summaries(offers, self.pool,
                                                                     utcnow()).items():
                yield (self.topics.capacity(cloud, region, gpu),
                       functools.partial(_ready, dumps(summary)), expiry)

    async def _committed_lease_state(self, lease_id: str) -> bytes | None:
        """A lease's retained payload as committed now (None once the store failed)."""
        try:
            await self.broker.settled()
        except StoreFailed:
            return None
        lease = self.book.get(lease_id)
        # Not in the book: it has ended (and left memory) since it was listed; ended is
        # final, and its retained state empty.
        return b"" if lease is None else self.messages.lease_state(lease).payload

    async def _read_ended_to_clear(self) -> None:
        """At a connect: the leases whose retained state the restore clears again
        (`_retained_state`), read from the store — those that ended since the retained
        state was last made true, less `RETAINED_ENDED_MARGIN` (at a start, in the
        margin before it), and within `state.keep_ended_hours`; the most recent
        `RESTORE_ENDED_MAX` — as (scheduler, lease_id), without their bodies."""
        self._ended_to_clear = ()
        now = utcnow()
        since = retained_ended_since(self.bus.retained_true_since) or \
            now - RETAINED_ENDED_MARGIN
        try:
            self._ended_to_clear = await self.store.ended_since(
                max(since, now - self.book.keep_ended), limit=RESTORE_ENDED_MAX)
        except StoreFailed as exc:  # the broker stops on it; nothing to clear meanwhile
            log.warning("ended leases not read; their retained states are not cleared "
                        "again", detail=str(exc)[:300])



async def _ready(payload: bytes) -> bytes:
    return payload


def retained_ended_since(true_since: datetime | None) -> datetime | None:
    """The ended leases whose retained state a restore clears again: those that ended at
    or after this (None: not known, at a start). `true_since`: when the retained state
    was last made true (`Bus.retained_true_since`)."""
    return None if true_since is None else true_since - RETAINED_ENDED_MARGIN


def hazard_estimator(policy: Policy, hazard: HazardEstimator | None) -> HazardEstimator:
    """The daemon's estimator, its half-life the policy's (kept when the policy turns
    it off: placement then ignores it, and it is ready when turned on again)."""
    hours = policy.scoring.hazard_half_life_hours
    if hazard is None:
        return HazardEstimator(half_life_hours=hours if hours > 0 else 6.0)
    if hours > 0:
        hazard.half_life_hours = hours
    return hazard


def _read_history(source: Callable[[], Db], since: datetime, until: datetime,
                  hazard: HazardEstimator) -> int:
    with HistoryReader(source) as reader:
        return hazard.observe_rows(reader.rows(since=since, until=until, market=Market.SPOT))

