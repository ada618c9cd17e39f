"""The composition root: builds the parts, runs them in one task group, shuts down in order.

Start-up: state store → lease book and outbox restored → MQTT → adapters → polling;
requests are taken once the first round of polls is in. The market recorder listens to
the pool from the start and writes on the store's thread. Shutdown (SIGTERM/SIGINT) runs
in reverse: stop taking requests, finish the decisions in flight, flush the outbox,
publish `offline`, disconnect, close the store and the adapters. A commit the state
store refuses ends the task group at once instead (crash-only, see `broker.leasing.authority`):
`run` raises `StoreFailed`, and the next start recovers from the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import gc
import json
import math
import os
import signal
import sqlite3
import ssl
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import structlog

from adapters.base import CloudAdapter
from adapters.errors import AdapterError
from broker.daemon.config import Config
from broker.edges.bus import Bus, RetainedRead, make_client
from broker.edges.http import serve
from broker.edges.metrics import Metrics, state_gauges
from broker.edges.sdnotify import Notifier, watchdog_seconds
from broker.leasing.authority import Broker
from broker.leasing.book import LeaseBook
from broker.market import capacity
from broker.market.changes import PoolChange, SliceId
from broker.market.clouds import build_adapters
from broker.market.hazard import HazardEstimator
from broker.market.poller import Poller, PollResult
from broker.market.pool import ResourcePool
from broker.market.recorder import HistoryReader, MarketRecorder
from broker.model import Lease, LeaseState, Market, PoolKey, utcnow
from broker.output.logs import filter_loop_errors
from broker.output.ratelimit import Every
from broker.placement import solver
from broker.state.configured import store_for
from broker.state.leadership import Leadership
from broker.state.pgstore import PgStateStore
from broker.state.store import Db, Deposed, StoreFailed, db_errors
from broker.wire.commands import Command
from broker.wire.messages import Envelopes, Messages, Topics, dumps
from gpubroker_client import files
from policies import yamlsrc
from policies.loader import SourceError, parse_policy_bytes, policy_hash
from policies.model import Policy
from policies.yamlsrc import Problem

log = structlog.get_logger("gpubroker.daemon")
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS)
"""A read failing with one of these says nothing about the file: try it again later."""

SHUTDOWN_GRACE_SECONDS = 10.0
RETAINED_ENDED_MARGIN = timedelta(hours=1)
"""After a reconnect, retained states are cleared again for leases that ended up to this
long before the connection was lost: an MQTT server restored from a save of that age may
still hold them (mosquitto's default autosave interval is 30 minutes)."""
HAZARD_HISTORY_HALF_LIVES = 4.0
"""How much recorded history warms the hazard estimator at start (older rows weigh
under 2^-4 of its averages)."""


class Daemon:
    # Complex: split in the package redesign (#28).
    def __init__(self, cfg: Config, *, policy: Policy | None = None,  # noqa: PLR0915
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
        self.hazard = _hazard_estimator(self.policy, None)
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
                       time_left=self._lead_time_left)
        self.broker = Broker(pool=self.pool, book=self.book, store=self.store,
                             messages=self.messages, policy=self.policy,
                             publish=self.bus.enqueue,
                             retry_after_seconds=cfg.poll.interval_seconds,
                             batching=cfg.placement)
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
                             on_result=self._on_poll)
        self.ready = asyncio.Event()
        self.stopped = asyncio.Event()
        self._reload = asyncio.Event()
        self._reloading = asyncio.Lock()
        self.metrics = Metrics()
        self.metrics.watch(lambda: state_gauges(self))
        # Paid-for GPUs left idle, integrated over time: before each change of the
        # broker's holdings of them, and after each poll (scrapes add a point too).
        self.pool.on_holdings = lambda: self.metrics.idle_owned(self.pool.idle_owned_gpus())
        self.pool.subscribe(lambda _: self.metrics.idle_owned(self.pool.idle_owned_gpus()))
        self.broker.observers.append(self.metrics.observe_event)
        self.broker.batch_observers.append(self.metrics.observe_batch)
        self.broker.decision_latency = self.metrics.decision_seconds.observe
        self.broker.on_launch_failed = self._launch_failed
        self.notifier = Notifier()
        _check_mqtt_files(cfg)
        self.http_token: bytes | None = None
        if cfg.http.token_file is not None:
            try:
                self.http_token = files.read_secret(cfg.http.token_file).encode() or None
            except OSError as exc:
                raise SourceError([yamlsrc.unreadable(cfg.http.token_file, exc,
                                                      "http.token_file")]) from None
        self._last_poll = time.monotonic()

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
        return (f"{len(self.book.active())} active leases; {len(self.pool)} offers from "
                f"{len(health)} regions ({failing} failing); {clouds}; MQTT "
                f"{'connected' if self.bus.connected.is_set() else 'DISCONNECTED'}, outbox "
                f"{self.bus.outbox_depth}")

    def request_reload(self) -> None:
        """SIGHUP: read the policy file again now."""
        self._reload.set()

    async def reload_policy(self, *, forced: bool = False) -> str:
        """Read, validate and apply the policy file if it changed (or `forced`).
        Returns "applied", "rejected" or "unchanged"."""
        async with self._reloading:
            return await self._reload_policy(forced)

    async def _reload_policy(self, forced: bool) -> str:
        path = self.cfg.policy_file
        if path is None:
            return "unchanged"
        if not forced:
            return await self._reload_policy_file(path, forced)
        # A SIGHUP (systemctl reload) is a reload systemd waits for: tell it.
        self.notifier.reloading()
        try:
            return await self._reload_policy_file(path, forced)
        finally:
            self.notifier.ready(self.status_line())

    async def _reload_policy_file(self, path: Path, forced: bool) -> str:
        """The file is read and parsed by the readers a start uses (`broker.daemon.files`:
        a regular file of at most 1 MiB, strict UTF-8; `yamlsrc`: every YAML failure an
        error naming line and key), off the event loop: a FIFO, `/dev/zero` or a
        42,000-team policy neither blocks nor stalls the daemon. A refusal is published
        once per change of the file — of its content, or for a file that is not read,
        of why and of what it is (inode, size, modification time)."""
        try:
            raw = await asyncio.to_thread(files.read_bytes, path, yamlsrc.MAX_BYTES)
        except OSError as exc:
            if exc.errno in _OUT_OF_RESOURCES:
                # The process (or system) is out of descriptors or memory, e.g. while
                # HTTP clients hold many connections: nothing is wrong with the file.
                # Not a policy.rejected; the watcher tries again (a SIGHUP's forced
                # reload too) on its next round.
                self._forced_pending = self._forced_pending or forced
                if n := self._unreadable_log.hit():
                    log.warning("policy file not read now; retrying", file=str(path),
                                error=exc.strerror, count=n)
                return "unchanged"
            problem = yamlsrc.unreadable(path, exc)
            seen = f"unreadable: {problem} {getattr(exc, 'identity', None)}"
            if forced or self._rejected_digest != seen:
                self._rejected_digest = seen
                await self.broker.reject_policy(str(path), [problem])
            return "rejected"
        digest = policy_hash(raw)
        if digest == self.policy_digest and not forced:
            return "unchanged"
        if digest == self._rejected_digest and not forced:
            return "rejected"
        try:
            policy = await asyncio.to_thread(parse_policy_bytes, raw, str(path))
        except SourceError as err:
            self._rejected_digest = digest
            await self.broker.reject_policy(str(path), err.problems)
            return "rejected"
        self._rejected_digest = None
        self.policy = policy
        self.policy_digest = digest
        _hazard_estimator(policy, self.hazard)
        await self.broker.apply_policy(policy, digest, str(path))
        return "applied"

    async def _watch_policy(self, every_seconds: float = 2.0) -> None:
        """Reload on SIGHUP, and when the file's content changes."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(every_seconds):
                    await self._reload.wait()
            forced = self._reload.is_set() or self._forced_pending
            self._reload.clear()
            self._forced_pending = False
            await self.reload_policy(forced=forced)

    def _launch_failed(self, pool: PoolKey, detail: str) -> None:
        """Tell the pool's cloud a launch failed there (GCP learns stock-outs this way)."""
        for adapter in self.adapters:
            if adapter.name == pool.cloud and adapter.note_launch_failure(pool, detail):
                log.info("stock-out noted", pool=str(pool), detail=detail)

    def adapter(self, name: str) -> CloudAdapter:
        return next(a for a in self.adapters if a.name == name)

    async def _submit(self, command: Command) -> None:
        await self.broker.submit(command)

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

    # Complex: split in the package redesign (#28).
    async def run(self, stop: asyncio.Event) -> None:  # noqa: C901, PLR0912, PLR0915
        """Run until `stop` is set, then shut down in order."""
        _quiet_closed_socket_callbacks(asyncio.get_running_loop())
        if self.leadership is None:
            await self._open_sqlite()
        http = None
        hold: asyncio.Task[None] | None = None
        try:
            if (where := self.cfg.http.host_port) is not None:
                try:
                    http = await serve(self, *where)
                except OSError as exc:  # name the setting; keep the type (gaierror: exit 2)
                    reason = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else \
                        exc.strerror
                    raise type(exc)(exc.errno, f"http.listen {self.cfg.http.listen}: "
                                    f"{reason}") from None
                log.info("http listening", listen=self.cfg.http.listen)
            if self.leadership is not None:
                if not await self._stand_by(stop):
                    return
                assert self.leadership is not None
                self.store.epoch = self.leadership.epoch
                if isinstance(self.store, PgStateStore):
                    self.store.boot_id = self.leadership.boot_id
                    await self._take_over_polls(self.store)
            now = utcnow()
            self.broker.restore(await self._lease_book(now - self.book.keep_ended))
            # The restored book is long-lived: out of the cyclic collector's sight, a full
            # collection does not walk it (with a few hundred thousand leases one would
            # hold every thread, the leadership's renewals included, for seconds). Leases
            # hold no cycles: an ended one is still freed when it is let go.
            gc.freeze()
            self.bus.enqueue(await self.store.pending())
            log.info("starting", site=self.cfg.site, boot_id=self.boot_id,
                     leases=len(self.book.active()), outbox=self.bus.outbox_depth,
                     adapters=[a.name for a in self.adapters], state=self.store.name,
                     node=self.cfg.node, epoch=self.store.epoch)
            async with asyncio.TaskGroup() as tg:
                if self.leadership is not None:
                    hold = tg.create_task(self.leadership.hold())
                bus = tg.create_task(self.bus.run())
                workers = [
                    tg.create_task(self.poller.run()),
                    tg.create_task(self.broker.run_requests(self.poller.first_round)),
                    tg.create_task(self.broker.run_failovers()),
                    tg.create_task(self.broker.run_expiry(self.poller.first_round)),
                    tg.create_task(self.broker.run_health(
                        min(30.0, self.cfg.poll.stale_after_seconds / 4))),
                    tg.create_task(self._watch_policy()),
                    tg.create_task(self._publish_capacity()),
                    tg.create_task(self._prune()),
                    tg.create_task(self._mark_ready()),
                    tg.create_task(self.warm_hazard()),
                    tg.create_task(self._preload_solver()),
                    tg.create_task(self.metrics.watch_loop_lag()),
                    tg.create_task(self.broker.learn_stored_keys()),
                    *(tg.create_task(self._signals(a)) for a in self.adapters),
                ]
                workers.append(tg.create_task(self._systemd()))
                if self.leadership is not None:
                    workers.append(tg.create_task(self._share_polls()))
                recording = None
                if self.recorder is not None:
                    recording = tg.create_task(self.recorder.run())
                    workers.append(tg.create_task(self.recorder.run_pruning()))
                await stop.wait()
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
                bus.cancel()
                if hold is not None and self.leadership is not None:
                    hold.cancel()
                    await self.leadership.release()
        except BaseExceptionGroup as eg:
            if self.leadership is not None:
                self.leadership.step_down()  # publish nothing more, whatever happened
            deposed, _ = eg.split(Deposed)
            if deposed is not None and self.broker.failed is None:
                first = _leaves(deposed)[0]
                log.warning("deposed: another node leads the site; standing by again",
                            detail=str(first))
                raise first from None
            failed = self.broker.failed
            if failed is None:
                raise
            # Crash-only (broker.leasing.authority): the store refused a commit.
            # The broker has logged
            # it and refused what was waiting; end with that error, not with the group.
            _, rest = eg.split(StoreFailed)
            if rest is not None:
                log.error("failed as well while stopping", exc_info=rest)
            raise failed from None
        finally:
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

    async def _stand_by(self, stop: asyncio.Event) -> bool:
        """High availability: open the shared store (waiting for the database while it
        cannot be reached), then stand by until this node leads the site. False: `stop`
        was set first. A schema newer than this code, or another site's database, is a
        configuration error (exit 2)."""
        assert self.leadership is not None
        failures = 0
        while True:
            try:
                await self.store.open()
                break
            except RuntimeError as exc:
                raise SourceError([Problem(self.store.name, None, None, "state.url",
                                           str(exc))]) from None
            except db_errors(OSError) as exc:
                failures += 1
                if failures == 1:
                    log.warning("database not reachable, retrying", database=self.store.name,
                                error=type(exc).__name__, detail=str(exc).strip()[:300])
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(5.0, 0.5 * failures)):
                        await stop.wait()
                if stop.is_set():
                    return False
        log.info("standing by", site=self.cfg.site, node=self.cfg.node,
                 database=self.store.name)
        self.notifier.ready(self._standby_line())
        async with asyncio.TaskGroup() as tg:
            watch = [tg.create_task(self._standby_bus()), tg.create_task(self._standby_pulse()),
                     tg.create_task(self._follow_book())]
            try:
                epoch = await self.leadership.acquire(stop)
            finally:
                await _cancel_and_wait(watch)
        if epoch is None:
            return False
        await self._store_connection_alive()
        return True

    def _said_offline(self, boot_id: str) -> bool:
        """Standing by: whether the last `P/status` this node saw is that boot's
        `offline` (a leader's will fires when its MQTT connection drops)."""
        status = self.leader_status
        return (status is not None and status.get("state") == "offline"
                and status.get("boot_id") == boot_id)

    async def _lease_book(self, ended_since: datetime) -> list[Lease]:
        """The lease book to restore: read whole (SQLite), or — just elected — the book
        followed while standing by brought up to date, so a takeover reads only what
        changed since (a few hundred thousand leases take seconds to read whole)."""
        if not isinstance(self.store, PgStateStore):
            return await self.store.leases(ended_since=ended_since)
        started = time.monotonic()
        reading = self._reading_book
        if reading is not None:
            # The standby's read in flight (its first, of the whole book, may take
            # seconds): wait for it rather than read the book a second time.
            with contextlib.suppress(StoreFailed):
                await reading
        await self._catch_up_book(self.store, ended_since)
        followed, self._followed = self._followed, {}
        leases = [le for le in followed.values()
                  if le.state is LeaseState.ACTIVE or le.updated_at >= ended_since]
        log.info("lease book taken over", leases=len(leases),
                 seconds=round(time.monotonic() - started, 3))
        return leases

    async def _catch_up_book(self, store: PgStateStore, ended_since: datetime) -> None:
        cursor, changed = await store.lease_changes(self._follow_cursor,
                                                    ended_since=ended_since)
        for lease in changed:
            self._followed[lease.lease_id] = lease
        self._follow_cursor = cursor

    async def _follow_book(self, every: float = 1.0) -> None:
        """Standing by: follow the leader's lease book in the database, change by change
        (`PgStateStore.lease_changes`), so that a takeover does not read it whole. Ended
        leases older than `keep_ended_hours` are let go, as the leader does."""
        store = self.store
        assert isinstance(store, PgStateStore)
        failing = False
        pruned = time.monotonic()
        while True:
            ended_since = utcnow() - self.book.keep_ended
            # Shielded: a takeover cancels this task but takes over the read in flight.
            self._reading_book = asyncio.ensure_future(self._catch_up_book(store,
                                                                           ended_since))
            try:
                await asyncio.shield(self._reading_book)
            except StoreFailed as exc:
                if not failing:
                    failing = True
                    log.warning("standing by: the lease book not followed; retrying",
                                detail=str(exc)[:300])
            else:
                failing = False
            if time.monotonic() - pruned > 600:
                pruned = time.monotonic()
                self._followed = {k: le for k, le in self._followed.items()
                                  if le.state is LeaseState.ACTIVE
                                  or le.updated_at >= ended_since}
            await asyncio.sleep(every)

    async def _take_over_polls(self, store: PgStateStore) -> None:
        """Just elected: take the last leader's polls that are still fresh into the pool,
        so that placement starts at once instead of after this node's first poll of
        every cloud (which goes ahead on schedule all the same)."""
        now = utcnow()
        started = time.monotonic()
        try:
            shared = await store.load_slices(now - self.pool.stale_after)
        except StoreFailed as exc:
            log.warning("the last leader's polls not read; placing after the first poll",
                        detail=str(exc)[:300])
            return
        ours = {(a.name, r) for a in self.adapters for r in a.regions()}
        taken: dict[SliceId, float] = {}
        for slice_id, polled_at, offers in shared:
            if slice_id in ours and now - polled_at <= self.pool.stale_after:
                self.pool.replace(slice_id, offers, polled_at=polled_at)
                taken[slice_id] = (now - polled_at).total_seconds()
        self.poller.warmed(taken)
        log.info("took over the last leader's polls", slices=len(taken), of=len(ours),
                 offers=sum(len(self.pool.slice_offers(s)) for s in taken),
                 seconds=round(time.monotonic() - started, 3))

    async def _share_polls(self) -> None:
        """Leading with standbys: write each slice's last poll to the database for them
        (`_take_over_polls`), latest first come first, at most one write at a time."""
        store = self.store
        if not isinstance(store, PgStateStore):
            return
        while True:
            await self._to_share_due.wait()
            self._to_share_due.clear()
            while self._to_share:
                slice_id = next(iter(self._to_share))
                del self._to_share[slice_id]
                health = next((h for h in self.pool.health() if h.slice == slice_id), None)
                if health is None or health.last_ok_at is None:
                    continue
                await store.save_slice(slice_id, health.last_ok_at,
                                       self.pool.slice_offers(slice_id))

    async def _store_connection_alive(self) -> None:
        """Just elected: the store's connection was opened when this node began to stand
        by and a standby never uses it, so a database restart meanwhile would go
        unnoticed until the first read as the leader, which would fail and leave the
        site without a leader until the claim expires. A lost connection is replaced;
        one that cannot be is `StoreFailed` (stand by again)."""
        store = self.store
        assert isinstance(store, PgStateStore)
        await store.reconnect_if_lost()

    async def _standby_bus(self) -> None:
        """Standing by: stay connected to the MQTT server with a client of this node's
        own (no will, no session, publishes nothing) and follow `P/status`, so /readyz
        and the status line say whether the server and the leader are there. A status
        of a lower epoch than one already seen is a deposed leader's, late: ignored.
        It logs in as `mqtt.standby_username`, not as the daemon: where client ids are
        usernames (deploy/mosquitto) the daemon's login is the leader's session, and
        connecting with it would end the leader's connection (#26). On a server that
        wants a login, without a standby user, it does not connect."""
        mqtt = self.cfg.mqtt.standby()
        if mqtt is None:
            log.warning("standing by without following P/status: mqtt.standby_username "
                        "is not set (the daemon's own MQTT user is the leader's)")
            return
        client_id = f"{self.cfg.client_id}-standby-{self.cfg.node}"
        failures = 0
        while True:
            try:
                async with make_client(mqtt, client_id, session=False) as client:
                    await client.subscribe(self.topics.status, qos=1)
                    self.standby_mqtt = True
                    failures = 0
                    async for message in client.messages:
                        status = _json_object(message.payload)
                        if status is not None and not _older(status, self.leader_status):
                            self.leader_status = status
            except Exception as exc:  # any failure: reconnect (standing by is all it does)
                failures += 1
                if failures == 1:
                    log.warning("standing by: mqtt not reachable, retrying",
                                url=self.cfg.mqtt.url, error=type(exc).__name__,
                                detail=str(exc)[:300])
            finally:
                self.standby_mqtt = False
            await asyncio.sleep(min(30.0, 0.25 * 2 ** min(failures, 7)))

    async def _standby_pulse(self) -> None:
        """Standing by: systemd's status line, and its watchdog while the loop runs."""
        period = watchdog_seconds()
        while True:
            self.notifier.status(self._standby_line())
            if period:
                self.notifier.watchdog()
            await asyncio.sleep(min(5.0, period / 2) if period else 5.0)

    def _standby_line(self) -> str:
        ha = self.leadership
        assert ha is not None
        notes = []
        if not ha.database_ok:
            notes.append("database not reachable")
        elif ha.leader is None:
            notes.append("no leader yet")
        else:
            notes.append(f"leader: node {ha.leader[0]}, epoch {ha.leader[1]}")
        if not self.standby_mqtt:
            notes.append("MQTT not connected")
        return f"standby ({'; '.join(notes)})"

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
        log.info("ready", offers=len(self.pool), leases=len(self.book.active()))

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
        lease's state; an empty payload for each lease that ended since shortly before
        the connection was lost (a server restored from an older save may still hold
        it); the capacity summaries of every slice of the pool. Lease states are read
        when sent, and only once committed. `P/status` is published by the bus."""
        now = utcnow()
        since = min(self.bus.lost_at or now, now) - RETAINED_ENDED_MARGIN
        for lease in self.book.all():
            if lease.state is LeaseState.ACTIVE or lease.updated_at >= since:
                yield (self.topics.lease(lease.scheduler, lease.lease_id),
                       functools.partial(self._committed_lease_state, lease.lease_id), None)
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
        return None if lease is None else self.messages.lease_state(lease).payload

    async def _prune(self) -> None:
        while True:
            await asyncio.sleep(3600)
            self.book.prune(utcnow())


def _json_object(payload: Any) -> dict[str, Any] | None:
    try:
        value = json.loads(payload)
    except (TypeError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _older(status: dict[str, Any], than: dict[str, Any] | None) -> bool:
    """Whether `status` (a `P/status`) has a lower leader epoch than `than`: then it
    comes from a deposed leader and says nothing of the site's leader now."""
    if than is None:
        return False
    return _epoch_of(status) < _epoch_of(than)


