"""The `gpubroker` command line (SPEC §7). Exit codes: 0 ok, 1 runtime failure, 2 bad
usage or configuration."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from broker import __version__
from broker.config import Config, SourceError, load_config

if TYPE_CHECKING:
    from broker.model import Lease, Offer
    from broker.pool import ResourcePool

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpubroker", description="Multi-cloud GPU broker daemon and tools.")
    p.add_argument("--version", action="version", version=f"gpubroker {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run the daemon in the foreground")
    run.add_argument("--config", type=Path, help="daemon configuration (YAML)")

    demo = sub.add_parser("demo", help="the whole system on the simulated market")
    demo.add_argument("--duration", type=float, default=None,
                      help="stop after this many seconds (default: until Ctrl-C)")
    demo.add_argument("--mqtt", default=None,
                      help="MQTT server URL (default: 127.0.0.1:1883 if it answers, "
                           "else an embedded one)")
    demo.add_argument("--state", type=Path, default=None,
                      help="SQLite state file (default: a fresh temporary one)")
    demo.add_argument("--seed", type=int, default=7)

    offers = sub.add_parser("offers", help="poll once and list the pool by price per GPU-hour")
    offers.add_argument("--config", type=Path)
    offers.add_argument("--gpu", action="append", help="GPU model (repeatable)")
    offers.add_argument("--cloud", action="append", help="cloud (repeatable)")
    offers.add_argument("--market", choices=["spot", "on_demand"])
    offers.add_argument("--format", choices=["table", "json"], default="table")

    policy = sub.add_parser("policy", help="policy tools")
    psub = policy.add_subparsers(dest="policy_command", required=True, metavar="SUBCOMMAND")
    check = psub.add_parser("check", help="validate a policy file")
    check.add_argument("file", type=Path)
    explain = psub.add_parser("explain", help="how a policy places one request, and why")
    explain.add_argument("file", type=Path)
    explain.add_argument("--request", required=True,
                         help="the placement request as JSON (as on P/requests/S/place)")
    explain.add_argument("--scheduler", default="explain", help="the scheduler id S")
    explain.add_argument("--config", type=Path)
    explain.add_argument("--format", choices=["text", "json"], default="text")
    diff = psub.add_parser("diff", help="which current leases a new policy would move or fail")
    diff.add_argument("old", type=Path)
    diff.add_argument("new", type=Path)
    diff.add_argument("--config", type=Path)
    diff.add_argument("--format", choices=["text", "json"], default="text")

    history = sub.add_parser("history", help="export the recorded market history as a trace")
    history.add_argument("--config", type=Path, help="daemon configuration (its state.path)")
    history.add_argument("--state", type=Path, help="the state file (instead of --config)")
    history.add_argument("--since", metavar="WHEN",
                         help="start: ISO-8601 (2026-11-30T10:00:00Z) or a duration back "
                              "(30m, 6h, 7d); the trace opens with every pool's state then")
    history.add_argument("--until", metavar="WHEN", help="end (exclusive), as --since")
    history.add_argument("--gpu", action="extend", nargs="+", metavar="MODEL")
    history.add_argument("--cloud", action="extend", nargs="+", metavar="NAME")
    history.add_argument("--market", choices=["spot", "on_demand"])
    history.add_argument("--format", choices=["csv", "jsonl"],
                         help="default: from --output's name, else jsonl")
    history.add_argument("--output", type=Path, metavar="FILE",
                         help="write here (gzipped if it ends in .gz); default stdout")

    from broker.backtest.cli import add_parser as add_backtest_parser

    add_backtest_parser(sub)
    return p


def _config(path: Path | None) -> Config:
    return load_config(path) if path is not None else Config()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "demo":
            from broker.demo import run_demo

            return run_demo(duration=args.duration, mqtt_url=args.mqtt, state=args.state,
                            seed=args.seed)
        if args.command == "offers":
            return _offers(args)
        if args.command == "history":
            return _history(args)
        if args.command == "backtest":
            from broker.backtest.cli import run as run_backtest

            return run_backtest(args)
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
    from broker import logs
    from broker.daemon import Daemon, install_signal_handlers
    from broker.store import StoreFailed

    cfg = _config(args.config)
    logs.configure(json=True, level=logging.getLevelNamesMapping()[cfg.log_level.upper()])
    daemon = Daemon(cfg)

    async def go() -> None:
        stop = asyncio.Event()
        install_signal_handlers(stop, daemon.request_reload)
        await daemon.run(stop)

    try:
        asyncio.run(go())
    except StoreFailed:
        # Crash-only (broker.core): the broker has logged SQLite's error, once; systemd
        # starts the daemon again, and it recovers from the store.
        return EXIT_RUNTIME
    except (OSError, ExceptionGroup) as exc:
        first = exc.exceptions[0] if isinstance(exc, ExceptionGroup) else exc
        print(f"gpubroker: {type(first).__name__}: {first}", file=sys.stderr)
        return EXIT_RUNTIME
    return EXIT_OK


def _poll(cfg: Config) -> tuple[ResourcePool, list[str]]:
    """One poll of every configured cloud, as `offers`, `policy explain` and `policy diff`
    see the market. Returns the pool and one line per problem."""
    from broker.clouds import build_adapters
    from broker.poller import Poller
    from broker.pool import ResourcePool

    adapters, problems = build_adapters(cfg)
    errors = [f"{name}: {problem}" for name, problem in problems]

    async def poll() -> ResourcePool:
        pool = ResourcePool(stale_after_seconds=cfg.poll.stale_after_seconds)
        poller = Poller(pool, adapters, interval_seconds=cfg.poll.interval_seconds,
                        timeout_seconds=cfg.poll.timeout_seconds)
        try:
            results = await poller.poll_all()
        finally:
            for adapter in adapters:
                await adapter.close()
        errors.extend(f"poll failed: {r.slice[0]} {r.slice[1]}: {type(r.error).__name__}: "
                      f"{r.error}" for r in results if r.error)
        return pool

    return asyncio.run(poll()), errors


def _offers(args: argparse.Namespace) -> int:
    from broker import logs

    cfg = _config(args.config)
    logs.configure(json=False, level=logging.WARNING)
    pool, errors = _poll(cfg)
    for e in errors:
        print(f"gpubroker: {e}", file=sys.stderr)
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


def _policy_explain(args: argparse.Namespace) -> int:
    from broker import logs, requests
    from broker.model import utcnow
    from broker.placement import Ask, explain
    from policies.loader import load_policy

    policy = load_policy(args.file)
    req = requests.parse_place(args.scheduler, args.request.encode())
    if isinstance(req, requests.Invalid):
        for fe in req.errors:
            print(f"gpubroker: --request: {fe['field'] or '(body)'}: {fe['message']}",
                  file=sys.stderr)
        return EXIT_USAGE
    cfg = _config(args.config)
    logs.configure(json=False, level=logging.WARNING)
    pool, errors = _poll(cfg)
    for e in errors:
        print(f"gpubroker: {e}", file=sys.stderr)
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
    from broker import failover, logs
    from broker.model import LeaseState, utcnow
    from broker.placement import Decision
    from broker.store import StateStore
    from policies.evaluate import forbids
    from policies.loader import load_policy
    from policies.residency import Residency

    old, new = load_policy(args.old), load_policy(args.new)
    cfg = _config(args.config)
    logs.configure(json=False, level=logging.WARNING)

    async def active() -> list[Lease]:
        store = StateStore(cfg.state.path)
        await store.open()
        try:
            return [le for le in await store.leases() if le.state is LeaseState.ACTIVE]
        finally:
            await store.close()

    if not cfg.state.path.exists():
        print(f"gpubroker: no state file at {cfg.state.path}", file=sys.stderr)
        return EXIT_USAGE
    leases = asyncio.run(active())
    pool, errors = _poll(cfg)
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
    print(f"{path}: ok (version {policy.version})")
    return EXIT_OK


def _history(args: argparse.Namespace) -> int:
    """`gpubroker history`: the state file's market history as a trace (broker.trace),
    streamed in time order; a one-line summary on stderr at the end."""
    import gzip
    import os
    import sqlite3
    from collections.abc import Iterator
    from datetime import datetime

    from broker.model import CLOUDS, GPU_MODELS, Market, PoolKey, utcnow
    from broker.recorder import HistoryReader
    from broker.trace import (
        TraceError,
        TraceRow,
        format_t,
        parse_when,
        trace_format,
        write_csv,
        write_jsonl,
    )
    from policies.checks import suggest

    def usage(message: str) -> int:
        print(f"gpubroker: {message}", file=sys.stderr)
        return EXIT_USAGE

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
    path: Path = args.state or _config(args.config).state.path
    if not path.is_file():
        return usage(f"no state file at {path}")
    fmt = args.format
    if fmt is None:
        try:
            fmt = trace_format(args.output)[0] if args.output else "jsonl"
        except TraceError:
            fmt = "jsonl"
    try:
        reader = HistoryReader(path)
    except sqlite3.Error as err:
        return usage(f"{path}: cannot read the state file: {err}")
    with reader:
        for option, names, what, known in (
                ("--gpu", args.gpu, "GPU model", set(GPU_MODELS) | reader.names("gpu")),
                ("--cloud", args.cloud, "cloud", set(CLOUDS) | reader.names("cloud"))):
            for name in names or ():
                if name not in known:
                    return usage(f"{option}: unknown {what} {name!r}{suggest(name, known)}")
        pruned = reader.pruned_before()
        pools: set[PoolKey] = set()
        span: list[datetime] = []  # the first and the last row's time

        def counted() -> Iterator[TraceRow]:
            for row in reader.rows(since=since, until=until, gpus=args.gpu or (),
                                   clouds=args.cloud or (),
                                   market=Market(args.market) if args.market else None):
                pools.add(row.pool)
                if not span:
                    span.append(row.t)
                span[1:] = [row.t]
                yield row

        write = write_csv if fmt == "csv" else write_jsonl
        try:
            if args.output is None:
                n = write(counted(), sys.stdout)
                sys.stdout.flush()
            else:
                gz = args.output.name.endswith(".gz")
                with (gzip.open(args.output, "wt", encoding="utf-8", newline="") if gz
                      else args.output.open("w", encoding="utf-8", newline="")) as out:
                    n = write(counted(), out)
        except BrokenPipeError:  # `gpubroker history | head`: the reader has had enough
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_OK
        except (sqlite3.Error, OSError) as err:
            print(f"gpubroker: {type(err).__name__}: {err}", file=sys.stderr)
            return EXIT_RUNTIME
    summary = f"exported {n} changes of {len(pools)} pools"
    if span:
        summary += f" from {format_t(span[0])} to {format_t(span[-1])}"
    if not reader.present:
        summary += f" ({path} holds no market history)"
    elif pruned is not None and since is not None and since < pruned:
        summary += f" (history before {format_t(pruned)} is pruned: it starts there)"
    print(summary, file=sys.stderr)
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
