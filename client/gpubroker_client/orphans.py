"""The placements a scheduler gave up on: `place()` calls cancelled, or timed out, after
their request went out. The daemon may decide one of them later; its lease then belongs
to nobody — an orphan, paid for until it expires. The client remembers their request ids
and releases the lease of any decision that comes for one (and after a reconnect asks the
daemon, by `lookup`, for those it never heard of)."""

from __future__ import annotations

import time
from collections import OrderedDict

__all__ = ["ABANDONED_KEEP_SECONDS", "ABANDONED_MAX", "Abandoned"]

ABANDONED_KEEP_SECONDS = 3600.0
"""How long a given-up request is remembered: the daemon decides a request it received
within its MQTT session's expiry (default 3600 s), so a decision may come that late."""

ABANDONED_MAX = 100_000
"""Given-up requests remembered at most (the oldest are forgotten first)."""


class Abandoned:
    """request_id -> when it was given up (monotonic), oldest first."""

    def __init__(self) -> None:
        self._ids: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        self._prune()
        return len(self._ids)

    def __contains__(self, request_id: object) -> bool:
        self._prune()
        return request_id in self._ids

    def add(self, request_id: str) -> None:
        self._ids[request_id] = time.monotonic()
        self._ids.move_to_end(request_id)
        while len(self._ids) > ABANDONED_MAX:
            self._ids.popitem(last=False)

    def take(self, request_id: str) -> bool:
        """Forget `request_id`; whether it was given up (and not too long ago)."""
        self._prune()
        return self._ids.pop(request_id, None) is not None

    def pending(self) -> list[str]:
        self._prune()
        return list(self._ids)

    def _prune(self) -> None:
        horizon = time.monotonic() - ABANDONED_KEEP_SECONDS
        while self._ids and next(iter(self._ids.values())) < horizon:
            self._ids.popitem(last=False)
