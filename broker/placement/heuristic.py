"""The regret heuristic that solves every batch (`heuristic`), and its local improvement
(`broker.placement.solver` tells the whole story)."""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter
from collections.abc import Callable, Hashable

from broker.placement.problem import (
    EPS,
    Alive,
    AssignmentProblem,
    Option,
    Request,
    Shrinking,
    Solution,
)
from broker.placement.residual import State, trivial_bound
from policies.teams import TeamRoom

RECLAIM = 500
"""Requests the heuristic's last two phases (`_spare_limits`, `_reclaim`) look at each,
those that stand to gain most first: a bound on their work, so that the answer does not
depend on the machine's speed (the deadline stops them only on a machine far slower
than this one: at 10,000 requests they take about 0.3 s here, bench/placement.py b)."""

# Complex: an inner loop of the heuristic (10,000-request batches, bench/placement.py part b):
# kept whole, no call per option; checked against brute force in tests/placement/test_solver.py.
def heuristic(p: AssignmentProblem, *, improve_rounds: int = 2, chains: bool = True,  # noqa: C901, PLR0915
              deadline: float = math.inf, reclaim: int | None = None) -> Solution:
    """Regret greedy, then local improvement (`_improve`, then `_polish`). Never
    exceeds a resource or a limit. `deadline` (a `time.perf_counter()` instant) stops
    the improvement early: the greedy answer is always finished, the improvement only
    while time is left. `reclaim`: how many requests each of the last two phases
    (`_polish`) looks at at most, `RECLAIM` unless given; 0 leaves them out."""
    started = time.perf_counter()
    bound = trivial_bound(p)  # before lists grow without what this answer used up
    st = State(p)
    reqs = p.requests
    global_ok = st.global_ok
    alone = len(reqs) == 1
    # The teams with one request in the batch: nothing else in it moves their shares.
    teams_of = Counter(r.team for r in reqs if r.team is not None)

    def best_two(i: int) -> tuple[Option | None, float, float]:
        """The request's cheapest option that fits now, its cost, and the cost of the
        next one that fits (or the penalty)."""
        r = reqs[i]
        g = r.group
        t = st.teams.get(r.team) if r.team is not None else None
        budget = t.budget_left if t is not None else None
        if t is not None and (t.binding(r.min_gpus) is not None or
                              (teams_of[r.team] == 1 and _shut_out(t, r))):
            return None, r.penalty, r.penalty  # the team has no room for any option
        # The team's checks straight on its `TeamRoom` (`State.team_ok`, `fits_spread`).
        binding = t.binding if t is not None and t.limited else None
        spread = t.spread_allows if t is not None and t.spreads else None
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
                if (spread is not None and not spread(o.gpus, o.cloud, o.zone)) or \
                        (j > k and not global_ok(o)) or \
                        (binding is not None and binding(o.gpus, o.price, o.owned) is not None):
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
            if not g.grow(k=max(32, 4 * n), alive=alive):
                return None, r.penalty, r.penalty

    # While the greedy places, resources only shrink: lists being read may remember what
    # they find used up (`Shrinking`).
    alive: Alive = Shrinking(st.left, global_ok)
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
    # A request alone is placed on the first option, in order of cost, that every
    # constraint admits (or on none when none does, the list grown to its end): the
    # optimum, although the trivial bound may lie below it (it ignores team limits).
    # Nothing is left to improve: no other request to move, none to make room for.
    if not alone:
        alive = global_ok  # from here on resources are freed as well as taken
        _improve(st, rounds=improve_rounds, best_two=best_two, chains=chains,
                 deadline=deadline)
        _polish(st, best_two, limit=RECLAIM if reclaim is None else reclaim,
                deadline=deadline)
    objective = st.objective()
    return Solution(st.choice, objective, bound, "heuristic", time.perf_counter() - started,
                    optimal=alone or objective <= bound + EPS * max(1.0, bound))


