"""Tests of the market recorder (`broker/recorder.py`): a real ResourcePool feeding a real
StateStore in tmp_path; the recorded rows read back through HistoryReader."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, replace
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from daemon_helpers import StartDaemon
from factories import SLICE, Clock, offer
from mqtt_helpers import ProbeFactory, payload_json
from structlog.testing import capture_logs

from broker.config import Config, HttpConfig, StateConfig
from broker.daemon import Daemon
from broker.model import Offer
from broker.pool import ResourcePool, SliceId
from broker.recorder import HistoryReader, MarketRecorder, epoch, prune_step, start_pruning
from broker.store import StateStore
from broker.trace import TraceRow

GCP: SliceId = ("sim", "gcp:us-central1")
DAY = 86400.0


def gcp(zone: str = "us-central1-a", **kw: Any) -> Offer:
    return offer(zone, cloud="gcp", region="us-central1", instance_type="a3-highgpu-8g", **kw)


@dataclass
class Rig:
    """A pool, a store and a recorder, wired as the daemon wires them."""

    path: Path
    clock: Clock
    store: StateStore
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
        with HistoryReader(self.path) as reader:
            return list(reader.rows(**kw))

    async def count(self) -> int:
        n = await self.store.call(
            lambda db: db.execute("SELECT count(*) FROM market_changes").fetchone()[0])
        return int(n)


@contextlib.asynccontextmanager
async def rig_at(path: Path, clock: Clock | None = None, **kw: Any) -> AsyncIterator[Rig]:
    clock = clock or Clock()
    store = StateStore(path)
    await store.open()
    pool = ResourcePool(stale_after_seconds=1e9, clock=clock)
    recorder = MarketRecorder(store, retention_days=kw.pop("retention_days", 14), clock=clock,
                              **kw)
    pool.subscribe(recorder.observe)
    task = asyncio.create_task(recorder.run())
    try:
        yield Rig(path, clock, store, pool, recorder, task)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await store.close()


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with rig_at(tmp_path / "state.db") as r:
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


async def test_a_restart_picks_up_the_recorded_state(tmp_path: Path) -> None:
    path, clock = tmp_path / "state.db", Clock()
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


async def test_pruning_keeps_every_pools_state_at_the_cutoff(tmp_path: Path) -> None:
    path, clock = tmp_path / "state.db", Clock()
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
        # The cutoff is day 6; the latest snapshot before it, day 1, holds b's state.
        assert await rig.recorder.prune() == 3  # a, b and c of day 0
        day = [start + timedelta(days=d) for d in range(21)]
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


async def test_snapshots_bound_state_reads_and_leave_the_trace_alone(tmp_path: Path
                                                                     ) -> None:
    polls = [[offer("us-east-1a", price=float(i)), offer("us-east-1b", price=float(i // 3))]
             for i in range(1, 30)]
    traces, scanned, snapshots = [], [], []
    for factor in (2, 1000):
        async with rig_at(tmp_path / f"{factor}.db", Clock(), snapshot_factor=factor) as rig:
            for offers in polls:
                await rig.poll(offers)
            traces.append(rig.rows())
            with HistoryReader(rig.path) as reader:
                state, changes, _ = reader.state_at(None, reader.pools())
            assert sorted(v[0] for v in state.values()) == [9_000_000, 29_000_000]
            scanned.append(changes)
            snapshots.append(rig.recorder.snapshots)
    assert traces[0] == traces[1] and len(traces[0]) == 29 + 10
    assert scanned[0] <= 2 * 2 and scanned[1] == 39  # factor × live pools, or everything
    assert snapshots[0] >= 8 and snapshots[1] == 0


async def test_pruning_works_in_bounded_steps(tmp_path: Path) -> None:
    async with rig_at(tmp_path / "state.db", snapshot_factor=4) as rig:
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


async def test_zero_retention_keeps_nothing_but_the_current_state(tmp_path: Path) -> None:
    async with rig_at(tmp_path / "state.db", retention_days=0, snapshot_factor=1) as rig:
        await rig.poll([offer("us-east-1a", price=1.0)])
        await rig.poll([offer("us-east-1a", price=2.0)])
        assert await rig.recorder.prune() == 1
        assert [r.price_per_hour for r in rig.rows()] == [2.0]


# --- best effort ---------------------------------------------------------------------------


async def test_a_failing_write_is_logged_once_and_the_next_poll_catches_up(rig: Rig) -> None:
    await rig.poll([offer("us-east-1a", price=1.0)])
    await rig.store.call(lambda db: db.execute("PRAGMA query_only=1"))
    with capture_logs() as logs:
        await rig.poll([offer("us-east-1a", price=2.0)])
        await rig.poll([offer("us-east-1a", price=3.0)])
        assert rig.recorder.failures == 2
        await rig.store.call(lambda db: db.execute("PRAGMA query_only=0"))
        await rig.poll([offer("us-east-1a", price=3.0)])
    assert [e["event"] for e in logs] == ["market recording failing",
                                          "market recording recovered"]
    assert "readonly" in logs[0]["detail"]
    # The failed polls' change is recorded by the next one.
    assert [r.price_per_hour for r in rig.rows()] == [1.0, 3.0]
    assert not rig.task.done()


async def test_a_full_queue_drops_polls_without_losing_the_state(tmp_path: Path) -> None:
    async with rig_at(tmp_path / "state.db", queue_size=1) as rig:
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


async def test_a_closed_store_does_not_break_the_pool(tmp_path: Path) -> None:
    async with rig_at(tmp_path / "state.db") as rig:
        await rig.store.close()
        with capture_logs() as logs:
            change = rig.pool.replace(SLICE, [offer("us-east-1a")])
            async with asyncio.timeout(10):
                await rig.recorder.flush()
        assert change.offers and len(rig.pool) == 1
        assert rig.recorder.failures == 1
        assert [e["event"] for e in logs] == ["market history loaded",
                                              "market recording failing"]
        rig.store = StateStore(rig.path)  # for the rig's own teardown
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
    from broker.placement import signals

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
