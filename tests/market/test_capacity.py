"""The capacity summaries of `P/capacity/<cloud>/<region>/<gpu>` (docs/contract.md §3.5):
paid-for capacity (market `reserved`) is counted apart from on-demand."""

from __future__ import annotations

from contract_check import problem
from factories import T0, Clock, offer, owned, pool_of

from broker.market import capacity
from broker.model import Market


def test_paid_for_capacity_is_not_counted_as_on_demand() -> None:
    """A private server at $0 next to on-demand instances: the on-demand price stays the
    on-demand offer's, and the paid-for GPUs are counted in `reserved` fields of their
    own (they are part of `free_*` too, which sums every market)."""
    offers = [offer("fra1-a", cloud="private", region="fra1", market=Market.ON_DEMAND,
                    price=16.0, capacity=3),
              owned("fra1-a", servers=2),  # 2 servers of 8 GPUs at $0, both free
              offer("fra1-a", cloud="private", region="fra1", market=Market.SPOT,
                    instance_type="spot-x", price=8.0, capacity=None)]
    pool = pool_of(offers, clock=Clock())
    (summary,) = capacity.summaries(offers, pool, T0).values()
    assert summary["cheapest_on_demand_per_gpu_hour"] == 2.0
    assert summary["cheapest_spot_per_gpu_hour"] == 1.0
    assert summary["cheapest_reserved_per_gpu_hour"] == 0.0
    assert summary["reserved_gpus"] == 16
    assert (summary["free_reserved_instances"], summary["free_reserved_gpus"]) == (2, 16)
    assert (summary["free_instances"], summary["free_gpus"]) == (5, 40)
    assert summary["pools"] == 3
    assert problem("capacity", summary) is None


def test_a_slice_without_paid_for_capacity_says_so() -> None:
    offers = [offer(price=24.0, capacity=2)]
    (summary,) = capacity.summaries(offers, pool_of(offers, clock=Clock()), T0).values()
    assert summary["cheapest_reserved_per_gpu_hour"] is None
    assert summary["reserved_gpus"] == 0
    assert summary["free_reserved_instances"] is None
    assert summary["free_reserved_gpus"] is None
    assert summary["free_gpus"] == 16
    assert problem("capacity", summary) is None
