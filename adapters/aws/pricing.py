"""Reading AWS's answers: Price List documents, GPU names, quota families, scores,
Spot Instance Advisor interruption bands.

Pure functions over plain data, so each mapping has a table-driven test.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from adapters.common import reserved_count
from adapters.gpus import canonical
from adapters.hazard import AWS_WINDOW_HOURS, hazard_from_band

# EC2 vCPU quotas for GPU instance families: (on-demand, spot) quota codes.
QUOTA_CODES: dict[str, tuple[str, str]] = {
    "G": ("L-DB2E81BA", "L-3819A6DF"),  # Running On-Demand G and VT / All G and VT Spot
    "P": ("L-417A185B", "L-7212CCBC"),  # Running On-Demand P / All P Spot Instance Requests
}


def quota_family(instance_type: str) -> str | None:
    """`g5.xlarge`, `vt1.3xlarge` → "G"; `p5.48xlarge`, `p6-b200.48xlarge` → "P"."""
    family = instance_type.split(".", 1)[0].lower()
    if family.startswith(("g", "vt")):
        return "G"
    if family.startswith("p"):
        return "P"
    return None


def gpu_of(type_info: dict[str, Any]) -> tuple[str, int, float | None, bool]:
    """(canonical GPU name, GPUs per instance, GPU memory GiB, known) from an
    `InstanceTypeInfo`'s `GpuInfo`. Instance types mixing GPU models take the first."""
    gpus = type_info["GpuInfo"]["Gpus"]
    first = gpus[0]
    count = sum(int(g.get("Count", 0)) for g in gpus)
    mib = first.get("MemoryInfo", {}).get("SizeInMiB")
    mem = None if mib is None else round(mib / 1024, 1)
    name = str(first.get("Name", "unknown"))
    canon, known = canonical(name, mem)
    return canon, count, mem, known


def on_demand_price(documents: Sequence[Mapping[str, Any] | str], instance_type: str,
                    region: str) -> float | None:
    """The hourly USD price in the Price List documents for `instance_type` in `region`.

    Checks the product attributes again (a filter the API ignored must not turn a
    Windows or dedicated-host price into ours) and takes the `Hrs` dimension of the
    OnDemand term. None if no document matches or the price is 0 (AWS lists 0 for types
    not sold on demand)."""
    for doc in documents:
        product: Mapping[str, Any] = json.loads(doc) if isinstance(doc, str) else doc
        attrs = product.get("product", {}).get("attributes", {})
        if attrs.get("instanceType") != instance_type or attrs.get("regionCode") != region:
            continue
        if (attrs.get("operatingSystem") != "Linux" or attrs.get("tenancy") != "Shared"
                or attrs.get("preInstalledSw") != "NA"
                or attrs.get("capacitystatus") != "Used"):
            continue
        for term in product.get("terms", {}).get("OnDemand", {}).values():
            for dim in term.get("priceDimensions", {}).values():
                if dim.get("unit") not in ("Hrs", "Hours"):
                    continue
                usd = float(dim.get("pricePerUnit", {}).get("USD", "nan"))
                if math.isfinite(usd) and usd > 0:
                    return usd
    return None


def availability_of(score: int | None) -> float | None:
    """A spot placement score (1–10, 10 = very likely to succeed) as availability 0..1."""
    if score is None:
        return None
    return max(0.0, min(1.0, score / 10))


