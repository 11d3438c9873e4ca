// Concurrency: threads on their own streams (SPEC X1), frees of blocks from
// other threads, record_stream across streams, and slow-path operations
// (empty_cache, memory fraction, stats) racing with the fast path.
// Invariants are checked at the quiescent point after the threads join.
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/core/config.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include "mapping_table.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

namespace {

using ccalloc::mib;

// Runs worker(t) for t in [0, threads) on their own threads while another
// thread calls background() in a loop; returns when the workers are done.
template <class Worker, class Background>
void run_alongside(int threads, Worker worker, Background background) {
  std::atomic<bool> stop{false};
  std::thread side([&] {
    while (!stop.load()) {
      background();
      std::this_thread::yield();
    }
  });
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(worker, t);
  for (auto& th : pool) th.join();
  stop.store(true);
  side.join();
}

TEST(ConcurrencyTest, ThreadsOnOwnStreamsWithCrossThreadFreesAndSlowPathRaces) {
  auto sim = std::make_shared<ccalloc::sim_backend>(ccalloc::sim_options{1, std::size_t{2} << 30, 2 * mib});
  ccalloc::caching_allocator alloc(sim, ccalloc::allocator_config{});
  alloc.init(1);
  constexpr int threads = 6;
  constexpr int ops = 20000;
  std::vector<ccalloc::stream_t> streams;
  for (int t = 0; t < threads; ++t) streams.push_back(sim->create_stream(0));

  // Pointers handed between threads: a thread frees what another allocated.
  std::mutex handoff_mutex;
  std::vector<void*> handoff;
  std::atomic<bool> stop{false};
  std::atomic<long> ooms{0};

  auto worker = [&](int t) {
    std::mt19937_64 rng(1234 + t);
    std::vector<void*> mine;
    for (int i = 0; i < ops; ++i) {
      const int op = static_cast<int>(rng() % 10);
      if (op < 5 || mine.empty()) {
        const std::size_t size = std::size_t{512} << (rng() % 16);  // 512 B .. 16 MiB
        try {
          void* p = alloc.malloc(0, size + rng() % 512, streams[static_cast<std::size_t>(t)]);
          if (rng() % 4 == 0) alloc.record_stream(p, streams[(static_cast<std::size_t>(t) + 1) % threads]);
          mine.push_back(p);
        } catch (const ccalloc::out_of_memory_error&) {
          ++ooms;
        }
      } else if (op < 8) {
        const std::size_t k = rng() % mine.size();
        alloc.free(mine[k]);
        mine[k] = mine.back();
        mine.pop_back();
      } else {
        const std::size_t k = rng() % mine.size();
        std::lock_guard lock(handoff_mutex);
        handoff.push_back(mine[k]);
        mine[k] = mine.back();
        mine.pop_back();
        if (handoff.size() > 8) {
          void* p = handoff.front();
          handoff.erase(handoff.begin());
          alloc.free(p);  // allocated by some other thread, maybe on another stream
        }
      }
    }
    for (void* p : mine) alloc.free(p);
  };
  auto disturber = [&] {
    std::mt19937_64 rng(99);
    while (!stop.load()) {
      switch (rng() % 4) {
        case 0: alloc.empty_cache(); break;
        case 1: alloc.set_memory_fraction(0.5 + 0.5 * double(rng() % 100) / 100.0, 0); break;
        case 2: (void)alloc.get_device_stats(0); break;
        default: sim->advance_to(sim->now() + 1); break;
      }
      std::this_thread::yield();
    }
  };

  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(worker, t);
  std::thread d(disturber);
  for (auto& th : pool) th.join();
  stop = true;
  d.join();
  for (void* p : handoff) alloc.free(p);

  auto& dev = alloc.device_allocator(0);
  dev.check_invariants();
  const auto st = alloc.get_device_stats(0);
  EXPECT_EQ(st.allocation[0].current, 0);
  EXPECT_EQ(st.allocated_bytes[0].current, 0);
  // Blocks still waiting on recorded streams are active and keep their requested bytes.
  EXPECT_EQ(st.requested_bytes[0].current == 0, st.active_bytes[0].current == 0);
  // Everything comes back once the recorded streams' work is done.
  for (auto s : streams) sim->synchronize_stream(0, s);
  alloc.empty_cache();
  const auto after = alloc.get_device_stats(0);
  EXPECT_EQ(after.active_bytes[0].current, 0);
  EXPECT_EQ(after.requested_bytes[0].current, 0);
  EXPECT_EQ(after.reserved_bytes[0].current, 0);
  EXPECT_EQ(sim->counters().used_bytes, 0u);
  dev.check_invariants();
}

// Threads that allocate on their per-thread default stream and exit, while
// workers allocate on their own streams and a disturber takes the world
// lock: each exiting thread hands its stream to the device, whose next world
// lock waits for its work and marks it gone. Blocks of an exited thread's
// stream freed later by another thread, and uses recorded on it, stay exact.
TEST(ConcurrencyTest, ThreadsExitWhileOthersAllocateOnTheirOwnStreams) {
  auto sim = std::make_shared<ccalloc::sim_backend>(ccalloc::sim_options{1, std::size_t{2} << 30, 2 * mib});
  ccalloc::caching_allocator alloc(sim, ccalloc::allocator_config{});
  alloc.init(1);
  constexpr int workers = 3;
  constexpr int short_threads = 150;
  std::vector<ccalloc::stream_t> streams;
  for (int t = 0; t < workers; ++t) streams.push_back(sim->create_stream(0));
  std::mutex left_mutex;
  std::vector<void*> left;  // blocks of exited threads' streams, freed by the main thread
  std::atomic<bool> stop{false};
  auto worker = [&](int t) {
    std::mt19937_64 rng(77 + t);
    std::vector<void*> mine;
    while (!stop.load()) {
      if (mine.size() < 8) {
        void* p = alloc.malloc(0, (std::size_t{512} << (rng() % 13)) + rng() % 512, streams[std::size_t(t)]);
        mine.push_back(p);
      } else {
        for (void* p : mine) alloc.free(p);
        mine.clear();
      }
    }
    for (void* p : mine) alloc.free(p);
  };
  std::vector<std::thread> pool;
  for (int t = 0; t < workers; ++t) pool.emplace_back(worker, t);
  std::thread disturber([&] {
    std::mt19937_64 rng(5);
    while (!stop.load()) {
      if (rng() % 2 == 0) (void)alloc.get_device_stats(0);
      else alloc.empty_cache();
      std::this_thread::yield();
    }
  });
  for (int i = 0; i < short_threads; ++i) {
    std::thread t([&, i] {
      std::mt19937_64 rng(1000 + i);
      const ccalloc::stream_t own = ccalloc::per_thread_stream_handle;
      void* a = alloc.malloc(0, (std::size_t{512} << (rng() % 13)) + rng() % 512, own);
      void* b = alloc.malloc(0, 2 * mib, own);
      alloc.record_stream(b, streams[std::size_t(i) % workers]);  // a use on a live stream
      alloc.free(a);
      std::lock_guard lock(left_mutex);
      left.push_back(b);  // freed after this thread has exited
    });
    t.join();
    if (i % 8 == 7) {
      std::lock_guard lock(left_mutex);
      for (void* p : left) alloc.free(p);
      left.clear();
    }
  }
  stop.store(true);
  for (auto& th : pool) th.join();
  disturber.join();
  for (void* p : left) alloc.free(p);
  auto& dev = alloc.device_allocator(0);
  dev.check_invariants();
  for (auto s : streams) sim->synchronize_stream(0, s);
  alloc.empty_cache();
  const auto st = alloc.get_device_stats(0);
  EXPECT_EQ(st.allocation[0].current, 0);
  EXPECT_EQ(st.allocated_bytes[0].current, 0);
  EXPECT_EQ(st.active_bytes[0].current, 0);
  EXPECT_EQ(st.reserved_bytes[0].current, 0);
  EXPECT_EQ(sim->counters().used_bytes, 0u);
  dev.check_invariants();
}

// Aborts the process (a failure ctest reports at once) unless disarmed
// within `limit`: a test that hangs fails instead of waiting for ctest's
// timeout.
class watchdog {
 public:
  explicit watchdog(std::chrono::seconds limit, const char* what)
      : thread_([this, limit, what] {
          std::unique_lock lock(mutex_);
          if (!done_cv_.wait_for(lock, limit, [this] { return done_; })) {
            std::fprintf(stderr, "watchdog: %s did not finish within %lld s (a hang)\n", what,
                         static_cast<long long>(limit.count()));
            std::abort();
          }
        }) {}
  ~watchdog() {
    {
      std::lock_guard lock(mutex_);
      done_ = true;
    }
    done_cv_.notify_one();
    thread_.join();
  }
  watchdog(const watchdog&) = delete;
  watchdog& operator=(const watchdog&) = delete;

