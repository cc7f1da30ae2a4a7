"""Any JSON body, on any generation route: a typed request or a 4xx in the route's own error
shape, never a 5xx, never an exception, never a hang."""

from __future__ import annotations

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import AUTH, EXAMPLES

ROUTES = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/v1/systemone",
    "/v1/embeddings",
]
FIELDS = [
    "model", "messages", "prompt", "input", "system", "instructions", "tools", "tool_choice",
    "stream", "stop", "stop_sequences", "temperature", "top_p", "top_k", "min_p", "seed", "n",
    "max_tokens", "max_completion_tokens", "max_output_tokens", "thinking", "reasoning",
    "chat_template_kwargs", "enable_thinking", "response_format", "text", "include",
    "logprobs", "top_logprobs", "stream_options", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "output_config", "parallel_tool_calls", "state", "questions",
]  # fmt: skip

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
    st.sampled_from(["user", "assistant", "system", "tool", "text", "function", "auto", "none",
                     "required", "tool_use", "tool_result", "message", "function_call",
                     "input_text", "image_url", "<tool_call>", "<think>", "jev-latest",
                     "noul", "choice", "score"]),
)  # fmt: skip
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(["role", "content", "type", "text", "name",
                                                   "arguments", "input", "function", "id",
                                                   "instructions", "criteria", "true"]),
                                  st.text(max_size=8)), inner, max_size=4),
    ),
    max_leaves=20,
)  # fmt: skip
bodies = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=8)


@settings(
    max_examples=EXAMPLES * 10,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(route=st.sampled_from(ROUTES), body=bodies)
def test_any_json_body_is_a_request_or_a_4xx(fuzz_server, route, body):
    body = {**body, "max_tokens": 1, "max_output_tokens": 1}  # keep generations short
    body.pop("max_completion_tokens", None)
    r = httpx.post(fuzz_server.url + route, json=body, headers=AUTH, timeout=60)
    assert r.status_code < 500, (route, body, r.text[:300])
    if r.status_code >= 400:
        error = r.json()
        if route.startswith("/v1/messages"):
            assert error["type"] == "error" and error["error"]["message"]
        elif route == "/v1/systemone":  # seed 004's ErrorResponse
            assert error["error"]["message"] and error["error"]["code"]
        else:
            assert error["error"]["message"] and error["error"]["type"]
