"""`broker.output.stdio.stdout_to_stderr`: native writes to fd 1 stay out of a command's report.
Real processes, since it rewires the process's own file descriptors."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap


def python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=60, check=False)


def test_writes_to_fd_1_inside_go_to_stderr_and_the_report_to_stdout() -> None:
    out = python("""
        import os, sys
        from broker.output.stdio import stdout_to_stderr
        print("before", flush=True)
        with stdout_to_stderr():
            os.write(1, b"noise from C++\\n")
            print("python noise")
        sys.stdout.write("report\\n")
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "before\nreport\n"
    assert "noise from C++\n" in out.stderr and "python noise\n" in out.stderr


def test_stdout_is_restored_when_the_block_raises() -> None:
    out = python("""
        import os
        from broker.output.stdio import stdout_to_stderr
        try:
            with stdout_to_stderr():
                os.write(1, b"noise\\n")
                raise RuntimeError("boom")
        except RuntimeError:
            pass
        os.write(1, b"report\\n")
        with stdout_to_stderr():  # and again, after that
            os.write(1, b"more noise\\n")
        os.write(1, b"end\\n")
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "report\nend\n"
    assert out.stderr == "noise\nmore noise\n"


def test_backtest_json_on_stdout_is_the_report_alone() -> None:
    # the placement solver (HiGHS) runs in this process, behind the redirection; fd 1
    # is the report's only, so stdout is exactly one JSON document
    out = subprocess.run([sys.executable, "-m", "broker.cli", "backtest", "--market",
                          "sim:6h:2:1", "--workload", "gen:40", "--format", "json"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert out.stdout == json.dumps(report, indent=2) + "\n"
    assert "simulated hours per second" in out.stderr


def test_a_native_write_during_the_backtest_stays_out_of_its_json() -> None:
    # HiGHS's stray line, written to fd 1 while each run computes
    out = python("""
        import os, sys
        from broker.backtest import compare
        real = compare.compare
        def noisy(*args, **kw):
            os.write(1, b"HighsMipSolverData::transformNewIntegerFeasibleSolution "
                        b"tmpSolver.run();\\n")
            return real(*args, **kw)
        compare.compare = noisy
        from broker.cli.main import main
        sys.exit(main(["backtest", "--market", "sim:2h:2:1", "--workload", "gen:10",
                       "--seeds", "2", "--format", "json"]))
    """)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["summary"]["seeds"] == 2
    assert out.stderr.count("tmpSolver.run();") == 2
