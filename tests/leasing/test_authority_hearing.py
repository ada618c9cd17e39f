"""No lease expires while the daemon cannot hear its schedulers; when it hears again,
the leases it could not hear get the reconnect grace (contract 1.1 §3.2, #29)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from factories import Clock, Sink, offer, placement, pool_of, request

from broker.leasing.authority import Broker
from broker.leasing.book import LeaseBook
from broker.model import LeaseState
from broker.state.store import StateStore
from broker.wire.messages import Envelopes, Messages, Topics
from policies.model import Policy

GRACE = 60


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[Any]:
    clock = Clock()
    store = StateStore(tmp_path / "state.db")
    await store.open()
    sink = Sink()
    broker = Broker(pool=pool_of([offer(capacity=4)], clock=clock), book=LeaseBook(),
                    store=store, messages=Messages(Topics("p"), Envelopes("t", "boot",
                                                                          clock=clock)),
                    policy=Policy(), publish=sink, retry_after_seconds=60, clock=clock,
                    reconnect_grace_seconds=GRACE)
    yield broker, clock, sink, store
    await store.close()


def _leases(broker: Broker, clock: Clock, *ttls: int) -> list[Any]:
    made = [broker.book.create(request(f"r{i}"), placement(), lease_seconds=ttl, cap=None,
                               now=clock()) for i, ttl in enumerate(ttls)]
    broker.restore(made)  # as loaded at start
    return made


async def test_no_lease_expires_while_deaf_and_hearing_again_gives_the_grace(
        setup: Any) -> None:
    broker, clock, sink, store = setup
    short, soon, far = _leases(broker, clock, 10, 70, 3600)
    broker.deaf()
    clock.advance(30)  # `short` is overdue, unheard
    assert await broker.expire_due() == []
    assert broker.book.get(short.lease_id).state is LeaseState.ACTIVE

    heard_at = clock()
    assert await broker.heard() == 2  # `short` and `soon` expire before now + grace
    until = heard_at + timedelta(seconds=GRACE)
    assert broker.book.get(short.lease_id).expires_at == until
    assert broker.book.get(soon.lease_id).expires_at == until
    assert broker.book.get(far.lease_id).expires_at == far.expires_at  # never shortened
    # Committed like any lease change, with the retained states that say so.
    [stored] = [le for le in await store.leases() if le.lease_id == short.lease_id]
    assert stored.expires_at == until
    states = {r.topic.rsplit("/", 1)[1]: json.loads(r.payload) for r in sink.rows if r.retain}
    assert set(states) == {short.lease_id, soon.lease_id}
    assert states[short.lease_id]["expires_at"] == until.isoformat(
        timespec="milliseconds").replace("+00:00", "Z")
    assert not [r for r in sink.rows if not r.retain]  # no event: nothing happened to S

    clock.advance(GRACE - 1)
    assert await broker.expire_due() == []
    clock.advance(1)
    assert {le.lease_id for le in await broker.expire_due()} == {short.lease_id,
                                                                  soon.lease_id}


async def test_the_expiry_loop_waits_while_deaf(setup: Any) -> None:
    """The loop itself, not only `expire_due`: deaf, a due lease stays active; heard,
    it gets the grace and expires when that has passed."""
    broker, clock, sink, _ = setup
    [lease] = _leases(broker, clock, 5)
    broker.deaf()
    clock.advance(10)
    expiry = asyncio.create_task(broker.run_expiry())
    try:
        await asyncio.wait({expiry}, timeout=0.2)  # a negative check: nothing may happen
        assert broker.book.get(lease.lease_id).state is LeaseState.ACTIVE
        await broker.heard()
        sink.arrived.clear()
        clock.advance(GRACE)
        broker._expiry_changed.set()  # the clock is the test's: wake the loop
        async with asyncio.timeout(5):
            await sink.arrived.wait()  # the expiry's commit
        assert broker.book.get(lease.lease_id).state is LeaseState.EXPIRED
    finally:
        expiry.cancel()
        await asyncio.gather(expiry, return_exceptions=True)


async def test_no_grace_extends_nothing(tmp_path: Path) -> None:
    clock = Clock()
    store = StateStore(tmp_path / "state.db")
    await store.open()
    try:
        broker = Broker(pool=pool_of([offer(capacity=4)], clock=clock), book=LeaseBook(),
                        store=store, messages=Messages(Topics("p"), Envelopes("t", "b")),
                        policy=Policy(), publish=Sink(), retry_after_seconds=60,
                        clock=clock, reconnect_grace_seconds=0)
        [lease] = _leases(broker, clock, 5)
        broker.deaf()
        clock.advance(10)
        assert await broker.heard() == 0
        assert [le.lease_id for le in await broker.expire_due()] == [lease.lease_id]
    finally:
        await store.close()
