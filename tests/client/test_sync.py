"""`gpubroker_client.sync.SyncBrokerClient`: the blocking wrapper, against the real daemon.

The daemon runs on the test's event loop, so the blocking calls are made from a worker
thread (`asyncio.to_thread`), as a scheduler's own thread would make them."""

from __future__ import annotations

import asyncio
import threading

from daemon_helpers import StartDaemon
from mqtt_helpers import Mosquitto

from broker.model import LeaseState
from gpubroker_client import Lease, LeaseEvent, LeaseEventKind, Rejected
from gpubroker_client.sync import SyncBrokerClient

S = "train"


async def test_place_renew_report_release_blocking(start_daemon: StartDaemon,
                                                   mosquitto: Mosquitto) -> None:
    rd = await start_daemon()
    ended: list[tuple[str, LeaseEvent]] = []
    called = threading.Event()

    def on_end(lease: Lease, ev: LeaseEvent) -> None:  # a plain function: in a thread
        ended.append((threading.current_thread().name, ev))
        called.set()

    def scheduler() -> tuple[Lease, LeaseEvent, LeaseState, str]:
        with SyncBrokerClient(mosquitto.url, scheduler=S) as c:
            lease = c.place(gpu=["A100-80GB", "H100-80GB"], gpus=8, lease_seconds=300,
                            on_end=on_end)
            c.renew(lease)
            moved = c.report(lease, "launch_failed", "InsufficientInstanceCapacity")
            state = c.release(lease)
            assert called.wait(5)
            try:
                c.place(gpu="MI300X", gpus=1)
            except Rejected as exc:
                code = exc.code
            return lease, moved, state, code

    async with asyncio.timeout(30):
        lease, moved, state, code = await asyncio.to_thread(scheduler)
    assert moved.kind is LeaseEventKind.FAILOVER and moved.epoch == 2 == lease.epoch
    assert state is LeaseState.RELEASED and code == "no_capacity"
    held = rd.daemon.book.get(lease.lease_id)
    assert held is not None and held.state is LeaseState.RELEASED and held.epoch == 2
    assert [ev.kind for _, ev in ended] == ["released"]
    assert ended[0][0] != "gpubroker-client"  # not on the client's loop thread
