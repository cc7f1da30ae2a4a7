"""The prompt cache on disk (--cache-dir): a restored prefix is exactly what a fresh prefill
writes, a torn, corrupted or foreign file is removed and never loaded, the directory stays
under its cap, and a restarted server does not prefill a repeated prompt again."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import httpx
import pytest
import torch

from mashbox.engine import disk_cache
from mashbox.engine.engine import Engine
from mashbox.prompt_cache import MIN_DISK_TOKENS, PromptCache, disk_bytes, disk_name
from mashbox.protocol import Admit, DiskEntry, Persist, Prefill, Restore, SamplingParams, Step
from support.serverproc import serving

PROMPT = tuple(5 + i % 80 for i in range(MIN_DISK_TOKENS + 44))
N = len(PROMPT) - 1  # what a restore brings: generation re-runs the last prompt token
GREEDY = SamplingParams()


def engine(model: Path, cache_dir: Path, cap: int = 2**30) -> Engine:
    return Engine(model, slots=2, ctx=512, cache_dir=cache_dir, cache_dir_bytes=cap)


def prefill(e: Engine, slot: int, prompt=PROMPT) -> int:
    step = Step(admits=(Admit(slot, GREEDY, prompt),), prefills=(Prefill(slot, 0, prompt, True),))
    return e.step(step).tokens[slot]


def persist(e: Engine, slot: int, tokens=PROMPT, tenant: str = "") -> str:
    """Write the slot's prefix to disk, as the scheduler asks; wait until it is written."""
    name = disk_name(e.info.disk_key, tenant, tokens)
    e.step(Step(persists=(Persist(slot, name, tenant, tuple(tokens)),)))
    e.disk.flush()
    return name


def restore(e: Engine, slot: int, name: str, failed: tuple = ()) -> int:
    """Restore all but the last prompt token from the file, prefill that one, sample."""
    step = Step(
        restores=(Restore(slot, 0, N, name, PROMPT[:N]),),
        admits=(Admit(slot, GREEDY, PROMPT),),
        prefills=(Prefill(slot, N, PROMPT[N:], True),),
    )
    result = e.step(step)
    assert result.disk_failed == failed  # what the scheduler's index then forgets
    return result.tokens[slot]


def kv(e: Engine, slot: int, n: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    return e.cache.k[:, slot, :, :n].clone(), e.cache.v[:, slot, :, :n].clone()


def _bytes_in(directory: Path) -> int:
    """The sizes of the files in `directory` now. The server writes and removes them in the
    background: one removed between the listing and its stat is gone, and counts nothing
    (stat raised FileNotFoundError there once, in CI)."""
    total = 0
    for path in directory.iterdir():
        with contextlib.suppress(FileNotFoundError):
            total += path.stat().st_size
    return total


def test_a_restored_prefix_is_exactly_a_fresh_prefill(tiny_llama, tmp_path):
    """Bit for bit: the file holds the cache's own bytes (same dtype, no conversion), and the
    key holds everything that computes them (model, layout, decode weights, kernels, torch),
    so a new engine process reads back what its own prefill writes."""
    first = engine(tiny_llama, tmp_path)
    token = prefill(first, 0)
    name = persist(first, 0)
    written = kv(first, 0, len(PROMPT))

    again = engine(tiny_llama, tmp_path)  # a new engine: as after a restart
    assert again.info.disk_key == first.info.disk_key
    assert again.info.disk_entries == (DiskEntry(name, "", PROMPT),)
    assert restore(again, 1, name) == token
    fresh_token = prefill(again, 0)
    for restored, fresh, saved in zip(kv(again, 1), kv(again, 0), written, strict=True):
        assert torch.equal(restored, fresh)
        assert torch.equal(restored, saved[:, :, :N])
    assert fresh_token == token


def _written(model: Path, cache_dir: Path, tenant: str = "") -> Path:
    e = engine(model, cache_dir)
    prefill(e, 0)
    return cache_dir / (persist(e, 0, tenant=tenant) + disk_cache.SUFFIX)


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["truncated", "header byte", "magic"])
def test_a_torn_or_damaged_file_is_removed_at_start(tiny_llama, tmp_path, damage):
    path = _written(tiny_llama, tmp_path)
    if damage == "truncated":  # a crash in the middle of a write someone else made
        path.write_bytes(path.read_bytes()[:-100])
    elif damage == "header byte":  # a token id or the tenant, say
        _flip(path, disk_cache._PREFIX.size + 40)
    else:
        _flip(path, 0)
    e = engine(tiny_llama, tmp_path)
    assert e.info.disk_entries == () and not path.exists()


