#include "cpu_kernels.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
// AMX beside AVX-512 (a native build with -mno-avx512f has AMX's intrinsics, not zmm's).
#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512F__)
#include <sys/syscall.h>
#include <unistd.h>
#define MASHBOX_AMX 1
#endif

// y[M, N] = x[M, K] . W^T with W a GGUF file's own Q4 or Q5 blocks (packed as for q4_gemm and
// q5_gemm, blocks_gemm.cpp: Q4_0 / Q4_1 / Q5_0 / Q5_1 with fp16 d and m, Q4_K's and Q5_K's
// groups of 32 with float32 ones), its Q6_K blocks (q6a16) or its Q8 blocks (q8a16), and the
// activations rounded to integers per block of 32, for exact integer dot products. One kernel
// for the 4-, 5- and 6-bit blocks and int8 or int16 activations, unpacking a record's bytes
// once for all its rows.

#define UNROLL _Pragma("GCC unroll 16")

static constexpr int64_t TILE = TILE_LANES, BLOCK = 32;

// Activations rounded per block of 32 (quantize_rows below), as the block kernels read them:
// int8 (x ~ xq * dx, dx = max|x| / 127: llama.cpp's Q8_1), or int16 (dx = max|x| / 32767,
// ~256x finer, near float32) split into bytes, xq = 256 * high + low with high signed and low
// unsigned, so that both take int8 dot products (dot4). dx and xs = dx * sum(xq) per block.
// (The Q8 blocks' int8 weights are signed: they take int16 xq whole, two to a lane.)
template <typename T>
struct Rows {  // one of Rounded's arrays, in the calling thread's Scratch
  T* p = nullptr;
  T* data() const { return p; }
  T& operator[](int64_t i) const { return p[i]; }
};
struct Rounded {
  Rows<int8_t> high;     // int8 xq, or int16 xq's high bytes [rows, K]
  Rows<uint8_t> low;     // int16 xq's low bytes (none for int8)
  Rows<int16_t> whole;   // or int16 xq whole (WHOLE), and no bytes
  Rows<float> dx, xs;    // [rows, K / 32]
  Rows<int32_t> sums16;  // xq's sums per 16 [rows, K / 16], for Q6 blocks alone
};

// Where a thread's Rounded lives until its next call: a decode step rounds ~120 inputs, and
// six fresh zeroed vectors each cost ~0.2 us (malloc, memset, free) of the caller's serial
// time while its helper waits. A thread rounds one input at a time (a matmul's, read by the
// pool while the caller waits for it); the arrays keep the largest input's size (a 256-row
// prefill chunk of qwen2.5-0.5b's down matrix: ~2.5 MB).
struct Scratch {
  std::vector<int8_t> high;
  std::vector<uint8_t> low;
  std::vector<int16_t> whole;
  std::vector<float> dx, xs;
  std::vector<int32_t> sums16;
  template <typename T>
  static Rows<T> take(std::vector<T>& room, int64_t n) {
    if (static_cast<int64_t>(room.size()) < n) room.resize(n);
    return {room.data()};
  }
};

// x[rows, K] rounded to -LIMIT..LIMIT per block (to nearest even): 127 or 32767; SUMS16: also
// the sums per 16 (Q6's). TILED: the bytes as AMX's tiles take them (amx_rows): per 16 rows
// and block, the 16 rows' 32 bytes one after the other, rows past the last up to a multiple
// of 16 zeros. A tile load then reads 512 bytes in a row, where rows K apart took 16 lines
// (qwen's down matrices, K = 4,864, ran 1.15x as fast).
template <int LIMIT, bool WHOLE = false, bool SUMS16 = false, bool TILED = false>
static Rounded quantize_rows(const float* x, int64_t rows, int64_t K) {
  const int64_t per_row = K / BLOCK, blocks = rows * per_row;
  const int64_t bytes = WHOLE ? 0 : (TILED ? (rows + 15) / 16 * 16 : rows) * K;
  static thread_local Scratch room;
  Rounded r{Scratch::take(room.high, bytes), Scratch::take(room.low, LIMIT > 127 ? bytes : 0),
            Scratch::take(room.whole, WHOLE ? rows * K : 0), Scratch::take(room.dx, blocks),
            Scratch::take(room.xs, blocks), Scratch::take(room.sums16, SUMS16 ? 2 * blocks : 0)};
  if (TILED && rows % 16) {  // the last 16 rows' bytes: zeros where no row fills them
    std::memset(r.high.data() + rows / 16 * 16 * K, 0, 16 * K);
    if (LIMIT > 127) std::memset(r.low.data() + rows / 16 * 16 * K, 0, 16 * K);
  }
  for (int64_t i = 0; i < blocks; ++i) {
    const float* p = x + i * BLOCK;
    const int64_t m = i / per_row, nth = i % per_row;  // the block's row, its place there
    const int64_t at = TILED ? ((m / 16 * per_row + nth) * 16 + m % 16) * BLOCK : i * BLOCK;
#if defined(__AVX512F__)
    // The scalar loop below, 16 lanes at a time: the same roundings (cvtps rounds to nearest
    // even, as nearbyint does in the default mode), so the same integers.
    const __m512 a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float d = amax / static_cast<float>(LIMIT), inv = d != 0.0f ? 1.0f / d : 0.0f;
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
    const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
    int32_t halves[2] = {_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)), 0};
    if constexpr (SUMS16)
      halves[0] = _mm512_reduce_add_epi32(qa), halves[1] = _mm512_reduce_add_epi32(qb);
    if constexpr (WHOLE) {
      auto* whole = reinterpret_cast<__m256i*>(r.whole.data() + i * BLOCK);
      _mm256_storeu_si256(whole, _mm512_cvtepi32_epi16(qa));
      _mm256_storeu_si256(whole + 1, _mm512_cvtepi32_epi16(qb));
    } else if constexpr (LIMIT > 127) {
      auto* high = reinterpret_cast<__m128i*>(r.high.data() + at);
      auto* low = reinterpret_cast<__m128i*>(r.low.data() + at);
      _mm_storeu_si128(high, _mm512_cvtepi32_epi8(_mm512_srai_epi32(qa, 8)));  // floor
      _mm_storeu_si128(high + 1, _mm512_cvtepi32_epi8(_mm512_srai_epi32(qb, 8)));
      _mm_storeu_si128(low, _mm512_cvtepi32_epi8(qa));  // the low bytes
      _mm_storeu_si128(low + 1, _mm512_cvtepi32_epi8(qb));
    } else {
      auto* bytes = reinterpret_cast<__m128i*>(r.high.data() + at);
      _mm_storeu_si128(bytes, _mm512_cvtepi32_epi8(qa));
      _mm_storeu_si128(bytes + 1, _mm512_cvtepi32_epi8(qb));
    }
