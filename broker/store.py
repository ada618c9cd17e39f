"""Durable state in SQLite: the lease book, the event outbox and the market history.

One connection, used only from one dedicated thread, so SQLite never blocks the event
loop and writes are serialised. A lease change and the events it causes are committed
in one transaction: after a crash, either both are there or neither is.

WAL mode; `synchronous=NORMAL` by default, which survives a killed process (the
daemon's crash mode) but may lose the last transactions on power loss. Set
`state.synchronous: full` to survive that too, at the cost of an fsync per commit.

A commit or a lease lookup that SQLite refuses (disk full, I/O error, a read-only file,
`database is locked` after the 5 s busy timeout) raises `StoreFailed`: the broker cannot
keep its state, and stops (`broker.core` says how).

The market history (`market_pools`, `market_changes`, `market_snapshots`) is written
and read by `broker.recorder`; its tables are created here with the rest of the schema.
They were added without a schema version bump: an older gpubroker ignores them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from broker.model import Lease, LeaseState, Placement, PlaceRequest, iso, parse_iso

T = TypeVar("T")

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    lease_id   TEXT PRIMARY KEY,
    scheduler  TEXT NOT NULL,
    request_id TEXT NOT NULL,
    state      TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    body       TEXT NOT NULL,
    UNIQUE (scheduler, request_id)
);
CREATE INDEX IF NOT EXISTS leases_state ON leases (state, updated_at);
CREATE TABLE IF NOT EXISTS outbox (
    id       INTEGER PRIMARY KEY AUTOINCREMENT,
    topic    TEXT NOT NULL,
    payload  BLOB NOT NULL,
    qos      INTEGER NOT NULL,
    retain   INTEGER NOT NULL,
    props    TEXT
);
-- The market history (broker/recorder.py). A pool row is one pool key together with the
-- GPU model and count it was offered with. A change row is that pool's full state from
-- `t` (epoch seconds) until its next row: kind 0 a change, 1 gone, 2 part of a snapshot
-- of every live pool (complete once its `t` is in market_snapshots). Fractional signals
-- are integers scaled by 10^6 (price in micro-USD per instance-hour), which SQLite packs
-- into 3-4 bytes where a REAL takes 8; NULL is unknown. Clustered on (t, pool_id), so
-- rows are appended in time order and exports and pruning read and delete sequentially;
-- there is deliberately no per-pool index (it would cost a page write per row).
CREATE TABLE IF NOT EXISTS market_pools (
    id            INTEGER PRIMARY KEY,
    cloud         TEXT NOT NULL,
    region        TEXT NOT NULL,
    zone          TEXT NOT NULL,
    instance_type TEXT NOT NULL,
    market        TEXT NOT NULL,
    gpu           TEXT NOT NULL,
    gpus          INTEGER NOT NULL,
    UNIQUE (cloud, region, zone, instance_type, market, gpu, gpus)
);
CREATE TABLE IF NOT EXISTS market_changes (
    t                    INTEGER NOT NULL,
    pool_id              INTEGER NOT NULL,
    price_e6             INTEGER,
    availability_e6      INTEGER,
    capacity             INTEGER,
    interruption_rate_e6 INTEGER,
    quota_headroom       INTEGER,
    kind                 INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (t, pool_id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS market_snapshots (t INTEGER PRIMARY KEY);
"""


