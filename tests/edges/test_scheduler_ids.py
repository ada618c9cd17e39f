"""One rule for the scheduler id `S` (docs/contract.md §3, §8): `[A-Za-z0-9_.-]{1,64}`,
not the reserved `_ops`; other ids starting with `_` are ordinary. MQTT, HTTP and the
client apply it alike, with the same message."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
import structlog.testing
from daemon_helpers import PREFIX, StartDaemon
from mqtt_helpers import ProbeFactory, free_port, payload_json

from broker.daemon.config import HttpConfig
from broker.model import scheduler_id_problem
from gpubroker_client import BrokerClient

TOKEN = "tok-ids"


def place(request_id: str) -> dict[str, object]:
    return {"request_id": request_id, "gpu": ["T4", "L4", "A10G"], "gpus": 1}


def test_the_rule() -> None:
    for ok in ("train", "_team", "_", "a.b-c_d", "x" * 64, "_opsx", "_OPS"):
        assert scheduler_id_problem(ok) is None, ok
    assert scheduler_id_problem("_ops") == "scheduler id '_ops' is reserved (operations events)"
    for bad in ("", "bad*id", "a/b", "x" * 65, "é"):
        assert scheduler_id_problem(bad) == \
            f"scheduler id {bad!r} must match [A-Za-z0-9_.-]{{1,64}}", bad


def test_the_client_refuses_what_the_daemon_refuses() -> None:
    with pytest.raises(ValueError) as refused:
        BrokerClient(scheduler="_ops")
    assert str(refused.value) == scheduler_id_problem("_ops")
    BrokerClient(scheduler="_team")  # allowed, as by the daemon


async def test_mqtt_and_http_treat_underscore_ids_alike(
        start_daemon: StartDaemon, probe_factory: ProbeFactory, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    port = free_port()
    await start_daemon(config={"http": HttpConfig(listen=f"127.0.0.1:{port}",
                                                  token_file=token)})
    probe = await probe_factory([f"{PREFIX}/events/#"])
    # MQTT: `_team` is served; `_ops` is dropped, logged with the rule's message.
    with structlog.testing.capture_logs() as logs:
        await probe.publish(f"{PREFIX}/requests/_ops/place", place("ops-1"))
        await probe.publish(f"{PREFIX}/requests/_team/place", place("team-1"))
        decided = await probe.wait_for(f"{PREFIX}/events/_team/placement.decided")
    assert payload_json(decided)["data"]["request_id"] == "team-1"
    dropped = [e for e in logs if e["event"].startswith("request from an invalid")]
    assert [e["problem"] for e in dropped] == [scheduler_id_problem("_ops")]
    assert not probe.matching(f"{PREFIX}/events/_ops/placement.decided")
    # HTTP: the same.
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
        async with session.post("/v1/requests/_team/place", json=place("team-2"),
                                headers=auth) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["type"] == "gpubroker.placement.decided.v1"
        for bad in ("_ops", "bad*id"):
            async with session.post(f"/v1/requests/{bad}/place", json=place("x"),
                                    headers=auth) as r:
                assert r.status == 400
                assert await r.json() == {"error": scheduler_id_problem(bad)}
