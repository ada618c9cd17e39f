"""The MQTT client as the bus uses it, over gmqtt: a `Connection` made with the configured
server, credentials, TLS and MQTT 5 properties (`connect`); publishes that return once
the server acknowledged them; incoming QoS 1 messages acknowledged in order once done
(`Acks`); and what a session's end needs (`Connection.drop`, `Connection.close`,
`describe`).

A `Connection` is one network connection: gmqtt never reconnects it and never sends a
message again by itself (the bus reconnects with a new `Connection`, and its outbox
sends again what was not acknowledged). Why gmqtt and not aiomqtt over paho-mqtt (#31):
about 11 µs of CPU per QoS 1 publish and 19 per received message instead of 65-75 and
46-76 (`bench/mqtt_layer.py`); the bus makes three of those per request."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import ssl
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import gmqtt
import structlog
from gmqtt.mqtt.constants import MQTTv50, MQTTv311

from broker.daemon.config import MqttConfig
from broker.output.ratelimit import Every
from broker.wire.validation import MAX_PACKET
from gpubroker_client import files

log = structlog.get_logger("gpubroker.bus")

RECEIVE_MAXIMUM = 1024
"""The MQTT 5 Receive Maximum the daemon announces: the most requests (QoS 1) the server
sends it that it has not acknowledged yet. Requests are acknowledged once committed, so
this bounds the daemon's whole backlog; the rest waits at the MQTT server, in the
session, where a crash or a takeover does not lose it. 1024 is four batches at the
default `placement.max_batch` (256): enough that a batch is always filling while the one
before is placed and committed (a small window would starve the batching and cost a
round trip every few requests). It replaces mosquitto's `max_inflight_messages`
(default 20) for this connection."""
INCOMING_QOS0 = 20_000
"""At most this many QoS 0 messages wait in a connection's incoming queue (more are
dropped, as QoS 0 allows). QoS 1 messages are never dropped there: under manual
acknowledgement the Receive Maximum bounds them."""
IN_FLIGHT = 256
"""The most QoS 1 publishes of one connection waiting for their PUBACK; fewer if the
server's Receive Maximum (CONNACK) says so. More wait for a slot."""
KEEPALIVE = 30
CONNACK_TIMEOUT = 10.0
"""The longest the server may take to answer CONNECT."""
NO_MQTT5 = ("connection refused: the server does not take MQTT 5 (CONNACK 1, unacceptable "
            "protocol version); set mqtt.protocol to \"3.1.1\" for it")


class MqttError(Exception):
    """The MQTT session failed: the connection was lost or refused, or an acknowledgement
    did not come in time. The bus reconnects."""


class Fenced(MqttError):
    """This node no longer leads its site: it must not publish (broker.state.leadership)."""


class Unpublishable(Exception):
    """A message no MQTT server would take (a bad topic, a payload over the limit): an
    error of the message, not of the session."""


@dataclass(frozen=True, slots=True)
class Will:
    """The message the server publishes when the connection ends without a DISCONNECT."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = False


@dataclass(slots=True)
class Message:
    """One message received. `ack`: under manual acknowledgement, sends the QoS 1
    message's PUBACK (called by `Acks`, in order; nothing once the connection is lost);
    None when there is nothing to acknowledge (QoS 0) or it was acknowledged on
    receipt."""

    topic: str
    payload: bytes
    qos: int
    retain: bool
    response_topic: str | None = None
    correlation_data: bytes | None = None
    ack: Callable[[], None] | None = None


class _QuietEnd(logging.Filter):
    """gmqtt logs a lost connection with a traceback (`[EXC: CONN LOST]`), a PUBACK that
    can no longer be sent (`[TRYING WRITE TO CLOSED SOCKET]`: the connection is gone,
    the server sends the request again on the next one) as a warning, and a refused
    CONNECT as permanent although the bus retries it. The bus says each of those itself,
    in one line: gmqtt's records become debug lines without a traceback."""

    QUIET = ("[EXC: CONN LOST]", "[TRYING WRITE TO CLOSED SOCKET]",
             "[MqttPackageHandler] CONNACK")

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(self.QUIET):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            record.exc_info = record.exc_text = None
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


