"""The servers file: the company's own GPU servers as the ops team declares them — sites,
groups of identical servers, maintenance windows (`deploy/private.example.yaml` shows
every key).

Loading reports every problem at once, each as `FILE:LINE:COL: key: message`, with a
suggestion for a near miss: first the shape of each site, group and window (types,
ranges, unknown keys), then the names and the coherence of those whose shape is right
(sites and zones that exist, known GPU models, server names unique across the file,
windows that end after they start).
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError

from broker.model import GPU_MODELS
from policies import yamlsrc
from policies.checks import suggest
from policies.yamlsrc import Document, Loc, Problem, SourceError

__all__ = ["MAX_BYTES", "MAX_SERVERS", "Group", "Health", "Servers", "Site", "SourceError",
           "Window", "load_servers", "parse_servers"]

NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
MAX_BYTES = yamlsrc.MAX_BYTES
"""The largest servers file read (1 MiB)."""
MAX_SERVERS = 100_000
"""The most servers one file may declare."""
MAX_PROBLEMS_PER_GROUP = 5
"""Duplicate server names reported per group before "and N more"."""

Name = Annotated[str, Field(pattern=rf"^{NAME.pattern}$")]


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SiteSpec(_Spec):
    residency: list[Name] = Field(default_factory=list)
    """The site's residency tags (`eu`, `de`): a policy's `residency` requirements see
    the site's servers as in these."""
    zones: list[Name] | None = Field(default=None, min_length=1)
    """Default: one zone named like the site."""


class HealthSpec(_Spec):
    prometheus: str | None = None
    """A URL template with `{server}`: each server's exporter (DCGM or node exporter)."""
    file: Path | None = None
    """A YAML file `{down: [names]}` the ops team edits (relative: to this file's folder)."""


class GroupSpec(_Spec):
    name: Name
    site: Name
    zone: Name | None = None
    gpu: Annotated[str, Field(min_length=1, max_length=128)]
    gpus: int = Field(ge=1, le=64)
    vcpus: int | None = Field(default=None, ge=1)
    memory_gb: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    servers: list[Name] | None = Field(default=None, min_length=1)
    count: int | None = Field(default=None, ge=1, le=MAX_SERVERS)
    name_prefix: Name | None = None
    price_per_gpu_hour: float = Field(ge=0, allow_inf_nan=False)
    slices: int = Field(default=1, ge=1, le=64)
    """Leases per server at most: a server of 8 GPUs with `slices: 4` is leased as four
    instances of 2 GPUs (with a quarter of its vCPUs and memory each), so small jobs do
    not hold a whole server; a lease of several slices fills one server before the next.
    It must divide `gpus`. 1 (the default): a server goes whole to one lease."""
    health: HealthSpec | None = None


class WindowSpec(_Spec):
    servers: list[Name] | None = Field(default=None, min_length=1)
    group: Name | None = None
    drain_from: AwareDatetime
    drain_until: AwareDatetime
    lead_minutes: float = Field(default=30, ge=0, le=7 * 24 * 60, allow_inf_nan=False)
    reason: str = Field(default="", max_length=500)


class ServersFile(_Spec):
    """The whole file, `version: 1`."""

    version: Literal[1]
    sites: dict[Name, SiteSpec]
    groups: list[GroupSpec] = Field(default_factory=list)
    maintenance: list[WindowSpec] = Field(default_factory=list)


class _Top(_Spec):
    """The top level alone: each site, group and window is validated on its own, so that
    one with a problem does not hide the others' problems."""

    version: Literal[1]
    sites: dict[str, Any]
    groups: list[Any] = Field(default_factory=list)
    maintenance: list[Any] = Field(default_factory=list)


# --- what a valid file declares ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Site:
    name: str
    residency: tuple[str, ...]
    zones: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Health:
    """How a group's servers' health is read: one of the two."""

    prometheus: str | None = None
    file: Path | None = None


@dataclass(frozen=True, slots=True)
class Group:
    name: str
    site: str
    zone: str
    gpu: str
    gpus: int
    vcpus: int | None
    memory_gb: float | None
    price_per_gpu_hour: float
    servers: tuple[str, ...]
    health: Health | None
    slices: int = 1


@dataclass(frozen=True, slots=True)
class Window:
    """A maintenance window of `servers`: from `drain_from - lead` they drain (their
    leases move); from `drain_from` until `drain_until` they are out of service."""

    servers: frozenset[str]
    drain_from: datetime
    drain_until: datetime
    lead: timedelta
    reason: str

    def draining(self, now: datetime) -> bool:
        return self.drain_from - self.lead <= now < self.drain_from

    def closed(self, now: datetime) -> bool:
        """Whether the servers are out of service at `now`."""
        return self.drain_from <= now < self.drain_until


