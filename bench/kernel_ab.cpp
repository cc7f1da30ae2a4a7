// One process, two builds of the decode kernels side by side: this tree's (A) and another
// commit's (B, its symbols renamed by kernel_ab.sh), taking turns over the same matrices, so
// both see the same host. SmolLM2's 120 layer matrices at int4a16 (Q4_0-shaped random
// blocks, 60 MB: past the L3 cache) and a Q8_0 head of 49,152 x 576, at M rows:
//
//   bash bench/kernel_ab.sh HEAD~1 [THREADS [M [HEAD_ROWS HEAD_K]]]
//
// Prints each pair's time ratio A / B over 10 alternations (below 1: A is faster) and each
// side's best, after checking that both give the same bits. Also how fast the pool reads the
// same bytes without any arithmetic (a plain sum), the ceiling for these calls here.
// Optional: the head's shape (qwen2.5-coder-0.5b's: 151936 896).
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "chunk_pool.h"

void q4a16_gemm(const float*, const uint8_t*, const uint16_t*, float*, int64_t, int64_t, int64_t,
                int);
void q4a16_gemm_B(const float*, const uint8_t*, const uint16_t*, float*, int64_t, int64_t,
                  int64_t, int);
void q8a16_gemm(const float*, const int8_t*, const uint16_t*, float*, int64_t, int64_t, int64_t);
void q8a16_gemm_B(const float*, const int8_t*, const uint16_t*, float*, int64_t, int64_t,
                  int64_t);

using Clock = std::chrono::steady_clock;

struct Matrix {
  int64_t n, k;
  std::vector<uint8_t> qs;
  std::vector<uint16_t> d;  // fp16 scales, one per 32 weights
};

static Matrix random_matrix(std::mt19937& rng, int64_t n, int64_t k, int bits) {
  Matrix m{n, k, std::vector<uint8_t>(n * k * bits / 8), std::vector<uint16_t>(n * k / 32)};
  for (auto& b : m.qs) b = rng();
  for (auto& d : m.d) d = 0x2000 + (rng() & 0xff);  // small positive fp16 values
  return m;
}

static size_t bytes(const std::vector<Matrix>& ms) {
  size_t total = 0;
  for (const auto& m : ms) total += m.qs.size() + 2 * m.d.size();
  return total;
}

// The pool reading m's bytes with no arithmetic but a sum, in the kernels' chunks.
static void plain_sum(const Matrix& m, std::vector<float>& out) {
  const int64_t chunks = m.n / 64, size = m.qs.size() / chunks;
  ChunkPool::get().run(chunks, 1, at::get_num_threads() - 1, [&](int64_t c) {
    const uint8_t* p = m.qs.data() + c * size;
    __m256i sum = _mm256_setzero_si256();
    for (int64_t i = 0; i < size; i += 32)
      sum = _mm256_add_epi64(sum, _mm256_sad_epu8(_mm256_loadu_si256((const __m256i*)(p + i)),
                                                  _mm256_setzero_si256()));
    out[c % out.size()] = _mm256_extract_epi64(sum, 0);
  });
}

