"""Fixed-shape decode (graph_decode.py) against Model.decode's reference path: the function
a CUDA graph captures, run eagerly on the CPU, and bench/gpu_check.py's own smoke run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mashbox.engine import graph_decode, indexed_attention, kernel_build
from mashbox.engine.engine import Engine, compiles_so_far
from mashbox.engine.graph_decode import GraphDecoder, batch_buckets, context_buckets
from support.tinymodels import no_tokenizer, random_weights, step_by_step, write_gguf

VOCAB = 97
SLOTS, CTX = 6, 320  # buckets B 1, 2, 4, 8 (the cache's 7th slot is scratch) and L 256, 320
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    arch = request.param
    w = random_weights(vocab=VOCAB, qkv_bias=arch == "qwen2", tied=arch == "qwen2", seed=5)
    return write_gguf(tmp_path_factory.mktemp(arch) / "m.gguf", w, no_tokenizer, arch=arch)


def engines(path) -> tuple[Engine, Engine]:
    """The default (reference) path and fixed-shape decode, over the same weights."""
    return (
        Engine(path, slots=SLOTS, ctx=CTX, graph_decode=False),
        Engine(path, slots=SLOTS, ctx=CTX, graph_decode=True),
    )


@pytest.fixture(params=["gathered", "indexed"])
def attention(request, monkeypatch):
    """Fixed-shape decode's two attentions: SDPA over gathered copies (or every slot in
    place), and indexed_attention, compiled (inductor's C++ here, Triton on a GPU)."""
    if request.param == "indexed" and not kernel_build.compiler():
        pytest.skip("no C++ compiler, which torch.compile needs on a CPU")
    monkeypatch.setenv(indexed_attention.ENV, request.param)
    return request.param


def test_fixed_shape_decode_matches_the_reference(tiny, attention):
    """Batches of 1 to 5 rows in different slots and lengths, across the L=256 boundary and
    padded (3 rows in bucket 4, 5 in 8), through each attention (the gathered one both
    over copies and over every slot in place): the same hidden states and KV, and slots
    outside the batch untouched."""
    ref, fixed = engines(tiny)
    decoder = fixed.decoder
    assert isinstance(decoder, GraphDecoder) and not decoder.graphs  # eager on the CPU
    assert (decoder.indexed is not None) == (attention == "indexed")
    assert fixed.cache.k.shape[1] == SLOTS + 1 and fixed.cache.scratch_slot == SLOTS
    generator = torch.Generator().manual_seed(0)
    lengths = [3, 255, 100, 299, 17, 40]
    for slot, n in enumerate(lengths):
        ids = torch.randint(0, VOCAB, (n,), generator=generator)
        for engine in (ref, fixed):
            engine.model.prefill(engine.cache, slot, 0, ids)
    batches = [([1], (1, 256)), ([0, 2], (2, 256)), ([1], (1, 320)), ([4, 1, 3], (4, 320))]
    batches += [([5, 4, 3, 2], (4, 320)), ([0, 1, 2, 3, 4], (8, 320)), ([2, 0, 5], (4, 256))]
    for rows, bucket in batches:
        ids = torch.randint(0, VOCAB, (len(rows),), generator=generator)
        positions = torch.tensor([lengths[s] for s in rows])
        assert decoder.bucket(len(rows), int(positions.max()) + 1) == bucket
        before_k, before_v = fixed.cache.k.clone(), fixed.cache.v.clone()
        expected = ref.model.decode(ref.cache, rows, ids, positions)
        got = fixed.decoder.decode(rows, ids, positions)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(fixed.cache.k[:, :SLOTS], ref.cache.k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fixed.cache.v[:, :SLOTS], ref.cache.v, rtol=1e-5, atol=1e-5)
        for slot in set(range(SLOTS)) - set(rows):
            assert torch.equal(fixed.cache.k[:, slot], before_k[:, slot])
            assert torch.equal(fixed.cache.v[:, slot], before_v[:, slot])
        for slot in rows:
            lengths[slot] += 1


def test_both_attention_layouts_are_exercised():
    """A cache of 7 slots: buckets 1 and 2 gather their rows, 4 and 8 read in place."""
    in_place = [graph_decode.reads_in_place(b, SLOTS + 1) for b in (1, 2, 4, 8)]
    assert in_place == [False, False, True, True]


def test_greedy_generation_through_the_engine_is_unchanged(tiny, attention):
    # 3 rows (bucket 4); the long one crosses L=256 while decoding.
    prompts = [(4, 8, 15, 16, 23, 42), (9, 8, 7), tuple(i % VOCAB for i in range(248))]
    ref, fixed = engines(tiny)
    assert step_by_step(fixed, prompts, 16) == step_by_step(ref, prompts, 16)


def test_buckets():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(6) == (1, 2, 4, 8)
    assert batch_buckets(32) == (1, 2, 4, 8, 16, 32)
    assert context_buckets(8192) == (256, 512, 1024, 2048, 4096, 8192)
    assert context_buckets(300) == (256, 300)
    assert context_buckets(64) == (64,)


def test_the_smallest_fitting_bucket_is_chosen(tiny):
    engine = Engine(tiny, slots=SLOTS, ctx=CTX, graph_decode=True)
    decoder = engine.decoder
    assert decoder.bucket(1, 1) == (1, 256)
    assert decoder.bucket(3, 256) == (4, 256)
    assert decoder.bucket(3, 257) == (4, 320)
    assert decoder.bucket(6, CTX) == (8, 320)
    with pytest.raises(ValueError):
        decoder.bucket(1, CTX + 1)


def test_the_default_on_the_cpu_is_the_existing_path(tiny, monkeypatch):
    monkeypatch.delenv(graph_decode.ENV, raising=False)
    engine = Engine(tiny, slots=2, ctx=64)
    assert not isinstance(engine.decoder, GraphDecoder) and engine.cache.scratch_slot is None
    assert engine.cache.k.shape[1] == 2
    monkeypatch.setenv(graph_decode.ENV, "1")
    assert isinstance(Engine(tiny, slots=2, ctx=64).decoder, GraphDecoder)
    assert not isinstance(Engine(tiny, slots=2, ctx=64, graph_decode=False).decoder, GraphDecoder)


class FakeGraph:
    """Stands in for a captured CUDA graph on the CPU: a replay reruns the eager function
    into the same output buffer (off by `error`, for a broken capture)."""

    def __init__(self, decoder: GraphDecoder, batch: int, length: int, error: float):
        self.run = lambda: decoder._eager(batch, length) + error
        self.out = self.run()
        self.replays = 0

    def replay(self):
        self.replays += 1
        self.out.copy_(self.run())


@pytest.fixture
def fake_capture(monkeypatch):
    """Capture that makes FakeGraphs; returns a setter for their error."""
    error = [0.0]

    def capture(self, batch, length, pool):
        graph = FakeGraph(self, batch, length, error[0])
        return graph, graph.out

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(GraphDecoder, "_capture", capture)
    return lambda value: error.__setitem__(0, value)


def test_captured_graphs_are_counted_checked_and_replayed(tiny, fake_capture):
    ref, fixed = engines(tiny)
    before = compiles_so_far()
    decoder = GraphDecoder(fixed.model, fixed.cache, capture=True)
    assert decoder.eager_reason == "" and len(decoder.graphs) == 4 * 2
    assert compiles_so_far() - before == 8
    # The check put back what it wrote into real slots (the scratch slot holds anything).
    assert not fixed.cache.k[:, :SLOTS].any() and not fixed.cache.v[:, :SLOTS].any()
    fixed.decoder = decoder
    checked = sum(graph.replays for graph, _ in decoder.graphs.values())
    prompts = [(4, 8, 15, 16, 23, 42), (9, 8, 7), tuple(i % VOCAB for i in range(248))]
    assert step_by_step(fixed, prompts, 16) == step_by_step(ref, prompts, 16)
    # Each of the 15 decode steps went through the engine's decoder, as one replay.
    assert sum(graph.replays for graph, _ in decoder.graphs.values()) - checked == 15


@pytest.mark.skipif(not kernel_build.compiler(), reason="no C++ compiler for torch.compile")
@pytest.mark.parametrize("inference", [False, True], ids=["plain", "inference-mode"])
def test_captured_steps_compile_the_indexed_attention_once(tiny, fake_capture, inference):
    """Its warm-up runs in the mode the captures run in (the caller's), so capturing all 8
    buckets adds no compile to its four (torch.compile guards on inference tensors)."""
    _, fixed = engines(tiny)
    with torch.inference_mode(inference):
        before = compiles_so_far()
        decoder = GraphDecoder(fixed.model, fixed.cache, capture=True, indexed=True)
        assert decoder.indexed is not None and decoder.eager_reason == ""
        assert compiles_so_far() - before == len(decoder.graphs) + 4


def test_a_replay_that_differs_from_eager_turns_graphs_off(tiny, fake_capture, caplog):
    _, fixed = engines(tiny)
    fake_capture(0.1)
    decoder = GraphDecoder(fixed.model, fixed.cache, capture=True)
    assert not decoder.graphs and "differs from eager" in decoder.eager_reason
    assert [r.message for r in caplog.records if r.module == "graph_decode"] == [
        f"CUDA graph decode off, decoding eagerly: {decoder.eager_reason}"
    ]


def test_a_failed_capture_decodes_eagerly(tiny, caplog):
    """On the CPU capture itself fails (no CUDA): one log line, and decode still works."""
    ref, fixed = engines(tiny)
    decoder = GraphDecoder(fixed.model, fixed.cache, capture=True)
    assert not decoder.graphs and decoder.eager_reason
    assert len([r for r in caplog.records if r.module == "graph_decode"]) == 1
    ids, positions = torch.tensor([5, 6]), torch.tensor([0, 0])
    torch.testing.assert_close(
        decoder.decode([0, 1], ids, positions), ref.model.decode(ref.cache, [0, 1], ids, positions)
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_graphs_replay_what_the_eager_function_computes(tiny, attention):
    captures, compiles = graph_decode.captures, compiles_so_far()
    engine = Engine(tiny, slots=SLOTS, ctx=CTX, device="cuda", graph_decode=True)
    decoder = engine.decoder
    assert decoder.eager_reason == "" and len(decoder.graphs) == 4 * 2
    assert (decoder.indexed is not None) == (attention == "indexed")
    assert graph_decode.captures - captures == len(decoder.graphs)
    # compiles_after_ready counts them, beside the glue's torch.compile graphs.
    assert compiles_so_far() - compiles >= len(decoder.graphs)
    slots, ids = [0, 3, 5], torch.tensor([1, 2, 3], device="cuda")
    for positions in ([0, 10, 200], [0, 300, 7]):  # L 256, then 320
        pos = torch.tensor(positions, device="cuda")
        eager = decoder.decode(slots, ids, pos, eager=True).float()
        replay = decoder.decode(slots, ids, pos).float()
        torch.testing.assert_close(replay, eager, rtol=2e-2, atol=2e-2)


def test_the_gpu_check_script_runs_on_the_cpu():
    env = {k: v for k, v in os.environ.items() if k != "OUT"}  # no report file
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--smoke", "--device", "cpu"],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "correctness" in out.stdout and "tok/s" in out.stdout
