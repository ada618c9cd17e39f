"""The helpers every cloud adapter shares (adapters/common.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from structlog.testing import capture_logs

from adapters.common import Cached, RetryPolicy, gather_all, import_sdk, note_optional
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
