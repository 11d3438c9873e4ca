// Corner cases users hit, found by trying the classes of bug that public
// reports describe against PyTorch's, RMM's and CUB's allocators (issue 16).
// Each test names the defect it guards against; each failed on commit 0d5c551.
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>
#include <ccalloc/replay/replay.hpp>
#include <ccalloc/replay/trace.hpp>

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace ccalloc;

std::unique_ptr<caching_allocator> make(const std::shared_ptr<sim_backend>& sim, const std::string& config) {
  auto a = std::make_unique<caching_allocator>(sim, allocator_config::parse(config));
  a->init(1);
  return a;
}

// ---- item 4: per-thread default streams (NVIDIA/cub#373) ---------------------------------

// Two threads passing cudaStreamPerThread's value use two streams: their own
// pools. A block freed by thread A while A's per-thread stream still works on
// it is not handed to thread B (it was: both were pooled under the handle 2).
TEST(CornerCases, PerThreadStreamHandleIsTheCallingThreadsStream) {
  for (const char* config : {"", "expandable_segments:False", pytorch_policies}) {
    SCOPED_TRACE(config);
    auto sim = std::make_shared<sim_backend>();
    auto a = make(sim, config);
    void* freed_by_a = nullptr;
    stream_t stream_a = 0;
    std::thread ta([&] {
      freed_by_a = a->malloc(0, 8 * mib, per_thread_stream_handle);
      sim->enqueue_work(0, per_thread_stream_handle, 100);  // A's kernel uses the block until t=100
      stream_a = sim->resolve_stream(0, per_thread_stream_handle);
      a->free(freed_by_a);
    });
    ta.join();
    EXPECT_EQ(sim->busy_until(0, stream_a), 100u);
    void* got_by_b = nullptr;
    stream_t stream_b = 0;
    std::thread tb([&] {
      EXPECT_EQ(sim->busy_until(0, per_thread_stream_handle), 0u) << "B's stream is not A's";
      got_by_b = a->malloc(0, 8 * mib, per_thread_stream_handle);
      stream_b = sim->resolve_stream(0, per_thread_stream_handle);
    });
    tb.join();
    EXPECT_NE(stream_a, stream_b);
    // B may get A's bytes only once A's work is over (the allocator waited
    // for the device before moving memory between streams).
    EXPECT_TRUE(got_by_b != freed_by_a || sim->now() >= 100)
        << "handed to thread B while thread A's work still runs (clock " << sim->now() << ")";
    // The pools are keyed by the resolved streams, never by the value 2.
    std::size_t segments_of_a = 0;
    std::size_t segments_of_b = 0;
    for (const auto& seg : a->snapshot().segments) {
      EXPECT_NE(seg.stream, per_thread_stream_handle);
      segments_of_a += seg.stream == stream_a ? 1 : 0;
      segments_of_b += seg.stream == stream_b ? 1 : 0;
    }
    EXPECT_GE(segments_of_b, 1u);
    if (std::string(config) == pytorch_policies) {  // no cross-stream moves: each keeps its own
      EXPECT_NE(got_by_b, freed_by_a);
      // A's thread has exited: its stream is gone, and its cache, which no
      // other stream may adopt, went back to the device.
      EXPECT_EQ(segments_of_a, 0u);
    }
    a->free(got_by_b);
    a->device_allocator(0).check_invariants();
  }
}

// cudaStreamLegacy's value is stream 0: one pool, blocks come back to it.
TEST(CornerCases, LegacyStreamHandleIsStreamZero) {
  auto sim = std::make_shared<sim_backend>();
  auto a = make(sim, "expandable_segments:False");
  void* p = a->malloc(0, 3 * mib, legacy_stream_handle);
  a->free(p);
  EXPECT_EQ(a->malloc(0, 3 * mib, default_stream), p);
  for (const auto& seg : a->snapshot().segments) EXPECT_EQ(seg.stream, default_stream);
  a->free(p);
}

// record_stream with cudaStreamPerThread means the calling thread's stream:
// the block waits for that stream's work, not for an unrelated stream "2".
TEST(CornerCases, RecordStreamResolvesThePerThreadHandle) {
  auto sim = std::make_shared<sim_backend>();
  auto a = make(sim, "expandable_segments:False,reuse_across_streams:False");
  const stream_t s = sim->create_stream(0);
  void* p = a->malloc(0, 4 * mib, s);
  std::thread t([&] {
    sim->enqueue_work(0, per_thread_stream_handle, 50);
    a->record_stream(p, per_thread_stream_handle);
  });
  t.join();
  a->free(p);
  EXPECT_NE(a->malloc(0, 4 * mib, s), p) << "reused while the other thread's stream still works on it";
  sim->advance_to(50);
  void* again = a->malloc(0, 4 * mib, s);
  EXPECT_EQ(again, p);
}

