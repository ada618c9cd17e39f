"""Nothing lost between receipt and commit (#26): on MQTT 5 the daemon acknowledges a
request only once its outcome is committed, in the order the requests came, and
announces a Receive Maximum; on MQTT 3.1.1 it acknowledges on receipt. Real mosquitto
(its log, `log_type all`, shows the PUBLISH and PUBACK packets) and real SQLite."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from daemon_helpers import (
    BIG_LABELS,
    PREFIX,
    RunningDaemon,
    StartDaemon,
    daemon_config,
    fill_up,
    start_until_ready,
)
from mqtt_helpers import Mosquitto, MqttProbe, ProbeFactory, payload_json

from broker.daemon.config import MqttConfig
from broker.edges.bus import Bus
from broker.edges.mqtt import RECEIVE_MAXIMUM
from broker.leasing.authority import REPEATED
from broker.state.store import StateStore, StoreFailed
from broker.wire.commands import Command
from broker.wire.messages import Topics

S = "sched-1"
PLACE = f"{PREFIX}/requests/{S}/place"


async def _until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll `condition` (a counter, a log file: nothing to wait on) until it holds."""
    async with asyncio.timeout(timeout):
        while not condition():  # noqa: ASYNC110 - no event to wait on (see above)
            await asyncio.sleep(0.02)


def _log_lines(mosquitto: Mosquitto, client_id: str) -> list[str]:
    """mosquitto's PUBLISH sent to and PUBACK received from `client_id`, in order."""
    return [line for line in mosquitto.log_text().splitlines()
            if f"Sending PUBLISH to {client_id} " in line
            or f"Received PUBACK from {client_id} " in line]


def _requests_sent(mosquitto: Mosquitto, client_id: str) -> list[int]:
    """The mids of the requests mosquitto sent `client_id`, in order."""
    out = []
    for line in _log_lines(mosquitto, client_id):
        m = re.search(r"Sending PUBLISH to \S+ \(d\d, q1, r\d, m(\d+), '([^']*)'", line)
        if m and m.group(2).startswith(f"{PREFIX}/requests/"):
            out.append(int(m.group(1)))
    return out


def _pubacks(mosquitto: Mosquitto, client_id: str) -> list[int]:
    """The mids `client_id` acknowledged to mosquitto, in order."""
    out = []
    for line in _log_lines(mosquitto, client_id):
        m = re.search(r"Received PUBACK from \S+ \(Mid: (\d+)", line)
        if m:
            out.append(int(m.group(1)))
    return out


class Receiver:
    """A bus whose broker is the test: it records the commands and says when each is
    done."""

    def __init__(self, mosquitto: Mosquitto, store: StateStore, *, protocol: str = "5",
                 **kwargs: Any) -> None:
        self.client_id = f"gb-acks-{uuid.uuid4().hex[:6]}"
        self.commands: list[Command] = []
        self.bus = Bus(MqttConfig(url=mosquitto.url, protocol=protocol), Topics(PREFIX),
                       store, client_id=self.client_id, boot_id=str(uuid.uuid4()),
                       on_command=self._take, **kwargs)

    async def _take(self, command: Command) -> None:
        self.commands.append(command)

    async def got(self, n: int) -> list[Command]:
        await _until(lambda: len(self.commands) >= n)
        return self.commands

    async def round_trip(self) -> None:
        """A publish of the bus acknowledged by the server: every PUBACK the bus sent
        before it has reached mosquitto (one TCP stream), and so its log."""
        assert await self.bus.publish_now(f"{PREFIX}/test/round-trip", b"{}")


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[StateStore]:
    st = StateStore(tmp_path / "state.db")
    await st.open()
    yield st
    await st.close()


@contextlib.asynccontextmanager
async def running(receiver: Receiver) -> AsyncIterator[Receiver]:
    task = asyncio.create_task(receiver.bus.run())
    try:
        async with asyncio.timeout(10):
            await receiver.bus.connected.wait()
        yield receiver
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def finish(command: Command) -> None:
    """What the broker does once the command's outcome is committed."""
    assert command.done is not None, "an MQTT 5 request is acknowledged when done"
    command.done()


def payload_json_of(command: Command) -> Any:
    return json.loads(command.payload)


def body(request_id: str) -> dict[str, Any]:
    return {"request_id": request_id, "gpu": ["T4"], "gpus": 1}


# --- the bus ----------------------------------------------------------------------------


