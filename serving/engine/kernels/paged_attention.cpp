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
// slot = block * block_size + offset, in float32 or float16 (widened to float32 as it is read: half
// the bytes for the same arithmetic). The kernel takes *query groups*: group i is
// group_size[i] consecutive tokens of the step's batch starting at group_token[i],
// all of sequence group_seq[i] (a row of block_tables); its first token sees the
// first group_len[i] positions of the sequence and each later one a position more,
// which is the causal mask. A decode is a group of one; a chunk (speculative
// guesses, a prompt's tail after a prefix-cache hit, a prompt) is groups of up to
// model_runner.KERNEL_GROUP of its tokens.
//
// Work items are (group, kv head); the grouped query heads of a KV head share each
// key and value load. Each item is two small matrix products (attend): its query
// rows (tokens x grouped heads) against the keys, then the weights against the
// values, register-blocked in the machine's own vector width: scores key-major,
// each key element broadcast against a tile of transposed query rows; then each
// block's value rows against a block of output rows. An item of a few rows (up to
// DOT_ROWS: a decode's grouped heads) takes dot products along the head instead, NW
// keys at a time, keeps its scores row by row, and weighs each value row for its rows
// alone: a tile would be mostly padding (attend_rows). Each next block is
// prefetched: a sequence's blocks lie anywhere in the pool. Softmax is exact (max-subtracted,
// two passes over the scores), in float32. GCC vector extensions keep it portable:
// -march=native picks AVX-512, AVX2 or SSE at build time, on the machine that runs it.

#include <ATen/ATen.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "pool.h"
#include "vec.h"

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// The cache holds float32 or float16 (c10::Half) keys and values; both are read as float32 vectors.
inline vn load_kv(const float* p) { return load<vn>(p); }
inline vn load_kv(const c10::Half* p) {
#if defined(__AVX512F__)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__AVX__) && defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vn v;
  for (int i = 0; i < NW; i++) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}
inline float kv_scalar(float x) { return x; }
inline float kv_scalar(c10::Half x) { return static_cast<float>(x); }

struct Scratch {
  std::vector<float> scores, inv, qs, out;
};

// An item works key-major: scores[p * rows_padded + row], rows padded to a whole vector. Its register
// blocks are in the machine's own vectors (vec.h's vn): for the scores, SCORE_KEYS(RV) keys x a tile of
// RV vectors of rows (broadcast key elements times the transposed queries), tiles of up to SCORE_VECS
// vectors; for the values, VALUE_ROWS rows x VALUE_COLS vectors of the head (broadcast weights times
// value rows). With AVX-512's 32 registers: 8 keys x 3 vectors (48 rows: 16 tokens x 3 grouped heads,
// SmolLM2's chunk groups) and 4 rows x the whole head (4 vectors for 64), 24 and 16 accumulators, where
// 8 x 1 and 4 x 2 would load a vector or a broadcast for each FMA or two. With AVX2's 16: 8 accumulators
// (12, as 6 keys x 2 vectors, are no faster there).
constexpr int SCORE_VECS = NREGS == 32 ? 3 : 2;
template <int RV>
constexpr int score_keys_for() { return NREGS == 32 ? 8 : 8 / RV; }
constexpr int VALUE_ROWS = 4, VALUE_COLS = NREGS == 32 ? 4 : 2;

// scores[i][tile] = k_i . qt[:, tile] for KEYS keys (kv_stride apart) and one tile of RV * NW query rows
// (qt[d * qt_stride + r] is element d of row r).
template <int D, int KEYS, int RV, typename T>
inline void score_keys(const T* k, int64_t kv_stride, const float* qt, int64_t qt_stride, float* out,
                       int64_t out_stride) {
  vn acc[KEYS][RV];
  for (int i = 0; i < KEYS; i++)
    for (int c = 0; c < RV; c++) acc[i][c] = vn{};
  for (int d = 0; d < D; d++) {
    vn x[RV];
    for (int c = 0; c < RV; c++) {
      x[c] = load<vn>(qt + d * qt_stride + c * NW);
      IN_REGISTER(x[c]);
    }
    for (int i = 0; i < KEYS; i++) {
      const vn e = splat_n(kv_scalar(k[i * kv_stride + d]));
      for (int c = 0; c < RV; c++) acc[i][c] += e * x[c];
    }
  }
  for (int i = 0; i < KEYS; i++)
    for (int c = 0; c < RV; c++) store(out + i * out_stride + c * NW, acc[i][c]);
}

