"""Policies that are well-formed YAML but wrong: every problem found, located, explained,
with the nearest valid name for a typo."""

from __future__ import annotations

import textwrap

import pytest

from policies.loader import SourceError, parse_policy


def problems(text: str) -> list[tuple[int | None, str, str]]:
    with pytest.raises(SourceError) as info:
        parse_policy(textwrap.dedent(text), "p.yaml")
    return [(p.line, p.key, p.message) for p in info.value.problems]


# (policy body after `version: 1`, expected line, key, words in the message)
BROKEN = [
    ("gpus:\n  allow: [A100-80G]\n", 3, "gpus.allow[0]",
     "unknown GPU 'A100-80G'; did you mean 'A100-80GB'?"),
    ("gpus:\n  deny: [h100]\n", 3, "gpus.deny[0]", "unknown GPU 'h100'"),
    ("gpus:\n  equivalent: {A100-80GB: [H100-80]}\n", 3, "gpus.equivalent.A100-80GB[0]",
     "did you mean 'H100-80GB'?"),
    ("gpus:\n  equivalent: {A10O: [L4]}\n", 3, "gpus.equivalent.A10O", "unknown GPU 'A10O'"),
    ("clouds:\n  allow: [aws, gpc]\n", 3, "clouds.allow[1]",
     "unknown cloud 'gpc'; did you mean 'gcp'?"),
    ("clouds:\n  allow: [aws]\n  deny: [aws]\n", 4, "clouds.deny[0]",
     "'aws' is both allowed and denied"),
    ("regions:\n  allow: [us-east-1]\n  deny: [us-east-1]\n", 4, "regions.deny[0]",
     "both allowed and denied"),
    ("teams:\n  ml:\n    residency: [europa]\n", 4, "teams.ml.residency[0]",
     "unknown residency tag 'europa'; did you mean 'europe'?"),
    ("teams:\n  ml:\n    gpus: [T4, L4x]\n", 4, "teams.ml.gpus[1]", "did you mean 'L4'?"),
    ("teams:\n  ml:\n    clouds: [azur]\n", 4, "teams.ml.clouds[0]", "did you mean 'azure'?"),
    ("teams:\n  ml:\n    budjet_per_hour: 5\n", 4, "teams.ml.budjet_per_hour",
     "unknown key; did you mean 'budget_per_hour'?"),
    ("teams:\n  ml:\n    max_gpus: -1\n", 4, "teams.ml.max_gpus", "greater than or equal"),
    ("teams:\n  ml:\n    markets: [preemptible]\n", 4, "teams.ml.markets[0]", "'spot'"),
    ("rules:\n  - name: a\n    match: {team: ml}\n", 3, "rules[0]",
     "needs exactly one of `require` or `deny`"),
    ("rules:\n  - name: a\n    deny: x\n    require: {market: spot}\n", 3, "rules[0]",
     "needs exactly one of `require` or `deny`"),
    ("rules:\n  - name: a\n    deny: no\n", 4, "rules[0].deny", "quote the text"),
    ("rules:\n  - name: a\n    match: {gpu: A100}\n    deny: x\n", 4, "rules[0].match.gpu[0]",
     "unknown GPU 'A100'"),
    ("rules:\n  - name: a\n    require: {residency: [mars]}\n", 4,
     "rules[0].require.residency[0]", "unknown residency tag 'mars'"),
    ("rules:\n  - name: a\n    match: {gpu: T4}\n    deny: x\n  - name: a\n    match: {gpu: L4}\n"
     "    deny: y\n", 6, "rules[1].name", "already used by rules[0]"),
    ("rules:\n  - name: a\n    match: {team: [x, y]}\n    deny: x\n  - name: b\n"
     "    match: {team: [y, x]}\n    deny: y\n", 7, "rules[1].match",
     "rule 'b' can never match: rule 'a' has the same match and comes first"),
    ("clouds:\n  allow: [aws]\nrules:\n  - name: a\n    require: {clouds: [gcp]}\n", 6,
     "rules[0].require.clouds", "could never place anything"),
    ("teams:\n  ml: {markets: [spot]}\nrules:\n  - name: a\n    match: {team: ml}\n"
     "    require: {market: on_demand}\n", 7, "rules[0].require.market",
     "whose markets are spot"),
    ("teams:\n  ml: {}\nrules:\n  - name: a\n    match: {team: mll}\n    deny: x\n", 6,
     "rules[0].match.team", "unknown team 'mll'; did you mean 'ml'?"),
    ("failover:\n  ladder: [on_demand, on_demand]\n", 3, "failover.ladder", "appears twice"),
    ("failover:\n  ladder: [same_zone]\n", 3, "failover.ladder[0]", "same_region_spot"),
    ("failover:\n  triggers: {price_spike_ratio: 0.5}\n", 3,
     "failover.triggers.price_spike_ratio", "greater than 1"),
    ("scoring:\n  spot_min_discount: 1\n", 3, "scoring.spot_min_discount", "less than 1"),
    ("extra_gpus: [H20]\ngpus:\n  allow: [H21]\n", 4, "gpus.allow[0]",
     "did you mean 'H20'?"),
]


@pytest.mark.parametrize(("body", "line", "key", "words"), BROKEN,
                         ids=[b[2] for b in BROKEN])
def test_broken_policies_are_explained(body: str, line: int, key: str, words: str) -> None:
    got = problems("version: 1\n" + body)
    assert any(gl == line and gk == key and words in gm for gl, gk, gm in got), got


def test_all_problems_at_once() -> None:
    got = problems("""\
        version: 1
        gpus: {allow: [A100-80G, H100]}
        clouds: {deny: [awss]}
        teams: {ml: {residency: [euu]}}
    """)
    assert [k for _, k, _ in got] == ["gpus.allow[0]", "gpus.allow[1]", "clouds.deny[0]",
                                      "teams.ml.residency[0]"]  # in the order of the file


def test_extra_gpus_make_cloud_specific_models_valid() -> None:
    p = parse_policy("version: 1\nextra_gpus: [H20]\ngpus: {allow: [H20, L4]}\n")
    assert p.gpus.allow == ["H20", "L4"]


def test_a_yaml_bomb_is_refused_quickly() -> None:
    laughs = ["version: 1", 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 10):
        prev = chr(ord("a") + i - 1)
        cur = chr(ord("a") + i)
        laughs.append(f"{cur}: &{cur} [{','.join(['*' + prev] * 9)}]")
    [(line, _, message)] = problems("\n".join(laughs) + "\n")
    assert line == 2 and "aliases are not allowed" in message


def test_a_huge_file_is_refused(tmp_path: object) -> None:
    text = "version: 1\n" + "# padding\n" * 200_000
    [(_, _, message)] = problems(text)
    assert "larger than" in message


@pytest.mark.parametrize("text", ["version: 1\nteams: {ml: [1, 2}\n",
                                  "version: 1\nkey: 'unterminated\n", "version: 1\n  x: 1\n"])
def test_not_yaml(text: str) -> None:
    [(line, _, message)] = problems(text)
    assert line is not None and message.startswith("invalid YAML")


def test_deeply_nested_yaml_is_refused() -> None:
    text = "version: 1\nx: " + "[" * 60 + "]" * 60 + "\n"
    got = problems(text)
    assert any("nested too deeply" in m for _, _, m in got)
