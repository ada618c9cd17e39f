"""Strategies run through a market and a workload, on a simulated clock.

The run uses the daemon's own parts: a real `ResourcePool` fed slice by slice from the
market trace (its clock is the simulated one; offers never go stale, since a trace row
holds until the pool's next row), a real `LeaseBook`, `broker.leasing.failover`'s triggers
(`from_pool_change`, `held_back`) and the strategy's placement and failover code. No
sleeping, no MQTT, no asyncio.

`simulate` runs several strategies in lockstep over one market `ResourcePool` (the
market is the same for all, and feeding a pool is most of the work): each strategy reads
it through its own `StrategyView`, whose holdings and cool-downs live in a `ResourcePool`
of its own, and has its own lease book, jobs and events. Strategies share nothing else,
so each run is what it would be alone. A strategy whose policy keeps pool history
(`scoring.hazard_half_life_hours` > 0: gpubroker's; the baselines' is 0) scores spot
pools with a `broker.market.hazard.HazardEstimator` on its view, fed by the market pool as each
step's rows land (as the daemon's is fed by its polls): it knows no row after the
simulated present. Events, in time order (and in this order at one instant):

1. **market**: the rows of one instant, applied slice by slice to the pool. Leases on a
   pool whose price changed pay the new price from then on. `failover.from_pool_change`
   raises the daemon's triggers: pool gone or availability 0 → `capacity_lost`; price
   above the lease's cap (or the policy's spike ratio) → `price_above_cap`, which the
   anti-flap limits may hold back, and which leaves the lease where it is when nothing
   better is free. A pool's capacity falling below what leases hold moves nothing:
   `capacity` is the cloud's estimate of *free* instances, and running instances are
   lost only by the events named here.
2. **interruption** (`draws.hazard_schedule`, the same draws for every strategy): a
   pool-wide draw interrupts every lease on its pool; each lease on a spot pool also
   meets its own draw per step, keyed on (draw seed, pool, step, job), which interrupts
   a lease of n instances at the chance that any of them is reclaimed. The draws follow
   a generated market's hidden true hazard, which the strategies never see. An
   interrupted lease is moved (reason `interrupted`), and the pool cools down for
   `failover.cooldown_seconds`, as the daemon does on a preemption notice. An
   interruption always moves the lease, even when the policy switches the `interrupted`
   trigger off (the scheduler's `report` would).
3. **completion**: a job ends when it has done `duration_hours` of useful work.
4. **placement**, at each arrival instant and at each step of the grid: the requests
   arriving then and (at a step) every request still waiting, oldest first, as one batch.
   Then, at a step, when the policy sets `failover.reoptimize_min_saving`, the daemon's
   health-check re-optimisation (`failover.reoptimize`) over every running lease.

**Work and money.** Every placement, first or after a move, starts with the job's
start-up (`startup_minutes`: boot, image pull, checkpoint load; paid, no useful work);
then the job works, saving a checkpoint every `checkpoint_minutes` of work on that
placement. A move (an interruption, a capacity loss or a discretionary move) keeps the
work up to the last checkpoint and loses the rest (checkpoint 0: it loses nothing).
Both come from the workload line, else from `Settings` (`--startup-minutes`,
`--checkpoint-minutes`). The policy's `scoring.restart_hours` is only what the optimizer
assumes a restart costs; it plays no part here. A lease pays its pool's price, as it
changes, for every hour it holds instances; useful GPU-hours are the work kept times
the GPUs asked; lost GPU-hours are the start-ups and the work lost, times the GPUs
asked (so paid = useful + lost + idle); GPUs paid for but not asked for are idle.

**Waiting.** A request that cannot be placed waits and is tried again at every step
until placed, or counted never placed after `max_wait_hours` (or at the market's end).
A failover that finds nowhere to go ends the lease (`lease.failed`, as in the daemon);
the job then asks again at every step like a new request (its request_id suffixed `~N`)
and is abandoned after `max_wait_hours` without a placement. A request the policy denies
is never placed at once. At the market's end, running jobs stop and keep their work (a
start-up not finished then counts as lost).

**Hidden pools.** `simulate` may hide pools from a strategy's run (`hidden`): its view
lists no offer of them and knows none by key, as if the market had none. A private pool
(`private.with_private`) hidden from one run of a strategy and shown to another compares
the two on one market pool, in the same lockstep, with the same requests and draws: the
run that does not see it is the run of the market without it. A run tallies what it holds
on paid-for capacity (market `reserved`) per pool: the GPU-hours its leases hold there
(`reserved_gpu_hours`) and, of those, the GPUs the jobs asked for
(`reserved_asked_gpu_hours`; a server is one lease's, whole). The policy's verdict on a
request is given the paid-for GPUs the run sees (a team's `private_share`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from broker.backtest.draws import HazardSchedule
from broker.backtest.ledger import NEVER_STALE, Job, Settings, StrategyView, Tally
from broker.backtest.market import MarketTrace, SliceId
from broker.backtest.strategies import Strategy, rid
from broker.backtest.workload import Workload
from broker.leasing import failover
from broker.leasing.book import LeaseBook
from broker.market.changes import PoolChange
from broker.market.hazard import HazardEstimator
from broker.market.pool import ResourcePool
from broker.model import (
    FailoverReason,
    Lease,
    LeaseState,
    Market,
    Offer,
    Placement,
    PoolKey,
    RejectCode,
)
from broker.placement.optimizer import Ask, Decision, Rejection
from policies.evaluate import Denied, evaluate
from policies.model import Policy

_INTERRUPT, _COMPLETE, _PLACE = range(3)
_INVOLUNTARY = frozenset({FailoverReason.INTERRUPTED, FailoverReason.CAPACITY_LOST,
                          FailoverReason.REPORTED})

DayProgress = Callable[[int, int], None]


def simulate(market: MarketTrace, workload: Workload, strategies: Sequence[Strategy],
             schedule: HazardSchedule, settings: Settings,
             progress: DayProgress | None = None,
             hidden: Sequence[Collection[PoolKey]] | None = None) -> list[Tally]:
    """Run each strategy through `market` and `workload` (see the module docstring);
    `hidden[i]`: the pools the i-th strategy's run does not see (none by default)."""
    if hidden is not None and len(hidden) != len(strategies):
        raise ValueError("simulate: one set of hidden pools per strategy")
    now = [market.start]
    pool = ResourcePool(stale_after_seconds=NEVER_STALE, clock=lambda: now[0])
    runs = [Run(market, workload, s, schedule, settings, pool,
                hidden=() if hidden is None else hidden[i])
            for i, s in enumerate(strategies)]
    estimators: dict[float, HazardEstimator] = {}
    for run in runs:
        run.pool.hazard = _estimator(run.policy, pool, estimators)
    slices: dict[SliceId, dict[PoolKey, Offer]] = {}
    end = market.seconds
    days = max(1, math.ceil(end / 86400 - 1e-9))
    day = -1
    for step in market.steps:
        if step.at >= end:
            break
        for run in runs:
            run.advance(step.at)
        now[0] = market.at(step.at)
        if progress is not None and int(step.at // 86400) != day:
            day = int(step.at // 86400)
            progress(day + 1, days)
        changes: list[PoolChange] = []
        for slice_id, rows in step.slices:
            offers = slices.setdefault(slice_id, {})
            for key, offer in rows:
                if offer is None:
                    offers.pop(key, None)
                else:
                    offers[key] = offer
            changes.append(pool.replace(slice_id, list(offers.values())))
        for run in runs:
            run.market_changed(step.at, changes)
    for run in runs:
        run.advance(end)
        run.finish(end)
    return [run.tally for run in runs]


def _estimator(policy: Policy, pool: ResourcePool, made: dict[float, HazardEstimator]
               ) -> HazardEstimator | None:
    """The hazard estimator a strategy's view scores with (None when its policy keeps no
    history): one per half-life, fed by the market pool as each step's rows land, so it
    never knows a row after the simulated present."""
    hours = policy.scoring.hazard_half_life_hours
    if hours <= 0:
        return None
    est = made.get(hours)
    if est is None:
        est = made[hours] = HazardEstimator(half_life_hours=hours)
        pool.feed_hazard(est)
    return est


class Run:
    """One strategy through the market and the workload (see the module docstring)."""

    def __init__(self, market: MarketTrace, workload: Workload, strategy: Strategy,
                 schedule: HazardSchedule, settings: Settings,
                 pool: ResourcePool, hidden: Collection[PoolKey] = ()) -> None:
        self.market = market
        self.strategy = strategy
        self.policy = strategy.policy
        self.settings = settings
        self.now = market.start
        self.pool = StrategyView(pool, lambda: self.now, hidden=hidden)
        self.book = LeaseBook()
        self.tally = Tally(requests=len(workload.arrivals))
        self.schedule = schedule
        self._jobs: list[Job] = [
            Job(i, a, strategy.adapt(a.request), a.duration_hours,
                 60.0 * (settings.startup_minutes if a.startup_minutes is None
                         else a.startup_minutes),
                 (settings.checkpoint_minutes if a.checkpoint_minutes is None
                  else a.checkpoint_minutes) / 60.0)
            for i, a in enumerate(workload.arrivals)]
        self._spot: dict[int, Job] = {}  # jobs on a spot placement, by index
        self._by_lease: dict[str, Job] = {}
        self._moves: dict[str, list[datetime]] = {}
        self._queue: list[Job] = []  # waiting for a placement
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        for at, key in schedule.pool_hits:
            self._push(at, _INTERRUPT, key)
        ticks = max(1, math.ceil(market.seconds / settings.step_seconds - 1e-9))
        for k in range(ticks):
            self._push(k * settings.step_seconds, _PLACE, None)
        for job in self._jobs:
            self._push(job.arrival.at, _PLACE, job)

    def _push(self, at: float, kind: int, what: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at, kind, self._seq, what))

    def _dt(self, t: float) -> datetime:
        return self.market.start + timedelta(seconds=t)

    # --- the loop --------------------------------------------------------------------

    def advance(self, until: float) -> None:
        """Handle this run's own events before `until` (seconds)."""
        events = self._events
        while events and events[0][0] < until:
            t, kind, _, what = heapq.heappop(events)
            self.now = self._dt(t)
            if kind == _INTERRUPT:
                self._interrupt(t, what)
            elif kind == _COMPLETE:
                job, version = what
                if job.version == version and not job.done:
                    self._complete(t, job)
            else:
                tick = what is None
                arrivals = [] if tick else [what]
                while events and events[0][0] == t and events[0][1] == _PLACE:
                    more = heapq.heappop(events)[3]
                    if more is None:
                        tick = True
                    else:
                        arrivals.append(more)
                self._place(t, arrivals, tick)

    # --- market --------------------------------------------------------------------

    def market_changed(self, t: float, changes: Sequence[PoolChange]) -> None:
        """The market pool changed at `t`: new prices for the leases there; the daemon's
        failover triggers (`from_pool_change` acts on leased pools only, so it is given
        each change narrowed to the pools this run's leases hold)."""
        self.now = self._dt(t)
        leased = self.book.leased_pools()
        if not leased:
            return
        triggers = []
        for change in changes:
            # sorted: float sums must not follow a set's (hash-seeded) order
            updated = {k: change.updated[k] for k in sorted(change.updated.keys() & leased)}
            removed = {k: change.removed[k] for k in sorted(change.removed.keys() & leased)}
            if not updated and not removed:
                continue
            for key, old in updated.items():
                new = change.offers[key].price_per_hour
                if old is None or new is None or new == old.price_per_hour:
                    continue
                for job in self._on(key):
                    self._pay(job, t)
                    assert job.placement is not None
                    job.rate = new * job.placement.instances
            triggers.extend(failover.from_pool_change(
                PoolChange(change.slice, updated, removed, change.offers), self.book,
                self.policy.failover))
        self._handle(t, triggers)

    def _on(self, key: PoolKey) -> list[Job]:
        """The jobs holding `key`, in a fixed order (the book keeps a set)."""
        return sorted((self._by_lease[le.lease_id] for le in self.book.on_pool(key)),
                      key=lambda j: j.index)

    def _interrupt(self, t: float, what: Any) -> None:
        """A pool-wide interruption (`what` a PoolKey: every lease on the pool), or a
        lease's own (`what` = (job, version): that job's lease, if it still holds it)."""
        if isinstance(what, PoolKey):
            jobs = self._on(what)
        else:
            job, version = what
            if job.version != version or job.done or job.lease_id is None:
                return
            jobs = [job]
        reason = (FailoverReason.INTERRUPTED if self.policy.failover.triggers.interrupted
                  else FailoverReason.REPORTED)
        triggers = []
        for job in jobs:
            lease = self.book.get(job.lease_id or "")
            assert lease is not None
            triggers.append(failover.Trigger(lease.lease_id, lease.epoch, reason,
                                             "spot interruption (backtest draw)",
                                             cool_down=True))
        self._handle(t, triggers)

    def _arm(self, job: Job, t: float, k: int) -> None:
        """Make job's lease draw of step k (once per placement and step): an
        interruption event if it hits at or after `t`."""
        if job.armed == k:
            return
        job.armed = k
        p = job.placement
        assert p is not None
        hit = self.schedule.lease_hit(p.pool, k, job.index, p.instances)
        if hit is not None and hit >= t:
            self._push(hit, _INTERRUPT, (job, job.version))

    def _handle(self, t: float, triggers: list[failover.Trigger]) -> None:
        order = {id(tr): self._by_lease[tr.lease_id].index for tr in triggers}
        for trigger in sorted(triggers, key=lambda tr: order[id(tr)]):
            self._fail_over(t, trigger)

    def _fail_over(self, t: float, trigger: failover.Trigger) -> None:
        """The daemon's failover decision (`failover.step`), on the simulated clock;
        the jobs and the tally follow it."""
        lease = self.book.get(trigger.lease_id)
        step = failover.step(trigger, book=self.book, pool=self.pool, policy=self.policy,
                             moves=self._moves, now=self.now,
                             find=lambda le: self.strategy.move(le, self.pool, self.now))
        if step.kind in ("skipped", "held_back"):
            return
        assert lease is not None and step.old is not None
        job = self._by_lease[lease.lease_id]
        involuntary = trigger.reason in _INVOLUNTARY
        if trigger.reason is FailoverReason.CAPACITY_LOST:
            self.tally.capacity_lost += 1
        elif involuntary:
            self.tally.interrupted += 1
        if involuntary:
            self.tally.losses.append((t, trigger.reason.value, step.old.pool))
        if step.kind == "moved":
            assert step.lease is not None
            self._stop(job, t, restart=True)
            self.tally.failovers[trigger.reason.value] += 1
            self._start(job, t, step.lease.placement)
        elif step.kind == "failed":
            assert isinstance(step.outcome, Rejection)
            self._stop(job, t, restart=True)
            self.tally.failovers_nowhere += 1
            job.lease_id, job.placement, job.lost_at = None, None, t
            job.last_code = step.outcome.code.value
            self._queue.append(job)

    # --- jobs ------------------------------------------------------------------------

    def _pay(self, job: Job, t: float) -> None:
        p = job.placement
        assert p is not None
        hours = (t - job.paid_since) / 3600.0
        job.paid_since = t
        if hours <= 0:
            return
        tally = self.tally
        tally.cost += job.rate * hours
        tally.paid_gpu_hours += p.total_gpus * hours
        tally.idle_gpu_hours += (p.total_gpus - job.gpus) * hours
        if p.pool.market is Market.SPOT:
            tally.spot_gpu_hours += p.total_gpus * hours
            tally.spot_gpu_hours_by_cloud[p.pool.cloud] += p.total_gpus * hours
        elif p.pool.market is Market.RESERVED:
            key = p.pool
            tally.reserved_gpu_hours[key] = tally.reserved_gpu_hours.get(key, 0.0) \
                + p.total_gpus * hours
            tally.reserved_asked_gpu_hours[key] = \
                tally.reserved_asked_gpu_hours.get(key, 0.0) + job.gpus * hours
            tally.reserved_cost[key] = tally.reserved_cost.get(key, 0.0) + job.rate * hours

    def _start(self, job: Job, t: float, placement: Placement) -> None:
        job.placement = placement
        job.started = job.paid_since = t
        job.ready = t + job.startup
        job.rate = placement.price_per_hour
        job.version += 1
        self._push(job.ready + (job.need - job.work) * 3600.0, _COMPLETE, (job, job.version))
        if placement.pool.market is Market.SPOT:
            self._spot[job.index] = job
            job.armed = -1
            self._arm(job, t, math.floor(t / self.settings.step_seconds + 1e-9))

    def _stop(self, job: Job, t: float, *, restart: bool) -> None:
        """The job stops working on its placement at `t`: pay up to `t`; the start-up
        is lost; on a restart, so is the work since the last checkpoint."""
        self._pay(job, t)
        self._spot.pop(job.index, None)
        startup = (min(t, job.ready) - job.started) / 3600.0
        worked = max(0.0, t - job.ready) / 3600.0
        kept = worked
        if restart and job.checkpoint > 0:
            kept = math.floor(worked / job.checkpoint + 1e-9) * job.checkpoint
        job.work = min(job.need, job.work + kept)
        self.tally.lost_gpu_hours += (worked - kept + startup) * job.gpus
        self.tally.startup_gpu_hours += startup * job.gpus
        job.version += 1  # its completion, if scheduled, is void

    def _complete(self, t: float, job: Job) -> None:
        assert job.lease_id is not None and job.placement is not None
        self._stop(job, t, restart=False)
        job.work = job.need
        lease = self.book.end(job.lease_id, LeaseState.RELEASED, self.now)
        self.pool.unhold(lease.placement.pool, lease.placement.instances)
        job.done = True
        self.tally.completed += 1
        self.tally.useful_gpu_hours += job.work * job.gpus

    # --- placement -------------------------------------------------------------------

    def _place(self, t: float, arrivals: list[Job], tick: bool) -> None:
        limit = self.settings.max_wait_hours * 3600.0
        batch: list[Job] = []
        if tick:
            k = round(t / self.settings.step_seconds)
            for job in list(self._spot.values()):
                self._arm(job, t, k)
            queue, self._queue = sorted(self._queue, key=lambda j: j.index), []
            for job in queue:
                if job.lost_at is None and t - job.arrival.at >= limit:
                    self._never(job)
                elif job.lost_at is not None and t - job.lost_at >= limit:
                    self._abandon(job, t)
                else:
                    batch.append(job)
        batch.extend(arrivals)
        if batch:
            self._place_batch(t, batch)
        if tick:
            self._reoptimize(t)

    def _place_batch(self, t: float, batch: list[Job]) -> None:
        now = self.now
        asks: list[Ask] = []
        verdicts = {}
        for job in batch:
            req = job.req if job.leases == 0 else \
                replace(job.req, request_id=f"{job.req.request_id}~{job.leases + 1}")
            verdict = evaluate(self.policy, req, self.book.team_usage(req.team),
                               self.strategy.resident, self.pool.owned_gpus)
            if isinstance(verdict, Denied):
                job.last_code = verdict.code.value
                if verdict.code is not RejectCode.POLICY_DENIED:
                    self._queue.append(job)
                elif job.lost_at is None:
                    self._never(job)
                else:
                    self._abandon(job, t)
                continue
            asks.append(Ask(req, constraints=verdict))
            verdicts[rid(req)] = (job, req, verdict)
        if not asks:
            return
        outcomes = {rid(o.ask.request): o for o in self.strategy.place(asks, self.pool, now)}
        for ask in asks:
            key = rid(ask.request)
            job, req, verdict = verdicts[key]
            outcome = outcomes[key]
            if not isinstance(outcome, Decision):
                job.last_code = outcome.code.value
                self._queue.append(job)
                continue
            lease = self.book.create(req, outcome.placement, lease_seconds=verdict.lease_seconds,
                                     cap=verdict.cap, now=now)
            self.pool.hold(lease.placement.pool, lease.placement.instances)
            self._adopt(job, lease, t)

    def _reoptimize(self, t: float) -> None:
        """The daemon's health check with `failover.reoptimize_min_saving`: move leases
        a placement enough cheaper in expected cost would serve (at every step here)."""
        if self.policy.failover.reoptimize_min_saving is None:
            return
        active = sorted(self.book.active(), key=lambda le: self._by_lease[le.lease_id].index)
        self._handle(t, failover.reoptimize(active, self.pool, self.policy,
                                            self.strategy.resident, self.now))

    def _adopt(self, job: Job, lease: Lease, t: float) -> None:
        job.leases += 1
        job.lease_id = lease.lease_id
        self._by_lease[lease.lease_id] = job
        if job.first_placed is None:
            job.first_placed = t
            self.tally.placed += 1
            self.tally.waits.append((t - job.arrival.at) / 3600.0)
        if job.lost_at is not None:
            self.tally.hours_without_placement += (t - job.lost_at) / 3600.0
            job.lost_at = None
        self._start(job, t, lease.placement)

    def _never(self, job: Job) -> None:
        job.done = True
        self.tally.never_placed[job.last_code] += 1

    def _abandon(self, job: Job, t: float) -> None:
        assert job.lost_at is not None
        job.done = True
        self.tally.abandoned += 1
        self.tally.hours_without_placement += (t - job.lost_at) / 3600.0
        self.tally.useful_gpu_hours += job.work * job.gpus

    def finish(self, end: float) -> None:
        self.now = self._dt(end)
        for job in self._jobs:
            if job.done:
                continue
            if job.placement is not None:
                self._stop(job, end, restart=False)
                self.tally.running_at_end += 1
                self.tally.useful_gpu_hours += job.work * job.gpus
            elif job.first_placed is None:
                self.tally.never_placed[job.last_code if job.last_code != "none"
                                        else "not_tried"] += 1
            else:
                assert job.lost_at is not None
                self.tally.waiting_at_end += 1
                self.tally.hours_without_placement += (end - job.lost_at) / 3600.0
                self.tally.useful_gpu_hours += job.work * job.gpus
            job.done = True
