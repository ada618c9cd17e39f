"""Tests of the assignment solvers (`broker/placement/solver.py`) against brute force.

Small problems are solved by enumerating every assignment (each request: one of its
options, or unplaced), checking every constraint written out here independently of the
solver, and taking the cheapest. `exact` must find that optimum and say so; `heuristic`
must stay feasible and can only be as good or worse — except on the cases it is built
for (regret ordering), where it must find the optimum too.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from broker.placement import solver
from broker.placement.solver import AssignmentProblem, Group, Option, Request, Solution, TeamRoom

TOL = 1e-6

# Hypothesis's pytest plugin imports this module (and through it libcst, which warns of a
# deprecation) only when a test fails; under `filterwarnings = error` that turns a
# readable failure into an INTERNALERROR. Import it now, quietly.
with contextlib.suppress(ImportError), warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import hypothesis.extra._patching  # noqa: F401


def opt(cost: float, *uses: tuple[Hashable, float], gpus: int = 8, price: float | None = None,
        cloud: str = "aws", zone: str = "a") -> Option:
    """An option costing `cost` per hour (its price too, unless given)."""
    return Option(cost, tuple(uses), gpus, cost if price is None else price, cloud, zone)


def req(*options: Option, team: str | None = None, horizon: float = 1.0,
        penalty: float | None = None) -> Request:
    """A request with every option listed, cheapest first as `Group` wants them; unless
    given, a penalty above any of its options (ten times the dearest)."""
    opts = sorted(options, key=lambda o: o.cost_per_hour)
    if penalty is None:
        penalty = 10 * horizon * max((o.cost_per_hour for o in opts), default=1.0)
    return Request(Group(opts), horizon, penalty, team)


def short_group(full: list[Option], listed: int) -> Group:
    """A group listing only the cheapest `listed` of `full` (sorted); `more` lists the
    rest as `broker.placement.optimizer` does: the cheapest k alive, or all under a cost."""

    def more(k: int | None, below: float | None, alive: Callable[[Option], bool] | None = None
             ) -> tuple[list[Option], float]:
        pool = [o for o in full if alive is None or alive(o)]
        got = pool[:k] if k is not None else [o for o in pool if o.cost_per_hour < (below or 0)]
        return got, (pool[len(got)].cost_per_hour if len(got) < len(pool) else math.inf)

    return Group(full[:listed], full[listed].cost_per_hour if listed < len(full) else math.inf,
                 more)


# --- brute force -----------------------------------------------------------------------


# Complex: one check per constraint, written out from the problem's definition.
def violations(p: AssignmentProblem, choice: Sequence[Option | None]) -> list[str]:  # noqa: C901, PLR0912
    """Every constraint the assignment breaks, from the problem's definition."""
    out: list[str] = []
    assert len(choice) == len(p.requests)
    used: dict[Hashable, float] = defaultdict(float)
    gpus: dict[str, int] = defaultdict(int)
    price: dict[str, float] = defaultdict(float)
    by_zone: dict[str, dict[tuple[str, str], int]] = defaultdict(lambda: defaultdict(int))
    by_cloud: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r, o in zip(p.requests, choice, strict=True):
        if o is None:
            continue
        if o not in r.options:
            out.append(f"{o} is not an option of its request")
        for k, amount in o.uses:
            used[k] += amount
        if r.team is not None and r.team in p.teams:
            gpus[r.team] += o.gpus
            price[r.team] += o.price
            by_zone[r.team][(o.cloud, o.zone)] += o.gpus
            by_cloud[r.team][o.cloud] += o.gpus
    for k, amount in used.items():
        if k in p.limits and amount > p.limits[k] + TOL:
            out.append(f"resource {k!r}: {amount} > {p.limits[k]}")
    for name, t in p.teams.items():
        if t.gpus_left is not None and gpus[name] > t.gpus_left + TOL:
            out.append(f"team {name} gpus {gpus[name]} > {t.gpus_left}")
        if t.budget_left is not None and price[name] > t.budget_left + TOL:
            out.append(f"team {name} budget {price[name]} > {t.budget_left}")
        total = t.total + gpus[name]
        # The spread limit holds where the batch puts GPUs ("counting what a placement
        # would add"), as a share of the team's GPUs after the batch, with the grace.
        if t.zone_share is not None:
            for z, n in by_zone[name].items():
                if t.by_zone.get(z, 0) + n > t.zone_share * total + t.grace + TOL:
                    out.append(f"team {name} zone {z} over its share")
        if t.cloud_share is not None:
            for c, n in by_cloud[name].items():
                if t.by_cloud.get(c, 0) + n > t.cloud_share * total + t.grace + TOL:
                    out.append(f"team {name} cloud {c} over its share")
    return out


def objective(p: AssignmentProblem, choice: Sequence[Option | None]) -> float:
    return sum(r.penalty if o is None else r.cost(o)
               for r, o in zip(p.requests, choice, strict=True))


def brute_force(p: AssignmentProblem) -> tuple[float, list[Option | None]]:
    """The optimum by enumeration. Resources, team GPUs and budget only grow as
    requests are placed, so a branch that passes one is cut at once; the spread limit
    (a share of the total after the batch) is checked on full assignments."""
    n = len(p.requests)
    best: tuple[float, list[Option | None]] = (math.inf, [])
    choice: list[Option | None] = [None] * n
    used: dict[Hashable, float] = defaultdict(float)
    gpus: dict[str, float] = defaultdict(float)
    price: dict[str, float] = defaultdict(float)
    spreads = any(t.spreads for t in p.teams.values())

    def fits(r: Request, o: Option) -> bool:
        for k, amount in o.uses:
            if k in p.limits and used[k] + amount > p.limits[k] + TOL:
                return False
        t = p.teams.get(r.team) if r.team is not None else None
        if t is None:
            return True
        assert r.team is not None
        return not ((t.gpus_left is not None and gpus[r.team] + o.gpus > t.gpus_left + TOL)
                    or (t.budget_left is not None
                        and price[r.team] + o.price > t.budget_left + TOL))

    def take(r: Request, o: Option, sign: int) -> None:
        for k, amount in o.uses:
            used[k] += sign * amount
        if r.team is not None:
            gpus[r.team] += sign * o.gpus
            price[r.team] += sign * o.price

    def walk(i: int, cost: float) -> None:
        nonlocal best
        if cost >= best[0] - TOL:
            return
        if i == n:
            if not spreads or not violations(p, choice):
                best = (cost, list(choice))
            return
        r = p.requests[i]
        for o in r.options:
            if fits(r, o):
                take(r, o, 1)
                choice[i] = o
                walk(i + 1, cost + r.cost(o))
                take(r, o, -1)
        choice[i] = None
        walk(i + 1, cost + r.penalty)

    walk(0, 0.0)
    assert not violations(p, best[1])
    return best


