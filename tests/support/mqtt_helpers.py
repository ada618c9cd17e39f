"""Real-server test helpers: a mosquitto process per test and an MQTT probe client.

Nothing here mocks MQTT. ``Mosquitto`` runs the real ``mosquitto`` binary on a free
loopback port with its own config, data directory and log under the test's tmp_path;
``MqttProbe`` is a real aiomqtt client that records every message it receives and lets a
test *wait on an event* (a matching message) instead of sleeping.

Importable from any test module as ``from mqtt_helpers import ...`` (pytest puts the
``tests`` directory on ``sys.path`` because ``tests/conftest.py`` lives there and
``tests`` is not a package).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self
from urllib.parse import urlsplit

import aiomqtt
import contract_check
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

MOSQUITTO_CANDIDATES = ("/usr/sbin/mosquitto",)
INSTALL_HINT = (
    "the tests need the real mosquitto MQTT server; .ci/run installs it "
    "(apt-get install -y mosquitto mosquitto-clients)"
)


class MosquittoError(RuntimeError):
    """mosquitto would not start, or died; the message carries its log tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def find_mosquitto() -> str | None:
    for candidate in MOSQUITTO_CANDIDATES:
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("mosquitto")


class Mosquitto:
    """One mosquitto server on 127.0.0.1:<port>, its files under ``workdir``.

    Persistence is on and written on a clean shutdown only (``autosave_interval`` is far
    beyond any test), which makes both restart flavours deterministic:

    * ``stop()`` + ``start()`` — a clean restart: retained messages, persistent sessions
      and their queued QoS>0 messages all survive.
    * ``kill()`` + ``start()`` — a crash: everything since the previous ``start()`` is lost.

    ``start()`` always reuses the same port, so clients configured with ``url`` can
    reconnect to the restarted server.
    """

    host = "127.0.0.1"

    def __init__(
        self,
        workdir: Path,
        port: int | None = None,
        *,
        binary: str | None = None,
        extra_config: str = "",
    ) -> None:
        self.binary = binary or find_mosquitto()
        if self.binary is None:
            raise MosquittoError(f"mosquitto not found ({INSTALL_HINT})")
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.data_dir = workdir / "data"
        self.data_dir.mkdir(exist_ok=True)
        self.config_path = workdir / "mosquitto.conf"
        self.log_path = workdir / "mosquitto.log"
        self.output_path = workdir / "mosquitto.out"  # stdout/stderr, e.g. config errors
        self.extra_config = extra_config
        self._fixed_port = port is not None
        self.port = port if port is not None else free_port(self.host)
        self._proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    # -- addresses ---------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # -- lifecycle -------------------------------------------------------------------
    def _write_config(self) -> None:
        # Root would make mosquitto drop to the "mosquitto" user, who cannot write into
        # pytest's 0700 tmp dirs; run as whoever we are.
        user = pwd.getpwuid(os.geteuid()).pw_name
        self.config_path.write_text("\n".join([
            f"listener {self.port} {self.host}",
            "allow_anonymous true",
            f"user {user}",
            *self._persistence_config(),
            f"log_dest file {self.log_path}",
            *(f"log_type {t}" for t in self._log_types()),
            "log_timestamp true",
            "log_timestamp_format %H:%M:%S",
            "connection_messages true",
            "set_tcp_nodelay true",
            self.extra_config,
            "",
        ]))

    def _persistence_config(self) -> list[str]:
        """Saved on a clean shutdown only (see the class docstring)."""
        return ["persistence true", f"persistence_location {self.data_dir}/",
                "autosave_interval 86400", "autosave_on_changes false"]

    def _log_types(self) -> list[str]:
        return ["all"]

    def start(self, timeout: float = 10.0) -> None:
        """Start (or restart) the server on ``self.port``; return once it accepts TCP."""
        if self.running:
            raise MosquittoError(f"mosquitto already running on port {self.port}")
        attempts = 1 if (self._fixed_port or self.starts) else 3
        for attempt in range(attempts):
            try:
                self._spawn_and_wait(timeout)
                break
            except MosquittoError:
                # First start on a kernel-picked port: someone else may have taken the
                # port between free_port() and bind(); pick another and retry.
                if attempt + 1 == attempts or "Address already in use" not in self.log_tail():
                    raise
                self.port = free_port(self.host)
        self.starts += 1

    def _spawn_and_wait(self, timeout: float) -> None:
        self._write_config()
        with self.output_path.open("ab") as out:
            self._proc = subprocess.Popen(
                [str(self.binary), "-c", str(self.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C in the terminal is for pytest only
            )
        deadline = time.monotonic() + timeout
        # Readiness probe: connect() until the listener answers, bounded by a deadline.
        # The short wait on the process between attempts doubles as death detection.
        while True:
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    return
            except OSError:
                pass
            try:
                rc = self._proc.wait(timeout=0.02)
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    self.kill()
                    raise MosquittoError(
                        f"mosquitto did not accept connections on {self.host}:{self.port} "
                        f"within {timeout}s\n{self.log_tail()}"
                    ) from None
            else:
                self._proc = None
                raise MosquittoError(
                    f"mosquitto exited with code {rc} on start (port {self.port})\n"
                    f"{self.log_tail()}"
                )

    def stop(self, timeout: float = 10.0) -> None:
        """Clean shutdown (SIGTERM): mosquitto writes its persistence file and exits."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise MosquittoError(
                    f"mosquitto ignored SIGTERM for {timeout}s; killed\n{self.log_tail()}"
                ) from None

    def kill(self) -> None:
        """Crash (SIGKILL): nothing is saved since the last clean start."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    # Async variants, for tests whose code under test runs on the same event loop and
    # must keep running (e.g. notice the disconnect) while the server goes down / up.
    async def astop(self) -> None:
        await asyncio.to_thread(self.stop)

    async def astart(self) -> None:
        await asyncio.to_thread(self.start)

    async def akill(self) -> None:
        await asyncio.to_thread(self.kill)

    # -- diagnostics ---------------------------------------------------------------
    def log_text(self) -> str:
        parts = []
        for path in (self.output_path, self.log_path):
            if path.exists():
                parts.append(path.read_text(errors="replace"))
        return "".join(parts)

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_text().splitlines()[-lines:]
        return "--- mosquitto log (tail) ---\n" + "\n".join(text)

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<Mosquitto {self.url} {state} pid={self.pid}>"


# --------------------------------------------------------------------------------------
# MQTT probe
# --------------------------------------------------------------------------------------

Predicate = Callable[[aiomqtt.Message], bool] | str
Payload = dict[str, Any] | list[Any] | str | bytes | bytearray | None


def parse_mqtt_url(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme != "mqtt":
        raise ValueError(f"MqttProbe speaks plain mqtt:// only, got {url!r}")
    return parts.hostname or "127.0.0.1", parts.port or 1883


def payload_json(message: aiomqtt.Message) -> Any:
    """The message payload decoded as JSON; ``None`` for an empty payload."""
    raw = message.payload
    if raw is None or raw == b"":
        return None
    if isinstance(raw, bytes | bytearray):
        raw = raw.decode()
    return json.loads(raw)  # type: ignore[arg-type]


def encode_payload(payload: Payload) -> bytes:
    if payload is None:
        return b""
    if isinstance(payload, bytes | bytearray):
        return bytes(payload)
    if isinstance(payload, str):
        return payload.encode()
    return json.dumps(payload, separators=(",", ":")).encode()


def publish_properties(**values: Any) -> Properties:
    """MQTT 5 PUBLISH properties: ``publish_properties(ResponseTopic="a/b",
    CorrelationData=b"x", MessageExpiryInterval=30)``."""
    props = Properties(PacketTypes.PUBLISH)
    for name, value in values.items():
        setattr(props, name, value)
    return props


def _matcher(predicate: Predicate) -> Callable[[aiomqtt.Message], bool]:
    if isinstance(predicate, str):
        wildcard = predicate
        return lambda m: m.topic.matches(wildcard)
    return predicate


class MqttProbe:
    """A real MQTT client that subscribes and records everything it receives.

    ::

        async with MqttProbe(mosquitto.url, ["gpubroker/v1/#"], protocol=5) as probe:
            await probe.publish("gpubroker/v1/requests/s1/place", {"request_id": "r1"})
            msg = await probe.wait_for("gpubroker/v1/events/s1/#")
            event = payload_json(msg)

    ``persistent=True`` uses a fixed client id and a session that outlives the
    connection (3.1.1 clean_session=False; 5 clean_start=False + SessionExpiryInterval),
    so after ``await probe.reconnect()`` the server delivers the QoS 1 messages it queued
    meanwhile. ``messages`` keeps growing across reconnects.

    Every message received on one of the daemon's topics is checked against the published
    contract (``tests/support/contract_check.py``); what breaks it fails the test — at the next
    ``wait_for`` / ``wait_for_count`` or at ``close()`` — with ``ContractViolation``.
    Messages published through an ``MqttProbe`` are not checked; ``check_contract=False``
    turns the check off for this client.
    """

    def __init__(
        self,
        url: str,
        topics: Iterable[str] = ("#",),
        *,
        protocol: int | str | aiomqtt.ProtocolVersion = 5,
        qos: int = 1,
        client_id: str | None = None,
        persistent: bool = False,
        timeout: float = 5.0,
        check_contract: bool = True,
    ) -> None:
        self.url = url
        self.host, self.port = parse_mqtt_url(url)
        self.topics = list(topics)
        if isinstance(protocol, aiomqtt.ProtocolVersion):
            self.protocol = protocol
        elif protocol in (5, "5"):
            self.protocol = aiomqtt.ProtocolVersion.V5
        elif protocol in (311, "311", "3.1.1"):
            self.protocol = aiomqtt.ProtocolVersion.V311
        else:
            raise ValueError(f"protocol must be 5 or '3.1.1', got {protocol!r}")
        self.qos = qos
        self.client_id = client_id or f"probe-{uuid.uuid4().hex[:10]}"
        self.persistent = persistent
        self.timeout = timeout
        self.messages: list[aiomqtt.Message] = []
        self.received_at: list[float] = []  # time.monotonic() of each of `messages`
        self.check_contract = check_contract
        self.contract_errors: list[str] = []
        self._reported = 0  # contract errors raised already
        self.disconnect_error: BaseException | None = None
        self._client: aiomqtt.Client | None = None
        self._reader: asyncio.Task[None] | None = None
        self._cond: asyncio.Condition | None = None

    # -- connection ---------------------------------------------------------------
    @property
    def client(self) -> aiomqtt.Client:
        if self._client is None:
            raise RuntimeError("MqttProbe is not connected (use `async with`)")
        return self._client

    @property
    def connected(self) -> bool:
        return self._reader is not None and not self._reader.done()

    def _new_client(self) -> aiomqtt.Client:
        kwargs: dict[str, Any] = {}
        if self.protocol == aiomqtt.ProtocolVersion.V5:
            if self.persistent:
                kwargs["clean_start"] = False
                props = Properties(PacketTypes.CONNECT)
                props.SessionExpiryInterval = 3600
                kwargs["properties"] = props
            else:
                kwargs["clean_start"] = True
        else:
            kwargs["clean_session"] = not self.persistent
        return aiomqtt.Client(
            self.host,
            self.port,
            identifier=self.client_id,
            protocol=self.protocol,
            timeout=self.timeout,
            **kwargs,
        )

    async def connect(self) -> None:
        if self._cond is None:
            self._cond = asyncio.Condition()
        if self.connected:
            raise RuntimeError("MqttProbe already connected")
        client = self._new_client()
        await client.__aenter__()
        self._client = client
        self.disconnect_error = None
        try:
            if self.topics:
                await client.subscribe([(t, self.qos) for t in self.topics])
        except BaseException:
            await self._close()
            raise
        self._reader = asyncio.create_task(self._read(client), name=f"{self.client_id}-reader")

    async def close(self) -> None:
        """Disconnect cleanly (a no-op on a connection the server already dropped); then
        raise ``ContractViolation`` for contract errors no wait reported."""
        await self._close()
        self.raise_contract_errors()

    async def _close(self) -> None:
        reader, self._reader = self._reader, None
        client, self._client = self._client, None
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        if client is not None:
            with contextlib.suppress(aiomqtt.MqttError):
                await client.__aexit__(None, None, None)

    async def reconnect(self) -> None:
        """Drop the connection (if any) and connect again with the same client id."""
        await self._close()
        await self.connect()

    async def wait_disconnected(
        self,
        timeout: float | None = None,
    ) -> BaseException | None:
        """Wait until the server drops us (e.g. it was stopped); return the error."""
        if self._reader is None:
            return self.disconnect_error
        async with asyncio.timeout(self.timeout if timeout is None else timeout):
            await asyncio.shield(self._reader)
        return self.disconnect_error

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _read(self, client: aiomqtt.Client) -> None:
        assert self._cond is not None
        try:
            async for message in client.messages:
                self.messages.append(message)
                self.received_at.append(time.monotonic())
                if self.check_contract:
                    self._check_contract(message)
                async with self._cond:
                    self._cond.notify_all()
        except aiomqtt.MqttError as exc:
            self.disconnect_error = exc
            async with self._cond:
                self._cond.notify_all()

    # -- publishing ---------------------------------------------------------------
    async def publish(
        self,
        topic: str,
        payload: Payload = None,
        *,
        qos: int = 1,
        retain: bool = False,
        properties: Properties | None = None,
    ) -> None:
        """Publish; with QoS 1 this returns after the server's PUBACK."""
        data = encode_payload(payload)
        contract_check.note_published(topic, data)
        await self.client.publish(topic, data, qos=qos, retain=retain, properties=properties)

    # -- waiting ----------------------------------------------------------------------
    def mark(self) -> int:
        """The current message count; pass it as ``since=`` to wait only for newer ones."""
        return len(self.messages)

    def matching(self, predicate: Predicate, *, since: int = 0) -> list[aiomqtt.Message]:
        match = _matcher(predicate)
        return [m for m in self.messages[since:] if match(m)]

    def topics_seen(self) -> list[str]:
        return [m.topic.value for m in self.messages]

    async def wait_for(
        self,
        predicate: Predicate,
        timeout: float = 5.0,
        *,
        since: int = 0,
    ) -> aiomqtt.Message:
        """The first recorded message (from index ``since``) that matches.

        ``predicate`` is a callable on ``aiomqtt.Message`` or a topic filter string
        (``+``/``#`` wildcards). Messages already received count. Raises
        ``TimeoutError`` listing what was seen if nothing matches within ``timeout``.
        """
        match = _matcher(predicate)
        if self._cond is None:
            raise RuntimeError("MqttProbe was never connected")
        checked = since
        try:
            async with asyncio.timeout(timeout), self._cond:
                while True:
                    for message in self.messages[checked:]:
                        if match(message):
                            self.raise_contract_errors()
                            return message
                    checked = max(checked, len(self.messages))
                    await self._cond.wait()
        except TimeoutError:
            raise TimeoutError(self._describe_miss(predicate, timeout, since)) from None

    async def wait_for_count(
        self,
        predicate: Predicate,
        count: int,
        timeout: float = 5.0,
        *,
        since: int = 0,
    ) -> list[aiomqtt.Message]:
        """Wait until ``count`` recorded messages match; return all matches so far."""
        match = _matcher(predicate)
        if self._cond is None:
            raise RuntimeError("MqttProbe was never connected")
        try:
            async with asyncio.timeout(timeout), self._cond:
                while True:
                    found = [m for m in self.messages[since:] if match(m)]
                    if len(found) >= count:
                        self.raise_contract_errors()
                        return found
                    await self._cond.wait()
        except TimeoutError:
            raise TimeoutError(
                f"wanted {count} matches; " + self._describe_miss(predicate, timeout, since)
            ) from None

    # -- the contract check (tests/support/contract_check.py) -----------------------------------
    def _check_contract(self, message: aiomqtt.Message) -> None:
        raw = message.payload
        if isinstance(raw, str):
            raw = raw.encode()
        data = bytes(raw) if isinstance(raw, bytes | bytearray) else str(raw or "").encode()
        error = contract_check.check(message.topic.value, data)
        if error is not None:
            self.contract_errors.append(error)

    def raise_contract_errors(self) -> None:
        """Raise ``ContractViolation`` for the contract errors not raised yet."""
        new = self.contract_errors[self._reported:]
        self._reported = len(self.contract_errors)
        if new:
            raise ContractViolation(self.client_id, new)

    def _describe_miss(self, predicate: Predicate, timeout: float, since: int) -> str:
        what = (
            repr(predicate)
            if isinstance(predicate, str)
            else getattr(predicate, "__name__", repr(predicate))
        )
        seen = self.topics_seen()[since:]
        shown = _summarise_topics(seen)
        state = "connected" if self.connected else f"DISCONNECTED ({self.disconnect_error})"
        return (
            f"no message matching {what} within {timeout}s on {self.url} "
            f"(probe {self.client_id}, {state}, subscribed to {self.topics}); "
            f"{len(seen)} message(s) seen since index {since}: {shown}"
        )


class ContractViolation(AssertionError):
    """A message from the daemon that does not follow the published contract."""

    def __init__(self, client_id: str, errors: Sequence[str]) -> None:
        super().__init__(
            f"{len(errors)} message(s) received by {client_id} break the published "
            "contract (docs/contract.md; the schemas in docs/schemas/ are generated from "
            "broker/wire/payloads.py by `python -m broker.wire.contract`):\n" + "\n".join(errors))


# What the ``probe_factory`` fixture yields: ``await probe_factory(topics, **MqttProbe kw)``.
ProbeFactory = Callable[..., Awaitable[MqttProbe]]


def _summarise_topics(topics: Sequence[str], limit: int = 20) -> str:
    if not topics:
        return "none"
    counts: dict[str, int] = {}
    for t in topics:
        counts[t] = counts.get(t, 0) + 1
    items = [f"{t} x{n}" if n > 1 else t for t, n in counts.items()]
    more = f" ... and {len(items) - limit} more topics" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more
