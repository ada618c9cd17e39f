"""How Google's errors become the contract's typed errors (`adapters.gcp.sdk.translate`).

The exceptions are built the way the client libraries build them: `from_http_status`
with the REST error body's `errors`/`details` (what the REST transport raises), and with
Compute Engine `Errors` messages (what a failed long-running operation raises)."""

from __future__ import annotations

from typing import Any

import google.auth.exceptions as auth_exc
import pytest
import requests
from google.api_core import exceptions as core
from google.cloud import compute_v1

from adapters.errors import (
    AdapterError,
    AuthFailed,
    CapacityUnavailable,
    CloudUnavailable,
    InvalidConfig,
    QuotaExceeded,
    RateLimited,
)
from adapters.gcp.sdk import is_stockout, translate


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
    assert translate(http(429)).retry_after is None  # type: ignore[attr-defined]


@pytest.mark.parametrize(("exc", "typed"), [
    (requests.exceptions.ConnectionError("refused"), CloudUnavailable),
    (requests.exceptions.ReadTimeout("slow"), CloudUnavailable),
    (auth_exc.DefaultCredentialsError("none"), AuthFailed),
    (auth_exc.RefreshError("invalid_grant"), AuthFailed),
    (auth_exc.TransportError("unreachable"), CloudUnavailable),
    (core.RetryError("gave up", cause=None), AdapterError),
])
def test_transport_and_auth_errors(exc: Exception, typed: type[AdapterError]) -> None:
    assert type(translate(exc)) is typed


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
