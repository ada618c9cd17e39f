"""What an owner on the event loop lends to readers in worker threads (`Loans`): the
pool's lists by GPU and holdings, the cost index's lists. One discipline for both."""

from __future__ import annotations

from collections.abc import Hashable, Iterable


class Loans:
    """The parts an owner lent (`lend`), and the readers that hold them (`borrow`,
    `returned`). A lent part is copied by its owner before its next change
    (`take_back` says so), for as long as any reader is out; once every one has
    returned, nothing is lent and changes are made in place. A reader that never
    returns (one whose thread may still read) keeps every later loan copied first."""

    __slots__ = ("_borrowers", "_lent")

    def __init__(self) -> None:
        self._lent: set[Hashable] = set()
        self._borrowers = 0

    @property
    def out(self) -> bool:
        """Whether a reader that borrowed has not returned yet."""
        return self._borrowers > 0

    def borrow(self) -> None:
        """A reader in a worker thread is to read what is lent next, until `returned`."""
        self._borrowers += 1

    def returned(self) -> None:
        """A reader is done; once none is out, nothing is lent."""
        self._borrowers -= 1
        if self._borrowers == 0:
            self._lent.clear()

    def lend(self, parts: Iterable[Hashable]) -> None:
        self._lent.update(parts)

    def take_back(self, part: Hashable) -> bool:
        """Whether `part` is lent: the owner copies it before changing it (the copy is
        its own from then on, not lent)."""
        if part in self._lent:
            self._lent.discard(part)
            return True
        return False

    def forget(self) -> None:
        """The owner dropped every part (made anew when next asked for): none is lent."""
        self._lent.clear()
