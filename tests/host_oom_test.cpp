// host_oom_test.cpp: frees and mallocs that run out of host memory (SPEC R5:
// an error leaves the state unchanged). This program replaces the global
// operator new (its own executable, so that no other test shares it): while
// `host_out_of_memory` is set, every allocation of the program throws
// std::bad_alloc, as under an exhausted RLIMIT_AS.
//
// The free-block index of a pool (block_index) keeps a spare slot in every
// bin: an insert that fills a bin grows it afterwards, and when that growth
// finds no host memory the index owes it (block_index::owes). The operation
// still succeeds; the next one that could insert into the pool repays first,
// before it changes anything, and fails unchanged if host memory is still
// out. Before this design a free grew the bin in the middle of its work: it
// had counted the block freed when it threw, and the block stayed live, so
// freeing it again counted it twice (allocated bytes went negative).
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/core/device_caching_allocator.hpp>
#include <ccalloc/core/tags.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include <gtest/gtest.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <vector>

namespace {
std::atomic<bool> host_out_of_memory{false};
std::atomic<long> refused_allocations{0};
// While >= 0: allocations left before host memory runs out (each one
// counts it down; at 0 the next is refused).
std::atomic<long> allocations_left{-1};
}  // namespace

// Out of line: inlined, GCC pairs a `new` expression with the free() below
// and warns (-Wmismatched-new-delete) although they match here.
[[gnu::noinline]] void* operator new(std::size_t size) {
  if (allocations_left.load(std::memory_order_relaxed) >= 0 &&
      allocations_left.fetch_sub(1, std::memory_order_relaxed) <= 0)
    host_out_of_memory.store(true, std::memory_order_relaxed);
  if (host_out_of_memory.load(std::memory_order_relaxed)) {
    refused_allocations.fetch_add(1, std::memory_order_relaxed);
    throw std::bad_alloc();
  }
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
[[gnu::noinline]] void operator delete(void* p) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void* p, std::size_t) noexcept { std::free(p); }
// The array forms too: the standard library's call the single forms, but a
// sanitizer's runtime replaces each form on its own (under ASan, new[] never
// reached the operator new above, and no allocation failed).
[[gnu::noinline]] void* operator new[](std::size_t size) { return ::operator new(size); }
[[gnu::noinline]] void operator delete[](void* p) noexcept { ::operator delete(p); }
[[gnu::noinline]] void operator delete[](void* p, std::size_t) noexcept { ::operator delete(p); }

