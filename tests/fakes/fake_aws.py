"""A fake AWS on one local URL, for driving the real boto3 against it.

The AWS adapter's config has ONE base URL (``clouds.aws.endpoint``) that replaces every
AWS service host, so this fake is a single aiohttp server (its own event loop, in a
background thread: usable from sync boto3 code and from async tests alike) that routes
each request to a service the way AWS's wire protocols tell them apart:

* ``X-Amz-Target: AWSPriceListService.*``      → Price List (served here, JSON 1.1)
* ``X-Amz-Target: ServiceQuotasV20190624.*``   → Service Quotas (served here, JSON 1.1)
* ``X-Amz-Target: AmazonSQS.*``                → SQS (proxied to moto; boto3 ≥ 1.31 speaks
  the JSON 1.0 protocol to SQS)
* a form-encoded ``Action=...`` POST           → EC2 query protocol. These are served
  here: ``DescribeSpotPriceHistory``, ``GetSpotPlacementScores``,
  ``DescribeInstanceTypeOfferings`` (moto's offering data, but with real EC2 wildcard
  filters and paging). ``DescribeInstanceTypes`` is moto's data and moto's XML, but
  paged like real EC2 (≤100 a page; moto alone returns all ~1,260 types at once).
  Everything else (``RunInstances``, ``DescribeInstances``, ``DescribeRegions``,
  ``DescribeAvailabilityZones`` ...) is proxied to moto's server app, which the fake
  runs on its own free port (as ``moto.server.ThreadedMotoServer`` does).

Usage::

    from fake_aws import fake_aws_fixture  # noqa: F401   (the ``fake_aws`` fixture)

    def test_x(fake_aws):
        ec2 = fake_aws.client("ec2", "us-west-2")  # = boto3.client(endpoint_url=fake_aws.url)

or without pytest: ``with FakeAWS() as fake: ...`` (``start()``/``stop()`` also work).

Regions. With ``endpoint_url`` every region hits the same URL, so the fake reads the
region from the SigV4 ``Authorization`` credential scope
(``Credential=AKID/20261130/us-west-2/ec2/aws4_request``). Unsigned requests
(``Config(signature_version=UNSIGNED)``, the adapter's ``anonymous: true``) carry no
region at all, so the fake uses, in order: a region named inside the request (an SQS
``QueueUrl`` host ``sqs.<region>.amazonaws.com``; an EC2 ``AvailabilityZone`` /
``Placement.AvailabilityZone`` parameter or ``availability-zone`` filter), else
``FakeAWS.default_region`` (``"us-east-1"`` unless given to the constructor). So an
anonymous adapter polling several regions sees the default region's EC2 data for all
of them; tests that tell regions apart must sign (the fixture sets fake credentials).

Zone names. The price CSV (``tests/fixtures/prices/gpu-prices-aws.csv``) has AZ *IDs*
(``use1-az1``); EC2 spot history speaks zone *names*. The fake maps an ID to the name
that moto's ``DescribeAvailabilityZones`` reports for it in the same region, so the two
APIs agree (as one real account's would). moto's table is irregular for some regions,
like real accounts are: us-east-1 is a=az6, b=az1, c=az2, d=az4, e=az3, f=az5;
us-west-2 is a=az2, b=az1, c=az3, d=az4; eu-west-1 a=az3, b=az1, c=az2 (see
``zone_name``/``zone_id``). Regions moto doesn't list specially use azN → the N-th
letter (az1→a, az2→b ...).

Spot price history follows the real API's time rule: with ``StartTime`` it returns the
points with ``Timestamp >= StartTime`` (and ``<= EndTime`` if given) **plus, per
(zone, type, product), the last point before StartTime** — "the effective price as of
the start time" (EC2 API reference). CSV prices are stamped ``snapshot_time`` (default:
one hour before the fake was built); add newer points with ``set_spot_price``.

Every call (except the fake's own helper calls) is counted in ``calls`` (a Counter of
``(service, action, region)``; services ``ec2``, ``pricing``, ``servicequotas``,
``sqs``, ``s3``), whether it is answered or hit by a random fault, can be delayed by
``latency = (lo, hi)`` seconds (an ``asyncio.sleep`` in the handler: calls stay
concurrent) and failed with ``fail(...)`` in that service's real error shape.

Random faults (``chaos = Chaos(...)``, see ``fake_server``) answer in each service's own
shape: EC2 ``RequestLimitExceeded`` (503) for a throttle, ``InternalError`` (500) or
``Unavailable`` (503) XML; Price List and Service Quotas (JSON 1.1) and SQS (JSON 1.0)
``ThrottlingException`` / ``TooManyRequestsException`` (400) and
``InternalErrorException`` / ``ServiceException`` / ``ServiceUnavailableException`` with
``x-amzn-ErrorType``; S3 ``SlowDown`` (503), ``InternalError`` (500) or
``ServiceUnavailable`` (503) XML. Throttles carry ``throttle_headers``, by default
``Retry-After: 1``, which AWS itself does not send (botocore's own retries read only
``x-amz-retry-after``, in milliseconds; the adapter reads both). The fake's own helper
calls are never faulted.

The Spot Instance Advisor document (``spot_advisor``, served at
``/spot-bid-advisor/spot-advisor-data.json``, where an S3 client with this endpoint and
path-style addressing asks for bucket ``spot-bid-advisor``, key
``spot-advisor-data.json``; counted as ``("s3", "GetObject", region)``) has the real
document's shape: ``global_rate``, ``instance_types`` ({cores, ram_gb, emr}), ``ranges``
(the five bands with AWS's labels and ``max`` values) and ``spot_advisor`` (region → OS →
type → {"s": savings %, "r": band index}). Provenance: built from that documented shape
(and the public document's band table); the per-type values are invented, drawn from
``seed`` for every GPU type of the price CSV in its regions, except that each region
leaves one type out (``advisor_gaps``), like the real document, which lists only some
types. ``set_interruption_band`` pins one entry. Its ``Last-Modified`` is
``advisor_modified`` (AWS republishes the document every few months), ``snapshot_time``
while that is None.

On-Demand Capacity Reservations (moto 5 has none: ``CreateCapacityReservation``,
``DescribeCapacityReservations`` and ``CancelCapacityReservation`` are served here, in
EC2's XML shapes: ``capacityReservationSet`` items with ``capacityReservationId``,
``ownerId``, ``capacityReservationArn``, ``availabilityZoneId``, ``instanceType``,
``instancePlatform``, ``availabilityZone``, ``tenancy``, ``totalInstanceCount``,
``availableInstanceCount``, ``state``, ``startDate``, ``endDate``, ``endDateType``,
``instanceMatchCriteria``, ``createDate``, ``reservationType`` ..., paged by
``nextToken``, at most ``page_size["DescribeCapacityReservations"]`` a page; the filters
EC2 documents for it: ``instance-type``, ``owner-id``, ``instance-platform``,
``availability-zone``, ``tenancy``, ``state``, ``end-date-type``,
``instance-match-criteria``). A reservation is created only for a type moto offers in
the zone (else ``Unsupported``, as EC2 answers); a ``limited`` one whose ``EndDate`` has
passed (by the fake's ``now``) is ``expired``, a cancelled one ``cancelled``; both stay
listed, as EC2 lists them for a while. ``add_capacity_reservation`` makes one without a
call (any state, a Capacity Block, and ``raw`` overrides of the answered fields, for
answers no real reservation gives), ``use_capacity_reservation`` sets how many instances
run in one (``availableInstanceCount`` = total − those).

moto keeps its state in process-global backends: the fake resets moto when it starts,
so two FakeAWS instances alive at once in one process share EC2/SQS state.
"""

from __future__ import annotations

import base64
import contextlib
import csv
import fnmatch
import functools
import hashlib
import json
import logging
import math
import os
import re
import threading
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Self
from urllib.parse import parse_qsl, urlencode
from xml.sax.saxutils import escape

import aiohttp
import pytest
from aiohttp import web
from fake_server import FakeServer

# the price snapshot vendored with the tests (provenance: tests/fixtures/prices/README.md)
DEFAULT_PRICES_CSV = Path(__file__).resolve().parents[1] / "fixtures/prices/gpu-prices-aws.csv"

ACCOUNT_ID = "123456789012"  # moto's default account
EC2_NS = "http://ec2.amazonaws.com/doc/2016-11-15/"
OD_TERM = "JRTCKXETXF"  # the On-Demand offer term code (same for every SKU)
RESERVED_TERM = "4NA7Y494T4"  # 1yr standard No Upfront
HRS_RATE = "6YS6EN2CT7"

