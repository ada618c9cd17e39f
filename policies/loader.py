"""Load and validate a policy file, with errors that name file, line and key.

Validation has two passes, and one run reports the problems of both, in the order of the
file: the shapes (types, ranges, unknown keys: `policies.model`), then the names and the
coherence (`policies.checks`) of everything whose shape is right. A part whose shape is
wrong is left out of the second pass — a rule with any such problem as a whole, so that
comparing rules never trips over a half-read one — and reported by the first.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from policies import checks, yamlsrc
from policies.model import Policy
from policies.yamlsrc import Document, Loc, Problem, SourceError

__all__ = ["SourceError", "load_policy", "parse_policy", "parse_policy_bytes"]

_PASSES = 16
"""At most this many rounds of leaving out what failed (each leaves out more, or stops)."""


def parse_policy(text: str, name: str = "<policy>") -> Policy:
    return _validate(yamlsrc.parse(text, name))


def parse_policy_bytes(raw: bytes, name: str = "<policy>") -> Policy:
    """The policy whose file content is `raw`: what a reload reads, checked exactly as a
    start checks it (strict UTF-8, the same bounds)."""
    return _validate(yamlsrc.parse_bytes(raw, name))


def load_policy(path: Path) -> Policy:
    return _validate(yamlsrc.load(path))


def _validate(doc: Document) -> Policy:
    if not doc.data:
        raise SourceError([doc.problem((), "empty policy: it needs at least `version: 1`")])
    if not isinstance(doc.data, dict):
        raise SourceError([doc.problem((), "a policy is a mapping with `version: 1` at the top")])
    if "version" not in doc.data:
        raise SourceError([doc.problem((), "`version: 1` is missing at the top")])
    problems: list[Problem] = []
    left_out: set[Loc] = set()
    policy: Policy | None = None

    def where(loc: Loc) -> Loc:  # a key path of what was validated, in the document
        return _original(loc, doc.data, left_out)

    for round_ in range(_PASSES):
        try:
            policy = Policy.model_validate(_without(doc.data, left_out))
            break
        except ValidationError as err:
            if round_ == 0:  # later rounds only see what leaving parts out caused
                problems += yamlsrc.from_validation_error(doc, err, Policy, where).problems
            more = {_part(where(yamlsrc.error_loc(e)), doc.data)
                    for e in err.errors(include_url=False)} - {()}
            if not more - left_out:
                break  # nothing more to leave out: no second pass
            left_out |= more
    if policy is not None:
        problems += [doc.problem(_original(loc, doc.data, left_out), message)
                     for loc, message in checks.check(policy)]
    if problems:
        raise SourceError(yamlsrc.by_line(problems))
    assert policy is not None
    return policy


def _part(loc: Loc, data: Any) -> Loc:
    """What to leave out for a problem at `loc`: the deepest key or item of `loc` that
    the document has, or the whole rule for a problem in a rule."""
    if len(loc) >= 2 and loc[0] == "rules" and isinstance(loc[1], int):
        return loc[:2]
    node, n = data, 0
    for part in loc:
        inside = part in node if isinstance(node, dict) else \
            isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        if not inside:
            break
        node = node[part]
        n += 1
    return loc[:n]


def _without(data: Any, left_out: set[Loc], loc: Loc = ()) -> Any:
    """`data` without the keys and list items at `left_out` (original key paths)."""
    if isinstance(data, dict):
        return {k: _without(v, left_out, (*loc, k)) for k, v in data.items()
                if (*loc, k) not in left_out}
    if isinstance(data, list):
        return [_without(v, left_out, (*loc, i)) for i, v in enumerate(data)
                if (*loc, i) not in left_out]
    return data


def _original(loc: Loc, data: Any, left_out: set[Loc]) -> Loc:
    """The key path in the document of `loc`, a key path in `_without(data, left_out)`:
    list positions count the items left out too."""
    out: list[str | int] = []
    node = data
    for part in loc:
        if isinstance(node, list) and isinstance(part, int):
            kept = [i for i in range(len(node)) if (*out, i) not in left_out]
            part = kept[part] if 0 <= part < len(kept) else part
            node = node[part] if 0 <= part < len(node) else None
        elif isinstance(node, dict):
            node = node.get(part)
        else:
            node = None
        out.append(part)
    return tuple(out)


def policy_hash(text: bytes) -> str:
    """The identity of a policy file's content, as published in `policy.applied`."""
    return "sha256:" + hashlib.sha256(text).hexdigest()
