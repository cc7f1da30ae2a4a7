"""Q5_0, Q5_1, Q5_K and Q6_K blocks read as stored by mashbox's kernels: the file's weights bit
for bit (against gguf's own dequantization, dequant.py's reference) at every row count a
decode step or prefill chunk gives them; a row's bits the same alone and in a batch; a model
of such matrices through DecodeStack; and every matrix of the catalogue's Q4_K_M model, which
is mostly Q5_0 and Q6_K, read exactly."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from mashbox import registry
from mashbox.engine import cpu_kernels, gguf_file, kernel_build
from mashbox.engine.decode_weight import SplitWeight, decode_weight_for
from mashbox.engine.dequant import dequantize
from mashbox.engine.engine import Engine
from mashbox.engine.int4 import Int4Weight, unpack
from mashbox.engine.model import tensors_in
from mashbox.engine.q6_weight import Q6Weight, unpack_q6_k
from mashbox.engine.q8_weight import Q8Weight, int8_blocks
from mashbox.engine.weights import RawBlocks
from mashbox.tiny import random_weights
from support.decode_steps import decode, file_matrix, prefill
from support.tinymodels import no_tokenizer, write_gguf

LACKS = kernel_build.machine_lacks()  # anywhere else, no kernels fails the tests below
pytestmark = pytest.mark.skipif(LACKS is not None, reason=f"cannot build the kernels: {LACKS}")
BLOCK_BYTES = {Q.Q5_0: 22, Q.Q5_1: 24, Q.Q5_K: 176, Q.Q6_K: 210, Q.Q8_0: 34}
BLOCK_WEIGHTS = {Q.Q5_0: 32, Q.Q5_1: 32, Q.Q5_K: 256, Q.Q6_K: 256, Q.Q8_0: 32}
# Where each block's fp16 scales lie: d (and dmin / m), the other bytes any value.
SCALE_AT = {Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q8_0: (0,)}


def random_blocks(qtype, n: int, k: int, seed: int) -> np.ndarray:
    """Blocks uint8 [n, k / weights a block, bytes] of random bytes but for the fp16 scales:
    of either sign, exponents wide enough to need float32 for d * sc (K-quants)."""
    g = np.random.default_rng(seed)
    raw = g.integers(0, 256, (n, k // BLOCK_WEIGHTS[qtype], BLOCK_BYTES[qtype]), dtype=np.uint8)
    for at in SCALE_AT[qtype]:
        scale = g.standard_normal(raw.shape[:2]) * 2.0 ** g.integers(-14, -2, raw.shape[:2])
        raw[..., at : at + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
    return raw


def reference(qtype, raw: np.ndarray) -> torch.Tensor:
    n, blocks, _ = raw.shape
    return dequantize(raw.reshape(-1), qtype, (n, blocks * BLOCK_WEIGHTS[qtype]))


def blocks_of(qtype, raw: np.ndarray) -> RawBlocks:
    return RawBlocks(qtype, torch.from_numpy(raw))


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1, Q.Q5_K])
def test_five_bit_blocks_unpack_to_the_files_weights(qtype):
    raw = random_blocks(qtype, 64, 512, seed=1)
    q, d, m = unpack(blocks_of(qtype, raw))
    assert q.dtype == torch.uint8 and int(q.max()) == 31
    w = (q.float().view(64, -1, 32) * d.float()[..., None] + m.float()[..., None]).view(64, 512)
    assert torch.equal(w, reference(qtype, raw))


@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q8_0, Q.Q5_0])
def test_int8_blocks_are_the_files_weights(qtype):
    raw = random_blocks(qtype, 32, 512, seed=2)
    q, d = int8_blocks(blocks_of(qtype, raw))
    group = 512 // d.shape[1]
    assert q.dtype == torch.int8 and group == (16 if qtype == Q.Q6_K else 32)
    w = (q.float().view(32, -1, group) * d.float()[..., None]).view(32, 512)
    assert torch.equal(w, reference(qtype, raw))


def each_row_alone_as_in_any_batch(weight, k: int) -> None:
    """At every row count up to where the blocks give way to the float path, each row has the
    bits it has alone."""
    x = torch.randn(weight.max_rows, k, generator=torch.Generator().manual_seed(k))
    alone = torch.cat([weight(x[i : i + 1]) for i in range(weight.max_rows)])
    for rows in range(1, weight.max_rows + 1):
        assert torch.equal(weight(x[:rows]), alone[:rows]), rows


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1, Q.Q5_K])
@pytest.mark.parametrize("activations", ["float", "int16", "int8"])
def test_q5_weights_read_exactly_and_each_row_alone_as_in_any_batch(qtype, activations):
    raw = random_blocks(qtype, 96, 768, seed=3)
    ref = reference(qtype, raw)
    weight = Int4Weight([blocks_of(qtype, raw)], activations=activations)
    assert weight.kernel is cpu_kernels.load() and weight.qs.shape == (3, 96, 160)
    assert weight.activations == activations
    # Q5_0's m = -16 d is the kernels' to derive: d alone is read; Q5_K's scales as stored
    # where activations are rounded (test_kquant.py)
    if qtype == Q.Q5_K and activations != "float":
        assert weight.dm.shape == (3, 3, 640)
    else:
        assert weight.dm.shape == (3, 24, 1 if qtype == Q.Q5_0 else 2, 32)
    assert torch.equal(cpu_kernels.unpack_q4(weight.qs), unpack(blocks_of(qtype, raw))[0])
    assert torch.equal(weight.dequantized(), ref)
    each_row_alone_as_in_any_batch(weight, 768)


def test_q5_and_q4_kernels_agree_where_the_fifth_bits_are_zero():
    """Q5_1 blocks whose weights are all below 16 are Q4_1 blocks: the same bits either way."""
    raw = random_blocks(Q.Q5_1, 64, 256, seed=4)
    raw[..., 4:8] = 0  # no fifth bits
    q, d, m = unpack(blocks_of(Q.Q5_1, raw))
    as_q4_1 = np.concatenate([raw[..., 0:4], raw[..., 8:]], axis=-1)
    for activations in ("float", "int16", "int8"):
        five = Int4Weight([blocks_of(Q.Q5_1, raw)], activations=activations)
        four = Int4Weight([RawBlocks(Q.Q4_1, torch.from_numpy(as_q4_1))],
                          activations=activations)  # fmt: skip
        x = torch.randn(five.max_rows, 256, generator=torch.Generator().manual_seed(5))
        for rows in (1, 2, 5, 8, 17, five.max_rows):
            assert torch.equal(five(x[:rows]), four(x[:rows])), (activations, rows)


@pytest.mark.parametrize("parts", [[Q.Q6_K, Q.Q8_0], [Q.Q5_0, Q.Q5_0, Q.Q8_0], [Q.Q8_0, Q.Q5_0]])
def test_q6_k_and_q5_0_mixed_with_q8_0_read_exactly(parts):
    """Q6_K in groups of 16 merged with Q8_0 (as wqkv merges q, k and v), Q5_0 merged with
    Q8_0, as Q8 blocks: the file's weights, each row alone as in any batch."""
    raws = [random_blocks(qtype, 32, 512, seed=6 + i) for i, qtype in enumerate(parts)]
    ref = torch.cat([reference(qtype, raw) for qtype, raw in zip(parts, raws, strict=True)])
    blocks = [blocks_of(qtype, raw) for qtype, raw in zip(parts, raws, strict=True)]
    weight = decode_weight_for(blocks, "int4a16", None)
    assert isinstance(weight, Q8Weight)
    assert weight.d.dtype == (torch.float32 if Q.Q6_K in parts else torch.float16)
    assert torch.equal(weight.dequantized(), ref)
    each_row_alone_as_in_any_batch(weight, 512)


