"""Batches through `broker.placement.optimizer.solve` on a real ResourcePool and real Policies: each
constraint shown binding by a case of its own, with the decision it forces and, when a
request is rejected, the code and a detail that names the constraint.

Offers come from `factories.offer`: availability 1 and no interruption risk unless a
test says otherwise, so an offer's expected cost per hour is `instances × price`.
"""

from __future__ import annotations

import gc
import math
import random
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from factories import SLICE, T0, offer, pool_of, request

from broker.market.pool import ResourcePool
from broker.model import Market, Offer, PlaceRequest, RejectCode
from broker.placement import solver
from broker.placement.arrays import Ranked
from broker.placement.optimizer import (
    Ask,
    BatchResult,
    BatchSettings,
    CandidateBuilder,
    Decision,
    Outcome,
    Rejection,
    solve,
)
from policies.evaluate import Denied, TeamUsage, evaluate
from policies.model import (
    Clouds,
    Gpus,
    Match,
    Policy,
    Regions,
    Require,
    Rule,
    Scoring,
    Team,
)

POLICY = Policy()
HEURISTIC = BatchSettings(exact_max_batch=0)
MILP = BatchSettings(exact_max_batch=1000, exact_time_limit=5)
BOTH = pytest.mark.parametrize("settings", [HEURISTIC, MILP], ids=["heuristic", "milp"])


def run(reqs: Sequence[PlaceRequest | Ask], pool: ResourcePool, policy: Policy = POLICY,
        settings: BatchSettings = MILP) -> BatchResult:
    asks = [r if isinstance(r, Ask) else Ask(r) for r in reqs]
    result = solve(asks, pool, policy, now=T0, settings=settings)
    assert [o.ask for o in result.outcomes] == asks  # one outcome per ask, in order
    assert result.bound <= result.objective + 1e-9
    return result


def with_usage(req: PlaceRequest, policy: Policy, usage: TeamUsage) -> Ask:
    """The ask as the broker makes it: the policy's verdict with the team's usage."""
    c = evaluate(policy, req, usage)
    assert not isinstance(c, Denied), c
    return Ask(req, constraints=c)


def decided(out: Outcome) -> Decision:
    assert isinstance(out, Decision), out
    return out


def rejected(out: Outcome) -> Rejection:
    assert isinstance(out, Rejection), out
    return out


def zones(result: BatchResult) -> list[str | None]:
    """Each outcome's zone, None for a rejection."""
    return [o.placement.pool.zone if isinstance(o, Decision) else None
            for o in result.outcomes]


def in_group(o: Offer, group: str, units: int) -> Offer:
    return replace(o, quota_group=group, quota_units=units)


# --- capacity and quota ------------------------------------------------------------------


@BOTH
def test_pool_capacity_less_what_the_broker_holds_binds_across_the_batch(
        settings: BatchSettings) -> None:
    cheap = offer("us-east-1a", price=20.0, capacity=2)
    dear = offer("us-east-1b", price=30.0)
    pool = pool_of([cheap, dear])
    r = run([request("r1"), request("r2"), request("r3")], pool, settings=settings)
    assert zones(r) == ["us-east-1a", "us-east-1a", "us-east-1b"]
    pool.hold(cheap.pool, 1)  # a lease holds one: one left for the batch
    r = run([request("r1"), request("r2"), request("r3")], pool, settings=settings)
    assert zones(r) == ["us-east-1a", "us-east-1b", "us-east-1b"]
    # Without the dearer pool the second request has nowhere to go: the detail names
    # the pool that was taken.
    only = pool_of([cheap])
    only.hold(cheap.pool, 1)
    r = run([request("r1"), request("r2")], only, settings=settings)
    assert zones(r) == ["us-east-1a", None]
    no = rejected(r.outcomes[1])
    assert no.code is RejectCode.NO_CAPACITY
    assert "aws/us-east-1a p5.48xlarge is taken" in no.detail


@BOTH
def test_quota_headroom_of_one_pool_binds_across_the_batch(settings: BatchSettings) -> None:
    tight = offer("us-east-1a", price=20.0, quota_headroom=8)  # one 8-GPU instance
    roomy = offer("us-east-1b", price=30.0, quota_headroom=64)
    r = run([request("r1"), request("r2")], pool_of([tight, roomy]), settings=settings)
    assert zones(r) == ["us-east-1a", "us-east-1b"]
    r = run([request("r1"), request("r2")], pool_of([tight]), settings=settings)
    no = rejected(r.outcomes[1])
    assert no.code is RejectCode.NO_CAPACITY
    assert f"quota {tight.pool} is used up" in no.detail


@BOTH
def test_a_quota_group_shared_by_two_pools_binds_across_both(settings: BatchSettings) -> None:
    # Two zones draw on one regional quota of 192 vCPUs: one p5 (192 vCPUs) in all.
    group = "aws:us-east-1:P:spot"
    a = in_group(offer("us-east-1a", price=20.0, quota_headroom=8), group, 192)
    b = in_group(offer("us-east-1b", price=22.0, quota_headroom=8), group, 192)
    c = offer("us-east-1c", price=40.0, capacity=1)
    reqs = [request("r1"), request("r2"), request("r3")]
    # Counted per pool, a and b would each take one.
    apart = [replace(o, quota_group=None, quota_units=None) for o in (a, b)]
    r = run(reqs, pool_of([*apart, c]), settings=settings)
    assert zones(r) == ["us-east-1a", "us-east-1b", "us-east-1c"]
    # Counted together, b's headroom went to a.
    r = run(reqs, pool_of([a, b, c]), settings=settings)
    assert zones(r) == ["us-east-1a", "us-east-1c", None]
    no = rejected(r.outcomes[2])
    assert no.code is RejectCode.NO_CAPACITY
    assert f"quota {group} is used up" in no.detail


# --- the team's limits ----------------------------------------------------------------


@BOTH
def test_team_max_gpus_binds_across_the_batch(settings: BatchSettings) -> None:
    policy = Policy(teams={"ml": Team(max_gpus=16)})
    pool = pool_of([offer("us-east-1a", price=20.0)])
    # Each alone fits.
    for rid in ("r1", "r2", "r3"):
        decided(run([request(rid, team="ml")], pool, policy, settings).outcomes[0])
    r = run([request(f"r{i}", team="ml") for i in (1, 2, 3)], pool, policy, settings)
    assert [isinstance(o, Decision) for o in r.outcomes] == [True, True, False]
    no = rejected(r.outcomes[2])
    assert no.code is RejectCode.OVER_BUDGET
    assert "max_gpus" in no.detail and "'ml'" in no.detail
    # What the team holds already counts: 8 held leaves room for one more.
    usage = TeamUsage(gpus=8, gpus_by_zone={("aws", "us-east-1a"): 8})
    r = run([with_usage(request(f"r{i}", team="ml"), policy, usage) for i in (1, 2)], pool,
            policy, settings)
    assert [isinstance(o, Decision) for o in r.outcomes] == [True, False]
    assert rejected(r.outcomes[1]).code is RejectCode.OVER_BUDGET