 private:
  std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;
  std::thread thread_;
};

// Threads malloc and free on a shared stream handle (and record uses on it)
// while another thread makes a new stream, swaps it in and destroys the old
// one, over and over: a thread may find its stream destroyed at any step
// (between looking it up and locking it, between its lock and the world
// lock), malloc on a handle just destroyed (refused), and free blocks of
// destroyed streams (always). Nothing may crash, hang or miscount: every
// block freed and the cache emptied, nothing is allocated or reserved.
// About 2 s (fewer cycles under the sanitizers, the same time).
TEST(ConcurrencyTest, StreamsDestroyedWhileOtherThreadsAllocateAndFreeOnThem) {
  const watchdog dog(std::chrono::seconds(120), "the stream destroy race");
  for (const char* conf : {"", "expandable_segments:False,reuse_across_streams:False"}) {
    auto sim = std::make_shared<ccalloc::sim_backend>(ccalloc::sim_options{1, std::size_t{1} << 30, 2 * mib});
    ccalloc::caching_allocator alloc(sim, ccalloc::allocator_config::parse(conf));
    alloc.init(1);
    std::atomic<ccalloc::stream_t> shared{alloc.create_stream(0)};
    std::atomic<bool> stop{false};
    std::atomic<long> refused{0}, served{0};
    auto worker = [&](int t) {
      std::mt19937_64 rng(4242 + t);
      std::vector<void*> mine(16, nullptr);
      while (!stop.load(std::memory_order_relaxed)) {
        void*& slot = mine[rng() % mine.size()];
        if (slot != nullptr) {
          alloc.free(slot);  // a block of a destroyed stream too
          slot = nullptr;
          continue;
        }
        const std::size_t size = rng() % 4 == 0 ? rng() % (8 * mib) + 1 : rng() % 4096 + 1;
        try {
          slot = alloc.malloc(0, size, shared.load());
          served.fetch_add(1, std::memory_order_relaxed);
        } catch (const ccalloc::invalid_argument_error&) {  // the stream was destroyed meanwhile
          refused.fetch_add(1, std::memory_order_relaxed);
          continue;
        }
        if (rng() % 3 == 0) {
          try {
            alloc.record_stream(slot, shared.load());
          } catch (const ccalloc::invalid_argument_error&) {  // destroyed meanwhile
          }
        }
      }
      for (void* p : mine)
        if (p != nullptr) alloc.free(p);
    };
    std::vector<std::thread> pool;
    for (int t = 0; t < 3; ++t) pool.emplace_back(worker, t);
    long cycles = 0;
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    while (std::chrono::steady_clock::now() < end) {
      const ccalloc::stream_t fresh = alloc.create_stream(0);
      alloc.destroy_stream(0, shared.exchange(fresh));
      ++cycles;
    }
    stop.store(true);
    for (auto& th : pool) th.join();
    alloc.destroy_stream(0, shared.load());
    auto& dev = alloc.device_allocator(0);
    dev.check_invariants();
    alloc.empty_cache();
    const auto st = alloc.get_device_stats(0);
    EXPECT_EQ(st.allocation[0].current, 0) << "config '" << conf << "'";
    EXPECT_EQ(st.allocated_bytes[0].current, 0) << "config '" << conf << "'";
    EXPECT_EQ(st.active_bytes[0].current, 0) << "config '" << conf << "'";
    EXPECT_EQ(st.reserved_bytes[0].current, 0) << "config '" << conf << "'";
    EXPECT_EQ(sim->counters().used_bytes, 0u) << "config '" << conf << "'";
    EXPECT_GT(cycles, 100) << "config '" << conf << "'";
    EXPECT_GT(served.load(), 100) << "config '" << conf << "'";
    dev.check_invariants();
  }
}

// Once destroy_stream has returned, a malloc on the stream is refused in
// every thread, also in one that had looked the stream up before (its
// thread-local entry) and whose cached block of the stream would fit.
TEST(ConcurrencyTest, AMallocOnADestroyedStreamIsRefusedInEveryThread) {
  for (const char* conf : {"", "expandable_segments:False", "thread_cache:off"}) {
    auto sim = std::make_shared<ccalloc::sim_backend>(ccalloc::sim_options{1, std::size_t{1} << 30, 2 * mib});
    ccalloc::caching_allocator alloc(sim, ccalloc::allocator_config::parse(conf));
    alloc.init(1);
    const ccalloc::stream_t s = alloc.create_stream(0);
    std::mutex m;
    std::condition_variable cv;
    int step = 0;  // 1: the worker allocated and freed; 2: the stream is destroyed
    bool refused = false;
    void* kept = nullptr;
    std::thread worker([&] {
      alloc.free(alloc.malloc(0, 4096, s));
      kept = alloc.malloc(0, 8192, s);  // the stream keeps a segment: not forgotten
      {
        std::lock_guard lock(m);
        step = 1;
      }
      cv.notify_all();
      std::unique_lock lock(m);
      cv.wait(lock, [&] { return step == 2; });
      try {
        alloc.free(alloc.malloc(0, 4096, s));
      } catch (const ccalloc::invalid_argument_error&) {
        refused = true;
      }
    });
    {
      std::unique_lock lock(m);
      cv.wait(lock, [&] { return step == 1; });
    }
    alloc.destroy_stream(0, s);
    {
      std::lock_guard lock(m);
      step = 2;
    }
    cv.notify_all();
    worker.join();
    EXPECT_TRUE(refused) << "a malloc on a destroyed stream succeeded (config '" << conf << "')";
    alloc.free(kept);
    alloc.empty_cache();
    EXPECT_EQ(alloc.get_device_stats(0).reserved_bytes[0].current, 0) << "config '" << conf << "'";
  }
}

// With one thread, statistics are exact even when it switches streams: the
// peak of allocated bytes is the peak of the sum over streams.
TEST(ConcurrencyTest, SingleThreadPeaksAreExactAcrossStreams) {
  auto sim = std::make_shared<ccalloc::sim_backend>();
  ccalloc::caching_allocator alloc(sim, ccalloc::allocator_config{});
  alloc.init(1);
  const auto s1 = sim->create_stream(0);
  const auto s2 = sim->create_stream(0);
  void* a = alloc.malloc(0, 4 * mib, s1);  // s1: 4 MiB
  void* b = alloc.malloc(0, 6 * mib, s2);  // s1 + s2 = 10 MiB: the peak
  alloc.free(a);                           // 6 MiB
  void* c = alloc.malloc(0, 2 * mib, s1);  // 8 MiB
  const auto st = alloc.get_device_stats(0);
  EXPECT_EQ(st.allocated_bytes[0].peak, static_cast<std::int64_t>(10 * mib));
  EXPECT_EQ(st.allocated_bytes[0].current, static_cast<std::int64_t>(8 * mib));
  EXPECT_EQ(st.requested_bytes[0].peak, static_cast<std::int64_t>(10 * mib));
  alloc.free(b);
  alloc.free(c);
}

// The thread cache (issue 18): blocks allocated by one thread are freed by
// another (parked in the freeing thread's cache under the allocating
// stream), handed out again to the freeing thread on that stream, and
// returned to the pools by misses, by stats reads and empty_cache racing
// with them, and by thread exit. Afterwards nothing is live and nothing is
// lost.
TEST(ConcurrencyTest, ThreadCacheBlocksMoveAcrossThreadsAndStreams) {
  auto sim = std::make_shared<ccalloc::sim_backend>(ccalloc::sim_options{1, std::size_t{2} << 30, 2 * mib});
  ccalloc::caching_allocator alloc(sim, ccalloc::allocator_config{});
  alloc.init(1);
  alloc.device_allocator(0).set_thread_cache_enabled(true);  // opt-in
  ASSERT_TRUE(alloc.device_allocator(0).thread_cache_enabled());
  constexpr int threads = 4;
  constexpr int ops = 20000;
  std::vector<ccalloc::stream_t> streams;
  for (int t = 0; t < threads; ++t) streams.push_back(sim->create_stream(0));
  struct handed {
    void* ptr;
    std::size_t size;
    ccalloc::stream_t stream;
  };
  std::mutex handoff_mutex;
  std::vector<handed> handoff;
  std::atomic<long> reuses{0};

  auto worker = [&](int t) {
    std::mt19937_64 rng(99 + t);
    const std::size_t sizes[] = {512, 4096, 1 * mib, 3 * mib};
    for (int i = 0; i < ops; ++i) {
      const std::size_t size = sizes[rng() % 4];
      const ccalloc::stream_t stream = streams[rng() % threads];
      void* p = alloc.malloc(0, size, stream);
      if (rng() % 2 == 0) {  // hand it to another thread
        std::lock_guard lock(handoff_mutex);
        handoff.push_back({p, size, stream});
      } else {
        alloc.free(p);
      }
      handed h{nullptr, 0, 0};
      {
        std::lock_guard lock(handoff_mutex);
        if (!handoff.empty()) {
          h = handoff.back();
          handoff.pop_back();
        }
      }
      if (h.ptr != nullptr) {
        alloc.free(h.ptr);  // parked here, under the allocating thread's stream
        void* again = alloc.malloc(0, h.size, h.stream);  // this thread, that stream
        if (again == h.ptr) reuses.fetch_add(1, std::memory_order_relaxed);
        alloc.free(again);
      }
    }
  };
  run_alongside(threads, worker, [&] {
    const auto st = alloc.get_device_stats(0);
    EXPECT_GE(st.allocated_bytes[0].current, 0);
    EXPECT_LE(st.allocated_bytes[0].current, st.reserved_bytes[0].current);
    alloc.empty_cache();
    (void)alloc.device_allocator(0).segments();
  });
  for (const handed& h : handoff) alloc.free(h.ptr);
  EXPECT_GT(reuses.load(), 0);  // the cache served blocks freed across threads
  auto& dev = alloc.device_allocator(0);
  dev.check_invariants();
  const auto st = alloc.get_device_stats(0);
  EXPECT_EQ(st.allocated_bytes[0].current, 0);
  EXPECT_EQ(st.active_bytes[0].current, 0);
  EXPECT_EQ(st.requested_bytes[0].current, 0);
  EXPECT_EQ(st.allocation[0].allocated, st.allocation[0].freed);
  alloc.empty_cache();
  EXPECT_EQ(alloc.get_device_stats(0).reserved_bytes[0].current, 0);
  EXPECT_EQ(sim->counters().used_bytes, 0u);
}

// No-caching mode switched on and off (enable) while threads free into
// their caches: the park reads the mode without a lock, so the mode is an
// atomic (breaker finding: a data race ThreadSanitizer reports). Afterwards
// nothing is live, and the cache returns everything.
TEST(ConcurrencyTest, ThreadCacheParksWhileCachingIsSwitched) {
  auto sim = std::make_shared<ccalloc::sim_backend>(ccalloc::sim_options{1, std::size_t{1} << 30, 2 * mib});
  ccalloc::caching_allocator alloc(sim, ccalloc::allocator_config{});
  alloc.init(1);
  ASSERT_TRUE(alloc.device_allocator(0).thread_cache_enabled());
  constexpr int threads = 3;
  std::vector<ccalloc::stream_t> streams;
  for (int t = 0; t < threads; ++t) streams.push_back(sim->create_stream(0));
  std::atomic<long> switches{0};
  auto worker = [&](int t) {
    const std::size_t sizes[] = {512, 8192, 3 * mib};
    for (int i = 0; i < 20000; ++i) {
      const std::size_t size = sizes[(i / 8) % 3];
      void* keep = alloc.malloc(0, 512, streams[t]);  // splits the segment: pairs stay cached
      for (int k = 0; k < 3; ++k) alloc.free(alloc.malloc(0, size, streams[t]));
      alloc.free(keep);
    }
  };
  bool on = false;
  run_alongside(threads, worker, [&] {
    alloc.enable(on);
    on = !on;
    switches.fetch_add(1, std::memory_order_relaxed);
  });
  alloc.enable(true);
  EXPECT_GT(switches.load(), 1);
  alloc.device_allocator(0).check_invariants();
  const auto st = alloc.get_device_stats(0);
  EXPECT_EQ(st.allocated_bytes[0].current, 0);
  EXPECT_EQ(st.allocation[0].allocated, st.allocation[0].freed);
  EXPECT_EQ(st.allocation[0].allocated, threads * 20000 * 4);
  alloc.empty_cache();
  EXPECT_EQ(alloc.get_device_stats(0).reserved_bytes[0].current, 0);
  EXPECT_EQ(sim->counters().used_bytes, 0u);
}

}  // namespace

