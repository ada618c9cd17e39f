"""The daemon end to end through a real mosquitto: what a scheduler sees (SPEC §3–§5)."""

from __future__ import annotations

import asyncio
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

from daemon_helpers import PREFIX, StartDaemon, daemon_config
from mqtt_helpers import Mosquitto, MqttProbe, ProbeFactory, payload_json, publish_properties

from broker.daemon.assembly import Daemon
from broker.model import PoolKey

S = "sched-1"
EVENTS = f"{PREFIX}/events/{S}/"
ENVELOPE = {"specversion", "id", "source", "type", "time", "subject", "datacontenttype",
            "seq", "bootid", "leaderepoch", "schedseq", "correlationid", "data"}
PLACEMENT = {"cloud", "region", "zone", "instance_type", "instances", "market", "gpu", "gpus",
             "total_gpus", "price_per_hour", "price_per_gpu_hour", "price_observed_at"}


def place_body(request_id: str, **extra: Any) -> dict[str, Any]:
    return {"request_id": request_id, "gpu": ["A100-80GB", "H100-80GB"], "gpus": 8, **extra}


def event_of(probe: MqttProbe, kind: str, **data: Any) -> Any:
    """Predicate: an event of `kind` for scheduler S whose data has these values."""
    def match(msg: Any) -> bool:
        if str(msg.topic) != EVENTS + kind:
            return False
        d = payload_json(msg)["data"]
        return all(d.get(k) == v for k, v in data.items())
    return match


async def request(probe: MqttProbe, verb: str, body: Any, kind: str, **match: Any
                  ) -> dict[str, Any]:
    mark = probe.mark()
    await probe.publish(f"{PREFIX}/requests/{S}/{verb}", body)
    msg = await probe.wait_for(event_of(probe, kind, **match), since=mark)
    return payload_json(msg)  # type: ignore[no-any-return]


async def test_place_decides_with_every_field(start_daemon: StartDaemon,
                                              probe_factory: ProbeFactory) -> None:
    rd = await start_daemon()
    probe = await probe_factory([f"{PREFIX}/#"])
    ev = await request(probe, "place", place_body("job-1", duration_hours=6,
                                                  labels={"job": "llm"}),
                       "placement.decided", request_id="job-1")

    assert set(ev) == ENVELOPE
    assert ev["specversion"] == "1.0"
    assert ev["type"] == "gpubroker.placement.decided.v1"
    assert ev["source"] == "gpubroker://test"
    assert ev["bootid"] == rd.daemon.boot_id
    assert ev["leaderepoch"] == 0  # one daemon on SQLite: no election
    assert ev["correlationid"] == "job-1"
    assert ev["time"].endswith("Z")
    d = ev["data"]
    assert set(d) == {"request_id", "lease_id", "epoch", "placement", "expires_at", "reason",
                      "alternatives", "lease_seconds"}
    assert d["epoch"] == 1 and d["lease_id"].startswith("L-")
    assert ev["subject"] == f"lease/{d['lease_id']}"
    p = d["placement"]
    assert set(p) == PLACEMENT
    assert p["gpu"] in ("A100-80GB", "H100-80GB")
    assert p["total_gpus"] == p["instances"] * p["gpus"] >= 8
    assert abs(p["price_per_gpu_hour"] - p["price_per_hour"] / p["total_gpus"]) < 1e-6
    assert d["reason"]
    assert 1 <= len(d["alternatives"]) <= 3
    for alt in d["alternatives"]:
        assert set(alt) == PLACEMENT
        assert (alt["zone"], alt["instance_type"], alt["market"]) != (
            p["zone"], p["instance_type"], p["market"])

    # The lease's state is retained for late subscribers.
    late = await probe_factory([f"{PREFIX}/leases/{S}/+"])
    msg = await late.wait_for(f"{PREFIX}/leases/{S}/{d['lease_id']}")
    assert msg.retain
    state = payload_json(msg)
    assert state["state"] == "active" and state["epoch"] == 1
    assert state["placement"] == p