async def test_a_request_not_done_is_delivered_again_on_the_next_connection(
        mosquitto: Mosquitto, store: StateStore, probe_factory: ProbeFactory) -> None:
    """The connection is lost before the request is done: it was not acknowledged, so
    the server delivers it again on the session's next connection; once done there it
    is acknowledged and not delivered a third time. (Acknowledged on receipt, it never
    came again.)"""
    scheduler = await probe_factory([])
    async with running(Receiver(mosquitto, store)) as r:
        await scheduler.publish(PLACE, body("r1"))
        first = (await r.got(1))[0]
        connections = r.bus.connections
        client = r.bus._client
        assert client is not None
        client.drop()  # the connection dies (no DISCONNECT), the daemon lives on
        again = (await r.got(2))[1]
        assert r.bus.connections == connections + 1
        assert (again.topic, again.payload) == (first.topic, first.payload)
        finish(first)  # the old connection's: dropped, nothing is sent
        finish(again)
        await r.round_trip()
        assert r.bus.unacknowledged == 0
        # Acknowledged now: after one more lost connection, only new requests come.
        client = r.bus._client
        assert client is not None
        client.drop()
        await r.bus.connection_after(connections + 1)
        await scheduler.publish(PLACE, body("r2"))
        commands = await r.got(3)
        assert [payload_json_of(c)["request_id"] for c in commands] == ["r1", "r1", "r2"]


async def test_acknowledgements_wait_for_every_earlier_request(
        mosquitto: Mosquitto, store: StateStore, probe_factory: ProbeFactory) -> None:
    """Two requests, the second done first: nothing is acknowledged before the first is
    done (MQTT 5 §4.6: PUBACKs in the order the PUBLISHes came), then both, in order.
    A message dropped without a command (a reserved scheduler id) is acknowledged at
    once, in its place in the line."""
    scheduler = await probe_factory([])
    async with running(Receiver(mosquitto, store)) as r:
        await scheduler.publish(PLACE, body("a"))
        await scheduler.publish(PLACE, body("b"))
        a, b = await r.got(2)
        await r.round_trip()
        assert _pubacks(mosquitto, r.client_id) == []  # neither is done
        finish(b)
        await r.round_trip()
        assert _pubacks(mosquitto, r.client_id) == []  # b waits for a
        assert r.bus.unacknowledged == 2
        finish(a)
        sent = _requests_sent(mosquitto, r.client_id)
        assert len(sent) == 2
        await _until(lambda: len(_pubacks(mosquitto, r.client_id)) == 2)
        assert _pubacks(mosquitto, r.client_id) == sent
        # Dropped here (no command, nothing to commit): acknowledged at once.
        await scheduler.publish(f"{PREFIX}/requests/_ops/place", body("c"))
        await _until(lambda: r.bus.received == 3)
        await _until(lambda: len(_pubacks(mosquitto, r.client_id)) == 3)
        assert len(r.commands) == 2 and r.bus.unacknowledged == 0


async def test_mqtt_3_1_1_acknowledges_on_receipt(
        mosquitto: Mosquitto, store: StateStore, probe_factory: ProbeFactory) -> None:
    """Over 3.1.1 nothing changes: no Receive Maximum, the PUBACK goes at once (the
    command has no `done`)."""
    scheduler = await probe_factory([], protocol="3.1.1")
    async with running(Receiver(mosquitto, store, protocol="3.1.1")) as r:
        await scheduler.publish(PLACE, body("a"))
        (a,) = await r.got(1)
        assert a.done is None
        await r.round_trip()
        assert _pubacks(mosquitto, r.client_id) == _requests_sent(mosquitto, r.client_id)
        assert len(_pubacks(mosquitto, r.client_id)) == 1
        assert r.bus.unacknowledged == 0


async def test_the_server_sends_no_more_than_the_receive_maximum(
        mosquitto: Mosquitto, store: StateStore, probe_factory: ProbeFactory) -> None:
    """With 3 requests unacknowledged (Receive Maximum 3; mosquitto's own in-flight
    limit is 20) the other requests wait at the server; each one done lets one more
    come."""
    assert RECEIVE_MAXIMUM >= 256
    scheduler = await probe_factory([])
    async with running(Receiver(mosquitto, store, receive_maximum=3)) as r:
        for i in range(6):
            await scheduler.publish(PLACE, body(f"r{i}"))
        await r.got(3)
        await r.round_trip()
        assert len(_requests_sent(mosquitto, r.client_id)) == 3
        assert r.bus.received == 3 and len(r.commands) == 3
        finish(r.commands[0])
        await r.got(4)
        for c in r.commands[1:]:
            finish(c)
        commands = await r.got(6)
        for c in commands[4:]:
            finish(c)
        assert [payload_json_of(c)["request_id"] for c in commands] == \
            [f"r{i}" for i in range(6)]
        await _until(lambda: len(_pubacks(mosquitto, r.client_id)) == 6)
        assert _pubacks(mosquitto, r.client_id) == _requests_sent(mosquitto, r.client_id)


