"""The HTTP API and metrics of a real in-process daemon (SPEC §8)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from daemon_helpers import RunningDaemon, daemon_config
from mqtt_helpers import Mosquitto, ProbeFactory, free_port
from prometheus_client.parser import text_string_to_metric_families

from broker.config import HttpConfig
from broker.daemon import Daemon

TOKEN = "tok-5f1c2d"


async def start(cfg: Any) -> RunningDaemon:
    daemon = Daemon(cfg)
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop))
    return RunningDaemon(daemon, task, stop)


@pytest.fixture
async def api(mosquitto: Mosquitto, tmp_path: Path) -> Any:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    port = free_port()
    cfg = daemon_config(mosquitto, tmp_path / "state.db").model_copy(update={
        "http": HttpConfig(listen=f"127.0.0.1:{port}", token_file=token)})
    rd = await start(cfg)
    async with asyncio.timeout(15):
        await rd.daemon.ready.wait()
    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
        yield session, rd
    await rd.stop()


async def get_json(session: aiohttp.ClientSession, path: str) -> Any:
    async with session.get(path) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def test_health_offers_leases_policy(api: Any) -> None:
    session, _ = api
    async with session.get("/livez") as r:
        assert r.status == 200
    async with session.get("/readyz") as r:
        assert r.status == 200 and "ready" in await r.text()
    offers = await get_json(session, "/v1/offers?gpu=H100-80GB&market=spot&limit=5")
    assert 0 < len(offers) <= 5
    assert all(o["gpu"] == "H100-80GB" and o["market"] == "spot" for o in offers)
    prices = [o["price_per_gpu_hour"] for o in offers]
    assert prices == sorted(prices)
    async with session.get("/v1/offers?market=preemptible") as r:
        assert r.status == 400
    assert await get_json(session, "/v1/leases") == []
    async with session.get("/v1/leases/L-nope") as r:
        assert r.status == 404
    policy = await get_json(session, "/v1/policy")
    assert policy["policy"]["version"] == 1 and "defaults" in policy["policy"]


async def test_place_needs_the_token_and_answers_like_mqtt(api: Any) -> None:
    session, _ = api
    body = {"request_id": "h1", "gpu": "L4", "gpus": 1}
    async with session.post("/v1/requests/s1/place", json=body) as r:
        assert r.status == 401 and r.headers["WWW-Authenticate"].startswith("Bearer")
    bad = {"Authorization": "Bearer tok-5f1c2e"}
    async with session.post("/v1/requests/s1/place", json=body, headers=bad) as r:
        assert r.status == 401
    good = {"Authorization": f"Bearer {TOKEN}"}
    async with session.post("/v1/requests/s1/place", json=body, headers=good) as r:
        assert r.status == 200
        event = await r.json()
    assert event["type"] == "gpubroker.placement.decided.v1"
    lease_id = event["data"]["lease_id"]
    assert (await get_json(session, f"/v1/leases/{lease_id}"))["state"] == "active"
    assert [le["lease_id"] for le in await get_json(session, "/v1/leases?scheduler=s1")] == [
        lease_id]
    # Same request id, same lease.
    async with session.post("/v1/requests/s1/place", json=body, headers=good) as r:
        assert (await r.json())["data"]["lease_id"] == lease_id
    async with session.post("/v1/requests/s1/place", data=b"{nope", headers=good) as r:
        assert r.status == 422
        assert (await r.json())["type"] == "gpubroker.request.invalid.v1"
    async with session.post("/v1/requests/no%20spaces/place", json=body, headers=good) as r:
        assert r.status == 400
    huge = b'{"request_id": "x", "pad": "' + b"x" * 70_000 + b'"}'
    async with session.post("/v1/requests/s1/place", data=huge, headers=good) as r:
        assert r.status == 413
    # The daemon still serves.
    async with session.get("/livez") as r:
        assert r.status == 200


async def test_the_lease_list_holds_the_active_leases_unless_asked(
        api: Any, probe_factory: ProbeFactory) -> None:
    session, _ = api
    good = {"Authorization": f"Bearer {TOKEN}"}
    ids = {}
    for rid in ("keep", "drop"):
        async with session.post("/v1/requests/s1/place", headers=good,
                                json={"request_id": rid, "gpu": "L4", "gpus": 1}) as r:
            ids[rid] = (await r.json())["data"]["lease_id"]
    probe = await probe_factory(["gpubroker/v1/events/s1/#"])
    mark = probe.mark()
    await probe.publish("gpubroker/v1/requests/s1/release", {"lease_id": ids["drop"]})
    await probe.wait_for("gpubroker/v1/events/s1/lease.released", since=mark)

    async def listed(query: str) -> list[tuple[str, str]]:
        return [(le["lease_id"], le["state"]) for le in await get_json(session, query)]

    assert await listed("/v1/leases") == [(ids["keep"], "active")]
    assert await listed("/v1/leases?state=") == [(ids["keep"], "active")]
    assert await listed("/v1/leases?state=released") == [(ids["drop"], "released")]
    assert await listed("/v1/leases?state=all") == [(ids["keep"], "active"),
                                                    (ids["drop"], "released")]
    assert await listed("/v1/leases?state=all&scheduler=s2") == []
    async with session.get("/v1/leases?state=ended") as r:
        assert r.status == 400
        assert "active, released, expired, failed or all" in (await r.json())["error"]


async def test_metrics_parse_and_count(api: Any) -> None:
    session, rd = api
    good = {"Authorization": f"Bearer {TOKEN}"}
    await session.post("/v1/requests/s1/place", json={"request_id": "m1", "gpu": "L4",
                                                      "gpus": 1}, headers=good)
    await session.post("/v1/requests/s1/place", json={"request_id": "m2", "gpu": "T4",
                                                      "gpus": 1,
                                                      "max_price_per_gpu_hour": 0.001},
                       headers=good)
    async with session.get("/metrics") as r:
        assert r.status == 200
        text = await r.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert all(name.startswith("gpubroker_") for name in families)

    def value(name: str, **labels: str) -> float:
        return sum(s.value for s in families[name].samples
                   if s.name in (name, f"{name}_total")
                   and all(s.labels.get(k) == v for k, v in labels.items()))

    assert families["gpubroker_build_info"].samples[0].labels["version"]
    assert value("gpubroker_placements") == 1
    assert value("gpubroker_rejections", code="over_price_cap") == 1
    assert value("gpubroker_active_leases") == 1
    assert value("gpubroker_mqtt_connected") == 1
    assert value("gpubroker_pool_offers") == len(rd.daemon.pool)
    assert value("gpubroker_polls", result="ok") >= len(rd.daemon.pool.health())
    latency = families["gpubroker_decision_latency_seconds"]
    count = [s.value for s in latency.samples if s.name.endswith("_count")]
    assert count == [2]
    assert families["gpubroker_cheapest_gpu_hour_price_usd"].samples
    # No ids as labels.
    for f in families.values():
        for s in f.samples:
            assert not any(str(v).startswith("L-") for v in s.labels.values())


async def test_readyz_is_503_until_mqtt_connects(tmp_path: Path) -> None:
    port, dead = free_port(), free_port()
    cfg = daemon_config(Mosquitto(tmp_path / "m", port=dead), tmp_path / "state.db"
                        ).model_copy(update={"http": HttpConfig(listen=f"127.0.0.1:{port}")})
    rd = await start(cfg)
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as s:
            async with asyncio.timeout(10):
                while True:  # wait for the listener to be up (not for a state)
                    try:
                        r = await s.get("/readyz")
                        break
                    except aiohttp.ClientConnectionError:
                        await asyncio.sleep(0.05)
            assert r.status == 503 and "MQTT not connected" in await r.text()
            r = await s.get("/livez")
            assert r.status == 200
            r = await s.post("/v1/requests/s1/place", data=json.dumps({}))
            assert r.status == 403  # no token file configured
    finally:
        await rd.stop()
