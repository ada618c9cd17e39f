"""A tiny scheduler on gpubroker's client (`gpubroker_client`).

It places a few jobs, keeps their leases alive, "restarts" a job wherever the broker
moves it after a failover, and releases every lease on the way out (Ctrl-C, SIGTERM,
`--duration`).

    gpubroker demo                                   # in one terminal (or a real daemon)
    python examples/scheduler.py --scheduler demo-train
    python examples/scheduler.py --mqtt mqtts://mqtt.example:8883 --scheduler train \\
        --topic-prefix gpubroker/v1

A real scheduler would launch the job's instances where `lease.placement` says, and pass
`lease.epoch` along as a fencing token: after a failover, only the newest epoch's
instances may write the job's checkpoints.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import uuid
from typing import Any

from gpubroker_client import (
    DEFAULT_PREFIX,
    BrokerClient,
    BrokerError,
    InvalidRequest,
    Lease,
    LeaseEvent,
    Placement,
    Rejected,
)

JOBS: dict[str, dict[str, Any]] = {
    "pretrain": {"gpu": ["H100-80GB", "A100-80GB"], "gpus": 8, "market": "spot"},
    "finetune": {"gpu": "A100-40GB", "gpus": 4, "market": "any"},
    "eval": {"gpu": ["L4", "T4"], "gpus": 1, "market": "spot"},
}


def where(p: Placement) -> str:
    return (f"{p.instances} × {p.pool.instance_type} ({p.gpus} {p.gpu} each) on "
            f"{p.pool.cloud}/{p.pool.zone} {p.pool.market.value}, "
            f"${p.price_per_gpu_hour:.3f}/GPU-h")


def say(job: str, what: str) -> None:
    print(f"{job:<9} {what}", flush=True)


async def run(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    run_id = uuid.uuid4().hex[:8]
    jobs: dict[str, Lease] = {}

    def moved(lease: Lease, ev: LeaseEvent) -> None:
        job = lease.request_id.split("/")[0]
        say(job, f"moved ({ev.reason or 'failover'}), restarting at epoch {ev.epoch}: "
                 f"{where(ev.placement)}")

    def ended(lease: Lease, ev: LeaseEvent) -> None:
        job = lease.request_id.split("/")[0]
        if ev.kind != "released":  # expired or failed: the broker took it back
            say(job, f"lost its lease ({ev.kind}{': ' + ev.detail if ev.detail else ''})")
        jobs.pop(job, None)

    async with BrokerClient(args.mqtt, scheduler=args.scheduler,
                            topic_prefix=args.topic_prefix) as broker:
        print(f"scheduler {args.scheduler} on {args.mqtt} ({args.topic_prefix}/…)", flush=True)
        try:
            for job, ask in JOBS.items():
                if stop.is_set():
                    break
                try:
                    # The request id names the job: asking again after a crash or a lost
                    # answer gets the same lease, never a second one.
                    lease = await broker.place(**ask, request_id=f"{job}/{run_id}",
                                               lease_seconds=args.lease_seconds,
                                               keep_alive=True, on_failover=moved,
                                               on_end=ended, timeout=30)
                except Rejected as exc:
                    say(job, f"not placed ({exc.code}): {exc.detail}")
                    continue
                except InvalidRequest as exc:
                    say(job, f"bad request: {exc}")
                    continue
                jobs[job] = lease
                say(job, f"placed {lease.lease_id}: {where(lease.placement)}")
            try:
                async with asyncio.timeout(args.duration):  # None: until a signal
                    await stop.wait()
            except TimeoutError:
                pass
        finally:
            print(f"releasing {len(jobs)} lease(s)", flush=True)
            for job, lease in list(jobs.items()):
                try:
                    await lease.release(timeout=10)
                    say(job, "released")
                except BrokerError as exc:
                    say(job, f"not released: {exc}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mqtt", default="mqtt://127.0.0.1:1883",
                   help="MQTT server URL (default: mqtt://127.0.0.1:1883)")
    p.add_argument("--scheduler", default="example",
                   help="scheduler id (default: example)")
    p.add_argument("--topic-prefix", default=DEFAULT_PREFIX,
                   help=f"topic root (default: {DEFAULT_PREFIX})")
    p.add_argument("--lease-seconds", type=int, default=60,
                   help="lease period; the client renews half-way (default: 60)")
    p.add_argument("--duration", type=float, default=None,
                   help="stop after this many seconds (default: until Ctrl-C)")
    args = p.parse_args(argv)
    try:
        return asyncio.run(run(args))
    except (BrokerError, ValueError) as exc:
        print(f"scheduler: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
