// Expandable segments (SPEC B7, F19, F26, X3), cross-stream reuse (X2) and
// the OOM path's wait for pending events (X7), on the simulated device, whose
// reservations and page mappings are real host mappings.
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/core/config.hpp>
#include <ccalloc/core/device_caching_allocator.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace {

using namespace ccalloc;  // NOLINT: test file

constexpr std::size_t MiB = mib;
constexpr std::size_t page = 2 * MiB;
constexpr std::int64_t I(std::size_t v) { return static_cast<std::int64_t>(v); }
std::uintptr_t U(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

class ExpandableTest : public ::testing::Test {
 protected:
  void make(std::size_t capacity = 256 * MiB, const std::string& conf = "", int devices = 1,
            sim_options::host_clock clock = sim_options::host_clock::none) {
    alloc.reset();
    sim_options o;
    o.capacity_bytes = capacity;
    o.device_count = devices;
    o.host_clock_mode = clock;
    sim = std::make_shared<sim_backend>(o);
    alloc = std::make_unique<caching_allocator>(sim, allocator_config::parse(conf));
    alloc->init(devices);
  }
  void SetUp() override { make(); }
  void TearDown() override {
    if (alloc)
      for (int d = 0; d < sim->device_count(); ++d) alloc->device_allocator(d).check_invariants();
  }
  device_caching_allocator& dev(int d = 0) { return alloc->device_allocator(d); }
  device_stats st(int d = 0) { return alloc->get_device_stats(d); }
  std::int64_t reserved(int d = 0) { return st(d).reserved_bytes[0].current; }
  void* m(std::size_t bytes, stream_t s = 0, int d = 0) { return alloc->malloc(d, bytes, s); }

  std::shared_ptr<sim_backend> sim;
  std::unique_ptr<caching_allocator> alloc;
};

TEST_F(ExpandableTest, IsTheDefaultAndGrowsByMappingPages) {
  EXPECT_TRUE(alloc->config().expandable_segments);
  void* a = m(5 * MiB);
  EXPECT_EQ(reserved(), I(6 * MiB)) << "5 MiB needs 3 pages";
  EXPECT_EQ(sim->counters().mapped_bytes, 6 * MiB);
  void* b = m(5 * MiB);
  EXPECT_EQ(U(b), U(a) + 5 * MiB) << "packed right after the first block";
  EXPECT_EQ(reserved(), I(10 * MiB)) << "the shared page is not mapped twice";
  const auto segs = alloc->expandable_segment_sizes(0);
  ASSERT_EQ(segs.size(), 1u);
  EXPECT_EQ(segs[0].mapped_bytes, 10 * MiB);
  EXPECT_FALSE(segs[0].is_small_pool);
  EXPECT_GE(segs[0].reserved_address_bytes, 256 * MiB) << "the reservation spans the device";
  EXPECT_EQ(st().segment[0].current, 1);
  EXPECT_EQ(st().num_device_alloc, 5) << "one physical page each";
  // The memory is real: write both blocks through and read them back.
  std::memset(a, 0xab, 5 * MiB);
  std::memset(b, 0xcd, 5 * MiB);
  EXPECT_EQ(static_cast<unsigned char*>(a)[5 * MiB - 1], 0xab);
  EXPECT_EQ(static_cast<unsigned char*>(b)[0], 0xcd);
  const auto [base, size] = alloc->get_base_allocation(b);
  EXPECT_EQ(U(base), segs[0].address);
  EXPECT_EQ(size, segs[0].reserved_address_bytes);
  alloc->free(a);
  alloc->free(b);
}

TEST_F(ExpandableTest, SmallPoolPacksIntoPagesToo) {
  std::vector<void*> blocks;
  for (int i = 0; i < 8; ++i) blocks.push_back(m(512 * 1024));
  EXPECT_EQ(reserved(), I(4 * MiB));
  const auto segs = alloc->expandable_segment_sizes(0);
  ASSERT_EQ(segs.size(), 1u);
  EXPECT_TRUE(segs[0].is_small_pool);
  for (void* p : blocks) alloc->free(p);
}

TEST_F(ExpandableTest, EmptyCacheUnmapsEveryFreePageAndReleasesTheReservation) {
  void* a = m(9 * MiB);
  void* b = m(1536 * 1024);
  alloc->free(a);
  alloc->free(b);
  EXPECT_EQ(reserved(), I(10 * MiB) + I(2 * MiB)) << "cached, still mapped";
  const std::size_t free_before = sim->mem_get_info(0).free_bytes;
  alloc->empty_cache();
  EXPECT_EQ(reserved(), 0);
  EXPECT_EQ(sim->mem_get_info(0).free_bytes, free_before + 12 * MiB) << "the device got its memory back";
  const auto c = sim->counters();
  EXPECT_EQ(c.mapped_bytes, 0u);
  EXPECT_EQ(c.live_handles, 0u);
  EXPECT_EQ(c.live_reservations, 0u);
  EXPECT_TRUE(alloc->expandable_segment_sizes(0).empty());
  EXPECT_EQ(st().segment[0].current, 0);
  EXPECT_EQ(st().num_device_free, 6);
}

TEST_F(ExpandableTest, EmptyCacheNeverTouchesLiveBlocks) {
  void* a = m(3 * MiB);
  void* b = m(8 * MiB);
  void* c = m(3 * MiB);
  std::memset(a, 1, 3 * MiB);
  std::memset(c, 3, 3 * MiB);
  alloc->free(b);  // a hole with 3 whole pages inside it (3..11 MiB -> pages 4..10 MiB)
  alloc->empty_cache();
  EXPECT_EQ(reserved(), I(14 * MiB - 3 * page)) << "only the hole's whole pages go";
  EXPECT_EQ(static_cast<unsigned char*>(a)[3 * MiB - 1], 1);
  EXPECT_EQ(static_cast<unsigned char*>(c)[0], 3);
  void* d = m(8 * MiB);  // the hole is remapped and reused
  EXPECT_EQ(d, b);
  EXPECT_EQ(reserved(), I(14 * MiB));
  for (void* p : {a, c, d}) alloc->free(p);
}

TEST_F(ExpandableTest, FreePagesOfAnotherStreamAreRecycledInsteadOfGrowing) {
  make(256 * MiB, "reuse_across_streams:False");  // else stream 0's idle reservation passes whole
  const stream_t other = sim->create_stream(0);
  void* a = m(20 * MiB);
  alloc->free(a);  // cached on stream 0; high-water 20 MiB
  const auto creates = sim->counters().vm_creates;
  void* b = m(20 * MiB, other);
  EXPECT_EQ(reserved(), I(20 * MiB)) << "X3: the free pages move to the other stream's segment";
  EXPECT_EQ(st().reserved_bytes[0].peak, I(20 * MiB));
  EXPECT_EQ(sim->counters().vm_creates, creates) << "no new physical memory";
  EXPECT_EQ(alloc->expandable_segment_sizes(0).size(), 2u) << "one reservation per stream";
  std::memset(b, 7, 20 * MiB);
  alloc->free(b);
}

// X3, issue 15: recycling takes first the free blocks whose unmapping leaves
// nothing behind in partial pages. Unmapping the whole page of b (its two
// ends share pages with a and c) would strand two 1 MiB pieces too small for
// stream 0's next requests; d lies on page boundaries and goes instead, and
// stream 0 goes on without a new page.
TEST_F(ExpandableTest, RecyclingTakesFirstTheFreeBlocksThatLeaveNoPartialPagesBehind) {
  make(256 * MiB, "reuse_across_streams:False");  // page by page, no idle reservation moves
  const stream_t other = sim->create_stream(0);
  void* a = m(3 * MiB);  // [0, 3) MiB
  void* b = m(4 * MiB);  // [3, 7): one whole page, 1 MiB of a page at each end
  void* c = m(3 * MiB);  // [7, 10)
  void* d = m(4 * MiB);  // [10, 14): two whole pages
  void* e = m(2 * MiB);  // [14, 16)
  ASSERT_EQ(U(b), U(a) + 3 * MiB);
  ASSERT_EQ(U(d), U(a) + 10 * MiB);
  ASSERT_EQ(reserved(), I(16 * MiB));
  alloc->free(b);  // the lower offset: recycled first before, by address
  alloc->free(d);
  void* f = m(2 * MiB, other);  // one page past the mark: recycled
  EXPECT_EQ(st().num_pages_remapped, 1);
  EXPECT_EQ(reserved(), I(16 * MiB));
  EXPECT_EQ(sim->counters().mapped_bytes, 16 * MiB);
  const auto mapped = st().num_pages_mapped;
  void* x = m(4 * MiB);  // b is still whole
  EXPECT_EQ(x, b);
  void* y = m(2 * MiB);  // the rest of d
  EXPECT_EQ(U(y), U(a) + 12 * MiB);
  EXPECT_EQ(st().num_pages_mapped, mapped) << "nothing mapped: no piece of a page was stranded";
  EXPECT_EQ(st().reserved_bytes[0].peak, I(16 * MiB));
  EXPECT_EQ(st().num_device_synchronizations, 0);
  for (void* p : {a, c, e, f, x, y}) alloc->free(p);
}

// Among free blocks that leave no piece of a page behind, the smallest is
// recycled first: the large free run stays whole for a large request (by
// address, the run below would have lost a page and needed one mapped again).
TEST_F(ExpandableTest, RecyclingTakesTheSmallestOfTheFreeBlocksThatLeaveNoPartialPages) {
  make(256 * MiB, "reuse_across_streams:False");  // page by page, no idle reservation moves
  const stream_t other = sim->create_stream(0);
  void* a = m(2 * MiB);  // [0, 2) MiB
  void* b = m(6 * MiB);  // [2, 8): three whole pages
  void* c = m(2 * MiB);  // [8, 10)
  void* d = m(2 * MiB);  // [10, 12): one whole page
  void* e = m(2 * MiB);  // [12, 14)
  ASSERT_EQ(U(b), U(a) + 2 * MiB);
  ASSERT_EQ(U(d), U(a) + 10 * MiB);
  ASSERT_EQ(reserved(), I(14 * MiB));
  alloc->free(b);
  alloc->free(d);
  void* f = m(2 * MiB, other);  // one page past the mark: recycled, d's
  EXPECT_EQ(st().num_pages_remapped, 1);
  EXPECT_EQ(reserved(), I(14 * MiB));
  const auto mapped = st().num_pages_mapped;
  void* x = m(6 * MiB);  // b is still whole
  EXPECT_EQ(x, b);
  EXPECT_EQ(st().num_pages_mapped, mapped) << "nothing mapped";
  EXPECT_EQ(st().reserved_bytes[0].peak, I(14 * MiB));
  EXPECT_EQ(st().num_device_synchronizations, 0);
  for (void* p : {a, c, e, f, x}) alloc->free(p);
}

// Issue 15: a block just short of a whole number of pages (by at most 1/64
// of a page) is carved from a cached block on page boundaries when that takes
// no more pages: carved flush against a, at 3 MiB, it would straddle three
// pages and keep all three once its neighbours are gone.
TEST_F(ExpandableTest, ABlockJustShortOfWholePagesIsCarvedOnPageBoundaries) {
  void* a = m(3 * MiB);       // [0, 3) MiB
  void* big = m(16 * MiB);    // [3, 19)
  void* c = m(2 * MiB);       // [19, 21)
  alloc->free(big);           // cached: [3, 19)
  const std::size_t size = 4 * MiB - 16 * 1024;
  void* x = m(size);
  EXPECT_EQ(U(x), U(a) + 8 * MiB - size) << "ends on the page boundary at 8 MiB, in the same two pages as flush";
  EXPECT_EQ(reserved(), I(22 * MiB)) << "nothing mapped";
  std::memset(x, 5, size);
  void* y = m(1040 * 1024);  // the piece before x serves a large request
  EXPECT_EQ(U(y), U(a) + 3 * MiB);
  for (void* p : {a, c, y}) alloc->free(p);
  alloc->empty_cache();
  EXPECT_EQ(reserved(), I(4 * MiB)) << "x keeps two pages, not three";
  EXPECT_EQ(static_cast<unsigned char*>(x)[size - 1], 5);
  alloc->free(x);
}

// Issue 15: a block that, carved flush, would reach a sliver (at most 1/64
// of a page) past a page boundary is carved on page boundaries too when that
// takes no more pages: b, 8 MiB, flush against a (which ends 16 KiB past
// 2 MiB) would straddle five pages and keep the fifth for 16 KiB once a is
// gone. Only then: c (which would reach 1 MiB past a boundary) is carved flush.
TEST_F(ExpandableTest, ABlockThatWouldReachASliverPastAPageBoundaryIsCarvedOnPageBoundaries) {
  void* a = m(2 * MiB + 16 * 1024);  // [0, 2 MiB + 16 KiB)
  void* b = m(8 * MiB);
  EXPECT_EQ(U(b), U(a) + 4 * MiB) << "flush it would start at 2 MiB + 16 KiB";
  EXPECT_EQ(reserved(), I(12 * MiB)) << "the same six pages as flush";
  void* c = m(5 * MiB);
  EXPECT_EQ(U(c), U(a) + 12 * MiB) << "reaching 1 MiB past a boundary: flush";
  alloc->free(c);
  std::memset(b, 7, 8 * MiB);
  alloc->free(a);
  alloc->empty_cache();
  EXPECT_EQ(reserved(), I(8 * MiB)) << "b keeps its four pages, not five";
  EXPECT_EQ(static_cast<unsigned char*>(b)[8 * MiB - 1], 7);
  alloc->free(b);
}

// Issue 15: a request whose best fit is a free island (a free mapped run
// with no block in use beside it, whose pages the next new peak recycles
// whole) takes the fitting free block at the lowest address instead, so that
// blocks allocated one after another (a model loaded again) stay in one run.
// Best fit put w1 and w2 in the two islands, two pages each with 1 MiB of
// each stranded; together at the bottom they fill three pages exactly, and
// the other stream's next peak recycles every other page without growing.
TEST_F(ExpandableTest, ARequestWhoseBestFitIsAFreeIslandTakesTheLowestFittingBlock) {
  make(256 * MiB, "reuse_across_streams:False");  // page by page, no idle reservation moves
  const stream_t other = sim->create_stream(0);
  void* low = m(20 * MiB);  // [0, 20) MiB
  void* h1 = m(4 * MiB);    // [20, 24)
  void* i1 = m(4 * MiB);    // [24, 28)
  void* h2 = m(4 * MiB);    // [28, 32)
  void* i2 = m(4 * MiB);    // [32, 36)
  ASSERT_EQ(U(i2), U(low) + 32 * MiB);
  alloc->free(h1);
  alloc->free(h2);
  void* o1 = m(8 * MiB, other);  // past the mark: h1's and h2's pages move, holes at [20, 24) and [28, 32)
  ASSERT_EQ(st().num_pages_remapped, 4);
  for (void* p : {low, i1, i2}) alloc->free(p);  // three free islands: [0, 20), [24, 28), [32, 36)
  void* w1 = m(3 * MiB);
  void* w2 = m(3 * MiB);
  EXPECT_EQ(w1, low) << "best fit would take the island at 24 MiB";
  EXPECT_EQ(U(w2), U(low) + 3 * MiB) << "best fit would take the island at 32 MiB";
  EXPECT_EQ(reserved(), I(36 * MiB)) << "nothing mapped";
  // 11 pages past the mark: the islands' 4 pages and the 7 above w2 move.
  void* o2 = m(22 * MiB, other);
  EXPECT_EQ(st().num_pages_remapped, 4 + 11);
  EXPECT_EQ(st().reserved_bytes[0].peak, I(36 * MiB)) << "best fit: 10 free pages, 1 more mapped";
  EXPECT_EQ(st().num_device_synchronizations, 0);
  for (void* p : {w1, w2, o1, o2}) alloc->free(p);
}

// Best fit as before for a request of whole pages (carved from an island
// it strands nothing), and without recycling at every new peak
// (recycles_per_peak limited: the islands stay mapped whatever is placed).
TEST_F(ExpandableTest, WholePagesOrLimitedRecyclingKeepBestFitInAFreeIsland) {
  for (const auto& [conf, size] : {std::pair{std::string{"reuse_across_streams:False"}, 4 * MiB},
                                   std::pair{std::string{"reuse_across_streams:False,recycles_per_peak:4"}, 3 * MiB}}) {
    make(256 * MiB, conf);
    const stream_t other = sim->create_stream(0);
    void* low = m(20 * MiB);  // [0, 20) MiB
    void* h1 = m(4 * MiB);    // [20, 24)
    void* i1 = m(4 * MiB);    // [24, 28)
    alloc->free(h1);
    void* o1 = m(4 * MiB, other);  // past the mark: h1's pages move
    ASSERT_EQ(st().num_pages_remapped, 2) << conf;
    alloc->free(low);
    alloc->free(i1);  // islands [0, 20) and [24, 28)
    void* w = m(size);
    EXPECT_EQ(w, i1) << conf;
    for (void* p : {w, o1}) alloc->free(p);
  }
}

// The same at the back of a cached block, next to the live block above
// (place_at_back): x starts on the page boundary below the flush position,
// and the free range below it stays on page boundaries, whole pages only.
TEST_F(ExpandableTest, ABlockJustShortOfWholePagesTakenFromTheBackStartsOnAPageBoundary) {
  void* a = m(3 * MiB);       // [0, 3) MiB
  void* big1 = m(8 * MiB);    // [3, 11): two blocks of less than 8 pages, carved flush
  void* big2 = m(8 * MiB);    // [11, 19)
  void* c = m(2 * MiB);       // [19, 21)
  ASSERT_EQ(U(c), U(a) + 19 * MiB);
  alloc->free(a);
  alloc->free(big1);
  alloc->free(big2);          // cached: [0, 19), c above it
  const std::size_t size = 4 * MiB - 16 * 1024;
  void* x = m(size);
  EXPECT_EQ(U(x), U(a) + 14 * MiB) << "flush against c it would start at 19 MiB - size, in three pages";
  void* y = m(14 * MiB);  // the free range below: exactly seven pages
  EXPECT_EQ(y, a);
  for (void* p : {c, y}) alloc->free(p);
  alloc->empty_cache();
  EXPECT_EQ(reserved(), I(4 * MiB));
  alloc->free(x);
}

// Other sizes are carved flush as before: short by more than 1/64 of a page,
// a whole number of pages that ends on a boundary, or reaching more than 1/64
// of a page past one (carved at 3 MiB: 3 MiB + 512 bytes would reach 512
// bytes past 6 MiB, a sliver: it ends on the boundary at 8 MiB instead).
TEST_F(ExpandableTest, OtherBlocksAreCarvedFlushAgainstTheirNeighbour) {
  for (const std::size_t size : {4 * MiB - 64 * 1024, 4 * MiB, 3 * MiB + 64 * 1024, 3 * MiB + 512}) {
    make();
    void* a = m(3 * MiB);
    void* big = m(16 * MiB);
    void* c = m(2 * MiB);
    alloc->free(big);
    void* x = m(size);
    EXPECT_EQ(U(x), size == 3 * MiB + 512 ? U(a) + 8 * MiB - size : U(a) + 3 * MiB) << size;
    for (void* p : {a, c, x}) alloc->free(p);
  }
}

// Issue 15: a block of page_aligned_block_pages (8) pages or more that,
// carved flush, would touch one page more than it needs is carved on page
// boundaries when that takes no more pages, so that it keeps only the pages
// it needs once its neighbours are gone. Carved from the cached [3, 43) MiB
// after a (which ends mid-page at 3 MiB): 16 MiB flush would touch nine
// pages, on a boundary eight; 17.5 MiB flush ten, ending on the boundary at
// 22 MiB nine. 17 MiB flush touches the nine it needs: flush. Below eight
// pages (14 MiB) flush as before, keeping one page more (a model's small
// parameters loaded one after another stay packed). With recycling limited,
// flush whatever the size.
TEST_F(ExpandableTest, ABlockOfEightPagesOrMoreIsCarvedToTouchNoMorePagesThanItNeeds) {
  struct expected {
    std::size_t size;
    const char* conf;
    std::size_t offset;  // from a
    std::size_t kept;    // reserved once a and c are freed and the cache emptied
  };
  for (const expected& e : {expected{16 * MiB, "", 4 * MiB, 16 * MiB},
                            expected{35 * MiB / 2, "", 9 * MiB / 2, 18 * MiB},
                            expected{17 * MiB, "", 3 * MiB, 18 * MiB},
                            expected{14 * MiB, "", 3 * MiB, 16 * MiB},
                            expected{16 * MiB, "recycles_per_peak:4", 3 * MiB, 18 * MiB}}) {
    make(256 * MiB, e.conf);
    void* a = m(3 * MiB);     // [0, 3) MiB
    void* big = m(40 * MiB);  // [3, 43)
    void* c = m(2 * MiB);     // [43, 45)
    alloc->free(big);         // cached: [3, 43)
    void* x = m(e.size);
    EXPECT_EQ(U(x) - U(a), e.offset) << e.size << " " << e.conf;
    EXPECT_EQ(reserved(), I(46 * MiB)) << "nothing mapped";
    std::memset(x, 9, e.size);
    alloc->free(a);
    alloc->free(c);
    alloc->empty_cache();
    EXPECT_EQ(reserved(), I(e.kept)) << e.size << " " << e.conf;
    EXPECT_EQ(static_cast<unsigned char*>(x)[e.size - 1], 9);
    alloc->free(x);
  }
}

// With recycling limited or off, the neighbours' pages stay mapped and the
// page would not be saved: carved flush as before.
TEST_F(ExpandableTest, WithRecyclingLimitedABlockJustShortOfWholePagesIsCarvedFlush) {
  for (const char* conf : {"recycles_per_peak:4", "recycles_per_peak:0", "trim_on_new_peak:False"}) {
    make(256 * MiB, conf);
    void* a = m(3 * MiB);
    void* big = m(16 * MiB);
    void* c = m(2 * MiB);
    alloc->free(big);
    void* x = m(4 * MiB - 16 * 1024);
    EXPECT_EQ(U(x), U(a) + 3 * MiB) << conf;
    for (void* p : {a, c, x}) alloc->free(p);
  }
}

// X3 with recycles_per_peak: after the limit at one high-water mark, the mark
// rises instead. Recycling waits for nothing (page fences: issue 15).
TEST_F(ExpandableTest, RecyclingStopsAfterTheLimitAtOneHighWaterMark) {
  make(256 * MiB, "recycles_per_peak:1,reuse_across_streams:False");  // page by page, no idle reservation moves
  const stream_t other = sim->create_stream(0);
  alloc->free(m(20 * MiB));       // stream 0 caches 10 pages; high-water 20 MiB
  void* b = m(20 * MiB, other);  // recycles them: the one recycling allowed at 20 MiB
  EXPECT_EQ(st().num_pages_remapped, 10);
  EXPECT_EQ(reserved(), I(20 * MiB));
  alloc->free(b);
  void* c = m(4 * MiB);  // stream 0 has no page left: the mark rises
  EXPECT_EQ(st().num_pages_remapped, 10);
  EXPECT_EQ(reserved(), I(24 * MiB)) << "the peak grew instead";
  alloc->free(c);
  void* d = m(30 * MiB, other);  // a new mark (24 MiB): recycling is allowed again
  EXPECT_EQ(st().num_pages_remapped, 12) << "stream 0's two free pages";
  EXPECT_EQ(reserved(), I(30 * MiB));
  EXPECT_EQ(st().num_device_synchronizations, 0);
  alloc->free(d);
}

// recycle_time_percent (issues 15, 18): recycling for a new peak takes at
// most that share of the host's time; the bucket holds that share of one
// second and starts full. Two streams trade 10 pages back and forth: each
// trade unmaps and maps 10 pages, which the simulated device's modelled
// clock charges at an H200's cost (host_clock.hpp).
namespace {
constexpr double trade_us = 10 * (vm_call_costs::unmap_us + vm_call_costs::map_us + vm_call_costs::set_access_us);
}

TEST_F(ExpandableTest, RecyclingStopsWhenItsTimeBudgetIsSpentAndTheMarkRisesInstead) {
  make(1024 * MiB, "recycle_time_percent:5,reuse_across_streams:False", 1, sim_options::host_clock::modeled);
  const stream_t other = sim->create_stream(0);
  void* keep = m(400 * MiB);  // the trades below are small peaks (20 MiB, under 1/16 of the mark)
  alloc->free(m(20 * MiB));   // stream 0 caches 10 pages; high-water 420 MiB
  // The clock stands still but for the remapping itself (the program does
  // nothing but allocate): the bucket's 50 ms, refilled by 5% of the time the
  // trades take, pay for about 50,000 / (0.95 x trade_us) trades, then the
  // mark rises (small peaks never draw on the reserve).
  const auto budget_trades = static_cast<std::int64_t>(50'000.0 / (0.95 * trade_us));
  std::int64_t trades = 0;
  for (int i = 0; i < 400 && reserved() == I(420 * MiB); ++i) {
    alloc->free(m(20 * MiB, i % 2 == 0 ? other : 0));
    if (reserved() == I(420 * MiB)) ++trades;
  }
  EXPECT_GE(trades, budget_trades - 1);
  EXPECT_LE(trades, budget_trades + 1);
  EXPECT_EQ(st().num_pages_remapped, 10 * trades);
  EXPECT_EQ(reserved(), I(440 * MiB)) << "the mark rose: each stream keeps its own 10 pages";
  EXPECT_EQ(st().num_device_synchronizations, 0);
  // From now on both fit without recycling: no more remapping.
  for (int i = 0; i < 10; ++i) alloc->free(m(20 * MiB, i % 2 == 0 ? other : 0));
  EXPECT_EQ(st().num_pages_remapped, 10 * trades);
  // A large peak (80 MiB over the 440 MiB mark, more than 1/16 of it) with
  // the bucket still empty: the reserve pays, and stream 0's 10 free pages
  // are recycled; the mark rises by the 30 pages nobody has free.
  void* big = m(100 * MiB, other);
  EXPECT_EQ(st().num_pages_remapped, 10 * trades + 10);
  EXPECT_EQ(reserved(), I(500 * MiB));
  alloc->free(big);
  alloc->free(keep);
}

// The reserve (issue 15) keeps the time bound: a program with a large new
// peak at every step (two streams trading 10 pages, each trade a new peak of
// the whole mark) recycles on the bucket, then on the reserve (5% of ten
// seconds), then as fast as the bucket refills, and no more: the time
// recycling takes is at most 5% of the time passed plus what the two hold
// at the start (plus a trade each, the debt of their last one); then the
// mark rises.
TEST_F(ExpandableTest, ALargeNewPeakAtEveryStepRecyclesWithinTheTimeBound) {
  constexpr double bucket_us = 50'000.0;    // 5% of one second
  constexpr double reserve_us = 500'000.0;  // 5% of ten seconds
  // idle: the program's own time between two trades, in trades (0: the
  // clock moves only by the remapping; 5: trading at every step would take
  // 1/6 of the time, more than the 5% allowed).
  for (const int idle : {0, 5}) {
    make(256 * MiB, "recycle_time_percent:5,reuse_across_streams:False", 1, sim_options::host_clock::modeled);
    const stream_t other = sim->create_stream(0);
    alloc->free(m(20 * MiB));  // stream 0 caches 10 pages; high-water 20 MiB
    const std::uint64_t start_us = *sim->host_time_us();
    std::uint64_t base_us = 0;
    std::int64_t trades = 0;
    int steps = 0;
    for (; steps < 20'000 && reserved() == I(20 * MiB); ++steps) {
      base_us += static_cast<std::uint64_t>(idle * trade_us);
      sim->set_host_time_us(base_us);
      alloc->free(m(20 * MiB, steps % 2 == 0 ? other : 0));
      if (reserved() == I(20 * MiB)) ++trades;
    }
    const double elapsed_us = static_cast<double>(*sim->host_time_us() - start_us);
    const double recycled_us = static_cast<double>(trades) * trade_us;
    EXPECT_EQ(st().num_pages_remapped, 10 * trades) << idle;
    EXPECT_LE(recycled_us, 0.05 * elapsed_us + bucket_us + reserve_us + 2 * trade_us) << idle;
    // The reserve did pay: more trades than the bucket alone allows.
    EXPECT_GT(recycled_us, (bucket_us + reserve_us) * 0.95) << idle;
    EXPECT_EQ(reserved(), I(40 * MiB)) << idle << ": the mark rose after " << steps << " steps";
    EXPECT_EQ(st().num_device_synchronizations, 0);
    // Both fit now: no more remapping, however long the program runs.
    for (int i = 0; i < 100; ++i) alloc->free(m(20 * MiB, i % 2 == 0 ? other : 0));
    EXPECT_EQ(st().num_pages_remapped, 10 * trades) << idle;
  }
}

// The reserve fills only with what the full bucket cannot hold (together
// they never take more than the one share of the time passing): after both
// are spent, 1.5 s of the program's own time refills the bucket's 50 ms and
// puts the other 25 ms in the reserve, so a program trading large peaks
// again recycles for about (50 + 25) / 0.95 ms (the bucket refills by 5% of
// the trades' own time): not 53 ms (a reserve that never refills), not
// (50 + 75) / 0.95 ms (a reserve filling at 5% of its own).
TEST_F(ExpandableTest, TheReserveFillsOnlyWithWhatTheFullBucketCannotHold) {
  make(256 * MiB, "recycle_time_percent:5,reuse_across_streams:False", 1, sim_options::host_clock::modeled);
  const stream_t other = sim->create_stream(0);
  alloc->free(m(20 * MiB));
  for (int i = 0; i < 20'000 && reserved() == I(20 * MiB); ++i) alloc->free(m(20 * MiB, i % 2 == 0 ? other : 0));
  ASSERT_EQ(reserved(), I(40 * MiB)) << "the bucket and the reserve are spent: the mark rose";
  const std::int64_t remapped = st().num_pages_remapped;
  sim->set_host_time_us(1'500'000);  // the base (0 so far) moves on: 1.5 s pass
  // Trades of 40 MiB (each 20 MiB or more over the 40 MiB mark: large).
  int steps = 0;
  for (; steps < 20'000 && reserved() == I(40 * MiB); ++steps) alloc->free(m(40 * MiB, steps % 2 == 0 ? other : 0));
  ASSERT_EQ(reserved(), I(80 * MiB)) << "the mark rose again: each stream keeps 20 pages";
  constexpr double page_us = vm_call_costs::unmap_us + vm_call_costs::map_us + vm_call_costs::set_access_us;
  const double recycled_us = static_cast<double>(st().num_pages_remapped - remapped) * page_us;
  const double trade40_us = 20 * page_us;
  EXPECT_GE(recycled_us, 75'000.0 / 0.95 - 2 * trade40_us) << steps << " steps";
  EXPECT_LE(recycled_us, 75'000.0 / 0.95 + 2 * trade40_us) << steps << " steps";
  EXPECT_EQ(st().num_device_synchronizations, 0);
}

TEST_F(ExpandableTest, TimeThatPassesRefillsTheRecyclingBudget) {
  make(256 * MiB, "recycle_time_percent:5,reuse_across_streams:False", 1, sim_options::host_clock::modeled);
  const stream_t other = sim->create_stream(0);
  alloc->free(m(20 * MiB));
  // A program that spends 20 x one trade's time elsewhere between trades
  // remaps 1 / 21 of its time < 5%: every trade recycles, the mark stays.
  std::uint64_t now_us = 0;
  for (int i = 0; i < 400; ++i) {
    now_us += static_cast<std::uint64_t>(20 * trade_us);
    sim->set_host_time_us(now_us);
    alloc->free(m(20 * MiB, i % 2 == 0 ? other : 0));
  }
  EXPECT_EQ(st().num_pages_remapped, 10 * 400);
  EXPECT_EQ(reserved(), I(20 * MiB));
}

TEST_F(ExpandableTest, WithoutAHostClockOrAtOneHundredPercentRecyclingIsNotTimed) {
  for (const auto& [conf, clock] :
       {std::pair{std::string{"reuse_across_streams:False"}, sim_options::host_clock::none},
        std::pair{std::string{"recycle_time_percent:100,reuse_across_streams:False"}, sim_options::host_clock::modeled}}) {
    make(256 * MiB, conf, 1, clock);
    const stream_t other = sim->create_stream(0);
    alloc->free(m(20 * MiB));
    for (int i = 0; i < 400; ++i) alloc->free(m(20 * MiB, i % 2 == 0 ? other : 0));
    EXPECT_EQ(st().num_pages_remapped, 10 * 400) << conf;
    EXPECT_EQ(reserved(), I(20 * MiB)) << conf;
  }
}

TEST_F(ExpandableTest, RecycleTimePercentZeroNeverRecyclesForANewPeak) {
  // Also without a host clock (the simulated device's default, a backend
  // whose host_time_us is empty): 0 needs no clock (breaker finding: it
  // recycled there, the budget being off).
  for (const auto clock : {sim_options::host_clock::modeled, sim_options::host_clock::none}) {
    make(256 * MiB, "recycle_time_percent:0,reuse_across_streams:False", 1, clock);
    const stream_t other = sim->create_stream(0);
    alloc->free(m(20 * MiB));
    alloc->free(m(20 * MiB, other));
    EXPECT_EQ(st().num_pages_remapped, 0);
    EXPECT_EQ(reserved(), I(40 * MiB));
  }
}

// A smaller percent set at run time holds at once, though the clock has not
// moved since the bucket was last filled: 0 never recycles again (breaker
// finding: the bucket kept the old percent's tokens until time passed).
TEST_F(ExpandableTest, SetConfigToAZeroRecycleTimePercentStopsRecyclingAtOnce) {
  make(256 * MiB, "recycle_time_percent:5,reuse_across_streams:False", 1, sim_options::host_clock::modeled);
  const stream_t other = sim->create_stream(0);
  alloc->free(m(20 * MiB));
  alloc->free(m(20 * MiB, other));  // a trade: 10 pages recycled, the bucket still far from empty
  ASSERT_EQ(st().num_pages_remapped, 10);
  alloc->set_config("recycle_time_percent:0,reuse_across_streams:False");
  alloc->free(m(20 * MiB));
  EXPECT_EQ(st().num_pages_remapped, 10) << "no recycling at 0%";
  EXPECT_EQ(reserved(), I(40 * MiB)) << "the mark rose instead";
  // Back to 5%: recycling resumes once time has passed to refill the bucket.
  alloc->set_config("recycle_time_percent:5,reuse_across_streams:False");
  sim->set_host_time_us(sim->host_time_us().value() + 1'000'000);
  alloc->free(m(40 * MiB, other));
  EXPECT_GT(st().num_pages_remapped, 10);
}

// ... and so does a debt: a smaller percent bounds it to its own bucket, so
// one long stretch of page mapping delays recycling by a window at most
// (breaker finding: the old percent's debt took several windows to repay).
TEST_F(ExpandableTest, SetConfigToASmallerRecycleTimePercentBoundsTheDebtToItsBucket) {
  make(16384 * MiB, "recycle_time_percent:5,reuse_across_streams:False", 1, sim_options::host_clock::modeled);
  const stream_t other = sim->create_stream(0);
  alloc->free(m(6000 * MiB));  // fresh pages: not charged
  // Recycling 3000 pages takes ~143 ms of the 5% bucket's 50 ms: it ends
  // one bucket (50 ms) in debt.
  alloc->free(m(6000 * MiB, other));
  ASSERT_EQ(st().num_pages_remapped, 3000);
  // A small new peak (one page, under 1/16 of the mark; a large one would
  // draw on the reserve): in debt, the mark rises.
  void* a = m(2 * MiB);
  ASSERT_EQ(st().num_pages_remapped, 3000) << "in debt: the mark rose";
  ASSERT_EQ(reserved(), I(6002 * MiB));
  alloc->set_config("recycle_time_percent:1,reuse_across_streams:False");  // a 10 ms bucket
  sim->set_host_time_us(*sim->host_time_us() + 2'000'000);  // refills 20 ms at 1%
  void* b = m(4 * MiB);  // two pages over the mark: recycled from the other stream
  EXPECT_EQ(st().num_pages_remapped, 3002);
  EXPECT_EQ(reserved(), I(6002 * MiB));
  alloc->free(a);
  alloc->free(b);
}

// The budget pays for recycling only: the unmaps and the remapping of the
// pages they freed, not the fresh pages the same request creates and maps
// (they cost as much when the mark rises instead). One large request that
// recycles one page and creates 2999 (a model's first step) leaves the
// bucket almost full, and the next request over the mark still recycles
// (charged whole, the 2999 fresh pages' ~119 ms emptied the 50 ms bucket
// and the mark rose: 2 MiB more reserved).
TEST_F(ExpandableTest, FreshPagesOfARequestThatRecyclesAreNotChargedToTheBudget) {
  make(16384 * MiB, "recycle_time_percent:5,reuse_across_streams:False", 1, sim_options::host_clock::modeled);
  const stream_t other = sim->create_stream(0);
  alloc->free(m(2 * MiB));  // stream 0 caches one page; the mark is 2 MiB
  alloc->free(m(6000 * MiB, other));  // recycles stream 0's page, creates 2999
  ASSERT_EQ(st().num_pages_remapped, 1);
  ASSERT_EQ(reserved(), I(6000 * MiB));
  void* a = m(2 * MiB);  // one page over the mark: recycled from the other stream's free pages
  EXPECT_EQ(st().num_pages_remapped, 2);
  EXPECT_EQ(reserved(), I(6000 * MiB));
  EXPECT_EQ(st().reserved_bytes[0].peak, I(6000 * MiB));
  EXPECT_EQ(st().num_device_synchronizations, 0);
  alloc->free(a);
}

// The cap is not subject to the budget: with the bucket empty, a request
// that would pass per_process_memory_fraction still recycles.
TEST_F(ExpandableTest, TheMemoryCapRecyclesWhateverTheTimeBudget) {
  make(256 * MiB, "recycle_time_percent:0,reuse_across_streams:False,per_process_memory_fraction:0.125", 1,
       sim_options::host_clock::modeled);  // cap 32 MiB
  const stream_t other = sim->create_stream(0);
  alloc->free(m(20 * MiB));
  void* b = m(20 * MiB, other);  // 40 MiB would pass the cap by 8 MiB: 4 pages must move
  EXPECT_EQ(st().num_pages_remapped, 4);
  EXPECT_EQ(reserved(), I(32 * MiB));
  alloc->free(b);
}

TEST_F(ExpandableTest, RecyclesPerPeakZeroGrowsLikePyTorchAndNeverSynchronizes) {
  make(256 * MiB, "recycles_per_peak:0,reuse_across_streams:False");
  const stream_t other = sim->create_stream(0);
  alloc->free(m(20 * MiB));
  alloc->free(m(20 * MiB, other));
  EXPECT_EQ(st().num_device_synchronizations, 0);
  EXPECT_EQ(st().num_pages_remapped, 0);
  EXPECT_EQ(reserved(), I(40 * MiB));
}

TEST_F(ExpandableTest, TheDefaultRecyclesAtEveryNewPeak) {
  const stream_t other = sim->create_stream(0);
  void* keep = m(2 * MiB);  // stream 0 stays busy: its reservation cannot pass whole
  alloc->free(m(20 * MiB));
  void* b = m(20 * MiB, other);
  EXPECT_EQ(st().num_pages_remapped, 10);
  alloc->free(b);
  void* c = m(24 * MiB);  // other's idle reservation passes whole; 2 new pages
  EXPECT_EQ(st().num_device_synchronizations, 0);
  EXPECT_EQ(st().num_pages_remapped, 10) << "other's 10 pages stay where they are";
  EXPECT_EQ(reserved(), I(26 * MiB)) << "keep's page and other's 10, plus 2 new ones";
  for (void* p : {keep, c}) alloc->free(p);
}

TEST_F(ExpandableTest, WithoutTrimTheReservationGrowsLikePyTorch) {
  make(256 * MiB, pytorch_expandable_policies);
  const stream_t other = sim->create_stream(0);
  alloc->free(m(20 * MiB));
  void* b = m(20 * MiB, other);
  EXPECT_EQ(reserved(), I(40 * MiB));
  alloc->free(b);
}

TEST_F(ExpandableTest, TheCapIsKeptByRecyclingPages) {
  make(256 * MiB, "per_process_memory_fraction:0.125");  // 32 MiB
  const stream_t other = sim->create_stream(0);
  alloc->free(m(24 * MiB));
  void* b = m(24 * MiB, other);
  EXPECT_LE(reserved(), I(32 * MiB));
  EXPECT_THROW((void)m(10 * MiB, other), out_of_memory_error);
  alloc->free(b);
}

TEST_F(ExpandableTest, OutOfMemoryUnmapsFreePagesAndTheAllocatorGoesOn) {
  make(64 * MiB);
  void* a = m(30 * MiB);
  void* b = m(10 * MiB);
  alloc->free(b);
  try {
    (void)m(40 * MiB);
    FAIL() << "expected an out_of_memory_error";
  } catch (const out_of_memory_error& e) {
    EXPECT_EQ(e.requested_bytes, 40 * MiB);
    EXPECT_NE(std::string(e.what()).find("Tried to allocate 40.00 MiB"), std::string::npos) << e.what();
  }
  EXPECT_EQ(reserved(), I(30 * MiB)) << "the free pages went back to the device";
  EXPECT_EQ(st().num_ooms, 1);
  void* c = m(30 * MiB);  // fits now
  EXPECT_EQ(reserved(), I(60 * MiB));
  alloc->free(a);
  alloc->free(c);
}

TEST_F(ExpandableTest, BlocksWaitingForEventsAreNotUnmapped) {
  const stream_t side = sim->create_stream(0);
  void* a = m(8 * MiB);
  alloc->record_stream(a, side);
  sim->enqueue_work(0, side, 100);  // the side stream uses `a` until t=100
  alloc->free(a);                   // pending
  alloc->empty_cache();             // waits for the event (B6) and only then unmaps
  EXPECT_GE(sim->now(), 100u);
  EXPECT_EQ(reserved(), 0);
  EXPECT_EQ(st().num_sync_all_streams, 1);
}

TEST_F(ExpandableTest, OutOfMemoryPathWaitsForPendingEventsX7) {
  make(32 * MiB);
  const stream_t side = sim->create_stream(0);
  void* a = m(24 * MiB);
  alloc->record_stream(a, side);
  sim->enqueue_work(0, side, 50);
  alloc->free(a);  // pending until t=50
  void* b = m(24 * MiB);  // only fits in a's pages: the OOM path waits for the event
  EXPECT_EQ(st().num_ooms, 0);
  EXPECT_EQ(st().num_sync_all_streams, 1);
  EXPECT_GE(sim->now(), 50u);
  alloc->free(b);
}

TEST_F(ExpandableTest, PeerAccessCoversExistingAndFutureMappings) {
  make(256 * MiB, "", 2);
  void* before = m(4 * MiB, 0, 1);
  alloc->enable_peer_access(0, 1);  // device 0 may access device 1's memory
  EXPECT_TRUE(sim->peer_access_enabled(0, 1));
  EXPECT_TRUE(sim->peer_can_access(1, before, 0));
  void* after = m(6 * MiB, 0, 1);
  EXPECT_TRUE(sim->peer_can_access(1, after, 0));
  EXPECT_TRUE(sim->peer_can_access(1, static_cast<char*>(after) + 5 * MiB, 0));
  EXPECT_EQ(dev(1).peers(), std::vector<int>{0});
  alloc->enable_peer_access(0, 1);  // again: nothing changes
  EXPECT_EQ(dev(1).peers(), std::vector<int>{0});
  EXPECT_THROW(alloc->enable_peer_access(1, 1), invalid_argument_error);
  EXPECT_THROW(alloc->enable_peer_access(0, 2), invalid_argument_error);
  alloc->free(before);
  alloc->free(after);
}

TEST_F(ExpandableTest, FailedPageCreationIsRetriedAfterFreeingTheCache) {
  sim->fail_vm_create_after(2);  // the second page cannot be created (once)
  void* a = m(5 * MiB);          // B6: release the cache, retry
  EXPECT_EQ(st().num_alloc_retries, 1);
  EXPECT_EQ(st().num_ooms, 0);
  EXPECT_EQ(reserved(), I(6 * MiB));
  EXPECT_EQ(sim->counters().live_handles, 3u) << "the page mapped before the failure is still used, none leaked";
  alloc->free(a);
}

TEST_F(ExpandableTest, PageCreationFailingOnAFullDeviceIsAnOutOfMemory) {
  make(16 * MiB);
  void* a = m(10 * MiB);
  EXPECT_THROW((void)m(8 * MiB), out_of_memory_error);  // 10 + 8 > 16
  dev().check_invariants();
  EXPECT_EQ(reserved(), I(10 * MiB)) << "pages mapped for the failed request were returned";
  EXPECT_EQ(sim->counters().live_handles, 5u);
  void* b = m(6 * MiB);
  EXPECT_EQ(reserved(), I(16 * MiB));
  alloc->free(a);
  alloc->free(b);
}

TEST_F(ExpandableTest, FailedMapThrowsTheBackendErrorAndKeepsTheStateConsistent) {
  void* a = m(3 * MiB);
  sim->fail_vm_map_after(1);
  try {
    (void)m(6 * MiB);
    FAIL() << "expected a backend_error";
  } catch (const backend_error& e) {
    EXPECT_NE(std::string(e.what()).find("vm_map"), std::string::npos) << e.what();
  }
  dev().check_invariants();
  EXPECT_EQ(sim->counters().live_handles * page, static_cast<std::size_t>(reserved()))
      << "no physical page leaked";
  void* b = m(6 * MiB);
  alloc->free(a);
  alloc->free(b);
  alloc->empty_cache();
  EXPECT_EQ(sim->counters().live_handles, 0u);
}

// A failed request gives back the pages it mapped; when the device refuses
// such an unmap, it still holds the page: the page is retired (unmapped at
// the next settle, then released) and counted as reserved meanwhile, so
// reserved bytes keep matching the device's pages (the page used to leave
// the books with its handle never released: a leak the statistics hid).
TEST_F(ExpandableTest, ARefusedUnmapKeepsThePageReservedUntilItIsUnmapped) {
  void* a = m(3 * MiB);  // 2 pages of the stream's reservation
  sim->fail_vm_map_after(2);    // the request's second new page cannot be mapped...
  sim->fail_vm_unmap_after(1);  // ...and the device refuses to unmap its first
  EXPECT_THROW((void)m(6 * MiB), backend_error);
  dev().check_invariants();
  EXPECT_EQ(reserved(), I(3 * page)) << "the page the device still holds";
  EXPECT_EQ(sim->counters().live_handles, 3u);
  EXPECT_EQ(sim->counters().mapped_bytes, 3 * page);
  void* b = m(6 * MiB);  // over the retired page: unmapped first, then mapped again
  dev().check_invariants();
  EXPECT_EQ(reserved(), I(5 * page));
  EXPECT_EQ(sim->counters().live_handles * page, static_cast<std::size_t>(reserved()));
  alloc->free(a);
  alloc->free(b);
  alloc->empty_cache();
  dev().check_invariants();
  EXPECT_EQ(reserved(), 0);
  EXPECT_EQ(sim->counters().live_handles, 0u);
  EXPECT_EQ(sim->counters().live_reservations, 0u);
}

// The same in a reservation the failed request made: it stays (one
// unmapped block) while it holds the retired page, and goes at emptyCache
// (it used to be released with a page still mapped in it, which the device
// refused too: the address range leaked).
TEST_F(ExpandableTest, ARefusedUnmapKeepsTheFailedRequestsReservationUntilItIsUnmapped) {
  sim->fail_vm_map_after(2);
  sim->fail_vm_unmap_after(1);
  EXPECT_THROW((void)m(6 * MiB), backend_error);
  dev().check_invariants();
  EXPECT_EQ(reserved(), I(page));
  EXPECT_EQ(sim->counters().live_handles, 1u);
  EXPECT_EQ(sim->counters().live_reservations, 1u);
  EXPECT_EQ(st().segment[0].current, 1);
  alloc->empty_cache();
  dev().check_invariants();
  EXPECT_EQ(reserved(), 0);
  EXPECT_EQ(st().segment[0].current, 0);
  EXPECT_EQ(sim->counters().live_handles, 0u);
  EXPECT_EQ(sim->counters().mapped_bytes, 0u);
  EXPECT_EQ(sim->counters().live_reservations, 0u);
  void* a = m(6 * MiB);  // the device works again
  EXPECT_EQ(reserved(), I(3 * page));
  alloc->free(a);
}

TEST_F(ExpandableTest, PlainAndExpandableSegmentsCoexistAcrossSetConfig) {
  make(256 * MiB, "expandable_segments:False");
  void* plain = m(12 * MiB);
  alloc->set_config("expandable_segments:True");
  void* exp = m(12 * MiB);
  const auto segs = dev().segments();
  ASSERT_EQ(segs.size(), 2u);
  EXPECT_NE(segs[0].is_expandable, segs[1].is_expandable);
  alloc->free(plain);
  alloc->free(exp);
  alloc->empty_cache();
  EXPECT_EQ(reserved(), 0);
}

// ---- X2: cross-stream reuse of plain segments ----------------------------------

TEST_F(ExpandableTest, IdleStreamsCachedWholeSegmentServesAnotherStream) {
  make(256 * MiB, "expandable_segments:False");
  const stream_t other = sim->create_stream(0);
  void* a = m(30 * MiB);
  alloc->free(a);
  void* b = m(30 * MiB, other);
  EXPECT_EQ(b, a) << "stream 0 has no work left: its cached segment moves";
  EXPECT_EQ(st().num_device_alloc, 1);
  alloc->free(b);
  EXPECT_EQ(m(30 * MiB, other), a) << "now cached on the other stream";
  alloc->free(a);
}

// Two idle streams cache a whole segment of the same size: the one adopted
// is the lower stream handle's, whatever order the streams' states have in
// host memory (the world lock orders the streams by handle). Here the higher
// handle's stream is registered first, so its state is usually made first.
TEST_F(ExpandableTest, AmongEqualIdleSegmentsTheLowerStreamHandlesIsAdopted) {
  make(256 * MiB, "expandable_segments:False");
  constexpr stream_t high = 0x7000, low = 0x1000, taker = 0x4000;
  sim->adopt_stream(0, high);
  sim->adopt_stream(0, low);
  sim->adopt_stream(0, taker);
  void* on_high = m(30 * MiB, high);
  void* on_low = m(30 * MiB, low);
  alloc->free(on_high);
  alloc->free(on_low);
  EXPECT_EQ(m(30 * MiB, taker), on_low) << "the tie goes to stream 0x1000";
  EXPECT_EQ(st().num_device_alloc, 2);
  EXPECT_EQ(m(30 * MiB, taker), on_high) << "then the other one";
  EXPECT_EQ(st().num_device_alloc, 2);
}

TEST_F(ExpandableTest, AnotherStreamsSegmentMovesOnlyAfterItsWorkCompleted) {
  make(256 * MiB, "expandable_segments:False");
  const stream_t other = sim->create_stream(0);
  void* a = m(30 * MiB);
  sim->enqueue_work(0, 0, 1000);  // stream 0 still runs work that may use `a`
  alloc->free(a);
  void* b = m(30 * MiB, other);  // a new peak: the segment moves, after the device synchronized
  EXPECT_EQ(b, a);
  EXPECT_GE(sim->now(), 1000u) << "the host waited for stream 0's work";
  EXPECT_EQ(st().num_device_alloc, 1);
  alloc->free(b);
}

TEST_F(ExpandableTest, WithoutTrimNoSegmentMovesAndNothingWaits) {
  make(256 * MiB, "expandable_segments:False,trim_on_new_peak:False");
  const stream_t other = sim->create_stream(0);
  void* a = m(30 * MiB);
  sim->enqueue_work(0, 0, 1000);
  alloc->free(a);
  void* b = m(30 * MiB, other);  // PyTorch's path: a new segment, no synchronization
  EXPECT_NE(b, a);
  EXPECT_EQ(sim->now(), 0u);
  EXPECT_EQ(st().num_device_alloc, 2);
  alloc->free(b);
}

TEST_F(ExpandableTest, ReuseAcrossStreamsFalseKeepsPyTorchsBinding) {
  make(256 * MiB, pytorch_policies);
  const stream_t other = sim->create_stream(0);
  void* a = m(30 * MiB);
  alloc->free(a);
  void* b = m(30 * MiB, other);
  EXPECT_NE(b, a);
  alloc->free(b);
}


// ---- regressions from adversarial testing --------------------------------------

// Each (stream, pool) reserves address space the size of the device: when
// the host (or GPU) address space runs out, requests get plain segments
// instead of an out-of-memory error with the device mostly free.
TEST_F(ExpandableTest, AddressSpaceExhaustionFallsBackToPlainSegments) {
  make(std::size_t{48} << 40);  // 48 TiB "device": two or three reservations fill a 47-bit address space
  std::vector<std::pair<void*, stream_t>> live;
  testing::internal::CaptureStderr();
  for (int i = 0; i < 6; ++i) {
    const stream_t s = sim->create_stream(0);
    void* p = nullptr;
    ASSERT_NO_THROW(p = m(4 * MiB, s)) << "stream " << i;
    live.emplace_back(p, s);
  }
  const std::string err = testing::internal::GetCapturedStderr();
  std::size_t expandable = 0, plain = 0;
  for (const auto& seg : dev().segments()) (seg.is_expandable ? expandable : plain) += 1;
  EXPECT_GE(expandable, 1u);
  EXPECT_EQ(expandable + plain, 6u);
  // The fallback is announced once (not at each plain segment); a host with
  // a larger address space (57 bits) makes no plain segment here.
  const std::string warning =
      "ccalloc: warning: device 0: no address space left for another reservation of 52776558133248 bytes "
      "(expandable segment); requests that need one get plain segments (cudaMalloc) while none is left, whose pages "
      "are not recycled and which a tag's pause cannot release\n";
  EXPECT_EQ(err, plain > 0 ? warning : "");
  for (auto& [p, s] : live) alloc->free(p);
}

TEST_F(ExpandableTest, DeviceSizeNearTheLimitDoesNotOverflow) {
  make(std::numeric_limits<std::size_t>::max());
  void* p = nullptr;
  ASSERT_NO_THROW(p = m(512));  // no reservation that large: a plain segment
  alloc->free(p);
}

TEST_F(ExpandableTest, PeerAccessThatTheBackendCannotGiveIsRefusedAndNotRecorded) {
  sim_options o;
  o.device_count = 2;
  o.capacity_bytes = 64 * MiB;
  o.peer_access = false;
  sim = std::make_shared<sim_backend>(o);
  alloc = std::make_unique<caching_allocator>(sim, allocator_config{});
  alloc->init(2);
  EXPECT_THROW(dev(0).enable_peer_access(1), backend_error);
  EXPECT_TRUE(dev(0).peers().empty());
  void* a = m(4 * MiB);  // maps fine: no peer to grant
  void* b = m(4 * MiB);
  alloc->free(a);
  alloc->free(b);
  alloc->empty_cache();
  EXPECT_EQ(sim->counters().mapped_bytes, 0u);
}

// A request that maps pages goes to the free run needing the fewest new
// pages, then the shortest run (alloc_expandable, step 1). The runs are found
// from the segment's unmapped blocks and the pool's free blocks, not by
// walking every block (issue D4); check_invariants (TearDown) compares that
// placement with a walk over every block at several sizes.
TEST_F(ExpandableTest, ARequestThatMapsPagesTakesTheRunNeedingFewestPagesThenTheShortest) {
  void* a = m(4 * MiB);
  void* b = m(4 * MiB);
  void* c = m(4 * MiB);
  void* d = m(6 * MiB);
  void* e = m(2 * MiB);
  const std::uintptr_t base = U(a);
  ASSERT_EQ(U(e), base + 18 * MiB) << "packed one after another";
  alloc->free(b);
  alloc->free(d);
  alloc->empty_cache();  // b's and d's pages unmapped: holes of 4 and 6 MiB, and the unmapped tail
  ASSERT_EQ(reserved(), I(10 * MiB));
  void* x = m(4 * MiB);
  EXPECT_EQ(U(x), base + 4 * MiB) << "two pages to map in each hole and the tail: the shortest run";
  EXPECT_EQ(reserved(), I(14 * MiB));
  void* y = m(5 * MiB);
  EXPECT_EQ(U(y), base + 12 * MiB) << "too long for b's hole; three pages in d's or the tail: d's is shorter";
  EXPECT_EQ(reserved(), I(20 * MiB));
  alloc->free(e);  // free mapped [17, 20) MiB, followed by the unmapped tail
  alloc->free(c);  // free mapped [8, 12) MiB, between blocks in use: too short
  const std::int64_t remapped = st().num_pages_remapped;
  void* z = m(5 * MiB);
  EXPECT_EQ(U(z), base + 17 * MiB) << "one page to map after the free mapped pages before the tail";
  EXPECT_EQ(st().num_pages_remapped, remapped + 1) << "a new peak: the page is one of c's, recycled";
  EXPECT_EQ(reserved(), I(20 * MiB));
  dev().check_invariants();
  for (void* p : {a, x, y, z}) alloc->free(p);
}

// Random mallocs, frees and emptyCache on two streams, with recycling: the
// list of unmapped blocks and the placement found from it agree with a walk
// over every block after every step (check_invariants), as pages are mapped,
// unmapped, split and merged.
TEST_F(ExpandableTest, UnmappedBlockListAndPlacementAgreeWithAFullWalkUnderRandomOperations) {
  make(256 * MiB, "per_process_memory_fraction:0.8");
  const stream_t other = sim->create_stream(0);
  std::uint64_t rng = 0x5eedd4;
  const auto next = [&](std::uint64_t n) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (rng >> 33) % n;
  };
  std::vector<std::pair<void*, std::size_t>> live;
  std::size_t live_bytes = 0;
  for (int step = 0; step < 3000; ++step) {
    const std::uint64_t op = next(100);
    if (op < 55 && live_bytes < 120 * MiB) {
      static constexpr std::size_t sizes[] = {512, 64 << 10, 1 * MiB, 1536 << 10, 2 * MiB, 3 * MiB - 4096,
                                              4 * MiB, 5 * MiB + 512, 8 * MiB};
      const std::size_t bytes = sizes[next(std::size(sizes))];
      live.emplace_back(m(bytes, next(4) == 0 ? other : 0), bytes);
      live_bytes += bytes;
    } else if (op < 98 && !live.empty()) {
      const std::size_t i = next(live.size());
      alloc->free(live[i].first);
      live_bytes -= live[i].second;
      live[i] = live.back();
      live.pop_back();
    } else {
      alloc->empty_cache();
    }
    ASSERT_NO_THROW(dev().check_invariants()) << "step " << step;
  }
  EXPECT_GT(st().num_pages_unmapped, 100) << "pages were unmapped and mapped again";
  EXPECT_GT(st().num_pages_mapped, st().num_pages_unmapped);
  for (const auto& [p, bytes] : live) alloc->free(p);
}

}  // namespace
