"""High availability end to end: two `gpubroker run` processes of one site on a real
mosquitto and a real PostgreSQL database, a scheduler (``BrokerClient``) placing
requests all along and re-sending the unanswered ones with the same request_id, and
one fault per test.

What every test asserts on what the scheduler and one probe (subscribed before the
fault) saw, and on the database (``check_site``):

* no request unanswered (after re-sends, within the client's timeout);
* no lease decided twice: a request_id never gets two lease_ids, and the `leases` table
  has one row per (scheduler, request_id), the lease the scheduler holds;
* nothing from a deposed leader after the takeover (``Observed.takeover_problems``:
  bootids and arrival order at the probe);
* epochs rising: from one leader to the next in P/status, and the `leadership` table
  naming the last of them.

The leaders each scenario makes are checked in order (``expect``). A leader that cannot
renew in time on a starved machine (others run their tests on its two cores) steps
down, and another takeover follows; such further leaders are accepted as long as every
check above holds for them too.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from typing import Any

import pytest
from ha.helpers import (
    LEADERSHIP_SECONDS,
    PREFIX,
    HaDaemon,
    HaSite,
    Leader,
    Observed,
    Scheduler,
    wait_leader,
    wait_until,
)
from mqtt_helpers import MqttProbe

pytestmark = pytest.mark.timeout(60)

FLOW_EVERY = 0.1  # one placement request every 100 ms
TAKEOVER_TIMEOUT = 4 * LEADERSHIP_SECONDS + 5


class Flow:
    """Requests placed at a steady pace from `start()` to `stop()`."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._stop = asyncio.Event()
        self._task: asyncio.Task[int] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self.scheduler.flow(self._stop, FLOW_EVERY))

    async def more(self, count: int, timeout: float = 10.0) -> None:
        """Until `count` more requests have been answered."""
        await self.scheduler.wait_answered(self.scheduler.answered + count, timeout)

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task


async def settle(site: HaSite, probe: MqttProbe, scheduler: Scheduler) -> Observed:
    """Every request answered (within the client's timeout), and every answer the
    scheduler got also seen by the probe; then what the probe saw."""
    unanswered = await scheduler.finish(scheduler.answer_timeout + 5)
    assert not unanswered, (f"{len(unanswered)} of {len(scheduler.outcomes)} requests "
                            f"unanswered: {unanswered[:5]}\n{site.logs()}")
    want = set(scheduler.outcomes)

    def seen_all() -> bool:
        got = {s.body["data"].get("request_id") for s in Observed.of(probe).events()
               if s.kind in ("placement.decided", "placement.rejected")}
        return want <= got

    await wait_until(seen_all, 5, "the probe receives every answer")
    probe.raise_contract_errors()
    return Observed.of(probe)


async def check_site(site: HaSite, seen: Observed, scheduler: Scheduler,
                     expect: list[tuple[str, int]], *,
                     quiet_from: dict[str, int] | None = None) -> list[Leader]:
    """The checks of every test (module docstring); `expect`: the leaders (node,
    epoch) the scenario makes, in order. Returns the leaders the probe saw."""
    problems = seen.takeover_problems(quiet_from)
    problems += seen.lease_problems(scheduler, await site.leases())
    problems += seen.epoch_problems()
    chain = seen.leaders()
    got = [(leader.node, leader.epoch) for leader in chain]
    if got[:len(expect)] != expect:
        problems.append(f"leaders {got}, expected {expect} first")
    if chain:
        last = chain[-1]
        row = await site.leadership()
        if row != (last.node, last.epoch, last.boot):
            problems.append(f"leadership table {row}, the last leader seen {last}")
    for d in site.daemons.values():
        if d.connects_while_not_leading():
            problems.append(f"node {d.node} connected to MQTT while not leading: "
                            f"{d.connects_while_not_leading()}")
        if d.tracebacks():
            problems.append(f"node {d.node} logged failures: {d.tracebacks()[:3]}")
    assert not problems, ("\n".join(problems) + "\n--- probe ---\n" + seen.describe()
                          + "\n" + site.logs())
    return chain


