"""Q4_K blocks read as stored by mashbox's Q4 kernels: the file's weights bit for bit (against
gguf's own dequantization, dequant.py's reference), at every row count a decode step or
prefill chunk gives them; a row's bits the same alone and in a batch; and in a whole model,
through DecodeStack."""

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
from mashbox.engine.int4 import BLOCK_KINDS, Int4Weight, k_scales, q4_k_scales, unpack
from mashbox.engine.int8_weight import Int8Weight
from mashbox.engine.weights import RawBlocks
from mashbox.tiny import random_weights
from support.decode_steps import decode, file_matrix, prefill
from support.tinymodels import no_tokenizer, write_gguf

LACKS = kernel_build.machine_lacks()  # anywhere else, no kernels fails the tests below
pytestmark = pytest.mark.skipif(LACKS is not None, reason=f"cannot build the kernels: {LACKS}")
ACTIVATIONS = list(BLOCK_KINDS.values())  # float32, int16, int8


def pack_q4_k(d, dmin, sc, mn, q) -> np.ndarray:
    """Q4_K blocks, uint8 [n, blocks, 144], as llama.cpp packs them: d, dmin fp16 [n, blocks];
    6-bit sc, mn [n, blocks, 8]; q [n, blocks * 256] in 0..15."""
    n, blocks = d.shape
    raw = np.empty((n, blocks, 144), np.uint8)
    raw[..., 0:2] = d.astype(np.float16)[..., None].view(np.uint8)
    raw[..., 2:4] = dmin.astype(np.float16)[..., None].view(np.uint8)
    raw[..., 4:8] = sc[..., :4] | (sc[..., 4:] >> 4) << 6
    raw[..., 8:12] = mn[..., :4] | (mn[..., 4:] >> 4) << 6
    raw[..., 12:16] = (sc[..., 4:] & 0x0F) | (mn[..., 4:] & 0x0F) << 4
    pairs = q.astype(np.uint8).reshape(n, blocks, 4, 2, 32)  # sub-blocks 2i and 2i + 1
    raw[..., 16:] = (pairs[..., 0, :] | pairs[..., 1, :] << 4).reshape(n, blocks, 128)
    return raw


