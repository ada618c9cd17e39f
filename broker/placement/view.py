"""What placement reads of the market: the `PoolView` protocol, a `Snapshot` of it for a
worker thread, and the offers in order of their cost per GPU (`CostIndex`)."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import (
    Callable,
    Collection,
    Hashable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from broker.market.hazard import DEFAULT_HORIZON, Hazard, HazardEstimator, horizon_bucket
from broker.market.loans import Loans
from broker.model import MARKETS, Market, Offer, PlaceRequest, PoolKey
from broker.placement.cost import by_horizon, hazard_over, unit_cost
from broker.placement.room import no_room
from policies.model import Policy, RiskLevel

if TYPE_CHECKING:
    from broker.market.pool import ResourcePool
    from policies.evaluate import Constraints


class PoolView(Protocol):
    def by_gpu(self, gpu: str, market: Market | None = None) -> Sequence[Offer]:
        """Priced offers of `gpu` in `market`, cheapest per GPU-hour first."""

    def stale_slices(self, now: datetime) -> Collection[Hashable]:
        """Slices (as `slice_of` names them) whose offers must not be placed on."""

    def slice_of(self, key: PoolKey) -> Hashable | None: ...

    def cooling(self, now: datetime) -> Collection[PoolKey]:
        """Pools that take no new placements now."""

    def held(self, key: PoolKey) -> int:
        """Instances of `key` the broker's leases already hold."""

    def held_now(self) -> Mapping[PoolKey, int]:
        """`held` of every pool it is not 0 for, now, as one mapping (for reading many
        at once); not to be changed."""

    def get(self, key: PoolKey) -> Offer | None: ...

    @property
    def hazard(self) -> HazardEstimator | None:
        """Spot pools' interruption rate and availability expected over a job, from their
        history (None: none kept; the offers' own signals are used)."""


_BOTH_AND_EACH: tuple[Market | None, ...] = (None, *MARKETS)
"""The pool's lists by GPU a `Snapshot` lends: both markets (None), then each."""


class Snapshot:
    """A `PoolView` frozen at one moment, for placing in a worker thread while the event
    loop goes on changing the pool: every GPU's sorted offer lists and the instances
    held (lent by the pool, which copies what it changes after: `ResourcePool.lend`,
    `held_now`; the offers are immutable), the stale slices and cooling pools at `now`.
    Offers looked up by key (`get`, `slice_of`) and the hazard estimator are read live:
    single lookups, each consistent on its own."""

    def __init__(self, pool: ResourcePool, now: datetime) -> None:
        self._pool = pool
        pool.borrow()
        self._returned = False
        self._lists: dict[tuple[str, Market | None], Sequence[Offer]] = {}
        for gpu in pool.gpus():
            for market in _BOTH_AND_EACH:
                self._lists[(gpu, market)] = pool.lend(gpu, market)
        self._stale = frozenset(pool.stale_slices(now))
        self._cooling = frozenset(pool.cooling(now))
        self._held = pool.held_now()
        self._hazard = pool.hazard

    def return_loan(self) -> None:
        """Done reading (`ResourcePool.return_loan`); once only."""
        if not self._returned:
            self._returned = True
            self._pool.return_loan()

    def by_gpu(self, gpu: str, market: Market | None = None) -> Sequence[Offer]:
        return self._lists.get((gpu, market), ())

    def stale_slices(self, now: datetime) -> Collection[Hashable]:
        return self._stale

    def slice_of(self, key: PoolKey) -> Hashable | None:
        return self._pool.slice_of(key)

    def cooling(self, now: datetime) -> Collection[PoolKey]:
        return self._cooling

    def held(self, key: PoolKey) -> int:
        return self._held.get(key, 0)

    def held_now(self) -> Mapping[PoolKey, int]:
        return self._held

    def get(self, key: PoolKey) -> Offer | None:
        return self._pool.get(key)

    @property
    def hazard(self) -> HazardEstimator | None:
        return self._hazard


