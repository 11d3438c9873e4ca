// Page fences (issue 15, SPEC P8): free pages of expandable segments change
// hands (another place, another stream) without synchronizing the device:
// once an event recorded on the stream that freed them has completed. On the
// simulated device, whose virtual clock runs the streams' work, and whose
// use_memory lets a test declare which work uses which bytes: an unmap
// before that work ends counts in sim_counters::unsafe_unmaps.
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/core/config.hpp>
#include <ccalloc/core/device_caching_allocator.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <string>

namespace {

using namespace ccalloc;  // NOLINT: test file

constexpr std::size_t MiB = mib;
constexpr std::int64_t I(std::size_t v) { return static_cast<std::int64_t>(v); }

// Two streams that both allocate, no cross-stream adoption: `s` keeps
// `keep` (2 MiB, the first page of its reservation), `other` holds `o` (2 MiB).
struct busy_stream_setup {
  stream_t s;
  stream_t other;
  void* o;
  void* keep;
};

class PageFenceTest : public ::testing::Test {
 protected:
  void make(std::size_t capacity = 256 * MiB, const std::string& conf = "") {
    alloc.reset();
    sim_options o;
    o.capacity_bytes = capacity;
    sim = std::make_shared<sim_backend>(o);
    alloc = std::make_unique<caching_allocator>(sim, allocator_config::parse(conf));
    alloc->init(1);
  }
  void SetUp() override { make(); }
  void TearDown() override {
    if (alloc) alloc->device_allocator(0).check_invariants();
    EXPECT_EQ(sim->counters().unsafe_unmaps, 0u) << "a page was unmapped while work could still use it";
    EXPECT_EQ(sim->counters().unsafe_reuses, 0u) << "a page was used by two streams' work at once";
  }
  device_stats st() { return alloc->get_device_stats(0); }
  // (AStreamThatKeepsABlock..., AnotherStreamsSlowPath...)
  busy_stream_setup busy_stream_and_other(const std::string& conf = "reuse_across_streams:False") {
    make(256 * MiB, conf);
    const stream_t s = sim->create_stream(0);
    const stream_t other = sim->create_stream(0);
    void* o = m(2 * MiB, other);  // both streams allocate
    return {s, other, o, m(2 * MiB, s)};
  }
  std::int64_t reserved() { return st().reserved_bytes[0].current; }
  void* m(std::size_t bytes, stream_t s = 0) { return alloc->malloc(0, bytes, s); }
  // A kernel on `s` uses p's bytes until virtual time `until`, then p is freed.
  void use_and_free(void* p, std::size_t bytes, stream_t s, std::uint64_t until) {
    sim->enqueue_work(0, s, until);
    sim->use_memory(0, p, bytes, s);
    alloc->free(p);
  }

  // Deferred unmaps: stream s allocates A (20 MiB), then B (3 MiB, after A:
  // A's run cannot simply grow), and frees A while its kernel uses A until
  // t=100. Returns s; B in `keep`.
  stream_t frees_behind_its_kernel(void*& keep) {
    make(256 * MiB, "reuse_across_streams:False");
    const stream_t s = sim->create_stream(0);
    void* a = m(20 * MiB, s);
    keep = m(3 * MiB, s);
    use_and_free(a, 20 * MiB, s, 100);
    return s;
  }

  // Stream t captures a graph into private pool `id`, known to the allocator
  // (t allocates during it: returned, 1 MiB); end_known_capture ends it.
  void* begin_known_capture(stream_t t, mempool_id_t id) {
    alloc->create_or_incref_pool(0, id);
    alloc->begin_allocate_to_pool(0, id, [t](stream_t x) { return x == t; });
    sim->begin_capture(0, t);
    return m(1 * MiB, t);
  }
  void end_known_capture(stream_t t, mempool_id_t id, void* q) {
    sim->end_capture(0, t);
    alloc->end_allocate_to_pool(0, id);
    alloc->free(q);
    alloc->release_pool(0, id);
  }