template <int D, int RV, typename T>
inline void score_block(const T* k, int64_t count, int64_t kv_stride, const float* qt, int64_t qt_stride,
                        float* out, int64_t out_stride) {
  constexpr int KEYS = score_keys_for<RV>();
  int64_t i = 0;
  for (; i + KEYS <= count; i += KEYS)
    score_keys<D, KEYS, RV>(k + i * kv_stride, kv_stride, qt, qt_stride, out + i * out_stride, out_stride);
  for (; i < count; i++)
    score_keys<D, 1, RV>(k + i * kv_stride, kv_stride, qt, qt_stride, out + i * out_stride, out_stride);
}

// An item of at most this many rows (a decode's grouped heads: 3 for SmolLM2) takes attend_rows.
constexpr int DOT_ROWS = 4;

// The scores of NW keys at once: a[j] holds key j's products along the head (NW partial sums); after this,
// a[0]'s lane j is key j's score. A tree of pairwise shuffles and adds: each level halves the lanes a key
// keeps and doubles the keys a vector holds, NW - 1 shuffle pairs for NW keys, where a horizontal sum per
// key took log2(NW) and a lane insert.
template <int S>
constexpr int lo_lane(int t) {
  const int seg = t / S, off = t % S, half = NW / (2 * S);
  return seg < half ? seg * 2 * S + off : NW + (seg - half) * 2 * S + off;
}

template <int S, int... T>
inline vn pair_sum(vn x, vn y, std::integer_sequence<int, T...>) {
  return __builtin_shufflevector(x, y, lo_lane<S>(T)...) + __builtin_shufflevector(x, y, (lo_lane<S>(T) + S)...);
}

template <int S = NW / 2>
inline void sum_keys(vn* a, int n = NW) {
  for (int m = 0; m < n / 2; m++) a[m] = pair_sum<S>(a[2 * m], a[2 * m + 1], std::make_integer_sequence<int, NW>());
  if constexpr (S > 1) sum_keys<S / 2>(a, n / 2);
}

// Scores of R query rows (qr: row-major, D apart, scaled) against count keys of a block, into row-major
// scores[r * stride + p] from p = 0, NW keys at a time. A last group of fewer keys reads none past count
// and writes only its own scores.
template <int D, int R, typename T>
inline void score_rows(const T* k, int64_t count, int64_t kv_stride, const float* qr, float* scores,
                       int64_t stride) {
  for (int64_t i = 0; i < count; i += NW) {
    const int64_t n = std::min<int64_t>(NW, count - i);
    for (int r = 0; r < R; r++) {
      vn q[D / NW];
      for (int c = 0; c < D / NW; c++) q[c] = load<vn>(qr + r * D + c * NW);
      vn a[NW];
      for (int j = 0; j < NW; j++) {
        a[j] = vn{};
        if (n < NW && j >= n) continue;
        const T* kj = k + (i + j) * kv_stride;
        for (int c = 0; c < D / NW; c++) a[j] += load_kv(kj + c * NW) * q[c];
      }
      sum_keys(a);
      if (n == NW) {
        store(scores + r * stride + i, a[0]);
      } else {
        float lanes[NW];
        store(lanes, a[0]);
        std::memcpy(scores + r * stride + i, lanes, n * sizeof(float));
      }
    }
  }
}

// Asks for one head's rows of a block (cache points at the head) ahead of use: the blocks of a sequence
// lie anywhere in the pool, so the hardware prefetchers cannot follow from one to the next.
template <int D, typename T>
inline void prefetch_block(const T* cache, int64_t block, int64_t block_size, int64_t kv_stride) {
  const T* row = cache + block * block_size * kv_stride;
  for (int64_t i = 0; i < block_size; i++, row += kv_stride)
    for (int d = 0; d < D; d += 64 / static_cast<int>(sizeof(T))) __builtin_prefetch(row + d);
}

// The first K and V blocks of an item: a decode's context is a few blocks, and its item is over in
// microseconds.
template <int D, typename T>
inline void prefetch_first(const T* k_cache, const T* v_cache, const int64_t* table, int64_t block_size,
                           int64_t kv_stride) {
  prefetch_block<D>(k_cache, table[0], block_size, kv_stride);
  prefetch_block<D>(v_cache, table[0], block_size, kv_stride);
}

