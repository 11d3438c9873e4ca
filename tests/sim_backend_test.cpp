// sim_backend_test.cpp: the simulated device (include/ccalloc/backend/sim_backend.hpp):
// capacity and granularity charging, exhaustion, mem_get_info, streams and
// events on the virtual clock, fault injection, errors for unknown handles and
// devices, counters, and that its "device memory" is real, writable memory.
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/base/types.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include <gtest/gtest.h>

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace {

using ccalloc::backend_error;
using ccalloc::host_memory_error;
using ccalloc::gib;
using ccalloc::mib;
using ccalloc::sim_backend;
using ccalloc::sim_options;
using ccalloc::segment_placement;
using ccalloc::invalid_argument_error;

sim_options small_device(std::size_t capacity = 10 * mib, int devices = 1) {
  sim_options o;
  o.device_count = devices;
  o.capacity_bytes = capacity;
  o.granularity_bytes = 2 * mib;
  return o;
}

// ---- construction and devices ----------------------------------------------------

TEST(SimBackend, DefaultsAreOneH200SizedDevice) {
  sim_backend sim;
  EXPECT_EQ(sim.name(), "sim");
  EXPECT_EQ(sim.device_count(), 1);
  const auto info = sim.mem_get_info(0);
  EXPECT_EQ(info.total_bytes, std::size_t{141} * 1000 * 1000 * 1000);
  EXPECT_EQ(info.free_bytes, info.total_bytes);
  EXPECT_EQ(sim.now(), 0u);
  const auto c = sim.counters();
  EXPECT_EQ(c.segment_mallocs, 0u);
  EXPECT_EQ(c.segment_frees, 0u);
  EXPECT_EQ(c.failed_mallocs, 0u);
  EXPECT_EQ(c.used_bytes, 0u);
  EXPECT_EQ(c.live_events, 0u);
  EXPECT_EQ(c.live_streams, 0u);
}

TEST(SimBackend, RejectsBadOptions) {
  sim_options o;
  o.device_count = 0;
  EXPECT_THROW(sim_backend{o}, backend_error);
  o.device_count = 1;
  o.granularity_bytes = 3 * mib;  // not a power of two
  EXPECT_THROW(sim_backend{o}, backend_error);
  o.granularity_bytes = 0;
  EXPECT_THROW(sim_backend{o}, backend_error);
}

TEST(SimBackend, CurrentDeviceIsPerThreadAndChecked) {
  sim_backend sim(small_device(10 * mib, 3));
  EXPECT_EQ(sim.device_count(), 3);
  EXPECT_EQ(sim.current_device(), 0);
  sim.set_device(2);
  EXPECT_EQ(sim.current_device(), 2);
  int other_thread_device = -1;
  std::thread([&] { other_thread_device = sim.current_device(); }).join();
  EXPECT_EQ(other_thread_device, 0) << "the current device is a per-thread setting";
  EXPECT_THROW(sim.set_device(3), backend_error);
  EXPECT_THROW(sim.set_device(-1), backend_error);
  EXPECT_EQ(sim.current_device(), 2) << "a failed set_device changes nothing";
  sim.set_device(0);  // leave this thread as we found it
}

TEST(SimBackend, UnknownDeviceThrowsEverywhere) {
  sim_backend sim(small_device(10 * mib, 2));
  EXPECT_THROW((void)sim.mem_get_info(2), backend_error);
  EXPECT_THROW((void)sim.mem_get_info(-1), backend_error);
  EXPECT_THROW((void)sim.segment_malloc(2, mib), backend_error);
  EXPECT_THROW((void)sim.create_stream(2), backend_error);
  EXPECT_THROW((void)sim.create_event(-1), backend_error);
  EXPECT_THROW(sim.synchronize_device(2), backend_error);
  EXPECT_THROW(sim.enqueue_work(5, 0, 10), backend_error);
  EXPECT_THROW(sim.set_capacity(2, gib), backend_error);
  EXPECT_THROW((void)sim.busy_until(2, 0), backend_error);
  EXPECT_EQ(sim.counters().failed_mallocs, 0u) << "a bad device is an error, not out of memory";
}

// ---- capacity and granularity --------------------------------------------------

TEST(SimBackend, ChargesSegmentsRoundedUpToTheGranularity) {
  sim_backend sim(small_device(10 * mib));
  void* a = sim.segment_malloc(0, 1);  // charged 2 MiB
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(sim.mem_get_info(0).free_bytes, 8 * mib);
  EXPECT_EQ(sim.counters().used_bytes, 2 * mib);
  void* b = sim.segment_malloc(0, 3 * mib);  // charged 4 MiB
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(sim.mem_get_info(0).free_bytes, 4 * mib);
  void* c = sim.segment_malloc(0, 2 * mib);  // exactly one granule
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(sim.mem_get_info(0).free_bytes, 2 * mib);
  EXPECT_EQ(sim.mem_get_info(0).total_bytes, 10 * mib);
  EXPECT_EQ(sim.counters().used_bytes, 8 * mib);
  EXPECT_EQ(sim.counters().segment_mallocs, 3u);
  sim.segment_free(0, b);
  EXPECT_EQ(sim.mem_get_info(0).free_bytes, 6 * mib) << "a free returns the charged (rounded) bytes";
  sim.segment_free(0, a);
  sim.segment_free(0, c);
  EXPECT_EQ(sim.mem_get_info(0).free_bytes, 10 * mib);
  EXPECT_EQ(sim.counters().used_bytes, 0u);
  EXPECT_EQ(sim.counters().segment_frees, 3u);
}

// ---- addresses ---------------------------------------------------------------------

std::uintptr_t addr(void* p) { return reinterpret_cast<std::uintptr_t>(p); }

// Each segment goes at the lowest free address of the device's own range, so
// the layout follows the calls alone (host mmap hands out falling addresses).
TEST(SimBackend, SegmentsTakeTheLowestFreeAddressOfTheDevicesOwnRange) {
  sim_backend sim(small_device(64 * mib));
  void* a = sim.segment_malloc(0, 4 * mib);
  void* b = sim.segment_malloc(0, 2 * mib);
  void* c = sim.segment_malloc(0, 6 * mib);
  ASSERT_TRUE(a && b && c);
  EXPECT_EQ(addr(a) % (2 * mib), 0u);
  EXPECT_EQ(addr(b), addr(a) + 4 * mib);
  EXPECT_EQ(addr(c), addr(b) + 2 * mib);
  std::memset(c, 0x5a, 6 * mib);  // mapped read/write
  sim.segment_free(0, b);
  void* d = sim.segment_malloc(0, 4 * mib);  // does not fit b's hole: after c
  EXPECT_EQ(addr(d), addr(c) + 6 * mib);
  void* e = sim.segment_malloc(0, 2 * mib);  // b's hole
  EXPECT_EQ(e, b);
  sim.segment_free(0, a);
  sim.segment_free(0, e);
  void* f = sim.segment_malloc(0, 6 * mib);  // a's and b's stretches, coalesced
  EXPECT_EQ(f, a);
  EXPECT_EQ(static_cast<unsigned char*>(f)[0], 0) << "a reused stretch reads as new memory";
  for (void* p : {c, d, f}) sim.segment_free(0, p);
  EXPECT_EQ(sim.segment_malloc(0, 2 * mib), a) << "everything freed: the range starts over";
}

TEST(SimBackend, EachDeviceHasItsOwnRange) {
  sim_options o = small_device(64 * mib);
  o.device_count = 2;
  sim_backend sim(o);
  void* a0 = sim.segment_malloc(0, 2 * mib);
  void* a1 = sim.segment_malloc(1, 2 * mib);
  void* b0 = sim.segment_malloc(0, 2 * mib);
  void* b1 = sim.segment_malloc(1, 2 * mib);
  EXPECT_EQ(addr(b0), addr(a0) + 2 * mib);
  EXPECT_EQ(addr(b1), addr(a1) + 2 * mib);
  for (void* p : {a0, b0}) sim.segment_free(0, p);
  for (void* p : {a1, b1}) sim.segment_free(1, p);
}

// place_segments: the k-th successful segment_malloc goes at the planned
// offset when its size agrees and the stretch is free; else lowest free.
TEST(SimBackend, PlaceSegmentsPutsTheNextMallocsWhereThePlanSays) {
  sim_backend sim(small_device(64 * mib));
  void* probe = sim.segment_malloc(0, 2 * mib);  // the range's base (lowest free)
  ASSERT_NE(probe, nullptr);
  const std::uintptr_t base = addr(probe);
  sim.segment_free(0, probe);
  sim.place_segments(0, {{10 * mib, 2 * mib}, {0, 4 * mib}, {20 * mib, 2 * mib}, {0, 2 * mib}});
  EXPECT_EQ(sim.segment_malloc(0, 66 * mib), nullptr);  // a failed malloc takes no entry
  void* a = sim.segment_malloc(0, 2 * mib);
  void* b = sim.segment_malloc(0, 3 * mib + 1);  // charged 4 MiB, as planned
  void* c = sim.segment_malloc(0, 4 * mib);      // planned 2 MiB: lowest free instead
  void* d = sim.segment_malloc(0, 2 * mib);      // planned stretch taken by b: lowest free
  void* e = sim.segment_malloc(0, 2 * mib);      // past the plan: lowest free
  EXPECT_EQ(addr(a), base + 10 * mib);
  EXPECT_EQ(addr(b), base);
  EXPECT_EQ(addr(c), base + 4 * mib);
  EXPECT_EQ(addr(d), base + 8 * mib);
  EXPECT_EQ(addr(e), base + 12 * mib);
  for (void* p : {a, b, c, d, e}) sim.segment_free(0, p);
}

TEST(SimBackend, PlaceSegmentsRejectsEntriesOffTheGranularity) {
  sim_backend sim(small_device(64 * mib));
  sim.place_segments(0, {{4 * mib, 2 * mib}});
  for (const segment_placement bad : {segment_placement{mib, 2 * mib}, segment_placement{0, 3 * mib},
                                      segment_placement{0, 0}}) {
    try {
      sim.place_segments(0, {{0, 2 * mib}, bad});
      ADD_FAILURE() << "expected invalid_argument_error";
    } catch (const invalid_argument_error& e) {
      EXPECT_EQ(std::string(e.what()), "sim: place_segments(device 0): entry at offset " +
                                           std::to_string(bad.offset_bytes) + " of " + std::to_string(bad.size_bytes) +
                                           " bytes is not a nonzero multiple of the granularity (2097152 bytes)");
    }
  }
  void* a = sim.segment_malloc(0, 2 * mib);  // the earlier plan holds
  void* b = sim.segment_malloc(0, 2 * mib);
  EXPECT_EQ(addr(a), addr(b) + 4 * mib);
  sim.segment_free(0, a);
  sim.segment_free(0, b);
}

TEST(SimBackend, ReturnsNullWhenCapacityWouldBeExceeded) {
  sim_backend sim(small_device(10 * mib));
  void* a = sim.segment_malloc(0, 6 * mib);
  ASSERT_NE(a, nullptr);
  // 4 MiB left: 4 MiB + 1 byte is charged 6 MiB and does not fit.
  EXPECT_EQ(sim.segment_malloc(0, 4 * mib + 1), nullptr);
  EXPECT_EQ(sim.counters().failed_mallocs, 1u);
  EXPECT_EQ(sim.counters().segment_mallocs, 1u);
  EXPECT_EQ(sim.mem_get_info(0).free_bytes, 4 * mib) << "a failed malloc charges nothing";
  void* b = sim.segment_malloc(0, 4 * mib);  // exactly the rest
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(sim.mem_get_info(0).free_bytes, 0u);
  EXPECT_EQ(sim.segment_malloc(0, 1), nullptr);
  EXPECT_EQ(sim.counters().failed_mallocs, 2u);
  // Sizes whose rounding would overflow are out of memory, not UB.
  EXPECT_EQ(sim.segment_malloc(0, std::numeric_limits<std::size_t>::max()), nullptr);
  EXPECT_EQ(sim.counters().failed_mallocs, 3u);
  sim.segment_free(0, a);
  void* c = sim.segment_malloc(0, 5 * mib);  // charged 6 MiB, fits again
  EXPECT_NE(c, nullptr);
  sim.segment_free(0, b);
  sim.segment_free(0, c);
}

TEST(SimBackend, ZeroByteMallocIsAnError) {
  sim_backend sim(small_device());
  EXPECT_THROW((void)sim.segment_malloc(0, 0), backend_error);
  EXPECT_EQ(sim.counters().failed_mallocs, 0u);
}

TEST(SimBackend, CustomGranularity) {
  sim_options o = small_device(1 * mib);
  o.granularity_bytes = 64 * 1024;
  sim_backend sim(o);
  void* a = sim.segment_malloc(0, 1);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(sim.counters().used_bytes, 64u * 1024);
  void* b = sim.segment_malloc(0, 64 * 1024 + 1);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(sim.counters().used_bytes, 3u * 64 * 1024);
  sim.segment_free(0, a);
  sim.segment_free(0, b);
}

TEST(SimBackend, SegmentsAreAlignedWritableAndDistinct) {
  sim_backend sim(small_device(64 * mib));
  std::vector<void*> segs;
  for (std::size_t size : {std::size_t{512}, 1 * mib, 3 * mib + 17, 8 * mib}) {
    void* p = sim.segment_malloc(0, size);
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 512, 0u) << "segments are at least 512-byte aligned";
    // Write every byte asked for, with a pattern unique to the segment.
    auto* bytes = static_cast<unsigned char*>(p);
    const auto pattern = static_cast<unsigned char>(segs.size() + 1);
    std::memset(bytes, pattern, size);
    EXPECT_EQ(bytes[0], pattern);
    EXPECT_EQ(bytes[size - 1], pattern);
    segs.push_back(p);
  }
  // No two segments overlap: each still holds its own pattern.
  for (std::size_t i = 0; i < segs.size(); ++i)
    EXPECT_EQ(static_cast<unsigned char*>(segs[i])[0], static_cast<unsigned char>(i + 1));
  for (void* p : segs) sim.segment_free(0, p);
  EXPECT_EQ(sim.counters().used_bytes, 0u);
}

