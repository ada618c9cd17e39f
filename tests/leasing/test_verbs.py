"""Contract 1.1's lease verbs through a real daemon and a real mosquitto, on MQTT 5 and
3.1.1 (broker/leasing/verbs.py): epochs on renew, release and report (an older one
changes nothing: `lease.current`; a newer one is invalid), a report acted on once per
epoch, `report.declined`, the per-scheduler limit on the pools reports cool, the echo
of `verb` and `lease_id` in `request.invalid`, `lease_seconds` and how a lease ended in
the repeated answers, `release` by `request_id`, `lookup`, and every verb answered."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from daemon_helpers import PREFIX, RunningDaemon, StartDaemon
from mqtt_helpers import MqttProbe, ProbeFactory, payload_json

from broker.model import PoolKey, utcnow

PROTOCOLS = [5, "3.1.1"]


def body(request_id: str, **fields: Any) -> dict[str, Any]:
    return {"request_id": request_id, "gpu": ["A100-80GB", "H100-80GB"], "gpus": 8,
            "market": "spot", **fields}


async def ask(probe: MqttProbe, scheduler: str, verb: str, payload: Any,
              timeout: float = 10) -> tuple[dict[str, Any], float]:
    """Send one request; the first event to `scheduler` after it and how long it took.
    Each test's schedulers have one request in flight at a time."""
    mark = probe.mark()
    sent = time.monotonic()
    await probe.publish(f"{PREFIX}/requests/{scheduler}/{verb}", payload)
    msg = await probe.wait_for(f"{PREFIX}/events/{scheduler}/#", timeout=timeout, since=mark)
    took = probe.received_at[probe.messages.index(msg)] - sent
    return payload_json(msg), took


def kind(event: dict[str, Any]) -> str:
    return str(event["type"]).removeprefix("gpubroker.").removesuffix(".v1")


def count(probe: MqttProbe, scheduler: str, k: str) -> int:
    return len(probe.matching(f"{PREFIX}/events/{scheduler}/{k}"))


