"""int4 decode weights: loaded exactly from a GGUF's 4-bit blocks, and what bf16 costs."""

from __future__ import annotations

import gguf
import pytest
import torch
import torch.nn.functional as F

from mashbox import registry
from mashbox.engine import kernel_build
from mashbox.engine import weights as weights_mod
from mashbox.engine.decode_weight import SplitWeight
from mashbox.engine.engine import Engine
from mashbox.engine.int4 import EXACT_QTYPES, Int4Weight, unpack
from mashbox.engine.int8_weight import Int8Weight
from mashbox.engine.model import DECODE_MATRICES
from mashbox.engine.q8_weight import Q8Weight
from support.decode_steps import (
    STEPS,
    TEXT_PROMPTS,
    assert_one_call_is_two,
    file_matrix,
    greedy_logits,
    prefill,
)
from support.tinymodels import no_tokenizer, random_weights, write_gguf

Q = gguf.GGMLQuantizationType
EPS = 2.0**-8  # bf16 rounding: 8 significant bits, half an ulp of relative error


@pytest.fixture(scope="session")
def real():
    """The shipped default model, fetched and checked on first use as `mashbox run` does
    (a fresh machine fetches it here instead of skipping)."""
    ref = registry.resolve(registry.DEFAULT_MODEL)
    return registry.fetch(ref, registry.default_models_dir())


def tiny_gguf(path, qtype_of, vocab=96):
    """A 2-layer Llama (Q/K rows permuted in the file, as llama.cpp writes them)."""
    return write_gguf(path, random_weights(vocab=vocab, seed=5), no_tokenizer, qtype_of=qtype_of)


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    """Every matrix Q4_1 but the output head, Q4_0."""
    path = tmp_path_factory.mktemp("int4") / "q4.gguf"
    return tiny_gguf(path, lambda name: Q.Q4_0 if name == "output.weight" else Q.Q4_1)


def matrices(loaded, n_layers):
    """(float reference, blocks of its parts) for each decode matrix, as Model merges them."""
    for i in range(n_layers):
        for parts in DECODE_MATRICES.values():
            names = [f"blk.{i}.{p}" for p in parts]
            w = torch.cat([loaded.tensors[n] for n in names])
            yield w, [loaded.blocks[n] for n in names]


def assert_bf16_bound(weight: Int4Weight, ref: torch.Tensor, blocks) -> None:
    """The fast kernel's weights: (q - 8) * bf16(d) + bf16(zero), in float32, then rounded to
    bf16 on the way out of the kernel. Rounding d and zero moves a weight by at most
    e = EPS * (8 |d| + |zero|); the identity product's bf16 output adds EPS * |w|."""
    q, d, m = (torch.cat(t) for t in zip(*(unpack(b) for b in blocks), strict=True))
    q, d, zero = q.int(), d.float(), m.float() + 8 * d.float()
    n, k = q.shape
    groups = (n, k // 32, 32)
    s16, z16 = d.bfloat16().float()[..., None], zero.bfloat16().float()[..., None]
    expected = ((q.float() - 8).view(groups) * s16 + z16).view(n, k).bfloat16()
    got = weight.dequantized()
    assert torch.equal(got, expected)
    e = (EPS * (8 * d.abs() + zero.abs()))[..., None].expand(groups).reshape(n, k)
    assert ((got.float() - ref).abs() <= e + EPS * (ref.abs() + e)).all()


def test_tiny_q4_blocks_load_exactly_in_float32_and_within_the_bf16_bound(tiny4):
    loaded = weights_mod.load(tiny4, keep_blocks=EXACT_QTYPES)
    assert set(loaded.blocks) == {n for n, t in loaded.tensors.items() if t.ndim == 2}
    pairs = [
        *matrices(loaded, 2),
        (loaded.tensors["output.weight"], [loaded.blocks["output.weight"]]),
    ]
    for ref, blocks in pairs:
        # float32 activations and scales: the kernel reproduces dequant.py's weights bit for bit.
        assert torch.equal(Int4Weight(blocks, dtype=torch.float32, ours=False).dequantized(), ref)
        assert_bf16_bound(Int4Weight(blocks, ours=False), ref, blocks)


def test_int4_engine_uses_int4_where_blocks_allow_and_int8_elsewhere(tmp_path):
    def qtype_of(name):
        if name.endswith("attn_v.weight"):
            return Q.Q8_0  # wqkv is cat(q, k, v): one part without 4-bit blocks, its own
        if name.endswith("ffn_down.weight"):
            return None  # F32
        return Q.Q4_0 if name.endswith("ffn_up.weight") else Q.Q4_1  # mixed 4-bit types merge

    engine = Engine(
        tiny_gguf(tmp_path / "m.gguf", qtype_of, vocab=97), slots=1, decode_weights="int4"
    )
    for layer in engine.model.layers:
        if kernel_build.machine_lacks() is None:  # mashbox's kernels read Q8_0: parts apart
            assert isinstance(layer["wqkv"], SplitWeight)
            assert [type(p) for p in layer["wqkv"].parts] == [Int4Weight, Int4Weight, Q8Weight]
        else:  # torch's int4 kernel alone: no Q8_0, so int8 for the whole matrix
            assert isinstance(layer["wqkv"], Int8Weight)
        assert isinstance(layer["wo"], Int4Weight)
        assert isinstance(layer["w_gate_up"], Int4Weight)
        assert isinstance(layer["w_down"], Int8Weight)
    assert isinstance(engine.model.lm_head, Int8Weight)  # 97 rows: the kernel packs 16 at a time


@pytest.mark.parametrize("kind", ["int4", "int4a16", "int4a8"])
def test_int4_decode_is_close_and_calls_past_max_rows_keep_their_bits(tiny4, kind):
    float_engine = Engine(tiny4, slots=1, ctx=64)
    engine = Engine(tiny4, slots=1, ctx=64, decode_weights=kind)
    assert isinstance(engine.model.lm_head, Int4Weight)
    ours = engine.model.lm_head.kernel is not None  # int4a8 needs mashbox's kernels
    assert engine.model.decode_kind == (kind if ours else "int4")
    ids = torch.tensor([5, 17, 3, 88, 42, 7, 19, 60])
    for e in (float_engine, engine):
        e.model.prefill(e.cache, 0, 0, ids[:-1])
    exact = float_engine.model.decode(float_engine.cache, [0], ids[-1:], torch.tensor([7]))
    approx = engine.model.decode(engine.cache, [0], ids[-1:], torch.tensor([7]))
    assert (approx - exact).norm() / exact.norm() < 0.02  # bf16 activations and scales
    w = engine.model.layers[0]["w_gate_up"]
    big = torch.randn(w.max_rows + 3, w.shape[1])
    if w.activations == "float":  # past max_rows sgemm, on the file's float32 weights
        assert torch.equal(w.w, file_matrix(tiny4, 0, "w_gate_up"))
        assert torch.equal(w(big), F.linear(big, w.w))
    else:  # no float copy: the blocks in pieces, every row the bits it has alone
        assert w.w is None
        assert torch.equal(w(big), torch.cat([w(row[None]) for row in big]))


@pytest.mark.slow
def test_real_q4_1_blocks_load_exactly(real):
    loaded = weights_mod.load(real, keep_blocks=EXACT_QTYPES)
    assert loaded.blocks and all(b.qtype == Q.Q4_1 for b in loaded.blocks.values())
    # (q - 8) * d + zero, zero = m + 8 d, is q * d + m exactly in float32 when zero is: q * d
    # has at most 15 significant bits, so the sum is rounded once, as dequant.py's is.
    for name, blocks in loaded.blocks.items():
        d = blocks.data[..., 0:2].contiguous().view(torch.float16).double()
        m = blocks.data[..., 2:4].contiguous().view(torch.float16).double()
        assert torch.equal((m + 8 * d).float().double(), m + 8 * d), name
    # The kernel itself on layer 0's matrices (q and k rows un-permuted block by block).
    for ref, blocks in matrices(loaded, 1):
        if ref.numel() <= 960 * 576:  # the float32 kernel is slow: wqkv and wo are enough
            assert torch.equal(
                Int4Weight(blocks, dtype=torch.float32, ours=False).dequantized(), ref
            )
        assert_bf16_bound(Int4Weight(blocks, ours=False), ref, blocks)


def test_real_head_in_the_stacks_call_gives_the_same_bits(real):
    """The default model's Q8_0 head, run by the decode stack's own call (`decode_logits`, an
    engine step's) and by `Model.logits` after `decode`: the same bits."""
    engine = Engine(real, slots=4, ctx=128, decode_weights="int4a16")
    assert isinstance(engine.model.lm_head, Q8Weight)
    prefill(engine)
    assert_one_call_is_two(engine, [3, 0, 2], [11, 23, 5])
    assert_one_call_is_two(engine, [2], [42])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["int4", "int4a16", "int4a8", "int8"])
