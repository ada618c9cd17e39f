"""The daemon's MQTT connection writes what one turn of the event loop sends in one write
(`broker.edges.mqtt._Corked`), against a real mosquitto: the packets arrive all, in
order; a clean close still sends its DISCONNECT (the server discards the will); a
dropped connection sends nothing it held (the server publishes the will)."""

from __future__ import annotations

import asyncio
from typing import Any

from mqtt_helpers import Mosquitto, ProbeFactory

from broker.daemon.config import MqttConfig
from broker.edges.mqtt import Will, connect

TOPIC = "gb-test/writes"
WILL = "gb-test/will"


def _count_writes(conn: Any) -> list[int]:
    """The sizes of the writes to the connection's socket from now on."""
    corked = conn._client._connection._transport
    socket_transport = corked._transport
    sizes: list[int] = []
    write = socket_transport.write

    def counting(data: bytes) -> None:
        sizes.append(len(data))
        write(data)

    socket_transport.write = counting
    return sizes


async def test_publishes_made_in_one_turn_go_out_in_one_write_all_and_in_order(
        mosquitto: Mosquitto, probe_factory: ProbeFactory) -> None:
    probe = await probe_factory([TOPIC])
    for protocol in ("5", "3.1.1"):
        since = probe.mark()
        conn = await connect(MqttConfig(url=mosquitto.url, protocol=protocol),
                             f"gb-writes-{protocol}")
        try:
            writes = _count_writes(conn)
            n = 50
            async with asyncio.timeout(10):
                await asyncio.gather(*(conn.publish(TOPIC, f"{protocol}:{i}".encode())
                                       for i in range(n)))
            got = await probe.wait_for_count(TOPIC, n, since=since)
        finally:
            await conn.close()
        assert [m.payload for m in got] == [f"{protocol}:{i}".encode() for i in range(n)]
        assert 1 <= len(writes) < n / 5  # not one write a publish


async def test_a_clean_close_still_says_disconnect_and_a_drop_leaves_the_will(
        mosquitto: Mosquitto, probe_factory: ProbeFactory) -> None:
    """Three connections with a will each: closed cleanly, left (DISCONNECT written and the
    socket closed at once, as a connection the leadership no longer covers is left), and
    dropped. Only the dropped one's will is published: the server gets the others'
    DISCONNECT, which was waiting to be written when their socket closed."""
    probe = await probe_factory([WILL])
    cfg = MqttConfig(url=mosquitto.url)
    closed = await connect(cfg, "gb-writes-closed", will=Will(WILL, b"closed"))
    await closed.publish(TOPIC, b"x")
    await closed.close()
    left = await connect(cfg, "gb-writes-left", will=Will(WILL, b"left"))
    await left.publish(TOPIC, b"y")
    left._client.leave()
    dropped = await connect(cfg, "gb-writes-dropped", will=Will(WILL, b"dropped"))
    await dropped.publish(TOPIC, b"z")
    dropped.drop()
    await probe.wait_for(lambda m: m.payload == b"dropped", timeout=10)
    assert [m.payload for m in probe.matching(WILL)] == [b"dropped"]
