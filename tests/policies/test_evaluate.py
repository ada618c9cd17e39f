"""What a policy says about one request, and what placement does with it."""

from __future__ import annotations

import textwrap

from factories import T0, offer, pool_of, request

from broker.model import Market, RejectCode
from broker.placement.optimizer import Ask, Decision, Rejection, place
from policies.evaluate import Constraints, Denied, TeamUsage, evaluate, forbids
from policies.loader import parse_policy
from policies.model import Policy


def policy(body: str) -> Policy:
    return parse_policy("version: 1\n" + textwrap.dedent(body))


def allowed(p: Policy, **kw: object) -> Constraints:
    c = evaluate(p, request(**kw))  # type: ignore[arg-type]
    assert isinstance(c, Constraints), c
    return c


def denied(p: Policy, usage: TeamUsage | None = None, **kw: object) -> Denied:
    d = evaluate(p, request(**kw), usage)  # type: ignore[arg-type]
    assert isinstance(d, Denied), d
    return d


def test_first_matching_rule_wins_and_deny_names_it() -> None:
    p = policy("""
        rules:
          - name: interns-no-h100
            match: {team: interns, gpu: H100-80GB}
            deny: ask ops
          - name: interns-spot
            match: {team: interns}
            require: {market: spot}
    """)
    d = denied(p, team="interns")
    assert d.code is RejectCode.POLICY_DENIED and "interns-no-h100" in d.detail
    assert "ask ops" in d.detail
    c = allowed(p, team="interns", gpu="A100-80GB")
    assert c.rule == "interns-spot" and c.markets == (Market.SPOT, Market.RESERVED)
    assert allowed(p, team="research").rule is None


def test_rules_match_on_labels_and_scheduler() -> None:
    p = policy("""
        rules:
          - name: phi
            match: {labels: {data: phi}, scheduler: [slurm-eu]}
            require: {residency: [eu]}
    """)
    assert allowed(p, scheduler="slurm-eu", labels={"data": "phi"}).residency == ({"eu"},)
    assert allowed(p, scheduler="slurm-us", labels={"data": "phi"}).residency == ()
    assert allowed(p, scheduler="slurm-eu", labels={"data": "x"}).residency == ()


def test_equivalents_extend_and_lists_narrow_the_models() -> None:
    p = policy("gpus:\n  deny: [A10]\n  equivalent: {L4: [A10G, A10]}\n")
    assert allowed(p, gpu="L4", gpus=1).gpus == ("L4", "A10G")
    assert denied(p, gpu="A10", gpus=1).code is RejectCode.POLICY_DENIED


def test_team_limits() -> None:
    p = policy("""
        teams:
          ml: {max_gpus: 16, budget_per_hour: 100, markets: [spot], gpus: [H100-80GB]}
    """)
    assert allowed(p, team="ml").markets == (Market.SPOT, Market.RESERVED)
    d = denied(p, TeamUsage(gpus=12), team="ml")
    assert d.code is RejectCode.OVER_BUDGET and "max_gpus 16" in d.detail
    d = denied(p, TeamUsage(gpus=0, price_per_hour=100.0), team="ml")
    assert d.code is RejectCode.OVER_BUDGET and "budget_per_hour" in d.detail
    c = evaluate(p, request(team="ml"), TeamUsage(gpus=0, price_per_hour=60.0))
    assert isinstance(c, Constraints) and c.budget_left == 40.0
    assert denied(p, team="ml", gpu="A100-80GB").code is RejectCode.POLICY_DENIED
    # Paid-for capacity rides along with an allowed market; it does not stand in for
    # one the team may not use.
    assert denied(p, team="ml", market="on_demand").code is RejectCode.POLICY_DENIED
    assert allowed(p, team="ml", market="reserved").markets == (Market.RESERVED,)


def test_caps_request_replaces_default_rule_always_holds() -> None:
    p = policy("""
        defaults: {max_price_per_gpu_hour: 4}
        rules:
          - name: cheap
            match: {team: ml}
            require: {max_price_per_gpu_hour: 2}
    """)
    assert allowed(p).cap == 4
    assert allowed(p, max_price_per_gpu_hour=9.0).cap == 9
    assert allowed(p, team="ml", max_price_per_gpu_hour=9.0).cap == 2


def test_where_clouds_regions_residency() -> None:
    p = policy("""
        clouds: {allow: [aws, gcp], deny: []}
        regions: {deny: [aws:us-west-2]}
        teams:
          eu: {residency: [eu]}
    """)
    c = allowed(p)
    assert c.region_ok("aws", "us-east-1") and not c.region_ok("azure", "eastus")
    assert not c.region_ok("aws", "us-west-2") and c.region_ok("gcp", "us-west2")
    e = allowed(p, team="eu")
    assert e.region_ok("aws", "eu-central-1") and not e.region_ok("aws", "us-east-1")
    assert denied(p, clouds=("azure",)).code is RejectCode.POLICY_DENIED


