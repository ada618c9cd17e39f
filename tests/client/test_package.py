"""gpubroker_client, the schedulers' client library, as a package of its own (#28): it
installs alone, with aiomqtt as its only dependency; the daemon's distribution ships it
too; the wire vocabulary it shares with the daemon is defined once, in it; and
`broker.client`, its former place, is an alias of it for one release."""

from __future__ import annotations

import ast
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from mqtt_helpers import Mosquitto

import broker.client
import broker.model
import gpubroker_client
import gpubroker_client.model

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "client" / "gpubroker_client"
DAEMON_ONLY = ("broker", "adapters", "policies", "numpy", "highspy", "aiohttp",
               "prometheus_client", "pydantic", "yaml", "structlog", "orjson", "rbloom",
               "tenacity", "psycopg")
"""What a scheduler does not get with the client: the daemon's packages and every
dependency of the daemon but aiomqtt."""

PROBE = """
import asyncio, importlib.metadata as md, importlib.util, json, sys
import gpubroker_client
from gpubroker_client import BrokerClient

async def connect(url):
    async with BrokerClient(url, scheduler="probe", connect_timeout=10) as c:
        return c.mqtt_version

names = sys.argv[2:]
print(json.dumps({
    "file": gpubroker_client.__file__,
    "importable": [n for n in names if importlib.util.find_spec(n) is not None],
    "loaded": sorted({m.split(".")[0] for m in sys.modules} & set(names)),
    "dists": sorted(d.metadata["Name"].lower() for d in md.distributions()),
    "requires": md.requires("gpubroker-client"),
    "mqtt": asyncio.run(connect(sys.argv[1])),
}))
"""


def _clean_env() -> dict[str, str]:
    """This process's environment without what would put the working tree (or another
    environment) on the child's path: CI sets PYTHONPATH to its copy of the repository."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")}


def _copy(src: Path, dest: Path) -> None:
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns(
        "__pycache__", "*.egg-info", "build", "dist"))


@pytest.mark.slow
@pytest.mark.timeout(150)
async def test_the_client_installs_alone_with_aiomqtt_only(tmp_path: Path,
                                                          mosquitto: Mosquitto) -> None:
    """`pip install ./client` in a clean virtual environment (no system site-packages):
    the client imports, connects to a real MQTT server, and nothing of the daemon nor
    any of its other dependencies is installed."""
    _copy(ROOT / "client", tmp_path / "client")  # the build writes beside its sources
    venv = tmp_path / "venv"
    python = venv / "bin" / "python"
    env = _clean_env()

    async def run(*args: str | Path, timeout: float) -> subprocess.CompletedProcess[str]:
        return await asyncio.to_thread(
            subprocess.run, [str(a) for a in args], cwd=tmp_path, env=env,
            capture_output=True, text=True, timeout=timeout, check=False)

    made = await run(sys.executable, "-m", "venv", venv, timeout=60)
    assert made.returncode == 0, made.stderr
    installed = await run(python, "-m", "pip", "install", "-q", "--no-input",
                          tmp_path / "client", timeout=120)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    probe = await run(python, "-c", PROBE, mosquitto.url, *DAEMON_ONLY, timeout=30)
    assert probe.returncode == 0, probe.stderr
    seen = json.loads(probe.stdout)
    assert Path(seen["file"]).is_relative_to(venv), seen["file"]
    assert seen["importable"] == [] and seen["loaded"] == []
    assert seen["requires"] == ["aiomqtt<3,>=2.5"]
    assert {"gpubroker-client", "aiomqtt", "paho-mqtt"} <= set(seen["dists"])
    assert set(seen["dists"]) <= {"gpubroker-client", "aiomqtt", "paho-mqtt",
                                  "typing-extensions", "pip", "setuptools"}, seen["dists"]
    assert seen["mqtt"] == "5"


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_daemon_distribution_ships_the_client_without_depending_on_it(
        tmp_path: Path) -> None:
    """The `gpubroker` wheel holds gpubroker_client (so `pip install gpubroker` is enough
    for the daemon and the command line), built from client/, and does not ask an index
    for a `gpubroker-client` distribution."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("broker", "adapters", "policies", "client"):
        _copy(ROOT / name, src / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-input", str(src),
         "-w", str(tmp_path / "w")],
        cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=120,
        check=False)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "w").glob("gpubroker-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(z.read(meta).decode())
    modules = {f"gpubroker_client/{p.name}" for p in PACKAGE.glob("*.py")}
    assert modules <= names, modules - names
    assert {"broker/client.py", "broker/model.py", "broker/cli/main.py"} <= names
    assert not [n for n in names if n.startswith("client/")]
    requires = metadata.get_all("Requires-Dist") or []
    names_required = {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("_", "-")
                      for r in requires}
    assert "aiomqtt" in names_required and "gpubroker-client" not in names_required


def test_the_shared_vocabulary_is_defined_once_in_the_client() -> None:
    """broker.model re-exports the client's wire vocabulary: the same objects, and no
    definition of their own."""
    shared = gpubroker_client.model.__all__
    for name in shared:
        assert getattr(broker.model, name) is getattr(gpubroker_client.model, name), name
    tree = ast.parse((ROOT / "broker" / "model.py").read_text())
    defined = {n.name for n in tree.body if isinstance(n, ast.ClassDef | ast.FunctionDef)}
    defined |= {t.id for n in tree.body if isinstance(n, ast.Assign)
                for t in n.targets if isinstance(t, ast.Name)}
    assert defined & set(shared) == set()


def test_the_shared_modules_load_no_mqtt_client() -> None:
    """The daemon's vocabulary and the modules it shares with the client load neither
    asyncio nor aiomqtt: the client's machinery is loaded on first use."""
    code = ("import sys, broker.model, gpubroker_client.files, gpubroker_client.mqtturl\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'asyncio', 'aiomqtt', "
            "'paho'}))\n")
    path = os.pathsep.join([str(ROOT), str(ROOT / "client")])
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=30, check=False,
                          env={**_clean_env(), "PYTHONPATH": path})
    assert (done.returncode, done.stdout) == (0, "[]\n"), done.stderr
    loaded = subprocess.run([sys.executable, "-c", "import gpubroker_client, sys\n"
                             "gpubroker_client.BrokerClient\nprint('aiomqtt' in sys.modules)"],
                            cwd=ROOT, capture_output=True, text=True, timeout=30,
                            check=False, env={**_clean_env(), "PYTHONPATH": path})
    assert (loaded.returncode, loaded.stdout) == (0, "True\n"), loaded.stderr


def test_broker_client_is_an_alias_of_the_package() -> None:
    assert set(broker.client.__all__) <= set(gpubroker_client.__all__)
    for name in broker.client.__all__:
        assert getattr(broker.client, name) is getattr(gpubroker_client, name), name


def test_every_module_of_the_client_has_one_role_and_stays_small() -> None:
    sizes = {p.name: len(p.read_text().splitlines()) for p in PACKAGE.glob("*.py")}
    assert {"client.py", "session.py", "lease.py", "watch.py", "errors.py", "events.py",
            "model.py"} <= set(sizes)
    assert max(sizes.values()) <= 500, sizes
