"""The test infrastructure itself, against a real mosquitto."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

import aiomqtt
import pytest
from mqtt_helpers import Mosquitto, MqttProbe, ProbeFactory, payload_json, publish_properties


@pytest.mark.parametrize("protocol", [5, "3.1.1"])
async def test_round_trip(probe_factory: ProbeFactory, protocol: int | str) -> None:
    probe = await probe_factory(["t/#"], protocol=protocol)
    assert probe.client._client.protocol == probe.protocol.value
    await probe.publish("t/a", {"n": 1})
    await probe.publish("t/b", b"raw")
    msg = await probe.wait_for("t/a")
    assert payload_json(msg) == {"n": 1}
    assert msg.qos == 1
    raw = await probe.wait_for(lambda m: m.payload == b"raw")
    assert raw.topic.value == "t/b"


async def test_v5_and_v311_clients_interoperate(probe_factory: ProbeFactory) -> None:
    v5 = await probe_factory(["x/#"], protocol=5)
    v311 = await probe_factory(["x/#"], protocol="3.1.1")
    await v5.publish("x/from5", {"a": 1}, properties=publish_properties(ResponseTopic="x/reply"))
    await v311.publish("x/from311", {"b": 2})
    got = await v311.wait_for("x/from5")
    assert payload_json(got) == {"a": 1}
    assert (await v5.wait_for("x/from311")).topic.value == "x/from311"
    # MQTT 5 properties reach MQTT 5 subscribers
    own = await v5.wait_for("x/from5")
    assert own.properties is not None
    assert own.properties.ResponseTopic == "x/reply"


async def test_wait_for_sees_already_collected_and_since(probe_factory: ProbeFactory) -> None:
    probe = await probe_factory(["s/#"])
    await probe.publish("s/1", {"i": 1})
    await probe.wait_for("s/1")
    mark = probe.mark()
    # Already collected: returns immediately.
    assert payload_json(await probe.wait_for("s/1", timeout=0.2)) == {"i": 1}
    # ...but not when asked for newer ones only.
    with pytest.raises(TimeoutError):
        await probe.wait_for("s/1", timeout=0.2, since=mark)
    await probe.publish("s/1", {"i": 2})
    assert payload_json(await probe.wait_for("s/1", since=mark)) == {"i": 2}
    both = await probe.wait_for_count("s/1", 2)
    assert [payload_json(m) for m in both] == [{"i": 1}, {"i": 2}]


async def test_wait_for_times_out_with_helpful_message(probe_factory: ProbeFactory) -> None:
    probe = await probe_factory(["q/#"])
    await probe.publish("q/seen", {})
    await probe.wait_for("q/seen")
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        await probe.wait_for("q/never", timeout=0.2)
    assert time.monotonic() - start < 2
    assert "q/never" in str(info.value)
    assert "q/seen" in str(info.value)


async def test_retained_survives_clean_restart(
    mosquitto: Mosquitto, probe_factory: ProbeFactory
) -> None:
    port = mosquitto.port
    writer = await probe_factory([])
    await writer.publish("r/status", {"state": "online"}, retain=True)
    await writer.publish("r/gone", {"x": 1}, retain=True)
    await writer.publish("r/gone", b"", retain=True)  # empty retained payload clears it

    await mosquitto.astop()
    assert not mosquitto.running
    assert isinstance(await writer.wait_disconnected(), aiomqtt.MqttError)
    with pytest.raises(OSError), socket.create_connection((mosquitto.host, port), timeout=1):
        pass

    await mosquitto.astart()
    assert mosquitto.port == port
    async with MqttProbe(mosquitto.url, ["r/#"]) as reader:
        msg = await reader.wait_for("r/status")
        assert msg.retain
        assert payload_json(msg) == {"state": "online"}
        assert reader.matching("r/gone") == []


async def test_kill_loses_unsaved_state(mosquitto: Mosquitto, probe_factory: ProbeFactory) -> None:
    writer = await probe_factory([])
    await writer.publish("k/retained", {"v": 1}, retain=True)
    await mosquitto.akill()
    await writer.wait_disconnected()
    await mosquitto.astart()
    async with MqttProbe(mosquitto.url, ["k/#", "marker"]) as reader:
        await reader.publish("marker", {})
        await reader.wait_for("marker")  # the retained one would have come first
        assert reader.matching("k/#") == []


@pytest.mark.parametrize("protocol", [5, "3.1.1"])
async def test_persistent_session_gets_queued_messages_across_server_restart(
    mosquitto: Mosquitto, probe_factory: ProbeFactory, protocol: int | str
) -> None:
    sub = await probe_factory(["p/#"], protocol=protocol, persistent=True)
    pub = await probe_factory([], protocol=protocol)
    await pub.publish("p/1", {"i": 1})
    await sub.wait_for("p/1")

    await sub.close()
    await pub.publish("p/2", {"i": 2})  # queued by the server for the offline session
    await mosquitto.astop()
    await mosquitto.astart()
    await sub.reconnect()
    msg = await sub.wait_for("p/2")
    assert payload_json(msg) == {"i": 2}


def test_start_failure_reports_log(tmp_path: Path, free_port: Callable[[], int]) -> None:
    server = Mosquitto(tmp_path / "bad", free_port(), extra_config="no_such_option 1")
    with pytest.raises(RuntimeError, match=r"no_such_option|exited"):
        server.start()
    assert not server.running
