"""The Azure adapter with the real azure-mgmt-compute (and its aiohttp price client)
against the fake Azure endpoint: sizes, zones, restrictions, prices, quotas, eviction
rates, caching, failures, random faults, the command line."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from fake_azure import FakeAzure, fake_azure_fixture  # noqa: F401
from fake_server import CHAOS_KINDS, Chaos
from pydantic import ValidationError

from adapters.azure import pricing
from adapters.azure.adapter import AzureAdapter, Refresh, from_config
from adapters.common import RetryPolicy, poll_deadline
from adapters.errors import AuthFailed, CloudUnavailable, InvalidConfig, RateLimited
from broker.daemon.config import AzureConfig
from broker.model import Market, Offer, PoolKey

REGION = "eastus"


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(fake: FakeAzure, **kwargs: Any) -> AzureAdapter:
    kwargs.setdefault("regions", [REGION, "westus", "southcentralus"])
    kwargs.setdefault("max_backoff", 0.05)
    return AzureAdapter(subscription_id=fake.subscription_id, endpoint=fake.url,
                        anonymous=True, **kwargs)


@pytest.fixture
async def adapter(fake_azure: FakeAzure) -> AsyncIterator[AzureAdapter]:
    a = make(fake_azure)
    yield a
    await a.close()


def by_key(offers: list[Offer]) -> dict[PoolKey, Offer]:
    return {o.pool: o for o in offers}


def find(offers: list[Offer], size: str, market: Market | None = None) -> list[Offer]:
    return [o for o in offers if o.pool.instance_type == size
            and (market is None or o.pool.market is market)]


async def test_poll_maps_sizes_zones_prices_quotas_and_eviction_rates(
        fake_azure: FakeAzure, adapter: AzureAdapter) -> None:
    offers = await adapter.poll(REGION)
    assert offers and all(o.pool.cloud == "azure" and o.pool.region == REGION for o in offers)
    assert len(by_key(offers)) == len(offers)

    size = "Standard_ND96asr_v4"
    od = find(offers, size, Market.ON_DEMAND)
    assert {o.pool.zone for o in od} == {f"eastus-{z}" for z in fake_azure.zones(REGION, size)}
    o = od[0]
    assert (o.gpu, o.gpus, o.gpu_memory_gb, o.vcpus, o.memory_gb, o.gpu_known) == (
        "A100-40GB", 8, 40, 96, 900.0, True)
    assert o.price_per_hour == fake_azure.on_demand_price(REGION, size)
    assert o.quota_headroom == 8  # family 100 vCPUs, cores 330 left: one 96-vCPU VM
    assert o.interruption_rate is None and o.availability is None and o.capacity is None
    for spot in find(offers, size, Market.SPOT):
        assert spot.price_per_hour == fake_azure.spot_price(REGION, size)
        assert spot.interruption_rate == pricing.eviction_rate(
            fake_azure.eviction_rate(REGION, size))
        assert spot.quota_headroom == 8  # lowPriorityCores 100: one VM

    assert {o.gpu for o in find(offers, "Standard_NC24ads_A100_v4")} == {"A100-80GB"}
    h100 = find(offers, "Standard_NC40ads_H100_v5")[0]
    assert (h100.gpu, h100.gpu_memory_gb) == ("H100-80GB", 94)
    assert {o.gpu for o in find(offers, "Standard_ND96isr_MI300X_v5")} == {"MI300X"}
    m60 = find(offers, "Standard_NV12s_v3")[0]
    assert (m60.gpu, m60.gpu_known) == ("M60", False)  # kept, flagged
    future = find(offers, "Standard_NC128lds_xl_RTXPRO6000BSE_v6")[0]
    assert (future.gpu, future.gpus, future.gpu_known) == ("RTXPRO6000BSE", 2, False)

    types = {o.pool.instance_type for o in offers}
    assert "Standard_D4s_v5" not in types and "Standard_E8s_v5" not in types  # no GPU
    assert "Standard_NV6ads_A10_v5" not in types  # 1/6 of a GPU
    assert "Standard_NV16as_v4" not in types  # 1/2 of a GPU, no GPUs capability
    # Promo sizes are not LowPriorityCapable: on-demand pools only.
    south = await adapter.poll("southcentralus")
    assert find(south, "Standard_NC6_Promo", Market.ON_DEMAND)
    assert not find(south, "Standard_NC6_Promo", Market.SPOT)
    assert {(o.gpu, o.gpu_known) for o in find(south, "Standard_NC6")} == {("K80", False)}
    # Some spot sizes have no eviction data: unknown, not guessed.
    rates = {o.pool.instance_type: o.interruption_rate
             for o in offers if o.pool.market is Market.SPOT}
    assert None in rates.values() and any(r is not None for r in rates.values())


async def test_a_region_without_zones_is_one_regional_pool_per_size(
        adapter: AzureAdapter) -> None:
    offers = await adapter.poll("westus")
    assert offers and {o.pool.zone for o in offers} == {"westus"}
    assert len(find(offers, "Standard_NC24ads_A100_v4")) == 2  # on-demand and spot


async def test_restrictions_for_the_subscription_remove_sizes_and_zones(
        fake_azure: FakeAzure, adapter: AzureAdapter) -> None:
    fake_azure.restrict(REGION, "Standard_ND96asr_v4")  # NotAvailableForSubscription
    fake_azure.restrict(REGION, "Standard_NC24ads_A100_v4", zones=["1", "3"])
    fake_azure.restrict("westus", "Standard_NC6s_v3")  # elsewhere: no effect here
    offers = await adapter.poll(REGION)
    assert not find(offers, "Standard_ND96asr_v4")
    assert {o.pool.zone for o in find(offers, "Standard_NC24ads_A100_v4")} == {"eastus-2"}
    assert {o.pool.zone for o in find(offers, "Standard_NC6s_v3", Market.SPOT)} == {
        "eastus-1", "eastus-2", "eastus-3"}


async def test_quota_headroom_follows_usage(fake_azure: FakeAzure,
                                            adapter: AzureAdapter) -> None:
    fake_azure.set_usage(REGION, "StandardNCADSA100v4Family", current=24, limit=120)
    fake_azure.set_usage(REGION, "lowPriorityCores", current=60, limit=100)
    fake_azure.set_usage(REGION, "standardNDSH100v5Family", current=0, limit=0)
    offers = await adapter.poll(REGION)
    nc48 = find(offers, "Standard_NC48ads_A100_v4")  # 48 vCPUs, 2 GPUs
    assert {o.quota_headroom for o in nc48 if o.pool.market is Market.ON_DEMAND} == {4}
    assert {o.quota_headroom for o in nc48 if o.pool.market is Market.SPOT} == {0}
    nc24 = find(offers, "Standard_NC24ads_A100_v4", Market.SPOT)  # 24 vCPUs, 1 GPU
    assert {o.quota_headroom for o in nc24} == {1}
    # A family with no quota at all (new subscriptions get 0 for most GPU families).
    assert {o.quota_headroom for o in find(offers, "Standard_ND96isr_H100_v5",
                                           Market.ON_DEMAND)} == {0}


async def test_between_refreshes_a_poll_asks_azure_nothing(fake_azure: FakeAzure) -> None:
    clock = Clock()
    a = make(fake_azure, monotonic=clock)
    try:
        first = by_key(await a.poll(REGION))
        assert {api for api, _ in fake_azure.calls} == {"skus", "prices", "usages", "graph"}
        fake_azure.reset_calls()
        clock.t += 60
        assert by_key(await a.poll(REGION)) == first
        assert fake_azure.call_count() == 0
        # Quotas are the first answer to go stale (10 min), prices, sizes and eviction
        # rates after an hour.
        fake_azure.set_usage(REGION, "lowPriorityCores", current=100, limit=100)
        fake_azure.set_price(REGION, "Standard_NC24ads_A100_v4", spot=0.39)
        clock.t += 600
        offers = await a.poll(REGION)
        assert {api for api, _ in fake_azure.calls} == {"usages"}
        spot = find(offers, "Standard_NC24ads_A100_v4", Market.SPOT)
        assert {o.quota_headroom for o in spot} == {0}
        assert {o.price_per_hour for o in spot} == {0.444433}  # cached an hour
        fake_azure.reset_calls()
        clock.t += 3600
        offers = await a.poll(REGION)
        assert {api for api, _ in fake_azure.calls} == {"skus", "prices", "usages", "graph"}
        assert {o.price_per_hour for o in find(offers, "Standard_NC24ads_A100_v4",
                                               Market.SPOT)} == {0.39}
    finally:
        await a.close()


async def test_throttling_with_a_short_retry_after_is_retried(fake_azure: FakeAzure) -> None:
    a = make(fake_azure, max_backoff=8)
    try:
        fake_azure.fail("skus", status=429, retry_after=1)
        started = time.monotonic()
        assert await a.poll(REGION)
        assert time.monotonic() - started >= 1.0  # not sooner than Azure asked
        skus = len(fake_azure.sizes_in(REGION, gpu_only=False)) + 2  # + a disk, a set
        pages = math.ceil(skus / fake_azure.page_size["skus"])
        assert fake_azure.call_count("skus") == pages + 1  # the throttled page, again
    finally:
        await a.close()


async def test_a_long_retry_after_goes_to_the_poller(fake_azure: FakeAzure,
                                                     adapter: AzureAdapter) -> None:
    fake_azure.fail("skus", status=429, code="SubscriptionRequestsThrottled",
                    retry_after=120)
    with pytest.raises(RateLimited) as info:
        await adapter.poll(REGION)
    assert info.value.retry_after == 120
    assert fake_azure.call_count("skus") == 1


async def test_an_api_that_stays_down_fails_the_poll_typed(fake_azure: FakeAzure,
                                                           adapter: AzureAdapter) -> None:
    fake_azure.fail("skus", status=503, times=None)
    with pytest.raises(CloudUnavailable, match=r"^Resource SKUs: ServiceUnavailable"):
        await adapter.poll(REGION)
    assert fake_azure.call_count("skus") == RetryPolicy.ATTEMPTS
    fake_azure.clear_faults()
    fake_azure.reset_calls()
    fake_azure.fail("skus", status=403, code="AuthorizationFailed", times=None)
    with pytest.raises(AuthFailed):
        await adapter.poll(REGION)
    assert fake_azure.call_count("skus") == 1  # never retried


async def test_optional_answers_keep_the_last_good_copy(fake_azure: FakeAzure) -> None:
    a = make(fake_azure, refresh=Refresh(prices=0, quotas=0, evictions=0))
    try:
        good = by_key(await a.poll(REGION))
        pages = fake_azure.call_count("prices")
        for api in ("prices", "usages", "graph"):
            fake_azure.fail(api, status=500, times=None)
        again = by_key(await a.poll(REGION))  # does not raise
        assert again.keys() == good.keys()
        for key, offer in good.items():
            assert (again[key].price_per_hour, again[key].quota_headroom,
                    again[key].interruption_rate, again[key].observed_at) == (
                offer.price_per_hour, offer.quota_headroom, offer.interruption_rate,
                offer.observed_at)
        # then every attempt at page 1
        assert fake_azure.call_count("prices") == pages + RetryPolicy.ATTEMPTS
    finally:
        await a.close()


async def test_a_first_poll_without_prices_fails_naming_them(fake_azure: FakeAzure,
                                                             adapter: AzureAdapter) -> None:
    # No earlier copy: no offers without a price because the price call failed; the
    # region is unhealthy, and the reason says what is missing.
    fake_azure.fail("prices", status=503, times=None)
    with pytest.raises(CloudUnavailable, match=r"^retail prices: ServiceUnavailable"):
        await adapter.poll(REGION)
    assert fake_azure.call_count("prices") == RetryPolicy.ATTEMPTS
    fake_azure.clear_faults()
    assert all(o.price_per_hour is not None for o in await adapter.poll(REGION)
               if o.pool.instance_type != "Standard_NC128lds_xl_RTXPRO6000BSE_v6")


async def test_without_optional_answers_quotas_and_rates_are_unknown(
        fake_azure: FakeAzure, adapter: AzureAdapter) -> None:
    for api in ("usages", "graph"):
        fake_azure.fail(api, status=503, times=None)
    offers = await adapter.poll(REGION)
    assert offers and all(o.quota_headroom is None and o.interruption_rate is None
                          for o in offers)
    assert find(offers, "Standard_NC24ads_A100_v4", Market.SPOT)[0].price_per_hour == \
        fake_azure.spot_price(REGION, "Standard_NC24ads_A100_v4")


async def test_retries_stop_at_the_polls_deadline(fake_azure: FakeAzure) -> None:
    a = make(fake_azure, max_backoff=1.0)
    try:
        fake_azure.fail("skus", status=500, times=None)
        started = time.monotonic()
        with poll_deadline(1.0), pytest.raises(CloudUnavailable, match="Resource SKUs"):
            await a.poll(REGION)
        assert time.monotonic() - started < 1.5
        assert 2 <= fake_azure.call_count("skus") < 8  # cut short by the deadline
    finally:
        await a.close()


# --- random faults: throttles, 5xx, timeouts, truncated bodies -------------------------

FAULTS = [pytest.param(0.5, (kind,), id=f"{kind}-50%") for kind in CHAOS_KINDS] + [
    pytest.param(0.3, CHAOS_KINDS, id="mixed-30%")]
FAULT_REGIONS = [REGION, "westus"]  # zones, and none
CALL_TIMEOUT = 1.0
EPOCH = datetime(2000, 1, 1, tzinfo=UTC)


def comparable(offers: list[Offer]) -> dict[PoolKey, Offer]:
    """The offers by pool, `observed_at` (when the prices were read) set aside."""
    return {o.pool: dataclasses.replace(o, observed_at=EPOCH) for o in offers}


async def fault_free(fake: FakeAzure) -> dict[PoolKey, Offer]:
    a = make(fake, regions=FAULT_REGIONS)
    try:
        polls = await asyncio.gather(*(a.poll(r) for r in FAULT_REGIONS))
    finally:
        await a.close()
    fake.reset_calls()
    return comparable([o for offers in polls for o in offers])


def inject(fake: FakeAzure, rate: float, kinds: tuple[str, ...]) -> None:
    """Random faults from now on. A timeout answers after 1.5 s (the client waits 1 s);
    no request is faulted more than 3 times of its 12 attempts (FakeAzure.chaos_repeats).
    At 50 % each API answers in one page, so that a test takes seconds, not a minute;
    the mixed faults at 30 % hit the fake's pages (several per API)."""
    fake.chaos = Chaos(rate=rate, kinds=kinds, hang_seconds=1.5, seed=15)
    fake.chaos_repeats = 3
    if rate >= 0.5:
        fake.page_size.update(skus=1000, usages=1000, prices=1000, graph=1000)


