"""High availability: one leader per site, elected in PostgreSQL, fenced by an epoch.

Every daemon of a site (same `site`, same `state.url`) runs `Leadership`. The site's
leadership is a row (`leadership`: epoch, node, expiry in the database's clock):

* A **standby** tries, every `claim_every` seconds, to take the row once it has expired
  (`expires_at < now()`), raising the epoch by one in the same statement; two standbys
  starting at once cannot both win, the row update is atomic.
* The **leader** renews the expiry every `seconds / 3`, from a thread and a connection
  of their own (a busy event loop must not let the claim lapse; a loop that has not run
  for `LOOP_STALL_SECONDS` stops the renewals, so a stuck daemon cannot keep it). It
  counts itself leader only until `deadline`: the local monotonic time at which it sent
  its last successful renewal, plus `seconds`, minus a margin (`seconds / 3`, at least
  0.5 s). The database's expiry is at least `seconds` after that same moment, so the
  leader stops acting before any standby can start. A leader that cannot renew in time
  (database lost, process frozen by `SIGSTOP`, renewal refused because another took
  over) raises `Deposed` and stands by again.
* **Fencing** in the database (`broker.pgstore`): every write transaction checks the
  epoch under a share lock of the row; the takeover's update waits for a commit in
  flight, and every later commit of the old leader fails. **Fencing on the bus**: the
  leader publishes (and connects) only while `valid()`; the leader's MQTT client id is
  the site's, so a new leader's connection also ends the old one's at the MQTT server.

Only the database's clock is compared with the expiry; a node's clock may be wrong.
The `nodes` table lists every node with its role, epoch and last heartbeat
(`gpubroker status`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, NoReturn

import structlog

from broker import __version__
from broker.model import utcnow
from broker.store import Deposed

if TYPE_CHECKING:
    import psycopg

    from broker.pgstore import PgStateStore

log = structlog.get_logger("gpubroker.ha")

_CLAIM = """
INSERT INTO leadership AS l (site, epoch, node, boot_id, since, expires_at)
VALUES (%(site)s, 1, %(node)s, %(boot)s, now(), now() + make_interval(secs => %(ttl)s))
ON CONFLICT (site) DO UPDATE SET epoch = l.epoch + 1, node = excluded.node,
    boot_id = excluded.boot_id, since = now(), expires_at = excluded.expires_at
