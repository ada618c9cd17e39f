"""How far a request's walk reads as the pool fills: offers walked and judged per request
shape, and CPU a request, on the daemon's placement path for small batches.

The simulated market of bench/latency.py (~20,000 offers), the `CostIndex` the daemon
keeps, the request mix of bench/latency.py placed one request a batch on the live pool
(as the event loop places a steady stream) and held, `--fill` of them first; then
`--rounds` rounds of the mix, counted: per shape, the offers the walk read from the
lists (`walked`) and those it judged by the rules (`judged`: the rest it passed over as
full, `rules.no_room`, or as too dear once its list left one out), and the CPU a request
(`time.process_time`, counting included); and a digest of every decision (pool,
instances, cost, alternatives) and rejection (code, detail), the fill's included: a
change to the walk that must not change what it finds keeps it. Then, with nothing
counted, the CPU of each shape's `solve` alone (placed `--repeat` times over, nothing
held; the best of five).

    python bench/walks.py [--fill 10000] [--rounds 20] [--repeat 200] [--default-cap USD]
                          [--allow-regions REGION ...]

`--default-cap`: a policy with a price cap for every request that names none (then every
walk is in order of price, where the walk ends at the cap); `--allow-regions`: a policy
that allows those regions only.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parent.parent
sys.path[:0] = [str(ROOT), str(SCRIPT.parent)]

from batches import World, requests  # noqa: E402  (bench/batches.py's market and mix)

from broker.placement import walk as walking  # noqa: E402
from broker.placement.optimizer import (  # noqa: E402
    Ask,
    BatchSettings,
    CostIndex,
    Decision,
    solve,
)
from policies.evaluate import Denied, evaluate  # noqa: E402
from policies.model import Policy  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fill", type=int, default=10_000, help="placements held first")
    ap.add_argument("--rounds", type=int, default=20, help="rounds of the mix counted")
    ap.add_argument("--regions-per-cloud", type=int, default=88)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--repeat", type=int, default=200,
                    help="solves a run of each shape's uncounted timing")
    ap.add_argument("--default-cap", type=float, default=None, metavar="USD",
                    help="the policy's defaults.max_price_per_gpu_hour (none)")
    ap.add_argument("--allow-regions", nargs="+", default=None, metavar="REGION",
                    help="the policy's regions.allow (none: any)")
    args = ap.parse_args()

    world = World(args.regions_per_cloud, args.seed)
    spec: dict[str, Any] = {}
    if args.default_cap is not None:
        spec["defaults"] = {"max_price_per_gpu_hour": args.default_cap}
    if args.allow_regions:
        spec["regions"] = {"allow": args.allow_regions}
    policy = Policy.model_validate(spec)
    index = CostIndex(world.pool, policy)
    settings = BatchSettings(exact_max_batch=0)
    walked: Counter[Any] = Counter()
    judged: Counter[Any] = Counter()
    shape: list[Any] = [None]
    real_lists, real_judge = walking._walk_lists, walking._judge

    def counted_lists(b: Any, p: Any, lists: Iterable[Iterable[Any]], *rest: Any,
                      **kw: Any) -> None:
        def read(entries: Iterable[Any]) -> Iterator[Any]:
            for entry in entries:
                walked[shape[0]] += 1
                yield entry
        real_lists(b, p, (read(e) for e in lists), *rest, **kw)

    def counted_judge(*a: Any) -> int:
        judged[shape[0]] += 1
        return real_judge(*a)

    walking._walk_lists, walking._judge = counted_lists, counted_judge  # type: ignore[assignment]

    digest = hashlib.sha256()

    def place(n: int) -> int:
        done = 0
        for b in range((n + 9) // 10):
            for req in requests(10, b)[:n - done]:
                done += 1
                c = evaluate(policy, req)
                if isinstance(c, Denied):
                    continue
                shape[0] = shape_of(req)
                result = solve([Ask(req, constraints=c)], world.pool, policy, now=world.now,
                               settings=settings, costs=index)
                for out in result.outcomes:
                    if isinstance(out, Decision):
                        world.pool.hold(out.placement.pool, out.placement.instances)
                        digest.update(repr((
                            out.placement.pool, out.placement.instances,
                            round(out.expected_cost_per_hour, 9),
                            [(a.pool, a.instances) for a in out.alternatives])).encode())
                    else:
                        digest.update(repr((out.code, out.detail)).encode())
        return done

    print(f"filling: {args.fill} requests of the mix, placed and held", file=sys.stderr,
          flush=True)
    place(args.fill)
    walked.clear()
    judged.clear()
    started = time.process_time()
    n = place(10 * args.rounds)
    cpu = time.process_time() - started
    print(f"{len(world.pool)} offers; {args.fill} requests placed first; then "
          f"{args.rounds} rounds of the mix: CPU a request {cpu / n * 1e3:.3f} ms; "
          f"decisions and reasons {digest.hexdigest()[:16]}")
    print(f"  {'shape (models, GPUs, market, cap, regions/clouds)':<70} {'walked':>8} "
          f"{'judged':>8}  a request")
    for key in sorted(walked, key=lambda k: -walked[k]):
        print(f"  {key!s:<70} {walked[key]:>8} {judged[key]:>8}  "
              f"{walked[key] / args.rounds:>8.0f}")
    walking._walk_lists, walking._judge = real_lists, real_judge  # type: ignore[assignment]
    uncounted(world, policy, index, settings, args.fill + 10 * args.rounds, args.repeat)
    return 0


def shape_of(req: Any) -> tuple[Any, ...]:
    """(models, GPUs, market, cap, regions or clouds): what the table names a request by."""
    return (",".join(req.gpu), req.gpus, req.market or "any", req.max_price_per_gpu_hour,
            ",".join(req.regions or ()) or ",".join(req.clouds or ()))


def uncounted(world: World, policy: Policy, index: CostIndex, settings: BatchSettings,
              batch: int, repeat: int) -> None:
    """The CPU of each shape's `solve` on the pool as the rounds left it, with nothing
    counted: placed `repeat` times over (nothing held), the best of five runs."""
    print(f"  {'CPU a solve, uncounted (best of 5 × ' + str(repeat) + ')':<70} {'µs':>8}")
    for req in requests(10, batch):
        c = evaluate(policy, req)
        if isinstance(c, Denied):
            continue
        ask = [Ask(req, constraints=c)]
        best = math.inf
        for _ in range(5):
            started = time.process_time()
            for _ in range(repeat):
                solve(ask, world.pool, policy, now=world.now, settings=settings, costs=index)
            best = min(best, (time.process_time() - started) / repeat)
        print(f"  {shape_of(req)!s:<70} {best * 1e6:>8.1f}")


if __name__ == "__main__":
    sys.exit(main())
