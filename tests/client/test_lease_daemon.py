"""The client's contract 1.1 lease features against the real daemon on a real mosquitto,
on MQTT 5 and 3.1.1: a renewal at an epoch the lease has left learns the failover from
`lease.current` and is sent again at the new epoch; a report sent again moves the lease
once; `lease_seconds` comes from the daemon; `report.declined` is `ReportDeclined`; and
`request.invalid` for a lease the scheduler does not have is matched at once.

What the client must not see (or not yet) is held back by `FilteringProxy`, a TCP proxy
between the client and mosquitto that reads the MQTT packets coming down and can drop or
hold back the PUBLISH packets of chosen topics."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from daemon_helpers import RunningDaemon, StartDaemon
from mqtt_helpers import Mosquitto

from gpubroker_client import (
    BrokerClient,
    InvalidRequest,
    LeaseEventKind,
    ReportDeclined,
)

S = "train"
GPUS = ["A100-80GB", "H100-80GB"]
PROTOCOLS = ["5", "3.1.1"]
PUBLISH = 3


class FilteringProxy:
    """A TCP proxy to mosquitto, one client connection at a time. Up: forwarded as is.
    Down: packet by packet; a PUBLISH whose topic `drop(topic)` is dropped (never
    acknowledged: mosquitto keeps it in flight), one whose topic `hold(topic)` waits
    until `resume()`; every other packet (CONNACK, PUBACK, SUBACK, PINGRESP) passes."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.drop: Callable[[str], bool] = lambda _: False
        self.hold: Callable[[str], bool] = lambda _: False
        self.dropped: list[str] = []
        self._held: list[bytes] = []
        self._down: asyncio.StreamWriter | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"mqtt://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aenter__(self) -> FilteringProxy:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in list(self._tasks):
            task.cancel()
        for w in self._writers:
            w.close()
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        self._writers += [writer, up_writer]
        self._down = writer
        for coro in (self._up(reader, up_writer), self._downward(up_reader, writer)):
            task = asyncio.create_task(coro)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _up(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        dst.close()

    async def _downward(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while True:
                packet = await _packet(src)
                topic = _topic(packet) if packet[0] >> 4 == PUBLISH else None
                if topic is not None and self.drop(topic):
                    self.dropped.append(topic)
                    continue
                if topic is not None and (self._held or self.hold(topic)):
                    self._held.append(packet)  # in order behind the first held one
                    continue
                dst.write(packet)
                await dst.drain()
        dst.close()

    def resume(self) -> None:
        """Pass on what was held back, in order, and hold nothing more."""
        self.hold = lambda _: False
        held, self._held = self._held, []
        if self._down is not None:
            for packet in held:
                self._down.write(packet)


async def _packet(src: asyncio.StreamReader) -> bytes:
    """One MQTT control packet: fixed header, remaining length (varint), the rest."""
    head = await src.readexactly(1)
    length, shift, raw = 0, 0, b""
    while True:
        byte = await src.readexactly(1)
        raw += byte
        length |= (byte[0] & 0x7F) << shift
        shift += 7
        if not byte[0] & 0x80:
            break
    return head + raw + await src.readexactly(length)


def _topic(packet: bytes) -> str:
    i = 1
    while packet[i] & 0x80:
        i += 1
    i += 1
    n = int.from_bytes(packet[i:i + 2], "big")
    return packet[i + 2:i + 2 + n].decode()


class Emitted:
    """The daemon's events, as it emits them (a broker observer); `until(kind, n)`
    waits for the n-th of a kind."""

    def __init__(self, rd: RunningDaemon) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._pulse = asyncio.Event()
        rd.daemon.broker.observers.append(self.observe)

    def observe(self, kind: str, data: dict[str, Any]) -> None:
        self.events.append((kind, data))
        self._pulse.set()

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [d for k, d in self.events if k == kind]

    async def until(self, kind: str, n: int = 1, timeout: float = 10) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            while len(self.of(kind)) < n:
                self._pulse.clear()
                await self._pulse.wait()
        return self.of(kind)[n - 1]


def client(url: str, protocol: str, instance: str, **kw: Any) -> BrokerClient:
    return BrokerClient(url, scheduler=S, protocol=protocol,  # type: ignore[arg-type]
                        instance=instance, **kw)


def failover_news(topic: str) -> bool:
    """The failover event and the retained lease state: how a client learns a move."""
    return topic.endswith("/lease.failover") or "/leases/" in topic


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_renewal_at_the_old_epoch_learns_the_failover_from_lease_current(
        start_daemon: StartDaemon, mosquitto: Mosquitto, protocol: str) -> None:
    """Another handle's report moves the lease; the holder never hears of it but by the
    answer to its renewal (`lease.current`): it takes the new epoch and placement and
    renews at that epoch; nothing moves again."""
    rd = await start_daemon()
    emitted = Emitted(rd)
    async with FilteringProxy(mosquitto.port) as proxy, \
            client(proxy.url, protocol, "holder") as holder, \
            client(mosquitto.url, protocol, "other") as other:
        seen: list[Any] = []
        told = asyncio.Event()

        def on_failover(_: Any, event: Any) -> None:
            seen.append(event)
            told.set()

        lease = await holder.place(gpu=GPUS, gpus=8, market="spot", on_failover=on_failover)
        assert lease.epoch == 1
        proxy.drop = failover_news
        moved = await other.report(lease.lease_id, "interrupted", epoch=1)
        assert moved.epoch == 2 and lease.epoch == 1
        await lease.renew(timeout=10)
        stale = emitted.of("lease.current")
        assert [d["stale_epoch"] for d in stale] == [1]
        assert lease.epoch == 2 and lease.placement == moved.placement
        async with asyncio.timeout(5):  # callbacks run in a task of their own
            await told.wait()
        (learnt,) = seen
        assert learnt.kind is LeaseEventKind.FAILOVER and learnt.epoch == 2
        assert learnt.previous is not None and learnt.previous != lease.placement
        renewed = emitted.of("lease.renewed")
        assert [d["epoch"] for d in renewed] == [2]
        assert len(emitted.of("lease.failover")) == 1  # the other handle's report only
        assert proxy.dropped  # the client could not have learnt it otherwise
        daemon_lease = rd.daemon.book.get(lease.lease_id)
        assert daemon_lease is not None and daemon_lease.epoch == 2
        await lease.release()


async def test_a_report_at_the_old_epoch_returns_the_move_and_moves_nothing(
        start_daemon: StartDaemon, mosquitto: Mosquitto) -> None:
    rd = await start_daemon()
    emitted = Emitted(rd)
    async with FilteringProxy(mosquitto.port) as proxy, \
            client(proxy.url, "5", "holder") as holder, \
            client(mosquitto.url, "5", "other") as other:
        lease = await holder.place(gpu=GPUS, gpus=8, market="spot")
        proxy.drop = failover_news
        moved = await other.report(lease.lease_id, "interrupted", epoch=1)
        event = await lease.report("unhealthy", timeout=10)
        assert event.kind is LeaseEventKind.FAILOVER and event.epoch == 2
        assert lease.epoch == 2 and lease.placement == moved.placement
        assert [d["stale_epoch"] for d in emitted.of("lease.current")] == [1]
        assert len(emitted.of("lease.failover")) == 1
        await lease.release()


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_report_sent_again_before_its_answer_moves_the_lease_once(
        start_daemon: StartDaemon, mosquitto: Mosquitto, protocol: str) -> None:
    """The answer to a report is held back; the client sends the report again (same
    epoch) meanwhile; the daemon answers the repeat `lease.current`; the lease moved
    once, and the client's report returns that move."""
    rd = await start_daemon()
    emitted = Emitted(rd)
    async with FilteringProxy(mosquitto.port) as proxy, \
            client(proxy.url, protocol, "holder", resend_after=0.2) as holder:
        lease = await holder.place(gpu=GPUS, gpus=8, market="spot")
        first = lease.placement
        proxy.hold = lambda topic: "/events/" in topic or "/reply/" in topic or \
            "/leases/" in topic
        reporting = asyncio.create_task(lease.report("launch_failed", timeout=15))
        await emitted.until("lease.failover")
        await emitted.until("lease.current")  # the report sent again reached the daemon
        proxy.resume()
        event = await reporting
        assert event.kind is LeaseEventKind.FAILOVER and event.epoch == 2
        assert event.previous == first and lease.placement == event.placement
        assert lease.epoch == 2
        assert len(emitted.of("lease.failover")) == 1
        assert all(d["stale_epoch"] == 1 for d in emitted.of("lease.current"))
        daemon_lease = rd.daemon.book.get(lease.lease_id)
        assert daemon_lease is not None and daemon_lease.epoch == 2
        await lease.renew(timeout=10)  # at epoch 2: renewed, not lease.current
        renewed = emitted.of("lease.renewed")  # (a renewal may be sent again: 0.2 s)
        assert renewed and {d["epoch"] for d in renewed} == {2}
        await lease.release()


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_lease_seconds_come_from_the_daemon(start_daemon: StartDaemon,
                                                  mosquitto: Mosquitto,
                                                  protocol: str) -> None:
    """A lease placed with lease_seconds=120, asked for again, and adopted (by request_id
    and by lease_id) has the daemon's 120 s: not the time left read off an answer."""
    await start_daemon()
    async with client(mosquitto.url, protocol, "first") as first, \
            client(mosquitto.url, protocol, "second") as second:
        lease = await first.place(gpu=GPUS, gpus=8, market="spot", request_id="job",
                                  lease_seconds=120)
        assert lease.lease_seconds == 120
        assert lease.decided["lease_seconds"] == 120
        again = await first.place(gpu=GPUS, gpus=8, market="spot", request_id="job")
        assert again is lease and again.lease_seconds == 120
        by_request = await second.adopt(request_id="job")
        assert by_request.lease_id == lease.lease_id and by_request.lease_seconds == 120
        assert by_request.seconds_left < 120  # so the old rule would not give 120
    async with client(mosquitto.url, protocol, "third") as third:
        by_id = await third.adopt(lease.lease_id)
        assert by_id.lease_seconds == 120
        by_id.keep_alive()  # half the daemon's period, not of the time left
        await by_id.release()


POLICY_FLAP = """
version: 1
failover:
  max_failovers_per_hour: 1
"""


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_report_held_back_by_the_policy_raises_report_declined(
        start_daemon: StartDaemon, mosquitto: Mosquitto, tmp_path: Path,
        protocol: str) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY_FLAP)
    rd = await start_daemon(policy_file=policy)
    emitted = Emitted(rd)
    async with client(mosquitto.url, protocol, "holder") as c:
        lease = await c.place(gpu=GPUS, gpus=8, market="spot")
        moved = await lease.report("interrupted")
        assert moved.epoch == 2
        with pytest.raises(ReportDeclined) as declined:
            await lease.report("interrupted", timeout=10)
        exc = declined.value
        assert (exc.lease_id, exc.epoch, exc.kind) == (lease.lease_id, 2, "interrupted")
        assert 3500 < exc.retry_after <= 3600
        assert "max_failovers_per_hour" in exc.reason
        assert lease.epoch == 2 and lease.active
        with pytest.raises(ReportDeclined):  # by id too
            await c.report(lease.lease_id, "interrupted", epoch=2, timeout=10)
        assert len(emitted.of("lease.failover")) == 1
        await lease.release()


async def test_request_invalid_for_a_lease_unknown_is_answered_at_once_on_3_1_1(
        start_daemon: StartDaemon, mosquitto: Mosquitto) -> None:
    await start_daemon(protocol="3.1.1")
    async with client(mosquitto.url, "3.1.1", "cli") as c:
        for verb in (c.renew, c.release):
            started = time.monotonic()
            with pytest.raises(InvalidRequest) as invalid:
                await verb("L-nobody", timeout=30)
            took = time.monotonic() - started
            assert invalid.value.errors[0]["field"] == "lease_id"
            assert invalid.value.event is not None
            assert invalid.value.event["data"]["lease_id"] == "L-nobody"
            assert took < 5, f"{verb.__name__}: answered after {took:.1f} s"
        with pytest.raises(InvalidRequest):
            await c.report("L-nobody", "interrupted", epoch=1, timeout=30)