@pytest.mark.parametrize("kind", ["int4a16", "int4a8", "int4"])
def test_q6_k_alone_reads_its_six_bits_where_activations_are_rounded(kind):
    """A matrix of Q6_K throughout (two parts, as a merged one): 0.82 bytes a weight as the
    file stores them where activations are rounded (Q8 blocks' 1.25 with float32 ones), the
    file's weights, each row alone as in any batch."""
    raws = [random_blocks(Q.Q6_K, 32, 512, seed=6 + i) for i in range(2)]
    ref = torch.cat([reference(Q.Q6_K, raw) for raw in raws])
    weight = decode_weight_for([blocks_of(Q.Q6_K, raw) for raw in raws], kind, None)
    if kind == "int4":
        assert isinstance(weight, Q8Weight)
        return
    assert isinstance(weight, Q6Weight) and weight.kind == "q6_k"
    assert weight.qs.shape == (2, 64, 192) and weight.scales.shape == (2, 2, 576)
    assert sum(t.nbytes for t in weight.decode_tensors) == 64 * 2 * 210  # the file's bytes
    parts = [unpack_q6_k(blocks_of(Q.Q6_K, raw)) for raw in raws]
    q, sc, d = (torch.cat(p) for p in zip(*parts, strict=True))
    assert torch.equal(cpu_kernels.unpack_q4(weight.qs), q)
    assert all(map(torch.equal, cpu_kernels.unpack_q6(weight.scales), (sc, d)))
    assert torch.equal(weight.dequantized(), ref)
    each_row_alone_as_in_any_batch(weight, 512)