namespace {

using namespace ccalloc;  // NOLINT: test file

/// Host memory runs out for the scope's life, after `allowed` more
/// allocations (0: at once).
struct no_host_memory {
  explicit no_host_memory(long allowed = 0) {
    if (allowed == 0) host_out_of_memory.store(true, std::memory_order_relaxed);
    else allocations_left.store(allowed, std::memory_order_relaxed);
  }
  ~no_host_memory() {
    allocations_left.store(-1, std::memory_order_relaxed);
    host_out_of_memory.store(false, std::memory_order_relaxed);
  }
  no_host_memory(const no_host_memory&) = delete;
  no_host_memory& operator=(const no_host_memory&) = delete;
};

/// Runs f() with host memory running out after `allowed` allocations
/// (0: at once); true when it threw std::bad_alloc.
template <class F>
bool fails_without_host_memory(F f, long allowed = 0) {
  no_host_memory scope(allowed);
  try {
    f();
  } catch (const std::bad_alloc&) {
    return true;
  }
  return false;
}

struct sim_fixture {
  std::shared_ptr<sim_backend> sim;
  std::unique_ptr<caching_allocator> alloc;
  explicit sim_fixture(const std::string& conf) {
    sim_options o;
    o.capacity_bytes = std::size_t{1} << 30;
    sim = std::make_shared<sim_backend>(o);
    alloc = std::make_unique<caching_allocator>(sim, allocator_config::parse(conf));
    alloc->init(1);
  }
  std::map<std::string, std::int64_t> stats() const { return alloc->get_device_stats(0).to_map(); }
};

// Every other of 4,000 blocks of 512 bytes (one 2 MiB segment each 4,096):
// the freed blocks cannot merge, so each free inserts one more entry into
// the 512-byte bin, which grows at 4, 8, 16, ... entries.
TEST(HostOutOfMemory, AFreeThatFailsChangesNothingAndCanBeRepeated) {
  for (const char* conf : {"expandable_segments:False,thread_cache:off", "thread_cache:off"}) {
    SCOPED_TRACE(conf);
    sim_fixture f(conf);
    constexpr std::size_t n = 4000;
    std::vector<void*> v(n);
    for (auto& p : v) p = f.alloc->malloc(0, 512, 0);
    std::size_t failed = 0, freed_without_memory = 0;
    for (std::size_t i = 1; i < n; i += 2) {
      const auto before = f.stats();
      const bool threw = fails_without_host_memory([&] { f.alloc->free(v[i]); });
      if (!threw) {
        ++freed_without_memory;
        continue;
      }
      ++failed;
      EXPECT_EQ(f.stats(), before) << "free #" << i / 2 + 1 << " failed: statistics unchanged";
      f.alloc->device_allocator(0).check_invariants();
      f.alloc->free(v[i]);  // with host memory again: the same pointer is still live
      EXPECT_EQ(f.stats().at("allocated_bytes.all.current"), before.at("allocated_bytes.all.current") - 512);
    }
    // The spare slot let most frees succeed without host memory; the few
    // that needed the owed growth failed, unchanged (bins grow at 4, 8, ...
    // entries: 2,000 entries need 9 growths).
    EXPECT_GE(failed, 1U);
    EXPECT_LE(failed, 10U);
    EXPECT_EQ(failed + freed_without_memory, n / 2);
    for (std::size_t i = 0; i < n; i += 2) f.alloc->free(v[i]);
    const auto after = f.stats();
    EXPECT_EQ(after.at("allocated_bytes.all.current"), 0);
    EXPECT_EQ(after.at("active.all.current"), 0);
    f.alloc->device_allocator(0).check_invariants();
    f.alloc->empty_cache();
    EXPECT_EQ(f.stats().at("reserved_bytes.all.current"), 0);
  }
}

// A malloc from the cache splits a free block; the remainder goes into its
// bin. Without host memory it fails unchanged (no pointer, same statistics)
// once a bin's growth is owed. 1 KiB from free 1.5 KiB blocks: the 512-byte
// remainders pile up in their bin (none fits the next request).
TEST(HostOutOfMemory, AMallocThatFailsChangesNothing) {
  sim_fixture f("expandable_segments:False,thread_cache:off");
  constexpr std::size_t n = 4000;
  // Spare block objects first (freed blocks that merged), so that a split
  // needs no new one: what can fail is the bin alone.
  std::vector<void*> warm(3 * n);
  for (auto& p : warm) p = f.alloc->malloc(0, 512, 0);
  for (void* p : warm) f.alloc->free(p);
  std::vector<void*> v(n);
  for (auto& p : v) p = f.alloc->malloc(0, 1536, 0);
  for (std::size_t i = 1; i < n; i += 2) f.alloc->free(v[i]);  // 2,000 free 1.5 KiB blocks
  std::vector<void*> w;
  std::size_t failed = 0;
  for (std::size_t k = 0; k < n / 2; ++k) {
    const auto before = f.stats();
    void* p = nullptr;
    const bool threw = fails_without_host_memory([&] { p = f.alloc->malloc(0, 1024, 0); });
    if (!threw) {
      w.push_back(p);
      continue;
    }
    ++failed;
    EXPECT_EQ(f.stats(), before) << "malloc #" << k + 1 << " failed: statistics unchanged";
    f.alloc->device_allocator(0).check_invariants();
    w.push_back(f.alloc->malloc(0, 1024, 0));  // with host memory again: served
  }
  // Bins grow at 4, 8, ... entries: 2,000 remainders need 9 growths.
  EXPECT_GE(failed, 1U);
  EXPECT_LE(failed, 10U);
  EXPECT_EQ(w.size(), n / 2);
  EXPECT_EQ(f.stats().at("allocated_bytes.all.current"),
            static_cast<std::int64_t>(n / 2 * 1536 + w.size() * 1024));
  for (void* p : w) f.alloc->free(p);
  for (std::size_t i = 0; i < n; i += 2) f.alloc->free(v[i]);
  EXPECT_EQ(f.stats().at("allocated_bytes.all.current"), 0);
  f.alloc->device_allocator(0).check_invariants();
  f.alloc->empty_cache();
  EXPECT_EQ(f.stats().at("reserved_bytes.all.current"), 0);
}

// Taking every lock of the device (the slow path, empty_cache, statistics)
// lists the streams first; without host memory that list cannot be made.
// The registry's lock was then left held and every later call on the device
// waited for ever (found by the seventh session's hostile-input trial).
TEST(HostOutOfMemory, TakingEveryLockWithoutHostMemoryReleasesThemAll) {
  sim_fixture f("thread_cache:off");
  const stream_t s1 = f.sim->create_stream(0);
  const stream_t s2 = f.sim->create_stream(0);
  void* a = f.alloc->malloc(0, 4 << 20, s1);
  void* b = f.alloc->malloc(0, 4 << 20, s2);
  f.alloc->free(b);
  const auto before = f.stats();
  const bool threw = fails_without_host_memory([&] { f.alloc->empty_cache(); });
  EXPECT_TRUE(threw) << "the world lock's list of streams needs host memory";
  EXPECT_EQ(f.stats(), before) << "nothing changed, and the device answers (no lock left held)";
  f.alloc->empty_cache();  // with host memory again: done
  EXPECT_EQ(f.stats().at("reserved_bytes.all.current"), before.at("allocated_bytes.all.current"));
  f.alloc->free(a);
  f.alloc->device_allocator(0).check_invariants();
}

// A stream's first malloc makes its entry in the device's registry. Without
// host memory it fails and leaves no entry: an empty one left behind was
// dereferenced by the next statistics read (a crash).
// Host memory runs out after k allocations, k = 0 (the registry's node) and
// 1 (the stream's state). (Later ones, in a malloc that makes a new segment:
// AMallocThatMakesAPlainSegmentFailsUnchanged and those after it.)
TEST(HostOutOfMemory, AStreamsFirstMallocWithoutHostMemoryLeavesNoEntry) {
  sim_fixture f("thread_cache:off");
  void* a = f.alloc->malloc(0, 512, 0);
  std::vector<void*> live{a};
  int failed = 0;
  for (long k = 0; k < 2; ++k) {
    SCOPED_TRACE(k);
    const stream_t s = f.sim->create_stream(0);
    const auto before = f.stats();
    void* p = nullptr;
    const bool threw = fails_without_host_memory([&] { p = f.alloc->malloc(0, 512, s); }, k);
    if (!threw) {
      live.push_back(p);
      continue;
    }
    ++failed;
    EXPECT_EQ(f.stats(), before);
    f.alloc->device_allocator(0).check_invariants();
    live.push_back(f.alloc->malloc(0, 512, s));  // with host memory again: the stream is made and served
  }
  EXPECT_EQ(failed, 2) << "both the registry's node and the stream's state were refused once";
  EXPECT_EQ(f.stats().at("allocated_bytes.all.current"), static_cast<std::int64_t>(512 * live.size()));
  for (void* p : live) f.alloc->free(p);
  f.alloc->device_allocator(0).check_invariants();
}

}  // namespace

