"""The SDK seam: Alibaba's errors, as the real Tea SDK raises them, become typed errors
by meaning; endpoints parse into the Tea config."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Iterator

import pytest
from fake_alibaba import FakeAlibaba, fake_alibaba_fixture  # noqa: F401
from fake_server import Chaos

from adapters.alibaba.sdk import AlibabaSdk, parse_endpoint, translate
from adapters.common import poll_deadline
from adapters.errors import (
    AdapterError,
    AuthFailed,
    CapacityUnavailable,
    CloudUnavailable,
    InvalidConfig,
    QuotaExceeded,
    RateLimited,
    SdkMissing,
)

REGION = "cn-hangzhou"


@pytest.fixture
def sdk(fake_alibaba: FakeAlibaba) -> Iterator[AlibabaSdk]:
    s = AlibabaSdk(endpoint=fake_alibaba.url, anonymous=True, attempts=1)
    yield s
    s.close()


@pytest.mark.parametrize(("code", "status", "typed"), [
    ("OperationDenied.NoStock", None, CapacityUnavailable),
    ("Throttling", None, RateLimited),
    ("Throttling.User", None, RateLimited),
    ("Throttling.Api", None, RateLimited),
    ("Throttling", 429, RateLimited),
    ("SomethingNew", 429, RateLimited),
    ("InvalidAccessKeyId.NotFound", None, AuthFailed),
    ("InvalidAccessKeyId", 404, AuthFailed),
    ("SignatureDoesNotMatch", None, AuthFailed),
    ("Forbidden.RAM", None, AuthFailed),
    ("Forbidden.SomethingNew", 403, AuthFailed),
    ("ServiceUnavailable", None, CloudUnavailable),
    ("InternalError", None, CloudUnavailable),
    ("ServiceUnavailable.Busy", 400, CloudUnavailable),
    ("SomethingBroke", 502, CloudUnavailable),
    ("QuotaExceed.ElasticQuota", None, QuotaExceeded),
    ("InvalidInstanceType.ValueUnauthorized", None, QuotaExceeded),
    ("InvalidRegionId.NotFound", None, InvalidConfig),
    ("InvalidParameter", None, AdapterError),
])
def test_errors_are_translated_by_meaning(fake_alibaba: FakeAlibaba, sdk: AlibabaSdk,
                                          code: str, status: int | None,
                                          typed: type[AdapterError]) -> None:
    fake_alibaba.fail("DescribeAvailableResource", code, status)
    with pytest.raises(AdapterError) as raised:
        sdk.available_resources(REGION, spot=True)
    err = raised.value
    assert type(err) is typed
    assert code in str(err) and "describe_available_resource" in str(err)
    assert err.cloud == "alibaba" and err.region == REGION
    assert err.retryable == (typed in (RateLimited, CloudUnavailable))


def test_the_retry_after_hint_is_kept_in_seconds(fake_alibaba: FakeAlibaba,
                                                 sdk: AlibabaSdk) -> None:
    fake_alibaba.fail("DescribePrice", "Throttling.User", retry_after_ms=2500)
    with pytest.raises(RateLimited) as raised:
        sdk.price(REGION, "ecs.gn7i-c8g1.2xlarge")
    assert raised.value.retry_after == 2.5


def test_a_hint_within_the_cap_is_waited_and_a_longer_one_goes_up(
        fake_alibaba: FakeAlibaba) -> None:
    s = AlibabaSdk(endpoint=fake_alibaba.url, anonymous=True, max_backoff=0.5)
    try:
        fake_alibaba.fail("DescribeAccountAttributes", "Throttling", retry_after_ms=300)
        started = time.perf_counter()
        assert s.account_attributes(REGION, ["max-spot-instance-vcpu-count"])
        assert time.perf_counter() - started >= 0.3
        assert fake_alibaba.call_count("DescribeAccountAttributes") == 2
        # Beyond the cap: not retried here; the poller waits it out before the next poll.
        fake_alibaba.fail("DescribeAccountAttributes", "Throttling", retry_after_ms=5000)
        with pytest.raises(RateLimited) as raised:
            s.account_attributes(REGION, ["max-spot-instance-vcpu-count"])
        assert raised.value.retry_after == 5.0
        assert fake_alibaba.call_count("DescribeAccountAttributes") == 3
        # Within the cap but beyond the poll's deadline: the same.
        fake_alibaba.fail("DescribeAccountAttributes", "Throttling", retry_after_ms=400)
        with poll_deadline(0.2), pytest.raises(RateLimited):
            s.account_attributes(REGION, ["max-spot-instance-vcpu-count"])
        assert fake_alibaba.call_count("DescribeAccountAttributes") == 4
    finally:
        s.close()


def test_a_refused_connection_is_cloud_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    sdk = AlibabaSdk(endpoint=f"http://127.0.0.1:{port}", anonymous=True, attempts=1)
    try:
        with pytest.raises(CloudUnavailable, match="connection failed"):
            sdk.gpu_instance_types(REGION)
    finally:
        sdk.close()


@pytest.mark.parametrize(("kind", "match"), [
    ("truncated", r"garbled answer \(cut off, or not the JSON it should be\): Failed to "
                  r"parse the value as json format"),
    ("timeout", r"connection failed or no answer in time: .*[Rr]ead timed out"),
    ("5xx", r"(InternalError|ServiceUnavailable): .*\(HTTP 50[03]"),
])
def test_faults_that_heal_are_cloud_unavailable_and_tried_once_per_attempt(
        fake_alibaba: FakeAlibaba, kind: str, match: str) -> None:
    fake_alibaba.chaos = Chaos(rate=1.0, kinds=(kind,), hang_seconds=0.6)
    sdk = AlibabaSdk(endpoint=fake_alibaba.url, anonymous=True, attempts=1,
                     call_timeout=0.2)
    try:
        started = time.perf_counter()
        with pytest.raises(CloudUnavailable, match=match) as raised:
            sdk.price(REGION, "ecs.gn7i-c8g1.2xlarge")
        assert raised.value.retryable
        assert time.perf_counter() - started < 0.6  # the call timeout, not the hang
        # One attempt at the seam is one call at the cloud: the SDK's own retries are off.
        assert fake_alibaba.faulted[kind] == 1
    finally:
        sdk.close()


def test_the_call_timeout_reaches_the_tea_client(fake_alibaba: FakeAlibaba) -> None:
    sdk = AlibabaSdk(endpoint=fake_alibaba.url, anonymous=True, call_timeout=2.5)
    try:
        client = sdk.client(REGION)
        assert (client._connect_timeout, client._read_timeout) == (2500, 2500)
        assert client._retry_options is not None and not client._retry_options.retryable
    finally:
        sdk.close()


def test_something_that_is_not_an_sdk_error_is_not_swallowed() -> None:
    with pytest.raises(KeyError):
        raise translate(KeyError("a bug"))


@pytest.mark.parametrize(("url", "parsed"), [
    ("http://127.0.0.1:8080", ("127.0.0.1:8080", "http")),
    ("http://127.0.0.1:8080/", ("127.0.0.1:8080", "http")),
    ("https://ecs.example.internal", ("ecs.example.internal", "https")),
    ("https://[::1]:8443", ("[::1]:8443", "https")),
])
def test_endpoint_urls_become_the_tea_endpoint_and_protocol(url: str,
                                                           parsed: tuple[str, str]) -> None:
    assert parse_endpoint(url) == parsed


@pytest.mark.parametrize("url", ["127.0.0.1:8080", "ftp://host", "http://host/ecs",
                                 "http://host:99999", "http://host?x=1"])
def test_bad_endpoint_urls_are_invalid_config(url: str) -> None:
    with pytest.raises(InvalidConfig, match=r"clouds\.alibaba\.endpoint"):
        parse_endpoint(url)


def test_a_missing_sdk_says_which_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from broker.daemon.config import parse_config
    from broker.market.clouds import build_adapters

    monkeypatch.setitem(sys.modules, "alibabacloud_ecs20140526", None)  # not installed
    with pytest.raises(SdkMissing, match=r"pip install 'gpubroker\[alibaba\]'"):
        AlibabaSdk()
    cfg = parse_config("clouds:\n  alibaba: {regions: [cn-hangzhou]}\n")
    adapters, problems = build_adapters(cfg)
    assert adapters == [] and problems == [
        ("alibaba", "Alibaba Cloud support needs alibabacloud-ecs20140526: "
                    "pip install 'gpubroker[alibaba]'")]
