"""The rules an offer must pass to be an option of a request, written once, in order.

Each rule has a name, the rejection code it stands for when it is what leaves a request
with nothing (`broker.model.RejectCode`), the reason `explain` gives for an offer it
excludes, a scalar check (one offer, one request: `check(probe, offer, instances)`) and a
vectorised mask (numpy, many offers of one GPU model and market:
`mask(probe, arrays, instances)`), which agree (tests/placement/test_rules.py).

    model, market            the verdict's GPU models and markets (policies.evaluate)
    stale, cooling           fresh offers of pools that take placements now
    excluded                 not a pool the request keeps out (a failover's own)
    request_region           the request's own clouds and regions
    policy_region            the verdict's clouds, regions and residency (policies.evaluate)
    price_cap                the verdict's price cap (policies.evaluate)
    capacity, quota          free instances and quota for the request alone (sized)
    discount                 a spot offer discounted enough under on-demand
    budget                   the team's remaining budget (sized; batch)

The policy's own rules (`policies.evaluate.POLICY_RULES`) are the same objects the lease
re-check (`forbids`) uses. A `sized` rule depends on the instances placed; a `batch` rule
is a limit the solver counts across a batch (`policies.teams.TeamRoom`): the option lists of
a batch do not filter by it (requests share lists whatever their team's budget), while a
request judged alone — `explain`, the backtest's baselines — is.

The walk (`broker.placement.walk`), the masks of large batches
(`broker.placement.candidates`), `explain` and the backtest's price-capacity baseline
all read this table."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

from broker.market.hazard import Hazard
from broker.model import Market, Offer, PlaceRequest, PoolKey, RejectCode
from broker.placement.cost import expected_cost
from broker.placement.room import fits as _fits
from broker.placement.room import instances_for as instances_for  # one formula, here too
from broker.placement.room import no_room as no_room
from broker.placement.view import PoolView
from policies import evaluate as verdict
from policies.evaluate import Constraints, OfferRule
from policies.model import Policy, RiskLevel


@dataclass(slots=True)
class Probe:
    """One request under its verdict `c`, against a view at one instant: what the rules
    read. `policy`: the one the request is scored with (the policy at its risk level,
    `Policy.for_risk(c.risk)`). `taken`/`taken_gpus`: instances and GPUs per pool that
    earlier choices of the same pass hold beyond the view's (a chooser that places one
    request at a time)."""

    request: PlaceRequest
    c: Constraints
    view: PoolView
    policy: Policy
    exclude: frozenset[PoolKey] = frozenset()
    stale: Collection[Hashable] = ()
    cooling: Collection[PoolKey] = ()
    taken: Mapping[PoolKey, int] | None = None
    taken_gpus: Mapping[PoolKey, int] | None = None
    own_clouds: frozenset[str] | None = field(init=False)
    own_regions: frozenset[str] | None = field(init=False)
    min_discount: float = field(init=False)

    def __post_init__(self) -> None:
        req = self.request
        self.own_clouds = frozenset(req.clouds) if req.clouds else None
        self.own_regions = frozenset(req.regions) if req.regions else None
        self.min_discount = self.policy.scoring.spot_min_discount

    def held(self, key: PoolKey) -> int:
        return self.view.held(key) + (self.taken.get(key, 0) if self.taken else 0)

    def used_gpus(self, key: PoolKey) -> int:
        return self.taken_gpus.get(key, 0) if self.taken_gpus else 0


def spot_discount_ok(offer: Offer, view: PoolView, min_discount: float) -> bool:
    """Whether a spot offer is at least `min_discount` cheaper than on-demand for the same
    instance type in the same zone (true when there is nothing to compare with)."""
    if min_discount <= 0 or offer.pool.market is not Market.SPOT:
        return True
    od = view.get(offer.pool._replace(market=Market.ON_DEMAND))
    if od is None or od.price_per_hour is None or offer.price_per_hour is None:
        return True
    return offer.price_per_hour <= od.price_per_hour * (1 - min_discount)


def quota_use(offer: Offer, instances: int, used_gpus: int = 0
              ) -> tuple[Hashable, int, int] | None:
    """The quota `instances` of the offer count against, as the solver counts it: (the
    quota's key, the amount they take, and what the offer reads as left of it, `used_gpus`
    less), in the quota's own units — a quota group's (`quota_units` per instance: vCPUs,
    or GPUs) when the pool shares one, else the pool's GPUs; None when unknown."""
    headroom = offer.quota_headroom
    if headroom is None:
        return None
    headroom -= used_gpus
    if offer.quota_group is not None and offer.quota_units:
        units = offer.quota_units
        return ("quota", offer.quota_group), instances * units, \
            headroom // max(offer.gpus, 1) * units
    return ("quota", offer.pool), instances * offer.gpus, headroom


