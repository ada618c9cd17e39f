"""The placement optimizer: a pure function from (requests, pool, policy) to decisions.

For each request it picks the feasible offer with the lowest expected cost per hour:

    instances × price × (1 + restart_hours × interruption_rate
                           + availability_weight × (1 − availability)
                           + spread_weight × share of the team's GPUs in that zone)

where interruption risk counts for spot only and unknown signals take the policy's
`unknown_*` values. Paid-for GPUs left idle (an 8-GPU instance for 6 GPUs) are in the
price, so they count too. What may be placed where is the policy's verdict on the
request (`policies.evaluate.Constraints`): GPU models with their equivalents, markets,
clouds, regions and residency, price cap, and what is left of the team's budget. A spot
pool is skipped when it is not at least `scoring.spot_min_discount` cheaper than
on-demand for the same instance type in the same zone.

Requests come in batches; capacity (and quota) an earlier request of the batch takes in
a pool is not offered to a later one. Quota shared by several pools of a family is
checked per pool here; the global optimizer accounts for it across pools. This version
places the batch's requests one after another in order; the interface is the one a
global optimizer will keep.

No I/O here: the pool is read through the small `PoolView` protocol.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from broker.model import Market, Offer, Placement, PlaceRequest, PoolKey, RejectCode
from policies.evaluate import Constraints, Denied, evaluate
from policies.evaluate import describe as describe_constraints
from policies.model import Policy

ALTERNATIVES = 3


class PoolView(Protocol):
    def by_gpu(self, gpu: str, market: Market | None = None) -> Sequence[Offer]:
        """Priced offers of `gpu` in `market`, cheapest per GPU-hour first."""

    def stale_slices(self, now: datetime) -> Collection[Hashable]:
        """Slices (as `slice_of` names them) whose offers must not be placed on."""

    def slice_of(self, key: PoolKey) -> Hashable | None: ...

    def cooling(self, now: datetime) -> Collection[PoolKey]:
        """Pools that take no new placements now."""

    def held(self, key: PoolKey) -> int:
        """Instances of `key` the broker's leases already hold."""

    def get(self, key: PoolKey) -> Offer | None: ...


@dataclass(frozen=True, slots=True)
class Ask:
    """One request to place. `exclude` keeps pools out (a failover never goes back to the
    pool that just failed). `constraints` is the policy's verdict on the request (with the
    team's usage); without one it is evaluated here against an idle team."""

    request: PlaceRequest
    exclude: frozenset[PoolKey] = frozenset()
    constraints: Constraints | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    ask: Ask
    placement: Placement
    expected_cost_per_hour: float
    reason: str
    alternatives: tuple[Placement, ...]


@dataclass(frozen=True, slots=True)
class Rejection:
    ask: Ask
    code: RejectCode
    detail: str
    retry_after_seconds: float | None = None


Outcome = Decision | Rejection


@dataclass(slots=True)
class _Scan:
    """What a request's search saw, to name the binding constraint if nothing fits."""

    matching: int = 0  # fresh offers of an acceptable model/market/cloud/region
    policy_excluded: int = 0  # offers the request alone would take, the policy forbids
    under_cap: int = 0
    over_budget: int = 0
    cheapest_ppg: float = math.inf
    best: list[tuple[float, int, Offer, int]] = field(default_factory=list)


def cost_terms(offer: Offer, policy: Policy, zone_share: float = 0.0) -> dict[str, float]:
    """The expected-cost multipliers of an offer, each as a share of its price."""
    s = policy.scoring
    risk = 0.0
    if offer.pool.market is Market.SPOT:
        rate = (offer.interruption_rate if offer.interruption_rate is not None
                else s.unknown_interruption_rate)
        risk = s.restart_hours * rate
    avail = offer.availability if offer.availability is not None else s.unknown_availability
    return {"interruption": risk, "availability": s.availability_weight * (1 - avail),
            "spread": s.spread_weight * zone_share}


