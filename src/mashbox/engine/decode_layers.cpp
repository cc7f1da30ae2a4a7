#include "cpu_kernels.h"
#include <torch/extension.h>  // the module binding (PYBIND11_MODULE below)
#include "decode_math.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

using decode_math::add_into;
using decode_math::rms_norm;
using decode_math::rope;
using decode_math::silu_mul;

// One whole decode step of a Llama-family decoder on the CPU with int8 or int4 weights:
// every layer's norms, matmuls, RoPE, KV write, attention, SiLU and residuals in one call,
// so a step costs one Python call instead of ~400 small torch ops (~8 ms of dispatch at
// batch 1 on the 2-core machines here, as much as reading the weights). Each batch row is
// computed on its own, in the same order whatever the batch holds: a row's bits do not
// depend on its neighbours. The float32 `Model.forward` in model.py is the reference it is
// tested against.

// A decode matrix, told apart by its tensors' dtypes and shapes: int8 per output channel
// (int8 packed weights, float32 scales [N]: int8_gemm.cpp), a GGUF's own Q4 or Q5 blocks
// (uint8 qs [.., 128] for Q4, [.., 160] for Q5; fp16 d and m, d alone for Q4_0 and Q5_0, or
// float32 for the K-quants' groups of 32, or their scales as stored: uint8), Q6 blocks
// (uint8 qs [.., 192] and scales: Q6_K's, always with int16 activations) or Q8 blocks (int8
// qs; fp16 d per 32, or float32 per 16): blocks_gemm.cpp and rounded_gemm.cpp.
class Mat {
 public:
  // q4_activation_bits: what Q4 and Q5 blocks multiply (float32, int16 or int8 x).
  Mat(at::Tensor a, at::Tensor b, int64_t q4_activation_bits)
      : a_(a), b_(b), bits_(q4_activation_bits), tiles_(a.size(0)),
        base_{static_cast<const char*>(a.data_ptr()), static_cast<const char*>(b.data_ptr())},
        tile_bytes_{a.nbytes() / std::max<int64_t>(tiles_, 1),
                    b.nbytes() / std::max<int64_t>(tiles_, 1)},
        q4_(a.scalar_type() == at::kByte), int8_(!q4_ && b.dim() == 1),
        q5_(q4_ && a.size(2) == Q5_RECORD), q6_(q4_ && a.size(2) == Q6_RECORD),
        scales_(b.scalar_type()), n_(int8_ ? b.size(0) : a.size(0) * 32),
        k_(q4_ ? a.size(1) * 8 : int8_ ? a.size(1) : a.size(1) * 2),
        derived_m_(q4_ && b.dim() >= 3 && b.size(2) == 1 ? (q5_ ? 16 : 8) : 0) {
    TORCH_CHECK(scales_ == at::kByte || scales_ == at::kFloat || scales_ == at::kHalf);
    TORCH_CHECK(!int8_ || scales_ == at::kFloat, "int8 weights take float32 scales");
    TORCH_CHECK(!q6_ || scales_ == at::kByte, "Q6 blocks take their scales as stored");
  }

  int64_t n() const { return n_; }
  int64_t k() const { return k_; }

  // What a call with `rows` rows reads, unit by unit as over_tiles hands them out (a pair of
  // tiles for one row, a tile for several); each tensor holds its tiles one after another
  // (int8's scales, one a row, near enough).
  ChunkPool::Ahead ahead(int64_t rows) const {
    const int64_t per = rows == 1 ? 2 : 1;
    ChunkPool::Ahead next;
    if (tiles_ < per) return next;
    for (int s = 0; s < 2; ++s) {
      next.base[s] = base_[s];
      next.unit_bytes[s] = tile_bytes_[s] * per;
    }
    next.units = tiles_ / per;
    return next;
  }

  // The kind, the pointers and the sizes were read from the tensors once: their accessors
  // touch the tensors' cold headers, ~0.3 us a call (perf, stop 38); reading them here at
  // every call took a step 1/0.98 as long (bench/stack_ab.sh, stop 40).
  void operator()(const float* x, float* y, int64_t rows) const {
    const auto* qs8 = reinterpret_cast<const int8_t*>(base_[0]);
    const auto* qs = reinterpret_cast<const uint8_t*>(base_[0]);
    if (int8_) {
      int8_gemm(x, qs8, scales<float>(), y, rows, k_, n_);
      return;
    }
    if (q6_) {
      q6a16_gemm(x, qs, scales<uint8_t>(), y, rows, k_, n_);
      return;
    }
    if (scales_ == at::kByte) {  // the K-quants' scales as stored
      run_q4(x, scales<uint8_t>(), y, rows);
      return;
    }
    if (scales_ == at::kFloat) {
      if (q4_)
        run_q4(x, scales<float>(), y, rows);
      else
        run_q8(x, scales<float>(), y, rows);
      return;
    }
    if (q4_)
      run_q4(x, scales<uint16_t>(), y, rows);  // fp16 bits
    else
      run_q8(x, scales<uint16_t>(), y, rows);
  }

