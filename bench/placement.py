"""Placement: quality and speed of the batch optimizer, and decisions per second through
the daemon, next to what came before.

Instances come from the real price snapshot (`bench/_instances.py`). Parts, each
runnable alone (`--part a b`), all by default:

a. 1,000 requests × 5,000 offers, a few seeds: the heuristic, the MILP, the optimum (the
   MILP's answer when it proves it optimal) and the old per-request sequential greedy,
   side by side: objective, expected cost, requests placed, ratios to the optimum, wall
   time; each answer checked for capacity, quota and team limits independently.
b. 10,000 requests × 50,000 offers: the heuristic's time (median of `--runs`) and its gap
   to the LP lower bound (column generation, as `broker.placement.solver.exact` starts), then
   which features of the instance make the gap (the same at 1,000 × 5,000 with one
   feature switched off at a time). `--profile`: where the heuristic's time goes.
c. For (b): time to evaluate the policy, build the candidate lists, solve, and turn the
   solution into decisions.
d. The whole daemon (real mosquitto, `python -m broker.cli run` on the simulated market):
   a burst of requests published at once (decisions per second, latency percentiles)
   and a fixed-rate load, for the skeleton (commit 63725ca, a git worktree), this
   checkout, and this checkout with the heuristic only, in one run.

Prints figures; pass/fail is not its business.

    cd /work/main && python bench/placement.py                 # everything, ~30 min
    python bench/placement.py --part a --seeds 1 2 3
    python bench/placement.py --part b c --profile
    python bench/placement.py --part d --burst 5000 --rate 500
    python bench/placement.py --quick                          # a smoke run, ~2 min
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import hashlib
import io
import math
import multiprocessing
import os
import pstats
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parent.parent
sys.path[:0] = [str(ROOT), str(SCRIPT.parent)]

import _instances as inst_mod  # noqa: E402
import latency  # noqa: E402
from _instances import Instance, group_quotas, instance, pool_from  # noqa: E402

from broker.model import Offer, PoolKey  # noqa: E402
from broker.placement import optimizer as placement  # noqa: E402
from broker.placement import solver  # noqa: E402
from broker.placement.optimizer import (  # noqa: E402
    Ask,
    BatchResult,
    BatchSettings,
    Decision,
    Outcome,
    Rejection,
)
from policies.evaluate import Denied, TeamUsage, evaluate  # noqa: E402
from policies.model import Team  # noqa: E402

SKELETON = "63725ca"  # the commit before the optimizer
HEURISTIC = BatchSettings(exact_max_batch=0)


def milp_settings(seconds: float) -> BatchSettings:
    return BatchSettings(exact_max_batch=10**9, exact_time_limit=seconds)


def load() -> str:
    """The machine's load average: other work on it skews wall times."""
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def median(xs: Sequence[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else math.nan


def fmt(x: float | None, nd: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.{nd}f}"


def table(rows: Sequence[Sequence[str]], indent: str = "  ") -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(indent + "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(row, widths, strict=True))))


def horizon(outcome: Outcome) -> float:
    """The hours a request's cost counts for, as placement builds its problem."""
    return outcome.ask.request.duration_hours or 1.0


# --------------------------------------------------------------------------------------
# the problem placement.solve builds, rebuilt here
# --------------------------------------------------------------------------------------

@dataclass
class Built:
    """The solver's problem for a batch, built as placement.solve builds it (through its
    `CandidateBuilder`), and what it took."""

    problem: solver.AssignmentProblem
    request_ids: list[str]  # problem request n -> request id
    rejected: int  # asks rejected before the solver (policy, or no option at all)
    evaluate_s: float
    build_s: float


def build(inst: Instance, settings: BatchSettings = HEURISTIC) -> Built:
    builder = placement.CandidateBuilder(inst.pool, inst.policy, inst.now, settings.candidates,
                                 indexed=len(inst.requests) >= settings.index_min_batch)
    verdicts = []
    t0 = time.perf_counter()
    for r in inst.requests:
        ask = Ask(r)
        verdicts.append((ask, placement.constraints_for(ask, inst.policy)))
    t1 = time.perf_counter()
    requests, ids, rejected = [], [], 0
    for ask, c in verdicts:
        if isinstance(c, Denied):
            rejected += 1
            continue
        req, _ = builder.request(ask, c)
        if req is None:
            rejected += 1
            continue
        requests.append(req)
        ids.append(ask.request.request_id)
    t2 = time.perf_counter()
    problem = solver.AssignmentProblem(requests, builder.limits, builder.teams)
    builder.problem = problem
    return Built(problem, ids, rejected, t1 - t0, t2 - t1)


def heuristic_as_solve(p: solver.AssignmentProblem) -> solver.Solution:
    """`solver.heuristic` as `placement.solve` runs it on a batch of this size."""
    return solver.heuristic(p, chains=len(p.requests) <= HEURISTIC.chain_max_batch)


@dataclass
class Reference:
    """Per request of the batch's problem (built fresh): the penalty for leaving it
    unplaced and the cost of its cheapest option, were it alone. Every answer is scored
    with these, so objectives compare across solvers (the solvers may raise a penalty
    while they list more options)."""

    penalty: dict[str, float]
    cheapest: dict[str, float]
    rejected_before: int


def reference(inst: Instance) -> Reference:
    b = build(inst)
    pen, cheap = {}, {}
    for rid, r in zip(b.request_ids, b.problem.requests, strict=True):
        pen[rid] = r.penalty
        cheap[rid] = min(r.cost(o) for o in r.options) if r.options else math.inf
    return Reference(pen, cheap, b.rejected)


# --------------------------------------------------------------------------------------
# scoring and checking an answer
# --------------------------------------------------------------------------------------

@dataclass
class Score:
    placed: int = 0
    gpus: int = 0
    cost: float = 0.0  # Σ horizon × expected cost per hour of the placed requests
    penalty: float = 0.0  # Σ reference penalty of the problem's unplaced requests
    not_cheapest: int = 0  # problem requests not on their cheapest option (or unplaced)
    in_problem: int = 0
    violations: list[str] = field(default_factory=list)
    codes: Counter[str] = field(default_factory=Counter)

    @property
    def objective(self) -> float:
        return self.cost + self.penalty


def score(inst: Instance, ref: Reference, outcomes: Sequence[Outcome]) -> Score:
    s = Score(in_problem=len(ref.penalty))
    for out in outcomes:
        rid = out.ask.request.request_id
        if isinstance(out, Decision):
            s.placed += 1
            s.gpus += out.placement.total_gpus
            cost = horizon(out) * out.expected_cost_per_hour
            s.cost += cost
            cheapest = ref.cheapest.get(rid)
            if cheapest is None:
                s.violations.append(f"{rid} placed but has no option in a fresh build")
            elif cost > cheapest * (1 + 1e-7) + 1e-9:
                s.not_cheapest += 1
        else:
            s.codes[out.code.value] += 1
            if rid in ref.penalty:
                s.penalty += ref.penalty[rid]
                s.not_cheapest += 1
    s.violations += check(inst, outcomes)
    return s


def check(inst: Instance, outcomes: Sequence[Outcome]) -> list[str]:
    """What the placed requests break, checked from the offers and the policy alone:
    pool capacity, shared and own quotas, teams' max_gpus, budget and spread."""
    offers = {o.pool: o for o in inst.offers}
    quotas = group_quotas(inst.offers)
    used: Counter[PoolKey] = Counter()
    group_use: Counter[str] = Counter()
    own_use: Counter[PoolKey] = Counter()
    team_gpus: Counter[str] = Counter()
    team_price: defaultdict[str, float] = defaultdict(float)
    zone: defaultdict[str, Counter[tuple[str, str]]] = defaultdict(Counter)
    cloud: defaultdict[str, Counter[str]] = defaultdict(Counter)
    bad: list[str] = []
    for out in outcomes:
        if not isinstance(out, Decision):
            continue
        p, req = out.placement, out.ask.request
        o = offers[p.pool]
        verdict = evaluate(inst.policy, req)
        if isinstance(verdict, Denied) or not verdict.permits(p.pool, o.gpu):
            bad.append(f"{req.request_id}: {p.pool} ({o.gpu}) is not allowed")
        elif verdict.cap is not None and p.price_per_gpu_hour > verdict.cap + 1e-9:
            bad.append(f"{req.request_id}: over its price cap")
        if p.total_gpus < req.gpus:
            bad.append(f"{req.request_id}: {p.total_gpus} GPUs for {req.gpus}")
        used[p.pool] += p.instances
        if o.quota_group is not None and o.quota_units:
            group_use[o.quota_group] += p.instances * o.quota_units
        elif o.quota_headroom is not None:
            own_use[p.pool] += p.instances * o.gpus
        if req.team:
            team_gpus[req.team] += p.total_gpus
            team_price[req.team] += p.price_per_hour
            zone[req.team][(p.pool.cloud, p.pool.zone)] += p.total_gpus
            cloud[req.team][p.pool.cloud] += p.total_gpus
    for key, n in used.items():
        cap = offers[key].capacity
        if cap is not None and n > cap:
            bad.append(f"pool {key}: {n} instances > capacity {cap}")
    for g, n in group_use.items():
        if n > quotas.get(g, math.inf):
            bad.append(f"quota {g}: {n} > {quotas[g]}")
    for key, n in own_use.items():
        if n > (offers[key].quota_headroom or 0):
            bad.append(f"quota of {key}: {n} GPUs > {offers[key].quota_headroom}")
    for name, t in inst.teams.items():
        total = team_gpus[name]
        if t.max_gpus is not None and total > t.max_gpus:
            bad.append(f"team {name}: {total} GPUs > max_gpus {t.max_gpus}")
        if t.budget_per_hour is not None and team_price[name] > t.budget_per_hour + 1e-6:
            bad.append(f"team {name}: ${team_price[name]:.2f}/h > {t.budget_per_hour}")
        grace = t.spread_grace_gpus
        if t.max_zone_share is not None and zone[name] and \
                max(zone[name].values()) > t.max_zone_share * total + grace:
            bad.append(f"team {name}: zone share over {t.max_zone_share}")
        if t.max_cloud_share is not None and cloud[name] and \
                max(cloud[name].values()) > t.max_cloud_share * total + grace:
            bad.append(f"team {name}: cloud share over {t.max_cloud_share}")
    return bad


# --------------------------------------------------------------------------------------
# the solvers
# --------------------------------------------------------------------------------------

@dataclass
class Answer:
    name: str
    seconds: float  # wall time of the whole placement
    outcomes: list[Outcome]
    result: BatchResult | None = None
    score: Score | None = None
    cpu: float = math.nan  # CPU time of this process (the machine may be shared)


def batch(inst: Instance, settings: BatchSettings, name: str) -> Answer:
    asks = [Ask(r) for r in inst.requests]
    c, t = time.process_time(), time.perf_counter()
    res = placement.solve(asks, inst.pool, inst.policy, now=inst.now, settings=settings)
    return Answer(name, time.perf_counter() - t, res.outcomes, res,
                  cpu=time.process_time() - c)


def sequential(inst: Instance) -> Answer:
    """The previous version: each request placed alone, in arrival order, against the
    capacity, quota and team usage the earlier ones took (held in the pool; quotas
    lowered in its offers, outside the timing). Each request is judged by the policy
    against its team's usage so far, as the daemon does."""
    pool = pool_from(inst.offers, now=inst.now)
    current = {o.pool: o for o in inst.offers}
    slice_keys: defaultdict[tuple[str, str], list[PoolKey]] = defaultdict(list)
    members: defaultdict[str, list[PoolKey]] = defaultdict(list)
    for o in inst.offers:
        slice_keys[(o.pool.cloud, o.pool.region)].append(o.pool)
        if o.quota_group is not None and o.quota_units:
            members[o.quota_group].append(o.pool)
    quota_left = group_quotas(inst.offers)
    usage: dict[str, tuple[int, float, Counter[tuple[str, str]]]] = {}
    outcomes: list[Outcome] = []
    spent = 0.0
    for req in inst.requests:
        t = time.perf_counter()
        u = usage.get(req.team or "")
        verdict = evaluate(inst.policy, req, TeamUsage(u[0], u[1], u[2]) if u else None)
        if isinstance(verdict, Denied):
            outcomes.append(Rejection(Ask(req), verdict.code, verdict.detail))
            spent += time.perf_counter() - t
            continue
        res = placement.solve([Ask(req, constraints=verdict)], pool, inst.policy,
                              now=inst.now, settings=HEURISTIC)
        out = res.outcomes[0]
        if isinstance(out, Decision):
            pool.hold(out.placement.pool, out.placement.instances)
        spent += time.perf_counter() - t
        outcomes.append(out)
        if not isinstance(out, Decision):
            continue
        p = out.placement
        if req.team:
            g, price, zones = usage.get(req.team, (0, 0.0, Counter()))
            zones[(p.pool.cloud, p.pool.zone)] += p.total_gpus
            usage[req.team] = (g + p.total_gpus, price + p.price_per_hour, zones)
        o = current[p.pool]
        changed: list[Offer] = []
        if o.quota_group is not None and o.quota_units:
            quota_left[o.quota_group] -= p.instances * o.quota_units
            left = quota_left[o.quota_group]
            for key in members[o.quota_group]:
                m = current[key]
                headroom = max(0, left) // m.quota_units * m.gpus  # type: ignore[operator]
                # Unchanged offers keep their object: the pool's index finds an offer
                # by identity when it changes later.
                if headroom != m.quota_headroom:
                    changed.append(replace(m, quota_headroom=headroom))
        elif o.quota_headroom is not None:
            changed.append(replace(o, quota_headroom=o.quota_headroom - p.total_gpus))
        slices = set()
        for m in changed:
            current[m.pool] = m
            slices.add((m.pool.cloud, m.pool.region))
        for sl in slices:
            pool.replace(sl, [current[k] for k in slice_keys[sl]])
    return Answer("sequential greedy", spent, outcomes)


def _milp_child(n_requests: int, n_offers: int, seed: int, seconds: float,
                conn: Any) -> None:
    inst = instance(n_requests, n_offers, seed)
    ans = batch(inst, milp_settings(seconds), "MILP")
    conn.send(ans)
    conn.close()


def milp(n_requests: int, n_offers: int, seed: int, seconds: float, wall: float
         ) -> Answer | None:
    """The MILP run in a child process (rebuilding the same instance), so a solve that
    overruns its time limit by far can be stopped: None after `wall` seconds."""
    ctx = multiprocessing.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_milp_child, args=(n_requests, n_offers, seed, seconds, send))
    proc.start()
    send.close()
    try:
        if recv.poll(wall):
            ans: Answer = recv.recv()
            return ans
        return None
    finally:
        if proc.is_alive():
            proc.terminate()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()


# --------------------------------------------------------------------------------------
# part a
# --------------------------------------------------------------------------------------

def part_a(args: argparse.Namespace) -> None:
    n_req, n_off = args.a_requests, args.a_offers
    print(f"== a. {n_req:,} requests x {n_off:,} offers, seeds {args.seeds}: heuristic "
          f"(exact_max_batch=0), MILP (exact_time_limit={args.milp_seconds:g} s, stopped "
          f"after {args.milp_wall:g} s wall), optimum (the MILP's answer when proven), "
          f"sequential greedy (one placement.solve per request, in order)")
    per: dict[str, list[tuple[Score, float]]] = defaultdict(list)
    for seed in args.seeds:
        inst = instance(n_req, n_off, seed)
        ref = reference(inst)
        print(f"-- seed {seed}: {inst.describe()}")
        print(f"   {ref.rejected_before} requests rejected before the solver (policy, or no "
              f"option at all); {len(ref.penalty)} go to the solver; trivial bound "
              f"{fmt(sum(ref.cheapest.values()))}")
        answers = [batch(inst, HEURISTIC, "heuristic")]
        m = milp(n_req, n_off, seed, args.milp_seconds, args.milp_wall)
        milp_note = ""
        if m is None:
            milp_note = f"no answer within {args.milp_wall:g} s wall: stopped"
        else:
            answers.append(m)
        answers.append(sequential(inst))
        for a in answers:
            a.score = score(inst, ref, a.outcomes)
        built = build(inst)
        lb = class_lp_bound(built.problem, time_limit=args.lp_seconds)
        lp = lb.value if lb.value is not None and lb.proven else math.nan
        opt = m if m is not None and m.result is not None and m.result.optimal else None
        best = min((a for a in answers), key=lambda a: a.score.objective)  # type: ignore[union-attr]
        base = opt or best
        assert base.score is not None
        rows = [("solver", "placed", "GPUs", "expected cost $", "penalty", "objective",
                 "obj/opt", "cost/opt", "obj/LP", "not cheapest", "viol.", "wall s",
                 "solver says")]
        for a in answers:
            s = a.score
            assert s is not None
            says = "-"
            if a.result is not None:
                r = a.result
                says = (f"{r.solver}, " + ("optimal" if r.optimal else
                                           f"gap ≤ {r.gap:.2%} (bound {fmt(r.bound, 0)})"))
            rows.append((a.name, str(s.placed), str(s.gpus), fmt(s.cost), fmt(s.penalty),
                         fmt(s.objective), f"{s.objective / base.score.objective:.4f}",
                         f"{s.cost / base.score.cost:.4f}", f"{s.objective / lp:.4f}",
                         f"{s.not_cheapest} ({s.not_cheapest / max(1, s.in_problem):.0%})",
                         str(len(s.violations)), fmt(a.seconds), says))
            per[a.name].append((s, a.seconds))
        if opt is not None:
            per["optimum"].append((opt.score, opt.seconds))  # type: ignore[arg-type]
        table(rows, "   ")
        if opt is not None:
            print("   ratios are to the optimum (the MILP's answer, proven optimal)")
        else:
            print("   obj/opt and cost/opt are to the best answer found; the optimum is not "
                  "proven: " + (milp_note or "the MILP stopped at its time limit"))
        print(f"   obj/LP is to the LP lower bound {fmt(lb.value)} ({lb.how}, "
              f"{'proven' if lb.proven else 'NOT proven'}, {lb.seconds:.1f} s): the optimum "
              f"lies between it and the best objective, {fmt(base.score.objective)}")
        for a in answers:
            assert a.score is not None
            if a.score.violations:
                print(f"   {a.name} breaks: " + "; ".join(a.score.violations[:5]))
            print(f"   {a.name} rejections: {dict(sorted(a.score.codes.items()))}")
    print(f"-- a. medians over seeds {args.seeds}")
    medians = [("solver", "runs", "placed", "expected cost $", "objective", "wall s")]
    for name, got in per.items():
        medians.append((name, str(len(got)), fmt(median([s.placed for s, _ in got]), 0),
                     fmt(median([s.cost for s, _ in got])),
                     fmt(median([s.objective for s, _ in got])),
                     fmt(median([t for _, t in got]))))
    table(medians, "   ")


# --------------------------------------------------------------------------------------
# parts b and c
# --------------------------------------------------------------------------------------

@dataclass
class Bound:
    value: float | None
    proven: bool
    rounds: int
    columns: int
    seconds: float
    how: str


def lp_bound(p: solver.AssignmentProblem, *, time_limit: float, max_rounds: int = 100,
             incumbent: solver.Solution | None = None) -> Bound:
    """The LP relaxation's optimum by column generation, a lower bound on every answer:
    the first half of `solver.exact`, through its private `_LP` and `_price_out` (a
    bench may use them; the MILP half is left out). Run it after the heuristic: it lists
    every option again as the LP needs them. Should those helpers change shape, the
    bound comes from `solver.exact` itself (MILP included), and says so."""
    started = time.perf_counter()
    try:
        groups = list({id(r.group): r.group for r in p.requests}.values())
        for g in groups:
            g.unfilter()
        rounds, grew, lp, duals = 0, False, None, None
        while True:
            rounds += 1
            lp = solver._LP(p)
            duals = lp.solve_relaxation()
            if duals is None:
                break
            grew, _ = solver._price_out(p, groups, duals, slack=0.0)
            if not grew or rounds >= max_rounds or \
                    time.perf_counter() - started > time_limit:
                break
    except (AttributeError, TypeError) as exc:
        sol = solver.exact(p, time_limit=time_limit, incumbent=incumbent)
        return Bound(sol.bound, sol.optimal or bool(sol.detail.get("lp_rounds")),
                     int(sol.detail.get("lp_rounds", 0)), int(sol.detail.get("columns", 0)),
                     time.perf_counter() - started,
                     f"solver.exact's bound (the LP helpers changed: {exc})")
    proven = duals is not None and not grew
    return Bound(lp.value if lp is not None else None, proven, rounds,
                 lp.n_x if lp is not None else 0, time.perf_counter() - started,
                 "LP column generation")


class _Rows:
    """An LP's rows by key, with their bounds: `rows(key, lo, hi)` is the row's index."""

    def __init__(self) -> None:
        self.index: dict[Any, int] = {}
        self.lo: list[float] = []
        self.hi: list[float] = []

    def __call__(self, key: Any, low: float, high: float) -> int:
        k = self.index.get(key)
        if k is None:
            k = self.index[key] = len(self.lo)
            self.lo.append(low)
            self.hi.append(high)
        return k


def _entries(p: solver.AssignmentProblem, r: solver.Request, o: solver.Option
             ) -> list[tuple[Any, float, float, float]]:
    """The rows an option's column has, as (row key, row low, row high, coefficient),
    in the solver's MILP formulation (`solver._LP`): its resources, its team's GPUs,
    budget, and spread rows."""
    out: list[tuple[Any, float, float, float]] = []
    for key, amount in o.uses:
        if key in p.limits:
            out.append((("res", key), -math.inf, p.limits[key], amount))
    t = p.teams.get(r.team) if r.team is not None else None
    if t is None:
        return out
    if t.gpus_left is not None:
        out.append((("gpus", r.team), -math.inf, t.gpus_left, o.gpus))
    if t.budget_left is not None:
        out.append((("budget", r.team), -math.inf, t.budget_left, o.price))
    if t.spreads:
        out.append((("total", r.team), 0.0, 0.0, -o.gpus))
        # A zone or cloud already over its share is clamped at 0 (the solver's LP also
        # fixes its options at 0; leaving them free only lowers the bound).
        if t.zone_share is not None:
            z = (o.cloud, o.zone)
            out.append((("zone", r.team, z), -math.inf,
                        max(0.0, t.zone_share * t.total + t.grace - t.by_zone.get(z, 0)),
                        o.gpus))
        if t.cloud_share is not None:
            out.append((("cloud", r.team, o.cloud), -math.inf,
                        max(0.0, t.cloud_share * t.total + t.grace
                            - t.by_cloud.get(o.cloud, 0)), o.gpus))
    return out


def class_lp_bound(p: solver.AssignmentProblem, *, time_limit: float, first: int = 8,
                   per_round: int = 20, max_rounds: int = 60,
                   progress: Callable[[str], None] | None = None) -> Bound:
    """A lower bound on every answer, from the bench's own LP: requests that are alike
    (the same option group, horizon, team and penalty) are one class with a count, so
    the LP has a column per class and option, not per request and option (the solver's
    `_LP` has the latter, which outgrows memory at 10,000 × 50,000). Column generation:
    each round prices every listed option of every class with the LP's duals and adds
    the most negative; options not listed yet cost at least their group's `upto`, and
    are listed (`grow`) when that could price out. Every round gives a valid bound, the
    LP's value plus, per class, count × its lowest reduced cost (Farley's bound); when
    nothing prices out it is the LP's value itself (proven). Reads the problem's option
    groups (`unfilter`, `grow`, `upto`): solver internals, like `lp_bound`."""
    import numpy as np
    from scipy.optimize import linprog
    from scipy.sparse import csr_array

    started = time.perf_counter()
    classes: dict[tuple[int, float, str | None, float], list[int]] = {}
    for i, r in enumerate(p.requests):
        if r.extra is not None:
            raise ValueError("class_lp_bound: the soft spread term is not modelled")
        classes.setdefault((id(r.group), r.horizon, r.team, r.penalty), []).append(i)
    reps = [p.requests[ix[0]] for ix in classes.values()]
    counts = [len(ix) for ix in classes.values()]
    for g in {id(r.group): r.group for r in reps}.values():
        g.unfilter()
    cols = [list(r.options[:first]) for r in reps]
    seen = [{id(o) for o in c} for c in cols]
    spread = [name for name, t in p.teams.items() if t.spreads]
    # An option's rows depend on it and the team only; their dual sum on the round too.
    rows_of: dict[tuple[str | None, int], list[tuple[Any, float, float, float]]] = {}

    def entries(r: solver.Request, o: solver.Option) -> list[tuple[Any, float, float, float]]:
        got = rows_of.get((r.team, id(o)))
        if got is None:
            got = rows_of[(r.team, id(o))] = _entries(p, r, o)
        return got

    best, rounds, proven, n_cols = -math.inf, 0, False, 0
    while True:
        rounds += 1
        row = _Rows()
        conv = [row(("class", j), float(n), float(n)) for j, n in enumerate(counts)]
        ri: list[int] = []
        ci: list[int] = []
        vals: list[float] = []
        cost: list[float] = []
        for j, r in enumerate(reps):
            for o in cols[j]:
                col = len(cost)
                cost.append(r.cost(o))
                ri.append(conv[j])
                ci.append(col)
                vals.append(1.0)
                for key, low, high, coef in entries(r, o):
                    ri.append(row(key, low, high))
                    ci.append(col)
                    vals.append(coef)
        n_cols = len(cost)
        for j, r in enumerate(reps):  # unplaced
            ri.append(conv[j])
            ci.append(len(cost))
            vals.append(1.0)
            cost.append(r.penalty)
        for name in spread:  # the team's GPUs in this batch, for its shares
            t = p.teams[name]
            share = {"total": -1.0, "zone": t.zone_share or 0.0, "cloud": t.cloud_share or 0.0}
            for key, k in row.index.items():
                if key[0] in share and key[1] == name:
                    ri.append(k)
                    ci.append(len(cost))
                    vals.append(1.0 if key[0] == "total" else -share[key[0]])
            cost.append(0.0)
        a = csr_array((vals, (ri, ci)), shape=(len(row.lo), len(cost)))
        lows, highs = np.array(row.lo), np.array(row.hi)
        eq = lows == highs
        ub = bool((~eq).any())
        res = linprog(np.array(cost), A_ub=a[~eq] if ub else None,
                      b_ub=highs[~eq] if ub else None, A_eq=a[eq], b_eq=highs[eq],
                      bounds=(0, None), method="highs")
        if res.status != 0:
            break
        duals = np.zeros(len(row.lo))
        duals[eq] = res.eqlin.marginals
        if ub:
            duals[~eq] = res.ineqlin.marginals
        index, values = row.index, duals.tolist()

        def dual(key: Any, index: dict[Any, int] = index, values: list[float] = values
                 ) -> float:
            k = index.get(key)
            return 0.0 if k is None else values[k]

        used: dict[tuple[str | None, int], float] = {}  # (team, option) -> Σ dual × coef
        farley, added, grown, negative = float(res.fun), 0, 0, False
        for j, r in enumerate(reps):
            u = float(duals[conv[j]])
            # Every other row adds to a reduced cost, but the team-total row
            # (coefficient −GPUs) may lower it by up to GPUs × |its dual|: options
            # dearer than `stop` (they come cheapest first) cannot price out.
            w = min(0.0, dual(("total", r.team)))
            gmax = (getattr(r, "min_gpus", 0) or max((o.gpus for o in r.options),
                                                     default=0)) + 16
            stop = u - w * gmax
            lowest = 0.0
            priced: list[tuple[float, int, solver.Option]] = []
            for o in r.options:
                c = r.cost(o)
                if c >= stop:
                    break
                if id(o) in seen[j]:
                    continue
                priced_in = used.get((r.team, id(o)))
                if priced_in is None:
                    priced_in = used[(r.team, id(o))] = sum(
                        dual(key) * coef for key, _, _, coef in entries(r, o))
                rc = c - u - priced_in
                if rc < -1e-9:
                    priced.append((rc, len(priced), o))
                    lowest = min(lowest, rc)
            g = r.group
            if not g.complete:
                # Not listed yet: at least `upto` per hour.
                tail = r.horizon * g.upto - stop
                if tail < -1e-9:
                    lowest = min(lowest, tail)
                    grown += g.grow(below=stop / r.horizon + 1e-9)
            farley += counts[j] * lowest
            negative = negative or lowest < 0
            for _, _, o in sorted(priced)[:per_round]:
                cols[j].append(o)
                seen[j].add(id(o))
                added += 1
        best = max(best, farley)
        if progress is not None:
            progress(f"round {rounds}: {n_cols:,} columns, LP {res.fun:,.2f}, bound "
                     f"{best:,.2f}, {added:,} columns added, {grown:,} groups grown, "
                     f"{time.perf_counter() - started:.0f} s")
        if not negative:
            proven, best = True, float(res.fun)
            break
        if not added and not grown:
            break  # something could price out that cannot be listed: bound as it is
        if rounds >= max_rounds or time.perf_counter() - started > time_limit:
            break
    return Bound(best if best > -math.inf else None, proven, rounds, n_cols,
                 time.perf_counter() - started,
                 f"the bench's class LP ({len(reps):,} classes of {len(p.requests):,} "
                 f"requests)")


def bound(args: argparse.Namespace, p: solver.AssignmentProblem, sol: solver.Solution,
          progress: Callable[[str], None] | None = None) -> Bound:
    if args.bound == "solver":
        return lp_bound(p, time_limit=args.lp_seconds, incumbent=sol)
    return class_lp_bound(p, time_limit=args.lp_seconds, progress=progress)


def part_b(args: argparse.Namespace, parts: set[str]) -> None:
    n_req, n_off, seed = args.b_requests, args.b_offers, args.b_seed
    t = time.perf_counter()
    inst = instance(n_req, n_off, seed)
    made = time.perf_counter() - t
    print(f"== {'/'.join(sorted(parts & {'b', 'c'}))}. {n_req:,} requests x {n_off:,} "
          f"offers, seed {seed} (instance made in {made:.1f} s): {inst.describe()}")
    # The pool builds its per-GPU price indexes on first use; the daemon keeps them warm.
    first = batch(inst, HEURISTIC, "heuristic (first, cold indexes)")
    runs = [batch(inst, HEURISTIC, "heuristic") for _ in range(args.runs)]
    walls = sorted(a.seconds for a in runs)
    own = sorted(a.result.seconds for a in runs if a.result is not None)
    r0 = runs[0].result
    assert r0 is not None
    print(f"   heuristic, placement.solve wall: median {median(walls):.3f} s over {args.runs} "
          f"runs ({', '.join(f'{w:.3f}' for w in walls)}; CPU median "
          f"{median([a.cpu for a in runs]):.3f} s); first run with cold pool indexes "
          f"{first.seconds:.3f} s; of which solver.heuristic (BatchResult.seconds) median "
          f"{median(own):.3f} s; load average {load()}")
    codes = Counter(o.code.value for o in r0.outcomes if isinstance(o, Rejection))
    print(f"   goal ≤ 1 s: {'met' if median(walls) <= 1 else 'MISSED'}; placed "
          f"{sum(isinstance(o, Decision) for o in r0.outcomes):,} of {n_req:,}; "
          f"rejections {dict(sorted(codes.items()))}")
    if "c" in parts:
        part_c(inst, args.runs)
    if args.profile:
        profile(inst)
    if "b" in parts:
        built = build(inst)
        sol = heuristic_as_solve(built.problem)
        print(f"   LP bound ({args.bound}) on the problem the heuristic just solved, up "
              f"to {args.lp_seconds:g} s:", flush=True)
        b = bound(args, built.problem, sol,
                  progress=lambda m: print(f"      {m}", flush=True))
        report_gap("   ", sol, b, built.problem)
        if not args.no_ablation:
            ablation(args)


def report_gap(indent: str, sol: solver.Solution, b: Bound, p: solver.AssignmentProblem) -> None:
    unplaced = [i for i, o in enumerate(sol.choice) if o is None]
    pen = sum(p.requests[i].penalty for i in unplaced)
    trivial = solver.trivial_bound(p)
    if b.value is None:
        print(f"{indent}LP failed after {b.rounds} rounds ({b.seconds:.1f} s)")
        return
    # Every round's value is a valid lower bound (Farley's), however early it stopped,
    # but an early one may be below the trivial bound, or negative: take the better.
    lower = max(b.value, trivial)
    gap = (sol.objective - lower) / lower if lower > 0 else math.inf
    print(f"{indent}heuristic objective {fmt(sol.objective)} (of which penalties "
          f"{fmt(pen)} for {len(unplaced)} unplaced); LP bound {fmt(b.value)} "
          f"({b.how}, {'proven' if b.proven else 'NOT proven: stopped early'}, {b.rounds} "
          f"rounds, {b.columns:,} columns, {b.seconds:.1f} s); trivial bound {fmt(trivial)}")
    print(f"{indent}gap to the {'LP' if lower == b.value else 'trivial'} bound {gap:.2%} "
          f"(goal ≤ 2 %, #31: "
          f"{'met' if gap <= 0.02 else 'MISSED'})")


@contextlib.contextmanager
def phase_timers() -> Iterator[dict[str, float]]:
    """Time the phases of placement.solve from the outside: the module functions and
    the builder's methods it calls are wrapped while the block runs (placement and the
    solver are read, never changed)."""
    spent: dict[str, float] = defaultdict(float)
    inside: list[str] = []
    saved: list[tuple[Any, str, str]] = [
        (placement, "constraints_for", "evaluate"),
        (placement.CandidateBuilder, "request", "lists"),
        (solver, "heuristic", "heuristic")]
    # Listing more options for the solver: whichever of these the builder has.
    saved += [(obj, name, "more") for obj, name in (
        (getattr(placement, "_Source", None), "more"), (placement.CandidateBuilder, "_walk"))
        if obj is not None and hasattr(obj, name)]
    originals = [getattr(obj, name) for obj, name, _ in saved]

    def timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            nested = label in inside
            where = inside[-1] if inside else ""
            inside.append(label)
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if not nested:
                    spent[f"more@{where}" if label == "more" else label] += \
                        time.perf_counter() - t
                inside.pop()
        return wrapper

    for (obj, name, label), fn in zip(saved, originals, strict=True):
        setattr(obj, name, timed(label, fn))
    try:
        yield spent
    finally:
        for (obj, name, _), fn in zip(saved, originals, strict=True):
            setattr(obj, name, fn)


def part_c(inst: Instance, runs: int) -> None:
    print("   c. time splits of placement.solve (heuristic): evaluate = the policy's verdict "
          "per request; candidate lists = placement.CandidateBuilder.request; solver = "
          "solver.heuristic, of which growing lists = the builder listing more options "
          "for it; decisions+rest = outcomes, reasons, why unplaced")
    rows = [("run", "evaluate s", "candidate lists s", "solver s", "of which growing lists s",
             "decisions+rest s", "total s")]
    for n in range(runs):
        asks = [Ask(r) for r in inst.requests]
        with phase_timers() as spent:
            t0 = time.perf_counter()
            placement.solve(asks, inst.pool, inst.policy, now=inst.now, settings=HEURISTIC)
            total = time.perf_counter() - t0
        ev, lists, heur = spent["evaluate"], spent["lists"], spent["heuristic"]
        rows.append((str(n + 1), fmt(ev, 3), fmt(lists, 3), fmt(heur, 3),
                     fmt(spent["more@heuristic"], 3), fmt(total - ev - lists - heur, 3),
                     fmt(total, 3)))
    table(rows, "      ")


def profile(inst: Instance) -> None:
    asks = [Ask(r) for r in inst.requests]
    prof = cProfile.Profile()
    prof.enable()
    placement.solve(asks, inst.pool, inst.policy, now=inst.now, settings=HEURISTIC)
    prof.disable()
    for key in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(22)
        lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
        start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
        print(f"   profile of one placement.solve (heuristic), by {key}:")
        for ln in lines[start:]:
            print("      " + ln.replace(str(ROOT) + "/", ""))


def ablation(args: argparse.Namespace) -> None:
    """The heuristic's gap to the LP bound with one feature of the instance off."""
    n_req, n_off, seed = args.ab_requests, args.ab_offers, args.b_seed
    print(f"   which features make the gap: {n_req:,} requests x {n_off:,} offers, seed "
          f"{seed}, one change at a time")
    base = instance(n_req, n_off, seed)
    no_limits = {k: Team(markets=t.markets) for k, t in base.teams.items()}

    def teams(**changes: Any) -> dict[str, Team]:
        return {k: t.model_copy(update=changes) for k, t in base.teams.items()}

    variants: list[tuple[str, Callable[[], Instance]]] = [
        ("as is", lambda: base),
        ("no team limits", lambda: with_policy(base, no_limits)),
        ("no budget_per_hour", lambda: with_policy(base, teams(budget_per_hour=None))),
        ("no max_gpus", lambda: with_policy(base, teams(max_gpus=None))),
        ("no spread limits", lambda: with_policy(base, teams(max_zone_share=None,
                                                             max_cloud_share=None))),
        ("no quotas", lambda: with_offers(base, [
            replace(o, quota_headroom=None, quota_group=None, quota_units=None)
            for o in base.offers])),
        ("capacity x3", lambda: instance(n_req, n_off, seed, capacity_scale=3.0)),
        ("no limits, capacity x3", lambda: with_policy(
            instance(n_req, n_off, seed, capacity_scale=3.0), no_limits)),
    ]
    rows = [("variant", "heuristic", "of which penalties", "unplaced", "LP bound", "gap",
             "heuristic s", "LP s")]
    for name, make in variants:
        inst = make()
        built = build(inst)
        sol = heuristic_as_solve(built.problem)
        b = bound(args, built.problem, sol)
        unplaced = [i for i, o in enumerate(sol.choice) if o is None]
        pen = sum(built.problem.requests[i].penalty for i in unplaced)
        v = b.value or math.nan
        rows.append((name, fmt(sol.objective), fmt(pen), str(len(unplaced)),
                     fmt(v) + ("" if b.proven else " (not proven)"),
                     f"{(sol.objective - v) / v:.2%}", fmt(sol.seconds, 3), fmt(b.seconds, 1)))
        if name == "as is" and args.bound == "class":
            check_built = build(inst)
            other = lp_bound(check_built.problem, time_limit=args.lp_seconds,
                             incumbent=heuristic_as_solve(check_built.problem))
            cross = (f"      cross-check, as is: the solver's own LP ({other.how}) gives "
                     f"{fmt(other.value)} in {other.seconds:.1f} s with {other.columns:,} "
                     f"columns; the class LP {fmt(b.value)} with {b.columns:,}")
    table(rows, "      ")
    if args.bound == "class":
        print(cross)


def with_policy(inst: Instance, teams: dict[str, Team]) -> Instance:
    return replace(inst, teams=teams, policy=inst_mod.policy_for(teams))


def with_offers(inst: Instance, offers: list[Offer]) -> Instance:
    return replace(inst, offers=offers, pool=pool_from(offers, now=inst.now))


# --------------------------------------------------------------------------------------
# part d: the daemon, this checkout and the skeleton
# --------------------------------------------------------------------------------------

class CheckoutDaemon(latency.Daemon):
    """latency.Daemon, run from another checkout (its cwd and PYTHONPATH)."""

    def __init__(self, root: Path, *args: Any, extra_config: str = "",
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.root = root
        if extra_config:
            with self.config.open("a") as f:
                f.write(extra_config)

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "broker.cli", "run", "--config", str(self.config),
            cwd=self.root, env=checkout_env(self.root), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True)
        self._reader = asyncio.create_task(self._read())


def checkout_env(root: Path) -> dict[str, str]:
    """The checkout's packages first: its broker, and its client library where it has one."""
    paths = [str(root)] + [str(root / "client")] * (root / "client").is_dir()
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def imports_from(root: Path) -> str:
    out = subprocess.run(
        [sys.executable, "-c", "import broker; print(broker.__file__)"],
        cwd=root, env=checkout_env(root), capture_output=True, text=True, check=True)
    return out.stdout.strip()


@dataclass
class Burst:
    sent: int = 0
    answered: int = 0
    publish_s: float = math.nan  # first send → last PUBACK
    span_s: float = math.nan  # first send → last answer
    p50_ms: float = math.nan
    p90_ms: float = math.nan
    p99_ms: float = math.nan
    max_ms: float = math.nan
    kinds: dict[str, int] = field(default_factory=dict)
    codes: dict[str, int] = field(default_factory=dict)
    daemon_cpu: float = math.nan  # % of one core, first send → last answer

    @property
    def per_second(self) -> float:
        return self.answered / self.span_s if self.span_s else math.nan


async def burst(host: str, port: int, n: int, pid: int, drain: float = 30.0) -> Burst:
    """Publish `n` requests at once (QoS 1, MQTT 3.1.1, written back to back in
    hand-written packets: `latency.RawPublisher`, so that the bench's own client is not
    what limits the rate) and time each to its decision."""
    make = latency.place_requests(f"burst-{uuid.uuid4().hex[:6]}")
    sent_at: dict[str, float] = {}
    answers: dict[str, tuple[float, str, str | None]] = {}
    res = Burst()
    async with latency.mqtt_client(host, port, "bench-burst", nodelay=True) as client:
        await client.subscribe(f"{latency.PREFIX}/events/+/+", qos=1)

        async def receive() -> None:
            async for msg in client.messages:
                got = latency.parse_event(msg)
                if got is not None and got[0] in sent_at and got[0] not in answers:
                    answers[got[0]] = (time.monotonic(), got[1], got[2])

        receiver = asyncio.create_task(receive())
        raw = await latency.RawPublisher.connect(host, port,
                                                 f"bench-burst-raw-{uuid.uuid4().hex[:8]}")
        try:
            cpu0 = latency.cpu_seconds(pid)
            t0 = time.monotonic()
            for i in range(n):
                topic, payload, key = make(i)
                sent_at[key] = time.monotonic()
                raw.publish(topic, payload)
            async with asyncio.timeout(60):
                await raw.until(n)  # every PUBACK: the server has them all
            res.publish_s = time.monotonic() - t0
            last, last_change = len(answers), time.monotonic()
            while len(answers) < len(sent_at) and time.monotonic() - last_change < drain:
                await asyncio.sleep(0.05)
                if len(answers) != last:
                    last, last_change = len(answers), time.monotonic()
            cpu1 = latency.cpu_seconds(pid)
        finally:
            raw.close()
            receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await receiver
    res.sent, res.answered = len(sent_at), len(answers)
    if answers:
        end = max(t for t, _, _ in answers.values())
        res.span_s = end - t0
        res.daemon_cpu = 100 * (cpu1 - cpu0) / res.span_s
        lat = sorted((answers[k][0] - sent_at[k]) * 1000 for k in answers)
        res.p50_ms, res.p90_ms = latency.percentile(lat, 50), latency.percentile(lat, 90)
        res.p99_ms, res.max_ms = latency.percentile(lat, 99), lat[-1]
        res.kinds = dict(Counter(k for _, k, _ in answers.values()))
        res.codes = dict(Counter(c for _, _, c in answers.values() if c is not None))
    return res


@contextlib.contextmanager
def skeleton_checkout(path: Path | None, commit: str) -> Any:
    """A checkout of `commit`: `path` when it exists, else a temporary git worktree that
    is removed afterwards."""
    if path is not None and path.exists():
        yield path
        return
    where = path or Path(tempfile.mkdtemp(prefix="gpubroker-skeleton-")) / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where),
                    commit], check=True, capture_output=True)
    try:
        yield where
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)],
                       check=False, capture_output=True)