def _shut_out(t: TeamRoom, r: Request) -> bool:
    """Whether no option of `r`, listed or not, fits its team's spread limits or its GPUs
    left, with nothing else of the team's in the batch (which could widen its shares,
    or give GPUs back as it moves). Else the heuristic would list every offer there is
    to find each one over (some 40 ms of the event loop at 2,600 of them): a gang of
    8 where no zone may hold all of a team's GPUs; 4 H100s (8 an instance) with 4 left.
    The instances are counted only when the listed options are all too large."""
    if not t.spread_allows_somewhere(r.min_gpus):
        return True
    left = t.gpus_left
    if left is None or r.least_paid is None or not r.options or \
            min(o.gpus for o in r.options) <= left + EPS:
        return False
    return t.binding(r.least_paid()) is not None


def _short_teams(p: AssignmentProblem) -> dict[str, bool]:
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


# Complex: an inner loop of the heuristic (10,000-request batches, bench/placement.py part b):
# kept whole, no call per option; checked against brute force in tests/placement/test_solver.py.
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


# Complex: an inner loop of the heuristic (10,000-request batches, bench/placement.py part b):
# kept whole, no call per option; checked against brute force in tests/placement/test_solver.py.
def _make_room(st: State, i: int, users: dict[Hashable, list[int]], tries: int = 4,  # noqa: C901, PLR0912
               per_key: int = 32, scan: int = 16, worth: float | None = None,
               weigh: Callable[[Option], float] | None = None) -> bool:
    """Place request `i` (not placed now) on one of its cheapest options by moving as
    many placed requests off the resources it lacks as it takes, each to its cheapest
    other option that does not use that resource, while the moves together cost less
    than `worth` (what `i` costs where it is: its penalty unless given). Undone unless
    `i` then fits. `users`: who used each resource when the round began (checked
    before use). `weigh` adds to the cost of `i`'s options, and of those of the requests
    of its team it moves, what they take of a limit of the team (`_spare`)."""
    p = st.p
    r = p.requests[i]
    left = st.left
    if worth is None:
        worth = r.penalty
    for o in r.options[:tries]:
        gain = worth - r.cost(o) - (weigh(o) if weigh is not None else 0.0)
        if gain <= EPS:
            if weigh is not None:
                continue  # (cheapest first by cost, not by cost and price)
            break
        if not st.team_ok(i, o):
            continue  # moving other requests frees no room in i's own team
        moves: list[tuple[int, Option, Option]] = []
        spent = 0.0
        for key, amount in o.uses:
            while (have := left.get(key)) is not None and have < amount - EPS:
                best: tuple[float, int, Option, Option] | None = None
                for j in users.get(key, ())[:per_key]:
                    oj = st.choice[j]
                    if oj is None or all(k != key for k, _ in oj.uses):
                        continue
                    rj = p.requests[j]
                    # The same team's limit counts for it as for `i`.
                    w = weigh if weigh is not None and rj.team == r.team else None
                    base = rj.cost(oj) + (w(oj) if w is not None else 0.0)
                    off = False  # j taken off oj (only once an option needs the check)
                    own = [k for k, _ in oj.uses]
                    opts = rj.options
                    for alt in opts[rj.group.dead:rj.group.dead + scan]:
                        delta = rj.cost(alt) + (w(alt) if w is not None else 0.0) - base
                        if spent + delta >= gain or (best is not None and delta >= best[0]):
                            break
                        if alt is oj:
                            continue
                        # Not on `key`, and (first, cheaply) room in what oj does not use.
                        for k, amount_k in alt.uses:
                            if k == key or ((h := left.get(k)) is not None and
                                            h < amount_k - EPS and k not in own):
                                break
                        else:
                            if not off:
                                st.take(j, oj, -1)
                                off = True
                            if st.fits(j, alt):
                                best = (delta, j, oj, alt)
                                break
                    if off:
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


# Complex: an inner loop of the heuristic (10,000-request batches, bench/placement.py part b):
# kept whole, no call per option; checked against brute force in tests/placement/test_solver.py.
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




