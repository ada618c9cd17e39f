"""The shared vocabulary of gpubroker.

Everything here is a plain, frozen value. This module imports nothing of the daemon, so
adapters and policies may depend on it without pulling in the daemon.

The part of the vocabulary the schedulers' client also speaks (`SCHEDULER_ID`, `CLOUDS`, `Market`,
`LeaseState`, `PoolKey`, `Placement`, `iso`, `parse_iso`) is defined once, in
`gpubroker_client.model`, and re-exported here, so `from broker.model import Placement`
and the like keep working across the daemon. The client never imports this module.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from types import MappingProxyType
from typing import Any, NamedTuple

from gpubroker_client.model import CLOUDS as CLOUDS
from gpubroker_client.model import RESERVED_SCHEDULER_IDS as RESERVED_SCHEDULER_IDS
from gpubroker_client.model import SCHEDULER_ID as SCHEDULER_ID
from gpubroker_client.model import CloudName as CloudName
from gpubroker_client.model import LeaseState as LeaseState
from gpubroker_client.model import Market as Market
from gpubroker_client.model import Placement as Placement
from gpubroker_client.model import PoolKey as PoolKey
from gpubroker_client.model import iso as iso
from gpubroker_client.model import parse_iso as parse_iso
from gpubroker_client.model import scheduler_id_problem as scheduler_id_problem


@dataclass(frozen=True, slots=True)
class GpuModel:
    """A canonical GPU model: the name every adapter maps its cloud's names onto."""

    name: str
    memory_gb: float
    vendor: str = "nvidia"


GPU_MODELS: MappingProxyType[str, GpuModel] = MappingProxyType({m.name: m for m in (
    GpuModel("T4", 16),
    GpuModel("L4", 24),
    GpuModel("A10", 24),
    GpuModel("A10G", 24),
    GpuModel("L40S", 48),
    GpuModel("P4", 8),
    GpuModel("P100", 16),
    GpuModel("V100-16GB", 16),
    GpuModel("V100-32GB", 32),
    GpuModel("A100-40GB", 40),
    GpuModel("A100-80GB", 80),
    GpuModel("A800-80GB", 80),
    GpuModel("H100-80GB", 80),
    GpuModel("H800-80GB", 80),
    GpuModel("H20-96GB", 96),
    GpuModel("L20", 48),
    GpuModel("H200-141GB", 141),
    GpuModel("B200", 180),
    GpuModel("MI300X", 192, vendor="amd"),
)})


OWNED = Market.RESERVED
"""The market of capacity already paid for: cloud capacity reservations and private
servers. It is never interrupted, and priced at the margin."""


MARKETS: tuple[Market, ...] = tuple(Market)
"""Every market, in the enum's order: for the loops that run per request or per batch
(iterating the enum class itself makes a generator over its members each time)."""

_SERVES: Mapping[str, frozenset[Market]] = MappingProxyType({
    "any": frozenset(MARKETS),
    OWNED.value: frozenset({OWNED}),
    **{m.value: frozenset({m, OWNED}) for m in MARKETS if m is not OWNED},
})


def markets_for(choice: str) -> frozenset[Market]:
    """The markets a request's `market` may be placed on: paid-for capacity (`reserved`)
    is at least as good as on-demand and never interrupted, so it serves a request for
    spot or on-demand too; `reserved` asks for it alone. Raises `ValueError` for a
    choice that is neither `any` nor a market."""
    served = _SERVES.get(choice)
    if served is None:
        raise ValueError(f"{choice!r} is not a valid Market")
    return served


class FailoverReason(StrEnum):
    INTERRUPTED = "interrupted"
    CAPACITY_LOST = "capacity_lost"
    PRICE_ABOVE_CAP = "price_above_cap"
    CLOUD_UNHEALTHY = "cloud_unhealthy"
    REPORTED = "reported"
    POLICY_CHANGED = "policy_changed"
    REOPTIMIZED = "reoptimized"  # a better placement saves more than the policy's threshold
    MAINTENANCE = "maintenance"  # the server goes into a maintenance window (private pools)


class RejectCode(StrEnum):
    NO_CAPACITY = "no_capacity"
    OVER_PRICE_CAP = "over_price_cap"
    OVER_BUDGET = "over_budget"
    POLICY_DENIED = "policy_denied"


def utcnow() -> datetime:
    return datetime.now(UTC)