async def test_same_request_id_gets_the_same_lease(start_daemon: StartDaemon,
                                                   probe_factory: ProbeFactory) -> None:
    rd = await start_daemon()
    probe = await probe_factory([f"{PREFIX}/events/#"])
    first = await request(probe, "place", place_body("job-2"), "placement.decided",
                          request_id="job-2")
    again = await request(probe, "place", place_body("job-2", gpus=1), "placement.decided",
                          request_id="job-2")
    assert again["data"]["lease_id"] == first["data"]["lease_id"]
    assert again["data"]["placement"] == first["data"]["placement"]
    assert again["id"] != first["id"]
    assert len(rd.daemon.book.active()) == 1
    # Seq increases by one per published event within a boot (the retained lease-state
    # messages are not events and take no seq).
    assert again["seq"] == first["seq"] + 1


async def test_renew_release_and_retained_state_cleared(start_daemon: StartDaemon,
                                                        probe_factory: ProbeFactory) -> None:
    rd = await start_daemon()
    probe = await probe_factory([f"{PREFIX}/#"])
    d = (await request(probe, "place", place_body("job-3", lease_seconds=60),
                       "placement.decided", request_id="job-3"))["data"]
    lease_id = d["lease_id"]
    renewed = (await request(probe, "renew", {"lease_id": lease_id}, "lease.renewed",
                             lease_id=lease_id))["data"]
    assert renewed["epoch"] == 1 and renewed["expires_at"] >= d["expires_at"]

    mark = probe.mark()
    await request(probe, "release", {"lease_id": lease_id}, "lease.released", lease_id=lease_id)
    cleared = await probe.wait_for(
        lambda m: str(m.topic) == f"{PREFIX}/leases/{S}/{lease_id}" and m.payload == b"",
        since=mark)
    assert cleared is not None
    assert rd.daemon.book.get(lease_id).state.value == "released"  # type: ignore[union-attr]
    assert rd.daemon.pool.held(PoolKey.from_json(d["placement"])) == 0
    # A late subscriber finds no retained state for the ended lease.
    late = await probe_factory([f"{PREFIX}/leases/{S}/+"])
    other = await late.wait_for(f"{PREFIX}/leases/{S}/+", timeout=0.5) \
        if late.messages else None
    assert other is None or str(other.topic) != f"{PREFIX}/leases/{S}/{lease_id}"
    # Renewing a released lease repeats how it ended.
    await request(probe, "renew", {"lease_id": lease_id}, "lease.released", lease_id=lease_id)


async def test_unrenewed_lease_expires(start_daemon: StartDaemon,
                                       probe_factory: ProbeFactory) -> None:
    rd = await start_daemon()
    probe = await probe_factory([f"{PREFIX}/events/#"])
    d = (await request(probe, "place", place_body("job-4", lease_seconds=1),
                       "placement.decided", request_id="job-4"))["data"]
    ev = await probe.wait_for(event_of(probe, "lease.expired", lease_id=d["lease_id"]),
                              timeout=5)
    assert payload_json(ev)["subject"] == f"lease/{d['lease_id']}"
    assert rd.daemon.book.active() == []


async def test_sim_preemption_fails_over_to_another_pool(start_daemon: StartDaemon,
                                                         probe_factory: ProbeFactory) -> None:
    rd = await start_daemon()
    probe = await probe_factory([f"{PREFIX}/#"])
    d = (await request(probe, "place", place_body("job-5", market="spot"),
                       "placement.decided", request_id="job-5"))["data"]
    old = PoolKey.from_json(d["placement"])
    rd.sim.interrupt(old)
    ev = await probe.wait_for(event_of(probe, "lease.failover", lease_id=d["lease_id"]))
    f = payload_json(ev)["data"]
    assert f["epoch"] == 2
    assert f["reason"] == "interrupted"
    assert f["from"] == d["placement"]
    assert PoolKey.from_json(f["to"]) != old
    assert f["to"]["total_gpus"] >= 8
    state = payload_json(await probe.wait_for(
        lambda m: str(m.topic) == f"{PREFIX}/leases/{S}/{d['lease_id']}" and m.payload
        and payload_json(m)["epoch"] == 2))
    assert state["placement"] == f["to"]
    # The broker's holdings moved with the lease.
    assert rd.daemon.pool.held(old) == 0
    assert rd.daemon.pool.held(PoolKey.from_json(f["to"])) == f["to"]["instances"]


