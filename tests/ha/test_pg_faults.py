"""High availability end to end, faults of PostgreSQL itself: `gpubroker run` processes
of one site on a real mosquitto and a real PostgreSQL server — for restarts, failovers
and stalled commits a server of the test's own (``pg_server.PgServer``: initdb/pg_ctl on
a free port) — and a scheduler placing requests all along, re-sending the unanswered
ones with the same request_id.

What the tests assert on what the scheduler and one probe saw (``test_faults.settle``
and ``check_site``, unless a test says otherwise):

* no request unanswered (after re-sends, within the client's timeout);
* no lease decided twice: one request_id, one lease_id (events, answers, the `leases`
  table);
* nothing from a deposed leader after the new leader's first message;
* epochs rising from one leader to the next;
* no stretch without a leader longer than ``LEADERLESS_BOUND`` beyond the fault's own
  time (the database down, a failover being made): ``LeaderWatch`` asks every node's
  /readyz every 100 ms.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import re
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import datetime
from pathlib import Path

import pytest
from factories import offer, placement, request
from ha.helpers import (
    LEADERSHIP_SECONDS,
    SCHEDULER,
    SITE,
    HaDaemon,
    HaSite,
    LeaderWatch,
    Observed,
    Scheduler,
    wait_leader,
    wait_until,
)
from ha.pg_server import PgServer, server_root
from ha.test_faults import TAKEOVER_TIMEOUT, Flow, check_site, leader_boot, settle
from mqtt_helpers import Mosquitto, MqttProbe

from broker.leasing.book import LeaseBook
from broker.model import utcnow
from broker.state.pgdb import PgDb, connect, migrate
from broker.state.schema import lease_row

pytestmark = pytest.mark.timeout(90)

LEADERLESS_BOUND = LEADERSHIP_SECONDS + 3.0
"""The longest the site may be without a leader beyond the fault's own time: the term
runs out (`leadership_seconds`), a standby claims it (every 0.33 s), connects to MQTT and
is ready (its polls taken over from the database), with room for a starved machine."""

DB = "gpubroker"


@pytest.fixture
def own_pg() -> Iterator[PgServer]:
    """A PostgreSQL server of the test's own, with an empty database `gpubroker`."""
    with server_root() as root:
        server = PgServer.primary(root)
        try:
            server.sql(f"CREATE DATABASE {DB}")
            yield server
        finally:
            server.kill_quietly()


@pytest.fixture
async def own_site(tmp_path: Path, mosquitto: Mosquitto, own_pg: PgServer
                   ) -> AsyncIterator[HaSite]:
    """The site's nodes on the test's own server; every process killed at teardown."""
    s = HaSite(tmp_path, mosquitto, own_pg.url(DB))
    try:
        yield s
    finally:
        await s.close()


def assert_leader_back(watch: LeaderWatch, fault_seconds: float, since: float) -> float:
    """The longest stretch without a leader from `since` on; at most the fault's own
    time plus LEADERLESS_BOUND."""
    gap, start = watch.longest_without_leader(since)
    assert gap <= fault_seconds + LEADERLESS_BOUND, (
        f"no leader for {gap:.2f} s (from {start - since:.2f} s after the fault began); "
        f"bound {fault_seconds:.2f} + {LEADERLESS_BOUND:g} s")
    return gap


def stepped_down(d: HaDaemon) -> list[dict[str, object]]:
    return d.logged("deposed") + d.logged("stepped down")


# --------------------------------------------------------------------------------------
# 1. PostgreSQL restarted
# --------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_postgres_down_longer_than_the_term(own_site: HaSite, own_pg: PgServer,
                                                  probe: MqttProbe, scheduler: Scheduler
                                                  ) -> None:
    """The site's PostgreSQL server is stopped (`pg_ctl stop -m fast`) while requests
    flow and started again after the leader's term has run out. The leader steps down
    at once (a commit fails), both nodes wait for the database; once it is back a leader
    is back within the bound, at a higher epoch, every request is answered (those sent
    meanwhile included) and none decided twice."""
    a = await own_site.start_leader("a")
    b = await own_site.start_standby("b")
    watch = LeaderWatch(own_site)
    watch.start()
    flow = Flow(scheduler)
    flow.start()
    await flow.more(15)

    t_down = time.monotonic()
    await asyncio.to_thread(own_pg.stop, "fast")
    await a.wait_role("standby", TAKEOVER_TIMEOUT, text="database not reachable")
    # The outage lasts past the leader's term in the database, whatever a did.
    await asyncio.sleep(max(0.0, t_down + LEADERSHIP_SECONDS + 0.5 - time.monotonic()))
    await asyncio.to_thread(own_pg.start)
    down_for = time.monotonic() - t_down
    leader = await wait_leader([a, b], TAKEOVER_TIMEOUT)
    await flow.more(15, timeout=30)
    await flow.stop()
    gap = assert_leader_back(watch, down_for, t_down)
    await watch.stop()
    seen = await settle(own_site, probe, scheduler)

    chain = await check_site(own_site, seen, scheduler, [("a", 1), (leader.node, 2)])
    print(f"\ndatabase down {down_for:.2f} s, no leader for {gap:.2f} s; leaders "
          f"{[str(c) for c in chain]}")
    assert await own_site.stop_all() == {"a": 0, "b": 0}


