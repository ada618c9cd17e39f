"""How the GCP adapter reads Google's answers: SKUs, shapes, GPU names, quotas, stock-outs."""

from __future__ import annotations

import re
from typing import Any

import pytest
from fake_gcp import sku_json

from adapters.gcp import pricing
from adapters.gcp.pricing import Shape, StockoutDecay
from adapters.gcp.sdk import AcceleratorType, MachineType, Quota
from broker.model import Market

OD, SPOT = Market.ON_DEMAND, Market.SPOT


def sku(desc: str, group: str = "CPU", usage: str = "OnDemand", unit: str = "h",
        regions: tuple[str, ...] = ("us-central1",), usd: float = 0.5,
        family: str = "Compute") -> dict[str, Any]:
    return sku_json(desc, group=group, usage=usage, regions=list(regions), usd=usd, unit=unit,
                    family=family)


# Each description as the real Billing Catalog words it (where each comes from: the
# docstring of tests/fakes/fake_gcp.py), and what it prices.
@pytest.mark.parametrize(("desc", "group", "usage", "unit", "expect"), [
    # on-demand vCPU and RAM
    ("A2 Instance Core running in Iowa", "CPU", "OnDemand", "h", (OD, "core", "A2 Instance")),
    ("A2 Instance Ram running in Iowa", "RAM", "OnDemand", "GiBy.h", (OD, "ram", "A2 Instance")),
    ("A2 Instance Core running in Hong Kong", "CPU", "OnDemand", "h",
     (OD, "core", "A2 Instance")),
    ("G2 Instance Ram running in Netherlands", "RAM", "OnDemand", "GiBy.h",
     (OD, "ram", "G2 Instance")),
    ("A3 Instance Core running in Virginia", "CPU", "OnDemand", "h", (OD, "core", "A3 Instance")),
    # A3 Mega's and A3 Ultra's own (a public catalog mapping: "A3Plus Instance Core",
    # "A3Ultra Instance Core"; a parser's test data: "A3Plus Instance Core running in Americas")
    ("A3Plus Instance Core running in Americas", "CPU", "OnDemand", "h",
     (OD, "core", "A3Plus Instance")),
    ("Spot Preemptible A3Plus Instance Ram running in Virginia", "RAM", "Preemptible",
     "GiBy.h", (SPOT, "ram", "A3Plus Instance")),
    ("A3Ultra Instance Ram running in Americas", "RAM", "OnDemand", "GiBy.h",
     (OD, "ram", "A3Ultra Instance")),
    ("Spot Preemptible A3Ultra Instance Core running in Iowa", "CPU", "Preemptible", "h",
     (SPOT, "core", "A3Ultra Instance")),
    ("N1 Predefined Instance Core running in Americas", "N1Standard", "OnDemand", "h",
     (OD, "core", "N1 Predefined Instance")),
    ("N1 Predefined Instance Ram running in Zurich", "N1Standard", "OnDemand", "GiBy.h",
     (OD, "ram", "N1 Predefined Instance")),
    ("A2 Instance Core in Iowa", "CPU", "OnDemand", "h", (OD, "core", "A2 Instance")),
    ("A2 Instance Core", "CPU", "OnDemand", "h", (OD, "core", "A2 Instance")),
    # Spot vCPU and RAM: the "Spot Preemptible" prefix, and N1's older "Preemptible"
    ("Spot Preemptible A2 Instance Core running in Americas", "CPU", "Preemptible", "h",
     (SPOT, "core", "A2 Instance")),
    ("Spot Preemptible A2 Instance Ram running in Americas", "RAM", "Preemptible", "GiBy.h",
     (SPOT, "ram", "A2 Instance")),
    ("Spot Preemptible N1 Predefined Instance Core running in Americas", "N1Standard",
     "Preemptible", "h", (SPOT, "core", "N1 Predefined Instance")),
    ("Preemptible N1 Predefined Instance Core running in Virginia", "N1Standard",
     "Preemptible", "h", (SPOT, "core", "N1 Predefined Instance")),
    ("Preemptible N1 Predefined Instance Ram running in Americas", "N1Standard", "Preemptible",
     "GiBy.h", (SPOT, "ram", "N1 Predefined Instance")),
    ("Spot Preemptible E2 Instance Core running in Salt Lake City", "CPU", "Preemptible",
     "h", None),  # a series without GPUs
    # usageType decides: a Preemptible SKU without any Spot wording is Spot
    ("A2 Instance Core running in Iowa", "CPU", "Preemptible", "h",
     (SPOT, "core", "A2 Instance")),
    ("Nvidia Tesla T4 GPU running in Americas", "GPU", "Preemptible", "h",
     (SPOT, "gpu", "nvidia-tesla-t4")),
    # on-demand GPUs, with the catalog's spellings
    ("Nvidia Tesla A100 GPU running in Americas", "GPU", "OnDemand", "h",
     (OD, "gpu", "nvidia-tesla-a100")),
    ("Nvidia Tesla A100 80GB GPU running in Americas", "GPU", "OnDemand", "h",
     (OD, "gpu", "nvidia-a100-80gb")),
    ("Nvidia A100 80GB GPU running in Iowa", "GPU", "OnDemand", "h",
     (OD, "gpu", "nvidia-a100-80gb")),
    ("Nvidia L4 GPU running in Netherlands", "GPU", "OnDemand", "h", (OD, "gpu", "nvidia-l4")),
    ("NVIDIA L4 GPU running in Virginia", "GPU", "OnDemand", "h", (OD, "gpu", "nvidia-l4")),
    ("Nvidia H100 80GB GPU running in Americas", "GPU", "OnDemand", "h",
     (OD, "gpu", "nvidia-h100-80gb")),
    ("Nvidia H100 80GB Mega GPU running in Frankfurt", "GPU", "OnDemand", "h",
     (OD, "gpu", "nvidia-h100-mega-80gb")),
    ("Nvidia H100 Mega 80GB GPU running in Iowa", "GPU", "OnDemand", "h",
     (OD, "gpu", "nvidia-h100-mega-80gb")),
    ("Nvidia H100 80GB Plus GPU running in Americas", "GPU", "OnDemand", "h",
     (OD, "gpu", "nvidia-h100-mega-80gb")),
    ("H200 141GB GPU running in Belgium", "GPU", "OnDemand", "h",
     (OD, "gpu", "nvidia-h200-141gb")),
    ("Nvidia H200 141GB GPU running in Iowa", "GPU", "OnDemand", "h",
     (OD, "gpu", "nvidia-h200-141gb")),
    ("A4 Nvidia B200 (1 gpu slice) running in Americas", "GPU", "OnDemand", "h",
     (OD, "slice", "nvidia-b200")),
    ("Nvidia B200 GPU running in Iowa", "GPU", "OnDemand", "h", (OD, "gpu", "nvidia-b200")),
    ("A100 80GB GPU running in Iowa", "GPU", "OnDemand", "h",  # not a series prefix
     (OD, "gpu", "nvidia-a100-80gb")),
    # Spot GPUs: mostly "attached to Spot Preemptible VMs", a few with the prefix
    ("Nvidia Tesla A100 GPU attached to Spot Preemptible VMs running in Americas", "GPU",
     "Preemptible", "h", (SPOT, "gpu", "nvidia-tesla-a100")),
    ("Nvidia L4 GPU attached to Spot Preemptible VMs running in Hong Kong", "GPU",
     "Preemptible", "h", (SPOT, "gpu", "nvidia-l4")),
    ("Nvidia Tesla T4 GPU attached to Spot Preemptible VMs running in Americas", "GPU",
     "Preemptible", "h", (SPOT, "gpu", "nvidia-tesla-t4")),
    ("H200 141GB GPU attached to Spot Preemptible VMs running in Columbus", "GPU",
     "Preemptible", "h", (SPOT, "gpu", "nvidia-h200-141gb")),
    ("Spot Preemptible Nvidia Tesla A100 GPU running in Americas", "GPU", "Preemptible", "h",
     (SPOT, "gpu", "nvidia-tesla-a100")),
    ("Spot Preemptible NVIDIA L4 GPU running in Americas", "GPU", "Preemptible", "h",
     (SPOT, "gpu", "nvidia-l4")),
    ("Spot Preemptible Nvidia L4 GPU attached to Spot Preemptible VMs running in Iowa", "GPU",
     "Preemptible", "h", (SPOT, "gpu", "nvidia-l4")),
    ("Preemptible Nvidia Tesla T4 GPU running in Americas", "GPU", "Preemptible", "h",
     (SPOT, "gpu", "nvidia-tesla-t4")),
    ("Spot Preemptible A4 Nvidia B200 (1 gpu slice) running in Americas", "GPU",
     "Preemptible", "h", (SPOT, "slice", "nvidia-b200")),
    # Spot wording on a SKU tagged OnDemand (skypilot#8125): a Spot price, never on-demand
    ("Spot Preemptible A4 Nvidia B200 (1 gpu slice) running in Americas", "GPU", "OnDemand",
     "h", (SPOT, "slice", "nvidia-b200")),
    ("Spot Preemptible A2 Instance Core running in Iowa", "CPU", "OnDemand", "h",
     (SPOT, "core", "A2 Instance")),
    ("Nvidia Tesla A100 GPU attached to Spot Preemptible VMs running in Iowa", "GPU",
     "OnDemand", "h", (SPOT, "gpu", "nvidia-tesla-a100")),
    # Never a VM's price:
    ("Nvidia Tesla T4 Virtual Workstation GPU running in Iowa", "GPU", "OnDemand", "h", None),
    ("Nvidia L4 GPU Virtual Workstation running in Americas", "GPU", "OnDemand", "h", None),
    ("Commitment v1: Nvidia Tesla A100 GPU running in Americas for 1 Year", "GPU", "Commit1Yr",
     "h", None),
    ("Commitment v1: A2 Cpu in Americas for 1 Year", "CPU", "Commit1Yr", "h", None),
    ("Commitment v1: A4 Nvidia B200 (1 gpu slice) in Americas for 1 Year", "GPU", "OnDemand",
     "h", None),
    ("Nvidia Tesla A100 GPU running in Americas", "GPU", "Commit1Yr", "h", None),
    ("Nvidia Tesla A100 GPU running in Americas", "GPU", "Commit3Yr", "h", None),
    ("Nvidia Tesla A100 GPU attached to DWS Defined Duration VMs running in Americas", "GPU",
     "OnDemand", "h", None),
    ("DWS Defined Duration A2 Core running in Americas", "CPU", "OnDemand", "h", None),
    ("Nvidia L4 GPU (DWS Flex Start) running in Iowa", "GPU", "OnDemand", "h", None),
    ("Reserved Nvidia Tesla A100 80GB GPU in Virginia", "GPU", "OnDemand", "h", None),
    ("Reserved V6e TPU in Columbus in Calendar Mode", "TPU", "OnDemand", "h", None),
    ("Capacity Optimized TpuV6e running in Columbus", "TPU", "OnDemand", "h", None),
    ("TpuV6e attached to Spot Preemptible VMs running in Columbus", "TPU", "Preemptible", "h",
     None),
    ("Sole Tenancy Instance Core running in Iowa", "CPU", "OnDemand", "h", None),
    ("C3 Sole Tenancy Instance Ram running in Turin", "RAM", "OnDemand", "GiBy.h", None),
    ("Custom Instance Core running in Iowa", "N1Standard", "OnDemand", "h", None),
    ("Spot Preemptible Custom Instance Core running in Dammam", "N1Standard", "Preemptible",
     "h", None),
    ("Reserved A2 Instance Core running in Iowa", "CPU", "OnDemand", "h", None),
    ("A3 Ultra Instance Core running in Iowa", "CPU", "OnDemand", "h", None),  # not "A3Ultra"
    ("DWS Defined Duration A3Ultra Core running in Iowa", "CPU", "OnDemand", "h", None),
    ("Nvidia Tesla K80 GPU running in Iowa", "GPU", "OnDemand", "h", None),  # unknown GPU
    ("Nvidia Tesla K80 GPU attached to Spot Preemptible VMs running in Warsaw", "GPU",
     "Preemptible", "h", None),
    ("RTX 6000 96GB running in Oregon", "GPU", "OnDemand", "h", None),  # no g4 offers yet
    ("A2 Instance Ram running in Iowa", "RAM", "OnDemand", "GiBy.mo", None),  # wrong unit
    ("A2 Instance Core running in Iowa", "RAM", "OnDemand", "h", None),  # wrong group
    ("Nvidia Tesla T4 GPU running in Americas", "CPU", "OnDemand", "h", None),  # wrong group
])
def test_parse_sku(desc: str, group: str, usage: str, unit: str,
                   expect: tuple[Market, str, str] | None) -> None:
    p = pricing.parse_sku(sku(desc, group, usage, unit))
    assert (None if p is None else (p.market, p.kind, p.name)) == expect
    if p is not None:
        assert p.usd == 0.5 and p.regions == ("us-central1",)