async def test_scheduler_report_fails_over(start_daemon: StartDaemon,
                                           probe_factory: ProbeFactory) -> None:
    await start_daemon()
    probe = await probe_factory([f"{PREFIX}/events/#"])
    d = (await request(probe, "place", place_body("job-6"), "placement.decided",
                       request_id="job-6"))["data"]
    f = (await request(probe, "report", {"lease_id": d["lease_id"], "kind": "launch_failed",
                                         "detail": "InsufficientInstanceCapacity"},
                       "lease.failover", lease_id=d["lease_id"]))["data"]
    assert f["epoch"] == 2 and f["reason"] == "reported"
    assert "launch_failed" in f["detail"]
    assert PoolKey.from_json(f["to"]) != PoolKey.from_json(d["placement"])


async def test_a_report_is_answered_on_its_response_topic(start_daemon: StartDaemon,
                                                          probe_factory: ProbeFactory) -> None:
    """The lease.failover that answers a report is a reply like any other (SPEC §3)."""
    await start_daemon()
    reply_topic = f"{PREFIX}/replies/{S}/{uuid.uuid4().hex}"
    probe = await probe_factory([f"{PREFIX}/events/#", reply_topic])
    d = (await request(probe, "place", place_body("job-6r"), "placement.decided",
                       request_id="job-6r"))["data"]
    props = publish_properties(ResponseTopic=reply_topic, CorrelationData=b"rep")
    await probe.publish(f"{PREFIX}/requests/{S}/report",
                        {"lease_id": d["lease_id"], "kind": "interrupted"}, properties=props)
    msg = await probe.wait_for(reply_topic)
    assert payload_json(msg)["type"] == "gpubroker.lease.failover.v1"
    assert payload_json(msg)["data"]["lease_id"] == d["lease_id"]
    assert msg.properties is not None and msg.properties.CorrelationData == b"rep"


async def test_withdrawn_pool_fails_over_as_capacity_lost(start_daemon: StartDaemon,
                                                          probe_factory: ProbeFactory) -> None:
    rd = await start_daemon()
    probe = await probe_factory([f"{PREFIX}/events/#"])
    d = (await request(probe, "place", place_body("job-7"), "placement.decided",
                       request_id="job-7"))["data"]
    rd.sim.withdraw(PoolKey.from_json(d["placement"]))
    await rd.daemon.poller.poll_all()
    f = payload_json(await probe.wait_for(event_of(probe, "lease.failover",
                                                   lease_id=d["lease_id"])))["data"]
    assert f["reason"] == "capacity_lost" and f["epoch"] == 2


async def test_failover_with_nowhere_to_go_fails_the_lease(start_daemon: StartDaemon,
                                                           probe_factory: ProbeFactory) -> None:
    rd = await start_daemon()
    probe = await probe_factory([f"{PREFIX}/events/#"])
    # Ask for exactly one pool: one cloud, one region, spot, the cheapest model there.
    d = (await request(probe, "place", {"request_id": "job-8", "gpu": "T4", "gpus": 1,
                                        "market": "on_demand", "clouds": ["aws"]},
                       "placement.decided", request_id="job-8"))["data"]
    pinned = {"request_id": "job-8b", "gpu": "T4", "gpus": 1, "market": "on_demand",
              "clouds": ["aws"], "regions": [d["placement"]["region"]]}
    d2 = (await request(probe, "place", pinned, "placement.decided",
                        request_id="job-8b"))["data"]
    # Withdraw every T4 on-demand pool of that cloud: nowhere left to go.
    for offer in list(rd.daemon.pool):
        if offer.gpu == "T4" and offer.pool.cloud == "aws" and \
                offer.pool.market.value == "on_demand":
            rd.sim.withdraw(offer.pool)
    await rd.daemon.poller.poll_all()
    for lease_id in (d["lease_id"], d2["lease_id"]):
        ev = payload_json(await probe.wait_for(event_of(probe, "lease.failed",
                                                        lease_id=lease_id)))
        assert ev["data"]["reason"] == "capacity_lost"
        assert "no other placement" in ev["data"]["detail"]


