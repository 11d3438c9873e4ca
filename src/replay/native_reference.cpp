// native_reference.cpp: PyTorch's figures for a trace
// (include/ccalloc/replay/native_reference.hpp), read from native_peaks.json.
#include <ccalloc/replay/native_reference.hpp>

#include <ccalloc/replay/embedded.hpp>
#include <ccalloc/replay/trace.hpp>

#include <nlohmann/json.hpp>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string_view>
#include <system_error>
#include <unordered_set>
#include <utility>
#include <vector>

namespace ccalloc {

namespace {

using json = nlohmann::ordered_json;  // keeps the entry's keys in their order

// The figures of an entry, each a count (bytes, calls or events): a JSON
// integer from 0 to 2^64 - 1.
constexpr std::string_view figure_keys[] = {"requested_peak",
                                            "native_reserved_peak",
                                            "native_expandable_reserved_peak",
                                            "native_allocated_peak",
                                            "native_device_allocs",
                                            "events",
                                            "native_min_capacity_bytes",
                                            "native_expandable_min_capacity_bytes"};

// What is wrong with figure `key` of `entry` ("" when it is absent or a count).
std::string figure_problem(const json& entry, std::string_view key) {
  const auto it = entry.find(key);
  if (it == entry.end() || it->is_number_unsigned()) return "";
  if (it->is_number_integer() && it->get<std::int64_t>() == 0) return "";  // written -0
  const std::string what = std::string(key) + " is ";
  const std::string counts = " (PyTorch's figures are counts: integers from 0 to 18446744073709551615)";
  if (it->is_number_integer()) return what + it->dump() + ": negative" + counts;
  // nlohmann reads an integer beyond 64 bits as a floating-point number.
  if (it->is_number_float() && it->get<double>() >= 18446744073709551616.0 &&
      it->get<double>() == std::floor(it->get<double>()))
    return what + it->dump() + ": out of range" + counts;
  if (it->is_number_float()) return what + it->dump() + ": not an integer" + counts;
  return what + "a JSON " + std::string(it->type_name()) + ", not a number" + counts;
}

native_reference figures_from(const json& entry, std::string origin) {
  const auto u64 = [&](const char* key) {
    const auto it = entry.find(key);
    return it != entry.end() && it->is_number_unsigned() ? it->get<std::uint64_t>() : 0;
  };
  native_reference f;
  f.origin = std::move(origin);
  f.entry_json = entry.dump();
  f.requested_peak = u64("requested_peak");
  f.reserved_peak = u64("native_reserved_peak");
  f.expandable_reserved_peak = u64("native_expandable_reserved_peak");
  f.allocated_peak = u64("native_allocated_peak");
  f.device_allocs = u64("native_device_allocs");
  f.min_capacity_bytes = u64("native_min_capacity_bytes");
  f.expandable_min_capacity_bytes = u64("native_expandable_min_capacity_bytes");
  return f;
}

/// "gpt2_train" for ".../gpt2_train.trace.gz" or ".../gpt2_train.trace";
/// otherwise the file name.
std::string trace_base_name(const std::filesystem::path& path) {
  std::string name = path.filename().string();
  for (const std::string_view suffix : {std::string_view(".trace.gz"), std::string_view(".trace")}) {
    if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      return name.substr(0, name.size() - suffix.size());
    }
  }
  return name;
}

// A native_peaks.json parsed in one pass (nlohmann's parser callback).
struct peaks_parse {
  json all;
  bool too_deep = false;
  std::string last_key;
  // The first key written twice in an object where the trace's figures are
  // read (the top level, under the trace's name; or anywhere in its entry),
  // and whether at the top level: JSON keeps one of them (nlohmann the last),
  // so which value is meant is unclear. Empty when none.
  std::string duplicate_key;
  bool duplicate_at_top = false;

