"""The checks of a client's options that no connection could use, and the answer
that says the MQTT server does not speak the version asked for."""

from __future__ import annotations

import re
from typing import Literal

from aiomqtt.exceptions import MqttConnectError

from gpubroker_client.model import scheduler_id_problem

__all__ = ["INSTANCE", "Protocol", "check_options", "unsupported_version"]

Protocol = Literal["5", "3.1.1", "auto"]

INSTANCE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
"""An instance name: a topic level and a part of a client id."""


def check_options(scheduler: str | None, topic_prefix: str, protocol: str,
                   instance: str | None, session_expiry: int, *, two_passwords: bool) -> str:
    """Raise ValueError for an option no connection could use; the topic prefix."""
    if two_passwords:
        raise ValueError("give password or password_file, not both")
    if scheduler is not None and (problem := scheduler_id_problem(scheduler)) is not None:
        raise ValueError(problem)
    prefix = topic_prefix.strip()
    if not prefix or prefix.startswith("/") or prefix.endswith("/") or \
            any(c in prefix for c in "+#\0"):
        raise ValueError(f"topic prefix {topic_prefix!r} must be a topic path without "
                         "wildcards or a leading or trailing '/'")
    if protocol not in ("5", "3.1.1", "auto"):
        raise ValueError(f"protocol must be '5', '3.1.1' or 'auto', not {protocol!r}")
    if instance is not None and not INSTANCE.match(instance):
        raise ValueError(f"instance name {instance!r} must match [A-Za-z0-9_.-]{{1,64}}")
    if not 0 <= session_expiry <= 0xFFFFFFFF:
        raise ValueError(f"session_expiry must be 0 to 4294967295 seconds, not "
                         f"{session_expiry!r}")
    return prefix


def unsupported_version(exc: MqttConnectError) -> bool:
    rc = exc.rc
    value = getattr(rc, "value", rc)
    return value in (1, 132)  # 3.1.1 "unacceptable protocol version"; 5 "unsupported"
