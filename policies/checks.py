"""Checks of a structurally valid policy: every name known (with a suggestion for a near
miss), nothing contradictory. All problems are returned at once, each with the key path
it concerns, so the loader can give file, line and column."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence

from broker.model import CLOUDS, GPU_MODELS
from policies.model import Match, Policy

Loc = tuple[str | int, ...]
Found = list[tuple[Loc, str]]


def suggestions(word: str, choices: Iterable[str]) -> list[str]:
    """The names of `choices` a person who typed `word` most likely meant: the same name
    in other letter case, or names that extend it past a separator (`H100` ->
    `H100-80GB`, `eu` -> `eu-health`); failing those, the closest spelling
    (`A100-80G` -> `A100-80GB`). At most three; none for a word near nothing."""
    names = sorted(set(choices))
    low = word.lower()
    same = [n for n in names if n.lower() == low and n != word]
    if same:
        return same[:3]
    if low:
        longer = [n for n in names if n.lower().startswith(low) and len(n) > len(low)
                  and not n[len(low)].isalnum()]
        if longer:
            return longer[:3]
    by_lower = {n.lower(): n for n in names}
    close = difflib.get_close_matches(low, list(by_lower), n=1, cutoff=0.6)
    return [by_lower[c] for c in close]


def suggest(word: str, choices: Iterable[str]) -> str:
    """"; did you mean 'X'?" (or "'X' or 'Y'") for a near miss (`suggestions`), else ""."""
    return did_you_mean(suggestions(word, choices))


def did_you_mean(names: Sequence[str]) -> str:
    """"; did you mean 'A' or 'B'?" ("" for no names)."""
    quoted = [repr(n) for n in names]
    if not quoted:
        return ""
    either = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
    return f"; did you mean {either}?"


def _names(found: Found, loc: Loc, values: Iterable[str] | None, known: set[str],
           what: str) -> None:
    for i, v in enumerate(values or ()):
        if v not in known:
            found.append(((*loc, i), f"unknown {what} {v!r}{suggest(v, known)}"))


# Complex: one check per section of the policy, each its own finding.
def check(policy: Policy) -> Found:  # noqa: C901, PLR0912
    found: Found = []
    gpus = set(GPU_MODELS) | set(policy.extra_gpus)
    clouds = set(CLOUDS)
    tags = set(policy.residency_tags)

    for section, known, what in (("clouds", clouds, "cloud"), ("gpus", gpus, "GPU")):
        lists = getattr(policy, section)
        for key in ("allow", "deny"):
            _names(found, (section, key), getattr(lists, key), known, what)
        for name in sorted(set(lists.allow) & set(lists.deny)):
            found.append(((section, "deny", lists.deny.index(name)),
                          f"{name!r} is both allowed and denied"))
    for name in sorted(set(policy.regions.allow) & set(policy.regions.deny)):
        found.append((("regions", "deny", policy.regions.deny.index(name)),
                      f"{name!r} is both allowed and denied"))
    for model, alternatives in policy.gpus.equivalent.items():
        if model not in gpus:
            found.append((("gpus", "equivalent", model),
                          f"unknown GPU {model!r}{suggest(model, gpus)}"))
        _names(found, ("gpus", "equivalent", model), alternatives, gpus, "GPU")

    for name, team in policy.teams.items():
        loc: Loc = ("teams", name)
        _names(found, (*loc, "clouds"), team.clouds, clouds, "cloud")
        _names(found, (*loc, "gpus"), team.gpus, gpus, "GPU")
        _names(found, (*loc, "residency"), team.residency, tags, "residency tag")
        if team.clouds and not any(policy.clouds.permits(c) for c in team.clouds):
            found.append(((*loc, "clouds"), f"team {name!r} may use only clouds that the "
                          "top-level `clouds` lists forbid"))

    seen_names: dict[str, int] = {}
    seen_matches: dict[str, str] = {}
    for i, rule in enumerate(policy.rules):
        loc = ("rules", i)
        _names(found, (*loc, "match", "gpu"), rule.match.gpu, gpus, "GPU")
        if rule.name in seen_names:
            found.append(((*loc, "name"), f"rule name {rule.name!r} is already used by "
                          f"rules[{seen_names[rule.name]}]"))
        seen_names.setdefault(rule.name, i)
        key = _match_key(rule.match)
        if key in seen_matches:
            found.append(((*loc, "match"), f"rule {rule.name!r} can never match: rule "
                          f"{seen_matches[key]!r} has the same match and comes first"))
        seen_matches.setdefault(key, rule.name)
        for team_name in rule.match.team or ():
            if policy.teams and team_name not in policy.teams:
                found.append(((*loc, "match", "team"),
                              f"unknown team {team_name!r}{suggest(team_name, policy.teams)}"))
        req = rule.require
        if req is None:
            continue
        _names(found, (*loc, "require", "clouds"), req.clouds, clouds, "cloud")
        _names(found, (*loc, "require", "residency"), req.residency, tags, "residency tag")
        if req.clouds and not any(policy.clouds.permits(c) for c in req.clouds):
            found.append(((*loc, "require", "clouds"),
                          f"rule {rule.name!r} requires clouds that the top-level `clouds` "
                          "lists forbid: it could never place anything"))
        for team_name in rule.match.team or ():
            limits = policy.teams.get(team_name)
            if limits and limits.markets and req.market and req.market not in limits.markets:
                found.append(((*loc, "require", "market"),
                              f"rule {rule.name!r} requires market {req.market!r} for team "
                              f"{team_name!r}, whose markets are {', '.join(limits.markets)}"))
    for step in {s for s in policy.failover.ladder if policy.failover.ladder.count(s) > 1}:
        found.append((("failover", "ladder"), f"step {step!r} appears twice"))
    return found


def _match_key(m: Match) -> str:
    return repr((sorted(m.team or []), sorted(m.scheduler or []), sorted(m.gpu or []),
                 sorted((m.labels or {}).items())))