for _name in ("gmqtt.mqtt.protocol", "gmqtt.mqtt.handler"):
    logging.getLogger(_name).addFilter(_QuietEnd())


class _Client(gmqtt.Client):  # type: ignore[misc]  # gmqtt has no type hints
    """gmqtt's client for one connection. It never reconnects by itself (the bus does,
    with a new client), and its TCP connect and TLS handshake together are bounded by
    `handshake_timeout`, so that CONNECT goes out within that time of the start or never.
    gmqtt 0.8 has no setting for either, nor a public way to read the CONNACK, to close
    without a DISCONNECT or to write several packets at once: this class is where the bus
    reaches into it."""

    handshake_timeout = CONNACK_TIMEOUT
    on_held: Callable[[int, str, bytes, Mapping[str, Any]], None] | None = None
    """Under manual acknowledgement: called with each QoS 1 message and its packet id,
    whose PUBACK the caller sends (`puback`) when it is done with it. gmqtt's own way
    runs the message handler as a task, and sends the PUBACK from its done callback: a
    task, a future and two turns of the event loop per request, and the PUBACK in a
    write of its own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        handler = self._package_handler
        gmqtts = handler._handle_qos_1_publish_packet

        def qos_1(mid: int, packet: bytes, print_topic: str,
                  properties: dict[str, Any]) -> None:
            if handler._optimistic_acknowledgement or self.on_held is None:
                gmqtts(mid, packet, print_topic, properties)
            else:
                self.on_held(mid, print_topic, packet, properties)

        handler._handle_qos_1_publish_packet = qos_1

    def puback(self, mid: int) -> None:
        """Send the PUBACK (reason 0) of the QoS 1 message `mid`."""
        self._package_handler._send_puback(mid)

    async def reconnect(self, delay: bool = False) -> None:
        return None

    async def _create_connection(self, *args: Any, **kwargs: Any) -> Any:
        async with asyncio.timeout(self.handshake_timeout):
            return await super()._create_connection(*args, **kwargs)

    def abort(self) -> None:
        """Close the socket at once, without an MQTT DISCONNECT."""
        connection = self._connection
        if connection is not None:
            connection._transport.abort()

    def leave(self) -> None:
        """Send DISCONNECT and close the socket, without waiting: the server discards the
        will. Nothing if the socket is closed already."""
        connection = self._connection
        if connection is not None and not connection.is_closing():
            connection.send_disconnect()
            connection._transport.close()

    def cork(self, loop: asyncio.AbstractEventLoop) -> None:
        """From now on, what a turn of the event loop sends goes out in one write
        (`_Corked`): gmqtt's connection and protocol write through it."""
        connection = self._connection
        if connection is not None and not isinstance(connection._transport, _Corked):
            corked = _Corked(connection._transport, loop)
            connection._transport = corked
            connection._protocol._transport = corked

    def refusal(self) -> Exception | None:
        """The server's refusal of the CONNECT (a CONNACK with an error), if any."""
        error: Exception | None = self._package_handler._error
        return error

    def refused_mqtt5(self) -> bool:
        """Whether the server answered an MQTT 5 CONNECT with CONNACK 1 (unacceptable
        protocol version: a 3.1.1 server). gmqtt then switches itself to 3.1.1 and asks
        for a reconnect, which this client never makes: the bus says why instead."""
        return bool(self._connection_state.protocol_version == MQTTv311
                    and self._asked_mqtt5)

    _asked_mqtt5 = False

    def server_receive_maximum(self) -> int:
        """The server's Receive Maximum (its CONNACK; 65535 when it sent none)."""
        values = self._package_handler._connack_properties.get("receive_maximum")
        return int(values[0]) if values else 65535


