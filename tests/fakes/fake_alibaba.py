"""A fake Alibaba Cloud ECS API on one local URL, for driving the real Tea SDK
(`alibabacloud-ecs20140526`) against it.

The ECS API is RPC-style. The installed SDK (alibabacloud-tea-openapi ≥ 0.4) sends every
call as ``POST /`` with the parameters in the query string (lists flattened as
``InstanceTypes.1=...``, objects as ``SystemDisk.Category=...``), the operation in the
``x-acs-action`` header, the version (``2014-05-26``) in ``x-acs-version`` and an
``Authorization: ACS3-HMAC-SHA256 Credential=<key id>,SignedHeaders=...,Signature=...``
header. The fake answers by ``x-acs-action`` (or, for older SDKs, an ``Action`` query
or form parameter), with JSON bodies in the real shapes (PascalCase, lists wrapped in
their singular: ``InstanceTypes.InstanceType[]``), and errors as Alibaba sends them:
``{"RequestId", "HostId", "Code", "Message", "Recommend"}`` with a 4xx/5xx status.

Served: ``DescribeInstanceTypes`` (``MaxResults`` / ``NextToken`` pages,
``MinimumGPUAmount``, ``InstanceTypes.N``, ``InstanceTypeFamily``),
``DescribeAvailableResource`` (``DestinationResource=InstanceType``, by
``InstanceChargeType`` / ``SpotStrategy``, ``ZoneId``, ``InstanceType``; no paging, like
the real one), ``DescribeSpotPriceHistory`` (one ``InstanceType``, ``NetworkType``,
``OSType``, ``ZoneId``, ``StartTime`` / ``EndTime``, ``Offset`` / ``NextOffset`` pages),
``DescribePrice`` (``ResourceType=instance``, pay-as-you-go, itemised ``DetailInfos``),
``DescribeSpotAdvice`` (``InstanceTypes.N`` ≤ 10, ``ZoneId``) and
``DescribeAccountAttributes`` (``AttributeName.N``). Anything else answers
``InvalidAction.NotFound``.

The data are plausible, not Alibaba's: 16 GPU instance types (T4, V100 16/32 GB, A10,
A100 40/80 GB, L20, H20, A800, P100 and a vGPU slice of a T4) plus three non-GPU types,
with made-up but realistic pay-as-you-go list prices in CNY (the China site's currency;
``currency="USD"`` serves the same prices converted at ``USD_PER_CNY``, as the
international site would), in five regions. Which zone sells which type in which
market, its stock status, spot discounts and release rates are drawn from ``seed``;
tests read them back (``stock``, ``spot_price``, ``on_demand_price`` ...) or pin them
(``set_stock``, ``set_spot_price``, ``set_release_rate``, ``set_attribute`` ...).

Spot price history: per spot pool, a point every 3 hours over the last day (the newest
at the last full hour before the fake was built, ``snapshot_time``); ``set_spot_price``
adds points. The points are for ``SpotDuration=1`` (one hour of protection, Alibaba's
default when the parameter is left out); ``SpotDuration=0`` (none) answers each price
``NO_PROTECTION_FACTOR`` times as much, so a client that asks for the wrong protection
period reads another price. Any other ``SpotDuration`` is ``InvalidParameter``, in
``DescribeAvailableResource`` too (which serves the same stock for 0 and 1). A query
returns the points with StartTime ≤ Timestamp ≤ EndTime, oldest first,
``page_size["DescribeSpotPriceHistory"]`` per page; ``NextOffset`` is the offset of the
next page, or 0 after the last one.

Credentials: the fake reads the access key id from the ``Authorization`` header and
counts it in ``key_ids``. Keys in ``access_keys`` (id → secret) have their ACS3-HMAC-SHA256
signature checked (``SignatureDoesNotMatch`` when wrong); other key ids are accepted
unchecked unless ``accept_unknown_keys`` is False (``InvalidAccessKeyId.NotFound``); ids
in ``revoked_keys`` always get ``InvalidAccessKeyId.NotFound``.

Every call is counted in ``calls`` (a Counter of ``(action, region)``; region is the
``RegionId`` parameter, ``""`` for ``DescribeInstanceTypes``, which has none), can be
delayed by ``latency = (lo, hi)`` seconds (an ``asyncio.sleep`` in the handler: calls
stay concurrent) and failed with ``fail(...)`` in Alibaba's error shape (throttling,
5xx, stock-out, auth, quota codes, with an optional ``x-acs-retry-after``).

Random faults (``chaos = Chaos(...)``, `fake_server`) answer as Alibaba does: a throttle is
``Throttling.User`` (HTTP 400, with ``x-acs-retry-after: chaos_retry_after_ms``, which the
Tea SDK turns into a ``ThrottlingException``), ``Throttling.Api`` (HTTP 400, no hint) or
``Throttling`` (HTTP 429, no hint), in turn; a 5xx is ``InternalError`` (500) or
``ServiceUnavailable`` (503); all in the JSON error shape above. ``chaos_spare_after = n``
bounds the bad luck of one request: the same call (action and parameters) repeated
within ``chaos_window`` seconds of its first try is spared from its (n+1)-th try on, so
that a client that retries at least n times always gets through (tests that compare
offers exactly; None, the default: every call takes its chances).

Usage::

    from fake_alibaba import fake_alibaba_fixture  # noqa: F401 (the ``fake_alibaba`` fixture)

    def test_x(fake_alibaba):
        ecs = fake_alibaba.client("cn-hangzhou")  # a real Tea ECS client on the fake

or without pytest: ``with FakeAlibaba() as fake: ...`` (``start()``/``stop()`` also work).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import random
import re
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Self
from urllib.parse import parse_qsl, quote

import pytest
from aiohttp import web
from fake_server import FakeServer

API_VERSION = "2014-05-26"
USD_PER_CNY = 0.14  # the fake's own rate for its USD ("international site") answers
SYSTEM_DISK_CNY_PER_HOUR = 0.0417  # the default 40 GiB system disk DescribePrice adds
NO_PROTECTION_FACTOR = 0.85  # a SpotDuration=0 spot price against the 1-hour one (invented)


@dataclass(frozen=True)
class InstanceType:
    name: str
    family: str
    vcpus: int
    memory_gib: float
    gpus: int
    gpu_spec: str
    gpu_memory_gib: float
    cny_per_hour: float  # pay-as-you-go list price, China site, cn-* regions
    category: str = "Compute-optimized with GPU"


CATALOG: tuple[InstanceType, ...] = (
    InstanceType("ecs.gn6i-c4g1.xlarge", "ecs.gn6i", 4, 15, 1, "NVIDIA T4", 16, 11.75),
    InstanceType("ecs.gn6i-c8g1.2xlarge", "ecs.gn6i", 8, 31, 1, "NVIDIA T4", 16, 13.75),
    InstanceType("ecs.gn6i-c24g1.24xlarge", "ecs.gn6i", 96, 372, 4, "NVIDIA T4", 16, 62.48),
    InstanceType("ecs.gn6v-c8g1.2xlarge", "ecs.gn6v", 8, 32, 1, "NVIDIA V100", 16, 26.46),
    InstanceType("ecs.gn6v-c8g1.16xlarge", "ecs.gn6v", 64, 256, 8, "NVIDIA V100", 16, 211.68),
    InstanceType("ecs.gn6e-c12g1.3xlarge", "ecs.gn6e", 12, 92, 1, "NVIDIA V100", 32, 31.58),
    InstanceType("ecs.gn7i-c8g1.2xlarge", "ecs.gn7i", 8, 30, 1, "NVIDIA A10", 24, 13.92),
    InstanceType("ecs.gn7i-c16g1.4xlarge", "ecs.gn7i", 16, 60, 1, "NVIDIA A10", 24, 15.95),
    InstanceType("ecs.gn7i-c32g1.32xlarge", "ecs.gn7i", 128, 752, 4, "NVIDIA A10", 24, 79.50),
    InstanceType("ecs.gn7-c12g1.3xlarge", "ecs.gn7", 12, 94, 1, "NVIDIA A100", 40, 34.74),
    InstanceType("ecs.gn7e-c16g1.4xlarge", "ecs.gn7e", 16, 125, 1, "NVIDIA A100", 80, 39.62),
    InstanceType("ecs.gn7e-c16g1.32xlarge", "ecs.gn7e", 128, 1000, 8, "NVIDIA A100", 80,
                 316.96),
    InstanceType("ecs.gn8is-2x.8xlarge", "ecs.gn8is", 32, 256, 2, "NVIDIA L20", 48, 45.60),
    InstanceType("ecs.gn8v-8x.48xlarge", "ecs.gn8v", 192, 1024, 8, "NVIDIA H20", 96, 238.00),
    InstanceType("ecs.ebmgn7ex.32xlarge", "ecs.ebmgn7ex", 128, 1024, 8, "NVIDIA A800", 80,
                 300.00, "ECS Bare Metal Instance"),
    InstanceType("ecs.gn5-c4g1.xlarge", "ecs.gn5", 4, 30, 1, "NVIDIA P100", 16, 12.50),
    InstanceType("ecs.vgn6i-m4.xlarge", "ecs.vgn6i", 4, 23, 1, "NVIDIA T4", 4, 4.30,
                 "Visual Compute-optimized"),
    # Not GPU types: GPUAmount 0 (the FPGA type too).
    InstanceType("ecs.g7.large", "ecs.g7", 2, 8, 0, "", 0, 0.58, "General-purpose"),
    InstanceType("ecs.c7.xlarge", "ecs.c7", 4, 8, 0, "", 0, 0.98, "Compute-optimized"),
    InstanceType("ecs.f3-c4f1.xlarge", "ecs.f3", 4, 16, 0, "", 0, 9.80,
                 "Compute-optimized with FPGA"),
)
TYPES = {t.name: t for t in CATALOG}

REGIONS: dict[str, tuple[str, ...]] = {
    "cn-hangzhou": ("cn-hangzhou-h", "cn-hangzhou-i", "cn-hangzhou-j", "cn-hangzhou-k"),
    "cn-beijing": ("cn-beijing-g", "cn-beijing-h", "cn-beijing-i", "cn-beijing-l"),
    "cn-shanghai": ("cn-shanghai-e", "cn-shanghai-f", "cn-shanghai-g"),
    "ap-southeast-1": ("ap-southeast-1a", "ap-southeast-1b", "ap-southeast-1c"),
    "us-west-1": ("us-west-1a", "us-west-1b"),
}
REGION_PRICE_FACTOR = {"ap-southeast-1": 1.12, "us-west-1": 1.2}  # others 1.0

STOCK_CATEGORIES = ("WithStock", "ClosedWithStock", "WithoutStock", "ClosedWithoutStock")
_STATUS = {"WithStock": "Available", "ClosedWithStock": "Available",
           "WithoutStock": "SoldOut", "ClosedWithoutStock": "SoldOut"}
RATE_BANDS = (("0-3%", 3.0), ("3-5%", 5.0), ("5-10%", 10.0), ("10-100%", 100.0))

QUOTA_DEFAULTS: dict[str, str] = {
    "max-postpaid-instance-vcpu-count": "800",
    "used-postpaid-instance-vcpu-count": "48",
    "max-spot-instance-vcpu-count": "800",
    "used-spot-instance-vcpu-count": "0",
    "max-security-groups": "100",
    "max-elastic-network-interfaces": "100",
    "instance-network-type": "vpc",
    "real-name-authentication": "yes",
}

# Error code -> (HTTP status, message), as Alibaba answers them.
ERRORS: dict[str, tuple[int, str]] = {
    "Throttling": (400, "Request was denied due to request throttling."),
    "Throttling.User": (400, "Request was denied due to user flow control."),
    "Throttling.Api": (400, "Request was denied due to api flow control."),
    "ServiceUnavailable": (503, "The request has failed due to a temporary failure of the "
                                "server."),
    "InternalError": (500, "The request processing has failed due to some unknown error, "
                           "exception or failure."),
    "OperationDenied.NoStock": (403, "The requested resource is sold out in the specified "
                                     "zone; try other types of resources or other regions "
                                     "and zones."),
    "Forbidden.RAM": (403, "User not authorized to operate on the specified resource, or "
                           "this API doesn't support RAM."),
    "InvalidAccessKeyId.NotFound": (404, "Specified access key is not found."),
    "SignatureDoesNotMatch": (400, "Specified signature is not matched with our "
                                   "calculation."),
    "IncompleteSignature": (400, "The request signature does not conform to Aliyun "
                                 "standards."),
    "QuotaExceed.ElasticQuota": (403, "The number of vCPUs assigned to the pay-as-you-go "
                                      "instances would exceed the quota."),
    "InvalidInstanceType.ValueUnauthorized": (403, "The specified InstanceType is not "
                                                   "authorized."),
    "InvalidRegionId.NotFound": (404, "The specified RegionId does not exist."),
    "InvalidInstanceType.ValueNotSupported": (400, "The specified InstanceType does not "
                                                   "exist or beyond the permitted range."),
    "MissingParameter": (400, "A required parameter is missing."),
    "InvalidParameter": (400, "The specified parameter is not valid."),
    "InvalidAction.NotFound": (404, "Specified api is not found, please check your url "
                                    "and method."),
}


class FakeAlibabaError(Exception):
    """An error the fake answers in Alibaba's error shape."""

    def __init__(self, code: str, message: str | None = None, status: int | None = None,
                 retry_after_ms: int | None = None) -> None:
        default_status, default_message = ERRORS.get(code, (400, code))
        super().__init__(message or default_message)
        self.code = code
        self.message = message or default_message
        self.status = status or default_status
        self.retry_after_ms = retry_after_ms


