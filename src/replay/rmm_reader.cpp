// rmm_reader.cpp: RMM logging_resource_adaptor CSV logs as traces
// (parse_rmm_log in include/ccalloc/replay/trace.hpp).
//
// RMM writes one row per call, after a header line:
//
//     Thread,Time,Action,Pointer,Size,Stream
//     140573312345856,14:03:21.123456,allocate,0x7f8a40000000,1024,0x5581c0a0
//     140573312345856,14:03:21.223456,free,0x7f8a40000000,1024,0x5581c0a0
//
// (the thread id, the time of day, "allocate" / "free" / "allocate failure",
// the pointer as %p, the size in bytes, the stream as a hex pointer).
// Columns are found by their names in the header, in any order; Thread and
// columns of other names are not read.
#include <ccalloc/replay/trace.hpp>

#include "line_parsers.hpp"
#include "reader_limits.hpp"

#include <algorithm>
#include <array>
#include <charconv>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ccalloc {

namespace {

constexpr std::uint64_t us_per_second = 1000000;
constexpr std::uint64_t us_per_day = 86400 * us_per_second;
/// The most a row's Time may be before the latest Time of the rows above
/// it (1 s, as for a PyTorch snapshot's entries): threads take the time
/// before they take the log's lock, so rows of two threads may come out of
/// order by a preemption. More comes from no such race: rows out of order,
/// or two logs merged.
constexpr std::uint64_t max_time_step_back_us = us_per_second;

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

std::vector<std::string_view> split_commas(std::string_view line) {
  std::vector<std::string_view> out;
  std::size_t start = 0;
  while (true) {
    const std::size_t comma = line.find(',', start);
    out.push_back(trim(line.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start)));
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return out;
}

std::string quoted(std::string_view field) {
  return "'" + std::string(field.substr(0, 40)) + (field.size() > 40 ? "...'" : "'");
}

/// Parses the whole of `field` as an unsigned number in `base`; false if not.
bool parse_number(std::string_view field, int base, std::uint64_t& value) {
  if (field.empty()) return false;
  const auto [ptr, ec] = std::from_chars(field.data(), field.data() + field.size(), value, base);
  return ec == std::errc{} && ptr == field.data() + field.size();
}

/// A pointer or stream as RMM prints it: 0x-prefixed hex, bare hex, "(nil)" or "0".
bool parse_hex(std::string_view field, std::uint64_t& value) {
  if (field == "(nil)" || field == "nullptr") {
    value = 0;
    return true;
  }
  if (field.size() > 2 && field[0] == '0' && (field[1] == 'x' || field[1] == 'X')) field.remove_prefix(2);
  return parse_number(field, 16, value);
}

/// Microseconds from "HH:MM:SS[.ffffff]" (time of day) or "SECONDS[.ffffff]"
/// (since the epoch). False if neither.
bool parse_time(std::string_view field, std::uint64_t& time_us) {
  std::string_view whole = field, fraction;
  if (const std::size_t dot = field.find('.'); dot != std::string_view::npos) {
    whole = field.substr(0, dot);
    fraction = field.substr(dot + 1);
  }
  std::uint64_t frac_us = 0;
  if (!fraction.empty()) {
    std::uint64_t digits = 0;
    if (!parse_number(fraction, 10, digits)) return false;
    // Scale any number of fraction digits to microseconds.
    std::size_t n = fraction.size();
    frac_us = digits;
    for (; n < 6; ++n) frac_us *= 10;
    for (; n > 6; --n) frac_us /= 10;
  }
  std::uint64_t seconds = 0;
  if (whole.find(':') == std::string_view::npos) {
    if (!parse_number(whole, 10, seconds) || seconds > UINT64_MAX / us_per_second - 1) return false;
  } else {
    std::array<std::uint64_t, 3> hms{};
    std::size_t part = 0, start = 0;
    while (true) {
      const std::size_t colon = whole.find(':', start);
      const std::string_view piece = whole.substr(start, colon == std::string_view::npos ? colon : colon - start);
      if (part == 3 || !parse_number(piece, 10, hms[part])) return false;
      ++part;
      if (colon == std::string_view::npos) break;
      start = colon + 1;
    }
    if (part != 3 || hms[0] > 23 || hms[1] > 59 || hms[2] > 60) return false;
    seconds = (hms[0] * 60 + hms[1]) * 60 + hms[2];
  }
  time_us = seconds * us_per_second + frac_us;
  return true;
}

enum class rmm_action { allocate, free, allocate_failure };

}  // namespace

namespace detail {
namespace {

class rmm_log_parser final : public line_parser {
 public:
  rmm_log_parser(const std::string& source, const trace_limits& limits) : source_(source), limits_(limits) {
    t_.source = source;
  }

