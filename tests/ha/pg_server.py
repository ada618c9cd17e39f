"""A PostgreSQL server of the test's own: ``initdb`` + ``pg_ctl`` on a free loopback port
in a temporary directory, for the faults a shared server cannot take (a restart, a
failover to a streaming replica, a synchronous standby that never comes).

PostgreSQL refuses to run as root. The tests run as root here and in CI, so the server's
programs then run as the `postgres` OS user (``runuser -u postgres --``; Debian's
`postgresql` package, which `.ci/run` installs, creates that user) in a directory it
owns, outside pytest's `tmp_path` (which only root may enter). The programs are found on
PATH, else in Debian's `/usr/lib/postgresql/<version>/bin`. Anything missing fails the
test with what is missing: it is never skipped.

* ``PgServer.primary()`` — a new cluster, started (``wal_level=replica`` and room for a
  replica, ``fsync=off``: the tests' durability is the server's process, not the disk).
* ``replica()`` — ``pg_basebackup -R`` of it: a streaming replica, started.
* ``restart()``, ``stop(mode)``, ``promote()``, ``sql()`` (one autocommit statement as the
  superuser), ``url(dbname)``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from mqtt_helpers import free_port

HOST = "127.0.0.1"
OS_USER = "postgres"


def _bin_dir() -> Path | None:
    """Where initdb, pg_ctl and pg_basebackup are: PATH, else Debian's versioned dir."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl") and shutil.which("pg_basebackup"):
        return None  # on PATH
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"),
                  key=lambda d: int(d.split("/")[-2]) if d.split("/")[-2].isdigit() else 0)
    for d in reversed(dirs):
        if (Path(d) / "initdb").exists() and (Path(d) / "pg_ctl").exists():
            return Path(d)
    raise AssertionError("initdb/pg_ctl/pg_basebackup not found on PATH nor in "
                         "/usr/lib/postgresql/*/bin: install PostgreSQL's server "
                         "(`.ci/run` installs Debian's `postgresql` package)")


def _as_root() -> bool:
    return os.geteuid() == 0


def _check_os_user() -> None:
    if not _as_root():
        return
    try:
        pwd.getpwnam(OS_USER)
    except KeyError:
        raise AssertionError(
            "the tests run as root and PostgreSQL refuses to: its programs run as the OS "
            f"user {OS_USER!r}, which does not exist (Debian's `postgresql` package creates "
            "it; `.ci/run` installs that package)") from None
    if shutil.which("runuser") is None:
        raise AssertionError("runuser not found: needed to run PostgreSQL as user "
                             f"{OS_USER!r} while the tests run as root")


