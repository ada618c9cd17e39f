"""Durable state in SQLite: the lease book, the event outbox and the market history.

One connection, used only from one dedicated thread, so SQLite never blocks the event
loop and writes are serialised. A lease change and the events it causes are committed
in one transaction: after a crash, either both are there or neither is.

WAL mode with `synchronous=FULL` by default: each commit is fsynced before it returns,
and the broker publishes a batch's events only after its commit, so nothing published is
lost on power loss (else a scheduler could act on a decision the restarted daemon never
made, and a re-sent `request_id` would get a second lease). That is one fsync per
placement batch (one transaction each, `broker.leasing.authority`); acknowledgement deletes are not
synced on their own (`StateStore.ack`). `state.synchronous: normal` skips the fsync:
it still survives a killed process, not a power loss.

One daemon per state file: `StateStore` holds an exclusive `flock` on `<file>.lock`
(holding the owner's pid) from open to close, so a second daemon on the same file fails
at start (`StateInUse`) instead of writing next to the first. The kernel releases it when
the process dies, however it dies. Read-only opens (`read_only=True`, `reader()`: the
CLI's read commands) take no lock and work while the daemon runs.

A commit or a lease lookup that SQLite refuses (disk full, I/O error, a read-only file,
`database is locked` after the 5 s busy timeout) raises `StoreFailed`: the broker cannot
keep its state, and stops (`broker.leasing.authority` says how).

The market history (`market_pools`, `market_changes`, `market_snapshots`) is written
and read by `broker.market.recorder`; its tables are created here with the rest of the schema.
They were added without a schema version bump: an older gpubroker ignores them.

`broker.state.pgstore` keeps the same tables on PostgreSQL (high availability); `Store` is the
interface both implement, and `open_store` picks one from the configuration. Schema
changes are versioned migrations (`meta.schema`), applied at open; a state written by a
newer gpubroker is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sqlite3
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from broker.model import Lease, iso
from broker.state.keyfilter import KeyFilter
from broker.state.schema import (
    INSERT_OUTBOX,
    MIGRATIONS,
    SCHEMA,
    SCHEMA_VERSION,
    UPSERT_LEASE,
    UPSERT_SCHEDSEQ,
    first_part,
    lease_from,
    lease_row,
    outbox_row,
    statements,
)
from broker.state.thread import OneThread
from broker.wire.messages import OutboxRow

T = TypeVar("T")

class Db(Protocol):
    """What the market recorder needs of a connection, on either engine: statements
    with `?` parameters, and explicit transactions (`begin`, `commit`, `rollback`).
    On PostgreSQL, `begin` also checks the leader's fencing epoch."""

    @property
    def in_transaction(self) -> bool: ...

    def execute(self, sql: str, args: Sequence[Any] = ..., /) -> Any: ...

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]], /) -> Any: ...

    def stream(self, sql: str, args: Sequence[Any] = ..., /) -> Iterator[Sequence[Any]]:
        """The rows of a query that may return many, a batch at a time rather than all
        at once (PostgreSQL: a server-side cursor, so only inside a transaction)."""

    def begin(self) -> None: ...

    def commit(self) -> None: ...

    def rollback(self) -> None: ...

    def close(self) -> None: ...


class SqliteDb(sqlite3.Connection):
    """An SQLite connection in autocommit mode (`isolation_level=None`) that also
    speaks `Db`: `begin` takes the write lock at once."""

    def begin(self) -> None:
        self.execute("BEGIN IMMEDIATE")

    def stream(self, sql: str, args: Sequence[Any] = (), /) -> Iterator[Sequence[Any]]:
        return iter(self.execute(sql, args))  # SQLite steps through the rows as read


def connect_sqlite(path: Path, *, read_only: bool = False) -> SqliteDb:
    if read_only:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True,
                             isolation_level=None, factory=SqliteDb)
        db.execute("PRAGMA query_only=1")
        return db
    return sqlite3.connect(path, isolation_level=None, check_same_thread=False,
                           factory=SqliteDb)