class LeaderLost(AssertionError):
    """The leader stepped down, or another took over, over a fault it should ride out."""


@pytest.mark.slow
async def test_postgres_restart_shorter_than_the_term(own_site: HaSite, own_pg: PgServer,
                                                      probe: MqttProbe,
                                                      scheduler: Scheduler) -> None:
    """`pg_ctl restart -m fast` while requests flow, shorter than `leadership_seconds`:
    the site recovers (a leader within the bound, every request answered, none decided
    twice) and — the leader's term outliving the restart — the leader stays the leader
    (`LeaderLost` otherwise: the known failure this test is marked for)."""
    a = await own_site.start_leader("a")
    b = await own_site.start_standby("b")
    watch = LeaderWatch(own_site)
    watch.start()
    flow = Flow(scheduler)
    flow.start()
    await flow.more(15)

    t_restart = time.monotonic()
    took = await asyncio.to_thread(own_pg.restart, "fast")
    assert took < LEADERSHIP_SECONDS, f"pg_ctl restart took {took:.2f} s"
    await wait_leader([a, b], TAKEOVER_TIMEOUT)
    await flow.more(15, timeout=30)
    await flow.stop()
    gap = assert_leader_back(watch, took, t_restart)
    await watch.stop()
    seen = await settle(own_site, probe, scheduler)

    chain = await check_site(own_site, seen, scheduler, [("a", 1)])
    why = [r.get("why") or r.get("detail") for d in (a, b) for r in stepped_down(d)]
    print(f"\nrestart {took:.2f} s, no leader for {gap:.2f} s; leaders "
          f"{[str(c) for c in chain]}; stepped down: {why}")
    if len(chain) > 1 or why:
        raise LeaderLost(f"restart {took:.2f} s: leaders {[str(c) for c in chain]}, no "
                         f"leader for {gap:.2f} s; stepped down: {why}")
    assert await own_site.stop_all() == {"a": 0, "b": 0}


# --------------------------------------------------------------------------------------
# 2. failover to a streaming replica that lacks the last transactions
# --------------------------------------------------------------------------------------


def replay_caught_up(primary: PgServer, replica: PgServer) -> bool:
    (lsn,), = primary.sql("SELECT pg_current_wal_lsn()::text")
    (done,), = replica.sql(f"SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn")
    return bool(done)


