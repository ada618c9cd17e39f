"""The demo itself: the daemon, two schedulers placing jobs, and the orderly way out."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import socket
import ssl
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

from broker.cli.demo_mqtt import DemoError, free_port, host_port, mqtt_server, one_line, sweep
from broker.cli.demo_report import LEGEND, MqttLines, Tally, plural, short_id, summary, where
from broker.daemon.assembly import Daemon
from broker.daemon.config import (
    CloudsConfig,
    Config,
    HttpConfig,
    MqttConfig,
    PollConfig,
    SimConfig,
    StateConfig,
)
from broker.model import LeaseState, Market, Placement, utcnow
from broker.state.store import StoreFailed
from broker.wire.commands import Command
from gpubroker_client import (
    BrokerClient,
    BrokerError,
    BrokerUnavailable,
    InvalidRequest,
    Lease,
    LeaseEnded,
    LeaseEvent,
    PlacementTimeout,
    Rejected,
    RequestTimeout,
    parse_mqtt_url,
)

T = TypeVar("T")

SCHEDULERS = ("research", "inference")
WORKLOADS: tuple[dict[str, Any], ...] = (
    {"gpu": ["H100-80GB", "A100-80GB"], "gpus": 8},
    {"gpu": "A100-40GB", "gpus": 8, "market": "spot"},
    {"gpu": "L4", "gpus": 1},
    {"gpu": ["A10G", "A10"], "gpus": 4, "market": "spot"},
    {"gpu": "T4", "gpus": 1, "max_price_per_gpu_hour": 0.25},
    {"gpu": "H100-80GB", "gpus": 16, "market": "on_demand"},
    {"gpu": "L40S", "gpus": 1, "market": "spot", "clouds": ["aws"]},
    {"gpu": "H100-80GB", "gpus": 8, "max_price_per_gpu_hour": 0.5},
)
LEASE_SECONDS = 15
"""The demo's leases are short, so that renewals and expiries show within a minute."""
HOLD_SECONDS = (6.0, 35.0)
"""How long a demo job keeps its lease (uniformly drawn)."""
RENEW_EVERY = (4.0, 8.0)
ABANDON_SHARE = 0.2
"""The share of jobs that stop renewing instead of releasing: their leases expire."""
SUMMARY_EVERY = 10.0
CONNECT_TIMEOUT = 5.0
"""How long the first connection to the MQTT server may take."""
READY_TIMEOUT = 30.0
"""How long the daemon may take to connect and finish its first poll."""
RELEASE_TIMEOUT = 2.0
STOP_TIMEOUT = 3.0
"""How long the daemon's orderly stop may take before it is cut short."""
EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class _Stopped(Exception):
    """Stop was asked for (a signal or --duration) before a step finished."""


@dataclass(frozen=True)
class Options:
    duration: float | None
    mqtt_url: str | None
    state: Path | None
    seed: int


