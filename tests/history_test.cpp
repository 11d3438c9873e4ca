// history_test.cpp: memory history, annotations, compile contexts, user
// metadata, trace trackers and snapshots (SPEC F13-F16, F18;
// include/ccalloc/core/history.hpp, include/ccalloc/core/snapshot.hpp), on
// the simulated device.
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/core/history.hpp>
#include <ccalloc/core/snapshot.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <iterator>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <ostream>
#include <memory>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <unistd.h>

namespace ccalloc {
// Readable action names in failure messages.
void PrintTo(trace_entry_action a, std::ostream* os) { *os << to_string(a); }
}  // namespace ccalloc

namespace {

using namespace ccalloc;  // NOLINT: test file
using A = trace_entry_action;

struct fixture {
  // Plain segments: these tests follow segment_alloc / segment_free; the
  // expandable default (segment_map / segment_unmap) has its own tests below.
  explicit fixture(sim_options o = {}, const char* conf = "expandable_segments:False")
      : sim(std::make_shared<sim_backend>(o)), alloc(sim, allocator_config::parse(conf)) {
    alloc.init(sim->device_count());
    for (const stream_t s : {3, 7, 9}) sim->adopt_stream(0, s);  // the streams these tests allocate on
  }
  std::shared_ptr<sim_backend> sim;
  caching_allocator alloc;
};

history_options on(std::size_t max_entries = 1000000) {
  history_options o;
  o.enabled = true;
  o.when = record_context::never;
  o.max_entries = max_entries;
  return o;
}

std::vector<A> actions(const std::vector<trace_entry>& entries) {
  std::vector<A> out;
  for (const auto& e : entries) out.push_back(e.action);
  return out;
}

std::uintptr_t addr(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

std::uint64_t now_us() {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                        std::chrono::system_clock::now().time_since_epoch())
                                        .count());
}

context_ptr frames_of(std::string name) {
  auto c = std::make_shared<trace_context>();
  c->frames.push_back({std::move(name), "model.py", 42});
  return c;
}

TEST(History, ActionNamesRoundTrip) {
  const std::vector<std::string> names = {"alloc",       "free_requested", "free_completed", "segment_alloc",
                                          "segment_free", "segment_map",   "segment_unmap",  "snapshot",
                                          "oom",          "empty_cache",    "pause",          "resume"};
  ASSERT_EQ(names.size(), trace_entry_action_count);
  for (std::size_t i = 0; i < names.size(); ++i) {
    EXPECT_EQ(to_string(static_cast<A>(i)), names[i]);
    EXPECT_EQ(parse_trace_entry_action(names[i]), static_cast<A>(i));
  }
  EXPECT_FALSE(parse_trace_entry_action("allocate").has_value());
}

TEST(History, OffRecordsNothing) {
  fixture f;
  EXPECT_FALSE(f.alloc.is_history_enabled());
  void* p = f.alloc.malloc(0, 4096, 0);
  f.alloc.free(p);
  f.alloc.empty_cache();
  EXPECT_TRUE(f.alloc.device_allocator(0).trace_entries().empty());
  const memory_snapshot s = f.alloc.snapshot();
  ASSERT_EQ(s.device_traces.size(), 1u);
  EXPECT_TRUE(s.device_traces[0].empty());
}

TEST(History, EntriesInOrderWithPyTorchFields) {
  fixture f;
  const std::uint64_t before = now_us();
  f.alloc.record_history(on());
  EXPECT_TRUE(f.alloc.is_history_enabled());
  const stream_t s = 7;
  void* p = f.alloc.malloc(0, 1000, s);  // small pool: a 2 MiB segment, a 1024-byte block
  f.alloc.free(p);
  f.alloc.empty_cache();
  const std::uint64_t after = now_us();

  const auto e = f.alloc.device_allocator(0).trace_entries();
  ASSERT_EQ(actions(e), (std::vector<A>{A::segment_alloc, A::alloc, A::free_requested, A::free_completed,
                                        A::empty_cache, A::segment_free}));
  EXPECT_EQ(e[0].addr, addr(p));
  EXPECT_EQ(e[0].size, 2 * mib);
  EXPECT_EQ(e[0].stream, s);
  for (int i : {1, 2, 3}) {
    EXPECT_EQ(e[i].addr, addr(p));
    EXPECT_EQ(e[i].size, 1000u) << "requested bytes, not the rounded 1024";
    EXPECT_EQ(e[i].stream, s);
  }
  EXPECT_EQ(e[4].addr, 0u);
  EXPECT_EQ(e[4].size, 2 * mib) << "reserved bytes when empty_cache was called";
  EXPECT_EQ(e[5].addr, addr(p));
  EXPECT_EQ(e[5].size, 2 * mib);
  std::uint64_t last = before;
  for (const auto& x : e) {
    EXPECT_GE(x.time_us, last);
    EXPECT_LE(x.time_us, after);
    last = x.time_us;
    EXPECT_EQ(x.device, 0);
    EXPECT_EQ(x.compile_context, "N/A");
    EXPECT_EQ(x.user_metadata, "");
    EXPECT_EQ(x.context, nullptr);
  }
  f.alloc.device_allocator(0).check_invariants();
}

