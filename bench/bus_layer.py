"""The daemon's bus alone (`broker.edges.bus.Bus`, with whatever MQTT client the checkout
uses): the event loop's CPU per message received and per message published.

One private mosquitto (bench/latency.py's), one Bus on it (MQTT 5 or 3.1.1, its outbox
in a fresh SQLite file), then:

* **receive**: `mosquitto_pub` (a separate process, its CPU not counted) publishes
  `--messages` request-sized JSON payloads (~330 bytes) at QoS 1 to `P/requests/S/place`;
  the bus turns each into a command whose `done` is called at once (on MQTT 5 that sends
  its PUBACK, in order). Measured until every command is in and acknowledged.
* **publish**: as many outbox rows (the same payload, with MQTT 5 CorrelationData and
  Message Expiry as replies have), committed beforehand, handed to the bus at once;
  measured until every PUBACK is in and every row deleted (`Bus.drained`).

CPU is the event loop's thread (`time.thread_time` in it): the store's SQLite thread is
left out. Prints one line per protocol; pass/fail is not its business.

    python bench/bus_layer.py [--messages 10000] [--protocol 5 3.1.1]
    PYTHONPATH=/tmp/other-worktree:/tmp/other-worktree/client python bench/bus_layer.py
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
sys.path[:0] = [str(SCRIPT.parent)]

from latency import Mosquitto  # noqa: E402  (bench/latency.py: the private broker)
from mqtt_layer import PAYLOAD  # noqa: E402  (a request-sized JSON payload, as bytes)

from broker.daemon.config import MqttConfig  # noqa: E402
from broker.edges.bus import Bus  # noqa: E402
from broker.state.store import StateStore  # noqa: E402
from broker.wire.commands import Command  # noqa: E402
from broker.wire.messages import OutboxRow, Topics  # noqa: E402

PREFIX = "gpubroker/v1"


async def measure(mosq: Mosquitto, workdir: Path, protocol: str, n: int) -> dict[str, Any]:
    store = StateStore(workdir / f"state-{protocol}.db")
    await store.open()
    got = 0
    all_in = asyncio.Event()

    async def on_command(cmd: Command) -> None:
        nonlocal got
        got += 1
        if cmd.done is not None:
            cmd.done()
        if got >= n:
            all_in.set()

    bus = Bus(MqttConfig(url=mosq.url, protocol=protocol, session_expiry_seconds=0),
              Topics(PREFIX), store, client_id=f"bench-bus-{uuid.uuid4().hex[:8]}",
              boot_id=str(uuid.uuid4()), on_command=on_command)
    task = asyncio.create_task(bus.run())
    try:
        async with asyncio.timeout(10):
            await bus.connected.wait()
        lines = workdir / "lines.txt"
        lines.write_bytes((PAYLOAD + b"\n") * n)
        cpu, wall = time.thread_time(), time.monotonic()
        with lines.open("rb") as stdin:
            feeder = await asyncio.create_subprocess_exec(
                "mosquitto_pub", "-h", "127.0.0.1", "-p", str(mosq.port), "-q", "1",
                "-t", f"{PREFIX}/requests/bench/place", "-l",
                "-V", "mqttv5" if protocol == "5" else "mqttv311", stdin=stdin)
            async with asyncio.timeout(300):
                await all_in.wait()
                while bus.unacknowledged:  # noqa: ASYNC110 - a counter, nothing to wait on
                    await asyncio.sleep(0.005)
            receive = (time.thread_time() - cpu, time.monotonic() - wall)
            await feeder.wait()
        props = {"correlation_data": "00ff", "message_expiry": 60}
        rows: list[OutboxRow] = []
        for start in range(0, n, 1000):
            rows += await store.commit([], [
                OutboxRow(f"{PREFIX}/events/bench/e{i}", PAYLOAD, props=props)
                for i in range(start, min(n, start + 1000))])
        cpu, wall = time.thread_time(), time.monotonic()
        bus.enqueue(rows)
        if not await bus.drained(300):
            raise SystemExit("bench: the outbox did not drain within 300 s")
        publish = (time.thread_time() - cpu, time.monotonic() - wall)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await store.close()
    return {"protocol": protocol, "messages": n,
            "receive_us_per_msg": round(1e6 * receive[0] / n, 1),
            "receive_msg_per_s": round(n / receive[1]),
            "publish_us_per_msg": round(1e6 * publish[0] / n, 1),
            "publish_msg_per_s": round(n / publish[1])}


async def main(args: argparse.Namespace) -> None:
    if shutil.which("mosquitto_pub") is None:
        raise SystemExit("bench: mosquitto_pub not found (apt-get install -y mosquitto-clients)")
    with tempfile.TemporaryDirectory(prefix="gpubroker-bus-") as d:
        mosq = Mosquitto(Path(d))
        mosq.start()
        try:
            results = [await measure(mosq, Path(d), p, args.messages) for p in args.protocol]
        finally:
            mosq.stop()
    if args.json:
        print(json.dumps(results, indent=2))
        return
    import broker.edges.mqtt as client_module
    print(f"bus layer: {args.messages} messages each way, loop-thread CPU "
          f"({client_module.__file__})")
    for r in results:
        print(f"MQTT {r['protocol']:<5}  receive {r['receive_us_per_msg']:6.1f} µs/msg "
              f"({r['receive_msg_per_s']} msg/s)   publish {r['publish_us_per_msg']:6.1f} µs/msg "
              f"({r['publish_msg_per_s']} msg/s)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=10_000, help="each way (10000)")
    p.add_argument("--protocol", nargs="+", choices=("5", "3.1.1"), default=["5", "3.1.1"])
    p.add_argument("--json", action="store_true", help="the figures as JSON")
    asyncio.run(main(p.parse_args()))
