"""The GCP adapter: GPU machine types and N1 + GPU shapes per zone, Spot and on-demand
prices from the Cloud Billing Catalog, GPU quotas, and stock-outs reported to it.

What one poll of a region asks, and how often (everything through `GcpSdk`, on the
adapter's own thread pool, so one slow API never blocks the event loop):

* the region — `RegionsClient.get`: its zones and its quotas (`NVIDIA_*_GPUS`,
  `PREEMPTIBLE_NVIDIA_*_GPUS`, limit and usage); every poll; required (it is also what
  tells a healthy region from a failing one).
* each zone's inventory — `MachineTypesClient.list` (filtered to the GPU series and the
  N1 machines of the N1 + GPU shapes, paged) and `AcceleratorTypesClient.list` (paged);
  every 6 h; required. Zones known from an earlier poll are refreshed alongside the
  region call.
* prices — `CloudCatalogClient.list_skus` for Compute Engine (`6F81-5844-456A`, paged);
  every 6 h; shared by all regions (one read at a time, on a task of its own that a
  poll's timeout does not cancel); required until the first read has succeeded, then
  kept: while a copy exists a poll never waits for a new read, and a failed refresh
  keeps the last good copy. A poll before any copy exists waits for the first read
  (`Refresh.first_catalog_wait`, default: as long as the poll may take) and, if the read
  failed or is still going, fails typed (the read's own error, or `CloudUnavailable`):
  a catalog that could not be read never yields offers without prices. Offers of a copy
  that has no SKU for some part of a VM (a Spot B200 where the catalog lists none) are
  listed with `price_per_hour=None`, as the contract says.
* the project's `GPUS_ALL_REGIONS` quota — `ProjectsClient.get`; at most every 30 s,
  shared by all regions; optional (a failed read keeps the last good copy; none yet:
  the regional quota alone, else `quota_headroom=None`).

* reservations — `ReservationsClient.aggregated_list` (one paged call for the project's
  zones, the region's kept); every poll (their free counts are what placement needs);
  optional, and only with `reservations` on (`clouds.gcp.reservations.enabled`). Each
  READY (or UPDATING: being resized) reservation of a GPU shape — a machine type with
  built-in GPUs the zone lists, or an N1 machine with one attachable GPU type, named
  `n1-highmem-8+nvidia-tesla-t4x1` as the N1 + GPU offers are — is a target of the pool
  `(zone, shape, reserved)`: its name, `specificReservation.count` and count −
  `inUseCount` free. The pool's offer has the GPU facts of that shape, `capacity` the
  targets' free VMs, `availability` 1.0 (capacity says what is free: availability 0 would
  fail every lease on the pool over), `price_per_hour` the configured marginal price per
  GPU-hour × GPUs, no quota (the reservation holds its own). Reservations made from an
  instance template, past their `deleteAtTime`, of machines without GPUs, and entries
  that do not read (a field missing, a count negative, above 100,000 or below what is in
  use) are left out, each logged at debug level. A read that fails keeps the pools and
  reservations of the last good read listed with nothing free: leases on them stay (a
  pool or a target missing from a poll would fail them over), new ones go elsewhere
  until a read succeeds; before any good read there are none. A denied permission is
  logged once per region, naming `compute.reservations.list`.

So the first poll of a region costs one region call, two paged lists per zone and (once
for all regions) the catalog pages and one project call; a steady-state poll costs one
`regions.get` per region and one `projects.get` per poll round.

**Prices and `observed_at`.** GCP's Spot prices change at most once a day and on-demand
prices rarely, and the catalog is the only place to read either: every offer's
`observed_at` is the time the catalog copy it was priced from was read (up to 6 h ago),
not the time of the poll.

**Capacity.** With `capacity_advice` on (the configuration's default), Compute Engine's
capacity advice (`AdviceClient.capacity`, `regions.advice.capacity`: `advice` has the
request, the answer and how it is read) is asked about every pool of the region — one
call per zone, shape and provisioning model (STANDARD for on-demand, SPOT for Spot),
at most `ADVICE_CONCURRENCY` at a time — every 30 min (`Refresh.advice`), on a task of
its own that no poll waits for (a poll lists what the last read said; the first poll of
a region lists none), within `Refresh.advice_budget` seconds, retried by `GcpSdk` like
every call. The first call of a read goes alone: when the project is refused (401/403:
no `compute.advice.capacity` permission), no other is made, the refusal is logged once
(naming the permission), every pool's advice is dropped and none is asked for again for
`Refresh.advice_denied` (6 h). A shape refused alone (a 400: a machine type the API does
not advise on) only leaves that pool without advice; the others are asked. A read that
fails for a while keeps the last answers, each for at most `Refresh.advice_max_age`.
`obtainability` is the offer's `availability`; on Spot offers `estimatedUptime` gives
`interruption_rate` (`adapters.hazard.hazard_from_uptime`: ln 2 / hours).

Stock-outs (`ZONE_RESOURCE_POOL_EXHAUSTED`, `ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS`)
are learnt as before, and are all there is without advice: the daemon reports them with
`note_stockout` / `note_launch_failure`, and a pool one was seen on lately has
availability 0, recovering over the next hour (`pricing.StockoutDecay`); with advice
too, the smaller of the two. Without either, `availability` is None.
`quota_headroom` is the smaller of the regional per-model and the project-wide GPU
headroom (`pricing.quota_headroom`).

**Faults.** Every call is made by `GcpSdk`, which retries throttles, 5xx, timeouts
(`call_timeout`, `clouds.gcp.call_timeout_seconds`) and garbled or cut-off answers
within the poll's deadline, page by page; the adapter does not retry again. Whatever is
required and still missing after that — the region, a zone's machine or accelerator
types, the first catalog read — fails the poll with a typed error: the poller marks the
region unhealthy with that reason and its offers age until stale — which is not "no
capacity", so an API that blinks causes no failovers. Only the optional answers
(project quotas, reservations, capacity advice, stock-outs) may be unknown in a poll
that succeeds.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Generic, TypeVar

import structlog

from adapters.base import CloudAdapter, run_blocking
from adapters.common import (
    Cached,
    RetryPolicy,
    gather_all,
    note_optional,
    note_reservations_failed,
    poll_deadline,
)
from adapters.errors import (
    AdapterError,
    AuthFailed,
    CloudUnavailable,
    InvalidConfig,
    RateLimited,
)
from adapters.gcp import advice, pricing
from adapters.gcp.pricing import PriceIndex, Shape, StockoutDecay
from adapters.gcp.sdk import GcpSdk, Quota, RegionInfo, is_stockout
from broker.model import Market, Offer, PoolKey, Target, utcnow

log = structlog.get_logger("gpubroker.gcp")
CLOSE_WAIT_SECONDS = 5.0
ALL_REGIONS = "*"  # the region named in logs about the answers all regions share
ADVICE_CONCURRENCY = 4  # capacity advice calls of one region at a time
ADVICE_RETRY_SECONDS = 300.0  # after a failed advice read, the next one at the earliest
T = TypeVar("T")
V = TypeVar("V")


@dataclass(frozen=True, slots=True)
class Refresh:
    """How old each cached answer may get, in seconds."""

    region: float = 0.0  # zones and regional quotas: every poll (0)
    project_quotas: float = 30.0  # GPUS_ALL_REGIONS: once per poll round
    inventory: float = 6 * 3600  # machine types and accelerator types, per zone
    catalog: float = 6 * 3600  # Billing Catalog SKUs
    reservations: float = 0.0  # the project's reservations: every poll (0)
    advice: float = 1800.0  # capacity advice, per region
    advice_max_age: float = 2 * 3600  # an advice answer is used at most this long
    advice_denied: float = 6 * 3600  # after a refusal, the next try (one call)
    advice_budget: float = 120.0  # how long one region's advice read may take
    # How long a poll waits for the very first catalog read (None: as long as the poll
    # may take; it fails when no copy exists at the end of the wait).
    first_catalog_wait: float | None = None


@dataclass(slots=True)
class _RegionState:
    info: Cached[RegionInfo | None] = field(default_factory=lambda: Cached(None))
    zones: dict[str, Cached[tuple[Shape, ...]]] = field(default_factory=dict)
    reserved: Cached[list[pricing.Reservation]] = field(default_factory=lambda: Cached([]))
    # pool -> (its advice, monotonic time it was answered)
    advice: Cached[dict[PoolKey, tuple[advice.Advice, float]]] = field(
        default_factory=lambda: Cached({}))
    advice_tried: float = -1e18  # monotonic time the last advice read started


class _Shared(Generic[V]):
    """An answer every region's poll shares (the catalog, the project's quotas): read by
    one task at a time, on a task of its own so that a poll that times out does not
    cancel it. A failed read keeps the last good copy and is logged once — unless the
    answer is `required` and there is no copy yet: then the polls fail with `error`, and
    the poller logs that."""

    def __init__(self, what: str, empty: V, mono: Callable[[], float],
                 clock: Callable[[], datetime], *, required: bool = False) -> None:
        self.what = what
        self.required = required
        self.cache: Cached[V] = Cached(empty)
        self.error: AdapterError | None = None  # why the last read failed (None: it did not)
        self._task: asyncio.Task[None] | None = None
        self._mono = mono
        self._clock = clock

    def start(self, fetch: Callable[[], Awaitable[V]], max_age: float
              ) -> asyncio.Task[None] | None:
        """Start a read if the copy is older than `max_age` and none is running; the read
        in flight, if any."""
        if self._task is None and self.cache.older_than(max_age, self._mono()):
            self._task = asyncio.create_task(self._read(fetch), name=f"gcp {self.what}")
        return self._task

    async def _read(self, fetch: Callable[[], Awaitable[V]]) -> None:
        try:
            value = await fetch()
        except AdapterError as exc:
            self.error = exc
            if not self.required or self.cache.read_at is not None:
                note_optional(log, "gcp", ALL_REGIONS, self.what, self.cache, exc)
        else:
            note_optional(log, "gcp", ALL_REGIONS, self.what, self.cache, value)
            self.cache = Cached(value, self._mono(), self._clock())
            self.error = None
        finally:
            self._task = None

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class GcpAdapter(CloudAdapter):
    name = "gcp"

    # Many arguments: the adapter's settings, keyword-only, passed by name.
    def __init__(self, *, regions: Sequence[str], project: str | None = None,  # noqa: PLR0913
                 endpoint: str | None = None, anonymous: bool = False,
                 refresh: Refresh | None = None, stockout: StockoutDecay | None = None,
                 max_workers: int | None = None, retry: RetryPolicy | None = None,
                 call_timeout: float = 10.0,
                 clock: Callable[[], datetime] = utcnow,
                 monotonic: Callable[[], float] = time.monotonic,
                 on_call: Callable[[str, str], None] | None = None,
                 reservations: bool = False,
                 reservation_price_per_gpu_hour: float = 0.0,
                 capacity_advice: bool = False) -> None:
        """`reservations`: read the project's reservations and offer them in the
        `reserved` market at `reservation_price_per_gpu_hour` (USD per GPU-hour at the
        margin; 0: already paid for). `capacity_advice`: read Compute Engine's capacity
        advice (see the module doc). Both off unless asked for; the configuration's
        default (`from_config`) is on."""
        if not regions:
            raise InvalidConfig("clouds.gcp.regions is empty: list the regions to poll",
                                cloud="gcp")
        self._reservations = reservations
        self._reserved_price = reservation_price_per_gpu_hour
        if anonymous and not project:
            raise InvalidConfig("clouds.gcp.project is required with anonymous: true (there "
                                "are no credentials to take a default project from)",
                                cloud="gcp")
        self._regions = list(dict.fromkeys(regions))
        self._refresh = refresh or Refresh()
        self._decay = stockout or StockoutDecay()
        self._clock = clock
        self._mono = monotonic
        self.sdk = GcpSdk(project=project, endpoint=endpoint, anonymous=anonymous,
                          retry=retry, call_timeout=call_timeout, on_call=on_call)
        # SDK calls wait on the network: a region's first poll runs two list calls per
        # zone at once (up to ~5 zones), beside the region call and the shared reads.
        workers = max_workers or min(96, 12 * len(self._regions) + 4)
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gcp")
        self._state = {r: _RegionState() for r in self._regions}
        self._catalog: _Shared[PriceIndex] = _Shared("prices", {}, monotonic, clock,
                                                     required=True)
        self._project: _Shared[dict[str, Quota]] = _Shared("project quotas", {}, monotonic,
                                                           clock)
        self._stockouts: dict[PoolKey, datetime] = {}
        self._advice_on = capacity_advice
        self._advice_tasks: dict[str, asyncio.Task[None]] = {}
        self._advice_denied: float | None = None  # monotonic time of the last refusal
        self._advice_denial_logged = False

    def regions(self) -> Sequence[str]:
        return self._regions

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await run_blocking(self._executor, fn, *args)

    # --- poll ----------------------------------------------------------------------

    async def poll(self, region: str) -> list[Offer]:
        st = self._state.get(region)
        if st is None:
            raise InvalidConfig(f"region {region!r} is not configured", cloud="gcp",
                                region=region)
        rf = self._refresh
        waits: list[asyncio.Future[None]] = []
        catalog = self._catalog.start(self._read_catalog, rf.catalog)
        if catalog is not None and self._catalog.cache.read_at is None:
            # no copy yet: the prices are required, wait for the first read
            waits.append(asyncio.ensure_future(self._first_prices(catalog, region)))
        project = self._project.start(self._read_project, rf.project_quotas)
        if project is not None:
            waits.append(asyncio.shield(project))
        calls = [self._inventory(region, st)]
        if self._reservations and (rf.reservations <= 0 or
                                   st.reserved.older_than(rf.reservations, self._mono())):
            calls.append(self._reserved(region, st))  # never fails: notes its failures
        try:
            await gather_all(calls)
            for wait in waits:
                await wait
        except BaseException:
            for wait in waits:  # the waits only: the shared reads go on for the next poll
                wait.cancel()
            raise
        self._start_advice(region, st, force=False)
        return self._offers(region, st, self._clock())

    async def _inventory(self, region: str, st: _RegionState) -> None:
        """The region's zones and quotas, and the inventory of each zone that is due."""
        rf, mono = self._refresh, self._mono()

        def due() -> list[str]:
            return [z for z, c in st.zones.items() if c.older_than(rf.inventory, mono)]

        known = due()
        calls = [self._zone(z, st) for z in known]
        if rf.region <= 0 or st.info.older_than(rf.region, mono):
            calls.insert(0, self._region(region, st))
        await gather_all(calls)
        await gather_all(self._zone(z, st) for z in due() if z not in known)

    async def _region(self, region: str, st: _RegionState) -> None:
        info = await self._run(self.sdk.region, region)
        st.info = Cached(info, self._mono(), self._clock())
        for zone in info.zones:
            st.zones.setdefault(zone, Cached(()))
        for zone in [z for z in st.zones if z not in info.zones]:
            del st.zones[zone]

    async def _zone(self, zone: str, st: _RegionState) -> None:
        calls: list[Awaitable[Any]] = [
            self._run(self.sdk.machine_types, zone, pricing.machine_type_filter()),
            self._run(self.sdk.accelerator_types, zone)]
        machines, accelerators = await gather_all(calls)
        if zone in st.zones:  # not dropped by a region answer meanwhile
            st.zones[zone] = Cached(tuple(pricing.shapes(machines, accelerators)),
                                     self._mono(), self._clock())

    async def _reserved(self, region: str, st: _RegionState) -> None:
        """Read the region's reservations into `st.reserved`. A failure is noted (logged
        on change; a denied permission named) and leaves the last good copy, marked
        failing; it is not raised."""
        try:
            raw = await self._run(self.sdk.reservations, region)
        except AdapterError as exc:
            note_reservations_failed(log, "gcp", region, "reservations",
                                     pricing.RESERVATIONS_PERMISSION, st.reserved, exc)
            return
        now = self._clock()
        kept: dict[tuple[str, str], pricing.Reservation] = {}
        for entry in raw:
            try:
                r = pricing.reservation_of(entry, region, now)
            except ValueError as exc:
                log.debug("gcp reservation skipped", region=region,
                          reservation=entry.get("name") if isinstance(entry, dict) else None,
                          reason=str(exc))
                continue
            kept.setdefault((r.zone, r.name), r)
        note_optional(log, "gcp", region, "reservations", st.reserved, kept)
        st.reserved.value = list(kept.values())
        st.reserved.at, st.reserved.read_at = self._mono(), now

    async def _first_prices(self, read: asyncio.Task[None], region: str) -> None:
        """Wait for the first catalog read (shielded: other polls share it); raise a typed
        error if there is still no copy after it, or after `first_catalog_wait`."""
        wait = self._refresh.first_catalog_wait
        try:
            async with asyncio.timeout(wait):
                await asyncio.shield(read)
        except TimeoutError:
            raise CloudUnavailable(f"no prices yet: the Billing Catalog's first read is "
                                   f"still going after {wait:g}s", cloud="gcp",
                                   region=region) from None
        if self._catalog.cache.read_at is None:
            err = self._catalog.error
            detail = f"{type(err).__name__}: {err}" if err is not None else "no answer"
            text = f"no prices yet: the Billing Catalog could not be read ({detail})"
            if isinstance(err, RateLimited):
                raise RateLimited(text, retry_after=err.retry_after, cloud="gcp",
                                  region=region)
            raise (type(err) if err is not None else CloudUnavailable)(
                text, cloud="gcp", region=region)

    async def _read_catalog(self) -> PriceIndex:
        skus = await self._run(self.sdk.skus)
        index = await self._run(pricing.index_skus, skus)
        if not index:
            # Every page came back, yet nothing prices a VM: not a catalog to keep.
            raise CloudUnavailable(f"the Billing Catalog listed {len(skus)} Compute Engine "
                                   f"SKUs and none prices a vCPU, RAM or GPU", cloud="gcp")
        return index

    async def _read_project(self) -> dict[str, Quota]:
        return await self._run(self.sdk.project_quotas)

    async def refresh_prices(self) -> None:
        """Read the Billing Catalog now, or wait for the read in flight. Never raises an
        AdapterError: a failed read keeps the last good copy (if any; `poll` says when
        there is none)."""
        task = self._catalog.start(self._read_catalog, 0.0)
        if task is not None:
            await asyncio.shield(task)

    def _offers(self, region: str, st: _RegionState, now: datetime) -> list[Offer]:
        index = self._catalog.cache.value
        observed = self._catalog.cache.read_at or now
        regional = st.info.value.quotas if st.info.value is not None else {}
        all_regions = self._project.cache.value.get(pricing.GLOBAL_GPU_QUOTA)
        self._forget_stockouts(now)
        out: list[Offer] = []
        for zone, cached in sorted(st.zones.items()):
            for shape in cached.value:
                gpu, memory, known = pricing.gpu_of(shape.accelerator)
                for market in pricing.markets(shape.machine_type, shape.gpus):
                    pool = PoolKey("gcp", region, zone, shape.instance_type, market)
                    advised = self._advised(st, pool)
                    out.append(Offer(
                        pool=pool, gpu=gpu, gpus=shape.gpus, gpu_memory_gb=memory,
                        vcpus=shape.vcpus, memory_gb=round(shape.memory_gib, 1),
                        price_per_hour=pricing.vm_price(index, region, market, shape),
                        observed_at=observed,
                        availability=self._availability(pool, now, advised),
                        interruption_rate=(advised.interruption_rate
                                           if advised is not None and market is Market.SPOT
                                           else None),
                        quota_headroom=pricing.quota_headroom(regional, all_regions,
                                                              shape.accelerator, market),
                        # GPU quotas are per accelerator and region, counted in GPUs.
                        quota_group=f"gcp:{region}:{shape.accelerator}:{market.value}",
                        quota_units=shape.gpus, gpu_known=known))
        if self._reservations:
            out.extend(self._reserved_offers(region, st, now))
        return out

    def _reserved_offers(self, region: str, st: _RegionState, now: datetime) -> list[Offer]:
        """One `reserved` offer per (zone, GPU shape) of the reservations read; with
        nothing free while the last read failed."""
        failing = st.reserved.failing
        pools: dict[tuple[str, pricing.ReservedShape], list[Target]] = defaultdict(list)
        for r in st.reserved.value:
            listed = st.zones.get(r.zone)
            try:
                shape = pricing.reserved_shape(r, listed.value if listed is not None else ())
            except ValueError as exc:
                log.debug("gcp reservation skipped", region=region, reservation=r.name,
                          reason=str(exc))
                continue
            pools[(r.zone, shape)].append(Target(r.name, r.count, 0 if failing else r.free))
        out: list[Offer] = []
        for (zone, shape), targets in sorted(pools.items(),
                                             key=lambda p: (p[0][0], p[0][1].instance_type)):
            gpu, memory, known = pricing.gpu_of(shape.accelerator)
            out.append(Offer(
                pool=PoolKey("gcp", region, zone, shape.instance_type, Market.RESERVED),
                gpu=gpu, gpus=shape.gpus, gpu_memory_gb=memory, vcpus=shape.vcpus,
                memory_gb=None if shape.memory_gib is None else round(shape.memory_gib, 1),
                price_per_hour=self._reserved_price * shape.gpus,
                observed_at=st.reserved.read_at or now, availability=1.0,
                capacity=sum(t.free for t in targets),
                targets=tuple(sorted(targets, key=lambda t: t.id)), gpu_known=known))
        return out

    # --- capacity advice -------------------------------------------------------------

    def _start_advice(self, region: str, st: _RegionState, *, force: bool
                      ) -> asyncio.Task[None] | None:
        """Start reading the region's capacity advice if it is on, due (or `force`d), not
        refused lately and not being read; the read in flight, if any."""
        running = self._advice_tasks.get(region)
        if running is not None or not self._advice_on:
            return running
        rf, mono = self._refresh, self._mono()
        if self._advice_denied is not None and mono - self._advice_denied < rf.advice_denied:
            return None
        if not force and (not st.advice.older_than(rf.advice, mono)
                          or mono - st.advice_tried < ADVICE_RETRY_SECONDS):
            return None
        st.advice_tried = mono
        task = asyncio.create_task(self._read_advice(region, st), name=f"gcp advice {region}")
        self._advice_tasks[region] = task
        task.add_done_callback(lambda _: self._advice_tasks.pop(region, None))
        return task

    async def refresh_advice(self, region: str) -> None:
        """Read the region's capacity advice now (unless it was refused lately), or wait
        for the read in flight. Never raises an AdapterError."""
        st = self._state.get(region)
        task = None if st is None else self._start_advice(region, st, force=True)
        if task is not None:
            await asyncio.shield(task)

    async def _read_advice(self, region: str, st: _RegionState) -> None:
        """Ask about every on-demand and Spot pool the region lists; the first call alone
        (a refusal stops the read there)."""
        shapes = {(zone, s.instance_type): s for zone, cached in st.zones.items()
                  for s in cached.value}
        pools = [(o.pool.zone, shapes[(o.pool.zone, o.pool.instance_type)], o.pool.market)
                 for o in self._offers(region, st, self._clock())
                 if o.pool.market in advice.MODELS
                 and (o.pool.zone, o.pool.instance_type) in shapes]
        if not pools:
            return
        with poll_deadline(self._refresh.advice_budget):
            try:
                first: advice.Advice | AdapterError | None = await self._advise(region,
                                                                                *pools[0])
            except AdapterError as exc:
                if exc.retryable or isinstance(exc, AuthFailed):
                    self._advice_failed(region, st, exc)
                    return
                first = exc  # this shape's own refusal (a 400 ...): the others are asked
            self._advice_allowed()
            gate = asyncio.Semaphore(ADVICE_CONCURRENCY)

            async def one(zone: str, shape: pricing.Shape, market: Market
                          ) -> advice.Advice | None:
                async with gate:
                    return await self._advise(region, zone, shape, market)

            rest = await asyncio.gather(*(one(*p) for p in pools[1:]),
                                        return_exceptions=True)
        now = self._mono()
        kept = dict(st.advice.value)
        errors: list[AdapterError] = []
        for (zone, shape, market), got in zip(pools, [first, *rest], strict=True):
            key = PoolKey("gcp", region, zone, shape.instance_type, market)
            if isinstance(got, AdapterError) and (got.retryable or isinstance(got, AuthFailed)):
                errors.append(got)
                continue
            if isinstance(got, AdapterError):  # refused for this shape alone: no advice
                log.debug("gcp capacity advice refused for a shape", region=region,
                          zone=zone, instance_type=shape.instance_type, market=market.value,
                          error=type(got).__name__, detail=str(got))
                got = None
            elif isinstance(got, BaseException):
                raise got
            if got is None:
                kept.pop(key, None)
            else:
                kept[key] = (got, now)
        st.advice.value = kept
        if errors:
            refused = [e for e in errors if isinstance(e, AuthFailed)]
            self._advice_failed(region, st, (refused or errors)[0])
        else:
            note_optional(log, "gcp", region, "capacity advice", st.advice, kept)
            st.advice.at, st.advice.read_at = now, self._clock()

    async def _advise(self, region: str, zone: str, shape: pricing.Shape, market: Market
                      ) -> advice.Advice | None:
        answer = await self._run(self.sdk.capacity_advice, region, zone,
                                 advice.request(zone, shape, market))
        try:
            return advice.parse(answer, market)
        except ValueError as exc:
            log.debug("gcp capacity advice skipped", region=region, zone=zone,
                      instance_type=shape.instance_type, market=market.value, reason=str(exc))
            return None

    def _advice_failed(self, region: str, st: _RegionState, exc: AdapterError) -> None:
        """A transient failure keeps the last answers (logged once); a refusal of the
        project (`AuthFailed`: 401, 403, no permission) drops every region's advice and is
        remembered for `Refresh.advice_denied`, logged once until advice works again. An
        error that will not heal for one shape alone (a 400 ...) is not a refusal: that
        pool has no advice, the others keep theirs (`_read_advice`)."""
        if not isinstance(exc, AuthFailed):
            note_optional(log, "gcp", region, "capacity advice", st.advice, exc)
            return
        self._advice_denied = self._mono()
        for state in self._state.values():
            state.advice.value = {}
        if not self._advice_denial_logged:
            self._advice_denial_logged = True
            log.warning("gcp capacity advice not available: availability from stock-outs "
                        "only", region=region, permission=advice.PERMISSION,
                        error=type(exc).__name__, detail=str(exc))

    def _advice_allowed(self) -> None:
        if self._advice_denied is not None:
            log.info("gcp capacity advice available again")
        self._advice_denied = None
        self._advice_denial_logged = False

    def _advised(self, st: _RegionState, pool: PoolKey) -> advice.Advice | None:
        found = st.advice.value.get(pool)
        if found is None or self._mono() - found[1] > self._refresh.advice_max_age:
            return None
        return found[0]

    # --- stock-outs ----------------------------------------------------------------------

    def note_stockout(self, pool: PoolKey, at: datetime | None = None) -> None:
        """Record that launching into `pool` failed for want of capacity at `at` (now if
        not given): its availability drops to 0 and recovers over `StockoutDecay`.

        GCP's polling APIs never report stock-outs; they surface only on a launch
        (`ZONE_RESOURCE_POOL_EXHAUSTED*`), so whoever sees one — the daemon, on a
        scheduler's `launch_failed` report — tells the adapter."""
        if pool.cloud != self.name or pool.region not in self._state:
            return
        at = at or self._clock()
        if pool not in self._stockouts or at > self._stockouts[pool]:
            self._stockouts[pool] = at
            log.info("gcp stock-out noted", pool=str(pool))

    def note_launch_failure(self, pool: PoolKey, detail: str,
                            at: datetime | None = None) -> bool:
        """`note_stockout` if `detail` (an error code or message) names a GCP stock-out;
        returns whether it did."""
        if not is_stockout(detail):
            return False
        self.note_stockout(pool, at)
        return True

    def _availability(self, pool: PoolKey, now: datetime,
                      advised: advice.Advice | None = None) -> float | None:
        """The smaller of what a recent stock-out and the capacity advice say; None if
        neither says anything."""
        at = self._stockouts.get(pool)
        learnt = None if at is None else self._decay.availability((now - at).total_seconds())
        told = None if advised is None else advised.obtainability
        known = [a for a in (learnt, told) if a is not None]
        return min(known) if known else None

    def _forget_stockouts(self, now: datetime) -> None:
        horizon = now - timedelta(seconds=self._decay.window)
        for pool in [p for p, at in self._stockouts.items() if at <= horizon]:
            del self._stockouts[pool]

    async def close(self) -> None:
        """Stop the shared reads and the SDK calls (no next page, no retry), wait a little
        for the calls on the wire to end, then close the clients."""
        self.sdk.stop()
        tasks = list(self._advice_tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._catalog.close()
        await self._project.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        try:
            async with asyncio.timeout(CLOSE_WAIT_SECONDS):
                await asyncio.to_thread(self._executor.shutdown, True)
        except TimeoutError:
            log.warning("gcp calls still running at close: their threads finish on their own")
        self.sdk.close()


def from_config(section: Any, **kwargs: Any) -> GcpAdapter:
    """Build the adapter from the daemon configuration's `clouds.gcp` section."""
    kwargs.setdefault("reservations", section.reservations.enabled)
    kwargs.setdefault("reservation_price_per_gpu_hour",
                      section.reservations.price_per_gpu_hour)
    kwargs.setdefault("capacity_advice", True)
    return GcpAdapter(regions=section.regions, project=section.project,
                      endpoint=section.endpoint, anonymous=section.anonymous,
                      call_timeout=section.call_timeout_seconds, **kwargs)
