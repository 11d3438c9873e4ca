// fork_test.cpp: fork() while other threads are inside the allocator
// (base/detail/fork_handlers.hpp). Without the fork handlers a child
// inherits whatever lock another thread of the parent held at the fork,
// held by a thread that does not exist in the child, and its first call
// that needs that lock waits for ever. Here threads hammer the process-wide
// allocator and a second one (malloc, free, empty_cache, pause and resume of
// a tag, statistics, history) while the main thread forks repeatedly; each
// child allocates, writes, frees, empties the caches and reads the
// statistics of both allocators, then exits. The parent waits for each
// child with a deadline and kills and fails on a hang. CTest label
// "concurrent": the ThreadSanitizer build runs it too.
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/detail/fork_handlers.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/core/history.hpp>
#include <ccalloc/core/tags.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace ccalloc;
using std::chrono::steady_clock;

constexpr std::size_t mib = std::size_t{1} << 20;

// How a child ended: "exit N", "signal N", or "hung" (killed after the deadline).
std::string wait_with_deadline(pid_t child, std::chrono::milliseconds deadline) {
  const auto end = steady_clock::now() + deadline;
  int status = 0;
  for (;;) {
    const pid_t r = ::waitpid(child, &status, WNOHANG);
    if (r == child) break;
    if (r < 0) return "waitpid failed: " + std::string(std::strerror(errno));
    if (steady_clock::now() > end) {
      ::kill(child, SIGKILL);
      (void)::waitpid(child, &status, 0);
      return "hung";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (WIFEXITED(status)) return "exit " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return "signal " + std::to_string(WTERMSIG(status));
  return "status " + std::to_string(status);
}

// The child's work on one allocator: every step that takes the locks a
// parent's thread may have held (the fast path's stream lock and thread
// cache, the slow path's world lock, the pointer map, statistics, history,
// tags, the backend). Returns 0, or the number of the step that failed.
int child_work(caching_allocator& a, int first_code) {
  try {
    std::vector<void*> ptrs;
    for (std::size_t bytes : {std::size_t{512}, std::size_t{4096}, 3 * mib, 24 * mib, std::size_t{512}}) {
      void* p = a.malloc(0, bytes, 0);
      if (p == nullptr) return first_code;
      // The simulated device's memory is host memory, the child's own copy.
      std::memset(p, 0x5a, 64);
      std::memset(static_cast<char*>(p) + bytes - 64, 0xa5, 64);
      ptrs.push_back(p);
    }
    {
      tag_scope scope("fork_child");
      ptrs.push_back(a.malloc(0, 2 * mib, 0));
    }
    for (void* p : ptrs) a.free(p);
    a.empty_cache();
    const device_stats s = a.get_device_stats(0);
    if (s.num_device_alloc < 1) return first_code + 1;
    void* again = a.malloc(0, 4096, 0);
    a.free(again);
  } catch (const std::exception&) {
    return first_code + 2;
  }
  return 0;
}

// One thread's share of the parent's traffic until `stop`.
// `quiet`: the parent waits for a child (the threads would only take the
// child's processor time on a small machine).
void hammer(caching_allocator& a, unsigned seed, const std::atomic<bool>& stop, const std::atomic<bool>& quiet) {
  std::uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  auto next = [&x] {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return x;
  };
  std::vector<void*> held;
  for (unsigned i = 0; !stop.load(std::memory_order_relaxed); ++i) {
    while (quiet.load(std::memory_order_relaxed) && !stop.load(std::memory_order_relaxed))
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    try {
      const std::uint64_t r = next();
      const std::size_t bytes = (r & 3) == 0 ? (r >> 8) % (8 * mib) + 1 : (r >> 8) % 65536 + 1;
      if ((r & 0x30) == 0) {
        tag_scope scope("fork_hammer");
        held.push_back(a.malloc(0, bytes, 0));
      } else {
        held.push_back(a.malloc(0, bytes, 0));
      }
      if (held.size() > 8 || (r & 0x40) != 0) {
        a.free(held.front());
        held.erase(held.begin());
      }
      if (i % 64 == 0) a.empty_cache();
      if (i % 97 == 0) (void)a.get_device_stats(0);
      if (i % 128 == 0) {
        (void)a.pause({"fork_hammer"}, /*keep_contents=*/false, 0);
        (void)a.resume({"fork_hammer"}, 0);
      }
    } catch (const out_of_memory_error&) {
    } catch (const invalid_argument_error&) {  // a malloc under the tag while it is paused
    }
  }
  for (void* p : held) a.free(p);
}

TEST(ForkWhileThreadsAllocate, EachChildAllocatesFreesAndExits) {
  caching_allocator& process = global_allocator();
  sim_options o;
  o.capacity_bytes = std::size_t{1} << 30;
  caching_allocator second(std::make_shared<sim_backend>(o));
  second.init(1);
  history_options h;
  h.max_entries = 256;
  second.record_history(h);  // the history's lock too
  second.attach_mapping_listener([](const mapping_event&) {});

  const std::uint64_t prepared_before = detail::fork_prepared_count();
  std::atomic<bool> stop{false};
  std::atomic<bool> quiet{false};
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < 4; ++t)
    threads.emplace_back(hammer, std::ref(t % 2 == 0 ? process : second), t + 1, std::cref(stop), std::cref(quiet));

  constexpr int forks = 50;
  std::vector<std::string> failures;
  for (int k = 0; k < forks; ++k) {
    quiet = false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // let the threads get deep into calls
    const pid_t child = ::fork();
    if (child == 0) {
      int code = child_work(process, 10);
      if (code == 0) code = child_work(second, 20);
      ::_exit(code);
    }
    quiet = true;
    ASSERT_GT(child, 0) << std::strerror(errno);
    const std::string how = wait_with_deadline(child, std::chrono::seconds(20));
    if (how != "exit 0") failures.push_back("fork " + std::to_string(k) + ": " + how);
  }
  stop = true;
  for (auto& t : threads) t.join();
  EXPECT_TRUE(failures.empty()) << failures.size() << " of " << forks << " children failed, first: "
                                << failures.front();
  EXPECT_GE(detail::fork_prepared_count() - prepared_before, std::uint64_t{forks});
  second.device_allocator(0).check_invariants();
  process.device_allocator(0).check_invariants();
}

// A fork from a mapping listener, which runs holding its device's locks:
// the handlers take no lock (they would wait for this very thread), the
// fork goes through, and the parent's allocator goes on.
TEST(ForkWhileThreadsAllocate, FromAMappingListenerNeitherProcessWaits) {
  sim_options o;
  o.capacity_bytes = std::size_t{1} << 30;
  caching_allocator a(std::make_shared<sim_backend>(o));
  a.init(1);
  pid_t child = -1;
  a.attach_mapping_listener([&child](const mapping_event&) {
    if (child != -1) return;
    child = ::fork();
    if (child == 0) ::_exit(7);  // the child holds the device's locks as the listener's caller: it only exits
  });
  void* p = a.malloc(0, 3 * mib, 0);  // a new segment: announced
  ASSERT_GT(child, 0);
  EXPECT_EQ(wait_with_deadline(child, std::chrono::seconds(20)), "exit 7");
  a.free(p);
  a.empty_cache();
  EXPECT_EQ(a.get_device_stats(0).reserved_bytes[0].current, 0);
}

}  // namespace
