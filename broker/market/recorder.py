"""The market recorder: what the resource pool saw, change by change, in the state store.

For every pool the daemon polls, the recorder keeps the state it last recorded (GPU
model and count, price, availability, capacity, interruption rate, quota headroom) and
writes a row only when a poll shows something different, or a `gone` row when a pool
its slice used to offer is missing from that slice's poll. Read back in time order, the
rows are a market trace (`broker.market.traces`): `gpubroker history` exports them,
`gpubroker backtest` replays them.

**The hook.** The recorder subscribes to the resource pool (`ResourcePool.subscribe`):
a `PoolChange` carries the slice and every offer of its poll, which is all it needs. It
compares each offer with its own record, not with the pool's previous offer, because the
pool counts a new `observed_at` as a change and starts empty after a restart, while the
recorder starts from what it recorded. For the same reason it tracks which slice each
pool came from itself (gone = missing from its own slice's poll). The listener only
queues the poll (bounded; when full, the poll is dropped and the next poll of that slice
records whatever changed meanwhile), so it never holds up the poller or placement.

**Writes** run on the state store's one SQLite thread (`StateStore.call`), appended at
the end of the time-ordered table: the polls queued meanwhile in one short transaction
(`WRITE_MAX_OFFERS` offers at most), at most every `WRITE_EVERY_SECONDS` unless more
wait. The state store's thread and its durable commits are the lease decisions' too: a
transaction per polled slice (tens a second while a round comes in) held them back. The
recorder's memory of recorded states is used only on that thread, and a failed write
puts it back as it was, so that the next write records whatever changed since.
Recording is best effort: a failing write is logged once (and its recovery once), the
daemon goes on.

**Snapshots.** Once the change rows since the last snapshot outnumber the live pools
`snapshot_factor` times over, the recorder writes every live pool's state again, at one
`t` and in bounded chunks (kind 2, complete once listed in `market_snapshots`). A pool's
state at any time is then the latest snapshot before it plus the rows after that: at
most about `snapshot_factor + 1` rows per pool to read, with no per-pool index to keep
up on every write. Snapshots cost at most 1/`snapshot_factor` more rows.

**Retention.** At start-up and hourly, rows before the latest snapshot at or before the
cutoff (now − `state.market_history_days`) are deleted, from the start of the table in
bounded steps, each its own short transaction. Every pool's state at the cutoff is kept
(that snapshot and the rows after it), so history reaches a little further back than the
retention period, never less. Where history is complete from is kept in `meta`
(`market_pruned_before`); `HistoryReader.rows` never starts earlier.

After a restart, a pool that disappeared while the daemon was down gets its gone row at
the first poll of its cloud region that returns offers. The daemon's own downtime is not
marked: a trace carries the last recorded states across it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sqlite3
import struct
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import structlog

from broker.market.changes import PoolChange, SliceId
from broker.market.traces import TraceRow
from broker.model import Market, Offer, PoolKey, utcnow
from broker.state.store import Db, Store, StoreFailed, connect_sqlite, db_errors

log = structlog.get_logger("gpubroker.recorder")

SCALE = 1_000_000
"""Fractional signals are stored as integers × SCALE (see the schema in broker.state.store)."""
PRUNE_EVERY_SECONDS = 3600.0
QUEUE_SIZE = 1024
SNAPSHOT_FACTOR = 8.0
WRITE_EVERY_SECONDS = 0.25
"""The pause after each write, for the polls that come meanwhile to be written together
(history is kept to the second)."""
WRITE_MAX_OFFERS = 1_000
"""The offers of the polls written in one transaction, at most (one poll at least): the
transaction holds the state store's thread, some 17 µs an offer (50 ms for a 3,000)."""
# Rows per transaction when writing a snapshot, and when pruning (deletes from the start
# of the table are cheaper): a few milliseconds of the SQLite thread each
# (bench/recorder.py measures them).
SNAPSHOT_CHUNK_ROWS = 500
PRUNE_CHUNK_ROWS = 2000
_PRUNED_KEY = "market_pruned_before"
CHANGE, GONE, SNAPSHOT = 0, 1, 2  # market_changes.kind

