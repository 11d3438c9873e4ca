// The thread cache (src/core/detail/thread_cache.hpp, issue 18): a thread's
// freed block is parked and handed out again for the same bytes on the same
// stream when its pool has not changed meanwhile (the block the pools would
// hand out: the layout is the same on and off); statistics stay exact in one
// thread; empty_cache, the out-of-memory ladder, inspection and thread exit
// see parked memory.
// The cross-thread test with many threads is in concurrency_test.cpp.
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <functional>
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

std::int64_t hits(caching_allocator& alloc) { return alloc.get_device_stats(0).num_thread_cache_hits; }

// A free followed by a malloc of the same bytes on the same stream, with
// nothing else in between, is served by the cache: the same block, which is
// also what the pools hand out. Anything else goes to the pools, in the
// program's order (the parked block first), so the addresses are the pools'.
TEST(ThreadCacheTest, ServesOnlyWhatThePoolsWouldHandOut) {
  for (bool on : {true, false}) {
    fixture f(on);
    EXPECT_EQ(f.alloc.device_allocator(0).thread_cache_enabled(), on);
    const stream_t s = f.sim->create_stream(0);
    // The pair: the first block comes from the slow path (a new segment),
    // which proves nothing about the pools, so its free goes to the pools;
    // the second is the pools' best fit, parked at its free, and the third
    // malloc is served by the cache when it is on. The same block each time.
    void* p = f.alloc.malloc(0, 512, s);
    f.alloc.free(p);
    EXPECT_EQ(f.alloc.malloc(0, 512, s), p);
    f.alloc.free(p);
    EXPECT_EQ(f.alloc.malloc(0, 512, s), p);
    EXPECT_EQ(hits(f.alloc), on ? 1 : 0) << "thread cache " << on;
    // Two live blocks freed in order: the second free changes the pool after
    // the first block was handed out, so nothing is parked; the pools' best
    // fit (the lowest address) comes next, on or off.
    void* q = f.alloc.malloc(0, 512, s);
    ASSERT_LT(p, q);
    f.alloc.free(p);
    f.alloc.free(q);
    EXPECT_EQ(f.alloc.malloc(0, 512, s), p);
    // Freed in reverse order: q (the last handed out) is parked, then p's
    // free returns q to the pools first; the pools then hand out p again.
    q = f.alloc.malloc(0, 512, s);
    f.alloc.free(q);
    f.alloc.free(p);
    EXPECT_EQ(f.alloc.malloc(0, 512, s), p);
    // Other bytes or another stream: a miss, the parked block goes back first.
    q = f.alloc.malloc(0, 1024, s);
    f.alloc.free(q);
    void* r = f.alloc.malloc(0, 512, s);
    EXPECT_EQ(r, q) << "the freed 1 KiB block is the pools' best fit for 512 B";
    const stream_t s2 = f.sim->create_stream(0);
    f.alloc.free(r);
    void* d = f.alloc.malloc(0, 512, s2);
    EXPECT_NE(d, r);
    EXPECT_EQ(hits(f.alloc), on ? 1 : 0) << "thread cache " << on;
    f.alloc.free(d);
    f.alloc.free(p);
    f.alloc.device_allocator(0).check_invariants();
  }
}

