"""Fixtures of the high-availability tests: a site of daemon processes on the test's
mosquitto and PostgreSQL database, a probe, and a scheduler."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from ha.helpers import PREFIX, SCHEDULER, HaSite, Scheduler
from mqtt_helpers import Mosquitto, MqttProbe

from gpubroker_client import BrokerClient


@pytest.fixture
async def site(tmp_path: Path, mosquitto: Mosquitto, pg_url: str) -> AsyncIterator[HaSite]:
    """The site's nodes (started by the test); every process killed at teardown."""
    s = HaSite(tmp_path, mosquitto, pg_url)
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
async def probe(mosquitto: Mosquitto) -> AsyncIterator[MqttProbe]:
    """One subscriber of `P/status` and `P/events/#` for the whole test: the arrival
    order the checks compare. Every message is held to the contract."""
    async with MqttProbe(mosquitto.url, [f"{PREFIX}/status", f"{PREFIX}/events/#"]) as p:
        yield p


@pytest.fixture
async def scheduler(mosquitto: Mosquitto) -> AsyncIterator[Scheduler]:
    """A BrokerClient for scheduler `ha-sched`, re-sending after 0.5 s (doubling to
    2 s), and at once when a daemon comes online with another boot_id."""
    async with BrokerClient(mosquitto.url, scheduler=SCHEDULER, protocol="5",
                            resend_after=0.5, resend_max=2.0) as client:
        sched = Scheduler(client, answer_timeout=20.0)
        try:
            yield sched
        finally:
            await sched.close()
