"""The authority makes placement's cost lists ahead of the batches, and places a poll's
changes in them (`Placing.prepare_costs`, `CostIndex.prepare`): a step at a time, the
event loop free between two, while a batch is decided in a worker thread too (on lists
the index lent it, which it copies before it changes them); and for the policy in
force."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from factories import Clock, Sink, offer, pool_of

from broker.leasing.authority import Broker
from broker.leasing.book import LeaseBook
from broker.model import Market
from broker.state.store import StateStore
from broker.wire.messages import Envelopes, Messages, Topics
from policies.model import Policy


async def test_cost_lists_are_made_ahead_while_a_batch_is_decided_and_what_it_was_lent_stays(
        tmp_path: Path) -> None:
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
        # then the pool's lists by GPU of both markets, which a batch's `Snapshot` lends
        assert await asyncio.wait_for(b.prepare_costs(), 5) == lists + len(pool.gpus())
        assert await b.prepare_costs() == 0  # all made
        index = b._cost_index()
        async with b._lock:  # as a batch decided in a worker thread holds it
            lent = index.frozen()
            gpu = offers[0].gpu
            was = {m: list(lent.sorted(gpu, m)) for m in Market}
            # A poll halves every spot price; the lists follow it at once.
            pool.replace(("aws", "us-east-1"), [
                dataclasses.replace(o, price_per_hour=o.price_per_hour / 2)
                if o.pool.market is Market.SPOT else o for o in offers])
            assert index._dirty
            await asyncio.wait_for(b.prepare_costs(), 5)
            assert not index._dirty
            assert {m: list(lent.sorted(gpu, m)) for m in Market} == was  # lent: as it was
            now = index.frozen().sorted(gpu, Market.SPOT)
            assert [e[2].price_per_hour for e in now] == \
                sorted(e[2].price_per_hour / 2 for e in was[Market.SPOT])
        # A new policy: a new index, whose lists are made again (the pool keeps its own).
        b.policy = Policy()
        assert await b.prepare_costs() == lists
    finally:
        await store.close()


async def test_the_event_loop_runs_between_two_steps(tmp_path: Path) -> None:
    """Each step lets the rest of the event loop run: the steps once ran in one go (a
    second or more after a poll round of 50,000 offers)."""
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
