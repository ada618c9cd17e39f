"""PostgreSQL's own tests of the state store (`broker/state/pgstore.py`) and of the election
(`broker/state/leadership.py`), on the local server, a fresh database per test: migrations, sites,
fencing, a lost server, two nodes of one site. The tests every engine passes are in
test_store.py.

Where a test must know that the server has got somewhere (two sessions waiting for the
migrations' lock), it asks the server (`until`): a condition waited for with a timeout."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pg_helpers
import psycopg
import pytest
from factories import T0, offer, placement, request
from structlog.testing import capture_logs

from broker.leasing.book import LeaseBook
from broker.model import Lease, LeaseState
from broker.state import leadership
from broker.state.leadership import Leadership
from broker.state.pgdb import MIGRATE_LOCK, PgDb, connect, migrate
from broker.state.pgstore import PgStateStore
from broker.state.schema import ENDED_DETAIL, SCHEMA_VERSION, lease_row
from broker.state.sitestatus import site_status
from broker.state.store import Deposed, StoreFailed
from broker.wire.messages import OutboxRow

SITE = "site-a"
TABLES = {"meta", "leases", "outbox", "market_pools", "market_changes", "market_snapshots",
          "leadership", "leadership_term", "nodes", "offer_slices", "schedseq"}


def lease(request_id: str = "r1", *, at: float = 0) -> Lease:
    return LeaseBook().create(request(request_id), placement(offer(), 2), lease_seconds=900,
                              cap=3.5, now=T0 + timedelta(seconds=at))


def sql(url: str, query: str, args: Any = None) -> list[tuple[Any, ...]]:
    """`query` on a connection of its own (autocommit); its rows, if it returns any."""
    with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
        cur = conn.execute(query, args)
        return cur.fetchall() if cur.description else []


def lead(url: str, epoch: int, node: str, *, expires_in: float = 3600,
         boot: str = "boot") -> None:
    """Make `node` the site's leader at `epoch` (what broker.state.leadership's claim writes)."""
    sql(url, "INSERT INTO leadership VALUES (%s, %s, %s, %s, now()) ON CONFLICT (site) DO "
             "UPDATE SET epoch = excluded.epoch, node = excluded.node, "
             "boot_id = excluded.boot_id", (SITE, epoch, node, boot))
    sql(url, "INSERT INTO leadership_term VALUES (%s, %s, %s, now() + make_interval(secs => "
             "%s)) ON CONFLICT (site) DO UPDATE SET epoch = excluded.epoch, boot_id = "
             "excluded.boot_id, expires_at = excluded.expires_at",
        (SITE, epoch, boot, expires_in))


async def until(check: Callable[[], bool], what: str, timeout: float = 10) -> None:
    """Wait until `check()` (run in a thread: it asks the server) holds. The server has
    no event for "a session now waits for a lock"; it is asked until it says so."""
    try:
        async with asyncio.timeout(timeout):
            while not await asyncio.to_thread(check):  # noqa: ASYNC110 (see above)
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"not within {timeout} s: {what}") from None


def with_password(url: str, password: str) -> str:
    u = urlsplit(url)
    user = u.username or "postgres"
    host = u.netloc.rsplit("@", 1)[-1]
    return urlunsplit((u.scheme, f"{user}:{password}@{host}", u.path, u.query, u.fragment))


def dbname(url: str) -> str:
    return urlsplit(url).path.lstrip("/")


@pytest.fixture
async def store(pg_url: str) -> AsyncIterator[PgStateStore]:
    s = PgStateStore(pg_url, site=SITE)
    await s.open()
    try:
        yield s
    finally:
        await s.close()


# --- migrations -----------------------------------------------------------------------------------


async def test_an_empty_database_is_migrated(pg_url: str) -> None:
    assert sql(pg_url, "SELECT tablename FROM pg_tables WHERE schemaname = 'public'") == []
    s = PgStateStore(pg_url, site=SITE, leadership_seconds=2.5)
    await s.open()
    try:
        tables = {t for (t,) in sql(pg_url, "SELECT tablename FROM pg_tables "
                                            "WHERE schemaname = 'public'")}
        assert tables == TABLES
        assert dict(sql(pg_url, "SELECT key, value FROM meta")) == {
            "schema": str(SCHEMA_VERSION), "site": SITE}
        for table in ("leases", "outbox"):
            assert sql(pg_url, "SELECT data_type, column_default FROM information_schema."
                               "columns WHERE table_name = %s AND column_name = "
                               "'leader_epoch'", (table,)) == [("bigint", "0")]
        # A transaction left open cannot hold the leadership row for longer than a
        # takeover may wait.
        assert await s.call(lambda db: db.execute(
            "SHOW idle_in_transaction_session_timeout").fetchone()[0]) == "2500ms"
        le = lease()
        await s.commit([le], [OutboxRow("t/a", b"1")])
    finally:
        await s.close()
    # An up-to-date database: nothing to do, nothing lost.
    db = PgDb(connect(pg_url))
    try:
        assert migrate(db, SITE) == SCHEMA_VERSION
        assert not db.in_transaction
    finally:
        db.close()
    again = PgStateStore(pg_url, site=SITE)
    await again.open()
    try:
        assert await again.leases() == [le]
        assert [r.topic for r in await again.pending()] == ["t/a"]
    finally:
        await again.close()


def advisory_waiters(url: str) -> int:
    return int(sql(url, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND "
                        "NOT granted AND database = (SELECT oid FROM pg_database WHERE "
                        "datname = current_database())")[0][0])


@contextlib.contextmanager
def migrations_held(url: str) -> Iterator[None]:
    """Hold the migrations' advisory lock until the block ends, so that whatever starts
    inside it waits, and then races."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(%s)", (MIGRATE_LOCK,))
        try:
            yield
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATE_LOCK,))


async def test_two_migrations_at_once_apply_the_schema_once(pg_url: str) -> None:
    dbs = [PgDb(connect(pg_url)) for _ in range(2)]
    try:
        with migrations_held(pg_url):
            found = [asyncio.ensure_future(asyncio.to_thread(migrate, db, SITE))
                     for db in dbs]
            await until(lambda: advisory_waiters(pg_url) == 2, "both migrations wait")
        async with asyncio.timeout(10):
            versions = await asyncio.gather(*found)
        # One found an empty database and applied the schema; the other found it done.
        assert sorted(versions) == [0, SCHEMA_VERSION]
    finally:
        for db in dbs:
            db.close()
    assert dict(sql(pg_url, "SELECT key, value FROM meta")) == {
        "schema": str(SCHEMA_VERSION), "site": SITE}


async def test_two_stores_open_an_empty_database_at_once(pg_url: str) -> None:
    stores = [PgStateStore(pg_url, site=SITE) for _ in range(2)]
    try:
        with migrations_held(pg_url):
            opening = [asyncio.ensure_future(s.open()) for s in stores]
            await until(lambda: advisory_waiters(pg_url) == 2, "both opens wait")
        async with asyncio.timeout(10):
            await asyncio.gather(*opening)
        a, b = stores
        le = lease()
        [row] = await a.commit([le], [OutboxRow("t/a", b"1")])
        assert await b.pending() == [row]
        assert await b.leases() == [le]
    finally:
        for s in stores:
            await s.close()
    assert sql(pg_url, "SELECT value FROM meta WHERE key = 'schema'") == [
        (str(SCHEMA_VERSION),)]


