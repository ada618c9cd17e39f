"""How Google's errors become the contract's typed errors (`adapters.gcp.sdk.translate`).

The exceptions are built the way the client libraries build them: `from_http_status`
with the REST error body's `errors`/`details` (what the REST transport raises), and with
Compute Engine `Errors` messages (what a failed long-running operation raises)."""

from __future__ import annotations

import json
from http.client import IncompleteRead
from typing import Any

import google.auth.exceptions as auth_exc
import pytest
import requests
import urllib3.exceptions
from fake_gcp import FakeGCP, fake_gcp_fixture  # noqa: F401
from fake_server import Chaos
from google.api_core import exceptions as core
from google.cloud import compute_v1
from google.protobuf import json_format

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
from adapters.gcp.sdk import GcpSdk, is_stockout, translate


def http(status: int, reason: str | None = None, info: str | None = None,
         message: str = "m", **kwargs: Any) -> core.GoogleAPICallError:
    errors = [{"message": message, "domain": "global", "reason": reason}] if reason else []
    details = [{"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": info,
                "domain": "googleapis.com"}] if info else []
    details += kwargs.pop("details", [])
    exc: core.GoogleAPICallError = core.from_http_status(status, message, errors=errors,
                                                         details=details, **kwargs)
    return exc


def operation(status: int, code: str) -> core.GoogleAPICallError:
    exc: core.GoogleAPICallError = core.from_http_status(
        status, f"{code}: it failed", errors=[compute_v1.Errors(code=code, message="...")])
    return exc


@pytest.mark.parametrize(("exc", "typed"), [
    (http(429, "rateLimitExceeded", "RATE_LIMIT_EXCEEDED"), RateLimited),
    (http(429), RateLimited),
    (http(403, "rateLimitExceeded"), RateLimited),
    (http(403, "userRateLimitExceeded"), RateLimited),
    (http(403, "forbidden", "IAM_PERMISSION_DENIED"), AuthFailed),
    (http(401, "required", "CREDENTIALS_MISSING"), AuthFailed),
    (http(403, "quotaExceeded"), QuotaExceeded),
    (http(404, "notFound"), InvalidConfig),
    (http(500, "backendError"), CloudUnavailable),
    (http(503, "backendError"), CloudUnavailable),
    (http(502), CloudUnavailable),
    (http(400, "invalid"), AdapterError),
    (operation(503, "ZONE_RESOURCE_POOL_EXHAUSTED"), CapacityUnavailable),
    (operation(503, "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS"), CapacityUnavailable),
    (operation(403, "QUOTA_EXCEEDED"), QuotaExceeded),
    (http(400, message="ZONE_RESOURCE_POOL_EXHAUSTED: the zone has no capacity"),
     CapacityUnavailable),
    (http(504), CloudUnavailable),  # DEADLINE_EXCEEDED
    (http(408), CloudUnavailable),
    (http(501), AdapterError),  # not implemented: it will not heal
    # Compute Engine's documented rate-limit answer: 403, reason rateLimitExceeded
    (http(403, "rateLimitExceeded", message="Rate Limit Exceeded"), RateLimited),
    (http(429, "rateLimitExceeded", "RATE_LIMIT_EXCEEDED",
          message="Quota exceeded for quota metric 'Read requests' and limit 'Read requests "
                  "per minute' of service 'compute.googleapis.com'"), RateLimited),
])
def test_google_errors_are_translated_by_meaning(exc: Exception, typed: type[AdapterError]
                                                 ) -> None:
    err = translate(exc, "us-central1")
    assert type(err) is typed
    assert err.cloud == "gcp" and err.region == "us-central1"
    assert err.retryable == (typed in (RateLimited, CloudUnavailable))


def test_retry_info_gives_retry_after() -> None:
    exc = http(429, "rateLimitExceeded", details=[
        {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "7s"}])
    err = translate(exc)
    assert isinstance(err, RateLimited) and err.retry_after == 7.0
    exc = http(429, info="RATE_LIMIT_EXCEEDED", details=[
        {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "0.500s"}])
    assert translate(exc).retry_after == 0.5  # type: ignore[attr-defined]
    assert translate(http(429)).retry_after is None  # type: ignore[attr-defined]


def garbled(body: str) -> Exception:
    """What protobuf raises reading a cut-off body (the REST transport's `Parse`)."""
    try:
        json_format.Parse(body, compute_v1.Region(), ignore_unknown_fields=True)
    except json_format.ParseError as exc:
        return exc
    raise AssertionError("parsed")


