#include "cpu_kernels.h"

#include <cmath>

// y[M, N] = x[M, K] . W^T with W a GGUF file's own Q4 or Q5 blocks (packed as for q4_gemm and
// q5_gemm, blocks_gemm.cpp: Q4_0 / Q4_1 / Q5_0 / Q5_1 with fp16 d and m, Q4_K's and Q5_K's
// groups of 32 with float32 ones) and the activations rounded to integers per block of 32, for
// exact integer dot products. (Q5 takes int16 activations only: q5a16.)

#define UNROLL _Pragma("GCC unroll 16")

static constexpr int64_t TILE = TILE_LANES, BLOCK = 32;

// ---- Q4 x int8 activations (q4a8) ---------------------------------------------------------
// Each row's activations are rounded to int8 per block of 32, x ~ xq * dx with dx = max|x| /
// 127 (llama.cpp's Q8_1), and a block's sum of q * xq is an exact int32 dot product, four
// bytes a lane (dot4): w . x ~ dx * (d * sum(q * xq) + m * sum(xq)). Integer sums have no
// order, so a row's bits depend only on the row: the same at any M and either width.
// Packed (pack_q4a8) in tiles of 32 outputs: qs[N / 32][K / 8][32][4] bytes, byte j of an
// output's 4 holding weights 8i + j (low nibble) and 8i + 4 + j (high); dm as pack_q4's.

// x[rows, K] -> xq [rows, K] in -LIMIT..LIMIT, dx [rows, K / 32] and xs = dx * sum(xq) per
// block: x ~ xq * dx, dx = max|x| / LIMIT (int8: 127, int16: 32767).
template <typename T, int LIMIT>
static void quantize_rows(const float* x, T* xq, float* dx, float* xs, int64_t rows, int64_t K) {
  for (int64_t r = 0; r < rows * (K / BLOCK); ++r) {
    const float* p = x + r * BLOCK;
    float amax = 0.0f;
    for (int64_t k = 0; k < BLOCK; ++k) amax = std::max(amax, std::fabs(p[k]));
    const float d = amax / static_cast<float>(LIMIT), inv = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int64_t k = 0; k < BLOCK; ++k) {
      const int32_t q = static_cast<int32_t>(std::nearbyint(p[k] * inv));  // to nearest even
      xq[r * BLOCK + k] = static_cast<T>(q);
      sum += q;
    }
    dx[r] = d;
    xs[r] = d * static_cast<float>(sum);
  }
}

// A block's integer sums into out: out += d * (sum * dx) + m * xs, the same order for both.
template <int V, int MB, typename S>
static inline void add_block_sums(const vint (&sum)[MB][V], const float* dx, const float* xs,
                                  const S* dm, float (&out)[MB][V * LANES], int64_t b,
                                  int64_t m0, int64_t blocks, int64_t tile_dm) {
  UNROLL for (int v = 0; v < V; ++v) {
    const S* s = dm + vec_offset(v, tile_dm) + b * 2 * TILE;
    const vfloat d = load_scales(s), m = load_scales(s + TILE);
    UNROLL for (int j = 0; j < MB; ++j) {
      const int64_t at = (m0 + j) * blocks + b;
      const vfloat qx = vmul(to_float(sum[j][v]), vbroadcast(dx + at));
      vfloat o = vfma(d, qx, vload(out[j] + v * LANES));
      o = vfma(m, vbroadcast(xs + at), o);
      vstore(out[j] + v * LANES, o);
    }
  }
}

