"""A fake Azure on one local URL, for driving the real azure-mgmt-compute (and the Azure
adapter's aiohttp price client) against it.

The Azure adapter's config has ONE base URL (``clouds.azure.endpoint``) that replaces every
Azure host the adapter calls: Azure Resource Manager (``management.azure.com``, also the
host of Resource Graph) and the Retail Prices API (``prices.azure.com``). So this fake is a
single aiohttp server (its own event loop, in a background thread: usable from the
blocking SDK and from async tests alike) that routes by path, in the services' real JSON
shapes:

* ``GET /subscriptions/{sub}/providers/Microsoft.Compute/skus?$filter=location eq 'X'``
  — Resource SKUs: ``value`` [{``resourceType``, ``name``, ``tier``, ``size``,
  ``family``, ``locations``, ``locationInfo`` [{``location``, ``zones``,
  ``zoneDetails``}], ``capabilities`` [{``name``, ``value``}], ``restrictions``
  [{``type``, ``values``, ``restrictionInfo`` {``locations``, ``zones``},
  ``reasonCode``}]}], paged with ``nextLink`` (``$skiptoken``).
* ``GET /subscriptions/{sub}/providers/Microsoft.Compute/locations/{loc}/usages`` —
  ``value`` [{``unit``, ``currentValue``, ``limit``, ``name`` {``value``,
  ``localizedValue``}}], paged with ``nextLink``.
* ``GET /api/retail/prices?$filter=...`` — the Retail Prices API: ``BillingCurrency``,
  ``CustomerEntityId``, ``CustomerEntityType``, ``Items``, ``NextPageLink`` (``$skip``),
  ``Count``. The ``$filter`` is parsed (``field eq 'v'``, ``contains(field, 'v')``,
  ``startswith(field, 'v')`` joined by ``and``; ``priceType`` is the item's ``type``;
  values compare case-sensitively, as in the 2023-01-01-preview API); anything else is a
  400.
* ``POST /providers/Microsoft.ResourceGraph/resources`` — Resource Graph: ``totalRecords``,
  ``count``, ``data`` (``objectArray``), ``facets``, ``resultTruncated``, ``$skipToken``.
  The fake does not run KQL: it answers the ``SpotResources``
  ``microsoft.compute/skuspotevictionrate/location`` query with rows projected as
  ``skuName``, ``location``, ``evictionRate``, narrowed by a ``location =~ 'X'`` clause and
  a ``startswith 'prefix'`` on the SKU name if the query has them. Other queries: 400.

* Capacity reservations (none unless a test adds them: ``add_capacity_reservation_group``,
  ``add_capacity_reservation``, ``allocate``, ``remove_capacity_reservation_group``), in
  the shapes of the Capacity Reservation Groups and Capacity Reservations REST references
  (https://learn.microsoft.com/en-us/rest/api/compute/capacity-reservation-groups,
  .../capacity-reservations):
  ``GET /subscriptions/{sub}/providers/Microsoft.Compute/capacityReservationGroups``
  (list by subscription, every region) and the same under
  ``/resourceGroups/{rg}`` — ``value`` [{``id``, ``name``, ``type``, ``location``,
  ``zones``, ``properties`` {``capacityReservations`` [{``id``}],
  ``virtualMachinesAssociated`` [{``id``}], ``reservationType`` if set}}], paged with
  ``nextLink``; ``GET .../capacityReservationGroups/{name}`` with ``$expand=instanceView``
  adds ``properties.instanceView.capacityReservations`` [{``name``, ``utilizationInfo``
  {``currentCapacity``, ``virtualMachinesAllocated`` [{``id``}]}, ``statuses``}];
  ``GET .../capacityReservationGroups/{name}/capacityReservations`` — ``value`` [{``id``,
  ``name``, ``type``, ``location``, ``sku`` {``name``, ``capacity``}, ``zones``,
  ``properties`` {``reservationId``, ``platformFaultDomainCount``,
  ``provisioningState``, ``provisioningTime``, ``timeCreated``,
  ``virtualMachinesAssociated``}}]; ``GET .../capacityReservations/{name}`` with
  ``$expand=instanceView`` adds the reservation's own ``properties.instanceView``. A
  group or reservation that does not exist is ``404 ResourceNotFound``. ``raw``
  overrides a reservation's answered fields by dotted path (``sku.capacity``; ``None``
  leaves one out); ``view=False`` leaves it out of the instance views.

Errors use ARM's shape ``{"error": {"code", "message"}}`` with the status given; an
unknown subscription is ``404 SubscriptionNotFound``.

Random faults (``chaos = Chaos(...)``, see ``fake_server``) answer as each service does:

* a throttle — Resource SKUs and usages (the Compute resource provider behind ARM): half
  of them ARM's own (429, ``Retry-After: 1``, ``{"error": {"code": "TooManyRequests"}}``,
  ``x-ms-ratelimit-remaining-subscription-reads: 0``), half the resource provider's as
  Azure's "Troubleshooting API throttling errors" page shows it (429, ``Retry-After: 1``,
  a bare ``{"code": "OperationNotAllowed", "details": [{"code": "TooManyRequests",
  "target": "HighCostGet3Min"}]}`` — the code that on another status means a quota);
  Resource Graph: 429 ``RateLimiting`` with ``x-ms-user-quota-remaining: 0`` and
  ``x-ms-user-quota-resets-after: 00:00:01`` and no ``Retry-After``, as its throttling
  guidance describes; the Retail Prices API: 429, ``Retry-After: 1`` and a text body
  (Microsoft documents no error shape for that API, so the fake gives a client nothing
  but the status and the header to go by);
* a 5xx — ARM's ``{"error": {"code": "InternalServerError" | "ServiceUnavailable"}}``
  for ARM and Resource Graph, a text body for the Retail Prices API.

``chaos_repeats = N`` spares a request from random faults once the same request (method
and URL) has been sent N times: a seeded draw over concurrent requests is not
reproducible, and a test that must not fail by bad luck (12 attempts at 50 % faults
fail one call in 4,096) sets it below the client's attempts.

Data. VM sizes, regions and prices come from the price snapshot
(``tests/fixtures/prices/gpu-prices-azure.csv``: 8 US regions, prices per region). The
snapshot has no vCPU family names, zones, quotas or eviction rates, so the fake adds them:
family names as ARM spells them (``SIZES`` below), zones ``1``–``3`` in the regions that
have availability zones (westus and northcentralus have none; ND sizes are in two of the
three zones, chosen per region by a hash), default quotas (``DEFAULT_FAMILY_LIMIT`` vCPUs
per GPU family, ``cores`` and ``lowPriorityCores``), and an eviction-rate band per spot
size by hash (some sizes have no eviction data at all). Sizes the snapshot lacks
(``EXTRA_SIZES``: H200, MI300X, fractional A10, a future GPU) carry PLAUSIBLE prices,
not catalog ones. The snapshot lists ND96isr_H100_v5 with 12 GPUs; the fake serves the
real machine's 8. Windows, Low Priority, DevTest and reservation prices are derived from
the Linux ones, so that a client that does not filter them out gets visibly wrong answers.

Knobs: ``calls`` (a Counter of ``(api, region)``, api ∈ ``skus``, ``usages``, ``prices``,
``graph``, ``reservation_groups`` (a list; region ``""`` by subscription),
``reservation_group`` (one group), ``reservations`` (a group's list),
``reservation`` (one)), ``authorized`` (how many calls carried an ``Authorization`` header),
``latency = (lo, hi)`` seconds per call, ``page_size`` per api, ``link_base`` (put
paging links on another host, e.g. ``https://prices.azure.com:443``, as a proxy in front
of the real services would pass them through), ``fail(...)``,
``restrict(...)``, ``set_usage(...)``, ``set_price(...)``, ``set_eviction_rate(...)``.

Usage::

    from fake_azure import fake_azure_fixture  # noqa: F401   (the ``fake_azure`` fixture)

    def test_x(fake_azure): ...   # fake_azure.url, fake_azure.subscription_id

or ``with FakeAzure() as fake: ...``.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import json
import random
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import pytest
from aiohttp import web
from fake_server import FakeServer

# the price snapshot vendored with the tests (provenance: tests/fixtures/prices/README.md)
DEFAULT_PRICES_CSV = Path(__file__).resolve().parents[1] / "fixtures/prices/gpu-prices-azure.csv"
SUBSCRIPTION_ID = "6f1c2d3e-0000-4000-8000-00000000cafe"
SKUS_API = "2021-07-01"
RETAIL_HOST_PATH = "/api/retail/prices"
GRAPH_PATH = "/providers/Microsoft.ResourceGraph/resources"
EVICTION_TYPE = "microsoft.compute/skuspotevictionrate/location"
BANDS = ("0-5", "5-10", "10-15", "15-20", "20+")
ZONAL_REGIONS = frozenset({"centralus", "eastus", "eastus2", "southcentralus", "westus2",
                           "westus3"})
DEFAULT_FAMILY_LIMIT = 100  # vCPUs
DEFAULT_CORES = (20, 350)  # (currentValue, limit) of "Total Regional vCPUs"
DEFAULT_LOW_PRIORITY = (0, 100)  # of "Total Regional Low-priority vCPUs"
LOCATION_NAMES = {
    "centralus": "US Central", "eastus": "US East", "eastus2": "US East 2",
    "northcentralus": "US North Central", "southcentralus": "US South Central",
    "westus": "US West", "westus2": "US West 2", "westus3": "US West 3",
}
_STATUS_CODES = {400: "BadRequest", 401: "InvalidAuthenticationToken",
                 403: "AuthorizationFailed", 404: "NotFound", 409: "Conflict",
                 429: "TooManyRequests", 500: "InternalServerError", 502: "BadGateway",
                 503: "ServiceUnavailable", 504: "GatewayTimeout"}


@dataclass(frozen=True, slots=True)
class Size:
    """A VM size as ARM describes it. `gpus` is the `GPUs` capability (None: absent)."""

    name: str
    family: str
    vcpus: int
    memory_gb: float
    gpus: int | None
    low_priority: bool = True


SIZES: tuple[Size, ...] = (
    # K80 (retired in 2023, still in the snapshot)
    Size("Standard_NC6", "standardNCFamily", 6, 56, 1),
    Size("Standard_NC12", "standardNCFamily", 12, 112, 2),
    Size("Standard_NC24", "standardNCFamily", 24, 224, 4),
    Size("Standard_NC24r", "standardNCFamily", 24, 224, 4),
    Size("Standard_NC6_Promo", "standardNCPromoFamily", 6, 56, 1, low_priority=False),
    Size("Standard_NC12_Promo", "standardNCPromoFamily", 12, 112, 2, low_priority=False),
    Size("Standard_NC24_Promo", "standardNCPromoFamily", 24, 224, 4, low_priority=False),
    Size("Standard_NC24r_Promo", "standardNCPromoFamily", 24, 224, 4, low_priority=False),
    # V100
    Size("Standard_NC6s_v3", "standardNCSv3Family", 6, 112, 1),
    Size("Standard_NC12s_v3", "standardNCSv3Family", 12, 224, 2),
    Size("Standard_NC24s_v3", "standardNCSv3Family", 24, 448, 4),
    Size("Standard_NC24rs_v3", "standardNCSv3Family", 24, 448, 4),
    Size("Standard_ND40rs_v2", "standardNDSv2Family", 40, 672, 8),
    # T4
    Size("Standard_NC4as_T4_v3", "standardNCASv3_T4Family", 4, 28, 1),
    Size("Standard_NC8as_T4_v3", "standardNCASv3_T4Family", 8, 56, 1),
    Size("Standard_NC16as_T4_v3", "standardNCASv3_T4Family", 16, 110, 1),
    Size("Standard_NC64as_T4_v3", "standardNCASv3_T4Family", 64, 440, 4),
    # A100
    Size("Standard_NC24ads_A100_v4", "StandardNCADSA100v4Family", 24, 220, 1),
    Size("Standard_NC48ads_A100_v4", "StandardNCADSA100v4Family", 48, 440, 2),
    Size("Standard_NC96ads_A100_v4", "StandardNCADSA100v4Family", 96, 880, 4),
    Size("Standard_ND96asr_v4", "standardNDASv4_A100Family", 96, 900, 8),
    Size("Standard_ND96amsr_A100_v4", "StandardNDAMSv4_A100Family", 96, 1900, 8),
    # H100 (NC: H100 NVL 94 GB; ND: H100 SXM 80 GB); the snapshot says 12 GPUs for ND
    Size("Standard_NC40ads_H100_v5", "standardNCadsH100v5Family", 40, 320, 1),
    Size("Standard_NC80adis_H100_v5", "standardNCadsH100v5Family", 80, 640, 2),
    Size("Standard_ND96isr_H100_v5", "standardNDSH100v5Family", 96, 1900, 8),
    # M60, Radeon MI25 (fractional below NV32as_v4), A10
    Size("Standard_NV6", "standardNVFamily", 6, 56, 1),
    Size("Standard_NV12", "standardNVFamily", 12, 112, 2),
    Size("Standard_NV24", "standardNVFamily", 24, 224, 4),
    Size("Standard_NV6_Promo", "standardNVPromoFamily", 6, 56, 1, low_priority=False),
    Size("Standard_NV12_Promo", "standardNVPromoFamily", 12, 112, 2, low_priority=False),
    Size("Standard_NV24_Promo", "standardNVPromoFamily", 24, 224, 4, low_priority=False),
    Size("Standard_NV12s_v3", "standardNVSv3Family", 12, 112, 1),
    Size("Standard_NV24s_v3", "standardNVSv3Family", 24, 224, 2),
    Size("Standard_NV48s_v3", "standardNVSv3Family", 48, 448, 4),
    Size("Standard_NV4as_v4", "standardNVASv4Family", 4, 14, None),
    Size("Standard_NV8as_v4", "standardNVASv4Family", 8, 28, None),
    Size("Standard_NV16as_v4", "standardNVASv4Family", 16, 56, None),
    Size("Standard_NV32as_v4", "standardNVASv4Family", 32, 112, 1),
    Size("Standard_NV36ads_A10_v5", "StandardNVADSA10v5Family", 36, 440, 1),
    Size("Standard_NV36adms_A10_v5", "StandardNVADSA10v5Family", 36, 880, 1),
    Size("Standard_NV72ads_A10_v5", "StandardNVADSA10v5Family", 72, 880, 2),
    # Not in the snapshot (EXTRA_SIZES has their regions and plausible prices). The
    # fractional A10 sizes are served with GPUs=1 (an assumption) to show that the
    # adapter trusts the size name's fraction over that.
    Size("Standard_NV6ads_A10_v5", "StandardNVADSA10v5Family", 6, 55, 1),
    Size("Standard_NV12ads_A10_v5", "StandardNVADSA10v5Family", 12, 110, 1),
    Size("Standard_ND96isr_H200_v5", "standardNDSH200v5Family", 96, 1850, 8),
    Size("Standard_ND96isr_MI300X_v5", "standardNDISRMI300Xv5Family", 96, 1850, 8),
    Size("Standard_NC128lds_xl_RTXPRO6000BSE_v6", "standardNCLDSxlRTXPRO6000BSEv6Family",
         128, 1792, 2),
    # Not GPU sizes: every region has them, the adapter must leave them out
    Size("Standard_D4s_v5", "standardDSv5Family", 4, 16, None),
    Size("Standard_E8s_v5", "standardESv5Family", 8, 64, None),
)
SIZE_BY_NAME = {s.name: s for s in SIZES}
NON_GPU = ("Standard_D4s_v5", "Standard_E8s_v5")
# size -> (regions, on-demand USD/h, spot USD/h): PLAUSIBLE prices, not from a catalog
EXTRA_SIZES: dict[str, tuple[tuple[str, ...], float, float | None]] = {
    "Standard_NV6ads_A10_v5": (("eastus", "southcentralus", "westus2", "westus3"), 0.454, 0.0908),
    "Standard_NV12ads_A10_v5": (("eastus", "southcentralus", "westus2", "westus3"), 0.908, 0.1816),
    "Standard_ND96isr_H200_v5": (("eastus2", "westus3"), 110.24, 33.07),
    "Standard_ND96isr_MI300X_v5": (("eastus",), 67.2, 20.16),
    "Standard_NC128lds_xl_RTXPRO6000BSE_v6": (("eastus",), 9.6, 2.88),
    "Standard_D4s_v5": (tuple(LOCATION_NAMES), 0.192, 0.0384),
    "Standard_E8s_v5": (tuple(LOCATION_NAMES), 0.504, 0.1008),
}


APIS = ("skus", "usages", "prices", "graph", "reservation_groups", "reservation_group",
        "reservations", "reservation")
_CRG = r"/providers/Microsoft\.Compute/capacityReservationGroups"


def _set_path(doc: dict[str, Any], overrides: dict[str, Any]) -> None:
    """Override fields of `doc` by dotted path; a None value removes the field."""
    for path, value in overrides.items():
        *parents, leaf = path.split(".")
        node = doc
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value


class FakeAzureError(Exception):
    """An error the fake answers in ARM's error shape."""

    def __init__(self, status: int, code: str, message: str,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.headers = headers or {}


@dataclass
class _Fault:
    api: str
    region: str | None
    status: int
    code: str
    message: str
    retry_after: str | None
    remaining: int | None  # None = until clear_faults()


def _h(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256("|".join(map(str, parts)).encode()).digest()[:8], "big")


def _guid(*parts: object) -> str:
    d = hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()
    return f"{d[:8]}-{d[8:12]}-{d[12:16]}-{d[16:20]}-{d[20:32]}"


def _token(offset: int) -> str:
    return base64.urlsafe_b64encode(json.dumps({"o": offset}).encode()).decode().rstrip("=")


def _offset(token: str | None) -> int:
    if not token:
        return 0
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        offset = int(json.loads(raw)["o"])
        if offset < 0:
            raise ValueError(offset)
        return offset
    except (ValueError, KeyError, TypeError) as exc:
        raise FakeAzureError(400, "InvalidSkipToken",
                             f"The skip token '{token}' is invalid.") from exc


def meter_name(size: str) -> str:
    """`Standard_NC24ads_A100_v4` -> `NC24ads A100 v4` (the Retail Prices meter name)."""
    return size.removeprefix("Standard_").replace("_", " ")


def product_name(size: str, windows: bool = False) -> str:
    """`Standard_NC24ads_A100_v4` -> `Virtual Machines NCadsA100v4 Series`."""
    series = re.sub(r"^([A-Za-z]+)\d+", r"\1", size.removeprefix("Standard_"))
    series = series.replace("_Promo", "").replace("_", "")
    return f"Virtual Machines {series} Series" + (" Windows" if windows else "")


_TERM = re.compile(
    r"^(?:(?P<field>\w+)\s+eq\s+'(?P<value>[^']*)'"
    r"|(?P<fn>contains|startswith)\(\s*(?P<ffield>\w+)\s*,\s*'(?P<fvalue>[^']*)'\s*\))$",
    re.IGNORECASE)


def _retail_filter(expr: str) -> Callable[[dict[str, Any]], bool]:
    """The fake's subset of the Retail Prices API's OData `$filter`."""
    terms = [t.strip() for t in re.split(r"\s+and\s+(?=(?:[^']*'[^']*')*[^']*$)", expr.strip(),
                                         flags=re.IGNORECASE) if t.strip()]
    tests: list[Callable[[dict[str, Any]], bool]] = []
    for term in terms:
        m = _TERM.match(term)
        if m is None:
            raise FakeAzureError(400, "BadRequest", f"Invalid OData parameters supplied: {term}")
        field = (m.group("field") or m.group("ffield")).lower()
        field = "type" if field == "pricetype" else field
        value = m.group("value") if m.group("field") else m.group("fvalue")
        fn = (m.group("fn") or "eq").lower()

        def test(item: dict[str, Any], field: str = field, value: str = value,
                 fn: str = fn) -> bool:
            have = next((str(v) for k, v in item.items() if k.lower() == field), None)
            if have is None:
                return False
            if fn == "eq":
                return have == value
            return value in have if fn == "contains" else have.startswith(value)

        tests.append(test)
    return lambda item: all(t(item) for t in tests)


class FakeAzure(FakeServer[tuple[str, str]]):
    """ARM (Resource SKUs, usages, Resource Graph) and the Retail Prices API behind one
    local URL (see the module doc)."""

    thread_name = "fake-azure"

    def __init__(self, *, prices_csv: Path = DEFAULT_PRICES_CSV, seed: int = 7,
                 subscription_id: str = SUBSCRIPTION_ID) -> None:
        super().__init__()
        self.seed = seed
        self.subscription_id = subscription_id
        self.authorized = 0
        self.page_size = {"skus": 10, "usages": 8, "prices": 50, "graph": 20,
                          "reservation_groups": 2, "reservations": 2}
        # group id (lower case) -> the group and its reservations (see the knobs)
        self._groups: dict[str, dict[str, Any]] = {}
        self.link_base: str | None = None  # paging links on this host (None: the fake's)
        self.chaos_repeats: int | None = None  # see the module doc
        self._chaos_seen: Counter[tuple[str, str]] = Counter()
        self._faults: list[_Fault] = []
        # (region, size) -> [on-demand, spot] USD per hour (Linux)
        self._prices: dict[tuple[str, str], list[float | None]] = {}
        self._restrictions: dict[tuple[str, str], list[dict[str, Any]]] = {}
        self._usage: dict[tuple[str, str], tuple[int, int]] = {}
        self._eviction: dict[tuple[str, str], str | None] = {}
        self._load(prices_csv)

    # ------------------------------------------------------------------ data
    def _load(self, path: Path) -> None:
        with path.open(newline="") as fh:
            for row in csv.DictReader(fh):
                if row["instance_type"] not in SIZE_BY_NAME:
                    continue
                spot = float(row["spot_usd_per_hour"]) if row["spot_usd_per_hour"] else None
                od = float(row["on_demand_usd_per_hour"]) if row["on_demand_usd_per_hour"] \
                    else None
                self._prices[(row["region"], row["instance_type"])] = [od, spot]
        for size, (regions, od, spot) in EXTRA_SIZES.items():
            for region in regions:
                self._prices[(region, size)] = [od, spot]

    @property
    def regions(self) -> list[str]:
        return sorted({r for r, _ in self._prices})

    def sizes_in(self, region: str, *, gpu_only: bool = True) -> list[str]:
        """The VM sizes the region offers (GPU sizes only unless told)."""
        return sorted(s for r, s in self._prices
                      if r == region and (not gpu_only or s not in NON_GPU))

    def zones(self, region: str, size: str) -> list[str]:
        """The zones ARM lists for the size in the region (before restrictions)."""
        if region not in ZONAL_REGIONS:
            return []
        zones = ["1", "2", "3"]
        if size.startswith("Standard_ND"):
            zones.pop(_h(self.seed, region, size) % 3)
        return zones

    def on_demand_price(self, region: str, size: str) -> float | None:
        return self._prices.get((region, size), [None, None])[0]

    def spot_price(self, region: str, size: str) -> float | None:
        return self._prices.get((region, size), [None, None])[1]

    def set_price(self, region: str, size: str, *, on_demand: float | None = None,
                  spot: float | None = None) -> None:
        """Change the Linux prices of a size the region offers."""
        with self._lock:
            entry = self._prices[(region, size)]
            if on_demand is not None:
                entry[0] = on_demand
            if spot is not None:
                entry[1] = spot

    def restrict(self, region: str, size: str, *, zones: list[str] | None = None,
                 reason: str = "NotAvailableForSubscription") -> None:
        """A restriction on the SKU for this subscription: the whole location
        (`zones=None`, `type: Location`) or those zones (`type: Zone`)."""
        if zones is None:
            r = {"type": "Location", "values": [region],
                 "restrictionInfo": {"locations": [region]}, "reasonCode": reason}
        else:
            r = {"type": "Zone", "values": [region],
                 "restrictionInfo": {"locations": [region], "zones": list(zones)},
                 "reasonCode": reason}
        with self._lock:
            self._restrictions.setdefault((region, size), []).append(r)

    def set_usage(self, region: str, name: str, *, current: int | None = None,
                  limit: int | None = None) -> None:
        """Set a usage entry (`standardNCADSA100v4Family`, `cores`, `lowPriorityCores`)."""
        with self._lock:
            cur, lim = self.usage(region, name)
            self._usage[(region, name.lower())] = (cur if current is None else current,
                                                   lim if limit is None else limit)

    def usage(self, region: str, name: str) -> tuple[int, int]:
        """(currentValue, limit) of a usage entry."""
        with self._lock:
            if (region, name.lower()) in self._usage:
                return self._usage[(region, name.lower())]
        if name.lower() == "cores":
            return DEFAULT_CORES
        if name.lower() == "lowprioritycores":
            return DEFAULT_LOW_PRIORITY
        return (0, DEFAULT_FAMILY_LIMIT)

    def eviction_rate(self, region: str, size: str) -> str | None:
        """The eviction-rate band Resource Graph reports (None: no row)."""
        with self._lock:
            if (region, size) in self._eviction:
                return self._eviction[(region, size)]
        spec = SIZE_BY_NAME[size]
        if not spec.low_priority or _h(self.seed, "noeviction", region, size) % 6 == 0:
            return None
        return BANDS[_h(self.seed, "eviction", region, size) % len(BANDS)]

    def set_eviction_rate(self, region: str, size: str, band: str | None) -> None:
        with self._lock:
            self._eviction[(region, size)] = band

    # ------------------------------------------------- capacity reservations
    def group_id(self, resource_group: str, name: str) -> str:
        return (f"/subscriptions/{self.subscription_id}/resourceGroups/{resource_group}"
                f"/providers/Microsoft.Compute/capacityReservationGroups/{name}")

    def add_capacity_reservation_group(self, region: str, name: str, *,
                                       resource_group: str = "gpu-capacity",
                                       zones: list[str] | None = None,
                                       reservation_type: str | None = None) -> str:
        """A capacity reservation group; returns its resource id."""
        gid = self.group_id(resource_group, name)
        with self._lock:
            self._groups[gid.lower()] = {
                "id": gid, "rg": resource_group, "name": name, "location": region,
                "zones": list(zones or []), "type": reservation_type, "reservations": {}}
        return gid

    def add_capacity_reservation(self, group_id: str, name: str, size: str, capacity: int,
                                 *, zone: str | None = None, allocated: int = 0,
                                 provisioning_state: str = "Succeeded",
                                 current_capacity: int | None = None,
                                 reservation_state: str | None = None,
                                 raw: dict[str, Any] | None = None,
                                 view: bool = True) -> str:
        """A capacity reservation of `capacity` VMs of `size` in the group, `allocated`
        of them allocated; returns its resource id."""
        with self._lock:
            group = self._groups[group_id.lower()]
            group["reservations"][name] = {
                "size": size, "capacity": capacity, "zone": zone, "allocated": allocated,
                "state": provisioning_state, "current": current_capacity,
                "reservation_state": reservation_state, "raw": dict(raw or {}),
                "view": view}
        return f"{group['id']}/capacityReservations/{name}"

    def allocate(self, group_id: str, name: str, vms: int) -> None:
        """Say that `vms` VMs are allocated in the reservation."""
        with self._lock:
            self._groups[group_id.lower()]["reservations"][name]["allocated"] = vms

    def remove_capacity_reservation_group(self, group_id: str) -> None:
        with self._lock:
            del self._groups[group_id.lower()]

    # ----------------------------------------------------------- test knobs
    def fail(self, api: str, *, status: int = 429, code: str | None = None,
             times: int | None = 1, retry_after: float | str | None = None,
             region: str | None = None, message: str = "injected by the fake") -> None:
        """Make the next `times` calls of `api` (`skus`, `usages`, `prices`, `graph`;
        `times=None`: all, until `clear_faults()`) fail with `status` and ARM error `code`
        (default by status: 429 TooManyRequests, 500 InternalServerError ...), with a
        `Retry-After` header if given."""
        if api not in APIS:
            raise ValueError(f"unknown api {api!r}; one of {sorted(APIS)}")
        with self._lock:
            self._faults.append(_Fault(api, region, status, code or _STATUS_CODES.get(status,
                                       "Error"), message,
                                       None if retry_after is None else str(retry_after),
                                       times))

    def reset_calls(self) -> None:
        with self._lock:
            super().reset_calls()
            self.authorized = 0
            self._chaos_seen.clear()

    def call_count(self, api: str | None = None, region: str | None = None) -> int:
        with self._lock:
            return sum(n for (a, r), n in self.calls.items()
                       if (api is None or a == api) and (region is None or r == region))

    # -------------------------------------------------------------- routing
    _SKUS = re.compile(r"^/subscriptions/([^/]+)/providers/Microsoft\.Compute/skus/?$", re.I)
    _USAGES = re.compile(
        r"^/subscriptions/([^/]+)/providers/Microsoft\.Compute/locations/([^/]+)/usages/?$",
        re.I)

    _GROUPS = re.compile(rf"^/subscriptions/([^/]+)(?:/resourceGroups/([^/]+))?{_CRG}/?$",
                         re.I)
    _GROUP = re.compile(rf"^/subscriptions/([^/]+)/resourceGroups/([^/]+){_CRG}/([^/]+)"
                        r"(?:/capacityReservations(?:/([^/]+))?)?/?$", re.I)

    def _route(self, request: web.Request) -> tuple[str, str, Callable[..., Any], tuple[Any, ...]]:
        """(api, region, handler, args) for a request, or a 404 FakeAzureError."""
        path, q = request.path, request.query
        if (m := self._GROUPS.match(path)) and request.method == "GET":
            return "reservation_groups", "", self._list_groups, (m.group(1), m.group(2))
        if (m := self._GROUP.match(path)) and request.method == "GET":
            with self._lock:
                group = self._groups.get(self.group_id(m.group(2), m.group(3)).lower())
            region = group["location"] if group else ""
            if path.rstrip("/").lower().endswith("/capacityreservations"):
                return "reservations", region, self._list_reservations, m.groups()[:3]
            if m.group(4):
                return "reservation", region, self._get_reservation, m.groups()
            return "reservation_group", region, self._get_group, m.groups()[:3]
        if (m := self._SKUS.match(path)) and request.method == "GET":
            region = ""
            flt = q.get("$filter")
            if flt:
                fm = re.fullmatch(r"\s*location\s+eq\s+'([^']+)'\s*", flt, re.I)
                if fm is None:
                    raise FakeAzureError(400, "InvalidFilter",
                                         f"Only the location filter is supported: {flt}")
                region = fm.group(1).lower()
            return "skus", region, self._skus, (m.group(1), region)
        if (m := self._USAGES.match(path)) and request.method == "GET":
            return "usages", m.group(2).lower(), self._usages, (m.group(1), m.group(2).lower())
        if path.rstrip("/") == RETAIL_HOST_PATH and request.method == "GET":
            flt = q.get("$filter", "")
            rm = re.search(r"armRegionName\s+eq\s+'([^']+)'", flt, re.I)
            return "prices", rm.group(1) if rm else "", self._retail, (flt,)
        if path.rstrip("/").lower() == GRAPH_PATH.lower() and request.method == "POST":
            return "graph", "", self._graph, ()
        raise FakeAzureError(404, "InvalidResourceType",
                             f"No route for {request.method} {path} (fake)")

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.read()
        except ConnectionResetError:  # the client gave up (a timeout fault): nobody to answer
            return web.Response(status=499)
        try:
            api, region, handler, args = self._route(request)
            payload: dict[str, Any] = {}
            if api == "graph":
                payload = json.loads(body or b"{}")
                region = self._graph_region(str(payload.get("query", ""))) or ""
            with self._lock:
                self.calls[(api, region)] += 1
                self.authorized += "Authorization" in request.headers
            await self._delay()
            self._take_fault(api, region)
            if api != "prices" and request.query.get("api-version") is None:
                raise FakeAzureError(400, "MissingApiVersionParameter",
                                     "The api-version query parameter (?api-version=) is "
                                     "required for all requests.")
            result = handler(request, payload, *args) if api == "graph" \
                else handler(request, *args)
            return web.json_response(result, headers={
                "x-ms-request-id": _guid(random.random()),
                **({"x-ms-user-quota-remaining": "14",
                    "x-ms-user-quota-resets-after": "00:00:05"} if api == "graph" else {})})
        except FakeAzureError as err:
            return web.json_response({"error": {"code": err.code, "message": err.message}},
                                     status=err.status, headers=err.headers)

    # ------------------------------------------------------------ random faults
    def _chaos_applies(self, request: web.Request) -> bool:
        if self.chaos_repeats is None:
            return True
        key = (request.method, request.path_qs)
        with self._lock:
            seen = self._chaos_seen[key]
            self._chaos_seen[key] += 1
        return seen < self.chaos_repeats

    def _api_of(self, request: web.Request) -> str:
        try:
            return self._route(request)[0]
        except FakeAzureError:
            return ""

    def _coin(self) -> bool:
        return (self.chaos.rng if self.chaos is not None else random).random() < 0.5

    def _throttled(self, request: web.Request) -> web.StreamResponse:
        api = self._api_of(request)
        request_id = {"x-ms-request-id": _guid(random.random())}
        if api == "prices":
            return web.Response(status=429, text="Too Many Requests",
                                headers={"Retry-After": "1"})
        if api == "graph":
            return web.json_response(
                {"error": {"code": "RateLimiting",
                           "message": "Client application has been throttled; retry after "
                                      "the time in x-ms-user-quota-resets-after (fake)."}},
                status=429, headers={**request_id, "x-ms-user-quota-remaining": "0",
                                     "x-ms-user-quota-resets-after": "00:00:01"})
        if self._coin():  # ARM's own limit of reads for the subscription
            return web.json_response(
                {"error": {"code": "TooManyRequests",
                           "message": "Too many read requests for this subscription; "
                                      "retry after the time in Retry-After (fake)."}},
                status=429, headers={**request_id, "Retry-After": "1",
                                     "x-ms-ratelimit-remaining-subscription-reads": "0"})
        # The Compute resource provider's own throttle: OperationNotAllowed, unwrapped.
        detail = json.dumps({"operationGroup": "HighCostGet3Min", "allowedRequestCount": 240,
                             "measuredRequestCount": 241})
        return web.json_response(
            {"code": "OperationNotAllowed",
             "message": "Rejected: too many requests for this subscription (fake).",
             "details": [{"code": "TooManyRequests", "target": "HighCostGet3Min",
                          "message": detail}]},
            status=429, headers={**request_id, "Retry-After": "1",
                                 "x-ms-ratelimit-remaining-resource":
                                     "Microsoft.Compute/HighCostGet3Min;0"})

    def _server_error(self, request: web.Request, status: int) -> web.StreamResponse:
        if self._api_of(request) == "prices":
            return web.Response(status=status, text=f"{status} Server Error")
        code = "ServiceUnavailable" if status == 503 else "InternalServerError"
        return web.json_response(
            {"error": {"code": code, "message": f"{code} (injected by the fake)"}},
            status=status, headers={"x-ms-request-id": _guid(random.random())})

    def _take_fault(self, api: str, region: str) -> None:
        f = self._take(self._faults, lambda f: f.api == api and f.region in (None, region))
        if f is not None:
            headers = {"Retry-After": f.retry_after} if f.retry_after else {}
            raise FakeAzureError(f.status, f.code, f.message, headers)

    def _check_subscription(self, sub: str) -> None:
        if sub.lower() != self.subscription_id.lower():
            raise FakeAzureError(404, "SubscriptionNotFound",
                                 f"The subscription '{sub}' could not be found.")

    def _page(self, request: web.Request, api: str, items: list[Any], *,
              token_param: str) -> tuple[list[Any], str | None]:
        """A page of `items` and the next link (this request's URL with the next token)."""
        raw = request.query.get(token_param)
        if token_param == "$skip":  # the Retail Prices API pages by a plain offset
            if raw is not None and not raw.isdigit():
                raise FakeAzureError(400, "BadRequest", f"Invalid $skip value '{raw}'")
            start = int(raw or 0)
        else:
            start = _offset(raw)
        end = start + self.page_size[api]
        if end >= len(items):
            return items[start:end], None
        params = {k: v for k, v in request.query.items() if k != token_param}
        params[token_param] = str(end) if token_param == "$skip" else _token(end)
        return items[start:end], (f"{self.link_base or self.url}{request.path}?"
                                  f"{urlencode(params, quote_via=quote, safe='$')}")

    # ------------------------------------------------------------- compute
    def _sku(self, region: str, name: str) -> dict[str, Any]:
        spec = SIZE_BY_NAME[name]
        caps = [("MaxResourceVolumeMB", str(spec.vcpus * 12288)), ("OSVhdSizeMB", "1047552"),
                ("vCPUs", str(spec.vcpus)), ("MemoryPreservingMaintenanceSupported", "False"),
                ("HyperVGenerations", "V1,V2"), ("MemoryGB", f"{spec.memory_gb:g}"),
                ("MaxDataDiskCount", "32"), ("CpuArchitectureType", "x64"),
                ("LowPriorityCapable", str(spec.low_priority)), ("PremiumIO", "True"),
                ("VMDeploymentTypes", "IaaS"), ("vCPUsAvailable", str(spec.vcpus))]
        if spec.gpus is not None:
            caps.append(("GPUs", str(spec.gpus)))
        caps += [("vCPUsPerCore", "1"), ("EphemeralOSDiskSupported", "True"),
                 ("AcceleratedNetworkingEnabled", "True"), ("RdmaEnabled", "False"),
                 ("MaxNetworkInterfaces", "8")]
        zones = self.zones(region, name)
        return {
            "resourceType": "virtualMachines", "name": name, "tier": "Standard",
            "size": name.removeprefix("Standard_"), "family": spec.family,
            "locations": [region],
            "locationInfo": [{"location": region, "zones": sorted(zones, reverse=True),
                              "zoneDetails": []}],
            "capabilities": [{"name": n, "value": v} for n, v in caps],
            "restrictions": list(self._restrictions.get((region, name), [])),
        }

    def _skus(self, request: web.Request, sub: str, region: str) -> dict[str, Any]:
        self._check_subscription(sub)
        regions = [region] if region else self.regions
        items: list[dict[str, Any]] = []
        with self._lock:
            for r in regions:
                if r not in self.regions:
                    continue  # ARM answers an unknown location with an empty list
                items.append({"resourceType": "availabilitySets", "name": "Aligned",
                              "locations": [r], "locationInfo": [{"location": r,
                                                                  "zones": []}],
                              "capabilities": [{"name": "MaximumPlatformFaultDomainCount",
                                                "value": "3"}], "restrictions": []})
                items.append({"resourceType": "disks", "name": "Premium_LRS",
                              "tier": "Premium", "size": "P1", "family": "",
                              "locations": [r],
                              "locationInfo": [{"location": r, "zones": self.zones(r, "")}],
                              "capabilities": [{"name": "MaxSizeGiB", "value": "4"}],
                              "restrictions": []})
                items.extend(self._sku(r, s) for s in self.sizes_in(r, gpu_only=False))
        page, link = self._page(request, "skus", items, token_param="$skiptoken")
        return {"value": page, **({"nextLink": link} if link else {})}

    def _usages(self, request: web.Request, sub: str, region: str) -> dict[str, Any]:
        self._check_subscription(sub)
        if region not in self.regions:
            raise FakeAzureError(
                400, "LocationNotAvailableForResourceType",
                f"The provided location '{region}' is not available for resource type "
                "'Microsoft.Compute/locations/usages'.")
        names = [("availabilitySets", "Availability Sets"), ("cores", "Total Regional vCPUs"),
                 ("virtualMachines", "Virtual Machines"),
                 ("lowPriorityCores", "Total Regional Low-priority vCPUs")]
        families = sorted({SIZE_BY_NAME[s].family for s in self.sizes_in(region,
                                                                          gpu_only=False)})
        names += [(f, f"{f[0].upper()}{f[1:].removesuffix('Family')} Family vCPUs")
                  for f in families]
        items = []
        for value, localized in names:
            current, limit = self.usage(region, value)
            items.append({"unit": "Count", "currentValue": current, "limit": limit,
                          "name": {"value": value, "localizedValue": localized}})
        page, link = self._page(request, "usages", items, token_param="$skiptoken")
        return {"value": page, **({"nextLink": link} if link else {})}

    # ------------------------------------------------- capacity reservations
    def _vms(self, group: dict[str, Any], name: str, n: int) -> list[dict[str, str]]:
        return [{"id": f"/subscriptions/{self.subscription_id}/resourceGroups/"
                       f"{group['rg'].upper()}/providers/Microsoft.Compute/virtualMachines/"
                       f"{name}-vm{i}"} for i in range(n)]

    def _group_json(self, group: dict[str, Any], expand: str | None) -> dict[str, Any]:
        props: dict[str, Any] = {
            "capacityReservations": [{"id": f"{group['id']}/capacityReservations/{n}"}
                                     for n in group["reservations"]],
            "virtualMachinesAssociated": [vm for n, r in group["reservations"].items()
                                          for vm in self._vms(group, n, r["allocated"])]}
        if group["type"]:
            props["reservationType"] = group["type"]
        if expand == "instanceView":
            props["instanceView"] = {"capacityReservations": [
                {"name": n, **self._view(group, n, r)}
                for n, r in group["reservations"].items() if r["view"]]}
        out: dict[str, Any] = {
            "name": group["name"], "id": group["id"],
            "type": "Microsoft.Compute/capacityReservationGroups",
            "location": group["location"], "tags": {}, "properties": props}
        if group["zones"]:
            out["zones"] = list(group["zones"])
        return out

    def _view(self, group: dict[str, Any], name: str, r: dict[str, Any]) -> dict[str, Any]:
        view: dict[str, Any] = {
            "utilizationInfo": {
                "currentCapacity": r["capacity"] if r["current"] is None else r["current"],
                "virtualMachinesAllocated": self._vms(group, name, r["allocated"])},
            "statuses": [{"code": f"ProvisioningState/{r['state'].lower()}", "level": "Info",
                          "displayStatus": f"Provisioning {r['state'].lower()}",
                          "time": "2026-11-01T00:00:00+00:00"}]}
        if r["reservation_state"]:
            view["reservationStateInfo"] = {"reservationState": r["reservation_state"]}
        return view

    def _reservation_json(self, group: dict[str, Any], name: str, expand: str | None
                          ) -> dict[str, Any]:
        r = group["reservations"][name]
        props: dict[str, Any] = {
            "reservationId": _guid("reservation", group["id"], name),
            "platformFaultDomainCount": 1, "provisioningState": r["state"],
            "provisioningTime": "2026-11-01T00:00:00+00:00",
            "timeCreated": "2026-11-01T00:00:00+00:00",
            "virtualMachinesAssociated": self._vms(group, name, r["allocated"])}
        if expand == "instanceView" and r["view"]:
            props["instanceView"] = self._view(group, name, r)
        out: dict[str, Any] = {
            "name": name, "id": f"{group['id']}/capacityReservations/{name}",
            "type": "Microsoft.Compute/capacityReservationGroups/capacityReservations",
            "location": group["location"], "tags": {},
            "sku": {"name": r["size"], "capacity": r["capacity"]}, "properties": props}
        if r["zone"]:
            out["zones"] = [r["zone"]]
        _set_path(out, r["raw"])
        return out

    def _group_or_404(self, sub: str, rg: str, name: str) -> dict[str, Any]:
        self._check_subscription(sub)
        group = self._groups.get(self.group_id(rg, name).lower())
        if group is None:
            raise FakeAzureError(404, "ResourceNotFound", "The Resource 'Microsoft.Compute/"
                                 f"capacityReservationGroups/{name}' under resource group "
                                 f"'{rg}' was not found.")
        return group

    def _list_groups(self, request: web.Request, sub: str, rg: str | None) -> dict[str, Any]:
        self._check_subscription(sub)
        expand = request.query.get("$expand")
        if expand not in (None, "virtualMachines/$ref", "virtualMachineScaleSetVMs/$ref"):
            raise FakeAzureError(400, "InvalidParameter",
                                 f"The value '{expand}' of parameter '$expand' is invalid.")
        with self._lock:
            items = [self._group_json(g, None) for g in self._groups.values()
                     if rg is None or g["rg"].lower() == rg.lower()]
        page, link = self._page(request, "reservation_groups", items,
                                token_param="$skiptoken")
        return {"value": page, **({"nextLink": link} if link else {})}

    def _get_group(self, request: web.Request, sub: str, rg: str, name: str
                   ) -> dict[str, Any]:
        with self._lock:
            return self._group_json(self._group_or_404(sub, rg, name),
                                    request.query.get("$expand"))

    def _list_reservations(self, request: web.Request, sub: str, rg: str, name: str
                           ) -> dict[str, Any]:
        with self._lock:
            group = self._group_or_404(sub, rg, name)
            items = [self._reservation_json(group, n, None) for n in group["reservations"]]
        page, link = self._page(request, "reservations", items, token_param="$skiptoken")
        return {"value": page, **({"nextLink": link} if link else {})}

    def _get_reservation(self, request: web.Request, sub: str, rg: str, name: str,
                         reservation: str) -> dict[str, Any]:
        with self._lock:
            group = self._group_or_404(sub, rg, name)
            if reservation not in group["reservations"]:
                raise FakeAzureError(404, "ResourceNotFound", "The Resource 'Microsoft."
                                     f"Compute/capacityReservationGroups/{name}/"
                                     f"capacityReservations/{reservation}' was not found.")
            return self._reservation_json(group, reservation, request.query.get("$expand"))

    # -------------------------------------------------------------- prices
    def _items(self, region: str, size: str) -> list[dict[str, Any]]:
        """Every Retail Prices item of a size in a region (Linux, Windows, spot, low
        priority, DevTest, a 1-year reservation)."""
        od, spot = self._prices[(region, size)]
        spec = SIZE_BY_NAME[size]
        meter = meter_name(size)
        rows: list[tuple[str, str, bool, float | None, str]] = [
            ("Consumption", "", False, od, "1 Hour"),
            ("Consumption", " Spot", False, spot, "1 Hour"),
            ("Consumption", " Low Priority", False, None if od is None else od * 0.2, "1 Hour"),
            ("Consumption", "", True, None if od is None else od + 0.046 * spec.vcpus,
             "1 Hour"),
            ("Consumption", " Spot", True,
             None if spot is None else spot + 0.0092 * spec.vcpus, "1 Hour"),
            ("DevTestConsumption", "", False, None if od is None else od * 0.9, "1 Hour"),
            ("Reservation", "", False, None if od is None else od * 0.6 * 8760, "1 Hour"),
        ]
        out = []
        for kind, suffix, windows, price, unit in rows:
            if price is None:
                continue
            product = product_name(size, windows)
            item: dict[str, Any] = {
                "currencyCode": "USD", "tierMinimumUnits": 0.0,
                "retailPrice": round(price, 6), "unitPrice": round(price, 6),
                "armRegionName": region, "location": LOCATION_NAMES.get(region, region),
                "effectiveStartDate": "2026-11-01T00:00:00Z",
                "meterId": _guid("meter", region, size, suffix, windows),
                "meterName": meter + suffix,
                "productId": "DZH318Z0" + f"{_h('p', product) % 10**4:04d}",
                "skuId": f"DZH318Z0{_h('p', product) % 10**4:04d}/{_h('s', size) % 10**4:04d}",
                "availabilityId": None, "productName": product, "skuName": meter + suffix,
                "serviceName": "Virtual Machines", "serviceId": "DZH313Z7MMC8",
                "serviceFamily": "Compute", "unitOfMeasure": unit, "type": kind,
                "isPrimaryMeterRegion": True, "armSkuName": size,
            }
            if kind == "Reservation":
                item["reservationTerm"] = "1 Year"
            out.append(item)
        return out

    def _retail(self, request: web.Request, flt: str) -> dict[str, Any]:
        match = _retail_filter(flt) if flt else (lambda item: True)
        with self._lock:
            keys = sorted(self._prices)
            items = [i for r, s in keys for i in self._items(r, s) if match(i)]
        page, link = self._page(request, "prices", items, token_param="$skip")
        return {"BillingCurrency": "USD", "CustomerEntityId": "Default",
                "CustomerEntityType": "Retail", "Items": page, "NextPageLink": link,
                "Count": len(page)}

    # --------------------------------------------------------------- graph
    @staticmethod
    def _graph_region(query: str) -> str | None:
        m = re.search(r"\blocation\s*=~\s*'([^']+)'", query, re.I)
        return m.group(1).lower() if m else None

    def _graph(self, request: web.Request, body: dict[str, Any]) -> dict[str, Any]:
        query = str(body.get("query", ""))
        if "spotresources" not in query.lower() or EVICTION_TYPE not in query.lower():
            raise FakeAzureError(400, "BadRequest",
                                 "The fake answers only the SpotResources eviction-rate "
                                 f"query ({EVICTION_TYPE}); got: {query[:200]}")
        region = self._graph_region(query)
        pm = re.search(r"startswith\s*'([^']+)'", query, re.I)
        prefix = pm.group(1).lower() if pm else ""
        rows = []
        with self._lock:
            for r, s in sorted(self._prices):
                if (region and r != region) or not s.lower().startswith(prefix):
                    continue
                band = self.eviction_rate(r, s)
                if band is not None:
                    rows.append({"skuName": s.lower(), "location": r, "evictionRate": band})
        options = body.get("options") or {}
        start = _offset(options.get("$skipToken"))
        top = min(int(options.get("$top", 100)), 1000, self.page_size["graph"])
        page = rows[start:start + top]
        out: dict[str, Any] = {"totalRecords": len(rows), "count": len(page), "data": page,
                               "facets": [], "resultTruncated": "false"}
        if start + top < len(rows):
            out["$skipToken"] = _token(start + top)
        if options.get("resultFormat", "objectArray") == "table":
            cols = ["skuName", "location", "evictionRate"]
            out["data"] = {"columns": [{"name": c, "type": "string"} for c in cols],
                           "rows": [[row[c] for c in cols] for row in page]}
        return out


@pytest.fixture(name="fake_azure")
def fake_azure_fixture() -> Iterator[FakeAzure]:
    """A running FakeAzure."""
    with FakeAzure() as fake:
        yield fake
