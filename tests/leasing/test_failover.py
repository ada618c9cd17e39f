"""Tests of the failover triggers (`broker/leasing/failover.py`), on a real pool and lease book."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from factories import SLICE, T0, Clock, key, offer, placement, pool_of, request

from broker.leasing import failover
from broker.leasing.book import LeaseBook
from broker.leasing.failover import Trigger, from_pool_change, from_signal
from broker.model import (
    CapacitySignal,
    FailoverReason,
    Lease,
    LeaseState,
    Offer,
    PoolKey,
    SignalKind,
)
from policies.loader import parse_policy

LEASED = offer("us-east-1a", price=24.0)  # 3.0 per GPU-hour
OTHER = offer("us-east-1b", price=24.0)


def book_with(*caps: float | None, where: Offer = LEASED) -> tuple[LeaseBook, list[Lease]]:
    book = LeaseBook()
    leases = [book.create(request(f"r{i}"), placement(where, 1),
                          lease_seconds=900, cap=cap, now=T0)
              for i, cap in enumerate(caps)]
    return book, leases


def signal(kind: SignalKind, pool: PoolKey = LEASED.pool, detail: str = "") -> CapacitySignal:
    return CapacitySignal(pool, kind, T0, detail)


# --- signals -----------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "reason"), [
    (SignalKind.INTERRUPTED, FailoverReason.INTERRUPTED),
    (SignalKind.CAPACITY_LOST, FailoverReason.CAPACITY_LOST),
])
def test_signal_moves_every_lease_on_that_pool(kind: SignalKind,
                                               reason: FailoverReason) -> None:
    book, (a, b) = book_with(None, 4.0)
    book.failover(b.lease_id, placement(LEASED, 1), T0)  # b is now at epoch 2
    triggers = from_signal(signal(kind, detail="spot reclaimed"), book)
    assert sorted(triggers, key=lambda t: t.epoch) == [
        Trigger(a.lease_id, 1, reason, "spot reclaimed", cool_down=True, received_at=T0),
        Trigger(b.lease_id, 2, reason, "spot reclaimed", cool_down=True, received_at=T0),
    ]


def test_signal_without_detail_gets_one() -> None:
    book, _ = book_with(None)
    [t] = from_signal(signal(SignalKind.INTERRUPTED), book)
    assert "interrupted" in t.detail


def test_rebalance_is_not_a_failover() -> None:
    book, _ = book_with(None)
    assert from_signal(signal(SignalKind.REBALANCE), book) == []


def test_signal_for_another_pool_moves_nothing() -> None:
    book, _ = book_with(None)
    assert from_signal(signal(SignalKind.INTERRUPTED, OTHER.pool), book) == []


def test_signal_ignores_ended_leases() -> None:
    book, (a, b) = book_with(None, None)
    book.end(a.lease_id, LeaseState.RELEASED, T0)
    assert [t.lease_id for t in from_signal(signal(SignalKind.INTERRUPTED), book)] == [
        b.lease_id]


# --- pool changes ------------------------------------------------------------------------


def test_removed_leased_pool_is_capacity_lost() -> None:
    pool = pool_of([LEASED, OTHER])
    book, (a,) = book_with(None)
    change = pool.replace(SLICE, [OTHER])
    [t] = from_pool_change(change, book)
    assert (t.lease_id, t.epoch, t.reason, t.cool_down) == (
        a.lease_id, 1, FailoverReason.CAPACITY_LOST, True)
    assert "no longer offered" in t.detail


def test_availability_zero_is_capacity_lost() -> None:
    pool = pool_of([LEASED])
    book, (a,) = book_with(5.0)
    change = pool.replace(SLICE, [replace(LEASED, availability=0.0, capacity=0)])
    [t] = from_pool_change(change, book)
    assert (t.lease_id, t.reason, t.cool_down) == (a.lease_id, FailoverReason.CAPACITY_LOST,
                                                   True)
    assert "availability 0" in t.detail


def test_low_but_nonzero_availability_is_no_trigger() -> None:
    pool = pool_of([LEASED])
    book, _ = book_with(None)
    assert from_pool_change(pool.replace(SLICE, [replace(LEASED, availability=0.05)]),
                            book) == []


def test_unknown_availability_is_no_trigger() -> None:
    pool = pool_of([LEASED])
    book, _ = book_with(None)
    assert from_pool_change(pool.replace(SLICE, [replace(LEASED, availability=None)]),
                            book) == []


def test_price_above_a_leases_cap_moves_only_that_lease() -> None:
    pool = pool_of([LEASED])
    book, (low_cap, _, _) = book_with(3.5, 5.0, None)
    change = pool.replace(SLICE, [replace(LEASED, price_per_hour=32.0)])  # 4.0 per GPU-hour
    [t] = from_pool_change(change, book)
    assert (t.lease_id, t.epoch, t.reason) == (low_cap.lease_id, 1,
                                               FailoverReason.PRICE_ABOVE_CAP)
    assert t.cool_down is False  # a dearer pool is not a broken one
    assert "$4/GPU-h" in t.detail and "$3.5/GPU-h" in t.detail


def test_price_up_to_the_cap_is_no_trigger() -> None:
    pool = pool_of([LEASED])
    book, _ = book_with(4.0)
    assert from_pool_change(pool.replace(SLICE, [replace(LEASED, price_per_hour=32.0)]),
                            book) == []
    assert from_pool_change(pool.replace(SLICE, [replace(LEASED, price_per_hour=30.0)]),
                            book) == []


def test_price_disappearing_is_no_trigger() -> None:
    pool = pool_of([LEASED])
    book, _ = book_with(3.5)
    assert from_pool_change(pool.replace(SLICE, [replace(LEASED, price_per_hour=None)]),
                            book) == []


def test_changes_on_unleased_pools_are_no_trigger() -> None:
    pool = pool_of([LEASED, OTHER])
    book, _ = book_with(3.5)
    change = pool.replace(SLICE, [LEASED, replace(OTHER, price_per_hour=99.0,
                                                  availability=0.0)])
    assert from_pool_change(change, book) == []
    assert from_pool_change(pool.replace(SLICE, [LEASED]), book) == []  # OTHER removed


def test_unchanged_leased_pool_is_no_trigger() -> None:
    # a lease decided over its cap long ago is not moved again until the offer changes
    pool = pool_of([replace(LEASED, price_per_hour=32.0)])
    book, _ = book_with(3.5)
    assert from_pool_change(pool.replace(SLICE, [replace(LEASED, price_per_hour=32.0)]),
                            book) == []


def test_a_rereading_of_a_pool_over_the_cap_is_no_new_trigger() -> None:
    """A lease over its cap is moved once; polls that read the same price again (with a
    new observed_at, as AWS stamps them) do not ask for the move again."""
    clock = Clock()
    over = replace(LEASED, price_per_hour=32.0)
    pool = pool_of([LEASED], clock=clock)
    book, _ = book_with(3.5)
    [t] = from_pool_change(pool.replace(SLICE, [over]), book)
    assert t.reason is FailoverReason.PRICE_ABOVE_CAP
    for _ in range(3):
        reread = replace(over, observed_at=clock.advance(60))
        assert from_pool_change(pool.replace(SLICE, [reread]), book) == []


def test_lease_that_failed_over_is_watched_on_its_new_pool() -> None:
    clock = Clock()
    pool = pool_of([LEASED, OTHER], clock=clock)
    book, (a,) = book_with(None)
    book.failover(a.lease_id, placement(OTHER, 1), T0)
    change = pool.replace(SLICE, [LEASED])
    [t] = from_pool_change(change, book)
    assert (t.lease_id, t.epoch, t.reason) == (a.lease_id, 2, FailoverReason.CAPACITY_LOST)
    book2, _ = book_with(None)
    book2.end(book2.active()[0].lease_id, LeaseState.RELEASED, T0)
    assert from_pool_change(pool.replace(SLICE, []), book2) == []


# --- the policy's ladder and anti-flap limits ------------------------------------------

def _ladder_policy(body: str) -> Any:
    from policies.loader import parse_policy

    return parse_policy("version: 1\n" + body)


def test_ladder_goes_step_by_step_and_skips_impossible_steps() -> None:
    from broker.model import Market
    from policies.evaluate import Constraints, evaluate

    p = _ladder_policy("failover:\n  ladder: [same_region_spot, other_region_spot, on_demand,"
                       " other_cloud]\n")
    c = evaluate(p, request())
    assert isinstance(c, Constraints)
    here = key("us-east-1a")
    steps = list(failover.ladder(c, here, p.failover))
    assert [(s.markets, s.clouds) for s in steps] == [
        ((Market.SPOT, Market.RESERVED), frozenset({"aws"})),
        ((Market.SPOT, Market.RESERVED), frozenset({"aws"})),
        ((Market.ON_DEMAND, Market.RESERVED), frozenset({"aws"})),
        ((Market.SPOT, Market.ON_DEMAND, Market.RESERVED), None)]
    assert steps[0].region_ok("aws", "us-east-1") and not steps[0].region_ok("aws", "us-west-2")
    assert steps[1].region_ok("aws", "us-west-2")
    assert not steps[3].region_ok("aws", "us-west-2") and steps[3].region_ok("gcp", "us-east1")
    # An on-demand-only request skips the spot steps.
    od = evaluate(p, request(market="on_demand"))
    assert isinstance(od, Constraints)
    assert [s.markets for s in failover.ladder(od, here, p.failover)] == [
        (Market.ON_DEMAND, Market.RESERVED), (Market.ON_DEMAND, Market.RESERVED)]


def test_replacement_takes_the_first_ladder_step_that_places() -> None:
    from broker.placement.optimizer import Decision

    p = _ladder_policy("failover:\n  ladder: [same_region_spot, on_demand, other_cloud]\n")
    leaving = offer("us-east-1a", price=10.0)
    same_region = offer("us-east-1b", price=40.0)  # dearer, but first on the ladder
    other_cloud = offer("europe-west4-a", cloud="gcp", region="europe-west4", price=5.0)
    pool = pool_of([leaving, same_region, other_cloud])
    lease = LeaseBook().create(request(), placement(leaving), lease_seconds=60, cap=None,
                               now=T0)
    out = failover.replacement(lease, pool, p, None, T0)
    assert isinstance(out, Decision) and out.placement.pool == same_region.pool
    flat = _ladder_policy("failover: {}\n")
    out = failover.replacement(lease, pool, flat, None, T0)
    assert isinstance(out, Decision) and out.placement.pool == other_cloud.pool


def test_anti_flap_holds_back_discretionary_moves_only() -> None:
    from datetime import timedelta

    from broker.model import FailoverReason

    p = _ladder_policy("failover:\n  min_lease_age_seconds: 600\n  max_failovers_per_hour: 2\n"
                       "  triggers: {cloud_unhealthy: false}\n")
    lease = LeaseBook().create(request(), placement(), lease_seconds=60, cap=None, now=T0)
    young = T0 + timedelta(seconds=60)
    price = failover.Trigger(lease.lease_id, 1, FailoverReason.PRICE_ABOVE_CAP, "x")
    lost = failover.Trigger(lease.lease_id, 1, FailoverReason.INTERRUPTED, "x")
    sick = failover.Trigger(lease.lease_id, 1, FailoverReason.CLOUD_UNHEALTHY, "x")
    assert "min_lease_age" in (failover.held_back(price, lease, p.failover, [], young) or "")
    assert failover.held_back(lost, lease, p.failover, [], young) is None
    assert "switched off" in (failover.held_back(sick, lease, p.failover, [], young) or "")
    old = T0 + timedelta(hours=2)
    recent = [old - timedelta(minutes=10), old - timedelta(minutes=20)]
    assert "max_failovers_per_hour" in (
        failover.held_back(price, lease, p.failover, recent, old) or "")
    assert failover.held_back(price, lease, p.failover, recent[:1], old) is None
    assert failover.held_back(lost, lease, p.failover, recent * 3, old) is None


def test_price_spike_ratio_triggers_under_the_cap() -> None:
    from broker.model import FailoverReason

    p = _ladder_policy("failover:\n  triggers: {price_spike_ratio: 1.5}\n")
    book = LeaseBook()
    o = offer(price=8.0)  # $1/GPU-h
    book.create(request(), placement(o), lease_seconds=60, cap=10.0, now=T0)
    pool = pool_of([o])
    change = pool.replace(SLICE, [offer(price=16.0)])  # $2/GPU-h: 2× but under the cap
    [t] = failover.from_pool_change(change, book, p.failover)
    assert t.reason is FailoverReason.PRICE_ABOVE_CAP and "1.5×" in t.detail
    change = pool.replace(SLICE, [offer(price=11.0)])
    assert failover.from_pool_change(change, book, p.failover) == []


# --- risk levels ---------------------------------------------------------------------------
# A spot pool often interrupted and a calm one a little dearer; the policy-wide level is
# balanced, two teams name the others: 20 × (1 + 0.5 × 0.3) + 8 × $c × 0.3 against
# 21 × (1 + 0.5 × 0.01) + 8 × $c × 0.01, c = $0 (balanced) or $5 (fewest-interruptions).
STORMY = offer("us-east-1a", price=20.0, interruption_rate=0.3)
CALM = offer("us-east-1b", price=21.0, interruption_rate=0.01)
RISK_TEAMS = """\
version: 1
teams:
  sweeps: {risk: lowest-cost}
  serving: {risk: fewest-interruptions}