def db_errors(*also: type[Exception]) -> tuple[type[Exception], ...]:
    """The exceptions a database refusal raises, on either engine (and `also`).
    psycopg's only once it is imported: until then none of its errors can be raised
    (and a daemon on SQLite never loads it)."""
    psycopg = sys.modules.get("psycopg")
    if psycopg is None:
        return (sqlite3.Error, *also)
    return (sqlite3.Error, psycopg.Error, *also)


class StoreFailed(Exception):
    """The database refused a commit or a read of the lease book; the message names the
    file (or server) and the database's error. Fatal to the broker: its memory may be
    ahead of the store."""


class StateInUse(RuntimeError):
    """Another process holds the state file's lock: a second daemon on the same file.
    The message names the file, the holder's pid when it wrote one, and the lock file."""


class Deposed(StoreFailed):
    """Another node leads the site now (a higher fencing epoch): this one's commit was
    refused, or it could not renew its leadership in time. It stops at once, publishes
    nothing more and stands by again."""


class Store(Protocol):
    """The state store, on SQLite (`StateStore`) or PostgreSQL (`PgStateStore`)."""

    epoch: int
    """The fencing epoch this daemon commits with (0 without high availability)."""

    @property
    def name(self) -> str:
        """The file, or the server and database (no password), for messages."""

    def reader(self) -> Db:
        """A new read-only connection of its own, for another thread (history reads)."""

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def call(self, fn: Callable[[Db], T]) -> T: ...

    async def commit(self, leases: Iterable[Lease], rows: Sequence[OutboxRow],
                     schedseqs: Mapping[str, int] | None = None) -> list[OutboxRow]:
        """Lease changes, outbox rows and each scheduler's last `schedseq` after them,
        in one transaction; the rows with their ids."""

    async def schedseqs(self) -> dict[str, int]:
        """Each scheduler's last committed `schedseq`."""

    async def ack(self, ids: Sequence[int]) -> None: ...

    async def barrier(self) -> None: ...

    async def pending(self) -> list[OutboxRow]: ...

    async def leases(self, *, ended_since: datetime | None = None, state: str | None = None,
                     scheduler: str | None = None, request_id: str | None = None
                     ) -> list[Lease]: ...

    async def find_leases(self, keys: Sequence[tuple[str, str]]
                          ) -> dict[tuple[str, str], list[Lease]]:
        """Every lease of each of these (scheduler, request_id) keys that has any: one
        for a whole request, each part of a split one, in part order (head first)."""

    async def find_lease(self, scheduler: str, request_id: str) -> Lease | None:
        """The lease of a request, or of a split request its head (part 1)."""

    async def lease(self, lease_id: str) -> Lease | None:
        """One lease by its id, in any state."""

    async def ended_since(self, since: datetime, *, limit: int | None = None
                          ) -> list[tuple[str, str]]:
        """(scheduler, lease_id) of the leases that ended at or after `since`, the most
        recent first; at most `limit` of them."""



def lease_keys(db: Db) -> KeyFilter:
    """A filter of every (scheduler, request_id) the store holds a lease for (run it
    with `Store.call`; either engine). A split request's key is added once per part."""
    (count,) = db.execute("SELECT count(*) FROM leases").fetchone()
    keys = KeyFilter.sized_for(int(count))
    for scheduler, request_id in db.execute("SELECT scheduler, request_id FROM leases"):
        keys.add(scheduler, request_id)
    return keys


D = TypeVar("D", bound=Db)