def expected_cost(offer: Offer, instances: int, policy: Policy,
                  zone_share: float = 0.0) -> float:
    """instances × price × (1 + the `cost_terms`), computed inline: this runs for every
    candidate of every request."""
    s = policy.scoring
    assert offer.price_per_hour is not None
    avail = offer.availability
    factor = 1.0 + s.availability_weight * (
        1.0 - (avail if avail is not None else s.unknown_availability))
    if offer.pool.market is Market.SPOT:
        rate = offer.interruption_rate
        factor += s.restart_hours * (rate if rate is not None else s.unknown_interruption_rate)
    if zone_share:
        factor += s.spread_weight * zone_share
    return instances * offer.price_per_hour * factor


def constraints_for(ask: Ask, policy: Policy) -> Constraints | Denied:
    return ask.constraints if ask.constraints is not None else evaluate(policy, ask.request)


def spot_discount_ok(offer: Offer, view: PoolView, min_discount: float) -> bool:
    """Whether a spot offer is at least `min_discount` cheaper than on-demand for the same
    instance type in the same zone (true when there is nothing to compare with)."""
    if min_discount <= 0 or offer.pool.market is not Market.SPOT:
        return True
    od = view.get(offer.pool._replace(market=Market.ON_DEMAND))
    if od is None or od.price_per_hour is None or offer.price_per_hour is None:
        return True
    return offer.price_per_hour <= od.price_per_hour * (1 - min_discount)


@dataclass(slots=True)
class _Batch:
    """What one batch shares: the pool's state now, and what its decisions took."""

    view: PoolView
    policy: Policy
    stale: Collection[Hashable]
    cooling: Collection[PoolKey]
    retry_after: float | None
    taken: Counter[PoolKey] = field(default_factory=Counter)  # instances
    taken_gpus: Counter[PoolKey] = field(default_factory=Counter)


def place(asks: Sequence[Ask], view: PoolView, policy: Policy, *, now: datetime,
          retry_after_seconds: float | None = None) -> list[Outcome]:
    """Place each ask of a batch; capacity taken by one is not offered to the next."""
    batch = _Batch(view, policy, view.stale_slices(now), view.cooling(now),
                   retry_after_seconds)
    out: list[Outcome] = []
    for ask in asks:
        outcome = _place_one(ask, batch)
        if isinstance(outcome, Decision):
            batch.taken[outcome.placement.pool] += outcome.placement.instances
            batch.taken_gpus[outcome.placement.pool] += outcome.placement.total_gpus
        out.append(outcome)
    return out