async def started(start_daemon: StartDaemon, probe_factory: ProbeFactory, protocol: Any,
                  policy: str | None = None, tmp_path: Path | None = None
                  ) -> tuple[RunningDaemon, MqttProbe]:
    policy_file = None
    if policy is not None:
        assert tmp_path is not None
        policy_file = tmp_path / "policy.yaml"
        policy_file.write_text(policy)
    rd = await start_daemon(protocol=protocol, policy_file=policy_file)
    probe = await probe_factory([f"{PREFIX}/events/#"], protocol=protocol)
    return rd, probe


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_stale_report_after_a_failover_moves_nothing(
        start_daemon: StartDaemon, probe_factory: ProbeFactory, protocol: Any) -> None:
    """The issue's first figure: after a failover, a report with the old epoch makes 0
    moves; a report at the current epoch moves once, and sent again moves no more."""
    rd, probe = await started(start_daemon, probe_factory, protocol)
    d = (await ask(probe, "s1", "place", body("job")))[0]["data"]
    lease_id = d["lease_id"]
    assert d["lease_seconds"] == 900
    rd.sim.interrupt(PoolKey.from_json(d["placement"]))
    moved = payload_json(await probe.wait_for(f"{PREFIX}/events/s1/lease.failover"))["data"]
    assert moved["epoch"] == 2

    stale, _ = await ask(probe, "s1", "report", {"lease_id": lease_id, "kind": "interrupted",
                                                 "epoch": 1})
    assert kind(stale) == "lease.current"
    assert stale["data"]["stale_epoch"] == 1 and stale["data"]["epoch"] == 2
    assert stale["data"]["placement"] == moved["to"]
    assert stale["correlationid"] == "job"
    lease = rd.daemon.book.get(lease_id)
    assert lease is not None and lease.epoch == 2 and lease.placement.to_json() == moved["to"]
    assert count(probe, "s1", "lease.failover") == 1  # 0 moves by the stale report
    print(f"\nstale report after a failover ({protocol}): "
          f"{count(probe, 's1', 'lease.failover') - 1} moves")

    # At the current epoch it acts once; the same report again is stale by then.
    first, _ = await ask(probe, "s1", "report", {"lease_id": lease_id, "kind": "unhealthy",
                                                 "epoch": 2})
    assert kind(first) == "lease.failover" and first["data"]["epoch"] == 3
    again, _ = await ask(probe, "s1", "report", {"lease_id": lease_id, "kind": "unhealthy",
                                                 "epoch": 2})
    assert kind(again) == "lease.current" and again["data"]["epoch"] == 3
    assert count(probe, "s1", "lease.failover") == 2

    # Renew and release with the old epoch change nothing either.
    renew, _ = await ask(probe, "s1", "renew", {"lease_id": lease_id, "epoch": 1})
    assert kind(renew) == "lease.current" and renew["data"]["stale_epoch"] == 1
    release, _ = await ask(probe, "s1", "release", {"lease_id": lease_id, "epoch": 2})
    assert kind(release) == "lease.current"
    assert rd.daemon.book.active() != []
    # A newer epoch than the lease's is invalid, naming the field, the verb, the lease.
    future, _ = await ask(probe, "s1", "renew", {"lease_id": lease_id, "epoch": 9})
    assert kind(future) == "request.invalid"
    assert future["data"]["errors"] == [{"field": "epoch",
                                         "message": f"lease {lease_id} is at epoch 3"}]
    assert future["data"]["verb"] == "renew" and future["data"]["lease_id"] == lease_id
    ok, _ = await ask(probe, "s1", "renew", {"lease_id": lease_id, "epoch": 3})
    assert kind(ok) == "lease.renewed"


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_every_verb_is_answered(start_daemon: StartDaemon,
                                      probe_factory: ProbeFactory, protocol: Any) -> None:
    """The issue's second figure: every verb, with a valid and an invalid payload, is
    answered, each with the type expected; the worst answer time is printed (the
    timeout of each wait is generous: this is not a timing test)."""
    rd, probe = await started(start_daemon, probe_factory, protocol)
    times: dict[str, float] = {}
    got: dict[str, str] = {}

    async def answer(name: str, scheduler: str, verb: str, payload: Any) -> dict[str, Any]:
        event, took = await ask(probe, scheduler, verb, payload)
        times[name], got[name] = took, kind(event)
        return event

    lease = (await answer("place", "v1", "place", body("a")))["data"]
    ref = {"lease_id": lease["lease_id"], "epoch": lease["epoch"]}
    await answer("renew", "v1", "renew", ref)
    await answer("report", "v1", "report", ref | {"kind": "launch_failed"})
    await answer("lookup", "v1", "lookup", {"request_id": "a"})
    await answer("release", "v1", "release", {"request_id": "a"})
    await answer("quote", "v1", "quote", {"gpu": "H100-80GB", "gpus": 8})
    for verb in ("place", "renew", "release", "report", "lookup", "quote"):
        event = await answer(f"{verb} invalid", "v2", verb, {"lease_id": "L-x", "gpus": "8"})
        assert event["data"]["verb"] == verb and event["data"]["lease_id"] == "L-x"
    await answer("not JSON", "v2", "renew", b"\xff")
    await answer("unknown verb", "v2", "launch", {"lease_id": "L-x"})

    assert got == {
        "place": "placement.decided", "renew": "lease.renewed", "report": "lease.failover",
        "lookup": "placement.decided", "release": "lease.released",
        "quote": "placement.quoted",
        **{f"{verb} invalid": "request.invalid"
           for verb in ("place", "renew", "release", "report", "lookup", "quote")},
        "not JSON": "request.invalid", "unknown verb": "request.invalid"}
    worst = max(times, key=times.__getitem__)
    print(f"\nevery verb answered ({protocol}): {len(times)} requests, worst "
          f"{times[worst] * 1000:.1f} ms ({worst})")
    assert rd.daemon.book.active() == []


async def test_request_invalid_echoes_verb_and_lease_id_only_when_it_can(
        start_daemon: StartDaemon, probe_factory: ProbeFactory) -> None:
    _, probe = await started(start_daemon, probe_factory, "3.1.1")
    unknown, _ = await ask(probe, "s1", "launch", {"lease_id": 7})
    assert "verb" not in unknown["data"] and "lease_id" not in unknown["data"]
    gone, _ = await ask(probe, "s1", "release", {"lease_id": "L-nobody"})
    assert gone["data"]["verb"] == "release" and gone["data"]["lease_id"] == "L-nobody"
    assert gone["data"]["errors"][0]["field"] == "lease_id"


