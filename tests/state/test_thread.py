"""`OneThread`: the stores' one thread, each function answered on its loop."""

from __future__ import annotations

import asyncio
import threading

import pytest

from broker.state.thread import OneThread


async def test_runs_in_order_on_one_thread_and_answers_each() -> None:
    t = OneThread("store-test")
    seen: list[tuple[int, str]] = []

    def step(i: int) -> int:
        seen.append((i, threading.current_thread().name))
        return i * i

    try:
        got = await asyncio.gather(*(t.run(lambda i=i: step(i)) for i in range(200)))
    finally:
        t.shutdown()
    assert got == [i * i for i in range(200)]
    assert [i for i, _ in seen] == list(range(200))
    assert {name for _, name in seen} == {"store-test"}


async def test_an_exception_reaches_the_waiter_and_the_thread_goes_on() -> None:
    t = OneThread("store-test")

    def fail() -> None:
        raise ValueError("refused")

    def stop() -> None:
        raise StopIteration

    try:
        with pytest.raises(ValueError, match="refused"):
            await t.run(fail)
        with pytest.raises(RuntimeError, match="StopIteration"):
            await t.run(stop)
        assert await t.run(lambda: "still here") == "still here"
    finally:
        t.shutdown()


async def test_cancelled_before_it_ran_is_skipped_and_while_it_runs_finishes() -> None:
    t = OneThread("store-test")
    started, release = threading.Event(), threading.Event()
    ran: list[str] = []

    def blocker() -> str:
        started.set()
        release.wait(10)
        ran.append("blocker")
        return "late"

    try:
        first = t.run(blocker)
        second = t.run(lambda: ran.append("second"))
        assert await asyncio.to_thread(started.wait, 10)
        first.cancel()   # running: it finishes, its answer dropped
        second.cancel()  # not started: skipped
        release.set()
        assert await t.run(lambda: ran.append("third")) is None
    finally:
        t.shutdown()
    assert ran == ["blocker", "third"]
    assert first.cancelled() and second.cancelled()


def test_shutdown_runs_what_was_handed_over_then_refuses() -> None:
    t = OneThread("store-test")
    ran: list[int] = []

    async def hand_over() -> list[asyncio.Future[None]]:
        return [t.run(lambda i=i: ran.append(i)) for i in range(50)]

    async def main() -> None:
        futs = await hand_over()
        t.shutdown(wait=True)
        assert ran == list(range(50))
        await asyncio.gather(*futs)
        with pytest.raises(RuntimeError, match="after shutdown"):
            t.run(lambda: None)

    asyncio.run(main())


def test_a_closed_loop_does_not_end_the_thread() -> None:
    """An answer for a loop that closed meanwhile is dropped; the next loop is served."""
    t = OneThread("store-test")
    gate = threading.Event()

    async def leave_one_behind() -> None:
        t.run(lambda: gate.wait(10))  # answered after this loop closed

    try:
        asyncio.run(leave_one_behind())
        gate.set()

        async def again() -> int:
            return await t.run(lambda: 7)

        assert asyncio.run(again()) == 7
    finally:
        t.shutdown()
