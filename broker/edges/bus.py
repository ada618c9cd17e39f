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
daemon. On MQTT 3.1.1 requests are acknowledged on receipt.

The MQTT client is gmqtt, one `broker.edges.mqtt.Connection` per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import datetime
from typing import Any

import structlog

from broker import __version__
from broker.daemon.config import MqttConfig
from broker.edges.incoming import command_of
from broker.edges.mqtt import (
    RECEIVE_MAXIMUM,
    Acks,
    Connection,
    Fenced,
    MqttError,
    Unpublishable,
    Will,
    connect,
    describe,
    only,
    stopping,
)
from broker.model import iso, utcnow
from broker.output.ratelimit import Every
from broker.state.store import Store, StoreFailed
from broker.wire.commands import Command
from broker.wire.messages import OutboxRow, Topics, dumps

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
PUBLISH_TIMEOUT = 30.0
"""The longest an outbox row's PUBACK may take: later, the session ends and the rows
not acknowledged go out again on the next connection."""
CONNECT_MARGIN = 0.25
"""Leading a site (broker.state.leadership), a connect as the site starts only if the leadership has
this much time left beyond the time the connect is allowed to take to send CONNECT:
that CONNECT then reaches the MQTT server while this node still leads, before any next
leader's (network delays beyond this margin aside, which the check after CONNACK and
the subscribers' epoch rule cover)."""
CONNECT_MIN = 0.2
"""The least time a connect is allowed for its TCP and TLS handshakes: with less
leadership time left, the bus waits for the next renewal before it connects."""
class Bus:
    # Many arguments: the daemon's wiring, keyword-only (each a part or a setting of its own).
    def __init__(self, cfg: MqttConfig, topics: Topics, store: Store, *, client_id: str,  # noqa: PLR0913
                 boot_id: str, on_command: Callable[[Command], Awaitable[None]],
                 retained: RetainedSource | None = None, node: str = "",
                 epoch: Callable[[], int] = lambda: 0,
                 may_publish: Callable[[], bool] = lambda: True,
                 time_left: Callable[[], float] = lambda: math.inf,
                 receive_maximum: int = RECEIVE_MAXIMUM,
                 on_connect: Callable[[], Awaitable[object]] | None = None,
                 on_lost: Callable[[], None] | None = None) -> None:
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
        self._on_connect = on_connect
        """Awaited on every connect, after `online`, while requests are taken and the
        outbox is sent, and before the retained states are restored (the broker extends
        the leases it could not hear, `Broker.heard`, and the restore publishes them as
        extended). The state store failing in it ends the bus: no session failure."""
        self._on_lost = on_lost
        """Called when a connection that was up is lost (`Broker.deaf`)."""
        self._farewell = False  # `offline` retained by goodbye(): a clean disconnect is due
        self.restored = asyncio.Event()  # set each time the retained state was restored
        self.lost_at: datetime | None = None  # when the last connection was lost
        self.retained_true_since: datetime | None = None
        """When the last complete restore of the retained state began (every publish of
        it acknowledged); None before the first in this process."""
        self._pending: dict[int, OutboxRow] = {}
        self._queue: deque[int] = deque()
        self._resent_clears: set[str] = set()  # the clears sent again on this connection
        self._new = asyncio.Event()
        self._acked: list[int] = []
        self._acked_event = asyncio.Event()
        self._drained = asyncio.Event()
        self._drained.set()
        self._client: Connection | None = None
        self._receiving = True
        self.connected = asyncio.Event()
        self.reconnects = 0
        self.connections = 0
        """Sessions made so far (each connect, the first one included)."""
        self._connection_made = asyncio.Event()
        self.last_ack = time.monotonic()
        self.v5 = cfg.protocol == "5"
        self._dropped = Every(30.0)  # one warning per 30 s about invalid scheduler ids
        self._acks: Acks | None = None  # this connection's PUBACKs (MQTT 5)
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

    def pending_clears(self) -> set[str]:
        """The retained topics that outbox rows clear (an empty retained payload) on this
        connection: those not acknowledged yet, and those sent again when it was made
        (acknowledged since, perhaps before a restore asks). Every such row is sent on
        the current connection (or on the next, if this one is lost first), so a restore
        need not clear them again."""
        pending = {r.topic for r in self._pending.values() if r.retain and not r.payload}
        return pending | self._resent_clears

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

    def _still_leading(self) -> None:
        """`Fenced` once this node does not lead its site (`may_publish`): nothing is
        published and no connection made then."""
        if not self.may_publish():
            raise Fenced("this node does not lead the site (any more)")

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
            self._still_leading()
            budget = min(CONNECT_TIMEOUT, self.time_left() - CONNECT_MARGIN)
            if budget >= CONNECT_MIN:
                return budget
            await asyncio.sleep(0.05)

    async def _connect(self, budget: float = CONNECT_TIMEOUT) -> Connection:
        """Connect as the site. The TCP connect and the TLS handshake are bounded by
        `budget` together: CONNECT is sent within `budget` of the start, or never."""
        self._still_leading()
        return await connect(self.cfg, self.client_id, will=Will(
            self.topics.status, self._status("offline"), qos=1, retain=True),
            manual_ack=True, receive_maximum=self.receive_maximum, handshake_timeout=budget)

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
                    if (failed := _store_failure(exc)) is not None:
                        raise failed from exc  # `on_connect`'s: the daemon stops
                    if stopping():
                        raise asyncio.CancelledError from exc
                    self._client = None
                    was = self.connected.is_set()
                    self.connected.clear()
                    failures = 1 if was else failures + 1
                    if was:
                        self.reconnects += 1
                        self.lost_at = utcnow()
                        if self._on_lost is not None:
                            self._on_lost()
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
        if only(exc, (Fenced,)):
            if first:
                log.info("mqtt closed: this node does not lead the site", error=describe(exc))
            return
        expected = only(exc, (MqttError, OSError))
        detail = describe(exc)
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
        client = await self._connect(await self._connect_window())
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
        except Exception as exc:
            if _store_failure(exc) is not None:
                clean = False  # the daemon stops without `offline`: the will says it
            raise
        finally:
            self._client = None
            await self._close(client, clean=clean)

    async def _close(self, client: Connection, *, clean: bool) -> None:
        """Leave the connection. `clean=False`: the process is going away without having
        retained `offline` (an error, not an orderly stop) — drop the socket without a
        DISCONNECT so the server sends the will. Never raises; bounded in time."""
        await client.close(clean=clean, timeout=2.0)

    async def _session(self, client: Connection) -> None:
        async with asyncio.timeout(10):
            if self.v5:
                # No replay of retained requests on subscribe; a live publish keeps its
                # retain flag, so a retained request is recognised and refused (SPEC §3).
                await client.subscribe(self.topics.requests, qos=1, retain_handling=2,
                                       retain_as_published=True)
            else:
                await client.subscribe(self.topics.requests, qos=1)
        await self._publish(client, self.topics.status, self._status("online"), retain=True,
                            timeout=10)
        self._queue = deque(self._pending)  # everything not acknowledged, in order
        self._resent_clears = {r.topic for r in self._pending.values()
                               if r.retain and not r.payload}
        self._new.set()
        self.connections += 1
        self._connection_made.set()
        self.connected.set()
        log.info("mqtt connected", url=self.cfg.url, outbox=len(self._pending),
                 protocol=self.cfg.protocol)
        acks = self._acks = Acks() if self.v5 else None
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._send(client))
                tg.create_task(self._connected(client))
                await self._receive(client, acks)
        finally:
            # Acknowledgements belong to the connection: what it did not acknowledge,
            # the server delivers again on the next one.
            if acks is not None:
                acks.close()
            if self._acks is acks:
                self._acks = None
        raise MqttError("the MQTT server ended the session")

    async def _connected(self, client: Connection) -> None:
        """`on_connect`, then the retained states restored: what it committed (the leases
        it extended) is what they publish."""
        if self._on_connect is not None:
            await self._on_connect()
        if self._retained is not None:
            await self._restore_retained(client, self._retained)

    async def _restore_retained(self, client: Connection, source: RetainedSource) -> None:
        """Make the retained topics true again after a (re)connect: a server that
        restarted without persistence has lost them, one with persistence may hold
        states that changed while it was down. Paced (a bounded window of
        acknowledgements, a yield every few messages) so requests keep flowing."""
        started = time.monotonic()
        began = utcnow()
        window = asyncio.Semaphore(RESTORE_WINDOW)
        sent = 0
        async with asyncio.TaskGroup() as tg:
            for topic, read, expiry in source():
                await window.acquire()
                tg.create_task(self._restore_one(client, topic, read, expiry, window))
                sent += 1
                if sent % RESTORE_YIELD_EVERY == 0:
                    await asyncio.sleep(0)
        # Every retained topic was made true as of `began`, each publish acknowledged:
        # what changed since is in the outbox or in the next restore's window.
        self.retained_true_since = began
        self.restored.set()
        log.info("retained state restored", messages=sent,
                 seconds=round(time.monotonic() - started, 3))

    async def _restore_one(self, client: Connection, topic: str, read: RetainedRead,
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

    async def _send(self, client: Connection) -> None:
        """Publish the outbox's rows in order, as many unacknowledged at a time as the
        connection's in-flight window takes. No task per row: each PUBACK settles its
        row in a callback (`_acked_row`), and `_unacknowledged` ends the session when
        one is late or lost. In a burst of requests the tasks, timeouts and semaphore
        of a row each were a third of the bus's CPU per message."""
        sent: dict[int, float] = {}  # row id: loop time sent, oldest first
        failed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._unacknowledged(sent, failed))
            await self._send_rows(client, sent, failed)

    async def _send_rows(self, client: Connection, sent: dict[int, float],
                         failed: asyncio.Future[BaseException]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                self._new.clear()
                await self._new.wait()
                continue
            row = self._pending.get(self._queue.popleft())
            if row is None:
                continue  # acknowledged meanwhile
            assert row.id is not None
            self._still_leading()
            props = self._props(row.props) if row.props and self.v5 else None
            try:
                ack = await client.submit(row.topic, row.payload, qos=row.qos,
                                          retain=row.retain, properties=props)
            except (ValueError, TypeError) as exc:
                # Sending it again would fail again, after every reconnect: drop it,
                # loudly, rather than let one bad row stop the outbox for good.
                log.error("outbox message cannot be published; dropped",
                          topic=row.topic[:200], error=f"{type(exc).__name__}: {exc}")
                self._acked_row(row.id)
                continue
            sent[row.id] = loop.time()
            ack.add_done_callback(functools.partial(self._on_puback, row.id, sent, failed))

    def _on_puback(self, row_id: int, sent: dict[int, float],
                   failed: asyncio.Future[BaseException], ack: asyncio.Future[None]) -> None:
        sent.pop(row_id, None)
        error = ack.exception() if not ack.cancelled() else \
            MqttError("a publish was given up before its PUBACK")
        if error is None:
            self._acked_row(row_id)
        elif not failed.done():
            failed.set_result(error)  # the session ends (`_unacknowledged`)

    def _acked_row(self, row_id: int) -> None:
        """The server acknowledged the row (or it was dropped): deleted from the store
        by the ack loop."""
        self.last_ack = time.monotonic()
        if self._pending.pop(row_id, None) is not None:
            self._acked.append(row_id)
            self._acked_event.set()
            if not self._pending:
                self._drained.set()

    async def _unacknowledged(self, sent: dict[int, float],
                              failed: asyncio.Future[BaseException]) -> None:
        """End the session when a row's publish failed (the connection lost) or its
        PUBACK is `PUBLISH_TIMEOUT` late: the rows not acknowledged go out again on the
        next connection. One timer for all the rows in flight, not one each."""
        loop = asyncio.get_running_loop()
        while True:
            oldest = next(iter(sent.values()), None)
            wait = PUBLISH_TIMEOUT if oldest is None else oldest + PUBLISH_TIMEOUT - loop.time()
            if wait <= 0:
                raise MqttError(f"no acknowledgement within {PUBLISH_TIMEOUT:g}s")
            done, _ = await asyncio.wait([failed], timeout=wait)
            if done:
                raise failed.result()

    async def _publish(self, client: Connection, topic: str, payload: bytes, *,
                       qos: int = 1, retain: bool = False,
                       properties: dict[str, Any] | None = None,
                       timeout: float = 30.0) -> None:
        """Publish and wait for the acknowledgement, within `timeout`; `Fenced` (a
        session error) once this node does not lead its site.

        The wait is an `asyncio.timeout`, not an `asyncio.wait_for`: on Python 3.11 that
        can swallow a cancellation that races with completion (CPython gh-86296) and
        leave a task that never stops.
        """
        self._still_leading()
        try:
            async with asyncio.timeout(timeout):
                await client.publish(topic, payload, qos=qos, retain=retain,
                                     properties=properties)
        except TimeoutError:
            raise MqttError(f"no acknowledgement within {timeout:g}s") from None
        except (ValueError, TypeError) as exc:
            # checked before sending (wildcards, NUL, size, encoding: `check_topic`)
            raise Unpublishable(f"{type(exc).__name__}: {exc}") from exc

    @staticmethod
    def _props(p: dict[str, Any]) -> dict[str, Any]:
        """An outbox row's MQTT 5 properties, in the client's names."""
        props: dict[str, Any] = {}
        if "correlation_data" in p:
            props["correlation_data"] = bytes.fromhex(p["correlation_data"])
        if "message_expiry" in p:
            props["message_expiry_interval"] = int(p["message_expiry"])
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

    async def _receive(self, client: Connection, acks: Acks | None = None) -> None:
        """Turn each request message into a `Command` for the broker. With `acks` (MQTT
        5) a message is acknowledged when its command is done; one dropped here, without
        a command, is done at once, or it would hold back every later acknowledgement."""
        async for message in client.messages():
            if not self._receiving:
                continue  # shutting down: not acknowledged, so the next boot gets it
            self.received += 1
            done = acks.take(message) if acks is not None else None
            command = command_of(message, self.topics, v5=self.v5, dropped=self._dropped,
                                 done=done)
            if command is None:
                if done is not None:
                    done()
                continue
            await self._on_command(command)

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
        except MqttError:
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
        with contextlib.suppress(MqttError):
            await self._publish(client, self.topics.status, self._status("offline"),
                                retain=True, timeout=timeout)
            self._farewell = True


def _store_failure(exc: BaseException) -> StoreFailed | None:
    """The state store's failure in `exc` (an exception group of a session's tasks
    included), if it is one: that ends the bus, not only the session."""
    if isinstance(exc, StoreFailed):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := _store_failure(inner)) is not None:
                return found
    return None