@BOTH
def test_team_budget_binds_across_the_batch(settings: BatchSettings) -> None:
    policy = Policy(teams={"ml": Team(budget_per_hour=50.0)})
    pool = pool_of([offer("us-east-1a", price=24.0)])
    r = run([request(f"r{i}", team="ml") for i in (1, 2, 3)], pool, policy, settings)
    assert [isinstance(o, Decision) for o in r.outcomes] == [True, True, False]
    no = rejected(r.outcomes[2])
    assert no.code is RejectCode.OVER_BUDGET
    assert "budget_per_hour" in no.detail
    # What the team spends already counts: $30/h spent leaves $20/h, under one p5.
    usage = TeamUsage(gpus=8, price_per_hour=30.0, gpus_by_zone={("aws", "us-east-1a"): 8})
    r = run([with_usage(request("r1", team="ml"), policy, usage)], pool, policy, settings)
    no = rejected(r.outcomes[0])
    assert no.code is RejectCode.OVER_BUDGET
    # The budget alone stands in the way (nothing else of the team's is in the batch):
    # the rejection says so, not that other placements of the batch took it.
    assert "has $20.00/h left of its budget_per_hour" in no.detail
    assert "other placements" not in no.detail


def test_a_budget_rejection_in_a_batch_says_what_the_batch_left() -> None:
    policy = Policy(teams={"ml": Team(budget_per_hour=50.0)})
    pool = pool_of([offer("us-east-1a", price=24.0)])
    r = run([request(f"r{i}", team="ml") for i in (1, 2, 3)], pool, policy)
    assert "($2.00/h left)" in rejected(r.outcomes[2]).detail


def test_a_request_alone_lists_more_when_its_first_options_are_ruled_out() -> None:
    """A request alone lists only its best option and the alternatives its decision
    names up front. When its team's spread limit rules out all of them (five instance
    types in the zone the team holds most of), more are listed: it goes to the next
    zone, and names the same alternatives as with every option listed at once."""
    from broker.placement.candidates import ALTERNATIVES

    policy = Policy(teams={"ml": Team(max_zone_share=0.5, spread_grace_gpus=0)})
    full = [offer("us-east-1a", instance_type=f"p5.{i}", price=20.0 + i)
            for i in range(ALTERNATIVES + 2)]
    pool = pool_of([*full, offer("us-east-1b", price=40.0)])
    usage = TeamUsage(gpus=16, gpus_by_zone={("aws", "us-east-1a"): 16})
    ask = with_usage(request("r1", team="ml"), policy, usage)
    out = decided(run([ask], pool, policy, HEURISTIC).outcomes[0])
    assert out.placement.pool.zone == "us-east-1b"
    assert [a.pool.instance_type for a in out.alternatives] == \
        [o.pool.instance_type for o in full[:ALTERNATIVES]]
    # The same as a batch's request, which lists `candidates` (8) up front.
    builder = CandidateBuilder(pool, policy, T0, HEURISTIC.candidates)
    listed, _ = builder.request(ask, ask.constraints)  # type: ignore[arg-type]
    assert listed is not None and len(listed.options) == len(full) + 1


@BOTH
def test_spread_limit_per_zone_with_grace(settings: BatchSettings) -> None:
    # Half the team's GPUs per zone, plus 8 GPUs of grace: of 24 GPUs, 20 in one zone.
    policy = Policy(teams={"ml": Team(max_zone_share=0.5, spread_grace_gpus=8)})
    a = offer("us-east-1a", price=20.0)
    b = offer("us-east-1b", price=30.0)
    reqs = [request(f"r{i}", team="ml") for i in (1, 2, 3)]
    r = run(reqs, pool_of([a, b]), policy, settings)
    assert zones(r) == ["us-east-1a", "us-east-1a", "us-east-1b"]
    # Without the spread limit all three take the cheap zone.
    assert zones(run(reqs, pool_of([a, b]), Policy(teams={"ml": Team()}), settings)) == \
        ["us-east-1a"] * 3
    # With one zone only, the third is refused by the spread limit.
    r = run(reqs, pool_of([a]), policy, settings)
    assert zones(r) == ["us-east-1a", "us-east-1a", None]
    no = rejected(r.outcomes[2])
    assert no.code is RejectCode.POLICY_DENIED
    assert "spread limit" in no.detail and "max_zone_share" in no.detail
    # What the team holds counts: 16 in a already, 24 would pass 0.5 × 24 + 8 = 20.
    usage = TeamUsage(gpus=16, gpus_by_zone={("aws", "us-east-1a"): 16})
    r = run([with_usage(request("r1", team="ml"), policy, usage)], pool_of([a, b]), policy,
            settings)
    assert zones(r) == ["us-east-1b"]


@BOTH
def test_spread_limit_per_cloud_with_grace(settings: BatchSettings) -> None:
    policy = Policy(teams={"ml": Team(max_cloud_share=0.5, spread_grace_gpus=8)})
    a = offer("us-east-1a", price=20.0)
    b = offer("us-east-1b", price=21.0)
    gcp = offer("us-central1-a", cloud="gcp", region="us-central1", price=30.0)
    reqs = [request(f"r{i}", team="ml") for i in (1, 2, 3)]
    r = run(reqs, pool_of([a, b, gcp]), policy, settings)
    clouds = [decided(o).placement.pool.cloud for o in r.outcomes]
    assert clouds == ["aws", "aws", "gcp"]
    # Zones are not limited: both AWS placements take the cheapest zone.
    assert zones(r)[:2] == ["us-east-1a", "us-east-1a"]
    r = run(reqs, pool_of([a, b]), policy, settings)
    no = rejected(r.outcomes[2])
    assert no.code is RejectCode.POLICY_DENIED
    assert "spread limit" in no.detail and "max_cloud_share" in no.detail


# --- what the policy allows -------------------------------------------------------------