// f(rows, start, count) for each block of a sequence's first len positions, in order (rows: the block's
// first row of this head, kv_stride apart), with the next block prefetched before the current one is used.
template <int D, typename T, typename F>
inline void for_each_block(const T* cache, const int64_t* table, int64_t len, int64_t block_size,
                           int64_t kv_stride, F&& f) {
  for (int64_t start = 0; start < len; start += block_size) {
    if (start + block_size < len) prefetch_block<D>(cache, table[start / block_size + 1], block_size, kv_stride);
    f(cache + table[start / block_size] * block_size * kv_stride, start, std::min(block_size, len - start));
  }
}

// The item's output: row j * groups + g of acc (D apart), times inv of that row, to token j's head g.
template <int D>
inline void write_rows(const float* acc, const float* inv, int64_t num_queries, int64_t groups, float* out,
                       int64_t out_stride) {
  for (int64_t j = 0; j < num_queries; j++)
    for (int64_t g = 0; g < groups; g++) {
      const int64_t row = j * groups + g;
      for (int c = 0; c < D / W; c++)
        store(out + j * out_stride + g * D + c * W, load(acc + row * D + c * W) * inv[row]);
    }
}

// Adds to columns [0, VALUE_COLS * NW) of VALUE_ROWS output rows (out, out_stride apart) their weighted
// sum of count value rows (kv_stride apart), weights w[i * w_stride + r]. Called block by block, so each
// block's values come from memory once and then from L1.
template <typename T>
inline void weigh_values(const float* w, int64_t w_stride, const T* v, int64_t count, int64_t kv_stride,
                         float* out, int64_t out_stride) {
  vn acc[VALUE_ROWS][VALUE_COLS];
  for (int r = 0; r < VALUE_ROWS; r++)
    for (int c = 0; c < VALUE_COLS; c++) acc[r][c] = load<vn>(out + r * out_stride + c * NW);
  for (int64_t i = 0; i < count; i++, v += kv_stride, w += w_stride) {
    vn vv[VALUE_COLS];
    for (int c = 0; c < VALUE_COLS; c++) {
      vv[c] = load_kv(v + c * NW);
      IN_REGISTER(vv[c]);
    }
    for (int r = 0; r < VALUE_ROWS; r++) {
      const vn p = splat_n(w[r]);
      for (int c = 0; c < VALUE_COLS; c++) acc[r][c] += p * vv[c];
    }
  }
  for (int r = 0; r < VALUE_ROWS; r++)
    for (int c = 0; c < VALUE_COLS; c++) store(out + r * out_stride + c * NW, acc[r][c]);
}

// weigh_values for a few rows (DOT_ROWS at most): R output rows over the head, CB vectors of columns at a
// time (as many as keep R x CB accumulators in half the registers), each value row loaded once per pass
// and weighed for every row, by row-major weights w[r * w_stride + i]; weigh_values' VALUE_ROWS rows
// would be mostly padding for a decode.
template <int D, int R, typename T>
inline void weigh_rows(const float* w, int64_t w_stride, const T* v, int64_t count, int64_t kv_stride,
                       float* out) {
  constexpr int FIT = NREGS / 2 / R, CB = FIT >= 8 ? 8 : FIT >= 4 ? 4 : FIT >= 2 ? 2 : 1;
  constexpr int C = D / NW < CB ? D / NW : CB;
  static_assert(D % (C * NW) == 0, "column passes must divide the head");
  for (int c0 = 0; c0 < D; c0 += C * NW) {
    vn acc[R][C];
    for (int r = 0; r < R; r++)
      for (int c = 0; c < C; c++) acc[r][c] = load<vn>(out + r * D + c0 + c * NW);
    const T* vi = v + c0;
    for (int64_t i = 0; i < count; i++, vi += kv_stride)
      for (int c = 0; c < C; c++) {
        const vn x = load_kv(vi + c * NW);
        for (int r = 0; r < R; r++) acc[r][c] += splat_n(w[r * w_stride + i]) * x;
      }
    for (int r = 0; r < R; r++)
      for (int c = 0; c < C; c++) store(out + r * D + c0 + c * NW, acc[r][c]);
  }
}