def test_parse_sku_skips_other_resource_families() -> None:
    assert pricing.parse_sku(sku("A2 Instance Core running in Iowa", family="License")) is None
    assert pricing.parse_sku({"description": "A2 Instance Core running in Iowa"}) is None


@pytest.mark.parametrize(("price", "expect"), [
    ({"currencyCode": "USD", "units": "0", "nanos": 31611000}, 0.031611),
    ({"currencyCode": "USD", "units": "2", "nanos": 933910000}, 2.93391),
    ({"currencyCode": "USD", "units": "12"}, 12.0),
    ({"currencyCode": "EUR", "units": "1", "nanos": 0}, None),
])
def test_unit_price_reads_units_and_nanos(price: dict[str, Any], expect: float | None) -> None:
    s = sku("A2 Instance Core running in Iowa")
    s["pricingInfo"][0]["pricingExpression"]["tieredRates"] = [
        {"startUsageAmount": 0, "unitPrice": price}]
    assert pricing.unit_price(s, "h") == expect


def test_unit_price_takes_the_tier_that_starts_at_zero() -> None:
    s = sku("A2 Instance Core running in Iowa")
    s["pricingInfo"][0]["pricingExpression"]["tieredRates"] = [
        {"startUsageAmount": 744, "unitPrice": {"units": "0", "nanos": 10}},
        {"startUsageAmount": 0, "unitPrice": {"units": "0", "nanos": 31611000}}]
    assert pricing.unit_price(s, "h") == 0.031611
    assert pricing.unit_price(s, "GiBy.h") is None
    assert pricing.unit_price({"pricingInfo": []}, "h") is None


