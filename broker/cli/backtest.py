"""`gpubroker backtest`: the command line of the backtest (README "Backtest")."""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from broker.backtest import STRATEGIES
from broker.backtest.draws import CORRELATED_POOL_WIDE_SHARE, POOL_WIDE_SHARE
from broker.backtest.market import MAX_SPAN_DAYS
from broker.backtest.private import PrivateSite
from broker.cli.common import EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, error_line, output_problem
from broker.market.traces import MAX_GPUS, MAX_INTERRUPTION_RATE, MAX_PRICE_PER_HOUR
from broker.output.stdio import printable, stdout_to_stderr

MAX_SEEDS = 100
"""The most runs `--seeds` asks for: each is a whole backtest."""
MAX_STEP_MINUTES = 1440.0
"""The longest `--step-minutes`: a day (the poll interval of the replay)."""
MAX_PRIVATE_SERVERS = 100_000
"""The most servers `--private-gpus` may make (each is a target the replay keeps)."""
PRIVATE_DEFAULTS = PrivateSite(gpus=1)
"""`--private-gpu`, `--private-gpus-per-server` and `--private-price` when not given."""


def add_parser(sub: Any) -> None:
    """Add the `backtest` subcommand to the `gpubroker` parser's subparsers."""
    p = sub.add_parser(
        "backtest", help="replay a market trace and a workload; compare strategies",
        description="Replay a market trace and a request workload through the real "
                    "placement, lease book and failover code on a simulated clock, and "
                    "compare placement strategies.")
    p.add_argument("--market", required=True, metavar="TRACE",
                   help="a trace file (.jsonl/.csv, optionally .gz) or "
                        "sim:DURATION[:SEED][:REGIONS], e.g. sim:7d, sim:36h:42:2")
    p.add_argument("--workload", required=True, metavar="FILE",
                   help="a workload file (JSON Lines) or gen:N[:SEED], e.g. gen:3000")
    p.add_argument("--strategy", default=",".join(STRATEGIES),
                   help=f"comma-separated, any of {','.join(STRATEGIES)} (default: all)")
    p.add_argument("--policy", type=Path, metavar="FILE",
                   help="the gpubroker policy (YAML); default: the daemon's default "
                        "policy (no file), with --restart-hours if given")
    p.add_argument("--seed", type=int, default=7,
                   help="the default of --market-seed, --workload-seed and --draw-seed (7)")
    p.add_argument("--seeds", type=int, default=1, metavar="N",
                   help="run N times, with --seed, --seed+1, ... for each of the three "
                        "seeds not given explicitly, and report per strategy the mean and "
                        "a 95%% Student-t confidence interval over the runs (1)")
    p.add_argument("--market-seed", type=int, metavar="N",
                   help="the simulated market's seed when sim: names none, and the "
                        "permutation of a trace file's zone labels (--seed)")
    p.add_argument("--keep-zone-labels", action="store_true",
                   help="replay a trace file's zones under their recorded labels (by "
                        "default each zone's series takes another label of its cloud, "
                        "seeded, so that no strategy gains from zone names in a tie)")
    p.add_argument("--workload-seed", type=int, metavar="N",
                   help="the generated workload's seed when gen: names none (--seed)")
    p.add_argument("--draw-seed", type=int, metavar="N",
                   help="the interruption draws' seed (--seed)")
    p.add_argument("--restart-hours", type=float, metavar="H",
                   help="what the embedded policy's optimizer assumes a restart costs "
                        "(default: the default policy's scoring.restart_hours); the "
                        "backtest itself charges start-ups and checkpoints")
    p.add_argument("--startup-minutes", type=float, default=10.0, metavar="M",
                   help="boot, image pull and checkpoint load after every placement and "
                        "move, paid and not useful, for jobs whose line names none (10)")
    p.add_argument("--checkpoint-minutes", type=float, default=30.0, metavar="M",
                   help="a job's checkpoint interval, for jobs whose line names none: a "
                        "move loses the work since the last checkpoint (30; 0: none lost)")
    p.add_argument("--step-minutes", type=float, default=10.0, metavar="M",
                   help="the simulated market's poll interval, and how often waiting "
                        "requests retry and interruptions are drawn (10)")
    p.add_argument("--max-wait-hours", type=float, default=24.0, metavar="H",
                   help="a request waiting longer is never placed / abandoned (24)")
    p.add_argument("--default-interruption-rate", type=float, default=0.05, metavar="R",
                   help="interruptions per hour of a spot pool the trace gives none (0.05)")
    p.add_argument("--pool-wide-share", type=float, default=POOL_WIDE_SHARE, metavar="S",
                   help="the share of a spot pool's hazard that strikes every lease on it at "
                        f"once, 0..1 (default {POOL_WIDE_SHARE:g}; "
                        f"{CORRELATED_POOL_WIDE_SHARE:g}: the correlated market variant)")
    p.add_argument("--format", choices=["table", "json"], default="table",
                   help="the report on stdout: table for people (default), or json")
    p.add_argument("--json-out", type=Path, metavar="FILE", help="also write the JSON report")
    p.add_argument("--chart", type=Path, metavar="FILE.png",
                   help="cost per useful GPU-hour against interruptions, as a PNG")
    p.add_argument("--save-market", type=Path, metavar="FILE",
                   help="write the market as a trace file (.jsonl or .csv, optionally .gz): "
                        "the observed rows only; a simulated market replayed from it draws "
                        "interruptions from the observed rates times a hidden per-pool "
                        "factor, not its hidden truth")
    p.add_argument("--save-workload", type=Path, metavar="FILE",
                   help="write the workload as a workload file")
    p.add_argument("--private-gpus", type=int, metavar="N",
                   help="add a private pool of N GPUs (whole servers: N rounded up to "
                        "--private-gpus-per-server) for the whole run, never interrupted, "
                        "and run every strategy twice on the same market, requests and "
                        "draws: cloud only and with the pool; the report adds what the pool "
                        "saved and how busy it was")
    p.add_argument("--private-gpu", metavar="MODEL",
                   help=f"the private pool's GPU model ({PRIVATE_DEFAULTS.gpu})")
    p.add_argument("--private-gpus-per-server", type=int, metavar="N",
                   help=f"GPUs per private server; a server goes to one lease at a time "
                        f"({PRIVATE_DEFAULTS.per_server})")
    p.add_argument("--private-slices", type=int, metavar="N",
                   help="leases a private server may hold at once, each of its GPUs / N "
                        "(the servers file's slices; must divide "
                        "--private-gpus-per-server) (1: whole servers)")
    p.add_argument("--private-price", type=float, metavar="USD",
                   help="the internal marginal price per GPU-hour a lease on the private "
                        "pool pays (0); the pool's fixed cost is counted in neither run")


