"""What makes a lease fail over, decided from pool changes and cloud signals.

These functions only decide *which* leases must move and why; `broker.leasing.authority.Broker`
re-places them (never back onto the pool that failed, which also goes into a cool-down)
and publishes `lease.failover`, or `lease.failed` when nothing fits.

Triggers, each switched by the policy's `failover.triggers`:
* a cloud signal that a leased pool is interrupted or lost its capacity;
* a poll in which a leased pool is gone from its cloud's offerings, or its availability
  is 0 (the cloud says no capacity at all) → `capacity_lost`;
* a poll in which a leased pool's price per GPU-hour rose above the lease's cap, or
  above `price_spike_ratio` × the price it was decided at → `price_above_cap`;
* a leased pool's cloud region whose offers went stale (its API kept failing)
  → `cloud_unhealthy`;
* a new policy that forbids where or what a lease runs on → `policy_changed`;
* a scheduler's report (handled in the broker, always on) → `reported`;
* on paid-for capacity, a lease's reservation or server named as draining by its
  adapter (a maintenance window is near) → `maintenance` (always on; with nowhere to go
  the lease stays until the window starts), or gone from the pool's targets (a server
  down, a reservation ended) → `capacity_lost`;
* with `failover.reoptimize_min_saving` set, a placement whose expected cost is at
  least that share below the lease's, at today's prices → `reoptimized`. Without it, or
  for a smaller saving, a running lease is never moved by re-optimisation.

Moves for price, cloud health and policy are discretionary: the anti-flap limits
(`min_lease_age_seconds`, `max_failovers_per_hour`) hold them back. A lease whose
capacity is gone (interrupted, capacity lost, reported) always moves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Protocol

from broker.leasing.book import LeaseBook
from broker.market.changes import PoolChange
from broker.model import (
    CapacitySignal,
    FailoverReason,
    Lease,
    LeaseState,
    Market,
    Placement,
    PoolKey,
    RejectCode,
    SignalKind,
    Target,
)
from broker.placement import optimizer
from policies.evaluate import Constraints, Denied, evaluate, risk_for
from policies.model import Failover, Policy
from policies.residency import Residency

DISCRETIONARY = frozenset({FailoverReason.PRICE_ABOVE_CAP, FailoverReason.CLOUD_UNHEALTHY,
                           FailoverReason.POLICY_CHANGED, FailoverReason.REOPTIMIZED})
FLAP_WINDOW = timedelta(hours=1)
"""The anti-flap window: `max_failovers_per_hour` counts a lease's moves within it."""


@dataclass(frozen=True, slots=True)
class Trigger:
    """Move lease `lease_id`, if it is still at `epoch` when the trigger is handled."""

    lease_id: str
    epoch: int
    reason: FailoverReason
    detail: str
    cool_down: bool = False  # keep the failed pool out of new placements for a while
    received_at: datetime | None = None


def enabled(reason: FailoverReason, policy: Failover) -> bool:
    t = policy.triggers
    return {
        FailoverReason.INTERRUPTED: t.interrupted,
        FailoverReason.CAPACITY_LOST: t.capacity_lost,
        FailoverReason.PRICE_ABOVE_CAP: t.price_above_cap or t.price_spike_ratio is not None,
        FailoverReason.CLOUD_UNHEALTHY: t.cloud_unhealthy,
        FailoverReason.POLICY_CHANGED: t.policy_changed,
        FailoverReason.REPORTED: True,
        FailoverReason.REOPTIMIZED: policy.reoptimize_min_saving is not None,
        FailoverReason.MAINTENANCE: True,
    }[reason]


def from_signal(sig: CapacitySignal, book: LeaseBook, policy: Failover | None = None
                ) -> list[Trigger]:
    if sig.kind is SignalKind.REBALANCE:
        return []  # a risk notice, not a loss; used for scoring in a later version
    reason = (FailoverReason.INTERRUPTED if sig.kind is SignalKind.INTERRUPTED
              else FailoverReason.CAPACITY_LOST)
    if policy is not None and not enabled(reason, policy):
        return []
    detail = sig.detail or f"{sig.kind.value} notice from the cloud"
    return [Trigger(le.lease_id, le.epoch, reason, detail, cool_down=True,
                    received_at=sig.received_at)
            for le in book.on_pool(sig.pool)]