template <int V, int MB, int PAIR, typename S>
static inline void q4a8_block(const int8_t* xq, const float* dx, const float* xs,
                              const uint8_t* qs, const uint8_t*, const S* dm, float* y,
                              int64_t n0, int64_t m0, int64_t K, int64_t N) {
  static_assert(PAIR == Q4_PAIR, "pack_q4a8 holds 4-bit weights only");
  const int64_t blocks = K / BLOCK, tile_qs = K / 2 * TILE, tile_dm = blocks * 2 * TILE;
  alignas(64) float out[MB][V * LANES] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    vint sum[MB][V];
    UNROLL for (int j = 0; j < MB; ++j)
      UNROLL for (int v = 0; v < V; ++v) sum[j][v] = vzero_int();
    UNROLL for (int64_t i = 0; i < BLOCK / 8; ++i) {
      const int64_t k = b * BLOCK + 8 * i;
      vint low[V], high[V];  // weights k..k+3 and k+4..k+7 of LANES outputs
      UNROLL for (int v = 0; v < V; ++v) {
        // 4 bytes an output: vector v's lanes start 4 * LANES * (v % VPT) bytes in its tile.
        const int64_t at = (v / VPT) * tile_qs + (k / 8 * TILE + (v % VPT) * LANES) * 4;
        const vint w = vload_bytes(qs + at);
        low[v] = low_nibbles(w);
        high[v] = high_nibbles(w);
      }
      UNROLL for (int j = 0; j < MB; ++j) {
        const int8_t* row = xq + (m0 + j) * K + k;
        const vint x0 = broadcast4(row), x1 = broadcast4(row + 4);
        UNROLL for (int v = 0; v < V; ++v)
          sum[j][v] = dot4(dot4(sum[j][v], low[v], x0), high[v], x1);
      }
    }
    add_block_sums<V, MB>(sum, dx, xs, dm, out, b, m0, blocks, tile_dm);
  }
  store_rows<V, MB>(out, y, n0, m0, N);
}

// ---- Q4 and Q5 x int16 activations (q4a16, q5a16) -----------------------------------------
// As q4a8 with activations in int16 per block (dx = max|x| / 32767) and pack_q4's (or
// pack_q5's) layout: each lane holds an output's weights k and k + 1 as two words
// (nibble_words, plus 16 where a fifth bit is set), times the row's xq[k], xq[k + 1] (dot2).
// Block sums stay below 32 * 31 * 32767 < 2^31.

template <int V, int MB, int PAIR, typename S>
static inline void q4a16_block(const int16_t* xq, const float* dx, const float* xs,
                               const uint8_t* qs, const uint8_t* fifth, const S* dm, float* y,
                               int64_t n0, int64_t m0, int64_t K, int64_t N) {
  const int64_t blocks = K / BLOCK, tile_qs = K / 2 * PAIR, tile_dm = blocks * 2 * TILE;
  alignas(64) float out[MB][V * LANES] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    vint sum[MB][V];
    UNROLL for (int j = 0; j < MB; ++j)
      UNROLL for (int v = 0; v < V; ++v) sum[j][v] = vzero_int();
    UNROLL for (int64_t kp = 0; kp < BLOCK / 2; ++kp) {
      const int64_t k = b * BLOCK + 2 * kp;
      vint w[V];
      UNROLL for (int v = 0; v < V; ++v) {
        w[v] = nibble_words(qs + vec_offset(v, tile_qs) + k / 2 * PAIR);
        if constexpr (PAIR == Q5_PAIR)
          w[v] = add_fifth_words(w[v], load_fifth(fifth + fifth_offset(v, tile_qs) + k / 2 * PAIR));
      }
      UNROLL for (int j = 0; j < MB; ++j) {
        const vint x = broadcast2(xq + (m0 + j) * K + k);
        UNROLL for (int v = 0; v < V; ++v) sum[j][v] = dot2(sum[j][v], w[v], x);
      }
    }
    add_block_sums<V, MB>(sum, dx, xs, dm, out, b, m0, blocks, tile_dm);
  }
  store_rows<V, MB>(out, y, n0, m0, N);
}

// The row kinds of rounded_q4_gemm: the activation type and bound, the bytes of qs one
// output takes per packed row (pack_q4a8's 4 weights a lane; pack_q4's 2 a byte), the block.
struct Int8Rows {
  using T = int8_t;
  static constexpr int LIMIT = 127, LANE_BYTES = 4;
  template <int V, int MB, int PAIR, typename... A>
  static void block(A... a) { q4a8_block<V, MB, PAIR>(a...); }
};
struct Int16Rows {
  using T = int16_t;
  static constexpr int LIMIT = 32767, LANE_BYTES = 1;
  template <int V, int MB, int PAIR, typename... A>
  static void block(A... a) { q4a16_block<V, MB, PAIR>(a...); }
};

