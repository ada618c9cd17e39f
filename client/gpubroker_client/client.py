"""`BrokerClient`: the scheduler's verbs (place, adopt, renew, release, report, watch)
on a `Session`, and what it does with the answers: the leases it holds, and the release
of the leases of placements given up (`gpubroker_client.orphans`)."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Literal

from gpubroker_client.calls import MAX_REQUEST, Requests, _Waiter
from gpubroker_client.errors import (
    BrokerError,
    InvalidRequest,
    LeaseEnded,
    PlacementTimeout,
    Rejected,
    ReportDeclined,
    RequestTimeout,
    StaleEpoch,
)
from gpubroker_client.events import (
    _ENDS,
    EventType,
    LeaseEvent,
    LeaseEventKind,
    _full_kind,
    _kind,
    _remaining,
)
from gpubroker_client.lease import Callback, Lease
from gpubroker_client.model import SCHEDULER_ID, LeaseState, Placement, parse_iso
from gpubroker_client.orphans import Abandoned
from gpubroker_client.watch import LeaseWatch

__all__ = ["MAX_REQUEST", "BrokerClient"]

log = logging.getLogger("gpubroker.client")

ORPHAN_RELEASE_TIMEOUT = 60.0
"""How long the release of a given-up placement's lease is sent again."""

ReportKind = Literal["interrupted", "launch_failed", "unhealthy"]