 private:
  template <typename S>
  const S* scales() const {
    return reinterpret_cast<const S*>(base_[1]);
  }
  template <typename S>  // Q8 blocks take int16 activations whenever Q4 rounds them
  void run_q8(const float* x, const S* scales, float* y, int64_t rows) const {
    const auto* qs = reinterpret_cast<const int8_t*>(base_[0]);
    if (bits_ < 32)
      q8a16_gemm(x, qs, scales, y, rows, k_, n_);
    else
      q8_gemm(x, qs, scales, y, rows, k_, n_);
  }
  template <typename S>  // fp16 (uint16_t) or float32 d and m, or K-quants' (uint8_t)
  void run_q4(const float* x, const S* scales, float* y, int64_t rows) const {
    using Gemm = void (*)(const float*, const uint8_t*, const S*, float*, int64_t, int64_t,
                          int64_t, int);
    Gemm four = nullptr, five = nullptr;
    if constexpr (!std::is_same_v<S, uint8_t>) four = q4_gemm, five = q5_gemm;
    if (bits_ == 8) four = q4a8_gemm, five = q5a8_gemm;
    if (bits_ == 16) four = q4a16_gemm, five = q5a16_gemm;
    TORCH_CHECK(four != nullptr, "the K-quants' scales as stored need rounded activations");
    const auto* qs = reinterpret_cast<const uint8_t*>(base_[0]);
    (q5_ ? five : four)(x, qs, scales, y, rows, k_, n_, derived_m_);  // Q4_0 / Q5_0: d alone
  }

  at::Tensor a_, b_;  // the weights and their scales, kept alive
  int64_t bits_;
  int64_t tiles_;
  const char* base_[2];
  int64_t tile_bytes_[2];
  bool q4_, int8_, q5_, q6_;  // q4_: a GGUF's 4-, 5- or 6-bit blocks
  at::ScalarType scales_;
  int64_t n_, k_;
  int derived_m_;
};

static const float* data_or_null(const at::Tensor& t) {
  return t.numel() ? t.data_ptr<float>() : nullptr;
}

// A matrix made of parts along its outputs (q, k and v), each a Mat: one where a single
// kind of decode weight holds them all; else each part's own (a Q4_K_M file's Q6_K v beside
// Q4_K q and k), run one after another into its columns.
class Parts {
 public:
  Parts(const std::vector<at::Tensor>& t, size_t first, size_t count, int64_t bits) {
    for (size_t i = 0; i < count; ++i)
      parts_.emplace_back(t[first + 2 * i], t[first + 2 * i + 1], bits);
    for (const Mat& m : parts_) TORCH_CHECK(m.k() == parts_[0].k(), "parts of one input size");
    for (const Mat& m : parts_) n_ += m.n();
  }

  int64_t n() const { return n_; }
  ChunkPool::Ahead ahead(int64_t rows) const { return parts_[0].ahead(rows); }

  void operator()(const float* x, float* y, int64_t rows) const {
    if (parts_.size() == 1) {
      parts_[0](x, y, rows);
      return;
    }
    std::vector<float> part;
    int64_t at = 0;
    for (const Mat& m : parts_) {
      if (rows == 1) {  // one row: each part's outputs are a stretch of y
        m(x, y + at, 1);
      } else {
        part.resize(rows * m.n());
        m(x, part.data(), rows);
        for (int64_t r = 0; r < rows; ++r)
          std::copy_n(part.data() + r * m.n(), m.n(), y + r * n_ + at);
      }
      at += m.n();
    }
  }

 private:
  std::vector<Mat> parts_;
  int64_t n_ = 0;
};

