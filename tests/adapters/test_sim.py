"""Tests of the simulated market (`adapters/sim.py`)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from adapters.base import CloudAdapter
from adapters.errors import InvalidConfig
from adapters.gpus import MODELS
from adapters.hazard import WINDOW_HOURS, hazard_from_band, hazard_from_percent
from adapters.sim import CATALOG, SimAdapter
from broker.model import CapacitySignal, Market, Offer, PoolKey, SignalKind

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


class FakeClock:
    """A clock that advances one second per reading, the same in every run."""

    def __init__(self) -> None:
        self._ticks: Iterator[int] = iter(range(10**9))

    def __call__(self) -> datetime:
        return T0 + timedelta(seconds=next(self._ticks))


def fixed_clock() -> datetime:
    return T0


def sim(**kwargs: object) -> SimAdapter:
    kwargs.setdefault("clock", fixed_clock)
    return SimAdapter(**kwargs)  # type: ignore[arg-type]


async def poll_all(adapter: SimAdapter) -> list[Offer]:
    return [o for region in adapter.regions() for o in await adapter.poll(region)]


def by_key(offers: list[Offer]) -> dict[PoolKey, Offer]:
    return {o.pool: o for o in offers}


def first_spot(offers: list[Offer]) -> Offer:
    return next(o for o in offers if o.pool.market is Market.SPOT and o.price_per_hour)


# --- shape -------------------------------------------------------------------------------


def test_is_a_cloud_adapter_named_sim() -> None:
    adapter = sim()
    assert isinstance(adapter, CloudAdapter)
    assert adapter.name == "sim"


def test_region_ids_are_cloud_and_region() -> None:
    adapter = sim()
    assert list(adapter.regions()) == [
        "aws:us-east-1", "aws:us-west-2", "aws:eu-west-1",
        "gcp:us-central1", "gcp:europe-west4", "gcp:asia-east1",
        "azure:eastus", "azure:westus2", "azure:westeurope",
        "alibaba:cn-hangzhou", "alibaba:cn-beijing", "alibaba:ap-southeast-1",
    ]


def test_many_regions_are_synthesized_and_unique() -> None:
    adapter = sim(clouds=["aws", "azure"], regions_per_cloud=40)
    ids = list(adapter.regions())
    assert len(ids) == len(set(ids)) == 80
    assert "aws:us-east-1" in ids and "aws:sim-aws-r040" in ids
    assert "azure:sim-azure-r040" in ids


async def test_offers_carry_plain_cloud_region_and_cloud_style_zones() -> None:
    adapter = sim(zones_per_region=2)
    for region_id in adapter.regions():
        cloud, region = region_id.split(":")
        offers = await adapter.poll(region_id)
        assert offers
        for o in offers:
            assert (o.pool.cloud, o.pool.region) == (cloud, region)
            assert o.pool.zone.startswith(region)
    zones = {o.pool.zone for o in await poll_all(adapter)}
    assert {"us-east-1a", "us-central1-b", "eastus-1", "cn-hangzhou-h"} <= zones


async def test_one_offer_per_zone_type_and_market_and_a_subset_of_the_catalog() -> None:
    adapter = sim(regions_per_cloud=10)
    offers = await poll_all(adapter)
    keys = [o.pool for o in offers]
    assert len(keys) == len(set(keys))
    # every offered (zone, type) has both markets
    od = {(k.zone, k.instance_type) for k in keys if k.market is Market.ON_DEMAND}
    spot = {(k.zone, k.instance_type) for k in keys if k.market is Market.SPOT}
    assert od == spot
    # not every type in every zone, but most
    full = sum(10 * 3 * sum(1 for t in CATALOG if t.cloud == c)
               for c in ("aws", "gcp", "azure", "alibaba"))
    assert 0.7 * full < len(od) < 0.95 * full
    assert adapter.offer_count() == len(offers)


async def test_unknown_region_raises_invalid_config() -> None:
    with pytest.raises(InvalidConfig, match="us-east-1"):
        await sim().poll("us-east-1")


# --- determinism -------------------------------------------------------------------------


async def test_same_seed_same_polls_equal_offers() -> None:
    a, b = sim(seed=11), sim(seed=11)
    for _ in range(5):
        assert await poll_all(a) == await poll_all(b)


async def test_the_markets_course_for_a_seed_is_pinned() -> None:
    """The benchmarks' and backtests' figures rest on the market a seed gives: a change
    of the sim's draws, their order, or what it reports of them changes this digest of
    12 polls of two regions per cloud (offers and hidden true hazards; floats to 9
    significant digits, so that a C library's last bit does not count). Change it
    only with a change of the market that is meant, and say so."""
    import hashlib

    def g(x: float | None) -> str | None:
        return None if x is None else f"{x:.9g}"

    s = sim(seed=7, regions_per_cloud=2)
    digest = hashlib.sha256()
    for _ in range(12):
        for r in s.regions():
            for o in await s.poll(r):
                digest.update(repr((str(o.pool), o.gpu, o.gpus, g(o.price_per_hour),
                                    g(o.availability), o.capacity, g(o.interruption_rate),
                                    o.quota_headroom)).encode())
            for key, rate in s.true_rates(r):
                digest.update(f"{key}{rate:.9g}".encode())
    assert digest.hexdigest()[:16] == "9f7d7757e00a7fae"


async def test_polling_order_does_not_matter() -> None:
    a, b = sim(), sim()
    forward = {r: [await a.poll(r) for _ in range(4)] for r in a.regions()}
    backward: dict[str, list[list[Offer]]] = {r: [] for r in b.regions()}
    for _ in range(4):  # interleaved, in reverse order
        for r in reversed(b.regions()):
            backward[r].append(await b.poll(r))
    assert forward == backward


async def test_region_state_depends_only_on_its_own_polls() -> None:
    a, b = sim(), sim()
    for _ in range(7):  # a's other regions get ahead; that changes nothing in aws:us-east-1
        await a.poll("gcp:us-central1")
    assert await a.poll("aws:us-east-1") == await b.poll("aws:us-east-1")


async def test_different_seed_different_market() -> None:
    assert await poll_all(sim(seed=1)) != await poll_all(sim(seed=2))


async def test_observed_at_comes_from_the_clock() -> None:
    adapter = SimAdapter(clock=FakeClock())
    first = await adapter.poll("aws:us-east-1")
    second = await adapter.poll("aws:us-east-1")
    assert {o.observed_at for o in first} == {T0}
    assert {o.observed_at for o in second} == {T0 + timedelta(seconds=1)}


# --- values ------------------------------------------------------------------------------


async def test_fields_in_range_over_many_polls() -> None:
    # Spot signals are each cloud's: sometimes missing (None), GCP's always (see
    # test_spot_signals_are_shaped_like_each_clouds); on-demand pools report as before.
    adapter = sim(regions_per_cloud=4)
    seen_zero_capacity = seen_outage = seen_missing = False
    for _ in range(60):
        for o in await poll_all(adapter):
            assert o.gpus >= 1 and o.vcpus and o.vcpus > 0
            assert o.memory_gb and o.memory_gb > 0
            assert o.gpu_memory_gb and o.gpu_memory_gb > 0
            assert o.availability is None or 0.0 <= o.availability <= 1.0
            assert o.capacity is not None and o.capacity >= 0
            assert isinstance(o.capacity, int) and isinstance(o.quota_headroom, int)
            assert o.quota_headroom >= 0
            if o.price_per_hour is not None:
                assert o.price_per_hour > 0
            if o.pool.market is Market.ON_DEMAND:
                assert o.price_per_hour is not None
                assert o.interruption_rate is None
                assert o.availability is not None and o.availability >= 0.9
            else:
                if o.interruption_rate is not None:  # Azure's 20+ over 0.92 h: 0.3125;
                    # GCP's uptime to 2 digits may read a little under the lowest 0.01
                    assert 0.0095 <= o.interruption_rate <= 0.32
                seen_missing |= o.interruption_rate is None or o.availability is None
                seen_zero_capacity |= o.capacity == 0
                seen_outage |= o.availability == 0.0
    assert seen_zero_capacity and seen_outage and seen_missing


async def test_spot_is_cheaper_than_on_demand_on_average() -> None:
    offers = by_key(await poll_all(sim(regions_per_cloud=5)))
    ratios = []
    for key, o in offers.items():
        if key.market is Market.SPOT and o.price_per_hour is not None:
            od = offers[PoolKey(key.cloud, key.region, key.zone, key.instance_type,
                                Market.ON_DEMAND)]
            assert od.price_per_hour is not None
            ratios.append(o.price_per_hour / od.price_per_hour)
    assert sum(ratios) / len(ratios) < 0.7
    assert max(ratios) < 1.0


async def test_interruption_rate_rises_as_availability_falls() -> None:
    spot = [o for o in await poll_all(sim(regions_per_cloud=5, clouds=["aws"]))
            if o.pool.market is Market.SPOT and o.availability]
    low = [o.interruption_rate or 0 for o in spot if o.availability is not None
           and o.availability < 0.4]
    high = [o.interruption_rate or 0 for o in spot if o.availability is not None
            and o.availability > 0.8]
    assert low and high
    assert sum(low) / len(low) > sum(high) / len(high)


async def test_spot_signals_are_shaped_like_each_clouds() -> None:
    adapter = sim(regions_per_cloud=3)
    rates: dict[str, set[float | None]] = {c: set() for c in ("aws", "gcp", "azure",
                                                              "alibaba")}
    avails: dict[str, set[float | None]] = {c: set() for c in rates}
    for _ in range(40):
        for o in await poll_all(adapter):
            if o.pool.market is Market.SPOT:
                rates[o.pool.cloud].add(o.interruption_rate)
                avails[o.pool.cloud].add(o.availability)
    # GCP: the capacity advice's obtainability to two decimals, and the hazard read
    # from an estimated uptime (the time half of the Spot VMs outlive) given to 2
    # significant digits of real time (a real month an hour here)
    gcp = rates["gcp"] - {None}
    assert len(gcp) > 20
    for rate in gcp:
        assert rate is not None
        real_hours = math.log(2) / rate * 730
        assert real_hours == pytest.approx(float(f"{real_hours:.2g}"), rel=1e-3)
    assert all(a is None or round(a, 2) == a for a in avails["gcp"])
    assert len(avails["gcp"] - {None}) > 20
    # AWS: advisor bands at their midpoints over 730 h (an hour here), placement scores
    # 1-10 in tenths
    aws = {0.02532, 0.07796, 0.1335, 0.1924, 0.2877}
    assert rates["aws"] - {None} <= aws and len(rates["aws"] - {None}) >= 3
    assert {hazard_from_band(b, WINDOW_HOURS["aws"] / 730)
            for b in ("<5%", "5-10%", "10-15%", "15-20%", ">20%")} == aws
    assert avails["aws"] - {None} <= {n / 10 for n in range(1, 11)}
    # Azure: five eviction bands over 28 days (0.92 h here); a three-level score
    azure = {hazard_from_band(b, WINDOW_HOURS["azure"] / 730)
             for b in ("0-5", "5-10", "10-15", "15-20", "20+")}
    assert rates["azure"] - {None} <= azure and len(rates["azure"] - {None}) >= 3
    assert avails["azure"] - {None} <= {0.1, 0.5, 0.9}
    # Alibaba: the release rate in % to 0.1 over 30 days (0.99 h here); stock categories
    window = WINDOW_HOURS["alibaba"] / 730
    shown = rates["alibaba"] - {None}
    assert len(shown) > 20
    for rate in shown:
        assert rate is not None
        pct = round(-math.expm1(-rate * window) * 100, 1)
        assert hazard_from_percent(pct, window) == rate
    assert avails["alibaba"] - {None} <= {0.0, 0.3, 1.0}
    # and each signal is now and then missing
    for cloud in ("aws", "gcp", "azure", "alibaba"):
        assert None in rates[cloud] and None in avails[cloud]


async def test_the_true_hazard_is_hidden_behind_the_signal() -> None:
    adapter = sim(regions_per_cloud=3, clouds=["aws", "azure"])
    pairs: list[tuple[float, float]] = []
    lagged = 0
    previous: dict[PoolKey, float] = {}
    for _ in range(30):
        for region in adapter.regions():
            for o in await adapter.poll(region):
                if o.pool.market is not Market.SPOT:
                    continue
                true = adapter.true_interruption_rate(o.pool)
                assert true is not None
                if o.interruption_rate is not None:
                    pairs.append((o.interruption_rate, true))
                if o.pool in previous and previous[o.pool] != true:
                    lagged += 1
                previous[o.pool] = true
    # the hidden hazard moves every poll; the report is one of a few bands (5 a cloud)
    assert lagged > len(previous) * 20
    assert len({r for r, _ in pairs}) <= 10 < len({t for _, t in pairs})
    # the report is not a function of the truth: pools in one band differ widely, and
    # the truth is often in another band than the one reported
    one_band = [t for r, t in pairs if r == 0.02532]
    assert max(one_band) > 5 * min(one_band)
    off = sum(abs(r - t) > 0.05 for r, t in pairs)
    assert off > 0.2 * len(pairs)
    od = next(o.pool for o in await adapter.poll("aws:us-east-1")
              if o.pool.market is Market.ON_DEMAND)
    assert adapter.true_interruption_rate(od) is None


async def test_equal_true_hazards_score_alike_on_every_cloud() -> None:
    # Each cloud publishes its own language (AWS and Azure bands over 730 h and 28 days,
    # Alibaba a release rate over 30 days, GCP an estimated uptime) and the offers carry
    # what the one interruption
    # model reads from it: a pool's scored hazard over its true one is the same on every
    # cloud within a factor of 1.5, pool by pool (true hazards in narrow bins) and
    # overall; a cloud read over the wrong window (a day, an hour) is far off.
    clouds = ("aws", "gcp", "azure", "alibaba")
    adapter = sim(regions_per_cloud=4, clouds=list(clouds))
    pairs: dict[str, list[tuple[float, float]]] = {c: [] for c in clouds}
    for _ in range(25):
        for region in adapter.regions():
            for o in await adapter.poll(region):
                true = adapter.true_interruption_rate(o.pool)
                if true is not None and o.interruption_rate is not None:
                    pairs[o.pool.cloud].append((true, o.interruption_rate))
    overall = {c: sum(s for _, s in p) / sum(t for t, _ in p) for c, p in pairs.items()}
    assert max(overall.values()) < 1.5 * min(overall.values()), overall
    bins = [(0.01, 0.02), (0.02, 0.04), (0.04, 0.08), (0.08, 0.16), (0.16, 0.32)]
    compared = 0
    for lo, hi in bins:
        means = {}
        for cloud, p in pairs.items():
            scored = [s for t, s in p if lo <= t < hi]
            if len(scored) >= 200:
                means[cloud] = sum(scored) / len(scored)
        if len(means) == len(clouds):
            compared += 1
            assert max(means.values()) < 1.5 * min(means.values()), (lo, hi, means)
    assert compared >= 3


async def test_list_prices_come_from_the_catalog_in_the_first_region() -> None:
    offers = by_key(await sim().poll("aws:us-east-1"))
    p5 = next(o for k, o in offers.items()
              if k.instance_type == "p5.48xlarge" and k.market is Market.ON_DEMAND)
    assert p5.price_per_hour == 98.32
    assert (p5.gpu, p5.gpus, p5.gpu_memory_gb) == ("H100-80GB", 8, 80)


async def test_regions_differ_in_price() -> None:
    adapter = sim(clouds=["aws"], regions_per_cloud=6)
    prices = {o.pool.region: o.price_per_hour for o in await poll_all(adapter)
              if o.pool.instance_type == "g5.xlarge" and o.pool.market is Market.ON_DEMAND}
    assert len(set(prices.values())) > 1


async def test_gpus_are_canonical_except_the_deliberate_unknown_one() -> None:
    offers = await poll_all(sim(regions_per_cloud=5))
    unknown = {o.gpu for o in offers if not o.gpu_known}
    assert unknown == {"PPU"}
    assert all(o.gpu in MODELS for o in offers if o.gpu_known)
    h20 = next(o for o in offers if not o.gpu_known)
    assert h20.pool.cloud == "alibaba" and h20.gpu_memory_gb == 96


async def test_some_spot_pools_have_no_price_but_few() -> None:
    offers = await poll_all(sim(regions_per_cloud=10))
    unpriced = [o for o in offers if o.price_per_hour is None]
    assert unpriced
    assert all(o.pool.market is Market.SPOT for o in unpriced)
    assert len(unpriced) < 0.02 * len(offers)


# --- control methods ---------------------------------------------------------------------


async def test_withdraw_removes_a_pool_until_restore() -> None:
    adapter, twin = sim(), sim()
    region = "aws:us-east-1"
    pool = first_spot(await adapter.poll(region)).pool
    await twin.poll(region)
    adapter.withdraw(pool)
    assert pool not in by_key(await adapter.poll(region))
    assert pool in by_key(await twin.poll(region))
    assert adapter.offer_count() == twin.offer_count() - 1
    adapter.restore(pool)
    # back, on the same seeded course as a market that never lost it
    assert await adapter.poll(region) == await twin.poll(region)


async def test_set_spot_price_pins_until_unpin() -> None:
    adapter, twin = sim(), sim()
    region = "gcp:us-central1"
    pool = first_spot(await adapter.poll(region)).pool
    await twin.poll(region)
    adapter.set_spot_price(pool, 123.45)
    for _ in range(3):
        assert by_key(await adapter.poll(region))[pool].price_per_hour == 123.45
        await twin.poll(region)
    adapter.unpin(pool)
    assert await adapter.poll(region) == await twin.poll(region)


def test_control_methods_reject_pools_the_sim_does_not_offer() -> None:
    adapter = sim()
    foreign = PoolKey("aws", "us-east-1", "us-east-1a", "x9.huge", Market.SPOT)
    elsewhere = PoolKey("oracle", "us-ashburn-1", "ad-1", "BM.GPU4.8", Market.SPOT)
    for bad in (foreign, elsewhere):
        with pytest.raises(ValueError, match="no pool"):
            adapter.withdraw(bad)
        with pytest.raises(ValueError, match="no pool"):
            adapter.interrupt(bad)
        with pytest.raises(ValueError, match="no pool"):
            adapter.set_spot_price(bad, 1.0)


async def test_set_spot_price_needs_a_spot_pool_and_a_positive_price() -> None:
    adapter = sim()
    offers = await adapter.poll("aws:us-east-1")
    od = next(o.pool for o in offers if o.pool.market is Market.ON_DEMAND)
    with pytest.raises(ValueError, match="spot pool"):
        adapter.set_spot_price(od, 1.0)
    with pytest.raises(ValueError, match="price_per_hour"):
        adapter.set_spot_price(first_spot(offers).pool, 0.0)


# --- signals -----------------------------------------------------------------------------


async def test_interrupt_is_yielded_at_once() -> None:
    adapter = sim(signal_interval_seconds=3600.0)  # no tick during the test
    pool = first_spot(await adapter.poll("azure:eastus")).pool
    async with contextlib.aclosing(adapter.signals(lambda: [pool])) as signals:
        adapter.interrupt(pool, "test says so")
        async with asyncio.timeout(2):
            signal = await anext(signals)
        assert signal == CapacitySignal(pool, SignalKind.INTERRUPTED, T0, "test says so")
        # and while the consumer is already waiting
        waiter = asyncio.ensure_future(anext(signals))
        await asyncio.sleep(0)
        adapter.interrupt(pool)
        async with asyncio.timeout(2):
            second = await waiter
        assert second.pool == pool and second.kind is SignalKind.INTERRUPTED


async def test_interrupted_pool_becomes_scarce_for_a_few_polls() -> None:
    adapter, twin = sim(), sim()
    region = "aws:us-west-2"
    pool = first_spot(await adapter.poll(region)).pool
    await twin.poll(region)
    adapter.interrupt(pool)
    after = by_key(await adapter.poll(region))[pool]
    await twin.poll(region)
    assert after.capacity == 0
    assert after.availability is not None and after.availability <= 0.1
    for _ in range(10):
        await adapter.poll(region)
        await twin.poll(region)
    # then back on the seeded course, as if nothing had happened
    assert await adapter.poll(region) == await twin.poll(region)


async def test_preemption_hits_leased_spot_pools_only() -> None:
    adapter = sim(preempt_rate_multiplier=1e9, signal_interval_seconds=0.01)
    offers = await adapter.poll("aws:us-east-1")
    spot = first_spot(offers).pool
    on_demand = next(o.pool for o in offers if o.pool.market is Market.ON_DEMAND)
    foreign = PoolKey("oracle", "r", "z", "t", Market.SPOT)  # another adapter's pool
    seen: list[CapacitySignal] = []
    async with contextlib.aclosing(
        adapter.signals(lambda: {spot, on_demand, foreign})
    ) as signals, asyncio.timeout(2):
        async for signal in signals:
            seen.append(signal)
            if len(seen) == 3:
                break
    assert {s.pool for s in seen} == {spot}
    assert all(s.kind is SignalKind.INTERRUPTED for s in seen)
    assert seen[0].detail == "simulated spot preemption"
    assert by_key(await adapter.poll("aws:us-east-1"))[spot].capacity == 0


async def test_no_preemption_when_multiplier_is_zero() -> None:
    adapter = sim(preempt_rate_multiplier=0.0, signal_interval_seconds=0.001)
    pool = first_spot(await adapter.poll("aws:us-east-1")).pool
    async with contextlib.aclosing(adapter.signals(lambda: [pool])) as signals:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await anext(signals)


# --- scale -------------------------------------------------------------------------------


async def test_83_regions_per_cloud_give_about_20k_offers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    adapter = sim(regions_per_cloud=83)
    started = time.perf_counter()
    offers = await poll_all(adapter)  # the first poll also builds each region's market
    first = time.perf_counter() - started
    started = time.perf_counter()
    again = await poll_all(adapter)
    steady = time.perf_counter() - started
    assert 15_000 <= len(offers) <= 25_000
    assert len(again) == len(offers)
    with capsys.disabled():
        print(f"\nsim: {len(offers)} offers in {len(adapter.regions())} regions: first poll "
              f"of all {first * 1000:.0f} ms, next {steady * 1000:.0f} ms")


# --- arguments ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clouds": ["aws", "oracle"]}, "unknown cloud.*'oracle'"),
        ({"clouds": []}, "at least one cloud"),
        ({"clouds": "aws"}, "sequence of cloud names"),
        ({"clouds": ["aws", "aws"]}, "twice"),
        ({"regions_per_cloud": 0}, "regions_per_cloud"),
        ({"zones_per_region": 0}, "zones_per_region"),
        ({"zones_per_region": 27}, "zones_per_region"),
        ({"preempt_rate_multiplier": -1.0}, "preempt_rate_multiplier"),
        ({"preempt_rate_multiplier": float("nan")}, "preempt_rate_multiplier"),
        ({"signal_interval_seconds": 0.0}, "signal_interval_seconds"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SimAdapter(**kwargs)  # type: ignore[arg-type]
