"""A batch's candidates: `CandidateBuilder` turns asks into the solver's requests — each
request's options, cheapest expected cost per hour first (`broker.placement.cost`), among
the offers that pass the rules (`broker.placement.rules`); the resources the options use
and the teams' limits.

Requests asking for the same thing share one list, read further only when its options run
out. Small batches walk the pool's price index per request (`broker.placement.walk`); large
ones (`index_min_batch`) filter each GPU model's offers as arrays by the rules' masks,
once per batch (`broker.placement.arrays`), and while the solver places, an offer one list
finds used up is skipped by every other list as it grows.

Each request's costs are scored at its risk level (`Constraints.risk`): with the policy
`Policy.for_risk` gives for it. Requests at different levels never share a list."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator
from datetime import datetime
from typing import Any

from broker.market.hazard import DEFAULT_HORIZON, Hazard, horizon_bucket
from broker.model import OWNED, Market, Offer, PlaceRequest, PoolKey
from broker.placement import rules
from broker.placement.arrays import Ranked, Source
from broker.placement.cost import by_horizon, hazard_over, idle_cost, option_cost
from broker.placement.outcomes import Ask, Scan
from broker.placement.problem import Alive, Group, Option, Request, Shrinking
from broker.placement.residual import State
from broker.placement.rules import OfferArrays, Probe
from broker.placement.view import SCANS_MAX, WHOLE, Costs, Part, PoolView
from broker.placement.walk import Entries, walk
from policies.evaluate import Constraints
from policies.model import Policy, RiskLevel
from policies.teams import TeamRoom

ALTERNATIVES = 3
PENALTY = 100  # leaving a request unplaced costs this many times its cheapest option
PENALTY_FLOOR_PER_GPU_HOUR = 1.0

_Sized = tuple[Any, Any, Any, list[Option | None]]

_OWN = rules.PRICE_CAP
"""The listed rule whose key is most often the request's own (its price cap: 5,020 of
them for 8,190 lists at 10,000 requests): its mask is made per list, not kept."""
_SHARED = tuple(r for r in rules.LISTED if r is not _OWN)


def fewest_paid(need: int, lists: Iterable[Iterable[Offer]]) -> int:
    """The fewest GPUs `need` GPUs pay for on the offers of `lists`, in whole instances
    (`rules.instances_for`); `need` when there is none (it is never less)."""
    best: int | None = None
    for offers in lists:
        for offer in offers:
            if offer.gpus <= 0:
                continue
            paid = rules.instances_for(need, offer.gpus) * offer.gpus
            if best is None or paid < best:
                best = paid
                if best <= need:
                    return best
    return need if best is None else best


class CandidateBuilder:
    """Turns asks into the solver's requests: lists each request's options (shared by
    requests that ask for the same thing), the resources they use and the teams'
    limits."""

    def __init__(self, view: PoolView, policy: Policy, now: datetime, k: int,
                 indexed: bool = False, costs: Costs | None = None) -> None:
        self.view = view
        self.indexed = indexed
        self.costs = costs
        self._index: dict[tuple[str, Market], OfferArrays] = {}
        self._masks: dict[Hashable, Any] = {}  # `_listed` of all but `_OWN`
        self._rule_masks: dict[Hashable, Any] = {}
        self._sizes: dict[tuple[str, Market, int, float, RiskLevel], _Sized] = {}
        # Large batches: per offer of `_index`, the instances it may still have room
        # for while the solver places (see `Source`); inf: not known to be short.
        self.room: Any = None
        self._room_of: dict[Hashable, float] | None = None  # the `Shrinking.left` it is for
        self.policy = policy
        self.k = k
        self.stale = view.stale_slices(now)
        self.cooling = view.cooling(now)
        self._fresh_key: Hashable | None = None
        self.limits: dict[Hashable, float] = {}
        self.teams: dict[str, TeamRoom] = {}
        self._groups: dict[Hashable, tuple[Group, Scan]] = {}
        self._options: dict[tuple[PoolKey, int, int, float, RiskLevel], Option] = {}
        self._rules: list[str | None] = []
        # Spot risk is scored over each request's own horizon when an estimator is used;
        # otherwise every horizon scores alike and all share one.
        self._by_horizon = by_horizon(view.hazard, policy)
        self._hazards: dict[float, Hazard | None] = {}
        self._paid: dict[Hashable, int] = {}  # `_least_paid`

    def release(self) -> None:
        """Break the batch's cycles once it is solved: each group's `more` is a closure
        over this builder (or a `Source` that names the group), and the builder holds
        the groups. Released, what the batch made is freed by reference counting as it
        is let go, not left for a collection, and none of it is frozen alive by a heap
        sweep between batches (broker.daemon's `HEAP_SWEEP_SECONDS`)."""
        for group, _ in self._groups.values():
            group.more = None
        for cache in (self._groups, self._options, self._index, self._masks,
                      self._rule_masks, self._sizes, self._hazards, self._paid):
            cache.clear()

    def horizon(self, req: PlaceRequest) -> float:
        """The horizon (hours) the request's spot risk is scored over."""
        return horizon_bucket(req.duration_hours) if self._by_horizon else DEFAULT_HORIZON

    def hazard(self, h: float) -> Hazard | None:
        """The estimates over `h` hours (the view's estimator when it scores alike)."""
        try:
            return self._hazards[h]
        except KeyError:
            got = self._hazards[h] = hazard_over(self.view.hazard, self.policy, h)
            return got

    def walk_costs(self, policy: Policy, h: float
                   ) -> dict[tuple[PoolKey, int, int], tuple[Offer, float]] | None:
        """The index's memo of the walks' option costs over `h` hours under `policy` (a
        level of the builder's, `Policy.for_risk`): `CostMemo.walks`; None without the
        index."""
        if self.costs is None:
            return None
        return self.costs.memo.walks(self.view.hazard, policy, h)

    def rule_of(self, n: int) -> str | None:
        return self._rules[n]

    def risk(self, c: Constraints) -> RiskLevel:
        """The risk level the request of verdict `c` is scored at."""
        return c.risk or self.policy.scoring.risk

    def probe(self, ask: Ask, c: Constraints) -> Probe:
        """The request as the rules read it, against this batch's view, with the policy
        at its risk level."""
        return Probe(ask.request, c, self.view, self.policy.for_risk(self.risk(c)),
                     ask.exclude, self.stale, self.cooling)

    def request(self, ask: Ask, c: Constraints) -> tuple[Request | None, Scan]:
        req = ask.request
        h = self.horizon(req)
        risk = self.risk(c)
        sig = (req.gpus, c.gpus, c.markets, c.cap, c.clouds, c.deny_clouds, c.regions,
               c.deny_regions, c.residency, req.clouds, req.regions, ask.exclude, h, risk)
        got = self._groups.get(sig)
        if got is None and self.indexed:
            probe = self.probe(ask, c)
            source = Source(self, self._ranked(probe, h), req.gpus, h, risk)
            group = Group([], 0.0, source.more)
            source.group = group
            group.options, group.upto = source.more(self.k, None, None)
            scan = Scan() if group.options else self._scan(probe)
            got = self._groups[sig] = (group, scan)
        if got is None:
            # What the walk saw of a request with no option (`Scan`, what its rejection
            # names) depends on the offers and the request alone, not on the holdings:
            # kept by the index until its lists next change, a request of the same
            # shape is not walked again over every offer only to count it.
            seen = self.costs.scans_now() if self.costs is not None else None
            key = (sig, self._fresh()) if seen is not None else None
            known = seen.get(key) if seen is not None else None
            options, upto, scan = self._walk(ask, c, self.k, None, h=h, scan=known)
            if seen is not None and not options and known is None and \
                    len(seen) < SCANS_MAX:
                seen[key] = dataclasses.replace(scan)

            def more(k: int | None, below: float | None, alive: Alive | None,
                     ask: Ask = ask, c: Constraints = c
                     ) -> tuple[list[Option], float]:
                found, upto, _ = self._walk(ask, c, k, below, alive, h=h)
                return found, upto

            got = self._groups[sig] = (Group(options, upto, more), scan)
        group, scan = got
        if not group.options:
            return None, scan
        horizon = req.duration_hours or 1.0
        extra = None
        s = self.policy.scoring
        if s.spread_weight and c.zone_share:
            # The soft spread term makes the order the request's own: its own group.
            weight, shares = s.spread_weight, c.zone_share

            def extra(o: Option) -> float:
                return o.price * weight * shares.get((o.cloud, o.zone), 0.0)

            def key(o: Option) -> float:
                return o.cost_per_hour + extra(o)

            shared = group

            def own_more(k: int | None, below: float | None, alive: Alive | None
                         ) -> tuple[list[Option], float]:
                shared.grow(k=k, below=below, alive=alive)
                return sorted(shared.options, key=key), shared.upto

            group = Group(sorted(group.options, key=key), group.upto,
                                 None if group.complete else own_more)
            # An unlisted option costs at least `upto` before the spread term: list
            # until none could beat the best listed one with it.
            while not group.complete and group.options and \
                    group.upto <= key(group.options[0]) and \
                    group.grow(below=key(group.options[0])):
                pass
        if c.team is not None:
            self._team(c)
        self._rules.append(c.rule)
        best = min(o.cost_per_hour for o in group.options[:ALTERNATIVES + 1])
        if best <= 0:
            # Paid-for capacity may cost nothing: then the penalty is that of the
            # cheapest option that costs something, and never below $1 per GPU-hour.
            best = max(min((o.cost_per_hour for o in group.options if o.cost_per_hour > 0),
                           default=0.0), PENALTY_FLOOR_PER_GPU_HOUR * req.gpus)
        return Request(group=group, horizon=horizon, penalty=PENALTY * horizon * best,
                              team=c.team, extra=extra, min_gpus=req.gpus,
                              least_paid=None if c.gpus_left is None else
                              self._least_paid(req.gpus, c)), scan

    def _least_paid(self, need: int, c: Constraints) -> Callable[[], int]:
        """The fewest GPUs a request for `need` of the verdict's models and markets pays
        for on any offer of the view (`rules.instances_for` whole instances), once per
        batch and shape, when first asked: a bound below every option it can have."""
        key = (need, c.gpus, c.markets)

        def least() -> int:
            got = self._paid.get(key)
            if got is None:
                got = self._paid[key] = fewest_paid(
                    need, (self.view.by_gpu(gpu, m) for gpu in c.gpus for m in c.markets))
            return got

        return least

    def team_of(self, c: Constraints) -> None:
        """Count the verdict's team in the batch's limits (a request with options does
        this as it is listed)."""
        if c.team is not None:
            self._team(c)

    def split(self, ask: Ask, c: Constraints, st: State
              ) -> list[tuple[Option, int]] | None:
        """The request in up to `max_parts` parts, each one pool's option and the GPUs
        of the request it covers, taken from `st` (given back if it does not fit; None).
        """
        req = ask.request
        h, risk = self.horizon(req), self.risk(c)
        offers = list(self._eligible(ask, c))
        parts: list[tuple[Option, int]] = []
        left = req.gpus
        while left > 0 and len(parts) < req.max_parts:
            # Each part covers at least an even share of what is left over the parts
            # still allowed; a spot part's cost per GPU grows with its instances (a
            # gang's risk), an on-demand one's does not: the fewest and the most
            # instances are the candidates, and the cheaper per GPU wins (the larger
            # on a tie).
            share = -(-left // (req.max_parts - len(parts)))
            best: tuple[float, int, Option, int] | None = None
            for offer in offers:
                if any(o.ref[0].pool == offer.pool for o, _ in parts):
                    continue  # one part per pool: a part is one lease of one pool
                want = -(-left // offer.gpus)
                fit = st.room(self.option(offer, 1, min(left, offer.gpus), h, risk))
                most = int(min(want, fit))
                for n in {-(-share // offer.gpus), most}:
                    if n < 1 or n > most:
                        continue
                    covers = min(left, n * offer.gpus)
                    o = self.option(offer, n, covers, h, risk)
                    if not st.allows(c.team, o):
                        continue
                    rank = (o.cost_per_hour / covers, -covers)
                    if best is None or rank < best[:2]:
                        best = (*rank, o, covers)
            if best is None:
                break
            _, _, o, covers = best
            st.use(c.team, o)
            parts.append((o, covers))
            left -= covers
        if left > 0:
            for o, _ in parts:
                st.use(c.team, o, -1)
            return None
        return parts

    def _eligible(self, ask: Ask, c: Constraints) -> Iterator[Offer]:
        """Every fresh offer the request may use, whatever its free capacity: those that
        pass the rules that do not depend on the instances (`rules.ELIGIBLE`)."""
        probe = self.probe(ask, c)
        for gpu in c.gpus:
            for m in c.markets:
                for offer in self._offers(gpu, m):
                    if rules.first_failing(probe, offer, 1, rules.ELIGIBLE) is None:
                        yield offer

    def _team(self, c: Constraints) -> None:
        if c.team is None or c.team in self.teams:
            return
        by_cloud: Counter[str] = Counter()
        for (cloud, _), n in c.gpus_by_zone.items():
            by_cloud[cloud] += n
        self.teams[c.team] = TeamRoom(
            gpus_left=c.gpus_left, budget_left=c.budget_left,
            zone_share=c.max_zone_share, cloud_share=c.max_cloud_share,
            grace=c.spread_grace, total=c.team_gpus, by_zone=dict(c.gpus_by_zone),
            by_cloud=dict(by_cloud), owned_left=c.owned_left)

    def option(self, offer: Offer, instances: int, need: int, h: float,
               risk: RiskLevel | None = None, cost: float | None = None) -> Option:
        """The option of `instances` of the offer for `need` GPUs, costed over `h` hours
        at risk level `risk` (None: the policy's own) (made once), and the limits of the
        resources it uses. `cost`: its cost per hour, when the caller has just read it
        (`broker.placement.cost.option_cost` of the same offer, at the same level and
        horizon: a walk's)."""
        key = offer.pool
        risk = risk or self.policy.scoring.risk
        got = self._options.get((key, instances, need, h, risk))
        if got is not None:
            return got
        if self.costs is not None:
            offer = self.view.get(key) or offer  # the newest reading of the same state
        uses: list[tuple[Hashable, float]] = []
        if offer.capacity is not None:
            self.limits.setdefault(("pool", key), offer.capacity - self.view.held(key))
            uses.append((("pool", key), instances))
        quota = rules.quota_use(offer, instances)
        if quota is not None:
            qkey, amount, have = quota
            # A group's members read what is left of it rounded down to their own whole
            # instances (vCPUs per instance differ): each reading is at most what is
            # left, so the largest is the limit, whichever member is made an option
            # first. It only grows as members are listed, so the solver never counts
            # more than is left.
            if have > self.limits.get(qkey, -math.inf):
                self.limits[qkey] = have
            uses.append((qkey, amount))
        price = instances * offer.price_per_hour  # type: ignore[operator]
        if cost is None:
            cost = option_cost(offer, instances, need, self.policy.for_risk(risk),
                               hazard=self.hazard(h))
        o = Option(cost, tuple(uses), instances * offer.gpus, price, key.cloud,
                          key.zone, (offer, instances),
                          instances * offer.gpus if key.market is OWNED else 0)
        self._options[(key, instances, need, h, risk)] = o
        return o

    def _arrays(self, gpu: str, m: Market) -> OfferArrays:
        got = self._index.get((gpu, m))
        if got is None:
            import numpy as np

            offers = self._offers(gpu, m)
            kept = self.costs.memo.arrays if self.costs is not None else None
            last = kept.get((gpu, m)) if kept is not None else None
            # The last batch's arrays when its offers are the very same (most batches of
            # a burst): their room read again, the rest shared.
            if last is not None and not self.policy.scoring.spot_min_discount and \
                    last.offers == offers:
                got = last.again(self.view)
            else:
                got = OfferArrays.of(offers, self.policy, self.view)
                if kept is not None:
                    kept[(gpu, m)] = got
            self._index[(gpu, m)] = got
            # Its offers' slots in `room`, after those of the arrays made before.
            before = self.room if self.room is not None else np.zeros(0)
            got.base = len(before)
            self.room = np.concatenate([before, np.full(len(got.offers), np.inf)])
        return got

    def _listed(self, gpu: str, m: Market, arr: OfferArrays, p: Probe, need: int,
                inst: Any) -> Any:
        """Per offer of `arr`: whether it passes the rules a batch's lists filter by
        (`rules.LISTED`), for `need` GPUs. Each rule's mask is shared by the batch's
        requests whose rule reads the same (`Rule.key`; one policy, so one residency
        table), and so is the product of all but `_OWN`'s: at 10,000 requests, 1,222
        region masks and 130 of capacity serve 8,190 lists (bench/placement.py b)."""
        key = (gpu, m, need, *(r.key(p) for r in _SHARED))
        got = self._masks.get(key)
        if got is None:
            got = None
            for r in _SHARED:
                x = self._mask(gpu, m, arr, p, need, inst, r)
                got = x if got is None else got & x
            self._masks[key] = got
        return got & _OWN.mask(p, arr, inst)

    def _mask(self, gpu: str, m: Market, arr: OfferArrays, p: Probe, need: int, inst: Any,
              rule: rules.Rule) -> Any:
        """`rule`'s mask over `arr` for `need` GPUs, made once per batch per `Rule.key`."""
        key = (gpu, m, rule.name, need if rule.sized else None, rule.key(p))
        got = self._rule_masks.get(key)
        if got is None:
            got = self._rule_masks[key] = rule.mask(p, arr, inst)
        return got

    def _ranked(self, p: Probe, h: float) -> Ranked:
        """The request's candidates over every acceptable model and market (large
        batches): filtered by the rules' masks and costed at once on the batch's offer
        arrays; `Source` makes options of them, cheapest expected cost per hour first,
        as they are read."""
        import numpy as np

        need, c, risk = p.request.gpus, p.c, p.policy.scoring.risk
        arrays: list[OfferArrays] = []
        made: list[list[Option | None]] = []
        parts: list[Any] = []
        rows: list[Any] = []
        insts: list[Any] = []
        costs: list[Any] = []
        prices: list[Any] = []
        slots: list[Any] = []
        for gpu in c.gpus:
            for m in c.markets:
                arr = self._arrays(gpu, m)
                if not arr.offers:
                    continue
                inst, cost, price, options = self._sized(gpu, m, arr, need, h, risk)
                idx = np.flatnonzero(self._listed(gpu, m, arr, p, need, inst))
                parts.append(np.full(len(idx), len(arrays)))
                arrays.append(arr)
                made.append(options)
                rows.append(idx)
                insts.append(inst[idx])
                costs.append(cost[idx])
                prices.append(price[idx])
                slots.append(arr.base + idx)
        return Ranked(arrays, made, parts, rows, insts, costs, prices, slots,
                      head=4 * self.k)

    def _sized(self, gpu: str, m: Market, arr: OfferArrays, need: int, h: float,
               risk: RiskLevel) -> _Sized:
        """Per offer of `arr`, for `need` GPUs: the instances, their expected cost (over
        `h` hours, at risk level `risk`) and price per hour, and the option once made;
        shared by the batch's requests for as many GPUs at that horizon and level."""
        got = self._sizes.get((gpu, m, need, h, risk))
        if got is None:
            policy = self.policy.for_risk(risk)
            inst = rules.instances_for(need, arr.gpus)
            paid = inst * arr.gpus
            memo = self.costs.memo.table(self.view.hazard, policy, h) \
                if self.costs is not None else None
            eff, gang = arr.eff(h, policy, self.hazard(h), memo)
            cost = paid * (eff + (inst - 1) * gang)
            if policy.scoring.idle_gpu_weight:
                cost = cost + idle_cost(policy, paid, need, arr.ppg)
            got = self._sizes[(gpu, m, need, h, risk)] = (inst, cost, paid * arr.ppg,
                                                       [None] * len(arr.offers))
        return got

    def _scan(self, p: Probe) -> Scan:
        """What the candidates of a request that has none say about why (large batches):
        the first rule each offer fails (`rules.first_failing_masks`, with the masks the
        lists keep)."""
        import numpy as np

        scan = Scan()
        table = (*rules.WHERE, rules.POLICY_REGION, rules.PRICE_CAP)
        region, cap = len(rules.WHERE), len(rules.WHERE) + 1
        for gpu in p.c.gpus:
            for m in p.c.markets:
                arr = self._arrays(gpu, m)
                if not arr.offers:
                    continue

                def mask(r: rules.Rule, gpu: str = gpu, m: Market = m,
                         arr: OfferArrays = arr) -> Any:
                    return r.mask(p, arr, 1) if r is _OWN else \
                        self._mask(gpu, m, arr, p, 1, 1, r)

                failing = rules.first_failing_masks(p, arr, 1, table, mask)
                matching = failing > region
                scan.policy_excluded += int(np.count_nonzero(failing == region))
                scan.matching += int(np.count_nonzero(matching))
                if matching.any():
                    scan.cheapest_ppg = min(scan.cheapest_ppg, float(arr.ppg[matching].min()))
                scan.under_cap += int(np.count_nonzero(failing > cap))
        return scan

    def live_room(self, alive: Alive | None) -> Any:
        """`room` while the solver's resources only shrink (its greedy phase, when the
        lists are read with a `Shrinking` filter): what it found used up stays used up.
        None otherwise. Each greedy phase (its own `Shrinking.left`) starts from a clean
        `room`."""
        if not isinstance(alive, Shrinking) or self.room is None:
            return None
        if alive.left is not self._room_of:
            self.room[:] = math.inf
            self._room_of = alive.left
        return self.room

    def used_up(self, slot: int, o: Option, alive: Alive) -> None:
        """Record, while resources only shrink, that the offer in `room` slot `slot` has
        room for fewer instances than `o` takes: how many its pool and quota have left."""
        assert isinstance(alive, Shrinking)
        live, limits = alive.left, self.limits
        n = o.ref[1]
        room = math.inf
        for key, amount in o.uses:
            left = live.get(key)
            if left is None:
                left = limits.get(key)
            if left is not None and amount > 0:
                room = min(room, left * n / amount)
        if room < self.room[slot]:
            self.room[slot] = room

    def _walk(self, ask: Ask, c: Constraints, k: int | None, limit: float | None,
              alive: Alive | None = None, *, h: float, scan: Scan | None = None
              ) -> tuple[list[Option], float, Scan]:
        """The request's options by walking the offer lists (`broker.placement.walk`);
        `scan`: what a walk that found none saw, known already."""
        return walk(self, self.probe(ask, c), k, limit, alive, h, known=scan)

    def _fresh(self) -> Hashable:
        """The stale slices and cooling pools the batch's walks pass over (a key)."""
        if self._fresh_key is None:
            self._fresh_key = (frozenset(self.stale), frozenset(self.cooling))
        return self._fresh_key

    def _offers(self, gpu: str, m: Market) -> list[Offer]:
        """The priced offers of `gpu` in `m` the batch may place on (neither of a stale
        slice nor cooling down), in the pool's order: a list of the batch's own. With
        nothing stale or cooling (most batches) a copy of the pool's, made in C: the
        arrays of a burst's batches list thousands of offers each."""
        view, stale, cooling = self.view, self.stale, self.cooling
        offers = view.by_gpu(gpu, m)
        if not stale and not cooling:
            return list(offers)
        return [o for o in offers
                if not ((cooling and o.pool in cooling)
                        or (stale and view.slice_of(o.pool) in stale))]

    def _plain(self, gpu: str, m: Market) -> Entries:
        # Read as far as the walk goes: the pool's own list when nothing is passed over.
        filtered = self.stale or self.cooling
        for offer in self._offers(gpu, m) if filtered else self.view.by_gpu(gpu, m):
            yield offer.price_per_hour / offer.gpus, offer.pool, offer  # type: ignore[operator]

    def _by_price(self, gpu: str, m: Market, part: Part = WHOLE) -> Entries:
        """`_plain` from the `CostIndex`'s list in order of price: only the offers of
        `part`."""
        assert self.costs is not None
        return self._fresh_of(self.costs.by_price(gpu, m, part=part))

    def _by_cost(self, gpu: str, m: Market, h: float, risk: RiskLevel, part: Part = WHOLE
                 ) -> Entries:
        """`_plain` in order of `unit_cost` at risk level `risk` (from the `CostIndex`),
        which is the bound; only the offers of `part`."""
        assert self.costs is not None
        return self._fresh_of(self.costs.sorted(gpu, m, h, risk, part=part))

    def _fresh_of(self, entries: list[tuple[float, PoolKey, Offer]]) -> Entries:
        """The index's list as it is when nothing is stale or cooling (most batches),
        else those of its entries that are neither, as the walk reads them."""
        view, stale, cooling = self.view, self.stale, self.cooling
        if not stale and not cooling:
            return entries
        return (e for e in entries
                if not ((cooling and e[1] in cooling)
                        or (stale and view.slice_of(e[1]) in stale)))
