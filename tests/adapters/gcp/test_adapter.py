"""The GCP adapter with the real google-cloud-compute and google-cloud-billing clients
(REST transport) against the fake Google Cloud endpoint (inventory, SKUs and quotas from
the price snapshot)."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import pytest
import yaml
from factories import Clocks
from fake_gcp import LOCAL_SSD, LOCAL_SSD_GIB, FakeGCP, fake_gcp_fixture, sku_series  # noqa: F401
from fake_server import CHAOS_KINDS, Chaos

from adapters.common import RetryPolicy, poll_deadline
from adapters.errors import (
    AdapterError,
    AuthFailed,
    CloudUnavailable,
    InvalidConfig,
    RateLimited,
)
from adapters.gcp import pricing
from adapters.gcp.adapter import GcpAdapter, Refresh, from_config
from broker.daemon.config import GcpConfig, parse_config
from broker.market.clouds import build_adapters
from broker.model import Market, Offer, PoolKey

REGION = "us-central1"
ZONE = "us-central1-a"
OD, SPOT = Market.ON_DEMAND, Market.SPOT


@pytest.fixture
def clocks() -> Clocks:
    return Clocks()


def make(fake: FakeGCP, clocks: Clocks, regions: list[str] | None = None,
         **kwargs: Any) -> GcpAdapter:
    opts: dict[str, Any] = {"project": fake.project, "endpoint": fake.url, "anonymous": True}
    opts.update(kwargs)
    opts.setdefault("retry", RetryPolicy(max_backoff=0.05))
    return GcpAdapter(regions=regions or [REGION, "europe-west4"],
                      clock=lambda: clocks.now, monotonic=lambda: clocks.mono, **opts)


@pytest.fixture
async def adapter(fake_gcp: FakeGCP, clocks: Clocks) -> AsyncIterator[GcpAdapter]:
    a = make(fake_gcp, clocks)
    yield a
    await a.close()


def by_key(offers: Iterable[Offer]) -> dict[PoolKey, Offer]:
    return {o.pool: o for o in offers}


def pool(itype: str, market: Market = OD, zone: str = ZONE) -> PoolKey:
    return PoolKey("gcp", zone.rsplit("-", 1)[0], zone, itype, market)


def expected(fake: FakeGCP, zone: str, series: str, machine: str, accel: str, gpus: int,
             market: str) -> float:
    """What the fake's catalog says one instance costs: its vCPU, RAM and GPU SKUs."""
    region = zone.rsplit("-", 1)[0]
    vcpus, mib = fake.machine(zone, machine)
    core = fake.unit_price(region, market, "core", series)
    ram = fake.unit_price(region, market, "ram", series)
    gpu = fake.unit_price(region, market, "gpu", accel)
    assert core is not None and ram is not None and gpu is not None
    return core * vcpus + ram * mib / 1024 + gpu * gpus


