"""Tests of the market recorder (`broker/market/recorder.py`): a real ResourcePool feeding a real
state store; the recorded rows read back through HistoryReader. The recorder's own tests
run on both engines (an SQLite file in tmp_path, a fresh PostgreSQL database); those of
the daemon on SQLite."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import pg_helpers
import pytest
import yaml
from daemon_helpers import StartDaemon
from factories import SLICE, Clock, offer
from hypothesis import given
from hypothesis import strategies as st
from mqtt_helpers import ProbeFactory, payload_json
from structlog.testing import capture_logs

from broker.daemon.assembly import Daemon
from broker.daemon.config import Config, HttpConfig, StateConfig
from broker.market.changes import SliceId
from broker.market import recorder as recording
from broker.market.pool import ResourcePool
from broker.market.recorder import (
    HistoryReader,
    MarketRecorder,
    Values,
    _pack,
    _unpack,
    epoch,
    prune_step,
    start_pruning,
)
from broker.market.traces import TraceRow, format_t, read_trace
from broker.model import Market, Offer
from broker.state.store import StateStore, Store

GCP: SliceId = ("sim", "gcp:us-central1")
DAY = 86400.0


def gcp(zone: str = "us-central1-a", **kw: Any) -> Offer:
    return offer(zone, cloud="gcp", region="us-central1", instance_type="a3-highgpu-8g", **kw)


Where = Path | str
"""Where a state lives: an SQLite file, or a PostgreSQL database's URL."""


def store_at(where: Where) -> Store:
    if isinstance(where, Path):
        return StateStore(where)
    from broker.state.pgstore import PgStateStore

    return PgStateStore(where, site="test")


def reader_of(where: Where) -> HistoryReader:
    if isinstance(where, Path):
        return HistoryReader(where)
    from broker.state.pgstore import PgStateStore

    return HistoryReader(PgStateStore(where, site="test").reader)  # as `gpubroker history`


@dataclass
class Rig:
    """A pool, a store and a recorder, wired as the daemon wires them."""

    where: Where
    clock: Clock
    store: Store
    pool: ResourcePool
    recorder: MarketRecorder
    task: asyncio.Task[None]

    async def poll(self, offers: Iterable[Offer], slice_id: SliceId = SLICE,
                   after: float = 60) -> None:
        """One poll of `slice_id`, `after` seconds after the last one; waits for the write."""
        self.clock.advance(after)
        self.pool.replace(slice_id, [replace(o, observed_at=self.clock()) for o in offers])
        async with asyncio.timeout(10):
            await self.recorder.flush()

    def rows(self, **kw: Any) -> list[TraceRow]:
        with reader_of(self.where) as reader:
            return list(reader.rows(**kw))

    async def count(self) -> int:
        n = await self.store.call(
            lambda db: db.execute("SELECT count(*) FROM market_changes").fetchone()[0])
        return int(n)


@contextlib.asynccontextmanager
async def rig_at(where: Where, clock: Clock | None = None, **kw: Any) -> AsyncIterator[Rig]:
    clock = clock or Clock()
    store = store_at(where)
    await store.open()
    pool = ResourcePool(stale_after_seconds=1e9, clock=clock)
    recorder = MarketRecorder(store, retention_days=kw.pop("retention_days", 14), clock=clock,
                              **kw)
    pool.subscribe(recorder.observe)
    rig = Rig(where, clock, store, pool, recorder, asyncio.create_task(recorder.run()))
    try:
        yield rig
    finally:
        rig.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await rig.task
        await rig.store.close()  # the store a test may have put in its place too
        if rig.store is not store:
            await store.close()


class Places:
    """New, empty places for a state on one engine (`engine`): `new()`."""

    def __init__(self, engine: str, tmp_path: Path, stack: contextlib.ExitStack) -> None:
        self.engine = engine
        self._tmp = tmp_path
        self._stack = stack
        self._made = 0

    def new(self) -> Where:
        self._made += 1
        if self.engine == "sqlite":
            return self._tmp / f"state-{self._made}.db"
        return self._stack.enter_context(pg_helpers.fresh_database())


@pytest.fixture(params=["sqlite", "postgresql"])
def places(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Places]:
    if request.param == "postgresql" and (why := pg_helpers.available()) is not None:
        pytest.fail(why, pytrace=False)
    with contextlib.ExitStack() as stack:
        yield Places(request.param, tmp_path, stack)


