// ccalloc_cli.cpp: the `ccalloc` command line tool (SPEC X8).
//
//   ccalloc replay  [TRACE] [--config STR] [--device sim|cuda[:N]] [--device-memory BYTES] [--repeat N]
//                   [--device-lag EVENTS] [--own-addresses] [--json]
//   ccalloc compare [TRACE] --config A [--config B ...] [--device sim|cuda[:N]] [--device-memory BYTES]
//                   [--repeat N] [--device-lag EVENTS] [--json]
//   ccalloc report  [TRACE] [-o OUT.html] [--config STR] [--device-memory BYTES] [--points N] [--title T]
//   ccalloc config-keys
//
// TRACE is ccalloc's trace format, an RMM logging_resource_adaptor CSV, or a
// PyTorch snapshot pickle (read without Python), told apart by content
// (include/ccalloc/replay/trace.hpp). `replay --snapshot FILE.json` records
// history during the replay and writes a snapshot after the last event, in
// PyTorch's layout (python/ccalloc/snapshot.py turns it into a pickle).
// On a terminal, replays that take a while show a progress bar on stderr.
//
// --device: where the replay runs (include/ccalloc/replay/replay.hpp):
// "sim" (default), the simulated device of --device-memory bytes; "cuda" or
// "cuda:N", the real GPU N (default 0) through the CUDA backend, with the
// GPU's own memory (--device-memory is then a usage error). The report and
// the JSON ("device": "sim" | "cuda") say which.
//
// Without TRACE, replay and compare use the trace embedded in the binary
// (include/ccalloc/replay/embedded.hpp). When PyTorch's own figures for the
// trace are known (built in for the embedded trace; for a file, an entry
// named after it in a native_peaks.json in the same folder:
// include/ccalloc/replay/native_reference.hpp), the output compares
// ccalloc's peaks with them.
//
// Exit status: 0 success; 1 a ccalloc error (bad trace, bad configuration,
// unreadable file), printed as "ccalloc: <message>" on stderr; 2 a usage
// error (unknown option, missing subcommand, bad --repeat, --device or --device-memory
// value, --device-memory with --device cuda); 3 a replay in which
// allocations failed with out of memory (its figures are of another program
// than the one recorded: no ratio against PyTorch is printed), unless
// --allow-oom is given.
// With --json, stdout holds exactly one JSON document; warnings go to stderr.
//
// --repeat N (replay, compare): the trace runs N times back to back as one
// program (allocations the trace never frees are made in the first pass
// only; include/ccalloc/replay/replay.hpp defines it), and the output adds
// each pass's peaks, fragmentation and device synchronizations ("passes" in
// the JSON). PyTorch's figures stay those of the one recorded pass.
//
// --device-lag EVENTS (replay, compare; simulated device only): the device
// runs that many trace events behind the host, as a GPU does, so an event
// the allocator records completes EVENTS events later
// (replay_options::device_lag_events). Default 0: the device keeps up.
//
// --own-addresses (replay, compare; simulated device): the simulated device
// places every segment in its own order (lowest free address) instead of at
// the recording's segment_alloc addresses (replay_options::recorded_addresses;
// used by default when the trace has them). The output says which was used
// ("segment places"; "segment_addresses" in the JSON: "recorded", "own"
// or "driver" for a GPU).
#include <ccalloc/base/detail/bytes_text.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/core/config.hpp>
#include <ccalloc/core/file_output.hpp>
#include <ccalloc/core/snapshot.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>
#include <ccalloc/replay/embedded.hpp>
#include <ccalloc/replay/native_reference.hpp>
#include <ccalloc/replay/replay.hpp>
#include <ccalloc/replay/report.hpp>
#include <ccalloc/replay/trace.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <utility>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <limits>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace {

namespace detail {

using json = nlohmann::ordered_json;

// The --json output: text that is not UTF-8 (a file name of other bytes,
// legal on Linux) is written with U+FFFD in its place, not refused after
// the whole replay.
std::string json_text(const json& j) { return j.dump(2, ' ', false, json::error_handler_t::replace); }

/// What the command is doing, for the message of a host out-of-memory
/// (std::bad_alloc, caught in main): "reading the trace <file>",
/// "replaying the trace", ... In a fixed buffer, so that saying it
/// allocates nothing.
char current_step[512] = "";

/// Sets current_step to `what`, followed by `name` when it is not empty.
void set_step(const char* what, std::string_view name = {}) {
  std::snprintf(current_step, sizeof current_step, "%s%s%.*s", what, name.empty() ? "" : " ",
                static_cast<int>(std::min<std::size_t>(name.size(), 400)), name.data());
}

/// A command-line value that parses but is not acceptable (exit status 2).
class usage_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// ---- formatting helpers ------------------------------------------------------

/// printf into a std::string.
template <typename... Args>
std::string format(const char* fmt, Args... args) {
  const int n = std::snprintf(nullptr, 0, fmt, args...);
  if (n <= 0) return {};
  std::string out(static_cast<std::size_t>(n) + 1, '\0');
  std::snprintf(out.data(), out.size(), fmt, args...);
  out.resize(static_cast<std::size_t>(n));
  return out;
}

/// 13594206920 -> "13,594,206,920".
std::string with_commas(std::uint64_t value) {
  std::string digits = std::to_string(value);
  std::string out;
  out.reserve(digits.size() + digits.size() / 3);
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i != 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

/// Bytes as GiB with 3 decimals: "12.661 GiB".
std::string gib(std::uint64_t bytes) { return ccalloc::detail::format_gib(bytes); }

/// Pads `s` on the left (right-aligns it) to `width` characters.
std::string right(const std::string& s, std::size_t width) {
  return s.size() >= width ? s : std::string(width - s.size(), ' ') + s;
}
/// Pads `s` on the right (left-aligns it) to `width` characters.
std::string left(const std::string& s, std::size_t width) {
  return s.size() >= width ? s : s + std::string(width - s.size(), ' ');
}

/// "" and "default" both mean the default configuration; shown as "default".
std::string config_label(const std::string& config) {
  return config.empty() || config == "default" ? "default" : config;
}
std::string config_string(const std::string& config) { return config == "default" ? "" : config; }

// ---- --device-memory -----------------------------------------------------------

/// Parses a byte count: a non-negative number (integer, decimal or exponent
/// form: 80000000000, 1.5e9) with an optional unit, case-insensitive: B;
/// K/KB, M/MB, G/GB, T/TB, P/PB, E/EB (powers of 1000); KiB, MiB, GiB, TiB,
/// PiB, EiB (powers of 1024). With a unit of 1000 bytes or more,
/// fractional bytes are rounded down (1.3GiB); without a unit (or with B)
/// the number must be a whole number of bytes (1.5e9 is, 1.5 is not).
/// Throws usage_error when the text is not of that form, the result is 0, it
/// is a fraction of a byte, or it does not fit in 64 bits (16 EiB is one
/// byte too many).
std::uint64_t parse_byte_count(const std::string& text, std::string_view option) {
  const auto bad = [&](const std::string& why) {
    return usage_error("bad " + std::string(option) + " '" + text + "': " + why +
                       " (examples: 80000000000, 80GB, 80GiB, 512MiB, 1.5e9)");
  };
  // The number: digits, a point, and an exponent only where 'e' is followed
  // by a digit (or a sign and a digit), so "1.5e9" is a number while the 'E'
  // of "16EiB" and "2EB" starts the unit.
  std::size_t i = std::min(text.find_first_not_of("0123456789.+-"), text.size());
  if (i < text.size() && (text[i] == 'e' || text[i] == 'E')) {
    std::size_t j = i + 1;
    if (j < text.size() && (text[j] == '+' || text[j] == '-')) ++j;
    if (j < text.size() && std::isdigit(static_cast<unsigned char>(text[j])) != 0)
      i = std::min(text.find_first_not_of("0123456789", j), text.size());
  }
  const std::string_view number(text.data(), i);
  std::string unit = text.substr(i);
  while (!unit.empty() && unit.front() == ' ') unit.erase(0, 1);
  for (char& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (number.empty()) throw bad("expected a number of bytes");
  if (number.front() == '-') throw bad("must be positive");

  std::uint64_t multiplier = 0;
  struct unit_info {
    std::string_view name;
    std::uint64_t bytes;
  };
  constexpr std::uint64_t k = 1000, ki = 1024;
  constexpr unit_info units[] = {
      {"", 1},           {"b", 1},
      {"k", k},          {"kb", k},           {"kib", ki},
      {"m", k * k},      {"mb", k * k},       {"mib", ki * ki},
      {"g", k * k * k},  {"gb", k * k * k},   {"gib", ki * ki * ki},
      {"t", k * k * k * k}, {"tb", k * k * k * k}, {"tib", ki * ki * ki * ki},
      {"p", k * k * k * k * k}, {"pb", k * k * k * k * k}, {"pib", ki * ki * ki * ki * ki},
      {"e", k * k * k * k * k * k}, {"eb", k * k * k * k * k * k}, {"eib", ki * ki * ki * ki * ki * ki},
  };
  for (const auto& u : units) {
    if (unit == u.name) multiplier = u.bytes;
  }
  if (multiplier == 0)
    throw bad("unknown unit '" + text.substr(i) + "' (units: B, KB, MB, GB, TB, PB, EB (powers of 1000), KiB, MiB, "
              "GiB, TiB, PiB, EiB (powers of 1024))");
  const auto too_large = [&] {
    return bad("out of range: more than " + std::to_string(std::numeric_limits<std::uint64_t>::max()) +
               " bytes (16 EiB - 1)");
  };

  // Integers are exact (no detour through double).
  std::uint64_t whole = 0;
  const auto [end, ec] = std::from_chars(number.data(), number.data() + number.size(), whole);
  std::uint64_t bytes = 0;
  if (ec == std::errc{} && end == number.data() + number.size()) {
    if (whole > std::numeric_limits<std::uint64_t>::max() / multiplier) throw too_large();
    bytes = whole * multiplier;
  } else {
    double value = 0;
    const auto [dend, dec] = std::from_chars(number.data(), number.data() + number.size(), value);
    if (dec != std::errc{} || dend != number.data() + number.size() || !std::isfinite(value)) {
      if (dec == std::errc::result_out_of_range) throw too_large();
      throw bad("not a number");
    }
    const double total = value * double(multiplier);
    if (total >= 18446744073709551616.0) throw too_large();
    if (multiplier == 1 && total != std::floor(total))
      throw bad("not a whole number of bytes (give whole bytes, or a unit: 1.5KB, 1.5GiB)");
    bytes = static_cast<std::uint64_t>(total);
  }
  if (bytes == 0) throw bad("must be at least 1 byte");
  if (bytes > std::numeric_limits<std::size_t>::max()) throw too_large();
  return bytes;
}

/// Parses a whole-number option (--repeat, --points): decimal digits only
/// (no sign, blanks, fraction or 0x), from `min` to `max`. Throws usage_error
/// "bad <option> '<text>': expected a whole number from <min> to <max> (<what>)"
/// ("of at least <min>" when max is the largest std::uint64_t, unless the
/// text is a number too large: then the range with its top).
std::uint64_t parse_count(const std::string& text, std::string_view option, std::uint64_t min, std::uint64_t max,
                          std::string_view what) {
  std::uint64_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  const bool whole = !text.empty() && ec == std::errc{} && end == text.data() + text.size();
  // Digits only but beyond max (or beyond 2^64-1): the range names the top.
  const bool too_large = !text.empty() && end == text.data() + text.size() &&
                         (ec == std::errc::result_out_of_range || (ec == std::errc{} && value > max));
  if (!whole || value < min || value > max) {
    const std::string range = max == std::numeric_limits<std::uint64_t>::max() && !too_large
                                  ? "of at least " + std::to_string(min)
                                  : "from " + std::to_string(min) + " to " + std::to_string(max);
    throw usage_error("bad " + std::string(option) + " '" + text + "': expected a whole number " + range + " (" +
                      std::string(what) + ")");
  }
  return value;
}

// ---- progress on stderr ----------------------------------------------------------

/// A progress bar on stderr, drawn only when stderr is a terminal and the
/// work has run for half a second (short replays print nothing). Redrawn at
/// most every 1/10 s; erased by done() or the destructor.
class progress_bar {
 public:
  explicit progress_bar(std::string label) : label_(std::move(label)), enabled_(::isatty(STDERR_FILENO) == 1) {}
  ~progress_bar() { done(); }
  progress_bar(const progress_bar&) = delete;
  progress_bar& operator=(const progress_bar&) = delete;

  void update(std::size_t done_count, std::size_t total, const std::string& stage = {}) {
    if (!enabled_ || total == 0) return;
    const auto now = std::chrono::steady_clock::now();
    if (now - start_ < std::chrono::milliseconds(500) || now - last_ < std::chrono::milliseconds(100)) return;
    last_ = now;
    constexpr int width = 30;
    const double f = std::min(1.0, double(done_count) / double(total));
    const int filled = static_cast<int>(f * width);
    std::string bar = std::string(static_cast<std::size_t>(filled), '#') + std::string(width - filled, '.');
    std::fprintf(stderr, "\r%s%s [%s] %3.0f%%  %s / %s events\x1b[K", label_.c_str(),
                 stage.empty() ? "" : (" " + stage).c_str(), bar.c_str(), f * 100, with_commas(done_count).c_str(),
                 with_commas(total).c_str());
    std::fflush(stderr);
    shown_ = true;
  }
  void done() {
    if (shown_) std::fprintf(stderr, "\r\x1b[K");
    shown_ = false;
  }

 private:
  std::string label_;
  bool enabled_;
  bool shown_ = false;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point last_{};
};

// ---- the trace and PyTorch's figures for it ------------------------------------

/// The trace to replay and what is known about it.
struct loaded_trace {
  ccalloc::trace trace;
  std::optional<ccalloc::native_reference> native;  ///< PyTorch's figures for it, when known
  double read_seconds = 0.0;
};

/// Prints the progress of reading a trace on stderr once it has taken a
/// second: redrawn in place on a terminal (at most every 1/10 s), else a
/// line every 5 s.
class read_progress {
 public:
  explicit read_progress(std::string path) : path_(std::move(path)), tty_(::isatty(STDERR_FILENO) == 1) {}
  ~read_progress() {
    if (shown_ && tty_) std::fprintf(stderr, "\r\x1b[K");
  }
  read_progress(const read_progress&) = delete;
  read_progress& operator=(const read_progress&) = delete;
  void operator()(std::uint64_t done, std::uint64_t total) {
    const auto now = std::chrono::steady_clock::now();
    if (now - start_ < std::chrono::seconds(1) || now - last_ < (tty_ ? std::chrono::milliseconds(100) : std::chrono::seconds(5)))
      return;
    last_ = now;
    const double seconds = std::chrono::duration<double>(now - start_).count();
    std::fprintf(stderr, "%sccalloc: reading %s: %3.0f%%  %s of %s bytes, %.0f s%s", tty_ ? "\r" : "",
                 ccalloc::printable_name(path_).c_str(), total ? 100.0 * double(done) / double(total) : 0.0,
                 with_commas(done).c_str(), with_commas(total).c_str(), seconds, tty_ ? "\x1b[K" : "\n");
    std::fflush(stderr);
    shown_ = true;
  }

 private:
  std::string path_;
  bool tty_;
  bool shown_ = false;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point last_{};
};

/// Reads `path`, or the embedded default trace when `path` is empty.
loaded_trace load_trace(const std::string& path, ccalloc::trace_read_options read = {}) {
  const ccalloc::trace_limits& limits = read.limits;
  const auto start = std::chrono::steady_clock::now();
  set_step("reading the trace", path.empty() ? std::string_view("(the embedded one)") : std::string_view(path));
  loaded_trace out;
  if (path.empty()) {
    const std::string source = "<embedded:" + std::string(ccalloc::embedded::default_trace_name()) + ">";
    out.trace = ccalloc::parse_trace_text(
        ccalloc::maybe_gunzip(ccalloc::embedded::default_trace_gz(), source, limits), source, limits);
    out.native = ccalloc::embedded_native_reference();
  } else {
    {
      read_progress progress(path);
      read.progress = [&progress](std::uint64_t done, std::uint64_t total) { progress(done, total); };
      out.trace = ccalloc::read_trace_file(path, read);
    }
    std::string warning;
    out.native = ccalloc::native_reference_beside(path, &warning);
    if (!warning.empty()) std::cerr << "ccalloc: warning: " << ccalloc::printable_text(warning) << "\n";
    for (const std::string& note : out.trace.notes)
      std::cerr << "ccalloc: note: " << ccalloc::printable_name(path) << ": " << ccalloc::printable_text(note) << "\n";
  }
  // Only a snapshot pickle has devices to choose among (a text trace or an
  // RMM log is one device's): the option would be ignored silently.
  if (read.snapshot_device >= 0 && out.trace.has_source_lines)
    throw usage_error("--snapshot-device " + std::to_string(read.snapshot_device) +
                      " applies to PyTorch snapshot pickles only; " +
                      (path.empty() ? out.trace.source : ccalloc::printable_name(path)) +
                      " is a text trace or an RMM log, which holds one device (leave the option out)");
  out.read_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return out;
}

/// The error of a failed write_file_whole or check_file_writable: "cannot
/// write <what> to <path><step>: <errno text>", or for a FIFO with no
/// reader "...: a FIFO with no reader (start the reader first; ccalloc does
/// not wait for one)".
ccalloc::error output_error(const std::string& path, const std::string& what, int err, const std::string& step) {
  const std::string head = "cannot write " + what + " to " + path + step;
  if (err == ENXIO && step == ": a FIFO with no reader")
    return ccalloc::error(head + " (start the reader first; ccalloc does not wait for one)");
  return ccalloc::error(head + ": " + std::strerror(err));
}

/// Writes `content` to `path` whole or not at all (ccalloc::write_file_whole:
/// a regular file, or the file a symbolic link leads to, is replaced by a
/// temporary file renamed over it only once that is complete; a FIFO or
/// device is written in place, a FIFO with no reader refused). Throws
/// ccalloc::error (output_error: a directory, a missing folder, no
/// permission, a full disk).
void write_output_file(const std::string& path, const std::string& content, const std::string& what) {
  std::string step;
  if (const int err = ccalloc::write_file_whole(path, content, step); err != 0)
    throw output_error(path, what, err, step);
}

/// Whether `a` and `b` name one file: the same file where both exist, else
/// the same path once made absolute and its existing folders resolved.
bool same_output(const std::string& a, const std::string& b) {
  struct stat sa {}, sb {};
  const bool a_exists = ::stat(a.c_str(), &sa) == 0, b_exists = ::stat(b.c_str(), &sb) == 0;
  if (a_exists && b_exists) return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
  if (a_exists != b_exists) return false;
  std::error_code ec_a, ec_b;
  const auto full_a = std::filesystem::weakly_canonical(std::filesystem::absolute(a, ec_a), ec_a);
  const auto full_b = std::filesystem::weakly_canonical(std::filesystem::absolute(b, ec_b), ec_b);
  return !ec_a && !ec_b && full_a == full_b;
}

/// Checks, before a long replay, that write_output_file(path, ...) can write
/// `path` (ccalloc::check_file_writable: nothing is created, removed or
/// opened, so a FIFO's reader is not handed an end-of-file and a symbolic
/// link stays) and that `path` is no file the command reads: the trace
/// `input` or the native_peaks.json beside it (the same file under any name:
/// writing would destroy it). Throws usage_error "<what> would overwrite the
/// trace <input> ..." (or "... the native figures <file> ...") or the error
/// of write_output_file.
void check_output_file(const std::string& path, const std::string& what, const std::string& input) {
  // The files read exist: only an existing output can be one of them.
  const bool exists = ::access(path.c_str(), F_OK) == 0;
  const auto same_file = [&](const std::string& other) { return exists && !other.empty() && same_output(path, other); };
  if (same_file(input))
    throw usage_error(what + " would overwrite the trace " + input + " (" + path +
                      " is the same file); write it to another file");
  if (!input.empty()) {
    const std::string native = ccalloc::native_peaks_path_beside(input);
    if (same_file(native))
      throw usage_error(what + " would overwrite the native figures " + native + " (" + path +
                        " is the same file), which the command reads beside the trace; write it to another file");
  }
  std::string step;
  if (const int err = ccalloc::check_file_writable(path, step); err != 0) throw output_error(path, what, err, step);
}

/// Parses `config` up front so a bad one fails before any replay starts, and
/// prints the parser's warnings (settings with no effect) to stderr. Its
/// oom_snapshot file is checked as an output (check_output_file): a snapshot
/// written over the trace `input` would destroy it. Returns that file's
/// path ("" when none).
std::string check_config(const std::string& config, const std::string& input) {
  const ccalloc::allocator_config parsed = ccalloc::allocator_config::parse(config);
  for (const std::string& warning : parsed.warnings) {
    std::cerr << "ccalloc: warning: " << warning << "\n";  // the warning names the setting
  }
  if (!parsed.oom_snapshot_path.empty())
    check_output_file(parsed.oom_snapshot_path, "the out-of-memory snapshot (oom_snapshot)", input);
  return parsed.oom_snapshot_path;
}

/// One output file of a command: its path and what it holds.
struct output_use {
  std::string path;
  std::string what;
};

/// Refuses, before the run, two outputs of one command that name the same
/// file: the later write would silently replace the earlier one. Empty
/// paths (outputs not asked for) are skipped. Throws usage_error.
void check_outputs_differ(const std::vector<output_use>& outputs) {
  for (std::size_t i = 0; i < outputs.size(); ++i)
    for (std::size_t j = i + 1; j < outputs.size(); ++j)
      if (!outputs[i].path.empty() && !outputs[j].path.empty() && same_output(outputs[i].path, outputs[j].path))
        throw usage_error(outputs[i].what + " and " + outputs[j].what + " name the same file (" + outputs[i].path +
                          ", " + outputs[j].path + "): one would overwrite the other; write them to different files");
}

double ratio(std::uint64_t a, std::uint64_t b) { return b ? double(a) / double(b) : 0.0; }

/// 2 MiB pages created for expandable segments: every page mapping that was
/// not a remapping (num_device_alloc counts these and the cudaMallocs).
template <class Figures>
std::uint64_t pages_created(const Figures& f) {
  return f.pages_mapped - f.pages_remapped;
}

/// The first lines of a replay in which allocations (or resumes) failed:
/// its figures describe a program that skipped them, so they are not a
/// result.
void print_oom_banner(const ccalloc::replay_result& r) {
  std::printf("FAILED: %s: the figures below are of a\n"
              "        different program than the one recorded, not a result (a larger --device-memory, or\n"
              "        --min-memory, finds what the trace needs)\n\n",
              ccalloc::describe_ooms(r).c_str());
}

/// Says on stderr, once, that the configuration's oom_snapshot could not be
/// written and why: the replay goes on after an out-of-memory without
/// showing its message, which is where the library says it.
void print_oom_snapshot_failure(const std::vector<const ccalloc::replay_result*>& results) {
  for (const ccalloc::replay_result* r : results)
    if (!r->oom_snapshot_failure.empty()) {
      std::fprintf(stderr, "ccalloc: an out-of-memory snapshot was not written: %s\n",
                   ccalloc::printable_name(r->oom_snapshot_failure).c_str());
      return;
    }
}

/// The one --config of `command` ("" when none). Given twice, a usage error
/// that says how to give several keys: a second --config is not merged into
/// the first (compare takes each --config as a configuration of its own).
std::string single_config(const std::vector<std::string>& configs, const char* command) {
  if (configs.size() > 1)
    throw usage_error("--config was given " + std::to_string(configs.size()) + " times; " + command +
                      " takes one configuration: put every key in one --config, comma-separated (--config "
                      "'" + configs[0] + "," + configs[1] + "'), or use `ccalloc compare` to run each as a "
                      "configuration of its own");
  return configs.empty() ? std::string() : configs.front();
}

/// Exit status 3 for replays with out-of-memory errors (failed allocations
/// or resumes) unless --allow-oom.
int oom_exit_status(const std::vector<const ccalloc::replay_result*>& results, bool allow_oom) {
  ccalloc::replay_result all;
  for (const ccalloc::replay_result* r : results) {
    all.ooms += r->ooms;
    all.failed_resumes += r->failed_resumes;
    all.failed_pauses += r->failed_pauses;
  }
  if (all.ooms == 0) return 0;
  std::fprintf(stderr, "ccalloc: %s; the peaks describe a different program than the one recorded%s\n",
               ccalloc::describe_ooms(all).c_str(),
               allow_oom ? "" : " (exit status 3; --allow-oom accepts such a replay)");
  return allow_oom ? 0 : 3;
}

// ---- JSON output ----------------------------------------------------------------

json native_json(const ccalloc::native_reference& native, const ccalloc::replay_result& r) {
  json out = json::parse(native.entry_json);
  out["origin"] = native.origin;
  if (native.requested_peak) {
    if (native.reserved_peak) {
      out["native_fragmentation"] = ratio(native.reserved_peak, native.requested_peak);
    }
    if (native.expandable_reserved_peak) {
      out["native_expandable_fragmentation"] =
          ratio(native.expandable_reserved_peak, native.requested_peak);
    }
  }
  if (r.ooms > 0) return out;  // a replay that skipped allocations compares with nothing
  if (native.reserved_peak) {
    out["reserved_vs_native"] = ratio(r.peak_reserved_bytes, native.reserved_peak);
  }
  if (native.expandable_reserved_peak) {
    out["reserved_vs_native_expandable"] =
        ratio(r.peak_reserved_bytes, native.expandable_reserved_peak);
  }
  return out;
}

/// Where the device's segments were placed: "recorded" (the recording's
/// segment_alloc addresses), "own" (the simulated device's lowest free
/// address) or "driver" (a GPU's cudaMalloc).
const char* segment_addresses_label(const ccalloc::replay_result& r) {
  if (r.device == ccalloc::replay_device::cuda) return "driver";
  return r.recorded_addresses ? "recorded" : "own";
}

/// The figures a whole replay and each of its passes have alike
/// (ccalloc::replay_result, ccalloc::replay_pass).
template <class Figures>
void put_figures(json& out, const Figures& f) {
  out["peak_requested_bytes"] = f.peak_requested_bytes;
  out["peak_allocated_bytes"] = f.peak_allocated_bytes;
  out["peak_reserved_bytes"] = f.peak_reserved_bytes;
  out["fragmentation"] = f.fragmentation();
  out["device_mallocs"] = f.device_mallocs;
  out["device_frees"] = f.device_frees;
  out["segments_created"] = f.segments_created;
  out["pages_created"] = pages_created(f);
  out["cuda_mallocs"] = f.device_mallocs - pages_created(f);
  out["ooms"] = f.ooms;
  out["device_synchronizations"] = f.device_synchronizations;
  out["pages_remapped"] = f.pages_remapped;
  out["pages_mapped"] = f.pages_mapped;
  out["pages_unmapped"] = f.pages_unmapped;
  out["bytes_moved_between_streams"] = f.bytes_moved_between_streams;
  out["stream_waits"] = f.stream_waits;
}

/// Sleep and wake: the peak of paused bytes and every pause and resume
/// (only for a trace with pause or resume events, so that other traces'
/// documents do not change).
json sleep_json(const ccalloc::replay_result& r) {
  json events = json::array();
  std::uint64_t pauses = 0;
  for (const ccalloc::replay_sleep_event& e : r.sleep_events) {
    pauses += e.pause;
    json one;
    one["line"] = e.line;
    one["action"] = e.pause ? "pause" : "resume";
    one["tag"] = e.tag;
    if (e.pause) one["keep_contents"] = e.keep_contents;
    one["recorded_bytes"] = e.recorded_bytes;
    one["paused_bytes"] = e.paused_bytes;
    one[e.pause ? "released_bytes" : "cache_released_bytes"] = e.released_bytes;
    one["copied_bytes"] = e.copied_bytes;
    one["paused_total_bytes"] = e.paused_total_bytes;
    one["reserved_bytes"] = e.reserved_bytes;
    events.push_back(std::move(one));
  }
  json out;
  out["pauses"] = pauses;
  out["resumes"] = r.sleep_events.size() - pauses;
  out["peak_paused_bytes"] = r.peak_paused_bytes;
  out["events"] = std::move(events);
  return out;
}

json result_json(const ccalloc::replay_result& r, const loaded_trace& input,
                 const std::string& config, int cuda_device) {
  json out;
  out["trace"] = input.trace.source;
  out["config"] = config;
  out["device"] = ccalloc::to_string(r.device);
  if (r.device == ccalloc::replay_device::cuda) out["cuda_device"] = cuda_device;
  out["device_memory_bytes"] = r.device_memory_bytes;
  out["events"] = r.events;
  // A replay in which allocations failed is not a result (see print_oom_banner).
  out["valid"] = r.ooms == 0;
  if (r.ooms > 0)
    out["invalid_reason"] = ccalloc::describe_ooms(r);
  put_figures(out, r);
  out["failed_resumes"] = r.failed_resumes;  // of ooms (describe_ooms)
  out["failed_pauses"] = r.failed_pauses;
  out["alloc_retries"] = r.alloc_retries;
  out["thread_cache_hits"] = r.thread_cache_hits;
  out["wall_seconds"] = r.wall_seconds;
  out["read_seconds"] = input.read_seconds;
  out["repeat"] = r.repeat;
  out["device_lag_events"] = r.device_lag_events;
  out["segment_addresses"] = segment_addresses_label(r);
  json passes = json::array();
  for (const ccalloc::replay_pass& p : r.passes) {
    json pass;
    pass["events"] = p.events;
    put_figures(pass, p);
    passes.push_back(std::move(pass));
  }
  out["passes"] = std::move(passes);
  if (!r.sleep_events.empty()) out["sleep"] = sleep_json(r);
  if (input.native) out["native"] = native_json(*input.native, r);
  if (const ccalloc::recorded_figures rec = ccalloc::recorded_allocator_figures(input.trace); rec.has_segments) {
    out["recorded"] = {{"peak_reserved_bytes", rec.reserved_peak},
                       {"peak_requested_bytes", rec.requested_peak},
                       {"segments_created", rec.segment_allocs}};
  }
  // With pauses, the peak allocated to unpaused blocks: the fragmentation's
  // denominator (paused blocks count as requested but hold no device pages).
  if (std::any_of(input.trace.events.begin(), input.trace.events.end(),
                  [](const ccalloc::trace_event& e) { return e.action == ccalloc::trace_action::pause; })) {
    out["peak_unpaused_allocated_bytes"] = r.peak_unpaused_allocated_bytes;
    out["fragmentation"] = ccalloc::shown_fragmentation(r);
  }
  return out;
}

// ---- human output -----------------------------------------------------------

/// One "label  value" line of the replay report.
void print_row(std::string_view label, const std::string& value) {
  std::printf("%-16s %s\n", std::string(label).c_str(), value.c_str());
}

/// "13,594,206,920 B  (12.661 GiB)" with the byte count right-aligned to `width`.
std::string bytes_cell(std::uint64_t bytes, std::size_t width) {
  return right(with_commas(bytes), width) + " B  (" + gib(bytes) + ")";
}

std::string or_dash(std::uint64_t value, const std::string& text) { return value ? text : "-"; }

/// The side-by-side table of ccalloc's and PyTorch's figures.
void print_native_comparison(const ccalloc::replay_result& r, const ccalloc::native_reference& n) {
  std::printf("\nCompared with PyTorch's native allocator (%s):\n", n.origin.c_str());
  // The rows first, then printed with each column as wide as its widest
  // cell (at least the usual width; figures near 2^64 bytes are wider).
  std::vector<std::array<std::string, 4>> rows;
  const auto line = [&](std::string_view label, const std::string& ours, const std::string& native,
                        const std::string& expandable) {
    rows.push_back({std::string(label), ours, native, expandable});
  };
  line("", "ccalloc", "PyTorch native", "PyTorch expandable");
  line("peak requested", gib(r.peak_requested_bytes), or_dash(n.requested_peak, gib(n.requested_peak)),
       "");
  line("peak allocated", gib(r.peak_allocated_bytes), or_dash(n.allocated_peak, gib(n.allocated_peak)),
       "");
  line("peak reserved", gib(r.peak_reserved_bytes), or_dash(n.reserved_peak, gib(n.reserved_peak)),
       or_dash(n.expandable_reserved_peak, gib(n.expandable_reserved_peak)));
  if (r.ooms > 0) {
    line("  ccalloc / PyTorch", "", "invalid (OOMs)", "invalid (OOMs)");
  } else {
    line("  ccalloc / PyTorch", "",
         or_dash(n.reserved_peak, format("%.3fx", ratio(r.peak_reserved_bytes, n.reserved_peak))),
         or_dash(n.expandable_reserved_peak,
                 format("%.3fx", ratio(r.peak_reserved_bytes, n.expandable_reserved_peak))));
  }
  line("fragmentation", format("%.3f", r.fragmentation()),
       or_dash(n.requested_peak && n.reserved_peak,
               format("%.3f", ratio(n.reserved_peak, n.requested_peak))),
       or_dash(n.requested_peak && n.expandable_reserved_peak,
               format("%.3f", ratio(n.expandable_reserved_peak, n.requested_peak))));
  // PyTorch's count is of cudaMalloc calls: it compares with segments made
  // (cudaMallocs and reservations), not with pages created.
  line("segments made", with_commas(r.segments_created), or_dash(n.device_allocs, with_commas(n.device_allocs)),
       "");
  line("2 MiB pages created", with_commas(pages_created(r)), "-", "");
  // Label left-aligned; figures right-aligned, at least 2 blanks apart.
  std::array<std::size_t, 4> width{20, 17, 17, 20};
  for (const auto& row : rows)
    for (std::size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size() + (c == 0 ? 0 : 2));
  for (const auto& row : rows)
    std::printf("  %s%s%s%s\n", left(row[0], width[0]).c_str(), right(row[1], width[1]).c_str(),
                right(row[2], width[2]).c_str(), right(row[3], width[3]).c_str());
  std::printf("  (segments made: cudaMalloc calls, or address-space reservations of expandable segments; PyTorch\n"
              "   native's figure is its cudaMalloc calls. Pages created: physical 2 MiB pages mapped into\n"
              "   reservations, which PyTorch native does not make)\n");
  if (n.requested_peak && n.requested_peak != r.peak_requested_bytes) {
    std::printf("  note: the peak requested differs from the recording's (%s vs %s bytes)\n",
                with_commas(r.peak_requested_bytes).c_str(), with_commas(n.requested_peak).c_str());
  }
}

/// The per-pass table of a repeated replay (--repeat N > 1), each line
/// prefixed by `indent`.
/// A table of right-aligned columns, two blanks apart, each line after `indent`.
void print_table(const std::vector<std::string>& head, const std::vector<std::vector<std::string>>& rows,
                 const char* indent) {
  std::vector<std::size_t> width(head.size());
  for (std::size_t c = 0; c < head.size(); ++c) {
    width[c] = head[c].size();
    for (const auto& row : rows) width[c] = std::max(width[c], row[c].size());
  }
  const auto print_cells = [&](const std::vector<std::string>& cells) {
    std::string text = indent;
    for (std::size_t c = 0; c < cells.size(); ++c) text += (c ? "  " : "") + right(cells[c], width[c]);
    std::printf("%s\n", text.c_str());
  };
  print_cells(head);
  for (const auto& row : rows) print_cells(row);
}

void print_passes(const ccalloc::replay_result& r, const char* indent) {
  if (r.repeat <= 1) return;
  const std::vector<std::string> head = {"pass",           "peak requested", "peak reserved",
                                         "fragmentation",  "device syncs",   "pages mapped",
                                         "pages remapped", "moved streams",  "device mallocs"};
  std::vector<std::vector<std::string>> rows;
  for (std::size_t i = 0; i < r.passes.size(); ++i) {
    const ccalloc::replay_pass& p = r.passes[i];
    rows.push_back({std::to_string(i + 1), gib(p.peak_requested_bytes), gib(p.peak_reserved_bytes),
                    format("%.3f", p.fragmentation()), with_commas(p.device_synchronizations),
                    with_commas(p.pages_mapped), with_commas(p.pages_remapped),
                    gib(p.bytes_moved_between_streams), with_commas(p.device_mallocs)});
  }
  print_table(head, rows, indent);
}

/// Sleep and wake: the peak of paused bytes and one row per pause and
/// resume (nothing for a trace without them).
void print_sleep_events(const ccalloc::replay_result& r, const char* indent) {
  if (r.sleep_events.empty()) return;
  std::printf("\nSleep and wake (peak paused %s):\n", gib(r.peak_paused_bytes).c_str());
  const std::vector<std::string> head = {"line",   "action", "tag",    "paused",        "freed / cache given",
                                         "copied", "paused now", "reserved after"};
  std::vector<std::vector<std::string>> rows;
  for (const ccalloc::replay_sleep_event& e : r.sleep_events)
    rows.push_back({e.line ? with_commas(e.line) : std::string("pass end"), e.pause ? (e.keep_contents ? "pause+keep" : "pause") : "resume", e.tag,
                    gib(e.paused_bytes), gib(e.released_bytes), gib(e.copied_bytes), gib(e.paused_total_bytes),
                    gib(e.reserved_bytes)});
  print_table(head, rows, indent);
}

/// "sim (simulated device)" or "cuda:0 (GPU, CUDA backend)".
std::string device_label(const ccalloc::replay_result& r, int cuda_device) {
  if (r.device == ccalloc::replay_device::cuda) return format("cuda:%d (GPU, CUDA backend)", cuda_device);
  return "sim (simulated device)";
}

void print_replay_report(const ccalloc::replay_result& r, const loaded_trace& input,
                         const std::string& config, int cuda_device) {
  const std::uint64_t peak_unpaused = r.peak_unpaused_allocated_bytes;
  const std::uint64_t device_memory_bytes = r.device_memory_bytes;
  if (r.ooms > 0) print_oom_banner(r);
  // Byte counts right-aligned on the widest, so their digits line up.
  std::size_t w = 0;
  for (const std::uint64_t b : {std::uint64_t{device_memory_bytes}, r.peak_requested_bytes,
                                r.peak_allocated_bytes, r.peak_reserved_bytes}) {
    w = std::max(w, with_commas(b).size());
  }
  print_row("trace", ccalloc::printable_name(input.trace.source));
  print_row("config", config_label(config));
  print_row("device", device_label(r, cuda_device));
  if (r.device == ccalloc::replay_device::sim)
    print_row("segment places", r.recorded_addresses
                                    ? "recorded  (the recording's segment_alloc addresses: order and gaps)"
                                    : "own  (the simulated device's lowest free address first)");
  print_row("device memory", bytes_cell(device_memory_bytes, w));
  print_row("events", with_commas(r.events));
  if (r.repeat > 1)
    print_row("passes", format("%llu  (the trace run back to back as one program; allocations it never frees made "
                               "once)",
                               static_cast<unsigned long long>(r.repeat)));
  if (r.device_lag_events != 0)
    print_row("device lag", format("%llu events  (the simulated device runs behind the host)",
                                   static_cast<unsigned long long>(r.device_lag_events)));
  const char* paused_note = peak_unpaused ? "  (blocks of paused tags included)" : "";
  print_row("peak requested", bytes_cell(r.peak_requested_bytes, w) + paused_note);
  print_row("peak allocated", bytes_cell(r.peak_allocated_bytes, w) + paused_note);
  print_row("peak reserved", bytes_cell(r.peak_reserved_bytes, w));
  if (peak_unpaused) {
    print_row("peak unpaused", bytes_cell(peak_unpaused, w) +
                                   "  (allocated to blocks of tags not paused: a paused block keeps its address "
                                   "but no device pages)");
    print_row("fragmentation", format("%.3f  (peak reserved / peak unpaused)", ccalloc::shown_fragmentation(r)));
  } else {
    print_row("fragmentation", format("%.3f  (peak reserved / peak requested)", r.fragmentation()));
  }
  // Device calls in comparable terms: cudaMalloc / cudaFree calls (whole
  // segments) and 2 MiB pages created / released (expandable segments).
  const std::uint64_t cuda_mallocs = r.device_mallocs - pages_created(r);
  const std::uint64_t pages_released = r.pages_unmapped - std::min(r.pages_unmapped, r.pages_remapped);
  const std::uint64_t cuda_frees = r.device_frees - std::min(r.device_frees, pages_released);
  print_row("segments made", with_commas(r.segments_created) + "  (over the run: " + with_commas(cuda_mallocs) +
                                " cudaMalloc, " + with_commas(r.segments_created - cuda_mallocs) +
                                " address-space reservations)");
  print_row("pages created", with_commas(pages_created(r)) + "  (2 MiB physical pages mapped into reservations)");
  print_row("device mallocs", with_commas(r.device_mallocs) + "  (" + with_commas(cuda_mallocs) + " cudaMalloc + " +
                                 with_commas(pages_created(r)) + " pages created)");
  print_row("device frees", with_commas(r.device_frees) + "  (" + with_commas(cuda_frees) + " cudaFree + " +
                               with_commas(pages_released) + " pages released)");
  print_row("OOMs", with_commas(r.ooms) + (r.ooms ? "  (" + ccalloc::describe_ooms(r) + ")" : ""));
  print_row("alloc retries", with_commas(r.alloc_retries));
  print_row("device syncs", with_commas(r.device_synchronizations) +
                                (r.device_synchronizations ? "  (host waits for the device before memory changed hands)"
                                                           : ""));
  print_row("pages mapped", with_commas(r.pages_mapped) + "  (" + with_commas(pages_created(r)) + " created + " +
                               with_commas(r.pages_remapped) + " remapped)");
  print_row("pages unmapped", with_commas(r.pages_unmapped) + "  (" + with_commas(pages_released) + " released + " +
                                 with_commas(r.pages_remapped) +
                                 " remapped: unmapped at one place and mapped at another, never freed)");
  print_row("moved streams", with_commas(r.bytes_moved_between_streams) + " B  (bytes that changed stream)");
  print_row("stream waits", with_commas(r.stream_waits) +
                                (r.stream_waits ? "  (device-side waits for another stream's work; the host did not wait)"
                                                : ""));
  print_row("wall time", format("%.3f s  (replay; reading the trace: %.3f s)", r.wall_seconds,
                                input.read_seconds));
  if (r.repeat > 1) {
    std::printf("\nPer pass (peaks within the pass, counters during it):\n");
    print_passes(r, "  ");
  }
  print_sleep_events(r, "  ");
  const ccalloc::recorded_figures rec = ccalloc::recorded_allocator_figures(input.trace);
  if (rec.has_segments) {
    // The same figures as report's "recording allocator" row.
    std::printf("\nRecording allocator (from the trace's segment events):\n");
    print_row("  peak reserved", bytes_cell(rec.reserved_peak, w) +
                                     format("  (%.3f of its peak requested)", ratio(rec.reserved_peak, rec.requested_peak)));
    print_row("  segments made", with_commas(rec.segment_allocs) +
                                     (rec.segment_allocs == 0 && rec.reserved_peak > 0
                                          ? "  (its cudaMalloc calls: none, it mapped pages of expandable segments)"
                                          : "  (its cudaMalloc calls)"));
  }
  if (input.native) {
    print_native_comparison(r, *input.native);
    if (r.repeat > 1) std::printf("  (PyTorch's figures are of the one recorded pass)\n");
  }
}

void print_compare_table(const std::vector<ccalloc::replay_result>& results,
                         const std::vector<std::string>& configs, const loaded_trace& input,
                         const std::string& device) {
  struct row {
    std::vector<std::string> cells;
  };
  // "segments": cudaMallocs and address reservations (PyTorch native's
  // figure: its cudaMalloc calls); "pages": 2 MiB pages created.
  const std::vector<std::string> head = {"config",   "peak reserved", "fragmentation", "segments", "pages",
                                         "OOMs",     "retries",       "syncs",         "seconds"};
  std::vector<row> rows;
  for (std::size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    rows.push_back({{config_label(configs[i]), gib(r.peak_reserved_bytes),
                     r.ooms ? "invalid" : format("%.3f", ccalloc::shown_fragmentation(r)), with_commas(r.segments_created),
                     with_commas(pages_created(r)), with_commas(r.ooms), with_commas(r.alloc_retries),
                     with_commas(r.device_synchronizations), format("%.3f", r.wall_seconds)}});
  }
  if (input.native) {
    const ccalloc::native_reference& n = *input.native;
    if (n.reserved_peak) {
      rows.push_back({{"PyTorch native", gib(n.reserved_peak),
                       or_dash(n.requested_peak, format("%.3f", ratio(n.reserved_peak, n.requested_peak))),
                       or_dash(n.device_allocs, with_commas(n.device_allocs)), "-", "-", "-", "-", "-"}});
    }
    if (n.expandable_reserved_peak) {
      rows.push_back({{"PyTorch expandable", gib(n.expandable_reserved_peak),
                       or_dash(n.requested_peak,
                               format("%.3f", ratio(n.expandable_reserved_peak, n.requested_peak))),
                       "-", "-", "-", "-", "-", "-"}});
    }
  }
  const auto widths = [&] {
    std::vector<std::size_t> width(head.size());
    for (std::size_t c = 0; c < head.size(); ++c) {
      width[c] = head[c].size();
      for (const row& r : rows) width[c] = std::max(width[c], r.cells[c].size());
    }
    return width;
  };
  std::vector<std::size_t> width = widths();
  // The table fits 100 columns: long configuration strings are listed
  // above it and named #1, #2, ... in it.
  constexpr std::size_t max_columns = 100;
  std::size_t table_width = 0;
  for (const std::size_t w : width) table_width += w + 2;
  std::string legend;
  if (table_width - 2 > max_columns) {
    for (std::size_t i = 0; i < results.size(); ++i) {
      legend += format("#%zu  ", i + 1) + config_label(configs[i]) + "\n";
      rows[i].cells[0] = format("#%zu", i + 1);
    }
    width = widths();
  }
  const auto print_cells = [&](const std::vector<std::string>& cells) {
    std::string text = left(cells[0], width[0]);  // config names read left-aligned
    for (std::size_t c = 1; c < cells.size(); ++c) text += "  " + right(cells[c], width[c]);
    std::printf("%s\n", text.c_str());
  };
  std::printf("trace: %s (%s events)\ndevice: %s\n", ccalloc::printable_name(input.trace.source).c_str(),
              with_commas(input.trace.events.size()).c_str(), device.c_str());
  if (!results.empty() && results.front().device_lag_events != 0)
    std::printf("device lag: %llu events (the simulated device runs behind the host)\n",
                static_cast<unsigned long long>(results.front().device_lag_events));
  std::printf("\n%s", legend.empty() ? "" : ("configurations:\n" + legend + "\n").c_str());
  print_cells(head);
  std::size_t total = 0;
  for (const std::size_t w : width) total += w + 2;
  std::printf("%s\n", std::string(total - 2, '-').c_str());
  for (const row& r : rows) print_cells(r.cells);
  std::printf("\nsegments: cudaMalloc calls and address-space reservations (PyTorch native: its cudaMalloc\n"
              "calls); pages: 2 MiB physical pages created for expandable segments; syncs: host waits.\n");
  if (std::any_of(results.begin(), results.end(),
                  [](const ccalloc::replay_result& r) { return r.peak_unpaused_allocated_bytes != 0; }))
    std::printf("fragmentation: peak reserved / peak allocated to blocks of tags not paused (the trace pauses\n"
                "tags: a paused block counts as requested but holds no device pages).\n");
  for (std::size_t i = 0; i < results.size(); ++i)
    if (results[i].ooms)
      std::printf("FAILED: %s: %s: its figures are not a result\n", rows[i].cells[0].c_str(),
                  ccalloc::describe_ooms(results[i]).c_str());
  if (input.native) std::printf("PyTorch figures: %s\n", input.native->origin.c_str());
  if (!results.empty() && results.front().repeat > 1) {
    std::printf("\n%llu passes back to back as one program (allocations the trace never frees made once); per "
                "pass:\n",
                static_cast<unsigned long long>(results.front().repeat));
    for (std::size_t i = 0; i < results.size(); ++i) {
      std::printf("%s\n", config_label(configs[i]).c_str());
      print_passes(results[i], "  ");
    }
  }
}

// ---- subcommands -------------------------------------------------------------

/// Parses --device: "sim", "cuda" or "cuda:N" (N a device ordinal).
void parse_device(const std::string& text, ccalloc::replay_options& options) {
  if (text == "sim") {
    options.device = ccalloc::replay_device::sim;
    return;
  }
  const std::string_view prefix = "cuda";
  if (text.compare(0, prefix.size(), prefix) == 0) {
    const std::string rest = text.substr(prefix.size());
    int ordinal = 0;
    bool ok = rest.empty();
    if (!ok && rest[0] == ':' && rest.size() > 1) {
      const auto [end, ec] = std::from_chars(rest.data() + 1, rest.data() + rest.size(), ordinal);
      ok = ec == std::errc{} && end == rest.data() + rest.size() && ordinal >= 0;
    }
    if (ok) {
      options.device = ccalloc::replay_device::cuda;
      options.cuda_device = ordinal;
      return;
    }
  }
  throw usage_error("bad --device '" + text + "': expected sim, cuda or cuda:N (N = CUDA device ordinal)");
}

struct common_options {
  std::string trace_path;  ///< empty: the embedded trace
  std::string device_text = "sim";
  std::optional<std::string> device_memory_text;  ///< unset: the default; "" is a usage error
  bool json_output = false;
  bool allow_oom = false;  ///< --allow-oom: a replay with failed allocations exits 0
  std::string repeat_text = "1";  // checked by parse_count, not CLI11 (which clamps 2^64 to 2^63 - 1)
  std::string lag_text = "0";     // --device-lag, checked by parse_count
  bool own_addresses = false;     // --own-addresses
  // The readers' limits (ccalloc::trace_limits); unset: the defaults.
  std::optional<std::string> max_input_text, max_events_text, max_line_text;

  [[nodiscard]] ccalloc::trace_limits limits() const {
    ccalloc::trace_limits l;
    if (max_input_text) l.max_input_bytes = parse_byte_count(*max_input_text, "--max-input-bytes");
    if (max_events_text)
      l.max_events = parse_count(*max_events_text, "--max-events", 1, std::numeric_limits<std::uint64_t>::max(),
                                 "events a trace may hold");
    if (max_line_text) l.max_line_bytes = parse_byte_count(*max_line_text, "--max-line-bytes");
    return l;
  }

  std::string max_pickle_objects_text;  // --max-pickle-objects; empty: the library's default
  std::string max_pickle_bytes_text;    // --max-pickle-bytes; empty: the library's default
  std::optional<std::string> max_pickle_memory_text;  // --max-pickle-memory
  std::optional<std::string> snapshot_device_text;    // --snapshot-device; none: the device with the most entries

  /// The readers' limits: the text readers' (limits()) and a PyTorch snapshot pickle's.
  [[nodiscard]] ccalloc::trace_read_options read_options() const {
    ccalloc::trace_read_options read;
    read.limits = limits();
    if (!max_pickle_objects_text.empty())
      read.max_pickle_objects = parse_count(max_pickle_objects_text, "--max-pickle-objects", 1,
                                            std::numeric_limits<std::uint64_t>::max(), "objects of a snapshot pickle");
    if (!max_pickle_bytes_text.empty())
      read.max_pickle_bytes = parse_count(max_pickle_bytes_text, "--max-pickle-bytes", 1,
                                          std::numeric_limits<std::uint64_t>::max(),
                                          "decompressed bytes of a snapshot pickle");
    if (max_pickle_memory_text)
      read.max_pickle_memory_bytes = parse_byte_count(*max_pickle_memory_text, "--max-pickle-memory");
    if (snapshot_device_text)
      read.snapshot_device = static_cast<std::int64_t>(
          parse_count(*snapshot_device_text, "--snapshot-device", 0, 65535, "a device index of the snapshot"));
    return read;
  }

  [[nodiscard]] ccalloc::replay_options replay_options_for(const std::string& config) const {
    ccalloc::replay_options options;
    options.config = config_string(config);
    parse_device(device_text, options);
    // At most max_repeat passes: the run and its per-pass table grow with N.
    constexpr std::uint64_t max_repeat = 100000;
    options.repeat = static_cast<std::size_t>(parse_count(repeat_text, "--repeat", 1, max_repeat, "passes of the trace"));
    options.device_lag_events =
        parse_count(lag_text, "--device-lag", 0, std::uint64_t{1} << 40, "trace events the device runs behind");
    options.recorded_addresses = !own_addresses;
    if (options.device_lag_events != 0 && options.device != ccalloc::replay_device::sim)
      throw usage_error("--device-lag models the simulated device running behind the host: with --device " +
                        device_text + " the GPU runs behind by itself");
    if (device_memory_text && options.device != ccalloc::replay_device::sim) {
      throw usage_error("--device-memory applies to the simulated device only: with --device " + device_text +
                        " the replay uses the GPU's own memory");
    }
    if (device_memory_text) {
      options.device_memory_bytes =
          static_cast<std::size_t>(parse_byte_count(*device_memory_text, "--device-memory"));
    }
    return options;
  }
};

/// SPEC P7: the smallest device memory on which the trace replays without
/// an OOM, next to PyTorch's figures when they are known.
struct min_memory_result {
  std::uint64_t ccalloc_bytes = 0;
  std::uint64_t native_bytes = 0;             ///< 0: unknown
  std::uint64_t native_expandable_bytes = 0;  ///< 0: unknown
};

/// ccalloc::find_min_device_memory with its errors worded for the command
/// line: they name the flag that asked for the search (--min-memory), not
/// the library function (whose messages start with its name).
std::size_t min_device_memory(const ccalloc::trace& t, const ccalloc::replay_options& options) {
  try {
    return ccalloc::find_min_device_memory(t, options);
  } catch (const ccalloc::error& e) {
    constexpr std::string_view library_prefix = "find_min_device_memory: ";
    std::string_view what = e.what();
    if (!what.starts_with(library_prefix)) throw;
    what.remove_prefix(library_prefix.size());
    throw ccalloc::error("--min-memory: " + std::string(what));
  }
}

min_memory_result find_min_memory(const loaded_trace& input, const ccalloc::replay_options& options) {
  min_memory_result m;
  m.ccalloc_bytes = min_device_memory(input.trace, options);
  if (input.native) {
    m.native_bytes = input.native->min_capacity_bytes;
    m.native_expandable_bytes = input.native->expandable_min_capacity_bytes;
  }
  return m;
}

void print_min_memory(const min_memory_result& m, const std::string& config) {
  std::printf("\nSmallest device memory without out of memory (bisection to 2 MiB):\n");
  if (m.ccalloc_bytes == 0) {  // find_min_device_memory's answer when nothing is ever reserved
    std::printf("  ccalloc              none: the replay reserves no device memory (peak reserved 0 B)\n");
    return;
  }
  std::printf("  ccalloc              %s  (%llu B)\n", gib(m.ccalloc_bytes).c_str(),
              static_cast<unsigned long long>(m.ccalloc_bytes));
  const ccalloc::allocator_config parsed = ccalloc::allocator_config::parse(config);
  if (parsed.memory_fraction_set) {
    // The shortest text that reads back as the fraction (%g would show
    // 0.999999999 as 1).
    char fraction[32] = {};
    (void)std::to_chars(fraction, fraction + sizeof fraction - 1, parsed.per_process_memory_fraction);
    std::printf("  (the device's memory: per_process_memory_fraction:%s lets ccalloc use that much of it; "
                "PyTorch's figures are without a fraction)\n",
                fraction);
  }
  if (m.native_bytes)
    std::printf("  PyTorch native       %s  (ccalloc / PyTorch %.3fx)\n", gib(m.native_bytes).c_str(),
                double(m.ccalloc_bytes) / double(m.native_bytes));
  if (m.native_expandable_bytes)
    std::printf("  PyTorch expandable   %s  (ccalloc / PyTorch %.3fx)\n", gib(m.native_expandable_bytes).c_str(),
                double(m.ccalloc_bytes) / double(m.native_expandable_bytes));
}

/// --min-memory with an oom_snapshot: the search's trial replays write no
/// snapshot (each that runs out would replace the last, unsaid); the
/// snapshot is written by one more replay, on the largest device below the
/// smallest that fits (min_bytes less the search's 2 MiB step), and a line
/// on stderr says which device and file, or why nothing was written.
/// Returns that replay's result (for a failed write's message), if it ran.
std::optional<ccalloc::replay_result> min_memory_oom_snapshot(const loaded_trace& input,
                                                              const ccalloc::replay_options& options,
                                                              std::uint64_t min_bytes, const std::string& path) {
  constexpr std::uint64_t step = 2 * ccalloc::mib;  // find_min_device_memory's default precision
  const char* const head = "ccalloc: --min-memory: no out-of-memory snapshot (oom_snapshot) was written to";
  if (min_bytes == 0) {
    std::fprintf(stderr, "%s %s: the replay reserves no device memory on any device\n", head, path.c_str());
    return std::nullopt;
  }
  if (min_bytes <= step) {
    std::fprintf(stderr, "%s %s: the smallest device that fits (%llu B) is the search's step; no smaller one "
                 "is replayed\n", head, path.c_str(), static_cast<unsigned long long>(min_bytes));
    return std::nullopt;
  }
  ccalloc::replay_options trial = options;
  trial.after_event = nullptr;
  trial.history.reset();
  trial.device_memory_bytes = static_cast<std::size_t>(min_bytes - step);
  set_step("replaying on the largest device that runs out, for the oom_snapshot (--min-memory)");
  ccalloc::replay_result result = ccalloc::replay_trace(input.trace, trial);
  if (result.ooms == 0) {
    std::fprintf(stderr, "%s %s: the replay on %llu B, 2 MiB below the smallest device that fits, did not run "
                 "out of memory\n", head, path.c_str(), static_cast<unsigned long long>(trial.device_memory_bytes));
  } else if (result.oom_snapshot_failure.empty()) {
    std::fprintf(stderr, "ccalloc: --min-memory: the out-of-memory snapshot (oom_snapshot) in %s is of a replay "
                 "on %llu B (%s), 2 MiB below the smallest device that fits, where %llu allocation(s) failed\n",
                 path.c_str(), static_cast<unsigned long long>(trial.device_memory_bytes),
                 gib(trial.device_memory_bytes).c_str(), static_cast<unsigned long long>(result.ooms));
  }
  return result;
}

/// `config` without its oom_snapshot key (the canonical string of the rest).
std::string without_oom_snapshot(const std::string& config) {
  ccalloc::allocator_config parsed = ccalloc::allocator_config::parse(config);
  parsed.oom_snapshot_path.clear();
  return parsed.to_string();
}

int run_replay(const common_options& common, const std::string& config, bool min_memory,
               const std::string& snapshot_path) {
  ccalloc::replay_options options = common.replay_options_for(config);
  const std::string oom_snapshot = check_config(options.config, common.trace_path);
  if (min_memory && options.device != ccalloc::replay_device::sim)
    throw usage_error("--min-memory works on the simulated device only (--device sim)");
  if (!snapshot_path.empty()) check_output_file(snapshot_path, "the snapshot", common.trace_path);
  check_outputs_differ({{oom_snapshot, "the out-of-memory snapshot (oom_snapshot)"}, {snapshot_path, "the snapshot"}});
  const loaded_trace input = load_trace(common.trace_path, common.read_options());
  set_step("replaying the trace");
  progress_bar progress("replaying");
  const std::size_t total = input.trace.events.size() * options.repeat;
  std::string snapshot_json;
  if (!snapshot_path.empty()) options.history.emplace();  // everything, no context
  options.after_event = [&](std::size_t i, ccalloc::caching_allocator& allocator) {
    if ((i & 4095) == 0) progress.update(i, total);
    if (!snapshot_path.empty() && i + 1 == total) snapshot_json = ccalloc::to_json(allocator.snapshot());
    return true;
  };
  const ccalloc::replay_result result = ccalloc::replay_trace(input.trace, options);
  progress.done();
  if (!snapshot_path.empty()) {
    set_step("writing the snapshot to", snapshot_path);
    write_output_file(snapshot_path, snapshot_json, "the snapshot");
    std::fprintf(stderr, "ccalloc: wrote the snapshot after the last event to %s (%s bytes of JSON; "
                 "python3 -m ccalloc.snapshot %s -o SNAPSHOT.pickle, or python/ccalloc/snapshot.py in a clone, "
                 "makes PyTorch's pickle)\n",
                 snapshot_path.c_str(), with_commas(snapshot_json.size()).c_str(), snapshot_path.c_str());
  }
  std::optional<min_memory_result> min;
  std::optional<ccalloc::replay_result> snapshot_trial;
  if (min_memory) {
    set_step("finding the smallest device memory (--min-memory)");
    ccalloc::replay_options search = options;
    if (!oom_snapshot.empty()) search.config = without_oom_snapshot(options.config);
    min = find_min_memory(input, search);
    if (!oom_snapshot.empty()) snapshot_trial = min_memory_oom_snapshot(input, options, min->ccalloc_bytes, oom_snapshot);
  }
  set_step("printing the results");
  if (common.json_output) {
    json out = result_json(result, input, options.config, options.cuda_device);
    if (min) {
      out["min_device_memory_bytes"] = min->ccalloc_bytes;
      if (min->native_bytes) out["native_min_capacity_bytes"] = min->native_bytes;
      if (min->native_expandable_bytes) out["native_expandable_min_capacity_bytes"] = min->native_expandable_bytes;
      if (snapshot_trial && snapshot_trial->ooms != 0 && snapshot_trial->oom_snapshot_failure.empty())
        out["oom_snapshot_device_memory_bytes"] = snapshot_trial->device_memory_bytes;
    }
    std::printf("%s\n", json_text(out).c_str());
  } else {
    print_replay_report(result, input, options.config, options.cuda_device);
    if (min) print_min_memory(*min, options.config);
  }
  print_oom_snapshot_failure({&result});
  if (snapshot_trial) print_oom_snapshot_failure({&*snapshot_trial});
  return oom_exit_status({&result}, common.allow_oom);
}

/// `ccalloc report`: the HTML page (include/ccalloc/replay/report.hpp).
int run_report(const common_options& common, const std::string& config, const std::string& output_path,
               const std::string& points_text, const std::string& title) {
  const ccalloc::replay_options replay = common.replay_options_for(config);
  if (replay.device != ccalloc::replay_device::sim)
    throw usage_error("report replays on the simulated device only (--device sim)");
  const std::string oom_snapshot = check_config(replay.config, common.trace_path);
  const auto points = static_cast<std::size_t>(
      parse_count(points_text, "--points", 2, std::numeric_limits<std::size_t>::max(), "time slices per curve"));
  check_output_file(output_path, "the report", common.trace_path);
  check_outputs_differ({{oom_snapshot, "the out-of-memory snapshot (oom_snapshot)"}, {output_path, "the report"}});
  const auto start = std::chrono::steady_clock::now();
  const loaded_trace input = load_trace(common.trace_path, common.read_options());
  ccalloc::report_options options;
  options.config = replay.config;
  options.device_memory_bytes = replay.device_memory_bytes;
  options.plot_points = points;
  options.title = title;
  set_step("replaying the trace for the report");
  progress_bar progress("report");
  options.progress = [&](int pass, std::size_t done_count, std::size_t total) {
    progress.update(done_count, total, "replay " + std::to_string(pass) + "/2");
  };
  ccalloc::report_summary summary;
  const std::string page =
      ccalloc::render_report_html(input.trace, options, input.native ? &*input.native : nullptr, &summary);
  progress.done();
  set_step("writing the report to", output_path);
  write_output_file(output_path, page, "the report");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("wrote %s (%s bytes) in %.2f s: %s events, peak reserved %s (ccalloc) vs %s (recording allocator), "
              "segment map after event %s (%zu mapped ranges of %zu live segments, %zu blocks)\n",
              output_path.c_str(), with_commas(page.size()).c_str(), seconds,
              with_commas(summary.replay.events).c_str(), gib(summary.replay.peak_reserved_bytes).c_str(),
              summary.recorded_reserved_peak ? gib(summary.recorded_reserved_peak).c_str() : "-",
              with_commas(summary.peak_event_index + 1).c_str(), summary.segments_at_peak,
              summary.live_segments_at_peak, summary.blocks_at_peak);
  print_sleep_events(summary.replay, "  ");
  print_oom_snapshot_failure({&summary.replay});
  return oom_exit_status({&summary.replay}, common.allow_oom);
}

int run_compare(const common_options& common, const std::vector<std::string>& configs) {
  std::vector<ccalloc::replay_options> options;
  std::vector<output_use> oom_snapshots;
  for (const std::string& config : configs) {
    options.push_back(common.replay_options_for(config));
    // Every config checked before the first replay.
    oom_snapshots.push_back({check_config(options.back().config, common.trace_path),
                             "the out-of-memory snapshot (oom_snapshot) of configuration " +
                                 std::to_string(options.size())});
  }
  check_outputs_differ(oom_snapshots);
  const loaded_trace input = load_trace(common.trace_path, common.read_options());
  std::vector<ccalloc::replay_result> results;
  set_step("replaying the trace");
  for (const auto& o : options) results.push_back(ccalloc::replay_trace(input.trace, o));
  set_step("printing the results");
  if (common.json_output) {
    json out = json::array();
    for (std::size_t i = 0; i < results.size(); ++i) {
      out.push_back(
          result_json(results[i], input, options[i].config, options[i].cuda_device));
    }
    std::printf("%s\n", json_text(out).c_str());
  } else {
    const ccalloc::replay_result& first = results.front();
    print_compare_table(results, configs, input,
                        device_label(first, options.front().cuda_device) + ", " +
                            with_commas(first.device_memory_bytes) + " B (" + gib(first.device_memory_bytes) +
                            "), segment addresses " + segment_addresses_label(first));
  }
  std::vector<const ccalloc::replay_result*> replayed;
  for (const ccalloc::replay_result& r : results) replayed.push_back(&r);
  print_oom_snapshot_failure(replayed);
  return oom_exit_status(replayed, common.allow_oom);
}

/// Splits `text` into lines of at most `width` characters at spaces (a word
/// longer than `width` gets a line of its own).
std::vector<std::string> wrap(std::string_view text, std::size_t width) {
  std::vector<std::string> lines;
  std::string current;
  std::size_t pos = 0;
  while (pos < text.size()) {
    const std::size_t space = std::min(text.find(' ', pos), text.size());
    const std::string_view word = text.substr(pos, space - pos);
    pos = space + 1;
    if (word.empty()) continue;
    if (!current.empty() && current.size() + 1 + word.size() > width) {
      lines.push_back(std::move(current));
      current.clear();
    }
    if (!current.empty()) current += ' ';
    current += word;
  }
  if (!current.empty()) lines.push_back(std::move(current));
  return lines;
}

/// The settings table (ccalloc::config_keys()): each key, then its meaning
/// and accepted values wrapped beside it.
int run_config_keys() {
  const auto& keys = ccalloc::config_keys();
  std::size_t key_w = 3;
  for (const auto& k : keys) key_w = std::max(key_w, k.key.size());
  constexpr std::size_t text_w = 72;
  const std::string indent(key_w + 2, ' ');
  std::printf("Configuration keys (CCALLOC_CONF or --config; PYTORCH_CUDA_ALLOC_CONF syntax:\n"
              "comma-separated key:value pairs, e.g. "
              "\"max_split_size_mb:128,garbage_collection_threshold:0.6\")\n\n");
  for (const auto& k : keys) {
    std::vector<std::string> lines = wrap(k.meaning, text_w);
    for (std::string& l : wrap("accepted: " + std::string(k.accepted), text_w)) {
      lines.push_back(std::move(l));
    }
    for (std::size_t i = 0; i < lines.size(); ++i) {
      std::printf("%s%s\n", i == 0 ? left(std::string(k.key) + "  ", key_w + 2).c_str() : indent.c_str(),
                  lines[i].c_str());
    }
  }
  return 0;
}

int run(int argc, char** argv) {
  CLI::App app{"ccalloc: replay PyTorch allocation traces through ccalloc's caching allocator "
               "on a simulated device or a GPU and compare configurations.",
               "ccalloc"};
  app.set_version_flag("--version", std::string("ccalloc ") + CCALLOC_VERSION);
  app.footer(
      "The CLI reads its configuration from --config only: CCALLOC_CONF and CCALLOC_NO_CACHING are for "
      "programs that use the library.");
  app.require_subcommand(1);

  common_options common;
  std::vector<std::string> replay_configs, report_configs;  // one each: single_config
  std::vector<std::string> compare_configs;

  const auto add_common = [&](CLI::App* sub, bool with_json) {
    sub->add_option("trace", common.trace_path,
                    "Trace file, plain or gzip: ccalloc's format (docs/trace-format.md), an RMM "
                    "logging_resource_adaptor CSV, or a PyTorch snapshot pickle (torch.cuda.memory._dump_snapshot), "
                    "told apart by content. Default: the GPT-2 training trace built into the binary.");
    sub->add_option("--device", common.device_text,
                    "Where to replay: sim (the simulated device, default) or cuda / cuda:N "
                    "(a real GPU through the CUDA backend; needs a build with CUDA).");
    sub->add_option("--device-memory", common.device_memory_text,
                    "Simulated device capacity: bytes, optionally with a unit "
                    "(80GB, 80GiB, 512MiB, 1.5e9). Default: 141GB (an H200). Not with --device cuda.");
    sub->add_option("--max-pickle-objects", common.max_pickle_objects_text,
                    "A PyTorch snapshot pickle may make at most N objects (dicts, lists, strings, numbers). "
                    "Default: 500000000.");
    sub->add_option("--max-pickle-bytes", common.max_pickle_bytes_text,
                    "A PyTorch snapshot pickle may be at most N bytes, decompressed. Default: 4294967296 (4 GiB).");
    sub->add_option("--max-pickle-memory", common.max_pickle_memory_text,
                    "Reading a PyTorch snapshot pickle may build at most SIZE of values (bytes, units as "
                    "--device-memory; a real snapshot takes about 2x its pickle bytes). Default: 8GiB.");
    sub->add_option("--snapshot-device", common.snapshot_device_text,
                    "Which device of a PyTorch snapshot pickle to replay (its device_traces[N]; a trace holds one "
                    "device). Default: the device with the most entries, with a note naming the others.");
    if (with_json) sub->add_flag("--json", common.json_output, "Print the results as JSON.");
    sub->add_flag("--allow-oom", common.allow_oom,
                  "Exit 0 even when allocations failed with out of memory (they are skipped; the figures then "
                  "describe another program). Without it such a replay exits with status 3.");
    sub->add_option("--max-input-bytes", common.max_input_text,
                    "Largest trace file, and largest text after gzip decompression, read (bytes, units as "
                    "--device-memory). Default: 4GiB.");
    sub->add_option("--max-events", common.max_events_text, "Most events a trace may hold. Default: 100000000.");
    sub->add_option("--max-line-bytes", common.max_line_text,
                    "Longest line of a trace or RMM log (bytes). Default: 65536.");
  };
  const auto add_repeat = [&](CLI::App* sub) {
    sub->add_option("--repeat", common.repeat_text,
                    "Run the trace N times back to back as one program (allocations it never frees are made "
                    "in the first pass only) and report each pass: the steady state of a loop. 1 to 100000. "
                    "Default: 1.");
    sub->add_option("--device-lag", common.lag_text,
                    "The simulated device runs EVENTS trace events behind the host, as a GPU does: an event "
                    "recorded now (to learn when freed memory is out of use) completes EVENTS events later. Default: 0 "
                    "(it keeps up).");
    sub->add_flag("--own-addresses", common.own_addresses,
                  "The simulated device places every segment at its own lowest free address, not at the "
                  "recording's segment_alloc addresses (the default when the trace has them).");
  };

  // An output path must name a file: '' is rejected while parsing (CLI11
  // prints "--output: ..." and the usage hint).
  const CLI::Validator non_empty_path(
      [](const std::string& value) { return value.empty() ? std::string("an empty path names no file") : std::string(); },
      "PATH");

  CLI::App* replay = app.add_subcommand("replay", "Replay a trace and report peaks and device calls.");
  add_common(replay, true);
  add_repeat(replay);
  replay
      ->add_option("--config", replay_configs,
                   "Configuration string, PyTorch syntax (see `ccalloc config-keys`): every key in one --config, "
                   "comma-separated. Default: defaults.")
      ->allow_extra_args(false);
  bool min_memory = false;
  replay->add_flag("--min-memory", min_memory,
                   "Also find the smallest simulated device memory on which the trace replays with --config "
                   "without out of memory (bisection to 2 MiB). A per_process_memory_fraction applies "
                   "to that device: the figure is the device, not the cap.");

  CLI::App* compare =
      app.add_subcommand("compare", "Replay one trace under several configurations side by side.");
  add_common(compare, true);
  add_repeat(compare);
  compare
      ->add_option("--config", compare_configs,
                   "A configuration to run (repeat for more; \"default\" or \"\" = defaults).")
      ->required()
      ->allow_extra_args(false);  // one value per --config, so TRACE may follow

  std::string snapshot_path;
  replay->add_option("--snapshot", snapshot_path,
                     "Record history during the replay and write a snapshot after the last event to this file "
                     "(JSON in PyTorch's snapshot layout; python3 -m ccalloc.snapshot, or python/ccalloc/snapshot.py "
                     "in a clone, turns it into a pickle).")
      ->check(non_empty_path);

  CLI::App* report = app.add_subcommand(
      "report", "Replay a trace and write one self-contained HTML page with plots (bytes over time, the segment "
                "map at the peak, fragmentation by pool and stream, the largest allocations).");
  add_common(report, false);  // its output is the HTML file
  std::string report_output = "report.html", report_title;
  std::string report_points = "1200";
  report
      ->add_option("--config", report_configs,
                   "Configuration string, PyTorch syntax: every key in one --config, comma-separated. "
                   "Default: defaults.")
      ->allow_extra_args(false);
  report->add_option("-o,--output", report_output, "The HTML file to write. Default: report.html.")
      ->check(non_empty_path);
  report->add_option("--points", report_points, "Time slices per curve (downsampling). Default: 1200.");
  report->add_option("--title", report_title, "Page title. Default: the trace's file name.");

  CLI::App* keys = app.add_subcommand("config-keys", "List the configuration keys.");

  // --version prints the version and exits 0 before CLI11 looks at the
  // other arguments: with any of them it is a usage error, not a success.
  if (argc > 2 && std::any_of(argv + 1, argv + argc, [](const char* a) { return std::string_view(a) == "--version"; })) {
    std::fprintf(stderr, "ccalloc: --version takes no other arguments (see ccalloc --help)\n");
    return 2;
  }
  // A first word that is no option and no subcommand: CLI11 would say only
  // that a subcommand is required; name the word and the subcommands.
  if (argc >= 2 && argv[1][0] != '-') {
    std::string names;
    bool known = false;
    for (const CLI::App* sub : std::as_const(app).get_subcommands([](const CLI::App*) { return true; })) {
      names += (names.empty() ? "" : ", ") + sub->get_name();
      known = known || sub->get_name() == argv[1];
    }
    if (!known) {
      std::fprintf(stderr, "ccalloc: unknown subcommand '%s'; expected one of: %s (see ccalloc --help)\n", argv[1],
                   names.c_str());
      return 2;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // prints help, or the error and a hint
    return rc == 0 ? 0 : 2;
  }

  if (replay->parsed())
    return run_replay(common, single_config(replay_configs, "replay"), min_memory, snapshot_path);
  if (report->parsed())
    return run_report(common, single_config(report_configs, "report"), report_output, report_points, report_title);
  if (compare->parsed()) return run_compare(common, compare_configs);
  if (keys->parsed()) return run_config_keys();
  return 2;  // unreachable: require_subcommand(1)
}

}  // namespace detail
}  // namespace

namespace {
// Output that did not reach stdout (a full disk, a closed pipe) fails the
// command: a replay whose report was lost is not a success.
int checked_output(int rc) {
  std::cout.flush();
  errno = 0;
  const bool flush_failed = std::fflush(stdout) != 0;
  const int err = errno;
  if (!flush_failed && std::ferror(stdout) == 0 && std::cout) return rc;
  std::fprintf(stderr, "ccalloc: cannot write the output to stdout: %s\n",
               flush_failed && err != 0 ? std::strerror(err) : "a write failed (a full disk or a closed pipe)");
  return rc != 0 ? rc : 1;
}

// Prints the host out-of-memory message, naming the step, then `cause`;
// returns the exit status.
int host_out_of_memory(const char* cause) {
  std::fprintf(stderr, "ccalloc: out of host memory%s%s (the memory limit, e.g. ulimit -v, is too small for this "
               "trace, or the host's memory is used up)%s\n",
               detail::current_step[0] != '\0' ? " while " : "", detail::current_step, cause);
  return 1;
}

/// A signal that ends the command (SIGTERM, SIGINT, SIGHUP) during the write
/// of an output file: the file's temporary file is removed
/// (ccalloc::remove_temporary_files, async-signal-safe), then the signal's
/// default action ends the process, so that its exit status still says
/// which signal killed it. At any other time there is nothing to remove.
extern "C" void end_on_signal(int signal_number) {
  const int saved = errno;
  ccalloc::remove_temporary_files();
  // SA_RESETHAND restored the default action; SA_NODEFER lets it act now.
  (void)::raise(signal_number);
  errno = saved;
}

/// Installs end_on_signal for the signals that end a command, except one
/// the command was started with ignored (nohup's SIGHUP stays ignored).
void remove_temporary_files_on_signals() {
  for (const int signal_number : {SIGTERM, SIGINT, SIGHUP}) {
    struct sigaction old {};
    if (::sigaction(signal_number, nullptr, &old) != 0 || old.sa_handler == SIG_IGN) continue;
    struct sigaction action {};
    action.sa_handler = end_on_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESETHAND | SA_NODEFER;
    (void)::sigaction(signal_number, &action, nullptr);
  }
}
}  // namespace

int main(int argc, char** argv) {
  // A file size limit (ulimit -f) makes a write that passes it fail with
  // EFBIG, which each step reports (the simulated device's memory file, an
  // output file whose temporary file is then removed), instead of the
  // signal that would stop the process with no message.
  std::signal(SIGXFSZ, SIG_IGN);
  remove_temporary_files_on_signals();
  try {
    return checked_output(detail::run(argc, argv));
  } catch (const std::bad_alloc&) {
    // Said without allocating: the step is in a fixed buffer.
    return host_out_of_memory("");
  } catch (const ccalloc::host_memory_error& e) {
    // The simulated device's host mapping refused (ENOMEM): the same limit as
    // a std::bad_alloc, said the same way, with the library's details after.
    return host_out_of_memory((": " + ccalloc::printable_text(e.what())).c_str());
  } catch (const detail::usage_error& e) {
    // Messages may quote the command line or a trace: no raw control bytes.
    std::fprintf(stderr, "ccalloc: %s\n", ccalloc::printable_text(e.what()).c_str());
    return 2;
  } catch (const ccalloc::error& e) {
    // The library's messages mostly start with "ccalloc": do not say it twice.
    const std::string what = ccalloc::printable_text(e.what());
    std::fprintf(stderr, "%s%s\n", what.starts_with("ccalloc") ? "" : "ccalloc: ", what.c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ccalloc: %s\n", ccalloc::printable_text(e.what()).c_str());
    return 1;
  }
}
