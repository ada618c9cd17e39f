"""deploy/mosquitto/ on a real mosquitto: TLS, passwords, the per-scheduler ACL (SPEC §3).

The server runs deploy/mosquitto/mosquitto.conf as shipped, with only its paths moved into
tmp_path (certificates from tests/support/tls_helpers.py, a password file made by the real
``mosquitto_passwd``, persistence) and its listener on a free loopback port; the ACL is
deploy/mosquitto/acl itself. So every client here connects as production clients do: over
TLS, trusting the CA, with a username and password.

Covered: schedulers place only as themselves and read only their own events, leases and
replies (MQTT 5 and 3.1.1), cannot forge anything the daemon publishes; ops reads the
`_ops` events and cannot place; anonymous and wrong logins are refused; a client that
does not trust the CA cannot connect; adding or removing a scheduler is
``mosquitto_passwd`` + reload; and the real daemon, configured as deploy/ says (mqtts://,
user ``gpubroker``, password file, CA file), serves a scheduler behind this ACL.

And what a scheduler might try against the daemon or the others (#26): client ids are
usernames, so one asking for the daemon's client id neither ends its connection nor
takes its session while it is away; `#`, `$SYS/#` and `$share/...` subscriptions deliver
nothing foreign; a will on `P/status` is dropped; an empty retained publish clears
nothing; plain TCP, TLS below 1.2 and a packet over `max_packet_size` are refused. A
standby node follows `P/status` as `gpubroker-standby` without touching the leader's
session, and ``broker.client`` works with its client id replaced.

"Never arrives" is proved without sleeping: after the message that must not arrive, a
sentinel that must arrive is sent to the same subscriber; mosquitto queues a QoS 1 message
to its subscribers before it acknowledges the publish, and delivers each subscriber's
queue in order, so once the sentinel is in, the forbidden message would be in too.
"""

from __future__ import annotations

import asyncio
import gc
import os
import pwd
import re
import secrets
import shutil
import signal
import ssl
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiomqtt
import pytest
from daemon_helpers import daemon_config
from mqtt_helpers import Mosquitto, MqttProbe, Payload, find_mosquitto, payload_json
from mqtt_helpers import publish_properties as props
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from tls_helpers import Pki, make_pki

from broker.daemon.assembly import Daemon
from broker.daemon.config import StateConfig
from broker.wire.messages import Topics
from gpubroker_client import BrokerClient

P = "gpubroker/v1"
DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "mosquitto"
USERS = ("gpubroker", "gpubroker-standby", "ops", "sched-a", "sched-b")
DAEMON_ID = "gpubroker-lab-1"  # the daemon's client id as the config derives it: gpubroker-<site>
PASSWD_HINT = "mosquitto_passwd ships with Debian's mosquitto package (apt-get install mosquitto)"

pytestmark = pytest.mark.timeout(30)


# --- the server ------------------------------------------------------------------------


def find_mosquitto_passwd() -> str | None:
    for candidate in ("/usr/bin/mosquitto_passwd",):
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("mosquitto_passwd")


class DeployMosquitto(Mosquitto):
    """mosquitto running deploy/mosquitto/mosquitto.conf, its paths moved into workdir."""

    def __init__(self, workdir: Path, pki: Pki, passwd: Path) -> None:
        super().__init__(workdir)
        self.paths = {
            "/etc/mosquitto/certs/ca.crt": pki.ca_cert,
            "/etc/mosquitto/certs/server.crt": pki.server_cert,
            "/etc/mosquitto/certs/server.key": pki.server_key,
            "/etc/mosquitto/passwd": passwd,
            "/etc/mosquitto/acl": DEPLOY / "acl",
            "/var/lib/mosquitto/": self.data_dir,
        }

    @property
    def url(self) -> str:  # what gpubroker's config says for this server
        return f"mqtts://{self.host}:{self.port}"

    def _write_config(self) -> None:
        text = (DEPLOY / "mosquitto.conf").read_text()
        text, listeners = re.subn(r"(?m)^listener 8883$", f"listener {self.port} {self.host}",
                                  text)
        assert listeners == 1, "deploy/mosquitto/mosquitto.conf: expected one `listener 8883`"
        for deployed, here in self.paths.items():
            value = f"{here}/" if deployed.endswith("/") else str(here)
            assert deployed in text, f"deploy/mosquitto/mosquitto.conf no longer names {deployed}"
            text = text.replace(deployed, value)
        settings = [line for line in text.splitlines() if line and not line.startswith("#")]
        left = [line for line in settings if "/etc/" in line or "/var/" in line]
        assert not left, f"paths the test does not know how to move: {left}"
        # As root, mosquitto would switch to the `mosquitto` user, who cannot read tmp_path.
        user = pwd.getpwuid(os.geteuid()).pw_name
        self.config_path.write_text(f"{text}\nuser {user}\n")