  std::shared_ptr<sim_backend> sim;
  std::unique_ptr<caching_allocator> alloc;
};

// (The recycling tests turn cross-stream reuse off: an idle stream's
// reservation would otherwise pass whole, with no page remapped.)
TEST_F(PageFenceTest, RecyclingForANewPeakNeverSynchronizes) {
  make(256 * MiB, "reuse_across_streams:False");
  const stream_t other = sim->create_stream(0);
  alloc->free(m(20 * MiB));      // stream 0's work is done (idle stream): its fence completes at once
  void* b = m(20 * MiB, other);  // would be a new peak: stream 0's 10 pages move
  EXPECT_EQ(reserved(), I(20 * MiB));
  EXPECT_EQ(st().num_device_synchronizations, 0);
  EXPECT_EQ(st().num_pages_remapped, 10);
  EXPECT_EQ(st().num_pages_unmapped, 10);
  EXPECT_EQ(st().num_pages_mapped, 20);  // 10 fresh, 10 remapped
  EXPECT_EQ(st().bytes_moved_between_streams, I(20 * MiB));
  EXPECT_EQ(sim->now(), 0u) << "the host never waited";
  alloc->free(b);
}

// (reuse_with_stream_wait:False: else `other` would take the pages behind a
// device-side wait, CrossStreamWaitTest.)
TEST_F(PageFenceTest, PagesStillInUseStayPutAndMoveOnceTheirFenceCompleted) {
  make(256 * MiB, "reuse_with_stream_wait:False");
  const stream_t other = sim->create_stream(0);
  use_and_free(m(20 * MiB), 20 * MiB, 0, 100);  // stream 0's kernel runs until t=100
  void* b = m(20 * MiB, other);
  EXPECT_EQ(st().num_pages_remapped, 0) << "stream 0 may still use its pages: they stay";
  EXPECT_EQ(st().num_device_synchronizations, 0) << "and nobody waits for them";
  EXPECT_EQ(reserved(), I(40 * MiB)) << "the peak rises instead";
  EXPECT_EQ(sim->now(), 0u);
  alloc->free(b);
  sim->advance_to(100);  // the kernel is done; the fence recorded at the failed attempt completes
  void* c = m(50 * MiB, other);  // 15 more pages, all past the 40 MiB mark
  EXPECT_EQ(st().num_device_synchronizations, 0);
  EXPECT_EQ(st().num_pages_remapped, 10) << "stream 0's 10 free pages, now safe, move";
  EXPECT_EQ(reserved(), I(50 * MiB)) << "the peak grew by 10 MiB, not 30";
  alloc->free(c);
}

TEST_F(PageFenceTest, UnderTheCapTheAllocatorWaitsForTheFenceAndCountsIt) {
  make(256 * MiB, "per_process_memory_fraction:0.125,reuse_with_stream_wait:False");  // 32 MiB
  const stream_t other = sim->create_stream(0);
  use_and_free(m(24 * MiB), 24 * MiB, 0, 100);
  void* b = m(24 * MiB, other);  // only stream 0's pages can make room under the cap
  EXPECT_LE(reserved(), I(32 * MiB));
  EXPECT_EQ(st().num_device_synchronizations, 1) << "one wait on stream 0's fence";
  EXPECT_GE(sim->now(), 100u) << "the host waited for the kernel";
  EXPECT_GT(st().num_pages_remapped, 0);
  alloc->free(b);
}

// With reuse_with_stream_wait the cap is kept without the host waiting:
// `other` waits on the device for stream 0's fence instead.
TEST_F(PageFenceTest, UnderTheCapADeviceSideWaitReplacesTheHostWait) {
  make(256 * MiB, "per_process_memory_fraction:0.125,reuse_with_stream_wait:True");  // 32 MiB
  const stream_t other = sim->create_stream(0);
  use_and_free(m(24 * MiB), 24 * MiB, 0, 100);
  void* b = m(24 * MiB, other);
  EXPECT_LE(reserved(), I(32 * MiB));
  EXPECT_EQ(st().num_device_synchronizations, 0) << "the host never waited";
  EXPECT_EQ(st().num_stream_waits, 1);
  EXPECT_EQ(sim->now(), 0u);
  EXPECT_GE(sim->busy_until(0, other), 100u) << "other's work on the pages runs after the kernel";
  EXPECT_EQ(st().num_pages_remapped, 12);
  alloc->free(b);
  sim->advance_to(100);
}

TEST_F(PageFenceTest, EmptyCacheWaitsForBusyPagesAndUnmapsEverything) {
  use_and_free(m(20 * MiB), 20 * MiB, 0, 50);
  alloc->empty_cache();
  EXPECT_EQ(reserved(), 0);
  EXPECT_GE(sim->now(), 50u);
  EXPECT_EQ(st().num_device_synchronizations, 1);
}

TEST_F(PageFenceTest, PagesOfAStreamThatNoLongerAllocatesFlowToNewStreams) {
  // A new side stream per step (prefetch_sidestreams): each step's stream
  // takes the pages the previous steps' streams left, the peak stays.
  std::int64_t peak_after_first = 0;
  for (int step = 0; step < 6; ++step) {
    const stream_t s = sim->create_stream(0);
    void* p = m(16 * MiB, s);
    use_and_free(p, 16 * MiB, s, sim->now() + 5);
    sim->advance_to(sim->now() + 10);
    if (step == 0) peak_after_first = st().reserved_bytes[0].peak;
  }
  EXPECT_EQ(st().reserved_bytes[0].peak, peak_after_first);
  EXPECT_EQ(st().num_device_synchronizations, 0);
  EXPECT_EQ(st().bytes_moved_between_streams, I(5 * 16 * MiB));
  EXPECT_EQ(st().num_pages_remapped, 0) << "each stream's reservation passes on whole: no page is remapped";
  EXPECT_EQ(st().num_pages_mapped, 8) << "the first stream's 8 pages, mapped once";
}

// ---- idle reservations pass whole to another stream (issue 15) ----

// The mapped bytes of `s`'s expandable segments (large and small pool).
std::size_t mapped_on(caching_allocator& a, stream_t s) {
  std::size_t n = 0;
  for (const auto& e : a.expandable_segment_sizes(0))
    if (e.stream == s) n += e.mapped_bytes;
  return n;
}

TEST_F(PageFenceTest, AnIdleStreamsReservationIsAdoptedWithItsPagesWhereTheyAre) {
  const stream_t other = sim->create_stream(0);
  alloc->free(m(20 * MiB));      // stream 0: nothing live, its fence completes at once
  void* b = m(20 * MiB, other);  // stream 0's whole reservation becomes other's
  EXPECT_EQ(st().num_pages_remapped, 0);
  EXPECT_EQ(st().num_pages_unmapped, 0);
  EXPECT_EQ(st().num_pages_mapped, 10) << "the 10 pages mapped for stream 0, none since";
  EXPECT_EQ(reserved(), I(20 * MiB));
  EXPECT_EQ(st().bytes_moved_between_streams, I(20 * MiB));
  EXPECT_EQ(st().num_device_synchronizations, 0);
  EXPECT_EQ(mapped_on(*alloc, other), 20 * MiB);
  EXPECT_EQ(mapped_on(*alloc, 0), 0u);
  void* c = m(4 * MiB);  // stream 0 allocates again: a reservation of its own
  EXPECT_EQ(reserved(), I(24 * MiB));
  EXPECT_EQ(st().num_pages_remapped, 0) << "other's reservation holds a live block: not idle, not recycled";
  for (void* p : {b, c}) alloc->free(p);
}

TEST_F(PageFenceTest, AReservationStillUsedByItsStreamIsNotAdopted) {
  make(256 * MiB, "reuse_with_stream_wait:False");  // else other takes the pages behind a device-side wait
  const stream_t other = sim->create_stream(0);
  const stream_t third = sim->create_stream(0);
  use_and_free(m(20 * MiB), 20 * MiB, 0, 100);  // stream 0's kernel uses the block until t=100
  void* b = m(20 * MiB, other);
  EXPECT_EQ(st().bytes_moved_between_streams, 0) << "stream 0's work may still touch its pages";
  EXPECT_EQ(reserved(), I(40 * MiB));
  alloc->free(b);
  sim->advance_to(100);
  void* c = m(20 * MiB, third);  // both reservations are idle now: one is adopted
  EXPECT_EQ(st().bytes_moved_between_streams, I(20 * MiB));
  EXPECT_EQ(st().num_pages_remapped, 0);
  EXPECT_EQ(reserved(), I(40 * MiB));
  EXPECT_EQ(mapped_on(*alloc, third), 20 * MiB);
  EXPECT_EQ(st().num_device_synchronizations, 0);
  alloc->free(c);
}

TEST_F(PageFenceTest, AReservationWithALiveBlockGivesPagesNotItself) {
  const stream_t other = sim->create_stream(0);
  void* keep = m(4 * MiB);  // stream 0 keeps a live block
  alloc->free(m(20 * MiB));
  void* b = m(20 * MiB, other);
  EXPECT_EQ(st().num_pages_remapped, 10) << "stream 0's 10 free pages are recycled one by one";
  EXPECT_EQ(reserved(), I(24 * MiB));
  EXPECT_EQ(mapped_on(*alloc, 0), 4 * MiB);
  for (void* p : {keep, b}) alloc->free(p);
}

TEST_F(PageFenceTest, SmallPoolReservationsAreAdoptedToo) {
  const stream_t other = sim->create_stream(0);
  alloc->free(m(512 * 1024));
  void* b = m(512 * 1024, other);
  EXPECT_EQ(st().num_pages_mapped, 1);
  EXPECT_EQ(st().num_pages_remapped, 0);
  EXPECT_EQ(reserved(), I(2 * MiB));
  EXPECT_EQ(mapped_on(*alloc, other), 2 * MiB);
  alloc->free(b);
}

TEST_F(PageFenceTest, WithoutCrossStreamReuseIdlePagesAreRecycledInstead) {
  make(256 * MiB, "reuse_across_streams:False");
  const stream_t other = sim->create_stream(0);
  alloc->free(m(20 * MiB));
  void* b = m(20 * MiB, other);
  EXPECT_EQ(st().num_pages_remapped, 10);
  EXPECT_EQ(reserved(), I(20 * MiB));
  EXPECT_EQ(mapped_on(*alloc, 0), 0u);
  alloc->free(b);
}

TEST_F(PageFenceTest, FencesRecordedOnTheSlowPathLetPagesMoveWhileTheStreamKeepsRunning) {
  // A device that runs behind the host: stream 0 always has work queued. A
  // fence recorded only when its pages are wanted would cover all of it; the
  // one recorded on an earlier slow path covers just the work before the free.
  make(256 * MiB, "reuse_across_streams:False");
  const stream_t other = sim->create_stream(0);
  alloc->free(m(60 * MiB));
  alloc->empty_cache();  // high-water mark 60 MiB, nothing reserved
  use_and_free(m(20 * MiB), 20 * MiB, 0, 10);  // stream 0's kernel uses it until t=10
  void* b = m(10 * MiB, other);  // slow path below the mark: fences stream 0's free
  sim->enqueue_work(0, 0, 100);  // stream 0 keeps running until t=100
  sim->advance_to(20);
  void* c = m(40 * MiB, other);  // 10 MiB past the mark
  EXPECT_EQ(st().num_pages_remapped, 5) << "stream 0's pages, safe since t=10, cover the excess";
  EXPECT_EQ(reserved(), I(60 * MiB));
  EXPECT_EQ(st().num_device_synchronizations, 0);
  EXPECT_EQ(sim->now(), 20u);
  alloc->free(b);
  alloc->free(c);
}

TEST_F(PageFenceTest, RecyclesPerPeakLimitsRemappingAtOneMark) {
  make(256 * MiB, "recycles_per_peak:1,reuse_across_streams:False");
  const stream_t other = sim->create_stream(0);
  alloc->free(m(20 * MiB));
  void* b = m(20 * MiB, other);  // the one recycling allowed at the 20 MiB mark
  EXPECT_EQ(st().num_pages_remapped, 10);
  alloc->free(b);
  void* c = m(4 * MiB);  // stream 0 has no page left and no recycling is left: the mark rises
  EXPECT_EQ(st().num_pages_remapped, 10);
  EXPECT_EQ(reserved(), I(24 * MiB));
  EXPECT_EQ(st().num_device_synchronizations, 0);
  alloc->free(c);
}

TEST_F(PageFenceTest, UnlimitedIsTheDefaultAndRoundTrips) {
  EXPECT_EQ(alloc->config().recycles_per_peak, std::numeric_limits<std::size_t>::max());
  EXPECT_EQ(allocator_config::parse("recycles_per_peak:unlimited").recycles_per_peak,
            std::numeric_limits<std::size_t>::max());
  const auto four = allocator_config::parse("recycles_per_peak:4");
  EXPECT_EQ(allocator_config::parse(four.to_string()), four);
  EXPECT_EQ(allocator_config::parse(allocator_config{}.to_string()), allocator_config{});
}

}  // namespace

