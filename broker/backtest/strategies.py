"""The placement strategies a backtest compares.

Every strategy places the same requests on the same pool, under the same feasibility
rules: fresh offers of an acceptable GPU model, market, cloud and region, under the price
cap, with free capacity (the cloud's estimate less what leases hold) and quota, not in a
cool-down. They differ only in which feasible offer they choose, first and on failover:

* `on_demand` — every request on on-demand (a spot-only request too: this is the
  "no spot at all" reference), the cheapest price for the GPUs asked. Goes through
  `broker.placement.optimizer.place` with a policy whose scoring weights are all zero, so the
  expected cost is the plain price; failover through `broker.leasing.failover.replacement`.
* `cheapest_spot` — spot first, the cheapest price (the way SkyPilot and dstack choose);
  on-demand when no spot offer fits. `placement.place` with the zero-weight policy, once
  with the request narrowed to spot, then (for what is left) to on-demand; failover the
  same way through `failover.replacement`.
* `price_capacity` — EC2 Fleet's price-capacity-optimized allocation (which Karpenter
  uses for spot) as it really works, within one cloud on that cloud's own capacity
  signal: in each cloud, spot pools ranked by availability, then price; across clouds,
  the cheapest of each cloud's pick. On-demand when no spot fits. The lexicographic
  ranking is not an expected cost, so spot is chosen by `choose_price_capacity` below,
  over the same `PoolView` with the same feasibility rules; the on-demand fallback goes
  through `placement.place` like `cheapest_spot`'s. Availability is bucketed into ten
  levels relative to the cloud's most available pool (like EC2's spot placement scores
  1-10, and because the clouds' scales differ) so that price still decides between
  pools of about the same availability.
* `gpubroker` — `placement.place` with the policy (the expected-cost optimizer and
  whatever the policy says), failover through `failover.replacement` and the policy's
  ladder: exactly what the daemon does.

The baselines' policies are copies of the gpubroker policy with the scoring weights
zeroed and no failover ladder, so allow/deny lists, teams, rules and failover triggers
apply to all four alike. A request that pins a market (`spot` or `on_demand`) is
honoured by the three spot-capable strategies; `any` (or the policy's default) is
theirs to choose.

Paid-for capacity (market `reserved`: a private pool, `--private-gpus`) serves a request
for spot or on-demand too (`broker.model.markets_for`), for every strategy: `on_demand`
and `gpubroker` see it beside the other markets (at a marginal price of 0 it is the
cheapest option); `cheapest_spot` takes the cheapest of spot and paid-for capacity
first, then of on-demand and paid-for capacity; `price_capacity` ranks it with spot (its
availability is 1, so it comes first, as EC2 Fleet uses capacity reservations first).
A request for `reserved` alone goes to the first pass, narrowed to it.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any

from broker.backtest import STRATEGIES
from broker.backtest.draws import HazardSchedule
from broker.leasing import failover
from broker.model import (
    Lease,
    Market,
    Offer,
    Placement,
    PlaceRequest,
    PoolKey,
    RejectCode,
    markets_for,
)
from broker.placement import optimizer, rules
from broker.placement.optimizer import Ask, Decision, Outcome, PoolView, Rejection
from policies.evaluate import Constraints, Denied, evaluate
from policies.model import Policy, Scoring
from policies.residency import Residency

RequestId = tuple[str, str]
Placer = Callable[[Sequence[Ask], PoolView, datetime], list[Outcome]]


def baseline_policy(policy: Policy) -> Policy:
    """`policy` with every scoring weight zeroed (expected cost = price: the risk level
    `lowest-cost`, and no team or rule naming another), no failover ladder and no
    re-optimisation of running leases; everything else (lists, teams, rules, triggers,
    anti-flap limits, cool-down) kept."""
    s = policy.scoring
    scoring = Scoring(risk="lowest-cost", restart_hours=0.0, availability_weight=0.0,
                      interruption_cost_per_gpu=0.0, spread_weight=0.0,
                      unknown_interruption_rate=s.unknown_interruption_rate,
                      unknown_availability=s.unknown_availability, spot_min_discount=0.0,
                      hazard_half_life_hours=0.0)
    teams = {name: team.model_copy(update={"risk": None})
             for name, team in policy.teams.items()}
    rules_ = [r if r.require is None else r.model_copy(update={
        "require": r.require.model_copy(update={"risk": None})}) for r in policy.rules]
    return policy.model_copy(update={
        "scoring": scoring, "teams": teams, "rules": rules_,
        "failover": policy.failover.model_copy(update={"ladder": [],
                                                        "reoptimize_min_saving": None}),
    })


def rid(req: PlaceRequest) -> RequestId:
    return (req.scheduler, req.request_id)


class Strategy(ABC):
    """Chooses placements. The engine gives it asks whose `constraints` are the policy's
    verdict on the request (with its team's usage), and leases to move."""

    name: str
    how: str

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.resident = Residency(policy.residency.tags)

    def adapt(self, req: PlaceRequest) -> PlaceRequest:
        """The request as this strategy sends it (unchanged but for `on_demand`)."""
        return req

    @abstractmethod
    def place(self, asks: Sequence[Ask], view: PoolView, now: datetime) -> list[Outcome]:
        """One outcome per ask (matched to its ask by scheduler and request_id)."""

    @abstractmethod
    def move(self, lease: Lease, view: PoolView, now: datetime) -> Outcome:
        """Where a failing lease goes (never back to its pool)."""

    def _markets(self, req: PlaceRequest) -> tuple[Market, ...]:
        choice = req.market or self.policy.defaults.market
        return (Market.SPOT, Market.ON_DEMAND) if choice == "any" else (Market(choice),)

    def _placement(self, asks: Sequence[Ask], view: PoolView, now: datetime
                   ) -> list[Outcome]:
        return optimizer.place(asks, view, self.policy, now=now)

    def _replacement(self, lease: Lease, market: Market, view: PoolView, now: datetime
                     ) -> Outcome:
        narrowed = replace(lease, request=replace(lease.request, market=market.value))
        return failover.replacement(narrowed, view, self.policy, self.resident, now)


def narrow(ask: Ask, market: Market) -> Ask | None:
    """`ask` restricted to one market and the paid-for capacity that serves it
    (`markets_for`: `spot` or `on_demand` with `reserved`, where its constraints allow
    that); None when its constraints do not allow `market`."""
    c = ask.constraints
    assert c is not None
    if market not in c.markets:
        return None
    serves = markets_for(market.value)
    return Ask(replace(ask.request, market=market.value), ask.exclude,
               replace(c, markets=tuple(m for m in c.markets if m in serves)))


def _first(ask: Ask) -> Ask | None:
    """The first pass's ask: narrowed to spot, or to paid-for capacity for a request
    that may go nowhere else."""
    c = ask.constraints
    assert c is not None
    if c.markets == (Market.RESERVED,):
        return narrow(ask, Market.RESERVED)
    return narrow(ask, Market.SPOT)


def spot_then_on_demand(asks: Sequence[Ask], view: PoolView, now: datetime,
                        spot: Placer, on_demand: Placer) -> list[Outcome]:
    """Place each ask on spot (or paid-for capacity) if it can be, else on on-demand (or
    paid-for capacity); one outcome per ask, the first pass's rejection when both fail
    and the first pass was tried."""
    out: dict[RequestId, Outcome] = {}
    first = [a for a in (_first(a) for a in asks) if a is not None]
    if first:
        out.update((rid(o.ask.request), o) for o in spot(first, view, now))
    second = [a for a in (narrow(a, Market.ON_DEMAND) for a in asks
                          if not isinstance(out.get(rid(a.request)), Decision))
              if a is not None]
    if second:
        for o in on_demand(second, view, now):
            key = rid(o.ask.request)
            if isinstance(o, Decision) or key not in out:
                out[key] = o
    return [out.get(rid(a.request)) or Rejection(a, RejectCode.POLICY_DENIED,
                                                  "no market is left for this request")
            for a in asks]


class OnDemand(Strategy):
    name = "on_demand"
    how = "on-demand only, cheapest price (placement.place, zero-weight scoring)"

    def adapt(self, req: PlaceRequest) -> PlaceRequest:
        return replace(req, market=Market.ON_DEMAND.value)

    def place(self, asks: Sequence[Ask], view: PoolView, now: datetime) -> list[Outcome]:
        return self._placement(asks, view, now)

    def move(self, lease: Lease, view: PoolView, now: datetime) -> Outcome:
        return failover.replacement(lease, view, self.policy, self.resident, now)


class CheapestSpot(Strategy):
    name = "cheapest_spot"
    how = ("spot first, cheapest price; on-demand if no spot fits (placement.place, "
           "zero-weight scoring)")

    def place(self, asks: Sequence[Ask], view: PoolView, now: datetime) -> list[Outcome]:
        return spot_then_on_demand(asks, view, now, self._placement, self._placement)

    def move(self, lease: Lease, view: PoolView, now: datetime) -> Outcome:
        outcome: Outcome | None = None
        for market in self._markets(lease.request):
            outcome = self._replacement(lease, market, view, now)
            if isinstance(outcome, Decision):
                return outcome
        assert outcome is not None
        return outcome


class PriceCapacity(Strategy):
    name = "price_capacity"
    how = ("spot by availability (10 levels of each cloud's own scale), then price, "
           "within each cloud; the cheapest cloud's pick; on-demand if no spot fits "
           "(own chooser for spot, placement.place for on-demand)")

    def _spot(self, asks: Sequence[Ask], view: PoolView, now: datetime) -> list[Outcome]:
        return choose_price_capacity(asks, view, self.policy, now=now)

    def place(self, asks: Sequence[Ask], view: PoolView, now: datetime) -> list[Outcome]:
        return spot_then_on_demand(asks, view, now, self._spot, self._placement)

    def move(self, lease: Lease, view: PoolView, now: datetime) -> Outcome:
        outcome: Outcome | None = None
        for market in self._markets(lease.request):
            if market is Market.SPOT:
                req = replace(lease.request, market=market.value)
                verdict = evaluate(self.policy, req, None, self.resident)
                if isinstance(verdict, Denied):
                    continue
                ask = Ask(req, frozenset({lease.placement.pool}),
                          replace(verdict, budget_left=None))
                [outcome] = self._spot([ask], view, now)
            else:
                outcome = self._replacement(lease, market, view, now)
            if isinstance(outcome, Decision):
                return outcome
        if outcome is None:
            return Rejection(Ask(lease.request), RejectCode.POLICY_DENIED,
                             "no market is left for this lease")
        return outcome


class Gpubroker(Strategy):
    name = "gpubroker"
    how = ("broker.placement.optimizer.place with the policy; "
           "failover by broker.leasing.failover's ladder")

    def place(self, asks: Sequence[Ask], view: PoolView, now: datetime) -> list[Outcome]:
        return self._placement(asks, view, now)

    def move(self, lease: Lease, view: PoolView, now: datetime) -> Outcome:
        return failover.replacement(lease, view, self.policy, self.resident, now)


class TruthView:
    """A `PoolView` whose spot offers carry the interruption draws' true hazard at `now`
    (`HazardSchedule.rate` of the step) instead of the cloud's signal; everything else
    read through from `view`. Offers are rewritten once per GPU, market and step."""

    def __init__(self, view: PoolView, schedule: HazardSchedule, k: int) -> None:
        self._view = view
        self._schedule = schedule
        self._k = k
        self._lists: dict[tuple[str, Market | None], list[Offer]] = {}
        self.hazard = None  # the truth is known: no history to estimate it from

    def _true(self, offer: Offer) -> Offer:
        if offer.pool.market is not Market.SPOT:
            return offer
        return replace(offer, interruption_rate=self._schedule.rate(offer.pool, self._k))

    def by_gpu(self, gpu: str, market: Market | None = None) -> Sequence[Offer]:
        got = self._lists.get((gpu, market))
        if got is None:
            got = self._lists[(gpu, market)] = [
                self._true(o) for o in self._view.by_gpu(gpu, market)]
        return got

    def get(self, key: PoolKey) -> Offer | None:
        offer = self._view.get(key)
        return None if offer is None else self._true(offer)

    def __getattr__(self, name: str) -> Any:  # stale_slices, slice_of, cooling, held, ...
        return getattr(self._view, name)


class Oracle(Strategy):
    """gpubroker's placement and failover under `policy`, seeing each spot pool's true
    hazard (what the interruption draws follow) where the others see the cloud's signal:
    the reference for which clouds' spot capacity is worth taking. Not a strategy a
    user could run; the benchmark reports it beside them."""

    name = "oracle"
    how = "gpubroker's optimizer seeing the true hazards instead of the clouds' signals"

    def __init__(self, policy: Policy, schedule: HazardSchedule, start: datetime) -> None:
        scoring = policy.scoring.model_copy(update={"hazard_half_life_hours": 0.0})
        super().__init__(policy.model_copy(update={"scoring": scoring}))
        self._schedule = schedule
        self._start = start
        self._view: tuple[int, PoolView, TruthView] | None = None

    def _truth(self, view: PoolView, now: datetime) -> TruthView:
        k = int((now - self._start).total_seconds() // self._schedule.step_seconds)
        if self._view is None or self._view[0] != k or self._view[1] is not view:
            self._view = (k, view, TruthView(view, self._schedule, k))
        return self._view[2]

    def place(self, asks: Sequence[Ask], view: PoolView, now: datetime) -> list[Outcome]:
        return self._placement(asks, self._truth(view, now), now)

    def move(self, lease: Lease, view: PoolView, now: datetime) -> Outcome:
        return failover.replacement(lease, self._truth(view, now), self.policy,
                                    self.resident, now)


def build(name: str, policy: Policy) -> Strategy:
    """The strategy `name` under the gpubroker `policy` (baselines get its
    `baseline_policy`)."""
    if name == "gpubroker":
        return Gpubroker(policy)
    baseline = baseline_policy(policy)
    if name == "on_demand":
        return OnDemand(baseline)
    if name == "cheapest_spot":
        return CheapestSpot(baseline)
    if name == "price_capacity":
        return PriceCapacity(baseline)
    raise ValueError(f"unknown strategy {name!r}; expected one of {', '.join(STRATEGIES)}")


# --- price-capacity-optimized --------------------------------------------------------------

def availability_level(availability: float, best: float) -> int:
    """Availability in ten levels, 0..10, relative to `best`, the highest availability
    among the pools compared: the top tenth of `best` is level 10, the next 9, ...; 0
    only for no availability (all level 0 when `best` is 0)."""
    if best <= 0:
        return 0
    return min(10, max(0, math.ceil(availability / best * 10 - 1e-9)))


_Candidate = tuple[float, float, PoolKey, Offer, int]  # (availability, price, key, offer, n)


def _price_capacity_pick(found: Sequence[_Candidate]) -> tuple[int, _Candidate]:
    """Within one cloud: the highest availability level (relative to that cloud's best
    pool here), then the lowest price, then the pool key."""
    best = max(c[0] for c in found)
    level, pick = min(((availability_level(c[0], best), c) for c in found),
                      key=lambda lc: (-lc[0], lc[1][1], lc[1][2]))
    return level, pick


def choose_price_capacity(asks: Sequence[Ask], view: PoolView, policy: Policy, *,
                          now: datetime) -> list[Outcome]:
    """EC2 Fleet's price-capacity-optimized allocation, used the way a multi-cloud user
    would: within each cloud, on that cloud's own capacity signal, the feasible pool of
    the highest availability level (ten levels, relative to the cloud's most available
    feasible pool, since each cloud publishes on its own scale: Azure's top is 0.9,
    Alibaba's stock 0 / 0.3 / 1, AWS's placement score in tenths, GCP's obtainability),
    then the lowest price; then across clouds, paid-for capacity first (as EC2 Fleet
    uses capacity reservations first), then the cheapest of those picks (then the pool
    key). An unknown availability counts as the policy's `unknown_availability`.

    Feasibility is the placement rules' table (`broker.placement.rules`): acceptable
    model/market/cloud/region, not stale, not cooling, not excluded, under the price
    cap, free capacity and quota (less what earlier asks of the batch took), the spot
    discount, within the team's remaining budget."""
    stale, cooling = view.stale_slices(now), view.cooling(now)
    taken: Counter[PoolKey] = Counter()
    taken_gpus: Counter[PoolKey] = Counter()
    unknown = policy.scoring.unknown_availability
    out: list[Outcome] = []
    for ask in asks:
        req = ask.request
        c = ask.constraints if ask.constraints is not None else evaluate(policy, req)
        if isinstance(c, Denied):
            out.append(Rejection(ask, c.code, c.detail))
            continue
        by_cloud: dict[str, list[_Candidate]] = {}
        matching = under_cap = 0
        probe = rules.Probe(req, c, view, policy, ask.exclude, stale, cooling, taken,
                            taken_gpus)
        for gpu in c.gpus:
            for m in c.markets:
                for offer in view.by_gpu(gpu, m):
                    instances = rules.instances_for(req.gpus, offer.gpus)
                    failed = rules.first_failing(probe, offer, instances)
                    if failed is not None and failed in _UNMATCHED:
                        continue
                    matching += 1
                    if failed is rules.PRICE_CAP:
                        continue
                    under_cap += 1
                    if failed is not None:
                        continue
                    a = offer.availability if offer.availability is not None else unknown
                    by_cloud.setdefault(offer.pool.cloud, []).append(
                        (a, instances * offer.price_per_hour, offer.pool, offer, instances))
        if not by_cloud:
            out.append(_rejection(ask, c, matching, under_cap))
            continue
        picks = [_price_capacity_pick(found) for found in by_cloud.values()]
        # paid-for capacity first (as EC2 Fleet uses capacity reservations first), then
        # the cheapest pick
        level, (_, price, _, offer, instances) = min(
            picks, key=lambda lc: (lc[1][2].market is not Market.RESERVED, *lc[1][1:3]))
        chosen = Placement.of(offer, instances)
        taken[chosen.pool] += instances
        taken_gpus[chosen.pool] += chosen.total_gpus
        out.append(Decision(ask, chosen, price,
                            f"price-capacity-optimized within {offer.pool.cloud}: "
                            f"availability level {level}/10 of its best pool, the "
                            f"cheapest of {len(picks)} clouds' picks at "
                            f"${chosen.price_per_gpu_hour:.4g}/GPU-h", ()))
    return out


_UNMATCHED = frozenset(rules.RULES[:rules.RULES.index(rules.PRICE_CAP)])
"""The rules before the price cap: an offer failing one does not count as matching."""


def _rejection(ask: Ask, c: Constraints, matching: int, under_cap: int) -> Rejection:
    what = f"{ask.request.gpus}×{'|'.join(c.gpus)} (spot)"
    if not matching:
        return Rejection(ask, RejectCode.NO_CAPACITY, f"no fresh offer of {what}")
    if not under_cap:
        return Rejection(ask, RejectCode.OVER_PRICE_CAP,
                         f"no {what} at or under ${c.cap:g}/GPU-h")
    return Rejection(ask, RejectCode.NO_CAPACITY,
                     f"no {what} with free capacity, quota and budget")
