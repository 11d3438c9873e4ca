// replay_cuda_check.cpp: replays traces on the simulated device and on a real
// GPU (`ccalloc replay --device sim` and `--device cuda`, SPEC X8) and
// compares the two. A standalone program with nothing but the standard
// library (the GPU machine's minimal build has no CLI11 or nlohmann-json);
// scripts/gpu.sh check runs it.
//
// Usage: ccalloc_replay_cuda_check [--config STR] [--cuda-device N] [--repeat N] [TRACE...]
//   Without TRACE: the bundled gpt2_train and bert_copystream_infer traces
//   (CCALLOC_GPU_REPLAY_TRACE_DIR, set by CMake: plain copies when the build
//   has no zlib).
// Output: per trace, one JSON object per line for each device, with the keys
// of `ccalloc replay --json` ("device": "sim" | "cuda"), then a line
// "trace NAME: MATCH" or "trace NAME: MISMATCH (...)". Peak requested and
// reserved bytes and the OOM count must be equal; differing peak allocated
// bytes and device malloc/free counts are reported as a note (plain segment
// addresses, which differ between the devices, can break ties between equal
// free blocks). With --repeat N (the trace run N times back to back, as
// `ccalloc replay --repeat`), each pass's peak requested and reserved bytes
// and device synchronizations must be equal too.
// Exit status: 0 when every trace matched; 1 on a mismatch or an error (no
// GPU, a bad trace); 2 on a usage error.
#include <ccalloc/base/errors.hpp>
#include <ccalloc/replay/replay.hpp>
#include <ccalloc/replay/trace.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#ifndef CCALLOC_GPU_REPLAY_TRACE_DIR
#define CCALLOC_GPU_REPLAY_TRACE_DIR ""
#endif
#ifndef CCALLOC_GPU_REPLAY_TRACE_SUFFIX
#define CCALLOC_GPU_REPLAY_TRACE_SUFFIX ".trace.gz"
#endif

namespace {

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    out += c;
  }
  return out + "\"";
}

void print_json(const ccalloc::replay_result& r) {
  std::printf(
      "{\"trace\": %s, \"device\": \"%s\", \"config\": %s, \"device_memory_bytes\": %llu, \"events\": %llu, "
      "\"peak_requested_bytes\": %llu, \"peak_allocated_bytes\": %llu, \"peak_reserved_bytes\": %llu, "
      "\"fragmentation\": %.6f, \"device_mallocs\": %llu, \"device_frees\": %llu, \"ooms\": %llu, "
      "\"alloc_retries\": %llu, \"device_synchronizations\": %llu, \"repeat\": %llu, \"wall_seconds\": %.6f}\n",
      json_string(r.source).c_str(), ccalloc::to_string(r.device), json_string(r.config).c_str(),
      static_cast<unsigned long long>(r.device_memory_bytes), static_cast<unsigned long long>(r.events),
      static_cast<unsigned long long>(r.peak_requested_bytes), static_cast<unsigned long long>(r.peak_allocated_bytes),
      static_cast<unsigned long long>(r.peak_reserved_bytes), r.fragmentation(),
      static_cast<unsigned long long>(r.device_mallocs), static_cast<unsigned long long>(r.device_frees),
      static_cast<unsigned long long>(r.ooms), static_cast<unsigned long long>(r.alloc_retries),
      static_cast<unsigned long long>(r.device_synchronizations), static_cast<unsigned long long>(r.repeat),
      r.wall_seconds);
}

// Appends "what: sim A vs cuda B" to `diffs` when they differ.
void compare(std::string& diffs, const char* what, std::uint64_t sim, std::uint64_t cuda) {
  if (sim == cuda) return;
  if (!diffs.empty()) diffs += "; ";
  diffs += std::string(what) + ": sim " + std::to_string(sim) + " vs cuda " + std::to_string(cuda);
}

}  // namespace

