"""Tests of the state store on both engines: every test of the `Store` interface runs on
SQLite (`broker/state/store.py`, a real file in tmp_path) and on PostgreSQL
(`broker/state/pgstore.py`, a fresh database of the local server); then SQLite's own tests
(a full disk, a killed process, directories, migrating a schema-1 file).
PostgreSQL's own tests (migrations, sites, fencing) are in test_pgstore.py."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import sys
import textwrap
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from factories import T0, offer, owned, placement, request

from broker.leasing.book import LeaseBook
from broker.model import Lease, LeaseState, Market
from broker.state.schema import ENDED_DETAIL, SCHEMA_VERSION, lease_row
from broker.state.store import (
    Db,
    StateInUse,
    StateStore,
    Store,
    StoreFailed,
    db_errors,
    lease_keys,
)
from broker.wire.messages import OutboxRow


def lease(request_id: str = "r1", *, scheduler: str = "sched-a", at: float = 0,
          **req: Any) -> Lease:
    """A lease as the lease book makes it (times on whole milliseconds)."""
    book = LeaseBook()
    return book.create(request(request_id, scheduler=scheduler, **req),
                       placement(offer(), 2), lease_seconds=900, cap=3.5,
                       now=T0 + timedelta(seconds=at))


def end(le: Lease, state: LeaseState, at: datetime | None = None) -> Lease:
    """`le` ended (as the lease book ends it: its reason and time kept), at `at` or at
    its last change."""
    at = at or le.updated_at
    return replace(le, state=state, updated_at=at, ended_reason=state.value, ended_at=at)


def split(request_id: str = "s1", parts: int = 3, *, scheduler: str = "sched-a") -> list[Lease]:
    """The leases of a request split over `parts` pools (what the lease book makes of a
    request with gang false and max_parts > 1): the same key, parts 1..n, each part's
    request for its own GPUs, every part listing all parts' lease ids."""
    whole = request(request_id, scheduler=scheduler, gang=False, gpus=8 * parts)
    made = [replace(lease(request_id, scheduler=scheduler), lease_id=f"L-{request_id}-{k}",
                    request=replace(whole, gpus=8), part=k,
                    placement=placement(offer(f"us-east-1{'abcdefgh'[k - 1]}")))
            for k in range(1, parts + 1)]
    ids = tuple(le.lease_id for le in made)
    return [replace(le, parts=ids) for le in made]


@dataclass
class Engine:
    """Where a test's state lives, on one engine: `make()` gives a new store on it."""

    name: str
    make: Callable[[], Store]
    beside: Callable[[], Store]
    """A store to open while another is open on the same state: on SQLite a read-only
    one (one writer per file: the lock); on PostgreSQL another node's."""

    async def opened(self) -> Store:
        s = self.make()
        await s.open()
        return s


