// fuzz_trace_text: the reader of ccalloc's trace text format
// (docs/trace-format.md; replay/trace_reader.cpp), gzip input included, and
// the replay's checks of a trace's own history (replay.cpp).
//
// Checks, beyond the reader contract (trace_reader_contract.hpp):
//   - round trip: the events written back as text, once plainly and once with
//     every number zero-padded to 20 digits, read back to the same events.
//     The padded text takes the reader's checking path (the fast path takes at
//     most 19 digits), the plain one its fast path, so this also checks the
//     reader's promise that both paths agree;
//   - a trace that parsed replays on a small simulated device (1 GiB, so
//     out-of-memory happens) or fails with a trace_error naming one of its
//     lines; any other exception is a bug.
#include "trace_reader_contract.hpp"

#include <ccalloc/replay/replay.hpp>

#include <cinttypes>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

namespace {

using ccalloc::fuzz::violated;

std::string write_events(const ccalloc::trace& t, bool padded) {
  std::string out;
  char line[160];
  for (const ccalloc::trace_event& e : t.events) {
    const std::string action(ccalloc::to_string(e.action));
    if (padded)
      std::snprintf(line, sizeof line, "%020" PRIu64 " %s %020" PRIu64 " %020" PRIu64 " %020" PRIu64 "\n", e.time_us,
                    action.c_str(), e.addr, e.size, e.stream);
    else
      std::snprintf(line, sizeof line, "%" PRIu64 " %s %" PRIu64 " %" PRIu64 " %" PRIu64 "\n", e.time_us,
                    action.c_str(), e.addr, e.size, e.stream);
    out += line;
    // tag, pause and resume lines end with their tag (and pause's keep|drop).
    if (e.action == ccalloc::trace_action::tag || e.action == ccalloc::trace_action::pause ||
        e.action == ccalloc::trace_action::resume) {
      out.pop_back();
      out += ' ';
      out += e.tag == 0 ? std::string("default") : t.tags.at(e.tag - 1);
      if (e.action == ccalloc::trace_action::pause) out += e.keep_contents ? " keep" : " drop";
      out += '\n';
    }
  }
  return out;
}

void check_round_trip(const ccalloc::trace& t, bool padded) {
  const std::string text = write_events(t, padded);
  ccalloc::trace again;
  try {
    again = ccalloc::parse_trace_text(text, "round-trip");
  } catch (const ccalloc::trace_error& e) {
    violated(std::string("events written back do not read back: ") + e.what());
  }
  if (again.events.size() != t.events.size()) violated("round trip changed the number of events");
  for (std::size_t i = 0; i < t.events.size(); ++i) {
    const auto& a = t.events[i];
    const auto& b = again.events[i];
    if (a.time_us != b.time_us || a.action != b.action || a.addr != b.addr || a.size != b.size ||
        a.stream != b.stream || b.line != i + 1 || a.keep_contents != b.keep_contents ||
        (a.tag == 0 ? std::string("default") : t.tags.at(a.tag - 1)) !=
            (b.tag == 0 ? std::string("default") : again.tags.at(b.tag - 1)))
      violated("round trip (" + std::string(padded ? "padded" : "plain") + ") changed event " + std::to_string(i) +
               " (line " + std::to_string(a.line) + ")");
  }
}

void check_replay(const ccalloc::trace& t) {
  if (ccalloc::fuzz::check_empty_trace_rejected(t)) return;
  ccalloc::replay_options options;
  options.device_memory_bytes = std::size_t{1} << 30;
  try {
    const auto r = ccalloc::replay_trace(t, options);
    if (r.events != t.events.size()) violated("replay did not replay every event");
    if (r.peak_reserved_bytes > options.device_memory_bytes) violated("replay reserved more than the device has");
  } catch (const ccalloc::trace_error& e) {
    if (e.line == 0 || e.line > (t.events.empty() ? 0 : t.events.back().line))
      violated(std::string("replay's trace_error names no line of the trace: ") + e.what());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto t = ccalloc::fuzz::check_trace_reader(
      data, size, [](std::string_view text, const std::string& source) { return ccalloc::parse_trace_text(text, source); });
  if (!t) return 0;
  check_round_trip(*t, false);
  check_round_trip(*t, true);
  check_replay(*t);
  return 0;
}
