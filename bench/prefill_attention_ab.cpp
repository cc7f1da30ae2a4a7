// One process, two builds of the prefill attention side by side: this tree's
// prefill_attention.cpp (A) and another commit's (B, its entry renamed prefill_attention_b by
// prefill_attention_ab.sh, built as an object of its own against its own headers), taking
// turns over the same float16 KV cache, so both see the same host. One chunk of ROWS rows
// after START positions, HEADS query heads over KV_HEADS kv heads of size 64 (defaults:
// qwen2.5-coder-0.5b's 14 over 2, a 256-row chunk after 16,384 positions: an agent's prompt):
//
//   bash bench/prefill_attention_ab.sh HEAD~1 [START [ROWS [HEADS KV_HEADS]]]
//   bash bench/prefill_attention_ab.sh HEAD~1 2048 256 9 3     # SmolLM2's shape
//   THREADS=1 bash bench/prefill_attention_ab.sh HEAD~1         # one thread's rate
//
// Prints the time ratio A / B (median of 15 alternations; below 1: A is faster), each side's
// best and its rate in GFLOP/s (the scores' and the weighted values' multiply-adds), and the
// largest difference between the two outputs (0 where both compute the same bits).
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t start);
torch::Tensor prefill_attention_b(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                  int64_t start);

using Clock = std::chrono::steady_clock;

int main(int argc, char** argv) {
  const char* threads = std::getenv("THREADS");  // default: this host's two cores
  at::set_num_threads(threads ? std::atoi(threads) : 2);
  int64_t start = 16384, rows = 256, heads = 14, kv_heads = 2;
  if (argc > 1) start = atol(argv[1]);
  if (argc > 2) rows = atol(argv[2]);
  if (argc > 4) heads = atol(argv[3]), kv_heads = atol(argv[4]);
  torch::manual_seed(1);
  const int64_t ctx = start + rows;
  auto q = torch::randn({rows, heads, 64});
  auto k = (torch::randn({kv_heads, ctx, 64}) * 0.5).to(torch::kHalf);
  auto v = torch::randn({kv_heads, ctx, 64}).to(torch::kHalf);
  auto a = prefill_attention(q, k, v, start), b = prefill_attention_b(q, k, v, start);
  const double diff = (a - b).abs().max().item<double>();
  // Multiply-adds: every query row against the keys it sees, for scores and for values.
  const double flop = 2.0 * 2 * heads * 64 * (rows * start + rows * (rows + 1) / 2.0);
  std::vector<double> ratios;
  double best_a = 1e9, best_b = 1e9;
  auto timed = [&](auto f) {
    const auto t0 = Clock::now();
    f(q, k, v, start);
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  for (int round = 0; round < 15; ++round) {
    double ta, tb;
    if (round % 2) {
      tb = timed(prefill_attention_b), ta = timed(prefill_attention);
    } else {
      ta = timed(prefill_attention), tb = timed(prefill_attention_b);
    }
    ratios.push_back(ta / tb), best_a = std::min(best_a, ta), best_b = std::min(best_b, tb);
  }
  std::sort(ratios.begin(), ratios.end());
  std::printf("%ld rows after %ld positions, %ld heads over %ld kv heads, float16 KV\n", rows,
              start, heads, kv_heads);
  std::printf("  time A / B, median of 15: %.3f (%.3f-%.3f); best A %.2f ms (%.1f GFLOP/s), "
              "B %.2f ms (%.1f GFLOP/s); largest difference %.2g\n",
              ratios[7], ratios[0], ratios[14], best_a * 1e3, flop / best_a / 1e9, best_b * 1e3,
              flop / best_b / 1e9, diff);
}
