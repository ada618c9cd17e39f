"""The private adapter: the company's own GPU servers, as the servers file declares them
(`adapters.private.servers`), with their health (`adapters.private.health`).

Each site is a region. A poll of a site gives one offer per group of the site, in the
`reserved` market: `price_per_hour` is the group's internal price per GPU-hour times its
GPUs, `availability` is always 1 (a server that is down leaves the offer's `targets`
instead: an availability of 0 would move every lease of the pool), `targets` are the
group's servers that are up and not inside a maintenance window, one instance each,
`draining` those of them in a window's lead time, and `capacity` the targets that are
not draining.

The servers file is read again at each poll when it has changed. A file with errors is
logged once per change and the last good one stays in force; so does a file that is
gone. A file missing or with errors at start is an `InvalidConfig`: the cloud is not
built. Sites are the regions the file declared at start; a site added later is polled
from the next start (logged), a site removed is polled empty (its offers go).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import structlog

from adapters.base import CloudAdapter, run_blocking
from adapters.errors import InvalidConfig
from adapters.private.files import WatchedFile
from adapters.private.health import CONCURRENCY, MAX_BODY, HealthMonitor
from adapters.private.servers import MAX_BYTES, Group, Servers, SourceError, parse_servers
from broker.model import GPU_MODELS, Market, Offer, PoolKey, Target, utcnow

log = structlog.get_logger("gpubroker.private")

MAX_LOGGED_PROBLEMS = 50
"""Problems of a broken servers file put in its log line (the count says if more)."""


class PrivateAdapter(CloudAdapter):
    name = "private"

    def __init__(self, *, file: Path, health_timeout: float = 3.0,
                 clock: Callable[[], datetime] = utcnow,
                 probe_concurrency: int = CONCURRENCY, max_body: int = MAX_BODY) -> None:
        self.file = file
        self._clock = clock
        self._watched = WatchedFile(file, MAX_BYTES)
        try:
            raw = self._watched.read()
        except FileNotFoundError:
            raise InvalidConfig(f"clouds.private.file: {file}: no such file", cloud="private"
                                ) from None
        except OSError as exc:
            raise InvalidConfig(f"clouds.private.file: {file}: cannot read: "
                                f"{exc.strerror or exc}", cloud="private") from None
        try:
            self._servers = self._parse(raw)
        except SourceError as err:
            raise InvalidConfig("the servers file has errors: " + "; ".join(
                str(p) for p in err.problems[:MAX_LOGGED_PROBLEMS]), cloud="private") from None
        self._sites = list(self._servers.sites)
        self._known = set(self._sites)
        self._executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="private")
        self._file_lock = asyncio.Lock()
        self._refused: str | None = None  # the refusal last logged (logged once each)
        self.health = HealthMonitor(timeout=health_timeout, executor=self._executor,
                                    concurrency=probe_concurrency, max_body=max_body)

    def _parse(self, raw: bytes) -> Servers:
        return parse_servers(raw, str(self.file), base=self.file.parent)

    @property
    def servers(self) -> Servers:
        """The servers file in force (the last good one)."""
        return self._servers

    def regions(self) -> Sequence[str]:
        return self._sites

    def residency_tags(self) -> dict[str, list[str]]:
        """Each residency tag of the servers file's sites, with its sites as policies
        name regions: `{"eu": ["private:fra1", "private:ams1"]}`."""
        return self._servers.residency_tags()

    async def poll(self, region: str) -> list[Offer]:
        """The offers of the site `region`, one per group (see the module's docstring).
        Raises `InvalidConfig` for a site the servers file never declared; nothing else
        (a broken file or a failing health probe never fails a poll)."""
        if region not in self._known:
            raise InvalidConfig(f"site {region!r} is not in the servers file",
                                cloud="private", region=region)
        await self._reread()
        servers = self._servers
        if region not in servers.sites:
            return []
        now = self._clock()
        closed, draining = servers.out_of_service(now)
        groups = [g for g in servers.groups if g.site == region]
        serving = {s for g in groups for s in g.servers if s not in closed}
        down = await self.health.down(groups, serving, servers.names())
        return [self._offer(g, now, serving, draining, down) for g in groups]

    def _offer(self, group: Group, now: datetime, serving: set[str], draining: frozenset[str],
               down: dict[str, str]) -> Offer:
        # An instance is a slice of a server (the whole server unless `slices` says
        # otherwise); a server that is up is a target with that many slots.
        n = group.slices
        targets = tuple(Target(s, n, n) for s in group.servers
                        if s in serving and s not in down)
        leaving = tuple(t.id for t in targets if t.id in draining)
        model = GPU_MODELS[group.gpu]
        gpus = group.gpus // n
        return Offer(
            pool=PoolKey("private", group.site, group.zone, group.name, Market.RESERVED),
            gpu=group.gpu, gpus=gpus, gpu_memory_gb=model.memory_gb,
            vcpus=group.vcpus // n if group.vcpus else group.vcpus,
            memory_gb=group.memory_gb / n if group.memory_gb else group.memory_gb,
            price_per_hour=group.price_per_gpu_hour * gpus, observed_at=now,
            availability=1.0, capacity=(len(targets) - len(leaving)) * n,
            interruption_rate=None, targets=targets, draining=leaving)

    async def _reread(self) -> None:
        """Read the servers file again if it changed; keep the last good one when the new
        one has errors, is gone or is refused (a FIFO, a device, over `MAX_BYTES`):
        logged once per change — of the content, or of why and what the file is — and
        read off the event loop."""
        async with self._file_lock:
            try:
                raw = await run_blocking(self._executor, self._watched.changed)
            except OSError as exc:
                why = exc.strerror or str(exc)
                refusal = f"{why} {getattr(exc, 'identity', None)}"
                if refusal != self._refused:
                    self._refused = refusal
                    log.error("private servers file unreadable; keeping the last good one",
                              file=str(self.file), why=why)
                return
            if self._refused is not None:
                self._refused = None
                log.info("private servers file readable again", file=str(self.file))
            if raw is None:
                return
            try:
                servers = await run_blocking(self._executor, self._parse, raw)
            except SourceError as err:
                log.error("private servers file has errors; keeping the last good one",
                          file=str(self.file), count=len(err.problems),
                          problems=[str(p) for p in err.problems[:MAX_LOGGED_PROBLEMS]])
                return
            self._install(servers)

    def _install(self, servers: Servers) -> None:
        new_sites = [s for s in servers.sites if s not in self._known]
        if new_sites:
            log.warning("private sites added to the servers file are polled from the next "
                        "start", sites=new_sites)
        gone = [s for s in self._servers.sites if s not in servers.sites]
        self._servers = servers
        self.health.forget(servers.names())
        log.info("private servers file reloaded", file=str(self.file),
                 sites=len(servers.sites), groups=len(servers.groups),
                 servers=servers.server_count, **({"sites_removed": gone} if gone else {}))

    async def close(self) -> None:
        await self.health.prober.close()
        self._executor.shutdown(wait=False, cancel_futures=True)


def from_config(section: Any, **kwargs: Any) -> PrivateAdapter:
    """Build the adapter from the daemon configuration's `clouds.private` section.
    Raises `InvalidConfig` when the servers file is missing or has errors."""
    return PrivateAdapter(file=section.file, health_timeout=section.health_timeout_seconds,
                          **kwargs)