  void feed(std::string_view text) override {
    std::size_t pos = 0;
    if (line_number_ == 0 && text.substr(0, 3) == "\xEF\xBB\xBF") pos = 3;  // a UTF-8 byte-order mark
    while (pos < text.size()) {
      const std::size_t nl = text.find('\n', pos);
      const std::string_view line = text.substr(pos, nl == std::string_view::npos ? nl : nl - pos);
      pos = nl == std::string_view::npos ? text.size() : nl + 1;
      ++line_number_;
      // The limit holds for the line as written, blanks around it included.
      if (line.size() > limits_.max_line_bytes)
        throw trace_error(source_, line_number_, detail::line_limit_reason(limits_.max_line_bytes));
      read_line(trim(line));
    }
  }

  [[nodiscard]] std::size_t lines() const noexcept override { return line_number_; }

  [[nodiscard]] trace finish() override;

 private:
  /// One line of the log after the header, its fields parsed.
  struct record {
    rmm_action action = rmm_action::allocate;
    std::uint64_t raw_us = 0;        // Time as written (a time of day or since the epoch)
    std::uint64_t pointer = 0, size = 0, stream = 0;
    bool time_of_day = false;        // Time is HH:MM:SS.ffffff
    std::string_view pointer_text;   // Pointer as written, for messages
  };

  void read_line(std::string_view line);
  void read_header(const std::vector<std::string_view>& fields);
  [[nodiscard]] record parse_record(const std::vector<std::string_view>& fields) const;
  /// The record's time on the trace's clock: midnight crossings added, never
  /// going back (a step back of up to max_time_step_back_us takes the time of
  /// the row before it, counted in a note; more is an error).
  [[nodiscard]] std::uint64_t next_time_us(const record& r, std::string_view time_f);
  void add_allocate(trace_event e, std::string_view pointer_f);
  void add_free(trace_event e, std::string_view pointer_f);
  /// A free of a pointer not live: a double free, or one allocated before the log started.
  void count_unmatched_free(std::uint64_t pointer, std::string_view pointer_f);

  /// The columns the reader needs (RMM also writes Thread, which it does not).
  static constexpr std::array<std::string_view, 5> columns = {"Time", "Action", "Pointer", "Size", "Stream"};
  const std::string& source_;
  trace_limits limits_;
  trace t_;
  std::array<std::size_t, 5> index_{};  // column position of each of `columns`
  std::size_t header_fields_ = 0;
  bool have_header_ = false;

