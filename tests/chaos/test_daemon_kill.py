"""The daemon is SIGKILLed under load and started again on the same state.

The MQTT will puts `offline` on retained `P/status`; the restarted daemon answers every
request, and a request_id decided before the kill gets the same lease when it is asked
again, never a second one (SPEC §3, §4).
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
from chaos.harness import (
    PREFIX,
    DaemonDied,
    ResendingScheduler,
    StartDaemon,
    StatusWatcher,
    duplicate_leases_in,
    place_body,
    retained_snapshot,
)
from mqtt_helpers import Mosquitto

RATE = 150.0
REQUESTS = 750  # 5 s of load
KILL_AT = 300  # requests sent


@pytest.mark.slow
async def test_sigkill_under_load_then_restart_answers_each_request_id_once(
        chaos_mosquitto: Mosquitto, start_daemon: StartDaemon) -> None:
    mosq = chaos_mosquitto
    daemon = await start_daemon(mosq)
    problems: list[str] = []
    reached = asyncio.Event()

    async with StatusWatcher(mosq.port) as watcher, \
            ResendingScheduler(mosq.port, "chaos-t", resend_after=1.0,
                               max_interval=2.0) as sched:
        boot = (await watcher.online(20))["boot_id"]
        load = asyncio.create_task(sched.run_load(
            REQUESTS, RATE, place_body, on_sent=lambda n: n >= KILL_AT and reached.set()))
        await asyncio.wait_for(reached.wait(), 20)

        mark = watcher.mark()
        assert await daemon.kill() == -signal.SIGKILL
        try:
            will = await watcher.wait_for(StatusWatcher.is_state("offline", boot_id=boot),
                                          5, since=mark)
        except TimeoutError:
            problems.append("no `offline` on P/status within 5 s of the SIGKILL (the will)")
        else:
            if not will.retain:
                problems.append("the will's `offline` was not published retained")
        # What a subscriber arriving now finds (the daemon is still down).
        retained = await retained_snapshot(mosq.port, [f"{PREFIX}/status"])
        status = retained.get(f"{PREFIX}/status", b"")
        if b'"offline"' not in status or boot.encode() not in status:
            problems.append(f"retained P/status while the daemon is down: {status!r}")
        decided_before = [r.request_id for r in sched.requests.values()
                          if r.lease_ids]

        daemon.start()  # the same config, the same state file
        try:
            await daemon.while_alive(watcher.online(30, not_boot=boot), 30)
            last = await asyncio.wait_for(load, 30)
            sched.give_up_at = last + 12
            await daemon.while_alive(sched.wait_all_answered(12), 15)

            # Ask again for every request placed before the kill (and a few after it):
            # the same lease must come back.
            again = decided_before + [r.request_id
                                      for r in list(sched.requests.values())[-20:]
                                      if r.lease_ids]
            for request_id in again:
                sched.resend(request_id)
            sched.give_up_at = time.monotonic() + 10
            await daemon.while_alive(sched.wait_all_answered(10), 12)
            leases = await daemon.leases()
        except DaemonDied as exc:
            problems.append(f"the restarted daemon exited: {exc}")
            again, leases = [], []
        finally:
            load.cancel()

    if lost := sched.unanswered:
        problems.append(f"{len(lost)} request(s) never answered, "
                        f"e.g. {[r.request_id for r in lost[:5]]}")
    if dup := sched.duplicate_leases():
        problems.append(f"{len(dup)} request_id(s) answered with two lease_ids: "
                        f"{list(dup.items())[:3]}")
    if dup := duplicate_leases_in(leases):
        problems.append(f"request_ids with two leases in /v1/leases: {list(dup.items())[:3]}")
    not_repeated = [rid for rid in again if sched.requests[rid].kinds["placement.decided"] < 2]
    if not_repeated:
        problems.append(f"{len(not_repeated)} repeated request(s) not answered "
                        f"`placement.decided` again: {not_repeated[:5]}")
    if daemon.unexpected_exits:
        problems.append(f"the daemon exited on its own: {daemon.unexpected_exits}")
    if daemon.alive:
        code = await daemon.stop(signal.SIGTERM, timeout=20)
        if code != 0:
            problems.append(f"SIGTERM at the end: exit code {code} (expected 0)")
    assert not problems, "\n".join(problems) + "\n" + daemon.log_tail(15)
    assert decided_before, "nothing was placed before the kill"
