// The thread cache (src/core/detail/thread_cache.hpp, issue 18): a thread's
// freed blocks are parked and handed back for the same bytes on the same
// stream; statistics stay exact in one thread; empty_cache, the
// out-of-memory ladder, inspection and thread exit see parked memory.
// The cross-thread test with many threads is in concurrency_test.cpp.
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace ccalloc {
namespace {

allocator_config plain_config() {
  allocator_config c;
  c.expandable_segments = false;
  return c;
}

struct fixture {
  std::shared_ptr<sim_backend> sim;
  caching_allocator alloc;
  explicit fixture(bool thread_cache, std::size_t memory_bytes = std::size_t{4} << 30,
                   allocator_config config = plain_config())
      : sim(std::make_shared<sim_backend>(sim_options{1, memory_bytes, 2 * mib})), alloc(sim, std::move(config)) {
    alloc.init(1);
    alloc.device_allocator(0).set_thread_cache_enabled(thread_cache);
  }
};

// The cache serves the most recently freed block of the same size and
// stream; the pools (cache off) serve the best fit (lowest address).
TEST(ThreadCacheTest, HandsBackTheMostRecentlyFreedBlock) {
  for (bool on : {true, false}) {
    fixture f(on);
    EXPECT_EQ(f.alloc.device_allocator(0).thread_cache_enabled(), on);
    const stream_t s = f.sim->create_stream(0);
    void* a = f.alloc.malloc(0, 512, s);
    void* b = f.alloc.malloc(0, 512, s);
    ASSERT_LT(a, b);
    f.alloc.free(a);
    f.alloc.free(b);
    void* c = f.alloc.malloc(0, 512, s);
    EXPECT_EQ(c, on ? b : a) << "thread cache " << on;
    // Another stream never gets a block parked for the first one.
    const stream_t s2 = f.sim->create_stream(0);
    void* d = f.alloc.malloc(0, 512, s2);
    EXPECT_NE(d, a);
    EXPECT_NE(d, b);
    f.alloc.free(c);
    f.alloc.free(d);
    f.alloc.device_allocator(0).check_invariants();
  }
}

// CCALLOC_THREAD_CACHE=small (read when a device is created): small-pool
// blocks are parked, large ones go back to the pools.
TEST(ThreadCacheTest, SmallModeParksOnlySmallPoolBlocks) {
  ::setenv("CCALLOC_THREAD_CACHE", "small", 1);
  fixture f(true);
  ::unsetenv("CCALLOC_THREAD_CACHE");
  const stream_t s = f.sim->create_stream(0);
  for (const std::size_t size : {std::size_t{512}, 4 * mib}) {
    void* a = f.alloc.malloc(0, size, s);
    void* b = f.alloc.malloc(0, size, s);
    ASSERT_LT(a, b);
    f.alloc.free(a);
    f.alloc.free(b);
    void* c = f.alloc.malloc(0, size, s);
    EXPECT_EQ(c, size == 512 ? b : a) << size << " bytes";  // large: the pool's best fit
    f.alloc.free(c);
  }
  fixture g(true);  // unset again: every block
  void* a = g.alloc.malloc(0, 4 * mib, 0);
  void* b = g.alloc.malloc(0, 4 * mib, 0);
  g.alloc.free(a);
  g.alloc.free(b);
  void* c = g.alloc.malloc(0, 4 * mib, 0);
  EXPECT_EQ(c, b);
  g.alloc.free(c);
}

// One thread, random mallocs and frees on two streams (sizes whose rounding
// is exact, so the layout does not enter the figures): every statistic of
// allocations (current, peak, allocated, freed) equals the cache-off run.
TEST(ThreadCacheTest, StatisticsAreExactInOneThread) {
  auto run = [](bool on) {
    fixture f(on);
    const stream_t streams[2] = {f.sim->create_stream(0), f.sim->create_stream(0)};
    std::mt19937_64 rng(7);
    std::vector<void*> live;
    std::vector<device_stats> reads;
    for (int i = 0; i < 4000; ++i) {
      if (live.empty() || rng() % 2 == 0) {
        const std::size_t size = std::size_t{512} << (rng() % 6);  // 512 B .. 16 KiB
        live.push_back(f.alloc.malloc(0, size, streams[rng() % 2]));
      } else {
        const std::size_t k = rng() % live.size();
        f.alloc.free(live[k]);
        live[k] = live.back();
        live.pop_back();
      }
      if (i % 997 == 0) reads.push_back(f.alloc.get_device_stats(0));
    }
    for (void* p : live) f.alloc.free(p);
    reads.push_back(f.alloc.get_device_stats(0));
    return reads;
  };
  const auto on = run(true);
  const auto off = run(false);
  ASSERT_EQ(on.size(), off.size());
  auto same = [](const stat& x, const stat& y) {
    return x.current == y.current && x.peak == y.peak && x.allocated == y.allocated && x.freed == y.freed;
  };
  for (std::size_t r = 0; r < on.size(); ++r) {
    for (auto field : {&device_stats::allocation, &device_stats::allocated_bytes, &device_stats::active,
                       &device_stats::active_bytes, &device_stats::requested_bytes}) {
      for (std::size_t g = 0; g < stat_group_count; ++g) {
        const stat& x = (on[r].*field)[g];
        const stat& y = (off[r].*field)[g];
        EXPECT_TRUE(same(x, y)) << "read " << r << " group " << g << ": current " << x.current << "/" << y.current
                                << " peak " << x.peak << "/" << y.peak << " allocated " << x.allocated << "/"
                                << y.allocated << " freed " << x.freed << "/" << y.freed;
      }
    }
  }
  EXPECT_EQ(on.back().allocation[0].current, 0);
  EXPECT_GT(on.back().allocation[0].allocated, 1000);
}

// A parked block is free for everyone who looks: statistics, segments,
// invariants; empty_cache returns its segment.
TEST(ThreadCacheTest, ParkedBlocksAreFreeForReadersAndEmptyCache) {
  fixture f(true);
  const stream_t s = f.sim->create_stream(0);
  void* p = f.alloc.malloc(0, 4 * mib, s);
  f.alloc.free(p);  // parked
  const device_stats st = f.alloc.get_device_stats(0);
  EXPECT_EQ(st.allocated_bytes[0].current, 0);
  EXPECT_EQ(st.active_bytes[0].current, 0);
  EXPECT_EQ(st.requested_bytes[0].current, 0);
  EXPECT_EQ(st.allocation[0].freed, 1);
  EXPECT_EQ(st.reserved_bytes[0].current, static_cast<std::int64_t>(20 * mib));  // a large segment
  for (const segment_info& seg : f.alloc.device_allocator(0).segments())
    for (const block_info& b : seg.blocks) EXPECT_EQ(b.state, block_state::inactive);
  f.alloc.device_allocator(0).check_invariants();
  f.alloc.free(f.alloc.malloc(0, 4 * mib, s));  // parked again
  f.alloc.empty_cache();
  EXPECT_EQ(f.alloc.get_device_stats(0).reserved_bytes[0].current, 0);
  EXPECT_EQ(f.sim->counters().used_bytes, 0u);
}

// Memory parked by another (live, idle) thread is found by the
// out-of-memory ladder: the allocation succeeds instead of failing.
TEST(ThreadCacheTest, OutOfMemoryLadderTakesBlocksParkedByOtherThreads) {
  fixture f(true, 64 * mib);
  const stream_t s = f.sim->create_stream(0);
  std::atomic<int> phase{0};
  std::thread parker([&] {
    f.alloc.free(f.alloc.malloc(0, 40 * mib, s));  // parked in this thread's cache
    phase.store(1);
    while (phase.load() != 2) std::this_thread::yield();  // stays alive meanwhile
  });
  while (phase.load() != 1) std::this_thread::yield();
  void* big = nullptr;
  EXPECT_NO_THROW(big = f.alloc.malloc(0, 48 * mib, s));  // needs the 40 MiB segment released
  EXPECT_NE(big, nullptr);
  phase.store(2);
  parker.join();
  f.alloc.free(big);
  f.alloc.device_allocator(0).check_invariants();
}

// A thread that exits leaves its parked blocks to the device: they are free
// at the next read and returned by empty_cache.
TEST(ThreadCacheTest, ThreadExitReturnsParkedBlocks) {
  fixture f(true);
  const stream_t s = f.sim->create_stream(0);
  std::thread t([&] {
    for (int i = 0; i < 10; ++i) f.alloc.free(f.alloc.malloc(0, 8 * mib, s));
    f.alloc.free(f.alloc.malloc(0, 512, s));
  });
  t.join();
  const device_stats st = f.alloc.get_device_stats(0);
  EXPECT_EQ(st.allocated_bytes[0].current, 0);
  EXPECT_EQ(st.allocation[0].allocated, 11);
  EXPECT_EQ(st.allocation[0].freed, 11);
  f.alloc.device_allocator(0).check_invariants();
  f.alloc.empty_cache();
  EXPECT_EQ(f.alloc.get_device_stats(0).reserved_bytes[0].current, 0);
  EXPECT_EQ(f.sim->counters().used_bytes, 0u);
}

// A thread-local object destroyed after the thread cache's own records (at
// thread exit) may still free: the free takes the normal path.
struct late_free {
  caching_allocator* alloc = nullptr;
  void* ptr = nullptr;
  ~late_free() {
    if (ptr != nullptr) alloc->free(ptr);
  }
};
thread_local late_free tls_late_free;

TEST(ThreadCacheTest, FreeFromALateThreadLocalDestructor) {
  fixture f(true);
  const stream_t s = f.sim->create_stream(0);
  std::thread t([&] {
    tls_late_free.alloc = &f.alloc;  // constructed before the cache's records: destroyed after them
    tls_late_free.ptr = f.alloc.malloc(0, 512, s);
    f.alloc.free(f.alloc.malloc(0, 4096, s));  // parked
  });
  t.join();
  const device_stats st = f.alloc.get_device_stats(0);
  EXPECT_EQ(st.allocation[0].current, 0);
  EXPECT_EQ(st.allocation[0].freed, 2);
  f.alloc.device_allocator(0).check_invariants();
}

// record_stream'd blocks and no-caching mode bypass the cache: the block
// waits for its stream's event, and in no-caching mode goes to the device.
TEST(ThreadCacheTest, RecordStreamAndNoCachingBypassTheCache) {
  fixture f(true);
  const stream_t s = f.sim->create_stream(0);
  const stream_t other = f.sim->create_stream(0);
  void* p = f.alloc.malloc(0, 512, s);
  f.alloc.record_stream(p, other);
  f.alloc.free(p);
  EXPECT_EQ(f.alloc.get_device_stats(0).active_bytes[0].current, 512);  // waits on the event
  f.sim->synchronize_device(0);
  f.alloc.enable(false);
  void* q = f.alloc.malloc(0, 4 * mib, s);
  const auto used = f.sim->counters().used_bytes;
  f.alloc.free(q);
  EXPECT_EQ(f.sim->counters().used_bytes, used - 4 * mib);  // back to the device at once
  f.alloc.enable(true);
}

// Opt-in: off unless CCALLOC_THREAD_CACHE asks for it (it changes the layout;
// docs/perf.md), read when a device is created; an unknown value stays off.
TEST(ThreadCacheTest, OffByDefaultAndSwitchedByTheEnvironment) {
  const auto enabled_with = [](const char* value) {
    if (value == nullptr) ::unsetenv("CCALLOC_THREAD_CACHE");
    else ::setenv("CCALLOC_THREAD_CACHE", value, 1);
    auto sim = std::make_shared<sim_backend>(sim_options{1, std::size_t{1} << 30, 2 * mib});
    caching_allocator alloc(sim, plain_config());
    alloc.init(1);
    return alloc.device_allocator(0).thread_cache_enabled();
  };
  EXPECT_FALSE(enabled_with(nullptr));
  EXPECT_TRUE(enabled_with("1"));
  EXPECT_TRUE(enabled_with("small"));
  EXPECT_FALSE(enabled_with("0"));
  EXPECT_TRUE(enabled_with("all"));
  EXPECT_TRUE(enabled_with("True"));
  EXPECT_FALSE(enabled_with("off"));
  EXPECT_FALSE(enabled_with(""));
  EXPECT_TRUE(enabled_with(" all "));  // blanks dropped, as the key's values are
  EXPECT_EQ(allocator_config::parse("thread_cache: all").thread_cache, thread_cache_mode::all);
  // One parser for the variable and the key (breaker finding): what the key
  // rejects, the variable does not take either; a warning names the value.
  for (const char* value : {"sometimes", "on", "yes", "ALL"}) {
    ::testing::internal::CaptureStderr();
    EXPECT_FALSE(enabled_with(value)) << value;
    const std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_NE(err.find(std::string("ccalloc: warning: CCALLOC_THREAD_CACHE='") + value + "'"), std::string::npos)
        << err;
    EXPECT_THROW((void)allocator_config::parse(std::string("thread_cache:") + value), config_error)
        << value;
  }
  for (const char* value : {"off", "small", "all", "True", "true", "1", "False", "false", "0"})
    EXPECT_EQ(allocator_config::parse(std::string("thread_cache:") + value).thread_cache,
              *parse_thread_cache_mode(value))
        << value;
  ::unsetenv("CCALLOC_THREAD_CACHE");
}

// The thread_cache key of the settings table (CCALLOC_CONF, set_config, the
// CLI's --config, the C API, Python): off, small or all; given, it wins over
// CCALLOC_THREAD_CACHE; not given, the variable decides at device creation.
TEST(ThreadCacheTest, ConfigKeySwitchesItAndWinsOverTheEnvironment) {
  const auto make = [](const std::string& text) {
    allocator_config c = allocator_config::parse(text);
    auto sim = std::make_shared<sim_backend>(sim_options{1, std::size_t{1} << 30, 2 * mib});
    auto alloc = std::make_unique<caching_allocator>(sim, c);
    alloc->init(1);
    return std::pair{sim, std::move(alloc)};
  };
  // Whether a freed block of `size` bytes is handed back by the thread cache
  // (the most recently freed) rather than the pools (the lowest address).
  const auto parks = [](caching_allocator& alloc, std::size_t size) {
    void* a = alloc.malloc(0, size, 0);
    void* b = alloc.malloc(0, size, 0);
    alloc.free(a);
    alloc.free(b);
    void* c = alloc.malloc(0, size, 0);
    const bool parked = c == b && a < b;
    alloc.free(c);
    alloc.empty_cache();
    return parked;
  };
  ::unsetenv("CCALLOC_THREAD_CACHE");
  {
    auto [sim, alloc] = make("expandable_segments:False,thread_cache:all");
    EXPECT_TRUE(alloc->device_allocator(0).thread_cache_enabled());
    EXPECT_TRUE(parks(*alloc, 512));
    EXPECT_TRUE(parks(*alloc, 4 * mib));
    // set_config with a new value of the key switches it at once.
    alloc->set_config("thread_cache:small");
    EXPECT_TRUE(alloc->device_allocator(0).thread_cache_enabled());
    EXPECT_TRUE(parks(*alloc, 512));
    EXPECT_FALSE(parks(*alloc, 4 * mib));
    // A configuration that keeps the key leaves set_thread_cache_enabled in force.
    alloc->device_allocator(0).set_thread_cache_enabled(false);
    alloc->set_config("reuse_across_streams:False");
    EXPECT_FALSE(alloc->device_allocator(0).thread_cache_enabled());
    alloc->set_config("thread_cache:all");
    EXPECT_TRUE(alloc->device_allocator(0).thread_cache_enabled());
    alloc->set_config("thread_cache:off");
    EXPECT_FALSE(alloc->device_allocator(0).thread_cache_enabled());
    EXPECT_FALSE(parks(*alloc, 512));
    alloc->device_allocator(0).check_invariants();
  }
  ::setenv("CCALLOC_THREAD_CACHE", "1", 1);
  {
    auto [sim, alloc] = make("expandable_segments:False,thread_cache:off");  // the key wins
    EXPECT_FALSE(alloc->device_allocator(0).thread_cache_enabled());
  }
  {
    auto [sim, alloc] = make("expandable_segments:False,thread_cache:small");
    EXPECT_TRUE(alloc->device_allocator(0).thread_cache_enabled());
    EXPECT_FALSE(parks(*alloc, 4 * mib)) << "small from the key, not all from the variable";
  }
  {
    auto [sim, alloc] = make("expandable_segments:False");  // no key: the variable decides
    EXPECT_TRUE(alloc->device_allocator(0).thread_cache_enabled());
  }
  ::unsetenv("CCALLOC_THREAD_CACHE");
  {
    auto [sim, alloc] = make("expandable_segments:False");
    EXPECT_FALSE(alloc->device_allocator(0).thread_cache_enabled());
  }
}

}  // namespace
}  // namespace ccalloc

