"""LocalEngine's surfaces (seed 001): capabilities, status, openapi, Anthropic model list,
embeddings; each GET validated against the seed's schemas."""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import anthropic
import httpx
import jsonschema
import numpy as np
import openai
import pytest
import trio

SEED = Path(__file__).resolve().parents[1] / "specs" / "seeds" / "001_b2eeb40abd5bde33.json"


@pytest.fixture(scope="module")
def seed_schemas():
    """Seed 001, as the repository keeps it (specs/seeds/, copied from the contract)."""
    return json.loads(SEED.read_text())["components"]["schemas"]


def check(schema: dict, value) -> None:
    jsonschema.validate(value, schema)


def test_capabilities_come_from_the_routing_table(server, seed_schemas):
    body = httpx.get(server.url + "/v1/capabilities").json()
    check(seed_schemas["Capabilities"], body)
    routes = {(r["method"], r["path"]) for r in body["routes"]}
    doc = httpx.get(server.url + "/openapi.json").json()
    documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert documented <= routes
    assert ("POST", "/v1/embeddings") in routes and ("GET", "/v1/capabilities") in routes


def test_status_and_openapi(server, seed_schemas):
    status = httpx.get(server.url + "/v1/status").json()
    check(seed_schemas["Status"], status)
    assert status == {"runtime": "localengine-llama", "ready": True, "local_api": "running",
                      "active_model": "tiny-llama.gguf"}  # fmt: skip
    doc = httpx.get(server.url + "/v1/openapi.json").json()
    check(seed_schemas["RuntimeOpenAPI"], doc)
    assert doc == httpx.get(server.url + "/openapi.json").json()


def test_anthropic_model_list(server, seed_schemas):
    body = httpx.get(server.url + "/v1/models", headers={"anthropic-version": "2023-06-01"}).json()
    check(seed_schemas["AnthropicModelList"], body)
    assert body["data"][0]["id"] == "tiny-llama.gguf" and body["has_more"] is False
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny-llama.gguf"]
    assert httpx.get(server.url + "/v1/models").json()["object"] == "list"


def embed(url: str, inputs, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/embeddings", json={"input": inputs, **extra}, timeout=60)


def test_embeddings_shape_norm_usage(server, seed_schemas):
    r = embed(server.url, ["Paris is the capital of France.", "The sea is wide."])
    assert r.status_code == 200, r.text
    body = r.json()
    check(seed_schemas["EmbeddingsResponse"], body)
    assert [d["index"] for d in body["data"]] == [0, 1]
    for d in body["data"]:
        assert len(d["embedding"]) == 64  # the tiny model's width
        assert math.isclose(math.sqrt(sum(x * x for x in d["embedding"])), 1.0, rel_tol=1e-6)
    single = embed(server.url, "Paris is the capital of France.").json()
    assert single["data"][0]["embedding"] == body["data"][0]["embedding"]
    tokens = [
        httpx.post(server.url + "/v1/completions", json={"prompt": t, "max_tokens": 1}).json()[
            "usage"
        ]["prompt_tokens"]
        for t in ("Paris is the capital of France.", "The sea is wide.")
    ]
    assert body["usage"] == {"prompt_tokens": sum(tokens), "total_tokens": sum(tokens)}


async def test_embeddings_do_not_depend_on_the_batch(server):
    text = "A sentence to embed, alone or in company."
    alone = embed(server.url, text).json()["data"][0]["embedding"]
    results = []
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:

        async def busy(i):
            await http.post("/v1/completions", json={"prompt": f"noise {i}", "max_tokens": 30})

        async def mine():
            r = await http.post("/v1/embeddings", json={"input": [text, "other", text]})
            results.append(r.json())

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(busy, i)
            nursery.start_soon(mine)
    data = results[0]["data"]
    assert data[0]["embedding"] == alone == data[2]["embedding"]


def test_the_official_sdk_gets_its_default_base64_vectors(server):
    """openai-python asks for base64 unless told otherwise, and decodes it: past seed 001's
    float only, the same vector as float32 (the float form's float64 values, rounded)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    text = "Paris is the capital of France."
    default = client.embeddings.create(model="tiny-llama.gguf", input=[text, "The sea."])
    floats = embed(server.url, [text, "The sea."]).json()["data"]
    for got, want in zip(default.data, floats, strict=True):
        assert got.embedding == [float(np.float32(x)) for x in want["embedding"]]
    raw = httpx.post(
        server.url + "/v1/embeddings", json={"input": text, "encoding_format": "base64"}
    ).json()["data"][0]["embedding"]
    decoded = np.frombuffer(base64.b64decode(raw), dtype="<f4")
    assert decoded.tolist() == default.data[0].embedding


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        ({"input": "x", "model": "text-embedding-3-small"}, 400, "model"),  # 001: under 400
        ({"input": [1, 2, 3]}, 400, "input"),
        ({"input": [[1, 2]]}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"input": ""}, 200, None),  # the BOS token alone (this vocabulary adds one)
        ({"input": "x", "dimensions": 8}, 400, "dimensions"),
        ({"input": "x", "encoding_format": "float16"}, 400, "encoding_format"),
        ({"input": "x", "encoding_format": {}}, 400, "encoding_format"),  # schemathesis' find
        ({"input": "x", "encoding_format": "float"}, 200, None),
    ],
)
def test_embedding_errors_name_the_field(server, body, status, field):
    r = httpx.post(server.url + "/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    if field:
        error = r.json()["error"]
        assert field in error["message"] or error.get("param") == field
        assert isinstance(error["code"], str) and error["code"]  # seed 001's Error
        if field == "model":
            assert error["code"] == "model_not_found"


def test_embedding_and_websocket_errors_in_seed_001s_shape(server, seed_schemas):
    """Seed 001's Error (a string code and a message) on every embeddings error, an input
    past the context as context_length_exceeded, and on WebSocket error frames."""
    from websockets.sync.client import connect

    long = httpx.post(server.url + "/v1/embeddings", json={"input": "word " * 5000})
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
    for body in ({"input": []}, {"input": "x", "model": "other"}, {"input": "word " * 5000}):
        check(seed_schemas["Error"], httpx.post(server.url + "/v1/embeddings", json=body).json())
    url = server.url.replace("http://", "ws://") + "/v1/chat/completions/ws"
    with connect(url) as ws:
        for frame in ("{not json", json.dumps({"messages": []})):
            ws.send(frame)
            error = json.loads(ws.recv(timeout=30))
            check(seed_schemas["Error"], error)
            assert error["status"] == 400 and error["error"]["code"] == "invalid_request"
