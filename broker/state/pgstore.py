"""The state store on PostgreSQL: the same tables as on SQLite, for high availability.

`state.url: postgresql://…` puts the lease book, the outbox and the market history in a
PostgreSQL database that every daemon of the site shares; `broker.state.leadership` elects the one
that leads. The store follows `broker.state.store`'s model: one connection used from one
thread, a lease change and its events in one transaction, `StoreFailed` when the server
refuses (or cannot be reached). The schema is `broker.state.store`'s, in PostgreSQL's types,
at the same version number; migrations run at open, under a transaction-scoped advisory
lock so that two daemons starting at once apply them once.

**Fencing.** While this daemon leads, `epoch` is its leadership epoch, and every write
transaction, just before its COMMIT, reads the site's leadership row `FOR SHARE` and is
refused (`Deposed`) unless the epoch there is still its own. A standby's takeover
updates that row, so it waits for a commit that has passed the fence, and every later
commit of the old leader fails in the database. The lock is taken last, so a writer
frozen in the middle of its writes holds up no takeover (one frozen between the fence
and the COMMIT is idle in a transaction: `idle_in_transaction_session_timeout`, the
claim's lifetime, ends it). Each lease and outbox row records the epoch that wrote it.

Credentials: the password comes from `state.password_file` or libpq's own sources
(`PGPASSWORD`, `~/.pgpass`, `PGSERVICEFILE`); a password in the URL is refused by the
configuration. TLS is libpq's (`sslmode`, `sslrootcert` … in the URL).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import orjson
import structlog

from broker.model import Lease, Offer, iso
from broker.state.pgdb import (
    PG_UPSERT_LEASE,
    PgDb,
    connect,
    describe_url,
    migrate,
    pg_sql,
)
from broker.state.schema import (
    INSERT_OUTBOX,
    UPSERT_SCHEDSEQ,
    first_part,
    lease_from,
    lease_row,
    outbox_row,
)
from broker.state.store import Deposed, OneThreadStore, StoreFailed
from broker.wire.messages import OutboxRow

if TYPE_CHECKING:
    import psycopg

log = structlog.get_logger("gpubroker.store")

T = TypeVar("T")

class PgStateStore(OneThreadStore[PgDb]):
    """The state store on PostgreSQL (see the module docstring)."""

    def __init__(self, url: str, *, site: str, password_file: Path | None = None,
                 leadership_seconds: float = 3.0) -> None:
        super().__init__("postgres")
        self.url = url
        self.site = site
        self.password_file = password_file
        self.epoch = 0
        self.boot_id = ""
        """The leader's boot id, with `epoch`: the fence tells an epoch issued twice (a
        failover of an asynchronously replicated server that lost the last WAL) apart."""
        self._leadership_seconds = leadership_seconds

    @property
    def name(self) -> str:
        return describe_url(self.url)

    def connect(self, *, options: str = "") -> psycopg.Connection[Any]:
        return connect(self.url, password_file=self.password_file, options=options)

    def reader(self) -> PgDb:
        return PgDb(self.connect(options="-c default_transaction_read_only=on"))

    async def open(self) -> None:
        """Connect and migrate. Raises `RuntimeError` for a schema newer than this code
        or a database that holds another site's state, `psycopg.Error` when the server
        refuses."""
        self._db = await self._thread.run(self._open_db)

    def _open_db(self) -> PgDb:
        """A new connection, migrated (on the store's thread)."""
        # A transaction left open (a frozen or stuck process) must not hold the
        # leadership row for longer than a takeover may wait.
        idle_ms = max(1000, int(self._leadership_seconds * 1000))
        options = f"-c idle_in_transaction_session_timeout={idle_ms} -c statement_timeout=30000"
        conn = self.connect(options=options)
        db = PgDb(conn, self._check_epoch)
        try:
            migrate(db, self.site)
        except BaseException:
            conn.close()
            raise
        return db

    async def close(self) -> None:
        if self._db is not None:
            db, self._db = self._db, None
            try:
                await self._thread.run(db.close)
            except Exception as exc:  # closing a broken connection: nothing to keep
                log.debug("closing the database connection failed", error=str(exc))
        self._thread.shutdown(wait=True)

    async def reconnect_if_lost(self) -> bool:
        """Replace the connection if it no longer answers (a database restart while it
        sat unused, as a standby's does); True if it was replaced. Raises `StoreFailed`
        when a new one cannot be made."""
        import psycopg

        try:
            await self._run(lambda db: db.execute("SELECT 1"))
            return False
        except psycopg.Error as exc:
            log.info("the database connection was lost; connecting again", database=self.name,
                     error=type(exc).__name__, detail=str(exc).strip()[:300])

        def swap() -> None:
            # On the store's thread, in one step: no other operation of the store can
            # run between the old connection's end and the new one's start.
            old = self._db
            if old is not None:
                try:
                    old.close()
                except Exception as exc:  # it is broken: closing may fail as well
                    log.debug("closing the lost connection failed", error=str(exc))
            self._db = self._open_db()

        try:
            await self._thread.run(swap)
        except (psycopg.Error, OSError, RuntimeError) as exc:
            raise StoreFailed(f"{self.name}: connecting again failed: "
                              f"{str(exc).strip()[:300]}") from exc
        return True

    def _check_epoch(self, db: PgDb) -> None:
        """The fence (see the module docstring); runs last in every write transaction."""
        if self.epoch <= 0:
            return
        row = db.execute("SELECT epoch, node, boot_id FROM leadership WHERE site=? FOR SHARE",
                         (self.site,)).fetchone()
        if row is None or int(row[0]) != self.epoch or (self.boot_id and
                                                        row[2] != self.boot_id):
            now = "nobody" if row is None else f"node {row[1]} at epoch {row[0]}"
            raise Deposed(f"{self.name}: leadership of site {self.site} lost: this node's "
                          f"epoch is {self.epoch}, {now} leads")

    def _deposed_instead(self, db: PgDb, exc: Exception) -> None:
        """A write refused before the fence ran (a unique key, a constraint) can be the
        mark of a newer leader: its history holds rows this node's writes now meet (the
        same request decided again after a failover). Reads the fence on its own and
        raises `Deposed` from `exc` if this node no longer leads, so the node steps down
        for the reason, not the symptom. Nothing if the connection is gone (the caller
        handles that) or the node still leads (`exc` is the error then)."""
        if self.epoch <= 0 or db.conn.broken or db.in_transaction:
            return
        try:
            db.begin()
            try:
                self._check_epoch(db)
            finally:
                db.rollback()
        except Deposed as deposed:
            raise deposed from exc
        except Exception as other:  # cannot tell: the write's own error stands
            log.debug("reading the fence after a refused write failed", error=str(other))

    def _failed(self, what: str, exc: Exception) -> StoreFailed:
        sqlstate = getattr(exc, "sqlstate", None)
        return StoreFailed(f"{self.name}: {what} failed: {str(exc).strip()}"
                           + (f" (SQLSTATE {sqlstate})" if sqlstate else ""))

    async def commit(self, leases: Iterable[Lease], rows: Sequence[OutboxRow],
                     schedseqs: Mapping[str, int] | None = None) -> list[OutboxRow]:
        import psycopg

        epoch = self.epoch
        lease_rows = [lease_row(lease, epoch) for lease in leases]
        seqs = list((schedseqs or {}).items())
        outbox = [outbox_row(r, epoch) for r in rows]

        def tx(db: PgDb) -> list[OutboxRow]:
            conn = db.conn
            ids: list[int] = []
            db.commit_sent = False
            try:
                # One round trip for the writes (a pipeline), one for the fence and the
                # COMMIT (`PgDb.commit`).
                with conn.pipeline():
                    conn.execute("BEGIN")
                    if lease_rows:
                        conn.cursor().executemany(pg_sql(PG_UPSERT_LEASE), lease_rows)
                    if seqs:
                        conn.cursor().executemany(pg_sql(UPSERT_SCHEDSEQ), seqs)
                    cur = conn.cursor()
                    if outbox:
                        cur.executemany(pg_sql(INSERT_OUTBOX + " RETURNING id"), outbox,
                                        returning=True)
                if outbox:
                    while True:
                        ids.append(int(cur.fetchone()[0]))  # type: ignore[index]
                        if not cur.nextset():
                            break
                db.commit()
            except BaseException as failed:
                try:
                    db.rollback()
                except Exception as exc:  # the connection is gone: the error that matters
                    log.debug("rollback failed", error=str(exc))
                if isinstance(failed, psycopg.Error):
                    self._deposed_instead(db, failed)
                raise
            return [OutboxRow(r.topic, r.payload, r.qos, r.retain, r.props, i)
                    for r, i in zip(rows, ids, strict=True)]

        try:
            return await self._run(tx)
        except psycopg.Error as exc:
            db = self._db
            if db is None or db.commit_sent or not db.conn.broken:
                raise self._failed("commit", exc) from exc
            # The connection was lost before the COMMIT was sent (a short database
            # restart, `pg_terminate_backend`, an idle timeout): nothing was committed,
            # so the same transaction is tried once more on a new connection.
            log.info("the database connection was lost before a commit; trying it again",
                     database=self.name, error=type(exc).__name__)
        await self._reconnect_within(self._leadership_seconds)
        try:
            return await self._run(tx)
        except psycopg.Error as exc:
            raise self._failed("commit", exc) from exc

    async def _reconnect_within(self, seconds: float) -> None:
        """Connect again, trying every 0.1 s for up to `seconds`: a database restarting
        (shutting down, starting) refuses connections for a moment. `StoreFailed` if it
        still does then; a leader that cannot commit for longer loses its term anyway."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while True:
            try:
                await self.reconnect_if_lost()
                return
            except StoreFailed:
                if loop.time() + 0.1 > deadline:
                    raise
            await asyncio.sleep(0.1)

    async def ack(self, ids: Sequence[int]) -> None:
        """Forget acknowledged outbox rows. Best effort: a row not deleted is sent again
        by the next leader, and subscribers drop duplicates by event id."""
        import psycopg

        if not ids:
            return

        def delete(db: PgDb) -> None:
            db.execute("DELETE FROM outbox WHERE id = ANY(?)", (list(ids),))

        try:
            await self._run(delete)
        except psycopg.Error as exc:
            log.warning("outbox rows not deleted; they are sent again later",
                        rows=len(ids), error=str(exc).strip())

    async def save_slice(self, slice_id: tuple[str, str], polled_at: datetime,
                         offers: Sequence[Offer]) -> None:
        """Share the leader's last poll of a slice with the standbys (fenced like every
        write: a deposed leader's poll is refused). Best effort: a slice not saved costs
        a new leader only the wait for its own first poll of it."""
        import psycopg

        body = orjson.dumps([o.to_record() for o in offers])

        def tx(db: PgDb) -> None:
            db.begin()
            try:
                db.execute("INSERT INTO offer_slices VALUES (?, ?, ?, ?, ?) ON CONFLICT "
                           "(cloud, region) DO UPDATE SET polled_at = excluded.polled_at, "
                           "offers = excluded.offers, leader_epoch = excluded.leader_epoch",
                           (*slice_id, polled_at, body, self.epoch))
                db.commit()
            except BaseException:
                db.rollback()
                raise

        try:
            await self._run(tx)
        except psycopg.Error as exc:
            log.warning("the poll was not shared with the standbys", slice=list(slice_id),
                        error=type(exc).__name__, detail=str(exc).strip()[:300])

    async def load_slices(self, since: datetime
                          ) -> list[tuple[tuple[str, str], datetime, list[Offer]]]:
        """The last shared poll of each slice made at or after `since`."""
        def q(db: PgDb) -> list[tuple[tuple[str, str], datetime, list[Offer]]]:
            return [((cloud, region), at, [Offer.from_record(r) for r in orjson.loads(body)])
                    for cloud, region, at, body in db.execute(
                        "SELECT cloud, region, polled_at, offers FROM offer_slices "
                        "WHERE polled_at >= ?", (since,))]

        return await self._read("offers read", q)

    async def lease_changes(self, after: int, *, ended_since: datetime | None = None
                            ) -> tuple[int, list[Lease]]:
        """Follow the lease book (a standby): the leases written after change number
        `after`, and the number to ask after next time. `after` < 0: the whole book (the
        active leases, and those ended at or after `ended_since` if given), as `leases`
        reads it."""
        def q(db: PgDb) -> tuple[int, list[Lease]]:
            # The highest number first: a change committed meanwhile is read now and
            # again next time, never missed.
            row = db.execute("SELECT COALESCE(max(change), 0) FROM leases").fetchone()
            top = int(row[0]) if row else 0
            if after < 0 and ended_since is None:
                rows = db.execute("SELECT body FROM leases WHERE state = 'active'")
            elif after < 0:
                rows = db.execute("SELECT body FROM leases WHERE state = 'active' OR "
                                  "updated_at >= ?", (iso(ended_since),))
            else:
                rows = db.execute("SELECT body FROM leases WHERE change > ? AND change <= ? "
                                  "ORDER BY change", (after, top))
            return top, [lease_from(json.loads(b)) for (b,) in rows]

        return await self._read("lease book read", q)

    async def find_leases(self, keys: Sequence[tuple[str, str]]
                          ) -> dict[tuple[str, str], list[Lease]]:
        unique = list(dict.fromkeys(keys))  # a key given twice would join its rows twice
        if not unique:
            return {}

        def q(db: PgDb) -> dict[tuple[str, str], list[Lease]]:
            out: dict[tuple[str, str], list[Lease]] = {}
            rows = db.execute(
                "SELECT l.body FROM leases l JOIN unnest(?::text[], ?::text[]) AS k(s, r) "
                "ON l.scheduler = k.s AND l.request_id = k.r ORDER BY l.part",
                ([k[0] for k in unique], [k[1] for k in unique]))
            for (b,) in rows:
                lease = lease_from(json.loads(b))
                out.setdefault((lease.scheduler, lease.request_id), []).append(lease)
            return out

        return await self._read("lease lookup", q)

    async def find_lease(self, scheduler: str, request_id: str) -> Lease | None:
        return first_part(await self.find_leases([(scheduler, request_id)]), scheduler, request_id)
