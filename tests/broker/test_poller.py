"""The poller owns the pool's data: whatever an adapter raises is a failed poll of that
slice, never the end of the daemon."""

from __future__ import annotations

from collections.abc import Sequence

from factories import offer

from adapters.base import CloudAdapter
from adapters.errors import CloudUnavailable
from broker.model import Offer
from broker.poller import Poller
from broker.pool import ResourcePool


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
