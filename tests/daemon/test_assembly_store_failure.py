"""A commit the state store refuses, for real: the daemon stops at once (crash-only), its
HTTP caller hears so at once, nothing of the batch is published, and a restart on the
same file recovers what was committed (README "State and durability")."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from daemon_helpers import (
    BIG_LABELS,
    PREFIX,
    RunningDaemon,
    daemon_config,
    fill_up,
    start_until_ready,
)
from mqtt_helpers import Mosquitto, MqttProbe, ProbeFactory, free_port, payload_json

from broker.daemon.config import Config, HttpConfig
from broker.leasing.authority import REPEATED
from broker.state.store import StoreFailed

S = "sched-1"
TOKEN = "tok-3e9a"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def place_body(request_id: str, **extra: Any) -> dict[str, Any]:
    return {"request_id": request_id, "gpu": ["A100-80GB", "H100-80GB"], "gpus": 8, **extra}


@pytest.fixture
def config(mosquitto: Mosquitto, tmp_path: Path) -> Config:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    return daemon_config(mosquitto, tmp_path / "state.db").model_copy(update={
        "http": HttpConfig(listen=f"127.0.0.1:{free_port()}", token_file=token)})


@pytest.fixture
async def running() -> AsyncIterator[list[RunningDaemon]]:
    daemons: list[RunningDaemon] = []
    yield daemons
    for rd in daemons:
        if not rd.task.done():
            await rd.stop()




def decided(request_id: str) -> Any:
    def match(msg: Any) -> bool:
        return (str(msg.topic) == f"{PREFIX}/events/{S}/placement.decided"
                and payload_json(msg)["data"]["request_id"] == request_id)
    return match


async def place_mqtt(probe: MqttProbe, request_id: str) -> dict[str, Any]:
    mark = probe.mark()
    await probe.publish(f"{PREFIX}/requests/{S}/place", place_body(request_id))
    return payload_json(await probe.wait_for(decided(request_id), since=mark))  # type: ignore[no-any-return]


async def test_a_refused_commit_stops_the_daemon_and_a_restart_recovers(
        config: Config, running: list[RunningDaemon], probe_factory: ProbeFactory) -> None:
    probe = await probe_factory([f"{PREFIX}/events/#"])
    status_probe = await probe_factory([f"{PREFIX}/status"])
    base = f"http://{config.http.listen}"
    first = await start_until_ready(config, running)
    kept = (await place_mqtt(probe, "kept"))["data"]
    committed = {le.lease_id: le.to_json() for le in first.daemon.book.all()}
    assert list(committed) == [kept["lease_id"]]
    assert await first.daemon.bus.drained(5)
    await first.daemon.store.call(fill_up)

    # Two requests whose commit cannot be written: one over HTTP, one over MQTT.
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession(base) as session:
        started = loop.time()

        async def post() -> tuple[int, Any]:
            async with session.post(f"/v1/requests/{S}/place", headers=AUTH,
                                    json=place_body("doomed-http", labels=BIG_LABELS)) as r:
                return r.status, await r.json()

        answer = asyncio.create_task(post())
        await probe.publish(f"{PREFIX}/requests/{S}/place",
                            place_body("doomed-mqtt", labels=BIG_LABELS))
        async with asyncio.timeout(10):
            status, body = await answer
        waited = loop.time() - started
    assert (status, body) == (503, {"error": "state store failed; not executed"})
    assert waited < 3  # at once, not after the 30 s answer timeout

    # The daemon ends with the store's error, named.
    async with asyncio.timeout(15):
        with pytest.raises(StoreFailed, match=r"database or disk is full \(SQLITE_FULL\)"):
            await first.task
    assert first.daemon.broker.failed is not None
    # Not an orderly stop: the connection was dropped, and the will says `offline`.
    offline = await status_probe.wait_for(lambda m: payload_json(m)["state"] == "offline")
    assert payload_json(offline)["boot_id"] == first.daemon.boot_id

    # A restart on the same file: the lease book is what was committed, no more. The MQTT
    # request of the failed batch was not acknowledged: the session delivers it again,
    # and the new boot may have placed it by now (once: asserted below).
    second = await start_until_ready(config, running)
    assert second.daemon.boot_id != first.daemon.boot_id
    # (compared as published and stored: in memory a price's observed_at has microseconds,
    # the store keeps milliseconds)
    assert {le.lease_id: le.to_json() for le in second.daemon.book.all()
            if le.request_id != "doomed-mqtt"} == committed
    assert await second.daemon.store.find_lease(S, "doomed-http") is None

    # The same request ids answer consistently: the kept lease again; the refused
    # request, never decided before, is placed now, once, and repeats get that lease.
    again = (await place_mqtt(probe, "kept"))["data"]
    assert again["lease_id"] == kept["lease_id"] and again["reason"] == REPEATED
    async with aiohttp.ClientSession(base) as session:
        answers = []
        for _ in range(2):
            async with session.post(f"/v1/requests/{S}/place", headers=AUTH,
                                    json=place_body("doomed-http", labels=BIG_LABELS)) as r:
                assert r.status == 200
                answers.append((await r.json())["data"])
    assert answers[0]["reason"] != REPEATED
    assert answers[1]["lease_id"] == answers[0]["lease_id"]
    assert answers[1]["reason"] == REPEATED

    # Everything either boot published has reached the probe once this marker has
    # (the first daemon's connection is gone; the second publishes before answering).
    mark = probe.mark()
    await probe.publish(f"{PREFIX}/events/{S}/marker", {"end": True})
    await probe.wait_for(f"{PREFIX}/events/{S}/marker", since=mark)
    events = [payload_json(m) for m in probe.messages
              if not str(m.topic).endswith("/marker")]
    boot1 = [e for e in events if e["bootid"] == first.daemon.boot_id]
    boot2 = [e for e in events if e["bootid"] == second.daemon.boot_id]
    # Nothing of the failed batch was published by the boot that failed ...
    assert [e["data"]["request_id"] for e in boot1] == ["kept"]
    # ... the new boot placed the MQTT request delivered again, once ...
    assert [e["data"]["request_id"] for e in boot2].count("doomed-mqtt") == 1
    # ... and counts seq from 1 again, without gaps.
    assert sorted(e["seq"] for e in boot2) == list(range(1, len(boot2) + 1))
    assert [e["data"]["lease_id"] for e in boot2
            if e["data"]["request_id"] == "doomed-http"] == [answers[0]["lease_id"]] * 2
