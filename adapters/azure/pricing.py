"""Reading Azure's answers: GPU models from VM size names, SKUs and their restrictions,
Retail Prices items, vCPU quotas, Spot eviction-rate bands.

Pure functions over the services' JSON (camelCase, as ARM and the Retail Prices API send
it), so each mapping has a table-driven test.

Decisions where Azure is silent or irregular:

* **The GPU model is not a field**: it comes from the size name (`SERIES` below, one row
  per VM series). The count is the SKU's `GPUs` capability when present, else the
  series' count for that size; the adapter logs a mismatch between the two.
* **H100 NVL** (NCads_H100_v5, NCCads_H100_v5) has 94 GB per GPU; it is offered as
  `H100-80GB` (it serves whoever asks for an 80 GB H100), with `gpu_memory_gb` 94.
* **Fractional GPUs** (NVads_A10_v5 below 36 vCPUs: 1/6 to 1/2 of an A10; NCads_A10_v4
  below 32; NVv4 below 32; NGads_V620 below 32) are left out: a pool's `gpus` is whole
  GPUs per instance, and a slice of a GPU is not what a request for one GPU means.
* **Unknown sizes** with a `GPUs` capability are kept, their model named after the
  accelerator in the size name (`Standard_NC128lds_xl_RTXPRO6000BSE_v6` →
  `RTXPRO6000BSE`) and flagged unknown; retired models the canonical table does not
  know (K80, M60, P40, MI25) are kept the same way.
* **Restrictions** for this subscription: `type: Location` (any reason code:
  `NotAvailableForSubscription`, `QuotaId`) drops the size from the region; `type: Zone`
  drops those zones; a zonal size whose every zone is restricted is dropped too.
* **Zones**: a pool's zone is `<region>-<zone>` (`eastus-2`); a size the region offers
  without zones (regions without availability zones) is one pool whose zone is the
  region name.
* **Prices**: Linux only (a `productName` with the word `Windows` or its catalog
  abbreviation `Win`, as in `Virtual Machines NCCadsv5 Srs Win`, is skipped), no Cloud
  Services (`productName` with `Cloud Services` / `CloudServices`), primary meter
  regions only (`isPrimaryMeterRegion: false` is skipped), meters ending in ` Spot`
  are spot prices, ` Low Priority` meters are ignored, prices are per `unitOfMeasure`
  (`1 Hour`, `10 Hours` ...). Of several items for one size and market the newest
  `effectiveStartDate` wins among those already in effect: a price whose
  `effectiveStartDate` is after the adapter's clock is ignored until then.
* **Eviction rates**: Resource Graph gives a band of the share of Spot VMs of a size
  evicted over the last 28 days (`0-5`, `5-10`, `10-15`, `15-20`, `20+`, in %). The
  one interruption model (`adapters.hazard`) reads it: the band's midpoint (25 % for
  the open `20+` band) as the chance p of an eviction within 28 × 24 h, the hazard
  λ = −ln(1 − p) / 672 per hour: 0-5 → 3.77e-5, 5-10 → 1.16e-4, 10-15 → 1.99e-4,
  15-20 → 2.86e-4, 20+ → 4.28e-4.
* **Quota headroom** (GPUs): spot from `lowPriorityCores`; on-demand from the size's
  family quota (the SKU's `family` names the usage entry) capped by the regional
  `cores`; `limit − currentValue` vCPUs, in whole instances, times GPUs per instance.
  A family the usage list lacks is unknown (`None`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from fractions import Fraction
from typing import Any, NamedTuple

from adapters.common import reserved_count
from adapters.gpus import canonical
from adapters.hazard import AZURE_WINDOW_HOURS, hazard_from_band


@dataclass(frozen=True, slots=True)
class Series:
    """One VM series: its size-name pattern (lowercase, without `standard_`; group 1 is
    the vCPU count), GPU model, memory per GPU (GB) and GPUs per size by vCPUs."""

    pattern: re.Pattern[str]
    model: str
    memory_gb: float
    gpus: dict[int, Fraction]


def _s(pattern: str, model: str, memory_gb: float, gpus: dict[int, Any]) -> Series:
    return Series(re.compile(pattern), model, memory_gb,
                  {k: Fraction(v) for k, v in gpus.items()})


SERIES: tuple[Series, ...] = (
    _s(r"nd(\d+)amsr_a100_v4", "A100", 80, {96: 8}),
    _s(r"nd(\d+)asr_v4", "A100", 40, {96: 8}),
    _s(r"nc(\d+)ads_a100_v4", "A100", 80, {24: 1, 48: 2, 96: 4}),
    _s(r"nd(\d+)isr_h100_v5", "H100", 80, {96: 8}),
    _s(r"ncc?(\d+)adi?s_h100_v5", "H100", 94, {40: 1, 80: 2}),  # H100 NVL
    _s(r"nd(\d+)isr_h200_v5", "H200", 141, {96: 8}),
    _s(r"nd(\d+)isr_mi300x_v5", "MI300X", 192, {96: 8}),
    _s(r"nc(\d+)as_t4_v3", "T4", 16, {4: 1, 8: 1, 16: 1, 64: 4}),
    _s(r"nc(\d+)r?s_v3", "V100", 16, {6: 1, 12: 2, 24: 4}),
    _s(r"nd(\d+)rs_v2", "V100", 32, {40: 8}),
    _s(r"nv(\d+)adm?s_a10_v5", "A10", 24,
       {6: "1/6", 12: "1/3", 18: "1/2", 36: 1, 72: 2}),
    _s(r"nc(\d+)ads_a10_v4", "A10", 24, {8: "1/3", 16: "2/3", 32: 1}),
    _s(r"nc(\d+)r?s_v2", "P100", 16, {6: 1, 12: 2, 24: 4}),
    _s(r"nd(\d+)r?s", "P40", 24, {6: 1, 12: 2, 24: 4}),
    _s(r"nv(\d+)as_v4", "MI25", 16, {4: "1/8", 8: "1/4", 16: "1/2", 32: 1}),
    _s(r"ng(\d+)ads_v620_v1", "V620", 32, {8: "1/4", 16: "1/2", 32: 1}),
    _s(r"nv(\d+)s_v3", "M60", 8, {12: 1, 24: 2, 48: 4}),
    _s(r"nv(\d+)(?:_promo)?", "M60", 8, {6: 1, 12: 2, 24: 4}),
    _s(r"nc(\d+)r?(?:_promo)?", "K80", 12, {6: 1, 12: 2, 24: 4}),
)


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """What a VM size has: `count` whole GPUs of `model` (canonical if `known`).
    `name_count` is what the size name says (None if it says nothing)."""

    model: str
    count: int
    memory_gb: float | None
    known: bool
    name_count: int | None


def gpu_of(size: str, gpus_capability: int | None = None) -> GpuSpec | None:
    """The GPUs of a VM size, from its name and its `GPUs` capability. None for a size
    without GPUs or with less than one whole GPU."""
    short = size.lower().removeprefix("standard_")
    for series in SERIES:
        m = series.pattern.fullmatch(short)
        if m is None:
            continue
        share = series.gpus.get(int(m.group(1)))
        if share is not None and share < 1:
            return None  # a fraction of a GPU
        name_count = int(share) if share is not None else None
        count = gpus_capability if gpus_capability else name_count
        if not count:
            return None
        model, known = canonical(series.model, series.memory_gb)
        return GpuSpec(model, count, series.memory_gb, known, name_count)
    if not gpus_capability:
        return None
    parts = size.split("_")[1:]
    accel = [p for p in parts[1:] if re.search(r"[A-Za-z]", p) and re.search(r"\d", p)
             and not re.fullmatch(r"v\d+", p, re.IGNORECASE)]
    model = accel[-1] if accel else size
    return GpuSpec(model, gpus_capability, None, canonical(model)[1], None)


@dataclass(frozen=True, slots=True)
class VmSize:
    """A GPU VM size the subscription may use in a region."""

    name: str
    family: str
    vcpus: int | None
    memory_gb: float | None
    gpu: GpuSpec
    spot: bool  # LowPriorityCapable
    zones: tuple[str, ...]  # allowed zones ("1", "2" ...); () = a regional size


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def vm_size(sku: dict[str, Any], region: str) -> VmSize | None:
    """A Resource SKU as a GPU VM size this subscription may use in `region`, or None
    (not a VM, no whole GPU, or restricted in the region)."""
    if str(sku.get("resourceType", "")).lower() != "virtualmachines":
        return None
    caps = {str(c.get("name")): c.get("value") for c in sku.get("capabilities") or []}
    gpus = _number(caps.get("GPUs"))
    name = str(sku.get("name", ""))
    gpu = gpu_of(name, int(gpus) if gpus else None)
    if gpu is None:
        return None
    region = region.lower()
    zones: set[str] = set()
    for info in sku.get("locationInfo") or []:
        if str(info.get("location", "")).lower() == region:
            zones.update(str(z) for z in info.get("zones") or [])
    listed = bool(zones)
    for r in sku.get("restrictions") or []:
        info = r.get("restrictionInfo") or {}
        where = {str(x).lower() for x in (info.get("locations") or r.get("values") or [])}
        if region not in where:
            continue
        kind = str(r.get("type", "")).lower()
        if kind == "location":
            return None
        if kind == "zone":
            zones -= {str(z) for z in info.get("zones") or []}
    if listed and not zones:
        return None
    vcpus = _number(caps.get("vCPUs"))
    return VmSize(
        name=name, family=str(sku.get("family") or ""),
        vcpus=None if vcpus is None else int(vcpus), memory_gb=_number(caps.get("MemoryGB")),
        gpu=gpu, spot=str(caps.get("LowPriorityCapable", "True")).lower() != "false",
        zones=tuple(sorted(zones, key=lambda z: (len(z), z))))


def zone_name(region: str, zone: str | None) -> str:
    """A pool's zone: `eastus-2`, or the region for a size offered without zones."""
    return f"{region}-{zone}" if zone else region