def test_placement_obeys_residency_and_says_so_when_nothing_is_left() -> None:
    p = policy("teams:\n  eu: {residency: [eu]}\n")
    us = offer("us-east-1a", price=20.0)
    eu = offer("eu-central-1a", region="eu-central-1", price=30.0)
    [d] = place([Ask(request(team="eu"))], pool_of([us, eu]), p, now=T0)
    assert isinstance(d, Decision) and d.placement.pool == eu.pool
    [r] = place([Ask(request(team="eu"))], pool_of([us]), p, now=T0)
    assert isinstance(r, Rejection) and r.code is RejectCode.POLICY_DENIED
    assert "residency eu" in r.detail


def test_placement_over_budget_when_only_the_budget_stands_in_the_way() -> None:
    p = policy("teams:\n  ml: {budget_per_hour: 50}\n")
    o = offer(price=24.0)  # 8 GPUs per instance
    c = evaluate(p, request(team="ml", gpus=16), TeamUsage(price_per_hour=10.0))
    assert isinstance(c, Constraints)
    [r] = place([Ask(request(team="ml", gpus=16), constraints=c)], pool_of([o]), p, now=T0)
    assert isinstance(r, Rejection) and r.code is RejectCode.OVER_BUDGET
    assert "$40.00/h left" in r.detail
    c = evaluate(p, request(team="ml", gpus=8), TeamUsage(price_per_hour=10.0))
    assert isinstance(c, Constraints)
    [d] = place([Ask(request(team="ml", gpus=8), constraints=c)], pool_of([o]), p, now=T0)
    assert isinstance(d, Decision)


def test_spot_min_discount_skips_spot_that_is_not_cheap_enough() -> None:
    od = offer(market="on_demand", price=30.0)
    small = offer(market="spot", price=27.0)  # 10 % off
    p = policy("scoring: {spot_min_discount: 0.2}\n")
    [d] = place([Ask(request())], pool_of([od, small]), p, now=T0)
    assert isinstance(d, Decision) and d.placement.pool.market is Market.ON_DEMAND
    p = policy("scoring: {spot_min_discount: 0.05}\n")
    [d] = place([Ask(request())], pool_of([od, small]), p, now=T0)
    assert isinstance(d, Decision) and d.placement.pool.market is Market.SPOT


def test_spread_weight_steers_away_from_a_zone_the_team_crowds() -> None:
    a = offer("us-east-1a", price=24.0)
    b = offer("us-east-1b", price=25.0)
    p = policy("scoring: {spread_weight: 0.5}\n")
    crowded = TeamUsage(gpus=16, gpus_by_zone={("aws", "us-east-1a"): 16})
    c = evaluate(p, request(team="ml"), crowded)
    assert isinstance(c, Constraints)
    [d] = place([Ask(request(team="ml"), constraints=c)], pool_of([a, b]), p, now=T0)
    assert isinstance(d, Decision) and d.placement.pool == b.pool
    [d] = place([Ask(request(team="ml"))], pool_of([a, b]), p, now=T0)
    assert isinstance(d, Decision) and d.placement.pool == a.pool


def test_team_and_rule_residency_must_both_hold() -> None:
    p = policy("""
        residency:
          tags: {sovereign: [aws:eu-central-1, aws:us-east-1]}
        teams:
          eu: {residency: [eu]}
        rules:
          - name: s
            match: {team: eu}
            require: {residency: [sovereign]}
    """)
    c = allowed(p, team="eu")
    assert c.region_ok("aws", "eu-central-1")
    assert not c.region_ok("aws", "us-east-1")  # sovereign, but not eu
    assert not c.region_ok("aws", "eu-west-1")  # eu, but not sovereign


def test_forbids_names_what_changed() -> None:
    o = offer("us-east-1a")
    p = policy("teams:\n  eu: {residency: [eu]}\n")
    why = forbids(p, request(team="eu"), o.pool, "H100-80GB", 3.0)
    assert why and "aws/us-east-1" in why
    assert forbids(p, request(team="other"), o.pool, "H100-80GB", 3.0) is None
    p = policy("gpus: {deny: [H100-80GB]}\n")
    assert "H100-80GB" in (forbids(p, request(), o.pool, "H100-80GB", 3.0) or "")
    p = policy("defaults: {max_price_per_gpu_hour: 2}\n")
    assert "above the new cap" in (forbids(p, request(), o.pool, "H100-80GB", 3.0) or "")