async def test_release_by_request_id_and_lookup(start_daemon: StartDaemon,
                                                probe_factory: ProbeFactory) -> None:
    rd, probe = await started(start_daemon, probe_factory, 5)
    unknown, _ = await ask(probe, "s1", "release", {"request_id": "not-yet"})
    assert kind(unknown) == "request.invalid"
    assert unknown["data"]["errors"][0]["field"] == "request_id"
    assert unknown["data"]["request_id"] == "not-yet"
    both, _ = await ask(probe, "s1", "release", {"request_id": "r", "lease_id": "L-1"})
    assert kind(both) == "request.invalid"
    nobody, _ = await ask(probe, "s1", "lookup", {"request_id": "never"})
    assert kind(nobody) == "request.invalid"
    assert nobody["data"]["errors"] == [{"field": "request_id",
                                         "message": "no lease for this request_id"}]

    d = (await ask(probe, "s1", "place", body("job", lease_seconds=120)))[0]["data"]
    looked, _ = await ask(probe, "s1", "lookup", {"request_id": "job"})
    assert kind(looked) == "placement.decided"
    assert {k: looked["data"][k] for k in ("lease_id", "epoch", "placement",
                                           "lease_seconds")} == \
        {k: d[k] for k in ("lease_id", "epoch", "placement", "lease_seconds")}
    assert looked["data"]["lease_seconds"] == 120 and "state" not in looked["data"]
    # Another scheduler's request_id is not this one's.
    other, _ = await ask(probe, "s2", "release", {"request_id": "job"})
    assert kind(other) == "request.invalid"

    released, _ = await ask(probe, "s1", "release", {"request_id": "job"})
    assert kind(released) == "lease.released" and released["data"]["lease_id"] == d["lease_id"]
    assert rd.daemon.book.active() == []
    # Ended: the lookup and a repeated place say how and when.
    for verb, payload in (("lookup", {"request_id": "job"}), ("place", body("job"))):
        ended, _ = await ask(probe, "s1", verb, payload)
        assert kind(ended) == "placement.decided"
        data = ended["data"]
        assert (data["state"], data["ended_reason"], data["ended_detail"]) == \
            ("released", "released", None)
        assert data["ended_at"] <= utcnow().isoformat()
    again, _ = await ask(probe, "s1", "release", {"request_id": "job"})
    assert kind(again) == "lease.released"


async def test_a_failed_lease_repeats_its_reason_and_when(
        start_daemon: StartDaemon, probe_factory: ProbeFactory) -> None:
    rd, probe = await started(start_daemon, probe_factory, 5)
    d = (await ask(probe, "s1", "place", {"request_id": "job", "gpu": "T4", "gpus": 1,
                                          "market": "on_demand", "clouds": ["aws"]}))[0]["data"]
    # Every T4 on-demand pool of that cloud withdrawn: nowhere left to go.
    for offer in list(rd.daemon.pool):
        if offer.gpu == "T4" and offer.pool.cloud == "aws" and \
                offer.pool.market.value == "on_demand":
            rd.sim.withdraw(offer.pool)
    await rd.daemon.poller.poll_all()
    failed = payload_json(await probe.wait_for(f"{PREFIX}/events/s1/lease.failed",
                                               timeout=10))["data"]
    assert failed["reason"] == "capacity_lost" and "ended_at" not in failed
    for verb in ("renew", "report"):
        repeat, _ = await ask(probe, "s1", verb, {"lease_id": d["lease_id"], "epoch": 1,
                                                  "kind": "interrupted"})
        assert kind(repeat) == "lease.failed"
        assert repeat["data"]["reason"] == "capacity_lost"  # the original, not `ended`
        assert repeat["data"]["detail"] == failed["detail"]
        assert repeat["data"]["ended_at"] == repeat["time"][:10] + repeat["data"]["ended_at"][10:]
    looked, _ = await ask(probe, "s1", "lookup", {"request_id": "job"})
    assert (looked["data"]["state"], looked["data"]["ended_reason"],
            looked["data"]["ended_detail"]) == ("failed", "capacity_lost", failed["detail"])


POLICY_FLAP = """
version: 1
failover:
  max_failovers_per_hour: 1
"""

POLICY_NO_COOLING = """
version: 1
failover:
  report_cooldowns_per_hour: 1
"""


async def test_a_report_held_back_is_declined(start_daemon: StartDaemon,
                                              probe_factory: ProbeFactory,
                                              tmp_path: Path) -> None:
    rd, probe = await started(start_daemon, probe_factory, "3.1.1", POLICY_FLAP, tmp_path)
    d = (await ask(probe, "s1", "place", body("job")))[0]["data"]
    ref = {"lease_id": d["lease_id"], "kind": "interrupted"}
    moved, _ = await ask(probe, "s1", "report", ref | {"epoch": 1})
    assert kind(moved) == "lease.failover"
    declined, _ = await ask(probe, "s1", "report", ref | {"epoch": 2})
    assert kind(declined) == "report.declined"
    data = declined["data"]
    assert (data["lease_id"], data["epoch"], data["kind"]) == (d["lease_id"], 2, "interrupted")
    assert "max_failovers_per_hour" in data["reason"]
    assert 3500 < data["retry_after_seconds"] <= 3600
    lease = rd.daemon.book.get(d["lease_id"])
    assert lease is not None and lease.epoch == 2