// What each of `runs` returns, each computed in a child process. All
// children are forked before the parent reads anything (reading allocates,
// and a large buffer is a new mapping), so that they start from the same
// host address space and the simulated device's segments (host mappings)
// get the same addresses in each.
std::vector<std::vector<std::uintptr_t>> in_children(
    const std::vector<std::function<std::vector<std::uintptr_t>()>>& runs) {
  std::vector<std::array<int, 2>> pipes(runs.size());
  for (auto& fds : pipes)
    if (::pipe(fds.data()) != 0) return {};
  std::vector<pid_t> pids;
  pids.reserve(runs.size());
  for (std::size_t k = 0; k < runs.size(); ++k) {
    const pid_t pid = ::fork();
    if (pid == 0) {  // keeps only the write end of its own pipe (others' ends would hold off their EOF)
      for (std::size_t j = 0; j < pipes.size(); ++j) {
        ::close(pipes[j][0]);
        if (j != k) ::close(pipes[j][1]);
      }
      const std::vector<std::uintptr_t> out = runs[k]();
      const char* p = reinterpret_cast<const char*>(out.data());
      std::size_t left = out.size() * sizeof(std::uintptr_t);
      while (left > 0) {
        const ssize_t n = ::write(pipes[k][1], p, left);
        if (n <= 0) ::_exit(1);
        p += n;
        left -= static_cast<std::size_t>(n);
      }
      ::_exit(0);
    }
    pids.push_back(pid);
  }
  for (auto& fds : pipes) ::close(fds[1]);  // each child's end of its pipe only
  std::vector<std::vector<std::uintptr_t>> outs(runs.size());
  for (std::size_t k = 0; k < runs.size(); ++k) {
    std::uintptr_t word = 0;
    std::size_t have = 0;
    char buf[4096];
    for (ssize_t n; (n = ::read(pipes[k][0], buf, sizeof buf)) > 0;) {
      for (ssize_t i = 0; i < n; ++i) {
        reinterpret_cast<char*>(&word)[have++] = buf[i];
        if (have == sizeof word) {
          outs[k].push_back(word);
          have = 0;
        }
      }
    }
    ::close(pipes[k][0]);
    int status = 0;
    ::waitpid(pids[k], &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  return outs;
}

// The layout is the same with the cache on and off: one thread, random
// sizes (small, large, expandable and plain segments), three streams,
// live blocks freed in random order, and bursts of pairs of one size (a
// temporary buffer in a loop); every address handed out, the peak reserved
// bytes and the device mallocs agree, and the cache served many pairs.
TEST(ThreadCacheTest, TheLayoutIsTheSameOnAndOff) {
  for (bool expandable : {true, false}) {
    auto run = [expandable](bool on) {
      allocator_config c;
      c.expandable_segments = expandable;
      fixture f(on, std::size_t{8} << 30, c);
      const stream_t streams[3] = {f.sim->create_stream(0), f.sim->create_stream(0), f.sim->create_stream(0)};
      std::mt19937_64 rng(11);
      std::vector<void*> live;
      std::vector<std::uintptr_t> out;
      for (int i = 0; i < 20000; ++i) {
        const std::uint64_t r = rng();
        const std::size_t size = r % 3 == 0 ? 512 + r % 20000 : (std::size_t{1} << (9 + r % 19)) + r % 4096;
        const stream_t s = streams[(r >> 20) % 3];
        if (r % 4 == 0) {  // a burst of pairs
          for (std::uint64_t k = 0; k < 1 + (r >> 40) % 5; ++k) {
            void* t = f.alloc.malloc(0, size, s);
            out.push_back(reinterpret_cast<std::uintptr_t>(t));
            f.alloc.free(t);
          }
        } else if (live.empty() || r % 4 == 1) {
          live.push_back(f.alloc.malloc(0, size, s));
          out.push_back(reinterpret_cast<std::uintptr_t>(live.back()));
        } else {
          const std::size_t k = (r >> 32) % live.size();
          f.alloc.free(live[k]);
          live[k] = live.back();
          live.pop_back();
        }
      }
      for (void* p : live) f.alloc.free(p);
      f.alloc.device_allocator(0).check_invariants();
      const device_stats st = f.alloc.get_device_stats(0);
      out.push_back(static_cast<std::uintptr_t>(st.reserved_bytes[0].peak));
      out.push_back(static_cast<std::uintptr_t>(st.num_device_alloc));
      out.push_back(static_cast<std::uintptr_t>(st.num_thread_cache_hits));
      return out;
    };
    const auto outs = in_children({[&] { return run(true); }, [&] { return run(false); }});
    ASSERT_EQ(outs.size(), 2u);
    const auto& on = outs[0];
    const auto& off = outs[1];
    ASSERT_EQ(on.size(), off.size());
    ASSERT_GT(on.size(), 3u);
    EXPECT_EQ(off.back(), 0u);
    EXPECT_GT(on.back(), 3000u) << "expandable " << expandable;  // hits
    std::size_t first_difference = on.size() - 1;
    for (std::size_t i = 0; i + 1 < on.size() && first_difference == on.size() - 1; ++i)
      if (on[i] != off[i]) first_difference = i;
    EXPECT_EQ(first_difference, on.size() - 1) << "expandable " << expandable;
  }
}

// Page fences (expandable segments) number each stream's frees; the pages
// of a free block pass to another stream only once a fence after its free
// has completed. A cached pair elides a free and a split: the remainder it
// leaves keeps the count of its own last free, where the pools would have
// given it the elided free's (breaker finding). Its pages may then pass to
// another stream sooner than with the cache off, which is safe: the work
// of the reused block never touched them. Here, with the reused block in
// use by later work on its stream, a new peak on another stream recycles
// pages with the cache on and off, and no page is unmapped while work that
// uses it may still run (the simulated device counts such unmaps).
TEST(ThreadCacheTest, PagesNextToAReusedBlockMoveOnlyWhenTheirWorkIsDone) {
  for (bool on : {true, false}) {
    allocator_config c;
    c.expandable_segments = true;
    fixture f(on, std::size_t{1} << 30, c);
    const stream_t s1 = f.sim->create_stream(0);
    const stream_t s2 = f.sim->create_stream(0);
    void* a = f.alloc.malloc(0, 4 * mib, s1);
    void* gap = f.alloc.malloc(0, 4 * mib, s1);
    void* c3 = f.alloc.malloc(0, 4 * mib, s1);
    void* x = f.alloc.malloc(0, 512, s1);
    f.sim->enqueue_work(0, s1, f.sim->now() + 10);
    f.sim->use_memory(0, gap, 4 * mib, s1);  // the run's last use, before its free
    f.alloc.free(gap);  // a free 4 MiB run between two live blocks
    f.alloc.free(x);    // the last busy block of s1's small segment: a fence
    void* b = f.alloc.malloc(0, 2 * mib, s1);  // the pools' best fit: the run's front
    f.alloc.free(b);                           // parked (on), merged into the run (off)
    EXPECT_EQ(f.alloc.malloc(0, 2 * mib, s1), b);  // a hit (on), the same split (off)
    f.sim->enqueue_work(0, s1, f.sim->now() + 1000);
    f.sim->use_memory(0, b, 2 * mib, s1);  // the reused block, in use for a long time
    f.sim->advance_to(f.sim->now() + 20);  // the run's earlier work is done
    void* y = f.alloc.malloc(0, 2 * mib, s2);  // new peaks on other streams: pages recycled
    void* z = f.alloc.malloc(0, 2 * mib, f.sim->create_stream(0));
    const device_stats st = f.alloc.get_device_stats(0);
    EXPECT_EQ(st.num_thread_cache_hits, on ? 1 : 0);
    EXPECT_GE(st.num_pages_remapped, 1) << "thread cache " << on;
    EXPECT_EQ(f.sim->counters().unsafe_unmaps, 0u) << "thread cache " << on;
    EXPECT_EQ(st.num_device_synchronizations, 0);
    for (void* p : {a, c3, b, y, z}) f.alloc.free(p);
    f.alloc.device_allocator(0).check_invariants();
  }
}

// Memory history turned on while a block is parked (record_history takes no
// world lock): the next free, recorded, returns the parked block first, as
// the next malloc does, so the pools see the frees in the program's order
// and the split statistics match the cache-off run (breaker finding: the
// recorded free went first, and inactive_split counted one more split).
TEST(ThreadCacheTest, AFreeWithHistoryReturnsParkedBlocksFirst) {
  auto run = [](bool on) {
    fixture f(on);
    const stream_t s = f.sim->create_stream(0);
    void* x = f.alloc.malloc(0, 4096, s);  // the slow path: a new segment
    void* y = f.alloc.malloc(0, 8192, s);  // the pools' best fit, next to x
    f.alloc.free(y);                       // parked (on)
    history_options h;
    f.alloc.record_history(h);
    f.alloc.free(x);  // recorded: y must be free before it, x merges with both sides
    const device_stats st = f.alloc.get_device_stats(0);
    f.alloc.device_allocator(0).check_invariants();
    return std::vector<std::int64_t>{st.inactive_split[0].current, st.inactive_split[0].allocated,
                                     st.inactive_split[0].freed, st.inactive_split_bytes[0].allocated,
                                     st.inactive_split_bytes[0].freed, st.allocation[0].freed};
  };
  const std::vector<std::int64_t> on = run(true);
  const std::vector<std::int64_t> off = run(false);
  EXPECT_EQ(off[0], 0);  // the segment is whole again
  EXPECT_EQ(off[5], 2);
  for (std::size_t i = 0; i < on.size(); ++i) EXPECT_EQ(on[i], off[i]) << "figure " << i;
}

// CCALLOC_THREAD_CACHE=small (read when a device is created): small-pool
// blocks are parked, large ones go back to the pools.
TEST(ThreadCacheTest, SmallModeParksOnlySmallPoolBlocks) {
  ::setenv("CCALLOC_THREAD_CACHE", "small", 1);
  fixture f(true);
  ::unsetenv("CCALLOC_THREAD_CACHE");
  const stream_t s = f.sim->create_stream(0);
  // Three pairs of one size: the second block is parked, the third malloc a hit.
  const auto pairs = [](caching_allocator& alloc, std::size_t size, stream_t stream) {
    const std::int64_t before = hits(alloc);
    void* a = alloc.malloc(0, size, stream);
    for (int i = 0; i < 3; ++i) {
      alloc.free(a);
      if (i < 2) {
        EXPECT_EQ(alloc.malloc(0, size, stream), a);
      }
    }
    return hits(alloc) - before;
  };
  EXPECT_EQ(pairs(f.alloc, 512, s), 1);
  EXPECT_EQ(pairs(f.alloc, 4 * mib, s), 0);
  fixture g(true);  // unset again: every block
  EXPECT_EQ(pairs(g.alloc, 4 * mib, 0), 1);
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
      const std::uint64_t pick = rng() % 4;
      if (pick == 0) {  // a temporary buffer in a loop: the pairs the cache serves
        const std::size_t size = std::size_t{512} << (rng() % 6);
        const stream_t s = streams[rng() % 2];
        for (int k = 0; k < 3; ++k) f.alloc.free(f.alloc.malloc(0, size, s));
      } else if (live.empty() || pick == 1) {
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
  // The free blocks inside split segments: every current, allocated and
  // freed value (a hit counts the free's merge and the malloc's split); the
  // peak can miss the value between an elided free and malloc.
  for (std::size_t r = 0; r < on.size(); ++r) {
    for (auto field : {&device_stats::inactive_split, &device_stats::inactive_split_bytes}) {
      for (std::size_t g = 0; g < stat_group_count; ++g) {
        const stat& x = (on[r].*field)[g];
        const stat& y = (off[r].*field)[g];
        EXPECT_TRUE(x.current == y.current && x.allocated == y.allocated && x.freed == y.freed)
            << "inactive split, read " << r << " group " << g << ": current " << x.current << "/" << y.current
            << " allocated " << x.allocated << "/" << y.allocated << " freed " << x.freed << "/" << y.freed;
      }
    }
  }
  EXPECT_EQ(on.back().allocation[0].current, 0);
  EXPECT_GT(on.back().allocation[0].allocated, 1000);
  EXPECT_GT(on.back().num_thread_cache_hits, 100);
  EXPECT_EQ(off.back().num_thread_cache_hits, 0);
}

// A parked block is free for everyone who looks: statistics, segments,
// invariants; empty_cache returns its segment.
TEST(ThreadCacheTest, ParkedBlocksAreFreeForReadersAndEmptyCache) {
  fixture f(true);
  const stream_t s = f.sim->create_stream(0);
  // Three pairs: the second block is parked, handed out again (a hit) and
  // parked again at its free.
  for (int i = 0; i < 3; ++i) f.alloc.free(f.alloc.malloc(0, 4 * mib, s));
  const device_stats st = f.alloc.get_device_stats(0);
  EXPECT_EQ(st.num_thread_cache_hits, 1);
  EXPECT_EQ(st.allocated_bytes[0].current, 0);
  EXPECT_EQ(st.active_bytes[0].current, 0);
  EXPECT_EQ(st.requested_bytes[0].current, 0);
  EXPECT_EQ(st.allocation[0].freed, 3);
  EXPECT_EQ(st.reserved_bytes[0].current, static_cast<std::int64_t>(20 * mib));  // a large segment
  for (const segment_info& seg : f.alloc.device_allocator(0).segments())
    for (const block_info& b : seg.blocks) EXPECT_EQ(b.state, block_state::inactive);
  f.alloc.device_allocator(0).check_invariants();
  // The segment is cached now: the first of these comes from the pools.
  for (int i = 0; i < 3; ++i) f.alloc.free(f.alloc.malloc(0, 4 * mib, s));  // parked again
  EXPECT_EQ(f.alloc.get_device_stats(0).num_thread_cache_hits, 3);
  for (int i = 0; i < 3; ++i) f.alloc.free(f.alloc.malloc(0, 4 * mib, s));
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
    // The last of three pairs is parked in this thread's cache (a hit, parked again).
    for (int i = 0; i < 3; ++i) f.alloc.free(f.alloc.malloc(0, 40 * mib, s));
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
    for (int i = 0; i < 3; ++i) f.alloc.free(f.alloc.malloc(0, 512, s));  // the last one stays parked
  });
  t.join();
  const device_stats st = f.alloc.get_device_stats(0);
  EXPECT_EQ(st.num_thread_cache_hits, 8 + 1);  // 8 MiB: from the third pair on; 512 B: the third
  EXPECT_EQ(st.allocated_bytes[0].current, 0);
  EXPECT_EQ(st.allocation[0].allocated, 13);
  EXPECT_EQ(st.allocation[0].freed, 13);
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
    // From the 512 B block's segment (the pools), then twice from the cache; the last one parked.
    for (int i = 0; i < 3; ++i) f.alloc.free(f.alloc.malloc(0, 4096, s));
  });
  t.join();
  const device_stats st = f.alloc.get_device_stats(0);
  EXPECT_EQ(st.num_thread_cache_hits, 2);
  EXPECT_EQ(st.allocation[0].current, 0);
  EXPECT_EQ(st.allocation[0].freed, 4);
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