@BOTH
def test_price_cap_binds_and_the_capped_request_gets_the_pool_under_it(
        settings: BatchSettings) -> None:
    under = offer("us-east-1a", price=20.0, capacity=1)  # $2.5/GPU-h
    over = offer("us-east-1b", price=24.0)  # $3/GPU-h
    pool = pool_of([under, over])
    # The uncapped request arrives first, yet the capped one gets the only pool it may
    # take.
    r = run([request("free"), request("capped", max_price_per_gpu_hour=2.6)], pool,
            settings=settings)
    assert zones(r) == ["us-east-1b", "us-east-1a"]
    r = run([request("low", max_price_per_gpu_hour=2.0)], pool, settings=settings)
    no = rejected(r.outcomes[0])
    assert no.code is RejectCode.OVER_PRICE_CAP
    assert "$2/GPU-h" in no.detail and "$2.5/GPU-h" in no.detail


def test_gpu_models_with_the_policys_equivalents() -> None:
    a100 = offer("us-east-1a", gpu="A100-80GB", instance_type="p4de.24xlarge", price=30.0)
    h100 = offer("us-east-1b", gpu="H100-80GB", price=24.0)
    pool = pool_of([a100, h100])
    ask = request(gpu="A100-80GB")
    assert decided(run([ask], pool).outcomes[0]).placement.gpu == "A100-80GB"
    equivalent = Policy(gpus=Gpus(equivalent={"A100-80GB": ["H100-80GB"]}))
    assert decided(run([ask], pool, equivalent).outcomes[0]).placement.gpu == "H100-80GB"
    denied = Policy(gpus=Gpus(equivalent={"A100-80GB": ["H100-80GB"]}, deny=["H100-80GB"]))
    assert decided(run([ask], pool, denied).outcomes[0]).placement.gpu == "A100-80GB"
    team_only = Policy(teams={"ml": Team(gpus=["A100-80GB"])})
    no = rejected(run([request(gpu="H100-80GB", team="ml")], pool, team_only).outcomes[0])
    assert no.code is RejectCode.POLICY_DENIED
    assert "H100-80GB" in no.detail and "'ml'" in no.detail


def test_market_of_the_request_the_team_and_the_rule() -> None:
    spot = offer("us-east-1a", market="spot", price=20.0)
    od = offer("us-east-1a", market="on_demand", price=24.0)
    pool = pool_of([spot, od])
    assert decided(run([request()], pool).outcomes[0]).placement.pool.market is Market.SPOT
    r = run([request(market="on_demand")], pool)
    assert decided(r.outcomes[0]).placement.pool.market is Market.ON_DEMAND
    od_team = Policy(teams={"ml": Team(markets=["on_demand"])})
    r = run([request(team="ml")], pool, od_team)
    assert decided(r.outcomes[0]).placement.pool.market is Market.ON_DEMAND
    no = rejected(run([request(team="ml", market="spot")], pool, od_team).outcomes[0])
    assert no.code is RejectCode.POLICY_DENIED
    assert "market 'spot'" in no.detail
    rule = Policy(rules=[Rule(name="prod-od", match=Match(labels={"env": "prod"}),
                              require=Require(market="on_demand"))])
    r = run([request(labels={"env": "prod"}), request("r2")], pool, rule)
    assert [decided(o).placement.pool.market for o in r.outcomes] == \
        [Market.ON_DEMAND, Market.SPOT]


def test_clouds_regions_and_residency() -> None:
    us = offer("us-east-1a", price=20.0)
    eu = offer("eu-central-1a", region="eu-central-1", price=30.0)
    gcp = offer("us-central1-a", cloud="gcp", region="us-central1", price=10.0)
    pool = pool_of([us, eu, gcp])
    assert decided(run([request()], pool).outcomes[0]).placement.pool == gcp.pool
    no_gcp = Policy(clouds=Clouds(deny=["gcp"]))
    assert decided(run([request()], pool, no_gcp).outcomes[0]).placement.pool == us.pool
    no_us = Policy(clouds=Clouds(deny=["gcp"]), regions=Regions(deny=["us-east-1"]))
    assert decided(run([request()], pool, no_us).outcomes[0]).placement.pool == eu.pool
    eu_rule = Policy(rules=[Rule(name="eu-only", match=Match(team=["ml"]),
                                 require=Require(residency=["eu"]))])
    r = run([request("r1", team="ml"), request("r2")], pool, eu_rule)
    assert [decided(o).placement.pool for o in r.outcomes] == [eu.pool, gcp.pool]
    assert "under rule 'eu-only'" in decided(r.outcomes[0]).reason
    # No offer in the EU: every fresh offer is excluded by the rule's residency.
    r = run([request("r1", team="ml")], pool_of([us, gcp]), eu_rule)
    no = rejected(r.outcomes[0])
    assert no.code is RejectCode.POLICY_DENIED
    assert "rule 'eu-only'" in no.detail and "residency eu" in no.detail
    assert "2 fresh offer(s)" in no.detail
    denied = Policy(clouds=Clouds(deny=["aws", "gcp"]))
    no = rejected(run([request()], pool, denied).outcomes[0])
    assert no.code is RejectCode.POLICY_DENIED


# --- the shape of a placement -------------------------------------------------------------


@BOTH
def test_a_gang_takes_all_its_instances_in_one_pool(settings: BatchSettings) -> None:
    # 16 GPUs = two 8-GPU instances, never one in a and one in b.
    a = offer("us-east-1a", price=20.0, capacity=1)
    b = offer("us-east-1b", price=20.0, capacity=1)
    c = offer("us-east-1c", price=30.0, capacity=2)
    r = run([request(gpus=16)], pool_of([a, b, c]), settings=settings)
    d = decided(r.outcomes[0])
    assert (d.placement.pool, d.placement.instances, d.placement.total_gpus) == (c.pool, 2, 16)
    assert d.expected_cost_per_hour == pytest.approx(60.0)
    no = rejected(run([request(gpus=16)], pool_of([a, b]), settings=settings).outcomes[0])
    assert no.code is RejectCode.NO_CAPACITY
    assert "16 GPUs in one zone" in no.detail
    # A gang and a single share c: the gang needs both instances, the single goes to a.
    r = run([request("one", gpus=8), request("gang", gpus=16)], pool_of([c, a]),
            settings=settings)
    assert [(decided(o).placement.pool, decided(o).placement.instances)
            for o in r.outcomes] == [(a.pool, 1), (c.pool, 2)]


