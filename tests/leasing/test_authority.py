"""The broker's own decisions without MQTT: a real pool, lease book and SQLite store."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from daemon_helpers import BIG_LABELS, fill_up
from factories import SLICE, Clock, Sink, offer, pool_of, request

from broker.leasing.authority import Broker
from broker.leasing.book import LeaseBook
from broker.market.pool import ResourcePool
from broker.model import CapacitySignal, FailoverReason, PoolKey, SignalKind
from broker.state.store import StateStore, StoreFailed
from broker.wire.commands import Command
from broker.wire.messages import Envelopes, Messages, Topics
from policies.model import Policy


async def _on_two_pools(tmp_path: Path, cheap: int = 1) -> tuple[Broker, Clock, Sink]:
    """A broker on two pools of one p5 each ($20 and $30 an hour; `cheap`: instances
    of the cheaper), its store open."""
    clock = Clock()
    store = StateStore(tmp_path / "state.db")
    await store.open()
    pool = pool_of([offer("us-east-1a", price=20.0, capacity=cheap),
                    offer("us-east-1b", price=30.0, capacity=1)],
                   clock=clock, stale_after_seconds=300)
    sink = Sink()
    broker = Broker(pool=pool, book=LeaseBook(), store=store,
                    messages=Messages(Topics("p"), Envelopes("t", "boot", clock=clock)),
                    policy=Policy(), publish=sink, retry_after_seconds=60, clock=clock)
    return broker, clock, sink


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[Any]:
    broker, clock, sink = await _on_two_pools(tmp_path)
    yield broker, clock, sink
    await broker.store.close()


async def test_leases_on_a_stale_cloud_region_are_flagged_unhealthy(setup: Any) -> None:
    broker, clock, _ = setup
    lease = broker.book.create(request(), _placement(broker.pool.by_gpu("H100-80GB")[0]),
                               lease_seconds=3600, cap=None, now=clock())
    assert broker.check_health() == []
    clock.advance(301)  # no good poll of the slice for longer than stale_after
    [trigger] = broker.check_health()
    assert trigger.lease_id == lease.lease_id
    assert trigger.reason is FailoverReason.CLOUD_UNHEALTHY
    assert "no good poll" in trigger.detail
    broker.pool.replace(SLICE, list(broker.pool))  # the region recovers
    assert broker.check_health() == []


async def test_a_lease_on_a_cloud_not_polled_yet_waits_out_the_start_up_grace(
        tmp_path: Path) -> None:
    """A restarted daemon restores a lease on a slice whose first poll has not arrived:
    unknown is not unhealthy until `stale_after` has passed since the start."""
    clock = Clock()
    store = StateStore(tmp_path / "state.db")
    await store.open()
    try:
        pool = ResourcePool(stale_after_seconds=300, clock=clock)
        pool.replace(("gcp", "us-central1"), [offer("us-central1-a", cloud="gcp",
                                                    region="us-central1")])
        broker = Broker(pool=pool, book=LeaseBook(), store=store,
                        messages=Messages(Topics("p"), Envelopes("t", "boot", clock=clock)),
                        policy=Policy(), publish=Sink(), retry_after_seconds=60, clock=clock)
        lease = broker.book.create(request(), _placement(offer()), lease_seconds=3600,
                                   cap=None, now=clock())
        broker.restore([lease])
        assert broker.check_health() == []
        clock.advance(301)  # still no poll of the lease's region
        [trigger] = broker.check_health()
        assert trigger.reason is FailoverReason.CLOUD_UNHEALTHY
    finally:
        await store.close()


def _placement(o: Any) -> Any:
    from broker.model import Placement

    return Placement.of(o, 1)


async def test_a_discretionary_move_with_nowhere_to_go_leaves_the_lease(setup: Any) -> None:
    from broker.leasing import failover

    broker, clock, sink = setup
    only = broker.pool.by_gpu("H100-80GB")
    lease = broker.book.create(request(), _placement(only[0]), lease_seconds=3600, cap=None,
                               now=clock())
    broker.pool.hold(lease.placement.pool, 1)
    # Move it away on a policy change while the only other pool is excluded by capacity.
    other: PoolKey = only[1].pool
    broker.pool.hold(other, 1)  # no free capacity left anywhere else
    await broker._fail_over(failover.Trigger(lease.lease_id, 1,
                                             FailoverReason.POLICY_CHANGED, "test"))
    kept = broker.book.get(lease.lease_id)
    assert kept is not None and kept.state.value == "active" and kept.epoch == 1
    assert broker.pool.held(lease.placement.pool) == 1
    assert sink.rows == []
    # The same with a loss of capacity fails the lease.
    await broker._fail_over(failover.Trigger(lease.lease_id, 1,
                                             FailoverReason.CAPACITY_LOST, "gone"))
    failed = broker.book.get(lease.lease_id)
    assert failed is not None and failed.state.value == "failed"
    assert any(r.topic == "p/events/sched-a/lease.failed" for r in sink.rows)
    # Its instance is released once: the other lease's hold on the pool it leaves (here,
    # the one the test holds on `other`, and one more on its own pool) is untouched.
    assert broker.pool.held(other) == 1
    assert broker.pool.held(lease.placement.pool) == 0


async def test_a_failed_lease_releases_its_instances_once(setup: Any) -> None:
    """Two leases on one pool; one fails over with nowhere to go: the pool still holds
    the other's instance (it was released twice, so the pool looked free)."""
    from broker.leasing import failover

    broker, clock, _ = setup
    only = broker.pool.by_gpu("H100-80GB")
    a = broker.book.create(request("a"), _placement(only[0]), lease_seconds=3600, cap=None,
                           now=clock())
    b = broker.book.create(request("b"), _placement(only[0]), lease_seconds=3600, cap=None,
                           now=clock())
    broker.restore([a, b])  # holds 2 instances of the pool
    broker.pool.hold(only[1].pool, 1)  # nowhere else to go
    assert broker.pool.held(only[0].pool) == 2
    await broker._fail_over(failover.Trigger(a.lease_id, 1, FailoverReason.CAPACITY_LOST,
                                             "gone"))
    assert broker.book.get(a.lease_id).state.value == "failed"  # type: ignore[union-attr]
    assert broker.pool.held(only[0].pool) == 1  # b's instance, still held


