"""One cell of the end-to-end matrix: a tiny model of one family and tokenizer kind, served
with the host prompt cache on or off and one kind of decode weights, checked through the
official OpenAI and Anthropic SDKs and raw HTTP.

The environment picks the cell (`nox -s "e2e(...)"` sets it, see noxfile.py):
MASHBOX_MATRIX_FAMILY (llama, mistral, qwen2, qwen3), MASHBOX_MATRIX_TOKENIZER
(sentencepiece, bpe), MASHBOX_MATRIX_PREFIX_CACHE (on, off) and MASHBOX_MATRIX_DECODE_WEIGHTS
(float, int8, int4, int4a16, int4a8). Unset, each takes the cheap default below, so a plain
`pytest` run covers one cell in a few seconds.
"""

from __future__ import annotations

import contextlib
import os
import threading

import anthropic
import attrs
import httpx
import openai
import pytest

from mashbox.prompt_cache import MIN_TOKENS
from support.serverproc import serving
from support.tinymodels import FAMILIES, build_tiny_model
from support.tinytok import TOKENIZER_KINDS

DECODE_WEIGHTS = ("float", "int8", "int4", "int4a16", "int4a8")
PREFIX_CACHE = ("on", "off")
CACHE_RAM_MIB = 64
CTX = 2048  # tokens per slot: room for a long request beside the one checked

# Two tenants: the checks run as MAIN. A slot never gives one tenant's prefix to another, so
# once OTHER's requests have taken every slot only the host cache can give MAIN one back.
MAIN, OTHER = "matrix-main", "matrix-other"


@attrs.frozen
class Cell:
    """What one cell of the matrix serves, and how."""

    family: str = attrs.field(validator=attrs.validators.in_(tuple(FAMILIES)))
    tokenizer: str = attrs.field(validator=attrs.validators.in_(TOKENIZER_KINDS))
    prefix_cache: str = attrs.field(validator=attrs.validators.in_(PREFIX_CACHE))
    decode_weights: str = attrs.field(validator=attrs.validators.in_(DECODE_WEIGHTS))

    @classmethod
    def from_env(cls) -> Cell:
        env = os.environ.get
        return cls(
            family=env("MASHBOX_MATRIX_FAMILY", "llama"),
            tokenizer=env("MASHBOX_MATRIX_TOKENIZER", "sentencepiece"),
            prefix_cache=env("MASHBOX_MATRIX_PREFIX_CACHE", "on"),
            decode_weights=env("MASHBOX_MATRIX_DECODE_WEIGHTS", "float"),
        )

    @property
    def quant(self) -> str:
        """The int4 kinds read the file's own 4-bit blocks; the others any float weights."""
        return "q4" if self.decode_weights.startswith("int4") else "q8_0"


@pytest.fixture(scope="module")
def cell() -> Cell:
    return Cell.from_env()


@pytest.fixture(scope="module")
def matrix_server(cell, tmp_path_factory):
    """The cell's model on a real `mashbox run`: 2 slots, MAIN's and OTHER's keys."""
    workdir = tmp_path_factory.mktemp("matrix")
    model = build_tiny_model(
        workdir / "model", family=cell.family, tokenizer=cell.tokenizer, quant=cell.quant
    )
    keys = workdir / "keys"
    keys.write_text(f"{MAIN} main\n{OTHER} other\n")
    cache_ram = CACHE_RAM_MIB if cell.prefix_cache == "on" else 0
    with serving(
        str(model), "--ctx", str(CTX), "--slots", "2", "--threads", "1",
        "--decode-weights", cell.decode_weights, "--cache-ram", str(cache_ram),
        "--api-key-file", str(keys), "--tenant-slots", "0",
        log=workdir / "server.log",
    ) as proc:  # fmt: skip
        yield proc


@pytest.fixture(scope="module")
def model_id(matrix_server) -> str:
    return card(matrix_server.url)["id"]


@pytest.fixture(scope="module")
def oai(matrix_server):
    return openai.OpenAI(base_url=matrix_server.url + "/v1", api_key=MAIN, max_retries=0)