#else
    float amax = 0.0f;
    for (int64_t k = 0; k < BLOCK; ++k) amax = std::max(amax, std::fabs(p[k]));
    const float d = amax / static_cast<float>(LIMIT), inv = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t halves[2] = {0, 0};
    for (int64_t k = 0; k < BLOCK; ++k) {
      const int32_t q = static_cast<int32_t>(std::nearbyint(p[k] * inv));
      if constexpr (WHOLE) {
        r.whole[i * BLOCK + k] = static_cast<int16_t>(q);
      } else if constexpr (LIMIT > 127) {
        r.high[at + k] = static_cast<int8_t>(q >> 8);  // floor: the low byte >= 0
        r.low[at + k] = static_cast<uint8_t>(q & 0xFF);
      } else {
        r.high[at + k] = static_cast<int8_t>(q);
      }
      halves[k / 16] += q;
    }
#endif
    if constexpr (SUMS16) r.sums16[2 * i] = halves[0], r.sums16[2 * i + 1] = halves[1];
    r.dx[i] = d;
    r.xs[i] = d * static_cast<float>(halves[0] + halves[1]);
  }
  return r;
}

// How a record's weights are scaled: Q4 and Q5 blocks per 32, d and m, their scales a tile's
// [K / 32][1 or 2][32] of S (fp16 or float32), or the K-quants' as stored (S = uint8_t:
// K_SCALES bytes a tile and 256); Q6's per 16 (Q6_SCALES bytes a tile and 256).
template <int RECORD>
constexpr int64_t GROUP = RECORD == Q6_RECORD ? Q6_GROUP : BLOCK;
template <int RECORD, typename S>
static int64_t tile_scales(int64_t K, int derived_m) {
  if constexpr (RECORD == Q6_RECORD) return K / Q6_SUPER * Q6_SCALES;
  if constexpr (std::is_same_v<S, uint8_t>) return K / K_SUPER * K_SCALES;
  return K / BLOCK * scales_per_block(derived_m) * TILE;
}

// A block's integer sums into out: out += d * (sum * dx) + m * xs, the same order for both;
// scales(v, d, m) gives vector v's d and m.
template <int V, int MB, typename Scales>
static inline void add_block_sums(const vint (&sum)[MB][V], const Rounded& x,
                                  const Scales& scales, float (&out)[MB][V * LANES], int64_t b,
                                  int64_t m0, int64_t blocks) {
  UNROLL for (int v = 0; v < V; ++v) {
    vfloat d, m;
    scales(v, d, m);
    UNROLL for (int j = 0; j < MB; ++j) {
      const int64_t at = (m0 + j) * blocks + b;
      const vfloat qx = vmul(to_float(sum[j][v]), vbroadcast(x.dx.data() + at));
      vfloat o = vfma(d, qx, vload(out[j] + v * LANES));
      o = vfma(m, vbroadcast(x.xs.data() + at), o);
      vstore(out[j] + v * LANES, o);
    }
  }
}

// A group's sums into out where its weights have no offset of their own (Q6's groups of 16,
// the Q8 blocks): out += d * (sum * dx), scale(v) giving vector v's d, and `block` the
// rounding block (its dx) that the group lies in.
template <int V, int MB, typename Scale>
static inline void add_scaled_sums(const vint (&sum)[MB][V], const Rounded& x,
                                   const Scale& scale, float (&out)[MB][V * LANES],
                                   int64_t block, int64_t m0, int64_t blocks) {
  UNROLL for (int v = 0; v < V; ++v) {
    const vfloat d = scale(v);
    UNROLL for (int j = 0; j < MB; ++j) {
      const float* dx = x.dx.data() + (m0 + j) * blocks + block;
      const vfloat qx = vmul(to_float(sum[j][v]), vbroadcast(dx));
      vstore(out[j] + v * LANES, vfma(d, qx, vload(out[j] + v * LANES)));
    }
  }
}