class Target(NamedTuple):
    """One thing a scheduler launches into, inside a pool of paid-for capacity: a cloud
    capacity reservation (`id` its id, `instances` its size, `free` what the cloud says
    is free in it now) or a private server (`id` its name; 1 and 1, or 0 free when it is
    down or drained)."""

    id: str
    instances: int
    free: int


@dataclass(frozen=True, slots=True)
class Offer:
    """A pool's current state, as one poll of its cloud saw it.

    `price_per_hour` is USD per instance; `None` when the cloud publishes no price for the
    pool (such an offer is listed but never placed on). Signals the cloud does not give
    are `None`, never a guess: `availability` 0..1, `capacity` free instances,
    `interruption_rate` interruptions per hour (spot only), `quota_headroom` GPUs.
    `gpu_known` is False when the adapter could not map the cloud's GPU name onto a
    canonical one; `gpu` then holds the cloud's own name.

    `quota_group` names the quota the pool shares with others (`aws:us-east-1:G:spot`),
    and `quota_units` what one instance counts against it (its vCPUs, or GPUs where the
    cloud's quota counts GPUs); `None` when the headroom is the pool's own.

    Paid-for capacity (market `reserved`) lists its `targets`: the reservations or
    servers a lease is launched into, each assigned to leases by the pool; `draining`
    names the targets a maintenance window is about to take (leases on them move with
    reason `maintenance`). `owned_gpus` is the pool's paid-for GPUs, free or not.

    `observed_at` is when the price (and the signals read with it) was read;
    `rate_observed_at` when the source of `interruption_rate` was published or observed,
    where the cloud says (AWS: the Spot Instance Advisor document's Last-Modified, a
    trailing month's share republished every few months); `None` when it does not.
    """

    pool: PoolKey
    gpu: str
    gpus: int
    gpu_memory_gb: float | None
    vcpus: int | None
    memory_gb: float | None
    price_per_hour: float | None
    observed_at: datetime
    availability: float | None = None
    capacity: int | None = None
    interruption_rate: float | None = None
    quota_headroom: int | None = None
    gpu_known: bool = True
    quota_group: str | None = None
    quota_units: int | None = None
    targets: tuple[Target, ...] = ()
    draining: tuple[str, ...] = ()
    rate_observed_at: datetime | None = None

    @property
    def owned_gpus(self) -> int:
        return sum(t.instances for t in self.targets) * self.gpus

    @property
    def price_per_gpu_hour(self) -> float | None:
        if self.price_per_hour is None or self.gpus <= 0:
            return None
        return self.price_per_hour / self.gpus

    def to_json(self) -> dict[str, Any]:
        """The exact shape of `gpubroker offers --format json` and `/v1/offers`."""
        ppg = self.price_per_gpu_hour
        return {
            "cloud": self.pool.cloud,
            "region": self.pool.region,
            "zone": self.pool.zone,
            "instance_type": self.pool.instance_type,
            "market": self.pool.market.value,
            "gpu": self.gpu,
            "gpus": self.gpus,
            "gpu_memory_gb": self.gpu_memory_gb,
            "vcpus": self.vcpus,
            "memory_gb": self.memory_gb,
            "price_per_hour": _round(self.price_per_hour),
            "price_per_gpu_hour": _round(ppg),
            "observed_at": iso(self.observed_at),
            "availability": self.availability,
            "capacity": self.capacity,
            "interruption_rate": self.interruption_rate,
            "quota_headroom": self.quota_headroom,
            **({"owned_gpus": self.owned_gpus} if self.targets else {}),
            **({"rate_observed_at": iso(self.rate_observed_at)}
               if self.rate_observed_at is not None else {}),
        }

    def to_record(self) -> list[Any]:
        """Everything placement reads of the offer, as a compact JSON-able list: the
        leader shares its polls with the standbys in this form (`from_record` reads it
        back equal). `rate_observed_at` is the trailing element, left out when None, so
        a record is read alike by a daemon that predates it."""
        r = [*self.pool[:4], self.pool.market.value, self.gpu, self.gpus,
             self.gpu_memory_gb, self.vcpus, self.memory_gb, self.price_per_hour,
             iso(self.observed_at), self.availability, self.capacity,
             self.interruption_rate, self.quota_headroom, self.gpu_known,
             self.quota_group, self.quota_units, [list(t) for t in self.targets],
             list(self.draining)]
        if self.rate_observed_at is not None:
            r.append(iso(self.rate_observed_at))
        return r

    @classmethod
    def from_record(cls, r: list[Any]) -> Offer:
        """Read a `to_record` list back; one without the trailing `rate_observed_at`
        (written before it existed) reads as None."""
        (cloud, region, zone, itype, market, gpu, gpus, mem, vcpus, ram, price, observed,
         avail, capacity, rate, headroom, known, group, units, targets, draining) = r[:21]
        rate_at = parse_iso(r[21]) if len(r) > 21 and r[21] is not None else None
        return cls(PoolKey(cloud, region, zone, itype, Market(market)), gpu, gpus, mem,
                   vcpus, ram, price, parse_iso(observed), avail, capacity, rate, headroom,
                   known, group, units, tuple(Target(*t) for t in targets), tuple(draining),
                   rate_at)


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


