"""The MQTT side under faults (SPEC §3): every session failure means reconnect, `offline`
on every way out, no packet over the announced size, retained state made true again after
a reconnect, retained requests refused. Real mosquitto throughout."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import json
import logging
import os
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiomqtt
import pytest
import structlog.testing
from daemon_helpers import PREFIX, StartDaemon
from mqtt_helpers import Mosquitto, MqttProbe, ProbeFactory, payload_json

from broker.daemon.assembly.process import quiet_closed_socket_callbacks
from broker.daemon.config import MqttConfig
from broker.edges import bus as bus_module
from broker.edges.bus import CONNECT_MARGIN, CONNECT_MIN, Bus
from broker.edges.mqtt import IN_FLIGHT, MqttError, connect, connected, describe, only
from broker.state.store import StateStore
from broker.wire.messages import OutboxRow, Topics

S = "sched-1"
EVENTS = f"{PREFIX}/events/{S}/"


def small(request_id: str, **extra: Any) -> dict[str, Any]:
    """A request the simulated market can place many times over."""
    return {"request_id": request_id, "gpu": ["T4", "L4", "A10G"], "gpus": 1,
            "lease_seconds": 3600, **extra}


def answered(msg: aiomqtt.Message) -> bool:
    return str(msg.topic).startswith(EVENTS) and "request_id" in payload_json(msg)["data"]


def test_exception_groups_of_any_depth_count_as_session_failures() -> None:
    lost = aiomqtt.MqttCodeError(4, "The client is not currently connected")
    nested = ExceptionGroup("tg", [ExceptionGroup("send", [lost, lost]), OSError("reset")])
    assert only(nested, (aiomqtt.MqttError, OSError))
    assert not only(ExceptionGroup("tg", [lost, ValueError("bug")]),
                     (aiomqtt.MqttError, OSError))
    assert describe(nested) == f"MqttCodeError: {lost} (and 2 more)"
    assert describe(OSError("reset")) == "OSError: reset"


async def test_the_daemon_rides_out_server_kills_under_load(
        start_daemon: StartDaemon, mosquitto: Mosquitto,
        caplog: pytest.LogCaptureFixture) -> None:
    """kill -9 of the MQTT server while the outbox is busy, three times: the daemon stays
    up, reconnects, and every request it took is answered once it is back."""
    caplog.set_level(logging.ERROR, logger="asyncio")
    rd = await start_daemon()
    decided: set[str] = set()
    busy = asyncio.Event()
    round_ = 0

    def observe(kind: str, data: dict[str, Any]) -> None:
        if "request_id" in data:
            decided.add(data["request_id"])
            if data["request_id"].startswith(f"load-{round_}-"):
                busy.set()  # this round's requests are being decided and published

    rd.daemon.broker.observers.append(observe)
    sent: list[str] = []
    for round_ in range(3):
        busy.clear()
        async with MqttProbe(mosquitto.url, []) as loader:
            for i in range(400):
                rid = f"load-{round_}-{i}"
                sent.append(rid)
                await loader.client.publish(f"{PREFIX}/requests/{S}/place",
                                            json.dumps(small(rid)).encode(), qos=0)
        async with asyncio.timeout(10):
            await busy.wait()  # decisions are being published: now kill
        sessions = rd.daemon.bus.connections
        await mosquitto.akill()
        assert not rd.task.done()
        await mosquitto.astart()
        async with asyncio.timeout(15):  # subscribed again, on the new server
            await rd.daemon.bus.connection_after(sessions)
    # Every request that reached the daemon decided and committed (the last round's may
    # still be queued: an empty outbox a moment before its next batch is committed says
    # nothing), then every row acknowledged.
    async with asyncio.timeout(15):
        await rd.daemon.broker.idle()
    assert await rd.daemon.bus.drained(15)
    assert not rd.task.done(), "the daemon must never exit because its MQTT server died"
    assert rd.daemon.bus.reconnects >= 3
    # What reached the daemon was decided and published (QoS 0 loads may lose some in the
    # kill itself, before the daemon saw them: those a scheduler re-sends).
    assert len(decided) >= 3 * 100
    assert await rd.daemon.store.pending() == []
    gc.collect()
    await asyncio.sleep(0)
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


async def test_an_internal_error_leaves_offline_to_the_will(
        mosquitto: Mosquitto, probe_factory: ProbeFactory, tmp_path: Path) -> None:
    """A task beside the bus fails: its task group cancels the bus, which must not
    disconnect cleanly (that would suppress the will) — `offline` is retained."""
    probe = await probe_factory([f"{PREFIX}/status"])
    store = StateStore(tmp_path / "s.db")
    await store.open()
    boot = str(uuid.uuid4())

    async def ignore(_: Any) -> None:
        return None

    bus = Bus(MqttConfig(url=mosquitto.url), Topics(PREFIX), store, client_id="gb-fatal",
              boot_id=boot, on_command=ignore)

    async def fail_once_connected() -> None:
        await bus.connected.wait()
        raise RuntimeError("an internal error")

    with pytest.raises(ExceptionGroup) as err:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(bus.run())
            tg.create_task(fail_once_connected())
    assert err.group_contains(RuntimeError)
    await store.close()
    online = await probe.wait_for(lambda m: payload_json(m)["state"] == "online")
    assert payload_json(online)["boot_id"] == boot
    offline = await probe.wait_for(lambda m: payload_json(m)["state"] == "offline")
    assert payload_json(offline)["boot_id"] == boot
    late = await probe_factory([f"{PREFIX}/status"])
    retained = await late.wait_for(f"{PREFIX}/status")
    assert retained.retain and payload_json(retained)["state"] == "offline"


async def test_no_message_over_the_packet_size_reaches_the_daemon(
        start_daemon: StartDaemon, probe_factory: ProbeFactory, mosquitto: Mosquitto) -> None:
    """mosquitto here has no max_packet_size: the daemon's own MQTT 5 Maximum Packet Size
    keeps a 1 MiB publish away from it, and the requests after it still flow."""
    rd = await start_daemon()
    probe = await probe_factory([f"{PREFIX}/events/#"])
    huge = b'{"request_id":"huge","gpu":"T4","gpus":1,"pad":"' + b"x" * (1 << 20) + b'"}'
    await probe.client.publish(f"{PREFIX}/requests/{S}/place", huge, qos=1)
    await probe.publish(f"{PREFIX}/requests/{S}/place", small("after-huge"))
    msg = await probe.wait_for(answered)
    assert payload_json(msg)["data"]["request_id"] == "after-huge"
    assert not probe.matching(lambda m: payload_json(m)["data"].get("request_id") == "huge")
    assert rd.daemon.book.find(S, "huge") is None
    assert not rd.task.done()


async def test_retained_state_is_restored_after_the_server_loses_it(
        start_daemon: StartDaemon, probe_factory: ProbeFactory, mosquitto: Mosquitto) -> None:
    rd = await start_daemon()
    probe = await probe_factory([f"{PREFIX}/events/#"])
    for i in range(30):
        await probe.publish(f"{PREFIX}/requests/{S}/place", small(f"keep-{i}"))
    await probe.wait_for_count(answered, 30, timeout=10)
    active = {le.lease_id for le in rd.daemon.book.active()}
    assert len(active) == 30
    capacity_before = len(rd.daemon.pool.health())
    assert capacity_before > 0
    rd.daemon.bus.restored.clear()
    await mosquitto.akill()  # nothing retained survives: this server saves on clean stops
    await mosquitto.astart()
    async with asyncio.timeout(15):
        await rd.daemon.bus.restored.wait()
    late = await probe_factory([f"{PREFIX}/leases/#", f"{PREFIX}/capacity/#",
                                f"{PREFIX}/status"])
    leases = await late.wait_for_count(f"{PREFIX}/leases/#", 30)
    assert {str(m.topic).rsplit("/", 1)[1] for m in leases} == active
    assert all(m.retain and payload_json(m)["state"] == "active" for m in leases)
    await late.wait_for(f"{PREFIX}/capacity/+/+/+")
    status = await late.wait_for(f"{PREFIX}/status")
    assert payload_json(status)["state"] == "online"


@pytest.mark.parametrize("left_memory", [False, True], ids=["in-memory", "left-memory"])
async def test_a_lease_that_ended_is_cleared_again_after_a_reconnect(
        start_daemon: StartDaemon, probe_factory: ProbeFactory, mosquitto: Mosquitto,
        left_memory: bool) -> None:
    """An MQTT server restored from an older save may hold the state of a lease that has
    ended since: the daemon clears it after the reconnect, read from the store whether
    or not the lease is still in the book's memory."""
    rd = await start_daemon()
    if left_memory:
        rd.daemon.book.keep_recent = 0
    probe = await probe_factory([f"{PREFIX}/events/#", f"{PREFIX}/leases/#"])
    await probe.publish(f"{PREFIX}/requests/{S}/place", small("gone"))
    ev = payload_json(await probe.wait_for(answered))
    lease_id = ev["data"]["lease_id"]
    topic = f"{PREFIX}/leases/{S}/{lease_id}"
    stale = await probe.wait_for(lambda m: str(m.topic) == topic and m.payload)
    await probe.publish(f"{PREFIX}/requests/{S}/release", {"lease_id": lease_id})
    await probe.wait_for(EVENTS + "lease.released")
    await probe.wait_for(lambda m: str(m.topic) == topic and not m.payload)
    assert (rd.daemon.book.get(lease_id) is None) is left_memory
    # The old state comes back, as from a save made before the release.
    await probe.publish(topic, stale.payload, retain=True)  # type: ignore[arg-type]
    rd.daemon.bus.restored.clear()
    await mosquitto.astop()
    await mosquitto.astart()
    async with asyncio.timeout(15):
        await rd.daemon.bus.restored.wait()
    late = await probe_factory([topic, f"{PREFIX}/status"])
    await late.wait_for(f"{PREFIX}/status")  # retained ones come in subscription order
    assert not late.matching(topic)