async def test_poll_maps_machine_types_n1_shapes_and_prices(fake_gcp: FakeGCP, clocks: Clocks,
                                                            adapter: GcpAdapter) -> None:
    offers = await adapter.poll(REGION)
    offer = by_key(offers)
    assert len(offer) == len(offers) and all(o.pool.cloud == "gcp" for o in offers)
    assert {o.pool.zone for o in offers} == set(fake_gcp.zones(REGION))

    a2 = [o for o in offers if o.pool.instance_type == "a2-highgpu-1g" and o.pool.market is OD]
    assert {o.pool.zone for o in a2} == {f"{REGION}-{z}" for z in "abcf"}
    o = offer[pool("a2-highgpu-1g")]
    assert (o.gpu, o.gpus, o.gpu_memory_gb, o.vcpus, o.memory_gb, o.gpu_known) == (
        "A100-40GB", 1, 40, 12, 85.0, True)
    # The snapshot's host + accelerator rows: 0.73948 + 2.93391 on demand,
    # 0.29576 + 1.1472 Spot; the fake splits the host price into vCPU and RAM SKUs.
    assert o.price_per_hour == pytest.approx(
        expected(fake_gcp, ZONE, "a2", "a2-highgpu-1g", "nvidia-tesla-a100", 1, "on_demand"),
        rel=1e-12)
    assert o.price_per_hour == pytest.approx(3.67339, abs=2e-5)
    assert offer[pool("a2-highgpu-1g", SPOT)].price_per_hour == pytest.approx(1.44296, abs=2e-5)
    assert o.observed_at == clocks.now  # the time the catalog was read
    assert o.availability is None and o.interruption_rate is None and o.capacity is None

    assert (offer[pool("a3-megagpu-8g")].gpu, offer[pool("a3-megagpu-8g")].gpus) == (
        "H100-80GB", 8)
    assert offer[pool("a3-ultragpu-8g", SPOT, zone=f"{REGION}-b")].gpu == "H200-141GB"
    g2 = offer[pool("g2-standard-24", SPOT)]
    assert (g2.gpu, g2.gpus) == ("L4", 2)
    assert g2.price_per_hour == pytest.approx(0.35242 + 0.4462, abs=2e-5)

    # N1 + attachable GPUs: 1/2/4 T4 (a zone's maximum is 4), up to 8 V100, 8 vCPUs each.
    n1 = {o.pool.instance_type for o in offers if o.pool.zone == ZONE and "+" in
          o.pool.instance_type}
    assert {"n1-standard-8+nvidia-tesla-t4x1", "n1-standard-16+nvidia-tesla-t4x2",
            "n1-standard-32+nvidia-tesla-t4x4", "n1-standard-64+nvidia-tesla-v100x8"} <= n1
    assert "n1-standard-64+nvidia-tesla-t4x8" not in n1
    v100 = offer[pool("n1-standard-64+nvidia-tesla-v100x8")]
    assert (v100.gpu, v100.gpus, v100.vcpus, v100.memory_gb) == ("V100-16GB", 8, 64, 240.0)
    assert v100.price_per_hour == pytest.approx(
        expected(fake_gcp, ZONE, "n1", "n1-standard-64", "nvidia-tesla-v100", 8, "on_demand"),
        rel=1e-12)
    t4 = offer[pool("n1-standard-8+nvidia-tesla-t4x1", SPOT)]
    assert t4.price_per_hour == pytest.approx(
        expected(fake_gcp, ZONE, "n1", "n1-standard-8", "nvidia-tesla-t4", 1, "spot"), rel=1e-12)
    p100 = offer[pool("n1-standard-8+nvidia-tesla-p100x1", zone=f"{REGION}-c")]
    assert (p100.gpu, p100.gpu_known, p100.gpu_memory_gb) == ("P100", True, 16)

    # Not offered: virtual workstations, an obsolete GPU, machines without GPUs.
    names = {o.pool.instance_type for o in offers}
    assert not any("vws" in n or "k80" in n or n.startswith(("e2-", "n2-", "c2-"))
                   or n in ("n1-standard-8", "n1-highmem-8") for n in names)
    # A4 is sold reserved, flex-start or Spot, not on demand; the snapshot has no Spot
    # B200 price in us-central1: listed, unpriced.
    a4 = by_key(o for o in offers if o.pool.instance_type == "a4-highgpu-8g")
    assert pool("a4-highgpu-8g", zone=f"{REGION}-b") not in a4
    a4_spot = a4[pool("a4-highgpu-8g", SPOT, zone=f"{REGION}-b")]
    assert (a4_spot.gpu, a4_spot.gpus, a4_spot.price_per_hour) == ("B200", 8, None)


