"""Tests of the daemon configuration (`broker/daemon/config.py`)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any, get_args

import pytest

from broker.daemon.config import Config, SourceError, load_config, parse_config


def cfg(text: str) -> Config:
    return parse_config(textwrap.dedent(text), "gpubroker.yaml")


def problems(text: str) -> list[tuple[int | None, str, str]]:
    """(line, key, message) of each problem `text` has."""
    with pytest.raises(SourceError) as info:
        cfg(text)
    return [(p.line, p.key, p.message) for p in info.value.problems]


def one_problem(text: str) -> tuple[int | None, str, str]:
    [p] = problems(text)
    return p


# --- defaults ----------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "# only a comment\n", "---\n"])
def test_an_empty_file_means_every_default(text: str) -> None:
    c = cfg(text)
    assert c.site == "local"
    assert c.client_id == "gpubroker-local"
    assert c.state.path.name == "state.db"
    assert c.state.synchronous == "full"
    assert c.mqtt.url == "mqtt://127.0.0.1:1883"
    assert (c.mqtt.host, c.mqtt.port, c.mqtt.tls) == ("127.0.0.1", 1883, False)
    assert c.mqtt.topic_prefix == "gpubroker/v1"
    assert c.http.listen == "127.0.0.1:9464"
    assert c.policy_file is None
    assert (c.poll.interval_seconds, c.poll.stale_after_seconds) == (60, 300)
    assert c.clouds.configured() == ["sim"]


def test_state_path_defaults_to_systemds_state_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STATE_DIRECTORY", f"{tmp_path}/one:{tmp_path}/two")
    assert cfg("state: {}\n").state.path == tmp_path / "one" / "state.db"


def test_state_path_falls_back_to_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert cfg("state: {}\n").state.path == tmp_path / "gpubroker" / "state.db"


def test_the_spec_example_loads() -> None:
    c = cfg("""\
        site: lab-1
        state:
          path: /var/lib/gpubroker/state.db
        mqtt:
          url: mqtt://127.0.0.1:1883
          topic_prefix: gpubroker/v1
          client_id: gpubroker-lab-1
          username: gpubroker
          password_file: /run/credentials/gpubroker.service/mqtt
          ca_file: /etc/gpubroker/ca.pem
        http:
          listen: 127.0.0.1:9464
        policy_file: /etc/gpubroker/policy.yaml
        poll:
          interval_seconds: 60
          stale_after_seconds: 300
        clouds:
          aws:     {regions: [us-east-1, us-west-2], endpoint: null, interruption_queue_url: null}
          gcp:     {project: my-proj, regions: [us-central1], endpoint: null}
          azure:   {subscription_id: "x", regions: [eastus], endpoint: null}
          alibaba: {regions: [cn-hangzhou], endpoint: null}
    """)
    assert c.site == "lab-1"
    assert c.state.path == Path("/var/lib/gpubroker/state.db")
    assert c.mqtt.password_file == Path("/run/credentials/gpubroker.service/mqtt")
    assert c.policy_file == Path("/etc/gpubroker/policy.yaml")
    assert c.clouds.configured() == ["aws", "gcp", "azure", "alibaba"]
    assert c.clouds.aws is not None and c.clouds.aws.regions == ["us-east-1", "us-west-2"]
    assert c.clouds.gcp is not None and c.clouds.gcp.project == "my-proj"


def test_client_id_defaults_from_the_site() -> None:
    assert cfg("site: lab-7\n").client_id == "gpubroker-lab-7"
    assert cfg("site: lab-7\nmqtt: {client_id: mine}\n").client_id == "mine"


@pytest.mark.parametrize(("url", "host", "port", "tls"), [
    ("mqtt://broker.internal", "broker.internal", 1883, False),
    ("mqtts://broker.internal", "broker.internal", 8883, True),
    ("mqtt://10.0.0.5:1884", "10.0.0.5", 1884, False),
    ("mqtts://broker.internal:443", "broker.internal", 443, True),
    ("mqtt://[::1]:1883", "::1", 1883, False),
])
def test_mqtt_url_properties(url: str, host: str, port: int, tls: bool) -> None:
    m = cfg(f"mqtt:\n  url: '{url}'\n").mqtt
    assert (m.host, m.port, m.tls) == (host, port, tls)


# --- cloud sections ----------------------------------------------------------------------


def test_an_empty_cloud_section_means_its_defaults() -> None:
    c = cfg("clouds:\n  sim:\n")
    assert c.clouds.sim is not None
    assert c.clouds.sim.seed == 7
    assert c.clouds.sim.clouds == ["aws", "gcp", "azure", "alibaba"]
    c = cfg("clouds:\n  aws:\n")
    assert c.clouds.configured() == ["aws"]  # naming a real cloud replaces the default sim
    assert c.clouds.aws is not None
    assert (c.clouds.aws.regions, c.clouds.aws.endpoint, c.clouds.aws.anonymous) == (
        [], None, False)


def test_anonymous_with_an_endpoint_is_fine() -> None:
    c = cfg("clouds:\n  gcp: {endpoint: 'http://127.0.0.1:9000', anonymous: true}\n")
    assert c.clouds.gcp is not None and c.clouds.gcp.anonymous


def test_anonymous_without_endpoint_is_an_error() -> None:
    line, key, message = one_problem("""\
        clouds:
          aws:
            regions: [us-east-1]
            anonymous: true
    """)
    assert (line, key) == (2, "clouds.aws")
    assert "anonymous" in message and "endpoint" in message


def test_endpoint_must_be_http() -> None:
    line, key, message = one_problem("clouds:\n  aws:\n    endpoint: ftp://x\n")
    assert (line, key) == (3, "clouds.aws.endpoint")
    assert "http" in message


def test_azure_needs_its_subscription() -> None:
    line, key, message = one_problem("clouds:\n  azure:\n    regions: [eastus]\n")
    assert (line, key, message) == (2, "clouds.azure.subscription_id",
                                    "required key is missing")


def test_sim_may_not_simulate_a_configured_real_cloud() -> None:
    line, key, message = one_problem("""\
        site: x
        clouds:
          aws: {regions: [us-east-1]}
          sim: {}
    """)
    assert (line, key) == (2, "clouds")
    assert "aws" in message and "sim" in message


def test_sim_next_to_a_real_cloud_it_does_not_simulate() -> None:
    c = cfg("clouds:\n  aws: {regions: [us-east-1]}\n  sim: {clouds: [gcp, azure]}\n")
    assert c.clouds.configured() == ["aws", "sim"]


@pytest.mark.parametrize(("text", "line", "key"), [
    ("clouds:\n  aws:\n    regions: ['us east 1']\n", 3, "clouds.aws.regions[0]"),
    ("clouds:\n  aws:\n    regions: us-east-1\n", 3, "clouds.aws.regions"),
    ("clouds:\n  oracle: {}\n", 2, "clouds.oracle"),
    ("clouds:\n  gcp:\n    project_id: p\n", 3, "clouds.gcp.project_id"),
    ("clouds:\n  sim:\n    clouds: [ibm]\n", 3, "clouds.sim.clouds[0]"),
    ("clouds:\n  sim:\n    zones_per_region: 27\n", 3, "clouds.sim.zones_per_region"),
    ("clouds:\n  alibaba:\n    usd_per_cny: 0\n", 3, "clouds.alibaba.usd_per_cny"),
    ("clouds:\n  alibaba:\n    spot_duration: 2\n", 3, "clouds.alibaba.spot_duration"),
])
def test_cloud_section_errors_name_key_and_line(text: str, line: int, key: str) -> None:
    assert one_problem(text)[:2] == (line, key)


def test_alibaba_spot_duration_is_0_or_1_default_1() -> None:
    default = cfg("clouds:\n  alibaba: {regions: [cn-hangzhou]}\n").clouds.alibaba
    unprotected = cfg("clouds:\n  alibaba: {regions: [cn-hangzhou], spot_duration: 0}\n"
                      ).clouds.alibaba
    assert default is not None and default.spot_duration == 1
    assert unprotected is not None and unprotected.spot_duration == 0


# --- other sections ----------------------------------------------------------------------


@pytest.mark.parametrize(("text", "line", "key", "words"), [
    ("site: 'lab 1'\n", 1, "site", "pattern"),
    ("site: lab\nmqtt:\n  url: http://x\n", 3, "mqtt.url", "mqtt://"),
    ("mqtt:\n  url: mqtt://h:99999\n", 2, "mqtt.url", "port"),
    ("mqtt:\n  url: mqtt://u:secret@h\n", 2, "mqtt.url", "credentials"),
    ("mqtt:\n  topic_prefix: a/+/b\n", 2, "mqtt.topic_prefix", "wildcards"),
    ("mqtt:\n  topic_prefix: /a\n", 2, "mqtt.topic_prefix", "'/'"),
    ("mqtt:\n  protocol: '4'\n", 2, "mqtt.protocol", "3.1.1"),
    ("mqtt:\n  session_expiry_seconds: -1\n", 2, "mqtt.session_expiry_seconds", "0"),
    ("state:\n  synchronous: sometimes\n", 2, "state.synchronous", "full"),
    ("state:\n  keep_ended_hours: 0\n", 2, "state.keep_ended_hours", "0"),
    ("http:\n  listen: 9464\n", 2, "http.listen", "string"),
    ("http:\n  listen: localhost\n", 2, "http.listen", "HOST:PORT"),
    ("poll:\n  interval_seconds: 0\n", 2, "poll.interval_seconds", "greater than 0"),
    ("poll:\n  interval_seconds: fast\n", 2, "poll.interval_seconds", "number"),
    ("poll:\n  interval_seconds: 120\n  stale_after_seconds: 60\n", 1, "poll",
     "stale_after_seconds"),
    ("policy_file: [a, b]\n", 1, "policy_file", "path"),
])
def test_section_errors_name_key_and_line(text: str, line: int, key: str, words: str) -> None:
    got_line, got_key, message = one_problem(text)
    assert (got_line, got_key) == (line, key)
    assert words in message


def test_unknown_keys_are_errors_each_one_reported() -> None:
    got = problems("""\
        site: lab
        sitee: typo
        mqtt:
          url: mqtt://h
          passwrd: x
        pol:
          interval_seconds: 5
    """)
    assert sorted(got) == [
        (2, "sitee", "unknown key; did you mean 'site'?"),
        (5, "mqtt.passwrd", "unknown key; did you mean 'password_file'?"),
        (6, "pol", "unknown key; did you mean 'poll'?")]


def test_every_problem_is_reported_at_once() -> None:
    got = problems("site: 'a b'\nhttp: {listen: x}\nstate: {synchronous: no}\n")
    assert sorted(key for _, key, _ in got) == ["http.listen", "site", "state.synchronous"]


def test_problem_text_names_file_line_and_key() -> None:
    with pytest.raises(SourceError) as info:
        cfg("site: lab\nmqtt:\n  url: http://x\n")
    assert str(info.value).startswith("gpubroker.yaml:3:3: mqtt.url: must look like")


def test_duplicate_keys_are_errors() -> None:
    got = problems("site: a\nmqtt:\n  url: mqtt://h\n  url: mqtt://g\nsite: b\n")
    assert sorted(got) == [(4, "mqtt.url", "duplicate key"), (5, "site", "duplicate key")]


def test_invalid_yaml_reports_a_line() -> None:
    [(line, key, message)] = problems("site: lab\nmqtt:\n  url: [unclosed\nhttp: {}\n")
    assert line is not None and line >= 3
    assert key == ""
    assert message.startswith("invalid YAML")


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_not_a_mapping(text: str) -> None:
    [(line, key, message)] = problems(text)
    assert (line, key) == (1, "")
    assert "mapping" in message


def test_load_config_reads_a_file_and_names_it(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("site: from-file\n")
    assert load_config(path).site == "from-file"
    path.write_text("site: from-file\nbogus: 1\n")
    with pytest.raises(SourceError) as info:
        load_config(path)
    assert str(info.value) == f"{path}:2:1: bogus: unknown key"


def test_a_missing_file_is_a_source_error(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="cannot read"):
        load_config(tmp_path / "absent.yaml")


# --- bugs --------------------------------------------------------------------------------


def test_mqtt_port_zero_is_an_error() -> None:
    assert one_problem("mqtt:\n  url: mqtt://h:0\n")[1] == "mqtt.url"


def test_http_listen_port_out_of_range_is_an_error() -> None:
    assert one_problem("http:\n  listen: 127.0.0.1:99999\n")[1] == "http.listen"


def test_mqtt_protocol_5_unquoted_is_accepted() -> None:
    assert cfg("mqtt:\n  protocol: 5\n").mqtt.protocol == "5"


# --- deploy/config.example.yaml shows every key -------------------------------------------

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "config.example.yaml"


def _switched_on(text: str) -> str:
    """The example with every commented-out key line switched on, keeping its indent:
    `  # username: x` -> `  username: x`, `  #   regions: [...]` -> `    regions: [...]`."""
    import re

    return re.sub(r"(?m)^(\s*)# (\s*[a-z_]+:(?:\s|$))", r"\1\2", text)


def _field_paths(model: type[Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every key a configuration may have, from the models themselves."""
    from pydantic import BaseModel

    paths = []
    for name, info in model.model_fields.items():
        paths.append((*prefix, name))
        for tp in (info.annotation, *get_args(info.annotation)):
            if isinstance(tp, type) and issubclass(tp, BaseModel):
                paths += _field_paths(tp, (*prefix, name))
    return paths


