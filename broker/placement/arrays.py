"""A large batch's candidates as arrays (`Ranked`) and the option lists made of them as the
solver reads them (`Source`): see `broker.placement.candidates`."""

from __future__ import annotations

import math
from typing import Any, Protocol

from broker.model import Offer
from broker.placement.problem import Alive, Group, Option, Shrinking
from broker.placement.rules import OfferArrays
from policies.model import RiskLevel


class Lister(Protocol):
    """What a `Source` needs of the builder that made it."""

    def option(self, offer: Offer, instances: int, need: int, h: float, risk: RiskLevel
               ) -> Option: ...

    def live_room(self, alive: Alive | None) -> Any: ...

    def used_up(self, slot: int, o: Option, alive: Alive) -> None: ...


class Ranked:
    """A group's candidates, each offer `row` of `arrays[part]` with `inst` instances at
    expected `cost` and `price` per hour (`slot`: the offer's place in the builder's
    `room`), in `order` of cost: the cheapest few are sorted up front (most groups read
    no further), the rest once a read gets to them."""

    # Many arguments: the groups' parallel arrays, built together by the caller.
    def __init__(self, arrays: list[OfferArrays], made: list[list[Option | None]],  # noqa: PLR0913
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


class Source:
    """A group's options, made lazily from its `Ranked` candidates, cheapest first
    (`upto`: the cost of the next one unread).

    While the heuristic places, resources only shrink: an option it finds used up
    records in the builder's `room` how many instances its offer still has room for,
    and every group then skips, a chunk at a time, the candidates that need more,
    without making their options. Options dropped as used up are read again, from
    the start, when the LP asks for everything under a bound."""

    CHUNK = 256

    def __init__(self, builder: Lister, ranked: Ranked, need: int, h: float,
                 risk: RiskLevel) -> None:
        self.builder = builder
        self.h = h
        self.risk = risk  # the level its candidates were costed at
        self.ranked = ranked
        self.need = need
        self.at = 0  # the candidates before it in order are read
        self.dropped = False
        self.group: Group | None = None

    def more(self, k: int | None, below: float | None, alive: Alive | None
             ) -> tuple[list[Option], float]:
        import numpy as np

        g = self.group
        out: list[Option] = []
        if alive is None and self.dropped:
            self.at, self.dropped = 0, False
        elif g is not None:
            out = list(g.options)
        builder, ranked, need = self.builder, self.ranked, self.need
        room = builder.live_room(alive)
        # (a `Shrinking` filter's own check, without its call per option)
        ok = alive.ok if isinstance(alive, Shrinking) else alive
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
                    o = ranked.made[p][row] = builder.option(ranked.arrays[p].offers[row],
                                                             inst, need, self.h, self.risk)
                if ok is None or ok(o):
                    out.append(o)
                    added += 1
                else:
                    self.dropped = True
                    if room is not None and alive is not None:
                        builder.used_up(slot, o, alive)
            self.at += end
            if end < len(chunk):
                break
        if g is not None:
            g.unlisted_price = ranked.price_floor(self.at)
        nxt = ranked.read(self.at, 1)
        return out, (float(ranked.cost[nxt[0]]) if len(nxt) else math.inf)