JSON_TARGETS = {
    "AWSPriceListService": ("pricing", "application/x-amz-json-1.1", "com.amazonaws.pricing"),
    "ServiceQuotasV20190624": (
        "servicequotas",
        "application/x-amz-json-1.1",
        "com.amazonaws.servicequotas",
    ),
    "AmazonSQS": ("sqs", "application/x-amz-json-1.0", "com.amazonaws.sqs"),
}
DEFAULT_FAULT = {  # service -> (code, status) when fail() is given none
    "ec2": ("RequestLimitExceeded", 503),
    "pricing": ("ThrottlingException", 400),
    "servicequotas": ("TooManyRequestsException", 400),
    "sqs": ("ThrottlingException", 400),
    "s3": ("SlowDown", 503),
}

PRICING_LOCATIONS = {
    "af-south-1": "Africa (Cape Town)",
    "ap-east-1": "Asia Pacific (Hong Kong)",
    "ap-northeast-1": "Asia Pacific (Tokyo)",
    "ap-northeast-2": "Asia Pacific (Seoul)",
    "ap-northeast-3": "Asia Pacific (Osaka)",
    "ap-south-1": "Asia Pacific (Mumbai)",
    "ap-southeast-1": "Asia Pacific (Singapore)",
    "ap-southeast-2": "Asia Pacific (Sydney)",
    "ap-southeast-3": "Asia Pacific (Jakarta)",
    "ca-central-1": "Canada (Central)",
    "eu-central-1": "EU (Frankfurt)",
    "eu-north-1": "EU (Stockholm)",
    "eu-south-1": "EU (Milan)",
    "eu-west-1": "EU (Ireland)",
    "eu-west-2": "EU (London)",
    "eu-west-3": "EU (Paris)",
    "me-central-1": "Middle East (UAE)",
    "me-south-1": "Middle East (Bahrain)",
    "us-east-1": "US East (N. Virginia)",
    "us-east-2": "US East (Ohio)",
    "us-west-1": "US West (N. California)",
    "us-west-2": "US West (Oregon)",
}

# EC2 vCPU quotas (ServiceCode "ec2"): code -> (name, usage class, default vCPUs)
EC2_QUOTAS: dict[str, tuple[str, str, float]] = {
    "L-1216C47A": (
        "Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances",
        "Standard/OnDemand",
        1152.0,
    ),
    "L-DB2E81BA": ("Running On-Demand G and VT instances", "G/OnDemand", 64.0),
    "L-417A185B": ("Running On-Demand P instances", "P/OnDemand", 192.0),
    "L-74FC7D96": ("Running On-Demand F instances", "F/OnDemand", 128.0),
    "L-1945791B": ("Running On-Demand Inf instances", "Inf/OnDemand", 128.0),
    "L-7295265B": ("Running On-Demand X instances", "X/OnDemand", 128.0),
    "L-34B43A08": (
        "All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests",
        "Standard/Spot",
        1152.0,
    ),
    "L-3819A6DF": ("All G and VT Spot Instance Requests", "G/Spot", 64.0),
    "L-7212CCBC": ("All P Spot Instance Requests", "P/Spot", 192.0),
    "L-88CF9481": ("All F Spot Instance Requests", "F/Spot", 128.0),
    "L-B5D1601B": ("All Inf Spot Instance Requests", "Inf/Spot", 128.0),
    "L-E3A00192": ("All X Spot Instance Requests", "X/Spot", 128.0),
}

ADVISOR_PATH = "/spot-bid-advisor/spot-advisor-data.json"
ADVISOR_RANGES = [  # the real document's band table (labels and "max" as AWS publishes)
    {"index": 0, "label": "<5%", "dots": 0, "max": 5},
    {"index": 1, "label": "5-10%", "dots": 1, "max": 11},
    {"index": 2, "label": "10-15%", "dots": 2, "max": 16},
    {"index": 3, "label": "15-20%", "dots": 3, "max": 22},
    {"index": 4, "label": ">20%", "dots": 4, "max": 100},
]
# What each service answers to a random fault: service -> (throttle, 500, 503) codes.
CHAOS_CODES = {
    "ec2": ("RequestLimitExceeded", "InternalError", "Unavailable"),
    "pricing": ("ThrottlingException", "InternalErrorException", "ServiceUnavailableException"),
    "servicequotas": ("TooManyRequestsException", "ServiceException", "ServiceException"),
    "sqs": ("ThrottlingException", "InternalError", "ServiceUnavailable"),
    "s3": ("SlowDown", "InternalError", "ServiceUnavailable"),
}
THROTTLE_STATUS = {"ec2": 503, "s3": 503}  # others: 400

_AZ_NAME = re.compile(r"^([a-z]{2}(?:-[a-z]+)+-\d+)[a-z]$")
_QUEUE_HOST = re.compile(r"sqs\.([a-z0-9-]+)\.amazonaws\.com")


CR_FILTERS = {  # DescribeCapacityReservations filter -> the answer's field it matches
    "instance-type": "instanceType", "owner-id": "ownerId",
    "instance-platform": "instancePlatform", "availability-zone": "availabilityZone",
    "tenancy": "tenancy", "state": "state", "end-date-type": "endDateType",
    "instance-match-criteria": "instanceMatchCriteria",
}
CR_PLATFORMS = frozenset({
    "Linux/UNIX", "Red Hat Enterprise Linux", "SUSE Linux", "Windows",
    "Windows with SQL Server", "Windows with SQL Server Enterprise",
    "Windows with SQL Server Standard", "Windows with SQL Server Web",
    "Linux with SQL Server Standard", "Linux with SQL Server Web",
    "Linux with SQL Server Enterprise", "RHEL with SQL Server Standard",
    "RHEL with SQL Server Enterprise", "RHEL with SQL Server Web", "RHEL with HA",
    "RHEL with HA and SQL Server Standard", "RHEL with HA and SQL Server Enterprise",
    "Ubuntu Pro"})


@dataclass
class _CapacityReservation:
    id: str
    region: str
    zone: str
    instance_type: str
    platform: str
    tenancy: str
    total: int
    match: str
    end_date_type: str
    end_date: datetime | None
    state: str  # as set; `expired` is derived from end_date when listed
    created: datetime
    reservation_type: str = "default"
    in_use: int = 0
    raw: dict[str, str | None] | None = None  # answered fields overridden (None: left out)


