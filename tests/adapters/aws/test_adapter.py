"""The AWS adapter with real boto3 against the fake AWS endpoint (moto behind it for
EC2 and SQS; the price snapshot for spot, on-demand prices and placement scores)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
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
from fake_server import CHAOS_KINDS, Chaos

from adapters.aws.adapter import AwsAdapter, Refresh, from_config
from adapters.aws.sdk import AwsSdk, retry_after_of, translate
from adapters.common import RetryPolicy
from adapters.errors import (
    AdapterError,
    AuthFailed,
    CapacityUnavailable,
    CloudUnavailable,
    PriceTooLow,
    QuotaExceeded,
    RateLimited,
)
from broker.daemon.config import AwsConfig
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
        # The seam's attempts, each one HTTP call: botocore itself never retries.
        assert fake_aws.call_count(action="DescribeInstanceTypes") == a.sdk.retry.attempts
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
                   refresh=Refresh(on_demand=0, placement_scores=0, quotas=0,
                                   interruption_rates=0))
    a.sdk.retry.max_backoff = 0.05
    try:
        good = by_key(await a.poll(REGION))
        fake_aws.fail("GetProducts", times=None)
        fake_aws.fail("GetSpotPlacementScores", times=None)
        fake_aws.fail("GetServiceQuota", times=None)
        fake_aws.fail("GetObject", times=None)
        again = by_key(await a.poll(REGION))  # does not raise
        for key, offer in good.items():
            assert again[key].price_per_hour == offer.price_per_hour or \
                key.market is Market.SPOT
            assert again[key].availability == offer.availability
            assert again[key].quota_headroom == offer.quota_headroom
            assert again[key].interruption_rate == offer.interruption_rate
        assert any(o.interruption_rate for o in good.values())
    finally:
        await a.close()


async def test_a_first_poll_whose_prices_fail_fails_typed_never_unpriced(
        fake_aws: FakeAWS) -> None:
    a = AwsAdapter(regions=[REGION], endpoint=fake_aws.url)
    a.sdk.retry.max_backoff = 0.05
    try:
        fake_aws.fail("GetProducts", times=None)  # ThrottlingException, every attempt
        with pytest.raises(RateLimited, match="GetProducts"):
            await a.poll(REGION)
        fake_aws.clear_faults()
        offers = await a.poll(REGION)
        od = find(offers, "p5.48xlarge", Market.ON_DEMAND)
        assert od and od[0].price_per_hour == fake_aws.on_demand_price(REGION, "p5.48xlarge")
        # Types the catalog has no on-demand price for are listed, unpriced.
        unpriced = {o.pool.instance_type for o in offers
                    if o.pool.market is Market.ON_DEMAND and o.price_per_hour is None}
        assert unpriced
        assert all(fake_aws.on_demand_price(REGION, t) is None for t in unpriced)
    finally:
        await a.close()


async def test_a_first_poll_without_optional_answers_lists_them_unknown(
        fake_aws: FakeAWS) -> None:
    a = AwsAdapter(regions=[REGION], endpoint=fake_aws.url)
    a.sdk.retry.max_backoff = 0.05
    try:
        fake_aws.fail("GetSpotPlacementScores", times=None)
        fake_aws.fail("GetServiceQuota", code="ServiceException", status=500, times=None)
        fake_aws.fail("GetObject", code="SlowDown", status=503, times=None)
        offers = await a.poll(REGION)
        spot = [o for o in offers if o.pool.market is Market.SPOT]
        assert spot and all(o.price_per_hour for o in find(offers, "g5.xlarge", Market.SPOT))
        assert all(o.availability is None and o.quota_headroom is None
                   and o.interruption_rate is None for o in spot)
    finally:
        await a.close()


async def test_a_failed_refresh_of_types_and_offerings_keeps_the_last_good_copy(
        fake_aws: FakeAWS) -> None:
    a = AwsAdapter(regions=[REGION], endpoint=fake_aws.url,
                   refresh=Refresh(instance_types=0, offerings=0))
    a.sdk.retry.max_backoff = 0.05
    try:
        good = by_key(await a.poll(REGION))
        fake_aws.fail("DescribeInstanceTypes", code="InternalError", status=500, times=None)
        fake_aws.fail("DescribeInstanceTypeOfferings", code="Unavailable", status=503,
                      times=None)
        again = by_key(await a.poll(REGION))
        assert again.keys() == good.keys()
        # Spot prices are what a poll is for: without them it fails.
        fake_aws.fail("DescribeSpotPriceHistory", code="InternalError", status=500,
                      times=None)
        with pytest.raises(CloudUnavailable, match="DescribeSpotPriceHistory"):
            await a.poll(REGION)
    finally:
        await a.close()


# --- interruption rates (Spot Instance Advisor) ----------------------------------------

async def test_spot_offers_carry_the_advisors_interruption_rate(fake_aws: FakeAWS) -> None:
    fake_aws.set_interruption_band(REGION, "g5.xlarge", 0)  # <5%
    fake_aws.set_interruption_band(REGION, "p5.48xlarge", 4)  # >20%
    fake_aws.set_interruption_band(REGION, "g6.xlarge", 2, os_name="Windows")  # not Linux
    fake_aws.set_interruption_band(REGION, "g6.xlarge", None)
    a = AwsAdapter(regions=[REGION], endpoint=fake_aws.url)
    try:
        offers = await a.poll(REGION)
    finally:
        await a.close()
    rate = {(o.pool.instance_type, o.pool.market): o.interruption_rate for o in offers}
    assert rate[("g5.xlarge", Market.SPOT)] == pytest.approx(-math.log(1 - 0.025) / 730,
                                                            rel=1e-3)
    assert rate[("p5.48xlarge", Market.SPOT)] == pytest.approx(-math.log(1 - 0.25) / 730,
                                                              rel=1e-3)
    assert rate[("g6.xlarge", Market.SPOT)] is None  # not in the document: unknown
    assert rate[("g5.xlarge", Market.ON_DEMAND)] is None
    gap = fake_aws.advisor_gaps[REGION]
    assert all(o.interruption_rate is None for o in offers if o.pool.instance_type == gap)
    listed = fake_aws.spot_advisor["spot_advisor"][REGION]["Linux"]
    assert {o.pool.instance_type for o in offers
            if o.interruption_rate is not None} <= set(listed)


async def test_spot_rates_carry_when_the_advisor_published_them(fake_aws: FakeAWS) -> None:
    """AWS republishes the advisor document every few months: its Last-Modified, not the
    fetch, is when the rate was observed; a re-read after a republication moves it."""
    published = datetime(2026, 9, 1, 12, 0, tzinfo=UTC)
    fake_aws.advisor_modified = published
    clock = [1000.0]
    a = AwsAdapter(regions=[REGION], endpoint=fake_aws.url, monotonic=lambda: clock[0])
    try:
        offers = await a.poll(REGION)
        rated = [o for o in offers if o.interruption_rate is not None]
        assert rated and all(o.pool.market is Market.SPOT for o in rated)
        assert {o.rate_observed_at for o in rated} == {published}
        assert all(o.observed_at > published for o in rated)  # the read, not the rate
        assert all(o.rate_observed_at is None for o in offers if o.interruption_rate is None)
        row = rated[0].to_json()
        assert row["rate_observed_at"] == "2026-09-01T12:00:00.000Z"
        assert Offer.from_record(rated[0].to_record()).rate_observed_at == published
        assert "rate_observed_at" not in find(offers, "g5.xlarge", Market.ON_DEMAND)[0].to_json()
        fake_aws.advisor_modified = republished = published + timedelta(days=90)
        clock[0] += 6 * 3600 + 1
        offers = await a.poll(REGION)
        assert {o.rate_observed_at for o in offers if o.interruption_rate is not None} == {
            republished}
    finally:
        await a.close()


async def test_the_advisor_document_is_read_once_for_all_regions_and_cached(
        fake_aws: FakeAWS) -> None:
    clock = [1000.0]
    a = AwsAdapter(regions=[REGION, "us-west-2"], endpoint=fake_aws.url,
                   monotonic=lambda: clock[0])
    try:
        await asyncio.gather(a.poll(REGION), a.poll("us-west-2"))
        assert fake_aws.call_count("s3", "GetObject") == 1
        fake_aws.set_interruption_band(REGION, "g5.xlarge", 4)
        clock[0] += 6 * 3600 - 1  # still fresh
        offers = await a.poll(REGION)
        assert fake_aws.call_count("s3", "GetObject") == 1
        before = find(offers, "g5.xlarge", Market.SPOT)[0].interruption_rate
        clock[0] += 2  # six hours on: read again
        offers = await a.poll(REGION)
        assert fake_aws.call_count("s3", "GetObject") == 2
        after = find(offers, "g5.xlarge", Market.SPOT)[0].interruption_rate
        assert after == pytest.approx(3.941e-4) and after != before
    finally:
        await a.close()


async def test_an_advisor_that_fails_leaves_rates_unknown_until_it_answers(
        fake_aws: FakeAWS) -> None:
    a = AwsAdapter(regions=[REGION, "us-west-2"], endpoint=fake_aws.url)
    a.sdk.retry.attempts, a.sdk.retry.max_backoff = 3, 0.05
    try:
        fake_aws.fail("GetObject", times=None)  # SlowDown, 503
        first = await asyncio.gather(a.poll(REGION), a.poll("us-west-2"))
        assert all(o.interruption_rate is None for offers in first for o in offers)
        assert fake_aws.call_count("s3", "GetObject") == 3  # one fetch for both regions
        fake_aws.clear_faults()
        offers = await a.poll(REGION)  # not cached yet: asked again
        assert any(o.interruption_rate for o in offers)
        assert fake_aws.call_count("s3", "GetObject") == 4
    finally:
        await a.close()


async def test_an_unreadable_advisor_document_leaves_rates_unknown(fake_aws: FakeAWS
                                                                   ) -> None:
    fake_aws.spot_advisor = {"something": "else"}
    a = AwsAdapter(regions=[REGION], endpoint=fake_aws.url)
    try:
        offers = await a.poll(REGION)
        assert offers and all(o.interruption_rate is None for o in offers)
        assert fake_aws.call_count("s3", "GetObject") == 1  # not retried: it won't heal
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


def unreadable_answers() -> list[Exception]:
    import botocore.exceptions as bex
    from botocore.parsers import ResponseParserError

    return [ResponseParserError("Unable to parse response (no element found)"),
            bex.IncompleteReadError(actual_bytes=10, expected_bytes=20),
            bex.ConnectionClosedError(endpoint_url="http://x"),
            bex.ReadTimeoutError(endpoint_url="http://x"),
            bex.ConnectTimeoutError(endpoint_url="http://x"),
            json.JSONDecodeError("Expecting value", '{"PriceList": [', 15),
            ConnectionResetError(104, "Connection reset by peer")]


@pytest.mark.parametrize("exc", unreadable_answers(), ids=lambda e: type(e).__name__)
def test_answers_that_did_not_arrive_whole_are_retryable(exc: Exception) -> None:
    err = translate(exc, REGION)
    assert type(err) is CloudUnavailable and err.retryable and err.region == REGION


@pytest.mark.parametrize(("headers", "expect"), [
    ({}, None),
    ({"retry-after": "1"}, 1.0),
    ({"retry-after": "2.5"}, 2.5),
    ({"retry-after": "Wed, 21 Oct 2015 07:28:03 GMT"}, 3.0),  # an HTTP date
    ({"retry-after": "soon"}, None),
    ({"x-amz-retry-after": "1500", "retry-after": "9"}, 1.5),  # milliseconds, first
    ({"x-amz-retry-after": "-1", "retry-after": "2"}, 2.0),
])
def test_a_throttles_retry_after_is_read_from_the_answer(
        headers: dict[str, str], expect: float | None) -> None:
    now = datetime(2015, 10, 21, 7, 28, 0, tzinfo=UTC).timestamp()
    assert retry_after_of(headers, now) == expect
    from botocore.exceptions import ClientError

    err = translate(ClientError({"Error": {"Code": "ThrottlingException", "Message": "m"},
                                 "ResponseMetadata": {"HTTPStatusCode": 400,
                                                      "HTTPHeaders": {"retry-after": "1"}}},
                                "GetProducts"))
    assert isinstance(err, RateLimited) and err.retry_after == 1.0


SEAM_CALLS: dict[str, Any] = {  # one call of each protocol the adapter speaks
    "ec2-xml": lambda sdk, q: sdk.spot_prices(REGION, ["g5.xlarge"],
                                              datetime.now(UTC) - timedelta(days=1)),
    "pricing-json": lambda sdk, q: sdk.on_demand_products(REGION, "g5.xlarge"),
    "quotas-json": lambda sdk, q: sdk.quota(REGION, "L-DB2E81BA"),
    "sqs-json": lambda sdk, q: sdk.receive(REGION, q, wait_seconds=0),
    "s3-advisor": lambda sdk, q: sdk.spot_advisor_document(),
}


@pytest.mark.parametrize("kind", CHAOS_KINDS)
@pytest.mark.parametrize("call", SEAM_CALLS)
def test_every_fault_is_one_call_and_a_retryable_typed_error(
        fake_aws: FakeAWS, call: str, kind: str) -> None:
    queue = fake_aws.create_queue(REGION, "q")
    sdk = AwsSdk(endpoint=fake_aws.url, call_timeout=0.5, retry=RetryPolicy(attempts=1))
    try:
        fake_aws.chaos = Chaos(rate=1.0, kinds=(kind,), hang_seconds=1.0)
        with pytest.raises((RateLimited, CloudUnavailable)) as err:
            SEAM_CALLS[call](sdk, queue)
        assert err.value.retryable
        if kind == "throttle":
            assert isinstance(err.value, RateLimited) and err.value.retry_after == 1.0
        else:
            assert isinstance(err.value, CloudUnavailable)
        assert fake_aws.call_count() == 1  # botocore made one attempt, no retry of its own
        fake_aws.chaos = None
        SEAM_CALLS[call](sdk, queue)  # and the same call heals
    finally:
        sdk.close()


def test_the_configured_call_timeout_reaches_every_client(fake_aws: FakeAWS) -> None:
    section = AwsConfig(regions=[REGION], endpoint=fake_aws.url, call_timeout_seconds=3)
    a = from_config(section)
    try:
        for service in ("ec2", "pricing", "service-quotas", "sqs"):
            config = a.sdk.client(service, REGION).meta.config
            assert (config.connect_timeout, config.read_timeout) == (3, 3)
            assert config.retries["total_max_attempts"] == 1  # one retry layer: ours
        public = a.sdk.client("s3", REGION, public=True).meta.config
        assert (public.connect_timeout, public.read_timeout) == (3, 3)
    finally:
        asyncio.run(a.close())


class Sent(Exception):
    """Raised instead of sending a request, to look at it."""


@pytest.mark.parametrize(("endpoint", "url"), [
    (None, "https://spot-bid-advisor.s3.amazonaws.com/spot-advisor-data.json"),
    ("http://127.0.0.1:9", "http://127.0.0.1:9/spot-bid-advisor/spot-advisor-data.json"),
])
def test_the_advisor_document_is_asked_for_unsigned_at_its_public_url(
        fake_aws: FakeAWS, endpoint: str | None, url: str) -> None:
    sdk = AwsSdk(endpoint=endpoint, retry=RetryPolicy(attempts=1))
    seen: list[Any] = []

    def capture(request: Any, **_: Any) -> None:
        seen.append(request)
        raise Sent

    sdk.client("s3", "us-east-1", public=True).meta.events.register("before-send", capture)
    try:
        with pytest.raises(Sent):  # nothing leaves the machine
            sdk.spot_advisor_document()
    finally:
        sdk.close()
    assert seen[0].url == url and seen[0].method == "GET"
    assert "Authorization" not in seen[0].headers  # credentials are in the environment


def test_a_quota_aws_does_not_know_is_none_by_its_error_code(fake_aws: FakeAWS) -> None:
    sdk = AwsSdk(endpoint=fake_aws.url, retry=RetryPolicy(attempts=3, max_backoff=0.05))
    try:
        assert sdk.quota(REGION, "L-00000000") is None
        assert fake_aws.call_count(action="GetServiceQuota") == 1  # not retried
        # The code decides, not the words: a denial mentioning it is still a denial.
        fake_aws.fail("GetServiceQuota", code="AccessDeniedException", status=400,
                      message="NoSuchResourceException? not authorized", times=1)
        with pytest.raises(AuthFailed):
            sdk.quota(REGION, "L-DB2E81BA")
        assert sdk.quota(REGION, "L-DB2E81BA") == 64.0
    finally:
        sdk.close()


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


async def test_a_notice_whose_instance_cannot_be_described_yet_is_not_lost(
        fake_aws: FakeAWS) -> None:
    queue = fake_aws.create_queue(REGION, "interruptions")
    fake_aws.client("sqs", REGION).set_queue_attributes(
        QueueUrl=queue, Attributes={"VisibilityTimeout": "1"})
    a = AwsAdapter(regions=[REGION], endpoint=fake_aws.url, interruption_queue_url=queue)
    a.sdk.retry.attempts, a.sdk.retry.max_backoff = 2, 0.05
    leased_id = launch(fake_aws, "g5.xlarge", "us-east-1b", spot=True)
    leased = PoolKey("aws", REGION, "us-east-1b", "g5.xlarge", Market.SPOT)
    # Every attempt of the first try to describe the instance fails (a 5xx): the warning
    # stays on the queue and comes back after its visibility timeout.
    fake_aws.fail("DescribeInstances", code="InternalError", status=500, times=2)
    fake_aws.send_ec2_event(queue, "EC2 Spot Instance Interruption Warning",
                            {"instance-id": leased_id, "instance-action": "terminate"})
    try:
        async with contextlib.aclosing(a.signals(lambda: {leased})) as gen:
            sig = await next_signal(gen, timeout=20)
            assert sig.pool == leased and sig.kind is SignalKind.INTERRUPTED
            assert fake_aws.call_count(action="DescribeInstances") == 3
            assert fake_aws.call_count(action="ReceiveMessage") >= 2  # received again
            # Delivered to this consumer, not yet deleted: that waits for its next ask.
            assert fake_aws.call_count(action="DeleteMessageBatch") == 0
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
