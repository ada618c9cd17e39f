"""`mqtt.standby_username` / `mqtt.standby_password_file` (#26): the login a standby node
of a high-availability site follows `P/status` with, never the daemon's own — where the
MQTT server makes client ids of usernames (deploy/mosquitto), the daemon's login is the
leader's session."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from broker.daemon.config import Config, SourceError, parse_config


def cfg(text: str) -> Config:
    return parse_config(textwrap.dedent(text), "gpubroker.yaml")


def problems(text: str) -> list[tuple[int | None, str, str]]:
    with pytest.raises(SourceError) as info:
        cfg(text)
    return [(p.line, p.key, p.message) for p in info.value.problems]


def test_a_standby_user_logs_in_as_itself_with_the_rest_of_the_settings() -> None:
    c = cfg("""
        mqtt:
          url: mqtts://mqtt.example.com:8883
          topic_prefix: site/v1
          username: gpubroker
          password_file: /run/credentials/gpubroker.service/mqtt
          ca_file: /etc/gpubroker/ca.pem
          standby_username: gpubroker-standby
          standby_password_file: /run/credentials/gpubroker.service/mqtt-standby
    """)
    standby = c.mqtt.standby()
    assert standby is not None
    assert standby.username == "gpubroker-standby"
    assert standby.password_file == Path("/run/credentials/gpubroker.service/mqtt-standby")
    assert (standby.url, standby.topic_prefix, standby.ca_file, standby.protocol) == (
        c.mqtt.url, c.mqtt.topic_prefix, c.mqtt.ca_file, c.mqtt.protocol)
    # The daemon's own settings are untouched.
    assert (c.mqtt.username, c.mqtt.password_file) == (
        "gpubroker", Path("/run/credentials/gpubroker.service/mqtt"))


def test_a_server_without_logins_is_followed_with_the_daemons_settings() -> None:
    # No username: the server cannot bind client ids to usernames, nothing to take.
    c = cfg("mqtt: {url: mqtt://127.0.0.1:1883}\n")
    assert c.mqtt.standby() == c.mqtt


def test_a_login_without_a_standby_user_is_not_used_by_a_standby() -> None:
    c = cfg("mqtt: {username: gpubroker, password_file: /run/x/mqtt}\n")
    assert c.mqtt.standby() is None


def test_a_standby_password_needs_a_standby_user() -> None:
    [(line, key, message)] = problems("""
        mqtt:
          username: gpubroker
          standby_password_file: /run/x/mqtt-standby
    """)
    assert (line, key) == (4, "mqtt.standby_password_file")
    assert "standby_username" in message


def test_the_standby_user_may_not_be_the_daemons() -> None:
    [(line, key, message)] = problems("""
        mqtt:
          username: gpubroker
          standby_username: gpubroker
    """)
    assert (line, key) == (4, "mqtt.standby_username")
    assert "leader" in message


def test_an_empty_standby_user_is_refused() -> None:
    [(_, key, _)] = problems("mqtt: {standby_username: ''}\n")
    assert key == "mqtt.standby_username"
