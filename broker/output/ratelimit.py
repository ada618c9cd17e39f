"""Rate-limited logging: a warning a flood of messages can trigger is logged for the
first of them, then at most once per interval, with how many there were meanwhile."""

from __future__ import annotations

import time
from collections.abc import Callable


class Every:
    """`hit()` counts an occurrence and says whether to log it now: the first one, then
    the first after each `seconds`. It returns the number of occurrences the log line
    stands for (this one and those not logged since the last line), or 0 to stay quiet.
    """

    def __init__(self, seconds: float, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = seconds
        self._clock = clock
        self._next = float("-inf")
        self._count = 0

    def hit(self) -> int:
        self._count += 1
        now = self._clock()
        if now < self._next:
            return 0
        self._next = now + self.seconds
        count, self._count = self._count, 0
        return count
