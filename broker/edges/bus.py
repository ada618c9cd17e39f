"""MQTT in and out: the request topics, the durable outbox, status and capacity.

One connection, kept up by a reconnect loop with jittered exponential backoff. The MQTT
will publishes `offline` on `P/status` if the daemon dies; `online` is published,
retained, on every connect.

Outgoing events and lease states come from the outbox: rows are committed to SQLite
before they reach the bus, published with QoS 1, and deleted only once the MQTT server
acknowledged them. After a reconnect (or a restart) every row not yet acknowledged is
sent again, in order, byte-for-byte the same; subscribers drop duplicates by `id`.

Incoming messages on `P/requests/S/<verb>` become `Command`s for the broker; retained
ones are ignored (never act on stale commands). Nothing a scheduler needs lives only in
MQTT 5 properties: the 5-only extras are replies to ResponseTopic and message expiry.

On MQTT 5 an incoming request is acknowledged (PUBACK) only once its outcome is
committed (`Command.done`), in the order the requests came, and the daemon announces a
Receive Maximum: a request received before a crash, a takeover or a lost connection is
not lost but delivered again, and the backlog waits at the MQTT server, not in the
daemon. On MQTT 3.1.1 requests are acknowledged on receipt (paho's default).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import random
import socket
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import datetime
from typing import Any

import aiomqtt
import structlog
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from broker import __version__
from broker.daemon.config import MqttConfig
from broker.model import SCHEDULER_ID, iso, utcnow
from broker.output.ratelimit import Every
from broker.state.store import Store
from broker.wire.commands import OPS, Command
from broker.wire.messages import OutboxRow, Topics, dumps
from broker.wire.validation import MAX_PACKET
from gpubroker_client import files

log = structlog.get_logger("gpubroker.bus")

RESTORE_WINDOW = 64
RESTORE_YIELD_EVERY = 32

RetainedRead = Callable[[], Awaitable[bytes | None]]
RetainedSource = Callable[[], Iterable[tuple[str, RetainedRead, int | None]]]
"""What the retained topics should hold: (topic, read, message expiry seconds or None).
`read()` returns the payload as it is when the message is sent (None: nothing to send)
and must not yield to the event loop after reading, so that the read and the publish
are one step: a newer state committed meanwhile is always published after it."""
ACK_BATCH = 512
ACK_COALESCE_SECONDS = 0.05
CONNECT_TIMEOUT = 10.0
"""The longest a connection to the MQTT server may take to make (TCP, TLS, CONNACK)."""
CONNECT_MARGIN = 0.25
"""Leading a site (broker.state.leadership), a connect as the site starts only if the leadership has
this much time left beyond the time the connect is allowed to take to send CONNECT:
that CONNECT then reaches the MQTT server while this node still leads, before any next
leader's (network delays beyond this margin aside, which the check after CONNACK and
the subscribers' epoch rule cover)."""
CONNECT_MIN = 0.2
"""The least time a connect is allowed for its TCP and TLS handshakes: with less
leadership time left, the bus waits for the next renewal before it connects."""
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
    the caller acknowledges each (`_Acks`), and the client announces `receive_maximum`
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


class _Acks:
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