TEST(SimBackend, CapacityIsPerDevice) {
  sim_backend sim(small_device(4 * mib, 2));
  void* a = sim.segment_malloc(0, 4 * mib);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(sim.segment_malloc(0, 1), nullptr);
  void* b = sim.segment_malloc(1, 4 * mib);  // device 1 is untouched
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(sim.mem_get_info(0).free_bytes, 0u);
  EXPECT_EQ(sim.mem_get_info(1).free_bytes, 0u);
  EXPECT_EQ(sim.counters().used_bytes, 8 * mib) << "used_bytes counts all devices";
  // A segment belongs to its device.
  EXPECT_THROW(sim.segment_free(1, a), backend_error);
  sim.segment_free(0, a);
  sim.segment_free(1, b);
}

TEST(SimBackend, UnknownOrFreedSegmentThrows) {
  sim_backend sim(small_device());
  int host = 0;
  EXPECT_THROW(sim.segment_free(0, &host), backend_error);
  EXPECT_THROW(sim.segment_free(0, nullptr), backend_error);
  void* p = sim.segment_malloc(0, mib);
  ASSERT_NE(p, nullptr);
  EXPECT_THROW(sim.segment_free(0, static_cast<char*>(p) + 512), backend_error) << "interior pointer";
  sim.segment_free(0, p);
  EXPECT_THROW(sim.segment_free(0, p), backend_error) << "double free";
  EXPECT_EQ(sim.counters().segment_frees, 1u);
  EXPECT_EQ(sim.counters().used_bytes, 0u);
}