@pytest.mark.parametrize(("rate", "kinds"), FAULTS)
async def test_random_faults_leave_the_offers_as_without_them(
        fake_azure: FakeAzure, rate: float, kinds: tuple[str, ...]) -> None:
    want = await fault_free(fake_azure)
    inject(fake_azure, rate, kinds)
    a = make(fake_azure, regions=FAULT_REGIONS, max_backoff=1.0, call_timeout=CALL_TIMEOUT)
    try:
        with poll_deadline(30):
            polls = await asyncio.gather(*(a.poll(r) for r in FAULT_REGIONS))
    finally:
        await a.close()
    assert comparable([o for offers in polls for o in offers]) == want
    assert set(fake_azure.faulted) == set(kinds)


@pytest.mark.parametrize(("rate", "kinds"), FAULTS)
async def test_offers_command_under_random_faults_lists_the_same_offers(
        fake_azure: FakeAzure, tmp_path: Path, rate: float, kinds: tuple[str, ...]) -> None:
    want = {key: {k: v for k, v in o.to_json().items() if k != "observed_at"}
            for key, o in (await fault_free(fake_azure)).items()}
    inject(fake_azure, rate, kinds)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({"clouds": {"azure": {
        "subscription_id": fake_azure.subscription_id, "regions": FAULT_REGIONS,
        "endpoint": fake_azure.url, "anonymous": True,
        "call_timeout_seconds": CALL_TIMEOUT}}}))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "broker.cli", "offers", "--config", str(cfg), "--cloud",
        "azure", "--format", "json", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=dict(os.environ))
    async with asyncio.timeout(50):
        out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    assert "Traceback" not in err.decode(), err.decode()
    rows = [json.loads(line) for line in out.decode().splitlines()]
    got = {(r["region"], r["zone"], r["instance_type"], r["market"]):
           {k: v for k, v in r.items() if k != "observed_at"} for r in rows}
    assert len(got) == len(rows)
    assert got == {(k.region, k.zone, k.instance_type, k.market.value): v
                   for k, v in want.items()}
    assert set(fake_azure.faulted) == set(kinds)