@pytest.mark.parametrize("regional_first", [True, False])
def test_index_prefers_the_regional_sku_over_a_multi_regional_one(regional_first: bool
                                                                  ) -> None:
    multi = sku("Nvidia Tesla T4 GPU running in Americas", "GPU", usd=0.35,
                regions=("us-central1", "us-east1", "us-west1"))
    regional = sku("Nvidia Tesla T4 GPU running in Iowa", "GPU", usd=0.30)
    index = pricing.index_skus([regional, multi] if regional_first else [multi, regional])
    assert index[("us-central1", OD, "gpu", "nvidia-tesla-t4")] == 0.30
    assert index[("us-east1", OD, "gpu", "nvidia-tesla-t4")] == 0.35
    assert ("europe-west4", OD, "gpu", "nvidia-tesla-t4") not in index


A2_1G = Shape("a2-highgpu-1g", "a2-highgpu-1g", 12, 85.0, "nvidia-tesla-a100", 1)
INDEX: pricing.PriceIndex = {
    ("us-central1", OD, "core", "A2 Instance"): 0.031611,
    ("us-central1", OD, "ram", "A2 Instance"): 0.004237,
    ("us-central1", OD, "gpu", "nvidia-tesla-a100"): 2.933908,
    ("us-central1", SPOT, "core", "A2 Instance"): 0.01264,
    ("us-central1", SPOT, "ram", "A2 Instance"): 0.001695,
}


