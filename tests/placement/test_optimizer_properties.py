"""Properties of `broker.placement.optimizer.solve` on random small pools and batches, for both
solvers: whatever the pool and the policy, no decision breaks a constraint, the MILP
is never worse than the heuristic, and an answer that says it is optimal is.

Each check is written out here from the constraint's definition, not from the
optimizer's bookkeeping: capacity less what the broker holds, quota per pool or per
quota group (in the group's own units), the team's GPUs, budget and spread limits
counting what it holds already, the price cap, and the policy's models, markets and
clouds.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections import defaultdict
from collections.abc import Hashable
from dataclasses import dataclass, replace

import pytest
from factories import T0, offer, pool_of, request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.market.pool import ResourcePool
from broker.model import Market, Offer, PlaceRequest
from broker.placement.optimizer import (
    Ask,
    BatchResult,
    BatchSettings,
    CandidateBuilder,
    Decision,
    Rejection,
    solve,
)
from policies.evaluate import Constraints, Denied, TeamUsage, evaluate
from policies.model import Clouds, Gpus, Policy, Scoring, Team

# Hypothesis's pytest plugin imports this module (and through it libcst, which warns of a
# deprecation) only when a test fails; under `filterwarnings = error` that turns a
# readable failure into an INTERNALERROR. Import it now, quietly.
with contextlib.suppress(ImportError), warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import hypothesis.extra._patching  # noqa: F401

TOL = 1e-6
HEURISTIC = BatchSettings(exact_max_batch=0)
MILP = BatchSettings(exact_max_batch=1000, exact_time_limit=5)
FAST = settings(max_examples=60, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])

ZONES = [("aws", "us-east-1", "us-east-1a"), ("aws", "us-east-1", "us-east-1b"),
         ("gcp", "us-central1", "us-central1-a")]
MODELS = ["H100-80GB", "A100-80GB"]
GROUP_UNITS = {1: 8, 2: 16, 4: 16, 8: 16}  # quota units (vCPUs) per instance, by GPUs


# --- the world --------------------------------------------------------------------------


@dataclass
class World:
    offers: list[Offer]
    held: dict[int, int]  # offer index -> instances the broker's leases hold
    group_quota: dict[str, int]  # quota group -> headroom in its units
    policy: Policy
    usage: dict[str, TeamUsage]
    requests: list[PlaceRequest]

    def pool(self) -> ResourcePool:
        pool = pool_of(self.offers)
        for i, n in self.held.items():
            pool.hold(self.offers[i].pool, n)
        return pool

    def constraints(self, req: PlaceRequest) -> Constraints | Denied:
        return evaluate(self.policy, req, self.usage.get(req.team or ""))

    def asks(self) -> list[Ask]:
        """As the broker builds them: a team's requests carry its current usage."""
        return [self.ask(req) for req in self.requests]

    def ask(self, req: PlaceRequest) -> Ask:
        c = self.constraints(req)
        return Ask(req) if isinstance(c, Denied) else Ask(req, constraints=c)


