"""The stores' thread: the event loop's CPU per round trip, `OneThread` against the
`ThreadPoolExecutor` of one worker (`run_in_executor`) it replaced, side by side.

    python bench/store_thread.py [--n 20000] [--rounds 3]

Two workloads, each awaited one after another from the loop as the daemon's commits
are: an empty function (the hand-over and the answer alone), and an SQLite commit of
one row into a WAL file with `synchronous=FULL` (the daemon's settings). CPU is the
loop's thread only (`time.thread_time`); the worker's own time is not in it. Rounds
alternate the two; the median of the rounds is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.state.thread import OneThread


async def measure(submit: Callable[[Callable[[], Any]], Awaitable[Any]],
                  fn: Callable[[], Any], n: int) -> tuple[float, float]:
    """(loop CPU µs, wall µs) per round trip."""
    for _ in range(min(n, 200)):  # warm
        await submit(fn)
    cpu, wall = time.thread_time(), time.perf_counter()
    for _ in range(n):
        await submit(fn)
    return (1e6 * (time.thread_time() - cpu) / n, 1e6 * (time.perf_counter() - wall) / n)


async def main_async(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    with tempfile.TemporaryDirectory(prefix="gpubroker-bench-thread-") as d:
        db = sqlite3.connect(Path(d) / "s.db", isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, body BLOB)")
        body = b"x" * 400

        def commit() -> None:
            db.execute("BEGIN IMMEDIATE")
            db.execute("INSERT INTO t (body) VALUES (?)", (body,))
            db.execute("COMMIT")

        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-executor")
        one = OneThread("bench-one-thread")
        ways: dict[str, Callable[[Callable[[], Any]], Awaitable[Any]]] = {
            "ThreadPoolExecutor": lambda fn: loop.run_in_executor(executor, fn),
            "OneThread": one.run,
        }
        work = {"empty function": (lambda: None, args.n),
                "SQLite commit, FULL": (commit, max(1, args.n // 10))}
        print(f"loop CPU and wall time per round trip, µs; median of {args.rounds} "
              f"alternated rounds")
        print(f"{'work':<22}{'way':<20}{'loop CPU':>10}{'wall':>10}")
        try:
            for name, (fn, n) in work.items():
                got: dict[str, list[tuple[float, float]]] = {w: [] for w in ways}
                for _ in range(args.rounds):
                    for way, submit in ways.items():
                        got[way].append(await measure(submit, fn, n))
                for way, runs in got.items():
                    cpu = statistics.median(c for c, _ in runs)
                    wall = statistics.median(w for _, w in runs)
                    print(f"{name:<22}{way:<20}{cpu:>10.1f}{wall:>10.1f}")
        finally:
            executor.shutdown(wait=True)
            one.shutdown(wait=True)
            db.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=20_000, help="round trips per round")
    p.add_argument("--rounds", type=int, default=3)
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