async def test_one_schedulers_reports_cool_a_limited_number_of_pools(
        start_daemon: StartDaemon, probe_factory: ProbeFactory, tmp_path: Path) -> None:
    rd, probe = await started(start_daemon, probe_factory, 5, POLICY_NO_COOLING, tmp_path)
    pool = rd.daemon.pool

    def cooling() -> set[PoolKey]:
        return pool.cooling(utcnow())

    reported: list[PoolKey] = []
    for n in range(3):
        d = (await ask(probe, "s1", "place", body(f"job-{n}")))[0]["data"]
        reported.append(PoolKey.from_json(d["placement"]))
        moved, _ = await ask(probe, "s1", "report", {"lease_id": d["lease_id"],
                                                     "kind": "launch_failed", "epoch": 1})
        assert kind(moved) == "lease.failover"  # the lease moves, within the limit or not
        assert PoolKey.from_json(moved["data"]["to"]) != reported[-1]
    # Only the first pool cools for everyone: one per scheduler per hour here.
    assert reported[0] in cooling()
    assert not set(reported[1:]) - {reported[0]} & cooling()
    # Another scheduler has its own allowance.
    d = (await ask(probe, "s2", "place", body("other")))[0]["data"]
    await ask(probe, "s2", "report", {"lease_id": d["lease_id"], "kind": "interrupted"})
    assert PoolKey.from_json(d["placement"]) in cooling()



LATE = (("release", "by lease_id"), ("renew", "by lease_id"), ("report", "by lease_id"),
        ("release", "by request_id"), ("lookup", "by request_id"), ("place", "again"))


def late_verb(verb: str, how: str, lease_id: str) -> dict[str, Any]:
    if how == "by lease_id":
        return {"lease_id": lease_id, **({"kind": "unhealthy"} if verb == "report" else {})}
    return body("gone") if verb == "place" else {"request_id": "gone"}


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_an_ended_lease_that_left_memory_is_answered_as_a_moment_after_its_end(
        start_daemon: StartDaemon, probe_factory: ProbeFactory, protocol: Any) -> None:
    """An ended lease leaves the book's memory once its end is committed (beyond the
    recent ones): a repeated place gets the same lease, and every late verb the same
    answer as while it was still in memory, read from the store (#31)."""
    rd, probe = await started(start_daemon, probe_factory, protocol)
    book = rd.daemon.book
    placed = (await ask(probe, "s1", "place", body("gone")))[0]["data"]
    lease_id = placed["lease_id"]
    released, _ = await ask(probe, "s1", "release", {"lease_id": lease_id})
    assert kind(released) == "lease.released"
    assert book.get(lease_id) is not None  # among the recent ended leases
    recent = [await ask(probe, "s1", verb, late_verb(verb, how, lease_id))
              for verb, how in LATE]

    book.keep_recent = 0
    # Any change lets go of the ended leases beyond the recent ones once committed.
    await ask(probe, "s1", "lookup", {"request_id": "nothing-placed"})
    assert book.get(lease_id) is None and book.find("s1", "gone") is None
    assert book.all() == [] and book.ended_in_memory == 0
    stored = [await ask(probe, "s1", verb, late_verb(verb, how, lease_id))
              for verb, how in LATE]
    for (verb, how), (was, _), (now, _) in zip(LATE, recent, stored, strict=True):
        assert (kind(now), now["data"]) == (kind(was), was["data"]), (verb, how)
        assert book.get(lease_id) is None  # each answer brought it back only for itself
    by_kind = {f"{verb} {how}": kind(ev) for (verb, how), (ev, _) in zip(LATE, stored,
                                                                           strict=True)}
    assert by_kind == {"release by lease_id": "lease.released",
                       "renew by lease_id": "lease.released",
                       "report by lease_id": "lease.released",
                       "release by request_id": "lease.released",
                       "lookup by request_id": "placement.decided",
                       "place again": "placement.decided"}
    again = stored[-1][0]["data"]
    assert again["lease_id"] == lease_id and again["state"] == "released"
    assert again["placement"] == placed["placement"]
    assert len(await rd.daemon.store.leases(ended_since=utcnow() - timedelta(hours=1))) == 1
    # Another scheduler's verb on it is still not its own.
    theirs, _ = await ask(probe, "s2", "renew", {"lease_id": lease_id})
    assert kind(theirs) == "request.invalid"
    assert theirs["data"]["errors"] == [{"field": "lease_id",
                                         "message": f"no lease {lease_id!r}"}]
