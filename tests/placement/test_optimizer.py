"""Tests of the placement optimizer (`broker/placement/optimizer.py`), on a real ResourcePool."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Sequence
from datetime import timedelta

import pytest
from factories import SLICE, T0, Clock, offer, pool_of, request

from adapters.sim import SimAdapter
from broker.market.pool import ResourcePool
from broker.model import Market, Offer, PlaceRequest, PoolKey, RejectCode
from broker.placement.candidates import fewest_paid
from broker.placement.optimizer import Ask, CostIndex, Decision, Outcome, Rejection, place, solve
from policies.model import Defaults, Policy, Scoring, Team

POLICY = Policy()


def place_one(req: PlaceRequest, pool: ResourcePool, policy: Policy = POLICY,
              exclude: frozenset[PoolKey] = frozenset(),
              retry_after_seconds: float | None = None) -> Outcome:
    [out] = place([Ask(req, exclude)], pool, policy, now=T0,
                  retry_after_seconds=retry_after_seconds)
    return out


def decided(out: Outcome) -> Decision:
    assert isinstance(out, Decision), out
    return out


def rejected(out: Outcome) -> Rejection:
    assert isinstance(out, Rejection), out
    return out


# --- choosing ----------------------------------------------------------------------------


def test_cheapest_expected_cost_wins() -> None:
    offers = [offer("us-east-1a", price=30.0), offer("us-east-1b", price=20.0),
              offer("us-east-1c", price=25.0)]
    d = decided(place_one(request(), pool_of(offers)))
    assert d.placement.pool.zone == "us-east-1b"
    assert d.expected_cost_per_hour == pytest.approx(20.0)
    assert d.placement.price_per_hour == 20.0
    assert d.placement.price_observed_at == T0
    assert d.reason


def test_spot_interruption_risk_can_make_on_demand_win() -> None:
    spot = offer("us-east-1a", market="spot", price=20.0, interruption_rate=1.0)
    od = offer("us-east-1a", market="on_demand", price=24.0, interruption_rate=None)
    # spot: 20 × (1 + 0.5 h × 1.0) = 30 > on-demand 24 (balanced: no cost per GPU)
    d = decided(place_one(request(), pool_of([spot, od])))
    assert d.placement.pool.market is Market.ON_DEMAND
    assert d.expected_cost_per_hour == pytest.approx(24.0)
    # the same spot pool at a low interruption rate wins: 20 × 1.1 = 22
    d = decided(place_one(request(), pool_of([
        offer("us-east-1a", market="spot", price=20.0, interruption_rate=0.2), od])))
    assert d.placement.pool.market is Market.SPOT
    assert d.expected_cost_per_hour == pytest.approx(22.0)


def test_unknown_signals_take_the_policy_values() -> None:
    policy = Policy(scoring=Scoring(restart_hours=2, availability_weight=0.5,
                                    unknown_interruption_rate=0.1, unknown_availability=0.4))
    o = offer(price=10.0, availability=None, interruption_rate=None)
    d = decided(place_one(request(), pool_of([o]), policy))
    # 10 × (1 + 2 × 0.1 + 0.5 × (1 − 0.4)) (balanced: no cost per GPU)
    assert d.expected_cost_per_hour == pytest.approx(10.0 * 1.5)


def test_low_availability_costs_more() -> None:
    scarce = offer("us-east-1a", price=20.0, availability=0.0)  # 20 × 1.25 = 25
    plenty = offer("us-east-1b", price=22.0, availability=1.0)
    d = decided(place_one(request(), pool_of([scarce, plenty])))
    assert d.placement.pool.zone == "us-east-1b"


def test_idle_paid_gpus_count_in_the_cost() -> None:
    # 6 GPUs: one 8-GPU instance at 2.0/GPU-h costs 16/h; six 1-GPU ones at 2.5 cost 15/h.
    eight = offer("us-east-1a", instance_type="p5.48xlarge", gpus=8, price=16.0)
    one = offer("us-east-1a", instance_type="p5.4xlarge", gpus=1, price=2.5)
    d = decided(place_one(request(gpus=6), pool_of([eight, one])))
    assert d.placement.pool.instance_type == "p5.4xlarge"
    assert d.placement.instances == 6


def test_instances_round_up_and_price_is_for_the_whole_placement() -> None:
    o = offer(gpus=8, price=24.0)
    d = decided(place_one(request(gpus=10), pool_of([o])))
    p = d.placement
    assert (p.instances, p.gpus, p.total_gpus) == (2, 8, 16)
    assert p.price_per_hour == pytest.approx(48.0)
    assert p.price_per_gpu_hour == pytest.approx(3.0)
    assert p.gpu == "H100-80GB"
    assert d.expected_cost_per_hour == pytest.approx(48.0)


# --- filters -----------------------------------------------------------------------------


def test_any_acceptable_gpu_model_is_considered() -> None:
    h100 = offer("us-east-1a", gpu="H100-80GB", price=40.0)
    a100 = offer("us-east-1b", gpu="A100-80GB", instance_type="p4de.24xlarge", price=30.0)
    t4 = offer("us-east-1c", gpu="T4", instance_type="g4dn.12xlarge", price=1.0)
    pool = pool_of([h100, a100, t4])
    d = decided(place_one(request(gpu=["H100-80GB", "A100-80GB"]), pool))
    assert d.placement.gpu == "A100-80GB"
    d = decided(place_one(request(gpu="H100-80GB"), pool))
    assert d.placement.gpu == "H100-80GB"


@pytest.mark.parametrize(("market", "policy_market", "want"), [
    ("spot", "any", Market.SPOT),
    ("on_demand", "any", Market.ON_DEMAND),
    (None, "on_demand", Market.ON_DEMAND),  # the policy's default market
    ("spot", "on_demand", Market.SPOT),  # the request's market beats the policy's
])
def test_market_filter(market: str | None, policy_market: str, want: Market) -> None:
    # on-demand is the cheaper one here, so "any" would pick it
    spot = offer(market="spot", price=30.0)
    od = offer(market="on_demand", price=20.0)
    policy = Policy(defaults=Defaults(market=policy_market))  # type: ignore[arg-type]
    d = decided(place_one(request(market=market), pool_of([spot, od]), policy))
    assert d.placement.pool.market is want
    assert all(a.pool.market is want for a in d.alternatives)


def test_cloud_and_region_filters() -> None:
    cheap_gcp = offer("us-central1-a", cloud="gcp", region="us-central1", price=10.0)
    west = offer("us-west-2a", region="us-west-2", price=15.0)
    east = offer("us-east-1a", region="us-east-1", price=20.0)
    pool = pool_of([cheap_gcp, west, east])
    assert decided(place_one(request(clouds=("aws",)), pool)).placement.pool == west.pool
    assert decided(place_one(request(regions=("us-east-1",)), pool)).placement.pool == east.pool
    d = decided(place_one(request(clouds=("gcp", "aws"), regions=("us-east-1", "us-west-2")),
                          pool))
    assert d.placement.pool == west.pool
    r = rejected(place_one(request(clouds=("azure",)), pool))
    assert r.code is RejectCode.NO_CAPACITY
    assert "azure" in r.detail


def test_price_cap_rejects_with_cap_and_cheapest_in_the_detail() -> None:
    pool = pool_of([offer("us-east-1a", price=40.0), offer("us-east-1b", price=32.0)])
    r = rejected(place_one(request(max_price_per_gpu_hour=3.5), pool, retry_after_seconds=30))
    assert r.code is RejectCode.OVER_PRICE_CAP
    assert "$3.5/GPU-h" in r.detail
    assert "$4/GPU-h" in r.detail  # the cheapest fresh offer: 32 / 8
    assert r.retry_after_seconds == 30


def test_price_cap_admits_offers_at_or_under_it() -> None:
    pool = pool_of([offer("us-east-1a", price=32.0), offer("us-east-1b", price=40.0)])
    d = decided(place_one(request(max_price_per_gpu_hour=4.0), pool))
    assert d.placement.pool.zone == "us-east-1a"
    assert d.alternatives == ()  # 5.0/GPU-h is over the cap


def test_policy_default_cap_applies_when_the_request_has_none() -> None:
    pool = pool_of([offer(price=40.0)])
    policy = Policy(defaults=Defaults(max_price_per_gpu_hour=4.0))
    assert rejected(place_one(request(), pool, policy)).code is RejectCode.OVER_PRICE_CAP
    assert isinstance(place_one(request(max_price_per_gpu_hour=6.0), pool, policy), Decision)


def test_nothing_matching_is_no_capacity() -> None:
    pool = pool_of([offer(gpu="T4", instance_type="g4dn.xlarge", gpus=1, price=0.5)])
    r = rejected(place_one(request(gpu="H100-80GB"), pool))
    assert r.code is RejectCode.NO_CAPACITY
    assert "H100-80GB" in r.detail
    assert r.retry_after_seconds is None


def test_unpriced_offers_are_never_placed() -> None:
    r = rejected(place_one(request(), pool_of([offer(price=None)])))
    assert r.code is RejectCode.NO_CAPACITY


# --- capacity, quota, exclusions, cool-down, freshness -------------------------------------


def test_pool_without_enough_free_capacity_is_skipped() -> None:
    small = offer("us-east-1a", price=20.0, capacity=1)
    big = offer("us-east-1b", price=30.0, capacity=2)
    pool = pool_of([small, big])
    d = decided(place_one(request(gpus=16), pool))  # 2 instances
    assert d.placement.pool == big.pool
    pool.hold(big.pool, 1)  # a lease holds one: 1 left
    r = rejected(place_one(request(gpus=16), pool))
    assert r.code is RejectCode.NO_CAPACITY
    assert "free capacity" in r.detail


def test_unknown_capacity_does_not_block() -> None:
    d = decided(place_one(request(gpus=64), pool_of([offer(capacity=None)])))
    assert d.placement.instances == 8


def test_one_batch_never_oversubscribes_a_pool() -> None:
    only_one = offer("us-east-1a", price=20.0, capacity=1)
    dearer = offer("us-east-1b", price=30.0, capacity=5)
    pool = pool_of([only_one, dearer])
    first, second = place([Ask(request("r1")), Ask(request("r2"))], pool, POLICY, now=T0)
    assert decided(first).placement.pool == only_one.pool
    assert decided(second).placement.pool == dearer.pool


def test_one_batch_rejects_what_no_longer_fits() -> None:
    pool = pool_of([offer(capacity=1)])
    first, second = place([Ask(request("r1")), Ask(request("r2"))], pool, POLICY, now=T0)
    assert isinstance(first, Decision)
    assert rejected(second).code is RejectCode.NO_CAPACITY


def test_separate_batches_do_not_remember_each_other() -> None:
    # the batch's bookkeeping is per call; holds are the pool's job
    pool = pool_of([offer(capacity=1)])
    assert isinstance(place_one(request("r1"), pool), Decision)
    assert isinstance(place_one(request("r2"), pool), Decision)


def test_quota_headroom_is_respected() -> None:
    tight = offer("us-east-1a", price=20.0, quota_headroom=8)
    roomy = offer("us-east-1b", price=30.0, quota_headroom=16)
    pool = pool_of([tight, roomy])
    assert decided(place_one(request(gpus=8), pool)).placement.pool == tight.pool
    assert decided(place_one(request(gpus=9), pool)).placement.pool == roomy.pool
    assert rejected(place_one(request(gpus=17), pool)).code is RejectCode.NO_CAPACITY


def test_one_batch_never_oversubscribes_quota_headroom() -> None:
    tight = offer("us-east-1a", price=20.0, quota_headroom=8)
    roomy = offer("us-east-1b", price=30.0, quota_headroom=64)
    pool = pool_of([tight, roomy])
    first, second = place([Ask(request("r1")), Ask(request("r2"))], pool, POLICY, now=T0)
    assert decided(first).placement.pool == tight.pool
    assert decided(second).placement.pool == roomy.pool


def test_excluded_pools_are_not_placed_on() -> None:
    cheap, dear = offer("us-east-1a", price=20.0), offer("us-east-1b", price=30.0)
    pool = pool_of([cheap, dear])
    d = decided(place_one(request(), pool, exclude=frozenset({cheap.pool})))
    assert d.placement.pool == dear.pool
    assert cheap.pool not in {a.pool for a in d.alternatives}
    r = rejected(place_one(request(), pool, exclude=frozenset({cheap.pool, dear.pool})))
    assert r.code is RejectCode.NO_CAPACITY


def test_pools_in_cooldown_are_not_placed_on() -> None:
    clock = Clock()
    cheap, dear = offer("us-east-1a", price=20.0), offer("us-east-1b", price=30.0)
    pool = pool_of([cheap, dear], clock=clock)
    pool.cool_down(cheap.pool, 60)
    assert decided(place_one(request(), pool)).placement.pool == dear.pool
    [after] = place([Ask(request())], pool, POLICY, now=clock.advance(60))
    assert decided(after).placement.pool == cheap.pool


def test_stale_offers_are_never_placed() -> None:
    clock = Clock()
    stale = offer("us-east-1a", price=10.0)
    fresh = offer("us-central1-a", cloud="gcp", region="us-central1", price=30.0)
    pool = ResourcePool(stale_after_seconds=300, clock=clock)
    pool.replace(SLICE, [stale])
    clock.advance(301)
    pool.replace(("sim", "gcp:us-central1"), [fresh])
    [out] = place([Ask(request())], pool, POLICY, now=clock.now)
    assert decided(out).placement.pool == fresh.pool
    assert decided(out).alternatives == ()
    pool.replace(("sim", "gcp:us-central1"), [])
    [out] = place([Ask(request())], pool, POLICY, now=clock.now)
    r = rejected(out)
    assert r.code is RejectCode.NO_CAPACITY
    assert "no fresh offer" in r.detail


# --- alternatives ------------------------------------------------------------------------


def test_up_to_three_alternatives_distinct_and_ordered_by_cost() -> None:
    prices = [27.0, 21.0, 25.0, 22.0, 30.0, 23.0]
    offers = [offer(f"us-east-1{z}", price=p) for z, p in zip("abcdef", prices, strict=True)]
    d = decided(place_one(request(), pool_of(offers)))
    assert d.placement.price_per_hour == 21.0
    assert [a.price_per_hour for a in d.alternatives] == [22.0, 23.0, 25.0]
    pools = [d.placement.pool, *(a.pool for a in d.alternatives)]
    assert len(set(pools)) == 4


def test_fewer_alternatives_when_fewer_pools_fit() -> None:
    d = decided(place_one(request(), pool_of([offer("us-east-1a"), offer("us-east-1b")])))
    assert len(d.alternatives) == 1


# --- the early stop never loses the optimum ----------------------------------------------


def brute_force_costs(req: PlaceRequest, offers: Sequence[Offer], pool: ResourcePool,
                      policy: Policy, exclude: frozenset[PoolKey]) -> list[float]:
    """Expected cost of every feasible offer, cheapest first, from the formula in SPEC
    terms, written out here independently of the optimizer."""
    s = policy.scoring
    market = req.market or policy.defaults.market
    cap = (req.max_price_per_gpu_hour if req.max_price_per_gpu_hour is not None
           else policy.defaults.max_price_per_gpu_hour)
    costs = []
    for o in offers:
        k = o.pool
        if o.gpu not in req.gpu or o.price_per_hour is None:
            continue
        # Paid-for capacity (`reserved`) serves spot and on-demand requests too.
        if market != "any" and k.market.value not in (market, "reserved"):
            continue
        if (req.clouds and k.cloud not in req.clouds) or (
                req.regions and k.region not in req.regions):
            continue
        if k in exclude or not pool.is_fresh(k, T0) or k in pool.cooling(T0):
            continue
        if cap is not None and o.price_per_hour / o.gpus > cap:
            continue
        instances = math.ceil(req.gpus / o.gpus)
        free = pool.free_capacity(k)
        if free is not None and free < instances:
            continue
        if o.quota_headroom is not None and o.quota_headroom < instances * o.gpus:
            continue
        rate = 0.0
        if k.market is Market.SPOT:
            rate = (o.interruption_rate if o.interruption_rate is not None
                    else s.unknown_interruption_rate)
            rate *= instances  # a gang is interrupted when any of its instances is
        avail = o.availability if o.availability is not None else s.unknown_availability
        costs.append(instances * o.price_per_hour
                     * (1 + s.restart_hours * rate + s.availability_weight * (1 - avail))
                     + instances * o.gpus * s.interruption_cost_per_gpu * rate)
    return sorted(costs)


def check_against_brute_force(rng: random.Random, offers: list[Offer], pool: ResourcePool,
                              models: list[str], policy: Policy, n: int = 200,
                              costs: CostIndex | None = None) -> int:
    """Place n random requests one at a time (walking the offers in order of cost when
    `costs` is given, else of price); return how many were decided."""
    clouds = sorted({o.pool.cloud for o in offers})
    regions = sorted({o.pool.region for o in offers})
    ppgs = sorted(o.price_per_gpu_hour for o in offers if o.price_per_gpu_hour is not None)
    n_decided = 0
    for i in range(n):
        req = request(
            f"r{i}",
            gpu=rng.sample(models, rng.randint(1, min(3, len(models)))),
            gpus=rng.choice([1, 2, 3, 4, 6, 8, 12, 16, 24, 64]),
            market=rng.choice([None, "spot", "on_demand", "any"]),
            max_price_per_gpu_hour=rng.choice([None, None, rng.choice(ppgs) * 1.01]),
            clouds=rng.choice([None, None, tuple(rng.sample(clouds, 1))]),
            regions=rng.choice([None, None, None, tuple(rng.sample(regions, 2))]),
        )
        exclude = frozenset(rng.sample([o.pool for o in offers], rng.choice([0, 0, 3])))
        want = brute_force_costs(req, offers, pool, policy, exclude)
        [out] = solve([Ask(req, exclude)], pool, policy, now=T0, costs=costs).outcomes
        if not want:
            assert isinstance(out, Rejection), (req, out)
            continue
        d = decided(out)
        n_decided += 1
        got = [d.expected_cost_per_hour,
               *(brute_force_costs(req, [pool.get(a.pool)], pool, policy, exclude)[0]  # type: ignore[list-item]
                 for a in d.alternatives)]
        assert got == pytest.approx(want[:4], rel=1e-9), req
        assert d.placement.pool not in exclude
    return n_decided


def random_offers(rng: random.Random) -> list[Offer]:
    models = ["H100-80GB", "A100-80GB", "A100-40GB", "L4", "T4"]
    offers = []
    for cloud, region, zone, itype in itertools.product(
            ["aws", "gcp"], ["r1", "r2"], ["z1", "z2", "z3"], ["i1", "i2", "i3", "i4"]):
        gpus = rng.choice([1, 2, 4, 8])
        for market in Market:
            offers.append(offer(
                f"{region}-{zone}", cloud=cloud, region=region,
                instance_type=f"{itype}.{gpus}x", market=market,
                gpu=rng.choice(models), gpus=gpus,
                price=rng.choice([None, *[round(rng.uniform(0.3, 5.0) * gpus, 4)] * 9]),
                availability=rng.choice([None, round(rng.random(), 3)]),
                capacity=rng.choice([None, 0, 1, 2, 5, 40]),
                interruption_rate=rng.choice([None, round(rng.uniform(0, 0.5), 3)]),
                quota_headroom=rng.choice([None, None, 8, 32, 256])))
    return offers


@pytest.mark.parametrize("indexed", [False, True], ids=["by-price", "by-cost"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_early_stop_matches_brute_force_on_random_offers(seed: int, indexed: bool) -> None:
    rng = random.Random(seed)
    offers = random_offers(rng)
    clock = Clock()
    pool = ResourcePool(stale_after_seconds=300, clock=clock)
    by_slice: dict[str, list[Offer]] = {}
    for o in offers:
        by_slice.setdefault(o.pool.region, []).append(o)
    pool.replace(("x", "r2"), by_slice["r2"])
    clock.advance(-1000)  # r1's slice was polled long ago: stale
    pool.replace(("x", "r1"), by_slice["r1"][:10])
    clock.advance(1000)
    pool.replace(("x", "r1b"), by_slice["r1"][10:])
    for o in rng.sample(offers, 8):
        pool.cool_down(o.pool, 60)
    for o in rng.sample(offers, 8):
        pool.hold(o.pool, 1)
    policy = Policy(scoring=Scoring(restart_hours=rng.uniform(0, 3),
                                    availability_weight=rng.uniform(0, 1)))
    costs = CostIndex(pool, policy) if indexed else None
    n = check_against_brute_force(rng, offers, pool, sorted({o.gpu for o in offers}), policy,
                                  costs=costs)
    assert n > 50  # the test exercised decisions, not only rejections


@pytest.mark.parametrize("indexed", [False, True], ids=["by-price", "by-cost"])
async def test_early_stop_matches_brute_force_on_the_simulated_market(indexed: bool) -> None:
    adapter = SimAdapter(seed=3, regions_per_cloud=2, zones_per_region=2, clock=lambda: T0)
    pool = ResourcePool(stale_after_seconds=300, clock=lambda: T0)
    offers = []
    for region in adapter.regions():
        polled = await adapter.poll(region)
        pool.replace(("sim", region), polled)
        offers.extend(polled)
    rng = random.Random(5)
    models = sorted({o.gpu for o in offers})
    costs = CostIndex(pool, POLICY) if indexed else None
    n = check_against_brute_force(rng, offers, pool, models, POLICY, costs=costs)
    assert n > 50


@pytest.mark.parametrize("hazard", [False, True], ids=["signals", "hazard"])
def test_the_cost_index_follows_the_pool_as_a_fresh_one_would(hazard: bool) -> None:
    """After polls that change prices, add, remove and re-read offers, the index kept up
    to date holds what an index built from scratch holds, in the same order; and it
    still places as a brute force does. With the hazard estimator, whose estimates
    change with the polls (and all at once at each refresh), as the daemon scores."""
    from broker.market.hazard import HazardEstimator

    rng = random.Random(11)
    offers = random_offers(rng)
    clock = Clock()
    pool = ResourcePool(stale_after_seconds=300, clock=clock)
    if hazard:
        pool.hazard = HazardEstimator(half_life_hours=6.0, refresh_seconds=120.0)
        pool.feed_hazard(pool.hazard)
    by_region: dict[str, list[Offer]] = {}
    for o in offers:
        by_region.setdefault(o.pool.region, []).append(o)
    for region, members in by_region.items():
        pool.replace(("x", region), members)
    kept = CostIndex(pool, POLICY)
    lists = [(g, m) for g in sorted({o.gpu for o in offers}) for m in Market]
    for g, m in lists:
        kept.sorted(g, m)  # built before the changes, then kept up to date
    for round_ in range(5):
        for region, members in by_region.items():
            changed = []
            for o in members:
                roll = rng.random()
                if roll < 0.1:
                    continue  # gone from this poll
                if roll < 0.4 and o.price_per_hour is not None:
                    o = dataclasses.replace(o, price_per_hour=o.price_per_hour *
                                            rng.uniform(0.5, 1.5),
                                            availability=rng.uniform(0.2, 1.0))
                elif roll < 0.5:
                    o = dataclasses.replace(o, observed_at=T0 + timedelta(minutes=round_))
                changed.append(o)
            pool.replace(("x", region), changed)
            clock.advance(50)  # a refresh of every estimate every few polls
        fresh = CostIndex(pool, POLICY)
        for g, m in lists:
            assert [e[:2] for e in kept.sorted(g, m)] == [e[:2] for e in fresh.sorted(g, m)]
        fresh.close()
    current = [o for o in pool]
    models = sorted({o.gpu for o in current})
    if not hazard:
        assert check_against_brute_force(rng, current, pool, models, POLICY, n=100,
                                         costs=kept) > 20
        return
    # The brute force knows no hazard estimates: the walk in order of price is the
    # reference (it matches the brute force above, on the same scoring code).
    decided_ = 0
    for i in range(100):
        req = request(f"h{i}", gpu=rng.sample(models, rng.randint(1, 3)),
                      gpus=rng.choice([1, 2, 4, 8, 16]), market=rng.choice([None, "spot"]))
        [by_price] = solve([Ask(req)], pool, POLICY, now=T0).outcomes
        [by_cost] = solve([Ask(req)], pool, POLICY, now=T0, costs=kept).outcomes
        assert type(by_price) is type(by_cost)
        if isinstance(by_price, Decision):
            decided_ += 1
            assert isinstance(by_cost, Decision)
            assert by_cost.expected_cost_per_hour == pytest.approx(
                by_price.expected_cost_per_hour, rel=1e-9), req
    assert decided_ > 20


# --- the pools' history ---------------------------------------------------------------------


def _history(before: tuple[float, float], last: tuple[float, float], hours: float = 24
             ) -> tuple[ResourcePool, Clock, Offer, Offer]:
    """Two spot pools polled every ten minutes for `hours`: `changing` (us-east-1a, $20)
    at (availability, interruption rate) `before` all along and `last` at the last poll;
    `steady` (us-east-1b), 5 % dearer, at (0.85, 0.02) throughout. The pool feeds a
    hazard estimator."""
    from broker.market.hazard import HazardEstimator

    clock = Clock(T0 - timedelta(hours=hours))
    pool = ResourcePool(stale_after_seconds=300, clock=clock)
    pool.hazard = HazardEstimator(half_life_hours=6.0)
    pool.feed_hazard(pool.hazard)
    steady = offer("us-east-1b", price=21.0, availability=0.85, interruption_rate=0.02)
    changing = offer("us-east-1a", price=20.0, availability=before[0],
                     interruption_rate=before[1])
    for _ in range(int(hours * 6)):
        pool.replace(SLICE, [changing, steady])
        clock.advance(600)
    changing = offer("us-east-1a", price=20.0, availability=last[0], interruption_rate=last[1])
    pool.replace(SLICE, [changing, steady])
    return pool, clock, changing, steady


def _calm_now_stormy_before(hours: float = 24) -> tuple[ResourcePool, Clock, Offer, Offer]:
    """`flaky` at availability 0.45 (0.1 interruptions an hour) all along but calm at the
    last poll (0.95, 0.01), and `steady`."""
    return _history((0.45, 0.1), (0.95, 0.01), hours)


@pytest.mark.parametrize("batch", [1, 70])  # per request, and the large-batch arrays
def test_a_pool_calm_now_but_stormy_in_its_history_loses_to_a_steady_one(batch: int) -> None:
    pool, clock, flaky, steady = _calm_now_stormy_before()
    asks = [Ask(request(f"r{n}", gpus=8, market="spot")) for n in range(batch)]
    on = Policy(scoring=Scoring(hazard_half_life_hours=6.0))
    off = Policy(scoring=Scoring(hazard_half_life_hours=0.0))
    # Enough capacity for everyone: the choice is the expected cost alone.
    got_on = place(asks, pool, on, now=clock())
    got_off = place(asks, pool, off, now=clock())
    assert {decided(o).placement.pool for o in got_on} == {steady.pool}
    assert {decided(o).placement.pool for o in got_off} == {flaky.pool}
    # Without an estimator on the view, the policy's half-life changes nothing.
    pool.hazard = None
    assert {decided(o).placement.pool for o in place(asks, pool, on, now=clock())} == \
        {flaky.pool}


def _stormy_now_calm_before(hours: float = 24) -> tuple[ResourcePool, Clock, Offer, Offer]:
    """The other way round: `dip` calm (0.9, 0.01) all along but stormy at the last poll
    (0.3, 0.2), and `steady`."""
    return _history((0.9, 0.01), (0.3, 0.2), hours)


@pytest.mark.parametrize("costs", [False, True], ids=["walk", "index"])
@pytest.mark.parametrize("batch", [1, 70])  # per request, and the large-batch arrays
def test_spot_risk_is_scored_over_the_requests_own_duration(batch: int, costs: bool) -> None:
    """A short job takes the pool that is calm now, a long one the pool that is calm on
    the whole; in one batch, each its own (no duration: the 4 h default)."""
    for make, short_goes, long_goes in ((_calm_now_stormy_before, "us-east-1a", "us-east-1b"),
                                        (_stormy_now_calm_before, "us-east-1b", "us-east-1a")):
        pool, clock, _, _ = make()
        index = CostIndex(pool, POLICY) if costs else None
        asks = [Ask(request(f"r{n}", gpus=8, market="spot",
                            duration_hours=(0.5, 48.0)[n % 2])) for n in range(batch + 1)]
        got = solve(asks, pool, POLICY, now=clock(), costs=index).outcomes
        zones = [decided(o).placement.pool.zone for o in got]
        assert set(zones[0::2]) == {short_goes}, make.__name__
        assert set(zones[1::2]) == {long_goes}, make.__name__
        # A request that gives no duration is scored as a 4 h one.
        [plain, four] = place([Ask(request("p", gpus=8, market="spot")),
                               Ask(request("f", gpus=8, market="spot", duration_hours=4.0))],
                              pool, POLICY, now=clock())
        assert decided(plain).expected_cost_per_hour == decided(four).expected_cost_per_hour
        if index is not None:
            index.close()


@pytest.mark.parametrize("batch", [1, 70])  # per request, and the large-batch arrays
def test_a_gang_of_many_small_instances_is_riskier_than_a_few_large_ones(batch: int) -> None:
    """At one price per GPU and one interruption rate per instance, 16 GPUs as two
    8-GPU instances beat sixteen 1-GPU ones: the gang is interrupted when any of its
    instances is."""
    from broker.placement.optimizer import expected_cost

    small = dict(instance_type="g5.xlarge", gpu="A10G", gpus=1)
    large = dict(instance_type="g5.48xlarge", gpu="A10G", gpus=8)
    offers = [offer("us-east-1a", price=1.0, interruption_rate=0.05, **small),  # type: ignore[arg-type]
              offer("us-east-1b", price=8.0, interruption_rate=0.05, **large)]  # type: ignore[arg-type]
    pool = pool_of(offers)
    asks = [Ask(request(f"g{n}", gpu="A10G", gpus=16, market="spot")) for n in range(batch)]
    got = place(asks, pool, POLICY, now=T0)
    assert {decided(o).placement.instances for o in got} == {2}
    one = place([Ask(request("one", gpu="A10G", gpus=1, market="spot"))], pool, POLICY, now=T0)
    assert decided(one[0]).placement.pool.zone == "us-east-1a"  # one GPU: no gang
    # The cost says so: sixteen instances pay 16 × the rate in lost work, two pay 2 ×.
    restart = POLICY.scoring.restart_hours
    per_gpu = POLICY.scoring.interruption_cost_per_gpu
    costs = {decided(o).placement.instances: decided(o).expected_cost_per_hour for o in got}
    assert costs[2] == pytest.approx(16.0 * (1 + restart * 2 * 0.05) + 16 * per_gpu * 2 * 0.05)
    assert decided(got[0]).alternatives[0].instances == 16
    small_gang = expected_cost(offers[0], 16, POLICY)
    assert small_gang == pytest.approx(16.0 * (1 + restart * 16 * 0.05)
                                       + 16 * per_gpu * 16 * 0.05)
    assert small_gang > costs[2]


def test_costs_frozen_for_a_batch_hold_its_horizons_only() -> None:
    from broker.market.hazard import HORIZONS

    pool, _, flaky, steady = _calm_now_stormy_before(hours=6)
    index = CostIndex(pool, POLICY)
    frozen = index.frozen({1.0, 64.0})
    gpu = flaky.gpu
    assert [e[1] for e in frozen.sorted(gpu, Market.SPOT, 1.0)] == [flaky.pool, steady.pool]
    assert [e[1] for e in frozen.sorted(gpu, Market.SPOT, 64.0)] == [steady.pool, flaky.pool]
    with pytest.raises(KeyError, match="not 16 h"):
        frozen.sorted(gpu, Market.SPOT, 16.0)
    # A request of another horizon than those frozen is still placed (by price order).
    assert not frozen.covers(16.0) and frozen.covers(64.0)
    [out] = solve([Ask(request("x", gpu=gpu, gpus=8, market="spot", duration_hours=16.0))],
                  pool, POLICY, now=T0, costs=frozen).outcomes
    assert isinstance(out, Decision)
    # Every list kept is the one a fresh index makes, whichever horizon.
    for h in HORIZONS:
        index.sorted(gpu, Market.SPOT, h)
    pool.replace(SLICE, [dataclasses.replace(flaky, price_per_hour=19.0), steady])
    fresh = CostIndex(pool, POLICY)
    for h in HORIZONS:
        assert index.sorted(gpu, Market.SPOT, h) == fresh.sorted(gpu, Market.SPOT, h)
    # Without an estimator every horizon scores alike: one list answers for all.
    pool.hazard = None
    plain = CostIndex(pool, POLICY).frozen({1.0})
    assert plain.sorted(gpu, Market.SPOT, 64.0) == plain.sorted(gpu, Market.SPOT, 1.0)


def test_explain_shows_the_signals_expected_over_a_job() -> None:
    from broker.placement.optimizer import explain

    pool, clock, _, _ = _calm_now_stormy_before()
    out = explain(Ask(request(gpus=8, market="spot")), pool, Policy(), now=clock())
    cands = {c["placement"]["zone"]: c for c in out["candidates"]}
    expected = cands["us-east-1a"]["expected_over_job"]
    assert cands["us-east-1a"]["availability"] == 0.95
    assert 0.45 < expected["availability"] < 0.7
    assert 0.05 < expected["interruption_rate"] < 0.1
    assert "expected_over_job" not in cands["us-east-1b"]  # steady: the same either way


# --- a cost per interruption ------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 70])  # per request, and the large-batch arrays
def test_an_interruption_cost_per_gpu_prices_interruptions_alike_for_every_model(
        batch: int) -> None:
    from broker.placement.optimizer import cost_terms, expected_cost

    # Two cheap T4 pools and two dear H100 pools; in each, the stormy one is 10 % cheaper.
    t4 = dict(instance_type="g4dn.xlarge", gpu="T4", gpus=1)
    h100 = dict(instance_type="p5.48xlarge", gpu="H100-80GB", gpus=8)
    offers = [
        offer("us-east-1a", price=0.45, interruption_rate=0.2, **t4),  # type: ignore[arg-type]
        offer("us-east-1b", price=0.50, interruption_rate=0.01, **t4),  # type: ignore[arg-type]
        offer("us-east-1a", price=36.0, interruption_rate=0.2, **h100),  # type: ignore[arg-type]
        offer("us-east-1b", price=40.0, interruption_rate=0.01, **h100),  # type: ignore[arg-type]
    ]
    pool = pool_of(offers)

    def zones(policy: Policy, gpu: str, gpus: int) -> set[str]:
        asks = [Ask(request(f"{gpu}-{n}", gpu=gpu, gpus=gpus, market="spot"))
                for n in range(batch)]
        return {decided(o).placement.pool.zone for o in place(asks, pool, policy, now=T0)}

    # Weighed by lost work, a share of the price: both models choose alike, since each
    # stormy pool is 10 % cheaper (0.9 × (1 + 0.3 × 0.2) < 1 + 0.3 × 0.01).
    by_work = Policy(scoring=Scoring(restart_hours=0.3, availability_weight=0.0,
                                     interruption_cost_per_gpu=0.0))
    assert zones(by_work, "H100-80GB", 8) == {"us-east-1a"}
    assert zones(by_work, "T4", 1) == {"us-east-1a"}
    # $1 per GPU and interruption: 0.2/h × $1 is over the T4 pools' $0.05 gap, and
    # 8 × 0.2 × $1 = $1.6/h is under the H100 pools' $4 gap, whatever restart_hours says.
    per_gpu = Policy(scoring=Scoring(restart_hours=0.0, availability_weight=0.0,
                                     interruption_cost_per_gpu=1.0))
    assert zones(per_gpu, "T4", 1) == {"us-east-1b"}
    assert zones(per_gpu, "H100-80GB", 8) == {"us-east-1a"}
    # The figures: price + GPUs × rate × cost, and cost_terms' share says the same; a
    # gang of two instances is interrupted twice as often, and loses both.
    stormy_h100 = offers[2]
    assert expected_cost(stormy_h100, 1, per_gpu) == pytest.approx(36.0 + 8 * 0.2)
    assert expected_cost(stormy_h100, 2, per_gpu) == pytest.approx(2 * (36.0 + 8 * 0.4))
    terms = cost_terms(stormy_h100, per_gpu)
    assert 36.0 * (1 + sum(terms.values())) == pytest.approx(36.0 + 8 * 0.2)
    terms = cost_terms(stormy_h100, per_gpu, instances=2)
    assert 72.0 * (1 + sum(terms.values())) == pytest.approx(2 * (36.0 + 8 * 0.4))
    # On-demand pools carry no interruption risk.
    od = offer(market="on_demand", price=40.0, interruption_rate=None)
    assert expected_cost(od, 1, per_gpu) == pytest.approx(40.0)


# --- risk levels ------------------------------------------------------------------------


def test_explain_ranks_candidates_at_the_requests_risk_level() -> None:
    from broker.placement.optimizer import explain

    risky = offer("us-east-1a", price=20.0, interruption_rate=0.3)
    safe = offer("us-east-1b", price=21.0, interruption_rate=0.01)
    pool = pool_of([risky, safe])
    policy = Policy(scoring=Scoring(risk="lowest-cost"),
                    teams={"serving": Team(risk="fewest-interruptions")})
    cheap = explain(Ask(request(market="spot")), pool, policy, now=T0)
    assert cheap["verdict"]["risk"] == "lowest-cost"
    assert [c["placement"]["zone"] for c in cheap["candidates"]] == ["us-east-1a", "us-east-1b"]
    assert cheap["candidates"][0]["expected_cost_per_hour"] == pytest.approx(20.0)
    calm = explain(Ask(request(market="spot", team="serving")), pool, policy, now=T0)
    assert calm["verdict"]["risk"] == "fewest-interruptions"
    assert [c["placement"]["zone"] for c in calm["candidates"]] == ["us-east-1b", "us-east-1a"]
    # 21 × (1 + 0.5 × 0.01) + 8 GPUs × $5 × 0.01, and its terms say the same
    first = calm["candidates"][0]
    assert first["expected_cost_per_hour"] == pytest.approx(21.505)
    assert 21.0 * (1 + sum(first["terms"].values())) == pytest.approx(21.505)


def test_the_fewest_gpus_a_request_pays_for_are_whole_instances_of_its_offers() -> None:
    eights = [offer(f"z{i}", instance_type=f"p{i}", gpus=8) for i in range(3)]
    assert fewest_paid(4, [eights]) == 8
    assert fewest_paid(12, [eights]) == 16
    assert fewest_paid(3, [eights, [offer(gpus=2), offer(gpus=1)]]) == 3
    assert fewest_paid(3, [[offer(gpus=2)]]) == 4
    assert fewest_paid(5, []) == 5  # no offer: never fewer than asked for


def test_a_team_with_fewer_gpus_left_than_any_instance_is_refused_for_them() -> None:
    # H100s come 8 an instance; the team may take 4 more: a request for 4 is refused,
    # named for the team's GPUs, whatever it finds on the way.
    pool = pool_of([offer(f"us-east-1{z}", instance_type="p5.48xlarge", gpus=8,
                          price=24.0 + i) for i, z in enumerate("abc")])
    policy = Policy(teams={"t": Team(max_gpus=4)})
    [out] = solve([Ask(request("r1", "H100-80GB", 4, team="t"))], pool, policy, now=T0,
                  costs=CostIndex(pool, policy)).outcomes
    assert isinstance(out, Rejection) and out.code is RejectCode.OVER_BUDGET
    assert "4 GPUs left" in out.detail
    # With 8 left, it goes on the cheapest instance.
    policy = Policy(teams={"t": Team(max_gpus=8)})
    [out] = solve([Ask(request("r1", "H100-80GB", 4, team="t"))], pool, policy, now=T0,
                  costs=CostIndex(pool, policy)).outcomes
    assert isinstance(out, Decision) and out.placement.pool.zone == "us-east-1a"
