"""An MQTT server outage through a real daemon and a real mosquitto: no lease expires
while the daemon cannot hear its schedulers, and the retained states are true after it
(contract 1.1 §3.2, #29)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import aiomqtt
from daemon_helpers import PREFIX, StartDaemon
from mqtt_helpers import Mosquitto, MqttProbe, ProbeFactory, payload_json

from broker.model import LeaseState

S = "sched-1"
TTL = 3
OUTAGE = 2 * TTL
GRACE = 4
LEASES = 12
RENEW_EVERY = 0.5


async def _renew_until(probe: MqttProbe, lease_ids: list[str], stop: asyncio.Event) -> None:
    """A scheduler renewing every lease every RENEW_EVERY seconds — into the outage too:
    what it sends while the server is down is lost, and it connects again as soon as it
    can (a clean session: nothing is queued for it meanwhile) — until `stop` is set.
    Stopped by the event, not cancelled: under load a cancellation that lands inside the
    MQTT client's publish or reconnect can be lost, and the loop went on renewing for
    seconds after `cancel()`, while the test read the book."""
    while not stop.is_set():
        try:
            for lease_id in lease_ids:
                await probe.publish(f"{PREFIX}/requests/{S}/renew", {"lease_id": lease_id})
        except (aiomqtt.MqttError, RuntimeError):
            with contextlib.suppress(aiomqtt.MqttError, OSError):
                await probe.reconnect()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(RENEW_EVERY):  # the scheduler's cadence
                await stop.wait()


async def test_an_outage_of_twice_the_ttl_expires_no_lease(
        start_daemon: StartDaemon, mosquitto: Mosquitto, probe_factory: ProbeFactory) -> None:
    rd = await start_daemon(reconnect_grace_seconds=GRACE)
    daemon = rd.daemon
    sched = await probe_factory([f"{PREFIX}/events/{S}/#"])
    for i in range(LEASES):
        await sched.publish(f"{PREFIX}/requests/{S}/place",
                            {"request_id": f"job-{i}", "gpu": ["A100-80GB", "H100-80GB"],
                             "gpus": 1, "lease_seconds": TTL})
    decided = await sched.wait_for_count(f"{PREFIX}/events/{S}/placement.decided", LEASES)
    lease_ids = [payload_json(m)["data"]["lease_id"] for m in decided]
    stop = asyncio.Event()
    renewing = asyncio.create_task(_renew_until(sched, lease_ids, stop))
    try:
        sessions = daemon.bus.connections
        await mosquitto.astop()
        down = time.monotonic()
        await asyncio.sleep(OUTAGE)  # the outage itself: twice every lease's TTL
        assert not daemon.bus.connected.is_set()
        overdue = [le for le in daemon.book.active() if le.expires_at <= daemon.broker._clock()]
        assert len(overdue) == LEASES  # unheard for longer than the TTL, yet none expired
        await mosquitto.astart()
        async with asyncio.timeout(30):
            await daemon.bus.connection_after(sessions)
        up = time.monotonic()
        # Renewals resume; 3 s after the reconnect the scheduler stops renewing, and
        # what is retained must be the book (read before the first TTL runs out).
        await asyncio.sleep(3)
    finally:
        stop.set()
        async with asyncio.timeout(30):
            await renewing
    # The last renewals may still be on their way to the daemon. It takes a scheduler's
    # requests in the order they were sent: once a quote sent after them is answered,
    # every one of them was decided and committed.
    since = len(sched.messages)
    await sched.publish(f"{PREFIX}/requests/{S}/quote",
                        {"request_id": "after-the-renewals", "gpu": ["T4"], "gpus": 1})
    await sched.wait_for(f"{PREFIX}/events/{S}/placement.quoted", timeout=10, since=since)
    assert await daemon.bus.drained(5)
    await daemon.broker.settled()
    book = {le.lease_id: le for le in daemon.book.all()}
    ended = [le for le in book.values() if le.state is not LeaseState.ACTIVE]
    assert ended == [], f"{len(ended)} leases ended: {[le.state for le in ended]}"
    late = await probe_factory([f"{PREFIX}/leases/{S}/+"])
    retained = await late.wait_for_count(lambda m: m.retain, LEASES, timeout=2)
    seen = {str(m.topic).rsplit("/", 1)[1]: payload_json(m) for m in retained}
    assert seen == {i: json.loads(daemon.messages.lease_state(book[i]).payload)
                    for i in lease_ids}
    print(f"\noutage {up - down:.1f} s (mosquitto down {OUTAGE} s, lease TTL {TTL} s, "
          f"grace {GRACE} s): {LEASES} leases, {len(ended)} expired, "
          f"{len(seen)}/{LEASES} retained states true after the reconnect")
