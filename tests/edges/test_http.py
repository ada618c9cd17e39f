"""The HTTP API and metrics of a real in-process daemon (SPEC §8)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from daemon_helpers import RunningDaemon, daemon_config
from mqtt_helpers import Mosquitto, ProbeFactory, free_port, payload_json
from prometheus_client.parser import text_string_to_metric_families

from broker.daemon.assembly import Daemon
from broker.daemon.config import HttpConfig
from broker.wire.commands import VERBS

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


async def post_like_mqtt(session: aiohttp.ClientSession, probe: Any, verb: str,
                         body: Any, status: int = 200) -> dict[str, Any]:
    """POST a request; its answer is the bytes of the event MQTT carries too."""
    mark = probe.mark()
    async with session.post(f"/v1/requests/s1/{verb}", json=body,
                            headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        assert r.status == status, await r.text()
        assert r.content_type == "application/json"
        answer = await r.read()
    event: dict[str, Any] = json.loads(answer)
    kind = event["type"].removeprefix("gpubroker.").removesuffix(".v1")
    sent = await probe.wait_for(f"gpubroker/v1/events/s1/{kind}", since=mark)
    assert sent.payload == answer
    return event


async def test_every_verb_over_http_answers_like_mqtt(
        api: Any, probe_factory: ProbeFactory) -> None:
    session, rd = api
    probe = await probe_factory(["gpubroker/v1/events/s1/#"])
    for verb in VERBS:  # the same token rules as place
        async with session.post(f"/v1/requests/s1/{verb}", json={}) as r:
            assert r.status == 401 and r.headers["WWW-Authenticate"].startswith("Bearer")
        async with session.post(f"/v1/requests/s1/{verb}", json={},
                                headers={"Authorization": "Bearer nope"}) as r:
            assert r.status == 401
        async with session.post(f"/v1/requests/_ops/{verb}", json={},
                                headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            assert r.status == 400
    body = {"request_id": "h2", "gpu": "H100-80GB", "gpus": 8, "duration_hours": 2}
    quoted = await post_like_mqtt(session, probe, "quote", body)
    assert quoted["type"] == "gpubroker.placement.quoted.v1"
    assert quoted["data"]["request_id"] == "h2"
    assert rd.daemon.book.all() == []  # a quote holds nothing
    decided = await post_like_mqtt(session, probe, "place", body)
    assert decided["data"]["placement"] == quoted["data"]["placement"]
    lease_id = decided["data"]["lease_id"]
    renewed = await post_like_mqtt(session, probe, "renew", {"lease_id": lease_id})
    assert renewed["type"] == "gpubroker.lease.renewed.v1"
    moved = await post_like_mqtt(session, probe, "report",
                                 {"lease_id": lease_id, "kind": "unhealthy"})
    assert moved["type"] == "gpubroker.lease.failover.v1"  # the sim has other pools
    assert moved["data"]["lease_id"] == lease_id
    released = await post_like_mqtt(session, probe, "release", {"lease_id": lease_id})
    assert released["type"] == "gpubroker.lease.released.v1"
    assert (await get_json(session, f"/v1/leases/{lease_id}"))["state"] == "released"
    # Answered like MQTT after the end too (§4.5), and 422 for what MQTT calls invalid.
    again = await post_like_mqtt(session, probe, "renew", {"lease_id": lease_id})
    assert again["type"] == "gpubroker.lease.released.v1"
    for verb, bad in (("renew", {"lease_id": "L-nope"}), ("release", {}),
                      ("report", {"lease_id": lease_id, "kind": "bored"}),
                      ("quote", {"gpu": "H100-80GB", "gpus": 0})):
        invalid = await post_like_mqtt(session, probe, verb, bad, status=422)
        assert invalid["type"] == "gpubroker.request.invalid.v1", verb
    async with session.post("/v1/requests/s1/lookup-nothing", json={},
                            headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        assert r.status == 404


@pytest.mark.parametrize("keep_recent", [4096, 0], ids=["in memory", "left memory"])
async def test_the_lease_list_holds_the_active_leases_unless_asked(
        api: Any, probe_factory: ProbeFactory, keep_recent: int) -> None:
    """The ended leases listed and looked up are the store's, whether the lease book
    still holds them (the recent ones) or not."""
    session, rd = api
    rd.daemon.book.keep_recent = keep_recent
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
    assert await listed("/v1/leases?request_id=drop&scheduler=s1") == [(ids["drop"],
                                                                        "released")]
    assert (rd.daemon.book.get(ids["drop"]) is None) == (keep_recent == 0)
    assert (await get_json(session, f"/v1/leases/{ids['drop']}"))["state"] == "released"
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
            for verb in VERBS:  # no token file configured
                r = await s.post(f"/v1/requests/s1/{verb}", data=json.dumps({}))
                assert r.status == 403, verb
    finally:
        await rd.stop()


# --- hostile and malformed clients (#27) ---------------------------------------------

FD_LIMIT = 256
"""RLIMIT_NOFILE of the daemon processes below: systemd's 1,024 in small."""


