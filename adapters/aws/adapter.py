"""The AWS adapter: GPU instance types, where they are offered, spot and on-demand
prices, spot placement scores, EC2 quotas and spot interruption notices.

What one poll of a region asks, and how often (everything through `AwsSdk`, on the
adapter's own thread pool, so one slow API never blocks the event loop):

* GPU instance types — `DescribeInstanceTypes` (paginated, keep `GpuInfo`); every 6 h;
  required.
* zones offering them — `DescribeInstanceTypeOfferings` by availability zone; every
  hour; required.
* spot prices — `DescribeSpotPriceHistory` for Linux/UNIX, asking only for what changed
  since the last poll; every poll; required.
* on-demand prices — Price List `GetProducts` (TERM_MATCH filters), one call per type;
  every 6 h; on failure the last good copy is kept.
* spot capacity — `GetSpotPlacementScores` per type (score 1–10 → availability) and the
  account's zone IDs; every 30 min; last good copy kept.
* quota headroom — Service Quotas, the G/VT and P vCPU quotas, on-demand and spot; every
  10 min; last good copy kept.

A poll that fails raises a typed error: the poller marks the region unhealthy and its
offers age until stale (not placed on) — which is not "no capacity", so an API that
blinks causes no failovers.

Spot interruption notices come from an optional SQS queue fed by EventBridge
(`interruption_queue_url`): "EC2 Spot Instance Interruption Warning" becomes an
`interrupted` signal for the instance's pool, "EC2 Instance Rebalance Recommendation" a
`rebalance` signal; "EC2 Instance State-change Notification" only keeps the
instance → pool cache current. Only pools the broker leases are signalled.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, TypeVar
from urllib.parse import urlsplit

import structlog

from adapters.aws import pricing
from adapters.aws.sdk import AwsSdk
from adapters.base import CloudAdapter, LeasedPools, run_blocking
from adapters.common import Cached, gather_all, note_optional
from adapters.errors import AdapterError, InvalidConfig
from broker.model import CapacitySignal, Market, Offer, PoolKey, SignalKind, utcnow

log = structlog.get_logger("gpubroker.aws")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Refresh:
    """How old each cached answer may get, in seconds."""

    instance_types: float = 6 * 3600
    offerings: float = 3600
    on_demand: float = 6 * 3600
    placement_scores: float = 1800
    quotas: float = 600
    spot_overlap: float = 60  # re-ask this much before the last poll, for clock skew
    first_spot_window: float = 86400


@dataclass(frozen=True, slots=True)
class _Type:
    name: str
    gpu: str
    gpus: int
    gpu_memory_gb: float | None
    known: bool
    vcpus: int | None
    memory_gb: float | None


@dataclass(slots=True)
class _RegionState:
    types: Cached[dict[str, _Type]] = field(default_factory=lambda: Cached({}))
    offerings: Cached[list[tuple[str, str]]] = field(default_factory=lambda: Cached([]))
    on_demand: Cached[dict[str, float | None]] = field(default_factory=lambda: Cached({}))
    scores: Cached[dict[tuple[str, str], int]] = field(default_factory=lambda: Cached({}))
    quotas: Cached[dict[str, float | None]] = field(default_factory=lambda: Cached({}))
    spot: dict[tuple[str, str], tuple[float, datetime]] = field(default_factory=dict)
    spot_since: datetime | None = None


class AwsAdapter(CloudAdapter):
    name = "aws"

    def __init__(self, *, regions: Sequence[str], endpoint: str | None = None,
                 anonymous: bool = False, interruption_queue_url: str | None = None,
                 refresh: Refresh | None = None, max_workers: int | None = None,
                 clock: Callable[[], datetime] = utcnow,
                 monotonic: Callable[[], float] = time.monotonic,
                 on_call: Callable[[str, str], None] | None = None) -> None:
        if not regions:
            raise InvalidConfig("clouds.aws.regions is empty: list the regions to poll",
                                cloud="aws")
        self._regions = list(dict.fromkeys(regions))
        self._refresh = refresh or Refresh()
        self._clock = clock
        self._mono = monotonic
        # SDK calls wait on the network, not the CPU: a first poll fans out to ~150 calls
        # per region (prices and placement scores per type), so give each region threads.
        workers = max_workers or min(128, 24 * len(self._regions))
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="aws")
        self.sdk = AwsSdk(endpoint=endpoint, anonymous=anonymous, on_call=on_call)
        self._state = {r: _RegionState() for r in self._regions}
        self._queue_url = interruption_queue_url
        self._instances: dict[str, PoolKey] = {}

    def regions(self) -> Sequence[str]:
        return self._regions

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await run_blocking(self._executor, fn, *args)

    # --- poll ----------------------------------------------------------------------

    async def poll(self, region: str) -> list[Offer]:
        st = self._state.get(region)
        if st is None:
            raise InvalidConfig(f"region {region!r} is not configured", cloud="aws",
                                region=region)
        now, mono = self._clock(), self._mono()
        rf = self._refresh
        if st.types.older_than(rf.instance_types, mono):
            infos = await self._run(self.sdk.gpu_instance_types, region)
            st.types = Cached({t.name: t for t in map(_type_of, infos)}, mono, now)
        names = sorted(st.types.value)
        if not names:
            return []
        required: list[Any] = [self._spot(region, st, names, now)]
        if st.offerings.older_than(rf.offerings, mono):
            required.append(self._offerings(region, st, names, mono, now))
        optional = []
        if st.on_demand.older_than(rf.on_demand, mono):
            optional.append(("on-demand prices", self._on_demand(region, st, names, mono, now)))
        if st.scores.older_than(rf.placement_scores, mono):
            optional.append(("spot placement scores", self._scores(region, st, names, mono,
                                                                   now)))
        if st.quotas.older_than(rf.quotas, mono):
            optional.append(("quotas", self._quotas(region, st, mono, now)))
        results = await asyncio.gather(*required, *(c for _, c in optional),
                                       return_exceptions=True)
        for r in results[:len(required)]:
            if isinstance(r, BaseException):
                raise r
        for (what, _), r in zip(optional, results[len(required):], strict=True):
            self._note_optional(region, what, r)
        return self._offers(region, st, now)

    def _note_optional(self, region: str, what: str, result: object) -> None:
        """An optional answer failed: keep the last good copy, log on change only."""
        cache = {"on-demand prices": "on_demand", "spot placement scores": "scores",
                 "quotas": "quotas"}[what]
        note_optional(log, "aws", region, what, getattr(self._state[region], cache), result)

    async def _offerings(self, region: str, st: _RegionState, names: list[str],
                         mono: float, now: datetime) -> None:
        pairs = await self._run(self.sdk.offerings, region, names)
        st.offerings = Cached(sorted(set(pairs)), mono, now)

    async def _spot(self, region: str, st: _RegionState, names: list[str],
                    now: datetime) -> None:
        since = (now - timedelta(seconds=self._refresh.first_spot_window)
                 if st.spot_since is None
                 else st.spot_since - timedelta(seconds=self._refresh.spot_overlap))
        for itype, zone, price, ts in await self._run(self.sdk.spot_prices, region, names,
                                                      since):
            prev = st.spot.get((itype, zone))
            if prev is None or ts >= prev[1]:
                st.spot[(itype, zone)] = (price, ts)
        st.spot_since = now

    async def _on_demand(self, region: str, st: _RegionState, names: list[str],
                         mono: float, now: datetime) -> None:
        async def one(name: str) -> tuple[str, float | None]:
            docs = await self._run(self.sdk.on_demand_products, region, name)
            return name, pricing.on_demand_price(docs, name, region)

        prices = dict(await gather_all(one(n) for n in names))
        st.on_demand = Cached(prices, mono, now)

    async def _scores(self, region: str, st: _RegionState, names: list[str],
                      mono: float, now: datetime) -> None:
        zone_names = await self._run(self.sdk.zone_ids, region)

        async def one(name: str) -> dict[tuple[str, str], int]:
            by_id = await self._run(self.sdk.placement_scores, region, name)
            return {(name, zone_names[z]): s for z, s in by_id.items() if z in zone_names}

        scores: dict[tuple[str, str], int] = {}
        for part in await gather_all(one(n) for n in names):
            scores.update(part)
        st.scores = Cached(scores, mono, now)

    async def _quotas(self, region: str, st: _RegionState, mono: float, now: datetime
                      ) -> None:
        codes = [c for pair in pricing.QUOTA_CODES.values() for c in pair]
        values = await gather_all(self._run(self.sdk.quota, region, c) for c in codes)
        st.quotas = Cached(dict(zip(codes, values, strict=True)), mono, now)

    def _offers(self, region: str, st: _RegionState, now: datetime) -> list[Offer]:
        out: list[Offer] = []
        od_read = st.on_demand.read_at or now
        for itype, zone in st.offerings.value:
            t = st.types.value.get(itype)
            if t is None:
                continue
            family = pricing.quota_family(itype)
            od_code, spot_code = pricing.QUOTA_CODES.get(family or "", (None, None))
            common = dict(gpu=t.gpu, gpus=t.gpus, gpu_memory_gb=t.gpu_memory_gb,
                          vcpus=t.vcpus, memory_gb=t.memory_gb, gpu_known=t.known)
            out.append(Offer(
                pool=PoolKey("aws", region, zone, itype, Market.ON_DEMAND),
                price_per_hour=st.on_demand.value.get(itype), observed_at=od_read,
                quota_headroom=pricing.headroom_gpus(
                    st.quotas.value.get(od_code) if od_code else None, t.vcpus, t.gpus),
                quota_group=f"aws:{region}:{od_code}" if od_code else None,
                quota_units=t.vcpus if od_code else None,
                **common))  # type: ignore[arg-type]
            spot = st.spot.get((itype, zone))
            out.append(Offer(
                pool=PoolKey("aws", region, zone, itype, Market.SPOT),
                price_per_hour=spot[0] if spot else None, observed_at=now,
                availability=pricing.availability_of(st.scores.value.get((itype, zone))),
                quota_headroom=pricing.headroom_gpus(
                    st.quotas.value.get(spot_code) if spot_code else None, t.vcpus, t.gpus),
                quota_group=f"aws:{region}:{spot_code}" if spot_code else None,
                quota_units=t.vcpus if spot_code else None,
                **common))  # type: ignore[arg-type]
        return out

    # --- interruption notices ------------------------------------------------------

    def _queue_region(self) -> str:
        assert self._queue_url is not None
        host = urlsplit(self._queue_url).hostname or ""
        parts = host.split(".")
        if len(parts) >= 3 and parts[0] == "sqs":
            return parts[1]
        return self._regions[0]

    async def signals(self, leased: LeasedPools) -> AsyncGenerator[CapacitySignal, None]:
        if self._queue_url is None:
            async for never in super().signals(leased):
                yield never  # pragma: no cover - the default never yields
            return
        queue_region = self._queue_region()
        while True:
            messages = await self._run(self.sdk.receive, queue_region, self._queue_url)
            received = self._clock()
            done: list[str] = []
            for message in messages:
                done.append(message["ReceiptHandle"])
                notice = await self._signal_of(message, received)
                if notice is not None and notice.pool in leased():
                    yield notice
            await self._run(self.sdk.delete, queue_region, self._queue_url, done)

    async def _signal_of(self, message: dict[str, Any], received: datetime
                         ) -> CapacitySignal | None:
        try:
            event = json.loads(message.get("Body", ""))
            kind = event["detail-type"]
            detail = event["detail"]
            instance_id = str(detail["instance-id"])
            region = str(event.get("region") or self._regions[0])
        except (ValueError, KeyError, TypeError):
            log.warning("aws interruption queue: not an EC2 event, dropped",
                        message_id=message.get("MessageId"))
            return None
        if kind == "EC2 Instance State-change Notification":
            if detail.get("state") in ("terminated", "stopped"):
                self._instances.pop(instance_id, None)
            return None
        signal_kind = {"EC2 Spot Instance Interruption Warning": SignalKind.INTERRUPTED,
                       "EC2 Instance Rebalance Recommendation": SignalKind.REBALANCE}.get(kind)
        if signal_kind is None:
            return None
        pool = await self._pool_of(region, instance_id)
        if pool is None:
            return None
        return CapacitySignal(pool, signal_kind, received,
                              f"{kind} for {instance_id}"
                              + (f" ({detail['instance-action']})"
                                 if detail.get("instance-action") else ""))

    async def _pool_of(self, region: str, instance_id: str) -> PoolKey | None:
        if instance_id not in self._instances:
            try:
                found = await self._run(self.sdk.describe_instances, region, [instance_id])
            except AdapterError as exc:
                log.warning("aws interruption notice for an instance we cannot describe",
                            instance_id=instance_id, error=type(exc).__name__)
                return None
            for inst in found:
                market = (Market.SPOT if inst.get("InstanceLifecycle") == "spot"
                          else Market.ON_DEMAND)
                self._instances[inst["InstanceId"]] = PoolKey(
                    "aws", region, inst["Placement"]["AvailabilityZone"],
                    inst["InstanceType"], market)
        return self._instances.get(instance_id)

    async def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.sdk.close()


def _type_of(info: dict[str, Any]) -> _Type:
    gpu, gpus, mem, known = pricing.gpu_of(info)
    mib = info.get("MemoryInfo", {}).get("SizeInMiB")
    return _Type(
        name=info["InstanceType"], gpu=gpu, gpus=gpus, gpu_memory_gb=mem, known=known,
        vcpus=info.get("VCpuInfo", {}).get("DefaultVCpus"),
        memory_gb=None if mib is None else round(mib / 1024, 1))


def from_config(section: Any, **kwargs: Any) -> AwsAdapter:
    """Build the adapter from the daemon configuration's `clouds.aws` section."""
    return AwsAdapter(regions=section.regions, endpoint=section.endpoint,
                      anonymous=section.anonymous,
                      interruption_queue_url=section.interruption_queue_url, **kwargs)
