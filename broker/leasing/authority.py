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
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

import structlog

from broker.daemon.config import PlacementConfig
from broker.leasing import failover
from broker.leasing.batch import INTERNAL, REPEATED, RETAINED, Batch
from broker.leasing.book import LeaseBook
from broker.leasing.moves import Moves
from broker.leasing.placing import MILP_BURST_SECONDS, Placing
from broker.leasing.quote import Quoting
from broker.leasing.verbs import Observer, Verbs
from broker.market.changes import PoolChange
from broker.market.pool import ResourcePool
from broker.model import (
    CapacitySignal,
    Event,
    FailoverReason,
    Lease,
    LeaseState,
    PlaceRequest,
    PoolKey,
    utcnow,
)
from broker.placement import optimizer
from broker.state.keyfilter import KeyFilter
from broker.state.store import Store, StoreFailed, lease_keys
from broker.wire import validation
from broker.wire.commands import OPS, VERBS, Command
from broker.wire.messages import Messages, OutboxRow
from policies.evaluate import forbids
from policies.model import Policy
from policies.residency import Residency

log = structlog.get_logger("gpubroker.broker")

BURST = 8
"""Requests waiting, besides the one taken, that make a burst worth the batch window."""

FIRST_BATCH = 16
"""The size of the first batch after a start; each next one may be twice as large, up to
`placement.max_batch` (the backlog a new leader finds is answered from its head at once)."""


Publish = Callable[[Sequence[OutboxRow]], None]


