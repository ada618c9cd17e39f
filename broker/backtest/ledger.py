"""What a backtest run is given and what it keeps: its `Settings`, the jobs, the `Tally` of
work and money, and each strategy's view of the market (`StrategyView`). The run itself is
engine.py."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from broker.backtest.draws import POOL_WIDE_SHARE
from broker.backtest.workload import Arrival
from broker.market.hazard import HazardEstimator
from broker.market.pool import ResourcePool
from broker.model import Market, Offer, Placement, PlaceRequest, PoolKey

NEVER_STALE = 100 * 365 * 86400.0  # a trace row holds until its pool's next row


@dataclass(frozen=True, slots=True)
class Settings:
    seed: int = 7
    """The interruption draws' seed (`--draw-seed`)."""
    step_seconds: float = 600.0
    restart_hours: float = 0.5
    """What the embedded policy's optimizer assumes a restart costs; not used here."""
    max_wait_hours: float = 24.0
    default_interruption_rate: float = 0.05
    startup_minutes: float = 10.0
    """Start-up of a job without its own (boot, image pull, checkpoint load)."""
    checkpoint_minutes: float = 30.0
    """Checkpoint interval of a job without its own (0: never loses work)."""
    market_seed: int | None = None
    """The generated market's seed, for the report (None: read from a file)."""
    workload_seed: int | None = None
    """The generated workload's seed, for the report (None: read from a file)."""
    pool_wide_share: float = POOL_WIDE_SHARE
    """The share of a spot pool's hazard that strikes every lease on it at once
    (`--pool-wide-share`; `draws.CORRELATED_POOL_WIDE_SHARE` for the correlated
    market variant)."""

    @property
    def draw_seed(self) -> int:
        return self.seed

    def to_json(self) -> dict[str, Any]:
        return {"seed": self.seed, "market_seed": self.market_seed,
                "workload_seed": self.workload_seed, "draw_seed": self.seed,
                "step_minutes": self.step_seconds / 60,
                "restart_hours": self.restart_hours, "max_wait_hours": self.max_wait_hours,
                "default_interruption_rate": self.default_interruption_rate,
                "startup_minutes": self.startup_minutes,
                "checkpoint_minutes": self.checkpoint_minutes,
                "pool_wide_share": self.pool_wide_share}


@dataclass(slots=True, eq=False)
class Job:
    index: int
    arrival: Arrival
    req: PlaceRequest  # as the strategy asks for it
    need: float  # hours of work
    startup: float = 0.0  # seconds of start-up after each placement
    checkpoint: float = 0.0  # hours of work between checkpoints (0: continuous)
    leases: int = 0
    lease_id: str | None = None
    placement: Placement | None = None
    work: float = 0.0  # hours of work kept, before the current start
    started: float = 0.0  # seconds: the current start (placement or restart)
    ready: float = 0.0  # seconds: the current start-up's end (work from then on)
    armed: int = -1  # the last step whose lease draw was made for this placement
    paid_since: float = 0.0
    rate: float = 0.0  # USD per hour of the current placement
    version: int = 0
    first_placed: float | None = None
    lost_at: float | None = None  # lost its placement then, waiting for another
    last_code: str = "none"
    done: bool = False

    @property
    def gpus(self) -> int:
        return self.req.gpus


@dataclass(slots=True)
class Tally:
    """What one strategy's run added up."""

    cost: float = 0.0
    useful_gpu_hours: float = 0.0
    lost_gpu_hours: float = 0.0
    """Start-ups and work lost to moves (see the module docstring)."""
    startup_gpu_hours: float = 0.0
    """The start-ups' part of `lost_gpu_hours`."""
    idle_gpu_hours: float = 0.0
    spot_gpu_hours: float = 0.0
    spot_gpu_hours_by_cloud: Counter[str] = field(default_factory=Counter)
    """`spot_gpu_hours` per cloud."""
    paid_gpu_hours: float = 0.0
    interrupted: int = 0
    capacity_lost: int = 0
    failovers: Counter[str] = field(default_factory=Counter)
    failovers_nowhere: int = 0
    requests: int = 0
    placed: int = 0
    completed: int = 0
    running_at_end: int = 0
    waiting_at_end: int = 0
    abandoned: int = 0
    never_placed: Counter[str] = field(default_factory=Counter)
    waits: list[float] = field(default_factory=list)  # hours to first placement
    hours_without_placement: float = 0.0  # after losing one
    losses: list[tuple[float, str, PoolKey]] = field(default_factory=list)
    """Every involuntary loss of a placement: (seconds, reason, pool), in time order."""
    reserved_gpu_hours: dict[PoolKey, float] = field(default_factory=dict)
    """Per pool of paid-for capacity (market `reserved`): the GPU-hours leases held."""
    reserved_asked_gpu_hours: dict[PoolKey, float] = field(default_factory=dict)
    """Of `reserved_gpu_hours`, the GPUs the jobs asked for, times the hours."""
    reserved_cost: dict[PoolKey, float] = field(default_factory=dict)
    """Per pool of paid-for capacity: what the leases there paid (their marginal price)."""


class StrategyView:
    """One strategy's `placement.PoolView`: the market's offers from the shared pool, but
    those of the `hidden` pools; the strategy's own holdings and cool-downs from a
    `ResourcePool` that holds no offers."""

    def __init__(self, market: ResourcePool, clock: Callable[[], datetime],
                 hazard: HazardEstimator | None = None,
                 hidden: Collection[PoolKey] = ()) -> None:
        self.market = market
        self.own = ResourcePool(stale_after_seconds=NEVER_STALE, clock=clock)
        self.hazard = hazard
        self.hidden = frozenset(hidden)
        self._hidden_markets = frozenset(k.market for k in self.hidden)

    def by_gpu(self, gpu: str, market: Market | None = None) -> Sequence[Offer]:
        offers = self.market.by_gpu(gpu, market)
        if self.hidden and (market is None or market in self._hidden_markets):
            return [o for o in offers if o.pool not in self.hidden]
        return offers

    @property
    def owned_gpus(self) -> int:
        """The paid-for GPUs this view shows (the market's, but the hidden pools')."""
        hidden = sum(o.owned_gpus for k in self.hidden if (o := self.market.get(k)))
        return self.market.owned_gpus - hidden

    def stale_slices(self, now: datetime) -> Collection[Hashable]:
        return self.market.stale_slices(now)

    def slice_of(self, key: PoolKey) -> Hashable | None:
        return self.market.slice_of(key)

    def get(self, key: PoolKey) -> Offer | None:
        return None if key in self.hidden else self.market.get(key)

    def held(self, key: PoolKey) -> int:
        return self.own.held(key)

    def held_now(self) -> Mapping[PoolKey, int]:
        return self.own.held_now()

    def cooling(self, now: datetime) -> Collection[PoolKey]:
        return self.own.cooling(now)

    def hold(self, key: PoolKey, instances: int) -> None:
        self.own.hold(key, instances)

    def unhold(self, key: PoolKey, instances: int) -> None:
        self.own.unhold(key, instances)

    def take(self, placement: Placement) -> Placement:
        return self.own.take(placement)

    def give_back(self, placement: Placement) -> None:
        self.own.give_back(placement)

    def cool_down(self, key: PoolKey, seconds: float) -> None:
        self.own.cool_down(key, seconds)
