"""The four strategies over every market: the simulated one and the real traces, several
seeds each; or one simulated week, with gpubroker under other scoring weights.

    python bench/backtest.py                       # every market, 5 seeds each
    python bench/backtest.py --seeds 10 --policy policy.yaml
    python bench/backtest.py --single              # sim:7d, gen:3000, one seed
    python bench/backtest.py --variants            # + gpubroker under other scoring weights
    python bench/backtest.py --single --days 2 --requests 800 --json

**Every market** (the default, `--all-markets`): `sim:7d` (`--days`) with `gen:1000`
(`--requests`), and each trace in data/traces with a workload sized for it — the 9-zone
AWS trace (1,091 h) `gen:2000`, the 16-node AWS trace (390 h, at most 16 instances a
zone in 3 zones) `gen:400`, the GCP trace (336 h) `gen:1000` — each over `--seeds` runs
(5): run i takes seed `--seed` + i for the market (the simulated market's, or the
permutation of a trace's zone labels), the workload and the draws. For each market it
prints the table of `gpubroker backtest --seeds N` (mean ± the 95 % Student-t interval's
half-width per strategy, then each seed's figures), two goal lines —

    gpubroker $/useful ≤ cheapest_spot + 1 %: met/not met (x vs y)
    gpubroker intr/1k ≤ price_capacity: met/not met (x vs y)

(means over the seeds; the figures add the paired difference, seed by seed, with its
95 % interval) — and its wall and CPU time. `--policy FILE` runs gpubroker (and
the baselines' copies of it, zero-weighted) under that policy instead of the embedded
one (the daemon's default policy; `--restart-hours` sets its
`scoring.restart_hours`). About 2 minutes of CPU
at the defaults.

**One simulated week** (`--single`, or `--variants`): the backtest table (the same as
`gpubroker backtest`), how long generating the market took, and the backtest's own speed
in simulated hours per second (wall and CPU: on a shared machine the CPU figure is the
steadier one). `--variants` adds rows for gpubroker with other `scoring` weights and
pool-history half-lives (`hazard_half_life_hours`; 0 scores spot pools by the last poll
only), run in the same simulation (same market, same requests, same interruption draws),
to show which settings move it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from broker.backtest import STRATEGIES
from broker.backtest.compare import (
    Comparison,
    Result,
    Seeds,
    compare,
    embedded_policy,
    t_interval,
)
from broker.backtest.draws import hazard_schedule
from broker.backtest.engine import simulate
from broker.backtest.ledger import Settings
from broker.backtest.market import SimSpec, load_market, simulate_market
from broker.backtest.report import write_seeds_table, write_table
from broker.backtest.strategies import Strategy, build
from broker.backtest.workload import generate_workload
from policies.loader import load_policy
from policies.model import Policy

TRACES = Path(__file__).resolve().parent.parent / "data" / "traces"
# (trace file, requests generated for it)
TRACE_MARKETS = (
    ("aws-v100-p3-9az-2023-02-15.csv.gz", 2000),
    ("aws-v100-p3-16node-3az-2023-08-27.csv.gz", 400),
    ("gcp-gpu-weekly-2025-02-27.csv.gz", 1000),
)

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


def goals(seeds: Seeds) -> list[tuple[str, bool | None, str]]:
    """The two goal lines of a market: (goal, met (None: not measurable), x vs y), met
    on the means over the seeds. The figures add the paired difference, gpubroker's
    figure less the other's seed by seed, mean ± its 95 % t interval: the seeds move all
    strategies together, so it is much tighter than either interval."""
    means = {row["strategy"]: row for row in seeds.summary()["strategies"]}
    runs = [{f["strategy"]: f for f in run["strategies"]} for run in seeds.per_seed()]

    def mean(strategy: str, figure: str) -> float | None:
        row = means.get(strategy)
        return None if row is None else row[figure]["mean"]

    out: list[tuple[str, bool | None, str]] = []
    for goal, figure, other, slack, fmt in (
            ("gpubroker $/useful ≤ cheapest_spot + 1 %", "cost_per_useful_gpu_hour",
             "cheapest_spot", 1.01, "{:.4f}"),
            ("gpubroker intr/1k ≤ price_capacity", "interruptions_per_1000_gpu_hours",
             "price_capacity", 1.0, "{:.2f}")):
        x, y = mean("gpubroker", figure), mean(other, figure)
        if x is None or y is None:
            out.append((goal, None, "not measured"))
            continue
        text = f"{fmt.format(x)} vs {fmt.format(y)}"
        diffs = [r["gpubroker"][figure] - r[other][figure] for r in runs
                 if r["gpubroker"][figure] is not None and r[other][figure] is not None]
        if len(diffs) > 1:
            d, half = t_interval(diffs)
            text += f"; paired difference {fmt.format(d)} ± {fmt.format(half or 0.0)}"
        out.append((goal, x <= y * slack, text))
    return out


def all_markets(args: argparse.Namespace, policy: Policy, policy_name: str) -> int:
    settings = Settings(step_seconds=args.step_minutes * 60,
                        restart_hours=policy.scoring.restart_hours)
    markets = [(f"sim:{args.days:g}d", args.requests if args.requests is not None else 1000)]
    markets += [(os.path.relpath(TRACES / name), n) for name, n in TRACE_MARKETS]
    t_all, c_all = time.perf_counter(), time.process_time()
    reports = []
    for text, requests in markets:
        t0, c0 = time.perf_counter(), time.process_time()
        runs = []
        for i in range(args.seeds):
            seed = args.seed + i
            spec = f"{text}:{seed}:{args.regions}" if text.startswith("sim:") else text
            print(f"{Path(text).name}: seed {i + 1}/{args.seeds}", file=sys.stderr,
                  flush=True)
            market = load_market(spec, seed=seed, step_seconds=settings.step_seconds)
            workload = generate_workload(requests, seed=seed, market=market)
            runs.append(compare(market, workload, STRATEGIES, policy,
                                replace(settings, seed=seed, market_seed=market.seed,
                                        workload_seed=workload.seed),
                                policy_name=policy_name))
        seeds = Seeds(tuple(runs))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        met = goals(seeds)
        if args.json:
            reports.append({**seeds.to_json(), "goals": [
                {"goal": g, "met": ok, "figures": f} for g, ok, f in met],
                "timing": {"wall_seconds": round(wall, 2), "cpu_seconds": round(cpu, 2)}})
            continue
        write_seeds_table(seeds, sys.stdout)
        print()
        for goal, ok, figures in met:
            print(f"{goal}: {'not measured' if ok is None else 'met' if ok else 'not met'}"
                  f" ({figures})")
        print(f"{args.seeds} seeds (market generation and simulation) in {wall:.1f} s wall "
              f"({cpu:.1f} s CPU)")
        print("\n")
    wall, cpu = time.perf_counter() - t_all, time.process_time() - c_all
    if args.json:
        print(json.dumps({"markets": reports, "wall_seconds": round(wall, 2),
                          "cpu_seconds": round(cpu, 2)}, indent=2))
    else:
        print(f"every market: {wall:.1f} s wall ({cpu:.1f} s CPU)")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--all-markets", action="store_true",
                      help="the simulated market and every trace, --seeds each (default)")
    mode.add_argument("--single", action="store_true",
                      help="one simulated market, one seed (as --variants without them)")
    ap.add_argument("--days", type=float, default=7.0)
    ap.add_argument("--requests", type=int, default=None,
                    help="requests generated for the simulated market (every market: "
                         "1000; --single: 3000)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--seeds", type=int, default=5,
                    help="runs per market, seeds --seed, --seed+1, ... (every market; 5)")
    ap.add_argument("--regions", type=int, default=3, help="regions per cloud")
    ap.add_argument("--restart-hours", type=float,
                    help="the embedded policy's scoring.restart_hours (default: the "
                         "default policy's)")
    ap.add_argument("--step-minutes", type=float, default=10.0)
    ap.add_argument("--policy", type=Path, metavar="FILE",
                    help="gpubroker's policy (YAML); default: the daemon's default "
                         "policy, with --restart-hours if given")
    ap.add_argument("--variants", action="store_true",
                    help="also gpubroker under other scoring weights (one simulated week)")
    ap.add_argument("--json", action="store_true", help="the report as JSON")
    args = ap.parse_args()
    if args.seeds < 1:
        ap.error("--seeds must be >= 1")
    if args.variants and args.all_markets:
        ap.error("--variants runs one simulated week; leave out --all-markets")
    if args.policy is not None:
        policy, policy_name = load_policy(args.policy), str(args.policy)
    else:
        policy, policy_name = embedded_policy(args.restart_hours)
    if not (args.single or args.variants):
        return all_markets(args, policy, policy_name)
    if args.requests is None:
        args.requests = 3000

    settings = Settings(seed=args.seed, step_seconds=args.step_minutes * 60,
                        restart_hours=policy.scoring.restart_hours)
    t0, c0 = time.perf_counter(), time.process_time()
    market = simulate_market(SimSpec(args.days * 86400, args.seed, args.regions),
                             step_seconds=settings.step_seconds)
    gen_wall, gen_cpu = time.perf_counter() - t0, time.process_time() - c0
    workload = generate_workload(args.requests, seed=args.seed, market=market)

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
    c = Comparison(market, workload, settings, policy_name, results, wall, cpu)
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
