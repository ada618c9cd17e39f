"""The lease authority's moves: failovers (a lease to a new pool, fenced by its epoch),
the periodic re-optimisation and health checks that trigger them, and the residency
tags the policy and the private servers give."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import structlog

from broker.leasing import failover
from broker.leasing.batch import Batch, ms
from broker.leasing.book import LeaseBook
from broker.leasing.placing import on_loan
from broker.market.pool import ResourcePool
from broker.model import (
    Event,
    FailoverReason,
    Lease,
)
from broker.placement import optimizer
from broker.wire.commands import Command
from broker.wire.messages import Messages, lease_subject
from policies.model import Policy
from policies.residency import Residency

log = structlog.get_logger("gpubroker.broker")


class Moves:
    """The lease authority's failovers, re-optimisation and health checks (`Broker` is
    made of it)."""

    if TYPE_CHECKING:
        pool: ResourcePool
        book: LeaseBook
        messages: Messages
        policy: Policy
        region_tags: list[Callable[[], Mapping[str, Sequence[str]]]]
        _clock: Callable[[], datetime]
        _moves: dict[str, list[datetime]]
        _reopt_next: int
        _resident_of: Residency
        _resident_for: tuple[Policy, dict[str, list[str]]]

        def _changing(self) -> contextlib.AbstractAsyncContextManager[None]: ...

        async def _commit(self, b: Batch) -> None: ...

        def _ended(self, b: Batch, lease: Lease, kind: str, data: dict[str, Any],
                   cmd: Command | None = None, *, released: bool = False) -> None: ...

        def _emit(self, b: Batch, event: Event, cmd: Command | None = None) -> None: ...

        def _trigger(self, trigger: failover.Trigger) -> None: ...

    def _reoptimize_chunk(self, limit: int) -> list[Lease]:
        if self.policy.failover.reoptimize_min_saving is None:
            return []
        active = sorted(self.book.active(), key=lambda le: le.lease_id)
        if not active:
            return []
        start = self._reopt_next % len(active)
        chunk = (active[start:] + active[:start])[:limit]
        self._reopt_next = start + len(chunk)
        return chunk

    def check_reoptimize(self, limit: int = 500) -> list[failover.Trigger]:
        """Look at up to `limit` active leases (the next ones in turn) for a placement
        that saves at least `reoptimize_min_saving`; queue their moves."""
        chunk = self._reoptimize_chunk(limit)
        if not chunk:
            return []
        triggers = failover.reoptimize(chunk, self.pool, self.policy, self._resident_now(),
                                       self._clock())
        for t in triggers:
            self._trigger(t)
        return triggers

    async def check_reoptimize_async(self, limit: int = 500) -> list[failover.Trigger]:
        """`check_reoptimize` in a worker thread, on a snapshot of the pool (a pass of
        hundreds of leases would hold the event loop for a long time); the moves are
        queued on the loop, and each is judged again when its turn comes."""
        chunk = self._reoptimize_chunk(limit)
        if not chunk:
            return []
        now = self._clock()
        view = optimizer.Snapshot(self.pool, now)
        triggers = await on_loan((view,), failover.reoptimize, chunk, view, self.policy,
                                 self._resident_now(), now)
        for t in triggers:
            self._trigger(t)
        return triggers

    def check_health(self) -> list[failover.Trigger]:
        now = self._clock()
        stale = self.pool.stale_slices(now)
        grace = self.pool.in_grace(now)
        triggers = []
        for key in self.book.leased_pools():
            slice_id = self.pool.slice_of(key)
            if slice_id is not None and slice_id not in stale:
                continue
            if slice_id is None and grace:
                continue  # not polled yet since the start: unknown, not unhealthy
            for le in self.book.on_pool(key):
                triggers.append(failover.Trigger(
                    le.lease_id, le.epoch, FailoverReason.CLOUD_UNHEALTHY,
                    f"{key.cloud} {key.region} has had no good poll for over "
                    f"{self.pool.stale_after.total_seconds():g}s"))
        for t in triggers:
            self._trigger(t)
        return triggers

    def _resident_now(self) -> Residency:
        """The residency tags: the policy's, and those from `region_tags`."""
        extra: dict[str, list[str]] = {}
        for source in self.region_tags:
            for tag, regions in source().items():
                extra.setdefault(tag, []).extend(regions)
        policy, was = self._resident_for
        if policy is not self.policy or was != extra:
            merged = {t: list(r) for t, r in self.policy.residency.tags.items()}
            for tag, regions in extra.items():
                merged.setdefault(tag, []).extend(regions)
            self._resident_of = Residency(merged)
            self._resident_for = (self.policy, extra)
        return self._resident_of

    async def _fail_over(self, trigger: failover.Trigger) -> None:
        b = Batch()
        self._fail_over_into(b, trigger)
        await self._commit(b)

    def _fail_over_into(self, b: Batch, trigger: failover.Trigger,
                        cmd: Command | None = None) -> None:
        """Move the trigger's lease, or end it when nothing else fits. `cmd`: the
        scheduler's `report` this answers (its MQTT 5 ResponseTopic gets the event too)."""
        now = self._clock()
        step = failover.step(
            trigger, book=self.book, pool=self.pool, policy=self.policy, moves=self._moves,
            now=now, find=lambda lease: failover.replacement(lease, self.pool, self.policy,
                                                             self._resident_now(), now))
        lease, old, outcome = step.lease, step.old, step.outcome
        if step.kind == "held_back":
            assert lease is not None
            log.info("failover held back", lease_id=lease.lease_id,
                     reason=trigger.reason.value, why=step.why)
        elif step.kind == "moved":
            assert lease is not None and old is not None
            b.leases[lease.lease_id] = lease
            self._emit(b, Event("lease.failover", lease.scheduler, {
                "lease_id": lease.lease_id, "epoch": lease.epoch, "from": old.to_json(),
                "to": lease.placement.to_json(), "reason": trigger.reason.value,
                "detail": trigger.detail}, lease_subject(lease.lease_id), lease.request_id),
                cmd)
            b.rows.append(self.messages.lease_state(lease))
            log.info("lease failed over", lease_id=lease.lease_id, epoch=lease.epoch,
                     reason=trigger.reason.value, to=str(lease.placement.pool),
                     latency_ms=ms(now, trigger.received_at))
        elif step.kind == "stays" and trigger.reason is not FailoverReason.REOPTIMIZED:
            assert lease is not None
            log.info("failover found nowhere to go; lease stays", lease_id=lease.lease_id,
                     reason=trigger.reason.value, detail=getattr(outcome, "detail", ""))
        elif step.kind == "failed":
            assert lease is not None and isinstance(outcome, optimizer.Rejection)
            # The step has released the lease's instances already.
            self._ended(b, lease, "lease.failed", {
                "lease_id": lease.lease_id, "reason": lease.ended_reason,
                "detail": lease.ended_detail}, cmd, released=True)
            log.warning("lease failed", lease_id=lease.lease_id, reason=trigger.reason.value,
                        detail=outcome.detail)
