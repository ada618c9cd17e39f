"""The narrow seam between the Azure adapter and Azure's SDK and REST APIs.

Everything the adapter asks of Azure goes through this module, each question one method
returning plain Python data (the services' own JSON shapes, camelCase) and raising only
the typed errors of `adapters.errors`:

* `AzureSdk` — blocking calls through the real `azure-mgmt-compute`
  `ComputeManagementClient` (the adapter runs them on its own executor): Resource SKUs,
  vCPU usages, and Resource Graph queries (sent with the same client's `send_request`,
  so they share its pipeline, credential and error handling; `azure-mgmt-resourcegraph`
  is not needed).
* `RetailPrices` — the public Azure Retail Prices REST API over aiohttp (async, no
  credential: the API takes none).

Azure's error codes, HTTP statuses and the SDKs' exceptions are translated here, once
(`translate`, `classify`). What can heal by itself is retryable: a throttle (`RateLimited`,
with the service's `Retry-After`), a 5xx, a connection failure, a call that took longer
than `call_timeout` seconds (connect, or waiting for the answer) and an answer that cannot
be read (cut off, garbled: not the JSON it should be) are `CloudUnavailable`. Each call is
retried here, alone, by `adapters.common.RetryPolicy` (the one retry layer: jittered
backoff, never sooner than `Retry-After`, never past the poll's deadline; a `Retry-After`
longer than the backoff cap goes up to the poller, which honours it). What cannot heal
(credentials, permissions, a subscription or region that does not exist, a request ARM
refuses) is permanent and never retried. The SDK's own retry policy is switched off.

`endpoint` replaces every Azure host: ARM (`management.azure.com`, which also serves
Resource Graph) and the Retail Prices API (`prices.azure.com`); paging links the
services return are re-based onto it too, so that a test or a private endpoint sees every
request.

Credentials come only from `DefaultAzureCredential` (environment, workload identity,
managed identity, Azure CLI ...). With `anonymous=True` (tests and emulators, allowed
only with an `endpoint`) the client gets no credential and no bearer-token policy at
all: its `authentication_policy` is a no-op `SansIOHTTPPolicy`. That is the generated
client's own, documented configuration knob, so the rest of its pipeline (headers,
request ids, redirects, logging) stays exactly as in production; and since only the
bearer-token policy refuses plain-http URLs, the same client can talk to a local
`http://` fake. (The alternatives: replacing the whole pipeline through `policies=`
would copy the generated client's policy list and drift from it; a dummy
`TokenCredential` would still send a made-up bearer token, and still be refused over
http.) A non-anonymous `http://` endpoint is refused at construction (`InvalidConfig`),
since azure-core would refuse to send a bearer token over it anyway.

azure-mgmt-compute and azure-identity are imported lazily: gpubroker starts without
them, and a missing one reads
``Azure support needs azure-mgmt-compute: pip install 'gpubroker[azure]'``.
"""

from __future__ import annotations

import email.utils
import json
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from types import ModuleType
from typing import Any, TypeVar
from urllib.parse import quote, urlencode, urlsplit, urlunsplit

import aiohttp

from adapters.common import RetryPolicy, import_sdk, remaining
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

ARM_HOST = "https://management.azure.com"
RETAIL_HOST = "https://prices.azure.com"
RETAIL_PATH = "/api/retail/prices"
RETAIL_API = "2023-01-01-preview"
GRAPH_PATH = "/providers/Microsoft.ResourceGraph/resources"
GRAPH_API = "2021-03-01"
GPU_SKU_PREFIX = "Standard_N"  # NC, ND, NV (and NG, NP): every GPU family
REGION = re.compile(r"^[a-z][a-z0-9]{1,40}$")
CLOUD = "azure"

_CAPACITY = {"SkuNotAvailable", "AllocationFailed", "ZonalAllocationFailed",
             "OverconstrainedAllocationRequest", "OverconstrainedZonalAllocationRequest",
             "AllocationFailedSkuNotAvailable"}
