// Linear layers at decode batch sizes (a few rows to a few dozen), float32 or int8 weights, on the
// kernels' own thread pool (pool.h).
//
//   pack_panels(out [P, K, PANEL], weight [N, K])               out: weight's columns in panels
//   panel_linear(x [M, K], panels [P, K, PANEL], n, bias [N]?) -> [M, N]   y = x @ weight.T + bias
//   small_linear_int8(x [M, K], weight [N, K] int8, scale [N], bias [N]?) -> [M, N]
//                                                       y = (x @ weight.T) * scale + bias
//
// float32: outer products over packed panels (panel_linear). A panel is PANEL consecutive outputs
// (3 of the machine's vectors), stored k-major: panels[p, k, j] = weight[p * PANEL + j, k], the last
// panel padded with zero columns. A register block is PANEL_ROWS rows of x times one panel: each step
// of k loads the panel's 3 vectors once and multiplies them by a broadcast element of each row, into
// PANEL_ROWS x 3 accumulators, with no horizontal sums. k runs in blocks of PANEL_K: every block of
// rows of x takes a panel's k-block while it is in L1, and only then does the panel move on, so a step
// streams its weights from memory once, at an even pace, in one sequential run per panel that the
// hardware prefetcher follows (and the next k-block is prefetched during the first block of rows).
// Dot products over the plain [N, K] matrix instead (NR rows of weights against MR rows of x, a
// horizontal sum per output) would read a chunk of weights from memory for the first 4 rows of x
// and from L2 for the others: the memory stream and the arithmetic would take turns.
//
// int8 (weight-only quantization, serving/engine/quant.py): dot products over the plain matrix, each
// weight vector widened to float32 in registers, the activations float32; a step streams a quarter of
// float32's bytes, with the next rows prefetched so that the stream keeps up.
//
// Each output accumulates in float32 lanes in its own order: not the summation order of MKL or
// oneDNN, so results differ from theirs in the last bits.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
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

constexpr int64_t CHUNK_BYTES = 256 * 1024;

// One vector of int8 weights as floats, sign-extended and converted (a vpmovsxbd and a vcvtdq2ps per
// vector). Intrinsics for x86: GCC 12 turns __builtin_convertvector from 16 int8 lanes into a scalar
// conversion per lane (the int8 kernel ran at half float32's speed that way).
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

// int8: y[m, n0 + r] = (x[m, :] . w[n0 + r, :]) * scale[n0 + r] for m < MR, r < NR.
template <int MR, int NR>
inline void dot_block(const float* x, int64_t x_stride, const int8_t* w, const float* scale, int64_t k, float* y,
                      int64_t y_stride, int64_t n0) {
  vn acc[MR][NR];
  for (int m = 0; m < MR; m++)
    for (int r = 0; r < NR; r++) acc[m][r] = vn{};
  const int8_t* rows[NR];
  for (int r = 0; r < NR; r++) rows[r] = w + (n0 + r) * k;
  // The next block's rows are prefetched, a slice at every step: NR interleaved row streams that each
  // advance a quarter of a cache line a step leave the hardware prefetcher far behind.
  const char* ahead = reinterpret_cast<const char*>(w + (n0 + NR) * k);
  constexpr int64_t AHEAD_BYTES = NR * NW;
  int64_t i = 0;
  for (; i + NW <= k; i += NW, ahead += AHEAD_BYTES) {
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
      y[m * y_stride + n0 + r] = sum * scale[n0 + r];
    }
  }
}

template <int MR>
void dot_rows(const float* x, int64_t x_stride, const int8_t* w, const float* scale, int64_t k, float* y,
              int64_t y_stride, int64_t begin, int64_t end) {
  constexpr int NR = block_width<MR>();
  int64_t n = begin;
  for (; n + NR <= end; n += NR) dot_block<MR, NR>(x, x_stride, w, scale, k, y, y_stride, n);
  for (; n < end; n++) dot_block<MR, 1>(x, x_stride, w, scale, k, y, y_stride, n);
}