# (price_e6, availability_e6, capacity, interruption_rate_e6, quota_headroom)
Values = tuple[int | None, int | None, int | None, int | None, int | None]
# One market_pools row: a pool key with the GPU model and count it is offered with.
_Ident = tuple[PoolKey, str, int]
_PoolInfo = tuple[PoolKey, str, int]


# A pool's recorded values packed into 40 bytes (`_pack`): one object instead of a tuple
# and its integers, some 100 bytes less for each of the tens of thousands of pools.
_PACKED = struct.Struct("<5q")
# A missing signal is INT64_MIN, which no cloud reports. SQLite's INTEGER has the same 64
# bits: a value it could store packs, one it could not fails the write either way.
_NONE = -(2 ** 63)


def _pack(values: Values) -> bytes:
    return _PACKED.pack(*(_NONE if v is None else v for v in values))


def _unpack(packed: bytes) -> Values:
    a, b, c, d, e = (None if v == _NONE else v for v in _PACKED.unpack(packed))
    return (a, b, c, d, e)


@dataclass(frozen=True, slots=True)
class _Recorded:
    """What the recorder last wrote of a pool: its market_pools row, the GPU model and
    count of that row, the values (`_pack`), and the slice whose polls offer it (`None`:
    read back at start-up and not polled since)."""
    pool_id: int
    gpu: str
    gpus: int
    packed: bytes
    slice: SliceId | None = None

    @property
    def values(self) -> Values:
        return _unpack(self.packed)


@dataclass(frozen=True, slots=True)
class _Poll:
    slice: SliceId
    t: int
    offers: Mapping[PoolKey, Offer]


def _e6(x: float | None) -> int | None:
    if x is None or not math.isfinite(x):
        return None
    return round(x * SCALE)


def _unscale(x: int | None) -> float | None:
    return None if x is None else x / SCALE


def values_of(offer: Offer) -> Values:
    """The recorded signals of `offer`: what counts as a change, at the stored
    resolution (10⁻⁶ USD per hour, 10⁻⁶ of availability and interruption rate)."""
    return (_e6(offer.price_per_hour), _e6(offer.availability), offer.capacity,
            _e6(offer.interruption_rate), offer.quota_headroom)


def epoch(t: datetime) -> int:
    return int(t.timestamp())


def from_epoch(t: int) -> datetime:
    return datetime.fromtimestamp(t, UTC)


_POOL_COLUMNS = "cloud, region, zone, instance_type, market, gpu, gpus"
_VALUE_COLUMNS = ("price_e6, availability_e6, capacity, interruption_rate_e6, "
                  "quota_headroom")
_INSERT_CHANGE = (
    "INSERT INTO market_changes VALUES (?,?,?,?,?,?,?,?) ON CONFLICT (t, pool_id) DO UPDATE "
    "SET price_e6=excluded.price_e6, availability_e6=excluded.availability_e6, "
    "capacity=excluded.capacity, interruption_rate_e6=excluded.interruption_rate_e6, "
    "quota_headroom=excluded.quota_headroom, kind=excluded.kind")


