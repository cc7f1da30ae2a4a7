// Helper threads for the kernels' parallel loops, whose caller returns as soon as every chunk
// is done. torch's parallel_for (OpenMP) ends each region at a barrier that waits for every
// thread of its team, and on two cores the server takes a core from the engine after every
// step: a decode step's ~150 regions then each wait, up to a scheduler tick, for a thread
// that has no work left. Here each thread starts on a share of its own and, done with it,
// takes what is left of the others': a helper that lost its core holds at most the chunk it
// was computing, and the others finish its share. Which thread computes a chunk never
// changes its bits.
#pragma once

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>
#include <utility>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
// std::atomic's wait and notify are C++20 (libstdc++ 11 on), and torch's extension builder
// asks for C++17 before torch 2.12: there the helpers sleep on a futex of their own.
#if !defined(__cpp_lib_atomic_wait) || defined(MASHBOX_FUTEX)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#define MASHBOX_FUTEX 1
#endif

class ChunkPool {
 public:
  // The process's pool (leaked on purpose: helpers may still be asleep when it exits).
  static ChunkPool& get() {
    static ChunkPool* pool = new ChunkPool;
    return *pool;
  }

  // The bytes the job after the next run() will read: unit u of that job reads
  // unit_bytes[s] from base[s] + u * unit_bytes[s] in each stream s (a matrix's weights and
  // its scales), and thread i takes units [units * i / threads, units * (i + 1) / threads)
  // first, as run() shares them. A thread with nothing left of the next run()'s job asks for
  // its share of these into its L2 while it waits: a decode step's memory otherwise idles
  // through its matmuls' tails and the serial work between them.
  struct Ahead {
    const char* base[2] = {nullptr, nullptr};
    int64_t unit_bytes[2] = {0, 0};
    int64_t units = 0;
  };
  void ahead(const Ahead& next) { pending() = next; }  // for the calling thread's next run()

  // No job comes for a while (a decode step's last call is done): helpers sleep as soon as
  // they have asked for the next job's bytes, not after spinning. A process woken by the
  // step's result (the server, by a socket's "sync" wake-up) is put on the waker's core
  // unless another one is idle: with a helper spinning there, the server took the engine's
  // calling thread's core for its whole turn, ~0.3 ms, in 5 of 19 windows of 256 steps
  // (the result's send() took ~350 us instead of ~50; stop 40).
  void rest() { rest_.store(true, std::memory_order_relaxed); }

  // f(i) for every i in [0, n), `chunk` indices at a time, on the caller and up to `helpers`
  // helper threads. Runs on the caller alone where there is nothing to share, or where
  // another thread is using the pool.
  template <typename F>
  void run(int64_t n, int64_t chunk, int helpers, const F& f) {
    if ((n + chunk - 1) / chunk >= LIMIT) chunk = (n + LIMIT - 2) / (LIMIT - 1);  // 16 bits
    const int64_t units = (n + chunk - 1) / chunk;
    helpers = static_cast<int>(std::min<int64_t>({helpers, MAX_THREADS - 1, units - 1}));
    const Ahead next = std::exchange(pending(), Ahead{});
    if (helpers <= 0 || !busy_.try_lock()) {
      for (int64_t i = 0; i < n; ++i) f(i);
      return;
    }
    start_helpers(helpers);
    f_.store(&f, std::memory_order_relaxed);
    call_.store(&call<F>, std::memory_order_relaxed);
    n_.store(n, std::memory_order_relaxed);
    chunk_.store(chunk, std::memory_order_relaxed);
    threads_.store(helpers + 1, std::memory_order_relaxed);
    for (int s = 0; s < 2; ++s) {
      job_ahead_.base[s].store(next.base[s], std::memory_order_relaxed);
      job_ahead_.unit_bytes[s].store(next.unit_bytes[s], std::memory_order_relaxed);
    }
    job_ahead_.units.store(next.units, std::memory_order_relaxed);
    const uint32_t job = generation_.load(std::memory_order_relaxed) + 1;
    // Thread i's own share: units [units * i / threads, units * (i + 1) / threads).
    for (int i = 0; i <= helpers; ++i) {
      shares_[i].done.store(0, std::memory_order_relaxed);
      shares_[i].word.store(pack(job, units * i / (helpers + 1), units * (i + 1) / (helpers + 1)),
                            std::memory_order_release);
    }
    rest_.store(false, std::memory_order_relaxed);
    generation_.store(job);  // seq_cst, against a helper's going to sleep (helper())
    if (sleeping_.load() > 0) wake_all(generation_);
    work(job, 0);
    for (Prefetch p(next, 0, helpers + 1, shares_[0]); done(helpers + 1) < units;)
      if (!p.step()) pause();  // only chunks in flight
    busy_.unlock();
  }

