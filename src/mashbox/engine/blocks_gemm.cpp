#include "cpu_kernels.h"

#include <cmath>

// y[M, N] = x[M, K] . W^T with W a GGUF file's own blocks of 32 weights, not re-quantized,
// float32 activations. Per output and block the kernels sum q * x in k order, then scale:
// - Q4_0 / Q4_1 (q4_gemm): w = q * d + m (q in 0..15, d and m fp16; Q4_0's (q - 8) * d is
//   m = -8 d): out += d * sum + m * sum(x over the block). 0.625 bytes a weight. Q4_K's
//   groups of 32 (int4.py repacks them: d * sc and -dmin * mn, exact in float32 but not
//   always in fp16) take the same kernels with float32 d and m (S = float): 0.75 bytes.
// - Q5_0 / Q5_1 / Q5_K (q5_gemm): the same with q in 0..31, a fifth bit beside the nibbles
//   (Q5_0: m = -16 d). 0.75 bytes a weight (0.875 with Q5_K's float32 d and m).
// - Q8_0 (q8_gemm): w = q * d (q int8, d fp16): out += d * sum. 1.06 bytes a weight. Q6_K
//   (and a matrix mixing it with Q8_0, Q5_0 or Q4_0 parts) as int8 q - 32 in groups of 16
//   with float32 d * sc (exact): 1.25 bytes.
// With activations rounded to integers (rounded_gemm.cpp) the K-quants' scales are also read
// as stored (Q4_K: 0.58 bytes a weight) and Q6_K's six bits (q6a16: 0.82).
// All give the file's weights exactly (x = identity reads them back bit for bit). Like
// int8_gemm.cpp every output has one order of operations whatever M is, so a row's bits do
// not depend on the batch. (The Q4 and Q5 blocks times activations rounded to integers,
// q4a8, q4a16, q5a8 and q5a16: rounded_gemm.cpp.)
//
// Packed (pack_q4, pack_q5, pack_q8 in cpu_kernels.py) in tiles of 32 outputs: Q4 and Q5
// qs[N / 32][K / 8][128 or 160], a record per 8 weights (cpu_kernels.h: 4 bytes of nibbles an
// output, then Q5's fifth bits), and dm[N / 32][K / 32][2][32] fp16 (or float32), each
// block's d then m; Q8 qs[N / 32][K][32] int8 and d[N / 32][K / G][32], G = 32 (fp16) or 16
// (float32).

#define UNROLL _Pragma("GCC unroll 16")

static constexpr int64_t TILE = TILE_LANES, BLOCK = 32;