def test_idle_gpus_cost_only_when_the_policy_weighs_them() -> None:
    # 6 GPUs: one 8-GPU instance at $16/h (2 idle), or three 2-GPU ones at $5.6/h each
    # ($16.8/h, none idle). Two 4-GPU instances would leave 2 idle as well.
    eight = offer("us-east-1a", instance_type="p5.48xlarge", gpus=8, price=16.0)
    two = offer("us-east-1a", instance_type="g6.12xlarge", gpus=2, price=5.6)
    four = offer("us-east-1a", instance_type="g6.24xlarge", gpus=4, price=8.3)
    pool = pool_of([eight, two, four])
    d = decided(run([request(gpus=6)], pool).outcomes[0])
    assert (d.placement.pool, d.placement.instances) == (eight.pool, 1)
    assert d.expected_cost_per_hour == pytest.approx(16.0)
    # idle_gpu_weight 0.5 adds half the idle GPUs' price again: the 8-GPU instance costs
    # 16 + 0.5 × 2 × $2 = 18, two 4-GPU ones 16.6 + 0.5 × 2 × $2.075 = 18.675; three 2-GPU
    # ones stay at 16.8.
    snug = Policy(scoring=Scoring(idle_gpu_weight=0.5))
    d = decided(run([request(gpus=6)], pool, snug).outcomes[0])
    assert (d.placement.pool, d.placement.instances) == (two.pool, 3)
    assert d.expected_cost_per_hour == pytest.approx(16.8)
    assert d.placement.price_per_hour == pytest.approx(16.8)
    [alt1, alt2] = d.alternatives
    assert (alt1.pool, alt2.pool) == (eight.pool, four.pool)
    # Without idle GPUs the weight changes nothing: 8 GPUs take the cheapest per GPU.
    d = decided(run([request(gpus=8)], pool, snug).outcomes[0])
    assert (d.placement.pool, d.expected_cost_per_hour) == (eight.pool, pytest.approx(16.0))


@BOTH
def test_interruption_and_availability_make_a_dearer_pool_the_better_one(
        settings: BatchSettings) -> None:
    risky = offer("us-east-1a", market="spot", price=20.0, capacity=1,
                  interruption_rate=1.0)  # 20 × (1 + 0.5 h × 1.0) = 30
    scarce = offer("us-east-1b", market="spot", price=22.0, capacity=1,
                   availability=0.0)  # 22 × (1 + 0.25 × 1) = 27.5
    safe = offer("us-east-1c", market="on_demand", price=24.0, capacity=1)  # 24
    pool = pool_of([risky, scarce, safe])
    r = run([request("r1")], pool, settings=settings)
    assert decided(r.outcomes[0]).placement.pool == safe.pool
    r = run([request("r1"), request("r2"), request("r3")], pool, settings=settings)
    assert [decided(o).placement.pool for o in r.outcomes] == \
        [safe.pool, scarce.pool, risky.pool]
    assert [decided(o).expected_cost_per_hour for o in r.outcomes] == \
        pytest.approx([24.0, 27.5, 30.0])
    assert r.objective == pytest.approx(81.5)
    # Without the risk terms, price alone decides.
    plain = Policy(scoring=Scoring(risk="lowest-cost"))
    r = run([request("r1")], pool, plain, settings)
    assert decided(r.outcomes[0]).placement.pool == risky.pool


# --- the batch as a whole ---------------------------------------------------------------


@BOTH
def test_arrival_order_breaks_exact_ties(settings: BatchSettings) -> None:
    cheap = offer("us-east-1a", price=20.0, capacity=1)
    dear = offer("us-east-1b", price=30.0)
    pool = pool_of([cheap, dear])
    r = run([request("r1"), request("r2")], pool, settings=settings)
    assert zones(r) == ["us-east-1a", "us-east-1b"]
    r = run([request("r2"), request("r1")], pool, settings=settings)
    assert zones(r) == ["us-east-1a", "us-east-1b"]
    assert [o.ask.request.request_id for o in r.outcomes] == ["r2", "r1"]


@BOTH
def test_a_batch_gives_the_contested_pool_to_the_request_that_needs_it_more(
        settings: BatchSettings) -> None:
    """The regret case: both want H100 in a (one instance left). `flexible` also takes
    A100 in b for a dollar more; `fixed` only H100, whose next pool is dear. First come,
    first served would give a to `flexible` (20 + 40); the batch gives it to `fixed`
    (21 + 20)."""
    a = offer("us-east-1a", price=20.0, capacity=1)
    b = offer("us-east-1b", gpu="A100-80GB", instance_type="p4de.24xlarge", price=21.0)
    c = offer("us-east-1c", price=40.0)
    pool = pool_of([a, b, c])
    flexible = request("flexible", gpu=["H100-80GB", "A100-80GB"])
    fixed = request("fixed", gpu="H100-80GB")
    # Alone, each takes the cheapest pool.
    assert decided(run([flexible], pool, settings=settings).outcomes[0]).placement.pool == a.pool
    assert decided(run([fixed], pool, settings=settings).outcomes[0]).placement.pool == a.pool
    r = run([flexible, fixed], pool, settings=settings)
    assert [decided(o).placement.pool for o in r.outcomes] == [b.pool, a.pool]
    assert r.objective == pytest.approx(41.0)
    assert r.optimal == (settings is MILP)  # only the LP proves it
    assert "batch of 2 placed by" in decided(r.outcomes[0]).reason
    # The alternatives still list what else the request could have taken.
    assert a.pool in {p.pool for p in decided(r.outcomes[0]).alternatives}


@BOTH
def test_longer_requests_weigh_more_in_the_batch(settings: BatchSettings) -> None:
    # Two requests, one cheap pool: the one that runs ten hours saves ten times more
    # there, so it gets it even though it arrives second.
    cheap = offer("us-east-1a", price=20.0, capacity=1)
    dear = offer("us-east-1b", price=24.0)
    pool = pool_of([cheap, dear])
    r = run([request("short", duration_hours=1.0), request("long", duration_hours=10.0)],
            pool, settings=settings)
    assert zones(r) == ["us-east-1b", "us-east-1a"]
    assert r.objective == pytest.approx(24.0 + 200.0)


# --- known bugs -------------------------------------------------------------------------


def test_spread_weight_never_hides_a_cheaper_pool_in_an_empty_zone() -> None:
    # Eight pools in zone a, where the team already is: $10–10.7/h plus a spread term of
    # 1.0 × their price (the team's whole share is in a): ≈ $20/h. Zone b: $12/h flat.
    policy = Policy(teams={"ml": Team()}, scoring=Scoring(spread_weight=1.0))
    offers = [offer("us-east-1a", instance_type=f"p5.{i}", price=10.0 + i / 10)
              for i in range(8)]
    b = offer("us-east-1b", price=12.0)
    usage = TeamUsage(gpus=8, price_per_hour=10.0, gpus_by_zone={("aws", "us-east-1a"): 8})
    r = run([with_usage(request(team="ml"), policy, usage)], pool_of([*offers, b]), policy)
    d = decided(r.outcomes[0])
    assert d.placement.pool == b.pool
    assert d.expected_cost_per_hour == pytest.approx(12.0)


