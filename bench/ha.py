"""High-availability takeover: the leader of a two-node site killed (`kill -9`) and frozen
(SIGSTOP) under load with a full lease book, or its PostgreSQL server restarted; how
long the site makes no decision, and whether a request is lost or decided twice.

The parts are the real ones, run by the helpers of the HA tests (tests/ha/helpers.py,
tests/support/mqtt_helpers.py): two `gpubroker run` processes (`node-a`, `node-b`) of one site
with `state.url` on one fresh PostgreSQL database, a private mosquitto, the simulated
market, one `BrokerClient` scheduler that re-sends an unanswered request with the same
request_id, and one MQTT subscriber of `P/status` and `P/events/#` whose arrival times
every figure is read from.

1. The book is filled with `--leases` active leases, placed over MQTT by the same
   scheduler (`--fill-window` requests in flight), before any fault.
2. The load: `--rate` placement requests/s (the helpers' mix of six shapes, unique
   request_ids, 1-hour leases), each decided lease released `--release-after` s later
   (so the book stays about the same size; 0: never released).
3. The faults, `kill` and `stop` in turn (`--kills`, `--stops`): the leader (the node
   whose /readyz says it leads) gets SIGKILL, or SIGSTOP; once the new leader has
   decided something, the killed node is started again, or the frozen one gets SIGCONT;
   either must stand by again (/readyz 503 `standby (leader: …)`). Then the site settles:
   up to `--settle-timeout` s for every request sent more than 1 s ago to be answered
   (if that does not happen, the faults stop there, unless `--keep-going`), then
   `--steady` s.
   With `--pg-restart N` instead: the daemons' PostgreSQL is a server of the bench's own
   (initdb + pg_ctl on a free port in a temporary directory, as user postgres when the
   bench runs as root), restarted N times (`pg_ctl restart -m fast`) under the same load.

Figures, per fault: the **takeover** (the old leader's last decision event received
before the new leader's `online` → the new leader's first decision event), **no leader**
(the signal → the new leader's `online`), the signal → its first decision, the signalled
node back to standby, and when no request older than 1 s was left unanswered. Per
PostgreSQL restart: the longest time without any decision event around it, leader
changes, daemons that exited. Over the run: **lost** requests (never answered, after
`--grace` s of re-sending at the end), **duplicated** ones (a request_id answered with two
lease_ids, among the events, the scheduler's answers and the `leases` table), what the
deposed leaders published after their successor's first event, "mqtt connected" lines
of a node while it did not lead, and tracebacks in the nodes' logs.

Progress goes to stderr, the figures to stdout (`--json`: as JSON). Nothing is written
into the repository; `--keep` keeps the temporary directory (configs, nodes' logs).

    cd /work/main && python bench/ha.py --quick       # 3 kills, 3 stops
    python bench/ha.py                                # 10 kills, 10 stops
    python bench/ha.py --pg-restart 5                 # PostgreSQL restarted 5 times
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import itertools
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "ha"), str(ROOT / "tests"),
               str(ROOT / "tests" / "support"), str(ROOT / "tests" / "fakes")]  # broker first

import psycopg  # noqa: E402
from helpers import (  # noqa: E402  (tests/ha/helpers.py)
    PREFIX,
    SCHEDULER,
    SITE,
    HaDaemon,
    HaSite,
    Observed,
    Outcome,
    Scheduler,
    wait_leader,
    wait_until,
)
from mqtt_helpers import Mosquitto, MqttProbe, free_port  # noqa: E402
from pg_helpers import ADMIN_URL, fresh_database  # noqa: E402

from gpubroker_client import BrokerClient, BrokerError  # noqa: E402

DECISIONS = ("placement.decided", "placement.rejected")
ANSWERED = ("decided", "rejected")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (as bench/latency.py)."""
    s = sorted(xs)
    if not s:
        return math.nan
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def r3(x: float | None) -> float | None:
    return None if x is None or math.isnan(x) else round(x, 3)


class QuietMosquitto(Mosquitto):  # type: ignore[misc]
    """The tests' mosquitto without `log_type all` (which writes every PUBLISH to disk,
    part of what would be measured) and with a queue long enough that a slow subscriber
    shows up as late, not as messages dropped."""

    def _log_types(self) -> list[str]:
        return ["error", "warning", "notice"]


# --------------------------------------------------------------------------------------
# what the subscriber saw, read as it arrives
# --------------------------------------------------------------------------------------


@dataclass
class Msg:
    t: float  # arrival, time.monotonic()
    index: int
    status: bool
    kind: str  # `state` of a P/status; the event kind of an event
    boot: str
    node: str = ""
    epoch: int = 0
    stamp: float = math.nan  # an event's envelope `time`, on the monotonic clock


WALL_MINUS_MONOTONIC = time.time() - time.monotonic()


