"""The walk (`broker.placement.walk`) passes over offers with no room (`rules.no_room`)
without judging them: on random pools with some of their offers held, it lists the same
options, in the same order, up to the same cost, as a walk that judges every offer, and a
request left without any option is told the same reason. Offers that fill up, are
released or are polled again are seen as they are now, through the lists a `Snapshot`
and `CostIndex.frozen` share with the pool."""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import replace

from factories import SLICE, T0, offer, pool_of, request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.market.hazard import DEFAULT_HORIZON
from broker.market.pool import ResourcePool
from broker.model import Market, Offer, PoolKey, RejectCode
from broker.placement import rules
from broker.placement.candidates import CandidateBuilder
from broker.placement.optimizer import Ask, Decision, Rejection, solve
from broker.placement.rules import Probe
from broker.placement.view import CostIndex, Costs, PoolView, Snapshot
from broker.placement.walk import walk
from policies.evaluate import Constraints, evaluate
from policies.model import Policy, Scoring

# As in test_rules.py: hypothesis imports this (and libcst, which warns) only on a failure.
with contextlib.suppress(ImportError), warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import hypothesis.extra._patching  # noqa: F401

GPU = "H100-80GB"
ZONES = (("aws", "us-east-1", "us-east-1a"), ("aws", "us-east-1", "us-east-1b"),
         ("aws", "us-west-2", "us-west-2a"))