// A layer's matrices and vectors, their pointers read once (Mat).
struct Layer {
  // attn_norm, wqkv (2 tensors a part: 1 to 3 parts), bqkv, q_norm, k_norm, wo (2), ffn_norm,
  // gate_up (2), down (2); empty tensors where absent.
  Layer(const std::vector<at::Tensor>& t, int64_t bits)
      : tensors(t), at(t.size() - 10), attn_norm(data_or_null(t[0])),
        bqkv(data_or_null(t[at])), q_norm(data_or_null(t[at + 1])),
        k_norm(data_or_null(t[at + 2])), ffn_norm(data_or_null(t[at + 5])),
        wqkv(t, 1, (at - 1) / 2, bits), wo(t[at + 3], t[at + 4], bits),
        gate_up(t[at + 6], t[at + 7], bits), down(t[at + 8], t[at + 9], bits) {}
  std::vector<at::Tensor> tensors;  // kept alive
  size_t at;  // where bqkv lies, after wqkv's parts
  const float *attn_norm, *bqkv, *q_norm, *k_norm, *ffn_norm;  // null where absent
  Parts wqkv;
  Mat wo, gate_up, down;
};

// A row's first largest value's index, and whether the row holds no NaN and its largest value
// is finite (numpy's isfinite(max(x)), NaN propagating): two passes while it is in the caches.
struct Best {
  int64_t index;
  bool finite;
};
static Best best_of(const float* x, int64_t n) {
  float top = -INFINITY;
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 tops = _mm512_set1_ps(-INFINITY);
  __mmask16 nans = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nans |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    tops = _mm512_max_ps(tops, v);
  }
  top = _mm512_reduce_max_ps(tops);
  nan = nans != 0;
#endif
  for (; i < n; ++i) nan |= x[i] != x[i], top = std::max(top, x[i]);
  if (nan || !std::isfinite(top)) return {0, false};
  i = 0;
#if defined(__AVX512F__)
  for (const __m512 t = _mm512_set1_ps(top); i + 16 <= n; i += 16)
    if (const __mmask16 at = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), t, _CMP_EQ_OQ))
      return {i + __builtin_ctz(at), true};
#endif
  for (; i < n; ++i)
    if (x[i] == top) return {i, true};
  return {0, true};  // not reached: top is one of x
}

// A token's embedding row, from a float32 table [vocab, d_model] or from embedding.py's
// compact rows: int8 q [vocab, d_model] times a float32 scale [vocab, d_model / group], plus
// a float32 offset there if any: the product, then one rounded addition, as torch's.
class Embedding {
 public:
  explicit Embedding(const std::vector<at::Tensor>& t) : tensors_(t) {
    TORCH_CHECK(t.size() == 1 || t.size() == 3, "an embedding: a table, or q, scale, offset");
    for (const auto& x : t) TORCH_CHECK(x.is_contiguous() && x.device().is_cpu());
    vocab_ = t[0].size(0), width_ = t[0].size(1);
    if (t.size() == 1) {
      TORCH_CHECK(t[0].dtype() == at::kFloat && t[0].dim() == 2);
      table_ = t[0].data_ptr<float>();
      return;
    }
    TORCH_CHECK(t[0].dtype() == at::kChar && t[0].dim() == 2 && t[1].dtype() == at::kFloat &&
                t[1].dim() == 2 && t[1].size(0) == vocab_ && width_ % t[1].size(1) == 0);
    q_ = t[0].data_ptr<int8_t>(), scale_ = t[1].data_ptr<float>();
    groups_ = t[1].size(1), group_ = width_ / groups_;
    if (t[2].numel()) {
      TORCH_CHECK(t[2].dtype() == at::kFloat && t[2].sizes() == t[1].sizes());
      offset_ = t[2].data_ptr<float>();
    }
  }

  int64_t vocab() const { return vocab_; }
  int64_t width() const { return width_; }

  void row(int64_t token, float* out) const {
    if (table_) {
      std::copy_n(table_ + token * width_, width_, out);
      return;
    }
    const int8_t* q = q_ + token * width_;
    for (int64_t g = 0; g < groups_; ++g) {
      const float s = scale_[token * groups_ + g];
      const float o = offset_ ? offset_[token * groups_ + g] : 0.0f;
      for (int64_t j = g * group_; j < (g + 1) * group_; ++j) {
        // Where there is an offset the product is exact (q < 32), so even a fused
        // multiply-add rounds once, as torch's multiply, then add.
        out[j] = offset_ ? static_cast<float>(q[j]) * s + o : static_cast<float>(q[j]) * s;
      }
    }
  }