def check_solution(p: AssignmentProblem, sol: Solution, *, bound: bool = True) -> None:
    assert violations(p, sol.choice) == []
    assert sol.objective == pytest.approx(objective(p, sol.choice), abs=TOL)
    if bound:
        assert sol.bound <= sol.objective + TOL


# --- the cases greedy gets wrong --------------------------------------------------------


def regret_problem() -> AssignmentProblem:
    """Two requests want pool A (one instance left). r0, first in line, has a cheap
    second choice B; r1's second choice C is dear. One at a time in arrival order gives
    A to r0 and C to r1 (10 + 30); the optimum gives A to r1 and B to r0 (11 + 10)."""
    return AssignmentProblem(
        [req(opt(10, ("A", 1)), opt(11, ("B", 1))),
         req(opt(10, ("A", 1)), opt(30, ("C", 1)))],
        limits={"A": 1, "B": 1, "C": 1})


def test_regret_ordering_finds_the_optimum_greedy_in_arrival_order_misses() -> None:
    p = regret_problem()
    want, _ = brute_force(p)
    assert want == pytest.approx(21)
    h = solver.heuristic(p)
    check_solution(p, h)
    assert h.objective == pytest.approx(21)
    assert [o.uses[0][0] if o else None for o in h.choice] == ["B", "A"]
    e = solver.exact(p)
    assert e.objective == pytest.approx(21)
    assert e.optimal
    assert e.bound == pytest.approx(21)


def test_heuristic_reports_optimal_only_when_it_meets_the_trivial_bound() -> None:
    # No contention: everyone gets the cheapest option, proven by the bound.
    p = AssignmentProblem([req(opt(10, ("A", 1))), req(opt(12, ("B", 1)))], limits={"A": 1, "B": 1})
    h = solver.heuristic(p)
    assert h.optimal and h.objective == pytest.approx(22) and h.bound == pytest.approx(22)
    assert h.gap == 0.0
    # Contention: optimal in fact, but nothing proves it without the LP.
    h = solver.heuristic(regret_problem())
    assert not h.optimal
    assert h.bound == pytest.approx(20)  # each request at its cheapest
    assert h.gap == pytest.approx(21 / 20 - 1)


def test_a_request_with_nowhere_else_to_go_gets_the_contested_pool() -> None:
    # r0 arrives first and A is its cheapest, but r1's only option is A: leaving r1 out
    # costs its penalty (1000), far more than r0's move to B (+2).
    p = AssignmentProblem([req(opt(10, ("A", 1)), opt(12, ("B", 1))),
                 req(opt(50, ("A", 1)), penalty=1000)], limits={"A": 1, "B": 1})
    want, _ = brute_force(p)
    for sol in (solver.heuristic(p), solver.exact(p)):
        check_solution(p, sol)
        assert sol.objective == pytest.approx(want) == 62
        assert sol.choice[1] is not None


def test_spread_shares_are_of_the_teams_gpus_after_the_batch() -> None:
    # No grace: one placement alone is 100 % of the team in its zone, so a request can
    # only go in if another goes elsewhere in the same batch. Two requests in two zones
    # hold half each. One at a time can never start; the MILP places both.
    team = TeamRoom(zone_share=0.5, grace=0)
    p = AssignmentProblem([req(opt(10, zone="a", gpus=4), opt(11, zone="b", gpus=4), team="t"),
                 req(opt(10, zone="a", gpus=4), opt(11, zone="b", gpus=4), team="t")],
                limits={}, teams={"t": team})
    want, choice = brute_force(p)
    assert want == pytest.approx(21)
    assert sorted(o.zone for o in choice if o) == ["a", "b"]
    h = solver.heuristic(p)
    check_solution(p, h)
    e = solver.exact(p, incumbent=h)
    check_solution(p, e)
    assert e.objective == pytest.approx(21) and e.optimal
    assert e.solver == "milp"


def test_spread_grace_lets_a_small_team_sit_in_one_zone() -> None:
    team = TeamRoom(zone_share=0.5, grace=8, total=0)
    p = AssignmentProblem([req(opt(10, zone="a", gpus=4), opt(15, zone="b", gpus=4), team="t"),
                 req(opt(10, zone="a", gpus=4), opt(15, zone="b", gpus=4), team="t"),
                 req(opt(10, zone="a", gpus=4), opt(15, zone="b", gpus=4), team="t")],
                limits={}, teams={"t": team})
    # 12 GPUs after the batch: a zone may hold 0.5 × 12 + 8 = 14, so all three fit in a.
    for sol in (solver.heuristic(p), solver.exact(p)):
        check_solution(p, sol)
        assert [o.zone for o in sol.choice if o] == ["a", "a", "a"]
    # The team already holds 16 in a: 16 + 4k ≤ 0.5 × (16 + 12) + 8 = 22 → one more fits.
    held = TeamRoom(zone_share=0.5, grace=8, total=16, by_zone={("aws", "a"): 16},
                by_cloud={"aws": 16})
    p.teams["t"] = held
    want, _ = brute_force(p)
    assert want == pytest.approx(10 + 15 + 15)
    for sol in (solver.heuristic(p), solver.exact(p)):
        check_solution(p, sol)
        assert sol.objective == pytest.approx(want)
        assert sorted(o.zone for o in sol.choice if o) == ["a", "b", "b"]


def growth_counted(group: Group) -> tuple[Group, list[object]]:
    """`group`, its `more` wrapped to record each time it is asked to list more."""
    listed = group.more
    assert listed is not None
    grown: list[object] = []

    def more(*args: object, **kw: object) -> tuple[list[Option], float]:
        grown.append(args)
        return listed(*args, **kw)  # type: ignore[arg-type]

    group.more = more
    return group, grown


