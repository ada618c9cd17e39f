"""The narrow seam between the AWS adapter and boto3.

Everything the adapter asks of AWS goes through `AwsSdk`: one method per question, each
blocking (the adapter runs them on its own executor), each returning plain Python data,
each raising only the typed errors of `adapters.errors`. AWS's own error codes are
translated here, once (`translate`), and throttling and 5xx are retried here with
jittered exponential backoff (`adapters.common.RetryPolicy`: never sooner than a
`RateLimited.retry_after`; one beyond the backoff cap goes up to the poller).

boto3 is imported lazily: gpubroker starts without it, and a missing one reads
``AWS support needs boto3: pip install 'gpubroker[aws]'``.

Credentials come from boto3's standard chain only (environment, shared files, SSO,
instance or task role). With `anonymous=True` (tests and emulators, allowed only with an
`endpoint`) requests are not signed at all.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from typing import Any, TypeVar

from adapters.common import RetryPolicy, import_sdk
from adapters.errors import (
    AdapterError,
    AuthFailed,
    CapacityUnavailable,
    CloudUnavailable,
    InvalidConfig,
    PriceTooLow,
    QuotaExceeded,
    RateLimited,
)

T = TypeVar("T")

PRICING_REGION = "us-east-1"  # the Price List API lives in us-east-1 (and ap-south-1)

_CAPACITY = {"InsufficientInstanceCapacity", "InsufficientHostCapacity",
             "InsufficientReservedInstanceCapacity", "InsufficientCapacity",
             "Unsupported"}
_QUOTA = {"MaxSpotInstanceCountExceeded", "VcpuLimitExceeded", "InstanceLimitExceeded",
          "MaxSpotFleetRequestCountExceeded", "ServiceQuotaExceededException"}
_THROTTLE = {"RequestLimitExceeded", "Throttling", "ThrottlingException",
             "TooManyRequestsException", "SlowDown", "RequestThrottled",
             "RequestThrottledException", "PriorRequestNotComplete"}
_AUTH = {"AuthFailure", "UnauthorizedOperation", "AccessDenied", "AccessDeniedException",
         "InvalidClientTokenId", "SignatureDoesNotMatch", "ExpiredToken",
         "ExpiredTokenException", "UnrecognizedClientException", "OptInRequired",
         "InvalidAccessKeyId", "MissingAuthenticationToken"}
_UNAVAILABLE = {"InternalError", "InternalFailure", "ServiceUnavailable", "Unavailable",
                "InternalServerError", "ServiceUnavailableException", "InternalServiceError"}
_CONFIG = {"InvalidRegion", "UnknownRegion"}


def _boto() -> tuple[Any, Any]:
    """(boto3, botocore), imported on first use."""
    return (import_sdk("boto3", cloud="aws", label="AWS", package="boto3"),
            import_sdk("botocore", cloud="aws", label="AWS", package="boto3"))


def translate(exc: BaseException, region: str = "") -> AdapterError:
    """Map a botocore exception onto the typed errors of the adapter contract."""
    _boto()
    import botocore.exceptions as bex

    if isinstance(exc, AdapterError):
        return exc
    if isinstance(exc, bex.NoCredentialsError | bex.PartialCredentialsError):
        return AuthFailed("no usable AWS credentials in boto3's standard chain "
                          "(environment, ~/.aws, SSO, instance or task role)",
                          cloud="aws", region=region)
    if isinstance(exc, bex.ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        op = getattr(exc, "operation_name", "")
        msg = f"{op}: {code}: {err.get('Message', '')}".strip()
        if code in _CAPACITY:
            return CapacityUnavailable(msg, cloud="aws", region=region)
        if code in _QUOTA:
            return QuotaExceeded(msg, cloud="aws", region=region)
        if code == "SpotMaxPriceTooLow":
            return PriceTooLow(msg, cloud="aws", region=region)
        if code in _THROTTLE or status == 429:
            return RateLimited(msg, cloud="aws", region=region)
        if code in _AUTH or status in (401, 403):
            return AuthFailed(msg, cloud="aws", region=region)
        if code in _CONFIG:
            return InvalidConfig(msg, cloud="aws", region=region)
        if code in _UNAVAILABLE or status >= 500:
            return CloudUnavailable(msg, cloud="aws", region=region)
        return AdapterError(msg, cloud="aws", region=region)
    if isinstance(exc, bex.EndpointConnectionError | bex.ConnectionClosedError |
                  bex.ConnectTimeoutError | bex.ReadTimeoutError | bex.ProxyConnectionError):
        return CloudUnavailable(f"{type(exc).__name__}: {exc}", cloud="aws", region=region)
    if isinstance(exc, bex.BotoCoreError):
        return AdapterError(f"{type(exc).__name__}: {exc}", cloud="aws", region=region)
    raise exc


class AwsSdk:
    """Blocking AWS calls, translated and retried. Thread-safe."""

    def __init__(self, *, endpoint: str | None = None, anonymous: bool = False,
                 attempts: int = 4, max_backoff: float = 8.0,
                 on_call: Callable[[str, str], None] | None = None) -> None:
        boto3, botocore = _boto()
        from botocore.config import Config

        self.endpoint = endpoint
        self._session = boto3.session.Session()
        extra: dict[str, Any] = {}
        if anonymous:
            extra["signature_version"] = botocore.UNSIGNED
        # Retries are ours (tenacity, below), so that every cloud retries alike.
        self._config = Config(retries={"total_max_attempts": 1, "mode": "standard"},
                              connect_timeout=5, read_timeout=30, max_pool_connections=64,
                              **extra)
        self._clients: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()
        self.retry = RetryPolicy(attempts, max_backoff)
        self._on_call = on_call

    def client(self, service: str, region: str) -> Any:
        key = (service, region)
        with self._lock:  # boto3 sessions are not thread-safe; clients are
            if key not in self._clients:
                self._clients[key] = self._session.client(
                    service, region_name=region, endpoint_url=self.endpoint,
                    config=self._config)
            return self._clients[key]

    def _call(self, region: str, op: str, fn: Callable[[], T]) -> T:
        """Run `fn` with translation and retries of RateLimited / CloudUnavailable."""
        on_call = self._on_call
        return self.retry.call(fn, lambda exc: translate(exc, region),
                               None if on_call is None else lambda: on_call(op, region))

    def _pages(self, service: str, region: str, op: str, **kwargs: Any) -> Iterator[Any]:
        """Every page of a paginated call, each page fetched (and retried) on its own."""
        client = self.client(service, region)
        token: str | None = None
        token_in, token_out = ("NextToken", "NextToken")
        method = getattr(client, op)
        while True:
            args = dict(kwargs)
            if token:
                args[token_in] = token
            page = self._call(region, op, lambda a=args: method(**a))  # type: ignore[misc]
            yield page
            token = page.get(token_out)
            if not token:
                return

    # --- EC2 -----------------------------------------------------------------------

    def gpu_instance_types(self, region: str) -> list[dict[str, Any]]:
        """Every instance type of the region that has GPUs (`GpuInfo`)."""
        out: list[dict[str, Any]] = []
        for page in self._pages("ec2", region, "describe_instance_types", MaxResults=100):
            out.extend(t for t in page.get("InstanceTypes", []) if t.get("GpuInfo"))
        return out

    def offerings(self, region: str, instance_types: Sequence[str]) -> list[tuple[str, str]]:
        """(instance type, zone name) for each zone of the region that offers the type."""
        out: list[tuple[str, str]] = []
        for chunk in _chunks(instance_types, 100):
            for page in self._pages(
                    "ec2", region, "describe_instance_type_offerings",
                    LocationType="availability-zone",
                    Filters=[{"Name": "instance-type", "Values": list(chunk)}]):
                out.extend((o["InstanceType"], o["Location"])
                           for o in page.get("InstanceTypeOfferings", []))
        return out

    def zone_ids(self, region: str) -> dict[str, str]:
        """Zone ID (`use1-az1`) → zone name (`us-east-1a`); they differ per account."""
        client = self.client("ec2", region)
        resp = self._call(region, "describe_availability_zones",
                          lambda: client.describe_availability_zones(AllAvailabilityZones=False))
        return {z["ZoneId"]: z["ZoneName"] for z in resp.get("AvailabilityZones", [])
                if z.get("ZoneId")}

    def spot_prices(self, region: str, instance_types: Sequence[str], since: datetime
                    ) -> list[tuple[str, str, float, datetime]]:
        """(type, zone, USD/hour, timestamp) of Linux/UNIX spot prices since `since`
        (AWS also returns the price in effect at `since`)."""
        out: list[tuple[str, str, float, datetime]] = []
        for chunk in _chunks(instance_types, 100):
            for page in self._pages(
                    "ec2", region, "describe_spot_price_history", InstanceTypes=list(chunk),
                    ProductDescriptions=["Linux/UNIX"], StartTime=since, MaxResults=1000):
                for p in page.get("SpotPriceHistory", []):
                    out.append((p["InstanceType"], p["AvailabilityZone"], float(p["SpotPrice"]),
                                p["Timestamp"]))
        return out

    def placement_scores(self, region: str, instance_type: str) -> dict[str, int]:
        """Zone ID → spot placement score (1-10) for one instance of `instance_type`."""
        out: dict[str, int] = {}
        for page in self._pages(
                "ec2", region, "get_spot_placement_scores", InstanceTypes=[instance_type],
                TargetCapacity=1, SingleAvailabilityZone=True, RegionNames=[region],
                MaxResults=10):
            for s in page.get("SpotPlacementScores", []):
                if s.get("AvailabilityZoneId") and s.get("Region", region) == region:
                    out[s["AvailabilityZoneId"]] = int(s["Score"])
        return out

    def describe_instances(self, region: str, instance_ids: Sequence[str]
                           ) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for page in self._pages("ec2", region, "describe_instances",
                                InstanceIds=list(instance_ids)):
            for reservation in page.get("Reservations", []):
                out.extend(reservation.get("Instances", []))
        return out

    # --- Pricing, Service Quotas -----------------------------------------------------

    def on_demand_products(self, region: str, instance_type: str) -> list[str]:
        """Price List documents (JSON strings) for Linux, shared tenancy, no
        pre-installed software, used capacity: normally exactly one."""
        filters = [{"Type": "TERM_MATCH", "Field": f, "Value": v} for f, v in (
            ("instanceType", instance_type), ("regionCode", region),
            ("operatingSystem", "Linux"), ("tenancy", "Shared"), ("preInstalledSw", "NA"),
            ("capacitystatus", "Used"))]
        out: list[str] = []
        for page in self._pages("pricing", PRICING_REGION, "get_products",
                                ServiceCode="AmazonEC2", Filters=filters,
                                FormatVersion="aws_v1", MaxResults=100):
            out.extend(page.get("PriceList", []))
        return out

    def quota(self, region: str, code: str) -> float | None:
        """An EC2 quota's value (vCPUs for the instance-family quotas); None if AWS does
        not know the quota code in this region."""
        client = self.client("service-quotas", region)
        try:
            resp = self._call(region, "get_service_quota", lambda: client.get_service_quota(
                ServiceCode="ec2", QuotaCode=code))
        except AdapterError as exc:
            if "NoSuchResourceException" in str(exc):
                return None
            raise
        value = resp.get("Quota", {}).get("Value")
        return None if value is None else float(value)

    # --- SQS -----------------------------------------------------------------------

    def receive(self, region: str, queue_url: str, wait_seconds: int = 20
                ) -> list[dict[str, Any]]:
        client = self.client("sqs", region)
        resp = self._call(region, "receive_message", lambda: client.receive_message(
            QueueUrl=queue_url, MaxNumberOfMessages=10, WaitTimeSeconds=wait_seconds,
            MessageSystemAttributeNames=["SentTimestamp"]))
        return list(resp.get("Messages", []))

    def delete(self, region: str, queue_url: str, receipts: Sequence[str]) -> None:
        if not receipts:
            return
        client = self.client("sqs", region)
        entries = [{"Id": str(i), "ReceiptHandle": r} for i, r in enumerate(receipts)]
        self._call(region, "delete_message_batch", lambda: client.delete_message_batch(
            QueueUrl=queue_url, Entries=entries))

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()


def _chunks(items: Sequence[str], n: int) -> Iterator[Sequence[str]]:
    for i in range(0, len(items), n):
        yield items[i:i + n]
