"""What is left of the shared resources and the teams' limits for one candidate answer
(`State`), shared by the heuristic's phases and the MILP's check; the trivial lower bound;
and what keeps an unplaced request off its cheapest option."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

from broker.placement.problem import EPS, AssignmentProblem, Option


class State:
    """Residual resources and team tallies for one candidate solution."""

    __slots__ = ("choice", "left", "p", "teams")

    def __init__(self, p: AssignmentProblem) -> None:
        self.p = p
        self.left = dict(p.limits)
        self.teams = {name: t.copy() for name, t in p.teams.items()}
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
        return self.team_binds(team, o) is None

    def team_binds(self, team: str | None, o: Option) -> tuple[str, float] | None:
        """The limit of `team` that `o` would pass (`TeamRoom.binding`), or None."""
        t = self.teams.get(team) if team is not None else None
        return None if t is None else t.binding(o.gpus, o.price, o.owned)

    def fits_static(self, i: int, o: Option) -> bool:
        return self.global_ok(o) and self.team_ok(i, o)

    def fits_spread(self, i: int, o: Option) -> bool:
        return self.spread_allows(self.p.requests[i].team, o)

    def spread_allows(self, team: str | None, o: Option) -> bool:
        t = self.teams.get(team) if team is not None else None
        return t is None or t.spread_allows(o.gpus, o.cloud, o.zone)

    def spread_holds(self, team: str | None) -> bool:
        """Whether every zone and cloud of `team` is within its share (after a removal,
        which shrinks the total)."""
        t = self.teams.get(team) if team is not None else None
        return t is None or t.spread_holds()

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
            t.count(o.gpus, o.price, o.owned, o.cloud, o.zone, sign)

    def objective(self) -> float:
        p = self.p
        return sum(p.requests[i].cost(o) if o is not None else p.requests[i].penalty
                   for i, o in enumerate(self.choice))


def trivial_bound(p: AssignmentProblem) -> float:
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


def why_unplaced(p: AssignmentProblem, choice: Sequence[Option | None]
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
            binds = st.team_binds(r.team, o)
            if binds is not None:
                out[i] = binds
            elif not st.fits_spread(i, o):
                out[i] = ("spread", r.team)
    return out

