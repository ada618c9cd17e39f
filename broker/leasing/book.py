"""The lease book: every lease's state machine, in memory, mirrored to SQLite.

    active ──renew──▶ active
    active ──failover──▶ active (epoch + 1: a fencing token)
    active ──release──▶ released
    active ──TTL passes without renew──▶ expired
    active ──failover finds nowhere to go──▶ failed

A request split across pools (`gang: false`, `max_parts`) is several leases, one per
pool, each with its own state machine; the request's idempotency finds the head (part 1),
whose `parts` names the others.

Ended leases are final. The book does no I/O: each transition returns the new `Lease`,
which the caller commits to the `StateStore` together with the events it causes.

The book holds the active leases, and of the ended ones only the last `keep_recent` to
end (or to be brought back from the store, `remember`): once the change that ended a
lease is committed (`settle`, called by the broker after each commit), an ended lease
beyond those leaves memory. The store keeps them all, and what must answer a repeated
request (idempotency on scheduler + request_id) or a late verb on an ended lease is
read from it (`broker.leasing.placing` and `broker.leasing.verbs`). Kept in memory for
24 h, ended leases grew the daemon by ~13.5 MiB per 10,000 under churn, and full
collections over them held the event loop for hundreds of milliseconds (#31); the
recent ones keep the common case — a release, then the same release or a renewal
sent again a moment later — out of the store.
"""

from __future__ import annotations

import heapq
import sys
import uuid
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from broker.model import (
    MARKETS,
    OWNED,
    Lease,
    LeaseState,
    Market,
    Placement,
    PlaceRequest,
    PoolKey,
)
from policies.teams import TeamUsage