@pytest.fixture(scope="module")
def mqtt_secrets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Pki, Path, dict[str, str]]:
    """One CA, server certificate and password file for the whole module."""
    tool = find_mosquitto_passwd()
    if tool is None:
        pytest.fail(f"mosquitto_passwd is not installed: {PASSWD_HINT}", pytrace=False)
    base = tmp_path_factory.mktemp("mqtt-secrets")
    pki = make_pki(base / "certs")
    passwd = base / "passwd"
    passwords = {user: secrets.token_urlsafe(12) for user in USERS}
    for i, (user, password) in enumerate(passwords.items()):
        create = ["-c"] if i == 0 else []
        subprocess.run([tool, "-b", *create, str(passwd), user, password], check=True,
                       capture_output=True, timeout=10)
    passwd.chmod(0o600)
    return pki, passwd, passwords


@pytest.fixture
def server(tmp_path: Path, mqtt_secrets: tuple[Pki, Path, dict[str, str]]) -> Iterator[
        DeployMosquitto]:
    if find_mosquitto() is None:
        pytest.fail("mosquitto is not installed (apt-get install mosquitto)", pytrace=False)
    pki, passwd, _ = mqtt_secrets
    mosquitto = DeployMosquitto(tmp_path / "mosquitto", pki, passwd)
    mosquitto.start()
    try:
        yield mosquitto
    finally:
        mosquitto.stop()


# --- clients -----------------------------------------------------------------------------


class Client(MqttProbe):
    """An MqttProbe that logs in with a username and password over TLS; `client_id`
    (default: unique), `persistent` (a session kept for an hour) and `will` as asked."""

    def __init__(self, server: Mosquitto, username: str | None, password: str | None,
                 topics: tuple[str, ...] = (), *, tls: ssl.SSLContext | None,
                 client_id: str | None = None, will: aiomqtt.Will | None = None,
                 **kwargs: Any) -> None:
        super().__init__(f"mqtt://{server.host}:{server.port}", topics,
                         client_id=client_id or f"{username}-{uuid.uuid4().hex[:8]}",
                         **kwargs)
        self.username, self.password, self.tls, self.will = username, password, tls, will

    def _new_client(self) -> aiomqtt.Client:
        session: dict[str, Any] = {}
        if self.protocol == aiomqtt.ProtocolVersion.V5:
            session["clean_start"] = not self.persistent
            if self.persistent:
                connect = Properties(PacketTypes.CONNECT)
                connect.SessionExpiryInterval = 3600
                session["properties"] = connect
        else:
            session["clean_session"] = not self.persistent
        return aiomqtt.Client(self.host, self.port, identifier=self.client_id,
                              protocol=self.protocol, timeout=self.timeout,
                              username=self.username, password=self.password,
                              tls_context=self.tls, will=self.will, **session)

    async def subscribe(self, topic: str) -> None:
        """Subscribe one more filter (mosquitto may grant it: delivery is what it checks)."""
        await self.client.subscribe(topic, qos=1)


@pytest.fixture
async def login(server: DeployMosquitto, mqtt_secrets: tuple[Pki, Path, dict[str, str]]
                ) -> AsyncIterator[Any]:
    """``await login("sched-a", topics..., protocol=5)`` → a connected ``Client``."""
    pki, _, passwords = mqtt_secrets
    async with AsyncExitStack() as stack:

        async def make(user: str, *topics: str, **kwargs: Any) -> Client:
            client = Client(server, user, passwords[user], topics, tls=pki.client_context(),
                            **kwargs)
            return await stack.enter_async_context(client)

        yield make


def sched_b_or_ops(client: MqttProbe) -> list[str]:
    return [t for t in client.topics_seen() if "/sched-b/" in t or "/_ops/" in t]


PROTOCOLS = [pytest.param(5, id="mqtt5"), pytest.param("3.1.1", id="mqtt311")]


