"""sd_notify from a real daemon process to a fake notify socket (path and abstract)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from mqtt_helpers import Mosquitto

from broker.edges.sdnotify import Notifier


class NotifySocket:
    """What systemd listens on: a datagram socket collecting notifications."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.sock.setblocking(False)
        self.messages: list[str] = []

    async def until(self, line: str, timeout: float = 15) -> list[str]:
        """Read datagrams until one holds `line`; return every line seen so far."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout):
            while not any(line in m.splitlines() for m in self.messages):
                data = await loop.sock_recv(self.sock, 4096)
                self.messages.append(data.decode())
        return [ln for m in self.messages for ln in m.splitlines()]

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
async def test_ready_watchdog_reload_stopping_in_order(
        abstract: bool, tmp_path: Path, mosquitto: Mosquitto) -> None:
    address = f"@gpubroker-test-{uuid.uuid4().hex}" if abstract else str(tmp_path / "notify")
    notify = NotifySocket(address)
    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\n")
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({
        "state": {"path": str(tmp_path / "state.db")}, "policy_file": str(policy),
        "mqtt": {"url": mosquitto.url}, "http": {"listen": None},
        "poll": {"interval_seconds": 3600, "stale_after_seconds": 7200},
        "clouds": {"sim": {"regions_per_cloud": 1, "zones_per_region": 1}}}))
    env = {**os.environ, "NOTIFY_SOCKET": address, "WATCHDOG_USEC": "2000000"}
    env.pop("WATCHDOG_PID", None)
    log = (tmp_path / "daemon.log").open("wb")
    proc = subprocess.Popen(  # noqa: ASYNC220 - started here, waited on below off the loop
        [sys.executable, "-m", "broker.cli", "run", "--config", str(cfg)], env=env,
        stdout=log, stderr=log)
    try:
        lines = await notify.until("READY=1")
        assert any(ln.startswith("STATUS=") and "active leases" in ln for ln in lines)
        lines = await notify.until("WATCHDOG=1")
        assert lines.index("WATCHDOG=1") > lines.index("READY=1")

        proc.send_signal(signal.SIGHUP)
        lines = await notify.until("RELOADING=1")
        reload_at = lines.index("RELOADING=1")
        assert lines[reload_at + 1].startswith("MONOTONIC_USEC=")
        usec = int(lines[reload_at + 1].split("=")[1])
        assert abs(usec - time_monotonic_usec()) < 60_000_000
        while lines.count("READY=1") < 2:
            notify.messages.append(
                (await asyncio.get_running_loop().sock_recv(notify.sock, 4096)).decode())
            lines = [ln for m in notify.messages for ln in m.splitlines()]
        assert max(i for i, ln in enumerate(lines) if ln == "READY=1") > reload_at

        proc.send_signal(signal.SIGTERM)
        lines = await notify.until("STOPPING=1")
        assert lines.index("STOPPING=1") > reload_at
        assert await asyncio.to_thread(proc.wait, 20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        notify.close()


def time_monotonic_usec() -> int:
    import time

    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def test_without_notify_socket_nothing_is_sent() -> None:
    n = Notifier(address="")
    assert not n.enabled and n.ready() is False and n.watchdog() is False


def test_a_dead_socket_never_raises(tmp_path: Path) -> None:
    n = Notifier(address=str(tmp_path / "nobody-listens"))
    assert n.ready() is False and n.stopping() is False
    n.close()
