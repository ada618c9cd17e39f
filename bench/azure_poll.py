"""One full poll of several Azure regions against the fake Azure endpoint with per-call
latency: wall time against the critical path, and API calls per poll.

A region's poll runs four independent chains at once — Resource SKU pages (`nextLink`),
Retail Prices pages (`NextPageLink`), usage pages, Resource Graph pages — and the regions
run at once too, so the critical path is the longest single chain: with unlimited
parallelism a poll could not be faster.

Besides the first poll (everything fetched) and the next one (everything cached), the
bench replays one hour of polling every `--interval` seconds on a simulated clock
(quotas refresh every 10 min, the rest hourly) and counts the calls.

With `--faults RATE` it measures faults instead: per run, the first poll of every region
once without faults and once with that share of calls faulted by the fake (`Chaos`:
mixed throttles with `Retry-After: 1`, 5xx, timeouts — the answer comes `--call-timeout`
+ 0.5 s late — and bodies cut in half), each under the poller's deadline
(`--deadline`, as `poll.timeout_seconds`), by a fresh adapter with the daemon's retry
settings. It prints the wall time and the calls the adapter made (every attempt) of
both, the faults by kind, and whether the offers are the same (all but `observed_at`).

    python bench/azure_poll.py [--regions 3] [--latency 0.05 0.15] [--repeat 3] [--json]
    python bench/azure_poll.py --faults 0.3 [--call-timeout 2] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"),
               str(ROOT / "tests" / "support"), str(ROOT / "tests" / "fakes")]

from _poll_common import Timings, medians, one_poll, print_table  # noqa: E402
from fake_azure import FakeAzure  # noqa: E402
from fake_server import CHAOS_KINDS, Chaos  # noqa: E402

from adapters.azure.adapter import AzureAdapter  # noqa: E402
from adapters.common import poll_deadline  # noqa: E402
from broker.model import Offer, PoolKey  # noqa: E402

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


EPOCH = datetime(2000, 1, 1, tzinfo=UTC)


async def first_poll(fake: FakeAzure, regions: list[str], args: argparse.Namespace
                     ) -> tuple[dict[PoolKey, Offer], float, int, list[str], Timings]:
    """A fresh adapter's first poll of every region, under the poll deadline: the offers
    (`observed_at` set aside), wall seconds, calls made (attempts), failed regions and
    the chains' timings."""
    calls: Counter[str] = Counter()
    adapter = AzureAdapter(subscription_id=fake.subscription_id, regions=regions,
                           endpoint=fake.url, anonymous=True, max_workers=args.workers,
                           call_timeout=args.call_timeout,
                           on_call=lambda op, region: calls.update([op]))
    timings = timed(adapter)
    t = time.perf_counter()
    try:
        with poll_deadline(args.deadline):
            polls = await asyncio.gather(*(adapter.poll(r) for r in regions),
                                         return_exceptions=True)
    finally:
        wall = time.perf_counter() - t
        await adapter.close()
    offers: dict[PoolKey, Offer] = {}
    failed = []
    for region, got in zip(regions, polls, strict=True):
        if isinstance(got, BaseException):
            failed.append(f"{region}: {type(got).__name__}: {got}")
            continue
        offers.update((o.pool, dataclasses.replace(o, observed_at=EPOCH)) for o in got)
    return offers, wall, sum(calls.values()), failed, timings


async def run_faults(args: argparse.Namespace) -> dict[str, Any]:
    regions = REGIONS[:args.regions]
    hang = args.call_timeout + 0.5
    out: dict[str, Any] = {"regions": regions, "latency_s": args.latency,
                           "faults": args.faults, "call_timeout_s": args.call_timeout,
                           "hang_s": hang, "deadline_s": args.deadline, "runs": []}
    with FakeAzure(seed=args.seed) as fake:
        fake.latency = (args.latency[0], args.latency[1])
        for i in range(args.repeat):
            fake.chaos = None
            clean, clean_wall, clean_calls, clean_failed, _ = await first_poll(
                fake, regions, args)
            fake.chaos = Chaos(rate=args.faults, kinds=CHAOS_KINDS, hang_seconds=hang,
                               seed=args.seed + i)
            fake.faulted.clear()
            faulty, wall, calls, failed, timings = await first_poll(fake, regions, args)
            slowest = max(timings.by.items(), key=lambda kv: max(kv[1]))
            differ = sum(1 for k in clean.keys() | faulty.keys()
                         if clean.get(k) != faulty.get(k))
            out["runs"].append({
                "wall_clean_s": clean_wall, "wall_faults_s": wall,
                "calls_clean": clean_calls, "calls_faults": calls,
                "faulted": dict(fake.faulted), "offers": len(clean),
                "offers_differ": differ, "equal": differ == 0 and not failed,
                "failed_regions": clean_failed + failed,
                "slowest_chain": f"{slowest[0][0]} {slowest[0][1]}",
                "slowest_chain_s": max(slowest[1])})
    return out


def print_faults(out: dict[str, Any]) -> None:
    print(f"Azure first poll of {len(out['regions'])} regions ({', '.join(out['regions'])})"
          f", {out['latency_s'][0] * 1000:.0f}-{out['latency_s'][1] * 1000:.0f} ms per "
          f"call; faults on {out['faults']:.0%} of calls (throttle / 5xx / timeout "
          f"{out['hang_s']:g} s / truncated), call timeout {out['call_timeout_s']:g} s, "
          f"poll deadline {out['deadline_s']:g} s")
    print(f"{'run':>4} {'wall s':>7} {'faults s':>9} {'calls':>6} {'faults':>7} "
          f"{'thr':>4} {'5xx':>4} {'tmo':>4} {'cut':>4} {'offers':>7} {'equal':>6}")
    for i, r in enumerate(out["runs"], 1):
        f = r["faulted"]
        print(f"{i:>4} {r['wall_clean_s']:7.2f} {r['wall_faults_s']:9.2f} "
              f"{r['calls_clean']:6d} {r['calls_faults']:7d} {f.get('throttle', 0):4d} "
              f"{f.get('5xx', 0):4d} {f.get('timeout', 0):4d} {f.get('truncated', 0):4d} "
              f"{r['offers']:7d} {'yes' if r['equal'] else 'NO':>6}")
        for line in r["failed_regions"]:
            print(f"     failed: {line}")
    runs = out["runs"]
    med = medians([{k: r[k] for k in ("wall_clean_s", "wall_faults_s", "calls_clean",
                                      "calls_faults")} for r in runs])
    print(f" med {med['wall_clean_s']:7.2f} {med['wall_faults_s']:9.2f} "
          f"{med['calls_clean']:6.0f} {med['calls_faults']:7.0f}   "
          f"offers equal in {sum(r['equal'] for r in runs)} of {len(runs)} runs")


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
    p.add_argument("--faults", type=float, default=0.0, metavar="RATE",
                   help="share of calls the fake faults (0: measure the poll as usual)")
    p.add_argument("--call-timeout", type=float, default=2.0,
                   help="with --faults: call_timeout_seconds (a timeout fault answers "
                        "0.5 s later)")
    p.add_argument("--deadline", type=float, default=30.0,
                   help="with --faults: the poll's deadline (poll.timeout_seconds)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.faults:
        fout = asyncio.run(run_faults(args))
        if args.json:
            print(json.dumps(fout, indent=2))
        else:
            print_faults(fout)
        return
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