# --- the ACL -----------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_scheduler_places_only_as_itself(login: Any, protocol: int | str) -> None:
    # The daemon's own subscription, as bus.py makes it.
    daemon = await login("gpubroker", Topics(P).requests, protocol=protocol)
    a = await login("sched-a", protocol=protocol)

    await a.publish(f"{P}/requests/sched-a/place", {"request_id": "r1"})
    got = await daemon.wait_for(f"{P}/requests/sched-a/place")
    assert payload_json(got) == {"request_id": "r1"}

    mark = daemon.mark()
    for verb in ("place", "renew", "release", "report"):
        await a.publish(f"{P}/requests/sched-b/{verb}", {"request_id": "forged"})
    await a.publish(f"{P}/requests/sched-a/place", {"request_id": "sentinel"})
    await daemon.wait_for(lambda m: payload_json(m) == {"request_id": "sentinel"}, since=mark)
    assert [t for t in daemon.topics_seen() if "sched-b" in t] == []


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_scheduler_reads_only_its_own_events_leases_and_replies(
        login: Any, protocol: int | str) -> None:
    daemon = await login("gpubroker")
    # Retained before A subscribes: status, capacity and both schedulers' leases.
    await daemon.publish(f"{P}/status", {"state": "online"}, retain=True)
    await daemon.publish(f"{P}/capacity/aws/us-east-1/H100-80GB", {"n": 1}, retain=True)
    await daemon.publish(f"{P}/leases/sched-a/L-a", {"lease_id": "L-a"}, retain=True)
    await daemon.publish(f"{P}/leases/sched-b/L-b", {"lease_id": "L-b"}, retain=True)

    b = await login("sched-b", f"{P}/events/sched-b/#", f"{P}/replies/sched-b/#",
                    protocol=protocol)
    a = await login("sched-a", f"{P}/events/sched-a/#", f"{P}/leases/sched-a/#",
                    f"{P}/replies/sched-a/#", f"{P}/capacity/#", f"{P}/status",
                    protocol=protocol)
    # A's share of the retained state is there...
    for topic in (f"{P}/status", f"{P}/capacity/aws/us-east-1/H100-80GB",
                  f"{P}/leases/sched-a/L-a"):
        await a.wait_for(topic)
    # ...and asking for more gets nothing more: mosquitto 2.0 grants these subscriptions
    # but checks every message against the read ACL before delivering it.
    for topic in (f"{P}/events/sched-b/#", f"{P}/leases/sched-b/#", f"{P}/events/_ops/#",
                  f"{P}/#"):
        await a.subscribe(topic)

    await daemon.publish(f"{P}/events/sched-b/placement.decided", {"for": "b"})
    await daemon.publish(f"{P}/replies/sched-b/r1", {"for": "b"})
    await daemon.publish(f"{P}/leases/sched-b/L-b2", {"for": "b"}, retain=True)
    await daemon.publish(f"{P}/events/_ops/policy.applied", {"for": "ops"})
    await daemon.publish(f"{P}/events/sched-a/placement.decided", {"for": "a"})
    await daemon.publish(f"{P}/replies/sched-a/r1", {"for": "a"})

    await b.wait_for(f"{P}/events/sched-b/placement.decided")  # it was published
    await b.wait_for(f"{P}/replies/sched-b/r1")
    await a.wait_for(f"{P}/events/sched-a/placement.decided")
    await a.wait_for(f"{P}/replies/sched-a/r1")  # the sentinel: published last
    assert sched_b_or_ops(a) == []


async def test_schedulers_cannot_write_the_daemons_topics(login: Any) -> None:
    b = await login("sched-b", f"{P}/events/sched-b/#", f"{P}/leases/sched-b/#",
                    f"{P}/replies/sched-b/#", f"{P}/capacity/#", f"{P}/status")
    a = await login("sched-a")
    daemon = await login("gpubroker")
    # Forged events, lease states, replies, capacity and an `offline` status: each one
    # acknowledged (QoS 1) and dropped.
    for topic in (f"{P}/events/sched-b/lease.failover", f"{P}/leases/sched-b/L-b",
                  f"{P}/replies/sched-b/r1", f"{P}/capacity/aws/us-east-1/H100-80GB",
                  f"{P}/status"):
        await a.publish(topic, {"forged": True})
        await a.publish(topic, {"forged": True}, retain=True)
    await daemon.publish(f"{P}/events/sched-b/sentinel", {"sentinel": True})
    await b.wait_for(f"{P}/events/sched-b/sentinel")
    assert [t for t in b.topics_seen() if not t.endswith("/sentinel")] == []


async def test_a_denied_publish_is_still_acknowledged(login: Any) -> None:
    # The daemon's outbox deletes a row once its publish is acknowledged: a topic the ACL
    # denies it (say a ResponseTopic outside gpubroker/v1/replies/S/) must not stall it.
    daemon = await login("gpubroker", protocol=5)
    async with asyncio.timeout(5):
        await daemon.publish("elsewhere/reply", {"x": 1})
        await daemon.publish(f"{P}/requests/sched-a/place", {"x": 1})