@dataclass
class _Fault:
    action: str
    region: str | None
    code: str
    status: int | None
    message: str | None
    remaining: int | None  # None = until clear_faults()
    retry_after_ms: int | None


def _iso(ts: datetime) -> str:
    return ts.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_ts(text: str) -> datetime:
    ts = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    return ts if ts.tzinfo else ts.replace(tzinfo=UTC)


def _spot_duration(p: dict[str, str]) -> int:
    """A request's ``SpotDuration`` (hours of protection): 0 or 1, 1 when left out."""
    raw = p.get("SpotDuration") or "1"
    if raw not in ("0", "1"):
        raise FakeAlibabaError("InvalidParameter",
                               f"The specified parameter SpotDuration {raw} is not valid.")
    return int(raw)


def _duration_factor(spot_duration: int) -> float:
    return NO_PROTECTION_FACTOR if spot_duration == 0 else 1.0


def _indexed(params: dict[str, str], prefix: str) -> list[str]:
    """RPC lists: ``InstanceTypes.1=a&InstanceTypes.2=b`` -> [a, b]."""
    pattern = re.compile(rf"^{re.escape(prefix)}\.(\d+)$")
    found = sorted((int(m.group(1)), v) for k, v in params.items()
                   if (m := pattern.match(k)) is not None)
    return [v for _, v in found]


