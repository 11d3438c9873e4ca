// Stand-in for PyTorch's c10/cuda/CUDACachingAllocator.h: only the types
// python/ccalloc/csrc/torch_history.hpp uses, with PyTorch's names and
// signatures, so that tests/torch_history_test.cpp compiles and runs it
// where PyTorch is not installed.
#pragma once

#include <memory>

namespace c10 {
struct GatheredContext {
  virtual ~GatheredContext() = default;
};
namespace cuda::CUDACachingAllocator {
using CreateContextFn = std::shared_ptr<GatheredContext> (*)();
enum struct RecordContext { NEVER = 0, STATE = 1, ALLOC = 2, ALL = 3 };
}  // namespace cuda::CUDACachingAllocator
}  // namespace c10
