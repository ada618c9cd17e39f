"""The published documents agree with themselves and with the code: every `cloud` enum is
the one list of clouds; every example in the generated AsyncAPI (and OpenAPI) document
follows its schema; `null` means the default for every optional request field, as §4.1
says. (The JSON examples of docs/contract.md: tests/test_docs.py.)"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from contract_check import problem

from broker.model import CLOUDS, scheduler_id_problem
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


# --- every example of the generated AsyncAPI and OpenAPI documents ----------------------

SCHEMA_FILE = "./schemas/"


def _resolve(doc: Any, schema: Any) -> Any:
    """A schema with in-document `$ref`s followed: the published schema's name (a
    `./schemas/<name>.schema.json` reference), or the schema itself."""
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str):
        ref = schema["$ref"]
        if ref.startswith(SCHEMA_FILE):
            return ref.removeprefix(SCHEMA_FILE).removesuffix(".schema.json")
        assert ref.startswith("#/"), ref
        schema = doc
        for part in ref[2:].split("/"):
            schema = schema[part.replace("~1", "/").replace("~0", "~")]
    if isinstance(schema, dict) and "schemaFormat" in schema:  # AsyncAPI multi-format
        return _resolve(doc, schema["schema"])
    return schema


def follows(document: Any, schema: Any, example: Any) -> str | None:
    target = _resolve(document, schema)
    if isinstance(target, str):
        return problem(target, example)
    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(target).iter_errors(example))
    return None if error is None else error.message


def examples(document: Any, where: str = "") -> Iterator[tuple[str, Any, Any]]:
    """(where, schema, example) of every example in an AsyncAPI or OpenAPI document:
    media types and parameters (`schema` with `example` / `examples`), AsyncAPI
    messages (`payload` with `examples: [{payload}]`), AsyncAPI parameters (`enum`
    with `examples`), and the MQTT binding's `lastWill` (a `status`)."""
    if isinstance(document, list):
        for i, item in enumerate(document):
            yield from examples(item, f"{where}/{i}")
        return
    if not isinstance(document, dict):
        return
    if "schema" in document and "example" in document:
        yield where, document["schema"], document["example"]
    if "schema" in document and isinstance(document.get("examples"), dict):  # OpenAPI
        for name, ex in document["examples"].items():
            yield f"{where}/examples/{name}", document["schema"], ex.get("value")
    if "payload" in document and isinstance(document.get("examples"), list):  # AsyncAPI
        for i, ex in enumerate(document["examples"]):
            if "payload" in ex:
                yield f"{where}/examples/{i}", document["payload"], ex["payload"]
    if "enum" in document and isinstance(document.get("examples"), list):
        for i, ex in enumerate(document["examples"]):
            yield f"{where}/examples/{i}", {"enum": document["enum"]}, ex
    if isinstance(document.get("lastWill"), dict):
        will = document["lastWill"]
        assert will["topic"].endswith("/status"), where
        yield f"{where}/lastWill", {"$ref": SCHEMA_FILE + "status.schema.json"}, \
            json.loads(will["message"])
    for key, value in document.items():
        yield from examples(value, f"{where}/{key}")


def generated_api_documents() -> list[Any]:
    return [pytest.param(name, id=name) for name in ("asyncapi.yaml", "openapi.yaml")
            if (DOCS / name).is_file()]


@pytest.mark.parametrize("name", generated_api_documents())
def test_every_example_of_the_generated_api_documents_follows_its_schema(name: str) -> None:
    document = yaml.safe_load((DOCS / name).read_text(encoding="utf-8"))
    found = list(examples(document))
    if name == "asyncapi.yaml":
        assert any(where.endswith("/lastWill") for where, _, _ in found)
    wrong = [(where, why) for where, schema, example in found
             if (why := follows(document, schema, example)) is not None]
    assert wrong == []


@pytest.mark.parametrize("name", generated_api_documents())
def test_the_scheduler_id_examples_are_valid_scheduler_ids(name: str) -> None:
    document = yaml.safe_load((DOCS / name).read_text(encoding="utf-8"))
    parameter = document["components"]["parameters"]["scheduler"]
    listed = parameter.get("examples", [])
    shown = [*(listed if isinstance(listed, list)
               else [ex.get("value") for ex in listed.values()]),
             *([parameter["example"]] if "example" in parameter else [])]
    assert shown or name != "asyncapi.yaml"
    assert [s for s in shown if isinstance(s, str) and scheduler_id_problem(s)] == []


def test_every_inline_json_body_of_the_contract_follows_its_schema() -> None:
    """The JSON bodies written inline in docs/contract.md (`{"error": "no such lease"}`)
    are HTTP error bodies: `{"error": string}` (OpenAPI's `error` schema, when the
    document is there)."""
    text = (DOCS / "contract.md").read_text(encoding="utf-8")
    schema: Any = {"type": "object", "required": ["error"],
                   "properties": {"error": {"type": "string"}}}
    openapi = DOCS / "openapi.yaml"
    document: Any = None
    if openapi.is_file():
        document = yaml.safe_load(openapi.read_text(encoding="utf-8"))
        schema = document["components"]["schemas"]["error"]
    bodies = []
    for span in re.findall(r"`(\{[^`]*\})`", text):
        try:
            bodies.append(json.loads(span))
        except ValueError:
            continue  # a shape (`{"lease_id"}`), not a body
    assert len(bodies) >= 3
    assert [b for b in bodies if follows(document, schema, b) is not None] == []
