"""How the AWS adapter reads AWS's answers: GPU names, price documents, quotas, scores."""

from __future__ import annotations

import json
from typing import Any

import pytest

from adapters.aws import pricing


def type_info(name: str, gpu: str, count: int, mib: int) -> dict[str, Any]:
    return {"InstanceType": name, "GpuInfo": {"Gpus": [
        {"Name": gpu, "Count": count, "Manufacturer": "NVIDIA",
         "MemoryInfo": {"SizeInMiB": mib}}], "TotalGpuMemoryInMiB": count * mib}}


@pytest.mark.parametrize(("itype", "gpu", "count", "mib", "expect"), [
    ("p4d.24xlarge", "A100", 8, 40960, ("A100-40GB", 8, 40.0, True)),
    ("p4de.24xlarge", "A100", 8, 81920, ("A100-80GB", 8, 80.0, True)),
    ("p5.48xlarge", "H100", 8, 81920, ("H100-80GB", 8, 80.0, True)),
    ("p5en.48xlarge", "H200", 8, 144384, ("H200-141GB", 8, 141.0, True)),
    ("p6-b200.48xlarge", "B200", 8, 183359, ("B200", 8, 179.1, True)),
    ("g5.xlarge", "A10G", 1, 22888, ("A10G", 1, 22.4, True)),
    ("g6.12xlarge", "L4", 4, 22888, ("L4", 4, 22.4, True)),
    ("g6e.xlarge", "L40S", 1, 45776, ("L40S", 1, 44.7, True)),
    ("g4dn.xlarge", "T4", 1, 15360, ("T4", 1, 15.0, True)),
    ("p3.2xlarge", "V100", 1, 16384, ("V100-16GB", 1, 16.0, True)),
    ("p3dn.24xlarge", "V100", 8, 32768, ("V100-32GB", 8, 32.0, True)),
    ("g4ad.xlarge", "Radeon Pro V520", 1, 8192, ("Radeon Pro V520", 1, 8.0, False)),
])
def test_gpu_names_map_to_canonical(itype: str, gpu: str, count: int, mib: int,
                                    expect: tuple[str, int, float, bool]) -> None:
    assert pricing.gpu_of(type_info(itype, gpu, count, mib)) == expect


@pytest.mark.parametrize(("itype", "family"), [
    ("g5.xlarge", "G"), ("g6e.48xlarge", "G"), ("vt1.3xlarge", "G"), ("gr6.4xlarge", "G"),
    ("p5.48xlarge", "P"), ("p6-b200.48xlarge", "P"), ("p4de.24xlarge", "P"),
    ("dl1.24xlarge", None), ("inf2.xlarge", None), ("trn1.32xlarge", None),
])
def test_quota_family(itype: str, family: str | None) -> None:
    assert pricing.quota_family(itype) == family


def product(itype: str, region: str, usd: str, **attrs: str) -> str:
    a = {"instanceType": itype, "regionCode": region, "operatingSystem": "Linux",
         "tenancy": "Shared", "preInstalledSw": "NA", "capacitystatus": "Used", **attrs}
    return json.dumps({
        "product": {"productFamily": "Compute Instance", "attributes": a, "sku": "SKU1"},
        "terms": {"OnDemand": {"SKU1.JRTCKXETXF": {"priceDimensions": {
            "SKU1.JRTCKXETXF.6YS6EN2CT7": {"unit": "Hrs", "pricePerUnit": {"USD": usd},
                                           "description": "On Demand Linux"}}}}},
    })


def test_on_demand_price_takes_the_matching_linux_shared_used_product() -> None:
    docs = [
        product("p5.48xlarge", "us-east-1", "98.3200000000", operatingSystem="Windows"),
        product("p5.48xlarge", "us-east-1", "0.0000000000",
                capacitystatus="UnusedCapacityReservation"),
        product("p5.48xlarge", "us-east-1", "120.00", tenancy="Dedicated"),
        product("p5.48xlarge", "us-west-2", "55.04"),
        product("p5.48xlarge", "us-east-1", "55.0400000000"),
    ]
    assert pricing.on_demand_price(docs, "p5.48xlarge", "us-east-1") == 55.04


def test_on_demand_price_none_when_absent_or_zero() -> None:
    assert pricing.on_demand_price([], "p5.48xlarge", "us-east-1") is None
    assert pricing.on_demand_price([product("p5.48xlarge", "us-east-1", "0.00")],
                                   "p5.48xlarge", "us-east-1") is None


@pytest.mark.parametrize(("score", "availability"), [
    (None, None), (1, 0.1), (3, 0.3), (10, 1.0), (12, 1.0), (0, 0.0)])
def test_placement_score_to_availability(score: int | None, availability: float | None
                                         ) -> None:
    assert pricing.availability_of(score) == availability


@pytest.mark.parametrize(("quota", "vcpus", "gpus", "headroom"), [
    (None, 192, 8, None), (192.0, None, 8, None), (384.0, 192, 8, 16), (100.0, 192, 8, 0),
    (64.0, 4, 1, 16),
])
def test_quota_headroom_in_gpus(quota: float | None, vcpus: int | None, gpus: int,
                                headroom: int | None) -> None:
    assert pricing.headroom_gpus(quota, vcpus, gpus) == headroom
