"""Paid-for capacity (market `reserved`: cloud reservations and private servers) in the
pool, placement and failover: used first when it fits, each lease told which
reservation or server to launch into, teams held to their `private_share`, leases moved
off a server before its maintenance window."""

from __future__ import annotations

from datetime import timedelta

import pytest
from factories import T0, Clock, offer, owned, pool_of, request

from broker.leasing import failover
from broker.leasing.book import LeaseBook
from broker.market.pool import ResourcePool
from broker.model import FailoverReason, Lease, LeaseState, Market, Target
from broker.placement import optimizer
from broker.placement.optimizer import Ask, Decision, Rejection, solve
from policies.evaluate import Constraints, TeamUsage, evaluate
from policies.loader import parse_policy
from policies.model import Policy

POLICY = Policy()


def decided(out: optimizer.Outcome) -> Decision:
    assert isinstance(out, Decision), out
    return out


def place(pool: ResourcePool, *reqs: object, policy: Policy = POLICY) -> list[optimizer.Outcome]:
    asks = []
    for r in reqs:
        c = evaluate(policy, r, None, None, pool.owned_gpus)  # type: ignore[arg-type]
        assert isinstance(c, Constraints), c
        asks.append(Ask(r, constraints=c))  # type: ignore[arg-type]
    return solve(asks, pool, policy, now=T0).outcomes


# --- the pool: targets, room, idle ------------------------------------------------------


def test_a_placement_on_private_servers_names_each_server_once() -> None:
    pool = pool_of([owned(servers=3), offer(price=24.0)])
    first = pool.take(decided(place(pool, request("a", gpus=16))[0]).placement)
    assert first.pool.market is Market.RESERVED and first.price_per_hour == 0
    assert first.targets == (("s01", 1), ("s02", 1))
    second = pool.take(decided(place(pool, request("b", gpus=8))[0]).placement)
    assert second.targets == (("s03", 1),)
    assert pool.free_capacity(first.pool) == 0 and pool.idle_owned_gpus() == 0
    # Full: the next request goes to the cloud.
    third = decided(place(pool, request("c", gpus=8))[0]).placement
    assert third.pool.market is Market.SPOT and third.targets == ()
    pool.give_back(first)
    assert pool.free_capacity(first.pool) == 2 and pool.idle_owned_gpus() == 16
    assert pool.take(decided(place(pool, request("d", gpus=8))[0]).placement).targets == \
        (("s01", 1),)


def test_a_reservation_is_used_as_far_as_its_cloud_says_it_is_free() -> None:
    """cr-1 holds 4 instances, 2 run outside gpubroker; cr-2 holds 2, all free."""
    res = owned("us-east-1a", cloud="aws", region="us-east-1", instance_type="p5.48xlarge",
                targets=[Target("cr-1", 4, 2), Target("cr-2", 2, 2)])
    clock = Clock()
    pool = pool_of([res], clock=clock)
    assert pool.free_capacity(res.pool) == 4 and pool.owned_gpus == 48
    p = pool.take(decided(place(pool, request("a", gpus=24))[0]).placement)
    assert p.targets == (("cr-1", 2), ("cr-2", 1))
    # Not launched yet: the cloud's count still says 2 and 2 free; what the broker took
    # since comes off it.
    assert pool.free_capacity(res.pool) == 1
    # The next poll: the instances run, and the cloud's free counts now leave them out.
    clock.advance(60)
    pool.replace(("sim", "aws:us-east-1"), [owned(
        "us-east-1a", cloud="aws", region="us-east-1", instance_type="p5.48xlarge",
        targets=[Target("cr-1", 4, 0), Target("cr-2", 2, 1)])])
    assert pool.free_capacity(res.pool) == 1
    assert pool.take(decided(place(pool, request("b", gpus=8))[0]).placement).targets == \
        (("cr-2", 1),)
    assert pool.free_capacity(res.pool) == 0 and pool.idle_owned_gpus() == 0


def test_draining_servers_take_no_new_lease() -> None:
    pool = pool_of([owned(servers=["a", "b"], draining=["a"])])
    k = owned().pool
    assert pool.free_capacity(k) == 1 and pool.idle_owned_gpus() == 8
    assert pool.take(decided(place(pool, request("x", gpus=8))[0]).placement).targets == \
        (("b", 1),)
    assert isinstance(place(pool, request("y", gpus=8))[0], Rejection)