namespace {

/// The statistics that say what the allocator holds: every one but the
/// counts of what was made and given back (a request that fails gives back
/// what it made: both counts move; device calls, segments and reserved bytes
/// allocated and freed) and the peaks.
std::map<std::string, std::int64_t> held(const sim_fixture& f) {
  std::map<std::string, std::int64_t> out;
  for (const auto& [key, value] : f.stats()) {
    const bool made = key.starts_with("num_device_") || key.starts_with("num_pages_") ||
                      key == "num_alloc_retries" || key == "num_device_synchronizations" ||
                      ((key.starts_with("segment.") || key.starts_with("reserved_bytes.")) &&
                       (key.ends_with(".allocated") || key.ends_with(".freed")));
    if (!made && !key.ends_with(".peak")) out.emplace(key, value);
  }
  return out;
}

/// "key: before -> after" for each statistic that differs.
std::string differences(const std::map<std::string, std::int64_t>& after,
                        const std::map<std::string, std::int64_t>& before) {
  std::string out;
  for (const auto& [key, value] : before)
    if (after.at(key) != value) out += key + ": " + std::to_string(value) + " -> " + std::to_string(after.at(key)) + "; ";
  return out;
}

/// Runs `setup` on a new allocator, then `grow` (a malloc that makes a
/// segment, a reservation or maps pages) with host memory running out after
/// k allocations, k = 0, 1, ... until it succeeds. Each failure must leave
/// the allocator holding what it held (statistics, the device's free
/// memory, invariants), and the malloc must then succeed with host memory.
/// Says how many k failed, and how many of those after the device gave
/// memory or mapped pages (then given back).
struct failures {
  int failed = 0;
  int undone = 0;
};
template <class Setup, class Grow>
failures every_host_allocation_fails_unchanged(const char* conf, Setup setup, Grow grow) {
  int failed = 0;
  int undone = 0;
  for (long k = 0; k < 400; ++k) {
    SCOPED_TRACE(k);
    sim_fixture f(conf);
    std::vector<void*> live = setup(f);
    const auto before = held(f);
    const auto before_peak = f.stats().at("reserved_bytes.all.peak");
    const sim_counters device = f.sim->counters();
    const std::size_t device_free = f.sim->mem_get_info(0).free_bytes;
    void* p = nullptr;
    const bool threw = fails_without_host_memory([&] { p = grow(f); }, k);
    if (!threw) {
      f.alloc->free(p);
      break;
    }
    ++failed;
    const sim_counters now = f.sim->counters();
    if (now.segment_mallocs + now.vm_creates + now.vm_maps > device.segment_mallocs + device.vm_creates + device.vm_maps)
      ++undone;
    EXPECT_EQ(now.live_reservations, device.live_reservations);
    EXPECT_EQ(now.live_handles, device.live_handles);
    EXPECT_EQ(now.mapped_bytes, device.mapped_bytes);
    EXPECT_EQ(differences(held(f), before), "");
    EXPECT_EQ(f.sim->mem_get_info(0).free_bytes, device_free) << "no device memory kept";
    f.alloc->device_allocator(0).check_invariants();
    p = grow(f);  // with host memory: served
    EXPECT_NE(p, nullptr);
    f.alloc->free(p);
    f.alloc->device_allocator(0).check_invariants();
    for (void* q : live) f.alloc->free(q);
    f.alloc->empty_cache();
    EXPECT_EQ(f.stats().at("reserved_bytes.all.current"), 0);
    EXPECT_EQ(f.stats().at("segment.all.current"), 0);
    EXPECT_GE(f.stats().at("reserved_bytes.all.peak"), before_peak);
  }
  return {failed, undone};
}

// A malloc that makes a new plain segment fails unchanged wherever host
// memory runs out on the way (seventh session's hostile-input trial, D3/D7:
// the segment count stayed one up, or the new segment was kept cached, or
// out of its pool): its host memory is taken before the device's, and what
// it made goes back.
TEST(HostOutOfMemory, AMallocThatMakesAPlainSegmentFailsUnchanged) {
  // A full 2 MiB small segment, and a 20 MiB one with 17 MiB free.
  const auto setup = [](sim_fixture& f) {
    return std::vector<void*>{f.alloc->malloc(0, 1 << 20, 0), f.alloc->malloc(0, 1 << 20, 0),
                              f.alloc->malloc(0, 3 << 20, 0)};
  };
  const failures small = every_host_allocation_fails_unchanged(
      "expandable_segments:False,thread_cache:off", setup,
      [](sim_fixture& f) { return f.alloc->malloc(0, 1 << 20, 0); });  // a new 2 MiB segment
  const failures large = every_host_allocation_fails_unchanged(
      "expandable_segments:False,thread_cache:off", setup,
      [](sim_fixture& f) { return f.alloc->malloc(0, 19 << 20, 0); });  // a new 20 MiB segment
  // Host memory is taken before the device's but for the segment's entry
  // in the device's map (then the segment goes back at once).
  EXPECT_GE(small.failed, 4);
  EXPECT_GE(large.failed, 4);
  EXPECT_GE(small.undone, 1);
  EXPECT_GE(large.undone, 1);
}

// The same for expandable segments (the default): a malloc that makes a new
// reservation and maps its pages (a stream's first small request, here on
// a stream that has a large reservation already) gives the reservation and
// its pages back (it kept the segment count one up, an unmapped block over a
// mapped page, or a page mapped twice on the retry).
TEST(HostOutOfMemory, AMallocThatMakesAReservationFailsUnchanged) {
  const failures r = every_host_allocation_fails_unchanged(
      "thread_cache:off", [](sim_fixture& f) { return std::vector<void*>{f.alloc->malloc(0, 8 << 20, 0)}; },
      [](sim_fixture& f) { return f.alloc->malloc(0, 480727, 0); });  // small: a new reservation
  EXPECT_GE(r.failed, 10);
  EXPECT_GE(r.undone, 5) << "pages mapped, then given back";
}

// A malloc that maps more pages of its stream's reservation: the pages it
// mapped go back.
TEST(HostOutOfMemory, AMallocThatMapsPagesFailsUnchanged) {
  const failures r = every_host_allocation_fails_unchanged(
      "thread_cache:off", [](sim_fixture& f) { return std::vector<void*>{f.alloc->malloc(0, 8 << 20, 0)}; },
      [](sim_fixture& f) { return f.alloc->malloc(0, 8 << 20, 0); });  // 4 more pages
  EXPECT_GE(r.failed, 10);
  EXPECT_GE(r.undone, 5) << "pages mapped, then given back";
}

}  // namespace

