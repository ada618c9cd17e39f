"""What makes a lease fail over, decided from pool changes and cloud signals.

These functions only decide *which* leases must move and why; `broker.core.Broker`
re-places them (never back onto the pool that failed, which also goes into a cool-down)
and publishes `lease.failover`, or `lease.failed` when nothing fits.

Triggers (v1):
* a cloud signal that a leased pool is interrupted or lost its capacity;
* a poll in which a leased pool is gone from its cloud's offerings, or its availability
  is 0 (the cloud says no capacity at all) → `capacity_lost`;
* a poll in which a leased pool's price per GPU-hour rose above the lease's cap
  → `price_above_cap`;
* a scheduler's report (handled in the broker) → `reported`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from broker.leases import LeaseBook
from broker.model import CapacitySignal, FailoverReason, SignalKind
from broker.pool import PoolChange


@dataclass(frozen=True, slots=True)
class Trigger:
    """Move lease `lease_id`, if it is still at `epoch` when the trigger is handled."""

    lease_id: str
    epoch: int
    reason: FailoverReason
    detail: str
    cool_down: bool = False  # keep the failed pool out of new placements for a while
    received_at: datetime | None = None


def from_signal(sig: CapacitySignal, book: LeaseBook) -> list[Trigger]:
    if sig.kind is SignalKind.REBALANCE:
        return []  # a risk notice, not a loss; used for scoring in a later version
    reason = (FailoverReason.INTERRUPTED if sig.kind is SignalKind.INTERRUPTED
              else FailoverReason.CAPACITY_LOST)
    detail = sig.detail or f"{sig.kind.value} notice from the cloud"
    return [Trigger(le.lease_id, le.epoch, reason, detail, cool_down=True,
                    received_at=sig.received_at)
            for le in book.on_pool(sig.pool)]


def from_pool_change(change: PoolChange, book: LeaseBook) -> list[Trigger]:
    out: list[Trigger] = []
    for key in change.removed:
        for le in book.on_pool(key):
            out.append(Trigger(le.lease_id, le.epoch, FailoverReason.CAPACITY_LOST,
                               f"{key} is no longer offered by its cloud", cool_down=True))
    for key in change.updated:
        leases = book.on_pool(key)
        if not leases:
            continue
        offer = change.offers[key]
        if offer.availability == 0:
            for le in leases:
                out.append(Trigger(le.lease_id, le.epoch, FailoverReason.CAPACITY_LOST,
                                   f"{key} reports no capacity (availability 0)",
                                   cool_down=True))
            continue
        ppg = offer.price_per_gpu_hour
        for le in leases:
            cap = le.max_price_per_gpu_hour
            if cap is not None and ppg is not None and ppg > cap:
                out.append(Trigger(le.lease_id, le.epoch, FailoverReason.PRICE_ABOVE_CAP,
                                   f"{key} now costs ${ppg:.4g}/GPU-h, above the lease's cap "
                                   f"${cap:g}/GPU-h"))
    return out