class Bus:
    # Many arguments: the daemon's wiring, keyword-only; regrouped in the package redesign (#28).
    def __init__(self, cfg: MqttConfig, topics: Topics, store: Store, *, client_id: str,  # noqa: PLR0913
                 boot_id: str, on_command: Callable[[Command], Awaitable[None]],
                 retained: RetainedSource | None = None, node: str = "",
                 epoch: Callable[[], int] = lambda: 0,
                 may_publish: Callable[[], bool] = lambda: True,
                 time_left: Callable[[], float] = lambda: math.inf,
                 receive_maximum: int = RECEIVE_MAXIMUM) -> None:
        self.cfg = cfg
        self.receive_maximum = receive_maximum
        """The Receive Maximum announced on MQTT 5 (`RECEIVE_MAXIMUM`)."""
        self.node = node
        self._epoch = epoch
        self.may_publish = may_publish
        """The leader's fence (broker.state.leadership): nothing is published, and no connection is
        made, while it says no."""
        self.time_left = time_left
        """Seconds the leadership is still sure to hold (broker.state.leadership; infinite for a
        single daemon): a connect as the site starts only with enough of it left."""
        self.topics = topics
        self.store = store
        self.client_id = client_id
        self.boot_id = boot_id
        self._on_command = on_command
        self._retained = retained
        self._farewell = False  # `offline` retained by goodbye(): a clean disconnect is due
        self.restored = asyncio.Event()  # set each time the retained state was restored
        self.lost_at: datetime | None = None  # when the last connection was lost
        self._pending: dict[int, OutboxRow] = {}
        self._queue: deque[int] = deque()
        self._new = asyncio.Event()
        self._acked: list[int] = []
        self._acked_event = asyncio.Event()
        self._drained = asyncio.Event()
        self._drained.set()
        self._client: aiomqtt.Client | None = None
        self._receiving = True
        self.connected = asyncio.Event()
        self.reconnects = 0
        self.connections = 0
        """Sessions made so far (each connect, the first one included)."""
        self._connection_made = asyncio.Event()
        self.last_ack = time.monotonic()
        self.v5 = cfg.protocol == "5"
        self._dropped = Every(30.0)  # one warning per 30 s about invalid scheduler ids
        self._acks: _Acks | None = None  # this connection's PUBACKs (MQTT 5)
        self.received = 0
        """Request messages taken from the MQTT server so far, over every connection."""

    @property
    def unacknowledged(self) -> int:
        """Requests of this connection taken and not acknowledged yet (MQTT 5): being
        decided and committed, or done and waiting for an earlier one."""
        return 0 if self._acks is None else self._acks.waiting

    # --- the outbox ------------------------------------------------------------------

    def enqueue(self, rows: Sequence[OutboxRow]) -> None:
        """Hand committed outbox rows to the publisher."""
        for row in rows:
            assert row.id is not None, "only committed rows are published"
            self._pending[row.id] = row
            self._queue.append(row.id)
        if rows:
            self._drained.clear()
            self._new.set()

    @property
    def outbox_depth(self) -> int:
        return len(self._pending)

    async def connection_after(self, n: int) -> None:
        """Wait until more than `n` sessions were made (`connections`): after a server
        restart, `connected` may still be set from before the loss was noticed; this
        waits for the session on the new server."""
        while self.connections <= n:
            self._connection_made.clear()
            await self._connection_made.wait()

    async def drained(self, timeout: float) -> bool:
        """Wait until every outbox row was acknowledged and deleted from the store;
        False on timeout."""
        try:
            async with asyncio.timeout(timeout):
                await self._drained.wait()
                await self._flush_acks()
                await self.store.barrier()  # deletes already queued by the ack loop
        except TimeoutError:
            return False
        return True

    # --- the connection --------------------------------------------------------------

    def _status(self, state: str) -> bytes:
        return dumps({"state": state, "ts": iso(utcnow()), "boot_id": self.boot_id,
                      "version": __version__, "node": self.node, "role": "leader",
                      "epoch": self._epoch()})

    async def _connect_window(self) -> float:
        """Wait until a connect as the site may start; returns how long its TCP and TLS
        handshakes may take (CONNECT is sent right after them). `Fenced` once this node
        does not lead.

        A CONNECT under the site's client id takes the site's session from whoever holds
        it. Sent by a deposed leader after the next leader connected, it would take the
        session (and the requests queued in it) from the new leader and leave a will
        saying `offline` that fires after the new leader's `online`. So a connect starts
        only while the leadership has the handshakes' time plus `CONNECT_MARGIN` left,
        and the handshakes are bounded by that time. With too little left (a renewal is
        due), wait for the renewal rather than fail: a failure would grow the backoff."""
        while True:
            if not self.may_publish():
                raise Fenced("this node does not lead the site (any more)")
            budget = min(CONNECT_TIMEOUT, self.time_left() - CONNECT_MARGIN)
            if budget >= CONNECT_MIN:
                return budget
            await asyncio.sleep(0.05)

    def _client_for(self, budget: float = CONNECT_TIMEOUT) -> aiomqtt.Client:
        if not self.may_publish():
            raise Fenced("this node does not lead the site (any more)")
        client = make_client(self.cfg, self.client_id, will=aiomqtt.Will(
            self.topics.status, self._status("offline"), qos=1, retain=True),
            manual_ack=True, receive_maximum=self.receive_maximum)
        client.pending_calls_threshold = 100_000  # the outbox window bounds them, not this
        # paho bounds the TCP connect and the TLS handshake by this, each: CONNECT is
        # sent within `budget` of the start, or never.
        paho = getattr(client, "_client", None)
        if paho is not None:
            paho.connect_timeout = budget / 2
        return client

    async def run(self) -> None:
        """Stay connected until cancelled.

        Every way a session can end — a lost connection, a refused or unacknowledged
        publish, an exception group of those in any nesting, an error nobody foresaw —
        ends that session only: the next one starts after a jittered backoff. Only a
        deliberate stop (cancellation) ends the loop. On that way out the connection is
        closed cleanly only after `goodbye()` has retained `offline`; otherwise it is
        dropped without a DISCONNECT, so the MQTT server publishes the will."""
        failures = 0
        ack_task = asyncio.create_task(self._ack_loop())
        try:
            while True:
                try:
                    await self._connection()
                except Exception as exc:  # any session failure means: reconnect
                    if _stopping():
                        raise asyncio.CancelledError from exc
                    self._client = None
                    was = self.connected.is_set()
                    self.connected.clear()
                    failures = 1 if was else failures + 1
                    if was:
                        self.reconnects += 1
                        self.lost_at = utcnow()
                    self._log_failure(exc, was=was, first=failures == 1)
                    delay = min(30.0, 0.25 * 2 ** min(failures, 7)) * random.uniform(0.5, 1.0)
                    await asyncio.sleep(delay)
        finally:
            self._client = None
            self.connected.clear()
            ack_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ack_task
            await self._flush_acks()

    def _log_failure(self, exc: Exception, *, was: bool, first: bool) -> None:
        if _only(exc, (Fenced,)):
            if first:
                log.info("mqtt closed: this node does not lead the site", error=_describe(exc))
            return
        expected = _only(exc, (aiomqtt.MqttError, OSError))
        detail = _describe(exc)
        if not expected:
            # Not a network or protocol failure: a bug. Reconnecting keeps the daemon
            # serving; the traceback says where to look.
            log.error("mqtt session failed unexpectedly; reconnecting", error=detail,
                      exc_info=exc)
        elif was:
            log.warning("mqtt connection lost", error=detail)
        elif first:
            log.warning("mqtt not reachable, retrying", url=self.cfg.url, error=detail)

    async def _connection(self) -> None:
        """One connection: connect, run a session until it fails or the task is
        cancelled, then close it the way the SPEC asks for that way out."""
        client = self._client_for(await self._connect_window())
        await client.__aenter__()
        clean = True
        leading = False  # the connection was made while this node led
        try:
            if not self.may_publish():
                # CONNACK came after the leadership lapsed: this connection may have
                # taken the site's session from a newer leader. Leave it at once with a
                # DISCONNECT, which discards the will: its `offline` could otherwise be
                # published after the newer leader's `online` and stay retained.
                raise Fenced("connected to the MQTT server after the leadership lapsed")
            leading = True
            self._client = client
            if _stopping():
                # Cancelled while connecting, and aiomqtt's `asyncio.wait_for` swallowed
                # it (CPython gh-86296): the session would run on, and the stop wait
                # for it for good.
                raise asyncio.CancelledError
            await self._session(client)
        except asyncio.CancelledError:
            # Not leading (CONNACK after the lapse, cancelled on the way): no will.
            clean = self._farewell or not leading
            raise
        except Fenced:
            # Deposed on a connection made while leading: leave as a crash does, with
            # the will (`offline`). That is safe: the MQTT server publishes it now, or
            # it did when a newer leader's CONNECT (the same client id) closed this
            # connection, which discards or publishes the will before that leader's
            # CONNACK, so before its `online`. A connection made too late (above) is
            # left cleanly instead.
            clean = not leading
            raise
        finally:
            self._client = None
            await self._close(client, clean=clean)

    async def _close(self, client: aiomqtt.Client, *, clean: bool) -> None:
        """Leave the connection. `clean=False`: the process is going away without having
        retained `offline` (an error, not an orderly stop) — drop the socket without a
        DISCONNECT so the server sends the will. Never raises; bounded in time."""
        if not clean:
            _drop(client)
        with contextlib.suppress(Exception, TimeoutError):
            async with asyncio.timeout(2.0):
                await client.__aexit__(None, None, None)
        _settle(client)

    async def _session(self, client: aiomqtt.Client) -> None:
        options = None
        if self.v5:
            # No replay of retained requests on subscribe; a live publish keeps its retain
            # flag, so a retained request is recognised and refused (SPEC §3).
            options = SubscribeOptions(qos=1, retainHandling=2,
                                       retainAsPublished=True)
        async with asyncio.timeout(10):
            if options is not None:
                await client.subscribe(self.topics.requests, options=options,
                                       timeout=math.inf)
            else:
                await client.subscribe(self.topics.requests, qos=1, timeout=math.inf)
        await self._publish(client, self.topics.status, self._status("online"), retain=True,
                            timeout=10)
        self._queue = deque(self._pending)  # everything not acknowledged, in order
        self._new.set()
        self.connections += 1
        self._connection_made.set()
        self.connected.set()
        log.info("mqtt connected", url=self.cfg.url, outbox=len(self._pending),
                 protocol=self.cfg.protocol)
        acks = self._acks = _Acks(client) if self.v5 else None
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._send(client))
                if self._retained is not None:
                    tg.create_task(self._restore_retained(client, self._retained))
                await self._receive(client, acks)
        finally:
            # Acknowledgements belong to the connection: what it did not acknowledge,
            # the server delivers again on the next one.
            if acks is not None:
                acks.close()
            if self._acks is acks:
                self._acks = None
        raise aiomqtt.MqttError("the MQTT server ended the session")

    async def _restore_retained(self, client: aiomqtt.Client, source: RetainedSource) -> None:
        """Make the retained topics true again after a (re)connect: a server that
        restarted without persistence has lost them, one with persistence may hold
        states that changed while it was down. Paced (a bounded window of
        acknowledgements, a yield every few messages) so requests keep flowing."""
        started = time.monotonic()
        window = asyncio.Semaphore(RESTORE_WINDOW)
        sent = 0
        async with asyncio.TaskGroup() as tg:
            for topic, read, expiry in source():
                await window.acquire()
                tg.create_task(self._restore_one(client, topic, read, expiry, window))
                sent += 1
                if sent % RESTORE_YIELD_EVERY == 0:
                    await asyncio.sleep(0)
        self.restored.set()
        log.info("retained state restored", messages=sent,
                 seconds=round(time.monotonic() - started, 3))

    async def _restore_one(self, client: aiomqtt.Client, topic: str, read: RetainedRead,
                           expiry: int | None, window: asyncio.Semaphore) -> None:
        try:
            payload = await read()
            if payload is None:
                return
            props = None
            if expiry is not None and self.v5:
                props = self._props({"message_expiry": expiry})
            await self._publish(client, topic, payload, retain=True, properties=props)
        except Unpublishable as exc:
            log.error("retained message cannot be published; skipped", topic=topic[:200],
                      error=str(exc))
        finally:
            window.release()

    async def _send(self, client: aiomqtt.Client) -> None:
        window = asyncio.Semaphore(200)
        async with asyncio.TaskGroup() as tg:
            while True:
                if not self._queue:
                    self._new.clear()
                    await self._new.wait()
                    continue
                row_id = self._queue.popleft()
                row = self._pending.get(row_id)
                if row is None:
                    continue  # acknowledged meanwhile
                await window.acquire()
                tg.create_task(self._publish_one(client, row, window))

    async def _publish_one(self, client: aiomqtt.Client, row: OutboxRow,
                           window: asyncio.Semaphore) -> None:
        try:
            props = self._props(row.props) if row.props and self.v5 else None
            await self._publish(client, row.topic, row.payload, qos=row.qos,
                                retain=row.retain, properties=props)
        except Unpublishable as exc:
            # Sending it again would fail again, after every reconnect: drop it, loudly,
            # rather than let one bad row stop the outbox for good.
            log.error("outbox message cannot be published; dropped", topic=row.topic[:200],
                      error=str(exc))
        finally:
            window.release()
        assert row.id is not None
        self.last_ack = time.monotonic()
        if self._pending.pop(row.id, None) is not None:
            self._acked.append(row.id)
            self._acked_event.set()
            if not self._pending:
                self._drained.set()

    async def _publish(self, client: aiomqtt.Client, topic: str, payload: bytes, *,
                       qos: int = 1, retain: bool = False,
                       properties: Properties | None = None, timeout: float = 30.0) -> None:
        """Publish and wait for the acknowledgement, within `timeout`; `Fenced` (a
        session error) once this node does not lead its site.

        aiomqtt applies its timeouts with `asyncio.wait_for`, which on Python 3.11 can
        swallow a cancellation that races with completion (CPython gh-86296) and leave
        a task that never stops; `asyncio.timeout` has no such race.
        """
        if not self.may_publish():
            raise Fenced("this node does not lead the site (any more)")
        try:
            async with asyncio.timeout(timeout):
                await client.publish(topic, payload, qos=qos, retain=retain,
                                     properties=properties, timeout=math.inf)
        except TimeoutError:
            raise aiomqtt.MqttError(f"no acknowledgement within {timeout:g}s") from None
        except (ValueError, TypeError) as exc:
            # paho checks topic and payload before sending (wildcards, size, encoding)
            raise Unpublishable(f"{type(exc).__name__}: {exc}") from exc

    @staticmethod
    def _props(p: dict[str, Any]) -> Properties:
        props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
        if "correlation_data" in p:
            props.CorrelationData = bytes.fromhex(p["correlation_data"])
        if "message_expiry" in p:
            props.MessageExpiryInterval = int(p["message_expiry"])
        return props

    async def _ack_loop(self) -> None:
        while True:
            await self._acked_event.wait()
            # Gather acknowledgements for a moment: one delete per 50 ms instead of one
            # per message. A row acknowledged but not yet deleted is only sent again
            # after a crash, and subscribers drop duplicates by id.
            await asyncio.sleep(ACK_COALESCE_SECONDS)
            self._acked_event.clear()
            await self._flush_acks()

    async def _flush_acks(self) -> None:
        while self._acked:
            batch, self._acked = self._acked[:ACK_BATCH], self._acked[ACK_BATCH:]
            await self.store.ack(batch)

    async def _receive(self, client: aiomqtt.Client, acks: _Acks | None = None) -> None:
        """Turn each request message into a `Command` for the broker. With `acks` (MQTT
        5) a message is acknowledged when its command is done; one dropped here, without
        a command, is done at once, or it would hold back every later acknowledgement."""
        async for message in client.messages:
            if not self._receiving:
                continue  # shutting down: not acknowledged, so the next boot gets it
            self.received += 1
            done = acks.take(message) if acks is not None else None
            command = self._command(message, done)
            if command is None:
                if done is not None:
                    done()
                continue
            await self._on_command(command)

    def _command(self, message: aiomqtt.Message,
                 done: Callable[[], None] | None) -> Command | None:
        """The command a request message carries; None for one dropped unanswered."""
        topic = str(message.topic)
        if message.retain and not self.v5:
            # MQTT 3.1.1 marks only the replay on subscribe (a persistent session's
            # subscription is not re-made, so that is rare); ignore it.
            log.info("ignored retained request", topic=topic)
            return None
        parsed = self.topics.parse_request(topic)
        if parsed is None:
            return None
        scheduler, verb = parsed
        if not SCHEDULER_ID.match(scheduler) or scheduler == OPS:
            if dropped := self._dropped.hit():
                log.warning("request from an invalid or reserved scheduler id dropped",
                            topic=topic, dropped=dropped)
            return None
        payload = message.payload
        if not isinstance(payload, bytes | bytearray):
            payload = str(payload or "").encode()
        reply = None
        response_topic = getattr(message.properties, "ResponseTopic", None)
        if response_topic:
            # The reply is published with the daemon's rights, so it may only go where
            # the scheduler itself could read: P/replies/S/... Anything else would let
            # one scheduler write into another's events or leases.
            if self.topics.may_reply(scheduler, str(response_topic)):
                correlation = getattr(message.properties, "CorrelationData", b"")
                reply = {"response_topic": str(response_topic),
                         "correlation_data": bytes(correlation).hex()}
            else:
                log.warning("ResponseTopic outside the scheduler's replies tree ignored",
                            scheduler=scheduler, response_topic=str(response_topic),
                            allowed=self.topics.replies(scheduler) + "/#")
        # On MQTT 5 a retained request keeps its flag (Retain-As-Published): the broker
        # answers it request.invalid and does not act on it.
        return Command(scheduler, verb, bytes(payload), topic, reply,
                       retained=bool(message.retain), done=done)

    # --- direct (non-durable) publishing ----------------------------------------------

    def stop_receiving(self) -> None:
        """Stop taking requests (shutdown); what is queued is still decided."""
        self._receiving = False

    async def publish_now(self, topic: str, payload: bytes, *, retain: bool = False,
                          expiry_seconds: int | None = None) -> bool:
        """Best-effort publish outside the outbox (capacity summaries). False if down."""
        client = self._client
        if client is None or not self.connected.is_set():
            return False
        props = None
        if expiry_seconds is not None and self.v5:
            props = self._props({"message_expiry": expiry_seconds})
        try:
            await self._publish(client, topic, payload, retain=retain, properties=props,
                                timeout=10)
        except aiomqtt.MqttError:
            return False
        except Unpublishable as exc:
            log.error("message cannot be published; skipped", topic=topic[:200],
                      error=str(exc))
            return False
        return True

    async def goodbye(self, timeout: float = 5.0) -> None:
        """Publish `offline` (retained) before a clean disconnect, which sends no will.
        Not once this node stopped leading (`_publish` is fenced): a newer leader may be
        online by then, and this `offline` would overwrite its `online`."""
        client = self._client
        if client is None or not self.connected.is_set() or not self.may_publish():
            return
        with contextlib.suppress(aiomqtt.MqttError):
            await self._publish(client, self.topics.status, self._status("offline"),
                                retain=True, timeout=timeout)
            self._farewell = True


def _stopping() -> bool:
    """Whether the current task was asked to stop (a cancellation is pending or being
    handled): then a session error raised on the way out must not start a reconnect."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _only(exc: BaseException, kinds: tuple[type[BaseException], ...]) -> bool:
    """Whether `exc`, or every leaf of it when it is an exception group (nested to any
    depth), is one of `kinds`."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_only(e, kinds) for e in exc.exceptions)
    return isinstance(exc, kinds)


def _describe(exc: BaseException) -> str:
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


def _drop(client: aiomqtt.Client) -> None:
    """Cut the connection without an MQTT DISCONNECT: the server then publishes the
    will (`offline`), as it would after a crash. aiomqtt has no public way to leave
    without a DISCONNECT, hence the reach into its paho client."""
    paho = getattr(client, "_client", None)
    sock = paho.socket() if paho is not None else None
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def _settle(client: aiomqtt.Client) -> None:
    """Mark an unexpected-disconnection error as seen. aiomqtt stores it in a future
    that nobody awaits when the session already ended for another reason, and asyncio
    would log "Future exception was never retrieved" for it."""
    fut = getattr(client, "_disconnected", None)
    if isinstance(fut, asyncio.Future) and fut.done() and not fut.cancelled():
        fut.exception()