class PgServer:
    """One PostgreSQL server (cluster) of the test's own (see the module docstring)."""

    def __init__(self, root: Path, port: int, name: str) -> None:
        self.root = root
        self.data = root / name
        self.log = root / f"{name}.log"
        self.port = port
        self.name = name
        self.bin = _bin_dir()
        self.replicas: list[PgServer] = []

    # --- running the programs --------------------------------------------------------

    def _cmd(self, program: str, *args: str) -> list[str]:
        exe = str(self.bin / program) if self.bin is not None else program
        cmd = [exe, *args]
        return ["runuser", "-u", OS_USER, "--", *cmd] if _as_root() else cmd

    def run(self, program: str, *args: str, timeout: float = 60.0
            ) -> str:
        # Output to a file, not a pipe: a server that pg_ctl starts inherits it, and a
        # pipe would stay open (and the call waiting) as long as the server runs.
        with tempfile.TemporaryFile("w+") as output:
            out = subprocess.run(self._cmd(program, *args), stdin=subprocess.DEVNULL,
                                 stdout=output, stderr=subprocess.STDOUT, text=True,
                                 timeout=timeout, check=False, cwd=self.root)
            output.seek(0)
            text = output.read()
        if out.returncode != 0:
            raise AssertionError(f"{program} {' '.join(args)}: exit {out.returncode}\n"
                                 f"{text}\n{self.log_tail()}")
        return text

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            tail = self.log.read_text(errors="replace").splitlines()[-lines:]
            return f"--- PostgreSQL {self.name} log (tail) ---\n" + "\n".join(tail)
        return ""

    # --- the cluster -----------------------------------------------------------------

    @classmethod
    def primary(cls, root: Path, **conf: str) -> PgServer:
        """initdb a new cluster in `root` and start it; `conf`: more settings."""
        server = cls(root, free_port(), "primary")
        server.run("initdb", "-D", str(server.data), "-A", "trust", "-U", "postgres",
                   "--no-sync", "-E", "UTF8", "--no-instructions")
        settings = {"listen_addresses": f"'{HOST}'", "port": str(server.port),
                    "unix_socket_directories": f"'{root}'", "fsync": "off",
                    "synchronous_commit": "on", "full_page_writes": "off",
                    "wal_level": "replica", "max_wal_senders": "4",
                    "max_replication_slots": "4", "wal_keep_size": "'256MB'",
                    "max_connections": "100", "logging_collector": "off",
                    "log_line_prefix": "'%m [%p] %a '", **conf}
        with (server.data / "postgresql.conf").open("a") as f:
            f.write("\n# the test's own settings\n")
            for key, value in settings.items():
                f.write(f"{key} = {value}\n")
        with (server.data / "pg_hba.conf").open("a") as f:
            f.write(f"host replication all {HOST}/32 trust\n")
        server.start()
        return server

    def replica(self) -> PgServer:
        """A streaming replica of this server (`pg_basebackup -R`), started: asynchronous
        replication, hot standby (it answers reads)."""
        other = PgServer(self.root, free_port(), "replica")
        self.run("pg_basebackup", "-D", str(other.data), "-h", HOST, "-p", str(self.port),
                 "-U", "postgres", "-R", "-X", "stream", "--no-sync", "-c", "fast")
        with (other.data / "postgresql.conf").open("a") as f:
            f.write(f"port = {other.port}\nhot_standby = on\n")
        other.start()
        self.replicas.append(other)
        return other

    def start(self) -> None:
        self.run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "30",
                 "start")

    def restart(self, mode: str = "fast") -> float:
        """`pg_ctl restart -m MODE`; its wall time in seconds."""
        t = time.monotonic()
        self.run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-m", mode, "-w", "-t",
                 "30", "restart")
        return time.monotonic() - t

    def stop(self, mode: str = "fast") -> None:
        self.run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "30", "stop")

    def promote(self) -> None:
        """End recovery: the replica becomes a primary (waits until it accepts writes)."""
        self.run("pg_ctl", "-D", str(self.data), "-w", "-t", "30", "promote")

    def running(self) -> bool:
        out = subprocess.run(self._cmd("pg_ctl", "-D", str(self.data), "status"),
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, timeout=30, check=False,
                             cwd=self.root)
        return out.returncode == 0

    def kill_quietly(self) -> None:
        """Teardown: stop it and its replicas at once, whatever their state."""
        for other in self.replicas:
            other.kill_quietly()
        if self.data.exists() and self.running():
            with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
                self.stop("immediate")

    # --- SQL ---------------------------------------------------------------------------

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@{HOST}:{self.port}/{dbname}"

    def sql(self, statement: str, *args: Any, dbname: str = "postgres"
            ) -> list[tuple[Any, ...]]:
        """One statement in autocommit as the superuser; its rows (none: [])."""
        import psycopg

        with psycopg.connect(self.url(dbname), autocommit=True, connect_timeout=5) as c:
            cur = c.execute(statement, args or None)
            return list(cur.fetchall()) if cur.description is not None else []


@contextlib.contextmanager
def server_root() -> Any:
    """A temporary directory the server's OS user owns (removed afterwards)."""
    _check_os_user()
    root = Path(tempfile.mkdtemp(prefix="gpubroker-test-pg-"))
    try:
        if _as_root():
            shutil.chown(root, OS_USER, OS_USER)
        root.chmod(0o700)
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


__all__ = ["PgServer", "server_root"]
