"""What arrives on the wire: a scheduler's request, as received (over MQTT by the bus,
over HTTP by its API), before the lease authority validates and acts on it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

VERBS = ("place", "renew", "release", "report", "quote", "lookup")
OPS = "_ops"  # the reserved scheduler id of operations events (P/events/_ops/...)


@dataclass(frozen=True, slots=True)
class Command:
    """One message from a scheduler, as received (validated by the lease authority, not
    by the bus)."""

    scheduler: str
    verb: str
    payload: bytes
    topic: str
    reply: dict[str, Any] | None = None  # MQTT 5 response_topic + correlation_data
    answer: asyncio.Future[bytes] | None = None  # an HTTP caller waiting for the answer
    retained: bool = False  # published with the retain flag: refused, never acted on
    received: float = field(default_factory=time.monotonic)
    done: Callable[[], None] | None = None
    """Called once the command's outcome is committed (its lease and events, a
    rejection, a `request.invalid`, a repeat answered from the lease book: all in the
    outbox), or known to need no commit. The bus acknowledges the MQTT message then, not
    on receipt (MQTT 5): a command that is never done — the store refused the commit, the
    daemon stopped or crashed first — is never acknowledged, and the MQTT server delivers
    it again on the next connection."""