def from_pool_change(change: PoolChange, book: LeaseBook, policy: Failover | None = None
                     ) -> list[Trigger]:
    policy = policy or Failover()
    lost = policy.triggers.capacity_lost
    spike = policy.triggers.price_spike_ratio
    out: list[Trigger] = []
    for key in change.removed if lost else ():
        for le in book.on_pool(key):
            out.append(Trigger(le.lease_id, le.epoch, FailoverReason.CAPACITY_LOST,
                               f"{key} is no longer offered by its cloud", cool_down=True))
    for key in change.updated:
        leases = book.on_pool(key)
        if not leases:
            continue
        offer = change.offers[key]
        if offer.targets or any(le.placement.targets for le in leases):
            moving = list(_target_triggers(key, offer.targets, offer.draining, leases, lost))
            out.extend(moving)
            if moving:
                gone = {t.lease_id for t in moving}
                leases = [le for le in leases if le.lease_id not in gone]
        if offer.availability == 0 and lost:
            for le in leases:
                out.append(Trigger(le.lease_id, le.epoch, FailoverReason.CAPACITY_LOST,
                                   f"{key} reports no capacity (availability 0)",
                                   cool_down=True))
            continue
        ppg = offer.price_per_gpu_hour
        if ppg is None:
            continue
        for le in leases:
            cap = le.max_price_per_gpu_hour
            decided = le.placement.price_per_hour / le.placement.total_gpus
            if policy.triggers.price_above_cap and cap is not None and ppg > cap:
                out.append(Trigger(le.lease_id, le.epoch, FailoverReason.PRICE_ABOVE_CAP,
                                   f"{key} now costs ${ppg:.4g}/GPU-h, above the lease's cap "
                                   f"${cap:g}/GPU-h"))
            elif spike is not None and decided > 0 and ppg > spike * decided:
                out.append(Trigger(le.lease_id, le.epoch, FailoverReason.PRICE_ABOVE_CAP,
                                   f"{key} now costs ${ppg:.4g}/GPU-h, over {spike:g}× the "
                                   f"${decided:.4g}/GPU-h it was decided at"))
    return out


def _target_triggers(key: PoolKey, targets: Sequence[Target], draining: Sequence[str],
                     leases: Sequence[Lease], lost: bool) -> Iterator[Trigger]:
    """Leases on paid-for capacity whose reservation or server is going: into a
    maintenance window (`draining`: always moved, before the window starts), or gone
    from the pool's targets (a server down or unhealthy, a reservation ended or
    cancelled: `capacity_lost`, when that trigger is on)."""
    listed = {t.id for t in targets}
    drain = set(draining)
    for le in leases:
        mine = [t for t, _ in le.placement.targets]
        if going := [t for t in mine if t in drain]:
            yield Trigger(le.lease_id, le.epoch, FailoverReason.MAINTENANCE,
                          f"{', '.join(going)} on {key} enter a maintenance window")
        elif lost and (missing := [t for t in mine if t not in listed]):
            yield Trigger(le.lease_id, le.epoch, FailoverReason.CAPACITY_LOST,
                          f"{', '.join(missing)} on {key} are no longer available "
                          "(down, unhealthy or ended)", cool_down=False)


def supersedes(new: Trigger, waiting: Trigger) -> bool:
    """Whether `new` should replace the trigger `waiting` for the same lease: it is for a
    newer epoch (`waiting` is stale), or for the same one and the lease's capacity is
    gone where `waiting` was a move by choice. Otherwise the first one stays."""
    if new.epoch != waiting.epoch:
        return new.epoch > waiting.epoch
    return waiting.reason in DISCRETIONARY and new.reason not in DISCRETIONARY


def recent(moves: Sequence[datetime], now: datetime) -> list[datetime]:
    """The failover times within the anti-flap window (older ones no longer count)."""
    return [t for t in moves if now - t < FLAP_WINDOW]


def held_back(trigger: Trigger, lease: Lease, policy: Failover, moves: Sequence[datetime],
              now: datetime) -> str | None:
    """Why the anti-flap limits hold a move back, or None: a discretionary move by
    either limit, a scheduler's report by `max_failovers_per_hour` (a lease reported
    over and over would move without end); a lease whose capacity the cloud says is
    gone, never."""
    if not enabled(trigger.reason, policy):
        return f"trigger {trigger.reason.value} is switched off"
    if trigger.reason not in DISCRETIONARY and trigger.reason is not FailoverReason.REPORTED:
        return None
    age = (now - lease.created_at).total_seconds()
    if trigger.reason in DISCRETIONARY and age < policy.min_lease_age_seconds:
        return f"lease is {age:.0f}s old, under min_lease_age_seconds"
    if policy.max_failovers_per_hour is not None:
        moved = recent(moves, now)
        if len(moved) >= policy.max_failovers_per_hour:
            return f"{len(moved)} failovers in the last hour (max_failovers_per_hour)"
    return None