@pytest.fixture(params=["sqlite", "postgresql"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Engine:
    if request.param == "sqlite":
        path = tmp_path / "state" / "state.db"
        return Engine("sqlite", lambda: StateStore(path),
                      lambda: StateStore(path, read_only=True))
    from broker.state.pgstore import PgStateStore

    url = request.getfixturevalue("pg_url")
    return Engine("postgresql", lambda: PgStateStore(url, site="test"),
                  lambda: PgStateStore(url, site="test"))


@pytest.fixture
async def store(engine: Engine) -> AsyncIterator[Store]:
    s = await engine.opened()
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
async def sqlite_store(tmp_path: Path) -> AsyncIterator[StateStore]:
    s = StateStore(tmp_path / "state" / "state.db")
    await s.open()
    try:
        yield s
    finally:
        await s.close()


async def reopened(path: Path) -> StateStore:
    s = StateStore(path)
    await s.open()
    return s


# --- leases ------------------------------------------------------------------------------


async def test_a_lease_round_trips_exactly(store: Store) -> None:
    original = lease(
        "job-4711", gpu=("H100-80GB", "A100-80GB"), gang=False, market="spot",
        max_price_per_gpu_hour=3.5, clouds=("aws", "gcp"), regions=("us-east-1",),
        team="research", duration_hours=6.5, lease_seconds=900, labels={"job": "llm"})
    await store.commit([original], [])
    [back] = await store.leases()
    assert back == original
    assert back.placement.pool.market is Market.SPOT
    assert back.state is LeaseState.ACTIVE


async def test_a_lease_on_paid_for_capacity_keeps_its_targets(store: Store) -> None:
    """A lease on private servers or a reservation keeps which ones it was given (a
    restarted daemon holds them again: no second lease gets the same server)."""
    on_servers = replace(placement(owned(servers=["gpu-a01", "gpu-a02"]), 2),
                         targets=(("gpu-a01", 1), ("gpu-a02", 1)))
    original = LeaseBook().create(request("owned", market="reserved"), on_servers,
                                  lease_seconds=900, cap=None, now=T0)
    await store.commit([original], [])
    [back] = await store.leases()
    assert back == original and back.placement.pool.market is Market.RESERVED
    assert back.placement.targets == (("gpu-a01", 1), ("gpu-a02", 1))


async def test_a_lease_made_now_round_trips_exactly(store: Store) -> None:
    book = LeaseBook()
    original = book.create(request(), placement(offer(), 1), lease_seconds=900, cap=None,
                           now=T0.replace(microsecond=123456))
    await store.commit([original], [])
    assert await store.leases() == [original]


async def test_a_minimal_request_round_trips_exactly(store: Store) -> None:
    original = lease("bare")
    await store.commit([original], [])
    assert await store.find_lease("sched-a", "bare") == original


async def test_commit_updates_a_lease_in_place(store: Store) -> None:
    first = lease()
    await store.commit([first], [])
    moved = replace(first, epoch=2, placement=placement(offer("us-east-1b")),
                    updated_at=T0 + timedelta(seconds=5))
    await store.commit([moved], [])
    assert await store.leases() == [moved]


async def test_find_lease_by_scheduler_and_request_id(store: Store) -> None:
    a = lease("r1", scheduler="sched-a")
    b = lease("r1", scheduler="sched-b")
    ended = end(lease("r2"), LeaseState.RELEASED)
    await store.commit([a, b, ended], [])
    assert await store.find_lease("sched-a", "r1") == a
    assert await store.find_lease("sched-b", "r1") == b
    assert await store.find_lease("sched-a", "r2") == ended  # ended leases are found too
    assert await store.find_lease("sched-c", "r1") is None


async def test_leases_lists_active_plus_recently_ended(store: Store) -> None:
    active = lease("active")
    old = end(lease("old"), LeaseState.RELEASED, T0)
    recent = end(lease("recent"), LeaseState.EXPIRED, T0 + timedelta(hours=2))
    await store.commit([active, old, recent], [])
    assert await store.leases() == [active]
    since = await store.leases(ended_since=T0 + timedelta(hours=1))
    assert sorted(le.request_id for le in since) == ["active", "recent"]
    boundary = await store.leases(ended_since=T0 + timedelta(hours=2))
    assert sorted(le.request_id for le in boundary) == ["active", "recent"]
    everything = await store.leases(ended_since=T0 - timedelta(days=1))
    assert len(everything) == 3


async def test_ended_since_gives_the_most_recent_first_and_at_most_the_limit(
        store: Store) -> None:
    """What a restore clears again: ended leases of a window, as (scheduler, lease_id),
    the most recent first, capped (a start's work is bounded whatever the churn)."""
    active = lease("active")
    ended = [end(lease(f"e{h}", scheduler=f"sched-{h % 2}"), LeaseState.RELEASED,
                 T0 + timedelta(hours=h)) for h in range(5)]
    await store.commit([active, *ended], [])
    newest_first = [(le.scheduler, le.lease_id) for le in reversed(ended)]
    assert await store.ended_since(T0) == newest_first
    assert await store.ended_since(T0, limit=2) == newest_first[:2]
    assert await store.ended_since(T0 + timedelta(hours=3)) == newest_first[:2]
    assert await store.ended_since(T0 + timedelta(hours=9), limit=10) == []


async def test_leases_by_state_scheduler_and_request_id(store: Store) -> None:
    """The HTTP lease views' reads: the filters go to the database."""
    a = lease("r1", scheduler="sched-a")
    b = end(lease("r1", scheduler="sched-b"), LeaseState.RELEASED, T0 + timedelta(hours=2))
    c = end(lease("r2", scheduler="sched-a"), LeaseState.EXPIRED, T0 + timedelta(hours=2))
    old = end(lease("r3", scheduler="sched-a"), LeaseState.RELEASED, T0)
    await store.commit([a, b, c, old], [])
    since = T0 + timedelta(hours=1)
    assert await store.leases(ended_since=since, state="released") == [b]
    assert await store.leases(ended_since=since, state="active") == [a]
    assert sorted(le.lease_id for le in await store.leases(
        ended_since=since, scheduler="sched-a")) == sorted([a.lease_id, c.lease_id])
    assert sorted(le.scheduler for le in await store.leases(
        ended_since=since, request_id="r1")) == ["sched-a", "sched-b"]
    assert await store.leases(ended_since=since, scheduler="sched-a", request_id="r3") == []
    assert await store.leases(ended_since=T0, scheduler="sched-a", request_id="r3") == [old]


async def test_one_lease_by_id_and_the_ended_since(store: Store) -> None:
    """What answers a verb on a lease that left the book's memory, and what a reconnect
    clears again: read by id, and (scheduler, lease_id) of the leases ended since."""
    active = lease("active")
    released = end(lease("released", scheduler="sched-b"), LeaseState.RELEASED,
                   T0 + timedelta(hours=2))
    failed = end(lease("failed"), LeaseState.FAILED, T0 + timedelta(hours=3))
    old = end(lease("old"), LeaseState.EXPIRED, T0)
    await store.commit([active, released, failed, old], [])
    assert await store.lease(released.lease_id) == released
    assert await store.lease(old.lease_id) == old  # whatever its age
    assert await store.lease(active.lease_id) == active
    assert await store.lease("L-none") is None
    got = await store.ended_since(T0 + timedelta(hours=2))
    assert sorted(got) == sorted([("sched-b", released.lease_id),
                                  ("sched-a", failed.lease_id)])
    assert len(await store.ended_since(T0)) == 3  # never the active one
    assert await store.ended_since(T0 + timedelta(hours=4)) == []


async def test_a_split_lease_round_trips_with_its_parts(store: Store) -> None:
    parts = split("s1", 3)
    whole = lease("w1")
    # Committed out of order: the lookups give the parts in part order all the same.
    await store.commit([parts[2], whole, parts[0], parts[1]], [])
    assert sorted(await store.leases(), key=lambda le: (le.request_id, le.part)) == [
        *parts, whole]
    assert [(le.part, le.parts) for le in parts] == [
        (k, ("L-s1-1", "L-s1-2", "L-s1-3")) for k in (1, 2, 3)]
    key = ("sched-a", "s1")
    # A key asked for twice is still found once.
    assert await store.find_leases([key, ("sched-a", "w1"), key, ("sched-a", "none")]) == {
        key: parts, ("sched-a", "w1"): [whole]}
    assert await store.find_lease("sched-a", "s1") == parts[0]  # the head
    assert await store.find_lease("sched-a", "w1") == whole
    assert await store.call(lambda db: sorted(db.execute(
        "SELECT lease_id, part FROM leases").fetchall())) == sorted([
        ("L-s1-1", 1), ("L-s1-2", 2), ("L-s1-3", 3), (whole.lease_id, 0)])
    # A part's update stays that part.
    ended = end(parts[1], LeaseState.RELEASED, T0 + timedelta(hours=1))
    await store.commit([ended], [])
    assert await store.find_leases([key]) == {key: [parts[0], ended, parts[2]]}


async def test_a_requests_parts_are_unique_per_part(store: Store) -> None:
    one, two = split("s1", 2)
    await store.commit([one], [])
    await store.commit([two], [])  # the same key, another part: accepted
    again = replace(two, lease_id="L-s1-again")
    with pytest.raises(StoreFailed, match=r"commit failed: .*(UNIQUE|unique)"):
        await store.commit([again], [OutboxRow("t/lost", b"1")])
    assert await store.find_leases([("sched-a", "s1")]) == {("sched-a", "s1"): [one, two]}
    assert await store.pending() == []


async def test_the_key_filter_holds_split_requests(store: Store) -> None:
    await store.commit([*split("s1", 3), lease("w1")], [])
    keys = await store.call(lease_keys)
    assert keys.may_hold("sched-a", "s1") and keys.may_hold("sched-a", "w1")
    assert not keys.full


# --- the outbox --------------------------------------------------------------------------


async def test_commit_returns_rows_with_ids_in_order(store: Store) -> None:
    rows = [OutboxRow("p/events/s/a", b"1"),
            OutboxRow("p/leases/s/L", b"", retain=True),
            OutboxRow("reply/here", b"\x00\xff", qos=0,
                      props={"response_topic": "reply/here", "correlation_data": "ab01"})]
    written = await store.commit([], rows)
    ids = [r.id for r in written if r.id is not None]
    assert len(set(ids)) == 3
    assert ids == sorted(ids)
    assert [replace(r, id=None) for r in written] == rows
    assert await store.pending() == written


async def test_ack_removes_rows(store: Store) -> None:
    written = await store.commit([], [OutboxRow(f"t/{i}", b"x") for i in range(4)])
    await store.ack([written[0].id, written[2].id])  # type: ignore[list-item]
    assert [r.topic for r in await store.pending()] == ["t/1", "t/3"]
    await store.ack([])
    assert len(await store.pending()) == 2
    await store.ack([r.id for r in written])  # type: ignore[misc]
    assert await store.pending() == []


async def test_lease_and_rows_commit_together(store: Store) -> None:
    le = lease()
    await store.commit([le], [OutboxRow("t/ok", b"1")])
    # a clash on (scheduler, request_id) under another lease_id fails the whole commit
    clash = replace(lease(), lease_id="L-other")
    with pytest.raises(StoreFailed, match=r"commit failed: .*(UNIQUE|unique)") as err:
        await store.commit([clash], [OutboxRow("t/lost", b"2")])
    assert store.name in str(err.value)
    assert type(err.value.__cause__).__name__ in ("IntegrityError", "UniqueViolation")
    assert [r.topic for r in await store.pending()] == ["t/ok"]
    assert await store.leases() == [le]


async def test_a_failing_row_rolls_back_the_lease(store: Store) -> None:
    le = lease()
    bad = OutboxRow("t/bad", object())  # type: ignore[arg-type]
    with pytest.raises(StoreFailed) as err:
        await store.commit([le], [OutboxRow("t/good", b"1"), bad])
    assert isinstance(err.value.__cause__, db_errors())
    assert await store.leases() == []
    assert await store.pending() == []
    # and the store still works afterwards
    await store.commit([le], [])
    assert await store.leases() == [le]


async def test_ids_keep_growing_after_acks_and_reopening(engine: Engine) -> None:
    """An acknowledged row's id is never handed out again (the bus tells rows apart by
    id), not even after the rows are gone and the store reopened."""
    first = await engine.opened()
    try:
        written = await first.commit([], [OutboxRow("t/a", b"1"), OutboxRow("t/b", b"2")])
        await first.ack([r.id for r in written if r.id is not None])
    finally:
        await first.close()
    second = await engine.opened()
    try:
        [later] = await second.commit([], [OutboxRow("t/c", b"3")])
        assert later.id is not None and later.id > max(r.id or 0 for r in written)
    finally:
        await second.close()


async def test_call_runs_in_order_with_commits(store: Store) -> None:
    """`call` (the recorder's way in) runs on the store's connection, after every
    operation submitted before it, with `?` parameters on both engines."""
    def count(db: Db) -> int:
        return int(db.execute("SELECT count(*) FROM leases WHERE scheduler = ? AND "
                              "state = ?", ("sched-a", "active")).fetchone()[0])

    # gather starts its tasks in order: the five commits are submitted first.
    *_, counted = await asyncio.gather(*(store.commit([lease(f"r{i}")], []) for i in range(5)),
                                       store.call(count))
    assert counted == 5
    await store.barrier()
    assert await store.call(lambda db: db.in_transaction) is False


async def test_find_leases_looks_up_many_keys_at_once(store: Store) -> None:
    leases = [lease(f"r{i}", scheduler=f"s{i % 3}") for i in range(600)]
    await store.commit(leases, [])
    keys = [(le.scheduler, le.request_id) for le in leases[::2]] + [("s0", "missing")]
    found = await store.find_leases(keys)
    assert found == {(le.scheduler, le.request_id): [le] for le in leases[::2]}
    assert await store.find_leases([]) == {}


async def test_outbox_rows_keep_their_bytes_and_extras(store: Store) -> None:
    payload = bytes(range(256)) * 4
    rows = [OutboxRow("t/%s?x", payload, qos=2, retain=True,
                      props={"correlation_data": "00ff", "response_topic": "r/é"})]
    written = await store.commit([], rows)
    [back] = await store.pending()
    assert back == written[0]
    assert back.payload == payload and back.topic == "t/%s?x"


async def test_the_leader_epoch_is_0_without_high_availability(store: Store) -> None:
    assert store.epoch == 0
    await store.commit([lease()], [OutboxRow("t/a", b"1")])
    epochs = await store.call(lambda db: (
        db.execute("SELECT leader_epoch FROM leases").fetchall(),
        db.execute("SELECT leader_epoch FROM outbox").fetchall()))
    assert epochs == ([(0,)], [(0,)])


# --- durability --------------------------------------------------------------------------


async def test_state_is_back_after_reopening(engine: Engine) -> None:
    first = await engine.opened()
    le = lease()
    written = await first.commit([le], [OutboxRow("t/a", b"1"), OutboxRow("t/b", b"2")])
    await first.ack([written[0].id])  # type: ignore[list-item]
    await first.close()
    second = await engine.opened()
    try:
        assert await second.leases() == [le]
        assert await second.pending() == written[1:]
    finally:
        await second.close()


async def test_committed_state_is_visible_without_a_clean_close(engine: Engine) -> None:
    first = await engine.opened()
    try:
        le = lease()
        [row] = await first.commit([le], [OutboxRow("t/a", b"1", retain=True)])
        second = engine.beside()  # the first one was never closed
        await second.open()
        try:
            assert await second.leases() == [le]
            assert await second.pending() == [row]
        finally:
            await second.close()
    finally:
        await first.close()


async def test_a_newer_schema_is_refused(engine: Engine) -> None:
    s = await engine.opened()
    await s.call(lambda db: db.execute("UPDATE meta SET value = ? WHERE key = 'schema'",
                                       ("999",)))
    await s.close()
    newer = engine.make()
    with pytest.raises(RuntimeError, match=rf"newer gpubroker \(schema 999, this one knows "
                                           rf"{SCHEMA_VERSION}\)"):
        await newer.open()
    await newer.close()
    # The refusal changed nothing: still refused.
    again = engine.make()
    with pytest.raises(RuntimeError, match="schema 999"):
        await again.open()
    await again.close()


# --- SQLite only ----------------------------------------------------------------------------


async def test_a_full_disk_fails_the_commit_naming_sqlites_error(sqlite_store: StateStore
                                                                 ) -> None:
    """A real SQLITE_FULL in WAL mode: SQLite rolls the transaction back itself, and the
    error that reaches the caller is that one (not a failed second ROLLBACK)."""
    store = sqlite_store
    kept = lease("r1")
    await store.commit([kept], [OutboxRow("t/ok", b"1")])
    await store.call(fill_up)
    with pytest.raises(StoreFailed, match=r"commit failed: database or disk is full "
                                          r"\(SQLITE_FULL\)") as err:
        await store.commit([lease("r2")], [OutboxRow("t/big", b"x" * 20_000)])
    assert isinstance(err.value.__cause__, sqlite3.OperationalError)
    assert str(store.path) in str(err.value)
    assert await store.leases() == [kept]
    assert [r.topic for r in await store.pending()] == ["t/ok"]


def fill_up(db: sqlite3.Connection) -> None:
    """Make the file as full as it may get: no free pages, no room to grow (the limit is
    this connection's, so a reopened store has room again)."""
    db.execute("VACUUM")
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    db.execute(f"PRAGMA max_page_count = {pages}")


async def test_committed_state_survives_a_killed_process(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    script = textwrap.dedent(f"""
        import asyncio, os, sys
        sys.path.insert(0, {str(Path(__file__).parents[1] / "support")!r})
        from factories import T0, offer, owned, placement, request
        from broker.leasing.book import LeaseBook
        from broker.state.store import StateStore
        from broker.wire.messages import OutboxRow

        async def main():
            store = StateStore(__import__("pathlib").Path({str(path)!r}))
            await store.open()
            lease = LeaseBook().create(request("crash"), placement(offer(), 2),
                                       lease_seconds=900, cap=3.5, now=T0)
            await store.commit([lease], [OutboxRow("t/crash", b"1")])
            os._exit(9)  # no close, no flush: a crash

        asyncio.run(main())
    """)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    _, stderr = await proc.communicate()
    assert proc.returncode == 9, stderr.decode()
    store = await reopened(path)
    try:
        [le] = await store.leases()
        assert le.request_id == "crash"
        assert le.placement == placement(offer(), 2)
        assert [r.topic for r in await store.pending()] == ["t/crash"]
    finally:
        await store.close()


# The schema as release 1 wrote it (broker/state/store.py before the leader epochs): no
# leader_epoch columns, meta schema '1'.
_SCHEMA_1 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE leases (
    lease_id   TEXT PRIMARY KEY,
    scheduler  TEXT NOT NULL,
    request_id TEXT NOT NULL,
    state      TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    body       TEXT NOT NULL,
    UNIQUE (scheduler, request_id)
);
CREATE INDEX leases_state ON leases (state, updated_at);
CREATE TABLE outbox (
    id       INTEGER PRIMARY KEY AUTOINCREMENT,
    topic    TEXT NOT NULL,
    payload  BLOB NOT NULL,
    qos      INTEGER NOT NULL,
    retain   INTEGER NOT NULL,
    props    TEXT
);
CREATE TABLE market_pools (
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
CREATE TABLE market_changes (
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
CREATE TABLE market_snapshots (t INTEGER PRIMARY KEY);
INSERT INTO meta VALUES ('schema', '1');
"""


def columns(path: Path, table: str) -> list[str]:
    db = sqlite3.connect(path)
    try:
        return [r[1] for r in db.execute(f"PRAGMA table_info({table})")]
    finally:
        db.close()


async def test_a_schema_1_file_is_migrated_and_keeps_its_state(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    kept = lease("old-one")
    db = sqlite3.connect(path)
    db.executescript(_SCHEMA_1)
    with db:
        db.execute("INSERT INTO leases VALUES (?,?,?,?,?,?)", lease_row(kept, 0)[:6])
        db.execute("INSERT INTO outbox (topic, payload, qos, retain, props) "
                   "VALUES ('t/old', x'01', 1, 1, NULL)")
        db.execute("INSERT INTO market_snapshots VALUES (1700000000)")
    db.close()
    assert "leader_epoch" not in columns(path, "leases")

    store = await reopened(path)
    try:
        assert await store.leases() == [kept]
        [row] = await store.pending()
        assert (row.topic, row.payload, row.retain) == ("t/old", b"\x01", True)
        assert await store.call(lambda db: db.execute(
            "SELECT value FROM meta WHERE key='schema'").fetchone()[0]) == str(SCHEMA_VERSION)
        assert await store.call(lambda db: db.execute(
            "SELECT lease_id, leader_epoch, part FROM leases").fetchall()) == [
            (kept.lease_id, 0, 0)]
        # The new column is written from now on.
        moved = replace(kept, epoch=2, updated_at=T0 + timedelta(seconds=5))
        await store.commit([moved], [OutboxRow("t/new", b"2")])
        assert await store.find_lease("sched-a", "old-one") == moved
    finally:
        await store.close()
    assert "leader_epoch" in columns(path, "leases")
    assert "leader_epoch" in columns(path, "outbox")
    # The market history and everything else is still there; opening again is a no-op.
    again = await reopened(path)
    try:
        assert [r.topic for r in await again.pending()] == ["t/old", "t/new"]
        assert await again.call(lambda db: db.execute(
            "SELECT t FROM market_snapshots").fetchall()) == [(1700000000,)]
        assert await again.call(lambda db: db.execute(
            "SELECT value FROM meta WHERE key='schema'").fetchall()) == [(str(SCHEMA_VERSION),)]
    finally:
        await again.close()
    assert schema(path) == schema(await new_file(tmp_path / "new.db"))


# Schema 2 as release 2 wrote it (broker/state/store.py before the lease parts): schema 1 and
# the leader epochs, each request's key unique.
_SCHEMA_2 = _SCHEMA_1.replace("'1'", "'2'") + """
ALTER TABLE leases ADD COLUMN leader_epoch INTEGER NOT NULL DEFAULT 0;
ALTER TABLE outbox ADD COLUMN leader_epoch INTEGER NOT NULL DEFAULT 0;
"""


def schema(path: Path) -> list[tuple[str, str, str]]:
    """Every table's and index's definition, as SQLite keeps it."""
    db = sqlite3.connect(path)
    try:
        return db.execute("SELECT type, name, sql FROM sqlite_master WHERE name NOT LIKE "
                          "'sqlite_%' ORDER BY name").fetchall()
    finally:
        db.close()


async def new_file(path: Path) -> Path:
    s = await reopened(path)
    await s.close()
    return path


async def test_a_schema_2_file_is_migrated_keeps_its_leases_and_takes_parts(
        tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    kept = lease("old-one")
    ended = end(lease("old-two", at=1), LeaseState.RELEASED)
    db = sqlite3.connect(path)
    db.executescript(_SCHEMA_2)
    with db:
        db.executemany("INSERT INTO leases VALUES (?,?,?,?,?,?,?)",
                       [lease_row(kept, 4)[:7], lease_row(ended, 5)[:7]])
        db.execute("INSERT INTO outbox (topic, payload, qos, retain, props, leader_epoch) "
                   "VALUES ('t/old', x'01', 1, 1, NULL, 4)")
    db.close()
    assert "part" not in columns(path, "leases")

    store = await reopened(path)
    try:
        assert await store.leases(ended_since=T0) == [kept, ended]
        assert await store.find_leases([("sched-a", "old-one"), ("sched-a", "old-two")]) == {
            ("sched-a", "old-one"): [kept], ("sched-a", "old-two"): [ended]}
        assert [r.topic for r in await store.pending()] == ["t/old"]
        assert await store.call(lambda db: db.execute(
            "SELECT lease_id, leader_epoch, part FROM leases ORDER BY lease_id").fetchall()
        ) == sorted([(kept.lease_id, 4, 0), (ended.lease_id, 5, 0)])
        assert await store.call(lambda db: db.execute(
            "SELECT value FROM meta WHERE key='schema'").fetchone()[0]) == str(SCHEMA_VERSION)
        # The key is unique per part now: a split request's parts are kept.
        parts = split("s1", 3)
        await store.commit(parts, [])
        assert await store.find_leases([("sched-a", "s1")]) == {("sched-a", "s1"): parts}
        assert await store.find_lease("sched-a", "s1") == parts[0]
        with pytest.raises(StoreFailed, match="UNIQUE"):
            await store.commit([replace(kept, lease_id="L-other")], [])
    finally:
        await store.close()
    # The same tables and indexes as a new file's, the state index among them.
    assert schema(path) == schema(await new_file(tmp_path / "new.db"))
    assert ("index", "leases_state") in [(t, n) for t, n, _ in schema(path)]
    again = await reopened(path)
    try:
        assert len(await again.leases(ended_since=T0)) == 5
    finally:
        await again.close()


async def test_a_schema_5_file_is_migrated_and_its_ended_leases_say_how_they_ended(
        tmp_path: Path) -> None:
    """Schema 6 (contract 1.1) keeps how a lease ended in its record. A lease that ended
    under schema 5 gets its state as its reason and its last change as its end; a failed
    one `ended` (its failover reason was in no record)."""
    path = tmp_path / "state.db"
    active = lease("on")
    released = end(lease("off", at=1), LeaseState.RELEASED)
    failed = end(lease("gone", at=2), LeaseState.FAILED)
    store = await reopened(path)
    try:
        await store.commit([active, released, failed], [])
    finally:
        await store.close()
    db = sqlite3.connect(path)
    with db:  # what a schema-5 daemon wrote: no end in the records
        db.execute("UPDATE leases SET body = json_remove(body, '$.ended_reason', "
                   "'$.ended_detail', '$.ended_at')")
        db.execute("UPDATE meta SET value = '5' WHERE key = 'schema'")
    assert "ended_at" not in str(db.execute("SELECT body FROM leases").fetchall())
    db.close()

    store = await reopened(path)
    try:
        got = {le.request_id: le for le in await store.leases(ended_since=T0)}
        assert await store.call(lambda db: db.execute(
            "SELECT value FROM meta WHERE key='schema'").fetchone()[0]) == str(SCHEMA_VERSION)
    finally:
        await store.close()
    assert got == {"on": active, "off": released,
                   "gone": replace(failed, ended_reason="ended", ended_detail=ENDED_DETAIL)}
    assert got["off"].ended_at == T0 + timedelta(seconds=1)
    assert got["gone"].to_json()["ended_reason"] == "ended"


def tables(path: Path) -> set[str]:
    db = sqlite3.connect(path)
    try:
        return {n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    finally:
        db.close()


async def test_a_newer_schema_leaves_the_file_alone(tmp_path: Path) -> None:
    """Refused before anything is written: not even a table the newer schema has done
    away with (here the outbox) comes back."""
    path = tmp_path / "state.db"
    db = sqlite3.connect(path)
    db.executescript(_SCHEMA_1.replace("'1'", f"'{SCHEMA_VERSION + 1}'"))
    db.executescript("DROP TABLE outbox")
    db.close()
    before = tables(path)
    with pytest.raises(RuntimeError, match=rf"{path} was written by a newer gpubroker "
                                           rf"\(schema {SCHEMA_VERSION + 1}, this one "
                                           rf"knows {SCHEMA_VERSION}\)"):
        await reopened(path)
    assert tables(path) == before and "outbox" not in before
    assert "leader_epoch" not in columns(path, "leases")


async def test_a_new_file_gets_every_table_at_once(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    s = await reopened(path)
    await s.close()
    assert tables(path) == {"meta", "leases", "outbox", "market_pools", "market_changes",
                            "market_snapshots", "sqlite_sequence", "schedseq"}
    assert "leader_epoch" in columns(path, "outbox")
    assert columns(path, "leases")[-2:] == ["leader_epoch", "part"]


async def test_open_creates_missing_directories(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "state.db"
    s = await reopened(path)
    await s.close()
    assert path.exists()


# --- durability and one writer per file (#26) -------------------------------------------


def synchronous(db: Db) -> int:
    return int(db.execute("PRAGMA synchronous").fetchone()[0])


async def test_every_commit_is_synced_by_default(tmp_path: Path) -> None:
    """FULL (2): a commit is on disk before the broker publishes what it decided. An
    acknowledgement delete is not synced on its own, and the connection is back at FULL
    after it."""
    store = await reopened(tmp_path / "state.db")
    try:
        assert await store.call(synchronous) == 2
        rows = await store.commit([lease()], [OutboxRow("t/a", b"1"), OutboxRow("t/b", b"2")])
        await store.ack([r.id for r in rows if r.id is not None])
        assert await store.pending() == []
        assert await store.call(synchronous) == 2
    finally:
        await store.close()
    relaxed = StateStore(tmp_path / "state.db", synchronous="normal")
    await relaxed.open()
    try:
        assert await relaxed.call(synchronous) == 1
    finally:
        await relaxed.close()


async def test_a_second_writer_on_the_same_file_is_refused_until_the_first_closes(
        tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    first = await reopened(path)
    try:
        kept = lease()
        await first.commit([kept], [])
        second = StateStore(path)
        with pytest.raises(StateInUse) as err:
            await second.open()
        await second.close()
        assert str(err.value) == (f"another gpubroker (pid {os.getpid()}) is using it (lock "
                                  f"{path}.lock held); one daemon per state file")
        # Readers take no lock: the CLI's read commands work next to the daemon.
        reader = StateStore(path, read_only=True)
        await reader.open()
        try:
            assert await reader.leases() == [kept]
            with pytest.raises(StoreFailed, match="readonly"):
                await reader.commit([lease("r2")], [])
        finally:
            await reader.close()
        # The first is untouched by the refused open.
        await first.commit([lease("r3")], [])
    finally:
        await first.close()
    again = await reopened(path)
    try:
        assert {le.request_id for le in await again.leases()} == {"r1", "r3"}
    finally:
        await again.close()


async def test_the_lock_dies_with_a_killed_process(tmp_path: Path) -> None:
    """kill -9 of the holder: the kernel releases the lock, and the next store opens. While
    it lives, the refusal names its pid."""
    path = tmp_path / "state.db"
    script = textwrap.dedent(f"""
        import asyncio, pathlib, sys
        sys.path.insert(0, {str(Path(__file__).parent.parent.parent)!r})
        from broker.state.store import StateStore

        async def main():
            store = StateStore(pathlib.Path({str(path)!r}))
            await store.open()
            print("open", flush=True)
            await asyncio.Event().wait()

        asyncio.run(main())
    """)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(20):
            line = await proc.stdout.readline()
        assert line == b"open\n", (await proc.stderr.read()).decode() if proc.stderr else ""
        refused = StateStore(path)
        with pytest.raises(StateInUse, match=rf"\(pid {proc.pid}\)"):
            await refused.open()
        await refused.close()
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGKILL)
        await proc.wait()
    assert proc.returncode == -signal.SIGKILL
    store = await reopened(path)
    await store.close()