class FakeAWSError(Exception):
    """An error the fake answers in the service's own error shape."""

    def __init__(self, code: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.code, self.message, self.status = code, message, status


@dataclass
class _Fault:
    action: str
    service: str | None
    region: str | None
    code: str | None
    status: int | None
    message: str
    remaining: int | None  # None = until clear_faults()


@dataclass
class _Call:
    service: str
    action: str
    region: str
    signed: bool
    internal: bool
    content_type: str
    error_ns: str
    params: dict[str, str]  # EC2 query params
    body: bytes
    json_body: dict[str, Any]


CALL: Any = (
    web.RequestKey("fake_aws_call") if hasattr(web, "RequestKey") else "fake_aws_call"
)
"""The request's `_Call` (None: not one the fake understands), set by the counting
middleware. A typed key where aiohttp has one (3.14 warns on a plain string key); a
string on the older releases pyproject.toml's aiohttp range still admits."""


def _iso(ts: datetime) -> str:
    return ts.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z")


def _parse_ts(value: str) -> datetime:
    ts = datetime.fromisoformat(value.strip())
    return ts if ts.tzinfo else ts.replace(tzinfo=UTC)


def _token(action: str, offset: int) -> str:
    raw = json.dumps({"a": action, "o": offset}).encode()
    return base64.urlsafe_b64encode(raw).decode()


def _offset(action: str, token: str | None) -> int:
    if not token:
        return 0
    try:
        data = json.loads(base64.urlsafe_b64decode(token.encode()))
        if data["a"] != action or int(data["o"]) < 0:
            raise ValueError(token)
        return int(data["o"])
    except (ValueError, KeyError, TypeError) as exc:
        raise FakeAWSError("InvalidNextToken", f"The token '{token}' is invalid.") from exc


def _sku(*parts: str) -> str:
    digest = hashlib.sha256("|".join(parts).encode()).digest()
    return base64.b32encode(digest).decode()[:16].replace("=", "A")


@functools.cache
def _moto_zone_table() -> dict[str, list[tuple[str, str]]]:
    """region -> [(zone name, zone id)] exactly as moto's DescribeAvailabilityZones."""
    from moto.ec2.models.availability_zones_and_regions import RegionsAndZonesBackend

    return {
        region: [(z.name, z.zone_id) for z in zones]
        for region, zones in RegionsAndZonesBackend.zones.items()
    }


def _indexed(params: dict[str, str], prefix: str) -> list[str]:
    """EC2 query lists: ``InstanceType.1=a&InstanceType.2=b`` -> [a, b]."""
    pattern = re.compile(rf"^{re.escape(prefix)}\.(\d+)$")
    found = sorted(
        (int(m.group(1)), v) for k, v in params.items() if (m := pattern.match(k)) is not None
    )
    return [v for _, v in found]


def _filters(params: dict[str, str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for n in sorted({int(m.group(1)) for k in params if (m := re.match(r"^Filter\.(\d+)\.", k))}):
        name = params.get(f"Filter.{n}.Name")
        if name:
            out.setdefault(name, []).extend(_indexed(params, f"Filter.{n}.Value"))
    return out


def _wild(value: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(value, p) for p in patterns)


def _ec2_xml(action: str, inner: str) -> bytes:
    return (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<{action}Response xmlns="{EC2_NS}">'
        f"<requestId>{uuid.uuid4()}</requestId>{inner}</{action}Response>"
    ).encode()


def _xml_items(tag: str, items: list[dict[str, str]]) -> str:
    body = "".join(
        "<item>" + "".join(f"<{k}>{escape(str(v))}</{k}>" for k, v in item.items()) + "</item>"
        for item in items
    )
    return f"<{tag}>{body}</{tag}>"


def _next_token_xml(token: str | None) -> str:
    return f"<nextToken>{escape(token)}</nextToken>" if token else ""


def _ec2_products(
    region: str, itype: str, row: dict[str, str], gpu: dict[str, Any] | None
) -> list[dict[str, Any]]:
    od = float(row["on_demand_usd_per_hour"])
    vcpus = int(row["vcpus"])
    prefix = "" if region == "us-east-1" else _usage_prefix(region)
    base = {
        "servicecode": "AmazonEC2",
        "servicename": "Amazon Elastic Compute Cloud",
        "instanceType": itype,
        "instanceFamily": "GPU instance",
        "instanceFamilyCategory": "Accelerated Computing",
        "regionCode": region,
        "location": PRICING_LOCATIONS.get(region, region),
        "locationType": "AWS Region",
        "availabilityzone": "NA",
        "operatingSystem": "Linux",
        "licenseModel": "No License required",
        "tenancy": "Shared",
        "preInstalledSw": "NA",
        "capacitystatus": "Used",
        "marketoption": "OnDemand",
        "operation": "RunInstances",
        "usagetype": f"{prefix}BoxUsage:{itype}",
        "vcpu": str(vcpus),
        "memory": f"{row['memory_gib']} GiB",
        "gpu": row["gpus"] or "0",
        "currentGeneration": "Yes",
        "processorArchitecture": "64-bit",
    }
    if gpu:
        base["gpuMemory"] = f"{round(gpu['TotalGpuMemoryInMiB'] / 1024)} GB"
    # (variant, attribute overrides, price): the first is what an adapter wants; the
    # rest are real-looking decoys, each differing in ONE filterable attribute.
    variants: list[tuple[str, dict[str, str], float]] = [
        ("linux", {}, od),
        (
            "windows",
            {
                "operatingSystem": "Windows",
                "operation": "RunInstances:0002",
                "licenseModel": "License included",
            },
            round(od + 0.046 * vcpus, 4),
        ),
        (
            "sqlweb",
            {"preInstalledSw": "SQL Web", "operation": "RunInstances:0200"},
            round(od + 0.016 * vcpus, 4),
        ),
        (
            "dedicated",
            {"tenancy": "Dedicated", "usagetype": f"{prefix}DedicatedUsage:{itype}"},
            round(od * 1.1, 4),
        ),
        (
            "unused-cr",
            {
                "capacitystatus": "UnusedCapacityReservation",
                "usagetype": f"{prefix}UnusedBox:{itype}",
            },
            round(od * 1.05, 4),
        ),
        (
            "allocated-cr",
            {
                "capacitystatus": "AllocatedCapacityReservation",
                "usagetype": f"{prefix}Reservation:{itype}",
            },
            0.0,
        ),
    ]
    out = []
    for variant, overrides, price in variants:
        sku = _sku(region, itype, variant)
        attrs = {**base, **overrides}
        os_name = attrs["operatingSystem"]
        out.append(
            {
                "product": {
                    "productFamily": "Compute Instance",
                    "attributes": attrs,
                    "sku": sku,
                },
                "serviceCode": "AmazonEC2",
                "terms": {
                    "OnDemand": {
                        f"{sku}.{OD_TERM}": {
                            "priceDimensions": {
                                f"{sku}.{OD_TERM}.{HRS_RATE}": {
                                    "unit": "Hrs",
                                    "endRange": "Inf",
                                    "description": (
                                        f"${price:g} per On Demand {os_name} {itype} Instance Hour"
                                    ),
                                    "appliesTo": [],
                                    "rateCode": f"{sku}.{OD_TERM}.{HRS_RATE}",
                                    "beginRange": "0",
                                    "pricePerUnit": {"USD": f"{price:.10f}"},
                                }
                            },
                            "sku": sku,
                            "effectiveDate": "2026-11-01T00:00:00Z",
                            "offerTermCode": OD_TERM,
                            "termAttributes": {},
                        }
                    },
                    "Reserved": {
                        f"{sku}.{RESERVED_TERM}": {
                            "priceDimensions": {
                                f"{sku}.{RESERVED_TERM}.{HRS_RATE}": {
                                    "unit": "Hrs",
                                    "endRange": "Inf",
                                    "description": f"{os_name} {itype} reserved hour",
                                    "appliesTo": [],
                                    "rateCode": f"{sku}.{RESERVED_TERM}.{HRS_RATE}",
                                    "beginRange": "0",
                                    "pricePerUnit": {"USD": f"{price * 0.62:.10f}"},
                                }
                            },
                            "sku": sku,
                            "effectiveDate": "2026-11-01T00:00:00Z",
                            "offerTermCode": RESERVED_TERM,
                            "termAttributes": {
                                "LeaseContractLength": "1yr",
                                "OfferingClass": "standard",
                                "PurchaseOption": "No Upfront",
                            },
                        }
                    },
                },
                "version": "20261101000000",
                "publicationDate": "2026-11-01T00:00:00Z",
            }
        )
    return out


def _usage_prefix(region: str) -> str:
    zones = _moto_zone_table().get(region)
    short = zones[0][1].split("-az")[0] if zones else region.replace("-", "")
    return f"{short.upper()}-"


@functools.cache
def _price_catalog(path: Path) -> tuple[dict[str, Any], ...]:
    """The Price List products for the CSV: built once per process (~0.3 s), never
    mutated (the fake only serialises them)."""
    from moto.ec2.models.instance_types import INSTANCE_TYPES

    on_demand: dict[tuple[str, str], dict[str, str]] = {}
    with path.open(newline="") as fh:
        for row in csv.DictReader(fh):
            if row["on_demand_usd_per_hour"]:
                on_demand[(row["region"], row["instance_type"])] = row
    products: list[dict[str, Any]] = []
    for (region, itype), row in sorted(on_demand.items()):
        gpu = INSTANCE_TYPES.get(itype, {}).get("GpuInfo")
        products.extend(_ec2_products(region, itype, row, gpu))
    return tuple(products)


# moto's instance-type data is static and the same in every region: its serialised pages
# are kept for the whole test run (serialising 100 types takes moto about 0.25 s).
_TYPE_PAGES: dict[tuple[str, ...], bytes] = {}


class FakeAWS(FakeServer[tuple[str, str, str]]):
    """EC2 + Price List + Service Quotas + SQS behind one local URL (see module doc).

    Attributes a test may read or set:
      ``url`` — the base URL (after ``start()``); ``calls`` — Counter of
      ``(service, action, region)``; ``latency`` — ``None`` or ``(lo, hi)`` seconds;
      ``now`` — the fake's clock (``None`` = real time; set a datetime to freeze it);
      ``page_size`` — per-action cap on items per page (AWS may return fewer items
      than MaxResults; the caps make every paginator take several pages);
      ``default_region`` — the region of unsigned requests that name none;
      ``spot_advisor`` — the Spot Instance Advisor document served (see module doc) and
      ``advisor_gaps`` — region -> the GPU type it leaves out; ``advisor_modified`` — the
      document's ``Last-Modified`` (None: ``snapshot_time``); ``chaos``/``faulted`` —
      random faults (``fake_server``); ``throttle_headers`` — what a random throttle
      carries.
    """

    thread_name = "fake-aws"

    def __init__(
        self,
        *,
        prices_csv: Path = DEFAULT_PRICES_CSV,
        default_region: str = "us-east-1",
        seed: int = 7,
        snapshot_time: datetime | None = None,
    ) -> None:
        super().__init__()
        self.default_region = default_region
        self.seed = seed
        self.account_id = ACCOUNT_ID
        self.page_size: dict[str, int] = {
            "DescribeSpotPriceHistory": 50,
            "GetSpotPlacementScores": 10,
            "DescribeInstanceTypes": 100,
            "DescribeInstanceTypeOfferings": 100,
            "GetProducts": 20,
            "ListServiceQuotas": 5,
            "DescribeCapacityReservations": 5,
        }
        self._reservations: dict[str, _CapacityReservation] = {}
        self._now: datetime | None = None
        self._faults: list[_Fault] = []
        self._scores: dict[tuple[str, str | None, frozenset[str] | None], int] = {}
        self._quotas: dict[tuple[str, str], float] = {}
        self._zones = _moto_zone_table()
        self.snapshot_time = snapshot_time or (
            datetime.now(UTC).replace(microsecond=0) - timedelta(hours=1)
        )
        # (region, zone name, instance type, product description) -> [(ts, price)] sorted
        self._spot: dict[tuple[str, str, str, str], list[tuple[datetime, float]]] = {}
        # region -> instance type -> set of zone ids
        self._type_zones: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
        self._products: tuple[dict[str, Any], ...] = ()
        self.advisor_gaps: dict[str, str] = {}
        self.throttle_headers: dict[str, str] = {"Retry-After": "1"}
        self.spot_advisor: dict[str, Any] = {}
        self.advisor_modified: datetime | None = None
        self._load(prices_csv)
        self._session: aiohttp.ClientSession | None = None
        self._moto: Any = None  # werkzeug server running moto's app
        self._moto_thread: threading.Thread | None = None
        self._moto_url = ""
        self._clients: list[Any] = []

    # ------------------------------------------------------------------ data
    def _load(self, path: Path) -> None:
        with path.open(newline="") as fh:
            for row in csv.DictReader(fh):
                region, zone_id, itype = row["region"], row["zone"], row["instance_type"]
                self._type_zones[region][itype].add(zone_id)
                if row["spot_usd_per_hour"]:
                    zone = self.zone_name(region, zone_id)
                    linux = float(row["spot_usd_per_hour"])
                    windows = round(linux + 0.046 * int(row["vcpus"]), 4)
                    for product, price in (("Linux/UNIX", linux), ("Windows", windows)):
                        self._spot[(region, zone, itype, product)] = [(self.snapshot_time, price)]
        self._products = _price_catalog(path)
        self.spot_advisor = self._advisor_document(path)

    def _draw(self, *parts: str) -> int:
        """A number 0..255, the same for the same seed and parts."""
        return hashlib.sha256("|".join((str(self.seed), *parts)).encode()).digest()[0]

    def _advisor_document(self, path: Path) -> dict[str, Any]:
        """The Spot Instance Advisor document (shape real, values invented: module doc)."""
        specs: dict[str, dict[str, Any]] = {}
        by_region: dict[str, set[str]] = defaultdict(set)
        with path.open(newline="") as fh:
            for row in csv.DictReader(fh):
                itype = row["instance_type"]
                specs[itype] = {"emr": itype.startswith(("g4dn", "g5.", "p3")),
                                "cores": int(row["vcpus"]),
                                "ram_gb": float(row["memory_gib"])}
                by_region[row["region"]].add(itype)
        # Interruption bands skewed low, as the real document's are for most types.
        bands = (0, 0, 0, 1, 1, 2, 3, 4)
        advisor: dict[str, Any] = {}
        for region, types in sorted(by_region.items()):
            ordered = sorted(types, key=lambda t: (self._draw(region, t, "gap"), t))
            self.advisor_gaps[region] = ordered[0]
            linux = {t: {"s": 50 + self._draw(region, t, "s") % 40,
                         "r": bands[self._draw(region, t, "r") % len(bands)]}
                     for t in sorted(ordered[1:])}
            linux["m5.large"] = {"s": 54, "r": 0}  # CPU types are in the document too
            linux["c5.xlarge"] = {"s": 61, "r": 1}
            windows = {t: {"s": max(0, v["s"] - 20), "r": v["r"]} for t, v in linux.items()}
            advisor[region] = {"Linux": linux, "Windows": windows}
        specs["m5.large"] = {"emr": True, "cores": 2, "ram_gb": 8.0}
        specs["c5.xlarge"] = {"emr": True, "cores": 4, "ram_gb": 8.0}
        return {"global_rate": "<10%", "instance_types": specs,
                "ranges": [dict(r) for r in ADVISOR_RANGES], "spot_advisor": advisor}

    # ------------------------------------------------------------ zone names
    def zone_name(self, region: str, zone_id: str) -> str:
        """``use1-az1`` -> ``us-east-1b`` (moto's DescribeAvailabilityZones mapping)."""
        for name, zid in self._zones.get(region, []):
            if zid == zone_id:
                return name
        n = int(zone_id.rsplit("-az", 1)[1])
        return f"{region}{'abcdefghijklmnop'[n - 1]}"

    def zone_id(self, region: str, zone_name: str) -> str:
        """``us-east-1b`` -> ``use1-az1``; the inverse of ``zone_name``."""
        for name, zid in self._zones.get(region, []):
            if name == zone_name:
                return zid
        short = _usage_prefix(region)[:-1].lower()
        return f"{short}-az{'abcdefghijklmnop'.index(zone_name[-1]) + 1}"

    # ----------------------------------------------------------- test knobs
    @property
    def now(self) -> datetime:
        return self._now or datetime.now(UTC)

    @now.setter
    def now(self, value: datetime | None) -> None:
        self._now = value

    def set_spot_price(
        self,
        region: str,
        zone: str,
        instance_type: str,
        price: float,
        at: datetime | None = None,
        product_description: str = "Linux/UNIX",
    ) -> None:
        """Add a spot price point (``zone`` by name ``us-east-1b`` or ID ``use1-az1``)."""
        name = zone if _AZ_NAME.match(zone) else self.zone_name(region, zone)
        with self._lock:
            points = self._spot.setdefault((region, name, instance_type, product_description), [])
            points.append((at or self.now, float(price)))
            points.sort(key=lambda p: p[0])

    def spot_price(
        self, region: str, zone: str, instance_type: str, product: str = "Linux/UNIX"
    ) -> float | None:
        """The newest spot price the fake holds for that pool (for assertions)."""
        name = zone if _AZ_NAME.match(zone) else self.zone_name(region, zone)
        with self._lock:
            points = self._spot.get((region, name, instance_type, product))
            return points[-1][1] if points else None

    def on_demand_price(self, region: str, instance_type: str) -> float | None:
        """The Linux/Shared/Used on-demand price GetProducts serves (for assertions)."""
        for product in self._products:
            attrs = product["product"]["attributes"]
            if (
                attrs["regionCode"] == region
                and attrs["instanceType"] == instance_type
                and product["product"]["sku"] == _sku(region, instance_type, "linux")
            ):
                (term,) = product["terms"]["OnDemand"].values()
                (dim,) = term["priceDimensions"].values()
                return float(dim["pricePerUnit"]["USD"])
        return None

    def set_placement_score(
        self,
        region: str,
        score: int,
        *,
        az_id: str | None = None,
        instance_types: list[str] | None = None,
    ) -> None:
        """Pin GetSpotPlacementScores for a region (``az_id=None``: the region-level
        score and every zone of it) and, optionally, only for that exact type set."""
        if not 1 <= score <= 10:
            raise ValueError("placement scores are 1..10")
        key_types = frozenset(instance_types) if instance_types else None
        with self._lock:
            self._scores[(region, az_id, key_types)] = score

    def set_interruption_band(self, region: str, instance_type: str, index: int | None,
                              os_name: str = "Linux") -> None:
        """Pin the Spot Instance Advisor's band (``ranges`` index 0..4) for a type in a
        region; ``None`` removes the type from the document."""
        with self._lock:
            types = self.spot_advisor["spot_advisor"].setdefault(region, {}).setdefault(
                os_name, {})
            if index is None:
                types.pop(instance_type, None)
            else:
                types[instance_type] = {"s": types.get(instance_type, {}).get("s", 70),
                                        "r": index}

    def set_quota(self, region: str, code: str, value: float) -> None:
        """Set an EC2 quota value (``L-DB2E81BA`` ...) in one region."""
        if code not in EC2_QUOTAS:
            raise KeyError(f"unknown EC2 quota code {code}; known: {sorted(EC2_QUOTAS)}")
        with self._lock:
            self._quotas[(region, code)] = float(value)

    def add_capacity_reservation(
        self,
        region: str,
        zone: str,
        instance_type: str,
        count: int,
        *,
        in_use: int = 0,
        platform: str = "Linux/UNIX",
        tenancy: str = "default",
        match: str = "open",
        end_date: datetime | None = None,
        state: str = "active",
        reservation_type: str = "default",
        raw: dict[str, str | None] | None = None,
    ) -> str:
        """A capacity reservation, made without a call and without checks (``zone`` by
        name); ``raw`` overrides answered fields by their XML name (``None`` leaves one
        out). Returns its id."""
        now = self.now
        with self._lock:
            seed = f"{self.seed}|{region}|{len(self._reservations)}"
            rid = f"cr-{hashlib.sha256(seed.encode()).hexdigest()[:17]}"
            self._reservations[rid] = _CapacityReservation(
                rid, region, zone, instance_type, platform, tenancy, count, match,
                "limited" if end_date else "unlimited", end_date, state, now,
                reservation_type, in_use, raw)
        return rid

    def use_capacity_reservation(self, reservation_id: str, in_use: int) -> None:
        """Say that ``in_use`` instances run in the reservation."""
        with self._lock:
            self._reservations[reservation_id].in_use = in_use

    def fail(
        self,
        action: str,
        code: str | None = None,
        status: int | None = None,
        times: int | None = 1,
        message: str = "Request limit exceeded.",
        *,
        service: str | None = None,
        region: str | None = None,
    ) -> None:
        """Make the next ``times`` calls of ``action`` (``None``: all, until
        ``clear_faults()``) fail. Defaults per service: EC2 ``RequestLimitExceeded``/503,
        pricing ``ThrottlingException``/400, servicequotas ``TooManyRequestsException``/400,
        SQS ``ThrottlingException``/400, S3 (``GetObject`` of the advisor document)
        ``SlowDown``/503. ``service``/``region`` narrow the match."""
        with self._lock:
            self._faults.append(_Fault(action, service, region, code, status, message, times))

    def call_count(
        self, service: str | None = None, action: str | None = None, region: str | None = None
    ) -> int:
        with self._lock:
            return sum(
                n
                for (s, a, r), n in self.calls.items()
                if (service is None or s == service)
                and (action is None or a == action)
                and (region is None or r == region)
            )

    # -------------------------------------------------------- boto3 helpers
    def client(self, service: str, region: str = "us-east-1", *, unsigned: bool = False) -> Any:
        """A real boto3 client on this fake: no retries, fake creds (or unsigned); S3
        path-style (the only addressing the fake serves)."""
        import boto3
        from botocore import UNSIGNED
        from botocore.config import Config

        config = Config(
            retries={"total_max_attempts": 1, "mode": "standard"},
            signature_version=UNSIGNED if unsigned else None,
            connect_timeout=5,
            read_timeout=30,
            max_pool_connections=50,
            s3={"addressing_style": "path"},
        )
        creds = (
            {} if unsigned else {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
        )
        client = boto3.client(
            service, region_name=region, endpoint_url=self.url, config=config, **creds
        )
        self._clients.append(client)  # closed by stop(): no stray sockets at teardown
        return client

    def _internal_client(self, service: str, region: str) -> Any:
        client = self.client(service, region)

        def mark(request: Any, **_: Any) -> None:
            request.headers["X-Fake-Internal"] = "1"

        client.meta.events.register("before-sign", mark)
        return client

    def sqs_url(self, region: str, name: str) -> str:
        """The queue URL this fake (like AWS) gives queue ``name`` in ``region``."""
        return f"https://sqs.{region}.amazonaws.com/{self.account_id}/{name}"

    def create_queue(self, region: str, name: str) -> str:
        """Create an SQS queue (not counted in ``calls``); returns its URL."""
        resp = self._internal_client("sqs", region).create_queue(QueueName=name)
        return str(resp["QueueUrl"])

    def send_ec2_event(
        self,
        queue_url: str,
        detail_type: str,
        detail: dict[str, Any],
        region: str | None = None,
    ) -> dict[str, Any]:
        """Put an EventBridge-shaped EC2 event on the queue (as an EventBridge rule with an
        SQS target delivers it: the event JSON is the message body). ``detail_type`` is
        e.g. "EC2 Spot Instance Interruption Warning" (detail ``{"instance-id",
        "instance-action": "terminate"}``), "EC2 Instance Rebalance Recommendation"
        (``{"instance-id"}``), "EC2 Instance State-change Notification"
        (``{"instance-id", "state"}``). Returns the event sent."""
        m = _QUEUE_HOST.search(queue_url)
        region = region or (m.group(1) if m else self.default_region)
        detail = dict(detail)
        instance_id = detail.setdefault("instance-id", f"i-{uuid.uuid4().hex[:17]}")
        event = {
            "version": "0",
            "id": str(uuid.uuid4()),
            "detail-type": detail_type,
            "source": "aws.ec2",
            "account": self.account_id,
            "time": self.now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "region": region,
            "resources": [f"arn:aws:ec2:{region}:{self.account_id}:instance/{instance_id}"],
            "detail": detail,
        }
        self._internal_client("sqs", region).send_message(
            QueueUrl=queue_url, MessageBody=json.dumps(event)
        )
        return event

    # ------------------------------------------------------------ lifecycle
    def start(self) -> Self:
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no per-request lines
        # What moto's ThreadedMotoServer does, but with a short poll interval: its
        # serve_forever() polls every 0.5 s, so stopping it cost 0.5 s per test.
        self._moto = make_server(
            "127.0.0.1", 0, DomainDispatcherApplication(create_backend_app), threaded=True
        )
        self._moto_thread = threading.Thread(
            target=self._moto.serve_forever,
            kwargs={"poll_interval": 0.02},
            name="fake-aws-moto",
            daemon=True,
        )
        self._moto_thread.start()
        self._moto_url = f"http://127.0.0.1:{self._moto.server_port}"
        return super().start()

    def _application(self) -> web.Application:
        # Outermost: every call is classified and counted, also those a random fault hits.
        return web.Application(client_max_size=16 * 1024 * 1024,
                               middlewares=[self._count_middleware])

    @web.middleware
    async def _count_middleware(
        self, request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        try:
            call: _Call | None = self._classify(request, await request.read())
        except FakeAWSError:
            call = None  # answered by _handle, in the error's shape
        request[CALL] = call
        if call is not None and not call.internal:
            with self._lock:
                self.calls[(call.service, call.action, call.region)] += 1
        return await handler(request)

    # --------------------------------------------------------- random faults
    def _chaos_applies(self, request: web.Request) -> bool:
        call = request.get(CALL)
        return call is not None and not call.internal

    def _throttled(self, request: web.Request) -> web.StreamResponse:
        call = request[CALL]
        assert call is not None
        code = CHAOS_CODES[call.service][0]
        message = {"ec2": "Request limit exceeded.", "s3": "Please reduce your request rate."
                   }.get(call.service, "Rate exceeded")
        response = self._error(call, FakeAWSError(code, message,
                                                  THROTTLE_STATUS.get(call.service, 400)))
        response.headers.update(self.throttle_headers)
        return response

    def _server_error(self, request: web.Request, status: int) -> web.StreamResponse:
        call = request[CALL]
        assert call is not None
        code = CHAOS_CODES[call.service][1 if status == 500 else 2]
        message = ("We encountered an internal error. Please try again." if status == 500
                   else "The service is unavailable. Please try again shortly.")
        return self._error(call, FakeAWSError(code, message, status))

    async def _astart(self) -> str:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=100), auto_decompress=False
        )
        async with self._session.post(f"{self._moto_url}/moto-api/reset") as resp:
            resp.raise_for_status()
        return await super()._astart()

    async def _astop(self) -> None:
        await super()._astop()
        if self._session is not None:
            await self._session.close()

    def stop(self) -> None:
        for client in self._clients:
            client.close()
        self._clients.clear()
        super().stop()
        if self._moto is not None:
            self._moto.shutdown()
            self._moto.server_close()
            assert self._moto_thread is not None
            self._moto_thread.join(10)
            self._moto = None

    # -------------------------------------------------------------- routing
    def _classify(self, request: web.Request, body: bytes) -> _Call:
        headers = request.headers
        auth = headers.get("Authorization", "")
        scope = re.search(r"Credential=[^/]+/\d{8}/([^/]+)/([^/]+)/aws4_request", auth)
        signed_region = scope.group(1) if scope else None
        internal = headers.get("X-Fake-Internal") == "1"
        if request.method == "GET" and request.path == ADVISOR_PATH:
            region = signed_region or self.default_region
            return _Call("s3", "GetObject", region, bool(scope), internal, "application/xml",
                         "", {}, body, {})
        target = headers.get("X-Amz-Target", "")
        json_body: dict[str, Any] = {}
        params: dict[str, str] = {}
        hint: str | None = None
        if target:
            prefix, _, action = target.partition(".")
            if prefix not in JSON_TARGETS:
                raise FakeAWSError("UnknownOperationException", f"unknown target {target}")
            service, content_type, ns = JSON_TARGETS[prefix]
            if body:
                json_body = json.loads(body)
            queue_url = json_body.get("QueueUrl")
            if isinstance(queue_url, str) and (m := _QUEUE_HOST.search(queue_url)):
                hint = m.group(1)
        else:
            params = dict(parse_qsl(body.decode(), keep_blank_values=True))
            params.update({k: v for k, v in request.query.items() if k not in params})
            action = params.get("Action", "")
            if not action:
                raise FakeAWSError("MissingAction", "no X-Amz-Target and no Action", 400)
            service = scope.group(2) if scope and scope.group(2) == "sqs" else "ec2"
            content_type, ns = "text/xml;charset=UTF-8", ""
            zone = params.get("AvailabilityZone") or params.get("Placement.AvailabilityZone")
            zone = zone or next(iter(_filters(params).get("availability-zone", [])), None)
            if zone and (m := _AZ_NAME.match(zone)):
                hint = m.group(1)
        region = signed_region or hint or self.default_region
        return _Call(
            service,
            action,
            region,
            bool(scope),
            internal,
            content_type,
            ns,
            params,
            body,
            json_body,
        )

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        call = request.get(CALL)  # classified and counted by _count_middleware
        if call is None:
            try:
                call = self._classify(request, await request.read())
            except FakeAWSError as err:
                return web.Response(status=err.status, text=err.message)
        if not call.internal:
            await self._delay()
            fault = self._take_fault(call)
            if fault is not None:
                return self._error(call, fault)
        try:
            return await self._dispatch(call, request)
        except FakeAWSError as err:
            return self._error(call, err)

    def _take_fault(self, call: _Call) -> FakeAWSError | None:
        fault = self._take(self._faults, lambda f: f.action == call.action
                           and f.service in (None, call.service)
                           and f.region in (None, call.region))
        if fault is None:
            return None
        code, status = DEFAULT_FAULT[call.service]
        return FakeAWSError(fault.code or code, fault.message, fault.status or status)

    def _error(self, call: _Call, err: FakeAWSError) -> web.Response:
        request_id = str(uuid.uuid4())
        if call.service == "s3":
            xml = (
                '<?xml version="1.0" encoding="UTF-8"?>\n<Error>'
                f"<Code>{escape(err.code)}</Code><Message>{escape(err.message)}</Message>"
                f"<RequestId>{request_id[:16].upper()}</RequestId><HostId>fake</HostId></Error>"
            )
            return web.Response(
                status=err.status,
                body=xml.encode(),
                headers={"Content-Type": "application/xml", "x-amz-request-id": request_id},
            )
        if call.service == "ec2" or not call.error_ns:
            xml = (
                '<?xml version="1.0" encoding="UTF-8"?>\n<Response><Errors><Error>'
                f"<Code>{escape(err.code)}</Code><Message>{escape(err.message)}</Message>"
                f"</Error></Errors><RequestID>{request_id}</RequestID></Response>"
            )
            return web.Response(
                status=err.status,
                body=xml.encode(),
                headers={"Content-Type": "text/xml;charset=UTF-8"},
            )
        headers = {
            "Content-Type": call.content_type,
            "x-amzn-RequestId": request_id,
            "x-amzn-ErrorType": err.code,
        }
        if call.service == "sqs":  # awsQueryCompatible: botocore reads the code from here
            headers["x-amzn-query-error"] = (
                f"{err.code};{'Sender' if err.status < 500 else 'Receiver'}"
            )
        payload = {"__type": f"{call.error_ns}#{err.code}", "message": err.message}
        return web.Response(status=err.status, body=json.dumps(payload).encode(), headers=headers)

    async def _dispatch(self, call: _Call, request: web.Request) -> web.StreamResponse:
        if call.service == "s3":
            return self._advisor_object()
        if call.service == "pricing":
            return self._json(call, self._pricing(call))
        if call.service == "servicequotas":
            return self._json(call, self._quotas_api(call))
        if call.service == "ec2":
            own = {
                "DescribeSpotPriceHistory": self._spot_price_history,
                "GetSpotPlacementScores": self._placement_scores,
                "DescribeInstanceTypeOfferings": self._offerings,
                "CreateCapacityReservation": self._create_capacity_reservation,
                "DescribeCapacityReservations": self._describe_capacity_reservations,
                "CancelCapacityReservation": self._cancel_capacity_reservation,
            }.get(call.action)
            if own is not None:
                return web.Response(
                    body=own(call), headers={"Content-Type": "text/xml;charset=UTF-8"}
                )
            if call.action == "DescribeInstanceTypes":
                return await self._instance_types(call, request)
        return await self._proxy(call, request)

    def _advisor_object(self) -> web.Response:
        """GetObject of the advisor document, as S3 answers it."""
        with self._lock:
            body = json.dumps(self.spot_advisor, separators=(",", ":")).encode()
            modified = self.advisor_modified or self.snapshot_time
        headers = {
            "Content-Type": "application/json",
            "ETag": f'"{hashlib.md5(body, usedforsecurity=False).hexdigest()}"',
            "Last-Modified": modified.astimezone(UTC).strftime("%a, %d %b %Y %H:%M:%S GMT"),
            "Accept-Ranges": "bytes",
            "x-amz-request-id": uuid.uuid4().hex[:16].upper(),
        }
        return web.Response(body=body, headers=headers)

    def _json(self, call: _Call, payload: dict[str, Any]) -> web.Response:
        return web.Response(
            body=json.dumps(payload).encode(),
            headers={"Content-Type": call.content_type, "x-amzn-RequestId": str(uuid.uuid4())},
        )

    def _page(
        self, call: _Call, items: list[Any], max_results: Any, token: str | None
    ) -> tuple[list[Any], str | None]:
        start = _offset(call.action, token)
        size = self.page_size.get(call.action, 100)
        if max_results not in (None, ""):
            size = min(size, int(max_results))
        end = start + max(size, 1)
        return items[start:end], (_token(call.action, end) if end < len(items) else None)

    # ------------------------------------------------------------------ moto
    async def _proxy(
        self, call: _Call, request: web.Request, body: bytes | None = None
    ) -> web.Response:
        assert self._session is not None
        signing = "sqs" if call.service == "sqs" else call.service
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower()
            not in {"host", "content-length", "transfer-encoding", "connection", "accept-encoding"}
        }
        # moto picks the backend from the SigV4 scope and the region from the host.
        headers["Host"] = f"{signing}.{call.region}.amazonaws.com"
        if not call.signed:
            headers["Authorization"] = (
                "AWS4-HMAC-SHA256 Credential=anonymous/20260101/"
                f"{call.region}/{signing}/aws4_request, SignedHeaders=host, Signature=0"
            )
        async with self._session.request(
            request.method,
            f"{self._moto_url}{request.path_qs}",
            headers=headers,
            data=call.body if body is None else body,
        ) as resp:
            data = await resp.read()
            keep = {
                k: v
                for k, v in resp.headers.items()
                if k.lower().startswith("x-amz") or k.lower() == "content-type"
            }
        if call.service == "sqs":  # real queue URLs are https
            data = data.replace(b"http://sqs.", b"https://sqs.")
        return web.Response(status=resp.status, body=data, headers=keep)

    async def _instance_types(self, call: _Call, request: web.Request) -> web.Response:
        """Real EC2 pages DescribeInstanceTypes (≤100 a page); moto answers all ~1,260
        types at once and takes ~2 s to serialise them. So: match names with moto's own
        backend code here, then let moto serialise just this page's types."""
        from moto.ec2.models.instance_types import (
            INSTANCE_TYPES,
            InstanceType,
            InstanceTypeBackend,
        )

        p = call.params
        names = _indexed(p, "InstanceType")
        if any(n not in INSTANCE_TYPES for n in names) or any(
            name not in InstanceType._filter_attributes for name in _filters(p)
        ):
            return await self._proxy(call, request)  # moto's genuine error answer
        matched = InstanceTypeBackend().describe_instance_types(names, _filters(p))
        page, token = self._page(
            call, [t["InstanceType"] for t in matched], p.get("MaxResults"), p.get("NextToken")
        )
        if not page:
            xml = _ec2_xml(call.action, "<instanceTypeSet/>")
            return web.Response(body=xml, headers={"Content-Type": "text/xml;charset=UTF-8"})
        cached = _TYPE_PAGES.get(tuple(page))
        if cached is not None:
            resp = web.Response(body=cached, headers={"Content-Type": "text/xml;charset=UTF-8"})
        else:
            forward = {"Action": call.action, "Version": p.get("Version", "2016-11-15")}
            forward.update({f"InstanceType.{i}": name for i, name in enumerate(page, 1)})
            resp = await self._proxy(call, request, body=urlencode(forward).encode())
            if resp.status == 200 and isinstance(resp.body, bytes):
                _TYPE_PAGES[tuple(page)] = resp.body
        if resp.status != 200 or not token or not isinstance(resp.body, bytes):
            return resp
        closing = f"</{call.action}Response>".encode()
        resp.body = resp.body.replace(closing, _next_token_xml(token).encode() + closing)
        return resp

    def _offerings(self, call: _Call) -> bytes:
        from moto.ec2.models.instance_types import INSTANCE_TYPE_OFFERINGS

        p = call.params
        location_type = p.get("LocationType") or "region"
        if location_type not in INSTANCE_TYPE_OFFERINGS:
            raise FakeAWSError("InvalidParameterValue", f"bad LocationType {location_type}")
        filters = _filters(p)
        for name in filters:
            if name not in ("location", "instance-type"):
                raise FakeAWSError("InvalidParameterValue", f"The filter '{name}' is invalid")
        rows = [
            o
            for o in INSTANCE_TYPE_OFFERINGS[location_type].get(call.region, [])
            if _wild(o["InstanceType"], filters.get("instance-type", ["*"]))
            and _wild(o["Location"], filters.get("location", ["*"]))
        ]
        page, token = self._page(call, rows, p.get("MaxResults"), p.get("NextToken"))
        items = [
            {
                "instanceType": o["InstanceType"],
                "locationType": location_type,
                "location": o["Location"],
            }
            for o in page
        ]
        return _ec2_xml(
            call.action,
            _xml_items("instanceTypeOfferingSet", items) + _next_token_xml(token),
        )

    # ------------------------------------------------------------------ spot
    def _spot_price_history(self, call: _Call) -> bytes:
        p = call.params
        filters = _filters(p)
        types = _indexed(p, "InstanceType") + filters.get("instance-type", [])
        products = _indexed(p, "ProductDescription") + filters.get("product-description", [])
        zones = filters.get("availability-zone", [])
        if p.get("AvailabilityZone"):
            zones.append(p["AvailabilityZone"])
        zone_ids = filters.get("availability-zone-id", [])
        if p.get("AvailabilityZoneId"):
            zone_ids.append(p["AvailabilityZoneId"])
        start = _parse_ts(p["StartTime"]) if p.get("StartTime") else None
        end = _parse_ts(p["EndTime"]) if p.get("EndTime") else None
        rows: list[tuple[datetime, str, str, str, float]] = []
        with self._lock:
            for (region, zone, itype, product), points in self._spot.items():
                if region != call.region:
                    continue
                if types and not _wild(itype, types):
                    continue
                if products and not _wild(product, products):
                    continue
                if zones and not _wild(zone, zones):
                    continue
                if zone_ids and not _wild(self.zone_id(region, zone), zone_ids):
                    continue
                chosen = [(ts, price) for ts, price in points if end is None or ts <= end]
                if start is not None:
                    before = [pt for pt in chosen if pt[0] < start]
                    chosen = before[-1:] + [pt for pt in chosen if pt[0] >= start]
                rows.extend((ts, zone, itype, product, price) for ts, price in chosen)
        rows.sort(key=lambda r: (-r[0].timestamp(), r[1], r[2], r[3]))
        page, token = self._page(call, rows, p.get("MaxResults"), p.get("NextToken"))
        items = [
            {
                "instanceType": itype,
                "productDescription": product,
                "spotPrice": f"{price:.6f}",
                "timestamp": _iso(ts),
                "availabilityZone": zone,
                "availabilityZoneId": self.zone_id(call.region, zone),
            }
            for ts, zone, itype, product, price in page
        ]
        return _ec2_xml(
            call.action, _xml_items("spotPriceHistorySet", items) + _next_token_xml(token)
        )

    def _score(self, region: str, az_id: str | None, types: list[str], capacity: int) -> int:
        key_types = frozenset(types)
        with self._lock:
            for key in (
                (region, az_id, key_types),
                (region, az_id, None),
                (region, None, key_types),
                (region, None, None),
            ):
                if key in self._scores:
                    return self._scores[key]
        seed = f"{self.seed}|{region}|{az_id or ''}|{','.join(sorted(types))}"
        base = 1 + hashlib.sha256(seed.encode()).digest()[0] % 10
        return max(1, base - min(3, int(math.log10(max(capacity, 1)))))

    def _placement_scores(self, call: _Call) -> bytes:
        p = call.params
        types = _indexed(p, "InstanceType")
        if not types:
            raise FakeAWSError("MissingParameter", "InstanceTypes is required (fake)")
        if not p.get("TargetCapacity"):
            raise FakeAWSError(
                "MissingParameter", "The request must contain the parameter TargetCapacity"
            )
        capacity = int(p["TargetCapacity"])
        single_az = p.get("SingleAvailabilityZone", "false").lower() == "true"
        regions = _indexed(p, "RegionName") or sorted(self._type_zones)
        items: list[dict[str, str]] = []
        for region in regions:
            zone_ids = sorted(
                set().union(*(self._type_zones.get(region, {}).get(t, set()) for t in types))
            )
            if not zone_ids:
                continue
            if single_az:
                for az in zone_ids:
                    score = self._score(region, az, types, capacity)
                    items.append({"region": region, "availabilityZoneId": az, "score": str(score)})
            else:
                score = self._score(region, None, types, capacity)
                items.append({"region": region, "score": str(score)})
        items.sort(key=lambda i: (-int(i["score"]), i["region"], i.get("availabilityZoneId", "")))
        page, token = self._page(call, items, p.get("MaxResults"), p.get("NextToken"))
        return _ec2_xml(
            call.action, _xml_items("spotPlacementScoreSet", page) + _next_token_xml(token)
        )

    # --------------------------------------------------- capacity reservations
    def _cr_fields(self, cr: _CapacityReservation) -> dict[str, str]:
        """A reservation's answered fields (XML names, EC2's order), as listed now."""
        state = cr.state
        if state == "active" and cr.end_date is not None and cr.end_date <= self.now:
            state = "expired"
        fields = {
            "capacityReservationId": cr.id,
            "ownerId": self.account_id,
            "capacityReservationArn": (
                f"arn:aws:ec2:{cr.region}:{self.account_id}:capacity-reservation/{cr.id}"),
            "availabilityZoneId": self.zone_id(cr.region, cr.zone),
            "instanceType": cr.instance_type,
            "instancePlatform": cr.platform,
            "availabilityZone": cr.zone,
            "tenancy": cr.tenancy,
            "totalInstanceCount": str(cr.total),
            "availableInstanceCount": str(max(0, cr.total - cr.in_use)),
            "ebsOptimized": "true",
            "ephemeralStorage": "false",
            "state": state,
            "startDate": _iso(cr.created),
            **({"endDate": _iso(cr.end_date)} if cr.end_date is not None else {}),
            "endDateType": cr.end_date_type,
            "instanceMatchCriteria": cr.match,
            "createDate": _iso(cr.created),
            "reservationType": cr.reservation_type,
            "deliveryPreference": "fixed",
        }
        for key, value in (cr.raw or {}).items():
            if value is None:
                fields.pop(key, None)
            else:
                fields[key] = value
        return fields

    @staticmethod
    def _cr_xml(tag: str, fields: dict[str, str]) -> str:
        inner = "".join(f"<{k}>{escape(v)}</{k}>" for k, v in fields.items())
        return f"<{tag}>{inner}<tagSet/></{tag}>"

    def _create_capacity_reservation(self, call: _Call) -> bytes:
        from moto.ec2.models.instance_types import INSTANCE_TYPE_OFFERINGS, INSTANCE_TYPES

        p = call.params
        for name in ("InstanceType", "InstancePlatform", "InstanceCount"):
            if not p.get(name):
                raise FakeAWSError("MissingParameter",
                                   f"The request must contain the parameter {name}")
        itype, platform = p["InstanceType"], p["InstancePlatform"]
        if itype not in INSTANCE_TYPES:
            raise FakeAWSError("InvalidParameterValue",
                               f"Invalid value '{itype}' for InstanceType.")
        if platform not in CR_PLATFORMS:
            raise FakeAWSError("InvalidParameterValue",
                               f"Invalid value '{platform}' for InstancePlatform.")
        zone = p.get("AvailabilityZone")
        if not zone and p.get("AvailabilityZoneId"):
            zone = next((n for n, z in self._zones.get(call.region, [])
                         if z == p["AvailabilityZoneId"]), None)
        if not zone or zone not in [n for n, _ in self._zones.get(call.region, [])]:
            raise FakeAWSError("InvalidParameterValue",
                               f"Invalid availability zone: [{zone or ''}]")
        offered = {o["InstanceType"] for o in
                   INSTANCE_TYPE_OFFERINGS["availability-zone"].get(call.region, [])
                   if o["Location"] == zone}
        if itype not in offered:
            raise FakeAWSError("Unsupported", f"Your requested instance type ({itype}) is "
                               f"not supported in your requested Availability Zone ({zone}).")
        count = int(p["InstanceCount"])
        if count < 1:
            raise FakeAWSError("InvalidParameterValue",
                               f"Invalid value '{count}' for InstanceCount.")
        end_type = p.get("EndDateType", "unlimited")
        end = _parse_ts(p["EndDate"]) if p.get("EndDate") else None
        if (end_type == "limited") != (end is not None) or end_type not in (
                "limited", "unlimited"):
            raise FakeAWSError("InvalidParameterCombination",
                               "EndDate must be given with EndDateType limited, and only then.")
        match = p.get("InstanceMatchCriteria", "open")
        if match not in ("open", "targeted"):
            raise FakeAWSError("InvalidParameterValue",
                               f"Invalid value '{match}' for InstanceMatchCriteria.")
        rid = self.add_capacity_reservation(
            call.region, zone, itype, count, platform=platform,
            tenancy=p.get("Tenancy", "default"), match=match, end_date=end)
        with self._lock:
            fields = self._cr_fields(self._reservations[rid])
        return _ec2_xml(call.action, self._cr_xml("capacityReservation", fields))

    def _describe_capacity_reservations(self, call: _Call) -> bytes:
        p = call.params
        ids = _indexed(p, "CapacityReservationId")
        filters = _filters(p)
        for name in filters:
            if name not in CR_FILTERS:
                raise FakeAWSError("InvalidParameterValue", f"The filter '{name}' is invalid")
        max_results = p.get("MaxResults")
        if max_results and not 1 <= int(max_results) <= 1000:
            raise FakeAWSError("InvalidParameterValue",
                               f"Value ({max_results}) for parameter maxResults is invalid.")
        with self._lock:
            mine = [cr for cr in self._reservations.values() if cr.region == call.region]
            missing = [i for i in ids if i not in {cr.id for cr in mine}]
            if missing:
                raise FakeAWSError("InvalidCapacityReservationId.NotFound",
                                   f"The capacity reservation ID '{missing[0]}' does not exist")
            rows = [self._cr_fields(cr) for cr in mine if not ids or cr.id in ids]
        rows = [r for r in rows if all(_wild(r.get(CR_FILTERS[name], ""), values)
                                       for name, values in filters.items())]
        page, token = self._page(call, rows, max_results, p.get("NextToken"))
        items = "".join(self._cr_xml("item", r) for r in page)
        return _ec2_xml(call.action, f"<capacityReservationSet>{items}</capacityReservationSet>"
                        + _next_token_xml(token))

    def _cancel_capacity_reservation(self, call: _Call) -> bytes:
        rid = call.params.get("CapacityReservationId", "")
        with self._lock:
            cr = self._reservations.get(rid)
            if cr is None or cr.region != call.region:
                raise FakeAWSError("InvalidCapacityReservationId.NotFound",
                                   f"The capacity reservation ID '{rid}' does not exist")
            cr.state = "cancelled"
        return _ec2_xml(call.action, "<return>true</return>")

    # --------------------------------------------------------------- pricing
    def _pricing(self, call: _Call) -> dict[str, Any]:
        body = call.json_body
        if call.action != "GetProducts":
            raise FakeAWSError("UnknownOperationException", f"{call.action} is not faked")
        if body.get("FormatVersion", "aws_v1") != "aws_v1":
            raise FakeAWSError("InvalidParameterException", "FormatVersion must be aws_v1")
        service_code = body.get("ServiceCode")
        if not service_code:
            raise FakeAWSError("InvalidParameterException", "ServiceCode is required")
        products = list(self._products) if service_code == "AmazonEC2" else []
        # The most selective filters first; each product's fields are lowered once.
        selective = {"instancetype": 0, "regioncode": 1}
        filters = sorted(body.get("Filters", []),
                         key=lambda f: selective.get(str(f.get("Field", "")).lower(), 2))
        for flt in filters:
            products = [pr for pr in products if self._price_filter(pr, flt)]
        page, token = self._page(call, products, body.get("MaxResults"), body.get("NextToken"))
        out: dict[str, Any] = {
            "FormatVersion": "aws_v1",
            "PriceList": [json.dumps({k: v for k, v in pr.items() if k != "_fields"})
                          for pr in page],
        }
        if token:
            out["NextToken"] = token
        return out

    @staticmethod
    def _price_filter(product: dict[str, Any], flt: dict[str, str]) -> bool:
        kind, field, value = flt.get("Type", ""), flt.get("Field", ""), flt.get("Value", "")
        fields = product.get("_fields")
        if fields is None:
            fields = {k.lower(): v for k, v in product["product"]["attributes"].items()}
            fields["productfamily"] = product["product"]["productFamily"]
            fields["sku"] = product["product"]["sku"]
            product["_fields"] = fields
        have = fields.get(field.lower())
        if kind in ("TERM_MATCH", "EQUALS"):
            return have is not None and have.lower() == value.lower()
        if kind == "CONTAINS":
            return have is not None and value.lower() in have.lower()
        if kind in ("ANY_OF", "NONE_OF"):
            wanted = {v.strip().lower() for v in value.split(",")}
            hit = have is not None and have.lower() in wanted
            return hit if kind == "ANY_OF" else not hit
        raise FakeAWSError("InvalidParameterException", f"unknown filter type {kind!r}")

    # ---------------------------------------------------------------- quotas
    def _quota(self, region: str, code: str, default: bool = False) -> dict[str, Any]:
        name, usage_class, default_value = EC2_QUOTAS[code]
        with self._lock:
            value = default_value if default else self._quotas.get((region, code), default_value)
        return {
            "ServiceCode": "ec2",
            "ServiceName": "Amazon Elastic Compute Cloud (Amazon EC2)",
            "QuotaArn": f"arn:aws:servicequotas:{region}:{self.account_id}:ec2/{code}",
            "QuotaCode": code,
            "QuotaName": name,
            "Value": value,
            "Unit": "None",
            "Adjustable": True,
            "GlobalQuota": False,
            "UsageMetric": {
                "MetricNamespace": "AWS/Usage",
                "MetricName": "ResourceCount",
                "MetricDimensions": {
                    "Class": usage_class,
                    "Resource": "vCPU",
                    "Service": "EC2",
                    "Type": "Resource",
                },
                "MetricStatisticRecommendation": "Maximum",
            },
            "QuotaAppliedAtLevel": "ACCOUNT",
        }

    def _quotas_api(self, call: _Call) -> dict[str, Any]:
        body = call.json_body
        service_code = body.get("ServiceCode")
        if service_code != "ec2":
            raise FakeAWSError(
                "NoSuchResourceException", f"The service {service_code} does not exist (fake)"
            )
        if call.action in ("GetServiceQuota", "GetAWSDefaultServiceQuota"):
            code = body.get("QuotaCode", "")
            if code not in EC2_QUOTAS:
                raise FakeAWSError(
                    "NoSuchResourceException", f"The quota {code} does not exist for ec2."
                )
            default = call.action == "GetAWSDefaultServiceQuota"
            return {"Quota": self._quota(call.region, code, default)}
        if call.action in ("ListServiceQuotas", "ListAWSDefaultServiceQuotas"):
            default = call.action == "ListAWSDefaultServiceQuotas"
            quotas = [self._quota(call.region, code, default) for code in EC2_QUOTAS]
            page, token = self._page(call, quotas, body.get("MaxResults"), body.get("NextToken"))
            out: dict[str, Any] = {"Quotas": page}
            if token:
                out["NextToken"] = token
            return out
        raise FakeAWSError("UnknownOperationException", f"{call.action} is not faked")


def fake_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake credentials in the environment (AWS_* = testing, region us-east-1, no
    profile/config files, no instance metadata lookups)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.delenv("AWS_PROFILE", raising=False)


@pytest.fixture(name="fake_aws")
def fake_aws_fixture(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeAWS]:
    """A running FakeAWS with fake credentials in the environment (`fake_credentials`)."""
    fake_credentials(monkeypatch)
    with contextlib.ExitStack() as stack:
        yield stack.enter_context(FakeAWS())
