"""What a poll changes in the pool: the type the pool publishes to its listeners (the
hazard estimator, the recorder, failover, the daemon), in a module of its own so that
each of them, and the pool, import it from here rather than from one another."""

from __future__ import annotations

from dataclasses import dataclass

from broker.model import Offer, PoolKey

SliceId = tuple[str, str]
"""(adapter name, region) — the unit one poll replaces."""


@dataclass(frozen=True, slots=True)
class PoolChange:
    """What one poll changed. `updated` maps new and changed offers' keys to the old offer
    (None when new); `removed` holds offers no longer offered."""

    slice: SliceId
    updated: dict[PoolKey, Offer | None]
    removed: dict[PoolKey, Offer]
    offers: dict[PoolKey, Offer]