// Vector v's d * sc for Q6 group b (of 16) of the tile whose scales are at `scales` (tile:
// their bytes), exact in float32 (an fp16 times an int8). With sums((q - 32) * xq)
// (rounded_block starts each at -32 * sum(xq)), add_scaled_sums gives q8a16_gemm's bits
// over the same weights in groups of 16.
static inline vfloat q6_scale(const uint8_t* scales, int64_t tile, int v, int64_t b) {
  const uint8_t* s = scales + v / VPT * tile + b / (Q6_SUPER / Q6_GROUP) * Q6_SCALES;
  const int lane = v % VPT * LANES;
  const auto* sc = reinterpret_cast<const int8_t*>(s) + b % (Q6_SUPER / Q6_GROUP) * TILE;
  const auto* d = reinterpret_cast<const uint16_t*>(s + Q6_SUPER / Q6_GROUP * TILE);
  return vmul(from_half(d + lane), to_float(widen_i8(sc + lane)));
}

// Vector v's d and m for scale group b of Q4 and Q5 records (v within the tile whose scales
// are at `scales`, tile: their bytes): the K-quants' d * sc and -dmin * mn (S = uint8_t, as
// stored), or the blocks' own (block_scales).
template <typename S>
static inline void group_scales(const S* scales, int64_t tile, int v, int derived_m, int64_t b,
                                vfloat& d, vfloat& m) {
  if constexpr (std::is_same_v<S, uint8_t>) {
    const uint8_t* s = scales + v / VPT * tile + b / K_GROUPS * K_SCALES;
    const int64_t group = b % K_GROUPS * TILE, lane = v % VPT * LANES;
    const auto* half = reinterpret_cast<const uint16_t*>(s + 2 * K_GROUPS * TILE) + lane;
    d = vmul(from_half(half), to_float(widen_u8(s + group + lane)));
    m = vmul(from_half(half + TILE), to_float(widen_u8(s + K_GROUPS * TILE + group + lane)));
  } else {
    block_scales(scales + vec_offset(v, tile) + b * scales_per_block(derived_m) * TILE,
                 derived_m, d, m);
  }
}

// A scale group's sums into out, by the record's kind and the scales' type; scales: the
// tile's, tile: their bytes (tile_scales).
template <int V, int MB, int RECORD, typename S>
static inline void add_group_sums(const vint (&sum)[MB][V], const Rounded& x, const S* scales,
                                  int64_t tile, int v0, int derived_m,
                                  float (&out)[MB][V * LANES], int64_t b, int64_t m0, int64_t K) {
  if constexpr (RECORD == Q6_RECORD) {
    auto scale = [&](int v) { return q6_scale(scales, tile, v0 + v, b); };
    add_scaled_sums<V, MB>(sum, x, scale, out, b * Q6_GROUP / BLOCK, m0, K / BLOCK);
  } else {
    auto block = [&](int v, vfloat& d, vfloat& m) {
      group_scales(scales, tile, v0 + v, derived_m, b, d, m);
    };
    add_block_sums<V, MB>(sum, x, block, out, b, m0, K / BLOCK);
  }
}