class OneThreadStore(Generic[D]):
    """What both engines' stores share: one connection, used only from one dedicated
    thread (so the database never blocks the event loop and its work is serialised),
    and the reads that are the same SQL on both. A read the database refuses raises
    `StoreFailed`, naming the store (`_failed`)."""

    epoch = 0

    def __init__(self, thread_name: str) -> None:
        self._thread = OneThread(thread_name)
        self._db: D | None = None

    def _failed(self, what: str, exc: Exception) -> StoreFailed:
        raise NotImplementedError

    async def _run(self, fn: Callable[[D], T]) -> T:
        def call() -> T:
            assert self._db is not None, "store is not open"
            return fn(self._db)

        return await self._thread.run(call)

    async def _read(self, what: str, fn: Callable[[D], T]) -> T:
        try:
            return await self._run(fn)
        except db_errors() as exc:
            raise self._failed(what, exc) from exc

    async def call(self, fn: Callable[[D], T]) -> T:
        """Run `fn(connection)` on the store's thread, in order with every other store
        operation; for parts that keep their own tables (the market recorder). `fn` owns
        its transaction and must keep it short: lease commits wait behind it."""
        return await self._run(fn)

    async def barrier(self) -> None:
        """Return once every store operation submitted before it has completed (the
        store's one thread runs them in order)."""
        await self._run(lambda db: None)

    async def pending(self) -> list[OutboxRow]:
        """The outbox rows not acknowledged yet, in order."""
        def q(db: D) -> list[OutboxRow]:
            return [
                OutboxRow(t, bytes(p), qos, bool(ret), json.loads(pr) if pr else None, i)
                for i, t, p, qos, ret, pr in db.execute(
                    "SELECT id, topic, payload, qos, retain, props FROM outbox ORDER BY id")
            ]

        return await self._read("outbox read", q)

    async def schedseqs(self) -> dict[str, int]:
        def q(db: D) -> dict[str, int]:
            return {s: int(n) for s, n in db.execute("SELECT scheduler, last FROM schedseq")}

        return await self._read("schedseq read", q)

    async def leases(self, *, ended_since: datetime | None = None, state: str | None = None,
                     scheduler: str | None = None, request_id: str | None = None
                     ) -> list[Lease]:
        """Active leases, plus leases that ended at or after `ended_since`; only those
        in `state`, of `scheduler`, of `request_id` when given (the HTTP lease views)."""
        def q(db: D) -> list[Lease]:
            sql = "SELECT body FROM leases WHERE (state = 'active'"
            args: list[str] = []
            if ended_since is not None:
                sql += " OR updated_at >= ?"
                args.append(iso(ended_since))
            sql += ")"
            for column, value in (("state", state), ("scheduler", scheduler),
                                  ("request_id", request_id)):
                if value is not None:
                    sql += f" AND {column} = ?"
                    args.append(value)
            return [lease_from(json.loads(b)) for (b,) in db.execute(sql, args)]

        return await self._read("lease read", q)

    async def lease(self, lease_id: str) -> Lease | None:
        """One lease by its id, in any state (a verb or a view of a lease that has ended
        and left the lease book's memory)."""
        def q(db: D) -> Lease | None:
            row = db.execute("SELECT body FROM leases WHERE lease_id = ?",
                             (lease_id,)).fetchone()
            return None if row is None else lease_from(json.loads(row[0]))

        return await self._read("lease lookup", q)

    async def ended_since(self, since: datetime, *, limit: int | None = None
                          ) -> list[tuple[str, str]]:
        """(scheduler, lease_id) of the leases that ended at or after `since`, the most
        recent first, at most `limit` (None: all), read from the (state, updated_at)
        index: whose retained states a restore clears again, without their bodies."""
        sql = ("SELECT scheduler, lease_id FROM leases WHERE state IN "
               "('released', 'expired', 'failed') AND updated_at >= ? "
               "ORDER BY updated_at DESC, lease_id")
        args: tuple[Any, ...] = (iso(since),)
        if limit is not None:  # (SQLite reads no LIMIT NULL, PostgreSQL no LIMIT -1)
            sql, args = sql + " LIMIT ?", (*args, limit)

        def q(db: D) -> list[tuple[str, str]]:
            return [(s, i) for s, i in db.execute(sql, args)]

        return await self._read("lease read", q)


