"""The GET routes and the chat WebSocket under fuzzed requests, keys and the Host/Origin guard
on: every answer a 2xx or a 4xx in the route's shape, never a 5xx or a hang; a WebSocket
frame, whatever it holds, gets a reply frame of its own and leaves the socket serving."""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.sync.client import connect

from conftest import ALLOWED_HOST, AUTH, EXAMPLES

GET_ROUTES = [
    "/", "/health", "/health/live", "/v1/health", "/v1/models", "/metrics", "/openapi.json",
    "/v1/openapi.json", "/v1/capabilities", "/v1/status", "/v1/limits", "/v1/nothing",
]  # fmt: skip
SETTINGS = settings(
    max_examples=EXAMPLES * 4,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
header_values = st.one_of(
    # Printable ASCII, no white space at either end (the client itself refuses that).
    st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40).map(
        lambda v: v.strip() or "x"
    ),
    st.sampled_from(["localhost", ALLOWED_HOST, "evil.example", "http://evil.example", "null",
                     "Bearer fuzz-key", "bearer fuzz-key", "Bearer wrong", "203.0.113.9"]),
)  # fmt: skip
headers = st.dictionaries(
    st.sampled_from(["Host", "Origin", "Authorization", "x-api-key", "X-Forwarded-For",
                     "anthropic-version", "Accept", "X-Session-Id"]),
    header_values,
    max_size=4,
)  # fmt: skip


@SETTINGS
@given(path=st.sampled_from(GET_ROUTES), query=st.text(max_size=20), extra=headers)
def test_any_get_is_answered_without_a_5xx(fuzz_server, path, query, extra):
    r = httpx.get(
        fuzz_server.url + path, params={"q": query}, headers={**AUTH, **extra}, timeout=30
    )
    assert r.status_code < 500, (path, extra, r.text[:300])
    if r.status_code in (401, 403):  # the guard, in the route's shape
        assert "error" in r.json()


frames = st.one_of(
    st.text(max_size=200),
    st.recursive(
        st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=20)),
        lambda inner: st.one_of(
            st.lists(inner, max_size=3),
            st.dictionaries(
                st.sampled_from(["messages", "role", "content", "stream", "max_tokens", "stop",
                                 "tools", "model", "n", "seed"]),
                inner,
                max_size=4,
            ),
        ),
        max_leaves=12,
    ).map(json.dumps),
    st.just("[" * 5000 + "]" * 5000),
)  # fmt: skip


@SETTINGS
@given(frame=frames)
def test_any_websocket_frame_gets_a_reply_and_the_socket_serves_on(fuzz_server, frame):
    url = fuzz_server.url.replace("http://", "ws://") + "/v1/chat/completions/ws?token=fuzz-key"
    ok = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    with connect(url, max_size=None) as ws:
        ws.send(frame)
        reply = ws.recv(timeout=60)
        while reply != "[DONE]" and json.loads(reply).get("object") == "chat.completion.chunk":
            reply = ws.recv(timeout=60)  # a streamed answer: to its end
        if reply != "[DONE]":
            body = json.loads(reply)
            assert "error" in body or body.get("object") == "chat.completion", reply[:300]
            assert body.get("status", 200) < 500, reply[:300]
        ws.send(ok)
        assert json.loads(ws.recv(timeout=60))["object"] == "chat.completion"
