"""docs/contract.md holds: its examples validate, and it names what the code has.

* Every ```json block in docs/ follows the schema its `<!-- schema: NAME -->` comment
  names (what the daemon sends, closed to unknown keys, as in the end-to-end tests); a
  ```yaml block under `<!-- config -->` is a configuration the daemon accepts.
* §6 names every configuration key, §7 every command, §8 every HTTP endpoint, §5 every
  event type, rejection code and failover reason; relative links resolve.
* The README links the contract, and nothing published links the private specification.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from contract_check import problem
from pydantic import BaseModel

from broker.cli.main import _parser
from broker.daemon.config import CloudsConfig, Config, parse_config
from broker.wire import contract, payloads

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CONTRACT = DOCS / "contract.md"

FENCE = re.compile(r"(?P<marker><!--[^\n]*-->\n)?```(?P<lang>\w+)\n(?P<body>.*?)\n```", re.S)
MARKER = re.compile(r"<!--\s*(schema:\s*(?P<schema>[\w.-]+)|(?P<config>config))\s*-->")


def blocks() -> Iterator[tuple[str, int, str, str | None, str]]:
    """(file, line, language, marker, body) of every fenced block in docs/*.md."""
    for path in sorted(DOCS.rglob("*.md")):
        text = path.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start("body"))
            yield (path.relative_to(ROOT).as_posix(), line, m["lang"], m["marker"], m["body"])


def marked(lang: str) -> list[Any]:
    return [pytest.param(f, marker, body, id=f"{f}:{line}")
            for f, line, language, marker, body in blocks() if language == lang]


@pytest.mark.parametrize(("where", "marker", "body"), marked("json"))
def test_every_json_example_parses_and_follows_its_schema(where: str, marker: str | None,
                                                          body: str) -> None:
    m = MARKER.fullmatch((marker or "").strip())
    assert m is not None and m["schema"], (
        f"{where}: put `<!-- schema: NAME -->` on the line above the example; NAME is one "
        f"of {sorted(contract.BY_NAME)}")
    name = m["schema"]
    assert name in contract.BY_NAME, f"{where}: no schema {name!r}"
    doc = json.loads(body)
    assert problem(name, doc) is None


@pytest.mark.parametrize(("where", "marker", "body"), marked("yaml"))
def test_every_configuration_example_is_accepted(where: str, marker: str | None,
                                                 body: str) -> None:
    m = MARKER.fullmatch((marker or "").strip())
    if m is None or not m["config"]:
        pytest.skip("not marked <!-- config -->")
    parse_config(body, where)


def test_the_examples_cover_every_event_type_and_request() -> None:
    names = {MARKER.fullmatch(marker.strip())["schema"]  # type: ignore[index]
             for _, _, lang, marker, _ in blocks() if lang == "json" and marker}
    assert {"request.place", "request.renew", "request.report", "status", "lease-state",
            "capacity", "offer"} <= names
    # lease.released has the shape of lease.expired; both share one example.
    assert {f"event.{k}" for k in payloads.EVENTS} - {"event.lease.released"} <= names


def section(number: int) -> str:
    text = CONTRACT.read_text(encoding="utf-8")
    m = re.search(rf"^## {number}\. .*?(?=^## |\Z)", text, re.S | re.M)
    assert m is not None, f"docs/contract.md has no section {number}"
    return m.group(0)


def keys(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    for name, field in model.model_fields.items():
        sub = next((a for a in (field.annotation, *getattr(field.annotation, "__args__", ()))
                    if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if sub is not None and sub is not CloudsConfig:
            yield from keys(sub, f"{prefix}{name}.")
        else:
            yield prefix + name


def test_every_configuration_key_is_documented() -> None:
    text = section(6)
    missing = [k for k in keys(Config) if f"`{k}`" not in text]
    for cloud, model in CloudsConfig.model_fields.items():
        sub = next(a for a in model.annotation.__args__  # type: ignore[union-attr]
                   if isinstance(a, type) and issubclass(a, BaseModel))
        missing += [f"clouds.{cloud}.{k}" for k in sub.model_fields
                    if f"`{k}`" not in text and f"`{cloud}.{k}`" not in text]
        assert f"`{cloud}`" in text or f"clouds.{cloud}" in text, cloud
    assert missing == []


def test_every_command_is_documented() -> None:
    text = section(7)
    commands = []
    for action in _parser()._subparsers._group_actions:  # type: ignore[union-attr]
        for name, sub in action.choices.items():
            nested = [a for a in sub._actions if a.__class__.__name__ == "_SubParsersAction"]
            commands += ([f"gpubroker {name} {s}" for a in nested for s in a.choices]
                         if nested else [f"gpubroker {name}"])
    missing = [c for c in commands if f"`{c}" not in text]
    assert commands and missing == []


def test_every_http_endpoint_is_documented() -> None:
    from broker.edges.http import build_app

    text = section(8)
    app = build_app(object())  # type: ignore[arg-type]
    routes = {f"{r.method} {r.resource.canonical}".replace("{scheduler}", "{S}")
              for r in app.router.routes() if r.resource is not None and r.method != "HEAD"}
    assert routes and [r for r in sorted(routes) if f"`{r}`" not in text] == []


def test_every_code_and_reason_is_explained() -> None:
    text = section(5)
    names = [*payloads.EVENTS, *(payloads.event_type(k) for k in payloads.EVENTS)]
    names += [c for c in payloads.RejectCodeName.__args__]  # type: ignore[attr-defined]
    names += [r for r in payloads.FailoverReasonName.__args__]  # type: ignore[attr-defined]
    assert [n for n in names if f"`{n}`" not in text] == []


def test_links_resolve_and_the_readme_links_the_contract() -> None:
    for path in [*DOCS.rglob("*.md"), ROOT / "README.md"]:
        text = path.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" in target:
                continue
            assert (path.parent / target).exists(), f"{path.name}: link to {target}"
    assert "](docs/contract.md)" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_nothing_published_points_at_the_private_specification() -> None:
    private = "/".join(("..", "shared"))
    for path in [*DOCS.rglob("*"), *ROOT.glob("*.md"), *(ROOT / "deploy").rglob("*")]:
        if path.is_file():
            assert private not in path.read_text(encoding="utf-8", errors="replace"), path


def _rate(x: float) -> str:
    """A hazard per hour as the README writes it: 4 significant digits, `3.468e-5`."""
    mantissa, exponent = f"{x:.3e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def hazard_table() -> str:
    """The README's band → hazard table, from the one interruption model."""
    from adapters.hazard import WINDOW_HOURS, band_share, hazard_from_band, hazard_from_percent
    aws, azure, ali = WINDOW_HOURS["aws"], WINDOW_HOURS["azure"], WINDOW_HOURS["alibaba"]
    rows = [f"| share reclaimed | AWS advisor band | λ /h ({aws:g} h) | Azure eviction band "
            f"| λ /h ({azure:g} h) | Alibaba release rate | λ /h ({ali:g} h) |",
            "|---|---|---|---|---|---|---|"]
    bands = (("0–5 %", "<5%", "0-5"), ("5–10 %", "5-10%", "5-10"),
             ("10–15 %", "10-15%", "10-15"), ("15–20 %", "15-20%", "15-20"),
             ("over 20 %", ">20%", "20+"))
    for words, aws_band, azure_band in bands:
        share = band_share(aws_band)
        assert share is not None and share == band_share(azure_band)
        pct = f"{share * 100:g} %"
        a, z = hazard_from_band(aws_band, aws), hazard_from_band(azure_band, azure)
        assert a is not None and z is not None
        rows.append(f"| {words}, read as {pct} | `{aws_band}` | {_rate(a)} | `{azure_band}` "
                    f"| {_rate(z)} | {pct} | {_rate(hazard_from_percent(share * 100, ali))} |")
    rows.append("")
    rows.append("| Alibaba band (no rate given) | read as | λ /h (720 h) |")
    rows.append("|---|---|---|")
    for band in ("0-3%", "3-5%", "5-10%", "10-100%"):
        share = band_share(band)
        rate = hazard_from_band(band, ali)
        assert share is not None and rate is not None
        rows.append(f"| `{band}` | {share * 100:g} % | {_rate(rate)} |")
    return "\n".join(rows) + "\n"


def test_the_readme_hazard_table_is_the_interruption_models() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert hazard_table() in text
    # GCP's estimated uptimes, and the AWS bands the last two stand beside
    from adapters.hazard import WINDOW_HOURS, hazard_from_band, hazard_from_uptime
    hours = (7, 24, 7 * 24, 30 * 24, 73 * 24, 2.3 * 8760)
    rates = [_rate(hazard_from_uptime(h)) for h in hours]
    rates[-2] += " (≈ AWS `>20%`)"
    rates[-1] += " (≈ AWS `<5%`)"
    assert "| λ /h | " + " | ".join(rates) + " |" in text
    for band, h in ((">20%", 73 * 24), ("<5%", 2.3 * 8760)):
        aws = hazard_from_band(band, WINDOW_HOURS["aws"])
        assert aws is not None and abs(hazard_from_uptime(h) / aws - 1) < 0.01


def test_the_risk_levels_table_is_the_presets() -> None:
    # README's table and the example policy's comment give the values of RISK_PRESETS.
    from policies.risk import RISK_PRESETS
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    example = (ROOT / "deploy" / "policy.example.yaml").read_text(encoding="utf-8")
    for level, w in RISK_PRESETS.items():
        values = [f"{x:g}" for x in w]
        assert f"| `{level}` | {', '.join(values)} |" in readme, level
        line = next(ln for ln in example.splitlines() if ln.startswith(f"#   {level}"))
        assert re.findall(r"\d+(?:\.\d+)?", line)[:3] == values, line


def test_the_restore_cap_in_the_docs_is_the_constant() -> None:
    from broker.daemon.assembly.tasks import RESTORE_ENDED_MAX
    cap = f"{RESTORE_ENDED_MAX:,}"
    assert f"{cap} most recent" in (ROOT / "README.md").read_text(encoding="utf-8")
    contract = (ROOT / "docs" / "contract.md").read_text(encoding="utf-8")
    assert contract.count(f"{cap} most recent at most") == 2