class DaemonProcess:
    """`gpubroker run` as a process whose open-file limit is FD_LIMIT (soft and hard),
    its JSON log in a file."""

    def __init__(self, tmp_path: Path, mosquitto: Mosquitto, http: dict[str, Any],
                 policy: Path | None = None, log_level: str = "info",
                 **extra: Any) -> None:
        self.port = free_port()
        config = tmp_path / "config.yaml"
        config.write_text(yaml.safe_dump({
            "state": {"path": str(tmp_path / "state.db")}, "mqtt": {"url": mosquitto.url},
            "http": {"listen": f"127.0.0.1:{self.port}", **http},
            **({"policy_file": str(policy)} if policy else {}), "log_level": log_level,
            "poll": {"interval_seconds": 3600, "stale_after_seconds": 7200},
            "clouds": {"sim": {"regions_per_cloud": 1, "zones_per_region": 1}}, **extra}))
        self.log_path = tmp_path / "daemon.log"
        self._log = self.log_path.open("wb")
        limit = (f"import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, "
                 f"({FD_LIMIT}, {FD_LIMIT})); os.execv(sys.executable, [sys.executable, "
                 f"'-m', 'broker.cli', 'run', '--config', {str(config)!r}])")
        self.proc = subprocess.Popen([sys.executable, "-c", limit],
                                     stdout=self._log, stderr=self._log)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def wait_log(self, event: str, timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while f'"event": "{event}"' not in self.log():
                assert self.proc.poll() is None, self.log()[-3000:]
                await asyncio.sleep(0.1)  # polling a file: no event to wait on

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture
def daemon_process() -> Any:
    started: list[DaemonProcess] = []

    def start(*args: Any, **kwargs: Any) -> DaemonProcess:
        started.append(DaemonProcess(*args, **kwargs))
        return started[-1]

    yield start
    for d in started:
        d.close()


async def livez(port: int, timeout: float) -> float:
    """Seconds /livez took to answer 200 on a new connection."""
    began = time.monotonic()
    async with asyncio.timeout(timeout), aiohttp.ClientSession() as s, \
            s.get(f"http://127.0.0.1:{port}/livez") as r:
        assert r.status == 200
    return time.monotonic() - began


async def slow_clients(port: int, count: int) -> list[tuple[asyncio.StreamReader,
                                                            asyncio.StreamWriter]]:
    """`count` connections that sent half a request header and nothing since (those
    the server's backlog cannot take within 5 s are left out)."""
    async def one() -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        try:
            async with asyncio.timeout(5):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except (TimeoutError, OSError):
            return None
        writer.write(b"GET /livez HTTP/1.1\r\nHost: gpubroker\r\nX-Slow: ")
        return reader, writer

    return [c for c in await asyncio.gather(*(one() for _ in range(count))) if c]


async def closed_by_server(conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]],
                           timeout: float) -> int:
    """How many of `conns` the server closed (EOF or reset) within `timeout`."""
    async def eof(reader: asyncio.StreamReader) -> bool:
        try:
            async with asyncio.timeout(timeout):
                while await reader.read(4096):
                    pass
        except TimeoutError:
            return False
        except ConnectionError:
            pass
        return True

    try:
        return sum(await asyncio.gather(*(eof(r) for r, _ in conns)))
    finally:
        for _, w in conns:
            w.close()