// V vectors of LANES outputs for MB rows (vectors v0.. of the tile at qs, as q4_block in
// blocks_gemm.cpp). Per scale group (GROUP), an exact int32 sum of q * xq an output: with
// int8 xq, the weights' bytes (unsigned) times xq's (signed); with int16, 256 * (weights times
// the high bytes) + (the low bytes, unsigned, times the weights, signed: 0..63 is both).
// Integer sums have no order, so a row's bits depend only on the row: the same at any M and
// either width. Group sums stay below 32 * 31 * 32767 (16 * 63 * 32767 for Q6) < 2^31.
template <int V, int MB, int RECORD, bool INT16, typename S>
static inline void rounded_block(const Rounded& x, const uint8_t* qs, int v0, const S* scales,
                                 int derived_m, float* y, int64_t n0, int64_t m0, int64_t K,
                                 int64_t N) {
  constexpr int64_t G = GROUP<RECORD>;
  const int64_t tile_qs = K / 8 * RECORD, tile_s = tile_scales<RECORD, S>(K, derived_m);
  alignas(64) float out[MB][V * LANES] = {};
  for (int64_t b = 0; b < K / G; ++b) {
    vint sum[MB][V], low_sum[MB][V], second[V], low_second[V];
    UNROLL for (int j = 0; j < MB; ++j) {
      // Q6: sum((q - 32) * xq) = sum(q * xq) - 32 * sum(xq), exactly; the offset from the start
      const vint start = RECORD == Q6_RECORD
                             ? vset_int(-32 * x.sums16[(m0 + j) * (K / G) + b])
                             : vzero_int();
      UNROLL for (int v = 0; v < V; ++v) sum[j][v] = vzero_int(), low_sum[j][v] = start;
    }
    UNROLL for (int v = 0; v < V; ++v) second[v] = low_second[v] = vzero_int();
    UNROLL for (int group = 0; group < G / 8; ++group) {
      const int64_t g = b * G / 8 + group;
      vint low[V], high[V];  // weights k..k+3 and k+4..k+7 of LANES outputs
      UNROLL for (int v = 0; v < V; ++v)
        weight_bytes<RECORD>(qs, v0 + v, g, tile_qs, low[v], high[v]);
      UNROLL for (int j = 0; j < MB; ++j) {
        const int64_t at = (m0 + j) * K + 8 * g;
        const vint x0 = broadcast4(x.high.data() + at), x1 = broadcast4(x.high.data() + at + 4);
        // One row sums weights k+4..k+7's products in chains of their own (second,
        // low_second): four independent sums a vector hide dot4's latency. Integer sums,
        // so the same bits.
        UNROLL for (int v = 0; v < V; ++v) {
          sum[j][v] = dot4(sum[j][v], low[v], x0);
          vint& chain = MB == 1 ? second[v] : sum[j][v];
          chain = dot4(chain, high[v], x1);
        }
        if constexpr (INT16) {
          const vint l0 = broadcast4(x.low.data() + at), l1 = broadcast4(x.low.data() + at + 4);
          UNROLL for (int v = 0; v < V; ++v) {
            low_sum[j][v] = dot4(low_sum[j][v], l0, low[v]);
            vint& chain = MB == 1 ? low_second[v] : low_sum[j][v];
            chain = dot4(chain, l1, high[v]);
          }
        }
      }
    }
    if constexpr (MB == 1)
      UNROLL for (int v = 0; v < V; ++v) {
        sum[0][v] = add_int(sum[0][v], second[v]);
        low_sum[0][v] = add_int(low_sum[0][v], low_second[v]);
      }
    if constexpr (INT16)
      UNROLL for (int j = 0; j < MB; ++j)
        UNROLL for (int v = 0; v < V; ++v) sum[j][v] = shift_add(sum[j][v], 8, low_sum[j][v]);
    add_group_sums<V, MB, RECORD>(sum, x, scales, tile_s, v0, derived_m, out, b, m0, K);
  }
  store_rows<V, MB>(out, y, n0, m0, N);
}

// Several rows with int16 activations, whole (quantize_rows' WHOLE): vector v0's weight
// bytes widened to words once for all MB rows, two lanes an output (half_words), times
// xq[k..k+3] (dot2), the pairs of lanes summed at the block's end. The same exact sums as
// rounded_block's, with half the broadcasts and one sum a row and half-vector.
template <int MB, int RECORD, typename S>
static inline void words_block(const Rounded& x, const uint8_t* qs, int v0, const S* scales,
                               int derived_m, float* y, int64_t n0, int64_t m0, int64_t K,
                               int64_t N) {
  static_assert(RECORD != Q6_RECORD, "Q6's groups of 16 take rounded_block");
  const int64_t tile_qs = K / 8 * RECORD, tile_s = tile_scales<RECORD, S>(K, derived_m);
  alignas(64) float out[MB][LANES] = {};
  for (int64_t b = 0; b < K / BLOCK; ++b) {
    vint first[MB], second[MB];  // the vector's first and second half of outputs
    UNROLL for (int j = 0; j < MB; ++j) first[j] = second[j] = vzero_int();
    UNROLL for (int group = 0; group < BLOCK / 8; ++group) {
      const int64_t g = b * BLOCK / 8 + group;
      vint low, high;
      weight_bytes<RECORD>(qs, v0, g, tile_qs, low, high);
      const vint w0 = half_words<0>(low), w1 = half_words<1>(low);
      const vint w2 = half_words<0>(high), w3 = half_words<1>(high);
      UNROLL for (int j = 0; j < MB; ++j) {
        const int16_t* row = x.whole.data() + (m0 + j) * K + 8 * g;
        const vint x0 = broadcast8(row), x1 = broadcast8(row + 4);
        first[j] = dot2(dot2(first[j], w0, x0), w2, x1);
        second[j] = dot2(dot2(second[j], w1, x0), w3, x1);
      }
    }
    vint sum[MB][1];
    UNROLL for (int j = 0; j < MB; ++j) sum[j][0] = pair_sums(first[j], second[j]);
    add_group_sums<1, MB, RECORD>(sum, x, scales, tile_s, v0, derived_m, out, b, m0, K);
  }
  store_rows<1, MB>(out, y, n0, m0, N);
}

// ---- AMX tiles for prefill chunks ----------------------------------------------------------
// A prefill chunk's matmuls with int16 activations are bound by the dot products' arithmetic
// (~83% of vpdpwssd's ceiling on the AVX-512 host, docs/performance.md). AMX's tiles multiply
// 16 x 64 int8 by 64 x 16 in one instruction. Each block of 32 still needs its own exact
// int32 sums (its scales are its own), so a block takes four tile products (the high and the
// low bytes of the activations, times two vectors of weights), and the AVX-512 kernels' own
// epilogue finishes them (add_block_sums, add_scaled_sums): the same integers, the same
// float operations in the same order, so the same bits as the AVX-512 kernels at any M.
static std::atomic<bool> amx_wanted{true};

