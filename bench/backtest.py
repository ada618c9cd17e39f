"""A week of the simulated market, a few thousand requests, four strategies side by side.

    python bench/backtest.py                       # sim:7d, gen:3000, the four strategies
    python bench/backtest.py --variants            # + gpubroker under other scoring weights
    python bench/backtest.py --days 2 --requests 800 --json

Prints the backtest table (the same as `gpubroker backtest`), how long generating the
market took, and the backtest's own speed in simulated hours per second (wall and CPU:
on a shared machine the CPU figure is the steadier one). `--variants` adds rows for
gpubroker with other `scoring` weights and pool-history half-lives
(`hazard_half_life_hours`; 0 scores spot pools by the last poll only), run in the same
simulation (same market, same requests, same interruption draws), to show which
settings move it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from broker.backtest import STRATEGIES
from broker.backtest.compare import Comparison, Result, write_table
from broker.backtest.engine import Settings, simulate
from broker.backtest.market import SimSpec, hazard_schedule, simulate_market
from broker.backtest.strategies import Strategy, build
from broker.backtest.workload import generate_workload
from policies.model import Policy, Scoring

# gpubroker under other scoring weights: (label, scoring fields over the defaults)
VARIANTS: tuple[tuple[str, dict[str, float]], ...] = (
    ("gpubroker availability_weight=0", {"availability_weight": 0.0}),
    ("gpubroker restart_hours=4", {"restart_hours": 4.0}),
    ("gpubroker availability_weight=1", {"availability_weight": 1.0}),
    ("gpubroker restart_hours=8 availability_weight=2",
     {"restart_hours": 8.0, "availability_weight": 2.0}),
    ("gpubroker no risk terms", {"restart_hours": 0.0, "availability_weight": 0.0}),
    ("gpubroker hazard_half_life_hours=0", {"hazard_half_life_hours": 0.0}),
    ("gpubroker hazard_half_life_hours=24", {"hazard_half_life_hours": 24.0}),
    ("gpubroker restart_hours=16 availability_weight=8",
     {"restart_hours": 16.0, "availability_weight": 8.0}),
    ("gpubroker restart_hours=16 availability_weight=8 hazard_half_life_hours=0",
     {"restart_hours": 16.0, "availability_weight": 8.0, "hazard_half_life_hours": 0.0}),
    ("gpubroker restart_hours=32 availability_weight=4",
     {"restart_hours": 32.0, "availability_weight": 4.0}),
    ("gpubroker restart_hours=8 availability_weight=8",
     {"restart_hours": 8.0, "availability_weight": 8.0}),
    *((f"gpubroker interruption_cost_per_gpu={c:g}", {"interruption_cost_per_gpu": c})
      for c in (5.0, 10.0, 20.0, 30.0, 40.0, 60.0)),
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--days", type=float, default=7.0)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--regions", type=int, default=3, help="regions per cloud")
    ap.add_argument("--restart-hours", type=float, default=0.5)
    ap.add_argument("--step-minutes", type=float, default=10.0)
    ap.add_argument("--variants", action="store_true",
                    help="also gpubroker under other scoring weights")
    ap.add_argument("--json", action="store_true", help="the report as JSON")
    args = ap.parse_args()

    settings = Settings(seed=args.seed, step_seconds=args.step_minutes * 60,
                        restart_hours=args.restart_hours)
    t0, c0 = time.perf_counter(), time.process_time()
    market = simulate_market(SimSpec(args.days * 86400, args.seed, args.regions),
                             step_seconds=settings.step_seconds)
    gen_wall, gen_cpu = time.perf_counter() - t0, time.process_time() - c0
    workload = generate_workload(args.requests, seed=args.seed, market=market)

    policy = Policy(scoring=Scoring(restart_hours=args.restart_hours))
    strategies: list[Strategy] = [build(n, policy) for n in STRATEGIES]
    if args.variants:
        for label, weights in VARIANTS:
            scoring = policy.scoring.model_copy(update=weights)
            s = build("gpubroker", policy.model_copy(update={"scoring": scoring}))
            s.name = label
            strategies.append(s)

    t1, c1 = time.perf_counter(), time.process_time()
    schedule = hazard_schedule(market, seed=settings.seed, step_seconds=settings.step_seconds,
                               default_rate=settings.default_interruption_rate)
    tallies = simulate(market, workload, strategies, schedule, settings)
    wall, cpu = time.perf_counter() - t1, time.process_time() - c1
    results = tuple(Result(s.name, s.how, t) for s, t in zip(strategies, tallies, strict=True))
    c = Comparison(market, workload, settings,
                   f"embedded (market any, restart_hours {args.restart_hours:g})", results,
                   wall, cpu)
    if args.json:
        report = c.to_json()
        report["timing"] = {"market_generation_wall_seconds": round(gen_wall, 2),
                            "market_generation_cpu_seconds": round(gen_cpu, 2),
                            "simulation_wall_seconds": round(wall, 2),
                            "simulation_cpu_seconds": round(cpu, 2),
                            "simulated_hours": c.simulated_hours}
        print(json.dumps(report, indent=2))
        return 0
    write_table(c, sys.stdout)
    print()
    print(f"market generated in {gen_wall:.1f} s wall ({gen_cpu:.1f} s CPU): "
          f"{market.rows:,} rows, {market.pools} pools")
    print(f"{c.speed_line()}; {c.simulated_hours / cpu:,.1f} per CPU second")
    return 0


if __name__ == "__main__":
    sys.exit(main())
