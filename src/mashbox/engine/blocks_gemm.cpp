#include "cpu_kernels.h"

#include <cmath>

// y[M, N] = x[M, K] . W^T with W a GGUF file's own blocks of 32 weights, not re-quantized,
// float32 activations. Per output and block the kernels sum q * x in k order, then scale:
// - Q4_0 / Q4_1 (q4_gemm): w = q * d + m (q in 0..15, d and m fp16; Q4_0's (q - 8) * d is
//   m = -8 d): out += d * sum + m * sum(x over the block). 0.625 bytes a weight. Q4_K's
//   groups of 32 (int4.py repacks them: d * sc and -dmin * mn, exact in float32 but not
//   always in fp16) take the same kernels with float32 d and m (S = float): 0.75 bytes.
// - Q8_0 (q8_gemm): w = q * d (q int8, d fp16): out += d * sum. 1.06 bytes a weight.
// Both give the file's weights exactly (x = identity reads them back bit for bit). Like
// int8_gemm.cpp every output has one order of operations whatever M is, so a row's bits do
// not depend on the batch. (The Q4 blocks times activations rounded to integers, q4a8 and
// q4a16: rounded_gemm.cpp.)
//
// Packed (pack_q4, pack_q8 in cpu_kernels.py) in tiles of 32 outputs: Q4 qs[N / 32][K / 2][32]
// bytes holding weights k (low nibble) and k + 1 (high) of an output and dm[N / 32][K / 32]
// [2][32] fp16 (or float32), each block's d then m; Q8 qs[N / 32][K][32] int8 and
// d[N / 32][K / 32][32].

#define UNROLL _Pragma("GCC unroll 16")

static constexpr int64_t TILE = TILE_LANES, BLOCK = 32;

// V vectors of LANES outputs (vec_offset: V = 2 * VPT spans two tiles) for MB rows.
template <int V, int MB, typename S>
static inline void q4_block(const float* x, const float* xsum, const uint8_t* qs, const S* dm,
                            float* y, int64_t n0, int64_t m0, int64_t K,
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
      const S* s = dm + vec_offset(v, tile_dm) + b * 2 * TILE;
      const vfloat d = load_scales(s), m = load_scales(s + TILE);
      UNROLL for (int j = 0; j < MB; ++j) {
        vfloat o = vfma(d, in[j][v], vload(out[j] + v * LANES));
        o = vfma(m, vbroadcast(xsum + (m0 + j) * blocks + b), o);
        vstore(out[j] + v * LANES, o);
      }
    }
  }
  store_rows<V, MB>(out, y, n0, m0, N);
}

template <typename S>
static void q4_gemm_of(const float* x, const uint8_t* qs, const S* dm, float* y, int64_t M,
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
        const S* s = dm + t * tile_dm;
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

void q4_gemm(const float* x, const uint8_t* qs, const uint16_t* dm, float* y, int64_t M,
             int64_t K, int64_t N) {
  q4_gemm_of(x, qs, dm, y, M, K, N);
}

void q4_gemm(const float* x, const uint8_t* qs, const float* dm, float* y, int64_t M, int64_t K,
             int64_t N) {
  q4_gemm_of(x, qs, dm, y, M, K, N);
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
  store_rows<V, MB>(out, y, n0, m0, N);
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

template <typename S>
using Q4Gemm = void (*)(const float*, const uint8_t*, const S*, float*, int64_t, int64_t, int64_t);

// y = x . W^T by one of the Q4 kernels, after checking qs and dm are what it reads: pack_q4's
// qs [N / 32][K / 2][32] (a8 = false) or pack_q4a8's [N / 32][K / 8][32][4], dm pack_q4's,
// fp16 (half) or float32 (single).
static torch::Tensor q4_call(Q4Gemm<uint16_t> half, Q4Gemm<float> single, bool a8,
                             torch::Tensor x, torch::Tensor qs, torch::Tensor dm) {
  TORCH_CHECK(x.dtype() == torch::kFloat && qs.dtype() == torch::kByte &&
              (dm.dtype() == torch::kHalf || dm.dtype() == torch::kFloat));
  TORCH_CHECK(x.is_contiguous() && qs.is_contiguous() && dm.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0) * TILE;
  const bool layout = a8 ? qs.dim() == 4 && qs.size(1) * 8 == K && qs.size(3) == 4
                         : qs.dim() == 3 && qs.size(1) * 2 == K;
  TORCH_CHECK(K % BLOCK == 0 && layout && qs.size(2) == TILE && dm.dim() == 4 &&
              dm.size(0) == qs.size(0) && dm.size(1) * BLOCK == K,
              "qs/dm must be packed by ", a8 ? "pack_q4a8" : "pack_q4", " for K = ", K);
  auto y = torch::empty({M, N}, x.options());
  if (dm.dtype() == torch::kFloat)
    single(x.data_ptr<float>(), qs.data_ptr<uint8_t>(), dm.data_ptr<float>(), y.data_ptr<float>(),
           M, K, N);
  else
    half(x.data_ptr<float>(), qs.data_ptr<uint8_t>(),
         reinterpret_cast<const uint16_t*>(dm.data_ptr<at::Half>()), y.data_ptr<float>(), M, K, N);
  return y;
}

torch::Tensor q4_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor dm) {
  return q4_call(q4_gemm, q4_gemm, false, x, qs, dm);
}

torch::Tensor q4a16_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor dm) {
  return q4_call(q4a16_gemm, q4a16_gemm, false, x, qs, dm);
}

torch::Tensor q4a8_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor dm) {
  return q4_call(q4a8_gemm, q4a8_gemm, true, x, qs, dm);
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
