"""High availability: one leader per site, elected in PostgreSQL, fenced by an epoch.

Every daemon of a site (same `site`, same `state.url`) runs `Leadership`. The site's
leadership is two rows: `leadership` (epoch, node, boot id), written only by a claim, and
`leadership_term` (epoch, boot id, expiry in the database's clock), written by claims,
renewals and releases:

* A **standby** tries, every `claim_every` seconds, to take the term once it has
  expired (`expires_at < now()`) and, in the same transaction, to raise the epoch by
  one; two standbys starting at once cannot both win. A term whose holder has died (its
  will seen on the MQTT bus and its database sessions, named with its boot id, gone for
  `DEAD_AFTER_SECONDS` after being seen) is taken over without waiting for the expiry.
* The **leader** renews the term's expiry every `seconds / 3`, from a thread and a
  connection of their own (a busy event loop must not let the claim lapse; a loop that
  has not run for `loop_stall_seconds` stops the renewals, so a stuck daemon cannot keep
  it; a timer on the loop says it runs, from the claim on). A renewal names the epoch
  and the boot id, and renews only a term that has not expired: a lapsed term is never
  revived, and an epoch issued twice (a PostgreSQL failover that lost the last WAL) is
  told apart by the boot id. The leader counts itself leader only until `deadline`: the
  local monotonic time at which it sent its last successful renewal, plus `seconds`,
  minus a margin (`seconds / 3`, at least 0.5 s). The database's expiry is at least
  `seconds` after that same moment, so the leader stops acting before any standby can
  start. A leader that cannot renew in time (database lost, process frozen by
  `SIGSTOP`, renewal refused because another took over) raises `Deposed`, ends its
  term in the database if it is still its own (a standby need not wait out the rest)
  and stands by again.
* **Fencing** in the database (`broker.state.pgstore`): every write transaction checks the
  epoch and boot id under a share lock of the `leadership` row; a claim's update of that
  row waits for a commit in flight, and every later commit of the old leader fails.
  Renewals write the other row, so a COMMIT that stalls after the fence (a synchronous
  replica away, an fsync stall) holds up no renewal. **Fencing on the bus**: the leader
  publishes (and connects) only while `valid()`; the leader's MQTT client id is the
  site's, so a new leader's connection also ends the old one's at the MQTT server.

Only the database's clock is compared with the expiry; a node's clock may be wrong.
The `nodes` table lists every node with its role, epoch and last heartbeat
(`gpubroker status`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import structlog

from broker import __version__
from broker.model import utcnow
from broker.state.pgdb import connect
from broker.state.store import Deposed, StoreFailed
from gpubroker_client.files import read_secret

if TYPE_CHECKING:
    import psycopg

    from broker.state.pgstore import PgStateStore

log = structlog.get_logger("gpubroker.ha")

_TAKE_TERM = """
INSERT INTO leadership_term AS t (site, epoch, boot_id, expires_at)
VALUES (%(site)s, 0, %(boot)s, now() + make_interval(secs => %(ttl)s))
ON CONFLICT (site) DO UPDATE SET boot_id = excluded.boot_id, expires_at = excluded.expires_at
WHERE t.expires_at < now() OR t.boot_id = %(dead)s
RETURNING site
"""
_TERM = """
SELECT t.epoch, t.boot_id, t.expires_at >= now(),
       EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.application_name IN
               ('gpubroker-election ' || t.boot_id, 'gpubroker-renewal ' || t.boot_id)),
       EXTRACT(EPOCH FROM now() - pg_postmaster_start_time())
FROM leadership_term t WHERE t.site = %(site)s
"""
"""The term, and whether its holder still has a session with the database (its election
or renewal connection, named with its boot id), and how long the server has run."""
DEAD_AFTER_SECONDS = 0.5
"""A holder that is gone from both sides — its will (`offline`, its boot id) seen on the
MQTT bus, and every database session of it (named with its boot id), seen alive earlier
in its term, gone this long — has died: its process ended, and the kernel closed its
connections. A standby then takes its term over without waiting for the expiry. A leader
cut off from only one side (the database, or the bus) is not taken for dead: it stops at
its own deadline, as before. Not within `renew_every` + `margin` of the database
server's start (a restart ends every session), nor when the holder was never seen (a
server that hides other sessions' names, a pooler in between): then the term's expiry
decides. A living leader taken for dead loses nothing but its term: its next renewal or
commit is refused by the epoch."""
_LOCAL_COMMIT = "-c synchronous_commit=local"
"""The election's own statements do not wait for a synchronous replica: a COMMIT that
waits for one that is away would hold the term row (a standby's claim attempt locks it
even when the term still runs) and stall every renewal behind it. An epoch lost with
the last WAL in a failover is told apart by the boot id."""
_CLAIM = """
INSERT INTO leadership AS l (site, epoch, node, boot_id, since)
VALUES (%(site)s, 1, %(node)s, %(boot)s, now())
ON CONFLICT (site) DO UPDATE SET epoch = l.epoch + 1, node = excluded.node,
    boot_id = excluded.boot_id, since = now()
