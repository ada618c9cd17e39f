"""The daemon's process: the files its configuration names, checked at start; signals;
the event loop's reports quietened where nothing is wrong; the shutdown's grace."""

from __future__ import annotations

import asyncio
import errno
import signal
import ssl
from collections.abc import Callable
from typing import Any

import structlog

from broker.daemon.config import Config
from broker.output.logs import filter_loop_errors
from gpubroker_client import files
from policies import yamlsrc
from policies.loader import SourceError
from policies.yamlsrc import Problem

log = structlog.get_logger("gpubroker.daemon")
SHUTDOWN_GRACE_SECONDS = 10.0


def leaves(eg: BaseExceptionGroup[Any]) -> list[BaseException]:
    out: list[BaseException] = []
    for e in eg.exceptions:
        out.extend(leaves(e) if isinstance(e, BaseExceptionGroup) else [e])
    return out


def quiet_closed_socket_callbacks(loop: asyncio.AbstractEventLoop) -> None:
    """paho, under aiomqtt, asks the loop from its own callbacks to watch a socket that
    may be closed by the time the request runs (the MQTT server just went away); asyncio
    would log that with a traceback although nothing is wrong: the session is already
    ending and reconnects. Only that case is quietened; everything else goes to the
    handler that was there."""
    def quiet(context: dict[str, Any]) -> bool:
        exc = context.get("exception")
        handle = repr(context.get("handle", ""))
        if isinstance(exc, OSError) and exc.errno == errno.EBADF and (
                "add_writer" in handle or "add_reader" in handle):
            log.debug("socket watch on a closed MQTT connection skipped", handle=handle)
            return True
        return False

    filter_loop_errors(loop, quiet)


def check_mqtt_files(cfg: Config) -> None:
    """The MQTT password and CA files, and the database's password file, read once at
    start: a missing or unreadable one is a mistake in the configuration (exit 2), not
    a server that is away (which the daemon waits out). They are read again at each
    connect. Each is read by `broker.daemon.files` (a regular file, within its bound), so a
    FIFO or `/dev/zero` there is refused at once rather than hanging or filling memory."""
    problems = []
    for key, path in (("mqtt.password_file", cfg.mqtt.password_file),
                      ("mqtt.standby_password_file", cfg.mqtt.standby_password_file),
                      ("mqtt.ca_file", cfg.mqtt.ca_file),
                      ("state.password_file", cfg.state.password_file)):
        if path is None:
            continue
        try:
            if key == "mqtt.ca_file":
                files.read_bytes(path, files.MAX_CA_BYTES)
                ssl.create_default_context(cafile=str(path))
            else:
                files.read_secret(path)
        except (OSError, ssl.SSLError) as exc:
            why = "not a PEM certificate file" if isinstance(exc, ssl.SSLError) else \
                exc.strerror or str(exc)
            problems.append(Problem(str(path), None, None, key, f"cannot read: {why}")
                            if isinstance(exc, ssl.SSLError)  # an OSError too
                            else yamlsrc.unreadable(path, exc, key))
    if problems:
        raise SourceError(problems)


def install_signal_handlers(stop: asyncio.Event, reload: Callable[[], None] | None = None
                            ) -> Callable[[], None]:
    """SIGTERM/SIGINT stop; SIGHUP reloads the policy."""
    loop = asyncio.get_running_loop()
    handled = [signal.SIGTERM, signal.SIGINT]
    for sig in handled:
        loop.add_signal_handler(sig, stop.set)
    if reload is not None:
        loop.add_signal_handler(signal.SIGHUP, reload)
        handled.append(signal.SIGHUP)

    def remove() -> None:
        for sig in handled:
            loop.remove_signal_handler(sig)

    return remove
