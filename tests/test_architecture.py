"""The architecture's CI gates (#28). CI runs only the README's pytest command, so these
tests are how it enforces them:

* the import contracts of pyproject.toml's `[tool.importlinter]`, checked by
  import-linter (`lint-imports`): the shared vocabulary (`broker.model`) and the
  schedulers' client stay light, the cloud adapters stay independent of each other,
  the packages keep their layers (the command line on top, the shared vocabulary at the
  bottom), and no import cycle appears inside a package (the known exceptions are listed
  there, each to be removed by the package redesign);
* ruff over broker/, adapters/ and policies/, with the complexity (C901 at 15) and size
  (PLR0911/0912/0913/0915) limits: every function over them carries a `# noqa` and the
  reason on the line above.

A contract or a limit that catches nothing is worth nothing, so each is also run against
a copy of the code with a violation put in, and must fail there.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("broker", "adapters", "policies", "client/gpubroker_client")


def _lint_imports(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`lint-imports` run in `cwd`, which it puts first on sys.path, so a copy of the
    packages there is what it reads, not the installed ones. No cache: nothing is left
    in the tree, and a stale graph cannot hide an import. Its client/ (gpubroker_client)
    comes first on PYTHONPATH for the same reason."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(cwd / "client"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run(
        [sys.executable, "-c",
         "from importlinter.cli import lint_imports_command; "
         "lint_imports_command(prog_name='lint-imports')",
         "--no-cache", "--no-logo", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=50, check=False)


def _ruff(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=50, check=False)


def _importlinter_config() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        config: dict[str, Any] = tomllib.load(f)["tool"]["importlinter"]
    return config


def _contract(contract_id: str) -> dict[str, Any]:
    for contract in _importlinter_config()["contracts"]:
        if contract["id"] == contract_id:
            assert isinstance(contract, dict)
            return contract
    raise AssertionError(f"no contract {contract_id!r} in pyproject.toml")


# --- the import contracts ------------------------------------------------------------


def test_import_contracts_are_kept() -> None:
    r = _lint_imports(ROOT)
    report = r.stdout + r.stderr
    assert r.returncode == 0, report
    assert " 0 broken" in report, report
    ids = [c["id"] for c in _importlinter_config()["contracts"]]
    assert f"Contracts: {len(ids)} kept, 0 broken." in report, report


def _requirement_names(requirements: list[str]) -> list[str]:
    return [re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements]


def test_the_clients_contract_forbids_every_dependency_of_the_daemon_but_aiomqtt() -> None:
    """`gpubroker_client` imports nothing of broker, adapters or policies and, of the
    daemon's dependencies, aiomqtt alone: its own distribution (client/pyproject.toml)
    depends on nothing else. import-linter has no "only" for a package's imports, so the
    contract forbids the others by name; a dependency added to pyproject.toml must be
    added there too, or the client could import it unnoticed."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        daemon_deps = tomllib.load(f)["project"]["dependencies"]
    with (ROOT / "client" / "pyproject.toml").open("rb") as f:
        client_deps = tomllib.load(f)["project"]["dependencies"]
    assert _requirement_names(client_deps) == ["aiomqtt"]
    # the same bounds in both distributions
    assert client_deps == [d for d in daemon_deps if _requirement_names([d]) == ["aiomqtt"]]
    import_names = {"pyyaml": "yaml"}
    imported = {import_names.get(n, n.replace("-", "_")) for n in _requirement_names(daemon_deps)}
    forbidden = set(_contract("client-light")["forbidden_modules"])
    assert imported - {"aiomqtt"} - forbidden == set(), "add these to the client-light contract"
    assert {"broker", "adapters", "policies"} <= forbidden


