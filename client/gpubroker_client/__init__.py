"""gpubroker_client, a scheduler's client for gpubroker: place, renew, release and
follow leases over MQTT.

::

    async with BrokerClient("mqtt://127.0.0.1:1883", scheduler="train") as c:
        lease = await c.place(gpu=["H100-80GB", "A100-80GB"], gpus=8, market="spot",
                              keep_alive=True)
        print(lease.lease_id, lease.epoch, lease.placement, lease.expires_at)
        async for ev in lease.events():      # failover, renewed, released, expired, failed
            ...
        await lease.release()

What it does for the scheduler (SPEC §3-§5):

* **One connection, kept up, with a persistent session.** Client id
  `gpubroker-client-<scheduler>-<instance>` (`instance=`: a stable name to take the
  session up again after a restart; default a random one), MQTT 5 `clean_start` False
  with `session_expiry` (3.1.1: `clean_session` False), so what comes while it is away
  is kept for it. When the MQTT server goes away it reconnects by itself (jittered
  backoff, 0.5 s doubling to 15 s) and subscribes again before anything is sent, so no
  answer is missed for want of a subscription. `BrokerUnavailable` only when the first
  connection cannot be made within `connect_timeout`.
* **Idempotent requests.** `place()` sends the request (QoS 1, never retained) and waits
  for the answer with its `request_id`; an unanswered request is sent again with the same
  `request_id` (2 s, doubling, at most 15 s apart), and at once after a reconnect (the
  answer may have been lost with the connection) or when the daemon comes back online.
  The daemon answers a repeat with the same lease, never a second one. Renew, release
  and report are re-sent the same way, each with the lease's `epoch` (a report acts once
  per epoch; `lease.current` answers one of an older epoch, and updates the lease).
* **No orphans.** A `place()` cancelled or timed out after its request went out: when
  its decision arrives, the client releases that lease (after a reconnect it asks the
  daemon for the decisions it missed, `lookup`). `new_request_id()` or
  `place(request_id=...)` makes the request id known before the call returns.
* **Bounded, and callbacks apart.** A lease keeps its last 256 events, a lease watch
  queues 10 000 changes, callbacks queue 10 000 (each drops its oldest beyond that);
  callbacks run one at a time in a task of their own, so a slow one never delays a
  renewal. `gpubroker_client.sync.SyncBrokerClient` serves schedulers without asyncio.
* **Replies.** On MQTT 5 every request carries a ResponseTopic under
  `P/replies/S/<random>` and a CorrelationData; answers are still taken from
  `P/events/S/...` as well (MQTT 3.1.1, or whichever copy comes first). Every event is
  handled once, by its CloudEvents `id`.
* **Fencing.** A lease's `epoch` grows with each failover; events of a lower epoch than
  the lease has seen (a late re-send) are ignored. After a reconnect the retained lease
  state (`P/leases/S/<id>`) tells of a failover whose event was missed while away.
* **The daemon's status.** `daemon_online` follows `P/status` (`None` until known).
  Requests keep waiting, and re-sending, while the daemon is offline, until their own
  deadline.
* **Leader epochs** (high availability). A `P/status` whose `epoch` is lower than the
  highest leader epoch seen (on a status or in an event's `leaderepoch`) comes from a
  deposed leader, late: it is ignored, so it cannot make the client believe the daemon
  offline while the new leader serves. An event whose `leaderepoch` is lower than the
  highest seen on an event is dropped likewise. (Events are compared with events only:
  a new leader sends the old one's unacknowledged events again, byte for byte, with
  their old `leaderepoch`, after its own `online`.)

A lease that ends while the client is disconnected is learnt from its end event, kept in
the persistent session, or at the latest at the next `renew()`, which the keep-alive
sends.

Its own distribution, `gpubroker-client` (client/pyproject.toml: `pip install ./client`),
needs only aiomqtt; the daemon's distribution, `gpubroker`, ships this package too. It
imports nothing of the daemon. The modules: `session` (the connection), `client`
(`BrokerClient`'s verbs and requests), `lease` (a held lease, its keep-alive and events),
`requests` (sending and matching answers), `orphans` (placements given up), `callbacks`,
`options`, `sync` (the blocking wrapper), `watch` (`LeaseWatch`), `events` and `errors`
(what it reports), `model` (the wire
vocabulary it shares with the daemon), and two pieces the daemon uses as well: `files`
(the one reader of operator-given files, the password file here) and `mqtturl` (the one
MQTT URL parser).

`BrokerClient`, `DEFAULT_PREFIX`, `Lease` and `LeaseWatch` are loaded on first use (with
asyncio and aiomqtt): the daemon's shared vocabulary (`broker.model`, which every part of
the daemon, the adapters and the policies import) imports `gpubroker_client.model`, which
runs this file first, and that should load no MQTT client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gpubroker_client.errors import (
    BrokerError,
    BrokerUnavailable,
    InvalidRequest,
    LeaseEnded,
    PlacementTimeout,
    Rejected,
    ReportDeclined,
    RequestTimeout,
    StaleEpoch,
)
from gpubroker_client.events import (
    EventType,
    LeaseChange,
    LeaseChangeKind,
    LeaseEvent,
    LeaseEventKind,
    RejectCode,
)
from gpubroker_client.model import LeaseState, Market, Placement, PoolKey
from gpubroker_client.mqtturl import parse_mqtt_url

if TYPE_CHECKING:
    from gpubroker_client.client import BrokerClient
    from gpubroker_client.lease import Lease
    from gpubroker_client.session import DEFAULT_PREFIX
    from gpubroker_client.watch import LeaseWatch

__all__ = [
    "DEFAULT_PREFIX",
    "BrokerClient",
    "BrokerError",
    "BrokerUnavailable",
    "EventType",
    "InvalidRequest",
    "Lease",
    "LeaseChange",
    "LeaseChangeKind",
    "LeaseEnded",
    "LeaseEvent",
    "LeaseEventKind",
    "LeaseState",
    "LeaseWatch",
    "Market",
    "Placement",
    "PlacementTimeout",
    "PoolKey",
    "RejectCode",
    "Rejected",
    "ReportDeclined",
    "RequestTimeout",
    "StaleEpoch",
    "parse_mqtt_url",
]

_LAZY = {"BrokerClient": "client", "DEFAULT_PREFIX": "session", "Lease": "lease",
         "LeaseWatch": "watch"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
