// ccalloc/core/config.cpp: the settings table, the config-string parser and
// its canonical printer.
//
// One table (detail::key_table) holds, per key, its documentation row, its
// value parser and its printer; parse(), to_string(), the error messages and
// config_keys() all read it, so a key added there is parsed, printed,
// documented and listed in "unknown key" messages at once.
//
// Grammar (PyTorch's PYTORCH_CUDA_ALLOC_CONF syntax):
//   config := item (',' item)*         commas inside [...] do not split items
//   item   := ws* key ws* ':' ws* value ws*  |  ws*   (empty items are skipped)
//   value  := token | '[' entry (',' entry)* ']'
//   entry  := ws* (mib | '>') ws* ':' ws* token ws*
// A key given twice: the last one wins. Cross-key rules (checked after every
// item, so order does not matter): max_split_size_mb and
// max_non_split_rounding_mb >= large_segment_size_mb.
#include <ccalloc/core/config.hpp>

#include <ccalloc/base/errors.hpp>
#include <ccalloc/base/printable_text.hpp>

#include "detail/format.hpp"

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <system_error>
#include <utility>

namespace ccalloc {
namespace detail {
namespace {

constexpr std::string_view default_prefix = "ccalloc config";
constexpr std::string_view environment_prefix = "ccalloc config (CCALLOC_CONF)";

/// Largest MiB count whose byte value fits in std::size_t (2^44 - 1 on 64-bit
/// targets). Larger MiB values (up to 2^64 - 1; beyond is out of range) are
/// clamped to it, as PyTorch 2.8+ does (its tokenizer reads the value with
/// std::stoull, then takes the minimum with SIZE_MAX / 1 MiB); the clamped
/// settings warn (warnings_for), so the clamp is never silent.
constexpr std::uint64_t max_mib = std::numeric_limits<std::size_t>::max() / mib;

/// A value that a key's parser rejected. The driver turns it into a
/// config_error that also names the key, the value and what is accepted.
struct bad_value {
  enum class kind : std::uint8_t { malformed, out_of_range };
  kind what;
  std::string detail;  ///< optional precision, e.g. "interval 300 is not a power of two"
};

[[noreturn]] void throw_malformed(std::string detail = {}) {
  throw bad_value{bad_value::kind::malformed, std::move(detail)};
}
[[noreturn]] void throw_out_of_range(std::string detail = {}) {
  throw bad_value{bad_value::kind::out_of_range, std::move(detail)};
}

std::string_view trim(std::string_view text) noexcept {
  constexpr std::string_view spaces = " \t\n\r\f\v";
  const auto first = text.find_first_not_of(spaces);
  if (first == std::string_view::npos) return {};
  const auto last = text.find_last_not_of(spaces);
  return text.substr(first, last - first + 1);
}

std::string concat(std::initializer_list<std::string_view> parts) {
  std::string out;
  for (auto part : parts) out += part;
  return out;
}

/// Input text as error messages quote it: at most 100 characters, then
/// "... (N bytes)", so that a huge value does not make a huge message,
/// escaped onto one line (printable_line).
std::string shown(std::string_view text) {
  constexpr std::size_t max_shown = 100;
  if (text.size() <= max_shown) return printable_line(text);
  return concat({printable_line(text.substr(0, max_shown)), "... (", std::to_string(text.size()), " bytes)"});
}

/// Parses a non-negative decimal integer made of digits only (no sign, no
/// spaces, no suffix). `what` names the token inside a list ("" at top level)
/// for the detail text. Throws bad_value (malformed, or out_of_range when it
/// does not fit in 64 bits).
std::uint64_t parse_unsigned(std::string_view text, std::string_view what = {}) {
  std::uint64_t value = 0;
  const auto* const end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ec == std::errc::invalid_argument || ptr != end) {
    if (what.empty()) throw_malformed();
    throw_malformed(concat({what, " '", shown(text), "' is not a non-negative integer"}));
  }
  if (ec == std::errc::result_out_of_range) {
    if (what.empty()) throw_out_of_range();
    throw_out_of_range(concat({what, " '", shown(text), "' is too large"}));
  }
  return value;
}

/// Parses a finite decimal number ("0.5", "5e-1"). Throws bad_value.
double parse_double(std::string_view text) {
  double value = 0.0;
  const auto* const end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (ec == std::errc::result_out_of_range) throw_out_of_range();
  if (ec != std::errc{} || ptr != end || !std::isfinite(value)) throw_malformed();
  return value;
}

/// True/False as PyTorch spells them; also true/false and 1/0.
bool parse_bool(std::string_view text) {
  if (text == "True" || text == "true" || text == "1") return true;
  if (text == "False" || text == "false" || text == "0") return false;
  throw_malformed();
}

/// MiB count to bytes, clamped to max_mib MiB.
std::size_t mib_to_bytes(std::uint64_t count_mib) noexcept {
  return static_cast<std::size_t>(std::min(count_mib, max_mib)) * mib;
}

std::string format_unsigned(std::uint64_t value) { return std::to_string(value); }


std::string format_bool(bool value) { return value ? "True" : "False"; }

// ---- roundup_power2_divisions ----------------------------------------------

void check_divisions(std::uint64_t divisions) {
  if (divisions != 0 && !std::has_single_bit(divisions)) {
    throw_out_of_range(concat({"divisions ", format_unsigned(divisions),
                               " is not 0 or a power of two"}));
  }
}

/// Interval index of a list key of `size_mib` MiB: log2(size_mib), clamped to
/// the last interval (PyTorch's rule).
std::size_t interval_index(std::uint64_t size_mib) noexcept {
  const auto log2 = static_cast<std::size_t>(std::bit_width(size_mib) - 1);
  return std::min(log2, roundup_intervals - 1);
}

/// Parses a single value ("4": every interval) or a list
/// "[256:1,512:2,>:4]". List semantics are PyTorch's
/// (AcceleratorAllocatorConfig::parseRoundUpPower2Divisions):
///   - a key K (MiB, a power of two) sets interval log2(K) (clamped to 15);
///   - the first key also sets every interval below it;
///   - '>' sets every interval after the last key (all of them if it is the
///     only entry);
///   - intervals no entry sets are 0 (plain 512-byte rounding).
/// ccalloc also requires keys in increasing order with '>' last (PyTorch
/// accepts other orders with order-dependent results).
std::array<std::size_t, roundup_intervals> parse_roundup(std::string_view text) {
  std::array<std::size_t, roundup_intervals> result{};
  if (text.front() != '[') {
    const auto divisions = parse_unsigned(text);
    check_divisions(divisions);
    result.fill(static_cast<std::size_t>(divisions));
    return result;
  }
  if (text.back() != ']') throw_malformed("missing the closing ']'");
  const auto inner = trim(text.substr(1, text.size() - 2));
  if (inner.find_first_of("[]") != std::string_view::npos) {
    throw_malformed("nested or stray brackets");
  }
  if (inner.empty()) return result;  // "[]": every interval 0

  bool have_key = false;
  bool have_rest = false;
  std::size_t last_index = 0;
  std::uint64_t last_key = 0;  // MiB
  std::size_t start = 0;
  while (start <= inner.size()) {
    auto comma = inner.find(',', start);
    if (comma == std::string_view::npos) comma = inner.size();
    const auto entry = trim(inner.substr(start, comma - start));
    start = comma + 1;

    if (entry.empty()) throw_malformed("empty list entry");
    if (have_rest) throw_malformed("'>' must be the last entry");
    const auto colon = entry.find(':');
    if (colon == std::string_view::npos) {
      throw_malformed(concat({"expected <MiB>:<divisions> or >:<divisions>, got '", shown(entry), "'"}));
    }
    const auto key = trim(entry.substr(0, colon));
    const auto divisions = parse_unsigned(trim(entry.substr(colon + 1)), "divisions");
    check_divisions(divisions);
    const auto value = static_cast<std::size_t>(divisions);

    if (key == ">") {
      const std::size_t first = have_key ? last_index + 1 : 0;
      std::fill(result.begin() + static_cast<std::ptrdiff_t>(first), result.end(), value);
      have_rest = true;
      continue;
    }
    const auto size_mib = parse_unsigned(key, "interval");
    if (!std::has_single_bit(size_mib)) {
      throw_out_of_range(concat({"interval ", format_unsigned(size_mib),
                                 " is not a power of two (MiB)"}));
    }
    const auto index = interval_index(size_mib);
    if (have_key && size_mib <= last_key) {
      throw_out_of_range(concat({"interval ", format_unsigned(size_mib), " does not follow the previous one, ",
                                 format_unsigned(last_key), " (keys must increase)"}));
    }
    if (have_key && index <= last_index) {  // both keys at or past the last interval's start
      const auto bound = std::uint64_t{1} << (roundup_intervals - 1);
      throw_out_of_range(concat({"interval ", format_unsigned(size_mib), " is past ", format_unsigned(bound),
                                 ", the start of the last interval, which the key ", format_unsigned(last_key),
                                 " before it already set (sizes of ", format_unsigned(bound),
                                 " MiB and above share one interval: give one key of ", format_unsigned(bound),
                                 " or more)"}));
    }
    if (!have_key) {
      std::fill(result.begin(), result.begin() + static_cast<std::ptrdiff_t>(index), value);
    }
    result[index] = value;
    last_index = index;
    last_key = size_mib;
    have_key = true;
  }
  return result;
}

/// Canonical text of `divisions`: one number when all 16 are equal, else the
/// shortest list of the form "[<leading run key>:v, <one entry per interval>,
/// >:v]" that parse_roundup maps back to the same array.
std::string format_roundup(const std::array<std::size_t, roundup_intervals>& divisions) {
  const auto equal_to = [&](std::size_t value) {
    return [value](std::size_t other) { return other == value; };
  };
  // [0, lead_end): the leading run; [tail_begin, 16): the trailing run.
  const auto lead_end = static_cast<std::size_t>(
      std::find_if_not(divisions.begin(), divisions.end(), equal_to(divisions.front())) -
      divisions.begin());
  if (lead_end == roundup_intervals) return format_unsigned(divisions.front());
  const auto tail_begin = static_cast<std::size_t>(
      divisions.rend() -
      std::find_if_not(divisions.rbegin(), divisions.rend(), equal_to(divisions.back())));

  const auto key_of = [](std::size_t index) { return format_unsigned(std::uint64_t{1} << index); };
  std::string out = "[";
  const auto append_pair = [&out](const std::string& key, std::size_t value) {
    out.append(key).append(":").append(format_unsigned(value));
  };
  append_pair(key_of(lead_end - 1), divisions.front());
  for (std::size_t i = lead_end; i < tail_begin; ++i) {
    out.append(",");
    append_pair(key_of(i), divisions[i]);
  }
  out.append(",");
  append_pair(">", divisions.back());
  out.append("]");
  return out;
}

// ---- the settings table ------------------------------------------------------

/// One key: its documentation row, how to parse its (trimmed, non-empty)
/// value into a configuration (throws bad_value), and how to print it
/// (nullopt: the field is at a "not set" state that has no spelling).
struct key_spec {
  config_key_info info;
  void (*parse)(allocator_config& config, std::string_view value);
  std::optional<std::string> (*print)(const allocator_config& config);
};

constexpr std::string_view boolean_values = "True or False (also true/false, 1/0)";

// Parsers and printers that several keys share.
template <bool allocator_config::*Field>
void parse_bool_field(allocator_config& config, std::string_view value) {
  config.*Field = parse_bool(value);
}
template <bool allocator_config::*Field>
std::optional<std::string> print_bool_field(const allocator_config& config) {
  return format_bool(config.*Field);
}
/// A MiB count whose lower bound is checked after all items (cross-key).
template <std::size_t allocator_config::*Field>
void parse_mib_field(allocator_config& config, std::string_view value) {
  config.*Field = mib_to_bytes(parse_unsigned(value));
}
template <std::size_t allocator_config::*Field>
std::optional<std::string> print_mib_field(const allocator_config& config) {
  return format_unsigned(config.*Field / mib);
}

// Row order is documentation order and to_string() order.
const std::array<key_spec, 22>& key_table() {
  static const std::array<key_spec, 22> table{{
      {{"max_split_size_mb",
        "an integer number of MiB, at least large_segment_size_mb (20 by default)",
        "Blocks this large or larger are never split and serve only requests "
        "at least this large (default: unlimited)."},
       &parse_mib_field<&allocator_config::max_split_size_bytes>,
       [](const allocator_config& c) -> std::optional<std::string> {
         if (c.max_split_size_bytes == std::numeric_limits<std::size_t>::max()) return std::nullopt;
         return format_unsigned(c.max_split_size_bytes / mib);
       }},
      {{"max_non_split_rounding_mb",
        "an integer number of MiB, at least large_segment_size_mb (20 by default)",
        "An oversize block may serve a request up to this much smaller "
        "(default: large_segment_size_mb)."},
       &parse_mib_field<&allocator_config::max_non_split_rounding_bytes>,
       &print_mib_field<&allocator_config::max_non_split_rounding_bytes>},
      {{"large_segment_size_mb", "an even integer number of MiB greater than 10",
        "Segment size for large-pool requests under 10 MiB (default 20)."},
       [](allocator_config& c, std::string_view value) {
         const auto count_mib = parse_unsigned(value);
         if (count_mib <= 10 || count_mib % 2 != 0) throw_out_of_range();
         // Clamp, keeping it even (max_mib is odd).
         c.large_segment_size_bytes = mib_to_bytes(std::min(count_mib, max_mib - 1));
       },
       &print_mib_field<&allocator_config::large_segment_size_bytes>},
      {{"garbage_collection_threshold", "a number strictly between 0 and 1, i.e. in (0, 1)",
        "Above this fraction of the allowed memory, release old cached blocks "
        "before growing (default: off)."},
       [](allocator_config& c, std::string_view value) {
         const double threshold = parse_double(value);
         if (!(threshold > 0.0 && threshold < 1.0)) throw_out_of_range();
         c.garbage_collection_threshold = threshold;
       },
       [](const allocator_config& c) -> std::optional<std::string> {
         if (c.garbage_collection_threshold == 0.0) return std::nullopt;
         return format_double(c.garbage_collection_threshold);
       }},
      {{"roundup_power2_divisions",
        "0 or a power of two, or a list [<MiB>:<d>,...,>:<d>] of increasing power-of-two "
        "sizes in MiB, optionally ending with >, each mapped to d = 0 or a power of two",
        "Round requests up to one of this many steps per power-of-two interval "
        "(default: 0, plain 512-byte rounding)."},
       [](allocator_config& c, std::string_view value) {
         c.roundup_power2_divisions = parse_roundup(value);
       },
       [](const allocator_config& c) -> std::optional<std::string> {
         return format_roundup(c.roundup_power2_divisions);
       }},
      {{"expandable_segments", boolean_values,
        "Grow one segment per stream and pool by mapping 2 MiB pages (CUDA virtual memory) "
        "instead of allocating new segments; free whole pages are unmapped and recycled "
        "(default True; plain segments on a device without virtual memory)."},
       [](allocator_config& c, std::string_view value) {
         parse_bool_field<&allocator_config::expandable_segments>(c, value);
         c.expandable_segments_set = true;
       },
       [](const allocator_config& c) -> std::optional<std::string> {
         // Only when given: the default depends on the device (see config.hpp).
         if (!c.expandable_segments_set) return std::nullopt;
         return print_bool_field<&allocator_config::expandable_segments>(c);
       }},
      {{"release_lock_on_cudamalloc", boolean_values,
        "Release the allocator lock while the device malloc runs."},
       &parse_bool_field<&allocator_config::release_lock_on_cudamalloc>,
       &print_bool_field<&allocator_config::release_lock_on_cudamalloc>},
      {{"per_process_memory_fraction", "a number in [0, 1]",
        "Cap reserved memory at this fraction of the device's total memory."},
       [](allocator_config& c, std::string_view value) {
         const double fraction = parse_double(value);
         if (!(fraction >= 0.0 && fraction <= 1.0)) throw_out_of_range();
         c.per_process_memory_fraction = fraction + 0.0;  // -0 is 0, as set_memory_fraction takes it
         c.memory_fraction_set = true;
       },
       [](const allocator_config& c) -> std::optional<std::string> {
         if (!c.memory_fraction_set) return std::nullopt;
         return format_double(c.per_process_memory_fraction);
       }},
      {{"trim_on_new_peak", boolean_values,
        "ccalloc's own key: before reserved memory would pass its highest value so far, "
        "recycle free whole pages (expandable segments) or return cached segments that "
        "hold no live block to the device (plain segments) (default True; False "
        "reproduces PyTorch's reservations)."},
       &parse_bool_field<&allocator_config::trim_on_new_peak>,
       &print_bool_field<&allocator_config::trim_on_new_peak>},
      {{"recycles_per_peak", "an integer >= 0, or unlimited",
        "ccalloc's own key: with expandable segments, how many times free pages are recycled "
        "(unmapped and mapped where the request needs them, once the work the stream that "
        "freed them queued before the free has run: no synchronization) to avoid raising reserved memory "
        "past one high-water mark before the mark is raised instead (default unlimited: the "
        "least memory; 0: never, as PyTorch; a small number: fewer remappings, more memory)."},
       [](allocator_config& c, std::string_view value) {
         if (value == "unlimited") {
           c.recycles_per_peak = std::numeric_limits<std::size_t>::max();
           return;
         }
         const std::uint64_t n = parse_unsigned(value);
         // The largest count stands for unlimited: spelled as a number, it is a mistake.
         if (n >= std::numeric_limits<std::size_t>::max())
           throw_out_of_range("write 'unlimited' for no limit; a count must be below 2^64-1");
         c.recycles_per_peak = static_cast<std::size_t>(n);
       },
       [](const allocator_config& c) -> std::optional<std::string> {
         if (c.recycles_per_peak == std::numeric_limits<std::size_t>::max()) return std::nullopt;
         return format_unsigned(c.recycles_per_peak);
       }},
      {{"recycle_time_percent", "an integer from 0 to 100",
        "ccalloc's own key: with expandable segments, the most of the host's time (percent, "
        "as a token bucket over one second, and a reserve over ten seconds for new peaks of more "
        "than a sixteenth of the high-water mark) that recycling pages for a new peak may take, since "
        "remapping a page costs tens of microseconds; past it reserved memory rises instead "
        "(default 5; 100: no limit; 0: never)."},
       [](allocator_config& c, std::string_view value) {
         const auto percent = parse_unsigned(value);
         if (percent > 100) throw_out_of_range();
         c.recycle_time_percent = static_cast<unsigned>(percent);
       },
       [](const allocator_config& c) -> std::optional<std::string> {
         if (c.recycle_time_percent == allocator_config{}.recycle_time_percent) return std::nullopt;
         return format_unsigned(c.recycle_time_percent);
       }},
      {{"reuse_across_streams", boolean_values,
        "ccalloc's own key: before a new peak, a cached whole segment of another stream "
        "whose work has completed moves to the requesting stream; with expandable "
        "segments, an idle stream's whole reservation moves with its mapped pages "
        "(default True; False keeps segments and reservations with their stream, as "
        "PyTorch does; pages recycled under trim_on_new_peak still change streams)."},
       &parse_bool_field<&allocator_config::reuse_across_streams>,
       &print_bool_field<&allocator_config::reuse_across_streams>},
      {{"reuse_with_stream_wait", boolean_values,
        "ccalloc's own key: with expandable segments, recycling pages for a new peak may take the "
        "free pages of another stream's block whose work has not completed yet: the requesting stream "
        "waits on the device for that work (cudaStreamWaitEvent; the host never blocks), the pages are "
        "mapped at once and their old place unmapped later; a dependency between streams the program did "
        "not ask for (default False, as PyTorch: such pages stay until their work has completed, and "
        "reserved memory grows instead)."},
       &parse_bool_field<&allocator_config::reuse_with_stream_wait>,
       &print_bool_field<&allocator_config::reuse_with_stream_wait>},
      {{"thread_cache", "off, small or all (also True/true/1 = all, False/false/0 = off)",
        "ccalloc's own key: each thread parks up to 4 blocks it freed and gets one back for the same "
        "bytes on the same stream without the stream's lock, only while that block is exactly what the "
        "pools would hand out (the same addresses and peaks as off; small: small-pool blocks only, "
        "requests of at most 1 MiB). Default all; when the key is not given, the environment variable "
        "CCALLOC_THREAD_CACHE decides, spelled as this key."},
       [](allocator_config& c, std::string_view value) {
         const std::optional<thread_cache_mode> mode = parse_thread_cache_mode(value);
         if (!mode) throw_malformed();
         c.thread_cache = *mode;
         c.thread_cache_set = true;
       },
       [](const allocator_config& c) -> std::optional<std::string> {
         if (!c.thread_cache_set) return std::nullopt;
         switch (c.thread_cache) {
           case thread_cache_mode::off: return "off";
           case thread_cache_mode::small: return "small";
           case thread_cache_mode::all: return "all";
         }
         return std::nullopt;
       }},
      {{"oom_snapshot", "a file path without commas or brackets",
        "ccalloc's own key: an out-of-memory error first writes a snapshot of its device to this file "
        "(PyTorch's memory snapshot pickle, with the memory history when it is recorded; readable by "
        "torch.cuda._memory_viz, pytorch.org/memory_viz and ccalloc report) and its message says "
        "where (default: none)."},
       [](allocator_config& c, std::string_view value) {
         // Brackets group list items ("[1:2,>:8]"): a path with one would
         // swallow the settings after it when the configuration is printed
         // and parsed again.
         if (value.find_first_of("[]") != std::string_view::npos)
           throw_malformed("brackets '[' and ']' group list values; a path cannot contain them");
         c.oom_snapshot_path = std::string(value);
       },
       [](const allocator_config& c) -> std::optional<std::string> {
         if (c.oom_snapshot_path.empty()) return std::nullopt;
         return c.oom_snapshot_path;
       }},
      {{"oom_snapshot_interval_s", "an integer number of seconds >= 0",
        "ccalloc's own key: oom_snapshot writes at most one snapshot per device in this many seconds; "
        "out-of-memory errors in between say that none was written (default 60; 0: every time)."},
       [](allocator_config& c, std::string_view value) { c.oom_snapshot_interval_s = parse_unsigned(value); },
       [](const allocator_config& c) -> std::optional<std::string> {
         if (c.oom_snapshot_interval_s == allocator_config{}.oom_snapshot_interval_s) return std::nullopt;
         return format_unsigned(c.oom_snapshot_interval_s);
       }},
      {{"backend", "native or cudaMallocAsync",
        "PyTorch's allocator choice; ccalloc is always the native-style allocator."},
       [](allocator_config& c, std::string_view value) {
         if (value != "native" && value != "cudaMallocAsync") throw_malformed();
         c.backend = std::string(value);
       },
       [](const allocator_config& c) -> std::optional<std::string> { return c.backend; }},
      {{"pinned_use_cuda_host_register", boolean_values,
        "PyTorch pinned host allocator setting; no effect on device memory."},
       &parse_bool_field<&allocator_config::pinned_use_cuda_host_register>,
       &print_bool_field<&allocator_config::pinned_use_cuda_host_register>},
      {{"pinned_num_register_threads", "a power of two in [1, 128]",
        "PyTorch pinned host allocator setting; no effect on device memory."},
       [](allocator_config& c, std::string_view value) {
         const auto threads = parse_unsigned(value);
         if (!std::has_single_bit(threads) || threads > 128) throw_out_of_range();
         c.pinned_num_register_threads = static_cast<std::size_t>(threads);
       },
       [](const allocator_config& c) -> std::optional<std::string> {
         return format_unsigned(c.pinned_num_register_threads);
       }},
      {{"pinned_use_background_threads", boolean_values,
        "PyTorch pinned host allocator setting; no effect on device memory."},
       &parse_bool_field<&allocator_config::pinned_use_background_threads>,
       &print_bool_field<&allocator_config::pinned_use_background_threads>},
      {{"pinned_reserve_segment_size_mb", "an integer number of MiB greater than 0",
        "PyTorch pinned host allocator setting; no effect on device memory."},
       [](allocator_config& c, std::string_view value) {
         const auto count_mib = parse_unsigned(value);
         if (count_mib == 0) throw_out_of_range();
         c.pinned_reserve_segment_size_bytes = mib_to_bytes(count_mib);
       },
       [](const allocator_config& c) -> std::optional<std::string> {
         if (c.pinned_reserve_segment_size_bytes == 0) return std::nullopt;
         return format_unsigned(c.pinned_reserve_segment_size_bytes / mib);
       }},
      {{"graph_capture_record_stream_reuse", boolean_values,
        "PyTorch CUDA-graph capture setting (reuse of record_stream blocks during a capture); "
        "ccalloc defers those frees until the capture ends instead."},
       &parse_bool_field<&allocator_config::graph_capture_record_stream_reuse>,
       &print_bool_field<&allocator_config::graph_capture_record_stream_reuse>},
  }};
  return table;
}

const key_spec& spec_of(std::string_view key) {
  for (const auto& spec : key_table()) {
    if (spec.info.key == key) return spec;
  }
  std::abort();  // only called with keys from the table
}

std::string accepted_keys_list() {
  std::string out;
  for (const auto& spec : key_table()) {
    if (!out.empty()) out += ", ";
    out += spec.info.key;
  }
  return out;
}

/// Levenshtein distance, for "did you mean" on unknown keys.
std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

[[noreturn]] void throw_unknown_key(std::string_view prefix, std::string_view key) {
  std::string message = concat({prefix, ": unknown key '", shown(key), "'"});
  const key_spec* nearest = nullptr;
  std::size_t best = 4;  // suggest only close matches (distance <= 3)
  for (const auto& spec : key_table()) {
    // The distance is at least the difference in length: skip the quadratic
    // computation when that alone rules the key out (a long unknown key
    // costs O(its length), not O(length x key length x keys)).
    const std::size_t length_gap = key.size() > spec.info.key.size() ? key.size() - spec.info.key.size()
                                                                       : spec.info.key.size() - key.size();
    if (length_gap >= best) continue;
    const auto distance = edit_distance(key, spec.info.key);
    if (distance < best) {
      best = distance;
      nearest = &spec;
    }
  }
  if (nearest != nullptr) message += concat({"; did you mean '", nearest->info.key, "'?"});
  message += concat({" (accepted keys: ", accepted_keys_list(), ")"});
  throw config_error(message);
}

/// "<prefix>: <key>:<value> is <problem>[: <detail>] (accepted: <accepted>)".
[[noreturn]] void throw_bad_value(std::string_view prefix, const key_spec& spec,
                                  std::string_view value, const bad_value& problem) {
  std::string message = concat({prefix, ": ", spec.info.key, ":", shown(value),
                                problem.what == bad_value::kind::out_of_range
                                    ? " is out of range"
                                    : " is not a valid value"});
  if (!problem.detail.empty()) message += concat({": ", problem.detail});
  message += concat({" (accepted: ", spec.info.accepted, ")"});
  throw config_error(message);
}

/// Splits at commas outside brackets. Unbalanced brackets are left for the
/// value parser to report.
std::vector<std::string_view> split_items(std::string_view text) {
  std::vector<std::string_view> items;
  int depth = 0;
  std::size_t start = 0;
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '[') ++depth;
    if (text[i] == ']' && depth > 0) --depth;
    if (text[i] == ',' && depth == 0) {
      items.push_back(text.substr(start, i - start));
      start = i + 1;
    }
  }
  items.push_back(text.substr(start));
  return items;
}