def _ms(ts: datetime) -> datetime:
    """Lease times are kept at the millisecond precision they are published with, so a
    lease read back from the store equals the one written."""
    return ts.replace(microsecond=ts.microsecond // 1000 * 1000)


class LeaseError(Exception):
    """A transition that the lease's state does not allow; the message says why."""


KEEP_RECENT = 4096
"""Ended leases kept in memory beyond those of the change being committed (~1 KiB
each): about 20 s of ends at 200 a second."""


class LeaseBook:
    def __init__(self, *, keep_ended: timedelta = timedelta(hours=24),
                 keep_recent: int = KEEP_RECENT) -> None:
        self.keep_ended = keep_ended
        """How far back the daemon lists ended leases (`GET /v1/leases`) and clears their
        retained state again after a reconnect; they are read from the store."""
        self.keep_recent = keep_recent
        self._leases: dict[str, Lease] = {}  # the active leases
        # Ended leases in memory, oldest end first (`settle` lets go of the oldest).
        self._ended: OrderedDict[str, Lease] = OrderedDict()
        # Each (scheduler, request_id) of a lease in memory: its lease, a split's head.
        # (scheduler → request_id → lease id): no (scheduler, request_id) tuple per lease.
        self._by_request: dict[str, dict[str, str]] = {}
        # Each pool's active leases: the lease id while it is one, a set once several
        # (a set of one would cost ~200 bytes, and one more tracked object, per lease).
        self._by_pool: dict[PoolKey, str | set[str]] = {}
        # A lazy heap: a renewal pushes a new entry and leaves the old one, skipped when it
        # comes up; compacted when stale entries outnumber the leases (`_put`).
        self._expiry: list[tuple[datetime, str]] = []
        self._teams: dict[str, _TeamTally] = {}
        self._markets: Counter[Market] = Counter()  # the active leases per market

    def load(self, leases: Iterable[Lease]) -> None:
        """Hold `leases` (read from the store). Each placement read back has its own pool
        key (a tuple and four strings), GPU name and price time: leases on the same pool
        share one of each instead, which a book of 100,000 leases notices (#31)."""
        keys: dict[PoolKey, PoolKey] = {}
        times: dict[datetime, datetime] = {}
        for lease in leases:
            p = lease.placement
            key = keys.setdefault(p.pool, p.pool)
            at = times.setdefault(p.price_observed_at, p.price_observed_at)
            gpu = sys.intern(p.gpu)
            if key is not p.pool or at is not p.price_observed_at or gpu is not p.gpu:
                lease = replace(lease, placement=replace(p, pool=key, price_observed_at=at,
                                                         gpu=gpu))
            self._put(lease)
        self.settle()

    # --- reading -------------------------------------------------------------------

    def get(self, lease_id: str) -> Lease | None:
        """The lease if the book holds it: active, or among the recently ended (an ended
        lease not found here may be in the store)."""
        return self._leases.get(lease_id) or self._ended.get(lease_id)

    def find(self, scheduler: str, request_id: str) -> Lease | None:
        lease_id = self._by_request.get(scheduler, {}).get(request_id)
        return self.get(lease_id) if lease_id else None

    def active(self) -> list[Lease]:
        return list(self._leases.values())

    @property
    def active_count(self) -> int:
        return len(self._leases)

    def active_by_market(self) -> dict[Market, int]:
        """How many active leases each market holds (every market, 0s too), kept as they
        change: the metrics read it at each scrape, without a walk over the leases."""
        return {m: self._markets[m] for m in MARKETS}

    def all(self) -> list[Lease]:
        """The active leases and the ended ones still in memory."""
        return [*self._leases.values(), *self._ended.values()]

    @property
    def ended_in_memory(self) -> int:
        return len(self._ended)

    @property
    def in_memory(self) -> int:
        """The leases the book holds: the active ones and the ended ones in memory."""
        return len(self._leases) + len(self._ended)

    def on_pool(self, key: PoolKey) -> list[Lease]:
        ids = self._by_pool.get(key)
        if ids is None:
            return []
        if isinstance(ids, str):
            return [self._leases[ids]]
        return [self._leases[i] for i in ids]

    def team_usage(self, team: str | None) -> TeamUsage:
        """GPUs and decided price per hour that `team`'s active leases hold now."""
        tally = self._teams.get(team) if team else None
        if tally is None:
            return TeamUsage()
        return TeamUsage(tally.gpus, tally.price, dict(tally.by_zone), tally.owned)

    def leased_pools(self) -> set[PoolKey]:
        return set(self._by_pool)

    def next_expiry(self) -> datetime | None:
        while self._expiry:
            at, lease_id = self._expiry[0]
            lease = self._leases.get(lease_id)
            if lease and lease.state is LeaseState.ACTIVE and lease.expires_at == at:
                return at
            heapq.heappop(self._expiry)
        return None

    def due(self, now: datetime) -> list[Lease]:
        """Active leases whose TTL has passed."""
        out = []
        while (at := self.next_expiry()) is not None and at <= now:
            _, lease_id = heapq.heappop(self._expiry)
            out.append(self._leases[lease_id])
        return out

    # --- transitions -----------------------------------------------------------------

    def create(self, request: PlaceRequest, placement: Placement, *, lease_seconds: int,
               cap: float | None, now: datetime) -> Lease:
        now = _ms(now)
        if self._requested(request):
            raise LeaseError(f"request {request.request_id!r} already has a lease")
        lease = Lease(
            lease_id=f"L-{uuid.uuid4().hex}",
            scheduler=request.scheduler,
            request_id=request.request_id,
            request=request,
            placement=placement,
            epoch=1,
            state=LeaseState.ACTIVE,
            created_at=now,
            expires_at=now + timedelta(seconds=lease_seconds),
            lease_seconds=lease_seconds,
            max_price_per_gpu_hour=cap,
            updated_at=now,
        )
        self._put(lease)
        return lease

    def create_split(self, request: PlaceRequest, parts: Iterable[tuple[Placement, int]], *,
                     lease_seconds: int, cap: float | None, now: datetime) -> list[Lease]:
        """One lease per part of a split request: `parts` are (placement, GPUs the part
        covers). Each part's own request asks for its GPUs in one pool (what a failover
        of it places again); all keep the request's id and labels."""
        now = _ms(now)
        if self._requested(request):
            raise LeaseError(f"request {request.request_id!r} already has a lease")
        parts = list(parts)
        ids = tuple(f"L-{uuid.uuid4().hex}" for _ in parts)
        out = []
        for n, ((placement, gpus), lease_id) in enumerate(zip(parts, ids, strict=True), 1):
            out.append(self._put(Lease(
                lease_id=lease_id, scheduler=request.scheduler,
                request_id=request.request_id,
                request=replace(request, gpus=gpus, max_parts=1), placement=placement,
                epoch=1, state=LeaseState.ACTIVE, created_at=now,
                expires_at=now + timedelta(seconds=lease_seconds),
                lease_seconds=lease_seconds, max_price_per_gpu_hour=cap, updated_at=now,
                part=n, parts=ids)))
        return out

    def siblings(self, lease: Lease) -> list[Lease] | None:
        """Every part of `lease`'s split request, in order (None if one is not in memory);
        `[lease]` for a whole request's lease."""
        if not lease.parts:
            return [lease]
        got = [self.get(i) for i in lease.parts]
        return None if None in got else got  # type: ignore[return-value]

    def renew(self, lease_id: str, scheduler: str, now: datetime) -> Lease:
        lease = self._active(lease_id, scheduler)
        now = _ms(now)
        return self._put(replace(lease, expires_at=now + timedelta(seconds=lease.lease_seconds),
                                 updated_at=now))

    def extend(self, lease_id: str, until: datetime, now: datetime) -> Lease:
        """Move an active lease's expiry out to `until` (never in): the daemon could not
        hear its renewals (`Broker.heard`)."""
        lease = self._active(lease_id, None)
        until = _ms(until)
        if lease.expires_at >= until:
            return lease
        return self._put(replace(lease, expires_at=until, updated_at=_ms(now)))

    def failover(self, lease_id: str, placement: Placement, now: datetime) -> Lease:
        lease = self._active(lease_id, None)
        return self._put(replace(lease, placement=placement, epoch=lease.epoch + 1,
                                 updated_at=_ms(now)))

    def end(self, lease_id: str, state: LeaseState, now: datetime,
            scheduler: str | None = None, *, reason: str | None = None,
            detail: str | None = None) -> Lease:
        """End an active lease, keeping how: `reason` (default the state's name:
        `released`, `expired`; a failed lease's failover reason), `detail` and the time."""
        if state is LeaseState.ACTIVE:
            raise ValueError("end() takes a final state")
        lease = self._active(lease_id, scheduler)
        now = _ms(now)
        return self._put(replace(lease, state=state, updated_at=now,
                                 ended_reason=reason or state.value, ended_detail=detail,
                                 ended_at=now))

    def settle(self) -> int:
        """The changes made so far are committed: let go of the ended leases beyond the
        last `keep_recent` (the store has them). Until then every lease a change ended
        stays, so that the rest of its batch finds it here and not, still active, in
        the store. Returns how many left memory."""
        gone = 0
        while len(self._ended) > self.keep_recent:
            lease_id, lease = self._ended.popitem(last=False)
            ids = self._by_request.get(lease.scheduler)
            if ids is not None and ids.get(lease.request_id) == lease_id:
                del ids[lease.request_id]
                if not ids:
                    del self._by_request[lease.scheduler]
            gone += 1
        return gone

    def remember(self, lease: Lease) -> None:
        """Bring an ended lease found in the store back into memory, as the most recent
        (an idempotent answer; `settle` lets go of it again in its turn). A lease the
        book holds is kept as it is: the book is ahead of the store within a change."""
        if lease.lease_id not in self._leases and lease.lease_id not in self._ended:
            self._put(lease)

    # --- internals -------------------------------------------------------------------

    def _requested(self, request: PlaceRequest) -> bool:
        return request.request_id in self._by_request.get(request.scheduler, ())

    def _active(self, lease_id: str, scheduler: str | None) -> Lease:
        lease = self.get(lease_id)
        if lease is None or (scheduler is not None and lease.scheduler != scheduler):
            raise LeaseError(f"no lease {lease_id!r}")
        if lease.state is not LeaseState.ACTIVE:
            raise LeaseError(f"lease {lease_id!r} is {lease.state.value}")
        return lease

    def _put(self, lease: Lease) -> Lease:
        old = self._leases.get(lease.lease_id)
        if old is not None and old.state is LeaseState.ACTIVE:
            self._tally(old, -1)
            self._markets[old.placement.pool.market] -= 1
            self._off_pool(old.placement.pool, lease.lease_id)
        if lease.state is LeaseState.ACTIVE:
            self._leases[lease.lease_id] = lease
        else:
            self._leases.pop(lease.lease_id, None)
            self._ended[lease.lease_id] = lease
            self._ended.move_to_end(lease.lease_id)
        if lease.part <= 1:  # the request's idempotency finds a split's head
            self._by_request.setdefault(lease.scheduler, {})[lease.request_id] = lease.lease_id
        if lease.state is LeaseState.ACTIVE:
            self._tally(lease, +1)
            self._markets[lease.placement.pool.market] += 1
            self._on_pool(lease.placement.pool, lease.lease_id)
            if old is None or old.expires_at != lease.expires_at:
                heapq.heappush(self._expiry, (lease.expires_at, lease.lease_id))
                if len(self._expiry) > 2 * len(self._leases) + 64:
                    self._compact_expiry()
        return lease

    def _on_pool(self, key: PoolKey, lease_id: str) -> None:
        ids = self._by_pool.get(key)
        if ids is None:
            self._by_pool[key] = lease_id
        elif isinstance(ids, str):
            if ids != lease_id:
                self._by_pool[key] = {ids, lease_id}
        else:
            ids.add(lease_id)

    def _off_pool(self, key: PoolKey, lease_id: str) -> None:
        ids = self._by_pool.get(key)
        if ids is None:
            return
        if isinstance(ids, str):
            if ids == lease_id:
                del self._by_pool[key]
            return
        ids.discard(lease_id)
        if len(ids) == 1:
            self._by_pool[key] = next(iter(ids))

    def _compact_expiry(self) -> None:
        """Keep one heap entry per active lease (renewals leave stale ones behind)."""
        self._expiry = [(le.expires_at, le.lease_id) for le in self._leases.values()]
        heapq.heapify(self._expiry)

    def _tally(self, lease: Lease, sign: int) -> None:
        team = lease.request.team
        if not team:
            return
        t = self._teams.setdefault(team, _TeamTally())
        p = lease.placement
        t.gpus += sign * p.total_gpus
        t.price += sign * p.price_per_hour
        if p.pool.market is OWNED:
            t.owned += sign * p.total_gpus
        t.by_zone[(p.pool.cloud, p.pool.zone)] += sign * p.total_gpus
        if t.by_zone[(p.pool.cloud, p.pool.zone)] <= 0:
            del t.by_zone[(p.pool.cloud, p.pool.zone)]
        if t.gpus <= 0 and not t.by_zone:
            del self._teams[team]  # team names come from requests: keep only those holding


@dataclass(slots=True)
class _TeamTally:
    gpus: int = 0
    price: float = 0.0
    owned: int = 0
    by_zone: Counter[tuple[str, str]] = field(default_factory=Counter)
