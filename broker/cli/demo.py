"""`gpubroker demo`: the whole system on the simulated market, with no set-up.

It runs the real daemon (SQLite state, MQTT bus, poller, placement, failover) on a fast,
jumpy simulated market, plus two demo schedulers (`broker.client`) that place jobs over
MQTT, renew, release, sometimes let a lease expire, send a request again or send a
malformed one. What they see is printed as it happens, tagged (the legend is printed at
start); renewals are folded into a line every 10 s; a summary ends the run.

It plays safe on a shared MQTT server: its topics are its own (`gpubroker-demo/<random>/v1`,
never a real daemon's `gpubroker/v1`), every connection is a clean session, and every
way out (Ctrl-C, SIGTERM, `--duration`, an error) releases its leases and clears the
retained messages under its prefix. The MQTT server is the one given, else the one on
127.0.0.1:1883 if one answers, else an embedded one (amqtt, MQTT 3.1.1).

Here: the options and the command; the demo itself is demo_play.py, what it prints
demo_report.py, its MQTT server and the sweep of retained messages demo_mqtt.py.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import sys
import tempfile
from pathlib import Path

from broker.cli.demo_mqtt import host_port
from broker.cli.demo_play import EXIT_INTERRUPTED, EXIT_USAGE, Demo, Options
from broker.daemon.config import MqttConfig
from broker.output import logs
from gpubroker_client import parse_mqtt_url


def parse_options(*, duration: str | float | None, mqtt_url: str | None,
                  state: str | Path | None, seed: str | int) -> Options:
    """The demo's command-line values, checked; ValueError says what is wrong in one
    line, naming the option."""
    secs: float | None = None
    if duration is not None:
        try:
            secs = float(duration)
        except ValueError:
            secs = math.nan
        if not (math.isfinite(secs) and secs > 0):
            raise ValueError(f"--duration {duration!s}: expected a number of seconds above 0, "
                             "e.g. --duration 20")
    url = None if mqtt_url is None else normalise_mqtt_url(mqtt_url)
    try:
        number = int(seed)
    except ValueError:
        raise ValueError(f"--seed {seed!s}: expected a whole number, e.g. --seed 7") from None
    path = None if state is None else Path(state)
    if path is not None:
        if str(path) == "":
            raise ValueError("--state: expected a file path")
        if path.is_dir():
            raise ValueError(f"--state {path}: is a directory; give a file path, "
                             f"e.g. {path / 'demo.db'}")
        parent = path.parent if str(path.parent) else Path(".")
        if not parent.is_dir():
            raise ValueError(f"--state {path}: no directory {parent}")
        if path.is_file() and path.stat().st_size > 0:
            with path.open("rb") as f:
                if f.read(16) != b"SQLite format 3\x00":
                    raise ValueError(f"--state {path}: not a SQLite file (gpubroker keeps its "
                                     "state in one); give a new path or a demo's state file")
    return Options(secs, url, path, number)


def normalise_mqtt_url(text: str) -> str:
    """`HOST[:PORT]`, `mqtt://HOST[:PORT]` or `mqtts://HOST[:PORT]` as the URL the daemon's
    config takes, scheme and port written out (`mqtt://127.0.0.1:1883`). ValueError in
    one line otherwise."""
    given = text.strip()
    try:
        host, port, tls = parse_mqtt_url(given)
        if any(c.isspace() for c in host):
            raise ValueError("MQTT URL: the host name has a space in it")
    except ValueError as exc:
        why = str(exc).split(": ", 1)[-1]
        raise ValueError(f"--mqtt {text!r}: {why}; give HOST:PORT or mqtt://HOST:PORT, "
                         "e.g. 127.0.0.1:1883") from None
    url = f"{'mqtts' if tls else 'mqtt'}://{host_port(host, port)}"
    MqttConfig(url=url)  # the daemon takes it as well (raises nothing for a URL made so)
    return url


def run_demo(*, duration: str | float | None, mqtt_url: str | None,
             state: str | Path | None, seed: str | int, end_process: bool = False) -> int:
    """`gpubroker demo`: returns the exit code (0 when stopped by a signal or
    `--duration`, 1 on a failure, 2 for a bad option, 130 when stopped at once).

    `end_process` (the command line): end the process when done, without the
    interpreter's teardown. Everything of the demo is stopped, released, cleared and
    closed by then; unloading the hundreds of modules it imported took
    longer than all of that, and a Ctrl-C is to end the demo at once."""
    try:
        opts = parse_options(duration=duration, mqtt_url=mqtt_url, state=state, seed=seed)
    except ValueError as err:
        print(f"gpubroker demo: {err}", file=sys.stderr)
        return EXIT_USAGE
    logs.configure(json=False, level=logging.ERROR)  # the demo prints what happens itself
    # aiomqtt's and paho's own logger (WARNING of its own): a lost connection is told by
    # the clients' MQTT lines, not by a socket error of paho's.
    logging.getLogger("mqtt").setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="gpubroker-demo-") as tmp:
        demo = Demo(opts, opts.state or Path(tmp) / "state.db", temporary=opts.state is None)
        try:
            code = asyncio.run(demo.main())
        except asyncio.CancelledError:
            print(f"gpubroker demo: stopped at once (signalled twice); its leases may stay "
                  f"active and retained messages under {demo.prefix} may remain",
                  file=sys.stderr)
            code = EXIT_INTERRUPTED
    if end_process:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run_demo(duration=None, mqtt_url=None, state=None, seed=7))
