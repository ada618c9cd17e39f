"""Chaos bench: the daemon under load while its MQTT server, or the daemon itself, is killed.

What the daemon promises (SPEC §1, §3): it never exits because its MQTT server died; no
decision is lost; a scheduler that re-sends an unanswered request with the same
`request_id` gets the same lease, never a second one; after every (re)connect the
retained state (`P/status`, every active `P/leases/S/<id>`) is true again; `offline` is
retained on `P/status` on every way out. This bench measures those; it prints figures,
it does not pass or fail.

Each run is fresh: a private mosquitto on a free loopback port, `gpubroker run --config
…` as a subprocess on the simulated market (`clouds: {sim: {seed: 7}}`, SQLite state in
a temporary directory, HTTP on a free loopback port), and one scheduler — an aiomqtt
MQTT 5 client with its own client id and a clean session, from tests/chaos/harness.py,
the same client the chaos tests use — that sends `--requests` placement requests at
`--rate` per second, listens on `P/events/<S>/#`, re-sends every request unanswered
after `--resend-after` s with the same request_id (backing off ×2 up to 10 s) until
`--deadline` s after the last send, and reconnects by itself.

Scenarios:

* `mqtt-kill` — `kill -9` mosquitto `--kills` times during the load, back on the same
  port `--down` s later; with mosquitto persistence on (saved every second, so retained
  messages and the daemon's session survive) and off (a kill loses everything).
* `daemon-kill` — SIGKILL the daemon `--kills` times during the load and start it again
  `--down` s later on the same state file (mosquitto keeps running, persistence on).

Per kill: seconds to the daemon's `online` and to the first decision after the restart,
and the active leases (`GET /v1/leases?state=active`) with no retained state 5 s after
the daemon was back (looked at again and again until none is missing, or 5 s); for
`daemon-kill`, whether the will put `offline` on retained `P/status` within 5 s. Per
run: the daemon's exit code on SIGTERM at the end and whether it ever exited on its own,
requests sent, decisions received, lost decisions, duplicate leases, and the lines with
`Traceback` or `Future exception was never retrieved` in the daemon's output.

    cd /work/main && python bench/chaos.py   # three runs: about 2 min, more if answers go missing
    python bench/chaos.py --scenario mqtt-kill --persistence off --requests 2000 --json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The chaos tests' harness (tests/chaos/harness.py) and what it uses
# (tests/support/mqtt_helpers.py). Imported as `harness`: `chaos` here would be this file.
# The repository comes first, so its packages are the ones imported.
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "chaos"), str(ROOT / "tests"),
               str(ROOT / "tests" / "support"), str(ROOT / "tests" / "fakes")]

from harness import (  # noqa: E402
    LOG_PATTERNS,
    PREFIX,
    ChaosMosquitto,
    DaemonDied,
    DaemonProcess,
    ResendingScheduler,
    RetainedCheck,
    StatusWatcher,
    check_retained_leases,
    duplicate_leases_in,
    free_port,
    ignore_socket_races,
    kill_everything,
    place_body,
    retained_snapshot,
    wall,
    write_daemon_config,
)

SCHEDULER = "chaos-sched"
RETAINED_WITHIN = 5.0  # seconds after the daemon is back
OFFLINE_WITHIN = 5.0  # seconds after a daemon kill
ONLINE_WITHIN = 60.0  # seconds after mosquitto / the daemon is back


@dataclass
class Kill:
    n: int
    at_s: float  # since the load began
    sent_before: int
    under_load: bool
    up_s: float | None = None  # kill -> mosquitto accepting again / daemon restarted
    online_s: float | None = None  # back up -> the daemon's `online` on P/status
    first_decision_s: float | None = None  # back up -> first decision event
    retained: RetainedCheck | None = None
    offline_seen: bool | None = None  # daemon-kill: will `offline` (retained) seen
    offline_s: float | None = None
    offline_retained: bool | None = None
    alive_after: bool = True
    t_up: float = 0.0  # monotonic: when mosquitto / the daemon was back up

    def to_json(self) -> dict[str, Any]:
        out = {k: (round(v, 3) if isinstance(v, float) else v)
               for k, v in self.__dict__.items() if k not in ("retained", "t_up")}
        out["retained"] = self.retained.to_json() if self.retained else None
        return out


@dataclass
class Run:
    scenario: str
    persistence: bool
    kills: list[Kill] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        if self.scenario == "daemon-kill":
            return "daemon-kill"
        return f"mqtt-kill/persist-{'on' if self.persistence else 'off'}"

    def to_json(self) -> dict[str, Any]:
        return {"run": self.name, "scenario": self.scenario,
                "mosquitto_persistence": self.persistence, **self.figures,
                "kills": [k.to_json() for k in self.kills]}


def progress(msg: str, t0: float) -> None:
    print(f"[{time.monotonic() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------
# one run
# --------------------------------------------------------------------------------------

async def run_scenario(scenario: str, persistence: bool, args: argparse.Namespace,
                       workdir: Path, t0: float) -> Run:
    run = Run(scenario, persistence)
    workdir.mkdir(parents=True)  # noqa: ASYNC240 (once, before anything runs)
    mosq = ChaosMosquitto(workdir / "mosquitto", persistence=persistence)
    await mosq.astart()
    http_port = free_port()
    config = write_daemon_config(
        workdir / "config.yaml", mqtt_url=mosq.url, state_path=workdir / "state.db",
        http_port=http_port, poll_interval=args.poll_interval,
        sim={"seed": args.seed, "preempt_rate_multiplier": 0})
    daemon = DaemonProcess(config, workdir / "daemon.log", http_port)
    watcher = StatusWatcher(mosq.port)
    sched = ResendingScheduler(mosq.port, SCHEDULER, resend_after=args.resend_after)
    load: asyncio.Task[float] | None = None
    ticker: asyncio.Task[None] | None = None

    def say(msg: str) -> None:
        progress(f"{run.name}: {msg}", t0)

    try:
        await watcher.start()
        daemon.start()
        ready_s = await daemon.wait_ready()
        boot = (await watcher.online(ONLINE_WITHIN))["boot_id"]
        say(f"daemon ready after {ready_s:.1f} s; {args.requests} requests at "
            f"{args.rate:g}/s, {args.kills} kills")
        await sched.start()

        load_t0 = time.monotonic()
        load = asyncio.create_task(sched.run_load(args.requests, args.rate, place_body))
        ticker = asyncio.create_task(_tick(say, sched, daemon, run, args))
        spacing = args.requests / args.rate / (args.kills + 1)
        died: str | None = None
        try:
            for n in range(1, args.kills + 1):
                delay = load_t0 + n * spacing - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                kill = Kill(n, time.monotonic() - load_t0, len(sched.requests),
                            not load.done())
                run.kills.append(kill)
                if scenario == "mqtt-kill":
                    await _kill_mosquitto(kill, mosq, daemon, watcher, args, say)
                else:
                    boot = await _kill_daemon(kill, boot, mosq, daemon, watcher, args, say)
                kill.alive_after = daemon.alive
                # The next kill hits a daemon that is deciding again (bounded).
                await daemon.while_alive(sched.wait_until(
                    lambda t=kill.t_up: sched.first_decision_after(t) is not None
                    or (load.done() and sched.all_answered()), ONLINE_WITHIN),
                    ONLINE_WITHIN + 1)
            last_send = await load
            say(f"all {args.requests} sent; waiting for answers (re-sending until "
                f"{args.deadline:g} s after the last send)")
            sched.give_up_at = last_send + args.deadline
            wait = max(0.0, sched.give_up_at - time.monotonic())
            await daemon.while_alive(sched.wait_all_answered(wait), wait + 1)
        except DaemonDied as exc:
            died = str(exc)
            say(f"the daemon EXITED ON ITS OWN ({exc}); the run stops here")
            load.cancel()
        ticker.cancel()
        for kill in run.kills:
            kill.first_decision_s = sched.first_decision_after(kill.t_up)

        alive_before_stop = daemon.alive
        all_leases: list[dict[str, Any]] | None = None
        final: RetainedCheck | None = None
        stop_mark, stop_wall = watcher.mark(), wall()
        if alive_before_stop:
            # The end state: duplicates in the daemon's own book, retained state now.
            all_leases = await daemon.leases()
            final = await check_retained_leases(daemon, mosq.port, since=time.monotonic(),
                                                within=RETAINED_WITHIN)
            stop_mark, stop_wall = watcher.mark(), wall()
            exit_code = await daemon.stop(signal.SIGTERM, timeout=30)
        else:
            exit_code = daemon.returncode
        offline_on_stop = None
        with contextlib.suppress(TimeoutError):
            rec = await watcher.wait_for(
                StatusWatcher.is_state("offline", boot_id=boot,
                                       after=stop_wall if alive_before_stop else None),
                timeout=OFFLINE_WITHIN, since=stop_mark if alive_before_stop else 0)
            offline_on_stop = rec.retain
        status_after = await _retained_status(mosq.port)

        s = sched.summary()
        dup_http = duplicate_leases_in(all_leases) if all_leases is not None else {}
        counts = daemon.log_counts()
        run.figures = {
            "exit_code": exit_code,
            "alive_throughout": alive_before_stop and not daemon.unexpected_exits,
            "unexpected_exits": [{"boot": e.boot, "code": e.code}
                                 for e in daemon.unexpected_exits],
            "died": died,
            "ready_s": round(ready_s, 2),
            **s,
            "lost_request_ids": sorted(r.request_id for r in sched.unanswered)[:20],
            "duplicate_leases_events": s["duplicate_leases"],
            "duplicate_leases_http": len(dup_http) if all_leases is not None else None,
            "duplicate_examples": (list(sched.duplicate_leases().items())[:3]
                                   + list(dup_http.items())[:3]),
            "active_leases_end": final.active if final else None,
            "retained_end": final.to_json() if final else None,
            "offline_retained_on_stop": offline_on_stop,
            "status_retained_after_stop": status_after,
            "daemon_log_counts": counts,
            "daemon_log_excerpts": {p: daemon.log_matches(p, context=20, limit=2)
                                    for p in LOG_PATTERNS if counts[p]},
            "daemon_mqtt_connected_lines": len(daemon.events("mqtt connected")),
            "mosquitto_dropped_lines": sum("dropp" in line.lower()
                                           for line in mosq.log_text().splitlines()),
        }
        say(f"done: exit code {exit_code}, lost {s['lost']}, duplicate leases "
            f"{s['duplicate_leases']}/{run.figures['duplicate_leases_http']}")
        return run
    finally:
        for task in (load, ticker):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        await sched.aclose()
        await watcher.aclose()
        daemon.close()
        mosq.kill()


async def _tick(say: Any, sched: ResendingScheduler, daemon: DaemonProcess, run: Run,
                args: argparse.Namespace) -> None:
    while True:
        await asyncio.sleep(args.progress_every)
        s = sched.summary()
        say(f"sent {s['sent']}/{args.requests}, decisions {s['decisions']}, "
            f"unanswered {s['sent'] - s['decisions'] - s['invalid']}, re-sent "
            f"{s['resent_requests']}, kills {len(run.kills)}/{args.kills}, daemon "
            + ("alive" if daemon.alive else "EXITED ON ITS OWN" if daemon.unexpected_exits
               else "down (killed)"))


async def _kill_mosquitto(kill: Kill, mosq: ChaosMosquitto, daemon: DaemonProcess,
                          watcher: StatusWatcher, args: argparse.Namespace, say: Any
                          ) -> None:
    t_kill, kill_wall = time.monotonic(), wall()
    await mosq.akill()
    await asyncio.sleep(args.down)  # the outage itself
    await mosq.astart()
    t_up = kill.t_up = time.monotonic()
    kill.up_s = t_up - t_kill
    try:
        await daemon.while_alive(watcher.online(ONLINE_WITHIN, after=kill_wall),
                                 ONLINE_WITHIN)
    except TimeoutError:
        say(f"kill {kill.n}: the daemon did not come back online within {ONLINE_WITHIN:g} s")
        return
    t_online = time.monotonic()
    kill.online_s = t_online - t_up
    kill.retained = await check_retained_leases(daemon, mosq.port, since=t_online,
                                                within=RETAINED_WITHIN)
    r = kill.retained
    say(f"kill {kill.n} (sent {kill.sent_before}): mosquitto back after {kill.up_s:.2f} s, "
        f"daemon online +{kill.online_s:.2f} s; active leases without retained state: "
        f"{r.missing + r.stale}/{r.active}"
        + (f" (complete after {r.seconds:.2f} s)" if r.ok else f" after {RETAINED_WITHIN:g} s"))


async def _kill_daemon(kill: Kill, boot: str, mosq: ChaosMosquitto, daemon: DaemonProcess,
                       watcher: StatusWatcher, args: argparse.Namespace, say: Any) -> str:
    mark, t_kill, kill_wall = watcher.mark(), time.monotonic(), wall()
    await daemon.kill()
    offline = asyncio.create_task(watcher.wait_for(
        StatusWatcher.is_state("offline", boot_id=boot), OFFLINE_WITHIN, since=mark))
    await asyncio.sleep(args.down)  # restart this long after the kill
    daemon.start()
    t_up = kill.t_up = time.monotonic()
    kill.up_s = t_up - t_kill
    try:
        rec = await offline
        kill.offline_seen, kill.offline_s = True, rec.at - t_kill
        kill.offline_retained = rec.retain
    except TimeoutError:
        kill.offline_seen = False
    try:
        doc = await daemon.while_alive(
            watcher.online(ONLINE_WITHIN, not_boot=boot, after=kill_wall), ONLINE_WITHIN)
    except TimeoutError:
        say(f"kill {kill.n}: the restarted daemon was not online within {ONLINE_WITHIN:g} s")
        return boot
    t_online = time.monotonic()
    kill.online_s = t_online - t_up
    kill.retained = await check_retained_leases(daemon, mosq.port, since=t_online,
                                                within=RETAINED_WITHIN)
    r = kill.retained
    say(f"kill {kill.n} (sent {kill.sent_before}): offline "
        + (f"seen after {kill.offline_s:.2f} s (retained: {kill.offline_retained})"
           if kill.offline_seen else f"NOT seen within {OFFLINE_WITHIN:g} s")
        + f"; restarted daemon online after {kill.online_s:.2f} s; active leases without "
        f"retained state: {r.missing + r.stale}/{r.active}")
    return str(doc["boot_id"])


async def _retained_status(port: int) -> str | None:
    found = await retained_snapshot(port, [f"{PREFIX}/status"])
    raw = found.get(f"{PREFIX}/status")
    return json.loads(raw).get("state") if raw else None


# --------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------

def _f(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def print_report(runs: list[Run], args: argparse.Namespace) -> None:
    print(f"chaos bench: {args.requests} requests at {args.rate:g}/s per run, {args.kills} "
          f"kills, outage {args.down:g} s; re-send after {args.resend_after:g} s "
          f"(x2, at most 10 s) until {args.deadline:g} s after the last send; sim seed "
          f"{args.seed}, poll every {args.poll_interval:g} s")
    head = ("run", "exit", "alive", "sent", "decisions", "lost", "dup leases ev/http",
            "no retained @5s per kill", "end", "1st decision s per kill", "Traceback",
            "Future exc")
    rows = [head]
    for r in runs:
        f = r.figures
        missing = " ".join("?" if k.retained is None else str(k.retained.missing
                                                               + k.retained.stale)
                           for k in r.kills)
        end = f["retained_end"] or {}
        first = " ".join(_f(k.first_decision_s, 1) for k in r.kills)
        counts = f["daemon_log_counts"]
        rows.append((r.name, str(f["exit_code"]), "yes" if f["alive_throughout"] else "NO",
                     str(f["sent"]), str(f["decisions"]), str(f["lost"]),
                     f"{f['duplicate_leases_events']}/"
                     f"{'-' if f['duplicate_leases_http'] is None else f['duplicate_leases_http']}",
                     missing or "-",
                     str(end["missing"] + end["stale"]) if end else "-", first or "-",
                     str(counts["Traceback"]),
                     str(counts["Future exception was never retrieved"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    print()
    for r in runs:
        f = r.figures
        print(f"{r.name}: decided {f['decided']}, rejected {f['rejected']}, invalid "
              f"{f['invalid']}; {f['resent_requests']} requests re-sent ({f['publishes']} "
              f"publishes); {f['duplicate_events']} duplicate events (same id); scheduler "
              f"reconnects {f['reconnects']}; `offline` published retained at the end "
              f"({'SIGTERM' if f['alive_throughout'] else 'its own exit'}): "
              f"{f['offline_retained_on_stop']}, retained P/status then: "
              f"{f['status_retained_after_stop']}; mosquitto 'dropped' log lines "
              f"{f['mosquitto_dropped_lines']}")
        for k in r.kills:
            ret = k.retained
            line = (f"  kill {k.n} at {k.at_s:.1f} s ({k.sent_before} sent"
                    f"{'' if k.under_load else ', load over'}): back after {_f(k.up_s)} s, "
                    f"daemon online +{_f(k.online_s)} s, ")
            if r.scenario == "daemon-kill":
                seen = f"seen +{_f(k.offline_s)} s" if k.offline_seen else "NOT seen"
                line += f"offline {seen}{' (retained)' if k.offline_retained else ''}, "
            line += f"first decision +{_f(k.first_decision_s)} s; retained: "
            if ret is None:
                line += "not checked"
            elif ret.ok:
                line += f"all {ret.active} active leases after {_f(ret.seconds)} s"
            else:
                line += (f"{ret.missing} missing + {ret.stale} stale of {ret.active} after "
                         f"{RETAINED_WITHIN:g} s ({ret.retained} retained"
                         f"{', ' + ret.error if ret.error else ''})")
            if ret is not None and ret.ended_retained:
                line += f"; {ret.ended_retained} retained as active but ended"
            print(line)
        if f["lost_request_ids"]:
            print(f"  lost: {', '.join(f['lost_request_ids'][:10])}")
        if f["duplicate_examples"]:
            print(f"  duplicate leases: {f['duplicate_examples'][:3]}")
        if f["unexpected_exits"]:
            print(f"  the daemon EXITED ON ITS OWN: {f['unexpected_exits']}; the run stopped "
                  "there (lost = requests unanswered then)")
        for pattern, excerpts in f["daemon_log_excerpts"].items():
            print(f"  first '{pattern}' in the daemon's log:")
            print("    " + excerpts[0].replace("\n", "\n    "))


# --------------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=("mqtt-kill", "daemon-kill", "all"), default="all")
    p.add_argument("--persistence", choices=("on", "off", "both"), default="both",
                   help="mosquitto persistence for mqtt-kill (both)")
    p.add_argument("--requests", type=int, default=5000, help="requests per run (5000)")
    p.add_argument("--rate", type=float, default=200.0, help="requests per second (200)")
    p.add_argument("--kills", type=int, default=5, help="kills per run (5)")
    p.add_argument("--down", type=float, default=1.0,
                   help="seconds from a kill to the restart (1)")
    p.add_argument("--resend-after", type=float, default=3.0,
                   help="re-send a request unanswered this long (3 s; then x2, max 10 s)")
    p.add_argument("--deadline", type=float, default=30.0,
                   help="stop re-sending this long after the last send; unanswered then "
                        "is lost (30 s)")
    p.add_argument("--poll-interval", type=float, default=5.0,
                   help="the daemon's poll interval (5 s)")
    p.add_argument("--seed", type=int, default=7, help="sim seed (7)")
    p.add_argument("--progress-every", type=float, default=3.0, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--keep", action="store_true",
                   help="keep the temporary directory (logs, state, mosquitto data)")
    args = p.parse_args(argv)
    if args.requests < 1 or args.rate <= 0 or args.kills < 0 or args.down < 0:
        p.error("--requests >= 1, --rate > 0, --kills >= 0, --down >= 0")
    return args


def plan(args: argparse.Namespace) -> list[tuple[str, bool]]:
    runs: list[tuple[str, bool]] = []
    if args.scenario in ("mqtt-kill", "all"):
        if args.persistence in ("on", "both"):
            runs.append(("mqtt-kill", True))
        if args.persistence in ("off", "both"):
            runs.append(("mqtt-kill", False))
    if args.scenario in ("daemon-kill", "all"):
        runs.append(("daemon-kill", True))
    return runs


async def amain(args: argparse.Namespace, workdir: Path) -> list[Run]:
    t0 = time.monotonic()
    ignore_socket_races(asyncio.get_running_loop())
    runs = []
    # Every run is bounded: load + kills (outage, restart, checks) + deadline + margin.
    bound = (args.requests / args.rate + args.kills * (args.down + ONLINE_WITHIN
                                                       + RETAINED_WITHIN + OFFLINE_WITHIN + 5)
             + args.deadline + 120)
    for i, (scenario, persistence) in enumerate(plan(args)):
        async with asyncio.timeout(bound):
            runs.append(await run_scenario(scenario, persistence, args,
                                           workdir / f"run{i}-{scenario}", t0))
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # Ctrl-C (even where a shell started us with SIGINT ignored) and SIGTERM both cancel
    # the run; its `finally` blocks stop the daemon and mosquitto, and atexit kills
    # whatever is left.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: signal.raise_signal(signal.SIGINT))
    workdir = Path(tempfile.mkdtemp(prefix="gpubroker-chaos-"))
    try:
        runs = asyncio.run(amain(args, workdir))
    except KeyboardInterrupt:
        print("chaos: interrupted", file=sys.stderr)
        return 130
    finally:
        kill_everything()
        if args.keep:
            print(f"chaos: files kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(json.dumps({"settings": {k: v for k, v in vars(args).items()
                                       if k not in ("json", "keep", "progress_every")},
                          "runs": [r.to_json() for r in runs]}, indent=2))
    else:
        print_report(runs, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