class _NoLabels(Mapping[str, str]):
    """The type of `NO_LABELS`: an empty mapping that cannot be changed, equal to `{}`,
    and pickled and copied as that one object (a `MappingProxyType` would be refused
    by pickle, and so would every request holding it)."""

    __slots__ = ()

    def __getitem__(self, key: str) -> str:
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "{}"

    def __reduce__(self) -> str:
        return "NO_LABELS"  # this module's global of that name


NO_LABELS: Mapping[str, str] = _NoLabels()
"""A request's labels when it has none: one read-only empty mapping shared by every such
request instead of an empty dict in each."""

_ONE_GPU: Mapping[str, tuple[str]] = MappingProxyType({name: (name,) for name in GPU_MODELS})
"""The `gpu` of a request for one canonical model, shared by every such request."""


def _names(names: tuple[str, ...]) -> tuple[str, ...]:
    if len(names) == 1 and (one := _ONE_GPU.get(names[0])) is not None:
        return one
    return tuple(map(sys.intern, names))


@dataclass(frozen=True, slots=True)
class PlaceRequest:
    """A validated placement request (SPEC §4). `market` None means "policy default".

    In memory, the names many requests repeat (scheduler, team, market, GPU models) are
    interned, one canonical GPU model is a shared tuple and no labels are `NO_LABELS`
    (`__post_init__`): a request held by an active lease costs no copy of them (#31).
    Interned strings are freed with their last reference (CPython's interning is not
    immortal before 3.12), so a scheduler's made-up names do not pile up."""

    scheduler: str
    request_id: str
    gpu: tuple[str, ...]
    gpus: int
    gang: bool = True
    market: str | None = None  # spot | on_demand | reserved | any
    max_price_per_gpu_hour: float | None = None
    clouds: tuple[str, ...] | None = None
    regions: tuple[str, ...] | None = None
    team: str | None = None
    duration_hours: float | None = None
    lease_seconds: int | None = None
    labels: Mapping[str, str] = field(default_factory=lambda: NO_LABELS)
    max_parts: int = 1  # with gang False: how many leases (pools) it may be split into

    def __post_init__(self) -> None:
        put = object.__setattr__  # the dataclass is frozen; this is its construction
        put(self, "scheduler", sys.intern(self.scheduler))
        put(self, "gpu", _names(self.gpu))
        if self.market is not None:
            put(self, "market", sys.intern(self.market))
        if self.team is not None:
            put(self, "team", sys.intern(self.team))
        if not self.labels:
            put(self, "labels", NO_LABELS)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "request_id": self.request_id,
            "gpu": list(self.gpu),
            "gpus": self.gpus,
            "gang": self.gang,
        }
        if self.max_parts != 1:
            d["max_parts"] = self.max_parts
        for name in ("market", "max_price_per_gpu_hour", "team", "duration_hours",
                     "lease_seconds"):
            v = getattr(self, name)
            if v is not None:
                d[name] = v
        if self.clouds is not None:
            d["clouds"] = list(self.clouds)
        if self.regions is not None:
            d["regions"] = list(self.regions)
        if self.labels:
            d["labels"] = dict(self.labels)
        return d

    @classmethod
    def from_json(cls, scheduler: str, r: dict[str, Any]) -> PlaceRequest:
        """Rebuild a request `to_json` wrote (trusted input; see broker.wire.validation for
        validating what schedulers send)."""
        return cls(
            scheduler=scheduler,
            request_id=r["request_id"],
            gpu=tuple(r["gpu"]),
            gpus=r["gpus"],
            gang=r.get("gang", True),
            market=r.get("market"),
            max_price_per_gpu_hour=r.get("max_price_per_gpu_hour"),
            clouds=tuple(r["clouds"]) if "clouds" in r else None,
            regions=tuple(r["regions"]) if "regions" in r else None,
            team=r.get("team"),
            duration_hours=r.get("duration_hours"),
            lease_seconds=r.get("lease_seconds"),
            labels=dict(r.get("labels", {})),
            max_parts=r.get("max_parts", 1),
        )


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: str
    scheduler: str
    request_id: str
    request: PlaceRequest
    placement: Placement
    epoch: int
    state: LeaseState
    created_at: datetime
    expires_at: datetime
    lease_seconds: int
    max_price_per_gpu_hour: float | None  # the cap the lease was decided under
    updated_at: datetime
    # A split request (gang false, max_parts > 1) is several leases, one per pool: `part`
    # is this one's number (1 is the head, which the request's idempotency finds), `parts`
    # every part's lease id in order. A whole request's lease: 0 and ().
    part: int = 0
    parts: tuple[str, ...] = ()
    # How an ended lease ended (None while active): `released`, `expired`, or the failover
    # reason that failed it (`ended`: failed before the store kept the reason), what
    # happened for a person, and when. Kept with the lease and repeated in the answers.
    ended_reason: str | None = None
    ended_detail: str | None = None
    ended_at: datetime | None = None

    def __post_init__(self) -> None:
        # In memory, a lease shares what it repeats: its request's strings, one object for
        # equal times (a lease read back from the store has a copy of each; one made by
        # the lease book shares them already). Equal values, so nothing else sees it.
        put = object.__setattr__  # the dataclass is frozen; this is its construction
        r = self.request
        if self.scheduler is not r.scheduler and self.scheduler == r.scheduler:
            put(self, "scheduler", r.scheduler)
        if self.request_id is not r.request_id and self.request_id == r.request_id:
            put(self, "request_id", r.request_id)
        if self.updated_at is not self.created_at and self.updated_at == self.created_at:
            put(self, "updated_at", self.created_at)
        if self.ended_at is not None and self.ended_at == self.updated_at:
            put(self, "ended_at", self.updated_at)
        if self.ended_reason is not None:
            put(self, "ended_reason", sys.intern(self.ended_reason))

    def to_json(self) -> dict[str, Any]:
        """The retained `P/leases/S/<lease_id>` payload and the HTTP lease shape (with
        `ended_reason`, `ended_detail` and `ended_at` once ended)."""
        return {
            "lease_id": self.lease_id,
            "scheduler": self.scheduler,
            "request_id": self.request_id,
            "state": self.state.value,
            "epoch": self.epoch,
            "placement": self.placement.to_json(),
            "created_at": iso(self.created_at),
            "expires_at": iso(self.expires_at),
            "updated_at": iso(self.updated_at),
            "lease_seconds": self.lease_seconds,
            "max_price_per_gpu_hour": self.max_price_per_gpu_hour,
            **({"part": self.part, "parts": list(self.parts)} if self.part else {}),
            **(self.end_json() if self.state is not LeaseState.ACTIVE else {}),
        }

    def end_json(self) -> dict[str, Any]:
        """How an ended lease ended: `ended_reason`, `ended_detail`, `ended_at`."""
        return {"ended_reason": self.ended_reason or self.state.value,
                "ended_detail": self.ended_detail,
                "ended_at": iso(self.ended_at or self.updated_at)}