def test_a_flipped_payload_byte_is_never_loaded(tiny_llama, tmp_path):
    """The header is whole, so the start keeps the entry; its crc32 fails when restored: the
    file goes, and the engine prefills the tokens instead, so the slot holds the same KV (to
    float32 rounding: in 256-token chunks, as the scheduler's, where this fresh prefill is one
    forward of all 300; chunkings round matmuls differently)."""
    path = _written(tiny_llama, tmp_path)
    _flip(path, path.stat().st_size - 7)
    e = engine(tiny_llama, tmp_path)
    assert len(e.info.disk_entries) == 1
    token = restore(e, 1, path.stem, failed=(path.stem,))
    assert not path.exists()
    assert token == prefill(e, 0)
    for restored, fresh in zip(kv(e, 1), kv(e, 0), strict=True):
        torch.testing.assert_close(restored, fresh, rtol=1e-5, atol=1e-5)


def test_another_models_file_is_removed(tiny_llama, tiny_qwen2, tmp_path):
    foreign = _written(tiny_qwen2, tmp_path)
    key = engine(tiny_llama, tmp_path / "empty").info.disk_key
    renamed = foreign.with_name(disk_name(key, "", PROMPT) + disk_cache.SUFFIX)
    foreign.rename(renamed)  # even under the name this model would give it
    e = engine(tiny_llama, tmp_path)
    assert e.info.disk_entries == () and not renamed.exists()
    assert e.disk.read(renamed.stem, PROMPT[:N]) is None


def test_another_versions_file_is_removed(tiny_llama, tmp_path, monkeypatch):
    """A file written by other engine code (an older mashbox) may hold other bits for the
    same prompt: removed at the start, never loaded."""
    written = _written(tiny_llama, tmp_path)
    key = engine(tiny_llama, tmp_path / "empty").info.disk_key
    monkeypatch.setattr(disk_cache, "engine_code", lambda: "another version")
    e = engine(tiny_llama, tmp_path)
    assert e.info.disk_key != key
    assert e.info.disk_entries == () and not written.exists()


def test_the_start_keeps_the_directory_under_its_cap(tiny_llama, tmp_path):
    """Least recently used (by mtime: a restore touches its file) go first."""
    e = engine(tiny_llama, tmp_path)
    names = []
    for i in range(3):
        prompt = (i + 1,) + PROMPT[1:]
        prefill(e, 0, prompt)
        names.append(persist(e, 0, prompt))
    size = (tmp_path / (names[0] + disk_cache.SUFFIX)).stat().st_size
    old = tmp_path / (names[1] + disk_cache.SUFFIX)
    os.utime(old, (1, 1))  # the least recently used
    after = engine(tiny_llama, tmp_path, cap=2 * size)
    assert {d.name for d in after.info.disk_entries} == {names[0], names[2]}
    assert _bytes_in(tmp_path) <= 2 * size