def test_a4_is_priced_by_its_gpu_slices_alone() -> None:
    a4 = Shape("a4-highgpu-8g", "a4-highgpu-8g", 224, 3968.0, "nvidia-b200", 8)
    index: pricing.PriceIndex = {("us-east4", OD, "slice", "nvidia-b200"): 11.277,
                                 ("us-east4", SPOT, "gpu", "nvidia-b200"): 1.0}
    assert pricing.vm_price(index, "us-east4", OD, a4) == pytest.approx(90.216)
    # A GPU-only B200 price is not a slice: without vCPU/RAM SKUs the price is unknown.
    assert pricing.vm_price(index, "us-east4", SPOT, a4) is None


def test_vm_price_sums_core_ram_and_gpu_skus() -> None:
    assert pricing.vm_price(INDEX, "us-central1", OD, A2_1G) == pytest.approx(
        12 * 0.031611 + 85 * 0.004237 + 2.933908, rel=1e-12)
    assert pricing.vm_price(INDEX, "us-central1", SPOT, A2_1G) is None  # no Spot GPU SKU
    assert pricing.vm_price(INDEX, "europe-west4", OD, A2_1G) is None
    g4 = Shape("g4-standard-48", "g4-standard-48", 48, 180.0, "nvidia-rtx-pro-6000", 1)
    assert pricing.vm_price(INDEX, "us-central1", OD, g4) is None  # unknown series


