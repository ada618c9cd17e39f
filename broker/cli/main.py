"""The `gpubroker` command line (SPEC §7): the parser and the dispatch. Exit codes: 0 ok,
1 runtime failure, 2 bad usage or configuration.

The commands, a module each:

    daemon.py     run, status
    demo.py       demo (with demo_*.py)
    offers.py     offers
    policy.py     policy check|explain|diff, private check
    history.py    history
    backtest.py   backtest (the engine is broker.backtest)
    scheduler.py  place, leases, release, renew, report (over gpubroker_client)
    common.py     what they share: exit codes, one-line messages, one poll of the market
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from broker import __version__
from broker.cli.common import EXIT_OK, EXIT_RUNTIME, EXIT_USAGE
from broker.cli.daemon import run_daemon, show_status
from broker.cli.history import export_history
from broker.cli.offers import list_offers
from broker.cli.policy import policy_check, policy_diff, policy_explain, private_check
from broker.cli.scheduler import add_parsers as add_scheduler_parsers
from broker.cli.scheduler import client_command
from broker.daemon.config import SourceError
from broker.output.stdio import printable


class _Parser(argparse.ArgumentParser):
    """argparse with a usage mistake told in one line, with the nearest choice:
    `gpubroker offers: argument --market: invalid choice: 'on-demand' (choose from 'spot',
    'on_demand', 'reserved'); did you mean 'on_demand'? (gpubroker offers --help)`. Exit 2."""

    def error(self, message: str) -> NoReturn:
        from policies.checks import suggest

        m = re.search(r"invalid choice: '(.*?)' \(choose from (.*)\)$", message)
        if m:
            message += suggest(m.group(1), re.findall(r"'(.*?)'", m.group(2)))
        self.exit(EXIT_USAGE, f"{self.prog}: {printable(message)} ({self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="gpubroker", description="Multi-cloud GPU broker daemon and tools.")
    p.add_argument("--version", action="version", version=f"gpubroker {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run the daemon in the foreground")
    run.add_argument("--config", type=Path, help="daemon configuration (YAML)")

    # The demo's values are checked by broker.cli.demo (one line each, exit 2).
    demo = sub.add_parser(
        "demo", help="the whole system on the simulated market",
        description="The daemon on a simulated market, with two schedulers placing jobs "
                    "over MQTT; every event is printed, then a summary. It uses topics of "
                    "its own (gpubroker-demo/<random>/v1) and clean sessions, and on every "
                    "way out releases its leases and clears its retained messages.")
    demo.add_argument("--duration", metavar="SECONDS", default=None,
                      help="stop this many seconds after start (default: at Ctrl-C)")
    demo.add_argument("--mqtt", metavar="URL", default=None,
                      help="MQTT server: HOST:PORT, mqtt://HOST:PORT or mqtts://HOST:PORT "
                           "(default: 127.0.0.1:1883 if an MQTT server answers there, else "
                           "an embedded one)")
    demo.add_argument("--state", metavar="PATH", default=None,
                      help="SQLite state file, kept after the demo (default: a temporary "
                           "one, deleted at exit)")
    demo.add_argument("--seed", metavar="N", default="7",
                      help="seed of the simulated market and of the schedulers' choices "
                           "(default: 7)")

    offers = sub.add_parser("offers", help="poll once and list the pool by price per GPU-hour")
    offers.add_argument("--config", type=Path, metavar="PATH",
                        help="daemon configuration (YAML): the clouds to poll "
                             "(default: the simulated market)")
    offers.add_argument("--gpu", action="extend", nargs="+", metavar="MODEL",
                        help="only these GPU models: canonical names (H100-80GB) or a "
                             "cloud's own name for one it offers; --gpu A B or --gpu A "
                             "--gpu B")
    offers.add_argument("--cloud", action="extend", nargs="+", metavar="CLOUD",
                        help="only these clouds (aws, gcp, azure, alibaba); several as "
                             "--gpu takes them")
    offers.add_argument("--market", choices=["spot", "on_demand", "reserved"],
                        help="only this market (default: both)")
    offers.add_argument("--format", choices=["table", "json"], default="table",
                        help="table: for people (default); json: JSON Lines, one offer a "
                             "line (SPEC §7 keys)")

    policy = sub.add_parser("policy", help="policy tools")
    psub = policy.add_subparsers(dest="policy_command", required=True, metavar="SUBCOMMAND")
    check = psub.add_parser("check", help="validate a policy file")
    check.add_argument("file", type=Path, metavar="FILE",
                       help="the policy (YAML); every problem is listed, by line")
    explain = psub.add_parser("explain", help="how a policy places one request, and why")
    explain.add_argument("file", type=Path, metavar="FILE", help="the policy (YAML)")
    explain.add_argument("--request", required=True, metavar="JSON",
                         help="the placement request as JSON (as on P/requests/S/place)")
    explain.add_argument("--scheduler", default="explain", metavar="S",
                         help="the scheduler id S (policy rules may match it; default: "
                              "explain)")
    explain.add_argument("--config", type=Path, metavar="PATH",
                         help="daemon configuration: the clouds to poll (default: the "
                              "simulated market)")
    explain.add_argument("--format", choices=["text", "json"], default="text",
                         help="text: for people (default); json: the whole report")
    diff = psub.add_parser("diff", help="which current leases a new policy would move or fail")
    diff.add_argument("old", type=Path, metavar="OLD", help="the policy in force (YAML)")
    diff.add_argument("new", type=Path, metavar="NEW", help="the policy to compare (YAML)")
    diff.add_argument("--config", type=Path, metavar="PATH",
                      help="daemon configuration: its state.path (the leases) and the "
                           "clouds to poll")
    diff.add_argument("--format", choices=["text", "json"], default="text",
                      help="text: for people (default); json: every affected lease")

    private = sub.add_parser("private", help="the company's own GPU servers (clouds.private)")
    prsub = private.add_subparsers(dest="private_command", required=True, metavar="SUBCOMMAND")
    pcheck = prsub.add_parser("check", help="validate a servers file")
    pcheck.add_argument("file", type=Path, metavar="FILE",
                        help="the servers file (YAML); every problem is listed, by line")

    history = sub.add_parser("history", help="export the recorded market history as a trace")
    history.add_argument("--config", type=Path, help="daemon configuration (its state.path)")
    history.add_argument("--state", type=Path, help="the state file (instead of --config)")
    history.add_argument("--since", metavar="WHEN",
                         help="start: ISO-8601 (2026-11-30T10:00:00Z) or a duration back "
                              "(30m, 6h, 7d); the trace opens with every pool's state then")
    history.add_argument("--until", metavar="WHEN", help="end (exclusive), as --since")
    history.add_argument("--gpu", action="extend", nargs="+", metavar="MODEL",
                         help="only these GPU models (canonical or recorded names); "
                              "--gpu A B or --gpu A --gpu B")
    history.add_argument("--cloud", action="extend", nargs="+", metavar="NAME",
                         help="only these clouds, as --gpu")
    history.add_argument("--market", choices=["spot", "on_demand", "reserved"],
                         help="only this market (default: both)")
    history.add_argument("--format", choices=["csv", "jsonl"],
                         help="default: from --output's name, else jsonl")
    history.add_argument("--output", type=Path, metavar="FILE",
                         help="write here (gzipped if it ends in .gz); default stdout")

    status = sub.add_parser(
        "status", help="the site's leader and nodes (high availability)",
        description="Read the site's leadership and its nodes from the database of "
                    "state.url: each node's role, epoch, version, start and last heartbeat; "
                    "the leader, its epoch and when its claim expires. With a SQLite state "
                    "(state.path) there is a single daemon and nothing to show.")
    status.add_argument("--config", type=Path, metavar="PATH",
                        help="daemon configuration (YAML): its site and state.url")
    status.add_argument("--format", choices=["table", "json"], default="table",
                        help="table: for people (default); json: one object")

    from broker.cli.backtest import add_parser as add_backtest_parser

    add_backtest_parser(sub)
    add_scheduler_parsers(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """`gpubroker`: the command, its exit code. A reader that closes the pipe early
    (`gpubroker offers | head -1`) ends it quietly with 0: stdout then points at
    /dev/null, so that nothing left in its buffer fails again when Python flushes it at
    exit (the recipe of the Python docs, "Note on SIGPIPE")."""
    try:
        code = _main(argv)
        sys.stdout.flush()
    except BrokenPipeError:
        try:
            fd = sys.stdout.fileno()
        except (AttributeError, OSError, ValueError):  # not a real file (tests)
            return EXIT_OK
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
        return EXIT_OK
    return code


# Many returns: one return per subcommand: the dispatch table.
def _main(argv: Sequence[str] | None) -> int:  # noqa: PLR0911
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            return run_daemon(args)
        if args.command == "demo":
            from broker.cli.demo import run_demo

            return run_demo(duration=args.duration, mqtt_url=args.mqtt, state=args.state,
                            seed=args.seed, end_process=True)
        if args.command == "offers":
            return list_offers(args)
        if args.command == "history":
            return export_history(args)
        if args.command == "status":
            return show_status(args)
        if args.command in ("place", "leases", "release", "renew", "report"):
            return client_command(args)
        if args.command == "backtest":
            from broker.cli.backtest import run as run_backtest

            return run_backtest(args)
        if args.command == "private":
            return private_check(args.file)
        if args.command == "policy":
            if args.policy_command == "explain":
                return policy_explain(args)
            if args.policy_command == "diff":
                return policy_diff(args)
            return policy_check(args.file)
    except SourceError as err:
        for problem in err.problems:
            print(f"gpubroker: {problem}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_RUNTIME
    raise AssertionError(args.command)  # argparse allows nothing else


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
