"""The market recorder over the simulated market: rows, bytes and time per recorded poll.

Polls every region of a large simulated market (`SimAdapter`, `--regions-per-cloud` × 4
clouds) `--rounds` times into a real ResourcePool wired to a real MarketRecorder and
StateStore (a fresh SQLite file), as the daemon wires them: one round per minute of
recorder clock, its polls spread over that minute. Each slice poll is timed twice: how
long its write held the store's SQLite thread (what a lease commit queued behind it
could wait), and from `pool.replace` until its rows are committed (`flush`; adds the
hand-over to the thread and back, GIL scheduling included). The listener's own cost on
the event loop is timed separately.

Then: bytes per row (database size after a checkpoint / rows), the disk writes that
recording caused (WAL and checkpoints), the export rate of `HistoryReader.rows`, how fast
the daemon's hazard estimates warm from the spot rows at start (`broker.market.hazard`), and the
duration of each bounded pruning step when everything before the latest snapshot goes.

The simulated market moves every signal of every pool on every poll (on-demand
availability and capacity wander, quota headroom moves per region), so nearly every
offer is a change: a worst case for the recorder. Real clouds change far less often.

    cd /work/main && python bench/recorder.py [--regions-per-cloud 88] [--rounds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sqlite3
import statistics
import sys
import tempfile
import time
from datetime import datetime, timedelta
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from adapters.sim import SimAdapter  # noqa: E402
from broker.market.changes import PoolChange  # noqa: E402
from broker.market.hazard import HazardEstimator  # noqa: E402
from broker.market.pool import ResourcePool  # noqa: E402
from broker.market.recorder import (  # noqa: E402
    SNAPSHOT,
    SNAPSHOT_CHUNK_ROWS,
    HistoryReader,
    MarketRecorder,
    prune_step,
    start_pruning,
    write_snapshot_chunk,
)
from broker.model import Market, utcnow  # noqa: E402
from broker.state.store import StateStore  # noqa: E402


def _write_bytes() -> int:
    """Bytes this process caused to be written to disk (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("write_bytes"))
    except (OSError, StopIteration):
        return 0


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


class Clock:
    def __init__(self) -> None:
        self.now = utcnow().replace(microsecond=0)

    def __call__(self) -> datetime:
        return self.now


