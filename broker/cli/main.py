"""The `gpubroker` command line (SPEC §7). Exit codes: 0 ok, 1 runtime failure, 2 bad
usage or configuration."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from broker import __version__
from broker.cli.common import (
    EXIT_OK,
    EXIT_RUNTIME,
    EXIT_USAGE,
    config_at,
    error_line,
    gpu_typo,
    output_problem,
    poll_once,
    quiet_logs,
    usage,
)
from broker.daemon.config import SourceError, load_config
from broker.output.stdio import printable

if TYPE_CHECKING:
    from broker.model import Lease, Offer


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


MAX_TIMEOUT_SECONDS = 86400.0
"""The longest `--timeout`: a day."""


def seconds_arg(text: str) -> float:
    """`--timeout`: a number of seconds, finite, > 0 and at most MAX_TIMEOUT_SECONDS
    (`-1`, `nan` and `inf` were taken before and waited not at all, or for ever)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of seconds, got {printable(repr(text), 80)}") from None
    if not 0 < value <= MAX_TIMEOUT_SECONDS:
        raise argparse.ArgumentTypeError(
            f"must be > 0 and at most {MAX_TIMEOUT_SECONDS:g} seconds "
            f"(MAX_TIMEOUT_SECONDS), got {printable(repr(text), 80)}")
    return value


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
    _add_client_parsers(sub)
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
            return _run(args)
        if args.command == "demo":
            from broker.cli.demo import run_demo

            return run_demo(duration=args.duration, mqtt_url=args.mqtt, state=args.state,
                            seed=args.seed, end_process=True)
        if args.command == "offers":
            return _offers(args)
        if args.command == "history":
            return _history(args)
        if args.command == "status":
            return _status(args)
        if args.command in ("place", "leases", "release"):
            return _client_command(args)
        if args.command == "backtest":
            from broker.cli.backtest import run as run_backtest

            return run_backtest(args)
        if args.command == "private":
            return _private_check(args.file)
        if args.command == "policy":
            if args.policy_command == "explain":
                return _policy_explain(args)
            if args.policy_command == "diff":
                return _policy_diff(args)
            return _policy_check(args.file)
    except SourceError as err:
        for problem in err.problems:
            print(f"gpubroker: {problem}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_RUNTIME
    raise AssertionError(args.command)  # argparse allows nothing else


def _run(args: argparse.Namespace) -> int:
    import structlog

    from broker.daemon.assembly import Daemon, install_signal_handlers
    from broker.output import logs
    from broker.state.store import StoreFailed

    cfg = config_at(args.config)
    logs.configure(json=True, level=logging.getLevelNamesMapping()[cfg.log_level.upper()])
    daemon = Daemon(cfg)

    async def go() -> None:
        nonlocal daemon
        stop = asyncio.Event()
        while True:
            remove = install_signal_handlers(stop, daemon.request_reload)
            try:
                await daemon.run(stop)
                return
            except StoreFailed as exc:
                # Crash-only, SQLite: exit; systemd starts the daemon again. With high
                # availability the node steps down instead (another may lead by now) and
                # stands by again with a fresh start, which reloads the state.
                if not cfg.state.url or stop.is_set():
                    raise
                structlog.get_logger("gpubroker.daemon").warning(
                    "stepped down; standing by again", why=str(exc)[:300])
            finally:
                remove()
            daemon = Daemon(cfg)

    try:
        asyncio.run(go())
    except StoreFailed:
        # Crash-only (broker.leasing.authority): the broker has logged SQLite's error, once; systemd
        # starts the daemon again, and it recovers from the store.
        return EXIT_RUNTIME
    except (OSError, ExceptionGroup) as exc:
        first = exc.exceptions[0] if isinstance(exc, ExceptionGroup) else exc
        if isinstance(first, OSError):  # `http.listen HOST:PORT: address already in use`
            print(f"gpubroker: {error_line(first)}", file=sys.stderr)
            # A name that does not resolve is a mistake in the configuration; a port in
            # use may be free at the next start.
            return EXIT_USAGE if isinstance(first, socket.gaierror) else EXIT_RUNTIME
        print(f"gpubroker: {type(first).__name__}: {first}", file=sys.stderr)
        return EXIT_RUNTIME
    return EXIT_OK


def _offers(args: argparse.Namespace) -> int:
    from broker.model import CLOUDS, GPU_MODELS
    from broker.wire.validation import unknown_gpu, unknown_name

    for name in args.cloud or ():
        if name not in CLOUDS:
            return usage(f"--cloud: {unknown_name('cloud', name, CLOUDS)}")
    if typo := gpu_typo("--gpu", args.gpu):
        return usage(typo)
    cfg = config_at(args.config)
    quiet_logs()
    pool, errors = poll_once(cfg)
    for e in errors:
        print(f"gpubroker: {e}", file=sys.stderr)
    known = set(GPU_MODELS) | pool.gpus()
    for name in args.gpu or ():
        if name not in known:
            return usage(f"--gpu: {unknown_gpu(name, known)}")
    offers = [o for o in pool
              if (not args.gpu or o.gpu in args.gpu)
              and (not args.cloud or o.pool.cloud in args.cloud)
              and (not args.market or o.pool.market.value == args.market)]
    offers.sort(key=lambda o: (o.price_per_gpu_hour is None, o.price_per_gpu_hour or 0.0,
                               o.pool))
    out = sys.stdout
    if args.format == "json":
        for o in offers:
            out.write(json.dumps(o.to_json(), separators=(",", ":")) + "\n")
    else:
        _table(offers, out)
    if errors and not offers:
        return EXIT_RUNTIME
    return EXIT_OK


def _table(offers: Sequence[Offer], out: TextIO) -> None:
    rows = [("CLOUD", "REGION", "ZONE", "INSTANCE TYPE", "MARKET", "GPU", "GPUS", "$/H",
             "$/GPU-H", "AVAIL", "FREE", "INTR/H", "QUOTA")]

    def f(x: float | int | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    for o in offers:
        rows.append((o.pool.cloud, o.pool.region, o.pool.zone, o.pool.instance_type,
                     o.pool.market.value, o.gpu + ("" if o.gpu_known else "?"), str(o.gpus),
                     f(o.price_per_hour, ".4f"), f(o.price_per_gpu_hour, ".4f"),
                     f(o.availability, ".2f"), f(o.capacity, "d"),
                     f(o.interruption_rate, ".3f"), f(o.quota_headroom, "d")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    right = {6, 7, 8, 9, 10, 11, 12}
    for r in rows:
        line = "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        print(line.rstrip(), file=out)
    print(f"{len(offers)} offers", file=out)
    owned = [o for o in offers if o.targets]
    if owned:
        free = sum((o.capacity or 0) * o.gpus for o in owned)
        print(f"paid-for capacity (market reserved): {sum(o.owned_gpus for o in owned)} GPUs "
              f"in {len(owned)} pools, {free} free now (idle unless a lease is about to use "
              "them)", file=out)


def _policy_explain(args: argparse.Namespace) -> int:
    from broker.model import CLOUDS, utcnow
    from broker.placement.optimizer import Ask, explain
    from broker.wire import validation
    from policies.loader import load_policy

    policy = load_policy(args.file)
    req = validation.parse_place(args.scheduler, args.request.encode())
    if isinstance(req, validation.Invalid):
        for fe in req.errors:
            print(f"gpubroker: --request: {fe['field'] or '(body)'}: {fe['message']}",
                  file=sys.stderr)
        return EXIT_USAGE
    # A name the daemon would take but that is most likely a typo here: a team the
    # policy does not have (the daemon gives it no limits), a cloud no adapter has.
    if req.team is not None and policy.teams and req.team not in policy.teams:
        return usage(f"--request: team: {validation.unknown_name('team', req.team, policy.teams)}")
    for name in req.clouds or ():
        if name not in CLOUDS:
            return usage(f"--request: clouds: {validation.unknown_name('cloud', name, CLOUDS)}")
    if typo := gpu_typo("--request: gpu", req.gpu):
        return usage(typo)
    cfg = config_at(args.config)
    quiet_logs()
    pool, errors = poll_once(cfg)
    for e in errors:
        print(f"gpubroker: {e}", file=sys.stderr)
    unknown = validation.unknown_gpus(req, lambda: set(policy.extra_gpus) | pool.gpus())
    if unknown is not None:
        return usage(f"--request: gpu: {unknown.errors[0]['message']}")
    report = explain(Ask(req), pool, policy, now=utcnow(), all_gpus=sorted(pool.gpus()))
    if args.format == "json":
        print(json.dumps(report, indent=2))
        return EXIT_OK
    verdict = report["verdict"]
    print(f"request {req.request_id}: {req.gpus}×{'|'.join(req.gpu)}")
    if "denied" in verdict:
        print(f"  denied ({verdict['denied']}): {verdict['detail']}")
        return EXIT_OK
    print(f"  rule: {verdict['rule'] or '(no rule matched)'}")
    for k in ("gpus", "markets", "max_price_per_gpu_hour", "clouds", "regions", "residency",
              "budget_left_per_hour"):
        if verdict.get(k) is not None:
            print(f"  {k}: {verdict[k]}")
    print(f"  offers excluded ({sum(report['excluded'].values())}):")
    for why, n in report["excluded"].items():
        print(f"    {n:6d}  {why}")
    print(f"  feasible offers: {report['feasible']}; best {len(report['candidates'])}:")
    for c in report["candidates"]:
        p, t = c["placement"], c["terms"]
        print(f"    ${c['expected_cost_per_hour']:.4f}/h expected = ${c['price_per_hour']:.4f}/h"
              f" × (1 + {t['interruption']:.3f} interruption + {t['availability']:.3f} "
              f"availability + {t['spread']:.3f} spread)  {p['instances']}× "
              f"{p['cloud']}/{p['zone']} {p['instance_type']} {p['market']}")
    return EXIT_OK


def _policy_diff(args: argparse.Namespace) -> int:
    from broker.leasing import failover
    from broker.model import LeaseState, utcnow
    from broker.placement.optimizer import Decision
    from broker.state.configured import store_for
    from broker.state.store import StoreFailed, db_errors
    from policies.evaluate import forbids
    from policies.loader import load_policy
    from policies.residency import Residency

    old, new = load_policy(args.old), load_policy(args.new)
    cfg = config_at(args.config)
    quiet_logs()

    store = store_for(cfg.state, cfg.site, read_only=True)  # the daemon may be running

    async def active() -> list[Lease]:
        await store.open()
        try:
            return [le for le in await store.leases() if le.state is LeaseState.ACTIVE]
        finally:
            await store.close()

    if not cfg.state.url and not cfg.state.path.is_file():
        return usage(f"no state file at {cfg.state.path}"
                      + (" (a directory)" if cfg.state.path.is_dir() else ""))
    try:
        leases = asyncio.run(active())
    except db_errors(StoreFailed, RuntimeError) as err:  # not a state, or a newer one's
        what = "database" if cfg.state.url else "state file"
        return usage(f"{store.name}: cannot read the {what}: {str(err).strip()}")
    pool, errors = poll_once(cfg)
    for e in errors:
        print(f"gpubroker: {e}", file=sys.stderr)
    for lease in leases:
        pool.hold(lease.placement.pool, lease.placement.instances)
    resident_old, resident_new = Residency(old.residency.tags), Residency(new.residency.tags)
    now = utcnow()
    rows = []
    for lease in leases:
        p = lease.placement
        why_new = forbids(new, lease.request, p.pool, p.gpu, p.price_per_gpu_hour, resident_new)
        if not why_new:
            continue
        why_old = forbids(old, lease.request, p.pool, p.gpu, p.price_per_gpu_hour, resident_old)
        pool.unhold(p.pool, p.instances)
        outcome = failover.replacement(lease, pool, new, resident_new, now)
        pool.hold(p.pool, p.instances)
        row: dict[str, Any] = {"lease_id": lease.lease_id, "scheduler": lease.scheduler,
               "team": lease.request.team, "from": p.to_json(), "why": why_new,
               "forbidden_already": bool(why_old)}
        if isinstance(outcome, Decision):
            row.update(outcome="moves", to=outcome.placement.to_json())
        else:
            row.update(outcome="fails", detail=outcome.detail)
        rows.append(row)
    if args.format == "json":
        print(json.dumps({"active_leases": len(leases), "affected": rows}, indent=2))
        return EXIT_OK
    print(f"{len(leases)} active leases; {len(rows)} forbidden under {args.new}:")
    for r in rows:
        f = r["from"]
        where = f"{f['cloud']}/{f['zone']} {f['instance_type']} {f['market']}"
        if r["outcome"] == "moves":
            t = r["to"]
            to = f"moves to {t['cloud']}/{t['zone']} {t['instance_type']} {t['market']}"
        else:
            to = f"FAILS: {r['detail']}"
        note = " (already forbidden under the old policy)" if r["forbidden_already"] else ""
        print(f"  {r['lease_id']} {r['scheduler']}/{r['team'] or '-'} on {where}: {r['why']};"
              f" {to}{note}")
    return EXIT_OK


def _policy_check(path: Path) -> int:
    from policies.loader import load_policy

    policy = load_policy(path)
    print(f"{printable(str(path))}: ok (version {policy.version})")
    return EXIT_OK


def _private_check(path: Path) -> int:
    from adapters.private.servers import load_servers

    servers = load_servers(path)  # raises SourceError: every problem, by line
    print(f"{printable(str(path))}: ok: {len(servers.sites)} sites, {len(servers.groups)} groups, "
          f"{servers.server_count} servers")
    return EXIT_OK


# Complex, many returns: split in the package redesign (#28).
def _history(args: argparse.Namespace) -> int:  # noqa: C901, PLR0911, PLR0912, PLR0915
    """`gpubroker history`: the state file's market history as a trace (broker.market.traces),
    streamed in time order; a one-line summary on stderr at the end."""
    import gzip
    from collections.abc import Callable, Generator, Iterator
    from datetime import datetime

    from broker.market.recorder import HistoryReader
    from broker.market.traces import (
        TraceError,
        TraceRow,
        format_t,
        parse_when,
        trace_format,
        write_csv,
        write_jsonl,
    )
    from broker.model import CLOUDS, GPU_MODELS, Market, PoolKey, utcnow
    from broker.state.configured import store_for
    from broker.state.store import Db, db_errors
    from broker.wire.validation import unknown_gpu, unknown_name

    now = utcnow()
    when: dict[str, datetime | None] = {}
    for option, text in (("--since", args.since), ("--until", args.until)):
        try:
            when[option] = parse_when(text, now) if text else None
        except ValueError as err:
            return usage(f"{option}: {err}")
    since, until = when["--since"], when["--until"]
    if since is not None and until is not None and until <= since:
        return usage("--until must be later than --since")
    source: Path | Callable[[], Db]
    if args.state is None and (cfg := config_at(args.config)).state.url:
        store = store_for(cfg.state, cfg.site)
        source, name = store.reader, store.name
    else:
        path: Path = args.state or config_at(args.config).state.path
        if not path.is_file():
            return usage(f"no state file at {path}" + (" (a directory)" if path.is_dir()
                                                      else ""))
        source, name = path, str(path)
    if args.output is not None and (problem := output_problem("--output", args.output)):
        return usage(problem)
    fmt = args.format
    if fmt is None:
        try:
            fmt = trace_format(args.output)[0] if args.output else "jsonl"
        except TraceError:
            fmt = "jsonl"
    try:
        reader = HistoryReader(source)
    except db_errors() as err:
        what = "state file" if isinstance(source, Path) else "database"
        return usage(f"{name}: cannot read the {what}: {str(err).strip()}")
    with reader:
        gpus, clouds = set(GPU_MODELS) | reader.names("gpu"), set(CLOUDS) | reader.names("cloud")
        for name in args.gpu or ():
            if name not in gpus:
                return usage(f"--gpu: {unknown_gpu(name, gpus)}")
        for name in args.cloud or ():
            if name not in clouds:
                return usage(f"--cloud: {unknown_name('cloud', name, clouds)}")
        pruned = reader.pruned_before()
        pools: set[PoolKey] = set()
        span: list[datetime] = []  # the first and the last row's time

        def read() -> Generator[TraceRow]:
            yield from reader.rows(since=since, until=until, gpus=args.gpu or (),
                                   clouds=args.cloud or (),
                                   market=Market(args.market) if args.market else None)

        rows = read()  # closing it closes the reader's generator (`yield from`)

        def counted() -> Iterator[TraceRow]:
            for row in rows:
                pools.add(row.pool)
                if not span:
                    span.append(row.t)
                span[1:] = [row.t]
                yield row

        write = write_csv if fmt == "csv" else write_jsonl
        # The rows' read transaction ends when their generator is closed: here, on every
        # way out, while the database is still open. Left to the garbage collector, a
        # reader gone early (`| head -1`) had it end after `reader` closed the database:
        # "Exception ignored ... Cannot operate on a closed database".
        try:
            if args.output is None:
                n = write(counted(), sys.stdout)
                sys.stdout.flush()
            else:
                gz = args.output.name.endswith(".gz")
                with (gzip.open(args.output, "wt", encoding="utf-8", newline="") if gz
                      else args.output.open("w", encoding="utf-8", newline="")) as out:
                    n = write(counted(), out)
        except BrokenPipeError:  # `gpubroker history | head`: no error (`main`)
            raise
        except db_errors(OSError) as err:
            print(f"gpubroker: {printable(error_line(err))}", file=sys.stderr)
            return EXIT_RUNTIME
        finally:
            rows.close()
    summary = f"exported {n} changes of {len(pools)} pools"
    if span:
        summary += f" from {format_t(span[0])} to {format_t(span[-1])}"
    if not reader.present:
        summary += f" ({name} holds no market history)"
    elif pruned is not None and since is not None and since < pruned:
        summary += f" (history before {format_t(pruned)} is pruned: it starts there)"
    print(printable(summary), file=sys.stderr)
    return EXIT_OK


# Complex: split in the package redesign (#28).
def _status(args: argparse.Namespace) -> int:  # noqa: C901, PLR0912
    """`gpubroker status`: the site's leadership and nodes as its PostgreSQL database has
    them (broker.state.leadership). A SQLite state is a single daemon: said so, exit 0.
    A database that
    cannot be reached or read: one line, exit 1; another site's database, an unreadable
    password file or no psycopg: exit 2, as the daemon would."""
    from datetime import UTC

    from broker.model import iso

    cfg = config_at(args.config)
    out: dict[str, Any] = {"site": cfg.site, "high_availability": bool(cfg.state.url),
                           "database": None, "leadership_seconds": None, "leader": None,
                           "epoch": 0, "claimed_by": None, "expires_in_seconds": None,
                           "nodes": []}
    if not cfg.state.url:
        out["database"] = str(cfg.state.path)
        if args.format == "json":
            print(json.dumps(out, indent=2))
        else:
            print(f"site {cfg.site}: state in the SQLite file {cfg.state.path}: a single "
                  "daemon, no high availability (set state.url to run several)")
        return EXIT_OK

    from broker.state.leadership import site_status
    from broker.state.pgstore import PgStateStore
    from broker.state.store import db_errors

    store = PgStateStore(cfg.state.url, site=cfg.site, password_file=cfg.state.password_file,
                         leadership_seconds=cfg.state.leadership_seconds)
    if (pw := cfg.state.password_file) is not None:
        from gpubroker_client.files import read_secret

        try:
            read_secret(pw)
        except OSError as err:
            return usage(f"{pw}: state.password_file: cannot read: {err.strerror or err}")

    def one_line(err: BaseException) -> str:
        return " ".join(str(err).split()) or type(err).__name__

    try:
        with store.connect() as conn:
            found = conn.execute("SELECT to_regclass('leadership') IS NOT NULL, "
                                 "to_regclass('meta') IS NOT NULL").fetchone()
            owner = None
            if found is not None and found[1]:
                row = conn.execute("SELECT value FROM meta WHERE key = 'site'").fetchone()
                owner = None if row is None else str(row[0])
        if owner is not None and owner != cfg.site:
            return usage(f"{store.name}: state.url: the database holds the state of site "
                          f"{owner!r}, not {cfg.site!r}: each site needs a database of its own")
        if found is None or not found[0]:
            print(f"gpubroker: {store.name}: no leadership in this database yet: no daemon "
                  f"of site {cfg.site} has started on it", file=sys.stderr)
            return EXIT_RUNTIME
        site = site_status(store, cfg.site)
    except RuntimeError as err:  # psycopg is not installed
        return usage(f"state.url: {err}")
    except db_errors(OSError) as err:
        print(f"gpubroker: {store.name}: cannot read the site's status: {one_line(err)}",
              file=sys.stderr)
        return EXIT_RUNTIME

    valid = site.leader is not None and (site.expires_in_seconds or 0.0) > 0
    out.update(database=store.name, leadership_seconds=cfg.state.leadership_seconds,
               leader=site.leader if valid else None, epoch=site.epoch,
               claimed_by=site.leader,
               expires_in_seconds=None if site.expires_in_seconds is None
               else round(site.expires_in_seconds, 3),
               nodes=[{"node": n.node, "role": n.role, "epoch": n.epoch, "boot_id": n.boot_id,
                       "version": n.version, "started_at": iso(n.started_at),
                       "seen_seconds_ago": round(max(0.0, n.seen_seconds_ago), 3)}
                      for n in site.nodes])
    if args.format == "json":
        print(json.dumps(out, indent=2))
        return EXIT_OK

    print(f"site {cfg.site} on {store.name} (leadership_seconds "
          f"{cfg.state.leadership_seconds:g})")
    if site.leader is None:
        print("leader: none yet: no node has led this site")
    elif valid:
        print(f"leader: node {site.leader}, epoch {site.epoch}; its claim expires in "
              f"{_ago(site.expires_in_seconds or 0.0)} unless renewed")
    else:
        print(f"leader: none: the claim of node {site.leader} (epoch {site.epoch}) expired "
              f"{_ago(-(site.expires_in_seconds or 0.0))} ago; a standby takes over at "
              "its next claim")
    rows = [("NODE", "ROLE", "EPOCH", "VERSION", "STARTED", "LAST SEEN")]
    rows += [(n.node, n.role, str(n.epoch), n.version,
              n.started_at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
              f"{_ago(n.seen_seconds_ago)} ago") for n in site.nodes]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.rjust(w) if i == 2 else c.ljust(w)
                        for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip())
    # A running node writes its heartbeat at least every leadership_seconds / 3.
    gone = [n for n in site.nodes
            if n.role != "stopped" and n.seen_seconds_ago > cfg.state.leadership_seconds + 1]
    for n in gone:
        print(f"node {n.node}: not seen for {_ago(n.seen_seconds_ago)}: stopped, or cut off "
              "from the database")
    print(f"{len(site.nodes)} node{'s' if len(site.nodes) != 1 else ''}")
    return EXIT_OK


def _ago(seconds: float) -> str:
    """`0.4 s`, `42.0 s`, `3m 5s`, `2h 10m`, `3d 4h`."""
    s = max(0.0, seconds)
    if s < 60:
        return f"{s:.1f} s"
    m, sec = divmod(int(s), 60)
    h, m = divmod(m, 60)
    d, h = divmod(h, 24)
    if d:
        return f"{d}d {h}h"
    return f"{h}h {m}m" if h else f"{m}m {sec}s"


# --- scheduler commands: place, leases, release (over broker.client) ----------------------
#
# A person's view of what a scheduler does through `broker.client`: connection settings
# from --config (the daemon's file: mqtt url, prefix, credentials) or --mqtt; one line per
# error, no traceback; exit 1 for what the daemon or the network refused, 2 for what was
# wrong in the command itself.


def _add_client_parsers(sub: Any) -> None:
    def connection(p: argparse.ArgumentParser) -> None:
        p.add_argument("--mqtt", metavar="URL",
                       help="MQTT server: mqtt://HOST[:PORT] or mqtts://HOST[:PORT] "
                            "(default: mqtt.url of --config, else mqtt://127.0.0.1:1883)")
        p.add_argument("--config", type=Path, metavar="PATH",
                       help="the daemon's configuration file, for its MQTT URL, topic "
                            "prefix and credentials")
        p.add_argument("--topic-prefix", metavar="PREFIX",
                       help="topic root (default: mqtt.topic_prefix of --config, else "
                            "gpubroker/v1)")
        p.add_argument("--timeout", type=seconds_arg, default=30.0, metavar="SECONDS",
                       help="how long to wait for the MQTT server and the daemon's answer "
                            "(default: 30)")

    scheduler_help = ("scheduler id S, the identity the daemon knows the lease by (default: "
                      "$GPUBROKER_SCHEDULER, else the MQTT username of --config, else 'cli')")
    place = sub.add_parser("place", help="ask the daemon for GPUs and print the lease",
                           description="Send a placement request as scheduler S (on "
                                       "P/requests/S/place) and print the decision. The "
                                       "lease expires after its lease period unless its "
                                       "scheduler renews it.")
    place.add_argument("--gpu", action="extend", nargs="+", required=True, metavar="MODEL",
                       help="acceptable GPU model(s), e.g. H100-80GB A100-80GB "
                            "(repeatable)")
    place.add_argument("--gpus", type=int, required=True, metavar="N",
                       help="GPUs wanted in all")
    place.add_argument("--market", choices=["spot", "on_demand", "reserved", "any"],
                       help="market (default: the policy's)")
    place.add_argument("--max-price", type=float, metavar="USD",
                       help="highest acceptable price per GPU-hour, in USD")
    place.add_argument("--cloud", action="extend", nargs="+", metavar="CLOUD",
                       help="only these clouds (repeatable)")
    place.add_argument("--region", action="extend", nargs="+", metavar="REGION",
                       help="only these regions (repeatable)")
    place.add_argument("--team", help="the team the GPUs are charged to (policy limits)")
    place.add_argument("--lease-seconds", type=int, metavar="SECONDS",
                       help="lease period before it must be renewed (default: the policy's)")
    place.add_argument("--duration-hours", type=float, metavar="HOURS",
                       help="how long the job expects to run (placement weighs it)")
    place.add_argument("--max-parts", type=int, metavar="N",
                       help="allow a split into up to N leases, one per pool, when no one "
                            "pool has room or the split is cheaper (sends gang: false)")
    place.add_argument("--label", action="append", metavar="KEY=VALUE",
                       help="a label kept with the lease (repeatable)")
    place.add_argument("--request-id", metavar="ID",
                       help="idempotency key: the same id always gets the same lease "
                            "(default: a new uuid, printed)")
    place.add_argument("--scheduler", metavar="S", help=scheduler_help)
    place.add_argument("--format", choices=["table", "json"], default="table",
                       help="table: for people; json: the decision's data on one line")
    connection(place)

    leases = sub.add_parser(
        "leases", help="list leases (and follow them with --watch)",
        description="List leases: from the daemon's HTTP API (GET /v1/leases) when --http "
                    "is given or --config sets http.listen, else from the retained "
                    "P/leases/S/<id> topics on MQTT, which hold the active leases only. "
                    "--watch lists the active leases, then follows every change on MQTT.")
    leases.add_argument("--scheduler", metavar="S",
                        help="only this scheduler's leases (default: every scheduler's)")
    leases.add_argument("--state", choices=["active", "released", "expired", "failed", "all"],
                        default="active",
                        help="which leases (default: active; others need the HTTP API)")
    leases.add_argument("--watch", action="store_true",
                        help="after the list, print each change as it happens, until Ctrl-C")
    leases.add_argument("--http", metavar="URL",
                        help="the daemon's HTTP API, http://HOST:PORT or HOST:PORT "
                             "(default: http.listen of --config, when it sets it)")
    leases.add_argument("--format", choices=["table", "json"], default="table",
                        help="table: for people; json: JSON Lines, one lease (with --watch: "
                             "one change) per line")
    connection(leases)

    release = sub.add_parser("release", help="release a lease",
                             description="Release a lease of scheduler S; a lease that has "
                                         "already ended is reported as such (exit 0).")
    release.add_argument("lease_id", metavar="LEASE_ID", help="the lease, e.g. L-8c1f…")
    release.add_argument("--scheduler", metavar="S", help=scheduler_help)
    connection(release)


def _client_command(args: argparse.Namespace) -> int:
    from broker.client import BrokerError

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("gpubroker: %(message)s"))
    client_log = logging.getLogger("gpubroker.client")
    client_log.handlers[:] = [handler]
    client_log.propagate = False
    client_log.setLevel(logging.WARNING)
    try:
        if args.command == "place":
            return _place(args)
        if args.command == "release":
            return _release(args)
        return _leases(args)
    except ValueError as err:  # a bad URL, scheduler id or prefix
        return usage(str(err))
    except BrokerError as err:  # the MQTT server or the daemon said no, or nothing
        print(f"gpubroker: {printable(err)}", file=sys.stderr)
        return EXIT_RUNTIME


def _client_settings(args: argparse.Namespace, scheduler: str | None) -> dict[str, Any]:
    """BrokerClient arguments from --config, --mqtt and --topic-prefix."""
    import os

    from broker.client import DEFAULT_PREFIX

    cfg = load_config(args.config) if args.config is not None else None
    mqtt = cfg.mqtt if cfg is not None else None
    settings: dict[str, Any] = {
        "url": args.mqtt or (mqtt.url if mqtt else "mqtt://127.0.0.1:1883"),
        "topic_prefix": args.topic_prefix or (mqtt.topic_prefix if mqtt else DEFAULT_PREFIX),
        "connect_timeout": max(1.0, min(args.timeout, 5.0)),
    }
    if mqtt is not None:
        settings.update(username=mqtt.username, password_file=mqtt.password_file,
                        ca_file=mqtt.ca_file, protocol=mqtt.protocol)
    if scheduler is None:
        scheduler = os.environ.get("GPUBROKER_SCHEDULER") or \
            (mqtt.username if mqtt and mqtt.username else None) or "cli"
    settings["scheduler"] = scheduler
    return settings


# Complex: split in the package redesign (#28).
def _place(args: argparse.Namespace) -> int:  # noqa: C901
    import uuid

    from broker import client
    from broker.client import BrokerClient, InvalidRequest, PlacementTimeout, Rejected

    labels: dict[str, str] = {}
    for item in args.label or ():
        key, eq, value = item.partition("=")
        if not eq or not key:
            print(f"gpubroker: --label {item!r}: expected KEY=VALUE", file=sys.stderr)
            return EXIT_USAGE
        labels[key] = value
    rid = args.request_id or str(uuid.uuid4())
    settings = _client_settings(args, args.scheduler)

    async def go() -> client.Lease:
        async with BrokerClient(**settings) as c:
            return await c.place(
                gpu=args.gpu if len(args.gpu) > 1 else args.gpu[0], gpus=args.gpus,
                market=args.market, request_id=rid, timeout=args.timeout,
                max_price_per_gpu_hour=args.max_price, clouds=args.cloud,
                regions=args.region, team=args.team, lease_seconds=args.lease_seconds,
                duration_hours=args.duration_hours, labels=labels or None,
                **({"gang": False, "max_parts": args.max_parts}
                   if args.max_parts and args.max_parts > 1 else {}))

    again = f"; ask again with --request-id {rid} (the same id cannot place twice)"
    try:
        lease = asyncio.run(go())
    except Rejected as err:
        if args.format == "json" and err.event is not None:
            print(json.dumps(err.event["data"], separators=(",", ":")))
        print(f"gpubroker: request {rid} rejected: {err}", file=sys.stderr)
        return EXIT_RUNTIME
    except InvalidRequest as err:
        for e in err.errors:
            print(f"gpubroker: invalid request: {e['field'] or '(request)'}: {e['message']}",
                  file=sys.stderr)
        return EXIT_USAGE
    except PlacementTimeout as err:
        print(f"gpubroker: {err}{again}", file=sys.stderr)
        return EXIT_RUNTIME
    except KeyboardInterrupt:
        print(f"gpubroker: interrupted; the request may have been placed{again}",
              file=sys.stderr)
        return EXIT_RUNTIME
    if args.format == "json":
        print(json.dumps(dict(lease.decided), separators=(",", ":")))
        return EXIT_OK
    if len(lease.parts) > 1:
        print(f"request {lease.request_id} split into {len(lease.parts)} leases, one per "
              f"pool; each is renewed and released on its own")
    for n, part in enumerate(lease.parts):
        p = part.placement
        if part.active:
            print(f"placed {part.lease_id} for request {part.request_id} "
                  f"(scheduler {part.scheduler}, epoch {part.epoch})")
        else:
            print(f"request {part.request_id} already had lease {part.lease_id}, which has "
                  f"{part.state.value} (scheduler {part.scheduler}, epoch {part.epoch})")
        for name, value in (
                ("where", f"{p.pool.cloud} {p.pool.region}, zone {p.pool.zone}, "
                          f"{p.pool.instance_type}, {p.pool.market.value}"),
                ("launch", ", ".join(f"{n} into {t}" if n > 1 else t for t, n in p.targets)),
                ("gpus", f"{_instances(p.instances, p.gpus, p.gpu)} = {p.total_gpus} GPUs"),
                ("price", f"${p.price_per_gpu_hour:.4f} per GPU-hour, "
                          f"${p.price_per_hour:.2f} per hour"),
                ("expires", _expiry(part.expires_at.isoformat(), part.active)
                 + (" unless its scheduler renews it" if part.active else "")),
                ("why", lease.reason if n == 0 else "")):
            if value:
                print(f"  {name + ':':9}{value}")
    return EXIT_OK


def _instances(instances: int, gpus: int, gpu: str) -> str:
    """`2 instances × 8 A100-80GB`: never `16×A100-80GB`, which reads as one machine."""
    return f"{instances} instance{'s' if instances != 1 else ''} × {gpus} {gpu}"


def _expiry(expires_at: str, active: bool = True, *, short: bool = False) -> str:
    """`2026-12-01 22:36:12 UTC (in 14m 53s)`; short: `in 14m 53s`."""
    from broker.model import parse_iso, utcnow

    when = parse_iso(expires_at)
    left = int((when - utcnow()).total_seconds())
    m, s = divmod(max(0, left), 60)
    h, m = divmod(m, 60)
    rel = f"in {f'{h}h ' if h else ''}{f'{m}m ' if h or m else ''}{s}s" if left > 0 \
        else "due now"
    if short:
        return rel if active else "-"
    text = when.strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"{text} ({rel})" if active else text


def _release(args: argparse.Namespace) -> int:
    from broker.client import BrokerClient, InvalidRequest
    from broker.model import LeaseState

    settings = _client_settings(args, args.scheduler)

    async def go() -> LeaseState:
        async with BrokerClient(**settings) as c:
            return await c.release(args.lease_id, timeout=args.timeout)

    try:
        state = asyncio.run(go())
    except InvalidRequest:
        print(f"gpubroker: scheduler {settings['scheduler']} has no lease {args.lease_id} "
              "(another scheduler's? give its --scheduler)", file=sys.stderr)
        return EXIT_RUNTIME
    if state is LeaseState.RELEASED:
        print(f"released {args.lease_id}")
    else:
        print(f"{args.lease_id} had already {state.value}")
    return EXIT_OK


def _leases(args: argparse.Namespace) -> int:
    http = args.http
    if http is None and not args.watch and args.config is not None:
        cfg = load_config(args.config)
        if "listen" in cfg.http.model_fields_set and cfg.http.listen is not None:
            http = cfg.http.listen
    if http is not None and not args.watch:
        return _leases_http(args, http)
    if args.state != "active":
        print(f"gpubroker: MQTT holds the active leases only; --state {args.state} needs the "
              "daemon's HTTP API (--http, or http.listen in --config)"
              + (" and cannot be watched" if args.watch else ""), file=sys.stderr)
        return EXIT_USAGE
    return _leases_mqtt(args)


def _leases_http(args: argparse.Namespace, base: str) -> int:
    import urllib.error
    import urllib.parse
    import urllib.request

    if "://" not in base:
        base = "http://" + base
    states = ["active", "released", "expired", "failed"] if args.state == "all" \
        else [args.state]
    rows: list[dict[str, Any]] = []
    for state in states:
        query = {"state": state, **({"scheduler": args.scheduler} if args.scheduler else {})}
        url = f"{base.rstrip('/')}/v1/leases?{urllib.parse.urlencode(query)}"
        try:
            with urllib.request.urlopen(url, timeout=args.timeout) as answer:
                rows += json.loads(answer.read())
        except urllib.error.HTTPError as err:
            print(f"gpubroker: {url}: HTTP {err.code}: {err.read().decode(errors='replace')}",
                  file=sys.stderr)
            return EXIT_RUNTIME
        except (urllib.error.URLError, OSError, ValueError) as err:
            why = getattr(err, "reason", err)
            print(f"gpubroker: cannot read the daemon's HTTP API at {base}: {why}",
                  file=sys.stderr)
            return EXIT_RUNTIME
    rows.sort(key=lambda le: str(le.get("created_at", "")))
    _print_leases(rows, args.format)
    return EXIT_OK


def _targets(p: dict[str, Any], most: int = 4) -> str:
    """` on gpu-a01, gpu-a02` (reservations or private servers to launch into)."""
    targets = p.get("targets") or ()
    if not targets:
        return ""
    names = [t["id"] if t["instances"] == 1 else f"{t['id']}×{t['instances']}"
             for t in targets[:most]]
    more = f" +{len(targets) - most}" if len(targets) > most else ""
    return f" on {', '.join(names)}{more}"


def _print_leases(rows: Sequence[dict[str, Any]], fmt: str) -> None:
    if fmt == "json":
        for le in rows:
            print(json.dumps(le, separators=(",", ":")))
        return
    table = [("LEASE", "SCHEDULER", "REQUEST", "STATE", "EPOCH", "INSTANCES × GPUS", "WHERE",
              "$/GPU-H", "$/H", "EXPIRES")]
    for le in rows:
        p = le["placement"]
        table.append((le["lease_id"], le["scheduler"], le["request_id"], le["state"],
                      str(le["epoch"]), f"{p['instances']} × {p['gpus']} {p['gpu']}",
                      f"{p['cloud']}/{p['zone']} {p['instance_type']} {p['market']}"
                      + _targets(p),
                      f"{p['price_per_gpu_hour']:.4f}", f"{p['price_per_hour']:.2f}",
                      _expiry(le["expires_at"], le["state"] == "active", short=True)))
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for r in table:
        print("  ".join(c.rjust(w) if i in (4, 7, 8) else c.ljust(w)
                        for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip())
    print(f"{len(rows)} lease{'s' if len(rows) != 1 else ''}")


def _leases_mqtt(args: argparse.Namespace) -> int:
    import signal

    from broker.client import BrokerClient, LeaseChange

    settings = _client_settings(args, None)
    settings["scheduler"] = None  # read only: a lease watch

    def line(change: LeaseChange) -> str:
        from broker.model import iso, utcnow

        if args.format == "json":
            out: dict[str, Any] = {"change": change.kind, "lease_id": change.lease_id,
                                   "scheduler": change.scheduler, "time": iso(utcnow()),
                                   "lease": change.state}
            if change.reason is not None:
                out.update(reason=change.reason, detail=change.detail)
            return json.dumps(out, separators=(",", ":"))
        t = utcnow().strftime("%H:%M:%S")
        head = f"{t} {change.kind.upper():<8} {change.lease_id} {change.scheduler}"
        s = change.state or {}
        p = s.get("placement")
        if change.kind in ("placed", "failover") and p:
            why = f" ({change.reason})" if change.reason else ""
            lead = f"epoch {s.get('epoch')}{why} → " if change.kind == "failover" else ""
            return (f"{head} {lead}{p['instances']} × {p['gpus']} {p['gpu']} {p['cloud']}/"
                    f"{p['zone']} {p['instance_type']} {p['market']}{_targets(p)} "
                    f"${p['price_per_gpu_hour']:.4f}/GPU-h, expires "
                    f"{s['expires_at'][11:19]}")
        if change.kind == "renewed":
            return f"{head} expires {s.get('expires_at', '')[11:19]}"
        detail = f" {change.reason}: {change.detail}" if change.reason else ""
        return head + detail

    async def go() -> None:
        async with BrokerClient(**settings) as c, c.watch_leases(
                args.scheduler, all_schedulers=args.scheduler is None) as watch:
            await watch.synced(args.timeout)
            rows = sorted(watch.states.values(), key=lambda le: str(le.get("created_at")))
            if args.watch and args.format == "json":
                for le in rows:
                    print(json.dumps({"change": "present", "lease_id": le["lease_id"],
                                      "scheduler": le["scheduler"], "lease": le},
                                     separators=(",", ":")))
            else:
                _print_leases(rows, args.format)
            if not args.watch:
                return
            sys.stdout.flush()
            print("watching for changes; Ctrl-C to stop", file=sys.stderr)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            stopping = asyncio.create_task(stop.wait())
            changes = watch.changes()
            while True:
                nxt = asyncio.ensure_future(anext(changes))
                await asyncio.wait({nxt, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    nxt.cancel()
                    return
                print(line(nxt.result()), flush=True)

    try:
        asyncio.run(go())
    except BrokenPipeError:  # `gpubroker leases --watch | head`: the reader has had enough
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
