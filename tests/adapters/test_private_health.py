"""Private servers' health (`adapters/private/health.py`): real exporters' answers over
real HTTP (an aiohttp server on 127.0.0.1), and health files on disk."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from structlog.testing import capture_logs

from adapters.common import poll_deadline
from adapters.private.adapter import PrivateAdapter
from adapters.private.health import judge
from broker.model import Offer

T0 = datetime(2026, 12, 10, tzinfo=UTC)


def dcgm(gpus: int = 8, *, xid: dict[int, int] | None = None,
         ecc: dict[int, int] | None = None, host: str = "gpu-a01") -> str:
    """A DCGM exporter's answer (dcgm-exporter's default counters, abridged)."""
    lines = []
    for name, kind, helptext, values in (
        ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).", {}),
        ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", {}),
        ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.",
         xid or {}),
        ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter",
         "Total number of double-bit volatile ECC errors.", ecc or {}),
    ):
        lines += [f"# HELP {name} {helptext}", f"# TYPE {name} {kind}"]
        for gpu in range(gpus):
            labels = (f'gpu="{gpu}",UUID="GPU-{gpu:08x}-0000-0000-0000-000000000000",'
                      f'device="nvidia{gpu}",modelName="NVIDIA A100-SXM4-80GB",'
                      f'Hostname="{host}"')
            lines.append(f"{name}{{{labels}}} {values.get(gpu, 1410 if 'CLOCK' in name else 0)}")
    return "\n".join(lines) + "\n"


NODE = """\
# HELP node_load1 1m load average.
# TYPE node_load1 gauge
node_load1 0.42
# HELP node_cpu_seconds_total Seconds the CPUs spent in each mode.
# TYPE node_cpu_seconds_total counter
node_cpu_seconds_total{cpu="0",mode="idle"} 81234.5
"""


# --- judging an answer -------------------------------------------------------------------


@pytest.mark.parametrize(("body", "gpus", "why"), [
    (dcgm(8), 8, None),
    (dcgm(8, xid={3: 79}), 8, "XID errors (DCGM_FI_DEV_XID_ERRORS) on GPU 3"),
    (dcgm(8, ecc={1: 2, 5: 1}), 8,
     "uncorrectable ECC errors (DCGM_FI_DEV_ECC_DBE_VOL_TOTAL) on GPU 1, 5"),
    (dcgm(7), 8, "DCGM sees 7 of 8 GPUs"),
    (dcgm(4), 4, None),
    (NODE, 8, None),
    ("", 8, "the answer holds no metrics"),
    ("<html><body>Bad gateway</body></html>", 8,
     "the answer is not Prometheus text: invalid metric name:<html><body>Bad "
     "gateway</body></html>"),
])
def test_judge(body: str, gpus: int, why: str | None) -> None:
    assert judge(body.encode(), gpus) == why


def test_judge_refuses_what_is_not_utf8() -> None:
    assert judge(b"\xff\xfe node_load1 1\n", 1) == \
        "the answer is not Prometheus text (not UTF-8)"


# --- exporters over HTTP -----------------------------------------------------------------


@dataclass
class Exporters:
    """Each server's exporter, on one aiohttp server: `answers[server]` is its body, or
    a callable giving the response; `hang` servers never answer (until teardown)."""

    answers: dict[str, str | Callable[[], web.Response]] = field(default_factory=dict)
    hang: set[str] = field(default_factory=set)
    calls: dict[str, int] = field(default_factory=dict)
    in_flight: int = 0
    most_in_flight: int = 0
    hold: float = 0.0  # seconds each answer takes (to see how many run at once)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        server = request.match_info["server"]
        self.calls[server] = self.calls.get(server, 0) + 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if server in self.hang:
                await self.release.wait()
            elif self.hold:
                await asyncio.sleep(self.hold)
        finally:
            self.in_flight -= 1
        answer = self.answers.get(server)
        if answer is None:
            return web.Response(status=404, text="no such server")
        if callable(answer):
            return answer()
        return web.Response(text=answer, content_type="text/plain")


@pytest.fixture
async def exporters() -> AsyncIterator[Exporters]:
    ex = Exporters()
    app = web.Application()
    app.router.add_get("/{server}/metrics", ex.handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    ex.url = f"http://127.0.0.1:{server.port}/{{server}}/metrics"
    try:
        yield ex
    finally:
        ex.release.set()
        await server.close()


def servers_yaml(template: str, servers: list[str], gpus: int = 8) -> str:
    return f"""\
version: 1
sites:
  fra1: {{}}
groups:
  - name: a100-pod1
    site: fra1
    gpu: A100-80GB
    gpus: {gpus}
    servers: [{", ".join(servers)}]
    price_per_gpu_hour: 0
    health:
      prometheus: "{template}"
