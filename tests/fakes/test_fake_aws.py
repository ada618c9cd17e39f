"""Tests of the fake AWS endpoint (`tests/fakes/fake_aws.py`), driven by the real boto3."""

from __future__ import annotations

import asyncio
import contextlib
import csv
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import boto3
import pytest
from botocore import UNSIGNED
from botocore.config import Config
from botocore.exceptions import ClientError, ReadTimeoutError
from botocore.parsers import ResponseParserError
from fake_aws import ADVISOR_RANGES, DEFAULT_PRICES_CSV, FakeAWS, fake_aws_fixture  # noqa: F401
from fake_server import Chaos

NO_RETRY = Config(retries={"total_max_attempts": 1, "mode": "standard"})
LINUX_OD = [  # the filters that pick the one on-demand Linux product per type and region
    {"Type": "TERM_MATCH", "Field": "operatingSystem", "Value": "Linux"},
    {"Type": "TERM_MATCH", "Field": "tenancy", "Value": "Shared"},
    {"Type": "TERM_MATCH", "Field": "preInstalledSw", "Value": "NA"},
    {"Type": "TERM_MATCH", "Field": "capacitystatus", "Value": "Used"},
]


def csv_rows() -> list[dict[str, str]]:
    with DEFAULT_PRICES_CSV.open(newline="") as fh:
        return list(csv.DictReader(fh))


def od_price(product: dict[str, Any]) -> float:
    (term,) = product["terms"]["OnDemand"].values()
    (dim,) = term["priceDimensions"].values()
    assert dim["unit"] == "Hrs"
    return float(dim["pricePerUnit"]["USD"])


# --------------------------------------------------------------------------- EC2
def test_plain_boto3_client_with_endpoint_url_finds_p5_with_h100(fake_aws: FakeAWS) -> None:
    with contextlib.closing(
        boto3.client("ec2", region_name="us-east-1", endpoint_url=fake_aws.url, config=NO_RETRY)
    ) as ec2:
        pages = list(
            ec2.get_paginator("describe_instance_types").paginate(
                Filters=[{"Name": "instance-type", "Values": ["p*"]}],
                PaginationConfig={"PageSize": 5},
            )
        )
    assert len(pages) > 1
    types = {t["InstanceType"]: t for page in pages for t in page["InstanceTypes"]}
    gpu = types["p5.48xlarge"]["GpuInfo"]
    assert gpu["Gpus"][0]["Name"] == "H100"
    assert gpu["Gpus"][0]["Count"] == 8
    assert gpu["Gpus"][0]["MemoryInfo"]["SizeInMiB"] == 81920
    assert all(name.startswith("p") for name in types)


def test_describe_instance_types_pages_like_ec2(fake_aws: FakeAWS) -> None:
    ec2 = fake_aws.client("ec2")
    first = ec2.describe_instance_types()
    assert len(first["InstanceTypes"]) == 100
    assert first["NextToken"]
    with pytest.raises(ClientError) as err:
        ec2.describe_instance_types(InstanceTypes=["p9.huge"])
    assert err.value.response["Error"]["Code"] == "InvalidInstanceType"


def test_offerings_by_availability_zone_use_zone_names(fake_aws: FakeAWS) -> None:
    ec2 = fake_aws.client("ec2", "us-east-1")
    pages = list(
        ec2.get_paginator("describe_instance_type_offerings").paginate(
            LocationType="availability-zone",
            Filters=[{"Name": "instance-type", "Values": ["p5*", "g6e.*"]}],
            PaginationConfig={"PageSize": 10},
        )
    )
    assert len(pages) > 1
    offers = [o for page in pages for o in page["InstanceTypeOfferings"]]
    p5_zones = {o["Location"] for o in offers if o["InstanceType"] == "p5.48xlarge"}
    zones = {z["ZoneName"] for z in ec2.describe_availability_zones()["AvailabilityZones"]}
    assert p5_zones == zones == {f"us-east-1{c}" for c in "abcdef"}
    assert {o["LocationType"] for o in offers} == {"availability-zone"}

    regional = ec2.describe_instance_type_offerings(
        Filters=[{"Name": "instance-type", "Values": ["p5.48xlarge"]}]
    )["InstanceTypeOfferings"]
    assert regional == [
        {"InstanceType": "p5.48xlarge", "LocationType": "region", "Location": "us-east-1"}
    ]


