"""The OpenAPI document: valid 3.1, the same paths the app serves, served with the model's id."""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path

import httpx
from openapi_spec_validator import OpenAPIV31SpecValidator, validate

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
