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
Ended leases stay in memory for `keep_ended` so that a repeated request is answered
with the same lease (idempotency on scheduler + request_id); the store keeps them all.
"""

from __future__ import annotations

import heapq
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from broker.model import OWNED, Lease, LeaseState, Placement, PlaceRequest, PoolKey
from policies.teams import TeamUsage


def _ms(ts: datetime) -> datetime:
    """Lease times are kept at the millisecond precision they are published with, so a
    lease read back from the store equals the one written."""
    return ts.replace(microsecond=ts.microsecond // 1000 * 1000)


class LeaseError(Exception):
    """A transition that the lease's state does not allow; the message says why."""


class LeaseBook:
    def __init__(self, *, keep_ended: timedelta = timedelta(hours=24)) -> None:
        self.keep_ended = keep_ended
        self._leases: dict[str, Lease] = {}
        self._by_request: dict[tuple[str, str], str] = {}
        self._by_pool: dict[PoolKey, set[str]] = {}
        # A lazy heap: a renewal pushes a new entry and leaves the old one, skipped when it
        # comes up; compacted when stale entries outnumber the leases (`_put`).
        self._expiry: list[tuple[datetime, str]] = []
        self._teams: dict[str, _TeamTally] = {}

    def load(self, leases: Iterable[Lease]) -> None:
        for lease in leases:
            self._put(lease)

    # --- reading -------------------------------------------------------------------

    def get(self, lease_id: str) -> Lease | None:
        return self._leases.get(lease_id)

    def find(self, scheduler: str, request_id: str) -> Lease | None:
        lease_id = self._by_request.get((scheduler, request_id))
        return self._leases.get(lease_id) if lease_id else None

    def active(self) -> list[Lease]:
        return [le for le in self._leases.values() if le.state is LeaseState.ACTIVE]

    def all(self) -> list[Lease]:
        return list(self._leases.values())

    def on_pool(self, key: PoolKey) -> list[Lease]:
        return [self._leases[i] for i in self._by_pool.get(key, ())]

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
        key = (request.scheduler, request.request_id)
        if key in self._by_request:
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
        if (request.scheduler, request.request_id) in self._by_request:
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
        got = [self._leases.get(i) for i in lease.parts]
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

    def prune(self, now: datetime) -> int:
        """Forget ended leases older than keep_ended (they stay in the store)."""
        cutoff = now - self.keep_ended
        old = [le for le in self._leases.values()
               if le.state is not LeaseState.ACTIVE and le.updated_at < cutoff]
        for lease in old:
            del self._leases[lease.lease_id]
            key = (lease.scheduler, lease.request_id)
            if self._by_request.get(key) == lease.lease_id:
                del self._by_request[key]
        return len(old)

    def remember(self, lease: Lease) -> None:
        """Bring an ended lease found in the store back into memory (idempotent answer)."""
        if lease.lease_id not in self._leases:
            self._put(lease)

    # --- internals -------------------------------------------------------------------

    def _active(self, lease_id: str, scheduler: str | None) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None or (scheduler is not None and lease.scheduler != scheduler):
            raise LeaseError(f"no lease {lease_id!r}")
        if lease.state is not LeaseState.ACTIVE:
            raise LeaseError(f"lease {lease_id!r} is {lease.state.value}")
        return lease

    def _put(self, lease: Lease) -> Lease:
        old = self._leases.get(lease.lease_id)
        if old is not None and old.state is LeaseState.ACTIVE:
            self._tally(old, -1)
            ids = self._by_pool.get(old.placement.pool)
            if ids is not None:
                ids.discard(lease.lease_id)
                if not ids:
                    del self._by_pool[old.placement.pool]
        self._leases[lease.lease_id] = lease
        if lease.part <= 1:  # the request's idempotency finds a split's head
            self._by_request[(lease.scheduler, lease.request_id)] = lease.lease_id
        if lease.state is LeaseState.ACTIVE:
            self._tally(lease, +1)
            self._by_pool.setdefault(lease.placement.pool, set()).add(lease.lease_id)
            if old is None or old.expires_at != lease.expires_at:
                heapq.heappush(self._expiry, (lease.expires_at, lease.lease_id))
                if len(self._expiry) > 2 * len(self._leases) + 64:
                    self._compact_expiry()
        return lease

    def _compact_expiry(self) -> None:
        """Keep one heap entry per active lease (renewals leave stale ones behind)."""
        self._expiry = [(le.expires_at, le.lease_id) for le in self._leases.values()
                        if le.state is LeaseState.ACTIVE]
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