async def wait_listening(port: int, timeout: float = 20) -> None:
    async with asyncio.timeout(timeout):
        while True:  # wait for the listener to be up (not for a state)
            try:
                await livez(port, 2)
                return
            except (aiohttp.ClientConnectionError, TimeoutError):
                await asyncio.sleep(0.05)


@pytest.mark.slow
async def test_slow_clients_do_not_exhaust_descriptors(
        tmp_path: Path, mosquitto: Mosquitto, daemon_process: Any) -> None:
    # Without the MILP, and started in full first: a module the daemon imports on first
    # use (its solver, in a thread after the start) fails for want of descriptors and
    # stops it, which is not the listener's doing (see the test below).
    d = daemon_process(tmp_path, mosquitto, {"header_timeout_seconds": 2},
                       placement={"exact_max_batch": 0})
    await wait_listening(d.port)
    await d.wait_log("retained state restored", 20)
    conns = await slow_clients(d.port, FD_LIMIT + 100)
    try:
        # More were accepted than there are descriptors (the oldest idle ones made room
        # for the newest; on a busy machine a few may miss the connect timeout)...
        assert len(conns) > FD_LIMIT + 50, len(conns)
        # ...the daemon still answers at once, with more half-sent headers than
        # descriptors...
        assert await livez(d.port, 3) < 3
    except BaseException:
        for _, w in conns:  # closed here, not left to the collector in a later test
            w.close()
        raise
    # ...and no slow connection outlives the header timeout (plus scheduling slack).
    assert await closed_by_server(conns, 2 + 3) == len(conns)
    assert await livez(d.port, 3) < 3
    log = d.log()
    assert "Traceback" not in log and "out of system resource" not in log
    assert len(log) < 20_000, log[-3000:]
    assert '"event": "http connections closed: no request header in time"' in log