class Broker(Placing, Verbs, Moves, Quoting):
    # Many arguments: the daemon's wiring, keyword-only (each a part or a setting of its own).
    def __init__(self, *, pool: ResourcePool, book: LeaseBook, store: Store,  # noqa: PLR0913
                 messages: Messages, policy: Policy, publish: Publish,
                 retry_after_seconds: float, clock: Callable[[], datetime] = utcnow,
                 batching: PlacementConfig | None = None,
                 reconnect_grace_seconds: float = 60.0) -> None:
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
        self.settings = optimizer.BatchSettings(exact_max_batch=batching.exact_max_batch,
                                           exact_time_limit=batching.exact_time_limit_seconds,
                                           budget_seconds=batching.solve_budget_seconds)
        self.last_batch: optimizer.BatchResult | None = None
        # The MILP's share of the CPU (see `_milp_allowed`): seconds it may still spend,
        # refilled at MILP_SHARE a second up to MILP_BURST_SECONDS.
        self._milp_budget = MILP_BURST_SECONDS
        self._milp_refilled = time.monotonic()
        self._lock = asyncio.Lock()
        self._requests: asyncio.Queue[Command] = asyncio.Queue(maxsize=10_000)
        self._waiting = threading.Event()
        """Set when a request or a failover is queued: the MILP, which solves a batch in
        a worker thread while they wait for the lock, stops at once and keeps the best
        answer so far (`Placing._place`)."""
        # Failover triggers: at most one per lease, in order of first arrival.
        self._triggers: dict[str, failover.Trigger] = {}
        self._triggered = asyncio.Event()
        self._expiry_changed = asyncio.Event()
        self._expiry_at: datetime | None = None  # what `run_expiry` waits for (None: nothing)
        self._grace = timedelta(seconds=reconnect_grace_seconds)
        self.hearing = asyncio.Event()
        """Set while the daemon can hear its schedulers (its MQTT session is up): no lease
        expires while it is clear (`deaf`, `heard`). Set unless told otherwise."""
        self.hearing.set()
        self.observers: list[Observer] = []
        self.batch_observers: list[Callable[[optimizer.BatchResult], None]] = []
        self.between_batches: Callable[[], None] | None = None
        """Called between two batches of requests when no change is under way (nothing
        of a batch is alive then): the daemon's heap sweep, so that a broker with a
        backlog is swept too."""
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
        # scheduler -> the pools its reports cooled for everyone within the hour, and when
        # (`failover.report_cooldowns_per_hour`; at most that many per scheduler)
        self._cooled_by: dict[str, dict[PoolKey, datetime]] = {}
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
        self._waiting.set()
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
            self._waiting.set()
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
            if self.between_batches is not None and not self._lock.locked():
                self.between_batches()
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
            del batch
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
        """Expire leases when their time comes, only while the daemon can hear
        (`hearing`). With `ready` (the daemon's first poll, after which requests are
        taken): not before the requests queued meanwhile are handled, for at most the
        reconnect grace (`heard` gave every lease that long from the connect), so a
        renewal that waited for a new leader or a restart renews its lease instead of
        finding it expired."""
        if ready is not None:
            await ready.wait()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._grace.total_seconds()):
                    await self._requests.join()
        while True:
            await self.hearing.wait()
            nxt = self._expiry_at = self.book.next_expiry()
            timeout = None if nxt is None else max(0.0, (nxt - self._clock()).total_seconds())
            self._expiry_changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._expiry_changed.wait()
                    continue
            await self.expire_due()

    def _expires(self, at: datetime) -> None:
        """A lease now expires at `at`: `run_expiry` is woken only when that comes before
        what it waits for. A later one is read when it wakes next; one it waits for that
        moved later (a renewal) wakes it early, to find nothing due and wait again. At
        500 requests a second, waking it for every new lease cost the event loop a task
        step, a timer made and cancelled, per batch."""
        if self._expiry_at is None or at < self._expiry_at:
            self._expiry_changed.set()

    async def run_health(self, every_seconds: float) -> None:
        """Fail over leases whose cloud region went stale (its API kept failing), and
        those a better placement would save enough on (`reoptimize_min_saving`)."""
        while True:
            await asyncio.sleep(every_seconds)
            self.check_health()
            await self.check_reoptimize_async()

    # --- policy --------------------------------------------------------------------

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
            b = Batch()
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
            b = Batch()
            self._emit(b, Event("policy.rejected", OPS, {"file": source, "errors": errors},
                                "policy"))
            await self._commit(b)

    def deaf(self) -> None:
        """The daemon cannot hear its schedulers (its MQTT session is down, or not up yet
        since the start): no lease expires until `heard`."""
        self.hearing.clear()

    async def heard(self) -> int:
        """The daemon can hear its schedulers again (its MQTT session is up: after a lost
        connection, at start, after a takeover). Every active lease that expires before
        now + the reconnect grace gets that expiry, committed with its retained state:
        renewals sent into the lost connection (or while no leader was there) were not
        heard, and their schedulers get the grace to renew. Like Nomad's heartbeat grace
        after an election. Returns how many leases were extended."""
        async with self._changing():
            now = self._clock()
            until = now + self._grace
            b = Batch()
            if self._grace:
                for lease in self.book.active():
                    if lease.expires_at < until:
                        extended = self.book.extend(lease.lease_id, until, now)
                        b.leases[extended.lease_id] = extended
                        b.rows.append(self.messages.lease_state(extended))
            await self._commit(b)
            self.hearing.set()
            self._expiry_changed.set()
        if b.leases:
            log.info("leases extended: the daemon could not hear their renewals",
                     leases=len(b.leases), until=until.isoformat(),
                     grace_seconds=self._grace.total_seconds())
        return len(b.leases)

    async def expire_due(self) -> list[Lease]:
        async with self._changing():
            if not self.hearing.is_set():
                return []
            now = self._clock()
            b = Batch()
            for lease in self.book.due(now):
                ended = self.book.end(lease.lease_id, LeaseState.EXPIRED, now)
                self._ended(b, ended, "lease.expired", {"lease_id": ended.lease_id})
            await self._commit(b)
            return list(b.leases.values())

    # --- requests --------------------------------------------------------------------

    async def handle(self, batch: Sequence[Command]) -> None:
        async with self._changing():
            b = Batch()
            parsed = {i: self._parse_place(cmd)
                      for i, cmd in enumerate(batch) if cmd.verb == "place"}
            await self._recall([p for p in parsed.values() if isinstance(p, PlaceRequest)])
            asks: dict[tuple[str, str], tuple[Command, PlaceRequest]] = {}
            repeats: list[tuple[Command, PlaceRequest]] = []
            quotes: list[Command] = []
            for i, cmd in enumerate(batch):
                if cmd.retained:
                    req = parsed.get(i)
                    self._invalid(b, cmd, getattr(req, "request_id", None), [RETAINED])
                    continue
                with self._guard(b, cmd, getattr(parsed.get(i), "request_id", None)):
                    if cmd.verb == "place":
                        self._sort_place(b, cmd, parsed[i], asks, repeats)
                    elif cmd.verb in ("renew", "release"):
                        await self._lease_verb(b, cmd)
                    elif cmd.verb == "report":
                        await self._report(b, cmd)
                    elif cmd.verb == "lookup":
                        await self._lookup(b, cmd)
                    elif cmd.verb == "quote":
                        quotes.append(cmd)  # after the batch's placements: see below
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
            self._answer_the_rest(b, asks, repeats, rejected)
            # Quotes see the pool as the batch's placements left it: what a place sent
            # now would find.
            for cmd in quotes:
                with self._guard(b, cmd, None):
                    self._quote(b, cmd)
            await self._commit(b)
            # Committed (or nothing to commit): every command of the batch is answered in
            # the outbox, so its MQTT message may be acknowledged. A commit that raised
            # never gets here: those stay unacknowledged and come again.
            for cmd in batch:
                if cmd.done is not None:
                    cmd.done()

    def _sort_place(self, b: Batch, cmd: Command, req: PlaceRequest | validation.Invalid,
                    asks: dict[tuple[str, str], tuple[Command, PlaceRequest]],
                    repeats: list[tuple[Command, PlaceRequest]]) -> None:
        """A `place` request of the batch: answered at once (invalid, a repeat of a lease
        the book has, an unknown GPU), or added to the batch's asks (a second one for
        the same request to `repeats`: placed once, answered after)."""
        if isinstance(req, validation.Invalid):
            self._invalid(b, cmd, req.request_id, req.errors)
            return
        key = (req.scheduler, req.request_id)
        lease = self.book.find(*key)
        if lease is not None:
            self._decided(b, lease, cmd, REPEATED, ())
        elif (unknown := validation.unknown_gpus(req, self._known_gpus)) is not None:
            self._invalid(b, cmd, req.request_id, unknown.errors)
        elif key in asks:  # repeated within this batch: placed once
            repeats.append((cmd, req))
        else:
            asks[key] = (cmd, req)

    def _answer_the_rest(self, b: Batch,
                         asks: dict[tuple[str, str], tuple[Command, PlaceRequest]],
                         repeats: list[tuple[Command, PlaceRequest]],
                         rejected: dict[tuple[str, str], optimizer.Rejection]) -> None:
        """After placing: the asks placement did not answer (an internal error), and the
        repeats within the batch, as their first was answered."""
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

    @contextlib.contextmanager
    def _guard(self, b: Batch, cmd: Command, request_id: str | None) -> Iterator[None]:
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

    # --- plumbing --------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _changing(self) -> AsyncIterator[None]:
        """The lock, for a change; none once the broker has failed (its memory may be
        ahead of the store: see the module docstring)."""
        async with self._lock:
            if self.failed is not None:
                raise self.failed
            yield
            # The change is committed: ended leases beyond the recent ones leave memory.
            self.book.settle()

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

    async def _commit(self, b: Batch) -> None:
        if self.failed is not None:
            raise self.failed
        if not b.leases and not b.rows:
            return
        # Each scheduler's events take their `schedseq` here, committed with them.
        numbered, schedseqs, renumbered = self.messages.sequence(b.rows)
        try:
            rows = await self.store.commit(b.leases.values(), numbered, schedseqs)
        except StoreFailed as exc:
            self._fail(exc, [cmd for cmd, _ in b.answers])
            raise
        self.messages.commit_sequence(schedseqs)
        self._publish(rows)
        done = time.monotonic()
        for cmd, payload in b.answers:
            if cmd.answer is not None and not cmd.answer.done():
                cmd.answer.set_result(renumbered.get(id(payload), payload))
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


def _refuse(cmd: Command, exc: StoreFailed) -> None:
    """Answer a waiting HTTP caller with the store's failure (503, not executed)."""
    if cmd.answer is not None and not cmd.answer.done():
        cmd.answer.set_exception(exc)
