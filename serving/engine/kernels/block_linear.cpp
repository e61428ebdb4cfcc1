// GGUF block formats served in their own bits (serving/engine/blocks.py): linear layers and embedding
// rows over weights kept as 4- or 8-bit blocks of 32 with fp16 scales, activations float32.
//
//   block_lanes() -> G                        outputs per group: the machine's floats per vector
//   block_pack(weight [N, row_bytes] uint8, format, k) -> [ceil(N / G), K / 32 * G * block_bytes] uint8
//   block_linear(x [M, K], packed, format, n, k, bias [N]?) -> [M, N]          y = x @ W.T + bias
//   block_rows(packed, format, n, k, ids [R] int64) -> [R, K] float32          rows of W (embeddings)
//
// A GGUF row is K / 32 blocks, each as ggml lays it out (fp16 scales):
//   Q8_0  34 bytes: d, int8 q[32]                     w[j] = q[j] * d
//   Q4_0  18 bytes: d, uint8 qs[16]                   w[j] = (nibble j - 8) * d
//   Q4_1  20 bytes: d, m, uint8 qs[16]                w[j] = nibble j * d + m
// where nibble j is qs[j] & 15 for j < 16 and qs[j - 16] >> 4 for j >= 16.
//
// Packed at load (block_pack), the same bytes regrouped: G consecutive outputs form a group, one vector
// lane each, and a group stores block b of its G rows together: their G scales d (then G mins m for
// Q4_1), then byte p of the G blocks' quants side by side (p < 16 for Q4, 32 for Q8). Same size as the
// file's (a last, partial group padded with zero rows). The kernel then runs the outer-product form
// of the float32 small-batch kernel: at each position of a block it widens G quants into one vector
// (a Q4 byte holds positions p and p + 16: one load, a mask and a shift give both), multiplies it by
// the broadcast activation of each row of x, and only at the block's end applies the G scales, one
// vector, once: y += d * sum_j x_j q_j (+ m * sum_j x_j for Q4_1; Q4_0's -8 as m = -8 d). A block
// thus costs a load, a mask, a shift and two conversions per two positions, as int8 weights do, for
// 0.56 to 1.06 bytes a weight, and no horizontal sums. That is decode's path (up to WIDE_ROWS rows, MR
// rows per pass over a group). Larger batches widen each weight once per call into an L1 buffer and
// multiply it there in register blocks (wide_chunk): prefill at about float32 oneDNN's speed. Sums are
// float32, in this kernel's own order: results equal x times the de-quantized weights up to the last bits.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "pool.h"
#include "vec.h"

namespace {

using inferline::pool;

// The formats, numbered as ggml's GGMLQuantizationType.
enum Format : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };
constexpr int64_t QK = 32;  // weights per block
constexpr int64_t G = NW;   // outputs per group: one lane each

constexpr int64_t block_bytes(int64_t f) { return f == Q8_0 ? 34 : f == Q4_1 ? 20 : f == Q4_0 ? 18 : 0; }
constexpr int64_t header_bytes(int64_t f) { return f == Q4_1 ? 4 : 2; }  // d (and m)
constexpr int64_t quant_bytes(int64_t f) { return f == Q8_0 ? 32 : 16; }

inline float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// G fp16 values as a vector.
inline vn halves(const uint8_t* p) {
#if defined(__AVX512F__)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__AVX2__) && defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vn v;
  for (int i = 0; i < NW; i++) v[i] = half(p + 2 * i);
  return v;
#endif
}

// G bytes, one per lane, as 32-bit integers (zero- or sign-extended), and integers as floats.
#if defined(__AVX512F__)
typedef __m512i vq;
inline vq bytes_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vq bytes_s8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vq low4(vq v) { return _mm512_and_si512(v, _mm512_set1_epi32(15)); }
inline vq high4(vq v) { return _mm512_srli_epi32(v, 4); }
inline vn to_float(vq v) { return _mm512_cvtepi32_ps(v); }
#elif defined(__AVX2__)
typedef __m256i vq;
inline vq bytes_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline vq bytes_s8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline vq low4(vq v) { return _mm256_and_si256(v, _mm256_set1_epi32(15)); }
inline vq high4(vq v) { return _mm256_srli_epi32(v, 4); }
inline vn to_float(vq v) { return _mm256_cvtepi32_ps(v); }
#else
typedef int vq __attribute__((vector_size(NW * sizeof(int))));
inline vq bytes_u8(const uint8_t* p) { vq v; for (int i = 0; i < NW; i++) v[i] = p[i]; return v; }
inline vq bytes_s8(const uint8_t* p) { vq v; for (int i = 0; i < NW; i++) v[i] = static_cast<int8_t>(p[i]); return v; }
inline vq low4(vq v) { return v & 15; }
inline vq high4(vq v) { return v >> 4; }
inline vn to_float(vq v) { return __builtin_convertvector(v, vn); }
#endif

