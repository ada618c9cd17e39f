"""The Alibaba Cloud adapter: ECS GPU instance types, where each is sold and whether it
is in stock, spot and pay-as-you-go prices, spot release rates and vCPU quotas.

What one poll of a region asks, and how often (everything through `AlibabaSdk`, on the
adapter's own thread pool, so one slow API never blocks the event loop). The calls of
the first group do not depend on each other and run at once; the second group needs
the first's answers (which types the region sells) and runs after it:

1. * GPU instance types — `DescribeInstanceTypes` (`MinimumGPUAmount=1`, `NextToken`
     pages); every 6 h; required.
   * where each type is sold, and its stock — `DescribeAvailableResource`
     (`DestinationResource=InstanceType`, `InstanceChargeType=PostPaid`), once with
     `SpotStrategy=NoSpot` (pay-as-you-go pools) and once with `SpotAsPriceGo` (spot
     pools); every poll; required. `StatusCategory` → availability: `WithStock` 1.0,
     `ClosedWithStock` 0.3, `WithoutStock` and `ClosedWithoutStock` 0.0 (the pool is
     still listed: availability is a field, not a missing row).
   * quota headroom — `DescribeAccountAttributes` (`max-/used-postpaid-instance-vcpu-count`,
     `max-/used-spot-instance-vcpu-count`) → GPUs of each type that fit in the free
     vCPUs; every 10 min; on failure the last good copy is kept.
2. * spot prices — `DescribeSpotPriceHistory` (VPC, Linux; `Offset`/`NextOffset` pages),
     one call per instance type sold as spot (the API takes one type), the newest point
     per type and zone; every 5 min, asking only for what changed since the last read,
     and at once for a type the region starts selling; required.
   * pay-as-you-go prices — `DescribePrice` (`ResourceType=instance`, `PriceUnit=Hour`,
     Linux, VPC), one call per type sold pay-as-you-go, the `instanceType` line of the
     price (not the default system disk or bandwidth); every 6 h and at once for a new
     type; on failure the last good copy is kept.
   * spot release rates — `DescribeSpotAdvice` (10 types a call) → `interruption_rate`
     (see `pricing.RELEASE_HORIZON_HOURS` for the conversion); every 6 h; last good copy
     kept.

A steady-state poll is therefore two `DescribeAvailableResource` calls per region; every
5 minutes one `DescribeSpotPriceHistory` per spot type is added.

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
from collections.abc import Awaitable, Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Generic, TypeVar

import structlog

from adapters.alibaba import pricing
from adapters.alibaba.sdk import AlibabaSdk
from adapters.base import CloudAdapter, run_blocking
from adapters.common import Cached, gather_all, note_optional
from adapters.errors import InvalidConfig
from broker.model import Market, Offer, PoolKey, utcnow

log = structlog.get_logger("gpubroker.alibaba")
T = TypeVar("T")
V = TypeVar("V")


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
    """One answer about one instance type, and when it was read."""

    value: V
    at: datetime


def _dict() -> Cached[dict[Any, Any]]:
    return Cached({})


@dataclass(slots=True)
class _RegionState:
    types: Cached[dict[str, _Type]] = field(default_factory=_dict)
    # (type, zone, market) -> availability: the pools the region sells
    stock: Cached[dict[tuple[str, str, Market], float | None]] = field(default_factory=_dict)
    # type -> when its spot price history was last read
    spot_read: Cached[dict[str, datetime]] = field(default_factory=_dict)
    # (type, zone) -> (USD/hour or None, timestamp of that price point)
    spot: dict[tuple[str, str], tuple[float | None, datetime]] = field(default_factory=dict)
    on_demand: Cached[dict[str, _Read[float | None]]] = field(default_factory=_dict)
    # type -> zone -> interruptions per hour
    advice: Cached[dict[str, _Read[dict[str, float | None]]]] = field(default_factory=_dict)
    quotas: Cached[dict[str, float | None]] = field(default_factory=_dict)
    currency: str | None = None


_OPTIONAL = {"quotas": "quotas", "on-demand prices": "on_demand",
             "spot release rates": "advice"}


class AlibabaAdapter(CloudAdapter):
    """`max_workers` bounds the adapter's own thread pool: the second group of a poll
    fans out one call per instance type and region, so it is larger than AWS's (64
    keeps a first poll of three regions at its critical path: bench/alibaba_poll.py)."""

    name = "alibaba"

    def __init__(self, *, regions: Sequence[str], endpoint: str | None = None,
                 anonymous: bool = False, usd_per_cny: float = 0.14,
                 refresh: Refresh | None = None, max_workers: int = 64,
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
        self.sdk = AlibabaSdk(endpoint=endpoint, anonymous=anonymous, on_call=on_call)
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
        # 1. Independent questions, all at once.
        required: list[Awaitable[None]] = []
        if st.types.older_than(rf.instance_types, mono):
            required.append(self._types(region, st, mono, now))
        if st.stock.older_than(rf.stock, mono):
            required.append(self._stock(region, st, mono, now))
        optional: list[tuple[str, Awaitable[None]]] = []
        if st.quotas.older_than(rf.quotas, mono):
            optional.append(("quotas", self._quotas(region, st, mono, now)))
        await self._gather(region, required, optional)
        # 2. Prices and release rates of the GPU types the region sells.
        spot_types = self._sold(st, Market.SPOT)
        od_types = self._sold(st, Market.ON_DEMAND)
        optional = []
        od_due = st.on_demand.older_than(rf.on_demand, mono)
        if wanted := _wanted(st.on_demand.value, od_types, od_due):
            optional.append(("on-demand prices",
                             self._on_demand(region, st, wanted, od_due, mono, now)))
        advice_due = st.advice.older_than(rf.spot_advice, mono)
        if wanted := _wanted(st.advice.value, spot_types, advice_due):
            optional.append(("spot release rates",
                             self._advice(region, st, wanted, advice_due, mono, now)))
        await self._gather(region, [self._spot(region, st, spot_types, mono, now)], optional)
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
        """An optional answer failed: keep the last good copy, log on change only."""
        note_optional(log, "alibaba", region, what,
                      getattr(self._state[region], _OPTIONAL[what]), result)

    @staticmethod
    def _sold(st: _RegionState, market: Market) -> list[str]:
        """The GPU instance types the region sells in `market`."""
        return sorted({t for t, _, m in st.stock.value if m is market and t in st.types.value})

    async def _types(self, region: str, st: _RegionState, mono: float, now: datetime
                     ) -> None:
        infos = await self._run(self.sdk.gpu_instance_types, region)
        types = (_type_of(i) for i in infos if pricing.is_gpu(i) and i.get("InstanceTypeId"))
        st.types = Cached({t.name: t for t in types}, mono, now)

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

    async def _spot(self, region: str, st: _RegionState, spot_types: list[str],
                    mono: float, now: datetime) -> None:
        rf = self._refresh
        due = st.spot_read.older_than(rf.spot_prices, mono)
        wanted = _wanted(st.spot_read.value, spot_types, due)

        async def one(itype: str) -> tuple[str, list[dict[str, Any]], str | None]:
            last = st.spot_read.value.get(itype)
            since = (now - timedelta(seconds=rf.first_spot_window) if last is None
                     else last - timedelta(seconds=rf.spot_overlap))
            points, currency = await self._run(self.sdk.spot_price_history, region, itype,
                                               since)
            return itype, points, currency

        for itype, points, currency in await gather_all(one(t) for t in wanted):
            self._note_currency(region, st, currency)
            for key, (price, ts) in pricing.newest_spot_prices(points).items():
                prev = st.spot.get(key)
                if prev is None or ts >= prev[1]:
                    st.spot[key] = (self._usd(price, currency), ts)
            st.spot_read.value[itype] = now
        if due:
            st.spot_read.at, st.spot_read.read_at = mono, now

    async def _on_demand(self, region: str, st: _RegionState, wanted: list[str], due: bool,
                         mono: float, now: datetime) -> None:
        async def one(itype: str) -> tuple[str, _Read[float | None]]:
            amount, currency = pricing.instance_price(
                await self._run(self.sdk.price, region, itype))
            self._note_currency(region, st, currency)
            return itype, _Read(self._usd(amount, currency), now)

        prices = dict(await gather_all(one(t) for t in wanted))
        if due:
            st.on_demand = Cached(prices, mono, now, st.on_demand.failing)
        else:
            st.on_demand.value.update(prices)

    async def _advice(self, region: str, st: _RegionState, wanted: list[str], due: bool,
                      mono: float, now: datetime) -> None:
        rows = await self._run(self.sdk.spot_advice, region, wanted)
        rates: dict[str, dict[str, float | None]] = {t: {} for t in wanted}
        for zone, itype, pct, band in rows:
            rates.setdefault(itype, {})[zone] = pricing.interruption_rate(pct, band)
        reads = {t: _Read(z, now) for t, z in rates.items()}
        if due:
            st.advice = Cached(reads, mono, now, st.advice.failing)
        else:
            st.advice.value.update(reads)

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
                observed = st.spot_read.value.get(itype, read_fallback)
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


def _wanted(cached: Collection[str], offered: list[str], due: bool) -> list[str]:
    """Every offered type when the answer is due, else only those never asked about."""
    return list(offered) if due else [t for t in offered if t not in cached]


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
                          **kwargs)
