"""Daemon soak: `gpubroker run` on all four clouds' fakes, 30 % of their calls faulted.

What the daemon promises under a misbehaving cloud (issue #15): a throttle, a 5xx, a
timeout and a garbled body are transient — retried within the poll's deadline — so the
daemon does not crash, fails no lease over, and has every slice fresh at the end. This
bench runs it for `--minutes` and prints figures; it does not pass or fail.

One run: the four fake clouds of the tests (`tests/fakes/fake_aws.py`, `fake_gcp.py`,
`fake_azure.py`, `fake_alibaba.py`) in this process, each with
`chaos = Chaos(rate=--faults, seed=...)` (throttle, 5xx, timeout — the answer comes
`--hang` s late, above the daemon's `call_timeout_seconds` — and a 200 whose body is cut
in half, drawn at random); a private mosquitto on a free loopback port; and
`gpubroker run --config FILE` as a subprocess (tests/chaos/harness.py's DaemonProcess)
with every cloud pointed at its fake (`endpoint`; `anonymous: true`, except AWS, which
signs with the dummy key `testing`, because the fake AWS tells regions apart only by
the signature), `--regions` regions each, polled every `--interval` s, stale after
`--stale` s, SQLite state and the daemon's log in a temporary directory, HTTP on a free
loopback port. The daemon's environment has no cloud credentials and HOME in that
directory.

A scheduler (an MQTT 5 client, the chaos harness's ResendingScheduler) places
`--leases` leases as soon as every slice has had a good poll (one in four on each cloud,
`clouds: [<cloud>]`, so a failover anywhere would show), renews each every
`--renew` s, and records every `lease.failover`, `lease.failed` and `lease.expired`.

Every minute it prints the polls per cloud (`gpubroker_polls_total` on /metrics, by
result), the HTTP requests each fake received (counted at its fault middleware:
answered or faulted, its token endpoint and internal calls apart) and the faults by
kind. At the end: whether the daemon exited on its own (and its exit code on the
SIGTERM that ends the run), failovers (MQTT events and /metrics), whether every slice
is fresh (`/readyz`, `/v1/offers?fresh=1` per cloud and region, the stale and failing
region gauges), the lines of the daemon's log with `Traceback` or `Future exception
was never retrieved`, its "poll failing" and "partial poll failure" warnings per cloud,
and requests and mean poll time per cloud. `--baseline MIN` first runs the same daemon
for MIN minutes without faults and prints the two side by side.

    cd /work/main && python bench/soak.py                    # 10 minutes
    python bench/soak.py --minutes 10 --baseline 3 [--json out.json] [--keep]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
# The fakes and mqtt_helpers (tests/), the daemon-as-a-process harness (tests/chaos/);
# the project first (tests/ has a `broker` directory of its own).
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "chaos"), str(ROOT / "tests"),
               str(ROOT / "tests" / "support"), str(ROOT / "tests" / "fakes")]

from fake_alibaba import FakeAlibaba  # noqa: E402
from fake_aws import FakeAWS  # noqa: E402
from fake_azure import FakeAzure  # noqa: E402
from fake_gcp import FakeGCP  # noqa: E402
from fake_server import CHAOS_KINDS, Chaos, FakeServer  # noqa: E402
from harness import (  # noqa: E402
    LOG_PATTERNS,
    PREFIX,
    ChaosMosquitto,
    DaemonDied,
    DaemonProcess,
    Received,
    ResendingScheduler,
    free_port,
    ignore_socket_races,
    kill_everything,
)

CLOUDS = ("aws", "gcp", "azure", "alibaba")
REGIONS = {
    "aws": ["us-east-1", "us-west-2", "eu-central-1"],
    "gcp": ["us-central1", "europe-west4", "us-east4"],
    "azure": ["eastus", "westus2", "southcentralus"],
    "alibaba": ["cn-hangzhou", "cn-beijing", "ap-southeast-1"],
}
SCHEDULER = "soak"
GPUS = ["T4", "L4", "A10G", "A10", "V100-16GB", "V100-32GB", "A100-40GB", "A100-80GB",
        "H100-80GB"]
MARKETS = ("on_demand", "spot", "any")
LEASE_EVENTS = ("lease.failover", "lease.failed", "lease.expired", "lease.renewed")
CREDENTIAL_VARS = ("AWS_", "GOOGLE_", "CLOUDSDK_", "AZURE_", "ALIBABA_CLOUD_", "MSI_",
                   "IDENTITY_")


def say(t0: float, msg: str) -> None:
    print(f"[{(time.monotonic() - t0) / 60:5.1f} min] {msg}", flush=True)


# --------------------------------------------------------------------------------------
# the fakes
# --------------------------------------------------------------------------------------

class Requests:
    """HTTP requests a fake received, counted where its fault middleware decides (so
    faulted ones count too, whatever the fake itself counts); the requests a fake keeps
    out of its faults (a token endpoint, its own internal calls) are not cloud calls
    and are left out. Needs `chaos` set: a fault-free run uses `Chaos(rate=0)`."""

    def __init__(self, fake: FakeServer[Any]) -> None:
        self.n = 0
        applies: Callable[[Any], bool] = fake._chaos_applies

        def counted(request: Any) -> bool:
            ok = applies(request)
            self.n += ok  # one thread: the fake's event loop
            return ok

        fake._chaos_applies = counted  # type: ignore[method-assign,unused-ignore]


@dataclass
class Fakes:
    aws: FakeAWS
    gcp: FakeGCP
    azure: FakeAzure
    alibaba: FakeAlibaba
    requests: dict[str, Requests] = field(default_factory=dict)

    @classmethod
    def start(cls) -> Fakes:
        fakes = cls(FakeAWS().start(), FakeGCP().start(), FakeAzure().start(),
                    FakeAlibaba().start())
        fakes.requests = {c: Requests(fakes.of(c)) for c in CLOUDS}
        return fakes

    def of(self, cloud: str) -> FakeServer[Any]:
        fake: FakeServer[Any] = getattr(self, cloud)
        return fake

    def inject(self, rate: float, hang: float, seed: int) -> None:
        for i, cloud in enumerate(CLOUDS):
            fake = self.of(cloud)
            fake.chaos = Chaos(rate=rate, kinds=CHAOS_KINDS, hang_seconds=hang,
                               seed=seed + i)
            fake.faulted.clear()
            self.requests[cloud].n = 0

    def counts(self) -> dict[str, dict[str, Any]]:
        return {c: {"requests": self.requests[c].n, "faulted": dict(self.of(c).faulted)}
                for c in CLOUDS}

    def stop(self) -> None:
        for cloud in CLOUDS:
            with contextlib.suppress(Exception):
                self.of(cloud).stop()


def write_config(path: Path, fakes: Fakes, regions: dict[str, list[str]], *,
                 mqtt_url: str, state: Path, http_port: int,
                 args: argparse.Namespace) -> Path:
    common = {"call_timeout_seconds": args.call_timeout}
    cfg: dict[str, Any] = {
        "site": "soak",
        "log_level": "info",
        "state": {"path": str(state)},
        "mqtt": {"url": mqtt_url, "topic_prefix": PREFIX, "client_id": "gpubroker-soak"},
        "http": {"listen": f"127.0.0.1:{http_port}"},
        "poll": {"interval_seconds": args.interval, "stale_after_seconds": args.stale,
                 "timeout_seconds": args.poll_timeout},
        "clouds": {
            "aws": {"regions": regions["aws"], "endpoint": fakes.aws.url, **common},
            "gcp": {"regions": regions["gcp"], "endpoint": fakes.gcp.url,
                    "anonymous": True, "project": fakes.gcp.project, **common},
            "azure": {"regions": regions["azure"], "endpoint": fakes.azure.url,
                      "anonymous": True, "subscription_id": fakes.azure.subscription_id,
                      **common},
            "alibaba": {"regions": regions["alibaba"], "endpoint": fakes.alibaba.url,
                        "anonymous": True, **common},
        },
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def daemon_environment(home: Path) -> None:
    """No cloud credentials but the fake AWS key; HOME where no credential file is.
    (DaemonProcess starts the daemon with this process's environment.)"""
    for var in list(os.environ):
        if var.startswith(CREDENTIAL_VARS):
            del os.environ[var]
    os.environ.update(HOME=str(home), AWS_ACCESS_KEY_ID="testing",
                      AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                      AWS_EC2_METADATA_DISABLED="true", PYTHONPATH=str(ROOT))


# --------------------------------------------------------------------------------------
# the scheduler
# --------------------------------------------------------------------------------------

class Scheduler(ResendingScheduler):
    """Places leases, renews them, and keeps every lease event (duplicates dropped)."""

    def __init__(self, port: int) -> None:
        super().__init__(port, SCHEDULER, resend_after=5.0)
        self.lease_events: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.renewals_sent = 0

    def handle(self, rec: Received) -> None:
        dups = self.duplicate_events
        super().handle(rec)
        kind = rec.topic.rsplit("/", 1)[-1]
        if self.duplicate_events == dups and kind in LEASE_EVENTS:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                self.lease_events[kind].append(json.loads(rec.payload)["data"])

    def leases(self) -> dict[str, str]:
        """lease_id -> request_id of every placed lease."""
        return {r.lease_ids[-1]: r.request_id for r in self.requests.values()
                if r.lease_ids}

    async def renew_forever(self, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            for lease_id in self.leases():
                with contextlib.suppress(Exception):
                    await self.publish(f"{PREFIX}/requests/{SCHEDULER}/renew",
                                       json.dumps({"lease_id": lease_id}).encode())
                    self.renewals_sent += 1


def place_body(i: int, lease_seconds: int) -> dict[str, Any]:
    """One in four on each cloud; markets in turn."""
    return {"gpu": GPUS, "gpus": 1, "clouds": [CLOUDS[i % len(CLOUDS)]],
            "market": MARKETS[(i // len(CLOUDS)) % len(MARKETS)],
            "lease_seconds": lease_seconds, "labels": {"soak": "1"}}


# --------------------------------------------------------------------------------------
# the daemon's HTTP side
# --------------------------------------------------------------------------------------

Samples = dict[str, list[tuple[dict[str, str], float]]]


async def metrics(http: aiohttp.ClientSession, daemon: DaemonProcess) -> Samples:
    async with http.get(daemon.url("/metrics")) as r:
        text = await r.text()
    out: Samples = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name].append((dict(s.labels), s.value))
    return out


def total(samples: Samples, name: str, **match: str) -> float:
    return sum(v for labels, v in samples.get(name, [])
               if all(labels.get(k) == want for k, want in match.items()))


def polls(samples: Samples) -> dict[str, dict[str, Any]]:
    """Per cloud: polls ok, failed (by error), and the mean poll seconds."""
    out: dict[str, dict[str, Any]] = {c: {"ok": 0, "failed": Counter()} for c in CLOUDS}
    for labels, v in samples.get("gpubroker_polls_total", []):
        c = out.setdefault(labels["adapter"], {"ok": 0, "failed": Counter()})
        if labels["result"] == "ok":
            c["ok"] += int(v)
        elif v:
            c["failed"][labels["result"]] += int(v)
    for cloud, c in out.items():
        n = total(samples, "gpubroker_poll_duration_seconds_count", adapter=cloud)
        s = total(samples, "gpubroker_poll_duration_seconds_sum", adapter=cloud)
        c["mean_poll_s"] = s / n if n else None
        c["failed"] = dict(c["failed"])
    return out


def slices_polled_ok(samples: Samples) -> set[tuple[str, str]]:
    return {(labels["adapter"], labels["region"])
            for labels, v in samples.get("gpubroker_polls_total", [])
            if labels["result"] == "ok" and v > 0}


async def fresh_slices(http: aiohttp.ClientSession, daemon: DaemonProcess
                       ) -> Counter[tuple[str, str]]:
    """Fresh offers per (cloud, region), from `GET /v1/offers?fresh=1`."""
    async with http.get(daemon.url("/v1/offers?fresh=1&limit=10000000")) as r:
        rows = await r.json()
    return Counter((o["cloud"], o["region"]) for o in rows)


async def readyz(http: aiohttp.ClientSession, daemon: DaemonProcess) -> tuple[int, str]:
    async with http.get(daemon.url("/readyz")) as r:
        return r.status, (await r.text()).strip()


# --------------------------------------------------------------------------------------
# one run
# --------------------------------------------------------------------------------------

def log_records(daemon: DaemonProcess) -> list[dict[str, Any]]:
    out = []
    for line in daemon.log_text().splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if isinstance(rec, dict):
                    out.append(rec)
    return out


def log_figures(daemon: DaemonProcess) -> dict[str, Any]:
    records = log_records(daemon)
    failing: dict[str, Counter[str]] = defaultdict(Counter)
    first: dict[str, str] = {}
    partial: dict[str, Counter[str]] = defaultdict(Counter)
    unexpected: Counter[str] = Counter()
    for rec in records:
        event = str(rec.get("event", ""))
        cloud = str(rec.get("adapter") or event.split(" ", 1)[0])
        if event == "poll failing":
            failing[cloud][str(rec.get("error"))] += 1
            first.setdefault(cloud, f"{rec.get('region')}: {rec.get('error')}: "
                                    f"{str(rec.get('detail'))[:160]}")
        elif "partial poll failure" in event:
            partial[cloud][f"{rec.get('what')}: {rec.get('error')}"] += 1
        elif event == "poll failed unexpectedly":
            unexpected[cloud] += 1
    return {"patterns": daemon.log_counts(),
            "first_traceback": daemon.log_matches("Traceback", context=12, limit=1),
            "poll_failing": {c: dict(v) for c, v in failing.items()},
            "poll_failing_first": first,
            "partial_failures": {c: dict(v) for c, v in partial.items()},
            "poll_failed_unexpectedly": dict(unexpected)}


async def soak(label: str, minutes: float, rate: float, fakes: Fakes,
               args: argparse.Namespace, workdir: Path, t0: float) -> dict[str, Any]:
    regions = {c: REGIONS[c][:args.regions] for c in CLOUDS}
    configured = {(c, r) for c, rs in regions.items() for r in rs}
    workdir.mkdir(parents=True)  # noqa: ASYNC240 (once, before anything runs)
    fakes.inject(rate, args.hang, args.seed)
    mosq = ChaosMosquitto(workdir / "mosquitto", persistence=False)
    await mosq.astart()
    http_port = free_port()
    config = write_config(workdir / "config.yaml", fakes, regions, mqtt_url=mosq.url,
                          state=workdir / "state.db", http_port=http_port, args=args)
    daemon = DaemonProcess(config, workdir / "daemon.log", http_port)
    sched = Scheduler(mosq.port)
    out: dict[str, Any] = {"run": label, "minutes": minutes, "faults": rate,
                           "regions": regions, "progress": []}
    renewer: asyncio.Task[None] | None = None
    run_t0 = time.monotonic()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            daemon.start()
            started = time.monotonic()
            ready_s = await daemon.wait_ready(timeout=180)
            say(t0, f"{label}: daemon ready after {ready_s:.1f} s")
            # Place once every slice has had a good poll (a cloud still failing its first
            # poll would turn its leases into rejections, and hide its failovers).
            deadline = time.monotonic() + 180
            while True:
                ok = slices_polled_ok(await daemon.while_alive(metrics(http, daemon), 30))
                if configured <= ok or time.monotonic() > deadline:
                    break
                await asyncio.sleep(1)
            out["all_polled_s"] = (time.monotonic() - started if configured <= ok
                                   else None)
            missing = sorted(configured - ok)
            say(t0, f"{label}: every slice polled ok after "
                    f"{out['all_polled_s']:.1f} s" if not missing
                else f"{label}: no good poll yet after 180 s for {missing}; placing anyway")
            await sched.start()
            for i in range(args.leases):
                sched.submit(f"soak-{i:03d}", place_body(i, args.lease_seconds))
            await daemon.while_alive(sched.wait_all_answered(60), 61)
            renewer = asyncio.create_task(sched.renew_forever(args.renew))
            placed = Counter(CLOUDS[int(r.request_id[-3:]) % len(CLOUDS)]
                             for r in sched.requests.values() if r.lease_ids)
            say(t0, f"{label}: {sum(placed.values())} of {args.leases} leases placed "
                    f"({', '.join(f'{c} {placed[c]}' for c in CLOUDS)}); running "
                    f"{minutes:g} min")
            end = started + minutes * 60
            minute = 1
            while (now := time.monotonic()) < end:
                await daemon.while_alive(asyncio.sleep(min(60.0, end - now)), 61)
                samples = await daemon.while_alive(metrics(http, daemon), 30)
                row: dict[str, Any] = {"at_min": round((time.monotonic() - started) / 60, 2),
                       "polls": polls(samples), "fakes": fakes.counts(),
                       "failovers": total(samples, "gpubroker_failovers_total"),
                       "stale": total(samples, "gpubroker_pool_regions_stale"),
                       "failing": total(samples, "gpubroker_pool_regions_failing")}
                out["progress"].append(row)
                say(t0, f"{label}: minute {minute}: failovers {row['failovers']:.0f}, "
                        f"regions stale {row['stale']:.0f}, failing {row['failing']:.0f}")
                for cloud in CLOUDS:
                    p, f = row["polls"][cloud], row["fakes"][cloud]
                    kinds = " ".join(f"{k} {f['faulted'].get(k, 0)}" for k in CHAOS_KINDS)
                    failed = sum(p["failed"].values())
                    print(f"          {cloud:<8} polls ok {p['ok']:4d} failed {failed:3d}"
                          f"   requests {f['requests']:6d}   faulted {kinds}", flush=True)
                minute += 1
            # The end: what a scheduler and an SRE would look at now.
            samples = await daemon.while_alive(metrics(http, daemon), 30)
            fresh = await daemon.while_alive(fresh_slices(http, daemon), 30)
            status, text = await daemon.while_alive(readyz(http, daemon), 30)
            out["end"] = {
                "readyz": [status, text],
                "fresh_slices": len(configured & set(fresh)),
                "slices": len(configured),
                "not_fresh": sorted(f"{c} {r}" for c, r in configured - set(fresh)),
                "stale_regions": total(samples, "gpubroker_pool_regions_stale"),
                "failing_regions": total(samples, "gpubroker_pool_regions_failing"),
                "metrics_failovers": total(samples, "gpubroker_failovers_total"),
                "metrics_lease_failures": total(samples, "gpubroker_lease_failures_total"),
                "polls": polls(samples),
            }
            out["alive_at_end"] = daemon.alive
    except DaemonDied as exc:
        out["died"] = str(exc)
        say(t0, f"{label}: THE DAEMON EXITED ON ITS OWN ({exc})")
    finally:
        if renewer is not None:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
        out["seconds"] = time.monotonic() - run_t0
        out["exit_code_on_sigterm"] = await daemon.stop() if daemon.alive else None
        out["unexpected_exits"] = [{"boot": e.boot, "code": e.code}
                                   for e in daemon.unexpected_exits]
        out["fakes"] = fakes.counts()
        out["leases"] = {
            "asked": args.leases,
            "placed": sum(1 for r in sched.requests.values() if r.lease_ids),
            "rejected": sum(1 for r in sched.requests.values() if r.code),
            "placed_by_cloud": dict(Counter(
                CLOUDS[int(r.request_id[-3:]) % len(CLOUDS)]
                for r in sched.requests.values() if r.lease_ids)),
            "renewals_sent": sched.renewals_sent,
            "events": {k: len(sched.lease_events.get(k, [])) for k in LEASE_EVENTS},
            "failovers": [{k: e.get(k) for k in ("lease_id", "reason", "detail", "from",
                                                 "to")}
                          for e in sched.lease_events.get("lease.failover", [])][:10],
            "failed": sched.lease_events.get("lease.failed", [])[:10],
        }
        out["log"] = log_figures(daemon)
        await sched.aclose()
        daemon.close()
        await mosq.astop()
    return out


# --------------------------------------------------------------------------------------
# printing
# --------------------------------------------------------------------------------------

def rates(run: dict[str, Any], cloud: str) -> tuple[float, float | None]:
    """Requests a fake received in the run's first minute (the first polls: everything
    fetched) and per minute after it (caches warm), from the minute-by-minute figures."""
    rows = run.get("progress") or []
    if not rows:
        return float(run["fakes"][cloud]["requests"]), None
    first = float(rows[0]["fakes"][cloud]["requests"])
    if len(rows) < 2:
        return first, None
    later = float(rows[-1]["fakes"][cloud]["requests"]) - first
    return first, later / max(float(rows[-1]["at_min"]) - float(rows[0]["at_min"]), 1e-9)


def print_run(run: dict[str, Any], args: argparse.Namespace) -> None:
    end = run.get("end", {})
    leases, log = run["leases"], run["log"]
    print(f"\n== {run['run']}: {run['minutes']:g} min, faults on {run['faults']:.0%} of "
          f"calls (throttle, 5xx, timeout {args.hang:g} s, truncated), call timeout "
          f"{args.call_timeout:g} s, poll every {args.interval:g} s (deadline "
          f"{args.poll_timeout:g} s), stale after {args.stale:g} s, "
          f"{args.regions} regions per cloud")
    exits = run["unexpected_exits"]
    print(f"daemon: exited on its own: {len(exits)}{' ' + str(exits) if exits else ''}; "
          f"alive at the end: "
          f"{'yes' if run.get('alive_at_end') else 'NO'}; exit code on SIGTERM: "
          f"{run['exit_code_on_sigterm']}" + (f"; DIED: {run['died']}" if "died" in run
                                               else ""))
    ev = leases["events"]
    by_cloud = ", ".join(f"{c} {leases['placed_by_cloud'].get(c, 0)}" for c in CLOUDS)
    print(f"leases: {leases['placed']} of {leases['asked']} placed ({by_cloud}), "
          f"{leases['rejected']} rejected; renewals sent {leases['renewals_sent']}, "
          f"renewed {ev['lease.renewed']}, expired {ev['lease.expired']}")
    print(f"failovers: MQTT lease.failover {ev['lease.failover']}, lease.failed "
          f"{ev['lease.failed']}; /metrics failovers "
          f"{end.get('metrics_failovers', float('nan')):.0f}, lease failures "
          f"{end.get('metrics_lease_failures', float('nan')):.0f}")
    for f in leases["failovers"]:
        print(f"    failover {f['lease_id']}: {f['reason']} ({f['detail']})")
    for f in leases["failed"]:
        print(f"    failed {f.get('lease_id')}: {f.get('reason')} ({f.get('detail')})")
    if end:
        print(f"fresh at the end: /readyz {end['readyz'][0]} {end['readyz'][1]!r}; slices "
              f"with fresh offers (/v1/offers?fresh=1) {end['fresh_slices']} of "
              f"{end['slices']}{' ' + str(end['not_fresh']) if end['not_fresh'] else ''}; "
              f"stale regions {end['stale_regions']:.0f}, failing regions "
              f"{end['failing_regions']:.0f}")
    pats = log["patterns"]
    print(f"daemon log: {LOG_PATTERNS[0]} {pats[LOG_PATTERNS[0]]}, '{LOG_PATTERNS[1]}' "
          f"{pats[LOG_PATTERNS[1]]}, 'poll failed unexpectedly' "
          f"{sum(log['poll_failed_unexpectedly'].values())}")
    for excerpt in log["first_traceback"]:
        print("    first traceback:\n      " + excerpt.replace("\n", "\n      "))
    print(f"{'cloud':<8} {'polls ok':>8} {'failed':>6} {'mean poll s':>11} "
          f"{'requests':>8} {'1st min':>7} {'/min':>6} {'thr':>4} {'5xx':>4} {'tmo':>4} "
          f"{'cut':>4}  poll failing (by error) / partial failures")
    ps = end.get("polls") or (run["progress"][-1]["polls"] if run["progress"] else {})
    for cloud in CLOUDS:
        p = ps.get(cloud, {"ok": 0, "failed": {}, "mean_poll_s": None})
        f = run["fakes"][cloud]
        mean = p["mean_poll_s"]
        warn = ", ".join(f"{k} {n}" for k, n in log["poll_failing"].get(cloud, {}).items())
        part = ", ".join(f"{k} {n}" for k, n in
                         log["partial_failures"].get(cloud, {}).items())
        first, later = rates(run, cloud)
        print(f"{cloud:<8} {p['ok']:8d} {sum(p['failed'].values()):6d} "
              f"{'-' if mean is None else f'{mean:.2f}':>11} {f['requests']:8d} "
              f"{first:7.0f} {'-' if later is None else f'{later:.1f}':>6} "
              + " ".join(f"{f['faulted'].get(k, 0):4d}" for k in CHAOS_KINDS)
              + f"  {warn or '-'} / {part or '-'}")
        if cloud in log["poll_failing_first"]:
            print(f"{'':<8} first 'poll failing': {log['poll_failing_first'][cloud]}")


def print_comparison(faulty: dict[str, Any], base: dict[str, Any]) -> None:
    print(f"\n== with faults ({faulty['minutes']:g} min) against fault-free "
          f"({base['minutes']:g} min): requests in the first minute and per minute "
          f"after it, mean poll seconds, failed polls")
    print(f"{'cloud':<8} {'1st min':>8} {'(free)':>7} {'/min':>7} {'(free)':>7} "
          f"{'mean poll s':>11} {'(free)':>7} {'polls failed':>12} {'(free)':>7}")
    fp = faulty.get("end", {}).get("polls", {})
    bp = base.get("end", {}).get("polls", {})

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    for cloud in CLOUDS:
        (fa, la), (fb, lb) = rates(faulty, cloud), rates(base, cloud)
        ma = (fp.get(cloud) or {}).get("mean_poll_s")
        mb = (bp.get(cloud) or {}).get("mean_poll_s")
        xa = sum((fp.get(cloud) or {}).get("failed", {}).values())
        xb = sum((bp.get(cloud) or {}).get("failed", {}).values())
        print(f"{cloud:<8} {fa:8.0f} {fb:7.0f} {num(la, '.1f'):>7} {num(lb, '.1f'):>7} "
              f"{num(ma, '.2f'):>11} {num(mb, '.2f'):>7} {xa:12d} {xb:7d}")


# --------------------------------------------------------------------------------------

async def main_async(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    ignore_socket_races(asyncio.get_running_loop())
    t0 = time.monotonic()
    daemon_environment(tmp)
    say(t0, "starting the four fake clouds")
    fakes = await asyncio.to_thread(Fakes.start)
    runs = []
    try:
        if args.baseline:
            runs.append(await soak("fault-free", args.baseline, 0.0, fakes, args,
                                   tmp / "baseline", t0))
            print_run(runs[-1], args)
        runs.append(await soak("faults", args.minutes, args.faults, fakes, args,
                               tmp / "faults", t0))
        print_run(runs[-1], args)
        if args.baseline:
            print_comparison(runs[-1], runs[0])
    finally:
        await asyncio.to_thread(fakes.stop)
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--baseline", type=float, default=0.0, metavar="MIN",
                   help="first run the daemon this many minutes without faults")
    p.add_argument("--faults", type=float, default=0.3, help="share of calls faulted")
    p.add_argument("--regions", type=int, default=2, choices=(1, 2, 3),
                   help="regions per cloud")
    p.add_argument("--interval", type=float, default=15.0, help="poll.interval_seconds")
    p.add_argument("--stale", type=float, default=60.0, help="poll.stale_after_seconds")
    p.add_argument("--poll-timeout", type=float, default=30.0,
                   help="poll.timeout_seconds: the poll's deadline")
    p.add_argument("--call-timeout", type=float, default=2.0,
                   help="call_timeout_seconds of every cloud")
    p.add_argument("--hang", type=float, default=2.5,
                   help="a timeout fault answers this late (above --call-timeout)")
    p.add_argument("--leases", type=int, default=20)
    p.add_argument("--lease-seconds", type=int, default=300)
    p.add_argument("--renew", type=float, default=60.0, help="renew every lease this often")
    p.add_argument("--seed", type=int, default=15)
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--keep", action="store_true",
                   help="keep the temporary directory (configs, daemon logs)")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpubroker-soak-"))
    try:
        runs = asyncio.run(main_async(args, tmp))
        if args.json:
            args.json.write_text(json.dumps(runs, indent=2, default=str))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
    finally:
        kill_everything()
        if args.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