def retry_after(moves: Sequence[datetime], policy: Failover, now: datetime) -> float:
    """Seconds until `max_failovers_per_hour` no longer holds a lease with these moves
    back (its oldest counted moves leave the window); 0 when it does not now."""
    limit = policy.max_failovers_per_hour
    moved = sorted(recent(moves, now))
    if limit is None or len(moved) < limit:
        return 0.0
    return max(0.0, (moved[len(moved) - limit] + FLAP_WINDOW - now).total_seconds())


def ladder(c: Constraints, leaving: PoolKey, policy: Failover) -> Iterator[Constraints]:
    """The constraints of each fallback step, in the policy's order; with no ladder, the
    request's own constraints once (the best placement anywhere it allows)."""
    if not policy.ladder:
        yield c
        return
    here = frozenset({leaving.cloud})
    for step in policy.ladder:
        # Paid-for capacity (`reserved`) is never worse than spot or on-demand: a step
        # for either may take it too.
        if step in ("same_region_spot", "other_region_spot"):
            if Market.SPOT not in c.markets:
                continue
            markets: tuple[Market, ...] = tuple(m for m in c.markets if m is not Market.ON_DEMAND)
        elif step == "on_demand":
            if Market.ON_DEMAND not in c.markets:
                continue
            markets = tuple(m for m in c.markets if m is not Market.SPOT)
        else:
            markets = c.markets
        if step == "other_cloud":
            clouds = (c.clouds if c.clouds is not None else None)
            others = None if clouds is None else clouds - here
            if others is not None and not others:
                continue
            yield replace(c, markets=markets, clouds=others,
                          deny_clouds=c.deny_clouds | here, _region_ok={})
            continue
        clouds_here = here if c.clouds is None else c.clouds & here
        if not clouds_here:
            continue
        regions = c.regions
        if step == "same_region_spot":
            regions = frozenset({leaving.region, f"{leaving.cloud}:{leaving.region}"}) & \
                (c.regions if c.regions is not None else
                 frozenset({leaving.region, f"{leaving.cloud}:{leaving.region}"}))
            if not regions:
                continue
        yield replace(c, markets=markets, clouds=clouds_here, regions=regions,
                      _region_ok={})


def replacement(lease: Lease, view: optimizer.PoolView, policy: Policy,
                resident: Residency | None, now: datetime) -> optimizer.Outcome:
    """Where a failing lease goes: down the policy's fallback ladder, never back to the
    pool it leaves (on paid-for capacity, never back to its reservation or server: the
    pool may give it another one), scored at the request's risk level (its verdict's);
    a move is not held back by the team's budget or GPU limit."""
    verdict = evaluate(policy, lease.request, None, resident)
    here = view.get(lease.placement.pool)
    exclude = frozenset() if here is not None and here.targets else \
        frozenset({lease.placement.pool})
    if isinstance(verdict, Denied):
        return optimizer.Rejection(optimizer.Ask(lease.request, exclude), verdict.code,
                                   verdict.detail)
    verdict = replace(verdict, budget_left=None)
    outcome: optimizer.Outcome | None = None
    for step in ladder(verdict, lease.placement.pool, policy.failover):
        [outcome] = optimizer.place([optimizer.Ask(lease.request, exclude, step)], view,
                                    policy, now=now)
        if isinstance(outcome, optimizer.Decision):
            return outcome
    if outcome is None:  # every ladder step was impossible for this request
        return optimizer.Rejection(optimizer.Ask(lease.request, exclude),
                                   RejectCode.POLICY_DENIED,
                                   "no step of the failover ladder applies to this lease")
    return outcome


def current_cost(lease: Lease, view: optimizer.PoolView, policy: Policy) -> float | None:
    """The lease's expected cost per hour where it is, at the pool's price now, scored
    at its request's risk level (as its replacement is: `risk_for`)."""
    offer = view.get(lease.placement.pool)
    if offer is None or offer.price_per_hour is None:
        return None
    scored = policy.for_risk(risk_for(policy, lease.request))
    return optimizer.expected_cost(offer, lease.placement.instances, scored,
                                   hazard=optimizer.hazard_for(view, scored, lease.request))


