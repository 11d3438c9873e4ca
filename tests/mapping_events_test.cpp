// Mapping announcements (SPEC C1) on the simulated device: every path that
// changes what is mapped announces it, a map after the device mapped, an
// unmap before it unmaps, and a table built from the announcements equals
// what the allocator has mapped.
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/detail/spin_mutex.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/core/config.hpp>
#include <ccalloc/core/mapping_events.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include "mapping_table.hpp"

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace ccalloc;  // NOLINT: test file
using ccalloc::testing::mapped_ranges;
using ccalloc::testing::mapping_table;

constexpr std::size_t MiB = mib;

class MappingEventsTest : public ::testing::Test {
 protected:
  void make(const std::string& conf, std::size_t capacity = 256 * MiB) {
    alloc.reset();
    sim_options o;
    o.capacity_bytes = capacity;
    sim = std::make_shared<sim_backend>(o);
    alloc = std::make_unique<caching_allocator>(sim, allocator_config::parse(conf));
    alloc->init(1);
    alloc->attach_mapping_listener([this](const mapping_event& e) { on_event(e); });
  }
  // The device's bytes in use by the allocator: mapped pages and plain segments.
  std::size_t device_bytes() const {
    const sim_counters c = sim->counters();
    return c.mapped_bytes + (c.used_bytes - c.handle_bytes);
  }
  void on_event(const mapping_event& e) {
    events.push_back(e);
    // Everything in the table is mapped on the device when an unmap is
    // announced (before it) and after a map (announced after it).
    if (e.change == mapping_change::unmap && device_bytes() < table.bytes())
      late.push_back("unmap announced after the device unmapped");
    table.apply(e);
    if (e.change == mapping_change::map && device_bytes() < table.bytes())
      late.push_back("map announced before the device mapped");
  }
  void TearDown() override {
    if (!alloc) return;
    EXPECT_EQ(table.error(), "");
    EXPECT_TRUE(late.empty()) << late.front();
    EXPECT_EQ(table.ranges(), mapped_ranges(alloc->device_allocator(0)));
  }
  std::size_t count(mapping_change c, mapping_reason r) const {
    std::size_t n = 0;
    for (const auto& e : events) n += e.change == c && e.reason == r ? 1 : 0;
    return n;
  }
  std::size_t bytes(mapping_change c, mapping_reason r) const {
    std::size_t n = 0;
    for (const auto& e : events) n += e.change == c && e.reason == r ? e.size_bytes : 0;
    return n;
  }
  void* m(std::size_t bytes, stream_t s = 0) { return alloc->malloc(0, bytes, s); }

  std::shared_ptr<sim_backend> sim;
  std::unique_ptr<caching_allocator> alloc;
  std::vector<mapping_event> events;
  std::vector<std::string> late;
  mapping_table table;
};

TEST_F(MappingEventsTest, PlainSegmentsAreAnnouncedMadeAndReturned) {
  make("expandable_segments:False");
  void* a = m(5 * MiB);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].change, mapping_change::map);
  EXPECT_EQ(events[0].reason, mapping_reason::segment_alloc);
  EXPECT_EQ(events[0].addr, reinterpret_cast<std::uintptr_t>(a));
  EXPECT_EQ(events[0].size_bytes, 20 * MiB) << "the whole segment (a large request's 20 MiB)";
  EXPECT_FALSE(events[0].expandable);
  EXPECT_EQ(events[0].device, 0);
  alloc->free(a);
  EXPECT_EQ(events.size(), 1u) << "a cached block changes no mapping";
  alloc->empty_cache();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[1].change, mapping_change::unmap);
  EXPECT_EQ(events[1].reason, mapping_reason::segment_free);
  EXPECT_EQ(events[1].size_bytes, 20 * MiB);
  EXPECT_EQ(table.bytes(), 0u);
}

