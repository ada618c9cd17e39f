"""The Azure SDK seam: the real ComputeManagementClient and the aiohttp price client
against the fake Azure endpoint — paging, error translation, retries, timeouts, garbled
answers, credentials."""

from __future__ import annotations

import math
import socket
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime

import pytest
from fake_azure import FakeAzure, fake_azure_fixture  # noqa: F401
from fake_server import Chaos

from adapters.azure import pricing
from adapters.azure.sdk import AzureSdk, RetailPrices, rebase, retry_after_of
from adapters.common import RetryPolicy
from adapters.errors import (
    AdapterError,
    AuthFailed,
    CapacityUnavailable,
    CloudUnavailable,
    InvalidConfig,
    QuotaExceeded,
    RateLimited,
)

REGION = "eastus"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def sdk(fake_azure: FakeAzure) -> Iterator[AzureSdk]:
    s = AzureSdk(subscription_id=fake_azure.subscription_id, endpoint=fake_azure.url,
                 anonymous=True, max_backoff=0.05)
    yield s
    s.close()


@pytest.fixture
async def retail(fake_azure: FakeAzure) -> AsyncIterator[RetailPrices]:
    r = RetailPrices(endpoint=fake_azure.url, max_backoff=0.05)
    yield r
    await r.close()


def test_resource_skus_follow_next_link_over_several_pages(fake_azure: FakeAzure,
                                                           sdk: AzureSdk) -> None:
    skus = sdk.resource_skus(REGION)
    vms = {s["name"] for s in skus if s["resourceType"] == "virtualMachines"}
    assert vms == set(fake_azure.sizes_in(REGION, gpu_only=False))
    assert {s["resourceType"] for s in skus} == {"virtualMachines", "disks",
                                                "availabilitySets"}
    assert fake_azure.call_count("skus", REGION) == math.ceil(len(skus) / 10) >= 3
    assert fake_azure.authorized == 0  # anonymous: no credential, no bearer token


def test_usages_and_eviction_rates_page_too(fake_azure: FakeAzure, sdk: AzureSdk) -> None:
    fake_azure.page_size["graph"] = 5
    usages = sdk.usages(REGION)
    names = {u["name"]["value"] for u in usages}
    assert {"cores", "lowPriorityCores", "StandardNCADSA100v4Family"} <= names
    assert fake_azure.call_count("usages", REGION) == math.ceil(len(usages) / 8) >= 2
    rows = pricing.graph_rows(sdk.eviction_rates(REGION))
    want = {s.lower() for s in fake_azure.sizes_in(REGION)
            if fake_azure.eviction_rate(REGION, s) is not None}
    assert {r["skuName"] for r in rows} == want
    assert fake_azure.call_count("graph", REGION) == math.ceil(len(rows) / 5) >= 3


def test_unknown_location_lists_no_skus(sdk: AzureSdk) -> None:
    assert sdk.resource_skus("atlantis") == []


def test_paging_links_are_rebased_onto_the_endpoint(fake_azure: FakeAzure,
                                                    sdk: AzureSdk) -> None:
    # As if a proxy passed the real services' links through: they must not escape it.
    fake_azure.link_base = "https://management.azure.com:443"
    assert len(sdk.resource_skus(REGION)) > 10
    assert rebase("https://prices.azure.com:443/api/retail/prices?$skip=100",
                  "http://127.0.0.1:8080/") == "http://127.0.0.1:8080/api/retail/prices?$skip=100"
    assert rebase("https://x/a?b=1", None) == "https://x/a?b=1"


async def test_retail_prices_follow_next_page_link(fake_azure: FakeAzure,
                                                   retail: RetailPrices) -> None:
    fake_azure.page_size["prices"] = 20
    fake_azure.link_base = "https://prices.azure.com:443"
    items = await retail.vm_prices(REGION)
    assert fake_azure.call_count("prices", REGION) == math.ceil(len(items) / 20) >= 5
    # The filter narrowed the answer to pay-as-you-go GPU sizes in the region ...
    assert {i["type"] for i in items} == {"Consumption"}
    assert {i["armRegionName"] for i in items} == {REGION}
    assert {i["armSkuName"] for i in items} == set(fake_azure.sizes_in(REGION))
    # ... and the adapter's reading picks the Linux prices out of it.
    prices = pricing.prices_of(items, REGION)
    size = "Standard_NC24ads_A100_v4"
    assert prices.on_demand[size.lower()] == fake_azure.on_demand_price(REGION, size)
    assert prices.spot[size.lower()] == fake_azure.spot_price(REGION, size)