@pytest.fixture
async def rig(places: Places) -> AsyncIterator[Rig]:
    async with rig_at(places.new()) as r:
        yield r


def state(row: TraceRow) -> tuple[Any, ...]:
    return (row.pool.zone, row.price_per_hour, row.availability, row.capacity,
            row.interruption_rate, row.quota_headroom, row.gone)


# --- only changes ------------------------------------------------------------------------


async def test_a_new_pool_is_recorded_with_its_full_state(rig: Rig) -> None:
    await rig.poll([offer("us-east-1a", price=24.5, availability=0.8, capacity=3,
                          interruption_rate=0.05, quota_headroom=64),
                    offer("us-east-1b", price=None, availability=None)])
    a, b = rig.rows()
    assert a.t == rig.clock.now.replace(microsecond=0)
    assert (a.pool, a.gpu, a.gpus) == (offer("us-east-1a").pool, "H100-80GB", 8)
    assert state(a) == ("us-east-1a", 24.5, 0.8, 3, 0.05, 64, False)
    assert state(b) == ("us-east-1b", None, None, None, 0.0, None, False)


async def test_the_same_offers_again_write_nothing(rig: Rig) -> None:
    offers = [offer("us-east-1a"), offer("us-east-1b"), gcp()]
    await rig.poll(offers[:2])
    await rig.poll(offers[2:], GCP)
    assert await rig.count() == 3
    await rig.poll(offers[:2])  # a new observed_at alone is no change
    await rig.poll(offers[2:], GCP)
    assert await rig.count() == 3
    assert rig.recorder.rows_written == 3


async def test_one_changed_price_writes_one_row(rig: Rig) -> None:
    await rig.poll([offer("us-east-1a"), offer("us-east-1b")])
    await rig.poll([offer("us-east-1a"), offer("us-east-1b", price=25.0)])
    assert await rig.count() == 3
    last = rig.rows()[-1]
    assert state(last)[:2] == ("us-east-1b", 25.0)
    # Each signal counts, at the stored resolution (10⁻⁶).
    for change in ({"availability": 0.5}, {"capacity": 7}, {"interruption_rate": 0.2},
                   {"quota_headroom": 32}, {"gpus": 4}):
        before = await rig.count()
        await rig.poll([offer("us-east-1a"), offer("us-east-1b", price=25.0, **change)])
        await rig.poll([offer("us-east-1a"), offer("us-east-1b", price=25.0)])
        assert await rig.count() == before + (4 if "gpus" in change else 2), change
    before = await rig.count()
    await rig.poll([offer("us-east-1a"), offer("us-east-1b", price=25.0000001)])
    assert await rig.count() == before


async def test_a_changed_gpu_ends_the_old_pool_row(rig: Rig) -> None:
    await rig.poll([offer("us-east-1a", gpu="H100-80GB")])
    await rig.poll([offer("us-east-1a", gpu="H200-141GB")])
    first, gone, second = rig.rows()
    assert (first.gpu, gone.gone, second.gpu) == ("H100-80GB", True, "H200-141GB")
    assert gone.t == second.t
    # A replay from after the change sees one pool with the new GPU.
    [now] = rig.rows(since=rig.clock.now)
    assert now.gpu == "H200-141GB"


# --- gone ---------------------------------------------------------------------------------


async def test_a_pool_missing_from_its_slice_gets_a_gone_row(rig: Rig) -> None:
    await rig.poll([offer("us-east-1a"), offer("us-east-1b")])
    await rig.poll([gcp()], GCP)
    await rig.poll([offer("us-east-1a")])
    gone = rig.rows()[-1]
    assert gone.gone and gone.pool == offer("us-east-1b").pool and gone.gpu is None
    assert await rig.count() == 4  # the gcp pool of the other slice is not gone
    await rig.poll([offer("us-east-1a")])  # still gone: nothing new
    assert await rig.count() == 4
    await rig.poll([offer("us-east-1a"), offer("us-east-1b")])  # back
    back = rig.rows()[-1]
    assert not back.gone and back.pool == offer("us-east-1b").pool
    # An empty poll of a slice ends every pool it offered.
    await rig.poll([])
    assert [r.gone for r in rig.rows()[-2:]] == [True, True]


@given(st.tuples(*[st.none() | st.integers(-(2 ** 63) + 1, 2 ** 63 - 1)] * 5))
def test_recorded_values_pack_and_unpack_unchanged(values: Values) -> None:
    assert _unpack(_pack(values)) == values


