"""systemd's notification protocol (sd_notify), the small part gpubroker uses.

The protocol is one datagram of `KEY=value` lines to the AF_UNIX socket named by
`NOTIFY_SOCKET` (a path, or `@name` for the abstract namespace). Without the variable
(not started by systemd) every call is a no-op. Sending never blocks and never raises:
a notification that cannot be delivered is logged once.
"""

from __future__ import annotations

import os
import socket
import time

import structlog

log = structlog.get_logger("gpubroker.sdnotify")


class Notifier:
    def __init__(self, address: str | None = None) -> None:
        address = address if address is not None else os.environ.get("NOTIFY_SOCKET")
        self._address: str | None = None
        if address:
            self._address = "\0" + address[1:] if address.startswith("@") else address
        self._sock: socket.socket | None = None
        self._warned = False

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def send(self, *lines: str) -> bool:
        if self._address is None:
            return False
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.setblocking(False)
        try:
            self._sock.sendto("\n".join(lines).encode(), self._address)
        except OSError as exc:
            if not self._warned:
                log.warning("systemd notification failed", error=str(exc))
                self._warned = True
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.send("READY=1", *([f"STATUS={status}"] if status else []))

    def reloading(self) -> bool:
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.send("RELOADING=1", f"MONOTONIC_USEC={usec}")

    def stopping(self) -> bool:
        return self.send("STOPPING=1")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={text}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_seconds() -> float | None:
    """The watchdog period systemd asks for (`WATCHDOG_USEC`), if it is meant for us."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 1_000_000
    except ValueError:
        return None
