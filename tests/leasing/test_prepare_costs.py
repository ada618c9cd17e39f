"""The authority makes placement's cost lists ahead of the batches
(`Placing.prepare_costs`, `CostIndex.prepare`): one at a time, under its lock, so never
while a batch is being decided; and for the policy in force."""

from __future__ import annotations

import asyncio
from pathlib import Path

from factories import Clock, Sink, offer, pool_of

from broker.leasing.authority import Broker
from broker.leasing.book import LeaseBook
from broker.model import Market
from broker.state.store import StateStore
from broker.wire.messages import Envelopes, Messages, Topics
from policies.model import Policy


async def test_cost_lists_are_made_ahead_between_batches_only(tmp_path: Path) -> None:
    clock = Clock()
    store = StateStore(tmp_path / "state.db")
    await store.open()
    offers = [offer(f"us-east-1{z}", instance_type=f"p5.{i}", market=m, price=10.0 + i,
                    capacity=2) for z in "ab" for i in range(2) for m in ("spot", "on_demand")]
    pool = pool_of(offers, clock=clock, stale_after_seconds=300)
    b = Broker(pool=pool, book=LeaseBook(), store=store,
               messages=Messages(Topics("p"), Envelopes("t", "boot", clock=clock)),
               policy=Policy(), publish=Sink(), retry_after_seconds=60, clock=clock)
    try:
        lists = 2 * len(pool.gpus()) * len(Market)  # by cost (default horizon), by price
        async with b._lock:  # as a batch decided in a worker thread holds it
            task = asyncio.create_task(b.prepare_costs())
            done, _ = await asyncio.wait({task}, timeout=0.2)
            assert not done  # waits for the batch
        # then the pool's lists by GPU of both markets, which a batch's `Snapshot` lends
        assert await asyncio.wait_for(task, 5) == lists + len(pool.gpus())
        assert await b.prepare_costs() == 0  # all made
        # A new policy: a new index, whose lists are made again (the pool keeps its own).
        b.policy = Policy()
        assert await b.prepare_costs() == lists
    finally:
        await store.close()


async def test_the_event_loop_runs_between_two_steps(tmp_path: Path) -> None:
    """Each step takes the broker's lock and gives it back, then lets the rest of the
    event loop run: a lock no one holds is taken without a pause, and the steps once ran
    in one go (a second or more after a poll round of 50,000 offers)."""
    store = StateStore(tmp_path / "state.db")
    await store.open()
    offers = [offer(f"us-east-1{z}", instance_type=f"p5.{i}", market=m, price=10.0 + i,
                    capacity=2) for z in "ab" for i in range(3) for m in ("spot", "on_demand")]
    clock = Clock()
    pool = pool_of(offers, clock=clock, stale_after_seconds=300)
    b = Broker(pool=pool, book=LeaseBook(), store=store,
               messages=Messages(Topics("p"), Envelopes("t", "boot", clock=clock)),
               policy=Policy(), publish=Sink(), retry_after_seconds=60, clock=clock)
    try:
        index = b._cost_index()
        task = asyncio.create_task(b.prepare_costs())
        seen: list[int] = []
        while not task.done():  # runs whenever the steps let it
            seen.append(len(index._lists))
            await asyncio.sleep(0)
        made = await task
        assert made > 2
        assert len({n for n in seen if 0 < n < len(index._lists)}) >= 2  # between steps
    finally:
        await store.close()
