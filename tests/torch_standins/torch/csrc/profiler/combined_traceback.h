// Stand-in for PyTorch's torch/csrc/profiler/combined_traceback.h (see
// ../../../c10/cuda/CUDACachingAllocator.h): a CapturedTraceback that holds
// its frames already, and a symbolize() that counts its calls.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>

#include <cstdint>
#include <string>
#include <vector>

namespace torch {
namespace unwind {
struct Frame {
  std::string filename;
  std::string funcname;
  std::uint64_t lineno;
};
}  // namespace unwind

struct SymbolizedTracebacks {
  std::vector<unwind::Frame> all_frames;
  std::vector<std::vector<std::uint64_t>> tracebacks;
};

struct CapturedTraceback : public c10::GatheredContext {
  std::vector<unwind::Frame> frames;  // stand-in only: PyTorch keeps code objects and addresses
  inline static int alive = 0;
  inline static int symbolized = 0;
  CapturedTraceback() { ++alive; }
  ~CapturedTraceback() override { --alive; }
  CapturedTraceback(const CapturedTraceback&) = delete;
  CapturedTraceback& operator=(const CapturedTraceback&) = delete;
};

inline SymbolizedTracebacks symbolize(const std::vector<CapturedTraceback*>& to_symbolize) {
  SymbolizedTracebacks out;
  for (CapturedTraceback* t : to_symbolize) {
    ++CapturedTraceback::symbolized;
    std::vector<std::uint64_t> indices;
    for (const unwind::Frame& f : t->frames) {
      indices.push_back(out.all_frames.size());
      out.all_frames.push_back(f);
    }
    out.tracebacks.push_back(std::move(indices));
  }
  return out;
}
}  // namespace torch
