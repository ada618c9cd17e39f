"""The MQTT layer alone: what receiving and publishing a message costs in each client.

One private mosquitto (bench/latency.py's), then for each client and protocol version
(MQTT 5 and 3.1.1), `--messages` messages of a request-sized JSON payload (~330 bytes):

* **publish**: QoS 1, at most `--window` unacknowledged at once, until every PUBACK is
  in: messages per second (wall) and CPU microseconds per message of this process
  (`time.process_time`: the client's work, not mosquitto's).
* **receive**: a feeder process (aiomqtt, its CPU not counted) publishes the messages
  at QoS 1; the client under test, subscribed at QoS 1, takes each one and decodes its
  JSON: messages per second from the first to the last, and CPU per message.

The clients: `aiomqtt` (over paho-mqtt: the schedulers' client library's, and the
daemon's before #31), `gmqtt` (the daemon's since: broker/edges/mqtt.py), and `raw` —
hand-written MQTT packets (bench/latency.py's `RawPublisher`), no client library at all:
the floor a client sits on, not a candidate (no reconnects, no sessions, no flow
control).

Prints the table (`--json`: as JSON); pass/fail is not its business.

    python bench/mqtt_layer.py [--messages 10000] [--window 200] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiomqtt

SCRIPT = Path(__file__).resolve()
sys.path[:0] = [str(SCRIPT.parent)]

from latency import Mosquitto, RawPublisher  # noqa: E402  (bench/latency.py)

TOPIC = "bench/layer/req"
PAYLOAD = json.dumps({
    "request_id": "r-000000000001", "gpu": ["H100-80GB", "A100-80GB"], "gpus": 8,
    "market": "spot", "team": "research", "max_price_per_gpu_hour": 4.5,
    "duration_hours": 6, "lease_seconds": 900, "labels": {"job": "train-llm-7b",
                                                          "owner": "alice"},
    "clouds": ["aws", "gcp", "azure"], "regions": ["us-east-1", "us-central1", "eastus"],
}).encode()

Result = tuple[float, float]  # (wall seconds, CPU seconds)


# --- aiomqtt --------------------------------------------------------------------------

def _version(v: str) -> aiomqtt.ProtocolVersion:
    return aiomqtt.ProtocolVersion.V5 if v == "5" else aiomqtt.ProtocolVersion.V311


async def pub_aiomqtt(port: int, version: str, n: int, window: int) -> Result:
    async with aiomqtt.Client("127.0.0.1", port, protocol=_version(version),
                              max_inflight_messages=window) as client:
        client.pending_calls_threshold = 100_000  # as the daemon's bus: no warning a call
        gate = asyncio.Semaphore(window)

        async def one() -> None:
            async with gate:
                await client.publish(TOPIC, PAYLOAD, qos=1)

        t0, c0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(one() for _ in range(n)))
        return time.perf_counter() - t0, time.process_time() - c0


async def sub_aiomqtt(port: int, version: str, n: int, feed: Callable[[], None]) -> Result:
    async with aiomqtt.Client("127.0.0.1", port, protocol=_version(version),
                              max_queued_incoming_messages=0) as client:
        await client.subscribe(TOPIC, qos=1)
        feed()
        got = 0
        t0 = c0 = 0.0
        async for message in client.messages:
            if got == 0:
                t0, c0 = time.perf_counter(), time.process_time()
            json.loads(message.payload)  # type: ignore[arg-type]
            got += 1
            if got == n:
                break
        return time.perf_counter() - t0, time.process_time() - c0


# --- gmqtt -----------------------------------------------------------------------------

def _gmqtt_version(v: str) -> int:
    from gmqtt.mqtt.constants import MQTTv50, MQTTv311
    return MQTTv50 if v == "5" else MQTTv311


async def pub_gmqtt(port: int, version: str, n: int, window: int) -> Result:
    import gmqtt

    client = gmqtt.Client(f"layer-pub-{time.monotonic_ns()}")
    await client.connect("127.0.0.1", port, version=_gmqtt_version(version))
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(n):
            client.publish(TOPIC, PAYLOAD, qos=1)
            if i % window == window - 1:  # let the PUBACKs in, as a window would
                await client._wait_qos_queue_drained()  # no public way to wait
        await client._wait_qos_queue_drained()
        return time.perf_counter() - t0, time.process_time() - c0
    finally:
        await client.disconnect()


async def sub_gmqtt(port: int, version: str, n: int, feed: Callable[[], None]) -> Result:
    import gmqtt

    done = asyncio.get_running_loop().create_future()
    state = {"got": 0, "t0": 0.0, "c0": 0.0}

    def on_message(client: Any, topic: str, payload: bytes, qos: int, props: Any) -> int:
        if state["got"] == 0:
            state["t0"], state["c0"] = time.perf_counter(), time.process_time()
        json.loads(payload)
        state["got"] += 1
        if state["got"] == n and not done.done():
            done.set_result((time.perf_counter() - state["t0"],
                             time.process_time() - state["c0"]))
        return 0

    client = gmqtt.Client(f"layer-sub-{time.monotonic_ns()}")
    client.on_message = on_message
    await client.connect("127.0.0.1", port, version=_gmqtt_version(version))
    try:
        client.subscribe(TOPIC, qos=1)
        await asyncio.sleep(0)  # the SUBSCRIBE goes out before the feeder starts
        subscribed = asyncio.get_running_loop().create_future()
        client.on_subscribe = lambda *a: subscribed.done() or subscribed.set_result(None)
        await asyncio.wait_for(subscribed, 10)
        feed()
        result: Result = await done
        return result
    finally:
        await client.disconnect()


# --- raw packets ------------------------------------------------------------------------

async def pub_raw(port: int, version: str, n: int, window: int) -> Result:
    raw = await RawPublisher.connect("127.0.0.1", port, f"layer-raw-{time.monotonic_ns()}",
                                     version)
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(n):
        raw.publish(TOPIC, PAYLOAD)
        if i - window + 1 >= raw.acks:
            await raw.until(i - window + 2)
    await raw.until(n)
    result = time.perf_counter() - t0, time.process_time() - c0
    raw.close()
    return result


# --- the run ------------------------------------------------------------------------------

def feeder(port: int, version: str, n: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, str(SCRIPT), "--feed", str(port), version,
                             str(n)], stdin=subprocess.DEVNULL)


async def feed(port: int, version: str, n: int) -> None:
    await asyncio.sleep(0.2)  # the subscriber's SUBACK is in before the first message
    await pub_aiomqtt(port, version, n, 200)


CLIENTS: dict[str, tuple[Callable[..., Awaitable[Result]],
                         Callable[..., Awaitable[Result]] | None]] = {
    "aiomqtt": (pub_aiomqtt, sub_aiomqtt),
    "gmqtt": (pub_gmqtt, sub_gmqtt),
    "raw": (pub_raw, None),
}


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gpubroker-layer-") as tmp:
        # the broker's receive maximum (MQTT 5) and in-flight limit: the window
        mosq = Mosquitto(Path(tmp), max_inflight=args.window + 1)
        mosq.start()
        try:
            for name in args.clients:
                publish, receive = CLIENTS[name]
                if name == "gmqtt":
                    try:
                        import gmqtt  # noqa: F401
                    except ImportError:
                        print("gmqtt is not installed (pip install gmqtt): skipped",
                              file=sys.stderr)
                        continue
                for version in ("5", "3.1.1"):
                    for _ in range(args.repeat):
                        wall, cpu = await publish(mosq.port, version, args.messages,
                                                  args.window)
                        rows.append(_row(name, version, "publish", args.messages, wall, cpu))
                        if receive is None:
                            continue
                        procs: list[subprocess.Popen[bytes]] = []

                        def start(v: str = version,
                                  procs: list[subprocess.Popen[bytes]] = procs) -> None:
                            procs.append(feeder(mosq.port, v, args.messages))

                        wall, cpu = await receive(mosq.port, version, args.messages, start)
                        for p in procs:
                            p.wait(timeout=60)
                        rows.append(_row(name, version, "receive", args.messages, wall, cpu))
        finally:
            mosq.stop()
    return rows


def _row(client: str, version: str, what: str, n: int, wall: float, cpu: float
         ) -> dict[str, Any]:
    return {"client": client, "mqtt": version, "what": what, "messages": n,
            "per_second": round(n / wall) if wall > 0 else None,
            "cpu_us_per_message": round(cpu / n * 1e6, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=10000)
    ap.add_argument("--window", type=int, default=200,
                    help="unacknowledged publishes at once (default 200, the daemon's "
                         "outbox window)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each (default 3)")
    ap.add_argument("--clients", nargs="+", default=list(CLIENTS), choices=list(CLIENTS))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--feed", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.feed:
        port, version, n = args.feed
        asyncio.run(feed(int(port), version, int(n)))
        return 0
    if args.messages < 1 or args.window < 1 or args.repeat < 1:
        ap.error("--messages, --window and --repeat must be >= 1")
    rows = asyncio.run(run(args))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'client':8} {'MQTT':5} {'':8} {'msg/s':>8} {'CPU µs/msg':>11}")
    best: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in rows:
        key = (r["client"], r["mqtt"], r["what"])
        if key not in best or r["cpu_us_per_message"] < best[key]["cpu_us_per_message"]:
            best[key] = r
    for r in rows:
        print(f"{r['client']:8} {r['mqtt']:5} {r['what']:8} {r['per_second'] or 0:8,} "
              f"{r['cpu_us_per_message']:11.1f}")
    print(f"(each the best of {args.repeat} in the summary below; the machine may be shared)")
    for key, r in sorted(best.items()):
        print(f"  best {' '.join(key):24} {r['per_second'] or 0:8,}/s "
              f"{r['cpu_us_per_message']:8.1f} µs CPU")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
