#include "cpu_kernels.h"
#include "decode_math.h"

#include <cmath>
#include <numbers>
#include <vector>

// Causal softmax attention of a prefill chunk over one slot's KV cache: row i of the
// chunk (position start + i) sees keys 0..start + i. Unlike a decode step, which reads each
// key once for one query per head and is bound by memory, a chunk reuses every key for all
// its rows, so this is FLOP-bound and laid out like a matmul:
//
// - A task is one kv head and a block of rows: QUERIES queries (rows x the query heads that
//   share the kv head), transposed once so the 16 lanes of a vector are 16 queries. Then
//   scores, softmax and the weighted values are all lane by lane: no sum across lanes, no
//   transposed keys, and each query's running max and sum are plain vectors.
// - Keys are taken KEY_BLOCK at a time from position 0 (flash attention's online softmax):
//   the block's scores, their max, e^(score - max) and the values they weigh, the earlier
//   sum and output rescaled by e^(old max - new max).
// - Scores are tiles of TILE keys x VECS query vectors, the weighted values tiles of TILE
//   dims x VECS query vectors: 24 accumulators of AVX-512's 32 registers, or 4 (8 ymm) of
//   AVX2's 16.
//
// A query's bits depend on its position and the keys alone, not on the chunk or the block it
// falls in: blocks start at multiples of KEY_BLOCK from key 0, every sum runs in key or dim
// order, and a key a query may not see adds an exact 0 (a block it sees none of rescales by
// exactly e^0 = 1). So a prompt prefilled in one chunk or several, alone or beside others,
// gives each row the same attention.
//
// A float16 cache's block of keys and values is widened to float32 once for all the task's
// queries (exactly: the same scores as a float32 cache holding the float16 values).

namespace {

using namespace decode_math;

#if defined(__AVX512F__)
constexpr int TILE = 8, VECS = 3;
// Lanes where key <= limit keep x, the others take `other`.
inline f32x16 visible(f32x16 x, f32x16 key, f32x16 limit, f32x16 other) {
  return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(key.v, limit.v, _CMP_LE_OQ), other.v, x.v)};
}
#else
constexpr int TILE = 4, VECS = 1;
inline f32x16 visible(f32x16 x, f32x16 key, f32x16 limit, f32x16 other) {
  return {_mm256_blendv_ps(other.lo, x.lo, _mm256_cmp_ps(key.lo, limit.lo, _CMP_LE_OQ)),
          _mm256_blendv_ps(other.hi, x.hi, _mm256_cmp_ps(key.hi, limit.hi, _CMP_LE_OQ))};
}
#endif
// Each task reads all its kv head's keys and values once, so more queries a task means fewer
// passes over a long cache (past ~2k positions it comes from L3 or memory): 192 queries and
// blocks of 128 keys ran 1.1-1.3x the speed of 96 and 64 at 16k positions here.
constexpr int64_t KEY_BLOCK = 128;
constexpr int64_t QUERIES = 192;

