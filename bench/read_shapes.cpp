// How fast the pool reads a decode step's weight bytes in the shapes the kernels read them,
// with no arithmetic but a sum: where the step comes from memory, what its 121 calls cost
// against fewer, longer reads of the same bytes.
//
//   bash bench/read_shapes.sh [ROUNDS]
//
// SmolLM2's step: 30 layers of four matrices (960, 576, 3072 and 576 x 1536 outputs, 4.5
// bits a weight) and the 49,152 x 576 head (8.5 bits), 64 outputs a unit as the kernels'
// tile pairs. Each round reads them (best of 10 each):
//   calls      matrix by matrix, one ChunkPool::run each, as a decode step does
//   +next 4K   the same; the unit that ends each share asks for the first 4 KiB of that
//              share of the next matrix (would the prefetcher's restart be the cost?)
//   one call   every matrix's units in one ChunkPool::run (no hand-over or tail between them)
//   streams    a buffer of the same size, each thread reading one half front to back
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "chunk_pool.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Matrix {
  uint8_t* bytes;
  int64_t size, units;
};

uint64_t sum_bytes(const uint8_t* p, int64_t size) {
  __m256i sum = _mm256_setzero_si256();
  for (int64_t i = 0; i + 32 <= size; i += 32)
    sum = _mm256_add_epi64(sum, _mm256_sad_epu8(_mm256_loadu_si256((const __m256i*)(p + i)),
                                                _mm256_setzero_si256()));
  return _mm256_extract_epi64(sum, 0);
}

volatile uint64_t sink;  // keeps the sums

void keep(uint64_t sum) {
  if (sum == 1) sink = sum;
}

uint8_t* filled(int64_t size) {
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(64, (size + 63) / 64 * 64));
  std::memset(p, 1, size);  // touched: no page faults while timed
  return p;
}

void by_calls(const std::vector<Matrix>& ms, int64_t ahead) {
  for (size_t j = 0; j < ms.size(); ++j) {
    const Matrix &m = ms[j], *next = j + 1 < ms.size() ? &ms[j + 1] : nullptr;
    const int64_t unit = m.size / m.units;
    ChunkPool::get().run(m.units, 1, 1, [&](int64_t u) {
      keep(sum_bytes(m.bytes + u * unit, unit));
      for (int share = 0; share < 2 && ahead && next; ++share)
        if (u == m.units * (share + 1) / 2 - 1)  // the last unit of this share
          for (int64_t at = 0; at < ahead; at += 64)
            _mm_prefetch(reinterpret_cast<const char*>(next->bytes + next->size * share / 2 + at),
                         _MM_HINT_T0);
    });
  }
}

template <typename F>
double best_s(const F& f) {
  double best = 1e9;
  for (int i = 0; i < 10; ++i) {
    const auto t0 = Clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  at::set_num_threads(2);
  const int rounds = argc > 1 ? atoi(argv[1]) : 12;
  struct Shape {
    int64_t n, k;
    double bits;
  };
  std::vector<Shape> shapes;
  for (int layer = 0; layer < 30; ++layer)
    for (Shape s : {Shape{960, 576, 4.5}, {576, 576, 4.5}, {3072, 576, 4.5}, {576, 1536, 4.5}})
      shapes.push_back(s);
  shapes.push_back({49152, 576, 8.5});
  std::vector<Matrix> ms;
  std::vector<std::pair<const uint8_t*, int64_t>> units;  // every matrix's, in order
  int64_t total = 0;
  for (const Shape& s : shapes) {
    const int64_t size = static_cast<int64_t>(s.n * s.k * s.bits / 8) / 64 * 64;
    ms.push_back({filled(size), size, s.n / 64});
    const int64_t unit = size / (s.n / 64);
    for (int64_t u = 0; u < s.n / 64; ++u) units.push_back({ms.back().bytes + u * unit, unit});
    total += size;
  }
  uint8_t* flat = filled(total);
  std::printf("%.1f MB in %zu matrices, %zu units; GB/s, best of 10 a round\n", total / 1e6,
              ms.size(), units.size());
  const char* names[] = {"calls", "+next 4K", "one call", "streams"};
  std::vector<std::vector<double>> rates(4);
  for (int round = 0; round < rounds; ++round) {
    const double s[] = {
        best_s([&] { by_calls(ms, 0); }),
        best_s([&] { by_calls(ms, 4096); }),
        best_s([&] {
          ChunkPool::get().run(units.size(), 1, 1, [&](int64_t u) {
            keep(sum_bytes(units[u].first, units[u].second));
          });
        }),
        best_s([&] {
          ChunkPool::get().run(2, 1, 1, [&](int64_t half) {
            keep(sum_bytes(flat + total / 2 * half, total / 2));
          });
        }),
    };
    for (int v = 0; v < 4; ++v) rates[v].push_back(total / s[v] / 1e9);
  }
  for (int v = 0; v < 4; ++v) {
    std::sort(rates[v].begin(), rates[v].end());
    std::printf("  %-9s median %5.1f  best %5.1f  worst %5.1f\n", names[v],
                rates[v][rates[v].size() / 2], rates[v].back(), rates[v].front());
  }
}