// Vectors of score columns per softmax pass: the max and the sum of each take a register, and the
// exp's polynomial needs a few more (more vectors are no faster on AVX2).
constexpr int SOFTMAX_VECS = NREGS / 4;

// Columns [0, vecs * NW) of scores (stride apart, len rows) become exp(x - column max), and inv their
// column's 1 / sum; vecs <= V, unrolled for each count.
template <int V>
inline void softmax_columns(float* scores, int64_t stride, int64_t len, float* inv, int vecs) {
  if constexpr (V > 1) {
    if (vecs < V) return softmax_columns<V - 1>(scores, stride, len, inv, vecs);
  }
  vn m[V], sum[V];
  for (int c = 0; c < V; c++) m[c] = vn{} - INFINITY, sum[c] = vn{};
  for (int64_t p = 0; p < len; p++)
    for (int c = 0; c < V; c++) {
      const vn x = load<vn>(scores + p * stride + c * NW);
      m[c] = x > m[c] ? x : m[c];
    }
  for (int64_t p = 0; p < len; p++)
    for (int c = 0; c < V; c++) {
      const vn e = vexp(load<vn>(scores + p * stride + c * NW) - m[c]);
      store(scores + p * stride + c * NW, e);
      sum[c] += e;
    }
  for (int c = 0; c < V; c++) store(inv + c * NW, vn{} + 1.f / sum[c]);
}

// One (query group, KV head) work item. The group's query j (token j of the group) sees the first
// len0 + j positions of its sequence; its `groups` query heads share the KV head. Padding rows have
// zero queries and are dropped.
template <int D, typename T>
void attend(const float* q, int64_t q_stride, const T* k_cache, const T* v_cache, const int64_t* table,
            int64_t len0, int64_t num_queries, int64_t block_size, int64_t kv_stride, int64_t groups, float scale,
            float* out, int64_t out_stride, Scratch& s) {
  static_assert(D % (VALUE_COLS * NW) == 0 && NW % VALUE_ROWS == 0, "blocks must divide the head and a vector");
  const int64_t len = len0 + num_queries - 1, rows = num_queries * groups, padded = (rows + NW - 1) / NW * NW;
  s.scores.resize(len * padded);
  s.inv.resize(padded);
  // The scaled queries, transposed and padded with zero rows for the tiles (qs[d * padded + row]).
  s.qs.assign(D * padded, 0.f);
  for (int64_t j = 0; j < num_queries; j++)
    for (int64_t g = 0; g < groups; g++)
      for (int d = 0; d < D; d++) s.qs[d * padded + j * groups + g] = q[j * q_stride + g * D + d] * scale;

  prefetch_first<D>(k_cache, v_cache, table, block_size, kv_stride);
  for_each_block<D>(k_cache, table, len, block_size, kv_stride, [&](const T* k, int64_t start, int64_t count) {
    // Tiles of SCORE_VECS vectors of rows, then one of the 1 or 2 left.
    int64_t t = 0;
    for (; t + SCORE_VECS * NW <= padded; t += SCORE_VECS * NW)
      score_block<D, SCORE_VECS>(k, count, kv_stride, &s.qs[t], padded, &s.scores[start * padded + t], padded);
    if (padded - t == 2 * NW)
      score_block<D, 2>(k, count, kv_stride, &s.qs[t], padded, &s.scores[start * padded + t], padded);
    else if (padded - t == NW)
      score_block<D, 1>(k, count, kv_stride, &s.qs[t], padded, &s.scores[start * padded + t], padded);
  });
  // The causal mask: token j of the group sees positions below len0 + j.
  for (int64_t p = len0; p < len; p++)
    for (int64_t row = 0; row < (p - len0 + 1) * groups; row++) s.scores[p * padded + row] = -INFINITY;
  // Softmax down each column, exact: the max, then exp and the sum. Row by row over up to
  // SOFTMAX_VECS vectors of columns, kept in registers, so the scores are read in address order; going
  // down one vector of columns at a time would read a new cache line at every step, from L2 (a 1,040-key
  // context x 48 rows is 200 KB).
  for (int64_t c0 = 0; c0 < padded; c0 += SOFTMAX_VECS * NW)
    softmax_columns<SOFTMAX_VECS>(&s.scores[c0], padded, len, &s.inv[c0],
                                  static_cast<int>(std::min<int64_t>(SOFTMAX_VECS, (padded - c0) / NW)));
  s.out.assign(padded * D, 0.f);
  for_each_block<D>(v_cache, table, len, block_size, kv_stride, [&](const T* v, int64_t start, int64_t count) {
    for (int64_t row = 0; row < rows; row += VALUE_ROWS)  // padding rows past the last block: not needed
      for (int64_t c0 = 0; c0 < D; c0 += VALUE_COLS * NW)
        weigh_values(&s.scores[start * padded + row], padded, v + c0, count, kv_stride, &s.out[row * D + c0], D);
  });
  write_rows<D>(s.out.data(), s.inv.data(), num_queries, groups, out, out_stride);
}