@pytest.mark.parametrize(("status", "code", "typed"), [
    (409, "SkuNotAvailable", CapacityUnavailable),
    (409, "AllocationFailed", CapacityUnavailable),
    (409, "ZonalAllocationFailed", CapacityUnavailable),
    (409, "OperationNotAllowed", QuotaExceeded),
    (429, "TooManyRequests", RateLimited),
    (429, "SubscriptionRequestsThrottled", RateLimited),
    (429, "OperationNotAllowed", RateLimited),  # the Compute RP's throttle
    (401, "InvalidAuthenticationToken", AuthFailed),
    (403, "AuthorizationFailed", AuthFailed),
    (404, "SubscriptionNotFound", InvalidConfig),
    (500, "InternalServerError", CloudUnavailable),
    (502, "SomethingElse", CloudUnavailable),
    (400, "InvalidParameter", AdapterError),
])
def test_arm_errors_are_translated_by_meaning(fake_azure: FakeAzure, status: int, code: str,
                                              typed: type[AdapterError]) -> None:
    s = AzureSdk(subscription_id=fake_azure.subscription_id, endpoint=fake_azure.url,
                 anonymous=True, attempts=1)
    try:
        fake_azure.fail("skus", status=status, code=code, message="m")
        with pytest.raises(AdapterError) as info:
            s.resource_skus(REGION)
        err = info.value
        assert type(err) is typed
        assert code in str(err) and err.cloud == "azure" and err.region == REGION
        assert err.retryable == (typed in (RateLimited, CloudUnavailable))
    finally:
        s.close()


def test_resource_graph_errors_are_translated_too(fake_azure: FakeAzure,
                                                  sdk: AzureSdk) -> None:
    fake_azure.fail("graph", status=429, code="RateLimiting", retry_after=42)
    with pytest.raises(RateLimited) as info:
        sdk.eviction_rates(REGION)
    assert info.value.retry_after == 42
    assert fake_azure.call_count("graph") == 1  # 42 s is the poller's to wait, not ours


async def test_retail_errors_are_translated_by_status(fake_azure: FakeAzure,
                                                      retail: RetailPrices) -> None:
    fake_azure.fail("prices", status=503, times=None)
    with pytest.raises(CloudUnavailable):
        await retail.vm_prices(REGION)
    assert fake_azure.call_count("prices") == RetryPolicy.ATTEMPTS
    fake_azure.clear_faults()
    fake_azure.fail("prices", status=400, code="BadRequest", times=None)
    with pytest.raises(AdapterError) as info:
        await retail.vm_prices(REGION)
    assert type(info.value) is AdapterError and not info.value.retryable


async def test_connection_errors_are_cloud_unavailable(retail: RetailPrices) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    s = AzureSdk(subscription_id="sub", endpoint=url, anonymous=True, attempts=2,
                 max_backoff=0.01)
    r = RetailPrices(endpoint=url, attempts=2, max_backoff=0.01)
    try:
        with pytest.raises(CloudUnavailable):
            s.resource_skus(REGION)
        with pytest.raises(CloudUnavailable):
            await r.vm_prices(REGION)
    finally:
        s.close()
        await r.close()


# --- random faults: each kind is transient, and retried ------------------------------

def once(fake: FakeAzure, kind: str, hang_seconds: float = 1.0) -> None:
    """Every request's first send gets the fault `kind`; its second goes through."""
    fake.chaos = Chaos(rate=1.0, kinds=(kind,), hang_seconds=hang_seconds)
    fake.chaos_repeats = 1


@pytest.mark.parametrize("kind", ["throttle", "5xx", "timeout", "truncated"])
def test_each_fault_kind_on_arm_is_retried(fake_azure: FakeAzure, kind: str) -> None:
    fake_azure.page_size.update(skus=20, graph=1000)  # pages of SKUs, one of rows
    want = AzureSdk(subscription_id=fake_azure.subscription_id, endpoint=fake_azure.url,
                    anonymous=True)
    try:
        skus, rows = want.resource_skus(REGION), want.eviction_rates(REGION)
    finally:
        want.close()
    pages = fake_azure.call_count()
    assert pages >= 3  # two pages of SKUs at least
    once(fake_azure, kind)
    s = AzureSdk(subscription_id=fake_azure.subscription_id, endpoint=fake_azure.url,
                 anonymous=True, max_backoff=1.0, call_timeout=0.5)
    try:
        assert s.resource_skus(REGION) == skus
        assert s.eviction_rates(REGION) == rows
    finally:
        s.close()
    assert fake_azure.faulted[kind] == pages  # each page once, then again


