"""The adapter contract: what every cloud (and the simulated market) provides.

A cloud adapter is deliberately small. It reports what its cloud offers; it does not
filter, rank or place (availability is a field of an offer, not a missing row). It does
not time out a poll or count metrics either: the daemon does that around every adapter,
the same way for every cloud. The one thing that retries is each call at the SDK seam
(`adapters.common.RetryPolicy`): a throttle, a 5xx, a timeout or a garbled body is
retried with backoff within the poll's deadline; nothing above it retries again.

Rules every adapter follows:

* Methods are coroutines and never block the event loop. An adapter built on a blocking
  SDK runs every SDK call on the executor it is given (`run_blocking`), never on the loop.
* Heavy SDKs are imported lazily, inside the adapter's `sdk.py`, and a missing one raises
  `SdkMissing` with the pip extra to install.
* Credentials come from the SDK's standard chain only, and never appear in a message,
  a log line or an exception.
* Every failure is raised as one of the typed errors of `adapters.errors`, translated
  once in the adapter's `sdk.py`. Anything else escaping an adapter is a bug.
"""

from __future__ import annotations

import asyncio
import contextvars
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Callable, Collection, Sequence
from concurrent.futures import Executor
from datetime import datetime
from typing import ClassVar, ParamSpec, TypeVar

from broker.model import CapacitySignal, Offer, PoolKey

P = ParamSpec("P")
T = TypeVar("T")

LeasedPools = Callable[[], Collection[PoolKey]]
"""Returns the pools the broker holds active leases on, at the time of the call."""


class CloudAdapter(ABC):
    """One source of offers: a cloud account, or the simulated market.

    `name` identifies the adapter in logs, metrics and health (`aws`, `sim`); the offers
    it returns carry their own `pool.cloud`, which for a real cloud equals `name`.
    """

    name: ClassVar[str]

    @abstractmethod
    def regions(self) -> Sequence[str]:
        """The region ids this adapter polls, from its configuration. Never raises.

        Ids are opaque to the daemon (the simulated market, which plays several clouds,
        uses `aws:us-east-1`); they only need to be unique within the adapter."""

    @abstractmethod
    async def poll(self, region: str) -> list[Offer]:
        """Everything the cloud offers in `region` right now: one `Offer` per pool, for
        every GPU instance type the region offers in each zone, in both markets where the
        cloud sells them, with every capacity signal the cloud gives (unknown ones
        `None`). Pools the cloud lists without a price are returned with
        `price_per_hour=None`.

        The result replaces the previous result for `region` as a whole: a pool missing
        from it is no longer offered.

        Raises `AuthFailed` (credentials missing or denied), `RateLimited` (throttled,
        with the cloud's `retry_after` if any), `CloudUnavailable` (5xx, connection
        errors, timeouts), `InvalidConfig` (the region does not exist), `SdkMissing`.
        """

    async def signals(self, leased: LeasedPools) -> AsyncGenerator[CapacitySignal, None]:
        """Push notices about pools, as they arrive (spot interruption warnings, pool
        capacity loss), for as long as the caller iterates. `leased` tells which pools
        the broker holds leases on, for clouds whose notices need a filter. Adapters
        without a push channel never yield (this default).

        Raises the same typed errors as `poll`; the caller restarts the iteration after
        a backoff.
        """
        await asyncio.Event().wait()
        return
        yield  # pragma: no cover - makes this an async generator

    def note_launch_failure(self, pool: PoolKey, detail: str,
                            at: datetime | None = None) -> bool:
        """A scheduler could not launch into `pool` (`detail` is the cloud's error code or
        message, from a `launch_failed` report). Clouds whose APIs never show stock-outs
        (GCP) lower the pool's availability for a while when `detail` names one. Returns
        whether the adapter took it into account. Never raises; the default ignores it."""
        return False

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release clients, sessions and threads. Never raises."""


async def run_blocking(
    executor: Executor | None, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs
) -> T:
    """Run a blocking SDK call on `executor`, off the event loop, in a copy of the
    caller's context (so the call sees the poll's deadline: `adapters.common`)."""
    loop = asyncio.get_running_loop()
    ctx = contextvars.copy_context()
    return await loop.run_in_executor(executor, lambda: ctx.run(fn, *args, **kwargs))