TEST_F(MappingEventsTest, ANoCachingFreeAnnouncesItsSegmentBeforeReturningIt) {
  make("expandable_segments:False");
  alloc->enable(false);
  alloc->free(m(3 * MiB));
  EXPECT_EQ(count(mapping_change::map, mapping_reason::segment_alloc), 1u);
  EXPECT_EQ(count(mapping_change::unmap, mapping_reason::segment_free), 1u);
  EXPECT_EQ(table.bytes(), 0u);
}

TEST_F(MappingEventsTest, ExpandablePagesAreAnnouncedMappedAndReleased) {
  make("expandable_segments:True");
  void* a = m(5 * MiB);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].change, mapping_change::map);
  EXPECT_EQ(events[0].reason, mapping_reason::pages_mapped);
  EXPECT_EQ(events[0].size_bytes, 6 * MiB) << "3 pages";
  EXPECT_TRUE(events[0].expandable);
  void* b = m(5 * MiB);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[1].addr, events[0].addr + 6 * MiB) << "only the 2 new pages";
  EXPECT_EQ(events[1].size_bytes, 4 * MiB);
  alloc->free(a);
  alloc->free(b);
  alloc->empty_cache();
  EXPECT_EQ(bytes(mapping_change::unmap, mapping_reason::pages_released), 10 * MiB);
  EXPECT_EQ(table.bytes(), 0u);
}

TEST_F(MappingEventsTest, RecycledPagesAreUnmappedFromOneStreamAndMappedForAnother) {
  make("reuse_across_streams:False");
  const stream_t other = sim->create_stream(0);
  alloc->free(m(20 * MiB));
  void* b = m(20 * MiB, other);  // a new peak avoided: stream 0's 10 pages move
  EXPECT_EQ(bytes(mapping_change::unmap, mapping_reason::pages_recycled), 20 * MiB);
  EXPECT_EQ(bytes(mapping_change::map, mapping_reason::pages_mapped), 40 * MiB);
  EXPECT_EQ(events.back().stream, other);
  EXPECT_EQ(events.back().change, mapping_change::map);
  EXPECT_EQ(table.bytes(), 20 * MiB);
  alloc->free(b);
}

TEST_F(MappingEventsTest, RetiredPagesAreAnnouncedUnmappedAtOnceAndTheDeviceUnmapLater) {
  make("reuse_across_streams:False");
  const stream_t s = sim->create_stream(0);
  void* a = m(20 * MiB, s);
  void* keep = m(3 * MiB, s);
  sim->enqueue_work(0, s, 100);
  sim->use_memory(0, a, 20 * MiB, s);
  alloc->free(a);
  void* c = m(30 * MiB, s);  // A's pages move while its kernel runs; their old mapping stays
  EXPECT_EQ(bytes(mapping_change::unmap, mapping_reason::pages_retired), 20 * MiB);
  EXPECT_EQ(count(mapping_change::unmap_completed, mapping_reason::deferred_unmap), 0u);
  EXPECT_EQ(table.ranges(), mapped_ranges(alloc->device_allocator(0)));
  sim->advance_to(100);
  alloc->free(m(40 * MiB, s));  // a slow path settles the deferred unmaps
  EXPECT_EQ(bytes(mapping_change::unmap_completed, mapping_reason::deferred_unmap), 20 * MiB);
  EXPECT_EQ(sim->counters().unsafe_unmaps, 0u);
  alloc->free(c);
  alloc->free(keep);
}

TEST_F(MappingEventsTest, AnAdoptedReservationIsAnnouncedMovedWhereItIs) {
  make("");
  const stream_t other = sim->create_stream(0);
  alloc->free(m(20 * MiB));
  const std::size_t maps_before = count(mapping_change::map, mapping_reason::pages_mapped);
  void* b = m(20 * MiB, other);  // stream 0's whole reservation becomes other's
  EXPECT_EQ(count(mapping_change::map, mapping_reason::pages_mapped), maps_before) << "nothing mapped again";
  ASSERT_EQ(count(mapping_change::move, mapping_reason::reservation_moved), 1u);
  EXPECT_EQ(events.back().stream, other);
  EXPECT_EQ(events.back().size_bytes, 20 * MiB);
  alloc->free(b);
}

