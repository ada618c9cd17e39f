"""Hostile payloads against the real daemon: it must answer them all and keep running.

A private mosquitto on a free loopback port, the daemon as a subprocess
(`python -m broker.cli run --config …` on the sim, as `bench/latency.py` runs it), and one
client that publishes `--count` fuzzed payloads on `P/requests/fz-<n>/<verb>` at
`--rate` per second (open loop, QoS 1): a quarter are the entries of the corpus in
`tests/fixtures/nasty/` as they are, the rest random mutations of valid requests (bytes
flipped, inserted, deleted, repeated, cut; hostile tokens such as deep brackets, huge
numbers, lone surrogate escapes, invalid UTF-8, NUL, BOM; fields set to odd values;
whole payloads wrapped in nesting). Every `--valid-every`th message besides is a valid
placement request from `fz-valid`, timed from publish to its `placement.*` answer.

Seeded (`--seed`): the same arguments send the same payloads. Prints progress every 10 %,
then: payloads sent, daemon crashes (the daemon is restarted if it dies, so all of them
are counted; 0 expected, and the daemon alive and answering at the end), answers by kind,
valid requests answered and their p50/p99 latency, events that are not UTF-8 JSON, and the
daemon's RSS (VmRSS, VmHWM) before and after.

    cd /work/main && python bench/fuzz.py [--count 100000] [--rate 1000] [--seed 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiomqtt

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parent.parent
sys.path.insert(0, str(SCRIPT.parent))

from latency import (  # noqa: E402  (bench/latency.py: the same mosquitto and daemon)
    PREFIX,
    Daemon,
    Mosquitto,
    bench_workdir,
    cpu_seconds,
    mqtt_client,
    percentile,
    proc_status,
)

CORPUS_DIR = ROOT / "tests" / "fixtures" / "nasty"
SCHEDULERS = 16  # fuzzed payloads come from fz-0 .. fz-15
VERBS = ("place",) * 17 + ("renew", "release", "report")
ANSWERS = ("request.invalid", "placement.decided", "placement.rejected")
WINDOW = 2000  # publishes awaiting their PUBACK
MAX_FUZZ = 100 * 1024  # mutations stay under what the MQTT server forwards (128 KiB)

BASES: tuple[dict[str, Any], ...] = (
    {"gpu": ["H100-80GB", "A100-80GB"], "gpus": 8},
    {"gpu": "L4", "gpus": 1, "labels": {"job": "fuzz", "team": "x"}},
    {"gpu": "A10G", "gpus": 4, "market": "spot", "max_price_per_gpu_hour": 2.5},
    {"gpu": "T4", "gpus": 1, "clouds": ["aws", "gcp"], "regions": ["us-east-1"],
     "duration_hours": 6, "lease_seconds": 900, "team": "research", "gang": False},
)
VALID: tuple[dict[str, Any], ...] = (
    {"gpu": ["L4", "T4", "A10G"], "gpus": 1},
    {"gpu": ["A100-80GB", "H100-80GB"], "gpus": 1, "market": "any"},
)
FIELDS = ("request_id", "gpu", "gpus", "gang", "market", "max_price_per_gpu_hour",
          "clouds", "regions", "team", "duration_hours", "lease_seconds", "labels",
          "lease_id", "kind", "detail", "x")
TOKENS = (b"[", b"]", b"{", b"}", b'"', b"\\", b",", b":", b"\\ud800", b"\\udfff",
          b"\\ud83d\\ude00", b"\\u0000", b"\xff", b"\x00", b"\xc0\xaf", b"\xed\xa0\x80",
          b"\xef\xbb\xbf", b"NaN", b"Infinity", b"-0", b"1e400", b"9" * 5000, b"1e" + b"9" * 5000,
          b"[" * 5000, b'{"a":' * 200, b"null", b"true", b'"' + b"x" * 1000 + b'"', b"\n",
          b"\t", b"\r\n", "é".encode(), "\U0001f600".encode())


# --------------------------------------------------------------------------------------
# payloads
# --------------------------------------------------------------------------------------

def odd_text(rng: random.Random) -> str:
    """Text with anything in it: lone surrogates, NUL, controls, astral characters."""
    pool = ("\ud800", "\udfff", "\x00", "\x1f", "\u2028", "\ufeff", "\U0001f600", "é",
            '"', "\\", "[", "{", "a", "A100-80GB")
    return "".join(rng.choice(pool) for _ in range(rng.randint(0, 8)))


def odd_value(rng: random.Random, depth: int = 0) -> Any:
    pick = rng.randrange(12 if depth < 3 else 8)
    if pick == 0:
        return odd_text(rng)
    if pick == 1:
        return rng.choice([0, -1, 1, 2**63, -(2**64), 4096, 4097, 10**60])
    if pick == 2:
        return rng.choice([0.0, -0.0, 1e308, 5e-324, 3.5, float("inf"), float("nan")])
    if pick == 3:
        return rng.choice([None, True, False])
    if pick == 4:
        return "x" * rng.choice([0, 1, 64, 65, 128, 129, 257, 1025, 5000])
    if pick == 5:
        return ["A100-80GB"] * rng.choice([0, 1, 16, 17, 500])
    if pick == 6:
        return {odd_text(rng): odd_text(rng) for _ in range(rng.randint(0, 4))}
    if pick == 7:
        return rng.choice(["spot", "on_demand", "any", "cheap", "", "interrupted"])
    if pick in (8, 9):
        return [odd_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(FIELDS): odd_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def mutation(rng: random.Random, n: int) -> bytes:
    req: dict[str, Any] = {"request_id": f"fz-{n}", **rng.choice(BASES)}
    for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):  # fields set to odd values
        req[rng.choice(FIELDS)] = odd_value(rng)
    if rng.random() < 0.1:
        del req[rng.choice(list(req))]
    # `ensure_ascii` writes lone surrogates as `\udxxx`; without it they cannot be
    # encoded as UTF-8 and `surrogatepass` writes them as (invalid) UTF-8 bytes.
    text = json.dumps(req, ensure_ascii=rng.random() < 0.7)
    b = bytearray(text.encode("utf-8", "surrogatepass"))
    for _ in range(rng.choice([0, 1, 1, 2, 3, 5])):  # and bytes mangled
        op = rng.randrange(8)
        at = rng.randint(0, len(b))
        if op == 0 and b:
            b[min(at, len(b) - 1)] = rng.randrange(256)
        elif op == 1:
            b[at:at] = rng.choice(TOKENS)
        elif op == 2:
            del b[at:at + rng.randint(1, 16)]
        elif op == 3:
            piece = b[at:at + rng.randint(1, 64)]
            b[at:at] = piece * rng.randint(1, 200)
        elif op == 4:
            del b[at:]
        elif op == 5:
            k = rng.choice([1, 31, 32, 33, 1000, 10_000])
            b = bytearray(b"[" * k) + b + bytearray(b"]" * rng.choice([k, k - 1, 0]))
        elif op == 6:
            b[at:at] = rng.randbytes(rng.randint(1, 8))
        else:
            b = b + b  # trailing garbage: two documents
    return bytes(b[:MAX_FUZZ])


def fuzzed(rng: random.Random, n: int, corpus: Sequence[bytes]) -> tuple[str, bytes]:
    """The `n`th fuzzed message: (topic, payload)."""
    verb = rng.choice(VERBS)
    topic = f"{PREFIX}/requests/fz-{n % SCHEDULERS}/{verb}"
    payload = rng.choice(corpus) if rng.random() < 0.25 else mutation(rng, n)
    return topic, payload


# --------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------

def mib(kb: int | None) -> str:
    return "?" if kb is None else f"{kb / 1024:.1f} MiB"


class Watch:
    """Restarts the daemon if it dies, and counts how often that happened."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.crashes = 0
        self.exit_codes: list[int | None] = []
        self.stopping = False

    async def run(self) -> None:
        while not self.stopping:
            proc = self.daemon.proc
            assert proc is not None
            code = await proc.wait()
            if self.stopping:
                return
            self.crashes += 1
            self.exit_codes.append(code)
            print(f"fuzz: DAEMON DIED (exit {code}); its last lines:\n"
                  + "\n".join(self.daemon.tail[-15:]), file=sys.stderr, flush=True)
            self.daemon.proc = None
            self.daemon.ready.clear()
            await self.daemon.start()
            await self.daemon.wait_ready()


