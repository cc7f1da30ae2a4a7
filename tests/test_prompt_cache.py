"""The prompt cache: slot prefix reuse and the host-memory cache are exact, capped and LRU."""

from __future__ import annotations

import httpx
import pytest
import torch

from mashbox.engine.engine import Engine
from mashbox.kv_moves import KVMoves
from mashbox.memory import host_cache_cap, memory_available
from mashbox.prompt_cache import MIN_TOKENS, PromptCache
from mashbox.protocol import Admit, Decode, Prefill, Restore, SamplingParams, Save, Step
from mashbox.sequence import Slot
from support.serverproc import serving

TOKENS = list(range(10, 10 + 2 * MIN_TOKENS))


def test_lru_eviction_at_the_cap():
    cache = PromptCache(cap_bytes=100 * 2 * MIN_TOKENS, bytes_per_token=100)  # two entries
    a, _ = cache.add(TOKENS[:MIN_TOKENS], "")
    b, _ = cache.add([1] * MIN_TOKENS, "")
    cache.touch(a)  # a is now the most recently used
    c, evicted = cache.add([2] * MIN_TOKENS, "")
    assert [e.id for e in evicted] == [b.id] and cache.evictions == 1
    assert set(cache.entries) == {a.id, c.id}
    assert cache.nbytes == 2 * MIN_TOKENS * 100 <= cache.cap_bytes


def test_a_longer_prefix_replaces_its_own_prefix_and_copies_count_once():
    cache = PromptCache(cap_bytes=10**6, bytes_per_token=10)
    short, _ = cache.add(TOKENS[:MIN_TOKENS], "")
    assert not cache.worth_saving(TOKENS[:MIN_TOKENS], "")  # already saved
    long, evicted = cache.add(TOKENS, "")
    assert evicted == [short] and cache.evictions == 0  # redundant, not pushed out
    assert cache.nbytes == len(TOKENS) * 10
    assert cache.best(TOKENS[:40] + [0, 0], "") == (long, 40)


def test_namespaces_do_not_mix():
    cache = PromptCache(cap_bytes=10**6, bytes_per_token=10, namespace="model-a")
    cache.add(TOKENS, "")
    assert cache.best(TOKENS, "")[1] == len(TOKENS)
    assert cache.best(TOKENS, "", namespace="model-b") == (None, 0)


def test_tenants_do_not_mix():
    """One tenant's saved prompt never answers another's, nor is it saved again for them."""
    cache = PromptCache(cap_bytes=10**6, bytes_per_token=10)
    mine, _ = cache.add(TOKENS, "alice")
    assert cache.best(TOKENS, "alice") == (mine, len(TOKENS))
    assert cache.best(TOKENS, "bob") == (None, 0)
    assert cache.worth_saving(TOKENS, "bob") and not cache.worth_saving(TOKENS, "alice")
    theirs, evicted = cache.add(TOKENS[:MIN_TOKENS], "bob")  # not alice's prefix to drop
    assert evicted == [] and cache.best(TOKENS, "bob") == (theirs, MIN_TOKENS)


def test_short_or_oversized_prefixes_are_not_saved():
    cache = PromptCache(cap_bytes=10 * MIN_TOKENS, bytes_per_token=10)
    assert not cache.worth_saving(TOKENS[: MIN_TOKENS - 1], "")
    assert cache.worth_saving(TOKENS[:MIN_TOKENS], "")
    assert not cache.worth_saving(TOKENS[: MIN_TOKENS + 1], "")  # bigger than the whole cap
    assert not PromptCache(0, 10).worth_saving(TOKENS, "")


