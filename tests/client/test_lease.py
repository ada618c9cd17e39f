"""A held lease under contract 1.1: the epoch on every verb, `lease.current`,
`report.declined`, `request.invalid` matched by `verb`/`lease_id`, `adopt`, and callbacks
that cannot stall a renewal.

The answers only a 1.1 daemon gives come from a scripted daemon: a plain MQTT client on
the real mosquitto that answers the client's requests with the contract's events."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import aiomqtt
import pytest
from daemon_helpers import PREFIX, StartDaemon
from mqtt_helpers import Mosquitto

from broker.model import LeaseState, iso
from gpubroker_client import (
    BrokerClient,
    InvalidRequest,
    Lease,
    LeaseEnded,
    LeaseEvent,
    LeaseEventKind,
    ReportDeclined,
)

S = "train"
GPUS = ["A100-80GB", "H100-80GB"]
Answer = Callable[[str, dict[str, Any]], list[tuple[str, dict[str, Any]]]]


def placement(zone: str) -> dict[str, Any]:
    return {"cloud": "aws", "region": "us-east-1", "zone": zone,
            "instance_type": "p5.48xlarge", "market": "spot", "instances": 1,
            "gpu": "H100-80GB", "gpus": 8, "total_gpus": 8, "price_per_hour": 31.2,
            "price_per_gpu_hour": 3.9, "price_observed_at": iso(datetime.now(UTC))}


def decided(rid: str, lease_id: str = "L-1") -> dict[str, Any]:
    return {"request_id": rid, "lease_id": lease_id, "epoch": 1,
            "placement": placement("us-east-1a"), "lease_seconds": 900, "reason": "cheapest",
            "alternatives": [],
            "expires_at": iso(datetime.now(UTC) + timedelta(seconds=100))}


class ScriptedDaemon:
    """Answers P/requests/S/<verb> with `answer(verb, body)`; keeps what it was sent."""

    def __init__(self, mosquitto: Mosquitto, answer: Answer) -> None:
        self.mosquitto = mosquitto
        self.answer = answer
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()

    async def __aenter__(self) -> ScriptedDaemon:
        self._task = asyncio.create_task(self._serve())
        async with asyncio.timeout(10):
            await self._ready.wait()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()

    async def _serve(self) -> None:
        async with aiomqtt.Client("127.0.0.1", self.mosquitto.port,
                                  identifier=f"scripted-{uuid.uuid4().hex[:8]}") as c:
            await c.subscribe(f"{PREFIX}/requests/{S}/+", qos=1)
            await c.publish(f"{PREFIX}/status", json.dumps(
                {"state": "online", "ts": iso(datetime.now(UTC)), "boot_id": "b",
                 "version": "1.1", "node": "n", "role": "leader", "epoch": 0}), qos=1,
                retain=True)
            self._ready.set()
            async for m in c.messages:
                verb = str(m.topic).rsplit("/", 1)[-1]
                body = json.loads(bytes(m.payload))  # type: ignore[arg-type]
                self.requests.append((verb, body))
                for kind, data in self.answer(verb, body):
                    env = {"specversion": "1.0", "id": str(uuid.uuid4()),
                           "source": "gpubroker://scripted", "type": f"gpubroker.{kind}.v1",
                           "time": iso(datetime.now(UTC)), "datacontenttype": "application/json",
                           "seq": len(self.requests), "bootid": "b", "data": data}
                    await c.publish(f"{PREFIX}/events/{S}/{kind}", json.dumps(env), qos=1)

    def sent(self, verb: str) -> list[dict[str, Any]]:
        return [b for v, b in self.requests if v == verb]


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
async def test_a_stale_renew_learns_the_move_and_renews_at_the_new_epoch(
        mosquitto: Mosquitto, protocol: str) -> None:
    moved = placement("us-east-1c")

    def answer(verb: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        if verb == "place":
            return [("placement.decided", decided(body["request_id"]))]
        expires = iso(datetime.now(UTC) + timedelta(seconds=900))
        if body.get("epoch") == 1:
            return [("lease.current", {"lease_id": "L-1", "scheduler": S, "request_id": "r",
                                       "state": "active", "epoch": 2, "placement": moved,
                                       "expires_at": expires, "lease_seconds": 900,
                                       "stale_epoch": 1})]
        return [("lease.renewed", {"lease_id": "L-1", "epoch": 2, "expires_at": expires})]

    async with ScriptedDaemon(mosquitto, answer) as daemon, \
            BrokerClient(mosquitto.url, scheduler=S, protocol=protocol) as c:
        lease = await c.place(gpu="H100-80GB", gpus=8, request_id="r", timeout=5)
        assert lease.lease_seconds == 900  # the daemon's, not expiry less decision (100)
        old = lease.placement
        await lease.renew(timeout=5)
        kinds = [ev.kind for ev in lease._history]
    assert [b.get("epoch") for b in daemon.sent("renew")] == [1, 2]
    assert lease.epoch == 2 and lease.placement.pool.zone == "us-east-1c"
    assert kinds == [LeaseEventKind.FAILOVER, LeaseEventKind.RENEWED]
    assert lease._history[0].previous == old


async def test_reports_are_sent_again_until_answered_and_declined_is_raised(
        mosquitto: Mosquitto) -> None:
    def answer(verb: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        if verb == "place":
            return [("placement.decided", decided(body["request_id"]))]
        if len(daemon.sent("report")) < 2:
            return []  # the first one's answer is lost
        return [("report.declined", {"lease_id": "L-1", "epoch": 1, "kind": body["kind"],
                                     "reason": "pool cooled 3 times this hour",
                                     "retry_after_seconds": 30})]

    async with ScriptedDaemon(mosquitto, answer) as daemon, \
            BrokerClient(mosquitto.url, scheduler=S, resend_after=0.2) as c:
        lease = await c.place(gpu="H100-80GB", gpus=8, request_id="r", timeout=5)
        with pytest.raises(ReportDeclined) as declined:
            await lease.report("unhealthy", "xid 79", timeout=5)
    assert declined.value.retry_after == 30 and declined.value.epoch == 1
    assert [b["epoch"] for b in daemon.sent("report")] == [1, 1]
    assert lease.active and lease.epoch == 1


async def test_request_invalid_is_matched_by_verb_and_lease_id_on_311(
        mosquitto: Mosquitto) -> None:
    """No CorrelationData on 3.1.1, and a message that does not quote the lease id: the
    answer's `verb` and `lease_id` say whose it is; the client does not wait it out."""
    def answer(verb: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        if verb == "place":
            return [("placement.decided", decided(body["request_id"]))]
        return [("request.invalid", {"errors": [{"field": "epoch",
                                                 "message": "the lease is at epoch 1"}],
                                     "topic": f"{PREFIX}/requests/{S}/{verb}",
                                     "verb": verb, "lease_id": body["lease_id"]})]

    async with ScriptedDaemon(mosquitto, answer), \
            BrokerClient(mosquitto.url, scheduler=S, protocol="3.1.1") as c:
        await c.place(gpu="H100-80GB", gpus=8, request_id="r", timeout=5)
        async with asyncio.timeout(3):  # not the 30 s of the verb's timeout
            with pytest.raises(InvalidRequest) as bad:
                await c.renew("L-1", epoch=7)
    assert bad.value.fields == ["epoch"]


async def test_adopt_by_request_id_looks_the_lease_up(mosquitto: Mosquitto) -> None:
    def answer(verb: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        if verb == "lookup" and body["request_id"] == "job-9":
            return [("placement.decided", decided("job-9", "L-9"))]
        return [("request.invalid", {"request_id": body["request_id"], "verb": verb,
                                     "errors": [{"field": "request_id",
                                                 "message": "no lease for this request_id"}],
                                     "topic": f"{PREFIX}/requests/{S}/{verb}"})]

    async with ScriptedDaemon(mosquitto, answer), \
            BrokerClient(mosquitto.url, scheduler=S) as c:
        lease = await c.adopt(request_id="job-9", timeout=5)
        with pytest.raises(InvalidRequest) as unknown:
            await c.adopt(request_id="job-0", timeout=5)
    assert lease.lease_id == "L-9" and lease.lease_seconds == 900 and lease.active
    assert unknown.value.fields == ["request_id"]


async def test_adopt_by_lease_id_from_the_retained_state(start_daemon: StartDaemon,
                                                         mosquitto: Mosquitto) -> None:
    rd = await start_daemon()
    async with BrokerClient(mosquitto.url, scheduler=S) as first:
        placed = await first.place(gpu=GPUS, gpus=8, lease_seconds=120, request_id="job-a")
        ended = await first.place(gpu="T4", gpus=1)
        await ended.release()
    async with BrokerClient(mosquitto.url, scheduler=S, instance="second") as c:
        assert c.client_id == f"gpubroker-client-{S}-second"
        lease = await c.adopt(placed.lease_id, keep_alive=True)
        assert c.leases == [lease]
        with pytest.raises(LeaseEnded) as gone:
            await c.adopt(ended.lease_id)
        with pytest.raises(InvalidRequest):
            await c.adopt("L-nope")
        await lease.release()
    assert (lease.request_id, lease.epoch, lease.lease_seconds) == ("job-a", 1, 120)
    assert lease.placement == placed.placement
    assert gone.value.state is LeaseState.RELEASED
    assert rd.daemon.book.get(lease.lease_id).state is LeaseState.RELEASED  # type: ignore[union-attr]


async def test_a_slow_callback_does_not_delay_renewals(start_daemon: StartDaemon,
                                                       mosquitto: Mosquitto) -> None:
    """The keep-alive never waits for user code: an on_failover that does not return
    until the test lets it still sees the lease renewed, again and again, meanwhile."""
    rd = await start_daemon()
    entered, let_go = asyncio.Event(), asyncio.Event()
    seen: list[LeaseEvent] = []

    async def on_failover(lease: Lease, ev: LeaseEvent) -> None:
        seen.append(ev)
        entered.set()
        await let_go.wait()

    async with BrokerClient(mosquitto.url, scheduler=S) as c:
        lease = await c.place(gpu=GPUS, gpus=8, market="spot", lease_seconds=2,
                              keep_alive=True, on_failover=on_failover)
        rd.sim.interrupt(lease.placement.pool)
        async with asyncio.timeout(10):
            await entered.wait()
            renewed = 0
            async for ev in lease.events():
                if ev.kind is LeaseEventKind.RENEWED and ev.epoch == 2:
                    renewed += 1
                    if renewed == 3:  # three renewals of a 2 s lease, the callback stuck
                        break
        assert not let_go.is_set() and lease.active
        let_go.set()
        await lease.release()
    assert [ev.kind for ev in seen] == [LeaseEventKind.FAILOVER]