@dataclass(frozen=True, slots=True)
class Servers:
    sites: Mapping[str, Site]
    groups: tuple[Group, ...]
    maintenance: tuple[Window, ...]

    @property
    def server_count(self) -> int:
        return sum(len(g.servers) for g in self.groups)

    def names(self) -> frozenset[str]:
        return frozenset(s for g in self.groups for s in g.servers)

    def residency_tags(self) -> dict[str, list[str]]:
        """Each residency tag the sites declare, with its sites as policies name regions
        (`private:fra1`)."""
        out: dict[str, list[str]] = {}
        for site in self.sites.values():
            for tag in site.residency:
                out.setdefault(tag, []).append(f"private:{site.name}")
        return out

    def out_of_service(self, now: datetime) -> tuple[frozenset[str], frozenset[str]]:
        """The servers inside a maintenance window at `now`, and those draining before
        one (in its lead time and in no window)."""
        closed: set[str] = set()
        draining: set[str] = set()
        for w in self.maintenance:
            if w.closed(now):
                closed |= w.servers
            elif w.draining(now):
                draining |= w.servers
        return frozenset(closed), frozenset(draining - closed)


# --- loading -----------------------------------------------------------------------------


def load_servers(path: Path) -> Servers:
    """The servers file at `path`; raises `SourceError` naming every problem."""
    return parse_servers(yamlsrc.read(path), str(path), base=path.parent)


def parse_servers(raw: bytes | str, name: str = "<servers>", base: Path | None = None
                  ) -> Servers:
    """The servers file whose content is `raw` (at most `MAX_BYTES`); relative health
    file paths are taken from `base`. Raises `SourceError` naming every problem."""
    if isinstance(raw, str):
        raw = raw.encode()
    return _Checker(yamlsrc.parse_bytes(raw, name), base).run()


