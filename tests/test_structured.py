"""Structured output through real servers: JSON schemas, JSON objects, strict and forced tool
calls, on every protocol that asks for them, at temperature 1 on the shipped default model;
reasoning left free on a model that thinks; seeded answers exact alone, beside others, from
a cached prefix and after a restart."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import jsonschema
import openai
import pytest

from mashbox import registry
from mashbox.text.constraint import Grammars
from mashbox.text.tokenizer import Tokenizer
from support import trained
from support.serverproc import ServerProcess

MODEL = "smollm2-135m-instruct"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "minItems": 2,
            "maxItems": 4,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "zip": {"type": "integer", "minimum": 0, "maximum": 99999},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "color", "tags", "address"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": PERSON, "strict": True},
}

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "strict": True, "parameters": WEATHER},
}


@pytest.fixture(scope="module")
def oai(default_server):
    return openai.OpenAI(base_url=default_server.url + "/v1", api_key="x", max_retries=0)


def person(client, seed: int, **extra) -> str:
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=1, seed=seed, max_tokens=300,
        response_format=PERSON_FORMAT, **extra,
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    return r.choices[0].message.content


@pytest.mark.slow
def test_json_schema_answers_validate_at_temperature_1(oai):
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda seed: person(oai, seed), range(20)))
    for text in answers:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(answers)) > 10  # sampled, not one forced answer


@pytest.mark.slow
def test_streamed_json_schema_answer_is_the_whole_one(oai):
    stream = oai.chat.completions.create(
        model=MODEL, messages=ASK, temperature=1, seed=7, max_tokens=300,
        response_format=PERSON_FORMAT, stream=True,
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == person(oai, 7)


@pytest.mark.slow
def test_json_object_answers_parse(oai):
    for seed in range(5):
        r = oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Some JSON, please."}],
            temperature=1, seed=seed, max_tokens=300, response_format={"type": "json_object"},
        )  # fmt: skip
        if r.choices[0].finish_reason == "stop":  # an object may outgrow max_tokens
            assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.slow
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_tool_calls_follow_their_parameters(oai, choice):
    calls = 0
    for seed in range(6):
        r = oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=[WEATHER_TOOL], tool_choice=choice, temperature=1, seed=seed, max_tokens=120,
        )  # fmt: skip
        for call in r.choices[0].message.tool_calls or ():
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER)
            calls += 1
        assert r.choices[0].finish_reason == "tool_calls"
    assert calls >= 6


@pytest.mark.slow
def test_one_call_when_parallel_calls_are_off(oai):
    for seed in range(4):
        r = oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather in Paris and Rome?"}],
            tools=[WEATHER_TOOL], tool_choice="required", parallel_tool_calls=False,
            temperature=1, seed=seed, max_tokens=120,
        )  # fmt: skip
        assert len(r.choices[0].message.tool_calls) == 1


@pytest.mark.slow
def test_responses_text_format_and_strict_function_tools(default_server):
    client = openai.OpenAI(base_url=default_server.url + "/v1", api_key="x", max_retries=0)
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    for seed in range(3):
        r = client.responses.create(
            model=MODEL, input="Describe a person as JSON.", temperature=1,
            text={"format": fmt}, max_output_tokens=300, extra_body={"seed": seed},
        )  # fmt: skip
        jsonschema.validate(json.loads(r.output_text), PERSON)
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER}  # strict: default
    r = client.responses.create(
        model=MODEL, input="Weather in Paris?", tools=[tool], tool_choice="required",
        temperature=1, max_output_tokens=120,
    )  # fmt: skip
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER)


@pytest.mark.slow
def test_a_custom_tools_regex_holds_its_input(default_server):
    """Responses custom tools with format grammar/regex: the call's input matches it whole."""
    client = openai.OpenAI(base_url=default_server.url + "/v1", api_key="x", max_retries=0)
    regex = r"[1-9]d(4|6|8|20)"
    dice = {"type": "custom", "name": "roll", "description": "Roll dice.",
            "format": {"type": "grammar", "syntax": "regex", "definition": regex}}  # fmt: skip
    for seed in range(4):
        r = client.responses.create(
            model=MODEL, input="Roll some dice for me.", tools=[dice], temperature=1,
            tool_choice={"type": "custom", "name": "roll"}, max_output_tokens=60,
            extra_body={"seed": seed},
        )  # fmt: skip
        (call,) = [item for item in r.output if item.type == "custom_tool_call"]
        assert re.fullmatch(regex, call.input), call.input
    bad = {**dice, "format": "regex"}
    r = httpx.post(default_server.url + "/v1/responses", json={"input": "x", "tools": [bad]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


@pytest.mark.slow
def test_a_custom_tools_lark_grammar_holds_its_input(default_server):
    """A Lark format (Codex's apply_patch is one) holds the input though it travels inside
    the call's JSON string: quotes and newlines escaped there, the grammar's own when read."""
    client = openai.OpenAI(base_url=default_server.url + "/v1", api_key="x", max_retries=0)
    lark = 'start: "say " QUOTE /[a-z ]{1,20}/ QUOTE "\\n" count\ncount: /[1-9]/\nQUOTE: "\\""\n'
    say = {"type": "custom", "name": "say", "description": "Say something.",
           "format": {"type": "grammar", "syntax": "lark", "definition": lark}}  # fmt: skip
    weights = registry.fetch(registry.resolve(MODEL), registry.default_models_dir())
    tok = Tokenizer.for_model(weights)
    grammars = Grammars(tok)
    for seed in range(4):
        r = client.responses.create(
            model=MODEL, input="Say hello.", tools=[say], temperature=1,
            tool_choice={"type": "custom", "name": "say"}, max_output_tokens=80,
            extra_body={"seed": seed},
        )  # fmt: skip
        (call,) = [item for item in r.output if item.type == "custom_tool_call"]
        matcher = grammars.matcher(lark)
        assert all(matcher.consume_token(t) for t in tok.encode(call.input)), call.input
        matcher.compute_bitmask()
        assert matcher.is_accepting(), call.input


@pytest.mark.slow
def test_anthropic_output_config_format_and_strict_tools(default_server):
    client = anthropic.Anthropic(base_url=default_server.url, api_key="x", max_retries=0)
    for seed in range(3):
        m = client.messages.create(
            model=MODEL, max_tokens=300, messages=ASK,
            extra_body={"seed": seed, "temperature": 1, "output_config": {"format": {
                "type": "json_schema", "schema": PERSON}}},
        )  # fmt: skip
        jsonschema.validate(json.loads(m.content[0].text), PERSON)
    # Seeded, as unseeded it once failed for 2 seeds in 30: the test below.
    m = strict_weather_call(client, seed=0)
    (use,) = [b for b in m.content if b.type == "tool_use"]  # one: no parallel calls
    assert m.stop_reason == "tool_use"
    jsonschema.validate(use.input, WEATHER)


def strict_weather_call(client, seed: int):
    tool = {"name": "get_weather", "input_schema": WEATHER, "strict": True}
    return client.messages.create(
        model=MODEL, max_tokens=120, tools=[tool],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        extra_body={"temperature": 1, "seed": seed},
    )  # fmt: skip


@pytest.mark.parametrize("seed", [7, 10])
def test_a_strict_calls_string_may_hold_the_end_tag(default_server, seed):
    """Seeds 7 and 10 write `"city": "Paris}}</tool_call>..."`: valid inside the grammar, so
    the call ends where its JSON does, not at the tag (once it did: no tool_use at all)."""
    client = anthropic.Anthropic(base_url=default_server.url, api_key="x", max_retries=0)
    m = strict_weather_call(client, seed)
    assert [b.type for b in m.content] == ["tool_use"] and m.stop_reason == "tool_use"
    jsonschema.validate(m.content[0].input, WEATHER)
    assert "</tool_call>" in m.content[0].input["city"]


def test_completions_take_a_response_format_as_vllm_does(server):
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}},
              "required": ["n"], "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    for seed in range(3):
        body = {"prompt": "Some JSON:", "max_tokens": 40, "temperature": 1, "seed": seed,
                "response_format": fmt}  # fmt: skip
        choice = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()
        jsonschema.validate(json.loads(choice["choices"][0]["text"]), schema)