def _place_cmd(request_id: str, **fields: Any) -> Any:
    import json

    from broker.wire.commands import Command

    body = {"request_id": request_id, "gpu": ["H100-80GB"], "gpus": 8, **fields}
    return Command("sched-a", "place", json.dumps(body).encode(), "p/requests/sched-a/place")


def _decisions(broker: Broker) -> dict[str, str | None]:
    """request_id -> the zone its lease is in (None: no lease)."""
    out: dict[str, str | None] = {}
    for rid in ("r1", "r2"):
        lease = broker.book.find("sched-a", rid)
        out[rid] = lease.placement.pool.zone if lease else None
    return out


async def test_a_batch_gives_the_contested_pool_to_the_request_that_needs_it(
        setup: Any) -> None:
    # r1 could take either pool; r2's cap ($3/GPU-h) admits only us-east-1a ($2.50).
    # One at a time in arrival order, r1 would take us-east-1a and r2 would be refused.
    broker, _, _ = setup
    observed: list[Any] = []
    broker.batch_observers.append(observed.append)
    await broker.handle([_place_cmd("r1"), _place_cmd("r2", max_price_per_gpu_hour=3.0)])
    assert _decisions(broker) == {"r1": "us-east-1b", "r2": "us-east-1a"}
    [result] = observed
    assert len(result.outcomes) == 2 and result.optimal


async def _run_until_idle(broker: Any, timeout: float) -> None:
    """Run the broker's request loop until every queued request is decided and committed
    (the last batch's `task_done`, then `between_batches`: no await between them)."""
    import asyncio

    ready = asyncio.Event()
    ready.set()
    task = asyncio.create_task(broker.run_requests(ready))
    try:
        async with asyncio.timeout(timeout):
            await broker.idle()
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_requests_queued_together_are_placed_as_one_batch(setup: Any) -> None:

    broker, _, _ = setup
    observed: list[Any] = []
    broker.batch_observers.append(observed.append)
    await broker.submit(_place_cmd("r1"))
    await broker.submit(_place_cmd("r2", max_price_per_gpu_hour=3.0))
    await _run_until_idle(broker, 10)
    assert [len(r.outcomes) for r in observed] == [2]
    assert _decisions(broker) == {"r1": "us-east-1b", "r2": "us-east-1a"}


