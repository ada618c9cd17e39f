"""Fixtures of the chaos tests: a mosquitto of their own and the daemon as a process."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from chaos.harness import DaemonProcess, StartDaemon, free_port, write_daemon_config
from mqtt_helpers import INSTALL_HINT, Mosquitto, find_mosquitto

# A small simulated market (16 regions' worth of pools), no preemptions: the leases
# placed stay where they are, so every change in the figures comes from the chaos.
SIM = {"seed": 7, "regions_per_cloud": 2, "zones_per_region": 2,
       "preempt_rate_multiplier": 0}


@pytest.fixture
def chaos_mosquitto(tmp_path: Path) -> Iterator[Mosquitto]:
    """mqtt_helpers.Mosquitto: a ``kill()`` loses everything since the last ``start()``
    (persistence off, as far as a crash goes); queue limits as in deploy/mosquitto, so
    a late subscriber gets every retained lease."""
    if find_mosquitto() is None:
        pytest.fail(f"mosquitto is not installed: {INSTALL_HINT}", pytrace=False)
    server = Mosquitto(tmp_path / "mosquitto", extra_config="max_queued_messages 20000")
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
async def start_daemon(tmp_path: Path) -> AsyncIterator[StartDaemon]:
    """``await start_daemon(mosquitto)``: `gpubroker run` as a process, ready (HTTP
    `/readyz` answers 200); killed at teardown if still running."""
    started: list[DaemonProcess] = []

    async def start(mosquitto: Mosquitto, **sim: Any) -> DaemonProcess:
        port = free_port()
        config = write_daemon_config(
            tmp_path / "daemon.yaml", mqtt_url=mosquitto.url,
            state_path=tmp_path / "state.db", http_port=port, poll_interval=5.0,
            sim={**SIM, **sim})
        daemon = DaemonProcess(config, tmp_path / "daemon.log", port)
        started.append(daemon)
        daemon.start()
        await daemon.wait_ready(30)
        return daemon

    yield start
    for daemon in started:
        daemon.close()
