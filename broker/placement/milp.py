"""The exact solver: LP column generation for a lower bound, then the MILP (HiGHS, through
highspy) on every option that could improve on the heuristic's answer
(`broker.placement.solver` tells the whole story)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from broker.placement.heuristic import heuristic
from broker.placement.problem import EPS, AssignmentProblem, Group, Option, Solution
from broker.placement.residual import State, trivial_bound

PRICE_STEP = 64
"""Options a column-generation round lists at most per group (`_price_out`)."""

def preload() -> None:
    """Import what `exact` needs (HiGHS), so that the first batch to need the MILP does
    not wait for it. The daemon calls it, in a thread, at start."""
    import numpy  # noqa: F401

    _new_highs()


def _new_highs() -> Any:
    """A HiGHS instance that prints nothing, not even its banner: highspy's `Highs`
    prints one when made, so the extension's own class is used, as SciPy's HiGHS
    wrapper does (falling back to `Highs`, then silenced at once)."""
    try:
        from highspy._core import _Highs as Highs
    except ImportError:  # a highspy that moved its extension class
        from highspy import Highs
    h = Highs()
    h.setOptionValue("output_flag", False)
    return h


def _never() -> bool:
    return False


@dataclass(slots=True)
class _Result:
    """What HiGHS answered: `status` 0 optimal, 1 a limit struck, 2 infeasible, 4 other
    (SciPy's codes); `x` the columns' values when it has a feasible point."""

    status: int
    x: Any
    value: float | None
    row_dual: Any = None
    mip_dual_bound: float | None = None


Stop = Callable[[], bool]
"""Whether the exact solver should stop now and keep the best answer so far (the
daemon's: work is waiting for it); read between its LP rounds and by HiGHS while it
solves."""


def _stop_when(h: Any, stop: Stop) -> None:
    """Make HiGHS stop (status `kInterrupt`) at its next check once `stop()` is true:
    its interrupt callbacks, called every so often by the simplex, the interior point
    and the MIP search."""
    from highspy._core import cb

    def check(kind: Any, message: str, data_out: Any, data_in: Any, user_data: Any
              ) -> None:
        if data_in is not None and stop():
            data_in.user_interrupt = True

    h.setCallback(check, None)
    for kind in (cb.HighsCallbackType.kCallbackSimplexInterrupt,
                 cb.HighsCallbackType.kCallbackIpmInterrupt,
                 cb.HighsCallbackType.kCallbackMipInterrupt):
        h.startCallback(kind)


def _highs_solve(lp: _LP, *, integer: bool, time_limit: float, stop: Stop | None = None
                 ) -> _Result:
    """Solve `lp` (its relaxation unless `integer`) with HiGHS; an interrupt by `stop`
    is a limit struck, as the time limit is."""
    import highspy
    import numpy as np

    h = _new_highs()
    if time_limit < math.inf:
        h.setOptionValue("time_limit", max(0.001, float(time_limit)))
    if stop is not None:
        _stop_when(h, stop)
    inf = highspy.kHighsInf
    model = highspy.HighsLp()
    n, m = len(lp.c), len(lp.lb)
    model.num_col_, model.num_row_ = n, m
    model.col_cost_ = lp.c
    lo, hi = lp.col_bounds()
    model.col_lower_ = lo
    model.col_upper_ = np.where(np.isinf(hi), inf, hi)
    model.row_lower_ = np.where(np.isinf(lp.lb), -inf, lp.lb)
    model.row_upper_ = np.where(np.isinf(lp.ub), inf, lp.ub)
    a = model.a_matrix_
    a.format_ = highspy.MatrixFormat.kRowwise
    a.num_col_, a.num_row_ = n, m
    a.start_, a.index_, a.value_ = lp.indptr, lp.indices, lp.values
    if integer:
        kinds = [highspy.HighsVarType.kInteger] * (lp.n_x + lp.n_req) + \
            [highspy.HighsVarType.kContinuous] * (n - lp.n_x - lp.n_req)
        model.integrality_ = kinds
    h.passModel(model)
    h.run()
    status = h.getModelStatus()
    info = h.getInfo()
    S = highspy.HighsModelStatus
    code = (0 if status == S.kOptimal else
            1 if status in (S.kTimeLimit, S.kIterationLimit, S.kSolutionLimit,
                            S.kInterrupt) else
            2 if status == S.kInfeasible else 4)
    feasible = info.primal_solution_status == 2  # kSolutionStatusFeasible
    sol = h.getSolution() if feasible else None
    return _Result(
        code, np.array(sol.col_value) if sol is not None else None,
        float(info.objective_function_value) if feasible else None,
        np.array(sol.row_dual) if sol is not None and sol.dual_valid else None,
        float(info.mip_dual_bound) if integer else None)


def exact(p: AssignmentProblem, *, time_limit: float = 1.0, incumbent: Solution | None = None,
          max_rounds: int = 20, stop: Stop | None = None) -> Solution:
    """Optimal (or, when the time limit strikes or `stop()` turns true, the best found
    and a valid bound) by LP column generation and a MILP on every option that could
    still improve on `incumbent` (the heuristic's answer when not given)."""
    started = time.perf_counter()
    deadline = started + time_limit
    stopped: Stop = stop if stop is not None else _never
    inc = incumbent or heuristic(p)
    groups = list({id(r.group): r.group for r in p.requests}.values())
    for g in groups:
        g.unfilter()
    lp: _LP | None = None
    duals: _Duals | None = None
    grew = False
    rounds = 0
    while True:
        rounds += 1
        left = deadline - time.perf_counter()
        if left <= 0 or stopped():
            grew = True  # out of time: the relaxation is not proven, no bound from it
            break
        lp = _LP(p)
        duals = lp.solve_relaxation(time_limit=left, stop=stop)
        if duals is None:
            break  # the LP failed to solve (numerics): no bound beyond the trivial one
        grew, _ = _price_out(p, groups, duals, slack=0.0, step=PRICE_STEP)
        if not grew or rounds >= max_rounds or time.perf_counter() > deadline:
            break
    proven = lp is not None and lp.value is not None and duals is not None and not grew
    bound = max(lp.value or 0.0, 0.0) if proven and lp is not None else trivial_bound(p)
    bound = min(bound, inc.objective)
    if inc.objective <= bound + 1e-7 * max(1.0, bound):
        return Solution(inc.choice, inc.objective, bound, inc.solver,
                        time.perf_counter() - started, optimal=True,
                        detail={"lp_rounds": rounds})
    # Reduced-cost fixing: an option whose reduced cost exceeds the gap is in no
    # solution better than the incumbent; give the MILP all the others (or, when there
    # are more than PRICE_STEP more in a group, the cheapest: then its answer is the
    # best of those, not proven optimal).
    every = False
    if proven and duals is not None:
        every = not _price_out(p, groups, duals, slack=inc.objective - bound,
                               step=PRICE_STEP)[1]
    lp = _LP(p)
    remaining = deadline - time.perf_counter()
    halt = stopped()
    if remaining <= 0.01 or halt:
        return Solution(inc.choice, inc.objective, bound, inc.solver,
                        time.perf_counter() - started, detail={
                            "lp_rounds": rounds, "milp": "stopped" if halt else "no time left"})
    res = _highs_solve(lp, integer=True, time_limit=remaining, stop=stop)
    seconds = time.perf_counter() - started
    detail: dict[str, Any] = {"lp_rounds": rounds, "milp_status": int(res.status),
                              "columns": lp.n_x}
    if res.x is None:
        return Solution(inc.choice, inc.objective, bound, inc.solver, seconds,
                        detail=detail)
    choice = lp.choice(res.x)
    st = State(p)
    for i, o in enumerate(choice):
        if o is not None:
            st.take(i, o)
    objective = st.objective()
    mip_bound = res.mip_dual_bound
    if mip_bound is not None and math.isfinite(mip_bound):
        bound = max(bound, min(float(mip_bound), objective))
    optimal = res.status == 0 and every
    if objective >= inc.objective - EPS:
        return Solution(inc.choice, inc.objective, bound, inc.solver, seconds,
                        optimal=optimal, detail=detail)
    return Solution(choice, objective, bound, "milp", seconds, optimal=optimal,
                    detail=detail)


def _price_out(p: AssignmentProblem, groups: Sequence[Group], duals: _Duals, *,
               slack: float, step: int | None = None) -> tuple[bool, bool]:
    """List every left-out option whose reduced cost could be below `slack` (at most
    `step` more per group: the cheapest); returns whether any was added and whether
    `step` left some out. A left-out option costs at least its group's `upto` per hour,
    and only the team-total row can lower a reduced cost, by at most gpus × |its dual|.
    (With large duals, "could be below" can mean a GPU model's every offer: `step`
    keeps a small batch's column generation from listing thousands at once.)"""
    need: dict[int, float] = {}
    for i, r in enumerate(p.requests):
        g = r.group
        if g.complete or g.more is None or r.horizon <= 0:
            continue
        w = min(0.0, duals.team_total.get(r.team, 0.0)) if r.team is not None else 0.0
        gmax = 2 * (max((o.gpus for o in g.options), default=0) + 16)
        threshold = (duals.assign[i] - gmax * w + slack) / r.horizon
        if threshold >= g.upto - EPS:
            need[id(g)] = max(need.get(id(g), -math.inf), threshold)
    grew = short = False
    for g in groups:
        below = need.get(id(g))
        if below is None:
            continue
        if step is None:
            grew = g.grow(below=below + EPS) or grew
            continue
        grew = g.grow(k=len(g.options) + step) or grew
        short = short or (not g.complete and g.upto < below + EPS)
    return grew, short


@dataclass(slots=True)
class _Duals:
    assign: list[float]
    team_total: dict[str, float]


class _LP:
    """The MILP as HiGHS takes it (rows in compressed sparse row form). Variables: one
    per (request, option), one 'unplaced' per request, one 'batch GPUs' per team with a
    spread limit."""

    # Complex: one pass over every (request, option) writes all of its rows (assignment,
    # resources, the team's limits and spread); split, the passes would disagree on order.
    def __init__(self, p: AssignmentProblem) -> None:  # noqa: C901, PLR0915
        import numpy as np

        self.p = p
        self.zero: list[int] = []  # options that may not be taken
        self.index: list[tuple[int, Option]] = [(i, o) for i, r in enumerate(p.requests)
                                                for o in r.options]
        n_x = self.n_x = len(self.index)
        n_req = len(p.requests)
        spread_teams = [name for name, t in p.teams.items() if t.spreads]
        self.team_var = {name: n_x + n_req + k for k, name in enumerate(spread_teams)}
        n = n_x + n_req + len(spread_teams)
        c = np.zeros(n)
        rows: list[int] = []
        colix: list[int] = []
        vals: list[float] = []
        lb: list[float] = []
        ub: list[float] = []

        def row(lo: float, hi: float) -> int:
            lb.append(lo)
            ub.append(hi)
            return len(lb) - 1

        assign_rows = [row(1.0, 1.0) for _ in range(n_req)]
        res_rows: dict[Hashable, int] = {}
        team_rows: dict[tuple[str, str], int] = {}
        teams = p.teams
        for v, (i, o) in enumerate(self.index):
            r = p.requests[i]
            c[v] = r.cost(o)
            rows.append(assign_rows[i])
            colix.append(v)
            vals.append(1.0)
            for key, amount in o.uses:
                limit = p.limits.get(key)
                if limit is None:
                    continue
                k = res_rows.get(key)
                if k is None:
                    k = res_rows[key] = row(-math.inf, limit)
                rows.append(k)
                colix.append(v)
                vals.append(amount)
            t = teams.get(r.team) if r.team is not None else None
            if t is None:
                continue
            name = r.team or ""
            entries = [((name, what), left, amount)
                       for what, left, amount in t.rows(o.gpus, o.price, o.owned)]
            if t.spreads:
                entries.append(((name, "total"), 0.0, -o.gpus))
                # A zone or cloud the team already holds more than its share of takes
                # nothing more (as the heuristic sees it: no placement there fits).
                for what, hi in zip((f"zone:{o.cloud}:{o.zone}", f"cloud:{o.cloud}"),
                                    t.spread_room(o.cloud, o.zone), strict=True):
                    if hi is None:
                        continue
                    if hi < -EPS:
                        self.zero.append(v)
                    entries.append(((name, what), max(hi, 0.0), o.gpus))
            for key2, hi, amount in entries:
                k = team_rows.get(key2)
                if k is None:
                    k = team_rows[key2] = row(0.0, 0.0) if key2[1] == "total" \
                        else row(-math.inf, hi)
                rows.append(k)
                colix.append(v)
                vals.append(amount)
        for i, r in enumerate(p.requests):
            v = n_x + i
            c[v] = r.penalty
            rows.append(assign_rows[i])
            colix.append(v)
            vals.append(1.0)
        for (team, what), k in team_rows.items():
            tv = self.team_var.get(team)
            if tv is None:
                continue
            t = teams[team]
            share = (1.0 if what == "total" else
                     t.zone_share if what.startswith("zone:") else
                     t.cloud_share if what.startswith("cloud:") else None)
            if share is None:
                continue
            rows.append(k)
            colix.append(tv)
            vals.append(1.0 if what == "total" else -share)
        self.c = c
        self.lb = np.array(lb)
        self.ub = np.array(ub)
        # Compressed sparse rows: the entries by row (a stable sort keeps each row's in
        # the order written), where each row starts, and their columns.
        row_of = np.array(rows, dtype=np.int64)
        order = np.argsort(row_of, kind="stable")
        self.indices = np.array(colix, dtype=np.int32)[order]
        self.values = np.array(vals, dtype=np.float64)[order]
        self.indptr = np.zeros(len(lb) + 1, dtype=np.int32)
        np.cumsum(np.bincount(row_of, minlength=len(lb)), out=self.indptr[1:])
        self.n_req = n_req
        self.assign_rows = assign_rows
        self.team_total_rows = {team: k for (team, what), k in team_rows.items()
                                if what == "total"}
        self.value: float | None = None

    def col_bounds(self) -> tuple[Any, Any]:
        """Every column's lower and upper bound: 0..1, a team's batch GPUs 0..inf, an
        option that may not be taken 0..0."""
        import numpy as np

        hi = np.ones(len(self.c))
        for tv in self.team_var.values():
            hi[tv] = np.inf
        hi[self.zero] = 0.0
        return np.zeros(len(self.c)), hi

    def solve_relaxation(self, time_limit: float = math.inf, stop: Stop | None = None
                         ) -> _Duals | None:
        """The LP relaxation: its value (kept in `value`) and its rows' duals (the
        objective's derivative by each row's bound), None if it was not solved (a limit
        struck, or `stop`)."""
        res = _highs_solve(self, integer=False, time_limit=time_limit, stop=stop)
        if res.status != 0 or res.value is None or res.row_dual is None:
            return None
        self.value = res.value
        dual = res.row_dual
        assign = [float(dual[r]) for r in self.assign_rows]
        team_total = {team: float(dual[k]) for team, k in self.team_total_rows.items()}
        return _Duals(assign, team_total)

    def choice(self, x: Any) -> list[Option | None]:
        out: list[Option | None] = [None] * self.n_req
        for v, (i, o) in enumerate(self.index):
            if x[v] > 0.5:
                out[i] = o
        return out