async def test_a_backlog_found_at_start_is_answered_in_small_batches_first(
        setup: Any) -> None:
    """A new leader finds the requests that waited for it: the first batch is small, so
    the first decisions come at once; each next batch may be twice as large."""

    from broker.leasing.authority import FIRST_BATCH

    broker, _, _ = setup
    observed: list[Any] = []
    broker.batch_observers.append(observed.append)
    for i in range(6 * FIRST_BATCH):
        await broker.submit(_place_cmd(f"b{i}", gpus=1))
    await _run_until_idle(broker, 20)
    sizes = [len(r.outcomes) for r in observed]
    assert sum(sizes) == 6 * FIRST_BATCH
    assert sizes[:3] == [FIRST_BATCH, 2 * FIRST_BATCH, 3 * FIRST_BATCH]  # the rest: 3 x 16


async def test_a_backlog_calls_between_batches_after_each_batch_with_no_change_under_way(
        setup: Any) -> None:
    """The daemon's heap sweep runs there: a broker with a backlog is never idle, so the
    sweep must be offered a moment between batches, when nothing of a batch is alive."""

    from broker.leasing.authority import FIRST_BATCH

    broker, _, _ = setup
    observed: list[Any] = []
    broker.batch_observers.append(observed.append)
    seen: list[tuple[int, bool, int]] = []  # batches done, lock held, requests queued
    broker.between_batches = lambda: seen.append(
        (len(observed), broker._lock.locked(), broker._requests.qsize()))
    for i in range(3 * FIRST_BATCH):
        await broker.submit(_place_cmd(f"b{i}", gpus=1))
    await _run_until_idle(broker, 20)
    assert [n for n, _, _ in seen] == list(range(len(observed) + 1))
    assert not any(locked for _, locked, _ in seen)
    assert seen[1][2] > 0  # after the first batch, the backlog still waited


# --- a commit the store refuses: crash-only --------------------------------------------




def _answered(request_id: str, **fields: Any) -> Any:
    import asyncio

    cmd = _place_cmd(request_id, **fields)
    return dataclasses.replace(cmd, answer=asyncio.get_running_loop().create_future())


async def test_a_refused_commit_stops_the_broker_and_keeps_nothing_of_the_batch(
        setup: Any) -> None:
    broker, _, sink = setup
    await broker.handle([_place_cmd("r1")])
    kept = broker.book.find("sched-a", "r1")
    published = list(sink.rows)
    await broker.store.call(fill_up)

    doomed = _answered("r2", labels=BIG_LABELS)
    queued = _answered("r3")
    await broker.submit(queued)  # waiting in the queue when the commit fails
    with pytest.raises(StoreFailed, match="database or disk is full"):
        await broker.handle([doomed])

    assert sink.rows == published  # nothing of the failed batch reached the bus
    assert broker.failed is not None
    for cmd in (doomed, queued):  # answered at once, not left to time out
        assert isinstance(cmd.answer.exception(), StoreFailed)
    late = _answered("r4")
    await broker.submit(late)
    assert isinstance(late.answer.exception(), StoreFailed)
    # Nothing more changes or is committed.
    with pytest.raises(StoreFailed):
        await broker.expire_due()
    with pytest.raises(StoreFailed):
        await broker.settled()
    # The store holds what was committed before the failure, and only that.
    again = StateStore(broker.store.path, read_only=True)  # the first holds the lock
    await again.open()
    try:
        assert await again.leases() == [kept]
        assert [r.payload for r in await again.pending()] == [r.payload for r in published]
    finally:
        await again.close()


async def test_run_requests_ends_with_the_store_error_and_refuses_the_batch(
        setup: Any) -> None:
    import asyncio

    broker, _, sink = setup
    await broker.store.call(fill_up)
    cmds = [_answered("r1", labels=BIG_LABELS), _answered("r2", labels=BIG_LABELS)]
    for cmd in cmds:
        await broker.submit(cmd)
    ready = asyncio.Event()
    ready.set()
    async with asyncio.timeout(10):
        with pytest.raises(StoreFailed):
            await broker.run_requests(ready)
    assert all(isinstance(cmd.answer.exception(), StoreFailed) for cmd in cmds)
    assert sink.rows == []
    async with asyncio.timeout(1):
        await broker.idle()  # every queued command was taken off the queue


