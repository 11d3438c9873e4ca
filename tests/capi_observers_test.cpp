// ccalloc_set_observers_enabled: the process-wide switch of the observing
// callbacks (trace trackers, mapping listeners, out-of-memory observers, the
// history's context recorder), which the Python package turns off at
// interpreter exit so that no daemon thread is ended inside one.
#include <ccalloc/ccalloc.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <thread>

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

/// What each callback saw.
struct calls_t {
  std::atomic<int> tracked{0};
  std::atomic<int> mapped{0};
  std::atomic<int> ooms{0};
  std::atomic<int> recorded{0};
  std::atomic<int> released{0};
  std::atomic<int> symbolized{0};
};

/// Restarts the callbacks at the end of a test, whatever it did.
struct restart_at_end {
  restart_at_end() = default;
  restart_at_end(const restart_at_end&) = delete;
  restart_at_end& operator=(const restart_at_end&) = delete;
  ~restart_at_end() { EXPECT_EQ(ccalloc_set_observers_enabled(1, 0, nullptr), CCALLOC_OK); }
};

ccalloc_allocator_t* make_allocator(calls_t& c) {
  ccalloc_options_t o;
  ccalloc_options_init(&o);
  o.backend = CCALLOC_BACKEND_SIM;
  o.sim_capacity_bytes = 64 * MiB;
  ccalloc_allocator_t* a = nullptr;
  EXPECT_EQ(ccalloc_create(&o, &a), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(ccalloc_init(a, 1), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(ccalloc_attach_trace_tracker(
                a, [](void* u, const ccalloc_trace_entry_t*) { ++static_cast<calls_t*>(u)->tracked; }, &c),
            CCALLOC_OK);
  EXPECT_EQ(ccalloc_attach_mapping_listener(
                a, [](void* u, const ccalloc_mapping_event_t*) { ++static_cast<calls_t*>(u)->mapped; }, &c),
            CCALLOC_OK);
  EXPECT_EQ(ccalloc_attach_out_of_memory_observer(
                a, [](void* u, int, size_t, size_t, size_t) { ++static_cast<calls_t*>(u)->ooms; }, &c),
            CCALLOC_OK);
  ccalloc_history_options_t h;
  ccalloc_history_options_init(&h);
  h.user_data = &c;
  h.record = [](void* u) -> void* {
    return reinterpret_cast<void*>(static_cast<std::uintptr_t>(++static_cast<calls_t*>(u)->recorded));
  };
  h.release = [](void* u, void*) { ++static_cast<calls_t*>(u)->released; };
  h.frames = [](void* u, void*, ccalloc_frame_sink_fn sink, void* sink_data) {
    ++static_cast<calls_t*>(u)->symbolized;
    sink(sink_data, "site", "c.py", 7);
  };
  EXPECT_EQ(ccalloc_record_history_ex(a, &h), CCALLOC_OK) << ccalloc_last_error();
  return a;
}

/// One malloc of 8 MiB (a new segment: mapped), its free, one refused
/// malloc (an out-of-memory error), and empty_cache (unmapped).
void exercise(ccalloc_allocator_t* a) {
  void* p = nullptr;
  ASSERT_EQ(ccalloc_malloc(a, 0, 8 * MiB, nullptr, &p), CCALLOC_OK) << ccalloc_last_error();
  ASSERT_EQ(ccalloc_delete(a, p), CCALLOC_OK);
  void* q = nullptr;
  ASSERT_EQ(ccalloc_malloc(a, 0, 1024 * MiB, nullptr, &q), CCALLOC_ERROR_OUT_OF_MEMORY);
  ASSERT_EQ(ccalloc_empty_cache(a), CCALLOC_OK);
}

std::string snapshot_text(ccalloc_allocator_t* a) {
  size_t length = 0;
  EXPECT_EQ(ccalloc_snapshot_json(a, 1, nullptr, 0, &length), CCALLOC_OK);
  std::string text(length + 4096, '\0');
  EXPECT_EQ(ccalloc_snapshot_json(a, 1, text.data(), text.size(), &length), CCALLOC_OK);
  text.resize(length);
  return text;
}

TEST(CApiObservers, StoppedNoCallbackRunsAndRestartedEveryOneDoes) {
  restart_at_end restart;
  calls_t c;
  ccalloc_allocator_t* a = make_allocator(c);
  exercise(a);
  EXPECT_GT(c.tracked.load(), 4);
  EXPECT_GT(c.mapped.load(), 1);
  EXPECT_EQ(c.ooms.load(), 1);
  EXPECT_GT(c.recorded.load(), 0);
  void* held = nullptr;  // a block whose context was recorded before the stop
  ASSERT_EQ(ccalloc_malloc(a, 0, MiB, nullptr, &held), CCALLOC_OK);
  const int recorded = c.recorded.load();

  size_t running = 99;
  ASSERT_EQ(ccalloc_set_observers_enabled(0, 1000, &running), CCALLOC_OK);
  EXPECT_EQ(running, 0u);
  const int tracked = c.tracked.load(), mapped = c.mapped.load(), released = c.released.load();
  exercise(a);
  EXPECT_EQ(c.tracked.load(), tracked);
  EXPECT_EQ(c.mapped.load(), mapped);
  EXPECT_EQ(c.ooms.load(), 1);
  EXPECT_EQ(c.recorded.load(), recorded);
  const std::string stopped = snapshot_text(a);
  EXPECT_EQ(c.symbolized.load(), 0) << "no frames asked for while stopped";
  EXPECT_EQ(stopped.find("\"site\""), std::string::npos);
  ASSERT_EQ(ccalloc_delete(a, held), CCALLOC_OK);
  ASSERT_EQ(ccalloc_record_history(a, 0, 1000), CCALLOC_OK);  // off: drops every entry and context
  EXPECT_EQ(c.released.load(), released) << "a context dropped while stopped is not released (leaked)";

  ASSERT_EQ(ccalloc_set_observers_enabled(1, 0, &running), CCALLOC_OK);
  EXPECT_EQ(running, 0u);
  calls_t again;
  ccalloc_allocator_t* b = make_allocator(again);
  exercise(b);
  EXPECT_GT(again.tracked.load(), 4);
  EXPECT_GT(again.mapped.load(), 1);
  EXPECT_EQ(again.ooms.load(), 1);
  EXPECT_GT(again.recorded.load(), 0);
  EXPECT_NE(snapshot_text(b).find(R"({"name":"site","filename":"c.py","line":7})"), std::string::npos);
  EXPECT_GT(again.symbolized.load(), 0);
  ccalloc_destroy(b);
  ccalloc_destroy(a);
}

/// A tracker whose first call blocks until `go`.
struct blocking_t {
  std::atomic<bool> inside{false};
  std::atomic<bool> go{false};
  std::atomic<int> calls{0};
};

/// An allocator of one simulated device.
ccalloc_allocator_t* sim_allocator() {
  ccalloc_options_t o;
  ccalloc_options_init(&o);
  o.backend = CCALLOC_BACKEND_SIM;
  ccalloc_allocator_t* a = nullptr;
  EXPECT_EQ(ccalloc_create(&o, &a), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(ccalloc_init(a, 1), CCALLOC_OK);
  return a;
}

ccalloc_allocator_t* make_blocking_allocator(blocking_t& b) {
  ccalloc_allocator_t* a = sim_allocator();
  EXPECT_EQ(ccalloc_attach_trace_tracker(
                a,
                [](void* u, const ccalloc_trace_entry_t*) {
                  auto& s = *static_cast<blocking_t*>(u);
                  if (s.calls++ != 0) return;
                  s.inside = true;
                  while (!s.go) std::this_thread::sleep_for(std::chrono::milliseconds(1));
                },
                &b),
            CCALLOC_OK);
  return a;
}

/// A thread whose malloc's tracker call blocks; returns once it is inside.
std::thread user_inside_the_tracker(ccalloc_allocator_t* a, blocking_t& b) {
  std::thread user([a] {
    void* p = nullptr;
    EXPECT_EQ(ccalloc_malloc(a, 0, 4096, nullptr, &p), CCALLOC_OK);
    EXPECT_EQ(ccalloc_delete(a, p), CCALLOC_OK);
  });
  while (!b.inside) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return user;
}

TEST(CApiObservers, StoppingWaitsForACallInAnotherThread) {
  restart_at_end restart;
  blocking_t b;
  ccalloc_allocator_t* a = make_blocking_allocator(b);
  std::thread user = user_inside_the_tracker(a, b);
  std::atomic<bool> stopped{false};
  size_t running = 99;
  std::thread stopper([&] {
    EXPECT_EQ(ccalloc_set_observers_enabled(0, 60'000, &running), CCALLOC_OK);
    stopped = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(stopped.load()) << "returned while a tracker was still running";
  b.go = true;
  stopper.join();
  user.join();
  EXPECT_TRUE(stopped.load());
  EXPECT_EQ(running, 0u);
  EXPECT_EQ(b.calls.load(), 1) << "the entries after the stop reached no tracker";
  ccalloc_destroy(a);
}

TEST(CApiObservers, StoppingGivesUpAfterItsTimeoutAndCountsTheCallsLeft) {
  restart_at_end restart;
  blocking_t b;
  ccalloc_allocator_t* a = make_blocking_allocator(b);
  std::thread user = user_inside_the_tracker(a, b);
  size_t running = 99;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(ccalloc_set_observers_enabled(0, 50, &running), CCALLOC_OK);
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(50));
  EXPECT_EQ(running, 1u);
  b.go = true;
  user.join();
  EXPECT_EQ(ccalloc_set_observers_enabled(0, 0, &running), CCALLOC_OK);
  EXPECT_EQ(running, 0u);
  ccalloc_destroy(a);
}

TEST(CApiObservers, ACallbackThatStopsThemDoesNotWaitForItself) {
  restart_at_end restart;
  struct self_t {
    size_t running = 99;
    int calls = 0;
  } s;
  ccalloc_allocator_t* a = sim_allocator();
  ASSERT_EQ(ccalloc_attach_trace_tracker(
                a,
                [](void* u, const ccalloc_trace_entry_t*) {
                  auto& me = *static_cast<self_t*>(u);
                  if (me.calls++ == 0) (void)ccalloc_set_observers_enabled(0, 60'000, &me.running);
                },
                &s),
            CCALLOC_OK);
  const auto start = std::chrono::steady_clock::now();
  void* p = nullptr;
  ASSERT_EQ(ccalloc_malloc(a, 0, 4096, nullptr, &p), CCALLOC_OK);
  ASSERT_EQ(ccalloc_delete(a, p), CCALLOC_OK);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  EXPECT_EQ(s.running, 0u);
  EXPECT_EQ(s.calls, 1);
  ccalloc_destroy(a);
}

}  // namespace