def _polish(st: State, best_two: Callable[[int], tuple[Option | None, float, float]], *,
            limit: int, deadline: float) -> None:
    """The heuristic's last two phases, each looking at `limit` requests at most (none
    when 0): a team's budget or spread limit spared for its unplaced requests
    (`_spare_limits`), then cheaper options for the requests that lose most where they
    are (`_reclaim`)."""
    if limit > 0:
        _spare_limits(st, best_two, limit=limit, deadline=deadline)
        _reclaim(st, limit=limit, deadline=deadline)


def _late(deadline: float, n: int) -> bool:
    """Past `deadline`, looked at every 16th step `n` (and the first)."""
    return deadline < math.inf and n % 16 == 0 and time.perf_counter() > deadline


def _users(st: State) -> dict[Hashable, list[int]]:
    """The placed requests using each resource, in request order."""
    users: dict[Hashable, list[int]] = {}
    for j, o in enumerate(st.choice):
        if o is not None:
            for key, _ in o.uses:
                users.setdefault(key, []).append(j)
    return users


def _moved(users: dict[Hashable, list[int]], st: State, i: int) -> None:
    """Count request `i`, just placed, among the users of its option's resources."""
    o = st.choice[i]
    assert o is not None
    for key, _ in o.uses:
        users.setdefault(key, []).append(i)


def _reclaim(st: State, *, limit: int, deadline: float = math.inf, tries: int = 64,
             per_key: int = 4, scan: int = 16) -> int:
    """The requests that lose most by sitting where they are (cost where placed less
    cost of their cheapest option, most first: the greedy's regret looks one option
    ahead, so a long request may find every cheap pool taken by short ones that would
    lose little elsewhere) each try their cheapest `tries` options again, moving the
    requests in the way on to their next option (`_make_room`) when that costs less
    than it saves. At most `limit` requests; stops at `deadline`. Returns how many
    moved."""
    reqs = st.p.requests
    users = _users(st)
    losses: list[tuple[float, int]] = []
    for i, o in enumerate(st.choice):
        opts = reqs[i].options
        if o is not None and opts and opts[0] is not o:
            loss = reqs[i].cost(o) - reqs[i].cost(opts[0])
            if loss > EPS:
                losses.append((-loss, i))
    losses.sort()
    moved = 0
    for n, (_, i) in enumerate(losses[:limit]):
        if _late(deadline, n):
            break
        cur = st.choice[i]  # (moved on as another's holder since, perhaps)
        if cur is None:
            continue
        st.take(i, cur, -1)
        if _make_room(st, i, users, tries=tries, per_key=per_key, scan=scan,
                      worth=reqs[i].cost(cur)):
            moved += 1
            _moved(users, st, i)
        else:
            st.take(i, cur)
    return moved


def _spare_limits(st: State, best_two: Callable[[int], tuple[Option | None, float, float]],
                  *, limit: int, deadline: float = math.inf, tries: int = 48) -> None:
    """For each team whose `budget_left` or spread limit leaves some of its requests
    unplaced: move its placed requests to options that take less of that limit —
    lower price, or GPUs outside the zones and clouds at their share — moving others
    out of their way (`_make_room`), each $ or GPU spared weighed at what the team's
    unplaced requests are worth per $ or GPU (the median of their penalty less cost
    over it); then place the unplaced ones, those of highest penalty first (as phase
    2 of `_improve` does); all of it undone unless the objective is then lower."""
    reqs = st.p.requests
    for name in sorted(st.teams):
        t = st.teams[name]
        if (t.budget_left is None and not t.spreads) or _late(deadline, 0):
            continue
        waiting = [i for i, o in enumerate(st.choice)
                   if o is None and reqs[i].team == name and reqs[i].options]
        if not waiting:
            continue
        if t.budget_left is not None:
            for g in {id(r.group): r.group for r in reqs if r.team == name}.values():
                if len(g.options) < tries:  # options of lower price lie further down
                    g.unfilter()  # (every option listed stays listed)
                    g.grow(k=tries)
            _spare(st, best_two, waiting, lambda o: o.price, limit=limit, deadline=deadline,
                   tries=tries)
        waiting = [i for i in waiting if st.choice[i] is None]
        crowded = _crowded(st, waiting, tries) if t.spreads else set()
        if crowded:
            _spare(st, best_two, waiting, _gpus_in(crowded), limit=limit,
                   deadline=deadline, tries=tries)


