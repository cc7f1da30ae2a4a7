#include "cpu_kernels.h"

#include <ATen/Parallel.h>

// y[M, N] = x[M, K] . (q[N, K] * scale[N])^T for small M (decode batches): float32
// activations, int8 weights read from memory once per call whatever M is.
//
// Every output is summed in one order, whatever M is and whichever block computes it: four
// 8-lane accumulators take the 8-weight chunks of k in turn (k / 8 mod 4), the tail chunks
// (K not a multiple of 32) go to the first, then (a0 + a1) + (a2 + a3), a horizontal sum and
// the scale. So a row's result has the same bits alone or in any batch, which seeded
// sampling relies on. Blocks of NB weight rows x MB activation rows (NB * MB <= 3, twelve
// accumulators) differ only in how much each converted weight and each load is reused.

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

static inline __m256 widen(__m128i eight_bytes) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight_bytes));
}

template <int NB, int MB>
static inline void block(const float* x, const int8_t* q, const float* scale, float* y,
                         int64_t n0, int64_t m0, int64_t K, int64_t N) {
  __m256 acc[NB][MB][4];
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j)
      for (int a = 0; a < 4; ++a) acc[i][j][a] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    for (int i = 0; i < NB; ++i) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (n0 + i) * K + k));
      const __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
      const __m256 w[4] = {widen(lo), widen(_mm_srli_si128(lo, 8)), widen(hi),
                           widen(_mm_srli_si128(hi, 8))};
      for (int a = 0; a < 4; ++a)
        for (int j = 0; j < MB; ++j)
          acc[i][j][a] =
              _mm256_fmadd_ps(w[a], _mm256_loadu_ps(x + (m0 + j) * K + k + 8 * a), acc[i][j][a]);
    }
  }
  for (; k < K; k += 8)
    for (int i = 0; i < NB; ++i) {
      const __m256 w =
          widen(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + (n0 + i) * K + k)));
      for (int j = 0; j < MB; ++j)
        acc[i][j][0] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + (m0 + j) * K + k), acc[i][j][0]);
    }
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) {
      const __m256 s = _mm256_add_ps(_mm256_add_ps(acc[i][j][0], acc[i][j][1]),
                                     _mm256_add_ps(acc[i][j][2], acc[i][j][3]));
      y[(m0 + j) * N + n0 + i] = hsum(s) * scale[n0 + i];
    }
}

// Output rows in tiles of TILE weight rows; each tile's weights stay in L1 while every group
// of activation rows passes over them, so DRAM sees each weight once.
static constexpr int64_t TILE = 8;

template <int MB>
static void tile_rows(const float* x, const int8_t* q, const float* s, float* y, int64_t m0,
                      int64_t n0, int64_t n1, int64_t K, int64_t N) {
  constexpr int NB = 3 / MB;
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) block<NB, MB>(x, q, s, y, n, m0, K, N);
  for (; n < n1; ++n) block<1, MB>(x, q, s, y, n, m0, K, N);
}

void int8_gemm(const float* x, const int8_t* q, const float* scale, float* y, int64_t M,
               int64_t K, int64_t N) {
  const int64_t tiles = (N + TILE - 1) / TILE;
  // torch's own thread pool: a second OpenMP runtime would spin against it.
  at::parallel_for(0, tiles, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * TILE, n1 = std::min(N, n0 + TILE);
      int64_t m = 0;
      for (; M - m >= 3 && M - m != 4; m += 3) tile_rows<3>(x, q, scale, y, m, n0, n1, K, N);
      for (; M - m >= 2; m += 2) tile_rows<2>(x, q, scale, y, m, n0, n1, K, N);
      if (M - m == 1) tile_rows<1>(x, q, scale, y, m, n0, n1, K, N);
    }
  });
}

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale) {
  TORCH_CHECK(x.dtype() == torch::kFloat && q.dtype() == torch::kChar && scale.dtype() == torch::kFloat);
  TORCH_CHECK(x.is_contiguous() && q.is_contiguous() && scale.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(q.size(1) == K && K % 8 == 0, "K must match and be a multiple of 8");
  auto y = torch::empty({M, N}, x.options());
  int8_gemm(x.data_ptr<float>(), q.data_ptr<int8_t>(), scale.data_ptr<float>(),
            y.data_ptr<float>(), M, K, N);
  return y;
}