struct LinearJob {
  const float* x;
  int64_t x_stride, rows;
  const int8_t* w;
  const float* scale;  // per output
  int64_t k, n;
  const float* bias;
  float* y;
  int64_t chunk_rows;
};

void linear_chunk(const void* arg, int64_t chunk) {
  const LinearJob& job = *static_cast<const LinearJob*>(arg);
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

at::Tensor run_linear(const at::Tensor& x, const int8_t* w, const float* scale, int64_t n, int64_t k,
                      const float* bias) {
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0 || n == 0) return y;
  // Chunks of about 256 KB of weights (a multiple of 8 rows), microseconds of streaming each: long
  // enough runs for the hardware prefetcher (smaller chunks are slower at batch 1), short enough that a
  // late or descheduled helper leaves little for the others to wait on.
  const int64_t chunk_rows = std::max<int64_t>(8, ((CHUNK_BYTES / k) + 7) / 8 * 8);  // k bytes a row
  const LinearJob job{x.data_ptr<float>(), x.stride(0), x.size(0), w, scale, k, n, bias, y.data_ptr<float>(),
                         chunk_rows};
  pool().run(&linear_chunk, &job, (n + chunk_rows - 1) / chunk_rows);
  return y;
}

void check_x(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              op, ": x must be a float32 CPU tensor [rows, k] with contiguous rows");
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

// ---- float32: outer products over panels (see the top of the file)

// Vectors per panel, and rows of x per register block: PANEL_ROWS x PANEL_VECS accumulators, the
// panel's vectors and a broadcast fill the registers (AVX-512: 24 + 3 + 1 of 32; AVX2: 12 + 3 + 1 of
// 16). 4 vectors x 6 rows and 2 x 12 are no faster than 3 x 8.
constexpr int PANEL_VECS = 3, PANEL_ROWS = NREGS == 32 ? 8 : 4;
constexpr int64_t PANEL = PANEL_VECS * NW;
// k per block: the panel's 64 x 48 floats (12 KB) and a block of rows' 64 floats each stay in L1
// while every block of rows takes them (larger blocks are no faster).
constexpr int64_t PANEL_K = 64;

// How a block of rows asks for the panel's next k-block while it computes this one. One block of rows
// (up to PANEL_ROWS rows: decode) asks for all of it, a step's worth at each step (ALL). With more
// blocks of rows, every block asks for its share, spread evenly over its steps (SHARE): asked for in
// the first block only, the next k-block would come in a burst that the memory system does not finish
// while the rest of the rows compute, and a step's time would be the weights' streaming time plus the
// compute. At one block, shares would add their bookkeeping and gain nothing, so it keeps ALL. Where
// the hardware prefetchers alone stream faster, the caller passes burst=false and one block asks for
// nothing (start-up measures which: llama.calibrate_burst).
enum class Ahead { NONE, ALL, SHARE };

// The SHARE of the next k-block (cache lines from *next*) that a block of rows asks for: the k-block's
// *lines* spread over *steps* steps (the blocks of rows times kc), continuing where the last block left off.
struct Share {
  const char* next;
  int64_t lines, steps, issued = 0, owed = 0;
};

