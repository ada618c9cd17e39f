"""The placement optimizer: a pure function from (requests, pool, policy) to decisions.

A batch of requests is placed together (`solve`): `_Builder` lists each request's
options — fresh offers of an acceptable GPU model (with the policy's equivalents),
market, cloud, region and residency, under the price cap, not in a cool-down, with free
capacity and quota for it alone — cheapest expected cost per hour first:

    instances × price × (1 + restart_hours × interruption_rate
                           + availability_weight × (1 − availability)
                           + spread_weight × share of the team's GPUs in that zone)
    + idle_gpu_weight × price of the GPUs paid for but not asked for

(interruption risk counts for spot only, over the request's own duration when the pools'
history is kept: `broker.market.hazard`; unknown signals take the policy's `unknown_*` values;
a spot pool not `scoring.spot_min_discount` under on-demand for the same type and zone
is skipped). Requests asking for the same thing share one list, read further
only when its options run out. `broker.placement.solver` then assigns the batch within every
pool's free capacity, quota group, team `max_gpus`, `budget_per_hour` and spread limit;
a request it leaves unplaced is rejected with the constraint that binds.

Small batches walk the pool's price index per request; large ones (`index_min_batch`)
rank each GPU model's offers as numpy arrays once per batch, and while the solver
places, an offer one list finds used up is skipped by every other list as it grows.

No I/O here: the pool is read through the small `PoolView` protocol.
"""

from __future__ import annotations

import gc
import heapq
import math
import time
from collections import Counter
from collections.abc import Collection, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from broker.market.hazard import DEFAULT_HORIZON, Hazard, HazardEstimator, horizon_bucket
from broker.model import OWNED, Market, Offer, Placement, PlaceRequest, PoolKey, RejectCode
from broker.placement import solver
from policies.evaluate import Constraints, Denied, evaluate
from policies.evaluate import describe as describe_constraints
from policies.model import Policy
from policies.residency import Residency

if TYPE_CHECKING:
    from broker.market.pool import ResourcePool

ALTERNATIVES = 3
PENALTY = 100  # leaving a request unplaced costs this many times its cheapest option
PENALTY_FLOOR_PER_GPU_HOUR = 1.0
SPLIT_MIN_SAVING = 0.05
"""A request that one pool can take is split across pools only when that saves at least
this share of its expected cost: each part is a lease the scheduler launches and renews."""


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

    @property
    def hazard(self) -> HazardEstimator | None:
        """Spot pools' interruption rate and availability expected over a job, from their
        history (None: none kept; the offers' own signals are used)."""


class Snapshot:
    """A `PoolView` frozen at one moment, for placing in a worker thread while the event
    loop goes on changing the pool: every GPU's sorted offer lists (copies of the lists,
    not of the offers, which are immutable), the stale slices and cooling pools at `now`,
    and the instances held. Offers looked up by key (`get`, `slice_of`) and the hazard
    estimator are read live: single lookups, each consistent on its own."""

    def __init__(self, pool: ResourcePool, now: datetime) -> None:
        self._pool = pool
        self._lists: dict[tuple[str, Market | None], list[Offer]] = {}
        for gpu in pool.gpus():
            for market in (None, *Market):
                self._lists[(gpu, market)] = list(pool.by_gpu(gpu, market))
        self._stale = frozenset(pool.stale_slices(now))
        self._cooling = frozenset(pool.cooling(now))
        self._held = {key: pool.held(key) for key in pool.held_pools()}
        self._hazard = pool.hazard

    def by_gpu(self, gpu: str, market: Market | None = None) -> Sequence[Offer]:
        return self._lists.get((gpu, market), ())

    def stale_slices(self, now: datetime) -> Collection[Hashable]:
        return self._stale

    def slice_of(self, key: PoolKey) -> Hashable | None:
        return self._pool.slice_of(key)

    def cooling(self, now: datetime) -> Collection[PoolKey]:
        return self._cooling

    def held(self, key: PoolKey) -> int:
        return self._held.get(key, 0)

    def get(self, key: PoolKey) -> Offer | None:
        return self._pool.get(key)

    @property
    def hazard(self) -> HazardEstimator | None:
        return self._hazard


def by_horizon(hazard: HazardEstimator | None, policy: Policy) -> bool:
    """Whether spot risk is scored over each request's own horizon: with an estimator the
    policy uses (`scoring.hazard_half_life_hours` > 0); otherwise every horizon scores
    alike, and all share `DEFAULT_HORIZON`'s."""
    return hazard is not None and policy.scoring.hazard_half_life_hours > 0


def hazard_over(hazard: HazardEstimator | None, policy: Policy, hours: float
                ) -> Hazard | None:
    """The estimates spot risk is scored with over `hours`."""
    return hazard.at(hours) if hazard is not None and by_horizon(hazard, policy) else hazard


def hazard_for(view: PoolView, policy: Policy, request: PlaceRequest) -> Hazard | None:
    """The hazard estimates a request is scored with: the view's, over the request's own
    horizon (`broker.market.hazard.horizon_bucket` of its `duration_hours`)."""
    return hazard_over(view.hazard, policy, horizon_bucket(request.duration_hours))


def unit_cost(offer: Offer, policy: Policy, hazard: Hazard | None) -> float:
    """The expected cost of one of the offer's GPUs for an hour (`expected_cost` of one
    instance, per GPU): no option on the offer costs less per GPU asked for."""
    return expected_cost(offer, 1, policy, hazard=hazard) / offer.gpus


def _first_two(entry: tuple[float, PoolKey, Offer]) -> tuple[float, PoolKey]:
    return entry[0], entry[1]


