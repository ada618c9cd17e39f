"""The helpers every cloud adapter shares (adapters/common.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest
from structlog.testing import capture_logs

from adapters.base import run_blocking
from adapters.common import (
    Cached,
    RetryPolicy,
    gather_all,
    import_sdk,
    note_optional,
    poll_deadline,
)
from adapters.errors import AdapterError, AuthFailed, CloudUnavailable, RateLimited, SdkMissing


def same(exc: Exception) -> AdapterError:
    """The translation of an error that is already typed."""
    assert isinstance(exc, AdapterError)
    return exc


def flaky(*errors: Exception) -> tuple[list[int], Callable[[], str]]:
    calls: list[int] = []

    def fn() -> str:
        calls.append(1)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return "ok"

    return calls, fn


def test_retryable_errors_are_retried_and_others_not() -> None:
    policy = RetryPolicy(attempts=3, max_backoff=0.01)
    calls, fn = flaky(CloudUnavailable("5xx"), RateLimited("slow down"))
    assert policy.call(fn, same) == "ok"
    assert len(calls) == 3
    calls, fn = flaky(AuthFailed("no"))
    with pytest.raises(AuthFailed):
        policy.call(fn, same)
    assert len(calls) == 1


def test_a_short_retry_after_is_waited_out() -> None:
    policy = RetryPolicy(attempts=2, max_backoff=1.0)
    calls, fn = flaky(RateLimited("slow down", retry_after=0.3))
    t = time.monotonic()
    assert policy.call(fn, same) == "ok"
    assert time.monotonic() - t >= 0.3 and len(calls) == 2


def test_a_long_retry_after_goes_up_or_is_capped() -> None:
    calls, fn = flaky(RateLimited("slow down", retry_after=60))
    with pytest.raises(RateLimited):
        RetryPolicy(attempts=3, max_backoff=0.01).call(fn, same)
    assert len(calls) == 1  # left to the poller, which honours it
    calls, fn = flaky(RateLimited("slow down", retry_after=60))
    capped = RetryPolicy(attempts=3, max_backoff=0.01, long_hint="cap")
    assert capped.call(fn, same) == "ok"
    assert len(calls) == 2


def test_retries_stop_at_the_polls_deadline() -> None:
    """A call that keeps failing is retried only while the poll has time left: no
    attempt would end past the deadline, and the last error goes up."""
    policy = RetryPolicy(attempts=100, max_backoff=0.05)
    calls, fn = flaky(*[CloudUnavailable("5xx")] * 100)
    t = time.monotonic()
    with poll_deadline(0.5), pytest.raises(CloudUnavailable):
        policy.call(fn, same)
    took = time.monotonic() - t
    assert 2 < len(calls) < 100
    assert took < 0.6


def test_a_retry_after_beyond_the_deadline_is_not_waited_out() -> None:
    calls, fn = flaky(RateLimited("slow down", retry_after=5))
    with poll_deadline(1.0), pytest.raises(RateLimited):
        RetryPolicy(attempts=3, max_backoff=10).call(fn, same)
    assert len(calls) == 1


async def test_threads_of_a_timed_out_poll_stop_retrying() -> None:
    """The deadline reaches executor threads (`run_blocking` copies the context): when
    the poll is given up, its calls stop being retried."""
    policy = RetryPolicy(attempts=1000, max_backoff=0.02)
    calls, fn = flaky(*[CloudUnavailable("5xx")] * 1000)
    ended = threading.Event()

    def call() -> str:
        try:
            return policy.call(fn, same)
        finally:
            ended.set()

    with poll_deadline(0.3), pytest.raises(TimeoutError):
        async with asyncio.timeout(0.1):
            await run_blocking(None, call)
    assert not ended.is_set()  # the poll gave up; its thread is still retrying
    assert await asyncio.to_thread(ended.wait, 5)  # ... until the deadline
    assert len(calls) < 1000


def test_optional_failures_are_logged_once_and_recovery_once() -> None:
    import structlog

    log = structlog.get_logger("test")
    cached: Cached[dict[str, int]] = Cached({"a": 1})
    assert cached.older_than(10, 0.0)
    with capture_logs() as logs:
        for _ in range(2):
            note_optional(log, "aws", "r1", "quotas", cached, CloudUnavailable("x"))
        assert cached.failing and cached.value == {"a": 1}
        note_optional(log, "aws", "r1", "quotas", cached, None)
        note_optional(log, "aws", "r1", "quotas", cached, None)
    assert [e["event"] for e in logs] == ["aws partial poll failure, keeping last good copy",
                                         "aws partial poll recovered"]
    with pytest.raises(ZeroDivisionError):  # a bug, not a cloud failure
        note_optional(log, "aws", "r1", "quotas", cached, ZeroDivisionError())


async def test_gather_all_waits_for_every_call_before_raising() -> None:
    done: list[str] = []

    async def slow() -> str:
        await asyncio.sleep(0.05)
        done.append("slow")
        return "slow"

    async def fails() -> str:
        raise CloudUnavailable("x")

    with pytest.raises(CloudUnavailable):
        await gather_all([fails(), slow()])
    assert done == ["slow"]
    assert await gather_all([slow(), slow()]) == ["slow", "slow"]


def test_a_missing_sdk_names_the_extra() -> None:
    with pytest.raises(SdkMissing, match=r"^Foo support needs foo-sdk: pip install "
                                         r"'gpubroker\[foo\]'$"):
        import_sdk("gpubroker_no_such_module.sub", cloud="foo", label="Foo",
                   package="foo-sdk")
