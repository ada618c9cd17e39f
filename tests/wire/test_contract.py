"""The generated contract (`broker/wire/contract.py`): up to date, valid, and saying what the
daemon accepts.

* `docs/schemas/` and `docs/asyncapi.yaml` are what `python -m broker.wire.contract` writes
  now: a change to a payload type without regenerating fails here, naming the command.
* Every schema is a valid JSON Schema draft 2020-12 with its `$schema` and `$id`.
* `docs/asyncapi.yaml` validates against the AsyncAPI 3.0.0 JSON Schema (vendored with its
  provenance in tests/fixtures/asyncapi/), and its own references fit together.
* `docs/openapi.yaml` is valid OpenAPI 3.1 (openapi-spec-validator), names every HTTP route
  of the daemon, and refers to the same schema files.
* The request schemas accept what the daemon's validation (`broker.wire.validation`) accepts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import openapi_spec_validator
import pytest
import yaml
from openapi_spec_validator.validation.exceptions import OpenAPIValidationError
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

from broker.wire import contract, payloads, validation
from broker.wire.commands import VERBS

DOCS = Path(__file__).resolve().parents[2] / "docs"
ASYNCAPI_SCHEMAS = Path(__file__).resolve().parents[1] / "fixtures" / "asyncapi"


def test_the_generated_files_are_up_to_date() -> None:
    stale = list(contract.differences(DOCS))
    assert not stale, ("docs/ is not what broker/wire/payloads.py generates; run "
                       "`python -m broker.wire.contract` and commit the result:\n"
                       + "\n".join(stale))


def test_check_names_each_stale_file_and_the_command(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert contract.main(["--docs", str(tmp_path)]) == 0
    assert contract.main(["--check", "--docs", str(tmp_path)]) == 0
    status = tmp_path / "schemas" / "status.schema.json"
    status.write_text(status.read_text().replace('"online"', '"up"'))
    (tmp_path / "schemas" / "old.schema.json").write_text("{}")
    (tmp_path / "asyncapi.yaml").unlink()
    capsys.readouterr()
    assert contract.main(["--check", "--docs", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "status.schema.json: differs" in err and '"up"' in err
    assert "asyncapi.yaml: missing" in err and "old.schema.json: no longer generated" in err
    assert "run: python -m broker.wire.contract" in err
    assert contract.main(["--docs", str(tmp_path)]) == 0
    assert not (tmp_path / "schemas" / "old.schema.json").exists()
    assert list(contract.differences(tmp_path)) == []


@pytest.mark.parametrize("name", [p.name for p in contract.PAYLOADS])
def test_every_schema_is_draft_2020_12_with_its_id(name: str) -> None:
    doc = json.loads((DOCS / "schemas" / f"{name}.schema.json").read_text())
    assert doc["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert doc["$id"] == f"urn:gpubroker:v1:schema:{name}"
    assert doc["title"] and doc["type"] == "object"
    jsonschema.Draft202012Validator.check_schema(doc)
    strict = contract.schema(name, strict=True)
    jsonschema.Draft202012Validator.check_schema(strict)
    if contract.BY_NAME[name].sent:
        # Published open to additions, checked closed: the only difference.
        assert "additionalProperties" not in json.dumps(doc) or name == "event"
        assert strict["additionalProperties"] is False
        assert contract._open(strict) == doc
    else:
        assert strict == doc and "additionalProperties" not in doc


# --- AsyncAPI -------------------------------------------------------------------------------


def asyncapi_doc() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((DOCS / "asyncapi.yaml").read_text())
    return doc


def test_the_asyncapi_document_follows_the_asyncapi_3_schema() -> None:
    resources = []
    for path in ASYNCAPI_SCHEMAS.rglob("*.json"):
        schema = json.loads(path.read_text())
        resources.append((schema["$id"], Resource.from_contents(schema,
                                                                default_specification=DRAFT7)))
    registry: Registry[Any] = Registry().with_resources(resources)
    root = registry.contents("http://asyncapi.com/definitions/3.0.0/asyncapi.json")
    validator = jsonschema.Draft7Validator(root, registry=registry)
    errors = sorted(validator.iter_errors(asyncapi_doc()), key=lambda e: list(e.path))
    assert [f"{e.json_path}: {e.message[:200]}" for e in errors] == []


def test_the_asyncapi_schema_catches_a_broken_document() -> None:
    """The vendored schema is wired up: a send/receive typo is an error."""
    resources = [(s["$id"], Resource.from_contents(s, default_specification=DRAFT7))
                 for s in (json.loads(p.read_text()) for p in ASYNCAPI_SCHEMAS.rglob("*.json"))]
    registry: Registry[Any] = Registry().with_resources(resources)
    root = registry.contents("http://asyncapi.com/definitions/3.0.0/asyncapi.json")
    doc = asyncapi_doc()
    doc["operations"]["sendStatus"]["action"] = "publish"  # the 2.x word
    assert not jsonschema.Draft7Validator(root, registry=registry).is_valid(doc)


def _refs(node: Any, at: str = "#") -> list[tuple[str, str]]:
    if isinstance(node, dict):
        out = [(at, node["$ref"])] if isinstance(node.get("$ref"), str) else []
        for k, v in node.items():
            out += _refs(v, f"{at}/{k}")
        return out
    if isinstance(node, list):
        return [r for i, v in enumerate(node) for r in _refs(v, f"{at}/{i}")]
    return []


def _pointer(doc: Any, pointer: str) -> Any:
    for part in pointer.lstrip("#/").split("/"):
        doc = doc[part.replace("~1", "/").replace("~0", "~")]
    return doc


def test_every_reference_in_the_asyncapi_document_resolves() -> None:
    doc = asyncapi_doc()
    refs = _refs(doc)
    assert refs
    for where, ref in refs:
        if ref.startswith("#/"):
            _pointer(doc, ref)  # KeyError names what is missing
        else:
            assert (DOCS / ref).is_file(), f"{where}: {ref} is not a file beside the document"


def test_channels_operations_and_messages_fit_together() -> None:
    doc = asyncapi_doc()
    channels, operations = doc["channels"], doc["operations"]
    for name, channel in channels.items():
        assert channel["address"].startswith(contract.PREFIX + "/"), name
        used = set(re.findall(r"\{(\w+)\}", channel["address"]))
        assert used == set(channel.get("parameters", {})), name
        for message in channel["messages"].values():
            _pointer(doc, message["$ref"])
    for name, op in operations.items():
        channel = op["channel"]["$ref"]
        assert op["action"] in ("send", "receive")
        assert op["action"] == ("receive" if "Requests" in channel else "send"), name
        for m in op["messages"]:
            assert m["$ref"].startswith(channel + "/messages/"), name
        reply = op.get("reply")
        if reply:
            for m in reply["messages"]:
                assert m["$ref"].startswith(reply["channel"]["$ref"] + "/messages/"), name
    # Every channel is used by an operation; every event type has its message.
    assert {op["channel"]["$ref"] for op in operations.values()} == {
        f"#/channels/{c}" for c in channels}
    names = {m["name"] for m in doc["components"]["messages"].values()}
    assert {f"event.{k}" for k in payloads.EVENTS} <= names
    assert {f"request.{v}" for v in ("place", "renew", "release", "report")} <= names
    params = doc["components"]["parameters"]
    assert params["type"]["enum"] == list(payloads.EVENT_TYPES)
    assert params["opsType"]["enum"] == list(payloads.OPS_EVENT_TYPES)
    retained = {name: op["bindings"]["mqtt"].get("retain") for name, op in operations.items()
                if op["action"] == "send"}
    assert retained == {"sendStatus": True, "sendEvents": False, "sendOpsEvents": False,
                        "sendLeaseStates": True, "sendCapacity": True, "sendReplies": False}


# --- OpenAPI -------------------------------------------------------------------------------


def openapi_doc() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((DOCS / "openapi.yaml").read_text())
    return doc


def test_the_openapi_document_is_valid_openapi_3_1() -> None:
    """openapi-spec-validator, following the references into docs/schemas/."""
    base = (DOCS / "openapi.yaml").as_uri()
    doc = openapi_doc()
    assert doc["openapi"] == "3.1.0"
    openapi_spec_validator.validate(doc, base_uri=base)
    broken = openapi_doc()
    broken["paths"]["/livez"]["get"]["responses"]["200"]["description"] = 5
    with pytest.raises(OpenAPIValidationError):
        openapi_spec_validator.validate(broken, base_uri=base)
    unresolved = openapi_doc()
    unresolved["components"]["schemas"]["offer"]["$ref"] = "./schemas/nope.schema.json"
    with pytest.raises(Exception, match=r"nope\.schema\.json"):
        openapi_spec_validator.validate(unresolved, base_uri=base)


def test_the_openapi_paths_are_the_http_routes_and_use_the_payload_schemas() -> None:
    from broker.edges.http import build_app

    doc = openapi_doc()
    app = build_app(object())  # type: ignore[arg-type]
    routes = {(r.method.lower(), r.resource.canonical) for r in app.router.routes()
              if r.resource is not None and r.method != "HEAD"}
    documented = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    assert documented == routes
    # One request path per verb MQTT takes, with that verb's schema and answers.
    for verb in VERBS:
        op = doc["paths"][f"/v1/requests/{{scheduler}}/{verb}"]["post"]
        body = op["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/request.{verb}"}
        assert op["security"] == [{"bearer": []}]
        ok = op["responses"]["200"]["content"]["application/json"]["schema"]
        answers = [r["$ref"] for r in ok.get("oneOf", [ok])]
        assert answers == [f"#/components/schemas/event.{k}" for k in contract._ANSWERS[verb]
                           if k != "request.invalid"]
        invalid = op["responses"]["422"]["content"]["application/json"]["schema"]
        assert invalid == {"$ref": "#/components/schemas/event.request.invalid"}
    # The component schemas are the JSON Schema files, not copies of them.
    schemas = doc["components"]["schemas"]
    for p in contract.PAYLOADS:
        if p.name != "event":
            assert schemas[p.name] == {"$ref": f"./schemas/{p.name}.schema.json"}
    for where, ref in _refs(doc):
        if ref.startswith("#/"):
            _pointer(doc, ref)
        else:
            assert (DOCS / ref).is_file(), f"{where}: {ref}"


def test_check_covers_the_openapi_document(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert contract.main(["--docs", str(tmp_path)]) == 0
    assert (tmp_path / "openapi.yaml").read_text() == (DOCS / "openapi.yaml").read_text()
    (tmp_path / "openapi.yaml").write_text("openapi: 3.0.0\n")
    capsys.readouterr()
    assert contract.main(["--check", "--docs", str(tmp_path)]) == 1
    assert "openapi.yaml: differs" in capsys.readouterr().err


# --- the request schemas say what the daemon accepts --------------------------------------

GOOD_PLACE = {"request_id": "r1", "gpu": "H100-80GB", "gpus": 8}
PLACE_CASES = [
    GOOD_PLACE,
    GOOD_PLACE | {"gpu": ["H100-80GB", "A100-80GB"], "gang": False, "market": "spot",
                  "max_price_per_gpu_hour": 3, "clouds": ["aws"], "regions": ["us-east-1"],
                  "team": "t", "duration_hours": 0.5, "lease_seconds": 60,
                  "labels": {"k": "v"}, "unknown": {"ignored": True}},
    GOOD_PLACE | {"market": None, "team": None, "labels": None},
    {"gpu": "T4", "gpus": 1},
    GOOD_PLACE | {"request_id": ""},
    GOOD_PLACE | {"request_id": "x" * 129},
    GOOD_PLACE | {"request_id": 7},
    GOOD_PLACE | {"gpu": []},
    GOOD_PLACE | {"gpu": ["T4"] * 17},
    GOOD_PLACE | {"gpu": "x" * 65},
    GOOD_PLACE | {"gpus": 0},
    GOOD_PLACE | {"gpus": 4097},
    GOOD_PLACE | {"gpus": "8"},
    GOOD_PLACE | {"gpus": True},
    GOOD_PLACE | {"gang": "yes"},
    GOOD_PLACE | {"market": "reserved"},
    GOOD_PLACE | {"max_price_per_gpu_hour": 0},
    GOOD_PLACE | {"clouds": []},
    GOOD_PLACE | {"duration_hours": 24 * 366 + 1},
    GOOD_PLACE | {"lease_seconds": 7 * 86400 + 1},
    GOOD_PLACE | {"labels": {"k": 1}},
    GOOD_PLACE | {"labels": {"": "v"}},
    GOOD_PLACE | {"labels": {f"k{i}": "v" for i in range(65)}},
    ["not", "an", "object"],
]
REPORT_CASES = [
    {"lease_id": "L-1", "kind": "interrupted"},
    {"lease_id": "L-1", "kind": "unhealthy", "detail": "x" * 1024},
    {"lease_id": "L-1", "kind": "unhealthy", "detail": "x" * 1025},
    {"lease_id": "L-1", "kind": "preempted"},
    {"lease_id": "", "kind": "interrupted"},
    {"kind": "interrupted"},
]
LEASE_CASES = [{"lease_id": "L-1"}, {"lease_id": "L-1", "extra": 1}, {"lease_id": ""},
               {"lease_id": None}, {}]


@pytest.mark.parametrize(("name", "parse", "doc"), [
    *[("request.place", lambda b: validation.parse_place("s", b), d) for d in PLACE_CASES],
    *[("request.quote", lambda b: validation.parse_quote("s", b), d) for d in PLACE_CASES],
    *[("request.report", validation.parse_report, d) for d in REPORT_CASES],
    *[("request.renew", validation.parse_lease_ref, d) for d in LEASE_CASES],
    *[("request.release", validation.parse_lease_ref, d) for d in LEASE_CASES],
])
def test_a_request_schema_accepts_what_the_daemon_accepts(name: str, parse: Any,
                                                          doc: Any) -> None:
    # Not among the cases: `8.0` for an integer, which JSON Schema counts as one and the
    # daemon does not (docs/contract.md §4 says to write integers without a fraction).
    schema = json.loads((DOCS / "schemas" / f"{name}.schema.json").read_text())
    accepted = not isinstance(parse(json.dumps(doc).encode()), validation.Invalid)
    assert jsonschema.Draft202012Validator(schema).is_valid(doc) == accepted