def _token(offset: int) -> str:
    return base64.urlsafe_b64encode(json.dumps({"o": offset}).encode()).decode()


def _untoken(token: str) -> int:
    try:
        return int(json.loads(base64.urlsafe_b64decode(token.encode()))["o"])
    except (ValueError, KeyError, TypeError) as exc:
        raise FakeAlibabaError("InvalidParameter", f"The NextToken '{token}' is invalid."
                               ) from exc


def _rng(*parts: object) -> random.Random:
    return random.Random("|".join(str(p) for p in parts))


def _signature(secret: str, method: str, path: str, query: list[tuple[str, str]],
               headers: dict[str, str], signed: list[str], payload_hash: str) -> str:
    """ACS3-HMAC-SHA256 over the canonical request (Alibaba's V3 signature)."""
    canonical_query = "&".join(f"{k}={quote(v, safe='~')}" for k, v in sorted(query))
    canonical_headers = "".join(f"{h}:{headers.get(h, '').strip()}\n" for h in signed)
    canonical = "\n".join([method, path or "/", canonical_query, canonical_headers,
                           ";".join(signed), payload_hash])
    to_sign = "ACS3-HMAC-SHA256\n" + hashlib.sha256(canonical.encode()).hexdigest()
    return hmac.new(secret.encode(), to_sign.encode(), hashlib.sha256).hexdigest()