async def test_an_unknown_region_is_a_config_error(fake_azure: FakeAzure) -> None:
    a = make(fake_azure, regions=["atlantis"])
    try:
        with pytest.raises(InvalidConfig, match="atlantis"):
            await a.poll("atlantis")
    finally:
        await a.close()
    with pytest.raises(InvalidConfig, match="region name"):
        make(fake_azure, regions=["East US"])
    a = make(fake_azure, regions=["EastUS", "eastus", "WestUS2"])  # Azure ignores case
    try:
        assert a.regions() == ["eastus", "westus2"]
    finally:
        await a.close()


def test_from_config_and_the_keys_it_needs(fake_azure: FakeAzure) -> None:
    with pytest.raises(ValidationError, match=r"subscription_id"):
        AzureConfig(regions=[REGION], endpoint=fake_azure.url, anonymous=True)  # type: ignore[call-arg]
    with pytest.raises(InvalidConfig, match=r"clouds\.azure\.regions"):
        from_config(AzureConfig(subscription_id="s", regions=[], endpoint=fake_azure.url,
                                anonymous=True))


async def test_call_timeout_seconds_reaches_both_clients(fake_azure: FakeAzure) -> None:
    a = from_config(AzureConfig(subscription_id=fake_azure.subscription_id,
                                regions=[REGION], endpoint=fake_azure.url, anonymous=True,
                                call_timeout_seconds=0.5))
    try:
        assert (a.sdk.call_timeout, a.retail.call_timeout) == (0.5, 0.5)
        assert (a.sdk.retry.attempts, a.retail.retry.attempts) == (RetryPolicy.ATTEMPTS,) * 2
        # An answer 1 s late is a timeout after 0.5 s, for ARM and the price API alike.
        fake_azure.chaos = Chaos(rate=1.0, kinds=("timeout",), hang_seconds=1.0)
        a.sdk.retry.attempts = a.retail.retry.attempts = 1
        started = time.monotonic()
        with pytest.raises(CloudUnavailable, match="Timeout"):
            await a.poll(REGION)
        assert time.monotonic() - started < 0.9
    finally:
        await a.close()