def _progress(err: TextIO) -> Any:
    if not err.isatty():
        return None

    def show(text: str) -> None:
        err.write(f"\r\033[K{text}")
        err.flush()

    return show


def run(args: argparse.Namespace) -> int:
    """`gpubroker backtest`: every problem with the options at once (exit 2), then each
    seed's run, then the report."""
    from broker.backtest import compare as cmp
    from broker.backtest.ledger import Settings
    from policies.loader import load_policy

    err = sys.stderr
    names = [n.strip() for n in args.strategy.split(",") if n.strip()]
    private, problems = _problems(args, names)
    if problems:
        for p in problems:
            _say(err, f"{p}")
        return EXIT_USAGE

    settings = Settings(step_seconds=args.step_minutes * 60.0,
                        max_wait_hours=args.max_wait_hours,
                        default_interruption_rate=args.default_interruption_rate,
                        startup_minutes=args.startup_minutes,
                        checkpoint_minutes=args.checkpoint_minutes,
                        pool_wide_share=args.pool_wide_share)
    if args.policy is not None:
        policy = load_policy(args.policy)  # SourceError: gpubroker main prints it, exit 2
        policy_name = str(args.policy)
    else:
        policy, policy_name = cmp.embedded_policy(args.restart_hours)
    settings = replace(settings, restart_hours=policy.scoring.restart_hours)
    show = _progress(err)
    replay = _Replay(args, names, policy, policy_name, settings, private, show, err)
    runs: list[cmp.Comparison] = []
    # While the backtest computes, native code (HiGHS) writing to fd 1 must not get
    # into the report: fd 1 points at stderr until the report is written.
    with stdout_to_stderr():
        for i in range(args.seeds):
            outcome = replay.seed(i)
            if isinstance(outcome, int):
                return outcome
            runs.append(outcome)
    return _report(args, cmp.Seeds(tuple(runs)), show, err)


