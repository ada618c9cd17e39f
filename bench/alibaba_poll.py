"""One full poll of several Alibaba Cloud regions against the fake ECS endpoint with
per-call latency: wall time against the critical path, and API calls per poll.

The critical path is the longest chain of calls that must run one after another: per
region, the slowest of the first group (the instance-type pages; each of the two
DescribeAvailableResource calls; the account attributes), then the slowest of the
second group, which needs the first's answers (one type's spot-price-history pages; one
type's DescribePrice; the DescribeSpotAdvice chunks, one after another). With unlimited
parallelism a poll could not be faster.

Besides the first poll it counts the calls of a steady-state poll (right after it) and of
the poll that refreshes spot prices (every 5 minutes; the bench moves the adapter's
clock instead of waiting).

    python bench/alibaba_poll.py [--regions 3] [--latency 0.05 0.15] [--workers 64] [--json]

With ``--faults RATE`` it measures instead what random faults cost the command a user
runs: per run, one ``gpubroker offers --cloud alibaba --format json`` (a child process,
the real adapter and SDK with the seam's default retries) against the fake without
faults, then one with RATE of the HTTP calls faulted (throttles, 5xx, timeouts and
cut-off answers, mixed; ``tests/fakes/fake_server.py`` `Chaos`, every call taking its chances);
it prints the HTTP calls the fake answered and the wall time of each, whether the two
runs listed the same offers (every field but ``observed_at``), the exit code and the
stderr lines of the faulted run.

    python bench/alibaba_poll.py --faults 0.3 [--regions 3] [--call-timeout 1] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"),
               str(ROOT / "tests" / "support"), str(ROOT / "tests" / "fakes")]

import structlog  # noqa: E402
import yaml  # noqa: E402
from _poll_common import Timings, medians, one_poll, print_table  # noqa: E402
from fake_alibaba import FakeAlibaba  # noqa: E402
from fake_server import CHAOS_KINDS, Chaos  # noqa: E402

from adapters.alibaba.adapter import AlibabaAdapter, Refresh  # noqa: E402

REGIONS = ["cn-hangzhou", "cn-beijing", "ap-southeast-1", "cn-shanghai", "us-west-1"]
FIRST = ("gpu_instance_types", "available_resources", "account_attributes")
SECOND = ("spot_price_history", "price", "spot_advice")


def critical_path(timings: Timings, regions: list[str]) -> float:
    """Per region, the slowest chain of the first group, then of the second."""
    def longest(names: tuple[str, ...], region: str) -> float:
        return max(timings.longest(n, region) for n in names)

    return max(longest(FIRST, r) + longest(SECOND, r) for r in regions)


class Clock:
    """The adapter's monotonic clock, which the bench can move forward."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


async def run(args: argparse.Namespace) -> dict[str, Any]:
    random.seed(args.seed)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    regions = REGIONS[:args.regions]
    with FakeAlibaba(seed=args.seed) as fake:
        warm = AlibabaAdapter(regions=regions[:1], endpoint=fake.url, anonymous=True)
        await warm.poll(regions[0])  # the SDK's imports and first session, not measured
        await warm.close()
        fake.latency = (args.latency[0], args.latency[1])
        out: dict[str, Any] = {"regions": regions, "latency_s": args.latency,
                               "workers": args.workers, "runs": []}
        for _ in range(args.repeat):
            fake.reset_calls()
            timings, clock = Timings(), Clock()
            adapter = AlibabaAdapter(regions=regions, endpoint=fake.url, anonymous=True,
                                     max_workers=args.workers, refresh=Refresh(),
                                     monotonic=clock)
            timings.wrap(adapter.sdk, FIRST + SECOND)
            wall = await one_poll(adapter, regions)
            first_calls = sum(fake.calls.values())
            critical = critical_path(timings, regions)
            fake.reset_calls()
            steady_wall = await one_poll(adapter, regions)
            steady_calls = sum(fake.calls.values())
            clock.offset += Refresh().spot_prices + 1
            fake.reset_calls()
            spot_wall = await one_poll(adapter, regions)
            spot_calls = sum(fake.calls.values())
            await adapter.close()
            out["runs"].append({"wall_s": wall, "critical_s": critical,
                                "ratio": wall / critical, "calls_first": first_calls,
                                "calls_steady": steady_calls, "steady_wall_s": steady_wall,
                                "calls_spot_refresh": spot_calls, "spot_wall_s": spot_wall})
        out["median"] = medians(out["runs"])
    return out


def http_calls(fake: FakeAlibaba) -> int:
    """Every HTTP call the fake answered: those its API handled (timeouts and cut-off
    answers included) and the throttles and 5xx its fault middleware answered alone."""
    return sum(fake.calls.values()) + fake.faulted["throttle"] + fake.faulted["5xx"]


