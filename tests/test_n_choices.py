"""`n` choices on OpenAI chat and completions: one answer of n seeded choices, each what its
derived seed gives alone, from one prefill of the prompt, released together."""

from __future__ import annotations

import hashlib
import json
import time

import attrs
import httpx
import openai
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from mashbox.engine.engine import Engine
from mashbox.events import MAX_WAITING_PER_TENANT, Finished, QueueFull, Request
from mashbox.protocol import SamplingParams
from mashbox.scheduler import Scheduler
from mashbox.text.tokenizer import Tokenizer
from support import rawhttp
from support.serverproc import serving, wait_for
from support.tinymodels import step_by_step
from test_scheduler import InProcessEngine

CHAT = "/v1/chat/completions"
SEED = 1234


def derived_seed(seed: int, index: int) -> int:
    """Choice `index`'s seed as the README and specs/openapi.json spell it out."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:{index}".encode("ascii")).digest()
    return int.from_bytes(digest[:8], "big") >> 1


@pytest.fixture(scope="module")
def choices_server(tiny_llama, tmp_path_factory):
    """Four slots, 10 ms engine steps: wide enough to leave a stream mid-answer."""
    with serving(
        str(tiny_llama), "--ctx", "2048", "--slots", "4", "--threads", "1",
        env={"MASHBOX_FAULTS": "slow=0.01"},
        log=tmp_path_factory.mktemp("choices") / "server.log",
    ) as proc:  # fmt: skip
        yield proc


@pytest.fixture
def client(choices_server):
    return openai.OpenAI(base_url=choices_server.url + "/v1", api_key="unused", max_retries=0)


def sse_events(text: str) -> list:
    """An SSE body's JSON payloads, the final [DONE] kept as a string."""
    out = []
    for block in text.strip().split("\n\n"):
        data = block.removeprefix("data: ")
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


# --- chat and completions: each choice is its derived seed alone -------------------------------


def chat_answer(client, n: int, seed: int) -> tuple[list[str], object]:
    r = client.chat.completions.create(
        model="tiny-llama.gguf",
        messages=[{"role": "user", "content": "Tell me a story about the sea."}],
        n=n,
        seed=seed,
        temperature=1,
        max_tokens=12,
    )
    assert [c.index for c in r.choices] == list(range(n))
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    return [c.message.content for c in r.choices], r.usage


def completion_answer(client, n: int, seed: int) -> tuple[list[str], object]:
    r = client.completions.create(
        model="tiny-llama.gguf",
        prompt="Once upon a time, by the sea,",
        n=n,
        seed=seed,
        temperature=1,
        max_tokens=12,
    )
    assert [c.index for c in r.choices] == list(range(n))
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    return [c.text for c in r.choices], r.usage


@pytest.mark.parametrize("ask", [chat_answer, completion_answer], ids=["chat", "completions"])
def test_four_choices_are_their_derived_seeds_alone(client, ask):
    texts, usage = ask(client, 4, SEED)
    assert len(set(texts)) > 1  # four seeds, not one answer four times
    assert ask(client, 4, SEED)[0] == texts  # the same four again
    alone = [ask(client, 1, derived_seed(SEED, i)) for i in range(4)]
    assert [text for (text,), _ in alone] == texts  # choice 0: the request's own seed
    # OpenAI's count: the prompt once, every choice's completion tokens.
    assert usage.prompt_tokens == alone[0][1].prompt_tokens
    assert usage.completion_tokens == sum(u.completion_tokens for _, u in alone)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def story(route: str, n: int) -> dict:
    """A seeded request for n choices of a 12-token story, on the chat or completions route."""
    if route == CHAT:
        body = {"messages": [{"role": "user", "content": "Tell me a story about the sea."}]}
    else:
        body = {"prompt": "Once upon a time, by the sea,"}
    return body | {"n": n, "seed": SEED, "temperature": 1, "max_tokens": 12}


@pytest.mark.parametrize("route", [CHAT, "/v1/completions"])
def test_continuous_usage_counts_each_choice_apart(choices_server, route):
    body = story(route, 3)
    whole = httpx.post(choices_server.url + route, json=body, timeout=60).json()
    options = {"include_usage": True, "continuous_usage_stats": True}
    r = httpx.post(
        choices_server.url + route,
        json={**body, "stream": True, "stream_options": options},
        timeout=60,
    )
    *chunks, usage_chunk, _ = sse_events(r.text)
    usage = usage_chunk["usage"]  # every choice's tokens, the prompt once (and now cached)
    assert usage["completion_tokens"] == whole["usage"]["completion_tokens"]
    assert usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    counts: dict[int, list[int]] = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        counts.setdefault(choice["index"], []).append(chunk["usage"]["completion_tokens"])
        prompt = chunk["usage"]["prompt_tokens"]
        assert prompt == whole["usage"]["prompt_tokens"]
        assert chunk["usage"]["total_tokens"] == prompt + chunk["usage"]["completion_tokens"]
    assert sorted(counts) == [0, 1, 2]
    for each in counts.values():  # each choice's own count, rising to its own end
        assert each == sorted(each) and 1 <= each[-1] <= 12
    assert sum(each[-1] for each in counts.values()) == whole["usage"]["completion_tokens"]