class _Book:
    """What the recorder has recorded, for comparing the next poll with. Filled once
    from a read-only connection before the first write, then used only on the store's
    thread.

    `live` holds every live pool's record (its row, values and slice); `ids` only the
    rows of pools that are not live as that row (gone, or offered since with another GPU
    model or count), should they come back: a live pool's row is in its record."""

    def __init__(self) -> None:
        self.ids: dict[_Ident, int] = {}
        self.live: dict[PoolKey, _Recorded] = {}
        self.slices: dict[SliceId, tuple[PoolKey, ...]] = {}  # read whole: no sets
        # Live pools read back at start-up whose slice is not known yet, by (cloud, region).
        self.unclaimed: dict[tuple[str, str], set[PoolKey]] = {}
        self.last_t = 0
        self.since_snapshot = 0  # change rows written since the last complete snapshot
        self.loaded = False  # read from the store (`load`)

    def load(self, source: Path | Callable[[], Db]) -> int:
        """Read back every pool's last recorded state; returns how many are live."""
        with HistoryReader(source) as reader:
            pools = reader.pools()
            state, self.since_snapshot, self.last_t = reader.state_at(None, pools)
        self.live = {}
        for pid in sorted(state):  # a later pool row of a key (new GPU) wins
            key, gpu, gpus = pools[pid]
            self.live[key] = _Recorded(pid, gpu, gpus, _pack(state[pid]))
        self.ids = {}
        for pid, (key, gpu, gpus) in pools.items():
            rec = self.live.get(key)
            if rec is None or rec.pool_id != pid:
                self.ids[(key, gpu, gpus)] = pid
        self.slices, self.unclaimed = {}, {}
        for key in self.live:
            self.unclaimed.setdefault((key.cloud, key.region), set()).add(key)
        self.loaded = True
        return len(self.live)

    def record(self, db: Db, polls: Sequence[_Poll]) -> int:
        """Write what changed in these slices' polls, in order, in one transaction;
        returns the rows written. The book follows each poll as it goes (the next one is
        compared with it); should the transaction fail, the book is put back as it was,
        so that the next write records whatever changed since."""
        rows: list[tuple[Any, ...]] = []
        undo = _Undo(self)
        db.begin()
        try:
            for poll in polls:
                self._record(db, poll, rows, undo)
            db.executemany(_INSERT_CHANGE, rows)
            db.commit()
        except BaseException:
            undo.restore(self)
            if db.in_transaction:
                db.rollback()
            raise
        self.since_snapshot += len(rows)
        return len(rows)

    def _record(self, db: Db, poll: _Poll, rows: list[tuple[Any, ...]], undo: _Undo
                ) -> None:
        """What changed in one slice's poll, added to `rows`; the book as after it, what
        it changed kept in `undo`."""
        t, offers = max(poll.t, self.last_t), poll.offers  # a clock step back keeps order
        slice_id, live = poll.slice, self.live
        new_ids: dict[_Ident, int] = {}
        updates: dict[PoolKey, _Recorded] = {}
        for key, offer in offers.items():
            values = values_of(offer)
            packed = _pack(values)
            prev = live.get(key)
            if prev is not None and prev.gpu == offer.gpu and prev.gpus == offer.gpus:
                if prev.packed != packed:
                    rows.append((t, prev.pool_id, *values, CHANGE))
                    updates[key] = _Recorded(prev.pool_id, prev.gpu, prev.gpus, packed,
                                             slice_id)
                elif prev.slice != slice_id:
                    updates[key] = _Recorded(prev.pool_id, prev.gpu, prev.gpus, packed,
                                             slice_id)
                continue
            ident = (key, offer.gpu, offer.gpus)
            pid = self.ids.get(ident) or new_ids.get(ident)
            if pid is None:
                pid = _pool_id(db, ident)
                new_ids[ident] = pid
            if prev is not None:
                # Same pool key, other GPU model or count: the old pool row ends here.
                rows.append((t, prev.pool_id, None, None, None, None, None, GONE))
            rows.append((t, pid, *values, CHANGE))
            updates[key] = _Recorded(pid, offer.gpu, offer.gpus, packed, slice_id)
        gone = [k for k in self.slices.get(slice_id, ())
                if k not in offers and (r := live.get(k)) is not None
                and r.slice == slice_id]
        regions = {(k.cloud, k.region) for k in offers} & self.unclaimed.keys()
        for region in regions:
            gone.extend(k for k in self.unclaimed[region] if k not in offers)
        rows.extend((t, live[k].pool_id, None, None, None, None, None, GONE)
                    for k in gone)
        ids = self.ids
        for key, rec in updates.items():
            prev = live.get(key)
            undo.keep(undo.live, live, key)
            if prev is not None and prev.pool_id != rec.pool_id:
                undo.keep(undo.ids, ids, (key, prev.gpu, prev.gpus))
                ids[(key, prev.gpu, prev.gpus)] = prev.pool_id
            undo.keep(undo.ids, ids, (key, rec.gpu, rec.gpus))
            ids.pop((key, rec.gpu, rec.gpus), None)
            live[key] = rec
        for k in gone:
            undo.keep(undo.live, live, k)
            prev = live.pop(k)
            undo.keep(undo.ids, ids, (k, prev.gpu, prev.gpus))
            ids[(k, prev.gpu, prev.gpus)] = prev.pool_id
        for region in regions:
            undo.keep(undo.unclaimed, self.unclaimed, region)
            del self.unclaimed[region]
        undo.keep(undo.slices, self.slices, slice_id)
        self.slices[slice_id] = tuple(offers)
        self.last_t = t

    def write(self, db: Db, polls: Sequence[_Poll], snapshot_factor: float
              ) -> tuple[int, float, bool]:
        """`record`, timed: the rows written, the seconds taken, and whether a snapshot
        is due (the change rows since the last one outnumber the live pools
        `snapshot_factor` times over)."""
        started = time.perf_counter()
        rows = self.record(db, polls)
        due = self.since_snapshot >= snapshot_factor * max(1, len(self.live))
        return rows, time.perf_counter() - started, due

    def capture(self) -> tuple[int, list[tuple[int, Values]], int]:
        """Every live pool's recorded state as of the last write, its time, and the
        change rows it covers (`snapshot_done` takes them off the count)."""
        entries = sorted((r.pool_id, r.values) for r in self.live.values())
        return self.last_t, entries, self.since_snapshot

    def snapshot_done(self, covered: int) -> None:
        self.since_snapshot -= covered