class FakeAlibaba(FakeServer[tuple[str, str]]):
    """ECS behind one local URL (see module doc).

    Attributes a test may read or set: ``url`` (after ``start()``), ``host`` (its
    ``127.0.0.1:PORT``), ``calls``, ``key_ids``, ``requests`` (every call's action and
    parameters, in order), ``latency``, ``now`` (``None`` = real
    time), ``currency`` (``"CNY"`` or ``"USD"``), ``discount`` (the account's discount on
    pay-as-you-go instance prices, 0..1), ``page_size`` (per-action cap on items per
    page), ``access_keys``, ``accept_unknown_keys``, ``revoked_keys``; random faults:
    ``chaos``, ``faulted`` (`fake_server`), ``chaos_retry_after_ms``,
    ``chaos_spare_after``, ``chaos_window`` (module doc).
    """

    thread_name = "fake-alibaba"

    def __init__(self, *, seed: int = 7, snapshot_time: datetime | None = None,
                 currency: str = "CNY") -> None:
        super().__init__()
        self.seed = seed
        self.currency = currency
        self.discount = 0.0
        self.key_ids: Counter[str] = Counter()
        self.requests: list[tuple[str, dict[str, str]]] = []  # (action, parameters)
        self.page_size: dict[str, int] = {"DescribeInstanceTypes": 5,
                                          "DescribeSpotPriceHistory": 20}
        self.access_keys: dict[str, str] = {}
        self.accept_unknown_keys = True
        self.revoked_keys: set[str] = set()
        self.host = ""
        self.chaos_retry_after_ms = 1000
        self.chaos_spare_after: int | None = None
        self.chaos_window = 30.0
        self._chaos_tries: dict[tuple[str, str], tuple[float, int]] = {}
        self._chaos_throttles = 0
        self._now: datetime | None = None
        self._faults: list[_Fault] = []
        self.snapshot_time = snapshot_time or (
            datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=1))
        # (region, zone, type, market) -> stock category; market "spot" | "postpaid"
        self._stock: dict[tuple[str, str, str, str], str] = {}
        # (region, zone, type) -> [(ts, spot price in CNY)] sorted
        self._spot: dict[tuple[str, str, str], list[tuple[datetime, float]]] = {}
        # (region, zone, type) -> (InterruptionRate % or None, band, AverageSpotDiscount)
        self._advice: dict[tuple[str, str, str], tuple[float | None, str, int]] = {}
        self._attributes: dict[tuple[str, str], str] = {}
        self._generate()

    # ------------------------------------------------------------------ data
    def _generate(self) -> None:
        for region, zones in REGIONS.items():
            for zone in zones:
                for t in CATALOG:
                    r = _rng(self.seed, region, zone, t.name)
                    if r.random() > 0.75:
                        continue  # this zone does not sell the type
                    cats = r.choices(STOCK_CATEGORIES, weights=(70, 15, 10, 5), k=2)
                    self._stock[(region, zone, t.name, "postpaid")] = cats[0]
                    if t.family.startswith("ecs.vgn") or r.random() > 0.8:
                        continue  # not sold as spot here
                    self._stock[(region, zone, t.name, "spot")] = cats[1]
                    od = self._list_price(region, t.name)
                    base = r.uniform(0.12, 0.6)
                    points = []
                    for k in range(7, -1, -1):
                        ts = self.snapshot_time - timedelta(hours=3 * k)
                        factor = min(0.9, max(0.08, base + r.uniform(-0.05, 0.05)))
                        points.append((ts, round(od * factor, 4)))
                    self._spot[(region, zone, t.name)] = points
                    pct = round(r.choice((0.4, 1.2, 2.7, 3.6, 4.4, 6.1, 8.9, 12.5, 21.0)), 1)
                    self._advice[(region, zone, t.name)] = (
                        pct, _band(pct), round(100 * (1 - points[-1][1] / od)))

    def _list_price(self, region: str, itype: str) -> float:
        """Pay-as-you-go list price, CNY per hour."""
        return round(TYPES[itype].cny_per_hour * REGION_PRICE_FACTOR.get(region, 1.0), 4)

    def _money(self, cny: float) -> float:
        return round(cny * USD_PER_CNY, 6) if self.currency == "USD" else round(cny, 6)

    # ----------------------------------------------------------- test knobs
    @property
    def now(self) -> datetime:
        return self._now or datetime.now(UTC)

    @now.setter
    def now(self, value: datetime | None) -> None:
        self._now = value

    def sells(self, region: str, market: str) -> dict[tuple[str, str], str]:
        """(zone, type) -> stock category for every pool of the region in ``market``
        (``"spot"`` or ``"postpaid"``), GPU types or not."""
        with self._lock:
            return {(z, t): c for (r, z, t, m), c in self._stock.items()
                    if r == region and m == market}

    def stock(self, region: str, zone: str, instance_type: str, market: str) -> str | None:
        with self._lock:
            return self._stock.get((region, zone, instance_type, market))

    def set_stock(self, region: str, zone: str, instance_type: str, market: str,
                  category: str | None) -> None:
        """Pin a pool's stock category; None: the zone stops selling it."""
        if category is not None and category not in STOCK_CATEGORIES:
            raise ValueError(f"stock category must be one of {STOCK_CATEGORIES}")
        with self._lock:
            key = (region, zone, instance_type, market)
            if category is None:
                self._stock.pop(key, None)
            else:
                self._stock[key] = category

    def set_spot_price(self, region: str, zone: str, instance_type: str, cny: float,
                       at: datetime | None = None) -> None:
        """Add a spot price point (in CNY; served converted when ``currency="USD"``)."""
        with self._lock:
            points = self._spot.setdefault((region, zone, instance_type), [])
            points.append((at or self.now, float(cny)))
            points.sort(key=lambda p: p[0])

    def spot_price(self, region: str, zone: str, instance_type: str,
                   spot_duration: int = 1) -> float | None:
        """The newest spot price of a pool for `spot_duration` hours of protection (the
        one-hour price unless 0), in the served currency (for assertions)."""
        with self._lock:
            points = self._spot.get((region, zone, instance_type))
            if not points:
                return None
            return self._money(points[-1][1] * _duration_factor(spot_duration))

    def on_demand_price(self, region: str, instance_type: str) -> float:
        """The pay-as-you-go instance price DescribePrice serves (TradePrice of the
        ``instanceType`` line), in the served currency."""
        return self._money(self._list_price(region, instance_type) * (1 - self.discount))

    def set_release_rate(self, region: str, zone: str, instance_type: str,
                         pct: float | None, band: str | None = None) -> None:
        """Pin DescribeSpotAdvice's InterruptionRate (%) for a pool; ``pct=None`` leaves
        it out of the answer (only the ``band`` is sent)."""
        with self._lock:
            old = self._advice.get((region, zone, instance_type), (None, "0-3%", 50))
            self._advice[(region, zone, instance_type)] = (
                pct, band or (_band(pct) if pct is not None else old[1]), old[2])

    def release_rate(self, region: str, zone: str, instance_type: str
                     ) -> tuple[float | None, str] | None:
        with self._lock:
            advice = self._advice.get((region, zone, instance_type))
            return (advice[0], advice[1]) if advice else None

    def set_attribute(self, region: str, name: str, value: str | float | None) -> None:
        """Pin a DescribeAccountAttributes value (None: not reported)."""
        with self._lock:
            self._attributes[(region, name)] = "" if value is None else str(value)

    def attribute(self, region: str, name: str) -> str | None:
        with self._lock:
            value = self._attributes.get((region, name), QUOTA_DEFAULTS.get(name))
            return value or None

    def fail(self, action: str, code: str = "Throttling.User", status: int | None = None,
             times: int | None = 1, message: str | None = None, *,
             region: str | None = None, retry_after_ms: int | None = None) -> None:
        """Make the next ``times`` calls of ``action`` (``"*"``: any action; ``times=None``:
        all, until ``clear_faults()``) fail with Alibaba error ``code`` (HTTP status and
        message from ``ERRORS`` unless given); ``region`` narrows the match;
        ``retry_after_ms`` adds an ``x-acs-retry-after`` header."""
        with self._lock:
            self._faults.append(_Fault(action, region, code, status, message, times,
                                       retry_after_ms))

    def reset_calls(self) -> None:
        with self._lock:
            super().reset_calls()
            self.key_ids.clear()
            self.requests.clear()

    def call_count(self, action: str | None = None, region: str | None = None) -> int:
        with self._lock:
            return sum(n for (a, r), n in self.calls.items()
                       if (action is None or a == action) and (region is None or r == region))

    # ------------------------------------------------------------ SDK helper
    def client(self, region: str = "cn-hangzhou", *, key_id: str = "LTAI-fake-test-key",
               secret: str = "fake-test-secret") -> Any:
        """A real Tea ECS client on this fake (no SDK retries), signing with the given
        key. Its pooled connections are closed by ``stop()``."""
        from alibabacloud_ecs20140526.client import Client
        from alibabacloud_tea_openapi.models import Config

        return Client(Config(endpoint=self.host, protocol="http", region_id=region,
                             access_key_id=key_id, access_key_secret=secret,
                             connect_timeout=5000, read_timeout=30000))

    # ---------------------------------------------------------------- server
    def start(self) -> Self:
        super().start()
        self.host = self.url.removeprefix("http://")
        return self

    def stop(self) -> None:
        super().stop()
        _close_sdk_sessions(self.host)

    # -------------------------------------------------------------- dispatch
    async def _handle(self, request: web.Request) -> web.Response:
        request_id = str(uuid.uuid4()).upper()
        params = dict(request.query)
        body = await request.read()
        if body and request.content_type == "application/x-www-form-urlencoded":
            params.update(parse_qsl(body.decode()))
        action = request.headers.get("x-acs-action") or params.get("Action", "")
        region = params.get("RegionId", "")
        with self._lock:
            self.calls[(action, region)] += 1
            self.requests.append((action, params))
        try:
            self._authorize(request, body)
            with self._lock:
                fault = self._take_fault(action, region)
            await self._delay()
            if fault is not None:
                raise FakeAlibabaError(fault.code, fault.message, fault.status,
                                       fault.retry_after_ms)
            handler = getattr(self, f"_{_snake(action)}", None) if action else None
            if handler is None:
                raise FakeAlibabaError("InvalidAction.NotFound")
            if region and region not in REGIONS and action != "DescribeInstanceTypes":
                raise FakeAlibabaError("InvalidRegionId.NotFound")
            with self._lock:
                answer: dict[str, Any] = handler(params)
        except FakeAlibabaError as err:
            return _error_answer(err, region, request_id)
        return web.json_response({"RequestId": request_id, **answer},
                                 headers={"x-acs-request-id": request_id})

    # --------------------------------------------------------- random faults
    def _chaos_applies(self, request: web.Request) -> bool:
        if self.chaos_spare_after is None:
            return True
        key = (request.headers.get("x-acs-action", ""), request.query_string)
        now = time.monotonic()
        with self._lock:
            first, tries = self._chaos_tries.get(key, (now, 0))
            if now - first > self.chaos_window:
                first, tries = now, 0
            self._chaos_tries[key] = (first, tries + 1)
        return tries < self.chaos_spare_after

    def _throttled(self, request: web.Request) -> web.StreamResponse:
        with self._lock:
            turn = self._chaos_throttles % 3
            self._chaos_throttles += 1
        if turn == 0:
            err = FakeAlibabaError("Throttling.User",
                                   retry_after_ms=self.chaos_retry_after_ms or None)
        elif turn == 1:
            err = FakeAlibabaError("Throttling.Api")
        else:
            err = FakeAlibabaError("Throttling", status=429)
        return _error_answer(err, request.query.get("RegionId", ""))

    def _server_error(self, request: web.Request, status: int) -> web.StreamResponse:
        err = FakeAlibabaError("ServiceUnavailable" if status == 503 else "InternalError",
                               status=status)
        return _error_answer(err, request.query.get("RegionId", ""))

    def _authorize(self, request: web.Request, body: bytes) -> None:
        auth = request.headers.get("Authorization", "")
        m = re.match(r"^ACS3-HMAC-SHA256 Credential=([^,]+),SignedHeaders=([^,]*),"
                     r"Signature=([0-9a-f]+)$", auth)
        if m is None:
            raise FakeAlibabaError("IncompleteSignature")
        key_id, signed, signature = m.group(1), m.group(2).split(";"), m.group(3)
        with self._lock:
            self.key_ids[key_id] += 1
            secret = self.access_keys.get(key_id)
            known = secret is not None
            if key_id in self.revoked_keys or not (known or self.accept_unknown_keys):
                raise FakeAlibabaError("InvalidAccessKeyId.NotFound")
        if secret is None:
            return
        headers = {k.lower(): v for k, v in request.headers.items()}
        payload = headers.get("x-acs-content-sha256") or hashlib.sha256(body).hexdigest()
        query = list(parse_qsl(request.query_string, keep_blank_values=True))
        expected = _signature(secret, request.method, request.path, query, headers, signed,
                              payload)
        if not hmac.compare_digest(expected, signature):
            raise FakeAlibabaError("SignatureDoesNotMatch")

    def _take_fault(self, action: str, region: str) -> _Fault | None:
        for fault in self._faults:
            if fault.action not in (action, "*") or fault.region not in (None, region):
                continue
            if fault.remaining is not None:
                fault.remaining -= 1
                if fault.remaining <= 0:
                    self._faults.remove(fault)
            return fault
        return None

    @staticmethod
    def _required(params: dict[str, str], name: str) -> str:
        value = params.get(name)
        if not value:
            raise FakeAlibabaError("MissingParameter", f"{name} is mandatory for this action.")
        return value

    # ------------------------------------------------------------ the APIs
    def _describe_instance_types(self, p: dict[str, str]) -> dict[str, Any]:
        types = list(CATALOG)
        if "MinimumGPUAmount" in p:
            types = [t for t in types if t.gpus >= int(p["MinimumGPUAmount"])]
        if names := _indexed(p, "InstanceTypes"):
            types = [t for t in types if t.name in names]
        if family := p.get("InstanceTypeFamily"):
            types = [t for t in types if t.family == family]
        size = min(int(p.get("MaxResults") or 1600), 1600,
                   self.page_size.get("DescribeInstanceTypes", 1600))
        start = _untoken(p["NextToken"]) if p.get("NextToken") else 0
        page = types[start:start + size]
        out: dict[str, Any] = {"InstanceTypes": {"InstanceType": [_type_json(t) for t in page]}}
        if start + size < len(types):
            out["NextToken"] = _token(start + size)
        return out

    def _describe_available_resource(self, p: dict[str, str]) -> dict[str, Any]:
        region = self._required(p, "RegionId")
        destination = self._required(p, "DestinationResource")
        if destination != "InstanceType":
            raise FakeAlibabaError("InvalidParameter", "The fake serves "
                                   "DestinationResource=InstanceType only.")
        if p.get("InstanceChargeType", "PostPaid") != "PostPaid":
            raise FakeAlibabaError("InvalidParameter", "The fake serves PostPaid only.")
        strategy = p.get("SpotStrategy", "NoSpot")
        market = "postpaid" if strategy == "NoSpot" else "spot"
        _spot_duration(p)
        zones = []
        for zone in REGIONS[region]:
            if p.get("ZoneId") and zone != p["ZoneId"]:
                continue
            supported = [
                {"Value": t, "Status": _STATUS[c], "StatusCategory": c}
                for (z, t), c in sorted(self.sells(region, market).items())
                if z == zone and (not p.get("InstanceType") or t == p["InstanceType"])]
            if not supported:
                continue
            any_stock = any(s["Status"] == "Available" for s in supported)
            zones.append({
                "ZoneId": zone, "RegionId": region,
                "Status": "Available" if any_stock else "SoldOut",
                "StatusCategory": "WithStock" if any_stock else "WithoutStock",
                "AvailableResources": {"AvailableResource": [{
                    "Type": "InstanceType",
                    "SupportedResources": {"SupportedResource": supported}}]},
            })
        return {"AvailableZones": {"AvailableZone": zones}}

    def _describe_spot_price_history(self, p: dict[str, str]) -> dict[str, Any]:
        region = self._required(p, "RegionId")
        itype = self._required(p, "InstanceType")
        network = self._required(p, "NetworkType")
        if network not in ("vpc", "classic"):
            raise FakeAlibabaError("InvalidParameter", f"NetworkType {network} is invalid.")
        end = _parse_ts(p["EndTime"]) if p.get("EndTime") else self.now
        start = _parse_ts(p["StartTime"]) if p.get("StartTime") else end - timedelta(hours=3)
        if end - start > timedelta(days=30) or start > end:
            raise FakeAlibabaError("InvalidParameter", "StartTime must be within 30 days "
                                   "before EndTime.")
        windows = p.get("OSType", "linux") == "windows"
        factor = _duration_factor(_spot_duration(p))
        rows = []
        for (r, zone, t), points in self._spot.items():
            if r != region or t != itype or (p.get("ZoneId") and zone != p["ZoneId"]):
                continue
            od = self._list_price(region, itype)
            for ts, cny in points:
                if start <= ts <= end:
                    price = cny * factor + (0.3 * TYPES[itype].vcpus / 4 if windows else 0.0)
                    rows.append((ts, zone, {
                        "InstanceType": itype, "ZoneId": zone,
                        "SpotPrice": self._money(price), "OriginPrice": self._money(od),
                        "Timestamp": _iso(ts), "NetworkType": network,
                        "IoOptimized": "optimized"}))
        rows.sort(key=lambda row: (row[0], row[1]))
        offset = int(p.get("Offset") or 0)
        size = self.page_size.get("DescribeSpotPriceHistory", 1000)
        page = [row[2] for row in rows[offset:offset + size]]
        more = offset + size < len(rows)
        return {"SpotPrices": {"SpotPriceType": page}, "Currency": self.currency,
                "NextOffset": offset + size if more else 0}

    def _describe_price(self, p: dict[str, str]) -> dict[str, Any]:
        region = self._required(p, "RegionId")
        if p.get("ResourceType", "instance") != "instance":
            raise FakeAlibabaError("InvalidParameter", "The fake prices instances only.")
        itype = self._required(p, "InstanceType")
        if p.get("SpotStrategy", "NoSpot") != "NoSpot" or p.get("PriceUnit", "Hour") != "Hour":
            raise FakeAlibabaError("InvalidParameter", "The fake prices pay-as-you-go hours "
                                   "only.")
        if not any(r == region and t == itype and m == "postpaid"
                   for r, _, t, m in self._stock):
            raise FakeAlibabaError("InvalidInstanceType.ValueNotSupported")
        lines: list[dict[str, Any]] = []
        for resource, cny, discount in (
                ("instanceType", self._list_price(region, itype), self.discount),
                ("systemDisk", SYSTEM_DISK_CNY_PER_HOUR, 0.0), ("bandwidth", 0.0, 0.0)):
            original = self._money(cny)
            off = round(original * discount, 6)
            lines.append({"Resource": resource, "OriginalPrice": original,
                          "DiscountPrice": off, "TradePrice": round(original - off, 6),
                          "SubRules": {"Rule": []}})
        total = {k: round(sum(line[k] for line in lines), 6)
                 for k in ("OriginalPrice", "DiscountPrice", "TradePrice")}
        return {"PriceInfo": {
            "Price": {**total, "Currency": self.currency, "DetailInfos": {"DetailInfo": lines}},
            "Rules": {"Rule": []}}}

    def _describe_spot_advice(self, p: dict[str, str]) -> dict[str, Any]:
        region = self._required(p, "RegionId")
        wanted = _indexed(p, "InstanceTypes")
        if len(wanted) > 10:
            raise FakeAlibabaError("InvalidParameter", "InstanceTypes accepts at most 10 "
                                   "instance types.")
        zones = []
        for zone in REGIONS[region]:
            if p.get("ZoneId") and zone != p["ZoneId"]:
                continue
            resources = []
            for (r, z, t), (pct, band, discount) in self._advice.items():
                if r != region or z != zone or (wanted and t not in wanted):
                    continue
                if (r, z, t, "spot") not in self._stock:
                    continue
                item: dict[str, Any] = {"InstanceType": t, "InterruptRateDesc": band,
                                        "AverageSpotDiscount": discount}
                if pct is not None:
                    item["InterruptionRate"] = pct
                resources.append(item)
            if resources:
                resources.sort(key=lambda i: (i["AverageSpotDiscount"], i["InstanceType"]))
                zones.append({"ZoneId": zone,
                              "AvailableSpotResources": {"AvailableSpotResource": resources}})
        return {"RegionId": region, "AvailableSpotZones": {"AvailableSpotZone": zones}}

    def _describe_account_attributes(self, p: dict[str, str]) -> dict[str, Any]:
        region = self._required(p, "RegionId")
        names = _indexed(p, "AttributeName") or list(QUOTA_DEFAULTS)
        if len(names) > 8:
            raise FakeAlibabaError("InvalidParameter", "AttributeName accepts at most 8 "
                                   "names.")
        items = []
        for name in names:
            value = self._attributes.get((region, name), QUOTA_DEFAULTS.get(name))
            if not value:
                continue
            charge = "PostPaid" if "postpaid" in name else ""
            items.append({"AttributeName": name, "AttributeValues": {"ValueItem": [{
                "Value": value, "Count": 1, "ZoneId": "", "InstanceChargeType": charge,
                "InstanceType": "", "ExpiredTime": "", "DiskCategory": ""}]}})
        return {"AccountAttributeItems": {"AccountAttributeItem": items}}