// attend() for an item of R <= DOT_ROWS rows: dot products along the head (score_rows), its scores row
// by row (scores[r * stride + p]), so that each row's softmax runs along whole vectors of its own scores
// (key-major, a decode would spend a vector's exp on every key for R of its lanes), and weigh_rows.
template <int D, int R, typename T>
void attend_rows(const float* q, int64_t q_stride, const T* k_cache, const T* v_cache, const int64_t* table,
                 int64_t len0, int64_t num_queries, int64_t block_size, int64_t kv_stride, int64_t groups,
                 float scale, float* out, int64_t out_stride, Scratch& s) {
  const int64_t len = len0 + num_queries - 1, stride = (len + NW - 1) / NW * NW;
  s.scores.resize(R * stride);
  s.qs.resize(R * D);
  s.out.assign(R * D, 0.f);
  float* scores = s.scores.data();
  for (int64_t j = 0; j < num_queries; j++)
    for (int64_t g = 0; g < groups; g++)
      for (int d = 0; d < D; d++) s.qs[(j * groups + g) * D + d] = q[j * q_stride + g * D + d] * scale;
  prefetch_first<D>(k_cache, v_cache, table, block_size, kv_stride);
  for_each_block<D>(k_cache, table, len, block_size, kv_stride, [&](const T* k, int64_t start, int64_t count) {
    score_rows<D, R>(k, count, kv_stride, s.qs.data(), scores + start, stride);
  });
  // The causal mask (token j of the group sees positions below len0 + j), and the padding to a whole vector.
  for (int64_t j = 0; j < num_queries; j++)
    for (int64_t g = 0; g < groups; g++)
      for (int64_t p = len0 + j; p < stride; p++) scores[(j * groups + g) * stride + p] = -INFINITY;
  float inv[R];
  for (int r = 0; r < R; r++) {  // softmax, exact: the max, then exp and the sum
    float* row = scores + r * stride;
    vn m = vn{} - INFINITY;
    for (int64_t p = 0; p < stride; p += NW) {
      const vn x = load<vn>(row + p);
      m = x > m ? x : m;
    }
    float top = m[0];
    for (int l = 1; l < NW; l++) top = std::max(top, m[l]);
    vn sum{};
    for (int64_t p = 0; p < stride; p += NW) {
      const vn e = vexp(load<vn>(row + p) - top);
      store(row + p, e);
      sum += e;
    }
    inv[r] = 1.f / hsum_n(sum);
  }
  for_each_block<D>(v_cache, table, len, block_size, kv_stride, [&](const T* v, int64_t start, int64_t count) {
    weigh_rows<D, R>(scores + start, stride, v, count, kv_stride, s.out.data());
  });
  write_rows<D>(s.out.data(), inv, num_queries, groups, out, out_stride);
}

template <int D, typename T>
struct Job {
  const float* qp;
  const T *kp, *vp;
  const int64_t *tables, *tokens, *sizes, *seqs, *lens, *order;
  float* op;
  int64_t q_stride, out_stride, kv_stride, num_kv_heads, groups, max_blocks, block_size;
  float scale;
};

