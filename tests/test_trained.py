"""The scripted model (tests/trained.py) through the real engine, detokenizer and parser."""

from __future__ import annotations

import json

import pytest

from mashbox.engine.engine import Engine
from mashbox.protocol import Admit, Decode, Prefill, SamplingParams, Step
from mashbox.text.chat_template import ChatTemplate
from mashbox.text.parser import Content, OutputParser, Reasoning, ToolCall, merge
from mashbox.text.tokenizer import Detokenizer, Tokenizer
from support import trained
from support.trained import HELD_OUT, SCRIPT, TOOL_TEMPLATE, WEATHER_TOOL, expected_completion

MAX_TOKENS = 80


@pytest.fixture(scope="module")
def model_path(trained_model):
    return trained_model


@pytest.fixture(scope="module")
def tok(model_path) -> Tokenizer:
    return Tokenizer.from_gguf(model_path)


@pytest.fixture(scope="module")
def engine(model_path) -> Engine:
    return Engine(model_path, slots=2, ctx=512)


def prompt_ids(tok: Tokenizer, conversation) -> list[int]:
    messages, tools, thinking = conversation
    # The template the GGUF file carries, as the server reads it.
    prompt = ChatTemplate(tok.chat_template).render(messages, tools=tools, enable_thinking=thinking)
    return tok.encode(prompt, add_bos=tok.add_bos)


def generate(engine: Engine, tok: Tokenizer, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy decoding, the prompts side by side in the engine's slots, up to an EOG token."""
    greedy = SamplingParams()
    res = engine.step(
        Step(
            admits=tuple(Admit(s, greedy, tuple(p)) for s, p in enumerate(prompts)),
            prefills=tuple(Prefill(s, 0, tuple(p), True) for s, p in enumerate(prompts)),
        )
    )
    outs = [[res.tokens[s]] for s in range(len(prompts))]
    while live := [
        s for s, out in enumerate(outs) if out[-1] not in tok.eog_ids and len(out) < MAX_TOKENS
    ]:
        decodes = tuple(Decode(s, outs[s][-1], len(prompts[s]) + len(outs[s]) - 1) for s in live)
        res = engine.step(Step(decodes=decodes))
        for s in live:
            outs[s].append(res.tokens[s])
    return outs


def detokenize(tok: Tokenizer, ids: list[int]) -> str:
    """The text a server streams: every token up to the EOG token, which must end it."""
    assert ids[-1] in tok.eog_ids, "no end of generation"
    detok = Detokenizer(tok)
    return "".join(detok.feed(i) for i in ids[:-1]) + detok.flush()


def case_id(conversation) -> str:
    messages, tools, thinking = conversation
    last = messages[-1]
    text = last["content"] if last["role"] == "user" else "tool result"
    return f"{text[:24]}|{'tools' if tools else 'no tools'}|{'think' if thinking else 'no think'}"


@pytest.mark.parametrize("conversation", HELD_OUT, ids=[case_id(c) for c in HELD_OUT])
def test_greedy_generation_gives_the_scripted_completion(engine, tok, conversation):
    [ids] = generate(engine, tok, [prompt_ids(tok, conversation)])
    assert detokenize(tok, ids) == expected_completion(*conversation)


def test_two_slots_decoded_together_give_the_same_completions(engine, tok):
    pairs = [(HELD_OUT[0], HELD_OUT[5]), (HELD_OUT[9], HELD_OUT[3])]
    for a, b in pairs:
        out_a, out_b = generate(engine, tok, [prompt_ids(tok, a), prompt_ids(tok, b)])
        assert detokenize(tok, out_a) == expected_completion(*a)
        assert detokenize(tok, out_b) == expected_completion(*b)


def test_held_out_conversations_cover_every_script_case():
    assert {expected_completion(*c) for c in HELD_OUT} == {text for _, text in SCRIPT}


def test_thinking_and_tool_call_parse(engine, tok):
    conversation = ([{"role": "user", "content": "What's the weather?"}], [WEATHER_TOOL], True)
    [ids] = generate(engine, tok, [prompt_ids(tok, conversation)])
    parser = OutputParser(reasoning=True, tools=True)
    detok = Detokenizer(tok)
    events = []
    for i in ids[:-1]:
        events += parser.feed(detok.feed(i))
    events += parser.feed(detok.flush()) + parser.finish()
    reasoning, call = merge(events)
    assert reasoning == Reasoning("The user wants the weather.")
    assert isinstance(call, ToolCall)
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    conversation = ([{"role": "user", "content": "Hi"}], None, False)
    [ids] = generate(engine, tok, [prompt_ids(tok, conversation)])
    parser = OutputParser(reasoning=False, tools=True)
    events = parser.feed(detokenize(tok, ids)) + parser.finish()
    assert merge(events) == [Content("Hello! How can I help?")]


def test_tags_are_single_printed_tokens_and_im_end_ends_generation(tok):
    assert tok.chat_template == TOOL_TEMPLATE
    for tag in trained.TAGS:
        [i] = tok.encode(tag)
        assert tok.token_bytes(i) == tag.encode()
    [end] = tok.encode("<|im_end|>")
    assert end == tok.eos_id and end in tok.eog_ids
    assert tok.token_bytes(end) == b""
    # Completions encode to the tokens that decode to exactly their text.
    for _, text in SCRIPT:
        assert tok.decode(tok.encode(text)) == text


def test_the_model_file_is_cached(model_path):
    mtime = model_path.stat().st_mtime_ns
    assert trained.build_trained_model(model_path.parent) == model_path
    assert model_path.stat().st_mtime_ns == mtime


WEATHER_Q = {"role": "user", "content": "Weather?"}


def render(messages, **kwargs) -> str:
    return ChatTemplate(TOOL_TEMPLATE).render(messages, **kwargs)


def test_template_generation_prompt_follows_enable_thinking():
    assert render([WEATHER_Q]).endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert render([WEATHER_Q], enable_thinking=True).endswith("<|im_start|>assistant\n")
    off = render([WEATHER_Q], enable_thinking=False)
    assert off.endswith("<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render([WEATHER_Q], add_generation_prompt=False) == (
        "<|im_start|>user\nWeather?<|im_end|>\n"
    )


def test_template_lists_tools_in_the_system_block():
    system = {"role": "system", "content": "Be brief."}
    prompt = render([system, WEATHER_Q], tools=[WEATHER_TOOL], add_generation_prompt=False)
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\n")
    assert f"<tools>\n{json.dumps(WEATHER_TOOL)}\n</tools>" in prompt
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n' in prompt
    assert prompt.endswith("</tool_call><|im_end|>\n<|im_start|>user\nWeather?<|im_end|>\n")
    assert render([system, WEATHER_Q], add_generation_prompt=False).startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    )