RETURNING epoch
"""
_SET_TERM_EPOCH = "UPDATE leadership_term SET epoch = %(epoch)s WHERE site = %(site)s"
_RENEW = """
UPDATE leadership_term SET expires_at = now() + make_interval(secs => %(ttl)s)
WHERE site = %(site)s AND epoch = %(epoch)s AND boot_id = %(boot)s AND expires_at > now()
RETURNING epoch
"""
_RELEASE = """
UPDATE leadership_term SET expires_at = now()
WHERE site = %(site)s AND epoch = %(epoch)s AND boot_id = %(boot)s
"""
_HEARTBEAT = """
INSERT INTO nodes (node, boot_id, role, epoch, version, started_at, seen_at)
VALUES (%(node)s, %(boot)s, %(role)s, %(epoch)s, %(version)s, %(started)s, now())
ON CONFLICT (node) DO UPDATE SET boot_id = excluded.boot_id, role = excluded.role,
    epoch = excluded.epoch, version = excluded.version, started_at = excluded.started_at,
    seen_at = now()
"""


_takeovers = 0
_own_boots: set[str] = set()  # this process's boots, earlier terms included
LOOP_STALL_SECONDS = 10.0
"""The renewals stop when the event loop has not run for this long: a daemon whose loop
is stuck must not keep the site's leadership (a slow start of a term, with tens of
thousands of leases to restore, stalls it for a few seconds)."""


HEARTBEAT_EVERY = 3
"""The leader's row in `nodes` is written every this many renewals (`gpubroker status`
reads it; a standby's name check looks back two leadership lifetimes)."""


