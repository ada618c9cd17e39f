"""Re-optimisation of running leases (`failover.reoptimize_min_saving`) through the
broker: a real pool, lease book and SQLite store, as in test_core.py."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from factories import SLICE, Clock, Sink, offer, pool_of, request

from broker.leasing.authority import Broker
from broker.leasing.book import LeaseBook
from broker.model import FailoverReason, Lease, LeaseState, Offer, Placement
from broker.state.store import StateStore
from broker.wire.messages import Envelopes, Messages, Topics
from policies.model import Failover, Policy

LEASED = offer("us-east-1a", price=30.0)



@dataclass
class Setup:
    broker: Broker
    clock: Clock
    sink: Sink
    store: StateStore
    lease: Lease


Make = Callable[[float, Failover], Awaitable[Setup]]


@pytest.fixture
async def make(tmp_path: Path) -> AsyncIterator[Make]:
    """`await make(other_price, Failover(...))`: a broker with one lease on
    LEASED ($30/h) and one other pool at `other_price`."""
    stores: list[StateStore] = []

    async def build(other_price: float, failover: Failover) -> Setup:
        clock = Clock()
        store = StateStore(tmp_path / f"state{len(stores)}.db")
        await store.open()
        stores.append(store)
        pool = pool_of([LEASED, offer("us-east-1b", price=other_price)], clock=clock)
        sink = Sink()
        broker = Broker(pool=pool, book=LeaseBook(), store=store,
                        messages=Messages(Topics("p"), Envelopes("t", "boot", clock=clock)),
                        policy=Policy(failover=failover), publish=sink,
                        retry_after_seconds=60, clock=clock)
        lease = broker.book.create(request(), Placement.of(LEASED, 1), lease_seconds=3600,
                                   cap=None, now=clock())
        pool.hold(LEASED.pool, 1)
        return Setup(broker, clock, sink, store, lease)

    yield build
    for store in stores:
        await store.close()


def reprice(s: Setup, other_price: float) -> Offer:
    """A new poll: the other pool's price changes."""
    other = offer("us-east-1b", price=other_price)
    s.broker.pool.replace(SLICE, [LEASED, other])
    return other


async def test_a_saving_under_the_threshold_leaves_the_lease(make: Make) -> None:
    s = await make(24.0, Failover(reoptimize_min_saving=0.3))
    # $24 instead of $30 saves 20 %, under 30 %.
    assert s.broker.check_reoptimize() == []
    kept = s.broker.book.get(s.lease.lease_id)
    assert kept is not None and kept.epoch == 1 and kept.placement.pool == LEASED.pool
    assert s.sink.rows == []
    assert s.broker.pool.held(LEASED.pool) == 1


async def test_a_saving_over_the_threshold_moves_the_lease(make: Make) -> None:
    s = await make(18.0, Failover(reoptimize_min_saving=0.3))
    # $18 instead of $30 saves 40 %.
    [trigger] = s.broker.check_reoptimize()
    assert (trigger.lease_id, trigger.epoch, trigger.reason) == \
        (s.lease.lease_id, 1, FailoverReason.REOPTIMIZED)
    assert "40%" in trigger.detail and "reoptimize_min_saving 30%" in trigger.detail
    await s.broker._fail_over(trigger)
    moved = s.broker.book.get(s.lease.lease_id)
    assert moved is not None and moved.state is LeaseState.ACTIVE
    assert moved.epoch == 2
    assert moved.placement.pool.zone == "us-east-1b"
    assert moved.placement.price_per_hour == 18.0
    [event] = s.sink.events("lease.failover")
    assert event["reason"] == "reoptimized" and event["epoch"] == 2
    assert event["from"]["zone"] == "us-east-1a"  # type: ignore[index]
    assert event["to"]["zone"] == "us-east-1b"  # type: ignore[index]
    # The holds moved with it, and the store has the new epoch.
    assert s.broker.pool.held(LEASED.pool) == 0
    assert s.broker.pool.held(moved.placement.pool) == 1
    [stored] = await s.store.leases()
    assert (stored.epoch, stored.placement) == (2, moved.placement)
    # Once moved, nothing cheaper is left: no second move.
    assert s.broker.check_reoptimize() == []


async def test_without_a_threshold_running_leases_never_move(make: Make) -> None:
    s = await make(3.0, Failover())
    assert s.broker.check_reoptimize() == []  # 90 % cheaper, but re-optimisation is off


async def test_the_saving_is_checked_again_when_the_move_is_made(make: Make) -> None:
    s = await make(18.0, Failover(reoptimize_min_saving=0.3))
    [trigger] = s.broker.check_reoptimize()
    reprice(s, 27.0)  # before the move is handled the saving shrinks to 10 %
    await s.broker._fail_over(trigger)
    kept = s.broker.book.get(s.lease.lease_id)
    assert kept is not None and kept.epoch == 1 and kept.placement.pool == LEASED.pool
    assert s.sink.rows == []
    assert s.broker.pool.held(LEASED.pool) == 1
    assert s.broker.pool.held(offer("us-east-1b").pool) == 0


async def test_the_anti_flap_limits_hold_a_reoptimisation_back(make: Make) -> None:
    s = await make(18.0, Failover(reoptimize_min_saving=0.3,
                                         min_lease_age_seconds=600))
    [trigger] = s.broker.check_reoptimize()
    await s.broker._fail_over(trigger)
    young = s.broker.book.get(s.lease.lease_id)
    assert young is not None and young.epoch == 1  # ten minutes old at the least
    assert s.sink.rows == []
    s.clock.advance(600)
    s.broker.pool.replace(SLICE, list(s.broker.pool))  # a fresh poll, same prices
    [trigger] = s.broker.check_reoptimize()
    await s.broker._fail_over(trigger)
    moved = s.broker.book.get(s.lease.lease_id)
    assert moved is not None and moved.epoch == 2
    assert len(s.sink.events("lease.failover")) == 1
