// trace_reader.cpp: reading allocation traces (include/ccalloc/replay/trace.hpp).
//
// Pipeline: read_trace_file = read the whole file -> maybe_gunzip (zlib, when
// the bytes start with the gzip magic 1f 8b) -> sniff_trace_format ->
// parse_trace_text (this file), parse_rmm_log (rmm_reader.cpp) or
// convert_pytorch_snapshot (snapshot_reader.cpp).
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
// zlib is optional (CCALLOC_HAVE_ZLIB, set by CMake: a CCALLOC_MINIMAL build
// for the GPU checks has it only if the machine does): without it,
// maybe_gunzip refuses gzip data with a trace_error saying so.
#include <ccalloc/replay/trace.hpp>

#ifndef CCALLOC_HAVE_ZLIB
#define CCALLOC_HAVE_ZLIB 1
#endif
#if CCALLOC_HAVE_ZLIB
#include <zlib.h>
#endif

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
#include <utility>

namespace ccalloc {

namespace detail {
namespace {

/// Every action, indexed by its enumerator value (the order of trace_action).
constexpr std::array<std::string_view, 9> action_names = {
    "alloc",        "free_requested", "free_completed", "segment_alloc", "segment_free",
    "segment_map",  "segment_unmap",  "snapshot",       "oom",
};

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
std::size_t split_fields(std::string_view line, std::array<std::string_view, 5>& out) noexcept {
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
std::size_t count_lines(std::string_view text) noexcept {
  std::size_t lines = 0;
  const char* p = text.data();
  const char* const end = p + text.size();
  while (p != end) {
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
  while (index < action_names.size() && action != action_names[index]) ++index;
  if (index == action_names.size()) return nullptr;
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

/// The checking path for one line (without its '\n'): returns false for a
/// blank or comment line, true with `event` filled (not its line) for an
/// event line, and throws trace_error naming `source`:`line_number` and the
/// first thing wrong otherwise.
bool parse_line_checked(std::string_view line, const std::string& source, std::size_t line_number,
                        trace_event& event) {
  std::array<std::string_view, 5> fields;
  const std::size_t count = split_fields(line, fields);
  if (count == 0) return false;                // blank line
  if (fields[0].front() == '#') return false;  // comment
  if (count != 5) {
    throw trace_error(source, line_number,
                      "expected 5 fields (time_us action addr size stream), got " +
                          std::to_string(count));
  }
  event.time_us = parse_u64(fields[0], 0, source, line_number);
  event.action = parse_action(fields[1], source, line_number);
  event.addr = parse_u64(fields[2], 2, source, line_number);
  event.size = parse_u64(fields[3], 3, source, line_number);
  event.stream = parse_u64(fields[4], 4, source, line_number);
  return true;
}

#if CCALLOC_HAVE_ZLIB
/// Initial output buffer size for decompressing `data`: the ISIZE field of
/// the last gzip member (uncompressed size mod 2^32) when it is plausible for
/// a text trace (1x to 32x the compressed size), else 8x the compressed size.
/// The trailer of truncated or corrupt data is arbitrary bytes, hence the
/// plausibility bound (it would otherwise ask for up to 4 GiB up front).
std::size_t gzip_output_guess(std::string_view data) noexcept {
  constexpr std::size_t min_guess = 4096;
  constexpr std::size_t max_ratio = 32;
  const std::size_t fallback = std::max(min_guess, data.size() * 8);
  if (data.size() < 18) return min_guess;  // smaller than any gzip header + trailer
  const auto* tail = reinterpret_cast<const unsigned char*>(data.data() + data.size() - 4);
  const std::size_t isize = std::size_t{tail[0]} | std::size_t{tail[1]} << 8 |
                            std::size_t{tail[2]} << 16 | std::size_t{tail[3]} << 24;
  if (isize < data.size() || isize / max_ratio > data.size()) return fallback;
  return std::max(min_guess, isize + 64);  // + slack: a full buffer costs one more turn
}

/// Owns a zlib inflate stream; inflateEnd on destruction.
class inflater {
 public:
  explicit inflater(const std::string& source) : source_(source) {
    // 16 + MAX_WBITS: expect a gzip header and trailer (checks the CRC).
    if (inflateInit2(&stream_, 16 + MAX_WBITS) != Z_OK) {
      throw trace_error(source_, 0, "cannot start gzip decompression (zlib out of memory)");
    }
  }
  ~inflater() { inflateEnd(&stream_); }
  inflater(const inflater&) = delete;
  inflater& operator=(const inflater&) = delete;

  /// Decompresses all gzip members of `data` (concatenated members, as
  /// `cat a.gz b.gz` makes, decode to the concatenation of their contents).
  std::string run(std::string_view data) {
    std::string out;
    out.resize(gzip_output_guess(data));
    std::size_t produced = 0;
    const auto* in = reinterpret_cast<const unsigned char*>(data.data());
    std::size_t in_left = data.size();
    // zlib counts in uInt; feed and drain in chunks that fit.
    constexpr std::size_t max_chunk = std::numeric_limits<uInt>::max();
    while (true) {
      if (stream_.avail_in == 0 && in_left > 0) {
        const std::size_t chunk = std::min(in_left, max_chunk);
        stream_.next_in = const_cast<Bytef*>(in);  // zlib's API is not const-correct
        stream_.avail_in = static_cast<uInt>(chunk);
        in += chunk;
        in_left -= chunk;
      }
      if (produced == out.size()) out.resize(out.size() * 2);
      const std::size_t room = std::min(out.size() - produced, max_chunk);
      stream_.next_out = reinterpret_cast<Bytef*>(out.data() + produced);
      stream_.avail_out = static_cast<uInt>(room);
      const int rc = inflate(&stream_, Z_NO_FLUSH);
      produced += room - stream_.avail_out;
      if (rc == Z_STREAM_END) {
        // Another member may follow; anything else after the end is garbage.
        if (stream_.avail_in == 0 && in_left == 0) break;
        if (stream_.avail_in < 2 || stream_.next_in[0] != 0x1f || stream_.next_in[1] != 0x8b) {
          throw trace_error(source_, 0, "corrupt gzip data: trailing bytes after the gzip stream");
        }
        if (inflateReset(&stream_) != Z_OK) fail("inflateReset failed");
        continue;
      }
      if (rc == Z_BUF_ERROR) {
        // No progress possible: either more output room is needed (handled
        // by the resize above on the next turn) or the input ended early.
        if (stream_.avail_out != 0 && stream_.avail_in == 0 && in_left == 0) {
          throw trace_error(source_, 0, "corrupt gzip data: truncated (unexpected end of data)");
        }
        continue;
      }
      if (rc != Z_OK) fail(rc == Z_MEM_ERROR ? "out of memory" : nullptr);
      if (stream_.avail_in == 0 && in_left == 0 && stream_.avail_out != 0) {
        // All input consumed, output room left, but no stream end: truncated.
        throw trace_error(source_, 0, "corrupt gzip data: truncated (unexpected end of data)");
      }
    }
    out.resize(produced);
    return out;
  }

 private:
  [[noreturn]] void fail(const char* what) {
    std::string reason = "corrupt gzip data: ";
    reason += what ? what : (stream_.msg ? stream_.msg : "inflate failed");
    throw trace_error(source_, 0, reason);
  }

  const std::string& source_;
  z_stream stream_{};
};
#endif  // CCALLOC_HAVE_ZLIB

/// Closes a FILE* on scope exit.
struct file_closer {
  void operator()(std::FILE* f) const noexcept { std::fclose(f); }
};

}  // namespace
}  // namespace detail

std::string_view to_string(trace_action action) noexcept {
  const auto index = static_cast<std::size_t>(action);
  return index < detail::action_names.size() ? detail::action_names[index] : "unknown";
}

std::string maybe_gunzip(std::string_view data, const std::string& source) {
  const bool is_gzip = data.size() >= 2 && static_cast<unsigned char>(data[0]) == 0x1f &&
                       static_cast<unsigned char>(data[1]) == 0x8b;
  if (!is_gzip) return std::string(data);
#if CCALLOC_HAVE_ZLIB
  detail::inflater inflater(source);
  return inflater.run(data);
#else
  throw trace_error(source, 0,
                    "gzip-compressed, but this build of ccalloc has no zlib: decompress it first (gunzip -k)");
#endif
}

trace parse_trace_text(std::string_view text, const std::string& source) {
  trace result;
  result.source = source;
  // One event per line at most: reserving by the line count avoids regrowth.
  result.events.reserve(detail::count_lines(text));

  const char* const text_end = text.data() + text.size();
  std::uint64_t previous_time_us = 0;
  std::size_t line_number = 0;
  const char* p = text.data();
  while (p != text_end) {
    ++line_number;
    trace_event event;
    if (const char* next = detail::parse_line_fast(p, text_end, event)) [[likely]] {
      p = next;
    } else {
      // Not a plain event line: a blank line, a comment, or an error to name.
      const void* nl = std::memchr(p, '\n', static_cast<std::size_t>(text_end - p));
      const char* const line_end = nl ? static_cast<const char*>(nl) : text_end;
      const std::string_view line(p, static_cast<std::size_t>(line_end - p));
      p = nl ? line_end + 1 : text_end;
      if (!detail::parse_line_checked(line, source, line_number, event)) continue;
    }
    event.line = line_number;
    if (event.time_us < previous_time_us) [[unlikely]] {
      throw trace_error(source, line_number,
                        "time_us goes backwards (" + std::to_string(event.time_us) + " after " +
                            std::to_string(previous_time_us) + ")");
    }
    previous_time_us = event.time_us;
    result.events.push_back(event);
  }
  return result;
}

trace read_trace_file(const std::string& path) {
  errno = 0;
  const std::unique_ptr<std::FILE, detail::file_closer> file(std::fopen(path.c_str(), "rb"));
  if (!file) {
    throw trace_error(path, 0, std::string("cannot open: ") + std::strerror(errno));
  }
  std::string data;
  std::array<char, 1 << 16> buffer;
  while (true) {
    const std::size_t got = std::fread(buffer.data(), 1, buffer.size(), file.get());
    data.append(buffer.data(), got);
    if (got < buffer.size()) {
      if (std::ferror(file.get())) {
        throw trace_error(path, 0, std::string("cannot read: ") + std::strerror(errno));
      }
      break;
    }
  }
  const std::string text = maybe_gunzip(data, path);
  switch (sniff_trace_format(text)) {
    case trace_format::rmm_log: return parse_rmm_log(text, path);
    case trace_format::pytorch_snapshot: return convert_pytorch_snapshot(path);
    case trace_format::ccalloc: break;
  }
  return parse_trace_text(text, path);
}

}  // namespace ccalloc