// V vectors of LANES outputs for MB rows: vectors v0.. of the tile at qs (V = 2 * VPT spans
// two tiles), whose scales start at dm; RECORD: Q4_RECORD or Q5_RECORD (cpu_kernels.h).
template <int V, int MB, typename S, int RECORD>
static inline void q4_block(const float* x, const float* xsum, const uint8_t* qs, int v0,
                            const S* dm, int derived_m, float* y, int64_t n0, int64_t m0,
                            int64_t K, int64_t N) {
  const int64_t blocks = K / BLOCK, tile_qs = K / 8 * RECORD, per_block = scales_per_block(derived_m),
                tile_dm = blocks * per_block * TILE;
  alignas(64) float out[MB][V * LANES] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    // The block's even and odd weights in separate sums (two FMA chains a vector instead of
    // one), each in k order, added at the block's end: the same order for every MB.
    vfloat even[MB][V], odd[MB][V];
    UNROLL for (int j = 0; j < MB; ++j)
      UNROLL for (int v = 0; v < V; ++v) even[j][v] = odd[j][v] = vzero();
    UNROLL for (int group = 0; group < BLOCK / 8; ++group) {
      const int64_t g = b * BLOCK / 8 + group;
      vint low[V], high[V];
      UNROLL for (int v = 0; v < V; ++v)
        weight_bytes<RECORD>(qs, v0 + v, g, tile_qs, low[v], high[v]);
      UNROLL for (int i = 0; i < 8; i += 2) {  // weights k and k + 1 of the group
        const int64_t k = 8 * g + i;
        // Widened once for all MB rows. (The same sums in the same order either way; one row
        // takes each vector's weights as it goes instead, to keep its sums in registers.)
        auto weight = [&](int v, int at) {
          return byte_float(at < 4 ? low[v] : high[v], at % 4);
        };
        if constexpr (MB == 1) {
          const vfloat x0 = vbroadcast(x + m0 * K + k), x1 = vbroadcast(x + m0 * K + k + 1);
          UNROLL for (int v = 0; v < V; ++v) {
            even[0][v] = vfma(weight(v, i), x0, even[0][v]);
            odd[0][v] = vfma(weight(v, i + 1), x1, odd[0][v]);
          }
        } else {
          vfloat w0[V], w1[V];
          UNROLL for (int v = 0; v < V; ++v) w0[v] = weight(v, i), w1[v] = weight(v, i + 1);
          UNROLL for (int j = 0; j < MB; ++j) {
            const vfloat x0 = vbroadcast(x + (m0 + j) * K + k);
            UNROLL for (int v = 0; v < V; ++v) even[j][v] = vfma(w0[v], x0, even[j][v]);
            const vfloat x1 = vbroadcast(x + (m0 + j) * K + k + 1);
            UNROLL for (int v = 0; v < V; ++v) odd[j][v] = vfma(w1[v], x1, odd[j][v]);
          }
        }
      }
    }
    vfloat in[MB][V];
    UNROLL for (int j = 0; j < MB; ++j)
      UNROLL for (int v = 0; v < V; ++v) in[j][v] = vadd(even[j][v], odd[j][v]);
    UNROLL for (int v = 0; v < V; ++v) {
      vfloat d, m;
      block_scales(dm + vec_offset(v, tile_dm) + b * per_block * TILE, derived_m, d, m);
      UNROLL for (int j = 0; j < MB; ++j) {
        vfloat o = vfma(d, in[j][v], vload(out[j] + v * LANES));
        o = vfma(m, vbroadcast(xsum + (m0 + j) * blocks + b), o);
        vstore(out[j] + v * LANES, o);
      }
    }
  }
  store_rows<V, MB>(out, y, n0, m0, N);
}

// q4_block over tile t's vectors from v0 on, rows m.. (their records and scales).
template <int V, int MB, typename S, int RECORD>
static inline void q4_tile(const float* x, const float* xs, const uint8_t* qs, const S* dm,
                           int derived_m, float* y, int64_t t, int v0, int64_t m, int64_t K,
                           int64_t N) {
  const int64_t tile_dm = K / BLOCK * scales_per_block(derived_m) * TILE;
  q4_block<V, MB, S, RECORD>(x, xs, qs + t * (K / 8 * RECORD), v0,
                             dm + t * tile_dm + v0 * LANES, derived_m, y, t * TILE + v0 * LANES,
                             m, K, N);
}

template <typename S, int RECORD>
static void q4_gemm_of(const float* x, const uint8_t* qs, const S* dm, float* y, int64_t M,
                       int64_t K, int64_t N, int derived_m) {
  const int64_t blocks = K / BLOCK, tiles = N / TILE;
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
      [&](int64_t t) { q4_tile<2 * VPT, 1, S, RECORD>(x, xs, qs, dm, derived_m, y, t, 0, 0, K, N); },
      [&](int64_t t) { q4_tile<VPT, 1, S, RECORD>(x, xs, qs, dm, derived_m, y, t, 0, 0, K, N); },
      [&](int64_t t) {
        int64_t m = 0;
        if constexpr (ACCUMULATORS >= 16)  // 8 rows x a whole tile: weights widened once
          for (; M - m >= 8; m += 8)
            for (int v0 = 0; v0 < VPT; ++v0)
              q4_tile<1, 8, S, RECORD>(x, xs, qs, dm, derived_m, y, t, v0, m, K, N);
        for (; M - m >= 4; m += 4)
          for (int v0 = 0; v0 < VPT; v0 += 2)
            q4_tile<2, 4, S, RECORD>(x, xs, qs, dm, derived_m, y, t, v0, m, K, N);
        for (; M - m >= 2; m += 2)
          q4_tile<VPT, 2, S, RECORD>(x, xs, qs, dm, derived_m, y, t, 0, m, K, N);
        if (M - m == 1) q4_tile<VPT, 1, S, RECORD>(x, xs, qs, dm, derived_m, y, t, 0, m, K, N);
      });
}