namespace {

// A block freed after record_stream waits for an event; the next slow path
// takes the completed event off its queue and returns the block. Host
// memory running out there (the event pool's growth) lost the event: the
// block stayed pending for ever and its segment could never be released
// (seventh session's hostile-input trial, fi.cpp).
TEST(HostOutOfMemory, ACompletedEventIsNotLostWithoutHostMemory) {
  int failed = 0;
  for (long k = 0; k < 100; ++k) {
    SCOPED_TRACE(k);
    sim_fixture f("expandable_segments:False,thread_cache:off");
    const stream_t s = f.sim->create_stream(0);
    void* used = f.alloc->malloc(0, 3 << 20, 0);
    f.alloc->record_stream(used, s);
    f.alloc->free(used);  // an event on s, completed at once (no work queued on s)
    EXPECT_EQ(f.stats().at("active_bytes.all.current"), 3 << 20) << "pending until the event is taken";
    void* p = nullptr;
    const bool threw = fails_without_host_memory([&] { p = f.alloc->malloc(0, 30 << 20, 0); }, k);
    f.alloc->device_allocator(0).check_invariants();
    if (!threw) {
      f.alloc->free(p);
      break;
    }
    ++failed;
    p = f.alloc->malloc(0, 30 << 20, 0);  // with host memory
    f.alloc->free(p);
    f.alloc->empty_cache();
    EXPECT_EQ(f.stats().at("active_bytes.all.current"), 0) << "the block came back";
    EXPECT_EQ(f.stats().at("reserved_bytes.all.current"), 0);
  }
  EXPECT_GE(failed, 2);
}

}  // namespace

