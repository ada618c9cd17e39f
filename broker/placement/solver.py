"""The assignment problem behind placement, and its two solvers.

A batch of requests is a generalised assignment problem: each request takes one of its
options (a pool and a number of instances) or stays unplaced; options use up shared
resources (a pool's free instances, a quota group's headroom, a team's GPUs and budget)
and a team's GPUs may not crowd into one zone or cloud beyond a share (the spread limit).
Minimise the options' costs plus a penalty for every request left unplaced; the penalty
is larger than any option of that request, so the solvers place as much as they can first
and then place it as cheaply as they can.

* `heuristic` — regret-based greedy (the request that would lose most by waiting goes
  first; ties by arrival order, so nothing starves behind later requests; the requests
  of a team short of GPUs or budget for the batch go before all others, most valuable
  per GPU or $ first) plus local improvement (move a request to a cheaper option that
  has become free; re-try unplaced requests, making room by moving the placed requests
  in their way; in a team short of GPUs or budget, swap its least valuable placed
  requests for a more valuable unplaced one). Linear-ish in the number of requests;
  used for every batch.
* `exact` — the mixed-integer program solved by HiGHS (highspy, its Python interface), with a
  time limit. Its LP relaxation is solved first by column generation over each request's
  options (cheapest first) until no left-out option could lower it: a valid lower bound
  for the whole problem, not only for the options looked at. Options whose reduced cost
  exceeds the gap between the heuristic's answer and that bound cannot be in a better
  solution; the MILP gets every other option, so an optimal MILP answer is the optimum.

Pure and synchronous; it knows nothing of clouds. `broker.placement.optimizer` builds problems
from the pool and the policy and turns solutions into decisions.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

EPS = 1e-9
PRICE_STEP = 64
"""Options a column-generation round lists at most per group (`_price_out`)."""


@dataclass(frozen=True, slots=True)
class Option:
    """One way to place a request: `uses` amounts of shared resources, `gpus` GPUs
    (the team's count and spread), `price` per hour (the team's budget), in `zone` of
    `cloud`. `cost_per_hour` is the expected cost per hour; a request's cost for the
    option is that times the request's horizon. `ref` is the caller's (offer, instances)."""

    cost_per_hour: float
    uses: tuple[tuple[Hashable, float], ...]
    gpus: int
    price: float
    cloud: str
    zone: str
    ref: Any = None
    owned: int = 0  # of its GPUs, those on paid-for capacity (the team's private_share)


Alive = Callable[[Option], bool]
More = Callable[[int | None, float | None, Alive | None], tuple[list[Option], float]]
"""`more(k, below, alive)`: the cheapest `k` options that are `alive` (or all cheaper
than `below` per hour), cheapest first, and the cost per hour below which that list
holds every option that is alive (`math.inf` when it holds them all)."""


@dataclass(slots=True, eq=False)
class Group:
    """Options shared by the requests that ask for the same thing, cheapest first.
    Every option cheaper per hour than `upto` is listed; `more` lists further ones.
    `dead` is the heuristic's cursor: options before it use a resource already used up
    (resources only shrink while it places, so they stay dead). `unlisted_price` is
    kept by the owner of `more`: no option not listed yet has a lower price per hour
    (0 when it cannot tell)."""

    options: list[Option]
    upto: float = math.inf
    more: More | None = None
    dead: int = 0
    filtered: bool = False  # grown with the heuristic's `alive` filter
    unlisted_price: float = 0.0
    _lowest: list[float] = field(default_factory=list)  # price_floor per listed option
    _lowest_of: list[Option] | None = None  # the options `_lowest` is for

    @property
    def complete(self) -> bool:
        return self.upto == math.inf

    def price_floor(self, j: int = 0) -> float:
        """No option from the `j`-th listed on, nor any not listed yet, has a lower price
        per hour than this (a team's budget rules them all out below it)."""
        if self._lowest_of is not self.options:
            self._lowest = list(accumulate(reversed([o.price for o in self.options]), min))
            self._lowest.reverse()
            self._lowest_of = self.options
        low = self._lowest[j] if j < len(self._lowest) else math.inf
        return low if self.complete else min(low, self.unlisted_price)

    def grow(self, *, k: int | None = None, below: float | None = None,
             alive: Alive | None = None) -> bool:
        """List more options (the cheapest `k` that are `alive`, or all under `below`);
        True if any. Options left out as not alive must stay dead for good."""
        if self.complete or self.more is None:
            return False
        before = self.options
        options, upto = self.more(k, below, alive)
        # A longer list has a new option; one as long or shorter may too (`more` may
        # leave out listed options that are used up).
        grew = len(options) > len(before) or bool(set(map(id, options)) - set(map(id, before)))
        self.options, self.upto, self.dead = options, max(upto, self.upto), 0
        self.filtered = self.filtered or alive is not None
        return grew

    def unfilter(self) -> None:
        """List again, without the heuristic's filter, every option under `upto`: the
        LP needs them all (what the heuristic used up is free at the batch's start)."""
        if self.filtered and self.more is not None:
            self.options, _ = self.more(None, self.upto, None)
            self.dead, self.filtered = 0, False


@dataclass(slots=True)
class Request:
    """A request of the batch: its `group` of options, the `horizon` (hours) its cost
    counts for, and the `penalty` for leaving it unplaced. `extra` adds a per-option
    cost per hour (the soft spread term); the group is then the request's own, sorted
    by cost_per_hour + extra."""

    group: Group
    horizon: float
    penalty: float
    team: str | None = None
    extra: Callable[[Option], float] | None = None
    min_gpus: int = 0  # no option has fewer GPUs (the request's count)

    @property
    def options(self) -> list[Option]:
        return self.group.options

    def cost(self, o: Option) -> float:
        if self.extra is None:
            return self.horizon * o.cost_per_hour
        return self.horizon * (o.cost_per_hour + self.extra(o))


@dataclass(slots=True)
class Team:
    """What a team may still take in this batch. Shares are of the team's GPUs after the
    batch; `grace` GPUs may sit in one zone or cloud whatever the share."""

    gpus_left: float | None = None
    budget_left: float | None = None
    zone_share: float | None = None
    cloud_share: float | None = None
    grace: int = 0
    total: int = 0
    by_zone: dict[tuple[str, str], int] = field(default_factory=dict)
    by_cloud: dict[str, int] = field(default_factory=dict)
    owned_left: float | None = None  # paid-for GPUs it may still take (private_share)

    @property
    def spreads(self) -> bool:
        return self.zone_share is not None or self.cloud_share is not None


@dataclass(slots=True)
class Problem:
    requests: list[Request]
    limits: dict[Hashable, float]  # resource -> what is left of it; absent = unlimited
    teams: dict[str, Team] = field(default_factory=dict)
    live: dict[Hashable, float] | None = None
    """While the heuristic's greedy phase runs, what is left of each resource (it only
    shrinks then), so that option lists being read can skip what is used up."""

    def option_cost(self, i: int, o: Option) -> float:
        return self.requests[i].cost(o)


@dataclass(slots=True)
class Solution:
    """`choice[i]` is the request's option or None (unplaced). `bound` is a lower bound
    on the objective (the sum of every request's cheapest option when nothing better is
    known). `optimal` is True when the objective is proven to equal the optimum."""

    choice: list[Option | None]
    objective: float
    bound: float
    solver: str
    seconds: float
    optimal: bool = False
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def gap(self) -> float:
        """(objective − bound) / bound: how far from optimal the answer may be at most."""
        if self.bound <= 0:
            return 0.0 if self.objective <= EPS else math.inf
        return max(0.0, (self.objective - self.bound) / self.bound)


# --- state shared by the heuristic's phases ------------------------------------------


class State:
    """Residual resources and team tallies for one candidate solution."""

    __slots__ = ("choice", "left", "p", "teams")

    def __init__(self, p: Problem) -> None:
        self.p = p
        self.left = dict(p.limits)
        self.teams = {name: Team(t.gpus_left, t.budget_left, t.zone_share, t.cloud_share,
                                 t.grace, t.total, dict(t.by_zone), dict(t.by_cloud),
                                 t.owned_left)
                      for name, t in p.teams.items()}
        self.choice: list[Option | None] = [None] * len(p.requests)

    def global_ok(self, o: Option) -> bool:
        """Shared resources (pools, quotas): they only shrink as requests are placed."""
        left = self.left
        for key, amount in o.uses:
            have = left.get(key)
            if have is None:
                have = self._limit(key)
            if have is not None and have < amount - EPS:
                return False
        return True

    def _limit(self, key: Hashable) -> float | None:
        """A resource first seen after this state was made (the caller lists options,
        and registers their limits, as they are read)."""
        limit = self.p.limits.get(key)
        if limit is not None:
            self.left[key] = limit
        return limit

    def team_ok(self, i: int, o: Option) -> bool:
        return self.team_allows(self.p.requests[i].team, o)

    def team_allows(self, team: str | None, o: Option) -> bool:
        if team is not None:
            t = self.teams.get(team)
            if t is not None:
                if t.gpus_left is not None and t.gpus_left < o.gpus - EPS:
                    return False
                if t.budget_left is not None and t.budget_left < o.price - EPS:
                    return False
                if o.owned and t.owned_left is not None and t.owned_left < o.owned - EPS:
                    return False
        return True

    def fits_static(self, i: int, o: Option) -> bool:
        return self.global_ok(o) and self.team_ok(i, o)

    def fits_spread(self, i: int, o: Option) -> bool:
        return self.spread_allows(self.p.requests[i].team, o)

    def spread_allows(self, team: str | None, o: Option) -> bool:
        t = self.teams.get(team) if team is not None else None
        if t is None or not t.spreads:
            return True
        total = t.total + o.gpus
        if t.zone_share is not None and \
                t.by_zone.get((o.cloud, o.zone), 0) + o.gpus > t.zone_share * total + t.grace + EPS:
            return False
        return not (t.cloud_share is not None and
                    t.by_cloud.get(o.cloud, 0) + o.gpus > t.cloud_share * total + t.grace + EPS)

    def spread_holds(self, team: str | None) -> bool:
        """Whether every zone and cloud of `team` is within its share (after a removal,
        which shrinks the total)."""
        t = self.teams.get(team) if team is not None else None
        if t is None or not t.spreads:
            return True
        if t.zone_share is not None and t.by_zone and \
                max(t.by_zone.values()) > t.zone_share * t.total + t.grace + EPS:
            return False
        return not (t.cloud_share is not None and t.by_cloud and
                    max(t.by_cloud.values()) > t.cloud_share * t.total + t.grace + EPS)

    def fits(self, i: int, o: Option) -> bool:
        return self.fits_static(i, o) and self.fits_spread(i, o)

    def allows(self, team: str | None, o: Option) -> bool:
        """Whether `o` fits what is left, for a request of `team` (any request)."""
        return self.global_ok(o) and self.team_allows(team, o) and self.spread_allows(team, o)

    def room(self, o: Option) -> float:
        """How many times `o`'s use of shared resources fits in what is left (inf: it
        uses none that is limited)."""
        fit = math.inf
        for key, amount in o.uses:
            have = self.left.get(key)
            if have is None:
                have = self._limit(key)
            if have is not None and amount > 0:
                fit = min(fit, math.floor((have + EPS) / amount))
        return fit

    def take(self, i: int, o: Option, sign: int = 1) -> None:
        self.use(self.p.requests[i].team, o, sign)
        self.choice[i] = o if sign > 0 else None

    def use(self, team: str | None, o: Option, sign: int = 1) -> None:
        """Count `o` (sign 1) or no longer count it (-1) against what is left."""
        left = self.left
        for key, amount in o.uses:
            if key in left or self._limit(key) is not None:
                left[key] -= sign * amount
        t = self.teams.get(team) if team is not None else None
        if t is not None:
            if t.gpus_left is not None:
                t.gpus_left -= sign * o.gpus
            if t.budget_left is not None:
                t.budget_left -= sign * o.price
            if t.owned_left is not None:
                t.owned_left -= sign * o.owned
            t.total += sign * o.gpus
            zk = (o.cloud, o.zone)
            t.by_zone[zk] = t.by_zone.get(zk, 0) + sign * o.gpus
            t.by_cloud[o.cloud] = t.by_cloud.get(o.cloud, 0) + sign * o.gpus

    def objective(self) -> float:
        p = self.p
        return sum(p.requests[i].cost(o) if o is not None else p.requests[i].penalty
                   for i, o in enumerate(self.choice))


def trivial_bound(p: Problem) -> float:
    """Every request at its cheapest option that fits on its own (in the pools, quotas
    and team limits as they are before the batch; its spread limit too when it is
    alone), as if nothing were shared. Options not listed yet cost at least `upto`."""
    st = State(p)
    alone = len(p.requests) == 1
    total = 0.0
    for i, r in enumerate(p.requests):
        best = r.penalty
        for o in r.options:  # cheapest first (with `extra` too)
            if st.fits_static(i, o) and (not alone or st.fits_spread(i, o)):
                best = min(best, r.cost(o))
                break
        else:
            if not r.group.complete:
                best = min(best, r.horizon * r.group.upto)
        total += best
    return total


def why_unplaced(p: Problem, choice: Sequence[Option | None]
                 ) -> dict[int, tuple[str, Hashable | None]]:
    """For each unplaced request with options, what keeps it off its cheapest option
    given the others' choices: ("resource", key), ("team_gpus", GPUs the team has
    left), ("team_budget", budget per hour left), ("team_owned", paid-for GPUs left),
    ("spread", team), or ("penalty", None) when leaving it unplaced was merely
    cheaper."""
    st = State(p)
    for j, o in enumerate(choice):
        if o is not None:
            st.take(j, o)
    out: dict[int, tuple[str, Hashable | None]] = {}
    for i, r in enumerate(p.requests):
        if choice[i] is not None or not r.options:
            continue
        o = min(r.options, key=r.cost)
        out[i] = ("penalty", None)
        for key, amount in o.uses:
            have = st.left.get(key)
            if have is not None and have < amount - EPS:
                out[i] = ("resource", key)
                break
        else:
            t = st.teams.get(r.team) if r.team is not None else None
            if t is not None:
                if t.gpus_left is not None and t.gpus_left < o.gpus - EPS:
                    out[i] = ("team_gpus", t.gpus_left)
                elif t.budget_left is not None and t.budget_left < o.price - EPS:
                    out[i] = ("team_budget", t.budget_left)
                elif o.owned and t.owned_left is not None and t.owned_left < o.owned - EPS:
                    out[i] = ("team_owned", t.owned_left)
                elif not st.fits_spread(i, o):
                    out[i] = ("spread", r.team)
    return out


# --- the heuristic ----------------------------------------------------------------------


# Complex: hot path (bench/placement.py); split in the package redesign (#28).
def heuristic(p: Problem, *, improve_rounds: int = 2, chains: bool = True,  # noqa: C901
              deadline: float = math.inf) -> Solution:
    """Regret greedy, then local improvement. Never exceeds a resource or a limit.
    `deadline` (a `time.perf_counter()` instant) stops the improvement early: the
    greedy answer is always finished, the improvement only while time is left."""
    started = time.perf_counter()
    bound = trivial_bound(p)  # before lists grow without what this answer used up
    st = State(p)
    reqs = p.requests
    global_ok, team_ok, fits_spread = st.global_ok, st.team_ok, st.fits_spread

    def best_two(i: int) -> tuple[Option | None, float, float]:
        """The request's cheapest option that fits now, its cost, and the cost of the
        next one that fits (or the penalty)."""
        r = reqs[i]
        g = r.group
        t = st.teams.get(r.team) if r.team is not None else None
        budget = t.budget_left if t is not None else None
        if t is not None and t.gpus_left is not None and t.gpus_left < r.min_gpus - EPS:
            return None, r.penalty, r.penalty  # the team has no room for any option
        limited = t is not None and (t.gpus_left is not None or budget is not None
                                     or t.owned_left is not None)
        spread = t is not None and t.spreads
        while True:
            opts = g.options
            n = len(opts)
            k = g.dead
            while k < n and not global_ok(opts[k]):
                k += 1
            g.dead = k
            if budget is not None and budget < g.price_floor(k) - EPS:
                return None, r.penalty, r.penalty  # none left within the team's budget
            first: Option | None = None
            c1 = r.penalty
            for j in range(k, n):
                o = opts[j]
                # The spread limit first: where it binds, it rules out the most.
                if (spread and not fits_spread(i, o)) or (j > k and not global_ok(o)) or \
                        (limited and not team_ok(i, o)):
                    if budget is not None and budget < o.price - EPS and \
                            budget < g.price_floor(j) - EPS:
                        # Nothing from here on, listed or not, is within the budget.
                        return first, c1, r.penalty
                    continue
                c = r.cost(o)
                if first is None:
                    first, c1 = o, c
                else:
                    return first, c1, min(c, r.penalty)
            if g.complete:
                return first, c1, r.penalty
            if first is not None:  # the next, unlisted option costs at least the last
                return first, c1, min(max(c1, r.cost(opts[-1])), r.penalty)
            # The listed options are used up: list more (for the whole group).
            if not g.grow(k=max(32, 4 * n), alive=global_ok):
                return None, r.penalty, r.penalty

    p.live = st.left
    short = _short_teams(p)
    heap: list[tuple[int, float, int]] = []
    for i in range(len(reqs)):
        first, c1, c2 = best_two(i)
        if first is not None:
            heap.append(_greedy_key(reqs[i], i, first, c1, c2, short))
    heapq.heapify(heap)
    while heap:
        i = heapq.heappop(heap)[2]
        first, c1, c2 = best_two(i)
        if first is None:
            continue
        key = _greedy_key(reqs[i], i, first, c1, c2, short)
        if heap and key > heap[0]:
            heapq.heappush(heap, key)  # others now stand to lose more: they go first
            continue
        team = reqs[i].team
        if team is not None and short.get(team) is False and len(reqs) > 1:
            first = _thrifty(st, i, first)
        st.take(i, first)
    p.live = None  # from here on resources are freed as well as taken
    _improve(st, rounds=improve_rounds, best_two=best_two, chains=chains,
             deadline=deadline)
    objective = st.objective()
    # A request alone is placed on the first option, in order of cost, that every
    # constraint admits (or on none when none does, the list grown to its end): the
    # optimum, although the trivial bound may lie below it (it ignores team limits).
    alone = len(reqs) == 1
    return Solution(st.choice, objective, bound, "heuristic", time.perf_counter() - started,
                    optimal=alone or objective <= bound + EPS * max(1.0, bound))


def _short_teams(p: Problem) -> dict[str, bool]:
    """Teams whose requests, each at its cheapest option, would need more than the
    team's `gpus_left` (True) or `budget_left` (False) in this batch."""
    need_gpus: dict[str, float] = {}
    need_price: dict[str, float] = {}
    for r in p.requests:
        if r.team is not None and r.options:
            o = r.options[0]
            need_gpus[r.team] = need_gpus.get(r.team, 0.0) + o.gpus
            need_price[r.team] = need_price.get(r.team, 0.0) + o.price
    out: dict[str, bool] = {}
    for name, t in p.teams.items():
        if t.gpus_left is not None and need_gpus.get(name, 0.0) > t.gpus_left + EPS:
            out[name] = True
        elif t.budget_left is not None and need_price.get(name, 0.0) > t.budget_left + EPS:
            out[name] = False
    return out


def _thrifty(st: State, i: int, first: Option, look: int = 8) -> Option:
    """For a request of a team short of budget: of its cheapest `look` options that fit,
    the one with the lowest price (the budget it leaves buys other requests' places)."""
    r = st.p.requests[i]
    best = first
    seen = 0
    for o in r.options[r.group.dead:]:
        if seen >= look:
            break
        if o is first or not st.fits(i, o):
            continue
        seen += 1
        if o.price < best.price - EPS:
            best = o
    return best


def _greedy_key(r: Request, i: int, first: Option, c1: float, c2: float,
                short: dict[str, bool]) -> tuple[int, float, int]:
    """The greedy's order: requests of a team short of GPUs or budget first, most value
    (penalty − cost) per GPU or $ first (the team's knapsack: its dual price would send
    them to the cheap pools first); then the others, biggest regret first."""
    by_gpus = short.get(r.team) if r.team is not None else None
    if by_gpus is None:
        return (1, c1 - c2, i)
    return (0, -(r.penalty - c1) / _unit(first, by_gpus), i)


def _unit(o: Option, by_gpus: bool) -> float:
    """What an option takes of a team's limit: its GPUs, or its price (budget)."""
    return max(float(o.gpus) if by_gpus else o.price, EPS)


_CLOCK_EVERY = 256  # requests between two looks at the clock in the improvement


# Complex: hot path (bench/placement.py); split in the package redesign (#28).
def _improve(st: State, *, rounds: int,  # noqa: C901, PLR0912
             best_two: Callable[[int], tuple[Option | None, float, float]],
             chains: bool = True, deadline: float = math.inf) -> None:
    p = st.p
    reqs = p.requests
    timed = deadline < math.inf
    clock = time.perf_counter

    def late(i: int) -> bool:
        return timed and i % _CLOCK_EVERY == 0 and clock() > deadline

    for _ in range(rounds):
        moved = 0
        # 1. Cheaper options freed up by later decisions (or never tried in this order).
        for i, cur in enumerate(st.choice):
            if late(i):
                return
            if cur is None:
                continue
            r = reqs[i]
            cur_cost = r.cost(cur)
            opts = r.options
            if opts[r.group.dead] is cur if r.group.dead < len(opts) else False:
                continue  # already on the cheapest option still alive
            st.take(i, cur, -1)
            better = None
            for j in range(r.group.dead, len(opts)):
                o = opts[j]
                if o is cur or r.cost(o) >= cur_cost - EPS:
                    break
                if st.fits(i, o):
                    better = o
                    break
            if better is not None:
                st.take(i, better)
                if st.spread_holds(r.team):
                    moved += 1
                    continue
                st.take(i, better, -1)
            st.take(i, cur)
        users: dict[Hashable, list[int]] = {}
        for j, oj in enumerate(st.choice):
            if oj is not None:
                for key, _ in oj.uses:
                    users.setdefault(key, []).append(j)
        # 1b. A cheaper option held by others: move them on when that costs less
        #     (`chains`: about 0.4 s at 10,000 requests, for 0.15 % there).
        for i, cur in enumerate(st.choice if chains else ()):
            if late(i):
                return
            if cur is None or not reqs[i].options or reqs[i].options[0] is cur:
                continue  # (a list regrown without used-up options may be empty)
            st.take(i, cur, -1)
            if _make_room(st, i, users, tries=2, per_key=8, worth=reqs[i].cost(cur)):
                moved += 1
                new = st.choice[i]
                assert new is not None
                for key, _ in new.uses:
                    users.setdefault(key, []).append(i)
            else:
                st.take(i, cur)
        # 2. Unplaced requests: any option that fits, else make room by moving the
        #    placed requests off the resources the option lacks.
        for i, cur in enumerate(st.choice):
            if late(i):
                return
            if cur is not None:
                continue
            first, c1, _ = best_two(i)
            if first is not None and c1 < reqs[i].penalty:
                st.take(i, first)
                moved += 1
                continue
            if _make_room(st, i, users):
                moved += 1
        # 3. A team short of GPUs or budget: a request worth more per GPU (or $) than
        #    the team's least valuable placed ones takes their room (a knapsack swap).
        moved += _team_swaps(st)
        if not moved:
            return


# Complex: hot path (bench/placement.py); split in the package redesign (#28).
def _make_room(st: State, i: int, users: dict[Hashable, list[int]], tries: int = 4,  # noqa: C901, PLR0912
               per_key: int = 32, scan: int = 16, worth: float | None = None) -> bool:
    """Place request `i` (not placed now) on one of its cheapest options by moving as
    many placed requests off the resources it lacks as it takes, each to its cheapest
    other option that does not use that resource, while the moves together cost less
    than `worth` (what `i` costs where it is: its penalty unless given). Undone unless
    `i` then fits. `users`: who used each resource when the round began (checked
    before use)."""
    p = st.p
    r = p.requests[i]
    if worth is None:
        worth = r.penalty
    for o in r.options[:tries]:
        gain = worth - r.cost(o)
        if gain <= EPS:
            break
        if not st.team_ok(i, o):
            continue  # moving other requests frees no room in i's own team
        moves: list[tuple[int, Option, Option]] = []
        spent = 0.0
        for key, amount in o.uses:
            while (have := st.left.get(key)) is not None and have < amount - EPS:
                best: tuple[float, int, Option, Option] | None = None
                for j in users.get(key, ())[:per_key]:
                    oj = st.choice[j]
                    if oj is None or all(k != key for k, _ in oj.uses):
                        continue
                    rj = p.requests[j]
                    base = rj.cost(oj)
                    st.take(j, oj, -1)
                    opts = rj.options
                    for alt in opts[rj.group.dead:rj.group.dead + scan]:
                        delta = rj.cost(alt) - base
                        if spent + delta >= gain or (best is not None and delta >= best[0]):
                            break
                        if alt is not oj and all(k != key for k, _ in alt.uses) and \
                                st.fits(j, alt):
                            best = (delta, j, oj, alt)
                            break
                    st.take(j, oj)
                if best is None:
                    break
                delta, j, oj, alt = best
                st.take(j, oj, -1)
                st.take(j, alt)
                moves.append((j, oj, alt))
                spent += delta
        if st.fits(i, o):
            st.take(i, o)
            if st.spread_holds(r.team) and all(st.spread_holds(p.requests[j].team)
                                               for j, _, _ in moves):
                for j, _, alt in moves:
                    for k, _ in alt.uses:
                        users.setdefault(k, []).append(j)
                return True
            st.take(i, o, -1)
        for j, oj, alt in reversed(moves):
            st.take(j, alt, -1)
            st.take(j, oj)
    return False


# Complex: hot path (bench/placement.py); split in the package redesign (#28).
def _team_swaps(st: State) -> int:  # noqa: C901, PLR0912
    """For each unplaced request of a team whose `gpus_left` or `budget_left` rules out
    all its options, unplace the team's placed requests of lowest value per unit of that
    limit (value: penalty − cost) until it fits, when what they are worth together is
    less than what placing it gains. Returns how many requests it placed."""
    p = st.p
    reqs = p.requests
    members: dict[str, list[int]] = {}
    for j, oj in enumerate(st.choice):
        team = reqs[j].team
        if oj is not None and team is not None:
            t = st.teams.get(team)
            if t is not None and (t.gpus_left is not None or t.budget_left is not None):
                members.setdefault(team, []).append(j)
    if not members:
        return 0

    ranked: dict[str, list[tuple[float, int, Option]]] = {}
    for team, js in members.items():
        t = st.teams[team]
        rows = []
        for j in js:
            oj = st.choice[j]
            assert oj is not None
            rows.append(((reqs[j].penalty - reqs[j].cost(oj)) / _unit(oj, t.gpus_left is not None),
                         j, oj))
        rows.sort(key=lambda x: (x[0], x[1]))
        ranked[team] = rows
    placed = 0
    for i, cur in enumerate(st.choice):
        r = reqs[i]
        if cur is not None or r.team not in ranked:
            continue
        t = st.teams[r.team]
        o = next((x for x in r.options[r.group.dead:] if st.global_ok(x)), None)
        if o is None:
            continue
        gain = r.penalty - r.cost(o)
        rows = ranked[r.team]
        if not rows or gain / _unit(o, t.gpus_left is not None) <= rows[0][0]:
            continue  # worth no more per unit than the least valuable placed
        removed: list[tuple[int, Option]] = []
        loss = 0.0
        for _, j, oj in rows:
            if st.fits(i, o) or loss >= gain:
                break
            if st.choice[j] is not oj:
                continue
            loss += reqs[j].penalty - reqs[j].cost(oj)
            st.take(j, oj, -1)
            removed.append((j, oj))
        if loss < gain - EPS and st.fits(i, o):
            st.take(i, o)
            if st.spread_holds(r.team):
                placed += 1
                ranked[r.team] = [row for row in ranked[r.team] if st.choice[row[1]] is row[2]]
                continue
            st.take(i, o, -1)
        for j, oj in reversed(removed):
            st.take(j, oj)
    return placed


# --- the exact solver ----------------------------------------------------------------


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


@dataclass(slots=True)
class _Result:
    """What HiGHS answered: `status` 0 optimal, 1 a limit struck, 2 infeasible, 4 other
    (SciPy's codes); `x` the columns' values when it has a feasible point."""

    status: int
    x: Any
    value: float | None
    row_dual: Any = None
    mip_dual_bound: float | None = None


def _highs_solve(lp: _LP, *, integer: bool, time_limit: float) -> _Result:
    """Solve `lp` (its relaxation unless `integer`) with HiGHS."""
    import highspy
    import numpy as np

    h = _new_highs()
    if time_limit < math.inf:
        h.setOptionValue("time_limit", max(0.001, float(time_limit)))
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


def exact(p: Problem, *, time_limit: float = 1.0, incumbent: Solution | None = None,
          max_rounds: int = 20) -> Solution:
    """Optimal (or, when the time limit strikes, the best found and a valid bound) by
    LP column generation and a MILP on every option that could still improve on
    `incumbent` (the heuristic's answer when not given)."""
    started = time.perf_counter()
    deadline = started + time_limit
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
        if left <= 0:
            grew = True  # out of time: the relaxation is not proven, no bound from it
            break
        lp = _LP(p)
        duals = lp.solve_relaxation(time_limit=left)
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
    if remaining <= 0.01:
        return Solution(inc.choice, inc.objective, bound, inc.solver,
                        time.perf_counter() - started, detail={"lp_rounds": rounds,
                                                               "milp": "no time left"})
    res = _highs_solve(lp, integer=True, time_limit=remaining)
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


def _price_out(p: Problem, groups: Sequence[Group], duals: _Duals, *,
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

    # Complex: split in the package redesign (#28).
    def __init__(self, p: Problem) -> None:  # noqa: C901, PLR0912, PLR0915
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
            entries: list[tuple[tuple[str, str], float, float]] = []
            if t.gpus_left is not None:
                entries.append(((r.team or "", "gpus"), t.gpus_left, o.gpus))
            if t.budget_left is not None:
                entries.append(((r.team or "", "budget"), t.budget_left, o.price))
            if t.owned_left is not None and o.owned:
                entries.append(((r.team or "", "owned"), max(t.owned_left, 0.0), o.owned))
            if t.spreads:
                entries.append(((r.team or "", "total"), 0.0, -o.gpus))
                # A zone or cloud the team already holds more than its share of takes
                # nothing more (as the heuristic sees it: no placement there fits).
                if t.zone_share is not None:
                    zk = (o.cloud, o.zone)
                    hi = t.zone_share * t.total + t.grace - t.by_zone.get(zk, 0)
                    if hi < -EPS:
                        self.zero.append(v)
                    entries.append(((r.team or "", f"zone:{o.cloud}:{o.zone}"), max(hi, 0.0),
                                    o.gpus))
                if t.cloud_share is not None:
                    hi = t.cloud_share * t.total + t.grace - t.by_cloud.get(o.cloud, 0)
                    if hi < -EPS:
                        self.zero.append(v)
                    entries.append(((r.team or "", f"cloud:{o.cloud}"), max(hi, 0.0), o.gpus))
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

    def solve_relaxation(self, time_limit: float = math.inf) -> _Duals | None:
        """The LP relaxation: its value (kept in `value`) and its rows' duals (the
        objective's derivative by each row's bound), None if it was not solved."""
        res = _highs_solve(self, integer=False, time_limit=time_limit)
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
