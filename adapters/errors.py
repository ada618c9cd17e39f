"""Errors typed by meaning.

Each cloud's `sdk.py` translates its SDK's exceptions into these, once, so that the
poller, placement and failover never look at a cloud's own error codes.
"""

from __future__ import annotations


class AdapterError(Exception):
    """Base class: something a cloud adapter could not do. `retryable` says whether the
    same call may succeed later without anyone changing anything."""

    retryable: bool = False

    def __init__(self, message: str, *, cloud: str = "", region: str = "") -> None:
        super().__init__(message)
        self.cloud = cloud
        self.region = region


class SdkMissing(AdapterError):
    """The cloud's SDK is not installed. The message says which extra to install."""


class AuthFailed(AdapterError):
    """Credentials are missing, expired or lack a permission. Never retried
    automatically; the message never contains the credentials themselves."""


class RateLimited(AdapterError):
    """The cloud throttled us. `retry_after` (seconds) is the cloud's hint, if it gave one."""

    retryable = True

    def __init__(self, message: str, *, retry_after: float | None = None, cloud: str = "",
                 region: str = "") -> None:
        super().__init__(message, cloud=cloud, region=region)
        self.retry_after = retry_after


class CloudUnavailable(AdapterError):
    """The cloud's API failed or timed out (5xx, connection error). Retryable."""

    retryable = True


class CapacityUnavailable(AdapterError):
    """The cloud has no capacity for the pool right now (AWS InsufficientInstanceCapacity,
    GCP ZONE_RESOURCE_POOL_EXHAUSTED, Alibaba OperationDenied.NoStock, Azure
    AllocationFailed)."""


class QuotaExceeded(AdapterError):
    """The account's quota for the instance family or GPUs would be exceeded."""


class PriceTooLow(AdapterError):
    """The spot price rose above the maximum price given (AWS SpotMaxPriceTooLow)."""


class InvalidConfig(AdapterError):
    """The adapter's configuration cannot work (unknown region, bad endpoint)."""