failover:
  reoptimize_min_saving: 0.3
"""


@pytest.mark.parametrize(("team", "zone"), [
    ("sweeps", "us-east-1a"), ("serving", "us-east-1b"), (None, "us-east-1b")])
def test_a_replacement_is_chosen_at_the_requests_risk_level(team: str | None,
                                                           zone: str) -> None:
    from broker.placement.optimizer import Decision

    leaving = offer("us-east-1c", price=16.0)
    lease = LeaseBook().create(request(market="spot", team=team), placement(leaving),
                               lease_seconds=60, cap=None, now=T0)
    p = parse_policy(RISK_TEAMS)
    out = failover.replacement(lease, pool_of([leaving, STORMY, CALM]), p, None, T0)
    assert isinstance(out, Decision) and out.placement.pool.zone == zone


@pytest.mark.parametrize(("team", "now", "moves"), [
    ("serving", 35.0, True),   # 21.505: 39 % less at fewest-interruptions
    (None, 23.0, False),       # 21.105: 8 % less at balanced, under the 30 %
    ("sweeps", 20.0, False),   # 21: dearer at lowest-cost
])
def test_reoptimising_weighs_a_lease_at_its_risk_level(team: str | None, now: float,
                                                       moves: bool) -> None:
    p = parse_policy(RISK_TEAMS)
    pool = pool_of([STORMY, CALM])
    lease = LeaseBook().create(request(market="spot", team=team), placement(STORMY),
                               lease_seconds=60, cap=None, now=T0)
    assert failover.current_cost(lease, pool, p) == pytest.approx(now)
    triggers = failover.reoptimize([lease], pool, p, None, T0)
    assert bool(triggers) is moves
    if moves:
        assert "39%" in triggers[0].detail
