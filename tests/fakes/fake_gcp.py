"""A fake Google Cloud on one local URL, for driving the real google-cloud-compute and
google-cloud-billing clients (REST transport) against it.

The GCP adapter's config has ONE base URL (``clouds.gcp.endpoint``) that replaces both
hosts it calls, so this fake is a single aiohttp server (its own event loop, in a
background thread: usable from the blocking clients and from async tests alike) that
routes by path, as the two APIs' real paths differ:

* ``GET /compute/v1/projects/{p}``                                 → Compute ``projects.get``
* ``GET /compute/v1/projects/{p}/regions/{r}``                      → ``regions.get``
* ``GET /compute/v1/projects/{p}/zones/{z}/machineTypes``           → ``machineTypes.list``
* ``GET /compute/v1/projects/{p}/zones/{z}/acceleratorTypes``       → ``acceleratorTypes.list``
* ``GET /compute/v1/projects/{p}/aggregated/reservations``  → ``reservations.aggregatedList``
* ``GET /compute/v1/projects/{p}/zones/{z}/reservations``    → ``reservations.list``
* ``GET /compute/v1/projects/{p}/zones/{z}/reservations/{n}`` → ``reservations.get``
* ``POST /compute/v1/projects/{p}/regions/{r}/advice/capacity``  → ``advice.capacity``
* ``GET /v1/services/6F81-5844-456A/skus``                          → Billing ``skus.list``
* ``POST /token``                                                   → an OAuth token endpoint
  (``service_account_file`` points a service-account key at it)

Answers are the REST shapes in camelCase JSON: ``kind``, ``selfLink``, zone URLs in a
region's ``zones``, ``quotas`` with ``metric``/``limit``/``usage``, machine types'
``accelerators[]`` with ``guestAcceleratorType``/``guestAcceleratorCount``, SKUs with
``category``, ``serviceRegions`` and ``pricingInfo[].pricingExpression.tieredRates[]
.unitPrice {units (a string), nanos}``. Lists are paged with ``nextPageToken``, at most
``page_size[op]`` items a page (small by default, so every list takes several pages);
machine-type lists take Compute Engine's regex filter (``name eq "RE2"`` / ``ne``).
Errors are Google's JSON error bodies (``error.code``, ``message``, ``status``,
``errors[].reason`` for Compute Engine, an ``ErrorInfo`` detail), with ``Retry-After``
when asked.

**Data**, from the price snapshot ``tests/fixtures/prices/gpu-prices-gcp.csv``:

* zones: every zone a snapshot row names; each zone's machine types are its host rows
  (a2/a3/g2 with their built-in GPUs), ``a4-highgpu-8g`` where B200 rows are (the
  snapshot has no a4 host price, so no A4 SKU exists: its price must come out unknown),
  the N1 standard/highmem machines and some GPU-less series (e2, n2, c2); its accelerator
  types are the GPUs of its accelerator rows, ``maximumCardsPerInstance`` the largest
  count listed, plus the ``-vws`` virtual-workstation variants of T4/P4/P100 and an
  obsolete ``nvidia-tesla-k80``.
* SKUs: a vCPU and a RAM SKU per machine series, region and market, fitted to the
  snapshot's host prices by least squares over the series' shapes in the region (where
  all of them have one RAM/vCPU ratio, the split follows the series' us-central1
  ratio); every snapshot host price comes back within 2e-5 $/h (test_fake_gcp.py), except
  A3 Mega's and A3 Ultra's: the snapshot priced them with the ``A3 Instance`` SKUs (its
  rows equal A3 High's per vCPU and GiB), but they have their own, ``A3Plus Instance`` and
  ``A3Ultra Instance``. Those are the snapshot's fit scaled, in every region and market,
  so that the family's 8-GPU VM costs in us-central1 on demand: A3 Mega 208 × 0.026924 +
  1,872 × 0.002344 (public test data of a Billing Catalog parser, "A3Plus Instance Core
  running in Americas" and its Ram SKU), A3 Ultra 8.99808 $/h (the Billing Catalog's
  a3-ultragpu-8g price per GPU, 10.4365 on 2026-10-13 in the tanod/cloud-gpu-list-prices
  data set, × 8 less the snapshot's 8 H200; an estimate). A GPU
  SKU per model, region and market: the snapshot's price for the fewest GPUs, per GPU.
  Local SSD (``LOCAL_SSD_GIB``, bundled with A2 Ultra and A3 High, Mega, Edge and Ultra
  and not in the snapshot's host prices) has the generic ``SSD backed Local Storage``
  SKUs per region: 0.08 $/GiB-month on demand in us-central1 (Google's local SSD price),
  Spot 0.048 (an assumption: no public figure found), scaled as N1's.
  N1 host prices are not in the snapshot: they are the us-central1 list prices
  (0.031611 $/vCPU-h, 0.004237 $/GiB-h; Spot 0.006655 and 0.000892), scaled by the
  region's G2 (else A2, A3) price ratio to us-central1. Where us-central1, us-east1 and
  us-west1 share a price, it is one multi-regional SKU "... running in Americas", as the
  catalog does. Decoys priced absurdly (commitments, sole tenancy, custom, reserved,
  virtual-workstation, DWS and Calendar-mode GPUs, TPUs, storage, network, licences; in
  ``DECOY_REGIONS``) are shuffled in among the real SKUs.

**SKU descriptions** are worded as the real catalog words them, every documented
variant mixed in (each region and GPU gets one, chosen by a hash of the two: the same
on every run), so that the adapter is tested against the catalog's naming, not ours:

* Spot GPUs: mostly ``Nvidia Tesla A100 GPU attached to Spot Preemptible VMs running in
  Americas`` (usageType ``Preemptible``), some ``Spot Preemptible Nvidia ... GPU running
  in ...``. Sources: SKU ``39D4-516A-0317`` (that description, Preemptible, us-central1),
  the Cloud Billing API reference's example ``Nvidia Tesla K80 GPU attached to Spot
  Preemptible VMs running in Warsaw`` and the Catalog how-to's ``L4 GPU attached to Spot
  Preemptible VMs running in Hong Kong``; the prefix form: issue #15 ("only a few use the
  prefix form").
* B200 (A4): ``A4 Nvidia B200 (1 gpu slice) running in ...``, one GPU slice priced with
  its share of the VM (A4 has no vCPU/RAM SKUs); its Spot SKUs read ``Spot Preemptible A4
  Nvidia B200 (1 gpu slice) running in ...``, in some regions with usageType
  ``OnDemand`` (skypilot-org/skypilot#8125: "Some B200 spot SKUs ... have
  usageType='OnDemand' even though the description says Spot Preemptible"; the a4
  pricing: the same PR and dstackai/gpuhunt#176).
* ``H200 141GB GPU running in ...`` (no "Nvidia"), A3 Mega as ``Nvidia H100 80GB Mega
  GPU``, ``Nvidia H100 Mega 80GB GPU`` or ``Nvidia H100 80GB Plus GPU`` by region, the
  A100 80GB as ``Nvidia Tesla A100 80GB GPU`` or ``Nvidia A100 80GB GPU`` (skypilot's
  `fetch_gcp.py`, which matches exactly these names); ``NVIDIA L4 GPU`` in capitals
  in some regions (a public SKU classifier's test data).
* Spot vCPU/RAM: ``Spot Preemptible A2 Instance Core running in Americas`` (SKUs
  ``3178-715E-CFB6`` and ``65A3-16DB-D57A`` for Core and Ram); N1 either ``Preemptible N1
  Predefined Instance Core running in Virginia`` (the older wording, still in public
  price parsers' test data) or ``Spot Preemptible N1 Predefined Instance ...``
  (infracost/cloud-pricing-api#246: Google moved descriptions to "Spot Preemptible").
* Local SSD: ``SSD backed Local Storage in Iowa``, Spot ``SSD backed Local Storage
  attached to Spot Preemptible VMs in Iowa``, the Americas SKUs without a region (``SSD
  backed Local Storage``), resource family ``Storage``, group ``LocalSSD``, per GiB-month
  (``GiBy.mo``); some Spot ones tagged ``OnDemand`` (a public Billing Catalog client:
  "Google categorizes the generic ... attached to Spot Preemptible VMs SKUs as On
  Demand"). Sources: sc-crawler's GCP tests and infracost's ``scratchDiskCostComponent``.
* Regions as the catalog names them: ``running in Iowa``, ``running in Virginia``
  (us-east4), ``running in Israel`` (me-west1), ``running in Americas``.
* Never a VM's price: ``Nvidia Tesla A100 GPU attached to DWS Defined Duration VMs``,
  ``DWS Defined Duration A2 Core`` (flex-start), ``Reserved Nvidia Tesla A100 80GB GPU in
  ...`` priced $0 (a reservation placeholder), ``Commitment v1: ... for 1 Year``,
  TPU SKUs (``TpuV6e attached to Spot Preemptible VMs``, ``Capacity Optimized TpuV6e``,
  ``Reserved V6e TPU in ... in Calendar Mode``), all from public catalog parsers' test
  data and notes.
* quotas: in each region 16 of each GPU model it has, on demand and ``PREEMPTIBLE_``,
  none used; ``GPUS_ALL_REGIONS`` 64 for the project. ``set_quota`` /
  ``set_project_quota`` change them.

**Reservations** (none unless a test adds them: ``add_reservation``,
``set_reservation_in_use``, ``remove_reservation``) are answered in the v1 REST shape of
https://cloud.google.com/compute/docs/reference/rest/v1/reservations: ``kind``
``compute#reservation``, ``id``, ``creationTimestamp``, ``selfLink``, ``zone`` (a zone
URL), ``name``, ``specificReservation`` {``instanceProperties`` {``machineType`` (a
name), ``guestAccelerators`` [{``acceleratorType``, ``acceleratorCount``}]}, ``count``,
``inUseCount``, ``assuredCount`` — int64, so JSON strings}, ``specificReservationRequired``,
``status``, ``shareSettings``, ``deleteAtTime`` if set. A reservation made from an
instance template carries ``sourceInstanceTemplate`` and no ``instanceProperties`` (an
assumption: the reference gives the two as alternatives of a request). The aggregated
list (``compute#reservationAggregatedList``) keys ``items`` by ``zones/<zone>``: each zone
with reservations on the page has ``reservations``, every other zone of the project a
``warning`` ``NO_RESULTS_ON_PAGE``, as Compute Engine answers; pages hold at most
``page_size[op]`` reservations (``nextPageToken``). ``filter`` is not taken (a 400).
``raw`` overrides a reservation's answered fields by dotted path
(``specificReservation.count``; ``None`` leaves a field out).

**Capacity advice** (``advice.capacity``, the REST reference's method `advice.capacity`,
posted where google-cloud-compute's ``AdviceClient`` posts it, under ``/compute/v1``)
takes the documented request body — ``instanceProperties.scheduling.provisioningModel``
(``SPOT``/``STANDARD``), ``instanceFlexibilityPolicy.instanceSelections`` (a map of
selections, each with ``machineTypes[]`` and optionally ``guestAccelerators[]``
{``acceleratorType``, ``acceleratorCount``}), ``size``, ``distributionPolicy`` {``zones[]``
{``zone``: ``zones/<zone>`` or a zone URL}, ``targetShape``} — and answers
``{"recommendations": [{"scores": {"obtainability": 0..1, "estimatedUptime": "<n>s"},
"shards": [{"zone", "machineType", "provisioningModel", "instanceCount"}]}]}``
(``estimatedUptime`` on Spot answers only). The scores are those set with
``set_capacity_advice`` for (zone, machine type, attached accelerator, model), else a
fixed function of the four (obtainability 0.30-1.00, Spot uptime 1-24 h). Machine types
and accelerators the zone does not have, an unknown model or zone, or more than one
zone answer 400, as does a machine type in ``advice_unsupported``. ``advice_denied = True``
answers 403 (``forbidden``: "Required
'compute.advice.capacity' permission ...", as a project without the permission is
answered); ``advice_requests`` records each body. Calls are counted per zone asked.

Every call is counted in ``calls`` (a Counter of ``(op, where)``, ``where`` a region,
a zone or ``global``; random faults included), can be delayed by ``latency = (lo, hi)``
seconds (an ``asyncio.sleep``: calls stay concurrent) and failed with ``fail(...)``.

Random faults (``chaos``, `fake_server`) answer in Google's shapes: a throttle of the
Billing Catalog is HTTP 429 ``RESOURCE_EXHAUSTED`` with an ``ErrorInfo`` reason
``RATE_LIMIT_EXCEEDED`` and a ``RetryInfo`` ``retryDelay`` of 1 s (AIP-193's shape);
Compute Engine's throttles alternate between its documented 403 ``rateLimitExceeded``
(domain ``usageLimits``, "Rate Limit Exceeded": the "API rate limits" page) and a 429
"Quota exceeded for quota metric 'Read requests' ..." with reason ``rateLimitExceeded``;
5xx are 503 ``UNAVAILABLE`` / 500 ``INTERNAL`` with reason ``backendError``. The OAuth
``/token`` endpoint is spared (google-auth retries a token grant itself; its failures
reach the adapter as a retryable ``RefreshError``). ``spare_every = n`` spares every
n-th arrival of the same request (method, path and query) as well: no call then meets
more than n - 1 faults in a row, so a test of healing at a high fault rate does not
depend on the odds of a call failing every one of its attempts.
``require_auth = True`` answers 401 to calls without a bearer token;
``authorizations`` records each call's ``Authorization`` header ("" if none).

Usage::

    from fake_gcp import fake_gcp_fixture  # noqa: F401   (the ``fake_gcp`` fixture)

    def test_x(fake_gcp):
        GcpAdapter(regions=["us-central1"], project=fake_gcp.project,
                   endpoint=fake_gcp.url, anonymous=True)

or without pytest: ``with FakeGCP() as fake: ...``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import csv
import functools
import hashlib
import json
import random
import re
import threading
import weakref
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from aiohttp import web
from fake_server import FakeServer

# the price snapshot vendored with the tests (provenance: tests/fixtures/prices/README.md)
DEFAULT_PRICES_CSV = Path(__file__).resolve().parents[1] / "fixtures/prices/gpu-prices-gcp.csv"
COMPUTE_SERVICE = "6F81-5844-456A"
PROJECT = "gpubroker-test"
API = "https://www.googleapis.com/compute/v1"
CREATED = "2015-01-16T09:25:43.000-08:00"
AMERICAS = ("us-central1", "us-east1", "us-west1")  # the multi-regional SKUs' regions
DECOY_REGIONS = (*AMERICAS, "us-east4", "europe-west4")

# snapshot GPU name -> (accelerator type, description, quota metric, catalog names: the
# GPU part of the Billing Catalog's descriptions; where there are several, regions differ)
GPUS: MappingProxyType[str, tuple[str, str, str, tuple[str, ...]]] = MappingProxyType({
    "T4": ("nvidia-tesla-t4", "NVIDIA T4", "NVIDIA_T4_GPUS", ("Nvidia Tesla T4 GPU",)),
    "V100": ("nvidia-tesla-v100", "NVIDIA V100", "NVIDIA_V100_GPUS", ("Nvidia Tesla V100 GPU",)),
    "P100": ("nvidia-tesla-p100", "NVIDIA P100", "NVIDIA_P100_GPUS", ("Nvidia Tesla P100 GPU",)),
    "P4": ("nvidia-tesla-p4", "NVIDIA P4", "NVIDIA_P4_GPUS", ("Nvidia Tesla P4 GPU",)),
    "A100": ("nvidia-tesla-a100", "NVIDIA A100 40GB", "NVIDIA_A100_GPUS",
             ("Nvidia Tesla A100 GPU",)),
    "A100-80GB": ("nvidia-a100-80gb", "NVIDIA A100 80GB", "NVIDIA_A100_80GB_GPUS",
                  ("Nvidia Tesla A100 80GB GPU", "Nvidia A100 80GB GPU")),
    "L4": ("nvidia-l4", "NVIDIA L4", "NVIDIA_L4_GPUS", ("Nvidia L4 GPU", "NVIDIA L4 GPU")),
    "H100": ("nvidia-h100-80gb", "NVIDIA H100 80GB", "NVIDIA_H100_GPUS",
             ("Nvidia H100 80GB GPU",)),
    "H100-MEGA": ("nvidia-h100-mega-80gb", "NVIDIA H100 80GB MEGA", "NVIDIA_H100_MEGA_GPUS",
                  ("Nvidia H100 80GB Mega GPU", "Nvidia H100 Mega 80GB GPU",
                   "Nvidia H100 80GB Plus GPU")),
    "H200": ("nvidia-h200-141gb", "NVIDIA H200 141GB", "NVIDIA_H200_GPUS", ("H200 141GB GPU",)),
    "B200": ("nvidia-b200", "NVIDIA B200", "NVIDIA_B200_GPUS",
             ("A4 Nvidia B200 (1 gpu slice)",)),
})
SERIES_SKU = {"a2": "A2 Instance", "a3": "A3 Instance", "g2": "G2 Instance",
              "n1": "N1 Predefined Instance", "a3plus": "A3Plus Instance",
              "a3ultra": "A3Ultra Instance"}
# machine families with vCPU/RAM SKUs of their own -> their key in SERIES_SKU
OWN_SKUS = {"a3-megagpu": "a3plus", "a3-ultragpu": "a3ultra"}
# vCPU price / GiB price of a series in us-central1, for regions with a single shape ratio
CORE_RAM_RATIO = {"a2": 7.4607, "a3": 11.4837, "g2": 8.5371, "a3plus": 0.026924 / 0.002344,
                  "a3ultra": 11.4837}
# the us-central1 on-demand host price of A3 Mega's and Ultra's 8-GPU VM (module doc)
OWN_SKU_TARGETS = {"a3plus": ("a3-megagpu-8g", 208 * 0.026924 + 1872 * 0.002344),
                   "a3ultra": ("a3-ultragpu-8g", 8.99808)}
N1_PRICES = {"on_demand": (0.031611, 0.004237), "spot": (0.006655, 0.000892)}
LOCAL_SSD = "local-ssd"  # the name of the local SSD price (per GiB-month)
LOCAL_SSD_PRICES = {"on_demand": 0.08, "spot": 0.048}  # us-central1, $/GiB-month
# GiB of local SSD a machine type comes with (https://cloud.google.com/compute/docs/gpus)
LOCAL_SSD_GIB = {"a2-ultragpu-1g": 375, "a2-ultragpu-2g": 750, "a2-ultragpu-4g": 1500,
                 "a2-ultragpu-8g": 3000, "a3-highgpu-1g": 750, "a3-highgpu-2g": 1500,
                 "a3-highgpu-4g": 3000, "a3-highgpu-8g": 6000, "a3-megagpu-8g": 6000,
                 "a3-edgegpu-8g": 6000, "a3-ultragpu-8g": 12000}
LOCATIONS = {
    "asia-east1": "Taiwan", "asia-east2": "Hong Kong", "asia-northeast1": "Tokyo",
    "asia-northeast3": "Seoul", "asia-south1": "Mumbai", "asia-south2": "Delhi",
    "asia-southeast1": "Singapore", "asia-southeast2": "Jakarta",
    "australia-southeast1": "Sydney", "europe-central2": "Warsaw", "europe-north1": "Finland",
    "europe-west1": "Belgium", "europe-west2": "London", "europe-west3": "Frankfurt",
    "europe-west4": "Netherlands", "europe-west6": "Zurich", "europe-west8": "Milan",
    "europe-west9": "Paris", "me-central2": "Dammam", "me-west1": "Israel",
    "northamerica-northeast1": "Montreal", "northamerica-northeast2": "Toronto",
    "southamerica-east1": "Sao Paulo", "us-central1": "Iowa", "us-east1": "South Carolina",
    "us-east4": "Virginia", "us-east5": "Columbus", "us-south1": "Dallas",
    "us-west1": "Oregon", "us-west2": "Los Angeles", "us-west3": "Salt Lake City",
    "us-west4": "Las Vegas",
}
# GPU-less machine types every zone also lists: (name, vCPUs, MiB)
PLAIN_MACHINES = (
    [(f"n1-standard-{n}", n, n * 3840) for n in (1, 2, 4, 8, 16, 32, 64, 96)]
    + [(f"n1-highmem-{n}", n, n * 6656) for n in (2, 4, 8)]
    + [(f"e2-standard-{n}", n, n * 4096) for n in (2, 4, 8)]
    + [(f"n2-standard-{n}", n, n * 4096) for n in (2, 4, 8, 16, 32)]
    + [(f"c2-standard-{n}", n, n * 4096) for n in (4, 8)]
)
A4 = ("a4-highgpu-8g", 224, 3968 * 1024)
STATUS = {400: ("invalid", "INVALID_ARGUMENT"), 401: ("required", "UNAUTHENTICATED"),
          403: ("forbidden", "PERMISSION_DENIED"), 404: ("notFound", "NOT_FOUND"),
          429: ("rateLimitExceeded", "RESOURCE_EXHAUSTED"), 500: ("backendError", "INTERNAL"),
          503: ("backendError", "UNAVAILABLE")}
_FILTER = re.compile(r"""^\s*name\s+(eq|ne)\s+(?:"([^"]*)"|'([^']*)'|(\S+))\s*$""")

