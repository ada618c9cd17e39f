"""How the Azure adapter reads Azure's answers: GPU models from size names, SKUs and
their restrictions, Retail Prices items, eviction-rate bands, quotas."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from adapters.azure import pricing
from adapters.azure.pricing import GpuSpec

# --- GPU models from size names: one row per mapping ---------------------------------

@pytest.mark.parametrize(("size", "capability", "want"), [
    ("Standard_ND96asr_v4", 8, ("A100-40GB", 8, 40, True)),
    ("Standard_ND96amsr_A100_v4", 8, ("A100-80GB", 8, 80, True)),
    ("Standard_NC24ads_A100_v4", 1, ("A100-80GB", 1, 80, True)),
    ("Standard_NC48ads_A100_v4", 2, ("A100-80GB", 2, 80, True)),
    ("Standard_NC96ads_A100_v4", 4, ("A100-80GB", 4, 80, True)),
    ("Standard_ND96isr_H100_v5", 8, ("H100-80GB", 8, 80, True)),
    # H100 NVL (94 GB) is offered as H100-80GB, its memory told as it is
    ("Standard_NC40ads_H100_v5", 1, ("H100-80GB", 1, 94, True)),
    ("Standard_NC80adis_H100_v5", 2, ("H100-80GB", 2, 94, True)),
    ("Standard_NCC40ads_H100_v5", 1, ("H100-80GB", 1, 94, True)),
    ("Standard_ND96isr_H200_v5", 8, ("H200-141GB", 8, 141, True)),
    ("Standard_ND96isr_MI300X_v5", 8, ("MI300X", 8, 192, True)),
    ("Standard_NC4as_T4_v3", 1, ("T4", 1, 16, True)),
    ("Standard_NC8as_T4_v3", 1, ("T4", 1, 16, True)),
    ("Standard_NC16as_T4_v3", 1, ("T4", 1, 16, True)),
    ("Standard_NC64as_T4_v3", 4, ("T4", 4, 16, True)),
    ("Standard_NC6s_v3", 1, ("V100-16GB", 1, 16, True)),
    ("Standard_NC12s_v3", 2, ("V100-16GB", 2, 16, True)),
    ("Standard_NC24s_v3", 4, ("V100-16GB", 4, 16, True)),
    ("Standard_NC24rs_v3", 4, ("V100-16GB", 4, 16, True)),
    ("Standard_ND40rs_v2", 8, ("V100-32GB", 8, 32, True)),
    ("Standard_NV36ads_A10_v5", 1, ("A10", 1, 24, True)),
    ("Standard_NV36adms_A10_v5", 1, ("A10", 1, 24, True)),
    ("Standard_NV72ads_A10_v5", 2, ("A10", 2, 24, True)),
    ("Standard_NC32ads_A10_v4", 1, ("A10", 1, 24, True)),
    # models the canonical table does not know: kept, flagged
    ("Standard_NC6", 1, ("K80", 1, 12, False)),
    ("Standard_NC24r_Promo", 4, ("K80", 4, 12, False)),
    ("Standard_NV12", 2, ("M60", 2, 8, False)),
    ("Standard_NV48s_v3", 4, ("M60", 4, 8, False)),
    ("Standard_NC12s_v2", 2, ("P100", 2, 16, True)),
    ("Standard_ND24rs", 4, ("P40", 4, 24, False)),
    ("Standard_NV32as_v4", 1, ("MI25", 1, 16, False)),
])
def test_size_names_map_to_gpu_models(size: str, capability: int,
                                      want: tuple[str, int, float, bool]) -> None:
    spec = pricing.gpu_of(size, capability)
    assert spec is not None
    assert (spec.model, spec.count, spec.memory_gb, spec.known) == want
    assert spec.name_count == capability  # the name agrees with the capability


@pytest.mark.parametrize("size", [
    "Standard_NV6ads_A10_v5", "Standard_NV12ads_A10_v5", "Standard_NV18ads_A10_v5",
    "Standard_NC8ads_A10_v4", "Standard_NC16ads_A10_v4", "Standard_NV4as_v4",
    "Standard_NV16as_v4", "Standard_NG8ads_V620_v1",
])
def test_fractional_gpu_sizes_are_left_out_even_if_arm_says_one_gpu(size: str) -> None:
    assert pricing.gpu_of(size, 1) is None
    assert pricing.gpu_of(size, None) is None


def test_capability_wins_over_the_name_and_the_name_is_kept_for_the_warning() -> None:
    # The snapshot lists ND96isr_H100_v5 with 12 GPUs; if ARM ever said so, ARM wins.
    assert pricing.gpu_of("Standard_ND96isr_H100_v5", 12) == GpuSpec(
        "H100-80GB", 12, 80, True, 8)
    # Without the capability, the name's count.
    assert pricing.gpu_of("Standard_NC48ads_A100_v4", None) == GpuSpec(
        "A100-80GB", 2, 80, True, 2)


def test_unknown_gpu_sizes_are_kept_under_the_accelerator_name_flagged() -> None:
    assert pricing.gpu_of("Standard_NC128lds_xl_RTXPRO6000BSE_v6", 2) == GpuSpec(
        "RTXPRO6000BSE", 2, None, False, None)
    # A known series at a size the table does not list: the capability decides.
    assert pricing.gpu_of("Standard_NC192ads_A100_v4", 8) == GpuSpec(
        "A100-80GB", 8, 80, True, None)
    assert pricing.gpu_of("Standard_NC192ads_A100_v4", None) is None
    # Not a GPU size at all.
    assert pricing.gpu_of("Standard_D4s_v5", None) is None
    assert pricing.gpu_of("Standard_E8s_v5", 0) is None


# --- SKUs and restrictions -------------------------------------------------------------

def sku(name: str = "Standard_NC24ads_A100_v4", *, zones: tuple[str, ...] = ("3", "1", "2"),
        gpus: str | None = "1", low_priority: str = "True",
        restrictions: list[dict[str, Any]] | None = None,
        resource_type: str = "virtualMachines") -> dict[str, Any]:
    caps = [{"name": "vCPUs", "value": "24"}, {"name": "MemoryGB", "value": "220"},
            {"name": "LowPriorityCapable", "value": low_priority}]
    if gpus is not None:
        caps.append({"name": "GPUs", "value": gpus})
    return {"resourceType": resource_type, "name": name, "tier": "Standard",
            "family": "StandardNCADSA100v4Family", "locations": ["eastus"],
            "locationInfo": [{"location": "eastus", "zones": list(zones), "zoneDetails": []}],
            "capabilities": caps, "restrictions": restrictions or []}


def restriction(kind: str, zones: list[str] | None = None, location: str = "eastus",
                reason: str = "NotAvailableForSubscription") -> dict[str, Any]:
    info: dict[str, Any] = {"locations": [location]}
    if zones is not None:
        info["zones"] = zones
    return {"type": kind, "values": [location], "restrictionInfo": info,
            "reasonCode": reason}


def test_a_gpu_sku_becomes_a_size_with_its_zones() -> None:
    size = pricing.vm_size(sku(), "eastus")
    assert size is not None
    assert (size.name, size.family, size.vcpus, size.memory_gb, size.spot, size.zones) == (
        "Standard_NC24ads_A100_v4", "StandardNCADSA100v4Family", 24, 220.0, True,
        ("1", "2", "3"))
    assert size.gpu.model == "A100-80GB"


@pytest.mark.parametrize(("raw", "want_zones"), [
    (sku(restrictions=[restriction("Location")]), None),
    (sku(restrictions=[restriction("Location", reason="QuotaId")]), None),
    (sku(restrictions=[restriction("Zone", ["1", "3"])]), ("2",)),
    (sku(restrictions=[restriction("Zone", ["1", "2", "3"])]), None),
    # a restriction elsewhere does not count here
    (sku(restrictions=[restriction("Location", location="westus")]), ("1", "2", "3")),
    (sku(zones=()), ()),  # offered without zones: one regional pool
    (sku(low_priority="False"), ("1", "2", "3")),
])
def test_restrictions_drop_sizes_and_zones(raw: dict[str, Any],
                                           want_zones: tuple[str, ...] | None) -> None:
    size = pricing.vm_size(raw, "eastus")
    assert (None if size is None else size.zones) == want_zones


def test_not_vms_and_not_gpus_are_not_sizes() -> None:
    assert pricing.vm_size(sku(resource_type="disks"), "eastus") is None
    assert pricing.vm_size(sku("Standard_D4s_v5", gpus=None), "eastus") is None
    assert pricing.vm_size(sku("Standard_NV6ads_A10_v5"), "eastus") is None
    assert pricing.vm_size(sku(low_priority="False"), "eastus").spot is False  # type: ignore[union-attr]


def test_zone_names() -> None:
    assert pricing.zone_name("eastus", "2") == "eastus-2"
    assert pricing.zone_name("westus", None) == "westus"


# --- Retail Prices ---------------------------------------------------------------------

def item(meter: str, price: float, *, product: str = "Virtual Machines NCadsA100v4 Series",
         kind: str = "Consumption", region: str = "eastus",
         arm: str = "Standard_NC24ads_A100_v4", unit: str = "1 Hour",
         since: str = "2026-11-01T00:00:00Z", **extra: Any) -> dict[str, Any]:
    return {"currencyCode": "USD", "unitPrice": price, "retailPrice": price,
            "armRegionName": region, "meterName": meter, "skuName": meter,
            "productName": product, "serviceName": "Virtual Machines", "type": kind,
            "unitOfMeasure": unit, "armSkuName": arm, "effectiveStartDate": since, **extra}


def test_prices_take_linux_consumption_and_spot_only() -> None:
    items = [
        item("NC24ads A100 v4", 3.673),
        item("NC24ads A100 v4 Spot", 0.444433),
        item("NC24ads A100 v4 Low Priority", 0.7346),
        item("NC24ads A100 v4", 4.777, product="Virtual Machines NCadsA100v4 Series Windows"),
        item("NC24ads A100 v4 Spot", 0.6652,
             product="Virtual Machines NCadsA100v4 Series Windows"),
        item("NC24ads A100 v4", 3.3, kind="DevTestConsumption"),
        item("NC24ads A100 v4", 19300.0, kind="Reservation", reservationTerm="1 Year"),
        item("NC24ads A100 v4", 3.9, region="westus"),
        item("NC24ads A100 v4", 3.0, currencyCode="EUR"),
        item("NC24ads A100 v4", 0.0, arm="Standard_NC48ads_A100_v4"),  # free = no price
    ]
    prices = pricing.prices_of(items, "eastus")
    assert prices.on_demand == {"standard_nc24ads_a100_v4": 3.673}
    assert prices.spot == {"standard_nc24ads_a100_v4": 0.444433}


def test_prices_per_unit_of_measure_and_newest_first() -> None:
    items = [
        item("NC6 v3", 30.6, arm="Standard_NC6s_v3", unit="10 Hours"),
        item("NC24ads A100 v4", 3.5, since="2025-01-01T00:00:00Z"),
        item("NC24ads A100 v4", 3.673, since="2026-11-01T00:00:00Z"),
        item("NC24ads A100 v4", 3.2, since="2024-01-01T00:00:00Z"),
        item("NC24ads A100 v4", 9.9, unit="1 GB"),
    ]
    prices = pricing.prices_of(items, "eastus")
    assert prices.on_demand == {"standard_nc6s_v3": pytest.approx(3.06),
                                "standard_nc24ads_a100_v4": 3.673}


# A page of the Retail Prices API in its own shape, for one size in eastus2: the Linux
# on-demand and spot prices, then one row per catalog edge case, each effective later
# than the Linux ones (so "newest wins" would take it). The Windows spelling " Srs Win"
# is the catalog's for NCCadsv5 (all others say " Series Windows").
EDGES = json.loads((Path(__file__).resolve().parents[2]
                    / "fixtures/azure/retail-prices-edge-cases.json").read_text())["Items"]
NCC = "standard_ncc40ads_h100_v5"
CLOCK = datetime(2026, 12, 1, tzinfo=UTC)


def _linux(*edge: dict[str, Any]) -> list[dict[str, Any]]:
    return [i for i in EDGES if i["productName"] == "Virtual Machines NCCadsv5 Srs"
            and i["isPrimaryMeterRegion"] and i["effectiveStartDate"] < "2026"] + list(edge)


@pytest.mark.parametrize("edge", [
    pytest.param(lambda i: i["productName"].endswith(" Srs Win"), id="windows-abbreviated"),
    pytest.param(lambda i: "Cloud Services" in i["productName"], id="cloud-services"),
    pytest.param(lambda i: i["isPrimaryMeterRegion"] is False, id="non-primary-region"),
    pytest.param(lambda i: i["effectiveStartDate"] > "2027", id="not-yet-effective"),
])
def test_catalog_edge_rows_do_not_replace_the_linux_price(edge: Any) -> None:
    rows = [i for i in EDGES if edge(i)]
    assert rows
    prices = pricing.prices_of(_linux(*rows), "eastus2", CLOCK)
    assert prices.on_demand == {NCC: 6.98}
    assert prices.spot == {NCC: 1.419034}


def test_a_future_price_counts_once_in_effect() -> None:
    assert pricing.prices_of(EDGES, "eastus2", datetime(2027, 6, 1, tzinfo=UTC)
                             ).on_demand == {NCC: 5.94}
    assert pricing.prices_of(EDGES, "eastus2", CLOCK).on_demand == {NCC: 6.98}


# --- eviction rates --------------------------------------------------------------------

@pytest.mark.parametrize(("band", "rate"), [  # a share evicted over 28 days (672 h)
    ("0-5", 3.768e-05), ("5-10", 1.16e-04), ("10-15", 1.987e-04), ("15-20", 2.863e-04),
    ("20+", 4.281e-04), ("0-5%", 3.768e-05), (" 20+ ", 4.281e-04),
    ("", None), (None, None), ("high", None), ("N/A", None),
])
def test_eviction_bands_become_interruptions_per_hour(band: str | None,
                                                      rate: float | None) -> None:
    assert pricing.eviction_rate(band) == rate


def test_eviction_rows_by_size_in_both_result_formats() -> None:
    objects = [{"skuName": "standard_nc24ads_a100_v4", "location": "eastus",
                "evictionRate": "5-10"},
               {"skuName": "Standard_NC6s_v3", "location": "eastus", "evictionRate": "20+"},
               {"skuName": "standard_nc6s_v3", "location": "westus", "evictionRate": "0-5"},
               {"skuName": "standard_nc12s_v3", "location": "eastus", "evictionRate": ""}]
    table = {"columns": [{"name": "skuName"}, {"name": "location"}, {"name": "evictionRate"}],
             "rows": [["standard_nd96asr_v4", "eastus", "10-15"]]}
    assert pricing.evictions_of([*objects, table], "eastus") == {
        "standard_nc24ads_a100_v4": 1.16e-04, "standard_nc6s_v3": 4.281e-04,
        "standard_nd96asr_v4": 1.987e-04}


# --- quotas ----------------------------------------------------------------------------

def usage(name: str, current: int, limit: int) -> dict[str, Any]:
    return {"unit": "Count", "currentValue": current, "limit": limit,
            "name": {"value": name, "localizedValue": name}}


def test_quota_headroom_in_gpus() -> None:
    size = pricing.vm_size(sku(), "eastus")
    assert size is not None  # 24 vCPUs, 1 GPU, family StandardNCADSA100v4Family
    quotas = pricing.quotas_of([
        usage("standardNCADSA100v4Family", 24, 96),  # 72 left: 3 instances
        usage("cores", 300, 350),  # 50 left: 2 instances
        usage("lowPriorityCores", 0, 100),  # 4 instances
    ])
    assert pricing.on_demand_headroom(quotas, size) == 2  # the regional cap binds
    assert pricing.spot_headroom(quotas, size) == 4
    assert pricing.on_demand_headroom({}, size) is None
    assert pricing.spot_headroom({}, size) is None
    # the family quota alone, when the regional one is unknown
    assert pricing.on_demand_headroom(
        {"standardncadsa100v4family": (0.0, 48.0)}, size) == 2


@pytest.mark.parametrize(("quota", "vcpus", "gpus", "headroom"), [
    (None, 96, 8, None), ((0.0, 96.0), None, 8, None), ((0.0, 192.0), 96, 8, 16),
    ((96.0, 100.0), 96, 8, 0), ((120.0, 100.0), 96, 8, 0), ((0.0, 100.0), 4, 1, 25),
])
def test_headroom_gpus(quota: tuple[float, float] | None, vcpus: int | None, gpus: int,
                       headroom: int | None) -> None:
    assert pricing.headroom_gpus(quota, vcpus, gpus) == headroom
