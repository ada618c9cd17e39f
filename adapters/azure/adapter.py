"""The Azure adapter: GPU VM sizes, where they are offered and allowed, Spot and
pay-as-you-go prices, vCPU quota headroom and Spot eviction rates.

What one poll of a region asks, and how often (ARM calls through `AzureSdk` on the
adapter's own thread pool; the price API through aiohttp on the loop; all four at once,
so a poll takes as long as the slowest of them):

* GPU VM sizes, their zones and this subscription's restrictions — Resource SKUs
  (`resource_skus.list(filter="location eq '<region>'")`, paged by `nextLink`); every
  hour; required. A region for which ARM lists no SKU at all is not an Azure region
  (`InvalidConfig`).
* prices — the Retail Prices API, `Consumption` meters of `Standard_N*` sizes in the
  region (paged by `NextPageLink`); every hour; required until the first answer, then
  the last good copy is kept when a refresh fails.
* quota headroom — `usage.list(<region>)`: per-family vCPUs and `cores` for on-demand,
  `lowPriorityCores` for spot; every 10 min; optional (last good copy kept; without
  one, `quota_headroom` is None).
* Spot eviction rates — Resource Graph, `SpotResources`
  (`microsoft.compute/skuspotevictionrate/location`) for the region; every hour;
  optional (last good copy kept; `interruption_rate` None until one arrives).

* capacity reservations — `capacity_reservation_groups.list_by_subscription`, then for
  each group of the region its instance view (`get`, `$expand=instanceView`: each
  reservation's allocated VMs) and its reservations
  (`capacity_reservations.list_by_capacity_reservation_group`); every poll (their free
  counts are what placement needs); optional, and only with `reservations` on
  (`clouds.azure.reservations.enabled`). Each provisioned reservation of a GPU size is a
  target of the pool `(<region>-<zone>, size, reserved)` (a regional reservation: zone
  = the region): the target's id is the group's resource id — a VM is launched with its
  group, not the reservation — its size the reserved VMs (`currentCapacity`, else
  `sku.capacity`) and free those less the VMs allocated in it; two reservations of one
  group in one pool are one target. The offer has the size's GPU facts, `capacity` the
  targets' free VMs, `availability` 1.0 (capacity says what is free: availability 0
  would fail every lease on the pool over), `price_per_hour` the configured marginal
  price per GPU-hour × GPUs, no quota (the reservation holds its own). Block groups
  (capacity blocks), future reservations not live yet, sizes without whole GPUs and
  entries that do not read (a field missing, a count negative or above 100,000) are
  left out, each logged at debug level. A read that fails keeps the pools and targets
  of the last good read listed with nothing free: leases on them stay (a pool or a
  target missing from a poll would fail them over), new ones go elsewhere until a read
  succeeds; before any good read there are none. A denied permission is logged once per
  region, naming `Microsoft.Compute/capacityReservationGroups/read`.

Between refreshes a poll asks Azure nothing but the capacity reservations: Azure's other
answers change more slowly than the poll interval, and the cached ones are returned.

Faults. Every call is retried on its own at the SDK seam (`sdk.py`): a throttle (after
its `Retry-After`), a 5xx, a timeout (`call_timeout` seconds to connect or to wait for
the answer) and an answer cut off or garbled are retried with backoff within the poll's
deadline; credentials, permissions and configuration are not. A required answer still
missing after that fails the poll with a typed error naming it (`Resource SKUs: ...`,
`retail prices: ...`): the poller marks the region unhealthy with that reason and its
offers age until stale — which is not "no capacity", so an API that blinks causes no
failovers. So an offer's `price_per_hour` is None only where Azure lists a size without a
price, never because the price call failed; `quota_headroom` and `interruption_rate` are
None (unknown) while their optional answers have never arrived.

Azure gives no capacity signal for a pool (`availability` and `capacity` are None), and
no push channel the broker could read: Spot eviction notices (Scheduled Events) reach
only the VM itself, so `signals()` never yields. How names, prices, restrictions, quotas
and eviction bands are read: `pricing.py`.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

import structlog

from adapters.azure import pricing
from adapters.azure.sdk import CLOUD, AzureSdk, RetailPrices, check_region
from adapters.base import CloudAdapter, run_blocking
from adapters.common import (
    Cached,
    RetryPolicy,
    gather_all,
    note_optional,
    note_reservations_failed,
)
from adapters.errors import AdapterError, InvalidConfig
from broker.model import Market, Offer, PoolKey, Target, utcnow

log = structlog.get_logger("gpubroker.azure")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Refresh:
    """How old each cached answer may get, in seconds."""

    skus: float = 3600
    prices: float = 3600
    quotas: float = 600
    evictions: float = 3600
    reservations: float = 0.0  # capacity reservations: every poll (0)


@dataclass(slots=True)
class _RegionState:
    sizes: Cached[dict[str, pricing.VmSize]] = field(default_factory=lambda: Cached({}))
    prices: Cached[pricing.Prices] = field(
        default_factory=lambda: Cached(pricing.Prices({}, {})))
    quotas: Cached[dict[str, tuple[float, float]]] = field(
        default_factory=lambda: Cached({}))
    evictions: Cached[dict[str, float]] = field(default_factory=lambda: Cached({}))
    reserved: Cached[list[pricing.Reservation]] = field(default_factory=lambda: Cached([]))


class AzureAdapter(CloudAdapter):
    name = "azure"

    # Many arguments: the adapter's settings, keyword-only, passed by name.
    def __init__(self, *, subscription_id: str | None, regions: Sequence[str],  # noqa: PLR0913
                 endpoint: str | None = None, anonymous: bool = False,
                 refresh: Refresh | None = None, max_workers: int = 16,
                 attempts: int = RetryPolicy.ATTEMPTS,
                 max_backoff: float = RetryPolicy.MAX_BACKOFF, call_timeout: float = 10.0,
                 clock: Callable[[], datetime] = utcnow,
                 monotonic: Callable[[], float] = time.monotonic,
                 on_call: Callable[[str, str], None] | None = None,
                 reservations: bool = False,
                 reservation_price_per_gpu_hour: float = 0.0) -> None:
        """`reservations`: read the subscription's capacity reservations and offer them
        in the `reserved` market at `reservation_price_per_gpu_hour` (USD per GPU-hour at
        the margin; 0: already paid for). Off unless asked for; the configuration's
        default (`from_config`) is on."""
        self._reservations = reservations
        self._reserved_price = reservation_price_per_gpu_hour
        if not subscription_id or not subscription_id.strip():
            raise InvalidConfig("clouds.azure.subscription_id is missing: the Azure "
                                "subscription to poll (a GUID)", cloud=CLOUD)
        if not regions:
            raise InvalidConfig("clouds.azure.regions is empty: list the regions to poll",
                                cloud=CLOUD)
        # Azure takes region names in any case (`EastUS`); pools carry the lowercase
        # name, as ARM and the price API spell it.
        self._regions = [check_region(r) for r in dict.fromkeys(r.lower() for r in regions)]
        self._refresh = refresh or Refresh()
        self._clock = clock
        self._mono = monotonic
        self.sdk = AzureSdk(subscription_id=subscription_id.strip(), endpoint=endpoint,
                            anonymous=anonymous, attempts=attempts, max_backoff=max_backoff,
                            call_timeout=call_timeout, on_call=on_call)
        self.retail = RetailPrices(endpoint=endpoint, attempts=attempts,
                                   max_backoff=max_backoff, call_timeout=call_timeout,
                                   on_call=on_call)
        self._executor = ThreadPoolExecutor(max_workers=max_workers,
                                            thread_name_prefix="azure")
        self._state = {r: _RegionState() for r in self._regions}
        self._noted: set[tuple[str, str]] = set()  # (region, size) mismatches logged

    def regions(self) -> Sequence[str]:
        return self._regions

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await run_blocking(self._executor, fn, *args)

    # --- poll ----------------------------------------------------------------------

    async def poll(self, region: str) -> list[Offer]:
        st = self._state.get(region)
        if st is None:
            raise InvalidConfig(f"region {region!r} is not configured", cloud=CLOUD,
                                region=region)
        now, mono = self._clock(), self._mono()
        rf = self._refresh
        # Required answers: without them (and without an earlier copy) there is no
        # honest offer to make. Optional ones keep their last good copy.
        required: list[tuple[str, Coroutine[Any, Any, None]]] = []
        optional: list[tuple[str, str, Coroutine[Any, Any, None]]] = []
        if st.sizes.older_than(rf.skus, mono):
            required.append(("Resource SKUs", self._sizes(region, st, mono, now)))
        if st.prices.older_than(rf.prices, mono):
            if st.prices.read_at is None:
                required.append(("retail prices", self._prices(region, st, mono, now)))
            else:
                optional.append(("prices", "prices", self._prices(region, st, mono, now)))
        if st.quotas.older_than(rf.quotas, mono):
            optional.append(("quotas", "quotas", self._quotas(region, st, mono, now)))
        if st.evictions.older_than(rf.evictions, mono):
            optional.append(("spot eviction rates", "evictions",
                             self._evictions(region, st, mono, now)))
        # Never fails: `_reserved` notes its own failures (see the module doc).
        reserved = ([self._reserved(region, st, now)] if self._reservations and (
            rf.reservations <= 0 or st.reserved.older_than(rf.reservations, mono)) else [])
        results = await asyncio.gather(*(c for _, c in required),
                                       *(c for _, _, c in optional), *reserved,
                                       return_exceptions=True)
        for (what, _), r in zip(required, results, strict=False):
            if isinstance(r, AdapterError):
                raise _naming(what, r) from r
            if isinstance(r, BaseException):
                raise r
        for r in results[len(required) + len(optional):]:
            if isinstance(r, BaseException):
                raise r  # a bug: `_reserved` raises no AdapterError
        for (what, attr, _), r in zip(optional, results[len(required):][:len(optional)],
                                      strict=True):
            # An optional answer failed: keep the last good copy, log on change only.
            note_optional(log, CLOUD, region, what, getattr(st, attr), r)
        return self._offers(region, st, now)

    async def _sizes(self, region: str, st: _RegionState, mono: float, now: datetime
                     ) -> None:
        skus = await self._run(self.sdk.resource_skus, region)
        if not skus:
            raise InvalidConfig(f"ARM lists no Microsoft.Compute SKU in {region!r}: not an "
                                "Azure region, or not one this subscription may use",
                                cloud=CLOUD, region=region)
        sizes: dict[str, pricing.VmSize] = {}
        for sku in skus:
            size = pricing.vm_size(sku, region)
            if size is None:
                continue
            sizes[size.name] = size
            named = size.gpu.name_count
            if named is not None and named != size.gpu.count and \
                    (region, size.name) not in self._noted:
                self._noted.add((region, size.name))
                log.warning("azure GPUs capability differs from the size name; using "
                            "the capability", region=region, size=size.name,
                            capability=size.gpu.count, by_name=named)
        st.sizes = Cached(sizes, mono, now)

    async def _prices(self, region: str, st: _RegionState, mono: float, now: datetime
                      ) -> None:
        items = await self.retail.vm_prices(region)
        st.prices = Cached(pricing.prices_of(items, region, now), mono, now)

    async def _quotas(self, region: str, st: _RegionState, mono: float, now: datetime
                      ) -> None:
        usages = await self._run(self.sdk.usages, region)
        st.quotas = Cached(pricing.quotas_of(usages), mono, now)

    async def _evictions(self, region: str, st: _RegionState, mono: float, now: datetime
                         ) -> None:
        rows = await self._run(self.sdk.eviction_rates, region)
        st.evictions = Cached(pricing.evictions_of(rows, region), mono, now)

    async def _reserved(self, region: str, st: _RegionState, now: datetime) -> None:
        """Read the region's capacity reservations into `st.reserved`. A failure is
        noted (logged on change; a denied permission named) and leaves the last good
        copy, marked failing; it is not raised."""
        try:
            found = await self._read_reservations(region, now)
        except AdapterError as exc:
            note_reservations_failed(log, CLOUD, region, "capacity reservations",
                                     pricing.RESERVATIONS_PERMISSION, st.reserved, exc)
            return
        note_optional(log, CLOUD, region, "capacity reservations", st.reserved, found)
        st.reserved.value, st.reserved.at, st.reserved.read_at = found, self._mono(), now

    async def _read_reservations(self, region: str, now: datetime
                                 ) -> list[pricing.Reservation]:
        groups: dict[str, pricing.GroupRef] = {}
        for raw in await self._run(self.sdk.capacity_reservation_groups, region):
            try:
                ref = pricing.group_of(raw, region)
            except ValueError as exc:
                if isinstance(raw, dict) and str(raw.get("location", "")).lower() == region:
                    log.debug("azure capacity reservation group skipped", region=region,
                              group=raw.get("id"), reason=str(exc))
                continue
            groups.setdefault(ref.id.lower(), ref)

        async def one(ref: pricing.GroupRef) -> list[pricing.Reservation]:
            calls: list[Awaitable[Any]] = [
                self._run(self.sdk.capacity_reservation_group, region, ref.resource_group,
                          ref.name),
                self._run(self.sdk.capacity_reservations, region, ref.resource_group,
                          ref.name)]
            group: dict[str, Any] | None
            listed: list[dict[str, Any]] | None
            group, listed = await gather_all(calls)
            if group is None or listed is None:
                return []  # deleted since it was listed
            views = pricing.utilization_by_name(group)
            out: list[pricing.Reservation] = []
            for raw in listed:
                try:
                    out.append(pricing.reservation_of(raw, ref, region, views))
                except ValueError as exc:
                    log.debug("azure capacity reservation skipped", region=region,
                              group=ref.id, reason=str(exc),
                              reservation=raw.get("name") if isinstance(raw, dict) else None)
            return out

        found = await gather_all(one(ref) for ref in groups.values())
        return [r for part in found for r in part]

    def _reserved_offers(self, region: str, st: _RegionState, now: datetime) -> list[Offer]:
        """One `reserved` offer per (zone, GPU size) of the reservations read, a target per
        group; with nothing free while the last read failed."""
        failing = st.reserved.failing
        sizes = {name.lower(): size for name, size in st.sizes.value.items()}
        pools: dict[tuple[str, str], dict[str, list[int]]] = {}
        facts: dict[str, tuple[str, pricing.GpuSpec, int | None, float | None]] = {}
        for r in st.reserved.value:
            size = sizes.get(r.size.lower())
            if size is not None:
                facts[r.size.lower()] = (size.name, size.gpu, size.vcpus, size.memory_gb)
            else:
                # Not among the region's allowed GPU sizes: its GPUs from its name alone.
                gpu = pricing.gpu_of(r.size)
                if gpu is None:
                    log.debug("azure capacity reservation skipped", region=region,
                              group=r.group, reservation=r.name,
                              reason=f"{r.size} is not a size with whole GPUs")
                    continue
                facts[r.size.lower()] = (r.size, gpu, None, None)
            zone = pricing.zone_name(region, r.zone)
            target = pools.setdefault((zone, r.size.lower()), {}).setdefault(r.group, [0, 0])
            target[0] += r.instances
            target[1] += 0 if failing else r.free
        out: list[Offer] = []
        for (zone, key), targets in sorted(pools.items()):
            name, gpu, vcpus, memory = facts[key]
            out.append(Offer(
                pool=PoolKey(CLOUD, region, zone, name, Market.RESERVED), gpu=gpu.model,
                gpus=gpu.count, gpu_memory_gb=gpu.memory_gb, vcpus=vcpus, memory_gb=memory,
                gpu_known=gpu.known, price_per_hour=self._reserved_price * gpu.count,
                observed_at=st.reserved.read_at or now, availability=1.0,
                capacity=sum(free for _, free in targets.values()),
                targets=tuple(Target(gid, n, free)
                              for gid, (n, free) in sorted(targets.items()))))
        return out

    def _offers(self, region: str, st: _RegionState, now: datetime) -> list[Offer]:
        out: list[Offer] = []
        priced_at = st.prices.read_at or now
        prices, quotas = st.prices.value, st.quotas.value
        for name in sorted(st.sizes.value):
            size = st.sizes.value[name]
            key = name.lower()
            common: dict[str, Any] = dict(
                gpu=size.gpu.model, gpus=size.gpu.count, gpu_memory_gb=size.gpu.memory_gb,
                vcpus=size.vcpus, memory_gb=size.memory_gb, gpu_known=size.gpu.known,
                observed_at=priced_at)
            od_headroom = pricing.on_demand_headroom(quotas, size)
            spot_headroom = pricing.spot_headroom(quotas, size)
            for zone in size.zones or (None,):
                where = pricing.zone_name(region, zone)
                out.append(Offer(pool=PoolKey(CLOUD, region, where, name, Market.ON_DEMAND),
                                 price_per_hour=prices.on_demand.get(key),
                                 quota_headroom=od_headroom,
                                 quota_group=f"azure:{region}:{size.family.lower()}",
                                 quota_units=size.vcpus, **common))
                if size.spot:
                    out.append(Offer(pool=PoolKey(CLOUD, region, where, name, Market.SPOT),
                                     price_per_hour=prices.spot.get(key),
                                     interruption_rate=st.evictions.value.get(key),
                                     quota_headroom=spot_headroom,
                                     quota_group=f"azure:{region}:lowprioritycores",
                                     quota_units=size.vcpus, **common))
        if self._reservations:
            out.extend(self._reserved_offers(region, st, now))
        return out

    async def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        await self.retail.close()
        self.sdk.close()  # closes sockets and the credential: no network, no waiting


def _naming(what: str, err: AdapterError) -> AdapterError:
    """`err` (same type, cloud, region, `retry_after`) with a message that names the
    answer that is missing: the reason an unhealthy region shows."""
    named = copy.copy(err)
    named.args = (f"{what}: {err}",)
    return named


def from_config(section: Any, **kwargs: Any) -> AzureAdapter:
    """Build the adapter from the daemon configuration's `clouds.azure` section."""
    kwargs.setdefault("call_timeout", section.call_timeout_seconds)
    kwargs.setdefault("reservations", section.reservations.enabled)
    kwargs.setdefault("reservation_price_per_gpu_hour",
                      section.reservations.price_per_gpu_hour)
    return AzureAdapter(subscription_id=section.subscription_id, regions=section.regions,
                        endpoint=section.endpoint, anonymous=section.anonymous, **kwargs)