def sessions(url: str) -> int:
    """Sessions on the database other than the asking one."""
    return int(sql(url, "SELECT count(*) FROM pg_stat_activity WHERE datname = "
                        "current_database() AND pid <> pg_backend_pid()")[0][0])


async def test_a_newer_schema_is_refused_and_left_alone(store: PgStateStore,
                                                        pg_url: str) -> None:
    newer_version = str(SCHEMA_VERSION + 1)
    sql(pg_url, "UPDATE meta SET value = %s WHERE key = 'schema'", (newer_version,))
    sql(pg_url, "CREATE TABLE from_the_future (x int)")
    await store.close()
    newer = PgStateStore(pg_url, site=SITE)
    with pytest.raises(RuntimeError, match=rf"newer gpubroker \(schema {newer_version}, this "
                                           rf"one knows {SCHEMA_VERSION}\)"):
        await newer.open()
    await newer.close()
    assert sql(pg_url, "SELECT value FROM meta WHERE key = 'schema'") == [(newer_version,)]
    assert sql(pg_url, "SELECT count(*) FROM from_the_future") == [(0,)]
    # The refused store's connection is closed (its server process ends soon after).
    await until(lambda: sessions(pg_url) == 0, "no session left")


async def test_another_sites_database_is_refused(store: PgStateStore, pg_url: str) -> None:
    le = lease()
    await store.commit([le], [])
    other = PgStateStore(pg_url, site="site-b")
    with pytest.raises(RuntimeError, match=r"holds the state of site 'site-a', not "
                                           r"'site-b': each site needs a database"):
        await other.open()
    await other.close()
    assert sql(pg_url, "SELECT value FROM meta WHERE key = 'site'") == [(SITE,)]
    assert await store.leases() == [le]
    await until(lambda: sessions(pg_url) == 1, "only the fixture's store's session left")


# Schema 2 as release 2 made it (broker/state/pgstore.py before the lease parts): each
# request's key unique, under the constraint name PostgreSQL gave it.
_SCHEMA_2 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE leases (
    lease_id   TEXT PRIMARY KEY,
    scheduler  TEXT NOT NULL,
    request_id TEXT NOT NULL,
    state      TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    body       TEXT NOT NULL,
    UNIQUE (scheduler, request_id)
);
CREATE INDEX leases_state ON leases (state, updated_at);
CREATE TABLE outbox (
    id       BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic    TEXT NOT NULL,
    payload  BYTEA NOT NULL,
    qos      BIGINT NOT NULL,
    retain   BIGINT NOT NULL,
    props    TEXT
);
CREATE TABLE market_pools (
    id            BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    cloud         TEXT NOT NULL,
    region        TEXT NOT NULL,
    zone          TEXT NOT NULL,
    instance_type TEXT NOT NULL,
    market        TEXT NOT NULL,
    gpu           TEXT NOT NULL,
    gpus          BIGINT NOT NULL,
    UNIQUE (cloud, region, zone, instance_type, market, gpu, gpus)
);
CREATE TABLE market_changes (
    t                    BIGINT NOT NULL,
    pool_id              BIGINT NOT NULL,
    price_e6             BIGINT,
    availability_e6      BIGINT,
    capacity             BIGINT,
    interruption_rate_e6 BIGINT,
    quota_headroom       BIGINT,
    kind                 BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (t, pool_id)
);
CREATE TABLE market_snapshots (t BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY);
ALTER TABLE leases ADD COLUMN leader_epoch BIGINT NOT NULL DEFAULT 0;
ALTER TABLE outbox ADD COLUMN leader_epoch BIGINT NOT NULL DEFAULT 0;
CREATE TABLE leadership (
    site       TEXT PRIMARY KEY,
    epoch      BIGINT NOT NULL,
    node       TEXT NOT NULL,
    boot_id    TEXT NOT NULL,
    since      TIMESTAMPTZ NOT NULL,
    expires_at TIMESTAMPTZ NOT NULL
);
CREATE TABLE nodes (
    node       TEXT PRIMARY KEY,
    boot_id    TEXT NOT NULL,
    role       TEXT NOT NULL,
    epoch      BIGINT NOT NULL,
    version    TEXT NOT NULL,
    started_at TIMESTAMPTZ NOT NULL,
    seen_at    TIMESTAMPTZ NOT NULL
);
INSERT INTO meta VALUES ('schema', '2'), ('site', 'site-a');
"""


def lease_table(url: str) -> tuple[list[tuple[Any, ...]], ...]:
    """The leases table's columns, constraints and indexes."""
    return (sql(url, "SELECT column_name, data_type, is_nullable, column_default FROM "
                     "information_schema.columns WHERE table_name = 'leases' ORDER BY "
                     "ordinal_position"),
            sql(url, "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint WHERE "
                     "conrelid = 'leases'::regclass ORDER BY conname"),
            sql(url, "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'leases' "
                     "ORDER BY indexname"))


async def test_a_schema_5_database_is_migrated_and_its_ended_leases_say_how_they_ended(
        pg_url: str) -> None:
    """Schema 6 on PostgreSQL: as on SQLite (tests/state/test_store.py), in jsonb."""
    book = LeaseBook()
    active = lease("on")
    released = book.end(book.create(request("off"), placement(offer(), 2), lease_seconds=900,
                                    cap=None, now=T0).lease_id, LeaseState.RELEASED,
                        T0 + timedelta(seconds=1))
    failed = book.end(book.create(request("gone"), placement(offer(), 2), lease_seconds=900,
                                  cap=None, now=T0).lease_id, LeaseState.FAILED,
                      T0 + timedelta(seconds=2), reason="reported", detail="x")
    s = PgStateStore(pg_url, site=SITE)
    await s.open()
    try:
        await s.commit([active, released, failed], [])
    finally:
        await s.close()
    # What a schema-5 daemon wrote: no end in the records.
    sql(pg_url, "UPDATE leases SET body = (body::jsonb - 'ended_reason' - 'ended_detail' "
                "- 'ended_at')::text")
    sql(pg_url, "UPDATE meta SET value = '5' WHERE key = 'schema'")
    db = PgDb(connect(pg_url))
    try:
        assert migrate(db, SITE) == 5
    finally:
        db.close()
    s = PgStateStore(pg_url, site=SITE)
    await s.open()
    try:
        got = {le.request_id: le for le in await s.leases(ended_since=T0)}
    finally:
        await s.close()
    assert got == {"on": active, "off": released,
                   "gone": replace(failed, ended_reason="ended", ended_detail=ENDED_DETAIL)}
    assert got["off"].ended_reason == "released"
    assert got["off"].ended_at == T0 + timedelta(seconds=1)