WHERE l.expires_at < now()
RETURNING epoch
"""
_RENEW = """
UPDATE leadership SET expires_at = now() + make_interval(secs => %(ttl)s)
WHERE site = %(site)s AND epoch = %(epoch)s RETURNING epoch
"""
_RELEASE = "UPDATE leadership SET expires_at = now() WHERE site = %(site)s AND epoch = %(epoch)s"
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


def takeovers() -> int:
    """How many times this process took the leadership of its site."""
    return _takeovers


class Leadership:
    """This node's part in the site's election (see the module docstring)."""

    def __init__(self, store: PgStateStore, *, site: str, node: str, boot_id: str,
                 seconds: float = 3.0) -> None:
        self.store = store
        self.site = site
        self.node = node
        self.boot_id = boot_id
        self.seconds = seconds
        self.renew_every = seconds / 3
        self.claim_every = min(0.5, seconds / 6)
        self.margin = max(0.5, seconds / 3)
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
        self._loop_seen = time.monotonic()  # when the event loop last ran `hold`
        _own_boots.add(boot_id)

    def valid(self) -> bool:
        """Whether this node may act as the leader now (publish, connect as the site)."""
        return self.epoch > 0 and time.monotonic() < self.deadline

    def _args(self, **extra: Any) -> dict[str, Any]:
        return {"site": self.site, "node": self.node, "boot": self.boot_id,
                "ttl": self.seconds, "epoch": self.epoch, "role": self.role,
                "version": __version__, "started": self.started_at, **extra}

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            import psycopg

            kwargs: dict[str, Any] = {}
            if self.store.password_file is not None:
                kwargs["password"] = self.store.password_file.read_text(
                    encoding="utf-8").strip()
            # Never wait on a row lock for long (a takeover waits for a commit in
            # flight, not for a stuck session), nor on a statement.
            ms = max(200, int(self.seconds * 1000 / 3))
            # tcp_user_timeout: a server that stops answering (a partition) is given up
            # on within the claim's lifetime, not after the kernel's retransmissions.
            self._conn = await psycopg.AsyncConnection.connect(
                self.store.url, autocommit=True, connect_timeout=max(1, round(self.seconds)),
                application_name="gpubroker-election", keepalives=1, keepalives_idle=5,
                keepalives_interval=2, keepalives_count=3,
                tcp_user_timeout=int(self.seconds * 1000),
                options=f"-c lock_timeout={ms} -c statement_timeout={ms * 2}", **kwargs)
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

    async def acquire(self, stop: asyncio.Event) -> int | None:
        """Stand by until this node leads; returns its epoch (None: `stop` was set)."""
        import psycopg

        self.role, self.epoch, self.deadline = "standby", 0, 0.0
        while not stop.is_set():
            sent = time.monotonic()
            try:
                async with asyncio.timeout(self.seconds):
                    conn = await self._connection()
                    # Statements of their own (autocommit): a claim that fails holds no
                    # lock of the leadership row past its statement.
                    cur = await conn.execute(_CLAIM, self._args())
                    row = await cur.fetchone()
                    if row is None:
                        cur = await conn.execute(
                            "SELECT node, epoch FROM leadership WHERE site = %s",
                            (self.site,))
                        seen = await cur.fetchone()
                        self.leader = None if seen is None else (seen[0], int(seen[1]))
                    else:
                        self.epoch, self.role = int(row[0]), "leader"
                        self.leader = (self.node, self.epoch)
                    if not self._name_checked:
                        await self._check_name(conn)
                    await conn.execute(_HEARTBEAT, self._args())
            except psycopg.errors.LockNotAvailable:
                # The old leader's transaction still holds the leadership row (a frozen
                # process): the database answers; its session timeout ends that soon.
                self.epoch, self.role = 0, "standby"
                await self._drop()
            except (psycopg.Error, OSError, TimeoutError) as exc:
                self.epoch, self.role = 0, "standby"
                self._trouble("standing by: the database", exc)
                await self._drop()
            else:
                self.database_ok = True
                if self._complained:
                    self._complained = False
                    log.info("standing by: the database answers again")
                if self.epoch > 0:
                    global _takeovers
                    _takeovers += 1
                    self.deadline = sent + self.seconds - self.margin
                    log.info("leading the site", site=self.site, node=self.node,
                             epoch=self.epoch)
                    self._start_renewing()
                    return self.epoch
            try:
                async with asyncio.timeout(self.claim_every):
                    await stop.wait()
            except TimeoutError:
                pass
        return None

    def _start_renewing(self) -> None:
        """Renew from a thread of its own, from the claim on: the event loop may be
        busy for seconds (a new term restoring tens of thousands of leases, a backlog
        of requests), and the claim must not lapse meanwhile."""
        self._stop_renewing = threading.Event()
        self._lost = None
        self._loop_seen = time.monotonic()
        self._renewer = threading.Thread(target=self._renew_forever, name="leadership",
                                         args=(self._stop_renewing, self.epoch),
                                         daemon=True)
        self._renewer.start()

    def _renew_forever(self, stop: threading.Event, epoch: int) -> None:
        import psycopg

        ms = max(200, int(self.seconds * 1000 / 3))
        conn: psycopg.Connection[Any] | None = None
        complained = False
        try:
            while not stop.wait(max(0.0, min(self.renew_every,
                                             self.deadline - time.monotonic()))):
                if time.monotonic() - self._loop_seen > LOOP_STALL_SECONDS:
                    self._lost = (f"the event loop has not run for {LOOP_STALL_SECONDS:g} s: "
                                  "the leadership is left to expire")
                    return
                sent = time.monotonic()
                try:
                    if conn is None or conn.closed:
                        conn = self.store.connect(
                            options=f"-c lock_timeout={ms} -c statement_timeout={ms * 2}")
                    renewed = conn.execute(_RENEW, self._args(epoch=epoch)).fetchone()
                    if renewed is not None:
                        conn.execute(_HEARTBEAT, self._args(epoch=epoch, role="leader"))
                except (psycopg.Error, OSError) as exc:
                    if not complained:
                        complained = True
                        log.warning("renewing the leadership failed", database=self.store.name,
                                    error=type(exc).__name__, detail=str(exc).strip()[:300])
                    if conn is not None:
                        conn.close()
                    conn = None
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
                self.deadline = sent + self.seconds - self.margin
        finally:
            if conn is not None:
                conn.close()

    async def hold(self) -> NoReturn:
        """Watch the leadership the renewing thread keeps (and tell it the event loop
        runs); raise `Deposed` as soon as it is lost or its deadline passes."""
        every = min(0.25, self.renew_every / 2)
        while True:
            self._loop_seen = time.monotonic()
            lost = self._lost
            if lost is not None or not self.valid():
                epoch = self.epoch
                self.step_down()
                raise Deposed(lost or f"leadership of site {self.site} not renewed in time "
                              f"(epoch {epoch}): another node may lead now")
            await asyncio.sleep(every)

    def step_down(self) -> None:
        """Stop acting as the leader at once (no more publishing): a renewal in flight
        cannot make it leader again."""
        self._stop_renewing.set()
        self.deadline, self.epoch, self.role = 0.0, 0, "standby"

    async def release(self) -> None:
        """An orderly stop: let a standby take over at once. Best effort."""
        epoch = self.epoch
        if epoch <= 0:
            return
        self.step_down()
        renewer, self._renewer = self._renewer, None
        if renewer is not None:  # a renewal in flight would undo the release
            await asyncio.to_thread(renewer.join, 2 * self.seconds)
        try:
            async with asyncio.timeout(2.0):
                conn = await self._connection()
                await conn.execute(_RELEASE, self._args(epoch=epoch))
                await conn.execute(_HEARTBEAT, self._args(role="stopped", epoch=epoch))
        except Exception as exc:  # the standby then waits for the expiry instead
            log.warning("leadership not released; a standby takes over at its expiry",
                        error=type(exc).__name__, detail=str(exc).strip()[:300])

    async def close(self) -> None:
        self._stop_renewing.set()
        renewer, self._renewer = self._renewer, None
        if renewer is not None:
            await asyncio.to_thread(renewer.join, 2 * self.seconds)
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


@dataclass(frozen=True, slots=True)
class NodeInfo:
    node: str
    role: str
    epoch: int
    boot_id: str
    version: str
    started_at: datetime
    seen_seconds_ago: float


@dataclass(frozen=True, slots=True)
class SiteStatus:
    site: str
    leader: str | None
    epoch: int
    expires_in_seconds: float | None
    nodes: list[NodeInfo]


def site_status(store: PgStateStore, site: str) -> SiteStatus:
    """The site's leadership and nodes as the database has them (blocking)."""
    with store.connect() as conn:
        row = conn.execute("SELECT node, epoch, EXTRACT(EPOCH FROM expires_at - now()) "
                           "FROM leadership WHERE site = %s", (site,)).fetchone()
        nodes = [NodeInfo(n, role, int(e), boot, ver, started, float(ago))
                 for n, role, e, boot, ver, started, ago in conn.execute(
                     "SELECT node, role, epoch, boot_id, version, started_at, "
                     "EXTRACT(EPOCH FROM now() - seen_at) FROM nodes ORDER BY node")]
    if row is None:
        return SiteStatus(site, None, 0, None, nodes)
    return SiteStatus(site, row[0], int(row[1]), float(row[2]), nodes)
