"""Batches and single requests together: how long a single request waits behind a batch
that the daemon is deciding (#31).

The daemon (on the simulated market, 88 regions a cloud) gets a batch of `--batch`
place requests at once every `--period` seconds, and single requests at `--rate` a
second all along. A batch small enough for the MILP (`placement.exact_max_batch`, 200)
may go to it while no request waits; the singles that arrive meanwhile wait for the
broker's lock. Prints the singles' latency (p50, p90, p99, max), the batches' requests'
(p50, p99), and the daemon's CPU over the load, for each `--root` (a checkout, e.g. a
git worktree of an earlier commit), the roots alternated `--runs` times.

    python bench/mixed_load.py
    git worktree add /tmp/before HEAD~3
    python bench/mixed_load.py --root /tmp/before --root . --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

SCRIPT = Path(__file__).resolve()
sys.path[:0] = [str(SCRIPT.parent), str(SCRIPT.parent.parent)]

import latency  # noqa: E402
from placement import CheckoutDaemon  # noqa: E402


async def run(root: Path, args: argparse.Namespace) -> str:
    workdir = Path(tempfile.mkdtemp(prefix="gpubroker-mixed-"))
    mosq = latency.Mosquitto(workdir)
    mosq.start()
    host, port = latency.host_port(mosq.url)
    try:
        daemon = CheckoutDaemon(root, workdir / "daemon", mosq.url, seed=args.seed,
                                regions=args.regions_per_cloud, poll_interval=3600)
        await daemon.start()
        try:
            await daemon.wait_ready()
            await daemon.settle()
            return await load(host, port, daemon.pid, args)
        finally:
            await daemon.stop()
    finally:
        mosq.stop()
        shutil.rmtree(workdir, ignore_errors=True)


async def load(host: str, port: int, pid: int, args: argparse.Namespace) -> str:
    sent: dict[str, float] = {}
    answered: dict[str, float] = {}
    singles: set[str] = set()
    every = asyncio.Event()  # every request sent is answered
    async with latency.mqtt_client(host, port, "bench-mixed", nodelay=True) as client:
        await client.subscribe(f"{latency.PREFIX}/events/+/+", qos=1)

        async def receive() -> None:
            async for msg in client.messages:
                got = latency.parse_event(msg)
                if got is not None and got[0] in sent and got[0] not in answered:
                    answered[got[0]] = time.monotonic()
                    if sending.done() and len(answered) == len(sent):
                        every.set()

        sending = asyncio.get_running_loop().create_future()
        receiver = asyncio.create_task(receive())
        raw = await latency.RawPublisher.connect(host, port,
                                                 f"bench-mixed-{uuid.uuid4().hex[:8]}")
        try:
            single = latency.place_requests(f"single-{uuid.uuid4().hex[:6]}")
            batch = latency.place_requests(f"batch-{uuid.uuid4().hex[:6]}")
            n_single = n_batch = 0
            start = time.monotonic()
            end = start + args.period * (args.rounds + 1 / 3)
            next_batch = start + args.period / 3
            cpu0 = latency.cpu_seconds(pid)
            while (now := time.monotonic()) < end:
                if now >= next_batch:
                    for _ in range(args.batch):
                        topic, payload, key = batch(n_batch)
                        n_batch += 1
                        sent[key] = time.monotonic()
                        raw.publish(topic, payload)
                    next_batch += args.period
                topic, payload, key = single(n_single)
                n_single += 1
                sent[key] = time.monotonic()
                singles.add(key)
                raw.publish(topic, payload)
                # the next single at its time (an open loop: a late answer delays none)
                await asyncio.sleep(max(0.0, start + n_single / args.rate - time.monotonic()))
            cpu = 100 * (latency.cpu_seconds(pid) - cpu0) / (time.monotonic() - start)
            sending.set_result(None)
            if len(answered) == len(sent):
                every.set()
            async with asyncio.timeout(30):
                await every.wait()
        finally:
            raw.close()
            receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await receiver
    p = latency.percentile
    one = sorted((answered[k] - sent[k]) * 1000 for k in singles)
    many = sorted((answered[k] - sent[k]) * 1000 for k in sent if k not in singles)
    return (f"singles {len(one)}: p50 {p(one, 50):.1f}, p90 {p(one, 90):.1f}, "
            f"p99 {p(one, 99):.1f}, max {one[-1]:.1f} ms; the batches' {len(many)}: "
            f"p50 {p(many, 50):.1f}, p99 {p(many, 99):.1f} ms; daemon CPU {cpu:.0f} %")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, action="append",
                    help="a checkout to run the daemon from (repeat: side by side; "
                         "default: this one)")
    ap.add_argument("--runs", type=int, default=1, help="runs of each root, alternated (1)")
    ap.add_argument("--rounds", type=int, default=12, help="batches in a run (12)")
    ap.add_argument("--batch", type=int, default=150, help="requests in a batch (150)")
    ap.add_argument("--period", type=float, default=1.5, help="seconds between batches (1.5)")
    ap.add_argument("--rate", type=float, default=100.0, help="single requests a second (100)")
    ap.add_argument("--regions-per-cloud", type=int, default=88)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    roots = [r.resolve() for r in (args.root or [SCRIPT.parent.parent])]
    print(f"mixed load: a batch of {args.batch} every {args.period} s, singles at "
          f"{args.rate:g}/s, {args.rounds} batches a run; sim seed {args.seed}, "
          f"{args.regions_per_cloud} regions a cloud", flush=True)
    for i in range(args.runs):
        for root in roots:
            print(f"  run {i + 1}, {root}: {asyncio.run(run(root, args))}", flush=True)


if __name__ == "__main__":
    main()
