"""The policy language the ops teams write (`version: 1`).

A full, commented example is `deploy/policy.example.yaml`; README's "Policies" section
explains each part. This module holds the shapes (types, ranges, unknown keys);
`policies.checks` checks the names a person types — GPU models, clouds, residency tags —
and the rules' coherence, with a suggestion for every near miss.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from policies.residency import BUILT_IN_TAGS
from policies.risk import DEFAULT_RISK, RISK_PRESETS, preset_of
from policies.risk import RiskLevel as RiskLevel  # the levels, also named here

MarketChoice = Literal["spot", "on_demand", "reserved", "any"]
MarketName = Literal["spot", "on_demand", "reserved"]
LadderStep = Literal["same_region_spot", "other_region_spot", "on_demand", "other_cloud"]
Name = Annotated[str, Field(min_length=1, max_length=128)]
Price = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Defaults(_Strict):
    """What a request gets for the fields it leaves out."""

    market: MarketChoice = "any"
    max_price_per_gpu_hour: Price | None = None
    lease_seconds: int = Field(default=900, ge=10, le=7 * 86400)


class AllowDeny(_Strict):
    """`allow` (only these; empty or absent = all) and `deny` (never these)."""

    allow: list[Name] = Field(default_factory=list)
    deny: list[Name] = Field(default_factory=list)

    def permits(self, name: str) -> bool:
        return name not in self.deny and (not self.allow or name in self.allow)


class Clouds(AllowDeny):
    """`aws`, `gcp`, `azure`, `alibaba`, `private`."""


class Regions(AllowDeny):
    """Region names (`us-east-1`), or `cloud:region` for one cloud's region."""


class Gpus(AllowDeny):
    equivalent: dict[Name, list[Name]] = Field(default_factory=dict)
    """A request for the key may also take each listed model (`A100-80GB: [H100-80GB]`)."""


class ResidencySpec(_Strict):
    tags: dict[Name, list[Name]] = Field(default_factory=dict)
    """Extra regions for a tag, new or built-in: `{eu-sovereign: [aws:eu-central-1]}`."""


class Team(_Strict):
    max_gpus: int | None = Field(default=None, ge=0)
    budget_per_hour: Price | None = None
    markets: list[MarketName] | None = None
    clouds: list[Name] | None = None
    residency: list[Name] | None = None
    gpus: list[Name] | None = None
    max_zone_share: float | None = Field(default=None, gt=0, le=1)
    """Spread limit: at most this share of the team's GPUs in one zone (0.5 = half),
    counting what a placement would add. `spread_grace_gpus` may always sit in one."""
    max_cloud_share: float | None = Field(default=None, gt=0, le=1)
    """The same, per cloud."""
    spread_grace_gpus: int = Field(default=8, ge=0)
    private_share: float | None = Field(default=None, ge=0, le=1)
    """At most this share of the paid-for GPUs (private servers and cloud reservations:
    the `reserved` market) may be the team's at once, so one team cannot take them all.
    Unset: no limit."""
    risk: RiskLevel | None = None
    """The team's trade-off between price and interruptions (`policies.risk`); unset:
    the policy's `scoring.risk`."""