class Leadership:
    """This node's part in the site's election (see the module docstring)."""

    def __init__(self, store: PgStateStore, *, site: str, node: str, boot_id: str,
                 seconds: float = 3.0, loop_stall_seconds: float = LOOP_STALL_SECONDS,
                 gone: Callable[[str], bool] | None = None) -> None:
        self.store = store
        self.site = site
        self.node = node
        self.boot_id = boot_id
        self.seconds = seconds
        self.renew_every = seconds / 3
        self.claim_every = min(0.25, seconds / 8)
        self.margin = max(0.5, seconds / 3)
        self.loop_stall_seconds = loop_stall_seconds
        self.gone = gone
        """Whether the node of this boot id said on the MQTT bus that it is gone (its will,
        `offline`, seen by this standby): with its database sessions gone as well, its
        process has ended (`DEAD_AFTER_SECONDS`). None: never taken for dead early."""
        self.epoch = 0
        self.deadline = 0.0
        self.role = "standby"
        self.database_ok = False
        self.leader: tuple[str, int] | None = None
        """The leader last seen in the database while standing by: (node, epoch)."""
        self.started_at = utcnow()
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._complained = False
        self._name_checked = False
        self._renewer: threading.Thread | None = None
        self._stop_renewing = threading.Event()
        self._lost: str | None = None  # why the renewals ended (the renewing thread)
        self._loop_seen = time.monotonic()  # when the event loop last ran (`_beat`)
        self._pulse: asyncio.TimerHandle | None = None
        self._held = 0  # the epoch of the term this node holds in the database, until released
        self._holder_seen = ""  # standing by: the boot id of a holder seen alive
        self._holder_gone_since: float | None = None  # ... and since when it is gone
        _own_boots.add(boot_id)

    @property
    def takeovers(self) -> int:
        """How many times this process took the leadership of its site (its earlier
        daemons' terms included: a node that stepped down carries on counting)."""
        return _takeovers

    def valid(self) -> bool:
        """Whether this node may act as the leader now (publish, connect as the site)."""
        return self.epoch > 0 and time.monotonic() < self.deadline

    def time_left(self) -> float:
        """Seconds this node may still act as the leader without another renewal."""
        return max(0.0, self.deadline - time.monotonic()) if self.epoch > 0 else 0.0

    def _args(self, **extra: Any) -> dict[str, Any]:
        return {"site": self.site, "node": self.node, "boot": self.boot_id, "dead": "",
                "ttl": self.seconds, "epoch": self.epoch, "role": self.role,
                "version": __version__, "started": self.started_at, **extra}

    def _lock_ms(self) -> int:
        """A statement of the election waits at most this long for a row lock: a claim
        waits for a commit in flight, not for a stuck session."""
        return max(200, int(self.seconds * 1000 / 3))

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            import psycopg

            kwargs: dict[str, Any] = {}
            if self.store.password_file is not None:
                kwargs["password"] = read_secret(self.store.password_file)
            ms = self._lock_ms()
            # tcp_user_timeout: a server that stops answering (a partition) is given up
            # on within the claim's lifetime, not after the kernel's retransmissions.
            self._conn = await psycopg.AsyncConnection.connect(
                self.store.url, autocommit=True, connect_timeout=max(1, round(self.seconds)),
                application_name=f"gpubroker-election {self.boot_id}", keepalives=1,
                keepalives_idle=5, keepalives_interval=2, keepalives_count=3,
                tcp_user_timeout=int(self.seconds * 1000),
                options=f"-c lock_timeout={ms} -c statement_timeout={ms * 2} "
                        f"{_LOCAL_COMMIT}", **kwargs)
        return self._conn

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                await conn.close()
            except Exception as exc:  # a broken connection may not close cleanly
                log.debug("closing the election connection failed", error=str(exc))

    def _trouble(self, what: str, exc: BaseException) -> None:
        self.database_ok = False
        if not self._complained:
            self._complained = True
            log.warning(f"{what} failed", database=self.store.name,
                        error=type(exc).__name__, detail=str(exc).strip()[:300])

    async def _claim(self, conn: psycopg.AsyncConnection[Any]) -> int | None:
        """Take the site's term if it has expired, raising the epoch, in one transaction;
        the new epoch, or None (another node's term runs). The epoch row waits for a
        commit that has passed its fence; the term row is the one renewals write, so a
        stalled commit of the leader never holds up its renewals."""
        # A plain read first: while the term runs (nearly always), no row is locked.
        cur = await conn.execute(_TERM, self._args())
        term = await cur.fetchone()
        dead = ""
        if term is not None and term[2]:
            dead = self._dead_holder(str(term[1]), bool(term[3]), float(term[4]))
            if not dead:
                return None
            log.info("the leader's database sessions are gone: taking its term over "
                     "before it expires", epoch=int(term[0]))
        async with conn.transaction():
            cur = await conn.execute(_TAKE_TERM, self._args(dead=dead))
            if await cur.fetchone() is None:
                return None
            cur = await conn.execute(_CLAIM, self._args())
            row = await cur.fetchone()
            assert row is not None  # an upsert returns its row
            epoch = int(row[0])
            await conn.execute(_SET_TERM_EPOCH, self._args(epoch=epoch))
        return epoch

    def _dead_holder(self, boot: str, alive: bool, server_up: float) -> str:
        """The boot id of a running term's holder that has died (`DEAD_AFTER_SECONDS`),
        else "". Kept per standby: when the holder was last seen alive, since when it
        has been gone."""
        now = time.monotonic()
        if alive or server_up < self.renew_every + self.margin:
            self._holder_seen = boot if alive else self._holder_seen
            self._holder_gone_since = None
            return ""
        if self._holder_seen != boot or self.gone is None or not self.gone(boot):
            return ""
        if self._holder_gone_since is None:
            self._holder_gone_since = now
        return boot if now - self._holder_gone_since >= DEAD_AFTER_SECONDS else ""

    async def _seen(self, conn: psycopg.AsyncConnection[Any]) -> float | None:
        """Read who leads (`self.leader`); the seconds left of a term that is this node's
        own (a claim it won whose answer was lost: a timeout after the COMMIT), else
        None."""
        cur = await conn.execute(
            "SELECT l.node, l.epoch, l.boot_id, t.epoch, "
            "EXTRACT(EPOCH FROM t.expires_at - now()) FROM leadership l "
            "JOIN leadership_term t USING (site) WHERE l.site = %s", (self.site,))
        row = await cur.fetchone()
        if row is None:
            self.leader = None
            return None
        node, epoch, boot, term_epoch, left = row
        self.leader = (node, int(epoch))
        if boot == self.boot_id and int(term_epoch) == int(epoch):
            self.epoch = int(epoch)
            return float(left)
        return None

    async def acquire(self, stop: asyncio.Event) -> int | None:
        """Stand by until this node leads; returns its epoch (None: `stop` was set)."""
        import psycopg

        self.role, self.epoch, self.deadline = "standby", 0, 0.0
        while not stop.is_set():
            sent = time.monotonic()
            won: int | None = None
            left: float | None = None
            try:
                async with asyncio.timeout(self.seconds):
                    conn = await self._connection()
                    won = await self._claim(conn)
                    if won is None:
                        left = await self._seen(conn)
                        if left is None:
                            await conn.execute(_HEARTBEAT, self._args())
            except psycopg.errors.LockNotAvailable:
                # A commit of the old leader that passed its fence still holds the epoch
                # row (a stalled COMMIT, a frozen process): the database answers; the
                # commit ends, or its session timeout ends it, soon.
                await self._drop()
            except (psycopg.Error, OSError, TimeoutError) as exc:
                self._trouble("standing by: the database", exc)
                await self._drop()
            else:
                self.database_ok = True
                if self._complained:
                    self._complained = False
                    log.info("standing by: the database answers again")
            if won is not None or (left is not None and left > self.margin):
                if won is not None:
                    self.epoch, self.deadline = won, sent + self.seconds - self.margin
                else:  # our own claim, whose answer was lost: its term runs `left` more
                    self.deadline = time.monotonic() + left - self.margin  # type: ignore[operator]
                self.role, self.leader, self._held = "leader", (self.node, self.epoch), self.epoch
                global _takeovers
                _takeovers += 1
                log.info("leading the site", site=self.site, node=self.node, epoch=self.epoch)
                self._start_renewing()
                await self._announce()
                return self.epoch
            self.epoch = 0
            try:
                async with asyncio.timeout(self.claim_every):
                    await stop.wait()
            except TimeoutError:
                pass
        return None

    async def _announce(self) -> None:
        """Just elected: the name check and the heartbeat. Their failure never costs the
        claim won (the renewals keep it; the next heartbeat comes with them)."""
        import psycopg

        try:
            async with asyncio.timeout(self.margin):
                conn = await self._connection()
                if not self._name_checked:
                    await self._check_name(conn)
                await conn.execute(_HEARTBEAT, self._args())
        except (psycopg.Error, OSError, TimeoutError) as exc:
            log.info("elected; the node's heartbeat is left to the renewals",
                     error=type(exc).__name__, detail=str(exc).strip()[:300])
            await self._drop()

    def _start_renewing(self) -> None:
        """Renew from a thread of its own, from the claim on: the event loop may be
        busy for seconds (a new term restoring tens of thousands of leases, a backlog
        of requests), and the claim must not lapse meanwhile. A timer on the loop tells
        the thread the loop still runs, from the claim on: not only once `hold` runs,
        after the lease book is restored."""
        self._stop_renewing = threading.Event()
        self._lost = None
        self._loop_seen = time.monotonic()
        loop = asyncio.get_running_loop()
        every = min(0.25, self.renew_every / 2)

        def beat() -> None:
            self._loop_seen = time.monotonic()
            self._pulse = loop.call_later(every, beat)

        if self._pulse is not None:
            self._pulse.cancel()
        self._pulse = loop.call_later(every, beat)
        self._renewer = threading.Thread(target=self._renew_forever, name="leadership",
                                         args=(self._stop_renewing, self.epoch),
                                         daemon=True)
        self._renewer.start()

    def _renewal_connection(self) -> psycopg.Connection[Any]:
        """The renewing thread's connection, with every timeout inside the renewal period:
        a dropped connection is found out, and replaced, before the term lapses."""
        ms = self._lock_ms()
        return connect(self.store.url, password_file=self.store.password_file,
                       application=f"gpubroker-renewal {self.boot_id}",
                       timeout_seconds=min(2.0, self.seconds),
                       tcp_user_timeout_ms=max(500, int(self.renew_every * 1000)),
                       options=f"-c lock_timeout={ms} -c statement_timeout={ms} "
                               f"{_LOCAL_COMMIT}")

    def _renew_forever(self, stop: threading.Event, epoch: int) -> None:
        """Renew every `renew_every`, counted from when the last renewal was sent (not
        from when the thread got round to it again): a slow statement or a busy machine
        must not add its delay to the next renewal's. The node's heartbeat comes after a
        renewal, every `HEARTBEAT_EVERY` renewals, never in a renewal's way."""
        import psycopg

        conn: psycopg.Connection[Any] | None = None
        complained = False
        next_at = min(time.monotonic() + self.renew_every, self.deadline)
        beats = 0
        try:
            while not stop.wait(max(0.0, next_at - time.monotonic())):
                now = time.monotonic()
                if now - self._loop_seen > self.loop_stall_seconds:
                    self._lost = (f"the event loop has not run for "
                                  f"{self.loop_stall_seconds:g} s: the leadership is left "
                                  "to expire")
                    return
                try:
                    if conn is None or conn.closed:
                        conn = self._renewal_connection()
                    renewed = conn.execute(_RENEW, self._args(epoch=epoch)).fetchone()
                except (psycopg.Error, OSError) as exc:
                    if not complained:
                        complained = True
                        log.warning("renewing the leadership failed; trying again at once",
                                    database=self.store.name, error=type(exc).__name__,
                                    detail=str(exc).strip()[:300])
                    if conn is not None:
                        conn.close()
                    conn = None
                    next_at = time.monotonic() + 0.05  # at once: one drop must not depose
                    continue
                if renewed is None:
                    self._lost = (f"another node leads site {self.site} now (this node's "
                                  f"epoch was {epoch})")
                    return
                if stop.is_set():
                    return  # stepped down meanwhile: the renewal must not revive it
                if complained:
                    complained = False
                    log.info("leadership renewed again")
                self.database_ok = True
                self.deadline = now + self.seconds - self.margin
                next_at = now + self.renew_every
                beats += 1
                if beats % HEARTBEAT_EVERY == 0:
                    try:
                        conn.execute(_HEARTBEAT, self._args(epoch=epoch, role="leader"))
                    except (psycopg.Error, OSError) as exc:  # the next renewal reconnects
                        log.debug("heartbeat failed", error=type(exc).__name__)
        finally:
            if conn is not None:
                conn.close()

    async def hold(self) -> NoReturn:
        """Watch the leadership the renewing thread keeps, and the store's connection;
        raise `Deposed` as soon as the leadership is lost or its deadline passes."""
        every = min(0.25, self.renew_every / 2)
        watch = asyncio.create_task(self._watch_store(), name="store-connection")
        try:
            while True:
                self._loop_seen = time.monotonic()
                lost = self._lost
                if lost is not None or not self.valid():
                    epoch = self.epoch
                    self.step_down()
                    raise Deposed(lost or f"leadership of site {self.site} not renewed in "
                                  f"time (epoch {epoch}): another node may lead now")
                await asyncio.sleep(every)
        finally:
            watch.cancel()

    async def _watch_store(self) -> None:
        """Check the store's own connection at each renewal, replacing one that a short
        database restart, `pg_terminate_backend` or an idle timeout ended, so that the
        next commit does not find it dead hours later."""
        complained = False
        while True:
            await asyncio.sleep(self.renew_every)
            try:
                await self.store.reconnect_if_lost()
            except StoreFailed as exc:
                if not complained:
                    complained = True
                    log.warning("the store's database connection is lost; trying again",
                                detail=str(exc)[:300])
                continue
            complained = False

    def step_down(self) -> None:
        """Stop acting as the leader at once (no more publishing): a renewal in flight
        cannot make it leader again."""
        self._stop_renewing.set()
        if self._pulse is not None:
            self._pulse.cancel()
            self._pulse = None
        self.deadline, self.epoch, self.role = 0.0, 0, "standby"

    async def release(self) -> None:
        """Let a standby take over at once: end this node's term in the database, if it
        is still this node's (its epoch and boot). Also after a deposition by the
        deadline, so the site does not wait out the rest of a term nobody uses. Best
        effort; after the renewing thread ended, so a renewal in flight cannot undo it."""
        self.step_down()
        renewer, self._renewer = self._renewer, None
        if renewer is not None:
            await asyncio.to_thread(renewer.join, 2 * self.seconds)
        epoch, self._held = self._held, 0
        if epoch <= 0:
            return
        try:
            async with asyncio.timeout(2.0):
                conn = await self._connection()
                await conn.execute(_RELEASE, self._args(epoch=epoch))
                await conn.execute(_HEARTBEAT, self._args(role="stopped", epoch=epoch))
        except Exception as exc:  # the standby then waits for the expiry instead
            log.warning("leadership not released; a standby takes over at its expiry",
                        error=type(exc).__name__, detail=str(exc).strip()[:300])

    async def close(self) -> None:
        await self.release()
        await self._drop()

    async def _check_name(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Once: another running daemon with this node name (two hosts with the same
        name, a copied config) would share its row in `nodes`; say so."""
        self._name_checked = True
        cur = await conn.execute(
            "SELECT boot_id, role FROM nodes WHERE node = %s AND NOT boot_id = ANY(%s) AND "
            "role <> 'stopped' AND seen_at > now() - make_interval(secs => %s)",
            (self.node, sorted(_own_boots), 2 * self.seconds))
        other = await cur.fetchone()
        if other is not None:
            log.error("another daemon of this site uses the same node name: give each "
                      "its own `node`", node=self.node, other_boot_id=other[0],
                      other_role=other[1])
