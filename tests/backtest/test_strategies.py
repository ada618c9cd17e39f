"""The baselines' policy: plain price whatever risk level the gpubroker policy names."""

from __future__ import annotations

from datetime import UTC, datetime

from broker.backtest.strategies import baseline_policy
from broker.model import Market, Offer, PlaceRequest, PoolKey
from broker.placement.cost import expected_cost
from policies.evaluate import risk_for
from policies.loader import parse_policy

POLICY = """
version: 1
scoring: {risk: fewest-interruptions}
teams:
  research: {risk: balanced}
  prod: {}
rules:
  - name: prod
    match: {team: prod}
    require: {risk: fewest-interruptions}
"""


def spot(rate: float) -> Offer:
    return Offer(pool=PoolKey("aws", "us-east-1", "us-east-1a", "g6.xlarge", Market.SPOT),
                 gpu="L4", gpus=1, gpu_memory_gb=24, vcpus=4, memory_gb=16,
                 price_per_hour=1.0, availability=0.3, capacity=5,
                 interruption_rate=rate, observed_at=datetime(2026, 12, 1, tzinfo=UTC))


def test_the_baselines_score_plain_price_whatever_level_the_policy_names() -> None:
    policy = parse_policy(POLICY, "policy.yaml")
    base = baseline_policy(policy)
    for team in (None, "research", "prod"):
        req = PlaceRequest(scheduler="s", request_id="r", gpu=("L4",), gpus=2, team=team)
        assert risk_for(policy, req) != "lowest-cost"
        level = risk_for(base, req)
        assert level == "lowest-cost", team
        for rate in (0.0, 0.3):
            # the expected cost of two instances is their price, risk or no risk
            assert expected_cost(spot(rate), 2, base.for_risk(level)) == 2.0
    # the gpubroker policy itself does weigh the risk
    req = PlaceRequest(scheduler="s", request_id="r", gpu=("L4",), gpus=2)
    assert expected_cost(spot(0.3), 2, policy.for_risk(risk_for(policy, req))) > 2.5
