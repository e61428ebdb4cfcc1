// Linear layers at decode batch sizes (a few rows), float32 or int8 weights, on the kernels' own
// thread pool (pool.h).
//
// At batch 1 a decode step of SmolLM2-135M is 121 matrix-vector products that read
// 540 MB of weights: memory-bound work that two cores stream at 40-45 GB/s. Through
// oneDNN each product is an OpenMP parallel region whose sleeping worker takes 30-40 us
// to wake (pool.h): a quarter of the step (measured: the 121 products take 16-20 ms
// through oneDNN, 12 ms here). Batch-1 decode with a busy loop holding one of 2 cores:
// 48-51 tokens/s here against 43-47 through oneDNN; batch 2: 80-82 against 88-89 (idle:
// 65-85 against 44-46, and 118-125 against 82-87).
//
//   small_linear(x [M, K], weight [N, K], bias [N]?) -> [M, N]     y = x @ weight.T + bias
//   small_linear_int8(x [M, K], weight [N, K] int8, scale [N], bias [N]?) -> [M, N]
//                                                       y = (x @ weight.T) * scale + bias
//
// Each output is one dot product over K, accumulated in float32 lanes of the machine's own vector
// width (16 with AVX-512, else 8): not the summation order of MKL or oneDNN, so results differ from
// theirs in the last bits. The int8 variant is weight-only quantization (serving/engine/quant.py):
// each weight vector is widened to float32 in registers, the activations stay float32, and a step
// streams a quarter of the bytes; with the next rows prefetched it reads SmolLM2-135M's 134 MB of
// int8 weights at about 25 GB/s on two Zen 4 cores (121 products: 5.3 ms, fbgemm's 6.9).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "pool.h"
#include "vec.h"

namespace {

using inferline::pool;

constexpr int64_t CHUNK_BYTES = 256 * 1024;

// One vector of weights as floats: float32 as they are; int8 sign-extended and converted (a
// vpmovsxbd and a vcvtdq2ps per vector), so an int8 matrix streams a quarter of float32's bytes.
// Intrinsics for x86: GCC 12 turns __builtin_convertvector from 16 int8 lanes into a scalar
// conversion per lane (the int8 kernel ran at half float32's speed that way).
inline vn load_w(const float* p) { return load<vn>(p); }

inline vn load_w(const int8_t* p) {
#if defined(__AVX512F__)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  vn v;
  for (int i = 0; i < NW; i++) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

// Outputs per block for MR rows of x: as many as keep the MR * NR accumulators, the MR rows of x
// and one row of weights in registers (up to 8, or 4 from 3 rows on).
template <int MR>
constexpr int block_width() {
  constexpr int fit = (NREGS - MR - 1) / MR;
  constexpr int widest = MR <= 2 ? 8 : 4;
  return fit < 1 ? 1 : (fit < widest ? fit : widest);
}

// y[m, n0 + r] = (x[m, :] . w[n0 + r, :]) * scale[n0 + r] for m < MR, r < NR (scale: none for float32).
template <int MR, int NR, typename T>
inline void dot_block(const float* x, int64_t x_stride, const T* w, const float* scale, int64_t k, float* y,
                      int64_t y_stride, int64_t n0) {
  vn acc[MR][NR];
  for (int m = 0; m < MR; m++)
    for (int r = 0; r < NR; r++) acc[m][r] = vn{};
  const T* rows[NR];
  for (int r = 0; r < NR; r++) rows[r] = w + (n0 + r) * k;
  // The next block's rows are prefetched, a slice at every step. int8: NR interleaved row streams
  // that each advance a quarter of a cache line a step leave the hardware prefetcher far behind
  // (streaming a 28 MB int8 matrix on one core, AVX-512 Zen 4: 6.4 GB/s without, 19.9 with).
  // float32 from 2 rows of x on, where a step does more arithmetic per line of weights and the
  // misses no longer overlap on their own: a pass over SmolLM2-135M's 120 layer matmuls from memory
  // (Sapphire Rapids, 2 threads) at 2, 3, 4, 8 and 16 rows 18.0, 18.2, 20.0, 26.4, 32.6 ms against
  // 19.6, 21.4, 23.8, 29.2, 37.2 without. One row streams a whole line a step: there it measured
  // within the noise (16.3 against 16.2 ms), so it is not done.
  const char* ahead = reinterpret_cast<const char*>(w + (n0 + NR) * k);
  constexpr int64_t AHEAD_BYTES = NR * NW * static_cast<int64_t>(sizeof(T));
  int64_t i = 0;
  for (; i + NW <= k; i += NW, ahead += AHEAD_BYTES) {
    if constexpr (sizeof(T) == 1 || MR >= 2)
      for (int64_t b = 0; b < AHEAD_BYTES; b += 64) __builtin_prefetch(ahead + b);
    vn xv[MR];
    for (int m = 0; m < MR; m++) xv[m] = load<vn>(x + m * x_stride + i);
    for (int r = 0; r < NR; r++) {
      const vn wv = load_w(rows[r] + i);
      for (int m = 0; m < MR; m++) acc[m][r] += xv[m] * wv;
    }
  }
  for (int m = 0; m < MR; m++) {
    for (int r = 0; r < NR; r++) {
      float sum = hsum_n(acc[m][r]);
      for (int64_t j = i; j < k; j++) sum += x[m * x_stride + j] * static_cast<float>(rows[r][j]);
      y[m * y_stride + n0 + r] = scale != nullptr ? sum * scale[n0 + r] : sum;
    }
  }
}

template <int MR, typename T>
void dot_rows(const float* x, int64_t x_stride, const T* w, const float* scale, int64_t k, float* y,
              int64_t y_stride, int64_t begin, int64_t end) {
  constexpr int NR = block_width<MR>();
  int64_t n = begin;
  for (; n + NR <= end; n += NR) dot_block<MR, NR>(x, x_stride, w, scale, k, y, y_stride, n);
  for (; n < end; n++) dot_block<MR, 1>(x, x_stride, w, scale, k, y, y_stride, n);
}

template <typename T>
struct LinearJob {
  const float* x;
  int64_t x_stride, rows;
  const T* w;
  const float* scale;  // per output, int8 weights only
  int64_t k, n;
  const float* bias;
  float* y;
  int64_t chunk_rows;
};

template <typename T>
void linear_chunk(const void* arg, int64_t chunk) {
  const LinearJob<T>& job = *static_cast<const LinearJob<T>*>(arg);
  const int64_t begin = chunk * job.chunk_rows, end = std::min(job.n, begin + job.chunk_rows);
  for (int64_t m = 0; m < job.rows; m += 4) {
    const float* x = job.x + m * job.x_stride;
    float* y = job.y + m * job.n;
    switch (std::min<int64_t>(4, job.rows - m)) {
      case 1: dot_rows<1>(x, job.x_stride, job.w, job.scale, job.k, y, job.n, begin, end); break;
      case 2: dot_rows<2>(x, job.x_stride, job.w, job.scale, job.k, y, job.n, begin, end); break;
      case 3: dot_rows<3>(x, job.x_stride, job.w, job.scale, job.k, y, job.n, begin, end); break;
      default: dot_rows<4>(x, job.x_stride, job.w, job.scale, job.k, y, job.n, begin, end); break;
    }
    if (job.bias != nullptr) {
      for (int64_t r = 0; r < std::min<int64_t>(4, job.rows - m); r++)
        for (int64_t n = begin; n < end; n++) y[r * job.n + n] += job.bias[n];
    }
  }
}

const float* checked_bias(const c10::optional<at::Tensor>& bias, int64_t n, const char* op) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
              op, ": bias must be a contiguous float32 tensor of ", n, " elements");
  return bias->data_ptr<float>();
}

