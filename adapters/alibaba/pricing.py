"""Reading Alibaba Cloud's answers: GPU names, stock status, prices and currencies,
spot release rates, vCPU quotas.

Pure functions over plain data (the PascalCase maps the ECS API returns), so each
mapping has a table-driven test.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from adapters.gpus import canonical
from adapters.hazard import ALIBABA_WINDOW_HOURS, hazard_from_band, hazard_from_percent

# --- GPU names -------------------------------------------------------------------------

# Families whose GPUs are slices of a physical GPU (vGPU, `vgn*`) or shared between
# tenants (`sgn*`): the GPUSpec names the physical model (`NVIDIA T4`) but an instance
# gets a fraction of it, so they must not pass for that model.
_SLICED_FAMILIES = ("ecs.vgn", "ecs.sgn")


def gpu_of(info: Mapping[str, Any]) -> tuple[str, int, float | None, bool]:
    """(GPU name, GPUs per instance, GPU memory GiB per GPU, known) from one
    `InstanceTypes.InstanceType[]` entry.

    `GPUSpec` (`NVIDIA A10`, `NVIDIA V100`, `NVIDIA A100` ...) and `GPUMemorySize` (GiB
    per GPU) map onto canonical names (`adapters.gpus.canonical`): V100 with 32 GiB is
    `V100-32GB`, A100 with 80 GiB `A100-80GB`. Models the table does not know (`NVIDIA
    A800`, `NVIDIA H20`, `NVIDIA L20`, `NVIDIA P100` ...) keep Alibaba's name, flagged.
    vGPU and shared-GPU families (`ecs.vgn*`, `ecs.sgn*`) keep Alibaba's name, flagged,
    whatever the model: a quarter of a T4 is not a T4."""
    spec = str(info.get("GPUSpec") or "unknown").strip()
    count = int(info.get("GPUAmount") or 0)
    mem_raw = info.get("GPUMemorySize")
    mem = None if mem_raw in (None, "", 0) else round(float(mem_raw), 1)
    family = str(info.get("InstanceTypeFamily") or info.get("InstanceTypeId") or "")
    if family.startswith(_SLICED_FAMILIES):
        return spec, count, mem, False
    name, known = canonical(spec, mem)
    return name, count, mem, known


def is_gpu(info: Mapping[str, Any]) -> bool:
    """True for instance types with at least one GPU (FPGA/NPU types report 0)."""
    try:
        return int(info.get("GPUAmount") or 0) > 0
    except (TypeError, ValueError):
        return False


# --- stock -------------------------------------------------------------------------------

STOCK_AVAILABILITY: Mapping[str, float] = {
    "WithStock": 1.0,  # sufficient stock
    "ClosedWithStock": 0.3,  # low stock, supply not assured
    "WithoutStock": 0.0,  # sold out, will be replenished
    "ClosedWithoutStock": 0.0,  # sold out, will not be replenished
}
"""`DescribeAvailableResource` `StatusCategory` → `Offer.availability`."""

_STATUS_AVAILABILITY: Mapping[str, float] = {"Available": 1.0, "SoldOut": 0.0}


def availability_of(status: str | None, category: str | None) -> float | None:
    """A `SupportedResource`'s stock signal as availability 0..1: by `StatusCategory`
    (the finer one) when given, else by `Status` (`Available` / `SoldOut`); None if
    neither is known."""
    if category is not None and category in STOCK_AVAILABILITY:
        return STOCK_AVAILABILITY[category]
    if status is not None and status in _STATUS_AVAILABILITY:
        return _STATUS_AVAILABILITY[status]
    return None


# --- prices and currencies ---------------------------------------------------------------


def to_usd(amount: float | None, currency: str | None, usd_per_cny: float) -> float | None:
    """An amount in `currency` in USD. The China site (aliyun.com) prices in CNY, the
    international site (alibabacloud.com) in USD; any other or no currency gives None
    (an unknown currency is never taken for USD)."""
    if amount is None or not math.isfinite(amount):
        return None
    cur = (currency or "").strip().upper()
    if cur == "USD":
        return amount
    if cur == "CNY":
        return round(amount * usd_per_cny, 6)
    return None


def _positive(value: Any) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) and x > 0 else None


def instance_price(price: Mapping[str, Any]) -> tuple[float | None, str | None]:
    """(hourly price, currency) of the instance alone from `PriceInfo.Price`.

    `DescribePrice` prices the whole order (instance, default system disk, bandwidth);
    `DetailInfos.DetailInfo[]` splits it by `Resource`, so the `instanceType` line is
    taken when present, else the order total. Within a line, `TradePrice` (what this
    account pays, after its discounts) before `OriginalPrice` (the list price). None
    when no positive price is given."""
    currency = price.get("Currency")
    details = (price.get("DetailInfos") or {}).get("DetailInfo") or []
    for line in details:
        if line.get("Resource") == "instanceType":
            amount = _positive(line.get("TradePrice")) or _positive(line.get("OriginalPrice"))
            if amount is not None:
                return amount, currency
    return (_positive(price.get("TradePrice")) or _positive(price.get("OriginalPrice")),
            currency)


def parse_time(text: str) -> datetime:
    """`2026-11-30T06:00:00Z` (the API's UTC timestamps) as an aware datetime."""
    ts = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    return ts if ts.tzinfo else ts.replace(tzinfo=UTC)


def newest_spot_prices(points: Iterable[Mapping[str, Any]]
                       ) -> dict[tuple[str, str], tuple[float, datetime]]:
    """The newest `SpotPrice` per (instance type, zone) among `SpotPrices.SpotPriceType[]`
    entries (in the answer's currency). Entries without a usable price or time are
    skipped."""
    out: dict[tuple[str, str], tuple[float, datetime]] = {}
    for p in points:
        price = _positive(p.get("SpotPrice"))
        itype, zone, ts_text = p.get("InstanceType"), p.get("ZoneId"), p.get("Timestamp")
        if price is None or not itype or not zone or not ts_text:
            continue
        try:
            ts = parse_time(str(ts_text))
        except ValueError:
            continue
        key = (str(itype), str(zone))
        if key not in out or ts >= out[key][1]:
            out[key] = (price, ts)
    return out


# --- spot release rates ------------------------------------------------------------------

def interruption_rate(rate_pct: Any, band: str | None) -> float | None:
    """Interruptions per hour from an `AvailableSpotResource`'s `InterruptionRate` (%, the
    share of spot instances released over the last 30 days) or, without it, its
    `InterruptRateDesc` band (`0-3%`, `3-5%`, `5-10%`, `10-100%`), by the one
    interruption model (`adapters.hazard`, window `ALIBABA_WINDOW_HOURS`); None if
    neither is usable."""
    pct: float | None
    try:
        pct = float(rate_pct) if rate_pct is not None and rate_pct != "" else None
    except (TypeError, ValueError):
        pct = None
    if pct is not None and math.isfinite(pct):
        return hazard_from_percent(pct, ALIBABA_WINDOW_HOURS)
    return hazard_from_band(band, ALIBABA_WINDOW_HOURS)


# --- quotas ------------------------------------------------------------------------------

MAX_POSTPAID = "max-postpaid-instance-vcpu-count"
USED_POSTPAID = "used-postpaid-instance-vcpu-count"
MAX_SPOT = "max-spot-instance-vcpu-count"
USED_SPOT = "used-spot-instance-vcpu-count"
QUOTA_ATTRIBUTES = (MAX_POSTPAID, USED_POSTPAID, MAX_SPOT, USED_SPOT)
"""The `DescribeAccountAttributes` names asked for (the API takes up to 8)."""


def attribute_values(items: Iterable[Mapping[str, Any]]) -> dict[str, float | None]:
    """`AccountAttributeItems.AccountAttributeItem[]` → {name: value}. An attribute's
    value is its region-wide `ValueItem` (no `ZoneId`), else its first one; None when it
    is not a number."""
    out: dict[str, float | None] = {}
    for item in items:
        name = item.get("AttributeName")
        if not name:
            continue
        values = (item.get("AttributeValues") or {}).get("ValueItem") or []
        chosen = next((v for v in values if not v.get("ZoneId")), values[0] if values else None)
        value: float | None = None
        if chosen is not None:
            try:
                value = float(chosen.get("Value"))
            except (TypeError, ValueError):
                value = None
        out[str(name)] = value if value is None or math.isfinite(value) else None
    return out


def free_vcpus(attrs: Mapping[str, float | None], spot: bool) -> float | None:
    """vCPUs the account may still start in the region: the limit minus what is in use
    (usage taken as 0 when Alibaba does not report it). None without a limit."""
    limit = attrs.get(MAX_SPOT if spot else MAX_POSTPAID)
    if limit is None:
        return None
    used = attrs.get(USED_SPOT if spot else USED_POSTPAID) or 0.0
    return max(0.0, limit - used)


def headroom_gpus(free: float | None, vcpus: int | None, gpus: int) -> int | None:
    """How many GPUs of this instance type fit in `free` vCPUs."""
    if free is None or not vcpus:
        return None
    return int(free // vcpus) * gpus