def test_the_bound_never_exceeds_the_objective_when_the_listed_options_run_out() -> None:
    # Nine one-instance pools, nine requests: the ninth finds the eight listed options
    # taken and lists more.
    offers = [offer(f"us-east-1{z}", price=10.0 + i, capacity=1)
              for i, z in enumerate("abcdefghi")]
    solve_ = solve([Ask(request(f"r{i}")) for i in range(9)], pool_of(offers), POLICY,
                   now=T0, settings=HEURISTIC)
    assert solve_.objective == pytest.approx(sum(10.0 + i for i in range(9)))
    assert solve_.bound <= solve_.objective


def test_pools_listed_late_in_a_batch_are_never_oversubscribed() -> None:
    # Nine pools with one instance each and one without a limit; ten requests. The
    # first eight options listed are used up by the eighth request; the ninth and
    # tenth find pool i only after the group grows.
    offers = [offer(f"us-east-1{z}", price=10.0 + i, capacity=1)
              for i, z in enumerate("abcdefghi")]
    spare = offer("us-east-1z", price=40.0)
    r = solve([Ask(request(f"r{i}")) for i in range(10)], pool_of([*offers, spare]), POLICY,
              now=T0)
    got = [decided(o).placement.pool.zone for o in r.outcomes]
    assert got.count("us-east-1i") == 1
    assert got.count("us-east-1z") == 1


def test_a_team_over_its_share_does_not_keep_the_milp_from_other_teams() -> None:
    policy = Policy(teams={"old": Team(max_zone_share=0.5, spread_grace_gpus=0),
                           "new": Team(max_zone_share=0.5, spread_grace_gpus=0)})
    a = offer("us-east-1a", instance_type="g6.24xlarge", gpus=4, price=10.0)
    b = offer("us-east-1b", instance_type="g6.24xlarge", gpus=4, price=11.0)
    pool = pool_of([a, b])
    new = [request("n1", gpus=4, team="new"), request("n2", gpus=4, team="new")]
    # Alone in the batch, the MILP spreads team new's two requests over a and b.
    r = run(new, pool, policy)
    assert set(zones(r)) == {"us-east-1a", "us-east-1b"}
    usage = TeamUsage(gpus=24, gpus_by_zone={("aws", "us-east-1a"): 24})
    old = with_usage(request("o1", gpus=4, team="old"), policy, usage)
    r = run([*new, old], pool, policy)
    assert zones(r)[2] == "us-east-1b"
    assert set(zones(r)[:2]) == {"us-east-1a", "us-east-1b"}


# --- large batches: the offer arrays --------------------------------------------------


def test_an_offer_used_up_is_skipped_by_every_group_while_the_greedy_phase_runs() -> None:
    # Four one-instance pools, four groups (their caps differ) listing one option each.
    # With a and b taken (what the greedy phase's live resources say), the first group
    # to list more looks at b, finds it used up and records it; the others skip it
    # without a look. Once resources may be freed again, they look again; and so does
    # a new greedy phase, which starts from what is free then.
    offers = [offer(f"us-east-1{z}", price=10.0 + i, capacity=1) for i, z in enumerate("abcd")]
    builder = CandidateBuilder(pool_of(offers), POLICY, T0, 1, indexed=True)
    reqs = []
    for n in range(4):
        req = request(f"r{n}", max_price_per_gpu_hour=2.0 + n / 10)
        c = evaluate(POLICY, req)
        assert not isinstance(c, Denied)
        r, _ = builder.request(Ask(req), c)
        assert r is not None
        reqs.append(r)
    p = solver.AssignmentProblem(reqs, builder.limits, builder.teams)
    st = solver.State(p)
    st.left[("pool", offers[0].pool)] = st.left[("pool", offers[1].pool)] = 0
    looked: list[str] = []

    def alive(o: solver.Option) -> bool:
        looked.append(o.ref[0].pool.zone)
        return st.global_ok(o)

    def zones(g: solver.Group) -> list[str]:
        return [o.ref[0].pool.zone for o in g.options]

    live = solver.Shrinking(st.left, alive)  # as the greedy phase reads the lists
    assert reqs[0].group.grow(k=1, alive=live)
    assert looked == ["us-east-1b", "us-east-1c"]
    assert zones(reqs[0].group) == ["us-east-1a", "us-east-1c"]
    looked.clear()
    assert reqs[1].group.grow(k=1, alive=live)
    assert looked == ["us-east-1c"]
    assert zones(reqs[1].group) == ["us-east-1a", "us-east-1c"]
    looked.clear()  # resources may be freed: a plain filter
    assert reqs[2].group.grow(k=1, alive=alive)
    assert looked == ["us-east-1b", "us-east-1c"]
    st = solver.State(p)  # b free again (`alive` reads this state from here on)
    live = solver.Shrinking(st.left, alive)
    looked.clear()
    assert reqs[3].group.grow(k=1, alive=live)
    assert looked == ["us-east-1b"]
    # The LP lists every option again, those dropped as used up too.
    reqs[1].group.unfilter()
    assert zones(reqs[1].group) == ["us-east-1a", "us-east-1b", "us-east-1c", "us-east-1d"]


def test_a_group_reads_its_candidates_in_cost_order_a_growing_part_at_a_time() -> None:
    rng = random.Random(7)
    cost = [float(rng.randrange(40)) for _ in range(1000)]  # many ties
    price = [rng.uniform(1, 100) for _ in cost]
    n = len(cost)
    ranked = Ranked([], [], [np.zeros(n, dtype=np.int64)], [np.arange(n)],
                     [np.ones(n, dtype=np.int64)], [np.array(cost)], [np.array(price)],
                     [np.arange(n)], head=8)
    got: list[int] = []
    sizes: list[int] = []
    while True:
        assert ranked.price_floor(len(got)) <= min(
            (price[j] for j in range(n) if j not in set(got)), default=math.inf)
        chunk = ranked.read(len(got), 256).tolist()
        if not chunk:
            break
        sizes.append(len(chunk))
        got += chunk
    assert sorted(got) == list(range(n))
    assert [cost[j] for j in got] == sorted(cost)
    # After the first few (a partial sort), the order is the stable sort's.
    rest = [j for j in np.argsort(cost, kind="stable").tolist() if j not in set(got[:8])]
    assert got[8:] == rest
    assert sizes[0] == 8 and len(sizes) < 8


