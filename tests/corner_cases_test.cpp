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
      EXPECT_GE(segments_of_a, 1u);
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

}  // namespace