TEST(SimBackend, SetCapacityKeepsLiveSegments) {
  sim_backend sim(small_device(10 * mib));
  void* a = sim.segment_malloc(0, 6 * mib);
  ASSERT_NE(a, nullptr);
  sim.set_capacity(0, 4 * mib);  // below what is in use
  EXPECT_EQ(sim.mem_get_info(0).total_bytes, 4 * mib);
  EXPECT_EQ(sim.mem_get_info(0).free_bytes, 0u) << "free is clamped at 0, never wraps";
  EXPECT_EQ(sim.segment_malloc(0, 1), nullptr);
  sim.set_capacity(0, 12 * mib);
  EXPECT_EQ(sim.mem_get_info(0).free_bytes, 6 * mib);
  void* b = sim.segment_malloc(0, 6 * mib);
  EXPECT_NE(b, nullptr);
  sim.segment_free(0, a);
  sim.segment_free(0, b);
}

// ---- clock, streams and events ---------------------------------------------------

TEST(SimBackend, ClockNeverMovesBack) {
  sim_backend sim;
  sim.advance_to(10);
  EXPECT_EQ(sim.now(), 10u);
  sim.advance_to(5);
  EXPECT_EQ(sim.now(), 10u);
  sim.advance_to(10);
  EXPECT_EQ(sim.now(), 10u);
  sim.advance_to(11);
  EXPECT_EQ(sim.now(), 11u);
}

TEST(SimBackend, EventOnIdleStreamIsCompleteAtOnce) {
  sim_backend sim;
  const auto s = sim.create_stream(0);
  const auto e = sim.create_event(0);
  EXPECT_NE(e, ccalloc::event_t{0}) << "0 is never a valid event";
  sim.record_event(0, e, s);
  EXPECT_TRUE(sim.query_event(0, e));
  EXPECT_EQ(sim.now(), 0u) << "query never advances the clock";
  sim.destroy_event(0, e);
  sim.destroy_stream(0, s);
}

TEST(SimBackend, EventOnBusyStreamCompletesWhenClockReachesBusyUntil) {
  sim_backend sim;
  const auto s = sim.create_stream(0);
  EXPECT_EQ(sim.busy_until(0, s), 0u);
  sim.enqueue_work(0, s, 100);
  EXPECT_EQ(sim.busy_until(0, s), 100u);
  const auto e = sim.create_event(0);
  sim.record_event(0, e, s);
  EXPECT_FALSE(sim.query_event(0, e));
  sim.advance_to(99);
  EXPECT_FALSE(sim.query_event(0, e));
  sim.advance_to(100);
  EXPECT_TRUE(sim.query_event(0, e));
  EXPECT_EQ(sim.now(), 100u);
  sim.destroy_event(0, e);
  sim.destroy_stream(0, s);
}