// ---- item 7: the simulated device's segment_free waits for the device -----------------

TEST(CornerCases, SimSegmentFreeWaitsForTheDevice) {
  sim_backend sim;
  const stream_t s = sim.create_stream(0);
  void* p = sim.segment_malloc(0, 2 * mib);
  sim.enqueue_work(0, s, 40);
  const event_t e = sim.create_event(0);
  sim.record_event(0, e, s);
  EXPECT_FALSE(sim.query_event(0, e));
  sim.segment_free(0, p);
  EXPECT_EQ(sim.now(), 40u) << "cudaFree returns once the device is idle";
  EXPECT_TRUE(sim.query_event(0, e));
  // A stream behind a closed gate would hang cudaFree: the sim throws instead,
  // with nothing changed.
  void* q = sim.segment_malloc(0, 2 * mib);
  const gate_t g = sim.create_gate(0);
  sim.wait_gate(0, s, g);
  EXPECT_THROW(sim.segment_free(0, q), backend_error);
  EXPECT_EQ(sim.counters().segment_frees, 1u);
  sim.open_gate(0, g);
  sim.segment_free(0, q);
  sim.destroy_gate(0, g);
  sim.destroy_event(0, e);
}

// ---- item 6: input handling of traces ------------------------------------------------------

// A NUL byte in a field cut the message short (what() is a C string), and
// control characters were echoed raw (ESC[2J clears a terminal).
TEST(CornerCases, TraceErrorsEscapeNulAndControlCharacters) {
  const char raw[] = "1 alloc 4096 512 0\n2 free_req\0uested 4096 512 0\n";
  const std::string text(raw, sizeof raw - 1);
  try {
    (void)parse_trace_text(text, "nul.trace");
    FAIL() << "no trace_error";
  } catch (const trace_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("nul.trace:2: unknown action 'free_req\\x00uested'"), std::string::npos) << what;
  }
  try {
    (void)parse_trace_text("1 alloc\x1b[2J 4096 512 0\n", "esc.trace");
    FAIL() << "no trace_error";
  } catch (const trace_error& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.find('\x1b'), std::string::npos) << "a raw ESC in the message";
    EXPECT_NE(what.find("'alloc\\x1b[2J'"), std::string::npos) << what;
  }
  const char mixed[] = "a\0b\x7f\tc\n";
  EXPECT_EQ(printable_text(std::string(mixed, sizeof mixed - 1)), "a\\x00b\\x7f\tc\n");
}

// Replaying nothing printed zeros and succeeded, where report rejects it.
TEST(CornerCases, ReplayOfATraceWithoutEventsFails) {
  for (const std::string& text : {std::string(), std::string("# time_us action addr size stream\n")}) {
    const trace t = parse_trace_text(text, "empty.trace");
    EXPECT_THROW((void)replay_trace(t, replay_options{}), invalid_argument_error);
  }
  const trace rmm = parse_rmm_log("Thread,Time,Action,Pointer,Size,Stream\n", "header_only.csv");
  try {
    (void)replay_trace(rmm, replay_options{});
    FAIL() << "no error";
  } catch (const invalid_argument_error& e) {
    EXPECT_NE(std::string(e.what()).find("header_only.csv has no events"), std::string::npos) << e.what();
  }
}

// ---- item 1: an OOM while a fitting block only waits on an event ---------------------------

std::shared_ptr<sim_backend> small_sim(std::size_t capacity) {
  sim_options o;
  o.capacity_bytes = capacity;
  return std::make_shared<sim_backend>(o);
}

