// The placement policy (src/core/detail/placement_policy.hpp): rounding
// (B1), segment sizes (B2), the oversize rules (B3) and when pages are
// recycled at every peak, read from the configuration it owns.
#include "../src/core/detail/placement_policy.hpp"

#include <ccalloc/core/config.hpp>

#include <gtest/gtest.h>

#include <cstddef>

namespace {

using ccalloc::allocator_config;
using ccalloc::detail::placement_policy;
constexpr std::size_t mib = std::size_t{1} << 20;

TEST(PlacementPolicy, RoundsTo512ByteMultiplesOrToPowerOfTwoDivisions) {
  placement_policy plain(allocator_config{});
  EXPECT_EQ(plain.round_size(1), 512u);
  EXPECT_EQ(plain.round_size(512), 512u);
  EXPECT_EQ(plain.round_size(513), 1024u);
  EXPECT_EQ(plain.round_size(5 * mib + 1), 5 * mib + 512);
  placement_policy divided(allocator_config::parse("roundup_power2_divisions:4"));
  EXPECT_EQ(divided.round_size(5 * mib + 1), 6 * mib);  // steps of 1 MiB between 4 and 8 MiB
  EXPECT_EQ(divided.round_size(8 * mib), 8 * mib);     // a power of two stays
  EXPECT_EQ(divided.round_size(1000), 1024u);          // too small to divide: 512-byte multiples
}

TEST(PlacementPolicy, SegmentSizesBySizeClassAndExactWithoutCaching) {
  placement_policy p(allocator_config::parse("large_segment_size_mb:20"));
  EXPECT_EQ(p.allocation_size(512), 2 * mib);        // the small pool's 2 MiB segments
  EXPECT_EQ(p.allocation_size(1 * mib + 512), 20 * mib);
  EXPECT_EQ(p.allocation_size(11 * mib), 12 * mib);  // 10 MiB and up: to 2 MiB
  p.set_caching(false);
  EXPECT_FALSE(p.caching());
  EXPECT_EQ(p.allocation_size(11 * mib), 11 * mib);
  p.set_config(allocator_config::parse("large_segment_size_mb:40"));
  EXPECT_EQ(p.config().large_segment_size_bytes, 40 * mib);
}

TEST(PlacementPolicy, OversizeBlocksServeOnlyOversizeRequestsWithinTheRounding) {
  placement_policy p(allocator_config::parse("max_split_size_mb:40,max_non_split_rounding_mb:20"));
  EXPECT_TRUE(p.oversize_rules_allow(1 * mib, 39 * mib));
  EXPECT_FALSE(p.oversize_rules_allow(1 * mib, 40 * mib));   // a small request never takes an oversize block
  EXPECT_TRUE(p.oversize_rules_allow(40 * mib, 59 * mib));
  EXPECT_FALSE(p.oversize_rules_allow(40 * mib, 60 * mib));  // 20 MiB larger: too much waste
}

TEST(PlacementPolicy, RecyclesAtEveryPeakOnlyWithTrimAndUnlimitedRecycles) {
  EXPECT_TRUE(placement_policy(allocator_config{}).recycles_at_every_peak());
  EXPECT_FALSE(placement_policy(allocator_config::parse("trim_on_new_peak:False")).recycles_at_every_peak());
  EXPECT_FALSE(placement_policy(allocator_config::parse("recycles_per_peak:3")).recycles_at_every_peak());
}

}  // namespace
