"""Every file an operator gives the daemon, read as hostile (#27): the policy file, the
daemon configuration, the private servers file and the secret files.

One corpus of hostile files goes through every reader: each command that takes a file
(exit 2, one line per problem naming the file, never a traceback), a running daemon's
policy reload (kept alive, the last good policy in force, `policy.rejected` once per
change, memory bounded) and the private adapter's servers-file reload (the last good
file kept, logged once per change).
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import structlog
import yaml
from daemon_helpers import PREFIX, StartDaemon
from mqtt_helpers import Mosquitto, ProbeFactory, free_port, payload_json
from structlog.testing import capture_logs

from adapters.private.adapter import PrivateAdapter
from broker.cli.main import main
from gpubroker_client import files
from policies.loader import load_policy

GOOD_POLICY = "version: 1\nteams:\n  ml: {max_gpus: 8}\n"
GOOD_CONFIG = "site: lab\nhttp: {listen: null}\n"
GOOD_SERVERS = """\
version: 1
sites:
  fra1: {residency: [eu]}
groups:
  - {name: pod, site: fra1, gpu: L4, gpus: 4, servers: [gpu-1, gpu-2],
     price_per_gpu_hour: 0.5}
"""

DEEP = 10_000
BOMB = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n"
    for p, c in zip("abcdefgh", "bcdefghi", strict=True))

# Hostile content, appended to a valid file of each kind (so that the file is otherwise
# right and only the hostile part is at fault).
CONTENT: dict[str, bytes] = {
    "bad-date": b"x: 2024-13-45\n",
    "bad-time": b"x: 2024-01-01 25:00:00\n",
    "unknown-tag": b"x: !foo a\n",
    "python-tag": b"x: !!python/object/apply:os.system ['true']\n",
    "int-5000-digits": b"x: " + b"9" * 5000 + b"\n",
    "bad-float-tag": b"x: !!float abc\n",
    "complex-key": b"? [a, b]\n: c\n",
    "flow-map-10k-deep": b"x: " + b"{a: " * DEEP + b"1" + b"}" * DEEP + b"\n",
    "flow-seq-10k-deep": b"x: " + b"[" * DEEP + b"]" * DEEP + b"\n",
    "block-40-deep": b"x:\n" + b"".join(b"  " * i + b"k:\n" for i in range(1, 41))
                     + b"  " * 41 + b"1\n",
    "alias-bomb": BOMB.encode(),
    "control-char": b"x: a\x01b\n",
    "nul-byte": b"x: a\x00b\n",
    "not-utf8": b"x: caf\xe9\n",
    "duplicate-key": b"x: 1\nx: 2\n",
    "two-documents": b"---\nx: 1\n",
    "unterminated-quote": b"x: 'abc\n",
    "bad-merge": b"x: {<<: 1}\n",
}
SPECIAL = ("empty", "oversized", "directory", "fifo", "dev-zero-link", "dangling-link")
CORPUS = (*CONTENT, *SPECIAL)


def make(path: Path, case: str, base: str, limit: int = files.MAX_YAML_BYTES) -> Path:
    """`path` made into the hostile file `case` (replacing whatever was there)."""
    if path.is_dir() and not path.is_symlink():
        (path / "inside").unlink(missing_ok=True)
        path.rmdir()
    elif path.is_symlink() or path.exists():  # a file, a FIFO, a link
        path.unlink()
    if case == "good":
        path.write_text(base)
    elif case in CONTENT:
        path.write_bytes(base.encode() + CONTENT[case])
    elif case == "empty":
        path.write_bytes(b"")
    elif case == "oversized":
        path.write_bytes(base.encode() + b"#" * limit)
    elif case == "directory":
        path.mkdir()
        (path / "inside").write_text(base)
    elif case == "fifo":
        os.mkfifo(path)
    elif case == "dev-zero-link":
        path.symlink_to("/dev/zero")
    elif case == "dangling-link":
        path.symlink_to(path.parent / "nowhere")
    else:
        raise AssertionError(case)
    return path


def run_cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, list[str]]:
    """`gpubroker ARGS` in this process (its real entry point): exit code, stderr lines.
    `run` points the logs at the captured stdout: put them back as they were after."""
    saved = structlog.get_config()
    try:
        code = main([str(a) for a in args])
    finally:
        structlog.configure(**saved)
    return code, capsys.readouterr().err.splitlines()


# --- at start: every command that takes a file ---------------------------------------


def _commands(tmp: Path, case: str) -> dict[str, tuple[list[str | Path], Path]]:
    """Each command, with the hostile file it is given, for `case`."""
    good_policy = tmp / "good-policy.yaml"
    good_policy.write_text(GOOD_POLICY)
    out: dict[str, tuple[list[str | Path], Path]] = {}
    p = make(tmp / "policy.yaml", case, GOOD_POLICY)
    out["policy check"] = (["policy", "check", p], p)
    out["policy diff"] = (["policy", "diff", good_policy, p], p)
    s = make(tmp / "servers.yaml", case, GOOD_SERVERS)
    out["private check"] = (["private", "check", s], s)
    if case != "empty":  # an empty configuration is every default: a valid one
        c = make(tmp / "config.yaml", case, GOOD_CONFIG)
        out["run --config"] = (["run", "--config", c], c)
        out["history --config"] = (["history", "--config", c], c)
    cfg = tmp / "run.yaml"
    cfg.write_text(GOOD_CONFIG + f"state: {{path: '{tmp / 'state.db'}'}}\n"
                   f"policy_file: '{p}'\nclouds: {{sim: {{regions_per_cloud: 1}}}}\n")
    out["run (policy_file)"] = (["run", "--config", cfg], p)
    if case in SPECIAL or case == "not-utf8":  # a secret is any text: only these apply
        t = make(tmp / "token", case, "s3cret\n", files.MAX_SECRET_BYTES)
        if case != "empty":  # an empty token file: placing over HTTP stays off
            tcfg = tmp / "token.yaml"
            tcfg.write_text(GOOD_CONFIG + f"state: {{path: '{tmp / 'state.db'}'}}\n"
                            f"http: {{listen: null, token_file: '{t}'}}\n"
                            "clouds: {sim: {regions_per_cloud: 1}}\n")
            out["run (http.token_file)"] = (["run", "--config", tcfg], t)
        m = make(tmp / "mqtt-password", case, "s3cret\n", files.MAX_SECRET_BYTES)
        mcfg = tmp / "mqtt.yaml"
        mcfg.write_text(GOOD_CONFIG + f"state: {{path: '{tmp / 'state.db'}'}}\n"
                        f"mqtt: {{username: u, password_file: '{m}'}}\n"
                        "clouds: {sim: {regions_per_cloud: 1}}\n")
        if case != "empty":
            out["run (mqtt.password_file)"] = (["run", "--config", mcfg], m)
    return out


@pytest.mark.parametrize("case", CORPUS)
def test_every_command_refuses_a_hostile_file_in_one_line(
        case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name, (args, hostile) in _commands(tmp_path, case).items():
        started = time.monotonic()
        code, lines = run_cli(capsys, *args)
        assert code == 2, (name, lines)
        assert lines, name
        assert all(line.startswith(f"gpubroker: {hostile}") for line in lines), (name, lines)
        assert not any("Traceback" in line for line in lines), name
        assert time.monotonic() - started < 10, name


@pytest.mark.parametrize(("case", "message"), [
    ("bad-date", "policy.yaml:4:4: x: cannot read this value: month must be in 1..12"),
    ("int-5000-digits", "policy.yaml:4:4: x: cannot read this value: an integer of more "
                        "than 4300 digits"),
    ("unknown-tag", "policy.yaml:4:4: invalid YAML: could not determine a constructor for "
                    "the tag '!foo'"),
    ("complex-key", "policy.yaml:4:3: a key must be plain text, not a list or a mapping"),
    ("flow-map-10k-deep", "policy.yaml:4:132: x.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a"
                          ".a.a.a.a.a.a.a.a.a.a: nested too deeply (at most 32 levels)"),
    ("control-char", "policy.yaml:4:5: invalid YAML: special characters are not allowed "
                     "(character U+0001)"),
    ("not-utf8", "policy.yaml:4:7: not UTF-8 text: invalid continuation byte (byte 45, "
                 "line 4)"),
    ("oversized", "policy.yaml: larger than 1 MiB (1048576 bytes); not read"),
    ("fifo", "policy.yaml: cannot read: not a regular file (a FIFO)"),
    ("dev-zero-link", "policy.yaml: cannot read: not a regular file (a character device)"),
    ("directory", "policy.yaml: cannot read: Is a directory"),
])
def test_the_line_names_file_line_and_key(case: str, message: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = make(tmp_path / "policy.yaml", case, GOOD_POLICY)
    assert run_cli(capsys, "policy", "check", path) == (2, [f"gpubroker: {tmp_path}/{message}"])


def test_a_byte_order_mark_is_allowed_everywhere(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """One leading BOM (as Windows editors write) is dropped by the one reader: the same
    file is good at start, in `policy check` and on a reload (`parse_policy_bytes`)."""
    path = tmp_path / "policy.yaml"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD_POLICY.encode())
    assert run_cli(capsys, "policy", "check", path)[0] == 0
    assert set(load_policy(path).teams) == {"ml"}
    token = tmp_path / "token"
    token.write_bytes(b"\xef\xbb\xbfs3cret\n")
    assert files.read_secret(token) == "s3cret"


def test_a_fifo_is_refused_by_a_real_process_without_hanging(tmp_path: Path) -> None:
    fifo = make(tmp_path / "policy.yaml", "fifo", "")
    for args in (["policy", "check", fifo], ["private", "check", fifo],
                 ["run", "--config", fifo]):
        r = subprocess.run([sys.executable, "-m", "broker.cli", *map(str, args)],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr == f"gpubroker: {fifo}: cannot read: not a regular file (a FIFO)\n"


# --- live reload: one running daemon, the whole corpus -------------------------------


async def test_a_running_daemon_keeps_its_policy_through_the_whole_corpus(
        start_daemon: StartDaemon, probe_factory: ProbeFactory, tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(GOOD_POLICY)
    rd = await start_daemon(policy_file=policy)
    probe = await probe_factory([f"{PREFIX}/events/_ops/#"])
    rejected = f"{PREFIX}/events/_ops/policy.rejected"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for case in CORPUS:
        mark = probe.mark()
        make(policy, case, GOOD_POLICY)
        async with asyncio.timeout(10):
            # What the watcher calls every 2 s (it may be the one that gets there first).
            assert await rd.daemon.reload_policy() == "rejected", case
            msg = payload_json(await probe.wait_for(rejected, since=mark))
        assert msg["data"]["file"] == str(policy), case
        assert msg["data"]["errors"] and msg["data"]["errors"][0]["message"], case
        # The same bad file again: no news (once per change, not once per poll).
        assert await rd.daemon.reload_policy() == "rejected", case
        assert not rd.task.done(), case
        assert set(rd.daemon.broker.policy.teams) == {"ml"}, case
        assert rd.daemon.broker.policy.teams["ml"].max_gpus == 8, case
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 200, f"{grown_mb:.0f} MB more at the peak"
    make(policy, "good", GOOD_POLICY.replace("8", "4"))
    assert await rd.daemon.reload_policy() == "applied"
    await probe.wait_for(f"{PREFIX}/events/_ops/policy.applied")
    assert rd.daemon.broker.policy.teams["ml"].max_gpus == 4
    # Published in order: every rejection is in by now, one per hostile file.
    assert len(probe.matching(rejected)) == len(CORPUS)


# --- live reload: the private servers file -------------------------------------------


async def test_the_servers_file_keeps_the_last_good_one_through_the_corpus(
        tmp_path: Path) -> None:
    path = tmp_path / "servers.yaml"
    path.write_text(GOOD_SERVERS)
    adapter = PrivateAdapter(file=path)
    try:
        for case in CORPUS:
            make(path, case, GOOD_SERVERS)
            with capture_logs() as logs:
                for _ in range(3):
                    async with asyncio.timeout(10):
                        [offer] = await adapter.poll("fra1")
                    assert offer.gpus == 4 and len(offer.targets) == 2, case
            errors = [e for e in logs if e["log_level"] == "error"]
            assert len(errors) == 1, (case, logs)  # once per change, every change
            assert "keeping the last good one" in errors[0]["event"], case
    finally:
        await adapter.close()


# --- a real daemon process: the reproductions --------------------------------


def _livez(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/livez", timeout=5) as r:
        return int(r.status)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


@pytest.mark.slow
async def test_a_daemon_process_survives_hostile_policy_edits_and_stops(
        tmp_path: Path, mosquitto: Mosquitto, probe_factory: ProbeFactory) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(GOOD_POLICY)
    port = free_port()
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({
        "state": {"path": str(tmp_path / "state.db")}, "policy_file": str(policy),
        "mqtt": {"url": mosquitto.url}, "http": {"listen": f"127.0.0.1:{port}"},
        "poll": {"interval_seconds": 3600, "stale_after_seconds": 7200},
        "clouds": {"sim": {"regions_per_cloud": 1, "zones_per_region": 1}}}))
    probe = await probe_factory([f"{PREFIX}/#"])
    log = (tmp_path / "daemon.log").open("wb")
    proc = subprocess.Popen(  # noqa: ASYNC220 - starting it is instant; it is waited on below
        [sys.executable, "-m", "broker.cli", "run", "--config", str(cfg)],
        stdout=log, stderr=log)
    rejected = f"{PREFIX}/events/_ops/policy.rejected"
    try:
        await probe.wait_for(lambda m: str(m.topic) == f"{PREFIX}/status" and m.payload
                             and payload_json(m)["state"] == "online", timeout=20)
        steps: list[tuple[str, Callable[[], object]]] = [
            ("bad-date", lambda: make(policy, "bad-date", GOOD_POLICY)),
            ("fifo", lambda: make(policy, "fifo", "")),
            ("dev-zero-link", lambda: make(policy, "dev-zero-link", "")),
            ("not-utf8", lambda: make(policy, "not-utf8", GOOD_POLICY)),
        ]
        for case, step in steps:
            mark = probe.mark()
            step()
            # The watcher finds it (every 2 s); SIGHUP is not needed.
            msg = payload_json(await probe.wait_for(rejected, since=mark, timeout=10))
            assert msg["data"]["file"] == str(policy), case
            assert proc.poll() is None, case
            assert await asyncio.to_thread(_livez, port) == 200, case
        assert _rss_mb(proc.pid) < 400
        proc.send_signal(signal.SIGTERM)  # with a FIFO gone by: it still ends
        assert await asyncio.to_thread(proc.wait, 20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    assert b"Traceback" not in (tmp_path / "daemon.log").read_bytes()