def test_the_index_evicts_least_recently_used_files_at_the_cap():
    bpt = 100
    one = disk_bytes(MIN_DISK_TOKENS, bpt, "")
    cache = PromptCache(0, bpt)
    cache.use_disk(2 * one, "key")
    a, _ = cache.add_disk(PROMPT[:MIN_DISK_TOKENS], "")
    b, _ = cache.add_disk((1,) * MIN_DISK_TOKENS, "")
    cache.touch(a)
    c, evicted = cache.add_disk((2,) * MIN_DISK_TOKENS, "")
    assert evicted == [b] and cache.disk_evictions == 1
    assert cache.disk_nbytes <= cache.disk_cap_bytes
    assert {e.file for e in cache.disk.values()} == {a.file, c.file}
    assert a.file == disk_name("key", "", PROMPT[:MIN_DISK_TOKENS])
    # A repeat the disk holds half of or more is not written again; its extension replaces it.
    assert not cache.worth_persisting(PROMPT[: MIN_DISK_TOKENS + 10], "")
    assert cache.worth_persisting(PROMPT[: MIN_DISK_TOKENS + 10], "bob")  # not bob's
    longer = PROMPT + PROMPT
    assert cache.worth_persisting(longer[: 2 * MIN_DISK_TOKENS + 1], "")
    d, evicted = cache.add_disk(PROMPT, "")
    assert a in evicted  # its own prefix: redundant
    assert cache.best(PROMPT, "") == (d, len(PROMPT))
    assert cache.best(PROMPT, "bob") == (None, 0)
    cache.forget_disk([d.file])  # the engine found it damaged: never restored from again
    assert cache.best(PROMPT, "")[0] is not d and cache.worth_persisting(PROMPT, "")


# --- servers ------------------------------------------------------------------------------

LONG = "Paris is the capital of France. " * 60  # ~430 tokens of the tiny vocabulary


def complete(url: str, prompt: str = LONG, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": 12, "ignore_eos": True, "temperature": 0, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=120).json()


def _serve(model: Path, cache_dir: Path, *extra: str):
    args = "--ctx", "2048", "--slots", "2", "--threads", "1", "--cache-dir", str(cache_dir)
    return serving(str(model), *args, *extra)


def chat(url: str, user: str = "Hello") -> dict:
    """An agent's request: a long fixed system prompt, then the user's turn."""
    messages = [{"role": "system", "content": LONG}, {"role": "user", "content": user}]
    body = {"messages": messages, "max_tokens": 12, "ignore_eos": True, "temperature": 0}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()


def test_a_restarted_server_does_not_prefill_a_repeated_prompt_again(tiny_llama, tmp_path):
    with _serve(tiny_llama, tmp_path) as proc:
        fresh = chat(proc.url)  # prefilled: nothing to reuse
        assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        chat(proc.url)  # a repeat: reused from its slot, and written to disk
    files = list(tmp_path.glob("*" + disk_cache.SUFFIX))
    assert len(files) == 1
    prompt_tokens = fresh["usage"]["prompt_tokens"]
    with _serve(tiny_llama, tmp_path) as proc:
        assert "prompt cache on disk: " in proc.output() and "1 prefixes" in proc.output()
        # Another session under the same system prompt: that much comes from the file.
        other = chat(proc.url, "Tell me about the sea")
        cached = other["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert prompt_tokens - 20 < cached < prompt_tokens - 1  # all up to the user's turn
        again = chat(proc.url)
        details = again["usage"]["prompt_tokens_details"]
        assert details["cached_tokens"] == prompt_tokens - 1  # all but the last token
        assert again["timings"]["prompt_n"] == 1
        assert again["choices"][0]["message"] == fresh["choices"][0]["message"]
    # A flipped byte in the KV: never loaded; the server prefills and answers the same.
    _flip(files[0], files[0].stat().st_size - 3)
    with _serve(tiny_llama, tmp_path) as proc:
        damaged = chat(proc.url)
        assert damaged["choices"][0]["message"] == fresh["choices"][0]["message"]
        assert not files[0].exists()


def test_the_directory_stays_under_its_cap(tiny_llama, tmp_path):
    """1 MiB holds one of these ~1,400-token prefixes of float32 KV (512 bytes a token; half
    that in float16, the default), not two."""
    # float32 KV is the CPU's (a GPU computes in bf16): the same sizes on every machine.
    cap = ("--cache-dir-size", "1", "--kv-dtype", "float32", "--device", "cpu")
    with _serve(tiny_llama, tmp_path, *cap) as proc:
        for word in ("alpha", "bravo", "charlie"):
            prompt = f"{word} is a word I say. " * 90
            for _ in range(2):  # a repeat is what goes to disk
                r = complete(proc.url, prompt, max_tokens=1)
            assert r["timings"]["cache_n"] > 1000
            assert _bytes_in(tmp_path) <= 2**20
    assert len(list(tmp_path.iterdir())) == 1