TEST(SimBackend, EventCapturesOnlyWorkQueuedBeforeRecording) {
  sim_backend sim;
  const auto s = sim.create_stream(0);
  sim.enqueue_work(0, s, 50);
  const auto early = sim.create_event(0);
  sim.record_event(0, early, s);  // completes at 50
  sim.enqueue_work(0, s, 200);    // later work
  const auto late = sim.create_event(0);
  sim.record_event(0, late, s);  // completes at 200
  sim.advance_to(50);
  EXPECT_TRUE(sim.query_event(0, early));
  EXPECT_FALSE(sim.query_event(0, late));
  sim.advance_to(200);
  EXPECT_TRUE(sim.query_event(0, late));
  // Re-recording an event moves it to the stream's current work.
  sim.enqueue_work(0, s, 300);
  sim.record_event(0, early, s);
  EXPECT_FALSE(sim.query_event(0, early));
  sim.advance_to(300);
  EXPECT_TRUE(sim.query_event(0, early));
}

TEST(SimBackend, EnqueueWorkNeverShortensAStream) {
  sim_backend sim;
  const auto s = sim.create_stream(0);
  sim.enqueue_work(0, s, 100);
  sim.enqueue_work(0, s, 40);
  EXPECT_EQ(sim.busy_until(0, s), 100u);
  // Work that ended in the past: busy_until reports the clock.
  sim.advance_to(150);
  EXPECT_EQ(sim.busy_until(0, s), 150u);
  const auto e = sim.create_event(0);
  sim.record_event(0, e, s);
  EXPECT_TRUE(sim.query_event(0, e));
}

TEST(SimBackend, StreamsAreIndependent) {
  sim_backend sim;
  const auto a = sim.create_stream(0);
  const auto b = sim.create_stream(0);
  EXPECT_NE(a, b);
  EXPECT_NE(a, ccalloc::default_stream);
  sim.enqueue_work(0, a, 100);
  const auto ea = sim.create_event(0);
  const auto eb = sim.create_event(0);
  EXPECT_NE(ea, eb);
  sim.record_event(0, ea, a);
  sim.record_event(0, eb, b);
  EXPECT_FALSE(sim.query_event(0, ea));
  EXPECT_TRUE(sim.query_event(0, eb));
}

// Breaker (session 2): the simulated device accepted any stream handle, also
// one it never created or had destroyed, where CUDA fails the call. Every
// stream-taking call now throws invalid_argument_error naming the handle and
// changes nothing; the default streams need no create_stream, and
// adopt_stream makes a chosen handle (a trace's stream id) a stream.
TEST(SimBackend, UnknownOrDestroyedStreamHandlesAreRejected) {
  sim_backend sim(small_device(10 * mib, 2));
  sim.enqueue_work(0, ccalloc::default_stream, 20);
  EXPECT_EQ(sim.busy_until(0, ccalloc::default_stream), 20u);
  const auto e = sim.create_event(0);
  const auto destroyed = sim.create_stream(0);
  sim.destroy_stream(0, destroyed);
  const auto of_device_1 = sim.create_stream(1);
  const auto gate = sim.create_gate(0);
  void* seg = sim.segment_malloc(0, mib);
  for (const ccalloc::stream_t bad : {ccalloc::stream_t{0xdeadbeef}, destroyed, of_device_1}) {
    SCOPED_TRACE(bad);
    const std::string named = "stream " + std::to_string(bad) + " is not a stream of device 0";
    const auto expect_rejected = [&](const char* call, const auto& f) {
      try {
        f();
        ADD_FAILURE() << call << " accepted it";
      } catch (const ccalloc::invalid_argument_error& err) {
        const std::string what = err.what();
        EXPECT_NE(what.find(std::string("sim: ") + call + ": " + named), std::string::npos) << what;
      }
    };
    expect_rejected("record_event", [&] { sim.record_event(0, e, bad); });
    expect_rejected("synchronize_stream", [&] { sim.synchronize_stream(0, bad); });
    expect_rejected("use_memory", [&] { sim.use_memory(0, seg, mib, bad); });
    expect_rejected("enqueue_work", [&] { sim.enqueue_work(0, bad, 50); });
    expect_rejected("busy_until", [&] { (void)sim.busy_until(0, bad); });
    expect_rejected("wait_gate", [&] { sim.wait_gate(0, bad, gate); });
    expect_rejected("is_capturing", [&] { (void)sim.is_capturing(0, bad); });
    expect_rejected("begin_capture", [&] { sim.begin_capture(0, bad); });
    expect_rejected("memcpy_async", [&] { sim.memcpy_async(0, seg, seg, 0, bad); });
    EXPECT_THROW(sim.destroy_stream(0, bad), ccalloc::invalid_argument_error);
  }
  // Nothing changed: the event is still unrecorded (complete), no stream was made.
  EXPECT_TRUE(sim.query_event(0, e));
  EXPECT_EQ(sim.counters().live_streams, 1u);
  EXPECT_EQ(sim.now(), 0u);
  EXPECT_THROW(sim.destroy_stream(0, ccalloc::default_stream), ccalloc::invalid_argument_error);
  // The same handles are fine where they belong.
  sim.enqueue_work(1, of_device_1, 40);
  EXPECT_EQ(sim.busy_until(1, of_device_1), 40u);
  sim.open_gate(0, gate);
  sim.destroy_gate(0, gate);
  sim.destroy_event(0, e);
  sim.segment_free(0, seg);
}

