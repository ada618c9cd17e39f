"""The lease authority's placements: a batch's `place` requests parsed, their earlier
leases recalled from the store, the batch solved (heuristic, or the MILP within its
share of the CPU), and each request decided or rejected."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import structlog

from broker.leasing.batch import INTERNAL, Batch, part_json
from broker.leasing.book import LeaseBook
from broker.market.hazard import horizon_bucket
from broker.market.pool import ResourcePool
from broker.model import (
    Event,
    Lease,
    LeaseState,
    PlaceRequest,
    iso,
)
from broker.placement import optimizer
from broker.state.keyfilter import KeyFilter
from broker.state.store import Store
from broker.wire import validation
from broker.wire.commands import Command
from broker.wire.messages import Messages, lease_subject, request_subject
from policies.evaluate import Denied, evaluate
from policies.model import Policy, RiskLevel
from policies.residency import Residency

log = structlog.get_logger("gpubroker.broker")

MILP_SHARE = 0.1
"""The share of the CPU the MILP may take over time (see `Broker._milp_allowed`)."""
MILP_BURST_SECONDS = 1.0
THREAD_MIN_BATCH = 1024
"""Batches of this many requests or more are solved in a worker thread (see `_place`),
and so is every batch that goes to the MILP (`HEURISTIC_FIRST_MAX`)."""

HEURISTIC_FIRST_MAX = 16
"""A batch that may go to the MILP of at most this many requests is decided by the
heuristic on the event loop first (a millisecond or two), and goes to the MILP, in a
worker thread, only if the heuristic cannot prove its answer optimal; a larger one goes
to the thread at once, the loop free while its heuristic runs there."""

FREEZE_MAKE_MAX = 2_000
"""The most cost-list entries a batch for a worker thread leaves `CostIndex.frozen` to
make at once, on the event loop (`CostIndex.unmade`; some 6 µs each: every list at
50,000 offers, after a refresh of the hazard estimator, took 323 ms). Beyond it a batch
that may go to the MILP is decided by the heuristic instead, which makes only the lists
it reads, and a large batch waits for them, made a step at a time."""


_T = TypeVar("_T")


class Loan(Protocol):
    """What a worker thread reads that the event loop lent it: `optimizer.Snapshot`,
    `optimizer.FrozenCosts`."""

    def return_loan(self) -> None: ...


async def on_loan(loans: Sequence[Loan], fn: Callable[..., _T], *args: Any,
                  **kwargs: Any) -> _T:
    """`fn(*args, **kwargs)` in a worker thread that reads `loans`, returned once it is
    done (until then the pool and the cost index copy what they lent before changing
    it): by the thread as it ends, through the loop, so a wait cancelled meanwhile (the
    thread goes on reading) returns them all the same, once the thread is done."""
    loop = asyncio.get_running_loop()

    def returned() -> None:
        for loan in loans:
            loan.return_loan()

    def run() -> _T:
        try:
            return fn(*args, **kwargs)
        finally:
            # Before the result reaches the waiting task: both go through the loop's
            # queue, in this order.
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(returned)

    return await asyncio.to_thread(run)


def _solve_timed(*args: Any, **kwargs: Any) -> tuple[optimizer.BatchResult, float]:
    """`optimizer.solve`, and the CPU time it took (of the thread it ran on)."""
    started = time.thread_time()
    result = optimizer.solve(*args, **kwargs)
    return result, time.thread_time() - started


class Placing:
    """The lease authority's placement of `place` requests (`Broker` is made of it)."""

    if TYPE_CHECKING:
        pool: ResourcePool
        book: LeaseBook
        store: Store
        messages: Messages
        policy: Policy
        settings: optimizer.BatchSettings
        last_batch: optimizer.BatchResult | None
        batch_observers: list[Callable[[optimizer.BatchResult], None]]
        decision_latency: Callable[[float], None] | None
        stored_keys: KeyFilter | None
        _clock: Callable[[], datetime]
        _retry_after: float
        _milp_budget: float
        _milp_refilled: float
        _costs: optimizer.CostIndex | None
        _created_keys: list[tuple[str, str]] | None
        _requests: asyncio.Queue[Command]
        _waiting: threading.Event

        def _expires(self, at: datetime) -> None: ...

        def _resident_now(self) -> Residency: ...

        @property
        def pending_failovers(self) -> int: ...

        def _emit(self, b: Batch, event: Event, cmd: Command | None = None) -> None: ...

        def _invalid(self, b: Batch, cmd: Command, request_id: str | None,
                     errors: list[dict[str, str]]) -> None: ...

    def _known_gpus(self) -> set[str]:
        """GPU models a request may name besides the canonical ones: the policy's
        `extra_gpus` and every model in the pool now (requests.unknown_gpus)."""
        return set(self.policy.extra_gpus) | self.pool.gpus()

    def _parse_place(self, cmd: Command) -> PlaceRequest | validation.Invalid:
        try:
            return validation.parse_place(cmd.scheduler, cmd.payload)
        except Exception:
            log.exception("internal error parsing a request; answered request.invalid",
                          scheduler=cmd.scheduler, topic=cmd.topic, size=len(cmd.payload))
            return validation.Invalid([INTERNAL])

    async def _recall(self, reqs: Sequence[PlaceRequest]) -> None:
        """Bring leases of these requests that ended long ago back from the store, in one
        query, so that a repeated request gets its lease whatever its age."""
        known = self.stored_keys
        if known is not None and known.full:
            log.warning("more leases than the key filter was sized for: every new request "
                        "is looked up in the store until the next start",
                        capacity=known.capacity)
            known = self.stored_keys = None
        unknown = list(dict.fromkeys(
            (r.scheduler, r.request_id) for r in reqs
            if ((head := self.book.find(r.scheduler, r.request_id)) is None
                or self.book.siblings(head) is None)  # a part forgotten before its head
            and (known is None or known.may_hold(r.scheduler, r.request_id))))
        if not unknown:
            return
        for parts in (await self.store.find_leases(unknown)).values():
            for lease in parts:
                self.book.remember(lease)

    async def _place(self, b: Batch, asks: Sequence[tuple[Command, PlaceRequest]],
                     rejected: dict[tuple[str, str], optimizer.Rejection]) -> None:
        """Place a batch together: each ask is judged by the policy against its team's
        usage before the batch; the optimizer keeps the batch within the teams' limits."""
        now = self._clock()
        todo: list[tuple[Command, PlaceRequest, optimizer.Ask]] = []
        for cmd, req in asks:
            verdict = evaluate(self.policy, req, self.book.team_usage(req.team),
                               self._resident_now(), self.pool.owned_gpus)
            if isinstance(verdict, Denied):
                outcome = optimizer.Rejection(optimizer.Ask(req), verdict.code,
                                              verdict.detail)
                rejected[(req.scheduler, req.request_id)] = outcome
                self._rejected(b, cmd, req, outcome)
                continue
            todo.append((cmd, req, optimizer.Ask(req, constraints=verdict)))
        if not todo:
            return
        # The MILP only with time to spare: while requests wait, the heuristic answers,
        # and the MILP takes at most its share of the CPU; one that arrives while the
        # MILP solves stops it (`_waiting`): the best answer so far is kept.
        settings = self.settings if self._requests.empty() and self._milp_allowed() else \
            dataclasses.replace(self.settings, exact_max_batch=0)
        batch = [a for _, _, a in todo]
        milp = 1 < len(batch) <= settings.exact_max_batch and settings.exact_time_limit > 0
        index = self._cost_index()
        horizons = {horizon_bucket(a.request.duration_hours) for a in batch}
        risks = {a.constraints.risk for a in batch if a.constraints is not None}
        # Cost lists a freeze would make at once, on the loop, beyond FREEZE_MAKE_MAX.
        behind = (milp or len(batch) >= THREAD_MIN_BATCH) and \
            index.unmade(horizons, risks) > FREEZE_MAKE_MAX
        if milp and behind:
            # The cost lists are being made (again, after a refresh of the hazard
            # estimator): frozen for the MILP's thread they would all be made at once, on
            # the loop; the heuristic here makes only those it reads.
            milp = False
            settings = dataclasses.replace(settings, exact_max_batch=0)
        result: optimizer.BatchResult | None = None
        cpu = 0.0
        if (len(batch) <= HEURISTIC_FIRST_MAX) if milp else (len(batch) < THREAD_MIN_BATCH):
            # Decided here; a small batch for the MILP by the heuristic first, and sent
            # to the MILP only if the heuristic cannot prove its answer optimal. At
            # 500/s that was 26 of 1,826 batches of 2 to 5: the others went to a worker
            # thread (a snapshot and the cost lists lent, the GIL shared with the event
            # loop, a few milliseconds each) for the answer the heuristic gives here.
            # The same answers: the thread's solve runs the same heuristic on the same
            # state first (the lock is held), then the MILP from it.
            result, cpu = _solve_timed(
                batch, self.pool, self.policy, now=now,
                retry_after_seconds=self._retry_after, costs=index,
                settings=dataclasses.replace(settings, exact_max_batch=0) if milp
                else settings)
        if result is None or (milp and not result.optimal):
            # The MILP, or a large batch (thousands of requests), is solved in a worker
            # thread on a snapshot of the pool, so the event loop keeps serving MQTT,
            # polls and HTTP meanwhile; the lock keeps every other change out until the
            # outcome is committed, here, on the loop.
            if behind:
                # A large batch: the lists made first, a step at a time, the event loop
                # free between two (the batch waits, as its requests would anyway).
                await self.prepare_costs()
            view, costs = self._lend(index, horizons, risks, now)
            if milp:
                # Nothing waits now (the queue is empty, above), unless a failover does.
                self._waiting.clear()
                if self.pending_failovers:
                    self._waiting.set()
            result, more = await on_loan(
                (view, costs), _solve_timed, batch, view, self.policy, now=now,
                retry_after_seconds=self._retry_after, settings=settings, costs=costs,
                stop=self._waiting.is_set if milp else None)
            cpu += more
        self.last_batch = result
        if settings.exact_max_batch and settings.exact_time_limit > 0:
            # What the whole solve took of the CPU, MILP or not: listing the options the
            # MILP prices out costs more than the MILP itself, and `result.seconds`
            # counts neither the first listing nor the heuristic before it.
            self._milp_budget -= cpu
        for (cmd, req, ask), out in zip(todo, result.outcomes, strict=True):
            if isinstance(out, optimizer.Rejection):
                rejected[(req.scheduler, req.request_id)] = out
                self._rejected(b, cmd, req, out)
                continue
            c = ask.constraints
            assert c is not None
            # The pool holds each placement's instances and names the reservations or
            # servers it launches into, before the lease records it.
            if out.parts:
                parts = tuple((self.pool.take(p), gpus) for p, gpus in out.parts)
                made = self.book.create_split(req, parts, lease_seconds=c.lease_seconds,
                                              cap=c.cap, now=now)
            else:
                made = [self.book.create(req, self.pool.take(out.placement),
                                         lease_seconds=c.lease_seconds, cap=c.cap, now=now)]
            lease = made[0]
            self._note_key(lease)
            b.answered[(req.scheduler, req.request_id)] = lease
            self._decided(b, lease, cmd, out.reason, out.alternatives, made)
            self._expires(min(part.expires_at for part in made))
        for observe in self.batch_observers:
            observe(result)

    def _lend(self, index: optimizer.CostIndex, horizons: set[float],
              risks: set[RiskLevel | None], now: datetime
              ) -> tuple[optimizer.Snapshot, optimizer.FrozenCosts]:
        """The pool and the cost lists lent to a batch for a worker thread (`on_loan`
        returns them)."""
        view = optimizer.Snapshot(self.pool, now)
        try:
            return view, index.frozen(horizons, risks)
        except BaseException:
            view.return_loan()  # else every later change would copy first
            raise

    def _milp_allowed(self) -> bool:
        """Whether a batch may go to the MILP now: a token bucket of solve time that
        refills at MILP_SHARE of a second per second. Under a steady stream the queue
        empties often, and each small batch sent to the MILP (up to its time limit) took
        the CPU the next requests needed; now the MILP gets its share and the rest of
        the time the heuristic answers."""
        now = time.monotonic()
        self._milp_budget = min(MILP_BURST_SECONDS, self._milp_budget
                                + (now - self._milp_refilled) * MILP_SHARE)
        self._milp_refilled = now
        return self._milp_budget > 0

    def _note_key(self, lease: Lease) -> None:
        if self.stored_keys is not None:
            self.stored_keys.add(lease.scheduler, lease.request_id)
        elif self._created_keys is not None:
            self._created_keys.append((lease.scheduler, lease.request_id))

    async def prepare_costs(self) -> int:
        """The cost index's lists made ahead of the batches that will ask for them, and
        the offers changed since placed again in them (`CostIndex.prepare`), a step at a
        time, the event loop free between two. Not under the broker's lock: a batch
        decided in a worker thread meanwhile reads lists the index lent it, which the
        index copies before it changes them (`CostIndex.frozen`); held back, the changes
        of every poll made during such a batch were all placed again by the next one,
        on the loop. Returns how many steps were taken."""
        index = self._cost_index()
        made = 0
        for _ in index.prepare():
            made += 1
            # The rest of the loop runs here: the steps must not run in one go.
            await asyncio.sleep(0)
            if self._costs is not index:
                break  # a new policy's index: its own lists, later
        return made

    def _cost_index(self) -> optimizer.CostIndex:
        """The pool's offers in order of expected cost under the policy in force."""
        costs = self._costs
        if costs is None or costs.policy is not self.policy:
            if costs is not None:
                costs.close()
            costs = self._costs = optimizer.CostIndex(self.pool, self.policy)
        return costs

    def _rejected(self, b: Batch, cmd: Command, req: PlaceRequest,
                  outcome: optimizer.Rejection) -> None:
        data: dict[str, Any] = {"request_id": req.request_id, "code": outcome.code.value,
                                "detail": outcome.detail}
        if outcome.retry_after_seconds is not None:
            data["retry_after_seconds"] = outcome.retry_after_seconds
        self._emit(b, Event("placement.rejected", req.scheduler, data,
                            request_subject(req.request_id), req.request_id), cmd)

    def _decided(self, b: Batch, lease: Lease, cmd: Command | None, reason: str,
                 alternatives: Sequence[Any], parts: Sequence[Lease] | None = None) -> None:
        """`placement.decided` for `lease`; for a split request's head, with `parts`:
        every part's lease as it is now (the book's, when not given)."""
        if lease.parts and parts is None:
            parts = self.book.siblings(lease)
        data: dict[str, Any] = {
            "request_id": lease.request_id,
            "lease_id": lease.lease_id,
            "epoch": lease.epoch,
            "placement": lease.placement.to_json(),
            "expires_at": iso(lease.expires_at),
            "reason": reason,
            "alternatives": [a.to_json() for a in alternatives],
            "lease_seconds": lease.lease_seconds,
        }
        if lease.state is not LeaseState.ACTIVE:
            data["state"] = lease.state.value
            data.update(lease.end_json())
        if lease.parts and parts:
            data["parts"] = [part_json(p) for p in parts]
        b.leases[lease.lease_id] = lease
        self._emit(b, Event("placement.decided", lease.scheduler, data,
                            lease_subject(lease.lease_id), lease.request_id),
                   cmd)
        for part in parts or (lease,):
            b.leases[part.lease_id] = part
            b.rows.append(self.messages.lease_state(part))
