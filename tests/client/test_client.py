"""The scheduler client (gpubroker_client) against the real daemon and a real mosquitto.

Nothing is mocked: the daemon runs in-process on a private mosquitto. Where a test needs
the daemon's answer held back (the MQTT server restart in the middle of a `place`), a
broker observer — called when the daemon decides, before it commits and publishes —
stops the server, so the answer is decided but can only be published after the restart.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from daemon_helpers import PREFIX, RunningDaemon, StartDaemon
from mqtt_helpers import Mosquitto, ProbeFactory, free_port, payload_json

from broker.model import LeaseState, PoolKey
from gpubroker_client import (
    BrokerClient,
    BrokerUnavailable,
    InvalidRequest,
    Lease,
    LeaseChange,
    LeaseEnded,
    LeaseEvent,
    PlacementTimeout,
    Rejected,
)

S = "train"
GPUS = ["A100-80GB", "H100-80GB"]
ROOT = Path(__file__).resolve().parents[2]


def client(mosquitto: Mosquitto, **kw: Any) -> BrokerClient:
    return BrokerClient(mosquitto.url, scheduler=S, **kw)


def leases_for(rd: RunningDaemon, request_id: str) -> list[Any]:
    return [le for le in rd.daemon.book.all() if le.request_id == request_id]


async def next_event(lease: Lease, kind: str, timeout: float = 5.0) -> LeaseEvent:
    async with asyncio.timeout(timeout):
        async for ev in lease.events():
            if ev.kind == kind:
                return ev
    raise AssertionError(f"the lease ended without a {kind} event")


def test_the_client_needs_no_cloud_sdk_and_not_the_daemon() -> None:
    """gpubroker_client imports with the daemon's packages and every dependency of the
    daemon but aiomqtt made unimportable (tests/client/test_install.py installs it
    alone)."""
    blocked = ("boto3", "botocore", "google", "azure", "alibabacloud", "broker", "adapters",
               "policies", "numpy", "highspy", "aiohttp", "prometheus_client", "pydantic",
               "yaml", "structlog", "orjson", "rbloom", "tenacity", "psycopg")
    code = (f"import sys\nfor name in {blocked!r}:\n    sys.modules[name] = None\n"
            "import gpubroker_client\nprint(gpubroker_client.BrokerClient.__name__)\n")
    path = os.pathsep.join(filter(None, [str(ROOT / "client"), os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=30, check=False,
                          env={**os.environ, "PYTHONPATH": path})
    assert (done.returncode, done.stdout) == (0, "BrokerClient\n"), done.stderr


async def test_place_returns_the_decided_lease(start_daemon: StartDaemon,
                                               mosquitto: Mosquitto) -> None:
    rd = await start_daemon()
    async with client(mosquitto) as c:
        assert await c.wait_daemon_online(5)
        lease = await c.place(gpu=GPUS, gpus=8, market="spot", request_id="job-1",
                              labels={"job": "llm"}, duration_hours=2, lease_seconds=120)
        assert c.leases == [lease]
    assert lease.lease_id.startswith("L-") and lease.request_id == "job-1"
    assert lease.scheduler == S and lease.epoch == 1 and lease.active
    p = lease.placement
    assert p.gpu in GPUS and p.total_gpus >= 8 and p.pool.market.value == "spot"
    assert 100 < (lease.expires_at - datetime.now(UTC)).total_seconds() <= 120
    assert 119 <= lease.lease_seconds <= 120
    assert lease.reason and 1 <= len(lease.alternatives) <= 3
    held = rd.daemon.book.get(lease.lease_id)
    assert held is not None and held.state is LeaseState.ACTIVE
    assert held.placement.to_json() == p.to_json()
    assert held.request.labels == {"job": "llm"} and held.request.duration_hours == 2


async def test_the_same_request_id_gets_the_same_lease(start_daemon: StartDaemon,
                                                       mosquitto: Mosquitto) -> None:
    rd = await start_daemon()
    async with client(mosquitto) as c, client(mosquitto) as other:
        first = await c.place(gpu=GPUS, gpus=8, request_id="job-2")
        again = await c.place(gpu=GPUS, gpus=8, request_id="job-2")
        elsewhere = await other.place(gpu=GPUS, gpus=8, request_id="job-2")
        generated = await c.place(gpu="T4", gpus=1)
    assert again is first  # one object per lease in a client
    assert elsewhere.lease_id == first.lease_id and elsewhere.epoch == first.epoch
    assert len(leases_for(rd, "job-2")) == 1
    assert uuid.UUID(generated.request_id)  # a uuid when none was given
    assert generated.lease_id != first.lease_id


async def test_rejections_raise_rejected_with_the_code(start_daemon: StartDaemon,
                                                       mosquitto: Mosquitto) -> None:
    await start_daemon()
    async with client(mosquitto) as c:
        with pytest.raises(Rejected) as cap:
            await c.place(gpu=GPUS, gpus=8, max_price_per_gpu_hour=0.01, request_id="cheap")
        with pytest.raises(Rejected) as none:
            await c.place(gpu="MI300X", gpus=1, request_id="rare")
    assert cap.value.code == "over_price_cap" and cap.value.request_id == "cheap"
    assert cap.value.retry_after is not None and cap.value.retry_after > 0
    assert "0.01" in cap.value.detail
    assert none.value.code == "no_capacity"


async def test_invalid_requests_raise_invalid_request_naming_the_fields(
        start_daemon: StartDaemon, mosquitto: Mosquitto) -> None:
    await start_daemon()
    async with client(mosquitto) as c:
        with pytest.raises(InvalidRequest) as bad:
            await c.place(gpu=GPUS, gpus=0, request_id="bad", **{"market": "cheap"})
        # What the daemon could not answer with the request_id is refused before sending.
        with pytest.raises(InvalidRequest) as long_id:
            await c.place(gpu="T4", gpus=1, request_id="x" * 129)
        with pytest.raises(InvalidRequest) as unknown:
            await c.release("L-nope")
    assert set(bad.value.fields) == {"gpus", "market"}
    assert bad.value.request_id == "bad"
    assert all(e["message"] for e in bad.value.errors)
    assert long_id.value.fields == ["request_id"]
    assert unknown.value.fields == ["lease_id"]


async def test_renew_and_release(start_daemon: StartDaemon, mosquitto: Mosquitto) -> None:
    rd = await start_daemon()
    async with client(mosquitto) as c:
        lease = await c.place(gpu="T4", gpus=1, lease_seconds=60, request_id="job-3")
        before = lease.expires_at
        await lease.renew()
        assert lease.expires_at >= before and lease.active
        held = rd.daemon.book.get(lease.lease_id)
        assert held is not None and lease.expires_at == held.expires_at.replace(
            microsecond=held.expires_at.microsecond // 1000 * 1000)

        await lease.release()
        assert lease.state is LeaseState.RELEASED and not lease.active
        assert lease.end is not None and lease.end.kind == "released"
        assert c.leases == []
        await lease.release()  # idempotent
        with pytest.raises(LeaseEnded) as ended:
            await lease.renew()
        assert ended.value.state is LeaseState.RELEASED
        # By id, as the command line does: an ended lease answers how it ended.
        assert await c.release(lease.lease_id) is LeaseState.RELEASED
        with pytest.raises(LeaseEnded):
            await c.renew(lease.lease_id)
    assert rd.daemon.book.get(lease.lease_id).state is LeaseState.RELEASED  # type: ignore[union-attr]
    assert [ev.kind async for ev in lease.events()] == ["renewed", "released"]


async def test_keep_alive_renews_before_expiry_and_stops_on_release(
        start_daemon: StartDaemon, mosquitto: Mosquitto) -> None:
    rd = await start_daemon()
    async with client(mosquitto) as c:
        lease = await c.place(gpu="T4", gpus=1, lease_seconds=2, keep_alive=True)
        first_expiry = lease.expires_at
        renewals = 0
        async with asyncio.timeout(10):
            async for ev in lease.events():
                assert ev.kind == "renewed", ev
                renewals += 1
                if renewals == 3:
                    break
        # Three renewals of a 2 s lease, each about half-way: the first expiry has passed.
        assert datetime.now(UTC) > first_expiry
        held = rd.daemon.book.get(lease.lease_id)
        assert held is not None and held.state is LeaseState.ACTIVE
        assert lease.keeping_alive
        await lease.release()
        assert not lease.keeping_alive  # stopped with the lease


async def test_an_unrenewed_lease_expires_and_calls_on_end(start_daemon: StartDaemon,
                                                           mosquitto: Mosquitto) -> None:
    await start_daemon()
    ended: list[LeaseEvent] = []
    called = asyncio.Event()

    def on_end(_: Lease, ev: LeaseEvent) -> None:
        ended.append(ev)
        called.set()

    async with client(mosquitto) as c:
        lease = await c.place(gpu="T4", gpus=1, lease_seconds=1, on_end=on_end)
        async with asyncio.timeout(5):
            end = await lease.wait_ended()
            await called.wait()  # callbacks run in a task of their own, right after
    assert end.kind == "expired" and lease.state is LeaseState.EXPIRED
    assert ended == [end]


async def test_a_failover_reaches_the_callback_and_the_events(
        start_daemon: StartDaemon, mosquitto: Mosquitto) -> None:
    rd = await start_daemon()
    called: list[tuple[int, LeaseEvent]] = []

    async def on_failover(lease: Lease, ev: LeaseEvent) -> None:
        called.append((lease.epoch, ev))

    async with client(mosquitto) as c:
        lease = await c.place(gpu=GPUS, gpus=8, market="spot", on_failover=on_failover)
        old = lease.placement
        rd.sim.interrupt(old.pool)
        ev = await next_event(lease, "failover")
        assert ev.epoch == 2 and lease.epoch == 2
        assert ev.previous == old and ev.placement == lease.placement
        assert ev.placement.pool != old.pool and ev.reason == "interrupted"
        held = rd.daemon.book.get(lease.lease_id)
        assert held is not None and held.epoch == 2
        assert held.placement.pool == PoolKey.from_json(lease.placement.to_json())
        await lease.release()
    assert called == [(2, ev)]


async def test_stale_and_repeated_events_are_ignored(start_daemon: StartDaemon,
                                                     mosquitto: Mosquitto,
                                                     probe_factory: ProbeFactory) -> None:
    """Fencing: after a failover, an event of the older epoch (a late re-send) changes
    nothing; an event seen before (the same id) is handled once."""
    await start_daemon()
    probe = await probe_factory([f"{PREFIX}/events/{S}/#"])
    async with client(mosquitto) as c:
        lease = await c.place(gpu=GPUS, gpus=8, lease_seconds=300)
        await lease.report("launch_failed", "InsufficientInstanceCapacity")
        assert lease.epoch == 2
        expires = lease.expires_at
        failover = await probe.wait_for(lambda m: m.topic.matches(f"{PREFIX}/events/{S}/+")
                                        and payload_json(m)["type"].endswith("failover.v1"))
        stale = {**payload_json(failover), "id": str(uuid.uuid4()),
                 "type": "gpubroker.lease.renewed.v1",
                 "data": {"lease_id": lease.lease_id, "epoch": 1,
                          "expires_at": "2099-01-01T00:00:00.000Z"}}
        await probe.publish(f"{PREFIX}/events/{S}/lease.renewed", stale)
        await probe.publish(f"{PREFIX}/events/{S}/lease.failover", payload_json(failover))
        await lease.renew()  # its answer comes after both
        kinds = [ev.kind async for ev in _until_renewed(lease)]
        assert kinds == ["failover", "renewed"]
        assert lease.epoch == 2 and expires <= lease.expires_at < datetime(2099, 1, 1, tzinfo=UTC)


async def _until_renewed(lease: Lease) -> Any:
    async for ev in lease.events():
        yield ev
        if ev.kind == "renewed":
            return


async def test_report_moves_the_lease(start_daemon: StartDaemon, mosquitto: Mosquitto) -> None:
    await start_daemon()
    async with client(mosquitto) as c:
        lease = await c.place(gpu=GPUS, gpus=8)
        old = lease.placement
        ev = await lease.report("launch_failed", "InsufficientInstanceCapacity")
    assert ev.kind == "failover" and ev.epoch == 2 == lease.epoch
    assert ev.reason == "reported" and "launch_failed" in (ev.detail or "")
    assert ev.previous == old and lease.placement.pool != old.pool


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
async def test_place_survives_an_mqtt_server_restart_in_the_middle(
        start_daemon: StartDaemon, mosquitto: Mosquitto, protocol: str) -> None:
    """The server stops after the daemon decided and before it could publish the answer;
    `place()` still returns the one lease once the server is back."""
    rd = await start_daemon(protocol=protocol)
    stopped = asyncio.Event()

    def stop_before_the_answer(kind: str, data: dict[str, Any]) -> None:
        if kind == "placement.decided" and data["request_id"] == "job-r" and \
                not stopped.is_set():
            mosquitto.stop()  # blocks the loop: the daemon publishes nothing meanwhile
            stopped.set()

    rd.daemon.broker.observers.append(stop_before_the_answer)
    async with client(mosquitto, protocol=protocol) as c:
        assert c.mqtt_version == protocol
        placing = asyncio.create_task(c.place(gpu=GPUS, gpus=8, request_id="job-r",
                                              timeout=30))
        async with asyncio.timeout(10):
            await stopped.wait()
        assert not placing.done()
        await mosquitto.astart()
        async with asyncio.timeout(20):
            lease = await placing
        assert c.connects == 2
        assert [le.lease_id for le in leases_for(rd, "job-r")] == [lease.lease_id]
        await lease.renew()  # subscribed again: answers still arrive
        await lease.release()
    assert len(leases_for(rd, "job-r")) == 1


async def test_place_while_the_mqtt_server_is_down_waits_for_it(
        start_daemon: StartDaemon, mosquitto: Mosquitto) -> None:
    rd = await start_daemon()
    async with client(mosquitto) as c:
        await mosquitto.astop()
        placing = asyncio.create_task(c.place(gpu="T4", gpus=1, request_id="job-d",
                                              timeout=30))
        await mosquitto.astart()
        async with asyncio.timeout(20):
            lease = await placing
    assert [le.lease_id for le in leases_for(rd, "job-d")] == [lease.lease_id]


async def test_requests_wait_while_the_daemon_is_offline(start_daemon: StartDaemon,
                                                         mosquitto: Mosquitto,
                                                         probe_factory: ProbeFactory,
                                                         tmp_path: Any) -> None:
    state = tmp_path / "state.db"
    first = await start_daemon(state=state)
    await first.stop()
    probe = await probe_factory([f"{PREFIX}/requests/{S}/place"])
    async with client(mosquitto, resend_after=0.2) as c:
        placing = asyncio.create_task(c.place(gpu="T4", gpus=1, request_id="job-o",
                                              timeout=30))
        await probe.wait_for_count(f"{PREFIX}/requests/{S}/place", 2)  # sent again
        assert c.daemon_online is False and not placing.done()
        second = await start_daemon(state=state)
        async with asyncio.timeout(10):
            lease = await placing
        assert c.daemon_online is True
    assert [le.lease_id for le in leases_for(second, "job-o")] == [lease.lease_id]


async def test_an_unanswered_request_is_sent_again_until_the_deadline(
        mosquitto: Mosquitto, probe_factory: ProbeFactory) -> None:
    probe = await probe_factory([f"{PREFIX}/requests/{S}/place"])
    async with client(mosquitto, resend_after=0.2) as c:
        started = time.monotonic()
        with pytest.raises(PlacementTimeout) as timeout:
            await c.place(gpu="T4", gpus=1, request_id="job-t", timeout=1)
        assert 1 <= time.monotonic() - started < 2
    assert timeout.value.request_id == "job-t"
    assert "no daemon" in str(timeout.value)
    sent = probe.matching(f"{PREFIX}/requests/{S}/place")
    assert len(sent) >= 3  # 0, 0.2, 0.6 s
    assert {payload_json(m)["request_id"] for m in sent} == {"job-t"}
    assert not any(m.retain for m in sent)


async def test_replies_come_on_the_response_topic_on_mqtt5(start_daemon: StartDaemon,
                                                           mosquitto: Mosquitto,
                                                           probe_factory: ProbeFactory) -> None:
    await start_daemon()
    probe = await probe_factory([f"{PREFIX}/replies/{S}/#", f"{PREFIX}/requests/{S}/#"])
    async with client(mosquitto) as c:
        lease = await c.place(gpu="T4", gpus=1, request_id="job-5")
    request = probe.matching(f"{PREFIX}/requests/{S}/place")[0]
    assert request.properties is not None
    reply_topic = request.properties.ResponseTopic
    assert reply_topic.startswith(f"{PREFIX}/replies/{S}/")
    reply = await probe.wait_for(reply_topic)
    assert payload_json(reply)["data"]["lease_id"] == lease.lease_id
    assert reply.properties is not None
    assert reply.properties.CorrelationData == request.properties.CorrelationData


async def test_an_unreachable_server_raises_broker_unavailable() -> None:
    url = f"mqtt://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(BrokerUnavailable) as err:
        async with BrokerClient(url, scheduler=S, connect_timeout=1):
            pass
    assert time.monotonic() - started < 3
    assert "127.0.0.1" in str(err.value)


async def test_protocol_auto_falls_back_to_311() -> None:
    """A server that speaks only 3.1.1: amqtt, the demo's embedded one (mosquitto
    cannot be told to refuse MQTT 5)."""
    from amqtt.broker import Broker

    port = free_port()
    server = Broker({"listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{port}"}},
                     "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin":
                                 {"allow_anonymous": True}}})
    await server.start()
    try:
        async with BrokerClient(f"mqtt://127.0.0.1:{port}", scheduler=S) as c:
            assert c.mqtt_version == "3.1.1" and c.connected
    finally:
        await server.shutdown()


async def test_a_lease_watch_lists_and_follows_leases(start_daemon: StartDaemon,
                                                      mosquitto: Mosquitto) -> None:
    rd = await start_daemon()
    async with client(mosquitto) as c, BrokerClient(mosquitto.url, scheduler=None) as w:
        before = await c.place(gpu="A10G", gpus=1, request_id="before")
        other = await BrokerClient(mosquitto.url, scheduler="infer").__aenter__()
        try:
            theirs = await other.place(gpu="L4", gpus=1)
            async with w.watch_leases(all_schedulers=True) as watch:
                await watch.synced(5)
                assert set(watch.states) == {before.lease_id, theirs.lease_id}
                assert watch.states[theirs.lease_id]["scheduler"] == "infer"
                changes = watch.changes()

                async def change() -> LeaseChange:
                    async with asyncio.timeout(5):
                        return await anext(changes)

                after = await c.place(gpu="T4", gpus=1, request_id="after")
                assert (await change()).kind == "placed"
                await after.renew()
                assert (await change()).kind == "renewed"
                rd.sim.interrupt(after.placement.pool)
                moved = await change()
                assert (moved.kind, moved.reason) == ("failover", "interrupted")
                assert moved.state is not None and moved.state["epoch"] == 2
                await after.release()
                gone = await change()
                assert (gone.kind, gone.lease_id) == ("released", after.lease_id)
                assert set(watch.states) == {before.lease_id, theirs.lease_id}
        finally:
            await other.close()
    assert json.dumps(dict(watch.states[before.lease_id]))


async def test_a_split_placement_gives_a_lease_per_part(start_daemon: StartDaemon,
                                                        mosquitto: Mosquitto) -> None:
    rd = await start_daemon()
    # More GPUs than any one pool has free: only a split can place it.
    room = [o.capacity * o.gpus for o in rd.daemon.pool.by_gpu("A100-80GB")
            if o.capacity is not None and o.price_per_hour is not None]
    assert room
    want = max(room) + 1
    async with client(mosquitto) as c:
        assert await c.wait_daemon_online(5)
        with pytest.raises(Rejected):
            await c.place(gpu="A100-80GB", gpus=want, request_id="whole")
        lease = await c.place(gpu="A100-80GB", gpus=want, request_id="split", gang=False,
                              max_parts=16, keep_alive=True)
        assert len(lease.parts) >= 2 and lease.parts[0] is lease
        assert {p.lease_id for p in lease.parts} <= {le.lease_id for le in c.leases}
        assert all(p.keeping_alive for p in lease.parts)
        assert sum(p.placement.total_gpus for p in lease.parts) >= want
        held = leases_for(rd, "split")
        assert sorted(le.lease_id for le in held) == sorted(p.lease_id for p in lease.parts)
        # The same request again: the same parts, not new ones.
        again = await c.place(gpu="A100-80GB", gpus=want, request_id="split", gang=False,
                              max_parts=16)
        assert [p.lease_id for p in again.parts] == [p.lease_id for p in lease.parts]
        for part in lease.parts:
            await part.release()
        assert not any(le.state is LeaseState.ACTIVE for le in leases_for(rd, "split"))


def _status(state: str, epoch: int, node: str, ts: str) -> dict[str, Any]:
    return {"state": state, "ts": ts, "boot_id": str(uuid.uuid4()), "version": "0.1.0",
            "node": node, "role": "leader", "epoch": epoch}


async def test_a_status_of_a_lower_leader_epoch_is_ignored(
        mosquitto: Mosquitto, probe_factory: ProbeFactory,
        caplog: pytest.LogCaptureFixture) -> None:
    """High availability: once `online` of epoch 3 was seen, a retained `offline` of
    epoch 2 (a deposed leader's will or goodbye, late) does not make the client believe
    the daemon offline; a status of epoch 3 after it is taken as usual."""
    probe = await probe_factory([f"{PREFIX}/status"])
    topic = f"{PREFIX}/status"
    await probe.publish(topic, _status("online", 3, "a", "2026-11-30T12:00:00.000Z"),
                        retain=True)
    caplog.set_level("DEBUG", logger="gpubroker.client")
    async with BrokerClient(mosquitto.url, scheduler=None) as c:
        assert await c.wait_daemon_online(5)
        assert c.leader_epoch == 3
        await probe.publish(topic, _status("offline", 2, "b", "2026-11-30T12:00:01.000Z"),
                            retain=True)
        # The next status, on the same topic, arrives after it: the client has handled
        # the stale one by then.
        marker = "2026-11-30T12:00:02.000Z"
        await probe.publish(topic, _status("online", 3, "a", marker), retain=True)
        async with asyncio.timeout(5):
            while c.daemon_status is None or c.daemon_status["ts"] != marker:
                await c.wait_daemon_online(5)
                await asyncio.sleep(0.01)
        offline = [r for r in caplog.records if "offline" in r.getMessage()
                   and r.levelname == "WARNING"]
        assert not offline, "the client believed the daemon offline"
        assert any("ignored" in r.getMessage() and r.levelname == "DEBUG"
                   for r in caplog.records)
        # A status of the same epoch counts: the will of the leader that crashed.
        await probe.publish(topic, _status("offline", 3, "a", "2026-11-30T12:00:03.000Z"),
                            retain=True)
        async with asyncio.timeout(5):
            while c.daemon_online:  # noqa: ASYNC110 - the client has no "offline" event
                await asyncio.sleep(0.01)
    await probe.publish(topic, b"", retain=True)


async def test_an_event_of_a_lower_leader_epoch_is_dropped(
        start_daemon: StartDaemon, mosquitto: Mosquitto,
        probe_factory: ProbeFactory) -> None:
    """High availability: once an event of leader epoch 3 was seen, an event of leader
    epoch 2 (a deposed leader's, late) is dropped, even one the lease would take (a
    renewal of its epoch); a later event of epoch 3 is handled."""
    await start_daemon()
    probe = await probe_factory([f"{PREFIX}/events/{S}/#"])
    async with client(mosquitto) as c:
        lease = await c.place(gpu=GPUS, gpus=8, lease_seconds=300)
        decided = await probe.wait_for(lambda m: m.topic.matches(f"{PREFIX}/events/{S}/+")
                                       and payload_json(m)["type"].endswith("decided.v1"))
        assert payload_json(decided)["leaderepoch"] == 0  # a single daemon

        def renewed(leader_epoch: int, expires_at: str) -> dict[str, Any]:
            return {**payload_json(decided), "id": str(uuid.uuid4()),
                    "type": "gpubroker.lease.renewed.v1", "leaderepoch": leader_epoch,
                    "data": {"lease_id": lease.lease_id, "epoch": 1,
                             "expires_at": expires_at}}

        topic = f"{PREFIX}/events/{S}/lease.renewed"
        await probe.publish(topic, renewed(3, "2098-01-01T00:00:00.000Z"))
        await probe.publish(topic, renewed(2, "2099-01-01T00:00:00.000Z"))
        await probe.publish(topic, renewed(3, "2097-01-01T00:00:00.000Z"))
        got: list[datetime] = []
        async with asyncio.timeout(5):
            async for ev in lease.events():
                if ev.kind == "renewed" and ev.expires_at is not None:
                    got.append(ev.expires_at)
                    if ev.expires_at.year == 2097:
                        break
        assert [t.year for t in got] == [2098, 2097]
        assert c.leader_epoch == 3
