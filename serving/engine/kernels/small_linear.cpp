// Linear layers at decode batch sizes (a few rows), float32, on a thread pool of our own.
//
// At batch 1 a decode step of SmolLM2-135M is 121 matrix-vector products that read
// 540 MB of weights: memory-bound work that two cores stream at 40-45 GB/s. Through
// oneDNN each product is an OpenMP parallel region, and with OMP_WAIT_POLICY=PASSIVE
// (which the engine sets; see docs/engine.md) OpenMP's worker sleeps between regions
// and takes 30-40 us to wake for each: a quarter of the step (measured: the 121
// products take 16-20 ms through oneDNN, 12 ms here). A spinning OpenMP would fix
// that for this loop and hurt everything else on a shared machine, so the products
// of up to a few rows run here instead:
//
//   * The pool's helpers spin for a short while after each job (INFERLINE_POOL_SPIN_US,
//     default 100 us: longer than the gaps between the matmuls of one step, far shorter
//     than the gap between steps), yielding their core every few dozen spins in case
//     anyone else waits for it, then sleep on a condition variable.
//   * Work is handed out in chunks of rows through one atomic ticket, and the caller
//     takes chunks too: a helper that is asleep only means the caller does more of the
//     job itself. The caller waits only for chunks a helper has already claimed, and
//     yields its core while it does.
//   * A helper that holds a claimed chunk for over a millisecond has lost its core to
//     another process, and the scheduler, which favours threads that sleep, may keep a
//     spinning one off it for a whole time slice: the next 50 ms of jobs then run on the
//     caller's thread alone. Measured with a busy loop holding one of 2 cores, batch-1
//     decode: 48-51 tokens/s here against 43-47 through oneDNN; batch 2: 80-82 against
//     88-89 (idle: 65-85 against 44-46, and 118-125 against 82-87).
//   * A call that finds the pool busy (another engine's thread) runs on its own thread.
//
//   small_linear(x [M, K], weight [N, K], bias [N]?) -> [M, N]     y = x @ weight.T + bias
//
// Each output is one dot product over K, accumulated in float32 lanes of the machine's own vector
// width (16 with AVX-512, else 8): not the summation order of MKL or oneDNN, so results differ from
// theirs in the last bits.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "vec.h"

namespace {

constexpr int64_t CHUNK_BYTES = 256 * 1024;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// A job: fn(arg, chunk) for chunk in [0, chunks). The ticket holds the job's generation in its
// high 32 bits and the next unclaimed chunk in its low 32; a claim is a compare-and-swap that
// fails once the generation has moved on, so a late helper can never run a finished job.
class Pool {
 public:
  using Fn = void (*)(const void* arg, int64_t chunk);

  explicit Pool(int helpers, std::chrono::nanoseconds spin) : spin_(spin) {
    for (int i = 0; i < helpers; i++) threads_.emplace_back([this] { loop(); });
  }

  int threads() const { return static_cast<int>(threads_.size()) + 1; }

  void run(Fn fn, const void* arg, int64_t chunks) {
    std::unique_lock<std::mutex> mine(run_mutex_, std::try_to_lock);
    if (!mine.owns_lock() || threads_.empty() || Clock::now() < solo_until_) {
      // Busy with another caller's job, or helpers recently stalled: do it all on this thread.
      for (int64_t c = 0; c < chunks; c++) fn(arg, c);
      return;
    }
    const uint64_t gen = ++generation_;
    Slot& slot = slots_[gen & 1];
    slot.fn.store(fn, std::memory_order_relaxed);
    slot.arg.store(arg, std::memory_order_relaxed);
    slot.chunks.store(chunks, std::memory_order_relaxed);
    slot.done.store(0, std::memory_order_relaxed);
    ticket_.store(gen << 32, std::memory_order_seq_cst);  // publishes the slot
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
    work(gen, slot);
    Clock::time_point waiting_since{};
    for (int spins = 0; slot.done.load(std::memory_order_acquire) < chunks; spins++) {
      if (spins < 256) {
        cpu_relax();
        continue;
      }
      sched_yield();  // a helper holding a chunk may be waiting for this very core
      if (spins == 256) {
        waiting_since = Clock::now();
      } else if (spins % 64 == 0 && Clock::now() - waiting_since > STALL) {
        // A chunk takes microseconds: its helper lost its core to another thread, and the
        // scheduler may keep it off for a whole time slice. Spinning helpers are what the
        // scheduler punishes, so stop handing them work for a while.
        solo_until_ = Clock::now() + SOLO;
      }
    }
  }

