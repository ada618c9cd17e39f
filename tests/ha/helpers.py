"""High-availability test helpers: two `gpubroker run` processes of one site, a TCP proxy
in front of PostgreSQL, a scheduler that re-sends, and the checks on what it all saw.

* ``HaSite`` — the nodes of one site (``daemon()``, ``start_leader()``,
  ``start_standby()``: a config each with its own `node` and `http.listen`, the same
  `site`, `state.url` and simulated market), ``proxy()``, and the database's
  `leadership`, `nodes` and `leases` tables.
* ``HaDaemon`` — `python -m broker.cli run --config FILE` as a process of its own (its
  own session), its JSON log in a file, HTTP on a loopback port; ``readyz()`` and
  ``wait_role()`` poll `GET /readyz` with a deadline (200 "ready": leading; 503
  "not ready: standby (…)": standing by); ``kill()``, ``freeze()``/``thaw()``
  (SIGSTOP/SIGCONT), ``stop()`` (SIGTERM); ``wait_log()`` waits for a log record.
  One process may hold several starts of the daemon (a deposed leader stands by again
  in-process, with a new boot_id).
* ``PgProxy`` — an asyncio TCP proxy between a daemon and PostgreSQL: ``cut()`` closes
  every connection through it and resets every new one until ``restore()``;
  ``retarget()`` sends the new ones to another server (a failover).
* ``Scheduler`` — a ``BrokerClient`` placing requests at a steady pace; the client sends
  an unanswered request again with the same request_id (every 0.5 s here, doubling to
  2 s, and at once when a daemon comes online with a new boot_id). Rejections are
  answers; a placement that times out is not.
* ``Observed`` — what one ``MqttProbe``, subscribed to `P/status` and `P/events/#`
  before the fault, received, in arrival order, and the checks made on it:
  ``leaders()`` (the leading starts in the order they came online),
  ``takeover_problems`` (for each takeover: nothing from the deposed leader after the
  new leader's first message but its outbox sent again by the new leader, and a higher
  epoch), ``lease_problems`` (no request_id with two lease_ids, the database's
  `leases` table agreeing), ``epoch_problems`` (P/status epochs never going down).

Every process started here is killed at teardown (``HaSite.close``) and at interpreter
exit, frozen or not.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import yaml
from mqtt_helpers import Mosquitto, MqttProbe, free_port

from gpubroker_client import BrokerClient, BrokerError, PlacementTimeout, Rejected

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
PREFIX = "gpubroker/v1"
SITE = "ha"
SCHEDULER = "ha-sched"
LEADERSHIP_SECONDS = 2.0
"""`state.leadership_seconds` of the tests: a standby takes over about 2 s after the
leader stopped renewing; the leader itself stops acting 1.33 s after its last renewal."""

# --------------------------------------------------------------------------------------
# waiting
# --------------------------------------------------------------------------------------


async def wait_until(condition: Callable[[], bool], timeout: float, what: str,
                     every: float = 0.05) -> None:
    """Poll `condition` until it holds; TimeoutError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g}s")
        await asyncio.sleep(every)


# --------------------------------------------------------------------------------------
# the daemon as a process
# --------------------------------------------------------------------------------------

_LIVE: dict[int, subprocess.Popen[bytes]] = {}


def _kill_all() -> None:
    for proc in list(_LIVE.values()):
        _kill(proc)


atexit.register(_kill_all)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()  # a stopped (SIGSTOP) process dies of SIGKILL as well
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    _LIVE.pop(proc.pid, None)


@dataclass(frozen=True)
class Readiness:
    status: int | None  # None: HTTP did not answer (the process is between two starts)
    text: str

    @property
    def role(self) -> str:
        """'leader' (200), 'standby' (503 "not ready: standby (…)"), or 'other'."""
        if self.status == 200:
            return "leader"
        if self.status == 503 and self.text.startswith("not ready: standby"):
            return "standby"
        return "other"


