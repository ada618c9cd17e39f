"""Load and validate a policy file, with errors that name file, line and key."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from policies import yamlsrc
from policies.model import Policy
from policies.yamlsrc import Document, SourceError

__all__ = ["SourceError", "load_policy", "parse_policy"]


def parse_policy(text: str, name: str = "<policy>") -> Policy:
    return _validate(yamlsrc.parse(text, name))


def load_policy(path: Path) -> Policy:
    return _validate(yamlsrc.load(path))


def _validate(doc: Document) -> Policy:
    if not isinstance(doc.data, dict):
        raise SourceError([doc.problem((), "a policy is a mapping with `version: 1` at the top")])
    try:
        return Policy.model_validate(doc.data)
    except ValidationError as err:
        raise yamlsrc.from_validation_error(doc, err) from None