TEST(SimBackend, AdoptStreamGivesAStreamAChosenHandle) {
  sim_backend sim(small_device(10 * mib, 2));
  sim.adopt_stream(0, 0xdeadbeef);
  EXPECT_EQ(sim.counters().live_streams, 1u);
  sim.enqueue_work(0, 0xdeadbeef, 30);
  EXPECT_EQ(sim.busy_until(0, 0xdeadbeef), 30u);
  const auto e = sim.create_event(0);
  sim.record_event(0, e, 0xdeadbeef);
  EXPECT_FALSE(sim.query_event(0, e));
  // Not twice, not on another device, not the default streams' handles.
  for (const ccalloc::stream_t taken : {ccalloc::stream_t{0xdeadbeef}, ccalloc::default_stream,
                                        ccalloc::legacy_stream_handle, ccalloc::per_thread_stream_handle}) {
    EXPECT_THROW(sim.adopt_stream(0, taken), ccalloc::invalid_argument_error) << taken;
    EXPECT_THROW(sim.adopt_stream(1, taken), ccalloc::invalid_argument_error) << taken;
  }
  // create_stream never hands out an adopted handle.
  sim.adopt_stream(0, 0x1000);
  sim.adopt_stream(1, 0x1001);
  const auto made = sim.create_stream(0);
  EXPECT_NE(made, 0x1000u);
  EXPECT_NE(made, 0x1001u);
  EXPECT_EQ(sim.counters().live_streams, 4u);
  sim.destroy_stream(0, 0xdeadbeef);
  EXPECT_THROW(sim.record_event(0, e, 0xdeadbeef), ccalloc::invalid_argument_error) << "destroyed";
  sim.destroy_event(0, e);
}

TEST(SimBackend, SynchronizeEventAdvancesTheClockToItsCompletion) {
  sim_backend sim;
  const auto s = sim.create_stream(0);
  sim.enqueue_work(0, s, 70);
  const auto e = sim.create_event(0);
  sim.record_event(0, e, s);
  sim.synchronize_event(0, e);
  EXPECT_EQ(sim.now(), 70u);
  EXPECT_TRUE(sim.query_event(0, e));
  sim.synchronize_event(0, e);  // already complete: no change
  EXPECT_EQ(sim.now(), 70u);
}

TEST(SimBackend, SynchronizeStreamAndDevice) {
  sim_backend sim(small_device(10 * mib, 2));
  const auto a = sim.create_stream(0);
  const auto b = sim.create_stream(0);
  const auto other = sim.create_stream(1);
  sim.enqueue_work(0, a, 40);
  sim.enqueue_work(0, b, 90);
  sim.enqueue_work(1, other, 500);
  sim.synchronize_stream(0, a);
  EXPECT_EQ(sim.now(), 40u);
  sim.synchronize_stream(0, sim.create_stream(0));  // a stream with no work: no wait
  EXPECT_EQ(sim.now(), 40u);
  sim.synchronize_device(0);
  EXPECT_EQ(sim.now(), 90u) << "device 0 waits for its own streams only";
  sim.synchronize_device(1);
  EXPECT_EQ(sim.now(), 500u);
}

// cudaFree waits for the device: so does segment_free (issue 16, item 7),
// for the freeing device's streams only; sim_options can turn it off.
TEST(SimBackend, SegmentFreeWaitsForTheDevice) {
  sim_options o = small_device();
  o.device_count = 2;
  sim_backend sim(o);
  const auto s = sim.create_stream(0);
  sim.enqueue_work(0, s, 1000);
  sim.enqueue_work(1, sim.create_stream(1), 5000);
  void* p = sim.segment_malloc(0, mib);
  ASSERT_NE(p, nullptr);
  sim.segment_free(0, p);
  EXPECT_EQ(sim.now(), 1000u);

  o.segment_free_synchronizes = false;
  sim_backend lazy(o);
  lazy.enqueue_work(0, lazy.create_stream(0), 1000);
  void* q = lazy.segment_malloc(0, mib);
  lazy.segment_free(0, q);
  EXPECT_EQ(lazy.now(), 0u);
}

TEST(SimBackend, UnknownEventsThrow) {
  sim_backend sim;
  EXPECT_THROW((void)sim.query_event(0, 12345), backend_error);
  EXPECT_THROW(sim.synchronize_event(0, 12345), backend_error);
  EXPECT_THROW(sim.record_event(0, 12345, 0), backend_error);
  const auto e = sim.create_event(0);
  sim.destroy_event(0, e);
  EXPECT_THROW((void)sim.query_event(0, e), backend_error) << "a destroyed event is unknown";
}

TEST(SimBackend, CountsLiveStreamsAndEvents) {
  sim_backend sim;
  const auto s1 = sim.create_stream(0);
  const auto s2 = sim.create_stream(0);
  const auto e1 = sim.create_event(0);
  EXPECT_EQ(sim.counters().live_streams, 2u);
  EXPECT_EQ(sim.counters().live_events, 1u);
  sim.destroy_stream(0, s1);
  sim.destroy_event(0, e1);
  EXPECT_EQ(sim.counters().live_streams, 1u);
  EXPECT_EQ(sim.counters().live_events, 0u);
  sim.destroy_stream(0, s2);
  EXPECT_EQ(sim.counters().live_streams, 0u);
}

// Breaker (session 2): a segment the simulated capacity allows but the host
// cannot map (more than the process's address space) came back as nullptr,
// an out-of-memory of a device with that much free. It is the host's
// failure: backend_error with the errno text, and nothing is charged.
TEST(SimBackend, SegmentTheHostCannotMapIsABackendErrorNotOutOfMemory) {
  sim_backend sim(small_device(std::size_t{1} << 60));
  const std::size_t huge = std::size_t{1} << 59;  // more than a 47- or 57-bit user address space holds
  try {
    (void)sim.segment_malloc(0, huge);
    ADD_FAILURE() << "no error";
  } catch (const host_memory_error& e) {  // a backend_error the CLI says as a host out-of-memory
    const std::string what = e.what();
    EXPECT_NE(what.find("sim: segment_malloc(device 0, " + std::to_string(huge) +
                        " bytes): the host could not reserve the simulated memory: mmap failed: " +
                        std::strerror(ENOMEM) + " (the simulated device has " +
                        std::to_string(std::size_t{1} << 60) + " bytes free;"),
              std::string::npos)
        << what;
  }
  const auto c = sim.counters();
  EXPECT_EQ(c.used_bytes, 0u);
  EXPECT_EQ(c.segment_mallocs, 0u);
  EXPECT_EQ(c.failed_mallocs, 0u) << "failed_mallocs counts the device's refusals only";
  EXPECT_EQ(sim.mem_get_info(0).free_bytes, std::size_t{1} << 60);
  void* p = sim.segment_malloc(0, mib);
  ASSERT_NE(p, nullptr);
  sim.segment_free(0, p);
}

