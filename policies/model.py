"""The policy language the ops teams write (`version: 1`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MarketChoice = Literal["spot", "on_demand", "any"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Defaults(_Strict):
    """What a request gets for the fields it leaves out."""

    market: MarketChoice = "any"
    max_price_per_gpu_hour: float | None = Field(default=None, gt=0)
    lease_seconds: int = Field(default=900, ge=10, le=7 * 86400)


class Scoring(_Strict):
    """Expected cost per hour of a placement =
    price × (1 + restart_hours × interruption_rate + availability_weight × (1 − availability)).
    Unknown signals are taken at the `unknown_*` values."""

    restart_hours: float = Field(default=1.0, ge=0)
    availability_weight: float = Field(default=0.25, ge=0)
    unknown_interruption_rate: float = Field(default=0.05, ge=0)
    unknown_availability: float = Field(default=0.5, ge=0, le=1)


class Failover(_Strict):
    cooldown_seconds: float = Field(default=600, ge=0)
    """How long a pool that failed a lease is kept out of new placements."""


class Policy(_Strict):
    version: Literal[1] = 1
    defaults: Defaults = Defaults()
    scoring: Scoring = Scoring()
    failover: Failover = Failover()
