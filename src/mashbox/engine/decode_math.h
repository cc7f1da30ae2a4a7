// The float math of a decode step beside its matmuls (decode_layers.cpp): RMS norms, RoPE,
// residual adds, SiLU and softmax attention over a float32 or float16 KV cache, at the vector
// width the matmul kernels use.
#pragma once
#include "cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace decode_math {

// Sixteen float32 lanes: one zmm register with AVX-512, two ymm halves (lanes 0-7 and 8-15)
// with AVX2. Every operation is lane by lane (fmadd a * b + c and fnmadd c - a * b rounded
// once) and every sum across lanes (hsum) adds them in one fixed tree, so both widths give the
// same bits, as the matmul kernels do. Vectors of n floats are taken 16 at a time, a shorter
// tail zero-padded (load(p, n)) at either width.
#if defined(__AVX512F__)
struct f32x16 { __m512 v; };
static inline f32x16 zeros() { return {_mm512_setzero_ps()}; }
static inline f32x16 splat(float x) { return {_mm512_set1_ps(x)}; }
static inline f32x16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
static inline __mmask16 first(int64_t n) { return n >= 16 ? 0xFFFF : (1u << n) - 1; }
static inline f32x16 load(const float* p, int64_t n) {  // the first n lanes, the rest 0
  return {_mm512_maskz_loadu_ps(first(n), p)};
}
static inline void store(float* p, f32x16 x) { _mm512_storeu_ps(p, x.v); }
static inline void store(float* p, f32x16 x, int64_t n) { _mm512_mask_storeu_ps(p, first(n), x.v); }
static inline f32x16 add(f32x16 a, f32x16 b) { return {_mm512_add_ps(a.v, b.v)}; }
static inline f32x16 sub(f32x16 a, f32x16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
static inline f32x16 mul(f32x16 a, f32x16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
static inline f32x16 div(f32x16 a, f32x16 b) { return {_mm512_div_ps(a.v, b.v)}; }
static inline f32x16 vmax(f32x16 a, f32x16 b) { return {_mm512_max_ps(a.v, b.v)}; }
static inline f32x16 vmin(f32x16 a, f32x16 b) { return {_mm512_min_ps(a.v, b.v)}; }
static inline f32x16 fmadd(f32x16 a, f32x16 b, f32x16 c) {
  return {_mm512_fmadd_ps(a.v, b.v, c.v)};
}
static inline f32x16 fnmadd(f32x16 a, f32x16 b, f32x16 c) {
  return {_mm512_fnmadd_ps(a.v, b.v, c.v)};
}
static inline f32x16 round_down(f32x16 x) {  // 0x09: toward -inf, no exceptions
  return {_mm512_roundscale_ps(x.v, 0x09)};
}
static inline f32x16 round_nearest(f32x16 x) {  // 0x08: to nearest even, no exceptions
  return {_mm512_roundscale_ps(x.v, 0x08)};
}
static inline f32x16 pow2(f32x16 n) {  // 2^n for whole n in [-126, 127]
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127)), 23);
  return {_mm512_castsi512_ps(e)};
}
static inline f32x16 times_pow2(f32x16 x, f32x16 n) {  // x 2^n, as mul(x, pow2(n)) rounds it
  return {_mm512_scalef_ps(x.v, n.v)};
}
static inline __m256 fold8(f32x16 x) {  // lane i + lane i + 8
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x.v), 1));
  return _mm256_add_ps(_mm512_castps512_ps256(x.v), hi);
}
static inline float first_lane(f32x16 x) { return _mm512_cvtss_f32(x.v); }
// hsum (below) of each of 16 vectors, as one vector, by a transposing tree: 45 shuffles and
// adds for 16 sums, in hsum's order. The tree leaves slot i's sum in lane ORDER[i] (an
// involution), so it takes its inputs in that order.
static inline f32x16 hsums(const f32x16 (&a)[16]) {
  constexpr int ORDER[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i) {  // lane i + lane i + 8
    const __m512 x = a[ORDER[i]].v, y = a[ORDER[i + 8]].v;
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
  }
  for (int i = 0; i < 4; ++i)  // + 4
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[i], b[i + 4], 0x88),
                         _mm512_shuffle_f32x4(b[i], b[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)  // pairs
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[i], c[i + 2], 0x88),
                         _mm512_shuffle_ps(c[i], c[i + 2], 0xDD));
  return {_mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD))};
}
#else
struct f32x16 { __m256 lo, hi; };
static inline f32x16 zeros() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline f32x16 splat(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline f32x16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline __m256i first8(int64_t n) {  // lanes below n (n in -7..15)
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n)), lane);
}
static inline f32x16 load(const float* p, int64_t n) {
  if (n >= 16) return load(p);
  return {_mm256_maskload_ps(p, first8(n)), _mm256_maskload_ps(p + 8, first8(n - 8))};
}
static inline void store(float* p, f32x16 x) {
  _mm256_storeu_ps(p, x.lo);
  _mm256_storeu_ps(p + 8, x.hi);
}
static inline void store(float* p, f32x16 x, int64_t n) {
  if (n >= 16) return store(p, x);
  _mm256_maskstore_ps(p, first8(n), x.lo);
  _mm256_maskstore_ps(p + 8, first8(n - 8), x.hi);
}
#define DECODE_MATH_LANEWISE(name, op) \
  static inline f32x16 name(f32x16 a, f32x16 b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
DECODE_MATH_LANEWISE(add, _mm256_add_ps)
DECODE_MATH_LANEWISE(sub, _mm256_sub_ps)
DECODE_MATH_LANEWISE(mul, _mm256_mul_ps)
DECODE_MATH_LANEWISE(div, _mm256_div_ps)
DECODE_MATH_LANEWISE(vmax, _mm256_max_ps)
DECODE_MATH_LANEWISE(vmin, _mm256_min_ps)
#undef DECODE_MATH_LANEWISE
static inline f32x16 fmadd(f32x16 a, f32x16 b, f32x16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline f32x16 fnmadd(f32x16 a, f32x16 b, f32x16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
static inline f32x16 round_down(f32x16 x) { return {_mm256_floor_ps(x.lo), _mm256_floor_ps(x.hi)}; }
static inline __m256 pow2_8(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline f32x16 pow2(f32x16 n) { return {pow2_8(n.lo), pow2_8(n.hi)}; }
static inline f32x16 round_nearest(f32x16 x) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(x.lo, mode), _mm256_round_ps(x.hi, mode)};
}
static inline f32x16 times_pow2(f32x16 x, f32x16 n) { return mul(x, pow2(n)); }
static inline __m256 fold8(f32x16 x) { return _mm256_add_ps(x.lo, x.hi); }
static inline float first_lane(f32x16 x) { return _mm256_cvtss_f32(x.lo); }
#endif

// A float16 KV cache's values (IEEE half bits as uint16_t): widened exactly on load, rounded
// to nearest even on store, as torch converts float32 to float16 (the same bits either way).
#if defined(__AVX512F__)
static inline f32x16 load(const uint16_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
static inline void store(uint16_t* p, f32x16 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#else
static inline f32x16 load(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
static inline void store(uint16_t* p, f32x16 x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x.lo, _MM_FROUND_TO_NEAREST_INT));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8),
                   _mm256_cvtps_ph(x.hi, _MM_FROUND_TO_NEAREST_INT));
}
#endif
static inline f32x16 load(const uint16_t* p, int64_t n) {  // the first n lanes, the rest 0
  if (n >= 16) return load(p);
  uint16_t part[16] = {};
  std::copy_n(p, n, part);
  return load(part);
}
static inline void store(uint16_t* p, f32x16 x, int64_t n) {
  if (n >= 16) return store(p, x);
  uint16_t part[16];
  store(part, x);
  std::copy_n(part, n, p);
}

// The 16 lanes' sum: lane i + lane i + 8, then + 4, then adjacent pairs, then those two.
static inline float hsum(f32x16 x) {
  const __m256 v = fold8(x);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}
#if !defined(__AVX512F__)
static inline f32x16 hsums(const f32x16 (&a)[16]) {  // lane i: hsum(a[i])
  float s[16];
  for (int i = 0; i < 16; ++i) s[i] = hsum(a[i]);
  return load(s);
}
#endif

// c[0] x^(N-1) + ... + c[N-1] by Horner's rule, one multiply-add a coefficient.
template <int N>
static inline f32x16 horner(f32x16 x, const float (&c)[N]) {
  f32x16 p = splat(c[0]);
  for (int i = 1; i < N; ++i) p = fmadd(p, x, splat(c[i]));
  return p;
}

// e^x lane by lane: Cephes' expf polynomial (about 1 ulp), for softmax and SiLU.
static inline f32x16 exp(f32x16 x) {
  x = vmin(vmax(x, splat(-88.3762626647949f)), splat(88.3762626647949f));
  const f32x16 n = round_down(fmadd(x, splat(1.44269504088896341f), splat(0.5f)));
  x = fnmadd(n, splat(0.693359375f), x);
  x = fnmadd(n, splat(-2.12194440e-4f), x);
  const f32x16 p = horner(x, {1.9875691500E-4f, 1.3981999507E-3f, 8.3334519073E-3f,
                              4.1665795894E-2f, 1.6666665459E-1f, 5.0000001201E-1f});
  return mul(add(fmadd(p, mul(x, x), x), splat(1.0f)), pow2(n));
}
static inline float exp(float x) { return first_lane(exp(splat(x))); }  // the same polynomial

// 2^x lane by lane for x <= 0 (2^-126 below -126): 2^fraction by a degree-6 polynomial
// (about 1 ulp; fitted here to 2^f's relative error on [-0.5, 0.5]), then the whole power
// exactly. Half exp's instructions: for a prefill chunk's softmax, whose scores are scaled
// into base 2 by the same multiply-add that subtracts their max.
static inline f32x16 exp2_nonpositive(f32x16 x) {
  x = vmax(x, splat(-126.0f));
  const f32x16 n = round_nearest(x), f = sub(x, n);  // f exact, in [-0.5, 0.5]
  return times_pow2(horner(f, {1.5353362e-4f, 1.3398875e-3f, 9.6184369e-3f, 5.5503324e-2f,
                               2.4022648e-1f, 6.9314718e-1f, 1.0f}),
                    n);
}

// n floats, 16 at a time (i the first, count 16 or fewer at the tail).
template <typename F>
static inline void by16(int64_t n, const F& f) {
  for (int64_t i = 0; i < n; i += 16) f(i, std::min<int64_t>(16, n - i));
}

template <typename T>  // b float32 or float16
static inline float dot(const float* a, const T* b, int64_t n) {
  f32x16 s = zeros();
  by16(n, [&](int64_t i, int64_t c) { s = fmadd(load(a + i, c), load(b + i, c), s); });
  return hsum(s);
}

static inline void rms_norm(const float* x, const float* w, float* out, int64_t n, float eps) {
  const f32x16 r = splat(1.0f / std::sqrt(dot(x, x, n) / n + eps));
  by16(n, [&](int64_t i, int64_t c) {
    store(out + i, mul(mul(load(x + i, c), r), load(w + i, c)), c);
  });
}

// Rotate-half RoPE of one head in place: x1 cos - x2 sin, x2 cos + x1 sin, each rounded once
// after its product with sin.
static inline void rope(float* x, const float* cos, const float* sin, int64_t half) {
  by16(half, [&](int64_t i, int64_t c) {
    const f32x16 x1 = load(x + i, c), x2 = load(x + half + i, c);
    const f32x16 co = load(cos + i, c), si = load(sin + i, c);
    store(x + i, fnmadd(x2, si, mul(x1, co)), c);
    store(x + half + i, fmadd(x1, si, mul(x2, co)), c);
  });
}

// n floats into a cache row of float32 or float16 (rounded to nearest even).
template <typename T>
static inline void put(T* dst, const float* src, int64_t n) {
  by16(n, [&](int64_t i, int64_t c) { store(dst + i, load(src + i, c), c); });
}

static inline void add_into(float* x, const float* y, int64_t n) {
  by16(n, [&](int64_t i, int64_t c) { store(x + i, add(load(x + i, c), load(y + i, c)), c); });
}

// out = silu(gate) * up, where gu holds [gate | up].
static inline void silu_mul(const float* gu, float* out, int64_t n) {
  const f32x16 one = splat(1.0f);
  by16(n, [&](int64_t i, int64_t c) {
    const f32x16 g = load(gu + i, c);
    const f32x16 sig = div(one, add(one, exp(sub(zeros(), g))));
    store(out + i, mul(mul(g, sig), load(gu + n + i, c)), c);
  });
}

// ---- Softmax attention over a float32 or float16 KV cache ----------------------------------
// A decode step's attention reads every cached key and value once (2 * n * head_dim * 4 or 2
// bytes per kv head): at long context it is bound by memory bandwidth (over float16, about as
// much by its arithmetic). So the query heads that share a kv head (GQA) are taken together,
// each few positions' keys and values read from memory (and widened) once for all of them,
// and a row's positions are cut into chunks of ATTENTION_CHUNK that the
// threads take one at a time (so one long row keeps both cores busy), each chunk's softmax
// two-pass over its scores in L1, and the chunks merged in order. Where the chunks fall depends
// on the row's own length alone: its bits do not depend on its neighbours or on the threads.
constexpr int64_t ATTENTION_CHUNK = 512;

static inline float largest(const float* x, int64_t n) {  // exact, in any order
  f32x16 m = splat(-INFINITY);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) m = vmax(m, load(x + i));
  float lanes[16], top = -INFINITY;
  store(lanes, m);
  for (float l : lanes) top = std::max(top, l);
  for (; i < n; ++i) top = std::max(top, x[i]);
  return top;
}