  // Parses `text` into `all`, keeping only the entry `name` (the other
  // traces' entries are checked for syntax, not kept). Arrays and objects
  // nested deeper than max_native_peaks_depth are discarded as they are
  // met, so nothing deep is ever built (dump() and the destructor would
  // recurse once per level): `too_deep` tells. Throws nlohmann's
  // parse_error or out_of_range (number overflow) for text that is no
  // JSON; `last_key` is then the last key read before the fault.
  void parse(const std::string& text, const std::string& name) {
    // The keys met so far in the open object at each depth (a key's depth
    // is its object's plus 1), and whether the parser is inside the trace's
    // entry (after the top-level key `name`).
    std::vector<std::unordered_set<std::string>> keys_at(max_native_peaks_depth + 2);
    bool in_entry = false;
    // depth: the containers around the value (0 for the top level).
    const json::parser_callback_t keep = [&](int depth, json::parse_event_t event, json& parsed) {
      const auto d = static_cast<std::size_t>(depth);
      switch (event) {
        case json::parse_event_t::object_start:
        case json::parse_event_t::array_start:
          if (d < max_native_peaks_depth) {
            if (event == json::parse_event_t::object_start) keys_at[d + 1].clear();
            return true;
          }
          too_deep = true;
          return false;
        case json::parse_event_t::key: {
          last_key = parsed.get<std::string>();
          if (d == 1) in_entry = last_key == name;
          const bool read_here = d == 1 ? in_entry : in_entry && d >= 2;
          if (d < keys_at.size() && !keys_at[d].insert(last_key).second && read_here && duplicate_key.empty()) {
            duplicate_key = last_key;
            duplicate_at_top = d == 1;
          }
          return d != 1 || in_entry;  // a top-level key is a trace's name
        }
        default: return true;
      }
    };
    all = json::parse(text, keep);
  }
};

// nlohmann's message without its "[json.exception.<kind>.<id>] ".
std::string json_reason(const json::exception& e) {
  const std::string_view what = e.what();
  const std::size_t end = what.starts_with("[json.exception.") ? what.find("] ") : std::string_view::npos;
  return std::string(end == std::string_view::npos ? what : what.substr(end + 2));
}

}  // namespace

std::string native_peaks_path_beside(const std::string& trace_path) {
  namespace fs = std::filesystem;
  const fs::path trace_file(trace_path);
  const fs::path folder = trace_file.has_parent_path() ? trace_file.parent_path() : fs::path(".");
  return (folder / "native_peaks.json").string();
}

std::optional<native_reference> native_reference_beside(const std::string& trace_path, std::string* warning) {
  namespace fs = std::filesystem;
  const fs::path trace_file(trace_path);
  const fs::path peaks_path(native_peaks_path_beside(trace_path));
  std::error_code ec;
  if (!fs::is_regular_file(peaks_path, ec)) return std::nullopt;
  const std::string file = printable_name(peaks_path.string());
  const auto ignore = [&](const std::string& why) -> std::optional<native_reference> {
    if (warning != nullptr) *warning = "ignoring " + file + ": " + why;
    return std::nullopt;
  };
  errno = 0;
  std::ifstream in(peaks_path, std::ios::binary);
  if (!in.is_open()) return ignore(std::string("cannot open: ") + std::strerror(errno != 0 ? errno : EIO));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return ignore(std::string("cannot read: ") + std::strerror(errno != 0 ? errno : EIO));
  // nlohmann-json reads a NUL as the end of its input: what follows would
  // be ignored without a word. JSON text holds none.
  if (const std::size_t nul = text.find('\0'); nul != std::string::npos)
    return ignore("a NUL byte at byte " + std::to_string(nul) + " of " + std::to_string(text.size()) +
                  " (JSON text holds none; a JSON reader would stop there and ignore the rest)");
  const std::string name = trace_base_name(trace_file);
  peaks_parse parsed;
  try {
    parsed.parse(text, name);
  } catch (const json::exception& e) {
    // A syntax error names its line and column; a number too large for a
    // double (out_of_range 406) only itself: say the key before it.
    const std::string after_key = e.id == 406 && !parsed.last_key.empty()
                                      ? " (after the key '" + parsed.last_key + "')"
                                      : std::string();
    return ignore("not valid JSON: " + json_reason(e) + after_key);
  }
  if (parsed.too_deep)
    return ignore("nested more than " + std::to_string(max_native_peaks_depth) + " levels deep");
  const json& all = parsed.all;
  if (!all.is_object())
    return ignore("not a JSON object (its top level is a JSON " + std::string(all.type_name()) +
                  "; expected an object whose keys are trace names)");
  const auto it = all.find(name);
  if (it == all.end()) return std::nullopt;
  if (!parsed.duplicate_key.empty())
    return ignore(parsed.duplicate_at_top
                      ? "the entry '" + name + "' is written twice (which one holds the figures is unclear)"
                      : "in the entry '" + name + "', the key '" + printable_name(parsed.duplicate_key) +
                            "' is written twice in one object (which value is meant is unclear)");
  if (!it->is_object())
    return ignore("the entry '" + name + "' is a JSON " + std::string(it->type_name()) +
                  ", not an object of figures");
  for (const std::string_view key : figure_keys)
    if (const std::string why = figure_problem(*it, key); !why.empty())
      return ignore("in the entry '" + name + "', " + why);
  return figures_from(*it, peaks_path.string() + ", entry " + name);
}

std::optional<native_reference> embedded_native_reference() {
  const std::string_view peaks = embedded::default_trace_native_peaks_json();
  json entry = json::parse(peaks.begin(), peaks.end(), nullptr, /*allow_exceptions=*/false);
  if (!entry.is_object()) return std::nullopt;
  return figures_from(entry, "built-in figures for " + std::string(embedded::default_trace_name()));
}

}  // namespace ccalloc