def stamp_of(body: dict[str, Any]) -> float:
    """The envelope's `time` (the daemon's clock, the same machine) as monotonic."""
    try:
        wall = datetime.fromisoformat(str(body["time"]).replace("Z", "+00:00")).timestamp()
    except (KeyError, ValueError):
        return math.nan
    return wall - WALL_MINUS_MONOTONIC


class Feed:
    """The probe's messages parsed once each, in arrival order, with their arrival time."""

    def __init__(self, probe: MqttProbe) -> None:
        self.probe = probe
        self.msgs: list[Msg] = []

    def update(self) -> list[Msg]:
        n = len(self.msgs)
        for i in range(n, min(len(self.probe.messages), len(self.probe.received_at))):
            m = self.probe.messages[i]
            raw = m.payload if isinstance(m.payload, bytes | bytearray) else b""
            try:
                body = json.loads(raw) if raw else {}
            except ValueError:
                body = {}
            topic = m.topic.value
            if topic == f"{PREFIX}/status":
                self.msgs.append(Msg(self.probe.received_at[i], i, True,
                                     str(body.get("state", "")), str(body.get("boot_id", "")),
                                     str(body.get("node", "")), int(body.get("epoch") or 0)))
            else:
                self.msgs.append(Msg(self.probe.received_at[i], i, False,
                                     topic.rsplit("/", 1)[-1], str(body.get("bootid", "")),
                                     stamp=stamp_of(body)))
        return self.msgs[n:]

    def leader_boot(self) -> str | None:
        """The boot of the last `online` P/status so far."""
        self.update()
        return next((m.boot for m in reversed(self.msgs) if m.status and m.kind == "online"),
                    None)

    def decisions_since(self, t: float) -> list[Msg]:
        return [m for m in self.msgs if not m.status and m.kind in DECISIONS and m.t >= t]


# --------------------------------------------------------------------------------------
# PostgreSQL of the bench's own (--pg-restart)
# --------------------------------------------------------------------------------------