def _pairs(flat: tuple[Any, ...]) -> Iterator[tuple[Any, Any]]:
    """(a, b, c, d, …) as (a, b), (c, d), …"""
    it = iter(flat)
    return zip(it, it, strict=True)


def _first_two(entry: tuple[float, PoolKey, Offer]) -> tuple[float, PoolKey]:
    """What orders a list's entries: the cost, then the pool (whose entry is in a list
    once). A list is searched with the pair itself: a pair compares with an entry, in C,
    by these two, and is less than the entry it equals, so no offer is ever compared
    and no key function called (`_at`, `_put`)."""
    return entry[0], entry[1]


def _at(entries: list[_Entry], u: float, key: PoolKey) -> int:
    """Where pool `key`'s entry at cost `u` is in `entries`, or would go."""
    return bisect.bisect_left(entries, (u, key))


def _put(entries: list[_Entry], entry: _Entry) -> None:
    """Put `entry` in `entries` in its place (`_first_two`)."""
    entries.insert(_at(entries, entry[0], entry[1]), entry)


_Where = tuple[str, Market, float, str]  # (GPU model, market, horizon hours, risk level)
PRICE = "price"
"""The level of the index's lists in order of price per GPU-hour (horizon 0)."""


SCANS_MAX = 10_000
"""Entries of `CostIndex.scans`: one per shape of request with no option."""

PLACE_STEP = 200
"""Changed offers a step of `CostIndex.prepare` places again in the lists at most: a poll
round changes every offer, and placing tens of thousands again at once held the event
loop for a second or more."""

WALKS_MAX = 50_000
"""Entries of one `CostMemo.walks` table (some 200 bytes each): the walks of a steady
stream of requests read a few thousand."""


class CostMemo:
    """`OfferArrays.eff`'s figures per pool, kept from one batch to the next: a batch
    builds its arrays afresh, but most offers and their pools' hazard estimates have not
    changed since the last one, and the cost formula per offer was the largest part of
    a batch's placing (py-spy at 500 requests/s). An entry serves only the very offer
    it was computed for (a changed offer is a new object, its pool's estimate changed
    with it), at one horizon and one scoring; every entry goes when the hazard
    estimator is refreshed or replaced (its estimates of unchanged pools move then
    only: the `CostIndex`'s rule too). One entry per pool, horizon and scoring."""

    def __init__(self) -> None:
        self._seen: tuple[int, int] | None = None
        self._tables: dict[tuple[float, Any], dict[PoolKey, tuple[Offer, float, float]]] = {}
        self._walks: dict[tuple[float, Any], dict[tuple[PoolKey, int, int],
                                                  tuple[Offer, float]]] = {}
        self.arrays: dict[tuple[str, Market], Any] = {}
        """The last large batch's `rules.OfferArrays` per (model, market): the next one
        shares them when its offers are the same objects (`OfferArrays.again`), their
        costs too while `table` gives the same tables."""

    def table(self, estimator: Any, policy: Policy, h: float
              ) -> dict[PoolKey, tuple[Offer, float, float]]:
        """The entries for horizon `h` under `policy`'s scoring, as of `estimator` (the
        view's hazard estimator, or None)."""
        self._fresh(estimator)
        key = (h, policy.scoring)
        got = self._tables.get(key)
        if got is None:
            got = self._tables[key] = {}
        return got

    def walks(self, estimator: Any, policy: Policy, h: float
              ) -> dict[tuple[PoolKey, int, int], tuple[Offer, float]]:
        """The walks' option costs (`broker.placement.cost.option_cost`) over horizon `h`
        under `policy`'s scoring, as of `estimator`, per (pool, instances, GPUs asked
        for): the same requests walk the same offers batch after batch. An entry serves
        only the very offer it was computed for, like `table`'s; at most `WALKS_MAX`
        entries per table (it starts again empty)."""
        self._fresh(estimator)
        key = (h, policy.scoring)
        got = self._walks.get(key)
        if got is None or len(got) > WALKS_MAX:
            got = self._walks[key] = {}
        return got

    def _fresh(self, estimator: Any) -> None:
        seen = (id(estimator), getattr(estimator, "refreshes", 0))
        if seen != self._seen:
            self._tables = {}
            self._walks = {}
            self._seen = seen


