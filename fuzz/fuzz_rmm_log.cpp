// fuzz_rmm_log: the reader of RMM logging_resource_adaptor CSV logs
// (`Thread,Time,Action,Pointer,Size,Stream`; replay/rmm_reader.cpp), gzip
// input included, through the shared reader contract
// (trace_reader_contract.hpp: only trace_error escapes, it names the input
// and a line that exists, events come in line order), and the replay of
// every log that parsed: it replays on a small simulated device or fails
// with a trace_error naming one of its lines.
#include "trace_reader_contract.hpp"

#include <ccalloc/replay/replay.hpp>

#include <cstddef>
#include <cstdint>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto t = ccalloc::fuzz::check_trace_reader(
      data, size, [](std::string_view text, const std::string& source) { return ccalloc::parse_rmm_log(text, source); });
  if (!t) return 0;
  ccalloc::replay_options options;
  options.device_memory_bytes = std::size_t{1} << 30;
  try {
    const auto r = ccalloc::replay_trace(*t, options);
    if (r.events != t->events.size()) ccalloc::fuzz::violated("replay did not replay every event");
  } catch (const ccalloc::trace_error& e) {
    if (e.line == 0 || e.line > (t->events.empty() ? 0 : t->events.back().line))
      ccalloc::fuzz::violated(std::string("replay's trace_error names no line of the log: ") + e.what());
  }
  return 0;
}