FAST = settings(max_examples=200, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def pools(draw: st.DrawFn) -> tuple[ResourcePool, list[Offer]]:
    """Offers of one model, most with a small capacity, many of them held full or in
    part."""
    out: list[Offer] = []
    for i in range(draw(st.integers(1, 14))):
        cloud, region, zone = draw(st.sampled_from(ZONES))
        gpus = draw(st.sampled_from((1, 2, 4, 8)))
        out.append(offer(zone, cloud=cloud, region=region, instance_type=f"t{i}.{gpus}x",
                         market=draw(st.sampled_from((Market.SPOT, Market.ON_DEMAND))),
                         gpus=gpus, price=round(gpus * draw(st.floats(0.5, 4.0)), 4) + i * 1e-3,
                         capacity=draw(st.none() | st.integers(0, 4)),
                         interruption_rate=draw(st.none() | st.floats(0.0, 0.2)),
                         quota_headroom=draw(st.none() | st.integers(0, 40))))
    pool = pool_of(out)
    for o in out:
        if o.capacity and draw(st.booleans()):
            pool.hold(o.pool, draw(st.integers(1, o.capacity)))
    return pool, out


def constraints(data: st.DataObject) -> Constraints:
    draw = data.draw
    allowed = draw(st.sets(st.sampled_from((Market.SPOT, Market.ON_DEMAND)), min_size=1))
    return Constraints(
        gpus=(GPU,), markets=tuple(m for m in (Market.SPOT, Market.ON_DEMAND) if m in allowed),
        cap=draw(st.none() | st.floats(0.5, 4.0)),
        deny_regions=draw(st.sampled_from((frozenset(), frozenset({"us-west-2"})))))


def builder(pool: ResourcePool, policy: Policy, indexed_costs: bool) -> CandidateBuilder:
    view: PoolView = pool
    costs: Costs | None = None
    if indexed_costs:
        view = Snapshot(pool, T0)
        costs = CostIndex(pool, policy).frozen()
    return CandidateBuilder(view, policy, T0, 8, costs=costs)


@FAST
@given(pools(), st.data(), st.sampled_from((1, 2, 3, 8, 12)), st.booleans(),
       st.sampled_from((None, 1, 2, 5)), st.sampled_from((None, 3.0, 12.0)),
       st.sampled_from((0.0, 0.5)))
def test_the_walk_lists_the_same_options_whether_it_skips_offers_with_no_room(
        world: tuple[ResourcePool, list[Offer]], data: st.DataObject, need: int,
        indexed_costs: bool, k: int | None, limit: float | None, idle: float) -> None:
    pool, _ = world
    c = constraints(data)
    policy = Policy(scoring=Scoring(idle_gpu_weight=idle))
    if k is None and limit is None:
        limit = math.inf
    if k is not None:
        limit = None
    b = builder(pool, policy, indexed_costs)
    p = Probe(request("r1", GPU, need), c, b.view, policy)
    fast = walk(b, p, k, limit, None, DEFAULT_HORIZON)
    plain = walk(b, p, k, limit, None, DEFAULT_HORIZON, skip=False)
    assert [(o.ref[0].pool, o.ref[1]) for o in fast[0]] == \
        [(o.ref[0].pool, o.ref[1]) for o in plain[0]]
    assert fast[1] == plain[1]
    if not plain[0]:
        assert fast[2] == plain[2]  # what a rejection names


@FAST
@given(pools(), st.data(), st.sampled_from((1, 2, 3, 8, 12)))
def test_no_room_is_only_said_of_offers_the_capacity_rule_rejects(
        world: tuple[ResourcePool, list[Offer]], data: st.DataObject, need: int) -> None:
    pool, offers = world
    taken = data.draw(st.dictionaries(st.sampled_from([o.pool for o in offers]),
                                      st.integers(0, 3)))
    for view in (pool, Snapshot(pool, T0)):
        for p in (Probe(request("r1", GPU, need), constraints(data), view, Policy()),
                  Probe(request("r1", GPU, need), constraints(data), view, Policy(),
                        taken=taken)):
            for o in offers:
                n = rules.instances_for(need, o.gpus)
                if rules.no_room(o, view.held(o.pool), need):
                    assert not rules.CAPACITY.check(p, o, n)
                elif not taken:
                    assert rules.CAPACITY.check(p, o, n)  # the rule itself, on the view


# --- through the daemon's path: a Snapshot and the cost index, batch after batch ---------

CHEAP = offer("us-east-1a", instance_type="cheap", gpus=1, price=1.0, capacity=2)
DEAR = offer("us-east-1b", instance_type="dear", gpus=1, price=3.0, capacity=50)


def batch(pool: ResourcePool, index: CostIndex, gpus: int = 1) -> Decision | Rejection:
    policy = index.policy
    req = request("r1", GPU, gpus)
    c = evaluate(policy, req)
    assert isinstance(c, Constraints)
    [out] = solve([Ask(req, constraints=c)], Snapshot(pool, T0), policy, now=T0,
                  costs=index.frozen()).outcomes
    assert isinstance(out, Decision | Rejection)
    return out


def pool_placed(out: Decision | Rejection) -> PoolKey:
    assert isinstance(out, Decision), out
    return out.placement.pool


def test_an_offer_released_after_it_was_full_is_found_again() -> None:
    pool = pool_of([CHEAP, DEAR])
    index = CostIndex(pool, Policy())
    assert pool_placed(batch(pool, index)) == CHEAP.pool
    pool.hold(CHEAP.pool, 2)
    assert pool_placed(batch(pool, index)) == DEAR.pool
    pool.unhold(CHEAP.pool, 1)
    assert pool_placed(batch(pool, index)) == CHEAP.pool
    assert pool_placed(batch(pool, index, gpus=2)) == DEAR.pool  # room for one only
    pool.unhold(CHEAP.pool, 1)
    assert pool_placed(batch(pool, index, gpus=2)) == CHEAP.pool


def test_a_region_polled_again_is_seen_as_polled_not_as_the_batch_before_saw_it() -> None:
    pool = pool_of([CHEAP, DEAR])
    index = CostIndex(pool, Policy())
    pool.hold(CHEAP.pool, 2)
    assert pool_placed(batch(pool, index)) == DEAR.pool
    # The cloud now says there is more room where the broker holds two.
    pool.replace(SLICE, [replace(CHEAP, capacity=3), DEAR])
    assert pool_placed(batch(pool, index)) == CHEAP.pool
    # And less: the cheap pool is full again, and the dear one went up in price under
    # a third, cheaper still.
    third = offer("us-east-1c", instance_type="third", gpus=1, price=2.0, capacity=1)
    pool.replace(SLICE, [replace(CHEAP, capacity=2), replace(DEAR, price_per_hour=4.0),
                         third])
    assert pool_placed(batch(pool, index)) == third.pool


def test_a_request_that_finds_every_offer_full_is_told_so() -> None:
    # Skipped unjudged, the full offers would not count as matching: the reason would
    # read "no fresh offer" instead of naming capacity.
    pool = pool_of([CHEAP, replace(DEAR, capacity=1)])
    index = CostIndex(pool, Policy())
    pool.hold(CHEAP.pool, 2)
    pool.hold(DEAR.pool, 1)
    out = batch(pool, index)
    assert isinstance(out, Rejection)
    assert out.code is RejectCode.NO_CAPACITY
    assert "2 pool(s) offer" in out.detail and "none has free capacity" in out.detail


def test_a_snapshot_and_frozen_costs_keep_what_they_saw_while_the_pool_changes() -> None:
    pool = pool_of([CHEAP, DEAR])
    index = CostIndex(pool, Policy())
    pool.hold(CHEAP.pool, 1)
    view, costs = Snapshot(pool, T0), index.frozen()
    lists = {m: list(view.by_gpu(GPU, m)) for m in (None, *Market)}
    entries = list(costs.sorted(GPU, Market.SPOT))
    # Everything a batch placed in a worker thread must not see change under it.
    pool.hold(CHEAP.pool, 1)
    pool.hold(DEAR.pool, 5)
    cheaper = replace(DEAR, price_per_hour=0.5)
    pool.replace(SLICE, [CHEAP, cheaper, offer("us-east-1c", gpus=1, price=2.0)])
    index.frozen()  # the index places the changed offers again
    assert view.held(CHEAP.pool) == 1 and view.held(DEAR.pool) == 0
    assert {m: list(view.by_gpu(GPU, m)) for m in (None, *Market)} == lists
    assert list(costs.sorted(GPU, Market.SPOT)) == entries
    # A new one sees it all.
    now = Snapshot(pool, T0)
    assert now.held(CHEAP.pool) == 2 and now.held(DEAR.pool) == 5
    assert [o.pool.instance_type for o in now.by_gpu(GPU, Market.SPOT)] == \
        ["dear", "cheap", "p5.48xlarge"]
    assert index.frozen().sorted(GPU, Market.SPOT)[0][2] == cheaper