class HaDaemon:
    """One node of the site: `gpubroker run` as a process (see the module docstring)."""

    def __init__(self, node: str, config: Path, log_path: Path, http_port: int) -> None:
        self.node = node
        self.config = config
        self.log_path = log_path
        self.http_port = http_port
        self.proc: subprocess.Popen[bytes] | None = None
        self.frozen = False

    def start(self) -> None:
        if self.alive:
            raise RuntimeError(f"node {self.node} already runs")
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "broker.cli", "run", "--config", str(self.config)],
                cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        _LIVE[self.proc.pid] = self.proc

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def _signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None and self.alive, f"node {self.node} is not running"
        self.proc.send_signal(sig)

    async def kill(self) -> int | None:
        """SIGKILL; the exit code (-9)."""
        self._signal(signal.SIGKILL)
        return await self.wait_exit(10)

    def freeze(self) -> None:
        """SIGSTOP: the process stops where it is, sockets and all."""
        self._signal(signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        """SIGCONT."""
        self._signal(signal.SIGCONT)
        self.frozen = False

    async def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM and wait; the exit code (None: it had to be killed)."""
        if not self.alive:
            return self.returncode
        if self.frozen:
            self.thaw()
        self._signal(signal.SIGTERM)
        code = await self.wait_exit(timeout)
        if code is None:
            self.close()
        return code

    async def wait_exit(self, timeout: float) -> int | None:
        if self.proc is None:
            return None
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(self.proc.wait, timeout)
        code = self.proc.poll()
        if code is not None:
            _LIVE.pop(self.proc.pid, None)
        return code

    def close(self) -> None:
        if self.proc is not None:
            _kill(self.proc)

    # --- HTTP -------------------------------------------------------------------------

    async def readyz(self, session: aiohttp.ClientSession | None = None) -> Readiness:
        """`GET /readyz` once."""
        async with contextlib.AsyncExitStack() as stack:
            if session is None:
                session = await stack.enter_async_context(aiohttp.ClientSession(
                    timeout=aiohttp.ClientTimeout(total=1)))
            try:
                async with session.get(f"http://{HOST}:{self.http_port}/readyz") as r:
                    return Readiness(r.status, (await r.text()).strip())
            except (aiohttp.ClientError, TimeoutError) as exc:
                return Readiness(None, f"{type(exc).__name__}: {exc}")
        raise AssertionError("unreachable")

    async def wait_role(self, role: str, timeout: float, *,
                        text: str | None = None) -> Readiness:
        """Poll /readyz until it says `role` ('leader' or 'standby'; with `text`, a
        reply containing it). AssertionError if the process exits, TimeoutError after
        `timeout` s (both with the last reply and the log's tail)."""
        deadline = time.monotonic() + timeout
        last = Readiness(None, "never asked")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as s:
            while True:
                if not self.alive:
                    raise AssertionError(f"node {self.node} exited ({self.returncode}) "
                                         f"while waiting to be {role}\n{self.log_tail()}")
                last = await self.readyz(s)
                if last.role == role and (text is None or text in last.text):
                    return last
                if time.monotonic() > deadline:
                    raise TimeoutError(f"node {self.node} not {role} within {timeout:g}s; "
                                       f"/readyz: {last.status} {last.text!r}\n"
                                       f"{self.log_tail()}")
                await asyncio.sleep(0.05)

    # --- the log ------------------------------------------------------------------------

    def records(self) -> list[dict[str, Any]]:
        """The JSON log records so far (lines that are not JSON are skipped)."""
        out = []
        if not self.log_path.exists():
            return out
        for line in self.log_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if isinstance(rec, dict):
                    out.append(rec)
        return out

    def logged(self, event: str) -> list[dict[str, Any]]:
        """The log records whose `event` starts with `event`."""
        return [r for r in self.records() if str(r.get("event", "")).startswith(event)]

    async def wait_log(self, event: str, timeout: float, *, count: int = 1
                       ) -> dict[str, Any]:
        """The `count`-th log record whose event starts with `event`, once logged."""
        try:
            await wait_until(lambda: len(self.logged(event)) >= count, timeout,
                             f"node {self.node}: log record {event!r} #{count}")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\n{self.log_tail()}") from None
        return self.logged(event)[count - 1]

    def connects_while_not_leading(self) -> list[dict[str, Any]]:
        """"mqtt connected" records logged while this node did not lead: after it
        stepped down (or before its first start as the leader), before its next
        "starting". The site's client id is the leader's alone."""
        leading = False
        out = []
        for r in self.records():
            event = str(r.get("event", ""))
            if event == "starting":
                leading = True
            elif event.startswith(("deposed", "stepped down", "stopped")):
                leading = False
            elif event == "mqtt connected" and not leading:
                out.append(r)
        return out

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 25) -> str:
        tail = self.log_text().splitlines()[-lines:]
        return f"--- node {self.node} log (tail) ---\n" + "\n".join(tail)

    def tracebacks(self) -> list[str]:
        """Log lines about a failure nobody foresaw."""
        return [line for line in self.log_text().splitlines()
                if "Traceback" in line or "Future exception was never retrieved" in line
                or "Task exception was never retrieved" in line]


# --------------------------------------------------------------------------------------
# PostgreSQL behind a proxy
# --------------------------------------------------------------------------------------


class PgProxy:
    """A TCP proxy on 127.0.0.1 in front of the PostgreSQL server of `target_url`.
    ``url(target_url)`` is that URL through the proxy. ``cut()``: every connection
    through it is closed at once and every new one is reset as soon as it is accepted
    (libpq: "server closed the connection unexpectedly"), until ``restore()``.
    ``hold()``: every connection through it is closed, and every new one is accepted but
    not passed on (what the client sends waits, unread) until ``release()``: a network
    that holds a connect back. The MQTT server works through it as well (``url`` of an
    ``mqtt://`` URL)."""

    def __init__(self, target_url: str) -> None:
        u = urlsplit(target_url)
        self.target = (u.hostname or HOST, u.port or 5432)
        self.port = 0
        self.is_cut = False
        self.held = asyncio.Event()  # set: new connections wait for release()
        self.waiting = 0  # connections held back now
        self._released = asyncio.Event()
        self.accepted = 0
        self.refused = 0
        self._server: asyncio.Server | None = None
        self._links: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def url(self, target_url: str) -> str:
        u = urlsplit(target_url)
        netloc = (f"{u.username}@" if u.username else "") + f"{HOST}:{self.port}"
        return urlunsplit((u.scheme, netloc, u.path, u.query, u.fragment))

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, HOST, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                      ) -> None:
        if self.is_cut:
            self.refused += 1
            writer.transport.abort()
            return
        if self.held.is_set():
            self.waiting += 1
            await self._released.wait()
            self.waiting -= 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        if self.is_cut:  # cut while connecting
            up_writer.transport.abort()
            writer.transport.abort()
            return
        self.accepted += 1
        link = (writer, up_writer)
        self._links.add(link)
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._pump(reader, up_writer))
                tg.create_task(self._pump(up_reader, writer))
        except* (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self._links.discard(link)
            self._tasks.discard(task)
            for w in link:
                w.transport.abort()

    @staticmethod
    async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
        dst.transport.abort()  # one side closed: close both (libpq never half-closes)

    def retarget(self, target_url: str) -> None:
        """Send every new connection to the server of `target_url` from now on (a
        failover to another server behind one address), and close every connection to
        the old one."""
        u = urlsplit(target_url)
        self.target = (u.hostname or HOST, u.port or 5432)
        for link in list(self._links):
            for w in link:
                w.transport.abort()

    def cut(self) -> None:
        """Close every connection; reset every new one until `restore()`."""
        self.is_cut = True
        for link in list(self._links):
            for w in link:
                w.transport.abort()

    def restore(self) -> None:
        self.is_cut = False

    def hold(self) -> None:
        """Close every connection; hold every new one back until `release()`."""
        self._released.clear()
        self.held.set()
        for link in list(self._links):
            for w in link:
                w.transport.abort()

    def release(self) -> None:
        """Pass the held connections on (what their clients sent first), and new ones."""
        self.held.clear()
        self._released.set()

    async def close(self) -> None:
        self.cut()
        self.release()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        # Every link was aborted: its pumps end by themselves (a cancelled connection
        # handler would be logged by asyncio's streams as an error).
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=5)