_Entry = tuple[float, PoolKey, Offer]


@dataclass(frozen=True, slots=True)
class Part:
    """Which of a list's offers a walk reads: with `room`, only those of pools with room
    for a request of `room` GPUs (`broker.placement.room.no_room`, on the index's view
    of the holdings); with `clouds` or `regions`, only those within them (a request's
    own, `PlaceRequest.clouds`/`.regions`: what `rules.REQUEST_REGION` lets through);
    with `places`, only those of the (cloud, region)s it allows (a verdict's
    `Constraints.region_ok`, one per kind of verdict: `CostIndex.places`)."""

    room: int = 0
    clouds: frozenset[str] | None = None
    regions: frozenset[str] | None = None
    places: Callable[[str, str], bool] | None = None

    @staticmethod
    def room_for(need: int) -> int:
        """The `room` of the part a request of `need` GPUs walks: the largest power of two
        not above it. A pool with room for `need` GPUs has room for that many, so the
        part holds every offer the request could take, and a few parts (1, 2, 4, 8 …)
        serve every size."""
        return 1 << (need.bit_length() - 1) if need > 0 else 0

    def admits(self, entry: _Entry, held: Callable[[PoolKey], int]) -> bool:
        key = entry[1]
        return (self.clouds is None or key.cloud in self.clouds) and \
            (self.regions is None or key.region in self.regions) and \
            (self.places is None or self.places(key.cloud, key.region)) and \
            not (self.room and no_room(entry[2], held(key), self.room))

    def of(self, entries: list[_Entry], held: Callable[[PoolKey], int]) -> list[_Entry]:
        """This part of `entries`."""
        if self.sized:
            if not self.room:
                return entries
            room = self.room
            return [e for e in entries if not no_room(e[2], held(e[1]), room)]
        return [e for e in entries if self.admits(e, held)]

    @property
    def sized(self) -> bool:
        """Whether it is a part by room alone (kept however many parts are asked for)."""
        return self.clouds is None and self.regions is None and self.places is None


WHOLE = Part()
ROOMY = Part(room=1)
PARTS = 12
"""Parts kept per list besides those by room alone (`Part.sized`: one per power of two
asked for): those of the requests' own clouds or regions, or of a kind of verdict's
regions (`Part.places`), the last asked for."""


VERDICTS_MAX = 1_000
"""Kinds of verdict `CostIndex.places` keeps a test of (a policy has a few)."""


def _places(verdicts: dict[Hashable, Callable[[str, str], bool]], c: Constraints
            ) -> Callable[[str, str], bool]:
    key = c.regions_key()
    got = verdicts.get(key)
    if got is None:
        if len(verdicts) >= VERDICTS_MAX:
            verdicts.clear()  # the parts made with a test keep it
        got = verdicts.setdefault(key, c.region_ok)
    return got


def _holds(entries: list[_Entry], u: float, key: PoolKey) -> bool:
    """Whether pool `key`'s entry at cost `u` is in `entries`."""
    i = _at(entries, u, key)
    return i < len(entries) and entries[i][1] == key


def _remove(entries: list[_Entry], u: float, key: PoolKey) -> None:
    """Take pool `key`'s entry at cost `u` out of `entries`, if it is there."""
    i = _at(entries, u, key)
    if i < len(entries) and entries[i][1] == key:
        del entries[i]


