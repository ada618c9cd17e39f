"""YAML loading that remembers where each key stood, for errors a person can act on.

Used for both the ops teams' policy file and the daemon configuration: every problem is
reported as `FILE:LINE:COL: key.path: message`.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

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


MAX_BYTES = 1 << 20
MAX_DEPTH = 32


def parse(text: str, name: str) -> Document:
    """Parse YAML `text`; raise SourceError (with line) on syntax errors, duplicate keys,
    anchors/aliases (a "billion laughs" bomb expands through them), nesting deeper than
    MAX_DEPTH or a text larger than MAX_BYTES."""
    if len(text.encode()) > MAX_BYTES:
        raise SourceError([Problem(name, None, None, "",
                                   f"larger than {MAX_BYTES // 1024} KiB; not read")])
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
          problems: list[Problem], name: str, seen: set[int] | None = None) -> None:
    seen = set() if seen is None else seen
    mark = (node.start_mark.line + 1, node.start_mark.column + 1)
    if isinstance(node, yaml.MappingNode | yaml.SequenceNode):
        if id(node) in seen:
            # One line is enough, and walking on could take exponential time.
            raise SourceError([Problem(name, *mark, dotted(loc),
                                       "YAML anchors and aliases are not allowed "
                                       "(this one refers to the anchor on this line)")])
        seen.add(id(node))
        if len(loc) > MAX_DEPTH:
            problems.append(Problem(name, *mark, dotted(loc), "nested too deeply"))
            return
    marks.setdefault(loc, mark)
    if isinstance(node, yaml.MappingNode):
        keys: set[str] = set()
        for key_node, value_node in node.value:
            key = str(key_node.value)
            child = (*loc, key)
            if key in keys:
                problems.append(Problem(name, key_node.start_mark.line + 1,
                                        key_node.start_mark.column + 1, dotted(child),
                                        "duplicate key"))
            keys.add(key)
            marks[child] = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
            _walk(value_node, child, marks, problems, name, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _walk(item, (*loc, i), marks, problems, name, seen)


def load(path: Path) -> Document:
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_BYTES + 1)
        text = raw.decode("utf-8")
    except OSError as exc:
        raise SourceError([Problem(str(path), None, None, "", f"cannot read: {exc.strerror}")]
                          ) from None
    except UnicodeDecodeError as exc:
        raise SourceError([Problem(str(path), None, None, "", f"not UTF-8 text: {exc.reason}")]
                          ) from None
    return parse(text, str(path))


def error_loc(error: Any) -> Loc:
    """Where a pydantic error is, as a key path (validator names left out)."""
    return tuple(p for p in error["loc"]
                 if not (isinstance(p, str) and p.startswith("function-")))


def by_line(problems: Sequence[Problem]) -> list[Problem]:
    """Problems in the order of the file (those of the whole file first)."""
    return sorted(problems, key=lambda p: (p.line or 0, p.column or 0))


def from_validation_error(doc: Document, err: ValidationError,
                          model: type[BaseModel] | None = None,
                          where: Callable[[Loc], Loc] | None = None) -> SourceError:
    """Turn pydantic's errors into line-numbered problems naming the key, in the order of
    the file; with `model`, an unknown key gets the nearest valid key as a suggestion.
    `where` maps the errors' key paths onto the document's, when what was validated is
    the document with parts left out (`policies.loader`)."""
    problems = []
    for e in err.errors(include_url=False):
        loc = error_loc(e)
        if where is not None:
            loc = where(loc)
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
            parent = _model_at(model, loc[:-1]) if model else None
            if parent is not None and loc:
                match = difflib.get_close_matches(str(loc[-1]), list(parent.model_fields),
                                                  n=1, cutoff=0.6)
                if match:
                    msg += f"; did you mean {match[0]!r}?"
        elif e["type"] == "missing":
            msg = "required key is missing"
        msg = msg.removeprefix("Value error, ")
        if e["type"] == "string_type" and isinstance(e.get("input"), bool):
            msg += " (YAML reads yes/no/on/off/true/false as booleans: quote the text)"
        problem = doc.problem(loc, msg)
        if problem not in problems:  # a union reports one failure per member
            problems.append(problem)
    return SourceError(by_line(problems))


def _model_at(model: Any, loc: Loc) -> type[BaseModel] | None:
    """The pydantic model class that validates the mapping at `loc` under `model`."""
    current: Any = model
    for part in loc:
        current = _unwrap(current, part)
        if current is None:
            return None
    current = _unwrap(current, None)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _unwrap(tp: Any, part: str | int | None) -> Any:
    """Step from type `tp` into `part` (a field, a list index, a dict key), or with
    `part=None` only strip Optional/Annotated."""
    while True:
        origin = get_origin(tp)
        if origin is Annotated:
            tp = get_args(tp)[0]
        elif origin in (Union, UnionType):
            models = [a for a in get_args(tp) if a is not type(None)]
            tp = models[0] if models else None
        else:
            break
    if part is None:
        return tp
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        field = tp.model_fields.get(str(part))
        return None if field is None else field.annotation
    if origin in (list, tuple) and isinstance(part, int):
        return get_args(tp)[0]
    if origin is dict:
        return get_args(tp)[1]
    return None
