"""Tests of the fake Alibaba Cloud ECS endpoint (`tests/fakes/fake_alibaba.py`), driven by the
real Tea SDK: the shapes, paging, signatures and error bodies the adapter relies on."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from alibabacloud_ecs20140526 import models
from alibabacloud_tea_openapi.exceptions import (
    AlibabaCloudException,
    ClientException,
    ServerException,
    ThrottlingException,
)
from fake_alibaba import CATALOG, REGIONS, FakeAlibaba, fake_alibaba_fixture  # noqa: F401
from fake_server import Chaos
from Tea.exceptions import UnretryableException

REGION = "cn-hangzhou"


def body(response: Any) -> dict[str, Any]:
    return response.body.to_map()  # type: ignore[no-any-return]


def test_instance_types_page_with_next_token_and_filter_gpus(
        fake_alibaba: FakeAlibaba) -> None:
    ecs = fake_alibaba.client()
    seen, pages, token = [], 0, None
    while True:
        page = body(ecs.describe_instance_types(models.DescribeInstanceTypesRequest(
            minimum_gpuamount=1, max_results=4, next_token=token)))
        pages += 1
        seen.extend(page["InstanceTypes"]["InstanceType"])
        token = page.get("NextToken")
        if not token:
            break
    gpu_types = [t for t in CATALOG if t.gpus]
    assert pages == -(-len(gpu_types) // 4)
    assert [t["InstanceTypeId"] for t in seen] == [t.name for t in gpu_types]
    a10 = next(t for t in seen if t["InstanceTypeId"] == "ecs.gn7i-c8g1.2xlarge")
    assert (a10["GPUSpec"], a10["GPUAmount"], a10["GPUMemorySize"], a10["CpuCoreCount"],
            a10["MemorySize"]) == ("NVIDIA A10", 1, 24.0, 8, 30.0)


def test_available_resource_lists_zones_types_and_stock(fake_alibaba: FakeAlibaba) -> None:
    fake_alibaba.set_stock(REGION, "cn-hangzhou-i", "ecs.gn7i-c8g1.2xlarge", "spot",
                           "ClosedWithoutStock")
    answer = body(fake_alibaba.client().describe_available_resource(
        models.DescribeAvailableResourceRequest(
            region_id=REGION, destination_resource="InstanceType",
            instance_charge_type="PostPaid", spot_strategy="SpotAsPriceGo")))
    found = {}
    for zone in answer["AvailableZones"]["AvailableZone"]:
        assert zone["RegionId"] == REGION and zone["ZoneId"] in REGIONS[REGION]
        (res,) = zone["AvailableResources"]["AvailableResource"]
        assert res["Type"] == "InstanceType"
        for s in res["SupportedResources"]["SupportedResource"]:
            found[(zone["ZoneId"], s["Value"])] = (s["Status"], s["StatusCategory"])
    assert found[("cn-hangzhou-i", "ecs.gn7i-c8g1.2xlarge")] == ("SoldOut", "ClosedWithoutStock")
    assert {k: v[1] for k, v in found.items()} == fake_alibaba.sells(REGION, "spot")


def test_spot_price_history_pages_by_offset_within_the_window(
        fake_alibaba: FakeAlibaba) -> None:
    fake_alibaba.page_size["DescribeSpotPriceHistory"] = 4
    ecs = fake_alibaba.client()
    start = fake_alibaba.snapshot_time - timedelta(hours=7)
    points, offset, currency = [], 0, None
    while True:
        page = body(ecs.describe_spot_price_history(models.DescribeSpotPriceHistoryRequest(
            region_id=REGION, instance_type="ecs.gn7i-c8g1.2xlarge", network_type="vpc",
            ostype="linux", start_time=start.strftime("%Y-%m-%dT%H:%M:%SZ"),
            offset=offset or None)))
        points.extend(page["SpotPrices"]["SpotPriceType"])
        currency = page["Currency"]
        if not page["NextOffset"]:
            break
        offset = page["NextOffset"]
    zones = {z for (z, t) in fake_alibaba.sells(REGION, "spot") if t == "ecs.gn7i-c8g1.2xlarge"}
    assert len(points) == 3 * len(zones) > 4  # points at -6 h, -3 h and 0 h in each zone
    assert currency == "CNY"
    assert [p["Timestamp"] for p in points] == sorted(p["Timestamp"] for p in points)
    newest = [p for p in points if p["Timestamp"].startswith(
        fake_alibaba.snapshot_time.strftime("%Y-%m-%dT%H"))]
    for p in newest:
        assert p["SpotPrice"] == fake_alibaba.spot_price(REGION, p["ZoneId"], p["InstanceType"])
        assert p["OriginPrice"] > p["SpotPrice"] and p["NetworkType"] == "vpc"


def test_spot_price_history_answers_the_price_of_the_spot_duration_asked(
        fake_alibaba: FakeAlibaba) -> None:
    ecs = fake_alibaba.client()
    start = (fake_alibaba.snapshot_time - timedelta(minutes=1)).strftime("%Y-%m-%dT%H:%M:%SZ")

    def newest(duration: int | None) -> dict[str, float]:
        page = body(ecs.describe_spot_price_history(models.DescribeSpotPriceHistoryRequest(
            region_id=REGION, instance_type="ecs.gn7i-c8g1.2xlarge", network_type="vpc",
            start_time=start, spot_duration=duration)))
        return {p["ZoneId"]: p["SpotPrice"] for p in page["SpotPrices"]["SpotPriceType"]}

    default, one, none = newest(None), newest(1), newest(0)
    assert default == one and default
    for zone, price in none.items():
        assert price == fake_alibaba.spot_price(REGION, zone, "ecs.gn7i-c8g1.2xlarge", 0)
        assert price < one[zone]
    for api in (lambda: newest(2), lambda: ecs.describe_available_resource(
            models.DescribeAvailableResourceRequest(
                region_id=REGION, destination_resource="InstanceType",
                spot_strategy="SpotAsPriceGo", spot_duration=3))):
        with pytest.raises(AlibabaCloudException, match="SpotDuration"):
            api()


def test_describe_price_itemises_instance_disk_and_bandwidth(fake_alibaba: FakeAlibaba
                                                             ) -> None:
    fake_alibaba.discount = 0.1
    price = body(fake_alibaba.client().describe_price(models.DescribePriceRequest(
        region_id=REGION, resource_type="instance", instance_type="ecs.gn7i-c8g1.2xlarge",
        price_unit="Hour", period=1)))["PriceInfo"]["Price"]
    lines = {d["Resource"]: d for d in price["DetailInfos"]["DetailInfo"]}
    assert set(lines) == {"instanceType", "systemDisk", "bandwidth"}
    assert lines["instanceType"]["TradePrice"] == pytest.approx(
        fake_alibaba.on_demand_price(REGION, "ecs.gn7i-c8g1.2xlarge"))
    assert price["TradePrice"] == pytest.approx(sum(d["TradePrice"] for d in lines.values()))
    assert price["Currency"] == "CNY"


def test_spot_advice_and_account_attributes_shapes(fake_alibaba: FakeAlibaba) -> None:
    ecs = fake_alibaba.client()
    advice = body(ecs.describe_spot_advice(models.DescribeSpotAdviceRequest(
        region_id=REGION, instance_types=["ecs.gn7i-c8g1.2xlarge", "ecs.gn6i-c4g1.xlarge"])))
    resources = [r for z in advice["AvailableSpotZones"]["AvailableSpotZone"]
                 for r in z["AvailableSpotResources"]["AvailableSpotResource"]]
    assert resources and {r["InstanceType"] for r in resources} <= {
        "ecs.gn7i-c8g1.2xlarge", "ecs.gn6i-c4g1.xlarge"}
    assert all(r["InterruptRateDesc"] in ("0-3%", "3-5%", "5-10%", "10-100%")
               and 0 <= r["InterruptionRate"] < 100 for r in resources)
    with pytest.raises(ClientException) as too_many:
        ecs.describe_spot_advice(models.DescribeSpotAdviceRequest(
            region_id=REGION, instance_types=[t.name for t in CATALOG][:11]))
    assert too_many.value.code == "InvalidParameter"
    attrs = body(ecs.describe_account_attributes(models.DescribeAccountAttributesRequest(
        region_id=REGION, attribute_name=["max-spot-instance-vcpu-count",
                                          "used-postpaid-instance-vcpu-count"])))
    items = {i["AttributeName"]: i["AttributeValues"]["ValueItem"][0]["Value"]
             for i in attrs["AccountAttributeItems"]["AccountAttributeItem"]}
    assert items == {"max-spot-instance-vcpu-count": "800",
                     "used-postpaid-instance-vcpu-count": "48"}


def test_signatures_are_checked_for_known_keys(fake_alibaba: FakeAlibaba) -> None:
    fake_alibaba.access_keys["LTAI-known"] = "right"
    request = models.DescribeAccountAttributesRequest(region_id=REGION)
    fake_alibaba.client(key_id="LTAI-known", secret="right").describe_account_attributes(
        request)
    with pytest.raises(ClientException) as wrong:
        fake_alibaba.client(key_id="LTAI-known", secret="wrong").describe_account_attributes(
            request)
    assert (wrong.value.code, wrong.value.status_code) == ("SignatureDoesNotMatch", 400)
    fake_alibaba.revoked_keys.add("LTAI-gone")
    with pytest.raises(ClientException) as gone:
        fake_alibaba.client(key_id="LTAI-gone").describe_account_attributes(request)
    assert (gone.value.code, gone.value.status_code) == ("InvalidAccessKeyId.NotFound", 404)
    assert fake_alibaba.key_ids == {"LTAI-known": 2, "LTAI-gone": 1}


def test_faults_answer_in_alibabas_error_shape(fake_alibaba: FakeAlibaba) -> None:
    ecs = fake_alibaba.client()
    request = models.DescribeAvailableResourceRequest(region_id=REGION,
                                                      destination_resource="InstanceType")
    fake_alibaba.fail("DescribeAvailableResource", "OperationDenied.NoStock")
    with pytest.raises(ClientException) as no_stock:
        ecs.describe_available_resource(request)
    err = no_stock.value
    assert (err.code, err.status_code) == ("OperationDenied.NoStock", 403)
    assert set(err.data) >= {"RequestId", "HostId", "Code", "Message", "Recommend"}
    fake_alibaba.fail("DescribeAvailableResource", "Throttling.User", retry_after_ms=1500)
    with pytest.raises(ThrottlingException) as throttled:
        ecs.describe_available_resource(request)
    assert throttled.value.retry_after == 1500
    ecs.describe_available_resource(request)  # the faults were used up
    with pytest.raises(ClientException) as unknown:
        ecs.describe_available_resource(models.DescribeAvailableResourceRequest(
            region_id="cn-nowhere", destination_resource="InstanceType"))
    assert (unknown.value.code, unknown.value.status_code) == ("InvalidRegionId.NotFound", 404)
    assert fake_alibaba.call_count("DescribeAvailableResource") == 4


def test_latency_keeps_calls_concurrent(fake_alibaba: FakeAlibaba) -> None:
    fake_alibaba.latency = (0.2, 0.2)
    request = models.DescribeAccountAttributesRequest(region_id=REGION)
    clients = [fake_alibaba.client(r) for r in REGIONS][:4]
    clients[0].describe_account_attributes(request)  # one connection pool, made once
    started = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda c: c.describe_account_attributes(request), clients))
    assert time.perf_counter() - started < 0.6


def test_random_faults_answer_as_alibaba_does(fake_alibaba: FakeAlibaba) -> None:
    ecs = fake_alibaba.client()
    request = models.DescribeAccountAttributesRequest(region_id=REGION)
    fake_alibaba.chaos = Chaos(rate=1.0, kinds=("throttle",))
    throttles = []
    for _ in range(3):
        with pytest.raises(AlibabaCloudException) as raised:
            ecs.describe_account_attributes(request)
        err = raised.value
        assert set(err.data) >= {"RequestId", "HostId", "Code", "Message", "Recommend"}
        throttles.append((type(err), err.code, err.status_code,
                          getattr(err, "retry_after", None)))
    assert throttles == [(ThrottlingException, "Throttling.User", 400, 1000),
                         (ClientException, "Throttling.Api", 400, None),
                         (ClientException, "Throttling", 429, None)]
    fake_alibaba.chaos = Chaos(rate=1.0, kinds=("5xx",), seed=3)
    errors = set()
    for _ in range(8):
        with pytest.raises(ServerException) as failed:
            ecs.describe_account_attributes(request)
        errors.add((failed.value.code, failed.value.status_code))
    assert errors == {("InternalError", 500), ("ServiceUnavailable", 503)}
    assert fake_alibaba.faulted == {"throttle": 3, "5xx": 8}
    assert fake_alibaba.call_count() == 0  # the API itself never saw them


def test_chaos_spares_a_request_after_its_bad_luck_runs_out(fake_alibaba: FakeAlibaba
                                                             ) -> None:
    ecs = fake_alibaba.client()
    fake_alibaba.chaos = Chaos(rate=1.0, kinds=("truncated",))
    fake_alibaba.chaos_spare_after = 2
    one = models.DescribeAccountAttributesRequest(region_id=REGION)
    other = models.DescribeAccountAttributesRequest(region_id="cn-beijing")
    for _ in range(2):
        with pytest.raises(UnretryableException, match="Failed to parse the value as json format"):
            ecs.describe_account_attributes(one)
    assert body(ecs.describe_account_attributes(one))["AccountAttributeItems"]  # spared
    with pytest.raises(UnretryableException, match="Failed to parse"):
        ecs.describe_account_attributes(other)  # other parameters: its own luck
    assert fake_alibaba.faulted == {"truncated": 3}