class _Checker:
    def __init__(self, doc: Document, base: Path | None) -> None:
        self.doc = doc
        self.base = base
        self.problems: list[Problem] = []

    def add(self, loc: Loc, message: str) -> None:
        self.problems.append(self.doc.problem(loc, message))

    def shape(self, model: type[_Spec], data: Any, loc: Loc) -> Any:
        """`data` validated as `model`, or None (its problems added)."""
        try:
            return model.model_validate(data)
        except ValidationError as err:
            self.problems += yamlsrc.from_validation_error(
                self.doc, err, ServersFile, lambda inner: (*loc, *inner)).problems
            return None

    def run(self) -> Servers:
        data = self.doc.data
        if not data:
            raise SourceError([self.doc.problem((), "empty file: it needs `version: 1` and "
                                                    "`sites`")])
        if not isinstance(data, dict):
            raise SourceError([self.doc.problem((), "the servers file is a mapping with "
                                                    "`version: 1` at the top")])
        self.shape(_Top, data, ())
        raw_sites = data.get("sites")
        raw_sites = raw_sites if isinstance(raw_sites, dict) else {}
        sites: dict[str, Site] = {}
        for name, spec in raw_sites.items():
            site = self.site(str(name), spec)
            if site is not None:
                sites[site.name] = site
        known_sites = {str(n) for n in raw_sites}
        groups = self.groups(_items(data.get("groups")), sites, known_sites)
        windows = self.windows(_items(data.get("maintenance")), groups,
                               _declared(_items(data.get("groups"))))
        if self.problems:
            raise SourceError(yamlsrc.by_line(self.problems))
        return Servers(MappingProxyType(sites), tuple(g for g, _ in groups), tuple(windows))

    # --- sites -------------------------------------------------------------------------

    def site(self, name: str, data: Any) -> Site | None:
        loc: Loc = ("sites", name)
        spec = self.shape(SiteSpec, {} if data is None else data, loc)
        if not NAME.fullmatch(name):
            self.add(loc, "a site name is 1 to 128 of A-Z a-z 0-9 _ . -")
            return None
        if spec is None:
            return None
        zones = tuple(spec.zones or (name,))
        for i, zone in enumerate(zones):
            if zone in zones[:i]:
                self.add((*loc, "zones", i), f"zone {zone!r} is listed twice")
        return Site(name, tuple(dict.fromkeys(spec.residency)), tuple(dict.fromkeys(zones)))

    # --- groups ------------------------------------------------------------------------

    def groups(self, items: Iterable[tuple[int, Any]], sites: Mapping[str, Site],
               known_sites: set[str]) -> list[tuple[Group, int]]:
        specs = [(i, s) for i, data in items
                 if (s := self.shape(GroupSpec, data, ("groups", i))) is not None]
        total = sum(len(s.servers) if s.servers else (s.count or 0) for _, s in specs)
        if total > MAX_SERVERS:
            self.add(("groups",), f"{total:,} servers declared; at most {MAX_SERVERS:,} "
                                  "per file")
            return []
        out: list[tuple[Group, int]] = []
        names: dict[str, int] = {}
        owner: dict[str, tuple[str, int]] = {}  # server -> group name, index
        for i, spec in specs:
            group = self.group(i, spec, sites, known_sites, names, owner)
            if group is not None:
                out.append((group, i))
        return out

    def group(self, i: int, spec: GroupSpec, sites: Mapping[str, Site],
              known_sites: set[str], names: dict[str, int],
              owner: dict[str, tuple[str, int]]) -> Group | None:
        loc: Loc = ("groups", i)
        ok = True
        if spec.name in names:
            self.add((*loc, "name"), f"group {spec.name!r} is already declared by "
                                     f"groups[{names[spec.name]}]")
            ok = False
        names.setdefault(spec.name, i)
        if spec.gpu not in GPU_MODELS:
            self.add((*loc, "gpu"), f"unknown GPU model {spec.gpu!r}"
                                    f"{suggest(spec.gpu, GPU_MODELS)}")
            ok = False
        zone = spec.zone
        site = sites.get(spec.site)
        if spec.site not in known_sites:
            self.add((*loc, "site"), f"unknown site {spec.site!r}"
                                     f"{suggest(spec.site, known_sites)}")
            ok = False
        elif site is None:
            ok = False  # the site has problems of its own
        elif zone is None and len(site.zones) > 1:
            self.add((*loc, "zone"), f"site {site.name!r} has several zones "
                                     f"({', '.join(site.zones)}): say which")
            ok = False
        elif zone is not None and zone not in site.zones:
            self.add((*loc, "zone"), f"site {site.name!r} has no zone {zone!r} (its zones: "
                                     f"{', '.join(site.zones)}){suggest(zone, site.zones)}")
            ok = False
        if spec.gpus % spec.slices:
            self.add((*loc, "slices"), f"{spec.slices} slices do not divide the server's "
                                       f"{spec.gpus} GPUs")
            ok = False
        servers = self.server_names(loc, spec)
        if servers is not None:
            self.unique_servers(i, spec, servers, owner)
        health = self.health((*loc, "health"), spec.health)
        if not ok or servers is None or health is False or site is None:
            return None
        return Group(spec.name, site.name, zone or site.zones[0], spec.gpu, spec.gpus,
                     spec.vcpus, spec.memory_gb, spec.price_per_gpu_hour, servers, health,
                     spec.slices)

    def server_names(self, loc: Loc, spec: GroupSpec) -> tuple[str, ...] | None:
        if spec.servers is not None and spec.count is not None:
            self.add((*loc, "count"), "give either servers (names) or count with "
                                      "name_prefix, not both")
            return None
        if spec.servers is not None:
            if spec.name_prefix is not None:
                self.add((*loc, "name_prefix"), "name_prefix goes with count, not servers")
                return None
            return tuple(spec.servers)
        if spec.count is None:
            self.add((*loc, "servers"), "required: servers (a list of names), or count "
                                        "with name_prefix")
            return None
        if spec.name_prefix is None:
            self.add((*loc, "name_prefix"), "required with count: the servers are named "
                                            "name_prefix followed by 01, 02, ...")
            return None
        width = max(2, len(str(spec.count)))
        if len(spec.name_prefix) + width > 128:
            self.add((*loc, "name_prefix"), f"too long: names are at most 128 characters, "
                                            f"and the numbers take {width}")
            return None
        return tuple(f"{spec.name_prefix}{n:0{width}d}" for n in range(1, spec.count + 1))

    def health(self, loc: Loc, spec: HealthSpec | None) -> Health | Literal[False] | None:
        """The group's health source, None for none (every server is up), False for a
        problem (added)."""
        if spec is None:
            return None
        if (spec.prometheus is None) == (spec.file is None):
            self.add(loc, "give one of prometheus (an endpoint template) or file")
            return False
        if spec.prometheus is not None:
            problem = _template_problem(spec.prometheus)
            if problem:
                self.add((*loc, "prometheus"), problem)
                return False
            return Health(prometheus=spec.prometheus)
        assert spec.file is not None
        path = spec.file if spec.file.is_absolute() or self.base is None else \
            self.base / spec.file
        return Health(file=path)

    def unique_servers(self, i: int, spec: GroupSpec, servers: tuple[str, ...],
                       owner: dict[str, tuple[str, int]]) -> None:
        reported = 0
        for j, server in enumerate(servers):
            first = owner.get(server)
            if first is None:
                owner[server] = (spec.name, i)
                continue
            reported += 1
            if reported > MAX_PROBLEMS_PER_GROUP:
                continue
            loc: Loc = ("groups", i, "servers", j) if spec.servers else ("groups", i, "count")
            where = "this group" if first[1] == i else f"group {first[0]!r} (groups[{first[1]}])"
            self.add(loc, f"server {server!r} is already declared in {where}")
        if reported > MAX_PROBLEMS_PER_GROUP:
            loc = ("groups", i, "servers") if spec.servers else ("groups", i, "count")
            self.add(loc, f"and {reported - MAX_PROBLEMS_PER_GROUP:,} more server names "
                          "already declared")

    # --- maintenance -------------------------------------------------------------------

    def windows(self, items: Iterable[tuple[int, Any]], groups: list[tuple[Group, int]],
                declared: tuple[set[str], set[str]]) -> list[Window]:
        """The maintenance windows. `declared`: the names of the groups and servers the
        file declares, valid or not (a window naming a group or server that has problems
        of its own is left out, and not reported as unknown)."""
        by_name = {g.name: g for g, _ in groups}
        servers = {s for g, _ in groups for s in g.servers}
        group_names, server_names = declared
        out = []
        for i, data in items:
            loc: Loc = ("maintenance", i)
            spec = self.shape(WindowSpec, data, loc)
            if spec is None:
                continue
            ok = True
            if spec.drain_until <= spec.drain_from:
                self.add((*loc, "drain_until"), "must be after drain_from")
                ok = False
            if (spec.servers is None) == (spec.group is None):
                self.add(loc, "give one of servers (names) or group")
                continue
            if spec.group is not None:
                group = by_name.get(spec.group)
                if group is None:
                    if spec.group not in group_names:
                        self.add((*loc, "group"), f"unknown group {spec.group!r}"
                                                  f"{suggest(spec.group, group_names)}")
                    continue
                names = frozenset(group.servers)
            else:
                assert spec.servers is not None
                names = frozenset(spec.servers)
                for j, server in enumerate(spec.servers):
                    if server in servers:
                        continue
                    ok = False
                    if server not in server_names:
                        self.add((*loc, "servers", j),
                                 f"unknown server {server!r}"
                                 f"{_suggest_server(server, server_names)}")
            if ok:
                out.append(Window(names, spec.drain_from, spec.drain_until,
                                  timedelta(minutes=spec.lead_minutes), spec.reason))
        return out