# Billing Catalog SKUs in their REST shape (skus.list), as the catalog has them: A3 Mega's
# vCPU/RAM SKUs are "A3Plus Instance ...", A3 Ultra's "A3Ultra Instance ..." (us-central1
# on-demand A3Plus prices: a public Billing Catalog parser's test data; the others are
# made up for the test, each different so that a mix-up shows).
def rest_sku(desc: str, group: str, usage: str, unit: str, units: str, nanos: int,
             family: str = "Compute") -> dict[str, Any]:
    return {
        "name": "services/6F81-5844-456A/skus/0000-0000-0000", "skuId": "0000-0000-0000",
        "description": desc,
        "category": {"serviceDisplayName": "Compute Engine", "resourceFamily": family,
                     "resourceGroup": group, "usageType": usage},
        "serviceRegions": ["us-central1", "us-east1", "us-west1"],
        "pricingInfo": [{"pricingExpression": {
            "usageUnit": unit, "displayQuantity": 1,
            "tieredRates": [{"startUsageAmount": 0, "unitPrice": {
                "currencyCode": "USD", "units": units, "nanos": nanos}}]},
            "effectiveTime": "2026-11-30T00:00:00.000Z"}],
        "serviceProviderName": "Google"}


A3_SKUS = [
    rest_sku("A3 Instance Core running in Americas", "CPU", "OnDemand", "h", "0", 25497876),
    rest_sku("A3 Instance Ram running in Americas", "RAM", "OnDemand", "GiBy.h", "0", 2220354),
    rest_sku("A3Plus Instance Core running in Americas", "CPU", "OnDemand", "h", "0", 26924000),
    rest_sku("A3Plus Instance Ram running in Americas", "RAM", "OnDemand", "GiBy.h", "0",
             2344000),
    rest_sku("Spot Preemptible A3Plus Instance Core running in Americas", "CPU", "Preemptible",
             "h", "0", 6191542),
    rest_sku("Spot Preemptible A3Plus Instance Ram running in Americas", "RAM", "Preemptible",
             "GiBy.h", "0", 539034),
    rest_sku("A3Ultra Instance Core running in Americas", "CPU", "OnDemand", "h", "0",
             18704694),
    rest_sku("A3Ultra Instance Ram running in Americas", "RAM", "OnDemand", "GiBy.h", "0",
             1628804),
    rest_sku("Spot Preemptible A3Ultra Instance Core running in Americas", "CPU",
             "Preemptible", "h", "0", 4301080),
    rest_sku("Spot Preemptible A3Ultra Instance Ram running in Americas", "RAM",
             "Preemptible", "GiBy.h", "0", 374540),
    rest_sku("Nvidia H100 80GB Plus GPU running in Americas", "GPU", "OnDemand", "h", "10",
             344276000),
    rest_sku("Nvidia H100 80GB Mega GPU attached to Spot Preemptible VMs running in Americas",
             "GPU", "Preemptible", "h", "2", 379100000),
    rest_sku("H200 141GB GPU attached to Spot Preemptible VMs running in Americas", "GPU",
             "Preemptible", "h", "3", 724700000),
]
# local SSD: resource family Storage, group LocalSSD, per GiB-month; the Americas SKUs
# name no region; Google tags some Spot ones OnDemand (their description says Spot)
LOCAL_SSD_SKUS = [
    rest_sku("SSD backed Local Storage", "LocalSSD", "OnDemand", "GiBy.mo", "0", 80000000,
             family="Storage"),
    rest_sku("SSD backed Local Storage attached to Spot Preemptible VMs", "LocalSSD",
             "OnDemand", "GiBy.mo", "0", 48000000, family="Storage"),
]
MEGA = Shape("a3-megagpu-8g", "a3-megagpu-8g", 208, 1872.0, "nvidia-h100-mega-80gb", 8)
ULTRA = Shape("a3-ultragpu-8g", "a3-ultragpu-8g", 224, 2952.0, "nvidia-h200-141gb", 8)
SSD_OD, SSD_SPOT = 0.08 / 730, 0.048 / 730  # $ per GiB-hour