async def retained_status(site: HaSite) -> dict[str, Any]:
    """The retained `P/status`, as a scheduler that connects now reads it first."""
    async with MqttProbe(site.mosquitto.url, [f"{PREFIX}/status"]) as fresh:
        message = await fresh.wait_for(f"{PREFIX}/status", 5)
    assert message.retain
    body = json.loads(bytes(message.payload))  # type: ignore[arg-type]
    assert isinstance(body, dict)
    return body


async def leader_boot(d: HaDaemon, count: int = 1) -> str:
    """The boot_id of `d`'s `count`-th start as the leader (its "starting" record)."""
    record = await d.wait_log("starting", 5, count=count)
    return str(record["boot_id"])


@pytest.mark.slow
async def test_leader_killed_while_requests_flow(site: HaSite, probe: MqttProbe,
                                                 scheduler: Scheduler) -> None:
    """SIGKILL of the leader: the MQTT server publishes its will; the standby takes the
    expired leadership (epoch 2), resumes the site's MQTT session and answers the
    requests that waited, and the re-sent ones with the leases already decided."""
    a = await site.start_leader("a")
    b = await site.start_standby("b")
    old_boot = await leader_boot(a)
    assert await site.leadership() == ("a", 1, old_boot)

    flow = Flow(scheduler)
    flow.start()
    await flow.more(15)
    assert await a.kill() == -signal.SIGKILL
    await b.wait_role("leader", TAKEOVER_TIMEOUT)
    new_boot = await leader_boot(b)
    await flow.more(15)
    await flow.stop()
    seen = await settle(site, probe, scheduler)

    chain = await check_site(site, seen, scheduler, [("a", 1), ("b", 2)])
    assert chain[1].boot == new_boot
    offline = [s for s in seen.statuses() if s.body["state"] == "offline"]
    assert offline and offline[0].boot == old_boot, "the will of the killed leader"
    assert offline[0].index < chain[1].first
    assert await site.stop_all() == {"a": -signal.SIGKILL, "b": 0}


@pytest.mark.slow
async def test_leader_frozen_then_resumed_steps_down_silently(
        site: HaSite, probe: MqttProbe, scheduler: Scheduler) -> None:
    """SIGSTOP of the leader: the standby takes over once the leadership expires (its
    connection as the site's client id ends the frozen one's at the MQTT server). After
    SIGCONT the old process finds out it is deposed and steps down without publishing
    anything (no envelope with its bootid and no P/status from it after the new
    leader's first message; nothing at all with its bootid once let go), and stands by
    again in the same process."""
    a = await site.start_leader("a")
    b = await site.start_standby("b")
    old_boot = await leader_boot(a)
    assert a.proc is not None
    pid = a.proc.pid

    flow = Flow(scheduler)
    flow.start()
    await flow.more(15)
    a.freeze()
    frozen_at = time.monotonic()
    await b.wait_role("leader", TAKEOVER_TIMEOUT)
    new_boot = await leader_boot(b)
    # The new leader's first envelope of its own: from here on nothing may carry the
    # frozen leader's bootid, not even its outbox sent again by the new leader.
    await probe.wait_for(lambda m: m.topic.value.startswith(f"{PREFIX}/events/")
                         and new_boot.encode() in bytes(m.payload),  # type: ignore[arg-type]
                         10)
    quiet_from = probe.mark()
    frozen_for = time.monotonic() - frozen_at

    a.thaw()
    await a.wait_log("stepped down; standing by again", 10)
    await a.wait_role("standby", 10, text="leader: node b")
    await flow.more(15)
    await flow.stop()
    seen = await settle(site, probe, scheduler)

    chain = await check_site(site, seen, scheduler, [("a", 1), ("b", 2)],
                             quiet_from={old_boot: quiet_from})
    assert chain[1].boot == new_boot
    status = await retained_status(site)
    assert (status["state"], status["node"], status["epoch"], status["boot_id"]) == \
        ("online", "b", 2, new_boot), "a scheduler connecting now must read b online"
    assert a.alive and a.proc.pid == pid, "the deposed leader's process stays"
    assert frozen_for > LEADERSHIP_SECONDS * 2 / 3, "frozen past its deadline"
    nodes = await site.nodes()
    assert nodes["a"][0] == "standby"
    assert nodes["b"][0] == "leader"
    assert await site.stop_all() == {"a": 0, "b": 0}