TEST(History, RingBufferKeepsNewestEntries) {
  fixture f;
  f.alloc.record_history(on(5));
  std::vector<void*> ptrs;
  for (int i = 0; i < 10; ++i) {
    void* p = f.alloc.malloc(0, 4096 * (i + 1), 0);
    ptrs.push_back(p);
  }
  // 10 allocs (and one segment_alloc first): the newest 5 are allocs 6..10.
  auto e = f.alloc.device_allocator(0).trace_entries();
  ASSERT_EQ(e.size(), 5u);
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(e[i].action, A::alloc);
    EXPECT_EQ(e[i].addr, addr(ptrs[5 + i]));
    EXPECT_EQ(e[i].size, 4096u * (6 + i));
  }
  // Shrinking keeps the newest; growing keeps what is there.
  history_options o = on(2);
  f.alloc.record_history(o);
  e = f.alloc.device_allocator(0).trace_entries();
  ASSERT_EQ(e.size(), 2u);
  EXPECT_EQ(e[0].addr, addr(ptrs[8]));
  EXPECT_EQ(e[1].addr, addr(ptrs[9]));
  f.alloc.record_history(on(100));
  f.alloc.free(ptrs[0]);
  e = f.alloc.device_allocator(0).trace_entries();
  ASSERT_EQ(actions(e), (std::vector<A>{A::alloc, A::alloc, A::free_requested, A::free_completed}));
  EXPECT_EQ(e[1].addr, addr(ptrs[9]));
  for (std::size_t i = 1; i < ptrs.size(); ++i) f.alloc.free(ptrs[i]);
}

TEST(History, ClearAndDisableDropEntries) {
  fixture f;
  f.alloc.record_history(on());
  f.alloc.free(f.alloc.malloc(0, 4096, 0));
  EXPECT_EQ(f.alloc.device_allocator(0).trace_entries().size(), 4u);
  history_options o = on();
  o.clear = true;
  f.alloc.record_history(o);
  EXPECT_TRUE(f.alloc.device_allocator(0).trace_entries().empty());
  f.alloc.free(f.alloc.malloc(0, 4096, 0));
  EXPECT_EQ(f.alloc.device_allocator(0).trace_entries().size(), 3u);  // the segment stayed cached
  history_options off;
  off.enabled = false;
  f.alloc.record_history(off);
  EXPECT_FALSE(f.alloc.is_history_enabled());
  EXPECT_TRUE(f.alloc.device_allocator(0).trace_entries().empty());
  history_options zero = on(0);
  EXPECT_THROW(f.alloc.record_history(zero), invalid_argument_error);
  EXPECT_FALSE(f.alloc.is_history_enabled()) << "a rejected call changes nothing";
}

TEST(History, SkipActionsAreNotStoredButTracked) {
  fixture f;
  std::vector<A> tracked;
  f.alloc.attach_allocator_trace_tracker([&](const trace_entry& e) { tracked.push_back(e.action); });
  history_options o = on();
  o.skip_actions = {A::free_requested, A::segment_alloc};
  f.alloc.record_history(o);
  f.alloc.free(f.alloc.malloc(0, 4096, 0));
  EXPECT_EQ(actions(f.alloc.device_allocator(0).trace_entries()), (std::vector<A>{A::alloc, A::free_completed}));
  EXPECT_EQ(tracked, (std::vector<A>{A::segment_alloc, A::alloc, A::free_requested, A::free_completed}));
}

TEST(History, AnnotationsAreTimestampedAndKeptWhileRecording) {
  fixture f;
  f.alloc.record_annotation({{"name", "ignored"}});  // not recording: dropped
  f.alloc.record_history(on());
  const std::uint64_t before = now_us();
  f.alloc.record_annotation({{"stage", "START"}, {"name", "forward"}});
  f.alloc.record_annotation({{"stage", "END"}, {"name", "forward"}});
  const auto a = f.alloc.device_allocator(0).annotations();
  ASSERT_EQ(a.size(), 2u);
  EXPECT_GE(a[0].time_us, before);
  EXPECT_GE(a[1].time_us, a[0].time_us);
  EXPECT_EQ(a[0].device, 0);
  EXPECT_EQ(a[0].metadata, (std::vector<std::pair<std::string, std::string>>{{"stage", "START"}, {"name", "forward"}}));
  const memory_snapshot s = f.alloc.snapshot();
  ASSERT_EQ(s.external_annotations.size(), 2u);
  EXPECT_EQ(s.external_annotations[1].metadata[0].second, "END");
  const auto j = nlohmann::json::parse(to_json(s));
  ASSERT_EQ(j["external_annotations"].size(), 2u);
  EXPECT_EQ(j["external_annotations"][0]["stage"], "START");
  EXPECT_EQ(j["external_annotations"][0]["name"], "forward");
  EXPECT_EQ(j["external_annotations"][0]["device"], 0);
  EXPECT_EQ(j["external_annotations"][0]["time_us"].get<std::uint64_t>(), a[0].time_us);
  history_options off;
  off.enabled = false;
  f.alloc.record_history(off);
  EXPECT_TRUE(f.alloc.device_allocator(0).annotations().empty());
}

TEST(History, CompileContextAndUserMetadata) {
  fixture f;
  f.alloc.push_compile_context("ignored: not recording");  // PyTorch keeps it only while recording
  f.alloc.record_history(on());
  f.alloc.set_user_metadata("step=1");
  EXPECT_EQ(f.alloc.get_user_metadata(), "step=1");
  f.alloc.push_compile_context("outer");
  f.alloc.push_compile_context("inner");
  void* p = f.alloc.malloc(0, 4096, 0);
  f.alloc.pop_compile_context();
  f.alloc.set_user_metadata("step=2");
  f.alloc.free(p);
  f.alloc.pop_compile_context();
  f.alloc.pop_compile_context();  // one too many: ignored
  void* q = f.alloc.malloc(0, 4096, 0);
  const auto e = f.alloc.device_allocator(0).trace_entries();
  ASSERT_EQ(actions(e), (std::vector<A>{A::segment_alloc, A::alloc, A::free_requested, A::free_completed, A::alloc}));
  EXPECT_EQ(e[0].compile_context, "inner");
  EXPECT_EQ(e[1].compile_context, "inner");
  EXPECT_EQ(e[1].user_metadata, "step=1");
  EXPECT_EQ(e[2].compile_context, "outer");
  EXPECT_EQ(e[2].user_metadata, "step=2");
  EXPECT_EQ(e[4].compile_context, "N/A");
  EXPECT_EQ(e[4].user_metadata, "step=2");
  f.alloc.free(q);
}

