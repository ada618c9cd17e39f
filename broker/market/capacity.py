"""Summaries of the pool per (cloud, region, GPU) for the retained `P/capacity/...` topics."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from broker.market.pool import ResourcePool
from broker.model import Market, Offer, iso


def summaries(offers: Iterable[Offer], pool: ResourcePool, now: datetime
              ) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Cheapest spot and on-demand price per GPU-hour, free capacity and data age of each
    (cloud, region, gpu) slice of `offers`."""
    out: dict[tuple[str, str, str], dict[str, Any]] = {}
    for o in offers:
        k = (o.pool.cloud, o.pool.region, o.gpu)
        s = out.get(k)
        if s is None:
            s = out[k] = {
                "cloud": o.pool.cloud, "region": o.pool.region, "gpu": o.gpu,
                "cheapest_spot_per_gpu_hour": None, "cheapest_on_demand_per_gpu_hour": None,
                "free_instances": None, "free_gpus": None, "pools": 0,
                "observed_at": iso(o.observed_at), "age_seconds": None,
            }
        s["pools"] += 1
        ppg = o.price_per_gpu_hour
        field = ("cheapest_spot_per_gpu_hour" if o.pool.market is Market.SPOT
                 else "cheapest_on_demand_per_gpu_hour")
        if ppg is not None and (s[field] is None or ppg < s[field]):
            s[field] = round(ppg, 6)
        free = pool.free_capacity(o.pool)
        if free is not None:
            s["free_instances"] = (s["free_instances"] or 0) + free
            s["free_gpus"] = (s["free_gpus"] or 0) + free * o.gpus
        age = pool.age_seconds(o.pool, now)
        if age is not None:
            s["age_seconds"] = round(age, 3)
        if iso(o.observed_at) < s["observed_at"]:
            s["observed_at"] = iso(o.observed_at)
    return out