@pytest.mark.slow
async def test_out_of_descriptors_is_one_warning_and_no_policy_rejection(
        tmp_path: Path, mosquitto: Mosquitto, daemon_process: Any,
        probe_factory: ProbeFactory) -> None:
    # A limit set above what the descriptors allow: accept() does run out, and so does
    # the policy watcher's open() of the policy file.
    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\n")
    token = tmp_path / "token"
    token.write_text(TOKEN)
    probe = await probe_factory(["gpubroker/v1/events/_ops/#"])
    d = daemon_process(tmp_path, mosquitto, {"header_timeout_seconds": 4, "token_file":
                                             str(token), "max_connections": 10_000},
                       policy=policy, placement={"exact_max_batch": 0})
    # Started in full, and a decision made, without the MILP (its solver is imported in
    # a thread after the start): what the daemon imports on first use is in, since an
    # import failing for want of descriptors stops it (not a matter of the listener).
    await d.wait_log("retained state restored", 20)
    async with aiohttp.ClientSession(f"http://127.0.0.1:{d.port}") as s, s.post(
            "/v1/requests/s1/place", json={"request_id": "w", "gpu": "L4", "gpus": 1},
            headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        assert r.status == 200
    conns = await slow_clients(d.port, FD_LIMIT + 100)
    try:
        await d.wait_log("http accept failed: out of descriptors; retried", 10)
        await d.wait_log("policy file not read now; retrying", 10)
    finally:
        await closed_by_server(conns, 10)
    assert await livez(d.port, 5) < 5
    log = d.log()
    assert "Traceback" not in log and len(log) < 20_000, log[-3000:]
    assert log.count("http accept failed") <= 2  # once a minute
    assert not [m for m in probe.messages if str(m.topic).endswith("policy.rejected")], [
        payload_json(m) for m in probe.messages]


async def raw_request(port: int, data: bytes) -> bytes:
    """What the server answers to `data` sent as is, up to its close (a malformed
    request is answered, then the connection closed)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        async with asyncio.timeout(5):
            return await reader.read()
    finally:
        writer.close()


async def test_malformed_requests_are_4xx_without_a_traceback(
        tmp_path: Path, mosquitto: Mosquitto, daemon_process: Any) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    d = daemon_process(tmp_path, mosquitto, {"token_file": str(token),
                                             "body_timeout_seconds": 1}, log_level="debug")
    await d.wait_log("ready", 20)
    port = d.port
    good = f"Authorization: Bearer {TOKEN}\r\n".encode()
    place = b"POST /v1/requests/s1/place HTTP/1.1\r\nHost: x\r\n"
    answers = {
        "token not UTF-8": await raw_request(
            port, place + b"Authorization: Bearer tok-\xff\xfe\xc3\r\n"
                          b"Content-Length: 2\r\nConnection: close\r\n\r\n{}"),
        "bad JSON": await raw_request(
            port, place + good + b"Content-Length: 5\r\nConnection: close\r\n\r\n{nope"),
        "bad Content-Length": await raw_request(
            port, place + good + b"Content-Length: -1\r\n\r\n{}"),
        "two Content-Lengths": await raw_request(
            port, place + good + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}"),
        "bad method": await raw_request(port, b"G@T /livez HTTP/1.1\r\nHost: x\r\n\r\n"),
        "wrong method": await raw_request(
            port, b"DELETE /livez HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
        "huge header": await raw_request(
            port, b"GET /livez HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n"),
        "not HTTP": await raw_request(port, b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\r\n\r\n"),
        "body too slow": await raw_request(
            port, place + good + b"Content-Length: 100\r\n\r\n{\"request_id\": "),
    }
    status = {k: int(v[9:12]) if re.match(rb"HTTP/1\.[01] \d\d\d ", v) else v
              for k, v in answers.items()}
    assert status == {"token not UTF-8": 401, "bad JSON": 422, "bad Content-Length": 400,
                      "two Content-Lengths": 400, "bad method": 400, "wrong method": 405,
                      "huge header": 400, "not HTTP": 400, "body too slow": 408}
    assert await livez(port, 3) < 3
    log = d.log()
    assert "Traceback" not in log and "UnicodeEncodeError" not in log, log[-3000:]
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    malformed = [r for r in lines if r["event"] == "http request malformed"]
    assert malformed and all(r["level"] == "debug" for r in malformed)
    assert not [r for r in lines if r["level"] in ("error", "critical")]


async def test_views_need_the_token_when_configured(mosquitto: Mosquitto,
                                                     tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    port = free_port()
    cfg = daemon_config(mosquitto, tmp_path / "state.db").model_copy(update={
        "http": HttpConfig(listen=f"127.0.0.1:{port}", token_file=token,
                           views_need_token=True)})
    rd = await start(cfg)
    try:
        async with asyncio.timeout(15):
            await rd.daemon.ready.wait()
        good = {"Authorization": f"Bearer {TOKEN}"}
        bad = {"Authorization": "Bearer tok-5f1c2e"}
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as s:
            for path in ("/v1/leases", "/v1/leases?state=all", "/v1/leases/L-nope",
                         "/v1/policy", "/v1/offers"):
                for headers in ({}, bad):
                    async with s.get(path, headers=headers) as r:
                        assert r.status == 401, (path, headers)
                        assert r.headers["WWW-Authenticate"].startswith("Bearer")
                async with s.get(path, headers=good) as r:
                    assert r.status == (404 if path.endswith("L-nope") else 200), path
            for path in ("/livez", "/readyz", "/metrics"):
                async with s.get(path) as r:
                    assert r.status == 200, path
    finally:
        await rd.stop()


def test_views_need_token_needs_a_token_file() -> None:
    with pytest.raises(ValueError, match=r"views_need_token needs http\.token_file"):
        HttpConfig(views_need_token=True)