async def test_a_schema_2_database_is_migrated_keeps_its_leases_and_takes_parts(
        pg_url: str) -> None:
    kept, ended = lease("old-one"), replace(lease("old-two", at=1), state=LeaseState.RELEASED,
                                            ended_reason="released",
                                            ended_at=T0 + timedelta(seconds=1))
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(_SCHEMA_2)
        for le, epoch in ((kept, 4), (ended, 5)):
            conn.execute("INSERT INTO leases VALUES (%s,%s,%s,%s,%s,%s,%s)",
                         lease_row(le, epoch)[:7])
        conn.execute("INSERT INTO outbox (topic, payload, qos, retain, leader_epoch) "
                     "VALUES ('t/old', '\\x01', 1, 1, 4)")
    assert ("leases_scheduler_request_id_key", "UNIQUE (scheduler, request_id)") in \
        lease_table(pg_url)[1]
    db = PgDb(connect(pg_url))
    try:
        assert migrate(db, SITE) == 2
    finally:
        db.close()
    assert dict(sql(pg_url, "SELECT key, value FROM meta")) == {
        "schema": str(SCHEMA_VERSION), "site": SITE}
    columns, constraints, _ = lease_table(pg_url)
    assert columns[-3:] == [("leader_epoch", "bigint", "NO", "0"), ("part", "bigint", "NO", "0"),
                            ("change", "bigint", "YES", None)]
    assert dict(constraints) == {
        "leases_pkey": "PRIMARY KEY (lease_id)",
        "leases_scheduler_request_id_part_key": "UNIQUE (scheduler, request_id, part)"}
    # The same table as a new database's.
    with pg_helpers.fresh_database() as new_url:
        s = PgStateStore(new_url, site=SITE)
        await s.open()
        await s.close()
        assert lease_table(pg_url) == lease_table(new_url)

    s = PgStateStore(pg_url, site=SITE)
    await s.open()
    try:
        assert await s.leases(ended_since=T0) == [kept, ended]
        assert sql(pg_url, "SELECT lease_id, leader_epoch, part FROM leases ORDER BY "
                           "lease_id") == sorted([(kept.lease_id, 4, 0), (ended.lease_id, 5, 0)])
        assert [r.topic for r in await s.pending()] == ["t/old"]
        # The key is unique per part now: a split request's parts are kept.
        head = lease("s1")
        ids = (head.lease_id, "L-s1-2", "L-s1-3")
        parts = [replace(head, lease_id=lease_id, part=k, parts=ids)
                 for k, lease_id in enumerate(ids, 1)]
        await s.commit(parts, [])
        assert await s.find_leases([("sched-a", "s1")]) == {("sched-a", "s1"): parts}
        assert await s.find_lease("sched-a", "s1") == parts[0]
        with pytest.raises(StoreFailed, match="leases_scheduler_request_id_part_key"):
            await s.commit([replace(parts[1], lease_id="L-s1-again")], [])
        with pytest.raises(StoreFailed, match="leases_scheduler_request_id_part_key"):
            await s.commit([replace(kept, lease_id="L-other")], [])
    finally:
        await s.close()


# --- statements -----------------------------------------------------------------------------------


async def test_statements_are_passed_as_written(store: PgStateStore) -> None:
    """`?` is a parameter; `%` is a literal, with or without parameters."""
    def q(db: PgDb) -> list[Any]:
        return [db.execute("SELECT '100%'").fetchone()[0],
                db.execute("SELECT ? || '%'", ("5",)).fetchone()[0],
                db.execute("SELECT count(*) FROM meta WHERE value LIKE 'site-%'").fetchone()[0]]

    assert await store.call(q) == ["100%", "5%", 1]


# --- fencing --------------------------------------------------------------------------------------


def epochs(url: str) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    return (sql(url, "SELECT lease_id, leader_epoch FROM leases ORDER BY lease_id"),
            sql(url, "SELECT topic, leader_epoch FROM outbox ORDER BY id"))


async def test_a_leaders_commits_carry_its_epoch(store: PgStateStore, pg_url: str) -> None:
    lead(pg_url, 5, "n1")
    store.epoch = 5
    le = lease()
    rows = await store.commit([le], [OutboxRow("t/a", b"1"), OutboxRow("t/b", b"2")])
    assert [r.topic for r in rows] == ["t/a", "t/b"]
    assert epochs(pg_url) == ([(le.lease_id, 5)], [("t/a", 5), ("t/b", 5)])
    # A later leader's update of the same lease is marked with its own epoch.
    lead(pg_url, 7, "n2")
    store.epoch = 7
    await store.commit([replace(le, epoch=2)], [])
    assert epochs(pg_url)[0] == [(le.lease_id, 7)]
    assert await store.leases() == [replace(le, epoch=2)]


def row_lock_is_free(url: str) -> bool:
    """Whether a takeover's update of the leadership row goes through at once."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET lock_timeout = '500ms'")
        try:
            conn.execute("UPDATE leadership SET since = since WHERE site = %s", (SITE,))
        except psycopg.errors.LockNotAvailable:
            return False
        return True


async def test_a_writer_stopped_in_the_middle_of_its_writes_holds_up_no_takeover(
        store: PgStateStore, pg_url: str) -> None:
    """A leader frozen (SIGSTOP) while its writes are on the wire keeps its transaction
    open, 'active', with no timeout of the server's to end it: the fence's lock of the
    leadership row is taken only at the COMMIT, so the takeover goes through."""
    lead(pg_url, 5, "n1")
    store.epoch = 5

    def stopped_mid_transaction(db: Any) -> None:
        db.begin()
        db.executemany("INSERT INTO outbox (topic, payload, qos, retain) VALUES (?,?,?,?)",
                       [("t/x", b"1", 1, 0)])  # ... and the process stops here

    await store.call(stopped_mid_transaction)
    assert await store.call(lambda db: db.in_transaction) is True
    assert await asyncio.to_thread(row_lock_is_free, pg_url)  # a takeover is not held up
    lead(pg_url, 6, "n2")
    with pytest.raises(Deposed):  # the stopped writer resumes: its COMMIT is refused
        await store.call(lambda db: db.commit())
    assert sql(pg_url, "SELECT count(*) FROM outbox") == [(0,)]


async def test_after_a_takeover_a_commit_is_deposed_and_writes_nothing(
        store: PgStateStore, pg_url: str) -> None:
    lead(pg_url, 5, "n1")
    store.epoch = 5
    le = lease()
    [kept] = await store.commit([le], [OutboxRow("t/kept", b"1")])
    lead(pg_url, 6, "n2")  # another node took over
    with pytest.raises(Deposed, match=r"leadership of site site-a lost: this node's epoch "
                                      r"is 5, node n2 at epoch 6 leads") as err:
        await store.commit([replace(le, epoch=2), lease("r2")], [OutboxRow("t/lost", b"2")])
    assert isinstance(err.value, StoreFailed)
    assert store.name in str(err.value)
    assert await store.leases() == [le]
    assert await store.pending() == [kept]
    assert epochs(pg_url) == ([(le.lease_id, 5)], [("t/kept", 5)])
    # The refused transaction is over: the store's connection holds no lock, the new
    # leader's renewals go through.
    assert await store.call(lambda db: db.in_transaction) is False
    assert await asyncio.to_thread(row_lock_is_free, pg_url)
    # Every later write is refused too, the recorder's included.
    with pytest.raises(Deposed):
        await store.commit([], [OutboxRow("t/lost", b"3")])
    with pytest.raises(Deposed):  # a transaction of the recorder's: refused at its COMMIT
        await store.call(lambda db: (db.begin(), db.commit()))
    assert await store.call(lambda db: db.in_transaction) is False
    assert await asyncio.to_thread(row_lock_is_free, pg_url)
    # Nobody leading is no better.
    sql(pg_url, "DELETE FROM leadership")
    with pytest.raises(Deposed, match="epoch is 5, nobody leads"):
        await store.commit([], [OutboxRow("t/lost", b"4")])
    assert await store.pending() == [kept]


async def test_a_write_the_new_leaders_rows_refuse_is_deposed_not_failed(
        store: PgStateStore, pg_url: str) -> None:
    """After a failover that lost this node's last commits, the new leader decided the
    same request again: this node's next commit meets that row's unique key before its
    fence runs. It is told it is deposed (the reason), not that a key is duplicated (the
    symptom), and writes nothing. While it still leads, the key's error is its own."""
    lead(pg_url, 5, "n1")
    store.epoch = 5
    theirs = lease("r1")
    await store.commit([theirs], [])
    mine = lease("r1")  # the same request, another lease_id
    assert mine.lease_id != theirs.lease_id
    with pytest.raises(StoreFailed, match="duplicate key") as err:
        await store.commit([mine], [OutboxRow("t/x", b"1")])
    assert not isinstance(err.value, Deposed)
    lead(pg_url, 6, "n2")
    with pytest.raises(Deposed, match="this node's epoch is 5, node n2 at epoch 6 leads"):
        await store.commit([mine], [OutboxRow("t/x", b"1")])
    assert await store.leases() == [theirs]
    assert await store.pending() == []
    assert await store.call(lambda db: db.in_transaction) is False
    assert await asyncio.to_thread(row_lock_is_free, pg_url)