void q4_gemm(const float* x, const uint8_t* qs, const uint16_t* dm, float* y, int64_t M,
             int64_t K, int64_t N, int derived_m) {
  q4_gemm_of<uint16_t, Q4_RECORD>(x, qs, dm, y, M, K, N, derived_m);
}

void q4_gemm(const float* x, const uint8_t* qs, const float* dm, float* y, int64_t M, int64_t K,
             int64_t N, int derived_m) {
  q4_gemm_of<float, Q4_RECORD>(x, qs, dm, y, M, K, N, derived_m);
}

void q5_gemm(const float* x, const uint8_t* qs, const uint16_t* dm, float* y, int64_t M,
             int64_t K, int64_t N, int derived_m) {
  q4_gemm_of<uint16_t, Q5_RECORD>(x, qs, dm, y, M, K, N, derived_m);
}

void q5_gemm(const float* x, const uint8_t* qs, const float* dm, float* y, int64_t M, int64_t K,
             int64_t N, int derived_m) {
  q4_gemm_of<float, Q5_RECORD>(x, qs, dm, y, M, K, N, derived_m);
}

// ---- Q8_0 -------------------------------------------------------------------------------

// G: the weights a scale covers (32, fp16 d; or 16, float32), S its type.
template <int V, int MB, int G, typename S>
static inline void q8_block(const float* x, const int8_t* qs, const S* ds, float* y, int64_t n0,
                            int64_t m0, int64_t K, int64_t N) {
  const int64_t groups = K / G, tile_qs = K * TILE, tile_d = groups * TILE;
  alignas(64) float out[MB][V * LANES] = {};
  for (int64_t b = 0; b < groups; ++b) {
    vfloat in[MB][V];
    UNROLL for (int j = 0; j < MB; ++j)
      UNROLL for (int v = 0; v < V; ++v) in[j][v] = vzero();
    prefetch_pairs<V, G>(qs, b, tile_qs);
    for (int64_t k = b * G; k < (b + 1) * G; k += 2) {
      vfloat x0[MB], x1[MB];
      UNROLL for (int j = 0; j < MB; ++j) {
        x0[j] = vbroadcast(x + (m0 + j) * K + k);
        x1[j] = vbroadcast(x + (m0 + j) * K + k + 1);
      }
      UNROLL for (int v = 0; v < V; ++v) {  // one sum a lane, in k order
        const vint pairs = widen_pairs(qs + pair_offset(v, k, tile_qs));
        const vfloat w0 = low_word_float(pairs), w1 = high_word_float(pairs);
        UNROLL for (int j = 0; j < MB; ++j) in[j][v] = vfma(w1, x1[j], vfma(w0, x0[j], in[j][v]));
      }
    }
    UNROLL for (int v = 0; v < V; ++v) {
      const vfloat d = load_scales(ds + vec_offset(v, tile_d) + b * TILE);
      UNROLL for (int j = 0; j < MB; ++j)
        vstore(out[j] + v * LANES, vfma(d, in[j][v], vload(out[j] + v * LANES)));
    }
  }
  store_rows<V, MB>(out, y, n0, m0, N);
}

template <int G, typename S>
static void q8_gemm_of(const float* x, const int8_t* qs, const S* ds, float* y, int64_t M,
                       int64_t K, int64_t N) {
  const int64_t tile_qs = K * TILE, tile_d = K / G * TILE;
  q8_tiles(M, N / TILE, [&](auto v, auto rows, int64_t t, int v0, int64_t m) {
    q8_block<decltype(v)::value, decltype(rows)::value, G>(
        x, qs + t * tile_qs + v0 * LANES * 2, ds + t * tile_d + v0 * LANES, y,
        t * TILE + v0 * LANES, m, K, N);
  });
}