namespace {

// A stream whose blocks are all freed may be destroyed at once (legal in
// CUDA: the frees are stream-ordered). The allocator must never record on it
// afterwards: the simulated device rejects a destroyed handle, and on an
// H200 such a record crashed (GPU test threads_streams). The last free of
// the stream's segment records its page fence while the stream exists, so
// its pages still pass to other streams without any wait.
TEST_F(PageFenceTest, AStreamDestroyedAfterItsFreesIsNeverRecordedOnAndItsPagesStillMove) {
  make(256 * MiB, "reuse_across_streams:False");
  const stream_t gone = sim->create_stream(0);
  const stream_t other = sim->create_stream(0);
  void* p = m(20 * MiB, gone);
  void* q = m(4 * MiB, gone);
  use_and_free(p, 20 * MiB, gone, 10);  // the kernel using p runs until t=10
  alloc->free(q);                       // the segment's last busy block: fenced now
  sim->destroy_stream(0, gone);
  sim->advance_to(20);
  void* b = nullptr;
  ASSERT_NO_THROW(b = m(24 * MiB, other)) << "a slow path recorded on the destroyed stream";
  EXPECT_EQ(st().num_device_synchronizations, 0);
  EXPECT_EQ(st().num_pages_remapped, 12) << "the destroyed stream's 12 free pages, fenced at its last free, move";
  EXPECT_EQ(reserved(), I(24 * MiB));
  alloc->free(b);
}

// A stream that keeps a block (weights, a cache) and frees others: each
// free that spans a page records a page fence on the stream itself (no
// other stream's slow path may record on it: it may be gone), while none of
// its fences is outstanding. Its freed pages then pass to another stream,
// without any wait, once the stream's work before the free has completed;
// before that they stay. (Before: only a segment's last busy block was
// fenced at its free, so on the H200 such a stream gave no page away and
// the other stream grew: GPU test expandable_recycling_time_budget.)
TEST_F(PageFenceTest, AStreamThatKeepsABlockFencesItsFreesOfWholePagesAndTheyMove) {
  // (Without reuse_with_stream_wait: with it, other takes the pages at once
  // behind a device-side wait, CrossStreamWaitTest.)
  const auto [s, other, o, keep] = busy_stream_and_other("reuse_across_streams:False,reuse_with_stream_wait:False");
  use_and_free(m(20 * MiB, s), 20 * MiB, s, 10);  // s's kernel uses the block until t=10; s keeps `keep`
  void* b = m(20 * MiB, other);
  EXPECT_EQ(st().num_pages_remapped, 0) << "s's work before the free has not completed: its pages stay";
  EXPECT_EQ(reserved(), I(44 * MiB));
  alloc->free(b);
  sim->advance_to(10);           // the fence recorded at the free completes
  void* c = m(40 * MiB, other);  // 10 pages past the 44 MiB mark
  EXPECT_EQ(st().num_pages_remapped, 10) << "s's 10 free pages move: no slow path of s in between";
  EXPECT_EQ(reserved(), I(44 * MiB));
  EXPECT_EQ(mapped_on(*alloc, s), 2 * MiB);
  EXPECT_EQ(st().num_device_synchronizations, 0);
  EXPECT_EQ(sim->now(), 10u) << "the host never waited";
  for (void* p : {o, keep, c}) alloc->free(p);
}

// Frees of less than a page on such a stream are not fenced (most free no
// whole page), even when together they leave pages whole; another stream's
// slow path never records on the stream (it may be gone), so those pages
// stay with it until a fence of its own covers them (its next free of a
// page or more, its own slow path).
TEST_F(PageFenceTest, AnotherStreamsSlowPathNeverRecordsOnABusyStream) {
  const auto [s, other, o, keep] = busy_stream_and_other();
  void* parts[4];
  for (void*& p : parts) p = m(3 * MiB / 2, s);  // [2, 8) MiB of s's reservation: 3 pages
  EXPECT_EQ(reserved(), I(10 * MiB));
  for (void* p : parts) alloc->free(p);  // 3 whole pages free on s, from frees of less than a page
  void* b = m(6 * MiB, other);           // 3 pages past the 10 MiB mark
  EXPECT_EQ(st().num_pages_remapped, 0) << "no fence of s covers the frees: their pages stay";
  EXPECT_EQ(reserved(), I(16 * MiB));
  EXPECT_EQ(mapped_on(*alloc, s), 8 * MiB);
  EXPECT_EQ(st().num_device_synchronizations, 0);
  for (void* p : {o, keep, b}) alloc->free(p);
}

}  // namespace