def test_zone_ids_map_to_the_names_describe_availability_zones_gives(fake_aws: FakeAWS) -> None:
    for region in ("us-east-1", "us-west-2", "eu-west-1", "ap-southeast-3"):
        azs = fake_aws.client("ec2", region).describe_availability_zones()["AvailabilityZones"]
        for az in azs:
            assert fake_aws.zone_name(region, az["ZoneId"]) == az["ZoneName"]
            assert fake_aws.zone_id(region, az["ZoneName"]) == az["ZoneId"]
    assert fake_aws.zone_name("us-east-1", "use1-az1") == "us-east-1b"
    assert fake_aws.zone_name("eu-central-1", "euc1-az2") == "eu-central-1b"


def test_spot_price_history_pages_and_filters(fake_aws: FakeAWS) -> None:
    ec2 = fake_aws.client("ec2", "us-east-1")
    pages = list(
        ec2.get_paginator("describe_spot_price_history").paginate(
            ProductDescriptions=["Linux/UNIX"]
        )
    )
    prices = [p for page in pages for p in page["SpotPriceHistory"]]
    expected = [r for r in csv_rows() if r["region"] == "us-east-1" and r["spot_usd_per_hour"]]
    assert len(pages) == -(-len(expected) // 50) > 3
    assert len(prices) == len(expected)
    assert {p["ProductDescription"] for p in prices} == {"Linux/UNIX"}
    row = next(r for r in expected if r["instance_type"] == "p5.48xlarge")
    zone = fake_aws.zone_name("us-east-1", row["zone"])
    (hit,) = [
        p for p in prices if p["InstanceType"] == "p5.48xlarge" and p["AvailabilityZone"] == zone
    ]
    assert float(hit["SpotPrice"]) == float(row["spot_usd_per_hour"])
    assert hit["AvailabilityZoneId"] == row["zone"]

    # decoy Windows prices come back when the product filter is missing
    both = ec2.describe_spot_price_history(
        InstanceTypes=["p5.48xlarge"], Filters=[{"Name": "availability-zone", "Values": [zone]}]
    )["SpotPriceHistory"]
    assert {p["ProductDescription"] for p in both} == {"Linux/UNIX", "Windows"}


def test_spot_price_history_start_time_returns_effective_and_newer_points(
    fake_aws: FakeAWS,
) -> None:
    ec2 = fake_aws.client("ec2", "us-east-1")
    t0 = fake_aws.snapshot_time
    fake_aws.now = t0 + timedelta(minutes=30)
    fake_aws.set_spot_price("us-east-1", "use1-az1", "p5.48xlarge", 9.99)
    query = {
        "InstanceTypes": ["p5.48xlarge"],
        "ProductDescriptions": ["Linux/UNIX"],
        "Filters": [{"Name": "availability-zone", "Values": ["us-east-1b"]}],
    }
    since_before = ec2.describe_spot_price_history(StartTime=t0 + timedelta(minutes=10), **query)
    points = [(p["Timestamp"], float(p["SpotPrice"])) for p in since_before["SpotPriceHistory"]]
    assert points[0] == (t0 + timedelta(minutes=30), 9.99)  # newest first
    assert len(points) == 2 and points[1][0] == t0  # + the price in effect at StartTime

    since_after = ec2.describe_spot_price_history(StartTime=t0 + timedelta(hours=1), **query)
    assert [float(p["SpotPrice"]) for p in since_after["SpotPriceHistory"]] == [9.99]
    assert fake_aws.spot_price("us-east-1", "us-east-1b", "p5.48xlarge") == 9.99


def test_spot_placement_scores_page_are_deterministic_and_overridable(
    fake_aws: FakeAWS,
) -> None:
    ec2 = fake_aws.client("ec2", "us-east-1")
    query = {
        "InstanceTypes": ["p5.48xlarge"],
        "TargetCapacity": 1,
        "SingleAvailabilityZone": True,
        "RegionNames": ["us-east-1", "us-west-2", "us-east-2"],
    }
    paginator = ec2.get_paginator("get_spot_placement_scores")
    pages = list(paginator.paginate(**query))
    scores = [s for page in pages for s in page["SpotPlacementScores"]]
    assert len(pages) > 1
    csv_zones = {
        (r["region"], r["zone"])
        for r in csv_rows()
        if r["instance_type"] == "p5.48xlarge" and r["region"] in query["RegionNames"]
    }
    assert {(s["Region"], s["AvailabilityZoneId"]) for s in scores} == csv_zones
    assert all(1 <= s["Score"] <= 10 for s in scores)
    again = [s for page in paginator.paginate(**query) for s in page["SpotPlacementScores"]]
    assert again == scores

    fake_aws.set_placement_score("us-west-2", 10, az_id="usw2-az3")
    fake_aws.set_placement_score("us-east-2", 1)
    pinned = {
        (s["Region"], s["AvailabilityZoneId"]): s["Score"]
        for page in paginator.paginate(**query)
        for s in page["SpotPlacementScores"]
    }
    assert pinned[("us-west-2", "usw2-az3")] == 10
    assert {v for (r, _), v in pinned.items() if r == "us-east-2"} == {1}

    regional = ec2.get_spot_placement_scores(
        InstanceTypes=["p5.48xlarge"], TargetCapacity=1, RegionNames=["us-east-2"]
    )["SpotPlacementScores"]
    assert regional == [{"Region": "us-east-2", "Score": 1}]


# ----------------------------------------------------------------------- pricing
def test_get_products_filters_pick_one_product_and_drop_decoys(fake_aws: FakeAWS) -> None:
    pricing = fake_aws.client("pricing", "us-east-1")
    where = [
        {"Type": "TERM_MATCH", "Field": "instanceType", "Value": "p5.48xlarge"},
        {"Type": "TERM_MATCH", "Field": "regionCode", "Value": "us-east-1"},
    ]
    resp = pricing.get_products(ServiceCode="AmazonEC2", Filters=where + LINUX_OD)
    assert resp["FormatVersion"] == "aws_v1"
    (raw,) = resp["PriceList"]
    assert isinstance(raw, str)
    product = json.loads(raw)
    attrs = product["product"]["attributes"]
    assert (attrs["instanceType"], attrs["regionCode"], attrs["gpu"]) == (
        "p5.48xlarge",
        "us-east-1",
        "8",
    )
    assert attrs["location"] == "US East (N. Virginia)"
    row = next(
        r for r in csv_rows() if (r["instance_type"], r["region"]) == ("p5.48xlarge", "us-east-1")
    )
    assert od_price(product) == float(row["on_demand_usd_per_hour"])
    assert fake_aws.on_demand_price("us-east-1", "p5.48xlarge") == od_price(product)

    decoys = pricing.get_products(ServiceCode="AmazonEC2", Filters=where)["PriceList"]
    assert len(decoys) == 6
    assert len({od_price(json.loads(p)) for p in decoys}) == 6  # every filter matters


def test_get_products_paginates(fake_aws: FakeAWS) -> None:
    pricing = fake_aws.client("pricing", "us-east-1")
    pages = list(
        pricing.get_paginator("get_products").paginate(
            ServiceCode="AmazonEC2",
            Filters=[
                {"Type": "TERM_MATCH", "Field": "regionCode", "Value": "us-west-2"},
                *LINUX_OD,
            ],
        )
    )
    assert len(pages) > 1
    products = [json.loads(p) for page in pages for p in page["PriceList"]]
    names = [p["product"]["attributes"]["instanceType"] for p in products]
    expected = {
        r["instance_type"]
        for r in csv_rows()
        if r["region"] == "us-west-2" and r["on_demand_usd_per_hour"]
    }
    assert sorted(names) == sorted(expected)  # exactly one product per type


# ------------------------------------------------------------------------ quotas
def test_service_quotas_get_list_and_set(fake_aws: FakeAWS) -> None:
    east = fake_aws.client("service-quotas", "us-east-1")
    west = fake_aws.client("service-quotas", "us-west-2")
    quota = east.get_service_quota(ServiceCode="ec2", QuotaCode="L-417A185B")["Quota"]
    assert quota["QuotaName"] == "Running On-Demand P instances"
    assert (quota["Unit"], quota["Adjustable"], quota["ServiceCode"]) == ("None", True, "ec2")

    fake_aws.set_quota("us-west-2", "L-7212CCBC", 384)
    assert (
        west.get_service_quota(ServiceCode="ec2", QuotaCode="L-7212CCBC")["Quota"]["Value"] == 384.0
    )
    assert (
        east.get_service_quota(ServiceCode="ec2", QuotaCode="L-7212CCBC")["Quota"]["Value"] != 384.0
    )

    pages = list(west.get_paginator("list_service_quotas").paginate(ServiceCode="ec2"))
    assert len(pages) > 1
    codes = {q["QuotaCode"]: q for page in pages for q in page["Quotas"]}
    assert {"L-DB2E81BA", "L-417A185B", "L-3819A6DF", "L-7212CCBC"} <= set(codes)
    assert codes["L-7212CCBC"]["Value"] == 384.0

    with pytest.raises(ClientError) as err:
        east.get_service_quota(ServiceCode="ec2", QuotaCode="L-NOPE")
    assert err.value.response["Error"]["Code"] == "NoSuchResourceException"


# --------------------------------------------------------------------------- SQS
def test_sqs_round_trip_with_eventbridge_events(fake_aws: FakeAWS) -> None:
    url = fake_aws.create_queue("us-west-2", "gpubroker-interruptions")
    assert url == fake_aws.sqs_url("us-west-2", "gpubroker-interruptions")
    sqs = fake_aws.client("sqs", "us-west-2")
    assert sqs.get_queue_url(QueueName="gpubroker-interruptions")["QueueUrl"] == url

    # a long poll that is waiting when the event arrives returns with it
    with ThreadPoolExecutor(1) as pool:
        polling = pool.submit(sqs.receive_message, QueueUrl=url, WaitTimeSeconds=5)
        time.sleep(0.2)  # let the poll start waiting before the event is sent
        sent = fake_aws.send_ec2_event(
            url,
            "EC2 Spot Instance Interruption Warning",
            {"instance-id": "i-0abc123", "instance-action": "terminate"},
        )
        (msg,) = polling.result(timeout=10)["Messages"]
    event = json.loads(msg["Body"])
    assert event == sent
    assert event["source"] == "aws.ec2" and event["region"] == "us-west-2"
    assert event["resources"] == ["arn:aws:ec2:us-west-2:123456789012:instance/i-0abc123"]
    sqs.delete_message(QueueUrl=url, ReceiptHandle=msg["ReceiptHandle"])

    fake_aws.send_ec2_event(url, "EC2 Instance Rebalance Recommendation", {"instance-id": "i-1"})
    fake_aws.send_ec2_event(
        url, "EC2 Instance State-change Notification", {"instance-id": "i-2", "state": "stopping"}
    )
    got = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=1)
    kinds = {json.loads(m["Body"])["detail-type"] for m in got["Messages"]}
    assert kinds == {
        "EC2 Instance Rebalance Recommendation",
        "EC2 Instance State-change Notification",
    }
    # the helper's own calls are not counted
    assert fake_aws.call_count(action="SendMessage") == 0
    assert fake_aws.call_count("sqs", "ReceiveMessage", "us-west-2") == 2


