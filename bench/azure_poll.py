"""One full poll of several Azure regions against the fake Azure endpoint with per-call
latency: wall time against the critical path, and API calls per poll.

A region's poll runs four independent chains at once — Resource SKU pages (`nextLink`),
Retail Prices pages (`NextPageLink`), usage pages, Resource Graph pages — and the regions
run at once too, so the critical path is the longest single chain: with unlimited
parallelism a poll could not be faster.

Besides the first poll (everything fetched) and the next one (everything cached), the
bench replays one hour of polling every `--interval` seconds on a simulated clock
(quotas refresh every 10 min, the rest hourly) and counts the calls.

    python bench/azure_poll.py [--regions 3] [--latency 0.05 0.15] [--repeat 3] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from _poll_common import Timings, medians, one_poll, print_table  # noqa: E402
from fake_azure import FakeAzure  # noqa: E402

from adapters.azure.adapter import AzureAdapter  # noqa: E402

REGIONS = ["eastus", "westus2", "southcentralus", "eastus2", "westus3", "centralus",
           "westus", "northcentralus"]
SYNC_CHAINS = ("resource_skus", "usages", "eviction_rates")


def timed(adapter: AzureAdapter) -> Timings:
    """Timings of the adapter's chains: the ARM calls and the Retail Prices pages."""
    timings = Timings()
    timings.wrap(adapter.sdk, SYNC_CHAINS)
    timings.wrap_async(adapter.retail, "vm_prices", "retail_prices")
    return timings


def critical_path(timings: Timings) -> float:
    """Every chain runs at once: the longest of them."""
    return max(max(v) for v in timings.by.values())


class Clock:
    """The adapter's monotonic clock, moved by the bench."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def run(args: argparse.Namespace) -> dict[str, Any]:
    random.seed(args.seed)
    regions = REGIONS[:args.regions]
    with FakeAzure(seed=args.seed) as fake:
        if args.page:
            fake.page_size.update(skus=args.page, usages=args.page, prices=args.page,
                                  graph=args.page)
        out_pages = dict(fake.page_size)
        out: dict[str, Any] = {"regions": regions, "latency_s": args.latency,
                               "page_size": out_pages, "runs": []}
        for _ in range(args.repeat):
            fake.latency = (args.latency[0], args.latency[1])
            fake.reset_calls()
            clock = Clock()
            adapter = AzureAdapter(subscription_id=fake.subscription_id, regions=regions,
                                   endpoint=fake.url, anonymous=True,
                                   max_workers=args.workers, monotonic=clock)
            timings = timed(adapter)
            wall = await one_poll(adapter, regions)
            first_calls = sum(fake.calls.values())
            critical = critical_path(timings)
            fake.reset_calls()
            clock.t += args.interval
            steady_wall = await one_poll(adapter, regions)
            steady_calls = sum(fake.calls.values())
            fake.latency = None  # the hour's call count does not depend on latency
            fake.reset_calls()
            for _ in range(int(3600 // args.interval) - 1):
                clock.t += args.interval
                await one_poll(adapter, regions)
            hour_calls = first_calls + steady_calls + sum(fake.calls.values())
            await adapter.close()
            out["runs"].append({"wall_s": wall, "critical_s": critical,
                                "ratio": wall / critical, "calls_first": first_calls,
                                "calls_steady": steady_calls, "steady_wall_s": steady_wall,
                                "calls_per_hour": hour_calls})
        out["median"] = medians(out["runs"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--regions", type=int, default=3, choices=range(1, len(REGIONS) + 1))
    p.add_argument("--latency", type=float, nargs=2, default=[0.05, 0.15])
    p.add_argument("--workers", type=int, default=16, help="the adapter's thread pool")
    p.add_argument("--page", type=int, default=None,
                   help="items per page in every API of the fake (default: the fake's, "
                        "which gives several pages each)")
    p.add_argument("--interval", type=float, default=60, help="poll interval, seconds")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    out = asyncio.run(run(args))
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"Azure poll of {len(out['regions'])} regions ({', '.join(out['regions'])}), "
          f"{args.latency[0] * 1000:.0f}-{args.latency[1] * 1000:.0f} ms per call, "
          f"items per page {out['page_size']}, {args.workers} worker threads, "
          f"{args.repeat} runs")
    print_table(out, f" {'steady wall s':>14} {'calls/hour':>11}",
                lambda r: f" {r['steady_wall_s']:14.3f} {r['calls_per_hour']:11.0f}")


if __name__ == "__main__":
    main()
