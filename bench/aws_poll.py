"""One full poll of several AWS regions against the fake AWS endpoint with per-call
latency: wall time against the critical path, and API calls per poll.

The critical path is the longest chain of calls that must run one after another: per
region, the instance-type pages, then the slowest of the chains that depend on them
(offering pages, spot-price pages, zone IDs then one type's placement-score pages, one
type's price pages, one quota, the Spot Instance Advisor document). With unlimited
parallelism a poll could not be faster.

    python bench/aws_poll.py [--regions 4] [--latency 0.05 0.15] [--seed 7] [--json]

With ``--faults RATE`` it measures instead what random faults cost: one
``gpubroker offers --cloud aws --format json`` (a subprocess, as a user runs it) against
the fake, ``--repeat`` times fault-free and ``--repeat`` times with RATE of the calls
faulted (throttle, 5xx, timeout, truncated body, mixed; `fake_server.Chaos`),
alternately: per run, the calls the fake received (faulted ones included), the wall
time, the exit code, tracebacks on stderr, and whether the offers equal the first
fault-free run's (every key but ``observed_at``); then the medians of each kind of run.

    python bench/aws_poll.py --faults 0.3 [--regions 4] [--call-timeout 1] [--hang 1.5]
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

from _poll_common import Timings, medians, one_poll, print_table  # noqa: E402
from fake_aws import FakeAWS  # noqa: E402
from fake_server import Chaos  # noqa: E402

from adapters.aws.adapter import AwsAdapter  # noqa: E402

REGIONS = ["us-east-1", "us-west-2", "eu-west-1", "ap-northeast-1", "eu-central-1",
           "ap-southeast-1"]
CHAINS = ("gpu_instance_types", "offerings", "spot_prices", "zone_ids", "placement_scores",
          "on_demand_products", "quota", "spot_advisor_document")


def critical_path(timings: Timings, regions: list[str]) -> float:
    """Per region, the instance-type pages then the slowest chain that needs them."""
    longest = timings.longest
    per_region = []
    for r in regions:
        after_types = max(
            longest("offerings", r), longest("spot_prices", r),
            longest("zone_ids", r) + longest("placement_scores", r),
            longest("on_demand_products", r), longest("quota", r),
            longest("spot_advisor_document"))
        per_region.append(longest("gpu_instance_types", r) + after_types)
    return max(per_region)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    random.seed(args.seed)
    regions = REGIONS[:args.regions]
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
    with FakeAWS(seed=args.seed) as fake:
        # Warm the fake's own caches so that its start-up is not measured.
        warm = AwsAdapter(regions=regions[:1], endpoint=fake.url)
        await warm.poll(regions[0])
        await warm.close()
        fake.latency = (args.latency[0], args.latency[1])
        out: dict[str, Any] = {"regions": regions, "latency_s": args.latency, "runs": []}
        for _ in range(args.repeat):
            fake.reset_calls()
            timings = Timings()
            adapter = AwsAdapter(regions=regions, endpoint=fake.url,
                                 max_workers=args.workers)
            timings.wrap(adapter.sdk, CHAINS)
            wall = await one_poll(adapter, regions)
            first_calls = sum(fake.calls.values())
            critical = critical_path(timings, regions)
            fake.reset_calls()
            steady_wall = await one_poll(adapter, regions)
            steady_calls = sum(fake.calls.values())
            await adapter.close()
            out["runs"].append({"wall_s": wall, "critical_s": critical,
                                "ratio": wall / critical, "calls_first": first_calls,
                                "calls_steady": steady_calls, "steady_wall_s": steady_wall})
        out["median"] = medians(out["runs"])
    return out


def offers_command(config: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    t = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "broker.cli", "offers", "--config", str(config), "--cloud",
         "aws", "--format", "json"], capture_output=True, text=True, timeout=600,
        check=False, cwd=ROOT)
    return done, time.perf_counter() - t


def comparable(stdout: str) -> dict[tuple[str, ...], dict[str, Any]]:
    rows = [json.loads(line) for line in stdout.splitlines() if line.strip()]
    keys = ("cloud", "region", "zone", "instance_type", "market")
    return {tuple(r[k] for k in keys): {k: v for k, v in r.items() if k != "observed_at"}
            for r in rows}


def faults(args: argparse.Namespace) -> dict[str, Any]:
    """`gpubroker offers` fault-free, then with `args.faults` of the calls faulted."""
    regions = REGIONS[:args.regions]
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true",
                      AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull)
    out: dict[str, Any] = {"regions": regions, "rate": args.faults, "runs": []}
    with FakeAWS(seed=args.seed) as fake, tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.yaml"
        config.write_text(json.dumps({  # YAML is a superset of JSON
            "clouds": {"aws": {"regions": regions, "endpoint": fake.url,
                               "call_timeout_seconds": args.call_timeout}}}))
        warm, _ = offers_command(config)  # the fake's own caches, not measured
        assert warm.returncode == 0, warm.stderr
        fake.latency = (args.latency[0], args.latency[1])
        expected: dict[tuple[str, ...], dict[str, Any]] | None = None
        for i in range(2 * args.repeat):
            rate = args.faults if i % 2 else 0.0
            fake.reset_calls()
            fake.faulted.clear()
            fake.chaos = (None if rate == 0 else
                          Chaos(rate=rate, hang_seconds=args.hang, seed=args.seed + i))
            done, wall = offers_command(config)
            fake.chaos = None
            rows = comparable(done.stdout)
            if expected is None:
                expected = rows
            out["runs"].append({
                "faults": rate, "exit": done.returncode, "offers": len(rows),
                "calls": sum(fake.calls.values()), "faulted": dict(fake.faulted),
                "wall_s": wall, "tracebacks": done.stderr.count("Traceback"),
                "stderr_lines": len(done.stderr.splitlines()), "equal": rows == expected})
    for rate in sorted({r["faults"] for r in out["runs"]}):
        runs = [r for r in out["runs"] if r["faults"] == rate]
        out.setdefault("median", {})[str(rate)] = {
            "calls": statistics.median(r["calls"] for r in runs),
            "wall_s": statistics.median(r["wall_s"] for r in runs),
            "equal": sum(r["equal"] for r in runs), "runs": len(runs)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--regions", type=int, default=4, choices=range(1, len(REGIONS) + 1))
    p.add_argument("--latency", type=float, nargs=2, default=[0.05, 0.15])
    p.add_argument("--workers", type=int, default=None,
                   help="the adapter's thread pool (default: the adapter's own choice)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", action="store_true")
    p.add_argument("--faults", type=float, default=None, metavar="RATE",
                   help="measure `gpubroker offers` with this share of calls faulted")
    p.add_argument("--call-timeout", type=float, default=1.0,
                   help="clouds.aws.call_timeout_seconds for --faults (default 1)")
    p.add_argument("--hang", type=float, default=1.5,
                   help="how late a timed-out call is answered, for --faults (default 1.5)")
    args = p.parse_args()
    if args.faults is not None:
        report = faults(args)
        if args.json:
            print(json.dumps(report, indent=2))
            return
        print(f"gpubroker offers --cloud aws, {len(report['regions'])} regions "
              f"({', '.join(report['regions'])}), {args.latency[0] * 1000:.0f}-"
              f"{args.latency[1] * 1000:.0f} ms per call, call timeout {args.call_timeout:g} s,"
              f" timed-out calls answered after {args.hang:g} s")
        print(f"{'faults':>7} {'exit':>4} {'offers':>6} {'calls':>6} {'wall s':>7} "
              f"{'tracebacks':>10} {'equal':>5}  faulted")
        for r in report["runs"]:
            faulted = ", ".join(f"{k} {n}" for k, n in sorted(r["faulted"].items())) or "-"
            print(f"{r['faults']:7.0%} {r['exit']:4d} {r['offers']:6d} {r['calls']:6d} "
                  f"{r['wall_s']:7.1f} {r['tracebacks']:10d} "
                  f"{'yes' if r['equal'] else 'NO':>5}  {faulted}")
        for rate, m in report["median"].items():
            print(f"median at {float(rate):.0%} faults: {m['calls']:.0f} calls, "
                  f"{m['wall_s']:.1f} s; offers equal in {m['equal']} of {m['runs']} runs")
        return
    out = asyncio.run(run(args))
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"AWS poll of {len(out['regions'])} regions ({', '.join(out['regions'])}), "
          f"{args.latency[0] * 1000:.0f}-{args.latency[1] * 1000:.0f} ms per call, "
          f"{args.workers or 'default'} worker threads, {args.repeat} runs")
    print_table(out, f" {'steady wall s':>14}", lambda r: f" {r['steady_wall_s']:14.2f}")


if __name__ == "__main__":
    main()
