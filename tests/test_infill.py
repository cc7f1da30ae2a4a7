"""Fill in the middle: `suffix` on /v1/completions. The prompt is the code before the hole,
the suffix the code after it, and the model reads them between its vocabulary's markers,
[bos] <prefix> PROMPT <suffix> SUFFIX <middle>, then writes the middle (Qwen2.5-Coder's,
StarCoder's, DeepSeek-Coder's and CodeLlama's markers; as llama-server's /completion given
that text, which matched on qwen2.5-coder-0.5b).

And llama-server's `POST /infill`, for editors (llama.vscode, llama.vim): the code around the
cursor and other files' chunks go to the model as llama-server writes them, [<repo>
myproject (<file> NAME TEXT)... <file> filename] [bos] <prefix> PREFIX PROMPT <suffix> SUFFIX
<middle> (which gave llama-server's own tokens and text on qwen2.5-coder-0.5b), cut to fit
the context nearest the cursor first; the answer comes in llama-server's /completion shape."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from mashbox.text.tokenizer import Tokenizer
from mashbox.text.vocab_gguf import _spec_from_fields
from support.serverproc import serving
from support.tinymodels import build_tiny_qwen2

# Qwen2.5-Coder's markers, in its vocabulary's order (prefix, middle, suffix: the suffix
# marker's id is not the middle one's).
FIM_TOKENS = ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>")
REPO_TOKENS = ("<|repo_name|>", "<|file_sep|>")  # llama-server's /infill names files with them
PREFIX = "def add(a, b):\n    return "
SUFFIX = "\n\nfor i in range(10):\n    print(i)\n"


@pytest.fixture(scope="module")
def coder(tmp_path_factory):
    """A tiny Qwen2 with fill-in-the-middle markers, which puts a bos first."""
    return build_tiny_qwen2(
        tmp_path_factory.mktemp("tiny-coder"),
        more_special=FIM_TOKENS + REPO_TOKENS,
        add_bos=True,
        varied=True,
    )


@pytest.fixture(scope="module")
def coder_server(coder, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "coder.log"
    with serving(str(coder), "--ctx", "256", "--slots", "2", "--threads", "1", log=log) as proc:
        yield proc


def complete(server, expect: int = 200, **body) -> dict:
    body = {"max_tokens": 8, "temperature": 0} | body
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == expect, r.text
    return r.json()


def fim_ids(tok: Tokenizer, prefix: list[int], suffix: str, bos: bool) -> list[int]:
    pre, suf, mid = (
        tok.token_id(t) for t in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
    )
    return [*([tok.bos_id] if bos else []), pre, *prefix, suf, *tok.encode(suffix), mid]


@pytest.mark.parametrize(
    "fields",
    [{}, {"temperature": 1, "seed": 11}, {"logprobs": 2}],
    ids=["greedy", "seeded", "logprobs"],
)
def test_the_middle_is_what_the_marked_prompt_gives(coder_server, coder, fields):
    """A suffix request is the completion of the prompt with the markers written out: the same
    text, log-probs and prompt tokens (bos first here: this model puts one first)."""
    tok = Tokenizer.from_gguf(coder)
    assert tok.add_bos and tok.bos_id is not None
    marked = fim_ids(tok, tok.encode(PREFIX), SUFFIX, bos=True)
    fim = complete(coder_server, prompt=PREFIX, suffix=SUFFIX, **fields)
    plain = complete(coder_server, prompt=marked, **fields)
    assert fim["choices"] == plain["choices"] and fim["choices"][0]["text"]
    assert fim["usage"] == plain["usage"]
    assert fim["usage"]["prompt_tokens"] == len(marked)
    # Without the suffix the model reads another prompt (so the test above could fail).
    alone = complete(coder_server, prompt=PREFIX, **fields)
    assert alone["usage"]["prompt_tokens"] == len(tok.encode(PREFIX, add_bos=True))


def test_token_prompts_lists_and_streams_take_the_suffix_too(coder_server, coder):
    tok = Tokenizer.from_gguf(coder)
    ids = tok.encode(PREFIX)
    # Token ids are taken as they are: no bos before the prefix marker.
    by_ids = complete(coder_server, prompt=ids, suffix=SUFFIX)
    assert by_ids["usage"]["prompt_tokens"] == len(fim_ids(tok, ids, SUFFIX, bos=False))
    assert (
        by_ids["choices"]
        == complete(coder_server, prompt=fim_ids(tok, ids, SUFFIX, bos=False))["choices"]
    )
    # A list of prompts: each its own prefix before the same suffix, as alone.
    other = "x = 1\n"
    both = complete(coder_server, prompt=[PREFIX, other], suffix=SUFFIX, n=2, seed=3, temperature=1)
    for i, p in enumerate([PREFIX, other]):
        alone = complete(coder_server, prompt=p, suffix=SUFFIX, n=2, seed=3, temperature=1)
        assert [c["text"] for c in both["choices"][2 * i : 2 * i + 2]] == [
            c["text"] for c in alone["choices"]
        ]
    # Streamed, the same middle.
    whole = complete(coder_server, prompt=PREFIX, suffix=SUFFIX, max_tokens=12)
    with httpx.stream(
        "POST",
        coder_server.url + "/v1/completions",
        json={
            "prompt": PREFIX,
            "suffix": SUFFIX,
            "max_tokens": 12,
            "temperature": 0,
            "stream": True,
        },
        timeout=60,
    ) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(c["text"] for e in events[:-1] for c in json.loads(e)["choices"])
    assert text == whole["choices"][0]["text"]


def test_the_official_sdk_sends_a_suffix(coder_server):
    client = openai.OpenAI(base_url=coder_server.url + "/v1", api_key="unused")
    card = client.models.list().data[0]
    r = client.completions.create(
        model=card.id, prompt=PREFIX, suffix=SUFFIX, max_tokens=8, temperature=0
    )
    want = complete(coder_server, prompt=PREFIX, suffix=SUFFIX)["choices"][0]["text"]
    assert r.choices[0].text == want
    assert card.model_extra["fill_in_the_middle"] is True


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"suffix": 5}, "suffix", "must be a string"),
        ({"suffix": ["a"]}, "suffix", "must be a string"),
        ({"suffix": "x", "echo": True}, "suffix", "echo"),
        ({"suffix": "word " * 5000}, "suffix", "characters"),
        ({"suffix": "word " * 250}, "prompt", "context"),  # fits alone, not with the prompt
        ({"prompt": list(range(252)), "suffix": "a"}, "prompt", "context"),
    ],
)
def test_a_bad_suffix_is_a_400_naming_its_field(coder_server, body, field, words):
    r = complete(coder_server, 400, **({"prompt": PREFIX} | body))
    assert r["error"]["param"] == field and words in r["error"]["message"]


def test_a_model_without_markers_refuses_a_suffix_but_takes_an_empty_one(server):
    """The tests' tiny Llama has no fill-in-the-middle markers: a suffix would be ignored or
    read as text, so it is a 400; an empty one asks for nothing (some clients always send
    the field)."""
    r = complete(server, 400, prompt=PREFIX, suffix="\nprint(add(1, 2))\n")
    assert r["error"]["param"] == "suffix" and "fill-in-the-middle" in r["error"]["message"]
    assert (
        complete(server, prompt=PREFIX, suffix="")["choices"]
        == complete(server, prompt=PREFIX)["choices"]
    )
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["fill_in_the_middle"] is False


def _fields(tokens: list[str], **ids) -> dict:
    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens}
    fields |= {f"tokenizer.ggml.{k}_token_id": v for k, v in ids.items()}
    return fields


BASE = ["a", "b", "c", "d"]


@pytest.mark.parametrize(
    ("markers", "family"),
    [
        (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), "Qwen2.5-Coder, CodeGemma"),
        (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"), "StarCoder"),
        (("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"), "DeepSeek-Coder"),
        (("▁<PRE>", "▁<SUF>", "▁<MID>"), "CodeLlama"),
    ],
)
def test_the_markers_are_found_by_their_text(markers, family):
    tokens = [*BASE, markers[2], markers[0], markers[1]]
    vocab = _spec_from_fields(_fields(tokens)).vocab
    assert vocab.fim_ids == (5, 6, 4), family
    assert _spec_from_fields(_fields([*BASE, markers[0], markers[1]])).vocab.fim_ids is None


@pytest.mark.parametrize(
    "names", [("fim_pre", "fim_suf", "fim_mid"), ("prefix", "suffix", "middle")]
)
def test_the_files_own_marker_ids_come_first(names):
    """A file that names its markers (newer llama.cpp: fim_pre/suf/mid; older:
    prefix/suffix/middle) is read as it says, whatever its texts are."""
    tokens = [*BASE, "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
    vocab = _spec_from_fields(_fields(tokens, **dict(zip(names, (1, 2, 3), strict=True)))).vocab
    assert vocab.fim_ids == (1, 2, 3)
    out_of_range = _fields(tokens, **dict(zip(names, (99, 2, 3), strict=True)))
    assert _spec_from_fields(out_of_range).vocab.fim_ids == (4, 2, 3)  # found by its text


# --- /infill ----------------------------------------------------------------------------

EXTRA = [
    {"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"},
    {"filename": "b.py", "text": "X = 1\n"},
]


def infill(server, expect: int = 200, **body) -> dict:
    body = {"n_predict": 8, "temperature": 0} | body
    r = httpx.post(server.url + "/infill", json=body, timeout=60)
    assert r.status_code == expect, r.text
    return r.json()


def marked(tok: Tokenizer, prefix: str, suffix: str, extra=(), prompt: str = "") -> list[int]:
    """What llama-server reads for an /infill request (its format_infill), spelled out."""
    t = tok.token_id
    ids = [t("<|repo_name|>"), *tok.encode("myproject\n")]
    for chunk in extra:
        ids += [
            t("<|file_sep|>"),
            *tok.encode(chunk["filename"] + "\n"),
            *tok.encode(chunk["text"]),
        ]
    ids += [t("<|file_sep|>"), *tok.encode("filename\n"), tok.bos_id, t("<|fim_prefix|>")]
    ids += [*tok.encode(prefix), *tok.encode(prompt), t("<|fim_suffix|>"), *tok.encode(suffix)]
    return [*ids, t("<|fim_middle|>")]


@pytest.mark.parametrize(
    "fields",
    [{}, {"input_extra": EXTRA}, {"prompt": "a +"}, {"temperature": 1, "seed": 5, "top_k": 40}],
    ids=["plain", "extra", "prompt", "seeded"],
)
def test_infill_reads_what_llama_server_writes(coder_server, coder, fields):
    tok = Tokenizer.from_gguf(coder)
    ids = marked(tok, PREFIX, SUFFIX, fields.get("input_extra", ()), fields.get("prompt", ""))
    r = infill(coder_server, input_prefix=PREFIX, input_suffix=SUFFIX, ignore_eos=True, **fields)
    sampling = {k: v for k, v in fields.items() if k in ("temperature", "seed", "top_k")}
    want = complete(coder_server, prompt=ids, max_tokens=8, ignore_eos=True, **sampling)
    assert r["content"] == want["choices"][0]["text"] != ""
    assert r["tokens_evaluated"] == len(ids) == want["usage"]["prompt_tokens"]
    assert r["tokens_predicted"] == want["usage"]["completion_tokens"]
    assert r["stop"] is True and r["truncated"] is False
    assert r["stop_type"] == {"length": "limit", "stop": "eos"}[want["choices"][0]["finish_reason"]]
    assert r["has_new_line"] == ("\n" in r["content"])
    assert r["timings"]["prompt_n"] + r["timings"]["cache_n"] == len(ids)


def test_response_fields_pick_paths_as_llama_vim_asks(coder_server):
    fields = ["content", "timings/prompt_n", "timings/predicted_per_token_ms", "truncated",
              "tokens_cached", "timings/nothing", "nothing/at/all"]  # fmt: skip
    whole = infill(coder_server, input_prefix=PREFIX, input_suffix=SUFFIX, ignore_eos=True)
    r = infill(coder_server, input_prefix=PREFIX, input_suffix=SUFFIX, ignore_eos=True,
               response_fields=fields)  # fmt: skip
    assert set(r) == {"content", "timings/prompt_n", "timings/predicted_per_token_ms",
                      "truncated", "tokens_cached"}  # fmt: skip
    assert r["content"] == whole["content"] and r["truncated"] is False
    assert r["timings/prompt_n"] + r["tokens_cached"] == whole["tokens_evaluated"]
    timings = whole["timings"]
    assert timings["predicted_per_token_ms"] == round(
        timings["predicted_ms"] / timings["predicted_n"], 3
    )
    r = infill(coder_server, 400, input_prefix="x", response_fields=["a"] * 65)
    assert r["error"]["param"] == "response_fields"


def test_a_stop_word_is_reported_as_llama_server_does(coder_server):
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 16, "ignore_eos": True}
    whole = infill(coder_server, **body)
    word = whole["content"][3:5]
    assert len(word) == 2 and word not in whole["content"][:4]
    r = infill(coder_server, **body, stop=[word])
    assert r["stop_type"] == "word" and r["stopping_word"] == word
    assert r["content"] == whole["content"][: whole["content"].index(word)]


def test_the_stream_is_llama_servers_events(coder_server):
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 12, "ignore_eos": True}
    whole = infill(coder_server, **body)
    with httpx.stream("POST", coder_server.url + "/infill", json=body | {"stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: {") for line in lines)  # data only, no [DONE]
    events = [json.loads(line[6:]) for line in lines]
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == whole["content"]
    last = events[-1]
    assert last["tokens_predicted"] == whole["tokens_predicted"] == 12
    assert last["stop_type"] == "limit" and last["tokens_evaluated"] == whole["tokens_evaluated"]
    assert last["has_new_line"] == whole["has_new_line"] == ("\n" in whole["content"])


def test_n_predict_0_warms_the_cache_and_answers_nothing(coder_server):
    """llama.vscode sends other files' chunks with n_predict 0 ahead of the keystrokes that
    will need them: the prompt is read into the cache; the next request finds it there."""
    extra = [{"filename": "warm.py", "text": "def warm(x):\n    return x * 2\n" * 8}]
    body = {"input_prefix": "y = warm(", "input_suffix": ")\n", "input_extra": extra}
    warm = infill(coder_server, n_predict=0, **body)
    assert warm["content"] == "" and warm["tokens_predicted"] == 0
    then = infill(coder_server, **body)
    assert then["tokens_cached"] >= warm["tokens_evaluated"] - 8  # all but the last few


def test_a_long_request_is_cut_to_fit_nearest_the_cursor_first(coder_server, coder):
    """The coder server's context is 256 tokens: far more text than that still gets an
    answer, with `truncated` set; the prompt (the text at the cursor) is never cut."""
    tok = Tokenizer.from_gguf(coder)
    long = "for i in range(10):\n    print(i)\n" * 40
    many = [{"filename": f"f{i}.py", "text": long} for i in range(2)]  # within the bound
    seeded = {"temperature": 1, "seed": 9, "n_predict": 8}
    before = "".join(f"x{i} = {i}\n" for i in range(300))
    after = "".join(f"print(y{i})\n" for i in range(300))
    r = infill(coder_server, input_prefix=before, input_suffix=after, input_extra=many,
               prompt="x", **seeded)  # fmt: skip
    assert r["truncated"] is True
    # What is kept: the prompt whole, then the prefix's end and the suffix's start, 3:1 of the
    # room that 8 answer tokens, the bos and the three markers leave; no chunk.
    t, prompt = tok.token_id, tok.encode("x")
    room = 256 - 8 - 1 - 3 - len(prompt)
    prefix, suffix = tok.encode(before), tok.encode(after)
    kept_prefix, kept_suffix = prefix[len(prefix) - (room - room // 4) :], suffix[: room // 4]
    ids = [tok.bos_id, t("<|fim_prefix|>"), *kept_prefix, *prompt, t("<|fim_suffix|>")]
    ids += [*kept_suffix, t("<|fim_middle|>")]
    assert r["tokens_evaluated"] == len(ids) == 256 - 8
    want = complete(coder_server, prompt=ids, max_tokens=8, temperature=1, seed=9)
    assert r["content"] == want["choices"][0]["text"] != ""
    # The prefix's end and the suffix's start come first; chunks only with what is left.
    short = infill(coder_server, input_prefix=PREFIX, input_suffix=SUFFIX, input_extra=many)
    assert short["truncated"] is True
    assert short["tokens_evaluated"] > len(marked(tok, PREFIX, SUFFIX))  # some chunk kept
    r = infill(coder_server, 400, input_prefix="", prompt=long * 3)
    assert r["error"]["param"] == "prompt"


def test_a_long_file_is_cut_as_llama_server_cuts_it(coder, tmp_path):
    """Where the context holds more, llama-server still keeps 1536 tokens of the prefix's end
    and 510 less the prompt of the suffix's start (3/4 and 1/4 of its default batch, 2048),
    and so does mashbox: the same prompt, so the same answer an editor tuned on it expects."""
    tok = Tokenizer.from_gguf(coder)
    before = "".join(f"x{i} = {i}\n" for i in range(800))
    after = "".join(f"print(y{i})\n" for i in range(400))
    prefix, suffix, prompt = tok.encode(before), tok.encode(after), tok.encode("y")
    assert len(prefix) > 1536 and len(suffix) > 510
    t = tok.token_id
    ids = [t("<|repo_name|>"), *tok.encode("myproject\n"), t("<|file_sep|>")]
    ids += [*tok.encode("filename\n"), tok.bos_id, t("<|fim_prefix|>"), *prefix[-1536:]]
    ids += [*prompt, t("<|fim_suffix|>"), *suffix[: 510 - len(prompt)], t("<|fim_middle|>")]
    with serving(str(coder), "--ctx", "4096", "--slots", "1", "--threads", "1",
                 log=tmp_path / "wide.log") as wide:  # fmt: skip
        seeded = {"temperature": 1, "seed": 4}
        r = infill(wide, input_prefix=before, input_suffix=after, prompt="y", **seeded)
        assert r["tokens_evaluated"] == len(ids) and r["truncated"] is True
        want = complete(wide, prompt=ids, max_tokens=8, **seeded)
        assert r["content"] == want["choices"][0]["text"] != ""


def seeded_answer_with_a_later_line(server, **body) -> tuple[dict, int]:
    """A seeded answer (the tiny model writes bytes at random) with text on a line after its
    first, and that line's indentation."""
    for seed in range(40):
        r = infill(server, **body, temperature=1, seed=seed)
        head, newline, rest = r["content"].partition("\n")
        if newline and rest.lstrip(" \t"):
            return r | {"seed": seed}, len(rest) - len(rest.lstrip(" \t"))
    raise AssertionError("no seed gave a second line")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n_indent_ends_the_answer_at_a_shallower_line(coder_server, stream):
    """llama.vim and llama.vscode send the cursor line's indentation as n_indent: a later line
    indented less ends the completion (cut where its text starts), as llama-server ends it."""
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 64, "ignore_eos": True}
    whole, column = seeded_answer_with_a_later_line(coder_server, **body)
    text = whole["content"]
    cut = text.index("\n") + 1 + column  # where the second line's text starts
    limited = body | {"temperature": 1, "seed": whole["seed"], "n_indent": column + 1}
    if not stream:
        r = infill(coder_server, **limited)
    else:
        with httpx.stream("POST", coder_server.url + "/infill", json=limited | {"stream": True},
                          timeout=60) as resp:  # fmt: skip
            events = [json.loads(line[6:]) for line in resp.iter_lines() if line]
        r = events[-1] | {"content": "".join(e["content"] for e in events)}
    assert r["content"] == text[:cut] and len(r["content"]) < len(text)
    assert r["stop_type"] == "limit" and r["tokens_predicted"] < whole["tokens_predicted"]
    # As deep as the line is indented: it goes on (to its end, or a later shallower line).
    deep = infill(coder_server, **limited | {"n_indent": column})
    assert len(deep["content"]) > cut and text.startswith(deep["content"])


