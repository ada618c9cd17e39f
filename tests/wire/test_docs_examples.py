"""The published documents agree with themselves and with the code: every `cloud` enum is
the one list of clouds; every example in the generated AsyncAPI (and OpenAPI) document
follows its schema. (The JSON examples of docs/contract.md: tests/test_docs.py.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from broker.model import CLOUDS
from broker.wire import validation

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def generated() -> Iterator[tuple[str, Any]]:
    """(file, document) of every generated document under docs/."""
    for path in sorted((DOCS / "schemas").glob("*.schema.json")):
        yield path.name, json.loads(path.read_text(encoding="utf-8"))
    for name in ("asyncapi.yaml", "openapi.yaml"):
        path = DOCS / name
        if path.is_file():
            yield name, yaml.safe_load(path.read_text(encoding="utf-8"))


def cloud_enums(node: Any, where: str = "") -> Iterator[tuple[str, list[Any]]]:
    """(path, enum) of every enum under a key naming a cloud (`cloud`, `clouds`)."""
    if isinstance(node, dict):
        for key, value in node.items():
            here = f"{where}/{key}"
            if key in ("cloud", "clouds") and isinstance(value, dict):
                for sub in (value, value.get("items"), value.get("schema")):
                    if isinstance(sub, dict) and "enum" in sub:
                        yield here, sub["enum"]
            yield from cloud_enums(value, here)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from cloud_enums(value, f"{where}/{i}")


def test_every_cloud_enum_is_the_one_list_of_clouds() -> None:
    found = [(f"{name}{where}", enum) for name, doc in generated()
             for where, enum in cloud_enums(doc)]
    names = {where.split("/", 1)[0] for where, _ in found}
    assert {"asyncapi.yaml", "placement.schema.json", "capacity.schema.json",
            "offer.schema.json"} <= names
    assert [(where, enum) for where, enum in found if enum != list(CLOUDS)] == []
    assert "private" in CLOUDS


@pytest.mark.parametrize("name", ["asyncapi.yaml"])
def test_the_asyncapi_cloud_parameter_names_private(name: str) -> None:
    doc = yaml.safe_load((DOCS / name).read_text(encoding="utf-8"))
    assert doc["components"]["parameters"]["cloud"]["enum"] == list(CLOUDS)


PLACE = {"request_id": "r-1", "gpu": "T4", "gpus": 1}
REPORT = {"lease_id": "L-1", "kind": "interrupted"}


def _body(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc).encode()


@pytest.mark.parametrize("field", [name for name, f in validation.PlacePayload.model_fields
                                   .items() if not f.is_required()])
def test_null_for_an_optional_place_field_means_its_default(field: str) -> None:
    """§4.1: "`null` for an optional field means its default" — `gang` and `max_parts`
    too, whose default is a value."""
    assert validation.parse_place("s", _body(PLACE | {field: None})) == \
        validation.parse_place("s", _body(PLACE))


@pytest.mark.parametrize("field", [name for name, f in validation.ReportPayload.model_fields
                                   .items() if not f.is_required()])
def test_null_for_an_optional_report_field_means_its_default(field: str) -> None:
    assert validation.parse_report(_body(REPORT | {field: None})) == \
        validation.parse_report(_body(REPORT))


def test_null_for_a_required_field_is_refused() -> None:
    answer = validation.parse_place("s", _body(PLACE | {"gpus": None}))
    assert isinstance(answer, validation.Invalid)
    assert [e["field"] for e in answer.errors] == ["gpus"]
