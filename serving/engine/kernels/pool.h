// The thread pool our CPU kernels share (small_linear.cpp's matmuls, paged_attention.cpp's
// attention): a job is a number of chunks, fn(arg, chunk) each, that the calling thread and the
// pool's helpers claim one by one, each thread from a contiguous share of its own first.
//
// Through torch, each small matmul or attention call of a decode step is an OpenMP parallel region,
// and with OMP_WAIT_POLICY=PASSIVE (which the engine sets; see docs/engine.md) OpenMP's worker
// sleeps between regions and takes tens of microseconds to wake for each: at batch 1 a large share of
// the step. A spinning OpenMP would fix that for this loop and hurt everything else on a shared
// machine, so the kernels of a decode step run here instead:
//
//   * The pool's helpers spin for a short while after each job (INFERLINE_POOL_SPIN_US,
//     default 100 us: longer than the gaps between the matmuls of one step, far shorter
//     than the gap between steps), yielding their core every few dozen spins in case
//     anyone else waits for it, then sleep on a condition variable.
//   * Work is handed out in contiguous shares: thread i (the caller is 0) starts with the i-th
//     of threads() consecutive runs of chunks and claims them front to back, then claims what
//     is left of the others' from their backs. A helper that is asleep only means the caller
//     does more of the job itself. The caller waits only for chunks a helper has already
//     claimed, and yields its core while it does. In a matmul each thread thus streams one long
//     run of weights, where chunks handed out one at a time from one ticket would have the threads
//     take every other panel, and read the weights more slowly. A job of more chunks than a
//     share's 16-bit bounds hold still goes out from the ticket.
//   * A helper that holds a claimed chunk for over a millisecond has lost its core to
//     another process, and the scheduler, which favours threads that sleep, may keep a
//     spinning one off it for a whole time slice: the next 50 ms of jobs then run on the
//     caller's thread alone.
//   * A call that finds the pool busy (another engine's thread) runs on its own thread.
//
// One pool per process (pool.cpp), shared by every kernel: the attention call that follows a
// matmul finds the helpers still spinning from it.

#pragma once

#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace inferline {

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
    for (int i = 0; i < helpers; i++) threads_.emplace_back([this, i] { loop(i + 1); });
  }

  int threads() const { return static_cast<int>(threads_.size()) + 1; }

  // fn(arg, c) for every c in [0, chunks), on the pool.
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
    const int shares = chunks <= MAX_SHARE_CHUNKS ? static_cast<int>(std::min<int64_t>(threads(), chunks)) : 0;
    slot.shares.store(shares, std::memory_order_relaxed);
    for (int i = 0; i < shares; i++)
      slot.share[i].store(pack_share(gen, i * chunks / shares, (i + 1) * chunks / shares), std::memory_order_relaxed);
    ticket_.store(gen << 32, std::memory_order_seq_cst);  // publishes the slot
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
    work(gen, slot, 0);
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
  static constexpr int MAX_SHARES = 16;  // pool.cpp starts at most 15 helpers
  static constexpr int64_t MAX_SHARE_CHUNKS = 0xffff;  // a share's bounds are 16 bits each

  struct Slot {
    std::atomic<Fn> fn{nullptr};
    std::atomic<const void*> arg{nullptr};
    std::atomic<int64_t> chunks{0};
    std::atomic<int64_t> done{0};
    std::atomic<int> shares{0};  // 0: chunks are claimed through ticket_ in order (too many for shares)
    // Contiguous shares: the job's generation (high 32 bits), the share's next chunk from the front
    // and its end (16 bits each). A claim is a compare-and-swap that fails once the job is over.
    std::atomic<uint64_t> share[MAX_SHARES];
  };

  static uint64_t pack_share(uint64_t gen, int64_t begin, int64_t end) {
    return (gen << 32) | (static_cast<uint64_t>(begin) << 16) | static_cast<uint64_t>(end);
  }

  // A chunk of share *s* of job *gen*, from its front or its back; -1 when the share is empty, -2
  // when the job is over.
  static int64_t claim(std::atomic<uint64_t>& s, uint64_t gen, bool front) {
    uint64_t v = s.load(std::memory_order_acquire);
    for (;;) {
      if ((v >> 32) != (gen & 0xffffffffu)) return -2;
      const int64_t begin = static_cast<int64_t>((v >> 16) & 0xffff), end = static_cast<int64_t>(v & 0xffff);
      if (begin >= end) return -1;
      if (s.compare_exchange_weak(v, front ? v + (uint64_t{1} << 16) : v - 1, std::memory_order_acq_rel,
                                  std::memory_order_acquire))
        return front ? begin : end - 1;
    }
  }

  // Claims and runs chunks of job *gen* until none is left or the job is over; *self*: the thread's
  // index (the caller 0), whose share it starts with.
  void work(uint64_t gen, Slot& slot, int self) {
    const Fn fn = slot.fn.load(std::memory_order_relaxed);
    const void* arg = slot.arg.load(std::memory_order_relaxed);
    const int64_t chunks = slot.chunks.load(std::memory_order_relaxed);
    const int shares = slot.shares.load(std::memory_order_relaxed);
    if (shares > 0) {
      for (int i = 0; i < shares; i++) {
        const bool own = i == 0 && self < shares;
        std::atomic<uint64_t>& share = slot.share[(self + i) % shares];
        int64_t c;
        while ((c = claim(share, gen, own)) >= 0) {
          fn(arg, c);
          slot.done.fetch_add(1, std::memory_order_release);
        }
        if (c == -2) return;  // the job is over
      }
      return;
    }
    uint64_t ticket = ticket_.load(std::memory_order_acquire);
    while ((ticket >> 32) == (gen & 0xffffffffu) && static_cast<int64_t>(ticket & 0xffffffffu) < chunks) {
      if (ticket_.compare_exchange_weak(ticket, ticket + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        fn(arg, static_cast<int64_t>(ticket & 0xffffffffu));
        slot.done.fetch_add(1, std::memory_order_release);
        ticket = ticket_.load(std::memory_order_acquire);
      }
    }
  }

  void loop(int self) {
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
      work(gen, slots_[gen & 1], self);
    }
  }

  using Clock = std::chrono::steady_clock;
  // A wait this long for a claimed chunk means a descheduled helper (another process took its
  // core); then SOLO without helpers.
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

// The process's pool, started on first use with torch's thread count (the caller included).
Pool& pool();

}  // namespace inferline