def test_refusals_name_the_field_and_what_is_refused(server):
    def post(path, body):
        return httpx.post(server.url + path, json=body, timeout=30)

    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    bad = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"not": {}}, "strict": True},
    }
    r = post("/v1/chat/completions", {**chat, "response_format": bad})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "response_format" and '"not"' in error["message"]
    # Not strict: what the engine cannot enforce is ignored, the rest held.
    lenient = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}
    assert post("/v1/chat/completions", {**chat, "response_format": lenient}).status_code == 200
    for fmt in ({"type": "xml"}, {"type": "json_schema", "json_schema": {"schema": 3}}):
        r = post("/v1/chat/completions", {**chat, "response_format": fmt})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(9000)}}
    r = post("/v1/chat/completions", {**chat, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": huge}}})  # fmt: skip
    assert r.status_code == 400 and "at most" in r.json()["error"]["message"]
    lookbehind = {"type": "string", "pattern": "(?<=a)b"}
    r = post("/v1/responses", {"input": "hi", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": lookbehind, "strict": True}}})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format"
    r = post("/v1/messages", {"max_tokens": 5, "messages": chat["messages"], "output_config": {
        "format": {"type": "json_schema", "schema": {"$ref": "#/nowhere"}}}})  # fmt: skip
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "output_config.format" in r.json()["error"]["message"]


def test_thinking_stays_free_and_the_answer_follows_the_schema(trained_model, trained_url):
    """The trained model thinks "A greeting." and then, held to a schema, answers JSON; asked
    the weather with a strict tool offered, it thinks, then calls the tool by its schema."""
    schema = {"type": "object", "properties": {"reply": {"enum": ["hi", "hello"]}},
              "required": ["reply"], "additionalProperties": False}  # fmt: skip
    client = openai.OpenAI(base_url=trained_url + "/v1", api_key="x", max_retries=0)
    for seed in range(3):
        r = client.chat.completions.create(
            model=trained_model.name, seed=seed,
            messages=[{"role": "user", "content": "Good morning!"}],
            temperature=1, max_tokens=60, extra_body={"chat_template_kwargs": {
                "enable_thinking": True}}, response_format={"type": "json_schema",
                "json_schema": {"name": "r", "schema": schema, "strict": True}},
        )  # fmt: skip
        message = r.choices[0].message
        assert message.reasoning_content == "A greeting."  # the model's own, unconstrained
        jsonschema.validate(json.loads(message.content), schema)
    # tool_choice auto, a strict tool: the model thinks, then calls it as its schema says.
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"], "additionalProperties": False}  # fmt: skip
    strict = {"type": "function", "function": {
        **trained.WEATHER_TOOL["function"], "strict": True, "parameters": city}}  # fmt: skip
    for seed in range(3):
        r = client.chat.completions.create(
            model=trained_model.name, seed=seed, tools=[strict], temperature=1,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            max_tokens=80, extra_body={"chat_template_kwargs": {"enable_thinking": True}},
        )  # fmt: skip
        message = r.choices[0].message
        assert message.reasoning_content == "The user wants the weather."
        (call,) = message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert arguments == {"city": "Paris"}  # the model's own call, which the schema allows


def test_seeded_answers_are_exact_beside_others_cached_and_after_a_restart(tiny_llama):
    """One seed and schema: the same text alone, among 7 others, from the prompt cache, and
    from a fresh server."""
    args = (str(tiny_llama), "--ctx", "1024", "--slots", "8", "--threads", "1")
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}

    def ask(client, seed):
        r = client.chat.completions.create(
            model=tiny_llama.name,
            messages=ASK,
            temperature=1,
            seed=seed,
            max_tokens=80,
            response_format=fmt,
        )
        return r.choices[0].message.content

    def serve():
        proc = ServerProcess(*args)
        url = proc.wait_ready(120)
        return proc, openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)

    proc, client = serve()
    try:
        alone = ask(client, 11)
        cached = ask(client, 11)
        with ThreadPoolExecutor(8) as pool:
            crowd = list(pool.map(lambda s: ask(client, s), [11, *range(100, 107)]))
    finally:
        proc.stop()
    proc, client = serve()
    try:
        restarted = ask(client, 11)
    finally:
        proc.stop()
    assert alone == cached == crowd[0] == restarted
    assert len(set(crowd)) > 1


def test_a_grammar_compiles_once_and_refusals_name_keywords(tiny_llama):
    grammars = Grammars(Tokenizer.for_model(tiny_llama))
    grammar = 'start: answer\nanswer: %json {"type": "object"}\n'
    first = grammars.matcher(grammar)
    assert grammars.matcher(grammar) is not first  # a fresh copy each time
    assert len(grammars._compiled) == 1
    assert "Unimplemented keys" in grammars.error('start: %json {"not": {}}\n')
    assert len(grammars._compiled) == 1  # refusals are not kept