void q8_gemm(const float* x, const int8_t* qs, const uint16_t* ds, float* y, int64_t M,
             int64_t K, int64_t N) {
  q8_gemm_of<32>(x, qs, ds, y, M, K, N);
}

void q8_gemm(const float* x, const int8_t* qs, const float* ds, float* y, int64_t M, int64_t K,
             int64_t N) {
  q8_gemm_of<16>(x, qs, ds, y, M, K, N);
}

template <typename S>
using Q4Gemm = void (*)(const float*, const uint8_t*, const S*, float*, int64_t, int64_t, int64_t,
                        int);

// The kernels for one kind of activations: Q4 and Q5 weights, fp16 or float32 scales, or the
// K-quants' as stored (rounded activations only: null for float32 ones).
struct Q4Kernels {
  Q4Gemm<uint16_t> q4_half;
  Q4Gemm<float> q4_single;
  Q4Gemm<uint16_t> q5_half;
  Q4Gemm<float> q5_single;
  Q4Gemm<uint8_t> q4_k = nullptr;
  Q4Gemm<uint8_t> q5_k = nullptr;
};

// y = x . W^T by one of the Q4 or Q5 kernels, after checking qs and dm are what it reads:
// pack_q4's qs [N / 32][K / 8][128] or pack_q5's [N / 32][K / 8][160]; dm pack_q4's, fp16 or
// float32, [N / 32][K / 32][2][32] (d and m) or [..][1][32] (d alone: Q4_0's m = -8 d, Q5_0's
// -16 d), or pack_k_scales' uint8 [N / 32][K / 256][K_SCALES].
static at::Tensor q4_call(const Q4Kernels& kernels, at::Tensor x, at::Tensor qs,
                          at::Tensor dm) {
  const bool k_scales = dm.dtype() == at::kByte;
  TORCH_CHECK(x.dtype() == at::kFloat && qs.dtype() == at::kByte &&
              (dm.dtype() == at::kHalf || dm.dtype() == at::kFloat || k_scales));
  TORCH_CHECK(x.is_contiguous() && qs.is_contiguous() && dm.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0) * TILE;
  const bool q5 = qs.dim() == 3 && qs.size(2) == Q5_RECORD;
  TORCH_CHECK(K % BLOCK == 0 && qs.dim() == 3 && qs.size(1) * 8 == K &&
                  (qs.size(2) == Q4_RECORD || q5),
              "qs must be packed by pack_q4 or pack_q5 for K = ", K);
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* q = qs.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (k_scales) {
    TORCH_CHECK(kernels.q4_k != nullptr, "the K-quants' scales as stored need rounded activations");
    TORCH_CHECK(dm.dim() == 3 && dm.size(0) == qs.size(0) && dm.size(1) * K_SUPER == K &&
                    dm.size(2) == K_SCALES,
                "dm must be packed by pack_k_scales for K = ", K);
    (q5 ? kernels.q5_k : kernels.q4_k)(xp, q, dm.data_ptr<uint8_t>(), yp, M, K, N, 0);
    return y;
  }
  TORCH_CHECK(dm.dim() == 4 && dm.size(0) == qs.size(0) && dm.size(1) * BLOCK == K &&
                  (dm.size(2) == 1 || dm.size(2) == 2) && dm.size(3) == TILE,
              "dm must be packed by pack_q4 or pack_q5 for K = ", K);
  const int derived_m = dm.size(2) == 1 ? (q5 ? 16 : 8) : 0;
  if (dm.dtype() == at::kFloat) {
    (q5 ? kernels.q5_single : kernels.q4_single)(xp, q, dm.data_ptr<float>(), yp, M, K, N,
                                                 derived_m);
  } else {
    const auto* d = reinterpret_cast<const uint16_t*>(dm.data_ptr<at::Half>());
    (q5 ? kernels.q5_half : kernels.q4_half)(xp, q, d, yp, M, K, N, derived_m);
  }
  return y;
}