// ---- deferred unmaps (issue 15): pages of the same stream move before its work has run ----

// Stream s frees A (20 MiB) while its kernel still uses A until t=100, then
// asks for more than the peak allows: a GPU that runs behind the host, the
// usual case. The same stream runs the new request's work after the kernel,
// so A's 10 pages are mapped where the request needs them at once; their old
// addresses stay mapped until the kernel is done (never unmapped under it:
// unsafe_unmaps stays 0), and nothing waits.
TEST_F(PageFenceTest, PagesOfTheSameStreamMoveAtOnceAndTheirOldMappingGoesAfterTheWork) {
  void* keep = nullptr;
  const stream_t s = frees_behind_its_kernel(keep);
  EXPECT_EQ(reserved(), I(24 * MiB));
  void* c = m(30 * MiB, s);
  EXPECT_EQ(st().num_device_synchronizations, 0) << "nobody waits for the kernel";
  EXPECT_EQ(st().num_pages_remapped, 10) << "A's pages moved although its kernel still runs";
  EXPECT_EQ(reserved(), I(34 * MiB)) << "B's 2 pages + 30 MiB, 10 pages of them A's";
  EXPECT_EQ(sim->now(), 0u);
  EXPECT_EQ(sim->counters().mapped_bytes, 54 * MiB) << "A's 10 pages are mapped twice while the kernel runs";
  EXPECT_EQ(sim->counters().handle_bytes, 34 * MiB) << "but held once";
  alloc->device_allocator(0).check_invariants();
  sim->advance_to(100);   // the kernel is done
  alloc->free(m(40 * MiB, s));  // a slow path: the deferred unmaps whose fence completed happen
  EXPECT_EQ(st().num_device_synchronizations, 0);
  EXPECT_EQ(sim->counters().mapped_bytes, sim->counters().handle_bytes) << "every page mapped once again";
  alloc->free(c);
  alloc->free(keep);
  alloc->empty_cache();
  EXPECT_EQ(sim->counters().mapped_bytes, 0u);
  EXPECT_EQ(sim->counters().live_handles, 0u);
}

