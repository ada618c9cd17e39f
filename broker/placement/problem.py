"""The assignment problem a batch of placement requests is: each request takes one of its
options (a pool and a number of instances) or stays unplaced; options use up shared
resources (a pool's free instances, a quota group's headroom) and their team's limits
(`policies.teams.TeamRoom`). `broker.placement.solver` tells the whole story."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from policies.teams import EPS, TeamRoom

__all__ = ["EPS", "Alive", "AssignmentProblem", "Group", "More", "Option", "Request",
           "Shrinking", "Solution", "TeamRoom"]

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


@dataclass(frozen=True, slots=True)
class Shrinking:
    """The `Alive` filter of the heuristic's greedy phase, while resources only shrink:
    an option is alive while what it uses is `left` (what is left of each resource; a
    resource absent from it has its limit). A list being read may remember what it found
    used up for as long as it is given the same `left`."""

    left: dict[Hashable, float]
    ok: Alive

    def __call__(self, o: Option) -> bool:
        return self.ok(o)

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
    least_paid: Callable[[], int] | None = None
    """The fewest GPUs any of its options pays for, listed or not (whole instances: at
    least `min_gpus`), worked out when first asked; None where its team's GPUs are not
    limited (nothing reads it then)."""

    @property
    def options(self) -> list[Option]:
        return self.group.options

    def cost(self, o: Option) -> float:
        if self.extra is None:
            return self.horizon * o.cost_per_hour
        return self.horizon * (o.cost_per_hour + self.extra(o))


@dataclass(slots=True)
class AssignmentProblem:
    """A batch as the solvers see it: its requests, every shared resource's limit and
    every team's."""

    requests: list[Request]
    limits: dict[Hashable, float]  # resource -> what is left of it; absent = unlimited
    teams: dict[str, TeamRoom] = field(default_factory=dict)

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

