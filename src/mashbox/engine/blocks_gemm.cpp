#include "cpu_kernels.h"

#include <cmath>

// y[M, N] = x[M, K] . W^T with W a GGUF file's own blocks of 32 weights, not re-quantized,
// float32 activations. Per output and block the kernels sum q * x in k order, then scale:
// - Q4_0 / Q4_1 (q4_gemm): w = q * d + m (q in 0..15, d and m fp16; Q4_0's (q - 8) * d is
//   m = -8 d): out += d * sum + m * sum(x over the block). 0.625 bytes a weight.
// - Q8_0 (q8_gemm): w = q * d (q int8, d fp16): out += d * sum. 1.06 bytes a weight.
// Both give the file's weights exactly (x = identity reads them back bit for bit). Like
// int8_gemm.cpp every output has one order of operations whatever M is, so a row's bits do
// not depend on the batch.
//
// Packed (pack_q4, pack_q8 in cpu_kernels.py) in tiles of 32 outputs: Q4 qs[N / 32][K / 2][32]
// bytes holding weights k (low nibble) and k + 1 (high) of an output and dm[N / 32][K / 32]
// [2][32] fp16, each block's d then m; Q8 qs[N / 32][K][32] int8 and d[N / 32][K / 32][32].

#define UNROLL _Pragma("GCC unroll 16")

static constexpr int64_t TILE = TILE_LANES, BLOCK = 32;

// The finished sums of MB rows x V vectors into y (out: [MB][V * LANES], vectors as in blocks).
template <int V, int MB>
static inline void store(const float (&out)[MB][V * LANES], float* y, int64_t n0, int64_t m0,
                         int64_t N) {
  UNROLL for (int j = 0; j < MB; ++j)
    UNROLL for (int v = 0; v < V; ++v)
      vstoreu(y + (m0 + j) * N + n0 + vec_offset(v, TILE), vload(out[j] + v * LANES));
}

// V vectors of LANES outputs (vec_offset: V = 2 * VPT spans two tiles) for MB rows.
template <int V, int MB>
static inline void q4_block(const float* x, const float* xsum, const uint8_t* qs,
                            const uint16_t* dm, float* y, int64_t n0, int64_t m0, int64_t K,
                            int64_t N) {
  const int64_t blocks = K / BLOCK, tile_qs = K / 2 * TILE, tile_dm = blocks * 2 * TILE;
  alignas(64) float out[MB][V * LANES] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    // The block's even and odd weights in separate sums (two FMA chains a vector instead of
    // one), added at the block's end: the same order for every MB.
    vfloat even[MB][V], odd[MB][V];
    UNROLL for (int j = 0; j < MB; ++j)
      UNROLL for (int v = 0; v < V; ++v) even[j][v] = odd[j][v] = vzero();
    for (int64_t kp = 0; kp < BLOCK / 2; ++kp) {
      const int64_t k = b * BLOCK + 2 * kp;
      // Weights k and k + 1 of V vectors, widened once for all MB rows. (The same sums in
      // the same order either way; one row takes each vector's pair as it goes instead, to
      // keep its accumulators in registers.)
      auto pairs = [&](int v) { return widen_u8(qs + vec_offset(v, tile_qs) + (k / 2) * TILE); };
      if constexpr (MB == 1) {
        const vfloat x0 = vbroadcast(x + m0 * K + k), x1 = vbroadcast(x + m0 * K + k + 1);
        UNROLL for (int v = 0; v < V; ++v) {
          const vint q = pairs(v);
          even[0][v] = vfma(low_nibble_float(q), x0, even[0][v]);
          odd[0][v] = vfma(high_nibble_float(q), x1, odd[0][v]);
        }
      } else {
        vfloat w0[V], w1[V];
        UNROLL for (int v = 0; v < V; ++v) {
          const vint q = pairs(v);
          w0[v] = low_nibble_float(q);
          w1[v] = high_nibble_float(q);
        }
        UNROLL for (int j = 0; j < MB; ++j) {
          const vfloat x0 = vbroadcast(x + (m0 + j) * K + k);
          UNROLL for (int v = 0; v < V; ++v) even[j][v] = vfma(w0[v], x0, even[j][v]);
          const vfloat x1 = vbroadcast(x + (m0 + j) * K + k + 1);
          UNROLL for (int v = 0; v < V; ++v) odd[j][v] = vfma(w1[v], x1, odd[j][v]);
        }
      }
    }
    vfloat in[MB][V];
    UNROLL for (int j = 0; j < MB; ++j)
      UNROLL for (int v = 0; v < V; ++v) in[j][v] = vadd(even[j][v], odd[j][v]);
    UNROLL for (int v = 0; v < V; ++v) {
      const uint16_t* s = dm + vec_offset(v, tile_dm) + b * 2 * TILE;
      const vfloat d = from_half(s), m = from_half(s + TILE);
      UNROLL for (int j = 0; j < MB; ++j) {
        vfloat o = vfma(d, in[j][v], vload(out[j] + v * LANES));
        o = vfma(m, vbroadcast(xsum + (m0 + j) * blocks + b), o);
        vstore(out[j] + v * LANES, o);
      }
    }
  }
  store<V, MB>(out, y, n0, m0, N);
}

