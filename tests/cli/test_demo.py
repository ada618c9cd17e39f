"""`gpubroker demo` as a user runs it: a real subprocess against a real mosquitto.

What is checked is what the demo promises (README "The demo"): topics of its own and
clean sessions, so that it never mixes with a real daemon or another demo; every way out
(Ctrl-C, SIGTERM, --duration, an error) releases its leases and clears its retained
messages; a dead MQTT server is one line and exit 1, a bad option one line and exit 2;
the output's notation, legend and summary.

Nothing sleeps to synchronise: the tests wait for the demo's output lines and for MQTT
messages, each with a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from pathlib import Path

import pytest
from mqtt_helpers import Mosquitto, MqttProbe, free_port, payload_json

from broker.cli.demo import normalise_mqtt_url, parse_options
from broker.cli.demo_report import gpus
from broker.cli.main import main
from broker.model import Market, Placement, PoolKey

PLACED = re.compile(r"^\d\d:\d\d:\d\d PLACED +(job-\d+) +(.*?)  (L-[0-9a-f]{10})$")
PREFIX = re.compile(r"topics (gpubroker-demo/[0-9a-f]{8}/v1)/")
DEMO_EVENTS = "gpubroker-demo/+/v1/events/#"
DEMO_LEASES = "gpubroker-demo/+/v1/leases/#"
ENDED = ("gpubroker.lease.released.v1", "gpubroker.lease.expired.v1",
         "gpubroker.lease.failed.v1")


class DemoRun:
    """One `python -m broker.cli demo ...` process; its output lines as they come."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.out: list[str] = []
        self.err: list[str] = []
        self._news = asyncio.Condition()
        self._readers = [asyncio.create_task(self._read(proc.stdout, self.out)),
                         asyncio.create_task(self._read(proc.stderr, self.err))]

    @classmethod
    async def start(cls, *args: str, wrapper: Sequence[str] = ()) -> DemoRun:
        proc = await asyncio.create_subprocess_exec(
            *wrapper, sys.executable, "-m", "broker.cli", "demo", *args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        return cls(proc)

    async def _read(self, stream: asyncio.StreamReader | None, into: list[str]) -> None:
        assert stream is not None
        async for raw in stream:
            into.append(raw.decode(errors="replace").rstrip("\n"))
            async with self._news:
                self._news.notify_all()
        async with self._news:
            self._news.notify_all()

    @property
    def output(self) -> str:
        return "\n".join([*self.out, "--- stderr ---", *self.err])

    def matching(self, pattern: re.Pattern[str]) -> list[re.Match[str]]:
        return [m for line in self.out if (m := pattern.search(line))]

    async def wait_for(self, pattern: re.Pattern[str], count: int = 1,
                       timeout: float = 30.0) -> list[re.Match[str]]:
        """The first `count` output lines matching `pattern`."""
        try:
            async with asyncio.timeout(timeout), self._news:
                while len(found := self.matching(pattern)) < count:
                    if self.proc.returncode is not None and all(r.done() for r in self._readers):
                        break
                    await self._news.wait()
        except TimeoutError:
            pass
        assert len(found) >= count, f"{count} × {pattern.pattern!r} not seen\n{self.output}"
        return found[:count]

    async def exit(self, timeout: float = 30.0) -> int:
        async with asyncio.timeout(timeout):
            code = await self.proc.wait()
            await asyncio.gather(*self._readers)
        return code

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()

    @property
    def prefix(self) -> str:
        found = self.matching(PREFIX)
        assert found, self.output
        return found[0].group(1)


@pytest.fixture
async def demos() -> AsyncIterator[list[DemoRun]]:
    """Demo processes a test starts; killed if the test leaves one running."""
    runs: list[DemoRun] = []
    yield runs
    for run in runs:
        run.kill()
        with contextlib.suppress(TimeoutError, ProcessLookupError):
            await run.exit(10)


async def start(demos: list[DemoRun], *args: str, wrapper: Sequence[str] = ()) -> DemoRun:
    run = await DemoRun.start(*args, wrapper=wrapper)
    demos.append(run)
    return run


async def retained_under(url: str, prefix: str) -> list[str]:
    """The topics under `prefix` holding a retained message. The server sends them on
    subscribe, before a message this client publishes afterwards (the marker)."""
    async with MqttProbe(url, [f"{prefix}/#"]) as probe:
        marker = f"{prefix}/test-marker/{uuid.uuid4().hex}"
        await probe.publish(marker, "end")
        await probe.wait_for(marker)
        return sorted(str(m.topic) for m in probe.messages if m.retain and m.payload)


def short(lease_id: str) -> str:
    """A lease id as the demo prints it."""
    return lease_id[:12]


def lease_ends(probe: MqttProbe, prefix: str) -> dict[str, str]:
    """lease id (as printed) -> how it ended, from the events the probe saw under
    `prefix`."""
    ends = {}
    for m in probe.messages:
        if str(m.topic).startswith(f"{prefix}/events/") and m.payload:
            event = payload_json(m)
            if event["type"] in ENDED:
                ends[short(event["data"]["lease_id"])] = event["type"].split(".")[2]
    return ends


def demo_sessions(mosquitto: Mosquitto) -> list[tuple[str, str]]:
    """(client id, clean flag) of every connection but the tests' probes, from the
    server's log: `New client connected from ... as ID (p5, c1, k30...)`."""
    found = re.findall(r"New client connected from \S+ as (\S+) \(p\d, (c[01])",
                       mosquitto.log_text())
    return [(cid, clean) for cid, clean in found if not cid.startswith("probe-")]


# --- both ends of the demo's life: a real server, real processes ----------------------------


@pytest.mark.slow
async def test_two_demos_at_once_keep_apart_and_leave_nothing(
        mosquitto: Mosquitto, demos: list[DemoRun]) -> None:
    # A real daemon's topics, and the demos' events and lease states, from before the
    # demos start (held to the contract, as every probe's messages are).
    watched = ["gpubroker/#", DEMO_EVENTS, DEMO_LEASES]
    async with MqttProbe(mosquitto.url, watched) as everything:
        runs = [await start(demos, "--duration", "6", "--mqtt", mosquitto.url,
                            "--seed", str(seed)) for seed in (7, 8)]
        codes = [await run.exit(40) for run in runs]
        for run, code in zip(runs, codes, strict=True):
            assert code == 0, run.output
            assert not run.err, run.output
            assert "Traceback" not in run.output
            assert run.matching(PLACED), run.output
        a, b = (run.prefix for run in runs)
        assert a != b
        # Nothing went to a real daemon's gpubroker/v1, and each demo's leases are on its
        # own prefix only.
        topics = {str(m.topic) for m in everything.messages}
        assert all(t.startswith((f"{a}/", f"{b}/")) for t in topics), sorted(topics)[:10]
        for run, own, other in ((runs[0], a, b), (runs[1], b, a)):
            printed = {m.group(3) for m in run.matching(PLACED)}
            mine = {short(t.rsplit("/", 1)[1]) for t in topics
                    if t.startswith(f"{own}/leases/")}
            theirs = {short(t.rsplit("/", 1)[1]) for t in topics
                      if t.startswith(f"{other}/leases/")}
            assert printed <= mine, (printed - mine, run.output)
            assert not printed & theirs
            # Every lease it placed has ended (released, or expired/failed on its own).
            ends = lease_ends(everything, own)
            assert printed <= set(ends), (printed - set(ends), run.output)
            assert "left active" not in run.output
    # No retained message of either demo is left, and no session: every connection of
    # the demos (daemon, schedulers, sweep) was a clean one.
    assert await retained_under(mosquitto.url, "gpubroker-demo") == []
    sessions = demo_sessions(mosquitto)
    assert len(sessions) >= 2 * 4, sessions
    assert {clean for _, clean in sessions} == {"c1"}, sessions


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
async def test_a_signal_stops_it_at_once_releasing_and_clearing(
        mosquitto: Mosquitto, demos: list[DemoRun], sig: signal.Signals) -> None:
    async with MqttProbe(mosquitto.url, [DEMO_EVENTS, DEMO_LEASES]) as probe:
        # The form `--help` shows: HOST:PORT, no scheme.
        run = await start(demos, "--mqtt", f"127.0.0.1:{mosquitto.port}")
        placed = await run.wait_for(PLACED, count=3)
        prefix = run.prefix
        await probe.wait_for(f"{prefix}/leases/#")  # retained state to clear
        sent = time.monotonic()
        run.signal(sig)
        code = await run.exit(10)
        took = time.monotonic() - sent
        assert code == 0, run.output
        assert took < 1.5, f"{took:.2f}s from {sig.name} to exit\n{run.output}"
        assert "Traceback" not in run.output and not run.err, run.output
        stopping = "Ctrl-C" if sig is signal.SIGINT else "SIGTERM"
        assert f"stopping ({stopping})" in run.output
        # Its leases were released: the ones printed so far, and every one placed.
        leases = {m.group(3) for m in run.matching(PLACED)}
        assert {m.group(3) for m in placed} <= leases
        ends = lease_ends(probe, prefix)
        assert leases <= set(ends), (leases - set(ends), run.output)
        assert re.search(r"^  released +\d+: \d+ by the schedulers, \d+ at exit$",
                         "\n".join(run.out), re.M), run.output
    assert await retained_under(mosquitto.url, prefix) == []


async def test_duration_ends_it_with_the_summary(mosquitto: Mosquitto,
                                                 demos: list[DemoRun]) -> None:
    run = await start(demos, "--duration", "4", "--mqtt", mosquitto.url)
    assert await run.exit(30) == 0, run.output
    out = "\n".join(run.out)
    prefix = run.prefix
    # The legend comes before the first event, and names every tag the demo prints.
    legend = out.index("  PLACED    ")
    assert legend < out.index(" PLACED   job-")
    for tag in ("PLACED", "AGAIN", "REJECTED", "INVALID", "TIMEOUT", "FAILOVER", "FAILED",
                "RELEASED", "EXPIRED", "RENEWED", "MQTT"):
        assert re.search(rf"^  {tag} +\S", out, re.M), tag
    tags = {line.split()[1] for line in run.out if re.match(r"\d\d:\d\d:\d\d ", line)}
    assert tags <= {"PLACED", "AGAIN", "REJECTED", "INVALID", "TIMEOUT", "FAILOVER",
                    "FAILED", "RELEASED", "EXPIRED", "RENEWED", "MQTT"}, tags
    # Instances × GPUs per instance, in words: never `8×A100-80GB`.
    for m in run.matching(PLACED):
        assert re.match(r"\d+ instances? × \d+ [A-Za-z0-9-]+ \w+/", m.group(2)), m.group(0)
    assert not re.search(r"(PLACED|FAILOVER).*\d×[A-Z]", out), out
    # The summary, and no renewal line of its own per lease.
    assert "stopping (--duration 4)" in out
    for name in ("placed", "rejected", "invalid", "failovers", "renewed", "released",
                 "price", "retained"):
        assert re.search(rf"^  {name} +\S", out, re.M), name
    assert re.search(r"^  price +\$\d+\.\d{3}/GPU-h paid on average .* against "
                     r"\$\d+\.\d{3}/GPU-h on demand for the same GPU models: -?\d+ % saved",
                     out, re.M), out
    assert re.search(rf"^  retained +\d+ messages? cleared under {re.escape(prefix)}$",
                     out, re.M), out
    assert not re.search(r"RENEWED +L-", out)
    assert await retained_under(mosquitto.url, prefix) == []


# --- a server that is not there, or goes away ------------------------------------------------


@pytest.mark.parametrize("url", ["mqtt://127.0.0.1:{port}", "127.0.0.1:{port}"])
async def test_no_server_is_one_line_and_exit_1_in_seconds(
        demos: list[DemoRun], url: str) -> None:
    port = free_port()
    started = time.monotonic()
    run = await start(demos, "--mqtt", url.format(port=port), "--duration", "60")
    assert await run.exit(20) == 1, run.output
    assert time.monotonic() - started < 8.0
    assert run.out == [], run.output
    assert len(run.err) == 1, run.output
    assert run.err[0].startswith(f"gpubroker demo: no MQTT server at 127.0.0.1:{port}"), \
        run.output
    assert "connection refused" in run.err[0]


async def test_the_server_going_away_and_back_does_not_stop_it(
        mosquitto: Mosquitto, demos: list[DemoRun]) -> None:
    run = await start(demos, "--mqtt", mosquitto.url)
    await run.wait_for(PLACED)
    prefix = run.prefix
    mosquitto.kill()
    await run.wait_for(re.compile(r" MQTT +MQTT connection lost"))
    before = len(run.matching(PLACED))
    await asyncio.to_thread(mosquitto.start)
    await run.wait_for(re.compile(r" MQTT +MQTT reconnected"))
    await run.wait_for(PLACED, count=before + 1)  # placing again: the daemon is back too
    run.signal(signal.SIGINT)
    assert await run.exit(10) == 0, run.output
    assert "Traceback" not in run.output and not run.err, run.output
    assert await retained_under(mosquitto.url, prefix) == []


async def test_the_server_gone_for_good_ends_clearly_on_a_signal(
        mosquitto: Mosquitto, demos: list[DemoRun]) -> None:
    run = await start(demos, "--mqtt", mosquitto.url)
    await run.wait_for(PLACED)
    mosquitto.kill()
    await run.wait_for(re.compile(r" MQTT +MQTT connection lost"))
    sent = time.monotonic()
    run.signal(signal.SIGINT)
    assert await run.exit(20) == 1, run.output
    assert time.monotonic() - sent < 5.0, run.output
    assert "Traceback" not in run.output
    assert len(run.err) == 1 and "could not clean up" in run.err[0], run.output
    # The daemon released the leases itself; the retained messages it could not clear.
    out = "\n".join(run.out)
    assert "left active" not in out, run.output
    assert re.search(r"^  retained +not cleared under gpubroker-demo/", out, re.M), run.output


# --- the embedded server ----------------------------------------------------------------------


def _own_network() -> list[str] | None:
    """A wrapper running a command in a network namespace of its own (nothing answers on
    127.0.0.1:1883 there), or None where that is not allowed."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return None
    wrapper = ["unshare", "--net", "--map-root-user", "sh", "-c",
               'ip link set lo up && exec "$@"', "sh"]
    probe = subprocess.run([*wrapper, "true"], capture_output=True, timeout=10, check=False)
    return wrapper if probe.returncode == 0 else None


@pytest.mark.slow
async def test_with_nothing_on_1883_it_runs_an_embedded_server(demos: list[DemoRun]) -> None:
    wrapper = _own_network()
    if wrapper is None:
        pytest.skip("needs unshare --net (a network namespace) to keep 127.0.0.1:1883 free")
    run = await start(demos, "--duration", "5", wrapper=wrapper)
    assert await run.exit(40) == 0, run.output
    assert "started an embedded one" in run.output and "(MQTT 3.1.1)" in run.output
    assert run.matching(PLACED), run.output
    assert re.search(r"^  retained +\d+ messages? cleared", "\n".join(run.out), re.M), \
        run.output
    assert not run.err, run.output


# --- options ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "says"), [
    (["--duration", "abc"], "--duration abc: expected a number of seconds above 0"),
    (["--duration", "0"], "--duration 0: expected a number of seconds above 0"),
    (["--duration", "-5"], "--duration -5: expected"),
    (["--duration", "nan"], "--duration nan: expected"),
    (["--mqtt", "http://127.0.0.1:1883"], "--mqtt 'http://127.0.0.1:1883': the scheme must"),
    (["--mqtt", "127.0.0.1:99999"], "--mqtt '127.0.0.1:99999': the port must be"),
    (["--mqtt", "mqtt://user:pw@127.0.0.1"], "put no credentials in the URL"),
    (["--mqtt", ""], "--mqtt '': expected"),
    (["--seed", "seven"], "--seed seven: expected a whole number"),
    (["--state", "/"], "--state /: is a directory"),
    (["--state", "/no/such/dir/state.db"], "--state /no/such/dir/state.db: no directory"),
])
def test_a_bad_option_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str],
                                             args: list[str], says: str) -> None:
    assert main(["demo", *args]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("gpubroker demo: "), err
    assert says in err


def test_a_file_that_is_not_state_is_refused(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("not a database\n")
    assert main(["demo", "--state", str(notes)]) == 2
    assert "not a SQLite file" in capsys.readouterr().err


def test_help_shows_the_mqtt_forms_it_takes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "HOST:PORT, mqtt://HOST:PORT or mqtts://HOST:PORT" in text
    for option in ("--duration SECONDS", "--mqtt URL", "--state PATH", "--seed N"):
        assert option in text


@pytest.mark.parametrize(("given", "url"), [
    ("127.0.0.1:1999", "mqtt://127.0.0.1:1999"),
    ("localhost", "mqtt://localhost:1883"),
    ("mqtt://broker.example", "mqtt://broker.example:1883"),
    ("mqtts://broker.example", "mqtts://broker.example:8883"),
    (" mqtt://10.0.0.5:1884/ ", "mqtt://10.0.0.5:1884"),
    ("[::1]:1999", "mqtt://[::1]:1999"),
])
def test_mqtt_urls_are_normalised(given: str, url: str) -> None:
    assert normalise_mqtt_url(given) == url


def test_options_are_parsed() -> None:
    opts = parse_options(duration="2.5", mqtt_url="127.0.0.1:1", state=None, seed="-3")
    assert (opts.duration, opts.mqtt_url, opts.state, opts.seed) == \
        (2.5, "mqtt://127.0.0.1:1", None, -3)


def test_gpus_are_instances_times_gpus_per_instance() -> None:
    def placement(instances: int, per: int, gpu: str) -> Placement:
        pool = PoolKey("aws", "us-east-1", "us-east-1a", "x", Market.SPOT)
        return Placement(pool, instances, gpu, per, 1.0, datetime.now(UTC))

    assert gpus(placement(8, 1, "L4")) == "8 instances × 1 L4"
    assert gpus(placement(1, 8, "A100-80GB")) == "1 instance × 8 A100-80GB"
    assert gpus(placement(2, 8, "H100-80GB")) == "2 instances × 8 H100-80GB"
