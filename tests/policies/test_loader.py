"""Tests of the policy loader (`policies/loader.py`): errors name file, line, column, key."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from policies.loader import SourceError, load_policy, parse_policy
from policies.model import Defaults, Failover, Policy, Scoring

FULL = """\
version: 1
defaults:
  market: spot
  max_price_per_gpu_hour: 3.5
  lease_seconds: 600
scoring:
  restart_hours: 0.5
  availability_weight: 0.3
  unknown_interruption_rate: 0.1
  unknown_availability: 0.6
failover:
  cooldown_seconds: 120
"""


def problems(text: str) -> list[tuple[str, int | None, int | None, str, str]]:
    with pytest.raises(SourceError) as info:
        parse_policy(textwrap.dedent(text), "policy.yaml")
    return [(p.file, p.line, p.column, p.key, p.message) for p in info.value.problems]


def test_a_full_policy() -> None:
    assert parse_policy(FULL) == Policy(
        version=1,
        defaults=Defaults(market="spot", max_price_per_gpu_hour=3.5, lease_seconds=600),
        scoring=Scoring(restart_hours=0.5, availability_weight=0.3,
                        unknown_interruption_rate=0.1, unknown_availability=0.6),
        failover=Failover(cooldown_seconds=120),
    )


@pytest.mark.parametrize("text", ["version: 1\n", "version: 1\ndefaults: {}\n"])
def test_left_out_means_the_defaults(text: str) -> None:
    assert parse_policy(text) == Policy()


@pytest.mark.parametrize(("text", "words"), [
    ("", "empty policy"), ("# only a comment\n", "empty policy"),
    ("defaults:\n  market: spot\n", "`version: 1` is missing"),
])
def test_a_policy_must_say_its_version(text: str, words: str) -> None:
    [(_, _, _, key, message)] = problems(text)
    assert key == "" and words in message


def test_partial_sections_keep_their_other_defaults() -> None:
    p = parse_policy("version: 1\ndefaults:\n  market: on_demand\n")
    assert p.defaults.market == "on_demand"
    assert p.defaults.lease_seconds == 900
    assert p.scoring == Scoring()


def test_load_policy_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(FULL)
    assert load_policy(path) == parse_policy(FULL)


def test_file_errors_name_the_file_line_column_and_key(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("version: 1\ndefaults:\n  market: cheap\n")
    with pytest.raises(SourceError) as info:
        load_policy(path)
    assert str(info.value) == (
        f"{path}:3:3: defaults.market: Input should be 'spot', 'on_demand', 'reserved' or 'any'")


def test_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="cannot read"):
        load_policy(tmp_path / "absent.yaml")


@pytest.mark.parametrize(("text", "line", "col", "key", "words"), [
    ("version: 2\n", 1, 1, "version", "1"),
    ("version: 1\ndefaults:\n  market: cheap\n", 3, 3, "defaults.market", "spot"),
    ("version: 1\ndefaults:\n  max_price_per_gpu_hour: 0\n", 3, 3,
     "defaults.max_price_per_gpu_hour", "greater than 0"),
    ("version: 1\ndefaults:\n  lease_seconds: 5\n", 3, 3, "defaults.lease_seconds", "10"),
    ("version: 1\ndefaults:\n  lease_seconds: 1.5\n", 3, 3, "defaults.lease_seconds",
     "integer"),
    ("version: 1\nscoring:\n  restart_hours: fast\n", 3, 3, "scoring.restart_hours",
     "number"),
    ("version: 1\nscoring:\n  unknown_availability: 2\n", 3, 3,
     "scoring.unknown_availability", "1"),
    ("version: 1\nscoring:\n  availability_weight: -0.1\n", 3, 3,
     "scoring.availability_weight", "0"),
    ("version: 1\nfailover:\n  cooldown_seconds: [1]\n", 3, 3, "failover.cooldown_seconds",
     "number"),
    ("version: 1\ndefaults: [spot]\n", 2, 1, "defaults", "dictionary"),
    ("version: 1\nscoring: 3\n", 2, 1, "scoring", "dictionary"),
])
def test_wrong_values_name_line_column_and_key(text: str, line: int, col: int, key: str,
                                               words: str) -> None:
    [(file, got_line, got_col, got_key, message)] = problems(text)
    assert (file, got_line, got_col, got_key) == ("policy.yaml", line, col, key)
    assert words in message


def test_unknown_keys_are_errors() -> None:
    got = problems("""\
        version: 1
        defaults:
          markte: spot
        failover:
          cooldown: 5
        team: {}
    """)
    assert sorted(got) == [
        ("policy.yaml", 3, 3, "defaults.markte", "unknown key; did you mean 'market'?"),
        ("policy.yaml", 5, 3, "failover.cooldown",
         "unknown key; did you mean 'cooldown_seconds'?"),
        ("policy.yaml", 6, 1, "team", "unknown key; did you mean 'teams'?"),
    ]


def test_every_problem_is_reported_at_once() -> None:
    got = problems("version: 3\ndefaults:\n  market: x\nscoring:\n  restart_hours: -1\n")
    assert sorted(key for _, _, _, key, _ in got) == [
        "defaults.market", "scoring.restart_hours", "version"]


def test_shape_and_name_problems_come_in_one_run_in_the_order_of_the_file() -> None:
    got = problems("""\
        version: 1
        gpus:
          allow: [A100-80G, 7]
        teams:
          research:
            max_gpus: lots
            gpus: [H100]
            markets: [spot, preemptible]
          ml: {clouds: [gpc]}
        rules:
          - name: a
            match: {team: reserch}
            deny: "no"
          - name: b
            match: {team: ml}
            require: {market: cheap}
          - name: c
            match: {team: ml, gpu: [H100]}
            deny: x
          - name: a
            match: {team: ml}
            deny: y
        failover:
          cooldown: 5
    """)
    assert [(line, col, key) for _, line, col, key, _ in got] == [
        (3, 11, "gpus.allow[0]"), (3, 21, "gpus.allow[1]"), (6, 5, "teams.research.max_gpus"),
        (7, 12, "teams.research.gpus[0]"), (8, 21, "teams.research.markets[1]"),
        (9, 17, "teams.ml.clouds[0]"), (12, 13, "rules[0].match.team"),
        (16, 15, "rules[1].require.market"), (18, 29, "rules[2].match.gpu[0]"),
        (20, 5, "rules[3].name"), (24, 3, "failover.cooldown")]
    messages = [m for *_, m in got]
    assert "did you mean 'A100-80GB'?" in messages[0]
    assert "did you mean 'H100-80GB'?" in messages[3] and "did you mean 'gcp'?" in messages[5]
    assert "unknown team 'reserch'; did you mean 'research'?" in messages[6]
    # rules[1] has a wrong shape: the name checks leave it out, and no more is said of it
    assert "already used by rules[0]" in messages[9]
    assert "unknown key; did you mean 'cooldown_seconds'?" in messages[10]


def test_problems_far_down_the_file_come_in_line_order() -> None:
    # 49 rules: a shape problem on a late line, a name problem on the line before it
    rules = "".join(f"  - {{name: r{i}, match: {{gpu: T4, team: t{i}}}, deny: x}}\n"
                    for i in range(44))
    text = (f"version: 1\nrules:\n{rules}  - {{name: late, match: {{gpu: H100}}, deny: x}}\n"
            "  - {name: later, deny: x, require: {market: spot}}\n")
    got = problems(text)
    assert [(line, key) for _, line, _, key, _ in got] == [
        (47, "rules[44].match.gpu[0]"), (48, "rules[45]")]


@pytest.mark.parametrize("text", ["- version: 1\n", "spot\n", "42\n"])
def test_not_a_mapping(text: str) -> None:
    [(_, line, _, key, message)] = problems(text)
    assert key == ""
    assert "mapping" in message
    assert line == 1


def test_duplicate_keys_are_errors() -> None:
    got = problems("""\
        version: 1
        defaults:
          market: spot
          market: any
        version: 1
    """)
    assert sorted(got) == [
        ("policy.yaml", 4, 3, "defaults.market", "duplicate key"),
        ("policy.yaml", 5, 1, "version", "duplicate key"),
    ]


def test_invalid_yaml_names_line_and_column() -> None:
    [(_, line, col, key, message)] = problems("version: 1\n  bad: indent\n")
    assert (line, col, key) == (2, 6, "")
    assert message.startswith("invalid YAML:")