def test_a_restored_prefix_decodes_like_a_fresh_prefill(tiny_llama):
    engine = Engine(tiny_llama, slots=2, ctx=256)
    prompt, greedy = tuple(range(5, 105)), SamplingParams()

    def generate(slot: int, first: int, steps: int = 8) -> list[int]:
        out = [first]
        for i in range(steps):
            res = engine.step(Step(decodes=(Decode(slot, out[-1], len(prompt) + i),)))
            out.append(res.tokens[slot])
        return out

    first = engine.step(
        Step(admits=(Admit(0, greedy, prompt),), prefills=(Prefill(0, 0, prompt, True),))
    ).tokens[0]
    fresh = generate(0, first)
    # Save slot 0's prompt, overwrite slot 0, restore into slot 1, prefill only the last token.
    engine.step(Step(saves=(Save(0, 7, len(prompt)),)))
    engine.step(
        Step(admits=(Admit(0, greedy, (3,) * 50),), prefills=(Prefill(0, 0, (3,) * 50, True),))
    )
    restored = engine.step(
        Step(
            restores=(Restore(1, 7, len(prompt) - 1),),
            admits=(Admit(1, greedy, prompt),),
            prefills=(Prefill(1, len(prompt) - 1, prompt[-1:], True),),
        )
    ).tokens[1]
    assert generate(1, restored) == fresh
    k, v = engine.host_cache[7]
    assert k.shape == v.shape == (2, 2, len(prompt), 16)  # layers, kv heads, positions, dim
    assert torch.equal(k[:, :, :-1], engine.cache.k[:, 1, :, : len(prompt) - 1])


def test_one_round_can_restore_an_entry_and_drop_it():
    """Placed in one round (8 streams of one prompt after a finished one): the first request
    restores entry 1 (the prompt), the next lands on the slot that holds the prompt and its
    answer, which is saved first, and entry 1, a prefix of it, goes: one step carries both."""
    prompt = TOKENS[:MIN_TOKENS]
    cache = PromptCache(cap_bytes=10**6, bytes_per_token=10)
    first, _ = cache.add(prompt, "")
    slots = [Slot(0, tokens=prompt + [7] * 20), Slot(1)]
    moves = KVMoves(slots, cache)
    assert moves.bring_prefix(slots[1], "", prompt, 0, len(prompt) - 1) == len(prompt) - 1
    assert moves.bring_prefix(slots[0], "", prompt, len(prompt) - 1, len(prompt) - 1) > 0
    step = moves.take()
    assert [r.entry for r in step["restores"]] == [first.id] and step["drops"] == (first.id,)


def test_an_entry_restored_and_dropped_in_one_step_is_restored_first(tiny_llama):
    """The engine runs such a step's restores before its drops (it once dropped first: the
    worker died on a KeyError and the streams starting then got 503s)."""
    engine = Engine(tiny_llama, slots=2, ctx=256)
    prompt, greedy = tuple(range(5, 105)), SamplingParams()
    engine.step(Step(admits=(Admit(0, greedy, prompt),), prefills=(Prefill(0, 0, prompt, True),)))
    engine.step(Step(saves=(Save(0, 7, 60),)))
    engine.step(
        Step(
            saves=(Save(0, 8, len(prompt)),),
            restores=(Restore(1, 7, 60),),
            drops=(7,),
            admits=(Admit(1, greedy, prompt),),
            prefills=(Prefill(1, 60, prompt[60:], True),),
        )
    )
    assert set(engine.host_cache) == {8}
    assert torch.equal(engine.cache.k[:, 1, :, :100], engine.cache.k[:, 0, :, :100])


@pytest.fixture(scope="module")
def cached_server(tiny_llama):
    """One slot, so every other prompt evicts the slot's; 1 MiB of host cache."""
    with serving(
        str(tiny_llama), "--ctx", "2048", "--slots", "1", "--cache-ram", "1", "--threads", "1"
    ) as proc:
        yield proc


