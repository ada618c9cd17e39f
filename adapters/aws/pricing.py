"""Reading AWS's answers: Price List documents, GPU names, quota families, scores.

Pure functions over plain data, so each mapping has a table-driven test.
"""

from __future__ import annotations

import json
import math
from typing import Any

from adapters.gpus import canonical

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


def on_demand_price(documents: list[str], instance_type: str, region: str) -> float | None:
    """The hourly USD price in the Price List documents for `instance_type` in `region`.

    Checks the product attributes again (a filter the API ignored must not turn a
    Windows or dedicated-host price into ours) and takes the `Hrs` dimension of the
    OnDemand term. None if no document matches or the price is 0 (AWS lists 0 for types
    not sold on demand)."""
    for doc in documents:
        product = json.loads(doc) if isinstance(doc, str) else doc
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