_QUOTA = {"OperationNotAllowed", "QuotaExceeded", "ResourceQuotaExceeded"}
_THROTTLE = {"TooManyRequests", "SubscriptionRequestsThrottled", "TenantRequestsThrottled",
             "RateLimiting", "Throttled"}
_AUTH = {"AuthorizationFailed", "AuthenticationFailed", "InvalidAuthenticationToken",
         "InvalidAuthenticationTokenTenant", "InvalidAuthenticationTokenAudience",
         "ExpiredAuthenticationToken", "LinkedAuthorizationFailed",
         "AuthenticationFailedMissingToken"}
_CONFIG = {"SubscriptionNotFound", "InvalidSubscriptionId", "InvalidLocation",
           "LocationNotAvailableForResourceType", "NoRegisteredProviderFound",
           "MissingSubscriptionRegistration", "DisallowedLocation"}
_UNAVAILABLE = {"InternalServerError", "ServiceUnavailable", "GatewayTimeout", "BadGateway",
                "InternalOperationError", "ServerTimeout", "RequestTimeout"}
_NO_CREDENTIALS = ("no usable Azure credentials in DefaultAzureCredential's chain "
                   "(environment, workload identity, managed identity, Azure CLI ...)")


def _azure() -> ModuleType:
    """azure.mgmt.compute, imported on first use."""
    return import_sdk("azure.mgmt.compute", cloud=CLOUD, label="Azure",
                      package="azure-mgmt-compute")


# --- errors ------------------------------------------------------------------------

def retry_after_of(headers: Mapping[str, str] | None, now: datetime | None = None
                   ) -> float | None:
    """Seconds to wait from `Retry-After` (seconds or an HTTP date) or, failing that,
    Resource Graph's `x-ms-user-quota-resets-after` (hh:mm:ss)."""
    if not headers:
        return None
    value = headers.get("Retry-After") or headers.get("retry-after")
    if value:
        try:
            return max(0.0, float(value))
        except ValueError:
            try:
                when = email.utils.parsedate_to_datetime(value)
            except (TypeError, ValueError):
                return None
            return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())
    resets = headers.get("x-ms-user-quota-resets-after")
    if resets and (m := re.fullmatch(r"(\d+):(\d+):(\d+(?:\.\d+)?)", resets.strip())):
        return int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3))
    return None


def classify(status: int, code: str, message: str, *, region: str = "",
             retry_after: float | None = None) -> AdapterError:
    """The one table from Azure's (HTTP status, error code) onto typed errors.

    A 429 is a throttle whatever its code: the Compute resource provider throttles with
    429 and code `OperationNotAllowed` (details `TooManyRequests`), which on any other
    status means a quota."""
    msg = f"{code or status}: {message}".strip().rstrip(":")
    if code in _THROTTLE or status == 429:
        return RateLimited(msg, retry_after=retry_after, cloud=CLOUD, region=region)
    if code in _CAPACITY:
        return CapacityUnavailable(msg, cloud=CLOUD, region=region)
    if code in _QUOTA:
        return QuotaExceeded(msg, cloud=CLOUD, region=region)
    if code in _AUTH or status in (401, 403):
        return AuthFailed(msg, cloud=CLOUD, region=region)
    if code in _CONFIG:
        return InvalidConfig(msg, cloud=CLOUD, region=region)
    if code in _UNAVAILABLE or status >= 500:
        return CloudUnavailable(msg, cloud=CLOUD, region=region)
    return AdapterError(msg, cloud=CLOUD, region=region)


