"""A long prompt's prefill against the machine's FLOP/s: where the time goes (layer matmuls,
attention, the rest) and how close each comes to the practical peak.

    python bench/prefill_roofline.py                                  # SmolLM2, 2,048 tokens
    python bench/prefill_roofline.py --model qwen2.5-coder-0.5b-instruct --tokens 20480
    python bench/prefill_roofline.py --torch-attention   # torch's attention, for comparison
    python bench/prefill_roofline.py --no-amx     # the AVX-512 matmuls alone, where AMX is on

The Engine alone (no server), the prompt fed in --chunk-token chunks as the scheduler feeds
it (`--prefill-chunk`). FLOPs: 2 per weight per token for the layer matmuls, 4 * keys *
head_dim per query head per layer for attention (QK^T and AV over the keys each row sees).
The peaks are measured, not quoted, on the same threads: float32 sgemm (torch.mm, MKL) of
2048 x 2048 matrices, best of 5, the practical one; and independent float32 FMAs at the CPU's
widest vectors (compiled here with -march=native), the ceiling for attention, and independent
int16 dot products (`vpdpwssd`), the ceiling for the int4a16 matmuls; where the kernels put
their prefill chunks on AMX, its int8 tile products instead (two a product: an activation's
high and low bytes). On 2 cores nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import math
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from mashbox.engine import cpu_kernels
from mashbox.engine.engine import Engine
from mashbox.registry import DEFAULT_MODEL, default_models_dir, fetch, resolve


def sgemm_peak(n: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of float32 torch.mm at n x n x n, best of `repeats`."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = min(_seconds(lambda: torch.mm(a, b)) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


PEAK_LOOPS = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <chrono>

// Seconds for body(t) run on each of torch's threads t at once.
template <typename Body>
double seconds_on_every_thread(const Body& body) {
  const auto t0 = std::chrono::steady_clock::now();
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) body(t);
  });
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

typedef float lanes16 __attribute__((vector_size(64)));  // one zmm, or two ymm

// 12 independent chains of a * m + c (contracted to FMAs) on every thread: GFLOP/s.
double fma_gflops(int64_t iterations) {
  std::vector<float> sink(at::get_num_threads());
  const double s = seconds_on_every_thread([&](int64_t t) {
    lanes16 a[12], m = lanes16{} + 0.999f, c = lanes16{} + 1e-4f;
    for (int i = 0; i < 12; ++i) a[i] = lanes16{} + static_cast<float>(i);
    for (int64_t it = 0; it < iterations; ++it)
      for (int i = 0; i < 12; ++i) a[i] = a[i] * m + c;
    for (int i = 0; i < 12; ++i) sink[t] += a[i][0];
  });
  return sink.size() * static_cast<double>(iterations) * 12 * 16 * 2 / s / 1e9;
}

// The same for int16 dot products into int32 (what the int4a16 kernels' several rows and
// q8a16 run on): vpdpwssd, or vpmaddwd and an add without VNNI. GOP/s, 2 a product.
#if defined(__AVX512F__)
typedef __m512i words;
static inline words dot(words acc, words a) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, a, a);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, a));
#endif
}
#else
typedef __m256i words;
static inline words dot(words acc, words a) {
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, a, a);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, a));
#endif
}
#endif
// Chains enough to hide the latency: 12 reached only ~0.8 a cycle on Zen 5, 24 ~1.2.
constexpr int CHAINS = sizeof(words) == 64 ? 24 : 12;
double dot16_gops(int64_t iterations) {
  std::vector<int> sink(at::get_num_threads());
  const double s = seconds_on_every_thread([&](int64_t t) {
    words acc[CHAINS], a;
    std::memset(&a, 1, sizeof a);
    for (int i = 0; i < CHAINS; ++i) std::memset(&acc[i], i, sizeof acc[i]);
    for (int64_t it = 0; it < iterations; ++it)
      for (int i = 0; i < CHAINS; ++i) acc[i] = dot(acc[i], a);
    for (int i = 0; i < CHAINS; ++i) sink[t] += reinterpret_cast<const int*>(&acc[i])[0];
  });
  return sink.size() * static_cast<double>(iterations) * CHAINS * (sizeof(words) / 2) * 2 / s /
         1e9;
}

// AMX's int8 tile products (16 x 64 by 64 x 16 into int32, four independent sums) on every
// thread, GOP/s; 0 where the build or Linux has no AMX. The int4a16 matmuls' prefill chunks
// take two a product (an int16 activation's high and low bytes).
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
double amx_gops(int64_t iterations) {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) return 0;
  const double s = seconds_on_every_thread([&](int64_t) {
    struct {
      uint8_t palette = 1, start_row = 0, reserved[14] = {};
      uint16_t colsb[16] = {64, 64, 64, 64, 64, 64};
      uint8_t rows[16] = {16, 16, 16, 16, 16, 16};
    } config;
    _tile_loadconfig(&config);
    alignas(64) int8_t a[16 * 64] = {1}, b[16 * 64] = {1};
    _tile_loadd(4, a, 64);
    _tile_loadd(5, b, 64);
    for (int64_t it = 0; it < iterations; ++it) {
      _tile_dpbssd(0, 4, 5);
      _tile_dpbssd(1, 4, 5);
      _tile_dpbssd(2, 4, 5);
      _tile_dpbssd(3, 4, 5);
    }
    _tile_release();
  });
  return at::get_num_threads() * static_cast<double>(iterations) * 4 * 16 * 16 * 64 * 2 / s / 1e9;
}
#else
double amx_gops(int64_t) { return 0; }
#endif
"""


