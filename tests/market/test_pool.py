"""Tests of the unified resource pool (`broker/market/pool.py`)."""

from __future__ import annotations

import math
from dataclasses import replace

from factories import SLICE, Clock, key, offer, owned, pool_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.market.changes import PoolChange
from broker.market.pool import ResourcePool
from broker.model import Market, Offer, Target

OTHER: tuple[str, str] = ("sim", "gcp:us-central1")


def gcp_offer(zone: str = "us-central1-a") -> Offer:
    return offer(zone, cloud="gcp", region="us-central1", instance_type="a3-highgpu-8g")


# --- replace -----------------------------------------------------------------------------


def test_first_replace_reports_every_offer_as_new() -> None:
    a, b = offer("us-east-1a"), offer("us-east-1b")
    pool = ResourcePool(stale_after_seconds=300, clock=Clock())
    change = pool.replace(SLICE, [a, b])
    assert change.slice == SLICE
    assert change.updated == {a.pool: None, b.pool: None}
    assert change.removed == {}
    assert change.offers == {a.pool: a, b.pool: b}
    assert len(pool) == 2
    assert pool.get(a.pool) == a


def test_replace_reports_changed_and_removed_offers_with_the_old_ones() -> None:
    a, b, c = offer("us-east-1a"), offer("us-east-1b"), offer("us-east-1c")
    pool = pool_of([a, b, c])
    b2 = replace(b, price_per_hour=30.0)
    d = offer("us-east-1d")
    change = pool.replace(SLICE, [a, b2, d])
    assert change.updated == {b.pool: b, d.pool: None}  # `a` unchanged: not reported
    assert change.removed == {c.pool: c}
    assert pool.get(c.pool) is None
    assert pool.get(b.pool) == b2
    assert pool.slice_of(c.pool) is None
    assert sorted(o.pool.zone for o in pool) == ["us-east-1a", "us-east-1b", "us-east-1d"]


def test_replacing_one_slice_leaves_another_untouched() -> None:
    a = offer("us-east-1a")
    g = gcp_offer()
    pool = pool_of([a])
    pool.replace(OTHER, [g])
    change = pool.replace(SLICE, [])
    assert change.removed == {a.pool: a}
    assert pool.get(g.pool) == g
    assert pool.slice_offers(OTHER) == [g]
    assert pool.slice_offers(SLICE) == []
    assert pool.slice_of(g.pool) == OTHER


def test_a_pool_offered_by_another_slice_moves_to_it() -> None:
    """Two slices may report one pool (two adapters of one cloud): the last to offer it
    owns it, and only its own poll can take it away."""
    a, b = offer("us-east-1a"), offer("us-east-1b")
    pool = pool_of([a, b])
    b2 = replace(b, price_per_hour=30.0)
    pool.replace(OTHER, [b2])
    assert pool.slice_of(b.pool) == OTHER and pool.get(b.pool) == b2
    assert pool.slice_offers(SLICE) == [a] and pool.slice_offers(OTHER) == [b2]
    change = pool.replace(SLICE, [a])  # the first slice without it: not removed
    assert change.removed == {} and pool.get(b.pool) == b2
    change = pool.replace(OTHER, [])
    assert change.removed == {b.pool: b2} and pool.get(b.pool) is None
    assert [o.pool for o in pool] == [a.pool]


def test_listeners_get_each_change_until_unsubscribed() -> None:
    pool = ResourcePool(stale_after_seconds=300, clock=Clock())
    seen: list[PoolChange] = []
    unsubscribe = pool.subscribe(seen.append)
    first = pool.replace(SLICE, [offer()])
    unsubscribe()
    pool.replace(SLICE, [])
    assert seen == [first]


def test_slice_offers_lists_only_that_slice() -> None:
    a, b = offer("us-east-1a"), offer("us-east-1b")
    pool = pool_of([a, b])
    pool.replace(OTHER, [gcp_offer()])
    assert sorted(o.pool.zone for o in pool.slice_offers(SLICE)) == ["us-east-1a", "us-east-1b"]
    assert pool.slice_offers(("sim", "nowhere")) == []


# --- by_gpu ------------------------------------------------------------------------------