class Prices(NamedTuple):
    """USD per hour by lowercase VM size name."""

    on_demand: dict[str, float]
    spot: dict[str, float]


_HOURS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s+hours?\s*$", re.IGNORECASE)
# Not a Linux VM price: Windows by every spelling the catalog uses (`... Series Windows`,
# `... Srs Win`), and Cloud Services (`... Cloud Services`, `...CloudServices`).
_NOT_LINUX_VM = re.compile(r"\bwin(?:dows)?\b|cloud\s*services", re.IGNORECASE)


def _since(item: Mapping[str, Any]) -> datetime | None:
    """An item's `effectiveStartDate` (`2026-11-01T00:00:00Z`), None if unreadable."""
    try:
        when = datetime.fromisoformat(str(item.get("effectiveStartDate", "")))
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def prices_of(items: list[dict[str, Any]], region: str, now: datetime | None = None
              ) -> Prices:
    """Linux pay-as-you-go and spot prices per VM size from Retail Prices items, as of
    `now` (prices not yet in effect are ignored; None: all of them count).

    Checks every item again (a filter the API ignored must not turn a Windows, Cloud
    Services, non-primary region, low priority, DevTest or reservation price into ours)."""
    best: dict[tuple[str, bool], tuple[str, float]] = {}
    for item in items:
        if (item.get("serviceName") != "Virtual Machines"
                or str(item.get("armRegionName", "")).lower() != region.lower()
                or item.get("type") != "Consumption"
                or item.get("currencyCode", "USD") != "USD"
                or item.get("isPrimaryMeterRegion", True) is False
                or _NOT_LINUX_VM.search(str(item.get("productName", "")))):
            continue
        if now is not None:
            since = _since(item)
            if since is not None and since > now:
                continue
        meter = f"{item.get('meterName', '')}|{item.get('skuName', '')}".lower()
        if "low priority" in meter:
            continue
        spot = any(m.endswith(" spot") for m in meter.split("|"))
        hours = _HOURS.match(str(item.get("unitOfMeasure", "")))
        price = _number(item.get("unitPrice", item.get("retailPrice")))
        size = str(item.get("armSkuName", "")).lower()
        if not hours or price is None or not math.isfinite(price) or price <= 0 or not size:
            continue
        per_hour = price / float(hours.group(1))
        since = str(item.get("effectiveStartDate", ""))
        key = (size, spot)
        if key not in best or since > best[key][0]:
            best[key] = (since, per_hour)
    return Prices({s: p for (s, sp), (_, p) in best.items() if not sp},
                  {s: p for (s, sp), (_, p) in best.items() if sp})