async def pool_rows(rig: Rig) -> int:
    n = await rig.store.call(
        lambda db: db.execute("SELECT count(*) FROM market_pools").fetchone()[0])
    return int(n)


async def test_a_pool_that_comes_back_takes_up_its_own_row_again(places: Places) -> None:
    """Gone and back, another GPU and back, and across a restart: each (pool, GPU, count)
    has one market_pools row, and a pool's rows read back as its one history."""
    path, clock = places.new(), Clock()
    async with rig_at(path, clock) as rig:
        await rig.poll([offer("us-east-1a"), offer("us-east-1b")])
        await rig.poll([offer("us-east-1a")])  # b gone
        await rig.poll([offer("us-east-1a"), offer("us-east-1b")])  # b back
        await rig.poll([offer("us-east-1a", gpu="H200-141GB"), offer("us-east-1b")])
        await rig.poll([offer("us-east-1a"), offer("us-east-1b")])  # a's H100 again
        assert await pool_rows(rig) == 3
        await rig.poll([offer("us-east-1b")])  # a gone before the restart
    async with rig_at(path, clock) as rig:
        await rig.poll([offer("us-east-1a", gpu="H200-141GB"), offer("us-east-1b", price=9.0)])
        assert await pool_rows(rig) == 3
        await rig.poll([offer("us-east-1a"), offer("us-east-1b", price=9.0)])
        assert await pool_rows(rig) == 3
        rows = rig.rows()
    a = [(r.gpu, r.gone) for r in rows if r.pool.zone == "us-east-1a"]
    # Rows of one second come in the order of their pool rows (H100's first).
    assert a == [("H100-80GB", False),
                 (None, True), ("H200-141GB", False),  # H100's row ends
                 ("H100-80GB", False), (None, True),  # H200's ends
                 (None, True),  # gone before the restart
                 ("H200-141GB", False),
                 ("H100-80GB", False), (None, True)]  # H200's ends
    b = [(r.price_per_hour, r.gone) for r in rows if r.pool.zone == "us-east-1b"]
    assert [g for _, g in b] == [False, True, False, False]
    assert b[-1][0] == 9.0


async def test_a_pool_polled_by_another_slice_is_gone_only_from_that_one(rig: Rig) -> None:
    moved = offer("us-east-1b")
    await rig.poll([offer("us-east-1a"), moved])
    await rig.poll([moved], GCP)  # the other slice offers it now, unchanged
    assert await rig.count() == 2
    await rig.poll([offer("us-east-1a")])  # the first slice without it: not gone
    assert await rig.count() == 2
    await rig.poll([], GCP)  # its slice without it: gone
    assert [(r.pool.zone, r.gone) for r in rig.rows()[2:]] == [("us-east-1b", True)]


async def test_a_restart_picks_up_the_recorded_state(places: Places) -> None:
    path, clock = places.new(), Clock()
    async with rig_at(path, clock) as rig:
        await rig.poll([offer("us-east-1a"), offer("us-east-1b"), offer("us-east-1c")])
        await rig.poll([gcp()], GCP)
    async with rig_at(path, clock) as rig:
        await rig.poll([offer("us-east-1a"), offer("us-east-1b", price=30.0)])
        await rig.poll([gcp()], GCP)
        rows = rig.rows()
        # No duplicate of what was recorded; the change; the pool that went away while
        # the daemon was down.
        assert len(rows) == 6
        assert [(r.pool.zone, r.gone) for r in rows[4:]] == [("us-east-1b", False),
                                                             ("us-east-1c", True)]


async def test_polls_in_the_same_second_keep_the_last_state(rig: Rig) -> None:
    await rig.poll([offer("us-east-1a", price=1.0)])
    await rig.poll([offer("us-east-1a", price=2.0)], after=0)
    await rig.poll([offer("us-east-1a", price=3.0)], after=0)
    assert [r.price_per_hour for r in rig.rows()] == [3.0]
    await rig.poll([offer("us-east-1a", price=3.0)])
    assert await rig.count() == 1


# --- retention ---------------------------------------------------------------------------


