"""YAML loading that remembers where each key stood, for errors a person can act on.

Used for both the ops teams' policy file and the daemon configuration: every problem is
reported as `FILE:LINE:COL: key.path: message`.
"""

from __future__ import annotations

import difflib
import errno
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from gpubroker_client import files

Loc = tuple[str | int, ...]


@dataclass(frozen=True, slots=True)
class Problem:
    file: str
    line: int | None
    column: int | None
    key: str
    message: str

    def __str__(self) -> str:
        """`FILE:LINE:COL: key: message`, with the control characters of all of it
        escaped (`broker.output.stdio.printable`): the file name, a key and the text a message
        quotes come from the user, and a terminal must not act on them."""
        from broker.output.stdio import printable

        where = self.file
        if self.line is not None:
            where += f":{self.line}:{self.column}"
        return printable(f"{where}: {self.key}: {self.message}" if self.key
                         else f"{where}: {self.message}")


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


MAX_BYTES = files.MAX_YAML_BYTES
MAX_DEPTH = 32


class _Refused(yaml.MarkedYAMLError):
    """What the loader below refuses, where, and under which key."""

    def __init__(self, message: str, mark: yaml.Mark | None, loc: Loc) -> None:
        super().__init__(problem=message, problem_mark=mark)
        self.loc = loc


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader (plain data only: no Python objects, no unknown tags) that
    stops composing at `MAX_DEPTH` levels (so that deep nesting is refused at once, not
    after a `RecursionError`), refuses a list or a mapping as a key, and turns whatever
    constructing a value raises (a date like 2024-13-45, an integer past Python's 4,300
    digits, a bad `!!float`) into an error naming the value's line and key."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.path: list[str | int] = []
        self.locs: dict[int, Loc] = {}

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        if parent is not None and index is None and (
                self.check_event(yaml.MappingStartEvent)
                or self.check_event(yaml.SequenceStartEvent)):
            raise _Refused("a key must be plain text, not a list or a mapping",
                           self._next_mark(), tuple(self.path))
        pushed = parent is not None and index is not None
        if pushed:
            self.path.append(str(index.value) if isinstance(index, yaml.ScalarNode)
                             else index if isinstance(index, int) else "?")
        try:
            if len(self.path) > MAX_DEPTH and (self.check_event(yaml.MappingStartEvent)
                                               or self.check_event(yaml.SequenceStartEvent)):
                raise _Refused(f"nested too deeply (at most {MAX_DEPTH} levels)",
                               self._next_mark(), tuple(self.path))
            node = super().compose_node(parent, index)
            assert node is not None  # an event was there: `check_event` above
            self.locs.setdefault(id(node), tuple(self.path))
            return node
        finally:
            if pushed:
                self.path.pop()

    def _next_mark(self) -> yaml.Mark | None:
        event = self.peek_event()  # type: ignore[no-untyped-call]
        mark: yaml.Mark | None = getattr(event, "start_mark", None)
        return mark

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (ValueError, TypeError, OverflowError, ArithmeticError) as exc:
            why = "an integer of more than 4300 digits" if "integer string conversion" in \
                str(exc) else _one_line(str(exc))  # not Python's advice to raise the limit
            raise _Refused(f"cannot read this value: {why}", node.start_mark,
                           self.locs.get(id(node), ())) from None


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "…"


def _yaml_problem(exc: yaml.YAMLError, text: str, name: str) -> Problem:
    """One line for whatever PyYAML raised, at its line and column when it has one."""
    if isinstance(exc, yaml.reader.ReaderError):  # a control character: no mark, a position
        head = text[:exc.position]
        char = f" (character U+{exc.character:04X})" if isinstance(exc.character, int) else ""
        return Problem(name, head.count("\n") + 1, len(head) - (head.rfind("\n") + 1) + 1,
                       "", f"invalid YAML: {exc.reason}{char}")
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    line: int | None = mark.line + 1 if mark else None
    col: int | None = mark.column + 1 if mark else None
    if isinstance(exc, _Refused):
        return Problem(name, line, col, dotted(exc.loc), str(exc.problem))
    problem = getattr(exc, "problem", None) or str(exc)
    return Problem(name, line, col, "", f"invalid YAML: {_one_line(str(problem))}")


def parse(text: str, name: str) -> Document:
    """Parse YAML `text`; raise SourceError (with line) on syntax errors, duplicate keys,
    anchors/aliases (a "billion laughs" bomb expands through them), nesting deeper than
    MAX_DEPTH, a value that cannot be read (a bad date, a tag of its own, a list as a
    key) or a text larger than MAX_BYTES. Nothing else escapes: a file is never a crash."""
    if len(text.encode("utf-8", errors="surrogatepass")) > MAX_BYTES:
        raise SourceError([Problem(name, None, None, "",
                                   f"larger than {files.size_text(MAX_BYTES)}; not read")])
    text = text.removeprefix("\ufeff")  # one truth with `files.decode`
    try:
        loader = _Loader(text)  # refuses control characters at once
        try:
            node = loader.get_single_node()
            if node is None:
                return Document(name, {}, {})
            marks: dict[Loc, tuple[int, int]] = {}
            problems: list[Problem] = []
            _walk(node, (), marks, problems, name)
            if problems:
                raise SourceError(problems)
            data = loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        raise SourceError([_yaml_problem(exc, text, name)]) from None
    except RecursionError:  # not expected with MAX_DEPTH; still never a crash
        raise SourceError([Problem(name, None, None, "", "nested too deeply")]) from None
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


def parse_bytes(raw: bytes, name: str) -> Document:
    """`parse` of a file's bytes: strict UTF-8 (a leading byte order mark dropped), at
    most MAX_BYTES; what the daemon reads on a reload and what a start reads are one."""
    if len(raw) > MAX_BYTES:
        raise SourceError([Problem(name, None, None, "",
                                   f"larger than {files.size_text(MAX_BYTES)}; not read")])
    try:
        text = files.decode(raw, name)
    except files.FileRefused as exc:
        raise SourceError([Problem(name, exc.line, exc.column, "", str(exc.strerror))]
                          ) from None
    return parse(text, name)


def read(path: Path, limit: int = MAX_BYTES) -> bytes:
    """The bytes of the YAML file at `path` (`files.read_bytes`); SourceError naming the
    file when it cannot be read or is refused (not a regular file, too large)."""
    try:
        return files.read_bytes(path, limit)
    except OSError as exc:
        raise SourceError([unreadable(path, exc)]) from None


def unreadable(path: Path | str, exc: OSError, key: str = "") -> Problem:
    """The one line for a file that cannot be read or is refused."""
    why = exc.strerror or str(exc)
    if isinstance(exc, files.FileRefused) and exc.errno == errno.EFBIG:
        return Problem(str(path), None, None, key, why)  # "larger than …; not read"
    return Problem(str(path), None, None, key, f"cannot read: {why}")


def load(path: Path) -> Document:
    return parse_bytes(read(path), str(path))


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