// Work item *item* of the job: query group order[item / num_kv_heads] against KV head item % num_kv_heads.
template <int D, typename T>
void attend_item(const void* arg, int64_t item) {
  const Job<D, T>& job = *static_cast<const Job<D, T>*>(arg);
  thread_local Scratch scratch;  // kept between calls: a step makes one call a layer
  const int64_t i = job.order[item / job.num_kv_heads], h = item % job.num_kv_heads, token = job.tokens[i];
  const float* q = job.qp + token * job.q_stride + h * job.groups * D;
  const T *k = job.kp + h * D, *v = job.vp + h * D;
  const int64_t* table = job.tables + job.seqs[i] * job.max_blocks;
  float* out = job.op + token * job.out_stride + h * job.groups * D;
  static_assert(DOT_ROWS == 4, "the cases below take 1 to DOT_ROWS rows");
  switch (job.sizes[i] * job.groups) {
#define ATTEND_ROWS(R)                                                                                      \
  case R:                                                                                                   \
    return attend_rows<D, R>(q, job.q_stride, k, v, table, job.lens[i], job.sizes[i], job.block_size,       \
                             job.kv_stride, job.groups, job.scale, out, job.out_stride, scratch);
    ATTEND_ROWS(1) ATTEND_ROWS(2) ATTEND_ROWS(3) ATTEND_ROWS(4)
#undef ATTEND_ROWS
    default:
      attend<D>(q, job.q_stride, k, v, table, job.lens[i], job.sizes[i], job.block_size, job.kv_stride,
                job.groups, job.scale, out, job.out_stride, scratch);
  }
}

template <int D, typename T>
void run(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& group_token, const at::Tensor& group_size,
         const at::Tensor& group_seq, const at::Tensor& group_len, int64_t block_size, double scale) {
  const int64_t num_groups = group_token.size(0), num_heads = q.size(1), num_kv_heads = k_cache.size(1);
  const int64_t* sizes = group_size.data_ptr<int64_t>();
  const int64_t* lens = group_len.data_ptr<int64_t>();
  // Items differ in cost (a decode against a chunk of sixteen tokens), so they are sorted costliest
  // first and handed out one at a time in the pool's contiguous shares (pool.h): a thread takes its
  // share front to back, so one sequence's KV heads, whose K and V rows interleave in the cache, run
  // one after another on one core, and a thread done early takes the others' cheapest items from
  // their backs. The pool rather than OpenMP: at batch 1 a layer's attention is a few microseconds of
  // work, less than OpenMP's sleeping worker takes to wake for it, every layer.
  std::vector<int64_t> order(num_groups);
  for (int64_t i = 0; i < num_groups; i++) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return sizes[a] * (lens[a] + sizes[a]) > sizes[b] * (lens[b] + sizes[b]);
  });
  const Job<D, T> job{q.data_ptr<float>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                   block_tables.data_ptr<int64_t>(), group_token.data_ptr<int64_t>(), sizes,
                   group_seq.data_ptr<int64_t>(), lens, order.data(), out.data_ptr<float>(), q.stride(0),
                   out.stride(0), num_kv_heads * D, num_kv_heads, num_heads / num_kv_heads, block_tables.size(1),
                   block_size, static_cast<float>(scale)};
  inferline::pool().run(&attend_item<D, T>, &job, num_groups * num_kv_heads);
}

void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& group_token, const at::Tensor& group_size,
                     const at::Tensor& group_seq, const at::Tensor& group_len, int64_t block_size, double scale) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat, "paged_attention: float32 CPU tensors only");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kHalf),
              "paged_attention: the caches must both be float32 or both float16");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [T, H, D], rows contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(1) == q.size(1) * q.size(2),
              "out must be [T, H * D], rows contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  for (const at::Tensor* t : {&block_tables, &group_token, &group_size, &group_seq, &group_len})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "indices must be contiguous int64");
  const bool half = k_cache.scalar_type() == at::kHalf;
  switch (q.size(2)) {
    case 64:
      return half ? run<64, c10::Half>(out, q, k_cache, v_cache, block_tables, group_token, group_size, group_seq,
                                       group_len, block_size, scale)
                  : run<64, float>(out, q, k_cache, v_cache, block_tables, group_token, group_size, group_seq,
                                   group_len, block_size, scale);
    case 128:
      return half ? run<128, c10::Half>(out, q, k_cache, v_cache, block_tables, group_token, group_size, group_seq,
                                        group_len, block_size, scale)
                  : run<128, float>(out, q, k_cache, v_cache, block_tables, group_token, group_size, group_seq,
                                    group_len, block_size, scale);
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