int main(int argc, char** argv) {
  std::string config;
  int cuda_device = 0;
  std::size_t repeat = 1;
  std::vector<std::string> traces;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if ((arg == "--config" || arg == "--cuda-device" || arg == "--repeat") && i + 1 < argc) {
      const std::string value = argv[++i];
      if (arg == "--config") {
        config = value;
      } else if (arg == "--repeat") {
        // Decimal digits only, 1 to 100000 (as `ccalloc replay --repeat`):
        // std::stoul took "-1" (wrapped) and "3abc" (as 3).
        repeat = 0;
        const bool digits = !value.empty() && value.size() <= 6 &&
                            value.find_first_not_of("0123456789") == std::string::npos;
        if (digits) repeat = std::stoul(value);
        if (repeat < 1 || repeat > 100000) {
          std::fprintf(stderr,
                       "ccalloc_replay_cuda_check: bad --repeat '%s': expected a whole number from 1 to 100000 "
                       "(passes of the trace)\n",
                       value.c_str());
          return 2;
        }
      } else {
        try {
          cuda_device = std::stoi(value);
        } catch (const std::exception&) {
          std::fprintf(stderr, "ccalloc_replay_cuda_check: bad --cuda-device '%s'\n", value.c_str());
          return 2;
        }
      }
    } else if (arg == "--help" || arg == "-h") {
      std::printf("usage: %s [--config STR] [--cuda-device N] [--repeat N] [TRACE...]\n", argv[0]);
      return 0;
    } else if (!arg.empty() && arg[0] == '-') {
      std::fprintf(stderr, "ccalloc_replay_cuda_check: unknown option '%s'\n", arg.c_str());
      return 2;
    } else {
      traces.push_back(arg);
    }
  }
  if (traces.empty()) {
    const std::string dir = CCALLOC_GPU_REPLAY_TRACE_DIR;
    if (dir.empty()) {
      std::fprintf(stderr,
                   "ccalloc_replay_cuda_check: no bundled traces in this build (no zlib, no gzip or python3 "
                   "at configure time): pass TRACE files\n");
      return 1;
    }
    for (const char* name : {"gpt2_train", "bert_copystream_infer"})
      traces.push_back(dir + "/" + name + CCALLOC_GPU_REPLAY_TRACE_SUFFIX);
  }

  int failures = 0;
  for (const std::string& path : traces) {
    try {
      const ccalloc::trace t = ccalloc::read_trace_file(path);
      ccalloc::replay_options o;
      o.config = config;
      o.cuda_device = cuda_device;
      o.repeat = repeat;
      o.device = ccalloc::replay_device::sim;
      const ccalloc::replay_result sim = ccalloc::replay_trace(t, o);
      print_json(sim);
      o.device = ccalloc::replay_device::cuda;
      const ccalloc::replay_result cuda = ccalloc::replay_trace(t, o);
      print_json(cuda);
      std::string diffs;
      compare(diffs, "peak_requested_bytes", sim.peak_requested_bytes, cuda.peak_requested_bytes);
      compare(diffs, "peak_reserved_bytes", sim.peak_reserved_bytes, cuda.peak_reserved_bytes);
      compare(diffs, "ooms", sim.ooms, cuda.ooms);
      compare(diffs, "device_synchronizations", sim.device_synchronizations, cuda.device_synchronizations);
      for (std::size_t k = 0; k < sim.passes.size() && k < cuda.passes.size() && sim.passes.size() > 1; ++k) {
        const std::string pass = "pass " + std::to_string(k + 1) + " ";
        compare(diffs, (pass + "peak_requested_bytes").c_str(), sim.passes[k].peak_requested_bytes,
                cuda.passes[k].peak_requested_bytes);
        compare(diffs, (pass + "peak_reserved_bytes").c_str(), sim.passes[k].peak_reserved_bytes,
                cuda.passes[k].peak_reserved_bytes);
      }
      std::string notes;
      // Best fit breaks size ties by address (as PyTorch does), and plain
      // segments get their addresses from the device: cudaMalloc and the
      // simulated device order them differently, so the blocks chosen (and
      // the rounded bytes allocated) may differ while the reservation agrees.
      compare(notes, "peak_allocated_bytes", sim.peak_allocated_bytes, cuda.peak_allocated_bytes);
      compare(notes, "device_mallocs", sim.device_mallocs, cuda.device_mallocs);
      compare(notes, "device_frees", sim.device_frees, cuda.device_frees);
      if (diffs.empty()) {
        std::printf("trace %s: MATCH%s\n", path.c_str(), notes.empty() ? "" : (" (note: " + notes + ")").c_str());
      } else {
        ++failures;
        std::printf("trace %s: MISMATCH (%s%s%s)\n", path.c_str(), diffs.c_str(), notes.empty() ? "" : "; ",
                    notes.c_str());
      }
    } catch (const std::exception& e) {
      ++failures;
      std::printf("trace %s: ERROR %s\n", path.c_str(), e.what());
    }
    std::fflush(stdout);
  }
  std::printf("%d of %zu trace(s) matched\n", static_cast<int>(traces.size()) - failures, traces.size());
  return failures == 0 ? 0 : 1;
}
