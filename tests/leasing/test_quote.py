"""`quote` (contract 1.1 §4): what a placement request would get now, holding nothing.

The authority alone (a real pool, lease book and SQLite store), then the real daemon on
a real mosquitto over MQTT 5 and 3.1.1 (HTTP: tests/edges/test_http.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from factories import Clock, Sink, offer, pool_of
from mqtt_helpers import ProbeFactory, payload_json, publish_properties

from broker.leasing.authority import Broker
from broker.leasing.book import LeaseBook
from broker.model import Offer
from broker.state.store import StateStore
from broker.wire.commands import Command
from broker.wire.messages import Envelopes, Messages, Topics
from policies.loader import parse_policy
from policies.model import Policy

P = "gpubroker/v1"


@asynccontextmanager
async def broker_on(tmp_path: Path, offers: list[Offer], policy: Policy
                    ) -> AsyncIterator[tuple[Broker, Sink]]:
    """An authority over `offers` under `policy`, with a real store, and what it
    publishes."""
    clock = Clock()
    store = StateStore(tmp_path / "state.db")
    await store.open()
    sink = Sink()
    b = Broker(pool=pool_of(offers, clock=clock, stale_after_seconds=300), book=LeaseBook(),
               store=store,
               messages=Messages(Topics("p"), Envelopes("t", "boot", clock=clock)),
               policy=policy, publish=sink, retry_after_seconds=60, clock=clock)
    try:
        yield b, sink
    finally:
        await store.close()


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[tuple[Broker, Sink]]:
    async with broker_on(tmp_path, [offer("us-east-1a", price=20.0, capacity=1),
                                    offer("us-east-1b", price=30.0, capacity=1)],
                         Policy()) as got:
        yield got


async def ask(b: Broker, verb: str, body: dict[str, Any]) -> dict[str, Any]:
    """One command through the authority, as the bus or HTTP hands it over; its answer."""
    answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
    await b.handle([Command("sched-a", verb, json.dumps(body).encode(),
                            f"p/requests/sched-a/{verb}", answer=answer)])
    event: dict[str, Any] = json.loads(answer.result())
    return event


BODY = {"gpu": "H100-80GB", "gpus": 8, "duration_hours": 3}


async def test_a_quote_holds_nothing_and_a_place_after_it_gets_that_placement(
        broker: tuple[Broker, Sink]) -> None:
    b, sink = broker
    first = await ask(b, "quote", BODY)
    assert first["type"] == "gpubroker.placement.quoted.v1"
    assert first["subject"] == "request" and "correlationid" not in first
    q = first["data"]
    assert q["placement"]["zone"] == "us-east-1a" and "request_id" not in q
    assert q["expected_cost_per_hour"] >= 20.0
    assert q["expected_cost"] == pytest.approx(3 * q["expected_cost_per_hour"])
    assert [a["zone"] for a in q["alternatives"]] == ["us-east-1b"]
    key = b.pool.by_gpu("H100-80GB")[0].pool
    assert b.pool.held(key) == 0 and b.book.all() == []
    assert not [r for r in sink.rows if r.retain]  # no lease state
    # Nothing held: the same quote again, and the place, get the one free instance.
    again = await ask(b, "quote", {**BODY, "request_id": "q1"})
    assert again["data"]["placement"] == q["placement"]
    assert again["data"]["request_id"] == "q1" and again["correlationid"] == "q1"
    placed = await ask(b, "place", {**BODY, "request_id": "q1"})  # not a repeat of the quote
    assert placed["type"] == "gpubroker.placement.decided.v1"
    assert placed["data"]["placement"] == q["placement"]
    assert b.pool.held(key) == 1
    # Now the next quote sees the capacity taken; then nothing at all.
    assert (await ask(b, "quote", BODY))["data"]["placement"]["zone"] == "us-east-1b"
    await ask(b, "place", {**BODY, "request_id": "r2"})
    none = (await ask(b, "quote", BODY))["data"]
    assert none["code"] == "no_capacity" and none["detail"]
    assert "placement" not in none and "expected_cost" not in none
    assert len(b.book.all()) == 2


async def test_a_quote_is_judged_by_the_policy_and_validated_like_a_place(
        broker: tuple[Broker, Sink]) -> None:
    b, _ = broker
    capped = await ask(b, "quote", {**BODY, "max_price_per_gpu_hour": 1.0})
    assert capped["data"]["code"] == "over_price_cap"
    bad = await ask(b, "quote", {"gpu": "H100-80GB", "gpus": 0, "request_id": "q9"})
    assert bad["type"] == "gpubroker.request.invalid.v1"
    assert bad["data"]["request_id"] == "q9"
    assert [e["field"] for e in bad["data"]["errors"]] == ["gpus"]
    unknown = await ask(b, "quote", {"gpu": "H100", "gpus": 8})
    assert unknown["data"]["errors"][0]["field"] == "gpu"
    assert "H100-80GB" in unknown["data"]["errors"][0]["message"]
    empty_id = await ask(b, "quote", {**BODY, "request_id": ""})
    assert empty_id["data"]["errors"][0]["field"] == "request_id"
    assert b.book.all() == []


async def test_a_quote_sees_the_placements_of_its_own_batch(
        broker: tuple[Broker, Sink]) -> None:
    b, _ = broker
    loop = asyncio.get_running_loop()
    quoted: asyncio.Future[bytes] = loop.create_future()
    placed: asyncio.Future[bytes] = loop.create_future()
    await b.handle([
        Command("sched-a", "quote", json.dumps(BODY).encode(), "p/requests/sched-a/quote",
                answer=quoted),
        Command("sched-a", "place", json.dumps({**BODY, "request_id": "r1"}).encode(),
                "p/requests/sched-a/place", answer=placed)])
    assert json.loads(placed.result())["data"]["placement"]["zone"] == "us-east-1a"
    assert json.loads(quoted.result())["data"]["placement"]["zone"] == "us-east-1b"


async def test_a_quote_is_costed_at_the_requests_risk_level(tmp_path: Path) -> None:
    # A spot pool often interrupted and a calm one 5 % dearer. The team `serving` wants
    # fewest interruptions, except for its sweeps (a rule): lowest cost.
    policy = parse_policy(
        "version: 1\n"
        "teams: {serving: {risk: fewest-interruptions}}\n"
        "rules: [{name: sweeps, match: {labels: {kind: sweep}},"
        " require: {risk: lowest-cost}}]\n")
    async with broker_on(tmp_path, [offer("us-east-1a", price=20.0, interruption_rate=0.3),
                                    offer("us-east-1b", price=21.0, interruption_rate=0.01)],
                         policy) as (b, _):
        body = {**BODY, "market": "spot", "team": "serving"}
        calm = (await ask(b, "quote", body))["data"]
        # 21 × (1 + 0.5 × 0.01) + 8 GPUs × $5 × 0.01
        assert calm["placement"]["zone"] == "us-east-1b"
        assert calm["expected_cost_per_hour"] == pytest.approx(21.505)
        assert calm["expected_cost"] == pytest.approx(3 * 21.505)
        cheap = (await ask(b, "quote", {**body, "labels": {"kind": "sweep"}}))["data"]
        assert cheap["placement"]["zone"] == "us-east-1a"
        assert cheap["expected_cost_per_hour"] == pytest.approx(20.0)
        # A place gets what its quote said.
        placed = await ask(b, "place", {**body, "labels": {"kind": "sweep"},
                                        "request_id": "s1"})
        assert placed["data"]["placement"] == cheap["placement"]


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
async def test_quote_on_mqtt_answers_and_holds_nothing(
        start_daemon: Any, probe_factory: ProbeFactory, protocol: str) -> None:
    rd = await start_daemon(protocol=protocol)
    probe = await probe_factory([f"{P}/events/s1/#", f"{P}/leases/#", f"{P}/replies/s1/#"],
                                protocol=protocol)
    held = {o.pool: rd.daemon.pool.held(o.pool) for o in rd.daemon.pool}
    body = {"request_id": "q-1", "gpu": "H100-80GB", "gpus": 8, "duration_hours": 2}
    props = publish_properties(ResponseTopic=f"{P}/replies/s1/q",
                               CorrelationData=b"c-1") if protocol == "5" else None
    await probe.publish(f"{P}/requests/s1/quote", body, properties=props)
    msg = await probe.wait_for(f"{P}/events/s1/placement.quoted")
    quote = payload_json(msg)
    assert quote["correlationid"] == "q-1"
    data = quote["data"]
    assert data["request_id"] == "q-1" and data["placement"]["gpu"] == "H100-80GB"
    assert data["expected_cost"] == pytest.approx(2 * data["expected_cost_per_hour"])
    if protocol == "5":  # the same bytes to the ResponseTopic, with the correlation data
        reply = await probe.wait_for(f"{P}/replies/s1/q")
        assert reply.payload == msg.payload
        assert bytes(reply.properties.CorrelationData) == b"c-1"  # type: ignore[union-attr]
    # Held nothing: no lease, no instances, no idempotency record.
    assert {o.pool: rd.daemon.pool.held(o.pool) for o in rd.daemon.pool} == held
    assert rd.daemon.book.all() == []
    assert probe.matching(f"{P}/leases/#") == []
    mark = probe.mark()
    await probe.publish(f"{P}/requests/s1/place", body)
    decided = payload_json(await probe.wait_for(f"{P}/events/s1/placement.decided",
                                                since=mark))
    assert not decided["data"]["reason"].startswith("repeated")  # a first placement
    assert decided["data"]["placement"] == data["placement"]
    await probe.wait_for(f"{P}/leases/s1/{decided['data']['lease_id']}")
