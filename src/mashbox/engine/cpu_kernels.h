// mashbox's CPU kernels (built together as one extension by cpu_kernels.py).
#pragma once
#ifdef MASHBOX_BREAK_BUILD  // MASHBOX_KERNELS_BREAK names this target (kernel_build.py)
#error "a build broken on purpose (MASHBOX_KERNELS_BREAK), to test the fall-back ladder"
#endif
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>
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
static inline vint widen_u8(const uint8_t* p) {  // LANES bytes to int32 lanes
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
static inline vint widen_i8(const int8_t* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
static inline vfloat to_float(vint q) { return _mm512_cvtepi32_ps(q); }
static inline vfloat from_half(const uint16_t* p) {  // LANES fp16 values
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// The low and high nibbles of bytes widened to int32 lanes, as floats: a 16-entry table
// lookup (vpermps reads an index's low 4 bits) instead of a mask and a conversion.
static inline vfloat low_nibble_float(vint q) {
  const vfloat table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_permutexvar_ps(q, table);
}
static inline vfloat high_nibble_float(vint q) {
  return low_nibble_float(_mm512_srli_epi32(q, 4));
}
// Int8 dot products (q4a8): 4 bytes a lane. dot4 adds u[4i..4i+3] . s[4i..4i+3] (unsigned
// times signed bytes) to lane i, exactly (vpdpbusd).
static inline vint vload_bytes(const uint8_t* p) { return _mm512_loadu_si512(p); }
static inline vint vzero_int() { return _mm512_setzero_si512(); }
static inline vint low_nibbles(vint v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
static inline vint high_nibbles(vint v) {
  return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
}
static inline vint broadcast4(const int8_t* p) {
  return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(p));
}
static inline vint dot4(vint acc, vint u, vint s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, s);
#else  // as the AVX2 one below
  const __m512i pairs = _mm512_maddubs_epi16(u, s);
  return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#endif
}
// Int16 dot products (q4a16): 2 words a lane. dot2 adds a[2i] * b[2i] + a[2i+1] * b[2i+1]
// to lane i, exactly (vpdpwssd, or vpmaddwd and an add: the same sum).
static inline vint dot2(vint acc, vint a, vint b) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}
static inline vint broadcast2(const int16_t* p) {
  return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(p));
}
// LANES bytes of pack_q4 (weights k and k + 1 of an output, low nibble first) as lanes of two
// int16 words, k's then k + 1's: (b | b << 12) & 0x000F000F in one ternary op.
static inline vint nibble_words(const uint8_t* p) {
  const vint b = widen_u8(p);
  return _mm512_ternarylogic_epi32(b, _mm512_slli_epi32(b, 12), _mm512_set1_epi32(0x000F000F),
                                   0xA8);  // (A | B) & C
}
// Q5 blocks' fifth bits (pack_q5): 2 * LANES bits a pair of weights k, k + 1 of LANES
// outputs, output i's at bits 2i (k) and 2i + 1 (k + 1). add_fifth adds 16 to weight k's
// (parity 0) or k + 1's (parity 1) float lanes whose bit is set; add_fifth_words to the words
// of nibble_words.
static inline uint32_t load_fifth(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return bits;
}
static inline vfloat add_fifth(vfloat w, uint32_t bits, int parity) {
  const __mmask16 on = _pext_u32(bits, parity ? 0xAAAAAAAAu : 0x55555555u);
  return _mm512_mask_add_ps(w, on, w, _mm512_set1_ps(16.0f));
}
static inline vint add_fifth_words(vint w, uint32_t bits) {
  return _mm512_mask_add_epi16(w, bits, w, _mm512_set1_epi16(16));
}
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
static inline vint widen_u8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
static inline vint widen_i8(const int8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
static inline vfloat to_float(vint q) { return _mm256_cvtepi32_ps(q); }
static inline vfloat from_half(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
static inline vfloat low_nibble_float(vint q) {
  return to_float(_mm256_and_si256(q, _mm256_set1_epi32(0x0F)));
}
static inline vfloat high_nibble_float(vint q) { return to_float(_mm256_srli_epi32(q, 4)); }
static inline vint vload_bytes(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
static inline vint vzero_int() { return _mm256_setzero_si256(); }
static inline vint low_nibbles(vint v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
static inline vint high_nibbles(vint v) {
  return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
}
static inline vint broadcast4(const int8_t* p) {
  return _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(p));
}
// Without AVX-VNNI: byte pairs to int16 (no saturation here: 2 * 15 * 127 < 2^15), then
// pairs of those to int32; the same exact sums.
static inline vint dot4(vint acc, vint u, vint s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  const __m256i pairs = _mm256_maddubs_epi16(u, s);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}
static inline vint dot2(vint acc, vint a, vint b) {
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}
static inline vint broadcast2(const int16_t* p) {
  return _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(p));
}
static inline vint nibble_words(const uint8_t* p) {
  const vint b = widen_u8(p);
  return _mm256_and_si256(_mm256_or_si256(b, _mm256_slli_epi32(b, 12)),
                          _mm256_set1_epi32(0x000F000F));
}
static inline uint32_t load_fifth(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return bits;
}
// No mask registers: each lane tests its own bit (and, compare), then adds 16 where set.
static inline vfloat add_fifth(vfloat w, uint32_t bits, int parity) {
  const __m256i bit = parity ? _mm256_setr_epi32(2, 8, 32, 128, 512, 2048, 8192, 32768)
                             : _mm256_setr_epi32(1, 4, 16, 64, 256, 1024, 4096, 16384);
  const __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(bits), bit), bit);
  return _mm256_add_ps(w, _mm256_and_ps(_mm256_castsi256_ps(on), _mm256_set1_ps(16.0f)));
}
static inline vint add_fifth_words(vint w, uint32_t bits) {
  const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096,
                                        8192, 16384, -32768);
  const __m256i b = _mm256_set1_epi16(static_cast<int16_t>(bits));
  const __m256i on = _mm256_cmpeq_epi16(_mm256_and_si256(b, bit), bit);
  return _mm256_add_epi16(w, _mm256_and_si256(on, _mm256_set1_epi16(16)));
}
#endif
constexpr int TILE_LANES = 32;            // outputs per packed tile (cpu_kernels.TILE)
constexpr int VPT = TILE_LANES / LANES;  // vectors per tile: 4 (AVX2) or 2 (AVX-512)
// Bytes a packed pair of weights k, k + 1 of a tile's 32 outputs takes: their nibbles (Q4),
// then the fifth bits (Q5: pack_q5), which start at byte FIFTH_AT.
constexpr int Q4_PAIR = TILE_LANES, Q5_PAIR = TILE_LANES + TILE_LANES / 4, FIFTH_AT = TILE_LANES;
// Where vector v's fifth bits lie in a pair record, from the record's FIFTH_AT.
static inline int64_t fifth_offset(int v, int64_t tile_stride) {
  return (v / VPT) * tile_stride + (v % VPT) * LANES / 4;
}
// The vectors of a kernel block lie in consecutive tiles: vector v at tile v / VPT, lanes
// from (v % VPT) * LANES.
static inline int64_t vec_offset(int v, int64_t tile_stride) {
  return (v / VPT) * tile_stride + (v % VPT) * LANES;
}
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