// Another stream's pages still wait for their fence: s2's request does not
// take the pages s freed under its running kernel (the peak rises).
TEST_F(PageFenceTest, PagesOfAnotherStreamDoNotMoveBeforeTheirWork) {
  void* keep = nullptr;
  frees_behind_its_kernel(keep);
  const stream_t s2 = sim->create_stream(0);
  void* c = m(30 * MiB, s2);
  EXPECT_EQ(st().num_pages_remapped, 0);
  EXPECT_EQ(st().num_device_synchronizations, 0);
  EXPECT_EQ(reserved(), I(54 * MiB));
  EXPECT_EQ(sim->counters().mapped_bytes, 54 * MiB);
  alloc->free(c);
  alloc->free(keep);
}

// emptyCache with a deferred unmap pending waits for the kernel (counted),
// then gives everything back; the moved pages stay where they went.
TEST_F(PageFenceTest, EmptyCacheWaitsForDeferredUnmaps) {
  void* keep = nullptr;
  const stream_t s = frees_behind_its_kernel(keep);
  void* c = m(30 * MiB, s);
  ASSERT_EQ(st().num_pages_remapped, 10);
  alloc->empty_cache();
  EXPECT_EQ(st().num_device_synchronizations, 1) << "one wait, for the deferred unmaps";
  EXPECT_GE(sim->now(), 100u);
  EXPECT_EQ(reserved(), I(34 * MiB)) << "B and C live";
  EXPECT_EQ(sim->counters().mapped_bytes, 34 * MiB);
  alloc->free(c);
  alloc->free(keep);
  alloc->empty_cache();
  EXPECT_EQ(sim->counters().live_handles, 0u);
}