# Many returns: one return per SDK error class: a flat mapping table.
def translate(exc: BaseException, region: str = "") -> AdapterError:  # noqa: PLR0911
    """Map an azure-core, aiohttp or JSON exception onto the typed errors of the adapter
    contract; the one table, in order:

    ======================================================  ================================
    ``ClientAuthenticationError`` (no credential; a 401)    `AuthFailed`
    ``DecodeError`` (a 2xx whose body is not JSON: cut      `CloudUnavailable` (garbled)
    off, garbled; ``IncompleteReadError``),
    ``DeserializationError`` (JSON that is not ARM's shape)
    ``HttpResponseError`` (an error status)                 `classify` (status, ARM code)
    ``ServiceRequestError``, ``ServiceResponseError``       `CloudUnavailable`
    (connection failures, ``…TimeoutError``: connect or
    read took longer than the call timeout)
    any other ``AzureError``                                `AdapterError` (permanent)
    aiohttp ``ContentTypeError``, ``json.JSONDecodeError``  `CloudUnavailable` (garbled)
    aiohttp ``ClientError`` (connection, a body cut off     `CloudUnavailable`
    mid-stream), ``TimeoutError``
    ======================================================  ================================

    Anything else is re-raised: it is a bug, not a cloud failure."""
    if isinstance(exc, AdapterError):
        return exc
    _azure()
    from azure.core import exceptions as az

    def unavailable(what: str) -> CloudUnavailable:
        return CloudUnavailable(what, cloud=CLOUD, region=region)

    if isinstance(exc, az.ClientAuthenticationError):
        if exc.response is None:
            # The credential chain itself failed; its text names every credential it
            # tried, which is noise at best, so it stays out of the message.
            return AuthFailed(f"{_NO_CREDENTIALS}: {type(exc).__name__}", cloud=CLOUD,
                              region=region)
        # ARM's 401, or the token endpoint refusing the credential (any status).
        code = str(getattr(exc.error, "code", "") or "")
        return AuthFailed(f"{code or exc.status_code}: {exc.reason or 'unauthorized'}",
                          cloud=CLOUD, region=region)
    if isinstance(exc, az.DecodeError | az.DeserializationError):
        message = exc.message if isinstance(exc, az.AzureError) else str(exc)
        return unavailable(f"garbled answer from Azure ({type(exc).__name__}): "
                           f"{message.splitlines()[0] if message else ''}")
    if isinstance(exc, az.HttpResponseError):
        error = exc.error
        headers = getattr(exc.response, "headers", None)
        return classify(exc.status_code or 0, str(getattr(error, "code", "") or ""),
                        str(getattr(error, "message", "") or exc.reason or ""),
                        region=region, retry_after=retry_after_of(headers))
    if isinstance(exc, az.ServiceRequestError | az.ServiceResponseError):
        return unavailable(f"{type(exc).__name__}: {exc.message}")
    if isinstance(exc, az.AzureError):
        return AdapterError(f"{type(exc).__name__}: {exc.message}", cloud=CLOUD,
                            region=region)
    if isinstance(exc, aiohttp.ContentTypeError | json.JSONDecodeError):
        return unavailable(f"garbled answer from Azure ({type(exc).__name__}): {exc}")
    if isinstance(exc, aiohttp.ClientError | TimeoutError):
        return unavailable(f"{type(exc).__name__}: {exc}" if str(exc)
                           else f"{type(exc).__name__}: no answer within the call timeout")
    raise exc


# --- paging links ---------------------------------------------------------------------

def rebase(link: str, base: str | None) -> str:
    """A paging link moved onto the configured endpoint (scheme and host only)."""
    if not base:
        return link
    b, u = urlsplit(base), urlsplit(link)
    return urlunsplit((b.scheme, b.netloc, u.path, u.query, u.fragment))


def check_region(region: str) -> str:
    """Azure region names are lowercase letters and digits (`eastus2`); anything else
    cannot be one, and must not reach a query string."""
    if not REGION.fullmatch(region):
        raise InvalidConfig(f"{region!r} is not an Azure region name (like eastus, "
                            "westeurope)", cloud=CLOUD, region=region)
    return region


def eviction_query(region: str) -> str:
    """The Resource Graph query for the Spot eviction-rate bands of GPU sizes."""
    return (
        "SpotResources"
        " | where type =~ 'microsoft.compute/skuspotevictionrate/location'"
        f" | where location =~ '{check_region(region)}'"
        f" | where tolower(tostring(sku.name)) startswith '{GPU_SKU_PREFIX.lower()}'"
        " | project skuName = tostring(sku.name), location,"
        " evictionRate = tostring(properties.evictionRate)")


