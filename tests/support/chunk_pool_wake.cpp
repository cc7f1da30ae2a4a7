// ChunkPool (src/mashbox/engine/chunk_pool.h) on its own, as whichever C++ standard the
// compiler is given: each job comes after the helpers fell asleep, so it must wake them
// (the caller would finish a job alone, only slower: so count the rounds helpers joined;
// a quarter, as a loaded machine wakes them late, and a pool that never woke them joins 1).
#include <cstdio>
#include <thread>
#include <vector>

#include "chunk_pool.h"

int main() {
  ChunkPool& pool = ChunkPool::get();
  const auto caller = std::this_thread::get_id();
  std::vector<std::atomic<int>> hits(4000);
  const int rounds = 40;
  int joined = 0;
  for (int round = 0; round < rounds; ++round) {
    std::atomic<bool> helped{false};
    pool.run(static_cast<int64_t>(hits.size()), 4, 3, [&](int64_t i) {
      volatile uint64_t spin = 0;  // ~1 us an index: a job of a few ms
      for (int k = 0; k < 1000; ++k) spin = spin + k;
      hits[i].fetch_add(1);
      if (std::this_thread::get_id() != caller) helped.store(true);
    });
    joined += helped.load();
    pool.rest();  // helpers sleep at once ...
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // ... and are asleep by now
  }
  for (auto& h : hits)
    if (h.load() != rounds) return std::printf("an index was computed %d times\n", h.load()), 1;
  if (joined < rounds / 4) return std::printf("helpers joined %d of %d jobs\n", joined, rounds), 1;
#ifdef MASHBOX_FUTEX
  std::printf("ok: futex, helpers joined %d of %d jobs\n", joined, rounds);
#else
  std::printf("ok: std::atomic wait, helpers joined %d of %d jobs\n", joined, rounds);
#endif
  return 0;
}