 private:
  std::vector<at::Tensor> tensors_;  // kept alive: the pointers below are theirs
  const float* table_ = nullptr;
  const int8_t* q_ = nullptr;
  const float *scale_ = nullptr, *offset_ = nullptr;
  int64_t vocab_ = 0, width_ = 0, groups_ = 0, group_ = 0;
};

class DecodeStack {
 public:
  // Each layer: attn_norm, wqkv (2 tensors a part), bqkv, q_norm, k_norm, wo (2), ffn_norm,
  // gate_up (2), down (2), each matrix int8, Q4 or Q8_0 (Mat); empty tensors where absent.
  // q4_activation_bits: what the Q4 and Q5 matrices multiply (32: float32, 16, 8).
  // embed: the embedding, as `Embedding` takes it (`logits` reads its rows). head: the
  // output matrix's two tensors where it is a decode weight, with what its activations are
  // rounded to (`logits` runs it; each step's idle threads ask for its first bytes), or none.
  DecodeStack(const std::vector<std::vector<at::Tensor>>& layers, at::Tensor final_norm,
              at::Tensor cos, at::Tensor sin, int64_t n_heads, int64_t n_kv_heads,
              int64_t head_dim, double eps, int64_t q4_activation_bits,
              const std::vector<at::Tensor>& embed, const std::vector<at::Tensor>& head,
              int64_t head_activation_bits)
      : embed_(embed), final_norm_(final_norm), cos_(cos), sin_(sin), n_heads_(n_heads),
        n_kv_heads_(n_kv_heads), head_dim_(head_dim), eps_(static_cast<float>(eps)) {
    TORCH_CHECK(head_dim % 8 == 0 && cos.size(1) * 2 == head_dim);
    TORCH_CHECK(q4_activation_bits == 8 || q4_activation_bits == 16 || q4_activation_bits == 32);
    const int64_t bits = q4_activation_bits;
    for (const auto& t : layers) {
      TORCH_CHECK(t.size() == 13 || t.size() == 15 || t.size() == 17,
                  "11 tensors a layer, and 2 for each of wqkv's 1 to 3 parts");
      for (const auto& x : t) TORCH_CHECK(x.is_contiguous() && x.device().is_cpu());
      layers_.emplace_back(t, bits);
    }
    for (const auto& t : {final_norm, cos, sin})
      TORCH_CHECK(t.dtype() == at::kFloat && t.is_contiguous() && t.device().is_cpu());
    final_norm_at_ = final_norm.data_ptr<float>();
    cos_at_ = cos.data_ptr<float>(), sin_at_ = sin.data_ptr<float>();
    TORCH_CHECK(head.empty() || head.size() == 2, "the head: two tensors or none");
    if (head.size() == 2) head_ = Mat{head[0], head[1], head_activation_bits};
  }

