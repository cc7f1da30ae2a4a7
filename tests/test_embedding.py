"""The token embedding kept as the file's blocks (embedding.py), and a block model's memory:
the file's values exactly, in Python and in the decode stack's own call, and no float32
copy of any matrix where nothing multiplies by it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from mashbox.engine import kernel_build
from mashbox.engine.dequant import dequantize
from mashbox.engine.embedding import Embedding
from mashbox.engine.engine import Engine
from mashbox.engine.int4 import KEPT_QTYPES
from mashbox.engine.weights import RawBlocks
from support.decode_steps import PROMPTS, assert_one_call_is_two, prefill
from support.tinymodels import no_tokenizer, random_weights, write_gguf

# Where each block's fp16 scales lie (d, and dmin or m): the other bytes take any value.
SCALE_AT = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
            Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}  # fmt: skip


def random_blocks(qtype, rows: int, k: int, seed: int) -> np.ndarray:
    """Random bytes but for finite fp16 scales of either sign over a wide range."""
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    g = np.random.default_rng(seed)
    raw = g.integers(0, 256, (rows, k // block, block_bytes), dtype=np.uint8)
    for at in SCALE_AT[qtype]:
        scale = g.standard_normal(raw.shape[:2]) * 2.0 ** g.integers(-14, 2, raw.shape[:2])
        raw[..., at : at + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
    return raw


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)  # -0.0 and 0.0 apart


@pytest.mark.parametrize("qtype", list(SCALE_AT))
def test_compact_rows_are_the_files_values_bit_for_bit(qtype):
    assert set(SCALE_AT) == set(KEPT_QTYPES)  # every kind of block a block engine keeps
    raw = random_blocks(qtype, 64, 512, seed=int(qtype))
    reference = dequantize(raw.reshape(-1), qtype, (64, 512))

    def no_floats():
        raise AssertionError("the blocks are enough")

    embedding = Embedding.of(RawBlocks(qtype, torch.from_numpy(raw)), no_floats)
    assert embedding.table is None and embedding.shape == (64, 512)
    ids = torch.tensor([0, 63, 5, 5, 17, 40])
    assert torch.equal(bits(embedding(ids)), bits(reference[ids]))
    assert embedding.nbytes <= 1.25 * 64 * 512  # float32: 4 bytes a weight


def test_without_blocks_the_float_table():
    table = torch.randn(10, 64)
    embedding = Embedding.of(None, lambda: table)
    assert embedding.table is table and embedding.tensors == [table]
    assert torch.equal(embedding(torch.tensor([3, 9])), table[[3, 9]])


LACKS = kernel_build.machine_lacks()


@pytest.fixture(scope="module")
def tied_q5_0(tmp_path_factory):
    """qwen2.5-coder-0.5b's shape of file: a tied Q5_0 embedding, Q4_0, Q4_1 and Q8_0
    matrices (v Q8_0 beside Q4_0 q and k: wqkv takes Q8 blocks)."""
    w = random_weights(vocab=128, d_model=128, d_ff=256, tied=True, seed=3)

    def qtype_of(name):
        if name.endswith("norm.weight"):
            return None
        if name == "token_embd.weight":
            return Q.Q5_0
        return Q.Q8_0 if "attn_v" in name else Q.Q4_1 if "ffn_down" in name else Q.Q4_0

    return write_gguf(tmp_path_factory.mktemp("tied") / "m.gguf", w, no_tokenizer,
                      qtype_of=qtype_of)  # fmt: skip


@pytest.mark.skipif(LACKS is not None, reason=f"cannot build the kernels: {LACKS}")
def test_a_block_engine_holds_its_blocks_and_no_float_copies(tied_q5_0):
    reference = Engine(tied_q5_0, slots=4, ctx=64)  # float32 throughout
    engine = Engine(tied_q5_0, slots=4, ctx=64, decode_weights="int4a16")
    model = engine.model
    assert model.decode_stack is not None and model.embedding.table is None
    ids = torch.arange(128)
    assert torch.equal(bits(model.embedding(ids)), bits(reference.model.embedding(ids)))
    weights = [layer[m] for layer in model.layers for m in ("wqkv", "wo", "w_gate_up", "w_down")]
    assert all(w.w is None for w in [*weights, model.lm_head])
    # What it holds is what a decode step reads, and the embedding's compact rows.
    assert engine.info.held_bytes == engine.info.decode_bytes + model.embedding.nbytes
    assert engine.info.held_bytes < reference.info.held_bytes / 4
    # The decode stack's own call reads the embedding's rows as Python does.
    prefill(engine)
    assert_one_call_is_two(engine, list(PROMPTS), [5, 127, 64])
