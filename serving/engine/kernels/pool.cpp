// The process's kernel thread pool (pool.h).

#include "pool.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>

namespace inferline {
namespace {

std::atomic<Pool*> the_pool{nullptr};
std::mutex pool_mutex;

// A forked child has none of the parent's helper threads (and maybe a mutex held by one): it
// starts a pool of its own on first use. The parent's is left as it is, never freed.
void forget_pool_in_child() { the_pool.store(nullptr); }

}  // namespace

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

namespace {

// For the tests: runs a job of *chunks* chunks on the pool (each spins for *spin* iterations) and
// returns [2, chunks]: how many times each chunk ran, and whether the calling thread ran it (1) or a
// helper (0).
at::Tensor pool_trace(int64_t chunks, int64_t spin) {
  TORCH_CHECK(chunks >= 0, "pool_trace: chunks must not be negative");
  struct Trace {
    std::vector<std::atomic<int64_t>> runs, by_caller;
    std::thread::id caller;
    int64_t spin;
  } trace{std::vector<std::atomic<int64_t>>(chunks), std::vector<std::atomic<int64_t>>(chunks),
          std::this_thread::get_id(), spin};
  pool().run(
      [](const void* arg, int64_t chunk) {
        Trace& t = *static_cast<Trace*>(const_cast<void*>(arg));
        for (int64_t i = 0; i < t.spin; i++) cpu_relax();
        t.runs[chunk].fetch_add(1);
        if (std::this_thread::get_id() == t.caller) t.by_caller[chunk].store(1);
      },
      &trace, chunks);
  at::Tensor out = at::empty({2, chunks}, at::kLong);
  for (int64_t c = 0; c < chunks; c++) {
    out[0][c] = trace.runs[c].load();
    out[1][c] = trace.by_caller[c].load();
  }
  return out;
}

}  // namespace

}  // namespace inferline

TORCH_LIBRARY_FRAGMENT(inferline, m) {
  m.def("pool_trace(int chunks, int spin) -> Tensor", &inferline::pool_trace);
}