  // From token ids to float32 logits [B, vocab] in one call: the embedding's rows, forward,
  // then the head, with the bits of `forward` and then the head's own call (Model.logits).
  // From Python the same took five torch ops more a step, each 20-40 us while a step's
  // weights have just swept the caches (docs/performance.md, stop 38). Also each row's first
  // largest logit's index and whether the row is finite (no NaN, and its largest logit
  // finite, as sampling.finite_rows), as lists: read here while the logits are in the caches,
  // where numpy's max and argmax after a step took ~0.1 ms (stop 39).
  std::tuple<at::Tensor, std::vector<int64_t>, std::vector<bool>> logits(
      const std::vector<int64_t>& tokens, const std::vector<int64_t>& positions,
      const std::vector<int64_t>& slots, at::Tensor cache_k, at::Tensor cache_v) {
    TORCH_CHECK(head_, "this stack has no head");
    const int64_t B = static_cast<int64_t>(tokens.size()), D = embed_.width();
    TORCH_CHECK(B > 0 && positions.size() == tokens.size() && slots.size() == tokens.size());
    std::vector<float> x(B * D), h(B * D);
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(tokens[b] >= 0 && tokens[b] < embed_.vocab(), "token id out of range");
      embed_.row(tokens[b], x.data() + b * D);
    }
    layers(x.data(), B, positions.data(), slots.data(), cache_k, cache_v, h.data());
    const int64_t V = head_->n();
    auto y = at::empty({B, V});
    (*head_)(h.data(), y.data_ptr<float>(), B);
    ChunkPool::get().rest();  // the step's last call: its result goes to the server next
    std::vector<int64_t> best(B);
    std::vector<bool> finite(B);
    for (int64_t b = 0; b < B; ++b) {
      const Best row = best_of(y.data_ptr<float>() + b * V, V);
      best[b] = row.index, finite[b] = row.finite;
    }
    return {y, best, finite};
  }

  // x: [B, d_model] embeddings; positions and slots: int64 [B]; caches: float32 or float16
  // [layers, slots, kv_heads, ctx, head_dim]. Writes each row's k and v at its position (as
  // torch rounds them to float16) and returns the final-normed hidden states [B, d_model].
  at::Tensor forward(at::Tensor x, at::Tensor positions, at::Tensor slots,
                     at::Tensor cache_k, at::Tensor cache_v) {
    TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.size(1) == embed_.width());
    TORCH_CHECK(positions.dtype() == at::kLong && slots.dtype() == at::kLong &&
                positions.numel() == x.size(0) && slots.numel() == x.size(0));
    x = x.contiguous().clone();  // the residual stream, written in place
    positions = positions.contiguous(), slots = slots.contiguous();
    auto out = at::empty_like(x);
    layers(x.data_ptr<float>(), x.size(0), positions.data_ptr<int64_t>(),
           slots.data_ptr<int64_t>(), cache_k, cache_v, out.data_ptr<float>());
    return out;
  }

 private:
  // The layers and the final norm over the B rows of xs (overwritten: the residual stream),
  // into out [B, d_model], the caches float32 or float16. Pointers, not tensors: at batch 1
  // each torch tensor made cost a few microseconds, most of them cache misses (stop 40).
  void layers(float* xs, int64_t B, const int64_t* pos, const int64_t* slot,
              const at::Tensor& cache_k, const at::Tensor& cache_v, float* out) {
    const auto kind = cache_k.scalar_type();
    TORCH_CHECK((kind == at::kFloat || kind == at::kHalf) &&
                cache_v.scalar_type() == kind && cache_k.is_contiguous() &&
                cache_v.is_contiguous() && cache_k.size(4) == head_dim_);
    if (kind == at::kHalf)
      step(xs, B, pos, slot, reinterpret_cast<uint16_t*>(cache_k.data_ptr<at::Half>()),
           reinterpret_cast<uint16_t*>(cache_v.data_ptr<at::Half>()), cache_k.sizes(), out);
    else
      step(xs, B, pos, slot, cache_k.data_ptr<float>(), cache_v.data_ptr<float>(),
           cache_k.sizes(), out);
  }

  // layers' step over caches of T: float, or uint16_t (float16 bits).
  template <typename T>
  void step(float* xs, int64_t B, const int64_t* pos, const int64_t* slot, T* kc, T* vc,
            at::IntArrayRef cache_shape, float* out) {
    const int64_t D = embed_.width(), hd = head_dim_, half = hd / 2;
    const int64_t nh = n_heads_, nkv = n_kv_heads_;
    const int64_t n_slots = cache_shape[1], ctx = cache_shape[3];
    const int64_t row_stride = nkv * ctx * hd, layer_stride = n_slots * row_stride;
    std::vector<int64_t> lengths(B);  // the positions each row attends over
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(pos[b] >= 0 && pos[b] < ctx && pos[b] < cos_.size(0) && slot[b] >= 0 &&
                  slot[b] < n_slots, "position or slot out of range");
      lengths[b] = pos[b] + 1;
    }
    const int64_t n_qkv = layers_[0].wqkv.n(), ffn = layers_[0].down.k();
    std::vector<float> h(B * D), qkv(B * n_qkv), att(B * nh * hd), gu(B * 2 * ffn), act(B * ffn),
        y(B * D);
    decode_math::CacheAttention attention(nh, nkv, hd);
    std::vector<const T*> k_rows(B), v_rows(B);

    // Each pooled call names the matrix after it, for threads left waiting (ChunkPool::ahead).
    ChunkPool& pool = ChunkPool::get();
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& w = layers_[l];
      for (int64_t b = 0; b < B; ++b)
        rms_norm(xs + b * D, w.attn_norm, h.data() + b * D, D, eps_);
      pool.ahead(w.wo.ahead(B));
      w.wqkv(h.data(), qkv.data(), B);
      const float *bias = w.bqkv, *qn = w.q_norm, *kn = w.k_norm;
      for (int64_t b = 0; b < B; ++b) {
        float* r = qkv.data() + b * n_qkv;
        if (bias) add_into(r, bias, n_qkv);
        const float* c = cos_at_ + pos[b] * half;
        const float* s = sin_at_ + pos[b] * half;
        for (int64_t head = 0; head < nh + nkv; ++head) {  // q heads, then k heads
          float* x_head = r + head * hd;
          const float* norm = head < nh ? qn : kn;
          if (norm) rms_norm(x_head, norm, x_head, hd, eps_);
          rope(x_head, c, s, half);
        }
        for (int64_t kh = 0; kh < nkv; ++kh) {
          const int64_t at = l * layer_stride + slot[b] * row_stride + (kh * ctx + pos[b]) * hd;
          decode_math::put(kc + at, r + (nh + kh) * hd, hd);
          decode_math::put(vc + at, r + (nh + nkv + kh) * hd, hd);
        }
      }
      for (int64_t b = 0; b < B; ++b) {
        k_rows[b] = kc + l * layer_stride + slot[b] * row_stride;
        v_rows[b] = vc + l * layer_stride + slot[b] * row_stride;
      }
      pool.ahead(w.wo.ahead(B));
      attention(B, qkv.data(), n_qkv, k_rows.data(), v_rows.data(), ctx * hd, lengths.data(),
                att.data());
      pool.ahead(w.gate_up.ahead(B));
      w.wo(att.data(), y.data(), B);
      add_into(xs, y.data(), B * D);
      for (int64_t b = 0; b < B; ++b)
        rms_norm(xs + b * D, w.ffn_norm, h.data() + b * D, D, eps_);
      pool.ahead(w.down.ahead(B));
      w.gate_up(h.data(), gu.data(), B);
      for (int64_t b = 0; b < B; ++b) silu_mul(gu.data() + b * 2 * ffn, act.data() + b * ffn, ffn);
      if (l + 1 < layers_.size())
        pool.ahead(layers_[l + 1].wqkv.ahead(B));
      else if (head_)
        pool.ahead(head_->ahead(B));
      w.down(act.data(), y.data(), B);
      add_into(xs, y.data(), B * D);
    }
    for (int64_t b = 0; b < B; ++b)
      rms_norm(xs + b * D, final_norm_at_, out + b * D, D, eps_);
    // For the head's call, which comes next: the next step's first matrix.
    if (head_) pool.ahead(layers_[0].wqkv.ahead(B));
  }

  std::vector<Layer> layers_;
  std::optional<Mat> head_;
  Embedding embed_;
  at::Tensor final_norm_, cos_, sin_;
  const float *final_norm_at_, *cos_at_, *sin_at_;  // their data, read once
  int64_t n_heads_, n_kv_heads_, head_dim_;
  float eps_;
};

