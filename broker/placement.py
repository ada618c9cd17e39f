"""The placement optimizer: a pure function from (requests, pool, policy) to decisions.

For each request it picks the feasible offer with the lowest expected cost per hour:

    instances × price × (1 + restart_hours × interruption_rate
                           + availability_weight × (1 − availability))

where interruption risk counts for spot only and unknown signals take the policy's
`unknown_*` values. Paid-for GPUs left idle (an 8-GPU instance for 6 GPUs) are in the
price, so they count too.

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
from typing import Protocol

from broker.model import Market, Offer, Placement, PlaceRequest, PoolKey, RejectCode
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


@dataclass(frozen=True, slots=True)
class Ask:
    """One request to place. `exclude` keeps pools out (a failover never goes back to the
    pool that just failed); `gpu` is the list of acceptable models, in preference order."""

    request: PlaceRequest
    exclude: frozenset[PoolKey] = frozenset()


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
    under_cap: int = 0
    cheapest_ppg: float = math.inf
    best: list[tuple[float, int, Offer, int]] = field(default_factory=list)


def effective_market(request: PlaceRequest, policy: Policy) -> str:
    return request.market or policy.defaults.market


def effective_cap(request: PlaceRequest, policy: Policy) -> float | None:
    return (request.max_price_per_gpu_hour
            if request.max_price_per_gpu_hour is not None
            else policy.defaults.max_price_per_gpu_hour)


def expected_cost(offer: Offer, instances: int, policy: Policy) -> float:
    s = policy.scoring
    assert offer.price_per_hour is not None
    risk = 0.0
    if offer.pool.market is Market.SPOT:
        rate = (offer.interruption_rate if offer.interruption_rate is not None
                else s.unknown_interruption_rate)
        risk = s.restart_hours * rate
    avail = offer.availability if offer.availability is not None else s.unknown_availability
    return instances * offer.price_per_hour * (1.0 + risk + s.availability_weight * (1 - avail))


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
    market = effective_market(req, policy)
    markets = (Market.SPOT, Market.ON_DEMAND) if market == "any" else (Market(market),)
    cap = effective_cap(req, policy)
    clouds = set(req.clouds) if req.clouds else None
    regions = set(req.regions) if req.regions else None
    exclude, stale, cooling = ask.exclude, b.stale, b.cooling
    taken, taken_gpus = b.taken, b.taken_gpus
    need = req.gpus
    scan = _Scan()
    keep = ALTERNATIVES + 1
    best = scan.best
    tiebreak = 0
    for gpu in dict.fromkeys(req.gpu):
        for m in markets:
            for offer in view.by_gpu(gpu, m):
                key = offer.pool
                if clouds is not None and key.cloud not in clouds:
                    continue
                if regions is not None and key.region not in regions:
                    continue
                if (exclude and key in exclude) or (cooling and key in cooling) or \
                        (stale and view.slice_of(key) in stale):
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
                cost = expected_cost(offer, instances, policy)
                tiebreak += 1
                if len(best) < keep:
                    heapq.heappush(best, (-cost, -tiebreak, offer, instances))
                elif cost < -best[0][0]:
                    heapq.heapreplace(best, (-cost, -tiebreak, offer, instances))
    if not best:
        return _reject(ask, scan, cap, market, b.retry_after)
    ranked = [(-c, Placement.of(o, n), o) for c, _, o, n in sorted(best, reverse=True)]
    cost, chosen, offer = ranked[0]
    return Decision(
        ask=ask,
        placement=chosen,
        expected_cost_per_hour=cost,
        reason=_reason(chosen, offer, cost, req.duration_hours),
        alternatives=tuple(p for _, p, _ in ranked[1:]),
    )


def _reason(placement: Placement, offer: Offer, cost: float, duration: float | None) -> str:
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
    return ", ".join(bits)


def _reject(ask: Ask, scan: _Scan, cap: float | None, market: str,
            retry_after: float | None) -> Rejection:
    req = ask.request
    what = f"{req.gpus}×{'|'.join(req.gpu)} ({market})"
    if scan.matching and not scan.under_cap and cap is not None:
        return Rejection(ask, RejectCode.OVER_PRICE_CAP,
                         f"no {what} at or under ${cap:g}/GPU-h; cheapest fresh offer is "
                         f"${scan.cheapest_ppg:.4g}/GPU-h", retry_after)
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