TEST(History, ContextRecorderFollowsWhen) {
  for (record_context when : {record_context::state, record_context::alloc, record_context::all}) {
    SCOPED_TRACE(static_cast<int>(when));
    fixture f;
    int calls = 0;
    history_options o = on();
    o.when = when;
    o.recorder = [&] { return frames_of("call" + std::to_string(++calls)); };
    f.alloc.record_history(o);
    void* p = f.alloc.malloc(0, 4096, 0);  // call1
    const memory_snapshot s = f.alloc.snapshot();
    ASSERT_EQ(s.segments.size(), 1u);
    // The block keeps its malloc context in every mode from state on.
    ASSERT_NE(s.segments[0].blocks[0].context, nullptr);
    EXPECT_EQ(s.segments[0].blocks[0].context->frames[0].name, "call1");
    EXPECT_EQ(s.segments[0].blocks[0].context->frames[0].filename, "model.py");
    EXPECT_EQ(s.segments[0].blocks[0].context->frames[0].line, 42);
    ASSERT_NE(s.segments[0].context, nullptr) << "the segment keeps the context of the malloc that made it";
    EXPECT_EQ(s.segments[0].blocks[1].context, nullptr) << "inactive blocks have none";
    f.alloc.free(p);  // call2 only with all
    const auto e = f.alloc.device_allocator(0).trace_entries();
    ASSERT_EQ(actions(e), (std::vector<A>{A::segment_alloc, A::alloc, A::snapshot, A::free_requested,
                                          A::free_completed}));
    if (when == record_context::state) {
      EXPECT_EQ(calls, 1);
      for (const auto& x : e) EXPECT_EQ(x.context, nullptr);
    } else if (when == record_context::alloc) {
      EXPECT_EQ(calls, 1);
      ASSERT_NE(e[0].context, nullptr);
      EXPECT_EQ(e[0].context->frames[0].name, "call1");
      EXPECT_EQ(e[1].context->frames[0].name, "call1");
      EXPECT_EQ(e[3].context, nullptr);
      ASSERT_NE(e[4].context, nullptr) << "free_completed falls back to the block's context";
      EXPECT_EQ(e[4].context->frames[0].name, "call1");
    } else {
      EXPECT_EQ(calls, 2);
      ASSERT_NE(e[3].context, nullptr);
      EXPECT_EQ(e[3].context->frames[0].name, "call2");
      EXPECT_EQ(e[4].context->frames[0].name, "call2");
    }
  }
}

// A context that turns into frames only when a snapshot is written (as
// PyTorch's CapturedTraceback symbolizes only then), counting both.
struct lazy_context final : trace_context {
  lazy_context(std::string site, int* symbolized, int* alive) : site_(std::move(site)), symbolized_(symbolized),
                                                                alive_(alive) {
    ++*alive_;
  }
  ~lazy_context() override { --*alive_; }
  lazy_context(const lazy_context&) = delete;
  lazy_context& operator=(const lazy_context&) = delete;
  [[nodiscard]] std::vector<stack_frame> to_frames() const override {
    ++*symbolized_;
    return {{site_, "lazy.py", 3}};
  }
  std::string site_;
  int* symbolized_;
  int* alive_;
};

TEST(History, LazyContextsBecomeFramesInSnapshotsAndAreReleasedWithWhatHeldThem) {
  fixture f;
  int symbolized = 0;
  int alive = 0;
  int calls = 0;
  history_options o = on();
  o.when = record_context::all;
  o.skip_actions = {A::free_completed};
  o.recorder = [&] { return std::make_shared<lazy_context>("site" + std::to_string(++calls), &symbolized, &alive); };
  f.alloc.record_history(o);
  void* p = f.alloc.malloc(0, 4096, 0);  // site1: segment_alloc, alloc, the block
  void* q = f.alloc.malloc(0, 4096, 0);  // site2
  f.alloc.free(q);                       // site3: free_requested (free_completed skipped)
  EXPECT_EQ(calls, 3);
  EXPECT_EQ(symbolized, 0) << "no frames until a snapshot is written";
  EXPECT_EQ(alive, 3);
  {
    const auto e = f.alloc.device_allocator(0).trace_entries();
    ASSERT_EQ(actions(e), (std::vector<A>{A::segment_alloc, A::alloc, A::alloc, A::free_requested}));
    EXPECT_EQ(dynamic_cast<const lazy_context&>(*e[3].context).site_, "site3") << "the caller may downcast its own";
  }

  const auto j = nlohmann::json::parse(to_json(f.alloc.snapshot()));
  EXPECT_GT(symbolized, 0);
  const auto& block = j["segments"][0]["blocks"][0];
  ASSERT_EQ(block["frames"].size(), 1u);
  EXPECT_EQ(block["frames"][0]["name"], "site1");
  EXPECT_EQ(block["frames"][0]["filename"], "lazy.py");
  EXPECT_EQ(block["frames"][0]["line"], 3);
  EXPECT_EQ(j["segments"][0]["frames"][0]["name"], "site1");
  EXPECT_EQ(j["device_traces"][0][3]["frames"][0]["name"], "site3");
  const std::string pickle = to_pickle(f.alloc.snapshot());
  EXPECT_NE(pickle.find("site3"), std::string::npos);

  // clear_history drops the entries (and with them site2 and site3); the
  // live block and its segment keep site1.
  history_options clear = o;
  clear.clear = true;
  f.alloc.record_history(clear);
  EXPECT_EQ(alive, 1);
  f.alloc.free(p);
  f.alloc.empty_cache();
  {
    const auto e = f.alloc.device_allocator(0).trace_entries();
    ASSERT_FALSE(e.empty());
    EXPECT_EQ(e.back().action, A::segment_free);
    ASSERT_NE(e.back().context, nullptr) << "segment_free carries the segment's context (PyTorch)";
    EXPECT_EQ(dynamic_cast<const lazy_context&>(*e.back().context).site_, "site1");
  }
  history_options off;
  off.enabled = false;
  f.alloc.record_history(off);
  EXPECT_EQ(alive, 0) << "every context released once nothing holds it";
}

