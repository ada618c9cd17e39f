"""One full poll of several GCP regions against the fake Google Cloud endpoint with
per-call latency: wall time against the critical path, and API calls per poll.

The critical path is the longest chain of calls that must run one after another: per
region, `regions.get` (which names the zones) then the slowest zone's machine-type or
accelerator-type pages; beside them, once for all regions, the Billing Catalog's SKU
pages and the project's quotas. With unlimited parallelism a poll could not be faster.
The steady-state poll is the next one, a poll interval (60 s of the adapter's clock)
later.

`--pages small` (the default) serves lists in the small pages the tests use (10 machine
types, 3 accelerator types, 100 SKUs), so every list takes several pages; `--pages api`
serves the largest pages the adapter asks for (500, 500, 5000), as the real APIs would.

    python bench/gcp_poll.py [--regions 3] [--latency 0.05 0.15] [--repeat 3]
                             [--pages small|api] [--json]
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

from _poll_common import Timings, medians, one_poll, print_table  # noqa: E402
from fake_gcp import FakeGCP  # noqa: E402

from adapters.gcp.adapter import GcpAdapter  # noqa: E402

REGIONS = ["us-central1", "us-east4", "europe-west4", "asia-southeast1", "us-west1",
           "europe-west1"]
CHAINS = ("region", "machine_types", "accelerator_types", "skus", "project_quotas")


def critical_path(timings: Timings, zones: dict[str, tuple[str, ...]]) -> tuple[float, str]:
    """The longest chain and its name: a region's call then its slowest zone list, the
    SKU pages, or the project's quotas."""
    longest = timings.longest
    chains = {f"{r}: region + zone lists": longest("region", r) + max(
        [max(longest("machine_types", z), longest("accelerator_types", z)) for z in zs]
        or [0.0]) for r, zs in zones.items()}
    chains["SKU pages"] = longest("skus")
    chains["project quotas"] = longest("project_quotas")
    name = max(chains, key=lambda k: chains[k])
    return chains[name], name


class Clock:
    """time.monotonic, moved forward at will (to reach the next poll without waiting)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


async def run(args: argparse.Namespace) -> dict[str, Any]:
    random.seed(args.seed)
    regions = REGIONS[:args.regions]
    with FakeGCP(seed=args.seed) as fake:
        fake.skus()  # build the fake's catalog before measuring
        if args.pages == "api":
            fake.page_size.update({"machineTypes.list": 500, "acceleratorTypes.list": 500,
                                   "skus.list": 5000})
        fake.latency = (args.latency[0], args.latency[1])
        zones = {r: fake.zones(r) for r in regions}
        out: dict[str, Any] = {"regions": regions, "zones": sum(map(len, zones.values())),
                               "skus": len(fake.skus()), "latency_s": args.latency,
                               "runs": []}
        for _ in range(args.repeat):
            fake.reset_calls()
            clock = Clock()
            adapter = GcpAdapter(regions=regions, project=fake.project, endpoint=fake.url,
                                 anonymous=True, max_workers=args.workers, monotonic=clock)
            timings = Timings()
            timings.wrap(adapter.sdk, CHAINS)
            wall = await one_poll(adapter, regions)
            first_calls = sum(fake.calls.values())
            by_op = {op: fake.call_count(op) for op in sorted({op for op, _ in fake.calls})}
            critical, chain = critical_path(timings, zones)
            fake.reset_calls()
            clock.offset += 60  # the next poll, one interval later
            steady_wall = await one_poll(adapter, regions)
            steady_calls = sum(fake.calls.values())
            await adapter.close()
            out["runs"].append({"wall_s": wall, "critical_s": critical,
                                "ratio": wall / critical, "calls_first": first_calls,
                                "calls_steady": steady_calls, "steady_wall_s": steady_wall})
        out["calls_first_by_op"] = by_op
        out["critical_chain"] = chain
        out["median"] = medians(out["runs"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--regions", type=int, default=3, choices=range(1, len(REGIONS) + 1))
    p.add_argument("--latency", type=float, nargs=2, default=[0.05, 0.15])
    p.add_argument("--workers", type=int, default=None,
                   help="the adapter's thread pool (default: the adapter's own choice)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--pages", choices=("small", "api"), default="small",
                   help="the fake's page sizes (see above)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    out = asyncio.run(run(args))
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"GCP poll of {len(out['regions'])} regions ({', '.join(out['regions'])}; "
          f"{out['zones']} zones; {out['skus']} SKUs), "
          f"{args.latency[0] * 1000:.0f}-{args.latency[1] * 1000:.0f} ms per call, "
          f"{args.workers or 'default'} worker threads, {args.pages} pages, "
          f"{args.repeat} runs")
    print_table(out, f" {'steady wall s':>14}", lambda r: f" {r['steady_wall_s']:14.2f}")
    print("critical chain (last run):", out["critical_chain"])
    print("first poll, calls by op:", ", ".join(f"{k} {v}" for k, v in
                                                 out["calls_first_by_op"].items()))


if __name__ == "__main__":
    main()