// A prefill chunk's norms, RoPE and SiLU (Model.forward's, where the CPU kernels are
// loaded) with the decode step's own arithmetic above, row by row on torch's threads: ~25
// small torch ops a layer each made a pass over the chunk's activations and left the other
// thread waiting (~13% of SmolLM2's 2k-token prefill here).

// x [rows, n] (rows may be strided), w [n]: each row's RMSNorm, [rows, n].
static at::Tensor rows_rms_norm(at::Tensor x, at::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 &&
                  w.scalar_type() == at::kFloat && w.is_contiguous() &&
                  w.numel() == x.size(1), "x [rows, n] float32, w [n] float32");
  const int64_t n = x.size(1), stride = x.stride(0);
  auto out = at::empty({x.size(0), n}, x.options());
  const float *in = x.data_ptr<float>(), *weight = w.data_ptr<float>();
  float* o = out.data_ptr<float>();
  parallel_chunks(x.size(0), 8, [&](int64_t r) {
    rms_norm(in + r * stride, weight, o + r * n, n, static_cast<float>(eps));
  });
  return out;
}

// gu [rows, 2 n], each row [gate | up]: silu(gate) * up, [rows, n].
static at::Tensor rows_silu_mul(at::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.scalar_type() == at::kFloat && gu.is_contiguous() &&
                  gu.size(1) % 2 == 0, "gu [rows, 2 n] float32, contiguous");
  const int64_t n = gu.size(1) / 2;
  auto out = at::empty({gu.size(0), n}, gu.options());
  const float* in = gu.data_ptr<float>();
  float* o = out.data_ptr<float>();
  parallel_chunks(gu.size(0), 8, [&](int64_t r) { silu_mul(in + r * 2 * n, o + r * n, n); });
  return out;
}