def test_a3_mega_and_ultra_are_priced_by_their_own_skus() -> None:
    index = pricing.index_skus([*A3_SKUS, *LOCAL_SSD_SKUS])
    assert pricing.vm_price(index, "us-central1", OD, MEGA) == pytest.approx(
        208 * 0.026924 + 1872 * 0.002344 + 8 * 10.344276 + 6000 * SSD_OD, rel=1e-12)
    assert pricing.vm_price(index, "us-east1", SPOT, MEGA) == pytest.approx(
        208 * 0.006191542 + 1872 * 0.000539034 + 8 * 2.3791 + 6000 * SSD_SPOT, rel=1e-12)
    assert pricing.vm_price(index, "us-west1", SPOT, ULTRA) == pytest.approx(
        224 * 0.00430108 + 2952 * 0.00037454 + 8 * 3.7247 + 12000 * SSD_SPOT, rel=1e-12)
    # Without their own SKUs they are not priced with the A3 High ones.
    plain = pricing.index_skus([s for s in A3_SKUS if "A3Plus" not in s["description"]
                                and "A3Ultra" not in s["description"]] + LOCAL_SSD_SKUS)
    assert plain[("us-central1", OD, "core", "A3 Instance")] == 0.025497876
    assert pricing.vm_price(plain, "us-central1", OD, MEGA) is None
    assert pricing.vm_price(plain, "us-central1", SPOT, ULTRA) is None


def test_bundled_local_ssd_is_priced_spot_at_its_spot_price() -> None:
    index = pricing.index_skus([*A3_SKUS, *LOCAL_SSD_SKUS])
    assert index[("us-central1", OD, "lssd", pricing.LOCAL_SSD)] == pytest.approx(SSD_OD)
    assert index[("us-central1", SPOT, "lssd", pricing.LOCAL_SSD)] == pytest.approx(SSD_SPOT)
    index.update({("us-central1", OD, "gpu", "nvidia-h100-80gb"): 11.06,
                  ("us-central1", SPOT, "core", "A3 Instance"): 0.005,
                  ("us-central1", SPOT, "ram", "A3 Instance"): 0.0005,
                  ("us-central1", SPOT, "gpu", "nvidia-h100-80gb"): 2.25})
    host = 208 * 0.025497876 + 1872 * 0.002220354
    for itype, ssd_gib in (("a3-highgpu-8g", 6000), ("a3-edgegpu-8g", 6000),
                           ("a3-edgegpu-8g-nolssd", 0)):
        shape = Shape(itype, itype, 208, 1872.0, "nvidia-h100-80gb", 8)
        assert pricing.vm_price(index, "us-central1", OD, shape) == pytest.approx(
            host + 8 * 11.06 + ssd_gib * SSD_OD, rel=1e-12), itype
    h4 = Shape("a3-highgpu-4g", "a3-highgpu-4g", 104, 936.0, "nvidia-h100-80gb", 4)
    assert pricing.vm_price(index, "us-central1", SPOT, h4) == pytest.approx(
        104 * 0.005 + 936 * 0.0005 + 4 * 2.25 + 3000 * SSD_SPOT, rel=1e-12)
    a2u = Shape("a2-ultragpu-2g", "a2-ultragpu-2g", 24, 340.0, "nvidia-a100-80gb", 2)
    index.update({("us-central1", OD, "core", "A2 Instance"): 0.031611,
                  ("us-central1", OD, "ram", "A2 Instance"): 0.004237,
                  ("us-central1", OD, "gpu", "nvidia-a100-80gb"): 1.0})
    assert pricing.vm_price(index, "us-central1", OD, a2u) == pytest.approx(
        24 * 0.031611 + 340 * 0.004237 + 2 + 750 * SSD_OD, rel=1e-12)
    # a shape with local SSD where the catalog has no local SSD price: unknown
    del index[("us-central1", OD, "lssd", pricing.LOCAL_SSD)]
    assert pricing.vm_price(index, "us-central1", OD, a2u) is None