TEST(History, PendingFreeKeepsItsContextUntilCompleted) {
  fixture f;
  history_options o = on();
  o.when = record_context::alloc;
  o.recorder = [] { return frames_of("alloc_site"); };
  f.alloc.record_history(o);
  const stream_t side = f.sim->create_stream(0);
  void* p = f.alloc.malloc(0, 4096, 0);
  f.sim->enqueue_work(0, side, 10);
  f.alloc.record_stream(p, side);
  f.alloc.free(p);
  memory_snapshot s = f.alloc.snapshot();
  ASSERT_EQ(s.segments[0].blocks[0].state, block_state::active_pending_free);
  ASSERT_NE(s.segments[0].blocks[0].context, nullptr);
  EXPECT_EQ(s.segments[0].blocks[0].context->frames[0].name, "alloc_site");
  EXPECT_EQ(actions(f.alloc.device_allocator(0).trace_entries()),
            (std::vector<A>{A::segment_alloc, A::alloc, A::free_requested, A::snapshot}));
  f.sim->advance_to(10);
  void* q = f.alloc.malloc(0, 4096, 0);  // processes the completed event first
  const auto e = f.alloc.device_allocator(0).trace_entries();
  ASSERT_EQ(actions(e), (std::vector<A>{A::segment_alloc, A::alloc, A::free_requested, A::snapshot,
                                        A::free_completed, A::alloc}));
  EXPECT_EQ(e[4].addr, addr(p));
  ASSERT_NE(e[4].context, nullptr);
  EXPECT_EQ(e[4].context->frames[0].name, "alloc_site");
  f.alloc.free(q);
}

TEST(History, FreeCompletedOnEveryPath) {
  // No-caching mode: the free returns the segment at once, after its free_completed.
  fixture f;
  f.alloc.enable(false);
  f.alloc.record_history(on());
  f.alloc.free(f.alloc.malloc(0, 4096, 0));
  EXPECT_EQ(actions(f.alloc.device_allocator(0).trace_entries()),
            (std::vector<A>{A::segment_alloc, A::alloc, A::free_requested, A::free_completed, A::segment_free}));
  // A block waiting on another stream completes when empty_cache synchronizes its event.
  fixture g;
  g.alloc.record_history(on());
  const stream_t side = g.sim->create_stream(0);
  void* p = g.alloc.malloc(0, 4096, 0);
  g.sim->enqueue_work(0, side, 1000);
  g.alloc.record_stream(p, side);
  g.alloc.free(p);
  g.alloc.empty_cache();
  const auto e = g.alloc.device_allocator(0).trace_entries();
  EXPECT_EQ(actions(e), (std::vector<A>{A::segment_alloc, A::alloc, A::free_requested, A::empty_cache,
                                        A::free_completed, A::segment_free}));
  EXPECT_EQ(e[4].addr, addr(p));
  EXPECT_EQ(e[4].size, 4096u);
  g.alloc.device_allocator(0).check_invariants();
}

TEST(History, OutOfMemoryEntry) {
  sim_options so;
  so.capacity_bytes = 64 * mib;
  fixture f(so);
  f.alloc.record_history(on());
  EXPECT_THROW((void)f.alloc.malloc(0, 100 * mib, 3), out_of_memory_error);
  const auto e = f.alloc.device_allocator(0).trace_entries();
  ASSERT_EQ(actions(e), (std::vector<A>{A::oom}));
  EXPECT_EQ(e[0].size, 100 * mib);
  EXPECT_EQ(e[0].addr, 64 * mib) << "addr holds the device's free bytes, as PyTorch";
  EXPECT_EQ(e[0].stream, 3u);
  const auto j = nlohmann::json::parse(to_json(f.alloc.snapshot()));
  const auto& oom = j["device_traces"][0][0];
  EXPECT_EQ(oom["action"], "oom");
  EXPECT_EQ(oom["device_free"].get<std::uint64_t>(), 64 * mib);
  EXPECT_FALSE(oom.contains("addr"));
}

TEST(History, TrackersSeeEveryEntryOutsideTheLocks) {
  fixture f;
  std::vector<trace_entry> seen;
  bool reentered = false;
  f.alloc.attach_allocator_trace_tracker([&](const trace_entry& e) {
    seen.push_back(e);
    if (e.action == A::segment_alloc && !reentered) {
      reentered = true;
      // Calls back into the allocator: it must not hold its locks now.
      EXPECT_EQ(f.alloc.cache_info(0), 17 * mib) << "the split-off rest of the 20 MiB segment";
      f.alloc.free(f.alloc.malloc(0, 512, 0));
    }
  });
  EXPECT_FALSE(f.alloc.is_history_enabled());
  void* p = f.alloc.malloc(0, 3 * mib, 0);
  f.alloc.free(p);
  ASSERT_GE(seen.size(), 3u);
  EXPECT_EQ(seen[0].action, A::segment_alloc);
  EXPECT_EQ(seen[0].size, 20 * mib);
  // The nested calls' entries are delivered while the tracker handles the
  // outer segment_alloc, before the outer alloc entry.
  std::vector<A> got = actions(seen);
  EXPECT_EQ(got, (std::vector<A>{A::segment_alloc, A::segment_alloc, A::alloc, A::free_requested,
                                 A::free_completed, A::alloc, A::free_requested, A::free_completed}));
  EXPECT_EQ(seen[1].size, 2 * mib) << "the nested 512-byte malloc's small segment";
  EXPECT_TRUE(f.alloc.device_allocator(0).trace_entries().empty()) << "trackers do not need recording on";
  f.alloc.device_allocator(0).check_invariants();
}