async def test_a_retained_request_is_refused_not_executed(
        start_daemon: StartDaemon, probe_factory: ProbeFactory) -> None:
    rd = await start_daemon()
    probe = await probe_factory([f"{PREFIX}/events/#"])
    place = f"{PREFIX}/requests/{S}/place"
    await probe.publish(place, small("sticky"), retain=True)
    msg = await probe.wait_for(EVENTS + "request.invalid")
    data = payload_json(msg)["data"]
    assert data["request_id"] == "sticky"
    assert [e["field"] for e in data["errors"]] == ["retain"]
    assert rd.daemon.book.find(S, "sticky") is None
    await probe.publish(place, b"", retain=True)  # clear it
    await probe.publish(place, small("plain"))
    await probe.wait_for(EVENTS + "placement.decided")
    assert rd.daemon.book.find(S, "plain") is not None
    assert rd.daemon.book.find(S, "sticky") is None


async def test_a_message_no_server_would_take_does_not_stop_the_outbox(
        mosquitto: Mosquitto, probe_factory: ProbeFactory, tmp_path: Path) -> None:
    """A row whose topic no server takes (a wildcard) would fail again after every
    reconnect: it is dropped (and logged), and the rows after it go out."""
    # The rows are made up here, not the daemon's events: no contract check.
    probe = await probe_factory([f"{PREFIX}/events/#"], check_contract=False)
    store = StateStore(tmp_path / "s.db")
    await store.open()

    async def ignore(_: Any) -> None:
        return None

    bus = Bus(MqttConfig(url=mosquitto.url), Topics(PREFIX), store, client_id="gb-poison",
              boot_id="b", on_command=ignore)
    rows = await store.commit([], [OutboxRow(f"{PREFIX}/events/{S}/+", b"{}"),
                                   OutboxRow(f"{PREFIX}/events/{S}/after", b"{}")])
    bus.enqueue(rows)
    task = asyncio.create_task(bus.run())
    try:
        await probe.wait_for(EVENTS + "after")
        assert await bus.drained(5)
        assert await store.pending() == []
        assert bus.reconnects == 0 and not task.done()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await store.close()


