"""The payload types (`broker/wire/payloads.py`) describe what the code builds.

The broker is driven through every event kind, in-process on a real pool, lease book and
SQLite store, and every message it hands to the bus is checked against the published
contract as the end-to-end tests check what they receive (`tests/support/contract_check.py`):
a field the code sends that the contract does not name fails here too. The shapes built
outside events — offers, lease states in every state, capacity summaries, the status —
are checked the same way.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, get_args

import factories
import pytest
from contract_check import check, problem, route
from factories import Clock, offer, pool_of

from broker.daemon.config import MqttConfig
from broker.edges.bus import Bus
from broker.leasing.authority import Broker
from broker.leasing.book import LeaseBook
from broker.market import capacity
from broker.model import (
    CLOUDS,
    CapacitySignal,
    FailoverReason,
    LeaseState,
    Market,
    RejectCode,
    SignalKind,
)
from broker.state.store import StateStore
from broker.wire import payloads
from broker.wire.commands import Command
from broker.wire.messages import Envelopes, Messages, Topics
from policies.model import Failover, Policy
from policies.yamlsrc import Problem

P = "gpubroker/v1"
S = "sched-a"


def test_the_names_in_the_types_are_the_models_enums() -> None:
    assert get_args(get_args(payloads.CloudName)[0]) == CLOUDS
    assert get_args(get_args(payloads.MarketName)[0]) == tuple(m.value for m in Market)
    assert get_args(payloads.RejectCodeName) == tuple(c.value for c in RejectCode)
    assert get_args(payloads.FailoverReasonName) == tuple(r.value for r in FailoverReason)
    assert get_args(payloads.LeaseFailedReason) == (
        *(r.value for r in FailoverReason), "ended")
    assert get_args(payloads.LeaseStateName) == tuple(s.value for s in LeaseState)
    assert set(payloads.EVENTS) == {*payloads.EVENT_TYPES, *payloads.OPS_EVENT_TYPES}
    assert set(payloads.REPLY_EVENT_TYPES) <= set(payloads.EVENT_TYPES)


class Sink(factories.Sink):
    def kinds(self) -> list[str]:
        return [r.topic.rsplit("/", 1)[1] for r in self.rows
                if (found := route(r.topic)) and found[0] in ("event", "ops")]

    async def wait_for(self, kind: str, count: int = 1) -> None:
        async with asyncio.timeout(10):
            while self.kinds().count(kind) < count:
                self.arrived.clear()
                await self.arrived.wait()


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[tuple[Broker, Clock, Sink]]:
    clock = Clock()
    store = StateStore(tmp_path / "state.db")
    await store.open()
    pool = pool_of([offer(f"us-east-1{z}", price=20.0 + i, capacity=1)
                    for i, z in enumerate("abcd")], clock=clock, stale_after_seconds=3600)
    sink = Sink()
    b = Broker(pool=pool, book=LeaseBook(), store=store,
               messages=Messages(Topics(P), Envelopes("lab-1", str(uuid.uuid4()), clock=clock)),
               policy=Policy(), publish=sink, retry_after_seconds=60, clock=clock)
    yield b, clock, sink
    await store.close()


def cmd(verb: str, body: Any, *, reply: bool = False, retained: bool = False) -> Command:
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    props = ({"response_topic": f"{P}/replies/{S}/r-1", "correlation_data": "c0ffee"}
             if reply else None)
    return Command(S, verb, payload, f"{P}/requests/{S}/{verb}", props, retained=retained)


def place(request_id: str, **fields: Any) -> dict[str, Any]:
    return {"request_id": request_id, "gpu": "H100-80GB", "gpus": 8, **fields}


async def test_every_event_the_broker_sends_follows_the_contract(
        broker: tuple[Broker, Clock, Sink]) -> None:
    b, clock, sink = broker
    failovers = asyncio.create_task(b.run_failovers())
    try:
        await b.handle([cmd("place", place("r1"), reply=True),
                        cmd("place", place("cheap", max_price_per_gpu_hour=0.01)),
                        cmd("place", place("bad", gpus="eight")),
                        cmd("place", b"\xff not json"),
                        cmd("place", place("sticky"), retained=True),
                        cmd("launch", {"lease_id": "L-x"}),
                        cmd("quote", {"gpu": "H100-80GB", "gpus": 8}, reply=True),
                        cmd("quote", place("q", max_price_per_gpu_hour=0.01))])
        lease = b.book.find(S, "r1")
        assert lease is not None
        ref = {"lease_id": lease.lease_id}
        await b.handle([cmd("place", place("r1")), cmd("renew", ref, reply=True),
                        cmd("renew", {"lease_id": "L-not-mine"})])
        # A report moves the lease (reported), an interruption moves it again; both pools
        # it left cool down.
        await b.handle([cmd("report", ref | {"kind": "launch_failed", "detail": "no stock"})])
        moved = b.book.get(lease.lease_id)
        assert moved is not None and moved.epoch == 2
        # The same report again, its epoch 1 stale now: nothing moves (lease.current).
        await b.handle([cmd("report", ref | {"kind": "launch_failed", "epoch": 1},
                            reply=True)])
        # Beyond max_failovers_per_hour a report is held back (report.declined).
        b.policy = Policy(failover=Failover(max_failovers_per_hour=1))
        await b.handle([cmd("report", ref | {"kind": "unhealthy", "epoch": 2}, reply=True)])
        b.policy = Policy()
        assert b.book.get(lease.lease_id) == moved
        b.signal(CapacitySignal(moved.placement.pool, SignalKind.INTERRUPTED, clock()))
        await sink.wait_for("lease.failover", 2)
        # r2 takes the last pool, r3 finds none; the lease's next loss ends it.
        await b.handle([cmd("place", place("r2")), cmd("place", place("r3"))])
        assert "placement.rejected" in sink.kinds()  # r3: no capacity left
        last = b.book.get(lease.lease_id)
        assert last is not None and last.epoch == 3
        b.signal(CapacitySignal(last.placement.pool, SignalKind.INTERRUPTED, clock()))
        await sink.wait_for("lease.failed")
        # Verbs and repetitions on the failed lease repeat how it ended.
        await b.handle([cmd("renew", ref), cmd("place", place("r1"), reply=True)])
        r2 = b.book.find(S, "r2")
        assert r2 is not None
        await b.handle([cmd("release", {"lease_id": r2.lease_id}, reply=True)])
        await b.handle([cmd("lookup", {"request_id": "r2"}, reply=True),
                        cmd("release", {"request_id": "r2"}),
                        cmd("lookup", {"request_id": "nobody"})])
        await b.handle([cmd("place", place("short", lease_seconds=1))])
        clock.advance(2)
        assert await b.expire_due()
        await b.apply_policy(Policy(), "sha256:" + "0" * 64, "policy.yaml")
        await b.reject_policy("policy.yaml", [
            Problem("policy.yaml", 3, 5, "teams.x.max_gpus", "Input should be a valid integer"),
            Problem("policy.yaml", None, None, "", "cannot read: Permission denied")])
    finally:
        failovers.cancel()
        with pytest.raises(asyncio.CancelledError):
            await failovers

    errors = [e for r in sink.rows if (e := check(r.topic, r.payload)) is not None]
    assert errors == []
    assert set(sink.kinds()) == set(payloads.EVENTS)
    replies = [r for r in sink.rows if r.topic.startswith(f"{P}/replies/")]
    assert len(replies) >= 4
    leases = [r for r in sink.rows if (found := route(r.topic)) and found[0] == "lease"]
    assert any(r.payload == b"" for r in leases) and any(r.payload for r in leases)
    decided = [json.loads(r.payload)["data"] for r in sink.rows
               if r.topic.endswith("/placement.decided")]
    assert {d.get("state") for d in decided} == {None, "failed", "released"}
    assert {d["lease_seconds"] for d in decided} == {900, 1}  # "short" asked for 1 s
    failed = [json.loads(r.payload)["data"] for r in sink.rows
              if r.topic.endswith("/lease.failed")]
    # The repetition says the original reason, and when it failed.
    assert [(d["reason"], "ended_at" in d) for d in failed] == [
        ("interrupted", False), ("interrupted", True)]


async def test_offers_leases_in_every_state_and_capacity_follow_the_contract(
        broker: tuple[Broker, Clock, Sink]) -> None:
    b, clock, _ = broker
    for o in [*b.pool, offer(price=None, availability=None, interruption_rate=None,
                             market="on_demand", gpu="Tesla-X9", gpus=1)]:
        assert problem("offer", o.to_json()) is None
    await b.handle([cmd("place", place("r1")), cmd("place", place("r2"))])
    for le in b.book.all():
        assert problem("lease-state", le.to_json()) is None
    r1 = b.book.find(S, "r1")
    assert r1 is not None
    ended = b.book.end(r1.lease_id, LeaseState.RELEASED, clock())
    assert problem("lease-state", ended.to_json()) is None
    summaries = capacity.summaries(list(b.pool), b.pool, clock())
    assert summaries
    for summary in summaries.values():
        assert problem("capacity", json.loads(json.dumps(summary))) is None


async def test_the_status_follows_the_contract(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")
    bus = Bus(MqttConfig(), Topics(P), store, client_id="c", boot_id=str(uuid.uuid4()),
              on_command=lambda _: asyncio.sleep(0))
    for state in ("online", "offline"):
        assert check(f"{P}/status", bus._status(state)) is None


def test_a_field_the_contract_does_not_name_is_an_error() -> None:
    summary = {"cloud": "aws", "region": "r", "gpu": "T4", "cheapest_spot_per_gpu_hour": None,
               "cheapest_on_demand_per_gpu_hour": 0.5, "cheapest_reserved_per_gpu_hour": None,
               "free_instances": None, "free_gpus": None, "reserved_gpus": 0,
               "free_reserved_instances": None, "free_reserved_gpus": None,
               "pools": 1, "observed_at": "2026-11-30T12:00:00.000Z",
               "age_seconds": 1.5}
    assert problem("capacity", summary) is None
    assert "'surprise' was unexpected" in str(problem("capacity", summary | {"surprise": 1}))
    assert "required" in str(problem("capacity", {k: v for k, v in summary.items()
                                                   if k != "pools"}))
    assert check(f"{P}/events/{S}/lease.teleported", b"{}") is not None
    assert check(f"{P}/leases/{S}/L-1", b"") is None  # an ended lease: cleared
    assert check(f"{P}/requests/{S}/place", b"not checked") is None