def test_by_gpu_sorts_by_price_per_gpu_hour_not_per_instance() -> None:
    big = offer("us-east-1a", instance_type="p5.48xlarge", gpus=8, price=24.0)  # 3.0/GPU-h
    small = offer("us-east-1a", instance_type="p5.4xlarge", gpus=1, price=3.5)  # 3.5/GPU-h
    mid = offer("us-east-1b", instance_type="p5.24xlarge", gpus=4, price=10.0)  # 2.5/GPU-h
    pool = pool_of([small, big, mid])
    assert [o.price_per_gpu_hour for o in pool.by_gpu("H100-80GB")] == [2.5, 3.0, 3.5]


def test_by_gpu_leaves_out_unpriced_offers_and_other_models() -> None:
    priced = offer("us-east-1a")
    unpriced = offer("us-east-1b", price=None)
    other = offer("us-east-1c", gpu="A100-80GB")
    pool = pool_of([priced, unpriced, other])
    assert list(pool.by_gpu("H100-80GB")) == [priced]
    assert list(pool.by_gpu("A100-80GB")) == [other]
    assert list(pool.by_gpu("T4")) == []
    assert len(pool) == 3  # the unpriced offer is listed, just never sorted in
    assert pool.gpus() == {"H100-80GB", "A100-80GB"}


def test_by_gpu_resorts_after_a_price_change() -> None:
    a = offer("us-east-1a", price=16.0)
    b = offer("us-east-1b", price=24.0)
    pool = pool_of([a, b])
    assert [o.pool.zone for o in pool.by_gpu("H100-80GB")] == ["us-east-1a", "us-east-1b"]
    pool.replace(SLICE, [replace(a, price_per_hour=40.0), b])
    ranked = pool.by_gpu("H100-80GB")
    assert [o.pool.zone for o in ranked] == ["us-east-1b", "us-east-1a"]
    assert ranked[1].price_per_hour == 40.0


def test_by_gpu_follows_a_model_change_and_a_removal() -> None:
    a = offer("us-east-1a")
    b = offer("us-east-1b")
    pool = pool_of([a, b])
    assert len(pool.by_gpu("H100-80GB")) == 2
    pool.replace(SLICE, [replace(a, gpu="A100-80GB")])
    assert list(pool.by_gpu("H100-80GB")) == []
    assert list(pool.by_gpu("A100-80GB")) == [replace(a, gpu="A100-80GB")]
    assert pool.gpus() == {"A100-80GB"}


# --- freshness and health ----------------------------------------------------------------


def test_offers_go_stale_after_stale_after_seconds() -> None:
    clock = Clock()
    a = offer()
    pool = pool_of([a], clock=clock, stale_after_seconds=300)
    assert pool.is_fresh(a.pool, clock.advance(300))
    assert pool.age_seconds(a.pool, clock.now) == 300
    assert not pool.is_fresh(a.pool, clock.advance(1))
    assert pool.fresh_slices(clock.now) == set()


def test_a_new_poll_makes_the_slice_fresh_again() -> None:
    clock = Clock()
    a = offer()
    pool = pool_of([a], clock=clock, stale_after_seconds=300)
    clock.advance(301)
    assert not pool.is_fresh(a.pool, clock.now)
    pool.replace(SLICE, [a])
    assert pool.is_fresh(a.pool, clock.now)
    assert pool.fresh_slices(clock.now) == {SLICE}


def test_unknown_key_is_never_fresh() -> None:
    pool = pool_of([offer()])
    assert not pool.is_fresh(key("us-east-1z"), Clock().now)
    assert pool.age_seconds(key("us-east-1z"), Clock().now) is None


def test_mark_failed_keeps_offers_until_they_go_stale() -> None:
    clock = Clock()
    a = offer()
    pool = pool_of([a], clock=clock, stale_after_seconds=300)
    clock.advance(100)
    assert pool.mark_failed(SLICE, "timeout") is True  # healthy -> failing
    assert pool.failing(SLICE)
    assert pool.get(a.pool) == a
    assert pool.is_fresh(a.pool, clock.now)  # last good poll 100 s ago
    assert not pool.is_fresh(a.pool, clock.advance(201))
    assert pool.get(a.pool) == a  # stale, still listed


