"""Fixtures for broker tests: a real daemon, in-process, on a private mosquitto and a
SQLite file in tmp_path."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from daemon_helpers import RunningDaemon, StartDaemon, daemon_config
from mqtt_helpers import Mosquitto

from broker.daemon.assembly import Daemon


@pytest.fixture
async def start_daemon(mosquitto: Mosquitto, tmp_path: Path) -> AsyncIterator[StartDaemon]:
    """`await start_daemon(**mqtt_options)` → a ready daemon; stopped at teardown."""
    running: list[RunningDaemon] = []

    async def start(state: Path | None = None, policy_file: Path | None = None,
                    config: dict[str, Any] | None = None, **mqtt: Any) -> RunningDaemon:
        """`config`: top-level configuration sections replacing the test defaults."""
        cfg = daemon_config(mosquitto, state or tmp_path / "state.db", policy_file, **mqtt)
        if config:
            cfg = cfg.model_copy(update=config)
        daemon = Daemon(cfg)
        stop = asyncio.Event()
        task = asyncio.create_task(daemon.run(stop))
        rd = RunningDaemon(daemon, task, stop)
        running.append(rd)
        ready = asyncio.create_task(daemon.ready.wait())
        done, _ = await asyncio.wait({ready, task}, timeout=15,
                                     return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            ready.cancel()
            task.result()  # raises the daemon's error
        assert ready in done, "daemon did not become ready within 15 s"
        return rd

    yield start
    for rd in running:
        if not rd.task.done():
            await rd.stop()
        with contextlib.suppress(asyncio.CancelledError):
            rd.task.result()
