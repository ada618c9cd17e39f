"""What the cloud poll benches (`bench/<cloud>_poll.py`) share: timing the adapter's
SDK methods, one timed poll of every region, the medians of the runs and the table.

Each bench keeps its own fake, its chains and its critical path (how the chains depend
on each other is the cloud's), its command line and its extra columns.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any


class Timings:
    """Durations of each chain (one SDK method call: all its pages, retries included),
    by location: a method's first argument (the region or zone), else ``"global"``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by: dict[tuple[str, str], list[float]] = defaultdict(list)

    def add(self, name: str, where: str, seconds: float) -> None:
        with self.lock:
            self.by[(name, where)].append(seconds)

    def wrap(self, sdk: Any, names: Iterable[str]) -> None:
        """Time every call of the blocking methods `names` of `sdk`."""
        for name in names:
            fn = getattr(sdk, name)

            def timed(*args: Any, _fn: Callable[..., Any] = fn, _name: str = name) -> Any:
                t = time.perf_counter()
                try:
                    return _fn(*args)
                finally:
                    self.add(_name, str(args[0]) if args else "global",
                             time.perf_counter() - t)

            setattr(sdk, name, timed)

    def wrap_async(self, obj: Any, method: str, name: str) -> None:
        """Time every call of the coroutine method `method` of `obj`, as chain `name`."""
        fn: Callable[..., Awaitable[Any]] = getattr(obj, method)

        async def timed(*args: Any) -> Any:
            t = time.perf_counter()
            try:
                return await fn(*args)
            finally:
                self.add(name, str(args[0]) if args else "global", time.perf_counter() - t)

        setattr(obj, method, timed)

    def longest(self, name: str, where: str = "global") -> float:
        """The longest call of chain `name` at `where` (0 if there was none)."""
        return max(self.by.get((name, where), [0.0]))


async def one_poll(adapter: Any, regions: Sequence[str]) -> float:
    """Poll every region at once; the wall time in seconds."""
    t = time.perf_counter()
    results = await asyncio.gather(*(adapter.poll(r) for r in regions))
    assert all(results), "a region returned no offers"
    return time.perf_counter() - t


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the runs."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def print_table(out: dict[str, Any], extra_header: str,
                extra_row: Callable[[dict[str, Any]], str]) -> None:
    """One row per run and one for the medians: wall time, critical path, their ratio,
    the calls of the first and of a steady-state poll, then the bench's own columns
    (`extra_header`, and `extra_row` of a run, each starting with a space)."""
    print(f"{'run':>4} {'wall s':>8} {'critical s':>11} {'ratio':>6} {'calls 1st':>10} "
          f"{'calls steady':>13}{extra_header}")
    rows = [(str(i), r) for i, r in enumerate(out["runs"], 1)] + [("med", out["median"])]
    for label, r in rows:
        print(f"{label:>4} {r['wall_s']:8.2f} {r['critical_s']:11.2f} {r['ratio']:6.2f} "
              f"{r['calls_first']:10.0f} {r['calls_steady']:13.0f}{extra_row(r)}")