def test_mark_failed_reports_only_the_transition() -> None:
    pool = pool_of([offer()])
    assert pool.mark_failed(SLICE, "e1") is True
    assert pool.mark_failed(SLICE, "e2") is False
    health = {h.slice: h for h in pool.health()}[SLICE]
    assert (health.ok, health.failures, health.last_error) == (False, 2, "e2")
    pool.replace(SLICE, [offer()])
    assert not pool.failing(SLICE)
    assert pool.mark_failed(SLICE, "e3") is True


def test_failing_for_a_slice_that_never_polled() -> None:
    pool = ResourcePool(stale_after_seconds=300, clock=Clock())
    assert not pool.failing(SLICE)
    assert pool.mark_failed(SLICE, "no credentials") is True
    assert pool.failing(SLICE)
    assert pool.fresh_slices(Clock().now) == set()


# --- holdings and cool-down --------------------------------------------------------------


def test_hold_and_unhold_change_free_capacity() -> None:
    a = offer(capacity=5)
    pool = pool_of([a])
    assert pool.free_capacity(a.pool) == 5
    pool.hold(a.pool, 2)
    pool.hold(a.pool, 1)
    assert pool.held(a.pool) == 3
    assert pool.free_capacity(a.pool) == 2
    assert pool.held_pools() == {a.pool}
    pool.hold(a.pool, 4)
    assert pool.free_capacity(a.pool) == 0  # never negative
    pool.unhold(a.pool, 7)
    assert pool.held(a.pool) == 0
    assert pool.held_pools() == set()
    assert pool.free_capacity(a.pool) == 5


def test_free_capacity_unknown_and_absent() -> None:
    a = offer(capacity=None)
    pool = pool_of([a])
    pool.hold(a.pool, 3)
    assert pool.free_capacity(a.pool) is None
    assert pool.free_capacity(key("us-east-1z")) == 0


def test_holdings_survive_a_new_poll() -> None:
    a = offer(capacity=5)
    pool = pool_of([a])
    pool.hold(a.pool, 2)
    pool.replace(SLICE, [replace(a, capacity=3)])
    assert pool.free_capacity(a.pool) == 1


def test_cool_down_expires() -> None:
    clock = Clock()
    a, b = offer("us-east-1a"), offer("us-east-1b")
    pool = pool_of([a, b], clock=clock)
    pool.cool_down(a.pool, 60)
    assert a.pool in pool.cooling(clock.now)
    assert b.pool not in pool.cooling(clock.now)
    assert a.pool in pool.cooling(clock.advance(59))
    assert a.pool not in pool.cooling(clock.advance(1))
    assert a.pool not in pool.cooling(clock.now)


def test_a_later_cool_down_extends_it() -> None:
    clock = Clock()
    a = offer()
    pool = pool_of([a], clock=clock)
    pool.cool_down(a.pool, 60)
    clock.advance(50)
    pool.cool_down(a.pool, 60)
    assert a.pool in pool.cooling(clock.advance(20))


def test_pool_keys_of_each_market_are_distinct() -> None:
    spot = offer(market=Market.SPOT, price=10.0)
    od = offer(market=Market.ON_DEMAND, price=20.0)
    pool = pool_of([spot, od])
    assert len(pool) == 2
    assert [o.pool.market for o in pool.by_gpu("H100-80GB")] == [Market.SPOT, Market.ON_DEMAND]


def test_a_new_reading_of_the_same_state_is_not_a_change() -> None:
    """AWS stamps every spot price with the time it was read: a poll that reads the same
    price again changes nothing, but the pool keeps the newer reading."""
    clock = Clock()
    first = offer("us-east-1a", price=24.0)
    pool = pool_of([first], clock=clock)
    assert pool.by_gpu("H100-80GB") == [first]
    again = replace(first, observed_at=clock.advance(60))
    change = pool.replace(SLICE, [again])
    assert change.updated == {} and change.removed == {}
    assert pool.get(first.pool) is again
    assert pool.by_gpu("H100-80GB")[0] is again
    assert pool.by_gpu("H100-80GB", Market.SPOT)[0] is again
    dearer = replace(again, price_per_hour=30.0, observed_at=clock.advance(60))
    assert pool.replace(SLICE, [dearer]).updated == {first.pool: again}


