"""The narrow seam between the AWS adapter and boto3.

Everything the adapter asks of AWS goes through `AwsSdk`: one method per question, each
blocking (the adapter runs them on its own executor), each returning plain Python data,
each raising only the typed errors of `adapters.errors`.

Errors are translated here, once (`translate`), by meaning:

* a throttle (`RequestLimitExceeded`, `ThrottlingException`, S3 `SlowDown`, HTTP 429 ...)
  → `RateLimited`, with `retry_after` when the answer carries `Retry-After` (seconds or
  an HTTP date) or `x-amz-retry-after` (milliseconds; AWS sends neither on most APIs);
* a 5xx, a connection error, a connect or read timeout, and every answer that cannot be
  read — truncated or garbled XML (botocore's `ResponseParserError`), a JSON body that
  does not decode, a body cut short (`IncompleteReadError`, `ConnectionClosedError`)
  → `CloudUnavailable`. botocore reads an undecodable JSON body as an *empty* answer
  (a cut-off `GetProducts` page would look like "no price"), so JSON answers are checked
  before botocore parses them (`_check_json_body`);
* credentials, permissions, quotas, capacity, a bad region → `AuthFailed`,
  `QuotaExceeded`, `CapacityUnavailable`, `InvalidConfig`; any other AWS error code → a
  permanent `AdapterError`.

The one retry layer is here: each call (each page of a paginated call on its own) that
fails with a `RateLimited` or `CloudUnavailable` is retried by
`adapters.common.RetryPolicy` with jittered backoff, never sooner than a `retry_after`,
and never past the poll's deadline. botocore's own retries are off
(`total_max_attempts: 1`). One call may take `call_timeout` seconds to connect and as
long between reads (the cloud section's `call_timeout_seconds`).

AWS's schedule (`aws_retry_policy`): up to 12 attempts, backoff capped at 2 s. A first
poll of a region makes ~160 calls, 13 of them one after another (the instance-type
pages) before most others can start; a backoff growing to 8 s spends most of a 30 s poll
deadline on one unlucky call (with 30 % of calls faulted at random, one of a 4-region
poll's ~650 calls fails 6 times in a row about every other poll), and the deadline, not
the attempts, ends it. With waits of at most 2 s the deadline bounds the attempts
instead (`bench/aws_poll.py --faults 0.3`).

boto3 is imported lazily: gpubroker starts without it, and a missing one reads
``AWS support needs boto3: pip install 'gpubroker[aws]'``.

Credentials come from boto3's standard chain only (environment, shared files, SSO,
instance or task role). With `anonymous=True` (tests and emulators, allowed only with an
`endpoint`) requests are not signed at all. The Spot Instance Advisor document is public
and always fetched unsigned (a signed request would need an IAM permission on AWS's
bucket): from ``https://spot-bid-advisor.s3.amazonaws.com/spot-advisor-data.json``, or
with an `endpoint` from ``<endpoint>/spot-bid-advisor/spot-advisor-data.json`` (S3
path-style addressing).
"""

from __future__ import annotations

import email.utils
import http.client
import json
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
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
ADVISOR_BUCKET = "spot-bid-advisor"
ADVISOR_KEY = "spot-advisor-data.json"
ADVISOR_REGION = "us-east-1"

_CAPACITY = {"InsufficientInstanceCapacity", "InsufficientHostCapacity",
             "InsufficientReservedInstanceCapacity", "InsufficientCapacity",
             "Unsupported"}
_QUOTA = {"MaxSpotInstanceCountExceeded", "VcpuLimitExceeded", "InstanceLimitExceeded",
          "MaxSpotFleetRequestCountExceeded", "ServiceQuotaExceededException"}
_THROTTLE = {"RequestLimitExceeded", "Throttling", "ThrottlingException",
             "TooManyRequestsException", "SlowDown", "RequestThrottled",
             "RequestThrottledException", "PriorRequestNotComplete",
             "AWS.SimpleQueueService.RequestThrottled"}
