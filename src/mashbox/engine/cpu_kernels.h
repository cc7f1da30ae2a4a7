// mashbox's CPU kernels (built together as one extension by cpu_kernels.py).
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <vector>

// f(i) for every i in [0, n) on torch's threads, which take `chunk` indices at a time as they
// become free. A static split (at::parallel_for) makes the whole call wait for a thread that
// lost its core to another process, and on two cores the server's own work does that every
// step; here the other thread takes over the rest of the work.
template <typename F>
inline void parallel_chunks(int64_t n, int64_t chunk, const F& f) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + chunk - 1) / chunk);
  at::parallel_for(0, std::max<int64_t>(threads, 1), 1, [&](int64_t, int64_t) {
    for (int64_t i; (i = next.fetch_add(chunk)) < n;)
      for (int64_t j = i; j < std::min(n, i + chunk); ++j) f(j);
  });
}

// How a matmul's tiles of 32 outputs are spread over the threads: one row takes two tiles at
// a time (eight accumulators hide the FMA latency: pair(t) computes tiles t and t + 1, and
// single(t) an odd last one); several rows take a tile at a time (rows(t)).
template <typename Pair, typename Single, typename Rows>
inline void over_tiles(int64_t M, int64_t tiles, const Pair& pair, const Single& single,
                       const Rows& rows) {
  if (M > 1) {
    parallel_chunks(tiles, 2, rows);
    return;
  }
  parallel_chunks(tiles / 2, 2, [&](int64_t t) { pair(2 * t); });
  if (tiles % 2) single(tiles - 1);
}

// y[M, N] = x[M, K] . (q[N, K] * scale[N])^T, float32 activations and int8 weights packed
// as p[ceil(N / 32)][K][32]; each output row has the same bits whatever M is.
void int8_gemm(const float* x, const int8_t* p, const float* scale, float* y, int64_t M,
               int64_t K, int64_t N);

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor p, torch::Tensor scale);

// The same with a GGUF file's own Q4_0/Q4_1 or Q8_0 blocks, packed by pack_q4 / pack_q8
// (blocks_gemm.cpp); N and K multiples of 32.
void q4_gemm(const float* x, const uint8_t* qs, const uint16_t* dm, float* y, int64_t M,
             int64_t K, int64_t N);
void q8_gemm(const float* x, const int8_t* qs, const uint16_t* d, float* y, int64_t M,
             int64_t K, int64_t N);

torch::Tensor q4_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor dm);
torch::Tensor q8_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d);