TEST_F(MappingEventsTest, AThrowingListenerIsDroppedAndTheOthersStillRun) {
  make("");
  int second = 0;
  alloc->attach_mapping_listener([](const mapping_event&) { throw std::runtime_error("listener failed"); });
  alloc->attach_mapping_listener([&](const mapping_event&) { ++second; });
  void* a = m(MiB);
  EXPECT_EQ(second, 1);
  alloc->free(a);
  EXPECT_THROW(alloc->attach_mapping_listener(mapping_listener{}), invalid_argument_error);
}

TEST_F(MappingEventsTest, ListenersReachDevicesInitializedLater) {
  sim_options o;
  o.capacity_bytes = 64 * MiB;
  o.device_count = 2;
  sim = std::make_shared<sim_backend>(o);
  alloc = std::make_unique<caching_allocator>(sim, allocator_config::parse(""));
  alloc->init(1);
  std::vector<int> devices;
  alloc->attach_mapping_listener([&](const mapping_event& e) { devices.push_back(e.device); });
  alloc->init(2);
  alloc->free(alloc->malloc(1, MiB, 0));
  alloc->empty_cache();
  EXPECT_EQ(devices, (std::vector<int>{1, 1}));
  alloc.reset();  // the table of this test is not attached
}

TEST(MappingEventNames, EveryChangeAndReasonHasItsName) {
  EXPECT_EQ(to_string(mapping_change::unmap_completed), "unmap_completed");
  EXPECT_EQ(to_string(mapping_reason::pages_retired), "pages_retired");
  EXPECT_EQ(to_string(mapping_reason::reservation_moved), "reservation_moved");
}

}  // namespace

namespace {

// Pause releases a tag's pages (announced before they go) and resume maps
// them again at the same addresses (announced once mapped): a registration
// table kept from the announcements never holds a paused page.
TEST_F(MappingEventsTest, PauseAndResumeAnnounceTheTagsPages) {
  make("");
  void* live = nullptr;
  {
    tag_scope scope("kv_cache");
    live = m(6 * MiB);
    void* gone = m(4 * MiB);
    alloc->free(gone);
  }
  const std::size_t mapped_before = table.bytes();
  ASSERT_GE(mapped_before, 10 * MiB);
  const sleep_result paused = alloc->pause({"kv_cache"}, /*keep_contents=*/false);
  // The pages under the live block are paused; the tag's cached free pages
  // are given back to the device first, as empty_cache would.
  EXPECT_EQ(bytes(mapping_change::unmap, mapping_reason::pages_paused), 6 * MiB);
  EXPECT_EQ(bytes(mapping_change::unmap, mapping_reason::pages_paused) +
                bytes(mapping_change::unmap, mapping_reason::pages_released),
            paused.released_bytes);
  EXPECT_EQ(paused.released_bytes, mapped_before) << "every page of the tag goes, its cached pages too";
  EXPECT_EQ(table.bytes(), 0u);
  EXPECT_EQ(count(mapping_change::map, mapping_reason::pages_resumed), 0u);
  alloc->resume({"kv_cache"});
  EXPECT_EQ(bytes(mapping_change::map, mapping_reason::pages_resumed), 6 * MiB)
      << "the pages under the live block come back; the freed block's do not";
  EXPECT_EQ(table.bytes(), 6 * MiB);
  alloc->free(live);
}

}  // namespace

