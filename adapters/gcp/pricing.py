"""Reading Google Cloud's answers: GPU names, machine shapes, Billing Catalog SKUs, quotas,
stock-outs.

Pure functions over plain data, so each mapping has a table-driven test.

**What is offered.** Machine types with built-in GPUs (`accelerators[]` of the machine
types API: a2, a3, a4, g2 ...) are offered as they are. GPUs attached to N1 machines
(T4, V100, P100, P4) are offered in the common shapes only: 1, 2, 4 and 8 GPUs (up to the
zone's `maximumCardsPerInstance`), each on the N1 standard machine with **8 vCPUs per
GPU** (`n1-standard-8` for one GPU, `-16` for two, `-32` for four, `-64` for eight;
30 GB RAM per GPU), which every one of those GPUs accepts. Such an offer's instance
type is ``<machine type>+<accelerator type>x<count>``, e.g.
``n1-standard-16+nvidia-tesla-t4x2`` (`split_instance_type` reads it back).

**What it costs.** The Cloud Billing Catalog prices a VM by its parts: a vCPU SKU per
vCPU-hour and a RAM SKU per GiB-hour of the machine series (`A2 Instance Core running in
Iowa`, `N1 Predefined Instance Ram running in Americas` ...) plus a GPU SKU per GPU-hour
(`Nvidia Tesla A100 GPU running in ...`), each valid in the regions of its
`serviceRegions`. A VM's price is the sum of the three for its region and market; if any
part has no SKU the price is unknown (`None`) and the offer is still listed. A3 Mega and A3
Ultra have vCPU/RAM SKUs of their own (`A3Plus Instance Core ...`, `A3Ultra Instance Ram
...`), not the `A3 Instance` ones of A3 High and Edge. A machine type with bundled local
SSD (A2 Ultra, A3 High, Mega, Edge and Ultra: `BUNDLED_LOCAL_SSD_GIB`) also pays its
size in GiB × the `SSD backed Local Storage` SKU (resource family `Storage`, group
`LocalSSD`, priced per GiB-month: / 730 h), the Spot one (`... attached to Spot
Preemptible VMs`) for Spot. A4 (B200) is the exception: it has no vCPU/RAM SKUs, its `A4
Nvidia B200 (1 gpu slice)` SKU prices one GPU with its share of the VM, so an A4 VM costs
that times its GPUs.

**Which markets a shape is sold in.** Spot always; on demand not for A4, A3 Ultra and A3
High with fewer than 8 GPUs, which Google sells only reserved, flex-start or Spot
(`markets`).

**Which market.** The SKU's `category.usageType` says it: `OnDemand`, or `Preemptible`
(= Spot); `Commit1Yr` and the like are never a VM's hourly price. The description's
wording varies and does not decide: most Spot GPU SKUs read `Nvidia Tesla A100 GPU
attached to Spot Preemptible VMs running in Americas`, a few `Spot Preemptible Nvidia ...`,
Spot vCPU/RAM SKUs `Spot Preemptible A2 Instance Core ...` or, older, `Preemptible N1
Predefined Instance Core ...`; all are read. One contradiction is settled the safe way: a
description that names the Spot market on a SKU tagged `OnDemand` (some `Spot Preemptible
A4 Nvidia B200 (1 gpu slice)` SKUs, skypilot-org/skypilot#8125) is a Spot price — taking
it for the on-demand one would price on-demand VMs at the Spot rate.

**What is never matched.** SKUs for commitments, sole tenancy, custom shapes,
reservations (some priced at $0), virtual workstations, DWS (flex-start, "Defined
Duration"), Calendar mode and "Capacity Optimized" capacity: only descriptions of the
exact shapes below are. The GPU names (`GPU_SKU_NAMES`) and region wording (`running in
Iowa`, `running in Americas`, also `in Iowa`) follow the real catalog's variants: `Nvidia`
or `NVIDIA` or no vendor (`H200 141GB GPU`), a series prefix (`A4 Nvidia B200 ...`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from adapters.common import reserved_count
from adapters.gcp.sdk import AcceleratorType, MachineType, Quota
from adapters.gpus import canonical
from broker.model import Market

# --- GPUs ------------------------------------------------------------------------------

GPU_MEMORY_GB: Mapping[str, float] = {
    # accelerator type -> GB per GPU (not in the API; https://cloud.google.com/compute/docs/gpus)
    "nvidia-tesla-t4": 16,
    "nvidia-tesla-v100": 16,
    "nvidia-tesla-p100": 16,
    "nvidia-tesla-p4": 8,
    "nvidia-tesla-a100": 40,
    "nvidia-a100-80gb": 80,
    "nvidia-l4": 24,
    "nvidia-h100-80gb": 80,
    "nvidia-h100-mega-80gb": 80,
    "nvidia-h200-141gb": 141,
    "nvidia-b200": 180,
}

QUOTA_METRICS: Mapping[str, str] = {
    # accelerator type -> regional quota metric (Spot: the same with `PREEMPTIBLE_`)
    "nvidia-tesla-t4": "NVIDIA_T4_GPUS",
    "nvidia-tesla-v100": "NVIDIA_V100_GPUS",
    "nvidia-tesla-p100": "NVIDIA_P100_GPUS",
    "nvidia-tesla-p4": "NVIDIA_P4_GPUS",
    "nvidia-tesla-a100": "NVIDIA_A100_GPUS",
    "nvidia-a100-80gb": "NVIDIA_A100_80GB_GPUS",
    "nvidia-l4": "NVIDIA_L4_GPUS",
    "nvidia-h100-80gb": "NVIDIA_H100_GPUS",
    "nvidia-h100-mega-80gb": "NVIDIA_H100_MEGA_GPUS",
    "nvidia-h200-141gb": "NVIDIA_H200_GPUS",
    "nvidia-b200": "NVIDIA_B200_GPUS",
}
GLOBAL_GPU_QUOTA = "GPUS_ALL_REGIONS"

# The Billing Catalog's GPU names (between "Nvidia " and " GPU"), lower case -> accelerator.
GPU_SKU_NAMES: Mapping[str, str] = {
    "tesla t4": "nvidia-tesla-t4",
    "tesla v100": "nvidia-tesla-v100",
    "tesla p100": "nvidia-tesla-p100",
    "tesla p4": "nvidia-tesla-p4",
    "tesla a100": "nvidia-tesla-a100",
    "a100 40gb": "nvidia-tesla-a100",
    "tesla a100 80gb": "nvidia-a100-80gb",
    "a100 80gb": "nvidia-a100-80gb",
    "l4": "nvidia-l4",
    "h100 80gb": "nvidia-h100-80gb",
    "h100 80gb mega": "nvidia-h100-mega-80gb",
    "h100 mega 80gb": "nvidia-h100-mega-80gb",
    "h100 80gb plus": "nvidia-h100-mega-80gb",
    "h200 141gb": "nvidia-h200-141gb",
    "b200": "nvidia-b200",
    "b200 (1 gpu slice)": "nvidia-b200",
}

# --- machine series -----------------------------------------------------------------------

# Machine series -> the Billing Catalog's name for its vCPU and RAM SKUs. A3 High and
# Edge use "A3 Instance"; A3 Mega and Ultra have their own (`FAMILY_SKU_STEMS`).
HOST_SKU_STEMS: Mapping[str, str] = {
    "a2": "A2 Instance",
    "a3": "A3 Instance",
    "g2": "G2 Instance",
    "n1": "N1 Predefined Instance",
}
# Machine family (the name's first two parts) -> its own vCPU/RAM SKU stem, which wins
# over the series' ("A3Plus Instance Core running in Americas").
FAMILY_SKU_STEMS: Mapping[str, str] = {
    "a3-megagpu": "A3Plus Instance",
    "a3-ultragpu": "A3Ultra Instance",
}

# Machine type -> GiB of local SSD it comes with and is billed for
# (https://cloud.google.com/compute/docs/gpus: A2 Ultra 375 GiB per GPU, A3 High 750 per
# GPU, A3 Mega and Edge 6,000, A3 Ultra 12,000; the "-nolssd" variants have none). A4's
# is left out: its GPU-slice SKU prices the whole VM.
BUNDLED_LOCAL_SSD_GIB: Mapping[str, int] = {
    "a2-ultragpu-1g": 375, "a2-ultragpu-2g": 750, "a2-ultragpu-4g": 1500,
    "a2-ultragpu-8g": 3000,
    "a3-highgpu-1g": 750, "a3-highgpu-2g": 1500, "a3-highgpu-4g": 3000,
    "a3-highgpu-8g": 6000,
    "a3-megagpu-8g": 6000,
    "a3-edgegpu-8g": 6000,
    "a3-ultragpu-8g": 12000,
}
LOCAL_SSD = "local-ssd"  # the name of the local SSD's price in the index
HOURS_PER_MONTH = 730  # the Billing Catalog's month, for per-GiB-month SKUs
# Series priced per GPU "slice" (the GPU with its share of the VM): no vCPU/RAM SKUs.
SLICE_SERIES = frozenset({"a4"})
GPU_SERIES = ("a2", "a3", "a4", "g2")  # series whose machine types carry their GPUs

N1_ATTACHABLE = frozenset({"nvidia-tesla-t4", "nvidia-tesla-v100", "nvidia-tesla-p100",
                           "nvidia-tesla-p4"})
N1_GPU_COUNTS = (1, 2, 4, 8)
N1_VCPUS_PER_GPU = 8


def n1_machine_for(gpus: int) -> str:
    """The N1 machine type an N1 + GPU offer of `gpus` GPUs uses."""
    return f"n1-standard-{N1_VCPUS_PER_GPU * gpus}"


def machine_type_filter() -> str:
    """The machine types API filter for what `shapes` can use: the GPU series and the N1
    machines of the N1 + GPU shapes (a regular expression the whole name must match)."""
    n1 = "|".join(str(N1_VCPUS_PER_GPU * n) for n in N1_GPU_COUNTS)
    return f'name eq "(({"|".join(GPU_SERIES)})-.*)|(n1-standard-({n1}))"'


def n1_instance_type(machine_type: str, accelerator: str, count: int) -> str:
    return f"{machine_type}+{accelerator}x{count}"


_N1_NAME = re.compile(r"^(?P<machine>[a-z0-9-]+)\+(?P<accel>[a-z0-9-]+)x(?P<count>\d+)$")


def split_instance_type(instance_type: str) -> tuple[str, str | None, int]:
    """(machine type, attached accelerator type or None, attached count):
    ``n1-standard-16+nvidia-tesla-t4x2`` → (``n1-standard-16``, ``nvidia-tesla-t4``, 2);
    ``a2-highgpu-1g`` → (``a2-highgpu-1g``, None, 0)."""
    m = _N1_NAME.match(instance_type)
    if m is None:
        return instance_type, None, 0
    return m["machine"], m["accel"], int(m["count"])


def series(machine_type: str) -> str:
    return machine_type.split("-", 1)[0]


def host_stem(machine_type: str) -> str | None:
    """The vCPU/RAM SKU stem a machine type is priced by (None: not a series priced so)."""
    family = "-".join(machine_type.split("-", 2)[:2])
    return FAMILY_SKU_STEMS.get(family) or HOST_SKU_STEMS.get(series(machine_type))


def markets(machine_type: str, gpus: int) -> tuple[Market, ...]:
    """The markets a shape is sold in outside reservations: Spot always; on demand not
    for A4, A3 Ultra and A3 High with fewer than 8 GPUs (reservation, flex-start or Spot
    only: https://cloud.google.com/compute/docs/gpus)."""
    if (series(machine_type) == "a4" or machine_type.startswith("a3-ultragpu-")
            or (machine_type.startswith("a3-highgpu-") and gpus < 8)):
        return (Market.SPOT,)
    return (Market.ON_DEMAND, Market.SPOT)


_GONE = frozenset({"OBSOLETE", "DELETED"})  # deprecation states that can no longer launch


@dataclass(frozen=True, slots=True)
class Shape:
    """One thing a zone offers: a machine type with its GPUs."""

    instance_type: str
    machine_type: str
    vcpus: int
    memory_gib: float
    accelerator: str
    gpus: int


def shapes(machine_types: Iterable[MachineType],
           accelerators: Iterable[AcceleratorType]) -> list[Shape]:
    """What a zone offers: each machine type with built-in GPUs, and the N1 + GPU shapes
    its attachable accelerator types and N1 machine types allow."""
    out: list[Shape] = []
    by_name = {m.name: m for m in machine_types if m.deprecated not in _GONE}
    for m in by_name.values():
        if m.accelerators:
            out.append(Shape(m.name, m.name, m.vcpus, m.memory_mb / 1024,
                             m.accelerators[0][0], sum(n for _, n in m.accelerators)))
    for a in accelerators:
        if a.name not in N1_ATTACHABLE or a.deprecated in _GONE:
            continue
        for count in N1_GPU_COUNTS:
            host = by_name.get(n1_machine_for(count))
            if count > a.max_per_instance or host is None:
                continue
            out.append(Shape(n1_instance_type(host.name, a.name, count), host.name, host.vcpus,
                             host.memory_mb / 1024, a.name, count))
    return sorted(out, key=lambda s: s.instance_type)


def gpu_of(accelerator: str) -> tuple[str, float | None, bool]:
    """(canonical GPU name, GB per GPU, known) of an accelerator type."""
    mem = GPU_MEMORY_GB.get(accelerator)
    name, known = canonical(accelerator, mem)
    return name, mem, known


# --- Billing Catalog SKUs -------------------------------------------------------------------

# (region, market, "core"|"ram"|"gpu"|"slice"|"lssd", stem|accelerator|LOCAL_SSD)
PriceKey = tuple[str, Market, str, str]
PriceIndex = dict[PriceKey, float]

_USAGE = {"OnDemand": Market.ON_DEMAND, "Preemptible": Market.SPOT}
# The Spot wording: a prefix ("Spot Preemptible A2 Instance Core", the older "Preemptible
# N1 Predefined Instance Core") or, on most Spot GPU SKUs, a phrase ("Nvidia Tesla A100
# GPU attached to Spot Preemptible VMs running in Americas").
_SPOT_PREFIX = re.compile(r"^(?:Spot )?Preemptible ", re.IGNORECASE)
_SPOT_PHRASE = re.compile(r" attached to Spot Preemptible VMs\b", re.IGNORECASE)
_EXCLUDED = re.compile(
    r"commit|sole tenan|custom|reserv|premium|virtual workstation|\bdws\b|flex|calendar|"
    r"defined duration|capacity optimi[sz]ed|extended|licen[cs]", re.IGNORECASE)
_WHERE = r"(?: (?:running )?in (?P<where>.+))?"  # the region words; serviceRegions decide
_HOST = re.compile(rf"^(?P<stem>.+ Instance) (?P<part>Core|Ram){_WHERE}$")
# an optional machine series ("A4 Nvidia B200 ..."), an optional vendor ("H200 141GB GPU")
_GPU = re.compile(rf"^(?:[AG]\d[A-Z]? )?(?:Nvidia )?(?P<name>.+?)(?: GPU)?{_WHERE}$",
                  re.IGNORECASE)
_SLICE = re.compile(r"\(1 gpu slice\)$", re.IGNORECASE)
# the generic local SSD SKU ("SSD backed Local Storage in Iowa"; Spot: "... attached to
# Spot Preemptible VMs", read by _SPOT_PHRASE)
_LOCAL_SSD = re.compile(rf"^SSD backed Local Storage{_WHERE}$", re.IGNORECASE)
_GROUPS = {"core": ("CPU", "N1Standard"), "ram": ("RAM", "N1Standard"), "gpu": ("GPU",),
           "slice": ("GPU",), "lssd": ("LocalSSD",)}
_FAMILIES = {"core": "Compute", "ram": "Compute", "gpu": "Compute", "slice": "Compute",
             "lssd": "Storage"}
_UNITS = {"core": "h", "ram": "GiBy.h", "gpu": "h", "slice": "h", "lssd": "GiBy.h"}
_STEMS = frozenset(HOST_SKU_STEMS.values()) | frozenset(FAMILY_SKU_STEMS.values())


@dataclass(frozen=True, slots=True)
class SkuPrice:
    market: Market
    kind: str  # core | ram | gpu | slice (a GPU with its share of the VM) | lssd
    name: str  # the host SKU stem ("A2 Instance"), the accelerator type or LOCAL_SSD
    regions: tuple[str, ...]
    usd: float  # per vCPU-hour, GiB-hour (RAM, local SSD) or GPU-hour


def parse_sku(sku: Mapping[str, Any]) -> SkuPrice | None:
    """What a Billing Catalog SKU (its REST JSON shape) prices, or None for every SKU that
    is not the OnDemand / Preemptible price of a vCPU, a GiB of RAM, a GPU of the shapes
    this adapter offers or a GiB of local SSD (per hour; a per-GiB-month local SSD price
    is divided by 730). The market is the SKU's `usageType` (see the module doc: Spot
    wording on an `OnDemand` SKU makes it Spot, never the reverse)."""
    category = sku.get("category") or {}
    if category.get("resourceFamily") not in ("Compute", "Storage"):
        return None
    market = _USAGE.get(str(category.get("usageType", "")))
    if market is None:
        return None
    desc = " ".join(str(sku.get("description", "")).split())
    if _EXCLUDED.search(desc):
        return None
    plain = _SPOT_PHRASE.sub("", _SPOT_PREFIX.sub("", desc, count=1), count=1)
    if plain != desc:
        market = Market.SPOT
    kind, name = _what(plain)
    if kind is None or name is None:
        return None
    if (category.get("resourceGroup") not in _GROUPS[kind]
            or category.get("resourceFamily") != _FAMILIES[kind]):
        return None
    usd = unit_price(sku, _UNITS[kind])
    if usd is None and kind == "lssd" and (monthly := unit_price(sku, "GiBy.mo")) is not None:
        usd = monthly / HOURS_PER_MONTH
    regions = tuple(str(r) for r in sku.get("serviceRegions") or ())
    if usd is None or not regions:
        return None
    return SkuPrice(market, kind, name, regions, usd)


def _what(desc: str) -> tuple[str | None, str | None]:
    if _LOCAL_SSD.match(desc) is not None:
        return "lssd", LOCAL_SSD
    if (m := _HOST.match(desc)) is not None:
        if m["stem"] in _STEMS:
            return ("core" if m["part"] == "Core" else "ram"), m["stem"]
        return None, None
    if (m := _GPU.match(desc)) is not None:
        accel = GPU_SKU_NAMES.get(m["name"].lower())
        if accel is None:
            return None, None
        return ("slice" if _SLICE.search(m["name"]) else "gpu"), accel
    return None, None


def unit_price(sku: Mapping[str, Any], usage_unit: str) -> float | None:
    """USD per `usage_unit` of a SKU's current price (the first `pricingInfo`; the tier
    that starts at 0 units). None if it is priced in another unit or not at all."""
    infos = sku.get("pricingInfo") or []
    if not infos:
        return None
    expr = infos[0].get("pricingExpression") or {}
    if expr.get("usageUnit") != usage_unit:
        return None
    tiers = sorted(expr.get("tieredRates") or [],
                   key=lambda t: float(t.get("startUsageAmount") or 0))
    if not tiers:
        return None
    price = tiers[0].get("unitPrice") or {}
    currency = price.get("currencyCode", "USD")
    if currency != "USD":
        return None
    usd = int(price.get("units") or 0) + int(price.get("nanos") or 0) / 1e9
    return usd if math.isfinite(usd) and usd >= 0 else None


def index_skus(skus: Iterable[Mapping[str, Any]]) -> PriceIndex:
    """Every usable SKU price by (region, market, kind, name). Where two SKUs price the
    same thing in a region, the one naming fewer regions (the regional one, not a
    multi-regional "Americas" one) wins."""
    index: PriceIndex = {}
    span: dict[PriceKey, int] = {}
    for sku in skus:
        p = parse_sku(sku)
        if p is None:
            continue
        for region in p.regions:
            key = (region, p.market, p.kind, p.name)
            if key not in index or len(p.regions) < span[key]:
                index[key] = p.usd
                span[key] = len(p.regions)
    return index


def vm_price(index: Mapping[PriceKey, float], region: str, market: Market, shape: Shape
             ) -> float | None:
    """USD per hour of one instance of `shape`: vCPUs × core SKU + GiB × RAM SKU + GPUs ×
    GPU SKU of the region and market (the machine family's own core/RAM SKUs where it has
    them: `host_stem`), + its bundled local SSD's GiB × local SSD SKU (a slice-priced
    series: GPUs × slice SKU); None if a part is not in the catalog."""
    if series(shape.machine_type) in SLICE_SERIES:
        per_slice = index.get((region, market, "slice", shape.accelerator))
        return None if per_slice is None else per_slice * shape.gpus
    stem = host_stem(shape.machine_type)
    if stem is None:
        return None
    core = index.get((region, market, "core", stem))
    ram = index.get((region, market, "ram", stem))
    gpu = index.get((region, market, "gpu", shape.accelerator))
    if core is None or ram is None or gpu is None:
        return None
    usd = core * shape.vcpus + ram * shape.memory_gib + gpu * shape.gpus
    ssd_gib = BUNDLED_LOCAL_SSD_GIB.get(shape.machine_type, 0)
    if ssd_gib:
        ssd = index.get((region, market, "lssd", LOCAL_SSD))
        if ssd is None:
            return None
        usd += ssd * ssd_gib
    return usd


# --- quotas and stock-outs -------------------------------------------------------------------

def quota_headroom(regional: Mapping[str, Quota], global_gpus: Quota | None,
                   accelerator: str, market: Market) -> int | None:
    """GPUs of `accelerator` the project may still start in the region: the smaller of
    the regional per-model headroom (limit − usage) and the project's `GPUS_ALL_REGIONS`
    headroom; either alone if the other is unknown; None if both are.

    Spot VMs use the `PREEMPTIBLE_` quota when the project has one (limit > 0) and the
    regular quota otherwise, as Compute Engine does."""
    found: list[float] = []
    metric = QUOTA_METRICS.get(accelerator)
    if metric is not None:
        q = regional.get(metric)
        if market is Market.SPOT:
            pre = regional.get(f"PREEMPTIBLE_{metric}")
            if pre is not None and pre.limit > 0:
                q = pre
        if q is not None:
            found.append(q.limit - q.usage)
    if global_gpus is not None:
        found.append(global_gpus.limit - global_gpus.usage)
    if not found:
        return None
    return max(0, math.floor(min(found)))


@dataclass(frozen=True, slots=True)
class StockoutDecay:
    """How a stock-out seen on a pool (`ZONE_RESOURCE_POOL_EXHAUSTED`) lowers its
    availability: 0 for `hold` seconds, then rising linearly to 1 over `recover` seconds,
    then forgotten (None: GCP gives no capacity signal of its own)."""

    hold: float = 600.0
    recover: float = 3000.0

    def availability(self, age_seconds: float) -> float | None:
        if age_seconds < self.hold:
            return 0.0
        if age_seconds >= self.hold + self.recover:
            return None
        return round((age_seconds - self.hold) / self.recover, 4)

    @property
    def window(self) -> float:
        return self.hold + self.recover


# --- reservations ------------------------------------------------------------------------

RESERVATIONS_PERMISSION = "compute.reservations.list"
USABLE_STATUSES = frozenset({"READY", "UPDATING"})
"""A reservation being resized (UPDATING) still holds its VMs and its capacity."""


@dataclass(frozen=True, slots=True)
class Reservation:
    """One usable Compute Engine reservation: `count` VMs of `machine_type` (with
    `accelerators` attached, `(type, count)`) in `zone`, `free` of them not in use.
    `specific`: a VM must name the reservation to use it (`specificReservationRequired`);
    otherwise any matching VM of the project uses it."""

    name: str
    zone: str
    machine_type: str
    accelerators: tuple[tuple[str, int], ...]
    count: int
    free: int
    specific: bool


def _last(value: Any) -> str:
    """The name at the end of a full or partial resource URL (or a plain name)."""
    return value.rstrip("/").rsplit("/", 1)[-1] if isinstance(value, str) else ""


def reservation_of(raw: Mapping[str, Any], region: str, now: datetime) -> Reservation:
    """A reservation in its REST JSON shape as a `Reservation`, or `ValueError` saying why
    it is not one the broker can offer: not READY (or UPDATING), past its `deleteAtTime`,
    in another region, made from an instance template (its machine type is not in the
    answer) or garbled (a field missing, a count negative, absurd, or less than what is
    in use)."""
    if not isinstance(raw, Mapping):
        raise ValueError("not an object")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("no name")
    zone = _last(raw.get("zone"))
    if not zone or not zone.startswith(f"{region}-"):
        raise ValueError(f"zone {zone!r} is not a zone of {region}")
    if raw.get("status") not in USABLE_STATUSES:
        raise ValueError(f"status {raw.get('status')!r}, not READY")
    delete_at = raw.get("deleteAtTime")
    if delete_at is not None:
        try:
            at = datetime.fromisoformat(str(delete_at).replace("Z", "+00:00"))
        except ValueError:
            raise ValueError(f"deleteAtTime {delete_at!r} does not read") from None
        if (at if at.tzinfo else at.replace(tzinfo=UTC)) <= now:
            raise ValueError(f"deleted at {delete_at}")
    specific = raw.get("specificReservation")
    if not isinstance(specific, Mapping):
        raise ValueError("no specificReservation")
    props = specific.get("instanceProperties")
    if not isinstance(props, Mapping):
        if specific.get("sourceInstanceTemplate"):
            raise ValueError("made from an instance template (not read)")
        raise ValueError("no instanceProperties")
    machine = _last(props.get("machineType"))
    if not machine:
        raise ValueError("no machineType")
    accelerators: list[tuple[str, int]] = []
    for acc in props.get("guestAccelerators") or ():
        kind = _last(acc.get("acceleratorType")) if isinstance(acc, Mapping) else ""
        n = reserved_count(acc.get("acceleratorCount"), "acceleratorCount") if kind else 0
        if not kind or n < 1:
            raise ValueError(f"guest accelerator {acc!r} does not read")
        accelerators.append((kind, n))
    count = reserved_count(specific.get("count"), "count")
    in_use = reserved_count(specific.get("inUseCount", 0), "inUseCount")
    if in_use > count:
        raise ValueError(f"{in_use} in use of {count}")
    required = raw.get("specificReservationRequired", False)
    return Reservation(name, zone, machine, tuple(accelerators), count, count - in_use,
                       required is True)


@dataclass(frozen=True, slots=True)
class ReservedShape:
    """What a reservation's VMs are, as the adapter offers them."""

    instance_type: str
    accelerator: str
    gpus: int
    vcpus: int | None
    memory_gib: float | None


def reserved_shape(r: Reservation, zone_shapes: Sequence[Shape]) -> ReservedShape:
    """The shape a reservation's VMs have: a machine type with built-in GPUs the zone
    lists (`a2-highgpu-1g`), or an N1 machine with one attachable GPU type
    (`n1-highmem-8+nvidia-tesla-t4x1`, named as the N1 + GPU offers are; vCPUs and memory
    known only for the shapes the zone's offers use). `ValueError` for anything else (no
    GPU, a machine type the zone does not list, GPUs an N1 machine cannot take)."""
    by_type = {s.instance_type: s for s in zone_shapes}
    builtin = by_type.get(r.machine_type)
    if builtin is not None and builtin.machine_type == builtin.instance_type:
        return ReservedShape(builtin.instance_type, builtin.accelerator, builtin.gpus,
                             builtin.vcpus, builtin.memory_gib)
    if not r.accelerators:
        raise ValueError(f"{r.machine_type} is not a GPU machine type of {r.zone}")
    if len(r.accelerators) != 1 or series(r.machine_type) != "n1":
        raise ValueError(f"{r.machine_type} with {list(r.accelerators)} is not an N1 + GPU "
                         "shape")
    accel, gpus = r.accelerators[0]
    if accel not in N1_ATTACHABLE:
        raise ValueError(f"{accel} is not a GPU that attaches to N1 machines")
    itype = n1_instance_type(r.machine_type, accel, gpus)
    known = by_type.get(itype)
    return ReservedShape(itype, accel, gpus, known.vcpus if known else None,
                         known.memory_gib if known else None)
