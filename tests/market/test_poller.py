"""The poller owns the pool's data: whatever an adapter raises is a failed poll of that
slice, never the end of the daemon."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from factories import offer

from adapters.base import CloudAdapter
from adapters.errors import CloudUnavailable
from broker.market.poller import Poller
from broker.market.pool import ResourcePool
from broker.model import Offer


class _Garbled(CloudAdapter):
    """A cloud whose answer for one region the adapter did not expect (its parser
    raises a KeyError, as on a field missing from a reply)."""

    name = "aws"

    def regions(self) -> Sequence[str]:
        return ["us-east-1", "us-west-2"]

    async def poll(self, region: str) -> list[Offer]:
        if region == "us-west-2":
            raise KeyError("SpotPriceHistory")
        return [offer()]


async def test_an_unexpected_error_is_a_failed_poll_of_that_slice_only() -> None:
    pool = ResourcePool(stale_after_seconds=300)
    poller = Poller(pool, [_Garbled()], interval_seconds=60, timeout_seconds=5)
    results = {r.slice: r for r in await poller.poll_all()}
    assert results[("aws", "us-east-1")].error is None
    bad = results[("aws", "us-west-2")]
    assert isinstance(bad.error, CloudUnavailable)
    assert "KeyError" in str(bad.error)
    assert poller.first_round.is_set()
    health = {h.slice: h for h in pool.health()}
    assert health[("aws", "us-east-1")].ok and not health[("aws", "us-west-2")].ok
    assert len(pool) == 1


class _Counting(CloudAdapter):
    """Two regions; each poll is counted, and told (an event) as it happens."""

    name = "aws"

    def __init__(self) -> None:
        import asyncio

        self.polled: list[str] = []
        self.event = asyncio.Event()

    def regions(self) -> Sequence[str]:
        return ["us-east-1", "us-west-2"]

    async def poll(self, region: str) -> list[Offer]:
        self.polled.append(region)
        self.event.set()
        return [offer(region=region, zone=f"{region}a")]


async def test_slices_taken_over_are_polled_on_their_schedule_not_at_once() -> None:
    """A new leader that took over its predecessor's fresh polls places at once and
    polls those slices when they are due, not in its first second (no doubled API calls,
    no CPU spent on what it has); a slice not taken over is polled at once."""
    import asyncio

    adapter = _Counting()
    pool = ResourcePool(stale_after_seconds=300)
    poller = Poller(pool, [adapter], interval_seconds=60, timeout_seconds=5)
    poller.warmed({("aws", "us-east-1"): 10.0})  # polled 10 s ago: due in 50 s
    assert not poller.first_round.is_set()  # us-west-2 is still to come
    task = asyncio.create_task(poller.run())
    try:
        async with asyncio.timeout(5):
            await poller.first_round.wait()
        # Both slices' tasks started together: a poll of us-east-1 at once would be in.
        assert adapter.polled == ["us-west-2"]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    poller2 = Poller(pool, [adapter], interval_seconds=60, timeout_seconds=5)
    poller2.warmed({("aws", "us-east-1"): 10.0, ("aws", "us-west-2"): 70.0})
    assert poller2.first_round.is_set()  # both taken over: placement starts at once


class _Regions(CloudAdapter):
    """`n` regions whose polls all answer at once, at the price it is set to."""

    name = "aws"

    def __init__(self, n: int) -> None:
        self.n = n
        self.price = 24.0

    def regions(self) -> Sequence[str]:
        return [f"r{i}" for i in range(self.n)]

    async def poll(self, region: str) -> list[Offer]:
        return [offer(region=region, zone=f"{region}a", price=self.price)]


async def test_slices_polled_together_go_into_the_pool_one_at_a_time() -> None:
    """A round's replies come together; each slice goes into the pool after a turn of the
    event loop of its own, so the rest of the daemon (requests' batches) runs between
    two rather than after the whole round."""
    import asyncio

    pool = ResourcePool(stale_after_seconds=300)
    poller = Poller(pool, [_Regions(6)], interval_seconds=60, timeout_seconds=5)
    seen: list[int] = []
    task = asyncio.create_task(poller.poll_all())
    while not task.done():
        seen.append(len(pool))
        await asyncio.sleep(0)
    await task
    assert len(pool) == 6
    assert set(range(1, 6)) <= set(seen)  # each count seen between two slices


async def test_after_the_first_round_a_slice_waits_for_its_turn_for_a_while_only(
        monkeypatch: Any) -> None:
    """The daemon's turn is an idle broker: the requests come first. The first round goes
    in at once (the requests wait for it); a broker that stays busy holds a slice back
    for at most `APPLY_WAIT_SECONDS`."""
    import asyncio

    from broker.market import poller as polling

    adapter = _Regions(2)
    free = asyncio.Event()
    turns: list[str] = []

    async def turn() -> None:
        turns.append("asked")
        await free.wait()

    pool = ResourcePool(stale_after_seconds=300)
    poller = Poller(pool, [adapter], interval_seconds=60, timeout_seconds=5, turn=turn)
    monkeypatch.setattr(polling, "APPLY_WAIT_SECONDS", 30.0)
    async with asyncio.timeout(5):  # the first round does not wait for the turn
        await poller.poll_all()
    assert poller.first_round.is_set() and turns == [] and len(pool) == 2

    adapter.price = 12.0
    task = asyncio.create_task(poller.poll_once(adapter, "r0"))
    for _ in range(20):
        await asyncio.sleep(0)
    assert turns == ["asked"] and not task.done()
    assert {o.price_per_hour for o in pool} == {24.0}  # not in the pool before its turn
    free.set()
    async with asyncio.timeout(5):
        await task
    assert sorted(o.price_per_hour for o in pool) == [12.0, 24.0]

    free.clear()
    monkeypatch.setattr(polling, "APPLY_WAIT_SECONDS", 0.01)  # never idle: in anyway
    adapter.price = 6.0
    async with asyncio.timeout(5):
        result = await poller.poll_once(adapter, "r1")
    assert result.error is None and len(turns) == 2
    assert sorted(o.price_per_hour for o in pool) == [6.0, 12.0]
