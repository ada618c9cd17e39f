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

from broker import __version__
from broker.config import Config, SourceError, load_config

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
        if args.command == "policy":
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

    cfg = _config(args.config)
    logs.configure(json=True)
    daemon = Daemon(cfg)

    async def go() -> None:
        stop = asyncio.Event()
        install_signal_handlers(stop)
        await daemon.run(stop)

    try:
        asyncio.run(go())
    except (OSError, ExceptionGroup) as exc:
        first = exc.exceptions[0] if isinstance(exc, ExceptionGroup) else exc
        print(f"gpubroker: {type(first).__name__}: {first}", file=sys.stderr)
        return EXIT_RUNTIME
    return EXIT_OK


def _offers(args: argparse.Namespace) -> int:
    from broker import logs
    from broker.clouds import build_adapters
    from broker.poller import Poller
    from broker.pool import ResourcePool

    cfg = _config(args.config)
    logs.configure(json=False, level=logging.WARNING)
    adapters, problems = build_adapters(cfg)
    for name, problem in problems:
        print(f"gpubroker: {name}: {problem}", file=sys.stderr)

    async def poll() -> tuple[ResourcePool, list[str]]:
        pool = ResourcePool(stale_after_seconds=cfg.poll.stale_after_seconds)
        poller = Poller(pool, adapters, interval_seconds=cfg.poll.interval_seconds,
                        timeout_seconds=cfg.poll.timeout_seconds)
        try:
            results = await poller.poll_all()
        finally:
            for adapter in adapters:
                await adapter.close()
        errors = [f"{r.slice[0]} {r.slice[1]}: {type(r.error).__name__}: {r.error}"
                  for r in results if r.error]
        return pool, errors

    pool, errors = asyncio.run(poll())
    for e in errors:
        print(f"gpubroker: poll failed: {e}", file=sys.stderr)
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
    if (problems or errors) and not offers:
        return EXIT_RUNTIME
    return EXIT_OK


def _table(offers: Sequence[object], out: object) -> None:
    from broker.model import Offer

    rows = [("CLOUD", "REGION", "ZONE", "INSTANCE TYPE", "MARKET", "GPU", "GPUS", "$/H",
             "$/GPU-H", "AVAIL", "FREE", "INTR/H", "QUOTA")]

    def f(x: float | int | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    for o in offers:
        assert isinstance(o, Offer)
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
        print(line.rstrip(), file=out)  # type: ignore[call-overload]
    print(f"{len(offers)} offers", file=out)  # type: ignore[call-overload]


def _policy_check(path: Path) -> int:
    from policies.loader import load_policy

    policy = load_policy(path)
    print(f"{path}: ok (version {policy.version})")
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