def _problems(args: argparse.Namespace, names: list[str]
              ) -> tuple[PrivateSite | None, list[str]]:
    """The private pool the options ask for, and every problem with the options, in the
    order of the help."""
    from broker.backtest import chart

    problems = [f"--strategy: unknown strategy {n!r}; expected {', '.join(STRATEGIES)}"
                for n in names if n not in STRATEGIES]
    if not names:
        problems.append("--strategy: name at least one strategy")
    if len(set(names)) != len(names):
        problems.append("--strategy: a strategy is named twice")
    problems += _range_problems(args)
    if args.chart is not None:
        try:
            chart.check_chart()
        except chart.ChartUnavailable as exc:
            problems.append(f"--chart: {exc}")
    for flag, path in (("--json-out", args.json_out), ("--chart", args.chart),
                       ("--save-market", args.save_market),
                       ("--save-workload", args.save_workload)):
        if path is not None and (problem := output_problem(flag, path)):
            problems.append(problem)
    private, bad = private_site(args)
    return private, problems + bad


def _range_problems(args: argparse.Namespace) -> list[str]:
    """The numbers out of their range, and --seeds > 1 without scipy."""
    problems: list[str] = []
    hours, minutes = MAX_SPAN_DAYS * 24.0, MAX_SPAN_DAYS * 1440.0
    for flag, value, low, high in (
            ("--restart-hours", 0.0 if args.restart_hours is None else args.restart_hours,
             0.0, hours),
            ("--max-wait-hours", args.max_wait_hours, 0.0, hours),
            ("--default-interruption-rate", args.default_interruption_rate, 0.0,
             MAX_INTERRUPTION_RATE),
            ("--startup-minutes", args.startup_minutes, 0.0, minutes),
            ("--checkpoint-minutes", args.checkpoint_minutes, 0.0, minutes)):
        if not value >= low:  # also NaN
            problems.append(f"{flag}: must be >= {low:g}, got {value!r}")
        elif value > high:
            problems.append(f"{flag}: must be at most {high:g}, got {value!r}")
    if not 0.0 <= args.pool_wide_share <= 1.0:  # also NaN
        problems.append(f"--pool-wide-share: must be within 0..1, got "
                        f"{args.pool_wide_share!r}")
    if not args.step_minutes > 0:
        problems.append(f"--step-minutes: must be > 0, got {args.step_minutes!r}")
    elif args.step_minutes > MAX_STEP_MINUTES:
        problems.append(f"--step-minutes: must be at most {MAX_STEP_MINUTES:g} "
                        f"(MAX_STEP_MINUTES), got {args.step_minutes!r}")
    if not args.seeds >= 1:
        problems.append(f"--seeds: must be >= 1, got {args.seeds!r}")
    elif args.seeds > MAX_SEEDS:
        problems.append(f"--seeds: must be at most {MAX_SEEDS} (MAX_SEEDS), "
                        f"got {args.seeds!r}")
    elif args.seeds > 1:
        try:
            importlib.import_module("scipy.stats")
        except ModuleNotFoundError:
            problems.append("--seeds: the confidence intervals need scipy: pip install "
                            "'gpubroker[report]'")
    return problems


