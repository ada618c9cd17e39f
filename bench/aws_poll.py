"""One full poll of several AWS regions against the fake AWS endpoint with per-call
latency: wall time against the critical path, and API calls per poll.

The critical path is the longest chain of calls that must run one after another: per
region, the instance-type pages, then the slowest of the chains that depend on them
(offering pages, spot-price pages, zone IDs then one type's placement-score pages, one
type's price pages, one quota). With unlimited parallelism a poll could not be faster.

    python bench/aws_poll.py [--regions 4] [--latency 0.05 0.15] [--seed 7] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from _poll_common import Timings, medians, one_poll, print_table  # noqa: E402
from fake_aws import FakeAWS  # noqa: E402

from adapters.aws.adapter import AwsAdapter  # noqa: E402

REGIONS = ["us-east-1", "us-west-2", "eu-west-1", "ap-northeast-1", "eu-central-1",
           "ap-southeast-1"]
CHAINS = ("gpu_instance_types", "offerings", "spot_prices", "zone_ids", "placement_scores",
          "on_demand_products", "quota")


def critical_path(timings: Timings, regions: list[str]) -> float:
    """Per region, the instance-type pages then the slowest chain that needs them."""
    longest = timings.longest
    per_region = []
    for r in regions:
        after_types = max(
            longest("offerings", r), longest("spot_prices", r),
            longest("zone_ids", r) + longest("placement_scores", r),
            longest("on_demand_products", r), longest("quota", r))
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--regions", type=int, default=4, choices=range(1, len(REGIONS) + 1))
    p.add_argument("--latency", type=float, nargs=2, default=[0.05, 0.15])
    p.add_argument("--workers", type=int, default=None,
                   help="the adapter's thread pool (default: the adapter's own choice)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
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