# ------------------------------------------------------- Spot Instance Advisor
def advisor(fake_aws: FakeAWS) -> dict[str, Any]:
    with contextlib.closing(
        boto3.client(
            "s3",
            region_name="us-east-1",
            endpoint_url=fake_aws.url,
            config=NO_RETRY.merge(
                Config(signature_version=UNSIGNED, s3={"addressing_style": "path"})
            ),
        )
    ) as s3:
        resp = s3.get_object(Bucket="spot-bid-advisor", Key="spot-advisor-data.json")
        assert resp["ContentType"] == "application/json"
        doc: dict[str, Any] = json.loads(resp["Body"].read())
    return doc


def test_spot_advisor_document_has_the_published_shape(fake_aws: FakeAWS) -> None:
    doc = advisor(fake_aws)
    assert set(doc) == {"global_rate", "instance_types", "ranges", "spot_advisor"}
    assert doc["ranges"] == ADVISOR_RANGES
    assert [r["label"] for r in doc["ranges"]] == ["<5%", "5-10%", "10-15%", "15-20%", ">20%"]
    regions = {row["region"] for row in csv_rows()}
    assert set(doc["spot_advisor"]) == regions
    east = doc["spot_advisor"]["us-east-1"]
    assert set(east) == {"Linux", "Windows"}
    assert {"g5.xlarge", "m5.large"} <= set(east["Linux"])
    for entry in east["Linux"].values():
        assert set(entry) == {"s", "r"} and 0 <= entry["r"] <= 4 and 0 < entry["s"] < 100
    assert fake_aws.advisor_gaps["us-east-1"] not in east["Linux"]
    assert doc["instance_types"]["p5.48xlarge"] == {"emr": False, "cores": 192, "ram_gb": 2048.0}
    assert fake_aws.calls == {("s3", "GetObject", "us-east-1"): 1}

    fake_aws.set_interruption_band("us-east-1", "g5.xlarge", 4)
    fake_aws.set_interruption_band("us-east-1", "m5.large", None)
    linux = advisor(fake_aws)["spot_advisor"]["us-east-1"]["Linux"]
    assert linux["g5.xlarge"]["r"] == 4 and "m5.large" not in linux


