"""Shared fixtures: real servers, started per test, torn down always.

* ``mosquitto`` — a real mosquitto on a free 127.0.0.1 port, config/data/log in
  tmp_path; ``.url``, ``.stop()``, ``.start()`` (same port), ``.kill()``.
* ``probe_factory`` — ``await probe_factory(topics, protocol=5)`` gives a connected
  ``MqttProbe`` on that server, closed at teardown.
* ``free_port`` — the ``free_port()`` function, for tests that need more ports.
* ``pg_url`` — the URL of a fresh, empty PostgreSQL database, dropped at teardown
  (``tests/support/pg_helpers.py``).
* ``start_daemon`` — ``await start_daemon(**mqtt_options)`` gives a ready daemon,
  in-process, on that mosquitto and a SQLite file in tmp_path; stopped at teardown.

The helpers themselves live in ``tests/support/`` (``mqtt_helpers``, ``pg_helpers``,
``daemon_helpers``, ``factories``, …) and the clouds' fakes in ``tests/fakes/``; both
folders are on ``sys.path`` (pyproject's pytest ``pythonpath``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pg_helpers
import pytest
from daemon_helpers import RunningDaemon, StartDaemon, daemon_config
from mqtt_helpers import (
    INSTALL_HINT,
    Mosquitto,
    MqttProbe,
    ProbeFactory,
    find_mosquitto,
    free_port,
)

from broker.daemon.assembly import Daemon


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database of its own, dropped at teardown."""
    if (why := pg_helpers.available()) is not None:
        pytest.fail(why, pytrace=False)
    with pg_helpers.fresh_database() as url:
        yield url


@pytest.fixture(name="free_port")
def free_port_fixture() -> Callable[[], int]:
    return free_port


@pytest.fixture
def mosquitto(tmp_path: Path) -> Iterator[Mosquitto]:
    """A running mosquitto, private to this test."""
    if find_mosquitto() is None:
        pytest.fail(f"mosquitto is not installed: {INSTALL_HINT}", pytrace=False)
    server = Mosquitto(tmp_path / "mosquitto")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def probe_factory(mosquitto: Mosquitto) -> AsyncIterator[ProbeFactory]:
    """``await probe_factory(["gpubroker/v1/#"], protocol=5)`` → connected MqttProbe."""
    async with contextlib.AsyncExitStack() as stack:

        async def make(topics: Iterable[str] = ("#",), **kwargs: Any) -> MqttProbe:
            return await stack.enter_async_context(MqttProbe(mosquitto.url, topics, **kwargs))

        yield make


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