async def test_bad_requests_are_answered_and_the_daemon_keeps_serving(
        start_daemon: StartDaemon, probe_factory: ProbeFactory) -> None:
    await start_daemon()
    probe = await probe_factory([f"{PREFIX}/events/#"])
    topic = f"{PREFIX}/requests/{S}/place"

    bad_json = await request(probe, "place", b"{not json", "request.invalid")
    assert bad_json["data"]["topic"] == topic
    assert "JSON" in bad_json["data"]["errors"][0]["message"]

    wrong = await request(probe, "place", {"request_id": "job-9", "gpu": "T4", "gpus": "two",
                                           "market": "cheap"},
                          "request.invalid", request_id="job-9")
    fields = {e["field"] for e in wrong["data"]["errors"]}
    assert fields == {"gpus", "market"}

    missing = await request(probe, "renew", {"lease": "x"}, "request.invalid")
    assert missing["data"]["errors"][0]["field"] == "lease_id"

    unknown = await request(probe, "release", {"lease_id": "L-nope"}, "request.invalid")
    assert unknown["data"]["errors"][0]["field"] == "lease_id"

    verb = await request(probe, "teleport", {}, "request.invalid")
    assert "unknown verb" in verb["data"]["errors"][0]["message"]

    ok = await request(probe, "place", place_body("job-10"), "placement.decided",
                       request_id="job-10")
    assert ok["data"]["epoch"] == 1


async def test_rejections_name_the_code(start_daemon: StartDaemon,
                                        probe_factory: ProbeFactory) -> None:
    await start_daemon()
    probe = await probe_factory([f"{PREFIX}/events/#"])
    cap = await request(probe, "place", place_body("job-11", max_price_per_gpu_hour=0.01),
                        "placement.rejected", request_id="job-11")
    assert cap["data"]["code"] == "over_price_cap"
    assert cap["data"]["retry_after_seconds"] > 0
    none = await request(probe, "place", {"request_id": "job-12", "gpu": "MI300X", "gpus": 1},
                         "placement.rejected", request_id="job-12")
    assert none["data"]["code"] == "no_capacity"


async def test_an_unknown_gpu_model_is_invalid_not_no_capacity(
        start_daemon: StartDaemon, probe_factory: ProbeFactory) -> None:
    await start_daemon()
    probe = await probe_factory([f"{PREFIX}/events/#"])
    ev = await request(probe, "place", {"request_id": "job-13", "gpu": "H100", "gpus": 8},
                       "request.invalid", request_id="job-13")
    assert ev["data"]["errors"] == [
        {"field": "gpu", "message": "unknown GPU model 'H100'; did you mean 'H100-80GB'?"}]


async def test_scheduler_cannot_touch_another_schedulers_lease(
        start_daemon: StartDaemon, probe_factory: ProbeFactory) -> None:
    rd = await start_daemon()
    probe = await probe_factory([f"{PREFIX}/events/#"])
    d = (await request(probe, "place", place_body("job-13"), "placement.decided",
                       request_id="job-13"))["data"]
    mark = probe.mark()
    await probe.publish(f"{PREFIX}/requests/intruder/release", {"lease_id": d["lease_id"]})
    msg = await probe.wait_for(f"{PREFIX}/events/intruder/request.invalid", since=mark)
    assert payload_json(msg)["data"]["errors"][0]["field"] == "lease_id"
    assert rd.daemon.book.get(d["lease_id"]).state.value == "active"  # type: ignore[union-attr]


async def test_retained_requests_are_ignored(start_daemon: StartDaemon,
                                             probe_factory: ProbeFactory) -> None:
    probe = await probe_factory([f"{PREFIX}/events/#"])
    # Retained before the daemon subscribes: delivered to it as retained, never acted on.
    await probe.publish(f"{PREFIX}/requests/{S}/place", place_body("stale"), retain=True)
    rd = await start_daemon()
    await request(probe, "place", place_body("fresh"), "placement.decided",
                  request_id="fresh")
    assert rd.daemon.book.find(S, "stale") is None
    assert not probe.matching(event_of(probe, "placement.decided", request_id="stale"))


