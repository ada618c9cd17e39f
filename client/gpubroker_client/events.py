"""What the client tells a scheduler happened (`LeaseEvent`, `LeaseChange`), and how it
reads the daemon's CloudEvents envelopes and retained states."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from gpubroker_client.model import LeaseState, Placement, parse_iso

__all__ = ["EventType", "LeaseChange", "LeaseChangeKind", "LeaseEvent", "LeaseEventKind",
           "RejectCode"]


class EventType(StrEnum):
    """The daemon's event types (`P/events/S/<type>`; the envelope's `type` is
    `gpubroker.<type>.v1`). Contract 1.1 added `lease.current`, `report.declined` and
    `placement.quoted`."""

    PLACEMENT_DECIDED = "placement.decided"
    PLACEMENT_REJECTED = "placement.rejected"
    PLACEMENT_QUOTED = "placement.quoted"
    REQUEST_INVALID = "request.invalid"
    LEASE_RENEWED = "lease.renewed"
    LEASE_RELEASED = "lease.released"
    LEASE_EXPIRED = "lease.expired"
    LEASE_FAILOVER = "lease.failover"
    LEASE_FAILED = "lease.failed"
    LEASE_CURRENT = "lease.current"
    REPORT_DECLINED = "report.declined"
    POLICY_APPLIED = "policy.applied"
    POLICY_REJECTED = "policy.rejected"


class RejectCode(StrEnum):
    """`placement.rejected`'s `code`: the constraint that binds."""

    NO_CAPACITY = "no_capacity"
    OVER_PRICE_CAP = "over_price_cap"
    OVER_BUDGET = "over_budget"
    POLICY_DENIED = "policy_denied"


class LeaseEventKind(StrEnum):
    """`LeaseEvent.kind`: what happened to a held lease."""

    FAILOVER = "failover"
    RENEWED = "renewed"
    RELEASED = "released"
    EXPIRED = "expired"
    FAILED = "failed"


class LeaseChangeKind(StrEnum):
    """`LeaseChange.kind`: what a lease watch saw."""

    PLACED = "placed"
    RENEWED = "renewed"
    FAILOVER = "failover"
    RELEASED = "released"
    EXPIRED = "expired"
    FAILED = "failed"
    ENDED = "ended"  # ended, and it is not known how

SEEN_IDS = 4096
"""Event ids remembered for dropping duplicates (the same event on the event topic and
the ResponseTopic, or sent again by the daemon after a reconnect)."""


@dataclass(frozen=True, slots=True)
class LeaseEvent:
    """Something that happened to a lease.

    `kind`: `failover` (a new `epoch` and `placement`; `previous` is where it was),
    `renewed` (a new `expires_at`), or an end: `released`, `expired`, `failed`.
    `reason`/`detail` as the daemon gave them (`None` for a failover learnt from the
    retained lease state after a reconnect, whose event was missed). `envelope` is the
    CloudEvent, when there was one."""

    kind: LeaseEventKind
    lease_id: str
    epoch: int
    placement: Placement
    previous: Placement | None = None
    expires_at: datetime | None = None
    reason: str | None = None
    detail: str | None = None
    envelope: Mapping[str, Any] | None = None

    @property
    def ended(self) -> bool:
        return self.kind in _ENDS


_ENDS = {"released": LeaseState.RELEASED, "expired": LeaseState.EXPIRED,
         "failed": LeaseState.FAILED}


@dataclass(frozen=True, slots=True)
class LeaseChange:
    """A change seen by a `LeaseWatch`: `kind` is `placed`, `renewed`, `failover`, or an
    end: `released`, `expired`, `failed` — or `ended` when it is not known how (the end
    event was not readable, or the lease ended while the watch was disconnected).
    `state` is the retained lease state (SPEC's lease JSON), the last one for an end."""

    kind: LeaseChangeKind
    lease_id: str
    scheduler: str
    state: Mapping[str, Any] | None
    reason: str | None = None
    detail: str | None = None


def _kind(env: Mapping[str, Any]) -> str:
    """`gpubroker.lease.renewed.v1` -> `lease.renewed` -> for lease events `renewed`."""
    t = str(env.get("type", "")).removeprefix("gpubroker.").removesuffix(".v1")
    return t.removeprefix("lease.")


def _remaining(expires: datetime, env: Mapping[str, Any]) -> float:
    """Seconds from the event to the expiry, both on the daemon's clock."""
    try:
        return (expires - parse_iso(str(env["time"]))).total_seconds()
    except (KeyError, ValueError):
        return 0.0


def _full_kind(env: Mapping[str, Any]) -> str:
    return str(env.get("type", "")).removeprefix("gpubroker.").removesuffix(".v1")


def _json(payload: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(payload)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _epoch(value: Any) -> int:
    """A leader epoch from a payload: absent or not an integer (an older daemon) is 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