@dataclass
class _Replay:
    """The runs of one backtest, a seed at a time; a market already loaded for the same
    seed (or file) is replayed again, not loaded again."""

    args: argparse.Namespace
    names: list[str]
    policy: Any
    policy_name: str
    settings: Any
    private: PrivateSite | None
    show: Any
    err: TextIO
    markets: dict[Any, Any] = field(default_factory=dict)

    def seed(self, i: int) -> Any:
        """Run `i`'s comparison (broker.backtest.compare.Comparison), or the exit code
        of what stopped it (an int)."""
        from broker.backtest import compare as cmp
        from broker.backtest.market import MarketError, load_market, parse_sim_spec, save_market
        from broker.backtest.workload import WorkloadError, load_or_generate, save_workload

        args, err, show, settings, private = (self.args, self.err, self.show, self.settings,
                                              self.private)
        markets, names, policy, policy_name = (self.markets, self.names, self.policy,
                                               self.policy_name)
        # run i: each seed not given explicitly is --seed + i
        seeds = {n: args.seed + i if getattr(args, f"{n}_seed") is None
                 else getattr(args, f"{n}_seed") for n in ("market", "workload", "draw")}
        progress = show if show is None or args.seeds == 1 else \
            (lambda text, i=i: show(f"seed {i + 1}/{args.seeds}: {text}"))
        try:
            spec = parse_sim_spec(args.market, default_seed=seeds["market"])
            same = str(spec) if spec is not None else \
                None if args.keep_zone_labels else seeds["market"]
            market = markets.get(same)
            if market is None:
                market = markets[same] = load_market(
                    args.market, seed=seeds["market"], step_seconds=settings.step_seconds,
                    progress=progress, keep_zone_labels=args.keep_zone_labels)
            if args.save_market is not None and i == 0:
                n = save_market(market, args.save_market)
                _clear(progress, err)
                _say(err, f"wrote {n} market rows to {args.save_market}")
            workload = load_or_generate(args.workload, seed=seeds["workload"], market=market)
            if private is not None and i == 0 and not any(
                    private.gpu in a.request.gpu for a in workload.arrivals):
                _clear(progress, err)
                _say(err, f"note: no request of the workload asks for "
                      f"{private.gpu}: the private pool stays idle")
            run_settings = replace(settings, seed=seeds["draw"], market_seed=market.seed,
                                   workload_seed=workload.seed)
        except MarketError as exc:
            _clear(progress, err)
            _say(err, f"{exc}")
            return EXIT_USAGE
        except WorkloadError as exc:
            _clear(progress, err)
            for p in exc.problems:
                _say(err, f"{p}")
            return EXIT_USAGE
        except OSError as exc:  # writing --save-market (the checks above make it rare)
            _clear(progress, err)
            _say(err, f"--save-market: {error_line(exc)}")
            return EXIT_RUNTIME
        try:
            if args.save_workload is not None and i == 0:
                save_workload(workload, args.save_workload, market=market)
                _say(err, f"wrote {len(workload.arrivals)} requests to "
                      f"{args.save_workload}")
            return cmp.compare(market, workload, names, policy, run_settings,
                               policy_name=policy_name, progress=progress,
                               private=private)
        except MarketError as exc:  # the trace has the private pool's key already
            _clear(progress, err)
            _say(err, f"--private-gpus: {exc}")
            return EXIT_USAGE
        except OSError as exc:  # --save-workload could not be written after all
            _clear(progress, err)
            _say(err, f"{error_line(exc)}")
            return EXIT_RUNTIME