namespace {

// A pause that keeps contents and runs out of host memory at any point
// (the pinned copies' records included) pauses nothing: the tag is not
// paused and its usage counts no paused bytes (a failed pause once left
// its runs noted, so tag usage reported the paused bytes of a pause that
// never happened).
TEST(HostOutOfMemory, AKeepContentsPauseThatFailsPausesNothing) {
  sim_fixture f("thread_cache:off");
  void* p = nullptr;
  {
    tag_scope scope("oom_pause");
    p = f.alloc->malloc(0, 8 << 20, 0);
  }
  const auto usage = [&] {
    for (const tag_usage& u : f.alloc->tag_stats(0))
      if (u.tag == "oom_pause") return u;
    return tag_usage{};
  };
  int failed = 0;
  bool paused = false;
  for (long allowed = 0; allowed < 400 && !paused; ++allowed) {
    try {
      no_host_memory scope(allowed);
      f.alloc->pause({"oom_pause"}, true);
      paused = true;
    } catch (const std::bad_alloc&) {
      ++failed;
    } catch (const out_of_memory_error&) {
      ++failed;
    }
    if (paused) break;
    const tag_usage u = usage();
    EXPECT_FALSE(u.paused) << "host memory ran out after " << allowed << " allocations";
    EXPECT_EQ(u.paused_bytes, 0u) << "host memory ran out after " << allowed << " allocations";
    EXPECT_EQ(u.kept_bytes, 0u) << "host memory ran out after " << allowed << " allocations";
  }
  EXPECT_TRUE(paused);
  EXPECT_GE(failed, 3);
  EXPECT_EQ(usage().paused_bytes, 8u << 20);
  f.alloc->resume({"oom_pause"});
  f.alloc->free(p);
}

}  // namespace

