"""How the Alibaba adapter reads Alibaba's answers: GPU names, stock, prices and
currencies, release rates, quotas."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

import pytest

from adapters.alibaba import pricing


def itype(name: str, spec: str, count: int, mem: float, family: str = "") -> dict[str, Any]:
    return {"InstanceTypeId": name, "InstanceTypeFamily": family or name.rsplit("-", 1)[0],
            "GPUSpec": spec, "GPUAmount": count, "GPUMemorySize": mem}


@pytest.mark.parametrize(("info", "expect"), [
    (itype("ecs.gn7i-c8g1.2xlarge", "NVIDIA A10", 1, 24, "ecs.gn7i"), ("A10", 1, 24.0, True)),
    (itype("ecs.gn6i-c4g1.xlarge", "NVIDIA T4", 1, 16, "ecs.gn6i"), ("T4", 1, 16.0, True)),
    (itype("ecs.gn6v-c8g1.16xlarge", "NVIDIA V100", 8, 16, "ecs.gn6v"),
     ("V100-16GB", 8, 16.0, True)),
    (itype("ecs.gn6e-c12g1.3xlarge", "NVIDIA V100", 1, 32, "ecs.gn6e"),
     ("V100-32GB", 1, 32.0, True)),
    (itype("ecs.gn7-c12g1.3xlarge", "NVIDIA A100", 1, 40, "ecs.gn7"),
     ("A100-40GB", 1, 40.0, True)),
    (itype("ecs.gn7e-c16g1.32xlarge", "NVIDIA A100", 8, 80, "ecs.gn7e"),
     ("A100-80GB", 8, 80.0, True)),
    (itype("ecs.gn8x", "NVIDIA H100", 8, 80, "ecs.gn8"), ("H100-80GB", 8, 80.0, True)),
    # Models the canonical table does not know keep Alibaba's name, flagged.
    (itype("ecs.ebmgn7ex.32xlarge", "NVIDIA A800", 8, 80, "ecs.ebmgn7ex"),
     ("A800-80GB", 8, 80.0, True)),
    (itype("ecs.gn8v-8x.48xlarge", "NVIDIA H20", 8, 96, "ecs.gn8v"),
     ("H20-96GB", 8, 96.0, True)),
    (itype("ecs.gn8is-2x.8xlarge", "NVIDIA L20", 2, 48, "ecs.gn8is"),
     ("L20", 2, 48.0, True)),
    (itype("ecs.gn5-c4g1.xlarge", "NVIDIA P100", 1, 16, "ecs.gn5"),
     ("P100", 1, 16.0, True)),
    # A vGPU slice of a T4 is not a T4.
    (itype("ecs.vgn6i-m4.xlarge", "NVIDIA T4", 1, 4, "ecs.vgn6i"),
     ("NVIDIA T4", 1, 4.0, False)),
    (itype("ecs.sgn7i-vws-m2.xlarge", "NVIDIA A10", 1, 2, "ecs.sgn7i-vws"),
     ("NVIDIA A10", 1, 2.0, False)),
    ({"InstanceTypeId": "ecs.x", "GPUAmount": 1, "GPUSpec": "", "GPUMemorySize": 0},
     ("unknown", 1, None, False)),
])
def test_gpu_names_map_to_canonical(info: dict[str, Any],
                                    expect: tuple[str, int, float | None, bool]) -> None:
    assert pricing.gpu_of(info) == expect


@pytest.mark.parametrize(("amount", "gpu"), [(1, True), (8, True), (0, False), (None, False),
                                             ("x", False)])
def test_is_gpu(amount: Any, gpu: bool) -> None:
    assert pricing.is_gpu({"GPUAmount": amount}) is gpu


@pytest.mark.parametrize(("status", "category", "availability"), [
    ("Available", "WithStock", 1.0),
    ("Available", "ClosedWithStock", 0.3),
    ("SoldOut", "WithoutStock", 0.0),
    ("SoldOut", "ClosedWithoutStock", 0.0),
    ("Available", None, 1.0),
    ("SoldOut", None, 0.0),
    (None, None, None),
    ("Weird", "AlsoWeird", None),
])
def test_stock_status_to_availability(status: str | None, category: str | None,
                                      availability: float | None) -> None:
    assert pricing.availability_of(status, category) == availability


@pytest.mark.parametrize(("amount", "currency", "usd"), [
    (10.0, "CNY", 1.4), (10.0, "cny", 1.4), (2.5, "USD", 2.5), (2.5, "EUR", None),
    (2.5, None, None), (None, "USD", None), (math.nan, "USD", None),
])
def test_to_usd(amount: float | None, currency: str | None, usd: float | None) -> None:
    assert pricing.to_usd(amount, currency, 0.14) == usd


def price(total: float, lines: list[tuple[str, Any, Any]] | None = None,
          currency: str = "CNY") -> dict[str, Any]:
    out: dict[str, Any] = {"Currency": currency, "OriginalPrice": total, "TradePrice": total}
    if lines is not None:
        out["DetailInfos"] = {"DetailInfo": [
            {"Resource": r, "OriginalPrice": o, "TradePrice": t} for r, o, t in lines]}
    return out


@pytest.mark.parametrize(("answer", "expect"), [
    # The instanceType line, after the account's discount; not disk or bandwidth.
    (price(14.0, [("instanceType", 13.92, 12.5), ("systemDisk", 0.08, 0.08),
                  ("bandwidth", 0, 0)]), (12.5, "CNY")),
    # Only a list price on the line (strings, as some answers have them).
    (price(14.0, [("instanceType", "13.92", None)]), (13.92, "CNY")),
    # No breakdown: the order total.
    (price(2.1, None, "USD"), (2.1, "USD")),
    # Nothing positive anywhere: no price.
    (price(0.0, [("instanceType", 0, 0)]), (None, "CNY")),
])
def test_instance_price(answer: dict[str, Any], expect: tuple[float | None, str]) -> None:
    assert pricing.instance_price(answer) == expect


def test_newest_spot_price_per_type_and_zone() -> None:
    def point(zone: str, price: Any, ts: str, itype: str = "ecs.gn7i-c8g1.2xlarge"
              ) -> dict[str, Any]:
        return {"InstanceType": itype, "ZoneId": zone, "SpotPrice": price, "Timestamp": ts,
                "OriginPrice": 13.92, "NetworkType": "vpc", "IoOptimized": "optimized"}

    newest = pricing.newest_spot_prices([
        point("cn-hangzhou-i", 3.1, "2026-11-30T06:00:00Z"),
        point("cn-hangzhou-i", 2.9, "2026-11-30T09:00:00Z"),
        point("cn-hangzhou-i", 3.5, "2026-11-30T03:00:00Z"),
        point("cn-hangzhou-j", 4.0, "2026-11-30T09:00:00Z"),
        point("cn-hangzhou-j", 0, "2026-11-30T12:00:00Z"),  # unusable price
        point("cn-hangzhou-k", 1.0, "not a time"),
    ])
    at9 = datetime(2026, 11, 30, 9, tzinfo=UTC)
    assert newest == {("ecs.gn7i-c8g1.2xlarge", "cn-hangzhou-i"): (2.9, at9),
                      ("ecs.gn7i-c8g1.2xlarge", "cn-hangzhou-j"): (4.0, at9)}


@pytest.mark.parametrize(("pct", "band", "per_hour"), [
    (3.0, "0-3%", -math.log(0.97) / 720),
    (10, "5-10%", -math.log(0.90) / 720),
    (0, "0-3%", 0.0),
    ("2.5", None, -math.log(0.975) / 720),
    (None, "0-3%", -math.log(1 - 0.015) / 720),
    (None, "3-5%", -math.log(1 - 0.04) / 720),
    (None, "5-10%", -math.log(1 - 0.075) / 720),
    (None, "10-100%", -math.log(1 - 0.15) / 720),
    (None, "weird", None),
    (None, None, None),
    (150, None, -math.log(0.01) / 720),  # clamped: over 100 % is their error
])
def test_release_rate_to_interruptions_per_hour(pct: Any, band: str | None,
                                                per_hour: float | None) -> None:
    got = pricing.interruption_rate(pct, band)
    assert got == pytest.approx(per_hour, rel=1e-3) if per_hour is not None else got is None


def test_a_release_share_is_read_over_30_days() -> None:
    # the share released over the last 30 days: 3 % within 720 h, 10-100% as 15 %
    assert pricing.interruption_rate(3, None) == pytest.approx(4.23e-5, rel=1e-3)
    assert pricing.interruption_rate(10, None) == pytest.approx(1.463e-4, rel=1e-3)
    assert pricing.interruption_rate(None, "10-100%") == pytest.approx(2.257e-4, rel=1e-3)


def attribute(name: str, *values: tuple[str, str]) -> dict[str, Any]:
    return {"AttributeName": name, "AttributeValues": {"ValueItem": [
        {"Value": v, "ZoneId": z, "Count": 1} for v, z in values]}}


def test_attribute_values_prefer_the_region_wide_item() -> None:
    values = pricing.attribute_values([
        attribute(pricing.MAX_POSTPAID, ("100", "cn-hangzhou-i"), ("800", "")),
        attribute(pricing.USED_POSTPAID, ("48", "cn-hangzhou-i")),
        attribute(pricing.MAX_SPOT, ("lots", "")),
        attribute(pricing.USED_SPOT),
    ])
    assert values == {pricing.MAX_POSTPAID: 800.0, pricing.USED_POSTPAID: 48.0,
                      pricing.MAX_SPOT: None, pricing.USED_SPOT: None}


@pytest.mark.parametrize(("attrs", "spot", "free"), [
    ({pricing.MAX_POSTPAID: 800.0, pricing.USED_POSTPAID: 48.0}, False, 752.0),
    ({pricing.MAX_SPOT: 800.0}, True, 800.0),  # usage not reported: taken as 0
    ({pricing.MAX_SPOT: 100.0, pricing.USED_SPOT: 130.0}, True, 0.0),
    ({pricing.USED_SPOT: 8.0}, True, None),
    ({}, False, None),
])
def test_free_vcpus(attrs: dict[str, float | None], spot: bool, free: float | None) -> None:
    assert pricing.free_vcpus(attrs, spot) == free


@pytest.mark.parametrize(("free", "vcpus", "gpus", "headroom"), [
    (752.0, 8, 1, 94), (752.0, 128, 8, 40), (7.0, 8, 1, 0), (None, 8, 1, None),
    (100.0, None, 1, None), (100.0, 0, 1, None),
])
def test_headroom_in_gpus(free: float | None, vcpus: int | None, gpus: int,
                          headroom: int | None) -> None:
    assert pricing.headroom_gpus(free, vcpus, gpus) == headroom
