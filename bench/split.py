"""Split placements (`gang: false` with `max_parts`): what they place that one pool
cannot, and what they save, on the simulated market.

A stream of requests (8 to 256 GPUs of one model, `market: any`, some with a price cap)
is placed batch by batch on one poll of the simulated market, each decision holding its
capacity, twice side by side: every request whole (`max_parts` 1) and every request
allowed up to `--max-parts` parts. Prints, per run: requests placed, GPUs placed, the
mean expected cost per placed GPU-hour, how many were split (because no one pool had
room, or because the split was cheaper) and the solve time per batch (median, p99).

    python bench/split.py                       # seeds 7 8 9, 600 requests, 4 parts
    python bench/split.py --seeds 7 --requests 2000 --max-parts 8
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

SCRIPT = Path(__file__).resolve()
sys.path[:0] = [str(SCRIPT.parent.parent)]

from adapters.sim import SimAdapter  # noqa: E402
from broker.market.pool import ResourcePool  # noqa: E402
from broker.model import PlaceRequest  # noqa: E402
from broker.placement.optimizer import Ask, Decision, solve  # noqa: E402
from policies.model import Policy  # noqa: E402

T0 = datetime(2026, 11, 30, 12, tzinfo=UTC)


async def market(seed: int) -> ResourcePool:
    adapter = SimAdapter(seed=seed, regions_per_cloud=2, zones_per_region=3,
                         clock=lambda: T0)
    pool = ResourcePool(stale_after_seconds=300, clock=lambda: T0)
    for region in adapter.regions():
        pool.replace(("sim", region), await adapter.poll(region))
    await adapter.close()
    return pool


def workload(pool: ResourcePool, n: int, seed: int) -> list[PlaceRequest]:
    rng = random.Random(seed)
    models = sorted({o.gpu for o in pool if o.price_per_hour is not None})
    out = []
    for i in range(n):
        out.append(PlaceRequest(
            scheduler="bench", request_id=f"r{i}", gpu=(rng.choice(models),),
            gpus=rng.choice([8, 8, 16, 16, 32, 64, 128, 256]), market="any",
            duration_hours=rng.choice([1.0, 4.0, 16.0]),
            max_price_per_gpu_hour=rng.choice([None, None, 4.0])))
    return out


def run(pool: ResourcePool, reqs: list[PlaceRequest], parts: int, batch: int
        ) -> dict[str, float]:
    policy = Policy()
    placed = gpus = split = 0
    cost = 0.0
    times: list[float] = []
    for start in range(0, len(reqs), batch):
        asks = [Ask(replace(r, gang=parts == 1, max_parts=parts))
                for r in reqs[start:start + batch]]
        t = time.perf_counter()
        result = solve(asks, pool, policy, now=T0)
        times.append(time.perf_counter() - t)
        for out in result.outcomes:
            if not isinstance(out, Decision):
                continue
            placed += 1
            gpus += out.ask.request.gpus
            cost += out.expected_cost_per_hour
            split += bool(out.parts)
            for p, _ in out.parts or ((out.placement, 0),):
                pool.hold(p.pool, p.instances)
    times.sort()
    return {"placed": placed, "gpus": gpus, "per_gpu": cost / gpus if gpus else 0.0,
            "split": split, "median_ms": 1000 * statistics.median(times),
            "p99_ms": 1000 * times[min(len(times) - 1, int(0.99 * len(times)))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[7, 8, 9])
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--batch", type=int, default=20)
    ap.add_argument("--max-parts", type=int, default=4)
    args = ap.parse_args()
    print(f"{args.requests} requests in batches of {args.batch}, simulated market "
          f"(2 regions × 3 zones per cloud); whole vs up to {args.max_parts} parts")
    print(f"{'seed':>4}  {'mode':<8} {'placed':>6} {'GPUs':>7} {'$/GPU-h exp.':>12} "
          f"{'split':>5} {'batch ms p50':>12} {'p99':>7}")
    for seed in args.seeds:
        for parts in (1, args.max_parts):
            pool = asyncio.run(market(seed))
            reqs = workload(pool, args.requests, seed)
            r = run(pool, reqs, parts, args.batch)
            mode = "whole" if parts == 1 else f"parts≤{parts}"
            print(f"{seed:>4}  {mode:<8} {r['placed']:>6} {r['gpus']:>7} "
                  f"{r['per_gpu']:>12.4f} {r['split']:>5} {r['median_ms']:>12.2f} "
                  f"{r['p99_ms']:>7.2f}")


if __name__ == "__main__":
    main()
