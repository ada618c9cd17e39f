"""The Alibaba Cloud adapter: ECS GPU instance types, where each is sold and whether it
is in stock, spot and pay-as-you-go prices, spot release rates and vCPU quotas.

What one poll of a region asks, and how often (everything through `AlibabaSdk`, on the
adapter's own thread pool, so one slow API never blocks the event loop). First the SDK's
credential chain is asked, once (`AlibabaSdk.credentials`): without credentials the poll
fails with one `AuthFailed` and asks nothing else. The calls of the first group do not
depend on each other and run at once; the second group needs the first's answers (which
types the region sells) and runs after it:

1. * GPU instance types — `DescribeInstanceTypes` (`MinimumGPUAmount=1`, `NextToken`
     pages); every 6 h; required while there is no good copy, then the last good copy
     is kept when a refresh fails.
   * where each type is sold, and its stock — `DescribeAvailableResource`
     (`DestinationResource=InstanceType`, `InstanceChargeType=PostPaid`), once with
     `SpotStrategy=NoSpot` (pay-as-you-go pools) and once with `SpotAsPriceGo` (spot
     pools, with `SpotDuration`, below); every poll; required. `StatusCategory` →
     availability: `WithStock` 1.0, `ClosedWithStock` 0.3, `WithoutStock` and
     `ClosedWithoutStock` 0.0 (the pool is still listed: availability is a field, not a
     missing row).
   * quota headroom — `DescribeAccountAttributes` (`max-/used-postpaid-instance-vcpu-count`,
     `max-/used-spot-instance-vcpu-count`) → GPUs of each type that fit in the free
     vCPUs; every 10 min; optional: on failure the last good copy is kept (none yet:
     unknown, `None`).
2. * spot prices — `DescribeSpotPriceHistory` (VPC, Linux, `SpotDuration`: the
     configured `spot_duration`, hours of protection, 0 or 1, default 1 as Alibaba's;
     a spot price is per protection period; `Offset`/`NextOffset` pages),
     one call per instance type sold as spot (the API takes one type), the newest point
     per type and zone; every 5 min, asking only for what changed since the last read,
     and at once for a type the region starts selling; required per type (below).
   * pay-as-you-go prices — `DescribePrice` (`ResourceType=instance`, `PriceUnit=Hour`,
     Linux, VPC), one call per type sold pay-as-you-go, the `instanceType` line of the
     price (not the default system disk or bandwidth); every 6 h and at once for a new
     type; required per type (below).
   * spot release rates — `DescribeSpotAdvice` (10 types a call) → `interruption_rate`
     (the 30-day release share by the one interruption model, `adapters.hazard`); every
     6 h; optional: last good copy kept, none yet: unknown (`None`).

A steady-state poll is therefore two `DescribeAvailableResource` calls per region; every
5 minutes one `DescribeSpotPriceHistory` per spot type is added.

Faults. Every call is retried at the SDK seam (`AlibabaSdk`: throttles, 5xx, timeouts,
cut-off or garbled answers) within the poll's deadline; what still fails after that is
handled here, per part:

* a required part (instance types with no good copy, stock) that fails fails the poll;
* an optional part (quotas, release rates, an instance-type refresh) that fails keeps
  its last good copy, logged once when it starts failing and once when it recovers;
* prices are read per instance type, and each type's outcome stands alone. A type whose
  price refresh failed keeps its last good price (and that price's `observed_at`), and
  is asked again at the next poll. A type with no good price yet whose call failed
  (transiently: still throttled, down or garbled after the retries) is *missing*: the
  poll fails with a `CloudUnavailable` — or `RateLimited`, with the longest hint, when
  every failure was a throttle — that names the missing prices, so the poller marks the
  region unhealthy with that reason. Such a type is never offered without a price, nor
  silently left out; the prices that were read are kept, and the next poll asks only
  for the missing ones. A type Alibaba refuses to price for good (a permanent error
  about that type, e.g. `InvalidInstanceType.ValueNotSupported`: the contract's "listed
  without a price") is offered with `price_per_hour=None`, logged once. Credentials,
  permissions and configuration errors are not about one type: they fail the poll.

Currency: Alibaba prices in the currency of the account's site: CNY on the China site
(aliyun.com), USD on the international site. CNY prices are converted to USD at the
configured `usd_per_cny`; offers carry USD only (the `Offer` has no currency field), and
the adapter logs which currency each region answered in (once, and again if it
changes) and exposes it as `price_currency(region)`. A price in any other currency is
dropped (the offer is listed unpriced) rather than taken for USD.

A poll that fails raises a typed error: the poller marks the region unhealthy and its
offers age until stale (not placed on), which is not "no capacity", so an API that
blinks causes no failovers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Generic, TypeVar

import structlog

from adapters.alibaba import pricing
from adapters.alibaba.sdk import SPOT_ADVICE_TYPES, AlibabaSdk
from adapters.base import CloudAdapter, run_blocking
from adapters.common import Cached, gather_all, note_optional
from adapters.errors import (
    AdapterError,
    AuthFailed,
    CloudUnavailable,
    InvalidConfig,
    RateLimited,
    SdkMissing,
)
from broker.model import Market, Offer, PoolKey, utcnow

log = structlog.get_logger("gpubroker.alibaba")
T = TypeVar("T")
V = TypeVar("V")

_FATAL = (AuthFailed, InvalidConfig, SdkMissing)
"""Errors that are about the account or the configuration, not about one instance type:
a per-type part that meets one fails the poll with it."""
_NAMED = 4  # missing instance types named in an error, per part


@dataclass(frozen=True, slots=True)
class Refresh:
    """How old each cached answer may get, in seconds."""

    instance_types: float = 6 * 3600
    stock: float = 0  # every poll
    spot_prices: float = 300
    on_demand: float = 6 * 3600
    spot_advice: float = 6 * 3600
    quotas: float = 600
    spot_overlap: float = 60  # re-ask this much before the last read, for clock skew
    first_spot_window: float = 86400  # the API keeps 30 days; its default is 3 h


@dataclass(frozen=True, slots=True)
class _Type:
    name: str
    gpu: str
    gpus: int
    gpu_memory_gb: float | None
    known: bool
    vcpus: int | None
    memory_gb: float | None


@dataclass(frozen=True, slots=True)
class _Read(Generic[V]):
    """One answer about one instance type, and when it was read (wall and monotonic)."""

    value: V
    at: datetime
    mono: float


def _dict() -> Cached[dict[Any, Any]]:
    return Cached({})


@dataclass(slots=True)
class _RegionState:
    types: Cached[dict[str, _Type]] = field(default_factory=_dict)
    # (type, zone, market) -> availability: the pools the region sells
    stock: Cached[dict[tuple[str, str, Market], float | None]] = field(default_factory=_dict)
    # type -> the last good read of its spot price history (the prices are in `spot`)
    spot_read: Cached[dict[str, _Read[None]]] = field(default_factory=_dict)
    # (type, zone) -> (USD/hour or None, timestamp of that price point)
    spot: dict[tuple[str, str], tuple[float | None, datetime]] = field(default_factory=dict)
    on_demand: Cached[dict[str, _Read[float | None]]] = field(default_factory=_dict)
    # type -> zone -> interruptions per hour
    advice: Cached[dict[str, _Read[dict[str, float | None]]]] = field(default_factory=_dict)
    quotas: Cached[dict[str, float | None]] = field(default_factory=_dict)
    currency: str | None = None
    # (part, type) Alibaba refuses to price (listed unpriced; logged when it starts)
    refused: set[tuple[str, str]] = field(default_factory=set)


_PARTS = {"instance types": "types", "quotas": "quotas", "spot prices": "spot_read",
          "on-demand prices": "on_demand", "spot release rates": "advice"}
"""Each part of a poll that can fail on its own → the cached answer it refreshes."""

_Missing = tuple[str, str, AdapterError]  # (part, instance type, the last error)


class AlibabaAdapter(CloudAdapter):
    """`max_workers` bounds the adapter's own thread pool: the second group of a poll
    fans out one call per instance type and region, so it is larger than AWS's (64
    keeps a first poll of three regions at its critical path: bench/alibaba_poll.py).
    `call_timeout` is one API call's limit in seconds (`call_timeout_seconds`)."""

    name = "alibaba"

    # Many arguments: the adapter's settings, keyword-only, passed by name.
    def __init__(self, *, regions: Sequence[str], endpoint: str | None = None,  # noqa: PLR0913
                 anonymous: bool = False, usd_per_cny: float = 0.14,
                 refresh: Refresh | None = None, max_workers: int = 64,
                 call_timeout: float = 10.0, spot_duration: int = 1,
                 clock: Callable[[], datetime] = utcnow,
                 monotonic: Callable[[], float] = time.monotonic,
                 on_call: Callable[[str, str], None] | None = None) -> None:
        if not regions:
            raise InvalidConfig("clouds.alibaba.regions is empty: list the regions to poll",
                                cloud="alibaba")
        if not usd_per_cny > 0:
            raise InvalidConfig("clouds.alibaba.usd_per_cny must be positive", cloud="alibaba")
        self._regions = list(dict.fromkeys(regions))
        self._refresh = refresh or Refresh()
        self._usd_per_cny = usd_per_cny
        self._clock = clock
        self._mono = monotonic
        self.sdk = AlibabaSdk(endpoint=endpoint, anonymous=anonymous,
                              call_timeout=call_timeout, spot_duration=spot_duration,
                              on_call=on_call)
        self._executor = ThreadPoolExecutor(max_workers=max_workers,
                                            thread_name_prefix="alibaba")
        self._state = {r: _RegionState() for r in self._regions}

    def regions(self) -> Sequence[str]:
        return self._regions

    def price_currency(self, region: str) -> str | None:
        """The currency the region's last price answer was in (`CNY`, `USD`), before
        conversion to USD; None before the first one."""
        st = self._state.get(region)
        return st.currency if st else None

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await run_blocking(self._executor, fn, *args)

    # --- poll ----------------------------------------------------------------------

    async def poll(self, region: str) -> list[Offer]:
        st = self._state.get(region)
        if st is None:
            raise InvalidConfig(f"region {region!r} is not configured", cloud="alibaba",
                                region=region)
        now, mono = self._clock(), self._mono()
        rf = self._refresh
        # 0. Credentials: one clear AuthFailed, before any call, when there are none.
        await self._run(self.sdk.credentials)
        # 1. Independent questions, all at once.
        required: list[Awaitable[None]] = [self._stock(region, st, mono, now)]
        optional: list[tuple[str, Awaitable[None]]] = []
        if st.types.older_than(rf.instance_types, mono):
            types = self._types(region, st, mono, now)
            if st.types.read_at is None:
                required.insert(0, types)
            else:
                optional.append(("instance types", types))
        if st.quotas.older_than(rf.quotas, mono):
            optional.append(("quotas", self._quotas(region, st, mono, now)))
        await self._gather(region, required, optional)
        # 2. Prices and release rates of the GPU types the region sells, each type on
        # its own; prices still missing after the seam's retries fail the poll.
        spot_types = self._sold(st, Market.SPOT)
        od_types = self._sold(st, Market.ON_DEMAND)
        missing: list[_Missing] = []
        await gather_all([
            self._spot(region, st, _due(st.spot_read.value, spot_types, rf.spot_prices, mono),
                       mono, now, missing),
            self._on_demand(region, st, _due(st.on_demand.value, od_types, rf.on_demand,
                                              mono), mono, now, missing),
            self._advice(region, st, _due(st.advice.value, spot_types, rf.spot_advice, mono),
                         mono, now)])
        if missing:
            raise _missing_error(region, missing)
        return self._offers(region, st)

    async def _gather(self, region: str, required: Sequence[Awaitable[None]],
                      optional: Sequence[tuple[str, Awaitable[None]]]) -> None:
        """Run every part at once and wait for all of them (their SDK calls run on
        threads, which a cancellation would not stop); then note the optional parts'
        outcomes and raise the first required failure."""
        results = await asyncio.gather(*required, *(c for _, c in optional),
                                       return_exceptions=True)
        for (what, _), r in zip(optional, results[len(required):], strict=True):
            self._note_optional(region, what, r)
        for r in results[:len(required)]:
            if isinstance(r, BaseException):
                raise r

    def _note_optional(self, region: str, what: str, result: object) -> None:
        """An optional answer failed (`result` an AdapterError) or was read (anything
        else): keep the last good copy, log on change only."""
        note_optional(log, "alibaba", region, what,
                      getattr(self._state[region], _PARTS[what]), result)

    @staticmethod
    def _sold(st: _RegionState, market: Market) -> list[str]:
        """The GPU instance types the region sells in `market`."""
        return sorted({t for t, _, m in st.stock.value if m is market and t in st.types.value})

    async def _types(self, region: str, st: _RegionState, mono: float, now: datetime
                     ) -> None:
        infos = await self._run(self.sdk.gpu_instance_types, region)
        types = (_type_of(i) for i in infos if pricing.is_gpu(i) and i.get("InstanceTypeId"))
        st.types = Cached({t.name: t for t in types}, mono, now, st.types.failing)

    async def _stock(self, region: str, st: _RegionState, mono: float, now: datetime
                     ) -> None:
        od, spot = await gather_all([self._run(self.sdk.available_resources, region, False),
                                     self._run(self.sdk.available_resources, region, True)])
        pools: dict[tuple[str, str, Market], float | None] = {}
        for market, rows in ((Market.ON_DEMAND, od), (Market.SPOT, spot)):
            for zone, itype, status, category in rows:
                pools[(itype, zone, market)] = pricing.availability_of(status, category)
        st.stock = Cached(pools, mono, now)

    async def _quotas(self, region: str, st: _RegionState, mono: float, now: datetime
                      ) -> None:
        items = await self._run(self.sdk.account_attributes, region, pricing.QUOTA_ATTRIBUTES)
        st.quotas = Cached(pricing.attribute_values(items), mono, now, st.quotas.failing)

    # Many arguments: a per-type read's inputs and callbacks, each passed by name.
    async def _per_type(self, region: str, st: _RegionState, what: str,  # noqa: PLR0913
                        reads: Cached[dict[str, _Read[Any]]], wanted: Sequence[str],
                        fetch: Callable[[str], Awaitable[Any]],
                        store: Callable[[str, Any], None], refuse: Callable[[str], None],
                        missing: list[_Missing]) -> None:
        """Ask `fetch(type)` for every type in `wanted` at once and `store` each answer.
        A type whose call failed keeps its last good read in `reads` if it has one
        (logged once); one that Alibaba refuses for good is `refuse`d (listed
        unpriced, logged when it starts); any other is added to `missing`. An error
        about the account or the configuration (`_FATAL`) is raised."""
        results = await asyncio.gather(*(fetch(t) for t in wanted), return_exceptions=True)
        kept: AdapterError | None = None
        failed = False
        for itype, r in zip(wanted, results, strict=True):
            if not isinstance(r, BaseException):
                store(itype, r)
                st.refused.discard((what, itype))
                continue
            if not isinstance(r, AdapterError) or isinstance(r, _FATAL):
                raise r
            failed = True
            if not r.retryable:
                if (what, itype) not in st.refused:
                    st.refused.add((what, itype))
                    log.warning(f"alibaba will not give {what} of an instance type; listed "
                                "unpriced", region=region, instance_type=itype,
                                error=type(r).__name__, detail=str(r))
                refuse(itype)
            elif itype in reads.value:
                kept = kept or r
            else:
                missing.append((what, itype, r))
        if kept is not None:
            self._note_optional(region, what, kept)
        elif not failed and wanted:
            self._note_optional(region, what, None)

    async def _spot(self, region: str, st: _RegionState, wanted: Sequence[str],
                    mono: float, now: datetime, missing: list[_Missing]) -> None:
        rf = self._refresh

        async def fetch(itype: str) -> tuple[list[dict[str, Any]], str | None]:
            last = st.spot_read.value.get(itype)
            since = (now - timedelta(seconds=rf.first_spot_window) if last is None
                     else last.at - timedelta(seconds=rf.spot_overlap))
            return await self._run(self.sdk.spot_price_history, region, itype, since)

        def store(itype: str, answer: tuple[list[dict[str, Any]], str | None]) -> None:
            points, currency = answer
            self._note_currency(region, st, currency)
            for key, (price, ts) in pricing.newest_spot_prices(points).items():
                prev = st.spot.get(key)
                if prev is None or ts >= prev[1]:
                    st.spot[key] = (self._usd(price, currency), ts)
            st.spot_read.value[itype] = _Read(None, now, mono)

        def refuse(itype: str) -> None:
            for key in [k for k in st.spot if k[0] == itype]:
                del st.spot[key]
            st.spot_read.value[itype] = _Read(None, now, mono)

        await self._per_type(region, st, "spot prices", st.spot_read, wanted, fetch, store,
                             refuse, missing)

    async def _on_demand(self, region: str, st: _RegionState, wanted: Sequence[str],
                         mono: float, now: datetime, missing: list[_Missing]) -> None:
        async def fetch(itype: str) -> dict[str, Any]:
            return await self._run(self.sdk.price, region, itype)

        def store(itype: str, price: dict[str, Any]) -> None:
            amount, currency = pricing.instance_price(price)
            self._note_currency(region, st, currency)
            st.on_demand.value[itype] = _Read(self._usd(amount, currency), now, mono)

        def refuse(itype: str) -> None:
            st.on_demand.value[itype] = _Read(None, now, mono)

        await self._per_type(region, st, "on-demand prices", st.on_demand, wanted, fetch,
                             store, refuse, missing)

    async def _advice(self, region: str, st: _RegionState, wanted: Sequence[str],
                      mono: float, now: datetime) -> None:
        """Release rates, `SPOT_ADVICE_TYPES` types a call; optional, per call: the
        types of a call that failed keep their last good rates (none yet: unknown)."""
        chunks = [wanted[i:i + SPOT_ADVICE_TYPES]
                  for i in range(0, len(wanted), SPOT_ADVICE_TYPES)]
        results = await asyncio.gather(*(self._run(self.sdk.spot_advice, region, c)
                                         for c in chunks), return_exceptions=True)
        failure: AdapterError | None = None
        for chunk, r in zip(chunks, results, strict=True):
            if isinstance(r, AdapterError):
                failure = failure or r
                continue
            if isinstance(r, BaseException):
                raise r
            rates: dict[str, dict[str, float | None]] = {t: {} for t in chunk}
            for zone, itype, pct, band in r:
                rates.setdefault(itype, {})[zone] = pricing.interruption_rate(pct, band)
            for itype, zones in rates.items():
                st.advice.value[itype] = _Read(zones, now, mono)
        if chunks:
            self._note_optional(region, "spot release rates", failure)

    def _usd(self, amount: float | None, currency: str | None) -> float | None:
        return pricing.to_usd(amount, currency, self._usd_per_cny)

    def _note_currency(self, region: str, st: _RegionState, currency: str | None) -> None:
        """Log the currency a region prices in, once, and again when it changes."""
        if currency is None or currency == st.currency:
            return
        st.currency = currency
        if currency.upper() == "CNY":
            log.info("alibaba prices are in CNY, converted to USD", region=region,
                     usd_per_cny=self._usd_per_cny)
        elif currency.upper() == "USD":
            log.info("alibaba prices are in USD", region=region)
        else:
            log.warning("alibaba prices are in an unknown currency, listed unpriced",
                        region=region, currency=currency)

    def _offers(self, region: str, st: _RegionState) -> list[Offer]:
        out: list[Offer] = []
        attrs = st.quotas.value
        free = {Market.SPOT: pricing.free_vcpus(attrs, spot=True),
                Market.ON_DEMAND: pricing.free_vcpus(attrs, spot=False)}
        read_fallback = st.stock.read_at or self._clock()
        for (itype, zone, market), availability in sorted(st.stock.value.items()):
            t = st.types.value.get(itype)
            if t is None:
                continue  # not a GPU type
            interruption: float | None = None
            if market is Market.SPOT:
                price, _ = st.spot.get((itype, zone), (None, None))
                read = st.spot_read.value.get(itype)
                observed = read.at if read else read_fallback
                advice = st.advice.value.get(itype)
                interruption = advice.value.get(zone) if advice else None
            else:
                od = st.on_demand.value.get(itype)
                price, observed = (od.value, od.at) if od else (None, read_fallback)
            out.append(Offer(
                pool=PoolKey("alibaba", region, zone, itype, market),
                gpu=t.gpu, gpus=t.gpus, gpu_memory_gb=t.gpu_memory_gb, vcpus=t.vcpus,
                memory_gb=t.memory_gb, gpu_known=t.known, price_per_hour=price,
                observed_at=observed, availability=availability,
                interruption_rate=interruption,
                quota_headroom=pricing.headroom_gpus(free[market], t.vcpus, t.gpus),
                quota_group=f"alibaba:{region}:{market.value}", quota_units=t.vcpus))
        return out

    async def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.sdk.close()


