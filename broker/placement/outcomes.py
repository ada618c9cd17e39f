"""What placing a request comes to — a `Decision` or a `Rejection` of an `Ask` — and the
words for them: the reason of a decision, and the constraint that binds for a request
nothing could take (before the solver: `reject`; in its batch: `unplaced`)."""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass

from broker.model import Market, Offer, Placement, PlaceRequest, PoolKey, RejectCode
from policies.evaluate import Constraints, Denied, evaluate
from policies.model import Policy
from policies.residency import Residency
from policies.teams import EPS


@dataclass(frozen=True, slots=True)
class Ask:
    """One request to place. `exclude` keeps pools out (a failover never goes back to the
    pool that just failed). `constraints` is the policy's verdict on the request (with the
    team's usage); without one it is evaluated here against an idle team."""

    request: PlaceRequest
    exclude: frozenset[PoolKey] = frozenset()
    constraints: Constraints | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes. A request split across pools has its `parts` — each a
    placement and the GPUs of the request it covers, `placement` the first — and one
    lease per part; otherwise `parts` is empty."""

    ask: Ask
    placement: Placement
    expected_cost_per_hour: float
    reason: str
    alternatives: tuple[Placement, ...]
    parts: tuple[tuple[Placement, int], ...] = ()


@dataclass(frozen=True, slots=True)
class Rejection:
    ask: Ask
    code: RejectCode
    detail: str
    retry_after_seconds: float | None = None


Outcome = Decision | Rejection

@dataclass(slots=True)
class Scan:
    """What a request's search saw, to name the binding constraint if nothing fits: the
    offers that pass the table up to `policy_region` (`matching`), those the verdict's
    region alone keeps out (`policy_excluded`), those under the price cap too
    (`under_cap`), and the cheapest price per GPU-hour of those matching."""

    matching: int = 0
    policy_excluded: int = 0
    under_cap: int = 0
    cheapest_ppg: float = math.inf


def constraints_for(ask: Ask, policy: Policy, resident: Residency | None = None
                    ) -> Constraints | Denied:
    """The ask's verdict; `resident`: the policy's residency tags, shared by a batch."""
    if ask.constraints is not None:
        return ask.constraints
    return evaluate(policy, ask.request, None, resident)



def unplaced(ask: Ask, c: Constraints, why: tuple[str, Hashable | None],
             retry_after: float | None) -> Rejection:
    """Name the constraint that kept a request with options unplaced in its batch (`why`:
    `broker.placement.residual.why_unplaced`'s); a team limit that binds with nothing
    else of the team's placed in the batch is named as the limit alone."""
    req = ask.request
    what, key = why
    team = f"team {req.team!r}"
    before = {"team_gpus": c.gpus_left, "team_budget": c.budget_left,
              "team_owned": c.owned_left}.get(what)
    if before is not None and isinstance(key, float | int) and abs(before - key) <= EPS:
        return _over_limit(ask, c, what, before, retry_after)
    if what == "team_gpus":
        return Rejection(ask, RejectCode.OVER_BUDGET,
                         f"{team} has {key:g} GPUs of its max_gpus left after this batch's "
                         f"other placements; no placement of {req.gpus} GPUs fits", retry_after)
    if what == "team_budget":
        return Rejection(ask, RejectCode.OVER_BUDGET,
                         f"{team} has too little of its budget_per_hour (${key:.2f}/h left) "
                         f"after this batch's other placements for a placement of "
                         f"{req.gpus} GPUs", retry_after)
    if what == "team_owned":
        return Rejection(ask, RejectCode.OVER_BUDGET,
                         f"{team} has {key:g} GPUs of its private_share of paid-for capacity "
                         f"left after this batch's other placements; no placement of "
                         f"{req.gpus} GPUs fits", retry_after)
    if what == "spread":
        return Rejection(ask, RejectCode.POLICY_DENIED,
                         f"{team}'s spread limit (max_zone_share/max_cloud_share) leaves no "
                         f"zone or cloud for {req.gpus} more GPUs", retry_after)
    where = ""
    if what == "resource" and isinstance(key, tuple):
        kind, name = key
        where = (f": {name.cloud}/{name.zone} {name.instance_type} is taken"
                 if kind == "pool" and isinstance(name, PoolKey)
                 else f": quota {name} is used up")
    return Rejection(ask, RejectCode.NO_CAPACITY,
                     f"the free capacity and quota for {req.gpus}×{'|'.join(req.gpu)} went to "
                     f"other requests of this batch{where}", retry_after)


def reason(placement: Placement, offer: Offer, cost: float, duration: float | None,
            rule: str | None = None) -> str:
    bits = [
        f"lowest expected cost: {placement.pool.market.value} {placement.gpu} "
        f"{placement.pool.cloud}/{placement.pool.zone} {placement.pool.instance_type}",
        f"${placement.price_per_gpu_hour:.4g}/GPU-h",
        f"expected ${cost:.4g}/h",
    ]
    if offer.availability is not None:
        bits.append(f"availability {offer.availability:.2f}")
    if offer.interruption_rate is not None and placement.pool.market is Market.SPOT:
        bits.append(f"interruptions {offer.interruption_rate:.3g}/h")
    if duration:
        bits.append(f"≈${cost * duration:.2f} over {duration:g}h")
    if rule:
        bits.append(f"under rule {rule!r}")
    return ", ".join(bits)


def _over_limit(ask: Ask, c: Constraints, what: str, left: float,
                retry_after: float | None) -> Rejection:
    """A team limit that alone keeps every option of the request out."""
    req = ask.request
    team = f"team {req.team!r}"
    market = "any" if len(c.markets) == 2 else c.markets[0].value
    asked = f"{req.gpus}×{'|'.join(c.gpus)} ({market})"
    limit = {"team_gpus": f"{left:g} GPUs left of its max_gpus",
             "team_budget": f"${left:.2f}/h left of its budget_per_hour",
             "team_owned": f"{left:g} GPUs left of its private_share of paid-for capacity",
             }[what]
    return Rejection(ask, RejectCode.OVER_BUDGET,
                     f"{team} has {limit}; no {asked} with free capacity fits in it",
                     retry_after)


def reject(ask: Ask, c: Constraints, scan: Scan, retry_after: float | None) -> Rejection:
    """Name the constraint that left a request without any option (before the solver)."""
    req = ask.request
    market = "any" if len(c.markets) == 2 else c.markets[0].value
    what = f"{req.gpus}×{'|'.join(c.gpus)} ({market})"
    cap = c.cap
    if not scan.matching and scan.policy_excluded:
        where = f"rule {c.rule!r}" if c.rule else "the policy"
        if c.residency:
            where += " (residency " + " and ".join("|".join(sorted(t)) for t in c.residency) + ")"
        return Rejection(ask, RejectCode.POLICY_DENIED,
                         f"{where} excludes every one of the {scan.policy_excluded} fresh "
                         f"offer(s) of {what}", retry_after)
    if scan.matching and not scan.under_cap and cap is not None:
        return Rejection(ask, RejectCode.OVER_PRICE_CAP,
                         f"no {what} at or under ${cap:g}/GPU-h; cheapest fresh offer is "
                         f"${scan.cheapest_ppg:.4g}/GPU-h", retry_after)
    if not scan.matching:
        detail = f"no fresh offer of {what}"
        if req.clouds:
            detail += f" in clouds {','.join(req.clouds)}"
        if req.regions:
            detail += f" in regions {','.join(req.regions)}"
    else:
        detail = (f"{scan.under_cap} pool(s) offer {what} within the price cap, but none has "
                  f"free capacity or quota for {req.gpus} GPUs in one zone")
    return Rejection(ask, RejectCode.NO_CAPACITY, detail, retry_after)