namespace {

/// Two tags of two reservations each (blocks on two streams), one block of
/// each tag freed while paused: a resume of both that fails at any point
/// must leave both tags paused, their pages unmapped on the device, and a
/// later resume must succeed, bring the kept contents back and do the
/// deferred frees (a resume that threw after mapping a first reservation
/// once left its pages mapped on the device but paused in the books: every
/// later resume failed on the mapping it had left, and the frees deferred
/// to it never happened).
struct two_paused_tags {
  sim_fixture f{"thread_cache:off"};
  std::vector<void*> live;  // one per tag and stream, freed at the end
  std::size_t kept = 0;
  explicit two_paused_tags(bool keep_contents) {
    const stream_t s = f.alloc->create_stream(0);
    for (const char* tag : {"oom_resume_a", "oom_resume_b"}) {
      tag_scope scope(tag);
      for (stream_t st : {stream_t{0}, s}) {
        void* p = f.alloc->malloc(0, 1 << 20, st);
        std::memset(p, 0x5a, 1 << 20);
        live.push_back(p);
        f.alloc->free(f.alloc->malloc(0, 1 << 20, st));  // cached: returned by the pause
        void* gone = f.alloc->malloc(0, 3 << 20, st);
        std::memset(gone, 0x11, 3 << 20);
        pending.push_back(gone);
      }
    }
    f.alloc->pause({"oom_resume_a", "oom_resume_b"}, keep_contents);
    for (void* p : pending) f.alloc->free(p);  // deferred to the resume
    kept = keep_contents ? 1 : 0;
  }
  std::vector<void*> pending;
  std::size_t paused_bytes() const {
    std::size_t n = 0;
    for (const tag_usage& u : f.alloc->tag_stats(0))
      if (u.tag.rfind("oom_resume_", 0) == 0) n += u.paused ? u.paused_bytes : 0;
    return n;
  }
  std::size_t paused_tags() const { return f.alloc->paused_tags(0).size(); }
  void check_resumed_and_finish() {
    EXPECT_EQ(paused_tags(), 0u);
    if (kept != 0) {
      for (void* p : live) EXPECT_EQ(static_cast<const unsigned char*>(p)[(1 << 20) - 1], 0x5a);
    }
    for (void* p : live) f.alloc->free(p);
    f.alloc->empty_cache();
    const auto st = f.stats();
    EXPECT_EQ(st.at("allocated_bytes.all.current"), 0);
    EXPECT_EQ(st.at("reserved_bytes.all.current"), 0);
    EXPECT_EQ(f.sim->counters().mapped_bytes, 0u);
  }
};

void sweep_resume_without_host_memory(bool keep_contents) {
  two_paused_tags t(keep_contents);
  const std::size_t paused = t.paused_bytes();
  ASSERT_GT(paused, 0u);
  const std::size_t mapped_before = t.f.sim->counters().mapped_bytes;
  int failed = 0;
  bool resumed = false;
  for (long allowed = 0; allowed < 2000 && !resumed; ++allowed) {
    try {
      no_host_memory scope(allowed);
      t.f.alloc->resume({"oom_resume_a", "oom_resume_b"});
      resumed = true;
    } catch (const std::bad_alloc&) {
      ++failed;
    } catch (const out_of_memory_error&) {
      ++failed;
    }
    if (resumed) break;
    ASSERT_EQ(t.paused_tags(), 2u) << "host memory ran out after " << allowed << " allocations";
    ASSERT_EQ(t.paused_bytes(), paused) << "host memory ran out after " << allowed << " allocations";
    ASSERT_EQ(t.f.sim->counters().mapped_bytes, mapped_before)
        << "host memory ran out after " << allowed << " allocations";
  }
  EXPECT_TRUE(resumed);
  EXPECT_GE(failed, 10);
  t.check_resumed_and_finish();
}

TEST(HostOutOfMemory, AResumeThatFailsAnywhereLeavesTheTagsPausedAndCanBeRepeated) {
  sweep_resume_without_host_memory(true);
}

TEST(HostOutOfMemory, AResumeWithoutContentsThatFailsAnywhereCanBeRepeated) {
  sweep_resume_without_host_memory(false);
}

// The same with the device refusing the n-th page mapping of the resume.
TEST(HostOutOfMemory, AResumeWhoseMappingFailsAnywhereCanBeRepeated) {
  two_paused_tags t(true);
  const std::size_t paused = t.paused_bytes();
  const std::size_t mapped_before = t.f.sim->counters().mapped_bytes;
  bool resumed = false;
  int failed = 0;
  for (std::uint64_t n = 1; n < 200 && !resumed; ++n) {
    t.f.sim->fail_vm_map_after(n);
    try {
      t.f.alloc->resume({"oom_resume_a", "oom_resume_b"});
      resumed = true;
    } catch (const backend_error&) {
      ++failed;
    }
    t.f.sim->fail_vm_map_after(0);
    if (resumed) break;
    ASSERT_EQ(t.paused_tags(), 2u) << "mapping " << n << " failed";
    ASSERT_EQ(t.paused_bytes(), paused) << "mapping " << n << " failed";
    ASSERT_EQ(t.f.sim->counters().mapped_bytes, mapped_before) << "mapping " << n << " failed";
  }
  EXPECT_TRUE(resumed);
  EXPECT_EQ(static_cast<std::size_t>(failed) * (2u << 20), paused);  // one failure per page
  t.check_resumed_and_finish();
}

}  // namespace