// n floats of a cache at p as float32: p itself, or (float16) widened into `room`, once for
// all the queries that read them.
static inline const float* widened(const float* p, int64_t, float*) { return p; }
static inline const float* widened(const uint16_t* p, int64_t n, float* room) {
  by16(n, [&](int64_t i, int64_t c) { store(room + i, load(p + i, c), c); });
  return room;
}

// A chunk's float16 keys, then its values, are read in bursts (16 or 32 positions) between
// long runs of arithmetic for all its query heads, and the hardware prefetcher alone fell
// behind them. So each burst [p, p + n) asks for the bytes KV_AHEAD on, up to the end of the
// chunk's keys or values. 8 KiB ahead made the attention ~5-15% faster from 1,000 to 16k
// positions over a cold cache (as a step's weights leave it), about the same at 300; 2 or 16
// KiB gained less (docs/performance.md).
constexpr int64_t KV_AHEAD = 8192;

static inline void prefetch_ahead(const float*, int64_t, const float*) {}  // float32: none
static inline void prefetch_ahead(const uint16_t* p, int64_t n, const uint16_t* end) {
  // Offsets, not pointers: a pointer past the cache's end is never formed.
  const char* bytes = reinterpret_cast<const char*>(p);
  const int64_t stop = std::min<int64_t>(KV_AHEAD + n * 2, (end - p) * 2);
  for (int64_t at = KV_AHEAD; at < stop; at += 64) _mm_prefetch(bytes + at, _MM_HINT_T0);
}

