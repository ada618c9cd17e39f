"""The narrow seam between the GCP adapter and the Google Cloud client libraries.

Everything the adapter asks of Google Cloud goes through `GcpSdk`: one method per
question, each blocking (the adapter runs them on its own executor), each returning plain
Python data, each raising only the typed errors of `adapters.errors`. The clients are the
real `google-cloud-compute` and `google-cloud-billing` ones on their REST transport.

**Errors** are translated here, once (`translate`, one table): a throttle (429, or
Compute Engine's 403 `rateLimitExceeded`) is `RateLimited`, with the `Retry-After` header
or the `google.rpc.RetryInfo` delay as `retry_after`; a 5xx, a deadline, a connection
that fails or times out (`call_timeout` seconds, connect and read), and an answer that
cannot be read — a body cut off or garbled, which the clients raise as protobuf's
`ParseError`, `json.JSONDecodeError`, a `requests`/`urllib3` protocol or read error — is
`CloudUnavailable`. Both heal on their own, and are retried. Only what cannot heal is
permanent: no credentials or a refused refresh (`AuthFailed`), a denied permission
(`AuthFailed`), an unknown region or project (`InvalidConfig`), a bad request.

**Retries** happen here and nowhere else (`adapters.common.RetryPolicy`: jittered
exponential backoff, never sooner than a `retry_after`, never past the poll's deadline;
a `retry_after` beyond the backoff cap goes up to the poller). The client libraries' own
retries are off (`retry=None` on every call). Paged lists are paged here, each page
fetched, and retried, on its own: a failed page is asked again, not the whole list.

The client libraries are imported lazily: gpubroker starts without them, and a missing
one reads ``GCP support needs google-cloud-compute: pip install 'gpubroker[gcp]'``.

Credentials come from `google.auth.default()` only (GOOGLE_APPLICATION_CREDENTIALS,
`gcloud auth application-default login`, the metadata server), resolved on first use on a
worker thread (the metadata-server probe can take seconds). With `anonymous=True` (tests
and emulators, allowed only with an `endpoint`) no credentials are sent. `endpoint`
replaces both hosts the adapter calls, Compute Engine (`/compute/v1/...`) and the Cloud
Billing Catalog (`/v1/services/...`); ``http://`` endpoints are used as given.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

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

COMPUTE_SERVICE = "6F81-5844-456A"  # the Cloud Billing Catalog's id of Compute Engine
SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)
MAX_PAGES = 10_000
AUTH_RETRY_SECONDS = 60.0  # how long a failure to find credentials is repeated, not retried

# Codes and reasons, compared without case and underscores (`rateLimitExceeded` and
# `RATE_LIMIT_EXCEEDED` are the same reason in the legacy and the ErrorInfo spelling).
STOCKOUT_CODES = ("ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS")
_THROTTLE = {"RATELIMITEXCEEDED", "USERRATELIMITEXCEEDED", "RESOURCEEXHAUSTED",
             "RATELIMITEXCEEDEDPERUSER"}
_QUOTA = {"QUOTAEXCEEDED"}
_STOCKOUT_TEXT = re.compile(r"\bZONE_RESOURCE_POOL_EXHAUSTED(?:_WITH_DETAILS)?\b")
_QUOTA_TEXT = re.compile(r"\bQUOTA_EXCEEDED\b")
_RETRY_DELAY = re.compile(r"^\s*(\d+(?:\.\d+)?)s\s*$")


@dataclass(frozen=True, slots=True)
class Quota:
    limit: float
    usage: float


@dataclass(frozen=True, slots=True)
class RegionInfo:
    zones: tuple[str, ...]
    quotas: Mapping[str, Quota]


@dataclass(frozen=True, slots=True)
class MachineType:
    name: str
    vcpus: int
    memory_mb: int
    accelerators: tuple[tuple[str, int], ...]  # (accelerator type, count)
    deprecated: str = ""  # DEPRECATED, OBSOLETE or DELETED; "" while current


@dataclass(frozen=True, slots=True)
class AcceleratorType:
    name: str
    max_per_instance: int
    deprecated: str = ""


@dataclass(frozen=True, slots=True)
class _Mods:
    compute: Any
    billing: Any
    core: Any  # google.api_core.exceptions
    auth: Any  # google.auth
    auth_exc: Any  # google.auth.exceptions
    auth_transient: tuple[type[Exception], ...]  # its errors of a call that may pass
    anonymous: Any  # google.auth.credentials.AnonymousCredentials
    requests_exc: Any
    urllib3_exc: Any
    parse_error: Any  # google.protobuf.json_format.Error


def _google() -> _Mods:
    """The Google client libraries, imported on first use."""
    def sdk(module: str, package: str = "google-cloud-compute") -> Any:
        return import_sdk(module, cloud="gcp", label="GCP", package=package)

    auth_exc = sdk("google.auth.exceptions")
    # TimeoutError and ResponseError are newer than some google-auth releases still in use
    transient = tuple(getattr(auth_exc, name) for name in
                      ("TransportError", "TimeoutError", "ResponseError")
                      if hasattr(auth_exc, name))
    return _Mods(compute=sdk("google.cloud.compute_v1"),
                 billing=sdk("google.cloud.billing_v1", "google-cloud-billing"),
                 core=sdk("google.api_core.exceptions"), auth=sdk("google.auth"),
                 auth_exc=auth_exc, auth_transient=transient,
                 anonymous=sdk("google.auth.credentials").AnonymousCredentials,
                 requests_exc=sdk("requests.exceptions"),
                 urllib3_exc=sdk("urllib3.exceptions"),
                 parse_error=sdk("google.protobuf.json_format").Error)


def _norm(code: str) -> str:
    return code.replace("_", "").replace("-", "").upper()


_STOCKOUT = {_norm(c) for c in STOCKOUT_CODES}


def _codes(exc: Any) -> set[str]:
    """Every error code and reason a Google API error carries: its ErrorInfo reason, and
    the `reason`/`code` of each entry of `errors` (REST error bodies hold dicts, failed
    Compute Engine operations hold `Errors` messages)."""
    found = {getattr(exc, "reason", None)}
    for entry in getattr(exc, "errors", None) or ():
        for attr in ("reason", "code"):
            found.add(entry.get(attr) if isinstance(entry, dict) else getattr(entry, attr, None))
    return {_norm(c) for c in found if isinstance(c, str) and c}


def _retry_after(exc: Any) -> float | None:
    """Seconds from a `Retry-After` header, else from a `google.rpc.RetryInfo` detail."""
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None)
    if headers is not None:
        with contextlib.suppress(TypeError, ValueError):
            value = headers.get("Retry-After")
            if value is not None:
                return max(0.0, float(value))
    for detail in getattr(exc, "details", None) or ():
        if isinstance(detail, dict) and str(detail.get("@type", "")).endswith("RetryInfo"):
            m = _RETRY_DELAY.match(str(detail.get("retryDelay", "")))
            if m:
                return float(m.group(1))
    return None


def is_stockout(text: str) -> bool:
    """True if `text` (an error code, or a message naming one) is a GCP stock-out."""
    return bool(_STOCKOUT_TEXT.search(text)) or _norm(text.strip()) in _STOCKOUT


# Many returns: one return per SDK error class: a flat mapping table.
def translate(exc: BaseException, region: str = "") -> AdapterError:  # noqa: PLR0911
    """Map what a call to Google raised onto the typed errors of the contract. The one
    table, in order (the first row that matches wins):

    * a Google API error (`google.api_core.exceptions`) → by its status and reasons
      (`_api_error`: throttles `RateLimited`, 5xx/408/504 `CloudUnavailable` ...);
    * google.auth: no credentials, or a refusal it cannot refresh → `AuthFailed`;
    * google.auth: transport error, timeout, unreadable answer, or a token refresh refused
      for a reason that may pass (`retryable`) → `CloudUnavailable`;
    * google.auth: any other refused refresh → `AuthFailed`;
    * an answer that cannot be read, cut off or garbled (protobuf's `ParseError`,
      `JSONDecodeError`, `UnicodeDecodeError`, requests' `ChunkedEncodingError` /
      `ContentDecodingError`, urllib3's `ProtocolError` / `DecodeError`, `http.client`'s
      `IncompleteRead`) → `CloudUnavailable`;
    * no connection, or no answer in time (requests' `ConnectionError` / `Timeout`,
      urllib3's timeouts, `ConnectionError`, `TimeoutError`) → `CloudUnavailable`;
    * any other Google client-library error → `AdapterError` (permanent);
    * anything else is a bug, and re-raised.
    """
    g = _google()
    if isinstance(exc, AdapterError):
        return exc
    if isinstance(exc, g.core.GoogleAPICallError):
        return _api_error(exc, region)
    if isinstance(exc, g.auth_exc.InvalidOperation):  # e.g. anonymous credentials and a 401
        return AuthFailed(f"the request was refused and the credentials cannot be "
                          f"refreshed: {exc}", cloud="gcp", region=region)
    if isinstance(exc, g.auth_exc.DefaultCredentialsError):
        return AuthFailed("no usable Google credentials in google.auth.default()'s chain "
                          "(GOOGLE_APPLICATION_CREDENTIALS, gcloud application-default "
                          "login, the metadata server)", cloud="gcp", region=region)
    if isinstance(exc, g.auth_transient) or (isinstance(exc, g.auth_exc.RefreshError)
                                             and getattr(exc, "retryable", False)):
        return CloudUnavailable(f"Google's token endpoint failed: {type(exc).__name__}: "
                                f"{exc}", cloud="gcp", region=region)
    if isinstance(exc, g.auth_exc.RefreshError):
        return AuthFailed(f"Google credentials could not be refreshed: {exc}", cloud="gcp",
                          region=region)
    if isinstance(exc, g.parse_error | json.JSONDecodeError | UnicodeDecodeError |
                  g.requests_exc.ChunkedEncodingError | g.requests_exc.ContentDecodingError |
                  g.urllib3_exc.ProtocolError | g.urllib3_exc.DecodeError |
                  http.client.IncompleteRead):
        return CloudUnavailable(f"an answer that cannot be read (cut off or garbled): "
                                f"{type(exc).__name__}: {_short(exc)}", cloud="gcp",
                                region=region)
    if isinstance(exc, g.requests_exc.ConnectionError | g.requests_exc.Timeout |
                  g.urllib3_exc.TimeoutError | ConnectionError | TimeoutError):
        return CloudUnavailable(f"no answer: {type(exc).__name__}: {_short(exc)}",
                                cloud="gcp", region=region)
    if isinstance(exc, g.core.GoogleAPIError | g.auth_exc.GoogleAuthError):
        return AdapterError(f"{type(exc).__name__}: {exc}", cloud="gcp", region=region)
    raise exc


def _api_error(exc: Any, region: str) -> AdapterError:
    """A Google API error (an HTTP status, with the reasons of its error body)."""
    codes = _codes(exc)
    status = exc.code if isinstance(exc.code, int) else 0
    text = str(exc.message or "")
    msg = f"{status} {type(exc).__name__}: {_short(text)}".strip()
    core = _google().core
    if codes & _STOCKOUT or _STOCKOUT_TEXT.search(text):
        return CapacityUnavailable(msg, cloud="gcp", region=region)
    if status == 429 or codes & _THROTTLE or isinstance(exc, core.ResourceExhausted):
        return RateLimited(msg, retry_after=_retry_after(exc), cloud="gcp", region=region)
    if codes & _QUOTA or _QUOTA_TEXT.search(text):
        return QuotaExceeded(msg, cloud="gcp", region=region)
    if status in (401, 403) or isinstance(exc, core.Unauthenticated | core.PermissionDenied):
        return AuthFailed(msg, cloud="gcp", region=region)
    if status == 404 or isinstance(exc, core.NotFound):
        return InvalidConfig(msg, cloud="gcp", region=region)
    if status == 501:  # the endpoint does not implement the method: it will not heal
        return AdapterError(msg, cloud="gcp", region=region)
    if status >= 500 or status == 408 or isinstance(
            exc, core.ServerError | core.DeadlineExceeded):
        return CloudUnavailable(msg, cloud="gcp", region=region)
    return AdapterError(msg, cloud="gcp", region=region)


def _short(exc: object, most: int = 300) -> str:
    """An exception's text, at most `most` characters (a garbled body can be long)."""
    text = " ".join(str(exc).split())
    return text if len(text) <= most else f"{text[:most]}..."


def _region_of(location: str) -> str:
    """`us-central1-a` → `us-central1`; a region stays as it is."""
    return location.rsplit("-", 1)[0] if re.search(r"\d-[a-z]$", location) else location


class GcpSdk:
    """Blocking Google Cloud calls, translated and retried. Thread-safe."""

    def __init__(self, *, project: str | None = None, endpoint: str | None = None,
                 anonymous: bool = False, retry: RetryPolicy | None = None,
                 call_timeout: float = 10.0,
                 on_call: Callable[[str, str], None] | None = None) -> None:
        self._g = _google()
        self.endpoint = endpoint.rstrip("/") if endpoint else None
        self._anonymous = anonymous
        self._project = project
        self._credentials: Any = None
        self._auth_failed: tuple[float, AdapterError] | None = None
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.retry = retry or RetryPolicy()
        self._timeout = call_timeout  # one call's connect + read limit, in seconds
        self._on_call = on_call

    # --- credentials and clients ---------------------------------------------------

    def _auth(self) -> tuple[Any, str]:
        """(credentials, project), resolved once; call with the lock held."""
        if self._credentials is None:
            if self._anonymous:
                creds, found = self._g.anonymous(), None
            else:
                # Failing to find credentials may take seconds (the metadata server's
                # probe): say the same for a while rather than ask again on every call.
                failed = self._auth_failed
                if failed is not None and time.monotonic() - failed[0] < AUTH_RETRY_SECONDS:
                    err = failed[1]
                    raise type(err)(str(err), cloud=err.cloud, region=err.region)
                try:
                    creds, found = self._g.auth.default(scopes=list(SCOPES))
                except Exception as exc:  # translated; anything unknown re-raised
                    err = translate(exc)
                    self._auth_failed = (time.monotonic(), err)
                    raise err from exc
            self._project = self._project or found
            self._credentials = creds
        if not self._project:
            raise InvalidConfig("clouds.gcp.project is not set and google.auth.default() "
                                "names no project: set clouds.gcp.project", cloud="gcp")
        return self._credentials, self._project

    @property
    def project(self) -> str:
        with self._lock:
            return self._auth()[1]

    def client(self, kind: str) -> Any:
        """The client for `kind` (regions, projects, machine_types, accelerator_types,
        reservations, advice, catalog), built on first use."""
        with self._lock:
            if self._closed:
                raise AdapterError("the GCP adapter is closed", cloud="gcp")
            if kind not in self._clients:
                creds, _ = self._auth()
                c, b = self._g.compute, self._g.billing
                cls = {"regions": c.RegionsClient, "projects": c.ProjectsClient,
                       "machine_types": c.MachineTypesClient,
                       "accelerator_types": c.AcceleratorTypesClient,
                       "reservations": c.ReservationsClient, "advice": c.AdviceClient,
                       "catalog": b.CloudCatalogClient}[kind]
                options = {"api_endpoint": self.endpoint} if self.endpoint else None
                self._clients[kind] = cls(credentials=creds, transport="rest",
                                          client_options=options)
            return self._clients[kind]

    # --- calling ---------------------------------------------------------------------

    def _call(self, op: str, where: str, fn: Callable[[], T]) -> T:
        """Run `fn` with translation and retries of RateLimited / CloudUnavailable; after
        `stop()`, start nothing (no next page, no retry)."""
        region = _region_of(where) if where != "global" else ""

        def attempt() -> T:
            if self._closed:
                raise AdapterError("the GCP adapter is closed", cloud="gcp", region=region)
            return fn()

        on_call = self._on_call
        return self.retry.call(attempt, lambda exc: translate(exc, region),
                               None if on_call is None else lambda: on_call(op, where))

    def _pages(self, op: str, where: str, fetch: Callable[[str], Any]) -> Iterator[Any]:
        """Every page of a list call: `fetch(page_token)` returns the pager of one page
        (its attributes are that page's response); each page is retried on its own."""
        token = ""
        for _ in range(MAX_PAGES):
            page = self._call(op, where, lambda t=token: fetch(t))  # type: ignore[misc]
            yield page
            token = str(page.next_page_token or "")
            if not token:
                return
        raise CloudUnavailable(f"{op}: more than {MAX_PAGES} pages", cloud="gcp")

    # --- Compute Engine ------------------------------------------------------------------

    def region(self, region: str) -> RegionInfo:
        """The region's zones and quotas (`RegionsClient.get`)."""
        client = self.client("regions")
        project = self.project
        r = self._call("regions.get", region, lambda: client.get(
            project=project, region=region, retry=None, timeout=self._timeout))
        zones = tuple(sorted(str(z).rsplit("/", 1)[-1] for z in r.zones))
        return RegionInfo(zones, _quotas(r.quotas))

    def project_quotas(self) -> dict[str, Quota]:
        """The project's quotas (`ProjectsClient.get`), `GPUS_ALL_REGIONS` among them."""
        client = self.client("projects")
        project = self.project
        p = self._call("projects.get", "global", lambda: client.get(
            project=project, retry=None, timeout=self._timeout))
        return _quotas(p.quotas)

    def machine_types(self, zone: str, name_filter: str) -> list[MachineType]:
        """The zone's machine types whose name matches `name_filter` (a Compute Engine
        list filter), with their built-in accelerators."""
        client = self.client("machine_types")
        project = self.project
        out: list[MachineType] = []
        for page in self._pages("machineTypes.list", zone, lambda token: client.list(
                request={"project": project, "zone": zone, "filter": name_filter,
                         "max_results": 500, "page_token": token},
                retry=None, timeout=self._timeout)):
            for m in page.items:
                out.append(MachineType(
                    name=m.name, vcpus=int(m.guest_cpus), memory_mb=int(m.memory_mb),
                    accelerators=tuple((a.guest_accelerator_type, int(a.guest_accelerator_count))
                                       for a in m.accelerators),
                    deprecated=str(m.deprecated.state)))
        return out

    def accelerator_types(self, zone: str) -> list[AcceleratorType]:
        """The zone's accelerator (GPU) types and how many fit one instance."""
        client = self.client("accelerator_types")
        project = self.project
        out: list[AcceleratorType] = []
        for page in self._pages("acceleratorTypes.list", zone, lambda token: client.list(
                request={"project": project, "zone": zone, "max_results": 500,
                         "page_token": token},
                retry=None, timeout=self._timeout)):
            out.extend(AcceleratorType(a.name, int(a.maximum_cards_per_instance),
                                       str(a.deprecated.state))
                       for a in page.items)
        return out

    def capacity_advice(self, region: str, zone: str, body: Mapping[str, Any]
                        ) -> dict[str, Any]:
        """Compute Engine's capacity advice (`regions.advice.capacity`) for the request
        `body` (its REST JSON, `advice.request`), asked about `zone`; the answer in its
        REST JSON shape (`CapacityAdviceResponse`)."""
        client = self.client("advice")
        project = self.project
        compute = self._g.compute
        resource = compute.CapacityAdviceRequest.from_json(json.dumps(body))
        answer = self._call("advice.capacity", zone, lambda: client.capacity(
            project=project, region=region, capacity_advice_request_resource=resource,
            retry=None, timeout=self._timeout))
        return compute.CapacityAdviceResponse.to_dict(answer,
                                                      preserving_proto_field_name=False)

    def reservations(self, region: str) -> list[dict[str, Any]]:
        """The project's reservations in the region's zones (`reservations.aggregatedList`,
        paged: one call for every zone), each in its REST JSON shape (int64 counts as
        strings, fields the answer lacks left out). A zone of the region that the answer
        lists as unreachable makes it a `CloudUnavailable`: a reservation missing from it
        must not read as gone."""
        client = self.client("reservations")
        project = self.project
        out: list[dict[str, Any]] = []
        reservation = self._g.compute.Reservation
        for page in self._pages("reservations.aggregatedList", region, lambda token:
                                client.aggregated_list(
                                    request={"project": project, "max_results": 500,
                                             "page_token": token},
                                    retry=None, timeout=self._timeout)):
            unreachable = [u for u in page.unreachables if _in_region(u, region)]
            if unreachable:
                raise CloudUnavailable(f"reservations.aggregatedList: {', '.join(unreachable)}"
                                       " unreachable", cloud="gcp", region=region)
            for scope, scoped in page.items.items():
                if _in_region(scope, region):
                    out.extend(reservation.to_dict(r, preserving_proto_field_name=False)
                               for r in scoped.reservations)
        return out

    # --- Cloud Billing Catalog ---------------------------------------------------------

    def skus(self, service: str = COMPUTE_SERVICE) -> list[dict[str, Any]]:
        """The service's SKUs of resource family `Compute` and its local SSD SKUs (family
        `Storage`, group `LocalSSD`), in USD, in their REST JSON shape (the fields
        `pricing.parse_sku` reads)."""
        client = self.client("catalog")
        out: list[dict[str, Any]] = []
        for page in self._pages("skus.list", "global", lambda token: client.list_skus(
                request={"parent": f"services/{service}", "currency_code": "USD",
                         "page_size": 5000, "page_token": token},
                retry=None, timeout=self._timeout)):
            out.extend(_sku_json(s) for s in page.skus
                       if s.category.resource_family == "Compute"
                       or (s.category.resource_family, s.category.resource_group)
                       == ("Storage", "LocalSSD"))
        return out

    def stop(self) -> None:
        """Start no more calls (no next page, no retry); calls on the wire finish."""
        self._closed = True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for client in self._clients.values():
                client.transport.close()
            self._clients.clear()


def _in_region(scope: str, region: str) -> bool:
    """Whether an aggregated list's scope (`zones/us-central1-a`, a zone URL) is a zone of
    `region`."""
    return _region_of(str(scope).rstrip("/").rsplit("/", 1)[-1]) == region


def _quotas(quotas: Any) -> dict[str, Quota]:
    return {str(q.metric): Quota(float(q.limit), float(q.usage)) for q in quotas}


def _sku_json(s: Any) -> dict[str, Any]:
    """A `billing_v1.Sku` as the REST JSON it came from, the fields we read only (a full
    `MessageToDict` of ~10,000 SKUs costs seconds of CPU)."""
    c = s.category
    infos = []
    for info in list(s.pricing_info)[:1]:
        e = info.pricing_expression
        infos.append({"pricingExpression": {
            "usageUnit": e.usage_unit,
            "tieredRates": [{"startUsageAmount": r.start_usage_amount,
                             "unitPrice": {"currencyCode": r.unit_price.currency_code,
                                           "units": str(r.unit_price.units),
                                           "nanos": int(r.unit_price.nanos)}}
                            for r in e.tiered_rates]}})
    return {"skuId": s.sku_id, "description": s.description,
            "category": {"resourceFamily": c.resource_family,
                         "resourceGroup": c.resource_group, "usageType": c.usage_type},
            "serviceRegions": list(s.service_regions), "pricingInfo": infos}