async def test_mqtt5_response_topic_gets_the_reply(start_daemon: StartDaemon,
                                                   probe_factory: ProbeFactory) -> None:
    await start_daemon()
    reply_topic = f"{PREFIX}/replies/{S}/{uuid.uuid4().hex}"
    probe = await probe_factory([reply_topic, f"{PREFIX}/events/#", "elsewhere/#"])
    props = publish_properties(ResponseTopic=reply_topic, CorrelationData=b"\x01corr")
    await probe.publish(f"{PREFIX}/requests/{S}/place", place_body("job-14"),
                        properties=props)
    msg = await probe.wait_for(reply_topic)
    assert payload_json(msg)["data"]["request_id"] == "job-14"
    assert msg.properties is not None
    assert msg.properties.CorrelationData == b"\x01corr"
    # A ResponseTopic outside the scheduler's own replies tree is not honoured: the
    # answer still comes on the event topic, and nothing is written elsewhere.
    for i, target in enumerate(("elsewhere/x", f"{PREFIX}/events/other/placement.decided",
                                f"{PREFIX}/replies/other/x")):
        props = publish_properties(ResponseTopic=target, CorrelationData=b"x")
        await probe.publish(f"{PREFIX}/requests/{S}/place", place_body(f"job-14{i}"),
                            properties=props)
        await probe.wait_for(event_of(probe, "placement.decided", request_id=f"job-14{i}"))
    assert not probe.matching("elsewhere/#")
    assert not probe.matching(f"{PREFIX}/events/other/#")


async def test_works_over_mqtt_311(start_daemon: StartDaemon,
                                   probe_factory: ProbeFactory) -> None:
    await start_daemon(protocol="3.1.1")
    probe = await probe_factory([f"{PREFIX}/#"], protocol="3.1.1")
    ev = await request(probe, "place", place_body("job-15"), "placement.decided",
                       request_id="job-15")
    assert ev["data"]["epoch"] == 1
    status = await probe.wait_for(f"{PREFIX}/status")
    assert payload_json(status)["state"] == "online"


async def test_capacity_summaries_are_retained(start_daemon: StartDaemon,
                                               probe_factory: ProbeFactory) -> None:
    await start_daemon()
    live = await probe_factory([f"{PREFIX}/capacity/#"])
    await live.wait_for(f"{PREFIX}/capacity/aws/+/H100-80GB")
    late = await probe_factory([f"{PREFIX}/capacity/#"])
    msg = await late.wait_for(f"{PREFIX}/capacity/aws/+/H100-80GB")
    s = payload_json(msg)
    assert msg.retain
    assert s["cloud"] == "aws" and s["gpu"] == "H100-80GB"
    assert s["cheapest_on_demand_per_gpu_hour"] > 0
    # A retained message reaches a late subscriber with what is left of its expiry.
    assert msg.properties is not None
    assert 3 * 3600 - 30 <= msg.properties.MessageExpiryInterval <= 3 * 3600


async def test_events_survive_an_mqtt_server_restart(start_daemon: StartDaemon,
                                                     mosquitto: Mosquitto) -> None:
    """Events that happen while the MQTT server is down are published once it is back;
    leases expire only once the daemon hears again (after the reconnect grace)."""
    rd = await start_daemon(reconnect_grace_seconds=1)
    async with MqttProbe(mosquitto.url, [f"{PREFIX}/events/#"], persistent=True,
                         client_id="watcher") as probe:
        leases = []
        for i in range(5):
            ev = await request(probe, "place", place_body(f"job-r{i}", lease_seconds=2,
                                                          market="spot"),
                               "placement.decided", request_id=f"job-r{i}")
            leases.append(ev["data"])
        moved = asyncio.Event()
        seen: list[str] = []

        def observe(kind: str, data: dict[str, Any]) -> None:
            if kind in ("lease.expired", "lease.failover"):
                seen.append(kind)
            if kind == "lease.failover":
                moved.set()

        rd.daemon.broker.observers.append(observe)
        await mosquitto.astop()
        await probe.wait_disconnected(timeout=5)
        # While the server is down: a preemption fails one lease over; none expires
        # (the daemon cannot hear their renewals), though their 2 s run out meanwhile.
        rd.sim.interrupt(PoolKey.from_json(leases[0]["placement"]))
        async with asyncio.timeout(10):
            await moved.wait()
        await asyncio.sleep(2.5)  # past every lease's TTL, the server still down
        assert "lease.expired" not in seen
        assert rd.daemon.bus.outbox_depth > 0
        await mosquitto.astart()
        await probe.reconnect()
        for d in leases:
            await probe.wait_for(event_of(probe, "lease.expired", lease_id=d["lease_id"]),
                                 timeout=10)
        await probe.wait_for(event_of(probe, "lease.failover", lease_id=leases[0]["lease_id"]))
        ids = [payload_json(m)["id"] for m in probe.messages]
        kinds = {payload_json(m)["type"] for m in probe.messages}
        assert {"gpubroker.lease.expired.v1", "gpubroker.lease.failover.v1"} <= kinds
        assert len(set(ids)) >= 5 + 5 + 1
        assert await rd.daemon.bus.drained(5)
        assert await rd.daemon.store.pending() == []