class _Corked:
    """A connection's socket as gmqtt writes to it, with what one turn of the event loop
    sends written at once, at the start of the next: gmqtt writes each packet as it is
    made, a system call per publish and per PUBACK (10 % of the daemon's CPU in a burst
    of requests). In order; `close` sends what is waiting first, `abort` drops it."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._out: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._out:
            self._loop.call_soon(self._flush)
        self._out.append(data)

    def _flush(self) -> None:
        if self._out:
            data, self._out = b"".join(self._out), []
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._out = []
        self._transport.abort()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _Inflight:
    """gmqtt's `persistent_storage` for one connection: gmqtt hands it each QoS 1
    PUBLISH it sends (`push_message`) and removes it on its PUBACK
    (`remove_message_by_mid`), which resolves that publish's future and frees its slot.
    It keeps no packet: gmqtt would send those again on a reconnect of the same client,
    which never happens; the outbox sends again what was not acknowledged."""

    def __init__(self, released: Callable[[], None]) -> None:
        self._waiting: dict[int, asyncio.Future[None]] = {}
        self._released = released
        self.expect: asyncio.Future[None] | None = None
        """The future of the publish being sent: gmqtt pushes its packet next."""

    def push_message(self, mid: int, raw_package: bytes) -> None:
        fut, self.expect = self.expect, None
        if fut is not None:
            self._waiting[mid] = fut

    def remove_message_by_mid(self, mid: int) -> None:
        fut = self._waiting.pop(mid, None)
        if fut is None:
            return
        self._released()
        if not fut.done():
            fut.set_result(None)

    def fail(self, exc: BaseException) -> None:
        waiting, self._waiting = self._waiting, {}
        for fut in waiting.values():
            if not fut.done():
                fut.set_exception(exc)

    @property
    def is_empty(self) -> bool:
        return True  # nothing for gmqtt to send again

    def get_all(self) -> list[tuple[int, bytes]]:
        return []

    async def wait_empty(self) -> None:
        return None

    def clear(self) -> None:
        return None  # a CONNACK without a session: nothing of this connection was sent yet


def check_topic(topic: str) -> bytes:
    """The topic as it goes on the wire; ValueError for one no server takes in a PUBLISH
    (empty, a wildcard, NUL, not UTF-8, over 65535 bytes): the server would end the
    connection, and the message would fail again after every reconnect."""
    raw = topic.encode()  # strict: a lone surrogate raises UnicodeEncodeError
    if not raw:
        raise ValueError("Invalid topic.")
    if b"+" in raw or b"#" in raw:
        raise ValueError("Publish topic cannot contain wildcards.")
    if b"\0" in raw:
        raise ValueError("Publish topic cannot contain NUL.")
    if len(raw) > 65535:
        raise ValueError("Publish topic is too long.")
    return raw


class Connection:
    """One connection to the MQTT server (made by `connect`). A session failure raises
    `MqttError` from whatever waits on it: `messages()` once the messages received
    before it are taken, `publish` and `subscribe` at once."""

    def __init__(self, client_id: str, *, v5: bool, manual_ack: bool, clean: bool,
                 will: Will | None, properties: dict[str, Any]) -> None:
        self.v5 = v5
        self._manual = manual_ack and v5
        self._loop = asyncio.get_running_loop()
        self._error: MqttError | None = None
        self.gone: asyncio.Future[None] = self._loop.create_future()
        """Resolved once the connection is over."""
        self._inbox: deque[Message] = deque()
        self._qos0 = 0
        self._overflow = Every(30.0)
        self._wakeup: asyncio.Future[None] | None = None
        self._subacks: dict[int, asyncio.Future[tuple[int, ...]]] = {}
        self._limit = 1  # set from the CONNACK (`_connected`)
        self._in_flight = 0
        self._slot_waiters: deque[asyncio.Future[None]] = deque()
        self._inflight = _Inflight(self._release_slot)
        client = self._client = _Client(
            client_id, clean_session=clean, optimistic_acknowledgement=not self._manual,
            will_message=None if will is None else gmqtt.Message(
                will.topic, will.payload, qos=will.qos, retain=will.retain),
            persistent_storage=self._inflight, **properties)
        client.on_message = self._on_message_held if self._manual else self._on_message
        if self._manual:
            client.on_held = self._on_qos1_held
        client.on_subscribe = self._on_subscribe
        client.on_disconnect = self._on_disconnect

    # --- the connection ----------------------------------------------------------------

    def _connected(self) -> None:
        # gmqtt's packet ids: at most the server's Receive Maximum less one in use, and
        # one kept for a SUBSCRIBE.
        self._limit = max(1, min(IN_FLIGHT, self._client.server_receive_maximum() - 2))
        self._client.cork(self._loop)

    @property
    def lost(self) -> bool:
        return self._error is not None

    def _lose(self, error: MqttError) -> None:
        """The connection is over: everything waiting on it fails, and no held PUBACK
        is sent any more (`_puback`)."""
        if self._error is not None:
            return
        self._error = error
        self._client.abort()
        if not self.gone.done():
            self.gone.set_result(None)
        self._inflight.fail(error)
        for suback in self._subacks.values():
            if not suback.done():
                suback.set_exception(error)
        self._subacks.clear()
        waiters, self._slot_waiters = self._slot_waiters, deque()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._wake()

    def _on_disconnect(self, _client: Any, packet: Any = None, *_: Any) -> None:
        if isinstance(packet, bytes | bytearray) and packet:
            error = MqttError(f"the MQTT server sent DISCONNECT (reason {packet[0]:#04x})")
        else:
            error = MqttError("the connection to the MQTT server was lost")
        self._lose(error)

    def drop(self) -> None:
        """Cut the connection without an MQTT DISCONNECT: the server then publishes the
        will, as it would after a crash."""
        self._lose(MqttError("the connection was dropped"))

    async def close(self, *, clean: bool = True, timeout: float = 2.0) -> None:
        """Leave the connection: with a DISCONNECT (`clean`, which discards the will) or
        without one (as `drop`). Never raises but a cancellation; bounded in time."""
        try:
            if clean and self._error is None:
                try:
                    async with asyncio.timeout(timeout):
                        await self._client.disconnect()
                except Exception as exc:  # the connection ends below all the same
                    log.debug("mqtt disconnect not clean", error=describe(exc))
        finally:
            self._lose(MqttError("the connection was closed"))

    async def _open(self, cfg: MqttConfig, password: str | None,
                    handshake_timeout: float) -> None:
        client = self._client
        client.handshake_timeout = handshake_timeout
        client._asked_mqtt5 = self.v5
        if cfg.username is not None:
            client.set_auth_credentials(cfg.username, password)
        tls: ssl.SSLContext | bool = False
        if cfg.tls:
            tls = ssl.create_default_context(
                cafile=str(cfg.ca_file) if cfg.ca_file else None)
        attempt = asyncio.ensure_future(client.connect(
            cfg.host, cfg.port, ssl=tls, keepalive=KEEPALIVE,
            version=MQTTv50 if self.v5 else MQTTv311, raise_exc=True))
        try:
            async with asyncio.timeout(handshake_timeout + CONNACK_TIMEOUT):
                await asyncio.wait((attempt, self.gone), return_when=asyncio.FIRST_COMPLETED)
            if not attempt.done():
                refusal = client.refusal()
                if refusal is None and client.refused_mqtt5():
                    raise MqttError(NO_MQTT5)
                raise MqttError(f"connection refused: {refusal}" if refusal is not None
                                else "the connection was lost before its CONNACK")
            try:
                attempt.result()
            except gmqtt.MQTTConnectError as exc:
                raise MqttError(f"connection refused: {exc}") from None
            except TimeoutError:
                raise MqttError(f"no TCP connection and TLS handshake within "
                                f"{handshake_timeout:.2g}s") from None
            if self._error is not None:
                raise self._error
        except BaseException as exc:
            attempt.cancel()
            attempt.add_done_callback(_retrieve)
            # CONNECT may have reached the server (a CONNACK late, or lost on the way):
            # it would publish the will of a connection that never served, after
            # whatever a newer leader published. Leave with a DISCONNECT, as a
            # connection made after the leadership lapsed is left.
            self._client.leave()
            self._lose(MqttError("the connection was given up"))
            if isinstance(exc, TimeoutError):
                raise MqttError(NO_MQTT5 if client.refused_mqtt5() else
                                f"no CONNACK within {CONNACK_TIMEOUT:g}s") from None
            raise
        self._connected()

    # --- receiving -----------------------------------------------------------------------

    def _wake(self) -> None:
        wakeup = self._wakeup
        if wakeup is not None and not wakeup.done():
            wakeup.set_result(None)

    def _message(self, topic: str | bytes, payload: bytes, qos: int,
                 properties: Mapping[str, Any]) -> Message | None:
        if qos == 0:
            if self._qos0 >= INCOMING_QOS0:
                if count := self._overflow.hit():
                    log.warning("incoming queue full: QoS 0 messages dropped", dropped=count)
                return None
            self._qos0 += 1
        if isinstance(topic, bytes):  # not UTF-8: no request topic either
            topic = topic.decode(errors="replace")
        response = properties.get("response_topic")
        correlation = properties.get("correlation_data")
        return Message(topic, payload, qos, bool(properties.get("retain")),
                       response[0] if response else None,
                       bytes(correlation[0]) if correlation else None)

    def _on_message(self, _client: Any, topic: str, payload: bytes, qos: int,
                    properties: Mapping[str, Any]) -> None:
        """Acknowledged on receipt (gmqtt sent the PUBACK before this call)."""
        message = self._message(topic, payload, qos, properties)
        if message is not None:
            self._inbox.append(message)
            self._wake()

    def _on_qos1_held(self, mid: int, topic: str, payload: bytes,
                      properties: Mapping[str, Any]) -> None:
        """Manual acknowledgement of a QoS 1 message (`_Client.on_held`): its PUBACK is
        sent when its `ack` is called (`Acks`, once its request is committed). After the
        end it is not taken, and its PUBACK is not sent: the server sends it again."""
        if self._error is not None:
            return
        message = self._message(topic, payload, 1, properties)
        if message is None:  # not taken: acknowledged at once, as gmqtt would
            self._puback(mid)
            return
        message.ack = functools.partial(self._puback, mid)
        self._inbox.append(message)
        self._wake()

    def _puback(self, mid: int) -> None:
        """Send a held message's PUBACK, unless the connection is over. It is called
        after its request's batch is committed, from the broker's task: a write that
        fails must not end that task, so it is logged and the connection dropped (the
        server sends the message again on the next one)."""
        if self._error is not None:
            return
        try:
            self._client.puback(mid)
        except Exception as exc:
            log.warning("a PUBACK could not be written; dropping the connection",
                        error=f"{type(exc).__name__}: {exc}")
            self._lose(MqttError(f"a PUBACK could not be written: {exc}"))

    async def _on_message_held(self, _client: Any, topic: str, payload: bytes, qos: int,
                               properties: Mapping[str, Any]) -> int:
        """Manual acknowledgement, for what is not QoS 1 (`_on_qos1_held`): gmqtt sends
        the acknowledgement, if any, when this returns."""
        message = self._message(topic, payload, qos, properties)
        if message is not None and self._error is None:
            self._inbox.append(message)
            self._wake()
        return 0

    async def messages(self) -> AsyncIterator[Message]:
        """The messages received, in order; `MqttError` once the connection is lost and
        every message received before was taken."""
        inbox = self._inbox
        while True:
            if inbox:
                message = inbox.popleft()
                if message.qos == 0:
                    self._qos0 -= 1
                yield message
                continue
            if self._error is not None:
                raise self._error
            self._wakeup = self._loop.create_future()
            try:
                await self._wakeup
            finally:
                self._wakeup = None

    # --- subscribing -----------------------------------------------------------------------

    def _on_subscribe(self, _client: Any, mid: int, granted: tuple[int, ...],
                      _properties: Any = None) -> None:
        fut = self._subacks.pop(mid, None)
        if fut is not None and not fut.done():
            fut.set_result(tuple(granted))

    async def subscribe(self, topic: str, *, qos: int = 1, retain_handling: int = 0,
                        retain_as_published: bool = False) -> tuple[int, ...]:
        """Subscribe and wait for the SUBACK: the granted QoS (or reason code). The
        subscribe options beyond the QoS are MQTT 5's."""
        if self._error is not None:
            raise self._error
        sub = gmqtt.Subscription(topic, qos=qos, retain_as_published=retain_as_published,
                                 retain_handling_options=retain_handling)
        fut: asyncio.Future[tuple[int, ...]] = self._loop.create_future()
        self._subacks[self._client.subscribe(sub)] = fut
        return await fut

    # --- publishing -----------------------------------------------------------------------

    def _release_slot(self) -> None:
        """A PUBACK came: its slot passes to the first publish waiting, or is free."""
        while self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._in_flight -= 1

    async def _slot(self) -> None:
        """A slot of the in-flight window, taken in turn: publishes go out in the order
        they were made."""
        if self._in_flight < self._limit and not self._slot_waiters:
            self._in_flight += 1
            return
        waiter: asyncio.Future[None] = self._loop.create_future()
        self._slot_waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter in self._slot_waiters:
                self._slot_waiters.remove(waiter)
            elif self._error is None and waiter.done() and not waiter.cancelled():
                self._release_slot()  # handed over but not used: pass it on
            raise
        if self._error is not None:
            raise self._error

    async def submit(self, topic: str, payload: bytes, *, qos: int = 1,
                     retain: bool = False,
                     properties: Mapping[str, Any] | None = None) -> asyncio.Future[None]:
        """Send a PUBLISH once the in-flight window has a slot for it (at once, mostly),
        and return the future of its PUBACK: resolved when it comes, failed with
        `MqttError` if the connection is lost first (done at once at QoS 0). ValueError
        for a message no server would take (`check_topic`, a payload over 256 MiB);
        `MqttError` once the connection is lost. `properties`: MQTT 5 ones, in gmqtt's
        names (`correlation_data`, `message_expiry_interval`); ignored on 3.1.1."""
        raw_topic = check_topic(topic)
        if self._error is not None:
            raise self._error
        props = properties if properties and self.v5 else {}
        fut: asyncio.Future[None] = self._loop.create_future()
        if qos == 0:
            self._client.publish(raw_topic, payload, qos=0, retain=retain, **props)
            fut.set_result(None)
            return fut
        await self._slot()
        self._inflight.expect = fut
        try:
            self._client.publish(raw_topic, payload, qos=qos, retain=retain, **props)
        except BaseException:
            self._inflight.expect = None
            self._release_slot()
            raise
        return fut

    async def publish(self, topic: str, payload: bytes, *, qos: int = 1,
                      retain: bool = False,
                      properties: Mapping[str, Any] | None = None) -> None:
        """`submit`, then wait for the PUBACK (at QoS 1)."""
        await (await self.submit(topic, payload, qos=qos, retain=retain,
                                 properties=properties))


