// Stack contexts of PyTorch's memory history through ccalloc's C API: the
// callbacks of ccalloc_history_options_t (include/ccalloc/ccalloc.h) for
// the CreateContextFn that torch.cuda.memory._record_memory_history passes
// to the allocator's recordHistory (torch_allocator.cpp).
//
// PyTorch's recorder (stacks="python" or "all") returns a GatheredContext,
// in practice a torch::CapturedTraceback: raw Python code objects and
// instruction pointers, cheap to take. ccalloc keeps it as an opaque handle
// (a heap shared_ptr) with the entries and blocks it belongs to, and only
// when a snapshot is written asks for its frames: torch::symbolize, which
// turns Python frames into name/filename/line itself (taking the GIL) and
// C++ frames through PyTorch's unwinder, the frames PyTorch's own snapshot
// shows. Releasing a CapturedTraceback needs no GIL (PyTorch queues its
// Python references), so ccalloc may drop a handle on any thread.
//
// A header of its own so that the tests compile and run it against
// stand-ins of these PyTorch types (tests/torch_standins/), where no
// PyTorch is installed.
#pragma once

#include <ccalloc/ccalloc.h>

#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/csrc/profiler/combined_traceback.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace ccalloc_torch {

using torch_context = std::shared_ptr<c10::GatheredContext>;

/// ccalloc_history_options_t::record: `user_data` is a CreateContextFn*.
inline void* record_context(void* user_data) {
  try {  // nothing may cross the C API: a failed gather records no stack
    torch_context context = (*static_cast<c10::cuda::CUDACachingAllocator::CreateContextFn*>(user_data))();
    return context ? new torch_context(std::move(context)) : nullptr;
  } catch (...) {
    return nullptr;
  }
}

/// ccalloc_history_options_t::release.
inline void release_context(void* /*user_data*/, void* handle) { delete static_cast<torch_context*>(handle); }

/// ccalloc_history_options_t::frames: PyTorch's symbolized frames, innermost first.
inline void context_frames(void* /*user_data*/, void* handle, ccalloc_frame_sink_fn sink, void* sink_data) {
  try {
    auto* traceback = dynamic_cast<torch::CapturedTraceback*>(static_cast<torch_context*>(handle)->get());
    if (traceback == nullptr) return;  // another GatheredContext: PyTorch's snapshot shows no frames for it either
    const torch::SymbolizedTracebacks symbolized = torch::symbolize({traceback});
    if (symbolized.tracebacks.empty()) return;
    for (const std::uint64_t i : symbolized.tracebacks.front()) {
      const auto& frame = symbolized.all_frames.at(i);
      sink(sink_data, frame.funcname.c_str(), frame.filename.c_str(), static_cast<std::int64_t>(frame.lineno));
    }
  } catch (...) {
    // A context that cannot be symbolized shows no frames.
  }
}

/// PyTorch's skip_actions (trace action names, the same as ccalloc's) as one comma-separated string.
inline std::string join_actions(const std::vector<std::string>& actions) {
  std::string out;
  for (const std::string& a : actions) out += (out.empty() ? "" : ",") + a;
  return out;
}

}  // namespace ccalloc_torch