# --------------------------------------------------------------------------------------
# the site: configs, processes, the database
# --------------------------------------------------------------------------------------


class HaSite:
    """The daemons of one site on one mosquitto and one PostgreSQL database."""

    def __init__(self, workdir: Path, mosquitto: Mosquitto, pg_url: str,
                 leadership_seconds: float = LEADERSHIP_SECONDS,
                 config: dict[str, Any] | None = None) -> None:
        self.workdir = workdir
        self.mosquitto = mosquitto
        self.pg_url = pg_url
        self.leadership_seconds = leadership_seconds
        # Further config sections for every node (e.g. a larger sim market, a poll
        # interval): each top-level key's mapping is merged over the default one.
        self.config = config or {}
        self.daemons: dict[str, HaDaemon] = {}
        self.proxies: list[PgProxy] = []

    def daemon(self, node: str, *, state_url: str | None = None,
               mqtt_url: str | None = None) -> HaDaemon:
        """A node of the site (not started); `state_url` defaults to the database,
        `mqtt_url` to the MQTT server."""
        port = free_port()
        cfg = {
            "site": SITE,
            "node": node,
            "log_level": "info",
            "state": {"url": state_url or self.pg_url,
                      "leadership_seconds": self.leadership_seconds},
            "mqtt": {"url": mqtt_url or self.mosquitto.url, "topic_prefix": PREFIX},
            "http": {"listen": f"{HOST}:{port}"},
            "clouds": {"sim": {"seed": 7}},
        }
        for key, value in self.config.items():
            cfg[key] = {**cfg[key], **value} if isinstance(cfg.get(key), dict) and \
                isinstance(value, dict) else value
        path = self.workdir / f"{node}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        daemon = HaDaemon(node, path, self.workdir / f"{node}.log", port)
        self.daemons[node] = daemon
        return daemon

    async def proxy(self, target_url: str | None = None) -> PgProxy:
        """A started PgProxy in front of the database (or of `target_url`, e.g. the
        MQTT server's); its `url(site.pg_url)` is the state.url of a node that reaches
        the database through it."""
        proxy = PgProxy(target_url or self.pg_url)
        await proxy.start()
        self.proxies.append(proxy)
        return proxy

    async def start_leader(self, node: str, *, state_url: str | None = None,
                           mqtt_url: str | None = None, timeout: float = 20.0) -> HaDaemon:
        d = self.daemon(node, state_url=state_url, mqtt_url=mqtt_url)
        d.start()
        await d.wait_role("leader", timeout)
        return d

    async def start_standby(self, node: str, *, state_url: str | None = None,
                            timeout: float = 20.0) -> HaDaemon:
        d = self.daemon(node, state_url=state_url)
        d.start()
        await d.wait_role("standby", timeout, text="leader: node")
        return d

    async def stop_all(self) -> dict[str, int | None]:
        """SIGTERM every node at once; their exit codes."""
        codes = await asyncio.gather(*(d.stop() for d in self.daemons.values()))
        return dict(zip(self.daemons, codes, strict=True))

    async def close(self) -> None:
        for d in self.daemons.values():
            d.close()
        for p in self.proxies:
            await p.close()

    def logs(self) -> str:
        return "\n".join(d.log_tail(40) for d in self.daemons.values())

    # --- the database -------------------------------------------------------------------

    async def query(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        import psycopg

        async with await psycopg.AsyncConnection.connect(self.pg_url, autocommit=True,
                                                         connect_timeout=5) as conn:
            cur = await conn.execute(sql, args or None)
            return list(await cur.fetchall())

    async def leadership(self) -> tuple[str, int, str]:
        """The site's leadership row: (node, epoch, boot_id)."""
        rows = await self.query("SELECT node, epoch, boot_id FROM leadership WHERE site=%s",
                                SITE)
        assert len(rows) == 1, f"leadership rows of site {SITE}: {rows}"
        node, epoch, boot = rows[0]
        return str(node), int(epoch), str(boot)

    async def nodes(self) -> dict[str, tuple[str, int, str]]:
        """The `nodes` table: node -> (role, epoch, boot_id)."""
        return {str(n): (str(r), int(e), str(b)) for n, r, e, b in await self.query(
            "SELECT node, role, epoch, boot_id FROM nodes")}

    async def leases(self) -> list[tuple[str, str, str, int]]:
        """The `leases` table: (scheduler, request_id, lease_id, leader_epoch)."""
        return [(str(s), str(r), str(i), int(e)) for s, r, i, e in await self.query(
            "SELECT scheduler, request_id, lease_id, leader_epoch FROM leases")]


# --------------------------------------------------------------------------------------
# the scheduler
# --------------------------------------------------------------------------------------

MIX: tuple[dict[str, Any], ...] = (
    {"gpu": ["T4", "L4"], "gpus": 1},
    {"gpu": "V100-16GB", "gpus": 1, "market": "spot"},
    {"gpu": ["A10G", "A10"], "gpus": 1},
    {"gpu": "A100-40GB", "gpus": 1},
    {"gpu": "L40S", "gpus": 1, "market": "on_demand"},
    {"gpu": ["A100-80GB", "A100-40GB"], "gpus": 2},
)


@dataclass
class Outcome:
    request_id: str
    sent_at: float
    answered_at: float | None = None
    kind: str | None = None  # "decided", "rejected", "invalid", "timeout", "error"
    lease_id: str | None = None
    detail: str = ""


class Scheduler:
    """Places requests through a ``BrokerClient`` (see the module docstring)."""

    def __init__(self, client: BrokerClient, *, answer_timeout: float = 20.0) -> None:
        self.client = client
        self.answer_timeout = answer_timeout
        self.outcomes: dict[str, Outcome] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._count = 0
        self._answered = asyncio.Event()

    @property
    def answered(self) -> int:
        return sum(1 for o in self.outcomes.values() if o.kind in ("decided", "rejected"))

    def place(self, tag: str = "r") -> str:
        """Send one placement request (in a task of its own); its request_id."""
        i = self._count
        self._count += 1
        rid = f"{tag}-{i:04d}"
        outcome = Outcome(rid, time.monotonic())
        self.outcomes[rid] = outcome
        task = asyncio.create_task(self._place(outcome, MIX[i % len(MIX)]))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return rid

    async def _place(self, outcome: Outcome, body: dict[str, Any]) -> None:
        try:
            lease = await self.client.place(request_id=outcome.request_id,
                                            timeout=self.answer_timeout, lease_seconds=3600,
                                            **body)
        except Rejected as exc:
            outcome.kind, outcome.detail = "rejected", exc.code
        except PlacementTimeout as exc:
            outcome.kind, outcome.detail = "timeout", str(exc)
        except BrokerError as exc:
            outcome.kind, outcome.detail = "error", f"{type(exc).__name__}: {exc}"
        else:
            outcome.kind, outcome.lease_id = "decided", lease.lease_id
        outcome.answered_at = time.monotonic()
        self._answered.set()

    async def flow(self, stop: asyncio.Event, every: float = 0.1, tag: str = "r") -> int:
        """Place a request every `every` seconds until `stop` is set; how many."""
        sent = 0
        while not stop.is_set():
            self.place(tag)
            sent += 1
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(every):
                    await stop.wait()
        return sent

    async def wait_answered(self, count: int, timeout: float) -> None:
        """Until at least `count` requests have their answer."""
        async with asyncio.timeout(timeout):
            while self.answered < count:
                self._answered.clear()
                await self._answered.wait()

    async def finish(self, timeout: float) -> list[Outcome]:
        """Wait for every request's outcome; the requests left without an answer."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)
        return [o for o in self.outcomes.values() if o.kind not in ("decided", "rejected")]

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


# --------------------------------------------------------------------------------------
# what the probe saw
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Seen:
    index: int  # arrival order at the probe
    topic: str
    retain: bool
    body: dict[str, Any]

    @property
    def is_status(self) -> bool:
        return self.topic == f"{PREFIX}/status"

    @property
    def boot(self) -> str:
        """The daemon start it comes from: `boot_id` of a status, `bootid` of an event."""
        return str(self.body.get("boot_id" if self.is_status else "bootid", ""))

    @property
    def kind(self) -> str:
        return self.topic.rsplit("/", 1)[-1]


@dataclass
class Observed:
    """The messages of one probe, parsed, in arrival order."""

    seen: list[Seen] = field(default_factory=list)

    @classmethod
    def of(cls, probe: MqttProbe) -> Observed:
        out = []
        for i, m in enumerate(probe.messages):
            raw = m.payload if isinstance(m.payload, bytes | bytearray) else b""
            body = json.loads(raw) if raw else {}
            out.append(Seen(i, m.topic.value, bool(m.retain), body))
        return cls(out)

    def statuses(self) -> list[Seen]:
        return [s for s in self.seen if s.is_status]

    def events(self) -> list[Seen]:
        return [s for s in self.seen if not s.is_status]

    def online(self) -> list[Seen]:
        return [s for s in self.statuses() if s.body.get("state") == "online"]

    def leaders(self) -> list[Leader]:
        """Every daemon start that announced itself online, in the order of its first
        P/status: the site's leaders as the probe saw them come."""
        out: dict[str, Leader] = {}
        for s in self.online():
            if s.boot not in out:
                out[s.boot] = Leader(s.boot, str(s.body["node"]), int(s.body["epoch"]),
                                     s.index)
        return list(out.values())

    def describe(self, since: int = 0, limit: int = 80) -> str:
        rows = [f"#{s.index} {s.topic.removeprefix(PREFIX + '/')} {'R ' if s.retain else ''}"
                f"{s.body.get('state', '')} {s.body.get('epoch', '')} boot={s.boot[:8]} "
                f"{s.body.get('data', {}).get('request_id', '')}"
                for s in self.seen[since:]]
        return "\n".join(rows[:limit]) + (f"\n… {len(rows) - limit} more"
                                          if len(rows) > limit else "")

    # --- the checks ------------------------------------------------------------------

    def takeover_problems(self, quiet_from: dict[str, int] | None = None) -> list[str]:
        """For each takeover the probe saw (one leader's start, `old`, followed by the
        next, `new`): nothing from `old` after `new`'s first message T.

        * no P/status of `old` after T;
        * no envelope of `old` after F, `new`'s first envelope of its own.

        Between T and F the new leader sends again, first and in order, the old leader's
        outbox rows it found in the database (committed by the old leader, not yet
        deleted): they carry `old`'s bootid by design (an outbox row is sent again
        byte-for-byte) and are allowed there. The old process itself could publish only
        on a connection of its own, and the site's client id admits one at a time: it
        would have to connect again, which publishes P/status first (the first rule).
        `quiet_from`: boot -> a probe index after which nothing at all may carry that
        boot (e.g. after a frozen leader was let go, once F was seen).

        Also: each leader's epoch is higher than its predecessor's."""
        problems = []
        chain = self.leaders()
        for old, new in itertools.pairwise(chain):
            if new.epoch <= old.epoch:
                problems.append(f"leader {new} after {old}: the epoch did not rise")
            t = new.first
            f = next((s.index for s in self.events() if s.boot == new.boot), None)
            for s in self.statuses():
                if s.index > t and s.boot == old.boot:
                    problems.append(f"P/status of the deposed {old} at #{s.index}, after "
                                    f"the new leader's first message #{t}: {s.body}")
            for s in self.events():
                if s.boot == old.boot and f is not None and s.index > f:
                    problems.append(f"{s.kind} #{s.index} of the deposed {old} after the new "
                                    f"leader's first event #{f}: id {s.body.get('id')}")
        for boot, index in (quiet_from or {}).items():
            for s in self.seen[index:]:
                if s.boot == boot:
                    problems.append(f"{s.kind} #{s.index} of start {boot} after #{index}")
        return problems

    def decided(self) -> dict[str, set[str]]:
        """request_id -> the lease_ids of every placement.decided seen for it."""
        out: dict[str, set[str]] = {}
        for s in self.events():
            if s.kind == "placement.decided":
                data = s.body["data"]
                out.setdefault(str(data["request_id"]), set()).add(str(data["lease_id"]))
        return out

    def lease_problems(self, scheduler: Scheduler,
                       table: list[tuple[str, str, str, int]]) -> list[str]:
        """No lease decided twice: a request_id never has two lease_ids (among the
        events seen, the scheduler's answers and the `leases` table), and the table has
        one row per (scheduler, request_id), the lease the scheduler was given."""
        problems = []
        decided = self.decided()
        for rid, ids in decided.items():
            if len(ids) > 1:
                problems.append(f"request {rid} decided with {len(ids)} leases: {sorted(ids)}")
        rows: dict[tuple[str, str], list[str]] = {}
        for sched, rid, lease_id, _ in table:
            rows.setdefault((sched, rid), []).append(lease_id)
        for key, ids in rows.items():
            if len(ids) > 1:
                problems.append(f"leases table: {len(ids)} rows for {key}: {ids}")
        for o in scheduler.outcomes.values():
            if o.kind != "decided":
                continue
            in_table = rows.get((SCHEDULER, o.request_id), [])
            if in_table != [o.lease_id]:
                problems.append(f"request {o.request_id}: the scheduler holds lease "
                                f"{o.lease_id}, the leases table has {in_table}")
            if decided.get(o.request_id, {o.lease_id}) != {o.lease_id}:
                problems.append(f"request {o.request_id}: the scheduler holds lease "
                                f"{o.lease_id}, the events say {decided[o.request_id]}")
        return problems

    def epoch_problems(self) -> list[str]:
        """P/status epochs never go down in arrival order; a start keeps one epoch."""
        problems = []
        top = 0
        by_boot: dict[str, int] = {}
        for s in self.statuses():
            epoch = int(s.body.get("epoch", 0))
            if epoch < top:
                problems.append(f"P/status #{s.index} has epoch {epoch} after epoch {top} "
                                f"was seen: {s.body}")
            top = max(top, epoch)
            if by_boot.setdefault(s.boot, epoch) != epoch:
                problems.append(f"start {s.boot} published epochs {by_boot[s.boot]} and "
                                f"{epoch}")
        return problems


class LeaderWatch:
    """Asks every node of `site` for ``/readyz`` every `every` s, from ``start()`` to
    ``stop()``: which nodes said they lead at each moment, and so the longest stretch in
    which none did (a node whose HTTP does not answer within 1 s does not lead)."""

    def __init__(self, site: HaSite, every: float = 0.1) -> None:
        self.site = site
        self.every = every
        self.samples: list[tuple[float, dict[str, Readiness]]] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as s:
            while True:
                daemons = list(self.site.daemons.values())
                replies = await asyncio.gather(*(d.readyz(s) for d in daemons))
                self.samples.append((time.monotonic(),
                                     {d.node: r for d, r in zip(daemons, replies,
                                                                strict=True)}))
                await asyncio.sleep(self.every)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def leading(self, since: float = 0.0) -> list[tuple[float, list[str]]]:
        """(time, the nodes that said they lead) of every sample from `since` on."""
        return [(t, sorted(n for n, r in replies.items() if r.role == "leader"))
                for t, replies in self.samples if t >= since]

    def longest_without_leader(self, since: float) -> tuple[float, float]:
        """(seconds, start): the longest stretch without a leader from `since` (the
        fault's start, counted as led) on: from a sample in which some node led, or
        `since`, to the next such sample (or to the last sample)."""
        best, start = 0.0, since
        last = since
        samples = self.leading(since)
        for t, nodes in samples:
            if nodes:
                if t - last > best:
                    best, start = t - last, last
                last = t
        if samples and samples[-1][0] - last > best:
            best, start = samples[-1][0] - last, last
        return best, start

    def replies_of(self, node: str, since: float = 0.0) -> list[Readiness]:
        return [r[node] for t, r in self.samples if t >= since and node in r]


@dataclass(frozen=True)
class Leader:
    """One leading start of a node, as its first P/status `online` announced it."""

    boot: str
    node: str
    epoch: int
    first: int  # the probe index of its first P/status

    def __str__(self) -> str:
        return f"node {self.node} epoch {self.epoch} (start {self.boot[:8]})"


async def wait_leader(daemons: list[HaDaemon], timeout: float) -> HaDaemon:
    """The first of `daemons` whose /readyz says it leads (polled until `timeout`)."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as s:
        while True:
            for d in daemons:
                if (await d.readyz(s)).role == "leader":
                    return d
            if time.monotonic() > deadline:
                raise TimeoutError(f"no node leads within {timeout:g}s\n"
                                   + "\n".join(d.log_tail() for d in daemons))
            await asyncio.sleep(0.05)


__all__ = ["HOST", "LEADERSHIP_SECONDS", "MIX", "PREFIX", "SCHEDULER", "SITE", "HaDaemon",
           "HaSite", "Leader", "LeaderWatch", "Observed", "Outcome", "PgProxy", "Readiness",
           "Scheduler", "Seen", "wait_leader", "wait_until"]
