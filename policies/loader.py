"""Load and validate a policy file, with errors that name file, line and key."""

from __future__ import annotations

import hashlib
from pathlib import Path

from pydantic import ValidationError

from policies import checks, yamlsrc
from policies.model import Policy
from policies.yamlsrc import Document, SourceError

__all__ = ["SourceError", "load_policy", "parse_policy"]


def parse_policy(text: str, name: str = "<policy>") -> Policy:
    return _validate(yamlsrc.parse(text, name))


def load_policy(path: Path) -> Policy:
    return _validate(yamlsrc.load(path))


def _validate(doc: Document) -> Policy:
    if not doc.data:
        raise SourceError([doc.problem((), "empty policy: it needs at least `version: 1`")])
    if not isinstance(doc.data, dict):
        raise SourceError([doc.problem((), "a policy is a mapping with `version: 1` at the top")])
    if "version" not in doc.data:
        raise SourceError([doc.problem((), "`version: 1` is missing at the top")])
    try:
        policy = Policy.model_validate(doc.data)
    except ValidationError as err:
        raise yamlsrc.from_validation_error(doc, err, Policy) from None
    found = checks.check(policy)
    if found:
        raise SourceError([doc.problem(loc, message) for loc, message in found])
    return policy


def policy_hash(text: bytes) -> str:
    """The identity of a policy file's content, as published in `policy.applied`."""
    return "sha256:" + hashlib.sha256(text).hexdigest()