async def test_a3_shapes_are_priced_and_offered_as_google_sells_them(
        fake_gcp: FakeGCP, adapter: GcpAdapter) -> None:
    offer = by_key(await adapter.poll(REGION))
    # A3 Mega by its "A3Plus Instance" SKUs, + its 6,000 GiB local SSD (per GiB-month SKU)
    od_ssd = fake_gcp.unit_price(REGION, "on_demand", "lssd", LOCAL_SSD)
    spot_ssd = fake_gcp.unit_price(REGION, "spot", "lssd", LOCAL_SSD)
    assert od_ssd is not None and spot_ssd is not None
    mega = offer[pool("a3-megagpu-8g")]
    assert mega.price_per_hour == pytest.approx(
        208 * 0.026924 + 1872 * 0.002344 + 82.75421 + 6000 * od_ssd / 730, rel=1e-9)
    assert offer[pool("a3-megagpu-8g", SPOT)].price_per_hour == pytest.approx(
        expected(fake_gcp, ZONE, "a3plus", "a3-megagpu-8g", "nvidia-h100-mega-80gb", 8, "spot")
        + 6000 * spot_ssd / 730, rel=1e-9)
    # A3 High with 8 GPUs: the "A3 Instance" SKUs and 6,000 GiB of local SSD
    assert offer[pool("a3-highgpu-8g")].price_per_hour == pytest.approx(
        expected(fake_gcp, ZONE, "a3", "a3-highgpu-8g", "nvidia-h100-80gb", 8, "on_demand")
        + 6000 * od_ssd / 730, rel=1e-9)
    # A3 High with fewer than 8 GPUs and A3 Ultra: Spot only (or reserved, flex-start)
    for itype, zone in (("a3-highgpu-1g", ZONE), ("a3-highgpu-4g", ZONE),
                        ("a3-ultragpu-8g", f"{REGION}-b")):
        assert pool(itype, zone=zone) not in offer, itype
    assert offer[pool("a3-highgpu-1g", SPOT)].price_per_hour == pytest.approx(
        expected(fake_gcp, ZONE, "a3", "a3-highgpu-1g", "nvidia-h100-80gb", 1, "spot")
        + 750 * spot_ssd / 730, rel=1e-9)
    ultra = offer[pool("a3-ultragpu-8g", SPOT, zone=f"{REGION}-b")]
    assert ultra.price_per_hour == pytest.approx(
        expected(fake_gcp, f"{REGION}-b", "a3ultra", "a3-ultragpu-8g", "nvidia-h200-141gb", 8,
                 "spot") + 12000 * spot_ssd / 730, rel=1e-9)


def catalog_price(fake: FakeGCP, o: Offer) -> float | None:
    """What the fake's catalog says the offer's VM costs (None: a part is not in it)."""
    machine, _, count = pricing.split_instance_type(o.pool.instance_type)
    series = sku_series(machine)
    accel = o.quota_group.split(":")[2]  # gcp:<region>:<accelerator type>:<market>
    market = "spot" if o.pool.market is SPOT else "on_demand"
    gpu = fake.unit_price(o.pool.region, market, "gpu", accel)
    if series == "a4":  # priced by its GPU slices alone
        return None if gpu is None else gpu * o.gpus
    vcpus, mib = fake.machine(o.pool.zone, machine)
    core = fake.unit_price(o.pool.region, market, "core", series)
    ram = fake.unit_price(o.pool.region, market, "ram", series)
    ssd = fake.unit_price(o.pool.region, market, "lssd", LOCAL_SSD)
    if core is None or ram is None or gpu is None or ssd is None:
        return None
    return (core * vcpus + ram * mib / 1024 + gpu * (count or o.gpus)
            + ssd * LOCAL_SSD_GIB.get(machine, 0) / 730)


async def test_every_price_is_read_whatever_the_catalog_calls_it(fake_gcp: FakeGCP,
                                                                clocks: Clocks) -> None:
    # The fake words its SKUs as the real catalog does, every variant mixed in: most Spot
    # GPU SKUs "... GPU attached to Spot Preemptible VMs", a few "Spot Preemptible Nvidia
    # ...", B200 Spot SKUs tagged OnDemand, "H200 141GB GPU", "NVIDIA L4 GPU" ...
    skus = fake_gcp.skus()
    gpu_skus = [(s["description"], s["category"]["usageType"]) for s in skus
                if s["category"]["resourceGroup"] == "GPU"]
    assert any(" attached to Spot Preemptible VMs running in " in d and u == "Preemptible"
               for d, u in gpu_skus)
    assert any(d.startswith("Spot Preemptible Nvidia ") and u == "Preemptible"
               for d, u in gpu_skus)
    assert any(d.startswith("Spot Preemptible A4 Nvidia B200 (1 gpu slice)") and
               u == "OnDemand" for d, u in gpu_skus)
    assert any(d.startswith("H200 141GB GPU") for d, _ in gpu_skus)
    assert any(d.startswith("NVIDIA L4 GPU") for d, _ in gpu_skus)
    n1_spot_cores = {s["description"].split(" N1 ")[0] for s in skus
                     if s["category"]["usageType"] == "Preemptible"
                     and " N1 Predefined Instance Core " in s["description"]}
    assert n1_spot_cores == {"Preemptible", "Spot Preemptible"}
    regions = ["us-central1", "us-east4", "europe-west4", "asia-southeast1"]
    a = make(fake_gcp, clocks, regions=regions)
    try:
        offers = [o for r in regions for o in await a.poll(r)]
    finally:
        await a.close()
    spot_gpus = set()
    on_demand = {o.pool.instance_type for o in offers if o.pool.market is OD}
    assert not on_demand & {"a4-highgpu-8g", "a3-ultragpu-8g", "a3-highgpu-1g",
                            "a3-highgpu-2g", "a3-highgpu-4g"}
    assert {"a3-highgpu-8g", "a3-megagpu-8g", "a2-ultragpu-8g"} <= on_demand
    for o in offers:  # every price is the catalog's, never a decoy's
        expected = catalog_price(fake_gcp, o)
        if expected is None:  # a part the catalog does not price here: the offer has none
            assert o.price_per_hour is None, o.pool
            continue
        assert o.price_per_hour == pytest.approx(expected, rel=1e-9), o.pool
        if o.pool.market is SPOT and o.price_per_hour is not None:
            spot_gpus.add((o.pool.region, o.gpu))
    # Spot prices of every GPU model in every region the snapshot prices them in
    assert {g for _, g in spot_gpus} >= {"A100-40GB", "A100-80GB", "H100-80GB", "H200-141GB",
                                         "L4", "T4", "V100-16GB", "B200"}
    assert {r for r, _ in spot_gpus} == set(regions)