def peaks(iterations: int = 10_000_000) -> tuple[float, float, float]:
    """GFLOP/s of independent float32 FMAs, GOP/s of int16 dot products and of AMX's int8
    tile products (0: none) on every thread, best of 3 each."""
    from torch.utils.cpp_extension import load_inline

    module = load_inline(
        "mashbox_isa_peaks", PEAK_LOOPS, functions=["fma_gflops", "dot16_gops", "amx_gops"],
        extra_cflags=["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
    )  # fmt: skip
    return (
        max(module.fma_gflops(iterations) for _ in range(3)),
        max(module.dot16_gops(iterations) for _ in range(3)),
        max(module.amx_gops(iterations // 10) for _ in range(3)),
    )


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def layer_weights(engine: Engine) -> int:
    """Weights of the layer matrices one token multiplies (q/k/v, o, gate/up, down)."""
    return sum(
        math.prod(layer[name].shape)
        for layer in engine.model.layers
        for name in ("wqkv", "wo", "w_gate_up", "w_down")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--decode-weights", default="int4a16")
    parser.add_argument("--kv-dtype", default="auto", choices=["auto", "float16", "float32"])
    parser.add_argument(
        "--torch-attention", action="store_true", help="torch's attention, not the kernel's"
    )
    parser.add_argument(
        "--no-amx", action="store_true", help="the AVX-512 kernels alone, where AMX is on"
    )
    args = parser.parse_args()
    kernel = cpu_kernels.load()
    if args.no_amx and kernel is not None:
        kernel.set_amx(False)
    amx = kernel is not None and kernel.amx() == "on"
    ref = resolve(args.model)
    path = fetch(ref, default_models_dir())
    engine = Engine(
        path,
        slots=1,
        ctx=args.tokens + 8,
        decode_weights=args.decode_weights,
        kv_dtype=args.kv_dtype,
    )
    cfg = engine.model.cfg
    peak, (ceiling, dot16, amx8) = sgemm_peak(), peaks()
    print(f"{ref.id}, {args.tokens} tokens in chunks of {args.chunk}, {torch.get_num_threads()} "
          f"threads; float32 sgemm peak here: {peak:.1f} GFLOP/s, FMA ceiling "
          f"{ceiling:.1f}, int16 dot-product ceiling {dot16:.1f} GOP/s, AMX int8 "
          f"{amx8:.0f} GOP/s; prefill matmuls on AMX: "
          f"{'yes' if amx else kernel.amx() if kernel else 'no kernels'}")  # fmt: skip

    attention_s = 0.0

    def timed(fn):
        def run(*a, **k):
            nonlocal attention_s
            t0 = time.perf_counter()
            out = fn(*a, **k)
            attention_s += time.perf_counter() - t0
            return out

        return run

    # Attention is the CPU kernels' prefill_attention where the model has it, else torch's.
    kernels = engine.model.attention_kernels
    if args.torch_attention or kernels is None:
        engine.model.attention_kernels = None
        print("attention: torch's scaled_dot_product_attention")
    else:
        engine.model.attention_kernels = SimpleNamespace(
            prefill_attention=timed(kernels.prefill_attention)
        )
        print("attention: mashbox's prefill_attention kernel")
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = timed(original)
    ids = torch.randint(100, cfg.vocab_size - 100, (args.tokens,), generator=torch.Generator())
    total = 0.0
    with torch.inference_mode():
        for start in range(0, args.tokens, args.chunk):
            t0 = time.perf_counter()
            engine.model.prefill(engine.cache, 0, start, ids[start : start + args.chunk])
            total += time.perf_counter() - t0
    F.scaled_dot_product_attention = original

    n = args.tokens
    matmul_flop = 2 * layer_weights(engine) * n
    # Row p sees p + 1 keys: sum over rows = n (n + 1) / 2.
    attention_flop = 4 * cfg.head_dim * cfg.n_heads * cfg.n_layers * n * (n + 1) / 2
    rest_s = total - attention_s
    print(f"total {total:.2f} s: {n / total:.0f} tokens/s, "
          f"{(matmul_flop + attention_flop) / total / 1e9:.1f} GFLOP/s overall "
          f"({(matmul_flop + attention_flop) / total / 1e9 / peak:.0%} of sgemm's)")  # fmt: skip
    # Attention is float32 FMAs, bound by the FMA ceiling; the 4-bit matmuls with int16
    # activations (the default int4a16) are int16 dot products, bound by that ceiling (int4a8's
    # int8 ones run at twice its rate, float32 activations at the FMA ceiling), or on AMX by
    # half its int8 rate (two tile products a product; Q6_K and Q8_0 matrices stay off it).
    matmul_bound = (amx8 / 2, "AMX's int8 ceiling / 2") if amx else (
        dot16, "the int16 dot-product ceiling")  # fmt: skip
    for part, flop, seconds, bound in (
        ("attention", attention_flop, attention_s, (ceiling, "the FMA ceiling")),
        ("matmuls and the rest", matmul_flop, rest_s, matmul_bound),
    ):
        rate = flop / seconds / 1e9
        share = f", {rate / bound[0]:.0%} of {bound[1]}"
        print(f"  {part:22} {seconds:7.2f} s  {flop / 1e12:6.2f} TFLOP  {rate:6.1f} GFLOP/s "
              f"({rate / peak:.0%} of sgemm's{share})")  # fmt: skip


if __name__ == "__main__":
    main()
