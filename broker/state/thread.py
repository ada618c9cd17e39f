"""`OneThread`: one thread that runs the functions handed to it, in order, each answered
on the event loop that handed it over.

The stores run every database operation on one thread of their own. A
`ThreadPoolExecutor` of one worker did that through `run_in_executor`: per operation a
work item and a `concurrent.futures.Future` chained to the asyncio one, and the pool's
idle semaphore taken on each submit, its condition contended with the worker thread
for the GIL. Under 500 requests a second that path held 4 % of the event loop's samples
(py-spy). A round trip costs the loop 20–40 µs of CPU less this way
(`bench/store_thread.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_Item = tuple[Callable[[], Any], asyncio.AbstractEventLoop, "asyncio.Future[Any]"]


class OneThread:
    """Runs `fn()`s on one thread of its own, first handed first run; `run` returns an
    asyncio future settled with each one's result or exception.

    A future cancelled before its function started is skipped (as an executor's work
    item is). One cancelled while its function runs does not stop it: the function's
    effects stand, and its result is dropped. The thread is a daemon: a process that ends
    without `shutdown` (a crash path) is not held up by it."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def run(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Hand `fn` to the thread; the future it returns is settled on the running loop.
        RuntimeError after `shutdown`."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name}: cannot run anything after shutdown")
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self._name,
                                                daemon=True)
                self._thread.start()
            self._queue.put((fn, loop, fut))
        return fut

    def shutdown(self, wait: bool = True) -> None:
        """Run what was handed over, then end the thread; with `wait`, return once it
        ended. Nothing more may be handed over."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._queue.put(None)
            thread = self._thread
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()

    def _work(self) -> None:
        get = self._queue.get
        while (item := get()) is not None:
            fn, loop, fut = item
            del item
            if fut.cancelled():  # read across threads: as racy as an executor's check
                continue
            try:
                result, error = fn(), None
            except BaseException as exc:  # handed to the waiter, as an executor does
                result, error = None, exc
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits
                loop.call_soon_threadsafe(_settle, fut, result, error)
            del fn, loop, fut, result, error


def _settle(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if fut.done():  # cancelled while its function ran
        return
    if error is None:
        fut.set_result(result)
    elif isinstance(error, StopIteration):  # a future cannot hold one (PEP 479)
        fut.set_exception(RuntimeError(f"StopIteration raised on the store's thread: {error!r}"))
    else:
        fut.set_exception(error)
