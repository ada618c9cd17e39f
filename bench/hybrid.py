"""A private pool plus cloud burst, against renting everything: one simulated week with
64 private A100-80GB GPUs (8 servers of 8) and 3,000 requests, over 5 seeds.

    python bench/hybrid.py                          # sim:7d, gen:3000, 64 GPUs, 5 seeds
    python bench/hybrid.py --private-price 0.8      # a marginal price per GPU-hour
    python bench/hybrid.py --slices 8               # servers leased a GPU at a time
    python bench/hybrid.py --days 2 --requests 800 --seeds 3 --json

Each seed runs `gpubroker backtest --market sim:7d --workload gen:3000 --private-gpus 64
--seeds 5` would: every strategy twice in one lockstep, cloud only and with the private
pool, on the same market, requests and interruption draws (`broker/backtest/compare.py`);
run i takes seed `--seed` + i for the market, the workload and the draws. It prints, per
strategy, the mean ± the half-width of the 95 % Student-t interval over the seeds of:
$ per useful GPU-hour and interruptions per 1,000 useful GPU-hours, cloud only and with
the pool; the pool's utilisation (GPU-hours leases held on it ÷ owned GPU-hours); the $
saved (cloud only − with the pool, in all and per useful GPU-hour, paired seed by seed);
then how much of the workload could use the pool, and the wall and CPU time.

`gen:N` asks for GPU models weighted by how many pools of the market offer them: on the
simulated market about a fifth of the requests may run on A100-80GB (those asking for it,
and the A100-40GB ones that also accept it; README "Backtest"), asking about as many
GPU-hours as the pool has. A private server goes whole to one lease, so the 1-, 2- and
4-GPU jobs among them hold 8 GPUs each (`--slices 8`: a GPU at a time, as a servers
file's `slices: 8` leases them): counted in servers, the demand is well above
the pool, which needs no workload of its own to be full. The output says how much of
the workload could use the pool, and, for the first seed, the GPU-hours held on the pool
against those its jobs asked for. Requests arrive over the first 90 % of the week, so
the pool empties in the last hours and its utilisation stays under 90 %.
Money counts what leases pay: the pool's fixed cost is paid either way and counted in
neither run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from broker.backtest import STRATEGIES
from broker.backtest.compare import Comparison, Seeds, compare, embedded_policy
from broker.backtest.ledger import Settings
from broker.backtest.market import SimSpec, simulate_market
from broker.backtest.private import PrivateSite
from broker.backtest.workload import generate_workload
from broker.output.stdio import stdout_to_stderr

COLUMNS = (
    ("$/USEFUL CLOUD", "cloud", "cost_per_useful_gpu_hour", "{:.4f}"),
    ("$/USEFUL HYBRID", "hybrid", "cost_per_useful_gpu_hour", "{:.4f}"),
    ("SAVED $/USEFUL", "hybrid", "saved_per_useful_gpu_hour", "{:.4f}"),
    ("SAVED $", "hybrid", "saved", "{:,.0f}"),
    ("INTR/1K CLOUD", "cloud", "interruptions_per_1000_gpu_hours", "{:.2f}"),
    ("INTR/1K HYBRID", "hybrid", "interruptions_per_1000_gpu_hours", "{:.2f}"),
    ("UTIL", "hybrid", "utilisation", "{:.1%}"),
)


def pm(d: dict[str, Any], fmt: str) -> str:
    if d["mean"] is None:
        return "-"
    text = fmt.format(d["mean"])
    return text if d["half_width"] is None else f"{text} ± {fmt.format(d['half_width'])}"


def run(args: argparse.Namespace) -> tuple[Seeds, float, dict[str, float]]:
    site = PrivateSite(args.private_gpus, args.private_gpu, args.per_server,
                       args.private_price, args.slices)
    policy, name = embedded_policy()
    names = [n.strip() for n in args.strategy.split(",")]
    runs: list[Comparison] = []
    generating = 0.0
    demand = {"requests": 0.0, "gpu_hours": 0.0, "all_gpu_hours": 0.0}
    for i in range(args.seeds):
        seed = args.seed + i
        t = time.perf_counter()
        market = simulate_market(SimSpec(args.days * 86400.0, seed, 3), step_seconds=600.0)
        generating += time.perf_counter() - t
        workload = generate_workload(args.requests, seed=seed, market=market)
        for a in workload.arrivals:
            gpu_hours = a.request.gpus * a.duration_hours
            demand["all_gpu_hours"] += gpu_hours
            if site.gpu in a.request.gpu:
                demand["requests"] += 1
                demand["gpu_hours"] += gpu_hours
        settings = Settings(seed=seed, market_seed=seed, workload_seed=seed)
        runs.append(compare(market, workload, names, policy, settings, policy_name=name,
                            private=site))
        print(f"seed {seed}: {time.perf_counter() - t:.1f} s", file=sys.stderr)
    return Seeds(tuple(runs)), generating, {k: v / args.seeds for k, v in demand.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--days", type=float, default=7.0)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--private-gpus", type=int, default=64)
    ap.add_argument("--private-gpu", default="A100-80GB")
    ap.add_argument("--per-server", type=int, default=8)
    ap.add_argument("--private-price", type=float, default=0.0)
    ap.add_argument("--slices", type=int, default=1,
                    help="leases per server at once (the servers file's slices; 1: whole)")
    ap.add_argument("--strategy", default=",".join(STRATEGIES))
    ap.add_argument("--json", action="store_true", help="print the backtest's JSON report")
    args = ap.parse_args()

    wall, cpu = time.perf_counter(), time.process_time()
    with stdout_to_stderr():
        seeds, generating, demand = run(args)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if args.json:
        sys.stdout.write(json.dumps(seeds.to_json(), indent=2) + "\n")
        return 0
    c = seeds.first
    site = c.private
    assert site is not None
    summary = seeds.summary()
    cloud = {d["strategy"]: d for d in summary["strategies"]}
    print(f"sim:{args.days:g}d, gen:{args.requests}, {site.gpus} private {site.gpu} "
          f"({site.servers} servers of {site.per_server}"
          + (f", {site.slices} slices each" if site.slices > 1 else "")
          + f") at ${site.price:g}/GPU-h, "
          f"{c.owned_gpu_hours():,.0f} owned GPU-hours a run; {args.seeds} seeds "
          f"({args.seed}..{args.seed + args.seeds - 1}); mean ± half-width of the 95 % "
          "Student-t interval over the seeds")
    rows = [("STRATEGY", *(h for h, _, _, _ in COLUMNS))]
    for d in summary["private"]["strategies"]:
        got = {"cloud": cloud[d["strategy"]], "hybrid": d}
        rows.append((d["strategy"], *(pm(got[run][k], fmt) for _, run, k, fmt in COLUMNS)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print()
    for r in rows:
        print("  ".join(x.ljust(w) if i == 0 else x.rjust(w)
                        for i, (x, w) in enumerate(zip(r, widths, strict=True))))
    print()
    print(f"requests that may use the pool ({site.gpu}): {demand['requests']:.0f} of "
          f"{args.requests} a run, {demand['gpu_hours']:,.0f} of "
          f"{demand['all_gpu_hours']:,.0f} GPU-hours asked (means over the seeds)")
    busy = c.private_metrics()
    print("first seed, GPU-hours on the pool held / asked by the jobs there: " + ", ".join(
        f"{m['strategy']} {m['busy_gpu_hours']:,.0f} / {m['asked_gpu_hours']:,.0f}"
        for m in busy))
    print("money counts what leases pay; the pool's fixed cost is not counted (paid "
          "either way)" + ("" if c.fixed_cost() is None else
                           f"; at ${site.price:g}/GPU-h it is ${c.fixed_cost():,.0f} a run"))
    print(f"wall {wall:.1f} s, CPU {cpu:.1f} s (generating the markets {generating:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