def test_a_teams_only_request_that_no_zone_could_take_is_not_listed_to_the_end() -> None:
    # No grace and at most half of the team's GPUs in a zone, none held yet: wherever 4
    # GPUs go, they are all of the team's. The team's only request is left unplaced, for
    # its spread limit, without listing more of its 50 options (a pool's thousands, on
    # the event loop).
    full = [opt(10 + n, zone=f"z{n}", gpus=4) for n in range(50)]
    group, grown = growth_counted(short_group(full, 4))
    p = AssignmentProblem([Request(group, 1.0, 1000.0, "t", min_gpus=4)], limits={},
                          teams={"t": TeamRoom(zone_share=0.5, grace=0)})
    sol = solver.heuristic(p)
    assert sol.choice == [None]
    assert grown == []
    assert solver.why_unplaced(p, sol.choice) == {0: ("spread", "t")}
    # So in a batch where it is its team's only request.
    other = req(opt(5, zone="q", gpus=4), team="u")
    batch = AssignmentProblem([other, p.requests[0]], limits={},
                              teams={"t": p.teams["t"], "u": TeamRoom()})
    sol = solver.heuristic(batch)
    assert sol.choice == [other.options[0], None]
    assert grown == []
    # With 8 of its GPUs in two other zones, 4 more in a zone of their own are a third
    # of them: placed, on the cheapest.
    p.teams["t"] = TeamRoom(zone_share=0.5, grace=0, total=8,
                            by_zone={("gcp", "x"): 4, ("gcp", "y"): 4}, by_cloud={"gcp": 8})
    sol = solver.heuristic(p)
    check_solution(p, sol)
    assert sol.choice == [full[0]]


def test_a_teams_only_request_whose_instances_pass_its_gpus_left_is_not_listed_to_the_end(
        ) -> None:
    # 4 GPUs asked for, 4 left to the team, but every offer is of 8 GPUs an instance
    # (H100s): no option fits, listed or not.
    full = [opt(10 + n, zone=f"z{n}", gpus=8) for n in range(50)]
    group, grown = growth_counted(short_group(full, 4))
    asked: list[int] = []

    def least_paid() -> int:
        asked.append(8)
        return 8

    r = Request(group, 1.0, 1000.0, "t", min_gpus=4, least_paid=least_paid)
    p = AssignmentProblem([r], limits={}, teams={"t": TeamRoom(gpus_left=4)})
    sol = solver.heuristic(p)
    assert sol.choice == [None]
    assert grown == [] and asked == [8]
    assert solver.why_unplaced(p, sol.choice) == {0: ("team_gpus", 4)}
    # With 8 left it goes on the cheapest, and the instances are not counted.
    asked.clear()
    p.teams["t"] = TeamRoom(gpus_left=8)
    sol = solver.heuristic(p)
    check_solution(p, sol)
    assert sol.choice == [full[0]] and asked == []


def test_team_gpus_and_budget_bind_across_the_batch() -> None:
    both = [opt(10, gpus=8, price=10), opt(10, gpus=8, price=10), opt(10, gpus=8, price=10)]
    p = AssignmentProblem([req(o, team="t") for o in both],
                          limits={}, teams={"t": TeamRoom(gpus_left=16)})
    for sol in (solver.heuristic(p), solver.exact(p)):
        check_solution(p, sol)
        assert [o is not None for o in sol.choice] == [True, True, False]  # arrival order
    p = AssignmentProblem([req(o, team="t") for o in both], limits={},
                teams={"t": TeamRoom(budget_left=25.0)})
    for sol in (solver.heuristic(p), solver.exact(p)):
        check_solution(p, sol)
        assert sum(o is not None for o in sol.choice) == 2


def test_a_shared_resource_counts_every_user() -> None:
    # A quota group of 10 units: options in two pools count against it.
    p = AssignmentProblem([req(opt(10, ("A", 1), ("q", 6)), opt(40, ("C", 1))),
                 req(opt(11, ("B", 1), ("q", 6)), opt(20, ("C", 1)))],
                limits={"A": 5, "B": 5, "C": 5, "q": 10})
    want, _ = brute_force(p)
    assert want == pytest.approx(30)  # r0 in A, r1 pushed to C
    for sol in (solver.heuristic(p), solver.exact(p)):
        check_solution(p, sol)
        assert sol.objective == pytest.approx(30)


# --- why_unplaced --------------------------------------------------------------------


def test_why_unplaced_names_what_binds() -> None:
    a = opt(10, ("A", 1))
    p = AssignmentProblem([req(a), req(a)], limits={"A": 1})
    assert solver.why_unplaced(p, [a, None]) == {1: ("resource", "A")}
    g = opt(10, gpus=8)
    p = AssignmentProblem([req(g, team="t"), req(g, team="t")], limits={},
                teams={"t": TeamRoom(gpus_left=8)})
    assert solver.why_unplaced(p, [g, None]) == {1: ("team_gpus", 0)}  # GPUs left
    p = AssignmentProblem([req(g, team="t"), req(g, team="t")], limits={},
                teams={"t": TeamRoom(budget_left=15.0)})
    assert solver.why_unplaced(p, [g, None]) == {1: ("team_budget", 5.0)}  # $/h left
    p = AssignmentProblem([req(g, team="t"), req(g, team="t")], limits={},
                teams={"t": TeamRoom(zone_share=0.5, grace=4)})
    assert solver.why_unplaced(p, [g, None]) == {1: ("spread", "t")}
    # Nothing binds: only the penalty kept it out (a solver's choice, not a limit); a
    # request without options is not explained.
    p = AssignmentProblem([req(g), Request(Group([]), 1.0, 1.0)], limits={})
    assert solver.why_unplaced(p, [None, None]) == {0: ("penalty", None)}
    # Placed requests are not explained.
    assert solver.why_unplaced(p, [g, None]) == {}


# --- random small problems against brute force ---------------------------------------

ZONES = [("aws", "a"), ("aws", "b"), ("gcp", "c")]


RawOption = tuple[float, tuple[tuple[str, float], ...], int, float, int]