class OfferArrays:
    """The fresh offers of one GPU model and market that take placements (they pass
    `model`, `market`, `stale` and `cooling`), as arrays for a large batch: price per
    GPU-hour and per instance, GPUs per instance, free instances, quota in its own
    units (left, and per instance; inf: unknown), region code, and whether a spot offer is
    discounted enough."""

    def __init__(self) -> None:
        self.offers: list[Offer] = []
        self.regions: list[tuple[str, str]] = []
        self._eff: dict[tuple[float, RiskLevel], Any] = {}
        self._capped: Any = None  # the offers with a capacity, by index
        self._capped_keys: list[PoolKey] = []  # and their pools

    @classmethod
    def of(cls, offers: list[Offer], policy: Policy, view: PoolView) -> OfferArrays:
        """`offers` (priced, of one model and market) as arrays, their room as `view`
        has it."""
        import numpy as np

        a = cls()
        a.offers = offers
        codes: dict[tuple[str, str], int] = {}
        gpus, price, cap, q_have, q_unit, region, disc = [], [], [], [], [], [], []
        min_discount = policy.scoring.spot_min_discount
        for offer in offers:
            key = offer.pool
            gpus.append(offer.gpus)
            price.append(offer.price_per_hour)
            cap.append(math.inf if offer.capacity is None else offer.capacity)
            q = quota_use(offer, 1)
            q_have.append(math.inf if q is None else q[2])
            q_unit.append(0 if q is None else q[1])
            region.append(codes.setdefault((key.cloud, key.region), len(codes)))
            disc.append(not min_discount or spot_discount_ok(offer, view, min_discount))
        a.regions = list(codes)
        a.gpus = np.array(gpus, dtype=np.int64)
        a.price = np.array(price, dtype=float)
        a.ppg = a.price / a.gpus
        a.cap = np.array(cap, dtype=float)
        a._capped = np.flatnonzero(np.isfinite(a.cap))
        a._capped_keys = [offers[i].pool for i in a._capped.tolist()]
        a.q_have, a.q_unit = np.array(q_have, dtype=float), np.array(q_unit, dtype=float)
        a.region = np.array(region, dtype=np.int64)
        a.disc_ok = np.array(disc, dtype=bool)
        a.free = a._free(view)
        return a

    def _free(self, view: PoolView) -> Any:
        """Instances free per offer, as `view` holds them (inf: no capacity known)."""
        import numpy as np

        free = self.cap.copy()
        if keys := self._capped_keys:  # read in C: a burst's batches each read them all
            free[self._capped] -= np.fromiter(map(view.held_now().get, keys, repeat(0)),
                                              dtype=float, count=len(keys))
        return free

    def again(self, view: PoolView) -> OfferArrays:
        """The same offers for another batch: everything shared but their room, as `view`
        holds them now, and the slots (`base`). Only while the policy's spot discount is
        0 (`disc_ok` reads the on-demand offers, which may have changed)."""
        a = OfferArrays.__new__(OfferArrays)
        a.offers, a.regions, a._eff, a._capped = self.offers, self.regions, self._eff, \
            self._capped
        a._capped_keys = self._capped_keys
        a.gpus, a.price, a.ppg, a.cap = self.gpus, self.price, self.ppg, self.cap
        a.q_have, a.q_unit, a.region, a.disc_ok = self.q_have, self.q_unit, self.region, \
            self.disc_ok
        a.free = a._free(view)
        return a

    def eff(self, h: float, policy: Policy, hazard: Hazard | None,
            memo: dict[PoolKey, tuple[Offer, float, float]] | None = None
            ) -> tuple[Any, Any]:
        """Per offer, spot risk over `h` hours at `policy`'s risk level (made on first use
        per horizon and level; `policy` is one policy's `Policy.for_risk`): the expected
        cost per GPU-hour of one instance (`unit_cost`), and what each further instance
        of a gang adds to it per GPU-hour (the interruption terms, which grow with the
        instances: `expected_cost`), so that n instances cost
        n × GPUs × (eff + (n − 1) × gang). Both from the one cost formula. `memo`
        (`CostMemo.table`) keeps both per pool across batches, for the offer they were
        computed for."""
        key = (h, policy.scoring.risk)
        got = self._eff.get(key)
        # Kept across batches (`again`) while `memo` is the same table: the estimator
        # neither refreshed nor replaced, the same scoring.
        if got is not None and got[0] is memo:
            return got[1], got[2]
        import numpy as np

        n = len(self.offers)
        eff, gang = np.empty(n, dtype=float), np.zeros(n, dtype=float)
        spot = Market.SPOT
        for i, o in enumerate(self.offers):
            kept = memo.get(o.pool) if memo is not None else None
            if kept is not None and kept[0] is o:
                eff[i], gang[i] = kept[1], kept[2]
                continue
            one = expected_cost(o, 1, policy, hazard=hazard)
            eff[i] = one / o.gpus
            if o.pool.market is spot:  # only spot risk grows with the gang
                gang[i] = max(0.0, (expected_cost(o, 2, policy, hazard=hazard) / 2 - one)
                              / o.gpus)
            if memo is not None:
                memo[o.pool] = (o, float(eff[i]), float(gang[i]))
        self._eff[key] = (memo, eff, gang)
        return eff, gang

    def per_offer(self, test: Callable[[Offer], bool]) -> Any:
        import numpy as np

        return np.fromiter((test(o) for o in self.offers), dtype=bool, count=len(self.offers))

    def per_region(self, test: Callable[[str, str], bool]) -> Any:
        import numpy as np

        return np.array([test(cl, rg) for cl, rg in self.regions], dtype=bool)[self.region]

    ppg: Any
    price: Any
    gpus: Any
    cap: Any
    free: Any
    q_have: Any
    q_unit: Any
    region: Any
    disc_ok: Any
    base: int = 0  # where its offers start in the builder's `room`


