"""The one-word risk setting (`policies/risk.py`): what each level sets, how a policy reads
it, and which level a request is scored at (a rule's over its team's over the policy's)."""

from __future__ import annotations

import textwrap

import pytest
from factories import request

from policies.evaluate import Constraints, describe, evaluate, risk_for
from policies.loader import SourceError, parse_policy
from policies.model import Policy, Scoring
from policies.risk import DEFAULT_RISK, RISK_LEVELS, RISK_PRESETS, RISK_WEIGHTS


def policy(body: str = "") -> Policy:
    return parse_policy("version: 1\n" + textwrap.dedent(body))


def weights(s: Scoring) -> tuple[float, float, float]:
    return (s.restart_hours, s.availability_weight, s.interruption_cost_per_gpu)


def test_the_table_has_every_level_and_only_the_risk_weights() -> None:
    assert RISK_LEVELS == ("lowest-cost", "balanced", "fewest-interruptions")
    assert set(RISK_PRESETS) == set(RISK_LEVELS)
    assert set(RISK_WEIGHTS) == {"restart_hours", "availability_weight",
                                 "interruption_cost_per_gpu"}
    assert set(RISK_WEIGHTS) <= set(Scoring.model_fields)
    # lowest-cost is plain price, as cheapest-spot chooses
    assert tuple(RISK_PRESETS["lowest-cost"]) == (0.0, 0.0, 0.0)
    # each level prices an interruption at least as high as the one before it
    costs = [RISK_PRESETS[level].interruption_cost_per_gpu for level in RISK_LEVELS]
    assert costs == sorted(costs)


def test_balanced_is_the_default_everywhere() -> None:
    assert DEFAULT_RISK == "balanced"
    for p in (Policy(), policy(), policy("scoring: {}\n")):
        assert p.scoring.risk == "balanced"
        assert weights(p.scoring) == tuple(RISK_PRESETS["balanced"])
    p = policy("teams: {ml: {}}\nrules: [{name: r, match: {team: ml}, require: {}}]\n")
    assert p.teams["ml"].risk is None
    assert p.rules[0].require is not None and p.rules[0].require.risk is None
    assert evaluate(p, request(team="ml")).risk == "balanced"  # type: ignore[union-attr]


@pytest.mark.parametrize("level", RISK_LEVELS)
def test_a_policy_wide_level_takes_its_weights(level: str) -> None:
    p = policy(f"scoring: {{risk: {level}, spread_weight: 0.2}}\n")
    assert p.scoring.risk == level
    assert weights(p.scoring) == tuple(RISK_PRESETS[level])  # type: ignore[index]
    assert p.scoring.spread_weight == 0.2
    assert p.for_risk(level) is p  # type: ignore[arg-type]
    assert p.for_risk(None) is p


def test_explicit_weights_are_kept_as_written() -> None:
    # As before the risk levels: a scoring with weights written keeps them, and the
    # weights it leaves out take the level's (balanced's, unless it names another).
    s = Scoring(restart_hours=2.0, interruption_cost_per_gpu=0.0)
    assert weights(s) == (2.0, RISK_PRESETS["balanced"].availability_weight, 0.0)
    s = Scoring(risk="fewest-interruptions", restart_hours=3.0)
    assert weights(s) == (3.0, RISK_PRESETS["fewest-interruptions"].availability_weight,
                          RISK_PRESETS["fewest-interruptions"].interruption_cost_per_gpu)


