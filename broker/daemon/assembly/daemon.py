"""The daemon: its parts built and wired (`Daemon.__init__`), its readiness and status,
and `run`: start-up in order, the parts in one task group, shutdown in reverse (the
package docstring says in which order). Standing by, the policy file and the
background tasks are the mixins it is made of (`standby`, `policyfile`, `tasks`)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import math
import os
import sqlite3
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import structlog
from aiohttp import web

from adapters.base import CloudAdapter
from broker.daemon.assembly.policyfile import PolicyReloading
from broker.daemon.assembly.process import (
    SHUTDOWN_GRACE_SECONDS,
    check_mqtt_files,
    leaves,
    quiet_closed_socket_callbacks,
)
from broker.daemon.assembly.standby import StandingBy
from broker.daemon.assembly.tasks import Tasks, hazard_estimator
from broker.daemon.config import Config
from broker.edges.bus import Bus
from broker.edges.http import serve
from broker.edges.metrics import Metrics, state_gauges
from broker.edges.sdnotify import Notifier
from broker.leasing.authority import Broker
from broker.leasing.book import LeaseBook
from broker.market.changes import SliceId
from broker.market.clouds import build_adapters
from broker.market.poller import Poller, PollResult
from broker.market.pool import ResourcePool
from broker.market.recorder import MarketRecorder
from broker.model import Lease, PoolKey, utcnow
from broker.output.ratelimit import Every
from broker.state.configured import store_for
from broker.state.leadership import Leadership
from broker.state.pgstore import PgStateStore
from broker.state.store import Deposed, StoreFailed
from broker.wire.commands import Command
from broker.wire.messages import Envelopes, Messages, Topics
from gpubroker_client import files
from policies import yamlsrc
from policies.loader import SourceError, parse_policy_bytes, policy_hash
from policies.model import Policy
from policies.yamlsrc import Problem

log = structlog.get_logger("gpubroker.daemon")

HEAP_SWEEP_SECONDS = 1.0
"""How often the heap is swept (#31): a full collection, then what survived it frozen.

A full (generation 2) collection walks every tracked object not frozen and holds every
thread meanwhile: the offers a poll round replaces (~20,000, each with its index
entries), the leases placed since the start (three objects each: lease, request,
placement). With only the start's freeze, under churn (`bench/churn.py --rate 200`) the
collector's own full collections took 50–127 ms, 1–3 every 30 s (234 ms over 100,000
leases). Swept every second, a collection walks what a second made and kept: about one a
second, mostly under 5 ms (bench/README.md, `churn.py`).

