"""`schedseq` across a leader change on PostgreSQL (contract 1.1 §5.1, #29): the new
leader numbers a scheduler's events on from where the old one stopped, gapless; events
sent again by the new leader keep their number."""

from __future__ import annotations

import time

from ha.helpers import PREFIX, SCHEDULER, HaSite, Observed, Scheduler
from mqtt_helpers import MqttProbe

TAKEOVER_TIMEOUT = 20.0


def numbered(seen: Observed) -> dict[str, int]:
    """Every event of SCHEDULER the probe saw: its id -> its schedseq (an event sent
    again keeps its id; a different number under one id fails here)."""
    out: dict[str, int] = {}
    for s in seen.events():
        if s.topic.startswith(f"{PREFIX}/events/{SCHEDULER}/"):
            n = s.body["schedseq"]
            assert out.setdefault(s.body["id"], n) == n, (s.body["id"], out[s.body["id"]], n)
    return out


async def test_schedseq_continues_after_the_leader_changes(
        site: HaSite, probe: MqttProbe, scheduler: Scheduler) -> None:
    """Leader `a` answers 6 requests, stops (SIGTERM); `b` takes over and answers 6
    more: SCHEDULER's events are numbered 1 to 12, each once, `b`'s from 7."""
    started = time.monotonic()
    a = await site.start_leader("a")
    b = await site.start_standby("b")
    for _ in range(6):
        scheduler.place("a")
    await scheduler.wait_answered(6, 20)
    assert await a.stop() == 0
    await b.wait_role("leader", TAKEOVER_TIMEOUT)
    for _ in range(6):
        scheduler.place("b")
    await scheduler.wait_answered(12, 20)
    assert await scheduler.finish(5) == []
    await probe.wait_for_count(f"{PREFIX}/events/{SCHEDULER}/+", 12, timeout=10)

    seen = Observed.of(probe)
    by_id = numbered(seen)
    assert sorted(by_id.values()) == list(range(1, 13)), seen.describe()
    boots: dict[str, str] = {}  # the daemon start that sent each event first
    for s in seen.events():
        if s.topic.startswith(f"{PREFIX}/events/{SCHEDULER}/"):
            boots.setdefault(s.body["id"], s.boot)
    first_boot = boots[min(by_id, key=by_id.__getitem__)]
    later = sorted(n for i, n in by_id.items() if boots[i] != first_boot)
    assert later == list(range(7, 13)), seen.describe()
    print(f"\nschedseq across a leader change: 1..12 gapless, the new leader from 7 "
          f"({time.monotonic() - started:.1f} s)")