async def test_lists_are_paged_and_the_catalog_is_read_once_for_all_regions(
        fake_gcp: FakeGCP, adapter: GcpAdapter) -> None:
    a, b = await asyncio.gather(adapter.poll(REGION), adapter.poll("europe-west4"))
    assert a and b
    pages = math.ceil(len(fake_gcp.skus()) / fake_gcp.page_size["skus.list"])
    assert pages > 3
    assert fake_gcp.call_count("skus.list") == pages  # both regions share one read
    assert fake_gcp.call_count("projects.get") == 1
    assert fake_gcp.call_count("machineTypes.list", ZONE) > 1
    assert fake_gcp.call_count("acceleratorTypes.list", ZONE) > 1
    assert fake_gcp.call_count("regions.get") == 2


async def test_steady_state_poll_asks_only_for_quotas(fake_gcp: FakeGCP, clocks: Clocks,
                                                      adapter: GcpAdapter) -> None:
    await adapter.poll(REGION)
    first = sum(fake_gcp.calls.values())
    fake_gcp.set_quota(REGION, "NVIDIA_A100_GPUS", 16, usage=13)
    clocks.advance(60)
    fake_gcp.reset_calls()
    offers = by_key(await adapter.poll(REGION))
    assert dict(fake_gcp.calls) == {("regions.get", REGION): 1, ("projects.get", "global"): 1}
    assert offers[pool("a2-highgpu-1g")].quota_headroom == 3
    clocks.advance(10)  # project quotas are shared for 30 s
    fake_gcp.reset_calls()
    await adapter.poll(REGION)
    assert dict(fake_gcp.calls) == {("regions.get", REGION): 1}
    assert first > 20


async def test_quota_headroom_is_the_smaller_of_regional_and_global(
        fake_gcp: FakeGCP, adapter: GcpAdapter) -> None:
    fake_gcp.set_quota(REGION, "NVIDIA_A100_GPUS", 16, usage=12)
    fake_gcp.set_quota(REGION, "PREEMPTIBLE_NVIDIA_A100_GPUS", 0)
    fake_gcp.set_quota(REGION, "PREEMPTIBLE_NVIDIA_L4_GPUS", 32, usage=2)
    fake_gcp.set_project_quota("GPUS_ALL_REGIONS", 64, usage=40)
    offers = by_key(await adapter.poll(REGION))
    assert offers[pool("a2-highgpu-1g")].quota_headroom == 4
    assert offers[pool("a2-highgpu-1g", SPOT)].quota_headroom == 4  # falls back to on-demand
    assert offers[pool("g2-standard-4")].quota_headroom == 16
    assert offers[pool("g2-standard-4", SPOT)].quota_headroom == 24  # 30 left, 24 globally