def _items(value: Any) -> list[tuple[int, Any]]:
    return list(enumerate(value)) if isinstance(value, list) else []


def _declared(items: Iterable[tuple[int, Any]]) -> tuple[set[str], set[str]]:
    """The group and server names the groups declare, read loosely (whatever their
    problems): a name, a list of servers, or a count and a prefix where they are there."""
    groups: set[str] = set()
    servers: set[str] = set()
    for _, data in items:
        if not isinstance(data, dict):
            continue
        if isinstance(data.get("name"), str):
            groups.add(data["name"])
        names, count, prefix = data.get("servers"), data.get("count"), data.get("name_prefix")
        if isinstance(names, list):
            servers.update(str(n) for n in names)
        elif isinstance(count, int) and isinstance(prefix, str) and 0 < count <= MAX_SERVERS:
            width = max(2, len(str(count)))
            servers.update(f"{prefix}{n:0{width}d}" for n in range(1, count + 1))
        if len(servers) > MAX_SERVERS:
            break
    return groups, servers


def _suggest_server(name: str, servers: set[str]) -> str:
    """A suggestion for an unknown server name; in a large fleet, among the servers that
    begin with the same letter (comparing with 100,000 names would take a while)."""
    if len(servers) > 2000:
        head = name[:1].lower()
        return suggest(name, [s for s in servers if s[:1].lower() == head][:2000])
    return suggest(name, servers)


def _template_problem(template: str) -> str | None:
    """Why `template` is not an http(s) URL template with `{server}` (None if it is)."""
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        return f"not a URL template: {exc}"
    if "server" not in fields or set(fields) != {"server"}:
        return "must hold {server}, and nothing else in braces, e.g. " \
               "http://{server}:9400/metrics"
    url = urlsplit(template.replace("{server}", "gpu-a01"))
    try:
        port_ok = url.port is None or url.port > 0
    except ValueError:
        port_ok = False
    if url.scheme not in ("http", "https") or not url.hostname or not port_ok or " " in template:
        return "must be an http:// or https:// URL, e.g. http://{server}:9400/metrics"
    return None