// Rows::block over tile t's vectors from v0 on, rows m.. (their weights, fifth bits, scales).
template <typename Rows, int V, int MB, int PAIR, typename S>
static inline void rounded_tile(const typename Rows::T* xq, const float* dx, const float* xs,
                                const uint8_t* qs, const S* dm, float* y, int64_t t, int v0,
                                int64_t m, int64_t K, int64_t N) {
  const uint8_t* q = qs + t * (K / 2 * PAIR);
  Rows::template block<V, MB, PAIR>(xq, dx, xs, q + v0 * LANES * Rows::LANE_BYTES,
                                    q + FIFTH_AT + v0 * LANES / 4,
                                    dm + t * (K / BLOCK * 2 * TILE) + v0 * LANES, y,
                                    t * TILE + v0 * LANES, m, K, N);
}

// Round x per block (quantize_rows), then spread the tiles as q4_gemm does.
template <typename Rows, int PAIR, typename S>
static void rounded_q4_gemm(const float* x, const uint8_t* qs, const S* dm, float* y, int64_t M,
                            int64_t K, int64_t N) {
  const int64_t blocks = K / BLOCK, tiles = N / TILE;
  std::vector<typename Rows::T> xq_(M * K);
  std::vector<float> dx_(M * blocks), xs_(M * blocks);
  quantize_rows<typename Rows::T, Rows::LIMIT>(x, xq_.data(), dx_.data(), xs_.data(), M, K);
  const typename Rows::T* xq = xq_.data();
  const float *dx = dx_.data(), *xs = xs_.data();
  over_tiles(
      M, tiles,
      [&](int64_t t) { rounded_tile<Rows, 2 * VPT, 1, PAIR>(xq, dx, xs, qs, dm, y, t, 0, 0, K, N); },
      [&](int64_t t) { rounded_tile<Rows, VPT, 1, PAIR>(xq, dx, xs, qs, dm, y, t, 0, 0, K, N); },
      [&](int64_t t) {
        int64_t m = 0;
        if constexpr (ACCUMULATORS >= 16)  // 8 rows x a whole tile: weights unpacked once
          for (; M - m >= 8; m += 8)
            rounded_tile<Rows, VPT, 8, PAIR>(xq, dx, xs, qs, dm, y, t, 0, m, K, N);
        for (; M - m >= 4; m += 4)
          for (int v0 = 0; v0 < VPT; v0 += 2)
            rounded_tile<Rows, 2, 4, PAIR>(xq, dx, xs, qs, dm, y, t, v0, m, K, N);
        for (; M - m >= 2; m += 2)
          rounded_tile<Rows, VPT, 2, PAIR>(xq, dx, xs, qs, dm, y, t, 0, m, K, N);
        if (M - m == 1) rounded_tile<Rows, VPT, 1, PAIR>(xq, dx, xs, qs, dm, y, t, 0, m, K, N);
      });
}

void q4a8_gemm(const float* x, const uint8_t* qs, const uint16_t* dm, float* y, int64_t M,
               int64_t K, int64_t N) {
  rounded_q4_gemm<Int8Rows, Q4_PAIR>(x, qs, dm, y, M, K, N);
}

void q4a8_gemm(const float* x, const uint8_t* qs, const float* dm, float* y, int64_t M,
               int64_t K, int64_t N) {
  rounded_q4_gemm<Int8Rows, Q4_PAIR>(x, qs, dm, y, M, K, N);
}

void q4a16_gemm(const float* x, const uint8_t* qs, const uint16_t* dm, float* y, int64_t M,
                int64_t K, int64_t N) {
  rounded_q4_gemm<Int16Rows, Q4_PAIR>(x, qs, dm, y, M, K, N);
}

void q4a16_gemm(const float* x, const uint8_t* qs, const float* dm, float* y, int64_t M,
                int64_t K, int64_t N) {
  rounded_q4_gemm<Int16Rows, Q4_PAIR>(x, qs, dm, y, M, K, N);
}

void q5a16_gemm(const float* x, const uint8_t* qs, const uint16_t* dm, float* y, int64_t M,
                int64_t K, int64_t N) {
  rounded_q4_gemm<Int16Rows, Q5_PAIR>(x, qs, dm, y, M, K, N);
}

void q5a16_gemm(const float* x, const uint8_t* qs, const float* dm, float* y, int64_t M,
                int64_t K, int64_t N) {
  rounded_q4_gemm<Int16Rows, Q5_PAIR>(x, qs, dm, y, M, K, N);
}