async def bench(args: argparse.Namespace, folder: Path) -> None:
    path = folder / "state.db"
    store = StateStore(path)
    await store.open()
    clock = Clock()
    pool = ResourcePool(stale_after_seconds=1e9, clock=clock)
    thread_s: list[float] = []
    recorder = MarketRecorder(store, retention_days=14, clock=clock,
                              on_write=lambda rows, seconds: thread_s.append(seconds))
    listener_s: list[float] = []

    def observe(change: PoolChange) -> None:
        t0 = time.perf_counter()
        recorder.observe(change)
        listener_s.append(time.perf_counter() - t0)

    pool.subscribe(observe)
    writer = asyncio.create_task(recorder.run())
    io_start = _write_bytes()
    sim = SimAdapter(seed=args.seed, regions_per_cloud=args.regions_per_cloud,
                     zones_per_region=args.zones_per_region, clock=clock)
    regions = list(sim.regions())
    per_poll_s: list[float] = []
    rows_per_round: list[int] = []
    offers_per_round: list[int] = []
    step = timedelta(seconds=60 / len(regions))  # a round's polls spread over a minute
    for _ in range(args.rounds):
        before, offered = recorder.rows_written, 0
        for region in regions:
            clock.now += step
            offers = await sim.poll(region)
            offered += len(offers)
            t0 = time.perf_counter()
            pool.replace(("sim", region), offers)
            await recorder.flush()
            per_poll_s.append(time.perf_counter() - t0)
        rows_per_round.append(recorder.rows_written - before)
        offers_per_round.append(offered)

    rows = await store.call(
        lambda db: db.execute("SELECT count(*) FROM market_changes").fetchone()[0])
    snapshot_rows = await store.call(lambda db: db.execute(
        "SELECT count(*) FROM market_changes WHERE kind = ?", (SNAPSHOT,)).fetchone()[0])
    await store.call(lambda db: db.execute("PRAGMA wal_checkpoint(TRUNCATE)"))
    tables: dict[str, int] = {}
    with contextlib.suppress(sqlite3.OperationalError):  # dbstat: a compile-time option
        tables = dict(await store.call(lambda db: db.execute(
            "SELECT name, sum(pgsize) FROM dbstat GROUP BY name").fetchall()))
    io_written = _write_bytes() - io_start
    size = path.stat().st_size

    # Export rate.
    t0 = time.perf_counter()
    with HistoryReader(path) as reader:
        exported = sum(1 for _ in reader.rows())
    export_s = time.perf_counter() - t0

    # The daemon's start: the hazard estimator warmed from the spot pools' history.
    hazard = HazardEstimator()
    t0 = time.perf_counter()
    with HistoryReader(path) as reader:
        warmed = hazard.observe_rows(reader.rows(market=Market.SPOT))
    warm_s = time.perf_counter() - t0

    # Start-up read-back (its own read-only connection, as the recorder does it), then
    # one more snapshot of that state, timed chunk by chunk on the SQLite thread.
    t0 = time.perf_counter()
    with HistoryReader(path) as reader:
        state, _, last_t = reader.state_at(None, reader.pools())
    load_s = time.perf_counter() - t0
    entries = sorted(state.items())
    chunk_s: list[float] = []
    chunk = SNAPSHOT_CHUNK_ROWS
    for i in range(0, len(entries), chunk):
        t0 = time.perf_counter()
        await store.call(partial(write_snapshot_chunk, t=last_t + 1, entries=entries[i:i + chunk],
                                 complete=i + chunk >= len(entries)))
        chunk_s.append(time.perf_counter() - t0)

    # Pruning: everything before the latest snapshot, step by step.
    keep_from = await store.call(partial(start_pruning, cutoff=int(clock.now.timestamp())))
    steps_s: list[float] = []
    deleted, more = 0, keep_from is not None
    while more:
        assert keep_from is not None
        t0 = time.perf_counter()
        more, n = await store.call(partial(prune_step, keep_from=keep_from))
        steps_s.append(time.perf_counter() - t0)
        deleted += n
    writer.cancel()
    await store.close()

    polls = len(per_poll_s)
    ms = [x * 1000 for x in per_poll_s]
    print(f"market: {len(regions)} regions, {statistics.mean(offers_per_round):.0f} offers "
          f"per round; {args.rounds} rounds = {polls} slice polls")
    later = statistics.mean(rows_per_round[1:] or rows_per_round)
    print(f"rows written per round after the first: mean {later:.0f} "
          f"({later / statistics.mean(offers_per_round):.0%} of offers; first round "
          f"{rows_per_round[0]})")
    print(f"rows written per slice poll: mean {recorder.rows_written / polls:.1f}")
    print(f"rows stored: {rows} ({snapshot_rows} of them in {recorder.snapshots} snapshots); "
          f"database {size / 1e6:.1f} MB = {size / rows:.1f} bytes per row")
    if tables:
        for name, b in sorted(tables.items(), key=lambda kv: -kv[1])[:4]:
            print(f"  {name}: {b / 1e6:.1f} MB ({b / rows:.1f} bytes per row)")
    if io_written:
        print(f"disk writes while recording (WAL and checkpoints): {io_written / 1e6:.0f} MB "
              f"= {io_written / recorder.rows_written:.0f} bytes per row written")
    tms = [x * 1000 for x in thread_s]
    print(f"time per recorded slice poll on the SQLite thread: median "
          f"{statistics.median(tms):.2f} ms, p99 {pct(tms, 0.99):.2f} ms, max {max(tms):.2f} ms")
    print(f"time per recorded slice poll, replace → committed: median "
          f"{statistics.median(ms):.2f} ms, p99 {pct(ms, 0.99):.2f} ms, max {max(ms):.2f} ms")
    lms = [x * 1e6 for x in listener_s]
    print(f"listener on the event loop: median {statistics.median(lms):.1f} µs, "
          f"p99 {pct(lms, 0.99):.1f} µs")
    print(f"export: {exported} rows in {export_s:.2f} s ({exported / export_s:,.0f} rows/s)")
    print(f"hazard estimates warmed from {warmed} spot rows in {warm_s:.2f} s "
          f"({warmed / warm_s:,.0f} rows/s, {len(hazard)} pools)")
    print(f"start-up read-back of {len(state)} live pools: {load_s:.2f} s (own connection)")
    cms = [x * 1000 for x in chunk_s]
    print(f"snapshot of {len(entries)} pools in {len(cms)} chunks of {chunk}: chunk "
          f"median {statistics.median(cms):.1f} ms, max {max(cms):.1f} ms")
    sms = [x * 1000 for x in steps_s] or [0.0]
    print(f"pruning up to the latest snapshot: {deleted} rows in {len(steps_s)} steps, "
          f"step median {statistics.median(sms):.1f} ms, max {max(sms):.1f} ms")
    if recorder.failures or recorder.polls_dropped:
        print(f"failures {recorder.failures}, dropped polls {recorder.polls_dropped}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--regions-per-cloud", type=int, default=88)
    p.add_argument("--zones-per-region", type=int, default=3)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--keep", action="store_true", help="keep the database (path printed)")
    args = p.parse_args()
    if args.keep:
        folder = Path(tempfile.mkdtemp(prefix="gpubroker-recorder-"))
        print(f"database: {folder / 'state.db'}")
        asyncio.run(bench(args, folder))
    else:
        with tempfile.TemporaryDirectory(prefix="gpubroker-recorder-") as d:
            asyncio.run(bench(args, Path(d)))


if __name__ == "__main__":
    main()