# (region, market, core|ram|gpu|lssd, series|accelerator|LOCAL_SSD)
PriceKey = tuple[str, str, str, str]


def sku_series(machine_type: str) -> str:
    """The key (in SERIES_SKU) of the vCPU/RAM SKUs a machine type is priced by."""
    return OWN_SKUS.get("-".join(machine_type.split("-", 2)[:2]), machine_type.split("-")[0])


class FakeGCPError(Exception):
    """An error the fake answers in Google's JSON error shape."""

    def __init__(self, status: int, message: str, reason: str | None = None,
                 retry_after: float | None = None, *, retry_delay: str | None = None,
                 domain: str = "global", legacy: bool = False) -> None:
        super().__init__(message)
        self.status, self.message = status, message
        self.reason = reason or STATUS.get(status, ("unknown", "UNKNOWN"))[0]
        self.retry_after = retry_after  # the Retry-After header, if any
        self.retry_delay = retry_delay  # a google.rpc.RetryInfo detail's delay, if any
        self.domain = domain  # of the Compute Engine `errors[]` entry
        self.legacy = legacy  # Compute Engine's older body: `errors[]` only


@dataclass
class _Fault:
    op: str
    where: str | None
    status: int
    reason: str | None
    message: str
    retry_after: float | None
    remaining: int | None  # None = until clear_faults()


