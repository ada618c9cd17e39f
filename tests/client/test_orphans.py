"""`place()` calls given up leave no lease behind (contract 1.1, H.15): the real daemon on
a real mosquitto, the calls cancelled at random moments."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from daemon_helpers import RunningDaemon, StartDaemon
from mqtt_helpers import Mosquitto

from broker.model import LeaseState
from gpubroker_client import BrokerClient, Lease, LeaseEnded, PlacementTimeout

S = "train"


def active_ids(rd: RunningDaemon) -> set[str]:
    return {le.lease_id for le in rd.daemon.book.all()
            if le.scheduler == S and le.state is LeaseState.ACTIVE}


class Tally:
    """The daemon's leases of S as its events tell (a broker observer: called as the
    daemon emits each event); `settled` is set once the active ones are `held`."""

    def __init__(self, rd: RunningDaemon) -> None:
        self.active: set[str] = set()
        self.decided: set[str] = set()
        self.held: set[str] | None = None
        self.settled = asyncio.Event()
        rd.daemon.broker.observers.append(self.observe)

    def observe(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "placement.decided" and data.get("state", "active") == "active":
            self.decided |= {p["lease_id"] for p in data.get("parts") or [data]}
            self.active |= {p["lease_id"] for p in data.get("parts") or [data]}
        elif kind in ("lease.released", "lease.expired", "lease.failed"):
            self.active.discard(data["lease_id"])
        self.check()

    def check(self) -> None:
        if self.held is not None and self.active == self.held:
            self.settled.set()

    async def until(self, held: set[str], timeout: float = 10) -> None:
        self.held = held
        self.check()
        async with asyncio.timeout(timeout):
            await self.settled.wait()


async def test_cancelled_places_leave_no_active_lease(start_daemon: StartDaemon,
                                                      mosquitto: Mosquitto) -> None:
    rd = await start_daemon()
    tally = Tally(rd)
    rng = random.Random(29)
    loop = asyncio.get_running_loop()
    async with BrokerClient(mosquitto.url, scheduler=S) as c:
        assert await c.wait_daemon_online(5)
        ids = [c.new_request_id() for _ in range(150)]
        tasks = [asyncio.create_task(c.place(gpu="T4", gpus=1, request_id=rid, timeout=30))
                 for rid in ids]
        for t in tasks:
            loop.call_later(rng.uniform(0.0, 0.6), t.cancel)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        held = {r.lease_id for r in results if isinstance(r, Lease)}
        cancelled = sum(isinstance(r, asyncio.CancelledError) for r in results)
        # A last place(), awaited, is answered after every request sent before it.
        last = await c.place(gpu="T4", gpus=1, request_id="last")
        await last.release()
        await tally.until(held)
        await c.renew(next(iter(held))) if held else None  # one more round: committed
        assert active_ids(rd) == held
        decided = {le.request_id: le for le in rd.daemon.book.all() if le.request_id in ids}
        released = [le for le in decided.values() if le.state is LeaseState.RELEASED]
        for lease in [r for r in results if isinstance(r, Lease)]:
            await lease.release()
    # The figure means something: calls were cancelled after their decision was made.
    assert cancelled > 20 and released, (cancelled, len(decided))
    assert len(held) + len(released) == len(decided)


async def test_a_late_decision_after_a_timeout_is_released(start_daemon: StartDaemon,
                                                           mosquitto: Mosquitto) -> None:
    """The daemon decides after the caller's deadline (held back by a stopped MQTT
    server); the lease is released when the decision arrives, unless the caller asks
    again with the same request_id first."""
    rd = await start_daemon()
    held_back = asyncio.Event()

    def stop_before_the_answer(kind: str, data: dict[str, object]) -> None:
        if kind == "placement.decided" and data["request_id"] == "late" and \
                not held_back.is_set():
            mosquitto.stop()  # blocks the loop: the answer waits for the restart
            held_back.set()

    rd.daemon.broker.observers.append(stop_before_the_answer)
    tally = Tally(rd)
    async with BrokerClient(mosquitto.url, scheduler=S) as c:
        placing = asyncio.create_task(c.place(gpu="T4", gpus=1, request_id="late",
                                              timeout=1.5))
        async with asyncio.timeout(10):
            await held_back.wait()
        try:
            await placing
        except PlacementTimeout as exc:
            assert exc.request_id == "late"
        else:
            raise AssertionError("the place() should have timed out")
        await mosquitto.astart()
        await tally.until(set(), timeout=20)
        (lease_id,) = tally.decided
        with pytest.raises(LeaseEnded) as ended:  # one more round: the release committed
            await c.renew(lease_id)
        assert ended.value.state is LeaseState.RELEASED
    assert not [le for le in rd.daemon.book.all()
                if le.request_id == "late" and le.state is LeaseState.ACTIVE]
