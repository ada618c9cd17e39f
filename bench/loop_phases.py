"""Where the daemon's event loop spends its CPU under load, phase by phase (#31).

bench/latency.py's private mosquitto, real daemon (`python -m broker.cli run`, the sim,
about 20,000 offers, a fresh SQLite file) and open-loop load of `place` requests at
`--rate`. A `sitecustomize` module this bench puts first on the daemon's PYTHONPATH
(the daemon's code is not changed for it) wraps the functions named in `PHASES` and adds
up the CPU time of the event loop's thread inside each (`time.thread_time`) and its
calls, from the end of the warm-up to the end of the sends (SIGUSR1, SIGUSR2). Printed:
per phase its calls, CPU a call and share of the loop's CPU; the loop's CPU as % of a
core; the rest, outside every phase named (the event loop itself, tasks, futures, the
glue between the phases); and how many turns the event loop took and callbacks it ran
(`COUNTS`) a request. Only the loop's thread is counted: a batch solved in a
worker thread is not.

Why not a sampling profiler: py-spy without pausing the daemon (`--nonblocking`) reads
a thread's stack most reliably while it waits in a system call, so sends, the store's
hand-over and `uuid4` come out larger than they are; cProfile's cost per call swells
the placement's many small functions. Here each wrapped call costs the two clock reads
(about a microsecond), counted in its phase.

    cd /work/main && python bench/loop_phases.py [--rate 500] [--duration 20]
    python bench/loop_phases.py --root /tmp/before          # another checkout's daemon
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from latency import (  # bench/latency.py: the same mosquitto, daemon and load
    PREFIX,
    ROOT,
    Daemon,
    Mosquitto,
    host_port,
    parse_event,
    place_requests,
    run_load,
)

PHASES: list[tuple[str, str, str, str | None]] = [
    # (module, attribute path, phase, the phase it runs inside: not added to the sum)
    ("broker.leasing.placing", "_solve_timed", "placement (optimizer.solve)", None),
    ("broker.placement.candidates", "walk", "of which the walks", "placement (optimizer.solve)"),
    ("broker.leasing.placing", "Placing._decided", "decided: event and lease state", None),
    ("broker.leasing.placing", "Placing._parse_place", "request parsed and validated", None),
    ("broker.leasing.placing", "evaluate", "policy verdict", None),
    ("broker.leasing.book", "LeaseBook.create", "lease made (book)", None),
    ("gmqtt.mqtt.protocol", "MQTTProtocol._read_packet", "MQTT packets read and handled", None),
    ("gmqtt.mqtt.protocol", "MQTTProtocol.send_publish", "MQTT PUBLISH built", None),
    ("broker.edges.mqtt", "_Corked._flush", "socket writes", None),
    ("broker.edges.mqtt", "Connection._puback", "PUBACKs of requests", None),
    ("broker.state.thread", "OneThread.run", "hand-over to the store's thread", None),
    ("broker.state.store", "lease_row", "lease rows for the commit", None),
    ("broker.wire.messages", "Messages.sequence", "schedseq numbering", None),
    ("broker.edges.bus", "command_of", "message to command", None),
    ("selectors", "EpollSelector.select", "the selector's polls (CPU, not the waits)", None),
]

COUNTS: list[tuple[str, str, str]] = [
    # (module, attribute path, what a call is): counted, not timed
    ("asyncio.base_events", "BaseEventLoop._run_once",
     "turns of the event loop (asyncio's loop only)"),
    ("asyncio.events", "Handle._run", "callbacks run (asyncio's loop only)"),
]

PROBE = '''
import os, signal, sys, threading, time, json, functools, importlib
OUT = os.environ.get("GPUBROKER_BENCH_PHASES")
if OUT and "broker.cli" in " ".join(getattr(sys, "orig_argv", [])):
    PHASES, COUNTS = json.loads(os.environ["GPUBROKER_BENCH_PHASES_LIST"])
    spent, calls, counted, missing = {}, {}, {}, []
    state = {"on": False, "installed": False}
    main = threading.main_thread().ident
    clock = time.thread_time

    def wrapped(fn, phase):
        @functools.wraps(fn)
        def timed(*a, **k):
            if not state["on"] or threading.get_ident() != main:
                return fn(*a, **k)
            t = clock()
            try:
                return fn(*a, **k)
            finally:
                spent[phase] += clock() - t
                calls[phase] += 1
        return timed

    def counter(fn, what):
        @functools.wraps(fn)
        def count(*a, **k):
            if state["on"] and threading.get_ident() == main:
                counted[what] += 1
            return fn(*a, **k)
        return count

    def patch(module, path, wrap):
        try:
            owner = importlib.import_module(module)
            *outer, name = path.split(".")
            for part in outer:
                owner = getattr(owner, part)
            setattr(owner, name, wrap(getattr(owner, name)))
        except (ImportError, AttributeError):
            missing.append(f"{module}.{path}")

    def install():
        for module, path, phase, _ in PHASES:
            spent[phase], calls[phase] = 0.0, 0
            patch(module, path, lambda fn, phase=phase: wrapped(fn, phase))
        for module, path, what in COUNTS:
            counted[what] = 0
            patch(module, path, lambda fn, what=what: counter(fn, what))

    def start(*_):
        if not state["installed"]:
            install()
            state["installed"] = True
        for phase in spent:
            spent[phase], calls[phase] = 0.0, 0
        for what in counted:
            counted[what] = 0
        state.update(on=True, cpu=clock(), wall=time.monotonic())

    def stop(*_):
        state["on"] = False
        out = {"cpu": clock() - state["cpu"], "wall": time.monotonic() - state["wall"],
               "phases": {p: [spent[p], calls[p]] for p in spent}, "counts": counted,
               "missing": missing}
        with open(OUT + ".tmp", "w") as f:
            json.dump(out, f)
        os.replace(OUT + ".tmp", OUT)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
'''


async def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    probe = workdir / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(PROBE)
    out = workdir / "phases.json"
    (workdir / "mosquitto").mkdir()
    mosq = Mosquitto(workdir / "mosquitto")
    mosq.start()
    try:
        daemon = Daemon(workdir / "daemon", mosq.url, seed=args.seed,
                        regions=args.regions_per_cloud, poll_interval=args.poll_interval,
                        root=args.root,
                        env={"PYTHONPATH": str(probe), "GPUBROKER_BENCH_PHASES": str(out),
                             "GPUBROKER_BENCH_PHASES_LIST": json.dumps([PHASES, COUNTS])})
        await daemon.start()
        try:
            await daemon.wait_ready()
            await daemon.settle()
            host, port = host_port(mosq.url)
            assert mosq.proc is not None

            async def window() -> None:
                await asyncio.sleep(args.warmup)
                os.kill(daemon.pid, signal.SIGUSR1)
                await asyncio.sleep(args.duration)
                os.kill(daemon.pid, signal.SIGUSR2)

            timer = asyncio.create_task(window())
            res = await run_load("phases", host, port, rate=args.rate,
                                 duration=args.duration, warmup=args.warmup,
                                 subscribe=f"{PREFIX}/events/+/+",
                                 make=place_requests(f"phases-{uuid.uuid4().hex[:6]}"),
                                 parse=parse_event,
                                 pids={"daemon": daemon.pid, "mosquitto": mosq.proc.pid,
                                       "bench": os.getpid()},
                                 nodelay=True)
            await timer
            # Written by the daemon's process: nothing here to wait on but the file.
            deadline = time.monotonic() + 10
            while not out.exists() and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.1)
            if not out.exists():
                raise RuntimeError("the daemon's probe wrote no figures (no SIGUSR2 handler)")
            got: dict[str, Any] = json.loads(out.read_text())
            got["latency"] = {k: getattr(res, k) for k in ("sent", "answered")} | {
                "p50_ms": res.p50_ms, "p99_ms": res.p99_ms, "cpu": res.cpu}
            got["offers"] = daemon.offers
            return got
        finally:
            await daemon.stop()
    finally:
        mosq.stop()


def report(got: dict[str, Any], args: argparse.Namespace) -> None:
    cpu, wall = got["cpu"], got["wall"]
    lat = got["latency"]
    print(f"loop phases: {args.rate:g} place/s, {args.duration:g} s measured after "
          f"{args.warmup:g} s; {got['offers']} offers; daemon at {args.root}")
    print(f"  loop thread CPU {cpu:.2f} s over {wall:.1f} s ({100 * cpu / wall:.1f} % of a "
          f"core); requests sent {lat['sent']}, answered {lat['answered']}; p50 "
          f"{lat['p50_ms']:.2f} ms, p99 {lat['p99_ms']:.2f} ms")
    print(f"  {'phase':<40} {'calls':>8} {'µs a call':>10} {'% of loop CPU':>14}")
    counted = 0.0
    for _, _, phase, parent in PHASES:
        seconds, n = got["phases"].get(phase, [0.0, 0])
        if parent is None:
            counted += seconds
        name = ("  " if parent else "") + phase
        each = f"{1e6 * seconds / n:.1f}" if n else "-"
        print(f"  {name:<40} {n:>8} {each:>10} {100 * seconds / cpu:>13.1f}%")
    rest = cpu - counted
    print(f"  {'the rest (loop, tasks, futures, glue)':<40} {'':>8} {'':>10} "
          f"{100 * rest / cpu:>13.1f}%")
    answered = max(lat["answered"], 1)
    for _, _, what in COUNTS:
        n = got["counts"].get(what, 0)
        print(f"  {what}: {n} ({n / answered:.1f} a request answered)")
    if got["missing"]:
        print(f"  not found in this checkout (not measured): {', '.join(got['missing'])}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=500.0)
    ap.add_argument("--duration", type=float, default=20.0, help="seconds measured")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of load first")
    ap.add_argument("--regions-per-cloud", type=int, default=88)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--poll-interval", type=float, default=3600.0,
                    help="the daemon's poll interval (no poll during the load)")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout the daemon runs from")
    ap.add_argument("--json", action="store_true", help="the figures as JSON")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpubroker-phases-") as tmp:
        got = asyncio.run(measure(args, Path(tmp)))
    if args.json:
        print(json.dumps(got, indent=2))
    else:
        report(got, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