def _due(reads: Mapping[str, _Read[Any]], offered: Sequence[str], max_age: float,
         mono: float) -> list[str]:
    """The offered types never read, or last read more than `max_age` seconds before
    monotonic time `mono` (a type whose refresh failed stays due)."""
    return [t for t in offered if (r := reads.get(t)) is None or mono - r.mono > max_age]


def _missing_error(region: str, missing: Sequence[_Missing]) -> AdapterError:
    """The error of a poll that could not read some prices and has no earlier copy of
    them: `RateLimited` (with the longest hint) when every failure was a throttle, else
    `CloudUnavailable`; its message names what is missing."""
    by_part: dict[str, list[str]] = {}
    for what, itype, _ in missing:
        by_part.setdefault(what, []).append(itype)

    def named(types: list[str]) -> str:
        types = sorted(types)
        more = f", +{len(types) - _NAMED} more" if len(types) > _NAMED else ""
        return f"{len(types)} type{'s' * (len(types) > 1)} ({', '.join(types[:_NAMED])}{more})"

    errors = [e for _, _, e in missing]
    msg = ("still failing after retries, with no earlier copy (not offered until read): "
           + "; ".join(f"{what} of {named(types)}" for what, types in by_part.items())
           + f"; first error: {errors[0]}")
    if all(isinstance(e, RateLimited) for e in errors):
        hints = [e.retry_after for e in errors if isinstance(e, RateLimited) and e.retry_after]
        return RateLimited(msg, retry_after=max(hints) if hints else None, cloud="alibaba",
                           region=region)
    return CloudUnavailable(msg, cloud="alibaba", region=region)


def _type_of(info: dict[str, Any]) -> _Type:
    gpu, gpus, mem, known = pricing.gpu_of(info)
    vcpus = info.get("CpuCoreCount")
    memory = info.get("MemorySize")
    return _Type(
        name=str(info["InstanceTypeId"]), gpu=gpu, gpus=gpus, gpu_memory_gb=mem, known=known,
        vcpus=None if vcpus is None else int(vcpus),
        memory_gb=None if memory is None else round(float(memory), 1))


def from_config(section: Any, **kwargs: Any) -> AlibabaAdapter:
    """Build the adapter from the daemon configuration's `clouds.alibaba` section."""
    return AlibabaAdapter(regions=section.regions, endpoint=section.endpoint,
                          anonymous=section.anonymous, usd_per_cny=section.usd_per_cny,
                          call_timeout=section.call_timeout_seconds,
                          spot_duration=section.spot_duration, **kwargs)