// A page that moves twice before the work on it has run is retired at two
// places; emptyCache waits once, unmaps both, and releases each handle once
// (the simulated device refuses to release a handle still mapped).
TEST_F(PageFenceTest, APageMovedTwiceIsUnmappedAtBothPlacesAndReleasedOnce) {
  void* keep = nullptr;
  const stream_t s = frees_behind_its_kernel(keep);
  void* c = m(30 * MiB, s);  // takes A's 10 pages (retired at A's place)
  void* keep2 = m(3 * MiB, s);  // after C: C's run cannot simply grow
  use_and_free(c, 30 * MiB, s, 200);
  void* d = m(50 * MiB, s);  // takes C's pages, some of them A's too
  EXPECT_EQ(st().num_device_synchronizations, 0);
  EXPECT_GT(st().num_pages_remapped, 10);
  alloc->device_allocator(0).check_invariants();
  EXPECT_EQ(static_cast<std::size_t>(reserved()), sim->counters().handle_bytes) << "every page held counts once";
  alloc->free(d);
  alloc->free(keep);
  alloc->free(keep2);
  alloc->empty_cache();
  EXPECT_EQ(st().num_device_synchronizations, 1) << "one wait, for the deferred unmaps";
  EXPECT_GE(sim->now(), 200u);
  EXPECT_EQ(reserved(), 0);
  EXPECT_EQ(sim->counters().live_handles, 0u);
  EXPECT_EQ(sim->counters().mapped_bytes, 0u);
}

// While a graph is captured no event may be queried or waited for: a malloc
// whose only room lies over a retired page fails (out of memory) instead of
// waiting for the deferred unmap, and succeeds once the capture is over.
// (Breaker finding, 2026-12-02: it queried the fence and broke the capture.)
TEST_F(PageFenceTest, NoDeferredUnmapIsWaitedForDuringACapture) {
  void* keep = nullptr;
  const stream_t s = frees_behind_its_kernel(keep);
  void* c = m(30 * MiB, s);      // A's 10 pages move: retired at A's place
  void* e = m(202 * MiB, s);     // the rest of the device: only the retired run is left
  const stream_t t = sim->create_stream(0);
  const mempool_id_t id{0, 9};
  void* q = begin_known_capture(t, id);
  EXPECT_THROW(m(16 * MiB, s), out_of_memory_error);
  EXPECT_EQ(sim->now(), 0u) << "nothing waited";
  EXPECT_EQ(st().num_device_synchronizations, 0);
  alloc->device_allocator(0).check_invariants();
  end_known_capture(t, id, q);
  void* d = m(16 * MiB, s);  // now the deferred unmap may wait
  EXPECT_EQ(st().num_device_synchronizations, 1);
  for (void* p : {d, c, e, keep}) alloc->free(p);
}

// ---- cross-stream reuse behind a device-side wait (issue 15, reuse_with_stream_wait) ----

class CrossStreamWaitTest : public PageFenceTest {
 protected:
  // As busy_stream_and_other, with `conf` added; then s frees 20 MiB behind
  // its kernel (until t=100). Returns the streams and blocks.
  busy_stream_setup frees_beside_another_stream(const std::string& conf = "") {
    const busy_stream_setup b = two_allocating_streams(conf);
    use_and_free(m(20 * MiB, b.s), 20 * MiB, b.s, 100);
    return b;
  }
  // Streams s and other both allocate (s then fences its frees of a page
  // or more): other holds o, s keeps `keep` (2 MiB each).
  busy_stream_setup two_allocating_streams(const std::string& conf = "") {
    make(256 * MiB, "reuse_across_streams:False,reuse_with_stream_wait:True" + (conf.empty() ? "" : "," + conf));
    const stream_t s = sim->create_stream(0);
    const stream_t other = sim->create_stream(0);
    void* o = m(2 * MiB, other);
    return {s, other, o, m(2 * MiB, s)};
  }
};

// The pages of s's free block go to `other` at once: `other` waits on the
// device for s's fence (its later work starts at t=100 at the earliest),
// the host never waits, and the old mapping stays until the kernel is done
// (unsafe_unmaps stays 0, checked at TearDown).
TEST_F(CrossStreamWaitTest, AnotherStreamsPagesMoveBehindADeviceSideWait) {
  const auto [s, other, o, keep] = frees_beside_another_stream();
  EXPECT_EQ(reserved(), I(24 * MiB));
  void* c = m(20 * MiB, other);
  EXPECT_EQ(st().num_stream_waits, 1) << "one device-side wait for s's fence";
  EXPECT_EQ(sim->counters().stream_waits, 1u);
  EXPECT_EQ(st().num_pages_remapped, 10) << "s's 10 free pages moved although its kernel still runs";
  EXPECT_EQ(st().bytes_moved_between_streams, I(20 * MiB));
  EXPECT_EQ(reserved(), I(24 * MiB)) << "no new peak";
  EXPECT_EQ(st().num_device_synchronizations, 0);
  EXPECT_EQ(sim->now(), 0u) << "the host never waited";
  EXPECT_GE(sim->busy_until(0, other), 100u) << "other's work on the pages runs after s's kernel";
  EXPECT_EQ(sim->counters().mapped_bytes, 44 * MiB) << "s's 10 pages stay mapped at their old place meanwhile";
  EXPECT_EQ(sim->counters().handle_bytes, 24 * MiB) << "but are held once";
  // Data: other's block shows what is written through it (the pages are
  // the same physical memory at both places).
  std::memset(c, 0x5a, 20 * MiB);
  EXPECT_EQ(static_cast<unsigned char*>(c)[20 * MiB - 1], 0x5a);
  alloc->device_allocator(0).check_invariants();
  sim->advance_to(100);        // the kernel is done
  alloc->free(m(40 * MiB, s));  // a slow path: the deferred unmaps whose fence completed happen
  EXPECT_EQ(sim->counters().mapped_bytes, sim->counters().handle_bytes) << "every page mapped once again";
  EXPECT_EQ(st().num_device_synchronizations, 0);
  for (void* p : {o, keep, c}) alloc->free(p);
  alloc->empty_cache();
  EXPECT_EQ(sim->counters().live_handles, 0u);
}

