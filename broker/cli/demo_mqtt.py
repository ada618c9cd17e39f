"""The MQTT server `gpubroker demo` uses (the one given, one on 127.0.0.1:1883, or an
embedded one), and the sweep of the retained messages under its prefix at the end."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiomqtt

from gpubroker_client import parse_mqtt_url

SWEEP_TIMEOUT = 3.0


class DemoError(Exception):
    """A failure told in one line; exit code 1."""


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _retained(client: aiomqtt.Client, prefix: str) -> set[str]:
    """The topics under `prefix` that hold a retained message now. The server sends them
    on subscribe, before a message published afterwards on the same connection (the
    marker), so the marker ends the list."""
    marker = f"{prefix}/sweep/{uuid.uuid4().hex}"
    await client.subscribe(f"{prefix}/#", qos=1)
    await client.publish(marker, b"end", qos=1)
    found = set()
    async for message in client.messages:
        topic = str(message.topic)
        if topic == marker:
            break
        if message.retain and message.payload:
            found.add(topic)
    await client.unsubscribe(f"{prefix}/#")
    return found


def one_line(exc: BaseException | None) -> str:
    if exc is None:
        return "cancelled"
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(one_line(e) for e in exc.exceptions[:3])
    text = " ".join(str(exc).split())
    return f"{text}" if text else type(exc).__name__


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _answers(host: str, port: int) -> bool:
    try:
        async with asyncio.timeout(0.5):
            _, writer = await asyncio.open_connection(host, port)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


@contextlib.asynccontextmanager
async def mqtt_server(url: str | None) -> AsyncIterator[tuple[str, bool]]:
    """(url, embedded) of the MQTT server to use: `url`, else 127.0.0.1:1883 if something
    answers there, else an embedded one (amqtt) on a free port."""
    if url is not None:
        yield url, False
        return
    if await _answers("127.0.0.1", 1883):
        yield "mqtt://127.0.0.1:1883", False
        return
    try:
        from amqtt.broker import Broker
    except ModuleNotFoundError:
        raise DemoError("no MQTT server on 127.0.0.1:1883, and the embedded one needs "
                        "amqtt: pip install 'gpubroker[demo]' (or give --mqtt HOST:PORT)"
                        ) from None
    port = free_port()
    server = Broker({"listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{port}"}},
                     "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin":
                                 {"allow_anonymous": True}}})
    await server.start()
    print(f"no MQTT server on 127.0.0.1:1883: started an embedded one on 127.0.0.1:{port} "
          "(MQTT 3.1.1)", flush=True)
    try:
        yield f"mqtt://127.0.0.1:{port}", True
    finally:
        await server.shutdown()


def mqtt_client(url: str, protocol: str, role: str) -> aiomqtt.Client:
    """A clean-session client of the demo's own (`role` names it)."""
    host, port, tls = parse_mqtt_url(url)
    v5 = protocol == "5"
    session: dict[str, Any] = {"clean_start": True} if v5 else {"clean_session": True}
    client = aiomqtt.Client(
        host, port, identifier=f"gpubroker-demo-{role}-{uuid.uuid4().hex[:12]}",
        protocol=aiomqtt.ProtocolVersion.V5 if v5 else aiomqtt.ProtocolVersion.V311,
        tls_context=ssl.create_default_context() if tls else None, timeout=2,
        max_inflight_messages=256, **session)
    client.pending_calls_threshold = 100_000  # a sweep publishes them all at once
    return client


async def sweep(url: str, protocol: str, prefix: str) -> tuple[int, int, str | None]:
    """Clear every retained message under the demo's `prefix` (its status, capacity
    summaries and any lease state left): (cleared, still there, error)."""
    try:
        async with asyncio.timeout(SWEEP_TIMEOUT):
            async with mqtt_client(url, protocol, "sweep") as client:
                found = await _retained(client, prefix)
                await asyncio.gather(*(client.publish(topic, b"", qos=1, retain=True)
                                       for topic in found))
                left = await _retained(client, prefix)
    except (aiomqtt.MqttError, OSError, TimeoutError) as exc:
        return 0, 0, one_line(exc) or "no answer"
    return len(found), len(left), None