_AUTH = {"AuthFailure", "UnauthorizedOperation", "AccessDenied", "AccessDeniedException",
         "InvalidClientTokenId", "SignatureDoesNotMatch", "ExpiredToken",
         "ExpiredTokenException", "UnrecognizedClientException", "OptInRequired",
         "InvalidAccessKeyId", "MissingAuthenticationToken"}
_UNAVAILABLE = {"InternalError", "InternalFailure", "ServiceUnavailable", "Unavailable",
                "InternalServerError", "ServiceUnavailableException", "InternalServiceError",
                "InternalErrorException", "InternalServerException", "ServiceException"}
_CONFIG = {"InvalidRegion", "UnknownRegion"}
NO_SUCH_QUOTA = "NoSuchResourceException"


def aws_retry_policy() -> RetryPolicy:
    """The seam's retry schedule for AWS (see the module doc)."""
    return RetryPolicy(attempts=12, max_backoff=2.0)


def _boto() -> tuple[Any, Any]:
    """(boto3, botocore), imported on first use."""
    return (import_sdk("boto3", cloud="aws", label="AWS", package="boto3"),
            import_sdk("botocore", cloud="aws", label="AWS", package="boto3"))


def _transient_types() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "the answer did not arrive whole": retried as
    `CloudUnavailable`. botocore wraps urllib3's errors in its own; the standard
    library's are here for what reaches us unwrapped (a streaming body)."""
    import botocore.exceptions as bex
    from botocore.parsers import ResponseParserError

    return (bex.HTTPClientError,  # ConnectionClosedError, ReadTimeoutError, ...Streaming
            bex.EndpointConnectionError, bex.ConnectTimeoutError, bex.ProxyConnectionError,
            bex.IncompleteReadError, ResponseParserError, json.JSONDecodeError,
            UnicodeDecodeError, http.client.IncompleteRead, ConnectionError, TimeoutError)


def error_code(exc: BaseException) -> str:
    """AWS's error code of a botocore `ClientError` ("" for anything else)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return ""
    return str(response.get("Error", {}).get("Code", ""))


def retry_after_of(headers: Mapping[str, Any], now: float | None = None) -> float | None:
    """Seconds to wait from an answer's ``x-amz-retry-after`` (milliseconds, what
    botocore's own retries read) or ``Retry-After`` (seconds or an HTTP date) header;
    None without a usable one. `headers` are botocore's, lower-cased."""
    ms = headers.get("x-amz-retry-after")
    if ms is not None:
        try:
            seconds = float(ms) / 1000
        except ValueError:
            seconds = math.nan
        if math.isfinite(seconds) and seconds >= 0:
            return seconds
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(str(value))
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    return max(0.0, seconds) if math.isfinite(seconds) else None


# Many returns: one return per SDK error class: a flat mapping table.
def translate(exc: BaseException, region: str = "") -> AdapterError:  # noqa: PLR0911
    """Map a botocore exception onto the typed errors of the adapter contract (see the
    module doc); re-raise anything else, which is a bug."""
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
        code = error_code(exc)
        meta = exc.response.get("ResponseMetadata", {})
        status = int(meta.get("HTTPStatusCode", 0) or 0)
        op = getattr(exc, "operation_name", "")
        msg = f"{op}: {code}: {err.get('Message', '')}".strip()
        if code in _CAPACITY:
            return CapacityUnavailable(msg, cloud="aws", region=region)
        if code in _QUOTA:
            return QuotaExceeded(msg, cloud="aws", region=region)
        if code == "SpotMaxPriceTooLow":
            return PriceTooLow(msg, cloud="aws", region=region)
        if code in _THROTTLE or status == 429:
            return RateLimited(msg, retry_after=retry_after_of(meta.get("HTTPHeaders", {})),
                               cloud="aws", region=region)
        if code in _AUTH or status in (401, 403):
            return AuthFailed(msg, cloud="aws", region=region)
        if code in _CONFIG:
            return InvalidConfig(msg, cloud="aws", region=region)
        if code in _UNAVAILABLE or status >= 500:
            return CloudUnavailable(msg, cloud="aws", region=region)
        return AdapterError(msg, cloud="aws", region=region)
    if isinstance(exc, _transient_types()):
        return CloudUnavailable(f"{type(exc).__name__}: {exc}", cloud="aws", region=region)
    if isinstance(exc, bex.BotoCoreError):
        return AdapterError(f"{type(exc).__name__}: {exc}", cloud="aws", region=region)
    raise exc


