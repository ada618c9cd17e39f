"""The placement optimizer: a pure function from (requests, pool, policy) to decisions.

A batch of requests is placed together (`solve`): `_Builder` lists each request's
options — fresh offers of an acceptable GPU model (with the policy's equivalents),
market, cloud, region and residency, under the price cap, not in a cool-down, with free
capacity and quota for it alone — cheapest expected cost per hour first:

    instances × price × (1 + restart_hours × interruption_rate
                           + availability_weight × (1 − availability)
                           + spread_weight × share of the team's GPUs in that zone)
    + idle_gpu_weight × price of the GPUs paid for but not asked for

(interruption risk counts for spot only; unknown signals take the policy's `unknown_*`
values; a spot pool not `scoring.spot_min_discount` under on-demand for the same type
and zone is skipped). Requests asking for the same thing share one list, read further
only when its options run out. `broker.solver` then assigns the batch within every
pool's free capacity, quota group, team `max_gpus`, `budget_per_hour` and spread limit;
a request it leaves unplaced is rejected with the constraint that binds.

Small batches walk the pool's price index per request; large ones (`index_min_batch`)
rank each GPU model's offers as numpy arrays once per batch.

No I/O here: the pool is read through the small `PoolView` protocol.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import Any, Protocol

from broker import solver
from broker.model import Market, Offer, Placement, PlaceRequest, PoolKey, RejectCode
from policies.evaluate import Constraints, Denied, evaluate
from policies.evaluate import describe as describe_constraints
from policies.model import Policy

ALTERNATIVES = 3
PENALTY = 100  # leaving a request unplaced costs this many times its cheapest option


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


@dataclass(frozen=True, slots=True)
class Settings:
    """How batches are solved. `candidates`: options listed per request up front (more
    are listed when they run out). Batches of at most `exact_max_batch` requests that
    the heuristic cannot prove optimal go to the MILP for at most `exact_time_limit`
    seconds."""

    candidates: int = 8
    index_min_batch: int = 64
    exact_max_batch: int = 200
    exact_time_limit: float = 0.1


@dataclass(frozen=True, slots=True)
class BatchResult:
    outcomes: list[Outcome]
    solver: str  # "heuristic" | "milp" | "none" (nothing to solve)
    objective: float
    bound: float
    optimal: bool
    seconds: float

    @property
    def gap(self) -> float:
        if self.bound <= 0:
            return 0.0
        return max(0.0, (self.objective - self.bound) / self.bound)


def place(asks: Sequence[Ask], view: PoolView, policy: Policy, *, now: datetime,
          retry_after_seconds: float | None = None,
          settings: Settings = Settings()) -> list[Outcome]:
    """Place a batch of asks together (see `solve`); one outcome per ask, in order."""
    return solve(asks, view, policy, now=now, retry_after_seconds=retry_after_seconds,
                 settings=settings).outcomes


def solve(asks: Sequence[Ask], view: PoolView, policy: Policy, *, now: datetime,
          retry_after_seconds: float | None = None,
          settings: Settings = Settings()) -> BatchResult:
    """Place a batch of asks together: at most one pool each, within every pool's free
    capacity (its estimate minus what the broker holds), each quota's headroom, each
    team's `max_gpus`, `budget_per_hour` and spread limits, at the lowest total
    expected cost; as many as possible first. Requests that nothing could take are
    rejected with the constraint that binds."""
    builder = _Builder(view, policy, now, settings.candidates,
                       indexed=len(asks) >= settings.index_min_batch)
    outcomes: list[Outcome | None] = [None] * len(asks)
    index: list[int] = []  # request of the problem -> ask
    requests: list[solver.Request] = []
    for k, ask in enumerate(asks):
        c = constraints_for(ask, policy)
        if isinstance(c, Denied):
            outcomes[k] = Rejection(ask, c.code, c.detail, None)
            continue
        req, scan = builder.request(ask, c)
        if req is None:
            outcomes[k] = _reject(ask, c, scan, retry_after_seconds)
            continue
        index.append(k)
        requests.append(req)
    if not requests:
        return BatchResult([o for o in outcomes if o is not None], "none", 0.0, 0.0, True,
                           0.0)
    problem = solver.Problem(requests, builder.limits, builder.teams)
    builder.problem = problem
    sol = solver.heuristic(problem)
    if not sol.optimal and len(requests) <= settings.exact_max_batch and \
            settings.exact_time_limit > 0:
        sol = solver.exact(problem, time_limit=settings.exact_time_limit, incumbent=sol)
    note = (f"batch of {len(requests)} placed by {sol.solver}"
            + (", optimal" if sol.optimal else f", within {sol.gap:.2%} of optimal"))
    why = solver.why_unplaced(problem, sol.choice) if None in sol.choice else {}
    for n, k in enumerate(index):
        ask = asks[k]
        o = sol.choice[n]
        r = requests[n]
        if o is None:
            outcomes[k] = _unplaced(ask, problem, why.get(n, ("penalty", None)),
                                    retry_after_seconds)
            continue
        offer, instances = o.ref
        placement = Placement.of(offer, instances)
        cost = o.cost_per_hour + (r.extra(o) if r.extra is not None else 0.0)
        others = [x for x in r.options[:ALTERNATIVES + 1] if x is not o][:ALTERNATIVES]
        outcomes[k] = Decision(
            ask=ask, placement=placement, expected_cost_per_hour=cost,
            reason=_reason(placement, offer, cost, ask.request.duration_hours,
                           builder.rule_of(n)) + (f"; {note}" if len(requests) > 1 else ""),
            alternatives=tuple(Placement.of(*x.ref) for x in others))
    return BatchResult([o for o in outcomes if o is not None], sol.solver, sol.objective,
                       sol.bound, sol.optimal, sol.seconds)


class _Builder:
    """Turns asks into the solver's requests: lists each request's options (shared by
    requests that ask for the same thing), the resources they use and the teams'
    limits."""

    def __init__(self, view: PoolView, policy: Policy, now: datetime, k: int,
                 indexed: bool = False) -> None:
        self.view = view
        self.indexed = indexed
        self.problem: solver.Problem | None = None
        self._index: dict[tuple[str, Market], _Arrays] = {}
        self.policy = policy
        self.k = k
        self.stale = view.stale_slices(now)
        self.cooling = view.cooling(now)
        self.limits: dict[Hashable, float] = {}
        self.teams: dict[str, solver.Team] = {}
        self._groups: dict[Hashable, tuple[solver.Group, _Scan]] = {}
        self._options: dict[tuple[PoolKey, int, int], solver.Option] = {}
        self._rules: list[str | None] = []

    def rule_of(self, n: int) -> str | None:
        return self._rules[n]

    def request(self, ask: Ask, c: Constraints) -> tuple[solver.Request | None, _Scan]:
        req = ask.request
        sig = (req.gpus, c.gpus, c.markets, c.cap, c.clouds, c.deny_clouds, c.regions,
               c.deny_regions, c.residency, req.clouds, req.regions, ask.exclude)
        got = self._groups.get(sig)
        if got is None and self.indexed:
            scan = _Scan()
            source = _Source(partial(self._stream, ask, c, scan))
            group = solver.Group([], 0.0, source.more)
            source.group = group
            group.options, group.upto = source.more(self.k, None, None)
            got = self._groups[sig] = (group, scan)
        if got is None:
            options, upto, scan = self._walk(ask, c, self.k, None)

            def more(k: int | None, below: float | None, alive: solver.Alive | None,
                     ask: Ask = ask, c: Constraints = c
                     ) -> tuple[list[solver.Option], float]:
                found, upto, _ = self._walk(ask, c, k, below, alive)
                return found, upto

            got = self._groups[sig] = (solver.Group(options, upto, more), scan)
        group, scan = got
        if not group.options:
            return None, scan
        horizon = req.duration_hours or 1.0
        extra = None
        s = self.policy.scoring
        if s.spread_weight and c.zone_share:
            # The soft spread term makes the order the request's own: its own group.
            weight, shares = s.spread_weight, c.zone_share

            def extra(o: solver.Option) -> float:
                return o.price * weight * shares.get((o.cloud, o.zone), 0.0)

            def key(o: solver.Option) -> float:
                return o.cost_per_hour + extra(o)

            shared = group

            def own_more(k: int | None, below: float | None, alive: solver.Alive | None
                         ) -> tuple[list[solver.Option], float]:
                shared.grow(k=k, below=below, alive=alive)
                return sorted(shared.options, key=key), shared.upto

            group = solver.Group(sorted(group.options, key=key), group.upto,
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
        return solver.Request(group=group, horizon=horizon, penalty=PENALTY * horizon * best,
                              team=c.team, extra=extra, min_gpus=req.gpus), scan

    def _team(self, c: Constraints) -> None:
        if c.team is None or c.team in self.teams:
            return
        by_cloud: Counter[str] = Counter()
        for (cloud, _), n in c.gpus_by_zone.items():
            by_cloud[cloud] += n
        self.teams[c.team] = solver.Team(
            gpus_left=c.gpus_left, budget_left=c.budget_left,
            zone_share=c.max_zone_share, cloud_share=c.max_cloud_share,
            grace=c.spread_grace, total=c.team_gpus, by_zone=dict(c.gpus_by_zone),
            by_cloud=dict(by_cloud))

    def _option(self, offer: Offer, instances: int, need: int) -> solver.Option:
        key = offer.pool
        got = self._options.get((key, instances, need))
        if got is not None:
            return got
        uses: list[tuple[Hashable, float]] = []
        if offer.capacity is not None:
            self.limits.setdefault(("pool", key), offer.capacity - self.view.held(key))
            uses.append((("pool", key), instances))
        if offer.quota_headroom is not None:
            if offer.quota_group is not None and offer.quota_units:
                qkey: Hashable = ("quota", offer.quota_group)
                units = offer.quota_units
                have = offer.quota_headroom // max(offer.gpus, 1) * units
            else:
                qkey, units, have = ("quota", key), offer.gpus, offer.quota_headroom
            # The first offer of a group sets its limit (members differ only by rounding
            # vCPUs to whole instances); a limit never changes once the solver has it.
            self.limits.setdefault(qkey, have)
            uses.append((qkey, instances * units))
        price = instances * offer.price_per_hour  # type: ignore[operator]
        cost = expected_cost(offer, instances, self.policy)
        idle = self.policy.scoring.idle_gpu_weight
        if idle:
            cost += idle * (instances * offer.gpus - need) * (price / (instances * offer.gpus))
        o = solver.Option(cost, tuple(uses), instances * offer.gpus, price, key.cloud,
                          key.zone, (offer, instances))
        self._options[(key, instances, need)] = o
        return o

    def _arrays(self, gpu: str, m: Market) -> _Arrays:
        got = self._index.get((gpu, m))
        if got is None:
            got = self._index[(gpu, m)] = _Arrays.of(
                self._plain(gpu, m), self.policy, self.view)
        return got

    def _stream(self, ask: Ask, c: Constraints, scan: _Scan
                ) -> Iterator[tuple[float, solver.Option]]:
        """The request's options in order of expected cost per hour, lazily (large
        batches): the filters and costs over every acceptable model and market are
        computed at once on the batch's offer arrays, then options are made as they are
        read. Yields (the option's cost per hour — no later one is cheaper — , the
        option)."""
        import numpy as np

        req = ask.request
        need = req.gpus
        cap = c.cap
        own_clouds = set(req.clouds) if req.clouds else None
        own_regions = set(req.regions) if req.regions else None
        idle = self.policy.scoring.idle_gpu_weight
        costs: list[Any] = []
        picks: list[tuple[_Arrays, Any, Any]] = []
        for gpu in c.gpus:
            for m in c.markets:
                arr = self._arrays(gpu, m)
                if not arr.offers:
                    continue
                own = np.array([(own_clouds is None or cl in own_clouds)
                                and (own_regions is None or rg in own_regions)
                                for cl, rg in arr.regions], dtype=bool)[arr.region]
                allowed = np.array([c.region_ok(cl, rg) for cl, rg in arr.regions],
                                   dtype=bool)[arr.region]
                matching = own & allowed
                scan.policy_excluded += int(np.count_nonzero(own & ~allowed))
                scan.matching += int(np.count_nonzero(matching))
                if matching.any():
                    scan.cheapest_ppg = min(scan.cheapest_ppg, float(arr.ppg[matching].min()))
                under = matching if cap is None else matching & (arr.ppg <= cap)
                scan.under_cap += int(np.count_nonzero(under))
                inst = -(-need // arr.gpus)
                ok = under & (arr.free >= inst) & (arr.quota >= inst * arr.gpus) & arr.disc_ok
                idx = np.flatnonzero(ok)
                paid = inst[idx] * arr.gpus[idx]
                cost = paid * arr.eff[idx]
                if idle:
                    cost = cost + idle * (paid - need) * arr.ppg[idx]
                costs.append(cost)
                picks.append((arr, idx, inst[idx]))
        if not costs:
            return
        cost = np.concatenate(costs)
        part = np.concatenate([np.full(len(c_), p) for p, c_ in enumerate(costs)])
        pos = np.concatenate([np.arange(len(c_)) for c_ in costs])
        exclude = ask.exclude
        # The cheapest few by partial sort (most groups read no further), then the rest.
        head = min(len(cost), 4 * self.k)
        first = np.argpartition(cost, head - 1)[:head] if head < len(cost) else \
            np.arange(len(cost))
        first = first[np.argsort(cost[first], kind="stable")]
        rest = np.ones(len(cost), dtype=bool)
        rest[first] = False
        for order in (first, None):
            if order is None:
                left = np.flatnonzero(rest)
                order = left[np.argsort(cost[left], kind="stable")]
            for lo in range(0, len(order), 256):  # plain Python numbers, a chunk at a time
                chunk = order[lo:lo + 256]
                parts = part[chunk]
                at = pos[chunk]
                rows = [picks[p][1][a] for p, a in zip(parts.tolist(), at.tolist(),
                                                       strict=True)]
                insts = [picks[p][2][a] for p, a in zip(parts.tolist(), at.tolist(),
                                                        strict=True)]
                for p, row, n, co in zip(parts.tolist(), rows, insts, cost[chunk].tolist(),
                                         strict=True):
                    offer = picks[p][0].offers[int(row)]
                    if exclude and offer.pool in exclude:
                        continue
                    yield co, self._option(offer, int(n), need)

    def _plain(self, gpu: str, m: Market) -> Iterator[tuple[float, Offer, float, int | None]]:
        view, stale, cooling = self.view, self.stale, self.cooling
        for offer in view.by_gpu(gpu, m):
            key = offer.pool
            if (cooling and key in cooling) or (stale and view.slice_of(key) in stale):
                continue
            ppg = offer.price_per_hour / offer.gpus  # type: ignore[operator]
            yield ppg, offer, ppg, None  # free instances: computed where needed

    def _walk(self, ask: Ask, c: Constraints, k: int | None, limit: float | None,
              alive: solver.Alive | None = None
              ) -> tuple[list[solver.Option], float, _Scan]:
        """The request's options, cheapest expected cost per hour first: the best `k`,
        or all of them up to `limit` per hour; the cost per hour below which the list
        holds every option (inf: it holds them all); and what the walk saw."""
        req = ask.request
        view, policy = self.view, self.policy
        cap = c.cap
        own_clouds = set(req.clouds) if req.clouds else None
        own_regions = set(req.regions) if req.regions else None
        exclude = ask.exclude
        min_discount = policy.scoring.spot_min_discount
        idle = policy.scoring.idle_gpu_weight
        need = req.gpus
        scan = _Scan()
        keep = k if limit is None else None
        heap: list[tuple[float, int, solver.Option]] = []
        found: list[solver.Option] = []
        tiebreak = 0
        cut = False
        for gpu in c.gpus:
            for m in c.markets:
                for mult, entries in ((need, self._plain(gpu, m)),):
                    for bound, offer, ppg, _ in entries:
                        key = offer.pool
                        if own_clouds is not None and key.cloud not in own_clouds:
                            continue
                        if own_regions is not None and key.region not in own_regions:
                            continue
                        if exclude and key in exclude:
                            continue
                        if not c.region_ok(key.cloud, key.region):
                            scan.policy_excluded += 1
                            continue
                        scan.matching += 1
                        if ppg < scan.cheapest_ppg:
                            scan.cheapest_ppg = ppg
                        if cap is not None and ppg > cap:
                            break  # sorted by price per GPU-hour: the rest are dearer still
                        scan.under_cap += 1
                        # Any later offer costs at least need × its bound: stop when that
                        # cannot make the list.
                        if keep is not None and len(heap) == keep and mult * bound > -heap[0][0]:
                            cut = True
                            break
                        if limit is not None and mult * bound > limit:
                            cut = True
                            break
                        instances = -(-need // offer.gpus)
                        capacity = offer.capacity
                        if capacity is not None and capacity - view.held(key) < instances:
                            continue
                        quota = offer.quota_headroom
                        if quota is not None and quota < instances * offer.gpus:
                            continue
                        if min_discount and not spot_discount_ok(offer, view, min_discount):
                            continue
                        # The cost first: most offers walked never make the list.
                        cost = expected_cost(offer, instances, policy)
                        if idle:
                            cost += idle * (instances * offer.gpus - need) * ppg
                        if keep is not None and len(heap) == keep and cost >= -heap[0][0]:
                            continue
                        o = self._option(offer, instances, need)
                        if alive is not None and not alive(o):
                            continue
                        cost = o.cost_per_hour
                        if limit is not None:
                            if cost <= limit:
                                found.append(o)
                            else:
                                cut = True
                            continue
                        tiebreak += 1
                        assert keep is not None
                        if len(heap) < keep:
                            heapq.heappush(heap, (-cost, -tiebreak, o))
                        elif cost < -heap[0][0]:
                            heapq.heapreplace(heap, (-cost, -tiebreak, o))
                            cut = True
        if limit is not None:
            found.sort(key=lambda o: o.cost_per_hour)
            return found, (limit if cut else math.inf), scan
        best = [o for _, _, o in sorted(heap, reverse=True)]
        return best, (best[-1].cost_per_hour if cut and best else math.inf), scan


class _Arrays:
    """The fresh offers of one GPU model and market that take placements, as arrays for
    a large batch: expected cost per GPU-hour (`eff`), price per GPU-hour, GPUs per
    instance, free instances and quota headroom in GPUs (inf: unknown), region code,
    and whether a spot offer is discounted enough."""

    def __init__(self) -> None:
        self.offers: list[Offer] = []
        self.regions: list[tuple[str, str]] = []

    @classmethod
    def of(cls, entries: Iterable[tuple[float, Offer, float, int | None]], policy: Policy,
           view: PoolView) -> _Arrays:
        import numpy as np

        a = cls()
        codes: dict[tuple[str, str], int] = {}
        eff, ppg, gpus, free, quota, region, disc = [], [], [], [], [], [], []
        min_discount = policy.scoring.spot_min_discount
        for p, offer, _, _ in entries:
            key = offer.pool
            f = None if offer.capacity is None else offer.capacity - view.held(key)
            a.offers.append(offer)
            eff.append(expected_cost(offer, 1, policy) / offer.gpus)
            ppg.append(p)
            gpus.append(offer.gpus)
            free.append(math.inf if f is None else f)
            q = offer.quota_headroom
            quota.append(math.inf if q is None else q)
            region.append(codes.setdefault((key.cloud, key.region), len(codes)))
            disc.append(not min_discount or spot_discount_ok(offer, view, min_discount))
        a.regions = list(codes)
        a.eff, a.ppg = np.array(eff, dtype=float), np.array(ppg, dtype=float)
        a.gpus = np.array(gpus, dtype=np.int64)
        a.free, a.quota = np.array(free, dtype=float), np.array(quota, dtype=float)
        a.region = np.array(region, dtype=np.int64)
        a.disc_ok = np.array(disc, dtype=bool)
        return a

    eff: Any
    ppg: Any
    gpus: Any
    free: Any
    quota: Any
    region: Any
    disc_ok: Any


class _Source:
    """A group's options read lazily from a `_Builder._stream`, with one item of
    look-ahead (whose cost bound is the group's `upto`). Options the heuristic found
    used up are dropped as they are read; the LP's request for everything under a
    bound then reads a fresh stream."""

    def __init__(self, start: Callable[[], Iterator[tuple[float, solver.Option]]]) -> None:
        self._start = start
        self._it = start()
        self._next: tuple[float, solver.Option] | None = None
        self._done = False
        self._dropped = False
        self.group: solver.Group | None = None

    def _peek(self) -> tuple[float, solver.Option] | None:
        if self._next is None and not self._done:
            self._next = next(self._it, None)
            self._done = self._next is None
        return self._next

    def more(self, k: int | None, below: float | None, alive: solver.Alive | None
             ) -> tuple[list[solver.Option], float]:
        out = list(self.group.options) if self.group is not None else []
        if alive is None and self._dropped:
            self._it, self._next, self._done, self._dropped = self._start(), None, False, False
            out = []
        added = 0
        while (nxt := self._peek()) is not None:
            bound, o = nxt
            if (k is not None and added >= k) or (below is not None and bound > below):
                break
            self._next = None
            if alive is None or alive(o):
                out.append(o)
                added += 1
            else:
                self._dropped = True
        nxt = self._peek()
        return out, (math.inf if nxt is None else nxt[0])


def _unplaced(ask: Ask, problem: solver.Problem, why: tuple[str, Hashable | None],
              retry_after: float | None) -> Rejection:
    """Name the constraint that kept a request with options unplaced in its batch."""
    req = ask.request
    what, key = why
    team = f"team {req.team!r}"
    if what == "team_gpus":
        return Rejection(ask, RejectCode.OVER_BUDGET,
                         f"{team} has {key:g} GPUs of its max_gpus left after this batch's "
                         f"other placements; no placement of {req.gpus} GPUs fits", retry_after)
    if what == "team_budget":
        return Rejection(ask, RejectCode.OVER_BUDGET,
                         f"{team} has too little of its budget_per_hour (${key:.2f}/h left) "
                         f"after this batch's other placements for a placement of "
                         f"{req.gpus} GPUs", retry_after)
    if what == "spread":
        return Rejection(ask, RejectCode.POLICY_DENIED,
                         f"{team}'s spread limit (max_zone_share/max_cloud_share) leaves no "
                         f"zone or cloud for {req.gpus} more GPUs", retry_after)
    where = ""
    if what == "resource" and isinstance(key, tuple):
        kind, name = key
        where = (f": {name.cloud}/{name.zone} {name.instance_type} is taken"
                 if kind == "pool" and isinstance(name, PoolKey)
                 else f": quota {name} is used up")
    return Rejection(ask, RejectCode.NO_CAPACITY,
                     f"the free capacity and quota for {req.gpus}×{'|'.join(req.gpu)} went to "
                     f"other requests of this batch{where}", retry_after)


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