// acc (R rows x a panel, at c, PANEL apart) += x[r, :kc] (xs apart) times the k-block wp ([kc, PANEL]),
// starting from zero when first, asking for the panel's next k-block meanwhile (AHEAD, *share*).
template <int R, Ahead AHEAD>
inline void panel_block(const float* x, int64_t xs, const float* wp, int64_t kc, float* c, bool first,
                        Share* share) {
  vn acc[R][PANEL_VECS];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < PANEL_VECS; v++) acc[r][v] = first ? vn{} : load<vn>(c + r * PANEL + v * NW);
  const char* ahead = reinterpret_cast<const char*>(wp + kc * PANEL);
  [[maybe_unused]] int64_t issued = 0, owed = 0, lines = 0, steps = 1;
  if constexpr (AHEAD == Ahead::SHARE) {
    ahead = share->next;
    issued = share->issued, owed = share->owed, lines = share->lines, steps = share->steps;
  }
  for (int64_t i = 0; i < kc; i++) {
    if constexpr (AHEAD == Ahead::ALL)
      for (int64_t b = 0; b < PANEL * static_cast<int64_t>(sizeof(float)); b += 64)
        __builtin_prefetch(ahead + i * PANEL * sizeof(float) + b);
    if constexpr (AHEAD == Ahead::SHARE)
      for (owed += lines; owed >= steps; owed -= steps) __builtin_prefetch(ahead + 64 * issued++);
    vn w[PANEL_VECS];
    for (int v = 0; v < PANEL_VECS; v++) {
      w[v] = load<vn>(wp + i * PANEL + v * NW);
      IN_REGISTER(w[v]);
    }
    for (int r = 0; r < R; r++) {
      const vn b = splat_n(x[r * xs + i]);
      for (int v = 0; v < PANEL_VECS; v++) acc[r][v] += b * w[v];
    }
  }
  if constexpr (AHEAD == Ahead::SHARE) share->issued = issued, share->owed = owed;
  for (int r = 0; r < R; r++)
    for (int v = 0; v < PANEL_VECS; v++) store(c + r * PANEL + v * NW, acc[r][v]);
}

template <Ahead AHEAD, int R = PANEL_ROWS>
inline void panel_rows(int rows, const float* x, int64_t xs, const float* wp, int64_t kc, float* c, bool first,
                       Share* share) {
  if constexpr (R > 1) {
    if (rows < R) return panel_rows<AHEAD, R - 1>(rows, x, xs, wp, kc, c, first, share);
  }
  panel_block<R, AHEAD>(x, xs, wp, kc, c, first, share);
}

struct PanelJob {
  const float* x;
  int64_t x_stride, rows;
  const float* panels;
  int64_t k, n;
  const float* bias;
  float* y;
  bool burst;  // one block of rows asks for the next k-block (Ahead::ALL), else leaves it to the hardware
};

// Panel p of the job: all rows of x against outputs [p * PANEL, (p + 1) * PANEL), accumulated in a
// thread's own rows x PANEL buffer (L1), then written out (bias added, padding columns dropped).
void panel_item(const void* arg, int64_t p) {
  const PanelJob& job = *static_cast<const PanelJob*>(arg);
  thread_local std::vector<float> buffer;
  buffer.resize(job.rows * PANEL);
  float* c = buffer.data();
  const float* wp = job.panels + p * job.k * PANEL;
  const int64_t blocks = (job.rows + PANEL_ROWS - 1) / PANEL_ROWS;
  for (int64_t k0 = 0; k0 < job.k; k0 += PANEL_K) {
    const int64_t kc = std::min(PANEL_K, job.k - k0);
    const int64_t next_kc = std::min(PANEL_K, job.k - k0 - kc);
    const float* w = wp + k0 * PANEL;
    if (next_kc == 0) {  // the last k-block: nothing to ask for
      for (int64_t m = 0; m < job.rows; m += PANEL_ROWS)
        panel_rows<Ahead::NONE>(static_cast<int>(std::min<int64_t>(PANEL_ROWS, job.rows - m)),
                                job.x + m * job.x_stride + k0, job.x_stride, w, kc, c + m * PANEL, k0 == 0, nullptr);
    } else if (blocks == 1 && job.burst) {
      panel_rows<Ahead::ALL>(static_cast<int>(job.rows), job.x + k0, job.x_stride, w, kc, c, k0 == 0, nullptr);
    } else if (blocks == 1) {
      panel_rows<Ahead::NONE>(static_cast<int>(job.rows), job.x + k0, job.x_stride, w, kc, c, k0 == 0, nullptr);
    } else {
      Share share{reinterpret_cast<const char*>(w + kc * PANEL),
                  (next_kc * PANEL * static_cast<int64_t>(sizeof(float)) + 63) / 64, blocks * kc};
      for (int64_t m = 0; m < job.rows; m += PANEL_ROWS)
        panel_rows<Ahead::SHARE>(static_cast<int>(std::min<int64_t>(PANEL_ROWS, job.rows - m)),
                                 job.x + m * job.x_stride + k0, job.x_stride, w, kc, c + m * PANEL, k0 == 0, &share);
    }
  }
  const int64_t n0 = p * PANEL, cols = std::min(PANEL, job.n - n0);
  for (int64_t m = 0; m < job.rows; m++) {
    float* y = job.y + m * job.n + n0;
    const float* cm = c + m * PANEL;
    if (job.bias != nullptr)
      for (int64_t j = 0; j < cols; j++) y[j] = cm[j] + job.bias[n0 + j];
    else
      std::memcpy(y, cm, cols * sizeof(float));
  }
}