at::Tensor q4_linear(at::Tensor x, at::Tensor qs, at::Tensor dm) {
  return q4_call({q4_gemm, q4_gemm, q5_gemm, q5_gemm}, x, qs, dm);
}

at::Tensor q4a16_linear(at::Tensor x, at::Tensor qs, at::Tensor dm) {
  return q4_call({q4a16_gemm, q4a16_gemm, q5a16_gemm, q5a16_gemm, q4a16_gemm, q5a16_gemm}, x,
                 qs, dm);
}

at::Tensor q4a8_linear(at::Tensor x, at::Tensor qs, at::Tensor dm) {
  return q4_call({q4a8_gemm, q4a8_gemm, q5a8_gemm, q5a8_gemm, q4a8_gemm, q5a8_gemm}, x, qs, dm);
}

// Q8 blocks: int8 qs [N / 32][K / 2][64] (pack_q8) and d [N / 32][K / 32][32] fp16 (Q8_0's) or
// [N / 32][K / 16][32] float32 (groups of 16: Q6_K's d * sc); float32 activations, or
// (int16) rounded per block of 32.
static at::Tensor q8_call(bool int16, at::Tensor x, at::Tensor qs, at::Tensor d) {
  const bool sixteen = d.dtype() == at::kFloat;
  TORCH_CHECK(x.dtype() == at::kFloat && qs.dtype() == at::kChar &&
              (sixteen || d.dtype() == at::kHalf));
  TORCH_CHECK(x.is_contiguous() && qs.is_contiguous() && d.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0) * TILE, G = sixteen ? 16 : BLOCK;
  TORCH_CHECK(K % BLOCK == 0 && qs.dim() == 3 && qs.size(1) * 2 == K && qs.size(2) == 2 * TILE &&
              d.dim() == 3 && d.size(0) == qs.size(0) && d.size(1) * G == K,
              "qs/d must be packed by pack_q8 for K = ", K);
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* q = qs.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  if (sixteen) {
    const float* ds = d.data_ptr<float>();
    int16 ? q8a16_gemm(xp, q, ds, yp, M, K, N) : q8_gemm(xp, q, ds, yp, M, K, N);
  } else {
    const auto* ds = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
    int16 ? q8a16_gemm(xp, q, ds, yp, M, K, N) : q8_gemm(xp, q, ds, yp, M, K, N);
  }
  return y;
}

at::Tensor q8_linear(at::Tensor x, at::Tensor qs, at::Tensor d) {
  return q8_call(false, x, qs, d);
}

at::Tensor q8a16_linear(at::Tensor x, at::Tensor qs, at::Tensor d) {
  return q8_call(true, x, qs, d);
}

// Q6 blocks (pack_q6): qs uint8 [N / 32][K / 8][192] and scales uint8 [N / 32][K / 256][576],
// activations rounded to int16 per block of 32.
at::Tensor q6a16_linear(at::Tensor x, at::Tensor qs, at::Tensor scales) {
  TORCH_CHECK(x.dtype() == at::kFloat && qs.dtype() == at::kByte &&
              scales.dtype() == at::kByte);
  TORCH_CHECK(x.is_contiguous() && qs.is_contiguous() && scales.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0) * TILE;
  TORCH_CHECK(K % Q6_SUPER == 0 && qs.dim() == 3 && qs.size(1) * 8 == K &&
                  qs.size(2) == Q6_RECORD && scales.dim() == 3 &&
                  scales.size(0) == qs.size(0) && scales.size(1) * Q6_SUPER == K &&
                  scales.size(2) == Q6_SCALES,
              "qs/scales must be packed by pack_q6 for K = ", K);
  auto y = at::empty({M, N}, x.options());
  q6a16_gemm(x.data_ptr<float>(), qs.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(),
             y.data_ptr<float>(), M, K, N);
  return y;
}
