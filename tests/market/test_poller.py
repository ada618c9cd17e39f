"""The poller owns the pool's data: whatever an adapter raises is a failed poll of that
slice, never the end of the daemon."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

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