def test_t_max_predict_ms_ends_the_answer_at_a_newline_once_late(coder_server, coder):
    """Past t_max_predict_ms since the first token, the token that writes a newline is the
    answer's last (llama.vscode sends 1,000 ms, so a slow model still answers in time)."""
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 64, "ignore_eos": True}
    ids = marked(Tokenizer.from_gguf(coder), PREFIX, SUFFIX)
    for seed in range(40):  # an answer with a newline ten or more tokens in
        choice = complete(coder_server, prompt=ids, max_tokens=64, logprobs=0, ignore_eos=True,
                          temperature=1, seed=seed)["choices"][0]  # fmt: skip
        tokens = choice["logprobs"]["tokens"]
        lines = [i for i, t in enumerate(tokens) if "\n" in t]
        if any(i >= 10 for i in lines):
            break
    else:
        raise AssertionError("no seed gave a newline ten tokens in")
    seeded = body | {"temperature": 1, "seed": seed}
    whole = infill(coder_server, **seeded)
    assert whole["content"] == choice["text"] and whole["tokens_predicted"] == 64
    # In no time at all: the first newline after the first token's ends it (ten steps take
    # more than a millisecond).
    r = infill(coder_server, **seeded, t_max_predict_ms=1)
    n = r["tokens_predicted"]
    assert n - 1 in lines and n - 1 <= min(i for i in lines if i >= 10)
    assert choice["text"].startswith(r["content"]) and r["stop_type"] == "limit"
    assert "\n" in r["content"] and len(r["content"]) < len(choice["text"])
    # A generous limit, and 0 or less (none): the whole answer.
    for ms in (60_000, 0, -1):
        r = infill(coder_server, **seeded, t_max_predict_ms=ms)
        assert (r["content"], r["tokens_predicted"]) == (whole["content"], 64)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input_prefix": 5}, "input_prefix"),
        ({"input_suffix": ["x"]}, "input_suffix"),
        ({"prompt": {}}, "prompt"),
        ({"input_extra": "x"}, "input_extra"),
        ({"input_extra": ["x"]}, "input_extra[0]"),
        ({"input_extra": [{"filename": 3, "text": "x"}]}, "input_extra[0].filename"),
        ({"input_extra": [{"text": None}, {"text": 1}]}, "input_extra[1].text"),
        ({"input_extra": [{"text": "x"}] * 129}, "input_extra"),
        ({"input_extra": [{"text": "x" * 10**6}]}, "input_extra"),
        ({"input_extra": [{"text": "word " * 200}] * 100}, "input_extra"),  # each fits alone
        ({"n_predict": -2}, "n_predict"),
        ({"n_predict": "5"}, "n_predict"),
        ({"repeat_penalty": 0}, "repeat_penalty"),
        ({"temperature": 9}, "temperature"),
        ({"model": "other"}, "model"),
        ({"n_indent": 1.5}, "n_indent"),
        ({"n_indent": -1}, "n_indent"),
        ({"n_indent": "4"}, "n_indent"),
        ({"t_max_predict_ms": "500"}, "t_max_predict_ms"),
        ({"t_max_predict_ms": True}, "t_max_predict_ms"),
    ],
)
def test_a_bad_field_is_a_4xx_naming_it(coder_server, body, field):
    r = httpx.post(coder_server.url + "/infill", json={"input_prefix": "x"} | body, timeout=60)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == field


def test_a_model_without_markers_says_so(server):
    r = httpx.post(server.url + "/infill", json={"input_prefix": "x"}, timeout=60)
    assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]["message"]