# ------------------------------------------------------- faults, latency, counts
CHAOS_CALLS = {  # service -> (client, call)
    "ec2": ("ec2", lambda c: c.describe_spot_price_history(MaxResults=5)),
    "ec2-moto": ("ec2", lambda c: c.describe_regions()),
    "pricing": ("pricing", lambda c: c.get_products(ServiceCode="AmazonEC2", MaxResults=1)),
    "servicequotas": (
        "service-quotas",
        lambda c: c.get_service_quota(ServiceCode="ec2", QuotaCode="L-DB2E81BA"),
    ),
    "sqs": ("sqs", lambda c: c.list_queues()),
    "s3": ("s3", lambda c: c.get_object(Bucket="spot-bid-advisor", Key="spot-advisor-data.json")),
}
CHAOS_ANSWERS = {  # service -> (throttle code and status, 500 code, 503 code)
    "ec2": (("RequestLimitExceeded", 503), "InternalError", "Unavailable"),
    "ec2-moto": (("RequestLimitExceeded", 503), "InternalError", "Unavailable"),
    "pricing": (
        ("ThrottlingException", 400),
        "InternalErrorException",
        "ServiceUnavailableException",
    ),
    "servicequotas": (("TooManyRequestsException", 400), "ServiceException", "ServiceException"),
    "sqs": (("ThrottlingException", 400), "InternalError", "ServiceUnavailable"),
    "s3": (("SlowDown", 503), "InternalError", "ServiceUnavailable"),
}