/// "<prefix>: key:value" of `key` in `config`, as a warning starts.
std::string setting_text(const allocator_config& config, std::string_view key) {
  return concat({default_prefix, ": ", key, ":", *spec_of(key).print(config)});
}

/// Warnings for settings that another setting makes inert or changes.
void warn_interactions(const allocator_config& config, std::vector<std::string>& warnings) {
  const auto setting = [&](std::string_view key) { return setting_text(config, key); };
  if (config.garbage_collection_threshold > 0.0 && !config.memory_fraction_set) {
    warnings.push_back(
        setting("garbage_collection_threshold") +
        " is set without per_process_memory_fraction: PyTorch ignores the threshold then; "
        "ccalloc applies it to the device's total memory (set per_process_memory_fraction "
        "to choose the limit)");
  }
  if (config.max_split_size_bytes == std::numeric_limits<std::size_t>::max() &&
      config.max_non_split_rounding_bytes != config.large_segment_size_bytes) {
    warnings.push_back(setting("max_non_split_rounding_mb") +
                       " has no effect without max_split_size_mb: no block is oversize, "
                       "so none is rounded");
  }
  // Settings that expandable segments make inert (on by default where the
  // device has virtual memory): they map pages for the request itself, with
  // the allocator lock held throughout.
  if (config.expandable_segments) {
    const char* const why = " has no effect with expandable segments (the default where the device supports "
                            "virtual memory; set expandable_segments:False to use it): ";
    if (config.large_segment_size_bytes != allocator_config{}.large_segment_size_bytes)
      warnings.push_back(setting("large_segment_size_mb") + why +
                         "requests map pages for their own size, there are no fixed-size segments");
    if (config.release_lock_on_cudamalloc)
      warnings.push_back(setting("release_lock_on_cudamalloc") + why + "pages are mapped with the lock held");
  }
  // recycles_per_peak limits page recycling before a new peak: only with
  // expandable segments and trim_on_new_peak.
  for (const std::string_view key : {std::string_view{"recycles_per_peak"}, std::string_view{"recycle_time_percent"}}) {
    const bool changed = key == "recycles_per_peak"
                             ? config.recycles_per_peak != allocator_config{}.recycles_per_peak
                             : config.recycle_time_percent != allocator_config{}.recycle_time_percent;
    if (changed && (!config.expandable_segments || !config.trim_on_new_peak))
      warnings.push_back(setting(key) + " has no effect " +
                         (config.expandable_segments ? "with trim_on_new_peak:False: pages are recycled before a "
                                                       "new peak only when trim_on_new_peak is on"
                                                     : "with expandable_segments:False: it limits the recycling of "
                                                       "free pages, which plain segments do not have"));
  }
}

