"""The MQTT server crashes under load: the daemon stays up and no decision is lost.

`gpubroker run` as a process, a scheduler placing ~150 requests/s that re-sends what
stays unanswered (same request_id), and mosquitto `kill -9`ed twice and started again on
the same port. mqtt_helpers.Mosquitto keeps nothing across a kill, so every retained
message is gone after each restart: the daemon must make them true again (SPEC §3).
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
from chaos.harness import (
    DaemonDied,
    ResendingScheduler,
    StartDaemon,
    StatusWatcher,
    check_retained_leases,
    duplicate_leases_in,
    place_body,
    wall,
)
from mqtt_helpers import Mosquitto

RATE = 150.0
REQUESTS = 900  # 6 s of load
KILL_AT = (300, 600)  # requests sent


@pytest.mark.slow
async def test_daemon_outlives_mqtt_server_kills_and_loses_no_decision(
        chaos_mosquitto: Mosquitto, start_daemon: StartDaemon) -> None:
    mosq = chaos_mosquitto
    daemon = await start_daemon(mosq)
    problems: list[str] = []
    reached = {n: asyncio.Event() for n in KILL_AT}

    def sent(count: int) -> None:
        if count in reached:
            reached[count].set()

    async with StatusWatcher(mosq.port) as watcher, \
            ResendingScheduler(mosq.port, "chaos-t", resend_after=1.0,
                               max_interval=2.0) as sched:
        await watcher.online(20)
        load = asyncio.create_task(sched.run_load(REQUESTS, RATE, place_body, on_sent=sent))
        try:
            for n, at in enumerate(KILL_AT, 1):
                await asyncio.wait_for(reached[at].wait(), 20)
                killed = wall()
                await mosq.akill()
                await mosq.astart()
                try:
                    await daemon.while_alive(watcher.online(20, after=killed), 20)
                except TimeoutError:
                    problems.append(f"restart {n}: the daemon was not online again in 20 s")
                    continue
                check = await check_retained_leases(daemon, mosq.port,
                                                    since=time.monotonic(), within=5.0)
                if not check.ok:
                    problems.append(
                        f"restart {n}: {check.missing} of {check.active} active leases had "
                        f"no retained state ({check.stale} stale) 5 s after the daemon "
                        f"reconnected, e.g. {check.examples}"
                        + (f" ({check.error})" if check.error else ""))
            last = await asyncio.wait_for(load, 30)
            sched.give_up_at = last + 12
            await daemon.while_alive(sched.wait_all_answered(12), 15)
            leases = await daemon.leases()
        except DaemonDied as exc:
            problems.append(f"the daemon process exited under the chaos: {exc}")
            leases = []
        finally:
            load.cancel()

    lost = sched.unanswered
    if lost:
        problems.append(f"{len(lost)} of {len(sched.requests)} requests never answered, "
                        f"e.g. {[r.request_id for r in lost[:5]]}")
    if dup := sched.duplicate_leases():
        problems.append(f"request_ids answered with two lease_ids: {list(dup.items())[:3]}")
    if dup := duplicate_leases_in(leases):
        problems.append(f"request_ids with two leases in /v1/leases: {list(dup.items())[:3]}")
    if daemon.unexpected_exits:
        problems.append(f"the daemon exited on its own: {daemon.unexpected_exits}")
    if daemon.alive:
        code = await daemon.stop(signal.SIGTERM, timeout=20)
        if code != 0:
            problems.append(f"SIGTERM at the end: exit code {code} (expected 0)")
    assert not problems, "\n".join(problems) + "\n" + daemon.log_tail(15)
    assert sched.summary()["decisions"] == REQUESTS