// ---- the kernel

// Rows of x per pass over a group's weights, and independent sums per row within a block (more for a
// single row, so that its chain of multiply-adds does not wait on the previous one).
constexpr int MR = 4;

template <int R>
constexpr int chains() { return R == 1 ? 4 : 2; }

struct Job {
  const float* x;
  int64_t x_stride, rows;
  const uint8_t* packed;
  int64_t format, n, k;
  const float* xsum;  // [rows, k / 32]: each block's sum of x, for the mins (Q4)
  const float* bias;
  float* y;
  int64_t groups_per_chunk;
};

// y[m, group's outputs] for rows m0 .. m0 + R of x.
template <int64_t F, int R>
inline void group_rows(const Job& job, const uint8_t* group, int64_t m0, vn* out) {
  constexpr int A = chains<R>();
  constexpr int64_t GB = G * block_bytes(F), HB = G * header_bytes(F);
  const int64_t blocks = job.k / QK;
  const float* x = job.x + m0 * job.x_stride;
  vn acc[R];
  for (int r = 0; r < R; r++) acc[r] = vn{};
  for (int64_t b = 0; b < blocks; b++) {
    const uint8_t* gb = group + b * GB;
    const uint8_t* q = gb + HB;
    __builtin_prefetch(gb + 4 * GB);
    __builtin_prefetch(gb + 4 * GB + 64);
    __builtin_prefetch(gb + 4 * GB + 128);
    __builtin_prefetch(gb + 4 * GB + 192);
    __builtin_prefetch(gb + 4 * GB + 256);
    if constexpr (F == Q8_0) __builtin_prefetch(gb + 4 * GB + 320), __builtin_prefetch(gb + 4 * GB + 384),
        __builtin_prefetch(gb + 4 * GB + 448), __builtin_prefetch(gb + 4 * GB + 512);
    vn part[R][A];
    for (int r = 0; r < R; r++)
      for (int a = 0; a < A; a++) part[r][a] = vn{};
    const float* xb = x + b * QK;
    if constexpr (F == Q8_0) {
      for (int64_t p = 0; p < QK; p += A) {
        for (int a = 0; a < A; a++) {
          const vn w = to_float(bytes_s8(q + (p + a) * G));
          for (int r = 0; r < R; r++) part[r][a] += splat_n(xb[r * job.x_stride + p + a]) * w;
        }
      }
    } else {
      for (int64_t p = 0; p < 16; p += A / 2) {
        for (int a = 0; a < A / 2; a++) {
          const vq v = bytes_u8(q + (p + a) * G);
          const vn lo = to_float(low4(v)), hi = to_float(high4(v));
          for (int r = 0; r < R; r++) {
            part[r][2 * a] += splat_n(xb[r * job.x_stride + p + a]) * lo;
            part[r][2 * a + 1] += splat_n(xb[r * job.x_stride + p + a + 16]) * hi;
          }
        }
      }
    }
    const vn d = halves(gb);
    for (int r = 0; r < R; r++) {
      vn sum = part[r][0];
      for (int a = 1; a < A; a++) sum += part[r][a];
      acc[r] += sum * d;
    }
    if constexpr (F != Q8_0) {
      const vn m = F == Q4_1 ? halves(gb + 2 * G) : d * -8.f;
      for (int r = 0; r < R; r++) acc[r] += m * splat_n(job.xsum[(m0 + r) * blocks + b]);
    }
  }
  for (int r = 0; r < R; r++) out[r] = acc[r];
}