@dataclass(frozen=True, slots=True)
class Rule:
    """One rule of the table: `check(probe, offer, instances)` and
    `mask(probe, arrays, instances per offer)` say whether offers pass it; `key(probe)`
    is what, beyond the arrays and the instances, the mask depends on (a batch shares
    masks of equal keys)."""

    name: str
    code: RejectCode
    message: str
    check: Callable[[Probe, Offer, int], bool]
    mask: Callable[[Probe, OfferArrays, Any], Any]
    key: Callable[[Probe], Hashable] = lambda p: ()
    sized: bool = False
    batch: bool = False


def _ppg(offer: Offer) -> float:
    return offer.price_per_hour / offer.gpus  # type: ignore[operator]


def _of_policy(rule: OfferRule, key: Callable[[Probe], Hashable],
               mask: Callable[[Probe, OfferArrays, Any], Any]) -> Rule:
    """A rule of the verdict (`policies.evaluate.POLICY_RULES`) in the table."""
    return Rule(rule.name, rule.code, rule.message,
                lambda p, o, n: rule.ok(p.c, o.pool, o.gpu, _ppg(o)), mask, key)


def _all(a: OfferArrays) -> Any:
    import numpy as np

    return np.ones(len(a.offers), dtype=bool)


MODEL = _of_policy(verdict.MODEL, lambda p: p.c.gpus,
                   lambda p, a, n: a.per_offer(lambda o: o.gpu in p.c.gpus))
MARKET = _of_policy(verdict.MARKET, lambda p: p.c.markets,
                    lambda p, a, n: a.per_offer(lambda o: o.pool.market in p.c.markets))
STALE = Rule(
    "stale", RejectCode.NO_CAPACITY, "offer is stale",
    lambda p, o, n: not (p.stale and p.view.slice_of(o.pool) in p.stale),
    lambda p, a, n: a.per_offer(lambda o: not (p.stale and p.view.slice_of(o.pool) in p.stale)),
    lambda p: id(p.stale))
COOLING = Rule(
    "cooling", RejectCode.NO_CAPACITY, "pool in a cool-down",
    lambda p, o, n: not (p.cooling and o.pool in p.cooling),
    lambda p, a, n: a.per_offer(lambda o: not (p.cooling and o.pool in p.cooling)),
    lambda p: id(p.cooling))
EXCLUDED = Rule(
    "excluded", RejectCode.NO_CAPACITY,
    "pool kept out by the request (a failover does not go back to the pool it leaves)",
    lambda p, o, n: not (p.exclude and o.pool in p.exclude),
    lambda p, a, n: a.per_offer(lambda o: o.pool not in p.exclude) if p.exclude else _all(a),
    lambda p: p.exclude)


def _own(p: Probe, cloud: str, region: str) -> bool:
    return (p.own_clouds is None or cloud in p.own_clouds) and \
        (p.own_regions is None or region in p.own_regions)


REQUEST_REGION = Rule(
    "request_region", RejectCode.NO_CAPACITY, "outside the request's clouds/regions",
    lambda p, o, n: _own(p, o.pool.cloud, o.pool.region),
    lambda p, a, n: a.per_region(lambda cl, rg: _own(p, cl, rg)),
    lambda p: (p.own_clouds, p.own_regions))