def test_real_greedy_against_float32(kind, real):
    """Where int4 / int8 and float32 greedy text part, and why: README "--decode-weights".
    int8 decodes through DecodeStack (decode_layers.cpp) where the CPU kernels build."""
    from mashbox.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(real)
    prompts = [tok.encode(p) for p in TEXT_PROMPTS]
    ref = greedy_logits(Engine(real, slots=len(prompts), ctx=128), prompts)
    tokens = ref.argmax(-1)
    # The fast path fed the float32 path's tokens: its free-running text is the same up to
    # the first step where its pick differs, and then it is another text.
    # A float32 KV cache as the reference's: what the weights alone change (the float16
    # cache's own share: test_kv_dtype.py).
    fast = greedy_logits(
        Engine(real, slots=len(prompts), ctx=128, decode_weights=kind, kv_dtype="float32"),
        prompts,
        tokens,
    )
    differs = fast.argmax(-1) != tokens
    top2 = ref.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]
    print(
        f"{kind} agreed tokens per prompt:",
        [int(d.nonzero()[0]) if d.any() else STEPS for d in differs],
    )
    print(f"float32 margins where {kind} picks another token:", margin[differs].tolist())
    print("max |logit change|:", float((fast - ref).abs().max()))
    # int4 reads the file's own blocks (Q4_1 layers, the Q8_0 head) exactly, so only float32
    # rounding order moves its logits (~1e-4 seen). int4a16 / int4a8 round the 4-bit layers'
    # activations per block of 32 to int16 (0.007 seen, no pick changed) / int8 (1.7 seen, 4
    # of 192 picks), and int8 (one weight scale per output channel, coarser than the file's
    # blocks) moves them by up to ~2 (6 of 192): those two pick another token only at
    # near-ties of the float32 path, rarely.
    bounds = {"int4": (1e-3, 1e-3), "int4a16": (0.05, 0.05), "int4a8": (2.5, 0.5)}
    bounds["int8"] = (2.5, 0.5)
    largest_change, near_tie = bounds[kind]
    assert float((fast - ref).abs().max()) < largest_change
    assert (margin[differs] < near_tie).all()
    assert differs.sum() <= 0.1 * differs.numel()


def test_cli_accepts_int4():
    from mashbox.cli import _parser

    for kind in ("int4", "int4a16", "int4a8"):
        assert _parser().parse_args(["run", "--decode-weights", kind]).decode_weights == kind