template <int64_t F>
void chunk_of(const Job& job, int64_t chunk) {
  const int64_t groups = (job.n + G - 1) / G;
  const int64_t g_begin = chunk * job.groups_per_chunk, g_end = std::min(groups, g_begin + job.groups_per_chunk);
  const int64_t group_bytes = job.k / QK * G * block_bytes(F);
  for (int64_t g = g_begin; g < g_end; g++) {
    const uint8_t* group = job.packed + g * group_bytes;
    const int64_t n0 = g * G, lanes = std::min<int64_t>(G, job.n - n0);
    for (int64_t m0 = 0; m0 < job.rows; m0 += MR) {
      vn out[MR];
      const int64_t rows = std::min<int64_t>(MR, job.rows - m0);
      switch (rows) {
        case 1: group_rows<F, 1>(job, group, m0, out); break;
        case 2: group_rows<F, 2>(job, group, m0, out); break;
        case 3: group_rows<F, 3>(job, group, m0, out); break;
        default: group_rows<F, 4>(job, group, m0, out); break;
      }
      for (int64_t r = 0; r < rows; r++) {
        float* y = job.y + (m0 + r) * job.n + n0;
        if (lanes == G) {
          store(y, job.bias != nullptr ? out[r] + load<vn>(job.bias + n0) : out[r]);
        } else {
          for (int64_t i = 0; i < lanes; i++) y[i] = out[r][i] + (job.bias != nullptr ? job.bias[n0 + i] : 0.f);
        }
      }
    }
  }
}

// ---- large batches (prefill): widen once, then outer products from L1
//
// Above WIDE_ROWS rows, re-widening a group's blocks for every MR rows costs more than the multiplies.
// Instead a chunk is a panel of PV groups (PV * G outputs): PK positions at a time are widened into a
// buffer [PK, PV * G] (12 KB on AVX2, 24 KB on AVX-512) and every block of PR rows of x multiplies it
// there, PR x PV accumulators in registers, as the float32 small-batch kernel's panels do; partial sums
// wait in a [rows, PV * G] tile between the k-chunks.
constexpr int PV = 3, PR = NREGS == 32 ? 8 : 4;
constexpr int64_t PK = 128, PW = PV * G;
constexpr int64_t WIDE_ROWS = 8;

// buf[i, v * G + lane] = W[output (g0 + v) * G + lane, k0 + i] for i < min(PK, k - k0) (k0 a multiple of 32);
// the blocks past k are never read: the last group's would lie past the end of the packed weights.
template <int64_t F>
inline void widen_panel(const Job& job, int64_t g0, int64_t k0, float* buf) {
  const int64_t groups = (job.n + G - 1) / G, blocks = job.k / QK, last = std::min(k0 + PK, job.k) / QK;
  constexpr int64_t GB = G * block_bytes(F), HB = G * header_bytes(F);
  for (int v = 0; v < PV; v++) {
    float* col = buf + v * G;
    if (g0 + v >= groups) {
      for (int64_t i = 0; i < PK; i++) store(col + i * PW, vn{});
      continue;
    }
    const uint8_t* group = job.packed + (g0 + v) * blocks * GB;
    for (int64_t b = k0 / QK; b < last; b++) {
      const uint8_t* gb = group + b * GB;
      const uint8_t* q = gb + HB;
      const vn d = halves(gb);
      float* out = col + (b * QK - k0) * PW;
      if constexpr (F == Q8_0) {
        for (int64_t p = 0; p < QK; p++) store(out + p * PW, to_float(bytes_s8(q + p * G)) * d);
      } else {
        const vn m = F == Q4_1 ? halves(gb + 2 * G) : d * -8.f;
        for (int64_t p = 0; p < 16; p++) {
          const vq v = bytes_u8(q + p * G);
          store(out + p * PW, to_float(low4(v)) * d + m);
          store(out + (p + 16) * PW, to_float(high4(v)) * d + m);
        }
      }
    }
  }
}

// tile[r, :] (+)= x[r, k0 : k0 + kc] . buf for R rows.
template <int R>
inline void panel_rows(const float* x, int64_t xs, const float* buf, int64_t kc, float* tile, bool first) {
  vn acc[R][PV];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < PV; v++) acc[r][v] = first ? vn{} : load<vn>(tile + r * PW + v * G);
  for (int64_t i = 0; i < kc; i++) {
    vn w[PV];
    for (int v = 0; v < PV; v++) {
      w[v] = load<vn>(buf + i * PW + v * G);
      IN_REGISTER(w[v]);
    }
    for (int r = 0; r < R; r++) {
      const vn b = splat_n(x[r * xs + i]);
      for (int v = 0; v < PV; v++) acc[r][v] += b * w[v];
    }
  }
  for (int r = 0; r < R; r++)
    for (int v = 0; v < PV; v++) store(tile + r * PW + v * G, acc[r][v]);
}