// Plain segments: a 64 MiB device full of 8 MiB blocks (two per 20 MiB
// segment); the last block is freed after record_stream on a busy stream.
// Asking for 8 MiB again: the out-of-memory path waits for the event and
// merges the block back (12 MiB free), so it must search the pool again
// instead of failing (it failed, and the caller's retry succeeded).
TEST(CornerCases, OutOfMemoryPathSearchesAgainAfterWaitingForEvents) {
  for (const char* config : {"expandable_segments:False", "expandable_segments:False,trim_on_new_peak:False",
                             "expandable_segments:True"}) {
    SCOPED_TRACE(config);
    auto sim = small_sim(64 * mib);
    auto a = make(sim, config);
    std::vector<void*> blocks;
    try {
      for (;;) blocks.push_back(a->malloc(0, 8 * mib, default_stream));
    } catch (const out_of_memory_error&) {
    }
    ASSERT_GE(blocks.size(), 6u);
    const stream_t side = sim->create_stream(0);
    sim->enqueue_work(0, side, 100);
    a->record_stream(blocks.back(), side);
    a->free(blocks.back());
    void* again = nullptr;
    EXPECT_NO_THROW(again = a->malloc(0, 8 * mib, default_stream));
    EXPECT_GE(sim->now(), 100u) << "it waited for the side stream's event";
    blocks.back() = again;
    for (void* p : blocks)
      if (p != nullptr) a->free(p);
    a->device_allocator(0).check_invariants();
  }
}

// ---- item 2: garbage_collection_threshold with expandable segments -------------------------

// Free pages of expandable segments count: above the threshold, old free
// blocks' whole pages are unmapped (they were never collected: every block
// of an expandable segment counted as split).
TEST(CornerCases, GarbageCollectionUnmapsFreePagesOfExpandableSegments) {
  for (const char* config : {"expandable_segments:False,garbage_collection_threshold:0.25",
                             "expandable_segments:True,garbage_collection_threshold:0.25"}) {
    SCOPED_TRACE(config);
    auto sim = small_sim(256 * mib);
    auto a = make(sim, std::string(config) + ",per_process_memory_fraction:1,trim_on_new_peak:False");
    const stream_t s = sim->create_stream(0);
    std::vector<void*> old;
    for (int i = 0; i < 7; ++i) old.push_back(a->malloc(0, 10 * mib, s));  // 70 MiB
    for (void* p : old) a->free(p);
    // Another stream: no cached block fits, so the slow path runs; reserved
    // (70 MiB) is above the threshold (64 MiB): the old blocks go.
    void* x = a->malloc(0, 12 * mib, default_stream);
    const auto reserved = static_cast<std::size_t>(a->get_device_stats(0).reserved_bytes[0].current);
    EXPECT_LE(reserved, 64 * mib) << "reserved stayed at " << reserved / mib << " MiB";
    a->free(x);
    a->device_allocator(0).check_invariants();
  }
}

// ---- item 3: a scoped private pool outside a capture ------------------------------------

// begin_allocate_to_pool without a graph capture is ordinary allocation: the
// cache of the default pool may be released for it, and for any other
// stream. It made the allocator behave as if a capture ran: both OOMed while
// the default pool cached 64 MiB.
TEST(CornerCases, ScopedPoolOutsideACaptureCanReleaseTheCache) {
  for (const char* config : {"expandable_segments:False", "expandable_segments:True"}) {
    SCOPED_TRACE(config);
    const mempool_id_t pool{1, 0};
    {  // an allocation in the pool's scope
      auto sim = small_sim(100 * mib);
      auto a = make(sim, std::string(config) + ",trim_on_new_peak:False");
      const stream_t s1 = sim->create_stream(0);
      a->free(a->malloc(0, 64 * mib, default_stream));  // 64 MiB cached in the default pool
      a->create_or_incref_pool(0, pool);
      a->begin_allocate_to_pool(0, pool, [s1](stream_t x) { return x == s1; });
      void* in_pool = nullptr;
      EXPECT_NO_THROW(in_pool = a->malloc(0, 60 * mib, s1));
      if (in_pool != nullptr) a->free(in_pool);
      a->end_allocate_to_pool(0, pool);
      a->release_pool(0, pool);
      a->device_allocator(0).check_invariants();
    }
    {  // a plain allocation on an unrelated stream while the scope is active
      auto sim = small_sim(100 * mib);
      auto a = make(sim, std::string(config) + ",trim_on_new_peak:False");
      const stream_t s1 = sim->create_stream(0);
      const stream_t s2 = sim->create_stream(0);
      a->free(a->malloc(0, 64 * mib, default_stream));
      a->create_or_incref_pool(0, pool);
      a->begin_allocate_to_pool(0, pool, [s1](stream_t x) { return x == s1; });
      void* other = nullptr;
      EXPECT_NO_THROW(other = a->malloc(0, 60 * mib, s2));
      if (other != nullptr) a->free(other);
      // A block used on another stream is not deferred as during a capture:
      // its events are recorded at once, and it is free once they complete.
      void* used = a->malloc(0, 4 * mib, s2);
      sim->enqueue_work(0, s1, 50);
      a->record_stream(used, s1);
      a->free(used);
      sim->advance_to(50);
      a->free(a->malloc(0, 512, s2));  // processes the completed events
      for (const segment_info& seg : a->device_allocator(0).segments()) {
        for (const block_info& b : seg.blocks) {
          if (b.address == reinterpret_cast<std::uintptr_t>(used)) {
            EXPECT_EQ(b.state, block_state::inactive) << "still waiting (deferred as during a capture)";
          }
        }
      }
      a->end_allocate_to_pool(0, pool);
      a->release_pool(0, pool);
      a->device_allocator(0).check_invariants();
    }
  }
}

