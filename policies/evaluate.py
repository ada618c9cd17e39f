"""What a policy says about one request: denied, or the constraints its placement must
meet. Pure functions; the broker gives them the team's current usage.

Order of evaluation, each step able to deny with a detail that names the rule or limit:

1. `rules`, first match wins: `deny` → `policy_denied`; `require` adds constraints.
2. the team's limits: `max_gpus` (held + asked) → `over_budget`; its markets, clouds,
   residency and GPUs narrow the request.
3. the top-level `clouds` / `regions` / `gpus` allow and deny lists, and `gpus.equivalent`.
4. what is left must still allow something (a GPU model, a market), else `policy_denied`.

The request's risk level (the trade-off its placement is scored by, `policies.risk`) is
the rule's `require.risk`, else the team's `risk`, else the policy's `scoring.risk`
(`risk_for`); its costs are scored with `Policy.for_risk(constraints.risk)`.

The team's `budget_per_hour` is a constraint on the placement's price (what remains of
the budget), checked by the optimizer, which answers `over_budget` when only the budget
stands in the way.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from broker.model import MARKETS, Market, PlaceRequest, PoolKey, RejectCode, markets_for
from policies.model import Policy, Rule, Team
from policies.residency import Residency
from policies.risk import RiskLevel
from policies.teams import TeamUsage, over_max_gpus

__all__ = ["POLICY_RULES", "Constraints", "Denied", "OfferRule", "TeamUsage", "describe",
           "evaluate", "forbids", "matching_rule", "risk_for"]


@dataclass(frozen=True, slots=True)
class Denied:
    code: RejectCode
    detail: str


@dataclass(slots=True)
class Constraints:
    """Everything a placement of one request must satisfy, policy and request together."""

    gpus: tuple[str, ...]
    markets: tuple[Market, ...]
    cap: float | None
    clouds: frozenset[str] | None = None  # allowed; None = any
    deny_clouds: frozenset[str] = frozenset()
    regions: frozenset[str] | None = None  # `region` or `cloud:region`; None = any
    deny_regions: frozenset[str] = frozenset()
    residency: tuple[frozenset[str], ...] = ()  # the region needs a tag of each set
    budget_left: float | None = None  # USD per hour the team may still spend
    zone_share: Mapping[tuple[str, str], float] = field(default_factory=dict)
    lease_seconds: int = 900
    team: str | None = None
    gpus_left: int | None = None  # GPUs the team may still take (its max_gpus)
    max_zone_share: float | None = None  # the team's spread limits
    max_cloud_share: float | None = None
    spread_grace: int = 0
    team_gpus: int = 0  # what the team holds now, in total, per zone, per cloud
    gpus_by_zone: Mapping[tuple[str, str], int] = field(default_factory=dict)
    rule: str | None = None  # the rule that matched, for explanations
    resident: Residency | None = None
    owned_left: float | None = None  # paid-for GPUs the team may still take (private_share)
    risk: RiskLevel | None = None  # the risk level, resolved (`risk_for`); None: the policy's
    _region_ok: dict[tuple[str, str], bool] = field(default_factory=dict)

    def region_ok(self, cloud: str, region: str) -> bool:
        key = (cloud, region)
        ok = self._region_ok.get(key)
        if ok is None:
            ok = self._check_region(cloud, region)
            self._region_ok[key] = ok
        return ok

    def regions_bounded(self) -> bool:
        """Whether `region_ok` may say no to some region: the verdict names clouds or
        regions to keep to or keep out of, or residency (what `_check_region` reads)."""
        return self.clouds is not None or bool(self.deny_clouds) or \
            self.regions is not None or bool(self.deny_regions) or bool(self.residency)

    def regions_key(self) -> Hashable:
        """What `region_ok` reads (`_check_region`): verdicts of equal keys allow the same
        regions."""
        resident = self.resident.key if self.residency and self.resident else None
        return (self.clouds, self.deny_clouds, self.regions, self.deny_regions,
                self.residency, resident)

    def _check_region(self, cloud: str, region: str) -> bool:
        if self.clouds is not None and cloud not in self.clouds:
            return False
        if cloud in self.deny_clouds:
            return False
        names = {region, f"{cloud}:{region}"}
        if self.regions is not None and not names & self.regions:
            return False
        if names & self.deny_regions:
            return False
        if self.residency:
            tags = self.resident.of(cloud, region) if self.resident else frozenset()
            if not all(tags & wanted for wanted in self.residency):
                return False
        return True

    def permits(self, key: PoolKey, gpu: str) -> bool:
        """Whether a placement on `key` with GPU model `gpu` meets every constraint except
        price and budget (those depend on the price at the time): `POLICY_RULES`
        but the price cap."""
        return all(r.ok(self, key, gpu, 0.0) for r in POLICY_RULES if r is not PRICE_CAP)


@dataclass(frozen=True, slots=True)
class OfferRule:
    """One of the rules of where and on what a request may be placed that its verdict
    alone decides (`broker.placement.rules` puts them in its table, in this order):
    `ok(constraints, pool, GPU model, price per GPU-hour)`; `message`, why an offer
    fails it; `changed`, why a lease placed there is no longer allowed (`forbids`)."""

    name: str
    code: RejectCode
    message: str
    ok: Callable[[Constraints, PoolKey, str, float], bool]
    changed: Callable[[Constraints, PoolKey, str, float], str]


def _where(c: Constraints) -> str:
    return f"rule {c.rule!r}" if c.rule else "the policy"


MODEL = OfferRule(
    "model", RejectCode.NO_CAPACITY, "GPU model not acceptable",
    lambda c, key, gpu, ppg: gpu in c.gpus,
    lambda c, key, gpu, ppg: f"GPU {gpu} is no longer allowed")
MARKET = OfferRule(
    "market", RejectCode.NO_CAPACITY, "market not allowed",
    lambda c, key, gpu, ppg: key.market in c.markets,
    lambda c, key, gpu, ppg: f"market {key.market.value} is no longer allowed")
REGION = OfferRule(
    "policy_region", RejectCode.POLICY_DENIED,
    "cloud/region/residency not allowed by the policy",
    lambda c, key, gpu, ppg: c.region_ok(key.cloud, key.region),
    lambda c, key, gpu, ppg: f"{key.cloud}/{key.region} is no longer allowed by {_where(c)}")
PRICE_CAP = OfferRule(
    "price_cap", RejectCode.OVER_PRICE_CAP, "over the price cap",
    lambda c, key, gpu, ppg: c.cap is None or ppg <= c.cap,
    lambda c, key, gpu, ppg: f"${ppg:.4g}/GPU-h is above the new cap ${c.cap:g}")
POLICY_RULES = (MODEL, MARKET, REGION, PRICE_CAP)
"""The verdict's rules of an offer, in the order they are checked."""


