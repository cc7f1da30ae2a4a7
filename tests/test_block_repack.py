"""The load's one pass over a matrix's blocks (block_repack.cpp) against its torch definition:
block_bits against block_bits.torch_bits for every block type, one part or several of mixed
types, pack_blocks / pack_blocks_q8 against cpu_kernels' packers, and the K-quants' scale
packers against theirs (cpu_kernels.torch_block_scales). The decode weights built from them
are checked against the file's own weights in test_kquant.py and test_q5_q6.py."""

from __future__ import annotations

import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from mashbox.engine import cpu_kernels, kernel_build
from mashbox.engine.block_bits import BITS_QTYPES, bits, kernel_args, torch_bits
from mashbox.engine.weights import RawBlocks

LACKS = kernel_build.machine_lacks()  # anywhere else, no kernels fails the tests below
pytestmark = pytest.mark.skipif(LACKS is not None, reason=f"cannot build the kernels: {LACKS}")
kernel = cpu_kernels.load()


def random_blocks(qtype, rows: int, k: int, seed: int) -> RawBlocks:
    """Random bytes in qtype's blocks: every bit of every byte is some weight's or a scale's."""
    block, size = GGML_QUANT_SIZES[qtype]
    g = torch.Generator().manual_seed(seed)
    return RawBlocks(qtype, torch.randint(0, 256, (rows, k // block, size), generator=g).byte())


@pytest.mark.parametrize("qtype", BITS_QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize(("rows", "k"), [(1, 256), (3, 512), (96, 768), (161, 256)])
def test_block_bits_are_torchs(qtype, rows, k):
    blocks = random_blocks(qtype, rows, k, seed=rows + k)
    q = kernel.block_bits([blocks.data], [int(qtype)])
    want = torch_bits(blocks)
    assert q.dtype == torch.uint8 and q.shape == (rows, k)
    assert torch.equal(q, want)
    assert int(q.max()) == {Q.Q6_K: 63, Q.Q4_0: 15, Q.Q4_1: 15, Q.Q4_K: 15}.get(qtype, 31)


def test_parts_of_mixed_types_stack_along_the_outputs():
    """A Q4_K_M layer's q, k and v can be three types: each part read as its own."""
    parts = [
        random_blocks(Q.Q4_K, 64, 512, seed=1),
        random_blocks(Q.Q5_1, 32, 512, seed=2),
        random_blocks(Q.Q6_K, 37, 512, seed=3),
    ]
    assert torch.equal(bits(parts), torch.cat([torch_bits(p) for p in parts]))


def test_strided_blocks_are_read_as_they_stand():
    """A view whose rows are not laid out one after another reads as its values, not as
    its memory."""
    blocks = random_blocks(Q.Q4_K, 64, 512, seed=4)
    strided = blocks.data.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    assert torch.equal(bits([RawBlocks(Q.Q4_K, strided)]), torch_bits(blocks))
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel.block_bits([strided], [int(Q.Q4_K)])


@pytest.mark.parametrize("qtype", BITS_QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize(("n", "k"), [(32, 256), (96, 768), (64, 4352)])
def test_packed_blocks_are_the_torch_packing(qtype, n, k):
    """pack_blocks: pack_q4's, pack_q5's and pack_q6's qs; pack_blocks_q8: pack_q8's of Q6_K's
    q - 32 (the prefill chunks' copy)."""
    blocks = random_blocks(qtype, n, k, seed=n + k)
    q = torch_bits(blocks)
    planes = {Q.Q6_K: 2, Q.Q5_0: 1, Q.Q5_1: 1, Q.Q5_K: 1}.get(qtype, 0)
    qs = kernel.pack_blocks(*kernel_args([blocks]), planes)
    assert torch.equal(qs, cpu_kernels.packed_bits(q, planes))
    assert torch.equal(cpu_kernels.unpack_q4(qs), q)
    int8 = cpu_kernels.pack_q8(q.to(torch.int8) - 32, torch.ones(n, k // 32))[0]
    assert torch.equal(kernel.pack_blocks_q8(*kernel_args([blocks]), 32), int8)


def test_a_tile_may_span_parts():
    """Parts of 48 and 16 rows: the first tile's outputs come from two parts of two types."""
    parts = [random_blocks(Q.Q4_K, 48, 512, seed=7), random_blocks(Q.Q5_K, 16, 512, seed=8)]
    q = torch.cat([torch_bits(p) for p in parts])
    assert torch.equal(kernel.pack_blocks(*kernel_args(parts), 1), cpu_kernels.packed_bits(q, 1))


def test_bad_shapes_are_refused_not_read_past():
    blocks = random_blocks(Q.Q4_K, 32, 256, seed=5)
    with pytest.raises(RuntimeError, match="is 18 bytes, not 144"):
        kernel.block_bits([blocks.data], [int(Q.Q4_0)])
    with pytest.raises(RuntimeError, match="different widths"):
        kernel.block_bits([blocks.data, random_blocks(Q.Q4_K, 32, 512, 6).data], [12, 12])
    with pytest.raises(RuntimeError, match="no block bits"):
        kernel.block_bits([blocks.data], [int(Q.Q8_0)])
    with pytest.raises(RuntimeError, match="multiple of 32, not 33"):
        kernel.pack_blocks(*kernel_args([random_blocks(Q.Q4_K, 33, 256, 9)]), 0)
    with pytest.raises(RuntimeError, match="bit planes"):
        kernel.pack_blocks([blocks.data], [int(Q.Q4_K)], 3)
    with pytest.raises(RuntimeError, match="no such scales for GGML type 12"):
        kernel.blocks_q6_scales([blocks.data], [int(Q.Q4_K)])
    with pytest.raises(RuntimeError, match="no such scales for GGML type 14"):
        kernel.blocks_k_scales(*kernel_args([random_blocks(Q.Q6_K, 32, 256, 10)]))


SCALE_QTYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


@pytest.mark.parametrize("qtype", SCALE_QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize(("n", "k"), [(32, 256), (96, 768), (160, 4352)])
def test_scales_are_the_torch_packing(qtype, n, k):
    """blocks_k_scales: pack_k_scales of k_scales'; blocks_q6_scales and
    blocks_q6_group_scales: pack_q6_scales' and pack_q8_scales' of q6_k_scales' sc and d.
    Random bytes: every d is some fp16, NaN and infinity among them, compared as bits."""
    blocks = random_blocks(qtype, n, k, seed=3 * n + k)
    want = cpu_kernels.torch_block_scales(blocks)
    assert len(want) == (2 if qtype == Q.Q6_K else 1)
    for name, packed in want.items():
        got = getattr(kernel, name)(*kernel_args([blocks]))
        assert got.is_contiguous()
        assert torch.equal(got.view(torch.uint8), packed), name


def test_scales_of_parts_stack_along_the_outputs():
    """A Q4_K_M layer's K-quant parts, Q4_K beside Q5_K, a tile across both: their scales as
    those of the one matrix they make."""
    parts = [random_blocks(Q.Q4_K, 48, 512, seed=11), random_blocks(Q.Q5_K, 48, 512, seed=12)]
    whole = RawBlocks(Q.Q4_K, torch.cat([p.data[..., :144] for p in parts]))
    want = cpu_kernels.torch_block_scales(whole)["blocks_k_scales"]  # the scales' bytes agree
    assert torch.equal(kernel.blocks_k_scales(*kernel_args(parts)), want)
    q6 = [random_blocks(Q.Q6_K, 32, 512, seed=13), random_blocks(Q.Q6_K, 64, 512, seed=14)]
    want = cpu_kernels.torch_block_scales(RawBlocks(Q.Q6_K, torch.cat([p.data for p in q6])))
    for name, packed in want.items():
        assert torch.equal(getattr(kernel, name)(*kernel_args(q6)).view(torch.uint8), packed)