 private:
  using Call = void (*)(const void*, int64_t, int64_t);
  template <typename F>
  static void call(const void* f, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) (*static_cast<const F*>(f))(i);
  }

  // A thread's share of a job: the job's number, then the first and the end of the units
  // left. Its owner takes them from the front, in order (one stream of weights for the
  // prefetcher); a thread done with its own share takes others' from the back. Each claim is
  // a compare-and-swap on the share's own cache line, so while both threads have work no
  // line moves between cores: one shared counter for every claim (and one for every chunk
  // done) cost ~0.2-0.4 us a chunk in transfers, ~4 us a call of SmolLM2's matmuls.
  static uint64_t pack(uint32_t job, int64_t first, int64_t end) {
    return uint64_t{job} << 32 | static_cast<uint64_t>(first) << 16 | static_cast<uint64_t>(end);
  }
  // Claims a unit of `job` from share i's front (or back), or returns -1: none left, or the
  // share is another job's. A chunk is claimed only while its job is the current one: a job's
  // fields are rewritten only after all its chunks are done, and this one is not yet.
  int64_t claim(int i, uint32_t job, bool front) {
    std::atomic<uint64_t>& word = shares_[i].word;
    uint64_t w = word.load(std::memory_order_acquire);
    for (;;) {
      const int64_t first = (w >> 16) & 0xffff, end = w & 0xffff;
      if ((w >> 32) != job || first >= end) return -1;
      const uint64_t next = front ? w + (uint64_t{1} << 16) : w - 1;
      if (word.compare_exchange_weak(w, next, std::memory_order_acq_rel,
                                     std::memory_order_acquire))
        return front ? first : end - 1;
    }
  }

  // Runs units of `job`: share `self`'s first, then the others'. Each is counted done on
  // `self`'s own line as it ends, so the caller never waits for a helper that holds none.
  void work(uint32_t job, int self) {
    const int threads = threads_.load(std::memory_order_relaxed);
    int64_t ran = 0;
    for (int k = 0; k < threads; ++k) {
      const int i = (self + k) % threads;
      for (int64_t u; (u = claim(i, job, k == 0)) >= 0; ++ran) {
        const int64_t n = n_.load(std::memory_order_relaxed);
        const int64_t chunk = chunk_.load(std::memory_order_relaxed);
        call_.load(std::memory_order_relaxed)(f_.load(std::memory_order_relaxed), u * chunk,
                                              std::min(n, (u + 1) * chunk));
        shares_[self].done.store(ran + 1, std::memory_order_release);
      }
    }
  }

  int64_t done(int threads) const {
    int64_t sum = 0;
    for (int i = 0; i < threads; ++i) sum += shares_[i].done.load(std::memory_order_acquire);
    return sum;
  }

  // Sleep while `word` holds `seen` (spurious wake-ups allowed); wake every sleeper.
  static void sleep_while(std::atomic<uint32_t>& word, uint32_t seen) {
#ifdef MASHBOX_FUTEX
    static_assert(sizeof(word) == sizeof(uint32_t), "a futex is one 32-bit word");
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, seen, nullptr,
            nullptr, 0);
#else
    word.wait(seen);
#endif
  }
  static void wake_all(std::atomic<uint32_t>& word) {
#ifdef MASHBOX_FUTEX
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
            nullptr, 0);
#else
    word.notify_all();
