"""logit_bias, as OpenAI's: a number from -100 to 100 added to a token's logit before the
penalties and sampling, on chat and completions; at most 300 tokens, each of the model's
vocabulary, and anything else a 400 naming the field."""

from __future__ import annotations

import attrs
import httpx
import openai
import pytest

from mashbox.engine.engine import Engine
from mashbox.protocol import SamplingParams
from mashbox.text.tokenizer import Tokenizer
from support.tinymodels import step_by_step

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tok(tiny_llama) -> Tokenizer:
    return Tokenizer.from_gguf(tiny_llama)


@pytest.fixture(scope="module")
def word(tok) -> int:
    """A token that is a whole printable word, so its text repeats plainly."""
    (token,) = tok.encode("the")
    return token


def test_a_bias_moves_the_engines_picks_and_nothing_else(tiny_llama):
    """Greedy: -100 on the token greedy picks first makes it pick another; +100 on any token
    makes every pick that token, sampled (seeded) as well as greedy; a bias of 0 changes
    nothing. Each as the engine computes it alone, so the rest of the picks are real."""
    engine = Engine(tiny_llama, slots=1, ctx=256)
    prompt = (1, *range(40, 60))
    (plain,) = step_by_step(engine, [prompt], 6)
    (banned,) = step_by_step(engine, [prompt], 6, SamplingParams(logit_bias=((plain[0], -100),)))
    assert banned[0] != plain[0]
    favoured = next(t for t in range(100, 400) if t not in plain)
    for params in (SamplingParams(), SamplingParams(temperature=1.0, seed=7)):
        bias = attrs.evolve(params, logit_bias=((favoured, 100.0),))
        assert step_by_step(engine, [prompt], 6, bias) == [[favoured] * 6]
    zero = SamplingParams(logit_bias=((plain[0], 0.0),))
    assert step_by_step(engine, [prompt], 6, zero) == [plain]


def test_chat_and_completions_take_it_through_the_sdk(server, tok, word):
    """+100 on a word makes the whole answer that word; with -100 on it and +100 on another,
    the other: both signs reach the sampler, seeded or greedy, on both routes."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    (other,) = tok.encode("of")
    common = {"max_tokens": 5, "extra_body": {"ignore_eos": True}}
    for temperature in (0.0, 1.0):
        favoured = client.completions.create(
            model="tiny-llama.gguf", prompt=PROMPT, temperature=temperature, seed=3,
            logit_bias={str(word): 100}, **common,
        )  # fmt: skip
        assert favoured.choices[0].text == tok.decode([word] * 5)
        chat = client.chat.completions.create(
            model="tiny-llama.gguf", messages=[{"role": "user", "content": PROMPT}],
            temperature=temperature, seed=3, logit_bias={str(word): -100, str(other): 100},
            **common,
        )  # fmt: skip
        assert chat.choices[0].message.content == tok.decode([other] * 5)


@pytest.mark.parametrize(
    "bias",
    [
        {str(i): 1 for i in range(301)},  # past OpenAI's 300
        {"400": 1},  # past the tiny vocabulary (0 to 399)
        {"-1": 1},
        {"abc": 1},
        {"1" * 5000: 1},  # too long to be an id (and past Python's int parsing)
        {"5": 101},
        {"5": -100.5},
        {"5": True},
        {"5": "1"},
        {"5": None},
        [1, 2],
    ],
)
def test_a_bias_out_of_bounds_is_400_naming_it(server, bias):
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
        ("/v1/completions", {"prompt": "Hi"}),
    ):
        r = httpx.post(server.url + path, json={**body, "max_tokens": 2, "logit_bias": bias})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "logit_bias", r.text


def test_a_nan_bias_is_400(server):
    raw = b'{"prompt": "Hi", "max_tokens": 2, "logit_bias": {"5": NaN}}'
    r = httpx.post(
        server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
