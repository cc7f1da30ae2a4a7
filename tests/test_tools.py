"""Tool calls and thinking end to end through the real engine, on every chat protocol.

The model is trained in the test run (tests/trained.py) to answer a weather question with
`<think>...</think><tool_call>{...}</tool_call>`, a tool result with a sentence, anything
else with a greeting; so the real sampling, detokenizing and parsing path produces them.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from support import trained
from support.responses_events import check_sequence

WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris today?"}]
TOOLS = [trained.WEATHER_TOOL]
THOUGHT = "The user wants the weather."
CITY = {"city": "Paris"}


@pytest.fixture
def oai(trained_url):
    return openai.OpenAI(base_url=trained_url + "/v1", api_key="x", max_retries=0)


@pytest.fixture
def claude(trained_url):
    return anthropic.Anthropic(base_url=trained_url, api_key="x", max_retries=0)


def thinking(on: bool) -> dict:
    return {"chat_template_kwargs": {"enable_thinking": on}}


# --- OpenAI chat ---------------------------------------------------------------------------


@pytest.mark.parametrize("think", [True, False])
def test_chat_tool_call_with_and_without_thinking(oai, think):
    r = oai.chat.completions.create(
        model="trained.gguf", messages=WEATHER_Q, tools=TOOLS, max_tokens=80,
        extra_body=thinking(think),
    )  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == CITY
    reasoning = choice.message.model_extra.get("reasoning_content")
    assert reasoning == (THOUGHT if think else None)


@pytest.mark.parametrize(
    ("effort", "think"), [("high", True), ("low", True), ("minimal", False), ("none", False)]
)
def test_chat_reasoning_effort_turns_thinking_on_as_responses_does(oai, effort, think):
    """OpenAI's reasoning_effort (the SDK's own field) is read as Responses' reasoning.effort:
    any value but none or minimal thinks; enable_thinking, where given, wins."""
    r = oai.chat.completions.create(
        model="trained.gguf", messages=WEATHER_Q, tools=TOOLS, max_tokens=80,
        reasoning_effort=effort,
    )  # fmt: skip
    reasoning = r.choices[0].message.model_extra.get("reasoning_content")
    assert reasoning == (THOUGHT if think else None)
    r = oai.chat.completions.create(
        model="trained.gguf", messages=WEATHER_Q, tools=TOOLS, max_tokens=80,
        reasoning_effort=effort, extra_body=thinking(not think),
    )  # fmt: skip
    reasoning = r.choices[0].message.model_extra.get("reasoning_content")
    assert reasoning == (None if think else THOUGHT)


def test_chat_stream_carries_reasoning_and_whole_tool_calls(oai):
    stream = oai.chat.completions.create(
        model="trained.gguf", messages=WEATHER_Q, tools=TOOLS, max_tokens=80, stream=True,
        extra_body=thinking(True),
    )  # fmt: skip
    reasoning, content, calls, finish = [], [], [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning.append(delta.model_extra.get("reasoning_content") or "")
        content.append(delta.content or "")
        calls.extend(delta.tool_calls or [])
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(reasoning) == THOUGHT
    assert "".join(content) == ""  # no markup ever leaks into content
    (call,) = calls
    assert call.index == 0 and call.id.startswith("call_") and call.type == "function"
    assert json.loads(call.function.arguments) == CITY
    assert finish == "tool_calls"


def test_chat_tool_result_then_answer(oai):
    history = [
        *WEATHER_Q,
        {"role": "assistant", "content": None, "reasoning_content": THOUGHT,
         "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "get_weather", "arguments": json.dumps(CITY)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
    ]  # fmt: skip
    r = oai.chat.completions.create(
        model="trained.gguf", messages=history, tools=TOOLS, max_tokens=40
    )
    assert r.choices[0].message.content == trained.SUNNY
    assert r.choices[0].finish_reason == "stop"


def test_chat_greeting_with_thinking(oai):
    r = oai.chat.completions.create(
        model="trained.gguf", messages=[{"role": "user", "content": "Good evening!"}],
        max_tokens=60, extra_body=thinking(True),
    )  # fmt: skip
    assert r.choices[0].message.content == trained.GREETING
    assert r.choices[0].message.model_extra["reasoning_content"] == "A greeting."


def test_tool_choice_none_and_named(oai):
    none = oai.chat.completions.create(
        model="trained.gguf", messages=WEATHER_Q, tools=TOOLS, tool_choice="none", max_tokens=80
    )
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].finish_reason == "stop"
    named = oai.chat.completions.create(
        model="trained.gguf", messages=WEATHER_Q, tools=TOOLS, max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == CITY


# --- Anthropic -----------------------------------------------------------------------------

CLAUDE_TOOLS = [{"name": "get_weather", "description": "Weather in a city",
                 "input_schema": trained.WEATHER_TOOL["function"]["parameters"]}]  # fmt: skip


def test_messages_thinking_and_tool_use(claude):
    kwargs = dict(
        model="any", max_tokens=80, tools=CLAUDE_TOOLS, messages=WEATHER_Q,
        thinking={"type": "enabled", "budget_tokens": 1024},
    )  # fmt: skip
    m = claude.messages.create(**kwargs)
    assert [b.type for b in m.content] == ["thinking", "tool_use"]
    assert m.content[0].thinking == THOUGHT and m.content[0].signature == "mashbox-local"
    assert m.content[1].name == "get_weather" and m.content[1].input == CITY
    assert m.stop_reason == "tool_use"
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[0].thinking == THOUGHT and final.content[1].input == CITY
    # tool_use -> tool_result -> answer
    follow = claude.messages.create(
        model="any", max_tokens=40, tools=CLAUDE_TOOLS,
        messages=[*WEATHER_Q, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
                  {"role": "user", "content": [{"type": "tool_result",
                                                "tool_use_id": m.content[1].id,
                                                "content": "sunny"}]}],
    )  # fmt: skip
    assert [b.type for b in follow.content] == ["text"]
    assert follow.content[0].text == trained.SUNNY and follow.stop_reason == "end_turn"


# --- OpenAI Responses ----------------------------------------------------------------------

RESPONSE_TOOLS = [{"type": "function", "name": "get_weather",
                   "parameters": trained.WEATHER_TOOL["function"]["parameters"]}]  # fmt: skip


def test_responses_reasoning_and_function_call(oai, trained_model):
    r = oai.responses.create(
        model="trained.gguf", input="What is the weather in Paris today?",
        tools=RESPONSE_TOOLS, reasoning={"effort": "medium"}, max_output_tokens=80,
    )  # fmt: skip
    assert [item.type for item in r.output] == ["reasoning", "function_call"]
    assert r.output[0].content[0].text == THOUGHT and r.output[0].summary == []
    call = r.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == CITY
    # The tokens the model generated for its reasoning, think tags included (the trained
    # model writes them as single tokens), not the reasoning text tokenized again.
    from mashbox.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(trained_model)
    generated = tok.encode(trained.WEATHER_THOUGHT.rstrip("\n"))
    assert r.usage.output_tokens_details.reasoning_tokens == len(generated), generated
    events = list(oai.responses.create(
        model="trained.gguf", input="What is the weather in Paris today?", stream=True,
        tools=RESPONSE_TOOLS, reasoning={"effort": "medium"}, max_output_tokens=80,
    ))  # fmt: skip
    check_sequence(events)  # numbering, and every delta inside its item's added/done
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.reasoning_text.delta" in kinds
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == len(generated)
    follow = oai.responses.create(
        model="trained.gguf", tools=RESPONSE_TOOLS, max_output_tokens=40,
        input=[{"type": "message", "role": "user", "content": WEATHER_Q[0]["content"]},
               {"type": "function_call", "call_id": call.call_id, "name": "get_weather",
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )  # fmt: skip
    assert follow.output_text == trained.SUNNY


def test_responses_custom_and_namespace_tools(oai):
    """A custom tool's call comes back with its raw input; a namespace tool's function comes
    back with its namespace (the model writes the bare name, as small models do)."""
    tool = {"type": "custom", "name": "get_weather", "description": "Weather as free text"}
    custom = oai.responses.create(
        model="trained.gguf", input="What is the weather in Paris today?", max_output_tokens=80,
        tools=[tool],
    )  # fmt: skip
    (item,) = custom.output
    assert item.type == "custom_tool_call" and item.name == "get_weather"
    assert json.loads(item.input) == CITY  # the raw input the model wrote
    # With a grammar, the call is held to the custom tool's shape ({"input": "..."}), the
    # input to the grammar: the model writes the city there.
    lark = {"type": "grammar", "syntax": "lark", "definition": "start: /[A-Za-z ]+/"}
    custom = oai.responses.create(
        model="trained.gguf", input="What is the weather in Paris today?", max_output_tokens=80,
        tools=[{**tool, "format": lark}],
    )  # fmt: skip
    (item,) = custom.output
    assert item.type == "custom_tool_call" and item.input == "Paris"
    namespaced = oai.responses.create(
        model="trained.gguf", input="What is the weather in Paris today?", max_output_tokens=80,
        extra_body={"tools": [{"type": "namespace", "name": "weather",
                               "tools": [{"type": "function", "name": "get_weather",
                                          "parameters": {"type": "object"}}]}]},
    )  # fmt: skip
    (call,) = namespaced.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.namespace == "weather"
    assert json.loads(call.arguments) == CITY


def test_a_stream_faulting_inside_a_held_back_tool_call_is_run_again(trained_model):
    """The engine crashes while the answer is a <tool_call> the parser still holds back: the
    client has had the role chunk and nothing else, so the request gets its one retry (seed
    000: "one retry before first output") and the call arrives whole, not an error."""
    import httpx

    from support.serverproc import serving

    body = {"messages": WEATHER_Q, "tools": TOOLS, "max_tokens": 80,
            "stream": True, "temperature": 0}  # fmt: skip

    def call_and_events(url: str) -> tuple[list, list]:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
        calls = [c for e in events if e.get("choices") for c in
                 e["choices"][0]["delta"].get("tool_calls") or []]  # fmt: skip
        return calls, events

    with serving(str(trained_model), "--ctx", "1024", "--slots", "2") as server:
        reference, _ = call_and_events(server.url)
    assert reference and reference[0]["function"]["name"] == "get_weather"
    env = {"MASHBOX_FAULTS": "crash@5"}  # inside the call: its JSON is not done by step 5
    with serving(str(trained_model), "--ctx", "1024", "--slots", "2", env=env) as server:
        calls, events = call_and_events(server.url)
        assert not any("error" in e for e in events), events[-1]
        assert [c["function"] for c in calls] == [c["function"] for c in reference]
        assert httpx.get(server.url + "/health").json()["worker_restarts"] == 1


def test_an_answer_that_calls_a_tool_is_counted_as_tool_calls(oai, trained_url):
    """/metrics' request_success_total{finished_reason="tool_calls"}: the route's parser
    reads the calls, so the count comes when the route lets the request go."""
    import httpx

    def tool_calls_so_far() -> float:
        for line in httpx.get(trained_url + "/metrics").text.splitlines():
            if line.startswith("mashbox:request_success_total") and "tool_calls" in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = tool_calls_so_far()
    r = oai.chat.completions.create(
        model="trained.gguf", messages=WEATHER_Q, tools=TOOLS, max_tokens=80,
        extra_body=thinking(False),
    )  # fmt: skip
    assert r.choices[0].finish_reason == "tool_calls"
    assert tool_calls_so_far() == before + 1