// ---- fault injection ---------------------------------------------------------------

TEST(SimBackend, FailSegmentMallocAfterN) {
  sim_backend sim(small_device(64 * mib));
  sim.fail_segment_malloc_after(2);
  void* a = sim.segment_malloc(0, mib);
  EXPECT_NE(a, nullptr) << "the 1st malloc from now succeeds";
  EXPECT_EQ(sim.segment_malloc(0, mib), nullptr) << "the 2nd fails although memory is free";
  EXPECT_EQ(sim.counters().failed_mallocs, 1u);
  void* b = sim.segment_malloc(0, mib);
  EXPECT_NE(b, nullptr) << "the fault fires once";
  EXPECT_EQ(sim.counters().used_bytes, 4 * mib) << "the failed call charged nothing";

  sim.fail_segment_malloc_after(1);
  EXPECT_EQ(sim.segment_malloc(0, mib), nullptr);
  sim.fail_segment_malloc_after(1);
  sim.fail_segment_malloc_after(0);  // disarm
  void* c = sim.segment_malloc(0, mib);
  EXPECT_NE(c, nullptr);
  EXPECT_EQ(sim.counters().failed_mallocs, 2u);
  EXPECT_EQ(sim.counters().segment_mallocs, 3u);
  for (void* p : {a, b, c}) sim.segment_free(0, p);
}

TEST(SimBackend, FailEventQueryAfterN) {
  sim_backend sim;
  const auto e = sim.create_event(0);
  sim.record_event(0, e, 0);
  sim.fail_event_query_after(2);
  EXPECT_TRUE(sim.query_event(0, e));
  EXPECT_THROW((void)sim.query_event(0, e), backend_error);
  EXPECT_TRUE(sim.query_event(0, e)) << "the fault fires once";
  sim.fail_event_query_after(1);
  sim.fail_event_query_after(0);  // disarm
  EXPECT_TRUE(sim.query_event(0, e));
}

// ---- concurrency ---------------------------------------------------------------------

TEST(SimBackend, ConcurrentMallocFreeKeepsCountersExact) {
  sim_backend sim(small_device(gib));
  constexpr int threads = 4;
  constexpr int rounds = 500;
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&] {
      for (int i = 0; i < rounds; ++i) {
        void* p = sim.segment_malloc(0, mib);
        ASSERT_NE(p, nullptr);
        static_cast<char*>(p)[0] = 1;
        sim.segment_free(0, p);
      }
    });
  for (auto& th : pool) th.join();
  const auto c = sim.counters();
  EXPECT_EQ(c.segment_mallocs, std::uint64_t{threads} * rounds);
  EXPECT_EQ(c.segment_frees, std::uint64_t{threads} * rounds);
  EXPECT_EQ(c.used_bytes, 0u);
}

// ---- optional functions --------------------------------------------------------------

// The virtual-memory and peer functions in detail: sim_vm_test.cpp.
TEST(SimBackend, OptionalCapabilitiesAreReported) {
  sim_backend sim;
  const auto caps = sim.capabilities();
  EXPECT_TRUE(caps.virtual_memory);
  EXPECT_TRUE(caps.peer_access);
  EXPECT_TRUE(caps.gates);
  EXPECT_TRUE(caps.ipc);  // plain segments through memory files (tests/ipc_test.cpp)
  EXPECT_EQ(sim.vm_granularity(0), 2 * mib);
  EXPECT_FALSE(sim.can_access_peer(0, 0));  // a device is not its own peer
  EXPECT_THROW((void)sim.can_access_peer(0, 1), backend_error);  // one device only
}

}  // namespace

// ---- gates (device_backend::create_gate; replay --device cuda's driver on the CPU) ----

// stream_wait_event: the waiting stream's later work completes no earlier
// than the event as recorded at the call; the clock does not move.
TEST(SimBackend, StreamWaitEventDelaysTheWaitingStreamsLaterWork) {
  using ccalloc::backend_error;
  ccalloc::sim_backend sim;
  EXPECT_TRUE(sim.capabilities().stream_wait);
  const ccalloc::stream_t a = sim.create_stream(0);
  const ccalloc::stream_t b = sim.create_stream(0);
  sim.enqueue_work(0, a, 100);
  sim.enqueue_work(0, b, 30);
  const ccalloc::event_t e = sim.create_event(0);
  sim.record_event(0, e, a);
  sim.stream_wait_event(0, b, e);
  EXPECT_EQ(sim.busy_until(0, b), 100u) << "b's later work runs after a's work before the event";
  EXPECT_EQ(sim.now(), 0u) << "the host did not wait";
  EXPECT_EQ(sim.counters().stream_waits, 1u);
  const ccalloc::event_t after = sim.create_event(0);
  sim.record_event(0, after, b);
  sim.advance_to(99);
  EXPECT_FALSE(sim.query_event(0, after));
  sim.advance_to(100);
  EXPECT_TRUE(sim.query_event(0, after));
  // What the stream waits for is fixed at the call: a's later work or a
  // new record of e does not delay b.
  sim.enqueue_work(0, a, 500);
  sim.record_event(0, e, a);
  EXPECT_EQ(sim.busy_until(0, b), 100u);
  // An event already complete (or never recorded) holds nothing; a stream
  // busy past the event keeps its own time.
  const ccalloc::event_t fresh = sim.create_event(0);
  sim.stream_wait_event(0, b, fresh);
  EXPECT_EQ(sim.busy_until(0, b), 100u);
  sim.enqueue_work(0, b, 700);
  sim.stream_wait_event(0, b, e);
  EXPECT_EQ(sim.busy_until(0, b), 700u);
  // The default stream may wait too.
  sim.stream_wait_event(0, ccalloc::default_stream, e);
  EXPECT_EQ(sim.busy_until(0, ccalloc::default_stream), 500u);
  // Bad handles, and a capture on the device, throw with nothing changed.
  EXPECT_THROW(sim.stream_wait_event(0, 987654, e), ccalloc::invalid_argument_error);
  EXPECT_THROW(sim.stream_wait_event(0, b, 987654), backend_error);
  sim.begin_capture(0, a);
  EXPECT_THROW(sim.stream_wait_event(0, b, e), backend_error);
  sim.end_capture(0, a);
  EXPECT_EQ(sim.busy_until(0, b), 700u);
  EXPECT_EQ(sim.counters().stream_waits, 4u);
  for (ccalloc::event_t x : {e, after, fresh}) sim.destroy_event(0, x);
  sim.destroy_stream(0, a);
  sim.destroy_stream(0, b);
}