@pytest.mark.slow
async def test_failover_to_a_replica_that_lost_the_last_transactions(
        own_site: HaSite, own_pg: PgServer, probe: MqttProbe, scheduler: Scheduler) -> None:
    """Asynchronous streaming replication, then a failover that loses the last WAL.

    Each node reaches PostgreSQL through a TCP proxy of its own (its address of the
    database). Node `a` leads at epoch 1; the replica has everything so far. Then the
    replica stops receiving WAL (its `primary_conninfo` emptied), `a` is killed, and `b`
    takes over at epoch 2 and decides leases — all of it on the primary only. `a` comes
    back as a standby. The replica is promoted while the old primary, cut off from it,
    still runs (as a partition would have it) and `a`'s address is switched to it: there
    `a`'s epoch 1 is the last one, its term long expired, and `a` claims epoch 2 again.
    Then `b`'s address is switched too and the old primary dies (`-m immediate`). `b`,
    still within its epoch-2 term, must be deposed by its first commit or renewal there:
    the fence and the renewal compare the boot id, not only the epoch (without it `b`
    would commit into the new history as if epoch 2 were its own).

    What the scheduler may see (and the test allows): the leases `b` decided at epoch 2
    on the primary are gone with the lost WAL — the scheduler holds them, the database
    does not; the events and outbox rows committed with them are gone too. A request
    `b` decided but whose answer did not reach the scheduler before the failover is
    re-sent and decided again by the new leader, with another lease_id (the probe then
    saw two decisions for it, one of each history). What must hold: in P/status one
    start (boot id) never publishes two epochs and the epochs of the leaders never go
    down; no request_id has two lease_ids among the leases the database still holds
    (each the one the scheduler was given, when it was given one); nothing `b` decided
    is in the new primary's history; `b` is deposed by the epoch and boot id; the site
    serves again. (Messages of `b` after `a`'s first are possible while both databases
    run — the database itself split — and are counted, not refused.)"""
    replica = await asyncio.to_thread(own_pg.replica)
    # One address of the database per node: the failover reaches a before b.
    proxy_a, proxy_b = await own_site.proxy(own_pg.url(DB)), await own_site.proxy(
        own_pg.url(DB))
    a = await own_site.start_leader("a", state_url=proxy_a.url(own_pg.url(DB)))
    b = await own_site.start_standby("b", state_url=proxy_b.url(own_pg.url(DB)))
    a_boot = await leader_boot(a)
    watch = LeaderWatch(own_site)
    watch.start()
    flow = Flow(scheduler)
    flow.start()
    await flow.more(10)
    await wait_until(lambda: replay_caught_up(own_pg, replica), 10,
                     "the replica replays everything so far")
    kept = set(scheduler.outcomes)

    # The replica stops receiving: whatever the primary commits from here on is lost.
    replica.sql("ALTER SYSTEM SET primary_conninfo = ''")
    replica.sql("SELECT pg_reload_conf()")
    await wait_until(lambda: not replica.sql("SELECT 1 FROM pg_stat_wal_receiver"), 10,
                     "the replica's walreceiver ends")
    assert await a.kill() == -signal.SIGKILL
    await b.wait_role("leader", TAKEOVER_TIMEOUT)
    b_boot = await leader_boot(b)
    await flow.more(10, timeout=20)
    a.start()  # a standby again, with a new boot
    await a.wait_role("standby", 20, text="leader: node b")
    await flow.more(5)
    assert replica.sql("SELECT epoch FROM leadership", dbname=DB) == [(1,)], \
        "the replica must lack b's epoch"

    # The failover: the replica is promoted while the old primary, cut off from it,
    # still runs and b still renews its epoch-2 term there; a's address leads to the
    # new primary first, and a claims epoch 2 there. Then the old primary dies and b's
    # address leads to the new one: b, still within its term, renews at epoch 2 — the
    # boot id alone tells it the epoch is no longer its own.
    t_fail = time.monotonic()
    await asyncio.to_thread(replica.promote)
    proxy_a.retarget(replica.url(DB))
    own_site.pg_url = replica.url(DB)  # the site's database from now on
    await a.wait_log("leading the site", TAKEOVER_TIMEOUT, count=2)
    assert b.alive and not stepped_down(b), "b must still hold its term here"
    proxy_b.retarget(replica.url(DB))
    await asyncio.to_thread(own_pg.stop, "immediate")
    failover_for = time.monotonic() - t_fail
    await wait_until(lambda: bool(stepped_down(b)), 10, "b steps down")
    deposed = stepped_down(b)[0]
    leader = await wait_leader([a, b], TAKEOVER_TIMEOUT)
    other = b if leader is a else a
    await other.wait_role("standby", 20, text=f"leader: node {leader.node}")
    await flow.more(15, timeout=30)
    await flow.stop()
    gap = assert_leader_back(watch, failover_for, t_fail)
    await watch.stop()

    unanswered = await scheduler.finish(scheduler.answer_timeout + 5)
    assert not unanswered, f"unanswered: {unanswered[:5]}\n{own_site.logs()}"
    probe.raise_contract_errors()
    seen = Observed.of(probe)

    problems = seen.epoch_problems()
    chain = seen.leaders()
    for old, new in itertools.pairwise(chain):
        if new.epoch < old.epoch:
            problems.append(f"leader {new} after {old}: the epoch went down")
    assert [(c.node, c.epoch, c.boot) for c in chain[:2]] == [("a", 1, a_boot),
                                                              ("b", 2, b_boot)], chain
    after = chain[2:]
    if not after or after[0].epoch != 2:
        problems.append(f"expected epoch 2 issued again after the failover: {chain}")
    row = await own_site.query("SELECT node, epoch, boot_id FROM leadership")
    if chain and row != [(chain[-1].node, chain[-1].epoch, chain[-1].boot)]:
        problems.append(f"leadership row {row}, the last leader seen {chain[-1]}")

    table = await own_site.leases()
    rows: dict[str, list[str]] = {}
    for sched, rid, lease_id, _ in table:
        if sched == SCHEDULER:
            rows.setdefault(rid, []).append(lease_id)
    for rid, ids in rows.items():
        if len(ids) > 1:
            problems.append(f"leases table: {len(ids)} rows for {rid}: {ids}")
    lost = []
    for o in scheduler.outcomes.values():
        if o.kind != "decided":
            continue
        if o.request_id not in rows:
            lost.append(o.request_id)
            if o.request_id in kept:
                problems.append(f"request {o.request_id}, decided before the replica "
                                "stopped receiving, is missing from the leases table")
        elif rows[o.request_id] != [o.lease_id]:
            problems.append(f"request {o.request_id}: the scheduler holds {o.lease_id}, "
                            f"the database {rows[o.request_id]}")
    # b's whole term came after the replica stopped receiving: nothing b decided may be in
    # the new primary's history, where its epoch is a's.
    held = {lease_id for _, _, lease_id, _ in table}
    by_b = [str(e.body["data"]["lease_id"]) for e in seen.events()
            if e.boot == b_boot and e.kind == "placement.decided"]
    if held & set(by_b):
        problems.append(f"leases b decided at epoch 2 committed in the new primary's "
                        f"history (where epoch 2 is a's): {sorted(held & set(by_b))[:5]}")
    why = str(deposed.get("detail") or deposed.get("why"))
    if not re.search(r"this node's epoch is 2, node a at epoch 2 leads|another node leads "
                     r"site \w+ now \(this node's epoch was 2\)", why):
        problems.append(f"b was not deposed by the epoch and boot id: {why}")
    for d in own_site.daemons.values():
        if d.tracebacks():
            problems.append(f"node {d.node} logged failures: {d.tracebacks()[:3]}")
    late = [s.index for s in seen.seen if s.boot == b_boot and after
            and s.index > after[0].first]
    assert not problems, ("\n".join(problems) + "\n--- probe ---\n" + seen.describe()
                          + "\n" + own_site.logs())
    print(f"\nfailover made in {failover_for:.2f} s, no leader for {gap:.2f} s; leaders "
          f"{[str(c) for c in chain]}; decided leases lost with the WAL: {len(lost)}; "
          f"messages of b's epoch-2 start after the new leader's first: {len(late)}; b "
          f"deposed: {deposed.get('detail') or deposed.get('why')}")
    assert lost, "the leases b decided on the lost history must be missing"


