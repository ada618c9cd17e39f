"""Keeping a command's stdout for its report.

Native libraries may write to file descriptor 1 directly, past `sys.stdout`: HiGHS
(highspy, used by `broker.solver`) once printed
`HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();` from C++ in
the middle of a `gpubroker backtest --format json`, which then was no valid JSON; its
Python-level `output_flag` being off does not reach such lines. A command whose stdout
is a machine-readable report computes inside `stdout_to_stderr()` and writes the report
after it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress


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