class Demo:
    def __init__(self, opts: Options, state: Path, *, temporary: bool) -> None:
        self.opts = opts
        self.state = state
        self.temporary = temporary
        self.run = uuid.uuid4().hex[:8]
        self.prefix = f"gpubroker-demo/{self.run}/v1"
        self.rng = random.Random(opts.seed)
        self.tally = Tally()
        self.daemon: Daemon | None = None
        self.clients: dict[str, BrokerClient] = {}
        self.url = ""
        self.protocol = "5"
        self.stopping = False
        self.unclean = ""  # what was left behind: leases active, retained messages
        self.stop_reason = ""
        self._stop: asyncio.Event | None = None
        self._deadline: float | None = None
        self._sent: list[tuple[str, str, dict[str, Any]]] = []  # placed: (sched, rid, ask)

    # --- lines ---------------------------------------------------------------------------

    @staticmethod
    def say(tag: str, text: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {tag:<8} {text}", flush=True)

    # --- life cycle ----------------------------------------------------------------------

    async def main(self) -> int:
        loop = asyncio.get_running_loop()
        started = loop.time()
        self._stop = asyncio.Event()
        if self.opts.duration is not None:
            self._deadline = started + self.opts.duration
        remove = self._handle_signals()
        client_log = logging.getLogger("gpubroker.client")
        handler = MqttLines(self.say)
        client_log.addHandler(handler)
        client_log.setLevel(logging.INFO)
        client_log.propagate = False
        try:
            async with mqtt_server(self.opts.mqtt_url) as (url, embedded):
                self.url = url
                return await self._run(started, embedded)
        except DemoError as err:
            print(f"gpubroker demo: {err}", file=sys.stderr, flush=True)
            return EXIT_RUNTIME
        finally:
            client_log.removeHandler(handler)
            remove()

    def _handle_signals(self) -> Callable[[], None]:
        """The first SIGINT/SIGTERM stops the demo in order; a second stops it at once."""
        loop = asyncio.get_running_loop()
        main = asyncio.current_task()
        assert self._stop is not None and main is not None
        stop = self._stop

        def signalled(sig: signal.Signals) -> None:
            if not stop.is_set():
                self.stop_reason = "Ctrl-C" if sig is signal.SIGINT else sig.name
                stop.set()
            else:
                main.cancel()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, signalled, sig)

        def remove() -> None:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

        return remove

    async def _until_stopped(self, aw: Awaitable[T]) -> T:
        """`aw`'s result, unless stop is asked for (or --duration ends) first: then
        `_Stopped`, with `aw` cancelled."""
        assert self._stop is not None
        task = asyncio.ensure_future(aw)
        stopper = asyncio.create_task(self._stop.wait())
        loop = asyncio.get_running_loop()
        left = None if self._deadline is None else max(0.0, self._deadline - loop.time())
        try:
            await asyncio.wait({task, stopper}, timeout=left,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        if not self._stop.is_set():
            self.stop_reason = f"--duration {self.opts.duration:g}"
            self._stop.set()
        raise _Stopped

    async def _run(self, started: float, embedded: bool) -> int:
        try:
            await self._until_stopped(self._connect(embedded))
        except _Stopped:
            await self._close_clients()
            print(f"stopped ({self.stop_reason}) before the demo began", flush=True)
            return EXIT_OK
        except BaseException:
            await self._close_clients()
            raise
        cfg = self._config()
        daemon = self.daemon = Daemon(cfg)
        print("gpubroker demo: the daemon on a simulated market, and two schedulers "
              f"({', '.join(SCHEDULERS)}) placing jobs over MQTT.\n"
              f"  MQTT   {self.url} (MQTT {self.protocol}), topics {self.prefix}/… (this "
              "demo's own, cleared at exit)\n"
              f"  state  {self.state}{' (temporary)' if self.temporary else ''}\n"
              f"  HTTP   http://{cfg.http.listen}/v1/offers\n{LEGEND}\n", flush=True)
        daemon_stop = asyncio.Event()
        daemon_task = asyncio.create_task(daemon.run(daemon_stop), name="daemon")
        failure: BaseException | None = None
        try:
            await self._until_stopped(self._ready(daemon, daemon_task))
            loop = asyncio.get_running_loop()
            regions = len({(o.pool.cloud, o.pool.region) for o in daemon.pool})
            print(f"ready in {loop.time() - started:.1f} s: {len(daemon.pool)} offers from "
                  f"{regions} regions. " + ("Ctrl-C stops it." if self._deadline is None else
                                            f"Stops {self.opts.duration:g} s after start "
                                            "(or on Ctrl-C).") + "\n", flush=True)
            await self._until_stopped(self._play(daemon_task))
        except _Stopped:
            pass
        except DemoError as err:
            failure = err
        finally:
            self.stopping = True
            await self._wind_down(daemon, daemon_stop, daemon_task, started)
        if failure is None and daemon_task.done() and not daemon_task.cancelled() and \
                daemon_task.exception() is not None:
            failure = DemoError(f"the daemon stopped: {one_line(daemon_task.exception())}")
        if failure is not None:
            raise failure
        if self.unclean:
            raise DemoError(f"could not clean up on the way out: {self.unclean}")
        return EXIT_OK

    async def _connect(self, embedded: bool) -> None:
        """The schedulers' connections; the first one finds out the MQTT version."""
        host, port, _ = parse_mqtt_url(self.url)
        where = host_port(host, port)
        if not embedded:
            try:
                async with asyncio.timeout(CONNECT_TIMEOUT):
                    _, writer = await asyncio.open_connection(host, port)
                writer.close()
            except TimeoutError:
                raise DemoError(f"no answer from {where} within {CONNECT_TIMEOUT:g} s; is an "
                                "MQTT server running there?") from None
            except socket.gaierror as exc:
                raise DemoError(f"cannot find the MQTT server's host {host!r}: "
                                f"{exc.strerror or exc}") from None
            except OSError as exc:
                why = os.strerror(exc.errno).lower() if exc.errno else one_line(exc)
                raise DemoError(f"no MQTT server at {where} ({why}); start one, or leave out "
                                "--mqtt to use 127.0.0.1:1883 or an embedded one") from None
        protocol: Literal["5", "3.1.1", "auto"] = "3.1.1" if embedded else "auto"
        for scheduler in SCHEDULERS:
            # A clean session: the demo leaves nothing behind on the MQTT server.
            client = BrokerClient(self.url, scheduler=scheduler, topic_prefix=self.prefix,
                                  protocol=protocol, connect_timeout=CONNECT_TIMEOUT,
                                  persistent=False)
            try:
                await client.connect()
            except BrokerUnavailable as exc:
                raise DemoError(str(exc)) from None
            except ssl.SSLError as exc:
                raise DemoError(f"TLS with {where} failed: {exc}") from None
            self.clients[scheduler] = client
            self.protocol = client.mqtt_version
            protocol = "5" if self.protocol == "5" else "3.1.1"

    async def _close_clients(self) -> None:
        for client in self.clients.values():
            await client.close()

    def _config(self) -> Config:
        return Config(
            site="demo",
            state=StateConfig(path=self.state),
            mqtt=MqttConfig(url=self.url, protocol=self.protocol,  # type: ignore[arg-type]
                            topic_prefix=self.prefix, session_expiry_seconds=0,
                            client_id=f"gpubroker-demo-{uuid.uuid4().hex[:12]}"),
            poll=PollConfig(interval_seconds=2, stale_after_seconds=10, timeout_seconds=5),
            http=HttpConfig(listen=f"127.0.0.1:{free_port()}"),
            clouds=CloudsConfig(sim=SimConfig(seed=self.opts.seed, preempt_rate_multiplier=400,
                                              signal_interval_seconds=1.0)),
        )

    async def _ready(self, daemon: Daemon, task: asyncio.Task[None]) -> None:
        ready = asyncio.create_task(daemon.ready.wait())
        try:
            done, _ = await asyncio.wait({ready, task}, timeout=READY_TIMEOUT,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
        if ready in done:
            return
        if task.done():
            exc = None if task.cancelled() else task.exception()
            raise DemoError(f"the daemon did not start: {one_line(exc)}")
        why = "; ".join(daemon.not_ready()) or "unknown"
        raise DemoError(f"the daemon is not ready after {READY_TIMEOUT:g} s ({why})")

    async def _play(self, daemon_task: asyncio.Task[None]) -> None:
        """The schedulers' jobs and the periodic line, until stopped (or the daemon
        fails: DemoError)."""
        jobs: set[asyncio.Task[None]] = set()
        ticker = asyncio.create_task(self._every(SUMMARY_EVERY))
        try:
            n = 0
            while not daemon_task.done():
                n += 1
                job = asyncio.create_task(self._job(n))
                jobs.add(job)
                job.add_done_callback(jobs.discard)
                await asyncio.wait({daemon_task}, timeout=self.rng.uniform(0.5, 1.5))
            exc = None if daemon_task.cancelled() else daemon_task.exception()
            raise DemoError(f"the daemon stopped: {one_line(exc)}")
        finally:
            ticker.cancel()
            for job in list(jobs):
                job.cancel()
            await asyncio.gather(ticker, *jobs, return_exceptions=True)

    async def _every(self, seconds: float) -> None:
        while True:
            await asyncio.sleep(seconds)
            active = [lease for c in self.clients.values() for lease in c.leases]
            renewed, self.tally.renewed_since = self.tally.renewed_since, 0
            gpus_now = sum(lease.placement.total_gpus for lease in active)
            cost = sum(lease.placement.price_per_hour for lease in active)
            self.say("RENEWED", f"{plural(renewed, 'renewal')} in the last {seconds:g} s; "
                                f"{plural(len(active), 'lease')} active: "
                                f"{plural(gpus_now, 'GPU')}, ${cost:,.2f}/h")

    async def _job(self, n: int) -> None:
        """One job of one scheduler: place, hold (renewing), then release or abandon."""
        rng = self.rng
        scheduler = rng.choice(SCHEDULERS)
        client = self.clients[scheduler]
        rid = f"job-{n}"
        if n % 17 == 0:  # a malformed request: `gpus` is not a number
            ask: dict[str, Any] = {"gpu": "H100-80GB", "gpus": cast(int, "eight")}
        elif n % 11 == 0 and self._sent:  # a request sent again, as after a lost answer
            scheduler, rid, ask = rng.choice(self._sent)
            client = self.clients[scheduler]
            await self._again(client, rid, ask)
            return
        else:
            ask = {**rng.choice(WORKLOADS), "lease_seconds": LEASE_SECONDS,
                   "duration_hours": rng.choice([1, 6, 24])}
        lease = await self._place(client, rid, ask)
        if lease is None:
            return
        self._sent.append((scheduler, rid, ask))
        loop = asyncio.get_running_loop()
        until = loop.time() + rng.uniform(*HOLD_SECONDS)
        abandon = rng.random() < ABANDON_SHARE
        try:
            while lease.active and (left := until - loop.time()) > 0:
                await asyncio.sleep(min(left, rng.uniform(*RENEW_EVERY)))
                if lease.active and loop.time() < until:
                    await lease.renew(timeout=10)
                    self.tally.renewed += 1
                    self.tally.renewed_since += 1
            if not abandon:
                await lease.release(timeout=10)
            # else: it is not renewed any more, and expires
        except LeaseEnded:
            pass  # it failed or expired meanwhile: the line was printed then
        except RequestTimeout:
            self.say("TIMEOUT", f"{short_id(lease.lease_id)} no answer to a renewal or release")

    def _request_id(self, job: str) -> str:
        """`job-7/<run>`: unique to this run, also with a --state kept from another (the
        same request_id would get that run's lease back). Lines show the job only."""
        return f"{job}/{self.run}"

    async def _place(self, client: BrokerClient, rid: str, ask: dict[str, Any]) -> Lease | None:
        try:
            lease = await client.place(**ask, request_id=self._request_id(rid), timeout=10,
                                       on_failover=self._on_failover, on_end=self._on_end)
        except Rejected as exc:
            self.tally.rejected[exc.code] += 1
            self.say("REJECTED", f"{rid:<8} {exc.code}: {exc.detail}")
            return None
        except InvalidRequest as exc:
            self.tally.invalid += 1
            errors = "; ".join(f"{e['field'] or '(request)'}: {e['message']}"
                               for e in exc.errors)
            self.say("INVALID", f"{rid:<8} {errors}")
            return None
        except PlacementTimeout:
            self.tally.timeouts += 1
            self.say("TIMEOUT", f"{rid:<8} no answer within 10 s")
            return None
        p = lease.placement
        self.tally.placed += 1
        self.tally.placed_gpus += p.total_gpus
        self._price(p)
        self.say("PLACED", f"{rid:<8} {where(p)}  {short_id(lease.lease_id)}")
        return lease

    async def _again(self, client: BrokerClient, rid: str, ask: dict[str, Any]) -> None:
        try:
            lease = await client.place(**ask, request_id=self._request_id(rid), timeout=10)
        except BrokerError as exc:  # a repeat is answered like the first time
            self.say("AGAIN", f"{rid:<8} {exc}")
            return
        self.tally.again += 1
        state = "active" if lease.active else lease.state.value
        self.say("AGAIN", f"{rid:<8} sent again: the same lease {short_id(lease.lease_id)} "
                          f"({state}), not a second one")

    def _price(self, p: Placement) -> None:
        """Add a new placement to the price comparison: its $/GPU-h against the cheapest
        fresh on-demand $/GPU-h of the same GPU model in the daemon's pool now."""
        assert self.daemon is not None
        pool = self.daemon.pool
        now = utcnow()
        od = next((o.price_per_gpu_hour for o in pool.by_gpu(p.gpu, Market.ON_DEMAND)
                   if pool.is_fresh(o.pool, now)), None)
        if od is None:
            self.tally.unpriced_gpus += p.total_gpus
            return
        self.tally.paid += p.total_gpus * p.price_per_gpu_hour
        self.tally.on_demand += p.total_gpus * od
        self.tally.priced_gpus += p.total_gpus

    def _on_failover(self, lease: Lease, ev: LeaseEvent) -> None:
        reason = ev.reason or "missed event"
        self.tally.failovers[reason] += 1
        was = ev.previous
        came = f"{was.pool.cloud}/{was.pool.zone}" if was is not None else "?"
        self.say("FAILOVER", f"{short_id(lease.lease_id)} epoch {ev.epoch} ({reason}): {came} → "
                             f"{where(ev.placement)}")

    def _on_end(self, lease: Lease, ev: LeaseEvent) -> None:
        if ev.kind == "released":
            if self.stopping:
                self.tally.released_at_exit += 1
                return
            self.tally.released += 1
            self.say("RELEASED", short_id(lease.lease_id))
        elif ev.kind == "expired":
            self.tally.expired += 1
            self.say("EXPIRED", short_id(lease.lease_id))
        else:
            self.tally.failed += 1
            self.say("FAILED", f"{short_id(lease.lease_id)} {ev.reason}: {ev.detail}")

    # --- the way out -----------------------------------------------------------------------

    async def _wind_down(self, daemon: Daemon, daemon_stop: asyncio.Event,
                         daemon_task: asyncio.Task[None], started: float) -> None:
        """Release every lease, stop the daemon, clear what is retained under the prefix,
        print the summary. Each step is bounded in time."""
        loop = asyncio.get_running_loop()
        print(f"\nstopping ({self.stop_reason or 'error'}): releasing leases, clearing "
              "retained messages (Ctrl-C again quits at once)", flush=True)
        if not daemon_task.done():
            await self._release_all(daemon)
        # The schedulers go before the daemon: they would only report it going offline.
        await self._close_clients()
        if not daemon_task.done():
            await self._release_left(daemon)
            daemon_stop.set()
            limit = STOP_TIMEOUT if daemon.bus.connected.is_set() else 0.5
            done, _ = await asyncio.wait({daemon_task}, timeout=limit)
            if not done:
                daemon_task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await daemon_task
        self.tally.left_active = sum(1 for lease in daemon.book.active()
                                     if lease.scheduler in self.clients)
        cleared, left, error = await sweep(self.url, self.protocol, self.prefix)
        summary(self.tally, self.prefix, loop.time() - started, cleared, left, error)
        problems = []
        if self.tally.left_active:
            problems.append(f"{plural(self.tally.left_active, 'lease')} left active")
        if error is not None:
            problems.append(f"the retained messages under {self.prefix} are not cleared "
                            f"(the MQTT server did not answer: {error})")
        elif left:
            problems.append(f"{plural(left, 'retained message')} under {self.prefix} still there")
        self.unclean = "; ".join(problems)

    async def _release_all(self, daemon: Daemon) -> None:
        """Every active lease of the demo's schedulers, released over MQTT: the ones they
        hold, and any the daemon decided that they did not hear of (a request whose
        answer was still on its way)."""
        if not any(c.connected for c in self.clients.values()):
            return
        tried: set[str] = set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(RELEASE_TIMEOUT):
                while True:
                    await daemon.broker.idle()  # requests already received are decided
                    calls = [self._release(self.clients[lease.scheduler], lease.lease_id)
                             for lease in daemon.book.active()
                             if lease.scheduler in self.clients and lease.lease_id not in tried]
                    if not calls:
                        return
                    tried.update(lease.lease_id for lease in daemon.book.active())
                    await asyncio.gather(*calls)

    async def _release_left(self, daemon: Daemon) -> None:
        """The leases of the demo's schedulers still active once the daemon takes no more
        requests (one whose request was on its way when the schedulers stopped, or all of
        them when the MQTT server is gone), released by the daemon as if their scheduler
        had asked."""
        daemon.bus.stop_receiving()
        with contextlib.suppress(TimeoutError, StoreFailed):
            async with asyncio.timeout(RELEASE_TIMEOUT):
                await daemon.broker.idle()
                left = [lease for lease in daemon.book.active()
                        if lease.scheduler in self.clients]
                for lease in left:
                    topic = f"{self.prefix}/requests/{lease.scheduler}/release"
                    body = json.dumps({"lease_id": lease.lease_id}).encode()
                    await daemon.broker.submit(Command(lease.scheduler, "release", body, topic))
                await daemon.broker.idle()
                for lease in left:
                    now = daemon.book.get(lease.lease_id)
                    if now is not None and now.state is LeaseState.RELEASED:
                        self.tally.released_at_exit += 1

    async def _release(self, client: BrokerClient, lease_id: str) -> None:
        held = next((lease for lease in client.leases if lease.lease_id == lease_id), None)
        try:
            if held is not None:
                await held.release(timeout=RELEASE_TIMEOUT)  # counted by _on_end
            elif await client.release(lease_id, timeout=RELEASE_TIMEOUT) is \
                    LeaseState.RELEASED:
                self.tally.released_at_exit += 1
        except BrokerError:
            pass  # counted as left active, if it is