@pytest.mark.slow
async def test_leader_frozen_while_its_connect_is_held_back(
        site: HaSite, probe: MqttProbe, scheduler: Scheduler) -> None:
    """The leader reaches the MQTT server through a proxy, which holds the leader's
    reconnect back (its CONNECT sent, not passed on) while the leader is frozen. The
    standby takes over and comes online. Then the network lets the old CONNECT through:
    it takes the site's session from the new leader at the MQTT server, and the old
    process is thawed with that connection made. It must leave it without a word —
    no `online`, and no will (an `offline` of epoch 1 after the new leader's `online`
    would stay retained until the new leader connects again) — and stand by; the new
    leader takes its session back, and a scheduler connecting afterwards reads it
    online."""
    mqtt = await site.proxy(site.mosquitto.url)
    a = await site.start_leader("a", mqtt_url=mqtt.url(site.mosquitto.url))
    b = await site.start_standby("b")
    old_boot = await leader_boot(a)

    flow = Flow(scheduler)
    flow.start()
    await flow.more(10)
    mqtt.hold()  # a's connection ends; its next one waits at the proxy
    await wait_until(lambda: mqtt.waiting > 0, 10, "the leader connects again, held back")
    a.freeze()
    await b.wait_role("leader", TAKEOVER_TIMEOUT)
    new_boot = await leader_boot(b)
    await probe.wait_for(lambda m: m.topic.value == f"{PREFIX}/status"
                         and new_boot.encode() in bytes(m.payload), 10)  # type: ignore[arg-type]
    kicked = len(b.logged("mqtt connection lost"))
    mqtt.release()  # a's CONNECT reaches the server after b's: b's session is taken
    await wait_until(lambda: len(b.logged("mqtt connection lost")) > kicked, 10,
                     "the held-back CONNECT takes the session from the new leader")
    a.thaw()
    await a.wait_log("stepped down; standing by again", 10)
    await a.wait_role("standby", 10, text="leader: node b")
    await b.wait_log("mqtt connected", 10, count=2)  # b took its session back
    await flow.more(10)
    await flow.stop()
    seen = await settle(site, probe, scheduler)

    chain = await check_site(site, seen, scheduler, [("a", 1), ("b", 2)])
    assert chain[1].boot == new_boot
    late = [s.body for s in seen.statuses() if s.index > chain[1].first and s.boot == old_boot]
    assert not late, f"P/status from the deposed leader after b's online: {late}"
    status = await retained_status(site)
    assert (status["state"], status["node"], status["epoch"]) == ("online", "b", 2)
    assert not a.logged("mqtt connected")[1:], "the deposed leader published online"
    assert await site.stop_all() == {"a": 0, "b": 0}


@pytest.mark.slow
async def test_leader_loses_database_but_not_mqtt(site: HaSite, probe: MqttProbe,
                                                 scheduler: Scheduler) -> None:
    """The leader reaches PostgreSQL through a proxy, the standby directly. The proxy is
    cut: the leader stops publishing (at the latest at its local deadline) and steps
    down, still on the MQTT server; the standby takes over. The old leader stands by
    waiting for the database, and once the proxy is back it follows the new leader."""
    proxy = await site.proxy()
    a = await site.start_leader("a", state_url=proxy.url(site.pg_url))
    b = await site.start_standby("b")
    old_boot = await leader_boot(a)

    flow = Flow(scheduler)
    flow.start()
    await flow.more(15)
    proxy.cut()
    await b.wait_role("leader", TAKEOVER_TIMEOUT)
    new_boot = await leader_boot(b)
    await a.wait_role("standby", 10, text="database not reachable")
    await flow.more(15)

    proxy.restore()
    await a.wait_role("standby", 15, text="leader: node b")
    await flow.more(5)
    await flow.stop()
    seen = await settle(site, probe, scheduler)

    chain = await check_site(site, seen, scheduler, [("a", 1), ("b", 2)])
    assert chain[1].boot == new_boot
    # The old leader was still on the MQTT server: it left (its will) before the new
    # leader's first message.
    offline = [s for s in seen.statuses() if s.body["state"] == "offline"]
    assert offline and offline[0].boot == old_boot and offline[0].index < chain[1].first
    assert a.alive and a.logged("stepped down")
    assert proxy.refused > 0, "nothing tried the database while it was cut"
    assert (await a.readyz()).role == "standby"
    assert await site.stop_all() == {"a": 0, "b": 0}