/// Warnings for settings ccalloc ignores: at the clamp ceiling, or PyTorch's
/// settings that configure what ccalloc does not have.
void warn_ignored(const allocator_config& config, std::vector<std::string>& warnings) {
  const auto setting = [&](std::string_view key) { return setting_text(config, key); };
  // MiB counts at the clamp ceiling (a larger value was clamped there, or
  // the ceiling itself was given): 16 EiB, more than any device.
  const auto at_ceiling = [&](std::string_view key, std::size_t bytes, std::uint64_t ceiling_mib) {
    if (bytes == static_cast<std::size_t>(ceiling_mib) * mib)
      warnings.push_back(setting(key) + " is the largest value ccalloc keeps (larger values are clamped to it, " +
                         "as PyTorch does): about 16 EiB, more than any device has");
  };
  at_ceiling("max_split_size_mb", config.max_split_size_bytes, max_mib);
  at_ceiling("max_non_split_rounding_mb", config.max_non_split_rounding_bytes, max_mib);
  at_ceiling("large_segment_size_mb", config.large_segment_size_bytes, max_mib - 1);
  at_ceiling("pinned_reserve_segment_size_mb", config.pinned_reserve_segment_size_bytes, max_mib);
  if (config.backend != "native") {
    warnings.push_back(setting("backend") +
                       " has no effect: ccalloc is a native-style caching allocator; "
                       "the setting is ignored");
  }
  const allocator_config defaults;
  const auto pinned_warning = [&](std::string_view key) {
    warnings.push_back(setting(key) +
                       " has no effect: pinned_* settings configure PyTorch's pinned host "
                       "memory allocator, not device memory");
  };
  if (config.pinned_use_cuda_host_register != defaults.pinned_use_cuda_host_register) {
    pinned_warning("pinned_use_cuda_host_register");
  }
  if (config.pinned_num_register_threads != defaults.pinned_num_register_threads) {
    pinned_warning("pinned_num_register_threads");
  }
  if (config.pinned_use_background_threads != defaults.pinned_use_background_threads) {
    pinned_warning("pinned_use_background_threads");
  }
  if (config.pinned_reserve_segment_size_bytes != defaults.pinned_reserve_segment_size_bytes) {
    pinned_warning("pinned_reserve_segment_size_mb");
  }
  if (config.graph_capture_record_stream_reuse != defaults.graph_capture_record_stream_reuse) {
    warnings.push_back(setting("graph_capture_record_stream_reuse") +
                       " has no effect: during a CUDA-graph capture ccalloc defers the frees of "
                       "blocks used on other streams until the capture ends, rather than reusing "
                       "them as PyTorch can");
  }
}