@pytest.mark.parametrize("kind", ["throttle", "5xx", "timeout", "truncated"])
async def test_each_fault_kind_on_retail_prices_is_retried(fake_azure: FakeAzure,
                                                           kind: str) -> None:
    fake_azure.page_size["prices"] = 1000
    r = RetailPrices(endpoint=fake_azure.url)
    try:
        want = await r.vm_prices(REGION)
    finally:
        await r.close()
    once(fake_azure, kind)
    r = RetailPrices(endpoint=fake_azure.url, max_backoff=1.0, call_timeout=0.5)
    try:
        assert await r.vm_prices(REGION) == want
    finally:
        await r.close()
    assert fake_azure.faulted[kind] == 1


@pytest.mark.parametrize(("kind", "typed", "match"), [
    ("throttle", RateLimited, "TooManyRequests|OperationNotAllowed|RateLimiting"),
    ("5xx", CloudUnavailable, "ServiceUnavailable|InternalServerError"),
    ("timeout", CloudUnavailable, "ServiceResponseTimeoutError"),
    ("truncated", CloudUnavailable, "garbled answer from Azure .DecodeError.: JSON is invalid"),
])
def test_each_fault_kind_on_arm_is_transient(fake_azure: FakeAzure, kind: str,
                                             typed: type[AdapterError], match: str) -> None:
    once(fake_azure, kind, hang_seconds=0.6)
    s = AzureSdk(subscription_id=fake_azure.subscription_id, endpoint=fake_azure.url,
                 anonymous=True, attempts=1, call_timeout=0.3)
    try:
        with pytest.raises(typed, match=match) as info:
            s.resource_skus(REGION)
        assert info.value.retryable
        if kind == "throttle":
            assert isinstance(info.value, RateLimited) and info.value.retry_after == 1
        with pytest.raises(typed, match=match):
            s.eviction_rates(REGION)
    finally:
        s.close()


@pytest.mark.parametrize(("kind", "typed", "match"), [
    ("throttle", RateLimited, "429"),
    ("5xx", CloudUnavailable, "50[03]"),
    ("timeout", CloudUnavailable, "no answer within the call timeout|Timeout"),
    ("truncated", CloudUnavailable, "garbled answer from Azure .JSONDecodeError."),
])
async def test_each_fault_kind_on_retail_prices_is_transient(
        fake_azure: FakeAzure, kind: str, typed: type[AdapterError], match: str) -> None:
    once(fake_azure, kind, hang_seconds=0.6)
    r = RetailPrices(endpoint=fake_azure.url, attempts=1, call_timeout=0.3)
    try:
        started = time.monotonic()
        with pytest.raises(typed, match=match) as info:
            await r.vm_prices(REGION)
        assert info.value.retryable and time.monotonic() - started < 0.6
        if kind == "throttle":
            assert isinstance(info.value, RateLimited) and info.value.retry_after == 1
    finally:
        await r.close()


def test_no_credentials_is_one_clear_auth_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # DefaultAzureCredential's chain narrowed (by its own environment variable) to the
    # environment credential, which finds nothing; nothing is sent to the endpoint.
    for var in ("AZURE_CLIENT_ID", "AZURE_CLIENT_SECRET", "AZURE_TENANT_ID",
                "AZURE_CLIENT_CERTIFICATE_PATH", "AZURE_USERNAME", "AZURE_FEDERATED_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AZURE_TOKEN_CREDENTIALS", "EnvironmentCredential")
    s = AzureSdk(subscription_id="sub", endpoint=f"https://127.0.0.1:{closed_port()}")
    try:
        with pytest.raises(AuthFailed, match="DefaultAzureCredential's chain"):
            s.resource_skus(REGION)
    finally:
        s.close()


def test_configuration_that_cannot_work_is_refused() -> None:
    with pytest.raises(InvalidConfig, match="https"):
        AzureSdk(subscription_id="sub", endpoint="http://127.0.0.1:1")
    with pytest.raises(InvalidConfig, match="endpoint"):
        AzureSdk(subscription_id="sub", anonymous=True)


@pytest.mark.parametrize(("headers", "seconds"), [
    ({"Retry-After": "7"}, 7.0),
    ({"retry-after": "0.5"}, 0.5),
    ({"Retry-After": "Mon, 30 Nov 2026 12:00:30 GMT"}, 30.0),
    ({"x-ms-user-quota-resets-after": "00:01:05"}, 65.0),
    ({"Retry-After": "soon"}, None),
    ({}, None),
])
def test_retry_after_header_forms(headers: dict[str, str], seconds: float | None) -> None:
    now = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
    assert retry_after_of(headers, now) == seconds
