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

`--faults RATE` measures something else: the command `gpubroker offers --cloud gcp
--format json` (a subprocess, configured as a user would: `endpoint` the fake, `anonymous:
true`, `call_timeout_seconds`) run once against the fake without faults and once with
RATE of its calls faulted at random (`--kinds`, default all four: throttle, 5xx, timeout
after `--hang` seconds, truncated body), each repeat; it reports the calls the fake
received, the wall time, and whether the two runs listed the same offers (every field
but `observed_at`). No call is spared: a call that fails all its attempts shows as
unequal offers.

    python bench/gcp_poll.py [--regions 3] [--latency 0.05 0.15] [--repeat 3]
                             [--pages small|api] [--json]
    python bench/gcp_poll.py --faults 0.3 [--kinds throttle 5xx timeout truncated]
                             [--hang 1.5] [--call-timeout 1] [--regions 3] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"),
               str(ROOT / "tests" / "support"), str(ROOT / "tests" / "fakes")]

from _poll_common import Timings, medians, one_poll, print_table  # noqa: E402
from fake_gcp import FakeGCP  # noqa: E402
from fake_server import CHAOS_KINDS, Chaos  # noqa: E402

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


API_PAGES = {"machineTypes.list": 500, "acceleratorTypes.list": 500, "skus.list": 5000}


def _offers_command(config: Path) -> tuple[float, int, str, list[str]]:
    """Run `gpubroker offers` once: (wall seconds, exit code, stderr, offers as JSON
    without `observed_at`, sorted)."""
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "broker.cli", "offers", "--config", str(config),
                        "--cloud", "gcp", "--format", "json"], capture_output=True,
                       text=True, cwd=ROOT, timeout=600, check=False)
    wall = time.perf_counter() - t
    rows = []
    for line in r.stdout.splitlines():
        row = json.loads(line)
        row.pop("observed_at", None)
        rows.append(json.dumps(row, sort_keys=True))
    return wall, r.returncode, r.stderr, sorted(rows)


def run_faults(args: argparse.Namespace) -> dict[str, Any]:
    regions = REGIONS[:args.regions]
    out: dict[str, Any] = {"regions": regions, "rate": args.faults, "kinds": args.kinds,
                           "hang_s": args.hang, "call_timeout_s": args.call_timeout,
                           "latency_s": args.latency, "pages": args.pages, "runs": []}
    with FakeGCP(seed=args.seed) as fake, tempfile.TemporaryDirectory() as tmp:
        fake.skus()
        if args.pages == "api":
            fake.page_size.update(API_PAGES)
        fake.latency = (args.latency[0], args.latency[1])
        config = Path(tmp) / "gcp.yaml"
        config.write_text(yaml.safe_dump({
            "poll": {"timeout_seconds": args.poll_timeout},
            "clouds": {"gcp": {"project": fake.project, "regions": regions,
                               "endpoint": fake.url, "anonymous": True,
                               "call_timeout_seconds": args.call_timeout}}}))
        for i in range(args.repeat):
            run: dict[str, Any] = {}
            for label, chaos in (("clean", None), ("faulted", Chaos(
                    rate=args.faults, kinds=tuple(args.kinds), hang_seconds=args.hang,
                    seed=args.seed + i))):
                fake.chaos = chaos
                fake.reset_calls()
                fake.faulted.clear()
                wall, code, stderr, rows = _offers_command(config)
                fake.chaos = None
                # A call that timed out is counted when its (late) answer goes out.
                time.sleep(args.hang + 0.5 if chaos is not None else 0.0)
                run[label] = {"wall_s": wall, "exit": code, "offers": len(rows),
                              "calls": sum(fake.calls.values()),
                              "faulted": dict(fake.faulted),
                              "traceback": "Traceback" in stderr, "rows": rows}
            run["equal"] = run["clean"]["rows"] == run["faulted"]["rows"]
            for label in ("clean", "faulted"):
                del run[label]["rows"]
            out["runs"].append(run)
    return out


def print_faults(out: dict[str, Any]) -> None:
    print(f"gpubroker offers --cloud gcp, {len(out['regions'])} regions "
          f"({', '.join(out['regions'])}), {out['rate']:.0%} of calls faulted "
          f"({', '.join(out['kinds'])}; timeouts answer after {out['hang_s']:g}s, "
          f"call_timeout_seconds {out['call_timeout_s']:g}), "
          f"{out['latency_s'][0] * 1000:.0f}-{out['latency_s'][1] * 1000:.0f} ms per call, "
          f"{out['pages']} pages")
    print(f"{'run':>4} {'clean s':>8} {'faulted s':>10} {'calls clean':>12} "
          f"{'calls faulted':>14} {'offers':>7} {'equal':>6} {'exit':>5}  faulted by kind")
    for i, r in enumerate(out["runs"], 1):
        c, f = r["clean"], r["faulted"]
        print(f"{i:>4} {c['wall_s']:8.2f} {f['wall_s']:10.2f} {c['calls']:12d} "
              f"{f['calls']:14d} {f['offers']:7d} {'yes' if r['equal'] else 'NO':>6} "
              f"{f['exit']:>5}  " + ", ".join(f"{k} {v}" for k, v in sorted(
                  f["faulted"].items())) + (" TRACEBACK" if f["traceback"] else ""))


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
    p.add_argument("--faults", type=float, default=None, metavar="RATE",
                   help="run `gpubroker offers` without and with RATE of calls faulted")
    p.add_argument("--kinds", nargs="+", choices=CHAOS_KINDS, default=list(CHAOS_KINDS))
    p.add_argument("--hang", type=float, default=1.5,
                   help="seconds before a `timeout` fault answers")
    p.add_argument("--call-timeout", type=float, default=1.0,
                   help="clouds.gcp.call_timeout_seconds of the command")
    p.add_argument("--poll-timeout", type=float, default=30.0,
                   help="poll.timeout_seconds of the command (the config's default: 30)")
    args = p.parse_args()
    if args.faults is not None:
        result = run_faults(args)
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            print_faults(result)
        return
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
