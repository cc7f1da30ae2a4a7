// One process, two builds of the decode attention side by side: this tree's decode_math.h (A)
// and another commit's (B, its namespace renamed by attention_ab.sh), taking turns over the
// same float16 KV cache, so both see the same host. One batch-1 row at LEN positions over
// LAYERS layers (defaults: qwen2.5-coder-0.5b's 14 query heads over 2 kv heads, 24 layers, head
// size 64), a 256 MiB read between calls so the cache comes from memory, as it does after a
// step's weights:
//
//   bash bench/attention_ab.sh HEAD~1 [LEN [HEADS KV_HEADS LAYERS]]
//   bash bench/attention_ab.sh HEAD~1 2000 9 3 30        # SmolLM2's shape
//
// Prints the time ratio A / B (median of 20 alternations; below 1: A is faster), each side's
// best, and its rate over the cache's bytes, after checking that both give the same bits
// (AB_BITS_MAY_DIFFER=1: go on where they do not, e.g. for a change of the chunks).
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "decode_math.h"
#include "decode_math_b.h"

using Clock = std::chrono::steady_clock;

struct Shape {
  int64_t heads, kv_heads, layers, len, ctx;
};

// Seconds for one batch-1 row's attention through every layer, with `Attention` (either
// build's CacheAttention).
template <typename Attention>
static double attend_all(const Shape& s, const std::vector<std::vector<uint16_t>>& k,
                         const std::vector<std::vector<uint16_t>>& v, const float* q, float* out) {
  Attention attention(s.heads, s.kv_heads, 64);
  const auto t0 = Clock::now();
  for (int64_t l = 0; l < s.layers; ++l) {
    const uint16_t* kr[1] = {k[l].data()};
    const uint16_t* vr[1] = {v[l].data()};
    const int64_t lengths[1] = {s.len};
    attention(1, q, s.heads * 64, kr, vr, s.ctx * 64, lengths, out);
  }
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

int main(int argc, char** argv) {
  at::set_num_threads(2);
  Shape s{14, 2, 24, 16000, 0};
  if (argc > 1) s.len = atol(argv[1]);
  if (argc > 4) s.heads = atol(argv[2]), s.kv_heads = atol(argv[3]), s.layers = atol(argv[4]);
  s.ctx = s.len + 64;
  std::mt19937 rng(1);
  std::vector<std::vector<uint16_t>> k(s.layers), v(s.layers);
  for (int64_t l = 0; l < s.layers; ++l) {  // small positive float16 values
    k[l].resize(s.kv_heads * s.ctx * 64), v[l].resize(s.kv_heads * s.ctx * 64);
    for (auto& x : k[l]) x = 0x3000 + (rng() & 0x3ff);
    for (auto& x : v[l]) x = 0x3000 + (rng() & 0x3ff);
  }
  std::vector<float> q(s.heads * 64), out_a(q.size()), out_b(q.size());
  for (auto& x : q) x = std::uniform_real_distribution<float>(-1, 1)(rng);
  attend_all<decode_math::CacheAttention>(s, k, v, q.data(), out_a.data());
  attend_all<decode_math_b::CacheAttention>(s, k, v, q.data(), out_b.data());
  if (std::memcmp(out_a.data(), out_b.data(), sizeof(float) * q.size())) {
    float most = 0;
    for (size_t i = 0; i < q.size(); ++i) most = std::max(most, std::abs(out_a[i] - out_b[i]));
    std::printf("A and B differ, by up to %g\n", most);
    if (!getenv("AB_BITS_MAY_DIFFER")) return 1;  // set where a change moves the roundings
  }

  std::vector<float> other(64 << 20, 1.0f);  // read between calls: the cache leaves L3
  volatile float sink = 0;
  auto evict = [&] {
    float sum = 0;
    for (size_t i = 0; i < other.size(); i += 16) sum += other[i];
    sink = sink + sum;
  };
  std::vector<double> ratios;
  double best_a = 1e9, best_b = 1e9;
  for (int round = 0; round < 20; ++round) {
    double ta, tb;
    auto time_a = [&] {
      evict();
      ta = attend_all<decode_math::CacheAttention>(s, k, v, q.data(), out_a.data());
    };
    auto time_b = [&] {
      evict();
      tb = attend_all<decode_math_b::CacheAttention>(s, k, v, q.data(), out_b.data());
    };
    if (round % 2) time_b(), time_a();
    else time_a(), time_b();
    ratios.push_back(ta / tb), best_a = std::min(best_a, ta), best_b = std::min(best_b, tb);
  }
  std::sort(ratios.begin(), ratios.end());
  const double gb = s.layers * s.kv_heads * s.len * 64 * 2 * 2 / 1e9;  // keys and values
  std::printf("%ld positions, %ld heads over %ld kv heads, %ld layers (%.1f MB of float16 KV)\n",
              s.len, s.heads, s.kv_heads, s.layers, gb * 1e3);
  std::printf("  time A / B, median of 20: %.3f (%.3f-%.3f); best A %.2f ms (%.1f GB/s), "
              "B %.2f ms (%.1f GB/s)\n",
              ratios[10], ratios[0], ratios[19], best_a * 1e3, gb / best_a, best_b * 1e3,
              gb / best_b);
}