async def test_pruning_keeps_every_pools_state_at_the_cutoff(places: Places) -> None:
    path, clock = places.new(), Clock()
    start = clock.now
    # snapshot_factor 1: a snapshot as soon as the changes since the last one are as many
    # as the live pools (day 0 and day 1 here).
    async with rig_at(path, clock, snapshot_factor=1) as rig:
        await rig.poll([offer("us-east-1a", price=1.0), offer("us-east-1b", price=1.0),
                        offer("us-east-1c", price=1.0)], after=0)
        await rig.poll([offer("us-east-1a", price=2.0), offer("us-east-1b", price=1.0)],
                       after=DAY)  # c gone on day 1
        await rig.poll([offer("us-east-1a", price=3.0), offer("us-east-1b", price=1.0)],
                       after=DAY)  # day 2
        await rig.poll([offer("us-east-1a", price=4.0), offer("us-east-1b", price=1.0)],
                       after=18 * DAY)  # day 20
        assert rig.recorder.snapshots == 3
        with reader_of(rig.where) as reader:
            assert reader.pruned_before() is None
        # The cutoff is day 6; the latest snapshot before it, day 1, holds b's state.
        assert await rig.recorder.prune() == 3  # a, b and c of day 0
        day = [start + timedelta(days=d) for d in range(21)]
        with reader_of(rig.where) as reader:
            assert reader.pruned_before() == day[1]
        assert [(r.t, r.pool.zone, r.price_per_hour) for r in rig.rows()] == [
            (day[1], "us-east-1a", 2.0), (day[1], "us-east-1b", 1.0),
            (day[2], "us-east-1a", 3.0), (day[20], "us-east-1a", 4.0)]
        # A replay from the cutoff knows every pool offered then.
        assert [(r.t, r.pool.zone, r.price_per_hour) for r in rig.rows(since=day[6])] == [
            (day[6], "us-east-1a", 3.0), (day[6], "us-east-1b", 1.0),
            (day[20], "us-east-1a", 4.0)]
        # From before where history is complete, a trace starts there.
        assert rig.rows(since=start) == rig.rows()
        assert await rig.recorder.prune() == 0
        # Nothing the recorder remembers was lost: an unchanged poll writes nothing.
        before = await rig.count()
        await rig.poll([offer("us-east-1a", price=4.0), offer("us-east-1b", price=1.0)])
        assert await rig.count() == before
    async with rig_at(path, clock) as rig:  # nor what a restart reads back
        await rig.poll([offer("us-east-1a", price=4.0), offer("us-east-1b", price=1.0)])
        assert await rig.count() == before