#endif
  }

  // Helpers are detached: a forked child has none of them, and starts its own (told so by
  // pthread_atfork: getpid() at every call was a system call, ~60 ns hot, 151 times a step).
  ChunkPool() { pthread_atfork(nullptr, nullptr, [] { get().started_ = 0; }); }
  void start_helpers(int helpers) {
    for (; started_ < helpers; ++started_)
      std::thread([this, index = started_] { helper(index); }).detach();
  }

  // Wait for a job: spinning for a while (a decode step's jobs come microseconds apart),
  // then asleep, so that between steps the core is the server's (at once after rest()).
  void helper(int index) {
    uint32_t seen = generation_.load();
    Ahead next;
    int threads = 1;
    for (;;) {
      auto spin_until = std::chrono::steady_clock::now() + SPIN;
      uint32_t job;
      Prefetch p(next, index + 1, threads, shares_[index + 1]);
      for (int spins = 0; (job = generation_.load()) == seen; ++spins) {
        if (p.step()) continue;
        if (spins % 64 || (!rest_.load(std::memory_order_relaxed) &&
                           std::chrono::steady_clock::now() < spin_until)) {
          pause();
          continue;
        }
        sleeping_.fetch_add(1);
        sleep_while(generation_, seen);
        sleeping_.fetch_sub(1);
        spin_until = std::chrono::steady_clock::now() + SPIN;
      }
      seen = job;
      threads = threads_.load(std::memory_order_relaxed);
      next = job_ahead();
      // Read while the caller may be writing the next job's: checked, but a torn read can
      // still slip through. Harmless: a prefetch never faults, and only costs a wasted line.
      if (generation_.load() != job) next = Ahead{};
      if (index + 1 < threads) work(job, index + 1);
    }
  }

  static Ahead& pending() {  // each calling thread's own, for its next run()
    static thread_local Ahead next;
    return next;
  }

  Ahead job_ahead() const {
    Ahead a;
    for (int s = 0; s < 2; ++s) {
      a.base[s] = job_ahead_.base[s].load(std::memory_order_relaxed);
      a.unit_bytes[s] = job_ahead_.unit_bytes[s].load(std::memory_order_relaxed);
    }
    a.units = job_ahead_.units.load(std::memory_order_relaxed);
    return a;
  }

  struct Share {  // a thread's units left and done, each on a cache line of its own
    alignas(64) std::atomic<uint64_t> word{0};
    alignas(64) std::atomic<int64_t> done{0};
    alignas(64) const char* ahead_at = nullptr;  // the owner's own: Prefetch's progress
    int64_t ahead_done = 0;
  };

  // A thread's share of an Ahead, asked for a few lines at a time between its checks for
  // work. Where it got to is kept on the thread's Share: the same bytes named again by the
  // next job (the attention's, before the matrix after it) are not asked for twice.
  class Prefetch {
   public:
    Prefetch(const Ahead& a, int self, int threads, Share& share) : share_(share) {
      if (!a.units || !a.base[0]) return;
      const int64_t first = a.units * self / threads, end = a.units * (self + 1) / threads;
      for (int s = 0; s < 2; ++s) {
        at_[s] = a.base[s] ? a.base[s] + first * a.unit_bytes[s] : nullptr;
        bytes_[s] = a.base[s] ? (end - first) * a.unit_bytes[s] : 0;
      }
      if (share_.ahead_at != at_[0]) share_.ahead_at = at_[0], share_.ahead_done = 0;
      limit_ = std::min<int64_t>(bytes_[0], AHEAD_BYTES);
    }
    // Asks for the next few lines; false once the share (or AHEAD_BYTES of it) is asked for.
    bool step() {
      int64_t& done = share_.ahead_done;
      if (done >= limit_) return false;
      const int64_t stop = std::min<int64_t>(done + AHEAD_STEP, limit_);
      for (int64_t at = done; at < stop; at += 64) touch(at_[0] + at);
      // The scales in proportion: a line of them for every bytes_[0] / bytes_[1] of weights.
      if (bytes_[1]) {
        const int64_t from = done * bytes_[1] / bytes_[0], to = stop * bytes_[1] / bytes_[0];
        for (int64_t at = from & ~int64_t{63}; at < to; at += 64) touch(at_[1] + at);
      }
      done = stop;
      return true;
    }

   private:
    static void touch(const char* p) {
#if defined(__x86_64__)
      _mm_prefetch(p, _MM_HINT_T1);
#else
      __builtin_prefetch(p, 0, 2);
#endif
    }
    Share& share_;
    const char* at_[2] = {nullptr, nullptr};
    int64_t bytes_[2] = {0, 0}, limit_ = 0;
  };

  static void pause() {
#if defined(__x86_64__)
    _mm_pause();
#else
    std::this_thread::yield();
#endif
  }

  static constexpr std::chrono::microseconds SPIN{100};
  // An Ahead's share asked for at most (an L2 holds it beside the current work), a few lines
  // between checks for work.
  static constexpr int64_t AHEAD_BYTES = 512 << 10, AHEAD_STEP = 512;
  static constexpr int MAX_THREADS = 64;
  static constexpr int64_t LIMIT = int64_t{1} << 16;  // units a job: 16 bits in a share
  Share shares_[MAX_THREADS];
  alignas(64) std::mutex busy_;  // one caller at a time
  // The job, on a line no helper polls: written next to `generation_`, which the helpers
  // spin on, each store waited for that line to come back from the spinning core (120 calls
  // of SmolLM2's 576 x 576 Q4_1 matrix took 0.925x the time apart, `kernel_ab.sh`). A call
  // still costs ~0.9 us over its work on the AVX-512 host: the job's number going to the
  // helper and its last unit's `done` coming back, ~140 ns a trip between its two cores.
  alignas(64) std::atomic<int> threads_{0};
  struct {
    std::atomic<const char*> base[2];
    std::atomic<int64_t> unit_bytes[2];
    std::atomic<int64_t> units;
  } job_ahead_{};
  std::atomic<int64_t> n_{0}, chunk_{1};
  std::atomic<const void*> f_{nullptr};
  std::atomic<Call> call_{nullptr};
  alignas(64) std::atomic<uint32_t> generation_{0};  // the current job's number
  std::atomic<int> sleeping_{0};
  std::atomic<bool> rest_{false};  // rest(): on the line the helpers poll, set once a step
  int started_ = 0;
};