def test_the_daemon_side_is_kept_from_every_module_of_the_client() -> None:
    """Of `gpubroker_client`, the daemon's side imports only the modules it shares with
    the client (model, files, mqtturl): never the client's `Lease` or `LeaseEnded`, which
    share their names with `broker.model.Lease` and `broker.wire.payloads.LeaseEnded`.
    A module added to either must be added to the contract."""
    contract = _contract("daemon-not-client")
    shared = {"__init__", "model", "files", "mqtturl"}
    client = {f"gpubroker_client.{p.stem}"
              for p in (ROOT / "client" / "gpubroker_client").glob("*.py")
              if p.stem not in shared}
    assert set(contract["forbidden_modules"]) == client
    parts = {f"broker.{p.stem}" for p in (ROOT / "broker").glob("*.py")
             if p.name != "__init__.py"}
    parts |= {f"broker.{p.parent.name}" for p in (ROOT / "broker").glob("*/__init__.py")}
    users = {"broker.cli", "broker.client"}  # the command line, the one-release alias
    assert set(contract["source_modules"]) == parts - users | {"adapters", "policies"}


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the packages and of pyproject.toml to put violations in."""
    root = tmp_path_factory.mktemp("tree")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, root / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


@pytest.fixture
def inject(tree_copy: Path) -> Iterator[Path]:
    """Yields the copy; every module changed in it is put back afterwards."""
    saved = {p: p.read_text() for package in PACKAGES for p in (tree_copy / package).rglob("*.py")}
    yield tree_copy
    for p, text in saved.items():
        if p.read_text() != text:
            p.write_text(text)


@pytest.mark.parametrize(("contract_id", "module", "line", "shown"), [
    ("model-alone", "broker/model.py", "from broker.state import store",
     "broker.model -> broker.state.store"),
    ("model-alone", "broker/model.py", "import policies.model",
     "broker.model -> policies.model"),
    ("client-light", "client/gpubroker_client/session.py", "from broker.daemon import config",
     "gpubroker_client.session -> broker.daemon.config"),
    ("client-light", "client/gpubroker_client/lease.py", "from broker.model import Lease",
     "gpubroker_client.lease -> broker.model"),
    ("client-light", "client/gpubroker_client/model.py", "import numpy",
     "gpubroker_client.model -> numpy"),
    ("daemon-not-client", "broker/leasing/book.py", "from gpubroker_client.lease import Lease",
     "broker.leasing.book -> gpubroker_client.lease"),
    # indirectly: through the package, which imports the whole client
    ("daemon-not-client", "policies/evaluate.py", "import gpubroker_client",
     "policies.evaluate -> gpubroker_client"),
    ("layers", "client/gpubroker_client/files.py", "from broker.output import logs",
     "gpubroker_client.files -> broker.output.logs"),
    ("layers", "adapters/sim.py", "from broker.daemon.assembly import Daemon",
     "adapters.sim -> broker.daemon.assembly"),
    ("layers", "policies/evaluate.py", "from broker.placement.optimizer import explain",
     "policies.evaluate -> broker.placement.optimizer"),
    ("layers", "broker/daemon/assembly/daemon.py", "from broker.cli import main",
     "broker.daemon.assembly.daemon -> broker.cli.main"),
    ("layers", "broker/edges/http.py", "from broker.cli import demo",
     "broker.edges.http -> broker.cli.demo"),
    ("layers", "broker/placement/optimizer.py", "from broker.leasing import book",
     "broker.placement.optimizer -> broker.leasing.book"),
    # the daemon and the backtest are independent parts of one layer
    ("layers", "broker/backtest/engine.py", "from broker.daemon import assembly",
     "broker.backtest.engine -> broker.daemon.assembly"),
    ("clouds-independent", "adapters/aws/adapter.py", "from adapters.gcp import pricing",
     "adapters.aws.adapter -> adapters.gcp.pricing"),
    # a new cycle: recorder already imports traces
    ("no-cycles", "broker/market/traces.py", "from broker.market import recorder",
     ".traces -> .recorder"),
    # a new cycle through the state store: leadership already imports store
    ("no-cycles", "broker/state/store.py", "from broker.state import leadership",
     ".store -> .leadership"),
    ("no-cycles", "policies/residency.py", "from policies import model",
     ".residency -> .model"),
])
def test_a_contract_catches_its_violation(inject: Path, contract_id: str, module: str,
                                          line: str, shown: str) -> None:
    # Kept on the copy as it is: the failure below is the injected import's doing.
    kept = _lint_imports(inject, "--contract", contract_id)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    target = inject / module
    target.write_text(target.read_text() + f"\n{line}\n")
    r = _lint_imports(inject, "--contract", contract_id)
    report = r.stdout + r.stderr
    assert r.returncode != 0, report
    assert "BROKEN" in report, report
    assert shown in report, report


def test_a_known_cycle_gone_must_leave_the_contracts() -> None:
    """Every `ignore_imports` entry is a known cycle, each marked in pyproject.toml as
    removed by the package redesign; once its import is gone, import-linter reports the
    unmatched entry as an error (its default), so none outlives its cycle."""
    for contract in _importlinter_config()["contracts"]:
        assert contract.get("unmatched_ignore_imports_alerting", "error") == "error"
    text = (ROOT / "pyproject.toml").read_text()
    section = text[text.index("[tool.importlinter]"):]
    ignored = [ln.strip() for ln in section.splitlines() if ln.strip().startswith('"broker.')
               and " -> " in ln]
    for entry in ignored:
        above = section.splitlines()[section.splitlines().index(f"  {entry}") - 1]
        assert ("known cycle, removed by the package redesign (#28)" in above
                or "known back-edge, removed by the package redesign (#28)" in above), entry


# --- ruff: lint, complexity and size ------------------------------------------------


def test_ruff_is_clean() -> None:
    r = _ruff(ROOT, *PACKAGES)
    assert r.returncode == 0, r.stdout + r.stderr


def _function(name: str, *, args: int = 1, ifs: int = 0, returns: int = 1,
              pad: int = 0) -> str:
    """A function of the given shape: `ifs` ifs in a row (complexity ifs + 1),
    `returns` returns (the last one at the end), `pad` more plain statements."""
    params = ", ".join(f"a{i}: int" for i in range(args))
    body = ["    x = a0"]
    body += [f"    if x == {i}:\n        x += 1" for i in range(ifs)]
    body += [f"    if x == {-1 - i}:\n        return {i}" for i in range(returns - 1)]
    body += ["    x += 1"] * pad
    body.append("    return x")
    return f"def {name}({params}) -> int:\n" + "\n".join(body) + "\n"


def test_ruff_keeps_complexity_and_size_in_check(tmp_path: Path) -> None:
    """The limits in pyproject.toml bite just above where they are set, and not at them."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    at_limits = [
        _function("complexity_15", ifs=14),
        _function("branches_15", ifs=15),  # complexity 16: C901's, below
        _function("args_8", args=8),
        _function("returns_8", returns=8),
        _function("statements_60", pad=59),
    ]
    over = {
        "C901": (_function("complexity_16", ifs=15), "(16 > 15)"),
        "PLR0912": (_function("branches_16", ifs=16), "(16 > 15)"),
        "PLR0913": (_function("args_9", args=9), "(9 > 8)"),
        "PLR0911": (_function("returns_9", returns=9), "(9 > 8)"),
        "PLR0915": (_function("statements_61", pad=60), "(61 > 60)"),
    }
    (tmp_path / "at_limits.py").write_text("\n\n".join(at_limits))
    r = _ruff(tmp_path, "at_limits.py", "--ignore", "C901", "--output-format", "concise")
    assert r.returncode == 0, r.stdout + r.stderr
    r = _ruff(tmp_path, "at_limits.py", "--output-format", "concise")
    assert r.stdout.count(" C901 ") == 1 and "branches_15" in r.stdout, r.stdout
    for code, (source, figures) in over.items():
        (tmp_path / f"{code}.py").write_text(source)
        r = _ruff(tmp_path, f"{code}.py", "--output-format", "concise")
        found = [ln for ln in r.stdout.splitlines() if f" {code} " in ln]
        assert len(found) == 1 and figures in found[0], r.stdout + r.stderr
