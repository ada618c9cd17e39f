"""A request's options by walking the pool's offer lists (small batches): the offers that
pass the rules (`broker.placement.rules`), cheapest expected cost per hour first, stopping
as soon as no offer further on can make the list. Costs are the request's: scored with
the probe's policy, the policy at the request's risk level (`Policy.for_risk`)."""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from broker.market.hazard import Hazard
from broker.model import Market, Offer, PoolKey
from broker.placement import rules
from broker.placement.cost import option_cost
from broker.placement.outcomes import Scan
from broker.placement.problem import Alive, Option
from broker.placement.rules import Probe
from broker.placement.view import WHOLE, Costs, Part
from policies.model import Policy, RiskLevel

Entries = Iterable[tuple[float, PoolKey, Offer]]
"""(bound, pool key, offer) in order of the bound: the offer's price per GPU-hour, or its
`unit_cost`; no option of an offer further on costs less per GPU. The index's own lists
are entries as they are (`CostIndex.sorted`), read without a copy or a generator."""


class Walker(Protocol):
    """What the walk needs of the builder it lists options for."""

    costs: Costs | None

    def hazard(self, h: float) -> Hazard | None: ...

    def walk_costs(self, policy: Policy, h: float
                   ) -> dict[tuple[PoolKey, int, int], tuple[Offer, float]] | None: ...

    def option(self, offer: Offer, instances: int, need: int, h: float, risk: RiskLevel,
               cost: float | None = None) -> Option: ...

    def _plain(self, gpu: str, m: Market) -> Entries: ...

    def _by_price(self, gpu: str, m: Market, part: Part = WHOLE) -> Entries: ...

    def _by_cost(self, gpu: str, m: Market, h: float, risk: RiskLevel,
                 part: Part = WHOLE) -> Entries: ...


class _Found:
    """The options a walk keeps: the best `keep` (a heap), or all of them up to `limit`
    per hour; `cut` once it left one out. `skip`: whether the walk passes over offers
    with no room unjudged (`rules.no_room`), and `skipped` how many it did."""

    def __init__(self, keep: int | None, limit: float | None, skip: bool = False) -> None:
        self.keep, self.limit = keep, limit
        self.heap: list[tuple[float, int, Option]] = []
        self.found: list[Option] = []
        self.tiebreak = 0
        self.cut = False
        self.skip = skip
        self.skipped = 0
        self.counting = False  # only `scan` is wanted: no option is there to find

    def full(self, cost: float) -> bool:
        """Whether an option costing `cost` per hour or more cannot make the list."""
        if self.keep is not None:
            return len(self.heap) == self.keep and cost > -self.heap[0][0]
        return self.limit is not None and cost > self.limit

    def beaten(self, cost: float) -> bool:
        """Whether the best `keep` all cost at most `cost`."""
        return self.keep is not None and len(self.heap) == self.keep and \
            cost >= -self.heap[0][0]

    def add(self, o: Option) -> None:
        cost = o.cost_per_hour
        if self.limit is not None:
            if cost <= self.limit:
                self.found.append(o)
            else:
                self.cut = True
            return
        self.tiebreak += 1
        assert self.keep is not None
        if len(self.heap) < self.keep:
            heapq.heappush(self.heap, (-cost, -self.tiebreak, o))
        elif cost < -self.heap[0][0]:
            heapq.heapreplace(self.heap, (-cost, -self.tiebreak, o))
            self.cut = True

    def result(self) -> tuple[list[Option], float]:
        if self.limit is not None:
            self.found.sort(key=lambda o: o.cost_per_hour)
            return self.found, (self.limit if self.cut else math.inf)
        best = [o for _, _, o in sorted(self.heap, reverse=True)]
        return best, (best[-1].cost_per_hour if self.cut and best else math.inf)


_PASS, _SKIP, _DEARER = 0, 1, 2
_UNDER = 1.0 - 1e-12
"""A bound scaled by instances is made a little lower: rounding must never let it pass
the very cost it bounds (`cost.expected_cost` of one instance is `unit_cost` × its GPUs,
but not always to the last bit)."""


@dataclass(frozen=True, slots=True)
class _Checks:
    """The rules of `_judge` that some offer of a walk may fail; the others pass every
    one of its offers by their own definitions, and are not asked."""

    where: tuple[rules.Rule, ...]
    region: bool
    cap: bool


def _checks(p: Probe, own: bool, regions_passed: bool) -> _Checks:
    """`rules.EXCLUDED` fails only a pool the request keeps out (`Probe.exclude`);
    `rules.REQUEST_REGION` only outside the request's own clouds and regions (`own`: the
    walk reads the index's part of them alone); `rules.POLICY_REGION` only where the
    verdict bounds regions (`Constraints.regions_bounded`) and the walk has not passed
    over those it denies already, nor reads only those it allows (`regions_passed`);
    `rules.PRICE_CAP` only under a cap."""
    where = tuple(r for r in rules.WHERE
                  if not (r is rules.EXCLUDED and not p.exclude)
                  and not (r is rules.REQUEST_REGION and own))
    return _Checks(where, p.c.regions_bounded() and not regions_passed, p.c.cap is not None)


