"""The narrow seam between the Alibaba Cloud adapter and the ECS "Tea" SDK
(`alibabacloud-ecs20140526`).

Everything the adapter asks of Alibaba Cloud goes through `AlibabaSdk`: one method per
question, each blocking (the adapter runs them on its own executor), each returning
plain Python data (the API's PascalCase maps, via the SDK models' `to_map()`), each
raising only the typed errors of `adapters.errors`.

Errors: the SDK's exceptions and Alibaba's error codes are translated here, once, by one
table (`translate`). What can heal by itself is retryable: a throttle (`Throttling`,
`Throttling.User`, `Throttling.Api`, any `Throttling.*`, HTTP 429) is `RateLimited`, with
the `x-acs-retry-after` hint if Alibaba gave one; a 5xx (`InternalError`,
`ServiceUnavailable` ...), a connection that fails or a call that takes longer than
`call_timeout` seconds (to connect, or between bytes of the answer), and an answer that
cannot be read (cut off, garbled: the SDK's "Failed to parse the value as json format")
are `CloudUnavailable`. What cannot heal — credentials, permissions, a region that does
not exist, a request Alibaba refuses — is permanent. Each call is retried here, alone,
by `adapters.common.RetryPolicy`, the one retry layer (`ATTEMPTS` tries, waits capped at
`MAX_BACKOFF`): jittered backoff, never sooner than the retry-after hint, never past the
poll's deadline; a hint longer than the backoff cap, or than what is left of the
deadline, is not waited out here: the `RateLimited` goes up to the poller, which waits
it out before the next poll. The SDK's own retries
are off (`Config.retry_options` not retryable, `RuntimeOptions(autoretry=False,
max_attempts=0)` on every call).

The SDK is imported lazily: gpubroker starts without it, and a missing one reads
``Alibaba Cloud support needs alibabacloud-ecs20140526: pip install 'gpubroker[alibaba]'``.

Wire protocol: the installed SDK (alibabacloud-tea-openapi ≥ 0.4) speaks the OpenAPI v3
style for RPC APIs: ``POST /`` with the parameters in the query string (lists and
objects flattened, ``InstanceTypes.1=...``, ``SystemDisk.Category=...``), the operation
in the ``x-acs-action`` header and the version in ``x-acs-version``, signed
``ACS3-HMAC-SHA256``; errors come back as JSON ``{"RequestId", "HostId", "Code",
"Message", "Recommend"}`` with a 4xx/5xx status.

Endpoints: by default the SDK's own rule for ECS (``ecs.<region>.aliyuncs.com``, or the
SDK's per-region table, e.g. ``ecs-cn-hangzhou.aliyuncs.com``). A configured `endpoint`
(SPEC §6: a URL such as ``http://127.0.0.1:8080`` or ``https://ecs.example.internal``)
replaces it for every region: its host[:port] becomes the Tea `Config.endpoint` and its
scheme the `Config.protocol`; a path is refused (RPC calls always go to ``/``).

Credentials come from the SDK's default chain only (`alibabacloud_credentials`:
``ALIBABA_CLOUD_ACCESS_KEY_ID`` / ``ALIBABA_CLOUD_ACCESS_KEY_SECRET`` (+
``ALIBABA_CLOUD_SECURITY_TOKEN``), the ``~/.aliyun/config.json`` CLI profile, the
``~/.alibabacloud/credentials.ini`` profile, the ECS instance RAM role, a credentials
URI). The chain reads its environment variables once, when it is first imported.
`credentials()` asks the chain once before any client is built (the adapter calls it
first in every poll until it succeeds), so that a machine without credentials gets one
`AuthFailed` naming the sources, not one per call. The chain's providers log every
failed probe, a warning and then a traceback, on a logger named ``credentials`` that
has a stderr handler of its own (the root logger's set-up does not reach it); its
records are dropped (`_quiet_credential_chain`): gpubroker reports the outcome itself,
as one `AuthFailed`, and logs the chain's own reasons at debug. With `anonymous=True`
(tests and emulators, allowed only with an `endpoint`) the SDK signs with the fixed
dummy key `ANONYMOUS_KEY_ID` / `ANONYMOUS_KEY_SECRET`, which is not a credential of any
account: the Tea SDK has no unsigned mode for ECS, so a fixed, public, worthless key is
the closest thing to "no credentials".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from types import ModuleType
from typing import Any, TypeVar
from urllib.parse import urlsplit

import structlog

from adapters.common import RetryPolicy, import_sdk
from adapters.errors import (
    AdapterError,
    AuthFailed,
    CapacityUnavailable,
    CloudUnavailable,
    InvalidConfig,
    QuotaExceeded,
    RateLimited,
)

T = TypeVar("T")
log = structlog.get_logger("gpubroker.alibaba")

API_VERSION = "2014-05-26"
ANONYMOUS_KEY_ID = "gpubroker-anonymous"
ANONYMOUS_KEY_SECRET = "gpubroker-anonymous-not-a-secret"  # public, worthless
NO_CREDENTIALS = ("no usable Alibaba Cloud credentials in the SDK's default chain "
                  "(ALIBABA_CLOUD_ACCESS_KEY_ID/ALIBABA_CLOUD_ACCESS_KEY_SECRET, "
                  "~/.aliyun/config.json, ~/.alibabacloud/credentials.ini, ECS RAM role)")
CREDENTIALS_RECHECK = 10.0
"""Seconds a failed look at the credential chain is taken as the answer (the regions'
polls start together; one look serves them all), before the chain is asked again."""

ATTEMPTS = RetryPolicy.ATTEMPTS
MAX_BACKOFF = RetryPolicy.MAX_BACKOFF
"""The shared retry schedule (`adapters.common.RetryPolicy`): a first poll of a region
makes dozens of calls (one per instance type for each kind of price), all of which must
get through; about ten tries fit in the default 30 s poll deadline, so at 30 % of calls
failing at random a call runs out of them about once in 170,000 (0.3 ** 10). A
retry-after hint up to 4 s is waited out; a longer one goes up to the poller."""

INSTANCE_TYPES_PAGE = 1600  # DescribeInstanceTypes MaxResults: the documented maximum
SPOT_ADVICE_TYPES = 10  # DescribeSpotAdvice takes up to 10 InstanceTypes.N
MAX_PAGES = 1000  # a guard against a paging loop that never ends
_SHOWN = 200  # characters of a garbled answer quoted in an error message

_CAPACITY = {"OperationDenied.NoStock", "Zone.NotOnSale", "InvalidResourceType.NotSupported"}
_QUOTA = {"InvalidInstanceType.ValueUnauthorized", "OperationDenied.QuotaExceed",
          "InstanceLimitExceeded"}
_AUTH = {"InvalidAccessKeyId.NotFound", "InvalidAccessKeyId", "InvalidAccessKeyId.Inactive",
         "SignatureDoesNotMatch", "IncompleteSignature", "InvalidSecurityToken.Expired",
         "InvalidSecurityToken.Malformed", "InvalidSecurityToken.MismatchWithAccessKey",
         "MissingSecurityToken", "NoPermission", "Account.Arrearage", "InvalidCredentials"}
_UNAVAILABLE = {"ServiceUnavailable", "InternalError", "UnknownError", "InternalError.Dispatch",
                "ServiceTimeout", "RequestTimeout", "ServiceBusy", "SystemBusy"}
_CONFIG = {"InvalidRegionId.NotFound", "InvalidRegionId.MalFormed", "InvalidRegionId",
           "InvalidRegion.NotExist"}


def _tea() -> tuple[Any, Any, Any]:
    """(ECS `Client` class, ECS `models` module, Tea `Config` class)."""
    def sdk(module: str) -> ModuleType:
        return import_sdk(module, cloud="alibaba", label="Alibaba Cloud",
                          package="alibabacloud-ecs20140526")

    models = sdk("alibabacloud_ecs20140526.models")
    client = sdk("alibabacloud_ecs20140526.client")
    config = sdk("alibabacloud_tea_openapi.models")
    return client.Client, models, config.Config


class _DropAll(logging.Filter):
    """Drops every record of the logger it is attached to."""

    def filter(self, record: logging.LogRecord) -> bool:
        return False


_DROP_ALL = _DropAll()
CREDENTIAL_CHAIN_LOGGER = "credentials"
"""The logger `alibabacloud_credentials`' providers log on (sic: not the package name)."""