def matching_rule(policy: Policy, request: PlaceRequest) -> Rule | None:
    for rule in policy.rules:
        m = rule.match
        if m.team is not None and request.team not in m.team:
            continue
        if m.scheduler is not None and request.scheduler not in m.scheduler:
            continue
        if m.gpu is not None and not set(m.gpu) & set(request.gpu):
            continue
        if m.labels is not None and any(request.labels.get(k) != v
                                        for k, v in m.labels.items()):
            continue
        return rule
    return None


def _risk(policy: Policy, rule: Rule | None, team: Team | None) -> RiskLevel:
    req = rule.require if rule else None
    if req is not None and req.risk is not None:
        return req.risk
    if team is not None and team.risk is not None:
        return team.risk
    return policy.scoring.risk


def risk_for(policy: Policy, request: PlaceRequest) -> RiskLevel:
    """The risk level `request` is scored at: the matching rule's `require.risk`, else
    its team's `risk`, else the policy's `scoring.risk` (`evaluate` puts it in the
    constraints; this is for a request already placed, a lease's)."""
    return _risk(policy, matching_rule(policy, request),
                 policy.teams.get(request.team) if request.team else None)


def _markets(policy: Policy, request: PlaceRequest, rule: Rule | None,
             team: Team | None) -> set[Market] | Denied:
    """The markets: the request's (or the default), narrowed by the rule and the team.
    Paid-for capacity (`reserved`) rides along with spot and on-demand wherever they are
    allowed; it never stands in for the market a request asked for: a request for spot
    from a team allowed on-demand only is denied, not sent to reserved capacity."""
    market = request.market or policy.defaults.market
    markets = set(markets_for(market))
    asked = set(markets) if market in ("any", "reserved") else {Market(market)}
    req = rule.require if rule else None
    if req and req.market:
        markets &= markets_for(req.market)
    if team and team.markets is not None:
        markets &= {m for name in team.markets for m in markets_for(name)}
    if not markets & asked:
        why = f"rule {rule.name!r}" if rule else "policy"
        return Denied(RejectCode.POLICY_DENIED,
                      f"market {market!r} is not allowed for this request ({why}"
                      + (f", team {request.team!r} markets {team.markets}" if team else "")
                      + ")")
    return markets