async def test_anonymous_mode_sends_no_credentials(fake_azure: FakeAzure,
                                                   adapter: AzureAdapter) -> None:
    assert await adapter.poll(REGION)
    assert fake_azure.call_count() >= 8 and fake_azure.authorized == 0


# --- the command line ----------------------------------------------------------------

def test_offers_command_lists_the_regions_gpu_sizes(fake_azure: FakeAzure, tmp_path: Path
                                                    ) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({"clouds": {"azure": {
        "subscription_id": fake_azure.subscription_id, "regions": [REGION, "westus3"],
        "endpoint": fake_azure.url, "anonymous": True}}}))
    r = subprocess.run([sys.executable, "-m", "broker.cli", "offers", "--config", str(cfg),
                        "--format", "json"], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ), check=False)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert {row["cloud"] for row in rows} == {"azure"}
    assert {row["region"] for row in rows} == {REGION, "westus3"}
    types = {row["instance_type"] for row in rows}
    assert {"Standard_ND96isr_H100_v5", "Standard_NC24ads_A100_v4",
            "Standard_ND96isr_H200_v5"} <= types
    priced = [row["price_per_gpu_hour"] for row in rows if row["price_per_gpu_hour"]]
    assert priced == sorted(priced)
    assert any(row["interruption_rate"] is not None for row in rows)
