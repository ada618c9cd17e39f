"""High availability on PostgreSQL: leader kills and freezes under load, and PostgreSQL's
request latency next to SQLite's.

Three parts, each on a private mosquitto (no persistence) and, where PostgreSQL is used,
a fresh database created through `--admin-url` and dropped afterwards:

1. **kill** — two daemons of one site (`node-a`, `node-b`, each its own HTTP port) on
   the simulated market; one scheduler (an aiomqtt client with a persistent session)
   sends `--rate` placement requests per second with unique request_ids, open loop,
   and re-sends an unanswered one with the same request_id after `--resend-after` s,
   doubling up to `--resend-max` s, and at once when `P/status` says `online` with a
   new boot_id. `--kills` times: the leader (the node of the last `online`) gets
   `kill -9`; once the new boot has decided something, the killed node is started
   again; the next kill waits until it stands by (`/readyz`: 503 `standby (leader: …)`),
   then up to `--settle-timeout` s for every request sent more than 1 s ago to be
   answered, then `--steady` s.
2. **stop** — the same with `SIGSTOP`, and `SIGCONT` instead of the restart. The resumed
   node must publish nothing more (no event of its boot after the new leader's first
   one, no `online` of its own, no "mqtt connected" in its log) and stand by again.
3. **latency** — request → decision latency at `--latency-rate` on one daemon with its
   state on PostgreSQL next to one on SQLite, same load and sim market
   (`bench/latency.py`'s gpubroker phase, `--latency-duration` s after
   `--latency-warmup` s).

Figures of 1 and 2, per signal and over all: the **takeover** (the old leader's last
decision — the last decision event with its bootid received before the new boot's
`online` — to the first decision event with the new bootid), p50/p99/max; the signal to
the new `online` and to its first decision; **lost** requests (never answered, after
`--grace` s of re-sending at the end); **duplicate leases** (a request_id answered with
two lease_ids, two active leases for one request in the database, an answered lease the
database does not have or has under another id); request → decision latency outside
the takeovers (sent and answered between a recovery — no request older than 1 s
unanswered — and the next signal) and over all requests. To say why, also: each
leader term from the nodes' logs (claim won → `starting`, the leases restored, a
deposition the bench did not cause), the leader's `/livez` answer time (a stalled event
loop answers late), and PostgreSQL's lock waits (sampled from `pg_stat_activity`, each
waiter and blocker named by node and statement).

Prints the figures (`--json`: as JSON); pass/fail is not its business.

    cd /work/main && python bench/ha.py [--quick] [--kills 10] [--rate 200] [--json]
    python bench/ha.py --commit HEAD --keep      # the daemons from a clean worktree of HEAD
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import heapq
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import aiomqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parent.parent
sys.path.insert(0, str(SCRIPT.parent))

import latency as lat  # noqa: E402  (bench/latency.py)

PREFIX = lat.PREFIX
MQTT_LOG = logging.getLogger("bench.ha.mqtt")  # the scheduler's disconnects are counted
MQTT_LOG.addHandler(logging.NullHandler())
MQTT_LOG.propagate = False
DECISIONS = ("placement.decided", "placement.rejected")
RESEND_WINDOW = 2000  # re-sends awaiting their PUBACK
ADMIN_URL = os.environ.get("GPUBROKER_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
# Lines of a node's log worth keeping with their time (everything at warning and above
# is kept too).
NOTABLE = ("standing by", "leading the site", "starting", "mqtt connected", "ready",
           "stepped down; standing by again", "mqtt connection lost",
           "mqtt closed: this node does not lead the site", "shutting down", "stopped")


# The daemons' log lines carry wall-clock timestamps; their output reaches the bench in
# blocks (stdout is a pipe), so a line's time is its timestamp, on the monotonic clock.
WALL_MINUS_MONOTONIC = time.time() - time.monotonic()


def log_time(rec: dict[str, Any], default: float) -> float:
    try:
        wall = datetime.fromisoformat(str(rec["timestamp"]).replace("Z", "+00:00"))
    except (KeyError, ValueError):
        return default
    return wall.timestamp() - WALL_MINUS_MONOTONIC


def pct(xs: Sequence[float], q: float) -> float:
    return lat.percentile(sorted(xs), q)


def r3(x: float | None) -> float | None:
    return None if x is None or math.isnan(x) else round(x, 3)


# --------------------------------------------------------------------------------------
# a node: the daemon of bench/latency.py with a node name, its own HTTP port, PostgreSQL
# --------------------------------------------------------------------------------------

class Node(lat.Daemon):
    """One daemon of the site; its output goes to `<workdir>/<name>/node.log` (appended
    across restarts, each line prefixed with the bench's monotonic clock), and the
    notable lines are kept with their time."""

    def __init__(self, workdir: Path, mqtt_url: str, *, name: str, state_url: str,
                 args: argparse.Namespace) -> None:
        self.name = name
        self.http_port = lat.free_port()
        super().__init__(workdir / name, mqtt_url, seed=args.seed,
                         regions=args.regions_per_cloud, poll_interval=args.poll_interval,
                         state_url=state_url, node=name,
                         http_listen=f"127.0.0.1:{self.http_port}", root=args.daemon_tree)
        self.log_path = workdir / name / "node.log"
        self.notes: list[tuple[float, dict[str, Any]]] = []
        self.tracebacks = 0
        self.starts: list[float] = []
        self.exits: list[tuple[float, int | None, str]] = []  # (time, code, why)

    async def start(self) -> None:
        self.starts.append(time.monotonic())
        await super().start()

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with self.log_path.open("a", encoding="utf-8") as out:
            async for raw in self.proc.stdout:
                now = time.monotonic()
                line = raw.decode(errors="replace").rstrip()
                out.write(f"{now:.3f} {line}\n")
                self.tail = [*self.tail[-29:], line]
                if "Traceback" in line or "Future exception was never retrieved" in line:
                    self.tracebacks += 1
                try:
                    rec = json.loads(line)
                except ValueError:
                    self.levels["non-json"] += 1
                    continue
                if not isinstance(rec, dict):
                    continue
                level, event = rec.get("level", "?"), rec.get("event", "?")
                self.levels[level] += 1
                self.events[event] += 1
                if event in NOTABLE or level in ("warning", "error", "critical"):
                    self.notes.append((log_time(rec, now), rec))
                if event == "ready":
                    self.offers = rec.get("offers")
                    self.ready.set()

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    async def kill9(self) -> None:
        proc = self.proc
        assert proc is not None
        self.signal(signal.SIGKILL)
        await proc.wait()
        self.exits.append((time.monotonic(), proc.returncode, "kill -9"))
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(self._reader, 5)

    async def terminate(self) -> int | None:
        proc = self.proc
        if proc is not None and proc.returncode is not None:
            self.proc = None
            return proc.returncode  # not running (killed and not started again)
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.signal(signal.SIGCONT)  # a frozen node could not stop
        try:
            rc = await self.stop()
        except ProcessLookupError:  # it ended between the SIGTERM and the kill
            rc = None if proc is None else await proc.wait()
        self.exits.append((time.monotonic(), rc, "SIGTERM at the end"))
        return rc

    async def readyz(self, session: aiohttp.ClientSession) -> tuple[int, str] | None:
        try:
            async with session.get(f"http://127.0.0.1:{self.http_port}/readyz",
                                   timeout=aiohttp.ClientTimeout(total=1.0)) as resp:
                return resp.status, (await resp.text()).strip()
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None

    async def wait_role(self, role: str, timeout: float) -> float | None:
        """Wait until /readyz says `role` (`leader`: 200 ready; `standby`: 503 standby,
        naming a leader); returns the time (monotonic) or None on timeout or exit."""
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if self.proc is None or self.proc.returncode is not None:
                    return None
                got = await self.readyz(session)
                if got is not None:
                    status, text = got
                    if role == "leader" and status == 200:
                        return time.monotonic()
                    if role == "standby" and status == 503 and "standby (" in text \
                            and "leader: node" in text:
                        return time.monotonic()
                await asyncio.sleep(0.05)
        return None

    def terms(self) -> list[dict[str, Any]]:
        """Each time this node led: its epoch, when it won the claim, how long until it
        started serving (`starting`: the lease book read and restored), the leases it
        restored, and how long until its log says it stepped down (deposed)."""
        out: list[dict[str, Any]] = []
        for t, rec in self.notes:
            event = rec.get("event", "")
            if event == "leading the site":
                out.append({"t": t, "epoch": rec.get("epoch"), "claim_to_start_s": None,
                            "leases": None, "deposed_after_s": None, "why": None})
            elif out and event == "starting" and out[-1]["leases"] is None:
                out[-1]["claim_to_start_s"] = round(t - out[-1]["t"], 3)
                out[-1]["leases"] = rec.get("leases")
                out[-1]["boot_id"] = rec.get("boot_id")
            elif out and str(event).startswith("deposed") and \
                    out[-1]["deposed_after_s"] is None:
                out[-1]["deposed_after_s"] = round(t - out[-1]["t"], 3)
                out[-1]["why"] = str(rec.get("detail", ""))[:160]
        return out

    def notes_between(self, t0: float, t1: float = math.inf) -> list[dict[str, Any]]:
        return [rec for t, rec in self.notes if t0 <= t < t1]

    def summary(self) -> dict[str, Any]:
        warn = Counter(rec.get("event", "?") for _, rec in self.notes
                       if rec.get("level") in ("warning", "error", "critical"))
        return {"starts": len(self.starts), "levels": dict(self.levels),
                "tracebacks": self.tracebacks, "warnings_and_errors": dict(warn),
                "exits": [(c, why) for _, c, why in self.exits]}


# --------------------------------------------------------------------------------------
# the scheduler: open-loop load, re-sends with the same request_id, records everything
# --------------------------------------------------------------------------------------

@dataclass
class Req:
    topic: str
    payload: bytes
    first_sent: float
    next_due: float
    interval: float
    sends: int = 1
    answered_at: float | None = None
    kind: str | None = None
    bootid: str | None = None
    lease_ids: set[str] = field(default_factory=set)


@dataclass
class Status:
    t: float
    state: str
    boot_id: str
    node: str
    epoch: int
    retained: bool


class Scheduler:
    """The scheduler: one aiomqtt MQTT 5 client with a persistent session of its own
    (events published while it reconnects wait for it), reconnecting by itself;
    publishes `P/requests/<S>/place` (the request mix and scheduler ids of
    bench/latency.py) and listens on `P/events/+/+` and `P/status`. Every unanswered
    request is sent again, same request_id, after `resend_after` s (doubling up to
    `resend_max`), at once when `P/status` says `online` with a new boot_id, and at once
    after its own reconnect."""

    def __init__(self, host: str, port: int, *, rate: float, resend_after: float,
                 resend_max: float, tag: str) -> None:
        self.host, self.port = host, port
        self.rate = rate
        self.resend_after = resend_after
        self.resend_max = resend_max
        self.make = lat.place_requests(tag)
        self.client_id = f"bench-ha-scheduler-{tag}-{uuid.uuid4().hex[:8]}"
        self.requests: dict[str, Req] = {}
        self.unanswered: set[str] = set()
        self._order: list[str] = []  # request_ids in the order sent
        self._oldest = 0  # index in _order of the oldest request maybe unanswered
        self._heap: list[tuple[float, str]] = []
        self.event_ids: set[str] = set()
        self.duplicate_events = 0
        # every event received: (time, bootid, first time this event id was seen)
        self.events: list[tuple[float, str, bool]] = []
        self.decisions: list[tuple[float, str]] = []  # first receipt: (time, bootid)
        self.first_decision: dict[str, float] = {}  # bootid -> time
        self.other_events: Counter[str] = Counter()
        self.statuses: list[Status] = []
        self.online_boots: set[str] = set()
        self.resent = 0  # publishes beyond the first
        self.resent_on_online = 0
        self.resent_on_reconnect = 0
        self.publish_errors: Counter[str] = Counter()
        self.disconnects: list[tuple[float, str]] = []
        self.send_lag: list[float] = []
        self.t_load: tuple[float, float] = (math.nan, math.nan)
        self._stop = asyncio.Event()
        self._window = asyncio.Semaphore(lat.INFLIGHT_WINDOW)
        self._resend_window = asyncio.Semaphore(RESEND_WINDOW)
        self._queue: collections.deque[str] = collections.deque()
        self._queued: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._client: aiomqtt.Client | None = None
        self.connected = asyncio.Event()
        self._runner: asyncio.Task[None] | None = None
        self._resender: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Scheduler:
        self._runner = asyncio.create_task(self._run())
        async with asyncio.timeout(30):
            await self.connected.wait()
        self._resender = asyncio.create_task(self._resend())
        return self

    async def __aexit__(self, *exc: object) -> None:
        for t in [self._runner, self._resender, *self._tasks]:
            if t is not None:
                t.cancel()
        await asyncio.gather(*(t for t in [self._runner, self._resender, *self._tasks]
                               if t is not None), return_exceptions=True)

    def _new_client(self) -> aiomqtt.Client:
        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        props.SessionExpiryInterval = 3600
        client = aiomqtt.Client(
            self.host, self.port, identifier=self.client_id, clean_start=False,
            properties=props, protocol=aiomqtt.ProtocolVersion.V5, keepalive=30,
            timeout=30, logger=MQTT_LOG, max_inflight_messages=65535,
            max_queued_incoming_messages=0,
            socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        client.pending_calls_threshold = 10**9  # the window bounds them
        return client

    async def _run(self) -> None:
        connects = 0
        while True:
            client = self._new_client()
            try:
                async with client:
                    await client.subscribe(f"{PREFIX}/events/+/+", qos=1)
                    await client.subscribe(f"{PREFIX}/status", qos=1)
                    self._client = client
                    self.connected.set()
                    connects += 1
                    if connects > 1:  # what was in flight may be lost: again, now
                        self.resent_on_reconnect += self._all_again()
                    async for msg in client.messages:
                        self._handle(msg)
            except aiomqtt.MqttError as exc:
                self.disconnects.append((time.monotonic(), str(exc)[:200]))
            finally:
                self._client = None
                self.connected.clear()
                fut = getattr(client, "_disconnected", None)  # retrieve, or asyncio logs it
                if isinstance(fut, asyncio.Future) and fut.done() and not fut.cancelled():
                    fut.exception()
            await asyncio.sleep(0.2)

    # --- sending ------------------------------------------------------------------------

    def _publish(self, req: Req, window: asyncio.Semaphore) -> None:
        """Publish (a slot of `window` taken), QoS 1; the slot is freed at the PUBACK."""
        async def go() -> None:
            try:
                client = self._client
                if client is None:
                    raise aiomqtt.MqttError("not connected")
                await client.publish(req.topic, req.payload, qos=1, timeout=10)
            except aiomqtt.MqttError as exc:
                self.publish_errors[str(exc)[:80]] += 1  # the re-sends take care of it
            finally:
                window.release()

        t = asyncio.create_task(go())
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def run_load(self) -> None:
        """Send `rate`/s on a fixed schedule until `stop_sending()`."""
        t0 = time.monotonic() + 0.05
        i = 0
        while not self._stop.is_set():
            now = time.monotonic()
            due = t0 + i / self.rate
            if due > now:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(due - now):
                        await self._stop.wait()
                continue
            while t0 + i / self.rate <= now and not self._stop.is_set():
                topic, payload, rid = self.make(i)
                await self._window.acquire()
                sent = time.monotonic()
                self.send_lag.append(sent - (t0 + i / self.rate))
                req = Req(topic, payload, sent, sent + self.resend_after, self.resend_after)
                self.requests[rid] = req
                self._order.append(rid)
                self.unanswered.add(rid)
                heapq.heappush(self._heap, (req.next_due, rid))
                self._publish(req, self._window)
                i += 1
            await asyncio.sleep(0)
        self.t_load = (t0, time.monotonic())

    def stop_sending(self) -> None:
        self._stop.set()

    async def _resend(self) -> None:
        """Due re-sends into the queue every 50 ms; the queue goes out through a window
        of its own (RESEND_WINDOW publishes awaiting their PUBACK), so a burst of
        re-sends neither delays the load nor swamps the client."""
        while True:
            await asyncio.sleep(0.05)
            now = time.monotonic()
            while self._heap and self._heap[0][0] <= now:
                due, rid = heapq.heappop(self._heap)
                req = self.requests[rid]
                if req.answered_at is not None or due != req.next_due:
                    continue
                req.interval = min(req.interval * 2, self.resend_max)
                self._again(rid, req, now)
            while self._queue and not self._resend_window.locked():
                rid = self._queue.popleft()
                self._queued.discard(rid)
                req = self.requests[rid]
                if req.answered_at is not None:
                    continue
                await self._resend_window.acquire()
                req.sends += 1
                self.resent += 1
                self._publish(req, self._resend_window)

    def _again(self, rid: str, req: Req, now: float) -> bool:
        """Queue a re-send (once: a request already queued stays where it is)."""
        req.next_due = now + req.interval
        heapq.heappush(self._heap, (req.next_due, rid))
        if rid in self._queued:
            return False
        self._queued.add(rid)
        self._queue.append(rid)
        return True

    def _all_again(self) -> int:
        now = time.monotonic()
        return sum(self._again(rid, self.requests[rid], now) for rid in list(self.unanswered))

    # --- receiving ----------------------------------------------------------------------

    def _handle(self, msg: aiomqtt.Message) -> None:
        now = time.monotonic()
        payload = msg.payload
        if not isinstance(payload, bytes | bytearray):
            return
        topic = str(msg.topic)
        try:
            body = json.loads(payload)
        except ValueError:
            self.other_events["unparsable"] += 1
            return
        if topic == f"{PREFIX}/status":
            st = Status(now, body.get("state", "?"), body.get("boot_id", "?"),
                        body.get("node", "?"), int(body.get("epoch") or 0), bool(msg.retain))
            self.statuses.append(st)
            if st.state == "online" and st.boot_id not in self.online_boots:
                first = not self.online_boots
                self.online_boots.add(st.boot_id)
                if not first:  # the daemon is back, maybe without what it had received
                    self.resent_on_online += self._all_again()
            return
        kind = topic.rsplit("/", 1)[-1]
        eid, boot = body.get("id", ""), body.get("bootid", "?")
        first = eid not in self.event_ids
        self.events.append((now, boot, first))
        if not first:
            self.duplicate_events += 1
            return
        self.event_ids.add(eid)
        data = body.get("data") or {}
        rid = data.get("request_id")
        req = self.requests.get(rid) if isinstance(rid, str) else None
        if kind not in DECISIONS or req is None:
            self.other_events[kind] += 1
            return
        self.decisions.append((now, boot))
        self.first_decision.setdefault(boot, now)
        if kind == "placement.decided" and data.get("lease_id"):
            req.lease_ids.add(data["lease_id"])
        if req.answered_at is None:
            req.answered_at, req.kind, req.bootid = now, kind, boot
            self.unanswered.discard(rid)

    # --- questions ----------------------------------------------------------------------

    def leader_status(self) -> Status | None:
        """The last `online` on P/status."""
        return next((s for s in reversed(self.statuses) if s.state == "online"), None)

    def oldest_unanswered(self) -> float:
        """When the oldest unanswered request was first sent (inf: none)."""
        while self._oldest < len(self._order) and \
                self.requests[self._order[self._oldest]].answered_at is not None:
            self._oldest += 1
        if self._oldest == len(self._order):
            return math.inf
        return self.requests[self._order[self._oldest]].first_sent

    async def wait(self, cond: Any, timeout: float, step: float = 0.01) -> bool:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(step)
        return True

    def dump(self, path: Path) -> None:
        """Everything received and sent, for a look afterwards (--keep)."""
        with path.open("w", encoding="utf-8") as out:
            for s in self.statuses:
                out.write(json.dumps({"status": asdict(s)}) + "\n")
            for t, why in self.disconnects:
                out.write(json.dumps({"disconnect": t, "why": why}) + "\n")
            for rid, r in self.requests.items():
                out.write(json.dumps({"rid": rid, "first_sent": round(r.first_sent, 3),
                                      "sends": r.sends, "answered_at": r.answered_at,
                                      "kind": r.kind, "bootid": r.bootid,
                                      "lease_ids": sorted(r.lease_ids)}) + "\n")
            for t, boot, first in self.events:
                out.write(json.dumps({"event": round(t, 3), "bootid": boot,
                                      "first": first}) + "\n")


# --------------------------------------------------------------------------------------
# parts 1 and 2: kill -9 and SIGSTOP of the leader
# --------------------------------------------------------------------------------------

@dataclass
class Cycle:
    n: int
    signal: str
    old_node: str
    old_boot: str
    t_signal: float
    new_boot: str | None = None
    new_node: str | None = None
    t_new_online: float | None = None
    t_last_old: float | None = None
    t_first_new: float | None = None
    t_cont: float | None = None  # SIGCONT (stop)
    t_standby: float | None = None  # the signalled node stands by again
    t_drained: float | None = None  # the requests sent before the first new decision answered
    t_recovered: float | None = None  # no request older than 1 s unanswered any more
    resent_old_events: int = 0  # old-boot decisions first seen after the new online
    old_events_after_new: int = 0  # events of the old boot after the new first decision
    old_online_after_cont: int = 0  # `online` of the resumed node (stop)
    old_mqtt_connects_after_cont: int = 0  # "mqtt connected" in its log after SIGCONT
    old_stepped_down: str | None = None  # how its log says it stepped down (stop)
    leader_livez_max: float | None = None  # the new leader's slowest /livez until the next
    new_leader_leases: int | None = None  # the leases the new leader restored
    new_claim_to_start: float | None = None  # its claim won → `starting` (leases restored)
    note: str = ""

    @property
    def takeover(self) -> float | None:
        if self.t_first_new is None or self.t_last_old is None:
            return None
        return self.t_first_new - self.t_last_old

    def row(self) -> dict[str, Any]:
        def d(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round(a - b, 3)

        return {"n": self.n, "old_node": self.old_node, "new_node": self.new_node,
                "takeover_s": r3(self.takeover),
                "signal_to_online_s": d(self.t_new_online, self.t_signal),
                "signal_to_first_decision_s": d(self.t_first_new, self.t_signal),
                "last_old_decision_before_signal_s": d(self.t_signal, self.t_last_old),
                "backlog_answered_s": d(self.t_drained, self.t_first_new),
                "recovered_s": d(self.t_recovered, self.t_first_new),
                "back_to_standby_s": d(self.t_standby, self.t_cont or self.t_first_new),
                "resent_old_events": self.resent_old_events,
                "old_events_after_new_first": self.old_events_after_new,
                "old_online_after_cont": self.old_online_after_cont,
                "old_mqtt_connects_after_cont": self.old_mqtt_connects_after_cont,
                "old_stepped_down": self.old_stepped_down,
                "new_leader_livez_max_s": r3(self.leader_livez_max),
                "new_leader_leases": self.new_leader_leases,
                "new_claim_to_start_s": r3(self.new_claim_to_start), "note": self.note}


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v) - idle, sum(v)


LOCK_WAITS = """
SELECT w.client_port, left(w.query, 200), EXTRACT(EPOCH FROM now() - w.query_start),
       b.client_port, left(b.query, 200), b.state, EXTRACT(EPOCH FROM now() - b.xact_start)
FROM pg_stat_activity w
JOIN LATERAL unnest(pg_blocking_pids(w.pid)) AS bp(pid) ON true
JOIN pg_stat_activity b ON b.pid = bp.pid
WHERE w.datname = current_database() AND w.wait_event_type = 'Lock'
"""


def statement_kind(query: str) -> str:
    """What a node's statement is, in the words of broker/ha.py and broker/pgstore.py."""
    for needle, kind in (("UPDATE leadership SET expires_at = now() +", "renew"),
                         ("INSERT INTO leadership", "claim"),
                         ("UPDATE leadership SET expires_at = now() WHERE", "release"),
                         ("FOR SHARE", "fence"), ("INSERT INTO leases", "commit"),
                         ("INSERT INTO outbox", "commit"), ("INSERT INTO nodes", "heartbeat"),
                         ("DELETE FROM outbox", "ack"), ("FROM leadership", "leader read")):
        if needle in query:
            return kind
    return " ".join(query.split())[:40] or "?"


def socket_owners(nodes: list[Node], ports: set[int]) -> dict[int, str]:
    """Which node's process holds the local TCP port (its end of a PostgreSQL session)."""
    inode_of: dict[str, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in list(f)[1:]:
                cols = line.split()
                port = int(cols[1].rsplit(":", 1)[1], 16)
                if port in ports:
                    inode_of[cols[9]] = port
    owners: dict[int, str] = {}
    for node in nodes:
        if node.proc is None:
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{node.proc.pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{node.proc.pid}/fd/{fd}")
                    if link.startswith("socket:[") and link[8:-1] in inode_of:
                        owners[inode_of[link[8:-1]]] = node.name
    return owners


class LockWatch:
    """Every 0.1 s, the sessions of the site's database that wait for a lock, each with
    the sessions blocking it (`pg_blocking_pids`): which node and which statement (the
    blocker's current or last one, and whether its transaction is still open)."""

    def __init__(self, url: str, nodes: list[Node]) -> None:
        self.url = url
        self.nodes = nodes
        self.samples: list[tuple[float, str, str, float, str, str, str, float]] = []
        self.stop = threading.Event()
        self.error: str | None = None

    def run(self) -> None:
        import psycopg

        try:
            self._run()
        except psycopg.Error as exc:  # the database dropped at the end, or gone
            if not self.stop.is_set():
                self.error = f"{type(exc).__name__}: {exc}"

    def _run(self) -> None:
        import psycopg

        with psycopg.connect(self.url, autocommit=True, connect_timeout=5,
                             application_name="bench-lockwatch") as conn:
            while not self.stop.wait(0.1):
                rows = conn.execute(LOCK_WAITS).fetchall()
                if not rows:
                    continue
                now = time.monotonic()
                owners = socket_owners(self.nodes, {int(p) for r in rows for p in (r[0], r[3])
                                                    if p is not None})
                for wport, wq, waited, bport, bq, bstate, bxact in rows:
                    self.samples.append((now, owners.get(wport, "?"), statement_kind(wq or ""),
                                         float(waited or 0), owners.get(bport, "?"),
                                         statement_kind(bq or ""), str(bstate),
                                         float(bxact or 0)))

    def summary(self) -> dict[str, Any]:
        """Waits counted once each (the longest sample of a waiter and its blocker)."""
        pairs: Counter[str] = Counter()
        longest: dict[str, float] = {}
        for _t, wn, wk, waited, bn, bk, bstate, _x in self.samples:
            key = f"{wn} {wk} waited for {bn} {bk} ({bstate})"
            pairs[key] += 1
            longest[key] = max(longest.get(key, 0.0), waited)
        return {"samples": len(self.samples), "error": self.error,
                "by_kind": {k: {"samples": n, "longest_s": round(longest[k], 2)}
                            for k, n in pairs.most_common()}}


def mosquitto_summary(path: Path) -> dict[str, int]:
    """mosquitto's log lines (connections, disconnections, warnings), counted by kind:
    timestamps, ports and the bench's random client id parts left out."""
    kinds: Counter[str] = Counter()
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            text = re.sub(r"^\d+: ", "", line)
            if text.startswith("New connection from"):
                continue  # each is followed by "New client connected ..."
            text = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1", text)
            text = re.sub(r" \(p\d, c\d, k\d+\)", "", text)
            text = re.sub(r"bench-ha-scheduler-\S+?(?=[ .,]|$)", "<scheduler>", text)
            kinds[text.rstrip(".")] += 1
    return dict(kinds.most_common())


async def watch_livez(nodes: list[Node], samples: dict[str, list[tuple[float, float]]]
                      ) -> None:
    """GET /livez of every node every 0.2 s: how long its event loop takes to answer
    (a stalled loop answers late); failures (a node down or frozen) are not kept."""
    async with aiohttp.ClientSession() as session:
        async def one(node: Node) -> None:
            url = f"http://127.0.0.1:{node.http_port}/livez"
            while True:
                t = time.monotonic()
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                    async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as r:
                        await r.read()
                        samples[node.name].append((t, time.monotonic() - t))
                await asyncio.sleep(max(0.0, 0.2 - (time.monotonic() - t)))

        await asyncio.gather(*(one(n) for n in nodes))


async def failover_part(mode: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    sig = signal.SIGKILL if mode == "kill" else signal.SIGSTOP
    pdir = workdir / mode
    pdir.mkdir()
    mosq = lat.Mosquitto(pdir, log_types=("error", "warning", "notice"))
    mosq.start()
    cycles: list[Cycle] = []
    nodes: list[Node] = []
    notes: list[str] = []
    frozen: Node | None = None
    locks: LockWatch | None = None
    livez: dict[str, list[tuple[float, float]]] = {"node-a": [], "node-b": []}
    out: dict[str, Any] = {"part": mode, "signal": sig.name, "notes": notes}
    t_begin = time.monotonic()
    cpu0 = cpu_jiffies()
    watcher: asyncio.Task[None] | None = None
    try:
        with lat.fresh_database(args.admin_url, prefix=f"gpubroker_ha_{mode}") as url:
            a = Node(pdir, mosq.url, name="node-a", state_url=url, args=args)
            b = Node(pdir, mosq.url, name="node-b", state_url=url, args=args)
            nodes = [a, b]
            by_name = {n.name: n for n in nodes}
            locks = LockWatch(url, nodes)
            lock_thread = threading.Thread(target=locks.run, name="lockwatch", daemon=True)
            lock_thread.start()
            host, port = lat.host_port(mosq.url)
            async with Scheduler(host, port, rate=args.rate, resend_after=args.resend_after,
                                 resend_max=args.resend_max, tag=mode) as sched:
                await a.start()
                if await a.wait_role("leader", 180) is None:
                    raise RuntimeError("node-a did not lead:\n" + "\n".join(a.tail))
                out["first_start_to_ready_s"] = round(time.monotonic() - a.starts[0], 2)
                await b.start()
                if await b.wait_role("standby", 120) is None:
                    raise RuntimeError("node-b did not stand by:\n" + "\n".join(b.tail))
                await a.settle()
                watcher = asyncio.create_task(watch_livez(nodes, livez))
                load = asyncio.create_task(sched.run_load())
                caught_up = lambda: sched.oldest_unanswered() > time.monotonic() - 1.0  # noqa: E731
                for n in range(args.kills):
                    # Before each signal: the last takeover's backlog is answered (every
                    # request sent more than 1 s ago), the load has run undisturbed for
                    # `--steady` s, and the other node stands by.
                    if await sched.wait(caught_up, args.settle_timeout, 0.05):
                        if cycles:
                            cycles[-1].t_recovered = time.monotonic()
                    else:
                        notes.append(f"before signal {n}: requests older than 1 s still "
                                     f"unanswered after {args.settle_timeout:g} s")
                    await asyncio.sleep(args.steady)
                    st = sched.leader_status()
                    if st is None or st.node not in by_name:
                        raise RuntimeError(f"no online status of a node seen: {st}")
                    leader = by_name[st.node]
                    standby = b if leader is a else a
                    if await standby.wait_role("standby", 0.5) is None:
                        notes.append(f"before signal {n}: {standby.name} does not say standby")
                    cyc = Cycle(n, sig.name, leader.name, st.boot_id, time.monotonic())
                    cycles.append(cyc)
                    if mode == "kill":
                        await leader.kill9()
                    else:
                        leader.signal(signal.SIGSTOP)
                        frozen = leader
                    # The new boot's `online`, then its first decision.
                    def new_online(c: Cycle = cyc) -> Status | None:
                        return next((s for s in sched.statuses if s.state == "online"
                                     and s.boot_id != c.old_boot and s.t > c.t_signal), None)

                    if not await sched.wait(lambda: new_online() is not None,
                                            args.takeover_timeout):
                        cyc.note += f"no new online within {args.takeover_timeout:g} s; "
                        break
                    new = new_online()
                    assert new is not None
                    cyc.new_boot, cyc.new_node, cyc.t_new_online = new.boot_id, new.node, new.t
                    if not await sched.wait(lambda c=cyc: c.new_boot in sched.first_decision,
                                            args.takeover_timeout):
                        cyc.note += f"no decision of the new boot within " \
                                    f"{args.takeover_timeout:g} s; "
                        break
                    cyc.t_first_new = sched.first_decision[new.boot_id]
                    if new.node != standby.name:
                        cyc.note += f"the new leader is {new.node}, not {standby.name}; "
                    if mode == "kill":
                        await leader.start()
                    else:
                        cyc.t_cont = time.monotonic()
                        leader.signal(signal.SIGCONT)
                        frozen = None
                    cyc.t_standby = await leader.wait_role("standby", 120)
                    if cyc.t_standby is None:
                        cyc.note += f"{leader.name} not standing by within 120 s; "
                        break
                if frozen is not None:
                    notes.append(f"{frozen.name} was still frozen when the cycles stopped: "
                                 "SIGCONT")
                    frozen.signal(signal.SIGCONT)
                    frozen = None
                for node in nodes:
                    if node.proc is not None and node.proc.returncode is not None:
                        notes.append(f"{node.name} was down when the cycles stopped: "
                                     "started again")
                        await node.start()
                # the tail: steady load, then the grace period for the last answers
                if await sched.wait(caught_up, args.settle_timeout, 0.05) and cycles:
                    cycles[-1].t_recovered = time.monotonic()
                await asyncio.sleep(args.steady)
                sched.stop_sending()
                await load
                t_grace = time.monotonic()
                await sched.wait(lambda: not sched.unanswered, args.grace, 0.1)
                out["grace_used_s"] = round(time.monotonic() - t_grace, 2)
                await asyncio.sleep(1.0)  # late duplicates
                watcher.cancel()
                for node in nodes:
                    await node.terminate()
                locks.stop.set()
                lock_thread.join(5)
                out["lock_waits"] = locks.summary()
                db = await asyncio.to_thread(database_check, url, sched)
                if args.keep:
                    sched.dump(pdir / "scheduler.jsonl")
                    with (pdir / "lockwaits.jsonl").open("w") as f:
                        for row in locks.samples:
                            f.write(json.dumps(row) + "\n")
            out.update(analyse(mode, sched, cycles, nodes, db, livez))
    finally:
        if watcher is not None:
            watcher.cancel()
        if locks is not None:
            locks.stop.set()
        for node in nodes:
            if node.proc is not None:
                with contextlib.suppress(Exception):
                    await node.terminate()
        mosq.stop()
    cpu1 = cpu_jiffies()
    out["machine_busy_pct"] = round(100 * (cpu1[0] - cpu0[0]) / max(1, cpu1[1] - cpu0[1]), 1)
    out["mosquitto_log"] = mosquitto_summary(pdir / "mosquitto.log")
    out["wall_s"] = round(time.monotonic() - t_begin, 1)
    return out


def database_check(url: str, sched: Scheduler) -> dict[str, Any]:
    """What the database holds at the end, against what the scheduler was told."""
    import psycopg

    with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
        rows = conn.execute("SELECT scheduler, request_id, lease_id, state, leader_epoch "
                            "FROM leases").fetchall()
        lead = conn.execute("SELECT node, epoch FROM leadership").fetchall()
    by_request: dict[str, list[tuple[str, str, int]]] = {}
    for _s, rid, lease_id, state, epoch in rows:
        by_request.setdefault(rid, []).append((lease_id, state, int(epoch)))
    two_active = {rid: [x[0] for x in v] for rid, v in by_request.items()
                  if sum(1 for x in v if x[1] == "active") > 1}
    missing: list[str] = []
    other_id: list[str] = []
    unknown: list[str] = []
    for rid, req in sched.requests.items():
        db_ids = {x[0] for x in by_request.get(rid, [])}
        for lease_id in req.lease_ids:
            if lease_id not in db_ids:
                (other_id if db_ids else missing).append(rid)
        if db_ids and not (db_ids <= req.lease_ids):
            unknown.append(rid)  # a lease the scheduler was never told of
    epochs = Counter(int(x[2]) for v in by_request.values() for x in v)
    return {"leases": len(rows), "active": sum(1 for r in rows if r[3] == "active"),
            "two_active_for_one_request": len(two_active),
            "two_active_examples": dict(list(two_active.items())[:3]),
            "answered_lease_not_in_db": len(set(missing)),
            "answered_lease_under_other_id": len(set(other_id)),
            "db_lease_never_answered": len(set(unknown)),
            "db_lease_never_answered_examples": sorted(set(unknown))[:3],
            "leases_by_writer_epoch": dict(sorted(epochs.items())),
            "leadership": [list(x) for x in lead]}


def analyse(mode: str, sched: Scheduler, cycles: list[Cycle], nodes: list[Node],
            db: dict[str, Any], livez: dict[str, list[tuple[float, float]]]
            ) -> dict[str, Any]:
    by_node = {n.name: n for n in nodes}
    for c in cycles:
        if c.t_new_online is not None:
            old = [t for t, boot in sched.decisions if boot == c.old_boot
                   and t < c.t_new_online]
            c.t_last_old = old[-1] if old else None
            c.resent_old_events = sum(1 for t, boot in sched.decisions
                                      if boot == c.old_boot and t >= c.t_new_online)
        if c.t_first_new is not None:
            c.old_events_after_new = sum(1 for t, boot, _f in sched.events
                                         if boot == c.old_boot and t > c.t_first_new)
            backlog = [r.answered_at for r in sched.requests.values()
                       if r.first_sent < c.t_first_new and r.answered_at is not None
                       and r.answered_at >= c.t_signal]
            c.t_drained = max(backlog, default=c.t_first_new)
        if c.t_cont is not None:
            end = cycles[c.n + 1].t_signal if c.n + 1 < len(cycles) else math.inf
            c.old_online_after_cont = sum(1 for s in sched.statuses if s.state == "online"
                                          and s.node == c.old_node and c.t_cont < s.t < end)
            notes = by_node[c.old_node].notes_between(c.t_cont, end)
            c.old_mqtt_connects_after_cont = sum(1 for r in notes
                                                 if r.get("event") == "mqtt connected")
            down = [r.get("event", "") for r in notes
                    if "standing by again" in str(r.get("event", ""))]
            c.old_stepped_down = down[0] if down else None
    # /livez of the leader: the first from the start of the load, each new one from the
    # signal that made it leader, to the next signal
    t0, t_end = sched.t_load
    periods: list[tuple[Cycle | None, str, float, float]] = []
    who, since, after = (cycles[0].old_node if cycles else "node-a"), t0, None
    for c in cycles:
        periods.append((after, who, since, c.t_signal))
        if c.new_node is None:
            who = ""
            break
        who, since, after = c.new_node, c.t_signal, c
    if who:
        periods.append((after, who, since, t_end))
    slow, worst = 0, 0.0
    for after_cycle, name, p0, p1 in periods:
        xs = [dt for t, dt in livez.get(name, []) if p0 <= t < p1]
        slow += sum(1 for dt in xs if dt > 1.0)
        worst = max([worst, *xs])
        if after_cycle is not None:
            after_cycle.leader_livez_max = max(xs, default=None)
    # each leader term from the nodes' logs; a deposition the bench did not cause (every
    # one after a kill; after a SIGSTOP, all but the resumed node's own)
    terms: list[dict[str, Any]] = []
    for node in nodes:
        for term in node.terms():
            term["node"] = node.name
            terms.append(term)
    terms.sort(key=lambda x: x["t"])
    boots = {t.get("boot_id"): t for t in terms}
    for c in cycles:
        new_term = boots.get(c.new_boot)
        if new_term is not None:
            c.new_leader_leases = new_term["leases"]
            c.new_claim_to_start = new_term["claim_to_start_s"]
    unplanned = []
    for term in terms:
        if term["deposed_after_s"] is None:
            continue
        at = term["t"] + term["deposed_after_s"]
        if any(c.t_cont is not None and c.old_node == term["node"]
               and c.t_signal <= at <= c.t_cont + 10 for c in cycles):
            continue
        unplanned.append(term)
    never_decided = [t for t in unplanned if t.get("boot_id") not in sched.first_decision]
    starts = [t["claim_to_start_s"] for t in terms if t["claim_to_start_s"] is not None]
    takeovers = [c.takeover for c in cycles if c.takeover is not None]
    to_first = [c.t_first_new - c.t_signal for c in cycles if c.t_first_new is not None]
    to_online = [c.t_new_online - c.t_signal for c in cycles if c.t_new_online is not None]
    # latency outside takeovers: sent and answered between the recovery from a takeover
    # (no request older than 1 s unanswered; the start of the load) and the next signal
    windows, start = [], t0
    for c in cycles:
        windows.append((start, c.t_signal))
        start = c.t_recovered if c.t_recovered is not None else math.inf
    windows.append((start, math.inf))
    steady, all_lat = [], []
    for r in sched.requests.values():
        if r.answered_at is None:
            continue
        ms = (r.answered_at - r.first_sent) * 1000
        all_lat.append(ms)
        if any(w0 <= r.first_sent and r.answered_at < w1 for w0, w1 in windows):
            steady.append(ms)
    dup_leases = {rid: sorted(r.lease_ids) for rid, r in sched.requests.items()
                  if len(r.lease_ids) > 1}
    kinds = Counter(r.kind for r in sched.requests.values() if r.kind is not None)

    def stats(xs: list[float]) -> dict[str, float | None]:
        return {"p50": r3(pct(xs, 50)), "p99": r3(pct(xs, 99)),
                "max": r3(max(xs)) if xs else None}

    lag = sorted(x * 1000 for x in sched.send_lag)
    return {
        "cycles": [c.row() for c in cycles],
        "takeovers": len(takeovers), "signals": len(cycles),
        "same_boot_offline_online": sum(
            1 for i, st in enumerate(sched.statuses) if st.state == "offline" and any(
                x.state == "online" and x.boot_id == st.boot_id for x in sched.statuses[i + 1:])),
        "unplanned_new_boots": len(sched.online_boots) - 1 - len(
            [c for c in cycles if c.new_boot is not None]),
        "leader_livez_max_s": r3(worst), "leader_livez_over_1s": slow,
        "leader_terms": len(terms), "deposed_unplanned": len(unplanned),
        "deposed_unplanned_never_decided": len(never_decided),
        "deposed_unplanned_examples": [
            {k: t.get(k) for k in ("node", "epoch", "leases", "claim_to_start_s",
                                   "deposed_after_s", "why")} for t in unplanned[:3]],
        "claim_to_start_s": {"p50": r3(pct(starts, 50)), "max": r3(max(starts, default=math.nan)),
                             "n": len(starts)},
        "max_leases_restored": max((t["leases"] or 0 for t in terms), default=0),
        "takeover_s": stats(takeovers),
        "signal_to_first_decision_s": stats(to_first),
        "signal_to_online_s": stats(to_online),
        "sent": len(sched.requests), "answered": len(sched.requests) - len(sched.unanswered),
        "lost": len(sched.unanswered),
        "lost_examples": sorted(sched.unanswered)[:5],
        "answers": dict(kinds),
        "resent_publishes": sched.resent, "resent_on_online": sched.resent_on_online,
        "requests_sent_more_than_once": sum(1 for r in sched.requests.values()
                                            if r.sends > 1),
        "duplicate_leases_events": len(dup_leases),
        "duplicate_leases_examples": dict(list(dup_leases.items())[:3]),
        "duplicate_leases_db": db["two_active_for_one_request"],
        "duplicate_events": sched.duplicate_events,
        "other_events": dict(sched.other_events),
        "latency_outside_ms": {**stats(steady), "n": len(steady)},
        "latency_all_ms": {**stats(all_lat), "n": len(all_lat)},
        "load_s": r3(t_end - t0), "send_rate": r3(len(sched.requests) / (t_end - t0)),
        "send_lag_p99_ms": r3(pct(lag, 99)),
        "publish_errors": dict(sched.publish_errors),
        "scheduler_disconnects": [why for _, why in sched.disconnects],
        "resent_on_reconnect": sched.resent_on_reconnect,
        "database": db,
        "nodes": {n.name: n.summary() for n in nodes},
    }


# --------------------------------------------------------------------------------------
# part 3: PostgreSQL next to SQLite
# --------------------------------------------------------------------------------------

async def latency_part(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    pdir = workdir / "latency"
    pdir.mkdir()
    mosq = lat.Mosquitto(pdir)
    mosq.start()
    ns = argparse.Namespace(rate=args.latency_rate, duration=args.latency_duration,
                            warmup=args.latency_warmup, seed=args.seed,
                            regions_per_cloud=args.regions_per_cloud, nodelay=True)
    poll = max(60.0, 3 * (args.latency_warmup + args.latency_duration) + 30)
    results: list[lat.PhaseResult] = []
    try:
        for _ in range(args.latency_rounds):
            results.append(await lat.gpubroker(
                mosq, ns, pdir, name=f"sqlite-{len(results)}", poll_interval=poll,
                http_listen=f"127.0.0.1:{lat.free_port()}", root=args.daemon_tree))
            with lat.fresh_database(args.admin_url, prefix="gpubroker_ha_latency") as url:
                results.append(await lat.gpubroker(
                    mosq, ns, pdir, name=f"postgresql-{len(results)}", poll_interval=poll,
                    state_url=url, http_listen=f"127.0.0.1:{lat.free_port()}",
                    root=args.daemon_tree))
    finally:
        mosq.stop()
    phases = [asdict(r) for r in results]
    sq = [r for r in results if r.name.startswith("sqlite")]
    pg = [r for r in results if r.name.startswith("postgresql")]

    def med(rs: list[lat.PhaseResult], attr: str) -> float:
        xs: list[float] = sorted(float(getattr(r, attr)) for r in rs)
        return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2

    out: dict[str, Any] = {"part": "latency", "rate": args.latency_rate,
                           "duration_s": args.latency_duration,
                           "warmup_s": args.latency_warmup, "rounds": args.latency_rounds,
                           "phases": phases}
    for key, rs in (("sqlite", sq), ("postgresql", pg)):
        out[key] = {"p50_ms": r3(med(rs, "p50_ms")), "p99_ms": r3(med(rs, "p99_ms")),
                    "missing": sum(r.missing_total for r in rs)}
    out["ratio_p50"] = r3(lat.ratio(out["postgresql"]["p50_ms"], out["sqlite"]["p50_ms"]))
    out["ratio_p99"] = r3(lat.ratio(out["postgresql"]["p99_ms"], out["sqlite"]["p99_ms"]))
    return out


# --------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------

def f(x: Any, nd: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def print_failover(p: dict[str, Any], args: argparse.Namespace) -> None:
    what = "kill -9" if p["part"] == "kill" else "SIGSTOP (SIGCONT after the takeover)"
    print(f"\n== {p['part']}: leader {what} x{args.kills} under {args.rate:g} req/s; "
          f"re-send after {args.resend_after:g} s doubling to {args.resend_max:g} s, and at "
          f"once at a new online; first leader ready {p.get('first_start_to_ready_s')} s "
          f"after its start; machine busy {p.get('machine_busy_pct')} % of "
          f"{os.cpu_count()} CPUs over the part")
    stop = p["part"] == "stop"
    head = ("#", "old→new", "takeover s", "sig→online s", "sig→1st new s", "backlog s",
            "recovered s", "standby s", "resent old", "old ev after", "old online", "old mqtt",
            "livez max s", "leases", "claim→start s")
    rows = [head]
    for c in p["cycles"]:
        rows.append((str(c["n"]), f"{c['old_node'][-1]}→{(c['new_node'] or '?')[-1]}",
                     f(c["takeover_s"]), f(c["signal_to_online_s"]),
                     f(c["signal_to_first_decision_s"]), f(c["backlog_answered_s"]),
                     f(c["recovered_s"]), f(c["back_to_standby_s"]), str(c["resent_old_events"]),
                     str(c["old_events_after_new_first"]),
                     str(c["old_online_after_cont"]) if stop else "-",
                     str(c["old_mqtt_connects_after_cont"]) if stop else "-",
                     f(c["new_leader_livez_max_s"]), str(c["new_leader_leases"] or "-"),
                     f(c["new_claim_to_start_s"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    for c in p["cycles"]:
        if c["note"]:
            print(f"  cycle {c['n']}: {c['note']}")
    t, s1, so = p["takeover_s"], p["signal_to_first_decision_s"], p["signal_to_online_s"]
    print(f"takeover (old leader's last decision → new leader's first): p50 {f(t['p50'])} s, "
          f"p99 {f(t['p99'])} s, max {f(t['max'])} s over {p['takeovers']} of "
          f"{p['signals']} signals; signal → new online p50 {f(so['p50'])} s, "
          f"→ first decision p50 {f(s1['p50'])} s, max {f(s1['max'])} s")
    cs = p["claim_to_start_s"]
    print(f"leader terms {p['leader_terms']} (claims won); deposed without a signal "
          f"{p['deposed_unplanned']}, {p['deposed_unplanned_never_decided']} of them before "
          f"deciding anything; new boots online beyond the signals "
          f"{p['unplanned_new_boots']}; claim won → 'starting' p50 {f(cs['p50'])} s, max "
          f"{f(cs['max'])} s (up to {p['max_leases_restored']} leases restored); leader "
          f"/livez slowest {f(p['leader_livez_max_s'])} s, {p['leader_livez_over_1s']} "
          f"answers over 1 s; P/status offline then online again with the same boot "
          f"{p['same_boot_offline_online']}")
    for ex in p["deposed_unplanned_examples"]:
        print(f"  e.g. {ex}")
    db = p["database"]
    print(f"requests: sent {p['sent']} in {f(p['load_s'], 1)} s ({f(p['send_rate'], 1)}/s, "
          f"send lag p99 {f(p['send_lag_p99_ms'], 1)} ms), answered {p['answered']}, "
          f"LOST {p['lost']} (grace used {p.get('grace_used_s')} s); answers {p['answers']}")
    print(f"duplicate leases: {p['duplicate_leases_events']} request_ids answered with two "
          f"lease_ids, {db['two_active_for_one_request']} with two active leases in the "
          f"database; answered leases not in the database {db['answered_lease_not_in_db']}, "
          f"under another id {db['answered_lease_under_other_id']}; database leases never "
          f"answered {db['db_lease_never_answered']}")
    print(f"re-sends: {p['resent_publishes']} publishes ({p['resent_on_online']} at a new "
          f"online, {p['resent_on_reconnect']} after the scheduler's reconnects), "
          f"{p['requests_sent_more_than_once']} requests sent more than once; events "
          f"received twice (same id) {p['duplicate_events']}; other events "
          f"{p['other_events'] or 'none'}; publish errors {p['publish_errors'] or 'none'}; "
          f"scheduler disconnects {len(p['scheduler_disconnects'])}")
    lo, la = p["latency_outside_ms"], p["latency_all_ms"]
    print(f"request → decision outside takeovers: p50 {f(lo['p50'], 1)} ms, p99 "
          f"{f(lo['p99'], 1)} ms (n={lo['n']}); all requests: p50 {f(la['p50'], 1)} ms, "
          f"p99 {f(la['p99'], 1)} ms, max {f(la['max'], 1)} ms")
    print(f"database at the end: {db['leases']} leases ({db['active']} active), by writer "
          f"epoch {db['leases_by_writer_epoch']}, leadership {db['leadership']}")
    for name, n in p["nodes"].items():
        print(f"{name}: {n['starts']} starts, exits {n['exits']}, log levels {n['levels']}, "
              f"Traceback lines {n['tracebacks']}, warnings/errors "
              f"{n['warnings_and_errors'] or 'none'}")
    lw = p.get("lock_waits") or {}
    print(f"PostgreSQL lock waits (sampled every 0.1 s; a wait counts once per sample): "
          f"{lw.get('samples', 0)} samples" + (f", sampler failed: {lw['error']}"
                                              if lw.get("error") else ""))
    for kind, v in (lw.get("by_kind") or {}).items():
        print(f"  {kind}: {v['samples']} samples, longest {v['longest_s']} s")
    print(f"mosquitto log: {p.get('mosquitto_log') or 'nothing'}")
    for note in p.get("notes", []):
        print(f"note: {note}")


def print_latency(p: dict[str, Any]) -> None:
    print(f"\n== latency: {p['rate']:g} req/s open loop, {p['duration_s']:g} s measured after "
          f"{p['warmup_s']:g} s warm-up, one daemon each, same sim market and load")
    head = ("phase", "sent", "answered", "missing", "p50 ms", "p90 ms", "p99 ms", "max ms",
            "sent/s", "cpu% (daemon,mosq,bench)")
    rows = [head]
    for r in p["phases"]:
        rows.append((r["name"], str(r["sent"]), str(r["answered"]), str(r["missing"]),
                     f(r["p50_ms"]), f(r["p90_ms"]), f(r["p99_ms"]), f(r["max_ms"], 1),
                     f(r["send_rate"], 1), ",".join(f"{v:.0f}" for v in r["cpu"].values())))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(r, widths, strict=True))))
    print(f"PostgreSQL/SQLite: p50 {f(p['ratio_p50'])}x, p99 {f(p['ratio_p99'])}x "
          f"(SQLite p50 {f(p['sqlite']['p50_ms'], 1)} / p99 {f(p['sqlite']['p99_ms'], 1)} ms, "
          f"PostgreSQL p50 {f(p['postgresql']['p50_ms'], 1)} / p99 "
          f"{f(p['postgresql']['p99_ms'], 1)} ms)")
    for r in p["phases"]:
        print(f"{r['name']} p50 ms per {lat.WINDOW_S:g} s of sends (warm-up first): "
              + " ".join(f"{x:g}" for x in r["p50_by_window_ms"]))


def code_version(tree: Path) -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(tree), *a], capture_output=True, text=True,
                              check=False).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return f"{tree} (not a git checkout)"
    dirty = git("status", "--porcelain", "--", "broker", "adapters", "policies")
    if not dirty:
        return f"{tree} at {commit}"
    files = " ".join(line.split()[-1] for line in dirty.splitlines())
    return f"{tree} at {commit} (uncommitted changes: {files})"


# --------------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", choices=["kill", "stop", "latency"],
                   default=["kill", "stop", "latency"], help="which parts (all three)")
    p.add_argument("--kills", type=int, default=None,
                   help="signals to the leader per part (10; --quick 3)")
    p.add_argument("--rate", type=float, default=200.0,
                   help="placement requests per second during the kills (200)")
    p.add_argument("--steady", type=float, default=2.0,
                   help="seconds of load before each signal, after the settle (2)")
    p.add_argument("--resend-after", type=float, default=2.0,
                   help="the scheduler re-sends an unanswered request after this many s (2)")
    p.add_argument("--resend-max", type=float, default=15.0,
                   help="... doubling up to this many s apart (15, as broker/client.py)")
    p.add_argument("--grace", type=float, default=None,
                   help="seconds after the load for the last answers (20; --quick 15)")
    p.add_argument("--settle-timeout", type=float, default=5.0,
                   help="wait at most this long before a signal for the requests older "
                        "than 1 s to be answered (5 s; the signal comes anyway after it)")
    p.add_argument("--takeover-timeout", type=float, default=30.0,
                   help="stop the signals when a takeover (the new boot's online, then its "
                        "first decision) takes longer than this (30 s)")
    p.add_argument("--latency-rate", type=float, default=500.0,
                   help="requests per second of the latency part (500)")
    p.add_argument("--latency-duration", type=float, default=None,
                   help="measured seconds per latency phase (10; --quick 5)")
    p.add_argument("--latency-warmup", type=float, default=2.0,
                   help="warm-up seconds per latency phase (2)")
    p.add_argument("--latency-rounds", type=int, default=1,
                   help="SQLite + PostgreSQL pairs in the latency part, alternating (1); "
                        "the figures are their medians")
    p.add_argument("--regions-per-cloud", type=int, default=88,
                   help="sim regions per cloud (88: about 20,000 offers, as latency.py)")
    p.add_argument("--seed", type=int, default=7, help="sim seed (7)")
    p.add_argument("--poll-interval", type=float, default=300.0,
                   help="poll interval of the HA nodes (300 s: only a new leader's first "
                        "poll lands in the load)")
    p.add_argument("--admin-url", default=ADMIN_URL,
                   help="PostgreSQL role that may create databases ($GPUBROKER_TEST_PG or "
                        "postgresql://postgres@127.0.0.1:5432/postgres)")
    p.add_argument("--daemon-tree", type=Path, default=ROOT,
                   help="the checkout the daemons run from (this repository)")
    p.add_argument("--commit", metavar="REV", default=None,
                   help="run the daemons from a temporary git worktree of REV instead "
                        "(removed afterwards): figures of a commit, whatever the working "
                        "tree holds")
    p.add_argument("--quick", action="store_true",
                   help="a short run: 3 signals per part, 5 s latency phases")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--keep", action="store_true",
                   help="keep the temporary directory (configs, node logs)")
    args = p.parse_args(argv)
    quick = args.quick
    for name, normal, short in (("kills", 10, 3), ("grace", 20.0, 15.0),
                                ("latency_duration", 10.0, 5.0)):
        if getattr(args, name) is None:
            setattr(args, name, short if quick else normal)
    if args.kills < 1 or args.rate <= 0 or args.latency_rate <= 0:
        p.error("--kills >= 1, --rate and --latency-rate > 0")
    args.daemon_tree = args.daemon_tree.resolve()
    return args


async def amain(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"code": code_version(args.daemon_tree), "cpus": os.cpu_count(),
                           "args": {k: str(v) if isinstance(v, Path) else v
                                    for k, v in vars(args).items()}}
    t0 = time.monotonic()
    for part in args.parts:
        if part == "latency":
            out[part] = await latency_part(args, workdir)
        else:
            out[part] = await failover_part(part, args, workdir)
        if not args.json:
            print_failover(out[part], args) if part != "latency" else print_latency(out[part])
    out["wall_s"] = round(time.monotonic() - t0, 1)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: signal.raise_signal(signal.SIGINT))
    workdir = Path(tempfile.mkdtemp(prefix="gpubroker-ha-"))
    if args.commit:
        args.daemon_tree = workdir / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach",
                        str(args.daemon_tree), args.commit], check=True, capture_output=True)
    if not args.json:
        print(f"ha bench: daemon code {code_version(args.daemon_tree)}; {os.cpu_count()} CPUs; "
              f"sim seed {args.seed}, {args.regions_per_cloud} regions/cloud; files in "
              f"{workdir}" + ("" if args.keep else " (removed at the end)"), flush=True)
    try:
        out = asyncio.run(amain(args, workdir))
    except KeyboardInterrupt:
        print("bench: interrupted", file=sys.stderr)
        return 130
    finally:
        if args.commit:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(args.daemon_tree)], check=False, capture_output=True)
        if args.keep:
            print(f"bench: files kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"\nwall time {out['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