class Scoring(_Strict):
    """Expected cost per hour of a placement of n instances =
    price × (1 + restart_hours × n × interruption_rate
                + availability_weight × (1 − availability)
                + spread_weight × share of the team's GPUs already in that zone)
    + GPUs × interruption_cost_per_gpu × n × interruption_rate (spot: the gang is
    interrupted when any of its n instances is).
    Unknown signals are taken at the `unknown_*` values; a spot pool's signals are the
    ones expected over a job from its history (`hazard_half_life_hours`).

    `risk` names the trade-off between price and interruptions; the three risk weights
    (`restart_hours`, `availability_weight`, `interruption_cost_per_gpu`) not written
    take that level's values (`policies.risk.RISK_PRESETS`). Weights written tune this,
    the policy-wide, level only: `Policy.for_risk` gives a team or rule that names
    another level that level's weights."""

    risk: RiskLevel = DEFAULT_RISK
    restart_hours: float = Field(default=RISK_PRESETS[DEFAULT_RISK].restart_hours, ge=0)
    availability_weight: float = Field(
        default=RISK_PRESETS[DEFAULT_RISK].availability_weight, ge=0)
    spread_weight: float = Field(default=0.0, ge=0)
    unknown_interruption_rate: float = Field(default=0.05, ge=0)
    unknown_availability: float = Field(default=0.5, ge=0, le=1)
    idle_gpu_weight: float = Field(default=0.0, ge=0)
    """Paid-for GPUs left idle (an 8-GPU instance for 6 GPUs) are in the price already;
    this adds that share of their price again, to prefer a snug fit."""
    spot_min_discount: float = Field(default=0.0, ge=0, lt=1)
    """Take a spot pool only when it is at least this much cheaper than on-demand for the
    same instance type in the same zone (0.3 = 30 % cheaper)."""
    interruption_cost_per_gpu: float = Field(
        default=RISK_PRESETS[DEFAULT_RISK].interruption_cost_per_gpu, ge=0)
    """What an interruption costs beyond the work lost (`restart_hours`), in $ per GPU of
    the lease: the hours of people and queues a restart takes. It adds GPUs ×
    interruption_rate × this to a spot pool's expected cost per hour, the same for every
    GPU model, so it trades price against the number of interruptions directly (unlike
    `restart_hours`, which weighs an expensive GPU's interruptions more)."""
    hazard_half_life_hours: float = Field(default=6.0, ge=0, le=24 * 30)
    """Score a spot pool with the interruption rate and availability expected over a
    job from its history (`broker.market.hazard`: moving averages with this half-life, blended
    with the current values), not only the last poll's. 0: the last poll's."""

    @model_validator(mode="before")
    @classmethod
    def _risk_preset(cls, data: Any) -> Any:
        """The risk weights not written take the values of the level (`risk`, default
        `balanced`); an unknown level is left to the field's own check, which names
        the three."""
        if not isinstance(data, dict):
            return data
        preset = preset_of(data.get("risk", DEFAULT_RISK))
        if preset is None:
            return data
        return {**preset._asdict(), **data}

    def at_risk(self, level: RiskLevel) -> Scoring:
        """This scoring at another risk level: that level's risk weights
        (`RISK_PRESETS`), everything else as here."""
        if level == self.risk:
            return self
        return self.model_copy(update={"risk": level, **RISK_PRESETS[level]._asdict()})


class Triggers(_Strict):
    interrupted: bool = True
    capacity_lost: bool = True
    price_above_cap: bool = True
    price_spike_ratio: float | None = Field(default=None, gt=1)
    """Fail over when a pool's price rises above this multiple of the lease's decided
    price (e.g. 1.5), even under the cap."""
    cloud_unhealthy: bool = True
    """Fail over leases whose cloud region's offers went stale (its API kept failing)."""
    policy_changed: bool = True


class Failover(_Strict):
    triggers: Triggers = Field(default_factory=Triggers)
    ladder: list[LadderStep] = Field(default_factory=list)
    """Where a failover looks, in order; the first step with a placement wins. Empty: the
    best placement anywhere the request allows."""
    min_lease_age_seconds: float = Field(default=0, ge=0)
    max_failovers_per_hour: int | None = Field(default=None, ge=1)
    """Anti-flap limits. They hold back discretionary moves (price, policy change,
    cloud unhealthy); `max_failovers_per_hour` also a scheduler's report (answered
    `report.declined`); a lease whose capacity the cloud says is gone always moves."""
    cooldown_seconds: float = Field(default=600, ge=0)
    """How long a pool that failed a lease is kept out of new placements."""
    report_cooldowns_per_hour: int = Field(default=10, ge=0)
    """How many pools one scheduler's reports may cool down for everyone in an hour.
    Beyond it a report still moves that scheduler's lease (never back to the pool it
    reported) but keeps the pool open to everyone else: one scheduler's faulty reports
    cannot close the market to the others."""
    reoptimize_min_saving: float | None = Field(default=None, gt=0, lt=1)
    """Move a running lease to a better placement when that saves at least this share
    of its expected cost (0.3 = 30 %), subject to the anti-flap limits. Unset: running
    leases move only when a trigger fires."""