async def test_prices_refresh_in_the_background_and_keep_the_last_good_copy(
        fake_gcp: FakeGCP, clocks: Clocks, adapter: GcpAdapter) -> None:
    key = pool("a2-highgpu-1g")
    before = by_key(await adapter.poll(REGION))[key]
    first_read = clocks.now
    old = fake_gcp.unit_price(REGION, "on_demand", "gpu", "nvidia-tesla-a100")
    assert old is not None
    fake_gcp.set_unit_price(REGION, "on_demand", "gpu", "nvidia-tesla-a100", 3.0)
    clocks.advance(6 * 3600 + 1)
    arrived = fake_gcp.hold("skus.list")
    during = by_key(await adapter.poll(REGION))[key]  # does not wait for the catalog
    assert await asyncio.to_thread(arrived.wait, 10)
    assert (during.price_per_hour, during.observed_at) == (before.price_per_hour, first_read)
    fake_gcp.release("skus.list")
    await adapter.refresh_prices()  # joins the read in flight
    after = by_key(await adapter.poll(REGION))[key]
    assert before.price_per_hour is not None
    assert after.price_per_hour == pytest.approx(before.price_per_hour + 3.0 - old, abs=1e-9)
    assert after.observed_at == clocks.now

    fake_gcp.fail("skus.list", 503, times=None)
    clocks.advance(6 * 3600 + 1)
    await adapter.poll(REGION)
    await adapter.refresh_prices()
    kept = by_key(await adapter.poll(REGION))[key]
    assert (kept.price_per_hour, kept.observed_at) == (after.price_per_hour, after.observed_at)


async def test_without_any_catalog_copy_the_poll_fails_typed(
        fake_gcp: FakeGCP, clocks: Clocks, adapter: GcpAdapter) -> None:
    # A catalog that cannot be read never yields offers without prices: the first poll
    # fails with the read's own error (403: permanent, not retried) ...
    fake_gcp.fail("skus.list", 403, times=None)
    with pytest.raises(AuthFailed, match="Billing Catalog") as err:
        await adapter.poll(REGION)
    assert err.value.region == REGION
    assert fake_gcp.call_count("skus.list") == 1
    # ... and so does one that stays down (503: retried first, page by page).
    fake_gcp.clear_faults()
    fake_gcp.fail("skus.list", 503, times=None)
    clocks.advance(60)
    with pytest.raises(CloudUnavailable, match="Billing Catalog"):
        await adapter.poll(REGION)
    assert fake_gcp.call_count("skus.list") == 1 + RetryPolicy.ATTEMPTS
    fake_gcp.clear_faults()
    clocks.advance(60)
    offers = await adapter.poll(REGION)  # a failed read is tried again at the next poll
    assert all(o.price_per_hour is not None for o in offers
               if o.pool.instance_type != "a4-highgpu-8g")


async def test_a_failed_catalog_page_is_asked_again_not_the_whole_list(
        fake_gcp: FakeGCP, adapter: GcpAdapter) -> None:
    pages = math.ceil(len(fake_gcp.skus()) / fake_gcp.page_size["skus.list"])
    fake_gcp.fail("skus.list", 503, times=2)
    offers = by_key(await adapter.poll(REGION))
    assert offers[pool("a2-highgpu-1g", SPOT)].price_per_hour is not None
    assert fake_gcp.call_count("skus.list") == pages + 2


async def test_a_catalog_without_any_vm_price_is_not_a_copy(fake_gcp: FakeGCP,
                                                             clocks: Clocks) -> None:
    a = make(fake_gcp, clocks, retry=RetryPolicy(attempts=1))
    try:
        for key in fake_gcp.price_keys():
            fake_gcp.set_unit_price(*key, usd=None)
        with pytest.raises(CloudUnavailable, match="none prices a vCPU"):
            await a.poll(REGION)
    finally:
        await a.close()


async def test_a_slow_first_catalog_read_fails_the_poll_and_goes_on(fake_gcp: FakeGCP,
                                                                     clocks: Clocks) -> None:
    a = make(fake_gcp, clocks, refresh=Refresh(first_catalog_wait=0.2))
    try:
        fake_gcp.hold("skus.list")
        with pytest.raises(CloudUnavailable, match="still going"):
            await a.poll(REGION)
        fake_gcp.release("skus.list")
        await a.refresh_prices()  # the same read, still going
        assert fake_gcp.call_count("skus.list") == math.ceil(
            len(fake_gcp.skus()) / fake_gcp.page_size["skus.list"])
        offers = await a.poll(REGION)
        assert by_key(offers)[pool("g2-standard-4")].price_per_hour is not None
    finally:
        await a.close()


