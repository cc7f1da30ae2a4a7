// mashbox's CPU kernels (built together as one extension by cpu_kernels.py).
#pragma once
#ifdef MASHBOX_BREAK_BUILD  // MASHBOX_KERNELS_BREAK names this target (kernel_build.py)
#error "a build broken on purpose (MASHBOX_KERNELS_BREAK), to test the fall-back ladder"
#endif
// ATen's tensor and the two factories the kernels call, not <torch/extension.h>: that one
// (pybind11 and the whole C++ frontend) takes ~36 s of each file's compile, these ~6.
// decode_layers.cpp, which binds the module, includes it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <immintrin.h>

#include "chunk_pool.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>
#include <vector>

// One vector of float32 lanes for the matmul kernels: AVX-512 where the machine that builds
// them has it (-march=native), AVX2 elsewhere. Each lane holds one output's own sum, added
// in the same order at either width, so both widths give the same bits.
#if defined(__AVX512F__)
constexpr int LANES = 16;
using vfloat = __m512;
using vint = __m512i;
static inline vfloat vzero() { return _mm512_setzero_ps(); }
static inline vfloat vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
static inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
static inline vfloat vmul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
static inline vfloat vadd(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
static inline vfloat vload(const float* p) { return _mm512_load_ps(p); }  // 64-byte aligned
static inline vfloat vloadu(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, vfloat v) { _mm512_store_ps(p, v); }
static inline void vstoreu(float* p, vfloat v) { _mm512_storeu_ps(p, v); }
static inline vint widen_i8(const int8_t* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
static inline vint widen_u8(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
static inline vfloat to_float(vint q) { return _mm512_cvtepi32_ps(q); }
static inline vfloat from_half(const uint16_t* p) {  // LANES fp16 values
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// Byte j (0..3) of each int32 lane, a weight in 0..31, as a float: a 32-entry table
// lookup (vpermt2ps reads an index's low 5 bits) instead of a mask and a conversion.
static inline vfloat byte_float(vint q, int j) {
  const vfloat low = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const vfloat high = _mm512_setr_ps(16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29,
                                     30, 31);
  return _mm512_permutex2var_ps(low, j ? _mm512_srli_epi32(q, 8 * j) : q, high);
}
// Int8 dot products: 4 bytes a lane. dot4 adds u[4i..4i+3] . s[4i..4i+3] (unsigned times
// signed bytes) to lane i, exactly (vpdpbusd).
static inline vint vload_bytes(const uint8_t* p) { return _mm512_loadu_si512(p); }
static inline vint vzero_int() { return _mm512_setzero_si512(); }
static inline vint low_nibbles(vint v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
static inline vint high_nibbles(vint v) {
  return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
}
static inline vint broadcast4(const void* p) {
  int32_t four;
  std::memcpy(&four, p, sizeof four);
  return _mm512_set1_epi32(four);
}
static inline vint dot4(vint acc, vint u, vint s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, s);
#else  // as the AVX2 one below
  const __m512i pairs = _mm512_maddubs_epi16(u, s);
  return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#endif
}
static inline vint shift_add(vint high, int bits, vint low) {  // (high << bits) + low
  return _mm512_add_epi32(_mm512_slli_epi32(high, bits), low);
}
static inline vint add_int(vint a, vint b) { return _mm512_add_epi32(a, b); }
// Int16 dot products (Q8 blocks with int16 activations): dot2 adds a[2i] * b[2i] +
// a[2i + 1] * b[2i + 1] to lane i, exactly (vpdpwssd, or vpmaddwd and an add).
static inline vint dot2(vint acc, vint a, vint b) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}
// 2 * LANES int8 weights (pack_q8: weights k and k + 1 of LANES outputs) as LANES lanes of
// two int16 words, k's then k + 1's.
static inline vint widen_pairs(const int8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// Half H of LANES x 4 weight bytes (weight_bytes) as words: LANES lanes, two an output
// (weights k, k + 1, then k + 2, k + 3) of the outputs of that half.
template <int H>
static inline vint half_words(vint bytes) {
  return _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(bytes, H));
}
static inline vint broadcast8(const int16_t* p) {  // xq[k..k+3] in every pair of lanes
  int64_t eight;
  std::memcpy(&eight, p, sizeof eight);
  return _mm512_set1_epi64(eight);
}
// The sums of lanes 2i and 2i + 1 of a, then of b: one lane an output again, in order.
static inline vint pair_sums(vint a, vint b) {
  const vint index = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  return _mm512_permutex2var_epi32(_mm512_add_epi32(a, _mm512_srli_epi64(a, 32)), index,
                                   _mm512_add_epi32(b, _mm512_srli_epi64(b, 32)));
}
// A bit plane of Q5's fifth bits or Q6's fifth and sixth (pack_q5, pack_q6): one a byte of
// weights, bit i for byte i. Adds `value` (16 or 32) to each byte whose bit is set (a masked
// byte add).
static inline vint add_bit(vint w, const uint8_t* bits, int8_t value) {
  uint64_t mask;
  std::memcpy(&mask, bits, sizeof mask);
  return _mm512_mask_add_epi8(w, mask, w, _mm512_set1_epi8(value));
}
static inline vint vset_int(int32_t i) { return _mm512_set1_epi32(i); }
#else
constexpr int LANES = 8;
using vfloat = __m256;
using vint = __m256i;
static inline vfloat vzero() { return _mm256_setzero_ps(); }
static inline vfloat vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
static inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
static inline vfloat vmul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
static inline vfloat vadd(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
static inline vfloat vload(const float* p) { return _mm256_load_ps(p); }  // 32-byte aligned
static inline vfloat vloadu(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, vfloat v) { _mm256_store_ps(p, v); }
static inline void vstoreu(float* p, vfloat v) { _mm256_storeu_ps(p, v); }
static inline vint widen_i8(const int8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
static inline vint widen_u8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
static inline vfloat to_float(vint q) { return _mm256_cvtepi32_ps(q); }
static inline vfloat from_half(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
static inline vfloat byte_float(vint q, int j) {
  const vint shifted = j ? _mm256_srli_epi32(q, 8 * j) : q;
  return to_float(j == 3 ? shifted : _mm256_and_si256(shifted, _mm256_set1_epi32(0xFF)));
}
static inline vint vload_bytes(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
static inline vint vzero_int() { return _mm256_setzero_si256(); }
static inline vint low_nibbles(vint v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
static inline vint high_nibbles(vint v) {
  return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
}
static inline vint broadcast4(const void* p) {
  int32_t four;
  std::memcpy(&four, p, sizeof four);
  return _mm256_set1_epi32(four);
}
// Without AVX-VNNI: byte pairs to int16 (no saturation with these operands: 2 * 255 * 63 <
// 2^15), then pairs of those to int32; the same exact sums.
static inline vint dot4(vint acc, vint u, vint s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  const __m256i pairs = _mm256_maddubs_epi16(u, s);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}
static inline vint shift_add(vint high, int bits, vint low) {
  return _mm256_add_epi32(_mm256_slli_epi32(high, bits), low);
}
static inline vint add_int(vint a, vint b) { return _mm256_add_epi32(a, b); }
static inline vint dot2(vint acc, vint a, vint b) {
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}
static inline vint widen_pairs(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <int H>
static inline vint half_words(vint bytes) {
  return _mm256_cvtepu8_epi16(_mm256_extracti128_si256(bytes, H));
}
static inline vint broadcast8(const int16_t* p) {
  int64_t eight;
  std::memcpy(&eight, p, sizeof eight);
  return _mm256_set1_epi64x(eight);
}
static inline vint pair_sums(vint a, vint b) {  // even lanes of each, then 64-bit reorder
  const __m256 even = _mm256_shuffle_ps(
      _mm256_castsi256_ps(_mm256_add_epi32(a, _mm256_srli_epi64(a, 32))),
      _mm256_castsi256_ps(_mm256_add_epi32(b, _mm256_srli_epi64(b, 32))), 0x88);
  return _mm256_permute4x64_epi64(_mm256_castps_si256(even), 0xD8);
}
// No mask registers: each byte picks its bit's byte (shuffle), tests its bit (and, compare),
// then adds `value` where set.
static inline vint add_bit(vint w, const uint8_t* bits, int8_t value) {
  const __m256i picked = _mm256_shuffle_epi8(
      broadcast4(bits), _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2,
                                         2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
  const __m256i on = _mm256_cmpeq_epi8(_mm256_and_si256(picked, bit), bit);
  return _mm256_add_epi8(w, _mm256_and_si256(on, _mm256_set1_epi8(value)));
}
static inline vint vset_int(int32_t i) { return _mm256_set1_epi32(i); }
#endif
constexpr int TILE_LANES = 32;            // outputs per packed tile (cpu_kernels.TILE)
constexpr int VPT = TILE_LANES / LANES;  // vectors per tile: 4 (AVX2) or 2 (AVX-512)
// The vectors of a kernel block lie in consecutive tiles: vector v at tile v / VPT, lanes
// from (v % VPT) * LANES.
static inline int64_t vec_offset(int v, int64_t tile_stride) {
  return (v / VPT) * tile_stride + (v % VPT) * LANES;
}
// Packed 4-, 5- and 6-bit weights (pack_q4, pack_q5, pack_q6): per tile of 32 outputs and
// group of 8 weights k..k+7, a record of 4 bytes an output, byte j holding weights k + j (low
// nibble) and k + 4 + j (high), so one int32 lane holds 4 consecutive weights of its output;
// Q5 then 32 bytes of fifth bits: 128 for the low nibbles (bit 4o + j for output o's byte
// j), then 128 for the high ones; Q6 then as many of sixth bits.
constexpr int Q4_RECORD = 4 * TILE_LANES, Q5_RECORD = Q4_RECORD + TILE_LANES,
              Q6_RECORD = Q5_RECORD + TILE_LANES;
// Q6's scales (pack_q6: Q6_K's), per tile and 256 weights: an int8 sc per 16 weights
// [16][32], then an fp16 d [32]; w = d * sc * (q - 32).
constexpr int Q6_SUPER = 256, Q6_GROUP = 16,
              Q6_SCALES = Q6_SUPER / Q6_GROUP * TILE_LANES + 2 * TILE_LANES;
// The K-quants' scales as stored (pack_k_scales: Q4_K's and Q5_K's), per tile and 256
// weights: a 6-bit sc [8][32], then mn [8][32] (uint8, one per 32 weights), then fp16 d [32]
// and -dmin [32]; a group's d * sc and -dmin * mn, exact in float32 (an fp16 times six bits).
constexpr int K_SUPER = 256, K_GROUPS = K_SUPER / 32,
              K_SCALES = 2 * K_GROUPS * TILE_LANES + 2 * 2 * TILE_LANES;
// How far ahead of its loads a kernel asks for weights: with the hardware prefetcher alone,
// one row of q4a16 over SmolLM2's 120 layer matrices took ~1.2x as long on one EPYC core;
// 2048 bytes ahead read them 1.1-1.2x as fast as 1024 on two (docs/performance.md). The 4-,
// 5- and 6-bit records, read one tile after the other since (rounded_gemm), ask 8 KiB ahead
// (into the next tile, which the same thread usually takes next): `bash bench/kernel_ab.sh`
// gave 0.81-0.92x the time for one row of qwen's Q5_0 matrices, 0.90-0.98x for SmolLM2's
// Q4_1. (The Q8 kernels' pairs keep 2048: 8 KiB ahead, qwen's head took 1.11-1.13x as long.)
constexpr int PREFETCH_AHEAD = 2048, RECORDS_AHEAD = 8192;
// Vector v's 8 weights a lane in the records of group g: weights k..k+3 (a byte each, in
// 0..63) in `low`, k+4..k+7 in `high`. tile_qs: the bytes of a tile's records.
template <int RECORD>
static inline void weight_bytes(const uint8_t* qs, int v, int64_t g, int64_t tile_qs, vint& low,
                                vint& high) {
  const uint8_t* record = qs + (v / VPT) * tile_qs + g * RECORD;
  _mm_prefetch(reinterpret_cast<const char*>(record + (v % VPT) * LANES * 4 + RECORDS_AHEAD),
               _MM_HINT_T0);
  // The line of a Q5 or Q6 record's bit planes, past its nibbles': asked for by the nibbles'
  // prefetch above only every other record (160-byte records), or never (192). Without it,
  // eight rows of Q5_0 waited on the planes' loads (40% of the samples at their kmovq) and
  // took 1.5x as long (bench/kernel_ab.sh HEAD~1 2 8 qwen: 0.65-0.67; Q6 0.91).
  if constexpr (RECORD >= Q5_RECORD)
    _mm_prefetch(reinterpret_cast<const char*>(record + Q4_RECORD + RECORDS_AHEAD), _MM_HINT_T0);
  const vint w = vload_bytes(record + (v % VPT) * LANES * 4);
  low = low_nibbles(w);
  high = high_nibbles(w);
  if constexpr (RECORD >= Q5_RECORD) {
    const uint8_t* bits = record + Q4_RECORD + (v % VPT) * LANES / 2;
    low = add_bit(low, bits, 16);
    high = add_bit(high, bits + TILE_LANES / 2, 16);
  }
  if constexpr (RECORD == Q6_RECORD) {
    const uint8_t* bits = record + Q5_RECORD + (v % VPT) * LANES / 2;
    low = add_bit(low, bits, 32);
    high = add_bit(high, bits + TILE_LANES / 2, 32);
  }
}
// Where vector v's weights k, k + 1 lie in pack_q8's pairs (tile_qs: a tile's bytes).
static inline int64_t pair_offset(int v, int64_t k, int64_t tile_qs) {
  return (v / VPT) * tile_qs + k / 2 * 2 * TILE_LANES + (v % VPT) * LANES * 2;
}
// Asks for the pairs of scale group b (G weights: G * 32 bytes a tile) of the tiles the V
// vectors span, PREFETCH_AHEAD bytes on.
template <int V, int G>
static inline void prefetch_pairs(const int8_t* qs, int64_t b, int64_t tile_qs) {
  for (int v = 0; v < V; v += VPT)
    for (int line = 0; line < G * TILE_LANES; line += 64)
      _mm_prefetch(
          reinterpret_cast<const char*>(qs + pair_offset(v, b * G, tile_qs) + line + PREFETCH_AHEAD),
          _MM_HINT_T0);
}
// Lanes of widen_pairs as floats: the low words (weight k) and the high ones (k + 1).
static inline vfloat low_word_float(vint pairs) {
#if defined(__AVX512F__)
  return to_float(_mm512_srai_epi32(_mm512_slli_epi32(pairs, 16), 16));
#else
  return to_float(_mm256_srai_epi32(_mm256_slli_epi32(pairs, 16), 16));
#endif
}
static inline vfloat high_word_float(vint pairs) {
#if defined(__AVX512F__)
  return to_float(_mm512_srai_epi32(pairs, 16));
#else
  return to_float(_mm256_srai_epi32(pairs, 16));
#endif
}
static inline vint broadcast2(const int16_t* p) { return broadcast4(p); }  // xq[k], xq[k + 1]

// Accumulators a register file holds with room to spare: 16 ymm (AVX2) or 32 zmm.
constexpr int ACCUMULATORS = LANES == 16 ? 16 : 8;

// What the block kernels share (blocks_gemm.cpp, rounded_gemm.cpp). The finished sums of MB
// rows x V vectors into y (out: [MB][V * LANES], vectors as in the kernels' blocks).
template <int V, int MB>
static inline void store_rows(const float (&out)[MB][V * LANES], float* y, int64_t n0,
                              int64_t m0, int64_t N) {
  _Pragma("GCC unroll 16") for (int j = 0; j < MB; ++j)
    _Pragma("GCC unroll 16") for (int v = 0; v < V; ++v)
      vstoreu(y + (m0 + j) * N + n0 + vec_offset(v, TILE_LANES), vload(out[j] + v * LANES));
}
// LANES of a Q4 block's d or m: fp16 as Q4_0 / Q4_1 store them, or float32 (Q4_K's groups).
static inline vfloat load_scales(const uint16_t* p) { return from_half(p); }
static inline vfloat load_scales(const float* p) { return vloadu(p); }
// A block's d and m for LANES outputs at s: m stored TILE_LANES after d, or (derived_m:
// Q4_0 / Q5_0, whose dm holds d alone) m = -derived_m * d, exact in float32.
template <typename S>
static inline void block_scales(const S* s, int derived_m, vfloat& d, vfloat& m) {
  d = load_scales(s);
  const float times = -static_cast<float>(derived_m);
  m = derived_m ? vmul(d, vbroadcast(&times)) : load_scales(s + TILE_LANES);
}
static inline int64_t scales_per_block(int derived_m) { return derived_m ? 1 : 2; }

// f(i) for every i in [0, n) on torch's threads, which take `chunk` indices at a time as they
// become free: for a prefill chunk's milliseconds-long matmuls and attention. A static split
// would make the whole call wait for a thread that lost its core to another process.
template <typename F>
inline void parallel_chunks(int64_t n, int64_t chunk, const F& f) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + chunk - 1) / chunk);
  at::parallel_for(0, std::max<int64_t>(threads, 1), 1, [&](int64_t, int64_t) {
    for (int64_t i; (i = next.fetch_add(chunk)) < n;)
      for (int64_t j = i; j < std::min(n, i + chunk); ++j) f(j);
  });
}

// The same for a decode step's ~150 calls of microseconds each, on ChunkPool's threads
// (chunk_pool.h), which return without waiting at a barrier for a thread that has no work
// left: on two cores the server takes a core after every step, and each region of
// at::parallel_for waited for it. Prefill stays on torch's threads: its torch ops between
// the matmuls keep OpenMP's thread spinning for milliseconds, and a helper beside it would
// share its core.
template <typename F>
inline void pooled_chunks(int64_t n, int64_t chunk, const F& f) {
  ChunkPool::get().run(n, chunk, at::get_num_threads() - 1, f);
}
// Up to how many rows a matmul is a decode step's (batch) rather than a prefill chunk's.
constexpr int64_t POOLED_ROWS = 32;

// How a matmul's tiles of 32 outputs are spread over the threads: one row takes two tiles at
// a time (eight accumulators hide the FMA latency: pair(t) computes tiles t and t + 1, and
// single(t) an odd last one); several rows take a tile at a time (rows(t)). A decode step
// hands them out one pair or tile at a time: its matrices are small (SmolLM2's 576 outputs
// are 18 tiles), and chunks of two left one thread a whole chunk behind the other.
template <typename Pair, typename Single, typename Rows>
inline void over_tiles(int64_t M, int64_t tiles, const Pair& pair, const Single& single,
                       const Rows& rows) {
  if (M > POOLED_ROWS) {
    parallel_chunks(tiles, 2, rows);
    return;
  }
  if (M > 1) {
    pooled_chunks(tiles, 1, rows);
    return;
  }
  pooled_chunks(tiles / 2, 1, [&](int64_t t) { pair(2 * t); });
  if (tiles % 2) single(tiles - 1);
}

// How the Q8 kernels (q8_gemm, q8a16_gemm) spread a matmul's tiles: block(V, MB, t, v0, m)
// computes MB rows from m of V vectors from vector v0 of tile t (V and MB as
// std::integral_constant, so each block is compiled for its shape).
template <typename Block>
inline void q8_tiles(int64_t M, int64_t tiles, const Block& block) {
  using std::integral_constant;
  const integral_constant<int, 1> one;
  over_tiles(
      M, tiles, [&](int64_t t) { block(integral_constant<int, 2 * VPT>{}, one, t, 0, 0); },
      [&](int64_t t) { block(integral_constant<int, VPT>{}, one, t, 0, 0); },
      [&](int64_t t) {
        int64_t m = 0;
        if constexpr (ACCUMULATORS >= 16)
          for (; M - m >= 8; m += 8)
            block(integral_constant<int, VPT>{}, integral_constant<int, 8>{}, t, 0, m);
        for (; M - m >= 4; m += 4)
          for (int v0 = 0; v0 < VPT; v0 += 2)
            block(integral_constant<int, 2>{}, integral_constant<int, 4>{}, t, v0, m);
        for (; M - m >= 1; ++m) block(integral_constant<int, VPT>{}, one, t, 0, m);
      });
}

// y[M, N] = x[M, K] . (q[N, K] * scale[N])^T, float32 activations and int8 weights packed
// as p[ceil(N / 32)][K][32]; each output row has the same bits whatever M is.
void int8_gemm(const float* x, const int8_t* p, const float* scale, float* y, int64_t M,
               int64_t K, int64_t N);

at::Tensor int8_linear(at::Tensor x, at::Tensor p, at::Tensor scale);

// The same with a GGUF file's own Q4_0/Q4_1 or Q8_0 blocks, packed by pack_q4 / pack_q8
// (blocks_gemm.cpp); N and K multiples of 32. Each Q4 kernel also takes float32 d and m
// (Q4_K's groups of 32: int4.py), and derived_m: 0 where dm holds each block's d and m, or
// the q of w = 0 (8: Q4_0, 16: Q5_0) where it holds d alone and m = -derived_m * d.
void q4_gemm(const float* x, const uint8_t* qs, const uint16_t* dm, float* y, int64_t M,
             int64_t K, int64_t N, int derived_m);
void q4_gemm(const float* x, const uint8_t* qs, const float* dm, float* y, int64_t M, int64_t K,
             int64_t N, int derived_m);
void q8_gemm(const float* x, const int8_t* qs, const uint16_t* d, float* y, int64_t M,
             int64_t K, int64_t N);

// The Q4 blocks with activations rounded per block of 32 to int8 (x ~ xq * dx, as llama.cpp's
// Q8_1) or int16 (dx = max|x| / 32767: ~256x finer, near float32), exact integer dot
// products (rounded_gemm.cpp); the same packing as q4_gemm's.
void q4a8_gemm(const float* x, const uint8_t* qs, const uint16_t* dm, float* y, int64_t M,
               int64_t K, int64_t N, int derived_m);
void q4a8_gemm(const float* x, const uint8_t* qs, const float* dm, float* y, int64_t M,
               int64_t K, int64_t N, int derived_m);
void q4a16_gemm(const float* x, const uint8_t* qs, const uint16_t* dm, float* y, int64_t M,
                int64_t K, int64_t N, int derived_m);
void q4a16_gemm(const float* x, const uint8_t* qs, const float* dm, float* y, int64_t M,
                int64_t K, int64_t N, int derived_m);

// Q5 blocks (Q5_0, Q5_1, Q5_K's groups of 32): q4's nibbles and a fifth bit per weight,
// packed by pack_q5; w = q * d + m with q in 0..31.
void q5_gemm(const float* x, const uint8_t* qs, const uint16_t* dm, float* y, int64_t M,
             int64_t K, int64_t N, int derived_m);
void q5_gemm(const float* x, const uint8_t* qs, const float* dm, float* y, int64_t M, int64_t K,
             int64_t N, int derived_m);
void q5a8_gemm(const float* x, const uint8_t* qs, const uint16_t* dm, float* y, int64_t M,
               int64_t K, int64_t N, int derived_m);
void q5a8_gemm(const float* x, const uint8_t* qs, const float* dm, float* y, int64_t M,
               int64_t K, int64_t N, int derived_m);
void q5a16_gemm(const float* x, const uint8_t* qs, const uint16_t* dm, float* y, int64_t M,
                int64_t K, int64_t N, int derived_m);
void q5a16_gemm(const float* x, const uint8_t* qs, const float* dm, float* y, int64_t M,
                int64_t K, int64_t N, int derived_m);
// Q8 blocks of 16 with float32 scales (Q6_K's: d * sc, exact): d [N / 32][K / 16][32].
void q8_gemm(const float* x, const int8_t* qs, const float* d, float* y, int64_t M, int64_t K,
             int64_t N);
// The same over the K-quants' scales as stored (pack_k_scales, derived_m unused): 20 bytes
// an output and 256 weights where float32 d and m take 64.
void q4a8_gemm(const float* x, const uint8_t* qs, const uint8_t* scales, float* y, int64_t M,
               int64_t K, int64_t N, int derived_m);
void q4a16_gemm(const float* x, const uint8_t* qs, const uint8_t* scales, float* y, int64_t M,
                int64_t K, int64_t N, int derived_m);
void q5a8_gemm(const float* x, const uint8_t* qs, const uint8_t* scales, float* y, int64_t M,
               int64_t K, int64_t N, int derived_m);
void q5a16_gemm(const float* x, const uint8_t* qs, const uint8_t* scales, float* y, int64_t M,
                int64_t K, int64_t N, int derived_m);
// Q6_K's blocks as stored (pack_q6: 6-bit q, an int8 sc per 16 and an fp16 d per 256, w =
// d * sc * (q - 32)) with activations rounded to int16 per block of 32 (rounded_gemm.cpp):
// the same bits as q8a16_gemm over the same weights in groups of 16 (pack_q8), 0.82 bytes a
// weight read instead of 1.25.
void q6a16_gemm(const float* x, const uint8_t* qs, const uint8_t* scales, float* y, int64_t M,
                int64_t K, int64_t N);
// The Q8 blocks with activations rounded to int16 per block of 32 (rounded_gemm.cpp).
void q8a16_gemm(const float* x, const int8_t* qs, const uint16_t* d, float* y, int64_t M,
                int64_t K, int64_t N);
void q8a16_gemm(const float* x, const int8_t* qs, const float* d, float* y, int64_t M, int64_t K,
                int64_t N);

at::Tensor q4_linear(at::Tensor x, at::Tensor qs, at::Tensor dm);
at::Tensor q8_linear(at::Tensor x, at::Tensor qs, at::Tensor d);
at::Tensor q8a16_linear(at::Tensor x, at::Tensor qs, at::Tensor d);
at::Tensor q6a16_linear(at::Tensor x, at::Tensor qs, at::Tensor scales);
at::Tensor q4a8_linear(at::Tensor x, at::Tensor qs, at::Tensor dm);
at::Tensor q4a16_linear(at::Tensor x, at::Tensor qs, at::Tensor dm);
// AMX for prefill chunks' matmuls with int16 activations (rounded_gemm.cpp): "on"
// where this build has it and Linux grants this process its tile state, else why not.
std::string amx_status();
void set_amx(bool on);  // off: the AVX-512 kernels alone (the same bits), for the tests
// A GGUF matrix's blocks into the kernels' layouts at load (block_repack.cpp).
at::Tensor block_bits(const std::vector<at::Tensor>& parts,
                      const std::vector<int64_t>& qtypes);
at::Tensor pack_blocks(const std::vector<at::Tensor>& parts,
                       const std::vector<int64_t>& qtypes, int64_t planes);
at::Tensor pack_blocks_q8(const std::vector<at::Tensor>& parts,
                          const std::vector<int64_t>& qtypes, int64_t offset);
at::Tensor blocks_k_scales(const std::vector<at::Tensor>& parts,
                           const std::vector<int64_t>& qtypes);
at::Tensor blocks_q6_scales(const std::vector<at::Tensor>& parts,
                            const std::vector<int64_t>& qtypes);
at::Tensor blocks_q6_group_scales(const std::vector<at::Tensor>& parts,
                                  const std::vector<int64_t>& qtypes);
// Causal attention of a prefill chunk over one slot's cache (prefill_attention.cpp).
at::Tensor prefill_attention(at::Tensor q, at::Tensor k, at::Tensor v, int64_t start);
