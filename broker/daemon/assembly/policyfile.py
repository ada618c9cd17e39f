"""The policy file, read again on SIGHUP and when its content changes: validated, then
applied, or refused with a `policy.rejected` (once per change of the file)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from broker.daemon.assembly.tasks import hazard_estimator
from broker.daemon.config import Config
from broker.edges.sdnotify import Notifier
from broker.leasing.authority import Broker
from broker.market.hazard import HazardEstimator
from broker.output.ratelimit import Every
from gpubroker_client import files
from policies import yamlsrc
from policies.loader import SourceError, parse_policy_bytes, policy_hash
from policies.model import Policy

log = structlog.get_logger("gpubroker.daemon")
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS)
"""A read failing with one of these says nothing about the file: try it again later."""


class PolicyReloading:
    """The policy file's part of the daemon (`Daemon` is made of it)."""

    if TYPE_CHECKING:
        cfg: Config
        broker: Broker
        notifier: Notifier
        hazard: HazardEstimator
        policy: Policy
        policy_digest: str | None
        _rejected_digest: str | None
        _forced_pending: bool
        _unreadable_log: Every
        _reload: asyncio.Event
        _reloading: asyncio.Lock

        def status_line(self) -> str: ...

    def request_reload(self) -> None:
        """SIGHUP: read the policy file again now."""
        self._reload.set()

    async def reload_policy(self, *, forced: bool = False) -> str:
        """Read, validate and apply the policy file if it changed (or `forced`).
        Returns "applied", "rejected" or "unchanged"."""
        async with self._reloading:
            return await self._reload_policy(forced)

    async def _reload_policy(self, forced: bool) -> str:
        path = self.cfg.policy_file
        if path is None:
            return "unchanged"
        if not forced:
            return await self._reload_policy_file(path, forced)
        # A SIGHUP (systemctl reload) is a reload systemd waits for: tell it.
        self.notifier.reloading()
        try:
            return await self._reload_policy_file(path, forced)
        finally:
            self.notifier.ready(self.status_line())

    async def _reload_policy_file(self, path: Path, forced: bool) -> str:
        """The file is read and parsed by the readers a start uses (`broker.daemon.files`:
        a regular file of at most 1 MiB, strict UTF-8; `yamlsrc`: every YAML failure an
        error naming line and key), off the event loop: a FIFO, `/dev/zero` or a
        42,000-team policy neither blocks nor stalls the daemon. A refusal is published
        once per change of the file — of its content, or for a file that is not read,
        of why and of what it is (inode, size, modification time)."""
        try:
            raw = await asyncio.to_thread(files.read_bytes, path, yamlsrc.MAX_BYTES)
        except OSError as exc:
            if exc.errno in _OUT_OF_RESOURCES:
                # The process (or system) is out of descriptors or memory, e.g. while
                # HTTP clients hold many connections: nothing is wrong with the file.
                # Not a policy.rejected; the watcher tries again (a SIGHUP's forced
                # reload too) on its next round.
                self._forced_pending = self._forced_pending or forced
                if n := self._unreadable_log.hit():
                    log.warning("policy file not read now; retrying", file=str(path),
                                error=exc.strerror, count=n)
                return "unchanged"
            problem = yamlsrc.unreadable(path, exc)
            seen = f"unreadable: {problem} {getattr(exc, 'identity', None)}"
            if forced or self._rejected_digest != seen:
                self._rejected_digest = seen
                await self.broker.reject_policy(str(path), [problem])
            return "rejected"
        digest = policy_hash(raw)
        if digest == self.policy_digest and not forced:
            return "unchanged"
        if digest == self._rejected_digest and not forced:
            return "rejected"
        try:
            policy = await asyncio.to_thread(parse_policy_bytes, raw, str(path))
        except SourceError as err:
            self._rejected_digest = digest
            await self.broker.reject_policy(str(path), err.problems)
            return "rejected"
        self._rejected_digest = None
        self.policy = policy
        self.policy_digest = digest
        hazard_estimator(policy, self.hazard)
        await self.broker.apply_policy(policy, digest, str(path))
        return "applied"

    async def _watch_policy(self, every_seconds: float = 2.0) -> None:
        """Reload on SIGHUP, and when the file's content changes."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(every_seconds):
                    await self._reload.wait()
            forced = self._reload.is_set() or self._forced_pending
            self._reload.clear()
            self._forced_pending = False
            await self.reload_policy(forced=forced)