# --- queues that only grow -----------------------------------------------------------------


async def test_a_lease_has_at_most_one_failover_waiting(setup: Any) -> None:
    broker, clock, _ = setup
    await broker.handle([_place_cmd("r1")])
    lease = broker.book.find("sched-a", "r1")
    clock.advance(301)  # the region goes stale: every health check asks for a move
    for _ in range(1000):
        broker.check_health()
    assert broker.pending_failovers == 1
    [waiting] = broker._triggers.values()
    assert waiting.reason is FailoverReason.CLOUD_UNHEALTHY
    # The capacity is gone: that is more urgent than a move by choice, and replaces it.
    broker.signal(CapacitySignal(lease.placement.pool, SignalKind.INTERRUPTED, clock()))
    assert broker.pending_failovers == 1
    [waiting] = broker._triggers.values()
    assert waiting.reason is FailoverReason.INTERRUPTED
    # ... and a move by choice does not replace it back.
    broker.check_health()
    assert [t.reason for t in broker._triggers.values()] == [FailoverReason.INTERRUPTED]


async def test_failovers_are_taken_in_order_of_first_arrival(setup: Any) -> None:
    import asyncio

    from broker.leasing import failover

    broker, _, _ = setup
    await broker.handle([_place_cmd("r1")])
    await broker.handle([_place_cmd("r2")])
    first, second = (broker.book.find("sched-a", r) for r in ("r1", "r2"))
    assert first is not None and second is not None
    broker._trigger(failover.Trigger(first.lease_id, 1, FailoverReason.POLICY_CHANGED, "a"))
    broker._trigger(failover.Trigger(second.lease_id, 1, FailoverReason.POLICY_CHANGED, "b"))
    broker._trigger(failover.Trigger(first.lease_id, 1, FailoverReason.REPORTED, "c"))
    assert list(broker._triggers) == [first.lease_id, second.lease_id]
    # The pools go away: neither lease can stay; the first lease is handled first.
    broker.pool.replace(SLICE, [])
    handled: list[str] = []
    done = asyncio.Event()

    def observe(kind: str, data: dict[str, Any]) -> None:
        handled.append(data["lease_id"])
        if len(handled) == 2:
            done.set()

    broker.observers.append(observe)
    task = asyncio.create_task(broker.run_failovers())
    try:
        async with asyncio.timeout(10):
            await done.wait()
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert handled == [first.lease_id, second.lease_id]
    assert broker.pending_failovers == 0


async def test_the_anti_flap_record_keeps_the_window_and_goes_with_the_lease(
        setup: Any) -> None:
    from broker.leasing import failover

    broker, clock, _ = setup
    await broker.handle([_place_cmd("r1")])
    lease = broker.book.find("sched-a", "r1")
    assert lease is not None

    async def move() -> None:
        current = broker.book.get(lease.lease_id)
        assert current is not None
        await broker._fail_over(failover.Trigger(current.lease_id, current.epoch,
                                                 FailoverReason.REPORTED, "test"))
        moved = broker.book.get(lease.lease_id)
        assert moved is not None and moved.epoch == current.epoch + 1

    await move()
    assert broker._moves[lease.lease_id] == [clock()]
    clock.advance(3601)  # past the anti-flap window
    broker.pool.replace(SLICE, list(broker.pool))  # fresh offers
    await move()
    assert broker._moves[lease.lease_id] == [clock()]  # the old move no longer counts
    release = Command("sched-a", "release", json.dumps({"lease_id": lease.lease_id}).encode(),
                      "p/requests/sched-a/release")
    await broker.handle([release])
    assert lease.lease_id not in broker._moves


# --- GPU model names: unknown is invalid, with the nearest names ----------------------


def _events(sink: Sink, kind: str) -> list[dict[str, Any]]:
    return [json.loads(r.payload)["data"] for r in sink.rows
            if r.topic == f"p/events/sched-a/{kind}"]