def test_a_reading_is_the_same_state_unless_a_field_but_its_times_differs() -> None:
    """`same_state` compares every field of `Offer` but `observed_at` and
    `rate_observed_at`: one field changed at a time, each of the others makes a change."""
    import dataclasses
    from datetime import timedelta

    from broker.market.pool import same_state
    from broker.model import PoolKey

    base = offer("us-east-1a", price=24.0)
    other = {
        "pool": PoolKey("gcp", "us-central1", "us-central1-a", "a3-highgpu-8g", Market.SPOT),
        "gpu": "A100-80GB", "gpus": 4, "gpu_memory_gb": 40.0, "vcpus": 7, "memory_gb": 3.0,
        "price_per_hour": 25.0, "observed_at": base.observed_at + timedelta(seconds=5),
        "availability": 0.123, "capacity": 77, "interruption_rate": 0.321,
        "quota_headroom": 999, "gpu_known": not base.gpu_known, "quota_group": "q:other",
        "quota_units": 3, "targets": (("r-1", 2),), "draining": ("r-1",),
        "rate_observed_at": base.observed_at - timedelta(days=3)}
    fields = {f.name for f in dataclasses.fields(Offer)}
    assert set(other) == fields  # a new field of Offer: say here what changes it
    for name, value in other.items():
        assert getattr(base, name) != value, name
        changed = replace(base, **{name: value})
        assert same_state(base, changed) is (name in ("observed_at", "rate_observed_at")), name


def test_a_rate_source_republished_with_the_same_rate_is_not_a_change() -> None:
    """AWS republishes its advisor document every few months: the same rate with a newer
    `rate_observed_at` changes nothing, but the pool keeps the newer reading."""
    clock = Clock()
    first = replace(offer("us-east-1a", price=24.0), interruption_rate=1e-4,
                    rate_observed_at=clock.advance(0))
    pool = pool_of([first], clock=clock)
    again = replace(first, rate_observed_at=clock.advance(90 * 86400))
    change = pool.replace(SLICE, [again])
    assert change.updated == {} and change.removed == {}
    assert pool.get(first.pool) is again
    other = replace(again, interruption_rate=2e-4)
    assert pool.replace(SLICE, [other]).updated == {first.pool: again}


def test_offer_records_carry_rate_observed_at_and_old_records_still_read() -> None:
    """The leader shares its polls with the standbys as `Offer.to_record` lists: the
    rate's time is a trailing element, and a record written without it reads as None."""
    clock = Clock()
    o = replace(offer("us-east-1a", price=24.0), interruption_rate=1e-4,
                rate_observed_at=clock.advance(-86400))
    record = o.to_record()
    assert Offer.from_record(record) == o
    plain = replace(o, rate_observed_at=None)
    assert len(plain.to_record()) == len(record) - 1  # as written before the field
    assert Offer.from_record(record[:-1]) == plain
    assert "rate_observed_at" not in plain.to_json()


def test_a_slice_not_polled_yet_is_unknown_not_stale_during_the_start_up_grace() -> None:
    clock = Clock()
    pool = ResourcePool(stale_after_seconds=300, clock=clock)
    pool.mark_failed(("aws", "us-west-2"), "CloudUnavailable: first poll failed")
    assert pool.in_grace(clock())
    assert pool.stale_slices(clock()) == set()
    clock.advance(301)
    assert not pool.in_grace(clock())
    assert pool.stale_slices(clock()) == {("aws", "us-west-2")}


# --- what a placement snapshot borrows: the sorted lists and the holdings ---------------


def _targets(free: tuple[int, int]) -> tuple[Target, Target]:
    return Target("a", 2, free[0]), Target("b", 2, free[1])


_Op = tuple[str, int, int]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(("hold", "unhold", "poll")), st.integers(0, 2),
                          st.integers(0, 3)), max_size=25))
