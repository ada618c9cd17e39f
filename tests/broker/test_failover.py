"""Tests of the failover triggers (`broker/failover.py`), on a real pool and lease book."""

from __future__ import annotations

from dataclasses import replace

import pytest
from factories import SLICE, T0, Clock, offer, placement, pool_of, request

from broker.failover import Trigger, from_pool_change, from_signal
from broker.leases import LeaseBook
from broker.model import (
    CapacitySignal,
    FailoverReason,
    Lease,
    LeaseState,
    Offer,
    PoolKey,
    SignalKind,
)

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