"""


@pytest.fixture
async def make_adapter(tmp_path: Path) -> AsyncIterator[Callable[..., PrivateAdapter]]:
    made: list[PrivateAdapter] = []

    def make(text: str, **kwargs: object) -> PrivateAdapter:
        path = tmp_path / "servers.yaml"
        path.write_text(text)
        kwargs.setdefault("health_timeout", 0.5)
        adapter = PrivateAdapter(file=path, clock=lambda: T0, **kwargs)  # type: ignore[arg-type]
        made.append(adapter)
        return adapter

    yield make
    for adapter in made:
        await adapter.close()


async def offer(adapter: PrivateAdapter) -> Offer:
    [o] = await adapter.poll("fra1")
    return o


def down_events(logs: list[dict[str, object]]) -> dict[str, object]:
    return {str(e["server"]): e.get("why", "up") for e in logs
            if e["event"] in ("private server down", "private server up")}


async def test_exporters_answers_decide_which_servers_are_targets(
        exporters: Exporters, make_adapter: Callable[..., PrivateAdapter]) -> None:
    exporters.answers = {
        "ok": dcgm(8), "node": NODE, "xid": dcgm(8, xid={2: 48}), "ecc": dcgm(8, ecc={0: 1}),
        "seven": dcgm(7), "garbage": "<html>oops</html>", "empty": "",
        "err": lambda: web.Response(status=503, text="exporter restarting"),
        "slow": dcgm(8),
    }
    exporters.hang = {"slow"}
    names = [*exporters.answers, "unknown"]
    adapter = make_adapter(servers_yaml(exporters.url, names), health_timeout=0.3)
    with capture_logs() as logs:
        o = await offer(adapter)
    assert [t.id for t in o.targets] == ["ok", "node"]
    assert o.capacity == 2 and o.availability == 1.0
    assert down_events(logs) == {
        "xid": "XID errors (DCGM_FI_DEV_XID_ERRORS) on GPU 2",
        "ecc": "uncorrectable ECC errors (DCGM_FI_DEV_ECC_DBE_VOL_TOTAL) on GPU 0",
        "seven": "DCGM sees 7 of 8 GPUs",
        "garbage": "the answer is not Prometheus text: invalid metric name:<html>oops</html>",
        "empty": "the answer holds no metrics",
        "err": "HTTP 503",
        "slow": "no answer within 0.3 s",
        "unknown": "HTTP 404",
    }
    assert all(e["log_level"] == "warning" and e["group"] == "a100-pod1"
               for e in logs if e["event"] == "private server down")
    assert set(exporters.calls) == set(names)


async def test_health_changes_are_logged_once_each_way(
        exporters: Exporters, make_adapter: Callable[..., PrivateAdapter]) -> None:
    exporters.answers = {"a": dcgm(8), "b": dcgm(8, xid={0: 79})}
    adapter = make_adapter(servers_yaml(exporters.url, ["a", "b"]))
    with capture_logs() as logs:
        for _ in range(3):
            assert [t.id for t in (await offer(adapter)).targets] == ["a"]
    assert down_events(logs) == {"b": "XID errors (DCGM_FI_DEV_XID_ERRORS) on GPU 0"}
    assert len(logs) == 1
    exporters.answers["b"] = dcgm(8)  # the XID cleared (GPU reset)
    exporters.answers["a"] = dcgm(6)  # two GPUs fell off the bus
    with capture_logs() as logs:
        for _ in range(2):
            assert [t.id for t in (await offer(adapter)).targets] == ["b"]
    assert down_events(logs) == {"b": "up", "a": "DCGM sees 6 of 8 GPUs"}
    assert len(logs) == 2
    assert exporters.calls == {"a": 5, "b": 5}


async def test_a_server_that_refuses_connections_is_down(
        free_port: Callable[[], int], make_adapter: Callable[..., PrivateAdapter]) -> None:
    template = f"http://127.0.0.1:{free_port()}/{{server}}/metrics"
    adapter = make_adapter(servers_yaml(template, ["gone"]))
    with capture_logs() as logs:
        o = await offer(adapter)
    assert o.targets == () and o.capacity == 0 and o.availability == 1.0
    why = str(down_events(logs)["gone"])
    assert why.startswith("no answer: ClientConnectorError: Cannot connect to host 127.0.0.1")


async def test_an_answer_over_the_size_cap_is_down(
        exporters: Exporters, make_adapter: Callable[..., PrivateAdapter]) -> None:
    exporters.answers = {"big": dcgm(8) + "# " + "x" * (2 << 20) + "\n", "ok": dcgm(8)}
    adapter = make_adapter(servers_yaml(exporters.url, ["big", "ok"]), max_body=1 << 20)
    with capture_logs() as logs:
        assert [t.id for t in (await offer(adapter)).targets] == ["ok"]
    assert down_events(logs) == {"big": "the answer is larger than 1 MiB"}


async def test_probes_run_concurrently_within_the_bound(
        exporters: Exporters, make_adapter: Callable[..., PrivateAdapter]) -> None:
    names = [f"gpu-{n:02d}" for n in range(12)]
    exporters.answers = dict.fromkeys(names, dcgm(8))
    exporters.hold = 0.05
    adapter = make_adapter(servers_yaml(exporters.url, names), probe_concurrency=4)
    assert len((await offer(adapter)).targets) == 12
    assert exporters.most_in_flight == 4


async def test_probes_stop_at_the_polls_deadline_and_never_fail_the_poll(
        exporters: Exporters, make_adapter: Callable[..., PrivateAdapter]) -> None:
    exporters.answers = {"ok": dcgm(8), "stuck": dcgm(8)}
    exporters.hang = {"stuck"}
    adapter = make_adapter(servers_yaml(exporters.url, ["ok", "stuck"]), health_timeout=30)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with capture_logs() as logs, poll_deadline(1.3):  # probing stops 1 s before the deadline
        o = await offer(adapter)
    assert loop.time() - started < 1.0
    assert [t.id for t in o.targets] == ["ok"]  # never answered: not up
    assert adapter.health.state("stuck") is None  # no answer yet: nothing learnt
    assert [e["event"] for e in logs] == [
        "private health probes cut short by the poll's deadline"]
    assert (logs[0]["probed"], logs[0]["not_probed"]) == (1, 1)


async def test_a_server_in_maintenance_is_not_probed(
        exporters: Exporters, make_adapter: Callable[..., PrivateAdapter]) -> None:
    exporters.answers = {"a": dcgm(8), "b": dcgm(8)}
    text = servers_yaml(exporters.url, ["a", "b"]) + """\