async def test_an_unknown_gpu_model_is_invalid_with_a_suggestion(setup: Any) -> None:
    broker, _, sink = setup
    await broker.handle([_place_cmd("r1", gpu="H100"),
                         _place_cmd("r2", gpu=["H100-80GB", "a100-80gb"]),
                         _place_cmd("r3", gpu="Quantum-9000")])
    invalid = {e["request_id"]: e["errors"] for e in _events(sink, "request.invalid")}
    assert invalid["r1"] == [{"field": "gpu", "message": "unknown GPU model 'H100'; did you "
                                                         "mean 'H100-80GB'?"}]
    assert invalid["r2"] == [{"field": "gpu", "message": "unknown GPU model 'a100-80gb'; "
                                                         "did you mean 'A100-80GB'?"}]
    [r3] = invalid["r3"]
    assert r3["message"].startswith("unknown GPU model 'Quantum-9000'; known: A10, A100-40GB")
    assert broker.book.find("sched-a", "r1") is None and _events(sink, "placement.rejected") == []


async def test_a_model_a_cloud_offers_under_its_own_name_stays_requestable(
        setup: Any) -> None:
    broker, _, sink = setup
    broker.pool.replace(("alibaba", "cn-hangzhou"), [dataclasses.replace(
        offer("cn-hangzhou-k", cloud="alibaba", region="cn-hangzhou",
              instance_type="ecs.ebmgn8v", gpu="PPU-ZW810E", price=40.0),
        gpu_known=False)])
    broker.policy = Policy(extra_gpus=["MLU370"])
    await broker.handle([_place_cmd("r1", gpu="PPU-ZW810E"),  # offered now
                         _place_cmd("r2", gpu="MLU370")])  # declared, offered nowhere
    lease = broker.book.find("sched-a", "r1")
    assert lease is not None and lease.placement.gpu == "PPU-ZW810E"
    [rejected] = _events(sink, "placement.rejected")
    assert rejected["request_id"] == "r2" and rejected["code"] == "no_capacity"
    # The cloud stops offering it: a repeat still gets the lease, a new request is invalid.
    broker.pool.replace(("alibaba", "cn-hangzhou"), [])
    await broker.handle([_place_cmd("r1", gpu="PPU-ZW810E"), _place_cmd("r3", gpu="PPU-ZW810E")])
    decided = [e for e in _events(sink, "placement.decided") if e["request_id"] == "r1"]
    assert len(decided) == 2 and decided[1]["lease_id"] == lease.lease_id
    [invalid] = _events(sink, "request.invalid")
    assert invalid["request_id"] == "r3" and invalid["errors"][0]["field"] == "gpu"


# --- large batches are solved off the event loop -----------------------------------------