def test_a_batch_leaves_the_garbage_collector_as_it_found_it() -> None:
    pool = pool_of([offer("us-east-1a", price=10.0, capacity=1)])
    was = gc.isenabled()
    try:
        for state in (True, False):
            (gc.enable if state else gc.disable)()
            run([request("r1"), request("r2")], pool, settings=HEURISTIC)
            assert gc.isenabled() is state
    finally:
        (gc.enable if was else gc.disable)()


@pytest.mark.parametrize("path", ["walk", "milp", "arrays", "spread", "split"])
def test_a_solved_batch_leaves_no_cycle_for_the_collector(path: str) -> None:
    """What a batch made is freed by reference counting once let go: no cycle is left
    for a collection (the daemon's heap sweeps run between batches; a cycle alive then
    would stay frozen until a thaw)."""
    offers = [offer(f"us-east-1{z}", instance_type=f"p5.{i}", price=10.0 + i, capacity=2)
              for z in "ab" for i in range(6)]
    pool = pool_of(offers)
    policy = POLICY
    settings = MILP if path == "milp" else HEURISTIC
    if path == "arrays":
        settings = replace(settings, index_min_batch=1)
    if path == "spread":
        policy = Policy(teams={"ml": Team()}, scoring=Scoring(spread_weight=1.0))
    usage = TeamUsage(gpus=8, price_per_hour=10.0, gpus_by_zone={("aws", "us-east-1a"): 8})

    def batch(tag: str) -> list[Ask]:
        reqs = [request(f"{tag}{i}", team="ml" if path == "spread" else None,
                        gpus=16 if path == "split" else 8,
                        **({"gang": False, "max_parts": 4} if path == "split" else {}))
                for i in range(5)]
        return [with_usage(r, policy, usage) if path == "spread" else Ask(r) for r in reqs]

    run(batch("warm"), pool, policy, settings)  # what is made once (caches, types)
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        result = run(batch("r"), pool, policy, settings)
        assert any(isinstance(o, Decision) for o in result.outcomes)
        del result
        gc.collect()
        left = sorted({type(o).__qualname__ for o in gc.garbage})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        (gc.enable if was else gc.disable)()
    assert left == []


def test_a_spent_solve_budget_places_the_heuristic_answer_without_the_milp() -> None:
    # Both want a (one instance); the trivial bound (both on a) is below any answer, so
    # only the MILP proves the heuristic's answer optimal. With the whole solve's budget
    # gone the MILP is skipped: every request is still placed, nothing over capacity.
    a = offer("us-east-1a", price=10.0, capacity=1)
    b = offer("us-east-1b", price=11.0, capacity=1)
    pool = pool_of([a, b])
    reqs = [request("r0"), request("r1")]
    proven = run(reqs, pool, settings=MILP)
    assert proven.optimal
    spent = BatchSettings(exact_max_batch=1000, exact_time_limit=5, budget_seconds=1e-9)
    r = run(reqs, pool, settings=spent)
    assert r.solver == "heuristic" and not r.optimal
    assert sorted(zones(r)) == ["us-east-1a", "us-east-1b"]


# The one-word risk setting: two requests alike but for their risk level (a rule's), on
# one view of the pool, in one batch: a cheap spot pool often interrupted, and a safe one
# 5 % dearer. lowest-cost is plain price; fewest-interruptions weighs $5 per GPU and
# interruption: 20 × (1 + 0.5 × 0.3) + 8 × 5 × 0.3 = 35 against 21 × (1 + 0.5 × 0.01)
# + 8 × 5 × 0.01 = 21.505.
RISKY = offer("us-east-1a", market="spot", price=20.0, interruption_rate=0.3)
SAFE = offer("us-east-1b", market="spot", price=21.0, interruption_rate=0.01)
BY_RISK = Policy(rules=[
    Rule(name="serving-stays-up", match=Match(labels={"kind": "serving"}),
         require=Require(risk="fewest-interruptions")),
    Rule(name="sweeps-are-cheap", match=Match(labels={"kind": "sweep"}),
         require=Require(risk="lowest-cost")),
])


@pytest.mark.parametrize("path", ["walk", "walk-by-cost", "frozen-costs", "arrays"])
@BOTH
def test_requests_at_different_risk_levels_in_one_batch_take_different_pools(
        settings: BatchSettings, path: str) -> None:
    from broker.placement.optimizer import CostIndex, expected_cost

    pool = pool_of([RISKY, SAFE])
    reqs = [request("serving", market="spot", labels={"kind": "serving"}),
            request("sweep", market="spot", labels={"kind": "sweep"}),
            request("other", market="spot")]  # the policy's level: balanced
    asks = []
    for r in reqs:
        c = evaluate(BY_RISK, r)
        assert not isinstance(c, Denied), c
        asks.append(Ask(r, constraints=c))
    assert [a.constraints.risk for a in asks if a.constraints] == \
        ["fewest-interruptions", "lowest-cost", "balanced"]
    costs = None
    if path == "walk-by-cost":
        costs = CostIndex(pool, BY_RISK)
    elif path == "frozen-costs":
        costs = CostIndex(pool, BY_RISK).frozen(
            {1.0, 4.0}, {a.constraints.risk for a in asks if a.constraints})
    # One option listed up front: a list in the wrong order would stop at the wrong one.
    settings = replace(settings, candidates=1,
                       index_min_batch=1 if path == "arrays" else settings.index_min_batch)
    result = solve(asks, pool, BY_RISK, now=T0, settings=settings, costs=costs)
    serving, sweep, other = (decided(o) for o in result.outcomes)
    assert serving.placement.pool == SAFE.pool
    assert sweep.placement.pool == RISKY.pool
    assert other.placement.pool == SAFE.pool  # balanced: 23 against 21.105
    # Each is costed at its own level, as the one cost formula has it.
    assert sweep.expected_cost_per_hour == pytest.approx(20.0)
    assert serving.expected_cost_per_hour == pytest.approx(
        expected_cost(SAFE, 1, BY_RISK.for_risk("fewest-interruptions")))
    assert serving.expected_cost_per_hour == pytest.approx(21.505)
    assert other.expected_cost_per_hour == pytest.approx(expected_cost(SAFE, 1, BY_RISK))


def test_the_cost_index_keeps_a_list_per_risk_level() -> None:
    from broker.placement.optimizer import CostIndex

    index = CostIndex(pool_of([RISKY, SAFE]), BY_RISK)
    assert [e[1] for e in index.sorted(RISKY.gpu, Market.SPOT, 4.0, "lowest-cost")] == \
        [RISKY.pool, SAFE.pool]
    for level in ("fewest-interruptions", "balanced", None):
        assert [e[1] for e in index.sorted(RISKY.gpu, Market.SPOT, 4.0, level)] == \
            [SAFE.pool, RISKY.pool]
    assert [e[0] for e in index.sorted(RISKY.gpu, Market.SPOT, 4.0, "lowest-cost")] == \
        pytest.approx([20.0 / 8, 21.0 / 8])