Checkout = tuple[str, Path, str]  # name, root, extra daemon config


async def part_d_async(args: argparse.Namespace, checkouts: list[Checkout],
                       workdir: Path) -> None:
    mosq = latency.Mosquitto(workdir)
    mosq.start()
    host, port = latency.host_port(mosq.url)
    results: dict[str, dict[str, Any]] = defaultdict(dict)
    try:
        for n, (name, root, extra) in enumerate(checkouts):
            for mode in ("burst", "rate"):
                if mode == "rate" and args.rate <= 0:
                    continue
                tag = f"{n}-{mode}"
                daemon = CheckoutDaemon(root, workdir / tag, mosq.url, seed=args.sim_seed,
                                        regions=args.regions_per_cloud,
                                        poll_interval=args.d_poll_interval,
                                        extra_config=extra)
                await daemon.start()
                try:
                    await daemon.wait_ready()
                    await daemon.settle()
                    results[name]["offers"] = daemon.offers
                    assert mosq.proc is not None
                    if mode == "burst":
                        results[name]["burst"] = await burst(host, port, args.burst, daemon.pid)
                    else:
                        results[name]["rate"] = await latency.run_load(
                            tag, host, port, rate=args.rate, duration=args.duration,
                            warmup=args.warmup, subscribe=f"{latency.PREFIX}/events/+/+",
                            make=latency.place_requests(f"{tag}-{uuid.uuid4().hex[:6]}"),
                            parse=latency.parse_event,
                            pids={"daemon": daemon.pid, "mosquitto": mosq.proc.pid,
                                  "bench": os.getpid()}, nodelay=True)
                finally:
                    rc = await daemon.stop()
                    if rc not in (0, None):
                        print(f"   {tag}: daemon exited with {rc}:\n"
                              + "\n".join(daemon.tail[-10:]), file=sys.stderr)
    finally:
        mosq.stop()
    print(f"   burst: {args.burst:,} requests written at once (QoS 1, MQTT 3.1.1, hand-written "
          f"packets); decisions/s = answered / (first send → last answer)")
    rows = [("checkout", "offers", "answered", "publish s", "decisions/s", "p50 ms",
             "p90 ms", "p99 ms", "max ms", "daemon cpu%", "decided/rejected")]
    for name, _, _ in checkouts:
        b: Burst = results[name].get("burst") or Burst()
        rows.append((name, str(results[name].get("offers")), f"{b.answered}/{b.sent}",
                     fmt(b.publish_s), fmt(b.per_second, 0), fmt(b.p50_ms, 1),
                     fmt(b.p90_ms, 1), fmt(b.p99_ms, 1), fmt(b.max_ms, 1),
                     fmt(b.daemon_cpu, 0),
                     f"{b.kinds.get('placement.decided', 0)}/"
                     f"{b.kinds.get('placement.rejected', 0)}"))
    table(rows, "      ")
    for name, _, _ in checkouts:
        b = results[name].get("burst") or Burst()
        print(f"      {name} burst rejections: {b.codes}")
    if args.rate > 0:
        print(f"   fixed rate: {args.rate:g}/s open loop for {args.duration:g} s after "
              f"{args.warmup:g} s warm-up (latency.run_load)")
        rate_rows = [("checkout", "sent", "answered", "p50 ms", "p90 ms", "p99 ms", "max ms",
                      "sent/s", "cpu% daemon,mosq,bench", "decided/rejected")]
        for name, _, _ in checkouts:
            r = results[name].get("rate")
            if r is None:
                continue
            rate_rows.append((name, str(r.sent), str(r.answered), fmt(r.p50_ms), fmt(r.p90_ms),
                         fmt(r.p99_ms), fmt(r.max_ms, 1), fmt(r.send_rate, 0),
                         ",".join(f"{v:.0f}" for v in r.cpu.values()),
                         f"{r.kinds.get('placement.decided', 0)}/"
                         f"{r.kinds.get('placement.rejected', 0)}"))
        table(rate_rows, "      ")
        print(f"   fixed rate, p50 ms per {latency.WINDOW_S:g} s of sends (warm-up first):")
        for name, _, _ in checkouts:
            r = results[name].get("rate")
            if r is not None:
                print(f"      {name}: " + " ".join(f"{x:g}" for x in r.p50_by_window_ms))


