// Helper threads for the kernels' parallel loops, whose caller returns as soon as every chunk
// is done. torch's parallel_for (OpenMP) ends each region at a barrier that waits for every
// thread of its team, and on two cores the server takes a core from the engine after every
// step: a decode step's ~150 regions then each wait, up to a scheduler tick, for a thread
// that has no work left. Here a helper takes chunks only while it runs; one that lost its
// core holds none, and the caller finishes the rest alone. Which thread computes a chunk
// never changes its bits.
#pragma once

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

class ChunkPool {
 public:
  // The process's pool (leaked on purpose: helpers may still be asleep when it exits).
  static ChunkPool& get() {
    static ChunkPool* pool = new ChunkPool;
    return *pool;
  }

  // f(i) for every i in [0, n), `chunk` indices at a time, on the caller and up to `helpers`
  // helper threads. Runs on the caller alone where there is nothing to share, or where
  // another thread is using the pool.
  template <typename F>
  void run(int64_t n, int64_t chunk, int helpers, const F& f) {
    if (helpers <= 0 || n <= chunk || n >= (int64_t{1} << 31) || !busy_.try_lock()) {
      for (int64_t i = 0; i < n; ++i) f(i);
      return;
    }
    start_helpers(helpers);
    f_.store(&f, std::memory_order_relaxed);
    call_.store(&call<F>, std::memory_order_relaxed);
    n_.store(n, std::memory_order_relaxed);
    chunk_.store(chunk, std::memory_order_relaxed);
    active_.store(helpers, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    const uint32_t job = generation_.load(std::memory_order_relaxed) + 1;
    ticket_.store(uint64_t{job} << 32, std::memory_order_release);
    generation_.store(job);  // seq_cst, against a helper's going to sleep (helper())
    if (sleeping_.load() > 0) generation_.notify_all();
    work(job);
    while (done_.load(std::memory_order_acquire) < n) pause();  // only chunks in flight
    busy_.unlock();
  }

 private:
  using Call = void (*)(const void*, int64_t, int64_t);
  template <typename F>
  static void call(const void* f, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) (*static_cast<const F*>(f))(i);
  }

  // Claim and run chunks of `job` until none is left. The ticket holds the job's number and
  // its next index, so a chunk is claimed only while its job is the current one: a job's
  // fields are rewritten only after all its chunks are done, and this one is not yet.
  void work(uint32_t job) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    for (;;) {
      const int64_t n = n_.load(std::memory_order_relaxed);
      const int64_t chunk = chunk_.load(std::memory_order_relaxed);
      const int64_t at = static_cast<int64_t>(t & 0xffffffffu);
      if ((t >> 32) != job || at >= n) return;
      if (!ticket_.compare_exchange_weak(t, t + chunk, std::memory_order_acq_rel,
                                         std::memory_order_acquire))
        continue;
      const int64_t end = std::min(n, at + chunk);
      call_.load(std::memory_order_relaxed)(f_.load(std::memory_order_relaxed), at, end);
      done_.fetch_add(end - at, std::memory_order_release);
      t = ticket_.load(std::memory_order_acquire);
    }
  }

  // Helpers are detached: a forked child has none of them, and starts its own.
  void start_helpers(int helpers) {
    if (owner_ != getpid()) owner_ = getpid(), started_ = 0;
    for (; started_ < helpers; ++started_)
      std::thread([this, index = started_] { helper(index); }).detach();
  }

  // Wait for a job: spinning for a while (a decode step's jobs come microseconds apart),
  // then asleep, so that between steps the core is the server's.
  void helper(int index) {
    uint32_t seen = generation_.load();
    for (;;) {
      auto spin_until = std::chrono::steady_clock::now() + SPIN;
      uint32_t job;
      for (int spins = 0; (job = generation_.load()) == seen; ++spins) {
        if (spins % 64 || std::chrono::steady_clock::now() < spin_until) {
          pause();
          continue;
        }
        sleeping_.fetch_add(1);
        generation_.wait(seen);
        sleeping_.fetch_sub(1);
        spin_until = std::chrono::steady_clock::now() + SPIN;
      }
      seen = job;
      if (index < active_.load(std::memory_order_relaxed)) work(job);
    }
  }

  static void pause() {
#if defined(__x86_64__)
    _mm_pause();
#else
    std::this_thread::yield();
#endif
  }

  static constexpr std::chrono::microseconds SPIN{100};
  std::mutex busy_;               // one caller at a time
  std::atomic<uint64_t> ticket_{0};  // job number << 32 | next index
  std::atomic<uint32_t> generation_{0};  // the current job's number
  std::atomic<int> sleeping_{0}, active_{0};
  std::atomic<int64_t> n_{0}, chunk_{1}, done_{0};
  std::atomic<const void*> f_{nullptr};
  std::atomic<Call> call_{nullptr};
  pid_t owner_ = 0;
  int started_ = 0;
};
