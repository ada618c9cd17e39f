"""The daemon's memory under lease churn (#31): places at a steady rate, each lease
released a few seconds later, for a while; then a restart on the same state.

One private mosquitto on a free loopback port (bench/latency.py's), and the real daemon
(`python -m broker.cli run`, a subprocess, bench/latency.py's `Daemon`) on the simulated
market with about 20,000 offers, SQLite state in a temporary directory, HTTP on a free
loopback port, polled at start only. One MQTT 5 client places `--rate` requests a second
on a fixed schedule (open loop: it never waits for answers), one-GPU and eight-GPU
shapes on four scheduler ids, `lease_seconds` 6 h so nothing expires; each lease placed
is released a random `--release-min`..`--release-max` seconds after its
`placement.decided` arrives. A fraction (`--repeat`) of the released leases are asked
for again a few seconds after their release — the same `place` (same `request_id`) and
the same `release` — and the answers are checked: the same lease, `state: released`;
`lease.released`.

Every `--every` seconds it prints the daemon's RSS (VmRSS), its CPU over the interval
(% of one core), the leases active and ended (the state file, read-only), the place
answers' p50 and p99 over the interval, and the daemon's garbage collections over the
interval: how many full (generation 2) ones, their total and longest pause. Those are
measured inside the daemon by a `sitecustomize` module this bench puts first on the
daemon's PYTHONPATH: a `gc.callbacks` hook that times each collection and a thread that
writes the totals to a file once a second (the daemon's code is not changed for it).

`--poll-interval` polls again during the load (each round replaces the offers);
`--hold N` first places N leases, at `--hold-rate` a second, that are never released
(the book the churn then runs beside). The probe also writes how many objects are
frozen (`gc.get_freeze_count()`, every 10 s: counting walks them all, ~8 ms over
300,000), and `--audit`, after the load, has it collect, thaw
the frozen objects and collect again: the second finds what was frozen alive and is
garbage now (leaked cycles), counted by type.

After the load (`--no-restart` skips it): SIGTERM, and the daemon started again on the
same state; printed are the seconds to `ready`, the retained messages the restart
published (its `retained state restored` log line) and how long that took, and the RSS.

    cd /work/main && python bench/churn.py                   # 200/s for 3 minutes
    python bench/churn.py --rate 200 --duration 180 --root /tmp/before   # another checkout
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import json
import os
import random
import sqlite3
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import aiomqtt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from latency import (  # bench/latency.py: the same mosquitto and daemon
    PREFIX,
    ROOT,
    Daemon,
    Mosquitto,
    bench_workdir,
    cpu_seconds,
    free_port,
    mqtt_client,
    percentile,
    proc_status,
)

SCHEDULERS = ("churn-a", "churn-b", "churn-c", "churn-d")
MIX: tuple[dict[str, Any], ...] = (
    {"gpu": "L4", "gpus": 1},
    {"gpu": "T4", "gpus": 1},
    {"gpu": "A10G", "gpus": 1, "market": "spot"},
    {"gpu": ["A100-80GB", "H100-80GB"], "gpus": 8},
    {"gpu": "L40S", "gpus": 1, "team": "research"},
)
LEASE_SECONDS = 6 * 3600

GC_PROBE = '''\
"""gc.callbacks timings for bench/churn.py, written to $GPUBROKER_BENCH_GC each second."""
import gc, json, os, threading, time
_path = os.environ.get("GPUBROKER_BENCH_GC")
if _path:
    _totals = {g: [0, 0.0] for g in (0, 1, 2)}
    _pauses = []  # (monotonic end, generation, seconds) of collections over 5 ms
    _began = [0.0]

    def _timed(phase, info):
        if phase == "start":
            _began[0] = time.perf_counter()
            return
        took = time.perf_counter() - _began[0]
        t = _totals[info["generation"]]
        t[0] += 1
        t[1] += took
        if took > 0.005 and len(_pauses) < 100000:
            _pauses.append((time.monotonic(), info["generation"], took))

    def _audit():
        # What the permanent generation holds that nothing reaches any more: cycles
        # frozen while alive (they leak). Collect the rest first, then the frozen.
        gc.collect()
        frozen = gc.get_freeze_count()
        gc.unfreeze()
        gc.set_debug(gc.DEBUG_SAVEALL)
        t = time.perf_counter()
        found = gc.collect()
        took = (time.perf_counter() - t) * 1000
        gc.set_debug(0)
        kinds = {}
        for o in gc.garbage:
            name = type(o).__module__ + "." + type(o).__qualname__
            kinds[name] = kinds.get(name, 0) + 1
        gc.garbage.clear()
        top = dict(sorted(kinds.items(), key=lambda kv: -kv[1])[:12])
        return {"frozen": frozen, "unreachable_frozen": found,
                "unfrozen_collection_ms": took, "unreachable_by_type": top}

    def _write():
        audit = None
        frozen = None
        n = 0
        while True:
            time.sleep(1.0)
            if audit is None and os.path.exists(_path + ".audit"):
                audit = _audit()
            if n % 10 == 0:  # the count walks every frozen object, holding the GIL
                frozen = gc.get_freeze_count()
            n += 1
            tmp = _path + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"totals": _totals, "pauses": _pauses[-5000:],
                           "frozen": frozen, "audit": audit}, f)
            os.replace(tmp, _path)

    gc.callbacks.append(_timed)
    threading.Thread(target=_write, name="bench-gc", daemon=True).start()
'''


class ChurnDaemon(Daemon):
    """The latency bench's daemon, with the gc probe on its PYTHONPATH and the log
    records this bench reads kept."""

    def __init__(self, workdir: Path, *args: Any, **kwargs: Any) -> None:
        super().__init__(workdir, *args, **kwargs)
        self.probe_dir = workdir / "gcprobe"
        self.probe_dir.mkdir(exist_ok=True)
        (self.probe_dir / "sitecustomize.py").write_text(GC_PROBE)
        self.gc_file = workdir / "gc.json"
        self.records: dict[str, dict[str, Any]] = {}
        self.restored = asyncio.Event()

    async def start(self) -> None:
        cmd = [sys.executable, "-m", "broker.cli", "run", "--config", str(self.config)]
        env = {**os.environ, "GPUBROKER_BENCH_GC": str(self.gc_file),
               "PYTHONPATH": os.pathsep.join([str(self.probe_dir), str(self.root)])}
        self.ready.clear()
        self.restored.clear()
        self.records.clear()
        self.proc = await asyncio.create_subprocess_exec(
            *cmd, env=env, cwd=self.root, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True)
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        async for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            self.tail = [*self.tail[-29:], line]
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            event = rec.get("event", "?")
            self.levels[rec.get("level", "?")] += 1
            if event in ("ready", "retained state restored", "starting"):
                self.records[event] = {**rec, "at": time.monotonic()}
            if event == "ready":
                self.offers = rec.get("offers")
                self.ready.set()
            if event == "retained state restored":
                self.restored.set()

    def ask_audit(self) -> None:
        Path(str(self.gc_file) + ".audit").touch()

    async def audit(self) -> dict[str, Any] | None:
        """The probe's audit of the permanent generation (`_audit`), run once."""
        self.ask_audit()
        for _ in range(120):
            await asyncio.sleep(0.5)
            if (got := self.gc_totals().get("audit")) is not None:
                return dict(got)
        return None

    def gc_totals(self) -> dict[str, Any]:
        try:
            got: dict[str, Any] = json.loads(self.gc_file.read_text())
            return got
        except (OSError, ValueError):
            return {"totals": {}, "pauses": []}