// use_memory's use-after-reuse check: a physical page used by stream a's
// work until t=100 at one address, and by stream b's work at another before
// then, counts in unsafe_reuses; behind a stream_wait_event for a's work it
// does not.
TEST(SimBackend, UnsafeReusesCountAPageUsedByTwoStreamsAtOnce) {
  ccalloc::sim_backend sim;
  const std::size_t page = sim.vm_granularity(0);
  void* base = sim.vm_reserve(0, 4 * page);
  ASSERT_NE(base, nullptr);
  auto* first = static_cast<char*>(base);
  char* second = first + 2 * page;
  ccalloc::physical_handle_t h = 0;
  ASSERT_TRUE(sim.vm_create(0, page, &h));
  const ccalloc::stream_t a = sim.create_stream(0);
  const ccalloc::stream_t b = sim.create_stream(0);
  sim.vm_map(0, first, page, h);
  sim.enqueue_work(0, a, 100);
  sim.use_memory(0, first, page, a);
  sim.vm_map(0, second, page, h);  // the same page at a second address (a deferred unmap)
  sim.enqueue_work(0, b, 30);
  sim.use_memory(0, second, page, b);
  EXPECT_EQ(sim.counters().unsafe_reuses, 1u) << "b's work ran while a's still used the page";
  const ccalloc::stream_t c = sim.create_stream(0);
  const ccalloc::event_t e = sim.create_event(0);
  sim.record_event(0, e, a);
  sim.stream_wait_event(0, c, e);
  sim.enqueue_work(0, c, 130);
  sim.use_memory(0, second, page, c);
  EXPECT_EQ(sim.counters().unsafe_reuses, 1u) << "c's work starts after a's (the wait)";
  sim.enqueue_work(0, a, 140);
  sim.use_memory(0, first, page, a);  // the same stream again: stream order
  EXPECT_EQ(sim.counters().unsafe_reuses, 2u) << "a's new work overlaps c's (a never waited for c)";
  sim.advance_to(140);
  sim.vm_unmap(0, first, page);
  sim.vm_unmap(0, second, page);
  sim.vm_release_handle(0, h);
  sim.vm_release(0, base, 4 * page);
  sim.destroy_event(0, e);
  for (ccalloc::stream_t s : {a, b, c}) sim.destroy_stream(0, s);
}

// An event recorded behind a closed gate makes the waiting stream wait on
// that gate too: its work runs once the gate opens.
TEST(SimBackend, StreamWaitEventOnAGatedEventWaitsForTheGate) {
  using ccalloc::backend_error;
  ccalloc::sim_backend sim;
  const ccalloc::stream_t a = sim.create_stream(0);
  const ccalloc::stream_t b = sim.create_stream(0);
  const ccalloc::gate_t g = sim.create_gate(0);
  sim.wait_gate(0, a, g);
  const ccalloc::event_t e = sim.create_event(0);
  sim.record_event(0, e, a);
  sim.stream_wait_event(0, b, e);
  EXPECT_EQ(sim.busy_until(0, b), std::numeric_limits<std::uint64_t>::max());
  EXPECT_THROW(sim.synchronize_stream(0, b), backend_error) << "would never return on a device";
  sim.advance_to(40);
  sim.open_gate(0, g);
  EXPECT_EQ(sim.busy_until(0, b), 40u);
  sim.synchronize_stream(0, b);
  sim.destroy_gate(0, g);
  sim.destroy_event(0, e);
  sim.destroy_stream(0, a);
  sim.destroy_stream(0, b);
}

TEST(SimBackend, GatesHoldStreamWorkUntilOpened) {
  using ccalloc::backend_error;
  ccalloc::sim_options two;
  two.device_count = 2;
  ccalloc::sim_backend sim(two);
  EXPECT_TRUE(sim.capabilities().gates);
  const ccalloc::stream_t s = sim.create_stream(0);
  const ccalloc::stream_t other = sim.create_stream(0);
  sim.enqueue_work(0, s, 5);
  const ccalloc::gate_t g = sim.create_gate(0);
  EXPECT_NE(g, 0u);
  sim.wait_gate(0, s, g);
  EXPECT_EQ(sim.busy_until(0, s), std::numeric_limits<std::uint64_t>::max());
  EXPECT_EQ(sim.busy_until(0, other), 0u);
  const ccalloc::event_t e = sim.create_event(0);
  sim.record_event(0, e, s);
  sim.advance_to(100);
  EXPECT_FALSE(sim.query_event(0, e));  // however late: it is behind a closed gate
  // Waits a real device would never finish throw instead of deadlocking.
  EXPECT_THROW(sim.synchronize_event(0, e), backend_error);
  EXPECT_THROW(sim.synchronize_stream(0, s), backend_error);
  EXPECT_THROW(sim.synchronize_device(0), backend_error);
  EXPECT_THROW(sim.destroy_gate(0, g), backend_error);  // still closed
  sim.synchronize_stream(0, other);                     // not waiting: fine
  sim.synchronize_device(1);                            // another device: fine
  EXPECT_EQ(sim.now(), 100u);

  sim.open_gate(0, g);  // at 100: the stream's work and the event complete now
  sim.open_gate(0, g);  // opening twice does nothing
  EXPECT_TRUE(sim.query_event(0, e));
  EXPECT_EQ(sim.busy_until(0, s), 100u);
  sim.synchronize_event(0, e);
  sim.synchronize_stream(0, s);
  EXPECT_EQ(sim.now(), 100u);

  // An open gate holds nothing.
  const ccalloc::gate_t g2 = sim.create_gate(0);
  sim.open_gate(0, g2);
  sim.wait_gate(0, s, g2);
  EXPECT_EQ(sim.busy_until(0, s), 100u);

  // Work queued before the gate still runs its course after the opening.
  const ccalloc::gate_t g3 = sim.create_gate(0);
  sim.enqueue_work(0, s, 150);
  sim.wait_gate(0, s, g3);
  sim.record_event(0, e, s);
  sim.open_gate(0, g3);
  EXPECT_FALSE(sim.query_event(0, e));
  sim.advance_to(150);
  EXPECT_TRUE(sim.query_event(0, e));

  // Re-recording an event forgets the gate it waited on.
  const ccalloc::gate_t g4 = sim.create_gate(0);
  sim.wait_gate(0, s, g4);
  sim.record_event(0, e, s);
  EXPECT_FALSE(sim.query_event(0, e));
  sim.record_event(0, e, other);
  EXPECT_TRUE(sim.query_event(0, e));
  // A destroyed stream no longer waits; opening the gate later is fine.
  sim.destroy_stream(0, s);
  sim.open_gate(0, g4);

  // Handles: bound to their device, unknown once destroyed.
  const ccalloc::gate_t g5 = sim.create_gate(1);
  EXPECT_THROW(sim.wait_gate(0, other, g5), backend_error);
  EXPECT_THROW(sim.open_gate(0, g5), backend_error);
  sim.open_gate(1, g5);
  EXPECT_EQ(sim.counters().live_gates, 5u);
  for (const ccalloc::gate_t gate : {g, g2, g3, g4}) sim.destroy_gate(0, gate);
  sim.destroy_gate(1, g5);
  EXPECT_EQ(sim.counters().live_gates, 0u);
  EXPECT_THROW(sim.open_gate(0, g), backend_error);
  EXPECT_THROW(sim.wait_gate(0, other, 12345), backend_error);
  EXPECT_THROW(sim.destroy_gate(0, g), backend_error);
  sim.destroy_event(0, e);
}

