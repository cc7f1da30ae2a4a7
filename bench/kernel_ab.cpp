// One process, two builds of the decode kernels side by side: this tree's (A) and another
// commit's (B, its symbols renamed by kernel_ab.sh), taking turns over the same matrices, so
// both see the same host. A model's layer matrices in its decode weights' kernels, random
// blocks, its Q8_0 head, and the two together (a whole step's matrices: on a host whose cache
// holds each set alone but not both, the step is slower than its parts), at M rows:
//
//   bash bench/kernel_ab.sh HEAD~1 [THREADS [M [MODEL]]]
//
// MODEL: smollm2 (the default: 120 Q4_1 matrices, q4a16, 60 MB; head 49,152 x 576) or qwen
// (qwen2.5-coder-0.5b Q4_K_M as mashbox loads it: per layer its Q8 qkv, Q5_0 output and
// gate+up (q5a16) and Q6_K down (q6a16), 251 MB; head 151,936 x 896).
//
// Prints each kernel's time ratio A / B over 10 alternations (below 1: A is faster) and each
// side's best, after checking that both give the same bits. Also how fast the pool reads the
// same bytes without any arithmetic (a plain sum), the ceiling for these calls here.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "chunk_pool.h"

#define BOTH(ret, name, ...) ret name(__VA_ARGS__); ret name##_B(__VA_ARGS__);
BOTH(void, q4a16_gemm, const float*, const uint8_t*, const uint16_t*, float*, int64_t, int64_t,
     int64_t, int)
BOTH(void, q5a16_gemm, const float*, const uint8_t*, const uint16_t*, float*, int64_t, int64_t,
     int64_t, int)
BOTH(void, q6a16_gemm, const float*, const uint8_t*, const uint8_t*, float*, int64_t, int64_t,
     int64_t)
BOTH(void, q8a16_gemm, const float*, const int8_t*, const uint16_t*, float*, int64_t, int64_t,
     int64_t)

using Clock = std::chrono::steady_clock;

// Bytes at 64-byte alignment, as torch's allocator gives the engine's tensors.
struct Bytes {
  std::unique_ptr<uint8_t, decltype(&std::free)> p{nullptr, &std::free};
  size_t size = 0;
  explicit Bytes(size_t n)
      : p(static_cast<uint8_t*>(std::aligned_alloc(64, (n + 63) / 64 * 64)), &std::free),
        size(n) {}
  uint8_t* data() const { return p.get(); }
};

enum Kind { Q4, Q5, Q6, Q8 };
static const char* const KIND_NAMES[] = {"q4a16 (Q4_1)", "q5a16 (Q5_0)", "q6a16 (Q6_K)",
                                         "q8a16 (Q8_0)"};

struct Matrix {
  Kind kind;
  int64_t n, k;
  Bytes qs, scales;  // packed weights; fp16 d (and m), or Q6_K's int8 sc and fp16 d
};

static Matrix random_matrix(std::mt19937& rng, Kind kind, int64_t n, int64_t k) {
  const int bits = kind == Q4 ? 4 : kind == Q5 ? 5 : kind == Q6 ? 6 : 8;
  const int64_t scale_bytes = kind == Q6   ? n / 32 * (k / 256) * (16 * 32 + 2 * 32)
                              : kind == Q4 ? n * k / 32 * 4
                                           : n * k / 32 * 2;
  Matrix m{kind, n, k, Bytes(n * k * bits / 8), Bytes(scale_bytes)};
  for (size_t i = 0; i < m.qs.size; ++i) m.qs.data()[i] = rng();
  if (kind == Q6) {  // small sc and fp16 d alike: finite, nonzero products
    for (size_t i = 0; i < m.scales.size; ++i) m.scales.data()[i] = 1 + (rng() & 0x1f);
  } else {
    auto* d = reinterpret_cast<uint16_t*>(m.scales.data());
    for (size_t i = 0; i < m.scales.size / 2; ++i) d[i] = 0x2000 + (rng() & 0xff);
  }
  return m;
}

// Kind's kernel from build A or B.
static void gemm(const Matrix& m, bool b, const float* x, float* y, int64_t M) {
  const auto* d = reinterpret_cast<const uint16_t*>(m.scales.data());
  switch (m.kind) {
    case Q4: return (b ? q4a16_gemm_B : q4a16_gemm)(x, m.qs.data(), d, y, M, m.k, m.n, 0);
    case Q5: return (b ? q5a16_gemm_B : q5a16_gemm)(x, m.qs.data(), d, y, M, m.k, m.n, 16);
    case Q6:
      return (b ? q6a16_gemm_B : q6a16_gemm)(x, m.qs.data(), m.scales.data(), y, M, m.k, m.n);
    case Q8:
      return (b ? q8a16_gemm_B : q8a16_gemm)(x, reinterpret_cast<const int8_t*>(m.qs.data()), d,
                                             y, M, m.k, m.n);
  }
}

