"""CPU per batch on the daemon's placement path, with and without the cost memo.

What the daemon does for each small batch at a steady request rate, without MQTT or the
store around it: the simulated market's ~20,000 offers in a real `ResourcePool` with a
hazard estimator fed from the polls, the request mix of bench/latency.py, the policy's
verdict per request, `CostIndex.frozen` and `solve` on a `Snapshot` (the heuristic, as
while requests wait), each placement held in the pool, one region polled again every
`--poll-every` batches (its changed offers are new readings, costed afresh). The same
run twice, state rebuilt and seeded alike: with the `CostMemo` kept across batches (the
daemon's), and with a fresh one per batch (as before it existed), alternating
`--rounds` times; CPU time (`time.process_time`) per batch, median and p90, and their
ratio. Placements are compared between the two runs: they must be the same.

`--fill N`: instead, CPU per batch as the pool fills — N placements held and never given
back, batch after batch, one region polled every `--poll-every` batches; the CPU counted
is all a batch costs the daemon: the `Snapshot`, `CostIndex.frozen`, `solve`, holding
its placements and the polls (copies the pool makes of what a snapshot borrowed are
made there); median per `--fill-step` placements, `--rounds` runs, and a digest of the
placements (the same on every run).

    python bench/batches.py [--batches 400] [--batch-size 8] [--rounds 2]
    python bench/batches.py --fill 12000 [--fill-step 2000] [--rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parent.parent
sys.path[:0] = [str(ROOT), str(SCRIPT.parent)]

from latency import MIX  # noqa: E402  (bench/latency.py's request mix)

from adapters.sim import SimAdapter  # noqa: E402
from broker.market.hazard import HazardEstimator, horizon_bucket  # noqa: E402
from broker.market.pool import ResourcePool  # noqa: E402
from broker.model import PlaceRequest  # noqa: E402
from broker.placement.optimizer import (  # noqa: E402
    Ask,
    BatchSettings,
    CostIndex,
    Decision,
    Snapshot,
    solve,
)
from broker.placement.view import CostMemo, FrozenCosts  # noqa: E402
from policies.evaluate import Denied, evaluate  # noqa: E402
from policies.model import Policy  # noqa: E402

T0 = datetime(2026, 12, 1, tzinfo=UTC)


def requests(n: int, batch: int) -> list[PlaceRequest]:
    out = []
    for i in range(n):
        shape = dict(MIX[i % len(MIX)])
        gpu = shape.pop("gpu")
        out.append(PlaceRequest(scheduler=f"sched-{i % 4}", request_id=f"r{batch}-{i}",
                                gpu=tuple(gpu) if isinstance(gpu, list) else (gpu,),
                                clouds=tuple(shape.pop("clouds", ())) or None,
                                regions=tuple(shape.pop("regions", ())) or None, **shape))
    return out


class World:
    """The market, the pool and its estimator, as the daemon keeps them."""

    def __init__(self, regions_per_cloud: int, seed: int) -> None:
        self.now = T0
        self.sim = SimAdapter(seed=seed, regions_per_cloud=regions_per_cloud,
                              clock=lambda: self.now)
        self.pool = ResourcePool(stale_after_seconds=1e9, clock=lambda: self.now)
        self.pool.hazard = HazardEstimator()
        self.regions = list(self.sim.regions())
        self.next = 0
        for region in self.regions:
            self.poll(region)

    def poll(self, region: str) -> None:
        offers = asyncio.run(self.sim.poll(region))
        cloud, name = region.split(":", 1)
        change = self.pool.replace((cloud, name), offers)
        assert self.pool.hazard is not None
        self.pool.hazard.observe_change(change, self.now.timestamp())

    def poll_next(self) -> None:
        self.now += timedelta(seconds=1)
        self.poll(self.regions[self.next % len(self.regions)])
        self.next += 1


def run(args: argparse.Namespace, *, keep: bool) -> tuple[list[float], list[Any]]:
    world = World(args.regions_per_cloud, args.seed)
    policy = Policy()
    index = CostIndex(world.pool, policy)
    settings = BatchSettings(exact_max_batch=0)
    cpu: list[float] = []
    placed: list[Any] = []
    for b in range(args.batches):
        if b and b % args.poll_every == 0:
            world.poll_next()
        asks = []
        for req in requests(args.batch_size, b):
            c = evaluate(policy, req)
            if not isinstance(c, Denied):
                asks.append(Ask(req, constraints=c))
        c0 = time.process_time()
        view = Snapshot(world.pool, world.now)
        costs = index.frozen({horizon_bucket(a.request.duration_hours) for a in asks},
                             {a.constraints.risk for a in asks if a.constraints})
        if not keep:
            costs = FrozenCosts(costs.policy, costs._lists, costs._normalise,
                                memo=CostMemo())
        result = solve(asks, view, policy, now=world.now, settings=settings, costs=costs)
        cpu.append(time.process_time() - c0)
        for out in result.outcomes:
            if isinstance(out, Decision):
                p = out.placement
                world.pool.hold(p.pool, p.instances)
                placed.append((out.ask.request.request_id, p.pool, p.instances))
            else:
                placed.append((out.ask.request.request_id, None, 0))
    return cpu, placed


def fill(args: argparse.Namespace) -> tuple[dict[int, list[float]], str]:
    """CPU per batch by placements held before it (in steps of `--fill-step`), and a
    digest of the placements."""
    import hashlib

    world = World(args.regions_per_cloud, args.seed)
    policy = Policy()
    index = CostIndex(world.pool, policy)
    settings = BatchSettings(exact_max_batch=0)
    cpu: dict[int, list[float]] = {}
    digest = hashlib.sha256()
    placed = 0
    for b in range(args.fill // args.batch_size):
        asks = []
        for req in requests(args.batch_size, b):
            c = evaluate(policy, req)
            if not isinstance(c, Denied):
                asks.append(Ask(req, constraints=c))
        step = placed // args.fill_step * args.fill_step
        c0 = time.process_time()
        if b and b % args.poll_every == 0:
            world.poll_next()
        view = Snapshot(world.pool, world.now)
        costs = index.frozen({horizon_bucket(a.request.duration_hours) for a in asks},
                             {a.constraints.risk for a in asks if a.constraints})
        result = solve(asks, view, policy, now=world.now, settings=settings, costs=costs)
        for out in result.outcomes:
            if isinstance(out, Decision):
                world.pool.hold(out.placement.pool, out.placement.instances)
                placed += 1
        cpu.setdefault(step, []).append(time.process_time() - c0)
        for out in result.outcomes:
            p = out.placement if isinstance(out, Decision) else None
            digest.update(repr((out.ask.request.request_id, p and p.pool,
                                p and p.instances)).encode())
    return cpu, digest.hexdigest()[:16]


def main_fill(args: argparse.Namespace) -> int:
    figures: dict[int, list[float]] = {}
    digests = set()
    for r in range(args.rounds):
        cpu, digest = fill(args)
        digests.add(digest)
        for step, xs in cpu.items():
            figures.setdefault(step, []).append(statistics.median(xs))
        print(f"round {r + 1}: placements {digest}", file=sys.stderr, flush=True)
    print(f"CPU a batch of {args.batch_size} (median of batch medians over {args.rounds} "
          f"round(s)) as the pool fills, a region polled every {args.poll_every} batches")
    for step in sorted(figures):
        print(f"  {step:>6} placements held: {statistics.median(figures[step]) * 1e3:.2f} ms")
    print(f"  placements: {' '.join(sorted(digests))}")
    return 0 if len(digests) == 1 else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=8,
                    help="requests a batch (8: about 500/s at a batch every 16 ms)")
    ap.add_argument("--poll-every", type=int, default=4,
                    help="batches between two region polls (4: ~350 regions in 96 s at "
                         "500/s)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--regions-per-cloud", type=int, default=88)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--fill", type=int, default=0,
                    help="placements to hold, reporting CPU a batch as the pool fills")
    ap.add_argument("--fill-step", type=int, default=2000)
    args = ap.parse_args()
    if args.fill:
        return main_fill(args)
    figures: dict[bool, list[float]] = {True: [], False: []}
    placements: dict[bool, list[Any]] = {}
    for r in range(args.rounds):
        for keep in (False, True):
            cpu, placed = run(args, keep=keep)
            figures[keep] += cpu
            if keep in placements:
                assert placements[keep] == placed, "placements differ between rounds"
            placements[keep] = placed
            print(f"round {r + 1}, memo {'kept' if keep else 'fresh'}: "
                  f"{statistics.median(cpu) * 1e3:.2f} ms median CPU a batch",
                  file=sys.stderr, flush=True)
    same = placements[True] == placements[False]

    def q(xs: list[float], p: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] * 1e3

    print(f"{args.batches} batches of {args.batch_size} × {args.rounds} rounds, "
          f"{len(SimAdapter(seed=args.seed, regions_per_cloud=args.regions_per_cloud).regions())}"
          f" regions, a region polled every {args.poll_every} batches")
    for keep in (False, True):
        xs = figures[keep]
        print(f"  memo {'kept across batches' if keep else 'fresh per batch     '}: CPU a "
              f"batch median {q(xs, 0.5):.2f} ms, p90 {q(xs, 0.9):.2f} ms, "
              f"total {sum(xs):.2f} s")
    ratio = statistics.median(figures[True]) / statistics.median(figures[False])
    print(f"  kept / fresh (median): {ratio:.2f}; placements identical: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
