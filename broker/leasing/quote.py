"""The lease authority's answer to `quote`: what a placement request would get now, and at
what expected cost, holding nothing.

A quote goes the placement's own way — the policy's verdict against the team's usage as
the lease book has it, then the optimizer's `place` on the pool with the policy, as a
batch of one — but takes nothing from its outcome: no lease, no instances held in the
pool, no idempotency record (its `request_id` is only echoed), no placement metrics.
The answer, `placement.quoted`, is an event like any other (committed to the outbox,
sent on `P/events/S/placement.quoted` and to an MQTT 5 ResponseTopic or an HTTP
caller). The expected cost is the one the optimizer chose the placement by
(`broker.placement.cost`), the same number a `placement.decided` states in its reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from broker.leasing.batch import Batch
from broker.leasing.book import LeaseBook
from broker.market.pool import ResourcePool
from broker.model import Event, PlaceRequest
from broker.placement import optimizer
from broker.wire import validation
from broker.wire.commands import Command
from broker.wire.messages import request_subject
from policies.evaluate import Denied, evaluate
from policies.model import Policy
from policies.residency import Residency


class Quoting:
    """The lease authority's quotes (`Broker` is made of it)."""

    if TYPE_CHECKING:
        pool: ResourcePool
        book: LeaseBook
        policy: Policy
        settings: optimizer.BatchSettings
        _clock: Callable[[], datetime]
        _retry_after: float

        def _resident_now(self) -> Residency: ...

        def _known_gpus(self) -> set[str]: ...

        def _emit(self, b: Batch, event: Event, cmd: Command | None = None) -> None: ...

        def _invalid(self, b: Batch, cmd: Command, request_id: str | None,
                     errors: list[dict[str, str]]) -> None: ...

    def _quote(self, b: Batch, cmd: Command) -> None:
        """Answer a quote: `placement.quoted`, or `request.invalid` as a `place` with
        the same body would be (a `request_id` is not required)."""
        parsed = validation.parse_quote(cmd.scheduler, cmd.payload)
        if isinstance(parsed, validation.Invalid):
            self._invalid(b, cmd, parsed.request_id, parsed.errors)
            return
        req = parsed.request
        unknown = validation.unknown_gpus(req, self._known_gpus)
        if unknown is not None:
            self._invalid(b, cmd, parsed.request_id, unknown.errors)
            return
        data = self._outcome(req)
        if parsed.request_id is not None:
            data = {"request_id": parsed.request_id, **data}
        self._emit(b, Event("placement.quoted", cmd.scheduler, data,
                            request_subject(parsed.request_id), parsed.request_id), cmd)

    def _outcome(self, req: PlaceRequest) -> dict[str, Any]:
        """What placing `req` alone would come to now: the data of `placement.quoted`
        but its `request_id`."""
        verdict = evaluate(self.policy, req, self.book.team_usage(req.team),
                           self._resident_now(), self.pool.owned_gpus)
        if isinstance(verdict, Denied):
            return {"code": verdict.code.value, "detail": verdict.detail}
        # The heuristic only, as for a batch while requests wait: a quote never spends
        # the MILP's share of the CPU that placements draw on.
        settings = dataclasses.replace(self.settings, exact_max_batch=0)
        [out] = optimizer.place([optimizer.Ask(req, constraints=verdict)], self.pool,
                                self.policy, now=self._clock(),
                                retry_after_seconds=self._retry_after, settings=settings)
        if isinstance(out, optimizer.Rejection):
            data: dict[str, Any] = {"code": out.code.value, "detail": out.detail}
            if out.retry_after_seconds is not None:
                data["retry_after_seconds"] = out.retry_after_seconds
            return data
        per_hour = round(out.expected_cost_per_hour, 6)
        data = {
            "placement": out.placement.to_json(),
            "expected_cost_per_hour": per_hour,
            "expected_cost": round(out.expected_cost_per_hour * (req.duration_hours or 1.0), 6),
            "reason": out.reason,
            "alternatives": [a.to_json() for a in out.alternatives],
        }
        if out.parts:
            data["parts"] = [{"gpus": gpus, "placement": p.to_json()} for p, gpus in out.parts]
        return data
