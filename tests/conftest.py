"""Shared fixtures: real servers, started per test, torn down always.

* ``mosquitto`` — a real mosquitto on a free 127.0.0.1 port, config/data/log in
  tmp_path; ``.url``, ``.stop()``, ``.start()`` (same port), ``.kill()``.
* ``probe_factory`` — ``await probe_factory(topics, protocol=5)`` gives a connected
  ``MqttProbe`` on that server, closed at teardown.
* ``free_port`` — the ``free_port()`` function, for tests that need more ports.
* ``pg_url`` — the URL of a fresh, empty PostgreSQL database, dropped at teardown
  (``tests/pg_helpers.py``).

The helpers themselves live in ``tests/mqtt_helpers.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pg_helpers
import pytest
from mqtt_helpers import (
    INSTALL_HINT,
    Mosquitto,
    MqttProbe,
    ProbeFactory,
    find_mosquitto,
    free_port,
)


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
