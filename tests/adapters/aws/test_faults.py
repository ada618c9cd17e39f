"""The AWS adapter against a fake AWS that misbehaves the way AWS does: a share of calls
throttled, answered with a 5xx, answered too late, or answered with a body cut in half
(`fake_server.Chaos`). A first poll must give exactly the offers of a fault-free one
(every key and value but `observed_at`), and `gpubroker offers` must print them, exit 0
and show no traceback.

The in-process polls use a retry policy of 20 attempts (AWS's default is 12, bounded by
the poll's deadline): at 50 % faults, a call failing 12 times in a row is a 1-in-4,096 event,
and a first poll makes ~160 calls. To keep them fast, backoff is capped lower, and the
throttles of the throttle-only run ask for 0.25 s (`x-amz-retry-after: 250`, the
header AWS's SDKs read) instead of the fake's `Retry-After: 1`, which the mixed run
keeps. The command-line run uses the defaults, at 30 %.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from fake_aws import FakeAWS, fake_credentials
from fake_server import CHAOS_KINDS, Chaos

from adapters.aws.adapter import AwsAdapter
from adapters.common import RetryPolicy, poll_deadline
from broker.model import Offer

REGION = "us-east-1"
Rows = dict[tuple[str, ...], dict[str, Any]]


def comparable(rows: list[dict[str, Any]]) -> Rows:
    """Offers (as `Offer.to_json` gives them) by pool, without `observed_at`."""
    out: Rows = {}
    for row in rows:
        row = {k: v for k, v in row.items() if k != "observed_at"}
        key = tuple(str(row[k]) for k in ("cloud", "region", "zone", "instance_type",
                                          "market"))
        assert key not in out
        out[key] = row
    return out


async def first_poll(fake: FakeAWS, *, retry: RetryPolicy | None = None,
                     call_timeout: float = 10.0) -> list[Offer]:
    adapter = AwsAdapter(regions=[REGION], endpoint=fake.url, call_timeout=call_timeout,
                         retry=retry)
    try:
        with poll_deadline(60):
            return await adapter.poll(REGION)
    finally:
        await adapter.close()


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeAWS]:
    """One fake for the module (its first poll warms moto's caches once)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        fake_credentials(monkeypatch)
        with FakeAWS() as fake:
            yield fake


@pytest.fixture(scope="module")
def fault_free(fake: FakeAWS) -> Rows:
    offers = asyncio.run(first_poll(fake))
    rows = comparable([o.to_json() for o in offers])
    # What the comparisons stand on: prices, unpriced pools, every optional signal.
    assert any(r["price_per_hour"] is None for r in rows.values())
    for signal in ("availability", "interruption_rate", "quota_headroom"):
        assert any(r[signal] is not None for r in rows.values()), signal
    return rows


@pytest.fixture
def chaos(fake: FakeAWS) -> Iterator[FakeAWS]:
    fake.reset_calls()
    fake.faulted.clear()
    try:
        yield fake
    finally:
        fake.chaos = None
        fake.throttle_headers = {"Retry-After": "1"}


@pytest.mark.parametrize(("kinds", "rate", "max_backoff"), [
    (("throttle",), 0.5, 0.3), (("5xx",), 0.5, 0.3), (("timeout",), 0.5, 0.3),
    (("truncated",), 0.5, 0.3), (CHAOS_KINDS, 0.3, 1.0),
], ids=["throttle", "5xx", "timeout", "truncated", "mixed"])
async def test_a_first_poll_under_faults_gives_the_fault_free_offers(
        chaos: FakeAWS, fault_free: Rows, kinds: tuple[str, ...], rate: float,
        max_backoff: float) -> None:
    # Timed-out calls: the fake answers after 1 s, the client gives up after 0.5 s.
    chaos.chaos = Chaos(rate=rate, kinds=kinds, hang_seconds=1.0, seed=15)
    if kinds == ("throttle",):
        chaos.throttle_headers = {"x-amz-retry-after": "250"}
    started = time.perf_counter()
    offers = await first_poll(chaos, call_timeout=0.5,
                              retry=RetryPolicy(attempts=20, max_backoff=max_backoff))
    wall = time.perf_counter() - started
    assert comparable([o.to_json() for o in offers]) == fault_free
    assert set(chaos.faulted) == set(kinds)
    print(f"{'+'.join(kinds)} at {rate:.0%}: {sum(chaos.calls.values())} calls, "
          f"{sum(chaos.faulted.values())} faulted {dict(chaos.faulted)}, {wall:.1f} s")


def offers_command(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "broker.cli", "offers", "--config", str(config),
         "--cloud", "aws", "--format", "json"],
        capture_output=True, text=True, timeout=120, check=False)


def test_offers_command_under_faults_prints_the_fault_free_offers(
        chaos: FakeAWS, tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "poll": {"timeout_seconds": 60},
        "clouds": {"aws": {"regions": [REGION], "endpoint": chaos.url, "anonymous": True,
                           "call_timeout_seconds": 1}}}))
    clean = offers_command(config)
    assert clean.returncode == 0, clean.stderr
    calls = sum(chaos.calls.values())
    chaos.reset_calls()
    chaos.chaos = Chaos(rate=0.3, hang_seconds=1.5, seed=15)
    faulted = offers_command(config)
    assert faulted.returncode == 0, faulted.stderr
    assert "Traceback" not in faulted.stderr, faulted.stderr
    expected = comparable([json.loads(line) for line in clean.stdout.splitlines()])
    got = comparable([json.loads(line) for line in faulted.stdout.splitlines()])
    assert got == expected and expected
    assert set(chaos.faulted) == set(CHAOS_KINDS)
    print(f"fault-free: {calls} calls; 30 % faulted: {sum(chaos.calls.values())} calls, "
          f"{dict(chaos.faulted)}")