maintenance:
  - servers: [b]
    drain_from: 2026-12-09T00:00:00Z
    drain_until: 2026-12-11T00:00:00Z
"""
    adapter = make_adapter(text)
    assert [t.id for t in (await offer(adapter)).targets] == ["a"]
    assert exporters.calls == {"a": 1}


# --- health files ------------------------------------------------------------------------


def remove(path: Path) -> None:
    path.unlink()


def file_yaml(health: Path) -> str:
    return f"""\
version: 1
sites:
  fra1: {{}}
groups:
  - name: h100
    site: fra1
    gpu: H100-80GB
    gpus: 8
    count: 4
    name_prefix: gpu-h
    price_per_gpu_hour: 1.2
    health: {{file: {health.name}}}
"""


async def test_a_health_file_lists_the_servers_down(
        tmp_path: Path, make_adapter: Callable[..., PrivateAdapter]) -> None:
    health = tmp_path / "health.yaml"
    health.write_text("down: [gpu-h02, gpu-h09]\n")
    adapter = make_adapter(file_yaml(health))
    with capture_logs() as logs:
        o = await offer(adapter)
    assert [t.id for t in o.targets] == ["gpu-h01", "gpu-h03", "gpu-h04"]
    assert [(e["event"], e.get("servers", e.get("server"))) for e in logs] == [
        ("private health file names unknown servers", ["gpu-h09"]),
        ("private server down", "gpu-h02")]
    # Broken: its last good reading stays, logged once.
    health.write_text("down: [gpu-h03\n")
    with capture_logs() as logs:
        for _ in range(2):
            assert [t.id for t in (await offer(adapter)).targets] == \
                ["gpu-h01", "gpu-h03", "gpu-h04"]
    assert [(e["event"], e["log_level"]) for e in logs] == [
        ("private health file unusable; keeping its last good reading", "error")]
    assert f"{health}:2:1: invalid YAML" in str(logs[0]["problems"])
    health.write_text("down: []\n")
    with capture_logs() as logs:
        assert len((await offer(adapter)).targets) == 4
    assert [e["event"] for e in logs] == ["private health file usable again",
                                          "private server up"]
    # Gone: the last reading stays; back as it was: usable again.
    remove(health)
    with capture_logs() as logs:
        for _ in range(2):
            assert len((await offer(adapter)).targets) == 4
    assert [(e["event"], e["problems"]) for e in logs] == [
        ("private health file unusable; keeping its last good reading",
         "cannot read: No such file or directory")]
    health.write_text("down: []\n")
    with capture_logs() as logs:
        assert len((await offer(adapter)).targets) == 4
    assert [e["event"] for e in logs] == ["private health file usable again"]


async def test_without_a_first_reading_of_its_health_file_a_group_is_down(
        tmp_path: Path, make_adapter: Callable[..., PrivateAdapter]) -> None:
    health = tmp_path / "health.yaml"
    adapter = make_adapter(file_yaml(health))
    with capture_logs() as logs:
        o = await offer(adapter)
    assert o.targets == () and o.capacity == 0
    assert logs[0]["event"] == "private health file unusable; its servers count as down"
    assert adapter.health.state("gpu-h01") == \
        f"health file {health}: cannot read: No such file or directory"
    health.write_text("down: [gpu-h04]\n")
    assert [t.id for t in (await offer(adapter)).targets] == ["gpu-h01", "gpu-h02", "gpu-h03"]