# --- the daemon -------------------------------------------------------------------------


def decided(request_id: str) -> Callable[[Any], bool]:
    def match(msg: Any) -> bool:
        return (str(msg.topic) == f"{PREFIX}/events/{S}/placement.decided"
                and payload_json(msg)["data"]["request_id"] == request_id)
    return match


async def _all_seen(probe: MqttProbe) -> list[Any]:
    """Every event published so far, once this marker has come back."""
    mark = probe.mark()
    await probe.publish(f"{PREFIX}/events/{S}/marker", {"end": True})
    await probe.wait_for(f"{PREFIX}/events/{S}/marker", since=mark)
    return [payload_json(m) for m in probe.messages if not str(m.topic).endswith("/marker")]


@pytest.fixture
async def daemons() -> AsyncIterator[list[RunningDaemon]]:
    """Daemons started by the test (one may end with an error), stopped at teardown."""
    started: list[RunningDaemon] = []
    yield started
    for rd in started:
        if not rd.task.done():
            await rd.stop()




async def test_a_request_received_before_a_crash_is_answered_by_the_next_boot(
        mosquitto: Mosquitto, daemons: list[RunningDaemon], probe_factory: ProbeFactory,
        tmp_path: Path) -> None:
    """The daemon receives a request and dies before its commit (the store refuses it:
    crash-only). Not acknowledged, the request waits in the session, and the next boot
    places it: answered exactly once, one lease. (Acknowledged on receipt, it was
    lost: nobody ever answered it.)"""
    probe = await probe_factory([f"{PREFIX}/events/#"])
    cfg = daemon_config(mosquitto, tmp_path / "state.db")
    first = await start_until_ready(cfg, daemons)
    await first.daemon.store.call(fill_up)
    await probe.publish(PLACE, {**body("doomed"), "labels": BIG_LABELS})
    async with asyncio.timeout(15):
        with pytest.raises(StoreFailed):
            await first.task
    second = await start_until_ready(cfg, daemons)
    answer = payload_json(await probe.wait_for(decided("doomed"), timeout=15))
    assert answer["bootid"] == second.daemon.boot_id
    events = await _all_seen(probe)
    assert [e["data"]["lease_id"] for e in events
            if e["data"].get("request_id") == "doomed"] == [answer["data"]["lease_id"]]
    lease = await second.daemon.store.find_lease(S, "doomed")
    assert lease is not None and lease.lease_id == answer["data"]["lease_id"]
    await _until(lambda: second.daemon.bus.unacknowledged == 0)


async def test_a_request_delivered_again_gets_the_lease_it_already_has(
        start_daemon: StartDaemon, probe_factory: ProbeFactory) -> None:
    """The commit of a request is held back (the store's thread is busy) while the
    daemon's connection dies: the request is delivered again on the next connection,
    and once the commit lands the repeat is answered from the lease book: the same
    lease, one lease in the store."""
    probe = await probe_factory([f"{PREFIX}/events/#"])
    rd = await start_daemon()
    bus = rd.daemon.bus
    gate = asyncio.Event()
    loop = asyncio.get_running_loop()
    held = asyncio.create_task(rd.daemon.store.call(
        lambda _db: asyncio.run_coroutine_threadsafe(gate.wait(), loop).result(10)))
    try:
        await probe.publish(PLACE, body("held"))
        await _until(lambda: bus.received == 1 and bus.unacknowledged == 1)
        connections = bus.connections
        client = bus._client
        assert client is not None
        client.drop()
        await bus.connection_after(connections)
        await _until(lambda: bus.received == 2)  # delivered again, not acknowledged yet
        assert probe.matching(decided("held")) == []  # the commit is still held
    finally:
        gate.set()
        await held
    answers = [payload_json(m) for m in await probe.wait_for_count(decided("held"), 2)]
    assert answers[0]["data"]["lease_id"] == answers[1]["data"]["lease_id"]
    assert answers[1]["data"]["reason"] == REPEATED
    stored = await rd.daemon.store.find_leases([(S, "held")])
    assert [le.lease_id for parts in stored.values() for le in parts] == \
        [answers[0]["data"]["lease_id"]]
    await _until(lambda: bus.unacknowledged == 0)
