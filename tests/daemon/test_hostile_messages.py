"""One message must never kill the daemon: hostile payloads through a real daemon and a
real mosquitto, and a bug in the handling of one command (SPEC §3, §4)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from daemon_helpers import PREFIX, RunningDaemon, StartDaemon, daemon_config
from mqtt_helpers import Mosquitto, MqttProbe, ProbeFactory, free_port, payload_json
from structlog.testing import capture_logs

from broker.daemon.assembly import Daemon
from broker.daemon.config import HttpConfig
from broker.leasing import authority
from broker.leasing.batch import MAX_ERRORS
from broker.output.ratelimit import Every
from broker.placement import optimizer
from broker.wire import validation
from broker.wire.commands import Command

NASTY = Path(__file__).parent.parent / "fixtures" / "nasty"
CORPUS = sorted(p for p in NASTY.iterdir() if p.suffix in (".bad", ".ok"))
EVENTS = f"{PREFIX}/events/"
INTERNAL = authority.INTERNAL["message"]


def valid(request_id: str) -> dict[str, Any]:
    return {"request_id": request_id, "gpu": ["A100-80GB", "H100-80GB"], "gpus": 8}


def kind(msg: Any) -> str:
    return str(msg.topic).rsplit("/", 1)[1]


async def answers(probe: MqttProbe, prefix: str, count: int, since: int) -> dict[str, Any]:
    """Wait for `count` events to schedulers `<prefix><n>`; each must be valid UTF-8 JSON.
    Returns the events by scheduler id, one each."""
    def mine(m: Any) -> bool:
        return str(m.topic).startswith(EVENTS + prefix)
    got = await probe.wait_for_count(mine, count, timeout=30, since=since)
    by_scheduler: dict[str, Any] = {}
    for msg in got:
        scheduler = str(msg.topic)[len(EVENTS):].split("/")[0]
        assert scheduler not in by_scheduler, f"two answers to {scheduler}"
        event = json.loads(bytes(msg.payload).decode("utf-8"))  # strict UTF-8
        assert event["type"] == f"gpubroker.{kind(msg)}.v1"
        by_scheduler[scheduler] = event
    return by_scheduler


async def still_deciding(rd: RunningDaemon, probe: MqttProbe, request_id: str) -> None:
    mark = probe.mark()
    await probe.publish(f"{PREFIX}/requests/after/place", valid(request_id))
    msg = await probe.wait_for(f"{EVENTS}after/placement.decided", since=mark, timeout=10)
    assert payload_json(msg)["data"]["request_id"] == request_id
    assert not rd.task.done()


async def test_the_corpus_is_answered_and_the_daemon_lives(
        start_daemon: StartDaemon, probe_factory: ProbeFactory) -> None:
    rd = await start_daemon()
    probe = await probe_factory([f"{EVENTS}#"])
    mark = probe.mark()
    # One scheduler id per payload and verb: each answer is known by its topic.
    sent = 0
    for verb in ("place", "renew", "report"):
        for i, path in enumerate(CORPUS):
            await probe.publish(f"{PREFIX}/requests/n-{verb}-{i}/{verb}", path.read_bytes())
            sent += 1
    got = await answers(probe, "n-", sent, mark)
    assert len(got) == sent

    for i, path in enumerate(CORPUS):
        event = got[f"n-place-{i}"]
        if path.suffix == ".ok":
            assert event["type"] in ("gpubroker.placement.decided.v1",
                                     "gpubroker.placement.rejected.v1"), (path.name, event)
        else:
            assert event["type"] == "gpubroker.request.invalid.v1", (path.name, event)
            assert event["data"]["errors"], path.name
        for verb in ("renew", "report"):
            # No payload carries a lease id the scheduler holds.
            assert got[f"n-{verb}-{i}"]["type"] == "gpubroker.request.invalid.v1"
    for event in got.values():
        for err in event["data"].get("errors", []):
            assert err["message"] != INTERNAL  # none of them needed the last resort

    too_large = got[f"n-place-{CORPUS.index(NASTY / 'size-64k-plus-1.bad')}"]
    assert too_large["data"]["errors"] == [
        {"field": "", "message": "too large: 65537 bytes (at most 65536)"}]
    surrogate = got[f"n-place-{CORPUS.index(NASTY / 'surrogate-request-id-high.bad')}"]
    assert "request_id" not in surrogate["data"]
    assert surrogate["data"]["errors"][0]["field"] == "request_id"

    await still_deciding(rd, probe, "after-the-corpus")


async def test_a_bug_in_one_command_is_answered_and_the_batch_goes_on(
        start_daemon: StartDaemon, probe_factory: ProbeFactory,
        monkeypatch: pytest.MonkeyPatch) -> None:
    rd = await start_daemon()
    probe = await probe_factory([f"{EVENTS}#"])
    broker = rd.daemon.broker
    parse_place = validation.parse_place
    lease_verb = broker._lease_verb

    def parse_with_a_bug(scheduler: str, payload: bytes) -> Any:
        if b"boom" in payload:
            raise RuntimeError("a bug in the parser")
        return parse_place(scheduler, payload)

    async def lease_verb_with_a_bug(b: Any, cmd: Command) -> None:
        if b"boom" in cmd.payload:
            await lease_verb(b, cmd)  # queues a lease.released or request.invalid ...
            raise RuntimeError("a bug after the answer was queued")  # ... then fails
        await lease_verb(b, cmd)

    monkeypatch.setattr(validation, "parse_place", parse_with_a_bug)
    monkeypatch.setattr(broker, "_lease_verb", lease_verb_with_a_bug)
    mark = probe.mark()
    with capture_logs() as logs:
        # Into one batch: the loop takes whatever has queued up.
        await broker.submit(Command("b-1", "place", b'{"request_id":"boom"}',
                                         f"{PREFIX}/requests/b-1/place"))
        await broker.submit(Command("b-2", "release", b'{"lease_id":"boom"}',
                                         f"{PREFIX}/requests/b-2/release"))
        await broker.submit(Command("b-3", "place", json.dumps(valid("fine")).encode(),
                                         f"{PREFIX}/requests/b-3/place"))
        got = await answers(probe, "b-", 3, mark)
    assert got["b-3"]["type"] == "gpubroker.placement.decided.v1"
    for s in ("b-1", "b-2"):
        assert got[s]["type"] == "gpubroker.request.invalid.v1"
        assert got[s]["data"]["errors"] == [{"field": "", "message": INTERNAL}]
    failures = [e for e in logs if e["log_level"] == "error"]
    assert len(failures) == 2  # logged once each, with the exception
    assert all(e.get("exc_info") for e in failures)
    assert not rd.task.done()


async def test_a_bug_placing_a_batch_answers_its_requests(
        start_daemon: StartDaemon, probe_factory: ProbeFactory,
        monkeypatch: pytest.MonkeyPatch) -> None:
    rd = await start_daemon()
    probe = await probe_factory([f"{EVENTS}#"])

    def solve_with_a_bug(*args: Any, **kwargs: Any) -> Any:
        raise ZeroDivisionError("a bug in the solver")

    mark = probe.mark()
    with monkeypatch.context() as m, capture_logs():
        m.setattr(optimizer, "solve", solve_with_a_bug)
        await probe.publish(f"{PREFIX}/requests/p-1/place", valid("x"))
        got = await answers(probe, "p-", 1, mark)
    assert got["p-1"]["data"] == {"request_id": "x", "topic": f"{PREFIX}/requests/p-1/place",
                                  "errors": [{"field": "", "message": INTERNAL}],
                                  "verb": "place"}
    await still_deciding(rd, probe, "after-the-bug")


async def test_a_long_unknown_verb_gets_a_short_answer(
        start_daemon: StartDaemon, probe_factory: ProbeFactory) -> None:
    rd = await start_daemon()
    probe = await probe_factory([f"{EVENTS}#"])
    mark = probe.mark()
    await probe.publish(f"{PREFIX}/requests/v-1/{'x' * 30_000}", valid("v"))
    msg = await probe.wait_for(f"{EVENTS}v-1/request.invalid", since=mark)
    [err] = payload_json(msg)["data"]["errors"]
    assert err["message"].startswith("unknown verb") and len(err["message"]) <= 500
    assert len(msg.payload) < 64 * 1024
    await still_deciding(rd, probe, "after-the-verb")


async def test_many_errors_are_cut_short(start_daemon: StartDaemon,
                                         probe_factory: ProbeFactory) -> None:
    await start_daemon()
    probe = await probe_factory([f"{EVENTS}#"])
    mark = probe.mark()
    await probe.publish(f"{PREFIX}/requests/e-1/place",
                        (NASTY / "labels-2000-wrong-values.bad").read_bytes())
    msg = await probe.wait_for(f"{EVENTS}e-1/request.invalid", since=mark)
    errors = payload_json(msg)["data"]["errors"]
    assert len(errors) == MAX_ERRORS
    assert errors[-1] == {"field": "", "message": "and 1981 more errors"}


async def test_invalid_scheduler_ids_are_dropped_with_one_warning(
        start_daemon: StartDaemon, probe_factory: ProbeFactory) -> None:
    rd = await start_daemon()
    probe = await probe_factory([f"{EVENTS}#"])
    with capture_logs() as logs:
        for i in range(50):
            await probe.publish(f"{PREFIX}/requests/bad*id{i}/place", valid(f"d{i}"))
        await probe.publish(f"{PREFIX}/requests/_ops/place", valid("ops"))
        await still_deciding(rd, probe, "after-the-flood")  # handled after the flood
    warned = [e for e in logs if e["event"].startswith("request from an invalid")]
    assert len(warned) == 1 and warned[0]["dropped"] == 1
    assert not [m for m in probe.messages if "bad*id" in str(m.topic)]


def test_rate_limit_logs_the_first_then_once_an_interval_with_a_count() -> None:
    now = [100.0]
    every = Every(30.0, clock=lambda: now[0])
    assert every.hit() == 1
    assert [every.hit() for _ in range(5)] == [0] * 5
    now[0] += 29.9
    assert every.hit() == 0
    now[0] += 0.1
    assert every.hit() == 7  # this one and the six held back
    assert every.hit() == 0
    now[0] += 100
    assert every.hit() == 2


# --- over HTTP: the same parser -----------------------------------------------------------


@pytest.fixture
async def http(mosquitto: Mosquitto, tmp_path: Path) -> Any:
    token = tmp_path / "token"
    token.write_text("tok\n")
    port = free_port()
    cfg = daemon_config(mosquitto, tmp_path / "state.db").model_copy(update={
        "http": HttpConfig(listen=f"127.0.0.1:{port}", token_file=token)})
    daemon = Daemon(cfg)
    stop = asyncio.Event()
    rd = RunningDaemon(daemon, asyncio.create_task(daemon.run(stop)), stop)
    async with asyncio.timeout(15):
        await daemon.ready.wait()
    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}",
                                     headers={"Authorization": "Bearer tok"}) as session:
        yield session, rd
    await rd.stop()


async def test_the_corpus_over_http(http: Any) -> None:
    session, rd = http
    for i, path in enumerate(CORPUS):
        payload = path.read_bytes()
        async with session.post(f"/v1/requests/h{i}/place", data=payload) as r:
            if len(payload) > 64 * 1024:
                assert r.status == 413, path.name
                continue
            body = (await r.read()).decode("utf-8")
            assert r.status == (200 if path.suffix == ".ok" else 422), (path.name, body)
            json.loads(body)
    async with session.post("/v1/requests/h/place", json=valid("after")) as r:
        assert r.status == 200
        assert (await r.json())["type"] == "gpubroker.placement.decided.v1"
    assert not rd.task.done()
