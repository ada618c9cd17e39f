"""Chaos harness: the daemon as a process, a scheduler that re-sends, retained-state checks.

Shared by the chaos tests (``tests/chaos/``) and the chaos bench (``bench/chaos.py``),
so both measure with the same client:

* ``ChaosMosquitto`` — ``mqtt_helpers.Mosquitto`` with the persistence made a choice:
  ``persistence=True`` saves every ``autosave_seconds`` (retained messages and sessions
  survive a ``kill -9``, less the last moment), ``False`` keeps nothing. Queue limits as
  in ``deploy/mosquitto/mosquitto.conf``.
* ``write_daemon_config`` / ``DaemonProcess`` — ``gpubroker run --config FILE`` as a
  subprocess (its own session, so a Ctrl-C in the terminal reaches the harness only),
  its output appended to one log file across restarts, HTTP on a loopback port, and a
  record of every exit the harness did not cause.
* ``MqttClient`` — an aiomqtt MQTT 5 client (clean start, its own client id) that
  reconnects by itself when the server goes away and records what it receives.
* ``ResendingScheduler`` — what a careful scheduler does: sends placement requests with
  unique ``request_id``s on a fixed schedule and re-sends every request still unanswered
  after ``resend_after`` seconds with the *same* ``request_id`` (backing off, until
  ``give_up_at``), across its own reconnects. Rejections are answers.
* ``StatusWatcher`` — follows ``P/status`` (Retain-As-Published, so a will or an
  ``offline`` published retained arrives flagged retained).
* ``retained_snapshot`` / ``check_retained_leases`` — what a subscriber arriving now
  would find retained, against the active leases of ``GET /v1/leases``.

Everything is on 127.0.0.1. Every process started here is killed at interpreter exit
if nobody stopped it before.
"""

from __future__ import annotations

import asyncio
import atexit
import bisect
import contextlib
import itertools
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Self, TypeVar

import aiohttp
import aiomqtt
import contract_check
import yaml
from mqtt_helpers import ContractViolation, Mosquitto, free_port
from paho.mqtt.subscribeoptions import SubscribeOptions

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[2]
PREFIX = "gpubroker/v1"
HOST = "127.0.0.1"
DECISIONS = ("placement.decided", "placement.rejected")
LOG_PATTERNS = ("Traceback", "Future exception was never retrieved")

# --------------------------------------------------------------------------------------
# process clean-up: whatever happens to the caller, no mosquitto or daemon is left behind
# --------------------------------------------------------------------------------------

_LIVE: dict[int, Callable[[], None]] = {}
_IDS = itertools.count()


def _track(kill: Callable[[], None]) -> int:
    key = next(_IDS)
    _LIVE[key] = kill
    return key


def kill_everything() -> None:
    """Kill every process the harness started and nobody stopped (atexit, Ctrl-C)."""
    for key in list(_LIVE):
        kill = _LIVE.pop(key, None)
        if kill is not None:
            with contextlib.suppress(Exception):
                kill()


atexit.register(kill_everything)

# The harness's own MQTT clients lose their server on purpose; paho's "failed to receive
# on socket" errors about that are noise here.
MQTT_LOG = logging.getLogger("chaos.mqtt")
MQTT_LOG.setLevel(logging.CRITICAL)


def wall() -> datetime:
    return datetime.now(UTC)