void q4_gemm(const float* x, const uint8_t* qs, const uint16_t* dm, float* y, int64_t M,
             int64_t K, int64_t N) {
  const int64_t blocks = K / BLOCK, tiles = N / TILE;
  const int64_t tile_qs = K / 2 * TILE, tile_dm = blocks * 2 * TILE;
  // Each row's block sums, once a call (the same for every output).
  std::vector<float> xsum(M * blocks);
  for (int64_t r = 0; r < M * blocks; ++r) {
    float s = 0.0f;
    for (int64_t k = 0; k < BLOCK; ++k) s += x[r * BLOCK + k];
    xsum[r] = s;
  }
  const float* xs = xsum.data();
  over_tiles(
      M, tiles,
      [&](int64_t t) {
        q4_block<2 * VPT, 1>(x, xs, qs + t * tile_qs, dm + t * tile_dm, y, t * TILE, 0, K, N);
      },
      [&](int64_t t) {
        q4_block<VPT, 1>(x, xs, qs + t * tile_qs, dm + t * tile_dm, y, t * TILE, 0, K, N);
      },
      [&](int64_t t) {
        const uint8_t* q = qs + t * tile_qs;
        const uint16_t* s = dm + t * tile_dm;
        int64_t m = 0;
        if constexpr (ACCUMULATORS >= 16)  // 8 rows x a whole tile: weights widened once
          for (; M - m >= 8; m += 8)
            for (int v0 = 0; v0 < VPT; ++v0)
              q4_block<1, 8>(x, xs, q + v0 * LANES, s + v0 * LANES, y, t * TILE + v0 * LANES, m,
                             K, N);
        for (; M - m >= 4; m += 4)
          for (int v0 = 0; v0 < VPT; v0 += 2)
            q4_block<2, 4>(x, xs, q + v0 * LANES, s + v0 * LANES, y, t * TILE + v0 * LANES, m,
                           K, N);
        for (; M - m >= 2; m += 2) q4_block<VPT, 2>(x, xs, q, s, y, t * TILE, m, K, N);
        if (M - m == 1) q4_block<VPT, 1>(x, xs, q, s, y, t * TILE, m, K, N);
      });
}

// ---- Q8_0 -------------------------------------------------------------------------------

