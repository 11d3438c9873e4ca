// ccalloc/base/detail/spin_mutex.hpp: a small mutex for short critical
// sections (the allocator's hot path). Not part of the public API.
//
// Uncontended lock + unlock is one compare-exchange and one exchange, inlined
// (std::mutex goes through pthread_mutex_lock's type dispatch). Under
// contention it spins briefly, then sleeps in the kernel (C++20 atomic wait,
// a futex on Linux), so a thread holding it across a slow device call does
// not burn other cores. States: 0 unlocked, 1 locked, 2 locked with sleepers.
// Meets the Lockable requirements (std::lock_guard, std::unique_lock).
#pragma once

#include <atomic>
#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CCALLOC_CPU_RELAX() _mm_pause()
#else
#define CCALLOC_CPU_RELAX() ((void)0)
#endif

namespace ccalloc::detail {

class spin_mutex {
 public:
  void lock() noexcept {
    std::uint32_t expected = 0;
    if (state_.compare_exchange_strong(expected, 1, std::memory_order_acquire, std::memory_order_relaxed))
      [[likely]]
      return;
    lock_slow();
  }
  bool try_lock() noexcept {
    std::uint32_t expected = 0;
    return state_.compare_exchange_strong(expected, 1, std::memory_order_acquire, std::memory_order_relaxed);
  }
  void unlock() noexcept {
    if (state_.exchange(0, std::memory_order_release) == 2) [[unlikely]]
      state_.notify_one();
  }

 private:
  void lock_slow() noexcept {
    for (int i = 0; i < 64; ++i) {
      CCALLOC_CPU_RELAX();
      std::uint32_t expected = 0;
      if (state_.load(std::memory_order_relaxed) == 0 &&
          state_.compare_exchange_weak(expected, 1, std::memory_order_acquire, std::memory_order_relaxed))
        return;
    }
    // Mark "sleepers" and sleep until an unlock; whoever gets it keeps state 2
    // so that its unlock wakes the next sleeper.
    while (state_.exchange(2, std::memory_order_acquire) != 0) state_.wait(2, std::memory_order_relaxed);
  }

  std::atomic<std::uint32_t> state_{0};
};

}  // namespace ccalloc::detail