/// The warnings (SPEC X6) that `config` deserves: a function of its fields.
std::vector<std::string> warnings_for(const allocator_config& config) {
  std::vector<std::string> warnings;
  warn_interactions(config, warnings);
  warn_ignored(config, warnings);
  return warnings;
}

/// Applies `text` to `config` (a copy: the caller assigns it on success).
/// Messages start with `prefix`.
allocator_config parse_onto(allocator_config config, std::string_view text,
                            std::string_view prefix) {
  bool saw_large_segment = false;
  bool saw_non_split_rounding = false;
  for (const auto raw_item : split_items(text)) {
    const auto item = trim(raw_item);
    if (item.empty()) continue;
    const auto colon = item.find(':');
    const auto key = trim(item.substr(0, colon));
    if (colon == std::string_view::npos || key.empty()) {
      throw config_error(concat({prefix, ": expected key:value, got '", shown(item), "'"}));
    }
    const auto value = trim(item.substr(colon + 1));
    const auto spec = std::find_if(key_table().begin(), key_table().end(),
                                   [&](const key_spec& s) { return s.info.key == key; });
    if (spec == key_table().end()) throw_unknown_key(prefix, key);
    if (value.empty()) {
      throw config_error(
          concat({prefix, ": ", key, " has no value (accepted: ", spec->info.accepted, ")"}));
    }
    try {
      spec->parse(config, value);
    } catch (const bad_value& problem) {
      throw_bad_value(prefix, *spec, value, problem);
    }
    saw_large_segment = saw_large_segment || key == "large_segment_size_mb";
    saw_non_split_rounding = saw_non_split_rounding || key == "max_non_split_rounding_mb";
  }

  // PyTorch: max_non_split_rounding defaults to the large segment size.
  if (saw_large_segment && !saw_non_split_rounding) {
    config.max_non_split_rounding_bytes = config.large_segment_size_bytes;
  }
  // Cross-key lower bounds (PyTorch: "too small, must be >= large segment size").
  const auto below_segment = [&](std::string_view key) {
    const auto& spec = spec_of(key);
    throw_bad_value(prefix, spec, *spec.print(config),
                    bad_value{bad_value::kind::out_of_range,
                              concat({"it is below large_segment_size_mb (",
                                      format_unsigned(config.large_segment_size_bytes / mib),
                                      ")"})});
  };
  if (config.max_split_size_bytes != std::numeric_limits<std::size_t>::max() &&
      config.max_split_size_bytes < config.large_segment_size_bytes) {
    below_segment("max_split_size_mb");
  }
  if (config.max_non_split_rounding_bytes < config.large_segment_size_bytes) {
    below_segment("max_non_split_rounding_mb");
  }
  config.warnings = warnings_for(config);
  return config;
}

}  // namespace
}  // namespace detail

