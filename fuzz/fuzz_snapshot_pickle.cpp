// fuzz_snapshot_pickle: the PyTorch snapshot pickle reader
// (convert_pytorch_snapshot_data: replay/pickle_reader.cpp and
// replay/snapshot_reader.cpp), gzip input included. Checks:
//   - only trace_error escapes, naming the input and no line (the shared
//     checks of trace_reader_contract.hpp); small limits (1 MiB, 200,000
//     objects) make over-limit inputs fail with the limit's message;
//   - events' lines are 1, 2, 3... (their position), times never decrease,
//     each site is 0 or one of the trace's sites;
//   - reading is deterministic (a second read gives the same events);
//   - a trace that was read replays on a small simulated device or fails
//     with a trace_error naming one of its events.
#include "trace_reader_contract.hpp"

#include <ccalloc/replay/replay.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using ccalloc::fuzz::violated;
  const std::string source = "fuzz-input";
  const std::string_view raw(reinterpret_cast<const char*>(data), size);
  std::string bytes;
  try {
    bytes = ccalloc::maybe_gunzip(raw, source);
  } catch (const ccalloc::trace_error& e) {
    ccalloc::fuzz::check_error(e, source, 0);
    return 0;
  }
  ccalloc::trace_read_options options;
  options.max_pickle_bytes = std::uint64_t{1} << 20;
  options.max_pickle_objects = 200000;
  ccalloc::trace t;
  try {
    t = ccalloc::convert_pytorch_snapshot_data(bytes, source, options);
  } catch (const ccalloc::trace_error& e) {
    ccalloc::fuzz::check_error(e, source, 0);
    const std::string what = e.what();
    if (what.find('\n') != std::string::npos) violated("a multi-line message: " + what);
    return 0;
  }
  if (t.source != source) violated("trace source '" + t.source + "', not '" + source + "'");
  for (std::size_t i = 0; i < t.events.size(); ++i) {
    const ccalloc::trace_event& e = t.events[i];
    if (e.line != i + 1) violated("event " + std::to_string(i) + " has line " + std::to_string(e.line));
    if (i > 0 && e.time_us < t.events[i - 1].time_us) violated("time steps back at event " + std::to_string(i));
    if (e.site > t.sites.size()) violated("site " + std::to_string(e.site) + " of " + std::to_string(t.sites.size()));
  }
  const ccalloc::trace again = ccalloc::convert_pytorch_snapshot_data(bytes, source, options);
  if (again.events.size() != t.events.size() || again.sites != t.sites || again.notes != t.notes)
    violated("a second read differs");
  for (std::size_t i = 0; i < t.events.size(); ++i) {
    const auto &a = t.events[i], &b = again.events[i];
    if (std::tie(a.time_us, a.action, a.addr, a.size, a.stream, a.site) !=
        std::tie(b.time_us, b.action, b.addr, b.size, b.stream, b.site))
      violated("a second read differs at event " + std::to_string(i));
  }
  if (ccalloc::fuzz::check_empty_trace_rejected(t)) return 0;
  ccalloc::replay_options replay;
  replay.device_memory_bytes = std::size_t{1} << 30;
  try {
    const auto r = ccalloc::replay_trace(t, replay);
    if (r.events != t.events.size()) violated("replay did not replay every event");
  } catch (const ccalloc::trace_error& e) {
    if (e.line == 0 || e.line > t.events.size())
      violated(std::string("replay's trace_error names no event of the trace: ") + e.what());
  }
  return 0;
}