// The pool reading m's weight bytes with no arithmetic but a sum, in the kernels' chunks.
static void plain_sum(const Matrix& m, std::vector<float>& out) {
  const int64_t chunks = m.n / 64, size = m.qs.size / chunks;
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
  const std::string model = argc > 3 ? argv[3] : "smollm2";
  struct Shape { Kind kind; int64_t n, k; };
  std::vector<Shape> layer_shapes;
  Shape head_shape;
  int layers;
  if (model == "smollm2") {
    layers = 30, head_shape = {Q8, 49152, 576};
    layer_shapes = {{Q4, 960, 576}, {Q4, 576, 576}, {Q4, 3072, 576}, {Q4, 576, 1536}};
  } else if (model == "qwen") {
    layers = 24, head_shape = {Q8, 151936, 896};
    layer_shapes = {{Q8, 1152, 896}, {Q5, 896, 896}, {Q5, 9728, 896}, {Q6, 896, 4864}};
  } else {
    std::printf("unknown model %s: smollm2 or qwen\n", model.c_str());
    return 2;
  }
  std::mt19937 rng(0);
  // The layers' matrices by kind, in the order a step reads them, the head on its own, and
  // a whole step's matrices (every layer's, then the head): more bytes than each alone, which
  // a cache may hold one at a time and not together.
  std::deque<Matrix> matrices;  // a deque: push_back leaves the pointers below valid
  std::map<Kind, std::vector<const Matrix*>> by_kind;
  std::vector<const Matrix*> step;
  for (int layer = 0; layer < layers; ++layer)
    for (const auto& s : layer_shapes) {
      matrices.push_back(random_matrix(rng, s.kind, s.n, s.k));
      by_kind[s.kind].push_back(&matrices.back());
      step.push_back(&matrices.back());
    }
  std::vector<std::pair<std::string, std::vector<const Matrix*>>> sets;
  for (const auto& [kind, ms] : by_kind)
    sets.emplace_back(std::to_string(ms.size()) + " layer matrices, " + KIND_NAMES[kind], ms);
  Matrix head = random_matrix(rng, head_shape.kind, head_shape.n, head_shape.k);
  sets.emplace_back("head " + std::to_string(head_shape.n) + " x " +
                        std::to_string(head_shape.k) + ", " + KIND_NAMES[head_shape.kind],
                    std::vector<const Matrix*>{&head});
  step.push_back(&head);
  sets.emplace_back("a step (the layers, then the head)", step);
  std::vector<float> x(M * 8192), y(M * head_shape.n), y2(M * head_shape.n);
  for (auto& v : x) v = std::uniform_real_distribution<float>(-1, 1)(rng);

  for (const auto& [name, ms] : sets)  // the same bits from both builds
    for (const Matrix* m : ms) {
      gemm(*m, false, x.data(), y.data(), M);
      gemm(*m, true, x.data(), y2.data(), M);
      if (std::memcmp(y.data(), y2.data(), sizeof(float) * M * m->n)) {
        std::printf("%s: A and B differ on a %ld x %ld matrix\n", KIND_NAMES[m->kind], m->n,
                    m->k);
        return 1;
      }
    }

  std::printf("%d threads, %ld rows, %s; time A / B, median of 10 (range); best of each; the "
              "pool's plain sum of the same weight bytes:\n",
              at::get_num_threads(), M, model.c_str());
  for (const auto& [name, ms] : sets) {
    auto all = [&](bool b) {
      for (const Matrix* m : ms) gemm(*m, b, x.data(), y.data(), M);
    };
    std::vector<double> ratios;
    double best_a = 1e9, best_b = 1e9, plain = 1e9;
    for (int round = 0; round < 10; ++round) {  // alternating which side goes first
      const bool b_first = round % 2;
      const double t1 = best_of(5, [&] { all(b_first); });
      const double t2 = best_of(5, [&] { all(!b_first); });
      const double ta = b_first ? t2 : t1, tb = b_first ? t1 : t2;
      ratios.push_back(ta / tb);
      best_a = std::min(best_a, ta), best_b = std::min(best_b, tb);
      plain = std::min(plain, best_of(2, [&] {
                         for (const Matrix* m : ms) plain_sum(*m, y);
                       }));
    }
    std::sort(ratios.begin(), ratios.end());
    size_t total = 0, weights = 0;
    for (const Matrix* m : ms) total += m->qs.size + m->scales.size, weights += m->qs.size;
    const double gb = total / 1e9;
    std::printf("  %s (%.1f MB): %.3f (%.2f-%.2f); A %.3f ms (%.1f GB/s), B %.3f ms (%.1f "
                "GB/s); plain sum %.1f GB/s\n",
                name.c_str(), gb * 1e3, ratios[5], ratios[0], ratios[9], best_a * 1e3,
                gb / best_a, best_b * 1e3, gb / best_b, weights / 1e9 / plain);
  }
}
