#include "cpu_kernels.h"

#include <cmath>
#include <vector>

// One whole decode step of a Llama-family decoder on the CPU with int8 or int4 weights:
// every layer's norms, matmuls, RoPE, KV write, attention, SiLU and residuals in one call,
// so a step costs one Python call instead of ~400 small torch ops (~8 ms of dispatch at
// batch 1 on the 2-core machines here, as much as reading the weights). Each batch row is
// computed on its own, in the same order whatever the batch holds: a row's bits do not
// depend on its neighbours. The float32 `Model.forward` in model.py is the reference it is
// tested against.

// e^x for 8 floats: Cephes' expf polynomial (about 1 ulp), for softmax and SiLU.
static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)),
                    _mm256_set1_ps(88.3762626647949f));
  __m256 n = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 p = _mm256_set1_ps(1.9875691500E-4f);
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.3981999507E-3f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(8.3334519073E-3f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(4.1665795894E-2f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.6666665459E-1f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(5.0000001201E-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

// n is a multiple of 8 everywhere below (the Python side checks d_model and head_dim).
static inline float dot(const float* a, const float* b, int64_t n) {
  __m256 s = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s);
  return hsum8(s);
}

static void rms_norm(const float* x, const float* w, float* out, int64_t n, float eps) {
  const float r = 1.0f / std::sqrt(dot(x, x, n) / n + eps);
  const __m256 rv = _mm256_set1_ps(r);
  for (int64_t i = 0; i < n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), rv),
                                            _mm256_loadu_ps(w + i)));
}

// Rotate-half RoPE of one head in place.
static void rope(float* x, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * cos[i] - x2 * sin[i];
    x[i + half] = x2 * cos[i] + x1 * sin[i];
  }
}

static void add_into(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 8)
    _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
}

// out = silu(gate) * up, where gu holds [gate | up].
static void silu_mul(const float* gu, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gu + i);
    const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(gu + n + i)));
  }
}

// Softmax attention of one query head over the first n positions of one cache row.
static void attend(const float* q, const float* k, const float* v, float* out, int64_t n,
                   int64_t hd, float scale, float* scores) {
  float m = -INFINITY;
  for (int64_t t = 0; t < n; ++t) {
    scores[t] = dot(q, k + t * hd, hd) * scale;
    m = std::max(m, scores[t]);
  }
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sv = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), mv));
    _mm256_storeu_ps(scores + t, p);
    sv = _mm256_add_ps(sv, p);
  }
  float sum = hsum8(sv);
  for (; t < n; ++t) {  // the tail through the same polynomial: one definition of e^x
    scores[t] = _mm256_cvtss_f32(exp8(_mm256_set1_ps(scores[t] - m)));
    sum += scores[t];
  }
  for (int64_t i = 0; i < hd; i += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t u = 0; u < n; ++u)
      acc = _mm256_fmadd_ps(_mm256_set1_ps(scores[u]), _mm256_loadu_ps(v + u * hd + i), acc);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(acc, _mm256_set1_ps(1.0f / sum)));
  }
}

// A decode matrix, told apart by its tensors' dtypes and shapes: int8 per output channel
// (int8 packed weights, float32 scales [N]: int8_gemm.cpp), a GGUF's own Q4 or Q5 blocks
// (uint8 qs, [.., 32] for Q4, [.., 40] for Q5, 4-dim for Q4 with int8 activations; fp16 d
// and m, or float32 for the K-quants' groups of 32) or Q8 blocks (int8 qs; fp16 d per 32, or
// float32 per 16: Q6_K's): blocks_gemm.cpp and rounded_gemm.cpp.
struct Mat {
  torch::Tensor a, b;
  int64_t q4_activation_bits = 32;  // what Q4 blocks multiply: float32, int16 or int8 x
  bool q4() const { return a.scalar_type() == torch::kByte; }  // Q5 too
  bool int8() const { return !q4() && b.dim() == 1; }
  bool q4a8() const { return q4() && a.dim() == 4; }  // pack_q4a8's [N/32][K/8][32][4]
  bool q5() const { return q4() && a.dim() == 3 && a.size(2) == Q5_PAIR; }
  int64_t n() const { return int8() ? b.size(0) : a.size(0) * 32; }
  int64_t k() const { return q4a8() ? a.size(1) * 8 : q4() ? a.size(1) * 2 : a.size(1); }
  void operator()(const float* x, float* y, int64_t rows) const {
    if (int8()) {
      int8_gemm(x, a.data_ptr<int8_t>(), b.data_ptr<float>(), y, rows, k(), n());
      return;
    }
    if (b.scalar_type() == torch::kFloat) {
      if (q4())
        run_q4(x, b.data_ptr<float>(), y, rows);
      else
        q8_gemm(x, a.data_ptr<int8_t>(), b.data_ptr<float>(), y, rows, k(), n());
      return;
    }
    const auto* scales = reinterpret_cast<const uint16_t*>(b.data_ptr<at::Half>());
    if (q4())
      run_q4(x, scales, y, rows);
    else
      q8_gemm(x, a.data_ptr<int8_t>(), scales, y, rows, k(), n());
  }
  template <typename S>  // fp16 (uint16_t) or float32 d and m
  void run_q4(const float* x, const S* scales, float* y, int64_t rows) const {
    const uint8_t* q = a.data_ptr<uint8_t>();
    if (q5() && q4_activation_bits < 32)  // int16 whenever Q4 rounds activations: no q5a8
      q5a16_gemm(x, q, scales, y, rows, k(), n());
    else if (q5())
      q5_gemm(x, q, scales, y, rows, k(), n());
    else if (q4a8())
      q4a8_gemm(x, q, scales, y, rows, k(), n());
    else if (q4_activation_bits == 16)
      q4a16_gemm(x, q, scales, y, rows, k(), n());
    else
      q4_gemm(x, q, scales, y, rows, k(), n());
  }
};