template <typename F>
static double best_of(int times, const F& f) {
  double best = 1e9;
  for (int i = 0; i < times; ++i) {
    const auto t0 = Clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return best;
}

int main(int argc, char** argv) {
  at::set_num_threads(argc > 1 ? atoi(argv[1]) : 2);
  const int64_t M = argc > 2 ? atoi(argv[2]) : 1;
  std::mt19937 rng(0);
  std::vector<Matrix> layers, head;
  const int64_t shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
  for (int layer = 0; layer < 30; ++layer)
    for (const auto& s : shapes) layers.push_back(random_matrix(rng, s[0], s[1], 4));
  const int64_t head_n = argc > 4 ? atoi(argv[3]) : 49152;
  const int64_t head_k = argc > 4 ? atoi(argv[4]) : 576;
  head.push_back(random_matrix(rng, head_n, head_k, 8));
  std::vector<float> x(M * std::max<int64_t>(1536, head_k)), y(M * head_n), y2(M * head_n);
  for (auto& v : x) v = std::uniform_real_distribution<float>(-1, 1)(rng);

  auto q4 = [&](auto gemm, float* out) {
    for (const auto& m : layers) gemm(x.data(), m.qs.data(), m.d.data(), out, M, m.k, m.n, 8);
  };
  auto q8 = [&](auto gemm, float* out) {
    for (const auto& m : head)
      gemm(x.data(), reinterpret_cast<const int8_t*>(m.qs.data()), m.d.data(), out, M, m.k, m.n);
  };
  for (const auto& m : layers) {  // the same bits from both builds
    q4a16_gemm(x.data(), m.qs.data(), m.d.data(), y.data(), M, m.k, m.n, 8);
    q4a16_gemm_B(x.data(), m.qs.data(), m.d.data(), y2.data(), M, m.k, m.n, 8);
    if (std::memcmp(y.data(), y2.data(), sizeof(float) * M * m.n)) {
      std::printf("q4a16: A and B differ on a %ld x %ld matrix\n", m.n, m.k);
      return 1;
    }
  }
  q8(q8a16_gemm, y.data());
  q8(q8a16_gemm_B, y2.data());
  if (std::memcmp(y.data(), y2.data(), sizeof(float) * M * head[0].n)) {
    std::printf("q8a16: A and B differ\n");
    return 1;
  }

  // The ceiling: the pool summing the matrices' bytes, a pair of tiles a chunk.
  const double plain = best_of(10, [&] {
    for (const auto& m : layers) plain_sum(m, y);
  });
  const double head_plain = best_of(10, [&] { plain_sum(head[0], y); });
  std::vector<double> r4, r8;
  double a4 = 1e9, b4 = 1e9, a8 = 1e9, b8 = 1e9;
  for (int round = 0; round < 10; ++round) {  // alternating which side goes first
    double ta4, tb4, ta8, tb8;
    auto time_a = [&] {
      ta4 = best_of(10, [&] { q4(q4a16_gemm, y.data()); });
      ta8 = best_of(10, [&] { q8(q8a16_gemm, y.data()); });
    };
    auto time_b = [&] {
      tb4 = best_of(10, [&] { q4(q4a16_gemm_B, y.data()); });
      tb8 = best_of(10, [&] { q8(q8a16_gemm_B, y.data()); });
    };
    if (round % 2) time_b(), time_a();
    else time_a(), time_b();
    r4.push_back(ta4 / tb4), r8.push_back(ta8 / tb8);
    a4 = std::min(a4, ta4), b4 = std::min(b4, tb4), a8 = std::min(a8, ta8), b8 = std::min(b8, tb8);
  }
  std::sort(r4.begin(), r4.end());
  std::sort(r8.begin(), r8.end());
  const double gb = bytes(layers) / 1e9, head_gb = bytes(head) / 1e9;
  std::printf("%d threads, %ld rows; time A / B, median of 10 (range):\n",
              at::get_num_threads(), M);
  std::printf("  120 layer matmuls, q4a16 (%.1f MB): %.3f (%.2f-%.2f); best A %.3f ms "
              "(%.1f GB/s), B %.3f ms (%.1f GB/s)\n", gb * 1e3, r4[5], r4[0], r4[9], a4 * 1e3,
              gb / a4, b4 * 1e3, gb / b4);
  std::printf("  Q8_0 head %ld x %ld, q8a16 (%.1f MB; under ~32 MB it may sit in L3): %.3f "
              "(%.2f-%.2f); best A %.3f ms (%.1f GB/s), B %.3f ms (%.1f GB/s)\n",
              head[0].n, head[0].k, head_gb * 1e3, r8[5], r8[0], r8[9], a8 * 1e3, head_gb / a8,
              b8 * 1e3, head_gb / b8);
  size_t qs = 0;
  for (const auto& m : layers) qs += m.qs.size();
  std::printf("  ceiling: A's pool summing the layer matrices' 4-bit bytes: %.3f ms (%.1f GB/s)\n",
              plain * 1e3, qs / 1e9 / plain);
  std::printf("  ceiling: the same for the head's int8 bytes: %.3f ms (%.1f GB/s)\n",
              head_plain * 1e3, head[0].qs.size() / 1e9 / head_plain);
}
