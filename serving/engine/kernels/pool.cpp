// The process's kernel thread pool (pool.h).

#include "pool.h"

#include <ATen/Parallel.h>

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

}  // namespace inferline