// f(i) for every i in [0, n) on torch's threads, which take `chunk` indices at a time as they
// become free. A static split (at::parallel_for) makes the whole call wait for a thread that
// lost its core to another process, and on two cores the server's own work does that every
// step; here the other thread takes over the rest of the work.
template <typename F>
inline void parallel_chunks(int64_t n, int64_t chunk, const F& f) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + chunk - 1) / chunk);
  at::parallel_for(0, std::max<int64_t>(threads, 1), 1, [&](int64_t, int64_t) {
    for (int64_t i; (i = next.fetch_add(chunk)) < n;)
      for (int64_t j = i; j < std::min(n, i + chunk); ++j) f(j);
  });
}

// How a matmul's tiles of 32 outputs are spread over the threads: one row takes two tiles at
// a time (eight accumulators hide the FMA latency: pair(t) computes tiles t and t + 1, and
// single(t) an odd last one); several rows take a tile at a time (rows(t)).
template <typename Pair, typename Single, typename Rows>
inline void over_tiles(int64_t M, int64_t tiles, const Pair& pair, const Single& single,
                       const Rows& rows) {
  if (M > 1) {
    parallel_chunks(tiles, 2, rows);
    return;
  }
  parallel_chunks(tiles / 2, 2, [&](int64_t t) { pair(2 * t); });
  if (tiles % 2) single(tiles - 1);
}

