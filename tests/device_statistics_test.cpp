// A device's statistics (src/core/detail/device_statistics.hpp): which
// thread published last (stats_sink backs off when threads take turns),
// and publishing every stream's pending deltas into the device's figures.
#include "../src/core/detail/device_state.hpp"

#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/core/config.hpp>

#include <gtest/gtest.h>

#include <cstddef>

namespace {

using ccalloc::allocator_config;
using ccalloc::sim_backend;
using ccalloc::sim_options;
using ccalloc::detail::device_state;
using ccalloc::detail::device_statistics;
using ccalloc::detail::stream_state;
using ccalloc::detail::world_lock;

TEST(DeviceStatistics, SwitchPublisherSaysWhenAnotherThreadPublishedLast) {
  device_statistics s;
  const char thread_a = 0;
  const char thread_b = 0;
  EXPECT_FALSE(s.switch_publisher(&thread_a));  // the first publisher: nobody before it
  EXPECT_FALSE(s.switch_publisher(&thread_a));  // the same thread again
  EXPECT_TRUE(s.switch_publisher(&thread_b));   // another thread took over
  EXPECT_FALSE(s.switch_publisher(&thread_b));
  EXPECT_TRUE(s.switch_publisher(&thread_a));
  EXPECT_TRUE(s.mutex().try_lock());
  EXPECT_FALSE(s.mutex().try_lock());
  s.mutex().unlock();
}

// Deltas a stream collected while the lock was busy reach the device's
// figures at the next publish (peaks included), and the stream's are cleared.
TEST(DeviceStatistics, PublishAllPendingMergesEveryStreamsDeltas) {
  sim_backend sim(sim_options{1, std::size_t{1} << 30, std::size_t{2} << 20});
  device_state d(0, sim, allocator_config::parse("expandable_segments:False"));
  const ccalloc::stream_t side = sim.create_stream(0);
  stream_state& s0 = d.registry().stream_for(0);
  stream_state& s1 = d.registry().stream_for(side);
  s0.pending_stats.num_ooms = 2;
  s0.pending_stats.allocated_bytes[0].current = 100;
  s0.pending_stats.allocated_bytes[0].peak = 100;
  s0.has_pending_stats = true;
  s1.pending_stats.num_ooms = 3;
  s1.pending_stats.allocated_bytes[0].current = 50;
  s1.pending_stats.allocated_bytes[0].peak = 70;
  s1.has_pending_stats = true;
  {
    world_lock w(d);
    d.stats().publish_all_pending(w);
    const auto& v = d.stats().values();
    EXPECT_EQ(v.num_ooms, 5);
    EXPECT_EQ(v.allocated_bytes[0].current, 150);
    EXPECT_GE(v.allocated_bytes[0].peak, 150);
    EXPECT_FALSE(s0.has_pending_stats);
    EXPECT_FALSE(s1.has_pending_stats);
    EXPECT_EQ(s1.pending_stats.num_ooms, 0);
    EXPECT_EQ(s1.pending_stats.allocated_bytes[0].current, 0);
    // A second publish adds nothing.
    d.stats().publish_all_pending(w);
    EXPECT_EQ(d.stats().values().num_ooms, 5);
    // Back to zero before the device goes (no negative or leftover figures).
    d.stats().values().allocated_bytes[0].current = 0;
  }
}

}  // namespace
