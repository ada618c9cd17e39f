"""The daemon's MQTT connect against a server that speaks MQTT 3.1.1 only: a small asyncio
server on a free port that answers every CONNECT as a 3.1.1 server answers an MQTT 5 one
(CONNACK return code 1, unacceptable protocol version) and closes the connection. The bus
is told at once, in words an operator can act on; with `mqtt.protocol: "3.1.1"` the
CONNECT is a 3.1.1 one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from broker.daemon.config import MqttConfig
from broker.edges.mqtt import NO_MQTT5, MqttError, connect

MQTT5_LEVEL, MQTT311_LEVEL = 5, 4


class Mqtt311Only:
    """Reads one CONNECT per connection, notes its protocol level, refuses MQTT 5 with
    CONNACK 1 and closes; accepts 3.1.1 (CONNACK 0) and keeps the connection open."""

    def __init__(self) -> None:
        self.levels: list[int] = []
        self.server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readexactly(2)  # fixed header: type, first length byte
            length, shift, byte = head[1] & 0x7F, 7, head[1]
            while byte & 0x80:
                byte = (await reader.readexactly(1))[0]
                length |= (byte & 0x7F) << shift
                shift += 7
            body = await reader.readexactly(length)
            level = body[6]  # after the protocol name "MQTT" (2 + 4 bytes)
            self.levels.append(level)
            if level == MQTT5_LEVEL:
                writer.write(b"\x20\x02\x00\x01")  # CONNACK, unacceptable protocol version
                await writer.drain()
                writer.close()
                return
            writer.write(b"\x20\x02\x00\x00")
            await writer.drain()
            await reader.read()  # until the client leaves
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return f"mqtt://127.0.0.1:{port}"


@pytest.fixture
async def mqtt311_only() -> AsyncIterator[Mqtt311Only]:
    fake = Mqtt311Only()
    fake.server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    try:
        yield fake
    finally:
        fake.server.close()
        await fake.server.wait_closed()


async def test_an_mqtt5_connect_to_a_311_server_is_refused_at_once_and_says_what_to_set(
        mqtt311_only: Mqtt311Only) -> None:
    started = time.monotonic()
    with pytest.raises(MqttError) as refused:
        await connect(MqttConfig(url=mqtt311_only.url, protocol="5"), "gb-test")
    assert str(refused.value) == NO_MQTT5
    assert 'mqtt.protocol to "3.1.1"' in NO_MQTT5
    assert time.monotonic() - started < 5  # not the CONNACK timeout
    assert mqtt311_only.levels == [MQTT5_LEVEL]  # no CONNECT again behind the bus's back


async def test_a_311_connect_to_a_311_server_is_taken(mqtt311_only: Mqtt311Only) -> None:
    conn = await connect(MqttConfig(url=mqtt311_only.url, protocol="3.1.1"), "gb-test")
    try:
        assert not conn.lost
    finally:
        await conn.close()
    assert mqtt311_only.levels == [MQTT311_LEVEL]
