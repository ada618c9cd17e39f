"""The broker's own decisions without MQTT: a real pool, lease book and SQLite store."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from factories import SLICE, Clock, offer, pool_of, request

from broker.core import Broker
from broker.events import Envelopes, Messages, Topics
from broker.leases import LeaseBook
from broker.model import FailoverReason, PoolKey
from broker.store import OutboxRow, StateStore
from policies.model import Policy


class Sink:
    """Collects what the broker hands to the bus."""

    def __init__(self) -> None:
        self.rows: list[OutboxRow] = []

    def __call__(self, rows: Sequence[OutboxRow]) -> None:
        self.rows.extend(rows)


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[Any]:
    clock = Clock()
    store = StateStore(tmp_path / "state.db")
    await store.open()
    pool = pool_of([offer("us-east-1a", price=20.0, capacity=1),
                    offer("us-east-1b", price=30.0, capacity=1)],
                   clock=clock, stale_after_seconds=300)
    sink = Sink()
    broker = Broker(pool=pool, book=LeaseBook(), store=store,
                    messages=Messages(Topics("p"), Envelopes("t", "boot", clock=clock)),
                    policy=Policy(), publish=sink, retry_after_seconds=60, clock=clock)
    yield broker, clock, sink
    await store.close()


async def test_leases_on_a_stale_cloud_region_are_flagged_unhealthy(setup: Any) -> None:
    broker, clock, _ = setup
    lease = broker.book.create(request(), _placement(broker.pool.by_gpu("H100-80GB")[0]),
                               lease_seconds=3600, cap=None, now=clock())
    assert broker.check_health() == []
    clock.advance(301)  # no good poll of the slice for longer than stale_after
    [trigger] = broker.check_health()
    assert trigger.lease_id == lease.lease_id
    assert trigger.reason is FailoverReason.CLOUD_UNHEALTHY
    assert "no good poll" in trigger.detail
    broker.pool.replace(SLICE, list(broker.pool))  # the region recovers
    assert broker.check_health() == []


def _placement(o: Any) -> Any:
    from broker.model import Placement

    return Placement.of(o, 1)


async def test_a_discretionary_move_with_nowhere_to_go_leaves_the_lease(setup: Any) -> None:
    from broker import failover

    broker, clock, sink = setup
    only = broker.pool.by_gpu("H100-80GB")
    lease = broker.book.create(request(), _placement(only[0]), lease_seconds=3600, cap=None,
                               now=clock())
    broker.pool.hold(lease.placement.pool, 1)
    # Move it away on a policy change while the only other pool is excluded by capacity.
    other: PoolKey = only[1].pool
    broker.pool.hold(other, 1)  # no free capacity left anywhere else
    await broker._fail_over(failover.Trigger(lease.lease_id, 1,
                                             FailoverReason.POLICY_CHANGED, "test"))
    kept = broker.book.get(lease.lease_id)
    assert kept is not None and kept.state.value == "active" and kept.epoch == 1
    assert broker.pool.held(lease.placement.pool) == 1
    assert sink.rows == []
    # The same with a loss of capacity fails the lease.
    await broker._fail_over(failover.Trigger(lease.lease_id, 1,
                                             FailoverReason.CAPACITY_LOST, "gone"))
    failed = broker.book.get(lease.lease_id)
    assert failed is not None and failed.state.value == "failed"
    assert any(r.topic == "p/events/sched-a/lease.failed" for r in sink.rows)


def _place_cmd(request_id: str, **fields: Any) -> Any:
    import json

    from broker.core import Command

    body = {"request_id": request_id, "gpu": ["H100-80GB"], "gpus": 8, **fields}
    return Command("sched-a", "place", json.dumps(body).encode(), "p/requests/sched-a/place")


def _decisions(broker: Broker) -> dict[str, str | None]:
    """request_id -> the zone its lease is in (None: no lease)."""
    out: dict[str, str | None] = {}
    for rid in ("r1", "r2"):
        lease = broker.book.find("sched-a", rid)
        out[rid] = lease.placement.pool.zone if lease else None
    return out


async def test_a_batch_gives_the_contested_pool_to_the_request_that_needs_it(
        setup: Any) -> None:
    # r1 could take either pool; r2's cap ($3/GPU-h) admits only us-east-1a ($2.50).
    # One at a time in arrival order, r1 would take us-east-1a and r2 would be refused.
    broker, _, _ = setup
    observed: list[Any] = []
    broker.batch_observers.append(observed.append)
    await broker.handle([_place_cmd("r1"), _place_cmd("r2", max_price_per_gpu_hour=3.0)])
    assert _decisions(broker) == {"r1": "us-east-1b", "r2": "us-east-1a"}
    [result] = observed
    assert len(result.outcomes) == 2 and result.optimal


async def test_requests_queued_together_are_placed_as_one_batch(setup: Any) -> None:
    import asyncio

    broker, _, _ = setup
    observed: list[Any] = []
    broker.batch_observers.append(observed.append)
    await broker.submit(_place_cmd("r1"))
    await broker.submit(_place_cmd("r2", max_price_per_gpu_hour=3.0))
    ready = asyncio.Event()
    ready.set()
    task = asyncio.create_task(broker.run_requests(ready))
    try:
        async with asyncio.timeout(10):
            await broker.idle()
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert [len(r.outcomes) for r in observed] == [2]
    assert _decisions(broker) == {"r1": "us-east-1b", "r2": "us-east-1a"}