// On by default (a hit is what the pools would hand out); CCALLOC_THREAD_CACHE,
// read when a device is created, turns it off; an unknown value leaves it on.
TEST(ThreadCacheTest, OnByDefaultAndSwitchedByTheEnvironment) {
  const auto enabled_with = [](const char* value) {
    if (value == nullptr) ::unsetenv("CCALLOC_THREAD_CACHE");
    else ::setenv("CCALLOC_THREAD_CACHE", value, 1);
    auto sim = std::make_shared<sim_backend>(sim_options{1, std::size_t{1} << 30, 2 * mib});
    caching_allocator alloc(sim, plain_config());
    alloc.init(1);
    return alloc.device_allocator(0).thread_cache_enabled();
  };
  EXPECT_TRUE(enabled_with(nullptr));
  EXPECT_TRUE(enabled_with("1"));
  EXPECT_TRUE(enabled_with("small"));
  EXPECT_FALSE(enabled_with("0"));
  EXPECT_TRUE(enabled_with("all"));
  EXPECT_TRUE(enabled_with("True"));
  EXPECT_FALSE(enabled_with("off"));
  EXPECT_FALSE(enabled_with(" off "));  // blanks dropped, as the key's values are
  EXPECT_FALSE(enabled_with("False"));
  EXPECT_TRUE(enabled_with(""));
  EXPECT_EQ(allocator_config::parse("thread_cache: all").thread_cache, thread_cache_mode::all);
  // One parser for the variable and the key (breaker finding): what the key
  // rejects, the variable does not take either; a warning names the value.
  for (const char* value : {"sometimes", "on", "yes", "ALL"}) {
    ::testing::internal::CaptureStderr();
    EXPECT_TRUE(enabled_with(value)) << value;
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
  // Whether a freed block of `size` bytes is handed out again by the thread
  // cache (a hit) rather than the pools.
  const auto parks = [](caching_allocator& alloc, std::size_t size) {
    const std::int64_t before = hits(alloc);
    void* a = alloc.malloc(0, size, 0);  // the slow path: proves nothing, not parked
    alloc.free(a);
    void* b = alloc.malloc(0, size, 0);  // the pools' best fit: parked at its free
    alloc.free(b);
    void* c = alloc.malloc(0, size, 0);
    alloc.free(c);
    alloc.empty_cache();
    return a == b && b == c && hits(alloc) == before + 1;
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
  ::setenv("CCALLOC_THREAD_CACHE", "0", 1);
  {
    auto [sim, alloc] = make("expandable_segments:False,thread_cache:small");  // the key wins
    EXPECT_TRUE(alloc->device_allocator(0).thread_cache_enabled());
  }
  {
    auto [sim, alloc] = make("expandable_segments:False");
    EXPECT_FALSE(alloc->device_allocator(0).thread_cache_enabled());
  }
  ::unsetenv("CCALLOC_THREAD_CACHE");
  {
    auto [sim, alloc] = make("expandable_segments:False");  // the default
    EXPECT_TRUE(alloc->device_allocator(0).thread_cache_enabled());
    EXPECT_TRUE(parks(*alloc, 4 * mib));
  }
}

}  // namespace
}  // namespace ccalloc

