// The hot path's small locks (include/ccalloc/base/detail/spin_mutex.hpp):
// mutual exclusion under contention, try_lock, and nap_lock's waiters
// behind a long holder (they sleep in naps and still get the lock once it
// is released). In the concurrent tests' program (ThreadSanitizer stage).
#include <ccalloc/base/detail/spin_mutex.hpp>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace {

using ccalloc::detail::nap_lock;
using ccalloc::detail::spin_mutex;
using ccalloc::detail::yield_lock;

// `threads` threads each add 1 to a plain counter `per_thread` times under
// the lock, and check that nobody else is inside while they are: the counter
// is exact and the occupancy never above 1.
template <class Lock>
void check_exclusion(int threads, int per_thread) {
  Lock lock;
  std::int64_t counter = 0;  // plain: the lock is its only protection
  std::atomic<int> inside{0};
  std::atomic<int> max_inside{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&] {
      for (int i = 0; i < per_thread; ++i) {
        std::lock_guard guard(lock);
        const int now = inside.fetch_add(1, std::memory_order_relaxed) + 1;
        int seen = max_inside.load(std::memory_order_relaxed);
        while (now > seen && !max_inside.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
        }
        ++counter;
        inside.fetch_sub(1, std::memory_order_relaxed);
      }
    });
  for (auto& th : pool) th.join();
  EXPECT_EQ(counter, std::int64_t{threads} * per_thread);
  EXPECT_EQ(max_inside.load(), 1);
}

TEST(LocksTest, EachLockExcludesUnderContention) {
  check_exclusion<spin_mutex>(8, 20000);
  check_exclusion<yield_lock>(8, 20000);
  check_exclusion<nap_lock>(8, 20000);
}

TEST(LocksTest, NapLockTryLockFailsWhileHeldAndSucceedsAfter) {
  nap_lock lock;
  ASSERT_TRUE(lock.try_lock());
  std::atomic<bool> other_got_it{true};
  std::thread([&] { other_got_it = lock.try_lock(); }).join();
  EXPECT_FALSE(other_got_it.load());
  lock.unlock();
  std::thread([&] {
    other_got_it = lock.try_lock();
    if (other_got_it) lock.unlock();
  }).join();
  EXPECT_TRUE(other_got_it.load());
}

// A holder keeps the lock for 30 ms (a slow device call under the world
// lock): the waiters pass from spinning and yielding to naps, nobody wakes
// them, and each still takes the lock after the release, one at a time.
TEST(LocksTest, NapLockWaitersBehindALongHolderGetItAfterTheRelease) {
  nap_lock lock;
  lock.lock();
  std::atomic<int> acquired{0};
  std::atomic<bool> released{false};
  std::atomic<bool> early{false};  // a waiter got in before the release
  std::vector<std::thread> waiters;
  for (int t = 0; t < 3; ++t)
    waiters.emplace_back([&] {
      lock.lock();
      if (!released.load()) early = true;
      acquired.fetch_add(1);
      lock.unlock();
    });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_EQ(acquired.load(), 0);
  released = true;
  const auto release_time = std::chrono::steady_clock::now();
  lock.unlock();
  for (auto& th : waiters) th.join();
  const auto waited = std::chrono::steady_clock::now() - release_time;
  EXPECT_EQ(acquired.load(), 3);
  EXPECT_FALSE(early.load());
  // Each waiter looks again at least every nap: three of them are through
  // well within a second even on a loaded machine.
  EXPECT_LT(waited, std::chrono::seconds(1));
}

}  // namespace