# --------------------------------------------------------------------------------------
# 3. commits stalled after the fence
# --------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_commits_stalled_by_an_absent_synchronous_standby(
        own_site: HaSite, own_pg: PgServer, probe: MqttProbe, scheduler: Scheduler) -> None:
    """`synchronous_standby_names = 'nobody'` (set with ALTER SYSTEM and a reload while
    requests flow): every COMMIT that wrote something waits for a standby that never
    comes, after the fence took its share lock of the leadership row. For three terms
    the leader must stay the leader (no takeover, no stepping down: its renewals must
    not wait for the commits), and once the setting is reset it answers every request
    that waited."""
    a = await own_site.start_leader("a")
    b = await own_site.start_standby("b")
    watch = LeaderWatch(own_site)
    watch.start()
    flow = Flow(scheduler)
    flow.start()
    await flow.more(10)

    own_pg.sql("ALTER SYSTEM SET synchronous_standby_names = 'nobody'")
    own_pg.sql("SELECT pg_reload_conf()")
    t_stall = time.monotonic()
    await wait_until(lambda: bool(own_pg.sql(
        "SELECT 1 FROM pg_stat_activity WHERE application_name = 'gpubroker' "
        "AND wait_event = 'SyncRep'")), 10, "a commit of the leader waits for the standby")
    # The fault lasts three terms; the watch samples the nodes meanwhile.
    await asyncio.sleep(3 * LEADERSHIP_SECONDS)
    answered_during = scheduler.answered
    own_pg.sql("ALTER SYSTEM RESET synchronous_standby_names")
    own_pg.sql("SELECT pg_reload_conf()")
    stalled_for = time.monotonic() - t_stall
    await flow.more(15, timeout=30)
    await flow.stop()
    await watch.stop()
    seen = await settle(own_site, probe, scheduler)

    leading = watch.leading(t_stall)
    not_a = [(round(t - t_stall, 2), nodes) for t, nodes in leading if nodes != ["a"]]
    problems = []
    if not_a:
        problems.append(f"a did not lead all along the stall: {not_a[:10]}")
    if stepped_down(a):
        problems.append(f"a stepped down: {stepped_down(a)[:2]}")
    if b.logged("leading the site"):
        problems.append("b took over")
    if problems:
        raise LeaderLost("\n".join(problems) + "\n" + own_site.logs())
    chain = await check_site(own_site, seen, scheduler, [("a", 1)])
    assert len(chain) == 1
    print(f"\ncommits stalled {stalled_for:.2f} s; requests answered by then "
          f"{answered_during}")


