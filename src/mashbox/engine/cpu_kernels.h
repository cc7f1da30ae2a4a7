// mashbox's CPU kernels (built together as one extension by cpu_kernels.py).
#pragma once
#include <torch/extension.h>
#include <immintrin.h>

// y[M, N] = x[M, K] . (q[N, K] * scale[N])^T, float32 activations and int8 weights packed
// as p[ceil(N / 32)][K][32]; each output row has the same bits whatever M is.
void int8_gemm(const float* x, const int8_t* p, const float* scale, float* y, int64_t M,
               int64_t K, int64_t N);

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor p, torch::Tensor scale);