ALL = _Checks(rules.WHERE, True, True)


def _cost(memo: dict[tuple[PoolKey, int, int], tuple[Offer, float]] | None, offer: Offer,
          instances: int, need: int, policy: Policy, hazard: Hazard | None) -> float:
    """`option_cost` of `instances` of the offer for `need` GPUs, kept in `memo`
    (`CostMemo.walks`) for the very same offer."""
    if memo is None:
        return option_cost(offer, instances, need, policy, hazard=hazard)
    key = (offer.pool, instances, need)
    got = memo.get(key)
    if got is not None and got[0] is offer:
        return got[1]
    cost = option_cost(offer, instances, need, policy, hazard=hazard)
    memo[key] = (offer, cost)
    return cost


def _fits(p: Probe, offer: Offer, instances: int) -> bool:
    """Whether the offer passes the rules after the price cap (`rules.FIT`)."""
    return rules.first_failing(p, offer, instances, rules.FIT) is None


def _judge(p: Probe, offer: Offer, scan: Scan, checks: _Checks = ALL) -> int:
    """The rules up to the price cap (`rules.WHERE`, `policy_region`, `price_cap`; those of
    them `checks` names), counted in `scan` as `broker.placement.outcomes.reject` reads
    them."""
    for rule in checks.where:
        if not rule.check(p, offer, 1):
            return _SKIP
    if checks.region and not rules.POLICY_REGION.check(p, offer, 1):
        scan.policy_excluded += 1
        return _SKIP
    scan.matching += 1
    ppg = offer.price_per_hour / offer.gpus  # type: ignore[operator]
    if ppg < scan.cheapest_ppg:
        scan.cheapest_ppg = ppg
    if checks.cap and not rules.PRICE_CAP.check(p, offer, 1):
        return _DEARER
    scan.under_cap += 1
    return _PASS


def walk(b: Walker, p: Probe, k: int | None, limit: float | None, alive: Alive | None,
         h: float, *, skip: bool = True, known: Scan | None = None
         ) -> tuple[list[Option], float, Scan]:
    """The request's options, cheapest expected cost per hour first: the best `k`, or all
    of them up to `limit` per hour; the cost per hour below which the list holds every
    option (inf: it holds them all); and what the walk saw. The offer lists are fresh
    (`rules.FRESH`) and of the verdict's models and markets (`rules.MODEL`,
    `rules.MARKET`). `skip`: pass over unjudged the offers with no room, and those too
    dear for the list once it left one out (the same options; False: judge every one).
    `known`: what the walk made again to count would see (`CandidateBuilder.request`
    keeps it): returned instead of walking again."""
    risk = p.policy.scoring.risk
    # In order of price when there is a price cap (the walk ends at the cap), else in
    # order of cost when the index is there (it ends once no option can make the list).
    by_price = b.costs is None or p.c.cap is not None or not b.costs.covers(h, risk)
    # Offers with no room (`rules.no_room`) are passed over unjudged: once the pool
    # fills, the cheap offers ahead of the first with room are most of a walk. With the
    # index, most are not even stepped over: its lists less the pools without room for
    # the request's size rounded down to a power of two (`Part.room_for`) are walked,
    # in either order. They are then missing from `scan`, which names why a request
    # has no option: a walk that finds none is made again judging every offer.
    # (Without them, a walk that would have ended at one of them goes on to the next
    # offer that would end it, or to the end of the lists: the same options, and then
    # all there are, `upto` inf.) Nor are the offers outside the request's own clouds
    # and regions walked (`rules.REQUEST_REGION`, which `scan` does not count).
    # The walk made again finds no option either (those it passed over were none): it
    # only counts, and ends where a walk judging every offer would. What it lists (none)
    # and up to where (an option over `limit` seen, or all there are) is the first's.
    costs = b.costs
    indexed = costs is not None
    first: _Found | None = None
    for skipping in ((True, False) if skip else (False,)):
        if first is not None and known is not None:
            scan = dataclasses.replace(known)
            break
        scan = Scan()
        out = _Found(k if limit is None else None, limit, skipping)
        out.counting = skip and not skipping
        # The first pass reads only the regions the verdict allows, through the index's
        # part of them (`CostIndex.places`); the walk made again counts those it denies.
        places = costs.places(p.c) if costs is not None and skipping and \
            p.c.regions_bounded() else None
        part = Part(Part.room_for(p.request.gpus) if skipping else 0, p.own_clouds,
                    p.own_regions, places)
        lists = ((b._plain(gpu, m) if not indexed else
                  b._by_price(gpu, m, part) if by_price else
                  b._by_cost(gpu, m, h, risk, part))
                 for gpu in p.c.gpus for m in p.c.markets)
        _walk_lists(b, p, lists, by_price, out, scan, alive, h, indexed,
                    roomy=indexed and part.room == p.request.gpus,
                    allowed=places is not None)
        if first is None:
            first = out
        if out.heap or out.found or not (out.skipped or (skipping and indexed)):
            break
    assert first is not None
    return (*first.result(), scan)