async def test_an_outbox_row_not_acknowledged_in_time_goes_out_on_the_next_connection(
        mosquitto: Mosquitto, probe_factory: ProbeFactory, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The MQTT server stops answering (SIGSTOP: the socket stays open) while a row is in
    flight: once its PUBACK is `PUBLISH_TIMEOUT` late the session ends, and the row goes
    out again, and is deleted, on the next connection."""
    monkeypatch.setattr(bus_module, "PUBLISH_TIMEOUT", 1.0)
    probe = await probe_factory([f"{PREFIX}/events/#"], check_contract=False)
    store = StateStore(tmp_path / "s.db")
    await store.open()
    lost = asyncio.Event()

    async def ignore(_: Any) -> None:
        return None

    bus = Bus(MqttConfig(url=mosquitto.url), Topics(PREFIX), store, client_id="gb-late",
              boot_id="b", on_command=ignore, on_lost=lost.set)
    task = asyncio.create_task(bus.run())
    pid = mosquitto.pid
    assert pid is not None
    try:
        async with asyncio.timeout(10):
            await bus.connected.wait()
        sessions = bus.connections
        os.kill(pid, signal.SIGSTOP)
        try:
            bus.enqueue(await store.commit([], [OutboxRow(f"{PREFIX}/events/{S}/late", b"{}")]))
            started = time.monotonic()
            async with asyncio.timeout(10):
                await lost.wait()
            assert 0.9 <= time.monotonic() - started < 5
            assert bus.outbox_depth == 1, "not acknowledged: still to send"
        finally:
            os.kill(pid, signal.SIGCONT)
        async with asyncio.timeout(30):
            await bus.connection_after(sessions)
        await probe.wait_for(EVENTS + "late", timeout=10)
        assert await bus.drained(10)
        assert await store.pending() == []
        assert bus.reconnects == 1 and not task.done()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await store.close()


async def test_a_socket_watch_on_a_closed_connection_is_not_logged_as_an_error() -> None:
    """paho may ask the loop to watch a socket that closed meanwhile (the server just
    went away): asyncio's traceback for that is quietened; any other error is not."""
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    before = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: seen.append(context))
    try:
        quiet_closed_socket_callbacks(loop)
        handler = loop.get_exception_handler()
        assert handler is not None
        closed = OSError(errno.EBADF, "Bad file descriptor")
        handler(loop, {"message": "Exception in callback", "exception": closed,
                       "handle": "<Handle BaseSelectorEventLoop.add_writer(10, <fn>)>"})
        assert seen == []
        other = {"message": "Exception in callback", "exception": ValueError("bug"),
                 "handle": "<Handle something>"}
        handler(loop, other)
        assert seen == [other]
    finally:
        loop.set_exception_handler(before)


