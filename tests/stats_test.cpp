// Tests of device_stats (include/ccalloc/core/stats.hpp): the flat
// torch.cuda.memory_stats() key set and values, reset_peak() and
// reset_accumulated().
#include <ccalloc/core/stats.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace ccalloc {
namespace {

const std::vector<std::string> pooled_names = {
    "allocation",     "segment",         "active",       "inactive_split",
    "allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes",
    "requested_bytes"};
const std::vector<std::string> groups = {"all", "small_pool", "large_pool"};
const std::vector<std::string> fields = {"current", "peak", "allocated", "freed"};

/// Every key torch.cuda.memory_stats() reports for the native allocator.
std::set<std::string> expected_keys() {
  std::set<std::string> keys;
  for (const auto& name : pooled_names) {
    for (const auto& group : groups) {
      for (const auto& field : fields) keys.insert(name + "." + group + "." + field);
    }
  }
  for (const std::string name : {"oversize_allocations", "oversize_segments"}) {
    for (const auto& field : fields) keys.insert(name + "." + field);
  }
  for (const char* name : {"num_alloc_retries", "num_ooms", "num_sync_all_streams",
                           "num_device_alloc", "num_device_free", "num_device_synchronizations",
                           "num_pages_remapped", "num_pages_mapped", "num_pages_unmapped",
                           "bytes_moved_between_streams", "num_thread_cache_hits", "num_stream_waits",
                           "max_split_size"}) {
    keys.insert(name);
  }
  return keys;
}

std::set<std::string> keys_of(const std::map<std::string, std::int64_t>& map) {
  std::set<std::string> keys;
  for (const auto& [key, value] : map) keys.insert(key);
  return keys;
}

/// A small history: two large allocations (one freed), three small ones, a
/// large segment, an oversize allocation, some event counters.
device_stats sample_stats() {
  device_stats s;
  device_stats::increase(s.allocation, stat_group::large_pool, 1);
  device_stats::increase(s.allocation, stat_group::large_pool, 1);
  device_stats::decrease(s.allocation, stat_group::large_pool, 1);
  device_stats::increase(s.allocation, stat_group::small_pool, 3);

  device_stats::increase(s.allocated_bytes, stat_group::large_pool, 4096);
  device_stats::increase(s.allocated_bytes, stat_group::large_pool, 1024);
  device_stats::decrease(s.allocated_bytes, stat_group::large_pool, 4096);
  device_stats::increase(s.allocated_bytes, stat_group::small_pool, 1536);

  device_stats::increase(s.requested_bytes, stat_group::large_pool, 4000);
  device_stats::increase(s.reserved_bytes, stat_group::large_pool, 20 << 20);
  device_stats::increase(s.segment, stat_group::large_pool, 1);

  s.oversize_allocations.increase(2);
  s.oversize_allocations.decrease(1);
  s.oversize_segments.increase(1);

  s.num_alloc_retries = 1;
  s.num_ooms = 2;
  s.num_sync_all_streams = 3;
  s.num_device_alloc = 4;
  s.num_device_free = 5;
  s.num_device_synchronizations = 6;
  s.num_pages_remapped = 7;
  s.num_pages_mapped = 8;
  s.num_pages_unmapped = 9;
  s.bytes_moved_between_streams = 10;
  s.num_thread_cache_hits = 11;
  s.num_stream_waits = 12;
  s.max_split_size = std::int64_t{128} << 20;
  return s;
}

TEST(StatsTest, DefaultMapHasEveryKeyAtZero) {
  const auto map = device_stats{}.to_map();
  EXPECT_EQ(map.size(), 9u * 3u * 4u + 2u * 4u + 13u);  // 129
  EXPECT_EQ(keys_of(map), expected_keys());
  for (const auto& [key, value] : map) {
    EXPECT_EQ(value, key == "max_split_size" ? -1 : 0) << key;
  }
}

TEST(StatsTest, MapValuesAfterIncreasesAndDecreases) {
  const auto map = sample_stats().to_map();
  ASSERT_EQ(keys_of(map), expected_keys());

  // allocation: large +1 +1 -1, small +3.
  EXPECT_EQ(map.at("allocation.all.current"), 4);
  EXPECT_EQ(map.at("allocation.all.peak"), 4);
  EXPECT_EQ(map.at("allocation.all.allocated"), 5);
  EXPECT_EQ(map.at("allocation.all.freed"), 1);
  EXPECT_EQ(map.at("allocation.large_pool.current"), 1);
  EXPECT_EQ(map.at("allocation.large_pool.peak"), 2);
  EXPECT_EQ(map.at("allocation.large_pool.allocated"), 2);
  EXPECT_EQ(map.at("allocation.large_pool.freed"), 1);
  EXPECT_EQ(map.at("allocation.small_pool.current"), 3);
  EXPECT_EQ(map.at("allocation.small_pool.peak"), 3);
  EXPECT_EQ(map.at("allocation.small_pool.allocated"), 3);
  EXPECT_EQ(map.at("allocation.small_pool.freed"), 0);

  // allocated_bytes: large +4096 +1024 -4096, small +1536.
  EXPECT_EQ(map.at("allocated_bytes.all.current"), 2560);
  EXPECT_EQ(map.at("allocated_bytes.all.peak"), 5120);
  EXPECT_EQ(map.at("allocated_bytes.all.allocated"), 6656);
  EXPECT_EQ(map.at("allocated_bytes.all.freed"), 4096);
  EXPECT_EQ(map.at("allocated_bytes.large_pool.current"), 1024);
  EXPECT_EQ(map.at("allocated_bytes.large_pool.peak"), 5120);
  EXPECT_EQ(map.at("allocated_bytes.small_pool.current"), 1536);
  EXPECT_EQ(map.at("allocated_bytes.small_pool.peak"), 1536);

  EXPECT_EQ(map.at("requested_bytes.all.current"), 4000);
  EXPECT_EQ(map.at("requested_bytes.large_pool.allocated"), 4000);
  EXPECT_EQ(map.at("requested_bytes.small_pool.current"), 0);
  EXPECT_EQ(map.at("reserved_bytes.all.current"), 20 << 20);
  EXPECT_EQ(map.at("reserved_bytes.large_pool.peak"), 20 << 20);
  EXPECT_EQ(map.at("reserved_bytes.small_pool.peak"), 0);
  EXPECT_EQ(map.at("segment.large_pool.current"), 1);
  EXPECT_EQ(map.at("active.all.current"), 0);
  EXPECT_EQ(map.at("inactive_split_bytes.all.peak"), 0);

  EXPECT_EQ(map.at("oversize_allocations.current"), 1);
  EXPECT_EQ(map.at("oversize_allocations.peak"), 2);
  EXPECT_EQ(map.at("oversize_allocations.allocated"), 2);
  EXPECT_EQ(map.at("oversize_allocations.freed"), 1);
  EXPECT_EQ(map.at("oversize_segments.current"), 1);
  EXPECT_EQ(map.at("oversize_segments.allocated"), 1);

  EXPECT_EQ(map.at("num_alloc_retries"), 1);
  EXPECT_EQ(map.at("num_ooms"), 2);
  EXPECT_EQ(map.at("num_sync_all_streams"), 3);
  EXPECT_EQ(map.at("num_device_alloc"), 4);
  EXPECT_EQ(map.at("num_device_free"), 5);
  EXPECT_EQ(map.at("num_device_synchronizations"), 6);
  EXPECT_EQ(map.at("num_pages_remapped"), 7);
  EXPECT_EQ(map.at("num_pages_mapped"), 8);
  EXPECT_EQ(map.at("num_pages_unmapped"), 9);
  EXPECT_EQ(map.at("bytes_moved_between_streams"), 10);
  EXPECT_EQ(map.at("num_thread_cache_hits"), 11);
  EXPECT_EQ(map.at("num_stream_waits"), 12);
  EXPECT_EQ(map.at("max_split_size"), 128 << 20);
}

TEST(StatsTest, ResetPeakSetsPeakToCurrentEverywhere) {
  auto s = sample_stats();
  const auto before = s.to_map();
  s.reset_peak();
  const auto after = s.to_map();
  for (const auto& [key, value] : after) {
    const auto dot = key.rfind('.');
    const std::string field = dot == std::string::npos ? "" : key.substr(dot + 1);
    if (field == "peak") {
      EXPECT_EQ(value, after.at(key.substr(0, dot) + ".current")) << key;
    } else {
      EXPECT_EQ(value, before.at(key)) << key;  // nothing else changes
    }
  }
  EXPECT_EQ(after.at("allocated_bytes.all.peak"), 2560);
  EXPECT_EQ(after.at("allocation.large_pool.peak"), 1);
  EXPECT_EQ(after.at("oversize_allocations.peak"), 1);

  // Peaks grow again from the new baseline.
  device_stats::increase(s.allocated_bytes, stat_group::small_pool, 512);
  EXPECT_EQ(s.allocated_bytes[0].peak, 3072);
  EXPECT_EQ(s.allocated_bytes[1].peak, 2048);
  EXPECT_EQ(s.allocated_bytes[2].peak, 1024);
}

TEST(StatsTest, ResetAccumulatedZeroesAllocatedFreedAndEventCounters) {
  auto s = sample_stats();
  const auto before = s.to_map();
  s.reset_accumulated();
  const auto after = s.to_map();
  const std::set<std::string> counters = {"num_alloc_retries", "num_ooms",
                                          "num_sync_all_streams", "num_device_alloc",
                                          "num_device_free", "num_device_synchronizations",
                                          "num_pages_remapped", "num_pages_mapped", "num_pages_unmapped",
                                          "bytes_moved_between_streams", "num_thread_cache_hits",
                                          "num_stream_waits"};
  for (const auto& [key, value] : after) {
    const auto dot = key.rfind('.');
    const std::string field = dot == std::string::npos ? "" : key.substr(dot + 1);
    if (field == "allocated" || field == "freed" || counters.count(key) != 0) {
      EXPECT_EQ(value, 0) << key;
    } else {
      EXPECT_EQ(value, before.at(key)) << key;  // current, peak, max_split_size kept
    }
  }
  EXPECT_EQ(after.at("allocation.all.current"), 4);
  EXPECT_EQ(after.at("allocated_bytes.all.peak"), 5120);
  EXPECT_EQ(after.at("max_split_size"), 128 << 20);
}

}  // namespace
}  // namespace ccalloc