@pytest.mark.parametrize(("exc", "typed"), [
    (requests.exceptions.ConnectionError("refused"), CloudUnavailable),
    (requests.exceptions.ReadTimeout("slow"), CloudUnavailable),
    (requests.exceptions.ConnectTimeout("slow"), CloudUnavailable),
    (auth_exc.DefaultCredentialsError("none"), AuthFailed),
    (auth_exc.RefreshError("invalid_grant"), AuthFailed),
    (auth_exc.RefreshError("503 from the token endpoint", retryable=True), CloudUnavailable),
    (auth_exc.TransportError("unreachable"), CloudUnavailable),
    (core.RetryError("gave up", cause=None), AdapterError),
    # answers that cannot be read: cut off, garbled
    (garbled('{"kind": "compute#region", "name": "us-cent'), CloudUnavailable),
    (garbled('<html>502 Bad Gateway</html>'), CloudUnavailable),
    (json.JSONDecodeError("Expecting value", '{"error": {"co', 14), CloudUnavailable),
    (requests.exceptions.JSONDecodeError("Expecting value", "", 0), CloudUnavailable),
    (UnicodeDecodeError("utf-8", b"\xc3", 0, 1, "unexpected end of data"), CloudUnavailable),
    (requests.exceptions.ChunkedEncodingError("Connection broken: IncompleteRead"),
     CloudUnavailable),
    (requests.exceptions.ContentDecodingError("gzip"), CloudUnavailable),
    (urllib3.exceptions.ProtocolError("Connection aborted.", ConnectionResetError()),
     CloudUnavailable),
    (urllib3.exceptions.ReadTimeoutError(None, "/", "read timed out"), CloudUnavailable),
    (IncompleteRead(b"{", 10), CloudUnavailable),
    (ConnectionResetError(104, "reset by peer"), CloudUnavailable),
    (TimeoutError("timed out"), CloudUnavailable),
])
def test_transport_auth_and_garbled_answers(exc: Exception, typed: type[AdapterError]) -> None:
    err = translate(exc, "us-central1")
    assert type(err) is typed
    assert err.region == "us-central1" and len(str(err)) < 400


def test_a_long_garbled_body_is_not_copied_whole_into_the_error() -> None:
    err = translate(garbled('{"items": ["' + "x" * 100_000))
    assert isinstance(err, CloudUnavailable) and "cut off or garbled" in str(err)
    assert len(str(err)) < 400


def test_unknown_exceptions_are_not_swallowed() -> None:
    with pytest.raises(KeyError):
        translate(KeyError("a bug"))


@pytest.mark.parametrize(("text", "stockout"), [
    ("ZONE_RESOURCE_POOL_EXHAUSTED", True),
    ("zone_resource_pool_exhausted_with_details", True),
    ("launch failed: ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS: The zone 'us-central1-a' "
     "does not have enough resources", True),
    ("QUOTA_EXCEEDED", False),
    ("ZONE_RESOURCE_POOL", False),
    ("", False),
])
def test_is_stockout(text: str, stockout: bool) -> None:
    assert is_stockout(text) is stockout


@pytest.mark.parametrize(("kind", "typed"), [
    ("throttle", RateLimited), ("5xx", CloudUnavailable), ("timeout", CloudUnavailable),
    ("truncated", CloudUnavailable)])
def test_random_faults_reach_the_adapter_typed_and_retryable(fake_gcp: FakeGCP, kind: str,
                                                             typed: type[AdapterError]) -> None:
    """The real clients against the fake's faults, one attempt each: what `RetryPolicy`
    gets to see (every one of them retryable)."""
    fake_gcp.page_size["skus.list"] = 5000
    fake_gcp.chaos = Chaos(rate=1.0, kinds=(kind,), hang_seconds=0.6)
    sdk = GcpSdk(project=fake_gcp.project, endpoint=fake_gcp.url, anonymous=True,
                 retry=RetryPolicy(attempts=1), call_timeout=0.3)
    try:
        for call in (lambda: sdk.region("us-central1"), lambda: sdk.region("us-central1"),
                     sdk.skus, sdk.project_quotas):
            with pytest.raises(typed) as err:
                call()
            assert err.value.retryable
        if kind == "throttle":  # the Billing Catalog's RetryInfo; Compute Engine gives none
            with pytest.raises(RateLimited) as throttled:
                sdk.skus()
            assert throttled.value.retry_after == 1.0
    finally:
        sdk.close()
    assert fake_gcp.faulted[kind] >= 4