async def test_a_takeover_waits_for_a_commit_in_flight(store: PgStateStore,
                                                       pg_url: str) -> None:
    """A commit that has passed the fence finishes, and is kept, even though a standby's
    claim is made meanwhile: the claim waits for it (the share lock of the row)."""
    lead(pg_url, 5, "n1", expires_in=-1)  # expired: a standby's claim may take it
    store.epoch = 5
    fenced, proceed = threading.Event(), threading.Event()
    assert store._db is not None
    real_fence = store._db._fence
    assert real_fence is not None

    def paused_fence(db: PgDb) -> None:
        real_fence(db)  # the epoch checked, the row share-locked
        fenced.set()
        assert proceed.wait(10)

    store._db._fence = paused_fence
    le = lease()
    commit = asyncio.ensure_future(store.commit([le], [OutboxRow("t/in-flight", b"1")]))
    claim_args = {"site": SITE, "node": "n2", "boot": "b2", "ttl": 30.0}
    try:
        assert await asyncio.to_thread(fenced.wait, 10)
        with psycopg.connect(pg_url, autocommit=True) as standby:
            # broker.state.leadership's claim, as a standby makes it: while the commit is in
            # flight it
            # cannot have the row (here it gives up after 300 ms of waiting).
            standby.execute("SET lock_timeout = '300ms'")
            with pytest.raises(psycopg.errors.LockNotAvailable):
                await asyncio.to_thread(standby.execute, leadership._CLAIM, claim_args)
            assert not commit.done()
            # Once the commit is through, the claim is.
            standby.execute("SET lock_timeout = '10s'")
            claim = asyncio.ensure_future(asyncio.to_thread(
                lambda: standby.execute(leadership._CLAIM, claim_args).fetchone()))
            proceed.set()
            async with asyncio.timeout(10):
                written = await commit
                assert await claim == (6,)
    finally:
        proceed.set()
        store._db._fence = real_fence
    assert [r.topic for r in written] == ["t/in-flight"]
    assert epochs(pg_url) == ([(le.lease_id, 5)], [("t/in-flight", 5)])
    assert leadership_row(pg_url)[:2] == ("n2", 6)
    with pytest.raises(Deposed, match="node n2 at epoch 6 leads"):
        await store.commit([], [OutboxRow("t/late", b"2")])


async def test_a_deposed_recorder_writes_nothing(store: PgStateStore, pg_url: str) -> None:
    from factories import SLICE, Clock

    from broker.market.pool import ResourcePool
    from broker.market.recorder import MarketRecorder

    lead(pg_url, 5, "n1")
    store.epoch = 5
    clock = Clock()
    pool = ResourcePool(stale_after_seconds=1e9, clock=clock)
    recorder = MarketRecorder(store, retention_days=14, clock=clock)
    pool.subscribe(recorder.observe)
    task = asyncio.create_task(recorder.run())
    try:
        pool.replace(SLICE, [offer("us-east-1a", price=1.0)])
        async with asyncio.timeout(10):
            await recorder.flush()
        assert recorder.rows_written == 1
        lead(pg_url, 6, "n2")
        clock.advance(60)
        with capture_logs() as logs:
            pool.replace(SLICE, [offer("us-east-1a", price=2.0)])
            async with asyncio.timeout(10):
                await recorder.flush()
        assert recorder.failures == 1 and recorder.rows_written == 1
        [failing] = logs
        assert (failing["event"], failing["error"]) == ("market recording failing", "Deposed")
        assert "node n2 at epoch 6 leads" in failing["detail"]
        assert not failing.get("exc_info")  # expected, not a bug: no traceback
        assert sql(pg_url, "SELECT price_e6 FROM market_changes") == [(1_000_000,)]
        assert await store.call(lambda db: db.in_transaction) is False
        assert await asyncio.to_thread(row_lock_is_free, pg_url)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# --- a lost or refusing server --------------------------------------------------------------------