class OwnPostgres:
    """initdb + pg_ctl on a free loopback port, in a temporary directory; as user
    postgres when the bench runs as root (PostgreSQL refuses to run as root)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="gpubroker-bench-pg-"))
        self.data = self.dir / "data"
        self.port = free_port()
        self.as_postgres = os.geteuid() == 0
        if self.as_postgres:
            shutil.chown(self.dir, "postgres", "postgres")
            self.dir.chmod(0o700)

    def _run(self, *cmd: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        full = ["runuser", "-u", "postgres", "--", *cmd] if self.as_postgres else list(cmd)
        out = subprocess.run(full, capture_output=True, text=True, timeout=timeout,
                             check=False)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: exit {out.returncode}\n{out.stdout}\n"
                               f"{out.stderr}\n{self.log_tail()}")
        return out

    def log_tail(self, lines: int = 20) -> str:
        p = self.dir / "server.log"
        with contextlib.suppress(OSError):
            return "\n".join(p.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def start(self) -> None:
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres",
                  "--no-sync", "-E", "UTF8")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.dir / "server.log"), "-w",
                  "-o", f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1", "start")

    def restart(self) -> None:
        """`pg_ctl restart -m fast` (the same options: postmaster.opts)."""
        # -l again: else the new server writes to pg_ctl's stdout, a pipe of ours that
        # would then stay open (and `run` wait) as long as the server runs.
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.dir / "server.log"),
                  "-m", "fast", "-w", "restart")

    @property
    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def create_database(self, name: str) -> str:
        with psycopg.connect(self.admin_url, autocommit=True, connect_timeout=5) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql://postgres@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop",
                      timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)


# --------------------------------------------------------------------------------------
# the bench
# --------------------------------------------------------------------------------------


@dataclass
class Fault:
    n: int
    kind: str  # kill, stop, pg-restart
    old: str = ""  # node
    new: str = ""
    old_epoch: int = 0
    new_epoch: int = 0
    takeover_s: float | None = None  # old's last decision → new's first decision
    takeover_stamped_s: float | None = None  # the same by the envelopes' `time`
    probe_lag_s: float | None = None  # the new first decision: received − its `time`
    no_leader_s: float | None = None  # signal → new online
    to_first_s: float | None = None  # signal → new's first decision
    standby_s: float | None = None  # signal → the signalled node standing by again
    recovered_s: float | None = None  # signal → no request older than 1 s unanswered
    gap_s: float | None = None  # pg-restart: longest time without a decision around it
    restart_s: float | None = None  # pg-restart: pg_ctl restart's wall time
    leader_changes: int = 0  # pg-restart: new `online` boots in the window
    notes: list[str] = field(default_factory=list)


@dataclass
class Run:
    args: dict[str, Any]
    faults: list[Fault] = field(default_factory=list)
    fill: dict[str, Any] = field(default_factory=dict)
    load: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0


class Pool:
    """Several schedulers (one BrokerClient each, scheduler ids `ha-sched`, `ha-sched-1`,
    …) placing in turn: one client with thousands of requests awaiting an answer spends
    its CPU in aiomqtt's count of pending publishes (quadratic), which would make the
    bench, not the site, the bottleneck after a takeover."""

    def __init__(self, scheds: list[Scheduler]) -> None:
        self.scheds = scheds
        self._next = 0

    def place(self, tag: str) -> tuple[Outcome, Scheduler]:
        k = self._next % len(self.scheds)
        self._next += 1
        sched = self.scheds[k]
        rid = sched.place(f"{tag}{k}")
        return sched.outcomes[rid], sched

    @property
    def outcomes(self) -> list[Outcome]:
        return [o for s in self.scheds for o in s.outcomes.values()]

    async def finish(self, timeout: float) -> list[Outcome]:
        left = await asyncio.gather(*(s.finish(timeout) for s in self.scheds))
        return [o for part in left for o in part]

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.scheds))


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.run = Run(args={k: v for k, v in vars(args).items()})
        self.nodes: list[HaDaemon] = []
        self.released: Counter[str] = Counter()
        self._release_tasks: set[asyncio.Task[None]] = set()
        self._load: list[tuple[Outcome, Scheduler]] = []  # in the order sent
        self._oldest = 0  # index in _load of the oldest maybe unanswered

    # --- the load ---------------------------------------------------------------------

    async def fill(self, sched: Pool) -> None:
        """Place requests, `fill_window` in flight, until `leases` are decided."""
        a = self.args
        t0 = time.monotonic()
        pending: list[Outcome] = []
        decided = rejected = failed = sent = 0
        last_log = t0
        while decided < a.leases:
            while len(pending) < a.fill_window and decided + len(pending) < a.leases \
                    and sent < 3 * a.leases:
                pending.append(sched.place("fill")[0])
                sent += 1
            if not pending:
                break  # too many rejections: the market is full
            await asyncio.sleep(0.01)  # (`Scheduler.answered` counts every request)
            still = []
            for o in pending:
                if o.kind is None:
                    still.append(o)
                elif o.kind == "decided":
                    decided += 1
                elif o.kind == "rejected":
                    rejected += 1
                else:
                    failed += 1
            pending = still
            if time.monotonic() - last_log > 5:
                last_log = time.monotonic()
                log(f"fill: {decided} of {a.leases} leases decided ({rejected} rejected, "
                    f"{failed} failed) in {last_log - t0:.0f} s")
        wall = time.monotonic() - t0
        self.run.fill = {"how": f"placed over MQTT by the scheduler, {a.fill_window} "
                                "in flight", "decided": decided, "rejected": rejected,
                         "failed": failed, "sent": sent, "seconds": round(wall, 1),
                         "per_s": round((decided + rejected) / wall, 1) if wall else None}
        log(f"fill: {decided} leases decided ({rejected} rejected, {failed} failed) in "
            f"{wall:.1f} s, {self.run.fill['per_s']} answers/s")

    async def load(self, sched: Pool, stop: asyncio.Event) -> None:
        """`rate` requests/s on a fixed schedule; each decided lease is released
        `release_after` s later."""
        rate = self.args.rate
        t0 = time.monotonic()
        i = 0
        while not stop.is_set():
            due = t0 + i / rate
            delay = due - time.monotonic()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await stop.wait()
                continue
            self._load.append(sched.place("load"))
            i += 1

    async def releaser(self, stop: asyncio.Event) -> None:
        """Release each lease decided under load `release_after` s after its decision
        (each release a request of its own, re-sent until answered)."""
        waiting: dict[str, tuple[Outcome, Scheduler]] = {}
        due: list[tuple[float, str, int]] = []
        by_id: dict[int, Scheduler] = {}
        seen = 0
        while not stop.is_set():
            waiting.update((o.request_id, (o, s)) for o, s in self._load[seen:])
            seen = len(self._load)
            for rid, (o, s) in list(waiting.items()):
                if o.kind is not None:
                    del waiting[rid]
                    if o.kind == "decided" and o.lease_id is not None and \
                            o.answered_at is not None:
                        by_id[id(s)] = s
                        heapq.heappush(due, (o.answered_at + self.args.release_after,
                                             o.lease_id, id(s)))
            while due and due[0][0] <= time.monotonic():
                _, lease_id, sid = heapq.heappop(due)
                task = asyncio.create_task(self._release(by_id[sid], lease_id))
                self._release_tasks.add(task)
                task.add_done_callback(self._release_tasks.discard)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.2):
                    await stop.wait()

    async def _release(self, sched: Scheduler, lease_id: str) -> None:
        try:
            await sched.client.release(lease_id, timeout=self.args.answer_timeout)
            self.released["released"] += 1
        except BrokerError as exc:
            self.released[type(exc).__name__] += 1

    def unanswered_older_than(self, age: float) -> int:
        """Load requests sent more than `age` s ago without an answer yet."""
        now = time.monotonic()
        load = self._load
        while self._oldest < len(load) and load[self._oldest][0].kind is not None:
            self._oldest += 1
        n = 0
        for o, _ in load[self._oldest:]:
            if o.sent_at > now - age:
                break
            if o.kind is None:
                n += 1
        return n

    async def settle(self, t_signal: float, fault: Fault) -> None:
        """Until no request older than 1 s is unanswered (at most `settle_timeout` s),
        then `steady` s."""
        with contextlib.suppress(TimeoutError):
            await wait_until(lambda: not self.unanswered_older_than(1.0),
                             self.args.settle_timeout, "settled", every=0.1)
        if not self.unanswered_older_than(1.0):
            fault.recovered_s = r3(time.monotonic() - t_signal)
        else:
            fault.notes.append(f"{self.unanswered_older_than(1.0)} requests older "
                               f"than 1 s unanswered after the {self.args.settle_timeout:g} "
                               "s settle timeout")
        await asyncio.sleep(self.args.steady)

    # --- node faults --------------------------------------------------------------------

    async def node_fault(self, n: int, kind: str, feed: Feed) -> bool:
        """One kill or stop; False when the site has no leader to go on with."""
        a = self.args
        fault = Fault(n, kind)
        self.run.faults.append(fault)
        try:
            leader = await wait_leader(self.nodes, 30)
        except TimeoutError as exc:
            fault.notes.append(f"no leader before the signal: {str(exc)[:200]}")
            return False
        other = next(d for d in self.nodes if d is not leader)
        old_boot = feed.leader_boot()
        fault.old = leader.node
        t_sig = time.monotonic()
        if kind == "kill":
            await leader.kill()
        else:
            leader.freeze()
        # the new leader: an `online` of another boot, then its first decision
        new: Msg | None = None
        first: Msg | None = None
        deadline = t_sig + a.takeover_timeout
        while first is None and time.monotonic() < deadline:
            for m in feed.update():
                if new is None and m.status and m.kind == "online" and m.boot != old_boot \
                        and m.t >= t_sig:
                    new = m
                elif new is not None and not m.status and m.kind in DECISIONS and \
                        m.boot == new.boot:
                    first = m
                    break
            await asyncio.sleep(0.02)
        if new is not None:
            fault.new, fault.new_epoch = new.node, new.epoch
            fault.no_leader_s = r3(new.t - t_sig)
            olds = [m for m in feed.msgs if m.status and m.kind == "online" and
                    m.boot == old_boot]
            fault.old_epoch = olds[-1].epoch if olds else 0
            last_old = next((m for m in reversed(feed.msgs[:new.index]) if not m.status
                             and m.boot == old_boot and m.kind in DECISIONS), None)
            if first is not None:
                fault.to_first_s = r3(first.t - t_sig)
                fault.probe_lag_s = r3(first.t - first.stamp)
                if last_old is not None:
                    fault.takeover_s = r3(first.t - last_old.t)
                    fault.takeover_stamped_s = r3(first.stamp - last_old.stamp)
                else:
                    fault.notes.append("no decision of the old leader seen")
        if first is None:
            fault.notes.append(f"no decision of a new leader within {a.takeover_timeout:g} s"
                               + ("" if new else " (and no new `online`)"))
        # the signalled node back, standing by
        if kind == "kill":
            leader.start()
        else:
            leader.thaw()
        try:
            await leader.wait_role("standby", a.takeover_timeout, text="leader: node")
            fault.standby_s = r3(time.monotonic() - t_sig)
        except (TimeoutError, AssertionError) as exc:
            fault.notes.append(f"node {leader.node} not standing by: {str(exc)[:300]}")
            if not leader.alive:
                leader.start()
        if not other.alive:
            fault.notes.append(f"node {other.node} exited ({other.returncode}); started "
                               "again")
            other.start()
        await self.settle(t_sig, fault)
        log(f"{kind} {n + 1}: {fault.old}→{fault.new or '?'} takeover "
            f"{fault.takeover_s} s, no leader {fault.no_leader_s} s, first decision "
            f"{fault.to_first_s} s, standby {fault.standby_s} s, recovered "
            f"{fault.recovered_s} s; " + self.so_far(kind)
            + (f"; {'; '.join(fault.notes)}" if fault.notes else ""))
        return first is not None or new is not None

    def so_far(self, kind: str) -> str:
        xs = [f.takeover_s for f in self.run.faults if f.kind == kind
              and f.takeover_s is not None]
        return (f"{kind} takeover so far p50 {r3(pct(xs, 50))} s, max {r3(max(xs))} s "
                f"(n={len(xs)})" if xs else f"no {kind} takeover measured yet")

    # --- PostgreSQL restarts --------------------------------------------------------------

    async def pg_restart(self, n: int, pg: OwnPostgres, feed: Feed) -> None:
        fault = Fault(n, "pg-restart")
        self.run.faults.append(fault)
        feed.update()
        before = {m.boot for m in feed.msgs if m.status and m.kind == "online"}
        old_boot = feed.leader_boot()
        fault.old = next((m.node for m in reversed(feed.msgs) if m.status and
                          m.boot == old_boot), "")
        t_sig = time.monotonic()
        try:
            await asyncio.to_thread(pg.restart)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            fault.notes.append(f"pg_ctl restart failed: {str(exc)[:300]}")
        fault.restart_s = r3(time.monotonic() - t_sig)
        # decisions again, then the settle; then the gap from the window's decisions
        deadline = t_sig + self.args.takeover_timeout
        t_back = time.monotonic()
        while time.monotonic() < deadline and not any(
                m.t > t_back for m in feed.decisions_since(t_sig)):
            feed.update()
            await asyncio.sleep(0.05)
        for d in self.nodes:
            if not d.alive:
                fault.notes.append(f"node {d.node} exited ({d.returncode}); started again")
                d.start()
        try:
            await wait_leader(self.nodes, self.args.takeover_timeout)
        except TimeoutError:
            fault.notes.append("no leader after the restart")
        await self.settle(t_sig, fault)
        feed.update()
        t_end = time.monotonic()
        times = [m.t for m in feed.msgs if not m.status and m.kind in DECISIONS
                 and t_sig - 1 <= m.t <= t_end]
        edges = [t_sig - 1, *times, t_end]
        gaps = [(b - a_) for a_, b in itertools.pairwise(edges)]
        fault.gap_s = r3(max(gaps))
        new_boots = [m for m in feed.msgs if m.status and m.kind == "online"
                     and m.t >= t_sig and m.boot not in before]
        fault.leader_changes = len({m.boot for m in new_boots})
        fault.new = new_boots[-1].node if new_boots else fault.old
        if new_boots:
            fault.no_leader_s = r3(new_boots[0].t - t_sig)
        log(f"pg-restart {n + 1}: pg_ctl restart {fault.restart_s} s, longest without a "
            f"decision {fault.gap_s} s, leader changes {fault.leader_changes}, recovered "
            f"{fault.recovered_s} s" + (f"; {'; '.join(fault.notes)}" if fault.notes else ""))

    # --- the whole run --------------------------------------------------------------------

    async def main(self) -> Run:
        a = self.args
        t_start = time.monotonic()
        mosq = QuietMosquitto(self.workdir / "mqtt", extra_config="max_queued_messages 1000000")
        mosq.start()
        pg: OwnPostgres | None = None
        try:
            with contextlib.ExitStack() as stack:
                if a.pg_restart:
                    pg = OwnPostgres()
                    await asyncio.to_thread(pg.start)
                    url = pg.create_database("gpubroker_bench_ha")
                    log(f"own PostgreSQL on port {pg.port} in {pg.dir}")
                else:
                    url = stack.enter_context(fresh_database("gpbbench"))
                await self.site_run(mosq, url, pg)
        finally:
            mosq.stop()
            if pg is not None:
                pg.stop()
        self.run.wall_s = round(time.monotonic() - t_start, 1)
        return self.run

    async def site_run(self, mosq: Mosquitto, url: str, pg: OwnPostgres | None) -> None:
        a = self.args
        site = HaSite(self.workdir, mosq, url, leadership_seconds=a.leadership_seconds,
                      config={"clouds": {"sim": {"seed": a.seed,
                                                 "regions_per_cloud": a.regions_per_cloud}},
                              "poll": {"interval_seconds": a.poll_interval,
                                       "stale_after_seconds": max(300.0, 3 * a.poll_interval)},
                              "log_level": a.log_level})
        try:
            async with MqttProbe(mosq.url, [f"{PREFIX}/status", f"{PREFIX}/events/#"],
                                 check_contract=False, timeout=30) as probe:
                feed = Feed(probe)
                log("starting node-a (leader) and node-b (standby)")
                self.nodes = [await site.start_leader("node-a", timeout=120),
                              await site.start_standby("node-b", timeout=120)]
                async with contextlib.AsyncExitStack() as clients:
                    scheds = []
                    for k in range(a.schedulers):
                        client = await clients.enter_async_context(BrokerClient(
                            mosq.url, scheduler=SCHEDULER if k == 0 else f"{SCHEDULER}-{k}",
                            protocol="5", resend_after=a.resend_after,
                            resend_max=a.resend_max))
                        scheds.append(Scheduler(client, answer_timeout=a.answer_timeout))
                    sched = Pool(scheds)
                    try:
                        await self.fill(sched)
                        await self.loaded(sched, feed, pg)
                        await self.check(site, sched, probe, feed)
                    finally:
                        for t in list(self._release_tasks):
                            t.cancel()
                        await asyncio.gather(*self._release_tasks, return_exceptions=True)
                        await sched.close()
                codes = await site.stop_all()
                self.run.checks["exit_codes_at_the_end"] = codes
        finally:
            await site.close()

    async def loaded(self, sched: Pool, feed: Feed, pg: OwnPostgres | None) -> None:
        a = self.args
        stop = asyncio.Event()
        t0 = time.monotonic()
        cpu0 = os.times()
        loader = asyncio.create_task(self.load(sched, stop))
        releaser = asyncio.create_task(self.releaser(stop)) \
            if a.release_after > 0 else None
        try:
            await asyncio.sleep(a.steady)
            if pg is not None:
                for n in range(a.pg_restart):
                    log(f"pg-restart {n + 1} of {a.pg_restart}")
                    await self.pg_restart(n, pg, feed)
                    if self.run.faults[-1].recovered_s is None and not a.keep_going:
                        log("the site did not work off the backlog: the restarts stop here "
                            "(--keep-going goes on)")
                        self.run.faults[-1].notes.append("not recovered: the restarts "
                                                         "stopped")
                        break
            else:
                plan = interleave(a.kills, a.stops)
                for n, kind in enumerate(plan):
                    log(f"fault {n + 1} of {len(plan)}: {kind} the leader")
                    if not await self.node_fault(n, kind, feed):
                        log("no leader: the faults stop here")
                        break
                    if self.run.faults[-1].recovered_s is None and not a.keep_going:
                        log("the site did not work off the backlog: the faults stop here "
                            "(--keep-going goes on)")
                        self.run.faults[-1].notes.append("not recovered: the faults stopped")
                        break
        finally:
            stop.set()
            await loader
            if releaser is not None:
                await releaser
        t_load = time.monotonic() - t0
        cpu1 = os.times()
        bench_cpu = (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / t_load * 100
        log(f"load stopped; {a.grace:g} s for the last answers")
        left = await sched.finish(a.grace)
        load = [o for o, _ in self._load]
        kinds = Counter(o.kind or "unanswered" for o in load)
        lat = [o.answered_at - o.sent_at for o in load
               if o.kind in ANSWERED and o.answered_at is not None]
        self.run.load = {
            "sent": len(load), "seconds": round(t_load, 1),
            "per_s": round(len(load) / t_load, 1), "outcomes": dict(kinds),
            "rejection_codes": dict(Counter(o.detail for o in load if o.kind == "rejected")),
            "lost": sum(1 for o in load if o.kind not in ANSWERED),
            "lost_fill": sum(1 for o in left if o.request_id.startswith("fill")),
            "lost_examples": [f"{o.request_id}: {o.kind} {o.detail[:80]}" for o in left][:5],
            "answer_p50_s": r3(pct(lat, 50)), "answer_p99_s": r3(pct(lat, 99)),
            "releases": dict(self.released),
            "bench_cpu_percent": round(bench_cpu), "loadavg_1min_at_end":
                round(os.getloadavg()[0], 2), "cpus": os.cpu_count(),
        }

    async def check(self, site: HaSite, sched: Pool, probe: MqttProbe, feed: Feed
                    ) -> None:
        obs = Observed.of(probe)
        decided = obs.decided()
        table, active = [], [(None,)]
        for attempt in range(5):  # a busy machine: the server may answer late
            try:
                table = await site.leases()
                active = await site.query("SELECT count(*) FROM leases WHERE "
                                          "state='active'")
                break
            except psycopg.OperationalError as exc:
                log(f"reading the leases table: {exc}; again")
                await asyncio.sleep(2 * (attempt + 1))
        # Observed.lease_problems knows one scheduler id: each scheduler against the
        # rows of its own id, under that name.
        problems = []
        for s in sched.scheds:
            own = [(SCHEDULER, r, i, e) for sid, r, i, e in table
                   if sid == s.client.scheduler]
            problems += obs.lease_problems(s, own)
        self.run.checks.update({
            "duplicated_events": sum(1 for ids in decided.values() if len(ids) > 1),
            "lease_problems": len(problems),
            "lease_problem_examples": problems[:5],
            "takeover_problems": obs.takeover_problems()[:10],
            "epoch_problems": obs.epoch_problems()[:10],
            "connects_while_not_leading": {d.node: len(d.connects_while_not_leading())
                                           for d in site.daemons.values()},
            "tracebacks": {d.node: len(d.tracebacks()) for d in site.daemons.values()},
            "leases_in_table": len(table), "active_leases_at_the_end": active[0][0],
            "leaders": len(obs.leaders()), "messages_seen": len(probe.messages),
        })


def interleave(kills: int, stops: int) -> list[str]:
    out = []
    for i in range(max(kills, stops)):
        if i < kills:
            out.append("kill")
        if i < stops:
            out.append("stop")
    return out


# --------------------------------------------------------------------------------------
# the report
# --------------------------------------------------------------------------------------


def fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.2f}"
    return str(x)


def print_report(run: Run) -> None:
    a = run.args
    mode = (f"PostgreSQL of its own restarted {a['pg_restart']} times" if a["pg_restart"]
            else f"{a['kills']} kill -9 and {a['stops']} SIGSTOP of the leader, in turn")
    print(f"ha bench: site {SITE!r}, 2 nodes, state.leadership_seconds "
          f"{a['leadership_seconds']:g}, sim seed {a['seed']} with {a['regions_per_cloud']} "
          f"regions/cloud; {mode}; load {a['rate']:g} req/s, leases released "
          + (f"{a['release_after']:g} s after their decision" if a["release_after"] > 0
             else "never") + f"; wall {run.wall_s:g} s")
    f = run.fill
    print(f"book: {f.get('decided')} active leases before the first fault ({f.get('how')}; "
          f"{f.get('rejected')} rejected, {f.get('failed')} failed; {f.get('seconds')} s, "
          f"{f.get('per_s')} answers/s)")
    head: tuple[str, ...]
    if a["pg_restart"]:
        head = ("#", "kind", "leader", "pg_ctl s", "no decision s", "leader changes",
                "no leader s", "recovered s", "notes")
        rows = [tuple(fmt(x) for x in (x.n + 1, x.kind, f"{x.old}→{x.new}", x.restart_s,
                                       x.gap_s, x.leader_changes, x.no_leader_s,
                                       x.recovered_s, "; ".join(x.notes)[:100]))
                for x in run.faults]
    else:
        head = ("#", "kind", "old→new", "epoch", "takeover s", "(stamped)", "no leader s",
                "sig→1st decision s", "probe lag s", "standby s", "recovered s", "notes")
        rows = [tuple(fmt(v) for v in (x.n + 1, x.kind, f"{x.old}→{x.new or '?'}",
                                       f"{x.old_epoch}→{x.new_epoch}", x.takeover_s,
                                       x.takeover_stamped_s, x.no_leader_s, x.to_first_s,
                                       x.probe_lag_s, x.standby_s,
                                       x.recovered_s, "; ".join(x.notes)[:100]))
                for x in run.faults]
    table = [head, *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    for r in table:
        print("  ".join(c.rjust(w) if 0 < i < len(head) - 1 else c.ljust(w)
                        for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip())
    print()
    for kind in ("kill", "stop", "pg-restart"):
        fs = [x for x in run.faults if x.kind == kind]
        if not fs:
            continue
        if kind == "pg-restart":
            gaps = [x.gap_s for x in fs if x.gap_s is not None]
            print(f"pg-restart ×{len(fs)}: longest time without a decision p50 "
                  f"{fmt(r3(pct(gaps, 50)))} s, p99 {fmt(r3(pct(gaps, 99)))} s, max "
                  f"{fmt(max(gaps) if gaps else None)} s; leader changes "
                  f"{sum(x.leader_changes for x in fs)}")
            continue
        tk = [x.takeover_s for x in fs if x.takeover_s is not None]
        ts = [x.takeover_stamped_s for x in fs if x.takeover_stamped_s is not None]
        nl = [x.no_leader_s for x in fs if x.no_leader_s is not None]
        lag = [x.probe_lag_s for x in fs if x.probe_lag_s is not None]
        print(f"{kind} ×{len(fs)}: takeover p50 {fmt(r3(pct(tk, 50)))} s, p99 "
              f"{fmt(r3(pct(tk, 99)))} s, max {fmt(max(tk) if tk else None)} s "
              f"(measured in {len(tk)} of {len(fs)}; goal p99 ≤ 3 s: "
              f"{'met' if tk and len(tk) == len(fs) and pct(tk, 99) <= 3 else 'NOT met'}); "
              f"no leader p50 {fmt(r3(pct(nl, 50)))} s, max {fmt(max(nl) if nl else None)} s")
        print(f"  by the envelopes' `time` (the daemons' clock, not the subscriber's): "
              f"takeover p50 {fmt(r3(pct(ts, 50)))} s, p99 {fmt(r3(pct(ts, 99)))} s; the "
              f"subscriber received the new leader's first decision p50 "
              f"{fmt(r3(pct(lag, 50)))} s, max {fmt(max(lag) if lag else None)} s after it")
    ld, c = run.load, run.checks
    dup = c.get("duplicated_events", 0)
    print(f"requests under load: {ld.get('sent')} sent in {ld.get('seconds')} s "
          f"({ld.get('per_s')}/s): {ld.get('outcomes')}; rejections "
          f"{ld.get('rejection_codes') or 'none'}; answer p50 {fmt(ld.get('answer_p50_s'))} s, "
          f"p99 {fmt(ld.get('answer_p99_s'))} s; releases {ld.get('releases') or 'none'}")
    print(f"the bench's own CPU over the load: {ld.get('bench_cpu_percent')} % of one core "
          f"(its schedulers and subscriber); 1-min load average at the end "
          f"{ld.get('loadavg_1min_at_end')} on {ld.get('cpus')} CPUs")
    print(f"LOST {ld.get('lost')} (goal 0; after {a['grace']:g} s of grace; fill requests "
          f"lost {ld.get('lost_fill')})" + (f", e.g. {ld['lost_examples']}"
                                             if ld.get("lost_examples") else ""))
    print(f"DUPLICATED {dup} (request_ids with two lease_ids among the events; goal 0); "
          f"lease problems (events, answers, `leases` table) {c.get('lease_problems')}"
          + (f", e.g. {c['lease_problem_examples']}" if c.get("lease_problem_examples")
             else ""))
    print(f"deposed leaders publishing after their successor: "
          f"{len(c.get('takeover_problems', []))}; epoch problems "
          f"{len(c.get('epoch_problems', []))}; 'mqtt connected' while not leading "
          f"{c.get('connects_while_not_leading')}; tracebacks {c.get('tracebacks')}; "
          f"exit codes at the end {c.get('exit_codes_at_the_end')}")
    for p in c.get("takeover_problems", []) + c.get("epoch_problems", []):
        print(f"  {p[:300]}")
    print(f"leases table at the end: {c.get('leases_in_table')} rows, "
          f"{c.get('active_leases_at_the_end')} active; {c.get('leaders')} leader starts "
          f"seen; {c.get('messages_seen')} messages on P/status and P/events/#")


# --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 3 kills and 3 stops (or 2 PostgreSQL restarts), "
                        "5,000 leases")
    p.add_argument("--kills", type=int, default=None, help="leader kill -9 (10)")
    p.add_argument("--stops", type=int, default=None, help="leader SIGSTOP (10)")
    p.add_argument("--pg-restart", type=int, default=0, metavar="N",
                   help="instead of the node faults: the daemons on a PostgreSQL server of "
                        "the bench's own, restarted N times (pg_ctl restart -m fast)")
    p.add_argument("--leases", type=int, default=None,
                   help="active leases in the book before the first fault (20000)")
    p.add_argument("--fill-window", type=int, default=300,
                   help="fill requests in flight at a time (300)")
    p.add_argument("--rate", type=float, default=200.0, help="placement requests/s (200)")
    p.add_argument("--schedulers", type=int, default=8,
                   help="schedulers (BrokerClients) placing in turn (8)")
    p.add_argument("--release-after", type=float, default=5.0,
                   help="release each lease decided under load this many s after its "
                        "decision (5; 0: never, the book grows)")
    p.add_argument("--leadership-seconds", type=float, default=3.0,
                   help="state.leadership_seconds (3, the daemon's default)")
    p.add_argument("--regions-per-cloud", type=int, default=88,
                   help="sim regions per cloud (88, as bench/latency.py: ~20,000 offers)")
    p.add_argument("--seed", type=int, default=7, help="sim seed (7)")
    p.add_argument("--poll-interval", type=float, default=300.0,
                   help="poll.interval_seconds (300)")
    p.add_argument("--log-level", default="info", help="the daemons' log_level (info)")
    p.add_argument("--resend-after", type=float, default=2.0,
                   help="the scheduler re-sends an unanswered request after this many s, "
                        "doubling (2)")
    p.add_argument("--resend-max", type=float, default=15.0,
                   help="... up to this many s (15)")
    p.add_argument("--answer-timeout", type=float, default=300.0,
                   help="the scheduler gives up on a request after this many s (300)")
    p.add_argument("--takeover-timeout", type=float, default=60.0,
                   help="s to wait for a new leader's first decision, as the subscriber "
                        "sees it (60)")
    p.add_argument("--settle-timeout", type=float, default=30.0,
                   help="after a fault, at most this many s for every request older than "
                        "1 s to be answered (30); past it, the faults stop")
    p.add_argument("--keep-going", action="store_true",
                   help="go on with the next fault even when the last one's backlog was "
                        "not worked off within --settle-timeout")
    p.add_argument("--steady", type=float, default=2.0,
                   help="s of load after the settle, and before the first fault (2)")
    p.add_argument("--grace", type=float, default=60.0,
                   help="s for the last answers once the load stops (60)")
    p.add_argument("--json", action="store_true", help="the figures as JSON")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = p.parse_args(argv)
    if args.kills is None:
        args.kills = 3 if args.quick else 10
    if args.stops is None:
        args.stops = 3 if args.quick else 10
    if args.leases is None:
        args.leases = 5000 if args.quick else 20000
    if args.quick and args.pg_restart > 2:
        args.pg_restart = 2
    if args.rate <= 0 or args.leases < 0 or args.fill_window < 1:
        p.error("--rate must be > 0, --leases >= 0, --fill-window >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # aiomqtt warns on stderr at every publish beyond 10 awaiting their PUBACK (the
    # scheduler's re-sends after a takeover: thousands of lines, and their CPU).
    logging.getLogger("mqtt").setLevel(logging.ERROR)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: signal.raise_signal(signal.SIGINT))
    workdir = Path(tempfile.mkdtemp(prefix="gpubroker-bench-ha-"))
    log(f"workdir {workdir}; PostgreSQL "
        + ("of the bench's own" if args.pg_restart else ADMIN_URL))
    try:
        run = asyncio.run(Bench(args, workdir).main())
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        if args.keep:
            log(f"files kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(json.dumps(asdict(run), indent=2, default=str))
    else:
        print_report(run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