_ABSENT: Any = object()


class _Undo:
    """What a transaction of `_Book.record` changed in the book: each entry's value
    before it (`_ABSENT`: none), to put back should it fail."""

    def __init__(self, book: _Book) -> None:
        self.live: dict[PoolKey, Any] = {}
        self.ids: dict[_Ident, Any] = {}
        self.unclaimed: dict[tuple[str, str], Any] = {}
        self.slices: dict[SliceId, Any] = {}
        self.last_t = book.last_t

    @staticmethod
    def keep(kept: dict[Any, Any], table: dict[Any, Any], key: Any) -> None:
        """`table[key]` as it was before the transaction first changed it."""
        if key not in kept:
            kept[key] = table.get(key, _ABSENT)

    def restore(self, book: _Book) -> None:
        tables: tuple[tuple[dict[Any, Any], dict[Any, Any]], ...] = (
            (self.live, book.live), (self.ids, book.ids),
            (self.unclaimed, book.unclaimed), (self.slices, book.slices))
        for kept, table in tables:
            for key, was in kept.items():
                if was is _ABSENT:
                    table.pop(key, None)
                else:
                    table[key] = was
        book.last_t = self.last_t


def _pool_id(db: Db, ident: _Ident) -> int:
    key, gpu, gpus = ident
    args = (key.cloud, key.region, key.zone, key.instance_type, key.market.value, gpu, gpus)
    row = db.execute(
        f"INSERT INTO market_pools ({_POOL_COLUMNS}) VALUES (?,?,?,?,?,?,?) "
        "ON CONFLICT DO NOTHING RETURNING id", args).fetchone()
    if row is None:  # written by an earlier run that this one has not read back
        row = db.execute(
            "SELECT id FROM market_pools WHERE cloud=? AND region=? AND zone=? AND "
            "instance_type=? AND market=? AND gpu=? AND gpus=?", args).fetchone()
    return int(row[0])