@dataclass(frozen=True)
class _World:
    """What the snapshot says, built once per CSV (never mutated)."""

    zones: MappingProxyType[str, tuple[str, ...]]  # region -> zones
    machines: MappingProxyType[str, tuple[tuple[str, int, int, str | None, int], ...]]
    accelerators: MappingProxyType[str, tuple[tuple[str, int], ...]]  # zone -> (gpu, max)
    prices: MappingProxyType[PriceKey, float]


def _nanos(usd: float) -> float:
    return round(usd * 1e9) / 1e9


def _fit(points: list[tuple[int, float, float]], ratio: float) -> tuple[float, float]:
    """(USD per vCPU-h, USD per GiB-h) fitted to (vCPUs, GiB, USD/h) by least squares;
    with one RAM/vCPU ratio only, split by `ratio` (= vCPU price / GiB price)."""
    a = sum(v * v for v, _, _ in points)
    b = sum(v * m for v, m, _ in points)
    c = sum(m * m for _, m, _ in points)
    d1 = sum(v * p for v, _, p in points)
    d2 = sum(m * p for _, m, p in points)
    det = a * c - b * b
    if abs(det) > 1e-6 * a * c:
        return _nanos((d1 * c - b * d2) / det), _nanos((a * d2 - b * d1) / det)
    xs = [(ratio * v + m, p) for v, m, p in points]  # price = ram × (ratio × vCPUs + GiB)
    ram = sum(x * p for x, p in xs) / sum(x * x for x, _ in xs)
    return _nanos(ratio * ram), _nanos(ram)


def _own_skus(prices: dict[PriceKey, float],
              host: dict[tuple[str, str, str], dict[str, tuple[int, float, float]]]) -> None:
    """Scale the fitted vCPU/RAM prices of the families with SKUs of their own (A3 Mega,
    A3 Ultra) to their us-central1 target (`OWN_SKU_TARGETS`), in every region and market."""
    for series, (itype, target) in OWN_SKU_TARGETS.items():
        scale = target / host[("us-central1", "on_demand", series)][itype][2]
        for key in [k for k in prices if k[3] == series]:
            prices[key] = _nanos(prices[key] * scale)


@functools.cache
def _world(path: Path) -> _World:
    zones: dict[str, set[str]] = defaultdict(set)
    machines: dict[str, dict[str, tuple[str, int, int, str | None, int]]] = defaultdict(dict)
    accel_max: dict[str, dict[str, int]] = defaultdict(dict)
    host: dict[tuple[str, str, str], dict[str, tuple[int, float, float]]] = defaultdict(dict)
    gpu_unit: dict[tuple[str, str, str], tuple[int, str, float]] = {}
    with path.open(newline="") as fh:
        for row in csv.DictReader(fh):
            region, zone, gpu, gpus = row["region"], row["zone"], row["gpu"], int(row["gpus"])
            zones[region].add(zone)
            itype = row["instance_type"]
            if itype:
                accel = GPUS[gpu][0]
                mib = int(float(row["memory_gib"]) * 1024)
                machines[zone][itype] = (itype, int(row["vcpus"]), mib, accel, gpus)
                for market, col in (("on_demand", "on_demand_usd_per_hour"),
                                    ("spot", "spot_usd_per_hour")):
                    if row[col]:
                        host[(region, market, sku_series(itype))][itype] = (
                            int(row["vcpus"]), float(row["memory_gib"]), float(row[col]))
                continue
            accel_max[zone][gpu] = max(accel_max[zone].get(gpu, 0), gpus)
            if gpu == "B200":
                machines[zone][A4[0]] = (*A4, GPUS["B200"][0], 8)
            for market, col in (("on_demand", "on_demand_usd_per_hour"),
                                ("spot", "spot_usd_per_hour")):
                if row[col]:
                    key = (region, market, GPUS[gpu][0])
                    candidate = (gpus, zone, float(row[col]) / gpus)
                    if key not in gpu_unit or candidate < gpu_unit[key]:
                        gpu_unit[key] = candidate
    prices: dict[PriceKey, float] = {}
    for (region, market, series), shapes in host.items():
        core, ram = _fit(sorted(shapes.values()), CORE_RAM_RATIO[series])
        prices[(region, market, "core", series)] = core
        prices[(region, market, "ram", series)] = ram
    _own_skus(prices, host)
    for (region, market, accel), (_, _, usd) in gpu_unit.items():
        prices[(region, market, "gpu", accel)] = _nanos(usd)
    for region in zones:
        factor = 1.0
        for series in ("g2", "a2", "a3"):
            here = prices.get((region, "on_demand", "core", series))
            base = prices.get(("us-central1", "on_demand", "core", series))
            if here and base:
                factor = here / base
                break
        for market, (core, ram) in N1_PRICES.items():
            prices[(region, market, "core", "n1")] = _nanos(core * factor)
            prices[(region, market, "ram", "n1")] = _nanos(ram * factor)
            prices[(region, market, "lssd", LOCAL_SSD)] = _nanos(
                LOCAL_SSD_PRICES[market] * factor)
    plain = [(name, v, mib, None, 0) for name, v, mib in PLAIN_MACHINES]
    return _World(
        zones=MappingProxyType({r: tuple(sorted(z)) for r, z in sorted(zones.items())}),
        machines=MappingProxyType({
            z: tuple(sorted([*plain, *machines.get(z, {}).values()]))
            for r in zones for z in zones[r]}),
        accelerators=MappingProxyType({z: tuple(sorted(g.items()))
                                       for z, g in accel_max.items()}),
        prices=MappingProxyType(prices),
    )


