// Paged attention on the CPU: each query row attends to its sequence's keys and
// values where they lie in the block pool, with no gather.
//
// The torch path gathers a decode group's context slots into a padded batch
// (index_select) and then runs SDPA over the copy: the KV cache is read, written
// and read again. Decode attention is bound by memory traffic (at batch 64 and a
// few hundred tokens of context, a step reads about a gigabyte of K and V for
// SmolLM2-135M), so reading each row once, in place, is the whole point here.
//
// Layout (see attention.py): a layer's cache is [num_slots, num_kv_heads, head_dim],
// slot = block * block_size + offset. The kernel takes *query groups*: group i is
// group_size[i] consecutive tokens of the step's batch starting at group_token[i],
// all of sequence group_seq[i] (a row of block_tables); its first token sees the
// first group_len[i] positions of the sequence and each later one a position more,
// which is the causal mask. A decode is a group of one; a short chunk after some
// context (speculative guesses, a prompt's tail after a prefix-cache hit) is a group
// of its tokens.
//
// Work items are (group, kv head); the grouped query heads of a KV head share each
// key and value load. Softmax is exact (max-subtracted, two passes over the
// scores), in float32. GCC vector extensions keep it portable: -march=native picks
// AVX-512, AVX2 or SSE at build time, on the machine that runs it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "vec.h"

namespace {

// Scores in place -> exp(score - max(scores)); returns their sum.
inline float softmax_numerators(float* s, int64_t n) {
  vf mv = splat(-INFINITY);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const vf v = load(s + i);
    mv = v > mv ? v : mv;
  }
  float max = -INFINITY;
  for (int j = 0; j < W; j++) max = mv[j] > max ? mv[j] : max;
  for (; i < n; i++) max = s[i] > max ? s[i] : max;
  const vf m = splat(max);
  vf acc{};
  for (i = 0; i + W <= n; i += W) {
    const vf e = vexp(load(s + i) - m);
    store(s + i, e);
    acc += e;
  }
  float sum = hsum(acc);
  if (i < n) {  // the tail, padded with values that exp to 0
    float tail[W];
    for (int j = 0; j < W; j++) tail[j] = i + j < n ? s[i + j] : max - 100.f;
    const vf e = vexp(load(tail) - m);
    for (int64_t j = 0; i + j < n; j++) {
      s[i + j] = e[j];
      sum += e[j];
    }
  }
  return sum;
}

struct Scratch {
  std::vector<float> scores, inv;
  std::vector<vf> qv, acc;
};