TEST(History, ThrowingTrackerChangesNothing) {
  fixture f;
  int second_calls = 0;
  f.alloc.attach_allocator_trace_tracker([](const trace_entry&) { throw std::runtime_error("tracker failed"); });
  f.alloc.attach_allocator_trace_tracker([&](const trace_entry&) { ++second_calls; });
  f.alloc.record_history(on());
  void* p = nullptr;
  EXPECT_NO_THROW(p = f.alloc.malloc(0, 4096, 0));
  EXPECT_NE(p, nullptr);
  EXPECT_NO_THROW(f.alloc.free(p));
  EXPECT_NO_THROW(f.alloc.empty_cache());
  EXPECT_EQ(second_calls, 6);
  EXPECT_EQ(f.alloc.device_allocator(0).trace_entries().size(), 6u);
  const device_stats st = f.alloc.get_device_stats(0);
  EXPECT_EQ(st.allocated_bytes[0].current, 0);
  EXPECT_EQ(st.reserved_bytes[0].current, 0);
  f.alloc.device_allocator(0).check_invariants();
  EXPECT_THROW(f.alloc.attach_allocator_trace_tracker(trace_tracker{}), invalid_argument_error);
}

TEST(History, ThrowingRecorderFailsTheCallBeforeAnyChange) {
  fixture f;
  history_options o = on();
  o.when = record_context::all;
  bool fail = false;
  o.recorder = [&]() -> context_ptr {
    if (fail) throw std::runtime_error("no stack");
    return frames_of("x");
  };
  f.alloc.record_history(o);
  void* p = f.alloc.malloc(0, 4096, 0);
  fail = true;
  EXPECT_THROW((void)f.alloc.malloc(0, 4096, 0), std::runtime_error);
  EXPECT_THROW(f.alloc.free(p), std::runtime_error);
  fail = false;
  f.alloc.free(p);  // still live after the failed free
  EXPECT_EQ(f.alloc.get_device_stats(0).allocated_bytes[0].current, 0);
  f.alloc.device_allocator(0).check_invariants();
}

TEST(History, DevicesAddedLaterRecordToo) {
  sim_options so;
  so.device_count = 2;
  auto sim = std::make_shared<sim_backend>(so);
  caching_allocator a(sim, allocator_config::parse("expandable_segments:False"));
  a.init(1);
  a.record_history(on());
  a.set_user_metadata("m");
  a.init(2);
  void* p = a.malloc(1, 4096, 0);
  const memory_snapshot s = a.snapshot();
  ASSERT_EQ(s.device_traces.size(), 2u);
  EXPECT_TRUE(s.device_traces[0].empty() || s.device_traces[0][0].action == A::snapshot);
  ASSERT_GE(s.device_traces[1].size(), 2u);
  EXPECT_EQ(s.device_traces[1][1].action, A::alloc);
  EXPECT_EQ(s.device_traces[1][1].device, 1);
  EXPECT_EQ(s.device_traces[1][1].user_metadata, "m");
  ASSERT_EQ(s.segments.size(), 1u);
  EXPECT_EQ(s.segments[0].device, 1);
  a.free(p);
}