// During a real capture the cache is still kept (freeing or waiting is not
// allowed then): the capture's allocation fails rather than break the capture.
TEST(CornerCases, DuringARealCaptureTheCacheIsKept) {
  auto sim = small_sim(100 * mib);
  auto a = make(sim, "expandable_segments:False,trim_on_new_peak:False");
  const stream_t s1 = sim->create_stream(0);
  a->free(a->malloc(0, 64 * mib, default_stream));
  const mempool_id_t pool{1, 0};
  a->create_or_incref_pool(0, pool);
  sim->begin_capture(0, s1);
  a->begin_allocate_to_pool(0, pool, [s1](stream_t x) { return x == s1; });
  EXPECT_THROW((void)a->malloc(0, 60 * mib, s1), out_of_memory_error);  // the sim throws on any free or wait
  a->end_allocate_to_pool(0, pool);
  sim->end_capture(0, s1);
  a->release_pool(0, pool);
}

// ---- item 5: out-of-memory advice that applies -------------------------------------------

std::string oom_message(caching_allocator& a, std::size_t bytes, stream_t stream = default_stream) {
  try {
    (void)a.malloc(0, bytes, stream);
  } catch (const out_of_memory_error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no out_of_memory_error";
  return {};
}

// Expandable segments: no max_split_size_mb (blocks of expandable segments
// are never released for it) and no garbage_collection_threshold (the out-of-
// memory path already unmapped every free page it could) suggestion; pages
// are mapped, not a segment allocated.
TEST(CornerCases, OomAdviceWithExpandableSegments) {
  auto sim = small_sim(64 * mib);
  auto a = make(sim, "expandable_segments:True");
  std::vector<void*> live;
  // Fragment pages: small live blocks spread over many pages.
  // 64 KiB short of a page: packed across page boundaries (at most 1/64 of a
  // page short, they would be carved on page boundaries and free whole pages).
  for (int i = 0; i < 28; ++i) live.push_back(a->malloc(0, 2 * mib - 64 * 1024, default_stream));
  for (std::size_t i = 0; i < live.size(); i += 2) a->free(live[i]);
  const std::string msg = oom_message(*a, 20 * mib);
  EXPECT_EQ(msg.find("max_split_size_mb"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("garbage_collection_threshold"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("a new segment"), std::string::npos) << msg;
  EXPECT_NE(msg.find("needed to map 20.00 MiB of pages"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("memory fraction"), std::string::npos) << "no fraction is set: " << msg;
  for (std::size_t i = 1; i < live.size(); i += 2) a->free(live[i]);
}

// Plain segments: max_split_size_mb only while it is not set; expandable
// segments where the device has virtual memory; never the GC threshold.
TEST(CornerCases, OomAdviceWithPlainSegments) {
  for (const char* config : {"expandable_segments:False", "expandable_segments:False,max_split_size_mb:40"}) {
    SCOPED_TRACE(config);
    auto sim = small_sim(64 * mib);
    auto a = make(sim, config);
    void* x = a->malloc(0, 5 * mib, default_stream);  // a 20 MiB segment, 15 MiB free inside
    void* y = a->malloc(0, 5 * mib, default_stream);
    a->free(x);
    const std::string msg = oom_message(*a, 50 * mib);
    const bool max_split_set = std::string(config).find("max_split") != std::string::npos;
    EXPECT_EQ(msg.find("max_split_size_mb") != std::string::npos, !max_split_set) << msg;
    EXPECT_EQ(msg.find("garbage_collection_threshold"), std::string::npos) << msg;
    EXPECT_NE(msg.find("expandable_segments:True"), std::string::npos) << msg;
    EXPECT_NE(msg.find("needed a new segment of 50.00 MiB"), std::string::npos) << msg;
    a->free(y);
  }
}

}  // namespace