def test_costs_frozen_for_other_risk_levels_still_place_a_request_at_its_own() -> None:
    from broker.placement.optimizer import CostIndex

    pool = pool_of([RISKY, SAFE])
    frozen = CostIndex(pool, BY_RISK).frozen({4.0})  # the policy's level only
    assert frozen.covers(4.0) and not frozen.covers(4.0, "lowest-cost")
    with pytest.raises(KeyError, match="lowest-cost"):
        frozen.sorted(RISKY.gpu, Market.SPOT, 4.0, "lowest-cost")
    sweep = request("sweep", market="spot", labels={"kind": "sweep"})
    [out] = solve([Ask(sweep)], pool, BY_RISK, now=T0, costs=frozen).outcomes
    assert decided(out).placement.pool == RISKY.pool  # walked by price instead


def cheap_and_dear(capacity: int) -> tuple[Offer, Offer, ResourcePool]:
    """Two spot pools of us-east-1 alike but for their price (10 and 11 an hour)."""
    cheap = offer("us-east-1a", market="spot", price=10.0, capacity=capacity,
                  interruption_rate=0.01)
    dear = offer("us-east-1b", market="spot", price=11.0, capacity=capacity,
                 interruption_rate=0.01)
    return cheap, dear, pool_of([cheap, dear])


@BOTH
def test_the_arrays_costs_kept_across_batches_serve_only_the_offer_they_were_made_for(
        settings: BatchSettings) -> None:
    from broker.placement.optimizer import CostIndex

    # Large batches cost their offers through the index's memo, kept from one batch to
    # the next: an unchanged offer is not costed again, a changed one (a new reading of
    # its pool) is.
    cheap, dear, pool = cheap_and_dear(capacity=1)
    index = CostIndex(pool, POLICY)
    settings = replace(settings, index_min_batch=1)

    def batch() -> list[str | None]:
        asks = [Ask(request(f"r{i}", market="spot")) for i in range(2)]
        costs = index.frozen({1.0, 4.0})
        return zones(solve(asks, pool, POLICY, now=T0, settings=settings, costs=costs))

    assert batch() == ["us-east-1a", "us-east-1b"]
    kept = {key: entry for table in index.memo._tables.values()
            for key, entry in table.items()}
    assert kept[cheap.pool][0] is pool.get(cheap.pool)  # entries for the offers read
    assert batch() == ["us-east-1a", "us-east-1b"]
    # us-east-1a is read again, now the dearer (and riskier) one: the memo's entry for
    # its pool was made for the old reading and must not serve the new one.
    pool.replace(("aws", "us-east-1"), [
        offer("us-east-1a", market="spot", price=12.0, capacity=1, interruption_rate=0.2),
        dear])
    assert batch() == ["us-east-1b", "us-east-1a"]


def test_the_walks_costs_kept_across_batches_serve_only_the_offer_they_were_made_for() -> None:
    from broker.market.hazard import HazardEstimator
    from broker.placement.optimizer import CostIndex

    # Small batches walk the index's lists, and keep the costs they read in its memo
    # (`CostMemo.walks`) for the next: a new reading of a pool is costed again, and a
    # refreshed hazard estimator starts every table again.
    cheap, dear, pool = cheap_and_dear(capacity=4)
    index = CostIndex(pool, POLICY)

    def place(name: str) -> str | None:
        [zone] = zones(solve([Ask(request(name, market="spot"))], pool, POLICY, now=T0,
                             settings=HEURISTIC, costs=index))
        return zone

    assert place("r1") == "us-east-1a"
    kept = {key: entry for table in index.memo._walks.values()
            for key, entry in table.items()}
    assert kept[(cheap.pool, 1, 8)] == (cheap, pytest.approx(10.0, rel=0.5))
    assert place("r2") == "us-east-1a"
    # us-east-1a is read again, now the dearer (and riskier) one: the memo's entry for
    # its pool was made for the old reading and must not serve the new one.
    pool.replace(("aws", "us-east-1"), [
        offer("us-east-1a", market="spot", price=12.0, capacity=4, interruption_rate=0.2),
        dear])
    assert place("r3") == "us-east-1b"
    # Scored by a hazard estimator, until it is refreshed.
    estimator = HazardEstimator()
    table = index.memo.walks(estimator, POLICY, 1.0)
    table[(dear.pool, 1, 8)] = (dear, 1.0)
    assert index.memo.walks(estimator, POLICY, 1.0) is table
    estimator.refresh()
    assert index.memo.walks(estimator, POLICY, 1.0) == {}


@BOTH
def test_a_large_batch_shares_the_last_ones_arrays_only_while_its_offers_are_the_same(
        settings: BatchSettings) -> None:
    """Large batches keep their offer arrays for the next (`CostMemo.arrays`): it shares
    them while its offers are the very same, with their room read again. Batch after
    batch, with holdings, a poll, a cool-down and an estimator refresh between, every
    outcome is the one a batch without anything kept (a new index) decides."""
    from broker.market.hazard import HazardEstimator
    from broker.placement.optimizer import CostIndex

    offers = [offer(f"us-east-1{z}", instance_type=f"p5.{i}", market="spot",
                    price=10.0 + i + (z == "b"), capacity=1, interruption_rate=0.01 * i)
              for z in "ab" for i in range(4)]
    pool = pool_of(offers)
    pool.hazard = HazardEstimator()
    index = CostIndex(pool, POLICY)
    settings = replace(settings, index_min_batch=1)
    shared = 0

    def batch(tag: str) -> None:
        nonlocal shared
        asks = [Ask(request(f"{tag}{i}", market="spot", gpus=8)) for i in range(3)]
        before = dict(index.memo.arrays)
        got = solve(asks, pool, POLICY, now=T0, settings=settings,
                    costs=index.frozen({1.0}))
        fresh = solve(asks, pool, POLICY, now=T0, settings=settings,
                      costs=CostIndex(pool, POLICY).frozen({1.0}))
        assert [(type(o), zones_of(o)) for o in got.outcomes] == \
            [(type(o), zones_of(o)) for o in fresh.outcomes]
        shared += sum(1 for k, a in index.memo.arrays.items()
                      if k in before and a is before[k])
        for o in got.outcomes:
            if isinstance(o, Decision):
                pool.hold(o.placement.pool, o.placement.instances)

    batch("a")
    batch("b")  # held since: the same offers, less room
    assert shared > 0
    pool.unhold(offers[0].pool, 1)
    batch("c")
    pool.replace(SLICE, [replace(o, price_per_hour=o.price_per_hour + 5) if i == 1 else o
                         for i, o in enumerate(offers)])
    kept = dict(index.memo.arrays)
    batch("d")  # a changed offer: made again
    assert index.memo.arrays[("H100-80GB", Market.SPOT)] is not kept[("H100-80GB", Market.SPOT)]
    pool.cool_down(offers[2].pool, 600)
    batch("e")
    pool.hazard.refresh()
    batch("f")