// Every block of every segment accounted for, against the allocator's own
// state after a random mix of operations (SPEC F13).
TEST(Snapshot, AccountsForEveryBlock) {
  // No trim: returning a segment waits for the device (as cudaFree does),
  // which would complete the side stream's work before the snapshot.
  fixture f({}, "expandable_segments:False,trim_on_new_peak:False");
  f.alloc.record_history(on());
  std::mt19937_64 rng(5);
  const stream_t side = f.sim->create_stream(0);
  std::map<void*, std::size_t> live;  // pointer -> requested bytes
  std::set<void*> pending;
  for (int i = 0; i < 3000; ++i) {
    f.sim->advance_to(static_cast<std::uint64_t>(i));
    if (live.empty() || rng() % 3 != 0) {
      const std::size_t size = std::size_t{1} << (rng() % 25);
      const std::size_t bytes = size + rng() % size;
      void* p = f.alloc.malloc(0, bytes, rng() % 4 == 0 ? side : 0);
      live[p] = bytes;
    } else {
      auto it = live.begin();
      std::advance(it, static_cast<long>(rng() % live.size()));
      if (rng() % 5 == 0) {
        f.sim->enqueue_work(0, side, static_cast<std::uint64_t>(i + 2000));  // still running at the end
        f.alloc.record_stream(it->first, side);
        pending.insert(it->first);
      }
      f.alloc.free(it->first);
      live.erase(it);
    }
  }
  const memory_snapshot s = f.alloc.snapshot();
  const device_stats st = f.alloc.get_device_stats(0);
  std::size_t reserved = 0, allocated = 0, active = 0, requested = 0;
  std::map<std::uintptr_t, const block_info*> blocks;
  for (const segment_info& seg : s.segments) {
    std::uintptr_t next = seg.address;
    std::size_t sum = 0, seg_alloc = 0, seg_active = 0, seg_req = 0;
    for (const block_info& b : seg.blocks) {
      EXPECT_EQ(b.address, next) << "blocks tile the segment";
      next += b.size_bytes;
      sum += b.size_bytes;
      if (b.state == block_state::active_allocated) seg_alloc += b.size_bytes;
      if (b.state != block_state::inactive) {
        seg_active += b.size_bytes;
        seg_req += b.requested_bytes;
      } else {
        EXPECT_EQ(b.requested_bytes, 0u);
      }
      blocks[b.address] = &b;
    }
    EXPECT_EQ(sum, seg.total_bytes);
    EXPECT_EQ(seg_alloc, seg.allocated_bytes);
    EXPECT_EQ(seg_active, seg.active_bytes);
    EXPECT_EQ(seg_req, seg.requested_bytes);
    EXPECT_EQ(seg.is_small_pool, seg.total_bytes == 2 * mib);
    reserved += seg.total_bytes;
    allocated += seg.allocated_bytes;
    active += seg.active_bytes;
    requested += seg.requested_bytes;
  }
  EXPECT_EQ(static_cast<std::int64_t>(reserved), st.reserved_bytes[0].current);
  EXPECT_EQ(static_cast<std::int64_t>(allocated), st.allocated_bytes[0].current);
  EXPECT_EQ(static_cast<std::int64_t>(active), st.active_bytes[0].current);
  EXPECT_EQ(static_cast<std::int64_t>(requested), st.requested_bytes[0].current);
  std::size_t allocated_blocks = 0;
  for (const auto& [a, b] : blocks) allocated_blocks += b->state == block_state::active_allocated;
  EXPECT_EQ(allocated_blocks, live.size());
  for (const auto& [p, bytes] : live) {
    auto it = blocks.find(addr(p));
    ASSERT_NE(it, blocks.end());
    EXPECT_EQ(it->second->state, block_state::active_allocated);
    EXPECT_EQ(it->second->requested_bytes, bytes);
  }
  std::size_t pending_seen = 0;
  for (void* p : pending) {
    auto it = blocks.find(addr(p));
    if (it != blocks.end() && it->second->state == block_state::active_pending_free) ++pending_seen;
  }
  EXPECT_GT(pending_seen, 0u);
  // The trace ends with the snapshot entry, whose size is the active bytes.
  ASSERT_FALSE(s.device_traces[0].empty());
  EXPECT_EQ(s.device_traces[0].back().action, A::snapshot);
  EXPECT_EQ(s.device_traces[0].back().size, active);
  // include_traces = false: no entries.
  EXPECT_TRUE(f.alloc.snapshot(false).device_traces[0].empty());
  for (const auto& [p, bytes] : live) f.alloc.free(p);
}

TEST(Snapshot, JsonHasPyTorchsLayout) {
  fixture f;
  f.alloc.set_config("max_split_size_mb:64,roundup_power2_divisions:[256:1,>:4],garbage_collection_threshold:0.5,"
                     "per_process_memory_fraction:0.9");
  history_options o = on();
  o.when = record_context::all;
  o.recorder = [] {
    auto c = std::make_shared<trace_context>();
    c->frames.push_back({"fn \"q\"\n", "dir\\file.py", 7});
    return context_ptr(c);
  };
  f.alloc.record_history(o);
  f.alloc.set_user_metadata("tab\there");
  void* small = f.alloc.malloc(0, 1000, 0);
  void* large = f.alloc.malloc(0, 5 * mib, 9);
  f.alloc.free(large);
  const memory_snapshot s = f.alloc.snapshot();
  const std::string text = to_json(s);
  const auto j = nlohmann::ordered_json::parse(text);
  ASSERT_TRUE(j.is_object());
  std::vector<std::string> keys;
  for (const auto& [k, v] : j.items()) keys.push_back(k);
  EXPECT_EQ(keys, (std::vector<std::string>{"segments", "device_traces", "allocator_settings", "external_annotations"}));
  ASSERT_EQ(j["segments"].size(), 2u);
  const auto& seg = j["segments"][0];
  std::vector<std::string> seg_keys;
  for (const auto& [k, v] : seg.items()) seg_keys.push_back(k);
  EXPECT_EQ(seg_keys, (std::vector<std::string>{"device", "address", "total_size", "allocated_size", "active_size",
                                                "requested_size", "stream", "segment_type", "segment_pool_id",
                                                "is_expandable", "tag", "paused", "frames", "blocks"}));
  EXPECT_EQ(seg["address"].get<std::uint64_t>(), s.segments[0].address);
  EXPECT_EQ(seg["segment_pool_id"], nlohmann::json::array({0, 0}));
  EXPECT_EQ(seg["is_expandable"], false);
  std::map<std::string, std::string> type_by_stream;
  for (const auto& g : j["segments"]) type_by_stream[std::to_string(g["stream"].get<std::uint64_t>())] = g["segment_type"];
  EXPECT_EQ(type_by_stream["0"], "small");
  EXPECT_EQ(type_by_stream["9"], "large");
  const auto& blk = j["segments"][0]["blocks"][0];
  std::vector<std::string> blk_keys;
  for (const auto& [k, v] : blk.items()) blk_keys.push_back(k);
  EXPECT_EQ(blk_keys, (std::vector<std::string>{"address", "size", "requested_size", "state", "tag", "frames"}));
  EXPECT_EQ(j["segments"][0]["frames"][0]["name"], "fn \"q\"\n") << "escapes round-trip";
  EXPECT_EQ(j["segments"][0]["frames"][0]["filename"], "dir\\file.py");
  EXPECT_EQ(j["segments"][0]["frames"][0]["line"], 7);
  const auto& trace = j["device_traces"][0];
  ASSERT_EQ(trace.size(), s.device_traces[0].size());
  std::vector<std::string> entry_keys;
  for (const auto& [k, v] : trace[0].items()) entry_keys.push_back(k);
  EXPECT_EQ(entry_keys, (std::vector<std::string>{"action", "addr", "size", "stream", "time_us", "frames",
                                                  "compile_context", "user_metadata", "tag"}));
  EXPECT_EQ(trace[1]["action"], "alloc");
  EXPECT_EQ(trace[1]["addr"].get<std::uint64_t>(), addr(small));
  EXPECT_EQ(trace[1]["size"], 1000);
  EXPECT_EQ(trace[1]["user_metadata"], "tab\there");
  EXPECT_EQ(trace[1]["compile_context"], "N/A");
  const auto& set = j["allocator_settings"];
  EXPECT_EQ(set["max_split_size"], 64 * 1024 * 1024);
  EXPECT_TRUE(set["garbage_collection_threshold"].is_number_float());
  EXPECT_DOUBLE_EQ(set["garbage_collection_threshold"].get<double>(), 0.5);
  EXPECT_EQ(set["expandable_segments"], false);
  EXPECT_EQ(set["roundup_power2_divisions"].size(), 16u);
  for (std::size_t i = 0; i < roundup_intervals; ++i)
    EXPECT_EQ(set["roundup_power2_divisions"][std::to_string(std::size_t{1} << i)].get<std::size_t>(),
              s.config.roundup_power2_divisions[i]);
  EXPECT_EQ(set["roundup_power2_divisions"]["32768"], 4);
  EXPECT_EQ(set["PYTORCH_CUDA_ALLOC_CONF"], s.config.to_string());
  EXPECT_DOUBLE_EQ(set["per_process_memory_fraction"].get<double>(), 0.9);
  for (const char* k : {"pinned_num_register_threads", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
                        "graph_capture_record_stream_reuse", "trim_on_new_peak", "large_segment_size"})
    EXPECT_TRUE(set.contains(k)) << k;
  f.alloc.free(small);
}

