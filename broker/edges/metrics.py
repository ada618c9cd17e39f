"""Prometheus metrics (`gpubroker_` prefix, base units, no ids as labels).

One registry per daemon, no module-level state. Counters and histograms are updated as
things happen; gauges that describe state (pool, leases, MQTT, prices) are computed when
Prometheus scrapes, from the parts themselves. No `_created` series (the time each
counter and histogram series was created): a process-wide setting of prometheus_client,
made when a daemon's metrics are; they doubled the text a scrape writes on the event
loop (one `gpubroker_polls` series per region and result), and Prometheus does not need
them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    Info,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from broker import __version__
from broker.model import utcnow
from broker.placement.optimizer import BatchResult

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)
_POLL_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


LAG_EVERY_SECONDS = 0.05


class Metrics:
    def __init__(self) -> None:
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        Info("gpubroker_build", "gpubroker build information", registry=r).info(
            {"version": __version__})
        self.polls = Counter("gpubroker_polls", "Polls of one adapter region, by result",
                             ["adapter", "region", "result"], registry=r)
        self.poll_seconds = Histogram("gpubroker_poll_duration_seconds",
                                      "Duration of one region's poll", ["adapter", "result"],
                                      buckets=_POLL_BUCKETS, registry=r)
        self.placements = Counter("gpubroker_placements", "Placement requests decided",
                                  registry=r)
        self.rejections = Counter("gpubroker_rejections", "Placement requests rejected",
                                  ["code"], registry=r)
        self.invalid = Counter("gpubroker_invalid_requests", "Requests answered invalid",
                               registry=r)
        self.failovers = Counter("gpubroker_failovers", "Leases failed over", ["reason"],
                                 registry=r)
        self.lease_failures = Counter("gpubroker_lease_failures",
                                      "Leases failed (nowhere to fail over to)", ["reason"],
                                      registry=r)
        self.lease_ends = Counter("gpubroker_lease_ends", "Leases released or expired",
                                  ["state"], registry=r)
        self.decision_seconds = Histogram(
            "gpubroker_decision_latency_seconds",
            "From a request's arrival to its decision committed", buckets=_LATENCY_BUCKETS,
            registry=r)
        self.batches = Counter("gpubroker_placement_batches",
                               "Placement batches solved, by the solver that answered",
                               ["solver"], registry=r)
        self.batch_size = Histogram("gpubroker_placement_batch_size",
                                    "Requests placed together in one batch",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
                                    registry=r)
        self.batch_gap = Histogram(
            "gpubroker_placement_gap_ratio",
            "A batch's distance from its lower bound, (objective - bound) / bound",
            buckets=(0, 0.0001, 0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5), registry=r)
        self.batch_seconds = Histogram("gpubroker_placement_solve_seconds",
                                       "Time to solve one batch", buckets=_LATENCY_BUCKETS,
                                       registry=r)
        self.policy_reloads = Counter("gpubroker_policy_reloads", "Policy reloads by result",
                                      ["result"], registry=r)
        self.loop_lag = Histogram(
            "gpubroker_event_loop_lag_seconds",
            f"How late the event loop ran a timer due every {LAG_EVERY_SECONDS:g}s: the "
            "longest it was held by one piece of work, roughly",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r)
        self.loop_lag_max = 0.0
        self.idle_owned_gpu_hours = 0.0
        self._idle: tuple[float, int] | None = None  # (monotonic time, idle GPUs since)

    def idle_owned(self, idle_gpus: int) -> None:
        """Integrate paid-for GPUs left idle over time: called with the idle count just
        after it may have changed (polls, holdings) and at each scrape."""
        now = time.monotonic()
        if self._idle is not None:
            since, gpus = self._idle
            self.idle_owned_gpu_hours += gpus * (now - since) / 3600
        self._idle = (now, idle_gpus)

    async def watch_loop_lag(self) -> None:
        """Sleep `LAG_EVERY_SECONDS` at a time and record how much later than asked the
        loop woke up (a task of the daemon)."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + LAG_EVERY_SECONDS
            await asyncio.sleep(LAG_EVERY_SECONDS)
            lag = max(0.0, loop.time() - due)
            self.loop_lag.observe(lag)
            self.loop_lag_max = max(self.loop_lag_max, lag)

    def observe_event(self, kind: str, data: dict[str, Any]) -> None:
        """Count what the broker publishes (hooked to `Broker.observers`)."""
        if kind == "placement.decided" and "state" not in data and \
                not str(data.get("reason", "")).startswith("repeated"):
            self.placements.inc()
        elif kind == "placement.rejected":
            self.rejections.labels(code=data.get("code", "")).inc()
        elif kind == "request.invalid":
            self.invalid.inc()
        elif kind == "lease.failover":
            self.failovers.labels(reason=data.get("reason", "")).inc()
        elif kind == "lease.failed":
            self.lease_failures.labels(reason=data.get("reason", "")).inc()
        elif kind in ("lease.released", "lease.expired"):
            self.lease_ends.labels(state=kind.split(".")[1]).inc()
        elif kind == "policy.applied":
            self.policy_reloads.labels(result="applied").inc()
        elif kind == "policy.rejected":
            self.policy_reloads.labels(result="rejected").inc()

    def observe_batch(self, result: BatchResult) -> None:
        """Count a solved batch (hooked to `Broker.batch_observers`)."""
        self.batches.labels(solver=result.solver).inc()
        self.batch_size.observe(len(result.outcomes))
        if result.solver != "none":
            self.batch_gap.observe(result.gap)
            self.batch_seconds.observe(result.seconds)

    def watch(self, collect: Callable[[], Iterator[Metric]]) -> None:
        """Add gauges computed at scrape time."""
        self.registry.register(_Callback(collect))


