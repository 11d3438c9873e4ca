// A destroyed stream's memory with reuse_across_streams:False (SPEC X2, P10):
// no other stream may take its cached segments over, so they go back to the
// device when it is destroyed, and a segment that still holds a live block
// when that block is freed; a block recorded on another stream only once
// that stream's work has run. With the default configuration the cached
// memory stays for other streams to adopt.
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/core/config.hpp>
#include <ccalloc/core/device_caching_allocator.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace {

using namespace ccalloc;  // NOLINT: test file

constexpr std::size_t MiB = std::size_t{1} << 20;

class DestroyedStreamRelease : public ::testing::TestWithParam<const char*> {
 protected:
  void make(const std::string& conf) {
    sim_options o;
    o.capacity_bytes = 256 * MiB;
    sim = std::make_shared<sim_backend>(o);
    alloc = std::make_unique<caching_allocator>(sim, allocator_config::parse(conf));
    alloc->init(1);
  }
  void TearDown() override {
    if (alloc) dev().check_invariants();
    EXPECT_EQ(sim->counters().unsafe_unmaps, 0u) << "a page was unmapped while work could still use it";
  }
  device_caching_allocator& dev() { return alloc->device_allocator(0); }
  std::int64_t reserved() { return dev().stats().reserved_bytes[0].current; }
  std::size_t segments_of(stream_t s) {
    std::size_t n = 0;
    for (const segment_info& si : dev().segments()) n += si.stream == s ? 1 : 0;
    return n;
  }
  std::shared_ptr<sim_backend> sim;
  std::unique_ptr<caching_allocator> alloc;
};

std::string unshared(const char* kind) { return std::string("reuse_across_streams:False,") + kind; }

// Destroyed with a block live: its cached memory goes back at once, the
// segment of the live block when that block is freed.
TEST_P(DestroyedStreamRelease, CachedMemoryGoesAtDestroyAndTheRestAtTheLastFree) {
  make(unshared(GetParam()));
  const stream_t s = alloc->create_stream(0);
  void* kept = alloc->malloc(0, 4 * MiB, s);
  void* cached = alloc->malloc(0, 30 * MiB, s);  // its own segment (or pages)
  alloc->free(cached);
  const std::int64_t with_cache = reserved();
  EXPECT_GE(with_cache, static_cast<std::int64_t>(34 * MiB));
  const std::uint64_t frees_before = dev().stats().num_device_free;
  alloc->destroy_stream(0, s);
  EXPECT_GE(segments_of(s), 1u) << "the live block's segment stays";
  EXPECT_LE(reserved(), static_cast<std::int64_t>(20 * MiB)) << "the cached 30 MiB went back";
  EXPECT_GT(dev().stats().num_device_free, frees_before);
  alloc->free(kept);
  EXPECT_EQ(segments_of(s), 0u);
  EXPECT_EQ(reserved(), 0);
  EXPECT_EQ(dev().stats().segment[0].current, 0);
  EXPECT_EQ(sim->counters().mapped_bytes, 0u);
  EXPECT_EQ(sim->counters().live_handles, 0u);
}

// A block recorded on a side stream whose work is still queued: its memory
// waits for that work, then goes back at the next world lock.
TEST_P(DestroyedStreamRelease, ABlockRecordedOnAnotherStreamGoesOnlyOnceThatWorkHasRun) {
  make(unshared(GetParam()));
  const stream_t s = alloc->create_stream(0);
  const stream_t side = sim->create_stream(0);
  void* p = alloc->malloc(0, 4 * MiB, s);
  sim->enqueue_work(0, side, sim->now() + 1'000);
  sim->use_memory(0, p, 4 * MiB, side);
  alloc->record_stream(p, side);
  alloc->destroy_stream(0, s);
  alloc->free(p);
  EXPECT_EQ(segments_of(s), 1u) << "released before the side stream's use completed";
  EXPECT_GT(reserved(), 0);
  sim->advance_to(sim->busy_until(0, side));
  void* other = alloc->malloc(0, 64 * MiB, 0);  // its slow path finds the event completed
  EXPECT_EQ(segments_of(s), 0u);
  EXPECT_EQ(reserved(), static_cast<std::int64_t>(64 * MiB));
  alloc->free(other);
  alloc->empty_cache();
  EXPECT_EQ(reserved(), 0);
  EXPECT_EQ(sim->counters().live_handles, 0u);
}

// The default (reuse_across_streams:True): the destroyed stream's cached
// segment stays for another stream to take over, as before.
TEST_P(DestroyedStreamRelease, WithReuseAcrossStreamsTheCacheStaysForOtherStreams) {
  make(GetParam());
  const stream_t s = alloc->create_stream(0);
  alloc->free(alloc->malloc(0, 30 * MiB, s));
  const std::int64_t cached = reserved();
  alloc->destroy_stream(0, s);
  EXPECT_EQ(reserved(), cached);
  EXPECT_EQ(segments_of(s), 1u);
  void* p = alloc->malloc(0, 30 * MiB, alloc->create_stream(0));
  EXPECT_EQ(reserved(), cached) << "another stream took the cached memory over";
  alloc->free(p);
}

INSTANTIATE_TEST_SUITE_P(SegmentKinds, DestroyedStreamRelease,
                         ::testing::Values("expandable_segments:True", "expandable_segments:False"));

}  // namespace