_Where = tuple[str, Market, float]  # (GPU model, market, horizon hours)


class CostIndex:
    """The pool's priced offers per (GPU model, market, horizon) in order of `unit_cost`,
    for placing on the event loop: a request's walk can stop as soon as the next offer's
    cost per GPU times the GPUs it asks for exceeds the options it has, which in order
    of price alone can take hundreds of offers more (prices alike, risks not). The
    horizon is a request's (`broker.market.hazard.horizon_bucket`): spot risk is scored over
    it, so a list is kept per horizon asked for (at most `broker.market.hazard.HORIZONS`).

    Built per list on first use, then kept up to date from the pool's changes: an offer
    that changed or went (and with it the hazard estimate of its pool, which changes
    only with such a change) is placed again; a `refresh` of the hazard estimator, or
    another estimator, rebuilds every list. One policy's scoring: a new policy needs a
    new index. The offers are read from the pool when walked (the newest reading)."""

    def __init__(self, pool: ResourcePool, policy: Policy) -> None:
        self.pool = pool
        self.policy = policy
        self._lists: dict[_Where, list[tuple[float, PoolKey, Offer]]] = {}
        self._placed: dict[PoolKey, list[tuple[float, _Where]]] = {}
        self._dirty: set[PoolKey] = set()
        self._hazard_seen: tuple[int, int] = (0, -1)
        self.close = pool.subscribe(self._observe)
        """Stop following the pool (the index is not used any more)."""

    def _observe(self, change: Any) -> None:
        if self._lists:
            self._dirty.update(change.updated)
            self._dirty.update(change.removed)

    def _hazard(self, horizon: float) -> Hazard | None:
        return hazard_over(self.pool.hazard, self.policy, horizon)

    def _horizon(self, horizon: float) -> float:
        """Every horizon scores alike without an estimator in use: one list for all."""
        return horizon if by_horizon(self.pool.hazard, self.policy) else DEFAULT_HORIZON

    def sorted(self, gpu: str, market: Market, horizon: float = DEFAULT_HORIZON
               ) -> list[tuple[float, PoolKey, Offer]]:
        """(unit cost, pool key, offer) of the priced offers of `gpu` in `market`,
        scored over `horizon` hours, cheapest first, as of now (an offer re-read
        unchanged since may be newer in the pool: `ResourcePool.get`)."""
        hazard = self.pool.hazard
        seen = (id(hazard), hazard.refreshes if hazard is not None else 0)
        if seen != self._hazard_seen:
            self._lists.clear()
            self._placed.clear()
            self._dirty.clear()
            self._hazard_seen = seen
        if self._dirty:
            self._place_again()
        where = (gpu, market, self._horizon(horizon))
        got = self._lists.get(where)
        if got is None:
            policy, hz = self.policy, self._hazard(where[2])
            got = sorted(((unit_cost(o, policy, hz), o.pool, o)
                          for o in self.pool.by_gpu(gpu, market)), key=_first_two)
            self._lists[where] = got
            placed = self._placed
            for u, key, _ in got:
                placed.setdefault(key, []).append((u, where))
        return got

    def covers(self, horizon: float) -> bool:
        """Every horizon's list is made when first asked for."""
        return True

    def frozen(self, horizons: Iterable[float] = (DEFAULT_HORIZON,)) -> FrozenCosts:
        """Every list for these horizons, up to date now, copied: for a batch placed in a
        worker thread on a `Snapshot` while the pool and this index go on changing (on
        the loop)."""
        want = sorted({self._horizon(h) for h in horizons})
        for h in want:
            self._hazard(h)  # an estimator's view is made here, on the loop, not in a thread
        for gpu in self.pool.gpus():
            for market in Market:
                for h in want:
                    self.sorted(gpu, market, h)
        return FrozenCosts(self.policy, {k: list(v) for k, v in self._lists.items()
                                         if k[2] in want},
                           normalise=not by_horizon(self.pool.hazard, self.policy))

    def _place_again(self) -> None:
        import bisect

        dirty, self._dirty = self._dirty, set()
        lists, placed = self._lists, self._placed
        horizons = {w[2] for w in lists}
        for key in dirty:
            for u, where in placed.pop(key, ()):
                entries = lists[where]
                i = bisect.bisect_left(entries, (u, key), key=_first_two)
                if i < len(entries) and entries[i][1] == key:
                    del entries[i]
            offer = self.pool.get(key)
            if offer is None or offer.price_per_hour is None or offer.gpus <= 0:
                continue
            for h in horizons:
                where = (offer.gpu, key.market, h)
                entries_or_none = lists.get(where)
                if entries_or_none is None:
                    continue  # that list is built when first asked for
                u = unit_cost(offer, self.policy, self._hazard(h))
                bisect.insort(entries_or_none, (u, key, offer), key=_first_two)
                placed.setdefault(key, []).append((u, where))


class FrozenCosts:
    """A `CostIndex` as it was at one moment (`CostIndex.frozen`), for the horizons it
    was frozen for (`normalise`: every horizon scores alike, one list serves all)."""

    def __init__(self, policy: Policy, lists: dict[_Where, list[tuple[float, PoolKey, Offer]]],
                 normalise: bool = False) -> None:
        self.policy = policy
        self._lists = lists
        self._normalise = normalise
        self._horizons = {w[2] for w in lists}

    def covers(self, horizon: float) -> bool:
        """Whether lists for `horizon` were frozen."""
        return self._normalise or not self._horizons or horizon in self._horizons

    def sorted(self, gpu: str, market: Market, horizon: float = DEFAULT_HORIZON
               ) -> list[tuple[float, PoolKey, Offer]]:
        if self._normalise:
            horizon = DEFAULT_HORIZON
        elif self._horizons and horizon not in self._horizons:
            raise KeyError(f"costs frozen for horizons {sorted(self._horizons)}, "
                           f"not {horizon:g} h")
        return self._lists.get((gpu, market, horizon), [])