async def test_a_lost_connection_fails_reads_and_commits_but_not_acks(
        pg_url: str, tmp_path: Path) -> None:
    """The messages name the server and database, never a password (the URL's or the
    password file's; the test server trusts its clients, so both are accepted)."""
    pw = tmp_path / "pg-password"
    pw.write_text("file-s3cret\n")
    s = PgStateStore(with_password(pg_url, "url-s3cret"), site=SITE, password_file=pw)
    name = f"postgresql://postgres@{urlsplit(pg_url).hostname}:{urlsplit(pg_url).port}/" \
           f"{dbname(pg_url)}"
    assert s.name == name
    await s.open()
    try:
        [row] = await s.commit([lease()], [OutboxRow("t/a", b"1")])
        pid = await s.call(lambda db: db.conn.info.backend_pid)
        # (and waits until that session has ended)
        assert sql(pg_url, "SELECT pg_terminate_backend(%s, 5000)", (pid,)) == [(True,)]
        with capture_logs() as logs:
            await s.ack([row.id or 0])  # best effort: no exception
        assert [e["event"] for e in logs] == ["outbox rows not deleted; they are sent "
                                              "again later"]
        # A commit that finds the connection lost before its COMMIT was sent committed
        # nothing: it is tried again, once, on a new connection.
        with capture_logs() as logs:
            [row2] = await s.commit([lease("r2")], [OutboxRow("t/b", b"2")])
        assert "the database connection was lost before a commit; trying it again" in [
            e["event"] for e in logs]
        pid2 = await s.call(lambda db: db.conn.info.backend_pid)
        assert pid2 != pid
        assert sql(pg_url, "SELECT pg_terminate_backend(%s, 5000)", (pid2,)) == [(True,)]
        failures: list[StoreFailed] = []
        for what, op in (("outbox read", s.pending()),
                         ("lease read", s.leases()),
                         ("lease lookup", s.find_leases([("sched-a", "r1")]))):
            with pytest.raises(StoreFailed) as err:
                await op
            assert str(err.value).startswith(f"{name}: {what} failed: "), err.value
            assert isinstance(err.value.__cause__, psycopg.OperationalError)
            failures.append(err.value)
        assert not any("s3cret" in str(f) for f in failures)
    finally:
        await s.close()  # a broken connection closes quietly
    again = PgStateStore(pg_url, site=SITE)
    await again.open()
    try:
        assert await again.pending() == [row, row2]  # the ack was lost: sent again
    finally:
        await again.close()


async def test_a_missing_database_or_server_fails_the_open(
        pg_url: str, free_port: Callable[[], int]) -> None:
    """At open, the server's refusal is psycopg's error (the daemon waits for the
    database and retries); the store's name still says where, without a password."""
    u = urlsplit(pg_url)
    missing = urlunsplit((u.scheme, u.netloc, "/gpbtest_missing", u.query, u.fragment))
    port = free_port()
    nobody = urlunsplit((u.scheme, f"{u.username or 'postgres'}@127.0.0.1:{port}",
                         u.path, u.query, u.fragment))
    for url, why in ((missing, 'database "gpbtest_missing" does not exist'),
                     (nobody, "Connection refused")):
        s = PgStateStore(with_password(url, "url-s3cret"), site=SITE)
        assert "s3cret" not in s.name and s.name.endswith(urlsplit(url).path)
        async with asyncio.timeout(10):
            with pytest.raises(psycopg.OperationalError, match=why) as err:
                await s.open()
        assert "s3cret" not in str(err.value)
        await s.close()
    assert PgStateStore(nobody, site=SITE).name == \
        f"postgresql://{u.username or 'postgres'}@127.0.0.1:{port}/{dbname(pg_url)}"


# --- the election (broker.state.leadership) on a real database ------------------------------------


class Node(Leadership):
    """A Leadership that tells when a standby has seen who leads (its `leader`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.saw_leader = asyncio.Event()
        super().__init__(*args, **kwargs)

    @property  # type: ignore[override]
    def leader(self) -> tuple[str, int] | None:
        return self._leader

    @leader.setter
    def leader(self, value: tuple[str, int] | None) -> None:
        self._leader = value
        if value is not None and self.role == "standby":
            self.saw_leader.set()


def node(store: PgStateStore, name: str, seconds: float) -> Node:
    return Node(store, site=SITE, node=name, boot_id=f"boot-{name}", seconds=seconds)


def leadership_row(url: str) -> tuple[Any, ...]:
    [row] = sql(url, "SELECT l.node, l.epoch, l.since, t.expires_at FROM leadership l "
                     "JOIN leadership_term t USING (site) WHERE l.site = %s", (SITE,))
    return row


@contextlib.asynccontextmanager
async def nodes(store: PgStateStore, seconds: float, *names: str
                ) -> AsyncIterator[tuple[asyncio.Event, list[Node]]]:
    stop = asyncio.Event()
    made = [node(store, n, seconds) for n in names]
    try:
        yield stop, made
    finally:
        stop.set()
        for n in made:
            await n.close()


async def first_of(tasks: dict[asyncio.Task[int | None], Node], timeout: float = 10
                   ) -> tuple[Node, int | None]:
    done, _ = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1, f"{len(done)} nodes acquired"
    task = done.pop()
    return tasks.pop(task), task.result()


async def test_one_node_leads_the_other_takes_over_after_the_expiry(
        store: PgStateStore, pg_url: str) -> None:
    async with nodes(store, 2.0, "a", "b") as (stop, (a, b)):
        acquiring = {asyncio.create_task(n.acquire(stop)): n for n in (a, b)}
        holding: asyncio.Task[Any] | None = None
        try:
            leader, epoch = await first_of(acquiring)
            [(standby_task, standby)] = acquiring.items()
            assert epoch == 1 and leader.epoch == 1 and leader.role == "leader"
            assert leader.valid()
            holding = asyncio.create_task(leader.hold())  # renewing, as a daemon does
            # The other stands by: it has seen who leads, and keeps trying.
            async with asyncio.timeout(10):
                await standby.saw_leader.wait()
            assert standby.leader == (leader.node, 1)
            assert (standby.role, standby.epoch, standby.valid()) == ("standby", 0, False)
            status = await asyncio.to_thread(site_status, store, SITE)
            assert (status.leader, status.epoch) == (leader.node, 1)
            assert status.expires_in_seconds is not None and status.expires_in_seconds <= 2.0
            assert {(n.node, n.role, n.epoch) for n in status.nodes} == {
                (leader.node, "leader", 1), (standby.node, "standby", 0)}
            assert not standby_task.done() and not holding.done()
            # The leader stops renewing (as the daemon stops: the renewals first) and steps
            # down. The standby takes over once the claim has expired, in the database's
            # clock, one epoch later.
            holding.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await holding
            await leader.close()
            leader.step_down()
            assert not leader.valid()
            _, _, _, expires_at = leadership_row(pg_url)
            async with asyncio.timeout(10):
                assert await standby_task == 2
            who, epoch2, since, _ = leadership_row(pg_url)
            assert (who, epoch2, standby.epoch, standby.role) == (standby.node, 2, 2, "leader")
            assert isinstance(since, datetime) and since > expires_at
            # Stepped down, the old leader holds nothing (a renewal cannot revive it); its
            # store, still on epoch 1, has its commits refused.
            assert (leader.epoch, leader.role) == (0, "standby")
            async with asyncio.timeout(5):
                with pytest.raises(Deposed, match="not renewed in time"):
                    await leader.hold()
            store.epoch = 1
            with pytest.raises(Deposed, match=f"node {standby.node} at epoch 2 leads"):
                await store.commit([lease()], [])
            store.epoch = standby.epoch
            await store.commit([lease()], [])
            status = await asyncio.to_thread(site_status, store, SITE)
            assert (status.leader, status.epoch) == (standby.node, 2)
            assert {n.node for n in status.nodes} == {"a", "b"}
        finally:
            for t in [*acquiring, *([holding] if holding else [])]:
                t.cancel()


async def test_a_leader_whose_row_was_taken_is_deposed_at_its_next_renewal(
        store: PgStateStore, pg_url: str) -> None:
    async with nodes(store, 1.0, "a") as (stop, [a]):
        async with asyncio.timeout(10):
            assert await a.acquire(stop) == 1
        holding = asyncio.create_task(a.hold())
        try:
            lead(pg_url, 2, "intruder")
            async with asyncio.timeout(5):
                with pytest.raises(Deposed, match="another node leads site site-a now "
                                                  r"\(this node's epoch was 1\)"):
                    await holding
        finally:
            holding.cancel()


async def test_release_hands_over_at_once(store: PgStateStore, pg_url: str) -> None:
    # A claim of 30 s: a standby taking over within 10 s owes it to the release.
    async with nodes(store, 30.0, "a", "b") as (stop, (a, b)):
        async with asyncio.timeout(10):
            assert await a.acquire(stop) == 1
        standing_by = asyncio.create_task(b.acquire(stop))
        try:
            async with asyncio.timeout(10):
                await b.saw_leader.wait()
            assert not standing_by.done()
            await a.release()
            assert not a.valid()
            async with asyncio.timeout(10):
                assert await standing_by == 2
            assert leadership_row(pg_url)[:2] == ("b", 2)
            status = await asyncio.to_thread(site_status, store, SITE)
            assert {(n.node, n.role) for n in status.nodes} == {("a", "stopped"),
                                                                ("b", "leader")}
            assert status.expires_in_seconds is not None and status.expires_in_seconds > 20
        finally:
            standing_by.cancel()


async def test_a_standby_stops_standing_by_when_told(store: PgStateStore) -> None:
    async with nodes(store, 30.0, "a", "b") as (stop, (a, b)):
        async with asyncio.timeout(10):
            assert await a.acquire(stop) == 1
        standing_by = asyncio.create_task(b.acquire(stop))
        async with asyncio.timeout(10):
            await b.saw_leader.wait()
        stop.set()
        async with asyncio.timeout(5):
            assert await standing_by is None
        assert (b.role, b.epoch) == ("standby", 0)


async def test_a_former_leader_standing_by_again_does_not_lead(store: PgStateStore) -> None:
    async with nodes(store, 30.0, "a", "b") as (stop, (a, b)):
        async with asyncio.timeout(10):
            assert await a.acquire(stop) == 1
        await a.release()
        async with asyncio.timeout(10):
            assert await b.acquire(stop) == 2
        again = asyncio.create_task(a.acquire(stop))
        async with asyncio.timeout(10):
            await a.saw_leader.wait()  # its first attempt found b leading
        stop.set()
        async with asyncio.timeout(5):
            assert await again is None
        assert (a.epoch, a.valid()) == (0, False)


async def test_a_busy_event_loop_does_not_cost_the_leadership(store: PgStateStore,
                                                              pg_url: str) -> None:
    """The renewals run in a thread of their own: a new term whose loop is held for
    twice the claim's lifetime (restoring tens of thousands of leases) still leads."""
    import time

    async with nodes(store, 1.0, "a") as (stop, (a,)):
        async with asyncio.timeout(10):
            assert await a.acquire(stop) == 1
        time.sleep(2.0)  # noqa: ASYNC251 - the fault: the event loop held, not a wait
        holding = asyncio.create_task(a.hold())
        await asyncio.wait({holding}, timeout=0.5)
        assert not holding.done() and a.valid() and a.epoch == 1
        assert leadership_row(pg_url)[:2] == ("a", 1)
        holding.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await holding


