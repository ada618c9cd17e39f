"""The one-word trade-off between price and interruptions (`risk`), and the table that
says what each word means: the values of `scoring`'s three risk weights.

A policy's `scoring.risk` sets the level for everyone; a team's `risk` or a rule's
`require.risk` sets it for their requests (a matching rule's over the team's over the
policy's). Weights written in `scoring:` tune the policy-wide level only; a request at
another level is scored with that level's weights from `RISK_PRESETS`, every other
scoring setting (unknown signals, spread, idle GPUs, spot discount, hazard half-life)
kept from the policy.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

RiskLevel = Literal["lowest-cost", "balanced", "fewest-interruptions"]
RISK_LEVELS: tuple[RiskLevel, ...] = get_args(RiskLevel)
DEFAULT_RISK: RiskLevel = "balanced"


class RiskWeights(NamedTuple):
    """The scoring weights a risk level sets (`policies.model.Scoring` says what each
    weighs)."""

    restart_hours: float
    availability_weight: float
    interruption_cost_per_gpu: float


# Chosen on the backtest's tuning seeds 7-11 (`python bench/backtest.py --tune`: the
# simulated week, interruptions independent and correlated) and reported on its
# held-out seeds 101-105, never on the seeds they were chosen on. Tune them here and
# nowhere else. On the tuning seeds, against cheapest-spot and a per-cloud
# price-capacity-optimized allocation (independent / correlated market):
#   balanced              +0.5 % / +0.7 % cost, -20 % / -18 % interruptions vs cheapest-spot
#                         ($0.5 per GPU: +1.9 % / +2.1 %, over the 1 % the level allows)
#   fewest-interruptions  1.00 / 1.01 × price-capacity's cost, 0.63 / 0.90 × its
#                         interruptions ($10 per GPU: 1.04 / 1.05 ×, 0.56 / 0.84 ×)
RISK_PRESETS: dict[RiskLevel, RiskWeights] = {
    # Plain price for spot as for on-demand, as cheapest-spot chooses.
    "lowest-cost": RiskWeights(restart_hours=0.0, availability_weight=0.0,
                               interruption_cost_per_gpu=0.0),
    # The work an interruption loses (half an hour of the gang's) and the pool's capacity
    # signal: within 1 % of the lowest price, with fewer interruptions.
    "balanced": RiskWeights(restart_hours=0.5, availability_weight=0.25,
                            interruption_cost_per_gpu=0.0),
    # And $5 per GPU for each interruption: the calmer pools, at about what
    # price-capacity-optimized pays.
    "fewest-interruptions": RiskWeights(restart_hours=0.5, availability_weight=0.25,
                                        interruption_cost_per_gpu=5.0),
}
"""Per risk level, the values of the three risk weights."""

RISK_WEIGHTS: tuple[str, ...] = RiskWeights._fields
"""The names of the scoring fields a risk level sets."""


def preset_of(level: object) -> RiskWeights | None:
    """The weights of `level`, or None when it is not a risk level."""
    for name, weights in RISK_PRESETS.items():
        if level == name:
            return weights
    return None
