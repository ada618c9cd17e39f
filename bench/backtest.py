"""The strategies over every market: the simulated one (independent and correlated
interruptions) and the real traces, several held-out seeds each; or one simulated week,
with gpubroker under other scoring weights.

    python bench/backtest.py                       # every market, 5 held-out seeds each
    python bench/backtest.py --tune                # the risk presets' candidates, tuning seeds
    python bench/backtest.py --seeds 10 --policy policy.yaml
    python bench/backtest.py --single              # sim:7d, gen:3000, one seed
    python bench/backtest.py --variants            # + gpubroker under other scoring weights
    python bench/backtest.py --single --days 2 --requests 800 --json

**Seeds.** The defaults — the risk levels' weights in `policies/risk.py` among them —
were chosen on the tuning seeds 7-11 (`--tuning`, and `--tune` for the candidates) and
are reported on the held-out seeds 101-105 (the default), never used to choose
anything. `--seed N` starts elsewhere.

**Every market** (the default): `sim:7d` (`--days`) with `gen:1000` (`--requests`), twice:
with a quarter of each pool's hazard pool-wide (independent: most interruptions strike
one instance, as gang scoring assumes) and with 90 % pool-wide (correlated: mostly
capacity reclaims that take every lease of a pool at once); then each trace in
data/traces with a workload sized for it — the 9-zone AWS trace (1,091 h) `gen:2000`,
the 16-node AWS trace (390 h) `gen:400`, the GCP trace (336 h) `gen:1000` — each over
`--seeds` runs (5): run i takes seed first + i for the market (the simulated market's,
or the permutation of a trace's zone labels), the workload and the draws. The draws of
the simulated market follow its hidden true hazard; those of a trace its rows' rates (or
the default) times a hidden per-pool factor (the report says which).

Rows: the four strategies of `gpubroker backtest` (gpubroker at the policy's risk level,
`balanced` by default), gpubroker at the other two risk levels, and the oracle —
gpubroker's policy seeing the true hazards the draws follow. For each market it prints
the table (mean ± the 95 % Student-t interval's half-width per strategy, then each
seed's figures), the goal lines (`GOALS`, met on the means, with the paired difference
to the bound seed by seed and its interval), the spot GPU-hours per cloud of
cheapest_spot, price_capacity, gpubroker and the oracle, and its wall and CPU time.
`--policy FILE` runs gpubroker (and the baselines' copies of it, zero-weighted) under
that policy instead of the embedded one (the daemon's default policy).

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
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from broker.backtest import STRATEGIES
from broker.backtest.compare import (
    Comparison,
    Extra,
    Result,
    Seeds,
    compare,
    embedded_policy,
    t_interval,
)
from broker.backtest.draws import (
    CORRELATED_POOL_WIDE_SHARE,
    POOL_WIDE_SHARE,
    HazardSchedule,
    hazard_schedule,
)
from broker.backtest.engine import simulate
from broker.backtest.ledger import Settings
from broker.backtest.market import MarketTrace, SimSpec, load_market, simulate_market
from broker.backtest.report import write_seeds_table, write_table
from broker.backtest.strategies import Oracle, Strategy, build
from broker.backtest.workload import generate_workload
from policies.loader import load_policy
from policies.model import Policy

TRACES = Path(__file__).resolve().parent.parent / "data" / "traces"
TUNING_SEED = 7
"""The first of the seeds the defaults were chosen on (`--tuning`, `--tune`)."""
HELD_OUT_SEED = 101
"""The first of the seeds the results are reported on (the default)."""

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


LEVELS = ("lowest-cost", "fewest-interruptions")
"""The risk levels run beside gpubroker's own (the policy's `scoring.risk`, balanced by
default), as rows `gpubroker <level>`."""

# The candidate risk weights `--tune` compares: (restart_hours, availability_weight,
# interruption_cost_per_gpu).
CANDIDATES: tuple[tuple[float, float, float], ...] = (
    (0.5, 0.25, 0.0), (0.5, 0.25, 0.5), (0.5, 0.25, 1.0), (0.5, 0.25, 2.0),
    (1.0, 0.25, 1.0), (0.5, 0.5, 1.0), (0.5, 0.25, 5.0), (0.5, 0.25, 10.0),
    (0.5, 0.25, 20.0), (1.0, 1.0, 10.0), (2.0, 1.0, 20.0), (0.5, 0.25, 40.0),
)


def at_risk(policy: Policy, level: str) -> Strategy:
    s = build("gpubroker", policy.for_risk(level))  # type: ignore[arg-type]
    s.name = f"gpubroker {level}"
    return s


def weighted(policy: Policy, weights: tuple[float, float, float]) -> Strategy:
    r, a, c = weights
    scoring = policy.scoring.model_copy(update={
        "restart_hours": r, "availability_weight": a, "interruption_cost_per_gpu": c})
    s = build("gpubroker", policy.model_copy(update={"scoring": scoring}))
    s.name = f"gpubroker r={r:g} a={a:g} c={c:g}"
    return s


def extra_for(policy: Policy, tune: bool) -> Extra:
    """The strategies run beside the four: gpubroker at the other risk levels and the
    oracle (gpubroker's policy seeing the true hazards); with `tune`, gpubroker under
    each of `CANDIDATES` instead."""
    def extra(schedule: HazardSchedule, market: MarketTrace) -> list[Strategy]:
        if tune:
            return [weighted(policy, w) for w in CANDIDATES]
        return [*(at_risk(policy, level) for level in LEVELS),
                Oracle(policy, schedule, market.start)]
    return extra


def _means(seeds: Seeds) -> dict[str, dict[str, float | None]]:
    return {row["strategy"]: {k: v["mean"] for k, v in row.items()
                              if isinstance(v, dict) and "mean" in v}
            for row in seeds.summary()["strategies"]}


def _paired(seeds: Seeds, a: str, b: str, figure: str, scale: float = 1.0
            ) -> tuple[float, float | None] | None:
    """The mean of a's figure less `scale` × b's, seed by seed, with its 95 % interval."""
    diffs = []
    for run in seeds.per_seed():
        rows = {f["strategy"]: f for f in run["strategies"]}
        x, y = rows.get(a, {}).get(figure), rows.get(b, {}).get(figure)
        if x is not None and y is not None:
            diffs.append(x - scale * y)
    return t_interval(diffs) if len(diffs) > 1 else None


# (goal, strategy, its figure, the other strategy, the bound as a multiple of its figure)
GOALS = (
    ("balanced $/useful ≤ cheapest_spot + 1 %", "gpubroker", "cost_per_useful_gpu_hour",
     "cheapest_spot", 1.01),
    ("balanced interruptions ≥ 15 % under cheapest_spot", "gpubroker",
     "interruptions_per_1000_gpu_hours", "cheapest_spot", 0.85),
    ("fewest-interruptions interruptions ≤ price_capacity", "gpubroker fewest-interruptions",
     "interruptions_per_1000_gpu_hours", "price_capacity", 1.0),
    ("fewest-interruptions $/useful ≤ 80 % of price_capacity",
     "gpubroker fewest-interruptions", "cost_per_useful_gpu_hour", "price_capacity", 0.8),
)


def goals(seeds: Seeds) -> list[tuple[str, bool | None, str]]:
    """The goal lines of a market: (goal, met (None: not measurable), figures), met on
    the means over the seeds. The figures add the paired difference, the strategy's
    figure less the bound seed by seed, mean ± its 95 % t interval: the seeds move all
    strategies together, so it is much tighter than either interval."""
    means = _means(seeds)
    out: list[tuple[str, bool | None, str]] = []
    for goal, who, figure, other, scale in GOALS:
        x = means.get(who, {}).get(figure)
        y = means.get(other, {}).get(figure)
        if x is None or y is None:
            out.append((goal, None, "not measured"))
            continue
        text = f"{x:.4g} vs {scale * y:.4g} ({x / y - 1:+.1%} against {other})" if y \
            else f"{x:.4g} vs {scale * y:.4g}"
        paired = _paired(seeds, who, other, figure, scale)
        if paired is not None:
            d, half = paired
            text += f"; paired difference to the bound {d:+.4g} ± {half or 0.0:.4g}"
        out.append((goal, x <= y * scale, text))
    return out


def spot_shares(seeds: Seeds, names: Sequence[str]) -> dict[str, dict[str, float]]:
    """Per strategy of `names`, its spot GPU-hours per cloud as a share of its spot
    GPU-hours, the mean over the seeds."""
    out: dict[str, dict[str, float]] = {}
    for name in names:
        per_cloud: dict[str, list[float]] = {}
        runs = 0
        for run in seeds.runs:
            for r in run.results:
                if r.strategy == name:
                    runs += 1
                    for cloud, share in r.metrics()["spot_share_by_cloud"].items():
                        per_cloud.setdefault(cloud, []).append(share)
        out[name] = {c: sum(v) / runs for c, v in sorted(per_cloud.items())} if runs else {}
    return out


def tuning_table(seeds: Seeds) -> list[str]:
    """Each candidate's mean cost and interruptions against cheapest_spot and
    price_capacity's."""
    means = _means(seeds)
    cost, intr = "cost_per_useful_gpu_hour", "interruptions_per_1000_gpu_hours"
    cs, pc = means["cheapest_spot"], means["price_capacity"]
    lines = [f"{'strategy':44} {'$/useful':>9} {'vs cheap':>9} {'vs pc':>8} "
             f"{'intr/1k':>8} {'vs cheap':>9} {'vs pc':>8}"]
    for name, m in means.items():
        c, i = m[cost], m[intr]
        if c is None or i is None:
            continue
        lines.append(f"{name:44} {c:9.4f} {c / cs[cost] - 1:+9.1%} {c / pc[cost]:8.2f} "
                     f"{i:8.2f} {i / cs[intr] - 1:+9.1%} {i / pc[intr]:8.2f}")
    return lines


def markets(args: argparse.Namespace) -> list[tuple[str, str, int, float]]:
    """(label, market spec, requests, pool-wide share) of every market run."""
    n = args.requests if args.requests is not None else 1000
    sim = f"sim:{args.days:g}d"
    out = [(f"{sim} independent", sim, n, POOL_WIDE_SHARE),
           (f"{sim} correlated", sim, n, CORRELATED_POOL_WIDE_SHARE)]
    if not args.tune:
        out += [(name, os.path.relpath(TRACES / name), k, POOL_WIDE_SHARE)
                for name, k in TRACE_MARKETS]
    return out


def all_markets(args: argparse.Namespace, policy: Policy, policy_name: str) -> int:
    settings = Settings(step_seconds=args.step_minutes * 60,
                        restart_hours=policy.scoring.restart_hours)
    first = args.seed if args.seed is not None else (TUNING_SEED if args.tune or args.tuning
                                                     else HELD_OUT_SEED)
    t_all, c_all = time.perf_counter(), time.process_time()
    reports = []
    extra = extra_for(policy, args.tune)
    for label, text, requests, share in markets(args):
        t0, c0 = time.perf_counter(), time.process_time()
        runs = []
        for i in range(args.seeds):
            seed = first + i
            spec = f"{text}:{seed}:{args.regions}" if text.startswith("sim:") else text
            print(f"{label}: seed {seed} ({i + 1}/{args.seeds})", file=sys.stderr, flush=True)
            market = load_market(spec, seed=seed, step_seconds=settings.step_seconds)
            workload = generate_workload(requests, seed=seed, market=market)
            runs.append(compare(market, workload, STRATEGIES, policy,
                                replace(settings, seed=seed, market_seed=market.seed,
                                        workload_seed=workload.seed, pool_wide_share=share),
                                policy_name=policy_name, extra=extra))
        seeds = Seeds(tuple(runs))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        met = [] if args.tune else goals(seeds)
        shares = spot_shares(seeds, ["cheapest_spot", "price_capacity", "gpubroker",
                                     "oracle"])
        if args.json:
            reports.append({"label": label, **seeds.to_json(), "goals": [
                {"goal": g, "met": ok, "figures": f} for g, ok, f in met],
                "spot_share_by_cloud": shares,
                "timing": {"wall_seconds": round(wall, 2), "cpu_seconds": round(cpu, 2)}})
            continue
        print(f"## {label}: seeds {first}-{first + args.seeds - 1}, pool-wide share "
              f"{share:g}; interruptions drawn from {runs[0].truth}\n")
        if args.tune:
            print("\n".join(tuning_table(seeds)))
        else:
            write_seeds_table(seeds, sys.stdout)
            print()
            for goal, ok, figures in met:
                print(f"{goal}: {'not measured' if ok is None else 'met' if ok else 'NOT met'}"
                      f" ({figures})")
            print("spot GPU-hours by cloud (share of each strategy's spot GPU-hours, mean):")
            for name, by_cloud in shares.items():
                print(f"  {name:15} " + "  ".join(f"{c} {v:5.1%}" for c, v in by_cloud.items()))
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
    ap.add_argument("--seed", type=int, default=None,
                    help=f"the first seed (default: {HELD_OUT_SEED}, the held-out seeds; "
                         f"--tuning: {TUNING_SEED})")
    ap.add_argument("--tuning", action="store_true",
                    help="every market on the tuning seeds (the defaults were chosen on them)")
    ap.add_argument("--tune", action="store_true",
                    help="gpubroker under each candidate risk weighting (CANDIDATES) on the "
                         "simulated markets, tuning seeds")
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
    if args.seed is None:
        args.seed = TUNING_SEED

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