async def test_a_stuck_event_loop_lets_the_leadership_go(
        store: PgStateStore, pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop that has not run for LOOP_STALL_SECONDS stops the renewals: the claim
    expires and a standby can take over; when the loop runs again, the node learns it
    is deposed."""
    import time

    from broker.state import leadership

    monkeypatch.setattr(leadership, "LOOP_STALL_SECONDS", 1.0)
    async with nodes(store, 1.0, "a", "b") as (stop, (a, b)):
        a.loop_stall_seconds = 1.0
        async with asyncio.timeout(10):
            assert await a.acquire(stop) == 1
        time.sleep(2.5)  # noqa: ASYNC251 - the fault: the loop stuck past the limit
        with pytest.raises(Deposed, match="event loop has not run"):
            async with asyncio.timeout(5):
                await a.hold()
        assert (a.epoch, a.valid()) == (0, False)
        async with asyncio.timeout(10):
            assert await b.acquire(stop) == 2


async def test_a_lost_connection_is_replaced_when_asked(store: PgStateStore,
                                                        pg_url: str) -> None:
    """A standby's unused connection that the server ended (a restart) is replaced when
    it is elected, so its first read as the leader does not fail."""
    assert await store.reconnect_if_lost() is False
    sql(pg_url, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
                "datname = current_database() AND pid <> pg_backend_pid()")
    assert await store.reconnect_if_lost() is True
    [row] = await store.commit([lease()], [OutboxRow("t/after", b"1")])
    assert await store.pending() == [row]


# --- the election's faults (broker.state.leadership) ----------------------------------------------


def term_expiry(url: str) -> datetime:
    [(at,)] = sql(url, "SELECT expires_at FROM leadership_term WHERE site = %s", (SITE,))
    return at  # type: ignore[no-any-return]


def backend_pids(url: str, application: str) -> set[int]:
    return {pid for (pid,) in sql(url, "SELECT pid FROM pg_stat_activity WHERE "
                                       "application_name LIKE %s AND datname = current_database()",
                                  (application,))}


async def test_a_new_term_restoring_its_state_keeps_the_leadership(store: PgStateStore,
                                                                   pg_url: str) -> None:
    """Between the claim and `hold` a new leader reads the lease book and restores the
    broker: seconds with a few hundred thousand leases. The loop runs meanwhile (the
    reads are on the store's thread), so the renewals must go on, though `hold` has not
    started yet."""
    async with nodes(store, 1.0, "a") as (stop, (a,)):
        a.loop_stall_seconds = 1.0
        async with asyncio.timeout(10):
            assert await a.acquire(stop) == 1
        # The state being read: the loop free, `hold` not yet running, for 2.5 loop-stall
        # limits (the length of the load is the fault here, not a wait for an event).
        await asyncio.sleep(2.5)
        holding = asyncio.create_task(a.hold())
        await asyncio.wait({holding}, timeout=0.5)
        assert not holding.done() and a.valid() and a.epoch == 1
        assert leadership_row(pg_url)[:2] == ("a", 1)
        holding.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await holding


async def test_a_stalled_commit_neither_deposes_the_leader_nor_blocks_its_renewals(
        store: PgStateStore, pg_url: str) -> None:
    """A COMMIT that stalls after the fence (a synchronous replica away, an fsync stall)
    holds a share lock of the epoch row for as long as it stalls: the renewals write the
    term row, so the leader stays, and no standby takes over a term that is renewed."""
    async with nodes(store, 1.0, "a", "b") as (stop, (a, b)):
        async with asyncio.timeout(10):
            assert await a.acquire(stop) == 1
        store.epoch, store.boot_id = a.epoch, a.boot_id
        holding = asyncio.create_task(a.hold())
        fenced = threading.Event()
        assert store._db is not None
        real_fence = store._db._fence
        assert real_fence is not None

        def stalled_fence(db: PgDb) -> None:
            real_fence(db)  # the epoch checked, the row share-locked ...
            fenced.set()
            # ... and the server stalls before the COMMIT is through (busy in the
            # transaction, as a COMMIT waiting for a synchronous replica is).
            db.execute("SELECT pg_sleep(3.5)")

        store._db._fence = stalled_fence
        standing_by = asyncio.create_task(b.acquire(stop))
        commit = asyncio.ensure_future(store.commit([lease()], [OutboxRow("t/slow", b"1")]))
        try:
            assert await asyncio.to_thread(fenced.wait, 10)
            before = term_expiry(pg_url)
            # Three leadership lifetimes with the commit stalled.
            done, _ = await asyncio.wait({holding, standing_by}, timeout=3.0)
            assert not done, [t.exception() for t in done]
            assert a.valid() and term_expiry(pg_url) > before
            assert b.leader == ("a", 1) and b.role == "standby"
            assert not commit.done()
        finally:
            store._db._fence = real_fence
        async with asyncio.timeout(10):
            [row] = await commit
        assert row.topic == "t/slow"
        holding.cancel()
        standing_by.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await holding


async def test_the_leaders_store_connection_is_checked_at_each_renewal(
        store: PgStateStore, pg_url: str) -> None:
    """A short database blip (`pg_terminate_backend`, an idle timeout, a restart) ends
    the store's connection while the renewals' own lives: the leader replaces it within
    a renewal or two, not at its next commit hours later."""
    async with nodes(store, 1.0, "a") as (stop, (a,)):
        async with asyncio.timeout(10):
            assert await a.acquire(stop) == 1
        store.epoch, store.boot_id = a.epoch, a.boot_id
        holding = asyncio.create_task(a.hold())
        try:
            pid = await store.call(lambda db: db.conn.info.backend_pid)
            assert sql(pg_url, "SELECT pg_terminate_backend(%s, 5000)", (pid,)) == [(True,)]

            await until(lambda: bool(backend_pids(pg_url, "gpubroker") - {pid}),
                        "the store's connection replaced", timeout=5)
            assert await store.call(lambda db: db.conn.info.backend_pid) != pid
            assert not holding.done() and a.valid()
            [row] = await store.commit([lease()], [OutboxRow("t/after", b"1")])
            assert row.topic == "t/after"
        finally:
            holding.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await holding


async def test_an_epoch_issued_twice_is_told_apart_by_the_boot_id(store: PgStateStore,
                                                                  pg_url: str) -> None:
    """A failover of an asynchronously replicated PostgreSQL that lost the last WAL can
    issue the same epoch to another node: the renewals and the fence compare the boot id
    too, so the first holder of that epoch is deposed and commits nothing."""
    async with nodes(store, 1.0, "a") as (stop, (a,)):
        async with asyncio.timeout(10):
            assert await a.acquire(stop) == 1
        store.epoch, store.boot_id = a.epoch, a.boot_id
        holding = asyncio.create_task(a.hold())
        lead(pg_url, 1, "b", boot="boot-b", expires_in=30)  # epoch 1 again, b's
        with pytest.raises(Deposed, match="another node leads site site-a now"):
            async with asyncio.timeout(5):
                await holding
        with pytest.raises(Deposed, match="node b at epoch 1 leads"):
            await store.commit([lease()], [OutboxRow("t/lost", b"1")])
        assert sql(pg_url, "SELECT count(*) FROM outbox") == [(0,)]


async def test_a_lapsed_term_is_never_revived_by_a_renewal(store: PgStateStore,
                                                           pg_url: str) -> None:
    """A renewal in flight when the term lapsed in the database's clock must not extend
    it: a standby may be claiming it."""
    async with nodes(store, 2.0, "a") as (stop, (a,)):
        async with asyncio.timeout(10):
            assert await a.acquire(stop) == 1
        holding = asyncio.create_task(a.hold())
        sql(pg_url, "UPDATE leadership_term SET expires_at = now() - interval '1 second'")
        with pytest.raises(Deposed):
            async with asyncio.timeout(5):
                await holding
        assert term_expiry(pg_url) < datetime.now(term_expiry(pg_url).tzinfo)


async def test_a_won_claim_survives_a_failing_heartbeat(store: PgStateStore,
                                                        pg_url: str) -> None:
    """The claim is won before the node's heartbeat and name check: their failure must
    not throw the claim away (the site would have no leader until the term expired)."""
    sql(pg_url, "ALTER TABLE nodes RENAME TO nodes_away")
    try:
        async with nodes(store, 1.0, "a") as (stop, (a,)):
            async with asyncio.timeout(2.5):
                assert await a.acquire(stop) == 1
            assert a.valid() and leadership_row(pg_url)[:2] == ("a", 1)
            await a.release()
    finally:
        sql(pg_url, "ALTER TABLE nodes_away RENAME TO nodes")


async def test_a_leader_deposed_without_a_successor_releases_its_term(
        store: PgStateStore, pg_url: str) -> None:
    """A leader that deposes itself (its loop stuck past the limit) ends its term in the
    database when it stops: a standby takes over at once, not at the term's expiry."""
    import time

    async with nodes(store, 30.0, "a", "b") as (stop, (a, b)):
        a.loop_stall_seconds, a.renew_every = 1.0, 0.2  # a term of 30 s, renewed often
        async with asyncio.timeout(10):
            assert await a.acquire(stop) == 1
        standing_by = asyncio.create_task(b.acquire(stop))
        try:
            time.sleep(1.5)  # noqa: ASYNC251 - the fault: the loop stuck past the limit
            with pytest.raises(Deposed, match="event loop has not run"):
                async with asyncio.timeout(15):
                    await a.hold()
            await a.close()  # what the daemon does as it stops
            async with asyncio.timeout(10):  # the term had 25 s or more to run
                assert await standing_by == 2
        finally:
            standing_by.cancel()


async def test_a_dropped_renewal_connection_is_replaced_at_once(store: PgStateStore,
                                                                pg_url: str) -> None:
    """One dropped connection must not depose a healthy leader: the renewing thread
    connects again at once, with timeouts inside the renewal period."""
    async with nodes(store, 1.5, "a") as (stop, (a,)):
        async with asyncio.timeout(10):
            assert await a.acquire(stop) == 1
        holding = asyncio.create_task(a.hold())
        try:
            await until(lambda: bool(backend_pids(pg_url, "gpubroker-renewal %")),
                        "the renewal connection", timeout=5)
            first = backend_pids(pg_url, "gpubroker-renewal %")
            for pid in first:
                sql(pg_url, "SELECT pg_terminate_backend(%s, 5000)", (pid,))
            await until(lambda: bool(backend_pids(pg_url, "gpubroker-renewal %") - first),
                        "a new renewal connection", timeout=5)
            done, _ = await asyncio.wait({holding}, timeout=1.5)
            assert not done and a.valid()
        finally:
            holding.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await holding


# --- the leader's polls shared with the standbys --------------------------------------------------


async def test_a_shared_poll_comes_back_as_it_was_and_only_while_fresh(
        store: PgStateStore, pg_url: str) -> None:
    from broker.model import Market, Target

    reserved = replace(offer("r-a", cloud="private", region="r", gpu="A100-80GB", price=0.0,
                             market=Market.RESERVED),
                       targets=(Target("s1", 1, 1), Target("s2", 1, 0)), draining=("s2",),
                       quota_group="private:r:A100", quota_units=8)
    offers = [offer(price=31.2, capacity=3, quota_headroom=16), reserved,
              replace(offer("us-east-1b", gpu="L4", gpus=1, price=None,
                            interruption_rate=0.01, availability=0.5), gpu_known=False,
                      vcpus=None, memory_gb=None, gpu_memory_gb=None)]
    lead(pg_url, 3, "n1", boot="b1")
    store.epoch, store.boot_id = 3, "b1"
    await store.save_slice(("aws", "us-east-1"), T0, offers)
    await store.save_slice(("gcp", "us-central1"), T0 - timedelta(minutes=10), offers[:1])
    shared = await store.load_slices(T0 - timedelta(minutes=5))
    assert shared == [(("aws", "us-east-1"), T0, offers)]
    # A newer poll of a slice replaces its older one.
    await store.save_slice(("aws", "us-east-1"), T0 + timedelta(minutes=1), offers[1:])
    assert await store.load_slices(T0) == [(("aws", "us-east-1"), T0 + timedelta(minutes=1),
                                            offers[1:])]
    # A deposed leader shares nothing more.
    lead(pg_url, 4, "n2", boot="b2")
    with pytest.raises(Deposed):
        await store.save_slice(("aws", "us-east-1"), T0 + timedelta(minutes=2), [])
    assert len((await store.load_slices(T0))[0][2]) == 2


async def test_the_lease_book_is_followed_change_by_change(store: PgStateStore,
                                                           pg_url: str) -> None:
    """A standby reads the whole book once, then only what changed: in order, each
    change once, a refused (deposed) write never."""
    book = LeaseBook()
    a, b = (book.create(request(r), placement(), lease_seconds=600, cap=None, now=T0)
            for r in ("r1", "r2"))
    ended = book.end(book.create(request("r0"), placement(), lease_seconds=600, cap=None,
                                 now=T0 - timedelta(days=3)).lease_id,
                     LeaseState.RELEASED, T0 - timedelta(days=3))
    lead(pg_url, 1, "n1", boot="b1")
    store.epoch, store.boot_id = 1, "b1"
    await store.commit([a, b, ended], [])
    cursor, whole = await store.lease_changes(-1, ended_since=T0 - timedelta(days=1))
    assert sorted(le.request_id for le in whole) == ["r1", "r2"]  # the old ended one: no
    # Without `ended_since`, the active leases only (what a standby follows).
    assert sorted(le.request_id for le in (await store.lease_changes(-1))[1]) == ["r1", "r2"]
    assert len((await store.lease_changes(-1, ended_since=T0 - timedelta(days=4)))[1]) == 3
    assert await store.lease_changes(cursor, ended_since=T0) == (cursor, [])
    renewed = book.renew(a.lease_id, "sched-a", T0 + timedelta(seconds=30))
    c = book.create(request("r3"), placement(), lease_seconds=600, cap=None, now=T0)
    await store.commit([renewed], [])
    await store.commit([c], [])
    lead(pg_url, 2, "n2", boot="b2")  # deposed: this write is refused, never followed
    with pytest.raises(Deposed):
        await store.commit([book.renew(b.lease_id, "sched-a", T0 + timedelta(seconds=60))], [])
    later, changed = await store.lease_changes(cursor, ended_since=T0)
    assert later > cursor
    assert changed == [renewed, c]
    assert await store.lease_changes(later, ended_since=T0) == (later, [])


async def test_a_dead_leaders_term_is_taken_over_before_it_expires(
        store: PgStateStore, pg_url: str) -> None:
    """A leader whose process ended (its database sessions gone at once) leaves a term of
    30 s: a standby that saw it alive takes it over within a second or two, not at the
    expiry; the dead leader's commits are refused."""
    async with nodes(store, 30.0, "a", "b") as (stop, (a, b)):
        a.renew_every = b.renew_every = 0.25  # a 30 s term, renewed and watched often
        wills: set[str] = set()  # the boot ids whose `offline` b saw on the bus
        b.gone = wills.__contains__
        async with asyncio.timeout(10):
            assert await a.acquire(stop) == 1
        holding = asyncio.create_task(a.hold())
        standing_by = asyncio.create_task(b.acquire(stop))
        try:
            async with asyncio.timeout(10):
                await b.saw_leader.wait()
            # Alive, renewing, its sessions there: b waits, though it keeps looking.
            done, _ = await asyncio.wait({standing_by}, timeout=2.0)
            assert not done and b._holder_seen == a.boot_id
            # a's process ends: its renewals stop and every connection of it closes,
            # without a release (the kernel closes a killed process's sockets).
            a._stop_renewing.set()
            holding.cancel()
            renewer, a._renewer = a._renewer, None
            assert renewer is not None
            await asyncio.to_thread(renewer.join, 5)
            await a._drop()
            a._held = 0
            # Its database sessions alone gone: not dead yet (it might be cut off from the
            # database only); its will on the bus as well: dead.
            done, _ = await asyncio.wait({standing_by}, timeout=1.5)
            assert not done
            wills.add(a.boot_id)
            died = asyncio.get_running_loop().time()
            async with asyncio.timeout(10):
                assert await standing_by == 2
            assert asyncio.get_running_loop().time() - died < 3.0  # the term had ~30 s
            assert term_expiry(pg_url) > datetime.now(term_expiry(pg_url).tzinfo) + \
                timedelta(seconds=20)  # b's own new term
            store.epoch, store.boot_id = 1, a.boot_id
            with pytest.raises(Deposed):
                await store.commit([lease()], [])
        finally:
            holding.cancel()
            standing_by.cancel()


async def test_a_living_leader_whose_sessions_blip_keeps_its_term(
        store: PgStateStore, pg_url: str) -> None:
    """Every session of the leader ended at once (a proxy reset) but the process lives:
    its renewal connects again within a renewal, and a standby that counts on a death
    only after 0.5 s of absence does not take the term."""
    async with nodes(store, 30.0, "a", "b") as (stop, (a, b)):
        a.renew_every = b.renew_every = 0.1
        b.claim_every = 0.05
        b.gone = lambda boot: True  # even with its will seen (a bus blip as well)
        async with asyncio.timeout(10):
            assert await a.acquire(stop) == 1
        holding = asyncio.create_task(a.hold())
        standing_by = asyncio.create_task(b.acquire(stop))
        try:
            async with asyncio.timeout(10):
                await b.saw_leader.wait()
            await until(lambda: bool(backend_pids(pg_url, "gpubroker-renewal %")),
                        "the renewal connection", timeout=5)
            sql(pg_url, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
                        "application_name LIKE %s", (f"% {a.boot_id}",))
            done, _ = await asyncio.wait({standing_by, holding}, timeout=3.0)
            assert not done and a.valid() and leadership_row(pg_url)[:2] == ("a", 1)
        finally:
            holding.cancel()
            standing_by.cancel()