TEST(History, ConcurrentThreadsLoseNoEntry) {
  fixture f;
  f.alloc.record_history(on());
  std::atomic<std::size_t> tracked{0};
  f.alloc.attach_allocator_trace_tracker([&](const trace_entry&) { tracked.fetch_add(1); });
  constexpr int threads = 4, pairs = 2000;
  auto stream_of = [](int t) { return t == 0 ? stream_t{0} : 0x100 + static_cast<stream_t>(t); };
  for (int t = 1; t < threads; ++t) f.sim->adopt_stream(0, stream_of(t));  // thread t's stream
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (int i = 0; i < pairs; ++i) f.alloc.free(f.alloc.malloc(0, 4096 + 512 * (i % 7), stream_of(t)));
    });
  for (auto& th : pool) th.join();
  const auto e = f.alloc.device_allocator(0).trace_entries();
  std::map<A, std::size_t> count;
  for (const auto& x : e) ++count[x.action];
  EXPECT_EQ(count[A::alloc], std::size_t{threads * pairs});
  EXPECT_EQ(count[A::free_requested], std::size_t{threads * pairs});
  EXPECT_EQ(count[A::free_completed], std::size_t{threads * pairs});
  EXPECT_EQ(tracked.load(), e.size());
  std::uint64_t last = 0;
  for (const auto& x : e) {
    EXPECT_GE(x.time_us + 1000000, last) << "order of recording, clock jitter aside";
    last = std::max(last, x.time_us);
  }
  f.alloc.device_allocator(0).check_invariants();
}

}  // namespace

namespace {

// Expandable segments (the default): pages mapped and unmapped are
// segment_map / segment_unmap entries, and a snapshot shows each run of
// mapped pages as a segment of its own, as torch.cuda.memory._snapshot() does.
TEST(History, ExpandableSegmentsRecordMapAndUnmap) {
  fixture f({}, "");
  f.alloc.record_history(on());
  void* a = f.alloc.malloc(0, 5 * mib, 0);  // 3 pages mapped
  f.alloc.free(a);
  f.alloc.empty_cache();  // 3 pages unmapped
  const auto e = f.alloc.device_allocator(0).trace_entries();
  ASSERT_EQ(actions(e), (std::vector<A>{A::segment_map, A::alloc, A::free_requested, A::free_completed,
                                        A::empty_cache, A::segment_unmap}));
  EXPECT_EQ(e[0].size, 6 * mib);
  EXPECT_EQ(e[0].addr, reinterpret_cast<std::uintptr_t>(a));
  EXPECT_EQ(e[5].size, 6 * mib);
}

TEST(Snapshot, ExpandableSegmentsShowTheirMappedRuns) {
  fixture f({}, "");
  void* a = f.alloc.malloc(0, 3 * mib, 0);
  void* hole = f.alloc.malloc(0, 8 * mib, 0);
  void* c = f.alloc.malloc(0, 3 * mib, 0);
  f.alloc.free(hole);
  f.alloc.empty_cache();  // unmaps the hole's 3 whole pages: two mapped runs remain
  const memory_snapshot s = f.alloc.snapshot();
  ASSERT_EQ(s.segments.size(), 2u);
  std::size_t mapped = 0;
  for (const auto& seg : s.segments) {
    EXPECT_TRUE(seg.is_expandable);
    std::size_t sum = 0;
    for (const auto& b : seg.blocks) {
      EXPECT_TRUE(b.mapped);
      sum += b.size_bytes;
    }
    EXPECT_EQ(sum, seg.total_bytes);
    EXPECT_EQ(seg.total_bytes % (2 * mib), 0u);
    mapped += seg.total_bytes;
  }
  EXPECT_EQ(s.segments[0].address, reinterpret_cast<std::uintptr_t>(a));
  EXPECT_EQ(static_cast<std::int64_t>(mapped), f.alloc.get_device_stats(0).reserved_bytes[0].current);
  EXPECT_EQ(s.segments[0].allocated_bytes, 3 * mib);
  const auto j = nlohmann::json::parse(to_json(s));
  EXPECT_EQ(j["segments"].size(), 2u);
  EXPECT_TRUE(j["segments"][0]["is_expandable"].get<bool>());
  f.alloc.free(a);
  f.alloc.free(c);
}

// ---- contexts whose destructors call into an allocator (history.hpp: trace_context) ----

// Calls into `target` once, from its destructor, and notes what happened in
// `outcome`: "ok", or the message of what the call threw.
struct calling_context final : trace_context {
  calling_context(caching_allocator* target, std::string* outcome) : target_(target), outcome_(outcome) {}
  calling_context(const calling_context&) = delete;
  calling_context& operator=(const calling_context&) = delete;
  ~calling_context() override {
    try {
      void* p = target_->malloc(0, 512, 0);
      target_->free(p);
      target_->empty_cache();
      *outcome_ = "ok";
    } catch (const std::exception& e) {
      *outcome_ = e.what();
    }
  }