struct Layer {
  torch::Tensor attn_norm, bqkv, q_norm, k_norm, ffn_norm;  // absent ones have no elements
  Mat wqkv, wo, gate_up, down;
};

static const float* data_or_null(const torch::Tensor& t) {
  return t.numel() ? t.data_ptr<float>() : nullptr;
}

class DecodeStack {
 public:
  // Each layer: attn_norm, wqkv (2 tensors), bqkv, q_norm, k_norm, wo (2), ffn_norm,
  // gate_up (2), down (2), each matrix int8, Q4 or Q8_0 (Mat); empty tensors where absent.
  // q4_activation_bits: 16 for Q4 matrices in pack_q4's layout to take int16 activations.
  DecodeStack(const std::vector<std::vector<torch::Tensor>>& layers, torch::Tensor final_norm,
              torch::Tensor cos, torch::Tensor sin, int64_t n_heads, int64_t n_kv_heads,
              int64_t head_dim, double eps, int64_t q4_activation_bits)
      : final_norm_(final_norm), cos_(cos), sin_(sin), n_heads_(n_heads),
        n_kv_heads_(n_kv_heads), head_dim_(head_dim), eps_(static_cast<float>(eps)) {
    TORCH_CHECK(head_dim % 8 == 0 && cos.size(1) * 2 == head_dim);
    const int64_t bits = q4_activation_bits;
    for (const auto& t : layers) {
      TORCH_CHECK(t.size() == 13, "13 tensors a layer");
      for (const auto& x : t) TORCH_CHECK(x.is_contiguous() && x.device().is_cpu());
      layers_.push_back({t[0], t[3], t[4], t[5], t[8], {t[1], t[2], bits}, {t[6], t[7], bits},
                         {t[9], t[10], bits}, {t[11], t[12], bits}});
    }
  }