async def test_clean_stop_publishes_offline(start_daemon: StartDaemon,
                                            probe_factory: ProbeFactory) -> None:
    rd = await start_daemon()
    probe = await probe_factory([f"{PREFIX}/status"])
    online = payload_json(await probe.wait_for(f"{PREFIX}/status"))
    assert online["state"] == "online" and online["boot_id"] == rd.daemon.boot_id
    assert set(online) == {"state", "ts", "boot_id", "version", "node", "role", "epoch"}
    assert online["role"] == "leader" and online["epoch"] == 0
    mark = probe.mark()
    await rd.stop()
    offline = payload_json(await probe.wait_for(f"{PREFIX}/status", since=mark))
    assert offline["state"] == "offline" and offline["boot_id"] == rd.daemon.boot_id


async def test_a_polled_slice_waits_for_its_capacity_summaries_once(mosquitto: Mosquitto,
                                                                     tmp_path: Path) -> None:
    """The publisher reads a slice when its turn comes, so a slice already waiting is not
    queued again: what waits is bounded by the slices, however often they are polled."""
    # Not run, so nothing publishes: the publisher is as blocked as it gets.
    daemon = Daemon(daemon_config(mosquitto, tmp_path / "state.db"))
    sim = daemon.adapter("sim")
    try:
        first, second = sim.regions()[:2]
        for _ in range(100):
            await daemon.poller.poll_once(sim, first)
        assert daemon.capacity_pending == 1
        await daemon.poller.poll_once(sim, second)
        await daemon.poller.poll_once(sim, first)
        assert daemon.capacity_pending == 2
    finally:
        for adapter in daemon.adapters:
            await adapter.close()


async def test_a_polls_changes_go_into_the_cost_lists_as_they_come(
        start_daemon: StartDaemon, monkeypatch: Any) -> None:
    """Placement's cost lists follow the pool as it changes, not when the next batch of
    requests reads them (that batch once placed a whole round's changes first, held for
    hundreds of milliseconds): each change is placed at once, without waiting for the
    periodic check."""
    from broker.daemon.assembly import tasks

    monkeypatch.setattr(tasks, "PREPARE_COSTS_SECONDS", 3600.0)
    rd = await start_daemon()
    daemon = rd.daemon
    broker = daemon.broker

    async def until(done: Any) -> None:
        """Poll `done` (the index's own state: nothing to wait on) until it holds."""
        async with asyncio.timeout(10):
            while not done():  # noqa: ASYNC110 - no event to wait on (see above)
                await asyncio.sleep(0.01)

    await until(lambda: broker._costs is not None and broker._costs._lists)
    index = broker._costs
    sim = daemon.adapter("sim")
    changed: list[PoolKey] = []
    for region in sim.regions()[:3]:
        changed += (await daemon.poller.poll_once(sim, region)).change.updated
    assert changed

    def placed(key: PoolKey) -> bool:
        offer = daemon.pool.get(key)
        return any(entry[2] is offer for entry in index._placed.get(key, ())[1::2])

    # (an offer without a price is in no list)
    priced = [k for k in changed if (o := daemon.pool.get(k)) and o.price_per_hour]
    assert priced

    await until(lambda: all(placed(k) for k in priced))
    assert broker._costs is index and not index._dirty


# --- the state file: synced commits, one daemon per file (#26) ---------------------------