 private:
  struct Slot {
    std::atomic<Fn> fn{nullptr};
    std::atomic<const void*> arg{nullptr};
    std::atomic<int64_t> chunks{0};
    std::atomic<int64_t> done{0};
  };

  // Claims and runs chunks of job *gen* until none is left or the job is over.
  void work(uint64_t gen, Slot& slot) {
    const Fn fn = slot.fn.load(std::memory_order_relaxed);
    const void* arg = slot.arg.load(std::memory_order_relaxed);
    const int64_t chunks = slot.chunks.load(std::memory_order_relaxed);
    uint64_t ticket = ticket_.load(std::memory_order_acquire);
    while ((ticket >> 32) == (gen & 0xffffffffu) && static_cast<int64_t>(ticket & 0xffffffffu) < chunks) {
      if (ticket_.compare_exchange_weak(ticket, ticket + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        fn(arg, static_cast<int64_t>(ticket & 0xffffffffu));
        slot.done.fetch_add(1, std::memory_order_release);
        ticket = ticket_.load(std::memory_order_acquire);
      }
    }
  }

  void loop() {
    uint64_t seen = 0;  // the last generation this helper took part in
    for (;;) {
      uint64_t gen = ticket_.load(std::memory_order_acquire) >> 32;
      auto start = std::chrono::steady_clock::now();
      for (int spins = 0; gen == seen; spins++) {
        cpu_relax();
        if (spins % 64 != 63) continue;
        sched_yield();  // hands the core back at once if the caller (or anyone) is waiting for it
        if (std::chrono::steady_clock::now() - start > spin_) {
          std::unique_lock<std::mutex> lock(sleep_mutex_);
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          wake_.wait(lock, [&] { return (ticket_.load(std::memory_order_seq_cst) >> 32) != seen; });
          sleepers_.fetch_sub(1, std::memory_order_seq_cst);
          start = std::chrono::steady_clock::now();
        }
        gen = ticket_.load(std::memory_order_acquire) >> 32;
      }
      seen = gen;
      work(gen, slots_[gen & 1]);
    }
  }

  using Clock = std::chrono::steady_clock;
  // A wait this long for a claimed chunk means a descheduled helper (another process took its
  // core: measured with a busy loop on one of 2 cores); then SOLO without helpers.
  static constexpr std::chrono::microseconds STALL{1000};
  static constexpr std::chrono::milliseconds SOLO{50};

  const std::chrono::nanoseconds spin_;
  std::vector<std::thread> threads_;
  std::mutex run_mutex_;
  Clock::time_point solo_until_{};  // guarded by run_mutex_
  uint64_t generation_ = 0;  // written by the caller holding run_mutex_ only
  Slot slots_[2];  // job g lives in slots_[g & 1]: job g+1 is only published once g is done
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int> sleepers_{0};
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
};

std::atomic<Pool*> the_pool{nullptr};
std::mutex pool_mutex;

// A forked child has none of the parent's helper threads (and maybe a mutex held by one): it
// starts a pool of its own on first use. The parent's is left as it is, never freed.
void forget_pool_in_child() { the_pool.store(nullptr); }

Pool& pool() {
  Pool* pool = the_pool.load(std::memory_order_acquire);
  if (pool != nullptr) return *pool;
  std::lock_guard<std::mutex> lock(pool_mutex);
  pool = the_pool.load(std::memory_order_relaxed);
  if (pool == nullptr) {
    static std::once_flag registered;
    std::call_once(registered, [] { pthread_atfork(nullptr, nullptr, forget_pool_in_child); });
    const char* spin_us = std::getenv("INFERLINE_POOL_SPIN_US");
    const int64_t spin = spin_us != nullptr ? std::max<int64_t>(0, std::atoll(spin_us)) : 100;
    const int helpers = std::max(0, std::min(at::get_num_threads(), 16) - 1);  // torch's threads, the caller included
    pool = new Pool(helpers, std::chrono::microseconds(spin));
    the_pool.store(pool, std::memory_order_release);
  }
  return *pool;
}

// Outputs per block for MR rows of x: as many as keep the MR * NR accumulators, the MR rows of x
// and one row of weights in registers (up to 8, or 4 from 3 rows on).
template <int MR>
constexpr int block_width() {
  constexpr int fit = (NREGS - MR - 1) / MR;
  constexpr int widest = MR <= 2 ? 8 : 4;
  return fit < 1 ? 1 : (fit < widest ? fit : widest);
}

// y[m, n0 + r] = x[m, :] . w[n0 + r, :] for m < MR, r < NR.
template <int MR, int NR>
inline void dot_block(const float* x, int64_t x_stride, const float* w, int64_t k, float* y, int64_t y_stride,
                      int64_t n0) {
  vn acc[MR][NR];
  for (int m = 0; m < MR; m++)
    for (int r = 0; r < NR; r++) acc[m][r] = vn{};
  const float* rows[NR];
  for (int r = 0; r < NR; r++) rows[r] = w + (n0 + r) * k;
  int64_t i = 0;
  for (; i + NW <= k; i += NW) {
    vn xv[MR];
    for (int m = 0; m < MR; m++) xv[m] = load<vn>(x + m * x_stride + i);
    for (int r = 0; r < NR; r++) {
      const vn wv = load<vn>(rows[r] + i);
      for (int m = 0; m < MR; m++) acc[m][r] += xv[m] * wv;
    }
  }
  for (int m = 0; m < MR; m++) {
    for (int r = 0; r < NR; r++) {
      float sum = hsum_n(acc[m][r]);
      for (int64_t j = i; j < k; j++) sum += x[m * x_stride + j] * rows[r][j];
      y[m * y_stride + n0 + r] = sum;
    }
  }
}

template <int MR>
void dot_rows(const float* x, int64_t x_stride, const float* w, int64_t k, float* y, int64_t y_stride,
              int64_t begin, int64_t end) {
  constexpr int NR = block_width<MR>();
  int64_t n = begin;
  for (; n + NR <= end; n += NR) dot_block<MR, NR>(x, x_stride, w, k, y, y_stride, n);
  for (; n < end; n++) dot_block<MR, 1>(x, x_stride, w, k, y, y_stride, n);
}

struct LinearJob {
  const float* x;
  int64_t x_stride, rows;
  const float* w;
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
      case 1: dot_rows<1>(x, job.x_stride, job.w, job.k, y, job.n, begin, end); break;
      case 2: dot_rows<2>(x, job.x_stride, job.w, job.k, y, job.n, begin, end); break;
      case 3: dot_rows<3>(x, job.x_stride, job.w, job.k, y, job.n, begin, end); break;
      default: dot_rows<4>(x, job.x_stride, job.w, job.k, y, job.n, begin, end); break;
    }
    if (job.bias != nullptr) {
      for (int64_t r = 0; r < std::min<int64_t>(4, job.rows - m); r++)
        for (int64_t n = begin; n < end; n++) y[r * job.n + n] += job.bias[n];
    }
  }
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "small_linear: x must be a float32 CPU tensor [rows, k] with contiguous rows");
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2 &&
                  weight.is_contiguous() && weight.size(1) == x.size(1),
              "small_linear: weight must be a contiguous float32 CPU tensor [n, k] with k = ", x.size(1));
  const int64_t n = weight.size(0), k = weight.size(1);
  const float* bias_data = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "small_linear: bias must be a contiguous float32 tensor of ", n, " elements");
    bias_data = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0 || n == 0) return y;
  // Chunks of about 256 KB of weights (a multiple of 8 rows), 5-6 us of streaming each: long enough
  // runs for the hardware prefetcher (64 KB chunks were 6-8% slower at batch 1), short enough that a
  // late or descheduled helper leaves little for the others to wait on.
  const int64_t chunk_rows = std::max<int64_t>(8, ((CHUNK_BYTES / (k * 4)) + 7) / 8 * 8);
  const LinearJob job{x.data_ptr<float>(), x.stride(0), x.size(0), weight.data_ptr<float>(), k, n, bias_data,
                      y.data_ptr<float>(), chunk_rows};
  pool().run(&linear_chunk, &job, (n + chunk_rows - 1) / chunk_rows);
  return y;
}

int64_t small_linear_threads() { return pool().threads(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferline, m) {
  m.def("small_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("small_linear", c10::DispatchKey::CPU, &small_linear);
  m.def("small_linear_threads() -> int", &small_linear_threads);
}