async def test_optional_project_quota_keeps_the_last_good_copy(
        fake_gcp: FakeGCP, clocks: Clocks, adapter: GcpAdapter) -> None:
    fake_gcp.set_project_quota("GPUS_ALL_REGIONS", 64, usage=62)
    assert by_key(await adapter.poll(REGION))[pool("a2-highgpu-1g")].quota_headroom == 2
    fake_gcp.fail("projects.get", 503, times=None)
    clocks.advance(60)
    assert by_key(await adapter.poll(REGION))[pool("a2-highgpu-1g")].quota_headroom == 2
    assert fake_gcp.call_count("projects.get") == 1 + RetryPolicy.ATTEMPTS  # then given up


async def test_throttling_is_retried_unless_asked_to_wait_longer(
        fake_gcp: FakeGCP, adapter: GcpAdapter) -> None:
    fake_gcp.fail("regions.get", 429, times=2)
    assert await adapter.poll(REGION)
    assert fake_gcp.call_count("regions.get", REGION) == 3
    fake_gcp.reset_calls()
    fake_gcp.fail("regions.get", 429, times=1, retry_after=30)
    with pytest.raises(RateLimited) as err:
        await adapter.poll(REGION)
    assert err.value.retry_after == 30.0 and err.value.region == REGION
    assert fake_gcp.call_count("regions.get") == 1  # the poller waits, not a thread


async def test_an_api_that_stays_down_fails_the_poll_typed(fake_gcp: FakeGCP,
                                                           adapter: GcpAdapter) -> None:
    fake_gcp.fail("machineTypes.list", 503, times=None, where=ZONE)
    with pytest.raises(CloudUnavailable):
        await adapter.poll(REGION)
    assert fake_gcp.call_count("machineTypes.list", ZONE) == RetryPolicy.ATTEMPTS
    fake_gcp.clear_faults()
    fake_gcp.reset_calls()
    fake_gcp.fail("regions.get", 403, times=None)
    with pytest.raises(AuthFailed):
        await adapter.poll("europe-west4")
    assert fake_gcp.call_count("regions.get") == 1  # never retried


async def test_a_region_that_does_not_exist_is_a_config_error(fake_gcp: FakeGCP,
                                                              clocks: Clocks) -> None:
    a = make(fake_gcp, clocks, regions=["mars-north1"])
    try:
        with pytest.raises(InvalidConfig, match="mars-north1"):
            await a.poll("mars-north1")
        with pytest.raises(InvalidConfig, match="not configured"):
            await a.poll(REGION)
    finally:
        await a.close()


async def test_stockouts_lower_availability_then_recover(fake_gcp: FakeGCP, clocks: Clocks,
                                                         adapter: GcpAdapter) -> None:
    spot = pool("a2-highgpu-1g", SPOT)
    await adapter.poll(REGION)
    assert not adapter.note_launch_failure(spot, "QUOTA_EXCEEDED: Quota 'NVIDIA_A100_GPUS'")
    assert adapter.note_launch_failure(
        spot, "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS: The zone 'projects/p/zones/"
              "us-central1-a' does not have enough resources available")
    adapter.note_stockout(PoolKey("aws", "us-east-1", "us-east-1a", "p5.48xlarge", SPOT))
    offers = by_key(await adapter.poll(REGION))
    assert offers[spot].availability == 0.0
    others = [o.availability for k, o in offers.items() if k != spot]
    assert others and all(a is None for a in others)
    clocks.advance(600 + 1500)
    assert by_key(await adapter.poll(REGION))[spot].availability == 0.5
    clocks.advance(1500)
    assert by_key(await adapter.poll(REGION))[spot].availability is None


# --- credentials ---------------------------------------------------------------------

async def test_anonymous_mode_sends_no_credentials(fake_gcp: FakeGCP, adapter: GcpAdapter
                                                   ) -> None:
    assert await adapter.poll(REGION)
    assert fake_gcp.authorizations and set(fake_gcp.authorizations) == {""}
    fake_gcp.require_auth = True
    with pytest.raises(AuthFailed, match="cannot be refreshed"):
        await adapter.poll(REGION)