def write_snapshot_chunk(db: Db, t: int, entries: list[tuple[int, Values]],
                         complete: bool) -> None:
    """Write part of a snapshot at `t`; the last part marks it complete. A row already
    at (t, pool) is a change in the same second, at least as new: it stays."""
    db.begin()
    try:
        db.executemany("INSERT INTO market_changes VALUES (?,?,?,?,?,?,?,?) "
                       "ON CONFLICT DO NOTHING",
                       [(t, pid, *values, SNAPSHOT) for pid, values in entries])
        if complete:
            db.execute("INSERT INTO market_snapshots VALUES (?) ON CONFLICT DO NOTHING", (t,))
        db.commit()
    except BaseException:
        if db.in_transaction:
            db.rollback()
        raise


def start_pruning(db: Db, cutoff: int) -> int | None:
    """Where pruning up to `cutoff` may delete to: the latest complete snapshot at or
    before it (None: none yet, nothing to prune). Records it as where history is
    complete from, before anything is deleted."""
    row = db.execute("SELECT max(t) FROM market_snapshots WHERE t <= ?", (cutoff,)).fetchone()
    if row is None or row[0] is None:
        return None
    keep_from = int(row[0])
    db.begin()
    try:
        db.execute(
            "INSERT INTO meta VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = "
            "CASE WHEN CAST(meta.value AS BIGINT) > CAST(excluded.value AS BIGINT) "
            "THEN meta.value ELSE excluded.value END",
            (_PRUNED_KEY, str(keep_from)))
        db.execute("DELETE FROM market_snapshots WHERE t < ?", (keep_from,))
        db.commit()
    except BaseException:
        if db.in_transaction:
            db.rollback()
        raise
    return keep_from


def prune_step(db: Db, keep_from: int, *, max_rows: int = PRUNE_CHUNK_ROWS
               ) -> tuple[bool, int]:
    """Delete up to `max_rows` of the oldest rows before `keep_from` (the table's first
    rows: neighbouring pages). Returns whether more remain, and the rows deleted."""
    db.begin()
    try:
        end = db.execute("SELECT t, pool_id FROM market_changes WHERE t < ? ORDER BY t, "
                         "pool_id LIMIT 1 OFFSET ?", (keep_from, max_rows - 1)).fetchone()
        if end is None:
            deleted = db.execute("DELETE FROM market_changes WHERE t < ?",
                                 (keep_from,)).rowcount
        else:
            deleted = db.execute("DELETE FROM market_changes WHERE (t, pool_id) <= (?, ?)",
                                 (end[0], end[1])).rowcount
        db.commit()
    except BaseException:
        if db.in_transaction:
            db.rollback()
        raise
    return end is not None, deleted


