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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import structlog  # noqa: E402
from _poll_common import Timings, medians, one_poll, print_table  # noqa: E402
from fake_alibaba import FakeAlibaba  # noqa: E402

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--regions", type=int, default=3, choices=range(1, len(REGIONS) + 1))
    p.add_argument("--latency", type=float, nargs=2, default=[0.05, 0.15])
    p.add_argument("--workers", type=int, default=64, help="the adapter's thread pool")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
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