def card(url: str) -> dict:
    r = httpx.get(url + "/v1/models", headers=auth(MAIN))
    assert r.status_code == 200, r.text
    (only,) = r.json()["data"]
    return only


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def complete(url: str, key: str, prompt: str, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": 16, "ignore_eos": True, "temperature": 0, **extra}
    r = httpx.post(url + "/v1/completions", json=body, headers=auth(key), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@contextlib.contextmanager
def beside(url: str, key: str = MAIN):
    """Run the block while another request decodes: a long streamed completion, decoding
    before the block starts and still decoding when it ends (then its client leaves)."""
    body = {"prompt": "Count: one, two, three,", "max_tokens": CTX - 100, "ignore_eos": True,
            "stream": True}  # fmt: skip
    events: list[str] = []  # the SSE data lines
    errors: list[BaseException] = []
    decoding, block_done = threading.Event(), threading.Event()

    def stream() -> None:
        try:
            with httpx.stream(
                "POST", url + "/v1/completions", json=body, headers=auth(key), timeout=120
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line)
                        decoding.set()
                    if block_done.is_set():
                        break
        except BaseException as exc:  # re-raised by the test's thread
            errors.append(exc)
        finally:
            decoding.set()

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    decoding.wait(120)
    try:
        yield
    finally:
        ended_first = "data: [DONE]" in events
        block_done.set()
        thread.join(120)
    if errors:
        raise errors[0]
    assert events and not ended_first, "the other request ended before the block did"


def test_the_server_runs_the_cell(cell, matrix_server):
    info = card(matrix_server.url)
    # Without mashbox's kernels the int4 kinds fall back to torch's int4 kernel.
    fallback = info["kernels_fallback"] and cell.decode_weights.startswith("int4")
    assert info["decode_weights"] == ("int4" if fallback else cell.decode_weights)
    # Bit for bit alone or beside others only on mashbox's kernels (README, "Seeded sampling").
    on_kernels = cell.decode_weights != "float" and not info["kernels_fallback"]
    assert info["batch_invariant"] is on_kernels
    assert info["cache_ram_mib"] == (CACHE_RAM_MIB if cell.prefix_cache == "on" else 0)
    assert info["slots"] == 2 and info["max_model_len"] == CTX
    assert any(f"({cell.family}, " in line for line in matrix_server.lines)  # the ready line


def test_openai_chat_streams_what_it_answers_whole(oai, model_id):
    kwargs = dict(
        model=model_id,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    whole = oai.chat.completions.create(**kwargs)
    assert whole.usage.completion_tokens == 12
    assert whole.choices[0].finish_reason == "length"
    chunks = list(oai.chat.completions.create(stream=True, **kwargs))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_anthropic_messages_stream_what_they_answer_whole(matrix_server, model_id):
    client = anthropic.Anthropic(base_url=matrix_server.url, api_key=MAIN, max_retries=0)
    kwargs = dict(
        model=model_id,
        max_tokens=12,
        messages=[{"role": "user", "content": "Where is the Eiffel Tower?"}],
        extra_body={"temperature": 0, "ignore_eos": True},  # this SDK has no temperature
    )
    whole = client.messages.create(**kwargs)
    assert whole.role == "assistant" and whole.usage.output_tokens == 12
    with client.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == "".join(b.text for b in whole.content if b.type == "text")
    assert final.stop_reason == whole.stop_reason


def test_a_seeded_sample_repeats_exactly_alone_and_beside_another(oai, matrix_server, model_id):
    def sample(seed: int) -> str:
        r = oai.completions.create(
            model=model_id,
            prompt="Once upon a time,",
            max_tokens=16,
            temperature=1.0,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        return r.choices[0].text

    first = sample(7)
    assert sample(7) == first
    with beside(matrix_server.url):
        assert sample(7) == first


def test_greedy_text_is_the_same_alone_and_beside_another(matrix_server):
    url = matrix_server.url
    prompt = "The river Seine flows through"
    alone = complete(url, MAIN, prompt)["choices"][0]["text"]
    with beside(url):
        assert complete(url, MAIN, prompt)["choices"][0]["text"] == alone


def test_a_shared_prefix_is_answered_the_same_with_the_cache_on_or_off(
    cell, oai, matrix_server, model_id
):
    """MAIN's prompt leaves its slot when OTHER takes both: MAIN's next prompt with the same
    system text gets that prefix back from the host cache only (cached_tokens > 0 when on,
    0 when off) and is answered as OTHER's fresh prefill of it is."""
    url = matrix_server.url
    system = {"role": "system", "content": "You answer questions about geography. " * 6}

    def ask(client, question: str):
        return client.chat.completions.create(
            model=model_id,
            messages=[system, {"role": "user", "content": question}],
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )

    ask(oai, "What is the capital of France?")
    with beside(url, OTHER):  # both slots OTHER's: MAIN's prompt leaves the device
        complete(url, OTHER, "Numbers: 1 2 3 4 5", max_tokens=4)
    again = ask(oai, "Where is the Eiffel Tower?")
    cached = again.usage.prompt_tokens_details.cached_tokens
    if cell.prefix_cache == "on":  # the system text, at least: shorter prefixes are not saved
        assert MIN_TOKENS <= cached < again.usage.prompt_tokens
    else:
        assert cached == 0
    other = openai.OpenAI(base_url=url + "/v1", api_key=OTHER, max_retries=0)
    fresh = ask(other, "Where is the Eiffel Tower?")
    assert fresh.usage.prompt_tokens_details.cached_tokens <= 1  # its own BOS, at most
    assert again.choices[0].message.content == fresh.choices[0].message.content