def eviction_rate(band: str | None) -> float | None:
    """An eviction-rate band (`0-5`, `20+`: % of Spot VMs of the size evicted over the
    last 28 days) as interruptions per hour, by the one interruption model
    (`adapters.hazard`, window `AZURE_WINDOW_HOURS`); None for no or an unreadable
    band."""
    return hazard_from_band(band, AZURE_WINDOW_HOURS)


def graph_rows(data: list[Any]) -> list[dict[str, Any]]:
    """Resource Graph data as row objects: `objectArray` rows as they are, `table`
    results ({columns, rows}) zipped into objects."""
    out: list[dict[str, Any]] = []
    for part in data:
        if isinstance(part, dict) and "columns" in part and "rows" in part:
            names = [str(c.get("name")) for c in part["columns"]]
            out.extend(dict(zip(names, row, strict=False)) for row in part["rows"])
        elif isinstance(part, dict):
            out.append(part)
    return out


def evictions_of(data: list[Any], region: str) -> dict[str, float]:
    """Interruptions per hour by lowercase VM size name, from the eviction-rate rows."""
    out: dict[str, float] = {}
    for row in graph_rows(data):
        if str(row.get("location", region)).lower() != region.lower():
            continue
        rate = eviction_rate(str(row.get("evictionRate") or row.get("spotEvictionRate")
                                 or ""))
        if rate is not None and row.get("skuName"):
            out[str(row["skuName"]).lower()] = rate
    return out