class _Callback(Collector):
    def __init__(self, collect: Callable[[], Iterator[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterator[Metric]:
        return self._collect()


def state_gauges(daemon: Any) -> Iterator[Metric]:
    """The daemon's state as gauges: pool, freshness, prices, leases, MQTT."""
    pool, book, bus = daemon.pool, daemon.book, daemon.bus
    now = utcnow()
    role = GaugeMetricFamily("gpubroker_role", "1 for this node's role in its site: leader "
                             "or standby (high availability; a single daemon leads)",
                             labels=["role"])
    for name in ("leader", "standby"):
        role.add_metric([name], 1.0 if daemon.role == name else 0.0)
    yield role
    yield GaugeMetricFamily("gpubroker_leader_epoch", "The fencing epoch this node leads with "
                            "(0: standing by, or a single daemon on SQLite)",
                            value=daemon.store.epoch)
    yield CounterMetricFamily("gpubroker_takeovers", "Times this process took the "
                              "leadership of its site", value=daemon.takeovers)
    yield GaugeMetricFamily("gpubroker_event_loop_lag_max_seconds",
                            "The longest the event loop has been late so far",
                            value=daemon.metrics.loop_lag_max)
    offers = GaugeMetricFamily("gpubroker_pool_offers", "Offers in the pool",
                               labels=["cloud", "market"])
    counts, cheapest = pool.census()
    for cloud, market, n in sorted((c, m.value, n) for (c, m), n in counts.items()):
        offers.add_metric([cloud, market], n)
    yield offers
    price = GaugeMetricFamily("gpubroker_cheapest_gpu_hour_price_usd",
                              "Cheapest price per GPU-hour in the pool",
                              labels=["cloud", "gpu", "market"])
    for cloud, gpu, market, p in sorted((c, g, m.value, p) for (c, g, m), p in cheapest.items()):
        price.add_metric([cloud, gpu, market], p)
    yield price
    health = pool.health()
    stale = pool.stale_slices(now)
    yield GaugeMetricFamily("gpubroker_pool_regions", "Adapter regions polled",
                            value=len(health))
    yield GaugeMetricFamily("gpubroker_pool_regions_failing",
                            "Adapter regions whose last poll failed",
                            value=sum(1 for h in health if not h.ok))
    yield GaugeMetricFamily("gpubroker_pool_regions_stale",
                            "Adapter regions whose offers are too old to place on",
                            value=len(stale))
    ages = [(now - h.last_ok_at).total_seconds() for h in health if h.last_ok_at]
    yield GaugeMetricFamily("gpubroker_pool_oldest_data_age_seconds",
                            "Age of the oldest region's last good poll",
                            value=max(ages) if ages else 0.0)
    idle = pool.idle_owned_gpus()
    daemon.metrics.idle_owned(idle)
    yield GaugeMetricFamily("gpubroker_owned_gpus", "Paid-for GPUs (cloud reservations and "
                            "private servers that are up), leased or not", value=pool.owned_gpus)
    yield GaugeMetricFamily("gpubroker_idle_owned_gpus", "Paid-for GPUs that no lease holds "
                            "and that could be launched now", value=idle)
    yield CounterMetricFamily("gpubroker_idle_owned_gpu_hours", "Paid-for GPU-hours left "
                              "idle (no lease held them)",
                              value=daemon.metrics.idle_owned_gpu_hours)
    active = GaugeMetricFamily("gpubroker_active_leases", "Active leases", labels=["market"])
    for market, n in book.active_by_market().items():
        active.add_metric([market.value], n)
    yield active
    yield GaugeMetricFamily("gpubroker_mqtt_connected", "1 while connected to MQTT",
                            value=1.0 if bus.connected.is_set() else 0.0)
    yield CounterMetricFamily("gpubroker_mqtt_reconnects", "MQTT connections lost",
                              value=bus.reconnects)
    yield GaugeMetricFamily("gpubroker_outbox_depth", "Messages waiting for MQTT acknowledgement",
                            value=bus.outbox_depth)