def _gpus(policy: Policy, request: PlaceRequest, team: Team | None) -> list[str] | Denied:
    """The GPU models: asked for, plus equivalents, minus what is not allowed."""
    wanted: list[str] = []
    for g in request.gpu:
        for candidate in (g, *policy.gpus.equivalent.get(g, ())):
            if candidate not in wanted:
                wanted.append(candidate)
    gpus = [g for g in wanted if policy.gpus.permits(g)
            and (team is None or team.gpus is None or g in team.gpus)]
    if not gpus:
        return Denied(RejectCode.POLICY_DENIED,
                      f"GPU {'/'.join(request.gpu)} is not allowed"
                      + (f" for team {request.team!r}" if team and team.gpus is not None
                         else " by the policy's gpus lists"))
    return gpus


def _team_room(request: PlaceRequest, team: Team | None,
               usage: TeamUsage) -> float | Denied | None:
    """The team's limits: denied when it is at its max_gpus or budget; else the budget
    left per hour (None: no budget)."""
    if team and over_max_gpus(team.max_gpus, usage, request.gpus):
        return Denied(RejectCode.OVER_BUDGET,
                      f"team {request.team!r} holds {usage.gpus} GPUs; {request.gpus} more "
                      f"would pass its max_gpus {team.max_gpus}")
    if team is None or team.budget_per_hour is None:
        return None
    budget_left = team.budget_per_hour - usage.price_per_hour
    if budget_left <= 0:
        return Denied(RejectCode.OVER_BUDGET,
                      f"team {request.team!r} spends ${usage.price_per_hour:.2f}/h of its "
                      f"${team.budget_per_hour:g}/h budget_per_hour")
    return budget_left


_Places = tuple[set[str] | None, set[str] | None, tuple[frozenset[str], ...]]


def _places(policy: Policy, request: PlaceRequest, rule: Rule | None,
           team: Team | None) -> _Places | Denied:
    """Where: the clouds (request ∩ top-level lists ∩ team ∩ rule), the regions, and the
    residency requirements (the team's, the rule's: a region needs one tag of each)."""
    req = rule.require if rule else None
    clouds: set[str] | None = set(request.clouds) if request.clouds else None
    for extra in ((policy.clouds.allow or None), (team.clouds if team else None),
                  (req.clouds if req else None)):
        if extra:
            clouds = set(extra) if clouds is None else clouds & set(extra)
    if clouds is not None and not clouds - set(policy.clouds.deny):
        why = f"rule {rule.name!r}" if rule else "policy"
        return Denied(RejectCode.POLICY_DENIED, f"no cloud is left for this request ({why}, "
                      "the team's clouds and the policy's clouds lists)")
    regions: set[str] | None = set(request.regions) if request.regions else None
    if policy.regions.allow:
        allowed = set(policy.regions.allow)
        regions = allowed if regions is None else {
            r for r in regions if r in allowed or any(a.endswith(f":{r}") for a in allowed)}
        if not regions:
            return Denied(RejectCode.POLICY_DENIED,
                          "none of the requested regions is in the policy's regions.allow")
    residency = tuple(frozenset(tags) for tags in ((team.residency if team else None),
                                                   (req.residency if req else None)) if tags)
    return clouds, regions, residency