def offers_run(fake: FakeAlibaba, config: Path, home: Path) -> dict[str, Any]:
    """One `gpubroker offers --cloud alibaba --format json` against `fake`."""
    fake.reset_calls()
    fake.faulted.clear()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ALIBABA_CLOUD_")}
    env.update(HOME=str(home), PYTHONPATH=str(ROOT))
    started = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "broker.cli", "offers", "--config", str(config),
                        "--cloud", "alibaba", "--format", "json"], capture_output=True,
                       text=True, env=env, cwd=ROOT, timeout=600, check=False)
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    offers = {(o["region"], o["zone"], o["instance_type"], o["market"]):
              {k: v for k, v in o.items() if k != "observed_at"} for o in rows}
    return {"wall_s": wall, "calls": http_calls(fake), "faulted": dict(fake.faulted),
            "offers": offers, "exit": r.returncode, "stderr": r.stderr.splitlines()}


def run_faults(args: argparse.Namespace) -> dict[str, Any]:
    regions = REGIONS[:args.regions]
    out: dict[str, Any] = {"regions": regions, "latency_s": args.latency,
                           "faults": args.faults, "call_timeout_s": args.call_timeout,
                           "runs": []}
    with FakeAlibaba(seed=args.seed) as fake, tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.yaml"
        config.write_text(yaml.safe_dump({"clouds": {"alibaba": {
            "regions": regions, "endpoint": fake.url, "anonymous": True,
            "call_timeout_seconds": args.call_timeout}}}))
        fake.latency = (args.latency[0], args.latency[1])
        for i in range(args.repeat):
            fake.chaos = None
            clean = offers_run(fake, config, Path(tmp))
            fake.chaos = Chaos(rate=args.faults, kinds=CHAOS_KINDS,
                               hang_seconds=args.call_timeout + 0.5, seed=args.seed + i)
            faulted = offers_run(fake, config, Path(tmp))
            out["runs"].append({
                "offers": len(clean["offers"]), "wall_clean_s": clean["wall_s"],
                "calls_clean": clean["calls"], "wall_faults_s": faulted["wall_s"],
                "calls_faults": faulted["calls"], "faulted": faulted["faulted"],
                "equal": faulted["offers"] == clean["offers"] and clean["exit"] == 0,
                "exit_faults": faulted["exit"], "stderr_lines": len(faulted["stderr"]),
                "tracebacks": sum("Traceback" in line for line in faulted["stderr"]),
                "stderr": faulted["stderr"][:5]})
        out["median"] = {k: statistics.median(r[k] for r in out["runs"])
                         for k in ("wall_clean_s", "calls_clean", "wall_faults_s",
                                   "calls_faults")}
    return out


def print_faults(out: dict[str, Any]) -> None:
    print(f"gpubroker offers --cloud alibaba: {len(out['regions'])} regions "
          f"({', '.join(out['regions'])}), {out['latency_s'][0] * 1000:.0f}-"
          f"{out['latency_s'][1] * 1000:.0f} ms per call, call timeout "
          f"{out['call_timeout_s']:g} s; {out['faults']:.0%} of calls faulted "
          f"(throttle, 5xx, timeout, truncated)")
    print(f"{'run':>4} {'offers':>7} {'clean s':>8} {'calls':>6} {'faults s':>9} {'calls':>6} "
          f"{'equal':>6} {'exit':>5} {'stderr':>7}  faulted")
    for i, r in enumerate(out["runs"], 1):
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(r["faulted"].items()))
        print(f"{i:>4} {r['offers']:>7} {r['wall_clean_s']:8.2f} {r['calls_clean']:6d} "
              f"{r['wall_faults_s']:9.2f} {r['calls_faults']:6d} {r['equal']!s:>6} "
              f"{r['exit_faults']:>5} {r['stderr_lines']:>7}  {kinds}")
        for line in r["stderr"]:
            print(f"      stderr: {line[:150]}")
    m = out["median"]
    print(f"{'med':>4} {'':>7} {m['wall_clean_s']:8.2f} {m['calls_clean']:6.0f} "
          f"{m['wall_faults_s']:9.2f} {m['calls_faults']:6.0f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--regions", type=int, default=3, choices=range(1, len(REGIONS) + 1))
    p.add_argument("--latency", type=float, nargs=2, default=[0.05, 0.15])
    p.add_argument("--workers", type=int, default=64, help="the adapter's thread pool")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", action="store_true")
    p.add_argument("--faults", type=float, metavar="RATE",
                   help="measure `gpubroker offers` with this share of calls faulted")
    p.add_argument("--call-timeout", type=float, default=1.0,
                   help="call_timeout_seconds in the --faults runs' config")
    args = p.parse_args()
    if args.faults is not None:
        faults = run_faults(args)
        if args.json:
            print(json.dumps(faults, indent=2, default=str))
        else:
            print_faults(faults)
        return
    out = asyncio.run(run(args))
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"Alibaba Cloud poll of {len(out['regions'])} regions ({', '.join(out['regions'])}), "
          f"{args.latency[0] * 1000:.0f}-{args.latency[1] * 1000:.0f} ms per call, "
          f"{args.workers} worker threads, {args.repeat} runs")
    print_table(out, f" {'steady wall s':>14} {'calls spot 5min':>16} {'spot wall s':>12}",
                lambda r: f" {r['steady_wall_s']:14.2f} {r['calls_spot_refresh']:16.0f} "
                          f"{r['spot_wall_s']:12.2f}")


if __name__ == "__main__":
    main()
