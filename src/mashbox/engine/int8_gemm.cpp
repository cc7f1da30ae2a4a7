#include "cpu_kernels.h"

// y[M, N] = x[M, K] . (q[N, K] * scale[N])^T for small M (decode batches): float32
// activations, int8 weights read from memory once per call whatever M is.
//
// The weights are packed in tiles of 32 output rows, k-major: p[N / 32][K][32] (pack_int8 in
// cpu_kernels.py). At each k a block loads V x LANES consecutive int8 weights, widens them to
// float and multiplies them by one broadcast activation per row, so every output has its own
// accumulator and every load is a sequential stream: one row reads ~19-22 GB/s here, the
// machine's DRAM bandwidth, and several rows keep the FMA units busy with up to 12
// accumulators.
//
// Every output is one float32 sum over k in order, whatever M is and whichever block computes
// it, then times its scale: a row's result has the same bits alone or in any batch, which
// seeded sampling relies on.

// GCC keeps an accumulator array in memory (a store per FMA) unless every loop over it is
// unrolled to constant indices.
#define UNROLL _Pragma("GCC unroll 16")

static constexpr int64_t TILE = TILE_LANES;

// V vectors of LANES outputs from n0 (vector v at w + vec_offset(v, tile_bytes), so
// V = 2 * VPT spans two tiles) for MB activation rows from m0.
template <int V, int MB>
static inline void block(const float* x, const int8_t* w, const float* scale, float* y,
                         int64_t n0, int64_t m0, int64_t K, int64_t N) {
  const int64_t tile_bytes = K * TILE;
  vfloat acc[MB][V];
  UNROLL for (int j = 0; j < MB; ++j)
    UNROLL for (int v = 0; v < V; ++v) acc[j][v] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    vfloat xk[MB];
    UNROLL for (int j = 0; j < MB; ++j) xk[j] = vbroadcast(x + (m0 + j) * K + k);
    UNROLL for (int v = 0; v < V; ++v) {
      const vfloat wv = to_float(widen_i8(w + vec_offset(v, tile_bytes) + k * TILE));
      UNROLL for (int j = 0; j < MB; ++j) acc[j][v] = vfma(wv, xk[j], acc[j][v]);
    }
  }
  UNROLL for (int j = 0; j < MB; ++j)
    UNROLL for (int v = 0; v < V; ++v) {
      const int64_t n = n0 + vec_offset(v, TILE);
      float* out = y + (m0 + j) * N + n;
      if (n + LANES <= N) {
        vstoreu(out, vmul(acc[j][v], vloadu(scale + n)));
      } else {  // the padded end of the last tile
        alignas(64) float sums[LANES];
        vstore(sums, acc[j][v]);
        for (int64_t i = 0; n + i < N; ++i) out[i] = sums[i] * scale[n + i];
      }
    }
}

// One tile (32 outputs) for MB rows, in blocks of V vectors.
template <int V, int MB>
static void tile_rows(const float* x, const int8_t* tile, const float* scale, float* y,
                      int64_t n0, int64_t m0, int64_t K, int64_t N) {
  for (int v0 = 0; v0 < VPT; v0 += V)
    block<V, MB>(x, tile + v0 * LANES, scale, y, n0 + v0 * LANES, m0, K, N);
}

void int8_gemm(const float* x, const int8_t* p, const float* scale, float* y, int64_t M,
               int64_t K, int64_t N) {
  const int64_t tiles = (N + TILE - 1) / TILE, tile_bytes = K * TILE;
  over_tiles(
      M, tiles,
      [&](int64_t t) { block<2 * VPT, 1>(x, p + t * tile_bytes, scale, y, t * TILE, 0, K, N); },
      [&](int64_t t) { block<VPT, 1>(x, p + t * tile_bytes, scale, y, t * TILE, 0, K, N); },
      [&](int64_t t) {  // each tile stays in cache while every group of rows passes over it
        const int8_t* tile = p + t * tile_bytes;
        const int64_t n0 = t * TILE;
        int64_t m = 0;
        if constexpr (ACCUMULATORS >= 16)
          for (; M - m >= 8; m += 8) tile_rows<VPT, 8>(x, tile, scale, y, n0, m, K, N);
        for (; M - m >= 4; m += 4) tile_rows<2, 4>(x, tile, scale, y, n0, m, K, N);
        if (M - m == 3) tile_rows<VPT, 3>(x, tile, scale, y, n0, m, K, N);
        if (M - m == 2) tile_rows<VPT, 2>(x, tile, scale, y, n0, m, K, N);
        if (M - m == 1) tile_rows<VPT, 1>(x, tile, scale, y, n0, m, K, N);
      });
}

at::Tensor int8_linear(at::Tensor x, at::Tensor p, at::Tensor scale) {
  TORCH_CHECK(x.dtype() == at::kFloat && p.dtype() == at::kChar && scale.dtype() == at::kFloat);
  TORCH_CHECK(x.is_contiguous() && p.is_contiguous() && scale.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1), N = scale.size(0);
  TORCH_CHECK(p.dim() == 3 && p.size(1) == K && p.size(2) == TILE && p.size(0) * TILE >= N,
              "p must be packed [ceil(N / 32), K, 32]");
  auto y = at::empty({M, N}, x.options());
  int8_gemm(x.data_ptr<float>(), p.data_ptr<int8_t>(), scale.data_ptr<float>(),
            y.data_ptr<float>(), M, K, N);
  return y;
}
