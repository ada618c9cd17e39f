"""Running a real daemon in-process for tests: config, handle, start helper."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from mqtt_helpers import Mosquitto

from adapters.sim import SimAdapter
from broker.daemon.assembly import Daemon
from broker.daemon.config import (
    CloudsConfig,
    Config,
    HttpConfig,
    MqttConfig,
    PollConfig,
    SimConfig,
    StateConfig,
)

PREFIX = "gpubroker/v1"


def daemon_config(mosquitto: Mosquitto, state: Path, policy_file: Path | None = None,
                  **mqtt: Any) -> Config:
    return Config(
        site="test",
        policy_file=policy_file,
        http=HttpConfig(listen=None),
        state=StateConfig(path=state),
        mqtt=MqttConfig(url=mosquitto.url, client_id="gpubroker-test", **mqtt),
        # Polls only at start: tests poll explicitly when they need a new market state.
        poll=PollConfig(interval_seconds=3600, stale_after_seconds=7200),
        clouds=CloudsConfig(sim=SimConfig(seed=11, regions_per_cloud=2, zones_per_region=2,
                                          preempt_rate_multiplier=0,
                                          signal_interval_seconds=0.05)),
    )


class RunningDaemon:
    def __init__(self, daemon: Daemon, task: asyncio.Task[None], stop: asyncio.Event) -> None:
        self.daemon = daemon
        self.task = task
        self.stop_event = stop

    @property
    def sim(self) -> SimAdapter:
        adapter = self.daemon.adapter("sim")
        assert isinstance(adapter, SimAdapter)
        return adapter

    async def stop(self) -> None:
        self.stop_event.set()
        async with asyncio.timeout(15):
            await self.task


StartDaemon = Callable[..., Awaitable[RunningDaemon]]




async def start_until_ready(cfg: Config, started: list[RunningDaemon],
                            timeout: float = 15) -> RunningDaemon:
    """Start a daemon in-process (added to `started`, for the test to stop); return once
    it is ready, or raise what ended it first."""
    daemon = Daemon(cfg)
    stop = asyncio.Event()
    rd = RunningDaemon(daemon, asyncio.create_task(daemon.run(stop)), stop)
    started.append(rd)
    ready = asyncio.create_task(daemon.ready.wait())
    done, _ = await asyncio.wait({ready, rd.task}, timeout=timeout,
                                 return_when=asyncio.FIRST_COMPLETED)
    if rd.task in done:
        ready.cancel()
        rd.task.result()
    assert ready in done, f"daemon did not become ready within {timeout:g} s"
    return rd


def fill_up(db: Any) -> None:
    """Make a SQLite state file as full as it may get on this connection: no free pages
    and no room to grow, so the next commit that needs a page fails with a real
    SQLITE_FULL. The limit is the connection's own: a restarted daemon has room."""
    db.execute("VACUUM")
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    db.execute(f"PRAGMA max_page_count = {pages}")


BIG_LABELS = {f"label-{i}": "x" * 250 for i in range(40)}
"""About 10 KB of labels: a request that needs new pages in the store."""