async def connect(cfg: MqttConfig, client_id: str, *, will: Will | None = None,
                  session: bool = True, manual_ack: bool = False,
                  receive_maximum: int = RECEIVE_MAXIMUM,
                  handshake_timeout: float = CONNACK_TIMEOUT) -> Connection:
    """A connection to the configured server, with its credentials and TLS. `session`: a
    persistent session (requests sent while the daemon is away wait for it), unless
    `mqtt.session_expiry_seconds` is 0: then none is kept, on either version.

    `manual_ack` (MQTT 5 only): incoming QoS 1 messages are not acknowledged on receipt,
    the caller acknowledges each (`Acks`), and the client announces `receive_maximum`
    so that the server holds back what goes beyond it. On MQTT 3.1.1 it is ignored and
    messages are acknowledged on receipt: 3.1.1 has no Receive Maximum, so only the
    server's own settings would bound the unacknowledged messages.

    The TCP connect and the TLS handshake take at most `handshake_timeout` together,
    the CONNACK at most `CONNACK_TIMEOUT` more. `MqttError` for a refused connection or
    one lost before its CONNACK, OSError for a server that cannot be reached."""
    password = None
    if cfg.password_file is not None:
        password = files.read_secret(cfg.password_file)  # a regular file, at most 64 KiB
    expiry = cfg.session_expiry_seconds if session else 0
    v5 = cfg.protocol == "5"
    props: dict[str, Any] = {}
    if v5:
        props = {"session_expiry_interval": expiry, "maximum_packet_size": MAX_PACKET}
        if manual_ack:
            props["receive_maximum"] = receive_maximum
    conn = Connection(client_id, v5=v5, manual_ack=manual_ack, clean=expiry == 0,
                      will=will, properties=props)
    await conn._open(cfg, password, handshake_timeout)
    return conn


