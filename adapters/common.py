"""What every cloud adapter does the same way, written once.

* `Cached` — one cached answer: its value, when it was fetched (monotonic and wall time)
  and whether its last refresh failed.
* `note_optional` — an optional answer failed: keep the last good copy, log once when it
  starts failing and once when it recovers (not on every poll).
* `gather_all` — `asyncio.gather` that waits for every call before raising, so that SDK
  calls running on threads are not orphaned (and do not go on retrying) when one fails.
* `RetryPolicy` — the one retry layer: each SDK seam retries a call that failed with a
  transient error (`RateLimited`, `CloudUnavailable`: throttles, 5xx, timeouts, garbled
  bodies — any `AdapterError` that is `retryable`) with jittered exponential backoff,
  never sooner than the cloud's `RateLimited.retry_after`, and never past the poll's
  deadline (`poll_deadline`), which the poller sets and executor threads inherit. The
  poller itself does not retry: a poll is many calls, and a call is what fails.
* `import_sdk` — a heavy SDK imported lazily; a missing one raises `SdkMissing` naming
  the extra to install.

This module imports only `adapters.errors`, `broker.model` and third-party libraries, so
that every adapter may import it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import importlib
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from types import ModuleType
from typing import Any, Generic, Literal, TypeVar

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential_jitter,
)
from tenacity.stop import stop_base

from adapters.errors import AdapterError, AuthFailed, CloudUnavailable, RateLimited, SdkMissing

T = TypeVar("T")
V = TypeVar("V")


# --- cached answers ------------------------------------------------------------------

@dataclass(slots=True)
class Cached(Generic[V]):
    """One cached answer of a cloud, and when it was fetched."""

    value: V
    at: float = -1e18  # monotonic time of the last successful fetch (never: long ago)
    read_at: datetime | None = None  # wall time of that fetch
    failing: bool = False  # the last refresh failed (logged once, see `note_optional`)

    def older_than(self, seconds: float, now: float) -> bool:
        """Whether the answer is more than `seconds` old at monotonic time `now`."""
        return now - self.at > seconds


def note_optional(log: Any, cloud: str, region: str, what: str, cached: Cached[Any],
                  result: object) -> None:
    """Record the outcome `result` of refreshing the optional answer `cached` (`what`,
    e.g. "quotas"): an `AdapterError` keeps the last good copy and logs a warning, once,
    when it starts failing; success after failures logs "recovered", once. Any other
    exception is re-raised: it is a bug, not a cloud failure."""
    if isinstance(result, AdapterError):
        if not cached.failing:
            log.warning(f"{cloud} partial poll failure, keeping last good copy",
                        region=region, what=what, error=type(result).__name__,
                        detail=str(result))
        cached.failing = True
    elif isinstance(result, BaseException):
        raise result
    elif cached.failing:
        cached.failing = False
        log.info(f"{cloud} partial poll recovered", region=region, what=what)


MAX_RESERVED_INSTANCES = 100_000
"""A reservation count above this is not one a cloud would sell: a garbled answer."""


def reserved_count(value: Any, what: str = "count") -> int:
    """An instance count from a cloud's reservation answer: an int, or a string of one
    (GCP's int64 fields), in 0..`MAX_RESERVED_INSTANCES`; `ValueError` for anything else
    (bools, floats, negative or absurd counts)."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{what} {value!r} is not a whole number")
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{what} {value!r} is not a whole number") from None
    if not 0 <= n <= MAX_RESERVED_INSTANCES:
        raise ValueError(f"{what} {n} is out of range 0..{MAX_RESERVED_INSTANCES}")
    return n


def note_reservations_failed(log: Any, cloud: str, region: str, what: str, permission: str,
                             cached: Cached[Any], exc: AdapterError) -> None:
    """A failed read of a region's capacity reservations (`what`): a denied permission
    is named once, as a warning; the last good copy is kept (`note_optional`)."""
    if isinstance(exc, AuthFailed) and not cached.failing:
        log.warning(f"{cloud} {what} not read: permission denied", region=region,
                    permission=permission, detail=str(exc))
        cached.failing = True
    note_optional(log, cloud, region, what, cached, exc)


async def gather_all(calls: Iterable[Awaitable[T]]) -> list[T]:
    """Like `asyncio.gather`, but when one call fails it still waits for the others
    before raising (the first failure, in call order): their SDK calls run on threads,
    which a cancellation would not stop, and they must not go on retrying after the poll
    has given up."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results  # type: ignore[return-value]


# --- retries -------------------------------------------------------------------------

POLL_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "gpubroker_poll_deadline", default=None)
"""`time.monotonic()` by which the current poll must be done (None: no deadline). Set by
the poller for the task that polls; tasks it starts and executor threads started through
`adapters.base.run_blocking` see it too."""


def remaining() -> float | None:
    """Seconds left before the current poll's deadline (None: no deadline)."""
    deadline = POLL_DEADLINE.get()
    return None if deadline is None else deadline - time.monotonic()