  // x: [B, d_model] embeddings; positions and slots: int64 [B]; caches: float32
  // [layers, slots, kv_heads, ctx, head_dim]. Writes each row's k and v at its position and
  // returns the final-normed hidden states [B, d_model].
  torch::Tensor forward(torch::Tensor x, torch::Tensor positions, torch::Tensor slots,
                        torch::Tensor cache_k, torch::Tensor cache_v) {
    TORCH_CHECK(x.dtype() == torch::kFloat && cache_k.dtype() == torch::kFloat &&
                cache_v.dtype() == torch::kFloat && cache_k.is_contiguous() &&
                cache_v.is_contiguous() && cache_k.size(4) == head_dim_);
    x = x.contiguous().clone();
    const int64_t B = x.size(0), D = x.size(1), hd = head_dim_, half = hd / 2;
    const int64_t nh = n_heads_, nkv = n_kv_heads_, groups = nh / nkv;
    const int64_t n_slots = cache_k.size(1), ctx = cache_k.size(3);
    const int64_t row_stride = nkv * ctx * hd, layer_stride = n_slots * row_stride;
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    int64_t longest = 0;
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(pos[b] >= 0 && pos[b] < ctx && pos[b] < cos_.size(0) && slot[b] >= 0 &&
                  slot[b] < n_slots, "position or slot out of range");
      longest = std::max(longest, pos[b] + 1);
    }
    const int64_t n_qkv = layers_[0].wqkv.n(), ffn = layers_[0].down.k();
    std::vector<float> h(B * D), qkv(B * n_qkv), att(B * nh * hd), gu(B * 2 * ffn), act(B * ffn),
        y(B * D);
    float* xs = x.data_ptr<float>();
    float* kc = cache_k.data_ptr<float>();
    float* vc = cache_v.data_ptr<float>();
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));

    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& w = layers_[l];
      for (int64_t b = 0; b < B; ++b)
        rms_norm(xs + b * D, w.attn_norm.data_ptr<float>(), h.data() + b * D, D, eps_);
      w.wqkv(h.data(), qkv.data(), B);
      const float* bias = data_or_null(w.bqkv);
      const float* qn = data_or_null(w.q_norm);
      const float* kn = data_or_null(w.k_norm);
      for (int64_t b = 0; b < B; ++b) {
        float* r = qkv.data() + b * n_qkv;
        if (bias)
          for (int64_t i = 0; i < n_qkv; ++i) r[i] += bias[i];
        const float* c = cos_.data_ptr<float>() + pos[b] * half;
        const float* s = sin_.data_ptr<float>() + pos[b] * half;
        for (int64_t head = 0; head < nh + nkv; ++head) {  // q heads, then k heads
          float* x_head = r + head * hd;
          const float* norm = head < nh ? qn : kn;
          if (norm) rms_norm(x_head, norm, x_head, hd, eps_);
          rope(x_head, c, s, half);
        }
        for (int64_t kh = 0; kh < nkv; ++kh) {
          const int64_t at = l * layer_stride + slot[b] * row_stride + (kh * ctx + pos[b]) * hd;
          std::copy_n(r + (nh + kh) * hd, hd, kc + at);
          std::copy_n(r + (nh + nkv + kh) * hd, hd, vc + at);
        }
      }
      parallel_chunks(B * nh, 1, [&](int64_t task) {
        thread_local std::vector<float> scores;
        scores.resize(std::max<size_t>(scores.size(), longest));
        const int64_t b = task / nh, head = task % nh, kh = head / groups;
        const int64_t at = l * layer_stride + slot[b] * row_stride + kh * ctx * hd;
        attend(qkv.data() + b * n_qkv + head * hd, kc + at, vc + at,
               att.data() + (b * nh + head) * hd, pos[b] + 1, hd, scale, scores.data());
      });
      w.wo(att.data(), y.data(), B);
      add_into(xs, y.data(), B * D);
      for (int64_t b = 0; b < B; ++b)
        rms_norm(xs + b * D, w.ffn_norm.data_ptr<float>(), h.data() + b * D, D, eps_);
      w.gate_up(h.data(), gu.data(), B);
      for (int64_t b = 0; b < B; ++b) silu_mul(gu.data() + b * 2 * ffn, act.data() + b * ffn, ffn);
      w.down(act.data(), y.data(), B);
      add_into(xs, y.data(), B * D);
    }
    auto out = torch::empty_like(x);
    for (int64_t b = 0; b < B; ++b)
      rms_norm(xs + b * D, final_norm_.data_ptr<float>(), out.data_ptr<float>() + b * D, D, eps_);
    return out;
  }

 private:
  std::vector<Layer> layers_;
  torch::Tensor final_norm_, cos_, sin_;
  int64_t n_heads_, n_kv_heads_, head_dim_;
  float eps_;
};

// What this build's code uses, as the ready line and /v1/models name it.
static std::string isa() {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  return "avx512+vnni";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVXVNNI__)
  return "avx2+avx-vnni";
#else
  return "avx2";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &isa, "the instruction sets this build's kernels use");
  m.def("int8_linear", &int8_linear, "y = x . (q * scale)^T, q packed by pack_int8");
  m.def("q4_linear", &q4_linear, "y = x . W^T, W a GGUF's 4-bit blocks packed by pack_q4");
  m.def("q8_linear", &q8_linear, "y = x . W^T, W a GGUF's Q8_0 blocks packed by pack_q8");
  m.def("q4a8_linear", &q4a8_linear, "q4_linear with x rounded to int8 per block of 32");
  m.def("q4a16_linear", &q4a16_linear, "q4_linear with x rounded to int16 per block of 32");
  // module_local: a process may load several builds (a failed self-check, then the next
  // target), and pybind11 registers a type once per process otherwise.
  pybind11::class_<DecodeStack>(m, "DecodeStack", pybind11::module_local())
      .def(pybind11::init<const std::vector<std::vector<torch::Tensor>>&, torch::Tensor,
                          torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t, double,
                          int64_t>())
      .def("forward", &DecodeStack::forward);
}