def _quiet_credential_chain() -> None:
    """Drop the credential chain's log records. Its providers log each failed probe
    (no ECS metadata service, no profile file ...) as a warning and again with a
    traceback, on their own stderr handler, on every API call; the outcome is reported
    by `credentials()` as one `AuthFailed`. Idempotent."""
    chain_log = logging.getLogger(CREDENTIAL_CHAIN_LOGGER)
    if _DROP_ALL not in chain_log.filters:
        chain_log.addFilter(_DROP_ALL)


def parse_endpoint(url: str) -> tuple[str, str]:
    """A configured endpoint URL as the Tea `Config`'s (endpoint, protocol):
    ``http://127.0.0.1:8080`` → (``127.0.0.1:8080``, ``http``). Raises `InvalidConfig`
    for anything but an http(s) URL with a host and no path."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidConfig(f"clouds.alibaba.endpoint {url!r}: must be http(s)://HOST[:PORT]",
                            cloud="alibaba")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise InvalidConfig(f"clouds.alibaba.endpoint {url!r}: Alibaba RPC APIs are served "
                            "at '/'; give only scheme, host and port", cloud="alibaba")
    try:
        port = parts.port
    except ValueError as exc:
        raise InvalidConfig(f"clouds.alibaba.endpoint {url!r}: {exc}",
                            cloud="alibaba") from None
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    return (f"{host}:{port}" if port else host), parts.scheme


def _status_of(exc: Any) -> int:
    status = getattr(exc, "status_code", None) or getattr(exc, "statusCode", None)
    if status is None and isinstance(getattr(exc, "data", None), dict):
        status = exc.data.get("statusCode")
    try:
        return int(status or 0)
    except (TypeError, ValueError):
        return 0


def classify(code: str, status: int, message: str, *, region: str = "",
             retry_after: float | None = None, throttled: bool = False) -> AdapterError:
    """The one table from Alibaba's (error code, HTTP status) onto typed errors, in
    order: a throttle (any `Throttling*` code, a 429, or an answer the SDK calls one
    because it carries a retry-after hint: `throttled`) whatever else it says; capacity;
    quota; a region that does not exist; credentials and permissions (and any 401/403);
    a 5xx or a code that says the service failed; anything else is a request Alibaba
    refuses, permanent."""
    def typed(cls: type[AdapterError]) -> AdapterError:
        return cls(message, cloud="alibaba", region=region)

    if throttled or code.startswith("Throttling") or status == 429:
        return RateLimited(message, cloud="alibaba", region=region, retry_after=retry_after)
    if code in _CAPACITY:
        return typed(CapacityUnavailable)
    if code in _QUOTA or code.startswith("QuotaExceed"):  # QuotaExceed(ed).*
        return typed(QuotaExceeded)
    if code in _CONFIG:
        return typed(InvalidConfig)
    if (code in _AUTH or code.startswith(("Forbidden", "InvalidAccessKeyId",
                                          "InvalidSecurityToken"))
            or status in (401, 403)):
        return typed(AuthFailed)
    if code in _UNAVAILABLE or code.startswith("ServiceUnavailable") or status >= 500:
        return typed(CloudUnavailable)
    return typed(AdapterError)


def translate(exc: BaseException, region: str = "", op: str = "") -> AdapterError:
    """Map a Tea SDK exception onto the typed errors of the adapter contract; the one
    table, in order:

    ===========================================================  ========================
    ``CredentialException`` (the default chain found nothing),    `AuthFailed`
    alone or wrapped in ``UnretryableException``
    an error answer (``ClientException``, ``ServerException``,    `classify` (code, HTTP
    ``ThrottlingException`` with its ``x-acs-retry-after`` ms)    status)
    ``UnretryableException`` around ``RetryError`` / ``OSError``  `CloudUnavailable`
    (connection refused or reset, no answer within the call
    timeout, a body cut off in transfer)
    ``UnretryableException`` around a parse failure (the SDK's    `CloudUnavailable`
    ``RuntimeError("Failed to parse the value as json             (garbled answer)
    format ...")``, ``ValueError``, ``UnicodeDecodeError``, an
    XML ``ParseError``): a body cut off or garbled
    ``UnretryableException`` around anything else                 `AdapterError`
    ===========================================================  ========================

    Anything else is re-raised: it is a bug, not a cloud failure."""
    _tea()
    from alibabacloud_credentials.exceptions import CredentialException
    from alibabacloud_tea_openapi.exceptions import ThrottlingException
    from darabonba.exceptions import RetryError
    from Tea.exceptions import TeaException, UnretryableException

    where = f"{op}: " if op else ""

    def typed(cls: type[AdapterError], msg: str) -> AdapterError:
        return cls(where + msg, cloud="alibaba", region=region)

    if isinstance(exc, AdapterError):
        return exc
    if isinstance(exc, CredentialException):
        return typed(AuthFailed, NO_CREDENTIALS)
    if isinstance(exc, UnretryableException):
        # The SDK wraps what failed before an answer could be read: credentials, the
        # connection (RetryError around requests' IOError), an unreadable body.
        inner = exc.inner_exception
        if isinstance(inner, CredentialException):
            return typed(AuthFailed, NO_CREDENTIALS)
        if isinstance(inner, TeaException) and inner is not exc:
            return translate(inner, region, op)
        if isinstance(inner, RetryError | OSError | TimeoutError):
            text = str(getattr(inner, "message", None) or inner or type(inner).__name__)
            return typed(CloudUnavailable, f"connection failed or no answer in time: {text}")
        if _garbled(inner):
            return typed(CloudUnavailable, "garbled answer (cut off, or not the JSON it "
                                           f"should be): {_shorten(str(inner))}")
        return typed(AdapterError, f"{type(inner).__name__}: {_shorten(str(inner))}")
    if isinstance(exc, TeaException):
        code = str(exc.code or "")
        status = _status_of(exc)
        data = exc.data if isinstance(exc.data, dict) else {}
        detail = data.get("Message") or data.get("message") or exc.message or ""
        request_id = data.get("RequestId") or getattr(exc, "request_id", None)
        msg = f"{code or 'error'}: {detail}".strip()
        if status:
            msg += f" (HTTP {status}" + (f", request {request_id})" if request_id else ")")
        retry_ms = getattr(exc, "retry_after", None)
        return classify(code, status, where + msg, region=region,
                        retry_after=retry_ms / 1000 if retry_ms else None,
                        throttled=isinstance(exc, ThrottlingException))
    raise exc


def _garbled(exc: BaseException) -> bool:
    """Whether `exc` says an answer could not be parsed: the Tea SDK raises a bare
    ``RuntimeError('Failed to parse the value as json format, Value: ...')``; JSON,
    text decoding and XML parsers raise ``ValueError`` or ``SyntaxError`` kinds."""
    if isinstance(exc, ValueError | SyntaxError):  # JSONDecodeError, UnicodeDecodeError
        return True
    return isinstance(exc, RuntimeError) and str(exc).startswith("Failed to parse")


def _shorten(text: str) -> str:
    """`text` on one line, at most `_SHOWN` characters (an error may quote a whole
    garbled body)."""
    one = " ".join(text.split())
    return one if len(one) <= _SHOWN else one[:_SHOWN] + "…"


class AlibabaSdk:
    """Blocking ECS calls, translated and retried. Thread-safe.

    `call_timeout` (seconds, `call_timeout_seconds` in the configuration) bounds one
    call: to connect, and between bytes of the answer. `spot_duration` (hours of
    protection of a spot instance, 0 or 1; `spot_duration` in the configuration) is the
    `SpotDuration` the spot questions ask about: a spot price and stock are per
    protection period, and Alibaba's default is 1."""

    def __init__(self, *, endpoint: str | None = None, anonymous: bool = False,
                 attempts: int = ATTEMPTS, max_backoff: float = MAX_BACKOFF,
                 call_timeout: float = 10.0, spot_duration: int = 1,
                 on_call: Callable[[str, str], None] | None = None) -> None:
        _tea()
        if anonymous and not endpoint:
            raise InvalidConfig("clouds.alibaba.anonymous: true is allowed only together "
                                "with endpoint", cloud="alibaba")
        if spot_duration not in (0, 1):
            raise InvalidConfig("clouds.alibaba.spot_duration must be 0 or 1 (hours of "
                                "protection)", cloud="alibaba")
        self.spot_duration = spot_duration
        if not call_timeout > 0:
            raise InvalidConfig("clouds.alibaba.call_timeout_seconds must be positive",
                                cloud="alibaba")
        self.endpoint = endpoint
        self._host: str | None = None
        self._protocol: str | None = None
        if endpoint:
            self._host, self._protocol = parse_endpoint(endpoint)
        self._anonymous = anonymous
        self._credential: Any = None  # the default chain, once it has answered
        self._no_credential: tuple[float, AuthFailed] | None = None  # its last refusal
        self._credential_lock = threading.Lock()
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._warm: set[str] = set()
        self._warm_lock = threading.Lock()
        # The one retry layer; a retry-after hint beyond its cap goes up to the poller.
        self.retry = RetryPolicy(attempts, max_backoff, long_hint="raise")
        self.call_timeout_ms = max(1, round(call_timeout * 1000))
        self._on_call = on_call

    # --- credentials -------------------------------------------------------------------

    def credentials(self) -> None:
        """Make sure the SDK's default chain has credentials (nothing to do with
        `anonymous`). Asks the chain once and keeps it when it answers; a refusal is
        remembered for `CREDENTIALS_RECHECK` seconds. Raises `AuthFailed` naming the
        sources the chain looks at; the chain's own reasons are logged at debug."""
        if self._anonymous:
            return
        with self._credential_lock:
            if self._credential is not None:
                return
            now = time.monotonic()
            if (self._no_credential is not None
                    and now - self._no_credential[0] < CREDENTIALS_RECHECK):
                raise self._no_credential[1]
            _tea()
            from alibabacloud_credentials.client import Client as CredentialClient
            from alibabacloud_credentials.exceptions import CredentialException

            _quiet_credential_chain()
            chain = CredentialClient()  # the SDK's default chain, built afresh each look
            try:
                chain.get_credential()
            except CredentialException as exc:
                log.debug("alibaba credential chain found nothing", detail=_shorten(str(exc)))
                refusal = AuthFailed(NO_CREDENTIALS, cloud="alibaba")
                self._no_credential = (now, refusal)
                raise refusal from None
            self._credential, self._no_credential = chain, None

    # --- clients -----------------------------------------------------------------------

    def client(self, region: str) -> Any:
        """The ECS client for `region` (one per region: the endpoint is regional)."""
        self.credentials()
        with self._lock:
            if region not in self._clients:
                self._clients[region] = self._new_client(region)
            return self._clients[region]

    def _new_client(self, region: str) -> Any:
        client_cls, _, config_cls = _tea()
        from darabonba.policy.retry import RetryOptions

        config = config_cls(region_id=region, connect_timeout=self.call_timeout_ms,
                            read_timeout=self.call_timeout_ms, max_idle_conns=64,
                            retry_options=RetryOptions({"retryable": False}))
        if self._host:
            config.endpoint, config.protocol = self._host, self._protocol
        if self._anonymous:
            config.access_key_id = ANONYMOUS_KEY_ID
            config.access_key_secret = ANONYMOUS_KEY_SECRET
        else:
            config.credential = self._credential
        return client_cls(config)

    def _runtime(self) -> Any:
        """Per-call options: the SDK's own retries off, the call timeout."""
        from darabonba.runtime import RuntimeOptions

        return RuntimeOptions(autoretry=False, max_attempts=0,
                              connect_timeout=self.call_timeout_ms,
                              read_timeout=self.call_timeout_ms)

    @staticmethod
    def _host_of(client: Any) -> str:
        return str(getattr(client, "_endpoint", "") or "")

    # --- calls -------------------------------------------------------------------------

    def _call(self, region: str, op: str, request: Any) -> dict[str, Any]:
        """Call `op` (the SDK method name, e.g. `describe_price`) with `request`, with
        translation and retries of RateLimited / CloudUnavailable. Returns the body as
        the API's PascalCase map."""
        client = self.client(region)
        method = getattr(client, f"{op}_with_options")
        on_call = self._on_call
        response = self.retry.call(
            lambda: self._first_use(client, lambda: method(request, self._runtime())),
            lambda exc: translate(exc, region, op),
            None if on_call is None else lambda: on_call(op, region))
        body: dict[str, Any] = response.body.to_map() if response.body is not None else {}
        return body

    def _first_use(self, client: Any, fn: Callable[[], T]) -> T:
        """Run `fn`, serialising the first call per endpoint: the SDK keeps one
        `requests` session per endpoint in a process-wide dict that it fills without a
        lock, and two threads racing to create it would leak the loser's sockets."""
        host = self._host_of(client)
        if host not in self._warm:
            with self._warm_lock:
                if host not in self._warm:  # the others waited here, then go at once
                    try:
                        return fn()
                    finally:
                        self._warm.add(host)
        return fn()

    def _request(self, name: str, **fields: Any) -> Any:
        _, models, _ = _tea()
        return getattr(models, name)(**fields)

    # --- ECS ---------------------------------------------------------------------------

    def gpu_instance_types(self, region: str) -> list[dict[str, Any]]:
        """Every instance type with GPUs (`GPUAmount` ≥ 1), all pages (`NextToken`)."""
        out: list[dict[str, Any]] = []
        token: str | None = None
        for _ in range(MAX_PAGES):
            page = self._call(region, "describe_instance_types", self._request(
                "DescribeInstanceTypesRequest", minimum_gpuamount=1,
                max_results=INSTANCE_TYPES_PAGE, next_token=token))
            out.extend(t for t in (page.get("InstanceTypes") or {}).get("InstanceType") or []
                       if int(t.get("GPUAmount") or 0) > 0)
            token = page.get("NextToken") or None
            if not token:
                break
        return out

    def available_resources(self, region: str, spot: bool
                            ) -> list[tuple[str, str, str | None, str | None]]:
        """(zone, instance type, Status, StatusCategory) of every instance type the
        region sells pay-as-you-go (`spot=False`, `SpotStrategy=NoSpot`) or as spot
        (`SpotAsPriceGo`, with the configured `SpotDuration`), in stock or not. One call:
        the API has no paging."""
        body = self._call(region, "describe_available_resource", self._request(
            "DescribeAvailableResourceRequest", region_id=region,
            destination_resource="InstanceType", resource_type="instance",
            instance_charge_type="PostPaid", io_optimized="optimized",
            spot_strategy="SpotAsPriceGo" if spot else "NoSpot",
            spot_duration=self.spot_duration if spot else None))
        out: list[tuple[str, str, str | None, str | None]] = []
        for zone in (body.get("AvailableZones") or {}).get("AvailableZone") or []:
            zone_id = zone.get("ZoneId")
            resources = (zone.get("AvailableResources") or {}).get("AvailableResource") or []
            for res in resources:
                if res.get("Type") != "InstanceType":
                    continue
                supported = (res.get("SupportedResources") or {}).get("SupportedResource") or []
                out.extend((zone_id, s["Value"], s.get("Status"), s.get("StatusCategory"))
                           for s in supported if zone_id and s.get("Value"))
        return out

    def spot_price_history(self, region: str, instance_type: str, since: datetime
                           ) -> tuple[list[dict[str, Any]], str | None]:
        """(`SpotPriceType` entries, currency) of Linux VPC spot prices of one instance
        type in every zone of the region since `since` (the API allows 30 days back),
        for the configured protection period (`SpotDuration`), all pages (`Offset` /
        `NextOffset`)."""
        points: list[dict[str, Any]] = []
        currency: str | None = None
        offset = 0
        start = since.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        for _ in range(MAX_PAGES):
            body = self._call(region, "describe_spot_price_history", self._request(
                "DescribeSpotPriceHistoryRequest", region_id=region,
                instance_type=instance_type, network_type="vpc", ostype="linux",
                io_optimized="optimized", start_time=start, offset=offset or None,
                spot_duration=self.spot_duration))
            page = (body.get("SpotPrices") or {}).get("SpotPriceType") or []
            points.extend(page)
            currency = body.get("Currency") or currency
            nxt = int(body.get("NextOffset") or 0)
            if not page or nxt <= offset:
                break
            offset = nxt
        return points, currency

    def price(self, region: str, instance_type: str) -> dict[str, Any]:
        """`PriceInfo.Price` of one pay-as-you-go Linux instance of `instance_type` for
        one hour (`ResourceType=instance`, `PriceUnit=Hour`, `Period=1`, VPC,
        `SpotStrategy=NoSpot`); system disk and bandwidth are itemised in it."""
        body = self._call(region, "describe_price", self._request(
            "DescribePriceRequest", region_id=region, resource_type="instance",
            instance_type=instance_type, price_unit="Hour", period=1, amount=1,
            platform="linux", instance_network_type="vpc", io_optimized="optimized",
            spot_strategy="NoSpot"))
        return dict((body.get("PriceInfo") or {}).get("Price") or {})

    def spot_advice(self, region: str, instance_types: Sequence[str]
                    ) -> list[tuple[str, str, Any, str | None]]:
        """(zone, instance type, InterruptionRate %, InterruptRateDesc) from
        `DescribeSpotAdvice` (the last 30 days), 10 instance types per call."""
        out: list[tuple[str, str, Any, str | None]] = []
        for chunk in _chunks(instance_types, SPOT_ADVICE_TYPES):
            body = self._call(region, "describe_spot_advice", self._request(
                "DescribeSpotAdviceRequest", region_id=region, instance_types=list(chunk)))
            for zone in (body.get("AvailableSpotZones") or {}).get("AvailableSpotZone") or []:
                resources = ((zone.get("AvailableSpotResources") or {})
                             .get("AvailableSpotResource") or [])
                out.extend((zone["ZoneId"], r["InstanceType"], r.get("InterruptionRate"),
                            r.get("InterruptRateDesc"))
                           for r in resources if zone.get("ZoneId") and r.get("InstanceType"))
        return out

    def account_attributes(self, region: str, names: Sequence[str]) -> list[dict[str, Any]]:
        """`AccountAttributeItems.AccountAttributeItem[]` for `names` (≤ 8) in `region`."""
        body = self._call(region, "describe_account_attributes", self._request(
            "DescribeAccountAttributesRequest", region_id=region, attribute_name=list(names)))
        return list((body.get("AccountAttributeItems") or {}).get("AccountAttributeItem") or [])

    # --- teardown ----------------------------------------------------------------------

    def close(self) -> None:
        """Forget the clients and close the SDK's pooled HTTP sessions to their
        endpoints (the SDK keeps them process-wide and never closes them itself)."""
        with self._lock:
            hosts = {self._host_of(c) for c in self._clients.values()} - {""}
            self._clients.clear()
        try:
            from darabonba.core import DaraCore
        except ModuleNotFoundError:  # pragma: no cover - the SDK was never importable
            return
        sessions: dict[str, Any] = getattr(DaraCore, "_sessions", {})
        for key in list(sessions):
            # keys look like "http://127.0.0.1:8080:80:pool=40"
            if any(key.split("://", 1)[-1].startswith(f"{h}:") for h in hosts):
                session = sessions.pop(key, None)
                if session is not None:
                    session.close()


def _chunks(items: Sequence[str], n: int) -> Iterator[Sequence[str]]:
    for i in range(0, len(items), n):
        yield items[i:i + n]