template <int V, int MB>
static inline void q8_block(const float* x, const int8_t* qs, const uint16_t* ds, float* y,
                            int64_t n0, int64_t m0, int64_t K, int64_t N) {
  const int64_t blocks = K / BLOCK, tile_qs = K * TILE, tile_d = blocks * TILE;
  alignas(64) float out[MB][V * LANES] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    vfloat in[MB][V];
    UNROLL for (int j = 0; j < MB; ++j)
      UNROLL for (int v = 0; v < V; ++v) in[j][v] = vzero();
    for (int64_t k = b * BLOCK; k < (b + 1) * BLOCK; ++k) {
      vfloat xk[MB];
      UNROLL for (int j = 0; j < MB; ++j) xk[j] = vbroadcast(x + (m0 + j) * K + k);
      UNROLL for (int v = 0; v < V; ++v) {
        const vfloat w = to_float(widen_i8(qs + vec_offset(v, tile_qs) + k * TILE));
        UNROLL for (int j = 0; j < MB; ++j) in[j][v] = vfma(w, xk[j], in[j][v]);
      }
    }
    UNROLL for (int v = 0; v < V; ++v) {
      const vfloat d = from_half(ds + vec_offset(v, tile_d) + b * TILE);
      UNROLL for (int j = 0; j < MB; ++j)
        vstore(out[j] + v * LANES, vfma(d, in[j][v], vload(out[j] + v * LANES)));
    }
  }
  store<V, MB>(out, y, n0, m0, N);
}

void q8_gemm(const float* x, const int8_t* qs, const uint16_t* ds, float* y, int64_t M,
             int64_t K, int64_t N) {
  const int64_t tiles = N / TILE, tile_qs = K * TILE, tile_d = K / BLOCK * TILE;
  over_tiles(
      M, tiles,
      [&](int64_t t) {
        q8_block<2 * VPT, 1>(x, qs + t * tile_qs, ds + t * tile_d, y, t * TILE, 0, K, N);
      },
      [&](int64_t t) {
        q8_block<VPT, 1>(x, qs + t * tile_qs, ds + t * tile_d, y, t * TILE, 0, K, N);
      },
      [&](int64_t t) {
        const int8_t* q = qs + t * tile_qs;
        const uint16_t* s = ds + t * tile_d;
        int64_t m = 0;
        if constexpr (ACCUMULATORS >= 16)
          for (; M - m >= 8; m += 8) q8_block<VPT, 8>(x, q, s, y, t * TILE, m, K, N);
        for (; M - m >= 4; m += 4)
          for (int v0 = 0; v0 < VPT; v0 += 2)
            q8_block<2, 4>(x, q + v0 * LANES, s + v0 * LANES, y, t * TILE + v0 * LANES, m, K, N);
        for (; M - m >= 1; ++m) q8_block<VPT, 1>(x, q, s, y, t * TILE, m, K, N);
      });
}

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
template <int V, int MB>
static inline void add_block_sums(const vint (&sum)[MB][V], const float* dx, const float* xs,
                                  const uint16_t* dm, float (&out)[MB][V * LANES], int64_t b,
                                  int64_t m0, int64_t blocks, int64_t tile_dm) {
  UNROLL for (int v = 0; v < V; ++v) {
    const uint16_t* s = dm + vec_offset(v, tile_dm) + b * 2 * TILE;
    const vfloat d = from_half(s), m = from_half(s + TILE);
    UNROLL for (int j = 0; j < MB; ++j) {
      const int64_t at = (m0 + j) * blocks + b;
      const vfloat qx = vmul(to_float(sum[j][v]), vbroadcast(dx + at));
      vfloat o = vfma(d, qx, vload(out[j] + v * LANES));
      o = vfma(m, vbroadcast(xs + at), o);
      vstore(out[j] + v * LANES, o);
    }
  }
}

template <int V, int MB>
static inline void q4a8_block(const int8_t* xq, const float* dx, const float* xs,
                              const uint8_t* qs, const uint16_t* dm, float* y, int64_t n0,
                              int64_t m0, int64_t K, int64_t N) {
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
  store<V, MB>(out, y, n0, m0, N);
}

// ---- Q4 x int16 activations (q4a16) --------------------------------------------------------
// As q4a8 with activations in int16 per block (dx = max|x| / 32767) and pack_q4's layout:
// each lane holds an output's weights k and k + 1 as two words (nibble_words), times the
// row's xq[k], xq[k + 1] (dot2). Block sums stay below 32 * 15 * 32767 < 2^31.