class MarketRecorder:
    """Records the resource pool's changes in the state store (see the module docstring).

    Wiring: `pool.subscribe(recorder.observe)`, then `run()` (writes) and
    `run_pruning()` (retention) as tasks of the daemon; `flush()` waits until every
    poll observed so far is written (shutdown, tests). `on_write(rows, seconds)` is told
    after each written poll how many rows it took and how long it held the SQLite
    thread (metrics, bench/recorder.py)."""

    def __init__(self, store: Store, *, retention_days: float,
                 clock: Callable[[], datetime] = utcnow, queue_size: int = QUEUE_SIZE,
                 prune_every_seconds: float = PRUNE_EVERY_SECONDS,
                 snapshot_factor: float = SNAPSHOT_FACTOR,
                 on_write: Callable[[int, float], None] | None = None) -> None:
        self.store = store
        self.retention = timedelta(days=retention_days)
        self.prune_every = prune_every_seconds
        self.snapshot_factor = snapshot_factor
        self.on_write = on_write
        self._clock = clock
        self._queue: asyncio.Queue[_Poll] = asyncio.Queue(maxsize=queue_size)
        self._now = asyncio.Event()  # set by `flush`: no pause before the next write
        self._book = _Book()
        self._failing = False
        self._dropping = False
        self.rows_written = 0
        self.polls_recorded = 0
        self.polls_dropped = 0
        self.snapshots = 0
        self.failures = 0

    def observe(self, change: PoolChange) -> None:
        """The pool listener: queue the slice's poll for writing. Never raises, never
        blocks; a full queue drops the poll (logged once until the queue has room)."""
        try:
            self._queue.put_nowait(_Poll(change.slice, epoch(self._clock()), change.offers))
        except asyncio.QueueFull:
            self.polls_dropped += 1
            if not self._dropping:
                self._dropping = True
                log.warning("market recorder behind; dropping polls", slice=list(change.slice))
            return
        if self._dropping:
            self._dropping = False
            log.info("market recorder caught up", dropped=self.polls_dropped)

    async def run(self) -> None:
        """Write queued polls, in order, forever: those queued meanwhile together (at
        most `WRITE_MAX_OFFERS` offers), at most every `WRITE_EVERY_SECONDS` unless
        more wait."""
        carry: _Poll | None = None  # taken from the queue, for the next write
        while True:
            polls = [carry if carry is not None else await self._queue.get()]
            carry, offers = None, len(polls[0].offers)
            while not self._queue.empty():
                poll = self._queue.get_nowait()
                if offers + len(poll.offers) > WRITE_MAX_OFFERS:
                    carry = poll
                    break
                polls.append(poll)
                offers += len(poll.offers)
            try:
                await self._write(polls)
            finally:
                for _ in polls:
                    self._queue.task_done()
            del polls
            if carry is not None:  # more waits
                continue
            if self._now.is_set():  # flushed: the next write at once
                self._now.clear()
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(WRITE_EVERY_SECONDS):
                    await self._now.wait()
            self._now.clear()

    async def flush(self) -> None:
        """Return once every poll queued before the call is written (or has failed):
        written at once, not after the pause between writes."""
        self._now.set()
        await self._queue.join()

    async def _write(self, polls: Sequence[_Poll]) -> None:
        book = self._book
        try:
            if not book.loaded:
                # A read-only connection of its own: the SQLite thread stays free.
                live = await asyncio.to_thread(book.load, self.store.reader)
                log.info("market history loaded", live_pools=live)
            rows, seconds, due = await self.store.call(
                partial(book.write, polls=polls, snapshot_factor=self.snapshot_factor))
            self.rows_written += rows
            self.polls_recorded += len(polls)
            if self.on_write is not None:
                self.on_write(rows, seconds)
            if due:
                await self._snapshot()
        except db_errors(StoreFailed) as exc:  # StoreFailed: Deposed, from the fence
            self._failed(exc)
        except Exception as exc:  # best effort: a recorder bug must not stop the daemon
            self._failed(exc, exc_info=True)
        else:
            if self._failing:
                self._failing = False
                log.info("market recording recovered")

    async def _snapshot(self) -> None:
        """Write every live pool's state, a chunk per transaction."""
        book = self._book
        t, entries, covered = await self.store.call(lambda db: book.capture())
        size = SNAPSHOT_CHUNK_ROWS
        for i in range(0, max(1, len(entries)), size):
            await self.store.call(partial(write_snapshot_chunk, t=t, entries=entries[i:i + size],
                                          complete=i + size >= len(entries)))
        await self.store.call(lambda db: book.snapshot_done(covered))
        self.snapshots += 1

    def _failed(self, exc: Exception, *, exc_info: bool = False) -> None:
        self.failures += 1
        if not self._failing:
            self._failing = True
            log.warning("market recording failing", error=type(exc).__name__,
                        detail=str(exc), exc_info=exc_info)

    async def prune(self, now: datetime | None = None) -> int:
        """Delete history older than the retention period needs (see the module
        docstring), in bounded steps; returns the rows deleted."""
        cutoff = epoch((now or self._clock()) - self.retention)
        keep_from = await self.store.call(partial(start_pruning, cutoff=cutoff))
        if keep_from is None:
            return 0
        total, more = 0, True
        while more:
            more, deleted = await self.store.call(partial(prune_step, keep_from=keep_from))
            total += deleted
        return total

    async def run_pruning(self) -> None:
        """Prune now, then every `prune_every` seconds; a failure waits for the next time."""
        while True:
            try:
                deleted = await self.prune()
            except db_errors() as exc:
                log.warning("market history pruning failed", error=type(exc).__name__,
                            detail=str(exc))
            else:
                if deleted:
                    log.info("market history pruned", rows=deleted)
            await asyncio.sleep(self.prune_every)


