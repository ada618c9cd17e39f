"""Which adapters the configuration asks for, built lazily.

Each cloud's adapter (and its heavy SDK) is imported only when that cloud is configured.
A cloud that cannot be built is reported with a clear reason and the daemon runs on with
the others.
"""

from __future__ import annotations

import importlib

from adapters.base import CloudAdapter
from adapters.errors import AdapterError
from broker.daemon.config import Config

_REAL = ("aws", "gcp", "azure", "alibaba", "private")


def build_adapters(cfg: Config) -> tuple[list[CloudAdapter], list[tuple[str, str]]]:
    """Returns the adapters that could be built and (cloud, problem) for the others."""
    adapters: list[CloudAdapter] = []
    problems: list[tuple[str, str]] = []
    clouds = cfg.clouds
    if clouds.sim is not None:
        from adapters.sim import SimAdapter

        s = clouds.sim
        adapters.append(SimAdapter(
            seed=s.seed, clouds=tuple(s.clouds), regions_per_cloud=s.regions_per_cloud,
            zones_per_region=s.zones_per_region,
            preempt_rate_multiplier=s.preempt_rate_multiplier,
            signal_interval_seconds=s.signal_interval_seconds))
    for name in _REAL:
        section = getattr(clouds, name)
        if section is None:
            continue
        try:
            module = importlib.import_module(f"adapters.{name}.adapter")
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith(f"adapters.{name}"):
                problems.append((name, f"{name} is not supported by this version of gpubroker"))
            else:
                problems.append((name, f"{name} support needs {exc.name}: "
                                       f"pip install 'gpubroker[{name}]'"))
            continue
        try:
            adapters.append(module.from_config(section))
        except AdapterError as exc:
            problems.append((name, str(exc)))
    return adapters, problems