async def test_ops_reads_ops_events_and_all_leases_but_cannot_place(login: Any) -> None:
    daemon = await login("gpubroker", f"{P}/requests/#")
    ops = await login("ops", f"{P}/events/_ops/#", f"{P}/leases/#", f"{P}/status")
    a = await login("sched-a")

    await daemon.publish(f"{P}/events/sched-a/placement.decided", {"private": "a"})
    await daemon.publish(f"{P}/status", {"state": "online"}, retain=True)
    await daemon.publish(f"{P}/leases/sched-a/L-a", {"lease_id": "L-a"}, retain=True)
    await daemon.publish(f"{P}/events/_ops/policy.applied", {"hash": "sha256:x"})
    await ops.wait_for(f"{P}/leases/sched-a/L-a")
    await ops.wait_for(f"{P}/status")
    await ops.wait_for(f"{P}/events/_ops/policy.applied")  # published last
    assert not ops.matching(f"{P}/events/sched-a/#")

    mark = daemon.mark()
    await ops.publish(f"{P}/requests/ops/place", {"request_id": "by-ops"})
    await a.publish(f"{P}/requests/sched-a/place", {"request_id": "sentinel"})
    await daemon.wait_for(f"{P}/requests/sched-a/place", since=mark)
    assert not daemon.matching(f"{P}/requests/ops/#", since=mark)


# --- client ids are bound to user names (#26) ---------------------------------------------
# mosquitto.conf sets use_username_as_clientid: whatever client id a client asks for, the
# server uses its username. The daemon's session (client id `gpubroker-<site>` as asked,
# `gpubroker` as kept) can then be continued or ended by the daemon's user only.


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_scheduler_with_the_daemons_client_id_does_not_end_its_connection(
        server: DeployMosquitto, login: Any, protocol: int | str) -> None:
    daemon = await login("gpubroker", Topics(P).requests, client_id=DAEMON_ID,
                         persistent=True, protocol=protocol)
    # Accepted — as itself. On a server that does not bind ids, the daemon's connection
    # was closed before this one's CONNACK ("already connected, closing old connection").
    await login("sched-a", client_id=DAEMON_ID, persistent=True, protocol=protocol)
    await login("sched-a", client_id=DAEMON_ID, protocol=protocol)  # and a clean start

    b = await login("sched-b", protocol=protocol)
    await b.publish(f"{P}/requests/sched-b/place", {"request_id": "after"})
    await daemon.wait_for(f"{P}/requests/sched-b/place")
    assert daemon.connected and daemon.disconnect_error is None
    assert "Client gpubroker already connected" not in server.log_text()


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_scheduler_cannot_take_the_daemons_session_while_it_is_away(
        login: Any, protocol: int | str) -> None:
    # The daemon is away (a restart, a takeover): requests wait in its session.
    daemon = await login("gpubroker", Topics(P).requests, client_id=DAEMON_ID,
                         persistent=True, protocol=protocol)
    await daemon.close()
    a = await login("sched-a", protocol=protocol)
    await a.publish(f"{P}/requests/sched-a/place", {"request_id": "queued"})
    # Another scheduler continues "the daemon's" session, then leaves it.
    intruder = await login("sched-b", client_id=DAEMON_ID, persistent=True,
                           protocol=protocol)
    await intruder.close()
    await daemon.connect()
    got = await daemon.wait_for(f"{P}/requests/sched-a/place")
    assert payload_json(got) == {"request_id": "queued"}
    assert intruder.messages == []


async def test_the_standby_user_reads_the_status_only(login: Any) -> None:
    # A standby node's P/status watcher has a user of its own (mqtt.standby_username):
    # as `gpubroker` it would now be the leader's client id, and take its session.
    daemon = await login("gpubroker", Topics(P).requests, client_id=DAEMON_ID,
                         persistent=True)
    await daemon.publish(f"{P}/leases/sched-a/L-a", {"lease_id": "L-a"}, retain=True)
    await daemon.publish(f"{P}/status", {"state": "online"}, retain=True)
    standby = await login("gpubroker-standby", "#", client_id=f"{DAEMON_ID}-standby-broker-b")
    await standby.wait_for(f"{P}/status")
    await standby.publish(f"{P}/requests/gpubroker-standby/place", {"request_id": "s"})
    await standby.publish(f"{P}/status", {"state": "offline"}, retain=True)
    a = await login("sched-a")
    await a.publish(f"{P}/requests/sched-a/place", {"request_id": "sentinel"})
    await daemon.wait_for(f"{P}/requests/sched-a/place")
    assert daemon.topics_seen() == [f"{P}/requests/sched-a/place"]
    await daemon.publish(f"{P}/events/sched-a/x", {"for": "a"})
    await daemon.publish(f"{P}/status", {"state": "online", "n": 2}, retain=True)
    await standby.wait_for(lambda m: payload_json(m) == {"state": "online", "n": 2})
    assert standby.topics_seen() == [f"{P}/status"] * 2
    assert daemon.connected


# --- what a scheduler may try ---------------------------------------------------------------


