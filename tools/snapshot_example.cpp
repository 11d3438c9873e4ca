// snapshot_example.cpp: records memory history while a small workload runs
// on the default device (the GPU when there is one, else the simulated
// device), then writes a snapshot as JSON in PyTorch's layout (SPEC F13-F16,
// E4). A standalone program with nothing but the standard library and CUDA,
// so the GPU machine's minimal build has it; scripts/gpu.sh snapshots turns
// its output into a pickle (python/ccalloc/snapshot.py) and opens it with
// torch.cuda._memory_viz.
//
// Usage: ccalloc_snapshot_example OUT.json
// The workload: layers of activations allocated and freed on two streams, a
// block used on the second stream (record_stream), an out-of-memory attempt,
// annotations around each step, a compile context, user metadata, and a
// context recorder that returns the workload's own "frames".
#include <ccalloc/backend/default_backend.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/core/snapshot.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT.json\n", argv[0]);
    return 2;
  }
  try {
    auto backend = ccalloc::make_default_backend();
    ccalloc::caching_allocator alloc(backend, ccalloc::allocator_config{});
    alloc.init(1);
    const ccalloc::stream_t side = backend->create_stream(0);

    std::string where = "setup";
    ccalloc::history_options h;
    h.when = ccalloc::record_context::all;
    h.recorder = [&where] {
      auto c = std::make_shared<ccalloc::trace_context>();
      c->frames.push_back({where, "tools/snapshot_example.cpp", 0});
      c->frames.push_back({"main", "tools/snapshot_example.cpp", 0});
      return ccalloc::context_ptr(c);
    };
    alloc.record_history(h);
    alloc.set_user_metadata("ccalloc snapshot example");
    alloc.push_compile_context("example_model");

    std::vector<void*> weights;
    for (int i = 0; i < 8; ++i) weights.push_back(alloc.malloc(0, (std::size_t{3} + i) << 20, 0));
    for (int step = 0; step < 3; ++step) {
      alloc.record_annotation({{"stage", "START"}, {"name", "step " + std::to_string(step)}});
      where = "forward";
      std::vector<void*> activations;
      for (int layer = 0; layer < 12; ++layer) activations.push_back(alloc.malloc(0, (std::size_t{1} << 20) * (layer + 1) + 4000, 0));
      where = "backward";
      for (auto it = activations.rbegin(); it != activations.rend(); ++it) {
        void* grad = alloc.malloc(0, 700 * 1024, 0);  // small pool
        alloc.free(grad);
        alloc.free(*it);
      }
      where = "copy on the side stream";
      void* staging = alloc.malloc(0, 6 << 20, side);
      void* shared = alloc.malloc(0, 2 << 20, 0);
      alloc.record_stream(shared, side);
      alloc.free(shared);
      alloc.free(staging);
      alloc.record_annotation({{"stage", "END"}, {"name", "step " + std::to_string(step)}});
    }
    where = "too large";
    try {
      (void)alloc.malloc(0, std::size_t{1} << 50, 0);
    } catch (const ccalloc::out_of_memory_error&) {
    }
    alloc.pop_compile_context();
    where = "after the steps";
    void* live = alloc.malloc(0, 5 << 20, 0);
    backend->synchronize_device(0);

    const std::string json = ccalloc::to_json(alloc.snapshot());
    std::ofstream out(argv[1], std::ios::binary);
    out << json;
    if (!out.flush()) {
      std::fprintf(stderr, "cannot write %s\n", argv[1]);
      return 1;
    }
    std::printf("wrote %s (%zu bytes) from the %s backend\n", argv[1], json.size(), backend->name().c_str());
    alloc.free(live);
    for (void* w : weights) alloc.free(w);
    alloc.empty_cache();
    backend->destroy_stream(0, side);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ccalloc_snapshot_example: %s\n", e.what());
    return 1;
  }
}