def _place_one(ask: Ask, b: _Batch) -> Outcome:
    req = ask.request
    view, policy = b.view, b.policy
    c = constraints_for(ask, policy)
    if isinstance(c, Denied):
        return Rejection(ask, c.code, c.detail, None)
    cap, budget = c.cap, c.budget_left
    own_clouds = set(req.clouds) if req.clouds else None
    own_regions = set(req.regions) if req.regions else None
    exclude, stale, cooling = ask.exclude, b.stale, b.cooling
    taken, taken_gpus = b.taken, b.taken_gpus
    min_discount = policy.scoring.spot_min_discount
    zone_share = c.zone_share
    need = req.gpus
    scan = _Scan()
    keep = ALTERNATIVES + 1
    best = scan.best
    tiebreak = 0
    for gpu in c.gpus:
        for m in c.markets:
            for offer in view.by_gpu(gpu, m):
                key = offer.pool
                if own_clouds is not None and key.cloud not in own_clouds:
                    continue
                if own_regions is not None and key.region not in own_regions:
                    continue
                if (exclude and key in exclude) or (cooling and key in cooling) or \
                        (stale and view.slice_of(key) in stale):
                    continue
                if not c.region_ok(key.cloud, key.region):
                    scan.policy_excluded += 1
                    continue
                ppg = offer.price_per_hour / offer.gpus  # type: ignore[operator]
                scan.matching += 1
                if ppg < scan.cheapest_ppg:
                    scan.cheapest_ppg = ppg
                if cap is not None and ppg > cap:
                    break  # sorted by price per GPU-hour: the rest are dearer still
                scan.under_cap += 1
                # Any later offer costs at least need × its ppg: stop when that cannot win.
                if len(best) == keep and need * ppg > -best[0][0]:
                    break
                instances = -(-need // offer.gpus)
                capacity = offer.capacity
                if capacity is not None and \
                        capacity - view.held(key) - taken[key] < instances:
                    continue
                quota = offer.quota_headroom
                if quota is not None and quota - taken_gpus[key] < instances * offer.gpus:
                    continue
                if min_discount and not spot_discount_ok(offer, view, min_discount):
                    continue
                if budget is not None and \
                        instances * offer.price_per_hour > budget:  # type: ignore[operator]
                    scan.over_budget += 1
                    continue
                share = zone_share.get((key.cloud, key.zone), 0.0) if zone_share else 0.0
                cost = expected_cost(offer, instances, policy, share)
                tiebreak += 1
                if len(best) < keep:
                    heapq.heappush(best, (-cost, -tiebreak, offer, instances))
                elif cost < -best[0][0]:
                    heapq.heapreplace(best, (-cost, -tiebreak, offer, instances))
    if not best:
        return _reject(ask, c, scan, b.retry_after)
    ranked = [(-cost, Placement.of(o, n), o) for cost, _, o, n in sorted(best, reverse=True)]
    cost, chosen, offer = ranked[0]
    return Decision(
        ask=ask,
        placement=chosen,
        expected_cost_per_hour=cost,
        reason=_reason(chosen, offer, cost, req.duration_hours, c.rule),
        alternatives=tuple(p for _, p, _ in ranked[1:]),
    )


def _reason(placement: Placement, offer: Offer, cost: float, duration: float | None,
            rule: str | None = None) -> str:
    bits = [
        f"lowest expected cost: {placement.pool.market.value} {placement.gpu} "
        f"{placement.pool.cloud}/{placement.pool.zone} {placement.pool.instance_type}",
        f"${placement.price_per_gpu_hour:.4g}/GPU-h",
        f"expected ${cost:.4g}/h",
    ]
    if offer.availability is not None:
        bits.append(f"availability {offer.availability:.2f}")
    if offer.interruption_rate is not None and placement.pool.market is Market.SPOT:
        bits.append(f"interruptions {offer.interruption_rate:.3g}/h")
    if duration:
        bits.append(f"≈${cost * duration:.2f} over {duration:g}h")
    if rule:
        bits.append(f"under rule {rule!r}")
    return ", ".join(bits)


def _reject(ask: Ask, c: Constraints, scan: _Scan, retry_after: float | None) -> Rejection:
    req = ask.request
    market = "any" if len(c.markets) == 2 else c.markets[0].value
    what = f"{req.gpus}×{'|'.join(c.gpus)} ({market})"
    cap = c.cap
    if not scan.matching and scan.policy_excluded:
        where = f"rule {c.rule!r}" if c.rule else "the policy"
        if c.residency:
            where += " (residency " + " and ".join("|".join(sorted(t)) for t in c.residency) + ")"
        return Rejection(ask, RejectCode.POLICY_DENIED,
                         f"{where} excludes every one of the {scan.policy_excluded} fresh "
                         f"offer(s) of {what}", retry_after)
    if scan.matching and not scan.under_cap and cap is not None:
        return Rejection(ask, RejectCode.OVER_PRICE_CAP,
                         f"no {what} at or under ${cap:g}/GPU-h; cheapest fresh offer is "
                         f"${scan.cheapest_ppg:.4g}/GPU-h", retry_after)
    if scan.over_budget and c.budget_left is not None:
        return Rejection(ask, RejectCode.OVER_BUDGET,
                         f"team {req.team!r} has ${c.budget_left:.2f}/h left of its "
                         f"budget_per_hour; no {what} with free capacity fits in it",
                         retry_after)
    if not scan.matching:
        detail = f"no fresh offer of {what}"
        if req.clouds:
            detail += f" in clouds {','.join(req.clouds)}"
        if req.regions:
            detail += f" in regions {','.join(req.regions)}"
    else:
        detail = (f"{scan.under_cap} pool(s) offer {what} within the price cap, but none has "
                  f"free capacity or quota for {req.gpus} GPUs in one zone")
    return Rejection(ask, RejectCode.NO_CAPACITY, detail, retry_after)


def explain(ask: Ask, view: PoolView, policy: Policy, *, now: datetime, top: int = 5,
            all_gpus: Sequence[str] = ()) -> dict[str, Any]:
    """Why a request would be placed where it would: the policy's verdict, every offer
    that was excluded counted by reason, and the best candidates with their expected cost
    broken down. Scans everything (no early stop); for `gpubroker policy explain`, not the
    hot path."""
    req = ask.request
    c = constraints_for(ask, policy)
    out: dict[str, Any] = {"request_id": req.request_id}
    if isinstance(c, Denied):
        out["verdict"] = {"denied": c.code.value, "detail": c.detail}
        return out
    out["verdict"] = describe_constraints(c)
    excluded: Counter[str] = Counter()
    stale, cooling = view.stale_slices(now), view.cooling(now)
    candidates: list[tuple[float, Offer, int, dict[str, float]]] = []
    models = list(dict.fromkeys([*c.gpus, *all_gpus]))
    for gpu in models:
        for offer in view.by_gpu(gpu):
            key = offer.pool
            reason = None
            instances = -(-req.gpus // offer.gpus)
            ppg = offer.price_per_hour / offer.gpus  # type: ignore[operator]
            capacity = offer.capacity
            if gpu not in c.gpus:
                reason = "GPU model not acceptable"
            elif key.market not in c.markets:
                reason = "market not allowed"
            elif (req.clouds and key.cloud not in req.clouds) or \
                    (req.regions and key.region not in req.regions):
                reason = "outside the request's clouds/regions"
            elif not c.region_ok(key.cloud, key.region):
                reason = "cloud/region/residency not allowed by the policy"
            elif key in ask.exclude or key in cooling:
                reason = "pool in a cool-down"
            elif view.slice_of(key) in stale:
                reason = "offer is stale"
            elif c.cap is not None and ppg > c.cap:
                reason = "over the price cap"
            elif capacity is not None and capacity - view.held(key) < instances:
                reason = "not enough free capacity"
            elif offer.quota_headroom is not None and \
                    offer.quota_headroom < instances * offer.gpus:
                reason = "not enough quota"
            elif not spot_discount_ok(offer, view, policy.scoring.spot_min_discount):
                reason = "spot discount under spot_min_discount"
            elif c.budget_left is not None and \
                    instances * offer.price_per_hour > c.budget_left:  # type: ignore[operator]
                reason = "over the team's remaining budget"
            if reason:
                excluded[reason] += 1
                continue
            share = c.zone_share.get((key.cloud, key.zone), 0.0)
            terms = cost_terms(offer, policy, share)
            candidates.append((expected_cost(offer, instances, policy, share), offer,
                               instances, terms))
    candidates.sort(key=lambda t: (t[0], t[1].pool))
    out["excluded"] = dict(excluded.most_common())
    out["feasible"] = len(candidates)
    out["candidates"] = [{
        "placement": Placement.of(o, n).to_json(),
        "expected_cost_per_hour": round(cost, 6),
        "price_per_hour": round(n * o.price_per_hour, 6),  # type: ignore[operator]
        "terms": {k: round(v, 6) for k, v in terms.items()},
        "availability": o.availability, "interruption_rate": o.interruption_rate,
    } for cost, o, n, terms in candidates[:top]]
    return out
