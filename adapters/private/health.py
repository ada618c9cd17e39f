"""Which private servers are up: each group's health source, read at each poll.

* `prometheus` — each server's exporter, probed concurrently over HTTP (at most
  `CONCURRENCY` at once, each within the configured timeout, answers of at most
  `MAX_BODY` bytes) and read as Prometheus text. A server is down when it does not
  answer in time, answers an HTTP error or something that is not Prometheus text, or
  its DCGM exporter reports trouble: an XID error (`DCGM_FI_DEV_XID_ERRORS` > 0 on any
  GPU), uncorrectable ECC errors (`DCGM_FI_DEV_ECC_DBE_VOL_TOTAL` > 0), or fewer GPUs
  (distinct `gpu` labels of the `DCGM_FI_*` samples) than the group declares. An
  exporter with no DCGM metrics (node exporter) is healthy when it answers.
* `file` — a YAML file the ops team edits, `{down: [names]}`, read again when it
  changes. A file with errors, or gone, keeps its last good reading (logged once per
  change); until one was read, its groups' servers count as down. Names the servers
  file does not declare are warned about, once per change.

Health never fails a poll: what goes wrong only marks servers down. A server's change
of health (up to down, down to up) is logged once, when it happens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import structlog
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from adapters.base import run_blocking
from adapters.common import remaining
from adapters.private.files import WatchedFile
from adapters.private.servers import Group
from policies import yamlsrc
from policies.yamlsrc import SourceError

log = structlog.get_logger("gpubroker.private")

CONCURRENCY = 64
"""Probes in flight at once, across every site."""
MAX_BODY = 4 << 20
"""The largest exporter answer read (4 MiB; a DCGM exporter of 8 GPUs sends ~100 KiB)."""
DEADLINE_MARGIN = 1.0
"""Seconds before the poll's deadline by which probing stops: probes still running then
leave their servers' health as it was."""

XID = "DCGM_FI_DEV_XID_ERRORS"
ECC_DBE = "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"
NOT_PROBED = "not probed yet"


def judge(body: bytes, gpus: int) -> str | None:
    """Why a server whose exporter answered `body` counts as down (None: it is up);
    `gpus` is how many GPUs the server has."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return "the answer is not Prometheus text (not UTF-8)"
    try:
        # By family name: the parser names a counter's samples `<name>_total` when the
        # exporter did not (dcgm-exporter's ECC counters).
        samples = [(family.name, s) for family in text_string_to_metric_families(text)
                   for s in family.samples]
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        return f"the answer is not Prometheus text: {str(exc)[:120]}"
    if not samples:
        return "the answer holds no metrics"
    dcgm = [(name, s) for name, s in samples if name.startswith("DCGM_FI_")]
    if not dcgm:
        return None  # node exporter: answering is healthy
    for metric, what in ((XID, "XID errors"), (ECC_DBE, "uncorrectable ECC errors")):
        bad = sorted({s.labels.get("gpu", "?") for name, s in dcgm
                      if name == metric and s.value > 0}, key=_gpu_order)
        if bad:
            return f"{what} ({metric}) on GPU {', '.join(bad)}"
    seen = {s.labels["gpu"] for _, s in dcgm if "gpu" in s.labels}
    if len(seen) < gpus:
        return f"DCGM sees {len(seen)} of {gpus} GPUs"
    return None


def _gpu_order(gpu: str) -> tuple[int, str]:
    return (int(gpu), "") if gpu.isdigit() else (1 << 30, gpu)


class _TooLarge(Exception):
    pass


class Prober:
    """Probes exporters over HTTP: one client session, at most `concurrency` requests at
    once, each given `timeout` seconds."""

    def __init__(self, *, timeout: float, executor: Executor | None,
                 concurrency: int = CONCURRENCY, max_body: int = MAX_BODY) -> None:
        self.timeout = timeout
        self.max_body = max_body
        self._executor = executor
        self._concurrency = concurrency
        self._slots = asyncio.Semaphore(concurrency)
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._concurrency),
                timeout=aiohttp.ClientTimeout(total=self.timeout), trust_env=False)
        return self._session

    async def probe(self, url: str, gpus: int) -> str | None:
        """Why the server behind `url` counts as down (None: it is up). Never raises."""
        async with self._slots:
            try:
                async with asyncio.timeout(self.timeout):
                    body = await self._get(url)
            except TimeoutError:
                return f"no answer within {self.timeout:g} s"
            except _TooLarge:
                return f"the answer is larger than {self.max_body >> 20} MiB"
            except aiohttp.ClientResponseError as exc:
                return f"HTTP {exc.status}"
            except (aiohttp.ClientError, OSError, ValueError) as exc:
                return f"no answer: {type(exc).__name__}: {str(exc)[:160]}"
        return await run_blocking(self._executor, judge, body, gpus)

    async def _get(self, url: str) -> bytes:
        async with self._client().get(url, allow_redirects=False) as resp:
            if resp.status != 200:
                raise aiohttp.ClientResponseError(resp.request_info, resp.history,
                                                  status=resp.status)
            if (resp.content_length or 0) > self.max_body:
                raise _TooLarge
            body = bytearray()
            async for chunk in resp.content.iter_chunked(1 << 16):
                body += chunk
                if len(body) > self.max_body:
                    raise _TooLarge
            return bytes(body)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class _DownFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    down: list[str] = Field(default_factory=list)


@dataclass(slots=True)
class _Reading:
    """A health file's last good reading (`down` None: never read)."""

    watched: WatchedFile
    down: frozenset[str] | None = None
    why: str = "not read yet"
    failing: str | None = None  # the problem last logged (logged again only if it changes)