class BrokerClient(Requests):
    """An asyncio client of one gpubroker daemon (SPEC §3-§5), for scheduler `scheduler`.

    Connection options mirror the daemon's `mqtt` config: `url` (`mqtt://` or
    `mqtts://`), `topic_prefix`, `username`, `password` or `password_file`, `ca_file`
    (or a ready `ssl_context`), `protocol` (`"5"`, `"3.1.1"`, or `"auto"`: MQTT 5, and
    3.1.1 when the server does not speak 5).

    The session is persistent (SPEC §3.2): MQTT 5 `clean_start` False with a session
    expiry of `session_expiry` seconds (default 3600), 3.1.1 `clean_session` False, so
    the MQTT server keeps what comes while the connection is down. Its client id is
    `gpubroker-client-<scheduler>-<instance>`: give `instance` (a name of this process
    among the scheduler's, `[A-Za-z0-9_.-]{1,64}`) to take the session up again after a
    restart — one connection per instance name at a time (a second one takes the
    session over and the first reconnects, in turn); without it, a random one (the
    session then serves this process's reconnects only). `client_id` overrides the id;
    `persistent=False` (or `session_expiry=0`) asks for a clean session.
    `scheduler=None` makes a read-only client (lease watches, status)."""

    @functools.cached_property
    def _abandoned(self) -> Abandoned:
        """The request ids of `place()` calls given up (`gpubroker_client.orphans`)."""
        return Abandoned()

    @staticmethod
    def new_request_id() -> str:
        """A fresh request id (a uuid4), to give `place(request_id=...)` — so that it is
        known before the placement is decided."""
        return str(uuid.uuid4())

    # --- verbs -------------------------------------------------------------------------

    # Many arguments: the public client's API: one keyword per field of a request.
    async def place(self, gpu: str | Sequence[str], gpus: int, *,  # noqa: PLR0913
                    market: Literal["spot", "on_demand", "reserved", "any"] | None = None,
                    request_id: str | None = None, timeout: float = 60.0,
                    gang: bool | None = None, max_price_per_gpu_hour: float | None = None,
                    clouds: Sequence[str] | None = None, regions: Sequence[str] | None = None,
                    team: str | None = None, duration_hours: float | None = None,
                    lease_seconds: int | None = None, labels: Mapping[str, str] | None = None,
                    max_parts: int | None = None,
                    keep_alive: bool | float = False, on_failover: Callback | None = None,
                    on_end: Callback | None = None, release_abandoned: bool = True,
                    **extra: Any) -> Lease:
        """Ask for `gpus` GPUs of model `gpu` (one name or a list of acceptable ones).

        `request_id` is the idempotency key: give one (`new_request_id()` makes one) to
        know it before the call returns — to find the lease later (`adopt`), or to ask
        again after a crash; without one the client makes a uuid (`lease.request_id`,
        `PlacementTimeout.request_id`).

        Returns the `Lease` (`placement.decided`); for a `request_id` whose lease has
        ended since, that ended lease (`lease.active` is False). Raises `Rejected`,
        `InvalidRequest`, or `PlacementTimeout` after `timeout` seconds without an answer
        (re-sent meanwhile with the same `request_id`, so a repeat cannot place twice).

        Given up — the call cancelled, or timed out — after the request went out, the
        daemon may still decide it: the client then releases that lease as soon as the
        decision arrives (after a reconnect it asks the daemon with `lookup`), so no
        lease is left that nobody holds. `release_abandoned=False` keeps such a lease for
        a `place()` with the same `request_id` (or `adopt`) instead; calling `place()`
        again with the same `request_id` also takes it back from the release.
        `keep_alive=True` renews before expiry (a number: that margin in seconds).
        With `gang=False` and `max_parts` above 1 the request may be split across pools:
        the returned lease is the first part, `lease.parts` all of them (the callbacks
        and the keep-alive apply to each).
        Extra keyword arguments are sent as further request fields."""
        scheduler = self._need_scheduler()
        rid = self.new_request_id() if request_id is None else request_id
        if not isinstance(rid, str) or not 0 < len(rid) <= 128:
            raise InvalidRequest([{"field": "request_id",
                                   "message": "must be a string of 1 to 128 characters"}],
                                 None)
        body: dict[str, Any] = {"request_id": rid,
                                "gpu": gpu if isinstance(gpu, str) else list(gpu),
                                "gpus": gpus}
        optional = {"gang": gang, "market": market,
                    "max_price_per_gpu_hour": max_price_per_gpu_hour,
                    "clouds": None if clouds is None else list(clouds),
                    "regions": None if regions is None else list(regions), "team": team,
                    "duration_hours": duration_hours, "lease_seconds": lease_seconds,
                    "max_parts": max_parts,
                    "labels": None if labels is None else dict(labels), **extra}
        body.update({k: v for k, v in optional.items() if v is not None})
        payload = json.dumps(body, separators=(",", ":")).encode()
        if len(payload) > MAX_REQUEST:
            raise InvalidRequest([{"field": "", "message": f"too large: {len(payload)} "
                                   f"bytes (at most {MAX_REQUEST})"}], rid)

        def match(kind: str, data: Mapping[str, Any]) -> bool:
            return kind in ("placement.decided", "placement.rejected", "request.invalid") \
                and data.get("request_id") == rid

        waiter = _Waiter(match)
        self._abandoned.take(rid)  # asked for again: not given up
        held = any(le.request_id == rid for le in self._leases.values())
        try:
            answer = await self._request(f"{self.prefix}/requests/{scheduler}/place",
                                         payload, match, timeout, waiter=waiter)
        except RequestTimeout:
            if release_abandoned:
                self._give_up(rid, waiter, held)
            raise PlacementTimeout(self._timeout_message(f"placement {rid}", timeout),
                                   rid) from None
        except asyncio.CancelledError:
            if release_abandoned:
                self._give_up(rid, waiter, held)
            raise
        env = answer.answer
        assert env is not None
        if answer.error is not None:
            raise BrokerError(f"placement {rid}: {answer.error}")
        kind, data = _full_kind(env), env["data"]
        if kind == "placement.rejected":
            retry = data.get("retry_after_seconds")
            raise Rejected(str(data.get("code", "")), str(data.get("detail", "")),
                           float(retry) if isinstance(retry, int | float) else None, rid, env)
        if kind == "request.invalid":
            raise InvalidRequest(data.get("errors") or [], rid, env)
        lease = answer.lease
        assert lease is not None
        self._hold(lease, keep_alive, on_failover, on_end)
        return lease

    async def adopt(self, lease_id: str | None = None, *, request_id: str | None = None,
                    keep_alive: bool | float = False, on_failover: Callback | None = None,
                    on_end: Callback | None = None, timeout: float = 30.0) -> Lease:
        """Hold a lease that exists already (placed by an earlier run of this scheduler,
        or by another of its clients): by `lease_id`, from its retained state
        (`P/leases/S/<id>`), or by the `request_id` it was placed with (`lookup`, contract
        1.1). Returns the `Lease`, kept current like a placed one (`keep_alive`,
        `on_failover`, `on_end` as for `place`); for a `request_id` whose lease has
        ended, that ended lease. Raises `LeaseEnded` for a `lease_id` that has ended,
        `InvalidRequest` for one the scheduler does not have, `RequestTimeout`."""
        if (lease_id is None) == (request_id is None):
            raise ValueError("adopt takes a lease_id or a request_id, one of them")
        if lease_id is not None:
            lease = self._leases.get(lease_id) or await self._adopt_by_id(lease_id, timeout)
        else:
            assert request_id is not None
            lease = await self._look_up(request_id, timeout)
        self._hold(lease, keep_alive, on_failover, on_end)
        return lease

    async def _adopt_by_id(self, lease_id: str, timeout: float) -> Lease:
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            async with asyncio.timeout_at(deadline):
                await self._states_synced.wait()
        except TimeoutError:
            raise RequestTimeout(f"no retained lease states within {timeout:g}s") from None
        if lease_id not in self._states:
            # Not active, or its state not retained (yet): a renewal says how it ended,
            # or (re)publishes the state.
            env = await self._lease_verb("renew", lease_id, timeout)
            kind = _kind(env)
            if kind in _ENDS:
                raise LeaseEnded(lease_id, _ENDS[kind], env["data"].get("detail"))
            try:
                async with asyncio.timeout_at(deadline):
                    while lease_id not in self._states:
                        pulse = self._state_pulse
                        await pulse.wait()
            except TimeoutError:
                raise RequestTimeout(f"no retained state of lease {lease_id} within "
                                     f"{timeout:g}s") from None
        return self._lease_of_state(self._states[lease_id])

    async def _look_up(self, request_id: str, timeout: float) -> Lease:
        scheduler = self._need_scheduler()
        topic = f"{self.prefix}/requests/{scheduler}/lookup"

        def match(kind: str, data: Mapping[str, Any]) -> bool:
            if kind == "request.invalid":
                return data.get("verb", "lookup") == "lookup" and (
                    data.get("request_id") == request_id or data.get("topic") == topic)
            return kind == "placement.decided" and data.get("request_id") == request_id

        payload = json.dumps({"request_id": request_id}, separators=(",", ":")).encode()
        answer = await self._request(topic, payload, match, timeout)
        env = answer.answer
        assert env is not None
        if answer.error is not None:
            raise BrokerError(f"lookup {request_id}: {answer.error}")
        if _full_kind(env) == "request.invalid":
            raise InvalidRequest(env["data"].get("errors") or [], request_id, env)
        assert answer.lease is not None
        return answer.lease

    @staticmethod
    def _hold(lease: Lease, keep_alive: bool | float, on_failover: Callback | None,
              on_end: Callback | None) -> None:
        for part in lease.parts:
            if on_failover is not None:
                part.on_failover = on_failover
            if on_end is not None:
                part.on_end = on_end
            if keep_alive is not False and part.active:
                part.keep_alive(None if keep_alive is True else float(keep_alive))

    async def release(self, lease_id: str, timeout: float = 30.0, *,
                      epoch: int | None = None) -> LeaseState:
        """Release a lease by id (one this client may not hold: the command line's
        `release`). Returns how it ended (RELEASED, or EXPIRED/FAILED before); raises
        `InvalidRequest` (field `lease_id`) for a lease the scheduler does not have, and
        `StaleEpoch` when `epoch` is given and the lease has moved on from it."""
        lease = self._leases.get(lease_id)
        if lease is not None and epoch is None:
            await lease.release(timeout)
            return lease.state
        env = await self._by_id("release", lease_id, timeout, epoch)
        return _ENDS[_kind(env)]

    async def renew(self, lease_id: str, timeout: float = 30.0, *,
                    epoch: int | None = None) -> datetime:
        """Renew a lease by id; returns the new expiry. Raises `LeaseEnded`, and
        `StaleEpoch` when `epoch` is given and the lease has moved on from it."""
        lease = self._leases.get(lease_id)
        if lease is not None and epoch is None:
            await lease.renew(timeout)
            return lease.expires_at
        env = await self._by_id("renew", lease_id, timeout, epoch)
        kind, data = _kind(env), env["data"]
        if kind in _ENDS:
            raise LeaseEnded(lease_id, _ENDS[kind], data.get("detail"))
        return parse_iso(data["expires_at"])

    async def report(self, lease_id: str, kind: ReportKind, detail: str | None = None, *,
                     epoch: int | None = None, timeout: float = 30.0) -> LeaseEvent:
        """Report a lease by id (`Lease.report` for a held one): returns the failover
        event. Raises `LeaseEnded`, `ReportDeclined`, and `StaleEpoch` (the lease has
        moved on from `epoch`: nothing was done). With `epoch` the report is sent again
        until answered; without (the lease's current epoch, 1.0) it is sent until the
        MQTT server has it only, as a repeat could move the lease twice."""
        lease = self._leases.get(lease_id)
        if lease is not None and epoch in (None, lease.epoch):
            return await lease.report(kind, detail, timeout)
        body: dict[str, Any] = {"lease_id": lease_id, "kind": kind}
        if detail is not None:
            body["detail"] = detail
        env = await self._by_id("report", lease_id, timeout, epoch, body)
        answer, data = _kind(env), env["data"]
        if answer in _ENDS:
            raise LeaseEnded(lease_id, _ENDS[answer], data.get("detail"))
        if answer == EventType.REPORT_DECLINED:
            retry = data.get("retry_after_seconds")
            raise ReportDeclined(lease_id, int(data.get("epoch", epoch or 0)), kind,
                                 str(data.get("reason", "")),
                                 float(retry) if isinstance(retry, int | float) else 0.0, env)
        return LeaseEvent(LeaseEventKind.FAILOVER, lease_id, int(data["epoch"]),
                          Placement.from_json(data["to"]), Placement.from_json(data["from"]),
                          None, data.get("reason"), data.get("detail"), env)

    async def _by_id(self, verb: str, lease_id: str, timeout: float, epoch: int | None,
                     body: dict[str, Any] | None = None) -> Mapping[str, Any]:
        """A verb on a lease by id, at `epoch` when given; `lease.current` raises."""
        body = dict(body or {"lease_id": lease_id})
        if epoch is not None:
            body["epoch"] = epoch
        env = await self._lease_verb(verb, lease_id, timeout, body,
                                     once=verb == "report" and epoch is None)
        if _kind(env) == "current":
            data = env["data"]
            raise StaleEpoch(lease_id, int(data.get("epoch", 0)),
                             data.get("stale_epoch", epoch), data)
        return env

    def watch_leases(self, scheduler: str | None = None, *,
                     all_schedulers: bool = False) -> LeaseWatch:
        """The retained lease states of one scheduler (default: this client's) or of
        all, as `async with client.watch_leases() as watch:` — see `LeaseWatch`."""
        s = scheduler or self.scheduler
        if all_schedulers:
            s = "+"
        elif s is None or not SCHEDULER_ID.match(s):
            raise ValueError("watch_leases needs a scheduler id or all_schedulers=True")
        return LeaseWatch(self, s)

    # --- placements given up -----------------------------------------------------------

    def _give_up(self, request_id: str, waiter: _Waiter, held: bool) -> None:
        """A `place()` cancelled or timed out: release the lease of its decision — now
        if it came already (and was not held before this call), or when it comes."""
        if waiter.lease is not None:
            if not held:
                for part in waiter.lease.parts:
                    if part.active:
                        self._spawn(self._release_orphan(part.lease_id))
        elif waiter.answer is None and waiter.sent:
            self._abandoned.add(request_id)

    def _unclaimed(self, kind: str, data: Mapping[str, Any]) -> None:
        """An answer nobody waits for: a decision of a given-up `place()` is released."""
        rid = data.get("request_id")
        if not isinstance(rid, str) or rid not in self._abandoned:
            return
        if kind == EventType.PLACEMENT_DECIDED:
            self._abandoned.take(rid)
            if data.get("state", "active") == "active":
                for part in data.get("parts") or [data]:
                    if isinstance(part.get("lease_id"), str):
                        self._spawn(self._release_orphan(part["lease_id"]))
        elif kind == EventType.PLACEMENT_REJECTED or (
                kind == EventType.REQUEST_INVALID and data.get("verb", "place") == "place"):
            self._abandoned.take(rid)  # nothing was placed

    async def _release_orphan(self, lease_id: str) -> None:
        lease = self._leases.get(lease_id)
        try:
            if lease is not None:
                await lease.release(ORPHAN_RELEASE_TIMEOUT)
            else:
                await self._lease_verb("release", lease_id, ORPHAN_RELEASE_TIMEOUT)
        except BrokerError as exc:
            log.warning("could not release lease %s of a placement given up: %s",
                        lease_id, exc)
            return
        log.info("lease %s of a placement given up released", lease_id)

    def _reconnected(self) -> None:
        """Connected again: the decision of a given-up placement may have been lost with
        the connection; ask for it (`lookup`: its answer is a `placement.decided`, which
        `_unclaimed` releases)."""
        pending = self._abandoned.pending()
        client = self._client
        if pending and client is not None and self.scheduler is not None:
            topic = f"{self.prefix}/requests/{self.scheduler}/lookup"
            for rid in pending:
                payload = json.dumps({"request_id": rid}, separators=(",", ":")).encode()
                self._spawn(self._publish(client, topic, payload, None))

    def _dispatch(self, env: Mapping[str, Any], correlation: bytes | None) -> None:
        kind, data = _full_kind(env), env["data"]
        # The lease first, so that an answer's waiter sees the lease updated.
        lease = self._leases.get(str(data.get("lease_id", "")))
        if lease is not None and kind.startswith("lease."):
            try:
                lease._apply(_kind(env), env)
            except (KeyError, ValueError, TypeError) as exc:
                log.warning("malformed %s event for %s ignored: %s", kind, lease.lease_id, exc)
        waiter = self._by_token.get(correlation) if correlation else None
        if waiter is None:
            waiter = next((w for w in self._waiters if w.match(kind, data)), None)
        if waiter is None:
            self._unclaimed(kind, data)
            return
        if waiter.answer is not None:
            return
        if kind == "placement.decided":
            try:
                waiter.lease = self._adopt(env)
            except (KeyError, ValueError, TypeError) as exc:
                waiter.error = f"unreadable placement.decided ({type(exc).__name__}: {exc})"
        waiter.answer = env
        waiter.kick.set()

    def _adopt(self, env: Mapping[str, Any]) -> Lease:
        """The lease of a `placement.decided` answer: the one already held (a repeat
        may show a later epoch or an end), or a new one."""
        d = env["data"]
        lease = self._leases.get(d["lease_id"])
        if lease is None:
            return self._lease_of(env)
        if d.get("state") in _ENDS:
            lease._apply(d["state"], {**env, "data": {"lease_id": lease.lease_id}})
        elif int(d["epoch"]) > lease.epoch:
            lease._move(int(d["epoch"]), Placement.from_json(d["placement"]), None,
                        "learnt from a repeated placement", env)
        return lease

    def _lease_of(self, env: Mapping[str, Any]) -> Lease:
        d = env["data"]
        assert self.scheduler is not None
        made: list[Lease] = []
        for part in d.get("parts") or [d]:
            held = self._leases.get(part["lease_id"]) if made else None
            if held is not None:  # a part this client already holds
                made.append(held)
                continue
            expires = parse_iso(part["expires_at"])
            lease = Lease(self, lease_id=part["lease_id"], scheduler=self.scheduler,
                          request_id=d["request_id"], epoch=int(part["epoch"]),
                          placement=Placement.from_json(part["placement"]),
                          expires_at=expires, remaining=_remaining(expires, env),
                          state=LeaseState(part.get("state", "active")),
                          reason=str(d.get("reason", "")),
                          alternatives=[Placement.from_json(a)
                                        for a in d.get("alternatives", [])] if not made else [],
                          decided=d, lease_seconds=d.get("lease_seconds"))
            if lease.active:
                self._leases[lease.lease_id] = lease
            made.append(lease)
        for lease in made:
            lease.parts = made
        return made[0]

    def _lease_of_state(self, state: Mapping[str, Any]) -> Lease:
        """A lease held from its retained state (`adopt`)."""
        assert self.scheduler is not None
        expires = parse_iso(state["expires_at"])
        lease = Lease(self, lease_id=state["lease_id"], scheduler=self.scheduler,
                      request_id=str(state.get("request_id", "")), epoch=int(state["epoch"]),
                      placement=Placement.from_json(state["placement"]), expires_at=expires,
                      remaining=(expires - datetime.now(UTC)).total_seconds(),
                      state=LeaseState.ACTIVE, reason="", alternatives=[], decided=state,
                      lease_seconds=state.get("lease_seconds"))
        self._leases[lease.lease_id] = lease
        return lease

    def _forget(self, lease: Lease) -> None:
        self._leases.pop(lease.lease_id, None)
