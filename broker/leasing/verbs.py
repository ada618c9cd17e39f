"""The lease authority's answers to `renew`, `release` and `report`, a request's
`request.invalid`, and the events every change emits."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime
from typing import TYPE_CHECKING, Any

import structlog

from broker.leasing import failover
from broker.leasing.batch import MAX_ERRORS, Batch
from broker.leasing.book import LeaseBook
from broker.market.pool import ResourcePool
from broker.model import (
    Event,
    FailoverReason,
    Lease,
    LeaseState,
    PoolKey,
    iso,
)
from broker.state.keyfilter import KeyFilter
from broker.state.store import Store
from broker.wire import validation
from broker.wire.commands import VERBS, Command
from broker.wire.messages import Messages, lease_subject, request_subject
from policies.model import Policy

log = structlog.get_logger("gpubroker.broker")
Observer = Callable[[str, dict[str, Any]], None]
LOOKED_UP = "lookup: the lease placed with this request_id"


class Verbs:
    """The lease authority's answers to renew, release, report and lookup, and what
    every change emits (`Broker` is made of it).

    A verb that names a lease by `lease_id` may send the `epoch` it knows: an older one
    than the lease's changes nothing and is answered `lease.current` (the lease as it is
    now), a newer one is invalid; without it the verb acts on the lease as it is
    (contract 1.0). So a report is acted on once per epoch: the first one moves the
    lease to the next epoch, a repetition is answered `lease.current`."""

    if TYPE_CHECKING:
        pool: ResourcePool
        book: LeaseBook
        store: Store
        stored_keys: KeyFilter | None
        messages: Messages
        policy: Policy
        observers: list[Observer]
        on_launch_failed: Callable[[PoolKey, str], None] | None
        _clock: Callable[[], datetime]
        _moves: dict[str, list[datetime]]
        _cooled_by: dict[str, dict[PoolKey, datetime]]

        def _expires(self, at: datetime) -> None: ...

        def _fail_over_into(self, b: Batch, trigger: failover.Trigger,
                            cmd: Command | None = None) -> None: ...

        def _decided(self, b: Batch, lease: Lease, cmd: Command | None, reason: str,
                     alternatives: Sequence[Any],
                     parts: Sequence[Lease] | None = None) -> None: ...

    async def _lease_verb(self, b: Batch, cmd: Command) -> None:
        """`renew`, or `release` (by `lease_id`, or by `request_id`: every part)."""
        parsed = validation.parse_release(cmd.payload) if cmd.verb == "release" else \
            validation.parse_lease_ref(cmd.payload)
        if isinstance(parsed, validation.Invalid):
            self._invalid(b, cmd, parsed.request_id, parsed.errors)
            return
        if parsed.request_id is not None:
            await self._release_request(b, cmd, parsed.request_id)
            return
        await self._recall_lease(parsed.lease_id)
        lease = self._at_epoch(b, cmd, parsed.lease_id, parsed.epoch)
        if lease is None:
            return
        now = self._clock()
        if cmd.verb == "release":
            self._release(b, cmd, lease, now)
            return
        lease = self.book.renew(lease.lease_id, cmd.scheduler, now)
        b.leases[lease.lease_id] = lease
        self._emit(b, Event("lease.renewed", cmd.scheduler, {
            "lease_id": lease.lease_id, "epoch": lease.epoch,
            "expires_at": iso(lease.expires_at)}, lease_subject(lease.lease_id),
            lease.request_id), cmd)
        b.rows.append(self.messages.lease_state(lease))
        self._expires(lease.expires_at)

    def _release(self, b: Batch, cmd: Command, lease: Lease, now: datetime) -> None:
        lease = self.book.end(lease.lease_id, LeaseState.RELEASED, now, cmd.scheduler)
        self._ended(b, lease, "lease.released", {"lease_id": lease.lease_id}, cmd)

    async def _release_request(self, b: Batch, cmd: Command, request_id: str) -> None:
        """`release` by `request_id`: every part of the lease placed with it, each
        answered `lease.released` (a part that has ended repeats how it ended)."""
        parts = await self._request_leases(cmd.scheduler, request_id)
        if not parts:
            self._invalid(b, cmd, request_id, [{
                "field": "request_id", "message": f"no lease for request_id {request_id!r} "
                "(not placed, or not decided yet)"}])
            return
        now = self._clock()
        for lease in parts:
            if lease.state is LeaseState.ACTIVE:
                self._release(b, cmd, lease, now)
            else:
                self._lease_error(b, cmd, lease.lease_id)

    async def _lookup(self, b: Batch, cmd: Command) -> None:
        """`lookup`: the lease placed with `request_id`, as it is now (`placement.decided`,
        like a repeated `place`); places nothing."""
        parsed = validation.parse_lookup(cmd.payload)
        if isinstance(parsed, validation.Invalid):
            self._invalid(b, cmd, parsed.request_id, parsed.errors)
            return
        parts = await self._request_leases(cmd.scheduler, parsed)
        if not parts:
            self._invalid(b, cmd, parsed, [{"field": "request_id",
                                            "message": "no lease for this request_id"}])
            return
        self._decided(b, parts[0], cmd, LOOKED_UP, (), parts)

    async def _request_leases(self, scheduler: str, request_id: str) -> list[Lease]:
        """Every part of the lease `scheduler` placed with `request_id` (one lease when
        not split), from the lease book or, for one that ended long ago, the store."""
        head = self.book.find(scheduler, request_id)
        parts = self.book.siblings(head) if head is not None else None
        known = self.stored_keys
        if parts is None and (known is None or known.full
                              or known.may_hold(scheduler, request_id)):
            found = await self.store.find_leases([(scheduler, request_id)])
            for lease in found.get((scheduler, request_id), ()):
                self.book.remember(lease)
            head = self.book.find(scheduler, request_id)
            parts = self.book.siblings(head) if head is not None else None
        return parts or []

    async def _recall_lease(self, lease_id: str) -> None:
        """A verb names a lease the book does not hold: every active lease is in the
        book, so it has ended and left memory (or never was). Bring it back from the
        store, so that the verb is answered with how it ended, as a moment after its
        end (`_lease_error`)."""
        if self.book.get(lease_id) is None and (lease := await self.store.lease(lease_id)):
            self.book.remember(lease)

    def _at_epoch(self, b: Batch, cmd: Command, lease_id: str,
                  epoch: int | None) -> Lease | None:
        """The active lease a verb acts on; None when the verb is answered already: the
        lease has ended (how it ended, whatever the epoch), is not the scheduler's
        (`request.invalid`), or the epoch sent is older (`lease.current`) or newer
        (`request.invalid`) than the lease's."""
        lease = self.book.get(lease_id)
        if lease is None or lease.scheduler != cmd.scheduler or \
                lease.state is not LeaseState.ACTIVE:
            self._lease_error(b, cmd, lease_id)
            return None
        if epoch is not None and epoch < lease.epoch:
            log.info("verb with an older epoch: nothing done", scheduler=cmd.scheduler,
                     verb=cmd.verb, lease_id=lease_id, epoch=epoch, current=lease.epoch)
            self._emit(b, Event("lease.current", cmd.scheduler,
                                {**lease.to_json(), "stale_epoch": epoch},
                                lease_subject(lease_id), lease.request_id), cmd)
            return None
        if epoch is not None and epoch > lease.epoch:
            self._invalid(b, cmd, None, [{
                "field": "epoch", "message": f"lease {lease_id} is at epoch {lease.epoch}"}])
            return None
        return lease

    def _lease_error(self, b: Batch, cmd: Command, lease_id: str) -> None:
        """A verb on a lease that has ended repeats how it ended (`lease.failed` with its
        reason, detail and `ended_at`); on one the scheduler does not have, it is an
        invalid request."""
        lease = self.book.get(lease_id)
        if lease is not None and lease.scheduler == cmd.scheduler and \
                lease.state is not LeaseState.ACTIVE:
            kind = {LeaseState.RELEASED: "lease.released", LeaseState.EXPIRED: "lease.expired",
                    LeaseState.FAILED: "lease.failed"}[lease.state]
            data: dict[str, Any] = {"lease_id": lease_id}
            if lease.state is LeaseState.FAILED:
                end = lease.end_json()
                data.update(reason=end["ended_reason"],
                            detail=end["ended_detail"] or "the lease had already failed",
                            ended_at=end["ended_at"])
            self._emit(b, Event(kind, cmd.scheduler, data, lease_subject(lease_id),
                                lease.request_id), cmd)
            return
        self._invalid(b, cmd, None, [{"field": "lease_id", "message": f"no lease {lease_id!r}"}])

    async def _report(self, b: Batch, cmd: Command) -> None:
        parsed = validation.parse_report(cmd.payload)
        if isinstance(parsed, validation.Invalid):
            self._invalid(b, cmd, None, parsed.errors)
            return
        await self._recall_lease(parsed.lease_id)
        lease = self._at_epoch(b, cmd, parsed.lease_id, parsed.epoch)
        if lease is None:
            return
        now = self._clock()
        detail = f"scheduler reported {parsed.kind}"
        if parsed.detail:
            detail += f": {parsed.detail}"
        trigger = failover.Trigger(lease.lease_id, lease.epoch, FailoverReason.REPORTED,
                                   detail)
        moves = self._moves.get(lease.lease_id, ())
        why = failover.held_back(trigger, lease, self.policy.failover, moves, now)
        if why:
            log.info("report held back", lease_id=lease.lease_id, why=why)
            self._emit(b, Event("report.declined", cmd.scheduler, {
                "lease_id": lease.lease_id, "epoch": lease.epoch, "kind": parsed.kind,
                "reason": f"held back by the anti-flap limits: {why}",
                "retry_after_seconds": round(
                    failover.retry_after(moves, self.policy.failover, now), 3)},
                lease_subject(lease.lease_id), lease.request_id), cmd)
            return
        cool = self._may_cool(cmd.scheduler, lease.placement.pool, now)
        if cool and parsed.kind == "launch_failed" and self.on_launch_failed is not None:
            self.on_launch_failed(lease.placement.pool, parsed.detail or "")
        self._fail_over_into(b, replace(trigger, cool_down=cool), cmd)

    def _may_cool(self, scheduler: str, pool: PoolKey, now: datetime) -> bool:
        """Whether `scheduler`'s report may cool `pool` down for everyone: within the
        policy's `report_cooldowns_per_hour` pools per scheduler (a pool counts once
        within the hour); counted here when it may."""
        limit = self.policy.failover.report_cooldowns_per_hour
        mine = {p: t for p, t in self._cooled_by.get(scheduler, {}).items()
                if now - t < failover.FLAP_WINDOW}
        may = pool in mine or len(mine) < limit
        if may:
            mine.setdefault(pool, now)
        else:
            log.info("report cools the pool for nobody else: the scheduler's reports "
                     "cooled report_cooldowns_per_hour pools in the last hour",
                     scheduler=scheduler, pool=str(pool), limit=limit)
        if mine:
            self._cooled_by[scheduler] = mine
        else:
            self._cooled_by.pop(scheduler, None)
        return may

    def _invalid(self, b: Batch, cmd: Command, request_id: str | None,
                 errors: list[dict[str, str]]) -> None:
        if len(errors) > MAX_ERRORS:
            errors = [*errors[:MAX_ERRORS - 1], {
                "field": "", "message": f"and {len(errors) - MAX_ERRORS + 1} more errors"}]
        # Fields and messages can quote what was sent (a key, a verb): keep them short.
        errors = [{"field": e["field"][:200], "message": e["message"][:500]} for e in errors]
        data: dict[str, Any] = {"errors": errors, "topic": cmd.topic}
        if request_id is not None:
            data = {"request_id": request_id, **data}
        if cmd.verb in VERBS:
            data["verb"] = cmd.verb
        if (b"lease_id" in cmd.payload or b"\\u" in cmd.payload) and \
                (lease_id := validation.echoed_lease_id(cmd.payload)) is not None:
            data["lease_id"] = lease_id
        log.info("request invalid", scheduler=cmd.scheduler, topic=cmd.topic, errors=errors)
        self._emit(b, Event("request.invalid", cmd.scheduler, data,
                            request_subject(request_id), request_id), cmd)

    def _ended(self, b: Batch, lease: Lease, kind: str, data: dict[str, Any],
               cmd: Command | None = None, *, released: bool = False) -> None:
        """Publish the end of `lease`; release its instances unless `released`."""
        if not released:
            self.pool.give_back(lease.placement)
        self._moves.pop(lease.lease_id, None)
        b.leases[lease.lease_id] = lease
        self._emit(b, Event(kind, lease.scheduler, data, lease_subject(lease.lease_id),
                            lease.request_id), cmd)
        b.rows.append(self.messages.lease_state(lease))

    def _emit(self, b: Batch, event: Event, cmd: Command | None = None) -> None:
        """Queue the event's messages; the answer to `cmd` also goes to its MQTT 5
        ResponseTopic and to an HTTP caller waiting for it."""
        rows = self.messages.event(event, cmd.reply if cmd else None)
        b.rows.extend(rows)
        if cmd is not None and cmd.answer is not None:
            b.answers.append((cmd, rows[0].payload))
        if cmd is not None and cmd.verb == "place":
            b.decided.append((cmd, event.kind))
        for observe in self.observers:
            observe(event.kind, event.data)