void check_panels(const at::Tensor& panels, const char* op) {
  TORCH_CHECK(panels.device().is_cpu() && panels.scalar_type() == at::kFloat && panels.dim() == 3 &&
                  panels.size(2) == PANEL && panels.is_contiguous(),
              op, ": panels must be a contiguous float32 CPU tensor [P, K, ", PANEL, "]");
}

// out [ceil(N / PANEL), K, PANEL] = weight [N, K] in panels, the last one padded with zeros.
void pack_panels(at::Tensor out, const at::Tensor& weight) {
  check_panels(out, "pack_panels");
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2,
              "pack_panels: weight must be a float32 CPU tensor [n, k]");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(out.size(0) == (n + PANEL - 1) / PANEL && out.size(1) == k, "pack_panels: out must be [",
              (n + PANEL - 1) / PANEL, ", ", k, ", ", PANEL, "] for a [", n, ", ", k, "] weight");
  const at::Tensor w = weight.contiguous();
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, out.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; p++) {
      float* panel = dst + p * k * PANEL;
      std::fill(panel, panel + k * PANEL, 0.f);
      for (int64_t j = 0; j < PANEL && p * PANEL + j < n; j++) {
        const float* row = src + (p * PANEL + j) * k;
        for (int64_t i = 0; i < k; i++) panel[i * PANEL + j] = row[i];
      }
    }
  });
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                        const c10::optional<at::Tensor>& bias, bool burst) {
  check_x(x, "panel_linear");
  check_panels(panels, "panel_linear");
  TORCH_CHECK(panels.size(1) == x.size(1), "panel_linear: panels hold k = ", panels.size(1), ", x has ", x.size(1));
  TORCH_CHECK(n > (panels.size(0) - 1) * PANEL && n <= panels.size(0) * PANEL, "panel_linear: ", panels.size(0),
              " panels cannot hold n = ", n, " outputs");
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return y;
  const PanelJob job{x.data_ptr<float>(), x.stride(0), x.size(0), panels.data_ptr<float>(), x.size(1), n,
                     checked_bias(bias, n, "panel_linear"), y.data_ptr<float>(), burst};
  pool().run(&panel_item, &job, panels.size(0));
  return y;
}

int64_t panel_width() { return PANEL; }

int64_t small_linear_threads() { return pool().threads(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferline, m) {
  m.def("pack_panels(Tensor(a!) out, Tensor weight) -> ()");
  m.impl("pack_panels", c10::DispatchKey::CPU, &pack_panels);
  m.def("panel_linear(Tensor x, Tensor panels, int n, Tensor? bias, bool burst=True) -> Tensor");
  m.impl("panel_linear", c10::DispatchKey::CPU, &panel_linear);
  m.def("panel_width() -> int", &panel_width);
  m.def("small_linear_int8(Tensor x, Tensor weight, Tensor scale, Tensor? bias) -> Tensor");
  m.impl("small_linear_int8", c10::DispatchKey::CPU, &small_linear_int8);
  m.def("small_linear_threads() -> int", &small_linear_threads);
}