def test_q6a16_gives_q8a16s_bits_at_every_row_count():
    """The 6-bit kernel and the int8 one over the same Q6_K weights (Q6Weight keeps both:
    decode rows read six bits, prefill chunks int8): the same integer sums per group of 16
    and the same float steps, so the same bits, at every row blocking either has. Full-range
    q (0..63, both top bits), scales of either sign, activations over six decades."""
    raw = random_blocks(Q.Q6_K, 96, 768, seed=13)
    weight = Q6Weight([blocks_of(Q.Q6_K, raw)])
    g = torch.Generator().manual_seed(14)
    x = (
        torch.randn(256, 768, generator=g)
        * torch.logspace(-3, 3, 768)[torch.randperm(768, generator=g)]
    )
    for rows in [*range(1, 34), 64, 255, 256]:
        six = weight.kernel.q6a16_linear(x[:rows], weight.qs, weight.scales)
        eight = weight.kernel.q8a16_linear(x[:rows], weight.qs8, weight.d8)
        assert torch.equal(six, eight), rows
        if rows in (1, weight.DECODE_ROWS, weight.DECODE_ROWS + 1, 64):
            assert torch.equal(weight(x[:rows]), six), rows


def test_the_output_head_keeps_no_int8_copy_and_gives_the_same_bits():
    """A head (prefill_rows False) reads its six bits at every row count: the bits of the
    weight that keeps both forms, in the file's bytes alone."""
    raw = random_blocks(Q.Q6_K, 96, 768, seed=15)
    both = decode_weight_for([blocks_of(Q.Q6_K, raw)], "int4a16", None)
    head = decode_weight_for([blocks_of(Q.Q6_K, raw)], "int4a16", None, prefill_rows=False)
    assert isinstance(head, Q6Weight) and head.qs8 is None and head.d8 is None
    assert sum(t.nbytes for t in tensors_in(head)) == 96 * 3 * 210  # the file's bytes
    assert sum(t.nbytes for t in tensors_in(both)) == 96 * 768 * 1.25 + 96 * 3 * 210
    x = torch.randn(300, 768, generator=torch.Generator().manual_seed(16))
    for rows in (1, head.DECODE_ROWS + 1, 64, 256, 300):
        assert torch.equal(head(x[:rows]), both(x[:rows])), rows


def test_without_mashbox_kernels_q5_and_q6_k_stay_int8(monkeypatch):
    from mashbox.engine.int8_weight import Int8Weight

    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    for qtype in (Q.Q5_0, Q.Q6_K):
        raw = random_blocks(qtype, 32, 256, seed=9)
        ref = reference(qtype, raw)
        weight = decode_weight_for([blocks_of(qtype, raw)], "int4", lambda: ref)  # noqa: B023
        assert isinstance(weight, Int8Weight), qtype


