"""The Alibaba Cloud adapter with the real Tea SDK against the fake ECS endpoint."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import pytest
import structlog
import yaml
from fake_alibaba import TYPES, FakeAlibaba, fake_alibaba_fixture  # noqa: F401
from fake_server import CHAOS_KINDS, Chaos

from adapters.alibaba import pricing
from adapters.alibaba.adapter import AlibabaAdapter, Refresh, from_config
from adapters.alibaba.sdk import ANONYMOUS_KEY_ID, NO_CREDENTIALS
from adapters.errors import AuthFailed, CloudUnavailable, InvalidConfig, RateLimited
from broker.daemon.config import AlibabaConfig
from broker.model import Market, Offer, PoolKey

REGION = "cn-hangzhou"
RATE = 0.14  # usd_per_cny
A10 = "ecs.gn7i-c8g1.2xlarge"


def adapter_on(fake: FakeAlibaba, regions: list[str] | None = None, **kwargs: Any
               ) -> AlibabaAdapter:
    a = AlibabaAdapter(regions=regions or [REGION], endpoint=fake.url, anonymous=True,
                       usd_per_cny=RATE, **kwargs)
    a.sdk.retry.max_backoff = 0.05  # keep tests fast; the schedule is what is tested
    return a


@pytest.fixture
async def adapter(fake_alibaba: FakeAlibaba) -> AsyncIterator[AlibabaAdapter]:
    a = adapter_on(fake_alibaba, [REGION, "cn-beijing"])
    yield a
    await a.close()


def by_key(offers: list[Offer]) -> dict[PoolKey, Offer]:
    return {o.pool: o for o in offers}


def key(zone: str, itype: str, market: Market, region: str = REGION) -> PoolKey:
    return PoolKey("alibaba", region, zone, itype, market)


MARKETS = {"postpaid": Market.ON_DEMAND, "spot": Market.SPOT}


async def test_poll_lists_every_gpu_pool_with_stock_prices_rates_and_quotas(
        fake_alibaba: FakeAlibaba, adapter: AlibabaAdapter) -> None:
    offers = await adapter.poll(REGION)
    pools = by_key(offers)
    assert len(pools) == len(offers)
    # Exactly the pools the region sells, both markets, GPU types only, in stock or not.
    expected = {key(z, t, MARKETS[m]) for m in MARKETS
                for (z, t) in fake_alibaba.sells(REGION, m) if TYPES[t].gpus > 0}
    assert set(pools) == expected
    assert not {o.pool.instance_type for o in offers} & {"ecs.g7.large", "ecs.c7.xlarge",
                                                         "ecs.f3-c4f1.xlarge"}
    attrs = {n: float(fake_alibaba.attribute(REGION, n) or 0) for n in pricing.QUOTA_ATTRIBUTES}
    for o in offers:
        t = TYPES[o.pool.instance_type]
        assert (o.gpus, o.vcpus, o.memory_gb, o.gpu_memory_gb) == (
            t.gpus, t.vcpus, t.memory_gib, t.gpu_memory_gib)
        market = "spot" if o.pool.market is Market.SPOT else "postpaid"
        category = fake_alibaba.stock(REGION, o.pool.zone, t.name, market)
        assert o.availability == pricing.STOCK_AVAILABILITY[category]  # type: ignore[index]
        if o.pool.market is Market.ON_DEMAND:
            assert o.price_per_hour == pytest.approx(
                fake_alibaba.on_demand_price(REGION, t.name) * RATE)
            free = attrs["max-postpaid-instance-vcpu-count"] - attrs[
                "used-postpaid-instance-vcpu-count"]
            assert o.interruption_rate is None
        else:
            assert o.price_per_hour == pytest.approx(
                fake_alibaba.spot_price(REGION, o.pool.zone, t.name) * RATE)  # type: ignore[operator]
            free = attrs["max-spot-instance-vcpu-count"] - attrs["used-spot-instance-vcpu-count"]
            pct, band = fake_alibaba.release_rate(REGION, o.pool.zone, t.name)  # type: ignore[misc]
            assert o.interruption_rate == pytest.approx(pricing.interruption_rate(pct, band))
        assert o.quota_headroom == int(free // t.vcpus) * t.gpus
    # GPU names: canonical where known, Alibaba's own (flagged) where not.
    gpu = {o.pool.instance_type: (o.gpu, o.gpu_known) for o in offers}
    assert gpu[A10] == ("A10", True)
    assert gpu["ecs.gn6v-c8g1.2xlarge"] == ("V100-16GB", True)
    assert gpu["ecs.gn6e-c12g1.3xlarge"] == ("V100-32GB", True)
    assert gpu["ecs.gn7-c12g1.3xlarge"] == ("A100-40GB", True)
    assert gpu["ecs.gn7e-c16g1.32xlarge"] == ("A100-80GB", True)
    assert gpu["ecs.gn8v-8x.48xlarge"] == ("H20-96GB", True)
    assert gpu["ecs.vgn6i-m4.xlarge"] == ("NVIDIA T4", False)
    assert adapter.price_currency(REGION) == "CNY"


async def test_the_international_site_prices_in_usd_unconverted() -> None:
    with FakeAlibaba(currency="USD") as fake:
        a = adapter_on(fake)
        try:
            offers = await a.poll(REGION)
        finally:
            await a.close()
    od = next(o for o in offers if o.pool.market is Market.ON_DEMAND)
    assert od.price_per_hour == pytest.approx(fake.on_demand_price(REGION,
                                                                   od.pool.instance_type))
    assert a.price_currency(REGION) == "USD"


async def test_the_account_discount_and_only_the_instance_are_priced(
        fake_alibaba: FakeAlibaba, adapter: AlibabaAdapter) -> None:
    fake_alibaba.discount = 0.25
    offers = await adapter.poll(REGION)
    od = next(o for o in offers if o.pool.instance_type == A10
              and o.pool.market is Market.ON_DEMAND)
    # TradePrice of the instanceType line: discounted, without the system disk.
    assert od.price_per_hour == pytest.approx(TYPES[A10].cny_per_hour * 0.75 * RATE)


async def test_the_first_poll_asks_each_question_and_pages_through_answers(
        fake_alibaba: FakeAlibaba, adapter: AlibabaAdapter) -> None:
    fake_alibaba.page_size["DescribeSpotPriceHistory"] = 3
    offers = await adapter.poll(REGION)
    calls = fake_alibaba.calls
    gpu_types = [t for t in TYPES.values() if t.gpus > 0]
    assert calls[("DescribeInstanceTypes", "")] == -(-len(gpu_types) // 5)  # NextToken pages
    assert calls[("DescribeAvailableResource", REGION)] == 2  # NoSpot and SpotAsPriceGo
    sold_spot = {t for (_, t) in fake_alibaba.sells(REGION, "spot") if TYPES[t].gpus}
    sold_od = {t for (_, t) in fake_alibaba.sells(REGION, "postpaid") if TYPES[t].gpus}
    assert calls[("DescribeSpotPriceHistory", REGION)] > len(sold_spot)  # Offset pages
    assert calls[("DescribePrice", REGION)] == len(sold_od)
    assert calls[("DescribeSpotAdvice", REGION)] == -(-len(sold_spot) // 10)
    assert calls[("DescribeAccountAttributes", REGION)] == 1
    history = [p for a, p in fake_alibaba.requests if a == "DescribeSpotPriceHistory"]
    assert {(p["NetworkType"], p["OSType"]) for p in history} == {("vpc", "linux")}
    assert {p.get("Offset", "0") for p in history} >= {"0", "3", "6"}
    # The newest point wins even when it is on the last page.
    for o in offers:
        if o.pool.market is Market.SPOT:
            expected = fake_alibaba.spot_price(REGION, o.pool.zone, o.pool.instance_type)
            assert o.price_per_hour == pytest.approx(expected * RATE)  # type: ignore[operator]
    describe = [p for a, p in fake_alibaba.requests if a == "DescribeAvailableResource"]
    assert sorted(p["SpotStrategy"] for p in describe) == ["NoSpot", "SpotAsPriceGo"]
    assert {p["DestinationResource"] for p in describe} == {"InstanceType"}


async def test_a_steady_state_poll_asks_only_for_stock(fake_alibaba: FakeAlibaba,
                                                       adapter: AlibabaAdapter) -> None:
    await adapter.poll(REGION)
    zone = "cn-hangzhou-i"
    fake_alibaba.set_stock(REGION, zone, A10, "spot", "WithoutStock")
    fake_alibaba.set_stock(REGION, zone, A10, "postpaid", "ClosedWithStock")
    fake_alibaba.set_stock(REGION, "cn-hangzhou-j", A10, "postpaid", None)
    fake_alibaba.reset_calls()
    offers = by_key(await adapter.poll(REGION))
    assert set(fake_alibaba.calls) == {("DescribeAvailableResource", REGION)}
    assert fake_alibaba.call_count() == 2
    # A sold-out pool is still listed, with availability 0; one no longer sold is gone.
    assert offers[key(zone, A10, Market.SPOT)].availability == 0.0
    assert offers[key(zone, A10, Market.SPOT)].price_per_hour is not None
    assert offers[key(zone, A10, Market.ON_DEMAND)].availability == 0.3
    assert key("cn-hangzhou-j", A10, Market.ON_DEMAND) not in offers


async def test_a_type_the_region_starts_selling_is_priced_at_once(
        fake_alibaba: FakeAlibaba) -> None:
    l20 = "ecs.gn8is-2x.8xlarge"
    sold = {m: {z for (z, t) in fake_alibaba.sells(REGION, m) if t == l20} for m in MARKETS}
    for m, zones in sold.items():
        for z in zones:
            fake_alibaba.set_stock(REGION, z, l20, m, None)
    a = adapter_on(fake_alibaba)
    try:
        assert l20 not in {o.pool.instance_type for o in await a.poll(REGION)}
        for m, zones in sold.items():
            for z in zones:
                fake_alibaba.set_stock(REGION, z, l20, m, "WithStock")
        fake_alibaba.reset_calls()
        offers = [o for o in await a.poll(REGION) if o.pool.instance_type == l20]
        asked = [(act, p.get("InstanceType") or p.get("InstanceTypes.1"))
                 for act, p in fake_alibaba.requests if act != "DescribeAvailableResource"]
        assert sorted(set(asked)) == [("DescribePrice", l20), ("DescribeSpotAdvice", l20),
                                      ("DescribeSpotPriceHistory", l20)]
        assert offers and all(o.price_per_hour is not None for o in offers)
    finally:
        await a.close()


async def test_spot_prices_are_read_again_incrementally(fake_alibaba: FakeAlibaba) -> None:
    a = adapter_on(fake_alibaba, refresh=Refresh(spot_prices=0))
    zone = "cn-hangzhou-i"
    fake_alibaba.set_stock(REGION, zone, A10, "spot", "WithStock")
    try:
        await a.poll(REGION)
        first = {p["StartTime"] for act, p in fake_alibaba.requests
                 if act == "DescribeSpotPriceHistory" and p["InstanceType"] == A10}
        fake_alibaba.set_spot_price(REGION, zone, A10, 2.345)
        fake_alibaba.reset_calls()
        offers = by_key(await a.poll(REGION))
        again = {p["StartTime"] for act, p in fake_alibaba.requests
                 if act == "DescribeSpotPriceHistory" and p["InstanceType"] == A10}
        assert offers[key(zone, A10, Market.SPOT)].price_per_hour == pytest.approx(2.345 * RATE)
        assert min(again) > max(first)  # only what changed since the last read
        assert fake_alibaba.call_count("DescribePrice") == 0  # on-demand is cached
    finally:
        await a.close()


async def test_throttling_is_retried_honouring_retry_after(fake_alibaba: FakeAlibaba,
                                                           adapter: AlibabaAdapter) -> None:
    fake_alibaba.fail("DescribeAvailableResource", "Throttling.User", times=2)
    fake_alibaba.fail("DescribeSpotAdvice", "Throttling.Api", times=1, retry_after_ms=30)
    offers = await adapter.poll(REGION)
    assert offers
    assert fake_alibaba.call_count("DescribeAvailableResource") == 4
    assert fake_alibaba.call_count("DescribeSpotAdvice") == 3  # 2 chunks, one retried
    assert all(o.interruption_rate is not None for o in offers
               if o.pool.market is Market.SPOT)


async def test_an_api_that_stays_down_fails_the_poll_typed(fake_alibaba: FakeAlibaba,
                                                           adapter: AlibabaAdapter) -> None:
    fake_alibaba.fail("DescribeAvailableResource", "InternalError", times=None)
    with pytest.raises(CloudUnavailable, match="InternalError"):
        await adapter.poll(REGION)
    attempts = adapter.sdk.retry.attempts
    assert fake_alibaba.call_count("DescribeAvailableResource") == 2 * attempts
    fake_alibaba.clear_faults()
    fake_alibaba.fail("DescribeAvailableResource", "Forbidden.RAM", times=None)
    fake_alibaba.reset_calls()
    with pytest.raises(AuthFailed, match=r"Forbidden\.RAM.*HTTP 403"):
        await adapter.poll(REGION)
    assert fake_alibaba.call_count("DescribeAvailableResource") == 2  # never retried
    # A region Alibaba does not know is a configuration error.
    fake_alibaba.clear_faults()
    bad = adapter_on(fake_alibaba, ["cn-nowhere"])
    try:
        with pytest.raises(InvalidConfig, match="InvalidRegionId"):
            await bad.poll("cn-nowhere")
    finally:
        await bad.close()


async def test_failed_refreshes_keep_each_types_last_good_copy_and_log_once(
        fake_alibaba: FakeAlibaba) -> None:
    a = adapter_on(fake_alibaba, refresh=Refresh(instance_types=0, spot_prices=0, on_demand=0,
                                                 spot_advice=0, quotas=0))
    try:
        good = by_key(await a.poll(REGION))
        for action in ("DescribeInstanceTypes", "DescribeSpotPriceHistory", "DescribePrice",
                       "DescribeSpotAdvice", "DescribeAccountAttributes"):
            fake_alibaba.fail(action, "ServiceUnavailable", times=None)
        with structlog.testing.capture_logs() as logs:
            await a.poll(REGION)
            again = by_key(await a.poll(REGION))  # does not raise
            fake_alibaba.clear_faults()
            fresh = by_key(await a.poll(REGION))
        assert set(again) == set(fresh) == set(good)
        for k, offer in good.items():
            # The last good copy, with the time it was read.
            assert again[k].price_per_hour == offer.price_per_hour
            assert again[k].observed_at == offer.observed_at < fresh[k].observed_at
            assert again[k].interruption_rate == offer.interruption_rate
            assert again[k].quota_headroom == offer.quota_headroom
        failing = [e["what"] for e in logs if e["event"].startswith("alibaba partial poll "
                                                                     "failure")]
        recovered = [e["what"] for e in logs if e["event"] == "alibaba partial poll recovered"]
        assert sorted(failing) == sorted(recovered) == [
            "instance types", "on-demand prices", "quotas", "spot prices",
            "spot release rates"]
    finally:
        await a.close()


async def test_a_first_poll_without_prices_fails_and_names_what_is_missing(
        fake_alibaba: FakeAlibaba) -> None:
    a = adapter_on(fake_alibaba)
    fake_alibaba.fail("DescribePrice", "InternalError", times=None)
    fake_alibaba.fail("DescribeSpotAdvice", "Throttling", times=None)
    fake_alibaba.fail("DescribeAccountAttributes", "Throttling", times=None)
    sold_od = sorted({t for (_, t) in fake_alibaba.sells(REGION, "postpaid")
                      if TYPES[t].gpus})
    try:
        # Never an offer without its price because the price call failed: the poll
        # fails, and says which prices are missing.
        with pytest.raises(CloudUnavailable) as raised:
            await a.poll(REGION)
        message = str(raised.value)
        assert f"on-demand prices of {len(sold_od)} types ({', '.join(sold_od[:4])}, " \
               f"+{len(sold_od) - 4} more)" in message
        assert "spot prices" not in message and "InternalError" in message
        assert raised.value.region == REGION
        assert fake_alibaba.call_count("DescribePrice") == len(sold_od) * a.sdk.retry.attempts
        # What was read is kept: the next poll asks only for the missing prices. Release
        # rates and quotas are optional: unknown until read.
        fake_alibaba.clear_faults()
        fake_alibaba.fail("DescribeSpotAdvice", "Throttling", times=None)
        fake_alibaba.fail("DescribeAccountAttributes", "Throttling", times=None)
        fake_alibaba.reset_calls()
        offers = await a.poll(REGION)
        asked = {action for action, _ in fake_alibaba.calls}
        assert asked == {"DescribeAvailableResource", "DescribePrice", "DescribeSpotAdvice",
                         "DescribeAccountAttributes"}
        assert all(o.price_per_hour is not None for o in offers
                   if o.pool.market is Market.ON_DEMAND)
        assert all(o.interruption_rate is None and o.quota_headroom is None for o in offers)
    finally:
        await a.close()


async def test_prices_still_throttled_fail_the_poll_as_rate_limited_with_the_hint(
        fake_alibaba: FakeAlibaba, adapter: AlibabaAdapter) -> None:
    # A hint beyond the backoff cap is not waited out at the seam: the poller waits.
    fake_alibaba.fail("DescribeSpotPriceHistory", "Throttling.User", times=None,
                      retry_after_ms=5000)
    with pytest.raises(RateLimited, match=r"spot prices of \d+ types") as raised:
        await adapter.poll(REGION)
    assert raised.value.retry_after == 5.0
    sold_spot = {t for (_, t) in fake_alibaba.sells(REGION, "spot") if TYPES[t].gpus}
    assert fake_alibaba.call_count("DescribeSpotPriceHistory") == len(sold_spot)


async def test_a_type_alibaba_will_not_price_is_listed_unpriced_once_logged(
        fake_alibaba: FakeAlibaba) -> None:
    a = adapter_on(fake_alibaba, refresh=Refresh(on_demand=0))
    fake_alibaba.fail("DescribePrice", "InvalidInstanceType.ValueNotSupported", times=None)
    try:
        with structlog.testing.capture_logs() as logs:
            first = await a.poll(REGION)
            second = await a.poll(REGION)
    finally:
        await a.close()
    for offers in (first, second):
        od = [o for o in offers if o.pool.market is Market.ON_DEMAND]
        assert od and all(o.price_per_hour is None for o in od)
        assert all(o.price_per_hour is not None for o in offers
                   if o.pool.market is Market.SPOT)
    refused = [e for e in logs if e["event"].startswith("alibaba will not give")]
    assert {e["instance_type"] for e in refused} == {o.pool.instance_type for o in od}
    assert len(refused) == len({o.pool.instance_type for o in od})  # once per type


async def test_prices_the_account_may_not_read_fail_the_poll_as_auth(
        fake_alibaba: FakeAlibaba, adapter: AlibabaAdapter) -> None:
    fake_alibaba.fail("DescribePrice", "Forbidden.RAM", times=None)
    with pytest.raises(AuthFailed, match=r"describe_price: Forbidden\.RAM"):
        await adapter.poll(REGION)


async def test_release_rate_band_is_used_when_the_rate_is_missing(
        fake_alibaba: FakeAlibaba, adapter: AlibabaAdapter) -> None:
    zone = "cn-hangzhou-k"
    fake_alibaba.set_stock(REGION, zone, A10, "spot", "WithStock")
    fake_alibaba.set_release_rate(REGION, zone, A10, None, "5-10%")
    offers = by_key(await adapter.poll(REGION))
    assert offers[key(zone, A10, Market.SPOT)].interruption_rate == pytest.approx(
        pricing.interruption_rate(None, "5-10%"))


async def test_quota_headroom_subtracts_usage(fake_alibaba: FakeAlibaba,
                                              adapter: AlibabaAdapter) -> None:
    fake_alibaba.set_attribute(REGION, "max-spot-instance-vcpu-count", 100)
    fake_alibaba.set_attribute(REGION, "used-spot-instance-vcpu-count", 60)
    fake_alibaba.set_attribute(REGION, "max-postpaid-instance-vcpu-count", None)
    offers = await adapter.poll(REGION)
    a10 = {o.pool.market: o for o in offers if o.pool.instance_type == A10}
    assert a10[Market.SPOT].quota_headroom == 5  # (100 - 60) // 8 vCPUs × 1 GPU
    assert a10[Market.ON_DEMAND].quota_headroom is None  # no limit reported


async def test_anonymous_mode_signs_with_the_fixed_dummy_key(
        fake_alibaba: FakeAlibaba, adapter: AlibabaAdapter) -> None:
    await adapter.poll(REGION)
    assert set(fake_alibaba.key_ids) == {ANONYMOUS_KEY_ID}


async def test_regions_are_polled_concurrently_without_leaking(
        fake_alibaba: FakeAlibaba, adapter: AlibabaAdapter) -> None:
    fake_alibaba.latency = (0.01, 0.03)
    hz, bj = await asyncio.gather(adapter.poll(REGION), adapter.poll("cn-beijing"))
    assert hz and bj and {o.pool.region for o in bj} == {"cn-beijing"}


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"regions": []}, "regions is empty"),
    ({"regions": [REGION], "anonymous": True}, "only together with endpoint"),
    ({"regions": [REGION], "endpoint": "http://127.0.0.1:1/ecs"}, "served at '/'"),
    ({"regions": [REGION], "endpoint": "ftp://x"}, "http"),
    ({"regions": [REGION], "usd_per_cny": 0}, "usd_per_cny"),
])
def test_bad_configuration_is_invalid_config(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidConfig, match=match):
        AlibabaAdapter(**kwargs)


async def test_from_config_takes_the_config_section(fake_alibaba: FakeAlibaba) -> None:
    section = AlibabaConfig(regions=["cn-beijing"], endpoint=fake_alibaba.url, anonymous=True,
                            usd_per_cny=0.5)
    a = from_config(section)
    try:
        assert list(a.regions()) == ["cn-beijing"]
        od = next(o for o in await a.poll("cn-beijing") if o.pool.market is Market.ON_DEMAND)
        assert od.price_per_hour == pytest.approx(
            fake_alibaba.on_demand_price("cn-beijing", od.pool.instance_type) * 0.5)
        with pytest.raises(InvalidConfig):
            await a.poll(REGION)  # not configured
    finally:
        await a.close()


@pytest.mark.parametrize("duration", [0, 1])
async def test_the_configured_spot_duration_is_the_spot_price_read(
        fake_alibaba: FakeAlibaba, duration: int) -> None:
    """A spot price is per protection period (`SpotDuration`, default 1 h): configured
    0, the spot offers carry the 0-hour price, and the spot questions ask for it."""
    section = AlibabaConfig(regions=[REGION], endpoint=fake_alibaba.url, anonymous=True,
                            usd_per_cny=RATE, spot_duration=duration)
    a = from_config(section)
    try:
        spot = [o for o in await a.poll(REGION) if o.pool.market is Market.SPOT]
    finally:
        await a.close()
    assert spot
    for o in spot:
        want = fake_alibaba.spot_price(REGION, o.pool.zone, o.pool.instance_type, duration)
        other = fake_alibaba.spot_price(REGION, o.pool.zone, o.pool.instance_type,
                                        1 - duration)
        assert o.price_per_hour == pytest.approx(want * RATE, rel=1e-5)  # type: ignore[operator]
        assert o.price_per_hour != pytest.approx(other * RATE, rel=1e-5)  # type: ignore[operator]
    asked = [(action, p.get("SpotStrategy"), p.get("SpotDuration"))
             for action, p in fake_alibaba.requests
             if action in ("DescribeSpotPriceHistory", "DescribeAvailableResource")]
    assert {x for x in asked if x[0] == "DescribeSpotPriceHistory"} == {
        ("DescribeSpotPriceHistory", None, str(duration))}
    assert {x for x in asked if x[0] == "DescribeAvailableResource"} == {
        ("DescribeAvailableResource", "NoSpot", None),
        ("DescribeAvailableResource", "SpotAsPriceGo", str(duration))}


def test_spot_duration_is_0_or_1(fake_alibaba: FakeAlibaba) -> None:
    with pytest.raises(InvalidConfig, match="spot_duration"):
        AlibabaAdapter(regions=[REGION], endpoint=fake_alibaba.url, anonymous=True,
                       spot_duration=2)


# --- the SDK's default credential chain, in a fresh process ---------------------------
# The chain reads its environment variables once, when first imported, so these run the
# real command line in a child process with the environment under test.

def offers_command(fake: FakeAlibaba | None, tmp_path: Path, env: dict[str, str], *,
                   section: dict[str, Any] | None = None, config: dict[str, Any] | None = None,
                   metadata: bool = False) -> subprocess.CompletedProcess[str]:
    """`gpubroker offers --cloud alibaba --format json` in a child process: the config's
    `clouds.alibaba` is REGION on `fake` (if any) plus `section`, with `config`'s other
    sections; HOME is `tmp_path` (no credential files), no ALIBABA_CLOUD_* variables but
    `env`, the ECS metadata service probed only if `metadata`."""
    alibaba: dict[str, Any] = {"regions": [REGION]}
    if fake is not None:
        alibaba["endpoint"] = fake.url
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({**(config or {}),
                                   "clouds": {"alibaba": {**alibaba, **(section or {})}}}))
    base = {k: v for k, v in os.environ.items() if not k.startswith("ALIBABA_CLOUD_")}
    base["HOME"] = str(tmp_path)
    if not metadata:
        base["ALIBABA_CLOUD_ECS_METADATA_DISABLED"] = "true"
    base.update(env)
    return subprocess.run([sys.executable, "-m", "broker.cli", "offers", "--config", str(cfg),
                           "--cloud", "alibaba", "--format", "json"], capture_output=True,
                          text=True, timeout=60, env=base, check=False)


def test_offers_command_signs_with_the_default_chains_key(fake_alibaba: FakeAlibaba,
                                                          tmp_path: Path) -> None:
    fake_alibaba.access_keys["LTAI-env-key"] = "env-secret"  # signatures checked
    r = offers_command(fake_alibaba, tmp_path, {"ALIBABA_CLOUD_ACCESS_KEY_ID": "LTAI-env-key",
                                                "ALIBABA_CLOUD_ACCESS_KEY_SECRET": "env-secret"})
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert {row["cloud"] for row in rows} == {"alibaba"}
    assert {row["gpu"] for row in rows} >= {"A10", "T4", "V100-16GB", "A100-80GB"}
    priced = [row["price_per_gpu_hour"] for row in rows if row["price_per_gpu_hour"]]
    assert priced == sorted(priced) and len(priced) > len(rows) / 2
    assert set(fake_alibaba.key_ids) == {"LTAI-env-key"}


@pytest.mark.parametrize(("env", "message"), [
    ({}, "AuthFailed: no usable Alibaba Cloud credentials in the SDK's default chain"),
    ({"ALIBABA_CLOUD_ACCESS_KEY_ID": "LTAI-env-key",
      "ALIBABA_CLOUD_ACCESS_KEY_SECRET": "wrong"}, "AuthFailed: .*SignatureDoesNotMatch"),
])
def test_credentials_that_fail_are_one_clear_auth_error(
        fake_alibaba: FakeAlibaba, tmp_path: Path, env: dict[str, str], message: str) -> None:
    fake_alibaba.access_keys["LTAI-env-key"] = "env-secret"
    r = offers_command(fake_alibaba, tmp_path, {"ALIBABA_CLOUD_CLI_PROFILE_DISABLED": "true",
                                                **env})
    assert r.returncode == 1
    lines = [line for line in r.stderr.splitlines() if line.startswith("gpubroker:")]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("gpubroker: poll failed: alibaba cn-hangzhou: ")
    assert re.search(message, lines[0]), lines[0]
    assert "env-secret" not in r.stderr and "wrong" not in lines[0].split("AuthFailed")[0]


@pytest.mark.parametrize(("env", "metadata"), [
    pytest.param({}, True, id="ecs-metadata-service"),
    pytest.param({"ALIBABA_CLOUD_CREDENTIALS_URI": "http://127.0.0.1:9/credentials"}, False,
                 id="credentials-uri"),
])
def test_without_credentials_offers_says_so_in_one_line_without_tracebacks(
        tmp_path: Path, env: dict[str, str], metadata: bool) -> None:
    # The chain's providers that fail (no ECS metadata service here; nothing on the URI)
    # log a warning and a traceback per probe on a stderr handler of their own.
    r = offers_command(None, tmp_path, env, metadata=metadata)
    assert r.returncode == 1  # no offers, a cloud failed: as for any cloud
    assert "Traceback" not in r.stderr and "credentials" not in r.stdout
    lines = r.stderr.splitlines()
    assert len(lines) <= 3, r.stderr  # ours, and the poller's "poll failing"
    ours = [line for line in lines if line.startswith("gpubroker:")]
    assert len(ours) == 1, r.stderr
    assert ours[0].endswith("alibaba cn-hangzhou: AuthFailed: " + NO_CREDENTIALS), ours


# --- random faults: throttles, 5xx, timeouts and cut-off answers heal ------------------

CHAOS = [
    pytest.param(("throttle",), 0.5, id="throttle"),
    pytest.param(("5xx",), 0.5, id="5xx"),
    pytest.param(("timeout",), 0.5, id="timeout"),
    pytest.param(("truncated",), 0.5, id="truncated"),
    pytest.param(CHAOS_KINDS, 0.3, id="mixed"),
]


def comparable(rows: Iterable[dict[str, Any]]) -> dict[tuple[str, ...], dict[str, Any]]:
    """Offers as `to_json` rows by pool, without `observed_at` (the time of the read)."""
    return {(r["region"], r["zone"], r["instance_type"], r["market"]):
            {k: v for k, v in r.items() if k != "observed_at"} for r in rows}


async def fault_free(fake: FakeAlibaba) -> dict[tuple[str, ...], dict[str, Any]]:
    """The offers of a poll of REGION without faults, comparable. Makes `fake` page its
    instance types in two pages (paging under faults, but fewer calls in a row)."""
    fake.page_size["DescribeInstanceTypes"] = 8
    a = adapter_on(fake)
    try:
        return comparable(o.to_json() for o in await a.poll(REGION))
    finally:
        await a.close()


@pytest.mark.parametrize(("kinds", "rate"), CHAOS)
async def test_random_faults_change_no_offer(fake_alibaba: FakeAlibaba,
                                             kinds: tuple[str, ...], rate: float) -> None:
    expected = await fault_free(fake_alibaba)
    # One request fails at most 3 times in a row, so that the seam's retries (8
    # attempts) always get through and the offers can be compared exactly.
    fake_alibaba.chaos_spare_after = 3
    fake_alibaba.chaos_retry_after_ms = 200
    fake_alibaba.chaos = Chaos(rate=rate, kinds=kinds, hang_seconds=0.6, seed=11)
    a = adapter_on(fake_alibaba, call_timeout=0.3)
    a.sdk.retry.max_backoff = 0.2  # at least the hint: a throttle is waited out, not raised
    try:
        with structlog.testing.capture_logs() as logs:
            offers = await a.poll(REGION)
    finally:
        await a.close()
    assert comparable(o.to_json() for o in offers) == expected
    assert fake_alibaba.faulted and set(fake_alibaba.faulted) <= set(kinds)
    assert not [e for e in logs if e["log_level"] != "info"]  # nothing kept, nothing lost


@pytest.mark.slow
@pytest.mark.parametrize(("kinds", "rate"), CHAOS)
async def test_random_faults_change_no_offer_on_the_command_line(
        fake_alibaba: FakeAlibaba, tmp_path: Path, kinds: tuple[str, ...], rate: float
        ) -> None:
    expected = await fault_free(fake_alibaba)
    # The seam's own backoff (0.25 s doubling): at most 2 faults in a row per request
    # keeps the run to a few seconds.
    fake_alibaba.chaos_spare_after = 2
    fake_alibaba.chaos_retry_after_ms = 200
    fake_alibaba.chaos = Chaos(rate=rate, kinds=kinds, hang_seconds=1.0, seed=12)
    r = offers_command(fake_alibaba, tmp_path, {},
                       section={"anonymous": True, "call_timeout_seconds": 0.5})
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and not r.stderr.strip(), r.stderr
    assert comparable(json.loads(line) for line in r.stdout.splitlines()) == expected
    assert fake_alibaba.faulted and set(fake_alibaba.faulted) <= set(kinds)