@pytest.mark.parametrize("service", CHAOS_CALLS)
def test_random_faults_answer_in_each_services_own_shape(fake_aws: FakeAWS, service: str) -> None:
    name, call = CHAOS_CALLS[service]
    client = fake_aws.client(name, "us-east-1")
    (throttle, throttle_status), code_500, code_503 = CHAOS_ANSWERS[service]
    fake_aws.chaos = Chaos(rate=1.0, kinds=("throttle",))
    with pytest.raises(ClientError) as err:
        call(client)
    resp = err.value.response
    assert (resp["Error"]["Code"], resp["ResponseMetadata"]["HTTPStatusCode"]) == (
        throttle,
        throttle_status,
    )
    assert resp["ResponseMetadata"]["HTTPHeaders"]["retry-after"] == "1"
    fake_aws.chaos = Chaos(rate=1.0, kinds=("5xx",), seed=3)
    seen = set()
    for _ in range(12):
        with pytest.raises(ClientError) as err:
            call(client)
        resp = err.value.response
        seen.add((resp["Error"]["Code"], resp["ResponseMetadata"]["HTTPStatusCode"]))
    assert seen == {(code_500, 500), (code_503, 503)}
    assert fake_aws.faulted == {"throttle": 1, "5xx": 12}
    assert fake_aws.call_count() == 13  # faulted calls are counted too
    fake_aws.chaos = None
    call(client)