async def run(args: argparse.Namespace, workdir: Path) -> int:
    rng = random.Random(args.seed)
    corpus = [p.read_bytes() for p in sorted(CORPUS_DIR.iterdir())
              if p.suffix in (".bad", ".ok")]
    if not corpus:
        raise SystemExit(f"fuzz: no corpus in {CORPUS_DIR}")
    mosq = Mosquitto(workdir)
    mosq.start()
    daemon = Daemon(workdir / "daemon", mosq.url, seed=args.seed, regions=args.regions,
                    poll_interval=3600)
    watch = Watch(daemon)
    watcher: asyncio.Task[None] | None = None
    try:
        await daemon.start()
        await daemon.wait_ready()
        await daemon.settle()
        before = proc_status(daemon.pid)
        watcher = asyncio.create_task(watch.run())
        host, port = "127.0.0.1", mosq.port

        kinds: Counter[str] = Counter()  # answers to fuzzed payloads, by event kind
        valid_kinds: Counter[str] = Counter()
        other: Counter[str] = Counter()
        bad_events = 0
        sent_at: dict[str, float] = {}
        latency: dict[str, float] = {}
        progress = asyncio.Event()
        window = asyncio.Semaphore(WINDOW)
        errors: list[BaseException] = []

        async with mqtt_client(host, port, "bench-fuzz", nodelay=True) as client:
            await client.subscribe(f"{PREFIX}/events/+/+", qos=1)

            async def receive() -> None:
                nonlocal bad_events
                async for msg in client.messages:
                    now = time.monotonic()
                    _, _, scheduler, kind = str(msg.topic).rsplit("/", 3)
                    try:
                        event = json.loads(bytes(msg.payload).decode("utf-8"))
                    except ValueError:
                        bad_events += 1
                        continue
                    if scheduler == "fz-valid":
                        rid = event.get("data", {}).get("request_id")
                        if rid in sent_at and rid not in latency:
                            latency[rid] = now - sent_at[rid]
                            if rid.startswith("valid-"):
                                valid_kinds[kind] += 1
                    elif scheduler.startswith("fz-") and kind in ANSWERS:
                        kinds[kind] += 1
                    else:  # lease.expired / lease.failover of leases fuzzing made ...
                        other[kind] += 1
                    progress.set()

            async def publish(topic: str, payload: bytes, rid: str | None) -> None:
                try:
                    if rid is not None:
                        sent_at[rid] = time.monotonic()
                    await client.publish(topic, payload, qos=1)
                except aiomqtt.MqttError as exc:
                    errors.append(exc)
                finally:
                    window.release()

            receiver = asyncio.create_task(receive())
            tasks: set[asyncio.Task[None]] = set()
            total = args.count + args.count // args.valid_every
            step = max(1, total // 10)
            fuzz_sent = valid_sent = 0
            pid0, cpu0, t0 = daemon.pid, cpu_seconds(daemon.pid), time.monotonic()
            i = 0
            while i < total:
                due = t0 + i / args.rate
                now = time.monotonic()
                if due > now:
                    await asyncio.sleep(due - now)
                    continue
                if (i + 1) % args.valid_every == 0 and valid_sent < args.count // args.valid_every:
                    rid = f"valid-{valid_sent}"
                    body = json.dumps({"request_id": rid, **VALID[valid_sent % len(VALID)],
                                       "lease_seconds": 3600}).encode()
                    topic, payload = f"{PREFIX}/requests/fz-valid/place", body
                    valid_sent += 1
                else:
                    topic, payload = fuzzed(rng, fuzz_sent, corpus)
                    rid = None
                    fuzz_sent += 1
                await window.acquire()
                t = asyncio.create_task(publish(topic, payload, rid))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                i += 1
                if i % step == 0 or i == total:
                    rss = proc_status(daemon.pid) if daemon.proc else {}
                    print(f"fuzz: {100 * i // total:3d}%  sent {i:,}  answered "
                          f"{sum(kinds.values()) + len(latency):,}  "
                          f"{time.monotonic() - t0:6.1f}s  daemon VmRSS "
                          f"{mib(rss.get('VmRSS'))}  crashes {watch.crashes}", flush=True)
            if tasks:
                await asyncio.wait(tasks, timeout=60)
            send_s = time.monotonic() - t0
            cpu = ((cpu_seconds(pid0) - cpu0) / send_s * 100
                   if daemon.proc is not None and daemon.pid == pid0 else None)
            # Drain: until all is answered, or nothing new for `--drain` seconds.
            while sum(kinds.values()) < fuzz_sent or len(latency) < valid_sent:
                progress.clear()
                try:
                    async with asyncio.timeout(args.drain):
                        await progress.wait()
                except TimeoutError:
                    break
            drained_s = time.monotonic() - t0

            # Still alive, still answering: one more valid request.
            alive = daemon.proc is not None and daemon.proc.returncode is None
            final = "final-check"
            sent_at[final] = time.monotonic()
            await client.publish(f"{PREFIX}/requests/fz-valid/place", json.dumps(
                {"request_id": final, **VALID[0]}).encode(), qos=1)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(10):
                    while final not in latency:
                        progress.clear()
                        await progress.wait()
            answering = final in latency
            after = proc_status(daemon.pid) if daemon.proc else {}
            receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError, aiomqtt.MqttError):
                await receiver

        lat = sorted(v * 1000 for k, v in latency.items() if k != final)
        answered = sum(kinds.values())
        print()
        print(f"fuzz: seed {args.seed}, rate {args.rate:g}/s, sim regions/cloud "
              f"{args.regions}, corpus {len(corpus)} payloads")
        print(f"payloads sent:        {fuzz_sent:,} fuzzed + {valid_sent:,} valid "
              f"in {send_s:.1f}s ({(fuzz_sent + valid_sent) / send_s:,.0f}/s); "
              f"answers drained after {drained_s:.1f}s"
              + (f"; publish errors {len(errors)}" if errors else ""))
        print(f"daemon crashes:       {watch.crashes}"
              + (f" (exit codes {watch.exit_codes})" if watch.crashes else "")
              + f"; alive at the end: {'yes' if alive else 'NO'}; answering at the end: "
              f"{'yes' if answering else 'NO'}")
        print(f"fuzzed answered:      {answered:,} / {fuzz_sent:,}  "
              + "  ".join(f"{k} {v:,}" for k, v in kinds.most_common()))
        print(f"invalid answered:     {kinds['request.invalid']:,}")
        print(f"valid answered:       {len(lat):,} / {valid_sent:,}  "
              + "  ".join(f"{k} {v:,}" for k, v in valid_kinds.most_common()))
        if lat:
            print(f"valid latency:        p50 {percentile(lat, 50):.1f} ms  "
                  f"p99 {percentile(lat, 99):.1f} ms  max {lat[-1]:.1f} ms")
        print(f"events not UTF-8 JSON: {bad_events}"
              + (f"; other events {dict(other)}" if other else ""))
        print(f"daemon RSS before:    VmRSS {mib(before.get('VmRSS'))}  "
              f"VmHWM {mib(before.get('VmHWM'))}")
        print(f"daemon RSS after:     VmRSS {mib(after.get('VmRSS'))}  "
              f"VmHWM {mib(after.get('VmHWM'))}")
        print("daemon CPU:           "
              + ("n/a (restarted)" if cpu is None else f"{cpu:.0f}% of one core")
              + " while sending; log lines "
              + ", ".join(f"{k} {v:,}" for k, v in sorted(daemon.levels.items())))
        ok = watch.crashes == 0 and alive and answering and not bad_events
        return 0 if ok else 1
    finally:
        watch.stopping = True
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        await daemon.stop()
        mosq.stop()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=100_000, help="fuzzed payloads to send")
    p.add_argument("--rate", type=float, default=1000.0, help="messages per second")
    p.add_argument("--valid-every", type=int, default=50,
                   help="one valid request besides every N messages")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--regions", type=int, default=4, help="sim regions per cloud")
    p.add_argument("--drain", type=float, default=30.0,
                   help="give up waiting for answers after this many quiet seconds")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with bench_workdir("fuzz", keep=args.keep) as workdir:
        return asyncio.run(run(args, workdir))


if __name__ == "__main__":
    sys.exit(main())