def _report(args: argparse.Namespace, result: Any, show: Any, err: TextIO) -> int:
    """The report on stdout (table or JSON), --json-out and --chart; the speed on stderr."""
    from broker.backtest import chart
    from broker.backtest.report import write_seeds_table

    try:
        _clear(show, err)
        report = result.dumps()
        if args.json_out is not None:
            args.json_out.write_text(report, encoding="utf-8")
        if args.format == "json":
            sys.stdout.write(report)
        else:
            write_seeds_table(result, sys.stdout)
        if args.chart is not None:
            chart.write_chart(result, args.chart)
    except BrokenPipeError:  # stdout's reader has gone: `gpubroker main` ends quietly
        raise
    except OSError as exc:  # a file could not be written after all (disk full ...)
        _clear(show, err)
        _say(err, f"{error_line(exc)}")
        return EXIT_RUNTIME
    _say(err, f"{result.speed_line()}")
    return EXIT_OK


def private_site(args: argparse.Namespace) -> tuple[PrivateSite | None, list[str]]:
    """The private pool the options ask for (None without `--private-gpus`), and the
    problems with them."""
    import math

    from broker.model import GPU_MODELS
    from broker.wire.validation import unknown_gpu

    problems = []
    others = (("--private-gpu", args.private_gpu),
              ("--private-gpus-per-server", args.private_gpus_per_server),
              ("--private-slices", args.private_slices),
              ("--private-price", args.private_price))
    if args.private_gpus is None:
        problems += [f"{flag}: needs --private-gpus N (the private pool's size)"
                     for flag, value in others if value is not None]
    elif args.private_gpus < 1:
        problems.append(f"--private-gpus: must be >= 1, got {args.private_gpus!r}")
    gpu = PRIVATE_DEFAULTS.gpu if args.private_gpu is None else args.private_gpu
    if gpu not in GPU_MODELS:
        problems.append(f"--private-gpu: {unknown_gpu(gpu, GPU_MODELS)}")
    per_server = PRIVATE_DEFAULTS.per_server if args.private_gpus_per_server is None \
        else args.private_gpus_per_server
    if per_server < 1:
        problems.append(f"--private-gpus-per-server: must be >= 1, got {per_server!r}")
    elif per_server > MAX_GPUS:
        problems.append(f"--private-gpus-per-server: must be at most {MAX_GPUS} "
                        f"(MAX_GPUS), got {per_server!r}")
    elif args.private_gpus is not None and \
            -(-args.private_gpus // per_server) > MAX_PRIVATE_SERVERS:
        problems.append(f"--private-gpus: at most {MAX_PRIVATE_SERVERS:,} servers "
                        f"(MAX_PRIVATE_SERVERS) of {per_server} GPUs, got "
                        f"{args.private_gpus!r} GPUs")
    slices = 1 if args.private_slices is None else args.private_slices
    if slices < 1 or (per_server >= 1 and per_server % slices):
        problems.append(f"--private-slices: must divide the {per_server} GPUs of a server, "
                        f"got {slices!r}")
    price = PRIVATE_DEFAULTS.price if args.private_price is None else args.private_price
    if not (math.isfinite(price) and price >= 0):
        problems.append(f"--private-price: must be a number >= 0 (USD per GPU-hour), "
                        f"got {price!r}")
    elif price > MAX_PRICE_PER_HOUR:
        problems.append(f"--private-price: must be at most {MAX_PRICE_PER_HOUR:g} "
                        f"(USD per GPU-hour), got {price!r}")
    if problems or args.private_gpus is None:
        return None, problems
    return PrivateSite(args.private_gpus, gpu, per_server, price, slices), []


def _say(err: TextIO, text: str) -> None:
    """One line on stderr, `gpubroker: …`, its control characters escaped: the messages
    quote file names and values from the user's files (`broker.output.stdio.printable`)."""
    print(f"gpubroker: {printable(text)}", file=err)


def _clear(progress: Any, err: TextIO) -> None:
    if progress is not None:
        err.write("\r\033[K")
        err.flush()