def retail_filter(region: str) -> str:
    """The Retail Prices `$filter`: pay-as-you-go VM meters of GPU sizes in a region."""
    return (f"serviceName eq 'Virtual Machines' and armRegionName eq '{check_region(region)}'"
            f" and priceType eq 'Consumption' and contains(armSkuName, '{GPU_SKU_PREFIX}')")


class _NoCredential:
    """The credential of an anonymous client. Never asked for a token: the client's
    authentication policy is a no-op."""

    def get_token(self, *scopes: str, **kwargs: Any) -> Any:
        raise AuthFailed("anonymous Azure client: no credentials", cloud=CLOUD)


# --- ARM ---------------------------------------------------------------------------

class AzureSdk:
    """Blocking ARM calls through the real ComputeManagementClient, translated and
    retried. Thread-safe (azure-core clients are)."""

    def __init__(self, *, subscription_id: str, endpoint: str | None = None,
                 anonymous: bool = False, attempts: int = RetryPolicy.ATTEMPTS,
                 max_backoff: float = RetryPolicy.MAX_BACKOFF,
                 call_timeout: float = 10.0, max_connections: int = 32,
                 on_call: Callable[[str, str], None] | None = None) -> None:
        compute = _azure()
        import requests
        from azure.core.pipeline.policies import RetryPolicy as CoreRetryPolicy
        from azure.core.pipeline.policies import SansIOHTTPPolicy
        from azure.core.pipeline.transport import RequestsTransport

        self.endpoint = endpoint.rstrip("/") if endpoint else None
        if anonymous and not self.endpoint:
            raise InvalidConfig("clouds.azure.anonymous: true needs an endpoint", cloud=CLOUD)
        if not anonymous and self.endpoint and urlsplit(self.endpoint).scheme != "https":
            raise InvalidConfig("clouds.azure.endpoint must be https:// unless anonymous: "
                                "true (Azure credentials are never sent over plain http)",
                                cloud=CLOUD)
        self.retry = RetryPolicy(attempts, max_backoff)
        self.call_timeout = call_timeout
        self._on_call = on_call
        self._credential: Any = None
        extra: dict[str, Any] = {}
        credential: Any
        if anonymous:
            credential = _NoCredential()
            extra["authentication_policy"] = SansIOHTTPPolicy()
        else:
            identity = import_sdk("azure.identity", cloud=CLOUD, label="Azure",
                                  package="azure-identity")
            credential = self._credential = identity.DefaultAzureCredential()
        session = requests.Session()
        pool = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=max_connections)
        session.mount("https://", pool)
        session.mount("http://", pool)
        # One call's limit (`call_timeout_seconds`): to connect, and between bytes of the
        # answer; a call over it is a ServiceRequest/ResponseTimeoutError, retried.
        transport = RequestsTransport(session=session, session_owner=True,
                                      connection_timeout=call_timeout,
                                      read_timeout=call_timeout)
        self.client: Any = compute.ComputeManagementClient(
            credential, subscription_id, base_url=self.endpoint or ARM_HOST,
            retry_policy=CoreRetryPolicy.no_retries(), transport=transport, **extra)
        self._lock = threading.Lock()
        self._closed = False

    def _call(self, region: str, op: str, fn: Callable[[], T]) -> T:
        """Run `fn` with translation and retries of RateLimited / CloudUnavailable."""
        on_call = self._on_call
        return self.retry.call(fn, lambda exc: translate(exc, region),
                               None if on_call is None else lambda: on_call(op, region))

    def _pages(self, region: str, op: str, start: Callable[[], Any]
               ) -> Iterator[list[dict[str, Any]]]:
        """Every page of an ARM list operation (`nextLink`), each page fetched (and
        retried) on its own, its items as the service's JSON."""
        token: str | None = None
        while True:
            def one(token: str | None = token) -> tuple[list[dict[str, Any]], str | None]:
                pages = start().by_page(continuation_token=token)
                page = next(pages, None)
                items = [] if page is None else [item.as_dict() for item in page]
                return items, pages.continuation_token

            items, token = self._call(region, op, one)
            yield items
            if not token:
                return
            token = rebase(token, self.endpoint)

    def resource_skus(self, region: str) -> list[dict[str, Any]]:
        """Every Microsoft.Compute SKU of the region (VM sizes, disks ...), as ARM's
        JSON. Empty for a location ARM does not know."""
        flt = f"location eq '{check_region(region)}'"
        out: list[dict[str, Any]] = []
        for page in self._pages(region, "resource_skus.list",
                                lambda: self.client.resource_skus.list(filter=flt)):
            out.extend(page)
        return out

    def usages(self, region: str) -> list[dict[str, Any]]:
        """The subscription's vCPU usages and limits in the region (per VM family,
        `cores`, `lowPriorityCores` ...)."""
        out: list[dict[str, Any]] = []
        for page in self._pages(region, "usage.list",
                                lambda: self.client.usage.list(check_region(region))):
            out.extend(page)
        return out

    def capacity_reservation_groups(self, region: str) -> list[dict[str, Any]]:
        """Every capacity reservation group of the subscription, in every region (ARM
        lists them per subscription), as ARM's JSON; every page."""
        out: list[dict[str, Any]] = []
        for page in self._pages(region, "capacity_reservation_groups.list",
                                self.client.capacity_reservation_groups.list_by_subscription):
            out.extend(page)
        return out

    def capacity_reservation_group(self, region: str, resource_group: str, name: str
                                   ) -> dict[str, Any] | None:
        """A capacity reservation group with its instance view (`$expand=instanceView`:
        each reservation's utilisation), as ARM's JSON; None if it is gone (404)."""
        groups = self.client.capacity_reservation_groups

        def get() -> dict[str, Any]:
            group: dict[str, Any] = groups.get(resource_group, name,
                                               expand="instanceView").as_dict()
            return group

        return _unless_gone(lambda: self._call(region, "capacity_reservation_groups.get",
                                               get))

    def capacity_reservations(self, region: str, resource_group: str, group: str
                              ) -> list[dict[str, Any]] | None:
        """The capacity reservations of a group, as ARM's JSON; every page. None if the
        group is gone (404)."""
        reservations = self.client.capacity_reservations

        def read() -> list[dict[str, Any]]:
            out: list[dict[str, Any]] = []
            for page in self._pages(
                    region, "capacity_reservations.list",
                    lambda: reservations.list_by_capacity_reservation_group(resource_group,
                                                                            group)):
                out.extend(page)
            return out

        return _unless_gone(read)

    def eviction_rates(self, region: str) -> list[Any]:
        """Resource Graph rows (`skuName`, `location`, `evictionRate`) of the Spot
        eviction-rate bands of the region's GPU sizes, every page (`$skipToken`)."""
        from azure.core.rest import HttpRequest

        # No `subscriptions` in the request: SpotResources is not a per-subscription
        # table, and Resource Graph answers it at the caller's tenant scope.
        query = eviction_query(region)
        rows: list[Any] = []
        skip: str | None = None
        while True:
            options: dict[str, Any] = {"resultFormat": "objectArray", "$top": 1000}
            if skip:
                options["$skipToken"] = skip

            def one(options: dict[str, Any] = options) -> dict[str, Any]:
                response = self.client.send_request(HttpRequest(
                    "POST", f"{GRAPH_PATH}?api-version={GRAPH_API}",
                    json={"query": query, "options": options}))
                response.raise_for_status()
                body = response.json()
                if not isinstance(body, dict):
                    raise CloudUnavailable("garbled answer from Resource Graph: a JSON "
                                           f"{type(body).__name__}, not an object",
                                           cloud=CLOUD, region=region)
                return body

            page = self._call(region, "resource_graph", one)
            data = page.get("data")
            if isinstance(data, dict):  # resultFormat "table": {columns, rows}
                rows.append(data)
            else:
                rows.extend(data or [])
            skip = page.get("$skipToken")
            if not skip:
                return rows

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.client.close()
        if self._credential is not None:
            self._credential.close()