def random_q4_k(n: int, k: int, seed: int, exact_in_fp16: bool = False) -> np.ndarray:
    """Q4_K blocks with random nibbles, scales and mins, and d, dmin fp16 of either sign and
    wide exponents; or, exact_in_fp16, powers of two, so every d * sc and dmin * mn is an
    fp16 value too."""
    g = np.random.default_rng(seed)
    blocks = k // 256
    exponents = g.integers(-12, -2, (2, n, blocks))
    if exact_in_fp16:
        d, dmin = 2.0**exponents
    else:
        d, dmin = g.standard_normal((2, n, blocks)) * 2.0**exponents
    sc, mn = g.integers(0, 64, (2, n, blocks, 8), dtype=np.uint8)
    return pack_q4_k(d, dmin, sc, mn, g.integers(0, 16, (n, k)))


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """A plain Q4_K quantizer (gguf's Python package has none): per sub-block of 32 a scale
    and offset spanning min(x, 0)..max(x), 6-bit multiples of each block's d and dmin."""
    n, k = x.shape
    xb = x.reshape(n, k // 256, 8, 32).astype(np.float64)
    low, high = np.minimum(xb.min(-1), 0), xb.max(-1)
    d = np.maximum((high - low).max(-1) / 15 / 63, 1e-6).astype(np.float16).astype(np.float64)
    dmin = np.maximum((-low).max(-1) / 63, 1e-6).astype(np.float16).astype(np.float64)
    sc = np.clip(np.ceil((high - low) / 15 / d[..., None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(-low / dmin[..., None]), 0, 63).astype(np.uint8)
    scale, offset = d[..., None] * sc, dmin[..., None] * mn
    q = np.clip(np.round((xb + offset[..., None]) / scale[..., None]), 0, 15)
    return pack_q4_k(d, dmin, sc, mn, q.reshape(n, k))


def reference(raw: np.ndarray) -> torch.Tensor:
    """The file's weights, float32 [n, k], as dequant.py computes them (gguf's numpy code)."""
    n, blocks, _ = raw.shape
    return dequantize(raw.reshape(-1), Q.Q4_K, (n, blocks * 256))


def blocks_of(raw: np.ndarray) -> RawBlocks:
    return RawBlocks(Q.Q4_K, torch.from_numpy(raw))


def test_q4_k_groups_of_32_are_the_files_weights_and_need_float32():
    raw = random_q4_k(64, 512, seed=1)
    q, d, m = unpack(blocks_of(raw))
    assert q.dtype == torch.uint8 and int(q.max()) == 15
    assert d.dtype == m.dtype == torch.float32 and d.shape == m.shape == (64, 512 // 32)
    w = (q.float().view(64, -1, 32) * d[..., None] + m[..., None]).view(64, 512)
    assert torch.equal(w, reference(raw))
    # Why float32: d * sc and dmin * mn (up to 17 significant bits) are often not fp16 values.
    assert not torch.equal(d.half().float(), d) and not torch.equal(m.half().float(), m)


def test_the_six_bit_scales_unpack_as_gguf_reads_them():
    raw = np.random.default_rng(2).integers(0, 256, (32, 12), dtype=np.uint8)
    sc, mn = gguf.quants.Q4_K.get_scale_min(raw)
    ours = q4_k_scales(torch.from_numpy(raw))
    assert np.array_equal(ours[0].numpy(), sc) and np.array_equal(ours[1].numpy(), mn)


def rows_up_to_the_float_path(weight: Int4Weight, k: int) -> torch.Tensor:
    return torch.randn(weight.max_rows, k, generator=torch.Generator().manual_seed(weight.max_rows))


@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_q4_k_weights_read_exactly_and_each_row_alone_as_in_any_batch(activations):
    """x = identity reads the file's weights back bit for bit; at every row count up to where
    the blocks give way to the float path, each row has the bits it has alone."""
    raw = random_q4_k(64, 512, seed=3)
    ref = reference(raw)
    weight = Int4Weight([blocks_of(raw)], activations=activations)
    assert weight.kernel is cpu_kernels.load() and weight.activations == activations
    # float32 d and m for float32 activations, else the scales as stored
    assert weight.dm.dtype == (torch.float32 if activations == "float" else torch.uint8)
    assert torch.equal(weight.dequantized(), ref)
    x = rows_up_to_the_float_path(weight, 512)
    alone = torch.cat([weight(x[i : i + 1]) for i in range(weight.max_rows)])
    for rows in range(1, weight.max_rows + 1):
        assert torch.equal(weight(x[:rows]), alone[:rows]), rows


def as_q4_1(raw: np.ndarray) -> RawBlocks:
    """The same weights as Q4_1 blocks (fp16 d, m; byte j: weights j and j + 16), where every
    d * sc and -dmin * mn is an fp16 value."""
    q, d, m = unpack(blocks_of(raw))
    assert torch.equal(d.half().float(), d) and torch.equal(m.half().float(), m)
    n = q.shape[0]
    nib = q.view(n, -1, 32)
    qbytes = nib[..., :16] | (nib[..., 16:] << 4)
    halves = [t.half().view(torch.uint8).view(n, -1, 2) for t in (d, m)]
    return RawBlocks(Q.Q4_1, torch.cat([*halves, qbytes], dim=-1))


@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_float32_scales_give_the_q4_1_kernels_bits_at_every_row_count(activations):
    """Where Q4_K's weights are Q4_1 weights too, the float32-scale kernels give exactly what
    the fp16 ones (tests/test_cpu_kernels.py) give, rows 1 to the float path's threshold."""
    raw = random_q4_k(96, 768, seed=4, exact_in_fp16=True)
    ref = reference(raw)
    k_weight = Int4Weight([blocks_of(raw)], activations=activations)
    q4_1 = Int4Weight([as_q4_1(raw)], activations=activations)
    assert q4_1.dm.dtype == torch.float16 and torch.equal(q4_1.dequantized(), ref)
    x = rows_up_to_the_float_path(k_weight, 768)
    for rows in range(1, k_weight.max_rows + 1):
        assert torch.equal(k_weight(x[:rows]), q4_1(x[:rows])), rows


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K])
@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_k_scales_as_stored_give_the_float32_scales_bits(qtype, activations):
    """With rounded activations the K-quants' scales are read as stored (six-bit sc and mn,
    fp16 d and dmin: 20 bytes an output and 256 weights, float32 d and m 64): the kernels
    form the same exact d * sc and -dmin * mn, so the same bits at every row count."""
    raw = random_q4_k(96, 768, seed=9) if qtype == Q.Q4_K else random_k5(96, 768, seed=9)
    blocks = RawBlocks(qtype, torch.from_numpy(raw))
    weight = Int4Weight([blocks], activations=activations)
    assert weight.dm.dtype == torch.uint8 and weight.dm.nbytes == 96 * 768 // 256 * 20
    sc, mn, d, dmin = k_scales(blocks.data)
    assert all(map(torch.equal, cpu_kernels.unpack_k_scales(weight.dm), (sc, mn, d, dmin)))
    float32 = cpu_kernels.pack_scales(*unpack(blocks)[1:])
    assert torch.equal(weight.dequantized(), dequantize(raw.reshape(-1), qtype, (96, 768)))
    matmul = getattr(weight.kernel, "q4a16_linear" if activations == "int16" else "q4a8_linear")
    x = torch.randn(weight.max_rows, 768, generator=torch.Generator().manual_seed(10))
    for rows in [*range(1, 34), 64, weight.max_rows]:
        want = matmul(x[:rows], weight.qs, float32)
        assert torch.equal(matmul(x[:rows], weight.qs, weight.dm), want), rows


def random_k5(n: int, k: int, seed: int) -> np.ndarray:
    """Q5_K blocks: random_q4_k's d, dmin and scales, 32 bytes of fifth bits, its nibbles."""
    q4 = random_q4_k(n, k, seed)
    fifth = np.random.default_rng(seed + 1).integers(0, 256, (*q4.shape[:2], 32), np.uint8)
    return np.concatenate([q4[..., :16], fifth, q4[..., 16:]], axis=-1)


def test_decode_weights_take_q4_k_alone_merged_with_q4_0_or_split_from_q6_k():
    raw = random_q4_k(64, 256, seed=5)
    ref = reference(raw)
    # A Q4_0 part (w = (q - 8) * d) of 32 rows merged with the Q4_K one, as wqkv merges q, k, v.
    g = torch.Generator().manual_seed(6)
    d = (torch.rand(32, 8, generator=g) / 64).half()
    q = torch.randint(0, 16, (32, 256), dtype=torch.uint8, generator=g).view(32, 8, 32)
    q4_0 = torch.cat([d.view(torch.uint8).view(32, 8, 2), q[..., :16] | (q[..., 16:] << 4)], -1)
    w0 = ((q.float() - 8) * d.float()[..., None]).view(32, 256)
    merged = decode_weight_for([blocks_of(raw), RawBlocks(Q.Q4_0, q4_0)], "int4a16", None)
    assert isinstance(merged, Int4Weight) and merged.dm.dtype == torch.float32
    assert torch.equal(merged.dequantized(), torch.cat([ref, w0]))
    # A Q6_K part (a Q4_K_M file's v beside Q4_K q and k) keeps its own kind: the parts
    # split, each read as stored, one after another.
    q6 = np.random.default_rng(7).integers(0, 256, (32, 1, 210), dtype=np.uint8)
    q6[..., 208:210] = np.full((32, 1, 1), 2.0**-12, np.float16).view(np.uint8)
    w6 = dequantize(q6.reshape(-1), Q.Q6_K, (32, 256))
    for kind in BLOCK_KINDS:
        split = decode_weight_for([blocks_of(raw), RawBlocks(Q.Q6_K, torch.from_numpy(q6))],
                                  kind, None)  # fmt: skip
        assert isinstance(split, SplitWeight) and split.shape == (96, 256), kind
        assert isinstance(split.parts[0], Int4Weight) and split.w is None, kind
        assert torch.equal(split.dequantized(), torch.cat([ref, w6])), kind
        x = torch.randn(5, 256, generator=g)
        want = torch.cat([split.parts[0](x), split.parts[1](x)], dim=1)
        assert torch.equal(split(x), want) and split.kind == kind, kind


def test_without_mashbox_kernels_q4_k_stays_int8(monkeypatch):
    """torch's int4 kernel takes bf16 scales: d * sc would be rounded, so not Q4_K there."""
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    raw = random_q4_k(64, 256, seed=8)
    weight = decode_weight_for([blocks_of(raw)], "int4", lambda: reference(raw))
    assert isinstance(weight, Int8Weight)


# ---- A whole model of Q4_K matrices, decoding through DecodeStack ---------------------------


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    """A 2-layer Llama, d_model 256 and d_ff 512 (Q4_K's rows are 256 weights), every layer
    matrix Q4_K, the head Q8_0."""
    w = random_weights(vocab=97, d_model=256, d_ff=512, seed=7)
    original = gguf.quants.quantize

    def quantize(array, qtype):
        if qtype != Q.Q4_K:
            return original(array, qtype)
        return quantize_q4_k(array).reshape(array.shape[0], -1)  # bytes a row, as gguf's

    def qtype_of(name):
        return (
            None if name.endswith("norm.weight") else Q.Q8_0 if name == "output.weight" else Q.Q4_K
        )

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf.quants, "quantize", quantize)
        return write_gguf(
            tmp_path_factory.mktemp("q4k") / "m.gguf", w, no_tokenizer, qtype_of=qtype_of
        )


@pytest.fixture(scope="module", params=["int4", "int4a16", "int4a8"])
def engine(request, model_file):
    # A float32 KV cache: the kernels' weights compared alone (a float16 cache's own
    # rounding: test_decode_stack.py).
    engine = Engine(model_file, slots=4, ctx=64, decode_weights=request.param, kv_dtype="float32")
    assert engine.model.decode_stack is not None and engine.model.decode_kind == request.param
    prefill(engine)
    return engine


def test_every_layer_matrix_reads_the_files_q4_k_weights(engine, model_file):
    for i, layer in enumerate(engine.model.layers):
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            weight = layer[name]
            assert isinstance(weight, Int4Weight), name
            scales = torch.float32 if engine.model.decode_kind == "int4" else torch.uint8
            assert weight.dm.dtype == scales, name
            assert torch.equal(weight.dequantized(), file_matrix(model_file, i, name)), name


def test_decode_stack_computes_what_the_torch_ops_compute(engine):
    """The same weights and kernels, norms and attention in other code: float32 roundings
    apart. With int8 activations a value on a rounding boundary may also go to the next step
    in one path alone (the paths' norms differ in the last bit), moving that step's row by up
    to ~5e-3 (seen once in 15 rows x steps, on other seeds never)."""
    tolerance = 2e-2 if engine.model.layers[0]["wqkv"].activations == "int8" else 1e-4
    fused, torch_ops = decode(engine, [3, 0, 2], fused=True), decode(engine, [3, 0, 2], fused=False)
    torch.testing.assert_close(fused, torch_ops, rtol=tolerance, atol=tolerance)


def test_a_row_has_the_same_bits_alone_and_in_any_batch(engine):
    batch = decode(engine, [2, 0, 3], fused=True)
    for i, slot in enumerate([2, 0, 3]):
        assert torch.equal(decode(engine, [slot], fused=True)[:, 0], batch[:, i]), slot


# ---- The catalogue's Q4_K_M model -----------------------------------------------------------

QWEN = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture(scope="module")
def qwen():
    """qwen2.5-coder-0.5b-instruct Q4_K_M, fetched and checked on first use as `mashbox run`
    does. (Its 896-wide rows are no multiple of 256: only ffn_down, 4864 wide, has K-quants,
    Q4_K in 12 layers and Q6_K in 12; the rest is Q5_0 and Q8_0.)"""
    return registry.fetch(registry.resolve(QWEN), registry.default_models_dir())


@pytest.mark.slow
def test_real_q4_k_blocks_load_exactly(qwen):
    _, infos = gguf_file.read(qwen)
    q4_k = [t for t in infos if t.qtype == Q.Q4_K]
    assert len(q4_k) == 12 and all(t.name.endswith("ffn_down.weight") for t in q4_k)
    for t in q4_k:
        raw = np.array(t.data, dtype=np.uint8).reshape(t.shape[0], -1, 144)
        ref = dequantize(t.data, t.qtype, t.shape)
        q, d, m = unpack(blocks_of(raw))
        w = (q.float().view(*d.shape, 32) * d[..., None] + m[..., None]).view(ref.shape)
        assert torch.equal(w, ref), t.name
    # The kernel itself on one: the first 64 columns read back through x = identity.
    weight = Int4Weight([blocks_of(raw)])
    eye = torch.eye(ref.shape[1])[:64]
    assert torch.equal(weight.kernel.q4_linear(eye, weight.qs, weight.dm).T, ref[:, :64])
