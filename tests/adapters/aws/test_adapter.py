"""The AWS adapter with real boto3 against the fake AWS endpoint (moto behind it for
EC2 and SQS; the price snapshot for spot, on-demand prices and placement scores)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from fake_aws import FakeAWS, fake_aws_fixture  # noqa: F401

from adapters.aws.adapter import AwsAdapter, Refresh
from adapters.aws.sdk import translate
from adapters.errors import (
    AdapterError,
    AuthFailed,
    CapacityUnavailable,
    CloudUnavailable,
    PriceTooLow,
    QuotaExceeded,
    RateLimited,
)
from broker.model import CapacitySignal, Market, Offer, PoolKey, SignalKind

REGION = "us-east-1"
FAST = Refresh()


@pytest.fixture
async def adapter(fake_aws: FakeAWS) -> AsyncIterator[AwsAdapter]:
    a = AwsAdapter(regions=[REGION, "us-west-2"], endpoint=fake_aws.url)
    yield a
    await a.close()


def by_key(offers: list[Offer]) -> dict[PoolKey, Offer]:
    return {o.pool: o for o in offers}


def find(offers: list[Offer], itype: str, market: Market) -> list[Offer]:
    return [o for o in offers if o.pool.instance_type == itype and o.pool.market is market]


async def test_poll_maps_inventory_offerings_and_prices(fake_aws: FakeAWS,
                                                        adapter: AwsAdapter) -> None:
    offers = await adapter.poll(REGION)
    assert offers and all(o.pool.cloud == "aws" and o.pool.region == REGION for o in offers)
    assert len(by_key(offers)) == len(offers)

    p5 = find(offers, "p5.48xlarge", Market.ON_DEMAND)
    assert {o.pool.zone for o in p5} == {f"us-east-1{z}" for z in "abcdef"}
    o = p5[0]
    assert (o.gpu, o.gpus, o.gpu_memory_gb, o.vcpus, o.memory_gb) == (
        "H100-80GB", 8, 80.0, 192, 2048.0)
    assert o.price_per_hour == fake_aws.on_demand_price(REGION, "p5.48xlarge")
    assert o.quota_headroom == 8  # P on-demand quota 192 vCPUs / 192 vCPUs × 8 GPUs
    assert o.availability is None and o.interruption_rate is None

    # p4d and p4de share GpuInfo name "A100"; only the memory tells them apart.
    assert {o.gpu for o in find(offers, "p4d.24xlarge", Market.SPOT)} == {"A100-40GB"}
    assert {o.gpu for o in offers if o.pool.instance_type.startswith("g5.")} == {"A10G"}
    assert {o.gpu for o in offers if o.pool.instance_type.startswith("g6e.")} == {"L40S"}

    for spot in find(offers, "g5.xlarge", Market.SPOT):
        expected = fake_aws.spot_price(REGION, spot.pool.zone, "g5.xlarge")
        assert spot.price_per_hour == expected
        assert spot.availability is not None and 0.1 <= spot.availability <= 1.0
        assert spot.quota_headroom == 16  # G spot quota 64 vCPUs / 4 vCPUs × 1 GPU


async def test_second_poll_asks_only_for_what_changed(fake_aws: FakeAWS,
                                                      adapter: AwsAdapter) -> None:
    await adapter.poll(REGION)
    first = fake_aws.call_count(region=REGION) + fake_aws.call_count(service="pricing")
    zone = "us-east-1b"
    fake_aws.set_spot_price(REGION, zone, "g5.xlarge", 0.1234)
    fake_aws.reset_calls()
    offers = await adapter.poll(REGION)
    assert by_key(offers)[PoolKey("aws", REGION, zone, "g5.xlarge", Market.SPOT)
                          ].price_per_hour == 0.1234
    # Only spot price history again: types, offerings, prices, scores and quotas are cached.
    assert set(fake_aws.calls) == {("ec2", "DescribeSpotPriceHistory", REGION)}
    assert fake_aws.call_count() < first / 10


async def test_throttling_is_retried(fake_aws: FakeAWS, adapter: AwsAdapter) -> None:
    fake_aws.fail("DescribeSpotPriceHistory", times=2)  # RequestLimitExceeded, 503
    offers = await adapter.poll(REGION)
    assert offers
    assert fake_aws.call_count(action="DescribeSpotPriceHistory") >= 3


async def test_an_api_that_stays_down_fails_the_poll_typed(fake_aws: FakeAWS) -> None:
    a = AwsAdapter(regions=[REGION], endpoint=fake_aws.url)
    a.sdk.retry.max_backoff = 0.05  # keep the test fast; the schedule is what is tested
    try:
        fake_aws.fail("DescribeInstanceTypes", code="InternalError", status=500, times=None)
        with pytest.raises(CloudUnavailable):
            await a.poll(REGION)
        assert fake_aws.call_count(action="DescribeInstanceTypes") == 4  # attempts
        fake_aws.clear_faults()
        fake_aws.fail("DescribeInstanceTypes", code="UnauthorizedOperation", status=403,
                      times=None)
        fake_aws.reset_calls()
        with pytest.raises(AuthFailed):
            await a.poll(REGION)
        assert fake_aws.call_count(action="DescribeInstanceTypes") == 1  # never retried
    finally:
        await a.close()


async def test_optional_answers_keep_the_last_good_copy(fake_aws: FakeAWS) -> None:
    a = AwsAdapter(regions=[REGION], endpoint=fake_aws.url,
                   refresh=Refresh(on_demand=0, placement_scores=0, quotas=0))
    a.sdk.retry.max_backoff = 0.05
    try:
        good = by_key(await a.poll(REGION))
        fake_aws.fail("GetProducts", times=None)
        fake_aws.fail("GetSpotPlacementScores", times=None)
        fake_aws.fail("GetServiceQuota", times=None)
        again = by_key(await a.poll(REGION))  # does not raise
        for key, offer in good.items():
            assert again[key].price_per_hour == offer.price_per_hour or \
                key.market is Market.SPOT
            assert again[key].availability == offer.availability
            assert again[key].quota_headroom == offer.quota_headroom
    finally:
        await a.close()


async def test_without_any_price_copy_on_demand_is_listed_unpriced(fake_aws: FakeAWS
                                                                   ) -> None:
    a = AwsAdapter(regions=[REGION], endpoint=fake_aws.url)
    a.sdk.retry.max_backoff = 0.05
    try:
        fake_aws.fail("GetProducts", times=None)
        offers = await a.poll(REGION)
        od = [o for o in offers if o.pool.market is Market.ON_DEMAND]
        assert od and all(o.price_per_hour is None for o in od)
    finally:
        await a.close()


async def test_no_credentials_is_one_clear_auth_error(fake_aws: FakeAWS,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var)
    a = AwsAdapter(regions=[REGION], endpoint=fake_aws.url)
    try:
        with pytest.raises(AuthFailed, match="standard chain"):
            await a.poll(REGION)
    finally:
        await a.close()


async def test_anonymous_mode_sends_no_credentials(fake_aws: FakeAWS,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var)
    a = AwsAdapter(regions=[REGION], endpoint=fake_aws.url, anonymous=True)
    try:
        offers = await a.poll(REGION)
        assert find(offers, "p5.48xlarge", Market.SPOT)
    finally:
        await a.close()


def client_error(code: str, status: int = 400) -> Exception:
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": "m"},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "RunInstances")


@pytest.mark.parametrize(("code", "status", "typed"), [
    ("InsufficientInstanceCapacity", 500, CapacityUnavailable),
    ("MaxSpotInstanceCountExceeded", 400, QuotaExceeded),
    ("VcpuLimitExceeded", 400, QuotaExceeded),
    ("SpotMaxPriceTooLow", 400, PriceTooLow),
    ("RequestLimitExceeded", 503, RateLimited),
    ("Throttling", 400, RateLimited),
    ("ThrottlingException", 400, RateLimited),
    ("AuthFailure", 401, AuthFailed),
    ("UnauthorizedOperation", 403, AuthFailed),
    ("InternalError", 500, CloudUnavailable),
    ("SomethingElse", 502, CloudUnavailable),
    ("InvalidParameterValue", 400, AdapterError),
])
def test_errors_are_translated_by_meaning(code: str, status: int,
                                          typed: type[AdapterError]) -> None:
    err = translate(client_error(code, status), REGION)
    assert type(err) is typed
    assert code in str(err) and err.cloud == "aws" and err.region == REGION
    assert err.retryable == (typed in (RateLimited, CloudUnavailable))


def test_connection_errors_are_cloud_unavailable() -> None:
    from botocore.exceptions import EndpointConnectionError

    err = translate(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert isinstance(err, CloudUnavailable) and err.retryable


# --- interruption notices ----------------------------------------------------------

def launch(fake_aws: FakeAWS, itype: str, zone: str, spot: bool) -> str:
    ec2 = fake_aws.client("ec2", REGION)
    kwargs: dict[str, Any] = {}
    if spot:
        kwargs["InstanceMarketOptions"] = {"MarketType": "spot"}
    r = ec2.run_instances(ImageId="ami-12c6146b", InstanceType=itype, MinCount=1, MaxCount=1,
                          Placement={"AvailabilityZone": zone}, **kwargs)
    return str(r["Instances"][0]["InstanceId"])


async def next_signal(gen: Any, timeout: float = 10) -> CapacitySignal:
    async with asyncio.timeout(timeout):
        return await anext(gen)  # type: ignore[no-any-return]


async def test_interruption_warning_becomes_a_signal_for_a_leased_pool(
        fake_aws: FakeAWS) -> None:
    queue = fake_aws.create_queue(REGION, "interruptions")
    a = AwsAdapter(regions=[REGION], endpoint=fake_aws.url, interruption_queue_url=queue)
    leased_id = launch(fake_aws, "g5.xlarge", "us-east-1b", spot=True)
    other_id = launch(fake_aws, "g5.xlarge", "us-east-1c", spot=True)
    leased = PoolKey("aws", REGION, "us-east-1b", "g5.xlarge", Market.SPOT)
    try:
        async with contextlib.aclosing(a.signals(lambda: {leased})) as gen:
            # A notice for a pool the broker does not lease, a state change, then ours.
            fake_aws.send_ec2_event(queue, "EC2 Spot Instance Interruption Warning",
                                    {"instance-id": other_id, "instance-action": "terminate"})
            fake_aws.send_ec2_event(queue, "EC2 Instance State-change Notification",
                                    {"instance-id": leased_id, "state": "running"})
            sent = datetime.now(UTC)
            fake_aws.send_ec2_event(queue, "EC2 Spot Instance Interruption Warning",
                                    {"instance-id": leased_id, "instance-action": "terminate"})
            sig = await next_signal(gen)
            assert sig.pool == leased and sig.kind is SignalKind.INTERRUPTED
            assert leased_id in sig.detail and "terminate" in sig.detail
            assert sig.received_at - sent < timedelta(seconds=5)
            fake_aws.send_ec2_event(queue, "EC2 Instance Rebalance Recommendation",
                                    {"instance-id": leased_id})
            rebalance = await next_signal(gen)
            assert rebalance.kind is SignalKind.REBALANCE and rebalance.pool == leased
    finally:
        await a.close()


async def test_garbage_on_the_queue_is_dropped(fake_aws: FakeAWS) -> None:
    queue = fake_aws.create_queue(REGION, "interruptions")
    a = AwsAdapter(regions=[REGION], endpoint=fake_aws.url, interruption_queue_url=queue)
    leased_id = launch(fake_aws, "p5.48xlarge", "us-east-1a", spot=True)
    leased = PoolKey("aws", REGION, "us-east-1a", "p5.48xlarge", Market.SPOT)
    sqs = fake_aws.client("sqs", REGION)
    try:
        async with contextlib.aclosing(a.signals(lambda: {leased})) as gen:
            sqs.send_message(QueueUrl=queue, MessageBody="not json")
            sqs.send_message(QueueUrl=queue, MessageBody=json.dumps({"detail-type": "x"}))
            fake_aws.send_ec2_event(queue, "EC2 Spot Instance Interruption Warning",
                                    {"instance-id": "i-0000000000000dead",
                                     "instance-action": "terminate"})
            fake_aws.send_ec2_event(queue, "EC2 Spot Instance Interruption Warning",
                                    {"instance-id": leased_id, "instance-action": "stop"})
            sig = await next_signal(gen)
            assert sig.pool == leased
        # Everything read was deleted from the queue.
        left = sqs.get_queue_attributes(QueueUrl=queue,
                                        AttributeNames=["ApproximateNumberOfMessages"])
        assert left["Attributes"]["ApproximateNumberOfMessages"] == "0"
    finally:
        await a.close()


# --- the command line ----------------------------------------------------------------

def test_offers_command_lists_the_regions_gpu_types(fake_aws: FakeAWS, tmp_path: Path
                                                    ) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({"clouds": {"aws": {"regions": [REGION],
                                                      "endpoint": fake_aws.url}}}))
    r = subprocess.run([sys.executable, "-m", "broker.cli", "offers", "--config", str(cfg),
                        "--format", "json"], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ), check=False)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    types = {row["instance_type"] for row in rows}
    assert {"p5.48xlarge", "p4d.24xlarge", "g5.xlarge", "g6.xlarge"} <= types
    assert {row["cloud"] for row in rows} == {"aws"}
    priced = [row["price_per_gpu_hour"] for row in rows if row["price_per_gpu_hour"]]
    assert priced == sorted(priced)
