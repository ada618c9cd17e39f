"""High availability, standing by: the shared store opened (waiting for the database),
the leader's `P/status` and lease book followed until this node is elected, then the
book and the last polls taken over; while leading, each poll shared with the standbys."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import TYPE_CHECKING, Any

import structlog

from adapters.base import CloudAdapter
from broker.daemon.config import Config
from broker.edges.mqtt import connected
from broker.edges.sdnotify import Notifier, watchdog_seconds
from broker.leasing.book import LeaseBook
from broker.market.changes import SliceId
from broker.market.poller import Poller
from broker.market.pool import ResourcePool
from broker.model import Lease, LeaseState, utcnow
from broker.state.leadership import Leadership
from broker.state.pgstore import PgStateStore
from broker.state.store import Store, StoreFailed, db_errors
from broker.wire.messages import Topics
from policies.loader import SourceError
from policies.yamlsrc import Problem

log = structlog.get_logger("gpubroker.daemon")


class StandingBy:
    """The standby's part of the daemon (`Daemon` is made of it)."""

    if TYPE_CHECKING:
        cfg: Config
        store: Store
        leadership: Leadership | None
        notifier: Notifier
        book: LeaseBook
        pool: ResourcePool
        poller: Poller
        adapters: list[CloudAdapter]
        topics: Topics
        leader_status: dict[str, Any] | None
        standby_mqtt: bool
        _followed: dict[str, Lease]
        _follow_cursor: int
        _reading_book: asyncio.Future[None] | None
        _to_share: dict[SliceId, None]
        _to_share_due: asyncio.Event

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

    async def _lease_book(self) -> list[Lease]:
        """The active leases to restore the book with: read whole (SQLite), or — just
        elected — the book followed while standing by brought up to date, so a takeover
        reads only what changed since (a few hundred thousand leases take seconds to
        read whole). Ended leases stay in the store (`broker.leasing.book`)."""
        if not isinstance(self.store, PgStateStore):
            return await self.store.leases()
        started = time.monotonic()
        reading = self._reading_book
        if reading is not None:
            # The standby's read in flight (its first, of the whole book, may take
            # seconds): wait for it rather than read the book a second time.
            with contextlib.suppress(StoreFailed):
                await reading
        await self._catch_up_book(self.store)
        followed, self._followed = self._followed, {}
        leases = list(followed.values())
        log.info("lease book taken over", leases=len(leases),
                 seconds=round(time.monotonic() - started, 3))
        return leases

    async def _catch_up_book(self, store: PgStateStore) -> None:
        """The changes since the last read: an active lease is kept, an ended one let
        go at once (as the leader's book does)."""
        cursor, changed = await store.lease_changes(self._follow_cursor)
        for lease in changed:
            if lease.state is LeaseState.ACTIVE:
                self._followed[lease.lease_id] = lease
            else:
                self._followed.pop(lease.lease_id, None)
        self._follow_cursor = cursor

    async def _follow_book(self, every: float = 1.0) -> None:
        """Standing by: follow the leader's lease book in the database, change by change
        (`PgStateStore.lease_changes`), so that a takeover does not read it whole."""
        store = self.store
        assert isinstance(store, PgStateStore)
        failing = False
        while True:
            # Shielded: a takeover cancels this task but takes over the read in flight.
            self._reading_book = asyncio.ensure_future(self._catch_up_book(store))
            try:
                await asyncio.shield(self._reading_book)
            except StoreFailed as exc:
                if not failing:
                    failing = True
                    log.warning("standing by: the lease book not followed; retrying",
                                detail=str(exc)[:300])
            else:
                failing = False
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
                async with connected(mqtt, client_id, session=False) as client:
                    async with asyncio.timeout(10):
                        await client.subscribe(self.topics.status, qos=1)
                    self.standby_mqtt = True
                    failures = 0
                    async for message in client.messages():
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
    on: code that waits with `asyncio.wait_for` may swallow a cancellation that arrives
    as the wait completes (CPython gh-86296 on Python 3.11), and one `cancel()` is then
    not enough."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=every)