template <int R = PR>
inline void panel_any(int rows, const float* x, int64_t xs, const float* buf, int64_t kc, float* tile, bool first) {
  if constexpr (R > 1) {
    if (rows < R) return panel_any<R - 1>(rows, x, xs, buf, kc, tile, first);
  }
  panel_rows<R>(x, xs, buf, kc, tile, first);
}

template <int64_t F>
void wide_chunk(const Job& job, int64_t panel) {
  alignas(64) static thread_local float buf[PK * PW];
  thread_local std::vector<float> tile;
  tile.resize(job.rows * PW);
  const int64_t g0 = panel * PV;
  for (int64_t k0 = 0; k0 < job.k; k0 += PK) {
    const int64_t kc = std::min(PK, job.k - k0);
    widen_panel<F>(job, g0, k0, buf);  // the first kc rows of buf: the tail is neither written nor read
    for (int64_t m = 0; m < job.rows; m += PR)
      panel_any(static_cast<int>(std::min<int64_t>(PR, job.rows - m)), job.x + m * job.x_stride + k0, job.x_stride,
                buf, kc, tile.data() + m * PW, k0 == 0);
  }
  const int64_t n0 = g0 * G, cols = std::min(PW, job.n - n0);
  for (int64_t m = 0; m < job.rows; m++)
    for (int64_t j = 0; j < cols; j++)
      job.y[m * job.n + n0 + j] = tile[m * PW + j] + (job.bias != nullptr ? job.bias[n0 + j] : 0.f);
}

void run_chunk(const void* arg, int64_t chunk) {
  const Job& job = *static_cast<const Job*>(arg);
  if (job.rows > WIDE_ROWS) {
    switch (job.format) {
      case Q8_0: return wide_chunk<Q8_0>(job, chunk);
      case Q4_1: return wide_chunk<Q4_1>(job, chunk);
      default: return wide_chunk<Q4_0>(job, chunk);
    }
  }
  switch (job.format) {
    case Q8_0: return chunk_of<Q8_0>(job, chunk);
    case Q4_1: return chunk_of<Q4_1>(job, chunk);
    default: return chunk_of<Q4_0>(job, chunk);
  }
}

// ---- checks and the ops

int64_t checked_format(int64_t format, int64_t k, const char* op) {
  TORCH_CHECK(block_bytes(format) > 0, op, ": format ", format, " is not one of Q4_0 (2), Q4_1 (3), Q8_0 (8)");
  TORCH_CHECK(k > 0 && k % QK == 0, op, ": k must be a positive multiple of ", QK, ", got ", k);
  return block_bytes(format);
}

void check_packed(const at::Tensor& packed, int64_t format, int64_t n, int64_t k, const char* op) {
  const int64_t bytes = checked_format(format, k, op);
  TORCH_CHECK(n > 0, op, ": n must be positive");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 2 &&
                  packed.is_contiguous() && packed.size(0) == (n + G - 1) / G && packed.size(1) == k / QK * G * bytes,
              op, ": packed must be a contiguous uint8 CPU tensor [", (n + G - 1) / G, ", ", k / QK * G * bytes,
              "] (block_pack's layout for n = ", n, ", k = ", k, ")");
}

int64_t block_lanes() { return G; }

at::Tensor block_pack(const at::Tensor& weight, int64_t format, int64_t k) {
  const int64_t bytes = checked_format(format, k, "block_pack");
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kByte && weight.dim() == 2 &&
                  weight.size(1) == k / QK * bytes,
              "block_pack: weight must be a uint8 CPU tensor [n, ", k / QK * bytes, "] (GGUF rows of blocks)");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), blocks = k / QK, groups = (n + G - 1) / G;
  const int64_t hb = header_bytes(format), qb = quant_bytes(format), row_bytes = blocks * bytes;
  at::Tensor packed = at::zeros({groups, blocks * G * bytes}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; g++) {
      for (int64_t lane = 0; lane < G && g * G + lane < n; lane++) {
        const uint8_t* row = src + (g * G + lane) * row_bytes;
        for (int64_t b = 0; b < blocks; b++) {
          const uint8_t* block = row + b * bytes;
          uint8_t* gb = dst + g * blocks * G * bytes + b * G * bytes;
          for (int64_t h = 0; h < hb; h += 2) std::memcpy(gb + h * G + 2 * lane, block + h, 2);
          for (int64_t p = 0; p < qb; p++) gb[hb * G + p * G + lane] = block[hb + p];
        }
      }
    }
  });
  return packed;
}

