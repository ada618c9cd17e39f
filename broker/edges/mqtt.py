"""The MQTT client as the bus uses it: made with the configured server, credentials,
TLS and MQTT 5 properties (`make_client`); incoming QoS 1 messages acknowledged in
order once done (`Acks`); and what a session's end needs (`drop`, `settle`, `describe`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import ssl
from collections import deque
from collections.abc import Callable
from typing import Any

import aiomqtt
import structlog
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from broker.daemon.config import MqttConfig
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
round trip every few requests), and far below the 20,000 messages aiomqtt's queue holds.
It replaces mosquitto's `max_inflight_messages` (default 20) for this connection."""
INCOMING_QOS0 = 20_000
"""At most this many QoS 0 messages wait in the client's incoming queue (more are
dropped, as QoS 0 allows). Under manual acknowledgement QoS 1 messages are never dropped
there: the Receive Maximum bounds them instead (see `_IncomingQueue`)."""


class _LateAck(logging.Filter):
    """aiomqtt logs an error with a traceback when an acknowledgement (SUBACK, UNSUBACK,
    PUBACK) arrives for a call that was already cancelled or timed out, which happens
    whenever a task is cancelled mid-call (a standby elected while it subscribes, a
    shutdown). Nothing is wrong then: the record becomes a debug line without the
    traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("Unexpected message ID"):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            record.exc_info = record.exc_text = None
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


logging.getLogger("mqtt").addFilter(_LateAck())


class _IncomingQueue(asyncio.Queue[aiomqtt.Message]):
    """aiomqtt's incoming queue for a client that acknowledges by hand: unbounded for
    QoS 1 messages (the Receive Maximum bounds those), `maxsize` for QoS 0 ones (aiomqtt
    drops a message the queue refuses). With one bound for both, a flood of QoS 0
    messages could make it drop a QoS 1 request, which would then never be acknowledged
    and would hold back the acknowledgement of every later request."""

    def __init__(self, maxsize: int = 0) -> None:
        super().__init__()
        self._qos0_limit = maxsize if maxsize > 0 else INCOMING_QOS0
        self._qos0 = 0

    def put_nowait(self, item: aiomqtt.Message) -> None:
        if item.qos == 0:
            if self._qos0 >= self._qos0_limit:
                raise asyncio.QueueFull
            self._qos0 += 1
        super().put_nowait(item)

    def get_nowait(self) -> aiomqtt.Message:
        item = super().get_nowait()  # asyncio.Queue.get() ends in get_nowait() too
        if item.qos == 0:
            self._qos0 -= 1
        return item


def make_client(cfg: MqttConfig, client_id: str, *, will: aiomqtt.Will | None = None,
                session: bool = True, manual_ack: bool = False,
                receive_maximum: int = RECEIVE_MAXIMUM) -> aiomqtt.Client:
    """An MQTT client with the configured server, credentials and TLS. `session`: a
    persistent session (requests sent while the daemon is away wait for it), unless
    `mqtt.session_expiry_seconds` is 0: then none is kept, on either version.

    `manual_ack` (MQTT 5 only): incoming QoS 1 messages are not acknowledged on receipt,
    the caller acknowledges each (`Acks`), and the client announces `receive_maximum`
    so that the server holds back what goes beyond it. On MQTT 3.1.1 it is ignored and
    messages are acknowledged on receipt: 3.1.1 has no Receive Maximum, so only the
    server's own settings would bound the unacknowledged messages."""
    password = None
    if cfg.password_file is not None:
        password = files.read_secret(cfg.password_file)  # a regular file, at most 64 KiB
    tls = None
    if cfg.tls:
        tls = ssl.create_default_context(cafile=str(cfg.ca_file) if cfg.ca_file else None)
    props = None
    expiry = cfg.session_expiry_seconds if session else 0
    clean = expiry == 0
    kwargs: dict[str, Any] = {}
    v5 = cfg.protocol == "5"
    manual = manual_ack and v5
    if v5:
        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        props.SessionExpiryInterval = expiry
        props.MaximumPacketSize = MAX_PACKET
        if manual:
            props.ReceiveMaximum = receive_maximum
            kwargs["queue_type"] = _IncomingQueue
        kwargs["clean_start"] = clean
    else:
        kwargs["clean_session"] = clean
    client = aiomqtt.Client(
        cfg.host, cfg.port, identifier=client_id, username=cfg.username,
        password=password, tls_context=tls,
        protocol=aiomqtt.ProtocolVersion.V5 if v5 else aiomqtt.ProtocolVersion.V311,
        will=will, keepalive=30, timeout=10, properties=props, max_inflight_messages=256,
        max_queued_incoming_messages=20_000,
        # Small MQTT packets must not wait for Nagle's algorithm and delayed ACKs
        # (about 40 ms each way otherwise).
        socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)], **kwargs)
    if manual:
        # aiomqtt 2.5 has no switch for it; its paho client has.
        client._client.manual_ack_set(True)
    return client


class _Receipt:
    __slots__ = ("done", "mid")

    def __init__(self, mid: int) -> None:
        self.mid = mid
        self.done = False


class Acks:
    """The PUBACKs of one connection under manual acknowledgement. Each QoS 1 message
    gets a receipt when it is taken from the client; its `done` marks it, and every done
    receipt at the head of the line is acknowledged, so PUBACKs go out in the order the
    PUBLISH packets came, as MQTT 5 §4.6 requires: an acknowledgement waits for every
    earlier message of the connection. Once the connection is gone (`close`) nothing is
    acknowledged any more: the server delivers those messages again on the session's
    next connection, and the broker answers a repeated request from its lease book."""

    def __init__(self, client: aiomqtt.Client) -> None:
        self._paho = client._client
        self._line: deque[_Receipt] = deque()
        self._open = True

    @property
    def waiting(self) -> int:
        """Messages taken and not acknowledged yet."""
        return len(self._line)

    def take(self, message: aiomqtt.Message) -> Callable[[], None] | None:
        """The `done` of one message; None for QoS 0 (no PUBACK). QoS 2 does not come:
        the subscription is QoS 1."""
        if message.qos != 1:
            return None
        receipt = _Receipt(message.mid)
        self._line.append(receipt)
        return functools.partial(self._done, receipt)

    def _done(self, receipt: _Receipt) -> None:
        receipt.done = True
        line = self._line
        while self._open and line and line[0].done:
            # On a connection lost meanwhile paho sends nothing (it returns an error
            # code): the message comes again on the next connection.
            self._paho.ack(line.popleft().mid, 1)

    def close(self) -> None:
        self._open = False
        self._line.clear()


class Fenced(aiomqtt.MqttError):
    """This node no longer leads its site: it must not publish (broker.state.leadership)."""


class Unpublishable(Exception):
    """A message no MQTT server would take (a bad topic, a payload over the limit): an
    error of the message, not of the session."""


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


def drop(client: aiomqtt.Client) -> None:
    """Cut the connection without an MQTT DISCONNECT: the server then publishes the
    will (`offline`), as it would after a crash. aiomqtt has no public way to leave
    without a DISCONNECT, hence the reach into its paho client."""
    paho = getattr(client, "_client", None)
    sock = paho.socket() if paho is not None else None
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def settle(client: aiomqtt.Client) -> None:
    """Mark an unexpected-disconnection error as seen. aiomqtt stores it in a future
    that nobody awaits when the session already ended for another reason, and asyncio
    would log "Future exception was never retrieved" for it."""
    fut = getattr(client, "_disconnected", None)
    if isinstance(fut, asyncio.Future) and fut.done() and not fut.cancelled():
        fut.exception()