template <typename T>
at::Tensor run_linear(const at::Tensor& x, const T* w, const float* scale, int64_t n, int64_t k, const float* bias) {
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0 || n == 0) return y;
  // Chunks of about 256 KB of weights (a multiple of 8 rows), 5-6 us of streaming each: long enough
  // runs for the hardware prefetcher (64 KB chunks were 6-8% slower at batch 1), short enough that a
  // late or descheduled helper leaves little for the others to wait on.
  const int64_t row_bytes = k * static_cast<int64_t>(sizeof(T));
  const int64_t chunk_rows = std::max<int64_t>(8, ((CHUNK_BYTES / row_bytes) + 7) / 8 * 8);
  const LinearJob<T> job{x.data_ptr<float>(), x.stride(0), x.size(0), w, scale, k, n, bias, y.data_ptr<float>(),
                         chunk_rows};
  pool().run(&linear_chunk<T>, &job, (n + chunk_rows - 1) / chunk_rows);
  return y;
}

void check_x(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              op, ": x must be a float32 CPU tensor [rows, k] with contiguous rows");
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  check_x(x, "small_linear");
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2 &&
                  weight.is_contiguous() && weight.size(1) == x.size(1),
              "small_linear: weight must be a contiguous float32 CPU tensor [n, k] with k = ", x.size(1));
  const int64_t n = weight.size(0), k = weight.size(1);
  return run_linear(x, weight.data_ptr<float>(), nullptr, n, k, checked_bias(bias, n, "small_linear"));
}

// y = (x @ weight.T) * scale + bias for int8 weight [n, k] with a float32 scale per output: weight-only
// quantization, the activations stay float32.
at::Tensor small_linear_int8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                             const c10::optional<at::Tensor>& bias) {
  check_x(x, "small_linear_int8");
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kChar && weight.dim() == 2 &&
                  weight.is_contiguous() && weight.size(1) == x.size(1),
              "small_linear_int8: weight must be a contiguous int8 CPU tensor [n, k] with k = ", x.size(1));
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == n,
              "small_linear_int8: scale must be a contiguous float32 tensor of ", n, " elements");
  return run_linear(x, weight.data_ptr<int8_t>(), scale.data_ptr<float>(), n, k,
                    checked_bias(bias, n, "small_linear_int8"));
}

int64_t small_linear_threads() { return pool().threads(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferline, m) {
  m.def("small_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("small_linear", c10::DispatchKey::CPU, &small_linear);
  m.def("small_linear_int8(Tensor x, Tensor weight, Tensor scale, Tensor? bias) -> Tensor");
  m.impl("small_linear_int8", c10::DispatchKey::CPU, &small_linear_int8);
  m.def("small_linear_threads() -> int", &small_linear_threads);
}
