"""What one turn of the lease authority changes (`Batch`), and the answers every part
of it gives: the fixed error entries and the split request's parts."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from broker.model import (
    Lease,
    LeaseState,
    iso,
)
from broker.wire.commands import Command
from broker.wire.messages import OutboxRow

REPEATED = "repeated request: the lease it already has"
INTERNAL = {"field": "", "message": "internal error handling this request; it was not "
            "executed (the daemon logged the error)"}
MAX_ERRORS = 20  # per request.invalid answer: an answer must stay far below a packet's limit
RETAINED = {"field": "retain", "message": "a request published with the retain flag is "
            "never acted on; publish it without the retain flag"}


@dataclass(slots=True)
class Batch:
    """What one turn of the request loop changes, committed in one transaction."""

    leases: dict[str, Lease] = field(default_factory=dict)
    rows: list[OutboxRow] = field(default_factory=list)
    answered: dict[tuple[str, str], Lease] = field(default_factory=dict)
    answers: list[tuple[Command, bytes]] = field(default_factory=list)
    decided: list[tuple[Command, str]] = field(default_factory=list)  # place verbs answered


def part_json(lease: Lease) -> dict[str, Any]:
    """One part of a split request in its `placement.decided` (`parts`)."""
    d: dict[str, Any] = {"lease_id": lease.lease_id, "part": lease.part, "epoch": lease.epoch,
                         "gpus": lease.request.gpus, "placement": lease.placement.to_json(),
                         "expires_at": iso(lease.expires_at)}
    if lease.state is not LeaseState.ACTIVE:
        d["state"] = lease.state.value
        d.update(lease.end_json())
    return d


def ms(now: datetime, then: datetime | None) -> float | None:
    return None if then is None else round((now - then).total_seconds() * 1000, 1)