allocator_config allocator_config::parse(std::string_view text) {
  return detail::parse_onto(allocator_config{}, text, detail::default_prefix);
}

void allocator_config::apply(std::string_view text) {
  *this = detail::parse_onto(*this, text, detail::default_prefix);
}

allocator_config allocator_config::from_environment() {
  const char* const text = std::getenv("CCALLOC_CONF");
  if (text == nullptr) return allocator_config{};
  return detail::parse_onto(allocator_config{}, text, detail::environment_prefix);
}

std::string allocator_config::to_string() const {
  std::string out;
  for (const auto& spec : detail::key_table()) {
    const auto value = spec.print(*this);
    if (!value) continue;
    if (!out.empty()) out += ',';
    out += spec.info.key;
    out += ':';
    out += *value;
  }
  return out;
}

std::optional<thread_cache_mode> parse_thread_cache_mode(std::string_view text) noexcept {
  text = detail::trim(text);
  if (text == "off" || text == "False" || text == "false" || text == "0") return thread_cache_mode::off;
  if (text == "small") return thread_cache_mode::small;
  if (text == "all" || text == "True" || text == "true" || text == "1") return thread_cache_mode::all;
  return std::nullopt;
}

const std::vector<config_key_info>& config_keys() {
  static const std::vector<config_key_info> keys = [] {
    std::vector<config_key_info> out;
    for (const auto& spec : detail::key_table()) out.push_back(spec.info);
    return out;
  }();
  return keys;
}

}  // namespace ccalloc