def saving(lease: Lease, outcome: optimizer.Outcome, view: optimizer.PoolView,
           policy: Policy) -> float | None:
    """The share of the lease's expected cost a move to `outcome` saves (None: unknown)."""
    now_cost = current_cost(lease, view, policy)
    if now_cost is None or now_cost <= 0 or not isinstance(outcome, optimizer.Decision):
        return None
    return 1.0 - outcome.expected_cost_per_hour / now_cost


def reoptimize(leases: Sequence[Lease], view: optimizer.PoolView, policy: Policy,
               resident: Residency | None, now: datetime) -> list[Trigger]:
    """Leases a better placement would save at least `reoptimize_min_saving` on. Only
    the price and signals now count; the anti-flap limits still apply to the move."""
    threshold = policy.failover.reoptimize_min_saving
    if threshold is None:
        return []
    out = []
    for lease in leases:
        gain = saving(lease, replacement(lease, view, policy, resident, now), view, policy)
        if gain is not None and gain >= threshold:
            out.append(Trigger(lease.lease_id, lease.epoch, FailoverReason.REOPTIMIZED,
                               f"a placement {gain:.0%} cheaper in expected cost is free "
                               f"(reoptimize_min_saving {threshold:.0%})"))
    return out


class Holdings(optimizer.PoolView, Protocol):
    """A pool view that also keeps the broker's holdings and cool-downs: the daemon's
    `ResourcePool`, a backtest strategy's view."""

    def take(self, placement: Placement) -> Placement:
        """Hold a placement's instances; the placement with its targets assigned."""

    def give_back(self, placement: Placement) -> None: ...

    def cool_down(self, key: PoolKey, seconds: float) -> None: ...


@dataclass(frozen=True, slots=True)
class Step:
    """What handling one trigger did: `skipped` (the lease moved or ended since the
    trigger), `held_back` (the anti-flap limits; `why` says which), `stays` (a move by
    choice that found nowhere better, or not enough better), `moved` or `failed`.
    `lease` is the lease after the step, `old` its placement before."""

    kind: str
    lease: Lease | None = None
    old: Placement | None = None
    outcome: optimizer.Outcome | None = None
    why: str = ""


def step(trigger: Trigger, *, book: LeaseBook, pool: Holdings, policy: Policy,
         moves: dict[str, list[datetime]], now: datetime,
         find: Callable[[Lease], optimizer.Outcome]) -> Step:
    """Handle one trigger on the lease book and the pool — the one failover decision
    the daemon (`broker.leasing.authority`) and the backtest both make; `find(lease)` is where the
    lease could go (the daemon: `replacement`; the backtest: its strategy's move).
    Holds and releases the pool's instances, records the move in `moves` (the anti-flap
    record), and ends a lease that must go and has nowhere to. What it publishes or
    counts is the caller's."""
    lease = book.get(trigger.lease_id)
    if lease is None or lease.state is not LeaseState.ACTIVE or \
            lease.epoch != trigger.epoch:
        return Step("skipped", lease)
    why = held_back(trigger, lease, policy.failover, moves.get(lease.lease_id, ()), now)
    if why:
        return Step("held_back", lease, why=why)
    old = lease.placement
    if trigger.cool_down:
        pool.cool_down(old.pool, policy.failover.cooldown_seconds)
    pool.give_back(old)
    outcome = find(lease)
    if trigger.reason is FailoverReason.REOPTIMIZED:
        gain = saving(lease, outcome, pool, policy)
        threshold = policy.failover.reoptimize_min_saving
        if gain is None or threshold is None or gain < threshold:
            pool.take(old)  # the saving is gone: stay
            return Step("stays", lease, old, outcome)
    if isinstance(outcome, optimizer.Decision):
        moved = book.failover(lease.lease_id, pool.take(outcome.placement), now)
        moves[moved.lease_id] = [*recent(moves.get(moved.lease_id, ()), now), now]
        return Step("moved", moved, old, outcome)
    if trigger.reason in DISCRETIONARY or trigger.reason is FailoverReason.MAINTENANCE:
        # A move by choice, or ahead of a maintenance window (the server is still up;
        # when the window starts it leaves the pool and the lease moves or fails then):
        # the lease stays.
        pool.take(old)
        return Step("stays", lease, old, outcome)
    ended = book.end(lease.lease_id, LeaseState.FAILED, now, reason=trigger.reason.value,
                     detail=f"{trigger.detail}; no other placement: "
                            f"{getattr(outcome, 'detail', '')}")
    moves.pop(lease.lease_id, None)
    return Step("failed", ended, old, outcome)
