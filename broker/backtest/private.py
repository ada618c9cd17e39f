"""A private pool added to a market (`--private-gpus`): the company's own servers, a pool
of market reserved for the whole run, never interrupted."""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from broker.backtest.market import Change, MarketError, MarketTrace, SliceId, Step
from broker.model import GPU_MODELS, Market, Offer, PoolKey, Target

PRIVATE_SLICE: SliceId = ("private", "onprem")


@dataclass(frozen=True, slots=True)
class PrivateSite:
    """`--private-gpus N` of GPU model `gpu`, `per_server` to a server, at `price` USD per
    GPU-hour (the marginal price a lease on them pays; the servers' fixed cost is not
    counted anywhere)."""

    gpus: int
    gpu: str = "A100-80GB"
    per_server: int = 8
    price: float = 0.0
    slices: int = 1
    """Leases a server may hold at once, each of `per_server` / `slices` GPUs (the
    daemon's `slices` of a private group); 1: a server goes whole to one lease."""

    @property
    def servers(self) -> int:
        return -(-self.gpus // self.per_server)

    @property
    def owned_gpus(self) -> int:
        """The GPUs the servers have: `gpus` rounded up to whole servers."""
        return self.servers * self.per_server

    @property
    def key(self) -> PoolKey:
        return PoolKey("private", "onprem", "onprem", f"{self.gpu}-server", Market.RESERVED)

    def targets(self) -> tuple[Target, ...]:
        width = len(str(self.servers))
        n = self.slices
        return tuple(Target(f"onprem-{i + 1:0{width}d}", n, n) for i in range(self.servers))

    def offer(self, at: datetime) -> Offer:
        model = GPU_MODELS.get(self.gpu)
        gpus = self.per_server // self.slices
        return Offer(pool=self.key, gpu=self.gpu, gpus=gpus,
                     gpu_memory_gb=model.memory_gb if model else None, vcpus=None,
                     memory_gb=None, price_per_hour=self.price * gpus,
                     observed_at=at, availability=1.0, capacity=self.servers * self.slices,
                     interruption_rate=None, targets=self.targets())

    def to_json(self) -> dict[str, Any]:
        return {"gpus": self.gpus, "gpu": self.gpu, "gpus_per_server": self.per_server,
                "slices": self.slices,
                "servers": self.servers, "owned_gpus": self.owned_gpus,
                "price_per_gpu_hour": self.price, "pool": self.key.to_json()}


def with_private(market: MarketTrace, site: PrivateSite) -> MarketTrace:
    """`market` with the private pool `site` offered from its start to its end (one row
    at the start, in a slice of its own; see the module docstring). The spot pools, their
    rows and their truth are `market`'s, so its draws are too."""
    if any(k == site.key for s in market.steps for _, ch in s.slices for k, _ in ch):
        raise MarketError(f"{market.source}: the market already has the pool {site.key}")
    change: tuple[SliceId, tuple[Change, ...]] = (PRIVATE_SLICE,
                                                  ((site.key, site.offer(market.start)),))
    steps = list(market.steps)
    if steps and steps[0].at == 0:
        steps[0] = Step(0.0, (*steps[0].slices, change))
    else:
        steps.insert(0, Step(0.0, (change,)))
    gpu_pools = dict(market.gpu_pools)
    gpu_pools[site.gpu] = gpu_pools.get(site.gpu, 0) + 1
    return replace(market, steps=tuple(steps), rows=market.rows + 1,
                   pools=market.pools + 1, gpu_pools=dict(sorted(gpu_pools.items())))