@contextlib.contextmanager
def poll_deadline(seconds: float) -> Iterator[None]:
    """Give the calls made inside this block `seconds` to finish, retries included."""
    token = POLL_DEADLINE.set(time.monotonic() + seconds)
    try:
        yield
    finally:
        POLL_DEADLINE.reset(token)


class _stop_at_deadline(stop_base):
    """Stop when the next wait would end past the poll's deadline."""

    def __call__(self, state: RetryCallState) -> bool:
        left = remaining()
        return left is not None and (state.upcoming_sleep or 0.0) >= left


class RetryPolicy:
    """Attempts (12 by default) and jittered exponential backoff (0.25 s doubling,
    ± 0.25 s, at most `max_backoff`, 4 s by default) for any `AdapterError` that is
    `retryable`; a wait is never shorter than a `RateLimited.retry_after`, up to
    `max_backoff`. Within a poll, attempts stop
    when the next wait would end past the poll's deadline (`poll_deadline`), and no
    attempt starts after it: the last error goes up, and a thread of a poll that timed
    out stops retrying.

    `long_hint` says what to do with a `retry_after` beyond `max_backoff`: ``"raise"``
    (the default) does not retry, so the `RateLimited` goes up to the poller, which
    waits it out before the next poll; ``"cap"`` retries after `max_backoff`.

    The defaults suit a first poll: it makes dozens to hundreds of calls that must all
    get through, so each gets many tries, and short waits fit about ten of them into a
    30 s poll (with 30 % of calls failing, 8 tries of up to 8 s lost a region now and
    then on the AWS and Alibaba fakes).

    The attributes may be changed after construction (tests shorten `max_backoff`)."""

    ATTEMPTS = 12
    MAX_BACKOFF = 4.0

    def __init__(self, attempts: int = ATTEMPTS, max_backoff: float = MAX_BACKOFF, *,
                 long_hint: Literal["raise", "cap"] = "raise") -> None:
        self.attempts = attempts
        self.max_backoff = max_backoff
        self.long_hint = long_hint

    def retryable(self, exc: BaseException) -> bool:
        """Whether `exc` is retried here."""
        if not (isinstance(exc, AdapterError) and exc.retryable):
            return False
        return not (self.long_hint == "raise" and isinstance(exc, RateLimited)
                    and exc.retry_after is not None and exc.retry_after > self.max_backoff)

    def wait(self, state: RetryCallState) -> float:
        """Seconds before the next attempt."""
        base: float = wait_exponential_jitter(multiplier=0.25, max=self.max_backoff,
                                              jitter=0.25)(state)
        exc = state.outcome.exception() if state.outcome is not None else None
        if isinstance(exc, RateLimited) and exc.retry_after:
            return min(self.max_backoff, max(base, exc.retry_after))
        return base

    def sync(self) -> Retrying:
        """A tenacity `Retrying` for blocking calls (re-raises the last error)."""
        return Retrying(stop=stop_after_attempt(self.attempts) | _stop_at_deadline(),
                        wait=self.wait, retry=retry_if_exception(self.retryable),
                        reraise=True)

    def async_(self) -> AsyncRetrying:
        """A tenacity `AsyncRetrying` for coroutines (re-raises the last error)."""
        return AsyncRetrying(stop=stop_after_attempt(self.attempts) | _stop_at_deadline(),
                             wait=self.wait, retry=retry_if_exception(self.retryable),
                             reraise=True)

    def call(self, fn: Callable[[], T], translate: Callable[[Exception], AdapterError],
             on_attempt: Callable[[], None] | None = None) -> T:
        """Run the blocking `fn` with retries: each attempt first calls `on_attempt`
        (call counting), and any exception `fn` raises goes through `translate` (the
        cloud's error table, which re-raises what it does not know)."""
        for attempt in self.sync():
            with attempt:
                left = remaining()
                if left is not None and left <= 0:
                    raise CloudUnavailable("the poll's deadline passed; no more attempts")
                if on_attempt is not None:
                    on_attempt()
                try:
                    return fn()
                except Exception as exc:  # translated here; anything unknown re-raised
                    raise translate(exc) from exc
        raise AssertionError("unreachable")  # pragma: no cover


# --- lazy SDK imports ----------------------------------------------------------------

def import_sdk(module: str, *, cloud: str, label: str, package: str) -> ModuleType:
    """`module`, imported on first use. When it is missing, `SdkMissing` reads
    ``<label> support needs <package>: pip install 'gpubroker[<cloud>]'``."""
    try:
        importlib.import_module(module.partition(".")[0])  # the package itself, first
        return importlib.import_module(module)
    except ModuleNotFoundError:
        raise SdkMissing(f"{label} support needs {package}: pip install "
                         f"'gpubroker[{cloud}]'", cloud=cloud) from None