# --------------------------------------------------------------------------------------
# 4. the leader's store connection terminated
# --------------------------------------------------------------------------------------


async def test_leader_store_connection_terminated(site: HaSite, probe: MqttProbe,
                                                  scheduler: Scheduler) -> None:
    """`pg_terminate_backend` of the leader's store connection (application_name
    'gpubroker'), twice, while requests flow; its election and renewal connections live.
    The leader stays the leader — no 503, no takeover — and answers the next requests:
    a commit that finds its connection gone before its COMMIT is tried again on a new
    one."""
    a = await site.start_leader("a")
    # The leader's store connection: its first 'gpubroker' one (opened to stand by; a
    # read of the market history at the start of its term is another), before b's.
    ((pid,),) = await site.query(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND "
        "application_name = 'gpubroker' ORDER BY backend_start LIMIT 1")
    store_pids = {int(pid)}
    renewal: list[tuple[object, ...]] = []
    async with asyncio.timeout(10):
        while not renewal:  # the server has no event for a new connection: it is asked
            renewal = await site.query(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND "
                "application_name LIKE 'gpubroker-renewal %'")
            await asyncio.sleep(0.05)
    b = await site.start_standby("b")
    others = await store_backends(site) - store_pids  # b's, and a's reads
    watch = LeaderWatch(site)
    watch.start()
    t0 = time.monotonic()
    flow = Flow(scheduler)
    flow.start()
    await flow.more(10)
    for _ in range(2):
        (pid,) = store_pids
        assert await site.query("SELECT pg_terminate_backend(%s)", pid) == [(True,)]
        await flow.more(10)
        new: set[int] = set()
        async with asyncio.timeout(10):
            while not new:  # the server has no event for a new connection: it is asked
                new = await store_backends(site) - others - store_pids
                await asyncio.sleep(0.05)
        assert len(new) == 1, f"the leader's new store connection: {new}"
        store_pids = new
    await flow.stop()
    await watch.stop()
    seen = await settle(site, probe, scheduler)

    replies = watch.replies_of("a", t0)
    assert replies and not [r for r in replies if r.status == 503], \
        [r for r in replies if r.status == 503][:3]
    assert all(nodes == ["a"] for _, nodes in watch.leading(t0) if nodes)
    assert not stepped_down(a), stepped_down(a)
    assert not b.logged("leading the site")
    assert not [o for o in scheduler.outcomes.values() if o.kind == "error"]
    chain = await check_site(site, seen, scheduler, [("a", 1)])
    assert len(chain) == 1
    assert renewal == await site.query(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND "
        "application_name LIKE 'gpubroker-renewal %'"), "the renewal connection lived on"


async def store_backends(site: HaSite) -> set[int]:
    """The backends of the site's database with application_name 'gpubroker': each
    node's store connection."""
    return {int(pid) for (pid,) in await site.query(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND "
        "application_name = 'gpubroker'")}


# --------------------------------------------------------------------------------------
# 5. a leader with 200,000 leases
# --------------------------------------------------------------------------------------

BOOK = 200_000


def fill_book(url: str, count: int) -> float:
    """The schema, then `count` active leases of scheduler `bulk` (1-day leases, rows as
    the daemon writes them: `broker.state.schema.lease_row`), copied in; the seconds taken."""
    t = time.monotonic()
    conn = connect(url)
    try:
        migrate(PgDb(conn), SITE)
        now = utcnow()
        template = LeaseBook().create(request("bulk-0", "T4", 1), placement(offer(), 1),
                                      lease_seconds=86_400, cap=1.0, now=now)
        row = lease_row(template, 1)
        body = json.loads(row[5])
        out = io.StringIO()
        for i in range(count):
            lease_id = f"L-{uuid.UUID(int=i).hex}"
            body["lease_id"], body["request_id"], body["scheduler"] = \
                lease_id, f"bulk-{i}", "bulk"
            body["request"]["request_id"] = f"bulk-{i}"
            text = json.dumps(body, separators=(",", ":"))
            out.write("\t".join([lease_id, "bulk", f"bulk-{i}", row[3], row[4],
                                 text.replace("\\", "\\\\"), "1", str(row[7])]) + "\n")
        with conn.cursor().copy("COPY leases (lease_id, scheduler, request_id, state, "
                                "updated_at, body, leader_epoch, part) FROM STDIN") as cp:
            cp.write(out.getvalue())
    finally:
        conn.close()
    return time.monotonic() - t


