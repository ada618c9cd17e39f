"""Orphaned leases: `place()` calls cancelled at random moments leave no active lease.

One private mosquitto, the real daemon (`python -m broker.cli run`, a subprocess, on the
simulated market, its HTTP API on), one `gpubroker_client.BrokerClient`. `--count`
`place()` calls (default 1,000, each for 1 GPU of a common model) are started at once and
each is cancelled at a random moment in `[0, --window]` seconds; the calls that return
before their cancel hold their lease. When every call has ended, a last `place()` is
awaited (the daemon answers in order: every request sent before it is decided by then),
then `--grace` seconds (default 5) pass, and the daemon's HTTP API (`GET /v1/leases`)
is read: the active leases of the bench's scheduler that no call returned are the
orphans. Contract 1.1 (#29): 0.

    cd /work/main && python bench/client_cancel.py [--count 1000] [--window 1.5] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parent.parent
sys.path[:0] = [str(SCRIPT.parent), str(ROOT / "client")]

from latency import Daemon, Mosquitto, free_port  # noqa: E402  (the same mosquitto and daemon)

from gpubroker_client import BrokerClient, BrokerError, Lease  # noqa: E402

SCHEDULER = "cancel-bench"
GPUS = ["T4", "L4", "A10G", "A100-80GB", "H100-80GB"]


def leases(listen: str, state: str = "active") -> list[dict[str, Any]]:
    query = urllib.parse.urlencode({"state": state, "scheduler": SCHEDULER})
    with urllib.request.urlopen(f"http://{listen}/v1/leases?{query}", timeout=30) as r:
        rows: list[dict[str, Any]] = json.loads(r.read())
    return rows


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    mosq = Mosquitto(workdir)
    mosq.start()
    listen = f"127.0.0.1:{free_port()}"
    daemon = Daemon(workdir / "daemon", mosq.url, seed=args.seed, regions=3,
                    poll_interval=3600, http_listen=listen)
    try:
        await daemon.start()
        await daemon.wait_ready()
        return await load(args, mosq.url, listen)
    finally:
        await daemon.stop()
        mosq.stop()


async def load(args: argparse.Namespace, url: str, listen: str) -> dict[str, Any]:
    rng = random.Random(args.seed)
    loop = asyncio.get_running_loop()
    async with BrokerClient(url, scheduler=SCHEDULER) as c:
        if not await c.wait_daemon_online(30):
            raise SystemExit("bench: the daemon did not come online")
        started = time.monotonic()
        tasks = [asyncio.create_task(c.place(gpu=rng.choice(GPUS), gpus=1, timeout=120,
                                             lease_seconds=3600))
                 for _ in range(args.count)]
        for t in tasks:
            loop.call_later(rng.uniform(0.0, args.window), t.cancel)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        outcome = Counter("returned" if isinstance(r, Lease) else
                          "cancelled" if isinstance(r, asyncio.CancelledError) else
                          type(r).__name__ for r in results)
        held = {r.lease_id for r in results if isinstance(r, Lease)}
        last = await c.place(gpu="T4", gpus=1, request_id=f"last-{time.time_ns()}")
        await last.release()
        decided_at = time.monotonic()
        await asyncio.sleep(args.grace)  # the figure is "active after `grace` seconds"
        active = await asyncio.to_thread(leases, listen)
        released = await asyncio.to_thread(leases, listen, "released")
        orphans = [le for le in active if le["lease_id"] not in held]
        for r in results:
            if isinstance(r, Lease):
                try:
                    await r.release()
                except BrokerError as exc:
                    print(f"bench: release of {r.lease_id}: {exc}", file=sys.stderr)
    return {"calls": args.count, "window_seconds": args.window, "outcome": dict(outcome),
            "held_by_callers": len(held),
            "released_by_the_client": len(released) - 1,  # less the last place()
            "active_after_grace": len(active),
            "orphans": len(orphans), "grace_seconds": args.grace,
            "seconds_to_last_decision": round(decided_at - started, 3)}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=1000, help="place() calls (default 1000)")
    p.add_argument("--window", type=float, default=1.5,
                   help="each call is cancelled at a random moment in [0, WINDOW] s")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds after the last decision before counting (default 5)")
    p.add_argument("--seed", type=int, default=29)
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gpubroker-cancel-") as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:26} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
