"""Why a request would be placed where it would (`gpubroker policy explain`): every offer
judged by the rules' table (`broker.placement.rules`), the excluded counted by the first
rule they fail, the rest ranked by the cost the optimizer ranks options by
(`broker.placement.cost.option_cost`, at the request's risk level)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from broker.market.hazard import Hazard
from broker.model import Offer, Placement
from broker.placement import rules
from broker.placement.cost import cost_terms, option_cost, signals
from broker.placement.outcomes import Ask, constraints_for
from broker.placement.rules import Probe
from broker.placement.view import PoolView, hazard_for
from policies.evaluate import Denied
from policies.evaluate import describe as describe_constraints
from policies.model import Policy


def explain(ask: Ask, view: PoolView, policy: Policy, *, now: datetime, top: int = 5,
            all_gpus: Sequence[str] = ()) -> dict[str, Any]:
    """Why a request would be placed where it would: the policy's verdict, every offer
    that was excluded counted by reason (the first rule of `rules.RULES` it fails, the
    team's remaining budget included: a request alone), and the best candidates with
    their expected cost broken down. Scans everything (no early stop); for
    `gpubroker policy explain`, not the hot path."""
    req = ask.request
    c = constraints_for(ask, policy)
    out: dict[str, Any] = {"request_id": req.request_id}
    if isinstance(c, Denied):
        out["verdict"] = {"denied": c.code.value, "detail": c.detail}
        return out
    out["verdict"] = describe_constraints(c)
    policy = policy.for_risk(c.risk)  # the request's costs are scored at its level
    probe = Probe(req, c, view, policy, ask.exclude, view.stale_slices(now), view.cooling(now))
    excluded: Counter[str] = Counter()
    hazard = hazard_for(view, policy, req)
    candidates: list[tuple[float, Offer, int]] = []
    for gpu in dict.fromkeys([*c.gpus, *all_gpus]):
        for offer in view.by_gpu(gpu):
            instances = rules.instances_for(req.gpus, offer.gpus)
            failed = rules.first_failing(probe, offer, instances)
            if failed is not None:
                excluded[failed.message] += 1
                continue
            share = c.zone_share.get((offer.pool.cloud, offer.pool.zone), 0.0)
            candidates.append((option_cost(offer, instances, req.gpus, policy, share, hazard),
                               offer, instances))
    candidates.sort(key=lambda t: (t[0], t[1].pool))
    out["excluded"] = dict(excluded.most_common())
    out["feasible"] = len(candidates)
    out["candidates"] = [{
        "placement": Placement.of(o, n).to_json(),
        "expected_cost_per_hour": round(cost, 6),
        "price_per_hour": round(n * o.price_per_hour, 6),  # type: ignore[operator]
        "terms": {k: round(v, 6) for k, v in cost_terms(
            o, policy, c.zone_share.get((o.pool.cloud, o.pool.zone), 0.0), hazard, n,
            need=req.gpus).items()},
        "availability": o.availability, "interruption_rate": o.interruption_rate,
        **_scored_with(o, policy, hazard),
    } for cost, o, n in candidates[:top]]
    return out


def _scored_with(offer: Offer, policy: Policy, hazard: Hazard | None
                 ) -> dict[str, Any]:
    """The signals a candidate was scored with, when they are the hazard estimator's."""
    rate, avail = signals(offer, policy, hazard)
    if (rate, avail) == (offer.interruption_rate, offer.availability):
        return {}
    return {"expected_over_job": {"availability": avail, "interruption_rate": rate}}
