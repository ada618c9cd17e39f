"""A restart under churn (#31), through a real daemon, a real mosquitto and a real SQLite
file: the lease book comes back with the active leases only (an ended one is read from
the store when asked for), and the retained state is made true again with bounded work —
the active leases' states, the clears the MQTT server had not acknowledged (the outbox),
and those of the leases that ended in the hour before the start (the most recent
`RESTORE_ENDED_MAX`, a cap the store's `ended_since` test checks), not one for every
lease that ended in the day before."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
from pathlib import Path
from typing import Any

import aiomqtt
from daemon_helpers import PREFIX, StartDaemon
from mqtt_helpers import Mosquitto, ProbeFactory, payload_json

from broker.wire.commands import Command

S = "sched-1"
EVENTS = f"{PREFIX}/events/{S}/"
LEASES = f"{PREFIX}/leases/{S}/"


def small(request_id: str) -> dict[str, Any]:
    return {"request_id": request_id, "gpu": ["T4", "L4", "A10G"], "gpus": 1,
            "lease_seconds": 3600}


def answered(msg: aiomqtt.Message) -> bool:
    return str(msg.topic).startswith(EVENTS) and "request_id" in payload_json(msg)["data"]


def outbox_topics(state: Path) -> list[str]:
    with contextlib.closing(sqlite3.connect(state)) as db:
        return [t for (t,) in db.execute("SELECT topic FROM outbox ORDER BY id")]


async def test_a_restart_republishes_the_active_leases_and_the_recent_clears(
        start_daemon: StartDaemon, probe_factory: ProbeFactory, mosquitto: Mosquitto,
        tmp_path: Path) -> None:
    state = tmp_path / "state.db"
    rd = await start_daemon(state=state)
    probe = await probe_factory([f"{PREFIX}/events/#", f"{PREFIX}/leases/#"])
    ids: dict[str, str] = {}
    for name in ("kept", "done-1", "done-2", "unheard"):
        await probe.publish(f"{PREFIX}/requests/{S}/place", small(name))
        msg = await probe.wait_for(lambda m, n=name: answered(m)
                                   and payload_json(m)["data"]["request_id"] == n)
        ids[name] = payload_json(msg)["data"]["lease_id"]
    for name in ("done-1", "done-2"):
        await probe.publish(f"{PREFIX}/requests/{S}/release", {"lease_id": ids[name]})
        await probe.wait_for(lambda m, n=name: str(m.topic) == LEASES + ids[n]
                             and not m.payload)
    assert await rd.daemon.bus.drained(10)  # their clears acknowledged: out of the outbox
    # The last one ends while the MQTT server is away: its clear waits in the outbox.
    await mosquitto.astop()
    body = json.dumps({"lease_id": ids["unheard"]}).encode()
    await rd.daemon.broker.submit(Command(S, "release", body,
                                          f"{PREFIX}/requests/{S}/release"))
    await rd.daemon.broker.idle()
    await rd.stop()
    assert LEASES + ids["unheard"] in outbox_topics(state)
    assert not {LEASES + ids[n] for n in ("done-1", "done-2")} & set(outbox_topics(state))

    await mosquitto.astart()
    watch = await probe_factory([f"{PREFIX}/leases/#", "bench/marker"])
    mark = watch.mark()
    again = await start_daemon(state=state)
    book = again.daemon.book
    assert [le.lease_id for le in book.all()] == [ids["kept"]]  # no ended lease in memory
    await watch.wait_for(lambda m: str(m.topic) == LEASES + ids["unheard"]
                         and not m.payload and not m.retain, since=mark)
    async with asyncio.timeout(15):
        await again.daemon.bus.restored.wait()
    assert await again.daemon.bus.drained(10)
    # Everything the daemon published before now has reached this subscriber before
    # the marker (one server, published in order): nothing more of the restart to come.
    await watch.publish("bench/marker", b"after the restore")
    await watch.wait_for("bench/marker", since=mark)
    live = [m for m in watch.matching(f"{PREFIX}/leases/#", since=mark) if not m.retain]
    assert {str(m.topic) for m in live} == {LEASES + ids[n] for n in ids}
    # "unheard" ended in the hour before the start and its clear waited in the outbox:
    # the outbox sends it, and the restore does not send it a second time.
    assert [str(m.topic) for m in live].count(LEASES + ids["unheard"]) == 1
    assert all(payload_json(m)["state"] == "active" if str(m.topic) == LEASES + ids["kept"]
               else not m.payload for m in live)
    # The ended leases are not in memory; the store still answers for them.
    events = await probe_factory([f"{PREFIX}/events/#"])
    await events.publish(f"{PREFIX}/requests/{S}/place", small("done-1"))
    repeated = payload_json(await events.wait_for(answered))["data"]
    assert (repeated["lease_id"], repeated["state"]) == (ids["done-1"], "released")