// y[M, N] = x[M, K] . (q[N, K] * scale[N])^T, float32 activations and int8 weights packed
// as p[ceil(N / 32)][K][32]; each output row has the same bits whatever M is.
void int8_gemm(const float* x, const int8_t* p, const float* scale, float* y, int64_t M,
               int64_t K, int64_t N);

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor p, torch::Tensor scale);

// The same with a GGUF file's own Q4_0/Q4_1 or Q8_0 blocks, packed by pack_q4 / pack_q8
// (blocks_gemm.cpp); N and K multiples of 32. Each Q4 kernel also takes float32 d and m
// (Q4_K's groups of 32: int4.py).
void q4_gemm(const float* x, const uint8_t* qs, const uint16_t* dm, float* y, int64_t M,
             int64_t K, int64_t N);
void q4_gemm(const float* x, const uint8_t* qs, const float* dm, float* y, int64_t M, int64_t K,
             int64_t N);
void q8_gemm(const float* x, const int8_t* qs, const uint16_t* d, float* y, int64_t M,
             int64_t K, int64_t N);

// Q4 blocks with activations rounded to int8 per block of 32 (x ~ xq * dx, as llama.cpp's
// Q8_1), exact integer dot products: qs packed by pack_q4a8, dm as pack_q4's.
void q4a8_gemm(const float* x, const uint8_t* qs, const uint16_t* dm, float* y, int64_t M,
               int64_t K, int64_t N);
void q4a8_gemm(const float* x, const uint8_t* qs, const float* dm, float* y, int64_t M,
               int64_t K, int64_t N);
// The same with int16 activations per block (dx = max|x| / 32767: ~256x finer than int8,
// near float32) and pack_q4's layout: q4_gemm's weights, integer dot products.
void q4a16_gemm(const float* x, const uint8_t* qs, const uint16_t* dm, float* y, int64_t M,
                int64_t K, int64_t N);
void q4a16_gemm(const float* x, const uint8_t* qs, const float* dm, float* y, int64_t M,
                int64_t K, int64_t N);

// Q5 blocks (Q5_0, Q5_1, Q5_K's groups of 32): q4's nibbles and a fifth bit per weight,
// qs packed by pack_q5 [N / 32][K / 2][40]; w = q * d + m with q in 0..31.
void q5_gemm(const float* x, const uint8_t* qs, const uint16_t* dm, float* y, int64_t M,
             int64_t K, int64_t N);
void q5_gemm(const float* x, const uint8_t* qs, const float* dm, float* y, int64_t M, int64_t K,
             int64_t N);
void q5a16_gemm(const float* x, const uint8_t* qs, const uint16_t* dm, float* y, int64_t M,
                int64_t K, int64_t N);
void q5a16_gemm(const float* x, const uint8_t* qs, const float* dm, float* y, int64_t M,
                int64_t K, int64_t N);
// Q8 blocks of 16 with float32 scales (Q6_K's: d * sc, exact): d [N / 32][K / 16][32].
void q8_gemm(const float* x, const int8_t* qs, const float* d, float* y, int64_t M, int64_t K,
             int64_t N);

torch::Tensor q4_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor dm);
torch::Tensor q8_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d);
torch::Tensor q4a8_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor dm);
torch::Tensor q4a16_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor dm);