@pytest.mark.slow
async def test_database_lost_by_both_then_back(site: HaSite, probe: MqttProbe,
                                               scheduler: Scheduler) -> None:
    """The database goes away for both nodes, then comes back.

    A real restart of the PostgreSQL server is not possible here: the server is shared
    by every test (and by others working on this machine); each test has only a
    database of its own. Both nodes reach it through one proxy instead, which is cut
    (every connection closed, new ones reset) until both stand by without a database,
    then restored. Afterwards exactly one node leads, at a higher epoch, and every
    request is answered, those sent while no node led included."""
    proxy = await site.proxy()
    url = proxy.url(site.pg_url)
    a = await site.start_leader("a", state_url=url)
    b = await site.start_standby("b", state_url=url)
    old_boot = await leader_boot(a)

    flow = Flow(scheduler)
    flow.start()
    await flow.more(15)
    proxy.cut()
    await a.wait_role("standby", TAKEOVER_TIMEOUT, text="database not reachable")
    await b.wait_role("standby", 5, text="database not reachable")
    down = probe.mark()
    sent_down = len(scheduler.outcomes)
    await wait_until(lambda: len(scheduler.outcomes) >= sent_down + 5, 5,
                     "requests sent while no node leads")
    proxy.restore()

    leader = await wait_leader([a, b], 20)
    standby = b if leader is a else a
    await standby.wait_role("standby", 10, text=f"leader: node {leader.node}")
    await flow.more(15)
    await flow.stop()
    seen = await settle(site, probe, scheduler)

    chain = await check_site(site, seen, scheduler, [("a", 1), (leader.node, 2)])
    assert chain[1].boot != old_boot
    # Nothing from either node while neither led, but the will of `a`.
    quiet = [s for s in seen.seen[down:chain[1].first]
             if not (s.is_status and s.boot == old_boot and s.body["state"] == "offline")]
    assert not quiet, seen.describe(down)
    roles = {d.node: (await d.readyz()).role for d in (a, b)}
    assert sorted(roles.values()) == ["leader", "standby"], roles
    assert await site.stop_all() == {"a": 0, "b": 0}


async def test_both_started_at_once(site: HaSite, probe: MqttProbe,
                                    scheduler: Scheduler) -> None:
    """Two nodes started together: one leads at epoch 1, the other stands by (epoch 0
    in the `nodes` table) and publishes nothing; every request is answered once."""
    a, b = site.daemon("a"), site.daemon("b")
    a.start()
    b.start()
    leader = await wait_leader([a, b], 20)
    standby = b if leader is a else a
    await standby.wait_role("standby", 10, text=f"leader: node {leader.node}, epoch 1")
    boot = await leader_boot(leader)
    nodes = await site.nodes()
    assert nodes[leader.node][:2] == ("leader", 1)
    assert nodes[standby.node][:2] == ("standby", 0)

    flow = Flow(scheduler)
    flow.start()
    await flow.more(20)
    await flow.stop()
    seen = await settle(site, probe, scheduler)

    chain = await check_site(site, seen, scheduler, [(leader.node, 1)])
    assert chain[0].boot == boot
    if len(chain) == 1:  # no takeover (see the module docstring)
        assert {s.boot for s in seen.seen} == {boot}, "messages from the standby"
        assert not standby.logged("leading the site")
        assert {e for _, _, _, e in await site.leases()} == {1}
        assert (await standby.readyz()).role == "standby"
        assert (await leader.readyz()).role == "leader"
    assert await site.stop_all() == {"a": 0, "b": 0}