def lease_counts(state: Path) -> Counter[str]:
    uri = f"{state.resolve().as_uri()}?mode=ro"
    with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=5)) as db:
        return Counter(dict(db.execute("SELECT state, count(*) FROM leases GROUP BY state")))


class Load:
    """The scheduler side: places on a schedule, releases when due, checks repeats."""

    def __init__(self, args: argparse.Namespace, tag: str) -> None:
        self.args = args
        self.tag = tag
        self.rng = random.Random(args.seed)
        self.sent_at: dict[str, float] = {}
        self.scheduler_of: dict[str, str] = {}
        self.latency: list[float] = []  # place → first answer, ms, this interval
        self.due: list[tuple[float, int, str, str, str]] = []  # (when, n, what, sched, id)
        self.n = 0
        self.lease_of: dict[str, str] = {}  # request_id -> lease_id, while held
        self.counts: Counter[str] = Counter()
        self.repeat_of: dict[str, str] = {}  # request_id asked again -> its lease_id
        self.held: set[str] = set()  # `--hold`'s requests, never released
        self.held_decided = asyncio.Event()
        self.woken = asyncio.Event()

    def body(self, i: int) -> tuple[str, str, bytes]:
        request_id = f"{self.tag}-{i:08d}"
        scheduler = SCHEDULERS[i % len(SCHEDULERS)]
        payload = {"request_id": request_id, **MIX[i % len(MIX)],
                   "lease_seconds": LEASE_SECONDS}
        return scheduler, request_id, json.dumps(payload, separators=(",", ":")).encode()

    def later(self, seconds: float, what: str, scheduler: str, key: str) -> None:
        self.n += 1
        heapq.heappush(self.due, (time.monotonic() + seconds, self.n, what, scheduler, key))
        self.woken.set()

    def on_event(self, msg: aiomqtt.Message) -> None:
        if not isinstance(msg.payload, bytes | bytearray):
            return
        kind = str(msg.topic).rsplit("/", 1)[-1]
        data = json.loads(msg.payload).get("data", {})
        request_id = data.get("request_id")
        if kind == "placement.decided" and request_id in self.repeat_of:
            same = (data.get("lease_id") == self.repeat_of.pop(request_id)
                    and data.get("state") == "released")
            self.counts["repeat place: same lease, released" if same
                        else "repeat place: WRONG ANSWER"] += 1
            return
        if request_id in self.held:
            if kind in ("placement.decided", "placement.rejected"):
                self.held.discard(request_id)
                self.counts[f"held {kind}"] += 1
                if not self.held:
                    self.held_decided.set()
            return
        if kind in ("placement.decided", "placement.rejected") and request_id in self.sent_at:
            self.latency.append((time.monotonic() - self.sent_at.pop(request_id)) * 1000)
            self.counts[kind] += 1
            if kind == "placement.decided":
                self.lease_of[request_id] = data["lease_id"]
                self.later(self.rng.uniform(self.args.release_min, self.args.release_max),
                           "release", self.scheduler_of[request_id], request_id)
            return
        if kind in ("lease.released", "request.invalid"):
            self.counts[kind] += 1

    async def hold(self, client: aiomqtt.Client, n: int, rate: float) -> None:
        """Place `n` leases that are never released, at `rate` a second, and wait for
        every answer."""
        self.held = {f"{self.tag}-held-{i:08d}" for i in range(n)}
        t0 = time.monotonic()
        for i in range(n):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            scheduler, _, payload = self.body(i)
            payload = payload.replace(f"{self.tag}-{i:08d}".encode(),
                                      f"{self.tag}-held-{i:08d}".encode())
            await client.publish(f"{PREFIX}/requests/{scheduler}/place", payload, qos=1)
        await asyncio.wait_for(self.held_decided.wait(), 600)

    async def run(self, client: aiomqtt.Client, until: float) -> None:
        rate = self.args.rate
        t0 = time.monotonic()
        i = 0
        tasks: set[asyncio.Task[Any]] = set()

        def send(topic: str, payload: bytes) -> None:
            t = asyncio.create_task(client.publish(topic, payload, qos=1))
            tasks.add(t)
            t.add_done_callback(tasks.discard)

        while True:
            now = time.monotonic()
            while now < until and t0 + i / rate <= now:
                scheduler, request_id, payload = self.body(i)
                self.sent_at[request_id] = now
                self.scheduler_of[request_id] = scheduler
                send(f"{PREFIX}/requests/{scheduler}/place", payload)
                i += 1
            while self.due and self.due[0][0] <= now:
                _, _, what, scheduler, request_id = heapq.heappop(self.due)
                if what == "release":
                    lease_id = self.lease_of.pop(request_id)
                    send(f"{PREFIX}/requests/{scheduler}/release",
                         json.dumps({"lease_id": lease_id}).encode())
                    self.counts["releases sent"] += 1
                    if self.rng.random() < self.args.repeat:
                        self.lease_of[request_id] = lease_id
                        self.later(self.rng.uniform(2, 10), "repeat", scheduler, request_id)
                else:  # the same place and release again, after the lease ended
                    lease_id = self.lease_of.pop(request_id)
                    self.repeat_of[request_id] = lease_id
                    i_of = int(request_id.rsplit("-", 1)[1])
                    send(f"{PREFIX}/requests/{scheduler}/place", self.body(i_of)[2])
                    send(f"{PREFIX}/requests/{scheduler}/release",
                         json.dumps({"lease_id": lease_id}).encode())
                    self.counts["repeats sent"] += 1
            # After the last place: until every lease placed is released (and the
            # answers of the last places are in, or 15 s have passed).
            if now >= until and not self.due and (not self.sent_at or now > until + 15):
                break
            wake = [t0 + i / rate] if now < until else [now + 0.5]
            if self.due:
                wake.append(self.due[0][0])
            self.woken.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.woken.wait(),
                                       max(0.0, min(wake) - time.monotonic()))
        if tasks:
            await asyncio.wait(tasks, timeout=30)