def _sku_id(*parts: str) -> str:
    h = hashlib.sha256("|".join(parts).encode()).hexdigest().upper()
    return f"{h[0:4]}-{h[4:8]}-{h[8:12]}"


def sku_json(description: str, *, group: str, usage: str, regions: list[str], usd: float,
             unit: str = "h", family: str = "Compute") -> dict[str, Any]:
    """One Billing Catalog SKU in its REST JSON shape."""
    nanos = round(usd * 1e9)
    unit_desc = {"h": ("hour", "s", "second", 3600),
                 "GiBy.h": ("gibibyte hour", "By.s", "byte second", 3600 * 2**30),
                 "GiBy.mo": ("gibibyte month", "By.s", "byte second", 2592000 * 2**30),
                 "GiBy": ("gibibyte", "By", "byte", 2**30)}[unit]
    sku_id = _sku_id(description, ",".join(regions), usage)
    return {
        "name": f"services/{COMPUTE_SERVICE}/skus/{sku_id}",
        "skuId": sku_id,
        "description": description,
        "category": {"serviceDisplayName": "Compute Engine", "resourceFamily": family,
                     "resourceGroup": group, "usageType": usage},
        "serviceRegions": regions,
        "pricingInfo": [{
            "summary": "",
            "pricingExpression": {
                "usageUnit": unit, "displayQuantity": 1,
                "tieredRates": [{"startUsageAmount": 0, "unitPrice": {
                    "currencyCode": "USD", "units": str(nanos // 10**9),
                    "nanos": nanos % 10**9}}],
                "usageUnitDescription": unit_desc[0], "baseUnit": unit_desc[1],
                "baseUnitDescription": unit_desc[2],
                "baseUnitConversionFactor": unit_desc[3]},
            "currencyConversionRate": 1,
            "effectiveTime": "2026-11-30T00:00:00.000Z"}],
        "serviceProviderName": "Google",
        "geoTaxonomy": {"type": "MULTI_REGIONAL" if len(regions) > 1 else "REGIONAL",
                        "regions": regions},
    }


def _pick(n: int, *key: str) -> int:
    """A stable choice among `n` variants for `key` (the same on every run)."""
    return int(hashlib.sha256("|".join(key).encode()).hexdigest(), 16) % n


def _describe(market: str, kind: str, name: str, where: str) -> tuple[str, str, str]:
    """(description, resource group, usage type) of the SKU pricing `kind` of `name` in
    `where`, worded as the real catalog words it (see the module doc)."""
    spot = market == "spot"
    if kind == "lssd":  # the Americas SKU names no region
        tail = "" if where == "Americas" else f" in {where}"
        if not spot:
            return f"SSD backed Local Storage{tail}", "LocalSSD", "OnDemand"
        usage = "OnDemand" if _pick(2, "lssd-usage", where) else "Preemptible"
        return (f"SSD backed Local Storage attached to Spot Preemptible VMs{tail}", "LocalSSD",
                usage)
    if kind == "gpu":
        names = next(g[3] for g in GPUS.values() if g[0] == name)
        gpu = names[_pick(len(names), name, where)]
        if not spot:
            return f"{gpu} running in {where}", "GPU", "OnDemand"
        if name == "nvidia-b200":  # some of them tagged OnDemand (skypilot#8125)
            usage = "OnDemand" if _pick(2, "b200-usage", where) else "Preemptible"
            return f"Spot Preemptible {gpu} running in {where}", "GPU", usage
        if _pick(4, "gpu-spot-form", name, where) == 0:  # the few with the prefix
            return f"Spot Preemptible {gpu} running in {where}", "GPU", "Preemptible"
        return (f"{gpu} attached to Spot Preemptible VMs running in {where}", "GPU",
                "Preemptible")
    part = "Core" if kind == "core" else "Ram"
    stem = SERIES_SKU[name]
    usage = "Preemptible" if spot else "OnDemand"
    if name == "n1":
        prefix = ("Preemptible " if _pick(2, "n1-spot-form", where) else
                  "Spot Preemptible ") if spot else ""
        return f"{prefix}{stem} {part} running in {where}", "N1Standard", usage
    group = "CPU" if kind == "core" else "RAM"
    return f"{'Spot Preemptible ' if spot else ''}{stem} {part} running in {where}", group, usage


def _decoys(region: str) -> list[dict[str, Any]]:
    """SKUs an adapter must not take for a VM's price, each priced absurdly."""
    loc = LOCATIONS.get(region, region)
    d = [
        (f"Commitment v1: Nvidia Tesla A100 GPU running in {loc} for 1 Year", "GPU",
         "Commit1Yr", 9.0, "h", "Compute"),
        (f"Commitment v1: A2 Cpu in {loc} for 1 Year", "CPU", "Commit1Yr", 9.0, "h", "Compute"),
        (f"Nvidia Tesla T4 Virtual Workstation GPU running in {loc}", "GPU", "OnDemand", 9.0,
         "h", "Compute"),
        (f"Spot Preemptible Nvidia Tesla T4 Virtual Workstation GPU running in {loc}", "GPU",
         "Preemptible", 9.0, "h", "Compute"),
        (f"Nvidia L4 GPU (DWS Flex Start) running in {loc}", "GPU", "OnDemand", 9.0, "h",
         "Compute"),
        (f"Nvidia Tesla A100 GPU attached to DWS Defined Duration VMs running in {loc}",
         "GPU", "OnDemand", 9.0, "h", "Compute"),
        (f"DWS Defined Duration A2 Core running in {loc}", "CPU", "OnDemand", 9.0, "h",
         "Compute"),
        (f"Reserved Nvidia Tesla A100 80GB GPU in {loc}", "GPU", "OnDemand", 0.0, "h",
         "Compute"),
        (f"Commitment v1: A4 Nvidia B200 (1 gpu slice) in {loc} for 1 Year", "GPU",
         "Commit1Yr", 9.0, "h", "Compute"),
        (f"Commitment v1: Nvidia H100 80GB Mega GPU running in {loc} for 3 Years", "GPU",
         "Commit3Yr", 9.0, "h", "Compute"),
        (f"Nvidia Tesla K80 GPU attached to Spot Preemptible VMs running in {loc}", "GPU",
         "Preemptible", 0.0, "h", "Compute"),
        (f"Spot Preemptible Custom Instance Core running in {loc}", "N1Standard",
         "Preemptible", 0.0, "h", "Compute"),
        (f"TpuV6e attached to Spot Preemptible VMs running in {loc}", "TPU", "Preemptible",
         0.0, "h", "Compute"),
        (f"DWS Defined Duration V6e running in {loc}", "TPU", "OnDemand", 0.0, "h",
         "Compute"),
        (f"Capacity Optimized TpuV6e running in {loc}", "TPU", "OnDemand", 0.0, "h",
         "Compute"),
        (f"Reserved V6e TPU in {loc} in Calendar Mode", "TPU", "OnDemand", 0.0, "h",
         "Compute"),
        (f"Sole Tenancy Instance Core running in {loc}", "CPU", "OnDemand", 9.0, "h", "Compute"),
        (f"Custom Instance Core running in {loc}", "N1Standard", "OnDemand", 9.0, "h",
         "Compute"),
        (f"Custom Extended Instance Ram running in {loc}", "N1Standard", "OnDemand", 9.0,
         "GiBy.h", "Compute"),
        (f"Reserved A2 Instance Core running in {loc}", "CPU", "OnDemand", 9.0, "h", "Compute"),
        (f"A2 Instance Ram running in {loc}", "RAM", "OnDemand", 9.0, "GiBy.mo", "Compute"),
        (f"Storage PD Capacity in {loc}", "PDStandard", "OnDemand", 9.0, "GiBy.mo", "Storage"),
        (f"Network Internet Egress from {loc} to Americas", "PremiumInternetEgress",
         "OnDemand", 9.0, "GiBy", "Network"),
    ]
    return [sku_json(desc, group=g, usage=u, regions=[region], usd=usd, unit=unit, family=f)
            for desc, g, u, usd, unit, f in d]


def _token(op: str, offset: int, query: str) -> str:
    raw = json.dumps({"op": op, "o": offset, "q": query}).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _offset(op: str, token: str, query: str) -> int:
    if not token:
        return 0
    try:
        data = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        if data["op"] != op or data["q"] != query or int(data["o"]) < 0:
            raise ValueError(token)
        return int(data["o"])
    except (ValueError, KeyError, TypeError) as exc:
        raise FakeGCPError(400, f"Invalid value for field 'pageToken': '{token}'.") from exc


class FakeGCP(FakeServer[tuple[str, str]]):
    """Compute Engine + Cloud Billing Catalog behind one local URL (see module doc).

    Attributes a test may read or set: ``url`` (after ``start()``), ``project``,
    ``calls``, ``latency``, ``page_size`` (per op), ``require_auth``,
    ``authorizations``.
    """

    thread_name = "fake-gcp"

    def __init__(self, *, prices_csv: Path = DEFAULT_PRICES_CSV, project: str = PROJECT,
                 seed: int = 7) -> None:
        super().__init__()
        self.project = project
        self.seed = seed
        self.page_size: dict[str, int] = {"machineTypes.list": 10, "acceleratorTypes.list": 3,
                                          "skus.list": 100, "reservations.aggregatedList": 3,
                                          "reservations.list": 3}
        # (zone, name) -> what a reservation is made of (see `add_reservation`)
        self._reservations: dict[tuple[str, str], dict[str, Any]] = {}
        self.require_auth = False
        self.authorizations: list[str] = []
        # (zone, machine type, accelerator or "", model) -> (obtainability, uptime seconds)
        self._advice: dict[tuple[str, str, str, str], tuple[Any, Any]] = {}
        self.advice_denied = False
        self.advice_unsupported: set[str] = set()
        """Machine types advice is refused for with a 400, as the API refuses a shape it
        does not advise on; the other shapes are answered."""
        self.advice_requests: list[dict[str, Any]] = []
        self.token_requests = 0
        self._world = _world(prices_csv)
        self._prices: dict[PriceKey, float] = dict(self._world.prices)
        self._skus: list[dict[str, Any]] | None = None
        self._quotas: dict[str, dict[str, list[float]]] = {}
        for region, zones in self._world.zones.items():
            metrics = {GPUS[g][2] for z in zones for g, _ in self._world.accelerators.get(z, ())}
            q: dict[str, list[float]] = {"CPUS": [2400.0, 0.0], "INSTANCES": [6000.0, 0.0],
                                         "DISKS_TOTAL_GB": [102400.0, 0.0]}
            for m in sorted(metrics):
                q[m] = [16.0, 0.0]
                q[f"PREEMPTIBLE_{m}"] = [16.0, 0.0]
            self._quotas[region] = q
        self._project_quotas: dict[str, list[float]] = {
            "GPUS_ALL_REGIONS": [64.0, 0.0], "CPUS_ALL_REGIONS": [4800.0, 0.0],
            "SNAPSHOTS": [10000.0, 0.0], "NETWORKS": [15.0, 1.0]}
        self._faults: list[_Fault] = []
        self.spare_every: int | None = None  # see the module doc
        self._arrivals: Counter[tuple[str, str]] = Counter()
        self._throttles = 0
        self._gates: dict[str, tuple[asyncio.Event, threading.Event]] = {}
        self._transports: weakref.WeakSet[asyncio.Transport] = weakref.WeakSet()

    # ------------------------------------------------------------- test knobs
    def regions(self) -> list[str]:
        return list(self._world.zones)

    def zones(self, region: str) -> tuple[str, ...]:
        return self._world.zones[region]

    def machine(self, zone: str, name: str) -> tuple[int, int]:
        """(vCPUs, memoryMb) of a machine type the fake lists in `zone`."""
        m = next(m for m in self._world.machines[zone] if m[0] == name)
        return m[1], m[2]

    def unit_price(self, region: str, market: str, kind: str, name: str) -> float | None:
        """The price the catalog holds for `kind` ("core", "ram" per vCPU-h / GiB-h of
        series `name` "a2"/"n1"..., or "gpu" per GPU-h of accelerator type `name`) in
        `region` and `market` ("on_demand"/"spot")."""
        with self._lock:
            return self._prices.get((region, market, kind, name))

    def price_keys(self) -> list[PriceKey]:
        """Every (region, market, kind, name) the catalog holds a price for."""
        with self._lock:
            return sorted(self._prices)

    def set_unit_price(self, region: str, market: str, kind: str, name: str,
                       usd: float | None) -> None:
        """Change (or, with None, drop) one catalog price; a multi-regional SKU it was
        part of splits."""
        with self._lock:
            if usd is None:
                self._prices.pop((region, market, kind, name), None)
            else:
                self._prices[(region, market, kind, name)] = _nanos(usd)
            self._skus = None

    def set_quota(self, region: str, metric: str, limit: float, usage: float = 0.0) -> None:
        with self._lock:
            self._quotas[region][metric] = [float(limit), float(usage)]

    def set_project_quota(self, metric: str, limit: float, usage: float = 0.0) -> None:
        with self._lock:
            self._project_quotas[metric] = [float(limit), float(usage)]

    def add_reservation(self, zone: str, name: str, machine_type: str, count: int, *,
                        in_use: int = 0, accelerators: tuple[tuple[str, int], ...] = (),
                        specific: bool = True, status: str = "READY",
                        delete_at: str | None = None, template: str | None = None,
                        raw: dict[str, Any] | None = None) -> None:
        """A reservation of `count` VMs of `machine_type` (+ `accelerators`, as
        (acceleratorType, count)) in `zone`, `in_use` of them used; `template`: made from
        that instance template instead; `raw`: answered fields overridden by dotted path
        (None: left out)."""
        if zone not in self._world.machines:
            raise ValueError(f"the fake has no zone {zone!r}")
        with self._lock:
            self._reservations[(zone, name)] = {
                "machine_type": machine_type, "count": count, "in_use": in_use,
                "accelerators": tuple(accelerators), "specific": specific, "status": status,
                "delete_at": delete_at, "template": template, "raw": dict(raw or {})}

    def set_capacity_advice(self, zone: str, machine_type: str, model: str, *,
                            obtainability: Any, uptime_seconds: Any = None,
                            accelerator: str = "") -> None:
        """What ``advice.capacity`` answers for `machine_type` (+ attached `accelerator`)
        in `zone` under `model` (``SPOT``/``STANDARD``): `obtainability` and
        ``estimatedUptime`` = `uptime_seconds` s (None leaves a score out; a string is
        answered as given)."""
        with self._lock:
            self._advice[(zone, machine_type, accelerator, model)] = (obtainability,
                                                                      uptime_seconds)

    def capacity_advice(self, zone: str, machine_type: str, model: str,
                        accelerator: str = "") -> tuple[Any, Any]:
        """(obtainability, uptime seconds) answered for a pool (see `set_capacity_advice`;
        unset: a fixed function of the four)."""
        with self._lock:
            found = self._advice.get((zone, machine_type, accelerator, model))
        if found is not None:
            return found
        h = int(hashlib.sha256(f"{zone}|{machine_type}|{accelerator}|{model}".encode())
                .hexdigest(), 16)
        obtainability = round(0.3 + (h % 71) / 100, 2)
        return obtainability, (3600 * (1 + (h >> 8) % 24) if model == "SPOT" else None)

    def set_reservation_in_use(self, zone: str, name: str, in_use: int) -> None:
        with self._lock:
            self._reservations[(zone, name)]["in_use"] = in_use

    def remove_reservation(self, zone: str, name: str) -> None:
        with self._lock:
            del self._reservations[(zone, name)]

    def _reservation_json(self, zone: str, name: str) -> dict[str, Any]:
        r = self._reservations[(zone, name)]
        base = f"{API}/projects/{self.project}"
        specific: dict[str, Any] = {"count": str(r["count"]), "inUseCount": str(r["in_use"]),
                                    "assuredCount": str(r["count"])}
        if r["template"]:
            specific["sourceInstanceTemplate"] = (f"{base}/global/instanceTemplates/"
                                                  f"{r['template']}")
        else:
            props: dict[str, Any] = {"machineType": r["machine_type"]}
            if r["accelerators"]:
                props["guestAccelerators"] = [{"acceleratorType": a, "acceleratorCount": n}
                                              for a, n in r["accelerators"]]
            specific["instanceProperties"] = props
        out: dict[str, Any] = {
            "kind": "compute#reservation", "id": str(int(_sku_id(zone, name)
                                                         .replace("-", ""), 16)),
            "creationTimestamp": CREATED,
            "selfLink": f"{base}/zones/{zone}/reservations/{name}",
            "zone": f"{base}/zones/{zone}", "name": name, "description": "",
            "specificReservation": specific,
            "specificReservationRequired": r["specific"], "status": r["status"],
            "shareSettings": {"shareType": "LOCAL"}, "satisfiesPzs": False}
        if r["delete_at"]:
            out["deleteAtTime"] = r["delete_at"]
        for path, value in r["raw"].items():
            *parents, leaf = path.split(".")
            node = out
            for part in parents:
                node = node.setdefault(part, {})
            if value is None:
                node.pop(leaf, None)
            else:
                node[leaf] = value
        return out

    def fail(self, op: str, status: int = 429, times: int | None = 1, *,
             where: str | None = None, reason: str | None = None,
             message: str | None = None, retry_after: float | None = None) -> None:
        """Make the next ``times`` calls of ``op`` (``regions.get``, ``skus.list`` ...;
        ``None`` times: all, until ``clear_faults()``) answer HTTP ``status`` with
        Google's error body (``reason`` defaults by status: 429 rateLimitExceeded,
        503 backendError, 403 forbidden ...). ``where`` narrows to a region, its zones
        or one zone."""
        text = message or {429: "Quota exceeded for quota metric 'Read requests' and limit "
                                "'Read requests per minute' of service "
                                "'compute.googleapis.com'.",
                           503: "The service is currently unavailable.",
                           403: "Required permission denied."}.get(status, "fake failure")
        with self._lock:
            self._faults.append(_Fault(op, where, status, reason, text, retry_after, times))

    def hold(self, op: str) -> threading.Event:
        """Hold every call of `op` until `release(op)`; the returned event is set once a
        call is being held (wait for it with ``await asyncio.to_thread(ev.wait, 10)``)."""
        with self._lock:
            gate = self._gates.setdefault(op, (asyncio.Event(), threading.Event()))
        return gate[1]

    def release(self, op: str | None = None) -> None:
        """Let the held calls of `op` (of every op if None) through, and stop holding."""
        with self._lock:
            ops = [op] if op is not None else list(self._gates)
            gates = [self._gates.pop(o) for o in ops if o in self._gates]
        if self._loop is not None:
            for opened, _ in gates:
                self._loop.call_soon_threadsafe(opened.set)

    def reset_calls(self) -> None:
        with self._lock:
            super().reset_calls()
            self.authorizations.clear()

    def call_count(self, op: str | None = None, region: str | None = None) -> int:
        with self._lock:
            return sum(n for (o, w), n in self.calls.items()
                       if (op is None or o == op) and (region is None or _within(w, region)))

    def service_account_file(self, path: Path, project_id: str | None = None) -> Path:
        """Write a service-account key file whose token endpoint is this fake (for
        GOOGLE_APPLICATION_CREDENTIALS); its project is `project_id` (none if None)."""
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption()).decode()
        info: dict[str, Any] = {
            "type": "service_account", "private_key_id": "fake-key-1", "private_key": pem,
            "client_email": f"broker@{project_id or 'fake'}.iam.gserviceaccount.com",
            "client_id": "1234567890", "token_uri": f"{self.url}/token"}
        if project_id is not None:
            info["project_id"] = project_id
        path.write_text(json.dumps(info))
        return path

    # ------------------------------------------------------------ lifecycle
    def _application(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/compute/v1/projects/{project}", self._project)
        app.router.add_get("/compute/v1/projects/{project}/regions/{region}", self._region)
        app.router.add_get("/compute/v1/projects/{project}/zones/{zone}/machineTypes",
                           self._machine_types)
        app.router.add_get("/compute/v1/projects/{project}/zones/{zone}/acceleratorTypes",
                           self._accelerator_types)
        app.router.add_get("/compute/v1/projects/{project}/aggregated/reservations",
                           self._aggregated_reservations)
        app.router.add_get("/compute/v1/projects/{project}/zones/{zone}/reservations",
                           self._zone_reservations)
        app.router.add_get("/compute/v1/projects/{project}/zones/{zone}/reservations/{name}",
                           self._reservation)
        app.router.add_post("/compute/v1/projects/{project}/regions/{region}/advice/capacity",
                            self._capacity_advice)
        app.router.add_get("/v1/services/{service}/skus", self._list_skus)
        app.router.add_post("/token", self._oauth_token)
        return app  # everything else: `_handle`, a 404

    async def _astop(self) -> None:
        await super()._astop()
        # A transport closed with unsent data waits for its peer to read it: abort what
        # is left, then take the loop turn in which an aborted transport closes its socket
        # (else the sockets leak, and warn when collected).
        for transport in list(self._transports):
            transport.abort()
        await asyncio.sleep(0)

    def stop(self) -> None:
        self.release()
        super().stop()

    # ------------------------------------------------------------- serving
    async def _serve(self, request: web.Request, op: str, where: str, answer: Any,
                     ) -> web.Response:
        """Count, delay, authenticate, inject faults, then answer (or raise)."""
        billing = op == "skus.list"
        auth = request.headers.get("Authorization", "")
        if request.transport is not None:
            self._transports.add(request.transport)
        with self._lock:
            self.calls[(op, where)] += 1
            self.authorizations.append(auth)
            gate = self._gates.get(op)
        if gate is not None:
            gate[1].set()
            await gate[0].wait()
        await self._delay()
        try:
            if self.require_auth and not auth.startswith("Bearer "):
                raise FakeGCPError(401, "Request is missing required authentication "
                                        "credential. Expected OAuth 2 access token.",
                                   reason="required")
            fault = self._take_fault(op, where)
            if fault is not None:
                raise fault
            if request.match_info.get("project", self.project) != self.project:
                raise FakeGCPError(404, f"The resource 'projects/"
                                        f"{request.match_info['project']}' was not found")
            return web.json_response(answer())
        except FakeGCPError as err:
            return _error(err, billing)

    def _take_fault(self, op: str, where: str) -> FakeGCPError | None:
        f = self._take(self._faults, lambda f: f.op == op and (f.where is None
                                                               or _within(where, f.where)))
        return None if f is None else FakeGCPError(f.status, f.message, f.reason,
                                                   f.retry_after)

    # ---------------------------------------------------------- random faults
    def _chaos_applies(self, request: web.Request) -> bool:
        if request.path == "/token":
            return False  # google-auth's, which retries a token grant on its own
        if self.spare_every is None:
            return True
        with self._lock:
            key = (request.method, request.path_qs)
            self._arrivals[key] += 1
            return self._arrivals[key] % self.spare_every != 0

    def _count(self, request: web.Request) -> bool:
        """Count a call the chaos middleware answers itself; whether it is a Billing one."""
        match = request.match_info
        if request.path.startswith("/v1/services/"):
            op, where = "skus.list", "global"
        elif request.path.endswith("/aggregated/reservations"):
            op, where = "reservations.aggregatedList", "global"
        elif "name" in match:
            op, where = "reservations.get", match["zone"]
        elif request.path.endswith("/advice/capacity"):
            op, where = "advice.capacity", match["region"]
        elif "zone" in match:
            op, where = f"{request.path.rsplit('/', 1)[-1]}.list", match["zone"]
        elif "region" in match:
            op, where = "regions.get", match["region"]
        else:
            op, where = "projects.get", "global"
        with self._lock:
            self.calls[(op, where)] += 1
            self.authorizations.append(request.headers.get("Authorization", ""))
        return op == "skus.list"

    def _throttled(self, request: web.Request) -> web.StreamResponse:
        if self._count(request):  # the Billing Catalog: AIP-193's shape
            return _error(FakeGCPError(
                429, "Quota exceeded for quota metric 'Read requests' and limit 'Read "
                     "requests per minute' of service 'cloudbilling.googleapis.com' for "
                     "consumer 'project_number:4711471147114711'.",
                reason="RATE_LIMIT_EXCEEDED", retry_delay="1s"), True)
        with self._lock:
            self._throttles += 1
            legacy = self._throttles % 2 == 1
        if legacy:  # Compute Engine's documented answer
            return _error(FakeGCPError(403, "Rate Limit Exceeded", reason="rateLimitExceeded",
                                       domain="usageLimits", legacy=True), False)
        return _error(FakeGCPError(
            429, "Quota exceeded for quota metric 'Read requests' and limit 'Read requests "
                 "per minute' of service 'compute.googleapis.com' for consumer "
                 "'project_number:4711471147114711'.", reason="rateLimitExceeded",
            domain="usageLimits"), False)

    def _server_error(self, request: web.Request, status: int) -> web.StreamResponse:
        billing = self._count(request)
        message = ("The service is currently unavailable." if status == 503 else
                   "Internal error. Please try again or contact Google Support. "
                   "(Code: '-4711471147114711')")
        return _error(FakeGCPError(status, message, reason="backendError"), billing)

    async def _project(self, request: web.Request) -> web.Response:
        def answer() -> dict[str, Any]:
            with self._lock:
                quotas = [{"metric": m, "limit": lim, "usage": use}
                          for m, (lim, use) in self._project_quotas.items()]
            return {"kind": "compute#project", "id": "4711471147114711",
                    "creationTimestamp": CREATED, "name": self.project,
                    "commonInstanceMetadata": {"kind": "compute#metadata",
                                               "fingerprint": "nNp3kGGbmRE="},
                    "quotas": quotas, "selfLink": f"{API}/projects/{self.project}",
                    "defaultServiceAccount": "4711-compute@developer.gserviceaccount.com",
                    "xpnProjectStatus": "UNSPECIFIED_XPN_PROJECT_STATUS",
                    "defaultNetworkTier": "PREMIUM", "vmDnsSetting": "ZONAL_ONLY"}

        return await self._serve(request, "projects.get", "global", answer)

    async def _region(self, request: web.Request) -> web.Response:
        region = request.match_info["region"]

        def answer() -> dict[str, Any]:
            if region not in self._world.zones:
                raise FakeGCPError(404, f"The resource 'projects/{self.project}/regions/"
                                        f"{region}' was not found")
            with self._lock:
                quotas = [{"metric": m, "limit": lim, "usage": use}
                          for m, (lim, use) in self._quotas[region].items()]
            base = f"{API}/projects/{self.project}"
            return {"kind": "compute#region", "id": str(1000 + self.regions().index(region)),
                    "creationTimestamp": CREATED, "name": region, "description": region,
                    "status": "UP", "quotas": quotas,
                    "zones": [f"{base}/zones/{z}" for z in self._world.zones[region]],
                    "selfLink": f"{base}/regions/{region}", "supportsPzs": False}

        return await self._serve(request, "regions.get", region, answer)

    def _zone_or_error(self, zone: str) -> None:
        if zone not in self._world.machines:
            raise FakeGCPError(400, f"Invalid value for field 'zone': '{zone}'. Unknown zone.")

    async def _machine_types(self, request: web.Request) -> web.Response:
        zone = request.match_info["zone"]
        op = "machineTypes.list"

        def answer() -> dict[str, Any]:
            self._zone_or_error(zone)
            flt = request.query.get("filter", "")
            items = [_machine_json(self.project, zone, m) for m in self._world.machines[zone]
                     if _matches(flt, m[0])]
            return self._page(op, zone, "compute#machineTypeList", "machineTypes", items,
                              request, flt)

        return await self._serve(request, op, zone, answer)

    async def _accelerator_types(self, request: web.Request) -> web.Response:
        zone = request.match_info["zone"]
        op = "acceleratorTypes.list"

        def answer() -> dict[str, Any]:
            self._zone_or_error(zone)
            items = []
            for gpu, most in self._world.accelerators.get(zone, ()):
                accel, desc = GPUS[gpu][0], GPUS[gpu][1]
                items.append(_accel_json(self.project, zone, accel, desc, most))
                if gpu in ("T4", "P4", "P100"):
                    items.append(_accel_json(self.project, zone, f"{accel}-vws",
                                             f"{desc} Virtual Workstation", most))
                if gpu == "P100":
                    items.append(_accel_json(self.project, zone, "nvidia-tesla-k80",
                                             "NVIDIA K80", 8, deprecated="OBSOLETE"))
            return self._page(op, zone, "compute#acceleratorTypeList", "acceleratorTypes",
                              items, request, "")

        return await self._serve(request, op, zone, answer)

    async def _capacity_advice(self, request: web.Request) -> web.Response:
        region = request.match_info["region"]
        try:
            body = await request.json()
        except ValueError:
            body = None
        zones = [str(z.get("zone", "")).rstrip("/").rsplit("/", 1)[-1]
                 for z in ((body or {}).get("distributionPolicy") or {}).get("zones") or ()
                 if isinstance(z, dict)] if isinstance(body, dict) else []
        where = zones[0] if len(zones) == 1 else region

        def answer() -> dict[str, Any]:
            if self.advice_denied:
                raise FakeGCPError(403, f"Required 'compute.advice.capacity' permission for "
                                        f"'projects/{self.project}'", reason="forbidden")
            if not isinstance(body, dict):
                raise FakeGCPError(400, "Invalid JSON payload received.")
            with self._lock:
                self.advice_requests.append(body)
            return self._advice_answer(region, zones, body)

        return await self._serve(request, "advice.capacity", where, answer)

    def _advice_answer(self, region: str, zones: list[str], body: dict[str, Any]
                       ) -> dict[str, Any]:
        if region not in self._world.zones:
            raise FakeGCPError(404, f"The resource 'projects/{self.project}/regions/{region}'"
                                    " was not found")
        if len(zones) != 1 or zones[0] not in self._world.zones[region]:
            raise FakeGCPError(400, "Invalid value for field 'distributionPolicy.zones': the "
                                    f"fake answers about one zone of {region}, got {zones}.")
        zone = zones[0]
        model = (((body.get("instanceProperties") or {}).get("scheduling") or {})
                 .get("provisioningModel"))
        if model not in ("SPOT", "STANDARD"):
            raise FakeGCPError(400, f"Invalid value for field 'instanceProperties.scheduling"
                                    f".provisioningModel': '{model}'.")
        size = body.get("size")
        if not isinstance(size, int) or size < 1:
            raise FakeGCPError(400, f"Invalid value for field 'size': '{size}'.")
        selections = ((body.get("instanceFlexibilityPolicy") or {})
                      .get("instanceSelections") or {})
        if len(selections) != 1:
            raise FakeGCPError(400, "The fake answers about one instance selection.")
        selection = next(iter(selections.values()))
        machines = selection.get("machineTypes") or []
        names = {m[0] for m in self._world.machines[zone]}
        if machines and machines[0] in self.advice_unsupported:
            raise FakeGCPError(400, f"Invalid value for field 'machineTypes': {machines}: "
                                    "capacity advice is not supported for this machine type.")
        if len(machines) != 1 or machines[0] not in names:
            raise FakeGCPError(400, f"Invalid value for field 'machineTypes': {machines}: "
                                    f"not a machine type of {zone}.")
        accels = selection.get("guestAccelerators") or []
        accelerator = ""
        if accels:
            attachable = {GPUS[g][0]: most for g, most in self._world.accelerators.get(zone, ())}
            a = accels[0]
            accelerator = str(a.get("acceleratorType", "")).rsplit("/", 1)[-1]
            count = a.get("acceleratorCount")
            if (len(accels) != 1 or accelerator not in attachable or not isinstance(count, int)
                    or not 1 <= count <= attachable[accelerator]):
                raise FakeGCPError(400, f"Invalid value for field 'guestAccelerators': "
                                        f"{accels}.")
        obtainability, uptime = self.capacity_advice(zone, machines[0], model, accelerator)
        scores: dict[str, Any] = {}
        if obtainability is not None:
            scores["obtainability"] = obtainability
        if uptime is not None and model == "SPOT":
            scores["estimatedUptime"] = uptime if isinstance(uptime, str) else f"{uptime}s"
        return {"recommendations": [{"scores": scores, "shards": [
            {"zone": zone, "machineType": machines[0], "provisioningModel": model,
             "instanceCount": size}]}]}

    def _no_filter(self, request: web.Request) -> None:
        if request.query.get("filter"):
            raise FakeGCPError(400, "Invalid value for field 'filter': the fake takes no "
                                    "filter on reservations.")

    async def _aggregated_reservations(self, request: web.Request) -> web.Response:
        op = "reservations.aggregatedList"

        def answer() -> dict[str, Any]:
            self._no_filter(request)
            size = min(_bounded(request, "maxResults", 500), self.page_size[op])
            start = _offset(op, request.query.get("pageToken", ""), "")
            end = start + max(size, 1)
            with self._lock:
                keys = sorted(self._reservations)
                page = [(z, self._reservation_json(z, n)) for z, n in keys[start:end]]
            items: dict[str, Any] = {}
            for zone in sorted(self._world.machines):
                found = [r for z, r in page if z == zone]
                items[f"zones/{zone}"] = {"reservations": found} if found else {"warning": {
                    "code": "NO_RESULTS_ON_PAGE",
                    "message": f"There are no results for scope 'zones/{zone}' on this page.",
                    "data": [{"key": "scope", "value": f"zones/{zone}"}]}}
            out: dict[str, Any] = {
                "kind": "compute#reservationAggregatedList",
                "id": f"projects/{self.project}/aggregated/reservations", "items": items,
                "selfLink": f"{API}/projects/{self.project}/aggregated/reservations"}
            if end < len(keys):
                out["nextPageToken"] = _token(op, end, "")
            return out

        return await self._serve(request, op, "global", answer)

    async def _zone_reservations(self, request: web.Request) -> web.Response:
        zone = request.match_info["zone"]
        op = "reservations.list"

        def answer() -> dict[str, Any]:
            self._zone_or_error(zone)
            self._no_filter(request)
            with self._lock:
                items = [self._reservation_json(z, n) for z, n in sorted(self._reservations)
                         if z == zone]
            return self._page(op, zone, "compute#reservationList", "reservations", items,
                              request, "")

        return await self._serve(request, op, zone, answer)

    async def _reservation(self, request: web.Request) -> web.Response:
        zone, name = request.match_info["zone"], request.match_info["name"]

        def answer() -> dict[str, Any]:
            self._zone_or_error(zone)
            with self._lock:
                if (zone, name) not in self._reservations:
                    raise FakeGCPError(404, f"The resource 'projects/{self.project}/zones/"
                                            f"{zone}/reservations/{name}' was not found")
                return self._reservation_json(zone, name)

        return await self._serve(request, "reservations.get", zone, answer)

    def _page(self, op: str, zone: str, kind: str, collection: str, items: list[Any],
              request: web.Request, query: str) -> dict[str, Any]:
        size = min(_bounded(request, "maxResults", 500), self.page_size[op])
        start = _offset(op, request.query.get("pageToken", ""), query)
        end = start + max(size, 1)
        out: dict[str, Any] = {
            "kind": kind, "id": f"projects/{self.project}/zones/{zone}/{collection}",
            "items": items[start:end],
            "selfLink": f"{API}/projects/{self.project}/zones/{zone}/{collection}"}
        if end < len(items):
            out["nextPageToken"] = _token(op, end, query)
        return out

    async def _list_skus(self, request: web.Request) -> web.Response:
        op = "skus.list"

        def answer() -> dict[str, Any]:
            if request.match_info["service"] != COMPUTE_SERVICE:
                raise FakeGCPError(404, f"Service {request.match_info['service']} not found.")
            skus = self.skus()
            size = min(_bounded(request, "pageSize", 5000), self.page_size[op])
            start = _offset(op, request.query.get("pageToken", ""), "")
            end = start + max(size, 1)
            return {"skus": skus[start:end],
                    "nextPageToken": _token(op, end, "") if end < len(skus) else ""}

        return await self._serve(request, op, "global", answer)

    def skus(self) -> list[dict[str, Any]]:
        """Every SKU the catalog lists, in the order it lists them."""
        with self._lock:
            if self._skus is None:
                self._skus = self._build_skus()
            return self._skus

    def _build_skus(self) -> list[dict[str, Any]]:
        by_what: dict[tuple[str, str, str, float], list[str]] = defaultdict(list)
        for (region, market, kind, name), usd in self._prices.items():
            by_what[(market, kind, name, usd)].append(region)
        skus: list[dict[str, Any]] = []
        for (market, kind, name, usd), regions in by_what.items():
            shared = sorted(r for r in regions if r in AMERICAS)
            if len(shared) == len(AMERICAS):
                skus.append(_price_sku(*_describe(market, kind, name, "Americas"), kind,
                                       shared, usd))
            for region in sorted(regions):
                if len(shared) == len(AMERICAS) and region in AMERICAS:
                    continue
                skus.append(_price_sku(*_describe(market, kind, name,
                                                  LOCATIONS.get(region, region)),
                                       kind, [region], usd))
        for region in DECOY_REGIONS:
            skus.extend(_decoys(region))
        skus.append(sku_json("Licensing Fee for Windows Server 2022 Datacenter Edition "
                             "(CPU cost)", group="CPU", usage="OnDemand", regions=["global"],
                             usd=9.0, family="License"))
        random.Random(self.seed).shuffle(skus)
        return skus

    async def _oauth_token(self, request: web.Request) -> web.Response:
        with self._lock:
            self.token_requests += 1
        return web.json_response({"access_token": "ya29.fake-access-token",
                                  "expires_in": 3600, "token_type": "Bearer"})

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        return _error(FakeGCPError(404, f"The requested URL {request.path} was not found "
                                        "on this server (fake)."), False)


def _price_sku(desc: str, group: str, usage: str, kind: str, regions: list[str],
               usd: float) -> dict[str, Any]:
    if kind == "lssd":
        return sku_json(desc, group=group, usage=usage, regions=regions, usd=usd,
                        unit="GiBy.mo", family="Storage")
    return sku_json(desc, group=group, usage=usage, regions=regions, usd=usd,
                    unit="GiBy.h" if kind == "ram" else "h")


def _bounded(request: web.Request, param: str, most: int) -> int:
    """A page-size parameter in [0, most] as the APIs check it; 0 or absent: `most`."""
    raw = request.query.get(param, str(most))
    if not raw.isdigit() or not 0 <= int(raw) <= most:
        raise FakeGCPError(400, f"Invalid value for field '{param}': '{raw}'. Must be in the "
                                f"range [0, {most}].")
    return int(raw) or most


def _within(where: str, region: str) -> bool:
    return where == region or where.startswith(f"{region}-")


def _matches(flt: str, name: str) -> bool:
    if not flt:
        return True
    m = _FILTER.match(flt)
    if m is None:
        raise FakeGCPError(400, f"Invalid value for field 'filter': '{flt}'. Invalid list "
                                "filter expression.")
    pattern = next(g for g in m.groups()[1:] if g is not None)
    hit = re.fullmatch(pattern, name) is not None
    return hit if m.group(1) == "eq" else not hit


def _machine_json(project: str, zone: str, m: tuple[str, int, int, str | None, int]
                  ) -> dict[str, Any]:
    name, vcpus, mib, accel, gpus = m
    out: dict[str, Any] = {
        "kind": "compute#machineType", "id": str(int(_sku_id(name).replace("-", ""), 16)),
        "creationTimestamp": CREATED, "name": name,
        "description": f"{vcpus} vCPUs, {mib / 1024:g} GB RAM", "guestCpus": vcpus,
        "memoryMb": mib, "imageSpaceGb": 0, "maximumPersistentDisks": 128,
        "maximumPersistentDisksSizeGb": "263168", "zone": zone,
        "selfLink": f"{API}/projects/{project}/zones/{zone}/machineTypes/{name}",
        "isSharedCpu": False, "architecture": "X86_64"}
    if accel:
        out["accelerators"] = [{"guestAcceleratorType": accel, "guestAcceleratorCount": gpus}]
    return out


def _accel_json(project: str, zone: str, name: str, desc: str, most: int,
                deprecated: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "kind": "compute#acceleratorType", "id": str(int(_sku_id(name).replace("-", ""), 16)),
        "creationTimestamp": CREATED, "name": name, "description": desc,
        "zone": f"{API}/projects/{project}/zones/{zone}",
        "selfLink": f"{API}/projects/{project}/zones/{zone}/acceleratorTypes/{name}",
        "maximumCardsPerInstance": most}
    if deprecated:
        out["deprecated"] = {"state": deprecated}
    return out


def _error(err: FakeGCPError, billing: bool) -> web.Response:
    """Google's JSON error body. Compute Engine adds the legacy `errors[]` list (and its
    older answers, `legacy`, have nothing else)."""
    status = STATUS.get(err.status, ("unknown", "UNKNOWN"))[1]
    body: dict[str, Any] = {"code": err.status, "message": err.message}
    if not billing:
        body["errors"] = [{"message": err.message, "domain": err.domain, "reason": err.reason}]
    if err.legacy:
        return web.json_response({"error": body}, status=err.status)
    body["status"] = status
    info_reason = (err.reason if err.reason.isupper()
                   else re.sub(r"(?<!^)(?=[A-Z])", "_", err.reason).upper())
    body["details"] = [{"@type": "type.googleapis.com/google.rpc.ErrorInfo",
                        "reason": info_reason, "domain": "googleapis.com",
                        "metadata": {"service": ("cloudbilling" if billing else "compute")
                                     + ".googleapis.com"}}]
    if err.retry_delay is not None:
        body["details"].append({"@type": "type.googleapis.com/google.rpc.RetryInfo",
                                "retryDelay": err.retry_delay})
    headers = {}
    if err.retry_after is not None:
        headers["Retry-After"] = f"{err.retry_after:g}"
    return web.json_response({"error": body}, status=err.status, headers=headers)


@pytest.fixture(name="fake_gcp")
def fake_gcp_fixture(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeGCP]:
    """A running FakeGCP, with google.auth kept away from this machine's own credentials:
    no GOOGLE_APPLICATION_CREDENTIALS (a test that wants ADC sets it), an empty gcloud
    config directory, no project in the environment."""
    for var in ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT", "GCLOUD_PROJECT",
                "CLOUDSDK_CORE_PROJECT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    with contextlib.ExitStack() as stack:
        yield stack.enter_context(FakeGCP())
