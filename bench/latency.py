"""Request latency of the gpubroker daemon against a bare MQTT echo, side by side.

One run, one private mosquitto, three phases (each `--warmup` + `--duration` seconds of
open-loop load at `--rate` messages per second, QoS 1, one aiomqtt client):

1. **baseline** — an echo responder (its own process, one aiomqtt client) republishes
   every request payload to a reply topic; latency = reply received − request sent.
2. **gpubroker** — the real daemon (`python -m broker.cli run --config …`, a subprocess)
   on the simulated market (about 20,000 offers), state in a fresh SQLite file, its
   poll interval long enough that no poll lands in the load; the load client publishes
   `P/requests/<S>/place` and times each request to its `placement.decided` /
   `placement.rejected` event (matched on `data.request_id`).
3. **gpubroker + polls** — the same with a short poll interval, so every region is
   re-polled (and its capacity summaries re-published) while the load runs
   (`--poll-phase-interval 0` skips it).

`--state-url URL` keeps the daemon's state on PostgreSQL instead (a fresh database per
phase on that server, dropped afterwards); `bench/ha.py` runs both side by side.

`--synchronous normal|full|both` sets the SQLite daemon's `state.synchronous` (default:
the daemon's own, full); `both` runs the gpubroker phase twice, normal then full, and
prints full's latency against normal's. Before the gpubroker phases an fsync probe times
`os.fsync` of a small file in the directory the state files live in (`--fsync-probe N`
iterations; `--dir` chooses that directory): what one synced commit costs at least.

Prints the figures (`--json`: as JSON); pass/fail is not its business.

    cd /work/main && python bench/latency.py [--rate 500] [--duration 20] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiomqtt

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parent.parent
PREFIX = "gpubroker/v1"
SCHEDULERS = ("sched-a", "sched-b", "sched-c", "sched-d")
LEASE_SECONDS = 6 * 3600  # nothing may expire during the run
WINDOW_S = 2.0  # latency over time: p50 per this many seconds of sends
INFLIGHT_WINDOW = 5000  # un-acknowledged publishes the load client allows itself
ECHO_REQ, ECHO_REP = "bench/echo/req", "bench/echo/rep"

# The request mix, cycled in order (index = request number mod len).
MIX: tuple[dict[str, Any], ...] = (
    {"gpu": ["H100-80GB", "A100-80GB"], "gpus": 8},
    {"gpu": ["H100-80GB", "A100-80GB"], "gpus": 8, "market": "spot", "team": "research"},
    {"gpu": "L4", "gpus": 1},
    {"gpu": "A10G", "gpus": 4, "market": "spot"},
    {"gpu": "T4", "gpus": 1, "max_price_per_gpu_hour": 0.35},
    {"gpu": "A100-40GB", "gpus": 2, "market": "on_demand", "duration_hours": 6},
    {"gpu": "L40S", "gpus": 1, "clouds": ["aws"]},
    {"gpu": ["H100-80GB"], "gpus": 16, "gang": True, "market": "spot"},
    {"gpu": "V100-16GB", "gpus": 4, "regions": ["us-east-1", "us-west-2", "eastus",
                                                "us-central1"]},
    {"gpu": "T4", "gpus": 1, "max_price_per_gpu_hour": 0.05},  # rejected: over the cap
)


# --------------------------------------------------------------------------------------
# processes: mosquitto, the daemon, the echo responder
# --------------------------------------------------------------------------------------

@contextlib.contextmanager
def bench_workdir(name: str, *, keep: bool, prefix: str | None = None,
                  parent: str | None = None) -> Iterator[Path]:
    """A bench run's temporary directory, and how it ends: Ctrl-C (even where a shell
    started us with SIGINT ignored) and SIGTERM both cancel the run (its `finally`
    blocks stop the daemon, the echo and mosquitto) and exit 130 with "NAME:
    interrupted"; the directory is removed afterwards unless `keep`."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: signal.raise_signal(signal.SIGINT))
    workdir = Path(tempfile.mkdtemp(prefix=f"gpubroker-{prefix or name}-", dir=parent))
    try:
        yield workdir
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        if keep:
            print(f"{name}: files kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Mosquitto:
    """A private mosquitto on a free loopback port. Unlike tests/support/mqtt_helpers.py it logs
    errors and warnings only, unless `log_types` says otherwise (`log_type all` writes
    every PUBLISH/PUBACK, which would be measured too), and keeps no persistence file.
    `max_queued_messages` is raised from 1000 so a subscriber that falls behind shows up
    as latency, not as silently dropped events."""

    def __init__(self, workdir: Path, max_inflight: int | None = None,
                 log_types: Sequence[str] = ("error", "warning")) -> None:
        self.max_inflight = max_inflight
        self.log_types = tuple(log_types)
        binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        if not os.access(binary, os.X_OK):
            raise SystemExit("bench: mosquitto not found (apt-get install -y mosquitto)")
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def start(self) -> None:
        conf = self.workdir / "mosquitto.conf"
        conf.write_text("\n".join([
            f"listener {self.port} 127.0.0.1",
            "allow_anonymous true",
            f"user {pwd.getpwuid(os.geteuid()).pw_name}",
            "persistence false",
            f"log_dest file {self.workdir / 'mosquitto.log'}",
            *(f"log_type {t}" for t in self.log_types),
            "set_tcp_nodelay true",
            "max_queued_messages 1000000",
            *([] if self.max_inflight is None
              else [f"max_inflight_messages {self.max_inflight}"]),
            "",
        ]))
        with (self.workdir / "mosquitto.out").open("ab") as out:
            self.proc = subprocess.Popen([self.binary, "-c", str(conf)],
                                         stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", self.port), timeout=0.5):
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mosquitto did not start:\n{self.log_tail()}")
            time.sleep(0.02)

    def log_tail(self) -> str:
        text = ""
        for name in ("mosquitto.out", "mosquitto.log"):
            p = self.workdir / name
            if p.exists():
                text += p.read_text(errors="replace")
        return "\n".join(text.splitlines()[-20:])

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_process(proc)


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM / ... from /proc/<pid>/status, in kB."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key.startswith("Vm") and rest.strip().endswith("kB"):
                out[key] = int(rest.split()[0])
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """User + system CPU time of each thread of a process so far, by thread id (the
    main thread's id is the process id)."""
    out: dict[int, float] = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
                out[int(tid)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def split_by_thread(pid: int, before: dict[int, float], after: dict[int, float],
                    seconds: float) -> dict[str, float]:
    """% of one core over `seconds`: the main thread (the daemon's event loop) and the
    other threads together (the placement workers, the store's thread, the SDKs')."""
    used = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    main = used.pop(pid, 0.0)
    return {"loop": round(100 * main / seconds, 1),
            "other threads": round(100 * sum(used.values()) / seconds, 1)}


class Daemon:
    """`python -m broker.cli run --config FILE` as a subprocess; stdout (JSON log lines)
    is read all along so the pipe never fills."""

    def __init__(self, workdir: Path, mqtt_url: str, *, seed: int, regions: int,
                 poll_interval: float, state_url: str | None = None, node: str | None = None,
                 http_listen: str | None = None, root: Path = ROOT,
                 synchronous: str | None = None, env: dict[str, str] | None = None) -> None:
        """`state_url`: the state on PostgreSQL instead of a SQLite file in `workdir`;
        `node`, `http_listen`, `synchronous` (SQLite's `state.synchronous`): those
        settings (default: the daemon's); `root`: the checkout the daemon runs from;
        `env`: more of the daemon's environment (a `PYTHONPATH` there comes first)."""
        self.workdir = workdir
        self.root = root
        self.env = env or {}
        workdir.mkdir(parents=True, exist_ok=True)
        self.config = workdir / "config.yaml"
        state = (f"state: {{url: '{state_url}'}}\n" if state_url
                 else f"state: {{path: '{workdir / 'state.db'}'"
                 + (f", synchronous: {synchronous}" if synchronous else "") + "}\n")
        self.config.write_text(
            "site: bench\n"
            + (f"node: {node}\n" if node else "")
            + state
            + (f"http: {{listen: '{http_listen}'}}\n" if http_listen else "")
            + f"mqtt: {{url: '{mqtt_url}', topic_prefix: '{PREFIX}', client_id: gpubroker-bench}}\n"
            f"poll: {{interval_seconds: {poll_interval}, "
            f"stale_after_seconds: {max(300.0, 3 * poll_interval)}}}\n"
            "clouds:\n"
            f"  sim: {{seed: {seed}, regions_per_cloud: {regions}, zones_per_region: 3,\n"
            "         preempt_rate_multiplier: 1.0, signal_interval_seconds: 1.0}\n")
        self.proc: asyncio.subprocess.Process | None = None
        self.ready = asyncio.Event()
        self.offers: int | None = None
        self.levels: Counter[str] = Counter()
        self.events: Counter[str] = Counter()
        self.tail: list[str] = []
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        cmd = [sys.executable, "-m", "broker.cli", "run", "--config", str(self.config)]
        env = None
        if self.root != ROOT or self.env:
            # The checkout's packages first (its client library too, where it has one).
            client = self.root / "client"
            path = [self.env.get("PYTHONPATH", ""), str(self.root),
                    str(client) if client.is_dir() else ""]
            env = {**os.environ, **self.env, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
        self.proc = await asyncio.create_subprocess_exec(
            *cmd, env=env,
            cwd=self.root, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        async for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            self.tail = [*self.tail[-29:], line]
            try:
                rec = json.loads(line)
            except ValueError:
                self.levels["non-json"] += 1
                continue
            self.levels[rec.get("level", "?")] += 1
            self.events[rec.get("event", "?")] += 1
            if rec.get("event") == "ready":
                self.offers = rec.get("offers")
                self.ready.set()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def wait_ready(self, timeout: float = 120.0) -> None:
        assert self.proc is not None
        waiter = asyncio.create_task(self.ready.wait())
        died = asyncio.create_task(self.proc.wait())
        done, _ = await asyncio.wait({waiter, died}, timeout=timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        died.cancel()
        if not self.ready.is_set():
            why = "exited" if died in done else f"not ready within {timeout:g}s"
            raise RuntimeError(f"gpubroker {why}:\n" + "\n".join(self.tail))

    async def settle(self, quiet_cpu: float = 0.10, window: float = 0.5,
                     limit: float = 30.0) -> float:
        """Wait until the daemon is idle (CPU below `quiet_cpu` over `window`): the
        first round's capacity summaries are published. Returns the seconds waited."""
        start = time.monotonic()
        while time.monotonic() - start < limit:
            c0 = cpu_seconds(self.pid)
            await asyncio.sleep(window)
            if (cpu_seconds(self.pid) - c0) / window < quiet_cpu:
                break
        return time.monotonic() - start

    async def stop(self) -> int | None:
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 20)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(self._reader, 2)
        return proc.returncode


@contextlib.contextmanager
def fresh_database(admin_url: str, prefix: str = "gpubroker_bench") -> Iterator[str]:
    """A new, empty PostgreSQL database on the server of `admin_url` (a libpq URL of a
    role that may create databases); yields its URL; drops it afterwards, with any
    session still on it."""
    import psycopg

    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_url, autocommit=True, connect_timeout=5) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        u = urlsplit(admin_url)
        yield urlunsplit((u.scheme, u.netloc, f"/{name}", u.query, u.fragment))
    finally:
        with psycopg.connect(admin_url, autocommit=True, connect_timeout=5) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def run_echo(url: str, nodelay: bool) -> None:
    """The echo responder (`--echo URL`, run as its own process): every message on
    ECHO_REQ goes back, QoS 1, to ECHO_REP; publishes are not awaited one by one."""

    async def main() -> None:
        host, port = url.removeprefix("mqtt://").rsplit(":", 1)
        async with mqtt_client(host, int(port), "bench-echo", nodelay=nodelay) as client:
            await client.subscribe(ECHO_REQ, qos=1)
            print("ready", flush=True)
            pending: set[asyncio.Task[None]] = set()
            async for msg in client.messages:
                t = asyncio.create_task(client.publish(ECHO_REP, msg.payload, qos=1))
                pending.add(t)
                t.add_done_callback(pending.discard)

    with contextlib.suppress(KeyboardInterrupt, aiomqtt.MqttError):
        asyncio.run(main())


def mqtt_client(host: str, port: int, name: str, *, nodelay: bool) -> aiomqtt.Client:
    """The bench's clients. `nodelay` sets TCP_NODELAY: paho-mqtt leaves Nagle's
    algorithm on, which holds a small write back while an earlier one is unacknowledged
    (with the peer's delayed ACK, up to ~40 ms per message on loopback)."""
    client = aiomqtt.Client(
        host, port, identifier=f"{name}-{uuid.uuid4().hex[:8]}",
        socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)] if nodelay else (),
        protocol=aiomqtt.ProtocolVersion.V5, keepalive=60, timeout=30,
        max_inflight_messages=65535, max_queued_incoming_messages=0)
    client.pending_calls_threshold = 10**9  # the INFLIGHT_WINDOW bounds them
    return client


# --------------------------------------------------------------------------------------
# the load: open loop, fixed schedule, answers matched by id
# --------------------------------------------------------------------------------------

@dataclass
class PhaseResult:
    name: str
    sent: int = 0  # in the measured window (after warm-up)
    answered: int = 0
    missing: int = 0
    duplicates: int = 0
    sent_total: int = 0  # warm-up included
    answered_total: int = 0
    missing_total: int = 0
    duplicates_total: int = 0
    p50_ms: float = math.nan
    p90_ms: float = math.nan
    p99_ms: float = math.nan
    max_ms: float = math.nan
    mean_ms: float = math.nan
    send_rate: float = math.nan  # achieved, measured window
    send_lag_p99_ms: float = math.nan  # how late sends were against the schedule
    send_lag_max_ms: float = math.nan
    p50_by_window_ms: list[float] = field(default_factory=list)  # per WINDOW_S of sends
    kinds: dict[str, int] = field(default_factory=dict)  # answer type -> count
    codes: dict[str, int] = field(default_factory=dict)  # rejection code -> count
    other_events: dict[str, int] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)  # process -> % of one core
    server_threads: dict[str, float] = field(default_factory=dict)  # the server's, by thread
    extra: dict[str, Any] = field(default_factory=dict)


def percentile(sorted_xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_xs:
        return math.nan
    k = max(0, math.ceil(q / 100 * len(sorted_xs)) - 1)
    return sorted_xs[k]


Answer = tuple[str, str, str | None]  # (key, kind, rejection code)


async def run_load(name: str, host: str, port: int, *, rate: float, duration: float,
                   warmup: float, subscribe: str,
                   make: Callable[[int], tuple[str, bytes, str]],
                   parse: Callable[[aiomqtt.Message], Answer | None],
                   pids: dict[str, int], nodelay: bool, drain: float = 15.0
                   ) -> PhaseResult:
    """Send `rate`/s for `warmup + duration` s on a fixed schedule (open loop: never
    waits for answers; QoS 1 PUBACKs are awaited by per-message tasks inside a window
    of INFLIGHT_WINDOW), then wait up to `drain` s for the outstanding answers."""
    res = PhaseResult(name)
    total = round(rate * (warmup + duration))
    measured_from = round(rate * warmup)
    sent_at: dict[str, float] = {}
    lag: list[float] = []
    index_of: dict[str, int] = {}
    answers: dict[str, tuple[float, str, str | None]] = {}
    dups: Counter[str] = Counter()
    other: Counter[str] = Counter()
    window = asyncio.Semaphore(INFLIGHT_WINDOW)
    publish_errors: list[BaseException] = []

    async with mqtt_client(host, port, f"bench-load-{name}", nodelay=nodelay) as client:
        await client.subscribe(subscribe, qos=1)

        async def receive() -> None:
            async for msg in client.messages:
                now = time.monotonic()
                got = parse(msg)
                if got is None:
                    continue
                key, kind, code = got
                if key not in sent_at:
                    other[kind] += 1
                elif key in answers:
                    dups[key] += 1
                else:
                    answers[key] = (now, kind, code)

        async def publish(topic: str, payload: bytes, key: str, due: float) -> None:
            try:
                now = time.monotonic()
                sent_at[key] = now
                lag.append(now - due)
                await client.publish(topic, payload, qos=1)
            except aiomqtt.MqttError as exc:
                publish_errors.append(exc)
            finally:
                window.release()

        tasks: set[asyncio.Task[None]] = set()
        receiver = asyncio.create_task(receive())
        try:
            cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
            server = next(iter(pids.values()))  # the echo or the daemon, listed first
            threads0 = thread_cpu_seconds(server)
            t_cpu0 = time.monotonic()
            t0 = time.monotonic() + 0.05
            i = 0
            while i < total:
                now = time.monotonic()
                due = t0 + i / rate
                if due > now:
                    await asyncio.sleep(due - now)
                    continue
                while i < total and t0 + i / rate <= now:  # everything due by now
                    topic, payload, key = make(i)
                    index_of[key] = i
                    await window.acquire()
                    t = asyncio.create_task(publish(topic, payload, key, t0 + i / rate))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
                    i += 1
                await asyncio.sleep(0)  # let the publish tasks write
            if tasks:
                await asyncio.wait(tasks, timeout=30)
            t_sent = time.monotonic()
            cpu1 = {k: cpu_seconds(p) for k, p in pids.items()}
            res.cpu = {k: round(100 * (cpu1[k] - cpu0[k]) / (t_sent - t_cpu0), 1) for k in pids}
            res.server_threads = split_by_thread(server, threads0,
                                                 thread_cpu_seconds(server), t_sent - t_cpu0)
            # Drain: until everything is answered, or no progress for `drain` seconds.
            last, last_change = len(answers), time.monotonic()
            while len(answers) < len(sent_at) and time.monotonic() - last_change < drain:
                await asyncio.sleep(0.1)
                if len(answers) != last:
                    last, last_change = len(answers), time.monotonic()
            await asyncio.sleep(0.5)  # late duplicates
            if receiver.done():  # the connection broke: the figures would lie
                receiver.result()
        finally:
            receiver.cancel()
            for t in list(tasks):
                t.cancel()
            with contextlib.suppress(asyncio.CancelledError, aiomqtt.MqttError):
                await receiver

    if publish_errors:
        res.extra["publish_errors"] = len(publish_errors)
        res.extra["publish_error"] = str(publish_errors[0])
    measured = [k for k, n in index_of.items() if n >= measured_from and k in sent_at]
    lat = sorted((answers[k][0] - sent_at[k]) * 1000 for k in measured if k in answers)
    res.sent_total = len(sent_at)
    res.answered_total = sum(1 for k in sent_at if k in answers)
    res.missing_total = res.sent_total - res.answered_total
    res.duplicates_total = sum(dups.values())
    res.sent = len(measured)
    res.answered = len(lat)
    res.missing = res.sent - res.answered
    res.duplicates = sum(dups[k] for k in measured)
    if lat:
        res.p50_ms, res.p90_ms = percentile(lat, 50), percentile(lat, 90)
        res.p99_ms, res.max_ms = percentile(lat, 99), lat[-1]
        res.mean_ms = sum(lat) / len(lat)
    buckets: dict[int, list[float]] = {}
    for k in sent_at:
        if k in answers:
            n = int(index_of[k] / rate / WINDOW_S)
            buckets.setdefault(n, []).append((answers[k][0] - sent_at[k]) * 1000)
    res.p50_by_window_ms = [round(percentile(sorted(buckets[n]), 50), 1)
                            for n in sorted(buckets)]
    times = sorted(sent_at[k] for k in measured)
    if len(times) > 1:
        res.send_rate = (len(times) - 1) / (times[-1] - times[0])
    lags = sorted(x * 1000 for x in lag)
    res.send_lag_p99_ms, res.send_lag_max_ms = percentile(lags, 99), lags[-1] if lags else 0
    res.kinds = dict(Counter(answers[k][1] for k in sent_at if k in answers))
    res.codes = dict(Counter(c for k in sent_at if k in answers
                             if (c := answers[k][2]) is not None))
    res.other_events = dict(other)
    return res


# --------------------------------------------------------------------------------------
# the phases
# --------------------------------------------------------------------------------------

class RawPublisher(asyncio.Protocol):
    """A connection that only publishes, in hand-written MQTT packets (no client
    library): QoS 1 PUBLISHes written back to back, their PUBACKs counted. What a bench
    uses when its own client must not be what it measures (a burst of thousands sent
    at once), and the floor bench/mqtt_layer.py measures clients against. No
    reconnects, no sessions; MQTT 3.1.1 ("3.1.1") or 5 ("5")."""

    def __init__(self, version: str = "3.1.1") -> None:
        self.version = version
        self.buf = bytearray()
        self.acks = 0
        self.connacked = asyncio.get_running_loop().create_future()
        self.wake: asyncio.Future[None] | None = None
        self.want = 0
        self.transport: asyncio.Transport | None = None
        self._mid = 0

    @classmethod
    async def connect(cls, host: str, port: int, client_id: str, version: str = "3.1.1"
                      ) -> RawPublisher:
        loop = asyncio.get_running_loop()
        _, proto = await loop.create_connection(lambda: cls(version), host, port)
        assert proto.transport is not None
        proto.transport.get_extra_info("socket").setsockopt(
            socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        level, props = (5, b"\x00") if version == "5" else (4, b"")
        proto.transport.write(_packet(0x10, _mqtt_str("MQTT") + bytes([level, 0x02])
                                      + (60).to_bytes(2, "big") + props
                                      + _mqtt_str(client_id)))
        await proto.connacked
        return proto

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def publish(self, topic: str, payload: bytes) -> None:
        """Write one QoS 1 PUBLISH (not waiting for anything)."""
        assert self.transport is not None
        self._mid = self._mid % 65535 + 1
        props = b"\x00" if self.version == "5" else b""
        self.transport.write(_packet(0x32, _mqtt_str(topic) + self._mid.to_bytes(2, "big")
                                     + props + payload))

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        while len(buf) >= 2:
            length, shift, i = 0, 0, 1
            while True:
                if i >= len(buf):
                    return
                byte = buf[i]
                length |= (byte & 0x7F) << shift
                shift += 7
                i += 1
                if not byte & 0x80:
                    break
            if len(buf) < i + length:
                return
            kind = buf[0] >> 4
            del buf[:i + length]
            if kind == 2:
                self.connacked.set_result(None)
            elif kind == 4:
                self.acks += 1
                if self.wake is not None and self.acks >= self.want and not self.wake.done():
                    self.wake.set_result(None)

    async def until(self, acks: int) -> None:
        """Wait until `acks` PUBACKs are in."""
        if self.acks < acks:
            self.want = acks
            self.wake = asyncio.get_running_loop().create_future()
            await self.wake

    def close(self) -> None:
        if self.transport is not None:
            self.transport.write(b"\xe0\x00")  # DISCONNECT
            self.transport.close()


def _packet(kind: int, body: bytes) -> bytes:
    n, length = len(body), bytearray()
    while True:
        n, byte = divmod(n, 128)
        length.append(byte | (0x80 if n else 0))
        if not n:
            return bytes([kind]) + bytes(length) + body


def _mqtt_str(text: str) -> bytes:
    raw = text.encode()
    return len(raw).to_bytes(2, "big") + raw


def host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("mqtt://").rsplit(":", 1)
    return host, int(port)


async def baseline(mosq: Mosquitto, args: argparse.Namespace) -> PhaseResult:
    host, port = host_port(mosq.url)
    echo = await asyncio.create_subprocess_exec(
        sys.executable, str(SCRIPT), "--echo", mosq.url,
        *([] if args.nodelay else ["--no-nodelay"]),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        start_new_session=True)
    try:
        assert echo.stdout is not None
        line = await asyncio.wait_for(echo.stdout.readline(), 30)
        if line.strip() != b"ready":
            raise RuntimeError("echo responder did not start")
        pad = "x" * 120  # about the size of a placement request

        def make(i: int) -> tuple[str, bytes, str]:
            key = str(i)
            return ECHO_REQ, json.dumps({"id": key, "pad": pad}).encode(), key

        def parse(msg: aiomqtt.Message) -> Answer | None:
            payload = msg.payload
            assert isinstance(payload, bytes | bytearray)
            return json.loads(payload)["id"], "echo", None

        assert mosq.proc is not None
        return await run_load("baseline", host, port, rate=args.rate,
                              duration=args.duration, warmup=args.warmup,
                              subscribe=ECHO_REP, make=make, parse=parse,
                              pids={"echo": echo.pid, "mosquitto": mosq.proc.pid,
                                    "bench": os.getpid()},
                              nodelay=args.nodelay)
    finally:
        if echo.returncode is None:
            echo.terminate()
            try:
                await asyncio.wait_for(echo.wait(), 5)
            except TimeoutError:
                echo.kill()
                await echo.wait()


def place_requests(tag: str) -> Callable[[int], tuple[str, bytes, str]]:
    def make(i: int) -> tuple[str, bytes, str]:
        request_id = f"bench-{tag}-{i:07d}"
        body = {"request_id": request_id, **MIX[i % len(MIX)],
                "lease_seconds": LEASE_SECONDS, "labels": {"bench": tag}}
        scheduler = SCHEDULERS[(i // len(MIX)) % len(SCHEDULERS)]
        return (f"{PREFIX}/requests/{scheduler}/place",
                json.dumps(body, separators=(",", ":")).encode(), request_id)

    return make


def parse_event(msg: aiomqtt.Message) -> Answer | None:
    kind = str(msg.topic).rsplit("/", 1)[-1]
    payload = msg.payload
    if not isinstance(payload, bytes | bytearray):
        return None
    data = json.loads(payload).get("data", {})
    request_id = data.get("request_id")
    if kind not in ("placement.decided", "placement.rejected", "request.invalid") or \
            request_id is None:
        return "", kind, None  # counted under other_events (failovers ...)
    return request_id, kind, data.get("code")


def loop_lag(listen: str, before: dict[str, Any] | None = None) -> dict[str, Any]:
    """The daemon's event-loop lag, from its /metrics: the longest since its start (a
    gauge), and how many of its 50 ms timers ran more than 20, 50 and 100 ms late (the
    histogram) — since `before` (an earlier reading) when given, else since the start."""
    import urllib.request

    with urllib.request.urlopen(f"http://{listen}/metrics", timeout=10) as r:
        text = r.read().decode()
    buckets: dict[float, float] = {}
    out: dict[str, Any] = {}
    for line in text.splitlines():
        if line.startswith("gpubroker_event_loop_lag_seconds_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[math.inf if le == "+Inf" else float(le)] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("gpubroker_event_loop_lag_max_seconds "):
            out["loop_lag_max_ms"] = round(float(line.rsplit(" ", 1)[1]) * 1000, 1)
    out["buckets"] = dict(buckets)
    if before is not None and before.get("buckets"):
        buckets = {le: n - before["buckets"].get(le, 0.0) for le, n in buckets.items()}
        if out.get("loop_lag_max_ms", 0) > before.get("loop_lag_max_ms", 0):
            out["loop_lag_max_in_window_ms"] = out["loop_lag_max_ms"]
    if buckets:
        total = buckets[math.inf]
        out["loop_lag_timers"] = int(total)
        for ms in (20, 50, 100):
            out[f"loop_lag_over_{ms}ms"] = int(total - buckets.get(ms / 1000, total))
    return out


async def gpubroker(mosq: Mosquitto, args: argparse.Namespace, workdir: Path, *,
                    name: str, poll_interval: float, state_url: str | None = None,
                    http_listen: str | None = None, root: Path = ROOT,
                    synchronous: str | None = None) -> PhaseResult:
    """One phase on the real daemon; `state_url`: its state on PostgreSQL (a database
    of its own, fresh) instead of a fresh SQLite file; `synchronous`: that SQLite
    setting (default: the daemon's)."""
    host, port = host_port(mosq.url)
    daemon = Daemon(workdir / name, mosq.url, seed=args.seed,
                    regions=args.regions_per_cloud, poll_interval=poll_interval,
                    state_url=state_url, http_listen=http_listen, root=root,
                    synchronous=synchronous)
    t_start = time.monotonic()
    await daemon.start()
    try:
        await daemon.wait_ready()
        t_ready = time.monotonic() - t_start
        settle = await daemon.settle()
        rss_ready = proc_status(daemon.pid)
        lag_before = loop_lag(http_listen) if http_listen else None
        assert mosq.proc is not None
        res = await run_load(name, host, port, rate=args.rate, duration=args.duration,
                             warmup=args.warmup, subscribe=f"{PREFIX}/events/+/+",
                             make=place_requests(f"{name}-{uuid.uuid4().hex[:6]}"),
                             parse=parse_event,
                             pids={"daemon": daemon.pid, "mosquitto": mosq.proc.pid,
                                   "bench": os.getpid()},
                             nodelay=args.nodelay)
        end = proc_status(daemon.pid)
        if http_listen:
            lag = loop_lag(http_listen, lag_before)
            lag.pop("buckets", None)
            res.extra.update(lag)
        res.extra.update(
            offers=daemon.offers, poll_interval_s=poll_interval,
            start_to_ready_s=round(t_ready, 2), settle_s=round(settle, 2),
            rss_after_first_poll_mib=round(rss_ready.get("VmRSS", 0) / 1024, 1),
            rss_end_mib=round(end.get("VmRSS", 0) / 1024, 1),
            peak_rss_mib=round(end.get("VmHWM", 0) / 1024, 1),
            log_levels=dict(daemon.levels))
        if state_url:
            res.extra["state"] = "postgresql"
        else:
            res.extra["synchronous"] = synchronous or "daemon default"
        return res
    finally:
        rc = await daemon.stop()
        if rc not in (0, None):
            print(f"bench: gpubroker ({name}) exited with code {rc}:\n"
                  + "\n".join(daemon.tail[-10:]), file=sys.stderr)


def fsync_probe(folder: Path, iterations: int, size: int = 4096) -> dict[str, Any]:
    """Time `os.fsync` of a small file in `folder` (the state's file system): append
    `size` bytes, then fsync, `iterations` times. A synced commit costs at least this
    (SQLite appends the transaction's pages to the WAL and syncs it)."""
    path = folder / "fsync-probe"
    times: list[float] = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        block = os.urandom(size)
        for _ in range(iterations):
            os.write(fd, block)
            t0 = time.perf_counter()
            os.fsync(fd)
            times.append((time.perf_counter() - t0) * 1000)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    times.sort()
    return {"dir": str(folder), "fs": filesystem(folder), "iterations": iterations,
            "bytes": size, "p50_ms": round(percentile(times, 50), 3),
            "p99_ms": round(percentile(times, 99), 3), "max_ms": round(times[-1], 3)}


def filesystem(folder: Path) -> str:
    """The type and device of the mount `folder` is on (/proc/mounts: the longest
    mount point that contains it)."""
    best, found = "", "?"
    target = str(folder.resolve())
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fstype = line.split()[:3]
            if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and \
                    len(mnt) >= len(best):
                best, found = mnt, f"{fstype} on {dev}"
    return found


# --------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------

def ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def report(results: list[PhaseResult], args: argparse.Namespace) -> dict[str, Any]:
    base = results[0]
    out: dict[str, Any] = {
        "rate": args.rate, "duration_s": args.duration, "warmup_s": args.warmup,
        "seed": args.seed, "regions_per_cloud": args.regions_per_cloud,
        "bench_clients_nodelay": args.nodelay,
        "mosquitto_max_inflight": args.mosquitto_max_inflight,
        "phases": [asdict(r) for r in results],
        "ratios": {r.name: {"p50": round(ratio(r.p50_ms, base.p50_ms), 2),
                            "p99": round(ratio(r.p99_ms, base.p99_ms), 2)}
                   for r in results[1:]},
    }
    if args.state_url:
        out["state"] = "postgresql"
    if args.fsync:
        out["fsync_probe"] = args.fsync
    if (pair := sync_pair(results)) is not None:
        normal, full = pair
        out["full_vs_normal"] = {"p50": round(ratio(full.p50_ms, normal.p50_ms), 2),
                                 "p99": round(ratio(full.p99_ms, normal.p99_ms), 2)}
    return out


def sync_pair(results: list[PhaseResult]) -> tuple[PhaseResult, PhaseResult] | None:
    """The normal and the full phase of `--synchronous both`, if it ran."""
    by = {r.extra.get("synchronous"): r for r in results if r.name.startswith("gpubroker[")}
    if "normal" in by and "full" in by:
        return by["normal"], by["full"]
    return None


def print_table(results: list[PhaseResult], args: argparse.Namespace) -> None:
    def f(x: float, nd: int = 1) -> str:
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"

    head = ("phase", "sent", "answered", "missing", "dup", "p50 ms", "p90 ms", "p99 ms",
            "max ms", "sent/s", "cpu% (server,mosq,bench)")
    rows = [head]
    for r in results:
        cpu = ",".join(f"{v:.0f}" for v in r.cpu.values())
        rows.append((r.name, str(r.sent), str(r.answered), str(r.missing), str(r.duplicates),
                     f(r.p50_ms, 2), f(r.p90_ms, 2), f(r.p99_ms, 2), f(r.max_ms, 1),
                     f(r.send_rate), cpu))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    print(f"latency bench: {args.rate:g} msg/s open loop, QoS 1, {args.duration:g} s measured "
          f"after {args.warmup:g} s warm-up; sim seed {args.seed}, "
          f"{args.regions_per_cloud} regions/cloud"
          + ("; bench clients with TCP_NODELAY" if args.nodelay else "; Nagle on everywhere")
          + (f"; EXPERIMENT: mosquitto max_inflight_messages {args.mosquitto_max_inflight}"
             if args.mosquitto_max_inflight is not None else "")
          + ("; state on PostgreSQL (a fresh database per phase)" if args.state_url else ""))
    for row in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(row, widths, strict=True))))
    base = results[0]
    for r in results[1:]:
        e = r.extra
        print(f"{r.name}: p50 {ratio(r.p50_ms, base.p50_ms):.1f}x baseline, "
              f"p99 {ratio(r.p99_ms, base.p99_ms):.1f}x baseline; offers {e.get('offers')}; "
              f"poll interval {e.get('poll_interval_s'):g} s; "
              f"RSS after first poll {e.get('rss_after_first_poll_mib')} MiB, "
              f"peak (VmHWM) {e.get('peak_rss_mib')} MiB")
        if "loop_lag_timers" in e:
            during = e.get("loop_lag_max_in_window_ms")
            print(f"  event loop under load: {e['loop_lag_timers']} timers (50 ms), "
                  f"{e['loop_lag_over_20ms']} more than 20 ms late, "
                  f"{e['loop_lag_over_50ms']} more than 50 ms, "
                  f"{e['loop_lag_over_100ms']} more than 100 ms; longest lag "
                  + (f"{during} ms (during the load)" if during is not None else
                     f"since the start {e.get('loop_lag_max_ms')} ms (before the load)"))
        if r.server_threads:
            print(f"  {r.name} CPU by thread (% of a core): " + ", ".join(
                f"{k} {v:.0f}" for k, v in r.server_threads.items()))
        codes = ", ".join(f"{k} {v}" for k, v in sorted(r.codes.items()))
        kinds = r.kinds
        print(f"  answers (warm-up included, {r.sent_total} sent): "
              f"decided {kinds.get('placement.decided', 0)}, "
              f"rejected {kinds.get('placement.rejected', 0)} ({codes or 'none'}), "
              f"invalid {kinds.get('request.invalid', 0)}, missing {r.missing_total}, "
              f"duplicates {r.duplicates_total}; other events {r.other_events or 'none'}; "
              f"send lag p99 {f(r.send_lag_p99_ms, 2)} ms")
    for r in results:
        print(f"{r.name} p50 ms per {WINDOW_S:g} s of sends (warm-up first): "
              + " ".join(f"{x:g}" for x in r.p50_by_window_ms))
    print(f"baseline send lag p99 {f(base.send_lag_p99_ms, 2)} ms; "
          f"answers {base.answered_total}/{base.sent_total}")
    for r in results:
        if "publish_errors" in r.extra:
            print(f"{r.name}: {r.extra['publish_errors']} publish errors, e.g. "
                  f"{r.extra['publish_error']}")
    if (probe := args.fsync) is not None:
        print(f"fsync probe ({probe['iterations']} × {probe['bytes']} B appended then "
              f"os.fsync, in {probe['dir']}, {probe['fs']}): p50 {probe['p50_ms']} ms, "
              f"p99 {probe['p99_ms']} ms, max {probe['max_ms']} ms")
    if (pair := sync_pair(results)) is not None:
        normal, full = pair
        print(f"synchronous full against normal: p50 {f(full.p50_ms, 2)} / "
              f"{f(normal.p50_ms, 2)} ms = {ratio(full.p50_ms, normal.p50_ms):.2f}x, "
              f"p99 {f(full.p99_ms, 2)} / {f(normal.p99_ms, 2)} ms = "
              f"{ratio(full.p99_ms, normal.p99_ms):.2f}x")


# --------------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=500.0, help="messages per second (500)")
    p.add_argument("--duration", type=float, default=20.0, help="measured seconds (20)")
    p.add_argument("--warmup", type=float, default=2.0,
                   help="seconds of load before the measured window (2)")
    p.add_argument("--regions-per-cloud", type=int, default=88,
                   help="sim regions per cloud (88: about 20,000 offers)")
    p.add_argument("--seed", type=int, default=7, help="sim seed (7)")
    p.add_argument("--poll-interval", type=float, default=None,
                   help="poll interval of the main gpubroker phase (default: long enough "
                        "that no poll lands in the load)")
    p.add_argument("--poll-phase-interval", type=float, default=5.0,
                   help="poll interval of the extra phase with polls during the load "
                        "(5; 0 skips that phase)")
    p.add_argument("--no-nodelay", dest="nodelay", action="store_false",
                   help="leave Nagle's algorithm on in the bench's own MQTT clients (the "
                        "load client and the echo), as paho-mqtt does by default")
    p.add_argument("--mosquitto-max-inflight", type=int, default=None, metavar="N",
                   help="experiment: mosquitto's max_inflight_messages (QoS 1 messages "
                        "it sends a client before waiting for PUBACKs; default 20)")
    p.add_argument("--state-url", metavar="URL", default=None,
                   help="keep the daemon's state on PostgreSQL: each gpubroker phase gets a "
                        "fresh database on this server, dropped afterwards (a libpq URL of "
                        "a role that may create databases, e.g. "
                        "postgresql://postgres@127.0.0.1:5432/postgres); default SQLite")
    p.add_argument("--synchronous", choices=("normal", "full", "both"), default=None,
                   help="the SQLite daemon's state.synchronous (default: the daemon's, "
                        "full); both: the gpubroker phase twice, normal then full")
    p.add_argument("--fsync-probe", type=int, default=300, metavar="N",
                   help="time N fsyncs of a small file next to the state (300; 0: none)")
    p.add_argument("--dir", type=Path, default=None,
                   help="where the temporary directory (state files, logs) is made "
                        "(default: the system's temporary directory)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    p.add_argument("--echo", metavar="URL", help=argparse.SUPPRESS)  # internal
    args = p.parse_args(argv)
    if args.rate <= 0 or args.duration <= 0 or args.warmup < 0:
        p.error("--rate and --duration must be > 0, --warmup >= 0")
    if args.poll_interval is None:
        args.poll_interval = max(60.0, 3 * (args.warmup + args.duration) + 30)
    if args.state_url and args.synchronous:
        p.error("--synchronous is SQLite's; not with --state-url")
    args.fsync = None  # the probe's figures, once taken
    return args


async def amain(args: argparse.Namespace, workdir: Path) -> list[PhaseResult]:
    mosq = Mosquitto(workdir, args.mosquitto_max_inflight)
    mosq.start()
    try:
        async def phase(name: str, poll_interval: float,
                        synchronous: str | None = None) -> PhaseResult:
            if not args.state_url:
                return await gpubroker(mosq, args, workdir, name=name,
                                       poll_interval=poll_interval,
                                       http_listen=f"127.0.0.1:{free_port()}",
                                       synchronous=synchronous)
            with fresh_database(args.state_url) as url:
                return await gpubroker(mosq, args, workdir, name=name,
                                       poll_interval=poll_interval, state_url=url,
                                       http_listen=f"127.0.0.1:{free_port()}")

        results = [await baseline(mosq, args)]
        if args.fsync_probe > 0 and not args.state_url:
            args.fsync = await asyncio.to_thread(fsync_probe, workdir, args.fsync_probe)
        if args.synchronous == "both":
            for sync in ("normal", "full"):
                results.append(await phase(f"gpubroker[{sync}]", args.poll_interval, sync))
        else:
            results.append(await phase("gpubroker", args.poll_interval, args.synchronous))
        if args.poll_phase_interval > 0:
            results.append(await phase("gpubroker+polls", args.poll_phase_interval,
                                       None if args.synchronous == "both" else
                                       args.synchronous))
        return results
    finally:
        mosq.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.echo:
        run_echo(args.echo, args.nodelay)
        return 0
    with bench_workdir("bench", keep=args.keep, parent=args.dir) as workdir:
        results = asyncio.run(amain(args, workdir))
    if args.json:
        print(json.dumps(report(results, args), indent=2))
    else:
        print_table(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
