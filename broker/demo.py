"""`gpubroker demo`: the whole system on the simulated market, with no set-up.

It runs the real daemon (SQLite state, MQTT bus, poller, placement, failover) on a fast,
jumpy simulated market, plus two demo schedulers that send placement requests over MQTT,
renew, release, sometimes let a lease expire or send a malformed request. Every event the
schedulers receive is printed as it arrives, so placements and failovers can be watched.
The MQTT server is the one on 127.0.0.1:1883 if one answers, else an embedded one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiomqtt

from broker import logs
from broker.config import (
    CloudsConfig,
    Config,
    HttpConfig,
    MqttConfig,
    PollConfig,
    SimConfig,
    StateConfig,
)
from broker.daemon import Daemon, install_signal_handlers
from broker.events import Topics

SCHEDULERS = ("research", "inference")
WORKLOADS: tuple[dict[str, Any], ...] = (
    {"gpu": ["H100-80GB", "A100-80GB"], "gpus": 8},
    {"gpu": "A100-40GB", "gpus": 8, "market": "spot"},
    {"gpu": "L4", "gpus": 1},
    {"gpu": ["A10G", "A10"], "gpus": 4, "market": "spot"},
    {"gpu": "T4", "gpus": 1, "max_price_per_gpu_hour": 0.25},
    {"gpu": "H100-80GB", "gpus": 16, "market": "on_demand"},
    {"gpu": "L40S", "gpus": 1, "market": "spot", "clouds": ["aws"]},
    {"gpu": "H100-80GB", "gpus": 8, "max_price_per_gpu_hour": 0.5},
)
LEASE_SECONDS = 20


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def _mqtt_server(url: str | None) -> AsyncIterator[tuple[str, str]]:
    """Yields (url, protocol) of an MQTT server to use."""
    if url is not None:
        yield url, "5"
        return
    if _port_open("127.0.0.1", 1883):
        yield "mqtt://127.0.0.1:1883", "5"
        return
    try:
        from amqtt.broker import Broker
    except ModuleNotFoundError:
        raise SystemExit("gpubroker demo: no MQTT server on 127.0.0.1:1883 and the embedded "
                         "one needs amqtt: pip install 'gpubroker[demo]'") from None
    port = _free_port()
    server = Broker({"listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{port}"}},
                     "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin":
                                 {"allow_anonymous": True}}})
    await server.start()
    print(f"embedded MQTT server on 127.0.0.1:{port} (MQTT 3.1.1)")
    try:
        yield f"mqtt://127.0.0.1:{port}", "3.1.1"
    finally:
        await server.shutdown()


def _config(url: str, protocol: str, state: Path, seed: int) -> Config:
    return Config(
        site="demo",
        state=StateConfig(path=state),
        mqtt=MqttConfig(url=url, protocol=protocol,  # type: ignore[arg-type]
                        client_id=f"gpubroker-demo-{uuid.uuid4().hex[:12]}"),
        poll=PollConfig(interval_seconds=2, stale_after_seconds=10, timeout_seconds=5),
        http=HttpConfig(listen=f"127.0.0.1:{_free_port()}"),
        clouds=CloudsConfig(sim=SimConfig(seed=seed, preempt_rate_multiplier=400,
                                          signal_interval_seconds=1.0)),
    )


def run_demo(*, duration: float | None, mqtt_url: str | None, state: Path | None,
             seed: int) -> int:
    logs.configure(json=False, level=40)  # errors only: the demo prints events itself
    with tempfile.TemporaryDirectory(prefix="gpubroker-demo-") as tmp:
        path = state or Path(tmp) / "state.db"
        asyncio.run(_main(duration, mqtt_url, path, seed))
    return 0


async def _main(duration: float | None, mqtt_url: str | None, state: Path, seed: int) -> None:
    stop = asyncio.Event()
    install_signal_handlers(stop)
    async with _mqtt_server(mqtt_url) as (url, protocol):
        cfg = _config(url, protocol, state, seed)
        daemon = Daemon(cfg)
        print(f"gpubroker demo: state {state}, MQTT {url}, topics {cfg.mqtt.topic_prefix}/…, "
              f"HTTP http://{cfg.http.listen}/v1/offers")
        print("Ctrl-C to stop." if duration is None else f"Running for {duration:g}s.")
        async with asyncio.TaskGroup() as tg:
            tg.create_task(daemon.run(stop))
            await daemon.ready.wait()
            print(f"ready: {len(daemon.pool)} offers from "
                  f"{len({(o.pool.cloud, o.pool.region) for o in daemon.pool})} regions\n")
            schedulers = tg.create_task(_schedulers(cfg, seed))
            if duration is not None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(duration):
                        await stop.wait()
            else:
                await stop.wait()
            schedulers.cancel()
            await asyncio.gather(schedulers, return_exceptions=True)
            # Let the releases the schedulers sent on their way out be decided, so the
            # demo leaves no retained lease behind on a shared MQTT server.
            released = asyncio.Event()
            daemon.broker.observers.append(
                lambda *_: None if daemon.book.active() else released.set())
            if not daemon.book.active():
                released.set()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(3):
                    await released.wait()
            stop.set()


async def _schedulers(cfg: Config, seed: int) -> None:
    topics = Topics(cfg.mqtt.topic_prefix)
    rng = random.Random(seed)
    leases: dict[str, tuple[str, float]] = {}  # lease_id -> (scheduler, release_at)
    host, port = cfg.mqtt.host, cfg.mqtt.port
    # Client ids are unique per process: a server kicks off the older of two clients
    # with one id, so two demos on one server would end each other's sessions.
    async with aiomqtt.Client(host, port, identifier=f"demo-schedulers-{uuid.uuid4().hex[:12]}"
                              ) as client:
        await client.subscribe(f"{topics.prefix}/events/+/+", qos=1)
        loop = asyncio.get_running_loop()

        async def printer() -> None:
            async for msg in client.messages:
                event = json.loads(msg.payload)
                line = describe(event)
                kind = event["type"]
                d = event["data"]
                if kind.endswith("placement.decided.v1") and "state" not in d:
                    leases[d["lease_id"]] = (str(msg.topic).split("/")[-2],
                                             loop.time() + rng.uniform(8, 40))
                elif kind.endswith(("lease.released.v1", "lease.expired.v1",
                                    "lease.failed.v1")):
                    leases.pop(d["lease_id"], None)
                print(line, flush=True)

        async def sender() -> None:
            n = 0
            while True:
                n += 1
                sched = rng.choice(SCHEDULERS)
                body: dict[str, Any] = {"request_id": f"job-{n}", **rng.choice(WORKLOADS),
                                        "lease_seconds": LEASE_SECONDS,
                                        "duration_hours": rng.choice([1, 6, 24])}
                if n % 17 == 0:
                    body = {"request_id": f"job-{n}", "gpu": "H100-80GB", "gpus": "eight"}
                await client.publish(f"{topics.prefix}/requests/{sched}/place",
                                     json.dumps(body), qos=1)
                now = loop.time()
                for lease_id, (owner, release_at) in list(leases.items()):
                    if now >= release_at:
                        leases.pop(lease_id)
                        if rng.random() < 0.8:
                            await client.publish(f"{topics.prefix}/requests/{owner}/release",
                                                 json.dumps({"lease_id": lease_id}), qos=1)
                        # else: stop renewing and let it expire
                    elif rng.random() < 0.15:
                        await client.publish(f"{topics.prefix}/requests/{owner}/renew",
                                             json.dumps({"lease_id": lease_id}), qos=1)
                await asyncio.sleep(rng.uniform(0.5, 1.5))

        printing = asyncio.create_task(printer())
        try:
            await sender()
        finally:
            for lease_id, (owner, _) in list(leases.items()):
                with contextlib.suppress(aiomqtt.MqttError):
                    await client.publish(f"{topics.prefix}/requests/{owner}/release",
                                         json.dumps({"lease_id": lease_id}), qos=1)
            printing.cancel()
            await asyncio.gather(printing, return_exceptions=True)


def _where(p: dict[str, Any]) -> str:
    return (f"{p['total_gpus']}×{p['gpu']} {p['cloud']}/{p['zone']} {p['instance_type']} "
            f"{p['market']} ${p['price_per_gpu_hour']:.3f}/GPU-h")


def describe(event: dict[str, Any]) -> str:
    """One readable line per event."""
    kind = event["type"].removeprefix("gpubroker.").removesuffix(".v1")
    d = event["data"]
    t = event["time"][11:19]
    if kind == "placement.decided":
        tag = "PLACED  " if "state" not in d and not d["reason"].startswith("repeated") \
            else "AGAIN   "
        return f"{t} {tag} {d['request_id']:<8} {_where(d['placement'])}  {d['lease_id'][:12]}"
    if kind == "placement.rejected":
        return f"{t} REJECTED {d['request_id']:<8} {d['code']}: {d['detail']}"
    if kind == "lease.failover":
        return (f"{t} FAILOVER {d['lease_id'][:12]} epoch {d['epoch']} ({d['reason']}): "
                f"{d['from']['cloud']}/{d['from']['zone']} → {_where(d['to'])}")
    if kind == "lease.failed":
        return f"{t} FAILED   {d['lease_id'][:12]} {d['reason']}: {d['detail']}"
    if kind == "request.invalid":
        errs = "; ".join(f"{e['field']}: {e['message']}" for e in d["errors"])
        return f"{t} INVALID  {d.get('request_id', '?'):<8} {errs}"
    if kind in ("lease.renewed", "lease.released", "lease.expired"):
        return f"{t} {kind.split('.')[1].upper():<8} {d['lease_id'][:12]}"
    return f"{t} {kind} {json.dumps(d)}"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run_demo(duration=None, mqtt_url=None, state=None, seed=7))
