"""A CUDA model's norms, RoPE and SiLU: torch's ops through torch.compile (one kernel each
instead of ~7 in a decode step's graph). Checked here on the CPU, where inductor compiles to
C++ rather than Triton (bench/gpu_check.py runs them on a GPU): against torch's ops, in a
server that takes the CUDA path, and the fallback to torch's ops where compiling fails."""

from __future__ import annotations

import logging

import httpx
import pytest
import torch

from mashbox.engine import indexed_attention, kernel_build
from mashbox.engine import model as model_module
from mashbox.engine.engine import Engine, compiles_so_far
from mashbox.engine.graph_decode import GraphDecoder
from mashbox.engine.kv_cache import KVCache
from mashbox.engine.model import GLUE_ENV, TORCH_GLUE, wants_compiled_glue, warmed_compiled_glue
from support.serverproc import serving
from support.tinymodels import no_tokenizer, random_weights, write_gguf

# Inductor compiles to C++ on a CPU (Triton on a GPU).
pytestmark = pytest.mark.skipif(
    not kernel_build.compiler(), reason="no C++ compiler, which torch.compile needs on a CPU"
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    weights = random_weights(vocab=97, seed=3)
    path = write_gguf(tmp_path_factory.mktemp("glue") / "m.gguf", weights, no_tokenizer)
    return Engine(path, slots=2, ctx=64, graph_decode=False).model


@pytest.fixture(scope="module")
def compiled(model):
    return warmed_compiled_glue(model)


def test_the_model_compiles_its_glue(compiled):
    assert compiled is not TORCH_GLUE
    assert set(vars(compiled)) == set(vars(TORCH_GLUE))


@pytest.mark.parametrize("rows", [1, 2, 7])
def test_each_compiled_op_computes_what_torch_ops_compute(compiled, rows):
    g = torch.Generator().manual_seed(rows)
    x, delta, w = (torch.randn(rows, 64, generator=g) for _ in range(3))
    qk, cs = torch.randn(rows, 6, 16, generator=g), torch.rand(2, rows, 8, generator=g)
    cases = {
        "rms_norm": (x, w[0], 1e-5),
        "add_rms_norm": (x, delta, w[0], 1e-5),
        "apply_rope": (qk, cs[0], cs[1]),
        "silu_mul": (torch.randn(rows, 256, generator=g),),
    }
    for name, args in cases.items():
        torch.testing.assert_close(getattr(compiled, name)(*args), getattr(TORCH_GLUE, name)(*args))


def test_a_prefill_through_the_compiled_glue_matches_torch_ops(model, compiled):
    """The whole forward, its residual adds fused into the next norm."""
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    kept = model.glue
    try:
        hidden = {}
        for name, glue in (("torch", TORCH_GLUE), ("compiled", compiled)):
            model.glue = glue
            cache = KVCache(model.cfg, 1, 64, model.device, model.dtype)
            hidden[name] = model.prefill(cache, 0, 0, ids, all_rows=True)
    finally:
        model.glue = kept
    torch.testing.assert_close(hidden["compiled"], hidden["torch"])


def test_nothing_compiles_again_after_the_warm_up(model, compiled):
    """What a server's steps do after ready (compiles_after_ready): prefill chunks and decode
    batches of any size, in inference mode, on fresh tensors."""
    kept, model.glue = model.glue, compiled
    before = compiles_so_far()
    try:
        with torch.inference_mode():
            cache = KVCache(model.cfg, 3, 64, model.device, model.dtype, scratch_slot=True)
            for n in (1, 2, 5, 13):
                model.prefill(cache, 0, 0, torch.arange(n) % 97)
            decoder = GraphDecoder(model, cache, capture=False)  # CUDA's decode step, eager
            for rows in (1, 2, 3):
                decoder.decode(list(range(rows)), torch.arange(rows), torch.full((rows,), 13))
    finally:
        model.glue = kept
    assert compiles_so_far() == before


def test_a_failed_compile_falls_back_to_torch_ops_with_a_warning(model, monkeypatch, caplog):
    def broken(*args):
        raise RuntimeError("no Triton here")

    names = vars(TORCH_GLUE)
    monkeypatch.setattr(
        model_module, "compiled_glue", lambda: type(TORCH_GLUE)(**dict.fromkeys(names, broken))
    )
    with caplog.at_level(logging.WARNING, logger="mashbox"):
        assert warmed_compiled_glue(model) is TORCH_GLUE
    assert [r.message for r in caplog.records if "torch.compile failed" in r.message] == [
        "torch.compile failed (RuntimeError: no Triton here): norms, RoPE and SiLU run as "
        f"torch's ops one by one, a slower decode step (set {GLUE_ENV}=0 to skip the attempt)"
    ]


@pytest.mark.parametrize(
    "choice, on_cuda, on_cpu", [(None, True, False), ("0", False, False), ("1", True, True)]
)
def test_the_environment_chooses_where_glue_compiles(choice, on_cuda, on_cpu, monkeypatch):
    if choice is None:
        monkeypatch.delenv(GLUE_ENV, raising=False)
    else:
        monkeypatch.setenv(GLUE_ENV, choice)
    assert wants_compiled_glue(torch.device("cuda")) == on_cuda
    assert wants_compiled_glue(torch.device("cpu")) == on_cpu


def test_a_server_on_the_cuda_path_compiles_nothing_after_ready(tiny_llama):
    """A CUDA server's code path on the CPU: torch's ops where the kernels would run, the
    glue compiled, fixed-shape decode steps. Prompts of many lengths, batches of 1 to 4
    rows, sampled and greedy: all answered, and nothing compiled after ready."""
    env = {"MASHBOX_CPU_KERNELS": "0", GLUE_ENV: "1", "MASHBOX_GRAPH_DECODE": "1",
           indexed_attention.ENV: "indexed"}  # fmt: skip
    with serving(str(tiny_llama), "--slots", "4", "--ctx", "512", env=env, timeout=300) as proc:

        def complete(prompt: str, **body) -> dict:
            body = {"prompt": prompt, "max_tokens": 6, "ignore_eos": True, **body}
            r = httpx.post(proc.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()

        for words in (1, 2, 7, 40):
            complete(" ".join(["tea"] * words), temperature=0)
        assert len(complete("Count", n=4, temperature=1, seed=3)["choices"]) == 4
        health = httpx.get(proc.url + "/health").json()
    assert health["compiles_after_ready"] == 0