async def test_an_acknowledgement_after_a_cancelled_call_is_not_an_error(
        mosquitto: Mosquitto, caplog: pytest.LogCaptureFixture) -> None:
    """A subscribe or a publish given up before its SUBACK or PUBACK (a task cancelled
    mid-call, a standby just elected): the late acknowledgement is no error, and a late
    PUBACK gives its place in the in-flight window back."""
    caplog.set_level(logging.DEBUG)
    cfg = MqttConfig(url=mosquitto.url)
    async with connected(cfg, f"late-ack-{uuid.uuid4().hex[:8]}", session=False) as client:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0):  # sent, then given up at once
                await client.subscribe("late/ack/1", qos=1)
        # More publishes given up than the window holds: the next one goes out only once
        # their late PUBACKs have freed their places.
        for i in range(IN_FLIGHT + 1):
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0):
                    await client.publish(f"late/ack/{i}", b"x")
        async with asyncio.timeout(10):
            await client.publish("late/ack/last", b"x")
            # SUBACKs come in order: once this one is back, the late one was handled.
            await client.subscribe("late/ack/2", qos=1)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_puback_after_the_end_is_not_sent_nor_logged_as_a_warning(
        mosquitto: Mosquitto, probe_factory: ProbeFactory,
        caplog: pytest.LogCaptureFixture) -> None:
    """A request held unacknowledged when its connection ends, and done after: its
    PUBACK is not written into the closed socket (which gmqtt would log as a warning,
    `[TRYING WRITE TO CLOSED SOCKET]`); the server delivers it again on the session's
    next connection."""
    caplog.set_level(logging.DEBUG)
    cfg = MqttConfig(url=mosquitto.url)
    client_id = f"gb-held-{uuid.uuid4().hex[:8]}"
    scheduler = await probe_factory([])
    conn = await connect(cfg, client_id, manual_ack=True)
    await conn.subscribe("held/#", qos=1)
    await scheduler.publish("held/a", b"once")
    messages = conn.messages()
    async with asyncio.timeout(5):
        held = await anext(messages)
    assert held.ack is not None
    conn.drop()
    with pytest.raises(MqttError):
        await anext(messages)
    held.ack()  # done after the end
    assert not [r for r in caplog.records
                if r.name.startswith("gmqtt") and "CLOSED SOCKET" in r.getMessage()]
    async with connected(cfg, client_id, manual_ack=True) as again:
        async with asyncio.timeout(5):
            redelivered = await anext(again.messages())
    assert (redelivered.topic, redelivered.payload) == ("held/a", b"once")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# --- leading a site: when the bus may connect as the site (#26) ---------------------


class Lead:
    """A leadership that holds until `deadline` (time.monotonic()): what the daemon
    hands the bus from broker.state.leadership, `valid()` and the time left."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def valid(self) -> bool:
        return time.monotonic() < self.deadline

    def time_left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


class HeldBackProxy:
    """A TCP proxy to the MQTT server that forwards what the client sends at once and
    holds what the server sends (the CONNACK) until `release()`."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.released = asyncio.Event()
        self.accepted = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _accept(self, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self._writers += [writer, up_writer]
        self.accepted.set()
        for task in (self._pump(reader, up_writer, None),
                     self._pump(up_reader, writer, self.released)):
            t = asyncio.create_task(task)
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                    gate: asyncio.Event | None) -> None:
        with contextlib.suppress(OSError):
            while data := await src.read(65536):
                if gate is not None:
                    await gate.wait()
                dst.write(data)
                await dst.drain()
        with contextlib.suppress(OSError):
            dst.close()

    def release(self) -> None:
        self.released.set()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for w in self._writers:
            w.close()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def _leading_bus(url: str, store: StateStore, client_id: str, lead: Lead) -> Bus:
    async def ignore(_: Any) -> None:
        return None

    return Bus(MqttConfig(url=url), Topics(PREFIX), store, client_id=client_id,
               boot_id=str(uuid.uuid4()), on_command=ignore, node="n1", epoch=lambda: 2,
               may_publish=lead.valid, time_left=lead.time_left)


