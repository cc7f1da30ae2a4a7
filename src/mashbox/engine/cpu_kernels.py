"""mashbox's own CPU kernels for decode steps with int8 or int4 weights.

- `int8_gemm.cpp`: int8 weights x float32 activations. torch's `_weight_int8pack_mm` wants
  bf16 activations and reads the weights at ~8-13 GB/s on the 2-core AVX2 machines here; this
  one reads them (packed by `pack_int8`) once per call at up to ~20 GB/s, keeps activations
  in float32 (closer to the float path) and sums every output in one order, so a row's bits
  do not depend on the batch.
- `blocks_gemm.cpp`: the same with a GGUF file's own Q4_0/Q4_1/Q5_0/Q5_1 and Q8_0 blocks read
  as stored (packed by `pack_q4`, `pack_q5` / `pack_q8`): the file's weights exactly; the
  K-quants' too, as groups of 32 with float32 d and m (int4.py) or of 16 (Q6_K).
- `rounded_gemm.cpp`: `q4a16` / `q4a8` (and `q5a16` / `q5a8`), the same Q4 and Q5 blocks with
  activations rounded per block of 32 to int16 / int8 (llama.cpp's rounding), for exact
  integer dot products (int8 ones, VNNI where there is: int16 activations as two bytes).
  These also read the K-quants' scales as stored (`pack_k_scales`), and `q6a16` Q6_K's
  blocks as stored (`pack_q6`: 6-bit q, int8 sc per 16, fp16 d per 256).
- `decode_layers.cpp`: `DecodeStack`, a whole decode step (the embedding's rows, every
  layer, the head) in one call, with no torch op dispatch per norm, RoPE or residual.

Built once per machine by `mashbox kernels` (scripts/setup.sh runs it) down a ladder of
compiler targets (`kernel_build.py`): the first that compiles and passes `self_check` is
used, and every outcome is remembered, so no process compiles again or repeats a failure.
Without AVX2/FMA/F16C, a compiler or any target that builds, or with MASHBOX_CPU_KERNELS=0,
`load()` returns None, `report().fallback` says why, and torch's ops are used.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import torch

from . import kernel_build
from .kernel_build import Target

if TYPE_CHECKING:
    from .weights import RawBlocks

log = logging.getLogger("mashbox")

builds = 0  # kernel modules this process loaded (compiled now, or built earlier)


@attrs.frozen
class Attempt:
    """One rung of the ladder in this process."""

    target: str
    flags: tuple[str, ...]
    outcome: str  # "built", "cached", "failed", "failed before" (not compiled again), "skipped"
    why: str = ""
    seconds: float = 0.0  # the compile's wall time, now or when it was built
    where: str = ""


@attrs.frozen
class Report:
    """What `load()` found: every target tried, the one used, or why none is."""

    attempts: tuple[Attempt, ...] = ()
    chosen: Attempt | None = None
    isa: str = ""  # what the chosen build's code uses: "avx512", "avx512+vnni", "avx2", ...
    fallback: str = ""  # why there are no kernels, with the remedy ("" when there are)

    @property
    def kernels(self) -> str:
        """The chosen build as people read it, e.g. "avx512+vnni (native, -mno-avx512bf16)"."""
        if self.chosen is None:
            return ""
        return f"{self.isa} ({', '.join(f.removeprefix('-march=') for f in self.chosen.flags)})"


_report = Report()


def report() -> Report:
    load()
    return _report


@functools.cache
def load():
    """The compiled module (`int8_linear(x, pack_int8(q), scale)`, `DecodeStack`), or None
    where it cannot be used (`report()` says why, loudly logged)."""
    global _report, builds
    _report, module = _walk_ladder()
    if module is not None:
        builds += 1
        if module.amx().startswith("refused"):  # the CPU and the build have it, Linux not
            log.warning(
                "AMX %s: prefill chunks' matmuls take AVX-512 alone, ~1.5x as slow",
                module.amx(),
            )
    else:
        log.warning(
            "CPU kernels unavailable: %s. Decode falls back to torch's ops, several "
            "times slower (`mashbox kernels` shows each target tried).",
            _report.fallback,
        )
    return module


def _walk_ladder() -> tuple[Report, object | None]:
    if os.environ.get("MASHBOX_CPU_KERNELS") == "0":
        return Report(fallback="turned off by MASHBOX_CPU_KERNELS=0 (unset it)"), None
    lacks = kernel_build.machine_lacks()
    if lacks:
        return Report(fallback=lacks), None
    try:
        targets = kernel_build.ladder()
    except ValueError as exc:
        return Report(fallback=str(exc)), None
    attempts: list[Attempt] = []
    for target in targets:
        missing = target.needs - kernel_build.cpu()[1]
        if missing:
            why = (
                "the same code as native here (the CPU has no AVX-512 BF16)"
                if missing == {"avx512_bf16"}
                else f"the CPU lacks {', '.join(sorted(missing))}"
            )
            attempts.append(Attempt(target.name, target.flags, "skipped", why))
            continue
        attempt, module = _try(target)
        attempts.append(attempt)
        if module is not None:
            return Report(tuple(attempts), attempt, module.isa()), module
    tried = "; ".join(f"{a.target}: {a.why}" for a in attempts if a.outcome != "skipped")
    fallback = (
        f"no compiler target built and passed its self-check ({tried}); "
        "install another g++ and point CXX at it"
    )
    return Report(tuple(attempts), fallback=fallback), None


def _try(target: Target, again: bool = True) -> tuple[Attempt, object | None]:
    """Build (once, under a lock) or import one target and check it."""
    flags = kernel_build.flags_for(target)
    where = kernel_build.directory(target, flags)
    record = kernel_build.recorded(where)
    if record is None:
        with kernel_build.exclusive(where):
            record = kernel_build.recorded(where)  # another process may have built it meanwhile
            if record is None:
                return _build(target, flags, where)
    attempt = functools.partial(
        Attempt, target.name, flags, seconds=record.seconds, where=str(where)
    )
    if not record.ok:
        return attempt("failed before", record.reason), None
    try:
        module = kernel_build.import_library(where, record.library)
    except ImportError:  # the file went away or is torn: build it again, once
        kernel_build.forget(where)
        return _try(target, again=False) if again else (attempt("failed", "cannot import"), None)
    problem = self_check(module)
    if problem:
        kernel_build.remember(where, attrs.evolve(record, ok=False, reason=problem))
        return attempt("failed", problem), None
    return attempt("cached"), module


def _build(target: Target, flags: tuple[str, ...], where: Path) -> tuple[Attempt, object | None]:
    log.info("compiling the CPU kernels for %s (%s), once", target.name, " ".join(flags))
    t0 = time.monotonic()
    try:
        module = kernel_build.compile_module(flags, where)
        problem = self_check(module)
    except Exception as exc:  # a compiler error or crash
        module, problem = None, kernel_build.first_error(exc)
    seconds = round(time.monotonic() - t0, 1)
    library = module.__file__ if module is not None else ""
    record = kernel_build.Record(target.name, flags, not problem, problem or "", seconds, library)
    kernel_build.remember(where, record)
    attempt = Attempt(
        target.name, flags, "failed" if problem else "built", problem or "", seconds, str(where)
    )
    if problem:
        log.warning("CPU kernels for %s failed (%s); trying the next target", target.name, problem)
        return attempt, None
    return attempt, module


# The self-check: every matmul kernel on inputs whose products and sums are all exact in
# float32, so the right answer is known to the bit whatever order the kernel sums in; the
# rows cover every row blocking the kernels have (8, 4, 2 and 1-row blocks, one row over
# two tiles) and the outputs a pair of tiles and a tile alone.
CHECK_ROWS = (1, 2, 3, 4, 5, 8, 9, 12, 17)
CHECK_OUTPUTS = (64, 96)
CHECK_K = 64


def self_check(module) -> str | None:
    """None if each kernel gives the exact answer; else which one did not, and where."""
    g = torch.Generator().manual_seed(0)
    for n in CHECK_OUTPUTS:
        for name, matmul, weight, make_x in _check_cases(module, n, g):
            for m in CHECK_ROWS:
                x = make_x(m)
                want = (x.double() @ weight.T).float()
                got = matmul(x)
                if not torch.equal(got, want):
                    return f"self-check: {name} is not exact at {m} rows x {n} outputs"
    return _check_repack(module, g) or _check_attention(module, g)


def _check_repack(module, g: torch.Generator) -> str | None:
    """block_bits, pack_blocks and pack_blocks_q8 (block_repack.cpp) against their torch
    definitions, on random bytes of every block type in a 64 x 512 matrix of two parts."""
    from gguf import GGML_QUANT_SIZES

    from .block_bits import BITS_QTYPES, kernel_args, torch_bits
    from .weights import RawBlocks

    for qtype in BITS_QTYPES:
        block, size = GGML_QUANT_SIZES[qtype]
        raw = torch.randint(0, 256, (64, 512 // block, size), generator=g, dtype=torch.uint8)
        parts = kernel_args([RawBlocks(qtype, raw[:32]), RawBlocks(qtype, raw[32:])])
        q = torch_bits(RawBlocks(qtype, raw))
        if not torch.equal(module.block_bits(*parts), q):
            return f"self-check: block_bits is wrong for {qtype.name}"
        planes = int(q.max()).bit_length() - 4
        if not torch.equal(module.pack_blocks(*parts, planes), packed_bits(q, planes)):
            return f"self-check: pack_blocks is wrong for {qtype.name}"
        int8 = pack_q8(q.to(torch.int8) - 32, torch.ones(len(q), 16))[0]
        if not torch.equal(module.pack_blocks_q8(*parts, 32), int8):
            return f"self-check: pack_blocks_q8 is wrong for {qtype.name}"
        for name, packed in torch_block_scales(RawBlocks(qtype, raw)).items():
            if not torch.equal(getattr(module, name)(*parts).view(torch.uint8), packed):
                return f"self-check: {name} is wrong for {qtype.name}"
    return None


def torch_block_scales(blocks: RawBlocks) -> dict[str, torch.Tensor]:
    """What each of the kernels' scale packers (block_repack.cpp) makes of K-quant blocks,
    by its torch definition, as bytes: none for the other block types."""
    from gguf import GGMLQuantizationType as Q

    from .int4 import K_QTYPES, k_scales
    from .q6_weight import group_scales, q6_k_scales

    if blocks.qtype in K_QTYPES:
        return {"blocks_k_scales": pack_k_scales(*k_scales(blocks.data))}
    if blocks.qtype == Q.Q6_K:
        sc, d = q6_k_scales(blocks.data)
        return {
            "blocks_q6_scales": pack_q6_scales(sc, d),
            "blocks_q6_group_scales": pack_q8_scales(group_scales(sc, d)).view(torch.uint8),
        }
    return {}


def _check_attention(module, g: torch.Generator) -> str | None:
    """prefill_attention against float64 attention: e^x is a polynomial, so within float32
    rounding rather than exact. Three query heads to a kv head, 20 rows whose keys cross a
    block of 128, and a chunk starting at 0; a float32 cache, then a float16 one (its values
    widened exactly, so the same bound against them in float64)."""
    heads, kv_heads, hd = 6, 2, 64
    for start, rows, kv_dtype in ((0, 9, torch.float32), (120, 20, torch.float16)):
        end = start + rows
        q = torch.randn(rows, heads, hd, generator=g)
        k, v = torch.randn(2, kv_heads, end, hd, generator=g).to(kv_dtype).unbind(0)
        sees = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
        want = torch.nn.functional.scaled_dot_product_attention(
            q.double().transpose(0, 1)[None], k.double()[None], v.double()[None],
            attn_mask=sees, enable_gqa=True,
        )[0].transpose(0, 1).reshape(rows, -1)  # fmt: skip
        error = (module.prefill_attention(q, k, v, start).double() - want).abs().max().item()
        if not error < 1e-5:
            return (
                f"self-check: prefill_attention is off by {error:.1e} at {start}+{rows} "
                f"over a {kv_dtype} cache"
            )
    return None


def _check_cases(module, n: int, g: torch.Generator) -> list[tuple]:
    """(name, matmul(x), the weights it multiplies by in float64, x of m rows) per kernel."""
    k, blocks = CHECK_K, CHECK_K // 32

    def ints(low: int, high: int, shape, dtype=torch.float32):
        return torch.randint(low, high, shape, generator=g).to(dtype)

    def per_block(v: torch.Tensor) -> torch.Tensor:
        return v.double().repeat_interleave(32, 1)

    def float_x(m: int) -> torch.Tensor:  # multiples of 1/4 in [-2, 2]
        return ints(-8, 9, (m, k)) / 4

    def rounded_x(limit: int, small: int, dx: float, k: int = k):
        """Activations the int16 / int8 rounding keeps exactly: per block of 32 one value at
        the bound (so the block's scale is dx, a power of two), the rest small multiples."""

        def make(m: int) -> torch.Tensor:
            xq = ints(-small, small + 1, (m, k // 32, 32))
            xq[..., 0] = limit * (1 - 2 * ints(0, 2, (m, k // 32)))
            return (xq * dx).view(m, k)

        return make

    q8 = ints(-127, 128, (n, k), torch.int8)
    scale = torch.full((n,), 2.0**-7)
    q4 = ints(0, 16, (n, k), torch.uint8)
    d4 = (2.0 ** -ints(3, 5, (n, blocks))).half()
    m4 = (-ints(0, 3, (n, blocks)) / 2).half()
    w4 = q4.double() * per_block(d4) + per_block(m4)
    qs4, dm4 = pack_q4(q4, d4, m4)
    # float32 d and m (Q4_K's d * sc and -dmin * mn), kept small enough to stay exact
    d4k = d4.float() * ints(1, 4, (n, blocks))
    m4k = m4.float() * ints(1, 4, (n, blocks))
    w4k = q4.double() * per_block(d4k) + per_block(m4k)
    _, dm4k = pack_q4(q4, d4k, m4k)
    q5 = ints(0, 32, (n, k), torch.uint8)
    w5 = q5.double() * per_block(d4) + per_block(m4)
    qs5, _ = pack_q5(q5, d4, m4)
    # d alone (Q4_0's m = -8 d, Q5_0's -16 d, derived by the kernels)
    _, d40 = pack_q4(q4, d4, None)
    w40, w50 = (q.double() * per_block(d4) - c * per_block(d4) for q, c in ((q4, 8), (q5, 16)))
    w5k = q5.double() * per_block(d4k) + per_block(m4k)
    d8 = (2.0 ** -ints(7, 9, (n, blocks))).half()
    d16 = (2.0 ** -ints(7, 9, (n, 2 * blocks))) * ints(1, 4, (n, 2 * blocks))
    # Q6_K's q - 32 (-32..31): with int16 x, wider weights would make even the float64
    # product of 4 groups' scaled sums round (any kernel, float32 x included)
    q6 = ints(-32, 32, (n, k), torch.int8)
    qs16, ds16 = pack_q8(q6, d16)
    w16 = q6.double() * d16.double().repeat_interleave(16, 1)
    qs8, ds8 = pack_q8(q8, d8)
    packed8, w8 = pack_int8(q8), q8.double() / 128
    w_q8 = q8.double() * per_block(d8)
    x16, x8 = rounded_x(32767, 64, 2.0**-15), rounded_x(127, 127, 2.0**-7)
    # Q6_K's blocks as stored take K = 256 (a superblock): q near 32 (both top bits vary), so
    # that 16 groups' scaled sums stay exact in float32.
    q6k = ints(28, 36, (n, 256), torch.uint8)
    sc6 = ints(1, 4, (n, 16)) * (1 - 2 * ints(0, 2, (n, 16)))
    d6 = (2.0 ** -ints(7, 9, (n, 1))).half()
    qs6, scales6 = pack_q6(q6k, sc6.to(torch.int8), d6)
    w6 = (q6k.double() - 32) * (d6.double() * sc6.double()).repeat_interleave(16, 1)
    x6 = rounded_x(32767, 64, 2.0**-15, k=256)
    # The K-quants' scales as stored (K = 256): sc and mn small and q in 0..3, so that 8
    # groups' scaled sums stay exact in float32
    sck, mnk = ints(1, 4, (n, 8), torch.uint8), ints(0, 4, (n, 8), torch.uint8)
    dk, dmink = (2.0 ** -ints(8, 10, (n, 1))).half(), (2.0 ** -ints(8, 10, (n, 1))).half()
    q4k = ints(0, 4, (n, 256), torch.uint8)
    qs4k, ks = nibbles(q4k), pack_k_scales(sck, mnk, dk, dmink)
    per_group = dk.double().repeat_interleave(8, 1) * sck.double()
    per_group_m = -dmink.double().repeat_interleave(8, 1) * mnk.double()
    w4kk = q4k.double() * per_group.repeat_interleave(32, 1) + per_group_m.repeat_interleave(32, 1)
    x8k = rounded_x(127, 127, 2.0**-7, k=256)
    return [
        ("int8_linear", lambda x: module.int8_linear(x, packed8, scale), w8, float_x),
        ("q4_linear", lambda x: module.q4_linear(x, qs4, dm4), w4, float_x),
        ("q4a16_linear", lambda x: module.q4a16_linear(x, qs4, dm4), w4, x16),
        ("q4a8_linear", lambda x: module.q4a8_linear(x, qs4, dm4), w4, x8),
        ("q4_linear (float32 d, m)", lambda x: module.q4_linear(x, qs4, dm4k), w4k, float_x),
        ("q4a16_linear (float32 d, m)", lambda x: module.q4a16_linear(x, qs4, dm4k), w4k, x16),
        ("q4a8_linear (float32 d, m)", lambda x: module.q4a8_linear(x, qs4, dm4k), w4k, x8),
        ("q5_linear", lambda x: module.q4_linear(x, qs5, dm4), w5, float_x),
        ("q5a16_linear", lambda x: module.q4a16_linear(x, qs5, dm4), w5, x16),
        ("q5a8_linear", lambda x: module.q4a8_linear(x, qs5, dm4), w5, x8),
        ("q5_linear (float32 d, m)", lambda x: module.q4_linear(x, qs5, dm4k), w5k, float_x),
        ("q5a16_linear (float32 d, m)", lambda x: module.q4a16_linear(x, qs5, dm4k), w5k, x16),
        ("q5a8_linear (float32 d, m)", lambda x: module.q4a8_linear(x, qs5, dm4k), w5k, x8),
        ("q4_linear (Q4_0: d alone)", lambda x: module.q4_linear(x, qs4, d40), w40, float_x),
        ("q4a16_linear (Q4_0: d alone)", lambda x: module.q4a16_linear(x, qs4, d40), w40, x16),
        ("q4a8_linear (Q4_0: d alone)", lambda x: module.q4a8_linear(x, qs4, d40), w40, x8),
        ("q5_linear (Q5_0: d alone)", lambda x: module.q4_linear(x, qs5, d40), w50, float_x),
        ("q5a16_linear (Q5_0: d alone)", lambda x: module.q4a16_linear(x, qs5, d40), w50, x16),
        ("q5a8_linear (Q5_0: d alone)", lambda x: module.q4a8_linear(x, qs5, d40), w50, x8),
        ("q8_linear", lambda x: module.q8_linear(x, qs8, ds8), w_q8, float_x),
        ("q8_linear (groups of 16)", lambda x: module.q8_linear(x, qs16, ds16), w16, float_x),
        ("q8a16_linear", lambda x: module.q8a16_linear(x, qs8, ds8), w_q8, x16),
        ("q8a16_linear (groups of 16)", lambda x: module.q8a16_linear(x, qs16, ds16), w16, x16),
        ("q6a16_linear", lambda x: module.q6a16_linear(x, qs6, scales6), w6, x6),
        ("q4a16_linear (K scales)", lambda x: module.q4a16_linear(x, qs4k, ks), w4kk, x6),
        ("q4a8_linear (K scales)", lambda x: module.q4a8_linear(x, qs4k, ks), w4kk, x8k),
    ]


TILE = 32  # output rows per packed tile (int8_gemm.cpp)


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 weights [N, K] as the kernel reads them: tiles of 32 output rows, k-major,
    [ceil(N / 32), K, 32], the last tile padded with zeros."""
    n, k = q.shape
    pad = -n % TILE
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
    return q.view(-1, TILE, k).transpose(1, 2).contiguous()


def pack_q4(
    q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF matrix's 4-bit blocks as the Q4 kernels (blocks_gemm.cpp, rounded_gemm.cpp)
    read them: q uint8 [N, K] in 0..15 and fp16 (or float32: Q4_K's) d, m [N, K / 32]
    (w = q * d + m) -> qs uint8 [N / 32, K / 8, 128], per 32 outputs and 8 weights a record
    of 4 bytes an output, byte j holding weights j (low nibble) and j + 4 (high), so one
    32-bit lane holds 4 consecutive weights for an int8 dot product; and dm
    [N / 32, K / 32, 2, 32] in d's dtype, or [.., 1, 32] with m None (Q4_0: the kernels take
    m = -8 d; Q5_0 in pack_q5: -16 d)."""
    return nibbles(q), pack_scales(d, m)


def pack_scales(d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """pack_q4's dm of d and m [N, K / 32] (or d alone)."""
    n, blocks = d.shape
    scales = [d] if m is None else [d, m]
    dm = torch.stack(scales, dim=-1).view(n // TILE, TILE, blocks, len(scales))
    return dm.permute(0, 2, 3, 1).contiguous()


def pack_k_scales(
    sc: torch.Tensor, mn: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor
) -> torch.Tensor:
    """The K-quants' scales as stored (int4.k_scales: sc, mn uint8 [N, K / 32], fp16 d, dmin
    [N, K / 256]; w = d * sc * q - dmin * mn) as the rounded kernels read them in place of
    float32 d and m: uint8 [N / 32, K / 256, 640], per tile and 256 weights sc [8, 32], mn
    [8, 32], then fp16 d [32] and -dmin [32]."""
    n, groups = sc.shape
    tiles, supers = n // TILE, groups // 8

    def per_group(v: torch.Tensor) -> torch.Tensor:  # [N, K / 32] -> [tiles, supers, 8 * 32]
        return v.view(tiles, TILE, supers, 8).permute(0, 2, 3, 1).reshape(tiles, supers, -1)

    def per_super(v: torch.Tensor) -> torch.Tensor:  # fp16 [N, K / 256] -> bytes [.., 64]
        return v.view(tiles, TILE, supers).transpose(1, 2).contiguous().view(torch.uint8)

    parts = [per_group(sc), per_group(mn), per_super(d), per_super(-dmin)]
    return torch.cat(parts, dim=-1).contiguous()


def unpack_k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """pack_k_scales' bytes back to sc, mn, d and dmin."""
    tiles, supers, _ = scales.shape

    def per_group(v: torch.Tensor) -> torch.Tensor:
        return v.reshape(tiles, supers, 8, TILE).permute(0, 3, 1, 2).reshape(tiles * TILE, -1)

    def per_super(v: torch.Tensor) -> torch.Tensor:
        return v.contiguous().view(torch.float16).transpose(1, 2).reshape(tiles * TILE, supers)

    at = 8 * TILE
    sc, mn = per_group(scales[..., :at]), per_group(scales[..., at : 2 * at])
    d, dmin = per_super(scales[..., 2 * at : 2 * at + 64]), -per_super(scales[..., 2 * at + 64 :])
    return sc, mn, d, dmin


def nibbles(q: torch.Tensor) -> torch.Tensor:
    """pack_q4's qs of q uint8 [N, K] in 0..15: uint8 [N / 32, K / 8, 128]."""
    n, k = q.shape
    eights = q.view(n // TILE, TILE, k // 8, 8)
    qs = (eights[..., :4] | (eights[..., 4:] << 4)).permute(0, 2, 1, 3)
    return qs.reshape(n // TILE, k // 8, 4 * TILE)


def packed_bits(q: torch.Tensor, planes: int) -> torch.Tensor:
    """q's low nibbles as pack_q4's qs, each record followed by `planes` bit planes of bits 4
    and 5: pack_q4's (0), pack_q5's (1) and pack_q6's (2) qs."""
    low = nibbles(q & 0x0F)
    return torch.cat([low, *(bit_plane((q >> (4 + p)) & 1) for p in range(planes))], dim=-1)


def bit_plane(bits: torch.Tensor) -> torch.Tensor:
    """One bit a weight (uint8 [N, K] in 0..1) as a record's 32 bytes, little-endian: 128
    bits for the records' low nibbles (bit 4o + j: output o's byte j), then 128 for the high
    ones -> uint8 [N / 32, K / 8, 32]."""
    n, k = bits.shape
    halves = bits.view(n // TILE, TILE, k // 8, 2, 4).permute(0, 2, 3, 1, 4)  # [.., 2, 32, 4]
    eights = halves.reshape(n // TILE, k // 8, 32, 8)
    packed = eights[..., 0].clone()
    for bit in range(1, 8):  # in uint8 throughout: a big matrix's load peaks at its bytes
        packed |= eights[..., bit] << bit
    return packed


def pack_q5(
    q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """5-bit blocks (q uint8 [N, K] in 0..31; d, m as pack_q4's) as the Q5 kernels read them:
    qs uint8 [N / 32, K / 8, 160], each record pack_q4's 128 bytes of low nibbles, then their
    fifth bits, little-endian: 128 bits for the low nibbles (bit 4o + j: output o's byte j),
    then 128 for the high ones; dm as pack_q4's."""
    return packed_bits(q, 1), pack_scales(d, m)


def pack_q6(
    q: torch.Tensor, sc: torch.Tensor, d: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K's blocks (q uint8 [N, K] in 0..63, int8 sc [N, K / 16], fp16 d [N, K / 256]; w =
    d * sc * (q - 32)) as q6a16 reads them: qs uint8 [N / 32, K / 8, 192], pack_q5's records
    with a plane of sixth bits after the fifth; and scales uint8 [N / 32, K / 256, 576], per
    tile and 256 weights the int8 sc [16, 32], then the fp16 d [32]."""
    return packed_bits(q, 2), pack_q6_scales(sc, d)


def pack_q6_scales(sc: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """pack_q6's scales of int8 sc [N, K / 16] and fp16 d [N, K / 256]."""
    n, k = sc.shape[0], sc.shape[1] * 16
    tiles, supers = n // TILE, k // 256
    sc = sc.view(tiles, TILE, supers, 16).permute(0, 2, 3, 1).reshape(tiles, supers, 16 * TILE)
    d = d.view(tiles, TILE, supers).transpose(1, 2).contiguous()
    return torch.cat([sc.view(torch.uint8), d.view(torch.uint8)], dim=-1).contiguous()


def unpack_q6(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pack_q6's scales back to int8 sc [N, K / 16] and fp16 d [N, K / 256] (q: unpack_q4)."""
    tiles, supers, _ = scales.shape
    sc = scales[..., : 16 * TILE].contiguous().view(torch.int8).view(tiles, supers, 16, TILE)
    d = scales[..., 16 * TILE :].contiguous().view(torch.float16)  # [tiles, supers, 32]
    sc = sc.permute(0, 3, 1, 2).reshape(tiles * TILE, supers * 16)
    return sc, d.transpose(1, 2).reshape(tiles * TILE, supers)


def unpack_q4(qs: torch.Tensor) -> torch.Tensor:
    """pack_q4's (or pack_q5's, pack_q6's) qs back to q uint8 [N, K]."""
    tiles, groups, record = qs.shape
    low = qs[..., : 4 * TILE].reshape(tiles, groups, TILE, 4)
    q = torch.cat([low & 0x0F, low >> 4], dim=-1)  # [.., 32, 8]
    for plane in range((record - 4 * TILE) // TILE):  # fifth bits, then sixth
        at = (4 + plane) * TILE
        bits = qs[..., at : at + TILE].reshape(tiles, groups, 2, TILE // 2, 1)
        bit = (bits >> torch.arange(8, dtype=torch.uint8)) & 1  # [.., 2, 16, 8]
        bit = bit.reshape(tiles, groups, 2, TILE, 4)  # [.., low/high, output, j]
        q = q | (torch.cat([bit[:, :, 0], bit[:, :, 1]], dim=-1) << (4 + plane))
    return q.permute(0, 2, 1, 3).reshape(tiles * TILE, groups * 8)


def pack_q8(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF matrix's Q8_0 blocks as the Q8 kernels read them: q int8 [N, K] and fp16 d
    [N, K / 32] (w = q * d) -> qs int8 [N / 32, K / 2, 64], per 32 outputs and pair of
    weights k, k + 1 two bytes an output (one 32-bit lane of two int16 words once widened),
    and d fp16 [N / 32, K / 32, 32]; or float32 d [N, K / 16] (groups of 16: Q6_K's) ->
    [N / 32, K / 16, 32]."""
    n, k = q.shape
    qs = q.view(n // TILE, TILE, k // 2, 2).transpose(1, 2).reshape(n // TILE, k // 2, 2 * TILE)
    return qs, pack_q8_scales(d)


def pack_q8_scales(d: torch.Tensor) -> torch.Tensor:
    """pack_q8's d of d [N, K / 32] (fp16) or [N, K / 16] (float32)."""
    n = d.shape[0]
    return d.view(n // TILE, TILE, d.shape[1]).transpose(1, 2).contiguous()