@pytest.mark.parametrize(("route", "field"), [(CHAT, "delta"), ("/v1/completions", "text")])
def test_streamed_choices_carry_their_index_and_end_once(choices_server, route, field):
    body = story(route, 4)
    whole = httpx.post(choices_server.url + route, json=body, timeout=60).json()
    r = httpx.post(
        choices_server.url + route,
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
        timeout=60,
    )
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    *chunks, usage_chunk, _ = events
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    assert len({c["id"] for c in [*chunks, usage_chunk]}) == 1  # one answer
    texts, finishes = {}, {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        i = choice["index"]
        piece = choice["delta"].get("content") if field == "delta" else choice["text"]
        texts[i] = texts.get(i, "") + (piece or "")
        if choice["finish_reason"] is not None:
            assert i not in finishes  # each choice ends once
            finishes[i] = choice["finish_reason"]
    assert sorted(texts) == sorted(finishes) == [0, 1, 2, 3]
    for c in whole["choices"]:
        text = c["message"]["content"] if field == "delta" else c["text"]
        assert texts[c["index"]] == text
        assert finishes[c["index"]] == c["finish_reason"]


def test_completion_log_probabilities_per_choice(client):
    r = client.completions.create(
        model="tiny-llama.gguf",
        prompt="The sea is",
        n=2,
        seed=SEED,
        temperature=1,
        max_tokens=6,
        logprobs=1,
    )
    for c in r.choices:
        assert "".join(c.logprobs.tokens) == c.text
        assert c.logprobs.text_offset[0] == 0  # each choice's offsets start at its own text
        alone = client.completions.create(
            model="tiny-llama.gguf",
            prompt="The sea is",
            seed=derived_seed(SEED, c.index),
            temperature=1,
            max_tokens=6,
            logprobs=1,
        ).choices[0]
        assert alone.logprobs.tokens == c.logprobs.tokens
        # The same tokens; their float32 log-softmax alone or in a batch of two: to rounding.
        assert c.logprobs.token_logprobs == pytest.approx(alone.logprobs.token_logprobs, 1e-5)


# --- one prefill -------------------------------------------------------------------------------


def prefilled_tokens(url: str) -> float:
    """Prompt tokens the server has computed: those looked up less those a cache served."""
    samples = {
        s.name: s.value
        for family in text_string_to_metric_families(httpx.get(url + "/metrics").text)
        for s in family.samples
    }
    return (
        samples["mashbox:prefix_cache_queries_total"] - samples["mashbox:prefix_cache_hits_total"]
    )


def test_the_prompt_is_prefilled_once_for_all_choices(choices_server):
    url = choices_server.url
    wait_for(lambda: httpx.get(url + "/health").json()["live_rows"] == 0, timeout=30)
    before = prefilled_tokens(url)
    prompt = "A prompt no other test sends, long enough to matter: " + "waves and sand " * 20
    body = {"prompt": prompt, "n": 4, "seed": SEED, "temperature": 1, "max_tokens": 4}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    n_prompt = r.json()["usage"]["prompt_tokens"]
    cached = r.json()["timings"]["cache_n"]  # choice 0's: what a slot still held (a BOS...)
    assert n_prompt > 50 and cached < 5
    # Choice 0 prefills the prompt; each other choice copies all of it but its last token,
    # which it feeds itself to sample its own first token.
    assert prefilled_tokens(url) - before == n_prompt - cached + 3


async def test_later_choices_copy_choice_0s_prefill_and_sample_as_alone(tiny_llama):
    """Through the scheduler: choice 0's prompt is the only one the engine prefills (the
    others' last tokens aside); each choice answers what its seed gives alone."""
    tok = Tokenizer.from_gguf(tiny_llama)
    prompt = tuple(tok.encode("Tell me a story about the sea, and the ships on it. " * 4))
    params = [SamplingParams(1.0, seed=derived_seed(SEED, i)) for i in range(4)]
    reference = Engine(tiny_llama, slots=1, ctx=512)
    expected = [step_by_step(reference, [prompt], 8, p)[0] for p in params]
    worker = InProcessEngine(Engine(tiny_llama, slots=4, ctx=512))
    scheduler = Scheduler(tok, worker, slots=4, ctx=512, prefill_chunk=32)  # 3 chunks
    requests = [Request(prompt, p, 8, ignore_eos=True) for p in params]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(scheduler.run)
        events = scheduler.submit_choices(requests)
        ends = {}
        async with events:
            async for index, event in events:
                if isinstance(event, Finished):
                    ends[index] = event
        nursery.cancel_scope.cancel()
    assert sorted(ends) == [0, 1, 2, 3]
    prefilled = sum(len(p.token_ids) for step in worker.ran for p in step.prefills)
    assert prefilled == len(prompt) + 3
    (first, *_) = worker.ran
    assert [a.slot for a in first.admits] == [first.prefills[0].slot]  # choice 0 alone
    (shared,) = [step for step in worker.ran if step.shares]  # the others, as one
    assert len(shared.shares) == 3 and len({m.slot for m in shared.shares}) == 3
    assert {(m.source, m.n) for m in shared.shares} == {(first.admits[0].slot, len(prompt) - 1)}
    leader = events.sequences[0]
    assert [e.usage.cached_tokens for _, e in sorted(ends.items())] == [0, *[len(prompt) - 1] * 3]
    assert [s.output_ids for s in events.sequences] == expected
    assert leader.choice == 0 and all(s.leader is leader for s in events.sequences[1:])


def test_choices_count_against_the_tenants_queue_places(tiny_llama):
    tok = Tokenizer.from_gguf(tiny_llama)
    scheduler = Scheduler(tok, InProcessEngine(None), slots=1, ctx=512)  # never stepped
    one = Request(tuple(tok.encode("Hello")), SamplingParams(), 4, tenant="alice")
    for _ in range(MAX_WAITING_PER_TENANT - 3):
        scheduler.submit(one)
    with pytest.raises(QueueFull) as exc:
        scheduler.submit_choices([one] * 4)  # four places; three are left
    assert not exc.value.whole_queue
    assert len(scheduler.waiting) == MAX_WAITING_PER_TENANT - 3  # none of the four queued
    scheduler.submit_choices([attrs.evolve(one)] * 3)
    assert len(scheduler.waiting) == MAX_WAITING_PER_TENANT


# --- release and refusals ----------------------------------------------------------------------


def test_a_client_leaving_mid_stream_frees_every_choices_slot(choices_server):
    url = choices_server.url
    wait_for(lambda: httpx.get(url + "/health").json()["live_rows"] == 0, timeout=30)
    sock = rawhttp.connect(url)
    body = {
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "n": 4,
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    rawhttp.post_json(sock, CHAT, body)
    rawhttp.read_until(sock, b'"content": "')  # decoding has begun
    wait_for(lambda: httpx.get(url + "/health").json()["live_rows"] == 4, timeout=10)
    sock.close()
    t0 = time.monotonic()
    wait_for(lambda: httpx.get(url + "/health").json()["live_rows"] == 0, timeout=2.0)
    assert time.monotonic() - t0 < 2.0  # 1500 steps of 10 ms would take 15 s


@pytest.mark.parametrize("fault", ["crash@1", "raise@6"])
def test_choices_run_again_after_an_engine_fault(choices_server, tiny_llama, fault):
    """Choice 0's prefill lost, or every choice's decode: each runs again from its start and
    answers as if nothing happened (here two slots: choice 2 waits for one, then copies the
    prompt a finished choice left in its slot)."""
    body = {
        "prompt": "Once upon a time, by the sea,",
        "n": 3,
        "seed": SEED,
        "temperature": 1,
        "max_tokens": 12,
        "ignore_eos": True,
    }
    want = httpx.post(choices_server.url + "/v1/completions", json=body, timeout=60).json()
    with serving(
        str(tiny_llama), "--ctx", "256", "--slots", "2", "--threads", "1",
        env={"MASHBOX_FAULTS": fault},
    ) as proc:  # fmt: skip
        r = httpx.post(proc.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["system_fingerprint"] == want["system_fingerprint"]  # the same answers id
        assert [c["text"] for c in got["choices"]] == [c["text"] for c in want["choices"]]
        assert got["usage"] == want["usage"]
        assert httpx.get(proc.url + "/health").json()["worker_restarts"] == 1


@pytest.mark.parametrize("route", [CHAT, "/v1/completions"])
@pytest.mark.parametrize("n", [0, 9, "x"])
def test_n_out_of_range_is_400_naming_it(choices_server, route, n):
    if route == CHAT:
        body = {"messages": [{"role": "user", "content": "Hi"}], "n": n, "max_tokens": 2}
    else:
        body = {"prompt": "Hi", "n": n, "max_tokens": 2}
    r = httpx.post(choices_server.url + route, json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "n"
    assert "n must" in error["message"]


# --- completions' list of prompts: n choices of each, each prompt as alone --------------------

PROMPTS = ["Once upon a time, by the sea,", "The ships came home", "Far away, the hills"]


def completions(url: str, prompt, n: int = 1, **extra) -> dict:
    body = {"prompt": prompt, "n": n, "seed": SEED, "temperature": 1, "max_tokens": 8} | extra
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_each_prompt_of_a_list_is_answered_as_alone(client):
    r = client.completions.create(
        model="tiny-llama.gguf", prompt=PROMPTS, n=2, seed=SEED, temperature=1, max_tokens=8
    )
    assert [c.index for c in r.choices] == list(range(6))  # prompt i's choice j: 2 * i + j
    alone = [
        client.completions.create(
            model="tiny-llama.gguf", prompt=p, n=2, seed=SEED, temperature=1, max_tokens=8
        )
        for p in PROMPTS
    ]
    assert [c.text for c in r.choices] == [c.text for a in alone for c in a.choices]
    assert len({c.text for c in r.choices}) > 2
    # OpenAI's count: each prompt once, every choice's completion tokens.
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)


def test_token_id_prompts_are_taken_as_they_are(choices_server, tiny_llama):
    tok = Tokenizer.from_gguf(tiny_llama)
    ids = [tok.encode(p, add_bos=tok.add_bos) for p in PROMPTS[:2]]
    url = choices_server.url
    as_text = completions(url, PROMPTS[:2])
    as_ids = completions(url, ids)
    assert [c["text"] for c in as_ids["choices"]] == [c["text"] for c in as_text["choices"]]
    assert as_ids["usage"]["prompt_tokens"] == sum(map(len, ids))
    one = completions(url, ids[1])  # one prompt's token ids, not a list of them
    assert one["choices"][0]["text"] == as_ids["choices"][1]["text"]
    assert one["usage"]["prompt_tokens"] == len(ids[1])


def test_a_list_of_prompts_streams_every_choice_then_the_usage_once(choices_server):
    url = choices_server.url
    whole = completions(url, PROMPTS, 2)
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"prompt": PROMPTS, "n": 2, "seed": SEED, "temperature": 1, "max_tokens": 8}
    r = httpx.post(
        url + "/v1/completions",
        json={**body, "stream": True, "stream_options": options},
        timeout=60,
    )
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    *chunks, usage_chunk, _ = events
    assert usage_chunk["usage"] == whole["usage"]
    texts: dict[int, str] = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        i = choice["index"]
        texts[i] = texts.get(i, "") + choice["text"]
        # Each choice's usage counts its own prompt.
        own = completions(url, PROMPTS[i // 2], max_tokens=1)["usage"]["prompt_tokens"]
        assert chunk["usage"]["prompt_tokens"] == own
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}


def test_a_prompt_listed_twice_is_prefilled_once(choices_server):
    url = choices_server.url
    wait_for(lambda: httpx.get(url + "/health").json()["live_rows"] == 0, timeout=30)
    before = prefilled_tokens(url)
    prompt = "Listed twice and sent by no other test: " + "tides and shells " * 20
    r = completions(url, [prompt, prompt], max_tokens=4)
    n_prompt = r["usage"]["prompt_tokens"] // 2
    cached = r["timings"]["cache_n"]
    assert n_prompt > 50 and cached < 5
    # The first prefills it; the second copies all of it but the token it feeds itself.
    assert prefilled_tokens(url) - before == n_prompt - cached + 1
    assert r["choices"][0]["text"] == r["choices"][1]["text"]  # the same seed, the same bits


@pytest.mark.parametrize(
    ("prompt", "n", "says"),
    [
        ([], 1, "prompt must not be empty"),
        ([[]], 1, "prompt must not be empty"),
        (["Hi", ""], 1, "prompt[1] must not be empty"),
        (["Hi", [1, 2]], 1, "a list of strings, a list of token ids"),
        ([True], 1, "a list of strings, a list of token ids"),
        ([1.5], 1, "a list of strings, a list of token ids"),
        ({"text": "Hi"}, 1, "a list of strings, a list of token ids"),
        ([[1, "x"]], 1, "must be a list of token ids"),
        ([[[1]]], 1, "must be a list of token ids"),
        ([1, -1], 1, "token id -1 is not in the vocabulary"),
        ([[1], [1, 10**12]], 1, "prompt[1]: token id 1000000000000 is not"),
        ([1] * 2048, 1, "prompt is 2048 tokens; the context is 2048"),
        (["Hi", "sea " * 3000], 1, "prompt[1] is"),
        (["Hi"] * 33, 1, "33 prompts; at most 32"),
        (["Hi"] * 5, 7, "5 prompts of n=7 choices each ask for 35 answers; at most 32"),
    ],
)
def test_a_malformed_prompt_list_is_400_naming_the_prompt(choices_server, prompt, n, says):
    body = {"prompt": prompt, "n": n, "max_tokens": 2}
    r = httpx.post(choices_server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    where = says.split()[0].rstrip(":") if says.startswith("prompt[") else "prompt"
    assert error["param"] == where and says in error["message"], error