def _error_answer(err: FakeAlibabaError, region: str, request_id: str | None = None
                  ) -> web.Response:
    """An error as Alibaba answers it: JSON ``{"RequestId", "HostId", "Code", "Message",
    "Recommend"}`` with the error's HTTP status (and ``x-acs-retry-after``, if any)."""
    request_id = request_id or str(uuid.uuid4()).upper()
    headers = {"x-acs-request-id": request_id}
    if err.retry_after_ms:
        headers["x-acs-retry-after"] = str(err.retry_after_ms)
    return web.json_response({
        "RequestId": request_id,
        "HostId": f"ecs.{region or 'aliyuncs'}.aliyuncs.com",
        "Code": err.code,
        "Message": err.message,
        "Recommend": f"https://api.aliyun.com/troubleshoot?q={err.code}&product=Ecs"
                     f"&requestId={request_id}",
    }, status=err.status, headers=headers)


def _band(pct: float) -> str:
    return next(band for band, upper in RATE_BANDS if pct < upper)


def _snake(action: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", action).lower()


def _type_json(t: InstanceType) -> dict[str, Any]:
    return {
        "InstanceTypeId": t.name, "InstanceTypeFamily": t.family,
        "CpuCoreCount": t.vcpus, "MemorySize": float(t.memory_gib),
        "GPUAmount": t.gpus, "GPUSpec": t.gpu_spec, "GPUMemorySize": float(t.gpu_memory_gib),
        "InstanceCategory": t.category, "InstanceFamilyLevel": "EnterpriseLevel",
        "CpuArchitecture": "X86", "PhysicalProcessorModel": "Intel Xeon (Ice Lake) Platinum "
                                                           "8369B",
        "EniQuantity": 4, "EniPrivateIpAddressQuantity": 10, "EniIpv6AddressQuantity": 1,
        "InstanceBandwidthRx": 3_000_000, "InstanceBandwidthTx": 3_000_000,
        "InstancePpsRx": 1_000_000, "InstancePpsTx": 1_000_000,
        "LocalStorageCategory": "", "NvmeSupport": "unsupported", "DiskQuantity": 17,
        "CpuSpeedFrequency": 2.9, "CpuTurboFrequency": 3.5,
        "SupportedBootModes": {"SupportedBootMode": ["BIOS", "UEFI"]},
    }


def _close_sdk_sessions(host: str) -> None:
    """Close the SDK's process-wide pooled HTTP sessions to ``host`` (darabonba keeps one
    per endpoint and never closes them)."""
    if not host:
        return
    with contextlib.suppress(ModuleNotFoundError):
        from darabonba.core import DaraCore

        sessions: dict[str, Any] = getattr(DaraCore, "_sessions", {})
        for key in list(sessions):
            if key.split("://", 1)[-1].startswith(f"{host}:"):
                session = sessions.pop(key, None)
                if session is not None:
                    session.close()


@pytest.fixture(name="fake_alibaba")
def fake_alibaba_fixture() -> Iterator[FakeAlibaba]:
    """A running FakeAlibaba."""
    with FakeAlibaba() as fake:
        yield fake
