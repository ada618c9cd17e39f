"""What the commands share: exit codes, the one-line messages, the configuration, one
poll of the market."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from broker.daemon.config import Config, load_config
from broker.output.stdio import printable

if TYPE_CHECKING:
    from broker.market.pool import ResourcePool

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE = 0, 1, 2


def config_at(path: Path | None) -> Config:
    """The daemon configuration in `path`, or the defaults without one."""
    return load_config(path) if path is not None else Config()


def poll_once(cfg: Config) -> tuple[ResourcePool, list[str]]:
    """One poll of every configured cloud, as `offers`, `policy explain` and `policy diff`
    see the market: the pool and the problems (a cloud that could not be built, a region
    whose poll failed), each already told on stderr in a line."""
    from broker.market.clouds import build_adapters
    from broker.market.poller import Poller
    from broker.market.pool import ResourcePool

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

    pool = asyncio.run(poll())
    for e in errors:
        print(f"gpubroker: {e}", file=sys.stderr)
    return pool, errors


def usage(message: str) -> int:
    """A mistake of the user's: one line on stderr, control characters escaped (it may
    quote a file name or a value the user gave), exit 2."""
    print(f"gpubroker: {printable(message)}", file=sys.stderr)
    return EXIT_USAGE


def quiet_logs() -> None:
    """Logs of a command that polls: errors only, on stderr. What a poll's failures mean
    for the command is printed by the command itself, once (`poll_once`)."""
    from broker.output import logs

    logs.configure(json=False, level=logging.ERROR)


def gpu_typo(option: str, gpus: Sequence[str] | None) -> str | None:
    """The first of `gpus` that no cloud can offer under that name, told before a poll:
    a name the adapters would map onto a canonical one (`H100`, `nvidia-tesla-t4`) is
    never a pool's name. Other names outside the canonical list wait for the poll."""
    from adapters.gpus import canonical
    from broker.model import GPU_MODELS
    from broker.wire.validation import unknown_gpu

    for name in gpus or ():
        if name not in GPU_MODELS and canonical(name)[1]:
            return f"{option}: {unknown_gpu(name, GPU_MODELS)}"
    return None


def output_problem(option: str, path: Path) -> str | None:
    """Why `path` cannot be written (a directory, or a folder that does not exist), told
    before a long run; None when it looks writable."""
    if path.is_dir():
        return f"{option}: {path} is a directory"
    folder = path.parent
    if not folder.is_dir():
        return f"{option}: {path}: no folder {folder}"
    if not os.access(folder, os.W_OK):
        return f"{option}: {path}: the folder {folder} is not writable"
    return None


def error_line(err: BaseException) -> str:
    """An error in one line: `FILE: reason` for a file's, else its text."""
    if isinstance(err, OSError) and err.strerror:
        return f"{err.filename}: {err.strerror}" if err.filename else err.strerror
    return str(err) or type(err).__name__
