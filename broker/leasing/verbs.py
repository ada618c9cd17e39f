"""The lease authority's answers to `renew`, `release` and `report`, a request's
`request.invalid`, and the events every change emits."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

import structlog

from broker.leasing import failover
from broker.leasing.batch import MAX_ERRORS, Batch
from broker.leasing.book import LeaseBook, LeaseError
from broker.market.pool import ResourcePool
from broker.model import (
    Event,
    FailoverReason,
    Lease,
    LeaseState,
    PoolKey,
    iso,
)
from broker.wire import validation
from broker.wire.commands import Command
from broker.wire.messages import Messages, lease_subject, request_subject
from policies.model import Policy

log = structlog.get_logger("gpubroker.broker")
Observer = Callable[[str, dict[str, Any]], None]


class Verbs:
    """The lease authority's answers to renew, release and report, and what every change
    emits (`Broker` is made of it)."""

    if TYPE_CHECKING:
        pool: ResourcePool
        book: LeaseBook
        messages: Messages
        policy: Policy
        observers: list[Observer]
        on_launch_failed: Callable[[PoolKey, str], None] | None
        _clock: Callable[[], datetime]
        _moves: dict[str, list[datetime]]
        _expiry_changed: asyncio.Event

        def _fail_over_into(self, b: Batch, trigger: failover.Trigger,
                            cmd: Command | None = None) -> None: ...

    def _lease_verb(self, b: Batch, cmd: Command) -> None:
        parsed = validation.parse_lease_ref(cmd.payload)
        if isinstance(parsed, validation.Invalid):
            self._invalid(b, cmd, None, parsed.errors)
            return
        now = self._clock()
        try:
            if cmd.verb == "renew":
                lease = self.book.renew(parsed.lease_id, cmd.scheduler, now)
                b.leases[lease.lease_id] = lease
                self._emit(b, Event("lease.renewed", cmd.scheduler, {
                    "lease_id": lease.lease_id, "epoch": lease.epoch,
                    "expires_at": iso(lease.expires_at)}, lease_subject(lease.lease_id),
                    lease.request_id), cmd)
                b.rows.append(self.messages.lease_state(lease))
                self._expiry_changed.set()
            else:
                lease = self.book.end(parsed.lease_id, LeaseState.RELEASED, now, cmd.scheduler)
                self._ended(b, lease, "lease.released", {"lease_id": lease.lease_id},
                            cmd)
        except LeaseError as exc:
            self._lease_error(b, cmd, parsed.lease_id, exc)

    def _lease_error(self, b: Batch, cmd: Command, lease_id: str, exc: LeaseError) -> None:
        """A verb on a lease that has ended repeats how it ended; on one the scheduler
        does not have, it is an invalid request."""
        lease = self.book.get(lease_id)
        if lease is not None and lease.scheduler == cmd.scheduler and \
                lease.state is not LeaseState.ACTIVE:
            kind = {LeaseState.RELEASED: "lease.released", LeaseState.EXPIRED: "lease.expired",
                    LeaseState.FAILED: "lease.failed"}[lease.state]
            data: dict[str, Any] = {"lease_id": lease_id}
            if lease.state is LeaseState.FAILED:
                data.update(reason="ended", detail="the lease had already failed")
            self._emit(b, Event(kind, cmd.scheduler, data, lease_subject(lease_id),
                                lease.request_id), cmd)
            return
        self._invalid(b, cmd, None, [{"field": "lease_id", "message": str(exc)}])

    async def _report(self, b: Batch, cmd: Command) -> None:
        parsed = validation.parse_report(cmd.payload)
        if isinstance(parsed, validation.Invalid):
            self._invalid(b, cmd, None, parsed.errors)
            return
        lease = self.book.get(parsed.lease_id)
        if lease is None or lease.scheduler != cmd.scheduler or \
                lease.state is not LeaseState.ACTIVE:
            self._lease_error(b, cmd, parsed.lease_id,
                              LeaseError(f"no active lease {parsed.lease_id!r}"))
            return
        detail = f"scheduler reported {parsed.kind}"
        if parsed.detail:
            detail += f": {parsed.detail}"
        if parsed.kind == "launch_failed" and self.on_launch_failed is not None:
            self.on_launch_failed(lease.placement.pool, parsed.detail or "")
        trigger = failover.Trigger(lease.lease_id, lease.epoch, FailoverReason.REPORTED,
                                   detail, cool_down=True)
        self._fail_over_into(b, trigger, cmd)

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
