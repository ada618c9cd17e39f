"""The broker's decisions: requests in, lease changes and events out.

`Broker` owns the lease book and applies every change to it under one lock, in order:
placement requests (in batches), renewals, releases, reports, expiries and failovers.
Each change is committed to the state store together with the MQTT messages it causes
(the outbox) before anything is published, so a crash never loses a decision and never
publishes one that was not kept.

The rule for state — crash-only, with recovery from the store. The store is the truth;
the lease book and the pool's holdings in memory are a cache of it, changed under the
lock and committed before the lock is let go. A commit the store refuses (`StoreFailed`:
disk full, I/O error, a read-only file, `database is locked` after SQLite's 5 s busy
timeout) leaves memory ahead of the store, so it is fatal:

* nothing of the failed batch is published (rows reach the bus only once committed);
  every HTTP caller waiting on it and every command still queued is answered at once
  with `StoreFailed` (HTTP 503, "state store failed; not executed"); MQTT requests get
  no answer and are not acknowledged (`Command.done` is never called): on MQTT 5 the
  server delivers them again to the next start, over 3.1.1 schedulers send them again
  with the same `request_id`;
* nothing more is committed: the loop whose commit failed raises `StoreFailed`, which
  ends the daemon's task group, and every later change is refused (`_changing`,
  `_commit`); `gpubroker run` logs the SQLite error once and exits 1, and systemd
  starts it again;
* at start the lease book and the outbox are loaded from the store: what was committed
  is all there is, and nothing uncommitted ever left the process. The new boot has a new
  `bootid` and counts `seq` from 1, so the numbers the failed batch took are never seen.

Readers outside the lock that must see only committed state (the HTTP lease views) wait
for `settled()` first.

Nothing queued here grows without bound: requests wait in a bounded queue
(back-pressure), failover triggers at most one per lease, and the anti-flap record of a
lease holds only its moves within the window and goes when the lease ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import structlog

from broker.daemon.config import PlacementConfig
from broker.leasing import failover
from broker.leasing.book import LeaseBook, LeaseError
from broker.market.changes import PoolChange
from broker.market.hazard import horizon_bucket
from broker.market.pool import ResourcePool
from broker.model import (
    CapacitySignal,
    Event,
    FailoverReason,
    Lease,
    LeaseState,
    PlaceRequest,
    PoolKey,
    iso,
    utcnow,
)
from broker.placement import optimizer
from broker.state.keyfilter import KeyFilter
from broker.state.store import Store, StoreFailed, lease_keys
from broker.wire import validation
from broker.wire.commands import OPS, VERBS, Command
from broker.wire.messages import Messages, OutboxRow, lease_subject, request_subject
from policies.evaluate import Denied, evaluate, forbids
from policies.model import Policy
from policies.residency import Residency

EXPIRY_HOLD_SECONDS = 30.0
MILP_SHARE = 0.1
"""The share of the CPU the MILP may take over time (see `Broker._milp_allowed`)."""
MILP_BURST_SECONDS = 1.0
THREAD_MIN_BATCH = 1024
"""Batches of this many requests or more are solved in a worker thread (see `_place`),
and so is every batch that may go to the MILP."""

log = structlog.get_logger("gpubroker.broker")

BURST = 8
"""Requests waiting, besides the one taken, that make a burst worth the batch window."""

FIRST_BATCH = 16
"""The size of the first batch after a start; each next one may be twice as large, up to
`placement.max_batch` (the backlog a new leader finds is answered from its head at once)."""

REPEATED = "repeated request: the lease it already has"
INTERNAL = {"field": "", "message": "internal error handling this request; it was not "
            "executed (the daemon logged the error)"}
MAX_ERRORS = 20  # per request.invalid answer: an answer must stay far below a packet's limit
RETAINED = {"field": "retain", "message": "a request published with the retain flag is "
            "never acted on; publish it without the retain flag"}


@dataclass(slots=True)
class _Batch:
    """What one turn of the request loop changes, committed in one transaction."""

    leases: dict[str, Lease] = field(default_factory=dict)
    rows: list[OutboxRow] = field(default_factory=list)
    answered: dict[tuple[str, str], Lease] = field(default_factory=dict)
    answers: list[tuple[Command, bytes]] = field(default_factory=list)
    decided: list[tuple[Command, str]] = field(default_factory=list)  # place verbs answered


Publish = Callable[[Sequence[OutboxRow]], None]
Observer = Callable[[str, dict[str, Any]], None]


class Broker:
    # Many arguments: the daemon's wiring, keyword-only; regrouped in the package redesign (#28).
    def __init__(self, *, pool: ResourcePool, book: LeaseBook, store: Store,  # noqa: PLR0913
                 messages: Messages, policy: Policy, publish: Publish,
                 retry_after_seconds: float, clock: Callable[[], datetime] = utcnow,
                 batching: PlacementConfig | None = None) -> None:
        self.pool = pool
        self.book = book
        self.store = store
        self.messages = messages
        self.policy = policy
        self._publish = publish
        self._retry_after = retry_after_seconds
        self._clock = clock
        batching = batching or PlacementConfig()
        self._window = batching.batch_window_ms / 1000
        self._max_batch = batching.max_batch
        self.settings = optimizer.Settings(exact_max_batch=batching.exact_max_batch,
                                           exact_time_limit=batching.exact_time_limit_seconds,
                                           budget_seconds=batching.solve_budget_seconds)
        self.last_batch: optimizer.BatchResult | None = None
        # The MILP's share of the CPU (see `_milp_allowed`): seconds it may still spend,
        # refilled at MILP_SHARE a second up to MILP_BURST_SECONDS.
        self._milp_budget = MILP_BURST_SECONDS
        self._milp_refilled = time.monotonic()
        self._lock = asyncio.Lock()
        self._requests: asyncio.Queue[Command] = asyncio.Queue(maxsize=10_000)
        # Failover triggers: at most one per lease, in order of first arrival.
        self._triggers: dict[str, failover.Trigger] = {}
        self._triggered = asyncio.Event()
        self._expiry_changed = asyncio.Event()
        self.observers: list[Observer] = []
        self.batch_observers: list[Callable[[optimizer.BatchResult], None]] = []
        self.decision_latency: Callable[[float], None] | None = None
        self.on_launch_failed: Callable[[PoolKey, str], None] | None = None
        self.region_tags: list[Callable[[], Mapping[str, Sequence[str]]]] = []
        """Residency tags that come from elsewhere than the policy: the private servers
        file's sites (`private:<site>` regions). Read at every batch; merged with the
        policy's own `residency.tags`."""
        self._resident_of = Residency(policy.residency.tags)
        self._resident_for: tuple[Policy, dict[str, list[str]]] = (policy, {})
        self._reopt_next = 0  # where the next re-optimisation pass starts
        # lease_id -> its failover times within the anti-flap window (active leases only)
        self._moves: dict[str, list[datetime]] = {}
        self.failed: StoreFailed | None = None
        self._costs: optimizer.CostIndex | None = None
        self._created_keys: list[tuple[str, str]] | None = None
        self.stored_keys: KeyFilter | None = None
        """Every (scheduler, request_id) the store has a lease for, once read
        (`learn_stored_keys`): a new request is then not looked up in the store."""
        """Set when the store refused a change: the broker has stopped for good."""
        pool.subscribe(self._on_pool_change)

    # --- inputs ----------------------------------------------------------------------

    async def submit(self, command: Command) -> None:
        """Queue a scheduler's message; waits when the queue is full (back-pressure).
        Once the broker has failed, an HTTP caller is refused at once (`StoreFailed` on
        its answer) and an MQTT request is dropped: nothing would ever take it."""
        if self.failed is not None:
            _refuse(command, self.failed)
            return
        await self._requests.put(command)
        if self.failed is not None:  # failed while this one waited for room
            self._refuse_queued()

    def signal(self, sig: CapacitySignal) -> None:
        """A cloud's push notice about a pool (spot interruption ...)."""
        for trigger in failover.from_signal(sig, self.book, self.policy.failover):
            self._trigger(trigger)

    def _on_pool_change(self, change: PoolChange) -> None:
        for trigger in failover.from_pool_change(change, self.book, self.policy.failover):
            self._trigger(trigger)

    def _trigger(self, trigger: failover.Trigger) -> None:
        """Queue a failover trigger. A lease has at most one waiting, which keeps its
        place in the queue: a later trigger replaces it only when it supersedes it (a
        newer epoch, or a lost capacity over a move by choice)."""
        waiting = self._triggers.get(trigger.lease_id)
        if waiting is None:
            self._triggers[trigger.lease_id] = trigger
            self._triggered.set()
        elif failover.supersedes(trigger, waiting):
            self._triggers[trigger.lease_id] = trigger

    @property
    def pending_failovers(self) -> int:
        """Failover triggers waiting (at most one per lease)."""
        return len(self._triggers)

    def restore(self, leases: Sequence[Lease]) -> None:
        """Load the lease book from the store at start-up."""
        self.book.load(leases)
        for lease in self.book.active():
            self.pool.hold(lease.placement.pool, lease.placement.instances,
                           lease.placement.targets)

    async def learn_stored_keys(self) -> None:
        """Read the keys of every stored lease into `stored_keys` (at start, while the
        first poll runs; until then every new request is looked up in the store).
        Leases created meanwhile are added too."""
        created: list[tuple[str, str]] = []
        self._created_keys = created
        try:
            keys = await self.store.call(lease_keys)
        except Exception as exc:  # not fatal: every new request is looked up instead
            log.warning("stored lease keys not read; new requests are looked up in the "
                        "store", error=type(exc).__name__, detail=str(exc)[:300])
            return
        finally:
            self._created_keys = None
        for scheduler, request_id in created:
            keys.add(scheduler, request_id)
        self.stored_keys = keys
        log.info("stored lease keys read", keys=keys.count, capacity=keys.capacity)

    # --- loops -----------------------------------------------------------------------

    async def run_requests(self, ready: asyncio.Event) -> None:
        """Take requests in batches: whatever has queued up, and — when a burst is
        waiting (`BURST` or more) — what arrives within the batch window, at most
        `max_batch`. Otherwise the batch goes at once, so a steady stream is not held
        back by the window (requests that arrive while a batch is placed make the next
        one; waiting for a few would keep the loop waiting, batch after batch)."""
        await ready.wait()
        loop = asyncio.get_running_loop()
        # The first batches after a start (a takeover: the backlog that waited for it)
        # are small and grow, so the first decision comes at once rather than after a
        # whole backlog's solve; doubling reaches `max_batch` within a few batches.
        limit = min(self._max_batch, FIRST_BATCH)
        while True:
            batch = [await self._requests.get()]
            start = loop.time()
            busy = self._requests.qsize() >= BURST
            while len(batch) < limit:
                if not self._requests.empty():
                    batch.append(self._requests.get_nowait())
                    continue
                left = start + self._window - loop.time()
                if not busy or left <= 0:
                    break
                try:
                    async with asyncio.timeout(left):
                        batch.append(await self._requests.get())
                except TimeoutError:
                    break
            try:
                await self.handle(batch)
            except StoreFailed as exc:
                self._fail(exc, batch)
                raise
            finally:
                for _ in batch:
                    self._requests.task_done()
            limit = min(self._max_batch, 2 * limit)

    async def idle(self) -> None:
        """Wait until every queued request is decided and committed."""
        await self._requests.join()
        async with self._lock:
            pass

    async def run_failovers(self) -> None:
        """Handle failover triggers, first come first served (one per lease: the one
        waiting when its turn comes)."""
        while True:
            await self._triggered.wait()
            async with self._changing():
                lease_id = next(iter(self._triggers))
                trigger = self._triggers.pop(lease_id)
                if not self._triggers:
                    self._triggered.clear()
                await self._fail_over(trigger)

    async def run_expiry(self, ready: asyncio.Event | None = None) -> None:
        """Expire leases when their time comes. With `ready` (the daemon's first poll,
        after which requests are taken): not before the requests queued meanwhile are
        handled (for at most `EXPIRY_HOLD_SECONDS`), so a renewal that waited for a new
        leader or a restart renews its lease instead of finding it expired."""
        if ready is not None:
            await ready.wait()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(EXPIRY_HOLD_SECONDS):
                    await self._requests.join()
        while True:
            nxt = self.book.next_expiry()
            timeout = None if nxt is None else max(0.0, (nxt - self._clock()).total_seconds())
            self._expiry_changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._expiry_changed.wait()
                    continue
            await self.expire_due()

    async def run_health(self, every_seconds: float) -> None:
        """Fail over leases whose cloud region went stale (its API kept failing), and
        those a better placement would save enough on (`reoptimize_min_saving`)."""
        while True:
            await asyncio.sleep(every_seconds)
            self.check_health()
            await self.check_reoptimize_async()

    def _reoptimize_chunk(self, limit: int) -> list[Lease]:
        if self.policy.failover.reoptimize_min_saving is None:
            return []
        active = sorted(self.book.active(), key=lambda le: le.lease_id)
        if not active:
            return []
        start = self._reopt_next % len(active)
        chunk = (active[start:] + active[:start])[:limit]
        self._reopt_next = start + len(chunk)
        return chunk

    def check_reoptimize(self, limit: int = 500) -> list[failover.Trigger]:
        """Look at up to `limit` active leases (the next ones in turn) for a placement
        that saves at least `reoptimize_min_saving`; queue their moves."""
        chunk = self._reoptimize_chunk(limit)
        if not chunk:
            return []
        triggers = failover.reoptimize(chunk, self.pool, self.policy, self._resident_now(),
                                       self._clock())
        for t in triggers:
            self._trigger(t)
        return triggers

    async def check_reoptimize_async(self, limit: int = 500) -> list[failover.Trigger]:
        """`check_reoptimize` in a worker thread, on a snapshot of the pool (a pass of
        hundreds of leases would hold the event loop for a long time); the moves are
        queued on the loop, and each is judged again when its turn comes."""
        chunk = self._reoptimize_chunk(limit)
        if not chunk:
            return []
        now = self._clock()
        triggers = await asyncio.to_thread(
            failover.reoptimize, chunk, optimizer.Snapshot(self.pool, now), self.policy,
            self._resident_now(), now)
        for t in triggers:
            self._trigger(t)
        return triggers

    def check_health(self) -> list[failover.Trigger]:
        now = self._clock()
        stale = self.pool.stale_slices(now)
        grace = self.pool.in_grace(now)
        triggers = []
        for key in self.book.leased_pools():
            slice_id = self.pool.slice_of(key)
            if slice_id is not None and slice_id not in stale:
                continue
            if slice_id is None and grace:
                continue  # not polled yet since the start: unknown, not unhealthy
            for le in self.book.on_pool(key):
                triggers.append(failover.Trigger(
                    le.lease_id, le.epoch, FailoverReason.CLOUD_UNHEALTHY,
                    f"{key.cloud} {key.region} has had no good poll for over "
                    f"{self.pool.stale_after.total_seconds():g}s"))
        for t in triggers:
            self._trigger(t)
        return triggers

    # --- policy --------------------------------------------------------------------

    def _resident_now(self) -> Residency:
        """The residency tags: the policy's, and those from `region_tags`."""
        extra: dict[str, list[str]] = {}
        for source in self.region_tags:
            for tag, regions in source().items():
                extra.setdefault(tag, []).extend(regions)
        policy, was = self._resident_for
        if policy is not self.policy or was != extra:
            merged = {t: list(r) for t, r in self.policy.residency.tags.items()}
            for tag, regions in extra.items():
                merged.setdefault(tag, []).extend(regions)
            self._resident_of = Residency(merged)
            self._resident_for = (self.policy, extra)
        return self._resident_of

    async def apply_policy(self, policy: Policy, digest: str, source: str) -> int:
        """Swap in a validated policy, publish `policy.applied`, and fail over the leases
        it forbids (subject to the anti-flap limits). Returns how many were triggered."""
        async with self._changing():
            self.policy = policy
            triggers = []
            for lease in self.book.active():
                p = lease.placement
                why = forbids(policy, lease.request, p.pool, p.gpu, p.price_per_gpu_hour,
                              self._resident_now())
                if why:
                    triggers.append(failover.Trigger(lease.lease_id, lease.epoch,
                                                     FailoverReason.POLICY_CHANGED, why))
            b = _Batch()
            self._emit(b, Event("policy.applied", OPS, {
                "hash": digest, "file": source, "rules": len(policy.rules),
                "teams": len(policy.teams), "leases_to_move": len(triggers)}, "policy"))
            await self._commit(b)
        for t in triggers:
            self._trigger(t)
        log.info("policy applied", hash=digest, file=source, leases_to_move=len(triggers))
        return len(triggers)

    async def reject_policy(self, source: str, problems: Sequence[Any]) -> None:
        """Publish `policy.rejected`: the running policy stays."""
        errors = [{"line": p.line, "column": p.column, "key": p.key, "message": p.message}
                  for p in problems]
        for p in problems:
            log.error("policy rejected; the running policy stays", problem=str(p))
        async with self._changing():
            b = _Batch()
            self._emit(b, Event("policy.rejected", OPS, {"file": source, "errors": errors},
                                "policy"))
            await self._commit(b)

    async def expire_due(self) -> list[Lease]:
        async with self._changing():
            now = self._clock()
            b = _Batch()
            for lease in self.book.due(now):
                ended = self.book.end(lease.lease_id, LeaseState.EXPIRED, now)
                self._ended(b, ended, "lease.expired", {"lease_id": ended.lease_id})
            await self._commit(b)
            return list(b.leases.values())

    # --- requests --------------------------------------------------------------------

    # Complex: split in the package redesign (#28).
    async def handle(self, batch: Sequence[Command]) -> None:  # noqa: C901, PLR0912
        async with self._changing():
            b = _Batch()
            parsed = {i: self._parse_place(cmd)
                      for i, cmd in enumerate(batch) if cmd.verb == "place"}
            await self._recall([p for p in parsed.values() if isinstance(p, PlaceRequest)])
            asks: dict[tuple[str, str], tuple[Command, PlaceRequest]] = {}
            repeats: list[tuple[Command, PlaceRequest]] = []
            for i, cmd in enumerate(batch):
                if cmd.retained:
                    req = parsed.get(i)
                    self._invalid(b, cmd, getattr(req, "request_id", None), [RETAINED])
                    continue
                with self._guard(b, cmd, getattr(parsed.get(i), "request_id", None)):
                    if cmd.verb == "place":
                        req = parsed[i]
                        if isinstance(req, validation.Invalid):
                            self._invalid(b, cmd, req.request_id, req.errors)
                            continue
                        key = (req.scheduler, req.request_id)
                        lease = self.book.find(*key)
                        if lease is not None:
                            self._decided(b, lease, cmd, REPEATED, ())
                        elif (unknown := validation.unknown_gpus(req, self._known_gpus)
                              ) is not None:
                            self._invalid(b, cmd, req.request_id, unknown.errors)
                        elif key in asks:  # repeated within this batch: placed once
                            repeats.append((cmd, req))
                        else:
                            asks[key] = (cmd, req)
                    elif cmd.verb in ("renew", "release"):
                        self._lease_verb(b, cmd)
                    elif cmd.verb == "report":
                        await self._report(b, cmd)
                    else:
                        self._invalid(b, cmd, None, [{
                            "field": "", "message": f"unknown verb {cmd.verb!r}; "
                            f"expected one of {', '.join(VERBS)}"}])
            rejected: dict[tuple[str, str], optimizer.Rejection] = {}
            try:
                await self._place(b, list(asks.values()), rejected)
            except Exception:
                # The last resort for the batch: what it decided stands, the rest is
                # answered (below, with the repeats of the same requests).
                log.exception("internal error placing a batch; its undecided requests "
                              "answered request.invalid", requests=len(asks))
            for key, (cmd, req) in asks.items():
                if key not in b.answered and key not in rejected:
                    self._invalid(b, cmd, req.request_id, [INTERNAL])
            for cmd, req in repeats:
                key = (req.scheduler, req.request_id)
                with self._guard(b, cmd, req.request_id):
                    if key in rejected:
                        self._rejected(b, cmd, req, rejected[key])
                    elif key in b.answered:
                        self._decided(b, b.answered[key], cmd, REPEATED, ())
                    else:
                        self._invalid(b, cmd, req.request_id, [INTERNAL])
            await self._commit(b)
            # Committed (or nothing to commit): every command of the batch is answered in
            # the outbox, so its MQTT message may be acknowledged. A commit that raised
            # never gets here: those stay unacknowledged and come again.
            for cmd in batch:
                if cmd.done is not None:
                    cmd.done()

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

    @contextlib.contextmanager
    def _guard(self, b: _Batch, cmd: Command, request_id: str | None) -> Iterator[None]:
        """The last resort around one command: if handling it raises (a bug), what it
        had queued is dropped, it is answered `request.invalid`, and the batch goes on.
        Cancellation passes; the commit is not guarded here."""
        marks = len(b.rows), len(b.answers), len(b.decided)
        try:
            yield
        except Exception:
            log.exception("internal error handling a request; answered request.invalid",
                          scheduler=cmd.scheduler, topic=cmd.topic, verb=cmd.verb,
                          size=len(cmd.payload))
            del b.rows[marks[0]:], b.answers[marks[1]:], b.decided[marks[2]:]
            try:
                self._invalid(b, cmd, request_id, [INTERNAL])
            except Exception:
                log.exception("could not answer a request after an internal error",
                              scheduler=cmd.scheduler, topic=cmd.topic)

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

    async def _place(self, b: _Batch, asks: Sequence[tuple[Command, PlaceRequest]],
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
        # and the MILP takes at most its share of the CPU.
        settings = self.settings if self._requests.empty() and self._milp_allowed() else \
            dataclasses.replace(self.settings, exact_max_batch=0)
        batch = [a for _, _, a in todo]
        milp = 1 < len(batch) <= settings.exact_max_batch and settings.exact_time_limit > 0
        if not milp and len(batch) < THREAD_MIN_BATCH:
            result = optimizer.solve(batch, self.pool, self.policy, now=now,
                                     retry_after_seconds=self._retry_after, settings=settings,
                                     costs=self._cost_index())
        else:
            # A large batch (the MILP, or thousands of requests) is solved in a worker
            # thread on a snapshot of the pool, so the event loop keeps serving MQTT,
            # polls and HTTP meanwhile; the lock keeps every other change out until the
            # outcome is committed, here, on the loop.
            view = optimizer.Snapshot(self.pool, now)
            costs = self._cost_index().frozen(
                {horizon_bucket(a.request.duration_hours) for a in batch})
            result = await asyncio.to_thread(
                optimizer.solve, batch, view, self.policy, now=now,
                retry_after_seconds=self._retry_after, settings=settings, costs=costs)
        self.last_batch = result
        if settings.exact_max_batch and settings.exact_time_limit > 0:
            self._milp_budget -= result.seconds  # what the solve took, MILP or not
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
            self._expiry_changed.set()
        for observe in self.batch_observers:
            observe(result)

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

    def _cost_index(self) -> optimizer.CostIndex:
        """The pool's offers in order of expected cost under the policy in force."""
        costs = self._costs
        if costs is None or costs.policy is not self.policy:
            if costs is not None:
                costs.close()
            costs = self._costs = optimizer.CostIndex(self.pool, self.policy)
        return costs

    def _rejected(self, b: _Batch, cmd: Command, req: PlaceRequest,
                  outcome: optimizer.Rejection) -> None:
        data: dict[str, Any] = {"request_id": req.request_id, "code": outcome.code.value,
                                "detail": outcome.detail}
        if outcome.retry_after_seconds is not None:
            data["retry_after_seconds"] = outcome.retry_after_seconds
        self._emit(b, Event("placement.rejected", req.scheduler, data,
                            request_subject(req.request_id), req.request_id), cmd)

    def _decided(self, b: _Batch, lease: Lease, cmd: Command | None, reason: str,
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
        }
        if lease.state is not LeaseState.ACTIVE:
            data["state"] = lease.state.value
        if lease.parts and parts:
            data["parts"] = [part_json(p) for p in parts]
        b.leases[lease.lease_id] = lease
        self._emit(b, Event("placement.decided", lease.scheduler, data,
                            lease_subject(lease.lease_id), lease.request_id),
                   cmd)
        for part in parts or (lease,):
            b.leases[part.lease_id] = part
            b.rows.append(self.messages.lease_state(part))

    def _lease_verb(self, b: _Batch, cmd: Command) -> None:
        parsed = validation.parse_lease_ref(cmd.payload)
        if isinstance(parsed, validation.Invalid):
            self._invalid(b, cmd, None, parsed.errors)
            return
        now = self._clock()
        try:
            if cmd.verb == "renew":
                lease = self.book.renew(parsed.lease_id, cmd.scheduler, now)
                b.leases[lease.lease_id] = lease
                self._emit(b, Event("lease.renewed", cmd.scheduler, {
                    "lease_id": lease.lease_id, "epoch": lease.epoch,
                    "expires_at": iso(lease.expires_at)}, lease_subject(lease.lease_id),
                    lease.request_id), cmd)
                b.rows.append(self.messages.lease_state(lease))
                self._expiry_changed.set()
            else:
                lease = self.book.end(parsed.lease_id, LeaseState.RELEASED, now, cmd.scheduler)
                self._ended(b, lease, "lease.released", {"lease_id": lease.lease_id},
                            cmd)
        except LeaseError as exc:
            self._lease_error(b, cmd, parsed.lease_id, exc)

    def _lease_error(self, b: _Batch, cmd: Command, lease_id: str, exc: LeaseError) -> None:
        """A verb on a lease that has ended repeats how it ended; on one the scheduler
        does not have, it is an invalid request."""
        lease = self.book.get(lease_id)
        if lease is not None and lease.scheduler == cmd.scheduler and \
                lease.state is not LeaseState.ACTIVE:
            kind = {LeaseState.RELEASED: "lease.released", LeaseState.EXPIRED: "lease.expired",
                    LeaseState.FAILED: "lease.failed"}[lease.state]
            data: dict[str, Any] = {"lease_id": lease_id}
            if lease.state is LeaseState.FAILED:
                data.update(reason="ended", detail="the lease had already failed")
            self._emit(b, Event(kind, cmd.scheduler, data, lease_subject(lease_id),
                                lease.request_id), cmd)
            return
        self._invalid(b, cmd, None, [{"field": "lease_id", "message": str(exc)}])

    async def _report(self, b: _Batch, cmd: Command) -> None:
        parsed = validation.parse_report(cmd.payload)
        if isinstance(parsed, validation.Invalid):
            self._invalid(b, cmd, None, parsed.errors)
            return
        lease = self.book.get(parsed.lease_id)
        if lease is None or lease.scheduler != cmd.scheduler or \
                lease.state is not LeaseState.ACTIVE:
            self._lease_error(b, cmd, parsed.lease_id,
                              LeaseError(f"no active lease {parsed.lease_id!r}"))
            return
        detail = f"scheduler reported {parsed.kind}"
        if parsed.detail:
            detail += f": {parsed.detail}"
        if parsed.kind == "launch_failed" and self.on_launch_failed is not None:
            self.on_launch_failed(lease.placement.pool, parsed.detail or "")
        trigger = failover.Trigger(lease.lease_id, lease.epoch, FailoverReason.REPORTED,
                                   detail, cool_down=True)
        self._fail_over_into(b, trigger, cmd)

    def _invalid(self, b: _Batch, cmd: Command, request_id: str | None,
                 errors: list[dict[str, str]]) -> None:
        if len(errors) > MAX_ERRORS:
            errors = [*errors[:MAX_ERRORS - 1], {
                "field": "", "message": f"and {len(errors) - MAX_ERRORS + 1} more errors"}]
        # Fields and messages can quote what was sent (a key, a verb): keep them short.
        errors = [{"field": e["field"][:200], "message": e["message"][:500]} for e in errors]
        data: dict[str, Any] = {"errors": errors, "topic": cmd.topic}
        if request_id is not None:
            data = {"request_id": request_id, **data}
        log.info("request invalid", scheduler=cmd.scheduler, topic=cmd.topic, errors=errors)
        self._emit(b, Event("request.invalid", cmd.scheduler, data,
                            request_subject(request_id), request_id), cmd)

    # --- failover --------------------------------------------------------------------

    async def _fail_over(self, trigger: failover.Trigger) -> None:
        b = _Batch()
        self._fail_over_into(b, trigger)
        await self._commit(b)

    def _fail_over_into(self, b: _Batch, trigger: failover.Trigger,
                        cmd: Command | None = None) -> None:
        """Move the trigger's lease, or end it when nothing else fits. `cmd`: the
        scheduler's `report` this answers (its MQTT 5 ResponseTopic gets the event too)."""
        now = self._clock()
        step = failover.step(
            trigger, book=self.book, pool=self.pool, policy=self.policy, moves=self._moves,
            now=now, find=lambda lease: failover.replacement(lease, self.pool, self.policy,
                                                             self._resident_now(), now))
        lease, old, outcome = step.lease, step.old, step.outcome
        if step.kind == "held_back":
            assert lease is not None
            log.info("failover held back", lease_id=lease.lease_id,
                     reason=trigger.reason.value, why=step.why)
        elif step.kind == "moved":
            assert lease is not None and old is not None
            b.leases[lease.lease_id] = lease
            self._emit(b, Event("lease.failover", lease.scheduler, {
                "lease_id": lease.lease_id, "epoch": lease.epoch, "from": old.to_json(),
                "to": lease.placement.to_json(), "reason": trigger.reason.value,
                "detail": trigger.detail}, lease_subject(lease.lease_id), lease.request_id),
                cmd)
            b.rows.append(self.messages.lease_state(lease))
            log.info("lease failed over", lease_id=lease.lease_id, epoch=lease.epoch,
                     reason=trigger.reason.value, to=str(lease.placement.pool),
                     latency_ms=_ms(now, trigger.received_at))
        elif step.kind == "stays" and trigger.reason is not FailoverReason.REOPTIMIZED:
            assert lease is not None
            log.info("failover found nowhere to go; lease stays", lease_id=lease.lease_id,
                     reason=trigger.reason.value, detail=getattr(outcome, "detail", ""))
        elif step.kind == "failed":
            assert lease is not None and isinstance(outcome, optimizer.Rejection)
            # The step has released the lease's instances already.
            self._ended(b, lease, "lease.failed", {
                "lease_id": lease.lease_id, "reason": trigger.reason.value,
                "detail": f"{trigger.detail}; no other placement: {outcome.detail}"}, cmd,
                released=True)
            log.warning("lease failed", lease_id=lease.lease_id, reason=trigger.reason.value,
                        detail=outcome.detail)

    # --- plumbing --------------------------------------------------------------------

    def _ended(self, b: _Batch, lease: Lease, kind: str, data: dict[str, Any],
               cmd: Command | None = None, *, released: bool = False) -> None:
        """Publish the end of `lease`; release its instances unless `released`."""
        if not released:
            self.pool.give_back(lease.placement)
        self._moves.pop(lease.lease_id, None)
        b.leases[lease.lease_id] = lease
        self._emit(b, Event(kind, lease.scheduler, data, lease_subject(lease.lease_id),
                            lease.request_id), cmd)
        b.rows.append(self.messages.lease_state(lease))

    def _emit(self, b: _Batch, event: Event, cmd: Command | None = None) -> None:
        """Queue the event's messages; the answer to `cmd` also goes to its MQTT 5
        ResponseTopic and to an HTTP caller waiting for it."""
        rows = self.messages.event(event, cmd.reply if cmd else None)
        b.rows.extend(rows)
        if cmd is not None and cmd.answer is not None:
            b.answers.append((cmd, rows[0].payload))
        if cmd is not None and cmd.verb == "place":
            b.decided.append((cmd, event.kind))
        for observe in self.observers:
            observe(event.kind, event.data)

    @contextlib.asynccontextmanager
    async def _changing(self) -> AsyncIterator[None]:
        """The lock, for a change; none once the broker has failed (its memory may be
        ahead of the store: see the module docstring)."""
        async with self._lock:
            if self.failed is not None:
                raise self.failed
            yield

    async def settled(self) -> None:
        """Return when no change is being made or committed, so that the lease book, read
        before the next await, holds only what is in the store. Raises `StoreFailed`
        once the broker has failed. Returns at once, without yielding to the event loop,
        when no change is under way."""
        if self._lock.locked():
            async with self._lock:
                pass
        if self.failed is not None:
            raise self.failed

    async def _commit(self, b: _Batch) -> None:
        if self.failed is not None:
            raise self.failed
        if not b.leases and not b.rows:
            return
        try:
            rows = await self.store.commit(b.leases.values(), b.rows)
        except StoreFailed as exc:
            self._fail(exc, [cmd for cmd, _ in b.answers])
            raise
        self._publish(rows)
        done = time.monotonic()
        for cmd, payload in b.answers:
            if cmd.answer is not None and not cmd.answer.done():
                cmd.answer.set_result(payload)
        if self.decision_latency is not None:
            for cmd, _ in b.decided:
                self.decision_latency(done - cmd.received)

    def _fail(self, exc: StoreFailed, commands: Iterable[Command]) -> None:
        """The store refused a change: stop for good, and refuse at once the commands
        in flight and every one still queued (none of them was executed)."""
        if self.failed is None:
            self.failed = exc
            log.error("state store failed; nothing of the batch was kept or published; "
                      "stopping (the next start loads the store)", error=str(exc))
        for cmd in commands:
            _refuse(cmd, self.failed)
        self._refuse_queued()

    def _refuse_queued(self) -> None:
        assert self.failed is not None
        while not self._requests.empty():
            cmd = self._requests.get_nowait()
            self._requests.task_done()
            _refuse(cmd, self.failed)


def part_json(lease: Lease) -> dict[str, Any]:
    """One part of a split request in its `placement.decided` (`parts`)."""
    d: dict[str, Any] = {"lease_id": lease.lease_id, "part": lease.part, "epoch": lease.epoch,
                         "gpus": lease.request.gpus, "placement": lease.placement.to_json(),
                         "expires_at": iso(lease.expires_at)}
    if lease.state is not LeaseState.ACTIVE:
        d["state"] = lease.state.value
    return d


def _refuse(cmd: Command, exc: StoreFailed) -> None:
    """Answer a waiting HTTP caller with the store's failure (503, not executed)."""
    if cmd.answer is not None and not cmd.answer.done():
        cmd.answer.set_exception(exc)


def _ms(now: datetime, then: datetime | None) -> float | None:
    return None if then is None else round((now - then).total_seconds() * 1000, 1)
