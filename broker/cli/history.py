"""`gpubroker history`: the recorded market history as a trace."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from broker.cli.common import EXIT_OK, EXIT_RUNTIME, config_at, error_line, output_problem, usage
from broker.output.stdio import printable

if TYPE_CHECKING:
    from collections.abc import Callable
    from datetime import datetime

    from broker.market.recorder import HistoryReader
    from broker.state.store import Db


def export_history(args: argparse.Namespace) -> int:
    """`gpubroker history`: the state file's market history as a trace (broker.market.traces),
    streamed in time order; a one-line summary on stderr at the end."""
    import gzip
    from collections.abc import Generator, Iterator

    from broker.market.recorder import HistoryReader
    from broker.market.traces import TraceRow, write_csv, write_jsonl
    from broker.model import Market, PoolKey, utcnow
    from broker.state.store import db_errors

    window = _window(args, utcnow())
    if isinstance(window, str):
        return usage(window)
    since, until = window
    found = _source(args)
    if isinstance(found, str):
        return usage(found)
    source, name = found
    if args.output is not None and (problem := output_problem("--output", args.output)):
        return usage(problem)
    fmt = _format(args)
    try:
        reader = HistoryReader(source)
    except db_errors() as err:
        what = "state file" if isinstance(source, Path) else "database"
        return usage(f"{name}: cannot read the {what}: {str(err).strip()}")
    with reader:
        if problem := _unknown_names(args, reader):
            return usage(problem)
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
    summary = _summary(n, len(pools), span, present=reader.present, name=name,
                       pruned=pruned, since=since)
    print(printable(summary), file=sys.stderr)
    return EXIT_OK


def _summary(n: int, pools: int, span: list[datetime], *, present: bool, name: str,
             pruned: datetime | None, since: datetime | None) -> str:
    """The line on stderr at the end: what was exported, and why it may be less than
    asked for."""
    from broker.market.traces import format_t

    summary = f"exported {n} changes of {pools} pools"
    if span:
        summary += f" from {format_t(span[0])} to {format_t(span[-1])}"
    if not present:
        summary += f" ({name} holds no market history)"
    elif pruned is not None and since is not None and since < pruned:
        summary += f" (history before {format_t(pruned)} is pruned: it starts there)"
    return summary


def _window(args: argparse.Namespace, now: datetime) -> tuple[datetime | None,
                                                               datetime | None] | str:
    """--since and --until as times (None: not given), or what is wrong with them."""
    from broker.market.traces import parse_when

    when: dict[str, datetime | None] = {}
    for option, text in (("--since", args.since), ("--until", args.until)):
        try:
            when[option] = parse_when(text, now) if text else None
        except ValueError as err:
            return f"{option}: {err}"
    since, until = when["--since"], when["--until"]
    if since is not None and until is not None and until <= since:
        return "--until must be later than --since"
    return since, until


def _source(args: argparse.Namespace) -> tuple[Path | Callable[[], Db], str] | str:
    """Where the history is read (the state file, or the database of state.url) and its
    name in messages; or why there is none."""
    from broker.state.configured import store_for

    if args.state is None and (cfg := config_at(args.config)).state.url:
        store = store_for(cfg.state, cfg.site)
        return store.reader, store.name
    path: Path = args.state or config_at(args.config).state.path
    if not path.is_file():
        return f"no state file at {path}" + (" (a directory)" if path.is_dir() else "")
    return path, str(path)


def _format(args: argparse.Namespace) -> str:
    """--format, else from --output's name, else jsonl."""
    from broker.market.traces import TraceError, trace_format

    if args.format is not None:
        return str(args.format)
    try:
        return trace_format(args.output)[0] if args.output else "jsonl"
    except TraceError:
        return "jsonl"


def _unknown_names(args: argparse.Namespace, reader: HistoryReader) -> str | None:
    """The first --gpu or --cloud name neither canonical nor recorded, told with the
    nearest one."""
    from broker.model import CLOUDS, GPU_MODELS
    from broker.wire.validation import unknown_gpu, unknown_name

    gpus, clouds = set(GPU_MODELS) | reader.names("gpu"), set(CLOUDS) | reader.names("cloud")
    for name in args.gpu or ():
        if name not in gpus:
            return f"--gpu: {unknown_gpu(name, gpus)}"
    for name in args.cloud or ():
        if name not in clouds:
            return f"--cloud: {unknown_name('cloud', name, clouds)}"
    return None
