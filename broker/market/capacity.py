"""Summaries of the pool per (cloud, region, GPU) for the retained `P/capacity/...` topics."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from broker.market.pool import ResourcePool
from broker.model import OWNED, Market, Offer, iso

_CHEAPEST = {Market.SPOT: "cheapest_spot_per_gpu_hour",
             Market.ON_DEMAND: "cheapest_on_demand_per_gpu_hour",
             Market.RESERVED: "cheapest_reserved_per_gpu_hour"}
"""The price field of each market: paid-for capacity is not on-demand (it is priced at
the margin, $0 for a private server), so it has its own."""


def summaries(offers: Iterable[Offer], pool: ResourcePool, now: datetime
              ) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Cheapest spot, on-demand and reserved price per GPU-hour, free capacity (and the
    part of it on paid-for capacity, market `reserved`, counted apart) and data age of
    each (cloud, region, gpu) slice of `offers`."""
    out: dict[tuple[str, str, str], dict[str, Any]] = {}
    for o in offers:
        k = (o.pool.cloud, o.pool.region, o.gpu)
        s = out.get(k)
        if s is None:
            s = out[k] = {
                "cloud": o.pool.cloud, "region": o.pool.region, "gpu": o.gpu,
                "cheapest_spot_per_gpu_hour": None, "cheapest_on_demand_per_gpu_hour": None,
                "cheapest_reserved_per_gpu_hour": None,
                "free_instances": None, "free_gpus": None,
                "reserved_gpus": 0, "free_reserved_instances": None,
                "free_reserved_gpus": None, "pools": 0,
                "observed_at": iso(o.observed_at), "age_seconds": None,
            }
        s["pools"] += 1
        ppg = o.price_per_gpu_hour
        field = _CHEAPEST[o.pool.market]
        if ppg is not None and (s[field] is None or ppg < s[field]):
            s[field] = round(ppg, 6)
        free = pool.free_capacity(o.pool)
        if free is not None:
            s["free_instances"] = (s["free_instances"] or 0) + free
            s["free_gpus"] = (s["free_gpus"] or 0) + free * o.gpus
        if o.pool.market is OWNED:
            s["reserved_gpus"] += o.owned_gpus
            if free is not None:
                s["free_reserved_instances"] = (s["free_reserved_instances"] or 0) + free
                s["free_reserved_gpus"] = (s["free_reserved_gpus"] or 0) + free * o.gpus
        age = pool.age_seconds(o.pool, now)
        if age is not None:
            s["age_seconds"] = round(age, 3)
        if iso(o.observed_at) < s["observed_at"]:
            s["observed_at"] = iso(o.observed_at)
    return out