class Match(_Strict):
    team: list[Name] | None = None
    scheduler: list[Name] | None = None
    gpu: list[Name] | None = None
    labels: dict[Name, str] | None = None

    @field_validator("team", "scheduler", "gpu", mode="before")
    @classmethod
    def _one_or_list(cls, v: object) -> object:
        return [v] if isinstance(v, str) else v


class Require(_Strict):
    residency: list[Name] | None = None
    clouds: list[Name] | None = None
    market: MarketName | None = None
    max_price_per_gpu_hour: Price | None = None
    risk: RiskLevel | None = None
    """The matching requests' trade-off between price and interruptions (over the
    team's `risk` and the policy's `scoring.risk`)."""


class Rule(_Strict):
    name: Name
    match: Match = Field(default_factory=Match)
    require: Require | None = None
    deny: Name | None = None
    """Reject matching requests with this message."""

    @model_validator(mode="after")
    def _one_effect(self) -> Rule:
        if (self.require is None) == (self.deny is None):
            raise ValueError(f"rule {self.name!r} needs exactly one of `require` or `deny`")
        return self


class Policy(_Strict):
    version: Literal[1] = 1
    extra_gpus: list[Name] = Field(default_factory=list)
    """GPU models outside the canonical list that some cloud offers under its own name."""
    defaults: Defaults = Field(default_factory=Defaults)
    clouds: Clouds = Field(default_factory=Clouds)
    regions: Regions = Field(default_factory=Regions)
    gpus: Gpus = Field(default_factory=Gpus)
    residency: ResidencySpec = Field(default_factory=ResidencySpec)
    teams: dict[Name, Team] = Field(default_factory=dict)
    scoring: Scoring = Field(default_factory=Scoring)
    failover: Failover = Field(default_factory=Failover)
    rules: list[Rule] = Field(default_factory=list)

    _risk_copies: _RiskCopies = PrivateAttr(default_factory=lambda: _RiskCopies(None))

    @property
    def residency_tags(self) -> frozenset[str]:
        return BUILT_IN_TAGS | frozenset(self.residency.tags)

    def for_risk(self, level: RiskLevel | None) -> Policy:
        """The policy a request at risk `level` is scored with: this one at the
        policy-wide level (`scoring.risk`, or None), else a copy (made once) whose
        scoring has that level's risk weights and this one's other settings. Cost code
        takes the copy like any policy: `expected_cost(offer, n, policy.for_risk(...))`."""
        if level is None or level == self.scoring.risk:
            return self
        copies = self._risk_copies
        if copies.owner is not self:
            # None made yet, or those of the policy this one was `model_copy`'d from.
            copies = self._risk_copies = _RiskCopies(self)
        got = copies.get(level)
        if got is None:
            got = copies[level] = self.model_copy(
                update={"scoring": self.scoring.at_risk(level)})
            # The copy's way back to this level is this policy (its tuned weights).
            got._risk_copies = _RiskCopies(got, {self.scoring.risk: self})
        return got


class _RiskCopies(dict[str, Policy]):
    """A policy's copies at other risk levels (`Policy.for_risk`), made from it on first
    use: derived, so no part of its value — any two compare equal, and a policy equals
    another with the same settings whatever copies either has made."""

    def __init__(self, owner: Policy | None, made: dict[str, Policy] | None = None) -> None:
        super().__init__(made or {})
        self.owner = owner

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _RiskCopies)

    __hash__ = None
