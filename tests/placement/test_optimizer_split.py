"""Requests split across pools (`gang: false`, `max_parts`): placement."""

from __future__ import annotations

import pytest
from factories import T0, offer, pool_of, request

from broker.model import RejectCode
from broker.placement.optimizer import SPLIT_MIN_SAVING, Ask, Decision, Rejection, place
from policies.model import Policy, Team

POLICY = Policy()


def test_a_request_no_pool_can_hold_is_split_when_allowed() -> None:
    pool = pool_of([offer("us-east-1a", price=24.0, capacity=1),
                    offer("us-east-1b", price=28.0, capacity=1),
                    offer("us-east-1c", price=40.0, capacity=5)])
    whole = place([Ask(request(gpus=16, gang=False))], pool, POLICY, now=T0)[0]
    assert isinstance(whole, Decision) and whole.placement.pool.zone == "us-east-1c"
    # With max_parts 2: the two cheapest pools, 8 GPUs each, cheapest first.
    [d] = place([Ask(request(gpus=16, gang=False, max_parts=2))], pool, POLICY, now=T0)
    assert isinstance(d, Decision)
    assert [(p.pool.zone, p.instances, gpus) for p, gpus in d.parts] == [
        ("us-east-1a", 1, 8), ("us-east-1b", 1, 8)]
    assert d.placement == d.parts[0][0]
    assert d.expected_cost_per_hour == pytest.approx(24.0 + 28.0)
    assert "split across 2 pools" in d.reason


def test_only_way_to_place_is_a_split() -> None:
    pool = pool_of([offer("us-east-1a", capacity=1), offer("us-east-1b", capacity=1),
                    offer("us-east-1c", capacity=1)])
    [no] = place([Ask(request(gpus=24))], pool, POLICY, now=T0)
    assert isinstance(no, Rejection) and no.code is RejectCode.NO_CAPACITY
    [d] = place([Ask(request(gpus=24, gang=False, max_parts=3))], pool, POLICY, now=T0)
    assert isinstance(d, Decision) and len(d.parts) == 3
    assert {p.pool.zone for p, _ in d.parts} == {"us-east-1a", "us-east-1b", "us-east-1c"}
    assert sum(g for _, g in d.parts) == 24
    # Two parts cannot hold 24 GPUs here: rejected, nothing half-placed.
    [r] = place([Ask(request(gpus=24, gang=False, max_parts=2))], pool, POLICY, now=T0)
    assert isinstance(r, Rejection) and r.code is RejectCode.NO_CAPACITY


def test_the_last_part_covers_the_rest_and_idle_gpus_count() -> None:
    # 10 GPUs with idle GPUs weighed at their price. Whole: three of c's 4-GPU instances
    # (27 + 2 idle × 2.25 = 31.5). Split: a's 8 GPUs (16), then the last part must cover
    # the other 2: one of c's instances (9 + 2 idle × 2.25 = 13.5), not one of b's
    # (16.5 + 6 idle × 2.06): 29.5 in all, 6 % below whole.
    pool = pool_of([offer("us-east-1a", price=16.0, capacity=1),
                    offer("us-east-1b", price=16.5, capacity=3),
                    offer("us-east-1c", gpus=4, price=9.0, capacity=3)])
    policy = Policy(scoring=POLICY.scoring.model_copy(update={"idle_gpu_weight": 1.0}))
    [whole] = place([Ask(request(gpus=10, gang=False))], pool, policy, now=T0)
    assert isinstance(whole, Decision)
    assert (whole.placement.pool.zone, whole.placement.instances) == ("us-east-1c", 3)
    assert whole.expected_cost_per_hour == pytest.approx(31.5)
    [d] = place([Ask(request(gpus=10, gang=False, max_parts=2))], pool, policy, now=T0)
    assert isinstance(d, Decision)
    assert [(p.pool.zone, p.instances, g) for p, g in d.parts] == [
        ("us-east-1a", 1, 8), ("us-east-1c", 1, 2)]
    assert d.expected_cost_per_hour == pytest.approx(29.5)


def test_a_whole_placement_is_kept_unless_the_split_saves_enough() -> None:
    # One pool holds 16 GPUs at 25/instance-h; two single-instance pools at 24.5: a 2 %
    # saving, under SPLIT_MIN_SAVING: stays whole.
    near = pool_of([offer("us-east-1a", price=25.0, capacity=2),
                    offer("us-east-1b", price=24.5, capacity=1),
                    offer("us-east-1c", price=24.5, capacity=1)])
    [d] = place([Ask(request(gpus=16, gang=False, max_parts=4))], near, POLICY, now=T0)
    assert isinstance(d, Decision) and not d.parts and d.placement.pool.zone == "us-east-1a"
    assert SPLIT_MIN_SAVING > 0.02
    # At 20/instance-h in b and c the split saves 20 %: split.
    far = pool_of([offer("us-east-1a", price=25.0, capacity=2),
                   offer("us-east-1b", price=20.0, capacity=1),
                   offer("us-east-1c", price=20.0, capacity=1)])
    [d] = place([Ask(request(gpus=16, gang=False, max_parts=4))], far, POLICY, now=T0)
    assert isinstance(d, Decision) and {p.pool.zone for p, _ in d.parts} == {
        "us-east-1b", "us-east-1c"}


def test_spot_gang_risk_makes_a_split_pay() -> None:
    # Four 1-GPU spot instances at a high rate: one pool is a gang of 4 (4 × the rate);
    # four pools are four 1-instance parts.
    offers = [offer(z, gpus=1, price=3.0, capacity=4, interruption_rate=0.5)
              for z in ("us-east-1a", "us-east-1b", "us-east-1c", "us-east-1d")]
    [d] = place([Ask(request(gpus=4, gang=False, max_parts=4))], pool_of(offers), POLICY,
                now=T0)
    assert isinstance(d, Decision) and len(d.parts) == 4


def test_a_split_uses_only_what_the_batch_left_and_respects_the_team() -> None:
    pool = pool_of([offer("us-east-1a", capacity=1), offer("us-east-1b", capacity=1),
                    offer("us-east-1c", capacity=1)])
    first, split = place([Ask(request("a", gpus=8)),
                          Ask(request("b", gpus=16, gang=False, max_parts=3))],
                         pool, POLICY, now=T0)
    assert isinstance(first, Decision) and isinstance(split, Decision)
    zones = [p.pool.zone for p, _ in split.parts]
    assert first.placement.pool.zone not in zones and len(zones) == 2
    # A team with 16 GPUs of max_gpus left cannot take 24 in parts either.
    policy = Policy(teams={"ml": Team(max_gpus=16)})
    [r] = place([Ask(request("c", gpus=24, gang=False, max_parts=3, team="ml"))],
                pool, policy, now=T0)
    assert isinstance(r, Rejection)


def test_a_split_keeps_to_the_price_cap_and_the_request_clouds() -> None:
    pool = pool_of([offer("us-east-1a", price=24.0, capacity=1),
                    offer("us-east-1b", price=80.0, capacity=1),
                    offer("z1", cloud="gcp", region="us-central1", price=24.0, capacity=1)])
    [r] = place([Ask(request(gpus=16, gang=False, max_parts=2, clouds=("aws",),
                             max_price_per_gpu_hour=5.0))], pool, POLICY, now=T0)
    assert isinstance(r, Rejection)
    [d] = place([Ask(request(gpus=16, gang=False, max_parts=2, max_price_per_gpu_hour=5.0))],
                pool, POLICY, now=T0)
    assert isinstance(d, Decision) and {p.pool.cloud for p, _ in d.parts} == {"aws", "gcp"}