@dataclass(frozen=True, slots=True)
class Event:
    """One event for a scheduler, before it gets its envelope (SPEC §5).

    `kind` is the topic suffix (`placement.decided`); the CloudEvents `type` is
    `gpubroker.<kind>.v1`.
    """

    kind: str
    scheduler: str
    data: dict[str, Any]
    subject: str
    correlationid: str | None = None

    @property
    def type(self) -> str:
        return f"gpubroker.{self.kind}.v1"


def gpu_hours_cost(price_per_gpu_hour: float | None) -> float:
    """Sort key that puts unpriced offers last."""
    return math.inf if price_per_gpu_hour is None else price_per_gpu_hour


class SignalKind(StrEnum):
    INTERRUPTED = "interrupted"  # the cloud reclaims (or will within minutes) the pool's instances
    REBALANCE = "rebalance"  # the cloud says the pool is at elevated risk
    CAPACITY_LOST = "capacity_lost"  # the pool can no longer be launched into


@dataclass(frozen=True, slots=True)
class CapacitySignal:
    """A push notice from a cloud about one pool, outside the poll cycle.

    `received_at` is when the notice reached gpubroker (for failover latency);
    `detail` is human-readable and never holds credentials.
    """

    pool: PoolKey
    kind: SignalKind
    received_at: datetime
    detail: str = ""
