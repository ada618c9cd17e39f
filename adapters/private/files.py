"""A file read again only when it changed, for the files the ops team edits while the
daemon runs (the servers file, a health file)."""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from gpubroker_client import files

RACY_NS = 2_000_000_000
"""A file read less than this long after its last modification is read again at the
next check even when its stat looks the same: the kernel stamps modifications with a
coarse clock, so a write in the same tick as the read, of the same size, would leave the
stat as it was ("racily clean", as git calls it)."""


@dataclass(frozen=True, slots=True)
class _Stat:
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int


class WatchedFile:
    """`path`, at most `max_bytes` of it (a file over the bound is refused unread)."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._stat: _Stat | None = None
        self._read_at_ns = 0
        self._digest: str | None = None

    def read(self) -> bytes:
        """The file's content now, read by `gpubroker_client.files.read_bytes` (a regular file, at
        most `max_bytes`; raises `OSError`, `FileRefused` for a FIFO, a device or a file
        over the bound); remembered as the last content."""
        st = os.stat(self.path)
        raw = files.read_bytes(self.path, self.max_bytes)
        self._stat = _Stat(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        self._read_at_ns = time.time_ns()
        self._digest = hashlib.sha256(raw).hexdigest()
        return raw

    def changed(self) -> bytes | None:
        """The file's content when it differs from the last content read, else None.
        Only a stat when the file's stat is as it was (and it was not racily read).
        Raises `OSError` (`FileNotFoundError` for a file that is gone); after that, the
        next content read counts as changed, whatever it is (the file is back)."""
        try:
            st = os.stat(self.path)
            now = _Stat(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            racy = self._read_at_ns - max(now.mtime_ns, now.ctime_ns) < RACY_NS
            if now == self._stat and not racy:
                return None
            digest = self._digest
            raw = self.read()
        except OSError:
            self._stat, self._digest = None, None
            raise
        return None if self._digest == digest else raw
