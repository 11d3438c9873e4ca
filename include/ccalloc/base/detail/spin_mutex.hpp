// ccalloc/base/detail/spin_mutex.hpp: small mutexes for short critical
// sections (the allocator's hot path): spin_mutex; yield_lock for sections
// that never wait; nap_lock for the streams' locks. Not part of the public
// API.
//
// Uncontended lock + unlock is one compare-exchange and one exchange, inlined
// (std::mutex goes through pthread_mutex_lock's type dispatch). Under
// contention it spins briefly, then sleeps in the kernel (C++20 atomic wait,
// a futex on Linux), so a thread holding it across a slow device call does
// not burn other cores. States: 0 unlocked, 1 locked, 2 locked with sleepers.
// Meets the Lockable requirements (std::lock_guard, std::unique_lock).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CCALLOC_CPU_RELAX() _mm_pause()
#else
#define CCALLOC_CPU_RELAX() ((void)0)
#endif

namespace ccalloc::detail {

// Nonzero while this thread runs mapping listeners (mapping_notifier::
// announce), which it does holding every lock of the announcing device. A
// listener must not call into the allocator (ccalloc/core/mapping_events.hpp):
// the entry points that take a device's world lock throw when it does
// (world_lock); a lock below that is found taken by this very thread, so
// the slow path of these locks, never their uncontended path, stops the
// process with a message instead of waiting forever.
inline thread_local int tls_mapping_listener_depth = 0;

/// While a callback counted in tls_mapping_listener_depth other than a
/// mapping listener runs on this thread (the C API's history `release` and
/// `frames` functions): its name, set on entering it (base/detail/
/// locked_callback.hpp); null otherwise. Read only where a call is refused.
inline thread_local const char* tls_locked_callback = nullptr;

// Stops the process: the thread, in a callback that runs holding the
// allocator's locks, asked for one of them. The message names the callback
// (tls_locked_callback) or, when none is named, a mapping listener.
[[noreturn, gnu::cold]] inline void mapping_listener_reentered() noexcept {
  if (tls_locked_callback != nullptr) {
    std::fputs("ccalloc: ", stderr);
    std::fputs(tls_locked_callback, stderr);
    std::fputs(
        " called into the allocator, whose locks the calling thread may hold (ccalloc/ccalloc.h: "
        "ccalloc_history_options_t: it must not call into any ccalloc allocator); aborting instead of "
        "deadlocking\n",
        stderr);
    std::abort();
  }
  std::fputs(
      "ccalloc: a mapping listener called into the allocator, whose locks the announcing thread holds "
      "(ccalloc/core/mapping_events.hpp: a listener must not call into any ccalloc allocator); "
      "aborting instead of deadlocking\n",
      stderr);
  std::abort();
}

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
    if (tls_mapping_listener_depth != 0) mapping_listener_reentered();
    // Mark "sleepers" and sleep until an unlock; whoever gets it keeps state 2
    // so that its unlock wakes the next sleeper.
    while (state_.exchange(2, std::memory_order_acquire) != 0) state_.wait(2, std::memory_order_relaxed);
  }

  std::atomic<std::uint32_t> state_{0};
};

// A test-and-set lock whose release is a plain store: one atomic
// read-modify-write per uncontended lock + unlock (spin_mutex takes two: its
// release must see whether anyone sleeps). Waiters spin briefly, then yield
// the processor; nobody sleeps in the kernel, so only for critical sections
// that never wait for anything (the pointer map's shards, a thread cache's
// record). Meets the Lockable requirements.
class yield_lock {
 public:
  void lock() noexcept {
    if (!locked_.exchange(true, std::memory_order_acquire)) [[likely]]
      return;
    lock_slow();
  }
  void unlock() noexcept { locked_.store(false, std::memory_order_release); }

 private:
  void lock_slow() noexcept {
    for (int i = 0;; ++i) {
      if (!locked_.load(std::memory_order_relaxed) && !locked_.exchange(true, std::memory_order_acquire)) return;
      if (i < 64) CCALLOC_CPU_RELAX();
      else std::this_thread::yield();
    }
  }

  std::atomic<bool> locked_{false};
};

// A test-and-set lock whose release is a plain store, like yield_lock, for
// sections that are short on the hot path but may be held across a slow
// device call (a stream's lock: the slow path holds every stream's lock
// while it maps pages or calls the device's malloc). Uncontended lock +
// unlock is one atomic exchange and one store. Waiters spin briefly, yield
// the processor a while, then sleep in naps of nap_microseconds and look
// again: nobody wakes them (the release does not look for sleepers), so a
// waiter behind a long holder takes the lock at most one nap after it is
// released, and a waiter does not burn a core for the whole of a device
// call. Meets the Lockable requirements.
class nap_lock {
 public:
  static constexpr int spins = 64;
  static constexpr int yields = 256;
  static constexpr int nap_microseconds = 50;

  void lock() noexcept {
    if (!locked_.exchange(true, std::memory_order_acquire)) [[likely]]
      return;
    lock_slow();
  }
  bool try_lock() noexcept {
    return !locked_.load(std::memory_order_relaxed) && !locked_.exchange(true, std::memory_order_acquire);
  }
  void unlock() noexcept { locked_.store(false, std::memory_order_release); }

 private:
  [[gnu::noinline]] void lock_slow() noexcept {
    for (int i = 0;; ++i) {
      if (try_lock()) return;
      if (i == spins && tls_mapping_listener_depth != 0) mapping_listener_reentered();
      if (i < spins) CCALLOC_CPU_RELAX();
      else if (i < spins + yields) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(nap_microseconds));
    }
  }

  std::atomic<bool> locked_{false};
};

}  // namespace ccalloc::detail