 private:
  caching_allocator* target_;
  std::string* outcome_;
};

// Records one calling_context (the first call only, so that the calls its
// destructor makes record none) with the given `when` and capacity.
void record_one_calling_context(caching_allocator& recording, caching_allocator* target, std::string* outcome,
                                record_context when, std::size_t max_entries = 1000000) {
  history_options o = on(max_entries);
  o.when = when;
  auto armed = std::make_shared<bool>(true);
  o.recorder = [armed, target, outcome]() -> context_ptr {
    if (!std::exchange(*armed, false)) return nullptr;
    return std::make_shared<calling_context>(target, outcome);
  };
  recording.record_history(o);
}

// Runs `scenario` in a child process, which exits with 0 when it returns
// "ok" and else prints what it returned and exits with 1; a child that
// deadlocks is ended by its alarm (SIGALRM).
template <class F>
void expect_completes(F scenario) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // this process may have threads (sim_backend)
  EXPECT_EXIT(
      {
        alarm(10);
        const std::string outcome = scenario();
        if (outcome == "ok") std::_Exit(0);
        std::fprintf(stderr, "outcome: %s\n", outcome.c_str());
        std::_Exit(1);
      },
      ::testing::ExitedWithCode(0), "");
}

// The ring buffer drops the oldest entry, the only holder of the context,
// inside a malloc that records segment_alloc under the device's locks.
TEST(HistoryContextDestructor, CallsIntoTheSameAllocatorWhenTheRingDropsIt) {
  expect_completes([] {
    fixture f;
    std::string outcome = "never destroyed";
    record_one_calling_context(f.alloc, &f.alloc, &outcome, record_context::alloc, /*max_entries=*/1);
    void* p = f.alloc.malloc(0, 4096, 0);
    f.alloc.free(p);   // ring: free_completed, with the block's context
    f.alloc.empty_cache();  // ring: segment_free, with the segment's context (the same)
    if (outcome != "never destroyed") return "destroyed too early: " + outcome;
    void* q = f.alloc.malloc(0, 4096, 0);  // segment_alloc under the locks drops the last entry holding it
    f.alloc.free(q);
    return outcome;
  });
}

// Records a calling_context with `f`'s next block only (record_context::
// state) and frees that block while an event of another stream is pending:
// the context is dropped when the free completes, inside the next malloc on
// the same stream, under that stream's lock. Returns calling_context's outcome.
std::string drop_with_a_completed_free(fixture& f, caching_allocator* target) {
  std::string outcome = "never destroyed";
  void* first = f.alloc.malloc(0, 4096, 0);  // the segment, made before recording: no context of its own
  record_one_calling_context(f.alloc, target, &outcome, record_context::state);
  const stream_t side = f.sim->create_stream(0);
  void* p = f.alloc.malloc(0, 4096, 0);  // the context: kept with the block only
  f.sim->enqueue_work(0, side, 10);
  f.alloc.record_stream(p, side);
  f.alloc.free(p);
  if (outcome != "never destroyed") return "destroyed too early: " + outcome;
  f.sim->advance_to(10);
  void* q = f.alloc.malloc(0, 4096, 0);  // completes p's free
  f.alloc.free(q);
  f.alloc.free(first);
  return outcome;
}

TEST(HistoryContextDestructor, CallsIntoTheSameAllocatorWhenItsBlockIsFreed) {
  expect_completes([] {
    fixture f;
    return drop_with_a_completed_free(f, &f.alloc);
  });
}

// Turning history off drops the contexts of live blocks.
TEST(HistoryContextDestructor, CallsIntoTheSameAllocatorWhenHistoryIsTurnedOff) {
  expect_completes([] {
    fixture f;
    std::string outcome = "never destroyed";
    record_one_calling_context(f.alloc, &f.alloc, &outcome, record_context::state);
    void* p = f.alloc.malloc(0, 4096, 0);
    history_options off;
    off.enabled = false;
    f.alloc.record_history(off);
    f.alloc.free(p);
    return outcome;
  });
}

// A context of one allocator whose destructor calls into another, dropped
// under the first one's locks.
TEST(HistoryContextDestructor, CallsIntoAnotherAllocator) {
  expect_completes([] {
    fixture f;
    fixture other;
    return drop_with_a_completed_free(f, &other.alloc);
  });
}

}  // namespace