@pytest.mark.slow
@pytest.mark.timeout(150)
async def test_leader_with_200000_leases_stays_leader(site: HaSite, probe: MqttProbe,
                                                      scheduler: Scheduler) -> None:
    """200,000 active leases in the book before the nodes start. The first node to win
    the claim restores them all (seconds of a busy event loop) and must stay the leader
    meanwhile — its renewals run on a thread of their own — then answer requests. The
    time from its claim ("leading the site") to "ready" is reported."""
    filled = await asyncio.to_thread(fill_book, site.pg_url, BOOK)
    a = site.daemon("a")
    a.start()
    claimed = await a.wait_log("leading the site", 30)
    b = await site.start_standby("b")
    await wait_until(lambda: bool(a.logged("ready") or stepped_down(a)), 90,
                     "a is ready, or steps down")
    if stepped_down(a):
        raise LeaderLost(f"a stepped down while taking over {BOOK} leases: "
                         f"{stepped_down(a)[:2]}\n{a.log_tail(40)}")
    ready = a.logged("ready")[0]
    await a.wait_role("leader", 10)
    flow = Flow(scheduler)
    flow.start()
    await flow.more(10, timeout=30)
    await flow.stop()
    seen = await settle(site, probe, scheduler)

    assert not stepped_down(a), stepped_down(a)
    assert not b.logged("leading the site"), "b took over while a loaded its book"
    chain = await check_site(site, seen, scheduler, [("a", 1)])
    assert len(chain) == 1
    start = await a.wait_log("starting", 1)
    assert start["leases"] >= BOOK
    to_ready, to_start = (since(claimed, r) for r in (ready, start))
    print(f"\n{BOOK} leases copied in {filled:.1f} s; claim → starting {to_start:.2f} s, "
          f"→ ready {to_ready:.2f} s")
    assert await site.stop_all() == {"a": 0, "b": 0}


def since(first: dict[str, object], then: dict[str, object]) -> float:
    """Seconds between two log records (their timestamps)."""
    return (datetime.fromisoformat(str(then["timestamp"]))
            - datetime.fromisoformat(str(first["timestamp"]))).total_seconds()


# --------------------------------------------------------------------------------------
# 6. three leaders killed in turn
# --------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_three_leaders_killed_in_turn(site: HaSite, probe: MqttProbe,
                                            scheduler: Scheduler) -> None:
    """Three nodes; the leader is killed (SIGKILL) three times, each killed node started
    again as a standby. Each time another node leads, at a higher epoch, within the
    bound; every request is answered once."""
    a = await site.start_leader("a")
    nodes = [a, await site.start_standby("b"), await site.start_standby("c")]
    watch = LeaderWatch(site)
    watch.start()
    flow = Flow(scheduler)
    flow.start()
    await flow.more(10)
    leader = a
    gaps = []
    for _ in range(3):
        t_kill = time.monotonic()
        assert await leader.kill() == -signal.SIGKILL
        new = await wait_leader([d for d in nodes if d is not leader], TAKEOVER_TIMEOUT)
        assert new is not leader
        gaps.append(assert_leader_back(watch, 0.0, t_kill))
        leader.start()
        await leader.wait_role("standby", 20, text=f"leader: node {new.node}")
        await flow.more(10, timeout=20)
        leader = new
    await flow.stop()
    await watch.stop()
    seen = await settle(site, probe, scheduler)

    chain = await check_site(site, seen, scheduler, [("a", 1)])
    assert len(chain) >= 4
    assert [c.epoch for c in chain] == sorted({c.epoch for c in chain})
    for old, new_ in itertools.pairwise(chain):
        assert old.node != new_.node, chain
    print(f"\nleaders {[str(c) for c in chain]}; no leader for at most "
          f"{', '.join(f'{g:.2f}' for g in gaps)} s")
