"""The one way gpubroker reads a file an operator gives it: the daemon configuration, the
policy file, the private servers file, the health files and the secret files
(`http.token_file`, `mqtt.password_file`, `mqtt.standby_password_file`,
`state.password_file`).

Each of them is edited by people, sometimes while the daemon runs, so each is read as
hostile: only a regular file (a symlink to one is fine) — a FIFO would block the reader
for ever and `/dev/zero` would fill memory —, at most a stated number of bytes, and
strict UTF-8 (one leading byte order mark is allowed and dropped, as editors on Windows
write it). Every refusal is a `FileRefused`, an `OSError` whose `strerror` is one line
saying why, so that code which already handles an unreadable file handles these too.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

__all__ = ["MAX_CA_BYTES", "MAX_SECRET_BYTES", "MAX_YAML_BYTES", "FileRefused", "decode",
           "read_bytes", "read_secret", "read_text", "size_text"]

MAX_YAML_BYTES = 1 << 20
"""A YAML file (configuration, policy, servers, health) larger than 1 MiB is refused."""
MAX_SECRET_BYTES = 64 << 10
"""A secret file (a token, a password) larger than 64 KiB is refused."""
MAX_CA_BYTES = 4 << 20
"""A CA certificate bundle (`mqtt.ca_file`) larger than 4 MiB is refused (a system
bundle of every public CA is about 200 KiB)."""

_CHUNK = 1 << 16
_BOM = "\ufeff"


class FileRefused(OSError):
    """A file that is not read: not a regular file, too large, or not UTF-8 text.

    `identity` is what the file was when refused (device, inode, size, modification
    time), so that a caller reporting a refusal once per change can tell a new one from
    the same; `line` and `column` (1-based) say where text that is not UTF-8 starts."""

    def __init__(self, path: Path | str, why: str, code: int = errno.EINVAL, *,
                 identity: tuple[int, ...] | None = None, line: int | None = None,
                 column: int | None = None) -> None:
        super().__init__(code, why, str(path))
        self.identity = identity
        self.line = line
        self.column = column


def size_text(n: int) -> str:
    """`1 MiB (1048576 bytes)`: the bound in words, and exactly."""
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit} ({n} bytes)"
    return f"{n} bytes"


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a file"


def read_bytes(path: Path, limit: int) -> bytes:
    """The content of the regular file at `path`, at most `limit` bytes.

    Opened non-blocking, so that opening a FIFO returns at once (and is then refused),
    and without becoming a controlling terminal; the type is checked on the open file
    (`fstat`), so a file swapped between a check and the open cannot slip through.
    Raises `FileRefused` (not a regular file, larger than `limit`) or the `OSError` of
    the open (no such file, permission denied)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if stat.S_ISDIR(st.st_mode):
            raise FileRefused(path, os.strerror(errno.EISDIR), errno.EISDIR,
                              identity=identity)
        if not stat.S_ISREG(st.st_mode):
            raise FileRefused(path, f"not a regular file ({_kind(st.st_mode)})",
                              identity=identity)
        if st.st_size > limit:  # told before reading any of it
            raise FileRefused(path, f"larger than {size_text(limit)}; not read", errno.EFBIG,
                              identity=identity)
        chunks: list[bytes] = []
        size = 0
        while size <= limit:  # a file that grows while read is still cut at the bound
            chunk = os.read(fd, min(_CHUNK, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise FileRefused(path, f"larger than {size_text(limit)}; not read", errno.EFBIG,
                              identity=identity)
        return b"".join(chunks)
    finally:
        os.close(fd)


def decode(raw: bytes, path: Path | str = "") -> str:
    """`raw` as strict UTF-8 text, one leading byte order mark dropped. Raises
    `FileRefused` saying where the first byte that is not UTF-8 is."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        head = raw[:exc.start]
        line = head.count(b"\n") + 1
        column = len(head) - (head.rfind(b"\n") + 1) + 1
        raise FileRefused(path, f"not UTF-8 text: {exc.reason} (byte {exc.start + 1}, line "
                          f"{line})", errno.EILSEQ, line=line, column=column) from None
    return text.removeprefix(_BOM)


def read_text(path: Path, limit: int = MAX_YAML_BYTES) -> str:
    """The regular file at `path` as text: at most `limit` bytes, strict UTF-8."""
    return decode(read_bytes(path, limit), path)


def read_secret(path: Path) -> str:
    """A secret file (a token, a password): its text without surrounding white space, at
    most `MAX_SECRET_BYTES`. Raises `OSError` (`FileRefused` for what is refused)."""
    return read_text(path, MAX_SECRET_BYTES).strip()