async def test_a_large_batch_is_solved_in_a_thread_while_the_loop_runs(
        setup: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The solve of a batch of THREAD_MIN_BATCH requests waits for an event that only
    the event loop sets: it completes only if the solve runs off the loop (on the loop
    it would wait forever, and the test times out)."""
    import asyncio
    import threading

    from broker.leasing import placing
    from broker.placement import optimizer

    broker, _, _ = setup
    loop = asyncio.get_running_loop()
    started = asyncio.Event()
    loop_ran = threading.Event()
    real_solve = optimizer.solve
    solved_in: list[str] = []

    def solve(*args: Any, **kwargs: Any) -> Any:
        solved_in.append(threading.current_thread().name)
        loop.call_soon_threadsafe(started.set)
        if not loop_ran.wait(timeout=10):
            raise AssertionError("the event loop did not run while the batch was solved")
        return real_solve(*args, **kwargs)

    monkeypatch.setattr(optimizer, "solve", solve)
    n = placing.THREAD_MIN_BATCH
    handling = asyncio.create_task(broker.handle([_place_cmd(f"r{i}") for i in range(n)]))
    async with asyncio.timeout(10):
        await started.wait()  # the loop runs while the batch is being solved
    loop_ran.set()
    async with asyncio.timeout(10):
        await handling
    assert solved_in[0] != threading.main_thread().name
    # Two pools of one instance each: two requests placed, the rest refused, as on the loop.
    zones = sorted(le.placement.pool.zone for le in broker.book.active())
    assert zones == ["us-east-1a", "us-east-1b"]


async def test_a_snapshot_places_as_the_pool_does() -> None:
    """Placement on `Snapshot(pool)` decides exactly what it decides on the pool itself,
    and a change of the pool after the snapshot does not reach it."""
    from factories import T0

    from broker.model import PlaceRequest
    from broker.placement import optimizer

    offers = [offer(f"us-east-1{z}", price=10.0 + i, capacity=2)
              for i, z in enumerate("abcdef")]
    offers += [offer(f"us-west-2{z}", region="us-west-2", gpu="A100-80GB", price=8.0 + i,
                     market="on_demand") for i, z in enumerate("abc")]
    pool = pool_of(offers, clock=Clock(), stale_after_seconds=300)
    asks = [optimizer.Ask(PlaceRequest.from_json("s", {
        "request_id": f"r{i}", "gpu": ["H100-80GB", "A100-80GB"], "gpus": 8 * (1 + i % 2)}))
        for i in range(12)]
    policy = Policy()
    direct = optimizer.place(asks, pool, policy, now=T0)
    # On the loop, as a batch the heuristic decides first: the live index.
    live = optimizer.solve(asks, pool, policy, now=T0, costs=optimizer.CostIndex(pool, policy))
    snap = optimizer.Snapshot(pool, T0)
    costs = optimizer.CostIndex(pool, policy).frozen()
    pool.replace(SLICE, [])  # every offer gone from the pool, not from the snapshot
    on_snapshot = optimizer.place(asks, snap, policy, now=T0)
    frozen = optimizer.solve(asks, snap, policy, now=T0, costs=costs)
    for outcomes in (on_snapshot, frozen.outcomes, live.outcomes):
        assert [getattr(o, "placement", None) for o in outcomes] == \
            [getattr(o, "placement", None) for o in direct]
    assert (live.optimal, live.objective) == (frozen.optimal, frozen.objective)
    assert any(isinstance(o, optimizer.Decision) for o in direct)


# --- the stored keys: new requests are not looked up in the store ----------------------


async def test_new_requests_skip_the_store_and_old_ones_still_get_their_lease(
        setup: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the stored keys are read, a request the store has no lease for is decided
    without a lookup; one whose lease the lease book forgot (ended long ago) is still
    looked up and answered with that lease."""
    from broker.leasing.book import LeaseBook

    broker, _, _ = setup
    await broker.handle([_place_cmd("old")])
    old = broker.book.find("sched-a", "old")
    assert old is not None
    await broker.handle([_release_cmd(old.lease_id)])
    broker.book = LeaseBook()  # a restart long after: the book forgot the ended lease
    broker.restore([])
    await broker.learn_stored_keys()
    assert broker.stored_keys is not None and broker.stored_keys.count == 1
    lookups: list[tuple[str, str]] = []
    real = broker.store.find_leases

    async def counting(keys: Any) -> Any:
        lookups.extend(keys)
        return await real(keys)

    monkeypatch.setattr(broker.store, "find_leases", counting)
    await broker.handle([_place_cmd("new-1")])
    await broker.handle([_place_cmd("new-2")])
    assert ("sched-a", "new-1") not in lookups and ("sched-a", "new-2") not in lookups
    await broker.handle([_place_cmd("old")])
    assert ("sched-a", "old") in lookups
    again = broker.book.find("sched-a", "old")
    assert again is not None and again.lease_id == old.lease_id  # the old lease, not a new one
    # Leases created after the keys were read are in the filter too.
    assert broker.stored_keys.may_hold("sched-a", "new-1")


def _release_cmd(lease_id: str) -> Any:
    import json

    from broker.wire.commands import Command

    return Command("sched-a", "release", json.dumps({"lease_id": lease_id}).encode(),
                   "p/requests/sched-a/release")


async def test_a_renewal_queued_before_the_first_poll_renews_an_overdue_lease(
        setup: Any) -> None:
    """After a restart or a takeover, a lease may be past its expiry while its renewal
    waits in the queue for the first poll: expiry waits for the queue, and the lease
    is renewed, not expired."""
    import asyncio
    import json

    from broker.leasing.book import LeaseBook
    from broker.model import LeaseState
    from broker.wire.commands import Command

    broker, clock, _ = setup
    await broker.handle([_place_cmd("r1")])
    lease = broker.book.find("sched-a", "r1")
    assert lease is not None
    broker.book = LeaseBook()
    broker.restore([lease])  # as loaded at start
    clock.advance(lease.lease_seconds + 5)  # overdue while no leader was there
    await broker.submit(Command("sched-a", "renew",
                                json.dumps({"lease_id": lease.lease_id}).encode(),
                                "p/requests/sched-a/renew"))
    ready = asyncio.Event()
    ready.set()  # the first poll is in
    expiry = asyncio.create_task(broker.run_expiry(ready))
    # Expiry goes first and must wait for the queued renewal (a negative check: without
    # the wait it expires the lease within milliseconds; with it, this cannot fail).
    await asyncio.wait({expiry}, timeout=0.3)
    assert broker.book.get(lease.lease_id).state is LeaseState.ACTIVE  # type: ignore[union-attr]
    requests = asyncio.create_task(broker.run_requests(ready))
    try:
        async with asyncio.timeout(10):
            await broker.idle()
            while broker.book.get(lease.lease_id).expires_at <= clock():  # type: ignore[union-attr]
                await broker.idle()
    finally:
        for task in (expiry, requests):
            task.cancel()
        await asyncio.gather(expiry, requests, return_exceptions=True)
    now = broker.book.get(lease.lease_id)
    assert now is not None and now.state is LeaseState.ACTIVE
    assert now.expires_at > clock()


async def test_expiry_wakes_for_a_lease_that_expires_sooner_and_only_then(
        tmp_path: Path) -> None:
    """The expiry task waits for the lease book's first expiry. A lease placed to expire
    later does not wake it; one placed to expire sooner does, and expires on time."""
    import asyncio

    from broker.model import LeaseState

    broker, clock, _ = await _on_two_pools(tmp_path, cheap=2)
    try:
        await broker.handle([_place_cmd("first", lease_seconds=3600)])
        first = broker.book.find("sched-a", "first")
        assert first is not None
        ready = asyncio.Event()
        ready.set()
        expiry = asyncio.create_task(broker.run_expiry(ready))
        try:
            async with asyncio.timeout(5):
                while broker._expiry_at != first.expires_at:
                    await asyncio.sleep(0)  # a turn of the loop, until it waits
            wakes: list[bool] = []
            real_set = broker._expiry_changed.set

            def counted() -> None:
                wakes.append(True)
                real_set()

            broker._expiry_changed.set = counted  # type: ignore[method-assign]
            await broker.handle([_place_cmd("later", lease_seconds=7200)])
            assert broker.book.find("sched-a", "later") is not None
            assert wakes == []
            await broker.handle([_place_cmd("sooner", lease_seconds=60)])
            assert wakes == [True]
            async with asyncio.timeout(5):
                while broker._expiry_at != broker.book.find("sched-a", "sooner").expires_at:  # type: ignore[union-attr]
                    await asyncio.sleep(0)
            clock.advance(61)
            real_set()  # the clock is the test's: wake the loop
            sooner = broker.book.find("sched-a", "sooner")
            assert sooner is not None
            async with asyncio.timeout(5):
                while (now := broker.book.get(sooner.lease_id)) is None or \
                        now.state is not LeaseState.EXPIRED:
                    await asyncio.sleep(0)
            assert broker.book.get(first.lease_id).state is LeaseState.ACTIVE  # type: ignore[union-attr]
        finally:
            expiry.cancel()
            await asyncio.gather(expiry, return_exceptions=True)
    finally:
        await broker.store.close()


async def test_the_milp_gets_its_share_of_the_cpu_and_no_more(setup: Any) -> None:
    """A token bucket of solve time: spent, it refuses the MILP until it has refilled
    at MILP_SHARE of a second per second (the heuristic answers meanwhile)."""
    from broker.leasing import placing

    broker, _, _ = setup
    assert broker._milp_allowed()
    broker._milp_budget = -placing.MILP_SHARE * 3600  # an hour's worth spent
    assert not broker._milp_allowed()
    broker._milp_refilled -= 3601  # an hour and a second later
    assert broker._milp_allowed()
    assert broker._milp_budget <= placing.MILP_BURST_SECONDS


async def test_the_milp_is_charged_all_the_cpu_its_batch_took(
        setup: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Listing the options the MILP prices out costs more than the MILP itself: the
    bucket is charged the CPU of the whole solve, not the solver's own seconds."""
    import time

    from broker.placement import optimizer

    broker, _, _ = setup
    real_solve = optimizer.solve
    spent = 0.3  # beyond what the MILP may take of a batch this small

    def solve(*args: Any, **kwargs: Any) -> Any:
        started = time.thread_time()
        while time.thread_time() - started < spent:  # CPU the solver does not count
            pass
        return real_solve(*args, **kwargs)

    monkeypatch.setattr(optimizer, "solve", solve)
    before = broker._milp_budget
    await broker.handle([_place_cmd("r1"), _place_cmd("r2")])  # a MILP batch, in a thread
    assert broker.last_batch is not None and broker.last_batch.seconds < spent
    assert before - broker._milp_budget >= spent - 0.01  # the refill meanwhile


def _threads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the batches sent to a worker thread (`placing.on_loan`), as they go."""
    from broker.leasing import placing

    sent: list[int] = []
    real = placing.on_loan

    async def on_loan(loans: Any, fn: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(len(batch))
        return await real(loans, fn, batch, *args, **kwargs)

    monkeypatch.setattr(placing, "on_loan", on_loan)
    return sent


async def test_a_batch_the_heuristic_proves_optimal_is_decided_without_a_worker_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch small enough for the MILP is decided by the heuristic first, on the
    event loop: one it proves optimal (both requests on their cheapest pool, which has
    room for both) never goes to a worker thread."""
    broker, _, _ = await _on_two_pools(tmp_path, cheap=2)
    sent = _threads(monkeypatch)
    try:
        await broker.handle([_place_cmd("r1"), _place_cmd("r2")])
        assert _decisions(broker) == {"r1": "us-east-1a", "r2": "us-east-1a"}
        assert broker.last_batch is not None and broker.last_batch.optimal
        assert sent == []
    finally:
        await broker.store.close()


async def test_a_batch_the_heuristic_cannot_prove_optimal_goes_to_the_milp_in_a_thread(
        setup: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests for the one cheap pool's single instance: the heuristic's answer is
    not proven optimal (its bound counts both there), so the batch goes to the MILP, in
    a worker thread, as before; the MILP proves it optimal."""
    broker, _, _ = setup
    sent = _threads(monkeypatch)
    await broker.handle([_place_cmd("r1"), _place_cmd("r2")])
    assert sent == [2]
    assert broker.last_batch is not None and broker.last_batch.optimal
    assert broker.last_batch.objective == broker.last_batch.bound == 50.0
    assert sorted(z for z in _decisions(broker).values() if z) == ["us-east-1a", "us-east-1b"]


# --- a command is done once its outcome is committed (#26) -----------------------------


async def test_each_command_is_done_once_its_answer_is_committed(setup: Any) -> None:
    """`Command.done` (the bus acknowledges the MQTT message then) comes after the
    batch's commit, for every kind of outcome: a lease, a repeat, an invalid request, a
    verb on an unknown lease. The commit has handed the answers to the bus by then, and
    the lease is in the store."""
    broker, _, sink = setup
    done: list[tuple[str, int]] = []

    def cmd(name: str, c: Command) -> Command:
        return dataclasses.replace(c, done=lambda: done.append((name, len(sink.rows))))

    place = cmd("place", _place_cmd("r1"))
    batch = [place, cmd("again", _place_cmd("r1")),
             cmd("invalid", Command("sched-a", "place", b"{", "p/requests/sched-a/place")),
             cmd("renew", Command("sched-a", "renew", b'{"lease_id": "L-nope"}',
                                  "p/requests/sched-a/renew"))]
    await broker.handle(batch)
    answered = len(sink.rows)
    assert answered > 0
    assert done == [("place", answered), ("again", answered), ("invalid", answered),
                    ("renew", answered)]
    assert await broker.store.find_lease("sched-a", "r1") is not None


async def test_a_command_whose_commit_is_refused_is_never_done(setup: Any) -> None:
    """The store refuses the batch's commit: its commands are not done, so the bus never
    acknowledges them and the MQTT server delivers them to the next start."""
    broker, _, _ = setup
    await broker.store.call(fill_up)
    done: list[str] = []
    c = dataclasses.replace(_place_cmd("doomed", labels=BIG_LABELS),
                            done=lambda: done.append("doomed"))
    with pytest.raises(StoreFailed):
        await broker.handle([c])
    assert done == []