class CostIndex:
    """The pool's priced offers per (GPU model, market, horizon, risk level) in order of
    `unit_cost`, for placing on the event loop: a request's walk can stop as soon as the
    next offer's cost per GPU times the GPUs it asks for exceeds the options it has,
    which in order of price alone can take hundreds of offers more (prices alike, risks
    not). The
    horizon is a request's (`broker.market.hazard.horizon_bucket`): spot risk is scored over
    it, so a list is kept per horizon asked for (at most `broker.market.hazard.HORIZONS`);
    and a request's risk level (`Policy.for_risk`) weighs it, so a list is kept per level
    asked for too (None: the policy's own, `scoring.risk`).

    Built per list on first use, then kept up to date from the pool's changes: an offer
    that changed or went (and with it the hazard estimate of its pool, which changes
    only with such a change) is placed again; a `refresh` of the hazard estimator, or
    another estimator, rebuilds every list. One policy's scoring: a new policy needs a
    new index. The offers are read from the pool when walked (the newest reading).

    Each list has parts (`Part`), kept as it changes: the list less the offers of pools
    without room for a request of 1, 2, 4 … GPUs (`Part.room`, `rules.no_room`), kept as
    the broker's holdings change (`ResourcePool.subscribe_room`): as its leases fill
    the cheapest pools, a walk would otherwise step over all of them, request after
    request, and a gang's over every pool with room for fewer instances than it takes;
    and the list within a request's own clouds or regions (`PlaceRequest.clouds`,
    `.regions`), made when first asked for (at most `PARTS` per list), so that such a
    request does not walk every other region's offers."""

    def __init__(self, pool: ResourcePool, policy: Policy) -> None:
        self.pool = pool
        self.policy = policy
        self._lists: dict[_Where, list[_Entry]] = {}
        self._parts: dict[_Where, dict[Part, list[_Entry]]] = {}
        self._loans = Loans()  # of `_lists`, to the frozen indexes (`frozen`)
        self._made: set[_Where] = set()  # every list made since the start (`prepare`)
        # Where each pool's offer is placed: (where, its entry there, where, …), flat, so
        # that the tens of thousands of pools cost one tuple each (`_pairs` reads it).
        self._placed: dict[PoolKey, tuple[Any, ...]] = {}
        self._dirty: set[PoolKey] = set()
        # Pools whose holdings changed since the parts by room were last kept, each with
        # what it held then (`_reroom`).
        self._room_dirty: dict[PoolKey, int] = {}
        self._hazard_seen: tuple[int, int] = (0, -1)
        self.memo = CostMemo()
        """The arrays' costs per pool, kept across batches (`CostMemo`)."""
        self._asked: set[tuple[_Where, Part]] = set()  # by frozen indexes (`frozen`)
        self._verdicts: dict[Hashable, Callable[[str, str], bool]] = {}  # `places`
        self.scans: dict[Hashable, Any] = {}
        """What the walk of a request with no option saw (`Scan`), per its shape
        (`CandidateBuilder.request`): it reads the lists alone, so it is kept until they
        next change (a new table then: one lent to a frozen index stays its own)."""
        unsubscribe = pool.subscribe(self._observe), pool.subscribe_room(self._room)

        def close() -> None:
            for stop in unsubscribe:
                stop()

        self.close = close
        """Stop following the pool (the index is not used any more)."""

    def _observe(self, change: Any) -> None:
        if self._lists:
            self._dirty.update(change.updated)
            self._dirty.update(change.removed)

    def _room(self, key: PoolKey, before: int) -> None:
        if self._lists:
            self._room_dirty.setdefault(key, before)

    def _hazard(self, horizon: float) -> Hazard | None:
        return hazard_over(self.pool.hazard, self.policy, horizon)

    def _risk(self, risk: RiskLevel | None) -> RiskLevel:
        return risk or self.policy.scoring.risk

    def _horizon(self, horizon: float) -> float:
        """Every horizon scores alike without an estimator in use: one list for all."""
        return horizon if by_horizon(self.pool.hazard, self.policy) else DEFAULT_HORIZON

    def sorted(self, gpu: str, market: Market, horizon: float = DEFAULT_HORIZON,
               risk: RiskLevel | None = None, *, part: Part = WHOLE) -> list[_Entry]:
        """(unit cost, pool key, offer) of the priced offers of `gpu` in `market`,
        scored over `horizon` hours at risk level `risk`, cheapest first, as of now (an
        offer re-read unchanged since may be newer in the pool: `ResourcePool.get`);
        only those of `part` (`Part`)."""
        return self._list((gpu, market, self._horizon(horizon), self._risk(risk)), part)

    def by_price(self, gpu: str, market: Market, *, part: Part = WHOLE) -> list[_Entry]:
        """`sorted` in order of price per GPU-hour, which is its first item (the pool's
        order, `ResourcePool.by_gpu`): for the walks that end at a price cap."""
        return self._list((gpu, market, 0.0, PRICE), part)

    def _list(self, where: _Where, part: Part) -> list[_Entry]:
        self._sync()
        got = self._lists.get(where)
        if got is None:
            gpu, market, h, level = where
            got = sorted(((self._cost(o, h, level), o.pool, o)
                          for o in self.pool.by_gpu(gpu, market)), key=_first_two)
            self._lists[where] = got
            self._made.add(where)
            self._parts[where] = {}
            placed = self._placed
            for entry in got:
                key = entry[1]
                placed[key] = (*placed.get(key, ()), where, entry)
            self._part(where, ROOMY)  # kept from the start: most walks read it
        return self._part(where, part)

    def _sync(self) -> None:
        """Every list as the pool is now: all of them again after a refresh of the hazard
        estimator (or another one), the offers changed since placed again, the parts by
        room kept (`_reroom`)."""
        self._drop_if_refreshed()
        if self._dirty:
            self._place_again()
        if self._room_dirty:
            self._reroom()

    def _drop_if_refreshed(self) -> None:
        """Every list dropped after a refresh of the hazard estimator (or another one):
        made again when next asked for (or by `prepare`)."""
        hazard = self.pool.hazard
        seen = (id(hazard), hazard.refreshes if hazard is not None else 0)
        if seen != self._hazard_seen:
            self.scans = {}
            self._lists.clear()
            self._parts.clear()
            self._loans.forget()
            self._placed.clear()
            self._dirty.clear()
            self._room_dirty.clear()
            self._hazard_seen = seen

    def _cost(self, offer: Offer, h: float, level: str) -> float:
        """What a list orders `offer` by: its price per GPU-hour in the list by price,
        else its `unit_cost` over `h` hours at risk level `level`."""
        if level == PRICE:
            return offer.price_per_hour / offer.gpus  # type: ignore[operator]
        return unit_cost(offer, self.policy.for_risk(level), self._hazard(h))  # type: ignore[arg-type]

    def _part(self, where: _Where, part: Part) -> list[_Entry]:
        if part == WHOLE:
            return self._lists[where]
        parts = self._parts[where]
        got = parts.get(part)
        if got is None:
            if not part.sized and sum(not k.sized for k in parts) >= PARTS:
                # The parts by room stay; of the others the oldest goes (made again if
                # asked for again).
                del parts[next(k for k in parts if not k.sized)]
            got = parts[part] = part.of(self._lists[where], self.pool.held)
        return got

    def covers(self, horizon: float, risk: RiskLevel | None = None) -> bool:
        """Every horizon's and level's list is made when first asked for."""
        return True

    def scans_now(self) -> dict[Hashable, Any]:
        """`scans`, of the lists as the pool is now (the changes since made first)."""
        self._sync()
        return self.scans

    def places(self, c: Constraints) -> Callable[[str, str], bool]:
        """The test of the regions a verdict allows (`Constraints.region_ok`), one per kind
        of verdict (`Constraints.regions_key`): the part of a list within them
        (`Part.places`) serves every verdict of that kind alike."""
        return _places(self._verdicts, c)

    def frozen(self, horizons: Iterable[float] = (DEFAULT_HORIZON,),
               risks: Iterable[RiskLevel | None] = (None,)) -> FrozenCosts:
        """Every list for these horizons and risk levels, up to date now: for a batch
        placed in a worker thread on a `Snapshot` while the pool and this index go on
        changing (on the loop). Lent, not copied: the index copies a list lent out
        before it next changes it (`_place_again`)."""
        # Lists of a model the pool no longer has any offer of are not asked for below:
        # the changes that emptied them are made here.
        self._sync()
        # The parts the batches of earlier freezes made for themselves, kept from now on
        # (made once here, on the loop, and then kept as the pool changes).
        asked, self._asked = self._asked, set()
        for where, part in asked:
            if where in self._lists:
                self._part(where, part)
        want = sorted({self._horizon(h) for h in horizons})
        levels = sorted({self._risk(r) for r in risks})
        for h in want:
            self._hazard(h)  # an estimator's view is made here, on the loop, not in a thread
        for where in self._wheres(want, levels):
            self._list(where, WHOLE)
        lists = {k: v for k, v in self._lists.items()
                 if k[3] == PRICE or (k[2] in want and k[3] in levels)}
        self._loans.borrow()
        self._loans.lend(lists)
        self.pool.borrow()  # for `held_now`
        return FrozenCosts(self.policy, lists,
                           normalise=not by_horizon(self.pool.hazard, self.policy),
                           memo=self.memo, parts={k: dict(self._parts[k]) for k in lists},
                           held=self.pool.held_now(), scans=self.scans,
                           asked=self._asked, verdicts=self._verdicts,
                           on_return=self._returned)

    def _returned(self) -> None:
        """A frozen index is done (`FrozenCosts.return_loan`): once none is out, no list
        is lent, and a change no longer copies one first (`_to_change`)."""
        self._loans.returned()
        self.pool.return_loan()

    def unmade(self, horizons: Iterable[float] = (DEFAULT_HORIZON,),
               risks: Iterable[RiskLevel | None] = (None,)) -> int:
        """The entries `frozen` for these horizons and risk levels would make at once, on
        the event loop: those of the lists not made (yet, or again: a refresh of the
        hazard estimator, every ten minutes, drops them all; `prepare` makes them again
        a list a step)."""
        self._drop_if_refreshed()
        want = {self._horizon(h) for h in horizons}
        levels = {self._risk(r) for r in risks}
        return sum(len(self.pool.by_gpu(w[0], w[1]))
                   for w in self._wheres(want, levels) if w not in self._lists)

    def _wheres(self, horizons: Iterable[float], levels: Iterable[str]) -> list[_Where]:
        """Every list of the pool's models for these horizons and levels (made by
        `_horizon`, `_risk`), and each one's list by price."""
        return [where for gpu in self.pool.gpus() for market in MARKETS
                for where in ((gpu, market, 0.0, PRICE),
                              *((gpu, market, h, level) for h in horizons for level in levels))]

    def prepare(self) -> Iterator[None]:
        """Make the lists that batches will ask for before they do, one at a time,
        yielding after each (a caller on the event loop lets the rest run between them):
        a list is made when first asked for, and a refresh of the hazard estimator (every
        few minutes) drops them all, so the next batch would make every list at once —
        tens of milliseconds a list, hundreds for a batch, all on the event loop. Made:
        every list made since the start and missing now; at first, those of the default
        horizon at the policy's own risk level. Then the pool's lists by GPU that a
        `Snapshot` lends (`ResourcePool.unindexed`). First of all, the offers changed
        since are placed again, `PLACE_STEP` a step."""
        self._drop_if_refreshed()
        while len(self._dirty) > PLACE_STEP:
            self._place_again(PLACE_STEP)
            yield
            self._drop_if_refreshed()  # a refresh meanwhile: the lists go, and the changes
        self._sync()
        wanted = list(self._made) if self._made else self._wheres(
            [self._horizon(DEFAULT_HORIZON)], [self._risk(None)])
        for where in wanted:
            if where not in self._lists:  # (`_list` applies the changes since, first)
                self._list(where, WHOLE)
                yield
        # The pool's own lists that a `Snapshot` lends, for a batch in a worker thread:
        # the pool builds one when first asked for, and keeps it.
        for gpu, market in self.pool.unindexed(_BOTH_AND_EACH):
            self.pool.by_gpu(gpu, market)
            yield

    def _to_change(self, where: _Where) -> tuple[list[_Entry], dict[Part, list[_Entry]]]:
        """The list at `where` and its parts, to be changed (copies of them once lent
        out)."""
        if self._loans.take_back(where):
            self._lists[where] = list(self._lists[where])
            self._parts[where] = {k: list(v) for k, v in self._parts[where].items()}
        return self._lists[where], self._parts[where]

    def _place_again(self, limit: int | None = None) -> None:
        """The offers changed since placed again in every list (at most `limit` of them;
        the others stay to be placed, and every reader places them first: `_sync`)."""
        if limit is None or len(self._dirty) <= limit:
            dirty, self._dirty = self._dirty, set()
        else:
            dirty = set(itertools.islice(self._dirty, limit))
            self._dirty -= dirty
        self.scans = {}
        for key in dirty:  # placed again below, in every part as the pool is now
            self._room_dirty.pop(key, None)
        lists, placed, held = self._lists, self._placed, self.pool.held
        scored = {w[2:] for w in lists}  # (horizon, risk level)
        for key in dirty:
            for where, old in _pairs(placed.pop(key, ())):
                u = old[0]
                entries, parts = self._to_change(where)
                _remove(entries, u, key)
                for within in parts.values():
                    _remove(within, u, key)
            offer = self.pool.get(key)
            if offer is None or offer.price_per_hour is None or offer.gpus <= 0:
                continue
            for h, level in scored:
                where = (offer.gpu, key.market, h, level)
                if where not in lists:
                    continue  # that list is built when first asked for
                u = self._cost(offer, h, level)
                entry = (u, key, offer)
                entries, parts = self._to_change(where)
                _put(entries, entry)
                for part, got in parts.items():
                    if part.admits(entry, held):
                        _put(got, entry)
                placed[key] = (*placed.get(key, ()), where, entry)

    def _reroom(self) -> None:
        """Keep the parts by room (`Part.room`) as the holdings of the pools changed since
        are now: an offer out of those it has no more room for, back into those it has
        room for again. Only the parts whose size lies between what the pool held then
        and holds now can change; a list is copied (once lent) only when one does."""
        keys, self._room_dirty = self._room_dirty, {}
        held = self.pool.held
        for key, before in keys.items():
            now = held(key)
            offer = self.pool.get(key)
            if now == before or offer is None:
                continue
            for where, entry in _pairs(self._placed.get(key, ())):
                u = entry[0]
                moved = [part for part in self._parts[where] if part.room and
                         no_room(offer, before, part.room) != no_room(offer, now, part.room)]
                if not moved:
                    continue
                entries, parts = self._to_change(where)
                i = _at(entries, u, key)
                if i == len(entries) or entries[i][1] != key:
                    continue
                for part in moved:
                    got = parts[part]
                    if not part.admits(entry, held):
                        _remove(got, u, key)
                    elif not _holds(got, u, key):
                        _put(got, entry)