// The `group` query heads' (head_dim apart) scaled scores over `len` positions into scores[h *
// ATTENTION_CHUNK + t], their maxima into top[h]. HB: head_dim / 16 if known when compiled
// (16 positions' keys then read once for all the heads, their 16 sums finished together),
// else 0. Both give dot()'s bits.
template <int HB, typename T>
static void scores_of(const float* q, int64_t group, const T* k, int64_t len, int64_t hd,
                      float scale, float* scores, float* top) {
  int64_t t0 = 0;
  if constexpr (HB > 0) {
    alignas(64) float room[16 * 16 * HB];
    for (; t0 + 16 <= len; t0 += 16) {
      prefetch_ahead(k + t0 * hd, 16 * hd, k + len * hd);
      const float* keys = widened(k + t0 * hd, 16 * hd, room);
      for (int64_t h = 0; h < group; ++h) {
        f32x16 qb[HB], acc[16];
        for (int j = 0; j < HB; ++j) qb[j] = load(q + h * hd + 16 * j);
        _Pragma("GCC unroll 16") for (int i = 0; i < 16; ++i) {
          acc[i] = zeros();
          _Pragma("GCC unroll 16") for (int j = 0; j < HB; ++j)
            acc[i] = fmadd(qb[j], load(keys + i * hd + 16 * j), acc[i]);
        }
        const f32x16 s = mul(hsums(acc), splat(scale));
        store(scores + h * ATTENTION_CHUNK + t0, s);
      }
    }
  }
  for (int64_t h = 0; h < group; ++h) {
    float* sh = scores + h * ATTENTION_CHUNK;
    for (int64_t t = t0; t < len; ++t) sh[t] = dot(q + h * hd, k + t * hd, hd) * scale;
    top[h] = largest(sh, len);
  }
}

