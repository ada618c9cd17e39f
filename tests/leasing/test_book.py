"""Tests of the lease book (`broker/leasing/book.py`)."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import timedelta

import pytest
from factories import T0, offer, placement, request

from broker.leasing.book import LeaseBook, LeaseError
from broker.model import Lease, LeaseState, Market, Placement
from broker.state.schema import lease_from, lease_row

A = placement(offer("us-east-1a"))
B = placement(offer("us-east-1b"))
C = placement(offer("us-east-1c"))


def secs(n: float) -> timedelta:
    return timedelta(seconds=n)


def new(book: LeaseBook, request_id: str = "r1", *, scheduler: str = "sched-a",
        where: Placement = A, lease_seconds: int = 60, at: float = 0,
        cap: float | None = 4.0) -> Lease:
    return book.create(request(request_id, scheduler=scheduler), where,
                       lease_seconds=lease_seconds, cap=cap, now=T0 + secs(at))


# --- create ------------------------------------------------------------------------------


def test_create_starts_active_at_epoch_one() -> None:
    book = LeaseBook()
    lease = new(book, lease_seconds=90, cap=3.5)
    assert lease.state is LeaseState.ACTIVE
    assert lease.epoch == 1
    assert lease.placement == A
    assert (lease.scheduler, lease.request_id) == ("sched-a", "r1")
    assert lease.request == request("r1", scheduler="sched-a")
    assert lease.created_at == lease.updated_at == T0
    assert lease.expires_at == T0 + secs(90)
    assert lease.lease_seconds == 90
    assert lease.max_price_per_gpu_hour == 3.5
    assert lease.lease_id.startswith("L-")
    assert book.get(lease.lease_id) == lease
    assert book.active() == [lease]


def test_lease_ids_are_unique() -> None:
    book = LeaseBook()
    ids = {new(book, f"r{i}").lease_id for i in range(50)}
    assert len(ids) == 50


def test_a_request_id_gets_one_lease_per_scheduler() -> None:
    book = LeaseBook()
    lease = new(book, "r1", scheduler="sched-a")
    with pytest.raises(LeaseError, match="r1"):
        new(book, "r1", scheduler="sched-a")
    other = new(book, "r1", scheduler="sched-b")  # another scheduler's own r1
    assert other.lease_id != lease.lease_id
    assert book.find("sched-a", "r1") == lease
    assert book.find("sched-b", "r1") == other
    assert book.find("sched-c", "r1") is None
    assert book.find("sched-a", "r2") is None


def test_an_ended_request_still_answers_with_its_lease() -> None:
    book = LeaseBook()
    lease = new(book)
    ended = book.end(lease.lease_id, LeaseState.RELEASED, T0 + secs(5))
    assert book.find("sched-a", "r1") == ended
    with pytest.raises(LeaseError):
        new(book, "r1")


# --- renew -------------------------------------------------------------------------------


def test_renew_pushes_expiry_out_from_now() -> None:
    book = LeaseBook()
    lease = new(book, lease_seconds=60)
    renewed = book.renew(lease.lease_id, "sched-a", T0 + secs(45))
    assert renewed.expires_at == T0 + secs(105)
    assert renewed.updated_at == T0 + secs(45)
    assert renewed.epoch == 1
    assert renewed.state is LeaseState.ACTIVE
    assert book.get(lease.lease_id) == renewed
    assert book.next_expiry() == T0 + secs(105)


def test_renewed_lease_is_not_due_at_its_old_expiry() -> None:
    book = LeaseBook()
    lease = new(book, lease_seconds=60)
    book.renew(lease.lease_id, "sched-a", T0 + secs(30))
    assert book.due(T0 + secs(61)) == []
    assert [le.lease_id for le in book.due(T0 + secs(90))] == [lease.lease_id]


def test_renew_of_unknown_lease_fails() -> None:
    with pytest.raises(LeaseError, match="no lease"):
        LeaseBook().renew("L-nope", "sched-a", T0)


def test_renew_of_another_schedulers_lease_fails_and_changes_nothing() -> None:
    book = LeaseBook()
    lease = new(book, scheduler="sched-a")
    with pytest.raises(LeaseError, match="no lease"):
        book.renew(lease.lease_id, "sched-b", T0 + secs(30))
    with pytest.raises(LeaseError):
        book.end(lease.lease_id, LeaseState.RELEASED, T0, scheduler="sched-b")
    assert book.get(lease.lease_id) == lease


@pytest.mark.parametrize("final", [LeaseState.RELEASED, LeaseState.EXPIRED, LeaseState.FAILED])
def test_ended_leases_are_final(final: LeaseState) -> None:
    book = LeaseBook()
    lease = new(book)
    ended = book.end(lease.lease_id, final, T0 + secs(1), scheduler="sched-a")
    assert ended.state is final
    assert ended.updated_at == T0 + secs(1)
    with pytest.raises(LeaseError, match=final.value):
        book.renew(lease.lease_id, "sched-a", T0 + secs(2))
    with pytest.raises(LeaseError):
        book.failover(lease.lease_id, B, T0 + secs(2))
    with pytest.raises(LeaseError):
        book.end(lease.lease_id, LeaseState.RELEASED, T0 + secs(2))
    assert book.get(lease.lease_id) == ended
    assert book.active() == []


def test_end_needs_a_final_state() -> None:
    book = LeaseBook()
    lease = new(book)
    with pytest.raises(ValueError, match="final"):
        book.end(lease.lease_id, LeaseState.ACTIVE, T0)


# --- failover ----------------------------------------------------------------------------


def test_failover_moves_the_lease_and_increments_the_epoch() -> None:
    book = LeaseBook()
    lease = new(book, lease_seconds=60)
    moved = book.failover(lease.lease_id, B, T0 + secs(10))
    assert (moved.placement, moved.epoch) == (B, 2)
    assert moved.expires_at == lease.expires_at  # the TTL is the scheduler's business
    assert moved.updated_at == T0 + secs(10)
    again = book.failover(lease.lease_id, C, T0 + secs(20))
    assert again.epoch == 3
    assert book.renew(lease.lease_id, "sched-a", T0 + secs(30)).epoch == 3


def test_on_pool_and_leased_pools_follow_failover_and_end() -> None:
    book = LeaseBook()
    one = new(book, "r1", where=A)
    two = new(book, "r2", where=A)
    assert {le.lease_id for le in book.on_pool(A.pool)} == {one.lease_id, two.lease_id}
    assert book.leased_pools() == {A.pool}
    book.failover(one.lease_id, B, T0)
    assert [le.lease_id for le in book.on_pool(A.pool)] == [two.lease_id]
    assert [le.epoch for le in book.on_pool(B.pool)] == [2]
    assert book.leased_pools() == {A.pool, B.pool}
    book.end(two.lease_id, LeaseState.RELEASED, T0)
    assert book.on_pool(A.pool) == []
    assert book.leased_pools() == {B.pool}
    book.end(one.lease_id, LeaseState.FAILED, T0)
    assert book.leased_pools() == set()
    assert book.on_pool(B.pool) == []


# --- expiry ------------------------------------------------------------------------------


def test_due_returns_expired_leases_in_expiry_order() -> None:
    book = LeaseBook()
    late = new(book, "late", lease_seconds=300)
    early = new(book, "early", lease_seconds=60)
    mid = new(book, "mid", lease_seconds=120)
    assert book.next_expiry() == T0 + secs(60)
    assert book.due(T0 + secs(59)) == []
    assert book.due(T0 + secs(200)) == [early, mid]
    assert book.next_expiry() == T0 + secs(300)
    assert book.due(T0 + secs(300)) == [late]  # due at exactly expires_at
    assert book.next_expiry() is None


def test_due_leaves_out_ended_leases() -> None:
    book = LeaseBook()
    gone = new(book, "gone", lease_seconds=60)
    kept = new(book, "kept", lease_seconds=60, at=1)
    book.end(gone.lease_id, LeaseState.RELEASED, T0 + secs(10))
    assert book.next_expiry() == T0 + secs(61)
    assert book.due(T0 + secs(100)) == [kept]


def test_due_does_not_return_a_lease_twice() -> None:
    book = LeaseBook()
    new(book, lease_seconds=60)
    assert len(book.due(T0 + secs(61))) == 1
    assert book.due(T0 + secs(62)) == []


def test_next_expiry_of_an_empty_book() -> None:
    assert LeaseBook().next_expiry() is None
    assert LeaseBook().due(T0) == []


def test_load_rebuilds_the_indexes() -> None:
    first = LeaseBook()
    live = new(first, "live", lease_seconds=60)
    moved = first.failover(new(first, "moved", lease_seconds=120).lease_id, B, T0)
    done = first.end(new(first, "done").lease_id, LeaseState.EXPIRED, T0 + secs(60))
    book = LeaseBook()
    book.load([live, moved, done])
    assert book.find("sched-a", "done") == done
    assert book.leased_pools() == {A.pool, B.pool}
    assert book.on_pool(B.pool) == [moved]
    assert book.due(T0 + secs(1000)) == [live, moved]


# --- ended leases: the recent ones in memory, the rest in the store -------------------


def test_an_ended_lease_leaves_memory_once_settled_beyond_the_recent_ones() -> None:
    book = LeaseBook(keep_recent=2)
    first, second, third = (new(book, f"r{i}") for i in range(3))
    active = new(book, "active")
    ended = [book.end(le.lease_id, LeaseState.RELEASED, T0 + secs(i))
             for i, le in enumerate((first, second, third))]
    # Until the change is committed (`settle`), every lease it ended stays.
    assert [book.get(le.lease_id) for le in ended] == ended
    assert book.ended_in_memory == 3
    assert book.settle() == 1
    assert book.get(first.lease_id) is None and book.find("sched-a", "r0") is None
    assert book.find("sched-a", "r1") == ended[1] and book.find("sched-a", "r2") == ended[2]
    assert book.active() == [active] and book.ended_in_memory == 2
    assert book.all() == [active, ended[1], ended[2]]
    assert book.settle() == 0


def test_without_recent_ones_an_ended_lease_leaves_at_once() -> None:
    book = LeaseBook(keep_recent=0)
    lease = new(book)
    ended = book.end(lease.lease_id, LeaseState.EXPIRED, T0 + secs(60))
    assert book.get(lease.lease_id) == ended  # the batch that ended it finds it
    book.settle()
    assert book.get(lease.lease_id) is None and book.find("sched-a", "r1") is None
    assert book.all() == [] and book.leased_pools() == set()
    with pytest.raises(LeaseError, match="no lease"):
        book.renew(lease.lease_id, "sched-a", T0)


def test_ended_leases_in_memory_are_bounded_under_churn() -> None:
    book = LeaseBook(keep_recent=100)
    for i in range(5000):
        lease = new(book, f"r{i}", at=i)
        book.end(lease.lease_id, LeaseState.RELEASED, T0 + secs(i + 1))
        book.settle()
    assert book.ended_in_memory == 100
    assert sum(len(ids) for ids in book._by_request.values()) == 100
    assert book.find("sched-a", "r4999") is not None and book.find("sched-a", "r4899") is None


def test_load_keeps_the_active_leases_and_only_the_recent_ended_ones() -> None:
    first = LeaseBook()
    live = new(first, "live")
    done = [first.end(new(first, f"done{i}").lease_id, LeaseState.RELEASED, T0)
            for i in range(3)]
    book = LeaseBook(keep_recent=1)
    book.load([live, *done])
    assert book.active() == [live]
    assert book.all() == [live, done[2]]


def test_remember_brings_back_an_ended_lease_without_overwriting() -> None:
    book = LeaseBook(keep_recent=0)
    lease = new(book)
    ended = book.end(lease.lease_id, LeaseState.RELEASED, T0)
    book.settle()
    assert book.find("sched-a", "r1") is None
    book.remember(ended)
    assert book.find("sched-a", "r1") == ended
    assert book.leased_pools() == set()
    book.remember(replace(ended, epoch=99))
    assert book.get(lease.lease_id) == ended
    book.settle()  # remembered, it leaves again in its turn
    assert book.get(lease.lease_id) is None


def test_remember_keeps_the_books_lease_over_the_stores() -> None:
    """Within a change the book is ahead of the store: what it holds stays."""
    book = LeaseBook()
    lease = new(book)
    ended = book.end(lease.lease_id, LeaseState.RELEASED, T0 + secs(30))
    book.remember(lease)  # the store has it active until the change is committed
    assert book.get(lease.lease_id) == ended and book.active() == []


# --- nothing grows without bound -----------------------------------------------------------


def test_renewals_do_not_grow_the_expiry_heap() -> None:
    book = LeaseBook()
    leases = [new(book, f"r{i}") for i in range(10)]
    for n in range(1, 1001):
        for lease in leases:
            book.renew(lease.lease_id, "sched-a", T0 + secs(n))
    assert len(book._expiry) <= 2 * 10 + 64
    assert book.next_expiry() == T0 + secs(1000 + 60)
    assert book.due(T0 + secs(1000 + 59)) == []
    assert {le.lease_id for le in book.due(T0 + secs(1000 + 60))} == \
        {le.lease_id for le in leases}


def test_a_team_that_holds_nothing_is_forgotten() -> None:
    # Team names come from the requests: a tally per name ever seen would only grow.
    book = LeaseBook()
    for i in range(1000):
        lease = book.create(request(f"r{i}", team=f"team-{i}"), A, lease_seconds=60,
                            cap=None, now=T0)
        book.end(lease.lease_id, LeaseState.RELEASED, T0)
    held = book.create(request("held", team="research"), A, lease_seconds=60, cap=None,
                       now=T0)
    assert list(book._teams) == ["research"]
    assert book.team_usage("research").gpus == held.placement.total_gpus
    assert book.team_usage("team-1").gpus == 0


def test_a_pool_holds_one_lease_then_several_then_one_again() -> None:
    book = LeaseBook()
    one = new(book, "r1")
    assert [le.lease_id for le in book.on_pool(A.pool)] == [one.lease_id]
    book.renew(one.lease_id, "sched-a", T0 + secs(1))  # put again: still one
    assert [le.lease_id for le in book.on_pool(A.pool)] == [one.lease_id]
    two = new(book, "r2")
    assert {le.lease_id for le in book.on_pool(A.pool)} == {one.lease_id, two.lease_id}
    book.end(one.lease_id, LeaseState.RELEASED, T0 + secs(2))
    assert [le.lease_id for le in book.on_pool(A.pool)] == [two.lease_id]
    three = new(book, "r3")
    assert {le.lease_id for le in book.on_pool(A.pool)} == {two.lease_id, three.lease_id}
    book.failover(two.lease_id, B, T0 + secs(3))
    book.end(three.lease_id, LeaseState.RELEASED, T0 + secs(3))
    assert book.on_pool(A.pool) == []
    assert book.leased_pools() == {B.pool}


def test_load_shares_what_leases_read_back_from_the_store_repeat() -> None:
    """Leases read back from their stored form each have their own pool key, GPU name
    and price time; loaded, leases on one pool share them, and equal what was stored."""
    first = LeaseBook()
    made = [new(first, f"r{i}", where=A if i % 2 else B) for i in range(4)]
    read = [lease_from(json.loads(lease_row(le, 1)[5])) for le in made]
    assert read == made
    assert read[1].placement.pool is not read[3].placement.pool
    book = LeaseBook()
    book.load(read)
    got = sorted(book.active(), key=lambda le: le.request_id)
    assert got == made
    on_a = [le.placement for le in got if le.placement.pool == A.pool]
    assert len(on_a) == 2
    assert on_a[0].pool is on_a[1].pool
    assert on_a[0].gpu is on_a[1].gpu
    assert on_a[0].price_observed_at is on_a[1].price_observed_at
    assert {le.lease_id for le in book.on_pool(A.pool)} == {made[1].lease_id, made[3].lease_id}



def test_the_active_leases_per_market_are_kept_as_they_change() -> None:
    """`active_by_market` (the metrics' count) against counting the active leases, as
    leases are placed, failed over to another market, ended and loaded."""
    book = LeaseBook()
    on_demand = placement(offer("us-east-1b", market="on_demand"))

    def counted(b: LeaseBook) -> dict[Market, int]:
        got = dict.fromkeys(Market, 0)
        for lease in b.active():
            got[lease.placement.pool.market] += 1
        return got

    a = new(book, "a")
    b = new(book, "b", where=on_demand)
    assert book.active_by_market() == counted(book) == {
        Market.SPOT: 1, Market.ON_DEMAND: 1, Market.RESERVED: 0}
    book.failover(a.lease_id, on_demand, T0 + secs(1))
    assert book.active_by_market() == counted(book)
    book.end(b.lease_id, LeaseState.RELEASED, T0 + secs(2))
    assert book.active_by_market() == counted(book) == {
        Market.SPOT: 0, Market.ON_DEMAND: 1, Market.RESERVED: 0}
    assert book.active_count == 1
    again = LeaseBook()
    again.load(book.all())
    assert again.active_by_market() == book.active_by_market()