POLICY_REGION = _of_policy(
    verdict.REGION,
    lambda p: (p.c.clouds, p.c.deny_clouds, p.c.regions, p.c.deny_regions, p.c.residency),
    lambda p, a, n: a.per_region(p.c.region_ok))


PRICE_CAP = _of_policy(verdict.PRICE_CAP, lambda p: p.c.cap,
                       lambda p, a, n: _all(a) if p.c.cap is None else a.ppg <= p.c.cap)


def _capacity_ok(p: Probe, o: Offer, n: int) -> bool:
    return _fits(o, p.held(o.pool), n)


def _capacity_mask(p: Probe, a: OfferArrays, n: Any) -> Any:
    import numpy as np

    if not p.taken:
        return a.free >= n
    return a.free - np.array([p.taken.get(o.pool, 0) for o in a.offers], dtype=float) >= n


def _quota_ok(p: Probe, o: Offer, n: int) -> bool:
    q = quota_use(o, n, p.used_gpus(o.pool))
    return q is None or q[1] <= q[2]


def _quota_mask(p: Probe, a: OfferArrays, n: Any) -> Any:
    import numpy as np

    if not p.taken_gpus:
        return n * a.q_unit <= a.q_have
    q = [quota_use(o, 1, p.used_gpus(o.pool)) for o in a.offers]
    have = np.array([math.inf if x is None else x[2] for x in q], dtype=float)
    return n * a.q_unit <= have


CAPACITY = Rule("capacity", RejectCode.NO_CAPACITY, "not enough free capacity",
                _capacity_ok, _capacity_mask, sized=True)
QUOTA = Rule("quota", RejectCode.NO_CAPACITY, "not enough quota", _quota_ok, _quota_mask,
             sized=True)
DISCOUNT = Rule(
    "discount", RejectCode.NO_CAPACITY, "spot discount under spot_min_discount",
    lambda p, o, n: not p.min_discount or spot_discount_ok(o, p.view, p.min_discount),
    lambda p, a, n: a.disc_ok)
BUDGET = Rule(
    "budget", RejectCode.OVER_BUDGET, "over the team's remaining budget",
    lambda p, o, n: p.c.budget_left is None or
    n * o.price_per_hour <= p.c.budget_left,  # type: ignore[operator]
    lambda p, a, n: _all(a) if p.c.budget_left is None else n * a.price <= p.c.budget_left,
    lambda p: p.c.budget_left, sized=True, batch=True)

RULES: tuple[Rule, ...] = (MODEL, MARKET, STALE, COOLING, EXCLUDED, REQUEST_REGION,
                           POLICY_REGION, PRICE_CAP, CAPACITY, QUOTA, DISCOUNT, BUDGET)
"""The table, in the order an offer is judged (the first rule it fails is its reason)."""

FRESH = (STALE, COOLING)
"""What `OfferArrays` and the walks' offer lists hold already (with `model`, `market`:
they are read per GPU model and market)."""
WHERE = (EXCLUDED, REQUEST_REGION)
"""Before the verdict's region: an offer failing these does not count as matching."""
FIT = (CAPACITY, QUOTA, DISCOUNT)
"""After the price cap: room for the request alone, and the spot discount."""
LISTED = tuple(r for r in RULES if not r.batch and r not in (MODEL, MARKET, *FRESH))
"""What a batch's option lists filter the offers of `OfferArrays` by."""
ELIGIBLE = tuple(r for r in RULES if not r.sized and not r.batch)
"""What an offer must pass for a request whatever the instances (a split's parts)."""


def first_failing(p: Probe, offer: Offer, instances: int,
                  rules: Sequence[Rule] = RULES) -> Rule | None:
    """The first of `rules` the offer fails for the request, or None."""
    for rule in rules:
        if not rule.check(p, offer, instances):
            return rule
    return None


def first_failing_masks(p: Probe, a: OfferArrays, instances: Any,
                        rules: Sequence[Rule] = RULES,
                        mask: Callable[[Rule], Any] | None = None) -> Any:
    """Per offer of `a`, the index in `rules` of the first it fails (len(rules): none).
    `mask(rule)`: the rule's mask for them, where the caller keeps it (`Rule.mask` when
    None)."""
    import numpy as np

    out = np.full(len(a.offers), len(rules), dtype=np.int64)
    for i in reversed(range(len(rules))):
        ok = mask(rules[i]) if mask is not None else rules[i].mask(p, a, instances)
        out[~ok] = i
    return out