@pytest.mark.parametrize(("machine", "gpus", "on_demand"), [
    ("a3-highgpu-8g", 8, True), ("a3-highgpu-4g", 4, False), ("a3-highgpu-2g", 2, False),
    ("a3-highgpu-1g", 1, False), ("a3-megagpu-8g", 8, True), ("a3-edgegpu-8g", 8, True),
    ("a3-ultragpu-8g", 8, False), ("a3-ultragpu-8g-nolssd", 8, False),
    ("a4-highgpu-8g", 8, False), ("a2-ultragpu-1g", 1, True), ("g2-standard-4", 1, True),
    ("n1-standard-8", 1, True),
])
def test_shapes_google_sells_only_reserved_flex_start_or_spot(machine: str, gpus: int,
                                                              on_demand: bool) -> None:
    expect = (OD, SPOT) if on_demand else (SPOT,)
    assert pricing.markets(machine, gpus) == expect


def mt(name: str, vcpus: int, gib: float, accel: str | None = None, n: int = 0,
       deprecated: str = "") -> MachineType:
    return MachineType(name, vcpus, int(gib * 1024), ((accel, n),) if accel else (), deprecated)


def test_shapes_offer_built_in_gpus_and_the_common_n1_shapes() -> None:
    machines = [
        mt("a2-highgpu-1g", 12, 85, "nvidia-tesla-a100", 1),
        mt("a2-highgpu-2g", 24, 170, "nvidia-tesla-a100", 2, deprecated="DEPRECATED"),
        mt("a2-highgpu-4g", 48, 340, "nvidia-tesla-a100", 4, deprecated="OBSOLETE"),
        mt("n1-standard-4", 4, 15), mt("n1-standard-8", 8, 30), mt("n1-standard-16", 16, 60),
        mt("n1-standard-32", 32, 120), mt("e2-standard-8", 8, 32)]
    accelerators = [AcceleratorType("nvidia-tesla-t4", 4),
                    AcceleratorType("nvidia-tesla-v100", 8),  # 8 needs n1-standard-64: absent
                    AcceleratorType("nvidia-tesla-p4", 2),
                    AcceleratorType("nvidia-tesla-p100", 4, deprecated="OBSOLETE"),
                    AcceleratorType("nvidia-tesla-t4-vws", 4),
                    AcceleratorType("nvidia-tesla-a100", 16)]
    got = {s.instance_type: (s.vcpus, s.memory_gib, s.accelerator, s.gpus)
           for s in pricing.shapes(machines, accelerators)}
    assert got == {
        "a2-highgpu-1g": (12, 85.0, "nvidia-tesla-a100", 1),
        "a2-highgpu-2g": (24, 170.0, "nvidia-tesla-a100", 2),
        "n1-standard-8+nvidia-tesla-t4x1": (8, 30.0, "nvidia-tesla-t4", 1),
        "n1-standard-16+nvidia-tesla-t4x2": (16, 60.0, "nvidia-tesla-t4", 2),
        "n1-standard-32+nvidia-tesla-t4x4": (32, 120.0, "nvidia-tesla-t4", 4),
        "n1-standard-8+nvidia-tesla-v100x1": (8, 30.0, "nvidia-tesla-v100", 1),
        "n1-standard-16+nvidia-tesla-v100x2": (16, 60.0, "nvidia-tesla-v100", 2),
        "n1-standard-32+nvidia-tesla-v100x4": (32, 120.0, "nvidia-tesla-v100", 4),
        "n1-standard-8+nvidia-tesla-p4x1": (8, 30.0, "nvidia-tesla-p4", 1),
        "n1-standard-16+nvidia-tesla-p4x2": (16, 60.0, "nvidia-tesla-p4", 2),
    }