// reuse_with_stream_wait:False: the old rule, the pages wait for their fence.
TEST_F(CrossStreamWaitTest, OffThePagesStayUntilTheirFenceCompletes) {
  const auto [s, other, o, keep] = frees_beside_another_stream("reuse_with_stream_wait:False");
  void* c = m(20 * MiB, other);
  EXPECT_EQ(st().num_stream_waits, 0);
  EXPECT_EQ(sim->counters().stream_waits, 0u);
  EXPECT_EQ(st().num_pages_remapped, 0);
  EXPECT_EQ(reserved(), I(44 * MiB)) << "the peak rises instead";
  EXPECT_EQ(sim->busy_until(0, other), 0u);
  for (void* p : {o, keep, c}) alloc->free(p);
}

// Pages whose fence has completed come first, then a wait: stream u's free
// pages (u is idle: its fence has completed) serve other's first request
// without a wait; the second takes s's pages behind one.
TEST_F(CrossStreamWaitTest, CompletedPagesComeBeforeAWait) {
  const auto [s, other, o, keep] = two_allocating_streams();
  const stream_t u = sim->create_stream(0);
  void* pu = m(20 * MiB, u);
  void* ps = m(20 * MiB, s);
  EXPECT_EQ(reserved(), I(44 * MiB));
  alloc->free(pu);
  use_and_free(ps, 20 * MiB, s, 100);
  void* c = m(20 * MiB, other);
  EXPECT_EQ(st().num_stream_waits, 0) << "u's free pages needed no wait and were enough";
  EXPECT_EQ(st().num_pages_remapped, 10);
  EXPECT_EQ(sim->busy_until(0, other), 0u);
  void* d = m(20 * MiB, other);
  EXPECT_EQ(st().num_stream_waits, 1) << "then s's pages, behind a wait";
  EXPECT_EQ(st().num_pages_remapped, 20);
  EXPECT_EQ(reserved(), I(44 * MiB));
  EXPECT_GE(sim->busy_until(0, other), 100u);
  EXPECT_EQ(st().num_device_synchronizations, 0);
  sim->advance_to(100);
  for (void* p : {o, keep, c, d}) alloc->free(p);
}

// While a graph is captured nothing waits and no page of a busy stream moves.
TEST_F(CrossStreamWaitTest, NoWaitDuringACapture) {
  const auto [s, other, o, keep] = frees_beside_another_stream();
  const stream_t t = sim->create_stream(0);
  const mempool_id_t id{0, 9};
  void* q = begin_known_capture(t, id);
  void* c = m(20 * MiB, other);
  EXPECT_EQ(st().num_stream_waits, 0);
  EXPECT_EQ(sim->counters().stream_waits, 0u);
  EXPECT_EQ(sim->busy_until(0, other), 0u);
  EXPECT_EQ(st().num_device_synchronizations, 0);
  end_known_capture(t, id, q);
  for (void* p : {o, keep, c}) alloc->free(p);
}

// A private pool's free block (a graph may use it on any stream) never
// gives its pages behind a wait.
TEST_F(CrossStreamWaitTest, NoWaitForAPrivatePoolsBlocks) {
  const auto [s, other, o, keep] = two_allocating_streams();
  const mempool_id_t id{0, 7};
  alloc->create_or_incref_pool(0, id);
  alloc->begin_allocate_to_pool(0, id, [s](stream_t x) { return x == s; });
  void* p = m(20 * MiB, s);  // in the private pool
  void* pkeep = m(2 * MiB, s);
  alloc->end_allocate_to_pool(0, id);
  use_and_free(p, 20 * MiB, s, 100);
  void* c = m(20 * MiB, other);
  EXPECT_EQ(st().num_stream_waits, 0);
  EXPECT_EQ(sim->counters().stream_waits, 0u);
  EXPECT_EQ(sim->busy_until(0, other), 0u);
  EXPECT_EQ(st().num_device_synchronizations, 0);
  sim->advance_to(100);
  for (void* x : {o, keep, c, pkeep}) alloc->free(x);
  alloc->release_pool(0, id);
}

