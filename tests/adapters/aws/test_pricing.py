"""How the AWS adapter reads AWS's answers: GPU names, price documents, quotas, scores."""

from __future__ import annotations

import json
import math
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


# --- Spot Instance Advisor ------------------------------------------------------------

RANGES = [  # as the published document has them ("max" is not the label's bound)
    {"index": 0, "label": "<5%", "dots": 0, "max": 5},
    {"index": 1, "label": "5-10%", "dots": 1, "max": 11},
    {"index": 2, "label": "10-15%", "dots": 2, "max": 16},
    {"index": 3, "label": "15-20%", "dots": 3, "max": 22},
    {"index": 4, "label": ">20%", "dots": 4, "max": 100},
]


@pytest.mark.parametrize(("label", "monthly"), [
    ("<5%", 0.025), ("5-10%", 0.075), ("10-15%", 0.125), ("15-20%", 0.175), (">20%", 0.25),
    (" 5 - 10 % ", 0.075), ("<2.5%", 0.0125),
])
def test_an_advisor_band_is_its_midpoint_as_a_monthly_probability(label: str,
                                                                  monthly: float) -> None:
    rate = pricing.band_rate(label)
    assert rate == pytest.approx(-math.log(1 - monthly) / 730, rel=1e-3)
    # Read back: the chance of an interruption within 730 h is the band's midpoint.
    assert rate is not None and 1 - math.exp(-rate * 730) == pytest.approx(monthly, rel=1e-3)


@pytest.mark.parametrize("label", ["", "high", "5%", "5-%", "<%"])
def test_an_unreadable_band_is_unknown(label: str) -> None:
    assert pricing.band_rate(label) is None


def test_interruption_rates_by_region_and_type_for_linux() -> None:
    doc = {
        "global_rate": "<10%",
        "instance_types": {"g5.xlarge": {"emr": True, "cores": 4, "ram_gb": 16.0}},
        "ranges": [*RANGES, {"index": 5, "label": "unheard of", "max": 0}],
        "spot_advisor": {
            "us-east-1": {
                "Linux": {"g5.xlarge": {"s": 70, "r": 0}, "p5.48xlarge": {"s": 50, "r": 4},
                          "g6.xlarge": {"s": 60, "r": 5}, "g6e.xlarge": {"s": 60, "r": 9},
                          "p4d.24xlarge": {"s": 60}, "p3.2xlarge": "garbage"},
                "Windows": {"g4dn.xlarge": {"s": 40, "r": 1}},
            },
            "eu-west-1": {"Windows": {"g5.xlarge": {"s": 40, "r": 1}}},
            "us-west-2": {"Linux": {"g5.xlarge": {"s": 70, "r": 3}}},
        },
    }
    rates = pricing.interruption_rates(doc, ["us-east-1", "eu-west-1", "ap-south-1"])
    assert rates == {
        "us-east-1": {"g5.xlarge": pricing.band_rate("<5%"),
                      "p5.48xlarge": pricing.band_rate(">20%")},
        "eu-west-1": {},
        "ap-south-1": {},
    }


@pytest.mark.parametrize("doc", [{}, {"ranges": RANGES}, {"spot_advisor": {}},
                                 {"ranges": {}, "spot_advisor": {}}])
def test_a_document_without_ranges_or_advice_is_not_one(doc: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="Spot Instance Advisor"):
        pricing.interruption_rates(doc, ["us-east-1"])