class HealthMonitor:
    """The health of every server, as of the last poll of its site."""

    def __init__(self, *, timeout: float, executor: Executor | None,
                 concurrency: int = CONCURRENCY, max_body: int = MAX_BODY) -> None:
        self.prober = Prober(timeout=timeout, executor=executor, concurrency=concurrency,
                             max_body=max_body)
        self._executor = executor
        self._files: dict[Path, _Reading] = {}
        self._files_lock = asyncio.Lock()
        self._state: dict[str, str | None] = {}  # server -> why it is down (None: up)

    def state(self, server: str) -> str | None:
        """Why `server` was down at its last check (None: up, or never checked)."""
        return self._state.get(server)

    async def down(self, groups: Sequence[Group], servers: Collection[str],
                   declared: Collection[str]) -> dict[str, str]:
        """Which of `servers` (of `groups`) are down now, and why. `declared` is every
        server of the servers file (a health file naming others is warned about)."""
        checks: dict[str, str | None] = {}
        urls: dict[str, tuple[str, int]] = {}
        by_file: dict[Path, list[str]] = {}
        group_of: dict[str, Group] = {}
        for group in groups:
            health = group.health
            mine = [s for s in group.servers if s in servers]
            group_of.update(dict.fromkeys(mine, group))
            if health is None:
                checks.update(dict.fromkeys(mine))
            elif health.file is not None:
                by_file.setdefault(health.file, []).extend(mine)
            elif health.prometheus is not None:
                urls.update((s, (health.prometheus.replace("{server}", s), group.gpus))
                            for s in mine)
        for path, names in by_file.items():
            reading = await self._read(path, declared)
            for s in names:
                checks[s] = (f"health file {path}: {reading.why}" if reading.down is None
                             else "listed as down in the health file"
                             if s in reading.down else None)
        if urls:
            checks.update(await self._probe_all(urls))
        for server, why in checks.items():
            self._note(server, why, group_of[server])
        return {s: why for s in servers if (why := self._state.get(s, NOT_PROBED))}

    async def _probe_all(self, urls: Mapping[str, tuple[str, int]]) -> dict[str, str | None]:
        """Each server's probe answer (by its URL and GPU count), as far as they come
        before the poll's deadline (less a margin); probes still running then are
        cancelled and their servers left out."""
        probes = {s: asyncio.create_task(self.prober.probe(url, gpus))
                  for s, (url, gpus) in urls.items()}
        left = remaining()
        budget = None if left is None else max(0.0, left - DEADLINE_MARGIN)
        try:
            done, pending = await asyncio.wait(probes.values(), timeout=budget)
        finally:  # also when the poll itself is cancelled: no probe outlives it
            for task in probes.values():
                task.cancel()
        if pending:
            await asyncio.wait(pending)
            log.warning("private health probes cut short by the poll's deadline",
                        probed=len(done), not_probed=len(pending))
        return {s: t.result() for s, t in probes.items() if t in done}

    def _note(self, server: str, why: str | None, group: Group) -> None:
        before = self._state.get(server)  # never checked: as if up
        self._state[server] = why
        if (before is None) == (why is None):
            return
        if why is None:
            log.info("private server up", server=server, group=group.name, site=group.site)
        else:
            log.warning("private server down", server=server, why=why, group=group.name,
                        site=group.site)

    def forget(self, keep: Collection[str]) -> None:
        """Drop the health of servers no longer declared."""
        for server in [s for s in self._state if s not in keep]:
            del self._state[server]

    async def _read(self, path: Path, declared: Collection[str]) -> _Reading:
        async with self._files_lock:
            reading = self._files.get(path)
            if reading is None:
                reading = self._files[path] = _Reading(WatchedFile(path, yamlsrc.MAX_BYTES))
            try:
                raw = await run_blocking(self._executor, reading.watched.changed)
                if raw is None:
                    return reading
                down = _parse_down(raw, str(path))
            except (OSError, SourceError) as exc:
                problem = (f"cannot read: {exc.strerror or exc}" if isinstance(exc, OSError)
                           else str(exc))
                if reading.down is None:
                    reading.why = problem
                if reading.failing != problem:
                    reading.failing = problem
                    log.error("private health file unusable" + (
                        "; keeping its last good reading" if reading.down is not None else
                        "; its servers count as down"), file=str(path), problems=problem)
                return reading
            unknown = sorted(set(down) - set(declared))
            if unknown:
                log.warning("private health file names unknown servers", file=str(path),
                            servers=unknown[:20], count=len(unknown))
            if reading.failing is not None:
                log.info("private health file usable again", file=str(path))
            reading.down, reading.why, reading.failing = down, "", None
            return reading


def _parse_down(raw: bytes, name: str) -> frozenset[str]:
    doc = yamlsrc.parse_bytes(raw, name)
    try:
        spec = _DownFile.model_validate({} if doc.data is None else doc.data)
    except ValidationError as err:
        raise yamlsrc.from_validation_error(doc, err, _DownFile) from None
    return frozenset(spec.down)
