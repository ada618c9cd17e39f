"""A request split across pools, through the broker: one lease per part, one decision."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from contract_check import check
from factories import Clock, Sink, offer, pool_of

from broker.leasing import failover
from broker.leasing.authority import Broker
from broker.leasing.book import LeaseBook
from broker.model import FailoverReason, LeaseState
from broker.state.store import StateStore
from broker.wire.commands import Command
from broker.wire.messages import Envelopes, Messages, Topics
from policies.model import Policy


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[tuple[Broker, Clock, Sink, Path]]:
    clock = Clock()
    store = StateStore(tmp_path / "state.db")
    await store.open()
    pool = pool_of([offer("us-east-1a", price=20.0, capacity=1),
                    offer("us-east-1b", price=24.0, capacity=1),
                    offer("us-east-1c", price=30.0, capacity=1)],
                   clock=clock, stale_after_seconds=300)
    sink = Sink()
    broker = Broker(pool=pool, book=LeaseBook(), store=store,
                    messages=Messages(Topics("p"), Envelopes("t", str(uuid.uuid4()), clock=clock)),
                    policy=Policy(), publish=sink, retry_after_seconds=60, clock=clock)
    yield broker, clock, sink, tmp_path
    await store.close()


def place(request_id: str = "job", gpus: int = 16, **fields: Any) -> Command:
    body = {"request_id": request_id, "gpu": "H100-80GB", "gpus": gpus, "gang": False,
            "max_parts": 3, **fields}
    return Command("sched-a", "place", json.dumps(body).encode(), "p/requests/sched-a/place")


def verb(name: str, lease_id: str) -> Command:
    return Command("sched-a", name, json.dumps({"lease_id": lease_id}).encode(),
                   f"p/requests/sched-a/{name}")


async def test_a_split_is_one_decision_with_a_lease_per_part(setup: Any) -> None:
    broker, _, sink, _ = setup
    await broker.handle([place()])
    [decided] = sink.events("placement.decided")
    for r in sink.rows:
        assert check(r.topic, r.payload) is None, r.topic
    parts = decided["parts"]
    assert [p["part"] for p in parts] == [1, 2]
    assert [p["placement"]["zone"] for p in parts] == ["us-east-1a", "us-east-1b"]
    assert sum(p["gpus"] for p in parts) == 16
    assert decided["lease_id"] == parts[0]["lease_id"]
    assert decided["placement"] == parts[0]["placement"]
    # Each part is a lease of its own, retained on its own topic, holding its pool.
    ids = [p["lease_id"] for p in parts]
    for n, lease_id in enumerate(ids, 1):
        lease = broker.book.get(lease_id)
        assert lease is not None and lease.part == n and lease.parts == tuple(ids)
        assert lease.request.gpus == 8 and lease.request_id == "job"
        assert broker.pool.held(lease.placement.pool) == 1
        state = [json.loads(r.payload) for r in sink.rows
                 if r.topic == f"p/leases/sched-a/{lease_id}"]
        assert state and state[-1]["part"] == n and state[-1]["parts"] == ids


async def test_a_repeated_split_request_gets_the_same_parts(setup: Any) -> None:
    broker, _, sink, _ = setup
    await broker.handle([place()])
    first = sink.events("placement.decided")[0]
    await broker.handle([verb("release", first["parts"][1]["lease_id"])])
    await broker.handle([place()])
    again = sink.events("placement.decided")[1]
    assert [p["lease_id"] for p in again["parts"]] == [p["lease_id"] for p in first["parts"]]
    assert "state" not in again["parts"][0] and again["parts"][1]["state"] == "released"
    # Releasing one part left the other, and its pool, alone.
    head = broker.book.get(first["lease_id"])
    assert head is not None and head.state is LeaseState.ACTIVE
    assert broker.pool.held(head.placement.pool) == 1
    assert len(broker.book.active()) == 1


async def test_a_split_is_found_again_after_a_restart(setup: Any) -> None:
    broker, _, sink, _ = setup
    await broker.handle([place()])
    first = sink.events("placement.decided")[0]
    broker.book = LeaseBook()  # a restart: the book is read back from the store
    broker.book.load(await broker.store.leases())
    broker.restore(broker.book.active())
    await broker.handle([place()])
    again = sink.events("placement.decided")[1]
    assert [p["lease_id"] for p in again["parts"]] == [p["lease_id"] for p in first["parts"]]
    # ... and after the book forgot them all.
    broker.book = LeaseBook()
    broker.restore([])
    await broker.handle([place()])
    third = sink.events("placement.decided")[2]
    assert [p["lease_id"] for p in third["parts"]] == [p["lease_id"] for p in first["parts"]]


async def test_one_part_fails_over_alone(setup: Any) -> None:
    broker, _, sink, _ = setup
    await broker.handle([place()])
    decided = sink.events("placement.decided")[0]
    second = broker.book.get(decided["parts"][1]["lease_id"])
    assert second is not None
    await broker._fail_over(failover.Trigger(second.lease_id, 1,
                                             FailoverReason.INTERRUPTED, "reclaimed"))
    [moved] = sink.events("lease.failover")
    assert moved["lease_id"] == second.lease_id and moved["to"]["zone"] == "us-east-1c"
    after = broker.book.get(second.lease_id)
    assert after is not None and after.epoch == 2 and after.part == 2
    assert after.placement.total_gpus == 8
    head = broker.book.get(decided["lease_id"])
    assert head is not None and head.epoch == 1  # the other part did not move


async def test_a_split_needs_gang_false_and_no_pool_holding_it_is_rejected_whole(
        setup: Any) -> None:
    broker, _, sink, _ = setup
    await broker.handle([place("g", gang=True)])
    [invalid] = sink.events("request.invalid")
    assert invalid["errors"][0]["field"] == "max_parts"
    await broker.handle([place("big", gpus=32)])  # 24 GPUs free in all
    [rejected] = sink.events("placement.rejected")
    assert rejected["code"] == "no_capacity"
    assert broker.book.active() == [] and broker.book.find("sched-a", "big") is None