# --- placement and policy ---------------------------------------------------------------


def test_paid_for_capacity_first_then_the_burst_spills_to_the_cloud_in_one_batch() -> None:
    pool = pool_of([owned(servers=4), offer("us-east-1a", price=16.0, capacity=10),
                    offer("us-east-1b", market=Market.ON_DEMAND, price=98.0)])
    outs = place(pool, *(request(f"r{i}", gpus=8) for i in range(7)))
    markets = [decided(o).placement.pool.market for o in outs]
    assert markets.count(Market.RESERVED) == 4 and markets.count(Market.SPOT) == 3


@pytest.mark.parametrize("market, placed", [("spot", Market.RESERVED),
                                            ("on_demand", Market.RESERVED),
                                            ("reserved", Market.RESERVED),
                                            ("any", Market.RESERVED)])
def test_every_market_a_request_may_ask_for_takes_paid_for_capacity(
        market: str, placed: Market) -> None:
    pool = pool_of([owned(servers=1), offer(price=1.0),
                    offer("us-east-1b", market=Market.ON_DEMAND, price=2.0)])
    assert decided(place(pool, request(market=market))[0]).placement.pool.market is placed


def test_a_request_for_reserved_capacity_alone_is_not_placed_on_the_cloud() -> None:
    pool = pool_of([owned(servers=1), offer(price=1.0)])
    pool.take(decided(place(pool, request("a"))[0]).placement)
    assert isinstance(place(pool, request("b", market="reserved"))[0], Rejection)
    assert decided(place(pool, request("c", market="spot"))[0]).placement.pool.market is \
        Market.SPOT


def test_a_team_keeps_to_its_private_share() -> None:
    policy = parse_policy("version: 1\nteams:\n  ml:\n    private_share: 0.5\n")
    pool = pool_of([owned(servers=4), offer(price=16.0, capacity=10)])
    reqs = [request(f"r{i}", gpus=8, team="ml") for i in range(4)]
    outs = place(pool, *reqs, policy=policy)
    markets = [decided(o).placement.pool.market for o in outs]
    assert markets.count(Market.RESERVED) == 2, markets  # half of 4 servers
    # What the team holds already counts.
    usage = TeamUsage(gpus=16, owned_gpus=16)
    c = evaluate(policy, request("x", team="ml"), usage, None, pool.owned_gpus)
    assert isinstance(c, Constraints) and c.owned_left == 0
    [out] = solve([Ask(request("x", team="ml"), constraints=c)], pool, policy, now=T0).outcomes
    assert decided(out).placement.pool.market is Market.SPOT
    # Another team is not limited.
    other = place(pool, *(request(f"o{i}", gpus=8, team="web") for i in range(4)),
                  policy=policy)
    assert all(decided(o).placement.pool.market is Market.RESERVED for o in other)


def test_a_team_with_no_share_left_and_only_reserved_allowed_is_told_why() -> None:
    policy = parse_policy("version: 1\nteams:\n  ml:\n    private_share: 0.25\n")
    pool = pool_of([owned(servers=4)])
    outs = place(pool, *(request(f"r{i}", gpus=8, team="ml", market="reserved")
                         for i in range(2)), policy=policy)
    assert isinstance(outs[0], Decision)
    assert isinstance(outs[1], Rejection) and "private_share" in outs[1].detail


def test_free_capacity_costs_nothing_yet_an_unplaced_request_still_costs_something() -> None:
    """With every option at price 0, leaving a request unplaced must still cost more
    than placing it (the solver's penalty has a floor)."""
    pool = pool_of([owned(servers=8)])
    outs = place(pool, *(request(f"r{i}", gpus=8) for i in range(8)))
    assert all(isinstance(o, Decision) for o in outs)


# --- failover ---------------------------------------------------------------------------


def _leased(pool: ResourcePool, book: LeaseBook, rid: str, gpus: int = 8) -> Lease:
    d = decided(place(pool, request(rid, gpus=gpus))[0])
    return book.create(d.ask.request, pool.take(d.placement), lease_seconds=600, cap=None,
                       now=T0)