// s[t][v] = sum over d of k[t][d] * q[d][v] for T keys (hd apart) and V query vectors (q's
// rows and s's `width` floats apart); top[v], where given, takes the max of its T scores.
template <int T, int V>
void score_tile(const float* q, const float* k, int64_t hd, float* s, int64_t width,
                f32x16* top) {
  f32x16 acc[T][V];
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < V; ++v) acc[t][v] = zeros();
  for (int64_t d = 0; d < hd; ++d) {
    f32x16 qd[V];
    for (int v = 0; v < V; ++v) qd[v] = load(q + d * width + 16 * v);
    for (int t = 0; t < T; ++t) {
      const f32x16 kd = splat(k[t * hd + d]);
      for (int v = 0; v < V; ++v) acc[t][v] = fmadd(kd, qd[v], acc[t][v]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < V; ++v) store(s + t * width + 16 * v, acc[t][v]);
  if (top)
    for (int v = 0; v < V; ++v)
      for (int t = 0; t < T; ++t) top[v] = vmax(top[v], acc[t][v]);
}

// o[t][v] = o[t][v] * alpha[v] + sum over keys n of val[n][t] * p[n][v], for T dims and V
// query vectors (val's keys hd apart; p's, o's rows and alpha `width` floats apart).
template <int T, int V>
void value_tile(const float* p, const float* val, int64_t hd, int64_t keys, const float* alpha,
                float* o, int64_t width) {
  f32x16 acc[T][V];
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < V; ++v) acc[t][v] = mul(load(o + t * width + 16 * v), load(alpha + 16 * v));
  for (int64_t n = 0; n < keys; ++n) {
    f32x16 pn[V];
    for (int v = 0; v < V; ++v) pn[v] = load(p + n * width + 16 * v);
    for (int t = 0; t < T; ++t) {
      const f32x16 x = splat(val[n * hd + t]);
      for (int v = 0; v < V; ++v) acc[t][v] = fmadd(x, pn[v], acc[t][v]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < V; ++v) store(o + t * width + 16 * v, acc[t][v]);
}

// f<T, V>() for T in 1..TILE and V in 1..VECS known when compiled.
template <int T = TILE, int V = VECS, typename F>
void with_tile(int t, int v, const F& f) {
  if constexpr (T > 1)
    if (t < T) return with_tile<T - 1, V>(t, v, f);
  if constexpr (V > 1)
    if (v < V) return with_tile<T, V - 1>(t, v, f);
  f.template operator()<T, V>();
}

template <typename T>  // the cache's: float, or uint16_t (float16 bits)
struct Task {
  const float* q;   // row r's head h at q + r * q_row + h * hd
  int64_t q_row;
  const T* k;       // kv head kh's position t at k + kh * kv_head + t * hd
  const T* v;
  int64_t kv_head;
  float* out;       // [rows, heads, hd]
  int64_t start, heads, kv_heads, hd;
  float scale;
};

// The queries of kv head kh for rows [r0, r1).
template <typename T>
void attend_block(const Task<T>& a, int64_t kh, int64_t r0, int64_t r1) {
  const int64_t group = a.heads / a.kv_heads, hd = a.hd, n = (r1 - r0) * group;
  const int64_t vecs = (n + 15) / 16, width = vecs * 16;
  const int64_t last = a.start + r1 - 1;  // the last key any of them sees
  thread_local std::vector<float> qt, s, o, limit, top, sum, alpha, key_block, value_block;
  qt.assign(hd * width, 0.0f);
  s.resize(KEY_BLOCK * width);
  o.assign(hd * width, 0.0f);
  limit.resize(width);
  top.assign(width, -INFINITY);
  sum.assign(width, 0.0f);
  alpha.resize(width);
  key_block.resize(KEY_BLOCK * hd);  // a float16 block widened (decode_math's `widened`)
  value_block.resize(KEY_BLOCK * hd);
  for (int64_t m = 0; m < width; ++m) {  // query m: row r0 + m / group, head m % group
    limit[m] = static_cast<float>(m < n ? a.start + r0 + m / group : last);
    if (m >= n) continue;
    const float* src = a.q + (r0 + m / group) * a.q_row + (kh * group + m % group) * hd;
    for (int64_t d = 0; d < hd; ++d) qt[d * width + m] = src[d];
  }
  const T* keys = a.k + kh * a.kv_head;
  const T* values = a.v + kh * a.kv_head;
  const f32x16 scale = splat(a.scale * std::numbers::log2e_v<float>);  // e^(s x) = 2^(s x log2 e)
  for (int64_t k0 = 0; k0 <= last; k0 += KEY_BLOCK) {
    const int64_t nk = std::min(KEY_BLOCK, last + 1 - k0);
    // The next block's keys and values into L2 meanwhile (a block computes long enough).
    const int64_t next = std::min(KEY_BLOCK, last + 1 - k0 - nk) * hd;
    for (int64_t i = 0; i < next; i += 64 / sizeof(T)) {
      _mm_prefetch(reinterpret_cast<const char*>(keys + (k0 + nk) * hd + i), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(values + (k0 + nk) * hd + i), _MM_HINT_T1);
    }
    const float* kb = widened(keys + k0 * hd, nk * hd, key_block.data());
    const float* vb = widened(values + k0 * hd, nk * hd, value_block.data());
    // Only blocks past the first row's position hold keys some query may not see.
    const bool masked = k0 + nk - 1 > a.start + r0;
    // Query vector v's softmax over the block's scores, in place; its running max and sum,
    // and alpha, what its earlier output is scaled by. block_top: the max of its scores in
    // the block, taken by score_tile where every query sees every key.
    auto softmax = [&](int64_t v, f32x16 block_top) {
      float* sv = s.data() + 16 * v;
      const f32x16 lim = load(limit.data() + 16 * v);
      const f32x16 top_v = load(top.data() + 16 * v);
      if (masked) {  // the max over the keys each query sees, in four chains (exact in any
                     // order): one chain waited on each load
        f32x16 tops[4];
        for (auto& x : tops) x = splat(-INFINITY);
        auto seen = [&](int64_t t) {  // key k0 + t's scores, -inf where a query may not see it
          return visible(load(sv + t * width), splat(static_cast<float>(k0 + t)), lim,
                         splat(-INFINITY));
        };
        int64_t i = 0;
        for (; i + 4 <= nk; i += 4)
          for (int j = 0; j < 4; ++j) tops[j] = vmax(tops[j], seen(i + j));
        for (; i < nk; ++i) tops[0] = vmax(tops[0], seen(i));
        block_top = vmax(vmax(tops[0], tops[1]), vmax(tops[2], tops[3]));
      }
      const f32x16 new_top = vmax(top_v, block_top);
      const f32x16 rescale = exp2_nonpositive(mul(sub(top_v, new_top), scale));
      const f32x16 shift = sub(zeros(), mul(new_top, scale));
      f32x16 total = mul(load(sum.data() + 16 * v), rescale);
      for (int64_t t = 0; t < nk; ++t) {  // a hidden key's x may pass 0: visible() drops it
        f32x16 p = exp2_nonpositive(fmadd(load(sv + t * width), scale, shift));
        if (masked) p = visible(p, splat(static_cast<float>(k0 + t)), lim, zeros());
        store(sv + t * width, p);
        total = add(total, p);
      }
      store(top.data() + 16 * v, new_top);
      store(sum.data() + 16 * v, total);
      store(alpha.data() + 16 * v, rescale);
    };
    // VECS query vectors at a time through scores, softmax and values (with_tile picks V):
    // their queries, scores and outputs (12 + 24 + 12 KiB at 64 dims) stay in L1, where the
    // whole block's scores (96 KiB) did not. 1.05-1.08x as fast, the same bits.
    for (int64_t v0 = 0; v0 < vecs; v0 += VECS)
      with_tile(TILE, std::min<int64_t>(VECS, vecs - v0), [&]<int, int V>() {
        f32x16 block_top[V];
        for (auto& x : block_top) x = splat(-INFINITY);
        for (int64_t t = 0; t < nk; t += TILE)
          with_tile(std::min<int64_t>(TILE, nk - t), V, [&]<int T_, int>() {
            score_tile<T_, V>(qt.data() + 16 * v0, kb + t * hd, hd,
                              s.data() + t * width + 16 * v0, width,
                              masked ? nullptr : block_top);
          });
        for (int64_t v = v0; v < v0 + V; ++v) softmax(v, block_top[v - v0]);
        for (int64_t d = 0; d < hd; d += TILE)
          value_tile<TILE, V>(s.data() + 16 * v0, vb + d, hd, nk, alpha.data() + 16 * v0,
                              o.data() + d * width + 16 * v0, width);
      });
  }
  for (int64_t m = 0; m < n; ++m) {
    const float r = 1.0f / sum[m];
    float* dst = a.out + ((r0 + m / group) * a.heads + kh * group + m % group) * hd;
    for (int64_t d = 0; d < hd; ++d) dst[d] = o[d * width + m] * r;
  }
}

template <typename T>
at::Tensor attend_chunk_rows(at::Tensor q, const T* k, const T* v, int64_t kv_stride,
                             int64_t kv_heads, int64_t start) {
  const int64_t rows = q.size(0), heads = q.size(1), hd = q.size(2);
  auto out = at::empty({rows, heads * hd}, q.options());
  const Task<T> task{q.data_ptr<float>(), q.stride(0), k, v, kv_stride, out.data_ptr<float>(),
                     start, heads, kv_heads, hd, 1.0f / std::sqrt(static_cast<float>(hd))};
  const int64_t per_block = std::max<int64_t>(1, QUERIES / (heads / kv_heads));
  const int64_t blocks = (rows + per_block - 1) / per_block;
  // The last rows see the most keys: handed out first, so no thread is left with a long one.
  parallel_chunks(blocks * kv_heads, 1, [&](int64_t i) {
    const int64_t block = blocks - 1 - i / kv_heads, kh = i % kv_heads;
    attend_block(task, kh, block * per_block, std::min(rows, (block + 1) * per_block));
  });
  return out;
}

}  // namespace

// q: [rows, heads, hd] float32 (rows may be strided), k and v: one slot's [kv_heads, ctx, hd]
// cache, float32 or float16, holding positions 0..start + rows - 1. Returns
// [rows, heads * hd].
at::Tensor prefill_attention(at::Tensor q, at::Tensor k, at::Tensor v,
                             int64_t start) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), "q [rows, heads, hd], "
              "k and v [kv_heads, ctx, hd]");
  const auto kind = k.scalar_type();
  TORCH_CHECK(q.scalar_type() == at::kFloat &&
                  (kind == at::kFloat || kind == at::kHalf) && v.scalar_type() == kind,
              "q float32, k and v both float32 or both float16");
  const int64_t rows = q.size(0), heads = q.size(1), hd = q.size(2), kv_heads = k.size(0);
  TORCH_CHECK(heads % kv_heads == 0 && k.size(2) == hd && hd % TILE == 0, "shapes");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == hd && k.stride(2) == 1 && k.stride(1) == hd &&
                  v.strides() == k.strides(), "layout");
  TORCH_CHECK(start >= 0 && start + rows <= k.size(1), "positions past the cache");
  if (kind == at::kHalf)
    return attend_chunk_rows(q, reinterpret_cast<const uint16_t*>(k.data_ptr<at::Half>()),
                             reinterpret_cast<const uint16_t*>(v.data_ptr<at::Half>()),
                             k.stride(0), kv_heads, start);
  return attend_chunk_rows(q, k.data_ptr<float>(), v.data_ptr<float>(), k.stride(0), kv_heads,
                           start);
}