def zones_of(o: Outcome) -> tuple[str, int] | None:
    return (o.placement.pool.instance_type, o.placement.instances) \
        if isinstance(o, Decision) else None


def test_arrays_shared_with_another_batch_read_their_room_and_costs_again() -> None:
    """Arrays shared with the next batch read their offers' room again; the costs kept
    with them serve it only while the memo gives it the same table (the estimator
    neither refreshed nor replaced): else they are made again, and the new table
    filled."""
    from broker.placement.rules import OfferArrays

    offers = [offer(f"us-east-1{z}", market="spot", price=10.0, interruption_rate=0.01,
                    capacity=3 if z == "a" else None) for z in "ab"]
    pool = pool_of(offers)
    arrays = OfferArrays.of(offers, POLICY, pool)
    pool.hold(offers[0].pool, 2)
    assert list(arrays.again(pool).free) == [1, math.inf]  # its room read again
    assert list(arrays.free) == [3, math.inf]
    first: dict[Any, Any] = {}
    eff, _ = arrays.eff(1.0, POLICY, None, first)
    assert set(first) == {o.pool for o in offers}
    again = arrays.again(pool)
    assert again.eff(1.0, POLICY, None, first)[0] is eff  # the same table: shared
    second: dict[Any, Any] = {}
    assert list(again.eff(1.0, POLICY, None, second)[0]) == list(eff)
    assert set(second) == {o.pool for o in offers}  # costed again, for the new table


def test_the_index_places_a_rounds_changes_again_a_few_at_a_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A poll round changes every offer; `CostIndex.prepare` places them again in the
    lists `PLACE_STEP` a step (here 4), yielding between, and the lists end as a new
    index makes them, in every part the index kept; a refresh in between drops them."""
    from broker.market.hazard import DEFAULT_HORIZON, HazardEstimator
    from broker.placement import view
    from broker.placement.optimizer import CostIndex

    monkeypatch.setattr(view, "PLACE_STEP", 4)
    offers = [offer(f"us-east-1{z}", instance_type=f"p5.{i}", market=m,
                    price=10.0 + i + (z == "b"), capacity=1 + i, interruption_rate=0.01 * i)
              for z in "abc" for i in range(3) for m in ("spot", "on_demand")]
    pool = pool_of(offers)
    pool.hazard = HazardEstimator()
    index = CostIndex(pool, POLICY)
    for _ in index.prepare():
        pass

    def lists(ix: CostIndex) -> dict[Any, Any]:
        return {(gpu, m, how, part): getattr(ix, how)(gpu, m, *(
                    () if how == "by_price" else (DEFAULT_HORIZON,)), part=part)
                for gpu in pool.gpus() for m in Market for how in ("sorted", "by_price")
                for part in (view.WHOLE, view.ROOMY)}

    # The round: every price moves, one offer goes.
    pool.replace(SLICE, [replace(o, price_per_hour=o.price_per_hour * (1.3 if i % 2 else 0.8))
                         for i, o in enumerate(offers[1:])])
    changed = len(index._dirty)
    assert changed == len(offers)
    steps = sum(1 for _ in index.prepare())
    assert steps == math.ceil(changed / 4) - 1  # the last few with the rest, at once
    assert not index._dirty
    assert lists(index) == lists(CostIndex(pool, POLICY))


def test_the_index_prepares_the_lists_batches_ask_for_and_remakes_them_after_a_refresh(
        ) -> None:
    """`CostIndex.prepare` makes, one list a step, the lists a batch would otherwise
    make on the event loop: at first the default horizon's at the policy's own level and
    the lists by price, then the pool's lists that a `Snapshot` lends; later every list
    made since, again after an estimator's refresh dropped them. What it makes is what a
    new index makes, and a batch then makes none."""
    from broker.market.hazard import DEFAULT_HORIZON, HazardEstimator
    from broker.placement.optimizer import CostIndex

    offers = [offer(f"us-east-1{z}", instance_type=f"p5.{i}", market=m,
                    price=10.0 + i + (z == "b"), capacity=2, interruption_rate=0.01 * i)
              for z in "ab" for i in range(3) for m in ("spot", "on_demand")]
    pool = pool_of(offers)
    pool.hazard = HazardEstimator()
    index = CostIndex(pool, POLICY)

    def lists(ix: CostIndex, horizon: float) -> dict[Any, Any]:
        return {(gpu, m, how): getattr(ix, how)(gpu, m, *(() if how == "by_price"
                                                          else (horizon,)))
                for gpu in pool.gpus() for m in Market for how in ("sorted", "by_price")}

    assert pool.unindexed((None, *Market))  # the pool's lists by GPU: none built yet
    steps = sum(1 for _ in index.prepare())
    # by cost and by price, each; then the pool's lists of both markets (its list of each
    # market was built for the index's)
    assert steps == 2 * len(pool.gpus()) * len(Market) + len(pool.gpus())
    assert pool.unindexed((None, *Market)) == []  # all that a `Snapshot` lends
    assert sum(1 for _ in index.prepare()) == 0  # nothing left to make
    made = {k: id(v) for k, v in lists(index, DEFAULT_HORIZON).items()}
    assert lists(index, DEFAULT_HORIZON) == lists(CostIndex(pool, POLICY), DEFAULT_HORIZON)
    index.frozen({DEFAULT_HORIZON})  # a batch's freeze: every list was there
    assert {k: id(v) for k, v in lists(index, DEFAULT_HORIZON).items()} == made
    # A batch asks for another horizon; a refresh drops every list; prepare remakes all.
    index.frozen({1.0})
    pool.hazard.refresh()
    assert sum(1 for _ in index.prepare()) == 3 * len(pool.gpus()) * len(Market)
    assert sum(1 for _ in index.prepare()) == 0
    for h in (DEFAULT_HORIZON, 1.0):
        assert lists(index, h) == lists(CostIndex(pool, POLICY), h)
