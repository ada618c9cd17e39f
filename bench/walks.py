"""How far a request's walk reads as the pool fills: offers walked and judged per request
shape, and CPU a request, on the daemon's placement path for small batches.

The simulated market of bench/latency.py (~20,000 offers), the `CostIndex` the daemon
keeps, the request mix of bench/latency.py placed one request a batch on the live pool
(as the event loop places a steady stream) and held, `--fill` of them first; then
`--rounds` rounds of the mix, counted: per shape, the offers the walk read from the
lists (`walked`) and those it judged by the rules (`judged`: the rest it passed over as
full, `rules.no_room`), and the CPU a request (`time.process_time`, counting included).

    python bench/walks.py [--fill 10000] [--rounds 20] [--default-cap USD]
                          [--allow-regions REGION ...]

`--default-cap`: a policy with a price cap for every request that names none (then every
walk is in order of price, where the walk ends at the cap); `--allow-regions`: a policy
that allows those regions only.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Iterator
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
    real_list, real_judge = walking._walk_list, walking._judge

    def counted_list(b: Any, p: Any, entries: Iterator[Any], *rest: Any, **kw: Any) -> None:
        def read() -> Iterator[Any]:
            for entry in entries:
                walked[shape[0]] += 1
                yield entry
        real_list(b, p, read(), *rest, **kw)

    def counted_judge(*a: Any) -> int:
        judged[shape[0]] += 1
        return real_judge(*a)

    walking._walk_list, walking._judge = counted_list, counted_judge  # type: ignore[assignment]

    def place(n: int) -> int:
        done = 0
        for b in range((n + 9) // 10):
            for req in requests(10, b)[:n - done]:
                done += 1
                c = evaluate(policy, req)
                if isinstance(c, Denied):
                    continue
                shape[0] = (",".join(req.gpu), req.gpus, req.market or "any",
                            req.max_price_per_gpu_hour,
                            ",".join(req.regions or ()) or ",".join(req.clouds or ()))
                result = solve([Ask(req, constraints=c)], world.pool, policy, now=world.now,
                               settings=settings, costs=index)
                for out in result.outcomes:
                    if isinstance(out, Decision):
                        world.pool.hold(out.placement.pool, out.placement.instances)
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
          f"{args.rounds} rounds of the mix: CPU a request {cpu / n * 1e3:.3f} ms")
    print(f"  {'shape (models, GPUs, market, cap, regions/clouds)':<70} {'walked':>8} "
          f"{'judged':>8}  a request")
    for key in sorted(walked, key=lambda k: -walked[k]):
        print(f"  {key!s:<70} {walked[key]:>8} {judged[key]:>8}  "
              f"{walked[key] / args.rounds:>8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