at::Tensor block_linear(const at::Tensor& x, const at::Tensor& packed, int64_t format, int64_t n, int64_t k,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 &&
                  x.size(1) == k,
              "block_linear: x must be a float32 CPU tensor [rows, ", k, "] with contiguous rows");
  check_packed(packed, format, n, k, "block_linear");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "block_linear: bias must be a contiguous float32 tensor of ", n, " elements");
    b = bias->data_ptr<float>();
  }
  const int64_t rows = x.size(0), blocks = k / QK, groups = (n + G - 1) / G;
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0) return y;
  std::vector<float> xsum;
  if (format != Q8_0 && rows <= WIDE_ROWS) {
    xsum.resize(rows * blocks);
    const float* xp = x.data_ptr<float>();
    for (int64_t m = 0; m < rows; m++)
      for (int64_t j = 0; j < blocks; j++) {
        vn s{};
        for (int64_t i = 0; i < QK; i += NW) s += load<vn>(xp + m * x.stride(0) + j * QK + i);
        xsum[m * blocks + j] = hsum_n(s);
      }
  }
  // Chunks of about 64 KB of blocks: long runs for the hardware prefetcher, short enough that a late
  // helper leaves little for the others to wait on.
  const int64_t group_bytes = blocks * G * block_bytes(format);
  const int64_t per_chunk = std::max<int64_t>(1, 64 * 1024 / group_bytes);
  const Job job{x.data_ptr<float>(), x.stride(0), rows, packed.data_ptr<uint8_t>(), format, n, k,
                xsum.empty() ? nullptr : xsum.data(), b, y.data_ptr<float>(), per_chunk};
  pool().run(&run_chunk, &job, rows > WIDE_ROWS ? (groups + PV - 1) / PV : (groups + per_chunk - 1) / per_chunk);
  return y;
}

// Output o's weights at positions [b * 32, b * 32 + 32) of the packed layout, as floats.
inline void one_block(const uint8_t* gb, int64_t format, int64_t lane, float* out) {
  const float d = half(gb + 2 * lane);
  const uint8_t* q = gb + header_bytes(format) * G;
  if (format == Q8_0) {
    for (int64_t p = 0; p < QK; p++) out[p] = static_cast<int8_t>(q[p * G + lane]) * d;
    return;
  }
  const float m = format == Q4_1 ? half(gb + 2 * G + 2 * lane) : -8.f * d;
  for (int64_t p = 0; p < 16; p++) {
    const uint8_t byte = q[p * G + lane];
    out[p] = (byte & 15) * d + m;
    out[p + 16] = (byte >> 4) * d + m;
  }
}

at::Tensor block_rows(const at::Tensor& packed, int64_t format, int64_t n, int64_t k, const at::Tensor& ids) {
  check_packed(packed, format, n, k, "block_rows");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "block_rows: ids must be int64 [R]");
  const at::Tensor idc = ids.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  const int64_t count = idc.size(0), blocks = k / QK, bytes = block_bytes(format);
  for (int64_t i = 0; i < count; i++)
    TORCH_CHECK(id[i] >= 0 && id[i] < n, "block_rows: row ", id[i], " is out of range [0, ", n, ")");
  at::Tensor out = at::empty({count, k}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* src = packed.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i++) {
      const uint8_t* group = src + id[i] / G * blocks * G * bytes;
      for (int64_t b = 0; b < blocks; b++) one_block(group + b * G * bytes, format, id[i] % G, dst + i * k + b * QK);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferline, m) {
  m.def("block_lanes() -> int", &block_lanes);
  m.def("block_pack(Tensor weight, int format, int k) -> Tensor");
  m.impl("block_pack", c10::DispatchKey::CPU, &block_pack);
  m.def("block_linear(Tensor x, Tensor packed, int format, int n, int k, Tensor? bias) -> Tensor");
  m.impl("block_linear", c10::DispatchKey::CPU, &block_linear);
  m.def("block_rows(Tensor packed, int format, int n, int k, Tensor ids) -> Tensor");
  m.impl("block_rows", c10::DispatchKey::CPU, &block_rows);
}
