"""Small builders for the unit tests: pool keys, offers, requests, placements, a clock.

Imported as `from factories import ...` (tests/ is on sys.path through tests/conftest.py).
Defaults make the expected cost of an offer simply `instances × price`: availability 1
and no interruption risk, unless a test says otherwise.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from broker.market.changes import SliceId
from broker.market.pool import ResourcePool
from broker.model import Market, Offer, Placement, PlaceRequest, PoolKey, Target
from broker.wire.messages import OutboxRow

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


@dataclass
class Clocks:
    """An adapter's injectable clocks, moved on by hand: `mono` for its monotonic
    timers (caches, back-offs), `now` for the wall clock it stamps offers with."""

    mono: float = 1000.0
    now: datetime = field(default_factory=lambda: T0)

    def advance(self, seconds: float) -> None:
        self.mono += seconds
        self.now += timedelta(seconds=seconds)
SLICE: SliceId = ("sim", "aws:us-east-1")


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: datetime = T0) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> datetime:
        self.now += timedelta(seconds=seconds)
        return self.now


def key(zone: str = "us-east-1a", *, cloud: str = "aws", region: str = "us-east-1",
        instance_type: str = "p5.48xlarge", market: Market | str = Market.SPOT) -> PoolKey:
    return PoolKey(cloud, region, zone, instance_type, Market(market))


def offer(zone: str = "us-east-1a", *, cloud: str = "aws", region: str = "us-east-1",
          instance_type: str = "p5.48xlarge", market: Market | str = Market.SPOT,
          gpu: str = "H100-80GB", gpus: int = 8, price: float | None = 24.0,
          observed_at: datetime = T0, availability: float | None = 1.0,
          capacity: int | None = None, interruption_rate: float | None = 0.0,
          quota_headroom: int | None = None) -> Offer:
    """An offer; `price` is USD per instance and hour."""
    return Offer(
        pool=key(zone, cloud=cloud, region=region, instance_type=instance_type, market=market),
        gpu=gpu, gpus=gpus, gpu_memory_gb=80.0, vcpus=192, memory_gb=2048.0,
        price_per_hour=price, observed_at=observed_at, availability=availability,
        capacity=capacity, interruption_rate=interruption_rate,
        quota_headroom=quota_headroom)


def owned(zone: str = "fra1", *, servers: Iterable[str] | int = 2, draining: Iterable[str] = (),
          cloud: str = "private", region: str = "fra1", instance_type: str = "a100-pod",
          gpu: str = "H100-80GB", gpus: int = 8, price_per_gpu_hour: float = 0.0,
          targets: Iterable[Target] | None = None) -> Offer:
    """Paid-for capacity (market `reserved`): private servers (`servers`: names, or how
    many, named s01, s02, …) or, with `targets`, cloud reservations."""
    if targets is None:
        names = [f"s{i + 1:02d}" for i in range(servers)] if isinstance(servers, int) \
            else list(servers)
        targets = [Target(n, 1, 1) for n in names]
    targets = tuple(targets)
    drain = tuple(draining)
    return Offer(
        pool=key(zone, cloud=cloud, region=region, instance_type=instance_type,
                 market=Market.RESERVED),
        gpu=gpu, gpus=gpus, gpu_memory_gb=80.0, vcpus=96, memory_gb=1024.0,
        price_per_hour=price_per_gpu_hour * gpus, observed_at=T0, availability=1.0,
        capacity=sum(t.free for t in targets if t.id not in drain),
        targets=targets, draining=drain)


def reserved(offers: Iterable[Offer]) -> dict[PoolKey, Offer]:
    """The offers of the market `reserved`, by pool."""
    return {o.pool: o for o in offers if o.pool.market is Market.RESERVED}


def request(request_id: str = "r1", gpu: str | Iterable[str] = "H100-80GB", gpus: int = 8, *,
            scheduler: str = "sched-a", **kw: Any) -> PlaceRequest:
    models = (gpu,) if isinstance(gpu, str) else tuple(gpu)
    return PlaceRequest(scheduler=scheduler, request_id=request_id, gpu=models, gpus=gpus, **kw)


def placement(o: Offer | None = None, instances: int = 1) -> Placement:
    return Placement.of(o if o is not None else offer(), instances)


def pool_of(offers: Iterable[Offer], *, clock: Clock | None = None,
            stale_after_seconds: float = 300, slice_id: SliceId = SLICE) -> ResourcePool:
    """A real ResourcePool holding `offers` as one freshly polled slice."""
    pool = ResourcePool(stale_after_seconds=stale_after_seconds, clock=clock or Clock())
    pool.replace(slice_id, offers)
    return pool


class Sink:
    """What the broker hands to the bus (its `publish`), and an event set on each
    arrival, to wait on."""

    def __init__(self) -> None:
        self.rows: list[OutboxRow] = []
        self.arrived = asyncio.Event()

    def __call__(self, rows: Sequence[OutboxRow]) -> None:
        self.rows.extend(rows)
        self.arrived.set()

    def events(self, kind: str) -> list[dict[str, Any]]:
        """The data of every event of `kind` (`placement.decided`), in order."""
        return [json.loads(r.payload)["data"] for r in self.rows
                if r.topic.endswith(f"/{kind}")]