def test_the_holdings_lent_out_are_held_as_of_the_lending_and_the_new_ones_as_of_now(
        ops: list[_Op]) -> None:
    # `held_now` is `held` of every pool, whatever happened since (a paid-for pool's
    # `held` reads its offer's targets: a poll changes it too, and it is not 0 when its
    # cloud counts some of it used, even with none held by the broker); what was lent
    # before (to a reader that `borrow`ed and has not returned it) stays as it was.
    spot = offer("us-east-1a", gpus=1, price=1.0, capacity=3)
    reserved = owned("us-east-1b", cloud="aws", region="us-east-1",
                     targets=_targets((2, 2)))
    keys = [spot.pool, reserved.pool, offer("us-east-1c", gpus=1, capacity=None).pool]
    pool = pool_of([spot, reserved])
    lent: list[tuple[object, dict[object, int]]] = []
    for op, which, n in ops:
        k = keys[which]
        if op == "hold":
            pool.hold(k, n, [("a", n)] if k == reserved.pool else ())
        elif op == "unhold":
            pool.unhold(k, n, [("a", n)] if k == reserved.pool else ())
        else:
            pool.replace(SLICE, [replace(spot, capacity=n),
                                 replace(reserved, targets=_targets((n % 3, 2)))][:1 + which % 2])
        pool.borrow()
        now = pool.held_now()
        assert dict(now) == {k: pool.held(k) for k in keys if pool.held(k)}
        lent.append((now, dict(now)))
    for now, then in lent:
        assert dict(now) == then  # type: ignore[call-overload]


def test_a_sorted_list_lent_out_is_not_changed_by_a_later_poll() -> None:
    a = offer("us-east-1a", gpus=1, price=1.0)
    b = offer("us-east-1b", gpus=1, price=2.0)
    pool = pool_of([a, b])
    mine = pool.lend("H100-80GB", Market.SPOT)
    assert list(mine) == [a, b]
    c = offer("us-east-1c", gpus=1, price=1.5)
    pool.replace(SLICE, [replace(a, price_per_hour=3.0), b, c])
    assert list(mine) == [a, b]
    assert [o.pool.zone for o in pool.by_gpu("H100-80GB", Market.SPOT)] == \
        ["us-east-1c", "us-east-1b", "us-east-1a"]
    assert [o.pool.zone for o in pool.by_gpu("H100-80GB")] == \
        ["us-east-1c", "us-east-1b", "us-east-1a"]


def test_what_was_lent_is_changed_in_place_once_every_reader_returned_it() -> None:
    """A list by GPU and the holdings lent to readers in worker threads are copied
    before a change while any of them is out, and changed in place once all are
    returned: a copy of thousands of offers per change, walked by every young
    collection, for lists no thread reads any more."""
    a = offer("us-east-1a", gpus=1, price=1.0, capacity=4)
    b = offer("us-east-1b", gpus=1, price=2.0, capacity=4)
    pool = pool_of([a, b])
    gpu = a.gpu
    pool.borrow()
    first, held = pool.lend(gpu, Market.SPOT), pool.held_now()
    pool.borrow()
    second = pool.lend(gpu, Market.SPOT)
    pool.return_loan()  # one reader done, the other still reading
    pool.replace(SLICE, [replace(a, price_per_hour=3.0), b])
    pool.hold(a.pool, 1)
    assert list(first) == list(second) == [a, b] and dict(held) == {}
    pool.return_loan()  # both done
    # Read on the event loop, nothing lent: changed in place.
    mine, now = pool.by_gpu(gpu, Market.SPOT), pool.held_now()
    pool.replace(SLICE, [a, b])
    pool.hold(b.pool, 2)
    assert pool.by_gpu(gpu, Market.SPOT) is mine and list(mine) == [a, b]
    assert pool.held_now() is now and dict(now) == {a.pool: 1, b.pool: 2}
    # Lent again: copied first again.
    pool.borrow()
    lent, held = pool.lend(gpu, Market.SPOT), pool.held_now()
    pool.replace(SLICE, [replace(a, price_per_hour=3.0), b])
    pool.unhold(b.pool, 2)
    assert list(lent) == [a, b] and pool.by_gpu(gpu, Market.SPOT) is not lent
    assert dict(held) == {a.pool: 1, b.pool: 2} and pool.held_now() is not held


