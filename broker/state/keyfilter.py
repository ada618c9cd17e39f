"""A Bloom filter of the (scheduler, request_id) keys the state store holds.

Every placement request that the lease book does not know is looked up in the store, in
case it repeats a request whose lease ended long ago (the answer must be that lease).
Almost every such request is new: the filter says so without the round trip to the
store's thread. It may say "maybe" for a key it never saw (about 1 % of new keys at its
capacity); then the store is asked, as without it. It never says "no" for a key it saw.

Filled once from the store at start-up, then with every lease the broker creates. Past
its capacity the false positives grow, so it stops answering (`full`): every unknown
key is looked up again, and the next start sizes it for the store it finds.

The filter itself is rbloom's (keys hashed with Python's `hash`, salted per process:
the filter lives in memory only).
"""

from __future__ import annotations

from rbloom import Bloom

FALSE_POSITIVES = 0.01
MIN_CAPACITY = 1 << 20


class KeyFilter:
    def __init__(self, capacity: int = MIN_CAPACITY) -> None:
        self.capacity = max(1, capacity)
        self._bloom = Bloom(self.capacity, FALSE_POSITIVES)
        self.count = 0

    @classmethod
    def sized_for(cls, stored: int) -> KeyFilter:
        """Room for the keys stored now, twice over (at least `MIN_CAPACITY`)."""
        return cls(max(MIN_CAPACITY, 2 * stored))

    @property
    def full(self) -> bool:
        return self.count > self.capacity

    def add(self, scheduler: str, request_id: str) -> None:
        self._bloom.add((scheduler, request_id))
        self.count += 1

    def may_hold(self, scheduler: str, request_id: str) -> bool:
        """False: the key was never added. True: it may have been (or the filter is
        full and answers nothing)."""
        return self.full or (scheduler, request_id) in self._bloom
