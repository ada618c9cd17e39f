"""The client's connection: its options, one MQTT connection kept up (reconnects,
subscriptions, MQTT 5 or 3.1.1), the daemon's status and leader epochs, and the routing
of what comes in. `BrokerClient` (gpubroker_client.client) adds the verbs on top."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import ssl
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

import aiomqtt
from aiomqtt.exceptions import MqttConnectError
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from gpubroker_client import files
from gpubroker_client.callbacks import Callbacks
from gpubroker_client.errors import BrokerError, BrokerUnavailable
from gpubroker_client.events import SEEN_IDS, LeaseEvent, _epoch, _json
from gpubroker_client.lease import Callback, Lease
from gpubroker_client.mqtturl import parse_mqtt_url
from gpubroker_client.options import Protocol, check_options, unsupported_version
from gpubroker_client.watch import SYNC_FALLBACK_SECONDS, LeaseWatch

if TYPE_CHECKING:
    from gpubroker_client.calls import _Waiter

__all__ = ["DEFAULT_PREFIX", "Session"]

log = logging.getLogger("gpubroker.client")

DEFAULT_PREFIX = "gpubroker/v1"



class Session:
    """One scheduler's connection to the MQTT server a gpubroker daemon serves on, kept
    up; the options are `BrokerClient`'s. What comes in is routed here: the daemon's
    status, the lease watches, the retained lease states; events of this scheduler go,
    deduplicated and fenced by leader epoch, to `_dispatch`."""

    # Many arguments: the public client's options, keyword-only, each documented.
    def __init__(self, url: str = "mqtt://127.0.0.1:1883", *, scheduler: str | None,  # noqa: PLR0913
                 topic_prefix: str = DEFAULT_PREFIX, username: str | None = None,
                 password: str | None = None, password_file: str | Path | None = None,
                 ca_file: str | Path | None = None, ssl_context: ssl.SSLContext | None = None,
                 protocol: Protocol = "auto", client_id: str | None = None,
                 instance: str | None = None, persistent: bool = True,
                 session_expiry: int = 3600,
                 connect_timeout: float = 10.0, resend_after: float = 2.0,
                 resend_max: float = 15.0) -> None:
        self.host, self.port, tls = parse_mqtt_url(url)
        self.url = url
        prefix = check_options(scheduler, topic_prefix, protocol, instance, session_expiry,
                               two_passwords=password is not None and password_file is not None)
        self.scheduler = scheduler
        self.prefix = prefix
        self.username = username
        self._password = password
        self._password_file = Path(password_file) if password_file is not None else None
        self._tls = tls or ssl_context is not None or ca_file is not None
        self._ssl_context = ssl_context
        self._ca_file = Path(ca_file) if ca_file is not None else None
        self.protocol: Protocol = protocol
        self._v5 = protocol != "3.1.1"
        self.instance = instance or uuid.uuid4().hex[:12]
        """This client's name among its scheduler's (`instance`; default a random one):
        the client id and the reply topic are derived from it and the scheduler id."""
        self.client_id = client_id or \
            f"gpubroker-client-{scheduler or 'watch'}-{self.instance}"
        self.persistent = persistent and session_expiry > 0
        self.session_expiry = session_expiry
        self.connect_timeout = connect_timeout
        self.resend_after = resend_after
        self.resend_max = resend_max
        self._status_topic = f"{prefix}/status"
        self._events_head = f"{prefix}/events/"
        self._leases_head = f"{prefix}/leases/"
        self._reply_topic = f"{prefix}/replies/{scheduler}/{self.instance}" \
            if scheduler is not None else None
        # state
        self.daemon_status: Mapping[str, Any] | None = None
        """The last `P/status` payload (of the highest leader epoch seen)."""
        self.leader_epoch = 0
        """The highest leader epoch seen: in a `P/status` or an event's `leaderepoch`."""
        self._event_epoch = 0  # the highest `leaderepoch` seen on an event
        self.connects = 0
        self._generation = 0  # +1 on each connect
        self._online_generation = 0  # +1 each time the daemon comes online
        self._client: aiomqtt.Client | None = None
        self._connected = asyncio.Event()
        self._closed = False
        self._fatal: BaseException | None = None
        self._last_error: str | None = None
        self._run_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._waiters: set[_Waiter] = set()
        self._by_token: dict[bytes, _Waiter] = {}
        self._leases: dict[str, Lease] = {}
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._watches: set[LeaseWatch] = set()
        self._new_watch = asyncio.Event()
        self._was_up = False  # a session was up since the last failure
        # A bare MQTT 5 CONNECT first: a server of 3.1.1 only may not answer one with
        # properties at all (amqtt does not) where it refuses a bare one's version.
        self._probing = protocol == "auto" and self.persistent
        self._status_pulse = asyncio.Event()  # set (and replaced) when P/status changes
        self._status_subs = 0  # subscriptions to P/status made (markers)
        self._status_retained = 0  # retained P/status messages received
        self._states: dict[str, Mapping[str, Any]] = {}  # lease_id -> its retained state
        self._states_marker = 0  # the retained P/status after this connection's states
        self._states_synced = asyncio.Event()
        self._state_pulse = asyncio.Event()  # set (and replaced) when a state comes
        self._callbacks = Callbacks(self._spawn)

    # --- life cycle ------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def connect(self) -> None:
        """Connect (once); raises `BrokerUnavailable` when the MQTT server cannot be
        reached, or refuses the connection, within `connect_timeout`."""
        if self._run_task is not None:
            return
        if self._password_file is not None:
            try:
                self._password = files.read_secret(self._password_file)
            except OSError as exc:
                raise ValueError(f"MQTT password file {self._password_file}: "
                                 f"{exc.strerror or exc}") from None
        if self._ssl_context is None and self._tls:
            try:
                self._ssl_context = ssl.create_default_context(
                    cafile=str(self._ca_file) if self._ca_file else None)
            except OSError as exc:  # ssl.SSLError is one
                raise ValueError(f"MQTT CA file {self._ca_file}: "
                                 f"{getattr(exc, 'strerror', None) or exc}") from None
        self._run_task = asyncio.create_task(self._run(), name=f"{self.client_id}-mqtt")
        connected = asyncio.create_task(self._connected.wait())
        try:
            done, _ = await asyncio.wait({connected, self._run_task},
                                         timeout=self.connect_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            connected.cancel()
        if connected in done:
            return
        await self.close()
        if self._fatal is not None:
            raise BrokerUnavailable(f"the MQTT server at {self.host}:{self.port} refused the "
                                    f"connection: {self._fatal}") from None
        why = f": {self._last_error}" if self._last_error else ""
        raise BrokerUnavailable(f"cannot reach the MQTT server at {self.host}:{self.port} "
                                f"within {self.connect_timeout:g}s{why}")

    async def close(self) -> None:
        """Stop keep-alives and callbacks, disconnect. Leases stay as they are at the
        daemon (release them first if they should end)."""
        self._closed = True
        self._kick()
        self._status_pulse.set()
        for lease in list(self._leases.values()):
            if lease._keep_alive is not None:
                lease._keep_alive.cancel()
            lease._changed()  # its events() iterators end
        tasks = [t for t in (self._run_task, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def daemon_online(self) -> bool | None:
        """Whether the daemon says it is online (`P/status`); None until known."""
        if self.daemon_status is None:
            return None
        return self.daemon_status.get("state") == "online"

    @property
    def mqtt_version(self) -> str:
        """The MQTT version in use: "5" or "3.1.1" (with protocol "auto", 3.1.1 once the
        server refused 5)."""
        return "5" if self._v5 else "3.1.1"

    async def wait_daemon_online(self, timeout: float | None = None) -> bool:
        """Wait until the daemon says it is online; False if it did not within
        `timeout` seconds."""
        try:
            async with asyncio.timeout(timeout):
                while not self.daemon_online:
                    if self._closed:
                        raise BrokerError("the client is closed")
                    pulse = self._status_pulse
                    await pulse.wait()
        except TimeoutError:
            return False
        return True

    @property
    def leases(self) -> list[Lease]:
        """The active leases this client placed (or was given by `place`)."""
        return list(self._leases.values())

    # --- the connection --------------------------------------------------------------

    def _new_client(self) -> aiomqtt.Client:
        password = self._password
        if self._password_file is not None:  # read again: it may have been rotated
            with contextlib.suppress(OSError):
                password = files.read_secret(self._password_file)
        # A persistent session (SPEC §3.2): what comes while the connection is down is
        # kept by the MQTT server and delivered on the next one.
        props = None
        if self._v5 and self._probing:
            kwargs: dict[str, Any] = {"clean_start": True}
        elif self._v5:
            props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
            props.SessionExpiryInterval = self.session_expiry if self.persistent else 0
            kwargs = {"clean_start": not self.persistent, "properties": props}
        else:
            kwargs = {"clean_session": not self.persistent}
        return aiomqtt.Client(
            self.host, self.port, identifier=self.client_id, username=self.username,
            password=password, tls_context=self._ssl_context,
            protocol=aiomqtt.ProtocolVersion.V5 if self._v5 else aiomqtt.ProtocolVersion.V311,
            keepalive=30, timeout=min(10.0, max(1.0, self.connect_timeout)),
            max_inflight_messages=256, **kwargs)

    async def _run(self) -> None:
        """Stay connected until closed: every way a session ends means a reconnect after
        a jittered backoff. Only a refusal of the very first connection ends it."""
        failures = 0
        while True:
            try:
                await self._connection()
                continue  # the version probe (a session never ends without an error)
            except MqttConnectError as exc:  # the server answered: no
                if self.protocol == "auto" and self._v5 and unsupported_version(exc):
                    log.info("%s:%s does not speak MQTT 5; using 3.1.1", self.host, self.port)
                    self._v5 = False
                    continue
                if self.connects == 0:
                    self._fatal = exc
                    return
                self._last_error = str(exc)
                failures += 1
                log.warning("the MQTT server refused the connection (%s); retrying", exc)
            except Exception as exc:  # any other session failure means: reconnect
                self._last_error = f"{exc}" or type(exc).__name__
                failures = 1 if self._was_up else failures + 1
                if not isinstance(exc, aiomqtt.MqttError | OSError):
                    log.error("MQTT session failed unexpectedly; reconnecting", exc_info=exc)
                elif self._was_up:
                    log.warning("MQTT connection lost (%s); reconnecting", self._last_error)
            self._was_up = False
            delay = min(15.0, 0.5 * 2 ** min(failures - 1, 5)) * random.uniform(0.5, 1.0)
            await asyncio.sleep(delay)

    async def _connection(self) -> None:
        client = self._new_client()
        await client.__aenter__()
        if self._probing and self._v5:  # it speaks MQTT 5: connect for the session now
            self._probing = False
            with contextlib.suppress(Exception, TimeoutError):
                async with asyncio.timeout(2.0):
                    await client.__aexit__(None, None, None)
            _settle(client)
            return
        try:
            await self._session(client)
        finally:
            self._client = None
            self._connected.clear()
            self._kick()
            with contextlib.suppress(Exception, TimeoutError):
                async with asyncio.timeout(2.0):
                    await client.__aexit__(None, None, None)
            _settle(client)

    async def _session(self, client: aiomqtt.Client) -> None:
        self._status_retained = self._status_subs  # markers of an old connection are void
        self._states.clear()  # this connection's retained states come again
        self._states_synced.clear()
        async with asyncio.timeout(10):
            await self._subscribe(client, self._filters(), list(self._watches))
        self._states_marker = self._status_subs
        asyncio.get_running_loop().call_later(SYNC_FALLBACK_SECONDS, self._states_fallback,
                                              self._states_marker)
        self._client = client
        self._generation += 1
        self.connects += 1
        self._was_up = True
        self._connected.set()
        self._kick()
        if self.connects > 1:
            log.info("MQTT reconnected to %s:%s", self.host, self.port)
            self._reconnected()
        watching = asyncio.create_task(self._watch_subscriber(client))
        try:
            async for message in client.messages:
                try:
                    self._on_message(message)
                except Exception:  # one bad message must not end the session
                    log.exception("could not handle a message on %s", message.topic)
        finally:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching
        raise aiomqtt.MqttError("the MQTT server ended the session")

    def _filters(self) -> list[str]:
        out = []
        if self.scheduler is not None:
            out += [f"{self._events_head}{self.scheduler}/+",
                    f"{self._leases_head}{self.scheduler}/+"]
            if self._v5 and self._reply_topic is not None:
                out.append(self._reply_topic)
        for watch in self._watches:
            out += [f for f in watch.filters if f not in out]
        return out

    async def _subscribe(self, client: aiomqtt.Client, filters: Sequence[str],
                         watches: Sequence[LeaseWatch]) -> None:
        """Subscribe to `filters`, then (again) to `P/status`. The status's retained
        message comes after the retained messages of the filters (a server sends a
        subscription's retained messages as it acknowledges it, in order): for the
        lease watches given, it marks the end of their snapshot."""
        self._status_subs += 1
        marker = self._status_subs
        for watch in watches:
            watch._begin_sync(marker)
        if filters:
            await client.subscribe([(f, 1) for f in filters], timeout=math.inf)
        await client.subscribe(self._status_topic, qos=1, timeout=math.inf)
        if watches:
            asyncio.get_running_loop().call_later(SYNC_FALLBACK_SECONDS, self._sync_fallback,
                                                  marker)

    async def _watch_subscriber(self, client: aiomqtt.Client) -> None:
        """Take the snapshot of lease watches started while connected."""
        while True:
            await self._new_watch.wait()
            self._new_watch.clear()
            watches = [w for w in self._watches if w._marker is None and not w.is_synced]
            filters = list(dict.fromkeys(f for w in watches for f in w.filters))
            try:
                async with asyncio.timeout(10):
                    await self._subscribe(client, filters, watches)
            except (aiomqtt.MqttError, TimeoutError) as exc:
                log.warning("could not subscribe for a lease watch (%s)", exc)

    def _sync_fallback(self, marker: int) -> None:
        for w in list(self._watches):
            if w._marker == marker:
                log.info("no retained %s; the lease snapshot is what came within %gs",
                         self._status_topic, SYNC_FALLBACK_SECONDS)
                w._end_sync()

    def _states_fallback(self, marker: int) -> None:
        if self._states_marker == marker:
            self._states_synced.set()

    def _reconnected(self) -> None:
        """Connected again (`BrokerClient`'s: it asks after what it gave up)."""

    def _kick(self) -> None:
        for w in self._waiters:
            w.kick.set()

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

    def _call(self, callback: Callback, lease: Lease, event: LeaseEvent) -> None:
        """Queue a user callback (`Callbacks`: never awaited by the message handler or a
        keep-alive)."""
        if not self._closed:
            self._callbacks.put(callback, lease, event)

    # --- incoming ----------------------------------------------------------------------

    def _on_message(self, message: aiomqtt.Message) -> None:
        topic = str(message.topic)
        payload = message.payload if isinstance(message.payload, bytes | bytearray) else b""
        if topic == self._status_topic:
            self._on_status(bytes(payload), message.retain)
            return
        for watch in list(self._watches):
            watch._feed(topic, bytes(payload))
        if topic.startswith(self._leases_head):
            if topic.startswith(f"{self._leases_head}{self.scheduler}/"):
                self._on_state(topic.rsplit("/", 1)[-1], bytes(payload))
            return
        if not (topic.startswith(f"{self._events_head}{self.scheduler}/")
                or topic == self._reply_topic):
            return
        env = _json(bytes(payload))
        if env is None or not isinstance(env.get("data"), dict):
            log.warning("unreadable event on %s ignored", topic)
            return
        epoch = _epoch(env.get("leaderepoch"))
        if epoch < self._event_epoch:
            log.debug("event %s of leader epoch %d on %s dropped: epoch %d was seen",
                      env.get("id"), epoch, topic, self._event_epoch)
            return
        self._event_epoch = epoch
        self.leader_epoch = max(self.leader_epoch, epoch)
        eid = str(env.get("id", ""))
        if eid in self._seen:
            return
        self._seen[eid] = None
        if len(self._seen) > SEEN_IDS:
            self._seen.popitem(last=False)
        correlation = getattr(message.properties, "CorrelationData", None) \
            if message.properties is not None else None
        self._dispatch(env, bytes(correlation) if correlation else None)

    def _on_state(self, lease_id: str, payload: bytes) -> None:
        """A retained state of this scheduler's lease (empty: it has ended)."""
        state = _json(payload) if payload else None
        if state is None or state.get("state", "active") != "active":
            self._states.pop(lease_id, None)
        else:
            self._states[lease_id] = state
            lease = self._leases.get(lease_id)
            if lease is not None:
                lease._apply_state(state)
        pulse, self._state_pulse = self._state_pulse, asyncio.Event()
        pulse.set()

    def _on_status(self, payload: bytes, retained: bool) -> None:
        status = _json(payload)
        if status is not None and _epoch(status.get("epoch")) < self.leader_epoch:
            # A deposed leader's, late (its will, or a status from a connection it made
            # after the new leader's): the new leader is the one that serves.
            log.debug("P/status %r of leader epoch %d ignored: epoch %d was seen",
                      status.get("state"), _epoch(status.get("epoch")), self.leader_epoch)
            status = None
        if status is not None:
            self.leader_epoch = _epoch(status.get("epoch"))
            was = self.daemon_online
            before = self.daemon_status.get("boot_id") if self.daemon_status else None
            self.daemon_status = status
            # Online again, or online from another start (a restart, or another node of
            # the site taking over): what was sent before may be lost; send it again.
            if self.daemon_online and (not was or status.get("boot_id") != before):
                self._online_generation += 1
                if was is False:
                    log.info("the daemon is online again")
            elif was and not self.daemon_online:
                log.warning("the daemon is offline; requests wait for it")
            self._kick()
            pulse, self._status_pulse = self._status_pulse, asyncio.Event()
            pulse.set()
        if retained:
            self._status_retained += 1
            if self._states_marker and self._status_retained >= self._states_marker:
                self._states_synced.set()
            for watch in list(self._watches):
                if watch._marker is not None and watch._marker <= self._status_retained:
                    watch._end_sync()

    def _dispatch(self, env: Mapping[str, Any], correlation: bytes | None) -> None:
        """An event of this scheduler, seen for the first time (`BrokerClient`'s)."""
        raise NotImplementedError


def _settle(client: aiomqtt.Client) -> None:
    """Mark aiomqtt's disconnection error as seen: nobody awaits the future that holds
    it once the session ended, and asyncio would log "exception was never retrieved"."""
    fut = getattr(client, "_disconnected", None)
    if isinstance(fut, asyncio.Future) and fut.done() and not fut.cancelled():
        fut.exception()