#ifdef MASHBOX_AMX
// Linux gives a process AMX's 8 KiB of tile state only when asked (arch_prctl); 0 or the
// errno of its refusal (a kernel before 5.16, or a hypervisor that hides it).
static int amx_refused() {
  static const int refused = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : errno;
  }();
  return refused;
}

static bool amx_enabled() {
  return amx_wanted.load(std::memory_order_relaxed) && amx_refused() == 0;
}

// The tiles: 0-3 the sums of 16 rows x 16 outputs (int32: the rows' high bytes times vector
// 0's weights, their low bytes times them, then vector 1's), 4 and 5 a block of those bytes
// (16 rows x 32), 6 and 7 a block of each vector's weights (8 x 64: weight_bytes's layout is
// AMX's B).
static void load_tile_config() {
  struct {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {64, 64, 64, 64, 32, 32, 64, 64};
    uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 8, 8};
  } config;
  _tile_loadconfig(&config);
}

// A tile's 32 outputs for rows [0, M) into y from column n0, 16 rows at a time (x: their
// bytes, TILED). unpack(b, v, at) writes block b's weights of vector v at `at` in B's layout;
// finisher(b) returns what finishes a row's integer sums of block b into its outputs:
// finish(sum, row, out).
//
// The tile's weights are unpacked once for all its rows: a tile load of bytes just written
// by vector stores waits for them to reach the cache (a fifth of the time, perf). A block's
// tile products are issued before the previous block's sums are finished, so their latency
// hides behind that arithmetic; each row's are finished as soon as they are loaded (with all
// 16 rows' sums loaded first, the registers spilled). What bounds it is that float work and
// the tiles' stores and loads, ~3.5 ms for 256 rows of qwen's 4864 x 896 whichever the
// format (docs/performance.md), not the tile products.
template <typename Unpack, typename Finisher>
static void amx_rows(const Rounded& x, const Unpack& unpack, const Finisher& finisher, float* y,
                     int64_t n0, int64_t M, int64_t K, int64_t N) {
  static_assert(VPT == 2 && LANES == 16, "AMX's B holds one vector of 16 outputs");
  constexpr int64_t B_BYTES = BLOCK / 4 * 64;  // a block's weights of one vector
  const int64_t blocks = K / BLOCK;
  static thread_local std::vector<uint8_t> room;  // [blocks][VPT][B_BYTES], 64-byte aligned
  if (static_cast<int64_t>(room.size()) < blocks * VPT * B_BYTES + 64)
    room.resize(blocks * VPT * B_BYTES + 64);
  auto* unpacked = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(room.data()) + 63) & ~uintptr_t{63});
  for (int64_t b = 0; b < blocks; ++b)
    UNROLL for (int v = 0; v < VPT; ++v) unpack(b, v, unpacked + (b * VPT + v) * B_BYTES);
  load_tile_config();
  alignas(64) int32_t sums[4][16][16];
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    alignas(64) float out[16][VPT * LANES] = {};
    // Block b's sums of `rows` rows into out (rows: 16, known when compiled, or the last few).
    auto finish_rows = [&](int64_t b, auto rows) {
      const auto finish = finisher(b);  // its scales, once for all the rows
      UNROLL for (int j = 0; j < rows; ++j) {
        vint sum[1][VPT];
        UNROLL for (int v = 0; v < VPT; ++v)
          sum[0][v] = shift_add(_mm512_load_si512(sums[2 * v][j]), 8,
                                _mm512_load_si512(sums[2 * v + 1][j]));
        finish(sum, m0 + j, reinterpret_cast<float(&)[1][VPT * LANES]>(out[j]));
      }
    };
    for (int64_t b = 0; b <= blocks; ++b) {
      if (b > 0) {  // block b - 1's products, issued one turn ago
        _tile_stored(0, sums[0], 64);
        _tile_stored(1, sums[1], 64);
        _tile_stored(2, sums[2], 64);
        _tile_stored(3, sums[3], 64);
      }
      if (b < blocks) {
        const int64_t at = (m0 / 16 * blocks + b) * 16 * BLOCK;
        _tile_loadd(4, x.high.data() + at, BLOCK);
        _tile_loadd(5, x.low.data() + at, BLOCK);
        _tile_loadd(6, unpacked + b * VPT * B_BYTES, 64);
        _tile_loadd(7, unpacked + (b * VPT + 1) * B_BYTES, 64);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        _tile_dpbssd(0, 4, 6);  // signed high bytes, the weights as signed bytes
        _tile_dpbusd(1, 5, 6);  // unsigned low bytes
        _tile_dpbssd(2, 4, 7);
        _tile_dpbusd(3, 5, 7);
      }
      if (b > 0) {
        if (M - m0 >= 16)
          finish_rows(b - 1, std::integral_constant<int, 16>{});
        else
          finish_rows(b - 1, M - m0);
      }
    }
    if (M - m0 >= 16)
      store_rows<VPT, 16>(out, y, n0, m0, N);
    else
      for (int64_t j = 0; j < M - m0; ++j)
        store_rows<VPT, 1>(reinterpret_cast<float(&)[1][VPT * LANES]>(out[j]), y, n0, m0 + j, N);
  }
  _tile_release();  // a context switch saves 8 KiB less
}