def _unless_gone(call: Callable[[], T]) -> T | None:
    """`call()`, or None when it failed because what it reads is gone: ARM's 404
    (`ResourceNotFound`, `ParentResourceNotFound`), which a listing that raced a deletion
    meets."""
    from azure.core.exceptions import ResourceNotFoundError

    try:
        return call()
    except AdapterError as exc:
        if isinstance(exc.__cause__, ResourceNotFoundError):
            return None
        raise


# --- Retail Prices -------------------------------------------------------------------

class RetailPrices:
    """The public Azure Retail Prices API (no credential), over aiohttp."""

    def __init__(self, *, endpoint: str | None = None,
                 attempts: int = RetryPolicy.ATTEMPTS,
                 max_backoff: float = RetryPolicy.MAX_BACKOFF, call_timeout: float = 10.0,
                 on_call: Callable[[str, str], None] | None = None) -> None:
        self.endpoint = endpoint.rstrip("/") if endpoint else None
        self.retry = RetryPolicy(attempts, max_backoff)
        self.call_timeout = call_timeout
        self._on_call = on_call
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:  # created inside the running loop, on first use
            # As for ARM: `call_timeout` to connect and between bytes of the answer
            # (a whole answer may take longer; the poll's deadline bounds it).
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, connect=self.call_timeout,
                                              sock_read=self.call_timeout),
                connector=aiohttp.TCPConnector(limit=32))
        return self._session

    async def _get(self, region: str, url: str) -> dict[str, Any]:
        from yarl import URL

        async for attempt in self.retry.async_():
            with attempt:
                left = remaining()
                if left is not None and left <= 0:
                    raise CloudUnavailable("the poll's deadline passed; no more attempts",
                                           cloud=CLOUD, region=region)
                if self._on_call is not None:
                    self._on_call("retail_prices", region)
                try:
                    async with self._http().get(URL(url)) as resp:
                        if resp.status != 200:
                            raise _http_error(resp.status, await resp.text(), resp.headers,
                                              region)
                        body = await resp.json()
                        if not isinstance(body, dict):
                            raise CloudUnavailable(
                                "garbled answer from the Retail Prices API: a JSON "
                                f"{type(body).__name__}, not an object", cloud=CLOUD,
                                region=region)
                        return body
                except Exception as exc:  # translated here; anything unknown re-raised
                    raise translate(exc, region) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def vm_prices(self, region: str) -> list[dict[str, Any]]:
        """Every pay-as-you-go (`Consumption`) price item of the region's GPU VM sizes,
        all pages (`NextPageLink`): Linux and Windows, spot, low priority; the caller
        picks."""
        query = urlencode({"api-version": RETAIL_API, "$filter": retail_filter(region)},
                          quote_via=quote, safe="$")
        url: str | None = f"{self.endpoint or RETAIL_HOST}{RETAIL_PATH}?{query}"
        items: list[dict[str, Any]] = []
        while url:
            page = await self._get(region, url)
            items.extend(page.get("Items") or [])
            link = page.get("NextPageLink")
            url = rebase(link, self.endpoint) if link else None
        return items

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _http_error(status: int, body: str, headers: Mapping[str, str], region: str
                ) -> AdapterError:
    """A non-200 answer of a plain REST call, by status and the error code in its body."""
    code, message = "", body[:300]
    try:
        doc = json.loads(body)
        err = doc.get("error") or doc.get("Error") or {}
        code = str(err.get("code") or err.get("Code") or "")
        message = str(err.get("message") or err.get("Message") or message)
    except (ValueError, AttributeError):
        pass
    return classify(status, code, message, region=region, retry_after=retry_after_of(headers))