class StateStore(OneThreadStore[SqliteDb]):
    """The state store on SQLite (see the module docstring). `read_only`: for commands
    that only read while the daemon may run: no lock, no schema change (a file of a
    newer gpubroker is still refused), and every write fails."""

    def __init__(self, path: Path, *, synchronous: str = "full",
                 read_only: bool = False) -> None:
        super().__init__("sqlite")
        self.path = path
        self._synchronous = synchronous.upper()
        self._read_only = read_only
        self._lock_fd: int | None = None

    @property
    def name(self) -> str:
        return str(self.path)

    @property
    def lock_path(self) -> Path:
        """The lock file next to the state file. A separate file, since SQLite takes
        POSIX (fcntl) locks on the database file itself; it is never deleted (a process
        that opened it before a delete would lock an inode nobody else sees)."""
        return self.path.with_name(self.path.name + ".lock")

    def reader(self) -> SqliteDb:
        return connect_sqlite(self.path, read_only=True)

    def _lock(self) -> None:
        """Take the state file's lock for this store's lifetime, or raise `StateInUse`.
        The pid written into the lock file is only for the message: the lock is what
        counts (a stale pid in a file nobody locks is overwritten)."""
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.read(fd, 32).decode("ascii", "replace").strip()
            finally:
                os.close(fd)
            who = f"pid {holder}" if holder.isdigit() else "pid unknown"
            raise StateInUse(f"another gpubroker ({who}) is using it (lock {self.lock_path} "
                             "held); one daemon per state file") from None
        except BaseException:
            os.close(fd)
            raise
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the last descriptor releases the flock
            self._lock_fd = None

    async def open(self) -> None:
        def do_open() -> SqliteDb:
            if self._read_only:
                return self._open_read_only()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._lock()
            try:
                db = connect_sqlite(self.path)
            except BaseException:
                self._unlock()
                raise
            try:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute(f"PRAGMA synchronous={self._synchronous}")
                db.execute("PRAGMA busy_timeout=5000")
                # One transaction: the version is read before anything is created, so a
                # newer file is refused as it is (no table of an older schema added).
                db.begin()
                version = _schema_version(db)
                if version > SCHEMA_VERSION:
                    raise RuntimeError(
                        f"{self.path} was written by a newer gpubroker (schema {version}, "
                        f"this one knows {SCHEMA_VERSION})")
                for statement in statements(SCHEMA):
                    db.execute(statement)
                for v in range(version + 1, SCHEMA_VERSION + 1):
                    for statement in filter(str.strip, MIGRATIONS[v].split(";")):
                        db.execute(statement)
                db.execute("INSERT INTO meta VALUES ('schema', ?) ON CONFLICT(key) DO UPDATE "
                           "SET value=excluded.value", (str(max(version, SCHEMA_VERSION)),))
                db.commit()
            except BaseException:
                db.close()
                self._unlock()
                raise
            return db

        self._db = await self._thread.run(do_open)

    def _open_read_only(self) -> SqliteDb:
        db = connect_sqlite(self.path, read_only=True)
        try:
            db.execute("PRAGMA busy_timeout=5000")
            version = _schema_version(db)
            if version > SCHEMA_VERSION:
                raise RuntimeError(
                    f"{self.path} was written by a newer gpubroker (schema {version}, "
                    f"this one knows {SCHEMA_VERSION})")
        except BaseException:
            db.close()
            raise
        return db

    async def close(self) -> None:
        if self._db is not None:
            await self._run(lambda db: db.close())
            self._db = None
        self._unlock()
        self._thread.shutdown(wait=True)

    async def commit(self, leases: Iterable[Lease], rows: Sequence[OutboxRow],
                     schedseqs: Mapping[str, int] | None = None) -> list[OutboxRow]:
        """Write lease changes, outbox rows and the schedulers' last `schedseq` in one
        transaction; return the rows with their ids."""
        lease_rows = [lease_row(lease, 0) for lease in leases]
        seqs = list((schedseqs or {}).items())

        def tx(db: SqliteDb) -> list[OutboxRow]:
            out: list[OutboxRow] = []
            db.execute("BEGIN IMMEDIATE")
            try:
                db.executemany(UPSERT_LEASE, lease_rows)
                db.executemany(UPSERT_SCHEDSEQ, seqs)
                for r in rows:
                    cur = db.execute(INSERT_OUTBOX, outbox_row(r, 0))
                    out.append(OutboxRow(r.topic, r.payload, r.qos, r.retain, r.props,
                                         cur.lastrowid))
                db.execute("COMMIT")
            except BaseException:
                _end_failed(db)
                raise
            return out

        try:
            return await self._run(tx)
        except sqlite3.Error as exc:
            raise self._failed("commit", exc) from exc

    def _failed(self, what: str, exc: Exception) -> StoreFailed:
        name = getattr(exc, "sqlite_errorname", None)
        return StoreFailed(f"{self.path}: {what} failed: {exc}" + (f" ({name})" if name else ""))

    async def ack(self, ids: Sequence[int]) -> None:
        """Forget outbox rows the MQTT server has acknowledged."""
        if not ids:
            return

        def delete(db: SqliteDb) -> None:
            # One transaction, and not synced on its own: a delete that a power loss
            # takes back only sends the rows again at the next start (subscribers drop
            # duplicates by id). The next synced commit's fsync of the WAL covers it.
            # Only when the store syncs: at NORMAL there is nothing to switch.
            relax = self._synchronous == "FULL"
            if relax:
                db.execute("PRAGMA synchronous=NORMAL")
            try:
                db.execute("BEGIN IMMEDIATE")
                try:
                    for i in range(0, len(ids), 500):
                        chunk = ids[i:i + 500]
                        db.execute("DELETE FROM outbox WHERE id IN "
                                   f"({','.join('?' * len(chunk))})", chunk)
                    db.execute("COMMIT")
                except BaseException:
                    _end_failed(db)
                    raise
            finally:
                if relax:
                    db.execute("PRAGMA synchronous=FULL")

        await self._run(delete)

    async def find_leases(self, keys: Sequence[tuple[str, str]]
                          ) -> dict[tuple[str, str], list[Lease]]:
        """The leases of these (scheduler, request_id) keys that exist, every part of a
        split request in part order, a query per 250 keys."""
        unique = list(dict.fromkeys(keys))  # a key in two chunks would be read twice
        if not unique:
            return {}

        def q(db: SqliteDb) -> dict[tuple[str, str], list[Lease]]:
            out: dict[tuple[str, str], list[Lease]] = {}
            for i in range(0, len(unique), 250):
                chunk = unique[i:i + 250]
                where = " OR ".join("(scheduler=? AND request_id=?)" for _ in chunk)
                args = [x for k in chunk for x in k]
                for (b,) in db.execute(f"SELECT body FROM leases WHERE {where} "
                                       "ORDER BY part", args):
                    lease = lease_from(json.loads(b))
                    out.setdefault((lease.scheduler, lease.request_id), []).append(lease)
            return out

        return await self._read("lease lookup", q)

    async def find_lease(self, scheduler: str, request_id: str) -> Lease | None:
        return first_part(await self.find_leases([(scheduler, request_id)]), scheduler, request_id)


def _schema_version(db: SqliteDb) -> int:
    """The file's schema version (1 for a file without `meta`, or a new one)."""
    row = None
    if db.execute("SELECT count(*) FROM sqlite_master WHERE type='table' AND "
                  "name='meta'").fetchone()[0]:
        row = db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
    return 1 if row is None else int(row[0])


def _end_failed(db: SqliteDb) -> None:
    """Roll back a transaction that failed, if SQLite has not already (SQLITE_FULL,
    SQLITE_IOERR ... roll back by themselves): a second ROLLBACK would fail and hide the
    error that matters."""
    if db.in_transaction:
        with contextlib.suppress(sqlite3.Error):
            db.execute("ROLLBACK")