def test_explicit_weights_tune_the_policy_wide_level_only() -> None:
    p = policy("""
        scoring:
          risk: balanced
          interruption_cost_per_gpu: 3
          restart_hours: 1
          unknown_interruption_rate: 0.2
          unknown_availability: 0.7
          spread_weight: 0.1
          idle_gpu_weight: 0.3
          spot_min_discount: 0.15
          hazard_half_life_hours: 12
        """)
    assert weights(p.scoring) == (1.0, 0.25, 3.0)
    for level in ("lowest-cost", "fewest-interruptions"):
        other = p.for_risk(level)  # type: ignore[arg-type]
        assert other is not p and other.scoring.risk == level
        # that level's preset for the three risk weights ...
        assert weights(other.scoring) == tuple(RISK_PRESETS[level])  # type: ignore[index]
        # ... and every other setting the policy's
        assert other.scoring.model_dump(exclude={"risk", *RISK_WEIGHTS}) == \
            p.scoring.model_dump(exclude={"risk", *RISK_WEIGHTS})
        assert other.model_dump(exclude={"scoring"}) == p.model_dump(exclude={"scoring"})
        # made once; and its way back to the policy's level is the policy, as tuned
        assert p.for_risk(level) is other  # type: ignore[arg-type]
        assert other.for_risk("balanced") is p


def test_copies_made_for_other_levels_are_no_part_of_a_policys_value() -> None:
    p, q = policy(), policy()
    p.for_risk("fewest-interruptions")
    assert p == q
    # A copy of a policy with other settings makes its own copies, from its settings.
    tuned = p.model_copy(update={"scoring": Scoring(risk="balanced", spread_weight=0.5)})
    assert tuned.for_risk("fewest-interruptions").scoring.spread_weight == 0.5
    assert p.for_risk("fewest-interruptions").scoring.spread_weight == 0.0


PRECEDENCE = """
    scoring: {risk: balanced}
    teams:
      research: {risk: lowest-cost}
      inference: {risk: fewest-interruptions}
      plain: {}
    rules:
      - name: demos-stay-up
        match: {labels: {kind: demo}}
        require: {risk: fewest-interruptions}
      - name: sweeps-are-cheap
        match: {labels: {kind: sweep}}
        require: {risk: lowest-cost}
      - name: eu
        match: {labels: {data: eu}}
        require: {residency: [eu]}
    """


@pytest.mark.parametrize(("team", "labels", "level"), [
    (None, {}, "balanced"),                                  # the policy's
    ("plain", {}, "balanced"),                               # a team that names none
    ("research", {}, "lowest-cost"),                         # the team's over the policy's
    ("inference", {}, "fewest-interruptions"),
    ("research", {"kind": "demo"}, "fewest-interruptions"),  # the rule's over the team's
    ("inference", {"kind": "sweep"}, "lowest-cost"),
    (None, {"kind": "demo"}, "fewest-interruptions"),        # the rule's over the policy's
    ("research", {"data": "eu"}, "lowest-cost"),             # a rule that names none
])
def test_a_rule_over_the_team_over_the_policy(team: str | None, labels: dict[str, str],
                                              level: str) -> None:
    p = policy(PRECEDENCE)
    req = request(team=team, labels=labels)
    c = evaluate(p, req)
    assert isinstance(c, Constraints), c
    assert c.risk == level
    assert risk_for(p, req) == level
    assert describe(c)["risk"] == level


def test_a_policy_wide_level_other_than_balanced_is_the_fallback() -> None:
    p = policy("scoring: {risk: fewest-interruptions}\nteams: {ml: {}}\n")
    assert evaluate(p, request(team="ml")).risk == "fewest-interruptions"  # type: ignore[union-attr]


@pytest.mark.parametrize(("body", "line", "key"), [
    ("scoring:\n  risk: cheap\n", 3, "scoring.risk"),
    ("teams:\n  ml:\n    risk: safest\n", 4, "teams.ml.risk"),
    ("rules:\n  - name: r\n    match: {team: ml}\n    require: {risk: fewest_interruptions}\n",
     5, "rules[0].require.risk"),
])
def test_an_unknown_level_is_a_load_error_naming_the_three(body: str, line: int,
                                                           key: str) -> None:
    with pytest.raises(SourceError) as info:
        parse_policy("version: 1\n" + body, "policy.yaml")
    [problem] = info.value.problems
    assert (problem.file, problem.line, problem.key) == ("policy.yaml", line, key)
    for level in RISK_LEVELS:
        assert f"'{level}'" in problem.message
    assert f"policy.yaml:{line}:" in str(info.value)