// amx_rows for a tile of Q4 or Q5 records (its qs and scales), finished as rounded_block
// finishes them (add_block_sums).
template <int RECORD, typename S>
static void amx_records(const Rounded& x, const uint8_t* qs, const S* scales,
                        int derived_m, float* y, int64_t n0, int64_t M, int64_t K, int64_t N) {
  const int64_t tile_qs = K / 8 * RECORD, tile_s = tile_scales<RECORD, S>(K, derived_m);
  auto unpack = [&](int64_t b, int v, uint8_t* at) {
    UNROLL for (int group = 0; group < BLOCK / 8; ++group) {
      vint low, high;
      weight_bytes<RECORD>(qs, v, b * BLOCK / 8 + group, tile_qs, low, high);
      _mm512_store_si512(at + group * 128, low);
      _mm512_store_si512(at + group * 128 + 64, high);
    }
  };
  auto finisher = [&](int64_t b) {
    vfloat d[VPT], m[VPT];
    UNROLL for (int v = 0; v < VPT; ++v) group_scales(scales, tile_s, v, derived_m, b, d[v], m[v]);
    return [&x, d, m, b, K](const vint(&sum)[1][VPT], int64_t row, float(&out)[1][VPT * LANES]) {
      auto block = [&](int v, vfloat& dv, vfloat& mv) { dv = d[v], mv = m[v]; };
      add_block_sums<VPT, 1>(sum, x, block, out, b, row, K / BLOCK);
    };
  };
  amx_rows(x, unpack, finisher, y, n0, M, K, N);
}

// amx_rows for a tile of Q8_0 blocks (pack_q8's pairs, fp16 d), finished as q8a16_block
// finishes them (add_scaled_sums). A row of B is two pairs of weights (k, k + 1, then k + 2,
// k + 3) interleaved output by output.
static void amx_q8(const Rounded& x, const int8_t* qs, const uint16_t* ds,
                   float* y, int64_t n0, int64_t M, int64_t K, int64_t N) {
  const int64_t tile_qs = K * TILE, tile_d = K / BLOCK * TILE;
  alignas(64) static constexpr int16_t interleave[32] = {
      0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i words = _mm512_load_si512(interleave);
  auto unpack = [&](int64_t b, int v, uint8_t* at) {
    auto pairs = [&](int64_t k) {
      return _mm512_castsi256_si512(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + pair_offset(v, k, tile_qs))));
    };
    UNROLL for (int r = 0; r < BLOCK / 4; ++r) {
      const int64_t k = b * BLOCK + 4 * r;
      _mm512_store_si512(at + r * 64, _mm512_permutex2var_epi16(pairs(k), words, pairs(k + 2)));
    }
  };
  auto finisher = [&](int64_t b) {
    vfloat d[VPT];
    UNROLL for (int v = 0; v < VPT; ++v) d[v] = from_half(ds + vec_offset(v, tile_d) + b * TILE);
    return [&x, d, b, K](const vint(&sum)[1][VPT], int64_t row, float(&out)[1][VPT * LANES]) {
      auto scale = [&](int v) { return d[v]; };
      add_scaled_sums<VPT, 1>(sum, x, scale, out, b, row, K / BLOCK);
    };
  };
  amx_rows(x, unpack, finisher, y, n0, M, K, N);
}
#endif

std::string amx_status() {
#ifdef MASHBOX_AMX
  if (const int refused = amx_refused())
    return std::string("refused by Linux (arch_prctl: ") + std::strerror(refused) + ")";
  return amx_wanted.load() ? "on" : "turned off";
#else
  return "not in this build";
#endif
}

void set_amx(bool on) { amx_wanted.store(on); }