class FrozenCosts:
    """A `CostIndex` as it was at one moment (`CostIndex.frozen`), for the horizons and
    risk levels it was frozen for (`normalise`: every horizon scores alike, one list
    serves all)."""

    def __init__(self, policy: Policy, lists: dict[_Where, list[_Entry]],  # noqa: PLR0913
                 normalise: bool = False, memo: CostMemo | None = None,
                 parts: dict[_Where, dict[Part, list[_Entry]]] | None = None,
                 held: Mapping[PoolKey, int] | None = None,
                 scans: dict[Hashable, Any] | None = None,
                 asked: set[tuple[_Where, Part]] | None = None,
                 verdicts: dict[Hashable, Callable[[str, str], bool]] | None = None,
                 on_return: Callable[[], None] | None = None) -> None:
        self.policy = policy
        self._on_return = on_return
        """Tells the index this one is done (`return_loan`)."""
        self.memo = memo if memo is not None else CostMemo()
        """The index's `CostMemo` (a batch in a worker thread adds to it; entries are
        per offer object, so one made from a later reading is never taken for an
        earlier one)."""
        self._lists = lists
        self._parts = parts if parts is not None else {}
        """Each list's parts when frozen; those asked for later are made here."""
        self._held = held if held is not None else {}  # the holdings when frozen
        self.scans = scans if scans is not None else {}
        """The index's `CostIndex.scans` when frozen (of the lists frozen)."""
        self._asked = asked if asked is not None else set()
        """The parts made here, for the index to keep from its next freeze on."""
        self._verdicts = verdicts if verdicts is not None else {}
        """The index's tests of a verdict's regions (`CostIndex.places`)."""
        self._normalise = normalise
        self._horizons = {w[2] for w in lists if w[3] != PRICE}
        self._risks = {w[3] for w in lists if w[3] != PRICE} or {policy.scoring.risk}

    def return_loan(self) -> None:
        """Done reading what the index lent (`CostIndex.frozen`); once only."""
        on_return, self._on_return = self._on_return, None
        if on_return is not None:
            on_return()

    def _held_of(self, key: PoolKey) -> int:
        return self._held.get(key, 0)

    def scans_now(self) -> dict[Hashable, Any]:
        """`scans`: of the lists frozen."""
        return self.scans

    def places(self, c: Constraints) -> Callable[[str, str], bool]:
        """`CostIndex.places` (the index's own tests)."""
        return _places(self._verdicts, c)

    def covers(self, horizon: float, risk: RiskLevel | None = None) -> bool:
        """Whether lists for `horizon` and risk level `risk` were frozen."""
        return (risk or self.policy.scoring.risk) in self._risks and \
            (self._normalise or not self._horizons or horizon in self._horizons)

    def sorted(self, gpu: str, market: Market, horizon: float = DEFAULT_HORIZON,
               risk: RiskLevel | None = None, *, part: Part = WHOLE) -> list[_Entry]:
        level = risk or self.policy.scoring.risk
        if level not in self._risks:
            raise KeyError(f"costs frozen for risk levels {sorted(self._risks)}, "
                           f"not {level!r}")
        if self._normalise:
            horizon = DEFAULT_HORIZON
        elif self._horizons and horizon not in self._horizons:
            raise KeyError(f"costs frozen for horizons {sorted(self._horizons)}, "
                           f"not {horizon:g} h")
        return self._part((gpu, market, horizon, level), part)

    def by_price(self, gpu: str, market: Market, *, part: Part = WHOLE) -> list[_Entry]:
        """`CostIndex.by_price` as it was when frozen."""
        return self._part((gpu, market, 0.0, PRICE), part)

    def _part(self, where: _Where, part: Part) -> list[_Entry]:
        entries = self._lists.get(where, [])
        if part == WHOLE:
            return entries
        parts = self._parts.setdefault(where, {})
        got = parts.get(part)
        if got is None:
            got = parts[part] = part.of(entries, self._held_of)
            self._asked.add((where, part))
        return got


Costs = CostIndex | FrozenCosts


def hazard_for(view: PoolView, policy: Policy, request: PlaceRequest) -> Hazard | None:
    """The hazard estimates a request is scored with: the view's, over the request's own
    horizon (`broker.market.hazard.horizon_bucket` of its `duration_hours`)."""
    return hazard_over(view.hazard, policy, horizon_bucket(request.duration_hours))