def _retrieve(task: asyncio.Future[None]) -> None:
    if not task.cancelled():
        task.exception()


@contextlib.asynccontextmanager
async def connected(cfg: MqttConfig, client_id: str, **kwargs: Any
                    ) -> AsyncIterator[Connection]:
    """`connect`, and a clean disconnect on the way out."""
    conn = await connect(cfg, client_id, **kwargs)
    try:
        yield conn
    finally:
        await conn.close()


class _Receipt:
    __slots__ = ("ack", "done")

    def __init__(self, ack: Callable[[], None]) -> None:
        self.ack = ack
        self.done = False


class Acks:
    """The PUBACKs of one connection under manual acknowledgement. Each QoS 1 message
    gets a receipt when it is taken from the connection; its `done` marks it, and every
    done receipt at the head of the line is acknowledged, so PUBACKs go out in the order
    the PUBLISH packets came, as MQTT 5 §4.6 requires: an acknowledgement waits for every
    earlier message of the connection. Once the connection is gone (`close`) nothing is
    acknowledged any more: the server delivers those messages again on the session's
    next connection, and the broker answers a repeated request from its lease book."""

    def __init__(self) -> None:
        self._line: deque[_Receipt] = deque()
        self._open = True

    @property
    def waiting(self) -> int:
        """Messages taken and not acknowledged yet."""
        return len(self._line)

    def take(self, message: Message) -> Callable[[], None] | None:
        """The `done` of one message; None when it has no PUBACK to hold (QoS 0, or
        acknowledged on receipt). QoS 2 does not come: the subscription is QoS 1."""
        if message.ack is None:
            return None
        receipt = _Receipt(message.ack)
        self._line.append(receipt)
        return lambda: self._done(receipt)

    def _done(self, receipt: _Receipt) -> None:
        receipt.done = True
        line = self._line
        while self._open and line and line[0].done:
            # On a connection lost meanwhile nothing is sent, and the message comes again.
            line.popleft().ack()

    def close(self) -> None:
        self._open = False
        self._line.clear()


def stopping() -> bool:
    """Whether the current task was asked to stop (a cancellation is pending or being
    handled): then a session error raised on the way out must not start a reconnect."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def only(exc: BaseException, kinds: tuple[type[BaseException], ...]) -> bool:
    """Whether `exc`, or every leaf of it when it is an exception group (nested to any
    depth), is one of `kinds`."""
    if isinstance(exc, BaseExceptionGroup):
        return all(only(e, kinds) for e in exc.exceptions)
    return isinstance(exc, kinds)


def describe(exc: BaseException) -> str:
    """One line for the log: the first leaf of an exception group, and how many more."""
    leaves: list[BaseException] = []
    todo = [exc]
    while todo:
        e = todo.pop()
        if isinstance(e, BaseExceptionGroup):
            todo.extend(reversed(e.exceptions))
        else:
            leaves.append(e)
    if not leaves:
        return type(exc).__name__
    first = f"{type(leaves[0]).__name__}: {leaves[0]}"
    return first if len(leaves) == 1 else f"{first} (and {len(leaves) - 1} more)"