@dataclass
class Spec:
    """A drawn problem, rebuilt fresh for each solver (solvers list more options into
    groups and move their cursors). A request whose options are an int shares the
    group of that earlier request, as placement's requests for the same thing do."""

    requests: list[tuple[list[RawOption] | int, str | None, float]]
    limits: dict[str, float]
    teams: dict[str, tuple[float | None, float | None, float | None, float | None, int,
                           dict[int, int]]]

    def build(self, listed: int | None = None) -> AssignmentProblem:
        """The problem; with `listed`, each group lists only its cheapest `listed`
        options and `more` gives the rest (column generation)."""
        reqs: list[Request] = []
        for raw, team, horizon in self.requests:
            if isinstance(raw, int):
                group = reqs[raw % len(reqs)].group
            else:
                full = sorted((Option(c, uses, g, price, *ZONES[z])
                               for c, uses, g, price, z in raw), key=lambda o: o.cost_per_hour)
                group = Group(full) if listed is None else short_group(full, listed)
            worst = (group.more(None, math.inf)[0] if group.more else group.options)[-1]
            reqs.append(Request(group, horizon, 10 * horizon * worst.cost_per_hour, team))
        teams = {}
        for name, (gl, bl, zs, cs, grace, held) in self.teams.items():
            by_zone = {ZONES[z]: n for z, n in held.items() if n}
            by_cloud: dict[str, int] = defaultdict(int)
            for (cloud, _), n in by_zone.items():
                by_cloud[cloud] += n
            teams[name] = TeamRoom(gl, bl, zs, cs, grace, sum(by_zone.values()), by_zone,
                               dict(by_cloud))
        return AssignmentProblem(reqs, dict(self.limits), teams)


RESOURCES = ["p0", "p1", "p2", "q"]


def within_shares(team: tuple[float | None, float | None, float | None, float | None, int,
                              dict[int, int]]) -> bool:
    """Whether what the team holds already is within its spread limits (a team over
    them is `test_a_team_already_over_its_share_*`'s case)."""
    _, _, zone_share, cloud_share, grace, held = team
    total = sum(held.values())
    by_cloud: dict[str, int] = defaultdict(int)
    for z, n in held.items():
        by_cloud[ZONES[z][0]] += n
    return not ((zone_share is not None and
                 any(n > zone_share * total + grace for n in held.values())) or
                (cloud_share is not None and
                 any(n > cloud_share * total + grace for n in by_cloud.values())))


@st.composite
def specs(draw: st.DrawFn, max_requests: int = 6, max_options: int = 4) -> Spec:
    teams = {}
    team = st.tuples(
        st.one_of(st.none(), st.sampled_from([4, 8, 16, 24])),
        st.one_of(st.none(), st.sampled_from([15.0, 30.0, 60.0])),
        st.one_of(st.none(), st.sampled_from([0.34, 0.5, 0.75])),
        st.one_of(st.none(), st.sampled_from([0.5, 0.8])),
        st.sampled_from([0, 4, 8]),
        st.dictionaries(st.integers(0, 2), st.sampled_from([0, 4, 8]), max_size=2),
    ).filter(within_shares)
    for name in sorted(draw(st.sets(st.sampled_from(["t1", "t2"])))):
        teams[name] = draw(team)
    option = st.tuples(
        st.integers(5, 40).map(float),  # cost per hour
        st.lists(st.tuples(st.sampled_from(RESOURCES), st.sampled_from([1.0, 2.0, 4.0])),
                 max_size=2, unique_by=lambda u: u[0]).map(tuple),
        st.sampled_from([1, 4, 8, 16]),  # gpus
        st.integers(4, 30).map(float),  # price
        st.integers(0, 2),  # zone
    )
    first = st.tuples(st.lists(option, min_size=1, max_size=max_options),
                      st.sampled_from([None, *sorted(teams)]), st.sampled_from([1.0, 3.0]))
    rest = st.tuples(st.one_of(st.lists(option, min_size=1, max_size=max_options),
                               st.integers(0, max_requests)),
                     st.sampled_from([None, *sorted(teams)]), st.sampled_from([1.0, 1.0, 3.0]))
    requests = [draw(first), *draw(st.lists(rest, max_size=max_requests - 1))]
    limits = draw(st.dictionaries(st.sampled_from(RESOURCES),
                                  st.sampled_from([0.0, 1.0, 2.0, 3.0, 4.0, 6.0])))
    return Spec(requests, limits, teams)