def _without_example(text: str) -> list[str]:
    """The configuration keys that `text`, all its commented-out keys switched on, lacks."""
    import yaml

    data = yaml.safe_load(_switched_on(text))
    missing = []
    for path in _field_paths(Config):
        node = data
        for key in path:
            if not isinstance(node, dict) or key not in node:
                missing.append(".".join(path))
                break
            node = node[key]
    return missing


def test_the_example_config_shows_every_key_and_loads(tmp_path: Path) -> None:
    import yaml

    assert load_config(EXAMPLE).clouds.configured() == ["sim"]  # as shipped
    assert _without_example(EXAMPLE.read_text()) == [], \
        "keys without an example in deploy/config.example.yaml"
    # Every cloud switched on: the simulated market must go (it plays all four), and the
    # real clouds' sections load as they stand.
    data = yaml.safe_load(_switched_on(EXAMPLE.read_text()))
    del data["clouds"]["sim"]
    copy = tmp_path / "config.yaml"
    copy.write_text(yaml.safe_dump(data))
    loaded = load_config(copy)
    assert loaded.clouds.configured() == ["aws", "gcp", "azure", "alibaba", "private"]
    aws, gcp, azure, alibaba = (loaded.clouds.aws, loaded.clouds.gcp, loaded.clouds.azure,
                                loaded.clouds.alibaba)
    assert aws is not None and aws.interruption_queue_url and aws.regions
    assert gcp is not None and gcp.project and azure is not None and azure.subscription_id
    assert alibaba is not None and alibaba.usd_per_cny == 0.14 and alibaba.spot_duration == 1
    assert {c.call_timeout_seconds for c in (aws, gcp, azure, alibaba)} == {10}
    assert loaded.mqtt.password_file and loaded.http.token_file and loaded.policy_file


def test_a_key_without_an_example_is_found() -> None:
    """The check above finds what it is for: a key left out of the example."""
    text = "\n".join(line for line in EXAMPLE.read_text().splitlines()
                     if "usd_per_cny" not in line and "keep_ended_hours" not in line)
    assert _without_example(text) == ["state.keep_ended_hours", "clouds.alibaba.usd_per_cny"]


@pytest.mark.parametrize("url", ["http://", "http://bad host:80", "ftp://x", "x",
                                 "https://h:99999"])
def test_cloud_urls_need_a_scheme_and_a_host(url: str) -> None:
    line, key, message = one_problem(f"""\
        clouds:
          aws:
            regions: [us-east-1]
            interruption_queue_url: "{url}"
    """)
    assert (line, key) == (4, "clouds.aws.interruption_queue_url")
    assert "http:// or https:// URL with a host" in message
    line, key, _ = one_problem(f"clouds:\n  gcp:\n    regions: [x]\n    endpoint: '{url}'\n")
    assert (line, key) == (4, "clouds.gcp.endpoint")