def _check_json_body(response_dict: dict[str, Any], operation_model: Any,
                     **_: Any) -> None:
    """A ``before-parse`` hook for JSON-protocol clients: an answer whose body does not
    decode is unreadable (`ResponseParserError`), not empty, as botocore would take it."""
    body = response_dict.get("body")
    if operation_model.has_streaming_output or not isinstance(body, bytes) or not body:
        return
    try:
        json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        from botocore.parsers import ResponseParserError

        raise ResponseParserError(
            f"{operation_model.name}: unreadable JSON answer "
            f"(HTTP {response_dict.get('status_code')}, {len(body)} bytes): {exc}") from None


class AwsSdk:
    """Blocking AWS calls, translated and retried. Thread-safe."""

    def __init__(self, *, endpoint: str | None = None, anonymous: bool = False,
                 call_timeout: float = 10.0, retry: RetryPolicy | None = None,
                 on_call: Callable[[str, str], None] | None = None) -> None:
        boto3, botocore = _boto()
        from botocore.config import Config

        self.endpoint = endpoint
        self._session = boto3.session.Session()
        extra: dict[str, Any] = {}
        if anonymous:
            extra["signature_version"] = botocore.UNSIGNED
        # One retry layer: ours (`retry`), so botocore makes exactly one attempt per call.
        self._config = Config(retries={"total_max_attempts": 1, "mode": "standard"},
                              connect_timeout=call_timeout, read_timeout=call_timeout,
                              max_pool_connections=64, **extra)
        # The advisor document is public: unsigned; from AWS at its virtual-hosted URL
        # (https://spot-bid-advisor.s3.amazonaws.com/...), path-style on an endpoint.
        public: dict[str, Any] = {"signature_version": botocore.UNSIGNED}
        if endpoint:
            public["s3"] = {"addressing_style": "path"}
        self._public_config = self._config.merge(Config(**public))
        self._clients: dict[tuple[str, str, bool], Any] = {}
        self._lock = threading.Lock()
        self.retry = retry or aws_retry_policy()
        self._on_call = on_call

    def client(self, service: str, region: str, *, public: bool = False) -> Any:
        key = (service, region, public)
        with self._lock:  # boto3 sessions are not thread-safe; clients are
            if key not in self._clients:
                client = self._session.client(
                    service, region_name=region, endpoint_url=self.endpoint,
                    config=self._public_config if public else self._config)
                if client.meta.service_model.resolved_protocol == "json":
                    client.meta.events.register("before-parse", _check_json_body)
                self._clients[key] = client
            return self._clients[key]

    def _call(self, region: str, op: str, fn: Callable[[], T]) -> T:
        """Run `fn` with translation and retries of RateLimited / CloudUnavailable."""
        on_call = self._on_call
        return self.retry.call(fn, lambda exc: translate(exc, region),
                               None if on_call is None else lambda: on_call(op, region))

    def _pages(self, service: str, region: str, op: str, *,
               decode: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
               **kwargs: Any) -> Iterator[Any]:
        """Every page of a paginated call, each page fetched (and retried) on its own;
        `decode` reads a page inside the attempt, so an unreadable page is retried."""
        client = self.client(service, region)
        token: str | None = None
        method = getattr(client, op)

        def fetch(args: dict[str, Any]) -> dict[str, Any]:
            page: dict[str, Any] = method(**args)
            return page if decode is None else decode(page)

        while True:
            args = dict(kwargs)
            if token:
                args["NextToken"] = token
            page = self._call(region, op, lambda a=args: fetch(a))  # type: ignore[misc]
            yield page
            token = page.get("NextToken")
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

    def capacity_reservations(self, region: str) -> list[dict[str, Any]]:
        """The account's active On-Demand Capacity Reservations in the region (its own
        and those shared with it), as AWS describes them; every page."""
        out: list[dict[str, Any]] = []
        for page in self._pages("ec2", region, "describe_capacity_reservations",
                                Filters=[{"Name": "state", "Values": ["active"]}],
                                MaxResults=1000):
            out.extend(page.get("CapacityReservations", []))
        return out

    def describe_instances(self, region: str, instance_ids: Sequence[str]
                           ) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for page in self._pages("ec2", region, "describe_instances",
                                InstanceIds=list(instance_ids)):
            for reservation in page.get("Reservations", []):
                out.extend(reservation.get("Instances", []))
        return out

    # --- Pricing, Service Quotas, Spot Instance Advisor -------------------------------

    def on_demand_products(self, region: str, instance_type: str) -> list[dict[str, Any]]:
        """Price List documents (decoded) for Linux, shared tenancy, no pre-installed
        software, used capacity: normally exactly one; none when the catalog has no such
        price."""
        filters = [{"Type": "TERM_MATCH", "Field": f, "Value": v} for f, v in (
            ("instanceType", instance_type), ("regionCode", region),
            ("operatingSystem", "Linux"), ("tenancy", "Shared"), ("preInstalledSw", "NA"),
            ("capacitystatus", "Used"))]
        out: list[dict[str, Any]] = []
        for page in self._pages("pricing", PRICING_REGION, "get_products",
                                decode=_decode_price_list, ServiceCode="AmazonEC2",
                                Filters=filters, FormatVersion="aws_v1", MaxResults=100):
            out.extend(page.get("PriceList", []))
        return out

    def quota(self, region: str, code: str) -> float | None:
        """An EC2 quota's value (vCPUs for the instance-family quotas); None if AWS does
        not know the quota code in this region (`NoSuchResourceException`)."""
        from botocore.exceptions import ClientError

        client = self.client("service-quotas", region)

        def get() -> dict[str, Any] | None:
            try:
                resp: dict[str, Any] = client.get_service_quota(ServiceCode="ec2",
                                                                QuotaCode=code)
            except ClientError as exc:
                if error_code(exc) == NO_SUCH_QUOTA:  # AWS does not know the quota
                    return None
                raise
            return resp

        resp = self._call(region, "get_service_quota", get)
        value = None if resp is None else resp.get("Quota", {}).get("Value")
        return None if value is None else float(value)

    def spot_advisor_document(self) -> tuple[dict[str, Any], datetime | None]:
        """The Spot Instance Advisor's public JSON document (see the module doc), decoded,
        and when it was published: the object's `Last-Modified` (UTC; None when S3 does
        not say). AWS republishes it every few months, so the rates it holds are as old
        as that, not as the fetch. A body that does not decode to a JSON object is an
        unreadable answer, retried."""
        client = self.client("s3", ADVISOR_REGION, public=True)

        def get() -> tuple[dict[str, Any], datetime | None]:
            resp = client.get_object(Bucket=ADVISOR_BUCKET, Key=ADVISOR_KEY)
            with resp["Body"] as body:
                doc = json.loads(body.read())
            if not isinstance(doc, dict):
                raise json.JSONDecodeError("not a JSON object", "", 0)
            modified = resp.get("LastModified")
            if isinstance(modified, datetime) and modified.tzinfo is not None:
                return doc, modified.astimezone(UTC)
            return doc, None

        return self._call(ADVISOR_REGION, "get_object", get)

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


def _decode_price_list(page: dict[str, Any]) -> dict[str, Any]:
    """A `GetProducts` page with its `PriceList` documents (JSON strings) decoded."""
    docs = [json.loads(d) if isinstance(d, str) else d for d in page.get("PriceList", [])]
    return {**page, "PriceList": docs}


def _chunks(items: Sequence[str], n: int) -> Iterator[Sequence[str]]:
    for i in range(0, len(items), n):
        yield items[i:i + n]