namespace {

// Mapping announcements (SPEC C1) while threads on their own streams map,
// recycle and release pages at once: a table kept from them equals the
// mapped ranges at the end, and no announcement contradicted the table.
TEST(ConcurrencyTest, MappingAnnouncementsStayInStepAcrossThreads) {
  ccalloc::sim_options o;
  o.capacity_bytes = 256 * mib;
  auto sim = std::make_shared<ccalloc::sim_backend>(o);
  ccalloc::caching_allocator alloc(sim, ccalloc::allocator_config::parse("trim_on_new_peak:True"));
  alloc.init(1);
  ccalloc::testing::mapping_table table;
  alloc.attach_mapping_listener([&](const ccalloc::mapping_event& e) { table.apply(e); });
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t)
    threads.emplace_back([&, t] {
      const ccalloc::stream_t s = sim->create_stream(0);
      std::mt19937_64 rng(static_cast<unsigned>(t) + 1);
      std::vector<void*> live;
      for (int i = 0; i < 300; ++i) {
        if (live.size() < 4 && rng() % 3 != 0) {
          try {
            live.push_back(alloc.malloc(0, (1 + rng() % 12) * mib, s));
          } catch (const ccalloc::out_of_memory_error&) {
          }
        } else if (!live.empty()) {
          alloc.free(live.back());
          live.pop_back();
        }
        if (i % 50 == 49) alloc.empty_cache();
      }
      for (void* p : live) alloc.free(p);
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(table.error(), "");
  EXPECT_EQ(table.ranges(), ccalloc::testing::mapped_ranges(alloc.device_allocator(0)));
  EXPECT_GT(table.events(), 0u);
  alloc.empty_cache();
  EXPECT_EQ(table.bytes(), 0u);
}

}  // namespace