// One (query group, KV head) work item. The group's query j (token j of the group)
// sees the first len0 + j positions of its sequence; its G query heads share the
// KV head, so every key and value row is loaded once for all of them.
template <int D>
void attend_group(const float* q, int64_t q_stride, const float* k_cache, const float* v_cache,
                  const int64_t* table, int64_t len0, int64_t num_queries, int64_t block_size, int64_t kv_stride,
                  int64_t groups, float scale, float* out, int64_t out_stride, Scratch& s) {
  constexpr int V = D / W;
  const int64_t len = len0 + num_queries - 1, rows = num_queries * groups;
  s.scores.resize(rows * len);
  s.inv.resize(rows);
  s.qv.resize(rows * V);
  s.acc.assign(rows * V, vf{});
  for (int64_t j = 0; j < num_queries; j++)
    for (int64_t g = 0; g < groups; g++)
      for (int c = 0; c < V; c++) s.qv[(j * groups + g) * V + c] = load(q + j * q_stride + g * D + c * W) * scale;

  // Scores, W positions at a time: each row's W dot products end in one transposing sum. A query
  // row may get scores past what it sees (a chunk's earlier tokens); softmax and the value pass
  // read only the positions it sees.
  for (int64_t start = 0; start < len; start += block_size) {
    const int64_t base = table[start / block_size] * block_size;
    const int64_t count = std::min(block_size, len - start);
    for (int64_t off = 0; off < count; off += W) {
      const int64_t n = std::min<int64_t>(W, count - off), p0 = start + off;
      const float* k0 = k_cache + (base + off) * kv_stride;
      for (int64_t row = std::max<int64_t>(0, p0 - len0 + 1) * groups; row < rows; row++) {
        const vf* qr = &s.qv[row * V];
        vf dots[W];
        for (int64_t i = 0; i < n; i++) {
          const float* k = k0 + i * kv_stride;
          vf acc = load(k) * qr[0];
          for (int c = 1; c < V; c++) acc += load(k + c * W) * qr[c];
          dots[i] = acc;
        }
        for (int64_t i = n; i < W; i++) dots[i] = vf{};
        const vf sums = hsum16(dots);
        float* out_scores = &s.scores[row * len + p0];
        if (n == W) {
          store(out_scores, sums);
        } else {
          for (int64_t i = 0; i < n; i++) out_scores[i] = sums[i];
        }
      }
    }
  }
  for (int64_t row = 0; row < rows; row++)
    s.inv[row] = 1.f / softmax_numerators(&s.scores[row * len], len0 + row / groups);

  for (int64_t start = 0; start < len; start += block_size) {
    const int64_t base = table[start / block_size] * block_size;
    const int64_t count = std::min(block_size, len - start);
    for (int64_t i = 0; i < count; i++) {
      const int64_t p = start + i;
      const float* v = v_cache + (base + i) * kv_stride;
      vf vv[V];
      for (int c = 0; c < V; c++) vv[c] = load(v + c * W);
      for (int64_t row = std::max<int64_t>(0, p - len0 + 1) * groups; row < rows; row++) {
        const vf w = splat(s.scores[row * len + p]);
        vf* acc = &s.acc[row * V];
        for (int c = 0; c < V; c++) acc[c] += w * vv[c];
      }
    }
  }
  for (int64_t j = 0; j < num_queries; j++)
    for (int64_t g = 0; g < groups; g++) {
      const int64_t row = j * groups + g;
      for (int c = 0; c < V; c++) store(out + j * out_stride + g * D + c * W, s.acc[row * V + c] * s.inv[row]);
    }
}

template <int D>
void run(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& group_token, const at::Tensor& group_size,
         const at::Tensor& group_seq, const at::Tensor& group_len, int64_t block_size, double scale) {
  const int64_t num_groups = group_token.size(0), num_heads = q.size(1), num_kv_heads = k_cache.size(1);
  const int64_t groups = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* tokens = group_token.data_ptr<int64_t>();
  const int64_t* sizes = group_size.data_ptr<int64_t>();
  const int64_t* seqs = group_seq.data_ptr<int64_t>();
  const int64_t* lens = group_len.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t q_stride = q.stride(0), out_stride = out.stride(0), kv_stride = num_kv_heads * D;
  at::parallel_for(0, num_groups * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t item = begin; item < end; item++) {
      const int64_t i = item / num_kv_heads, h = item % num_kv_heads, token = tokens[i];
      attend_group<D>(qp + token * q_stride + h * groups * D, q_stride, kp + h * D, vp + h * D,
                      tables + seqs[i] * max_blocks, lens[i], sizes[i], block_size, kv_stride, groups,
                      static_cast<float>(scale), op + token * out_stride + h * groups * D, out_stride, scratch);
    }
  });
}

void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& group_token, const at::Tensor& group_size,
                     const at::Tensor& group_seq, const at::Tensor& group_len, int64_t block_size, double scale) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat, "paged_attention: float32 CPU tensors only");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat,
              "paged_attention: float32 caches only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [T, H, D], rows contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(1) == q.size(1) * q.size(2),
              "out must be [T, H * D], rows contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  for (const at::Tensor* t : {&block_tables, &group_token, &group_size, &group_seq, &group_len})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "indices must be contiguous int64");
  switch (q.size(2)) {
    case 64:
      return run<64>(out, q, k_cache, v_cache, block_tables, group_token, group_size, group_seq, group_len,
                     block_size, scale);
    case 128:
      return run<128>(out, q, k_cache, v_cache, block_tables, group_token, group_size, group_seq, group_len,
                      block_size, scale);
    default:
      TORCH_CHECK(false, "paged_attention: head_dim must be 64 or 128, got ", q.size(2));
  }
}

}  // namespace

TORCH_LIBRARY(inferline, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor group_token, Tensor group_size, Tensor group_seq, Tensor group_len, int block_size, "
        "float scale) -> ()");
  m.impl("paged_attention", c10::DispatchKey::CPU, &paged_attention);
}