def evaluate(policy: Policy, request: PlaceRequest, usage: TeamUsage | None = None,
             resident: Residency | None = None, owned_gpus: int = 0) -> Constraints | Denied:
    """The request's constraints under the policy, or why it is denied. `usage`: what
    the request's team holds; `owned_gpus`: the paid-for GPUs there are (for the team's
    `private_share`). The steps, in order: the matching rule's deny, the markets, the GPU
    models, the team's limits, then where (clouds, regions, residency)."""
    usage = usage or TeamUsage()
    resident = resident or Residency(policy.residency.tags)
    rule = matching_rule(policy, request)
    if rule is not None and rule.deny is not None:
        return Denied(RejectCode.POLICY_DENIED, f"rule {rule.name!r}: {rule.deny}")
    req = rule.require if rule else None
    team = policy.teams.get(request.team) if request.team else None
    markets = _markets(policy, request, rule, team)
    if isinstance(markets, Denied):
        return markets
    gpus = _gpus(policy, request, team)
    if isinstance(gpus, Denied):
        return gpus
    budget_left = _team_room(request, team, usage)
    if isinstance(budget_left, Denied):
        return budget_left
    where = _places(policy, request, rule, team)
    if isinstance(where, Denied):
        return where
    clouds, regions, residency = where
    # The request's own cap replaces the policy's default; a rule's cap always holds.
    own_cap = (request.max_price_per_gpu_hour if request.max_price_per_gpu_hour is not None
               else policy.defaults.max_price_per_gpu_hour)
    caps = [c for c in (own_cap, req.max_price_per_gpu_hour if req else None) if c is not None]
    total = sum(usage.gpus_by_zone.values())
    return Constraints(
        gpus=tuple(gpus),
        markets=tuple(m for m in MARKETS if m in markets),
        cap=min(caps) if caps else None,
        clouds=frozenset(clouds) if clouds is not None else None,
        deny_clouds=frozenset(policy.clouds.deny),
        regions=frozenset(regions) if regions is not None else None,
        deny_regions=frozenset(policy.regions.deny),
        residency=residency,
        budget_left=budget_left,
        zone_share={z: n / total for z, n in usage.gpus_by_zone.items()} if total else {},
        lease_seconds=request.lease_seconds or policy.defaults.lease_seconds,
        team=request.team if team else None,
        gpus_left=(team.max_gpus - usage.gpus
                   if team and team.max_gpus is not None else None),
        max_zone_share=team.max_zone_share if team else None,
        max_cloud_share=team.max_cloud_share if team else None,
        spread_grace=team.spread_grace_gpus if team else 0,
        team_gpus=usage.gpus,
        gpus_by_zone=usage.gpus_by_zone,
        rule=rule.name if rule else None,
        resident=resident,
        owned_left=(team.private_share * owned_gpus - usage.owned_gpus
                    if team and team.private_share is not None else None),
        risk=_risk(policy, rule, team),
    )


def forbids(policy: Policy, request: PlaceRequest, key: PoolKey, gpu: str,
            price_per_gpu_hour: float, resident: Residency | None = None) -> str | None:
    """Why `policy` no longer allows a lease of `request` placed on `key`, or None.
    Budgets and GPU counts are not re-checked: a lease is not moved because its team's
    limits shrank, only because where or what it runs on is now forbidden."""
    verdict = evaluate(policy, request, None, resident)
    if isinstance(verdict, Denied):
        return verdict.detail
    for rule in POLICY_RULES:
        if not rule.ok(verdict, key, gpu, price_per_gpu_hour):
            return rule.changed(verdict, key, gpu, price_per_gpu_hour)
    return None


def describe(c: Constraints) -> dict[str, Any]:
    """The constraints as plain data (for `policy explain`)."""
    return {
        "rule": c.rule, "gpus": list(c.gpus), "markets": [m.value for m in c.markets],
        "max_price_per_gpu_hour": c.cap,
        "clouds": sorted(c.clouds) if c.clouds is not None else None,
        "regions": sorted(c.regions) if c.regions is not None else None,
        "residency": [sorted(tags) for tags in c.residency] or None,
        "budget_left_per_hour": c.budget_left, "lease_seconds": c.lease_seconds,
        "risk": c.risk,
    }
