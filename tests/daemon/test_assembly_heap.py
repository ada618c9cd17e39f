"""Tests of the daemon's heap sweeps (`sweep_heap` in `broker/daemon/assembly/daemon.py`):
what survives a sweep is frozen out of the collector's walks, garbage is freed, and a
cycle frozen while alive is freed at the latest by the thaw that growth triggers."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from broker.daemon.assembly.daemon import HEAP_THAW_GROWTH, sweep_heap


class Node:
    """A cyclic structure, like those a placement batch builds."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def thawed_after() -> Iterator[None]:
    """Each test starts from a heap with nothing frozen and leaves it so."""
    gc.unfreeze()
    gc.collect()
    yield
    gc.unfreeze()
    gc.collect()


@pytest.mark.usefixtures("thawed_after")
def test_a_sweep_freezes_what_lives_and_frees_garbage() -> None:
    kept, dropped = Node(), Node()
    gone = weakref.ref(dropped)
    del dropped
    thawed = sweep_heap(gc.get_freeze_count() * 2 + 10)  # far from a thaw
    assert gone() is None
    assert gc.get_freeze_count() > 0
    assert all(o is not kept for o in gc.get_objects())  # frozen: no collection walks it
    plain = [1.5, "x"]  # an acyclic object frozen and let go: freed by its reference count
    sweep_heap(thawed)
    frozen = gc.get_freeze_count()
    del plain
    assert gc.get_freeze_count() == frozen - 1


@pytest.mark.usefixtures("thawed_after")
def test_a_cycle_frozen_while_alive_is_freed_by_the_thaw_growth_triggers() -> None:
    alive = Node()
    leaked = weakref.ref(alive)
    sweep_heap(gc.get_freeze_count() * 2 + 10)
    base = gc.get_freeze_count()
    del alive
    assert sweep_heap(base) == base  # below the growth: frozen, so not found
    assert leaked() is not None
    grown = [Node() for _ in range(int(base * (HEAP_THAW_GROWTH - 1)) + 10)]
    after = sweep_heap(sweep_heap(base))  # the first freezes them, the second thaws
    assert leaked() is None
    assert after >= len(grown)


@pytest.mark.usefixtures("thawed_after")
def test_the_lease_books_growth_triggers_no_thaw() -> None:
    alive = Node()
    leaked = weakref.ref(alive)
    sweep_heap(gc.get_freeze_count() * 2 + 10)
    base = gc.get_freeze_count()
    del alive
    book = [Node() for _ in range(base)]  # the frozen objects more than doubled
    sweep_heap(base)
    assert sweep_heap(base, leases=len(book)) == base  # the book's: no thaw
    assert leaked() is not None
    sweep_heap(base, leases=0)
    assert leaked() is None