def _epoch_of(status: dict[str, Any]) -> int:
    epoch = status.get("epoch")
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else 0


async def _cancel_and_wait(tasks: list[asyncio.Task[None]], every: float = 0.5) -> None:
    """Cancel `tasks` and wait until they have ended, cancelling again those that live
    on. aiomqtt waits for its CONNACK and SUBACK with `asyncio.wait_for`, which on Python
    3.11 swallows a cancellation that arrives as the wait completes (CPython gh-86296):
    the task then carries on, subscribed, and one `cancel()` is not enough."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=every)


def _leaves(eg: BaseExceptionGroup[Any]) -> list[BaseException]:
    out: list[BaseException] = []
    for e in eg.exceptions:
        out.extend(_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])
    return out


def _quiet_closed_socket_callbacks(loop: asyncio.AbstractEventLoop) -> None:
    """paho, under aiomqtt, asks the loop from its own callbacks to watch a socket that
    may be closed by the time the request runs (the MQTT server just went away); asyncio
    would log that with a traceback although nothing is wrong: the session is already
    ending and reconnects. Only that case is quietened; everything else goes to the
    handler that was there."""
    def quiet(context: dict[str, Any]) -> bool:
        exc = context.get("exception")
        handle = repr(context.get("handle", ""))
        if isinstance(exc, OSError) and exc.errno == errno.EBADF and (
                "add_writer" in handle or "add_reader" in handle):
            log.debug("socket watch on a closed MQTT connection skipped", handle=handle)
            return True
        return False

    filter_loop_errors(loop, quiet)


async def _ready(payload: bytes) -> bytes:
    return payload


def _hazard_estimator(policy: Policy, hazard: HazardEstimator | None) -> HazardEstimator:
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


def _check_mqtt_files(cfg: Config) -> None:
    """The MQTT password and CA files, and the database's password file, read once at
    start: a missing or unreadable one is a mistake in the configuration (exit 2), not
    a server that is away (which the daemon waits out). They are read again at each
    connect. Each is read by `broker.daemon.files` (a regular file, within its bound), so a
    FIFO or `/dev/zero` there is refused at once rather than hanging or filling memory."""
    problems = []
    for key, path in (("mqtt.password_file", cfg.mqtt.password_file),
                      ("mqtt.standby_password_file", cfg.mqtt.standby_password_file),
                      ("mqtt.ca_file", cfg.mqtt.ca_file),
                      ("state.password_file", cfg.state.password_file)):
        if path is None:
            continue
        try:
            if key == "mqtt.ca_file":
                files.read_bytes(path, files.MAX_CA_BYTES)
                ssl.create_default_context(cafile=str(path))
            else:
                files.read_secret(path)
        except (OSError, ssl.SSLError) as exc:
            why = "not a PEM certificate file" if isinstance(exc, ssl.SSLError) else \
                exc.strerror or str(exc)
            problems.append(Problem(str(path), None, None, key, f"cannot read: {why}")
                            if isinstance(exc, ssl.SSLError)  # an OSError too
                            else yamlsrc.unreadable(path, exc, key))
    if problems:
        raise SourceError(problems)


def install_signal_handlers(stop: asyncio.Event, reload: Callable[[], None] | None = None
                            ) -> Callable[[], None]:
    """SIGTERM/SIGINT stop; SIGHUP reloads the policy."""
    loop = asyncio.get_running_loop()
    handled = [signal.SIGTERM, signal.SIGINT]
    for sig in handled:
        loop.add_signal_handler(sig, stop.set)
    if reload is not None:
        loop.add_signal_handler(signal.SIGHUP, reload)
        handled.append(signal.SIGHUP)

    def remove() -> None:
        for sig in handled:
            loop.remove_signal_handler(sig)

    return remove