async def test_snapshots_bound_state_reads_and_leave_the_trace_alone(places: Places
                                                                     ) -> None:
    polls = [[offer("us-east-1a", price=float(i)), offer("us-east-1b", price=float(i // 3))]
             for i in range(1, 30)]
    traces, scanned, snapshots = [], [], []
    for factor in (2, 1000):
        async with rig_at(places.new(), Clock(), snapshot_factor=factor) as rig:
            for offers in polls:
                await rig.poll(offers)
            traces.append(rig.rows())
            with reader_of(rig.where) as reader:
                state, changes, _ = reader.state_at(None, reader.pools())
            assert sorted(v[0] for v in state.values()) == [9_000_000, 29_000_000]
            scanned.append(changes)
            snapshots.append(rig.recorder.snapshots)
    assert traces[0] == traces[1] and len(traces[0]) == 29 + 10
    assert scanned[0] <= 2 * 2 and scanned[1] == 39  # factor × live pools, or everything
    assert snapshots[0] >= 8 and snapshots[1] == 0


async def test_pruning_works_in_bounded_steps(places: Places) -> None:
    async with rig_at(places.new(), snapshot_factor=4) as rig:
        for price in range(1, 41):
            await rig.poll([offer(z, price=float(price)) for z in ("us-east-1a", "us-east-1b")])
        keep_from = await rig.store.call(partial(start_pruning,
                                                 cutoff=epoch(rig.clock.now)))
        assert keep_from is not None
        older = await rig.store.call(lambda db: db.execute(
            "SELECT count(*) FROM market_changes WHERE t < ?", (keep_from,)).fetchone()[0])
        steps: list[int] = []
        more = True
        while more:
            more, n = await rig.store.call(partial(prune_step, keep_from=keep_from,
                                                   max_rows=7))
            steps.append(n)
        assert older > 50 and max(steps) <= 7 and sum(steps) == older
        assert [r.price_per_hour for r in rig.rows(since=rig.clock.now)] == [40.0, 40.0]


async def test_zero_retention_keeps_nothing_but_the_current_state(places: Places) -> None:
    async with rig_at(places.new(), retention_days=0, snapshot_factor=1) as rig:
        await rig.poll([offer("us-east-1a", price=1.0)])
        await rig.poll([offer("us-east-1a", price=2.0)])
        assert await rig.recorder.prune() == 1
        assert [r.price_per_hour for r in rig.rows()] == [2.0]


# --- reading back ------------------------------------------------------------------------


T4 = offer("us-east-1a", instance_type="g4dn.xlarge", gpu="T4", gpus=1, price=0.2)
ON_DEMAND = offer("us-east-1b", market="on_demand", price=30.0, availability=None)


async def record_three_polls(rig: Rig) -> list[datetime]:
    """Three polls an hour apart (T4 gone in the last); returns their times."""
    times = []
    await rig.poll([offer("us-east-1a", price=10.0), ON_DEMAND, T4])
    await rig.poll([gcp(price=5.0)], GCP, after=0)
    times.append(rig.clock.now.replace(microsecond=0))
    await rig.poll([offer("us-east-1a", price=11.0), ON_DEMAND, T4], after=3600)
    times.append(rig.clock.now.replace(microsecond=0))
    await rig.poll([offer("us-east-1a", price=12.0), ON_DEMAND], after=3600)
    times.append(rig.clock.now.replace(microsecond=0))
    return times


def brief(rows: Iterable[TraceRow]) -> list[tuple[Any, ...]]:
    return [(r.t, r.pool.cloud, r.pool.instance_type, r.pool.market.value,
             r.price_per_hour, r.gone) for r in rows]


async def test_history_rows_filter_by_time_gpu_cloud_and_market(rig: Rig) -> None:
    t0, t1, t2 = await record_three_polls(rig)
    p5, g4, a3 = "p5.48xlarge", "g4dn.xlarge", "a3-highgpu-8g"
    assert brief(rig.rows()) == [
        (t0, "aws", p5, "spot", 10.0, False), (t0, "aws", p5, "on_demand", 30.0, False),
        (t0, "aws", g4, "spot", 0.2, False), (t0, "gcp", a3, "spot", 5.0, False),
        (t1, "aws", p5, "spot", 11.0, False),
        (t2, "aws", p5, "spot", 12.0, False), (t2, "aws", g4, "spot", None, True)]
    assert brief(rig.rows(gpus=["T4"])) == [(t0, "aws", g4, "spot", 0.2, False),
                                            (t2, "aws", g4, "spot", None, True)]
    assert brief(rig.rows(clouds=["gcp"])) == [(t0, "gcp", a3, "spot", 5.0, False)]
    assert brief(rig.rows(market=Market.ON_DEMAND, clouds=["aws"], gpus=["H100-80GB"])) == [
        (t0, "aws", p5, "on_demand", 30.0, False)]
    # From a time: every pool's state then, stamped with it; then the changes after it.
    assert brief(rig.rows(since=t1, clouds=["aws"])) == [
        (t1, "aws", p5, "spot", 11.0, False), (t1, "aws", p5, "on_demand", 30.0, False),
        (t1, "aws", g4, "spot", 0.2, False), (t2, "aws", p5, "spot", 12.0, False),
        (t2, "aws", g4, "spot", None, True)]
    assert brief(rig.rows(until=t1)) == brief(rig.rows())[:4]
    assert rig.rows(since=t2, until=t1) == []
    with reader_of(rig.where) as reader:
        assert reader.present
        assert reader.names("gpu") == {"H100-80GB", "T4"}
        assert reader.names("cloud") == {"aws", "gcp"}


async def test_an_empty_database_has_no_history(places: Places) -> None:
    where = places.new()
    if isinstance(where, str):  # PostgreSQL: no tables at all yet
        with reader_of(where) as reader:
            assert not reader.present
            assert list(reader.rows()) == [] and reader.pruned_before() is None
            assert reader.pools() == {} and reader.names("gpu") == set()
    async with rig_at(where) as rig:  # tables, no rows
        assert rig.rows() == []
        with reader_of(rig.where) as reader:
            assert reader.present and reader.pruned_before() is None


async def test_a_postgresql_history_is_read_a_batch_at_a_time(pg_url: str) -> None:
    """The changes come from a server-side cursor (a plain one would hold the whole
    history in memory), open only while the trace is read."""
    async with rig_at(pg_url) as rig:
        for i in range(1, 31):
            await rig.poll([offer("us-east-1a", price=float(i))])
        recorded = rig.rows()
    assert [r.price_per_hour for r in recorded] == [float(i) for i in range(1, 31)]

    def cursors(reader: HistoryReader) -> int:
        return int(reader._db.execute("SELECT count(*) FROM pg_cursors").fetchone()[0])

    with reader_of(pg_url) as reader:
        rows = reader.rows()
        first = next(rows)
        assert cursors(reader) == 1
        assert [first, *rows] == recorded
        assert cursors(reader) == 0 and not reader._db.in_transaction
        # A trace read only in part (`gpubroker history | head`) ends it all the same.
        rows = reader.rows()
        assert next(rows) == first
        rows.close()
        assert cursors(reader) == 0 and not reader._db.in_transaction
        assert list(reader.rows()) == recorded


def gpubroker(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "broker.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=60, check=False)


async def test_gpubroker_history_exports_a_postgresql_history(pg_url: str,
                                                              tmp_path: Path) -> None:
    async with rig_at(pg_url) as rig:
        t0, t1, t2 = await record_three_polls(rig)
        recorded = rig.rows()
        t4_since_t1 = rig.rows(since=t1, gpus=["T4"])
    assert len(recorded) == 7 and len(t4_since_t1) == 2
    cfg = tmp_path / "gpubroker.yaml"
    cfg.write_text(yaml.safe_dump({"site": "test", "state": {"url": pg_url}}))
    out = tmp_path / "history.jsonl"
    r = await asyncio.to_thread(gpubroker, "history", "--config", cfg, "--output", out)
    assert r.returncode == 0, r.stderr
    assert list(read_trace(out)) == recorded
    assert r.stderr.strip() == (f"exported 7 changes of 4 pools from {format_t(t0)} to "
                                f"{format_t(t2)}")
    r = await asyncio.to_thread(gpubroker, "history", "--config", cfg, "--gpu", "T4",
                                "--since", format_t(t1))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(x["t"], x["instance_type"], x.get("gone", False)) for x in rows] == [
        (format_t(t1), "g4dn.xlarge", False), (format_t(t2), "g4dn.xlarge", True)]


async def test_gpubroker_history_names_a_database_it_cannot_read(pg_url: str,
                                                                 tmp_path: Path) -> None:
    missing = pg_url.rsplit("/", 1)[0] + "/gpbtest_missing"
    cfg = tmp_path / "gpubroker.yaml"
    cfg.write_text(yaml.safe_dump({"state": {"url": missing}}))
    r = await asyncio.to_thread(gpubroker, "history", "--config", cfg)
    assert r.returncode == 2, r.stderr
    assert "/gpbtest_missing: cannot read the database: " in r.stderr
    assert 'database "gpbtest_missing" does not exist' in r.stderr
    assert r.stdout == ""


# --- best effort ---------------------------------------------------------------------------


# Statements that make the store's own connection refuse writes, and allow them again;
# what the refusal says.
READ_ONLY = {
    "sqlite": ("PRAGMA query_only=1", "PRAGMA query_only=0", "readonly"),
    "postgresql": ("SET default_transaction_read_only = on",
                   "SET default_transaction_read_only = off", "read-only transaction"),
}


async def test_a_failing_write_is_logged_once_and_the_next_poll_catches_up(
        rig: Rig, places: Places) -> None:
    refuse, allow, says = READ_ONLY[places.engine]
    await rig.poll([offer("us-east-1a", price=1.0)])
    await rig.store.call(lambda db: db.execute(refuse))
    with capture_logs() as logs:
        await rig.poll([offer("us-east-1a", price=2.0)])
        await rig.poll([offer("us-east-1a", price=3.0)])
        assert rig.recorder.failures == 2
        assert await rig.store.call(lambda db: db.in_transaction) is False
        await rig.store.call(lambda db: db.execute(allow))
        await rig.poll([offer("us-east-1a", price=3.0)])
    assert [e["event"] for e in logs] == ["market recording failing",
                                          "market recording recovered"]
    assert says in logs[0]["detail"]
    # The failed polls' change is recorded by the next one.
    assert [r.price_per_hour for r in rig.rows()] == [1.0, 3.0]
    assert not rig.task.done()


async def test_polls_queued_meanwhile_are_one_transaction_and_a_failed_one_is_redone(
        places: Places) -> None:
    """The store's thread and its durable commits are the lease decisions' too: the polls
    that queued while the recorder wrote or paused go in one transaction. One that
    fails leaves the recorder's memory as it was, though a poll in it went through: the
    next write records whatever changed since."""
    refuse, allow, _ = READ_ONLY[places.engine]
    writes: list[int] = []
    async with rig_at(places.new(), on_write=lambda rows, _s: writes.append(rows)) as rig:
        await rig.poll([offer("us-east-1a", price=1.0)])
        assert writes == [1]

        def polls(*offered: tuple[SliceId, list[Offer]]) -> None:
            for slice_id, offers in offered:  # queued without a pause: none written yet
                rig.clock.advance(60)
                rig.pool.replace(slice_id, [replace(o, observed_at=rig.clock())
                                            for o in offers])

        polls((SLICE, [offer("us-east-1a", price=2.0), offer("us-east-1b", price=5.0)]),
              (GCP, [gcp()]),
              (SLICE, [offer("us-east-1a", price=3.0), offer("us-east-1b", price=5.0)]))
        async with asyncio.timeout(10):
            await rig.recorder.flush()
        assert writes == [1, 4]  # 1a twice, 1b and the GCP pool new: one transaction
        assert [r.price_per_hour for r in rig.rows(clouds=["aws"])] == [1.0, 2.0, 5.0, 3.0]

        await rig.store.call(lambda db: db.execute(refuse))
        # The first poll goes through (1a changed, 1b gone); the second's new pool is
        # refused.
        polls((SLICE, [offer("us-east-1a", price=4.0)]),
              (SLICE, [offer("us-east-1a", price=6.0), offer("us-east-1c", price=7.0)]))
        async with asyncio.timeout(10):
            await rig.recorder.flush()
        assert rig.recorder.failures == 1 and writes == [1, 4]
        await rig.store.call(lambda db: db.execute(allow))
        await rig.poll([offer("us-east-1a", price=6.0)])
        assert writes == [1, 4, 2]  # as if the failed polls were never seen: 1a, 1b gone
        last = [state(r) for r in rig.rows()[-2:]]
        assert sorted(last) == [("us-east-1a", 6.0, 1.0, None, 0.0, None, False),
                                ("us-east-1b", None, None, None, None, None, True)]


async def test_a_transaction_takes_so_many_offers_at_most(places: Places,
                                                          monkeypatch: Any) -> None:
    """A transaction holds the store's thread (the lease decisions' commits wait): the
    polls queued meanwhile are split, each transaction `WRITE_MAX_OFFERS` offers at
    most, one poll at least."""
    monkeypatch.setattr(recording, "WRITE_MAX_OFFERS", 3)
    writes: list[int] = []
    async with rig_at(places.new(), on_write=lambda rows, _s: writes.append(rows)) as rig:
        for i, n in enumerate((2, 1, 4, 1, 1)):  # offers per poll, each of its own slice
            rig.pool.replace(("sim", f"aws:r{i}"), [offer(f"r{i}{z}", region=f"r{i}")
                                                    for z in "abcd"[:n]])
        async with asyncio.timeout(10):
            await rig.recorder.flush()
        assert writes == [3, 4, 2]


async def test_a_full_queue_drops_polls_without_losing_the_state(places: Places) -> None:
    async with rig_at(places.new(), queue_size=1) as rig:
        rig.task.cancel()  # nothing writes until the test says so
        with contextlib.suppress(asyncio.CancelledError):
            await rig.task
        with capture_logs() as logs:
            rig.pool.replace(SLICE, [offer("us-east-1a", price=1.0)])
            rig.pool.replace(SLICE, [offer("us-east-1a", price=2.0)])  # dropped
            rig.pool.replace(SLICE, [offer("us-east-1a", price=2.0)])  # dropped
        assert rig.recorder.polls_dropped == 2
        assert [e["event"] for e in logs] == ["market recorder behind; dropping polls"]
        rig.task = asyncio.create_task(rig.recorder.run())
        async with asyncio.timeout(10):
            await rig.recorder.flush()
        await rig.poll([offer("us-east-1a", price=2.0)])
        assert [r.price_per_hour for r in rig.rows()] == [1.0, 2.0]


async def test_a_closed_store_does_not_break_the_pool(places: Places) -> None:
    async with rig_at(places.new()) as rig:
        await rig.store.close()
        with capture_logs() as logs:
            change = rig.pool.replace(SLICE, [offer("us-east-1a")])
            async with asyncio.timeout(10):
                await rig.recorder.flush()
        assert change.offers and len(rig.pool) == 1
        assert rig.recorder.failures == 1
        assert [e["event"] for e in logs] == ["market history loaded",
                                              "market recording failing"]
        rig.store = store_at(rig.where)  # for the rig's own teardown
        await rig.store.open()


# --- in the daemon -------------------------------------------------------------------------


async def test_the_daemon_places_on_while_recording_fails(start_daemon: StartDaemon,
                                                          probe_factory: ProbeFactory) -> None:
    rd = await start_daemon()
    recorder = rd.daemon.recorder
    assert recorder is not None
    async with asyncio.timeout(10):
        await recorder.flush()
    assert recorder.rows_written >= len(rd.daemon.pool) > 0
    # Break only the recorder's table: leases and the outbox still commit.
    await rd.daemon.store.call(lambda db: db.execute("DROP TABLE market_changes"))
    await rd.daemon.poller.poll_all()
    async with asyncio.timeout(10):
        await recorder.flush()
    assert recorder.failures > 0
    probe = await probe_factory(["gpubroker/v1/events/#"])
    await probe.publish("gpubroker/v1/requests/s1/place",
                        {"request_id": "r1", "gpu": "L4", "gpus": 1})
    msg = await probe.wait_for("gpubroker/v1/events/s1/placement.decided")
    assert payload_json(msg)["data"]["request_id"] == "r1"
    assert not rd.task.done()


async def test_zero_history_days_turns_recording_off(tmp_path: Path) -> None:
    def daemon(days: float) -> Daemon:
        return Daemon(Config(state=StateConfig(path=tmp_path / "state.db",
                                               market_history_days=days),
                             http=HttpConfig(listen=None)))

    assert daemon(0).recorder is None
    on = daemon(0.5).recorder
    assert on is not None and on.retention == timedelta(hours=12)


async def _record_a_stormy_day(path: Path) -> Offer:
    """Twelve hours, up to now, of a spot pool at availability 0.4 (0.11 interruptions an
    hour), calm (0.95) at the last poll; recorded as the daemon records."""
    from broker.model import utcnow

    clock = Clock(utcnow() - timedelta(hours=12, minutes=20))  # the last poll 10 min ago
    async with rig_at(path, clock) as rig:
        for n in range(72):
            a = 0.4 if n % 2 else 0.42
            await rig.poll([offer("us-east-1a", availability=a, interruption_rate=0.11)],
                           after=600)
        calm = offer("us-east-1a", availability=0.95, interruption_rate=0.01)
        await rig.poll([calm], after=600)
    return calm


async def test_a_restarted_daemon_warms_its_hazard_estimates_from_the_history(
        tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    calm = await _record_a_stormy_day(path)
    daemon = Daemon(Config(state=StateConfig(path=path), http=HttpConfig(listen=None)),
                    adapters=[])
    assert calm.pool not in daemon.hazard
    await daemon.store.open()
    try:
        with capture_logs() as logs:
            rows = await daemon.warm_hazard()
    finally:
        await daemon.store.close()
    assert rows == 73
    assert "hazard estimates warmed from the market history" in [e["event"] for e in logs]
    assert daemon.pool.hazard is daemon.hazard
    # The history, not the last poll: the pool is expected to be mostly unavailable.
    est = daemon.hazard.estimate(calm.pool)
    assert est is not None and est[0] is not None and est[1] is not None
    assert 0.4 < est[1] < 0.7 and 0.05 < est[0] < 0.11
    # Placement scores the pool with it (the offer itself says 0.95).
    from broker.placement.optimizer import signals

    assert signals(calm, daemon.policy, daemon.pool.hazard) == est


async def test_the_daemon_warms_the_estimates_at_start(start_daemon: StartDaemon,
                                                       tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    calm = await _record_a_stormy_day(path)
    rd = await start_daemon(state=path)
    await asyncio.wait_for(rd.daemon.hazard_warm.wait(), 10)
    assert rd.daemon.pool.hazard is rd.daemon.hazard
    assert calm.pool in rd.daemon.hazard
    avg = rd.daemon.hazard.average(calm.pool)
    assert avg is not None and avg[1] is not None and avg[1] < 0.6
    # The sim's own spot pools are fed as they are polled.
    assert len(rd.daemon.hazard) > 1
