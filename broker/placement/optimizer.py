"""The placement optimizer: a pure function from (requests, pool, policy) to decisions.

A batch of requests is placed together (`solve`): `CandidateBuilder` lists each request's
options — fresh offers of an acceptable GPU model (with the policy's equivalents),
market, cloud, region and residency, under the price cap, not in a cool-down, with free
capacity and quota for it alone — cheapest expected cost per hour first:

    instances × price × (1 + restart_hours × interruption_rate
                           + availability_weight × (1 − availability)
                           + spread_weight × share of the team's GPUs in that zone)
    + idle_gpu_weight × price of the GPUs paid for but not asked for
    + GPUs × interruption_cost_per_gpu × instances × interruption_rate

(interruption risk counts for spot only, over the request's own duration when the pools'
history is kept: `broker.market.hazard`; the risk weights — restart_hours,
availability_weight, interruption_cost_per_gpu — are those of the request's risk level,
`Constraints.risk`, through `Policy.for_risk`; unknown signals take the policy's
`unknown_*` values; a spot pool not `scoring.spot_min_discount` under on-demand for the
same type and zone is skipped). Requests asking for the same thing share one list, read further
only when its options run out. `broker.placement.solver` then assigns the batch within every
pool's free capacity, quota group, team `max_gpus`, `budget_per_hour` and spread limit;
a request it leaves unplaced is rejected with the constraint that binds.

Small batches walk the pool's price index per request; large ones (`index_min_batch`)
rank each GPU model's offers as numpy arrays once per batch, and while the solver
places, an offer one list finds used up is skipped by every other list as it grows.

No I/O here: the pool is read through the small `PoolView` protocol.

The parts: what an offer must pass, once (`broker.placement.rules`); the cost, once
(`broker.placement.cost`); the pool as read (`broker.placement.view`); the candidates
(`broker.placement.candidates`, `walk`, `arrays`); the solver (`broker.placement.solver`);
decisions and rejections (`broker.placement.outcomes`); `explain`
(`broker.placement.explain`). This module places a batch and gathers their public names.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from broker.model import Placement
from broker.placement import solver
from broker.placement.arrays import Source as _Source
from broker.placement.candidates import (
    ALTERNATIVES,
    PENALTY,
    PENALTY_FLOOR_PER_GPU_HOUR,
    CandidateBuilder,
)
from broker.placement.cost import (
    by_horizon,
    cost_terms,
    expected_cost,
    hazard_over,
    option_cost,
    signals,
    unit_cost,
)
from broker.placement.explain import explain
from broker.placement.outcomes import (
    Ask,
    Decision,
    Outcome,
    Rejection,
    constraints_for,
    reason,
    reject,
    unplaced,
)
from broker.placement.problem import AssignmentProblem, Option, Request
from broker.placement.residual import State, why_unplaced
from broker.placement.rules import spot_discount_ok
from broker.placement.view import CostIndex, Costs, FrozenCosts, PoolView, Snapshot, hazard_for
from policies.evaluate import Constraints, Denied
from policies.model import Policy
from policies.residency import Residency

__all__ = [
    "ALTERNATIVES", "PENALTY", "PENALTY_FLOOR_PER_GPU_HOUR", "SPLIT_MIN_SAVING", "Ask",
    "BatchResult", "BatchSettings", "CandidateBuilder", "CostIndex", "Costs", "Decision",
    "FrozenCosts", "Outcome", "PoolView", "Rejection", "Snapshot",
    "_Source", "by_horizon", "constraints_for", "cost_terms", "expected_cost", "explain",
    "hazard_for", "hazard_over", "option_cost", "place", "signals", "solve",
    "spot_discount_ok", "unit_cost",
]

SPLIT_MIN_SAVING = 0.05
"""A request that one pool can take is split across pools only when that saves at least
this share of its expected cost: each part is a lease the scheduler launches and renews."""


@dataclass(frozen=True, slots=True)
class BatchSettings:
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
          settings: BatchSettings = BatchSettings()) -> list[Outcome]:
    """Place a batch of asks together (see `solve`); one outcome per ask, in order."""
    return solve(asks, view, policy, now=now, retry_after_seconds=retry_after_seconds,
                 settings=settings).outcomes


def solve(asks: Sequence[Ask], view: PoolView, policy: Policy, *, now: datetime,
          retry_after_seconds: float | None = None,
          settings: BatchSettings = BatchSettings(), costs: Costs | None = None,
          stop: solver.Stop | None = None) -> BatchResult:
    """Place a batch of asks together: at most one pool each, within every pool's free
    capacity (its estimate minus what the broker holds), each quota's headroom, each
    team's `max_gpus`, `budget_per_hour` and spread limits, at the lowest total
    expected cost; as many as possible first. Requests that nothing could take are
    rejected with the constraint that binds. The MILP, if the batch goes to it, stops
    with the best answer so far once `stop()` is true (`milp.Stop`)."""
    # A large batch makes many small objects, in no reference cycles: the collector's
    # full passes over the whole heap (the pool's offers among it), which they set
    # off, would cost more than the batch itself. It resumes when the batch is done.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _solve(asks, view, policy, now=now, retry_after_seconds=retry_after_seconds,
                      settings=settings,
                      costs=costs if costs is not None and costs.policy is policy else None,
                      stop=stop)
    finally:
        if was_enabled:
            gc.enable()


def _solve(asks: Sequence[Ask], view: PoolView, policy: Policy, *, now: datetime,
           retry_after_seconds: float | None, settings: BatchSettings,
           costs: Costs | None = None, stop: solver.Stop | None = None) -> BatchResult:
    deadline = time.perf_counter() + settings.budget_seconds
    # A request alone is placed on the first option, in order of cost, that every
    # constraint admits, listing more when those run out (`heuristic`): up front it needs
    # only that one and the alternatives its decision names. A batch's requests need
    # more, to give way to one another; and so does one that may be split, whose parts
    # read what is left of a quota group as its options listed so far raised it
    # (`CandidateBuilder.option`).
    alone = len(asks) == 1 and asks[0].request.max_parts <= 1
    k = min(settings.candidates, ALTERNATIVES + 1) if alone else settings.candidates
    builder = CandidateBuilder(view, policy, now, k,
                       indexed=len(asks) >= settings.index_min_batch, costs=costs)
    try:
        return _decide(builder, asks, policy, deadline=deadline,
                       retry_after_seconds=retry_after_seconds, settings=settings, stop=stop)
    finally:
        builder.release()


def _decide(builder: CandidateBuilder, asks: Sequence[Ask], policy: Policy, *,
            deadline: float, retry_after_seconds: float | None,
            settings: BatchSettings, stop: solver.Stop | None = None) -> BatchResult:
    resident = Residency(policy.residency.tags)
    outcomes: list[Outcome | None] = [None] * len(asks)
    index: list[int] = []  # request of the problem -> ask
    requests: list[Request] = []
    verdicts: list[Constraints] = []  # request of the problem -> its verdict
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
            outcomes[k] = reject(ask, c, scan, retry_after_seconds)
            continue
        index.append(k)
        requests.append(req)
        verdicts.append(c)
    if not requests:
        if splits:
            _split(builder, AssignmentProblem([], builder.limits, builder.teams), [], asks,
                   splits, outcomes)
        return BatchResult([o for o in outcomes if o is not None], "none", 0.0, 0.0, True,
                           0.0)
    problem = AssignmentProblem(requests, builder.limits, builder.teams)
    # Through the solver module: the bench times `solver.heuristic` from outside.
    sol = solver.heuristic(problem, chains=len(problem.requests) <= settings.chain_max_batch,
                           deadline=deadline)
    left = min(settings.exact_time_limit, deadline - time.perf_counter())
    if not sol.optimal and len(requests) <= settings.exact_max_batch and left > 0:
        sol = solver.exact(problem, time_limit=left, incumbent=sol, stop=stop)
    note = (f"batch of {len(requests)} placed by {sol.solver}"
            + (", optimal" if sol.optimal else f", within {sol.gap:.2%} of optimal"))
    why = why_unplaced(problem, sol.choice) if None in sol.choice else {}
    # One Placement per option, however many decisions name it (as theirs or as an
    # alternative: at 10,000 requests, some 34,000 names of 12,000 options).
    placements: dict[int, Placement] = {}

    def placement_of(o: Option) -> Placement:
        got = placements.get(id(o))
        if got is None:
            got = placements[id(o)] = Placement.of(*o.ref)
        return got

    for n, k in enumerate(index):
        ask = asks[k]
        o = sol.choice[n]
        r = requests[n]
        if o is None:
            outcomes[k] = unplaced(ask, verdicts[n], why.get(n, ("penalty", None)),
                                    retry_after_seconds)
            continue
        offer = o.ref[0]
        placement = placement_of(o)
        cost = o.cost_per_hour + (r.extra(o) if r.extra is not None else 0.0)
        others = [x for x in r.options[:ALTERNATIVES + 1] if x is not o][:ALTERNATIVES]
        outcomes[k] = Decision(
            ask=ask, placement=placement, expected_cost_per_hour=cost,
            reason=reason(placement, offer, cost, ask.request.duration_hours,
                           builder.rule_of(n)) + (f"; {note}" if len(requests) > 1 else ""),
            alternatives=tuple(placement_of(x) for x in others))
    if splits:
        _split(builder, problem, sol.choice, asks, splits, outcomes)
    return BatchResult([o for o in outcomes if o is not None], sol.solver, sol.objective,
                       sol.bound, sol.optimal, sol.seconds)


def _split(builder: CandidateBuilder, problem: AssignmentProblem, choice: Sequence[Option | None],
           asks: Sequence[Ask], splits: Sequence[tuple[int, Constraints, int | None]],
           outcomes: list[Outcome | None]) -> None:
    """After the batch is solved: each request that may be split (`gang: false`,
    `max_parts` > 1) and that no one pool could take is split across pools in what the
    batch left free, if it fits; one that was placed whole is split instead when that
    saves `SPLIT_MIN_SAVING` of its expected cost. Greedy, in the batch's order: each
    part is the option of lowest expected cost per GPU it covers, and the last allowed
    part must cover the rest."""
    st = State(problem)
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
                outcomes[k] = Decision(ask, placement, o.cost_per_hour, reason(
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

