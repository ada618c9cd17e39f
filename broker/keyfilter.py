"""A Bloom filter of the (scheduler, request_id) keys the state store holds.

Every placement request that the lease book does not know is looked up in the store, in
case it repeats a request whose lease ended long ago (the answer must be that lease).
Almost every such request is new: the filter says so without the round trip to the
store's thread. It may say "maybe" for a key it never saw (about 1 % of new keys at its
capacity); then the store is asked, as without it. It never says "no" for a key it saw.

Filled once from the store at start-up, then with every lease the broker creates. Past
its capacity the false positives grow, so it stops answering (`full`): every unknown
key is looked up again, and the next start sizes it for the store it finds.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable

BITS_PER_KEY = 10  # with 7 hashes: about 1 % false positives at capacity
HASHES = 7
MIN_CAPACITY = 1 << 20


class KeyFilter:
    def __init__(self, capacity: int = MIN_CAPACITY) -> None:
        self.capacity = max(1, capacity)
        self._m = self.capacity * BITS_PER_KEY
        self._bits = bytearray(math.ceil(self._m / 8))
        self.count = 0

    @classmethod
    def sized_for(cls, stored: int) -> KeyFilter:
        """Room for the keys stored now, twice over (at least `MIN_CAPACITY`)."""
        return cls(max(MIN_CAPACITY, 2 * stored))

    @property
    def full(self) -> bool:
        return self.count > self.capacity

    def _slots(self, scheduler: str, request_id: str) -> Iterable[int]:
        digest = hashlib.blake2b(f"{scheduler}\0{request_id}".encode(),
                                 digest_size=16).digest()
        h1 = int.from_bytes(digest[:8], "little")
        h2 = int.from_bytes(digest[8:], "little") | 1
        m = self._m
        return ((h1 + i * h2) % m for i in range(HASHES))

    def add(self, scheduler: str, request_id: str) -> None:
        bits = self._bits
        for s in self._slots(scheduler, request_id):
            bits[s >> 3] |= 1 << (s & 7)
        self.count += 1

    def may_hold(self, scheduler: str, request_id: str) -> bool:
        """False: the key was never added. True: it may have been (or the filter is
        full and answers nothing)."""
        if self.full:
            return True
        bits = self._bits
        return all(bits[s >> 3] & (1 << (s & 7)) for s in self._slots(scheduler, request_id))
