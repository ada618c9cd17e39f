"""The expected cost an option is ranked by, written once: `expected_cost` (the price with
its risk terms, `cost_terms`), plus the idle-GPU term (`option_cost`); and the hazard
estimates spot risk is scored with over a request's horizon."""

from __future__ import annotations

from broker.market.hazard import Hazard, HazardEstimator
from broker.model import Market, Offer
from policies.model import Policy


def by_horizon(hazard: HazardEstimator | None, policy: Policy) -> bool:
    """Whether spot risk is scored over each request's own horizon: with an estimator the
    policy uses (`scoring.hazard_half_life_hours` > 0); otherwise every horizon scores
    alike, and all share `DEFAULT_HORIZON`'s."""
    return hazard is not None and policy.scoring.hazard_half_life_hours > 0


def hazard_over(hazard: HazardEstimator | None, policy: Policy, hours: float
                ) -> Hazard | None:
    """The estimates spot risk is scored with over `hours`."""
    return hazard.at(hours) if hazard is not None and by_horizon(hazard, policy) else hazard


def unit_cost(offer: Offer, policy: Policy, hazard: Hazard | None) -> float:
    """The expected cost of one of the offer's GPUs for an hour (`expected_cost` of one
    instance, per GPU): no option on the offer costs less per GPU asked for."""
    return expected_cost(offer, 1, policy, hazard=hazard) / offer.gpus



def signals(offer: Offer, policy: Policy, hazard: Hazard | None = None
            ) -> tuple[float | None, float | None]:
    """The interruption rate and availability an offer is scored with: for a spot pool
    the `hazard` estimator knows, what it expects over a job (when the policy's
    `scoring.hazard_half_life_hours` is not 0); otherwise the offer's own (None:
    unknown)."""
    rate, avail = offer.interruption_rate, offer.availability
    if hazard is not None and offer.pool.market is Market.SPOT and \
            policy.scoring.hazard_half_life_hours > 0:
        est = hazard.estimate(offer.pool)
        if est is not None:
            if est[0] is not None:
                rate = est[0]
            if est[1] is not None:
                avail = est[1]
    return rate, avail



def _terms(offer: Offer, instances: int, policy: Policy, zone_share: float,
           hazard: Hazard | None) -> tuple[float, float, float, float]:
    """The one cost formula's terms for `instances` of an offer: the availability,
    restart and spread multipliers of their price, and the interruption cost per hour of
    the gang (`expected_cost` says how they add up)."""
    s = policy.scoring
    spot = offer.pool.market is Market.SPOT
    if hazard is not None and spot:
        rate, avail = signals(offer, policy, hazard)
    else:
        rate, avail = offer.interruption_rate, offer.availability
    availability = s.availability_weight * (
        1.0 - (avail if avail is not None else s.unknown_availability))
    restart = extra = 0.0
    if spot:
        if rate is None:
            rate = s.unknown_interruption_rate
        rate *= instances  # the gang's
        restart = s.restart_hours * rate
        if s.interruption_cost_per_gpu:
            extra = offer.gpus * s.interruption_cost_per_gpu * rate
    spread = s.spread_weight * zone_share if zone_share else 0.0
    return availability, restart, spread, extra


def cost_terms(offer: Offer, policy: Policy, zone_share: float = 0.0,
               hazard: Hazard | None = None, instances: int = 1, need: int | None = None
               ) -> dict[str, float]:
    """The expected-cost terms of `instances` of an offer, each as a share of their price
    (`option_cost` = price × (1 + their sum)); `idle` when `need`, the GPUs asked for,
    is given."""
    availability, restart, spread, extra = _terms(offer, instances, policy, zone_share,
                                                  hazard)
    price = offer.price_per_hour or 0.0
    out = {"interruption": restart + (extra / price if price else 0.0),
           "availability": availability, "spread": spread}
    if need is not None:
        paid = instances * offer.gpus
        out["idle"] = policy.scoring.idle_gpu_weight * (paid - need) / paid
    return out


def expected_cost(offer: Offer, instances: int, policy: Policy,
                  zone_share: float = 0.0, hazard: Hazard | None = None) -> float:
    """instances × (price × (1 + availability + restart + spread terms) + the gang's
    interruption cost per hour) (`_terms`). With a `hazard` estimator, a spot pool's
    signals are the ones it expects over a job (`signals`).

    A spot pool's interruption rate is per instance, and a lease of n instances is a
    gang: it is interrupted when any of them is (n × the rate, instances taken as
    independent), and then all of its work since the last checkpoint is lost, so its
    interruption terms grow with n² — fewer, larger instances are safer at one price
    per GPU. The cost per GPU is therefore lowest for one instance: `unit_cost`, the
    bound the walks stop at, stays a bound."""
    assert offer.price_per_hour is not None
    availability, restart, spread, extra = _terms(offer, instances, policy, zone_share,
                                                  hazard)
    return instances * (offer.price_per_hour * (1.0 + availability + restart + spread)
                        + extra)


def idle_cost(policy: Policy, paid: int, need: int, price_per_gpu: float) -> float:
    """`scoring.idle_gpu_weight` × the price of the GPUs paid for (`paid`) but not asked
    for (`need`)."""
    return policy.scoring.idle_gpu_weight * (paid - need) * price_per_gpu


def option_cost(offer: Offer, instances: int, need: int, policy: Policy,
                zone_share: float = 0.0, hazard: Hazard | None = None) -> float:
    """The expected cost per hour of placing `need` GPUs on `instances` of an offer:
    `expected_cost` plus `idle_cost` (what candidates are ranked by)."""
    cost = expected_cost(offer, instances, policy, zone_share, hazard)
    if policy.scoring.idle_gpu_weight:
        price = instances * offer.price_per_hour  # type: ignore[operator]
        cost += idle_cost(policy, instances * offer.gpus, need,
                          price / (instances * offer.gpus))
    return cost