def _census_by_reading_every_offer(pool: ResourcePool) -> tuple[dict[object, int],
                                                                 dict[object, float]]:
    counts: dict[object, int] = {}
    cheapest: dict[object, float] = {}
    for o in pool:
        counts[(o.pool.cloud, o.pool.market)] = counts.get((o.pool.cloud, o.pool.market), 0) + 1
        ppg = o.price_per_gpu_hour
        if ppg is not None and o.gpu_known:
            where = (o.pool.cloud, o.gpu, o.pool.market)
            cheapest[where] = min(ppg, cheapest.get(where, math.inf))
    return counts, cheapest


_CENSUS_OFFER = st.builds(
    lambda zone, cloud, market, gpu, gpus, price, known: replace(
        offer(zone, cloud=cloud, market=market, gpu=gpu, gpus=gpus, price=price),
        gpu_known=known),
    st.sampled_from(("a", "b", "c")), st.sampled_from(("aws", "gcp", "azure")),
    st.sampled_from((Market.SPOT, Market.ON_DEMAND)), st.sampled_from(("H100-80GB", "L4")),
    st.sampled_from((0, 1, 8)), st.one_of(st.none(), st.floats(0.5, 50.0)), st.booleans())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from((("aws", "r1"), ("aws", "r2"), ("gcp", "r1"))),
                          st.lists(_CENSUS_OFFER, max_size=6)), max_size=12))
def test_the_census_is_what_reading_every_offer_gives(
        polls: list[tuple[tuple[str, str], list[Offer]]]) -> None:
    """`census` (offers per cloud and market, the cheapest per GPU-hour per cloud, model
    and market, kept as polls change the pool) against reading every offer, after each
    poll: offers that come, go, change model or price, lose their price, or move to
    another slice; models the adapter could not name; instances of 0 GPUs."""
    pool = ResourcePool(stale_after_seconds=300, clock=Clock())
    for slice_id, offers in polls:
        pool.by_gpu("H100-80GB", Market.SPOT)  # a sorted list kept from the start
        pool.replace(slice_id, offers)
        assert pool.census() == _census_by_reading_every_offer(pool)


_SAME_PRICE_OFFER = st.builds(
    lambda zone, market, gpu, gpus, price, capacity, known: replace(offer(
        zone, market=market, gpu=gpu, gpus=gpus, price=price, capacity=capacity),
        gpu_known=known),
    st.sampled_from(("a", "b", "c")), st.sampled_from((Market.SPOT, Market.ON_DEMAND)),
    st.sampled_from(("H100-80GB", "L4")), st.sampled_from((0, 1, 8)),
    st.sampled_from((None, 1.0, 2.0, 8.0)), st.sampled_from((None, 0, 3)), st.booleans())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(_SAME_PRICE_OFFER, max_size=6), max_size=12))
def test_the_sorted_lists_hold_the_newest_readings_in_price_order(
        polls: list[list[Offer]]) -> None:
    """A new reading at the same price per GPU takes the old one's place in the lists
    by GPU (not taken out and put back); every other change moves it. After each poll,
    each list is the pool's priced offers of its model (and market), newest readings,
    cheapest per GPU-hour first; and the census is what reading every offer gives."""
    pool = ResourcePool(stale_after_seconds=300, clock=Clock())
    wheres = [(g, m) for g in ("H100-80GB", "L4") for m in (None, *Market)]
    for offers in polls:
        for gpu, market in wheres:
            pool.by_gpu(gpu, market)  # every list kept from the start
        pool.replace(SLICE, offers)
        for gpu, market in wheres:
            want = sorted((o for o in pool if o.gpu == gpu and o.price_per_hour is not None
                           and o.gpus > 0 and market in (None, o.pool.market)),
                          key=lambda o: (o.price_per_hour / o.gpus, o.pool))
            got = list(pool.by_gpu(gpu, market))
            assert got == want
            assert all(o is pool.get(o.pool) for o in got)  # the newest reading
        assert pool.census() == _census_by_reading_every_offer(pool)