// e^(score - m) in place; returns their sum.
static inline float exps(float* scores, int64_t len, float m) {
  const f32x16 mv = splat(m);
  f32x16 sv = zeros();
  int64_t t = 0;
  for (; t + 16 <= len; t += 16) {
    const f32x16 p = exp(sub(load(scores + t), mv));
    store(scores + t, p);
    sv = add(sv, p);
  }
  float sum = hsum(sv);
  for (; t < len; ++t) {  // the tail through the same polynomial: one definition of e^x
    scores[t] = exp(scores[t] - m);
    sum += scores[t];
  }
  return sum;
}

constexpr int64_t VALUE_BLOCK = 32;  // positions whose values stay in L1 for all the heads

// o_h += sum over u in [u0, u1) of p_h[u] * v[u] for H heads at once (p_h ATTENTION_CHUNK
// apart, o_h o_stride apart): H * HB sums in registers, each over positions in order.
template <int HB, int H, typename T>
static void weigh_values(const float* p, const T* v, int64_t u0, int64_t u1, int64_t hd,
                         float* o, int64_t o_stride) {
  f32x16 acc[H][HB];
  for (int h = 0; h < H; ++h)
    for (int j = 0; j < HB; ++j) acc[h][j] = load(o + h * o_stride + 16 * j);
  for (int64_t u = u0; u < u1; ++u) {
    f32x16 pu[H];
    for (int h = 0; h < H; ++h) pu[h] = splat(p[h * ATTENTION_CHUNK + u]);
    _Pragma("GCC unroll 16") for (int j = 0; j < HB; ++j) {
      const f32x16 x = load(v + u * hd + 16 * j);
      _Pragma("GCC unroll 16") for (int h = 0; h < H; ++h) acc[h][j] = fmadd(pu[h], x, acc[h][j]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int j = 0; j < HB; ++j) store(o + h * o_stride + 16 * j, acc[h][j]);
}

// All `group` query heads of a 64-wide head at once, straight from the cache: 4 * group sums
// in registers, each value vector loaded (and widened) once for all of them, where the group
// has at most 7 heads (28 accumulators). Over a warm cache one such pass took 0.84-0.92x the
// time of widening into a buffer and taking the heads 4, 2 and 1 at a time, for groups of 1
// to 7 (docs/performance.md). Returns false for the other shapes.
template <int HB, typename T>
static bool weigh_group_values(const float* p, const T* v, int64_t n, int64_t hd, int64_t group,
                               float* o, int64_t o_stride) {
  if constexpr (HB == 4) {
    switch (group) {
      case 1: return weigh_values<HB, 1>(p, v, 0, n, hd, o, o_stride), true;
      case 2: return weigh_values<HB, 2>(p, v, 0, n, hd, o, o_stride), true;
      case 3: return weigh_values<HB, 3>(p, v, 0, n, hd, o, o_stride), true;
      case 4: return weigh_values<HB, 4>(p, v, 0, n, hd, o, o_stride), true;
      case 5: return weigh_values<HB, 5>(p, v, 0, n, hd, o, o_stride), true;
      case 6: return weigh_values<HB, 6>(p, v, 0, n, hd, o, o_stride), true;
      case 7: return weigh_values<HB, 7>(p, v, 0, n, hd, o, o_stride), true;
    }
  }
  return false;
}

// weigh_values for `heads` heads (through a widened buffer where weigh_group_values does not
// take them), H at a time while enough are left, then fewer.
template <int HB, int H, typename T>
static void weigh_values_of(const float* p, const T* v, int64_t u0, int64_t u1, int64_t hd,
                            int64_t heads, float* o, int64_t o_stride) {
  int64_t h = 0;
  for (; h + H <= heads; h += H)
    weigh_values<HB, H>(p + h * ATTENTION_CHUNK, v, u0, u1, hd, o + h * o_stride, o_stride);
  if constexpr (H > 1)
    weigh_values_of<HB, H / 2>(p + h * ATTENTION_CHUNK, v, u0, u1, hd, heads - h,
                               o + h * o_stride, o_stride);
}

// The `group` query heads sharing one kv head over one chunk of `len` positions: per head the
// scores' max m, the sum s of e^(score - m), and o = sum of e^(score - m) * v (unnormalized),
// as [m, s, o...] at partials + head * stride.
template <int HB, typename T>
static void attend_chunk(const float* q, int64_t group, const T* k, const T* v,
                         int64_t len, int64_t hd, float scale, float* partials, int64_t stride) {
  thread_local std::vector<float> weights, top;  // resize keeps their memory
  weights.resize(group * ATTENTION_CHUNK);
  top.resize(group);
  scores_of<HB>(q, group, k, len, hd, scale, weights.data(), top.data());
  for (int64_t h = 0; h < group; ++h) {
    partials[h * stride] = top[h];
    partials[h * stride + 1] = exps(weights.data() + h * ATTENTION_CHUNK, len, top[h]);
    std::fill_n(partials + h * stride + 2, hd, 0.0f);
  }
  if constexpr (HB > 0) {
    alignas(64) float room[VALUE_BLOCK * 16 * HB];
    for (int64_t u = 0; u < len; u += VALUE_BLOCK) {
      const int64_t n = std::min(len - u, VALUE_BLOCK);
      prefetch_ahead(v + u * hd, n * hd, v + len * hd);
      if (weigh_group_values<HB>(weights.data() + u, v + u * hd, n, hd, group, partials + 2,
                                 stride))
        continue;
      const float* values = widened(v + u * hd, n * hd, room);
      weigh_values_of<HB, (HB <= 4 ? 4 : 2)>(weights.data() + u, values, 0, n, hd, group,
                                            partials + 2, stride);
    }
  } else {
    for (int64_t h = 0; h < group; ++h) {
      const float* p = weights.data() + h * ATTENTION_CHUNK;
      by16(hd, [&](int64_t i, int64_t c) {
        f32x16 acc = zeros();
        for (int64_t u = 0; u < len; ++u) acc = fmadd(splat(p[u]), load(v + u * hd + i, c), acc);
        store(partials + h * stride + 2 + i, acc, c);
      });
    }
  }
}

// The chunks' results of one query head merged in order into its output (head_dim floats):
// sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) s_c, M the largest m_c.
static inline void merge_chunks(const float* partials, int64_t chunks, int64_t stride,
                                int64_t hd, float* out) {
  float top = -INFINITY, sum = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) top = std::max(top, partials[c * stride]);
  for (const float* p = partials; p < partials + chunks * stride; p += stride)
    sum = std::fma(exp(p[0] - top), p[1], sum);
  const f32x16 r = splat(1.0f / sum);
  by16(hd, [&](int64_t i, int64_t n) {
    f32x16 acc = zeros();
    for (const float* p = partials; p < partials + chunks * stride; p += stride)
      acc = fmadd(splat(exp(p[0] - top)), load(p + 2 + i, n), acc);
    store(out + i, mul(acc, r), n);
  });
}

// Softmax attention of every query head of a batch's rows, each row over the first
// lengths[b] positions of its own cache row.
class CacheAttention {
 public:
  CacheAttention(int64_t heads, int64_t kv_heads, int64_t head_dim)
      : heads_(heads), kv_heads_(kv_heads), hd_(head_dim),
        scale_(1.0f / std::sqrt(static_cast<float>(head_dim))) {}

  // q: row b's query heads at q + b * q_stride, head_dim apart; k[b], v[b]: its cache row
  // (T: float, or uint16_t for float16), kv heads kv_stride apart and positions head_dim
  // apart; out: [rows, heads, head_dim].
  template <typename T>
  void operator()(int64_t rows, const float* q, int64_t q_stride, const T* const* k,
                  const T* const* v, int64_t kv_stride, const int64_t* lengths,
                  float* out) {
    first_chunk_.assign(rows + 1, 0);
    for (int64_t b = 0; b < rows; ++b)
      first_chunk_[b + 1] = first_chunk_[b] + (lengths[b] + ATTENTION_CHUNK - 1) / ATTENTION_CHUNK;
    const int64_t stride = hd_ + 2, groups = heads_ / kv_heads_;
    partials_.resize(first_chunk_[rows] * heads_ * stride);
    pooled_chunks(first_chunk_[rows] * kv_heads_, 1, [&](int64_t task) {
      const int64_t chunk = task / kv_heads_, kh = task % kv_heads_;
      const int64_t b = std::upper_bound(first_chunk_.begin(), first_chunk_.end(), chunk) -
                        first_chunk_.begin() - 1;
      const int64_t t0 = (chunk - first_chunk_[b]) * ATTENTION_CHUNK;
      const int64_t len = std::min(ATTENTION_CHUNK, lengths[b] - t0);
      const int64_t head = kh * groups, at = kh * kv_stride + t0 * hd_;
      attend(q + b * q_stride + head * hd_, groups, k[b] + at, v[b] + at, len,
             partials_.data() + (chunk * heads_ + head) * stride);
    });
    for (int64_t b = 0; b < rows; ++b)
      for (int64_t head = 0; head < heads_; ++head)
        merge_chunks(partials_.data() + (first_chunk_[b] * heads_ + head) * stride,
                     first_chunk_[b + 1] - first_chunk_[b], heads_ * stride, hd_,
                     out + (b * heads_ + head) * hd_);
  }

 private:
  template <typename T>
  void attend(const float* q, int64_t group, const T* k, const T* v, int64_t len,
              float* partials) const {
    const int64_t stride = hd_ + 2;
    switch (hd_) {  // the usual head sizes, their sums in registers
      case 64: return attend_chunk<4>(q, group, k, v, len, hd_, scale_, partials, stride);
      case 128: return attend_chunk<8>(q, group, k, v, len, hd_, scale_, partials, stride);
      default: return attend_chunk<0>(q, group, k, v, len, hd_, scale_, partials, stride);
    }
  }

  int64_t heads_, kv_heads_, hd_;
  float scale_;
  std::vector<int64_t> first_chunk_;  // row b's chunks: [first_chunk_[b], first_chunk_[b + 1])
  std::vector<float> partials_;       // [chunk, head, (m, s, o...)]
};

}  // namespace decode_math
