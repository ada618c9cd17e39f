"""The wire vocabulary a scheduler shares with the daemon: the scheduler id's pattern, a
lease's states, where a lease's GPUs are (`Placement`, in a `PoolKey` of a `Market`), and
the timestamps of every payload (`iso`, `parse_iso`).

Defined here once. The daemon's vocabulary (`broker.model`) imports these names from this
module and re-exports them; this module imports nothing of the daemon.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Literal, NamedTuple, Protocol, get_args

__all__ = ["CLOUDS", "RESERVED_SCHEDULER_IDS", "SCHEDULER_ID", "CloudName", "LeaseState",
           "Market", "Placement", "PoolKey", "iso", "parse_iso", "scheduler_id_problem"]

SCHEDULER_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
RESERVED_SCHEDULER_IDS = frozenset({"_ops"})
"""Scheduler ids no request may come from: `_ops` names the operations events'
topics (`P/events/_ops/...`). Other ids starting with `_` are ordinary ones."""


def scheduler_id_problem(scheduler: object) -> str | None:
    """Why `scheduler` cannot send requests, or None: the one rule for the scheduler id
    `S`, with the one message the daemon's MQTT and HTTP edges, the client and the
    command line give."""
    if not isinstance(scheduler, str) or not SCHEDULER_ID.match(scheduler):
        shown = scheduler[:80] if isinstance(scheduler, str) else scheduler
        return f"scheduler id {shown!r} must match [A-Za-z0-9_.-]{{1,64}}"
    if scheduler in RESERVED_SCHEDULER_IDS:
        return f"scheduler id {scheduler!r} is reserved (operations events)"
    return None

CloudName = Literal["aws", "gcp", "azure", "alibaba", "private"]
"""The clouds a placement, an offer or a capacity summary may name. `private`: the
company's own GPU servers, declared by its ops team. The one list: every enum of the
published contract (JSON Schemas, AsyncAPI) is made from it."""
CLOUDS: tuple[str, ...] = get_args(CloudName)


class Market(StrEnum):
    SPOT = "spot"
    ON_DEMAND = "on_demand"
    RESERVED = "reserved"  # paid-for capacity: a cloud reservation, or a private server


class LeaseState(StrEnum):
    ACTIVE = "active"
    RELEASED = "released"
    EXPIRED = "expired"
    FAILED = "failed"


@functools.lru_cache(maxsize=4096)
def iso(ts: datetime) -> str:
    """RFC 3339 in UTC with millisecond precision and a `Z`, as every payload uses.
    Cached: the same few timestamps (a poll's, a lease's) are written many times."""
    return ts.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_iso(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


class PoolKey(NamedTuple):
    """One place capacity comes from.

    A named tuple rather than a dataclass: pool keys are hashed on every lookup of the
    placement hot path, and a tuple's hash is computed in C."""

    cloud: str
    region: str
    zone: str
    instance_type: str
    market: Market

    def __str__(self) -> str:
        return f"{self.cloud}/{self.zone}/{self.instance_type}/{self.market.value}"

    def to_json(self) -> dict[str, str]:
        return {
            "cloud": self.cloud,
            "region": self.region,
            "zone": self.zone,
            "instance_type": self.instance_type,
            "market": self.market.value,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PoolKey:
        return cls(d["cloud"], d["region"], d["zone"], d["instance_type"], Market(d["market"]))


class PricedOffer(Protocol):
    """What `Placement.of` reads of an offer (the daemon's `broker.model.Offer`)."""

    @property
    def pool(self) -> PoolKey: ...
    @property
    def gpu(self) -> str: ...
    @property
    def gpus(self) -> int: ...
    @property
    def price_per_hour(self) -> float | None: ...
    @property
    def observed_at(self) -> datetime: ...


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a lease's GPUs are: one pool, `instances` instances of it. On paid-for
    capacity, `targets` says which reservations or servers, as (id, instances)."""

    pool: PoolKey
    instances: int
    gpu: str
    gpus: int  # per instance
    price_per_hour: float  # the whole placement
    price_observed_at: datetime
    targets: tuple[tuple[str, int], ...] = ()

    @property
    def total_gpus(self) -> int:
        return self.instances * self.gpus

    @property
    def price_per_gpu_hour(self) -> float:
        return self.price_per_hour / self.total_gpus

    @classmethod
    def of(cls, offer: PricedOffer, instances: int) -> Placement:
        assert offer.price_per_hour is not None
        return cls(
            pool=offer.pool,
            instances=instances,
            gpu=offer.gpu,
            gpus=offer.gpus,
            price_per_hour=offer.price_per_hour * instances,
            price_observed_at=offer.observed_at,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            **self.pool.to_json(),
            "instances": self.instances,
            "gpu": self.gpu,
            "gpus": self.gpus,
            "total_gpus": self.total_gpus,
            "price_per_hour": round(self.price_per_hour, 6),
            "price_per_gpu_hour": round(self.price_per_gpu_hour, 6),
            "price_observed_at": iso(self.price_observed_at),
            **({"targets": [{"id": t, "instances": n} for t, n in self.targets]}
               if self.targets else {}),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Placement:
        return cls(
            pool=PoolKey.from_json(d),
            instances=int(d["instances"]),
            gpu=d["gpu"],
            gpus=int(d["gpus"]),
            price_per_hour=float(d["price_per_hour"]),
            price_observed_at=parse_iso(d["price_observed_at"]),
            targets=tuple((str(t["id"]), int(t["instances"])) for t in d.get("targets", ())),
        )
