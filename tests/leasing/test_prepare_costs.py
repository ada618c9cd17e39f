"""The authority makes placement's cost lists ahead of the batches, and places a poll's
changes in them (`Placing.prepare_costs`, `CostIndex.prepare`): a step at a time, the
event loop free between two, while a batch is decided in a worker thread too (on lists
the index lent it, which it copies before it changes them); and for the policy in
force."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
from pathlib import Path
from typing import Any

from factories import Clock, Sink, offer, pool_of

from broker.leasing import placing
from broker.leasing.authority import Broker
from broker.leasing.book import LeaseBook
from broker.market.hazard import HazardEstimator
from broker.model import Market
from broker.state.store import StateStore
from broker.wire.commands import Command
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


def _two_models(tmp_path: Path) -> tuple[Broker, StateStore]:
    clock = Clock()
    store = StateStore(tmp_path / "state.db")
    offers = [offer(f"us-east-1{z}", instance_type=f"{kind}.{i}", gpu=gpu, market=m,
                    price=10.0 + i, capacity=4)
              for z in "ab" for i in range(2) for m in ("spot", "on_demand")
              for kind, gpu in (("p5", "H100-80GB"), ("g6", "L4"))]
    pool = pool_of(offers, clock=clock, stale_after_seconds=300)
    pool.hazard = HazardEstimator()
    b = Broker(pool=pool, book=LeaseBook(), store=store,
               messages=Messages(Topics("p"), Envelopes("t", "boot", clock=clock)),
               policy=Policy(), publish=Sink(), retry_after_seconds=60, clock=clock)
    return b, store


def _in_a_thread(tmp_path: Path, monkeypatch: Any) -> tuple[Broker, StateStore]:
    """`_two_models`, where a batch of two is large enough for a worker thread (and goes
    to no MILP)."""
    monkeypatch.setattr(placing, "THREAD_MIN_BATCH", 2)
    b, store = _two_models(tmp_path)
    b.settings = dataclasses.replace(b.settings, exact_max_batch=0)
    return b, store


def _place(request_id: str) -> Command:
    body = {"request_id": request_id, "gpu": ["H100-80GB"], "gpus": 8}
    return Command("sched-a", "place", json.dumps(body).encode(), "p/requests/sched-a/place")


async def test_after_a_refresh_a_batch_makes_only_the_lists_it_reads(
        tmp_path: Path, monkeypatch: Any) -> None:
    """A refresh of the hazard estimator drops every cost list. A batch that would go to
    the MILP in a worker thread (which freezes every list: all made at once, on the
    event loop, 300 ms at 50,000 offers) is decided by the heuristic instead, which
    makes only the lists it reads; the others are made a step at a time."""
    monkeypatch.setattr(placing, "FREEZE_MAKE_MAX", 0)  # these lists are short
    b, store = _two_models(tmp_path)
    await store.open()
    try:
        await b.prepare_costs()
        index = b._cost_index()
        every = set(index._lists)
        assert {w[0] for w in every} == {"H100-80GB", "L4"}
        assert b.pool.hazard is not None
        b.pool.hazard.refresh()
        assert index.unmade() > 0
        await b.handle([_place("r1"), _place("r2")])  # a batch the MILP would take
        assert all(b.book.find("sched-a", r) is not None for r in ("r1", "r2"))
        made = set(index._lists)
        assert made and made < every and {w[0] for w in made} == {"H100-80GB"}
        await b.prepare_costs()
        assert set(index._lists) == every and index.unmade() == 0
    finally:
        await store.close()


async def test_after_a_refresh_a_large_batch_waits_for_the_lists_made_a_step_at_a_time(
        tmp_path: Path, monkeypatch: Any) -> None:
    """A batch large enough for a worker thread needs every list frozen: it waits for them,
    made a step at a time, the event loop running between two."""
    monkeypatch.setattr(placing, "FREEZE_MAKE_MAX", 0)
    b, store = _in_a_thread(tmp_path, monkeypatch)
    await store.open()
    try:
        await b.prepare_costs()
        index = b._cost_index()
        every = set(index._lists)
        assert b.pool.hazard is not None
        b.pool.hazard.refresh()
        task = asyncio.create_task(b.handle([_place("r1"), _place("r2")]))
        seen: list[int] = []
        while not task.done():
            seen.append(len(index._lists))
            await asyncio.sleep(0)
        await task
        assert all(b.book.find("sched-a", r) is not None for r in ("r1", "r2"))
        assert set(index._lists) == every
        assert len({n for n in seen if 0 < n < len(every)}) >= 2  # made between turns
    finally:
        await store.close()


async def test_a_batch_in_a_worker_thread_returns_what_it_was_lent(
        tmp_path: Path, monkeypatch: Any) -> None:
    """Once a batch decided in a worker thread is done, the pool's lists and the cost
    lists it was lent are changed in place again, not copied at the next change (a copy
    of thousands of offers for every poll that lands after each such batch), whether it
    decided or failed."""
    b, store = _in_a_thread(tmp_path, monkeypatch)
    await store.open()
    try:
        await b.prepare_costs()
        index = b._cost_index()
        for r, fails in (("r1", False), ("r3", True)):
            if fails:
                def broken(*args: Any, **kwargs: Any) -> Any:
                    raise RuntimeError("a bug in the solver")
                monkeypatch.setattr(placing, "_solve_timed", broken)
            await b.handle([_place(r), _place(r + "b")])
            assert (b.book.find("sched-a", r) is None) is fails
            by_gpu = b.pool.by_gpu("H100-80GB", Market.SPOT)
            costs = index.sorted("H100-80GB", Market.SPOT)
            spot = [o for o in b.pool if o.pool.market is Market.SPOT]
            b.pool.replace(("aws", "us-east-1"), [
                dataclasses.replace(o, price_per_hour=o.price_per_hour / 2)
                if o.pool.market is Market.SPOT else o for o in b.pool])
            await b.prepare_costs()
            assert b.pool.by_gpu("H100-80GB", Market.SPOT) is by_gpu
            assert index.sorted("H100-80GB", Market.SPOT) is costs
            assert {o.price_per_hour for o in by_gpu} == \
                {o.price_per_hour / 2 for o in spot if o.gpu == "H100-80GB"}
    finally:
        await store.close()


async def test_what_a_thread_was_lent_is_returned_when_it_ends_even_if_its_wait_was_cancelled(
        ) -> None:
    """Cancelling the wait does not stop the thread: what it reads stays lent until it
    ends, and is returned then; a thread that ends normally has returned its loans by
    the time its result is awaited."""
    returned: list[str] = []
    back = asyncio.Event()

    class Loan:
        def return_loan(self) -> None:
            returned.append("returned")
            back.set()

    started, go = threading.Event(), threading.Event()

    def read() -> bool:
        started.set()
        return go.wait(5)

    task = asyncio.create_task(placing.on_loan([Loan()], read))
    assert await asyncio.to_thread(started.wait, 5)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert returned == []  # the thread still reads
    go.set()
    await asyncio.wait_for(back.wait(), 5)
    assert returned == ["returned"]
    returned.clear()
    assert await placing.on_loan([Loan(), Loan()], go.wait, 5) is True
    assert returned == ["returned", "returned"]