namespace {

// A listener runs with its device's locks held: a call back into the
// allocator fails with an error naming the rule (or, on the paths below
// the world lock, stops the process with that message) instead of hanging.
TEST_F(MappingEventsTest, AListenerThatCallsIntoTheAllocatorGetsAnErrorNotAHang) {
  make("");
  std::vector<std::string> refused;
  bool attached_inside = false;
  int later_listener = 0;
  alloc->attach_mapping_listener([&](const mapping_event& e) {
    if (e.change != mapping_change::map) return;
    for (const auto& call : std::vector<std::function<void()>>{[&] { alloc->empty_cache(); },
                                                              [&] { alloc->set_config("max_split_size_mb:64"); },
                                                              [&] { alloc->enable(false); }}) {
      try {
        call();
        refused.emplace_back("accepted");
      } catch (const invalid_argument_error& err) {
        refused.emplace_back(err.what());
      }
    }
    (void)alloc->config();  // allowed: no device lock
    if (!attached_inside) alloc->attach_mapping_listener([&](const mapping_event&) { ++later_listener; });
    attached_inside = true;
  });
  void* a = m(MiB);
  ASSERT_EQ(refused.size(), 3u);
  for (const std::string& msg : refused)
    EXPECT_NE(msg.find("a listener must not call into any ccalloc allocator"), std::string::npos) << msg;
  EXPECT_TRUE(attached_inside);
  EXPECT_TRUE(alloc->is_enabled()) << "the refused enable(false) changed nothing";
  EXPECT_EQ(alloc->config().max_split_size_bytes, allocator_config{}.max_split_size_bytes);
  alloc->free(a);
  alloc->empty_cache();
  EXPECT_EQ(later_listener, 1) << "the listener attached from inside a listener sees the unmap";
}

// enable() and set_config() announce while they hold the configuration:
// their listeners may still read it and attach listeners.
TEST_F(MappingEventsTest, AListenerOfEnableMayReadTheConfigurationAndAttachAnother) {
  make("");
  alloc->free(m(MiB));  // a cached segment: enable(false) returns it
  std::size_t seen = 0;
  alloc->attach_mapping_listener([&](const mapping_event& e) {
    if (e.change != mapping_change::unmap) return;
    seen = alloc->config().max_split_size_bytes;
    alloc->attach_mapping_listener([](const mapping_event&) {});
  });
  alloc->enable(false);
  EXPECT_EQ(seen, allocator_config{}.max_split_size_bytes);
  alloc->enable(true);
}

using MappingEventsDeathTest = MappingEventsTest;

TEST_F(MappingEventsDeathTest, AListenerThatAllocatesStopsTheProcessWithTheRule) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        make("");
        alloc->attach_mapping_listener([&](const mapping_event& e) {
          if (e.change == mapping_change::map) alloc->free(alloc->malloc(0, 512, 0));
        });
        (void)m(MiB);
      },
      "a mapping listener called into the allocator.*must not call into any ccalloc allocator");
  alloc.reset();
}

// A history callback of the C API (release, frames) runs counted as a
// mapping listener, under its own name (tls_locked_callback): a lock it
// finds held by its own thread stops the process naming that callback.
TEST(LockedCallbackDeathTest, AHeldLockReenteredFromAHistoryCallbackNamesTheCallback) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        detail::nap_lock held;
        held.lock();
        ++detail::tls_mapping_listener_depth;
        detail::tls_locked_callback = "the history's release function (ccalloc_history_options_t.release)";
        held.lock();
      },
      "ccalloc: the history's release function \\(ccalloc_history_options_t.release\\) called into the "
      "allocator, whose locks the calling thread may hold \\(ccalloc/ccalloc.h: ccalloc_history_options_t: it "
      "must not call into any ccalloc allocator\\); aborting instead of deadlocking");
  EXPECT_DEATH(
      {
        detail::spin_mutex held;
        held.lock();
        ++detail::tls_mapping_listener_depth;
        detail::tls_locked_callback = "the history's frames function (ccalloc_history_options_t.frames)";
        held.lock();
      },
      "ccalloc: the history's frames function \\(ccalloc_history_options_t.frames\\) called into the allocator");
  EXPECT_DEATH(
      {
        detail::nap_lock held;
        held.lock();
        ++detail::tls_mapping_listener_depth;
        held.lock();
      },
      "ccalloc: a mapping listener called into the allocator");
}

}  // namespace