def foreign(client: MqttProbe, me: str) -> list[str]:
    """Topics received that are neither `me`'s own nor public (capacity, status)."""
    return [t for t in client.topics_seen()
            if f"/{me}/" not in t and not t.startswith(f"{P}/capacity/") and t != f"{P}/status"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_wildcard_sys_and_shared_subscriptions_deliver_nothing_foreign(
        login: Any, protocol: int | str) -> None:
    daemon = await login("gpubroker", Topics(P).requests)
    await daemon.publish(f"{P}/leases/sched-b/L-b", {"lease_id": "L-b"}, retain=True)
    b = await login("sched-b", f"{P}/events/sched-b/#", f"{P}/replies/sched-b/#")
    a = await login("sched-a", "#", "$SYS/#", "$share/g/#", f"$share/g/{P}/#",
                    f"$share/g/{P}/requests/#", f"$share/g/{P}/events/sched-b/#",
                    f"$share/g/{P}/leases/+/+", "$share/g/$SYS/#", protocol=protocol)

    await b.publish(f"{P}/requests/sched-b/place", {"request_id": "b1"})
    await daemon.wait_for(f"{P}/requests/sched-b/place")
    await daemon.publish(f"{P}/events/sched-b/placement.decided", {"for": "b"})
    await daemon.publish(f"{P}/leases/sched-b/L-b2", {"for": "b"}, retain=True)
    await daemon.publish(f"{P}/events/_ops/policy.applied", {"for": "ops"})
    await daemon.publish(f"{P}/replies/sched-b/r1", {"for": "b"})
    await b.wait_for(f"{P}/replies/sched-b/r1")  # all of it was published
    await daemon.publish(f"{P}/events/sched-a/placement.decided", {"for": "a"})
    await a.wait_for(f"{P}/events/sched-a/placement.decided")  # the sentinel
    assert foreign(a, "sched-a") == []


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_schedulers_will_on_the_status_is_dropped(
        login: Any, protocol: int | str) -> None:
    daemon = await login("gpubroker", Topics(P).requests)
    ops = await login("ops", f"{P}/status")
    # The control: a will on a topic the scheduler may write is published when the
    # connection ends without DISCONNECT (here: taken over by a second connection).
    b = await login("sched-b", client_id="b-will", protocol=protocol, will=aiomqtt.Will(
        f"{P}/requests/sched-b/report", b'{"request_id": "will"}', qos=1))
    await login("sched-b", client_id="b-will", protocol=protocol)
    await b.wait_disconnected()
    await daemon.wait_for(f"{P}/requests/sched-b/report")
    # A forged `offline` for every status subscriber, retained.
    a = await login("sched-a", client_id="a-will", protocol=protocol, will=aiomqtt.Will(
        f"{P}/status", b'{"state": "offline", "forged": true}', qos=1, retain=True))
    await login("sched-a", client_id="a-will", protocol=protocol)
    await a.wait_disconnected()
    await daemon.publish(f"{P}/status", {"state": "online"}, retain=True)
    await ops.wait_for(f"{P}/status")
    assert [payload_json(m) for m in ops.messages] == [{"state": "online"}]


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_an_empty_retained_publish_cannot_clear_retained_state(
        login: Any, protocol: int | str) -> None:
    daemon = await login("gpubroker")
    retained: dict[str, Payload] = {
        f"{P}/leases/sched-b/L-b": {"lease_id": "L-b"},
        f"{P}/leases/sched-a/L-a": {"lease_id": "L-a"},  # not even its own
        f"{P}/capacity/aws/us-east-1/H100-80GB": {"n": 1},
        f"{P}/status": {"state": "online"},
    }
    for topic, body in retained.items():
        await daemon.publish(topic, body, retain=True)
    a = await login("sched-a", protocol=protocol)
    for topic in retained:
        await a.publish(topic, b"", retain=True)  # acknowledged, and dropped
    ops = await login("ops", f"{P}/leases/#", f"{P}/status")
    b = await login("sched-b", f"{P}/capacity/#")
    for topic, body in retained.items():
        got = await (b if "/capacity/" in topic else ops).wait_for(topic)
        assert payload_json(got) == body


# --- authentication and TLS ------------------------------------------------------------


async def _connect(server: Mosquitto, user: str | None, password: str | None,
                   tls: ssl.SSLContext | None) -> None:
    async with Client(server, user, password, tls=tls):
        pass


async def test_anonymous_and_wrong_passwords_are_refused(
        server: DeployMosquitto, mqtt_secrets: tuple[Pki, Path, dict[str, str]]) -> None:
    pki, _, passwords = mqtt_secrets
    await _connect(server, "sched-a", passwords["sched-a"], pki.client_context())  # control
    for user, password in ((None, None), ("sched-a", "wrong"), ("sched-a", None),
                           ("sched-c", passwords["sched-a"])):
        with pytest.raises(aiomqtt.MqttError, match=r"(?i)not authori[sz]ed|bad user name"):
            await _connect(server, user, password, pki.client_context())


async def test_adding_and_removing_a_scheduler_is_passwd_plus_reload(
        tmp_path: Path, mqtt_secrets: tuple[Pki, Path, dict[str, str]]) -> None:
    # deploy/INSTALL.md: the ACL patterns already cover a new scheduler; only
    # mosquitto_passwd and a reload (SIGHUP) are needed, and removal disconnects it.
    pki, shared, passwords = mqtt_secrets
    passwd = tmp_path / "passwd"
    shutil.copy(shared, passwd)
    server = DeployMosquitto(tmp_path / "mosquitto", pki, passwd)
    server.start()
    tool = find_mosquitto_passwd()
    assert tool is not None
    try:
        new = ("sched-new", secrets.token_urlsafe(12))
        with pytest.raises(aiomqtt.MqttError, match=r"(?i)not authori[sz]ed"):
            await _connect(server, *new, pki.client_context())
        await asyncio.to_thread(subprocess.run, [tool, "-b", str(passwd), *new], check=True,
                                timeout=10)
        await asyncio.to_thread(reload, server)

        async with Client(server, "gpubroker", passwords["gpubroker"],
                          (Topics(P).requests,), tls=pki.client_context()) as daemon, \
                Client(server, *new, tls=pki.client_context()) as scheduler:
            await scheduler.publish(f"{P}/requests/sched-new/place", {"request_id": "r1"})
            await daemon.wait_for(f"{P}/requests/sched-new/place")

            await asyncio.to_thread(subprocess.run, [tool, "-D", str(passwd), new[0]],
                                    check=True, timeout=10)
            await asyncio.to_thread(reload, server)
            assert await scheduler.wait_disconnected() is not None
    finally:
        server.stop()


def reload(server: Mosquitto, timeout: float = 5.0) -> None:
    """``systemctl reload mosquitto``: SIGHUP, then wait for the log line that says the
    password and ACL files were read again (mosquitto announces it nowhere else)."""
    before = server.log_text().count("Reloading config")
    assert server.pid is not None
    os.kill(server.pid, signal.SIGHUP)
    deadline = time.monotonic() + timeout
    while server.log_text().count("Reloading config") == before:
        assert time.monotonic() < deadline, f"no reload within {timeout}s\n{server.log_tail()}"
        time.sleep(0.01)


# paho leaves the socket of a failed TLS handshake to the garbage collector.
@pytest.mark.filterwarnings("ignore::ResourceWarning")
async def test_tls_needs_a_client_that_trusts_the_ca(
        server: DeployMosquitto, mqtt_secrets: tuple[Pki, Path, dict[str, str]]) -> None:
    pki, _, passwords = mqtt_secrets
    await _connect(server, "sched-a", passwords["sched-a"], pki.client_context())  # control
    # TLS 1.2 is the floor, not the ceiling: a client that stops at 1.2 still gets in.
    tls12 = pki.client_context()
    tls12.maximum_version = ssl.TLSVersion.TLSv1_2
    await _connect(server, "sched-a", passwords["sched-a"], tls12)
    # The system's CAs do not know our CA: the handshake fails on the client's side.
    with pytest.raises((aiomqtt.MqttError, ssl.SSLError)) as failed:
        await _connect(server, "sched-a", passwords["sched-a"], ssl.create_default_context())
    assert "CERTIFICATE_VERIFY_FAILED" in str(failed.value)
    del failed
    gc.collect()  # finalise that socket now, while ResourceWarning is ignored


def mqtt311_connect(client_id: str, username: str, password: str) -> bytes:
    """An MQTT 3.1.1 CONNECT packet (clean session, keepalive 60) with a login."""
    def field(text: str) -> bytes:
        data = text.encode()
        return len(data).to_bytes(2, "big") + data
    body = (field("MQTT") + bytes([4, 0b1100_0010]) + (60).to_bytes(2, "big")
            + field(client_id) + field(username) + field(password))
    assert len(body) < 128  # a one-byte remaining length
    return bytes([0x10, len(body)]) + body


async def test_plain_tcp_is_refused(
        server: DeployMosquitto, mqtt_secrets: tuple[Pki, Path, dict[str, str]]) -> None:
    # A valid CONNECT in the clear: a plain listener would answer CONNACK (0x20) and keep
    # the connection; this one closes it, having answered no MQTT at all.
    _, _, passwords = mqtt_secrets
    reader, writer = await asyncio.open_connection(server.host, server.port)
    try:
        writer.write(mqtt311_connect("sched-a-plain", "sched-a", passwords["sched-a"]))
        await writer.drain()
        try:
            async with asyncio.timeout(5):
                answer = await reader.read(4)  # b"" once the server closes
        except ConnectionResetError:
            answer = b""
    finally:
        writer.close()
    assert not answer.startswith(b"\x20"), f"a CONNACK over plain TCP: {answer!r}"
    assert "wrong version number" in server.log_text()


# paho leaves the socket of a failed TLS handshake to the garbage collector.
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore:ssl.TLSVersion.TLSv1:DeprecationWarning")
async def test_tls_below_1_2_is_refused(
        server: DeployMosquitto, mqtt_secrets: tuple[Pki, Path, dict[str, str]]) -> None:
    pki, _, passwords = mqtt_secrets
    for version in (ssl.TLSVersion.TLSv1, ssl.TLSVersion.TLSv1_1):
        old = pki.client_context()
        # Let this client offer the old version: at OpenSSL's default security level it
        # would give up by itself, and the server would never be asked.
        old.set_ciphers("DEFAULT:@SECLEVEL=0")
        old.minimum_version = old.maximum_version = version
        with pytest.raises((aiomqtt.MqttError, ssl.SSLError)) as failed:
            await _connect(server, "sched-a", passwords["sched-a"], old)
        # The server's answer (an alert), not the client's own refusal.
        assert "TLSV1_ALERT_PROTOCOL_VERSION" in str(failed.value), version
        del failed
    gc.collect()  # finalise those sockets now, while ResourceWarning is ignored


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_publish_over_the_max_packet_size_ends_the_connection(
        login: Any, protocol: int | str) -> None:
    daemon = await login("gpubroker", Topics(P).requests)
    a = await login("sched-a", protocol=protocol)
    await a.publish(f"{P}/requests/sched-a/place", {"request_id": "fits", "x": "x" * 120_000})
    await daemon.wait_for(f"{P}/requests/sched-a/place")
    # The server hangs up, perhaps before the client has written it all: what the publish
    # itself says (a timeout, an error) does not matter, the disconnect does.
    too_large = asyncio.create_task(a.publish(
        f"{P}/requests/sched-a/place", {"request_id": "too-large", "x": "x" * 140_000}))
    assert await a.wait_disconnected() is not None
    too_large.cancel()
    await asyncio.wait({too_large})
    if not too_large.cancelled():
        too_large.exception()  # retrieved: whatever it was, it is not the point here
    b = await login("sched-b", protocol=protocol)
    await b.publish(f"{P}/requests/sched-b/place", {"request_id": "sentinel"})
    await daemon.wait_for(f"{P}/requests/sched-b/place")
    assert [payload_json(m)["request_id"] for m in daemon.messages] == ["fits", "sentinel"]


# --- the daemon itself behind this server --------------------------------------------------


@pytest.fixture
async def daemon(server: DeployMosquitto, tmp_path: Path,
                 mqtt_secrets: tuple[Pki, Path, dict[str, str]]) -> AsyncIterator[Daemon]:
    """The real daemon, as deploy/ configures it: mqtts://, user gpubroker, a password
    file (as LoadCredential= provides it) and the CA file; and the standby user that
    nodes of a high-availability site follow P/status as."""
    pki, _, passwords = mqtt_secrets
    password_file = tmp_path / "credentials" / "mqtt"
    password_file.parent.mkdir()
    password_file.write_text(passwords["gpubroker"] + "\n")
    standby_file = password_file.parent / "mqtt-standby"
    standby_file.write_text(passwords["gpubroker-standby"] + "\n")
    cfg = daemon_config(server, tmp_path / "state.db", username="gpubroker",
                        password_file=password_file, ca_file=pki.ca_cert,
                        standby_username="gpubroker-standby",
                        standby_password_file=standby_file)
    assert cfg.mqtt.tls
    d = Daemon(cfg)
    stop = asyncio.Event()
    task = asyncio.create_task(d.run(stop))
    ready = asyncio.create_task(d.ready.wait())
    done, _ = await asyncio.wait({ready, task}, timeout=15, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        ready.cancel()
        task.result()
    assert ready in done, "daemon did not become ready within 15 s"
    try:
        yield d
    finally:
        stop.set()
        async with asyncio.timeout(15):
            await task


def place(request_id: str) -> Payload:
    return {"request_id": request_id, "gpu": ["A100-80GB", "H100-80GB"], "gpus": 8}


def request_id(message: aiomqtt.Message) -> str | None:
    """The request id of an event (None for anything else)."""
    body = payload_json(message)
    data = body.get("data") if isinstance(body, dict) else None
    return data.get("request_id") if isinstance(data, dict) else None


async def test_the_daemon_works_behind_the_deploy_config(daemon: Daemon, login: Any) -> None:
    a = await login("sched-a", f"{P}/events/sched-a/#", f"{P}/leases/sched-a/#",
                    f"{P}/replies/sched-a/#", f"{P}/capacity/#", f"{P}/status")
    status = await a.wait_for(f"{P}/status")
    assert payload_json(status)["state"] == "online"
    await a.wait_for(f"{P}/capacity/#")

    await a.publish(f"{P}/requests/sched-a/place", place("job-1"),
                    properties=props(ResponseTopic=f"{P}/replies/sched-a/job-1",
                                     CorrelationData=b"c1"))
    event = payload_json(await a.wait_for(f"{P}/events/sched-a/placement.decided"))
    assert event["data"]["request_id"] == "job-1"
    lease = payload_json(await a.wait_for(f"{P}/leases/sched-a/{event['data']['lease_id']}"))
    assert lease["lease_id"] == event["data"]["lease_id"]
    reply = await a.wait_for(f"{P}/replies/sched-a/job-1")
    assert payload_json(reply)["id"] == event["id"]


async def test_a_scheduler_cannot_aim_replies_at_another(daemon: Daemon, login: Any) -> None:
    b = await login("sched-b", f"{P}/events/sched-b/#", f"{P}/leases/sched-b/#")
    a = await login("sched-a", f"{P}/events/sched-a/#")
    for i, target in enumerate((f"{P}/events/sched-b/placement.decided",
                                f"{P}/leases/sched-b/L-forged")):
        await a.publish(f"{P}/requests/sched-a/place", place(f"aimed-{i}"),
                        properties=props(ResponseTopic=target, CorrelationData=b"x"))
        await a.wait_for(lambda m, i=i: request_id(m) == f"aimed-{i}")
    # Sentinel: a lease of B's own, decided after the aimed replies.
    await b.publish(f"{P}/requests/sched-b/place", place("b-own"))
    await b.wait_for(lambda m: request_id(m) == "b-own")
    assert [request_id(m) for m in b.matching(f"{P}/events/sched-b/#")] == ["b-own"]
    assert [t for t in b.topics_seen() if t.endswith("/L-forged")] == []


async def test_the_scheduler_client_works_with_its_id_replaced(
        daemon: Daemon, server: DeployMosquitto,
        mqtt_secrets: tuple[Pki, Path, dict[str, str]]) -> None:
    # broker.client asks for a random client id; this server uses the username instead.
    pki, _, passwords = mqtt_secrets
    async with BrokerClient(server.url, scheduler="sched-a", username="sched-a",
                            password=passwords["sched-a"], ca_file=pki.ca_cert,
                            protocol="5") as client:
        lease = await client.place(["A100-80GB", "H100-80GB"], 8, request_id="via-client",
                                   timeout=15)
        assert lease.request_id == "via-client" and lease.scheduler == "sched-a"
        await lease.release()
    log = server.log_text()
    assert f" as {client.client_id} " not in log and " as sched-a (" in log


# --- a standby node next to the leader (high availability) ---------------------------------


def standby_of(leader: Daemon, state: Path, **mqtt: Any) -> Daemon:
    """A second node of the leader's site: its configuration but for `node` and `state`
    (a standby never opens its store to follow P/status), and `mqtt` changes."""
    cfg = leader.cfg.model_copy(update={
        "node": "broker-b", "state": StateConfig(path=state),
        "mqtt": leader.cfg.mqtt.model_copy(update=mqtt)})
    return Daemon(cfg)


async def stop_watching(task: asyncio.Task[None]) -> None:
    while not task.done():  # cancelled again if aiomqtt swallowed it (CPython gh-86296)
        task.cancel()
        await asyncio.wait({task}, timeout=0.5)


async def test_a_standby_follows_the_status_as_its_own_user(
        daemon: Daemon, server: DeployMosquitto, tmp_path: Path, login: Any) -> None:
    # What a standby node runs while the leader serves (broker/daemon/assembly.py _standby_bus).
    # As the daemon's user its connection would be the leader's client id here, ending
    # the leader's connection and discarding the site's session.
    standby = standby_of(daemon, tmp_path / "standby.db")
    watch = asyncio.create_task(standby._standby_bus())
    try:
        deadline = time.monotonic() + 10
        while standby.leader_status is None:
            assert not watch.done(), watch
            assert time.monotonic() < deadline, f"no P/status\n{server.log_tail()}"
            await asyncio.sleep(0.01)
        assert standby.leader_status["state"] == "online" and standby.standby_mqtt
        assert " as gpubroker-standby (" in server.log_text()
        # The leader still serves, on the connection it had.
        a = await login("sched-a", f"{P}/events/sched-a/#")
        await a.publish(f"{P}/requests/sched-a/place", place("after-standby"))
        await a.wait_for(lambda m: request_id(m) == "after-standby")
        assert "Client gpubroker already connected" not in server.log_text()
    finally:
        await stop_watching(watch)


async def test_without_a_standby_user_a_standby_does_not_log_in_as_the_daemon(
        daemon: Daemon, server: DeployMosquitto, tmp_path: Path) -> None:
    standby = standby_of(daemon, tmp_path / "standby.db", standby_username=None,
                         standby_password_file=None)
    async with asyncio.timeout(5):
        await standby._standby_bus()  # returns: nothing to follow P/status as
    assert not standby.standby_mqtt and standby.leader_status is None
    assert "Client gpubroker already connected" not in server.log_text()