def parse_ts(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


# --------------------------------------------------------------------------------------
# mosquitto
# --------------------------------------------------------------------------------------

class ChaosMosquitto(Mosquitto):
    """A mosquitto whose persistence is chosen: on (saved every ``autosave_seconds``,
    so a ``kill()`` loses at most that much) or off (a ``kill()`` loses everything).

    Logs connections, warnings and errors only (not every PUBLISH: under load that would
    be measured too). Queue limits as in deploy/mosquitto: a subscriber holding a few
    thousand retained leases gets all of them on subscribe."""

    def __init__(self, workdir: Path, *, persistence: bool, autosave_seconds: int = 1,
                 port: int | None = None) -> None:
        super().__init__(workdir, port, extra_config="max_queued_messages 20000")
        self.persistence = persistence
        self.autosave_seconds = autosave_seconds
        self._key: int | None = None

    def _persistence_config(self) -> list[str]:
        if not self.persistence:
            return ["persistence false"]
        return ["persistence true", f"persistence_location {self.data_dir}/",
                f"autosave_interval {self.autosave_seconds}", "autosave_on_changes false"]

    def _log_types(self) -> list[str]:
        return ["error", "warning", "notice", "information"]

    def start(self, timeout: float = 10.0) -> None:
        super().start(timeout)
        if self._key is None:
            self._key = _track(self.kill)

    def stop(self, timeout: float = 10.0) -> None:
        super().stop(timeout)
        if self._key is not None:
            _LIVE.pop(self._key, None)
            self._key = None


# --------------------------------------------------------------------------------------
# the daemon as a process
# --------------------------------------------------------------------------------------

def write_daemon_config(path: Path, *, mqtt_url: str, state_path: Path, http_port: int,
                        client_id: str = "gpubroker-chaos", site: str = "chaos",
                        poll_interval: float = 5.0, sim: dict[str, Any] | None = None,
                        log_level: str = "info") -> Path:
    """A `gpubroker run` config: the simulated market, SQLite state, HTTP on loopback."""
    cfg: dict[str, Any] = {
        "site": site,
        "log_level": log_level,
        "state": {"path": str(state_path)},
        "mqtt": {"url": mqtt_url, "topic_prefix": PREFIX, "client_id": client_id},
        "http": {"listen": f"{HOST}:{http_port}"},
        "poll": {"interval_seconds": poll_interval,
                 "stale_after_seconds": max(300.0, 3 * poll_interval)},
        "clouds": {"sim": sim if sim is not None else {"seed": 7}},
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


class DaemonDied(RuntimeError):
    """The daemon process exited while the harness waited for it."""


@dataclass
class Exit:
    boot: int  # 1 = the first start
    code: int | None
    expected: bool  # the harness signalled it
    at: float  # monotonic


class DaemonProcess:
    """`python -m broker.cli run --config FILE`, started, signalled and restarted.

    ``exits`` records how every run ended; ``unexpected_exits`` those the harness did
    not cause by a signal (the daemon must never exit on its own)."""

    def __init__(self, config: Path, log_path: Path, http_port: int) -> None:
        self.config = config
        self.log_path = log_path
        self.http_port = http_port
        self.proc: subprocess.Popen[bytes] | None = None
        self.boots = 0
        self.exits: list[Exit] = []
        self._expected = False
        self._exited = asyncio.Event()
        self._pidfd: int | None = None
        self._key: int | None = None
        self.started_at = math.nan

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def unexpected_exits(self) -> list[Exit]:
        return [e for e in self.exits if not e.expected]

    def start(self) -> None:
        if self.alive:
            raise RuntimeError("daemon already running")
        with self.log_path.open("ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "broker.cli", "run", "--config", str(self.config)],
                cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        self.proc = proc
        self.boots += 1
        self.started_at = time.monotonic()
        self._expected = False
        self._key = _track(lambda: _kill_wait(proc))
        self._exited = asyncio.Event()
        # Learn of the exit from a pidfd on the event loop: no thread blocks on wait().
        loop = asyncio.get_running_loop()
        fd = os.pidfd_open(proc.pid)
        self._pidfd = fd
        loop.add_reader(fd, self._on_exit, proc, self.boots, self._exited)

    def _on_exit(self, proc: subprocess.Popen[bytes], boot: int, exited: asyncio.Event
                 ) -> None:
        self._drop_pidfd()
        code = proc.wait()
        self.exits.append(Exit(boot, code, self._expected, time.monotonic()))
        exited.set()
        if self._key is not None:
            _LIVE.pop(self._key, None)

    def _drop_pidfd(self) -> None:
        fd, self._pidfd = self._pidfd, None
        if fd is not None:
            with contextlib.suppress(RuntimeError, ValueError, OSError):
                asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)

    async def send(self, sig: signal.Signals) -> None:
        """Send a signal; the exit it causes counts as expected."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self._expected = True
        self.proc.send_signal(sig)

    async def wait(self, timeout: float = 30.0) -> int | None:
        """Wait for the process to exit; its code (None: still running at the timeout)."""
        if self.proc is None:
            return None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._exited.wait()
        return self.proc.returncode

    async def while_alive(self, aw: Awaitable[T], timeout: float) -> T:
        """`aw`'s result, unless this run of the daemon exits first (DaemonDied) or
        `timeout` passes (TimeoutError): nobody waits long on a dead daemon."""
        task = asyncio.ensure_future(aw)
        died = asyncio.ensure_future(self._exited.wait())
        try:
            done, _ = await asyncio.wait({task, died}, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            died.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if task in done:
            return task.result()
        if died in done:
            raise DaemonDied(f"the daemon exited with code {self.returncode}")
        raise TimeoutError(f"not done within {timeout:g}s")

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.proc is not None else None

    async def kill(self) -> int | None:
        await self.send(signal.SIGKILL)
        return await self.wait(10)

    async def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 30.0
                   ) -> int | None:
        """Signal and wait; SIGKILL after `timeout`. The exit code of the signal's exit
        (None when it had to be killed)."""
        await self.send(sig)
        code = await self.wait(timeout)
        if code is None and self.alive:
            await self.kill()
        return code

    def close(self) -> None:
        """Kill if still running (sync, for finally blocks and fixtures)."""
        if self.proc is not None:
            self._expected = True
            _kill_wait(self.proc)
        self._drop_pidfd()
        if self._key is not None:
            _LIVE.pop(self._key, None)

    # --- HTTP -------------------------------------------------------------------------

    def url(self, path: str) -> str:
        return f"http://{HOST}:{self.http_port}{path}"

    async def get_json(self, path: str, timeout: float = 5.0) -> Any:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s, \
                s.get(self.url(path)) as r:
            r.raise_for_status()
            return await r.json()

    async def leases(self, state: str | None = None) -> list[dict[str, Any]]:
        """`GET /v1/leases` (optionally `?state=`): the lease JSON objects."""
        rows: list[dict[str, Any]] = await self.get_json(
            "/v1/leases" + (f"?state={state}" if state else ""))
        return rows

    async def wait_ready(self, timeout: float = 60.0) -> float:
        """Poll `GET /readyz` until 200 (seconds since start); DaemonDied if it exits."""
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as s:
            while True:
                if not self.alive:
                    raise DaemonDied(f"daemon exited with code {self.proc and self.proc.poll()}"
                                     f" before it was ready\n{self.log_tail()}")
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with s.get(self.url("/readyz")) as r:
                        if r.status == 200:
                            return time.monotonic() - self.started_at
                if time.monotonic() > deadline:
                    raise TimeoutError(f"daemon not ready within {timeout}s\n{self.log_tail()}")
                await asyncio.sleep(0.05)

    # --- logs ---------------------------------------------------------------------------

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 30) -> str:
        return "--- daemon log (tail) ---\n" + "\n".join(self.log_text().splitlines()[-lines:])

    def log_counts(self) -> dict[str, int]:
        """How many log lines contain each of LOG_PATTERNS."""
        lines = self.log_text().splitlines()
        return {p: sum(p in line for line in lines) for p in LOG_PATTERNS}

    def log_matches(self, pattern: str, context: int = 0, limit: int = 5) -> list[str]:
        """Up to `limit` excerpts: each line containing `pattern`, with `context` lines
        after it (a traceback's frames)."""
        lines = self.log_text().splitlines()
        out = []
        for i, line in enumerate(lines):
            if pattern in line:
                out.append("\n".join(lines[i:i + 1 + context]))
                if len(out) >= limit:
                    break
        return out

    def events(self, name: str) -> list[dict[str, Any]]:
        """The daemon's JSON log records whose `event` is `name`."""
        found = []
        for line in self.log_text().splitlines():
            if name not in line:
                continue
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if isinstance(rec, dict) and rec.get("event") == name:
                    found.append(rec)
        return found


StartDaemon = Callable[..., Awaitable[DaemonProcess]]
"""The chaos tests' `start_daemon` fixture: `await start_daemon(mosquitto)`."""


def _kill_wait(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


# --------------------------------------------------------------------------------------
# MQTT clients
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Received:
    topic: str
    payload: bytes
    retain: bool
    at: float  # monotonic

    def json(self) -> Any:
        return json.loads(self.payload) if self.payload else None


Subscription = tuple[str, SubscribeOptions]


def sub(topic: str, *, qos: int = 1, retain_as_published: bool = False) -> Subscription:
    return topic, SubscribeOptions(qos=qos, retainAsPublished=retain_as_published)


class MqttClient:
    """An MQTT 5 client with a clean session and its own client id that stays connected:
    when the server goes away it connects again every `retry_seconds` and subscribes
    again. ``received`` keeps every message (``keep=True``); ``wait_for`` waits on one.
    Every message from the daemon is checked against the published contract
    (``tests/support/contract_check.py``); leaving ``async with`` raises ``ContractViolation``
    for those that break it (``contract_errors``)."""

    def __init__(self, port: int, subscriptions: Iterable[Subscription], *,
                 name: str = "chaos", retry_seconds: float = 0.1, keep: bool = True) -> None:
        self.port = port
        self.subscriptions = list(subscriptions)
        self.client_id = f"{name}-{uuid.uuid4().hex[:10]}"
        self.retry_seconds = retry_seconds
        self.keep = keep
        self.received: list[Received] = []
        self.contract_errors: list[str] = []
        self.connected = asyncio.Event()
        self.connects = 0
        self.disconnects = 0
        self.client: aiomqtt.Client | None = None
        self._cond = asyncio.Condition()
        self._lost = asyncio.Event()  # set when the current connection is gone
        self._task: asyncio.Task[None] | None = None
        self.on_connect: list[Callable[[], None]] = []

    async def start(self, timeout: float = 10.0) -> None:
        self._task = asyncio.create_task(self._run(), name=self.client_id)
        async with asyncio.timeout(timeout):
            await self.connected.wait()

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        await self.aclose()
        if exc_type is None and self.contract_errors:
            raise ContractViolation(self.client_id, self.contract_errors)

    async def _run(self) -> None:
        while True:
            client = aiomqtt.Client(
                HOST, self.port, identifier=self.client_id,
                protocol=aiomqtt.ProtocolVersion.V5, clean_start=True, keepalive=10,
                timeout=5, max_queued_incoming_messages=0, logger=MQTT_LOG,
                socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
            client.pending_calls_threshold = 100_000
            try:
                async with client:
                    if self.subscriptions:
                        await client.subscribe(self.subscriptions)
                    self._lost = asyncio.Event()
                    self.client = client
                    self.connects += 1
                    self.connected.set()
                    for hook in self.on_connect:
                        hook()
                    async for message in client.messages:
                        await self._deliver(message)
            except (aiomqtt.MqttError, OSError):
                pass
            finally:
                if self.client is client:
                    self.client = None
                    self._lost.set()
                    self.connected.clear()
                    self.disconnects += 1
                _retrieve(client)
            await asyncio.sleep(self.retry_seconds)

    async def _deliver(self, message: aiomqtt.Message) -> None:
        payload = message.payload
        if not isinstance(payload, bytes | bytearray):
            payload = str(payload or "").encode()
        rec = Received(str(message.topic), bytes(payload), bool(message.retain),
                       time.monotonic())
        if (error := contract_check.check(rec.topic, rec.payload)) is not None:
            self.contract_errors.append(error)
        self.handle(rec)
        if self.keep:
            self.received.append(rec)
        async with self._cond:
            self._cond.notify_all()

    def handle(self, rec: Received) -> None:
        """Subclasses look at each message here."""

    async def publish(self, topic: str, payload: bytes, *, qos: int = 1,
                      timeout: float = 10.0) -> None:
        """Publish (QoS 1: until the PUBACK). MqttError when not connected, or when the
        connection is lost before the PUBACK (aiomqtt would wait for it forever: a clean
        session never gets it)."""
        client, lost = self.client, self._lost
        if client is None:
            raise aiomqtt.MqttError("not connected")
        pub = asyncio.ensure_future(client.publish(topic, payload, qos=qos, timeout=math.inf))
        gone = asyncio.ensure_future(lost.wait())
        try:
            done, _ = await asyncio.wait({pub, gone}, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not pub.done():
                pub.cancel()
        if pub in done:
            pub.result()
            return
        with contextlib.suppress(asyncio.CancelledError, aiomqtt.MqttError):
            await pub
        raise aiomqtt.MqttError("connection lost before the PUBACK" if gone in done
                                else f"no PUBACK within {timeout:g}s")

    def mark(self) -> int:
        return len(self.received)

    async def wait_for(self, predicate: Callable[[Received], bool], timeout: float, *,
                       since: int = 0) -> Received:
        """The first received message (from index `since`) that matches."""
        checked = since
        try:
            async with asyncio.timeout(timeout), self._cond:
                while True:
                    for rec in self.received[checked:]:
                        if predicate(rec):
                            return rec
                    checked = max(checked, len(self.received))
                    await self._cond.wait()
        except TimeoutError:
            seen = [(r.topic, r.payload[:120]) for r in self.received[since:]][-10:]
            raise TimeoutError(f"{self.client_id}: no matching message within {timeout}s; "
                               f"last seen: {seen}") from None

    async def wait_until(self, condition: Callable[[], bool], timeout: float) -> bool:
        """Wait until `condition()` holds, re-checked on every message; False on timeout."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout), self._cond:
                await self._cond.wait_for(condition)
                return True
        return condition()


def ignore_socket_races(loop: asyncio.AbstractEventLoop) -> Counter[str]:
    """Install a loop exception handler that counts, instead of printing, paho's
    `add_writer` on a socket its lost connection already closed (EBADF: harmless for the
    harness's own clients); everything else goes to the default handler."""
    seen: Counter[str] = Counter()

    def handler(lp: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if (isinstance(exc, OSError) and exc.errno == 9
                and "add_writer" in str(context.get("message", ""))):
            seen["add_writer EBADF"] += 1
            return
        lp.default_exception_handler(context)

    loop.set_exception_handler(handler)
    return seen


def _retrieve(client: aiomqtt.Client) -> None:
    """Take the exception of a lost connection off aiomqtt's future, so asyncio does not
    log "Future exception was never retrieved" for the harness's own clients."""
    fut = getattr(client, "_disconnected", None)
    if isinstance(fut, asyncio.Future) and fut.done() and not fut.cancelled():
        fut.exception()


# --------------------------------------------------------------------------------------
# the scheduler
# --------------------------------------------------------------------------------------

@dataclass
class Request:
    request_id: str
    body: bytes
    created: float  # when the scheduler wanted it placed (monotonic)
    next_due: float
    interval: float
    attempts: int = 0  # publishes the MQTT server acknowledged
    first_sent: float | None = None
    answered_at: float | None = None
    kinds: Counter[str] = field(default_factory=Counter)
    lease_ids: list[str] = field(default_factory=list)  # one per decided event, in order
    code: str | None = None
    sending: bool = False

    @property
    def answered(self) -> bool:
        return self.answered_at is not None

    @property
    def distinct_leases(self) -> set[str]:
        return set(self.lease_ids)


class ResendingScheduler(MqttClient):
    """A scheduler (id `scheduler`): places requests, listens on `P/events/S/#`, re-sends
    what stays unanswered after `resend_after` s (then ×`backoff`, at most
    `max_interval`) with the same request_id, until `give_up_at` (monotonic)."""

    def __init__(self, port: int, scheduler: str = "chaos", *, resend_after: float = 3.0,
                 backoff: float = 2.0, max_interval: float = 10.0, window: int = 1000) -> None:
        super().__init__(port, [sub(f"{PREFIX}/events/{scheduler}/#")], name=scheduler,
                         keep=False)
        self.scheduler = scheduler
        self.topic = f"{PREFIX}/requests/{scheduler}/place"
        self.resend_after = resend_after
        self.backoff = backoff
        self.max_interval = max_interval
        self.give_up_at = math.inf
        self.requests: dict[str, Request] = {}
        self.decision_times: list[float] = []  # arrival of every decision event
        self.event_ids: set[str] = set()
        self.duplicate_events = 0  # the same event id again (allowed: dropped by id)
        self.other_events: Counter[str] = Counter()
        self.publish_errors = 0
        self._window = asyncio.Semaphore(window)
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._resender: asyncio.Task[None] | None = None
        self.on_connect.append(self._wake.set)

    async def start(self, timeout: float = 10.0) -> None:
        await super().start(timeout)
        self._resender = asyncio.create_task(self._resend_loop(), name="resender")

    async def aclose(self) -> None:
        if self._resender is not None:
            self._resender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._resender
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await super().aclose()

    # --- sending ----------------------------------------------------------------------

    def submit(self, request_id: str, body: dict[str, Any]) -> Request:
        """A new request: sent now if connected, else as soon as the client is."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id} already used")
        now = time.monotonic()
        raw = json.dumps({"request_id": request_id, **body}, separators=(",", ":")).encode()
        req = Request(request_id, raw, now, now, self.resend_after)
        self.requests[request_id] = req
        self._send(req, now)
        return req

    def resend(self, request_id: str) -> None:
        """Send a request again now, answered or not (an idempotency probe)."""
        req = self.requests[request_id]
        req.answered_at = None
        self._send(req, time.monotonic())

    def _send(self, req: Request, now: float) -> None:
        if req.sending or self.client is None:
            return  # the resend loop sends it once connected
        req.sending = True
        req.next_due = now + req.interval
        req.interval = min(req.interval * self.backoff, self.max_interval)
        task = asyncio.create_task(self._publish(req))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _publish(self, req: Request) -> None:
        try:
            async with self._window:
                await self.publish(self.topic, req.body)
            req.attempts += 1
            if req.first_sent is None:
                req.first_sent = time.monotonic()
        except (aiomqtt.MqttError, TimeoutError):
            self.publish_errors += 1  # not acknowledged: the resend loop tries again
        finally:
            req.sending = False

    async def _resend_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.1):
                    await self._wake.wait()
            self._wake.clear()
            if self.client is None:
                continue
            now = time.monotonic()
            if now >= self.give_up_at:
                continue
            for req in self.requests.values():
                if not req.answered and not req.sending and (
                        req.next_due <= now or req.attempts == 0):
                    self._send(req, now)

    async def run_load(self, count: int, rate: float,
                       body: Callable[[int], dict[str, Any]], *, tag: str | None = None,
                       on_sent: Callable[[int], None] | None = None) -> float:
        """Submit `count` requests at `rate` per second on a fixed schedule (open loop:
        it does not wait for answers, nor for the connection). Returns the monotonic time
        of the last submission."""
        tag = tag or uuid.uuid4().hex[:6]
        start = time.monotonic()
        for i in range(count):
            due = start + i / rate
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            self.submit(f"{tag}-{i:06d}", body(i))
            if on_sent is not None:
                on_sent(i + 1)
        return time.monotonic()

    # --- answers ------------------------------------------------------------------------

    def handle(self, rec: Received) -> None:
        kind = rec.topic.rsplit("/", 1)[-1]
        try:
            event = json.loads(rec.payload)
            data = event["data"]
        except (ValueError, KeyError, TypeError):
            self.other_events["unparsable"] += 1
            return
        event_id = event.get("id")
        if event_id in self.event_ids:
            self.duplicate_events += 1
            return
        self.event_ids.add(event_id)
        req = self.requests.get(data.get("request_id", "")) if isinstance(data, dict) else None
        if req is None or kind not in (*DECISIONS, "request.invalid"):
            self.other_events[kind] += 1
            return
        req.kinds[kind] += 1
        if kind == "placement.decided":
            req.lease_ids.append(data.get("lease_id"))
        elif kind == "placement.rejected":
            req.code = data.get("code")
        if kind in DECISIONS:
            self.decision_times.append(rec.at)
        if req.answered_at is None:
            req.answered_at = rec.at

    # --- figures ----------------------------------------------------------------------

    @property
    def unanswered(self) -> list[Request]:
        return [r for r in self.requests.values() if not r.answered]

    def all_answered(self) -> bool:
        return all(r.answered for r in self.requests.values())

    async def wait_all_answered(self, timeout: float) -> bool:
        return await self.wait_until(self.all_answered, timeout)

    def decided(self) -> int:
        """Distinct request_ids answered with a decision (placed or rejected)."""
        return sum(1 for r in self.requests.values() if any(r.kinds[k] for k in DECISIONS))

    def duplicate_leases(self) -> dict[str, list[str]]:
        """request_id -> its lease_ids, for requests decided with more than one lease."""
        return {r.request_id: sorted(r.distinct_leases) for r in self.requests.values()
                if len(r.distinct_leases) > 1}

    def first_decision_after(self, t: float) -> float | None:
        """Seconds from `t` (monotonic) to the first decision event received after it."""
        i = bisect.bisect_left(self.decision_times, t)  # in arrival order
        return self.decision_times[i] - t if i < len(self.decision_times) else None

    def summary(self) -> dict[str, Any]:
        reqs = self.requests.values()
        kinds: Counter[str] = Counter()
        for r in reqs:
            kinds.update({k: 1 for k in r.kinds})
        return {
            "sent": len(self.requests),
            "publishes": sum(r.attempts for r in reqs),
            "resent_requests": sum(1 for r in reqs if r.attempts > 1),
            "decisions": self.decided(),
            "decided": kinds["placement.decided"],
            "rejected": kinds["placement.rejected"],
            "invalid": kinds["request.invalid"],
            "lost": len(self.unanswered),
            "duplicate_leases": len(self.duplicate_leases()),
            "duplicate_events": self.duplicate_events,
            "reconnects": max(0, self.connects - 1),
            "publish_errors": self.publish_errors,
        }


def duplicate_leases_in(leases: Iterable[dict[str, Any]]) -> dict[str, list[str]]:
    """(scheduler/request_id) -> lease_ids, where `GET /v1/leases` holds more than one."""
    by: dict[str, list[str]] = {}
    for le in leases:
        by.setdefault(f"{le['scheduler']}/{le['request_id']}", []).append(le["lease_id"])
    return {k: sorted(v) for k, v in by.items() if len(v) > 1}


# --------------------------------------------------------------------------------------
# status and retained state
# --------------------------------------------------------------------------------------

class StatusWatcher(MqttClient):
    """Follows `P/status`. With Retain-As-Published, a live message published retained
    (the will, `online`, an orderly `offline`) arrives with its retain flag set."""

    def __init__(self, port: int) -> None:
        super().__init__(port, [sub(f"{PREFIX}/status", retain_as_published=True)],
                         name="status-watch")

    @staticmethod
    def is_state(state: str, *, boot_id: str | None = None, not_boot: str | None = None,
                 after: datetime | None = None, retained: bool | None = None
                 ) -> Callable[[Received], bool]:
        def match(rec: Received) -> bool:
            try:
                doc = rec.json()
            except ValueError:
                return False
            return (isinstance(doc, dict) and doc.get("state") == state
                    and (boot_id is None or doc.get("boot_id") == boot_id)
                    and (not_boot is None or doc.get("boot_id") != not_boot)
                    and (after is None or parse_ts(doc.get("ts", "1970-01-01T00:00:00Z"))
                         >= after)
                    and (retained is None or rec.retain == retained))
        return match

    async def online(self, timeout: float, **kw: Any) -> dict[str, Any]:
        rec = await self.wait_for(self.is_state("online", **kw), timeout)
        doc: dict[str, Any] = rec.json()
        return doc


async def retained_snapshot(port: int, filters: Iterable[str], timeout: float = 10.0
                            ) -> dict[str, bytes]:
    """What a subscriber arriving now finds retained under `filters` (topic -> payload).

    Subscribes, then publishes a marker to itself: mosquitto sends the retained messages
    of a SUBSCRIBE before it handles the next packet, so everything retained has arrived
    when the marker does. Live messages meanwhile update the picture (every publish on
    these topics is retained)."""
    marker = f"chaos/marker/{uuid.uuid4().hex}"
    client = aiomqtt.Client(HOST, port, identifier=f"snapshot-{uuid.uuid4().hex[:10]}",
                            protocol=aiomqtt.ProtocolVersion.V5, clean_start=True,
                            timeout=timeout, logger=MQTT_LOG)
    found: dict[str, bytes] = {}
    try:
        async with asyncio.timeout(timeout), client:
            # QoS 0: the retained messages come without a PUBACK round trip each (and
            # mosquitto's in-flight window of 20); QoS 0 keeps their order too.
            await client.subscribe([sub(f, qos=0) for f in filters] + [sub(marker, qos=0)])
            await client.publish(marker, b"x", qos=1)
            async for message in client.messages:
                topic = str(message.topic)
                if topic == marker:
                    break
                payload = message.payload
                if not isinstance(payload, bytes | bytearray):
                    payload = str(payload or "").encode()
                if payload:
                    found[topic] = bytes(payload)
                else:
                    found.pop(topic, None)
    finally:
        _retrieve(client)
    return found


@dataclass
class RetainedCheck:
    active: int = 0  # active leases per GET /v1/leases, at the last look
    retained: int = 0  # retained lease states found, at the last look
    missing: int = 0  # active leases with no retained state
    stale: int = 0  # active leases whose retained state has another state or epoch
    ended_retained: int = 0  # retained as active, but not active in the daemon
    seconds: float | None = None  # from `since` to the look that found all; None: never
    looks: int = 0
    error: str | None = None
    examples: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.seconds is not None

    def to_json(self) -> dict[str, Any]:
        return {"active": self.active, "retained": self.retained, "missing": self.missing,
                "stale": self.stale, "ended_retained": self.ended_retained,
                "seconds": None if self.seconds is None else round(self.seconds, 3),
                "looks": self.looks, "error": self.error, "examples": self.examples[:3]}


async def check_retained_leases(daemon: DaemonProcess, port: int, *, since: float,
                                within: float = 5.0) -> RetainedCheck:
    """Look again and again (fresh subscriptions) until every active lease of
    `GET /v1/leases` has its retained `P/leases/S/<id>` with the same state and epoch,
    or until `within` seconds after `since` (monotonic). `seconds` is measured from
    `since`."""
    check = RetainedCheck()
    deadline = since + within
    while True:
        check.looks += 1
        try:
            # Leases in the daemon's book before and after the look at the retained
            # state: one missing from it must be active in both (it did not start or
            # end meanwhile), one retained as active but ended must be in neither.
            before = {le["lease_id"]: le for le in await daemon.leases("active")}
            looked = time.monotonic()  # the retained state read below is from now on
            retained: dict[str, dict[str, Any]] = {}
            for topic, payload in (await retained_snapshot(port, [f"{PREFIX}/leases/#"])
                                   ).items():
                with contextlib.suppress(ValueError):
                    doc = json.loads(payload)
                    if isinstance(doc, dict):
                        retained[topic.rsplit("/", 1)[-1]] = doc
            after = {le["lease_id"]: le for le in await daemon.leases("active")}
        except (aiohttp.ClientError, aiomqtt.MqttError, OSError, TimeoutError) as exc:
            check.error = f"{type(exc).__name__}: {exc}"
        else:
            check.error = None
            steady = [i for i in before if i in after
                      and before[i].get("epoch") == after[i].get("epoch")]
            missing = [i for i in steady if i not in retained]
            stale = [i for i in steady if i in retained and (
                retained[i].get("state") != "active"
                or retained[i].get("epoch") != after[i].get("epoch"))]
            check.active, check.retained = len(after), len(retained)
            check.missing, check.stale = len(missing), len(stale)
            check.ended_retained = sum(
                1 for i, doc in retained.items()
                if doc.get("state") == "active" and i not in before and i not in after)
            check.examples = [f"{PREFIX}/leases/{after[i]['scheduler']}/{i}"
                              for i in (missing + stale)[:3]]
            if not missing and not stale:
                check.seconds = max(0.0, looked - since)
                return check
        if time.monotonic() >= deadline:
            return check
        await asyncio.sleep(0.2)


# --------------------------------------------------------------------------------------
# requests
# --------------------------------------------------------------------------------------

# Mostly placeable on the simulated market (seed 7); every tenth is over its price cap
# and rejected. Long leases, so nothing expires during a run.
MIX: tuple[dict[str, Any], ...] = (
    {"gpu": ["T4", "L4"], "gpus": 1},
    {"gpu": "V100-16GB", "gpus": 1, "market": "spot"},
    {"gpu": ["A10G", "A10"], "gpus": 1},
    {"gpu": "A100-40GB", "gpus": 1},
    {"gpu": "L40S", "gpus": 1, "market": "on_demand"},
    {"gpu": ["A100-80GB", "A100-40GB"], "gpus": 2},
    {"gpu": "T4", "gpus": 1, "market": "spot"},
    {"gpu": "L4", "gpus": 1, "market": "on_demand"},
    {"gpu": ["V100-16GB", "T4"], "gpus": 1},
    {"gpu": "T4", "gpus": 1, "max_price_per_gpu_hour": 0.01},  # over_price_cap
)


def place_body(i: int, lease_seconds: int = 3600) -> dict[str, Any]:
    return {**MIX[i % len(MIX)], "lease_seconds": lease_seconds, "labels": {"chaos": "1"}}


__all__ = [
    "DECISIONS", "HOST", "LOG_PATTERNS", "MIX", "PREFIX", "ROOT", "ChaosMosquitto",
    "DaemonDied", "DaemonProcess", "Exit", "MqttClient", "Received", "Request",
    "ResendingScheduler", "RetainedCheck", "StartDaemon", "StatusWatcher",
    "check_retained_leases", "duplicate_leases_in", "free_port", "ignore_socket_races",
    "kill_everything", "parse_ts", "place_body", "retained_snapshot", "sub", "wall",
    "write_daemon_config",
]
