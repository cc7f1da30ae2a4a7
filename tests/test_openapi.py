"""The OpenAPI document: valid 3.1, the same paths the app serves, served with the model's id."""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path

import httpx
import jsonschema
import pytest
from openapi_spec_validator import OpenAPIV31SpecValidator, validate

from mashbox.check import sse
from mashbox.server.app import create_app
from mashbox.server.state import ServerState

SPECS = Path(__file__).parent.parent / "specs" / "openapi.json"
METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}


def app_routes() -> set[tuple[str, str]]:
    """(method, path) of every route the app registers, in OpenAPI's path syntax; the HEAD
    and OPTIONS that werkzeug adds to every rule, and the static route, are left out."""
    app = create_app(ServerState(model_id="m", ctx=1024, slots=4))
    routes = set()
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        path = re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule)
        routes |= {(m.lower(), path) for m in rule.methods - {"HEAD", "OPTIONS"}}
    return routes


def doc_routes(doc: dict) -> set[tuple[str, str]]:
    return {(m, path) for path, item in doc["paths"].items() for m in item if m in METHODS}


def test_specs_file_is_the_shipped_one_and_valid():
    shipped = resources.files("mashbox").joinpath("openapi.json").read_text(encoding="utf-8")
    assert SPECS.read_text(encoding="utf-8") == shipped
    doc = json.loads(shipped)
    assert doc["openapi"].startswith("3.1")
    validate(doc, cls=OpenAPIV31SpecValidator)


def test_document_lists_exactly_the_routes_the_app_serves():
    doc = json.loads(SPECS.read_text(encoding="utf-8"))
    routes = doc_routes(doc)
    heads = {path for m, path in routes if m == "head"}
    assert routes - {("head", p) for p in heads} == app_routes()
    # A documented HEAD is one werkzeug answers on a GET route.
    assert {("get", p) for p in heads} <= app_routes()


def test_served_document_names_the_running_model(server):
    r = httpx.get(server.url + "/openapi.json")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/json")
    doc = r.json()
    validate(doc, cls=OpenAPIV31SpecValidator)
    assert doc_routes(doc) == doc_routes(json.loads(SPECS.read_text(encoding="utf-8")))
    assert "`tiny-llama.gguf`" in doc["info"]["description"]
    examples = [
        op["requestBody"]["content"]["application/json"]["example"]
        for item in doc["paths"].values()
        for op in item.values()
        if "requestBody" in op
    ]
    models = {e["model"] for e in examples if "model" in e}
    assert models == {"tiny-llama.gguf"}
    (param,) = doc["paths"]["/v1/models/{model}"]["get"]["parameters"]
    assert param["example"] == "tiny-llama.gguf"


SEED_000 = Path(__file__).parent.parent / "specs" / "seeds" / "000_1b8ec634bc296ce5.json"

# Every way specs/openapi.json departs from seed 000, one line each, with its reason. The test
# below finds the differences itself and holds them to exactly this list.
DELIBERATE = {
    ("route", "get", "/health/live"): "seed 004's liveness probe (200 while the process runs)",
    ("route", "get", "/v1/capabilities"): "seed 001's route, served as well",
    ("route", "get", "/v1/status"): "seed 001's route, served as well",
    ("route", "get", "/v1/openapi.json"): "seed 001's name for this document",
    ("route", "get", "/v1/chat/completions/ws"): "seed 001's chat WebSocket",
    ("route", "post", "/v1/embeddings"): "seed 001's embeddings",
    ("route", "post", "/v1/systemone"): "seed 004's typed decisions",
    ("route", "get", "/v1/limits"): "seed 004's limits",
    ("route", "post", "/tokenize"): "vLLM's tokenizer routes, for evaluation harnesses",
    ("route", "post", "/detokenize"): "vLLM's tokenizer routes, for evaluation harnesses",
    ("route", "get", "/tokenizer_info"): "vLLM's tokenizer routes, for evaluation harnesses",
    ("route", "post", "/infill"): "llama-server's fill in the middle, for editors",
    ("route", "post", "/completion"): "llama-server's own completion route, for its clients",
    ("route", "post", "/completions"): "llama-server's other name for /completion",
    ("route", "get", "/props"): "llama-server's server properties, for its clients",
    ("route", "post", "/apply-template"): "llama-server's chat template route, for /completion",
    ("required", "ModelList", "models"): "ollama-style clients read `models` beside `data`",
}