def headroom_gpus(quota_vcpus: float | None, vcpus: int | None, gpus: int) -> int | None:
    """How many GPUs of this instance type fit in a vCPU quota (usage not subtracted:
    that is a CloudWatch metric, not a Service Quotas field)."""
    if quota_vcpus is None or not vcpus:
        return None
    return int(quota_vcpus // vcpus) * gpus


# --- Spot Instance Advisor -------------------------------------------------------------

def band_rate(label: str) -> float | None:
    """A Spot Instance Advisor band label (`<5%`, `5-10%`, ..., `>20%`: the share of
    spot instances interrupted over the trailing month) as interruptions per hour, by the
    one interruption model (`adapters.hazard`, window `AWS_WINDOW_HOURS`). None for a
    label that reads as no band."""
    return hazard_from_band(label, AWS_WINDOW_HOURS)


def interruption_rates(document: Mapping[str, Any], regions: Collection[str],
                       os_name: str = "Linux") -> dict[str, dict[str, float]]:
    """Region → instance type → interruptions per hour, for `regions`, from the Spot
    Instance Advisor document (`ranges`: [{index, label, max}], `spot_advisor`:
    {region: {os: {instance type: {"s": savings %, "r": range index}}}}). Entries whose
    range is unknown are left out (unknown, not a guess). Raises `ValueError` when the
    document lacks `ranges` or `spot_advisor`."""
    ranges = document.get("ranges")
    advisor = document.get("spot_advisor")
    if not isinstance(ranges, list) or not isinstance(advisor, Mapping):
        raise ValueError("not a Spot Instance Advisor document (no ranges/spot_advisor)")
    rate_of: dict[int, float] = {}
    for band in ranges:
        if isinstance(band, Mapping) and isinstance(band.get("index"), int):
            rate = band_rate(str(band.get("label", "")))
            if rate is not None:
                rate_of[band["index"]] = rate
    out: dict[str, dict[str, float]] = {}
    for region in regions:
        types = advisor.get(region, {})
        types = types.get(os_name, {}) if isinstance(types, Mapping) else {}
        if not isinstance(types, Mapping):
            continue
        out[region] = {
            str(itype): rate_of[entry["r"]] for itype, entry in types.items()
            if isinstance(entry, Mapping) and isinstance(entry.get("r"), int)
            and entry["r"] in rate_of}
    return out


# --- capacity reservations ---------------------------------------------------------------

RESERVATIONS_PERMISSION = "ec2:DescribeCapacityReservations"


@dataclass(frozen=True, slots=True)
class Reservation:
    """One usable EC2 On-Demand Capacity Reservation: `total` instances of
    `instance_type` in `zone` (a zone name), `available` of them free now."""

    id: str
    zone: str
    instance_type: str
    total: int
    available: int


def reservation_of(raw: Mapping[str, Any], region: str, now: datetime) -> Reservation:
    """A `DescribeCapacityReservations` entry as a `Reservation`, or `ValueError` saying
    why it is not one the broker can offer: not active, ended (`EndDateType` limited and
    `EndDate` past), a Capacity Block or an interruptible reservation (neither is read),
    in another region, or garbled (a field missing, a count negative, absurd or above the
    total). Platform (`InstancePlatform`), tenancy and `InstanceMatchCriteria` are not
    checked: a targeted reservation is launched into by its id, which the offer's target
    carries; an open one is also used by any matching launch."""
    if not isinstance(raw, Mapping):
        raise ValueError("not an object")
    rid = raw.get("CapacityReservationId")
    if not isinstance(rid, str) or not rid:
        raise ValueError("no CapacityReservationId")
    if raw.get("State") != "active":
        raise ValueError(f"state {raw.get('State')!r}, not active")
    if raw.get("ReservationType") == "capacity-block":
        raise ValueError("a Capacity Block (not read)")
    if raw.get("Interruptible") is True:
        raise ValueError("an interruptible reservation (not read)")
    itype = raw.get("InstanceType")
    if not isinstance(itype, str) or not itype:
        raise ValueError("no InstanceType")
    zone = raw.get("AvailabilityZone")
    if not isinstance(zone, str) or not zone.startswith(region) or zone == region:
        raise ValueError(f"zone {zone!r} is not a zone of {region}")
    end = raw.get("EndDate")
    if raw.get("EndDateType") == "limited" and isinstance(end, datetime):
        if end.tzinfo is None:
            end = end.replace(tzinfo=UTC)
        if end <= now:
            raise ValueError(f"ended at {end.isoformat()}")
    total = reserved_count(raw.get("TotalInstanceCount"))
    available = reserved_count(raw.get("AvailableInstanceCount"))
    if available > total:
        raise ValueError(f"{available} available of {total}")
    return Reservation(rid, zone, itype, total, available)
