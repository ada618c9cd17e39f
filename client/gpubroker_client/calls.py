"""The requests behind the verbs: sent (QoS 1, never retained) and sent again until
answered, and their answers matched (by CorrelationData on MQTT 5; by the answer's
`request_id`, or its `verb` and `lease_id`, on either version)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiomqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from gpubroker_client.errors import BrokerError, InvalidRequest, RequestTimeout
from gpubroker_client.events import _full_kind
from gpubroker_client.lease import Lease
from gpubroker_client.session import Session

__all__ = ["MAX_REQUEST", "Requests"]

log = logging.getLogger("gpubroker.client")

MAX_REQUEST = 64 * 1024
"""The daemon answers larger requests "too large" without their request_id."""

LEASE_ANSWERS = {
    "renew": {"lease.renewed"}, "release": set(),
    "report": {"lease.failover", "report.declined"},
}
"""The answers of each verb on a lease, besides how it ended and `lease.current`."""


@dataclass(eq=False, slots=True)
class _Waiter:
    match: Callable[[str, Mapping[str, Any]], bool]
    token: bytes = field(default_factory=lambda: uuid.uuid4().bytes)
    answer: Mapping[str, Any] | None = None
    sent: bool = False  # a publish was attempted: the daemon may have it
    lease: Lease | None = None  # a placement.decided answer's lease
    error: str | None = None  # an answer that could not be read
    kick: asyncio.Event = field(default_factory=asyncio.Event)


class Requests(Session):
    """A `Session` that sends requests and waits for their answers (`BrokerClient`'s
    base)."""

    async def _lease_verb(self, verb: str, lease_id: str, timeout: float,
                          body: Mapping[str, Any] | None = None, *,
                          once: bool = False) -> Mapping[str, Any]:
        """Send renew/release/report for `lease_id` and wait for its answer: an event of
        that lease (renewed, failover, `lease.current`, `report.declined`, or how it
        ended). Raises InvalidRequest."""
        scheduler = self._need_scheduler()
        if not isinstance(lease_id, str) or not 0 < len(lease_id) <= 128:
            raise InvalidRequest([{"field": "lease_id",
                                   "message": "must be a string of 1 to 128 characters"}])
        topic = f"{self.prefix}/requests/{scheduler}/{verb}"
        answers = LEASE_ANSWERS[verb] | \
            {"lease.released", "lease.expired", "lease.failed", "lease.current"}

        def match(kind: str, data: Mapping[str, Any]) -> bool:
            if kind in answers:
                return data.get("lease_id") == lease_id
            return kind == "request.invalid" and _invalid_for(data, topic, verb, lease_id)

        payload = json.dumps(body or {"lease_id": lease_id}, separators=(",", ":")).encode()
        env = (await self._request(topic, payload, match, timeout, once=once)).answer
        assert env is not None
        if _full_kind(env) == "request.invalid":
            raise InvalidRequest(env["data"].get("errors") or [], None, env)
        return env

    def _need_scheduler(self) -> str:
        if self.scheduler is None:
            raise BrokerError("this client has no scheduler id (scheduler=None): read only")
        return self.scheduler

    def _timeout_message(self, what: str, timeout: float) -> str:
        if not self.connected:
            why = "the MQTT server is unreachable"
        elif self.daemon_online is False:
            why = "the daemon is offline"
        elif self.daemon_online is None:
            why = "no daemon has announced itself on this topic prefix"
        else:
            why = "the daemon is online but did not answer"
        return f"no answer to {what} within {timeout:g}s ({why})"

    async def _request(self, topic: str, payload: bytes,
                       match: Callable[[str, Mapping[str, Any]], bool],
                       timeout: float, *, once: bool = False,
                       waiter: _Waiter | None = None) -> _Waiter:
        """Publish `payload` and wait for the matching answer; send it again with
        backoff, after every reconnect and when the daemon comes back online, until the
        deadline. `once`: only until the MQTT server has acknowledged it (a request
        whose repeat is not harmless: a report moves the lease each time)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        waiter = waiter or _Waiter(match)
        self._waiters.add(waiter)
        self._by_token[waiter.token] = waiter
        props = None
        if self._v5 and self._reply_topic is not None:
            props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
            props.ResponseTopic = self._reply_topic
            props.CorrelationData = waiter.token
        delay = self.resend_after
        sent: tuple[int, int] | None = None  # (connection, daemon online) generations
        delivered = False  # `once` and acknowledged: never again
        next_send = loop.time()
        try:
            while True:
                if waiter.answer is not None:
                    return waiter
                if self._closed:
                    raise BrokerError("the client is closed")
                now = loop.time()
                if now >= deadline:
                    raise RequestTimeout(self._timeout_message(topic, timeout))
                client = self._client
                marks = (self._generation, self._online_generation)
                due = sent != marks or now >= next_send
                if client is not None and self.connected and due and not delivered:
                    waiter.kick.clear()
                    again = sent is not None
                    sent = marks
                    waiter.sent = True
                    if await self._publish(client, topic, payload, props):
                        if again:
                            log.info("no answer yet; sent again: %s", topic)
                        delivered = once
                        next_send = loop.time() + delay
                        delay = min(delay * 2, self.resend_max)
                    else:  # the connection is likely going: again after it, or in 1 s
                        next_send = loop.time() + 1.0
                    continue
                wake = min(deadline, next_send) if self.connected and not delivered \
                    else deadline
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout_at(wake):
                        await waiter.kick.wait()
                waiter.kick.clear()
        finally:
            self._waiters.discard(waiter)
            self._by_token.pop(waiter.token, None)

    async def _publish(self, client: aiomqtt.Client, topic: str, payload: bytes,
                       props: Properties | None) -> bool:
        """QoS 1, never retained; True once the server acknowledged it. (asyncio.timeout,
        not aiomqtt's own, for the reason in `broker.edges.bus.Bus._publish`.)"""
        try:
            async with asyncio.timeout(10):
                await client.publish(topic, payload, qos=1, retain=False,
                                     properties=props if self._v5 else None,
                                     timeout=math.inf)
        except (aiomqtt.MqttError, TimeoutError) as exc:
            log.info("publish on %s failed (%s); the request is sent again", topic, exc)
            return False
        return True



def _invalid_for(data: Mapping[str, Any], topic: str, verb: str, lease_id: str) -> bool:
    """Whether a `request.invalid` answers `verb` on `lease_id` (3.1.1 has no
    CorrelationData to match by). Contract 1.1: by its `verb` and `lease_id`. A 1.0
    daemon's names the topic, and its message quotes the lease id."""
    if "verb" in data:
        return data.get("verb") == verb and data.get("lease_id") == lease_id
    quoted = repr(lease_id)
    return data.get("topic") == topic and any(
        quoted in str(e.get("message", "")) for e in data.get("errors") or [])
