"""`deploy/grafana/gpubroker.json`: every query names metrics a running daemon exports,
so that renaming a metric without the dashboard fails here."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import aiohttp
from daemon_helpers import RunningDaemon, daemon_config
from mqtt_helpers import Mosquitto, free_port

from broker.daemon.assembly import Daemon
from broker.daemon.config import HttpConfig

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "gpubroker.json"
METRIC = re.compile(r"\bgpubroker_[a-z_]+\b")
# What an operator looks at first: each must have a panel.
WANTED = ["gpubroker_polls_total", "gpubroker_pool_offers", "gpubroker_pool_regions_stale",
          "gpubroker_cheapest_gpu_hour_price_usd", "gpubroker_placements_total",
          "gpubroker_rejections_total", "gpubroker_invalid_requests_total",
          "gpubroker_failovers_total", "gpubroker_active_leases",
          "gpubroker_decision_latency_seconds_bucket", "gpubroker_mqtt_connected",
          "gpubroker_mqtt_reconnects_total", "gpubroker_outbox_depth",
          "gpubroker_policy_reloads_total"]
FUNCTIONS = {"sum", "min", "max", "count", "rate", "increase", "histogram_quantile", "by",
             "label_values"}


def queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression of the dashboard: its panels' targets (rows included)
    and its variables' queries."""
    found = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            found.extend(t["expr"] for t in p.get("targets", ()))
            walk(p.get("panels", []))

    walk(dashboard["panels"])
    found.extend(v["definition"] for v in dashboard["templating"]["list"])
    return found


def check_syntax(expr: str) -> None:
    """Brackets balance outside strings; functions and aggregations are known ones."""
    closing = {"(": ")", "[": "]", "{": "}"}
    stack: list[str] = []
    for token in re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr):
        if token in closing:
            stack.append(closing[token])
        elif token in closing.values():
            assert stack and stack.pop() == token, expr
    assert not stack, expr
    words = set(re.findall(r"\b([a-z_]+)\s*\(", expr))
    assert words <= FUNCTIONS, (words - FUNCTIONS, expr)


def exported(text: str) -> set[str]:
    """The names Prometheus would store from a /metrics text: samples, and families
    without samples yet (a labelled counter nothing has counted) by their TYPE line; a
    histogram as its _bucket, _count and _sum series."""
    names = set(re.findall(r"(?m)^(gpubroker_[a-z_]+)[{ ]", text))
    for name, kind in re.findall(r"(?m)^# TYPE (gpubroker_[a-z_]+) (\w+)$", text):
        names.add(name)
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_count", f"{name}_sum"}
    return names


def test_the_dashboard_is_an_importable_grafana_dashboard() -> None:
    d = json.loads(DASHBOARD.read_text())
    assert [i["name"] for i in d["__inputs"]] == ["DS_PROMETHEUS"]
    assert d["uid"] == "gpubroker" and d["id"] is None and d["panels"]
    sources = {json.dumps(p["datasource"]) for p in d["panels"] if p["type"] != "row"}
    assert sources == {json.dumps({"type": "prometheus", "uid": "${DS_PROMETHEUS}"})}
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24
    for expr in queries(d):
        check_syntax(expr)


async def test_every_query_names_a_metric_the_daemon_exports(
        mosquitto: Mosquitto, tmp_path: Path) -> None:
    port = free_port()
    cfg = daemon_config(mosquitto, tmp_path / "state.db").model_copy(
        update={"http": HttpConfig(listen=f"127.0.0.1:{port}")})
    daemon = Daemon(cfg)
    stop = asyncio.Event()
    rd = RunningDaemon(daemon, asyncio.create_task(daemon.run(stop)), stop)
    try:
        async with asyncio.timeout(15):
            await daemon.ready.wait()
        async with aiohttp.ClientSession() as session, \
                session.get(f"http://127.0.0.1:{port}/metrics") as r:
            assert r.status == 200
            text = await r.text()
    finally:
        await rd.stop()
    names = exported(text)
    used = {m for expr in queries(json.loads(DASHBOARD.read_text()))
            for m in METRIC.findall(expr)}
    assert used - names == set(), "the dashboard asks for metrics the daemon does not export"
    assert set(WANTED) - used == set(), "metrics without a panel"
    # families with nothing counted yet are there too (by their TYPE line)
    assert {"gpubroker_failovers_total", "gpubroker_decision_latency_seconds_bucket"} <= names


def test_a_renamed_metric_is_caught() -> None:
    text = "# TYPE gpubroker_placements_total counter\ngpubroker_placements_total 0.0\n"
    assert "gpubroker_placements_total" in exported(text)
    assert "gpubroker_placement_total" not in exported(text)
    hist = "# TYPE gpubroker_decision_latency_seconds histogram\n"
    assert "gpubroker_decision_latency_seconds_bucket" in exported(hist)
