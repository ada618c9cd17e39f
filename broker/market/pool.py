"""The unified resource pool: every adapter's offers in one place.

The poller owns the data: it replaces one *slice* (adapter, region) at a time with what
that poll returned. Everyone else reads the pool or subscribes to its changes.

The pool also tracks what the broker itself has taken — instances held by active
leases — so that placement never hands out more of a pool than its estimated free
capacity, and pools in a cool-down after a failure.
"""

from __future__ import annotations

import bisect
import dataclasses
import operator
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from broker.market.changes import PoolChange, SliceId
from broker.market.hazard import HazardEstimator
from broker.market.loans import Loans
from broker.model import Market, Offer, Placement, PoolKey, utcnow

_STALE_CACHE = timedelta(seconds=1)
_HELD_NOW = "held_now"  # `held_now` among the parts the pool lends (`Loans`)


def _priced(o: Offer) -> bool:
    return o.price_per_hour is not None and o.gpus > 0


_STATE = operator.attrgetter(*(f.name for f in dataclasses.fields(Offer)
                                if f.name not in ("observed_at", "rate_observed_at")))
"""What a reading of a pool says, compared by `same_state`: every field of `Offer` (a
field added to it is compared too) but when it was read."""


def same_state(a: Offer, b: Offer) -> bool:
    """Whether two readings of a pool say the same: every field but `observed_at` (a
    cloud that stamps each reading, as AWS does every spot price, changes nothing) and
    `rate_observed_at` (a rate source republished with the same rates changes nothing)."""
    return _STATE(a) == _STATE(b)


def _order(o: Offer) -> tuple[float, PoolKey]:
    return (o.price_per_hour / o.gpus, o.pool)  # type: ignore[operator]


def _same_place(a: Offer, b: Offer) -> bool:
    """Whether two readings of a pool are counted alike and indexed in the same place
    (`_count`, `_index`): same GPU model, known or not alike, and either both unpriced or
    both at the same price per GPU."""
    if a.gpu != b.gpu or a.gpu_known != b.gpu_known or _priced(a) != _priced(b):
        return False
    return not _priced(a) or _order(a) == _order(b)


@dataclass(slots=True)
class SliceHealth:
    slice: SliceId
    ok: bool = False
    last_ok_at: datetime | None = None
    last_error: str | None = None
    failures: int = 0
    offers: int = 0


Listener = Callable[[PoolChange], None]