template <int V, int MB>
static inline void q4a16_block(const int16_t* xq, const float* dx, const float* xs,
                               const uint8_t* qs, const uint16_t* dm, float* y, int64_t n0,
                               int64_t m0, int64_t K, int64_t N) {
  const int64_t blocks = K / BLOCK, tile_qs = K / 2 * TILE, tile_dm = blocks * 2 * TILE;
  alignas(64) float out[MB][V * LANES] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    vint sum[MB][V];
    UNROLL for (int j = 0; j < MB; ++j)
      UNROLL for (int v = 0; v < V; ++v) sum[j][v] = vzero_int();
    UNROLL for (int64_t kp = 0; kp < BLOCK / 2; ++kp) {
      const int64_t k = b * BLOCK + 2 * kp;
      vint w[V];
      UNROLL for (int v = 0; v < V; ++v)
        w[v] = nibble_words(qs + vec_offset(v, tile_qs) + k / 2 * TILE);
      UNROLL for (int j = 0; j < MB; ++j) {
        const vint x = broadcast2(xq + (m0 + j) * K + k);
        UNROLL for (int v = 0; v < V; ++v) sum[j][v] = dot2(sum[j][v], w[v], x);
      }
    }
    add_block_sums<V, MB>(sum, dx, xs, dm, out, b, m0, blocks, tile_dm);
  }
  store<V, MB>(out, y, n0, m0, N);
}

// The row kinds of rounded_q4_gemm: the activation type and bound, the bytes of qs one
// output takes per packed row (pack_q4a8's 4 weights a lane; pack_q4's 2 a byte), the block.
struct Int8Rows {
  using T = int8_t;
  static constexpr int LIMIT = 127, LANE_BYTES = 4;
  template <int V, int MB, typename... A>
  static void block(A... a) { q4a8_block<V, MB>(a...); }
};
struct Int16Rows {
  using T = int16_t;
  static constexpr int LIMIT = 32767, LANE_BYTES = 1;
  template <int V, int MB, typename... A>
  static void block(A... a) { q4a16_block<V, MB>(a...); }
};

// Round x per block (quantize_rows), then spread the tiles as q4_gemm does.
template <typename Rows>
static void rounded_q4_gemm(const float* x, const uint8_t* qs, const uint16_t* dm, float* y,
                            int64_t M, int64_t K, int64_t N) {
  const int64_t blocks = K / BLOCK, tiles = N / TILE;
  const int64_t tile_qs = K / 2 * TILE, tile_dm = blocks * 2 * TILE;
  std::vector<typename Rows::T> xq_(M * K);
  std::vector<float> dx_(M * blocks), xs_(M * blocks);
  quantize_rows<typename Rows::T, Rows::LIMIT>(x, xq_.data(), dx_.data(), xs_.data(), M, K);
  const typename Rows::T* xq = xq_.data();
  const float *dx = dx_.data(), *xs = xs_.data();
  over_tiles(
      M, tiles,
      [&](int64_t t) {
        Rows::template block<2 * VPT, 1>(xq, dx, xs, qs + t * tile_qs, dm + t * tile_dm, y,
                                         t * TILE, int64_t{0}, K, N);
      },
      [&](int64_t t) {
        Rows::template block<VPT, 1>(xq, dx, xs, qs + t * tile_qs, dm + t * tile_dm, y,
                                     t * TILE, int64_t{0}, K, N);
      },
      [&](int64_t t) {
        const uint8_t* q = qs + t * tile_qs;
        const uint16_t* s = dm + t * tile_dm;
        int64_t m = 0;
        if constexpr (ACCUMULATORS >= 16)  // 8 rows x a whole tile: weights unpacked once
          for (; M - m >= 8; m += 8)
            Rows::template block<VPT, 8>(xq, dx, xs, q, s, y, t * TILE, m, K, N);
        for (; M - m >= 4; m += 4)
          for (int v0 = 0; v0 < VPT; v0 += 2)
            Rows::template block<2, 4>(xq, dx, xs, q + v0 * LANES * Rows::LANE_BYTES,
                                       s + v0 * LANES, y, t * TILE + v0 * LANES, m, K, N);
        for (; M - m >= 2; m += 2)
          Rows::template block<VPT, 2>(xq, dx, xs, q, s, y, t * TILE, m, K, N);
        if (M - m == 1) Rows::template block<VPT, 1>(xq, dx, xs, q, s, y, t * TILE, m, K, N);
      });
}