def row(t: float, daemon: ChurnDaemon, state: Path, load: Load, cpu: tuple[float, float],
        gc_before: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    now_cpu = (time.monotonic(), cpu_seconds(daemon.pid))
    rss = proc_status(daemon.pid).get("VmRSS", 0) / 1024
    counts = lease_counts(state)
    lat = sorted(load.latency)
    load.latency = []
    gcs = daemon.gc_totals()
    full_now = gcs["totals"].get("2", [0, 0.0])
    full_before = gc_before["totals"].get("2", [0, 0.0])
    since = gc_before.get("read_at", 0.0)
    pauses = [p for p in gcs["pauses"] if p[0] > since and p[1] == 2]
    out = {
        "t_s": round(t),
        "rss_mib": round(rss, 1),
        "cpu_pct": round(100 * (now_cpu[1] - cpu[1]) / (now_cpu[0] - cpu[0]), 1),
        "active": counts.get("active", 0),
        "ended": sum(n for s, n in counts.items() if s != "active"),
        "place_p50_ms": round(percentile(lat, 50), 1) if lat else None,
        "place_p99_ms": round(percentile(lat, 99), 1) if lat else None,
        "full_gcs": full_now[0] - full_before[0],
        "full_gc_total_ms": round((full_now[1] - full_before[1]) * 1000, 1),
        "full_gc_max_ms": round(max((p[2] for p in pauses), default=0.0) * 1000, 1),
        "frozen": gcs.get("frozen"),
    }
    gcs["read_at"] = time.monotonic()
    gcs["cpu"] = now_cpu
    return out, gcs


async def hold(args: argparse.Namespace, daemon: ChurnDaemon, load: Load,
               client: aiomqtt.Client) -> dict[str, Any]:
    """`--hold`: its places, their answers and the full collections meanwhile."""
    t = time.monotonic()
    before = daemon.gc_totals()["totals"].get("2", [0, 0.0])
    await load.hold(client, args.hold, args.hold_rate)
    await asyncio.sleep(1.5)  # the probe's next write
    gcs = daemon.gc_totals()
    full = gcs["totals"].get("2", [0, 0.0])
    got = {"places": args.hold, "seconds": round(time.monotonic() - t, 1),
           "answers": {k: v for k, v in load.counts.items() if "held" in k},
           "full_gcs": full[0] - before[0],
           "full_gc_total_ms": round((full[1] - before[1]) * 1000, 1),
           "full_gc_max_ms": round(max((p[2] for p in gcs["pauses"]
                                        if p[0] > t and p[1] == 2), default=0.0) * 1000, 1),
           "rss_mib": round(proc_status(daemon.pid).get("VmRSS", 0) / 1024, 1)}
    print("held:", json.dumps(got), flush=True)
    return got


def print_row(r: dict[str, Any]) -> None:
    print(f"{r['t_s']:>5} s  RSS {r['rss_mib']:7.1f} MiB  CPU {r['cpu_pct']:5.1f} %  "
          f"active {r['active']:>6}  ended {r['ended']:>7}  place p50/p99 "
          f"{r['place_p50_ms']!s:>6}/{r['place_p99_ms']!s:>7} ms  full GCs {r['full_gcs']:>3}"
          f" ({r['full_gc_total_ms']} ms, longest "
          f"{r['full_gc_max_ms'] or '< 5'} ms)  frozen "
          f"{r['frozen']}", flush=True)


async def amain(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    mosq = Mosquitto(workdir)
    mosq.start()
    listen = f"127.0.0.1:{free_port()}"
    daemon = ChurnDaemon(workdir / "daemon", mosq.url, seed=args.seed,
                         regions=args.regions_per_cloud, poll_interval=args.poll_interval,
                         http_listen=listen, root=args.root)
    state = workdir / "daemon" / "state.db"
    out: dict[str, Any] = {"rate": args.rate, "duration_s": args.duration,
                           "root": str(args.root), "rows": []}
    try:
        await daemon.start()
        await daemon.wait_ready()
        await daemon.settle()
        out["offers"] = daemon.offers
        host, port = mosq.url.removeprefix("mqtt://").rsplit(":", 1)
        load = Load(args, f"c{uuid.uuid4().hex[:6]}")
        async with mqtt_client(host, int(port), "bench-churn", nodelay=True) as client:
            await client.subscribe(f"{PREFIX}/events/+/+", qos=1)

            async def receive() -> None:
                async for msg in client.messages:
                    load.on_event(msg)

            receiver = asyncio.create_task(receive())
            if args.hold:
                out["hold"] = await hold(args, daemon, load, client)
            start = time.monotonic()
            gc_state = daemon.gc_totals()
            gc_state["read_at"] = time.monotonic()
            cpu = (time.monotonic(), cpu_seconds(daemon.pid))
            r0, gc_state = row(0, daemon, state, load, cpu, gc_state)
            out["rows"].append(r0)
            print_row(r0)
            cpu = gc_state["cpu"]
            running = asyncio.create_task(load.run(client, start + args.duration))
            while not running.done():
                await asyncio.wait({running}, timeout=args.every)
                r, gc_state = row(time.monotonic() - start, daemon, state, load, cpu,
                                  gc_state)
                cpu = gc_state["cpu"]
                out["rows"].append(r)
                print_row(r)
            running.result()
            await asyncio.sleep(2)  # the last answers (figures only)
            receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError, aiomqtt.MqttError):
                await receiver
        out["answers"] = dict(load.counts)
        print("answers:", json.dumps(dict(load.counts)), flush=True)
        await after_load(args, daemon, out)
    finally:
        rc = await daemon.stop()
        if rc not in (0, None):
            print(f"bench: gpubroker exited with code {rc}:\n" + "\n".join(daemon.tail[-10:]),
                  file=sys.stderr)
        mosq.stop()
    return out


async def after_load(args: argparse.Namespace, daemon: ChurnDaemon, out: dict[str, Any]
                     ) -> None:
    """`--audit`, then the restart (unless `--no-restart`)."""
    if args.audit:
        out["audit"] = await daemon.audit()
        print("audit of the permanent generation:", json.dumps(out["audit"]), flush=True)
    if args.restart:
        rss_before = proc_status(daemon.pid).get("VmRSS", 0) / 1024
        await daemon.stop()
        t = time.monotonic()
        await daemon.start()
        await daemon.wait_ready()
        ready_s = daemon.records["ready"]["at"] - t
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(daemon.restored.wait(), 600)
        restored = daemon.records.get("retained state restored", {})
        await daemon.settle()
        out["restart"] = {
            "rss_before_mib": round(rss_before, 1),
            "ready_s": round(ready_s, 2),
            "leases_loaded": daemon.records.get("starting", {}).get("leases"),
            "retained_messages": restored.get("messages"),
            "retained_seconds": restored.get("seconds"),
            "rss_after_mib": round(proc_status(daemon.pid).get("VmRSS", 0) / 1024, 1),
        }
        print("restart:", json.dumps(out["restart"]), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=200.0, help="places per second (200)")
    p.add_argument("--duration", type=float, default=180.0, help="seconds of load (180)")
    p.add_argument("--release-min", type=float, default=5.0, help="seconds (5)")
    p.add_argument("--release-max", type=float, default=30.0, help="seconds (30)")
    p.add_argument("--repeat", type=float, default=0.01,
                   help="fraction of released leases asked for again (0.01)")
    p.add_argument("--every", type=float, default=30.0, help="seconds between rows (30)")
    p.add_argument("--regions-per-cloud", type=int, default=88,
                   help="sim regions per cloud (88: about 20,000 offers)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--poll-interval", type=float, default=3600.0,
                   help="seconds between the daemon's polls (3600: at the start only)")
    p.add_argument("--hold", type=int, default=0,
                   help="leases placed before the churn and never released (0)")
    p.add_argument("--hold-rate", type=float, default=1000.0,
                   help="places per second for --hold (1000)")
    p.add_argument("--audit", action="store_true",
                   help="after the load: how many frozen objects nothing reaches (leaked "
                        "cycles); unfreezes the daemon's heap, so use --no-restart or "
                        "read the restart's figures with that in mind")
    p.add_argument("--root", type=Path, default=ROOT,
                   help="the checkout the daemon runs from (default: this one)")
    p.add_argument("--no-restart", dest="restart", action="store_false")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = p.parse_args(argv)
    args.root = args.root.resolve()
    with bench_workdir("bench", keep=args.keep, prefix="churn") as workdir:
        out = asyncio.run(amain(args, workdir))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
