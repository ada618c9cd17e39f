"""What a command writes: its stdout kept for its report, and user text made safe to echo.

Native libraries may write to file descriptor 1 directly, past `sys.stdout`: HiGHS
(highspy, used by `broker.placement.solver`) once printed
`HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();` from C++ in
the middle of a `gpubroker backtest --format json`, which then was no valid JSON; its
Python-level `output_flag` being off does not reach such lines. A command whose stdout
is a machine-readable report computes inside `stdout_to_stderr()` and writes the report
after it.

Error messages echo what the user gave (file names, YAML keys, hosts, cells of a
trace); `printable` escapes the control characters in them, so that a file named with a
terminal escape sequence cannot recolour, move or clear the user's terminal, and an
embedded newline cannot split one error into two lines.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress

ECHO_MAX_CHARS = 200
"""The longest piece of user text `printable` echoes whole; a longer one is cut there,
with `…(N chars)` after it, so that a megabyte argument is not a megabyte error line."""

_CONTROLS = {c: repr(chr(c))[1:-1] for c in (*range(0x20), *range(0x7F, 0xA0))}
"""Every C0 control (ESC among them), DEL and every C1 control → its escape as `repr`
writes it (`\\x1b`, `\\n`, `\\x9b`)."""


def printable(text: object, limit: int | None = None) -> str:
    """`text` (or `str(text)`) with its control characters escaped as `repr` escapes
    them, everything else as it is (backslashes too, so a message that already holds
    a `repr` is unchanged). With `limit`, text longer than that is cut there. Used for
    every error line that echoes user input (`policies.yamlsrc.Problem`, the trace and
    workload readers, the command line's own messages)."""
    s = str(text)
    if limit is not None and len(s) > limit:
        s = f"{s[:limit]}…({len(s)} chars)"
    return s.translate(_CONTROLS)


@contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """While inside, file descriptor 1 is a duplicate of descriptor 2: whatever is
    written to stdout, by Python (`sys.stdout`, flushed on the way in and out) or by
    native code (`write(1, …)`), goes to stderr. The real stdout is restored on the way
    out, also when the block raises. Without an open descriptor 1 or 2, nothing is
    redirected."""
    with suppress(OSError, ValueError):  # a closed or broken stdout: the report says so
        sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:
        yield
        return
    try:
        os.dup2(2, 1)
    except OSError:
        os.close(saved)
        yield
        return
    try:
        yield
    finally:
        try:
            with suppress(OSError, ValueError):
                sys.stdout.flush()  # what Python wrote inside goes where fd 1 points now
        finally:
            os.dup2(saved, 1)
            os.close(saved)