Frozen objects are still freed by reference counting when let go (offers, leases, their
indexes and messages are no part of a cycle), so the heap does not grow with them. What
a sweep cannot free is a cycle frozen while alive that dies later. A placement batch made
such cycles (its groups' closures over the candidate builder that holds them); they are
broken as the batch ends (`CandidateBuilder.release`), and a sweep runs only between two
batches, when no change is under way (`Authority.between_batches`), or once no request
is queued or being decided, so that a broker with a backlog is swept too. Before the
release, sweeps of a busy broker froze 8,178 such objects in 5 s, 51 offer arrays among
them, while 100,000 leases were placed at 1,000 a second. What still leaks (a cycle of a
poll or a connection in flight) is bounded by `HEAP_THAW_GROWTH`."""

HEAP_THAW_GROWTH = 1.5
"""Once the frozen objects, less the lease book's (`HEAP_OBJECTS_PER_LEASE` per lease
it holds), outnumber their first count or their count after the last thaw by this much
(counted every `HEAP_THAW_CHECK_SECONDS`), a sweep thaws them and collects everything
once: that one collection is as long as those without sweeps (234 ms with 100,000
leases), and frees what cycles were frozen, so they never hold more than half as many
objects again as the long-lived heap besides the leases. `bench/churn.py --audit` found
no such object after 24,000 leases placed and released (four runs), nor with 100,000
leases held and 12,000 churned; sweeps that did not wait for an idle broker froze 516
in 70 s and 14,347 in 150 s (placement's options and groups)."""

HEAP_THAW_CHECK_SECONDS = 600.0
"""How often a sweep counts the frozen objects for `HEAP_THAW_GROWTH`: the count walks
them all (`gc.get_freeze_count()`, ~8 ms over 300,000 objects), too long for every
sweep. The first count, the one later counts are measured against, is made this long
after the start: the placement's caches, built by the first requests, are no leak
(counted at the first poll round, they brought a thaw of 138 ms in the first seconds
of `bench/churn.py`)."""

HEAP_OBJECTS_PER_LEASE = 4
"""Tracked objects per lease in the book, rounded up: 3.2 made here, 3.8 read back from
the store (`bench/lease_memory.py`). A book that grows is no leak, and a thaw over
100,000 leases would hold the loop for hundreds of milliseconds."""


HEAP_TRIM_SECONDS = 60.0
"""How often the C heap's free pages go back to the system (`trim_heap`, in a thread):
once the first poll round is in and swept, then at this pace, busy or not. What Python
frees in the C heap (objects over 512 bytes, buffers, SQLite's and the solver's memory)
glibc keeps for reuse unless it is at the heap's top, so a poll round's or a burst's
peak would stay in the RSS for good. Measured in bench/README.md (`churn.py`)."""


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, looked up in the process's own symbols; None elsewhere
    (musl, macOS; Windows has no such lookup)."""
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except (OSError, TypeError):
        return None


_MALLOC_TRIM = _malloc_trim()


def sweep_heap() -> None:
    """One sweep: a full collection, and what survived it frozen."""
    gc.collect()
    gc.freeze()


def trim_heap() -> bool:
    """The C heap's free pages given back to the system (glibc's `malloc_trim(0)`, which
    releases whole free pages anywhere in the heap, not only at its top). False where
    the C library has no such call. Safe from any thread: it takes the heap's locks."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True


def heap_measure(leases: int) -> int:
    """The frozen objects less the lease book's (`leases` it holds): what grows when
    frozen cycles leak. Counting walks every frozen object."""
    return gc.get_freeze_count() - HEAP_OBJECTS_PER_LEASE * leases


def thaw_if_grown(thawed: int, leases: int) -> int:
    """Once `heap_measure` is beyond `HEAP_THAW_GROWTH` times `thawed` (its value after
    the last thaw or the first count), every frozen object thawed, collected with the
    rest and frozen again. Returns what the next count is measured against."""
    if heap_measure(leases) <= HEAP_THAW_GROWTH * thawed:
        return thawed
    gc.unfreeze()
    sweep_heap()
    return heap_measure(leases)