async def test_the_daemons_state_connection_syncs_every_commit(
        start_daemon: StartDaemon) -> None:
    """synchronous=FULL (2) by default: a decision is on disk before it is published."""
    rd = await start_daemon()
    assert await rd.daemon.store.call(
        lambda db: db.execute("PRAGMA synchronous").fetchone()[0]) == 2


REPO = Path(__file__).resolve().parents[2]


async def gpubroker_process(*args: str | Path, log: Path | None = None
                            ) -> asyncio.subprocess.Process:
    """`python -m broker.cli ...` as systemd runs it; its output in pipes, or appended to
    `log` for a daemon that runs on (a pipe nobody reads would block it when full)."""
    if log is None:
        out: Any = asyncio.subprocess.PIPE
    else:
        out = await asyncio.to_thread(log.open, "ab")
    try:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "broker.cli", *map(str, args), cwd=REPO,
            stdout=out, stderr=out)
    finally:
        if log is not None:
            out.close()  # the child has its own copy


async def online(probe: MqttProbe, since: int, not_boot: str | None = None) -> str:
    """The boot_id of the next daemon to announce itself `online` (not `not_boot`)."""
    msg = await probe.wait_for(
        lambda m: str(m.topic) == f"{PREFIX}/status" and bool(m.payload)
        and payload_json(m)["state"] == "online" and payload_json(m)["boot_id"] != not_boot,
        since=since, timeout=30)
    return str(payload_json(msg)["boot_id"])


async def test_a_second_daemon_on_the_same_state_file_exits_2_until_the_first_dies(
        tmp_path: Path, mosquitto: Mosquitto, probe_factory: ProbeFactory) -> None:
    """Two daemons writing one file would each publish decisions the other does not
    know. The second fails at start (exit 2, one line naming the file and the holder's
    pid); the read commands still work; once the first is killed (-9: no clean close),
    the lock is gone with it and a new daemon starts."""
    state = tmp_path / "state.db"
    config = tmp_path / "config.yaml"
    config.write_text(
        f"site: lock-test\nstate: {{path: '{state}'}}\nhttp: {{listen: null}}\n"
        f"mqtt: {{url: '{mosquitto.url}', client_id: gpubroker-lock-test}}\n"
        "poll: {interval_seconds: 3600, stale_after_seconds: 7200}\n"
        "clouds: {sim: {seed: 3, regions_per_cloud: 1, zones_per_region: 2, "
        "preempt_rate_multiplier: 0}}\n")
    probe = await probe_factory([f"{PREFIX}/status"])
    started: list[asyncio.subprocess.Process] = []
    try:
        log = tmp_path / "daemons.log"
        first = await gpubroker_process("run", "--config", config, log=log)
        started.append(first)
        boot1 = await online(probe, 0)

        second = await gpubroker_process("run", "--config", config)
        started.append(second)
        async with asyncio.timeout(30):
            _, err = await second.communicate()
        assert second.returncode == 2, err.decode()
        assert err.decode().splitlines() == [
            f"gpubroker: {state}: state.path: cannot open the state file: another "
            f"gpubroker (pid {first.pid}) is using it (lock {state}.lock held); one daemon "
            "per state file"]
        assert first.returncode is None  # the first runs on, untouched

        # Read-only commands take no lock.
        for args in (("history", "--state", state, "--since", "1h"),
                     ("policy", "diff", REPO / "deploy/policy.example.yaml",
                      REPO / "deploy/policy.example.yaml", "--config", config)):
            reader = await gpubroker_process(*args)
            async with asyncio.timeout(30):
                _, err = await reader.communicate()
            assert reader.returncode == 0, (args, err.decode())

        mark = probe.mark()
        first.send_signal(signal.SIGKILL)
        async with asyncio.timeout(10):
            await first.wait()
        third = await gpubroker_process("run", "--config", config, log=log)
        started.append(third)
        assert await online(probe, mark, not_boot=boot1) != boot1
        assert third.returncode is None
        assert (await asyncio.to_thread(state.with_name("state.db.lock").read_text)
                ).strip() == str(third.pid)
    finally:
        for proc in started:
            if proc.returncode is None:
                proc.send_signal(signal.SIGKILL)
            await proc.wait()