void q4a8_gemm(const float* x, const uint8_t* qs, const uint16_t* dm, float* y, int64_t M,
               int64_t K, int64_t N) {
  rounded_q4_gemm<Int8Rows>(x, qs, dm, y, M, K, N);
}

void q4a16_gemm(const float* x, const uint8_t* qs, const uint16_t* dm, float* y, int64_t M,
                int64_t K, int64_t N) {
  rounded_q4_gemm<Int16Rows>(x, qs, dm, y, M, K, N);
}

using Q4Gemm = void (*)(const float*, const uint8_t*, const uint16_t*, float*, int64_t, int64_t,
                        int64_t);

// y = x . W^T by one of the Q4 kernels, after checking qs and dm are what it reads: pack_q4's
// qs [N / 32][K / 2][32] (a8 = false) or pack_q4a8's [N / 32][K / 8][32][4], dm pack_q4's.
static torch::Tensor q4_call(Q4Gemm gemm, bool a8, torch::Tensor x, torch::Tensor qs,
                             torch::Tensor dm) {
  TORCH_CHECK(x.dtype() == torch::kFloat && qs.dtype() == torch::kByte && dm.dtype() == torch::kHalf);
  TORCH_CHECK(x.is_contiguous() && qs.is_contiguous() && dm.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0) * TILE;
  const bool layout = a8 ? qs.dim() == 4 && qs.size(1) * 8 == K && qs.size(3) == 4
                         : qs.dim() == 3 && qs.size(1) * 2 == K;
  TORCH_CHECK(K % BLOCK == 0 && layout && qs.size(2) == TILE && dm.dim() == 4 &&
              dm.size(0) == qs.size(0) && dm.size(1) * BLOCK == K,
              "qs/dm must be packed by ", a8 ? "pack_q4a8" : "pack_q4", " for K = ", K);
  auto y = torch::empty({M, N}, x.options());
  gemm(x.data_ptr<float>(), qs.data_ptr<uint8_t>(),
       reinterpret_cast<const uint16_t*>(dm.data_ptr<at::Half>()), y.data_ptr<float>(), M, K, N);
  return y;
}

torch::Tensor q4_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor dm) {
  return q4_call(q4_gemm, false, x, qs, dm);
}

torch::Tensor q4a16_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor dm) {
  return q4_call(q4a16_gemm, false, x, qs, dm);
}

torch::Tensor q4a8_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor dm) {
  return q4_call(q4a8_gemm, true, x, qs, dm);
}

torch::Tensor q8_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d) {
  TORCH_CHECK(x.dtype() == torch::kFloat && qs.dtype() == torch::kChar && d.dtype() == torch::kHalf);
  TORCH_CHECK(x.is_contiguous() && qs.is_contiguous() && d.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0) * TILE;
  TORCH_CHECK(K % BLOCK == 0 && qs.dim() == 3 && qs.size(1) == K && qs.size(2) == TILE &&
              d.dim() == 3 && d.size(0) == qs.size(0) && d.size(1) * BLOCK == K,
              "qs/d must be packed by pack_q8 for K = ", K);
  auto y = torch::empty({M, N}, x.options());
  q8_gemm(x.data_ptr<float>(), qs.data_ptr<int8_t>(),
          reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>()), y.data_ptr<float>(), M, K, N);
  return y;
}
