"""Tests of the SQLite state store (`broker/store.py`): real files in tmp_path."""

from __future__ import annotations

import asyncio
import sqlite3
import sys
import textwrap
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from factories import T0, offer, placement, request

from broker.leases import LeaseBook
from broker.model import Lease, LeaseState, Market
from broker.store import OutboxRow, StateStore, StoreFailed


def lease(request_id: str = "r1", *, scheduler: str = "sched-a", at: float = 0,
          **req: Any) -> Lease:
    """A lease as the lease book makes it (times on whole milliseconds)."""
    book = LeaseBook()
    return book.create(request(request_id, scheduler=scheduler, **req),
                       placement(offer(), 2), lease_seconds=900, cap=3.5,
                       now=T0 + timedelta(seconds=at))


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[StateStore]:
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


async def test_a_lease_round_trips_exactly(store: StateStore) -> None:
    original = lease(
        "job-4711", gpu=("H100-80GB", "A100-80GB"), gang=False, market="spot",
        max_price_per_gpu_hour=3.5, clouds=("aws", "gcp"), regions=("us-east-1",),
        team="research", duration_hours=6.5, lease_seconds=900, labels={"job": "llm"})
    await store.commit([original], [])
    [back] = await store.leases()
    assert back == original
    assert back.placement.pool.market is Market.SPOT
    assert back.state is LeaseState.ACTIVE


async def test_a_lease_made_now_round_trips_exactly(store: StateStore) -> None:
    book = LeaseBook()
    original = book.create(request(), placement(offer(), 1), lease_seconds=900, cap=None,
                           now=T0.replace(microsecond=123456))
    await store.commit([original], [])
    assert await store.leases() == [original]


async def test_a_minimal_request_round_trips_exactly(store: StateStore) -> None:
    original = lease("bare")
    await store.commit([original], [])
    assert await store.find_lease("sched-a", "bare") == original


async def test_commit_updates_a_lease_in_place(store: StateStore) -> None:
    first = lease()
    await store.commit([first], [])
    moved = replace(first, epoch=2, placement=placement(offer("us-east-1b")),
                    updated_at=T0 + timedelta(seconds=5))
    await store.commit([moved], [])
    assert await store.leases() == [moved]


async def test_find_lease_by_scheduler_and_request_id(store: StateStore) -> None:
    a = lease("r1", scheduler="sched-a")
    b = lease("r1", scheduler="sched-b")
    ended = replace(lease("r2"), state=LeaseState.RELEASED)
    await store.commit([a, b, ended], [])
    assert await store.find_lease("sched-a", "r1") == a
    assert await store.find_lease("sched-b", "r1") == b
    assert await store.find_lease("sched-a", "r2") == ended  # ended leases are found too
    assert await store.find_lease("sched-c", "r1") is None


async def test_leases_lists_active_plus_recently_ended(store: StateStore) -> None:
    active = lease("active")
    old = replace(lease("old"), state=LeaseState.RELEASED, updated_at=T0)
    recent = replace(lease("recent"), state=LeaseState.EXPIRED,
                     updated_at=T0 + timedelta(hours=2))
    await store.commit([active, old, recent], [])
    assert await store.leases() == [active]
    since = await store.leases(ended_since=T0 + timedelta(hours=1))
    assert sorted(le.request_id for le in since) == ["active", "recent"]
    boundary = await store.leases(ended_since=T0 + timedelta(hours=2))
    assert sorted(le.request_id for le in boundary) == ["active", "recent"]
    everything = await store.leases(ended_since=T0 - timedelta(days=1))
    assert len(everything) == 3


# --- the outbox --------------------------------------------------------------------------


async def test_commit_returns_rows_with_ids_in_order(store: StateStore) -> None:
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


async def test_ack_removes_rows(store: StateStore) -> None:
    written = await store.commit([], [OutboxRow(f"t/{i}", b"x") for i in range(4)])
    await store.ack([written[0].id, written[2].id])  # type: ignore[list-item]
    assert [r.topic for r in await store.pending()] == ["t/1", "t/3"]
    await store.ack([])
    assert len(await store.pending()) == 2
    await store.ack([r.id for r in written])  # type: ignore[misc]
    assert await store.pending() == []


async def test_lease_and_rows_commit_together(store: StateStore) -> None:
    le = lease()
    await store.commit([le], [OutboxRow("t/ok", b"1")])
    # a clash on (scheduler, request_id) under another lease_id fails the whole commit
    clash = replace(lease(), lease_id="L-other")
    with pytest.raises(StoreFailed, match="commit failed: UNIQUE constraint failed") as err:
        await store.commit([clash], [OutboxRow("t/lost", b"2")])
    assert isinstance(err.value.__cause__, sqlite3.IntegrityError)
    assert [r.topic for r in await store.pending()] == ["t/ok"]
    assert await store.leases() == [le]


async def test_a_failing_row_rolls_back_the_lease(store: StateStore) -> None:
    le = lease()
    bad = OutboxRow("t/bad", object())  # type: ignore[arg-type]
    with pytest.raises(StoreFailed) as err:
        await store.commit([le], [OutboxRow("t/good", b"1"), bad])
    assert isinstance(err.value.__cause__, sqlite3.Error)
    assert await store.leases() == []
    assert await store.pending() == []
    # and the store still works afterwards
    await store.commit([le], [])
    assert await store.leases() == [le]


async def test_a_full_disk_fails_the_commit_naming_sqlites_error(store: StateStore) -> None:
    """A real SQLITE_FULL in WAL mode: SQLite rolls the transaction back itself, and the
    error that reaches the caller is that one (not a failed second ROLLBACK)."""
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


# --- durability --------------------------------------------------------------------------


async def test_state_is_back_after_reopening(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    first = await reopened(path)
    le = lease()
    written = await first.commit([le], [OutboxRow("t/a", b"1"), OutboxRow("t/b", b"2")])
    await first.ack([written[0].id])  # type: ignore[list-item]
    await first.close()
    second = await reopened(path)
    try:
        assert await second.leases() == [le]
        assert await second.pending() == written[1:]
    finally:
        await second.close()


async def test_committed_state_is_visible_without_a_clean_close(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    first = await reopened(path)
    try:
        le = lease()
        [row] = await first.commit([le], [OutboxRow("t/a", b"1", retain=True)])
        second = await reopened(path)  # the first one was never closed
        try:
            assert await second.leases() == [le]
            assert await second.pending() == [row]
        finally:
            await second.close()
    finally:
        await first.close()


async def test_committed_state_survives_a_killed_process(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    script = textwrap.dedent(f"""
        import asyncio, os, sys
        sys.path.insert(0, {str(Path(__file__).parent.parent)!r})
        from factories import T0, offer, placement, request
        from broker.leases import LeaseBook
        from broker.store import OutboxRow, StateStore

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


async def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    s = await reopened(path)
    await s.close()
    db = sqlite3.connect(path)
    with db:
        db.execute("UPDATE meta SET value='999' WHERE key='schema'")
    db.close()
    newer = StateStore(path)
    with pytest.raises(RuntimeError, match="newer"):
        await newer.open()
    await newer.close()


async def test_open_creates_missing_directories(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "state.db"
    s = await reopened(path)
    await s.close()
    assert path.exists()