namespace {

// CUDA lets a destroyed stream's queued work complete: a device-wide wait
// still waits for it (the page fences' fallback relies on that).
TEST(SimBackend, SynchronizeDeviceWaitsForTheWorkOfDestroyedStreams) {
  ccalloc::sim_backend sim;
  const ccalloc::stream_t s = sim.create_stream(0);
  sim.enqueue_work(0, s, 100);
  sim.destroy_stream(0, s);
  EXPECT_EQ(sim.now(), 0u);
  sim.synchronize_device(0);
  EXPECT_EQ(sim.now(), 100u);
}

// The device count is bounded (ccalloc::max_device_count): 2^20 simulated
// devices would need a peer table of 2^40 entries; the allocator's init
// refuses as many devices whatever its backend reports.
TEST(SimBackend, DeviceCountIsBounded) {
  sim_options o;
  for (const int count : {ccalloc::max_device_count + 1, 1 << 20}) {
    o.device_count = count;
    try {
      sim_backend sim(o);
      FAIL() << "no error";  // and no 2^20 devices: a failure before the bound stops here
    } catch (const backend_error& e) {
      EXPECT_EQ(std::string(e.what()), "sim: device_count is " + std::to_string(count) +
                                           "; at most 1024 devices (ccalloc::max_device_count)");
    }
  }
  o.device_count = ccalloc::max_device_count;
  EXPECT_EQ(sim_backend(o).device_count(), 1024);
  ccalloc::caching_allocator a(std::make_shared<sim_backend>(sim_options{}));
  try {
    a.init(ccalloc::max_device_count + 1);
    FAIL() << "no error";
  } catch (const invalid_argument_error& e) {
    EXPECT_STREQ(e.what(), "ccalloc: init(1025): at most 1024 devices (ccalloc::max_device_count)");
  }
  EXPECT_FALSE(a.initialized());
}

}  // namespace

namespace {

// Handles with the per-thread bit: only the calling thread's resolved
// per-thread stream is one (another thread's, or a made-up handle, is not).
TEST(SimBackend, OnlyTheCallingThreadsPerThreadStreamIsAStream) {
  auto sim = std::make_shared<sim_backend>(sim_options{});
  const ccalloc::stream_t mine = sim->resolve_stream(0, ccalloc::per_thread_stream_handle);
  ccalloc::stream_t theirs = 0;
  std::thread([&] { theirs = sim->resolve_stream(0, ccalloc::per_thread_stream_handle); }).join();
  EXPECT_TRUE(sim->is_stream(0, mine));
  EXPECT_FALSE(sim->is_stream(0, theirs));
  EXPECT_FALSE(sim->is_stream(0, std::numeric_limits<ccalloc::stream_t>::max()));
  ccalloc::caching_allocator a(sim);
  a.init(1);
  try {
    (void)a.malloc(0, 10, std::numeric_limits<ccalloc::stream_t>::max());
    ADD_FAILURE() << "a made-up per-thread handle was accepted";
  } catch (const ccalloc::invalid_argument_error& e) {
    EXPECT_NE(std::string(e.what()).find("which is not a live stream of that device"), std::string::npos) << e.what();
  }
  void* p = a.malloc(0, 10, ccalloc::per_thread_stream_handle);
  EXPECT_NE(p, nullptr);
  a.free(p);
}

// -0 is 0 for set_memory_fraction and for per_process_memory_fraction alike.
TEST(SimBackend, NegativeZeroMemoryFractionIsZeroForTheSetterAndTheConfigKey) {
  ccalloc::caching_allocator a(std::make_shared<sim_backend>(sim_options{}));
  a.init(1);
  a.set_config("per_process_memory_fraction:-0");
  EXPECT_EQ(a.config().per_process_memory_fraction, 0.0);
  EXPECT_FALSE(std::signbit(a.config().per_process_memory_fraction));
  EXPECT_EQ(a.config().to_string().find("-0"), std::string::npos) << a.config().to_string();
  a.set_memory_fraction(0.5, 0);
  a.set_memory_fraction(-0.0, 0);
  EXPECT_EQ(a.get_memory_fraction(0), 0.0);
  EXPECT_FALSE(std::signbit(a.get_memory_fraction(0)));
}

}  // namespace