Costs = CostIndex | FrozenCosts


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
    """Where a request goes. A request split across pools has its `parts` — each a
    placement and the GPUs of the request it covers, `placement` the first — and one
    lease per part; otherwise `parts` is empty."""

    ask: Ask
    placement: Placement
    expected_cost_per_hour: float
    reason: str
    alternatives: tuple[Placement, ...]
    parts: tuple[tuple[Placement, int], ...] = ()


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


def cost_terms(offer: Offer, policy: Policy, zone_share: float = 0.0,
               hazard: Hazard | None = None, instances: int = 1) -> dict[str, float]:
    """The expected-cost multipliers of `instances` of an offer, each as a share of their
    price."""
    s = policy.scoring
    rate, avail = signals(offer, policy, hazard)
    risk = 0.0
    if offer.pool.market is Market.SPOT:
        rate = (rate if rate is not None else s.unknown_interruption_rate) * instances
        risk = s.restart_hours * rate
        if s.interruption_cost_per_gpu and offer.price_per_hour:
            risk += offer.gpus * s.interruption_cost_per_gpu * rate / offer.price_per_hour
    avail = avail if avail is not None else s.unknown_availability
    return {"interruption": risk, "availability": s.availability_weight * (1 - avail),
            "spread": s.spread_weight * zone_share}


def expected_cost(offer: Offer, instances: int, policy: Policy,
                  zone_share: float = 0.0, hazard: Hazard | None = None) -> float:
    """instances × price × (1 + the `cost_terms`) (the interruption cost per GPU is one
    of them, as a share of the price), computed inline: this runs for every
    candidate of every request. With a `hazard` estimator, a spot pool's signals are
    the ones it expects over a job (`signals`).

    A spot pool's interruption rate is per instance, and a lease of n instances is a
    gang: it is interrupted when any of them is (n × the rate, instances taken as
    independent), and then all of its work since the last checkpoint is lost, so its
    interruption terms grow with n² — fewer, larger instances are safer at one price
    per GPU. The cost per GPU is therefore lowest for one instance: `unit_cost`, the
    bound the walks stop at, stays a bound."""
    s = policy.scoring
    assert offer.price_per_hour is not None
    spot = offer.pool.market is Market.SPOT
    if hazard is not None and spot:
        rate, avail = signals(offer, policy, hazard)
    else:
        rate, avail = offer.interruption_rate, offer.availability
    factor = 1.0 + s.availability_weight * (
        1.0 - (avail if avail is not None else s.unknown_availability))
    extra = 0.0
    if spot:
        if rate is None:
            rate = s.unknown_interruption_rate
        rate *= instances  # the gang's
        factor += s.restart_hours * rate
        if s.interruption_cost_per_gpu:
            extra = offer.gpus * s.interruption_cost_per_gpu * rate
    if zone_share:
        factor += s.spread_weight * zone_share
    return instances * (offer.price_per_hour * factor + extra)