async def _until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll `condition` (a log, a clock: nothing to wait on) until it holds."""
    async with asyncio.timeout(timeout):
        while not condition():  # noqa: ASYNC110 - no event to wait on (see above)
            await asyncio.sleep(0.02)


async def _until_fenced(logs: list[dict[str, Any]], timeout: float = 5.0) -> None:
    """Until the bus has said it does not lead (its connect given up, or left)."""
    await _until(lambda: any(e["event"].startswith("mqtt closed: this node does not lead")
                             for e in logs), timeout)


async def test_a_leader_with_too_little_time_left_does_not_connect_as_the_site(
        mosquitto: Mosquitto, probe_factory: ProbeFactory, tmp_path: Path) -> None:
    """The leadership holds for less than a connect may take plus the margin: the bus
    waits for a renewal instead of connecting; none comes, the leadership lapses, and
    the bus never connected — the site's session (held here by a newer leader's
    client) is not taken, and nothing appears on P/status."""
    probe = await probe_factory([f"{PREFIX}/status"])
    store = StateStore(tmp_path / "s.db")
    await store.open()
    client_id = f"gb-site-{uuid.uuid4().hex[:8]}"
    lead = Lead(CONNECT_MARGIN + CONNECT_MIN / 2)
    bus = await _leading_bus(mosquitto.url, store, client_id, lead)
    async with connected(MqttConfig(url=mosquitto.url), client_id) as newer:
        with structlog.testing.capture_logs() as logs:
            task = asyncio.create_task(bus.run())
            try:
                await _until_fenced(logs)
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        # The newer leader's session is still its own: a round trip on it works.
        async with asyncio.timeout(5):
            await newer.subscribe(f"{PREFIX}/probe", qos=1)
    assert bus.connections == 0
    await probe.publish(f"{PREFIX}/status", b"", retain=False)  # a marker: nothing before
    marker = await probe.wait_for(f"{PREFIX}/status")
    assert probe.messages[0] is marker, [payload_json(m) for m in probe.messages[:-1]]
    await store.close()


async def test_a_connection_made_after_the_leadership_lapsed_is_left_without_a_will(
        mosquitto: Mosquitto, probe_factory: ProbeFactory, tmp_path: Path) -> None:
    """The connect started in time, but its CONNACK came after the leadership lapsed
    (the network held it back): the connection may have taken the site's session from
    a newer leader. The bus leaves it with a DISCONNECT: no `online`, and no will (the
    will's `offline`, of the old epoch, would be retained after the newer leader's
    `online`)."""
    probe = await probe_factory([f"{PREFIX}/status"])
    store = StateStore(tmp_path / "s.db")
    await store.open()
    host, port = mosquitto.url.removeprefix("mqtt://").rsplit(":", 1)
    proxy = HeldBackProxy(host, int(port))
    proxy_port = await proxy.start()
    client_id = f"gb-late-{uuid.uuid4().hex[:8]}"
    lead = Lead(1.0)
    bus = await _leading_bus(f"mqtt://127.0.0.1:{proxy_port}", store, client_id, lead)
    try:
        with structlog.testing.capture_logs() as logs:
            task = asyncio.create_task(bus.run())
            try:
                async with asyncio.timeout(5):
                    await proxy.accepted.wait()
                # The CONNACK waits at the proxy until the leadership has lapsed.
                await _until(lambda: not lead.valid())
                proxy.release()
                await _until_fenced(logs)
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        # mosquitto logs how the connection ended; a will is sent before that line.
        await _until(lambda: any(f"Client {client_id} {how}" in mosquitto.log_text()
                                 for how in ("disconnected", "closed its connection")))
        assert f"Client {client_id} disconnected" in mosquitto.log_text()
        assert bus.connections == 0
        await probe.publish(f"{PREFIX}/status", b"", retain=False)  # a marker
        marker = await probe.wait_for(f"{PREFIX}/status")
        assert probe.messages[0] is marker, [payload_json(m) for m in probe.messages[:-1]]
    finally:
        await proxy.close()
        await store.close()