// Garbage collection (rung 2) unmaps the pages that `other` took behind a
// wait while their old mapping in s's segment is still retired: their
// release waits for that deferred unmap. The waits the collection made
// (for other's fence, recorded after other waited for s's) completed s's
// fence too, so the deferred unmaps are done before the malloc returns:
// reserved memory equals the snapshot's mapped bytes and the device's.
// (Before: 40 MiB reserved, 20 MiB in the snapshot, until the next slow path.)
TEST_F(CrossStreamWaitTest, GarbageCollectionSettlesTheRetiredPagesItReleases) {
  const auto [s, other, o, keep] = frees_beside_another_stream(
      "garbage_collection_threshold:0.5,per_process_memory_fraction:0.234375");  // collects above 30 MiB
  const stream_t u = sim->create_stream(0);
  void* c = m(20 * MiB, other);  // s's pages, behind a wait
  EXPECT_EQ(st().num_stream_waits, 1);
  void* d = m(10 * MiB, u);  // 34 MiB reserved
  use_and_free(c, 20 * MiB, other, 110);
  void* e = m(6 * MiB, s);  // a slow path above the threshold: collects c's pages
  EXPECT_EQ(sim->now(), 110u) << "the collection waited for other's fence";
  std::size_t in_snapshot = 0;
  for (const auto& seg : alloc->snapshot(false).segments) in_snapshot += seg.mapped_bytes;
  EXPECT_EQ(reserved(), I(in_snapshot));
  EXPECT_EQ(reserved(), I(sim->counters().handle_bytes));
  EXPECT_EQ(sim->counters().mapped_bytes, sim->counters().handle_bytes) << "no page left mapped at its old place";
  for (void* p : {o, keep, d, e}) alloc->free(p);
}

// Without a fence covering the free (the stream recorded none, and another
// stream's slow path never records on it), nothing waits: the pages stay.
TEST_F(CrossStreamWaitTest, NoFenceNoWait) {
  make(256 * MiB, "reuse_across_streams:False,reuse_with_stream_wait:True");
  const stream_t s = sim->create_stream(0);
  const stream_t other = sim->create_stream(0);
  void* keep = m(2 * MiB, s);
  use_and_free(m(20 * MiB, s), 20 * MiB, s, 100);  // only s allocates so far: its free records no fence
  void* c = m(20 * MiB, other);
  EXPECT_EQ(st().num_stream_waits, 0);
  EXPECT_EQ(st().num_pages_remapped, 0);
  EXPECT_EQ(reserved(), I(42 * MiB));
  for (void* x : {keep, c}) alloc->free(x);
}

// A device-side wait that the backend refuses (cudaStreamWaitEvent fails)
// fails the malloc with that backend_error and changes nothing: the
// statistics, the reservation, the device's mappings and every block are
// as before, and the same malloc succeeds once the backend accepts the wait.
TEST_F(CrossStreamWaitTest, ARefusedWaitFailsTheMallocAndChangesNothing) {
  const auto [s, other, o, keep] = frees_beside_another_stream();
  const device_stats before = st();
  const auto mapped_before = sim->counters().mapped_bytes;
  const auto segments_before = alloc->device_allocator(0).segments();
  sim->fail_stream_wait_after(1);
  try {
    (void)m(20 * MiB, other);
    FAIL() << "the malloc succeeded although its device-side wait failed";
  } catch (const backend_error& e) {
    EXPECT_NE(std::string(e.what()).find("stream_wait_event"), std::string::npos) << e.what();
  }
  alloc->device_allocator(0).check_invariants();
  const device_stats after = st();
  EXPECT_EQ(after.allocation[0].current, before.allocation[0].current);
  EXPECT_EQ(after.allocation[0].allocated, before.allocation[0].allocated);
  EXPECT_EQ(after.reserved_bytes[0].current, before.reserved_bytes[0].current);
  EXPECT_EQ(after.inactive_split_bytes[0].current, before.inactive_split_bytes[0].current);
  EXPECT_EQ(after.num_stream_waits, 0);
  EXPECT_EQ(after.num_pages_remapped, before.num_pages_remapped);
  EXPECT_EQ(sim->counters().mapped_bytes, mapped_before) << "no page moved";
  const auto segments_after = alloc->device_allocator(0).segments();
  ASSERT_EQ(segments_after.size(), segments_before.size());
  for (std::size_t i = 0; i < segments_before.size(); ++i) {
    EXPECT_EQ(segments_after[i].address, segments_before[i].address);
    EXPECT_EQ(segments_after[i].total_bytes, segments_before[i].total_bytes);
    EXPECT_EQ(segments_after[i].blocks.size(), segments_before[i].blocks.size()) << "segment " << i;
  }
  // The backend accepts the wait again: the same request is served as it
  // would have been, behind one wait, without a new peak.
  void* c = m(20 * MiB, other);
  EXPECT_EQ(st().num_stream_waits, 1);
  EXPECT_EQ(reserved(), I(24 * MiB));
  EXPECT_EQ(st().num_device_synchronizations, 0);
  alloc->device_allocator(0).check_invariants();
  for (void* p : {o, keep, c}) alloc->free(p);
  alloc->empty_cache();
  EXPECT_EQ(sim->counters().live_handles, 0u);
}