  struct allocation {
    std::size_t line;       // of its allocate
    std::uint64_t size;     // bytes
    std::uint64_t stream;   // its Stream
  };
  std::unordered_map<std::uint64_t, allocation> live_;    // pointer -> its allocate
  std::unordered_map<std::uint64_t, std::size_t> freed_;  // pointer -> line of its last free (not allocated since)
  std::uint64_t skipped_frees_ = 0;
  std::unordered_map<std::uint64_t, std::uint64_t> zero_live_;  // pointer -> its 0-byte allocates not yet freed
  std::uint64_t zero_allocates_ = 0, zero_frees_ = 0;  // with a non-null Pointer; their frees
  std::size_t first_zero_line_ = 0;
  std::uint64_t double_frees_ = 0;
  std::size_t first_double_free_line_ = 0, first_double_free_earlier_line_ = 0;
  std::string first_double_free_pointer_;
  std::uint64_t last_time_us_ = 0;
  std::uint64_t day_offset_us_ = 0;
  std::uint64_t previous_raw_us_ = 0;
  bool time_of_day_ = false;
  std::uint64_t steps_back_ = 0;           // rows whose Time was before the latest above them
  std::uint64_t largest_step_back_us_ = 0;
  std::size_t first_step_back_line_ = 0;
  std::uint64_t frees_on_other_streams_ = 0;  // frees whose Stream is not their allocate's
  std::size_t first_other_stream_line_ = 0;
  std::size_t line_number_ = 0;
};

void rmm_log_parser::read_line(std::string_view line) {
  if (t_.events.size() + 2 > limits_.max_events) throw trace_error(source_, line_number_, detail::event_limit_reason(limits_.max_events));
  if (line.empty()) return;
  const std::vector<std::string_view> f = split_commas(line);
  if (!have_header_) {
    read_header(f);
    return;
  }
  const record r = parse_record(f);
  trace_event e;
  e.time_us = next_time_us(r, f[index_[0]]);
  e.addr = r.pointer;
  e.size = r.size;
  e.stream = r.stream;
  e.line = line_number_;
  switch (r.action) {
    case rmm_action::allocate: add_allocate(e, r.pointer_text); break;
    case rmm_action::free: add_free(e, r.pointer_text); break;
    case rmm_action::allocate_failure:
      // RMM logs a failure with a null Pointer: another is a row mixed up.
      if (e.addr != 0)
        throw trace_error(source_, line_number_,
                          "bad Pointer " + quoted(r.pointer_text) +
                              ": an allocate failure has a null Pointer (RMM writes 0, 0x0 or (nil))");
      e.action = trace_action::oom;
      t_.events.push_back(e);
      break;
  }
}

void rmm_log_parser::read_header(const std::vector<std::string_view>& f) {
  for (std::size_t c = 0; c < columns.size(); ++c) {
    std::size_t at = 0;
    while (at < f.size() && f[at] != columns[c]) ++at;
    if (at == f.size())
      throw trace_error(source_, line_number_,
                        "RMM log header lacks the column '" + std::string(columns[c]) +
                            "' (the replay needs Time, Action, Pointer, Size and Stream; RMM writes "
                            "Thread,Time,Action,Pointer,Size,Stream)");
    if (std::find(f.begin() + static_cast<std::ptrdiff_t>(at) + 1, f.end(), columns[c]) != f.end())
      throw trace_error(source_, line_number_,
                        "RMM log header names the column '" + std::string(columns[c]) +
                            "' twice (which one holds the values is unclear)");
    index_[c] = at;
  }
  header_fields_ = f.size();
  have_header_ = true;
}

rmm_log_parser::record rmm_log_parser::parse_record(const std::vector<std::string_view>& f) const {
  if (f.size() != header_fields_)
    throw trace_error(source_, line_number_,
                      "expected " + std::to_string(header_fields_) + " comma-separated fields as in the header, got " +
                          std::to_string(f.size()));
  const std::string_view time_f = f[index_[0]], action_f = f[index_[1]], pointer_f = f[index_[2]],
                         size_f = f[index_[3]], stream_f = f[index_[4]];
  record r;
  if (action_f == "allocate") r.action = rmm_action::allocate;
  else if (action_f == "free" || action_f == "deallocate") r.action = rmm_action::free;
  else if (action_f == "allocate failure") r.action = rmm_action::allocate_failure;
  else
    throw trace_error(source_, line_number_,
                      "unknown Action " + quoted(action_f) + " (accepted: allocate, free, allocate failure)");
  if (!parse_time(time_f, r.raw_us))
    throw trace_error(source_, line_number_,
                      "bad Time " + quoted(time_f) + " (expected HH:MM:SS.ffffff or seconds since the epoch)");
  if (!parse_hex(pointer_f, r.pointer))
    throw trace_error(source_, line_number_, "bad Pointer " + quoted(pointer_f) + " (expected hex, e.g. 0x7f8a40000000)");
  if (!parse_number(size_f, 10, r.size))
    throw trace_error(source_, line_number_, "bad Size " + quoted(size_f) + " (expected a decimal byte count)");
  if (!parse_hex(stream_f, r.stream))
    throw trace_error(source_, line_number_, "bad Stream " + quoted(stream_f) + " (expected hex, e.g. 0x5581c0a0)");
  r.time_of_day = time_f.find(':') != std::string_view::npos;
  r.pointer_text = pointer_f;
  return r;
}

std::uint64_t rmm_log_parser::next_time_us(const record& r, std::string_view time_f) {
  // A time of day that jumps back by more than 12 hours crossed midnight; a
  // smaller step back is threads logging out of order.
  if (t_.events.empty() && live_.empty()) time_of_day_ = r.time_of_day;
  if (time_of_day_ && r.raw_us + us_per_day / 2 < previous_raw_us_) day_offset_us_ += us_per_day;
  previous_raw_us_ = r.raw_us;
  const std::uint64_t time = r.raw_us + day_offset_us_;
  if (time < last_time_us_) {
    const std::uint64_t back = last_time_us_ - time;
    if (back > max_time_step_back_us)
      throw trace_error(source_, line_number_,
                        "Time " + quoted(time_f) + " is " + std::to_string(back) +
                            " us before the latest Time above it, more than the " +
                            std::to_string(max_time_step_back_us) +
                            " us threads logging out of order account for: the rows are out of order, or two "
                            "logs are merged");
    if (steps_back_++ == 0) first_step_back_line_ = line_number_;
    largest_step_back_us_ = std::max(largest_step_back_us_, back);
  }
  last_time_us_ = std::max(last_time_us_, time);
  return last_time_us_;
}

void rmm_log_parser::add_allocate(trace_event e, std::string_view pointer_f) {
  if (e.size == 0) {
    // 0 bytes: nothing to replay. RMM's resources return nullptr, others a
    // pointer of their own (maybe one they return again, or one inside a
    // live allocation); its free (Size 0) is legitimate and skipped with
    // it, both counted in a note.
    if (e.addr != 0) {
      ++zero_live_[e.addr];
      if (zero_allocates_++ == 0) first_zero_line_ = line_number_;
    }
    return;
  }
  if (e.addr == 0)
    throw trace_error(source_, line_number_, "allocate of " + std::to_string(e.size) + " bytes returned a null Pointer");
  freed_.erase(e.addr);
  const auto [it, fresh] = live_.try_emplace(e.addr, allocation{line_number_, e.size, e.stream});
  if (!fresh)
    throw trace_error(source_, line_number_,
                      "allocate at Pointer " + std::string(pointer_f) + ", which is still live (allocated at line " +
                          std::to_string(it->second.line) + ")");
  e.action = trace_action::alloc;
  t_.events.push_back(e);
}

void rmm_log_parser::add_free(trace_event e, std::string_view pointer_f) {
  if (e.size == 0) {  // the free of a 0-byte allocate (RMM passes the allocation's Size)
    if (const auto z = zero_live_.find(e.addr); z != zero_live_.end()) {
      if (--z->second == 0) zero_live_.erase(z);
      ++zero_frees_;
      if (live_.count(e.addr) == 0) freed_[e.addr] = line_number_;
      return;
    }
  }
  const auto it = live_.find(e.addr);
  if (it == live_.end()) {
    count_unmatched_free(e.addr, pointer_f);
    return;
  }
  // RMM's deallocate takes the size of the allocation: another size is a corrupt log.
  if (it->second.size != e.size)
    throw trace_error(source_, line_number_,
                      "free of Pointer " + std::string(pointer_f.substr(0, 40)) + " with Size " +
                          std::to_string(e.size) + ", but its allocate (line " + std::to_string(it->second.line) +
                          ") has Size " + std::to_string(it->second.size));
  // A free on another stream than its allocate (RMM allows it: the memory
  // is reusable in that stream's order) is replayed on the allocation's
  // stream, as ccalloc's trace format records a free, and counted in a note.
  if (e.stream != it->second.stream) {
    if (frees_on_other_streams_++ == 0) first_other_stream_line_ = line_number_;
    e.stream = it->second.stream;
  }
  live_.erase(it);
  freed_[e.addr] = line_number_;
  e.action = trace_action::free_requested;
  t_.events.push_back(e);
  e.action = trace_action::free_completed;
  t_.events.push_back(e);
}

void rmm_log_parser::count_unmatched_free(std::uint64_t pointer, std::string_view pointer_f) {
  if (const auto before = freed_.find(pointer); before != freed_.end()) {
    if (double_frees_++ == 0) {
      first_double_free_line_ = line_number_;
      first_double_free_earlier_line_ = before->second;
      first_double_free_pointer_ = std::string(pointer_f.substr(0, 40));
    }
  } else if (pointer != 0) {
    ++skipped_frees_;
  }
}

trace rmm_log_parser::finish() {
  if (!have_header_) throw trace_error(source_, 0, "empty RMM log: no header line");
  if (skipped_frees_ > 0)
    t_.notes.push_back(std::to_string(skipped_frees_) +
                      " free(s) of pointers the log never allocated were skipped (the log started after them)");
  if (zero_allocates_ > 0)
    t_.notes.push_back(std::to_string(zero_allocates_) + " allocate(s) of 0 bytes (the first: line " +
                       std::to_string(first_zero_line_) + ") and " + std::to_string(zero_frees_) +
                       " free(s) of them were skipped: 0 bytes hold no memory to replay");
  if (steps_back_ > 0)
    t_.notes.push_back("Time steps back at " + std::to_string(steps_back_) + " row(s) (the first: line " +
                       std::to_string(first_step_back_line_) + "; at most " + std::to_string(largest_step_back_us_) +
                       " us, threads logging out of order): each takes the latest Time above it");
  if (frees_on_other_streams_ > 0)
    t_.notes.push_back(std::to_string(frees_on_other_streams_) +
                       " free(s) on another Stream than their allocate's (the first: line " +
                       std::to_string(first_other_stream_line_) + ") are replayed on the allocation's stream");
  if (double_frees_ > 0)
    t_.notes.push_back(std::to_string(double_frees_) + " double free(s) were skipped: pointers freed again without " +
                      "an allocate between (the first: line " + std::to_string(first_double_free_line_) + " frees " +
                      first_double_free_pointer_ + ", already freed at line " +
                      std::to_string(first_double_free_earlier_line_) + ")");
  return std::move(t_);
}


}  // namespace

std::unique_ptr<line_parser> make_rmm_log_parser(const std::string& source, const trace_limits& limits) {
  return std::make_unique<rmm_log_parser>(source, limits);
}

}  // namespace detail

trace parse_rmm_log(std::string_view text, const std::string& source, const trace_limits& limits) {
  return detail::parse_whole(*detail::make_rmm_log_parser(source, limits), text);
}

}  // namespace ccalloc
