// torch_history_test.cpp: the PyTorch integration's stack contexts
// (python/ccalloc/csrc/torch_history.hpp) through ccalloc's C API, compiled
// and run against stand-ins of PyTorch's types (tests/torch_standins/): a
// recorder as torch.cuda.memory._record_memory_history passes it, contexts
// symbolized only when a snapshot is written, frames with PyTorch's keys,
// every context released.
#include <ccalloc/ccalloc.h>

#include "torch_history.hpp"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <memory>
#include <string>

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;

int recorded = 0;

/// What PyTorch's gather() returns: here a traceback with two frames named after the call.
std::shared_ptr<c10::GatheredContext> gather() {
  auto t = std::make_shared<torch::CapturedTraceback>();
  ++recorded;
  t->frames.push_back({"model.py", "forward" + std::to_string(recorded), 10});
  t->frames.push_back({"train.py", "<module>", 3});
  return t;
}

/// A GatheredContext that is no CapturedTraceback (another profiler's).
struct other_context : c10::GatheredContext {};
std::shared_ptr<c10::GatheredContext> gather_other() { return std::make_shared<other_context>(); }

std::string snapshot_json(ccalloc_allocator_t* a) {
  size_t length = 0;
  EXPECT_EQ(ccalloc_snapshot_json(a, 1, nullptr, 0, &length), CCALLOC_OK) << ccalloc_last_error();
  std::string text(length + 65536, '\0');
  EXPECT_EQ(ccalloc_snapshot_json(a, 1, text.data(), text.size(), &length), CCALLOC_OK);
  text.resize(length);
  return text;
}

/// A simulated device with plain segments, through the C API.
struct sim_allocator {
  sim_allocator() {
    ccalloc_options_t o;
    ccalloc_options_init(&o);
    o.backend = CCALLOC_BACKEND_SIM;
    o.config = "expandable_segments:False";
    if (ccalloc_create(&o, &handle) != CCALLOC_OK || ccalloc_init(handle, 1) != CCALLOC_OK)
      ADD_FAILURE() << ccalloc_last_error();
  }
  ~sim_allocator() { ccalloc_destroy(handle); }
  sim_allocator(const sim_allocator&) = delete;
  sim_allocator& operator=(const sim_allocator&) = delete;
  ccalloc_allocator_t* handle = nullptr;
};

TEST(TorchHistory, PyTorchsRecorderGivesFramesInSnapshotsAndEveryContextIsReleased) {
  sim_allocator sim;
  ccalloc_allocator_t* a = sim.handle;
  ASSERT_NE(a, nullptr);

  cca::CreateContextFn fn = &gather;
  ccalloc_history_options_t h;
  ccalloc_history_options_init(&h);
  h.when = static_cast<int>(cca::RecordContext::ALL);
  const std::string skip = ccalloc_torch::join_actions({"segment_alloc", "free_completed"});
  EXPECT_EQ(skip, "segment_alloc,free_completed");
  h.skip_actions = skip.c_str();
  h.user_data = &fn;
  h.record = &ccalloc_torch::record_context;
  h.release = &ccalloc_torch::release_context;
  h.frames = &ccalloc_torch::context_frames;
  ASSERT_EQ(ccalloc_record_history_ex(a, &h), CCALLOC_OK) << ccalloc_last_error();

  void* p = nullptr;
  ASSERT_EQ(ccalloc_malloc(a, 0, 4096, nullptr, &p), CCALLOC_OK);  // forward1
  void* q = nullptr;
  ASSERT_EQ(ccalloc_malloc(a, 0, 8192, nullptr, &q), CCALLOC_OK);  // forward2
  ASSERT_EQ(ccalloc_delete(a, q), CCALLOC_OK);                     // forward3
  EXPECT_EQ(recorded, 3);
  EXPECT_EQ(torch::CapturedTraceback::alive, 3);
  EXPECT_EQ(torch::CapturedTraceback::symbolized, 0) << "symbolized only for a snapshot";

  const auto j = nlohmann::json::parse(snapshot_json(a));
  EXPECT_GT(torch::CapturedTraceback::symbolized, 0);
  const auto& block = j["segments"][0]["blocks"][0];
  EXPECT_EQ(block["state"], "active_allocated");
  EXPECT_EQ(block["frames"], nlohmann::json::parse(R"([{"name":"forward1","filename":"model.py","line":10},
                                                       {"name":"<module>","filename":"train.py","line":3}])"));
  const auto& trace = j["device_traces"][0];
  std::string actions;
  for (const auto& e : trace) actions += e["action"].get<std::string>() + " ";
  // No `snapshot` entry: the size query records none, and the call that
  // filled the buffer records its own after making the text.
  EXPECT_EQ(actions, "alloc alloc free_requested ");
  EXPECT_EQ(trace[1]["frames"][0]["name"], "forward2");
  EXPECT_EQ(trace[2]["frames"][0]["name"], "forward3") << "the free's own stack (RecordContext::ALL)";

  // A context of another kind: kept and released, no frames.
  cca::CreateContextFn other = &gather_other;
  h.user_data = &other;
  h.clear = 1;
  ASSERT_EQ(ccalloc_record_history_ex(a, &h), CCALLOC_OK);
  void* r = nullptr;
  ASSERT_EQ(ccalloc_malloc(a, 0, 4096, nullptr, &r), CCALLOC_OK);
  const auto k = nlohmann::json::parse(snapshot_json(a));
  EXPECT_EQ(k["device_traces"][0][0]["action"], "alloc");
  EXPECT_TRUE(k["device_traces"][0][0]["frames"].empty());

  EXPECT_EQ(ccalloc_delete(a, p), CCALLOC_OK);
  EXPECT_EQ(ccalloc_delete(a, r), CCALLOC_OK);
  ASSERT_EQ(ccalloc_record_history(a, 0, 1), CCALLOC_OK);
  EXPECT_EQ(torch::CapturedTraceback::alive, 0) << "every traceback released";
}

}  // namespace
