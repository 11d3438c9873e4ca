// A device's segment table (src/core/detail/segment_table.hpp): the lookup
// of the segment that holds an address, and the releases of cached whole
// segments (emptyCache's, rung 5's) with their books: the segment count,
// the reserved bytes and the statistics. On a device_state of its own over
// the simulated device, plain segments only.
#include "../src/core/detail/device_state.hpp"

#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/core/config.hpp>

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>

namespace {

using ccalloc::allocator_config;
using ccalloc::sim_backend;
using ccalloc::sim_options;
using ccalloc::detail::block;
using ccalloc::detail::device_state;
using ccalloc::detail::segment;
using ccalloc::detail::world_lock;

constexpr std::size_t mib = std::size_t{1} << 20;

struct plain_device {
  sim_backend sim{sim_options{1, std::size_t{1} << 30, 2 * mib}};
  device_state d{0, sim, allocator_config::parse("expandable_segments:False")};
};

std::int64_t segment_count(device_state& d) { return d.stats().values().segment[0].current; }

TEST(SegmentTable, ContainingFindsTheSegmentOfEveryAddressInsideIt) {
  plain_device f;
  block* a = f.d.allocate(30 * mib, 0);
  block* b = f.d.allocate(40 * mib, 0);
  ASSERT_NE(a->seg, b->seg);
  ASSERT_EQ(f.d.segments().size(), 2u);
  for (const block* x : {a, b}) {
    const segment& seg = *x->seg;
    EXPECT_EQ(f.d.segments().containing(seg.base), &seg);
    EXPECT_EQ(f.d.segments().containing(seg.base + seg.size - 1), &seg);
    EXPECT_EQ(f.d.segments().containing(x->ptr + 12345), &seg);
    const segment* next = f.d.segments().containing(seg.base + seg.size);
    EXPECT_TRUE(next == nullptr || next->base == seg.base + seg.size);  // past the end: the next one or none
  }
  EXPECT_EQ(f.d.segments().containing(0), nullptr);
  EXPECT_EQ(f.d.segments().containing(std::uintptr_t{0} - 1), nullptr);
  std::size_t seen = 0;
  std::uintptr_t last = 0;
  for (const auto& [base, seg] : f.d.segments()) {  // in address order, keyed by base
    EXPECT_EQ(base, seg->base);
    EXPECT_GT(base, last);
    last = base;
    ++seen;
  }
  EXPECT_EQ(seen, 2u);
  f.d.free(a);
  f.d.free(b);
}

// A whole free segment goes back (books and device); one with a block in
// use stays, until that block is freed too.
TEST(SegmentTable, ReleaseCachedBlocksReturnsOnlyWholeFreeSegments) {
  plain_device f;
  block* whole = f.d.allocate(30 * mib, 0);
  block* small1 = f.d.allocate(4096, 0);  // two blocks of one small-pool segment
  block* small2 = f.d.allocate(4096, 0);
  ASSERT_EQ(small1->seg, small2->seg);
  const std::size_t small_seg = small1->seg->size;
  const std::size_t whole_seg = whole->seg->size;
  ASSERT_EQ(f.d.memory().reserved(), whole_seg + small_seg);
  ASSERT_EQ(segment_count(f.d), 2);
  f.d.free(whole);
  f.d.free(small1);
  {
    world_lock w(f.d);
    EXPECT_TRUE(f.d.segments().release_cached_blocks(w));
    EXPECT_EQ(f.d.segments().size(), 1u);  // the small segment: small2 is in use
    EXPECT_EQ(f.d.memory().reserved(), small_seg);
    EXPECT_EQ(segment_count(f.d), 1);
    EXPECT_EQ(f.d.stats().values().num_device_free, 1);
    EXPECT_EQ(f.d.segments().take_release_failure(), nullptr);  // nothing refused
  }
  f.d.free(small2);
  world_lock w(f.d);
  f.d.stats().publish_all_pending(w);
  EXPECT_TRUE(f.d.segments().release_cached_blocks(w));
  EXPECT_EQ(f.d.segments().size(), 0u);
  EXPECT_EQ(f.d.memory().reserved(), 0u);
  EXPECT_EQ(segment_count(f.d), 0);
  EXPECT_EQ(f.d.stats().values().num_device_free, 2);
  EXPECT_EQ(f.sim.counters().used_bytes, 0u);
  EXPECT_EQ(f.sim.counters().segment_frees, 2u);
}

}  // namespace