def part_d(args: argparse.Namespace) -> None:
    print(f"== d. the daemon on the sim ({args.regions_per_cloud} regions/cloud, seed "
          f"{args.sim_seed}), this checkout (its default placement settings: batches of "
          f"up to 256 gathered for 5 ms, the MILP for those of up to 200 for 0.1 s; and "
          f"with the heuristic only) next to the skeleton ({args.skeleton_commit})")
    workdir = Path(tempfile.mkdtemp(prefix="gpubroker-bench-placement-"))
    try:
        with skeleton_checkout(args.skeleton, args.skeleton_commit) as skel:
            checkouts: list[Checkout] = [
                (f"skeleton {args.skeleton_commit}", skel, ""),
                ("this checkout", ROOT, ""),
                ("this, heuristic only", ROOT, "placement: {exact_max_batch: 0}\n")]
            for name, root, extra in checkouts:
                print(f"   {name}: {root} (broker from {imports_from(root)})"
                      + (f"; config + {extra.strip()}" if extra else ""))
            asyncio.run(part_d_async(args, checkouts, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# --------------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", nargs="+", choices="abcd", default=list("abcd"))
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="part a (1 2 3)")
    p.add_argument("--a-requests", type=int, default=1000)
    p.add_argument("--a-offers", type=int, default=5000)
    p.add_argument("--milp-seconds", type=float, default=60.0,
                   help="the MILP's exact_time_limit (60)")
    p.add_argument("--milp-wall", type=float, default=900.0,
                   help="stop a MILP run that has not answered after this long (900)")
    p.add_argument("--b-requests", type=int, default=10_000)
    p.add_argument("--b-offers", type=int, default=50_000)
    p.add_argument("--b-seed", type=int, default=1)
    p.add_argument("--runs", type=int, default=3, help="heuristic runs in part b/c (3)")
    p.add_argument("--lp-seconds", type=float, default=1800.0,
                   help="column generation stops after this long (1800)")
    p.add_argument("--bound", choices=("class", "solver"), default="class",
                   help="part b: the LP bound from the bench's class LP (default), or from "
                        "the solver's own LP (one column per request and option: out of "
                        "memory at 10,000 x 50,000 on 23 GB)")
    p.add_argument("--profile", action="store_true", help="part b: cProfile the heuristic")
    p.add_argument("--no-ablation", action="store_true",
                   help="part b: skip the table of features that make the gap")
    p.add_argument("--ab-requests", type=int, default=1000)
    p.add_argument("--ab-offers", type=int, default=5000)
    p.add_argument("--burst", type=int, default=5000, help="part d: requests in the burst")
    p.add_argument("--rate", type=float, default=500.0,
                   help="part d: fixed-rate load, requests/s (0 skips it)")
    p.add_argument("--duration", type=float, default=15.0,
                   help="part d: measured seconds of the fixed-rate load (15)")
    p.add_argument("--warmup", type=float, default=5.0,
                   help="part d: seconds of load before the measured window (5)")
    p.add_argument("--regions-per-cloud", type=int, default=88,
                   help="part d: sim regions per cloud (88: about 20,000 offers)")
    p.add_argument("--sim-seed", type=int, default=7)
    p.add_argument("--skeleton", type=Path, default=None,
                   help="part d: an existing checkout of the skeleton (default: a "
                        "temporary git worktree of --skeleton-commit)")
    p.add_argument("--skeleton-commit", default=SKELETON)
    args = p.parse_args(argv)
    if args.quick:
        args.seeds = args.seeds[:1]
        args.a_requests, args.a_offers, args.milp_seconds = 100, 500, 10.0
        args.milp_wall = 120.0
        args.b_requests, args.b_offers, args.runs = 1000, 5000, 2
        args.ab_requests, args.ab_offers = 200, 1000
        args.lp_seconds = 60.0
        args.burst, args.rate, args.duration, args.warmup = 500, 200.0, 3.0, 1.0
        args.regions_per_cloud = 20
    args.d_poll_interval = max(600.0, 3 * (args.warmup + args.duration) + 60)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    parts = set(args.part)
    print("placement bench: " + " ".join(shlex.quote(a) for a in
                                         [sys.executable, *sys.argv]))
    sources = sorted((ROOT / "broker" / "placement").glob("*.py"))
    digest = hashlib.sha1(b"".join(f.name.encode() + f.read_bytes() for f in sources))
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {load()}; "
          f"snapshot {inst_mod.DATA_DIR}; sources: broker/placement ({len(sources)} files) "
          f"{digest.hexdigest()[:10]}")
    started = time.perf_counter()
    if "a" in parts:
        part_a(args)
    if parts & {"b", "c"}:
        part_b(args, parts)
    if "d" in parts:
        part_d(args)
    print(f"placement bench: done in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