// Round x per block (quantize_rows), then spread the tiles as q4_gemm does.
template <bool INT16, int RECORD, typename S>
static void rounded_gemm(const float* x, const uint8_t* qs, const S* scales, float* y, int64_t M,
                         int64_t K, int64_t N, int derived_m) {
  const int64_t tiles = N / TILE, tile_qs = K / 8 * RECORD,
                tile_s = tile_scales<RECORD, S>(K, derived_m);
  // One row: int16 as bytes (rounded_block); several: whole (words_block), but for Q6, whose
  // groups of 16 would pay words_block's pair sums twice as often, and for a prefill chunk's
  // rows on AMX, whose tiles take bytes. (Q6's groups of 16 take AMX twice the tiles' work
  // and epilogues a weight: no faster than AVX-512, 0.95-1.09x, so they stay there.)
  constexpr bool Q6 = RECORD == Q6_RECORD, WORDS = INT16 && !Q6;
#ifdef MASHBOX_AMX
  const bool amx = WORDS && M > POOLED_ROWS && amx_enabled();
#else
  constexpr bool amx = false;
#endif
  const Rounded r = amx ? quantize_rows<32767, false, false, true>(x, M, K)
                    : WORDS && M > 1 ? quantize_rows<32767, true>(x, M, K)
                                     : quantize_rows<INT16 ? 32767 : 127, false, Q6>(x, M, K);
  auto tile = [&](auto v_count, auto rows, int64_t t, int v0, int64_t m) {
    constexpr int V = decltype(v_count)::value, MB = decltype(rows)::value;
    rounded_block<V, MB, RECORD, INT16>(r, qs + t * tile_qs, v0, scales + t * tile_s, derived_m,
                                        y, t * TILE + v0 * LANES, m, K, N);
  };
  using std::integral_constant;
  // One row, a pair of tiles a call: one tile after the other, one stream of weights at a
  // time, which memory serves faster than two side by side (both tiles' vectors at once, each
  // x broadcast shared by four: `bash bench/kernel_ab.sh`, 0.89-0.97x the time for Q4 and Q5
  // records; Q6's 0.93-1.01 once their bit planes were prefetched, weight_bytes).
  // Several rows as bytes: R rows x 2 vectors a block, each x broadcast shared by both (int16
  // as two bytes: two sums each, half the rows).
  constexpr int R = INT16 ? ACCUMULATORS / 4 : ACCUMULATORS / 2;
  auto one_row = [&](int64_t t) {
    tile(integral_constant<int, VPT>{}, integral_constant<int, 1>{}, t, 0, 0);
  };
  over_tiles(
      M, tiles,
      [&](int64_t t) {
        one_row(t);
        one_row(t + 1);
      },
      one_row,
      [&](int64_t t) {
#ifdef MASHBOX_AMX
        if constexpr (WORDS)
          if (amx)
            return amx_records<RECORD>(r, qs + t * tile_qs, scales + t * tile_s, derived_m, y,
                                       t * TILE, M, K, N);
#endif
        int64_t m = 0;
        if constexpr (WORDS) {
          auto words = [&](auto rows, int64_t m) {
            for (int v0 = 0; v0 < VPT; ++v0)
              words_block<decltype(rows)::value, RECORD>(r, qs + t * tile_qs, v0,
                                                         scales + t * tile_s, derived_m, y,
                                                         t * TILE + v0 * LANES, m, K, N);
          };
          for (; M - m >= ACCUMULATORS / 2; m += ACCUMULATORS / 2)
            words(integral_constant<int, ACCUMULATORS / 2>{}, m);
          for (; M - m >= 1; ++m) words(integral_constant<int, 1>{}, m);
          return;
        }
        for (; M - m >= R; m += R)
          for (int v0 = 0; v0 < VPT; v0 += 2)
            tile(integral_constant<int, 2>{}, integral_constant<int, R>{}, t, v0, m);
        for (; M - m >= 1; ++m)
          tile(integral_constant<int, VPT>{}, integral_constant<int, 1>{}, t, 0, m);
      });
}

void q4a8_gemm(const float* x, const uint8_t* qs, const uint16_t* dm, float* y, int64_t M,
               int64_t K, int64_t N, int derived_m) {
  rounded_gemm<false, Q4_RECORD>(x, qs, dm, y, M, K, N, derived_m);
}

void q4a8_gemm(const float* x, const uint8_t* qs, const float* dm, float* y, int64_t M,
               int64_t K, int64_t N, int derived_m) {
  rounded_gemm<false, Q4_RECORD>(x, qs, dm, y, M, K, N, derived_m);
}

void q5a8_gemm(const float* x, const uint8_t* qs, const uint16_t* dm, float* y, int64_t M,
               int64_t K, int64_t N, int derived_m) {
  rounded_gemm<false, Q5_RECORD>(x, qs, dm, y, M, K, N, derived_m);
}

void q5a8_gemm(const float* x, const uint8_t* qs, const float* dm, float* y, int64_t M,
               int64_t K, int64_t N, int derived_m) {
  rounded_gemm<false, Q5_RECORD>(x, qs, dm, y, M, K, N, derived_m);
}

void q4a16_gemm(const float* x, const uint8_t* qs, const uint16_t* dm, float* y, int64_t M,
                int64_t K, int64_t N, int derived_m) {
  rounded_gemm<true, Q4_RECORD>(x, qs, dm, y, M, K, N, derived_m);
}

void q4a16_gemm(const float* x, const uint8_t* qs, const float* dm, float* y, int64_t M,
                int64_t K, int64_t N, int derived_m) {
  rounded_gemm<true, Q4_RECORD>(x, qs, dm, y, M, K, N, derived_m);
}

void q5a16_gemm(const float* x, const uint8_t* qs, const uint16_t* dm, float* y, int64_t M,
                int64_t K, int64_t N, int derived_m) {
  rounded_gemm<true, Q5_RECORD>(x, qs, dm, y, M, K, N, derived_m);
}

void q5a16_gemm(const float* x, const uint8_t* qs, const float* dm, float* y, int64_t M,
                int64_t K, int64_t N, int derived_m) {
  rounded_gemm<true, Q5_RECORD>(x, qs, dm, y, M, K, N, derived_m);
}