def test_a_truncated_answer_is_half_a_body(fake_aws: FakeAWS) -> None:
    ec2 = fake_aws.client("ec2", "us-east-1")
    pricing = fake_aws.client("pricing", "us-east-1")
    fake_aws.chaos = Chaos(rate=1.0, kinds=("truncated",))
    with pytest.raises(ResponseParserError):  # XML: botocore cannot parse it
        ec2.describe_spot_price_history(MaxResults=5)
    # JSON: botocore reads a body it cannot decode as an answer without data, no error;
    # the adapter's seam checks JSON bodies itself (adapters/aws/sdk.py).
    page = pricing.get_products(ServiceCode="AmazonEC2", MaxResults=1)
    assert "PriceList" not in page
    assert fake_aws.faulted == {"truncated": 2}


def test_a_timed_out_answer_comes_after_hang_seconds(fake_aws: FakeAWS) -> None:
    with contextlib.closing(
        boto3.client(
            "ec2",
            region_name="us-east-1",
            endpoint_url=fake_aws.url,
            config=NO_RETRY.merge(Config(read_timeout=0.3, connect_timeout=1)),
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
    ) as ec2:
        fake_aws.chaos = Chaos(rate=1.0, kinds=("timeout",), hang_seconds=0.6)
        with pytest.raises(ReadTimeoutError):
            ec2.describe_spot_price_history(MaxResults=5)
    fake_aws.chaos = None
    assert fake_aws.faulted == {"timeout": 1}
    patient = fake_aws.client("ec2", "us-east-1")
    assert patient.describe_spot_price_history(MaxResults=5)["SpotPriceHistory"]


def test_the_fakes_own_helper_calls_are_never_faulted(fake_aws: FakeAWS) -> None:
    fake_aws.chaos = Chaos(rate=1.0)
    url = fake_aws.create_queue("us-east-1", "spared")
    fake_aws.send_ec2_event(url, "EC2 Instance Rebalance Recommendation", {"instance-id": "i-1"})
    assert not fake_aws.faulted and fake_aws.call_count() == 0


@pytest.mark.parametrize(
    ("service", "call", "code", "status"),
    [
        ("ec2", lambda c: c.describe_spot_price_history(MaxResults=5), "RequestLimitExceeded", 503),
        ("ec2", lambda c: c.describe_regions(), "RequestLimitExceeded", 503),
        (
            "pricing",
            lambda c: c.get_products(ServiceCode="AmazonEC2", MaxResults=1),
            "ThrottlingException",
            400,
        ),
        (
            "service-quotas",
            lambda c: c.get_service_quota(ServiceCode="ec2", QuotaCode="L-DB2E81BA"),
            "TooManyRequestsException",
            400,
        ),
        ("sqs", lambda c: c.list_queues(), "ThrottlingException", 400),
    ],
)
def test_fail_returns_the_service_error_shape_then_recovers(
    fake_aws: FakeAWS, service: str, call: Any, code: str, status: int
) -> None:
    client = fake_aws.client(service, "us-east-1")
    action = client.meta.method_to_api_mapping[call.__code__.co_names[0]]
    fake_aws.fail(action, times=2, message="slow down")
    for _ in range(2):
        with pytest.raises(ClientError) as err:
            call(client)
        assert err.value.response["Error"]["Code"] == code
        assert err.value.response["Error"]["Message"] == "slow down"
        assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == status
    call(client)
    assert sum(n for (_, a, _), n in fake_aws.calls.items() if a == action) == 3


def test_fail_with_custom_code_and_region(fake_aws: FakeAWS) -> None:
    east, west = fake_aws.client("ec2", "us-east-1"), fake_aws.client("ec2", "us-west-2")
    fake_aws.fail(
        "RunInstances",
        "InsufficientInstanceCapacity",
        500,
        times=None,
        message="We currently do not have sufficient p5.48xlarge capacity",
        region="us-west-2",
    )
    run = {"ImageId": "ami-12c6146b", "MinCount": 1, "MaxCount": 1, "InstanceType": "p5.48xlarge"}
    for _ in range(3):
        with pytest.raises(ClientError) as err:
            west.run_instances(**run)
        assert err.value.response["Error"]["Code"] == "InsufficientInstanceCapacity"
        assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 500
    east.run_instances(**run)  # other regions unaffected
    fake_aws.clear_faults()
    assert west.run_instances(**run)["Instances"][0]["Placement"]["AvailabilityZone"].startswith(
        "us-west-2"
    )


def test_latency_does_not_serialise_concurrent_calls(fake_aws: FakeAWS) -> None:
    ec2 = fake_aws.client("ec2", "us-east-1")
    ec2.describe_spot_price_history(MaxResults=5)  # warm the connection pool
    fake_aws.latency = (0.1, 0.1)
    barrier = threading.Barrier(10)

    def one() -> float:
        barrier.wait()
        t = time.monotonic()
        ec2.describe_spot_price_history(MaxResults=5)
        return time.monotonic() - t

    start = time.monotonic()
    with ThreadPoolExecutor(10) as pool:
        durations = list(pool.map(lambda _: one(), range(10)))
    total = time.monotonic() - start
    assert min(durations) >= 0.1
    assert total < 1.0  # serialised would be ≥ 1.0 s


def test_calls_are_counted_per_service_action_region_and_reset(fake_aws: FakeAWS) -> None:
    fake_aws.client("ec2", "us-west-2").describe_spot_price_history(MaxResults=5)
    fake_aws.client("ec2", "eu-west-1").describe_spot_price_history(MaxResults=5)
    fake_aws.client("pricing", "us-east-1").get_products(ServiceCode="AmazonEC2", MaxResults=1)
    assert fake_aws.calls == {
        ("ec2", "DescribeSpotPriceHistory", "us-west-2"): 1,
        ("ec2", "DescribeSpotPriceHistory", "eu-west-1"): 1,
        ("pricing", "GetProducts", "us-east-1"): 1,
    }
    fake_aws.reset_calls()
    assert fake_aws.call_count() == 0


# ---------------------------------------------------------------------- unsigned
def test_unsigned_requests_work_and_use_the_default_region(fake_aws: FakeAWS) -> None:
    ec2 = fake_aws.client("ec2", "us-west-2", unsigned=True)
    prices = ec2.describe_spot_price_history(InstanceTypes=["p5.48xlarge"])["SpotPriceHistory"]
    assert {p["AvailabilityZone"][:-1] for p in prices} == {"us-east-1"}  # no region on the wire
    named = ec2.describe_spot_price_history(AvailabilityZone="us-west-2a")["SpotPriceHistory"]
    assert {p["AvailabilityZone"] for p in named} == {"us-west-2a"}  # ... unless the call names one
    types = ec2.describe_instance_types(InstanceTypes=["p5.48xlarge"])["InstanceTypes"]
    assert types[0]["GpuInfo"]["Gpus"][0]["Name"] == "H100"  # proxied to moto

    pricing = fake_aws.client("pricing", "us-east-1", unsigned=True)
    assert pricing.get_products(ServiceCode="AmazonEC2", MaxResults=1)["PriceList"]
    quotas = fake_aws.client("service-quotas", "us-east-1", unsigned=True)
    assert quotas.get_service_quota(ServiceCode="ec2", QuotaCode="L-DB2E81BA")["Quota"]["Value"]

    url = fake_aws.create_queue("eu-west-1", "anon")
    sqs = fake_aws.client("sqs", "eu-west-1", unsigned=True)
    fake_aws.send_ec2_event(url, "EC2 Instance Rebalance Recommendation", {"instance-id": "i-9"})
    assert sqs.receive_message(QueueUrl=url, WaitTimeSeconds=1)["Messages"]
    assert fake_aws.call_count("sqs", "ReceiveMessage", "eu-west-1") == 1  # region from QueueUrl

    with contextlib.closing(
        boto3.client(
            "ec2",
            region_name="us-east-1",
            endpoint_url=fake_aws.url,
            config=NO_RETRY.merge(Config(signature_version=UNSIGNED)),
        )
    ) as raw:
        assert raw.describe_regions()["Regions"]


# ------------------------------------------------------------ capacity reservations
def test_capacity_reservations_are_created_listed_paged_filtered_and_cancelled(
        fake_aws: FakeAWS) -> None:
    ec2 = fake_aws.client("ec2", "us-east-1")
    made = ec2.create_capacity_reservation(
        InstanceType="p4d.24xlarge", InstancePlatform="Linux/UNIX",
        AvailabilityZone="us-east-1a", InstanceCount=2, InstanceMatchCriteria="targeted",
        EndDateType="limited", EndDate=fake_aws.now + timedelta(days=2))["CapacityReservation"]
    rid = made["CapacityReservationId"]
    assert rid.startswith("cr-") and made["State"] == "active"
    assert (made["AvailabilityZoneId"], made["TotalInstanceCount"],
            made["AvailableInstanceCount"], made["InstanceMatchCriteria"],
            made["EndDateType"]) == ("use1-az6", 2, 2, "targeted", "limited")
    assert made["CapacityReservationArn"].endswith(f":capacity-reservation/{rid}")
    with pytest.raises(ClientError, match="Unsupported"):  # no p4d in us-east-1f
        ec2.create_capacity_reservation(InstanceType="p4d.24xlarge",
                                        InstancePlatform="Linux/UNIX",
                                        AvailabilityZone="us-east-1f", InstanceCount=1)
    for _ in range(6):
        ec2.create_capacity_reservation(InstanceType="g5.xlarge", InstancePlatform="Linux/UNIX",
                                        AvailabilityZone="us-east-1b", InstanceCount=1)
    fake_aws.use_capacity_reservation(rid, 2)
    pages = list(ec2.get_paginator("describe_capacity_reservations").paginate())
    assert len(pages) == 2  # five a page
    listed = {r["CapacityReservationId"]: r for p in pages for r in p["CapacityReservations"]}
    assert len(listed) == 7 and listed[rid]["AvailableInstanceCount"] == 0
    g5 = ec2.describe_capacity_reservations(
        Filters=[{"Name": "instance-type", "Values": ["g5.*"]}])["CapacityReservations"]
    assert len(g5) == 5 and {r["InstanceType"] for r in g5} == {"g5.xlarge"}
    ec2.cancel_capacity_reservation(CapacityReservationId=rid)
    active = ec2.describe_capacity_reservations(
        Filters=[{"Name": "state", "Values": ["active"]}], MaxResults=100)
    assert rid not in {r["CapacityReservationId"] for r in active["CapacityReservations"]}
    (cancelled,) = ec2.describe_capacity_reservations(
        CapacityReservationIds=[rid])["CapacityReservations"]
    assert cancelled["State"] == "cancelled"
    assert not fake_aws.client("ec2", "us-west-2").describe_capacity_reservations()[
        "CapacityReservations"]  # reservations are regional
    with pytest.raises(ClientError, match="InvalidParameterValue"):
        ec2.describe_capacity_reservations(Filters=[{"Name": "colour", "Values": ["x"]}])


def test_a_limited_capacity_reservation_expires_at_its_end_date(fake_aws: FakeAWS) -> None:
    ec2 = fake_aws.client("ec2", "us-east-1")
    end = fake_aws.now + timedelta(hours=1)
    rid = ec2.create_capacity_reservation(
        InstanceType="g5.xlarge", InstancePlatform="Linux/UNIX", AvailabilityZone="us-east-1a",
        InstanceCount=1, EndDateType="limited", EndDate=end)["CapacityReservation"][
        "CapacityReservationId"]
    fake_aws.now = end + timedelta(seconds=1)
    (r,) = ec2.describe_capacity_reservations(CapacityReservationIds=[rid])[
        "CapacityReservations"]
    assert r["State"] == "expired" and r["EndDate"] == end.replace(microsecond=0)
    assert fake_aws.call_count(action="DescribeCapacityReservations") == 1


async def test_usable_from_async_tests(fake_aws: FakeAWS) -> None:
    ec2 = fake_aws.client("ec2", "us-east-1")
    fake_aws.latency = (0.05, 0.05)
    results = await asyncio.gather(
        *(asyncio.to_thread(ec2.describe_spot_price_history, MaxResults=5) for _ in range(5))
    )
    assert all(len(r["SpotPriceHistory"]) == 5 for r in results)


def test_context_manager_without_pytest_fixture(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    with FakeAWS(default_region="eu-west-1") as fake:
        ec2 = fake.client("ec2", "us-east-1", unsigned=True)
        prices = ec2.describe_spot_price_history(MaxResults=5)["SpotPriceHistory"]
        assert {p["AvailabilityZone"][:-1] for p in prices} == {"eu-west-1"}
        url = fake.url
    host, port = url.removeprefix("http://").split(":")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=2).close()