def test_template_renders_calls_results_and_reasoning():
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    as_string = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    messages = [
        WEATHER_Q,
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "\nThe user wants the weather.\n",
            "tool_calls": [{"type": "function", "function": call}, {"function": as_string}],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "warm"},
        {"role": "assistant", "content": "It is sunny in Paris."},
    ]
    assert render(messages, add_generation_prompt=False) == (
        "<|im_start|>user\nWeather?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nThe user wants the weather.\n</think>\n\n"
        f"{trained.WEATHER_CALL}\n{trained.WEATHER_CALL}<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nwarm\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nIt is sunny in Paris.<|im_end|>\n"
    )
    with_content = [{"role": "assistant", "content": "Let me look.", "tool_calls": [as_string]}]
    assert render(with_content, add_generation_prompt=False) == (
        f"<|im_start|>assistant\nLet me look.\n{trained.WEATHER_CALL}<|im_end|>\n"
    )


@pytest.mark.parametrize(
    ("messages", "thinking", "expected"),
    [
        ([WEATHER_Q], True, trained.WEATHER_THOUGHT + trained.WEATHER_CALL),
        ([WEATHER_Q], False, trained.WEATHER_CALL),
        ([WEATHER_Q], None, trained.WEATHER_THOUGHT + trained.WEATHER_CALL),
        ([{"role": "user", "content": "Hi"}], True, trained.GREETING_THOUGHT + trained.GREETING),
        ([{"role": "user", "content": "Hi"}], False, trained.GREETING),
        ([WEATHER_Q, {"role": "tool", "content": "sunny"}], True, trained.SUNNY),
        ([WEATHER_Q, {"role": "tool", "content": "sunny"}], False, trained.SUNNY),
        (
            [WEATHER_Q, {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "ok"}],
            False,
            trained.GREETING,
        ),
    ],
)
def test_expected_completion_rules(messages, thinking, expected):
    assert expected_completion(messages, [WEATHER_TOOL], thinking) == expected