// x [rows, heads, hd] (rows may be strided), cos and sin [rows, hd / 2]: rotate-half RoPE of
// every head, [rows, heads, hd].
static at::Tensor rows_rope(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1 &&
                  x.stride(1) == x.size(2) && x.size(2) % 2 == 0, "x [rows, heads, hd] float32");
  const int64_t rows = x.size(0), heads = x.size(1), hd = x.size(2), half = hd / 2;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.size(0) == rows && cos.size(1) == half, "cos, sin [rows, hd / 2] float32");
  auto out = at::empty({rows, heads, hd}, x.options());
  const float *in = x.data_ptr<float>(), *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t stride = x.stride(0);
  parallel_chunks(rows, 8, [&](int64_t r) {
    float* row = o + r * heads * hd;
    std::copy_n(in + r * stride, heads * hd, row);
    for (int64_t h = 0; h < heads; ++h) rope(row + h * hd, c + r * half, s + r * half, half);
  });
  return out;
}

// What this build's code uses, as the ready line and /v1/models name it.
static std::string isa() {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  return amx_status() == "on" ? "avx512+vnni+amx" : "avx512+vnni";
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
  m.def("amx", &amx_status, "whether prefill chunks' Q4 and Q5 matmuls take AMX tiles (\"on\"), "
        "or why not");
  m.def("set_amx", &set_amx, "AMX on (where it is \"on\") or off: the same bits either way");
  m.def("int8_linear", &int8_linear, "y = x . (q * scale)^T, q packed by pack_int8");
  m.def("q4_linear", &q4_linear, "y = x . W^T, W a GGUF's 4-bit blocks packed by pack_q4");
  m.def("q8_linear", &q8_linear, "y = x . W^T, W a GGUF's Q8_0 blocks packed by pack_q8");
  m.def("q8a16_linear", &q8a16_linear, "q8_linear with x rounded to int16 per block of 32");
  m.def("q6a16_linear", &q6a16_linear,
        "y = x . W^T, W a GGUF's Q6_K blocks packed by pack_q6, x rounded to int16 per 32");
  m.def("q4a8_linear", &q4a8_linear, "q4_linear with x rounded to int8 per block of 32");
  m.def("q4a16_linear", &q4a16_linear, "q4_linear with x rounded to int16 per block of 32");
  m.def("block_bits", &block_bits,
        "q uint8 [N, K] of a matrix's GGUF parts' blocks (block_bits.torch_bits), stacked");
  m.def("pack_blocks", &pack_blocks,
        "those weights as pack_q4 (0 bit planes), pack_q5 (1) or pack_q6 (2) lay out qs");
  m.def("pack_blocks_q8", &pack_blocks_q8,
        "those weights less an offset as pack_q8 lays out its int8 qs");
  m.def("blocks_k_scales", &blocks_k_scales,
        "the K-quant parts' scales as pack_k_scales lays out int4.k_scales'");
  m.def("blocks_q6_scales", &blocks_q6_scales,
        "the Q6_K parts' scales as pack_q6_scales lays out q6_weight.q6_k_scales'");
  m.def("blocks_q6_group_scales", &blocks_q6_group_scales,
        "the Q6_K parts' d * sc as pack_q8_scales lays out q6_weight.group_scales'");
  m.def("rows_rms_norm", &rows_rms_norm, "each row's RMSNorm, as a decode step's");
  m.def("rows_silu_mul", &rows_silu_mul, "silu(gate) * up of rows [gate | up], as a decode step's");
  m.def("rows_rope", &rows_rope, "rotate-half RoPE of rows [rows, heads, hd], as a decode step's");
  m.def("prefill_attention", &prefill_attention,
        "causal attention of a chunk at positions start.. over one slot's cache "
        "(float32 or float16)");
  // module_local: a process may load several builds (a failed self-check, then the next
  // target), and pybind11 registers a type once per process otherwise.
  pybind11::class_<DecodeStack>(m, "DecodeStack", pybind11::module_local())
      .def(pybind11::init<const std::vector<std::vector<at::Tensor>>&, at::Tensor,
                          at::Tensor, at::Tensor, int64_t, int64_t, int64_t, double,
                          int64_t, const std::vector<at::Tensor>&,
                          const std::vector<at::Tensor>&, int64_t>())
      .def("forward", &DecodeStack::forward)
      .def("logits", &DecodeStack::logits);
}