def test_a_server_entering_maintenance_moves_its_lease_with_reason_maintenance() -> None:
    clock = Clock()
    pool = pool_of([owned(servers=["a", "b", "c"]), offer(price=16.0)], clock=clock)
    book = LeaseBook()
    on_a, on_b = _leased(pool, book, "x"), _leased(pool, book, "y")
    assert on_a.placement.targets == (("a", 1),) and on_b.placement.targets == (("b", 1),)
    change = pool.replace(("sim", "aws:us-east-1"),
                          [owned(servers=["a", "b", "c"], draining=["a"]), offer(price=16.0)])
    [t] = failover.from_pool_change(change, book)
    assert (t.lease_id, t.reason) == (on_a.lease_id, FailoverReason.MAINTENANCE)
    step = failover.step(t, book=book, pool=pool, policy=POLICY, moves={}, now=T0,
                         find=lambda le: failover.replacement(le, pool, POLICY, None, T0))
    assert step.kind == "moved" and step.lease is not None
    # The free server c, not the cloud: paid-for capacity first.
    assert step.lease.placement.targets == (("c", 1),)
    assert pool.held_targets(on_a.placement.pool) == {"b": 1, "c": 1}


def test_a_lease_with_nowhere_to_go_stays_until_the_window_starts() -> None:
    pool = pool_of([owned(servers=["a"])])
    book = LeaseBook()
    lease = _leased(pool, book, "x")
    change = pool.replace(("sim", "aws:us-east-1"), [owned(servers=["a"], draining=["a"])])
    [t] = failover.from_pool_change(change, book)
    step = failover.step(t, book=book, pool=pool, policy=POLICY, moves={}, now=T0,
                         find=lambda le: failover.replacement(le, pool, POLICY, None, T0))
    assert step.kind == "stays" and pool.held_targets(lease.placement.pool) == {"a": 1}
    # The window starts: the server leaves the pool's targets; the lease has lost it.
    change = pool.replace(("sim", "aws:us-east-1"), [owned(servers=[])])
    [t] = failover.from_pool_change(change, book)
    assert t.reason is FailoverReason.CAPACITY_LOST and "a on" in t.detail
    step = failover.step(t, book=book, pool=pool, policy=POLICY, moves={}, now=T0,
                         find=lambda le: failover.replacement(le, pool, POLICY, None, T0))
    assert step.kind == "failed"
    assert pool.held_targets(lease.placement.pool) == {}


def test_a_server_that_goes_down_moves_only_the_lease_on_it() -> None:
    pool = pool_of([owned(servers=["a", "b"]), offer(price=16.0)])
    book = LeaseBook()
    on_a, _ = _leased(pool, book, "x"), _leased(pool, book, "y")
    change = pool.replace(("sim", "aws:us-east-1"), [owned(servers=["b"]), offer(price=16.0)])
    [t] = failover.from_pool_change(change, book)
    assert (t.lease_id, t.reason) == (on_a.lease_id, FailoverReason.CAPACITY_LOST)


def test_a_spot_lease_moves_to_freed_private_capacity_under_reoptimize_min_saving() -> None:
    policy = parse_policy("version: 1\nfailover:\n  reoptimize_min_saving: 0.3\n")
    clock = Clock()
    pool = pool_of([owned(servers=["a"]), offer(price=16.0)], clock=clock)
    book = LeaseBook()
    first, second = _leased(pool, book, "x"), _leased(pool, book, "y")
    assert second.placement.pool.market is Market.SPOT
    book.end(first.lease_id, LeaseState.RELEASED, T0 + timedelta(minutes=5))
    pool.give_back(first.placement)
    [t] = failover.reoptimize([second], pool, policy, None, T0)
    assert t.reason is FailoverReason.REOPTIMIZED
    step = failover.step(t, book=book, pool=pool, policy=policy, moves={}, now=T0,
                         find=lambda le: failover.replacement(le, pool, policy, None, T0))
    assert step.kind == "moved" and step.lease is not None
    assert step.lease.placement.targets == (("a", 1),)


def test_after_a_restart_the_held_servers_are_not_given_again() -> None:
    """The daemon holds each restored lease's targets again (`Broker.restore`)."""
    pool = pool_of([owned(servers=3)])
    book = LeaseBook()
    kept = _leased(pool, book, "x", gpus=16)
    fresh = pool_of([owned(servers=3)])  # the restarted daemon's pool, first poll
    fresh.hold(kept.placement.pool, kept.placement.instances, kept.placement.targets)
    assert fresh.free_capacity(kept.placement.pool) == 1
    got = fresh.take(decided(place(fresh, request("y"))[0]).placement)
    assert got.targets == (("s03", 1),)
