"""Tests of the daemon's heap sweeps (`sweep_heap`, `thaw_if_grown` in
`broker/daemon/assembly/daemon.py`): what survives a sweep is frozen out of the
collector's walks, garbage is freed, and a cycle frozen while alive is freed at the
latest by the thaw that growth (not the lease book's) triggers; and its trim
(`trim_heap`): freed C heap pages go back to the system."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from broker.daemon.assembly.daemon import (
    _MALLOC_TRIM,
    HEAP_SWEEP_SECONDS,
    HeapSweeper,
    heap_measure,
    sweep_heap,
    thaw_if_grown,
    trim_heap,
)


class Node:
    """A cyclic structure, like those a placement batch builds."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def thawed_after() -> Iterator[None]:
    """Each test starts from a heap with nothing frozen and leaves it so."""
    gc.unfreeze()
    gc.collect()
    yield
    gc.unfreeze()
    gc.collect()


def test_a_sweep_freezes_what_lives_and_frees_garbage() -> None:
    kept, dropped = Node(), Node()
    gone = weakref.ref(dropped)
    del dropped
    sweep_heap()
    assert gone() is None
    assert gc.get_freeze_count() > 0
    assert all(o is not kept for o in gc.get_objects())  # frozen: no collection walks it
    plain = [1.5, "x"]  # an acyclic object frozen and let go: freed by its reference count
    sweep_heap()
    frozen = gc.get_freeze_count()
    del plain
    assert gc.get_freeze_count() == frozen - 1


def test_a_cycle_frozen_while_alive_is_freed_by_the_thaw_growth_triggers() -> None:
    alive = Node()
    leaked = weakref.ref(alive)
    sweep_heap()
    base = heap_measure(0)
    del alive
    sweep_heap()
    assert thaw_if_grown(base, 0) == base  # no growth: no thaw, so still frozen
    assert leaked() is not None
    grown = [Node() for _ in range(base)]  # the frozen objects more than double
    sweep_heap()
    after = thaw_if_grown(base, 0)
    assert leaked() is None
    assert after >= len(grown)


def test_the_lease_books_growth_triggers_no_thaw() -> None:
    alive = Node()
    leaked = weakref.ref(alive)
    sweep_heap()
    base = heap_measure(0)
    del alive
    book = [Node() for _ in range(base)]  # the frozen objects more than double
    sweep_heap()
    assert thaw_if_grown(base, leases=len(book)) == base  # the book's: no thaw
    assert leaked() is not None
    thaw_if_grown(base, leases=0)
    assert leaked() is None



def test_the_sweeper_sweeps_at_most_once_a_period() -> None:
    """Called between every two batches and when idle, it sweeps at most every
    `HEAP_SWEEP_SECONDS`."""
    now = [1000.0]
    sweeper = HeapSweeper(lambda: 0, clock=lambda: now[0])
    sweeper()
    frozen = gc.get_freeze_count()
    made = [Node() for _ in range(100)]
    now[0] += HEAP_SWEEP_SECONDS / 2
    sweeper()  # within the period: nothing made since is frozen
    assert gc.get_freeze_count() == frozen
    now[0] += HEAP_SWEEP_SECONDS / 2
    sweeper()
    assert gc.get_freeze_count() >= frozen + len(made)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.skipif(_MALLOC_TRIM is None,
                    reason="the C library has no malloc_trim (not glibc)")
def test_a_trim_gives_freed_heap_pages_back() -> None:
    """Memory freed inside the C heap stays in the RSS until trimmed: 64 KiB buffers
    (from the heap, below glibc's mmap threshold), every other one freed, so that each
    freed one lies between two that stay: neither merged into the heap's top nor left
    to glibc's own trimming, whatever the heap held before."""
    trim_heap()  # what earlier tests left free is given back first
    bufs = [bytearray(64 * 1024) for _ in range(1000)]  # zero-filled: every page resident
    kept = bufs[::2]
    del bufs
    gc.collect()
    before = _rss_mib()
    assert trim_heap() is True
    after = _rss_mib()
    assert before - after > 20, (before, after)  # about 31 MiB freed
    assert len(kept) == 500
