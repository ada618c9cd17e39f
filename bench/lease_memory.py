"""What a lease and an offer cost in memory (#31): bytes (tracemalloc) and objects the
cyclic garbage collector tracks, each, in the daemon's own structures.

Offers: the simulated market (`--regions-per-cloud`, 88: ~20,000 offers) polled into a
real `ResourcePool` with its hazard estimator, as the daemon keeps them; then what the
market recorder keeps of them (its book of every pool's last recorded state, each
region's poll written into a real SQLite state file), and what the placement's cost
index keeps (its lists, their parts and memos, after 400 requests of the mix are placed
on one index without holding anything: every list the mix reads). Leases:
`--leases` place requests decoded from JSON bytes by the daemon's own validation
(`broker.wire.validation.parse_place`, bench/latency.py's request mix on four scheduler
ids), each given a lease by a real `LeaseBook.create` on a placement from the pool, then
a quarter of them renewed once. Restored: the same leases written as the store writes
them (`lease_row`) and read back (`lease_from`) into a new book (`LeaseBook.load`), as a
start or a takeover does. Each figure is what the structure holds once built less what
was held before (`gc.collect()` first, so nothing transient counts); tracked objects
are counted with `gc.get_objects()` and split by type.

    cd /work/main && python bench/lease_memory.py
    python bench/lease_memory.py --leases 100000 --root /tmp/before     # another checkout
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
NOW = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)


def tracked_by_type() -> Counter[str]:
    gc.collect()
    return Counter(type(o).__name__ for o in gc.get_objects())


def measured(build: Callable[[], Any]) -> tuple[Any, int, Counter[str]]:
    """What `build()` returns, the bytes and the tracked objects (by type) it added."""
    before = tracked_by_type()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    got = build()
    gc.collect()
    added = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return got, added, tracked_by_type() - before


def build_pool(sim: Any) -> Any:
    from broker.market.hazard import HazardEstimator
    from broker.market.pool import ResourcePool

    pool = ResourcePool(stale_after_seconds=1e9, clock=lambda: NOW)
    pool.hazard = HazardEstimator()
    for region in sim.regions():
        offers = asyncio.run(sim.poll(region))
        cloud, name = region.split(":", 1)
        pool.hazard.observe_change(pool.replace((cloud, name), offers), NOW.timestamp())
    return pool


def build_book(pool: Any, folder: str) -> Any:
    """The market recorder's book after every slice of `pool` is written, as the daemon's
    recorder writes a poll (`_Book.write` on the store's thread, a real SQLite file)."""
    from broker.market.recorder import _Book, _Poll, epoch
    from broker.state.store import StateStore

    by_slice: dict[Any, dict[Any, Any]] = {}
    for o in pool:
        by_slice.setdefault(pool.slice_of(o.pool), {})[o.pool] = o

    async def write() -> Any:
        store = StateStore(Path(folder) / "state.db")
        await store.open()
        try:
            book = _Book()
            for slice_id, offers in by_slice.items():
                poll = _Poll(slice_id, epoch(NOW), offers)
                await store.call(partial(book.write, polls=[poll], snapshot_factor=1e9))
            return book
        finally:
            await store.close()

    return asyncio.run(write())


def build_index(pool: Any) -> Any:
    """A cost index after 400 requests of the mix are placed on it (nothing held)."""
    from batches import requests  # bench/batches.py's mix as PlaceRequests

    from broker.placement.optimizer import Ask, BatchSettings, CostIndex, solve
    from policies.evaluate import Denied, evaluate
    from policies.model import Policy

    policy = Policy()
    index = CostIndex(pool, policy)
    settings = BatchSettings(exact_max_batch=0)
    for b in range(50):
        asks = [Ask(r, constraints=c) for r in requests(8, b)
                if not isinstance(c := evaluate(policy, r), Denied)]
        solve(asks, pool, policy, now=NOW, settings=settings, costs=index)
    return index


def asks(pool: Any, n: int) -> list[tuple[str, bytes, Any]]:
    """(scheduler, place body, the offer to place it on) for `n` requests."""
    from latency import MIX  # bench/latency.py's request mix

    by_gpu: dict[str, list[Any]] = {}
    for o in pool:
        if o.price_per_hour:
            by_gpu.setdefault(o.gpu, []).append(o)
    out = []
    for i in range(n):
        shape = {**MIX[i % len(MIX)], "request_id": f"req-{i:08d}", "lease_seconds": 21600}
        gpu = shape["gpu"]
        cands = [o for g in ([gpu] if isinstance(gpu, str) else gpu) for o in by_gpu.get(g, ())]
        out.append((("sched-a", "sched-b", "sched-c", "sched-d")[i % 4],
                    json.dumps(shape, separators=(",", ":")).encode(), cands[i % len(cands)]))
    return out


def fill_book(todo: list[tuple[str, bytes, Any]]) -> Any:
    """Each request decoded, placed and given its lease, so the request and the
    placement count with the lease; a quarter renewed once."""
    from broker.leasing.book import LeaseBook
    from broker.model import Placement, PlaceRequest
    from broker.wire.validation import parse_place

    book = LeaseBook()
    t = NOW
    made = []
    for scheduler, payload, offer in todo:
        # A fresh scheduler string each time, as a topic parsed per message gives.
        req = parse_place(f"P/requests/{scheduler}/place".split("/")[2], payload)
        assert isinstance(req, PlaceRequest), req
        placement = Placement.of(offer, max(1, req.gpus // max(offer.gpus, 1)))
        t += timedelta(milliseconds=7)
        made.append(book.create(req, placement, lease_seconds=req.lease_seconds or 3600,
                                cap=req.max_price_per_gpu_hour, now=t))
    for lease in made[::4]:
        t += timedelta(milliseconds=3)
        book.renew(lease.lease_id, lease.scheduler, t)
    return book


def restore(bodies: list[str]) -> Any:
    from broker.leasing.book import LeaseBook
    from broker.state.schema import lease_from

    book = LeaseBook()
    book.load(lease_from(json.loads(b)) for b in bodies)
    return book


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--leases", type=int, default=10_000)
    p.add_argument("--regions-per-cloud", type=int, default=88)
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout to measure")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    sys.path.insert(0, str(args.root))
    sys.path.insert(1, str(args.root / "bench"))
    from adapters.sim import SimAdapter
    from broker.state.schema import lease_row

    # The simulated cloud itself, and everything made on first use, outside the figures.
    sim = SimAdapter(seed=7, regions_per_cloud=args.regions_per_cloud, clock=lambda: NOW)
    warm = build_pool(sim)
    restore([lease_row(le, 1)[5] for le in fill_book(asks(warm, 100)).active()])
    del warm
    gc.collect()
    pool, pool_bytes, pool_types = measured(lambda: build_pool(sim))
    with tempfile.TemporaryDirectory() as folder:
        build_book(warm_pool := build_pool(sim), folder)  # made on first use, not counted
        build_index(warm_pool)
        del warm_pool
        _, recorded_bytes, recorded_types = measured(lambda: build_book(pool, folder))
    _, index_bytes, index_types = measured(lambda: build_index(pool))
    todo = asks(pool, args.leases)
    book, book_bytes, book_types = measured(lambda: fill_book(todo))
    active = book.active()
    t = time.perf_counter()
    bodies = [lease_row(le, 1)[5] for le in active]
    row_s = time.perf_counter() - t
    del book, active
    t = time.perf_counter()
    restored, restored_bytes, restored_types = measured(lambda: restore(bodies))
    restore_s = time.perf_counter() - t
    n, m = len(pool), len(restored.active())
    out = {
        "offers": n, "pool_bytes_per_offer": round(pool_bytes / n),
        "pool_tracked_per_offer": round(pool_types.total() / n, 2),
        "pool_tracked_types": dict(pool_types.most_common(6)),
        "recorder_bytes_per_offer": round(recorded_bytes / n),
        "recorder_tracked_per_offer": round(recorded_types.total() / n, 2),
        "recorder_tracked_types": dict(recorded_types.most_common(4)),
        "index_bytes_per_offer": round(index_bytes / n),
        "index_tracked_per_offer": round(index_types.total() / n, 2),
        "index_tracked_types": dict(index_types.most_common(4)),
        "leases": m, "book_bytes_per_lease": round(book_bytes / m),
        "book_tracked_per_lease": round(book_types.total() / m, 2),
        "book_tracked_types": dict(book_types.most_common(5)),
        "restored_bytes_per_lease": round(restored_bytes / m),
        "restored_tracked_per_lease": round(restored_types.total() / m, 2),
        "restore_seconds": round(restore_s, 2),
        "lease_row_us": round(row_s / m * 1e6, 1),
    }
    if args.json:
        print(json.dumps(out))
        return
    print(f"offers {n}: {out['pool_bytes_per_offer']} B each (the pool with its indexes "
          f"and estimator), {out['pool_tracked_per_offer']} tracked objects each\n"
          f"  by type: {out['pool_tracked_types']}\n"
          f"  the market recorder's book: {out['recorder_bytes_per_offer']} B an offer, "
          f"{out['recorder_tracked_per_offer']} tracked objects ({out['recorder_tracked_types']})\n"
          f"  the cost index after the mix: {out['index_bytes_per_offer']} B an offer, "
          f"{out['index_tracked_per_offer']} tracked objects ({out['index_tracked_types']})\n"
          f"leases {m}: {out['book_bytes_per_lease']} B each (request and placement "
          f"included), {out['book_tracked_per_lease']} tracked objects each\n"
          f"  by type: {out['book_tracked_types']}\n"
          f"restored from their stored form: {out['restored_bytes_per_lease']} B each, "
          f"{out['restored_tracked_per_lease']} tracked objects each; read and loaded in "
          f"{out['restore_seconds']} s (tracemalloc on); written as the store writes them "
          f"(lease_row) in {out['lease_row_us']} µs a lease")


if __name__ == "__main__":
    main()