def _gpus_in(places: set[object]) -> Callable[[Option], float]:
    """What an option takes of the spread limits of `places` (clouds, and (cloud,
    zone)s): its GPUs, once for its cloud and once for its zone when they are there."""

    def takes(o: Option) -> float:
        return float(o.gpus) * ((o.cloud in places) + ((o.cloud, o.zone) in places))

    return takes


def _crowded(st: State, waiting: list[int], tries: int) -> set[object]:
    """The clouds and (cloud, zone)s whose share keeps `waiting` off the cheapest of
    their options that fit otherwise."""
    reqs = st.p.requests
    out: set[object] = set()
    for i in waiting:
        t = st.teams[reqs[i].team or ""]
        o = next((x for x in reqs[i].options[:tries] if st.fits_static(i, x)), None)
        if o is None or st.fits_spread(i, o):
            continue
        total = t.total + o.gpus
        if t.zone_share is not None and t.by_zone.get((o.cloud, o.zone), 0) + o.gpus > \
                t.zone_share * total + t.grace + EPS:
            out.add((o.cloud, o.zone))
        if t.cloud_share is not None and t.by_cloud.get(o.cloud, 0) + o.gpus > \
                t.cloud_share * total + t.grace + EPS:
            out.add(o.cloud)
    return out


def _spare(st: State, best_two: Callable[[int], tuple[Option | None, float, float]],
           waiting: list[int], takes: Callable[[Option], float], *, limit: int,
           deadline: float, tries: int) -> None:
    """Move the placed requests of the team of `waiting`, those whose option `takes` most
    of a limit first (at most `limit`), to options that take less of it, moving others
    out of the way (`_make_room`), each unit spared weighed at what `waiting` are worth
    per unit (the median of penalty less cost over what their cheapest option takes);
    then place `waiting`, those of highest penalty first. Undone unless the objective
    is then lower."""
    reqs = st.p.requests
    team = reqs[waiting[0]].team
    worth = sorted((reqs[i].penalty - reqs[i].cost(reqs[i].options[0]))
                   / takes(reqs[i].options[0]) for i in waiting
                   if takes(reqs[i].options[0]) > EPS)
    if not worth:
        return
    per_unit = worth[len(worth) // 2]

    def weigh(o: Option) -> float:
        return per_unit * takes(o)

    before = st.objective()
    saved = (list(st.choice), dict(st.left), {k: t.copy() for k, t in st.teams.items()})
    users = _users(st)
    over: list[tuple[float, int]] = []
    for j, o in enumerate(st.choice):
        r = reqs[j]
        if o is not None and r.team == team and r.options:
            over.append((min(takes(x) for x in r.options[:tries]) - takes(o), j))
    over.sort()
    for n, (less, j) in enumerate(over[:limit]):
        if less > -EPS or _late(deadline, n):
            break
        cur = st.choice[j]
        assert cur is not None
        st.take(j, cur, -1)
        if _make_room(st, j, users, tries=tries, per_key=8,
                      worth=reqs[j].cost(cur) + weigh(cur), weigh=weigh):
            _moved(users, st, j)
        else:
            st.take(j, cur)
    for n, i in enumerate(sorted(waiting, key=lambda i: (-reqs[i].penalty, i))):
        if _late(deadline, n):
            break
        first, c1, _ = best_two(i)
        if first is not None and c1 < reqs[i].penalty:
            st.take(i, first)
        elif _make_room(st, i, users, tries=tries, per_key=8):
            _moved(users, st, i)
    if st.objective() >= before - EPS:
        st.choice[:] = saved[0]
        st.left.clear()
        st.left.update(saved[1])
        st.teams.clear()
        st.teams.update(saved[2])
