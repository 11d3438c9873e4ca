// fuzz_rmm_log: the reader of RMM logging_resource_adaptor CSV logs
// (`Thread,Time,Action,Pointer,Size,Stream`; replay/rmm_reader.cpp), gzip
// input included. Checks:
//   - only trace_error escapes; it names the input and a line that exists
//     (the shared checks of trace_reader_contract.hpp);
//   - events come in line order, every line one of the input's. A `free`
//     line gives two events (free_requested and free_completed) with the same
//     line, so lines never decrease (the text format's reader, one event per
//     line, is held to strictly increasing lines);
//   - a log that parsed replays on a small simulated device or fails with a
//     trace_error naming one of its lines.
#include "trace_reader_contract.hpp"

#include <ccalloc/replay/replay.hpp>

#include <cstddef>
#include <cstdint>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using ccalloc::fuzz::violated;
  const std::string source = "fuzz-input";
  const std::string_view raw(reinterpret_cast<const char*>(data), size);
  std::string text;
  try {
    text = ccalloc::maybe_gunzip(raw, source);
  } catch (const ccalloc::trace_error& e) {
    ccalloc::fuzz::check_error(e, source, 0);
    return 0;
  }
  const std::size_t lines = ccalloc::fuzz::line_count(text);
  ccalloc::trace t;
  try {
    t = ccalloc::parse_rmm_log(text, source);
  } catch (const ccalloc::trace_error& e) {
    ccalloc::fuzz::check_error(e, source, lines);
    return 0;
  }
  if (t.source != source) violated("trace source '" + t.source + "', not '" + source + "'");
  std::uint64_t previous = 0;
  for (const ccalloc::trace_event& e : t.events) {
    if (e.line < previous || e.line == 0 || e.line > lines)
      violated("event line " + std::to_string(e.line) + " after line " + std::to_string(previous) + " of " +
               std::to_string(lines));
    previous = e.line;
  }
  if (ccalloc::fuzz::check_empty_trace_rejected(t)) return 0;
  ccalloc::replay_options options;
  options.device_memory_bytes = std::size_t{1} << 30;
  try {
    const auto r = ccalloc::replay_trace(t, options);
    if (r.events != t.events.size()) violated("replay did not replay every event");
  } catch (const ccalloc::trace_error& e) {
    if (e.line == 0 || e.line > (t.events.empty() ? 0 : t.events.back().line))
      violated(std::string("replay's trace_error names no line of the log: ") + e.what());
  }
  return 0;
}
