// trace_reader.cpp: ccalloc's own trace format (include/ccalloc/replay/trace.hpp):
// parse_trace_text. Files are opened, decompressed and routed to a reader by
// trace_file.cpp.
//
// The parser is one pass over the text with no per-line allocation. Each
// line first goes through a fast path (parse_line_fast: fused scanning and
// digit accumulation, no exceptions) that accepts only plain event lines; any
// other line (comment, blank, error, a 20-digit number) is re-read by the
// checking path (parse_line_checked: split on blanks, std::from_chars), which
// is the reference and produces every error message.
// Cost: about one pass over the decompressed text plus one over the gzip data;
// the 850k-line llama_generate trace (4.1 MB gzip, 44 MB text) reads in about
// 0.25 s (0.1 s inflate, 0.1 s parse) at -O2. Every error names the source and the 1-based line.
//
#include <ccalloc/replay/trace.hpp>

#include <ccalloc/core/tags.hpp>

#include "line_parsers.hpp"
#include "reader_limits.hpp"

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ccalloc {

namespace detail {
namespace {

/// Every action, indexed by its enumerator value (the order of trace_action).
constexpr std::array<std::string_view, 12> action_names = {
    "alloc",        "free_requested", "free_completed", "segment_alloc", "segment_free",
    "segment_map",  "segment_unmap",  "snapshot",       "oom",           "tag",
    "pause",        "resume",
};
/// The actions of five columns only (the fast path's); tag, pause and
/// resume add a tag name (and pause its keep/drop) after them.
constexpr std::size_t plain_action_count = 9;

/// "alloc, free_requested, ..., oom": what an unknown action message lists.
std::string accepted_actions() {
  std::string out;
  for (const std::string_view name : action_names) {
    if (!out.empty()) out += ", ";
    out += name;
  }
  return out;
}

/// The field separators of a trace line. '\r' is one so CRLF files read too.
constexpr bool is_blank(char c) noexcept {
  return c == ' ' || c == '\t' || c == '\r' || c == '\v' || c == '\f';
}

/// A printable excerpt of a field for messages: at most 40 characters.
std::string quote_field(std::string_view field) {
  constexpr std::size_t max_shown = 40;
  std::string out = "'";
  out.append(field.substr(0, max_shown));
  if (field.size() > max_shown) out += "...";
  out += "'";
  return out;
}

/// The five columns of a trace line, in file order.
constexpr std::array<std::string_view, 5> column_names = {"time_us", "action", "addr", "size",
                                                          "stream"};

/// Parses a decimal unsigned 64-bit field; throws trace_error naming the
/// column. Accepts only digits (no sign, no spaces, no hex).
std::uint64_t parse_u64(std::string_view field, std::size_t column, const std::string& source,
                        std::size_t line) {
  std::uint64_t value = 0;
  const char* const first = field.data();
  const char* const last = first + field.size();
  const auto [ptr, ec] = std::from_chars(first, last, value, 10);
  if (ec == std::errc{} && ptr == last) [[likely]] {
    return value;
  }
  const std::string head = "bad " + std::string(column_names[column]) + " " + quote_field(field);
  if (ec == std::errc::result_out_of_range && ptr == last) {
    throw trace_error(source, line,
                      head + ": out of range (largest accepted is " +
                          std::to_string(std::numeric_limits<std::uint64_t>::max()) + ")");
  }
  if (!field.empty() && field.front() == '-') {
    throw trace_error(source, line, head + ": not an unsigned integer (negative)");
  }
  throw trace_error(source, line, head + ": not an unsigned integer");
}

/// Maps an action name to its enumerator; throws trace_error when unknown.
trace_action parse_action(std::string_view field, const std::string& source, std::size_t line) {
  for (std::size_t i = 0; i < action_names.size(); ++i) {
    if (field == action_names[i]) return static_cast<trace_action>(i);
  }
  throw trace_error(source, line,
                    "unknown action " + quote_field(field) + " (accepted: " + accepted_actions() +
                        ")");
}

/// Splits `line` into at most `out.size()` blank-separated fields; returns the
/// total number of fields on the line (which may exceed out.size()).
std::size_t split_fields(std::string_view line, std::array<std::string_view, 7>& out) noexcept {
  std::size_t count = 0;
  std::size_t i = 0;
  const std::size_t n = line.size();
  while (true) {
    while (i < n && is_blank(line[i])) ++i;
    if (i == n) break;
    const std::size_t start = i;
    while (i < n && !is_blank(line[i])) ++i;
    if (count < out.size()) out[count] = line.substr(start, i - start);
    ++count;
  }
  return count;
}

/// Number of lines in `text` (a last line without '\n' counts). memchr per
/// line: several times faster than std::count at -O2, which GCC does not
/// vectorize.
/// The number of lines of `text`, counting up to `most` (then `most`).
std::size_t count_lines(std::string_view text, std::size_t most) noexcept {
  std::size_t lines = 0;
  const char* p = text.data();
  const char* const end = p + text.size();
  while (p != end && lines < most) {
    ++lines;
    const void* nl = std::memchr(p, '\n', static_cast<std::size_t>(end - p));
    if (!nl) break;
    p = static_cast<const char*>(nl) + 1;
  }
  return lines;
}

/// Reads the decimal digits at `p` into `value` and advances `p` past them.
/// Succeeds only for 1 to 19 digits followed by a blank, '\n' or the end
/// (19 digits cannot overflow 64 bits; a 20-digit value takes the checked path).
inline bool read_u64_fast(const char*& p, const char* end, std::uint64_t& value) noexcept {
  constexpr std::ptrdiff_t max_fast_digits = 19;
  const char* const first = p;
  std::uint64_t v = 0;
  while (p != end) {
    const unsigned digit = static_cast<unsigned char>(*p) - unsigned{'0'};
    if (digit > 9) break;
    v = v * 10 + digit;
    ++p;
  }
  const std::ptrdiff_t digits = p - first;
  if (digits == 0 || digits > max_fast_digits) return false;
  if (p != end && *p != '\n' && !is_blank(*p)) return false;
  value = v;
  return true;
}

inline void skip_blanks(const char*& p, const char* end) noexcept {
  while (p != end && is_blank(*p)) ++p;
}

/// Fast path for a well-formed event line starting at `p` ("T action A S ST",
/// blank-separated, ending at '\n' or `end`): fills `event` (not its line)
/// and returns where the next line starts. Returns nullptr for anything else
/// (blank line, comment, any malformed or unusual field) without throwing;
/// the caller then re-reads the line with parse_line_checked, which is
/// authoritative. Contract: whenever this succeeds, parse_line_checked would
/// produce the same event.
inline const char* parse_line_fast(const char* p, const char* end, trace_event& event) noexcept {
  skip_blanks(p, end);
  if (!read_u64_fast(p, end, event.time_us)) return nullptr;
  skip_blanks(p, end);
  const char* const action_begin = p;
  while (p != end && *p != '\n' && !is_blank(*p)) ++p;
  const std::string_view action(action_begin, static_cast<std::size_t>(p - action_begin));
  std::size_t index = 0;
  while (index < plain_action_count && action != action_names[index]) ++index;
  if (index == plain_action_count) return nullptr;
  event.action = static_cast<trace_action>(index);
  skip_blanks(p, end);
  if (!read_u64_fast(p, end, event.addr)) return nullptr;
  skip_blanks(p, end);
  if (!read_u64_fast(p, end, event.size)) return nullptr;
  skip_blanks(p, end);
  if (!read_u64_fast(p, end, event.stream)) return nullptr;
  skip_blanks(p, end);
  if (p == end) return p;
  if (*p != '\n') return nullptr;  // a sixth field
  return p + 1;
}

/// "size and stream are missing": the columns from `count` on.
std::string missing_columns(std::size_t count) {
  std::string out;
  for (std::size_t c = count; c < column_names.size(); ++c) {
    if (c != count) out += c + 1 == column_names.size() ? " and " : ", ";
    out += column_names[c];
  }
  return out + (column_names.size() - count == 1 ? " is missing" : " are missing");
}

/// The checking path for one line (without its '\n'): returns false for a
/// blank or comment line, true with `event` filled (not its line) for an
/// event line, and throws trace_error naming `source`:`line_number` and the
/// first thing wrong otherwise. `unterminated`: the line is the text's last
/// and has no '\n' (a short one then says the text may be truncated).
/// The names of a trace's tags (trace::tags) with a hash index of them, so
/// that a trace naming tens of thousands of tags reads in linear time.
struct tag_table {
  std::vector<std::string>* names = nullptr;
  std::unordered_map<std::string, std::uint16_t> ids;  // name -> trace_event::tag
};

/// The index (trace_event::tag) of the tag named `name` in `tags`, added
/// on first use; 0 for "default". Throws trace_error for a name that is no
/// tag name (tags.hpp: 1 to 64 of letters, digits and "_-.:/").
std::uint16_t tag_index(std::string_view name, tag_table& tags, const std::string& source, std::size_t line) {
  if (name == "default") return 0;
  if (!is_tag_name(name))
    throw trace_error(source, line,
                      "bad tag " + quote_field(name) +
                          ": a tag name is 1 to 64 ASCII letters, digits and the characters _-.:/");
  std::string key(name);
  if (const auto it = tags.ids.find(key); it != tags.ids.end()) return it->second;
  if (tags.names->size() >= std::numeric_limits<std::uint16_t>::max())
    throw trace_error(source, line, "more than 65535 distinct tags");
  tags.names->push_back(key);
  const auto id = static_cast<std::uint16_t>(tags.names->size());
  tags.ids.emplace(std::move(key), id);
  return id;
}

/// The sixth and seventh columns of tag, pause and resume lines (`fields`
/// holds `count` of them): the tag's name, and for pause `keep` or `drop`.
void parse_tag_columns(const std::array<std::string_view, 7>& fields, std::size_t count,
                       tag_table& tags, const std::string& source, std::size_t line, trace_event& event) {
  const bool is_pause = event.action == trace_action::pause;
  const std::size_t expected = is_pause ? 7 : 6;
  if (count != expected)
    throw trace_error(source, line,
                      std::string(action_names[static_cast<std::size_t>(event.action)]) + " needs " +
                          (is_pause ? "7 fields (time_us pause addr size stream tag keep|drop)"
                                    : "6 fields (time_us action addr size stream tag)") +
                          ", got " + std::to_string(count));
  // The columns these lines leave unused hold 0 (trace_writer writes 0):
  // any other value is a line written by hand or mixed up, refused rather
  // than ignored.
  const std::string_view name = action_names[static_cast<std::size_t>(event.action)];
  const auto unused = [&](std::size_t column, std::uint64_t value) {
    if (value != 0)
      throw trace_error(source, line,
                        "bad " + std::string(column_names[column]) + " " + quote_field(fields[column]) + ": a " +
                            std::string(name) + " line has " +
                            (event.action == trace_action::tag ? "addr, size and stream 0 (unused)"
                                                               : "addr and stream 0 (unused; size holds its bytes)"));
  };
  unused(2, event.addr);
  if (event.action == trace_action::tag) unused(3, event.size);
  unused(4, event.stream);
  event.tag = tag_index(fields[5], tags, source, line);
  if (is_pause) {
    if (fields[6] != "keep" && fields[6] != "drop")
      throw trace_error(source, line, "bad keep|drop " + quote_field(fields[6]) + ": pause ends with keep or drop");
    event.keep_contents = fields[6] == "keep";
  }
}

bool parse_line_checked(std::string_view line, const std::string& source, std::size_t line_number,
                        bool unterminated, trace_event& event, tag_table& tags) {
  std::array<std::string_view, 7> fields;
  const std::size_t count = split_fields(line, fields);
  if (count == 0) return false;                // blank line
  if (fields[0].front() == '#') return false;  // comment
  if (count >= 2 && std::find(action_names.begin() + plain_action_count, action_names.end(), fields[1]) !=
                        action_names.end()) {
    {
      event.action = parse_action(fields[1], source, line_number);
      if (count >= 5) {
        event.time_us = parse_u64(fields[0], 0, source, line_number);
        event.addr = parse_u64(fields[2], 2, source, line_number);
        event.size = parse_u64(fields[3], 3, source, line_number);
        event.stream = parse_u64(fields[4], 4, source, line_number);
      }
      parse_tag_columns(fields, count, tags, source, line_number, event);
      return true;
    }
  }
  if (count != 5) {
    std::string why = "expected 5 fields (time_us action addr size stream), got " + std::to_string(count);
    if (count < 5) {
      why += ": " + missing_columns(count);
      if (unterminated) why += " (the last line, with no newline after it: is the trace cut short?)";
    }
    throw trace_error(source, line_number, why);
  }
  event.time_us = parse_u64(fields[0], 0, source, line_number);
  event.action = parse_action(fields[1], source, line_number);
  event.addr = parse_u64(fields[2], 2, source, line_number);
  event.size = parse_u64(fields[3], 3, source, line_number);
  event.stream = parse_u64(fields[4], 4, source, line_number);
  return true;
}


}  // namespace
}  // namespace detail

std::string_view to_string(trace_action action) noexcept {
  const auto index = static_cast<std::size_t>(action);
  return index < detail::action_names.size() ? detail::action_names[index] : "unknown";
}

namespace detail {
namespace {

class trace_text_parser final : public line_parser {
 public:
  trace_text_parser(const std::string& source, const trace_limits& limits) : source_(source), limits_(limits) {
    result_.source = source;
    tags_.names = &result_.tags;
  }

  void feed(std::string_view text) override {
    if (first_) {
      first_ = false;
      if (std::string why = not_text_reason(text); !why.empty()) throw trace_error(source_, 0, why);
      // One event per line at most: reserving by the first block's line count
      // avoids most regrowth (up to a million events: text of empty lines
      // must not reserve memory).
      result_.events.reserve(count_lines(
          text, static_cast<std::size_t>(std::min<std::uint64_t>(limits_.max_events, std::uint64_t{1} << 20))));
    }
    const char* const text_end = text.data() + text.size();
    const char* p = text.data();
    while (p != text_end) {
      ++line_number_;
      if (*p == '\n') {  // a blank line (a run of them must not cost a full parse each)
        ++p;
        continue;
      }
      trace_event event;
      if (const char* next = parse_line_fast(p, text_end, event)) [[likely]] {
        // The fast path skips blanks around the fields: a line padded with
        // them is held to the limit too (its length without the '\n').
        if (static_cast<std::size_t>(next - p) - (next[-1] == '\n' ? 1 : 0) > limits_.max_line_bytes) [[unlikely]]
          throw trace_error(source_, line_number_, line_limit_reason(limits_.max_line_bytes));
        p = next;
      } else {
        // Not a plain event line: a blank line, a comment, or an error to name.
        const void* nl = std::memchr(p, '\n', static_cast<std::size_t>(text_end - p));
        const char* const line_end = nl ? static_cast<const char*>(nl) : text_end;
        const std::string_view line(p, static_cast<std::size_t>(line_end - p));
        p = nl ? line_end + 1 : text_end;
        if (line.size() > limits_.max_line_bytes) [[unlikely]]
          throw trace_error(source_, line_number_, line_limit_reason(limits_.max_line_bytes));
        if (!parse_line_checked(line, source_, line_number_, nl == nullptr, event, tags_)) continue;
      }
      event.line = line_number_;
      if (event.time_us < previous_time_us_) [[unlikely]] {
        throw trace_error(source_, line_number_,
                          "time_us goes backwards (" + std::to_string(event.time_us) + " after " +
                              std::to_string(previous_time_us_) + ")");
      }
      previous_time_us_ = event.time_us;
      if (result_.events.size() >= limits_.max_events) [[unlikely]]
        throw trace_error(source_, line_number_, event_limit_reason(limits_.max_events));
      result_.events.push_back(event);
    }
  }

  [[nodiscard]] std::size_t lines() const noexcept override { return line_number_; }

  [[nodiscard]] trace finish() override {
    if (first_) feed({});
    return std::move(result_);
  }

 private:
  const std::string& source_;
  trace_limits limits_;
  trace result_;
  tag_table tags_;  // names in result_.tags
  std::uint64_t previous_time_us_ = 0;
  std::size_t line_number_ = 0;
  bool first_ = true;
};

}  // namespace

std::unique_ptr<line_parser> make_trace_text_parser(const std::string& source, const trace_limits& limits) {
  return std::make_unique<trace_text_parser>(source, limits);
}

}  // namespace detail

trace parse_trace_text(std::string_view text, const std::string& source, const trace_limits& limits) {
  return detail::parse_whole(*detail::make_trace_text_parser(source, limits), text);
}


}  // namespace ccalloc