void q4a8_gemm(const float* x, const uint8_t* qs, const uint8_t* scales, float* y, int64_t M,
               int64_t K, int64_t N, int derived_m) {
  rounded_gemm<false, Q4_RECORD>(x, qs, scales, y, M, K, N, derived_m);
}

void q4a16_gemm(const float* x, const uint8_t* qs, const uint8_t* scales, float* y, int64_t M,
                int64_t K, int64_t N, int derived_m) {
  rounded_gemm<true, Q4_RECORD>(x, qs, scales, y, M, K, N, derived_m);
}

void q5a8_gemm(const float* x, const uint8_t* qs, const uint8_t* scales, float* y, int64_t M,
               int64_t K, int64_t N, int derived_m) {
  rounded_gemm<false, Q5_RECORD>(x, qs, scales, y, M, K, N, derived_m);
}

void q5a16_gemm(const float* x, const uint8_t* qs, const uint8_t* scales, float* y, int64_t M,
                int64_t K, int64_t N, int derived_m) {
  rounded_gemm<true, Q5_RECORD>(x, qs, scales, y, M, K, N, derived_m);
}

void q6a16_gemm(const float* x, const uint8_t* qs, const uint8_t* scales, float* y, int64_t M,
                int64_t K, int64_t N) {
  rounded_gemm<true, Q6_RECORD>(x, qs, scales, y, M, K, N, 0);
}

// ---- Q8 blocks x int16 activations (q8a16) ------------------------------------------------
// pack_q8's pairs of int8 weights widened to int16 words times xq[k], xq[k + 1] (dot2): an
// exact int32 sum per group of G (|sum| < 32 * 128 * 32767 < 2^31), then out += d * (sum *
// dx), dx the rounding block's (G = 16: two groups a block).
template <int V, int MB, int G, typename S>
static inline void q8a16_block(const Rounded& x, const int8_t* qs, const S* ds, float* y,
                               int64_t n0, int64_t m0, int64_t K, int64_t N) {
  const int64_t groups = K / G, tile_qs = K * TILE, tile_d = groups * TILE;
  alignas(64) float out[MB][V * LANES] = {};
  for (int64_t b = 0; b < groups; ++b) {
    vint sum[MB][V];
    UNROLL for (int j = 0; j < MB; ++j)
      UNROLL for (int v = 0; v < V; ++v) sum[j][v] = vzero_int();
    prefetch_pairs<V, G>(qs, b, tile_qs);
    UNROLL for (int i = 0; i < G; i += 2) {
      const int64_t k = b * G + i;
      vint w[V];
      UNROLL for (int v = 0; v < V; ++v) w[v] = widen_pairs(qs + pair_offset(v, k, tile_qs));
      UNROLL for (int j = 0; j < MB; ++j) {
        const vint xk = broadcast2(x.whole.data() + (m0 + j) * K + k);
        UNROLL for (int v = 0; v < V; ++v) sum[j][v] = dot2(sum[j][v], w[v], xk);
      }
    }
    auto scale = [&](int v) { return load_scales(ds + vec_offset(v, tile_d) + b * TILE); };
    add_scaled_sums<V, MB>(sum, x, scale, out, b * G / BLOCK, m0, K / BLOCK);
  }
  store_rows<V, MB>(out, y, n0, m0, N);
}

template <int G, typename S>
static void q8a16_gemm_of(const float* x, const int8_t* qs, const S* ds, float* y, int64_t M,
                          int64_t K, int64_t N) {
  const int64_t tile_qs = K * TILE, tile_d = K / G * TILE;
#ifdef MASHBOX_AMX
  // A prefill chunk's rows of Q8_0 as bytes, on the tiles: 1.2-1.3x as fast. (Q6_K's groups
  // of 16 ran at 0.74-0.85x the AVX-512 kernel's speed there: twice the tiles' work a weight.)
  if constexpr (std::is_same_v<S, uint16_t>)
    if (M > POOLED_ROWS && amx_enabled()) {
      const Rounded r = quantize_rows<32767, false, false, true>(x, M, K);
      parallel_chunks(N / TILE, 2, [&](int64_t t) {
        amx_q8(r, qs + t * tile_qs, ds + t * tile_d, y, t * TILE, M, K, N);
      });
      return;
    }
#endif
  const Rounded r = quantize_rows<32767, true>(x, M, K);
  q8_tiles(M, N / TILE, [&](auto v, auto rows, int64_t t, int v0, int64_t m) {
    q8a16_block<decltype(v)::value, decltype(rows)::value, G>(
        r, qs + t * tile_qs + v0 * LANES * 2, ds + t * tile_d + v0 * LANES, y,
        t * TILE + v0 * LANES, m, K, N);
  });
}

void q8a16_gemm(const float* x, const int8_t* qs, const uint16_t* ds, float* y, int64_t M,
                int64_t K, int64_t N) {
  q8a16_gemm_of<32>(x, qs, ds, y, M, K, N);
}

void q8a16_gemm(const float* x, const int8_t* qs, const float* ds, float* y, int64_t M, int64_t K,
                int64_t N) {
  q8a16_gemm_of<16>(x, qs, ds, y, M, K, N);
}