@pytest.mark.parametrize(("name", "parts"), [
    ("n1-standard-16+nvidia-tesla-t4x2", ("n1-standard-16", "nvidia-tesla-t4", 2)),
    ("n1-standard-64+nvidia-tesla-v100x8", ("n1-standard-64", "nvidia-tesla-v100", 8)),
    ("a2-highgpu-1g", ("a2-highgpu-1g", None, 0)),
    ("a3-megagpu-8g", ("a3-megagpu-8g", None, 0)),
])
def test_instance_type_names_read_back(name: str, parts: tuple[str, str | None, int]) -> None:
    assert pricing.split_instance_type(name) == parts
    if parts[1] is not None:
        assert pricing.n1_instance_type(*parts) == name  # type: ignore[arg-type]


def test_machine_type_filter_asks_for_exactly_what_shapes_use() -> None:
    flt = pricing.machine_type_filter()
    m = re.fullmatch(r'name eq "(.*)"', flt)
    assert m is not None
    wanted = re.compile(m.group(1))
    for name in ("a2-highgpu-1g", "a2-megagpu-16g", "a3-ultragpu-8g-nolssd", "a4-highgpu-8g",
                 "g2-standard-4", "n1-standard-8", "n1-standard-64"):
        assert wanted.fullmatch(name), name
    for name in ("n1-standard-4", "n1-standard-96", "n1-highmem-8", "e2-standard-8",
                 "a2x-highgpu-1g", "c2-standard-8"):
        assert not wanted.fullmatch(name), name


@pytest.mark.parametrize(("accel", "expect"), [
    ("nvidia-tesla-a100", ("A100-40GB", 40, True)),
    ("nvidia-a100-80gb", ("A100-80GB", 80, True)),
    ("nvidia-h100-80gb", ("H100-80GB", 80, True)),
    ("nvidia-h100-mega-80gb", ("H100-80GB", 80, True)),
    ("nvidia-h200-141gb", ("H200-141GB", 141, True)),
    ("nvidia-b200", ("B200", 180, True)),
    ("nvidia-l4", ("L4", 24, True)),
    ("nvidia-tesla-t4", ("T4", 16, True)),
    ("nvidia-tesla-v100", ("V100-16GB", 16, True)),
    ("nvidia-tesla-p100", ("P100", 16, True)),
    ("nvidia-tesla-p4", ("P4", 8, True)),
    ("nvidia-rtx-pro-6000", ("nvidia-rtx-pro-6000", None, False)),
])
def test_gpu_names_map_to_canonical(accel: str, expect: tuple[str, float | None, bool]
                                    ) -> None:
    assert pricing.gpu_of(accel) == expect


A100 = "NVIDIA_A100_GPUS"


@pytest.mark.parametrize(("regional", "global_", "market", "expect"), [
    ({A100: Quota(16, 12)}, None, OD, 4),
    ({A100: Quota(16, 12)}, None, SPOT, 4),  # no Spot quota: Spot uses the regular one
    ({A100: Quota(16, 12), f"PREEMPTIBLE_{A100}": Quota(32, 0)}, None, SPOT, 32),
    ({A100: Quota(16, 12), f"PREEMPTIBLE_{A100}": Quota(0, 0)}, None, SPOT, 4),
    ({A100: Quota(16, 12)}, Quota(10, 8), OD, 2),
    ({A100: Quota(16, 0)}, Quota(64, 0), OD, 16),
    ({}, Quota(10, 8), OD, 2),
    ({"NVIDIA_L4_GPUS": Quota(8, 0)}, None, OD, None),
    ({}, None, OD, None),
    ({A100: Quota(4, 6)}, None, OD, 0),  # over quota (a lowered limit)
    ({A100: Quota(16, 12.5)}, None, OD, 3),
])
def test_quota_headroom(regional: dict[str, Quota], global_: Quota | None, market: Market,
                        expect: int | None) -> None:
    assert pricing.quota_headroom(regional, global_, "nvidia-tesla-a100", market) == expect


@pytest.mark.parametrize(("age", "availability"), [
    (-5, 0.0), (0, 0.0), (599, 0.0), (600, 0.0), (600 + 1500, 0.5), (600 + 2999.4, 0.9998),
    (3600, None), (86400, None)])
def test_stockout_decay(age: float, availability: float | None) -> None:
    assert StockoutDecay(hold=600, recover=3000).availability(age) == availability