class HistoryReader:
    """The market history of a state file (or of the PostgreSQL database: a function
    that opens a read-only connection to it), read-only: safe while the daemon writes it
    (SQLite's WAL readers see the last committed state and never block the writer;
    PostgreSQL's readers never block writers either)."""

    def __init__(self, source: Path | Callable[[], Db]) -> None:
        self._db: Db = connect_sqlite(source, read_only=True) if isinstance(source, Path) \
            else source()
        self._pg = not isinstance(self._db, sqlite3.Connection)
        try:
            self.present = all(self._has(t) for t in (
                "meta", "market_pools", "market_changes", "market_snapshots"))
        except BaseException:
            self.close()
            raise

    def _has(self, table: str) -> bool:
        """Whether `table` exists (a file of another program, or an empty database)."""
        if self._pg:
            row = self._db.execute("SELECT to_regclass(?) IS NOT NULL", (table,)).fetchone()
        else:
            row = self._db.execute("SELECT count(*) FROM sqlite_master WHERE type='table' "
                                   "AND name=?", (table,)).fetchone()
        return bool(row and row[0])

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> HistoryReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def names(self, column: str) -> set[str]:
        """The distinct `gpu` or `cloud` values recorded."""
        if not self.present:
            return set()
        assert column in ("gpu", "cloud")
        return {v for (v,) in self._db.execute(f"SELECT DISTINCT {column} FROM market_pools")}

    def pruned_before(self) -> datetime | None:
        """Where the history is complete from after pruning (None: never pruned)."""
        if not self.present:
            return None
        row = self._db.execute("SELECT value FROM meta WHERE key=?", (_PRUNED_KEY,)).fetchone()
        return None if row is None else from_epoch(int(row[0]))

    def pools(self, where: str = "", args: Collection[str] = ()) -> dict[int, _PoolInfo]:
        """Pool rows by id (`where`: extra SQL conditions on `p`, see `_pool_filter`)."""
        if not self.present:
            return {}
        return {pid: (PoolKey(cloud, region, zone, itype, Market(mkt)), gpu, n)
                for pid, cloud, region, zone, itype, mkt, gpu, n in self._db.execute(
                    f"SELECT id, {_POOL_COLUMNS} FROM market_pools p WHERE 1=1{where}",
                    tuple(args))}

    def state_at(self, t: int | None, pools: Collection[int]
                 ) -> tuple[dict[int, Values], int, int]:
        """The recorded state of `pools` that were live at `t` (None: now): the latest
        complete snapshot at or before `t`, then the rows after it. Returns the states by
        pool id, the change rows read after the snapshot, and the last row's time."""
        state: dict[int, Values] = {}
        if not self.present:
            return state, 0, 0
        bound = 2**62 if t is None else t
        row = self._db.execute("SELECT max(t) FROM market_snapshots WHERE t <= ?",
                               (bound,)).fetchone()
        base = -1 if row is None or row[0] is None else int(row[0])
        changes, last = 0, 0
        for when, pid, *values, kind in self._db.execute(
                f"SELECT t, pool_id, {_VALUE_COLUMNS}, kind FROM market_changes "
                "WHERE t >= ? AND t <= ? ORDER BY t, pool_id", (base, bound)):
            last = when
            if kind != SNAPSHOT:
                changes += 1
            if pid not in pools:
                continue
            if kind == GONE:
                state.pop(pid, None)
            else:
                state[pid] = (values[0], values[1], values[2], values[3], values[4])
        return state, changes, last

    def rows(self, *, since: datetime | None = None, until: datetime | None = None,
             gpus: Collection[str] = (), clouds: Collection[str] = (),
             market: Market | None = None) -> Iterator[TraceRow]:
        """The trace of [since, until), streamed in time order.

        A trace that starts at a time (`since`, or where pruning left the history
        complete, whichever is later) opens with every pool's state as of then, stamped
        with that time, so a replay from there knows every pool; then come the changes
        after it. The filters select pools by GPU model, cloud and market (gone rows
        included: the pool row knows its GPU)."""
        if not self.present:
            return
        # One read transaction: the pools, the opening states and the changes all come
        # from the same snapshot, whatever the daemon commits meanwhile.
        self._db.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY" if self._pg
                         else "BEGIN")
        try:
            yield from self._rows(since, until, *_pool_filter(gpus, clouds, market))
        finally:
            self._db.commit()

    def _rows(self, since: datetime | None, until: datetime | None, where: str,
              args: list[str]) -> Iterator[TraceRow]:
        pruned = self.pruned_before()
        if pruned is not None and (since is None or since < pruned):
            since = pruned
        lo = None if since is None else epoch(since)
        hi = None if until is None else epoch(until)
        if lo is not None and hi is not None and hi <= lo:
            return
        pools = self.pools(where, args)
        if lo is not None:
            start = from_epoch(lo)
            state = self.state_at(lo, pools)[0]
            for pid in sorted(state):
                yield _trace_row(start, pools[pid], state[pid], CHANGE)
        sql = (f"SELECT t, pool_id, {_VALUE_COLUMNS}, kind FROM market_changes "
               f"WHERE kind != {SNAPSHOT}")
        bounds: list[int | str] = []
        if lo is not None:
            sql += " AND t > ?"
            bounds.append(lo)
        if hi is not None:
            sql += " AND t < ?"
            bounds.append(hi)
        if where:
            # `+` keeps SQLite on the time-ordered scan: the rows stream, unsorted.
            sql += f" AND +pool_id IN (SELECT id FROM market_pools p WHERE 1=1{where})"
            bounds.extend(args)
        last_t, when = -1, from_epoch(0)
        for t, pid, price, avail, cap, rate, quota, kind in self._db.stream(
                f"{sql} ORDER BY t, pool_id", bounds):
            if t != last_t:  # rows come in time order, many at the same second
                last_t, when = t, from_epoch(t)
            yield _trace_row(when, pools[pid], (price, avail, cap, rate, quota), kind)


def _pool_filter(gpus: Collection[str], clouds: Collection[str], market: Market | None
                 ) -> tuple[str, list[str]]:
    where, args = "", list[str]()
    if gpus:
        where += f" AND p.gpu IN ({','.join('?' * len(gpus))})"
        args.extend(gpus)
    if clouds:
        where += f" AND p.cloud IN ({','.join('?' * len(clouds))})"
        args.extend(clouds)
    if market is not None:
        where += " AND p.market = ?"
        args.append(market.value)
    return where, args


def _trace_row(t: datetime, pool: _PoolInfo, values: Values, kind: int) -> TraceRow:
    key, gpu, gpus = pool
    if kind == GONE:
        return TraceRow(t=t, pool=key, gone=True)
    price, avail, cap, rate, quota = values
    return TraceRow(t=t, pool=key, gpu=gpu, gpus=gpus, price_per_hour=_unscale(price),
                    availability=_unscale(avail), capacity=cap,
                    interruption_rate=_unscale(rate), quota_headroom=quota)