class ResourcePool:
    def __init__(self, *, stale_after_seconds: float,
                 clock: Callable[[], datetime] = utcnow) -> None:
        self.stale_after = timedelta(seconds=stale_after_seconds)
        self._clock = clock
        self.started_at = clock()
        self._offers: dict[PoolKey, Offer] = {}
        self._slice_of: dict[PoolKey, SliceId] = {}
        # Each slice's pools, as a tuple: a set of the tens of keys a slice has costs four
        # times the bytes, and is only ever read whole.
        self._slices: dict[SliceId, tuple[PoolKey, ...]] = {}
        self._health: dict[SliceId, SliceHealth] = {}
        self._keys_by_gpu: dict[str, set[PoolKey]] = {}
        # Offers per (cloud, GPU model, market, whether priced and of a known model),
        # kept with `_keys_by_gpu` (`census`).
        self._counts: Counter[tuple[str, str, Market, bool]] = Counter()
        # Priced offers per (GPU, market) and per GPU (market None), kept sorted by
        # price per GPU-hour: built on first use, then updated offer by offer as polls
        # change them (a poll changes a few dozen offers; re-sorting thousands each time
        # would cost more than placing).
        self._by_gpu: dict[tuple[str, Market | None], list[Offer]] = {}
        # Those of `_by_gpu` lent out (`lend`), and `held_now` (as `_HELD_NOW`), to
        # readers in worker threads: copied before their next change.
        self._loans = Loans()
        self._held: Counter[PoolKey] = Counter()
        # `held` of every pool in `_held`, kept as they change (`held_now`); copied before
        # the next change once lent out.
        self._held_now: dict[PoolKey, int] = {}
        # Told of each pool whose `held` changed (`subscribe_room`).
        self._room_listeners: list[Callable[[PoolKey, int], None]] = []
        self._held_targets: dict[PoolKey, Counter[str]] = {}
        self._owned: dict[SliceId, int] = {}
        self._held_at_poll: dict[PoolKey, Counter[str]] = {}
        # Paid-for pools (offers with targets) and the instances a new lease may have in
        # each, summed over its targets: read on placement's hot path (`held`), so
        # computed once per change of the offer or of the broker's holdings on it.
        self._owned_keys: set[PoolKey] = set()
        self._rooms: dict[PoolKey, int] = {}
        self.on_holdings: Callable[[], None] | None = None
        """Called when the broker's holdings of paid-for capacity changed (the idle
        owned GPU-hours metric integrates over time)."""
        self._cooldown: dict[PoolKey, datetime] = {}
        self._listeners: list[Listener] = []
        self._stale_cache: tuple[datetime | None, set[SliceId]] = (None, set())
        self.hazard: HazardEstimator | None = None
        """The spot pools' history that placement scores with (`broker.market.hazard`), fed with
        this pool's changes by `feed_hazard`; None: the offers' own signals."""

    # --- writing (the poller) -------------------------------------------------------

    def replace(self, slice_id: SliceId, offers: Iterable[Offer], *,
                polled_at: datetime | None = None) -> PoolChange:
        """Replace a slice with a fresh poll's offers and tell the listeners. `polled_at`:
        when that poll was made, if not now (a new leader taking over its predecessor's
        last polls): the slice's freshness counts from then."""
        new = {o.pool: o for o in offers}
        old_keys = self._slices.get(slice_id, ())
        updated: dict[PoolKey, Offer | None] = {}
        removed: dict[PoolKey, Offer] = {}
        for key in [k for k in old_keys if k not in new]:
            gone = self._offers.pop(key)
            del self._slice_of[key]
            removed[key] = gone
            self._forget(key, gone)
        for key, offer in new.items():
            prev = self._offers.get(key)
            if prev is not None and same_state(prev, offer):
                # Only re-read (a new observed_at): not a change; the index keeps its
                # place and takes the newer reading.
                self._swap(prev, offer)
            elif prev != offer:
                updated[key] = prev
                self._changed(key, prev, offer)
            self._offers[key] = offer
            was = self._slice_of.get(key)
            if was != slice_id:
                if was is not None:  # offered by another slice until now: this one's now
                    self._slices[was] = tuple(k for k in self._slices[was] if k != key)
                    if prev is not None and prev.targets:
                        self._owned[was] -= prev.owned_gpus
                self._slice_of[key] = slice_id
        self._slices[slice_id] = tuple(new)
        self._owned[slice_id] = sum(o.owned_gpus for o in new.values() if o.targets)
        for key, offer in new.items():
            self._rooms.pop(key, None)
            if offer.targets:
                self._held_at_poll[key] = Counter(self._held_targets.get(key, {}))
                self._owned_keys.add(key)
            else:
                self._held_at_poll.pop(key, None)
                self._owned_keys.discard(key)
        for key in removed:
            self._held_at_poll.pop(key, None)
            self._owned_keys.discard(key)
            self._rooms.pop(key, None)
        for key in (*removed, *new):
            self._note_held(key)  # a paid-for pool's `held` reads its offer
        health = self._health.setdefault(slice_id, SliceHealth(slice_id))
        health.ok, health.last_error = True, None
        health.last_ok_at = self._clock() if polled_at is None else polled_at
        self._stale_cache = (None, set())
        health.failures, health.offers = 0, len(new)
        change = PoolChange(slice_id, updated, removed, new)
        for listener in list(self._listeners):
            listener(change)
        return change

    def mark_failed(self, slice_id: SliceId, error: str) -> bool:
        """Record a failed poll; the slice's offers stay until they go stale. Returns True
        when this changes the slice from healthy (or unknown) to failing."""
        health = self._health.setdefault(slice_id, SliceHealth(slice_id))
        was_ok = health.ok or health.failures == 0
        health.ok, health.last_error = False, error
        health.failures += 1
        return was_ok

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def subscribe_timed(self, listener: Callable[[PoolChange, float], None]
                        ) -> Callable[[], None]:
        """Like `subscribe`, with each change's time on the pool's clock (epoch seconds).
        Returns the unsubscribe."""
        clock = self._clock
        return self.subscribe(lambda change: listener(change, clock().timestamp()))

    def feed_hazard(self, hazard: HazardEstimator) -> Callable[[], None]:
        """Feed `hazard` this pool's changes as they land (placement scores with it once
        it is also this pool's `hazard`). Returns the unsubscribe."""
        return self.subscribe_timed(hazard.observe_change)

    # --- the broker's own holdings -----------------------------------------------------

    def hold(self, key: PoolKey, instances: int,
             targets: Iterable[tuple[str, int]] = ()) -> None:
        self._held[key] += instances
        for target, n in targets:
            self._held_targets.setdefault(key, Counter())[target] += n
        self._rooms.pop(key, None)
        self._note_held(key)
        if self.on_holdings is not None and key.market is Market.RESERVED:
            self.on_holdings()

    def unhold(self, key: PoolKey, instances: int,
               targets: Iterable[tuple[str, int]] = ()) -> None:
        self._held[key] -= instances
        if self._held[key] <= 0:
            del self._held[key]
        by_target = self._held_targets.get(key)
        if by_target is not None:
            for target, n in targets:
                by_target[target] -= n
                if by_target[target] <= 0:
                    del by_target[target]
            if not by_target:
                del self._held_targets[key]
        self._rooms.pop(key, None)
        self._note_held(key)
        if self.on_holdings is not None and key.market is Market.RESERVED:
            self.on_holdings()

    def take(self, placement: Placement) -> Placement:
        """Hold a decided placement's instances; on paid-for capacity, assign it the
        reservations or servers it launches into first (`Placement.targets`)."""
        placement = self.assign(placement)
        self.hold(placement.pool, placement.instances, placement.targets)
        return placement

    def give_back(self, placement: Placement) -> None:
        self.unhold(placement.pool, placement.instances, placement.targets)

    def assign(self, placement: Placement) -> Placement:
        """`placement` with the targets its instances go to: the offer's targets in the
        order the adapter lists them, each filled as far as it has room (what its cloud
        says is free, and what the broker's leases do not hold); none are draining. A
        pool without targets, or a placement that has them already: as it is."""
        offer = self._offers.get(placement.pool)
        if offer is None or not offer.targets or placement.targets:
            return placement
        left, out = placement.instances, []
        rooms = [(t.id, self._room(placement.pool, offer, *t)) for t in offer.targets]
        # One target that holds it all, the snuggest (a lease of several slices stays
        # on one server); else each in order, as far as it has room.
        whole = min(((room, i) for i, (_, room) in enumerate(rooms) if room >= left),
                    default=None)
        if whole is not None:
            return dataclasses.replace(placement, targets=((rooms[whole[1]][0], left),))
        for target, room in rooms:
            if left <= 0:
                break
            n = min(left, room)
            if n > 0:
                out.append((target, n))
                left -= n
        return dataclasses.replace(placement, targets=tuple(out))

    def _room(self, key: PoolKey, offer: Offer, target: str, size: int, free: int) -> int:
        """A target's instances a new lease may have. Its cloud's free count (`free`)
        counts everyone's running instances, the broker's leases' too once they run; the
        instances the broker took since that count was read are taken as not running yet
        and come off it. Never more than its size less what the broker holds on it, and
        nothing on a draining server."""
        if target in offer.draining:
            return 0
        held_map = self._held_targets.get(key)
        held = held_map[target] if held_map else 0
        before = self._held_at_poll.get(key)
        since = max(0, held - (before[target] if before else 0))
        return max(0, min(free - since, size - held))

    def held(self, key: PoolKey) -> int:
        """Instances of `key` the broker's leases take from its `capacity`. On paid-for
        capacity the cloud's free count may or may not include them yet (a reservation
        counts an instance once it runs), so that is what per target room leaves."""
        if key in self._owned_keys:
            offer = self._offers[key]
            if offer.capacity is not None:
                return max(0, offer.capacity - self._total_room(key, offer))
        return self._held.get(key, 0)

    def _total_room(self, key: PoolKey, offer: Offer) -> int:
        room = self._rooms.get(key)
        if room is None:
            room = self._rooms[key] = sum(self._room(key, offer, *t) for t in offer.targets)
        return room

    def held_pools(self) -> set[PoolKey]:
        return set(self._held)

    def held_now(self) -> Mapping[PoolKey, int]:
        """`held` of every pool it is not 0 for, as of now — a paid-for pool's too when
        the broker holds none of it and its cloud counts some of it used — not to be
        changed. While a reader in a worker thread has `borrow`ed (a placement
        `Snapshot`), lent: the pool copies it before its next change instead of the
        reader copying it every time. A reader on the event loop reads it at once."""
        if self._loans.out:
            self._loans.lend((_HELD_NOW,))
        return self._held_now

    def borrow(self) -> None:
        """A reader in a worker thread (a placement `Snapshot`) is to read lists by GPU
        (`lend`) and the holdings (`held_now`) while the event loop changes the pool:
        what it takes is copied before its next change until it is returned
        (`return_loan`)."""
        self._loans.borrow()

    def return_loan(self) -> None:
        """A reader that `borrow`ed is done with what it took. Once every one is, nothing
        is lent: a change no longer copies a list of thousands of offers (nor the
        holdings) that no reader holds, and the young collections do not walk such
        copies. A borrower that never returns it (one whose thread may still read) keeps
        every later loan copied first, as it would be without this."""
        self._loans.returned()

    def _note_held(self, key: PoolKey) -> None:
        """`held_now` after a change of what `held(key)` reads."""
        if self._loans.take_back(_HELD_NOW):
            self._held_now = dict(self._held_now)
        before = self._held_now.get(key, 0)
        held = self.held(key) if key in self._held or key in self._owned_keys else 0
        if held:
            self._held_now[key] = held
        else:
            self._held_now.pop(key, None)
        for listener in self._room_listeners:
            listener(key, before)

    def subscribe_room(self, listener: Callable[[PoolKey, int], None]
                       ) -> Callable[[], None]:
        """`listener(key, before)` whenever what `held(key)` may read changed (the broker's
        holdings of pool `key`, or what its paid-for targets count used), `before` what
        it read until then: its room for a request may have changed
        (`broker.placement.room.no_room`). Returns the unsubscribe."""
        self._room_listeners.append(listener)
        return lambda: self._room_listeners.remove(listener)

    @property
    def owned_gpus(self) -> int:
        """The paid-for GPUs the adapters list (reservations and private servers that
        are up), free or not."""
        return sum(self._owned.values())

    def idle_owned_gpus(self) -> int:
        """Paid-for GPUs no lease of the broker holds and that could be launched now
        (per target: what its cloud says is free, less what the broker holds; draining
        servers count as busy)."""
        return sum(self._offers[k].gpus * self._total_room(k, self._offers[k])
                   for k in self._owned_keys)

    def held_targets(self, key: PoolKey) -> dict[str, int]:
        return dict(self._held_targets.get(key, {}))

    def free_capacity(self, key: PoolKey) -> int | None:
        """Estimated free instances less what the broker's leases hold; None if unknown."""
        offer = self._offers.get(key)
        if offer is None:
            return 0
        if offer.capacity is None:
            return None
        return max(0, offer.capacity - self.held(key))

    def cool_down(self, key: PoolKey, seconds: float) -> None:
        """Keep new placements off `key` for a while (after a preemption or failure)."""
        self._cooldown[key] = self._clock() + timedelta(seconds=seconds)

    # --- reading -------------------------------------------------------------------

    def _count(self, offer: Offer, n: int) -> None:
        key = offer.pool
        where = (key.cloud, offer.gpu, key.market, offer.gpu_known and _priced(offer))
        if left := self._counts[where] + n:
            self._counts[where] = left
        else:
            del self._counts[where]

    def census(self) -> tuple[dict[tuple[str, Market], int],
                              dict[tuple[str, str, Market], float]]:
        """The offers per (cloud, market), and the cheapest price per GPU-hour per
        (cloud, GPU model, market) of the known models, without reading every offer
        (tens of thousands, on the event loop, at each metrics scrape): the counts are
        kept as polls change the pool, and each model's cheapest per cloud are the first
        of its sorted offers (`by_gpu`) of that cloud."""
        counts: dict[tuple[str, Market], int] = {}
        clouds: dict[tuple[str, Market], set[str]] = {}
        for (cloud, gpu, market, listed), n in self._counts.items():
            counts[(cloud, market)] = counts.get((cloud, market), 0) + n
            if listed:  # some offer of this cloud has a price: the walk below finds it
                clouds.setdefault((gpu, market), set()).add(cloud)
        cheapest: dict[tuple[str, str, Market], float] = {}
        for (gpu, market), wanted in clouds.items():
            for o in self.by_gpu(gpu, market):  # priced, cheapest per GPU-hour first
                cloud = o.pool.cloud
                if cloud in wanted and o.gpu_known:
                    cheapest[(cloud, gpu, market)] = o.price_per_hour / o.gpus  # type: ignore[operator]
                    wanted.discard(cloud)
                    if not wanted:
                        break
        return counts, cheapest

    def get(self, key: PoolKey) -> Offer | None:
        return self._offers.get(key)

    def __len__(self) -> int:
        return len(self._offers)

    def __iter__(self) -> Iterator[Offer]:
        return iter(list(self._offers.values()))

    def slice_offers(self, slice_id: SliceId) -> list[Offer]:
        return [self._offers[k] for k in self._slices.get(slice_id, ())]

    def slice_of(self, key: PoolKey) -> SliceId | None:
        return self._slice_of.get(key)

    def failing(self, slice_id: SliceId) -> bool:
        h = self._health.get(slice_id)
        return h is not None and not h.ok and h.failures > 0

    def health(self) -> list[SliceHealth]:
        return list(self._health.values())

    def is_fresh(self, key: PoolKey, now: datetime) -> bool:
        """An offer is fresh while its slice's last good poll is younger than stale_after."""
        slice_id = self._slice_of.get(key)
        if slice_id is None:
            return False
        last = self._health[slice_id].last_ok_at
        return last is not None and now - last <= self.stale_after

    def fresh_slices(self, now: datetime) -> set[SliceId]:
        return {
            s for s, h in self._health.items()
            if h.last_ok_at is not None and now - h.last_ok_at <= self.stale_after
        }

    def age_seconds(self, key: PoolKey, now: datetime) -> float | None:
        slice_id = self._slice_of.get(key)
        last = self._health[slice_id].last_ok_at if slice_id else None
        return None if last is None else (now - last).total_seconds()

    def by_gpu(self, gpu: str, market: Market | None = None) -> Sequence[Offer]:
        """Priced offers of `gpu` (in `market`, or both), cheapest per GPU-hour first,
        fresh or not."""
        index = self._by_gpu.get((gpu, market))
        if index is None:
            offers = (self._offers[k] for k in self._keys_by_gpu.get(gpu, ()))
            index = self._by_gpu[(gpu, market)] = sorted(
                (o for o in offers if _priced(o) and (market is None or o.pool.market is market)),
                key=_order)
        return index

    def unindexed(self, markets: Iterable[Market | None]) -> list[tuple[str, Market | None]]:
        """(model, market) of the pool's models whose list by GPU (`by_gpu`) in these
        markets (None: both) is not built yet: built on first use, then kept."""
        built = self._by_gpu
        return [(gpu, m) for gpu in self.gpus() for m in markets if (gpu, m) not in built]

    def lend(self, gpu: str, market: Market | None = None) -> Sequence[Offer]:
        """`by_gpu`, not to be changed: lent out (a placement `Snapshot` reads it in a
        worker thread), so the pool copies it before its next change instead of the
        reader copying it every time."""
        index = self.by_gpu(gpu, market)
        self._loans.lend(((gpu, market),))
        return index

    def _views(self, offer: Offer) -> list[list[Offer]]:
        """The built indexes `offer` belongs in, to be changed (copies of those lent)."""
        views = []
        for market in (None, offer.pool.market):
            where = (offer.gpu, market)
            index = self._by_gpu.get(where)
            if index is not None:
                if self._loans.take_back(where):
                    index = self._by_gpu[where] = list(index)
                views.append(index)
        return views

    def _index(self, offer: Offer) -> None:
        if _priced(offer):
            for index in self._views(offer):
                bisect.insort(index, offer, key=_order)

    def _changed(self, key: PoolKey, prev: Offer | None, offer: Offer) -> None:
        """A changed reading of pool `key` (`prev`: the last one; None: a new pool) in the
        counts and the indexes."""
        if prev is not None and _same_place(prev, offer):
            # Counted alike and in the same place of every index: the new reading takes
            # the old one's place (half of a sim poll's changes keep their price).
            self._swap(prev, offer)
            return
        if prev is not None:
            self._forget(key, prev)
        self._keys_by_gpu.setdefault(offer.gpu, set()).add(key)
        self._count(offer, 1)
        self._index(offer)

    def _forget(self, key: PoolKey, offer: Offer) -> None:
        """Pool `key`'s reading `offer` out of the counts and the indexes."""
        self._keys_by_gpu[offer.gpu].discard(key)
        self._count(offer, -1)
        self._unindex(offer)

    def _swap(self, old: Offer, new: Offer) -> None:
        """Put `new` where `old` is in the indexes (both sort the same)."""
        if _priced(old):
            for index in self._views(old):
                i = bisect.bisect_left(index, _order(old), key=_order)
                if i < len(index) and index[i] is old:
                    index[i] = new

    def _unindex(self, offer: Offer) -> None:
        if _priced(offer):
            for index in self._views(offer):
                i = bisect.bisect_left(index, _order(offer), key=_order)
                if i < len(index) and index[i] is offer:
                    del index[i]

    def stale_slices(self, now: datetime) -> set[SliceId]:
        """Slices whose offers are too old to place on (usually none). Cached for a
        second: staleness is measured in minutes, and placement asks per request."""
        cached_at, cached = self._stale_cache
        if cached_at is not None and timedelta(0) <= now - cached_at < _STALE_CACHE:
            return cached
        stale = {s for s, h in self._health.items()
                 if (now - h.last_ok_at > self.stale_after if h.last_ok_at is not None
                     else not self.in_grace(now))}
        self._stale_cache = (now, stale)
        return stale

    def in_grace(self, now: datetime) -> bool:
        """Whether the pool is younger than `stale_after`: a slice that has not had a
        good poll yet is unknown, not stale, until then (a restarted daemon must not
        judge a cloud whose first poll is still on its way)."""
        return now - self.started_at <= self.stale_after

    def cooling(self, now: datetime) -> set[PoolKey]:
        """Pools in a cool-down now."""
        for key in [k for k, until in self._cooldown.items() if until <= now]:
            del self._cooldown[key]
        return set(self._cooldown)

    def gpus(self) -> set[str]:
        return {g for g, keys in self._keys_by_gpu.items() if keys}
