"""The AWS adapter: GPU instance types, where they are offered, spot and on-demand
prices, spot placement scores, EC2 quotas, spot interruption rates and spot
interruption notices.

What one poll of a region asks, and how often (everything through `AwsSdk`, on the
adapter's own thread pool, so one slow API never blocks the event loop). *Required*
parts make the poll fail when they cannot be read (after the seam's retries); a failed
*optional* part keeps its last good copy, or is unknown (`None`) until one arrives:

* GPU instance types — `DescribeInstanceTypes` (paginated, keep `GpuInfo`); every 6 h;
  required until the first good copy, then its last good copy is kept.
* zones offering them — `DescribeInstanceTypeOfferings` by availability zone; every
  hour; required until the first good copy, then its last good copy is kept.
* spot prices — `DescribeSpotPriceHistory` for Linux/UNIX, asking only for what changed
  since the last poll; every poll; always required (they are what a poll is for).
* on-demand prices — Price List `GetProducts` (TERM_MATCH filters), one call per type;
  every 6 h; required for every type that has no good copy yet (a first poll, a new
  type), then the last good copy is kept. A type the catalog has no price for (p5e in
  most regions) is offered with `price_per_hour=None`; a type whose price call failed
  is never offered that way: the poll fails instead.
* spot capacity — `GetSpotPlacementScores` per type (score 1–10 → availability) and the
  account's zone IDs; every 30 min; optional.
* quota headroom — Service Quotas, the G/VT and P vCPU quotas, on-demand and spot; every
  10 min; optional.
* interruption rates — the public Spot Instance Advisor document (one for all regions,
  read by the first region that needs it); every 6 h; optional. Its band of the share of
  spot instances interrupted in a month (`<5%` ... `>20%`) for the region, Linux and
  the instance type becomes the spot offers' `interruption_rate`: the band's midpoint
  (25 % for `>20%`) read as the probability p of an interruption within a month,
  rate = −ln(1 − p) / 730 per hour (`pricing.band_rate`). A type the document does not
  list has `interruption_rate=None`. The document's `Last-Modified` (AWS republishes it
  every few months) is the spot offers' `rate_observed_at`: when the rate was observed,
  which the fetch time (`observed_at`) is not.
* capacity reservations — `DescribeCapacityReservations` (state active, paginated);
  every poll (their free counts are what placement needs); optional, and only with
  `reservations` on (`clouds.aws.reservations.enabled`). The account's active On-Demand
  Capacity Reservations of GPU instance types (the instance-type catalog above says
  which), grouped by zone and type into one offer per pool in the `reserved` market:
  `targets` the reservations by id (sorted), each with its size and
  `AvailableInstanceCount`, `capacity` their sum, `availability` 1.0 (capacity says
  what is free: availability 0 would fail every lease on the pool over),
  `price_per_hour` the configured marginal price per GPU-hour × GPUs, no quota (the
  reservation holds its own). Capacity Blocks, interruptible reservations and ended
  ones are left out; so are entries that do not read (a field missing, a count
  negative or above 100,000), each logged at debug level. A read that fails keeps the
  pools and reservations of the last good read listed with nothing free (`free` and
  `capacity` 0): leases on them stay (a pool or a target missing from a poll would fail
  them over), new ones go elsewhere until a read succeeds. Before any good read there
  are no reserved offers. A denied permission is logged once per region, naming
  `ec2:DescribeCapacityReservations`.

A poll that fails raises a typed error: the poller marks the region unhealthy and its
offers age until stale (not placed on) — which is not "no capacity", so an API that
blinks causes no failovers.

Spot interruption notices come from an optional SQS queue fed by EventBridge
(`interruption_queue_url`): "EC2 Spot Instance Interruption Warning" becomes an
`interrupted` signal for the instance's pool, "EC2 Instance Rebalance Recommendation" a
`rebalance` signal; "EC2 Instance State-change Notification" only keeps the
instance → pool cache current. Only pools the broker leases are signalled. A message
is deleted from the queue only once it is done with: its signal was delivered (the
consumer asked for the next one), or it is irrelevant (not an EC2 event, another pool,
an instance AWS does not know). A message whose instance could not be described for a
transient reason stays on the queue and comes back after its visibility timeout.
Delivery is at least once: a consumer that stops right after a signal may see it again.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, TypeVar
from urllib.parse import urlsplit

import structlog

from adapters.aws import pricing
from adapters.aws.sdk import AwsSdk
from adapters.base import CloudAdapter, LeasedPools, run_blocking
from adapters.common import (
    Cached,
    RetryPolicy,
    gather_all,
    note_optional,
    note_reservations_failed,
)
from adapters.errors import AdapterError, InvalidConfig
from broker.model import CapacitySignal, Market, Offer, PoolKey, SignalKind, Target, utcnow

log = structlog.get_logger("gpubroker.aws")
T = TypeVar("T")
V = TypeVar("V")


@dataclass(frozen=True, slots=True)
class Refresh:
    """How old each cached answer may get, in seconds."""

    instance_types: float = 6 * 3600
    offerings: float = 3600
    on_demand: float = 6 * 3600
    placement_scores: float = 1800
    quotas: float = 600
    interruption_rates: float = 6 * 3600
    reservations: float = 0.0  # capacity reservations: every poll (0)
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
    reserved: Cached[list[pricing.Reservation]] = field(default_factory=lambda: Cached([]))


@dataclass(slots=True)
class _Part:
    """One part of a poll: what it reads, its cache, whether the poll needs it."""

    what: str
    cached: Cached[Any]
    required: bool
    run: Coroutine[Any, Any, None]


class AwsAdapter(CloudAdapter):
    name = "aws"

    # Many arguments: the adapter's settings, keyword-only, passed by name.
    def __init__(self, *, regions: Sequence[str], endpoint: str | None = None,  # noqa: PLR0913
                 anonymous: bool = False, interruption_queue_url: str | None = None,
                 call_timeout: float = 10.0, retry: RetryPolicy | None = None,
                 refresh: Refresh | None = None, max_workers: int | None = None,
                 clock: Callable[[], datetime] = utcnow,
                 monotonic: Callable[[], float] = time.monotonic,
                 on_call: Callable[[str, str], None] | None = None,
                 reservations: bool = False,
                 reservation_price_per_gpu_hour: float = 0.0) -> None:
        """`reservations`: read the account's capacity reservations and offer them in
        the `reserved` market at `reservation_price_per_gpu_hour` (USD per GPU-hour at
        the margin; 0: already paid for). Off unless asked for; the configuration's
        default (`from_config`) is on."""
        if not regions:
            raise InvalidConfig("clouds.aws.regions is empty: list the regions to poll",
                                cloud="aws")
        self._regions = list(dict.fromkeys(regions))
        self._reservations = reservations
        self._reserved_price = reservation_price_per_gpu_hour
        self._refresh = refresh or Refresh()
        self._clock = clock
        self._mono = monotonic
        # SDK calls wait on the network, not the CPU: a first poll fans out to ~150 calls
        # per region (prices and placement scores per type), so give each region threads.
        workers = max_workers or min(128, 24 * len(self._regions))
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="aws")
        self.sdk = AwsSdk(endpoint=endpoint, anonymous=anonymous, call_timeout=call_timeout,
                          retry=retry, on_call=on_call)
        self._state = {r: _RegionState() for r in self._regions}
        # The Spot Instance Advisor document is one for all regions: region → type → rate.
        self._advisor: Cached[dict[str, dict[str, float]]] = Cached({})
        self._advisor_lock = asyncio.Lock()
        self._advisor_tried = -1e18  # monotonic time the last fetch of it ended
        self._advisor_error: AdapterError | None = None  # how that fetch failed, if it did
        self._advisor_published: datetime | None = None  # the document's Last-Modified
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
            types = self._types(region, st, mono, now)
            await self._settle(region, [_Part("instance types", st.types,
                                              st.types.read_at is None, types)])
        names = sorted(st.types.value)
        if not names:
            return []
        parts = [_Part("spot prices", Cached(None), True, self._spot(region, st, names, now))]
        if st.offerings.older_than(rf.offerings, mono):
            parts.append(_Part("offerings", st.offerings, st.offerings.read_at is None,
                               self._offerings(region, st, names, mono, now)))
        unpriced = [n for n in names if n not in st.on_demand.value]
        if unpriced or st.on_demand.older_than(rf.on_demand, mono):
            # Types without any price copy must be priced: never "no price" for a failure.
            parts.append(_Part("on-demand prices", st.on_demand, bool(unpriced),
                               self._on_demand(region, st, names, unpriced, mono, now)))
        if st.scores.older_than(rf.placement_scores, mono):
            parts.append(_Part("spot placement scores", st.scores, False,
                               self._scores(region, st, names, mono, now)))
        if st.quotas.older_than(rf.quotas, mono):
            parts.append(_Part("quotas", st.quotas, False, self._quotas(region, st, mono, now)))
        if self._advisor.older_than(rf.interruption_rates, mono):
            parts.append(_Part("interruption rates", self._advisor, False,
                               self._interruption_rates(mono, now)))
        if self._reservations and (rf.reservations <= 0
                                   or st.reserved.older_than(rf.reservations, mono)):
            # Never fails: `_reserved` notes its own failures (see the module doc).
            parts.append(_Part("capacity reservations", Cached(None), False,
                               self._reserved(region, st, mono, now)))
        await self._settle(region, parts)
        return self._offers(region, st, now)

    async def _settle(self, region: str, parts: list[_Part]) -> None:
        """Run `parts` together and wait for all of them (their calls run on threads,
        which must not go on retrying after the poll ends). A failed optional part keeps
        its last good copy (logged on change only); then the first failed required part's
        error is raised. Anything but an `AdapterError` is a bug and raised as it is."""
        results = await asyncio.gather(*(p.run for p in parts), return_exceptions=True)
        failed: BaseException | None = None
        for part, result in zip(parts, results, strict=True):
            if isinstance(result, BaseException) and (
                    part.required or not isinstance(result, AdapterError)):
                failed = failed or result
                continue
            note_optional(log, "aws", region, part.what, part.cached, result)
        if failed is not None:
            raise failed

    async def _types(self, region: str, st: _RegionState, mono: float, now: datetime
                     ) -> None:
        infos = await self._run(self.sdk.gpu_instance_types, region)
        _fill(st.types, {t.name: t for t in map(_type_of, infos)}, mono, now)

    async def _offerings(self, region: str, st: _RegionState, names: list[str],
                         mono: float, now: datetime) -> None:
        pairs = await self._run(self.sdk.offerings, region, names)
        _fill(st.offerings, sorted(set(pairs)), mono, now)

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
                         unpriced: list[str], mono: float, now: datetime) -> None:
        """All types' prices when the copy is due, else only those of `unpriced` types
        (added to the copy, which keeps its age). A type the catalog has no price for
        is priced None; a failed call fails the whole refresh."""
        due = st.on_demand.older_than(self._refresh.on_demand, mono)

        async def one(name: str) -> tuple[str, float | None]:
            docs = await self._run(self.sdk.on_demand_products, region, name)
            return name, pricing.on_demand_price(docs, name, region)

        prices = dict(await gather_all(one(n) for n in (names if due else unpriced)))
        if due:
            _fill(st.on_demand, prices, mono, now)
        else:
            st.on_demand.value.update(prices)

    async def _scores(self, region: str, st: _RegionState, names: list[str],
                      mono: float, now: datetime) -> None:
        zone_names = await self._run(self.sdk.zone_ids, region)

        async def one(name: str) -> dict[tuple[str, str], int]:
            by_id = await self._run(self.sdk.placement_scores, region, name)
            return {(name, zone_names[z]): s for z, s in by_id.items() if z in zone_names}

        scores: dict[tuple[str, str], int] = {}
        for part in await gather_all(one(n) for n in names):
            scores.update(part)
        _fill(st.scores, scores, mono, now)

    async def _quotas(self, region: str, st: _RegionState, mono: float, now: datetime
                      ) -> None:
        codes = [c for pair in pricing.QUOTA_CODES.values() for c in pair]
        values = await gather_all(self._run(self.sdk.quota, region, c) for c in codes)
        _fill(st.quotas, dict(zip(codes, values, strict=True)), mono, now)

    async def _interruption_rates(self, mono: float, now: datetime) -> None:
        """Refresh the Spot Instance Advisor's rates, once for all regions: a region
        that finds a fetch under way waits for it, and does not fetch again if that one
        ended after this poll began; it shares its outcome."""
        async with self._advisor_lock:
            if self._advisor_tried >= mono:
                if self._advisor_error is not None:
                    raise self._advisor_error
                return
            if not self._advisor.older_than(self._refresh.interruption_rates, mono):
                return
            try:
                doc, published = await self._run(self.sdk.spot_advisor_document)
                try:
                    rates = pricing.interruption_rates(doc, self._regions)
                except ValueError as exc:
                    raise AdapterError(f"Spot Instance Advisor: {exc}", cloud="aws") from None
            except AdapterError as exc:
                self._advisor_error = exc
                raise
            finally:
                self._advisor_tried = self._mono()
            self._advisor_error = None
            self._advisor_published = published
            _fill(self._advisor, rates, mono, now)

    async def _reserved(self, region: str, st: _RegionState, mono: float, now: datetime
                        ) -> None:
        """Read the region's capacity reservations into `st.reserved`. A failure is
        noted (logged on change; a denied permission named) and leaves the last good
        copy, marked failing; it is not raised."""
        try:
            raw = await self._run(self.sdk.capacity_reservations, region)
        except AdapterError as exc:
            note_reservations_failed(log, "aws", region, "capacity reservations",
                                     pricing.RESERVATIONS_PERMISSION, st.reserved, exc)
            return
        kept: dict[str, pricing.Reservation] = {}
        for entry in raw:
            try:
                r = pricing.reservation_of(entry, region, now)
            except ValueError as exc:
                log.debug("aws capacity reservation skipped", region=region,
                          reservation=_reservation_id(entry), reason=str(exc))
                continue
            kept.setdefault(r.id, r)
        note_optional(log, "aws", region, "capacity reservations", st.reserved, kept)
        _fill(st.reserved, list(kept.values()), mono, now)

    def _reserved_offers(self, region: str, st: _RegionState) -> list[Offer]:
        """One `reserved` offer per (zone, GPU instance type) of the reservations read;
        with nothing free while the last read failed."""
        failing = st.reserved.failing
        pools: dict[tuple[str, str], list[Target]] = {}
        for r in st.reserved.value:
            if r.instance_type not in st.types.value:
                log.debug("aws capacity reservation skipped", region=region,
                          reservation=r.id,
                          reason=f"{r.instance_type} is not a GPU instance type here")
                continue
            pools.setdefault((r.zone, r.instance_type), []).append(
                Target(r.id, r.total, 0 if failing else r.available))
        out: list[Offer] = []
        for (zone, itype), targets in sorted(pools.items()):
            t = st.types.value[itype]
            out.append(Offer(
                pool=PoolKey("aws", region, zone, itype, Market.RESERVED), gpu=t.gpu,
                gpus=t.gpus, gpu_memory_gb=t.gpu_memory_gb, vcpus=t.vcpus,
                memory_gb=t.memory_gb, gpu_known=t.known,
                price_per_hour=self._reserved_price * t.gpus,
                observed_at=st.reserved.read_at or self._clock(), availability=1.0,
                capacity=sum(x.free for x in targets),
                targets=tuple(sorted(targets, key=lambda x: x.id))))
        return out

    def _offers(self, region: str, st: _RegionState, now: datetime) -> list[Offer]:
        out: list[Offer] = []
        od_read = st.on_demand.read_at or now
        rates = self._advisor.value.get(region, {})
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
            rate = rates.get(itype)
            out.append(Offer(
                pool=PoolKey("aws", region, zone, itype, Market.SPOT),
                price_per_hour=spot[0] if spot else None, observed_at=now,
                availability=pricing.availability_of(st.scores.value.get((itype, zone))),
                interruption_rate=rate,
                rate_observed_at=self._advisor_published if rate is not None else None,
                quota_headroom=pricing.headroom_gpus(
                    st.quotas.value.get(spot_code) if spot_code else None, t.vcpus, t.gpus),
                quota_group=f"aws:{region}:{spot_code}" if spot_code else None,
                quota_units=t.vcpus if spot_code else None,
                **common))  # type: ignore[arg-type]
        if self._reservations:
            out.extend(self._reserved_offers(region, st))
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
            done: list[str] = []  # delivered or irrelevant: deleted after this batch
            for message in messages:
                try:
                    notice = await self._signal_of(message, received)
                except AdapterError as exc:
                    # Left on the queue: it comes back after its visibility timeout.
                    log.warning("aws interruption notice not resolved yet, left on the queue",
                                message_id=message.get("MessageId"),
                                error=type(exc).__name__, detail=str(exc))
                    continue
                if notice is not None and notice.pool in leased():
                    yield notice  # delivered once the consumer asks for the next one
                done.append(message["ReceiptHandle"])
            await self._run(self.sdk.delete, queue_region, self._queue_url, done)

    async def _signal_of(self, message: dict[str, Any], received: datetime
                         ) -> CapacitySignal | None:
        """The signal a queue message carries; None when it carries none for us (not an
        EC2 event, a state change, an instance AWS does not know). Raises a retryable
        `AdapterError` when the instance could not be described for now."""
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
        """The pool of an instance; None if AWS does not know it (or will not describe
        it: a permanent error, logged). Raises a transient error after the seam's
        retries, so that the caller keeps the message."""
        if instance_id not in self._instances:
            try:
                found = await self._run(self.sdk.describe_instances, region, [instance_id])
            except AdapterError as exc:
                if exc.retryable:
                    raise
                log.warning("aws interruption notice for an instance we cannot describe",
                            instance_id=instance_id, error=type(exc).__name__,
                            detail=str(exc))
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


def _fill(cached: Cached[V], value: V, mono: float, now: datetime) -> None:
    """A good answer into `cached`, in place (its `failing` flag is `note_optional`'s)."""
    cached.value, cached.at, cached.read_at = value, mono, now


def _reservation_id(entry: Any) -> str | None:
    rid = entry.get("CapacityReservationId") if isinstance(entry, dict) else None
    return rid if isinstance(rid, str) else None


def _type_of(info: dict[str, Any]) -> _Type:
    gpu, gpus, mem, known = pricing.gpu_of(info)
    mib = info.get("MemoryInfo", {}).get("SizeInMiB")
    return _Type(
        name=info["InstanceType"], gpu=gpu, gpus=gpus, gpu_memory_gb=mem, known=known,
        vcpus=info.get("VCpuInfo", {}).get("DefaultVCpus"),
        memory_gb=None if mib is None else round(mib / 1024, 1))


def from_config(section: Any, **kwargs: Any) -> AwsAdapter:
    """Build the adapter from the daemon configuration's `clouds.aws` section."""
    kwargs.setdefault("reservations", section.reservations.enabled)
    kwargs.setdefault("reservation_price_per_gpu_hour",
                      section.reservations.price_per_gpu_hour)
    return AwsAdapter(regions=section.regions, endpoint=section.endpoint,
                      anonymous=section.anonymous,
                      interruption_queue_url=section.interruption_queue_url,
                      call_timeout=section.call_timeout_seconds, **kwargs)