def seed_differences(ours: dict, seed: dict) -> set[tuple]:
    """Routes, statuses, schemas and fields where the two documents differ."""
    found = set()
    for method, path in doc_routes(ours) - doc_routes(seed):
        found.add(("route", method, path))
    for method, path in doc_routes(seed):
        if (method, path) not in doc_routes(ours):
            found.add(("missing route", method, path))
            continue
        statuses = set(seed["paths"][path][method].get("responses", {}))
        for status in statuses - set(ours["paths"][path][method].get("responses", {})):
            found.add(("missing status", method, path, status))
    schemas = ours["components"]["schemas"]
    for name, schema in seed["components"]["schemas"].items():
        if name not in schemas:
            found.add(("missing schema", name))
            continue
        mine = schemas[name]
        for field in set(schema.get("properties", {})) - set(mine.get("properties", {})):
            found.add(("missing field", name, field))
        for field, spec in schema.get("properties", {}).items():
            theirs = mine.get("properties", {}).get(field, {})
            enum = set(map(str, spec.get("enum", ()))) - set(map(str, theirs.get("enum", ())))
            if enum and "enum" in theirs:
                found.add(("missing enum values", name, field, tuple(sorted(enum))))
        for field in set(mine.get("required", ())) ^ set(schema.get("required", ())):
            found.add(("required", name, field))
    return found


def test_the_document_holds_seed_000_route_by_route():
    """Every seed 000 path, method, status code and schema field is in mashbox's document,
    its version is the contract's, and each difference is a deliberate one listed above."""
    ours = json.loads(SPECS.read_text(encoding="utf-8"))
    seed = json.loads(SEED_000.read_text(encoding="utf-8"))
    assert ours["info"]["version"] == seed["info"]["version"]
    assert seed_differences(ours, seed) == set(DELIBERATE)
    keys = "with `--api-key-file` or `MASHBOX_API_KEY`"
    assert keys in ours["info"]["description"] and "No API key is checked" not in json.dumps(ours)


STREAMS = {  # each streaming route, a short request
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8},
    "/v1/completions": {"prompt": "The capital of", "max_tokens": 8},
    "/v1/messages": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8},
    "/v1/responses": {"input": "Hi", "max_output_tokens": 8},
}


def field_matches(schema: dict, value: str, doc: dict) -> bool:
    """Whether an event's field matches its schema as a validator that reads
    `contentMediaType` and `contentSchema` would (schemathesis does): JSON text whose
    payload the content schema holds, or any branch of an anyOf."""
    if "anyOf" in schema:
        return any(field_matches(branch, value, doc) for branch in schema["anyOf"])
    plain = {k: v for k, v in schema.items() if k not in ("contentMediaType", "contentSchema")}
    if not jsonschema.Draft202012Validator(plain).is_valid(value):
        return False
    if schema.get("contentMediaType") != "application/json":
        return True
    try:
        payload = json.loads(value)
    except ValueError:
        return False
    content = {**schema["contentSchema"], "components": doc["components"]}
    return jsonschema.Draft202012Validator(content).is_valid(payload)


@pytest.mark.parametrize("path", sorted(STREAMS))
def test_every_event_of_a_stream_matches_the_document(server, path):
    """The event-stream schema each streaming route documents holds every event it sends,
    the chat and completion streams' closing `data: [DONE]` included."""
    doc = json.loads(SPECS.read_text(encoding="utf-8"))
    event = doc["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]
    fields = event["schema"]["properties"]
    body = {"model": "tiny-llama.gguf", "stream": True, **STREAMS[path]}
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    events, framing = sse.parse(r.text)
    assert events and not framing, framing
    for sent in events:
        if sent.name is not None:
            assert field_matches(fields["event"], sent.name, doc), sent
        assert field_matches(fields["data"], sent.data, doc), sent