class HeapSweeper:
    """`sweep_heap` when called, at most every `HEAP_SWEEP_SECONDS`; every
    `HEAP_THAW_CHECK_SECONDS`, `thaw_if_grown` too. `leases`: how many the book holds."""

    def __init__(self, leases: Callable[[], int],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._leases = leases
        self._clock = clock
        self._swept = -math.inf
        self._counted = clock()
        self._thawed: int | None = None  # counted first after HEAP_THAW_CHECK_SECONDS

    def __call__(self) -> None:
        now = self._clock()
        if now - self._swept < HEAP_SWEEP_SECONDS:
            return
        sweep_heap()
        self._swept = self._clock()
        if now - self._counted >= HEAP_THAW_CHECK_SECONDS:
            self._counted = now
            leases = self._leases()
            self._thawed = (heap_measure(leases) if self._thawed is None
                            else thaw_if_grown(self._thawed, leases))


class Daemon(PolicyReloading, StandingBy, Tasks):
    """The daemon of one node: every part, wired; `run` runs them."""

    def __init__(self, cfg: Config, *, policy: Policy | None = None,
                 adapters: list[CloudAdapter] | None = None) -> None:
        self.cfg = cfg
        self.boot_id = str(uuid.uuid4())
        self.policy_digest: str | None = None
        self._rejected_digest: str | None = None
        self._forced_pending = False
        self._unreadable_log = Every(60.0)
        if policy is None and cfg.policy_file is not None:
            # Raises SourceError, naming the file: read once, by the reader a reload uses.
            raw = yamlsrc.read(cfg.policy_file)
            policy = parse_policy_bytes(raw, str(cfg.policy_file))
            self.policy_digest = policy_hash(raw)
        self.policy = policy if policy is not None else Policy()
        if adapters is None:
            adapters, problems = build_adapters(cfg)
            for name, problem in problems:
                log.error("cloud unavailable", cloud=name, error=problem)
        self.adapters = adapters
        self.topics = Topics(cfg.mqtt.topic_prefix)
        self.store = store_for(cfg.state, cfg.site)
        self.leadership: Leadership | None = None
        self.standby_mqtt = False  # standing by: connected to the MQTT server
        self.leader_status: dict[str, Any] | None = None  # standing by: the last P/status
        if cfg.state.url:
            assert isinstance(self.store, PgStateStore)
            self.leadership = Leadership(self.store, site=cfg.site, node=cfg.node,
                                         boot_id=self.boot_id,
                                         seconds=cfg.state.leadership_seconds,
                                         gone=self._said_offline)
        self.pool = ResourcePool(stale_after_seconds=cfg.poll.stale_after_seconds)
        self.hazard = hazard_estimator(self.policy, None)
        self.hazard_warm = asyncio.Event()
        """Set once the estimator has read the recorded history and placement scores with
        it (at once when nothing is recorded)."""
        self.recorder: MarketRecorder | None = None
        if cfg.state.market_history_days > 0:
            self.recorder = MarketRecorder(self.store,
                                           retention_days=cfg.state.market_history_days)
            self.pool.subscribe(self.recorder.observe)
        else:
            self._use_hazard()
        self.book = LeaseBook(keep_ended=timedelta(hours=cfg.state.keep_ended_hours))
        self.messages = Messages(self.topics, Envelopes(cfg.site, self.boot_id,
                                                        epoch=lambda: self.store.epoch))
        self.bus = Bus(cfg.mqtt, self.topics, self.store, client_id=cfg.client_id,
                       boot_id=self.boot_id, on_command=self._submit,
                       retained=self._retained_state, node=cfg.node,
                       epoch=lambda: self.store.epoch, may_publish=self._may_lead,
                       time_left=self._lead_time_left, on_connect=self._heard,
                       on_lost=self._deaf)
        self.broker = Broker(pool=self.pool, book=self.book, store=self.store,
                             messages=self.messages, policy=self.policy,
                             publish=self.bus.enqueue,
                             retry_after_seconds=cfg.poll.interval_seconds,
                             batching=cfg.placement,
                             reconnect_grace_seconds=cfg.mqtt.reconnect_grace_seconds)
        # Not heard yet: no lease expires before the first connect, which is a connect
        # after an outage too (this daemon's restart, or the last leader's end).
        self.broker.deaf()
        for adapter in self.adapters:  # the private servers' sites carry residency tags
            tags = getattr(adapter, "residency_tags", None)
            if callable(tags):
                self.broker.region_tags.append(tags)
        # Slices whose capacity summaries are due, in poll order, each at most once: the
        # publisher reads the slice when its turn comes, so a second poll adds nothing.
        self._polled: dict[SliceId, None] = {}
        self._polled_due = asyncio.Event()
        # High availability, standing by: the lease book as followed in the database (by
        # lease id), and the last change number read.
        self._followed: dict[str, Lease] = {}
        self._follow_cursor = -1
        self._reading_book: asyncio.Future[None] | None = None
        # High availability: slices whose last poll is due to be shared with the standbys.
        self._to_share: dict[SliceId, None] = {}
        self._to_share_due = asyncio.Event()
        self.poller = Poller(self.pool, self.adapters,
                             interval_seconds=cfg.poll.interval_seconds,
                             timeout_seconds=cfg.poll.timeout_seconds,
                             on_result=self._on_poll,
                             turn=lambda: self.broker.idle())
        self.ready = asyncio.Event()
        self.stopped = asyncio.Event()
        self._reload = asyncio.Event()
        self._reloading = asyncio.Lock()
        self.metrics = Metrics()
        self._feed_metrics()
        self.broker.on_launch_failed = self._launch_failed
        self.notifier = Notifier()
        check_mqtt_files(cfg)
        self.http_token = _http_token(cfg)
        self._last_poll = time.monotonic()

    def _feed_metrics(self) -> None:
        """The metrics read the daemon's state (at each scrape; registering reads it once,
        so `self.metrics` is set first), and are fed by the pool and the broker."""
        metrics = self.metrics
        metrics.watch(lambda: state_gauges(self))
        # Paid-for GPUs left idle, integrated over time: before each change of the
        # broker's holdings of them, and after each poll (scrapes add a point too).
        self.pool.on_holdings = lambda: metrics.idle_owned(self.pool.idle_owned_gpus())
        self.pool.subscribe(lambda _: metrics.idle_owned(self.pool.idle_owned_gpus()))
        self.broker.observers.append(metrics.observe_event)
        self.broker.batch_observers.append(metrics.observe_batch)
        self.broker.decision_latency = metrics.decision_seconds.observe

    @property
    def role(self) -> str:
        """`leader` or `standby` (high availability; a single daemon always leads)."""
        return "leader" if self.leadership is None else self.leadership.role

    @property
    def takeovers(self) -> int:
        """How many times this process took the leadership of its site (0: a single
        daemon, which leads without an election)."""
        return 0 if self.leadership is None else self.leadership.takeovers

    def _may_lead(self) -> bool:
        return self.leadership is None or self.leadership.valid()

    def _lead_time_left(self) -> float:
        """Seconds this node is still sure to lead (infinite: a single daemon)."""
        if self.leadership is None:
            return math.inf
        if not self.leadership.valid():
            return 0.0
        return self.leadership.deadline - time.monotonic()

    def not_ready(self) -> list[str]:
        """Why the daemon is not ready to serve (empty: ready)."""
        if self.role == "standby":
            return [self._standby_line()]
        reasons = []
        if self.broker.failed is not None:
            reasons.append("state store failed")
        if not self.bus.connected.is_set():
            reasons.append("MQTT not connected")
        if not self.poller.first_round.is_set():
            reasons.append("first poll not done")
        elif self.adapters and not self.pool.fresh_slices(utcnow()):
            reasons.append("no fresh offers")
        return reasons

    def status_line(self) -> str:
        """What `systemctl status` shows."""
        health = self.pool.health()
        healthy = {h.slice[0] for h in health if h.ok}
        sick = sorted({h.slice[0] for h in health if not h.ok} - healthy)
        clouds = f"{len(healthy)}/{len(self.adapters)} adapters healthy"
        if sick:
            clouds += f" ({', '.join(sick)} failing)"
        failing = sum(1 for h in health if not h.ok)
        return (f"{self.book.active_count} active leases; {len(self.pool)} offers from "
                f"{len(health)} regions ({failing} failing); {clouds}; MQTT "
                f"{'connected' if self.bus.connected.is_set() else 'DISCONNECTED'}, outbox "
                f"{self.bus.outbox_depth}")

    def _launch_failed(self, pool: PoolKey, detail: str) -> None:
        """Tell the pool's cloud a launch failed there (GCP learns stock-outs this way)."""
        for adapter in self.adapters:
            if adapter.name == pool.cloud and adapter.note_launch_failure(pool, detail):
                log.info("stock-out noted", pool=str(pool), detail=detail)

    def adapter(self, name: str) -> CloudAdapter:
        return next(a for a in self.adapters if a.name == name)

    async def _submit(self, command: Command) -> None:
        await self.broker.submit(command)

    async def _heard(self) -> int:
        extended = await self.broker.heard()
        await self._read_ended_to_clear()
        return extended

    def _deaf(self) -> None:
        self.broker.deaf()

    def _on_poll(self, result: PollResult) -> None:
        self._last_poll = time.monotonic()
        adapter, region = result.slice
        outcome = "ok" if result.error is None else type(result.error).__name__
        self.metrics.polls.labels(adapter=adapter, region=region, result=outcome).inc()
        self.metrics.poll_seconds.labels(adapter=adapter, result=outcome).observe(
            result.seconds)
        if result.change is not None and result.slice not in self._polled:
            self._polled[result.slice] = None
            self._polled_due.set()
        if result.change is not None and self.leadership is not None:
            self._to_share[result.slice] = None
            self._to_share_due.set()

    @property
    def capacity_pending(self) -> int:
        """Slices whose capacity summaries wait to be published (each at most once)."""
        return len(self._polled)

    async def run(self, stop: asyncio.Event) -> None:
        """Run until `stop` is set, then shut down in order."""
        quiet_closed_socket_callbacks(asyncio.get_running_loop())
        if self.leadership is None:
            await self._open_sqlite()
        http = None
        try:
            http = await self._serve_http()
            if self.leadership is not None and not await self._take_office(stop):
                return
            await self._restore()
            async with asyncio.TaskGroup() as tg:
                hold = None if self.leadership is None else tg.create_task(self.leadership.hold())
                bus = tg.create_task(self.bus.run())
                workers, recording = self._start(tg)
                await stop.wait()
                await self._shut_down(workers, recording)
                bus.cancel()
                if hold is not None and self.leadership is not None:
                    hold.cancel()
                    await self.leadership.release()
        except BaseExceptionGroup as eg:
            self._ended_by(eg)
        finally:
            await self._close(http)

    async def _serve_http(self) -> web.AppRunner | None:
        if (where := self.cfg.http.host_port) is None:
            return None
        try:
            http = await serve(self, *where)
        except OSError as exc:  # name the setting; keep the type (gaierror: exit 2)
            reason = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else exc.strerror
            raise type(exc)(exc.errno, f"http.listen {self.cfg.http.listen}: "
                            f"{reason}") from None
        log.info("http listening", listen=self.cfg.http.listen)
        return http

    async def _take_office(self, stop: asyncio.Event) -> bool:
        """High availability: stand by until elected (False: `stop` was set first), then
        commit with the new epoch and take over the last leader's polls."""
        if not await self._stand_by(stop):
            return False
        assert self.leadership is not None
        self.store.epoch = self.leadership.epoch
        if isinstance(self.store, PgStateStore):
            self.store.boot_id = self.leadership.boot_id
            await self._take_over_polls(self.store)
        return True

    async def _restore(self) -> None:
        """The lease book (its active leases: an ended one is read from the store when
        asked for) and the outbox, from the store."""
        self.broker.restore(await self._lease_book())
        # The restored book is long-lived: out of the cyclic collector's sight, a full
        # collection does not walk it (with a few hundred thousand leases one would
        # hold every thread, the leadership's renewals included, for seconds). Leases
        # hold no cycles: an ended one is still freed when it is let go.
        gc.freeze()
        self.bus.enqueue(await self.store.pending())
        self.messages.schedseqs = await self.store.schedseqs()
        log.info("starting", site=self.cfg.site, boot_id=self.boot_id,
                 leases=self.book.active_count, outbox=self.bus.outbox_depth,
                 adapters=[a.name for a in self.adapters], state=self.store.name,
                 node=self.cfg.node, epoch=self.store.epoch)

    async def _sweep_heap(self) -> None:
        """At most every `HEAP_SWEEP_SECONDS`: a full collection, then what survived it
        frozen (`gc.freeze`), so that no collection walks it again; the frozen thawed
        and collected at `HEAP_THAW_GROWTH`. Between two batches of requests, or once
        no request is queued or being decided. After the first sweep, and then every
        `HEAP_TRIM_SECONDS` whether busy or not, the C heap trimmed (`trim_heap`) in a
        thread."""
        await self.poller.first_round.wait()
        sweeper = HeapSweeper(lambda: self.book.in_memory)
        sweeper()
        self.broker.between_batches = sweeper
        await asyncio.to_thread(trim_heap)
        trimmed = time.monotonic()
        while True:
            await asyncio.sleep(HEAP_SWEEP_SECONDS)
            if time.monotonic() - trimmed >= HEAP_TRIM_SECONDS:  # busy or not
                await asyncio.to_thread(trim_heap)
                trimmed = time.monotonic()
            try:
                async with asyncio.timeout(HEAP_SWEEP_SECONDS):
                    await self.broker.idle()
            except TimeoutError:
                continue
            sweeper()

    def _start(self, tg: asyncio.TaskGroup
               ) -> tuple[list[asyncio.Task[Any]], asyncio.Task[None] | None]:
        """Every task but the bus and the leadership's: (the workers, the recorder's)."""
        workers = [
            tg.create_task(self.poller.run()),
            tg.create_task(self.broker.run_requests(self.poller.first_round)),
            tg.create_task(self.broker.run_failovers()),
            tg.create_task(self.broker.run_expiry(self.poller.first_round)),
            tg.create_task(self.broker.run_health(
                min(30.0, self.cfg.poll.stale_after_seconds / 4))),
            tg.create_task(self._watch_policy()),
            tg.create_task(self._publish_capacity()),
            tg.create_task(self._mark_ready()),
            tg.create_task(self.warm_hazard()),
            tg.create_task(self._preload_solver()),
            tg.create_task(self._prepare_costs()),
            tg.create_task(self.metrics.watch_loop_lag()),
            tg.create_task(self.broker.learn_stored_keys()),
            tg.create_task(self._sweep_heap()),
            *(tg.create_task(self._signals(a)) for a in self.adapters),
        ]
        workers.append(tg.create_task(self._systemd()))
        if self.leadership is not None:
            workers.append(tg.create_task(self._share_polls()))
        recording = None
        if self.recorder is not None:
            recording = tg.create_task(self.recorder.run())
            workers.append(tg.create_task(self.recorder.run_pruning()))
        return workers, recording

    async def _shut_down(self, workers: list[asyncio.Task[Any]],
                         recording: asyncio.Task[None] | None) -> None:
        """Stop taking requests, finish the decisions in flight, stop the workers, write
        the recorder's last polls, flush the outbox and say goodbye."""
        log.info("shutting down")
        self.notifier.stopping()
        self.bus.stop_receiving()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(SHUTDOWN_GRACE_SECONDS / 2):
                await self.broker.idle()
        for task in workers:
            task.cancel()
        if recording is not None:
            await self._flush_recorder(recording)
        if not await self.bus.drained(SHUTDOWN_GRACE_SECONDS / 2):
            log.warning("outbox not flushed; it is sent at next start",
                        outbox=self.bus.outbox_depth)
        await self.bus.goodbye()

    def _ended_by(self, eg: BaseExceptionGroup[Any]) -> NoReturn:
        """The task group failed: deposed (stand by again), the store refused a commit
        (crash-only), or anything else (raised as it is)."""
        if self.leadership is not None:
            self.leadership.step_down()  # publish nothing more, whatever happened
        deposed, _ = eg.split(Deposed)
        if deposed is not None and self.broker.failed is None:
            first = leaves(deposed)[0]
            log.warning("deposed: another node leads the site; standing by again",
                        detail=str(first))
            raise first from None
        failed = self.broker.failed
        if failed is None:
            raise eg
        # Crash-only (broker.leasing.authority): the store refused a commit. The broker
        # has logged it and refused what was waiting; end with that error, not with the
        # group.
        _, rest = eg.split(StoreFailed)
        if rest is not None:
            log.error("failed as well while stopping", exc_info=rest)
        raise failed from None

    async def _close(self, http: web.AppRunner | None) -> None:
        if http is not None:
            await http.cleanup()
        for adapter in self.adapters:
            await adapter.close()
        if self.leadership is not None:
            await self.leadership.close()
        await self.store.close()
        self.notifier.close()
        self.stopped.set()
        log.info("stopped")

    async def _open_sqlite(self) -> None:
        path = Path(self.store.name)
        try:
            await self.store.open()
        except (sqlite3.Error, OSError, RuntimeError) as exc:  # RuntimeError: a newer schema
            why = "it is a directory" if await asyncio.to_thread(path.is_dir) else exc
            raise SourceError([Problem(str(path), None, None, "state.path",
                                       f"cannot open the state file: {why}")]) from None


def _http_token(cfg: Config) -> bytes | None:
    """The HTTP API's bearer token, from `http.token_file` (None: not configured)."""
    if cfg.http.token_file is None:
        return None
    try:
        return files.read_secret(cfg.http.token_file).encode() or None
    except OSError as exc:
        raise SourceError([yamlsrc.unreadable(cfg.http.token_file, exc,
                                              "http.token_file")]) from None