async def test_default_credentials_supply_the_token_and_the_project(
        fake_gcp: FakeGCP, clocks: Clocks, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    key = fake_gcp.service_account_file(tmp_path / "sa.json", project_id=fake_gcp.project)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
    fake_gcp.require_auth = True
    a = make(fake_gcp, clocks, project=None, anonymous=False)
    try:
        assert await a.poll(REGION)
        assert a.sdk.project == fake_gcp.project
        assert all(h.startswith("Bearer ") for h in fake_gcp.authorizations)
    finally:
        await a.close()


async def test_no_project_anywhere_names_the_config_key(
        fake_gcp: FakeGCP, clocks: Clocks, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    key = fake_gcp.service_account_file(tmp_path / "sa.json", project_id=None)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
    a = make(fake_gcp, clocks, project=None, anonymous=False)
    try:
        with pytest.raises(InvalidConfig, match=r"clouds\.gcp\.project"):
            await a.poll(REGION)
        assert not fake_gcp.calls
    finally:
        await a.close()


async def test_no_credentials_is_one_clear_auth_error(
        fake_gcp: FakeGCP, clocks: Clocks, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    key = tmp_path / "sa.json"
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
    a = make(fake_gcp, clocks, anonymous=False)
    try:
        with pytest.raises(AuthFailed, match=r"google\.auth\.default"):
            await a.poll(REGION)
        assert not fake_gcp.calls
        # The chain is not searched again on every call (a metadata-server probe takes
        # seconds): the failure stands for a minute.
        fake_gcp.service_account_file(key, project_id=fake_gcp.project)
        with pytest.raises(AuthFailed, match=r"google\.auth\.default"):
            await a.poll(REGION)
    finally:
        await a.close()


async def test_the_call_timeout_comes_from_the_config(fake_gcp: FakeGCP) -> None:
    cfg = parse_config(yaml.safe_dump({"clouds": {"gcp": {
        "project": fake_gcp.project, "regions": [REGION], "endpoint": fake_gcp.url,
        "anonymous": True, "call_timeout_seconds": 0.2}}}))
    adapters, _ = build_adapters(cfg)
    fake_gcp.latency = (0.6, 0.6)
    try:
        with poll_deadline(1.5), pytest.raises(CloudUnavailable, match="Timeout"):
            await adapters[0].poll(REGION)
    finally:
        await adapters[0].close()
    assert fake_gcp.call_count("regions.get") >= 2  # timed out, then asked again


def test_config_problems_are_named() -> None:
    with pytest.raises(InvalidConfig, match=r"clouds\.gcp\.project"):
        from_config(GcpConfig(regions=[REGION], endpoint="http://127.0.0.1:9", anonymous=True))
    with pytest.raises(InvalidConfig, match=r"clouds\.gcp\.regions"):
        from_config(GcpConfig(project="p"))


# --- teardown and the command line ---------------------------------------------------

async def test_close_during_a_catalog_read(fake_gcp: FakeGCP, clocks: Clocks) -> None:
    a = make(fake_gcp, clocks)
    arrived = fake_gcp.hold("skus.list")
    polling = asyncio.create_task(a.poll(REGION))
    assert await asyncio.to_thread(arrived.wait, 10)
    polling.cancel()  # as the poller's timeout would
    with pytest.raises(asyncio.CancelledError):
        await polling
    closing = asyncio.create_task(a.close())  # waits for the page on the wire ...
    fake_gcp.release("skus.list")
    await closing
    # ... and starts no next page: one SKU page was read, and no thread is left.
    assert fake_gcp.call_count("skus.list") == 1
    assert not [t for t in threading.enumerate() if t.name.startswith("gcp")]
    with pytest.raises(AdapterError, match="closed"):
        a.sdk.client("regions")


async def test_the_daemon_builds_it_from_its_config(fake_gcp: FakeGCP) -> None:
    cfg = parse_config(yaml.safe_dump({"clouds": {"gcp": {
        "project": fake_gcp.project, "regions": [REGION], "endpoint": fake_gcp.url,
        "anonymous": True}}}))
    adapters, problems = build_adapters(cfg)
    assert not problems and [a.name for a in adapters] == ["gcp"]
    try:
        offers = await adapters[0].poll(REGION)
    finally:
        await adapters[0].close()
    types = {o.pool.instance_type for o in offers}
    assert {"a2-highgpu-1g", "a3-highgpu-8g", "g2-standard-4",
            "n1-standard-8+nvidia-tesla-t4x1"} <= types
    assert set(fake_gcp.authorizations) == {""}


# --- random faults -----------------------------------------------------------------------

FAULTS = [pytest.param((kind,), 0.5, id=f"{kind}-50%") for kind in CHAOS_KINDS] + [
    pytest.param(CHAOS_KINDS, 0.3, id="mixed-30%")]
# A "timeout" fault answers after HANG seconds; a call gives up after CALL_TIMEOUT.
HANG, CALL_TIMEOUT = 1.0, 0.5


def api_pages(fake: FakeGCP) -> None:
    """The largest pages the adapter asks for, as the real APIs serve them (one page a
    list: a test with timeouts stays short)."""
    fake.page_size.update({"machineTypes.list": 500, "acceleratorTypes.list": 500,
                           "skus.list": 5000})


def comparable(rows: Iterable[dict[str, Any]]) -> list[str]:
    """Offers as JSON, without `observed_at` (the time the catalog was read), sorted."""
    return sorted(json.dumps({k: v for k, v in row.items() if k != "observed_at"},
                             sort_keys=True) for row in rows)


async def fault_free(fake: FakeGCP, clocks: Clocks) -> list[str]:
    a = make(fake, clocks, regions=[REGION])
    try:
        return comparable(o.to_json() for o in await a.poll(REGION))
    finally:
        await a.close()


@pytest.mark.parametrize(("kinds", "rate"), FAULTS)
async def test_random_faults_heal_within_the_poll(fake_gcp: FakeGCP, clocks: Clocks,
                                                 kinds: tuple[str, ...], rate: float) -> None:
    api_pages(fake_gcp)
    expected = await fault_free(fake_gcp, clocks)
    fake_gcp.reset_calls()
    fake_gcp.chaos = Chaos(rate=rate, kinds=kinds, hang_seconds=HANG, seed=15)
    # More attempts than the default: at a 50 % fault rate one call in 4,096 would meet 12
    # faults in a row, and this test is about healing, not about those odds. Short waits
    # (the Billing Catalog's RetryInfo of 1 s capped to 0.25 s) keep it quick.
    a = make(fake_gcp, clocks, regions=[REGION], call_timeout=CALL_TIMEOUT,
             retry=RetryPolicy(attempts=20, max_backoff=0.25, long_hint="cap"))
    try:
        with poll_deadline(60):
            got = comparable(o.to_json() for o in await a.poll(REGION))
    finally:
        await a.close()
    assert got == expected
    assert sum(fake_gcp.faulted.values()) > 0 and set(fake_gcp.faulted) <= set(kinds)
    assert sum(fake_gcp.calls.values()) > len(fake_gcp.calls)  # some calls asked again


@pytest.mark.slow
@pytest.mark.parametrize(("kinds", "rate"), FAULTS)
async def test_offers_command_with_random_faults_lists_the_fault_free_offers(
        fake_gcp: FakeGCP, clocks: Clocks, tmp_path: Path, kinds: tuple[str, ...],
        rate: float) -> None:
    api_pages(fake_gcp)
    expected = await fault_free(fake_gcp, clocks)
    cfg = tmp_path / "gcp.yaml"
    cfg.write_text(yaml.safe_dump({"poll": {"timeout_seconds": 60}, "clouds": {"gcp": {
        "project": fake_gcp.project, "regions": [REGION], "endpoint": fake_gcp.url,
        "anonymous": True, "call_timeout_seconds": CALL_TIMEOUT}}}))
    fake_gcp.chaos = Chaos(rate=rate, kinds=kinds, hang_seconds=HANG, seed=15)
    # The command retries as configured (the default attempts and waits); no call meets
    # more than 2 faults in a row, so a pass neither hangs on the odds of many in a row nor waits
    # through the longest backoffs (see fake_gcp).
    fake_gcp.spare_every = 3
    r = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "broker.cli", "offers", "--config", str(cfg),
                         "--cloud", "gcp", "--format", "json"],
        capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "gpubroker:" not in r.stderr, r.stderr
    assert comparable(json.loads(line) for line in r.stdout.splitlines()) == expected
    assert sum(fake_gcp.faulted.values()) > 0 and set(fake_gcp.faulted) <= set(kinds)