@st.composite
def offers_(draw: st.DrawFn) -> tuple[list[Offer], dict[str, int]]:
    n = draw(st.integers(2, 7))
    group_quota = {g: draw(st.sampled_from([0, 16, 32, 64, 128])) for g in ("g1", "g2")}
    out = []
    for i in range(n):
        cloud, region, zone = ZONES[draw(st.integers(0, 2))]
        gpus = draw(st.sampled_from([1, 2, 4, 8, 8]))
        o = offer(zone, cloud=cloud, region=region, instance_type=f"i{i}.{gpus}x",
                  market=draw(st.sampled_from(list(Market))), gpu=draw(st.sampled_from(MODELS)),
                  gpus=gpus, price=gpus * draw(st.sampled_from([1.0, 1.5, 2.0, 2.5, 3.0, 4.0])),
                  availability=draw(st.sampled_from([None, 0.5, 1.0])),
                  capacity=draw(st.sampled_from([None, None, 0, 1, 1, 2, 3, 8])),
                  interruption_rate=draw(st.sampled_from([None, 0.0, 0.3])))
        quota = draw(st.sampled_from(["none", "none", "own", "g1", "g2"]))
        if quota == "own":
            o = replace(o, quota_headroom=draw(st.sampled_from([0, 8, 16, 32])))
        elif quota != "none":
            # The cloud's quota is in units (vCPUs); the offer's headroom in GPUs is how
            # many whole instances fit, times GPUs per instance.
            units = GROUP_UNITS[gpus]
            o = replace(o, quota_group=quota, quota_units=units,
                        quota_headroom=group_quota[quota] // units * gpus)
        out.append(o)
    return out, group_quota


def within_spread(team: Team, usage: TeamUsage) -> bool:
    """Whether what a team holds is within its spread limits already (a team over them
    is test_solver's `test_a_team_already_over_its_share_*` case)."""
    total = usage.gpus
    by_cloud: dict[str, int] = defaultdict(int)
    for (cloud, _), n in usage.gpus_by_zone.items():
        by_cloud[cloud] += n
    grace = team.spread_grace_gpus
    return not (
        (team.max_zone_share is not None and any(
            n > team.max_zone_share * total + grace for n in usage.gpus_by_zone.values()))
        or (team.max_cloud_share is not None and any(
            n > team.max_cloud_share * total + grace for n in by_cloud.values())))


@st.composite
def worlds(draw: st.DrawFn, max_requests: int = 5, split: bool = False) -> World:
    offers, group_quota = draw(offers_())
    held = {i: draw(st.integers(1, 2)) for i, o in enumerate(offers)
            if o.capacity and draw(st.booleans())}
    teams: dict[str, Team] = {}
    usage: dict[str, TeamUsage] = {}
    for name in ("t1", "t2"):
        team = Team(max_gpus=draw(st.sampled_from([None, 8, 16, 32])),
                    budget_per_hour=draw(st.sampled_from([None, 20.0, 40.0, 80.0])),
                    max_zone_share=draw(st.sampled_from([None, 0.5, 0.75])),
                    max_cloud_share=draw(st.sampled_from([None, 0.6])),
                    spread_grace_gpus=draw(st.sampled_from([0, 4, 8])))
        by_zone = {ZONES[z][::2]: n for z, n in draw(st.dictionaries(
            st.integers(0, 2), st.sampled_from([4, 8]), max_size=2)).items()}
        u = TeamUsage(gpus=sum(by_zone.values()),
                      price_per_hour=draw(st.sampled_from([0.0, 5.0])) if by_zone else 0.0,
                      gpus_by_zone=by_zone)
        if not within_spread(team, u):
            u = TeamUsage()
        teams[name], usage[name] = team, u
    policy = Policy(
        teams=teams,
        gpus=draw(st.sampled_from([Gpus(), Gpus(equivalent={"A100-80GB": ["H100-80GB"]})])),
        clouds=draw(st.sampled_from([Clouds(), Clouds(), Clouds(deny=["gcp"])])),
        scoring=Scoring(idle_gpu_weight=draw(st.sampled_from([0.0, 0.5])),
                        spread_weight=draw(st.sampled_from([0.0, 0.0, 0.5])),
                        restart_hours=draw(st.sampled_from([0.0, 1.0]))))
    requests: list[PlaceRequest] = []
    for i in range(draw(st.integers(1, max_requests))):
        parts = draw(st.sampled_from([1, 1, 1, 2, 3])) if split else 1
        requests.append(request(
            f"r{i}", gang=parts == 1, max_parts=parts,
            gpu=draw(st.sampled_from([["H100-80GB"], ["A100-80GB"], MODELS, MODELS])),
            gpus=draw(st.sampled_from([1, 2, 4, 6, 8, 8, 8, 16])),
            market=draw(st.sampled_from([None, None, "spot", "on_demand", "any"])),
            max_price_per_gpu_hour=draw(st.sampled_from([None, None, None, 2.0, 3.0])),
            clouds=draw(st.sampled_from([None, None, ("aws",)])),
            team=draw(st.sampled_from([None, "t1", "t2"])),
            duration_hours=draw(st.sampled_from([None, 1.0, 4.0]))))
    world = World(offers, held, group_quota, policy, usage, requests)
    # A request its team's usage alone denies (max_gpus) never reaches placement.
    world.requests = [r for r in requests if not (
        isinstance(world.constraints(r), Denied) and
        not isinstance(evaluate(policy, r), Denied))]
    return world


# --- what every answer must satisfy ----------------------------------------------------


def check_constraints(w: World, result: BatchResult, *, bound: bool = True) -> None:
    """Every decision is allowed, all of them together fit in every limit, and (with
    `bound`) the result's lower bound is one."""
    assert [o.ask.request for o in result.outcomes] == w.requests
    by_pool: dict[int, int] = defaultdict(int)
    offers = {o.pool: i for i, o in enumerate(w.offers)}
    for out in result.outcomes:
        req = out.ask.request
        c = w.constraints(req)
        if isinstance(c, Denied):
            assert isinstance(out, Rejection) and out.code is c.code
            continue
        if not isinstance(out, Decision):
            continue
        # A split (gang false, max_parts): its parts hold the request's GPUs, in at most
        # max_parts distinct pools; each part is checked as a placement of its own GPUs.
        parts = out.parts or ((out.placement, req.gpus),)
        assert len(parts) <= req.max_parts and sum(g for _, g in parts) == req.gpus
        assert out.placement == parts[0][0]
        assert len({p.pool for p, _ in parts}) == len(parts)
        for p, gpus in parts:
            i = offers[p.pool]
            o = w.offers[i]
            by_pool[i] += p.instances
            # The policy's and the request's own filters.
            assert p.gpu == o.gpu and p.gpu in c.gpus
            assert p.gpu in {*req.gpu, *(e for g in req.gpu
                                         for e in w.policy.gpus.equivalent.get(g, ()))}
            assert p.pool.market in c.markets
            assert c.region_ok(p.pool.cloud, p.pool.region)
            assert not req.clouds or p.pool.cloud in req.clouds
            if c.cap is not None:
                assert o.price_per_gpu_hour is not None and \
                    o.price_per_gpu_hour <= c.cap + TOL
            # Whole instances, enough GPUs: no more instances than needed.
            assert p.instances == -(-gpus // o.gpus)
            assert p.price_per_hour == pytest.approx(p.instances * (o.price_per_hour or 0))
    # Capacity less what the broker holds; quota per pool and per group.
    group_used: dict[str, int] = defaultdict(int)
    for i, n in by_pool.items():
        o = w.offers[i]
        if o.capacity is not None:
            assert n <= o.capacity - w.held.get(i, 0), o.pool
        if o.quota_group is not None:
            assert o.quota_units is not None
            group_used[o.quota_group] += n * o.quota_units
        elif o.quota_headroom is not None:
            assert n * o.gpus <= o.quota_headroom, o.pool
    for g, used in group_used.items():
        assert used <= w.group_quota[g], g
    # The teams' limits, counting what they hold already.
    for name, team in w.policy.teams.items():
        mine = [p for out in result.outcomes
                if isinstance(out, Decision) and out.ask.request.team == name
                for p, _ in (out.parts or ((out.placement, 0),))]
        if not mine:
            continue
        u = w.usage[name]
        added = sum(p.total_gpus for p in mine)
        total = u.gpus + added
        if team.max_gpus is not None:
            assert total <= team.max_gpus, name
        if team.budget_per_hour is not None:
            assert u.price_per_hour + sum(p.price_per_hour for p in mine) <= \
                team.budget_per_hour + TOL, name
        grace = team.spread_grace_gpus
        zone_add: dict[tuple[str, str], int] = defaultdict(int)
        cloud_add: dict[str, int] = defaultdict(int)
        for p in mine:
            zone_add[(p.pool.cloud, p.pool.zone)] += p.total_gpus
            cloud_add[p.pool.cloud] += p.total_gpus
        if team.max_zone_share is not None:
            for z, n in zone_add.items():
                assert u.gpus_by_zone.get(z, 0) + n <= \
                    team.max_zone_share * total + grace + TOL, (name, z)
        if team.max_cloud_share is not None:
            held_in = defaultdict(int)
            for (cloud, _), n in u.gpus_by_zone.items():
                held_in[cloud] += n
            for cloud, n in cloud_add.items():
                assert held_in[cloud] + n <= team.max_cloud_share * total + grace + TOL, \
                    (name, cloud)
    if bound:
        assert result.bound <= result.objective + TOL * max(1.0, result.objective)


# --- brute force over placements ------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    offer: int
    instances: int
    cost: float  # over the request's horizon
    uses: tuple[tuple[Hashable, float], ...]
    gpus: int
    price: float
    zone: tuple[str, str]


def choices(w: World, req: PlaceRequest) -> list[Choice]:
    """Every placement of `req` that it alone may take, with its cost from the
    documented formula: instances × price × (1 + restart_hours × instances ×
    interruption rate (spot) +
    availability_weight × (1 − availability) + spread_weight × the team's share in the
    zone), plus GPUs × interruption_cost_per_gpu × instances × interruption rate (spot),
    plus idle_gpu_weight × the idle GPUs' price, times the horizon."""
    c = w.constraints(req)
    if isinstance(c, Denied):
        return []
    s = w.policy.scoring
    u = w.usage.get(req.team or "") if c.team else None
    out = []
    for i, o in enumerate(w.offers):
        k = o.pool
        if o.gpu not in c.gpus or k.market not in c.markets or \
                not c.region_ok(k.cloud, k.region) or (req.clouds and k.cloud not in req.clouds):
            continue
        assert o.price_per_hour is not None
        ppg = o.price_per_hour / o.gpus
        if c.cap is not None and ppg > c.cap:
            continue
        n = -(-req.gpus // o.gpus)
        if o.capacity is not None and o.capacity - w.held.get(i, 0) < n:
            continue
        if o.quota_headroom is not None and o.quota_headroom < n * o.gpus:
            continue
        price = n * o.price_per_hour
        rate = 0.0
        if k.market is Market.SPOT:
            rate = o.interruption_rate if o.interruption_rate is not None \
                else s.unknown_interruption_rate
            rate *= n  # a gang of n instances is interrupted when any of them is
        avail = o.availability if o.availability is not None else s.unknown_availability
        share = 0.0
        if u is not None and u.gpus and s.spread_weight:
            share = u.gpus_by_zone.get((k.cloud, k.zone), 0) / u.gpus
        cost = price * (1 + s.restart_hours * rate + s.availability_weight * (1 - avail)
                        + s.spread_weight * share)
        cost += n * o.gpus * s.interruption_cost_per_gpu * rate
        cost += s.idle_gpu_weight * (n * o.gpus - req.gpus) * ppg
        uses: list[tuple[Hashable, float]] = [(("pool", i), n)]
        if o.quota_group is not None:
            uses.append((("group", o.quota_group), n * (o.quota_units or 0)))
        elif o.quota_headroom is not None:
            uses.append((("quota", i), n * o.gpus))
        out.append(Choice(i, n, (req.duration_hours or 1.0) * cost, tuple(uses),
                          n * o.gpus, price, (k.cloud, k.zone)))
    return out


def feasible(w: World, picks: list[tuple[PlaceRequest, Choice]], *, spread: bool = True
             ) -> bool:
    """Whether the placements fit together; the spread limit (a share of the total
    after the batch: adding elsewhere can make a zone fit again) only with `spread`."""
    used: dict[Hashable, float] = defaultdict(float)
    for _, ch in picks:
        for key, n in ch.uses:
            used[key] += n
    for (kind, what), n in used.items():
        o = w.offers[what] if kind != "group" else None
        limit = (w.group_quota[what] if o is None else
                 o.capacity - w.held.get(what, 0) if kind == "pool" and o.capacity is not None
                 else o.quota_headroom if kind == "quota" else None)
        if limit is not None and n > limit:
            return False
    for name, team in w.policy.teams.items():
        mine = [ch for req, ch in picks if req.team == name]
        if not mine:
            continue
        u = w.usage[name]
        total = u.gpus + sum(ch.gpus for ch in mine)
        if team.max_gpus is not None and total > team.max_gpus:
            return False
        if team.budget_per_hour is not None and \
                u.price_per_hour + sum(ch.price for ch in mine) > team.budget_per_hour + TOL:
            return False
        if not spread:
            continue
        grace = team.spread_grace_gpus
        zone_add: dict[tuple[str, str], int] = defaultdict(int)
        cloud_add: dict[str, int] = defaultdict(int)
        for ch in mine:
            zone_add[ch.zone] += ch.gpus
            cloud_add[ch.zone[0]] += ch.gpus
        held_in: dict[str, int] = defaultdict(int)
        for (cloud, _), n in u.gpus_by_zone.items():
            held_in[cloud] += n
        if team.max_zone_share is not None and any(
                u.gpus_by_zone.get(z, 0) + n > team.max_zone_share * total + grace + TOL
                for z, n in zone_add.items()):
            return False
        if team.max_cloud_share is not None and any(
                held_in[cl] + n > team.max_cloud_share * total + grace + TOL
                for cl, n in cloud_add.items()):
            return False
    return True


def check_optimal(w: World, result: BatchResult) -> None:
    """An answer that says it is optimal: (1) places the requests it places as cheaply
    as any feasible assignment placing the same ones, and (2) no feasible assignment
    places more of them for no more in total. Both hold whatever the penalty for an
    unplaced request is, as long as it is positive."""
    reqs = [out.ask.request for out in result.outcomes]
    opts = [choices(w, r) for r in reqs]
    placed = {n for n, out in enumerate(result.outcomes) if isinstance(out, Decision)}
    cost = 0.0
    for n in placed:
        out = result.outcomes[n]
        assert isinstance(out, Decision)
        [mine] = [ch for ch in opts[n] if w.offers[ch.offer].pool == out.placement.pool]
        assert out.expected_cost_per_hour * (reqs[n].duration_hours or 1.0) == \
            pytest.approx(mine.cost)
        cost += mine.cost
    same = math.inf
    more: list[tuple[set[int], float]] = []

    def walk(n: int, picks: list[tuple[PlaceRequest, Choice]], on: set[int], total: float
             ) -> None:
        nonlocal same
        if not feasible(w, picks, spread=False):
            return  # pools, quotas, team GPUs and budget only fill up: cut here
        if n == len(reqs):
            if not feasible(w, picks):
                return
            if on == placed:
                same = min(same, total)
            elif on > placed and total <= cost + TOL:
                more.append((set(on), total))
            return
        walk(n + 1, picks, on, total)
        for ch in opts[n]:
            walk(n + 1, [*picks, (reqs[n], ch)], on | {n}, total + ch.cost)

    walk(0, [], set(), 0.0)
    assert cost == pytest.approx(same, abs=TOL), "a cheaper way to place the same requests"
    assert not more, f"places more for no more: {more}"


# --- the properties ----------------------------------------------------------------------


# Small batches read the pool's price index; large ones (`index_min_batch`) stream
# options from an index by expected cost, built per batch: both ways, on small batches;
# and the latter with one option listed up front, so that lists grow as they run out.
PATHS = pytest.mark.parametrize(
    "path", [{}, {"index_min_batch": 1}, {"index_min_batch": 1, "candidates": 1}],
    ids=["plain", "indexed", "indexed-short"])


@PATHS
@FAST
@given(w=worlds())
def test_both_solvers_keep_every_constraint_and_the_milp_is_never_worse(
        path: dict[str, int], w: World) -> None:
    h = solve(w.asks(), w.pool(), w.policy, now=T0, settings=replace(HEURISTIC, **path))
    check_constraints(w, h)
    m = solve(w.asks(), w.pool(), w.policy, now=T0, settings=replace(MILP, **path))
    check_constraints(w, m)
    assert m.objective <= h.objective + TOL * max(1.0, h.objective)
    assert m.bound <= h.objective + TOL * max(1.0, h.objective)
    # What the policy alone denies is rejected the same way by both.
    for a, b in zip(h.outcomes, m.outcomes, strict=True):
        if isinstance(w.constraints(a.ask.request), Denied):
            assert isinstance(a, Rejection) and isinstance(b, Rejection)
            assert (a.code, a.detail) == (b.code, b.detail)


@PATHS
@FAST
@given(w=worlds(max_requests=4))
def test_an_answer_that_says_optimal_is_optimal(path: dict[str, int], w: World) -> None:
    for s in (HEURISTIC, MILP):
        result = solve(w.asks(), w.pool(), w.policy, now=T0, settings=replace(s, **path))
        if result.optimal:
            check_optimal(w, result)
    # With the MILP and time enough, small batches are solved to optimality.
    assert result.optimal


@FAST
@given(worlds(max_requests=3))
def test_a_request_alone_gets_its_cheapest_placement(w: World) -> None:
    """Without other requests to share with, the decision is the cheapest placement the
    request may take (or a rejection when there is none)."""
    for req in w.requests:
        [out] = solve([w.ask(req)], w.pool(), w.policy, now=T0, settings=MILP).outcomes
        options = [ch for ch in choices(w, req) if feasible(w, [(req, ch)])]
        if not options:
            assert isinstance(out, Rejection)
            continue
        assert isinstance(out, Decision), out
        best = min(ch.cost for ch in options)
        assert out.expected_cost_per_hour * (req.duration_hours or 1.0) == \
            pytest.approx(best)


@PATHS
@FAST
@given(w=worlds(split=True))
def test_splits_keep_every_constraint(path: dict[str, int], w: World) -> None:
    """Requests that may be split (gang false, max_parts 2–3) among others: every part
    and all of them together keep every limit, for both solvers."""
    for s in (HEURISTIC, MILP):
        check_constraints(w, solve(w.asks(), w.pool(), w.policy, now=T0,
                                   settings=replace(s, **path)), bound=False)


def listed(builder: CandidateBuilder, w: World, req: PlaceRequest
           ) -> list[tuple[object, int, float]] | None:
    """Every option the builder lists for the request (grown to the end): pool, instances
    and expected cost per hour, in order; None when it has none."""
    c = w.constraints(req)
    assert not isinstance(c, Denied)
    r, _ = builder.request(w.ask(req), c)
    if r is None:
        return None
    r.group.grow()
    return [(o.ref[0].pool, o.ref[1], o.cost_per_hour) for o in r.options]


@FAST
@given(w=worlds())
def test_a_large_batchs_lists_are_those_of_each_request_alone(w: World) -> None:
    """On the offer arrays, requests share rules' masks, and their product, across the
    batch; what each request lists is what it lists in a batch of its own. Each request
    comes with variants that ask for the same but in other clouds or under other caps
    (lists of their own that share masks)."""
    reqs = [v for r in w.requests for v in (
        r, replace(r, request_id=f"{r.request_id}-aws", clouds=("aws",)),
        replace(r, request_id=f"{r.request_id}-gcp", clouds=("gcp",)),
        replace(r, request_id=f"{r.request_id}-cap", max_price_per_gpu_hour=2.0))
        if not isinstance(w.constraints(v), Denied)]
    pool = w.pool()
    batch = CandidateBuilder(pool, w.policy, T0, 1, indexed=True)
    together = [listed(batch, w, r) for r in reqs]
    alone = [listed(CandidateBuilder(pool, w.policy, T0, 1, indexed=True), w, r) for r in reqs]
    assert together == alone