def constraints_for(ask: Ask, policy: Policy, resident: Residency | None = None
                    ) -> Constraints | Denied:
    """The ask's verdict; `resident`: the policy's residency tags, shared by a batch."""
    if ask.constraints is not None:
        return ask.constraints
    return evaluate(policy, ask.request, None, resident)


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
    seconds. Batches of at most `chain_max_batch` requests get the heuristic's costlier
    improvement too (moving requests off a cheaper option another request wants).
    `budget_seconds` bounds the whole solve after the first feasible answer: the
    heuristic's improvement and the MILP (its LP rounds included) stop when it is spent,
    keeping the best answer so far."""

    candidates: int = 8
    index_min_batch: int = 64
    exact_max_batch: int = 200
    exact_time_limit: float = 0.1
    chain_max_batch: int = 2000
    budget_seconds: float = 2.0


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
          settings: Settings = Settings(), costs: Costs | None = None) -> BatchResult:
    """Place a batch of asks together: at most one pool each, within every pool's free
    capacity (its estimate minus what the broker holds), each quota's headroom, each
    team's `max_gpus`, `budget_per_hour` and spread limits, at the lowest total
    expected cost; as many as possible first. Requests that nothing could take are
    rejected with the constraint that binds."""
    # A large batch makes many small objects, in no reference cycles: the collector's
    # full passes over the whole heap (the pool's offers among it), which they set
    # off, would cost more than the batch itself. It resumes when the batch is done.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _solve(asks, view, policy, now=now, retry_after_seconds=retry_after_seconds,
                      settings=settings,
                      costs=costs if costs is not None and costs.policy is policy else None)
    finally:
        if was_enabled:
            gc.enable()


def _solve(asks: Sequence[Ask], view: PoolView, policy: Policy, *, now: datetime,
           retry_after_seconds: float | None, settings: Settings,
           costs: Costs | None = None) -> BatchResult:
    deadline = time.perf_counter() + settings.budget_seconds
    builder = _Builder(view, policy, now, settings.candidates,
                       indexed=len(asks) >= settings.index_min_batch, costs=costs)
    resident = Residency(policy.residency.tags)
    outcomes: list[Outcome | None] = [None] * len(asks)
    index: list[int] = []  # request of the problem -> ask
    requests: list[solver.Request] = []
    splits: list[tuple[int, Constraints, int | None]] = []  # ask, verdict, request
    for k, ask in enumerate(asks):
        c = constraints_for(ask, policy, resident)
        if isinstance(c, Denied):
            outcomes[k] = Rejection(ask, c.code, c.detail, None)
            continue
        if ask.request.max_parts > 1:
            builder.team_of(c)
        req, scan = builder.request(ask, c)
        if ask.request.max_parts > 1:
            splits.append((k, c, len(requests) if req is not None else None))
        if req is None:
            outcomes[k] = _reject(ask, c, scan, retry_after_seconds)
            continue
        index.append(k)
        requests.append(req)
    if not requests:
        if splits:
            _split(builder, solver.Problem([], builder.limits, builder.teams), [], asks,
                   splits, outcomes)
        return BatchResult([o for o in outcomes if o is not None], "none", 0.0, 0.0, True,
                           0.0)
    problem = solver.Problem(requests, builder.limits, builder.teams)
    builder.problem = problem
    sol = solver.heuristic(problem, chains=len(problem.requests) <= settings.chain_max_batch,
                           deadline=deadline)
    left = min(settings.exact_time_limit, deadline - time.perf_counter())
    if not sol.optimal and len(requests) <= settings.exact_max_batch and left > 0:
        sol = solver.exact(problem, time_limit=left, incumbent=sol)
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
    if splits:
        _split(builder, problem, sol.choice, asks, splits, outcomes)
    return BatchResult([o for o in outcomes if o is not None], sol.solver, sol.objective,
                       sol.bound, sol.optimal, sol.seconds)


def _split(builder: _Builder, problem: solver.Problem, choice: Sequence[solver.Option | None],
           asks: Sequence[Ask], splits: Sequence[tuple[int, Constraints, int | None]],
           outcomes: list[Outcome | None]) -> None:
    """After the batch is solved: each request that may be split (`gang: false`,
    `max_parts` > 1) and that no one pool could take is split across pools in what the
    batch left free, if it fits; one that was placed whole is split instead when that
    saves `SPLIT_MIN_SAVING` of its expected cost. Greedy, in the batch's order: each
    part is the option of lowest expected cost per GPU it covers, and the last allowed
    part must cover the rest."""
    st = solver.State(problem)
    for n, o in enumerate(choice):
        if o is not None:
            st.take(n, o)
    for k, c, at in splits:
        ask = asks[k]
        whole = choice[at] if at is not None else None
        if at is not None and whole is not None:
            st.take(at, whole, -1)
        parts = builder.split(ask, c, st)
        cost = sum(o.cost_per_hour for o, _ in parts) if parts else math.inf
        if parts is None or len(parts) < 2 or (
                whole is not None and cost > (1 - SPLIT_MIN_SAVING) * whole.cost_per_hour):
            for o, _ in parts or ():
                st.use(c.team, o, -1)
            if at is not None and whole is not None:
                st.take(at, whole)
            elif parts is not None and len(parts) == 1:
                # One pool takes it after all (what the batch left): a whole placement.
                o = parts[0][0]
                placement = Placement.of(*o.ref)
                st.use(c.team, o)
                outcomes[k] = Decision(ask, placement, o.cost_per_hour, _reason(
                    placement, o.ref[0], o.cost_per_hour, ask.request.duration_hours,
                    c.rule), ())
            continue
        placed = tuple((Placement.of(*o.ref), gpus) for o, gpus in parts)
        where = "; ".join(f"{p.total_gpus}×{p.gpu} {p.pool.market.value} "
                          f"{p.pool.cloud}/{p.pool.zone} {p.pool.instance_type}"
                          for p, _ in placed)
        why = "no one pool has room for it" if whole is None else \
            f"{1 - cost / whole.cost_per_hour:.0%} below one pool's expected cost"
        outcomes[k] = Decision(
            ask, placed[0][0], cost,
            f"split across {len(placed)} pools ({why}): {where}; expected ${cost:.4g}/h"
            + (f" under rule {c.rule!r}" if c.rule else ""), (), placed)


_Sized = tuple[Any, Any, Any, Any, list[solver.Option | None]]


class _Builder:
    """Turns asks into the solver's requests: lists each request's options (shared by
    requests that ask for the same thing), the resources they use and the teams'
    limits."""

    def __init__(self, view: PoolView, policy: Policy, now: datetime, k: int,
                 indexed: bool = False, costs: Costs | None = None) -> None:
        self.view = view
        self.indexed = indexed
        self.costs = costs
        self.problem: solver.Problem | None = None
        self._index: dict[tuple[str, Market], _Arrays] = {}
        self._masks: dict[Hashable, tuple[Any, Any]] = {}
        self._inside_masks: dict[Hashable, Any] = {}
        self._sizes: dict[tuple[str, Market, int, float], _Sized] = {}
        # Large batches: per offer of `_index`, the instances it may still have room
        # for while the solver places (see `_Source`); inf: not known to be short.
        self.room: Any = None
        self._room_of: dict[Hashable, float] | None = None  # the `live` it is for
        self.policy = policy
        self.k = k
        self.stale = view.stale_slices(now)
        self.cooling = view.cooling(now)
        self.limits: dict[Hashable, float] = {}
        self.teams: dict[str, solver.Team] = {}
        self._groups: dict[Hashable, tuple[solver.Group, _Scan]] = {}
        self._options: dict[tuple[PoolKey, int, int, float], solver.Option] = {}
        self._rules: list[str | None] = []
        # Spot risk is scored over each request's own horizon when an estimator is used;
        # otherwise every horizon scores alike and all share one.
        self._by_horizon = by_horizon(view.hazard, policy)
        self._hazards: dict[float, Hazard | None] = {}

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

    def rule_of(self, n: int) -> str | None:
        return self._rules[n]

    def request(self, ask: Ask, c: Constraints) -> tuple[solver.Request | None, _Scan]:
        req = ask.request
        h = self.horizon(req)
        sig = (req.gpus, c.gpus, c.markets, c.cap, c.clouds, c.deny_clouds, c.regions,
               c.deny_regions, c.residency, req.clouds, req.regions, ask.exclude, h)
        got = self._groups.get(sig)
        if got is None and self.indexed:
            source = _Source(self, self._ranked(ask, c, h), req.gpus, ask.exclude, h)
            group = solver.Group([], 0.0, source.more)
            source.group = group
            group.options, group.upto = source.more(self.k, None, None)
            scan = _Scan() if group.options else self._scan(ask, c)
            got = self._groups[sig] = (group, scan)
        if got is None:
            options, upto, scan = self._walk(ask, c, self.k, None, h=h)

            def more(k: int | None, below: float | None, alive: solver.Alive | None,
                     ask: Ask = ask, c: Constraints = c
                     ) -> tuple[list[solver.Option], float]:
                found, upto, _ = self._walk(ask, c, k, below, alive, h=h)
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
        if best <= 0:
            # Paid-for capacity may cost nothing: then the penalty is that of the
            # cheapest option that costs something, and never below $1 per GPU-hour.
            best = max(min((o.cost_per_hour for o in group.options if o.cost_per_hour > 0),
                           default=0.0), PENALTY_FLOOR_PER_GPU_HOUR * req.gpus)
        return solver.Request(group=group, horizon=horizon, penalty=PENALTY * horizon * best,
                              team=c.team, extra=extra, min_gpus=req.gpus), scan

    def team_of(self, c: Constraints) -> None:
        """Count the verdict's team in the batch's limits (a request with options does
        this as it is listed)."""
        if c.team is not None:
            self._team(c)

    def split(self, ask: Ask, c: Constraints, st: solver.State
              ) -> list[tuple[solver.Option, int]] | None:
        """The request in up to `max_parts` parts, each one pool's option and the GPUs
        of the request it covers, taken from `st` (given back if it does not fit; None).
        """
        req = ask.request
        h = self.horizon(req)
        offers = list(self._eligible(ask, c))
        parts: list[tuple[solver.Option, int]] = []
        left = req.gpus
        while left > 0 and len(parts) < req.max_parts:
            # Each part covers at least an even share of what is left over the parts
            # still allowed; a spot part's cost per GPU grows with its instances (a
            # gang's risk), an on-demand one's does not: the fewest and the most
            # instances are the candidates, and the cheaper per GPU wins (the larger
            # on a tie).
            share = -(-left // (req.max_parts - len(parts)))
            best: tuple[float, int, solver.Option, int] | None = None
            for offer in offers:
                if any(o.ref[0].pool == offer.pool for o, _ in parts):
                    continue  # one part per pool: a part is one lease of one pool
                want = -(-left // offer.gpus)
                fit = st.room(self._option(offer, 1, min(left, offer.gpus), h))
                most = int(min(want, fit))
                for n in {-(-share // offer.gpus), most}:
                    if n < 1 or n > most:
                        continue
                    covers = min(left, n * offer.gpus)
                    o = self._option(offer, n, covers, h)
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
        """Every fresh offer the request may use, whatever its free capacity."""
        req = ask.request
        for gpu in c.gpus:
            for m in c.markets:
                for _, offer, ppg, _ in self._plain(gpu, m):
                    key = offer.pool
                    if (req.clouds and key.cloud not in req.clouds) or \
                            (req.regions and key.region not in req.regions) or \
                            key in ask.exclude or not c.region_ok(key.cloud, key.region) or \
                            (c.cap is not None and ppg > c.cap) or \
                            not spot_discount_ok(offer, self.view,
                                                 self.policy.scoring.spot_min_discount):
                        continue
                    yield offer

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
            by_cloud=dict(by_cloud), owned_left=c.owned_left)

    def _option(self, offer: Offer, instances: int, need: int, h: float) -> solver.Option:
        key = offer.pool
        got = self._options.get((key, instances, need, h))
        if got is not None:
            return got
        if self.costs is not None:
            offer = self.view.get(key) or offer  # the newest reading of the same state
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
        cost = expected_cost(offer, instances, self.policy, hazard=self.hazard(h))
        idle = self.policy.scoring.idle_gpu_weight
        if idle:
            cost += idle * (instances * offer.gpus - need) * (price / (instances * offer.gpus))
        o = solver.Option(cost, tuple(uses), instances * offer.gpus, price, key.cloud,
                          key.zone, (offer, instances),
                          instances * offer.gpus if key.market is OWNED else 0)
        self._options[(key, instances, need, h)] = o
        return o

    def _arrays(self, gpu: str, m: Market) -> _Arrays:
        got = self._index.get((gpu, m))
        if got is None:
            import numpy as np

            got = self._index[(gpu, m)] = _Arrays.of(
                self._plain(gpu, m), self.policy, self.view)
            # Its offers' slots in `room`, after those of the arrays made before.
            before = self.room if self.room is not None else np.zeros(0)
            got.base = len(before)
            self.room = np.concatenate([before, np.full(len(got.offers), np.inf)])
        return got

    def _regions(self, gpu: str, m: Market, arr: _Arrays, ask: Ask, c: Constraints
                 ) -> tuple[Any, Any]:
        """Per offer of `arr`: whether it is in the request's own clouds and regions, and
        whether the policy allows its region; shared by the batch's requests that say
        the same (one policy, so one residency table)."""
        import numpy as np

        req = ask.request
        key = (gpu, m, req.clouds, req.regions, c.clouds, c.deny_clouds, c.regions,
               c.deny_regions, c.residency)
        got = self._masks.get(key)
        if got is None:
            own_clouds = set(req.clouds) if req.clouds else None
            own_regions = set(req.regions) if req.regions else None
            own = np.array([(own_clouds is None or cl in own_clouds)
                            and (own_regions is None or rg in own_regions)
                            for cl, rg in arr.regions], dtype=bool)[arr.region]
            allowed = np.array([c.region_ok(cl, rg) for cl, rg in arr.regions],
                               dtype=bool)[arr.region]
            got = self._masks[key] = (own, allowed)
        return got

    def _ranked(self, ask: Ask, c: Constraints, h: float) -> _Ranked:
        """The request's candidates over every acceptable model and market (large
        batches): filtered and costed at once on the batch's offer arrays; `_Source`
        makes options of them, cheapest expected cost per hour first, as they are read."""
        import numpy as np

        need = ask.request.gpus
        cap = c.cap
        arrays: list[_Arrays] = []
        made: list[list[solver.Option | None]] = []
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
                inst, fits, cost, price, options = self._sized(gpu, m, arr, need, h)
                ok = self._inside(gpu, m, arr, ask, c, need, fits)
                if cap is not None:
                    ok = ok & (arr.ppg <= cap)
                idx = np.flatnonzero(ok)
                parts.append(np.full(len(idx), len(arrays)))
                arrays.append(arr)
                made.append(options)
                rows.append(idx)
                insts.append(inst[idx])
                costs.append(cost[idx])
                prices.append(price[idx])
                slots.append(arr.base + idx)
        return _Ranked(arrays, made, parts, rows, insts, costs, prices, slots,
                       head=4 * self.k)

    def _inside(self, gpu: str, m: Market, arr: _Arrays, ask: Ask, c: Constraints,
                need: int, fits: Any) -> Any:
        """Per offer of `arr`: in the request's regions and able to take `need` GPUs."""
        req = ask.request
        key = (gpu, m, req.clouds, req.regions, c.clouds, c.deny_clouds, c.regions,
               c.deny_regions, c.residency, need)
        got = self._inside_masks.get(key)
        if got is None:
            own, allowed = self._regions(gpu, m, arr, ask, c)
            got = self._inside_masks[key] = own & allowed & fits
        return got

    def _sized(self, gpu: str, m: Market, arr: _Arrays, need: int, h: float) -> _Sized:
        """Per offer of `arr`, for `need` GPUs: the instances, whether its free capacity,
        quota and spot discount allow them, their expected cost and price per hour, and
        the option once made; shared by the batch's requests for as many GPUs."""
        got = self._sizes.get((gpu, m, need, h))
        if got is None:
            inst = -(-need // arr.gpus)
            paid = inst * arr.gpus
            fits = (arr.free >= inst) & (arr.quota >= paid) & arr.disc_ok
            eff, gang = arr.eff(h, self.policy, self.hazard(h))
            cost = paid * (eff + (inst - 1) * gang)
            idle = self.policy.scoring.idle_gpu_weight
            if idle:
                cost = cost + idle * (paid - need) * arr.ppg
            got = self._sizes[(gpu, m, need, h)] = (inst, fits, cost, paid * arr.ppg,
                                                 [None] * len(arr.offers))
        return got

    def _scan(self, ask: Ask, c: Constraints) -> _Scan:
        """What the candidates of a request that has none say about why (large batches)."""
        import numpy as np

        scan = _Scan()
        for gpu in c.gpus:
            for m in c.markets:
                arr = self._arrays(gpu, m)
                if not arr.offers:
                    continue
                own, allowed = self._regions(gpu, m, arr, ask, c)
                matching = own & allowed
                scan.policy_excluded += int(np.count_nonzero(own & ~allowed))
                scan.matching += int(np.count_nonzero(matching))
                if matching.any():
                    scan.cheapest_ppg = min(scan.cheapest_ppg, float(arr.ppg[matching].min()))
                under = matching if c.cap is None else matching & (arr.ppg <= c.cap)
                scan.under_cap += int(np.count_nonzero(under))
        return scan

    def live_room(self) -> Any:
        """`room` while the solver's resources only shrink (its greedy phase, when the
        problem has `live` resources): what it found used up stays used up. None
        otherwise. Each greedy phase (its own `live`) starts from a clean `room`."""
        live = self.problem.live if self.problem is not None else None
        if live is None or self.room is None:
            return None
        if live is not self._room_of:
            self.room[:] = math.inf
            self._room_of = live
        return self.room

    def used_up(self, slot: int, o: solver.Option) -> None:
        """Record, while resources only shrink, that the offer in `room` slot `slot` has
        room for fewer instances than `o` takes: how many its pool and quota have left."""
        assert self.problem is not None and self.problem.live is not None
        live, limits = self.problem.live, self.limits
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

    def _plain(self, gpu: str, m: Market) -> Iterator[tuple[float, Offer, float, int | None]]:
        view, stale, cooling = self.view, self.stale, self.cooling
        for offer in view.by_gpu(gpu, m):
            key = offer.pool
            if (cooling and key in cooling) or (stale and view.slice_of(key) in stale):
                continue
            ppg = offer.price_per_hour / offer.gpus  # type: ignore[operator]
            yield ppg, offer, ppg, None  # free instances: computed where needed

    def _by_cost(self, gpu: str, m: Market, h: float
                 ) -> Iterator[tuple[float, Offer, float, int | None]]:
        """`_plain` in order of `unit_cost` (from the `CostIndex`), which is the bound."""
        assert self.costs is not None
        view, stale, cooling = self.view, self.stale, self.cooling
        for u, key, offer in self.costs.sorted(gpu, m, h):
            if (cooling and key in cooling) or (stale and view.slice_of(key) in stale):
                continue
            yield u, offer, offer.price_per_hour / offer.gpus, None  # type: ignore[operator]

    # Complex: hot path (bench/placement.py); split in the package redesign (#28).
    def _walk(self, ask: Ask, c: Constraints, k: int | None, limit: float | None,  # noqa: C901, PLR0912, PLR0915
              alive: solver.Alive | None = None, *, h: float
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
        hazard = self.hazard(h)
        scan = _Scan()
        keep = k if limit is None else None
        heap: list[tuple[float, int, solver.Option]] = []
        found: list[solver.Option] = []
        tiebreak = 0
        cut = False
        # In order of price when there is a price cap (the walk ends at the cap), else in
        # order of cost when the index is there (it ends once no option can make the list).
        by_price = self.costs is None or cap is not None or not self.costs.covers(h)
        for gpu in c.gpus:
            for m in c.markets:
                for mult, entries in ((need, self._plain(gpu, m) if by_price
                                       else self._by_cost(gpu, m, h)),):
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
                            if by_price:
                                break  # sorted by price per GPU-hour: the rest are dearer
                            continue
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
                        cost = expected_cost(offer, instances, policy, hazard=hazard)
                        if idle:
                            cost += idle * (instances * offer.gpus - need) * ppg
                        if keep is not None and len(heap) == keep and cost >= -heap[0][0]:
                            continue
                        o = self._option(offer, instances, need, h)
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
        self._eff: dict[float, Any] = {}

    @classmethod
    def of(cls, entries: Iterable[tuple[float, Offer, float, int | None]], policy: Policy,
           view: PoolView) -> _Arrays:
        import numpy as np

        a = cls()
        codes: dict[tuple[str, str], int] = {}
        ppg, gpus, free, quota, region, disc = [], [], [], [], [], []
        min_discount = policy.scoring.spot_min_discount
        for p, offer, _, _ in entries:
            key = offer.pool
            f = None if offer.capacity is None else offer.capacity - view.held(key)
            a.offers.append(offer)
            ppg.append(p)
            gpus.append(offer.gpus)
            free.append(math.inf if f is None else f)
            q = offer.quota_headroom
            quota.append(math.inf if q is None else q)
            region.append(codes.setdefault((key.cloud, key.region), len(codes)))
            disc.append(not min_discount or spot_discount_ok(offer, view, min_discount))
        a.regions = list(codes)
        a.gpus = np.array(gpus, dtype=np.int64)
        a.ppg = np.array(ppg, dtype=float)
        a.free, a.quota = np.array(free, dtype=float), np.array(quota, dtype=float)
        a.region = np.array(region, dtype=np.int64)
        a.disc_ok = np.array(disc, dtype=bool)
        return a

    def eff(self, h: float, policy: Policy, hazard: Hazard | None) -> tuple[Any, Any]:
        """Per offer, spot risk over `h` hours (made on first use per horizon): the
        expected cost per GPU-hour of one instance (`unit_cost`), and what each further
        instance of a gang adds to it per GPU-hour (the interruption terms, which grow
        with the instances: `expected_cost`), so that n instances cost
        n × GPUs × (eff + (n − 1) × gang). Both from the one cost formula."""
        got = self._eff.get(h)
        if got is None:
            import numpy as np

            n = len(self.offers)
            eff, gang = np.empty(n, dtype=float), np.zeros(n, dtype=float)
            spot = Market.SPOT
            for i, o in enumerate(self.offers):
                one = expected_cost(o, 1, policy, hazard=hazard)
                eff[i] = one / o.gpus
                if o.pool.market is spot:  # only spot risk grows with the gang
                    gang[i] = max(0.0, (expected_cost(o, 2, policy, hazard=hazard) / 2 - one)
                                  / o.gpus)
            got = self._eff[h] = (eff, gang)
        return got

    ppg: Any
    gpus: Any
    free: Any
    quota: Any
    region: Any
    disc_ok: Any
    base: int = 0  # where its offers start in the builder's `room`


class _Ranked:
    """A group's candidates, each offer `row` of `arrays[part]` with `inst` instances at
    expected `cost` and `price` per hour (`slot`: the offer's place in the builder's
    `room`), in `order` of cost: the cheapest few are sorted up front (most groups read
    no further), the rest once a read gets to them."""

    # Many arguments: the groups' parallel arrays, built together by the caller.
    def __init__(self, arrays: list[_Arrays], made: list[list[solver.Option | None]],  # noqa: PLR0913
                 parts: list[Any], rows: list[Any], insts: list[Any], costs: list[Any],
                 prices: list[Any], slots: list[Any], head: int) -> None:
        import numpy as np

        def join(xs: list[Any], dtype: Any) -> Any:
            if len(xs) == 1:
                return xs[0]
            return np.concatenate(xs) if xs else np.zeros(0, dtype=dtype)

        self.arrays = arrays
        self.made = made  # per part, its offers' options for the request's GPUs, once made
        self.part, self.row = join(parts, np.int64), join(rows, np.int64)
        self.inst, self.cost = join(insts, np.int64), join(costs, float)
        self.price, self.slot = join(prices, float), join(slots, np.int64)
        n = len(self.cost)
        head = min(n, head)
        first = np.argpartition(self.cost, head - 1)[:head] if head < n else np.arange(n)
        self.order = first[np.argsort(self.cost[first], kind="stable")]
        # The rest, once a read gets to it; till then its lowest price is at least the
        # lowest of all.
        self._first: Any = first if head < n else None
        self._rest: Any = None
        self._rest_price = float(self.price.min()) if head < n else math.inf

    def read(self, start: int, size: int) -> Any:
        """Candidates from `start` on in the order, at most `size`: those sorted already,
        or when there are none, the next part of the rest, at least `size` and as many
        as are sorted (a group that keeps running out reads ever more at a time)."""
        import numpy as np

        if self._first is not None:
            if start < len(self.order):
                return self.order[start:start + size]
            rest = np.ones(len(self.cost), dtype=bool)
            rest[self._first] = False
            self._first, self._rest = None, np.flatnonzero(rest)
        if self._rest is not None and start >= len(self.order):
            self._sort_more(max(size, len(self.order)))
        return self.order[start:start + size]

    def _sort_more(self, m: int) -> None:
        """Move the cheapest `m` of the rest, and any that tie with the last of them, to
        the end of the order, sorted (so the order is the same as sorting the whole
        rest at once)."""
        import numpy as np

        rest = self._rest
        cost = self.cost[rest]
        nxt, left = rest, None
        if m < len(rest):
            take = cost <= np.partition(cost, m - 1)[m - 1]
            if not take.all():
                nxt, left = rest[take], rest[~take]
        self.order = np.concatenate([self.order, nxt[np.argsort(self.cost[nxt], kind="stable")]])
        self._rest = left
        self._rest_price = math.inf if left is None else float(self.price[left].min())

    def price_floor(self, start: int) -> float:
        """No candidate from `start` on in the order has a lower price per hour (less a
        rounding margin: prices here are per GPU-hour times GPUs)."""
        low = float(self.price[self.order[start:]].min()) if start < len(self.order) \
            else math.inf
        return min(low, self._rest_price) * (1 - 1e-9)


class _Source:
    """A group's options, made lazily from its `_Ranked` candidates, cheapest first
    (`upto`: the cost of the next one unread).

    While the heuristic places, resources only shrink: an option it finds used up
    records in the builder's `room` how many instances its offer still has room for,
    and every group then skips, a chunk at a time, the candidates that need more,
    without making their options. Options dropped as used up are read again, from
    the start, when the LP asks for everything under a bound."""

    CHUNK = 256

    def __init__(self, builder: _Builder, ranked: _Ranked, need: int,
                 exclude: frozenset[PoolKey], h: float) -> None:
        self.builder = builder
        self.h = h
        self.ranked = ranked
        self.need = need
        self.exclude = exclude
        self.at = 0  # the candidates before it in order are read
        self.dropped = False
        self.group: solver.Group | None = None

    def more(self, k: int | None, below: float | None, alive: solver.Alive | None
             ) -> tuple[list[solver.Option], float]:
        import numpy as np

        g = self.group
        out: list[solver.Option] = []
        if alive is None and self.dropped:
            self.at, self.dropped = 0, False
        elif g is not None:
            out = list(g.options)
        builder, ranked, need, exclude = self.builder, self.ranked, self.need, self.exclude
        room = builder.live_room() if alive is not None else None
        added = 0
        while k is None or added < k:
            chunk = ranked.read(self.at, self.CHUNK)
            if not len(chunk):
                break
            cost = ranked.cost[chunk]
            end = len(chunk) if below is None else \
                int(np.searchsorted(cost, below, side="right"))
            pick = np.arange(end)
            if room is not None:
                short = room[ranked.slot[chunk[:end]]] < ranked.inst[chunk[:end]] - 1e-6
                if short.any():
                    pick = np.flatnonzero(~short)
                    self.dropped = True
            sel = chunk[pick]
            for n, p, row, inst, slot in zip(
                    pick.tolist(), ranked.part[sel].tolist(), ranked.row[sel].tolist(),
                    ranked.inst[sel].tolist(), ranked.slot[sel].tolist(), strict=True):
                if k is not None and added >= k:
                    end = n
                    break
                o = ranked.made[p][row]
                if o is None:
                    o = ranked.made[p][row] = builder._option(ranked.arrays[p].offers[row],
                                                              inst, need, self.h)
                if exclude and o.ref[0].pool in exclude:
                    continue
                if alive is None or alive(o):
                    out.append(o)
                    added += 1
                else:
                    self.dropped = True
                    if room is not None:
                        builder.used_up(slot, o)
            self.at += end
            if end < len(chunk):
                break
        if g is not None:
            g.unlisted_price = ranked.price_floor(self.at)
        nxt = ranked.read(self.at, 1)
        return out, (float(ranked.cost[nxt[0]]) if len(nxt) else math.inf)


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
    if what == "team_owned":
        return Rejection(ask, RejectCode.OVER_BUDGET,
                         f"{team} has {key:g} GPUs of its private_share of paid-for capacity "
                         f"left after this batch's other placements; no placement of "
                         f"{req.gpus} GPUs fits", retry_after)
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


# Complex: split in the package redesign (#28).
def explain(ask: Ask, view: PoolView, policy: Policy, *, now: datetime, top: int = 5,  # noqa: C901
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
    hazard = hazard_for(view, policy, req)
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
            terms = cost_terms(offer, policy, share, hazard, instances)
            candidates.append((expected_cost(offer, instances, policy, share, hazard), offer,
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
        **_scored_with(o, policy, hazard),
    } for cost, o, n, terms in candidates[:top]]
    return out


def _scored_with(offer: Offer, policy: Policy, hazard: Hazard | None
                 ) -> dict[str, Any]:
    """The signals a candidate was scored with, when they are the hazard estimator's."""
    rate, avail = signals(offer, policy, hazard)
    if (rate, avail) == (offer.interruption_rate, offer.availability):
        return {}
    return {"expected_over_job": {"availability": avail, "interruption_rate": rate}}