def complete(url: str, prompt: str, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": 12, "ignore_eos": True, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=120).json()


def test_host_cache_restores_a_prompt_exactly(cached_server):
    url = cached_server.url
    a = "Paris is the capital of France. " * 30
    b = "The sea is wide and the wind blows. " * 30
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 7}):
        first = complete(url, a, **sampling)
        complete(url, b, **sampling)  # takes the only slot: a's prefix goes to host memory
        again = complete(url, a, **sampling)
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert again["timings"]["cache_n"] == again["usage"]["prompt_tokens"] - 1
        assert again["timings"]["prompt_n"] == 1
    health = httpx.get(url + "/health").json()
    assert 0 < health["host_cache_bytes"] <= health["host_cache_cap_bytes"] == 2**20
    assert health["cache_bytes"] == health["host_cache_bytes"]
    assert httpx.get(url + "/v1/models").json()["data"][0]["cache_ram_mib"] == 1


def test_host_cache_evicts_at_its_cap(cached_server):
    url = cached_server.url
    before = httpx.get(url + "/health").json()["host_cache_evictions"]
    for word in ("alpha", "bravo", "charlie", "delta"):
        r = complete(url, f"{word} is a word I say. " * 90, max_tokens=1)  # 1,300-1,500 tokens
        assert r["usage"]["prompt_tokens"] * 512 > 2**19  # so two never fit in 1 MiB
    health = httpx.get(url + "/health").json()
    assert health["host_cache_evictions"] > before
    assert health["host_cache_bytes"] <= health["host_cache_cap_bytes"]


def test_a_busy_slots_prefix_is_shared_exactly(tiny_llama):
    """A request whose prompt shares a prefix with one decoding now copies that prefix from
    the busy slot (no host cache here) and answers what it answers with a fresh prefill."""
    system = "Paris is the capital of France. " * 30
    args = "--ctx", "2048", "--slots", "2", "--threads", "1", "--cache-ram", "0"
    with serving(str(tiny_llama), *args) as proc:
        url = proc.url
        alone = complete(url, system + "The sea is wide.")  # a fresh server: nothing to reuse
        assert alone["timings"]["cache_n"] == 0
        body = {"prompt": system + "Tell me more.", "max_tokens": 400, "ignore_eos": True,
                "stream": True}  # fmt: skip
        with httpx.Client(timeout=120) as http:
            with http.stream("POST", url + "/v1/completions", json=body) as running:
                lines = running.iter_lines()
                next(line for line in lines if '"text": "' in line and '"text": ""' not in line)
                shared = complete(url, system + "The sea is wide.")
                assert any(line.startswith("data: [DONE]") for line in lines)
    assert shared["choices"][0]["text"] == alone["choices"][0]["text"]
    prompt_tokens = alone["usage"]["prompt_tokens"]
    # The whole system text, not the tail that differs (and never the last token).
    assert prompt_tokens - 10 < shared["timings"]["cache_n"] < prompt_tokens


def test_the_ram_cache_cap_leaves_the_kv_cache_and_half_the_rest():
    gib = 2**30
    assert host_cache_cap(8 * gib, 20 * gib, 4 * gib) == 8 * gib  # room enough: as asked
    assert host_cache_cap(8 * gib, 10 * gib, 4 * gib) == 3 * gib  # half of what is left
    assert host_cache_cap(8 * gib, 3 * gib, 4 * gib) == 0  # the KV cache alone fills it
    assert host_cache_cap(8 * gib, None, 4 * gib) == 8 * gib  # nothing says: as asked


def test_a_ram_cache_larger_than_the_machine_is_capped_loudly(tiny_llama):
    """--cache-ram past what the machine has would end in the OOM killer once the cache
    filled, hours later: the server caps it at load, says so, and reports the cap."""
    asked = 2**30  # MiB: a PiB
    with serving(str(tiny_llama), "--ctx", "512", "--cache-ram", str(asked)) as server:
        reported = httpx.get(server.url + "/v1/models").json()["data"][0]["cache_ram_mib"]
        cap = httpx.get(server.url + "/health").json()["host_cache_cap_bytes"]
        log = "\n".join(server.lines)
    assert 0 < reported < memory_available() // 2**20 // 2 + 1
    assert cap // 2**20 == reported
    assert f"not --cache-ram's {asked}" in log and "WARNING: the RAM prompt cache" in log