class StoreFailed(Exception):
    """SQLite refused a commit or a read of the lease book; the message names the file
    and SQLite's error. Fatal to the broker: its memory may be ahead of the store."""


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """One MQTT message waiting to be acknowledged by the MQTT server.

    `props` holds MQTT 5 extras (`response_topic`-style replies carry
    `correlation_data` as hex); `id` is None until the row is committed."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = False
    props: dict[str, Any] | None = None
    id: int | None = None


class StateStore:
    def __init__(self, path: Path, *, synchronous: str = "normal") -> None:
        self.path = path
        self._synchronous = synchronous
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite")
        self._db: sqlite3.Connection | None = None

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        def call() -> T:
            assert self._db is not None, "store is not open"
            return fn(self._db)

        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    async def call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run `fn(connection)` on the store's thread, in order with every other store
        operation; for parts that keep their own tables (the market recorder). `fn` owns
        its transaction and must keep it short: lease commits wait behind it."""
        return await self._run(fn)

    async def open(self) -> None:
        def do_open() -> sqlite3.Connection:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(f"PRAGMA synchronous={self._synchronous.upper()}")
            db.execute("PRAGMA busy_timeout=5000")
            db.executescript(_SCHEMA)
            row = db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
            if row is None:
                db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) > SCHEMA_VERSION:
                db.close()
                raise RuntimeError(
                    f"{self.path} was written by a newer gpubroker (schema {row[0]})")
            return db

        loop = asyncio.get_running_loop()
        self._db = await loop.run_in_executor(self._executor, do_open)

    async def close(self) -> None:
        if self._db is not None:
            await self._run(lambda db: db.close())
            self._db = None
        self._executor.shutdown(wait=True)

    async def commit(self, leases: Iterable[Lease], rows: Sequence[OutboxRow]
                     ) -> list[OutboxRow]:
        """Write lease changes and outbox rows in one transaction; return the rows with
        their ids."""
        lease_rows = [_lease_row(lease) for lease in leases]

        def tx(db: sqlite3.Connection) -> list[OutboxRow]:
            out: list[OutboxRow] = []
            db.execute("BEGIN IMMEDIATE")
            try:
                db.executemany(
                    "INSERT INTO leases VALUES (?,?,?,?,?,?) ON CONFLICT(lease_id) DO UPDATE "
                    "SET state=excluded.state, updated_at=excluded.updated_at, "
                    "body=excluded.body", lease_rows)
                for r in rows:
                    cur = db.execute(
                        "INSERT INTO outbox (topic, payload, qos, retain, props) "
                        "VALUES (?,?,?,?,?)",
                        (r.topic, r.payload, r.qos, int(r.retain),
                         json.dumps(r.props) if r.props else None))
                    out.append(OutboxRow(r.topic, r.payload, r.qos, r.retain, r.props,
                                         cur.lastrowid))
                db.execute("COMMIT")
            except BaseException:
                # SQLite may have rolled back already (SQLITE_FULL, SQLITE_IOERR ...); a
                # second ROLLBACK would fail and hide the error that matters.
                if db.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        db.execute("ROLLBACK")
                raise
            return out

        try:
            return await self._run(tx)
        except sqlite3.Error as exc:
            raise self._failed("commit", exc) from exc

    def _failed(self, what: str, exc: sqlite3.Error) -> StoreFailed:
        name = getattr(exc, "sqlite_errorname", None)
        return StoreFailed(f"{self.path}: {what} failed: {exc}" + (f" ({name})" if name else ""))

    async def ack(self, ids: Sequence[int]) -> None:
        """Forget outbox rows the MQTT server has acknowledged."""
        if not ids:
            return

        def delete(db: sqlite3.Connection) -> None:
            for i in range(0, len(ids), 500):
                chunk = ids[i:i + 500]
                db.execute(f"DELETE FROM outbox WHERE id IN ({','.join('?' * len(chunk))})",
                           chunk)

        await self._run(delete)

    async def barrier(self) -> None:
        """Return once every store operation submitted before it has completed (the
        store's one thread runs them in order)."""
        await self._run(lambda db: None)

    async def pending(self) -> list[OutboxRow]:
        def q(db: sqlite3.Connection) -> list[OutboxRow]:
            return [
                OutboxRow(t, bytes(p), qos, bool(ret), json.loads(pr) if pr else None, i)
                for i, t, p, qos, ret, pr in db.execute(
                    "SELECT id, topic, payload, qos, retain, props FROM outbox ORDER BY id")
            ]

        return await self._run(q)

    async def leases(self, *, ended_since: datetime | None = None) -> list[Lease]:
        """Active leases, plus leases that ended at or after `ended_since`."""
        def q(db: sqlite3.Connection) -> list[Lease]:
            sql = "SELECT body FROM leases WHERE state = 'active'"
            args: tuple[str, ...] = ()
            if ended_since is not None:
                sql += " OR updated_at >= ?"
                args = (iso(ended_since),)
            return [_lease_from(json.loads(b)) for (b,) in db.execute(sql, args)]

        return await self._run(q)

    async def find_leases(self, keys: Sequence[tuple[str, str]]
                          ) -> dict[tuple[str, str], Lease]:
        """The leases of these (scheduler, request_id) keys that exist, in one query."""
        if not keys:
            return {}

        def q(db: sqlite3.Connection) -> dict[tuple[str, str], Lease]:
            out: dict[tuple[str, str], Lease] = {}
            for i in range(0, len(keys), 250):
                chunk = keys[i:i + 250]
                where = " OR ".join("(scheduler=? AND request_id=?)" for _ in chunk)
                args = [x for k in chunk for x in k]
                for (b,) in db.execute(f"SELECT body FROM leases WHERE {where}", args):
                    lease = _lease_from(json.loads(b))
                    out[(lease.scheduler, lease.request_id)] = lease
            return out

        try:
            return await self._run(q)
        except sqlite3.Error as exc:
            raise self._failed("lease lookup", exc) from exc

    async def find_lease(self, scheduler: str, request_id: str) -> Lease | None:
        def q(db: sqlite3.Connection) -> Lease | None:
            row = db.execute("SELECT body FROM leases WHERE scheduler=? AND request_id=?",
                             (scheduler, request_id)).fetchone()
            return _lease_from(json.loads(row[0])) if row else None

        return await self._run(q)


def _lease_row(lease: Lease) -> tuple[str, str, str, str, str, str]:
    body = lease.to_json()
    body["request"] = lease.request.to_json()
    return (lease.lease_id, lease.scheduler, lease.request_id, lease.state.value,
            iso(lease.updated_at), json.dumps(body, separators=(",", ":")))


def _lease_from(d: dict[str, Any]) -> Lease:
    request = PlaceRequest.from_json(d["scheduler"], d["request"])
    return Lease(
        lease_id=d["lease_id"],
        scheduler=d["scheduler"],
        request_id=d["request_id"],
        request=request,
        placement=Placement.from_json(d["placement"]),
        epoch=d["epoch"],
        state=LeaseState(d["state"]),
        created_at=parse_iso(d["created_at"]),
        expires_at=parse_iso(d["expires_at"]),
        lease_seconds=d["lease_seconds"],
        max_price_per_gpu_hour=d["max_price_per_gpu_hour"],
        updated_at=parse_iso(d["updated_at"]),
    )