FAST = settings(max_examples=60, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(specs())
def test_exact_equals_brute_force_and_heuristic_is_feasible_and_no_better(spec: Spec) -> None:
    want, _ = brute_force(spec.build())
    p = spec.build()
    h = solver.heuristic(p)
    check_solution(p, h)
    assert h.objective >= want - TOL
    if h.optimal:
        assert h.objective == pytest.approx(want, abs=TOL)
    p = spec.build()
    e = solver.exact(p, time_limit=5.0)
    check_solution(p, e)
    assert e.optimal
    assert e.objective == pytest.approx(want, abs=TOL)
    assert e.bound <= want + TOL


@FAST
@given(specs(max_requests=4, max_options=5))
# Three requests sharing one list whose pool has one instance: regrown without what is
# used up, the list is empty while a request sits on its last option.
@example(Spec([([(5.0, (("p0", 1.0),), 1, 4.0, 0), (5.0, (("p0", 1.0),), 1, 4.0, 0)],
                None, 1.0), (0, None, 1.0), (0, None, 1.0)], {"p0": 1.0}, {}))
def test_column_generation_finds_options_beyond_the_listed_ones(spec: Spec) -> None:
    """Each group lists only its cheapest option; the LP must ask `more` for the
    others (an all-unplaced incumbent keeps the heuristic from listing them first)."""
    want, _ = brute_force(spec.build())
    p = spec.build(listed=1)
    nobody = Solution([None] * len(p.requests), sum(r.penalty for r in p.requests), 0.0,
                      "none", 0.0)
    e = solver.exact(p, time_limit=5.0, incumbent=nobody)
    check_solution(spec.build(), e)
    assert e.optimal
    assert e.objective == pytest.approx(want, abs=TOL)
    # The heuristic, given the same short lists, lists more itself. (Its bound is then
    # not checked: see test_the_heuristic_bound_stays_below_its_objective_*.)
    p = spec.build(listed=1)
    h = solver.heuristic(p)
    check_solution(spec.build(), h, bound=False)
    assert h.objective >= want - TOL


def test_brute_force_checker_catches_each_violation() -> None:
    """The checker the tests lean on does see every kind of violation."""
    a = opt(10, ("A", 2), gpus=8, price=10, zone="a")
    p = AssignmentProblem([req(a, team="t"), req(a, team="t")], limits={"A": 3},
                teams={"t": TeamRoom(gpus_left=8, budget_left=15, zone_share=0.5,
                                 cloud_share=0.5, grace=0)})
    found = " | ".join(violations(p, [a, a]))
    for what in ("resource 'A'", "gpus 16 > 8", "budget 20", "zone ('aws', 'a')",
                 "cloud aws"):
        assert what in found
    assert violations(p, [None, None]) == []


# --- known bugs -------------------------------------------------------------------------


def test_a_team_already_over_its_share_does_not_spoil_the_milp_for_the_batch() -> None:
    p = AssignmentProblem([req(opt(10, zone="a", gpus=4), opt(11, zone="b", gpus=4), team="u"),
                 req(opt(10, zone="a", gpus=4), opt(11, zone="b", gpus=4), team="u"),
                 req(opt(5, zone="x", gpus=8), opt(9, zone="y", gpus=8), team="t")],
                limits={},
                teams={"u": TeamRoom(zone_share=0.5, grace=0),
                       "t": TeamRoom(zone_share=0.5, grace=0, total=24,
                                 by_zone={("aws", "x"): 24}, by_cloud={"aws": 24})})
    want, _ = brute_force(p)
    assert want == pytest.approx(10 + 11 + 9)
    e = solver.exact(p, time_limit=5.0)
    check_solution(p, e)
    assert e.objective == pytest.approx(want)


def test_the_heuristic_bound_stays_below_its_objective_when_a_shared_group_grows() -> None:
    # Two requests share a group listing only A (one left); B and C are listed later.
    full = [opt(5, ("A", 1)), opt(6, ("B", 1)), opt(7, ("C", 1))]
    group = short_group(full, 1)
    p = AssignmentProblem([Request(group, 1.0, 100.0), Request(group, 1.0, 100.0)],
                limits={"A": 1, "B": 1, "C": 1})
    h = solver.heuristic(p)
    assert h.objective == pytest.approx(11)
    assert h.bound <= h.objective


# --- listing more options --------------------------------------------------------------


def test_a_group_grows_when_its_source_leaves_out_the_listed_options_used_up() -> None:
    # A and B are listed and get taken; the third request's `more` lists only what is
    # alive (C): a shorter list than before, but a new option all the same, which the
    # greedy phase places (no improvement rounds to make up for it).
    full = [opt(5, ("A", 1)), opt(6, ("B", 1)), opt(7, ("C", 1))]
    group = short_group(full, 2)
    p = AssignmentProblem([Request(group, 1.0, 100.0) for _ in range(3)],
                limits={"A": 1, "B": 1, "C": 1})
    h = solver.heuristic(p, improve_rounds=0, reclaim=0)
    assert [o.uses[0][0] if o else None for o in h.choice] == ["A", "B", "C"]
    assert h.objective == pytest.approx(5 + 6 + 7)


def test_a_team_short_of_budget_for_every_unlisted_option_lists_no_more() -> None:
    # The group lists A; B and C, not listed yet, cost 20 and 30 an hour, and the group's
    # source says so (`unlisted_price`). TeamRoom t has 15 an hour left: once A is taken,
    # its request is unplaced without listing more (by the greedy and `_improve`; the
    # last phases, left out here, list more to spare the budget: see
    # test_a_team_short_of_budget_gets_the_low_price_pool_its_budget_affords).
    full = [opt(10, ("A", 1)), opt(20, ("B", 1)), opt(30, ("C", 1))]
    group = short_group(full, 1)
    group.unlisted_price = 20.0
    asked: list[int | None] = []
    more = group.more
    assert more is not None

    def counted(k: int | None, below: float | None, alive: Callable[[Option], bool] | None
                ) -> tuple[list[Option], float]:
        asked.append(k)
        return more(k, below, alive)

    group.more = counted
    teams = {"t": TeamRoom(budget_left=15.0)}
    p = AssignmentProblem([Request(group, 1.0, 100.0), Request(group, 1.0, 100.0, team="t")],
                limits={"A": 1, "B": 1, "C": 1}, teams=teams)
    h = solver.heuristic(p, reclaim=0)
    check_solution(p, h)
    assert [o.uses[0][0] if o else None for o in h.choice] == ["A", None]
    assert not asked
    # Without the floor, the same answer after listing everything.
    group = short_group(full, 1)
    p = AssignmentProblem([Request(group, 1.0, 100.0), Request(group, 1.0, 100.0, team="t")],
                limits={"A": 1, "B": 1, "C": 1}, teams=teams)
    assert solver.heuristic(p, reclaim=0).objective == pytest.approx(h.objective)
    assert group.complete


def test_the_price_floor_covers_listed_and_unlisted_options() -> None:
    group = Group([opt(10, price=12), opt(11, price=9), opt(12, price=14)], upto=13.0)
    group.unlisted_price = 11.0
    assert [group.price_floor(j) for j in range(4)] == [9, 9, 11, 11]
    group.upto = math.inf  # complete: nothing unlisted
    assert [group.price_floor(j) for j in range(4)] == [9, 9, 14, math.inf]
    group.options = group.options[:1]  # a new list: the floor follows it
    assert group.price_floor() == 12


# --- teams short of GPUs or budget, and making room ------------------------------------


def test_a_team_short_of_budget_takes_the_cheap_pools_before_teams_without_limits() -> None:
    # TeamRoom t may spend 20/h and asks for three placements of at least 10/h: two at most.
    # A and B (10/h, one instance each) are the only ones within its budget; `other`
    # has no limit and loses only 0.5 by going to D. By regret alone `other` (regret
    # 0.5) would take A before t's requests (regret 0), and t could place only one.
    ab = [opt(10, ("A", 1)), opt(10, ("B", 1)), opt(15, ("C", 1))]
    p = AssignmentProblem([req(opt(10, ("A", 1)), opt(10.5, ("D", 1)), penalty=1000),
                 *(req(*ab, team="t", penalty=1000) for _ in range(3))],
                limits={"A": 1, "B": 1, "C": 3, "D": 1}, teams={"t": TeamRoom(budget_left=20)})
    want, _ = brute_force(p)
    assert want == pytest.approx(10 + 10 + 10.5 + 1000)
    for rounds in (0, 4):  # the greedy phase alone finds it; improvement keeps it
        h = solver.heuristic(p, improve_rounds=rounds, reclaim=0 if rounds == 0 else None)
        check_solution(p, h)
        assert h.objective == pytest.approx(want)
        assert h.choice[0] is not None and h.choice[0].uses[0][0] == "D"


def test_a_team_swap_gives_its_gpus_to_the_request_worth_most_per_gpu() -> None:
    # The team may hold 8 more GPUs; two 4-GPU requests worth 50 each hold them, an
    # 8-GPU request worth 1000 is left out: a swap places it instead.
    p = AssignmentProblem([req(opt(10, gpus=4), team="t", penalty=50),
                 req(opt(10, gpus=4), team="t", penalty=50),
                 req(opt(20, gpus=8), team="t", penalty=1000)],
                limits={}, teams={"t": TeamRoom(gpus_left=8)})
    st = solver.State(p)
    st.take(0, p.requests[0].options[0])
    st.take(1, p.requests[1].options[0])
    assert solver._team_swaps(st) == 1
    assert [o is not None for o in st.choice] == [False, False, True]
    assert st.teams["t"].gpus_left == 0
    assert violations(p, st.choice) == []
    # Not when the left-out request is worth less than those it would displace.
    p.requests[2].penalty = 90
    st = solver.State(p)
    st.take(0, p.requests[0].options[0])
    st.take(1, p.requests[1].options[0])
    assert solver._team_swaps(st) == 0
    assert [o is not None for o in st.choice] == [True, True, False]
    # Through the heuristic: the brute-force optimum.
    p.requests[2].penalty = 1000
    want, _ = brute_force(p)
    h = solver.heuristic(p)
    check_solution(p, h)
    assert h.objective == pytest.approx(want) == 20 + 100


def test_making_room_moves_every_request_in_the_way() -> None:
    # Pool A has two instances, held by two 1-instance requests that could go to B and
    # C for 1 more each; the unplaced request needs both instances of A.
    small = [req(opt(10, ("A", 1)), opt(11, ("B", 1))), req(opt(10, ("A", 1)), opt(11, ("C", 1)))]
    big = req(opt(30, ("A", 2)), penalty=1000)
    p = AssignmentProblem([*small, big], limits={"A": 2, "B": 1, "C": 1})
    st = solver.State(p)
    for i in (0, 1):
        st.take(i, p.requests[i].options[0])
    users = {"A": [0, 1]}
    assert solver._make_room(st, 2, users)
    assert [o.uses[0][0] if o else None for o in st.choice] == ["B", "C", "A"]
    assert violations(p, st.choice) == []
    # When one of them has nowhere else to go, nothing moves.
    p.limits["C"] = 0
    st = solver.State(p)
    for i in (0, 1):
        st.take(i, p.requests[i].options[0])
    assert not solver._make_room(st, 2, {"A": [0, 1]})
    assert [o.uses[0][0] if o else None for o in st.choice] == ["A", "A", None]
    assert st.left == {"A": 0, "B": 1, "C": 0}


def test_the_trivial_bound_counts_only_options_that_fit_on_their_own() -> None:
    # A's last instance is gone before the batch: the lone request's best is B, and
    # the heuristic can say so without the LP (the daemon then skips the MILP).
    p = AssignmentProblem([req(opt(10, ("A", 1)), opt(12, ("B", 1)))], limits={"A": 0, "B": 1})
    h = solver.heuristic(p)
    assert h.objective == pytest.approx(12) and h.bound == pytest.approx(12) and h.optimal
    # A team whose budget rules out the cheapest option: the same.
    p = AssignmentProblem([req(opt(10, price=30), opt(12, price=20), team="t")], limits={},
                teams={"t": TeamRoom(budget_left=25)})
    h = solver.heuristic(p)
    assert h.objective == pytest.approx(12) and h.optimal
    # Two requests: contention is not counted, so nothing is proven.
    p = AssignmentProblem([req(opt(10, ("A", 1)), opt(12, ("B", 1))),
                 req(opt(10, ("A", 1)), opt(12, ("B", 1)))], limits={"A": 1, "B": 1})
    h = solver.heuristic(p)
    assert h.bound == pytest.approx(20) and h.objective == pytest.approx(22)
    assert not h.optimal


def test_a_team_short_of_budget_takes_the_lower_price_when_it_places_more() -> None:
    # A costs 10 (price 10), B costs 10.5 but its price is 6 (a cheaper machine whose
    # expected cost carries more risk). With 20/h, A places two requests, B three.
    opts = [opt(10, ("A", 1), price=10), opt(10.5, ("B", 1), price=6)]
    p = AssignmentProblem([req(*opts, team="t", penalty=1000) for _ in range(3)],
                limits={"A": 3, "B": 3}, teams={"t": TeamRoom(budget_left=20)})
    want, _ = brute_force(p)
    assert want == pytest.approx(3 * 10.5)
    h = solver.heuristic(p, improve_rounds=0, reclaim=0)
    check_solution(p, h)
    assert h.objective == pytest.approx(want)
    assert all(o is not None and o.uses[0][0] == "B" for o in h.choice)


@pytest.mark.parametrize("chains", [True, False])
def test_a_request_takes_a_cheaper_pool_by_moving_its_holder_on(chains: bool) -> None:
    # r0 sits in B (12) because r1 holds A's one instance; r1 loses 0.5 by moving to C,
    # r0 gains 2 by taking A.
    p = AssignmentProblem([req(opt(10, ("A", 1)), opt(12, ("B", 1))),
                 req(opt(10, ("A", 1)), opt(10.5, ("C", 1)))],
                limits={"A": 1, "B": 1, "C": 1})
    st = solver.State(p)
    st.take(0, p.requests[0].options[1])
    st.take(1, p.requests[1].options[0])

    def no_unplaced(i: int) -> tuple[Option | None, float, float]:
        raise AssertionError("nothing is unplaced")

    solver._improve(st, rounds=1, best_two=no_unplaced, chains=chains)
    where = [o.uses[0][0] if o else None for o in st.choice]
    assert where == (["A", "C"] if chains else ["B", "A"])
    assert violations(p, st.choice) == []
    assert st.left == ({"A": 0, "B": 1, "C": 0} if chains else {"A": 0, "B": 0, "C": 1})


def test_the_exact_solver_prints_nothing(capfd: pytest.CaptureFixture[str]) -> None:
    """HiGHS writes a banner and its log to the process's stdout unless told not to:
    nothing of it may reach a command's output (`--format json`)."""
    solver.preload()
    p = regret_problem()
    lp = solver._LP(p)
    assert lp.solve_relaxation() is not None  # HiGHS ran (the LP)
    assert solver.exact(p).objective == pytest.approx(21)  # and again (LP and MILP)
    out, _ = capfd.readouterr()
    assert out == ""


def test_a_stop_before_the_exact_solver_starts_keeps_the_heuristics_answer() -> None:
    """`stop` (the daemon's: work is waiting) already true: no LP and no MILP, the
    incumbent as it is, its bound only the trivial one, not called optimal."""
    p = regret_problem()
    inc = solver.heuristic(p)
    got = solver.exact(regret_problem(), stop=lambda: True)
    assert got.detail == {"lp_rounds": 1, "milp": "stopped"}
    assert got.objective == pytest.approx(inc.objective)
    assert not got.optimal
    assert got.bound == pytest.approx(solver.trivial_bound(regret_problem()))


def contested_problem(seed: int = 2, n: int = 40, m: int = 12) -> AssignmentProblem:
    """`n` requests over `m` pools of a few instances each, at random costs: the
    heuristic leaves a gap the MILP closes (seed 2: 371.16 against 358.78)."""
    import random

    rng = random.Random(seed)
    requests = [req(*(opt(round(rng.uniform(5, 50), 2), (f"P{j}", rng.randint(1, 4)))
                      for j in range(m))) for _ in range(n)]
    return AssignmentProblem(requests, limits={f"P{j}": rng.randint(6, 14) for j in range(m)})


def test_a_stop_while_the_exact_solver_runs_keeps_the_best_answer_so_far() -> None:
    """HiGHS asks `stop` every so often while it solves (some 80 times for this
    problem's LP and MILP); once it is true, it stops at the next ask, and `exact`
    answers with what it has: feasible, never worse than the heuristic's."""
    p = contested_problem()
    inc = solver.heuristic(contested_problem())
    whole = solver.exact(contested_problem(), time_limit=30, stop=lambda: False)
    assert whole.optimal and whole.objective < inc.objective - 1  # the MILP had work
    asked = 0

    def stop() -> bool:
        nonlocal asked
        asked += 1
        return asked >= 10

    got = solver.exact(p, time_limit=30, stop=stop)
    assert asked <= 12  # stopped at once, not at the end of the search
    check_solution(p, got)
    assert got.objective <= inc.objective + TOL
    assert not got.optimal
    assert got.detail.get("milp") == "stopped" or got.detail.get("milp_status") == 1


@FAST
@given(specs())
def test_a_deadline_already_past_keeps_the_greedy_answer_unimproved(spec: Spec) -> None:
    greedy = solver.heuristic(spec.build(), improve_rounds=0, reclaim=0)
    p = spec.build()
    late = solver.heuristic(p, deadline=0.0)  # perf_counter() is past 0 already
    check_solution(p, late)
    assert late.choice == greedy.choice or \
        [o and o.uses for o in late.choice] == [o and o.uses for o in greedy.choice]
    assert late.objective == pytest.approx(greedy.objective)


# --- the last phases (`_polish`): what the greedy and `_improve` leave ---------------------


def long_after_short_problem() -> AssignmentProblem:
    """A 10-hour request L wants pool A or C (1.0 and 1.05 an hour), else D (2.0). Two
    1-hour requests want A (else B at 3.0) and C (else E at 3.0): each stands to lose 2
    by waiting, L only 0.5 (10 × 0.05), so the regret greedy places them first and L on
    D: 1 + 1 + 20. The optimum moves the first on to B and gives A to L: 3 + 1 + 10."""
    return AssignmentProblem(
        [req(opt(1.0, ("A", 1)), opt(3.0, ("B", 1))),
         req(opt(1.0, ("C", 1)), opt(3.0, ("E", 1))),
         req(opt(1.0, ("A", 1)), opt(1.05, ("C", 1)), opt(2.0, ("D", 1)), horizon=10.0)],
        limits={"A": 1, "B": 1, "C": 1, "D": 1, "E": 1})


def test_the_request_that_loses_most_takes_the_cheap_pool_moving_its_holder_on() -> None:
    want, _ = brute_force(long_after_short_problem())
    assert want == pytest.approx(14)
    # Without the chains of `_improve` (as for batches above `chain_max_batch`).
    plain = solver.heuristic(long_after_short_problem(), chains=False, reclaim=0)
    assert plain.objective == pytest.approx(22)
    p = long_after_short_problem()
    h = solver.heuristic(p, chains=False)
    check_solution(p, h)
    assert h.objective == pytest.approx(14)
    assert [o.uses[0][0] if o else None for o in h.choice] == ["B", "C", "A"]


def budget_problem() -> AssignmentProblem:
    """Team t has 30 an hour left for two requests. t1's nine cheapest pools cost 20 an
    hour each; its tenth, L, 10 (at an expected cost of 12, above theirs); t2's one
    pool, K, 20. The greedy puts t1 on the lowest price among the cheapest it looks at
    (`_thrifty`: 20) and leaves t2 out (10 left): 9 + 100. On L, t1 spares what t2
    needs: 12 + 9."""
    t1 = [opt(9 + k / 10, (f"H{k}", 1), price=20) for k in range(9)]
    return AssignmentProblem(
        [req(*t1, opt(12, ("L", 1), price=10), team="t", penalty=100.0),
         req(opt(9, ("K", 1), price=20), team="t", penalty=100.0)],
        limits={**{f"H{k}": 1 for k in range(9)}, "L": 1, "K": 1},
        teams={"t": TeamRoom(budget_left=30.0)})


def test_a_team_short_of_budget_moves_to_a_lower_price_to_place_one_more() -> None:
    want, _ = brute_force(budget_problem())
    assert want == pytest.approx(21)
    plain = solver.heuristic(budget_problem(), reclaim=0)
    assert plain.objective == pytest.approx(109)
    p = budget_problem()
    h = solver.heuristic(p)
    check_solution(p, h)
    assert h.objective == pytest.approx(21)
    assert [o.uses[0][0] if o else None for o in h.choice] == ["L", "K"]


def test_a_team_short_of_budget_gets_the_low_price_pool_its_budget_affords() -> None:
    # Pools A, B, C at 10, 20, 30 an hour, one instance each; the group lists A only
    # (B and C come from `more`). r0 takes A (first in line); r1's team has 15 left, so
    # B and C are beyond it and it stays out: 10 + 100. Listing more, the last phases
    # move r0 on to B and give A to r1: 20 + 10.
    full = [opt(10, ("A", 1)), opt(20, ("B", 1)), opt(30, ("C", 1))]

    def problem(listed: int = 1) -> AssignmentProblem:
        group = short_group(full, listed)
        return AssignmentProblem(
            [Request(group, 1.0, 100.0), Request(group, 1.0, 100.0, team="t")],
            limits={"A": 1, "B": 1, "C": 1}, teams={"t": TeamRoom(budget_left=15.0)})

    assert brute_force(problem(listed=3))[0] == pytest.approx(30)
    assert solver.heuristic(problem(), reclaim=0).objective == pytest.approx(110)
    p = problem()
    h = solver.heuristic(p)
    check_solution(p, h)
    assert h.objective == pytest.approx(30)
    assert [o.uses[0][0] if o else None for o in h.choice] == ["B", "A"]



def spread_problem() -> AssignmentProblem:
    """Team t holds 8 GPUs in gcp and may put at most half of its GPUs in one cloud.
    m, with the larger regret (10 an hour, else 20 in azure), goes first, to aws; then
    `big` (aws only, at 10 or 11; 400 if left out) would make aws 16 of 24: it stays
    out, 10 + 400. With m in azure, aws holds 8 of 24: 20 + 10."""
    held = TeamRoom(cloud_share=0.5, total=8, by_zone={("gcp", "g"): 8}, by_cloud={"gcp": 8})
    return AssignmentProblem(
        [req(opt(10, ("A", 1)), opt(20, ("Z", 1), cloud="azure", zone="z"), team="t"),
         req(opt(10, ("B", 1)), opt(11, ("C", 1)), team="t", penalty=400.0)],
        limits={"A": 1, "B": 1, "C": 1, "Z": 1}, teams={"t": held})


def test_a_team_at_its_cloud_share_moves_one_out_of_that_cloud_to_place_one_more() -> None:
    want, _ = brute_force(spread_problem())
    assert want == pytest.approx(30)
    assert solver.heuristic(spread_problem(), reclaim=0).objective == pytest.approx(410)
    p = spread_problem()
    h = solver.heuristic(p)
    check_solution(p, h)
    assert h.objective == pytest.approx(30)
    assert [o.uses[0][0] if o else None for o in h.choice] == ["Z", "B"]

@FAST
@given(specs(), st.sampled_from([None, 1]))
def test_the_last_phases_break_no_constraint_and_never_raise_the_objective(
        spec: Spec, listed: int | None) -> None:
    plain = solver.heuristic(spec.build(listed), chains=False, reclaim=0)
    p = spec.build(listed)
    h = solver.heuristic(p, chains=False)
    # A list `short_group` regrows without what is used up may leave out the option a
    # request sits on (the greedy's doing, with or without the last phases): with
    # `listed`, every constraint but that one.
    assert [v for v in violations(p, h.choice)
            if listed is None or "is not an option" not in v] == []
    assert h.objective == pytest.approx(objective(p, h.choice), abs=TOL)
    assert h.objective <= plain.objective + TOL
    # The same input, the same answer.
    again = solver.heuristic(spec.build(listed), chains=False)
    assert [o and o.uses for o in again.choice] == [o and o.uses for o in h.choice]


@pytest.mark.parametrize("phase", ["reclaim", "spare_budget"])
def test_the_last_phases_change_nothing_past_their_deadline(phase: str) -> None:
    p = long_after_short_problem() if phase == "reclaim" else budget_problem()
    st_ = solver.State(p)
    # The greedy's answer (as `heuristic(..., reclaim=0)` finds it), placed by hand.
    placed = solver.heuristic(p if phase == "reclaim" else budget_problem(), chains=False,
                              reclaim=0).choice
    for i, o in enumerate(placed):
        if o is not None:
            st_.take(i, o)
    before = list(st_.choice)
    if phase == "reclaim":
        assert solver._reclaim(st_, limit=10, deadline=0.0) == 0
    else:
        solver._spare_limits(st_, lambda i: (None, p.requests[i].penalty,
                                             p.requests[i].penalty), limit=10, deadline=0.0)
    assert st_.choice == before


def test_the_reclaim_phase_stops_at_its_deadline() -> None:
    # 64 cheap pools, each held by a request with nowhere else to go; 5,000 long requests
    # on a dear pool try each of them in turn (about 1 s of work here, given the time).
    cheap = [opt(1.0, (f"P{k}", 1)) for k in range(64)]
    dear = opt(5.0, ("D", 1))
    group = Group([*cheap, dear])
    n = 5000
    holders = [Request(Group([o]), 1.0, 100.0) for o in cheap]
    p = AssignmentProblem([*holders, *(Request(group, 10.0, 1000.0) for _ in range(n))],
                          limits={**{f"P{k}": 1 for k in range(64)}, "D": n})
    state = solver.State(p)
    for i, o in enumerate(cheap):
        state.take(i, o)
    for i in range(64, 64 + n):
        state.take(i, dear)
    started = time.perf_counter()
    assert solver._reclaim(state, limit=n, deadline=started + 0.02) == 0
    assert time.perf_counter() - started < 0.02 + 0.2  # it looks every 16 requests
    assert violations(p, state.choice) == []