def _walk_lists(b: Walker, p: Probe, lists: Iterable[Entries], by_price: bool,  # noqa: C901, PLR0912, PLR0913
                out: _Found, scan: Scan, alive: Alive | None, h: float, own: bool = False, *,
                roomy: bool = False, allowed: bool = False) -> None:
    """Each of `lists` walked in turn into `out`, each until no offer further on in it
    can make the list (one function, its set-up once a walk: it is the placement path's
    innermost loop, and most lists are a few entries long).
    `own`: the entries are within the request's own clouds and regions already;
    `roomy`: their pools have room for the request, on the probe's view (the index's
    part by room of its very size): none is passed over for want of it; `allowed`:
    they are within the regions the verdict allows (the index's part of them)."""
    need = p.request.gpus
    policy, hazard = p.policy, b.hazard(h)
    memo = b.walk_costs(policy, h)
    held, no_room, counting = p.view.held, rules.no_room, out.counting
    skip = out.skip
    check_room = skip and not roomy
    # Offers outside the regions the policy allows the request (a team's clouds or
    # residency, the policy's allow and deny lists) are passed over too, by the rule's
    # own test kept per region (`Constraints.region_ok`), not judged one by one; they
    # are what `scan.policy_excluded` counts, so a walk that finds nothing is made
    # again, counting them (as `_judge` would when they pass `rules.WHERE`: none of the
    # request's own offers is excluded).
    bounded = p.c.regions_bounded()
    region_ok = p.c.region_ok if bounded and not allowed and \
        (skip or (counting and own and not p.exclude)) else None
    checks = _checks(p, own, allowed or region_ok is not None)
    # Once an option was left out (`out.cut`) in a walk that keeps the best `keep` in
    # order of cost, an offer is first asked what it costs: one that cannot make the
    # list is passed over unjudged, whatever the rules say of it (it would only be
    # counted in `scan`, which is read only of a walk that found no option, and
    # `out.cut` is set already), and the walk of its list ends where no offer further
    # on can make it. Its instances bound it first: an offer of 8 GPUs an instance
    # costs a request for 2 at least 8 × its bound, not 2 ×.
    dearer = skip and not by_price and out.keep is not None
    for entries in lists:
        for bound, key, offer in entries:
            if region_ok is not None and not region_ok(key.cloud, key.region):
                if skip:
                    out.skipped += 1
                else:
                    scan.policy_excluded += 1
                continue
            # An offer with no room can never be an option: passed over unjudged unless the
            # walk would stop at it. Where the next offer that passes the rules up to `fit`
            # would end the walk (`out.full`), so might this one: judged then, so that the
            # walk ends where it would have (and `out.cut` says the same). In order of
            # price, one over the cap ends it (the rest are dearer).
            if check_room and no_room(offer, held(key), need) and \
                    not out.full(need * bound):
                out.skipped += 1
                if by_price and not rules.PRICE_CAP.check(p, offer, 1):
                    break
                continue
            if dearer and out.cut:
                # `out.full` and `out.beaten` written out: the heap holds `keep` once cut.
                worst = -out.heap[0][0]
                if need * bound > worst:
                    break
                gpus = offer.gpus
                instances = rules.instances_for(need, gpus)
                if instances * gpus * bound * _UNDER >= worst or \
                        _cost(memo, offer, instances, need, policy, hazard) >= worst:
                    continue
            judged = _judge(p, offer, scan, checks)
            if judged == _SKIP:
                continue
            if judged == _DEARER:
                if by_price:
                    break  # sorted by price per GPU-hour: the rest are dearer
                continue
            # Any later offer costs at least need × its bound: stop when that cannot make
            # the list.
            if out.full(need * bound):
                out.cut = True
                break
            if counting:
                continue
            instances = rules.instances_for(need, offer.gpus)
            # The cost before the rules of room and quota: most offers judged never make the
            # list, and once one option was left out (`cut`) those need not be asked of them.
            cost = _cost(memo, offer, instances, need, policy, hazard)
            if out.beaten(cost):
                # An option left out: the list does not hold them all.
                out.cut = out.cut or _fits(p, offer, instances)
                continue
            if not _fits(p, offer, instances):
                continue
            o = b.option(offer, instances, need, h, policy.scoring.risk, cost)
            if alive is not None and not alive(o):
                continue
            out.add(o)