# ---- A whole model of Q5 and Q6_K matrices, decoding through DecodeStack --------------------


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """A plain Q6_K quantizer (gguf's Python package has none): per 16 weights an int8 scale,
    a multiple of the block's d, spanning max|x| in -32..31."""
    n, k = x.shape
    xb = x.reshape(n, k // 256, 16, 16).astype(np.float64)
    amax = np.abs(xb).max(-1)  # [n, blocks, 16]
    d = np.maximum(amax.max(-1) / 31 / 127, 1e-8).astype(np.float16).astype(np.float64)
    sc = np.clip(np.round(amax / 31 / d[..., None]), 1, 127).astype(np.int8)
    q = np.clip(np.round(xb / (d[..., None, None] * sc[..., None])), -32, 31).astype(np.int16)
    q = (q + 32).astype(np.uint8).reshape(n, k // 256, 256)
    raw = np.empty((n, k // 256, 210), np.uint8)
    for h in range(2):  # each half of 128 weights: ql 64 bytes, qh 32 bytes
        half = q[..., 128 * h : 128 * (h + 1)]
        raw[..., 64 * h : 64 * (h + 1)] = (half[..., :64] & 0x0F) | (half[..., 64:] & 0x0F) << 4
        top = half.reshape(n, -1, 4, 32) >> 4
        raw[..., 128 + 32 * h : 128 + 32 * (h + 1)] = (
            top[..., 0, :] | top[..., 1, :] << 2 | top[..., 2, :] << 4 | top[..., 3, :] << 6
        )
    raw[..., 192:208] = sc.view(np.uint8)
    raw[..., 208:210] = d.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def test_the_q6_k_quantizer_writes_what_gguf_reads():
    x = np.random.default_rng(10).standard_normal((4, 512)).astype(np.float32)
    raw = quantize_q6_k(x).reshape(4, 2, 210)
    assert np.abs(reference(Q.Q6_K, raw).numpy() - x).max() < 0.1


QTYPES = {  # a layer as qwen2.5's Q4_K_M file has it, with Q5_1 for wo
    "attn_q": Q.Q5_0, "attn_k": Q.Q5_0, "attn_v": Q.Q8_0, "attn_output": Q.Q5_1,
    "ffn_gate": Q.Q5_0, "ffn_up": Q.Q5_0, "ffn_down": Q.Q6_K,
}  # fmt: skip


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    """A 2-layer Llama, d_model 256 and d_ff 512, its matrices Q5_0, Q5_1, Q8_0 and Q6_K; layer
    1's q and k Q5_1 beside its Q8_0 v, which no one kind holds together (SplitWeight)."""
    w = random_weights(vocab=97, d_model=256, d_ff=512, seed=7)
    original = gguf.quants.quantize

    def quantize(array, qtype):
        return quantize_q6_k(array) if qtype == Q.Q6_K else original(array, qtype)

    def qtype_of(name):
        if name.endswith("norm.weight"):
            return None
        if name.startswith("blk.1.attn_") and name.split(".")[-2] in ("attn_q", "attn_k"):
            return Q.Q5_1
        return Q.Q8_0 if name == "output.weight" else QTYPES.get(name.split(".")[-2], Q.Q8_0)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf.quants, "quantize", quantize)
        return write_gguf(
            tmp_path_factory.mktemp("q5q6") / "m.gguf", w, no_tokenizer, qtype_of=qtype_of
        )


@pytest.fixture(scope="module", params=["int4", "int4a16", "int4a8"])
def engine(request, model_file):
    # A float32 KV cache: the kernels' weights compared alone (a float16 cache's own
    # rounding: test_decode_stack.py).
    engine = Engine(model_file, slots=4, ctx=64, decode_weights=request.param, kv_dtype="float32")
    assert engine.model.decode_stack is not None
    prefill(engine)
    return engine


def test_every_layer_matrix_reads_the_files_weights(engine, model_file):
    rounded = engine.model.decode_kind != "int4"  # Q6_K's six bits take int16 activations
    first, second = engine.model.layers
    assert isinstance(first["wqkv"], Q8Weight) and first["wqkv"].d.dtype == torch.float16
    assert isinstance(second["wqkv"], SplitWeight)
    assert [type(p) for p in second["wqkv"].parts] == [Int4Weight, Int4Weight, Q8Weight]
    for i, layer in enumerate(engine.model.layers):
        down = layer["w_down"]
        if rounded:
            assert isinstance(down, Q6Weight) and down.qs.shape[-1] == 192
        else:
            assert isinstance(down, Q8Weight) and down.d.dtype == torch.float32
        for name in ("wo", "w_gate_up"):
            assert isinstance(layer[name], Int4Weight) and layer[name].qs.shape[-1] == 160, name
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            want = file_matrix(model_file, i, name)
            assert torch.equal(layer[name].dequantized(), want), name


def test_decode_stack_computes_what_the_torch_ops_compute(engine):
    """The same weights and kernels, norms and attention in other code: float32 roundings
    apart. With rounded activations such a rounding can move an activation across a rounding
    boundary, by dx = max|x| / 127 for int8 (here 0.003-0.005 in one row's hidden state) or
    max|x| / 32767 for int16 (here up to 1.3e-4, once the prefill's attention rounded
    differently from torch's)."""
    fused, torch_ops = decode(engine, [3, 0, 2], fused=True), decode(engine, [3, 0, 2], fused=False)
    apart = {"int4a8": 1e-2, "int4a16": 5e-4}.get(engine.model.decode_kind, 1e-4)
    torch.testing.assert_close(fused, torch_ops, rtol=1e-4, atol=apart)


def test_a_row_has_the_same_bits_alone_and_in_any_batch(engine):
    batch = decode(engine, [2, 0, 3], fused=True)
    for i, slot in enumerate([2, 0, 3]):
        assert torch.equal(decode(engine, [slot], fused=True)[:, 0], batch[:, i]), slot


# ---- The catalogue's Q4_K_M model -----------------------------------------------------------


@pytest.mark.slow
def test_every_matrix_of_qwen_q4_k_m_is_read_as_stored():
    """qwen2.5-coder-0.5b-instruct Q4_K_M: Q5_0, Q6_K and Q8_0 matrices (and Q4_K, test_kquant)
    all read exactly; none is re-quantized to int8."""
    path = registry.fetch(registry.resolve("qwen2.5-coder-0.5b-instruct"),
                          registry.default_models_dir())  # fmt: skip
    _, infos = gguf_file.read(path)
    by_type = {}
    for t in infos:
        by_type.setdefault(t.qtype, []).append(t)
    assert {Q.Q5_0, Q.Q6_K, Q.Q8_0} <= set(by_type)
    for qtype in (Q.Q5_0, Q.Q6_K):
        for t in by_type[qtype][:6]:
            raw = np.array(t.data, dtype=np.uint8).reshape(t.shape[0], -1, BLOCK_BYTES[qtype])
            ref = dequantize(t.data, t.qtype, t.shape)
            if qtype == Q.Q6_K:
                q, d = int8_blocks(blocks_of(qtype, raw))
                w = (q.float().view(*d.shape, 16) * d[..., None]).view(ref.shape)
            else:
                q, d, m = unpack(blocks_of(qtype, raw))
                w = q.float().view(*d.shape, 32) * d.float()[..., None] + m.float()[..., None]
            assert torch.equal(w.view(ref.shape), ref), t.name
        # The kernel itself on the last: the first 64 columns read back through x = identity
        # (Q6_K: its int8 form; its six bits give the same bits as that for any x).
        weight = decode_weight_for([blocks_of(qtype, raw)], "int4a16", None)
        eye = torch.eye(ref.shape[1])[:64]
        if isinstance(weight, Q6Weight):
            assert torch.equal(weight.dequantized(), ref), t.name
            read = weight.kernel.q8_linear(eye, weight.qs8, weight.d8)
            x = torch.randn(3, ref.shape[1], generator=torch.Generator().manual_seed(15))
            six = weight.kernel.q6a16_linear(x, weight.qs, weight.scales)
            assert torch.equal(six, weight.kernel.q8a16_linear(x, weight.qs8, weight.d8))
        else:
            read = weight.kernel.q4_linear(eye, weight.qs, weight.dm)
        assert torch.equal(read.T, ref[:, :64]), t.name


def test_both_vector_widths_give_the_same_bits(narrow_kernels):
    """The AVX2 build (no mask registers: each lane tests its own fifth bit) and the AVX-512
    one, where the CPU has both: the same weights, sums and order, so the same bits."""
    x = torch.randn(19, 512, generator=torch.Generator().manual_seed(11))
    for qtype in (Q.Q5_0, Q.Q5_K, Q.Q6_K):
        raw = random_blocks(qtype, 64, 512, seed=12)
        weight = decode_weight_for([blocks_of(qtype, raw)], "int4a16", None)
        calls = [("q6a16_linear", weight.decode_tensors)]
        if not isinstance(weight, Q6Weight):  # the K-quants' scales as stored, and float32
            q, d, m = unpack(blocks_of(qtype, raw))
            float32 = (weight.qs, cpu_kernels.pack_scales(d, m))
            calls = [("q4_linear", float32), ("q4a16_linear", float32)]
            calls += [("q4a16_linear", weight.decode_tensors)] if qtype == Q.Q5_K else []
        for name, tensors in calls:
            for rows in (1, 2, 4, 8, 19):
                args = (x[:rows], *tensors)
                wide, narrow_y = (
                    getattr(weight.kernel, name)(*args),
                    getattr(narrow_kernels, name)(*args),
                )
                assert torch.equal(narrow_y, wide), (qtype, name, rows)
