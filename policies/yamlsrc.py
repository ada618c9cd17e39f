"""YAML loading that remembers where each key stood, for errors a person can act on.

Used for both the ops teams' policy file and the daemon configuration: every problem is
reported as `FILE:LINE:COL: key.path: message`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

Loc = tuple[str | int, ...]


@dataclass(frozen=True, slots=True)
class Problem:
    file: str
    line: int | None
    column: int | None
    key: str
    message: str

    def __str__(self) -> str:
        where = self.file
        if self.line is not None:
            where += f":{self.line}:{self.column}"
        return f"{where}: {self.key}: {self.message}" if self.key else f"{where}: {self.message}"


class SourceError(Exception):
    """One or more problems in a YAML source; `str()` is one line per problem."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        super().__init__("\n".join(str(p) for p in problems))
        self.problems = list(problems)


@dataclass(frozen=True, slots=True)
class Document:
    name: str
    data: Any
    marks: dict[Loc, tuple[int, int]]

    def where(self, loc: Loc) -> tuple[int | None, int | None]:
        """Line and column (1-based) of the deepest key of `loc` that exists in the file."""
        for n in range(len(loc), -1, -1):
            mark = self.marks.get(tuple(loc[:n]))
            if mark:
                return mark
        return None, None

    def problem(self, loc: Loc, message: str) -> Problem:
        line, col = self.where(loc)
        return Problem(self.name, line, col, dotted(loc), message)


def dotted(loc: Loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def parse(text: str, name: str) -> Document:
    """Parse YAML `text`; raise SourceError (with line) on syntax errors or duplicate keys."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        line, col = (mark.line + 1, mark.column + 1) if mark else (None, None)
        raise SourceError([Problem(name, line, col, "", f"invalid YAML: {problem}")]) from None
    if node is None:
        return Document(name, {}, {})
    marks: dict[Loc, tuple[int, int]] = {}
    problems: list[Problem] = []
    _walk(node, (), marks, problems, name)
    if problems:
        raise SourceError(problems)
    data = yaml.safe_load(text)
    return Document(name, data, marks)


def _walk(node: yaml.Node, loc: Loc, marks: dict[Loc, tuple[int, int]],
          problems: list[Problem], name: str) -> None:
    marks.setdefault(loc, (node.start_mark.line + 1, node.start_mark.column + 1))
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = str(key_node.value)
            child = (*loc, key)
            if key in seen:
                problems.append(Problem(name, key_node.start_mark.line + 1,
                                        key_node.start_mark.column + 1, dotted(child),
                                        "duplicate key"))
            seen.add(key)
            marks[child] = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
            _walk(value_node, child, marks, problems, name)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _walk(item, (*loc, i), marks, problems, name)


def load(path: Path) -> Document:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SourceError([Problem(str(path), None, None, "", f"cannot read: {exc.strerror}")]
                          ) from None
    return parse(text, str(path))


def from_validation_error(doc: Document, err: ValidationError) -> SourceError:
    """Turn pydantic's errors into line-numbered problems naming the key."""
    problems = []
    for e in err.errors(include_url=False):
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "missing":
            msg = "required key is missing"
        msg = msg.removeprefix("Value error, ")
        problems.append(doc.problem(loc, msg))
    return SourceError(problems)