def quotas_of(usages: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """(currentValue, limit) by lowercase usage name (`standardncadsa100v4family`,
    `cores`, `lowprioritycores` ...)."""
    out: dict[str, tuple[float, float]] = {}
    for u in usages:
        name = (u.get("name") or {}).get("value")
        current, limit = _number(u.get("currentValue")), _number(u.get("limit"))
        if name and current is not None and limit is not None:
            out[str(name).lower()] = (current, limit)
    return out


def headroom_gpus(quota: tuple[float, float] | None, vcpus: int | None, gpus: int
                  ) -> int | None:
    """GPUs of a size that fit in what is left of a vCPU quota (whole instances)."""
    if quota is None or not vcpus:
        return None
    current, limit = quota
    return int(max(0.0, limit - current) // vcpus) * gpus


def on_demand_headroom(quotas: dict[str, tuple[float, float]], size: VmSize) -> int | None:
    """The size's family quota, capped by the regional vCPU quota."""
    family = headroom_gpus(quotas.get(size.family.lower()), size.vcpus, size.gpu.count)
    if family is None:
        return None
    regional = headroom_gpus(quotas.get("cores"), size.vcpus, size.gpu.count)
    return family if regional is None else min(family, regional)


def spot_headroom(quotas: dict[str, tuple[float, float]], size: VmSize) -> int | None:
    """Spot VMs count against the regional low-priority vCPU quota only."""
    return headroom_gpus(quotas.get("lowprioritycores"), size.vcpus, size.gpu.count)


# --- capacity reservations ---------------------------------------------------------------

RESERVATIONS_PERMISSION = "Microsoft.Compute/capacityReservationGroups/read"
USABLE_STATES = frozenset({"succeeded", "updating"})  # provisioningState, lower case
LIVE_STATES = frozenset({"live", "partiallyfulfilled"})  # a future reservation's state
_GROUP_ID = re.compile(r"^/subscriptions/[^/]+/resourceGroups/(?P<rg>[^/]+)/providers/"
                       r"Microsoft\.Compute/capacityReservationGroups/(?P<name>[^/]+)$",
                       re.IGNORECASE)


class GroupRef(NamedTuple):
    """A capacity reservation group: its resource id (what a VM is launched with), its
    resource group and name."""

    id: str
    resource_group: str
    name: str


@dataclass(frozen=True, slots=True)
class Reservation:
    """One usable capacity reservation: `instances` VMs of `size` in `zone` (`1`, `2` ...;
    None for a regional one), `free` of them not allocated, in the group `group` (its
    resource id: the target a VM names)."""

    group: str
    name: str
    size: str
    zone: str | None
    instances: int
    free: int


def group_of(raw: Mapping[str, Any], region: str) -> GroupRef:
    """A listed capacity reservation group of `region` whose reservations the broker
    reads, or `ValueError` saying why not: another region, a Block group (time-boxed
    capacity blocks are not read), or no readable resource id."""
    if not isinstance(raw, Mapping):
        raise ValueError("not an object")
    if str(raw.get("location", "")).lower() != region:
        raise ValueError(f"in {raw.get('location')!r}, not {region}")
    rid = raw.get("id")
    m = _GROUP_ID.match(rid) if isinstance(rid, str) else None
    if m is None:
        raise ValueError(f"resource id {rid!r} is not a capacity reservation group's")
    props = raw.get("properties")
    kind = props.get("reservationType") if isinstance(props, Mapping) else None
    if isinstance(kind, str) and kind.lower() == "block":
        raise ValueError("a Block group (capacity blocks are not read)")
    return GroupRef(str(rid), m["rg"], m["name"])


def utilization_by_name(group: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """A group's instance view (`$expand=instanceView`): reservation name (lower case) →
    its instance view (`utilizationInfo`, `statuses`, `reservationStateInfo`)."""
    props = group.get("properties")
    view = props.get("instanceView") if isinstance(props, Mapping) else None
    entries = view.get("capacityReservations") if isinstance(view, Mapping) else None
    return {str(e["name"]).lower(): e for e in entries or ()
            if isinstance(e, Mapping) and isinstance(e.get("name"), str)}


def reservation_of(raw: Mapping[str, Any], group: GroupRef, region: str,
                   views: Mapping[str, Mapping[str, Any]]) -> Reservation:
    """A capacity reservation of `group` as a `Reservation`, or `ValueError` saying why it
    is not one the broker can offer: not provisioned (`provisioningState` other than
    Succeeded or Updating), a future reservation not live yet, another region, or garbled
    (no size, a count negative or absurd, no utilisation, more than one zone).

    Its size is `sku.capacity` — or the instance view's `currentCapacity`, what is
    reserved now, when it gives one; `free` is that less the VMs allocated in it
    (`utilizationInfo.virtualMachinesAllocated`), never below 0 (Azure lets VMs
    overallocate a reservation, without its guarantee). The instance view is the
    group's entry for the reservation (`views`), else the reservation's own."""
    if not isinstance(raw, Mapping):
        raise ValueError("not an object")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("no name")
    if str(raw.get("location", region)).lower() != region:
        raise ValueError(f"in {raw.get('location')!r}, not {region}")
    props = raw.get("properties")
    props = props if isinstance(props, Mapping) else {}
    state = props.get("provisioningState")
    if not isinstance(state, str) or state.lower() not in USABLE_STATES:
        raise ValueError(f"provisioningState {state!r}, not Succeeded")
    sku = raw.get("sku")
    size = sku.get("name") if isinstance(sku, Mapping) else None
    if not isinstance(size, str) or not size:
        raise ValueError("no sku.name")
    instances = reserved_count(sku.get("capacity") if isinstance(sku, Mapping) else None,
                       "sku.capacity")
    zones = raw.get("zones") or []
    if not isinstance(zones, list) or len(zones) > 1:
        raise ValueError(f"zones {zones!r}: a reservation has at most one")
    view = views.get(name.lower())
    if view is None:
        own = props.get("instanceView")
        view = own if isinstance(own, Mapping) else None
    info = view.get("utilizationInfo") if view is not None else None
    if not isinstance(info, Mapping):
        raise ValueError("no utilizationInfo")
    state_info = view.get("reservationStateInfo") if view is not None else None
    live = state_info.get("reservationState") if isinstance(state_info, Mapping) else None
    if isinstance(live, str) and live.lower() not in LIVE_STATES:
        raise ValueError(f"a future reservation, {live}")
    if info.get("currentCapacity") is not None:
        instances = reserved_count(info["currentCapacity"], "currentCapacity")
    allocated = info.get("virtualMachinesAllocated", [])
    if not isinstance(allocated, list):
        raise ValueError("virtualMachinesAllocated is not a list")
    return Reservation(group.id, name, size, str(zones[0]) if zones else None, instances,
                       max(0, instances - len(allocated)))
