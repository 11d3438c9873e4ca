// native_reference.cpp: PyTorch's figures for a trace
// (include/ccalloc/replay/native_reference.hpp), read from native_peaks.json.
#include <ccalloc/replay/native_reference.hpp>

#include <ccalloc/replay/embedded.hpp>
#include <ccalloc/replay/trace.hpp>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string_view>
#include <system_error>
#include <utility>

namespace ccalloc {

namespace {

using json = nlohmann::ordered_json;  // keeps the entry's keys in their order

std::uint64_t json_u64(const json& object, const char* key) {
  const auto it = object.find(key);
  return it != object.end() && it->is_number_unsigned() ? it->get<std::uint64_t>() : 0;
}

native_reference figures_from(const json& entry, std::string origin) {
  native_reference f;
  f.origin = std::move(origin);
  f.entry_json = entry.dump();
  f.requested_peak = json_u64(entry, "requested_peak");
  f.reserved_peak = json_u64(entry, "native_reserved_peak");
  f.expandable_reserved_peak = json_u64(entry, "native_expandable_reserved_peak");
  f.allocated_peak = json_u64(entry, "native_allocated_peak");
  f.device_allocs = json_u64(entry, "native_device_allocs");
  f.min_capacity_bytes = json_u64(entry, "native_min_capacity_bytes");
  f.expandable_min_capacity_bytes = json_u64(entry, "native_expandable_min_capacity_bytes");
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

/// The deepest nesting of arrays and objects in JSON text `text`, brackets
/// inside strings not counted; stops counting past `limit`. A linear scan:
/// nlohmann's dump() recurses once per level, so text nested deeper than the
/// stack allows must be refused before it is parsed.
std::size_t json_nesting_depth(std::string_view text, std::size_t limit) {
  std::size_t depth = 0;
  std::size_t deepest = 0;
  bool in_string = false;
  bool escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > deepest) deepest = depth;
      if (deepest > limit) return deepest;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return deepest;
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
  std::ifstream in(peaks_path, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (json_nesting_depth(text, max_native_peaks_depth) > max_native_peaks_depth) {
    if (warning != nullptr)
      *warning = "ignoring " + printable_name(peaks_path.string()) + ": nested more than " +
                 std::to_string(max_native_peaks_depth) + " levels deep";
    return std::nullopt;
  }
  json all = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (all.is_discarded() || !all.is_object()) {
    if (warning != nullptr) *warning = "ignoring " + printable_name(peaks_path.string()) + ": not a JSON object";
    return std::nullopt;
  }
  const std::string name = trace_base_name(trace_file);
  const auto it = all.find(name);
  if (it == all.end() || !it->is_object()) return std::nullopt;
  return figures_from(*it, peaks_path.string() + ", entry " + name);
}

std::optional<native_reference> embedded_native_reference() {
  const std::string_view peaks = embedded::default_trace_native_peaks_json();
  json entry = json::parse(peaks.begin(), peaks.end(), nullptr, /*allow_exceptions=*/false);
  if (!entry.is_object()) return std::nullopt;
  return figures_from(entry, "built-in figures for " + std::string(embedded::default_trace_name()));
}

}  // namespace ccalloc
