// trace_file.cpp: reading a trace file (include/ccalloc/replay/trace.hpp),
// above the three readers.
//
// Pipeline: read_trace_file = a PyTorch snapshot file goes to
// convert_pytorch_snapshot (snapshot_reader.cpp, read as a stream); any
// other file is read a block at a time (text_source: plain, or gzip through
// zlib when the bytes start with the gzip magic 1f 8b, counting the bytes
// against trace_limits::max_input_bytes as they come), its first block tells
// the format (sniff_trace_format), and whole lines go to one reader
// (line_parsers.hpp): ccalloc's format (trace_reader.cpp) or an RMM log
// (rmm_reader.cpp). Memory: one 1 MiB block, one partial line (at most
// max_line_bytes) and the events; never the whole file or text. maybe_gunzip
// decompresses data in memory with the same inflater. The readers never call
// back up here.
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
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "line_parsers.hpp"
#include "reader_limits.hpp"

namespace ccalloc {

std::string_view to_string(trace_format format) noexcept {
  switch (format) {
    case trace_format::rmm_log: return "RMM log";
    case trace_format::pytorch_snapshot: return "PyTorch snapshot";
    case trace_format::ccalloc: break;
  }
  return "ccalloc trace";
}

namespace {
/// Whether `line` is a header of comma-separated column names that names at
/// least one of RMM's columns: an event line of ccalloc's format has no
/// comma (its fields are blank-separated) and a comment starts with '#', so
/// such a line is an RMM log's header, in whatever order its columns come;
/// the RMM reader then names a needed column it lacks.
bool names_rmm_columns(std::string_view line) noexcept {
  if (line.starts_with('#') || line.find(',') == std::string_view::npos) return false;
  constexpr std::string_view names[] = {"Thread", "Time", "Action", "Pointer", "Size", "Stream"};
  const auto blank = [](char c) { return c == ' ' || c == '\t' || c == '\r'; };
  while (true) {
    const std::size_t comma = line.find(',');
    std::string_view field = line.substr(0, comma);
    while (!field.empty() && blank(field.front())) field.remove_prefix(1);
    while (!field.empty() && blank(field.back())) field.remove_suffix(1);
    for (const std::string_view name : names)
      if (field == name) return true;
    if (comma == std::string_view::npos) return false;
    line.remove_prefix(comma + 1);
  }
}
}  // namespace

trace_format sniff_trace_format(std::string_view data) noexcept {
  if (data.size() >= 2 && static_cast<unsigned char>(data[0]) == 0x80 && data[1] >= 2 && data[1] <= 5)
    return trace_format::pytorch_snapshot;
  std::size_t i = data.substr(0, 3) == "\xEF\xBB\xBF" ? 3 : 0;
  while (i < data.size() && (data[i] == ' ' || data[i] == '\t' || data[i] == '\r' || data[i] == '\n')) ++i;
  const std::size_t end = data.find('\n', i);
  if (names_rmm_columns(data.substr(i, end == std::string_view::npos ? std::string_view::npos : end - i)))
    return trace_format::rmm_log;
  return trace_format::ccalloc;
}

namespace detail {
namespace {

#if CCALLOC_HAVE_ZLIB
/// A zlib inflate stream over gzip data pulled from `read_raw`: decompresses
/// all gzip members (concatenated members, as `cat a.gz b.gz` makes, decode
/// to the concatenation of their contents) a buffer at a time, counting the
/// bytes it produces against `max_bytes`: memory stays at its buffers
/// (64 KiB of input, zlib's 32 KiB window) whatever the data expands to.
class inflater {
 public:
  /// Fills `buffer` with up to `size` bytes of gzip data; 0 at the end.
  using read_fn = std::function<std::size_t(char* buffer, std::size_t size)>;

  inflater(const std::string& source, std::uint64_t max_bytes, read_fn read_raw)
      : source_(source), max_bytes_(max_bytes), read_raw_(std::move(read_raw)) {
    // 16 + MAX_WBITS: expect a gzip header and trailer (checks the CRC).
    if (inflateInit2(&stream_, 16 + MAX_WBITS) != Z_OK) {
      throw trace_error(source_, 0, "cannot start gzip decompression (zlib out of memory)");
    }
  }
  ~inflater() { inflateEnd(&stream_); }
  inflater(const inflater&) = delete;
  inflater& operator=(const inflater&) = delete;

  /// Decompresses up to `size` bytes into `out`; returns how many, fewer
  /// only at the end of the data (then 0 on every later call). Throws
  /// trace_error for corrupt or truncated data and when the total goes
  /// beyond max_bytes.
  std::size_t read(char* out, std::size_t size) {
    size = std::min<std::size_t>(size, std::numeric_limits<uInt>::max());
    stream_.next_out = reinterpret_cast<Bytef*>(out);
    stream_.avail_out = static_cast<uInt>(size);
    while (stream_.avail_out != 0 && !done_) {
      if (stream_.avail_in == 0) refill();
      const uInt room = stream_.avail_out;
      const int rc = inflate(&stream_, Z_NO_FLUSH);
      total_ += room - stream_.avail_out;
      if (total_ > max_bytes_) too_large();
      if (rc == Z_STREAM_END) {
        // Another member may follow; anything else after the end is garbage.
        if (stream_.avail_in < 2) refill();
        if (stream_.avail_in == 0) {
          done_ = true;
          break;
        }
        if (stream_.avail_in < 2 || stream_.next_in[0] != 0x1f || stream_.next_in[1] != 0x8b) {
          throw trace_error(source_, 0, "corrupt gzip data: trailing bytes after the gzip stream");
        }
        if (inflateReset(&stream_) != Z_OK) fail("inflateReset failed");
        continue;
      }
      if (rc == Z_BUF_ERROR || rc == Z_OK) {
        // No progress without more input: at the end of the input, truncated.
        if (stream_.avail_in == 0 && input_ended_ && stream_.avail_out != 0) {
          throw trace_error(source_, 0, "corrupt gzip data: truncated (unexpected end of data)");
        }
        continue;
      }
      fail(rc == Z_MEM_ERROR ? "out of memory" : nullptr);
    }
    return size - stream_.avail_out;
  }

 private:
  /// Moves the unread input to the front of the buffer and reads more after it.
  void refill() {
    if (input_ended_) return;
    const std::size_t left = stream_.avail_in;
    if (left != 0) std::memmove(in_.data(), stream_.next_in, left);
    const std::size_t got = read_raw_(in_.data() + left, in_.size() - left);
    if (got == 0) input_ended_ = true;
    stream_.next_in = reinterpret_cast<Bytef*>(in_.data());
    stream_.avail_in = static_cast<uInt>(left + got);
  }

  [[noreturn]] void too_large() const {
    throw trace_error(source_, 0,
                      "decompresses to more than " + std::to_string(max_bytes_) +
                          " bytes, the input limit (trace_limits::max_input_bytes; raise it with --max-input-bytes)");
  }

  [[noreturn]] void fail(const char* what) {
    std::string reason = "corrupt gzip data: ";
    reason += what ? what : (stream_.msg ? stream_.msg : "inflate failed");
    throw trace_error(source_, 0, reason);
  }

  const std::string& source_;
  std::uint64_t max_bytes_;
  read_fn read_raw_;
  z_stream stream_{};
  std::array<char, 1 << 16> in_{};
  std::uint64_t total_ = 0;
  bool input_ended_ = false;
  bool done_ = false;
};
#endif  // CCALLOC_HAVE_ZLIB

/// Closes a FILE* on scope exit.
struct file_closer {
  void operator()(std::FILE* f) const noexcept { std::fclose(f); }
};

}  // namespace
}  // namespace detail

namespace {
bool looks_like_gzip(std::string_view data) noexcept {
  return data.size() >= 2 && static_cast<unsigned char>(data[0]) == 0x1f && static_cast<unsigned char>(data[1]) == 0x8b;
}
}  // namespace

std::string maybe_gunzip(std::string_view data, const std::string& source, const trace_limits& limits) {
  if (!looks_like_gzip(data)) return std::string(data);
#if CCALLOC_HAVE_ZLIB
  detail::inflater inflater(source, limits.max_input_bytes, [&data](char* buffer, std::size_t size) {
    const std::size_t n = std::min(size, data.size());
    std::memcpy(buffer, data.data(), n);
    data.remove_prefix(n);
    return n;
  });
  // Doubling from 4x the gzip data (text compresses 5-10x), then 256 MiB at
  // a time: the buffer stays within 1.25x of the text.
  std::string out(std::max<std::size_t>(4096, data.size() * 4), '\0');
  std::size_t produced = 0;
  while (true) {
    produced += inflater.read(out.data() + produced, out.size() - produced);
    if (produced < out.size()) break;
    out.resize(out.size() + std::min<std::size_t>(out.size(), std::size_t{256} << 20));
  }
  out.resize(produced);
  return out;
#else
  throw trace_error(source, 0,
                    "gzip-compressed, but this build of ccalloc has no zlib: decompress it first (gunzip -k)");
#endif
}

std::string not_text_reason(std::string_view data) {
  data = data.substr(0, 4096);
  const auto byte = [&](std::size_t i) { return i < data.size() ? static_cast<unsigned char>(data[i]) : 0x100u; };
  const auto starts = [&](std::string_view magic) { return data.substr(0, magic.size()) == magic; };
  if (looks_like_gzip(data))
    return "not a text trace: looks like gzip data compressed twice (gzip data again after decompressing); "
           "decompress it once (gunzip) and read the result";
  struct magic_name {
    std::string_view magic, name;
  };
  constexpr magic_name archives[] = {{"\xFD" "7zXZ", "xz"},
                                     {"BZh", "bzip2"},
                                     {"\x28\xB5\x2F\xFD", "zstd"},
                                     {"\x04\x22\x4D\x18", "lz4"},
                                     {"7z\xBC\xAF\x27\x1C", "7-Zip"},
                                     {"\x1F\x9D", "compress (.Z)"},
                                     {"PK\x03\x04", "zip"},
                                     {"\x89PNG", "PNG"},
                                     {"\x7F" "ELF", "ELF (a program)"}};
  for (const auto& a : archives)
    if (starts(a.magic))
      return "not a text trace: looks like " + std::string(a.name) +
             " data; ccalloc reads plain text or gzip (decompress it first)";
  // Pickle's PROTO opcode (0x80) and its protocol number: sniff_trace_format
  // takes protocols 2 to 5 as a snapshot. No UTF-8 text starts with 0x80
  // (a continuation byte).
  if (byte(0) == 0x80 && data.size() >= 2) {
    char hex[8];
    std::snprintf(hex, sizeof hex, "0x%02x", byte(1));
    return "not a text trace: looks like a pickle of protocol " + std::to_string(byte(1)) +
           " (its first bytes are 0x80 " + hex + "); ccalloc reads PyTorch snapshot pickles of protocols 2 to 5";
  }
  // UTF-16: a byte-order mark, or ASCII characters with NUL bytes between them.
  const bool bom = (byte(0) == 0xFF && byte(1) == 0xFE) || (byte(0) == 0xFE && byte(1) == 0xFF);
  const bool interleaved = data.size() >= 4 && ((byte(0) != 0 && byte(1) == 0 && byte(2) != 0 && byte(3) == 0) ||
                                                (byte(0) == 0 && byte(1) != 0 && byte(2) == 0 && byte(3) != 0));
  if (bom || interleaved)
    return "not a text trace: looks like UTF-16 text; convert it to UTF-8 (iconv -f UTF-16 -t UTF-8)";
  if (starts("\xEF\xBB\xBF"))
    return "not a text trace as it is: it starts with a UTF-8 byte-order mark; remove it "
           "(sed -i '1s/^\\xEF\\xBB\\xBF//' FILE)";
  // Control characters in the first line (a later line with one, or an
  // escape sequence, gets the usual message naming its line, escaped).
  for (std::size_t i = 0; i < data.size() && data[i] != '\n'; ++i) {
    const unsigned char c = byte(i);
    if (c < 0x20 && c != '\t' && c != '\r' && c != '\f' && c != '\v' && c != 0x1b) {  // ESC: a stray escape sequence
      char hex[8];
      std::snprintf(hex, sizeof hex, "0x%02x", c);
      return "not a text trace: looks like binary data (byte " + std::string(hex) + " at offset " + std::to_string(i) +
             ")";
    }
  }
  return {};
}

trace read_trace_file(const std::string& path, const trace_limits& limits) {
  trace_read_options options;
  options.limits = limits;
  return read_trace_file(path, options);
}

namespace {

/// The text of a trace file (plain or gzip), a buffer at a time, with
/// trace_limits::max_input_bytes checked as it is read: the file and its
/// text are never held whole.
class text_source {
 public:
  text_source(const std::string& path, const trace_limits& limits) : path_(path), limits_(limits) {
    errno = 0;
    file_.reset(std::fopen(path.c_str(), "rb"));
    if (!file_) throw trace_error(path, 0, std::string("cannot open: ") + std::strerror(errno));
    // The first block tells a file that is no text (/dev/zero, a program)
    // before more is read; gzip data and pickles are checked after.
    head_.resize(1 << 16);
    head_.resize(read_file(head_.data(), head_.size()));
    gzip_ = looks_like_gzip(head_);
    if (!gzip_ && sniff_trace_format(head_) != trace_format::pytorch_snapshot) {
      if (std::string why = not_text_reason(head_); !why.empty()) throw trace_error(path, 0, why);
    }
#if CCALLOC_HAVE_ZLIB
    if (gzip_)
      inflater_ = std::make_unique<detail::inflater>(
          path_, limits.max_input_bytes, [this](char* buffer, std::size_t size) { return read_raw(buffer, size); });
#else
    if (gzip_) (void)maybe_gunzip(head_, path_, limits_);  // throws: no zlib
#endif
  }

  /// Fills `buffer` with up to `size` bytes of text; fewer only at the end.
  std::size_t read(char* buffer, std::size_t size) {
#if CCALLOC_HAVE_ZLIB
    if (inflater_) return inflater_->read(buffer, size);
#endif
    return read_raw(buffer, size);
  }

 private:
  /// The file's bytes: the head first, then the rest of the file.
  std::size_t read_raw(char* buffer, std::size_t size) {
    std::size_t n = std::min(size, head_.size() - head_used_);
    std::memcpy(buffer, head_.data() + head_used_, n);
    head_used_ += n;
    if (n < size) n += read_file(buffer + n, size - n);
    return n;
  }

  std::size_t read_file(char* buffer, std::size_t size) {
    std::size_t n = 0;
    while (n < size) {
      const std::size_t got = std::fread(buffer + n, 1, size - n, file_.get());
      if (got == 0) {
        if (std::ferror(file_.get())) throw trace_error(path_, 0, std::string("cannot read: ") + std::strerror(errno));
        break;
      }
      n += got;
    }
    file_bytes_ += n;
    if (file_bytes_ > limits_.max_input_bytes)
      throw trace_error(path_, 0,
                        "larger than the input limit of " + std::to_string(limits_.max_input_bytes) +
                            " bytes (trace_limits::max_input_bytes; raise it with --max-input-bytes)");
    return n;
  }

  const std::string& path_;
  const trace_limits& limits_;
  std::unique_ptr<std::FILE, detail::file_closer> file_;
  std::string head_;
  std::size_t head_used_ = 0;
  std::uint64_t file_bytes_ = 0;
  bool gzip_ = false;
#if CCALLOC_HAVE_ZLIB
  std::unique_ptr<detail::inflater> inflater_;
#endif
};

/// Feeds `parser` the text of `source` a block of whole lines at a time,
/// `first` (already read) first. Holds at most one block plus one line:
/// a line longer than trace_limits::max_line_bytes fails as soon as that
/// many of its bytes are read.
trace parse_lines(text_source& source, std::string first, detail::line_parser& parser, const std::string& path,
                  const trace_limits& limits) {
  constexpr std::size_t block = std::size_t{1} << 20;
  std::string buffer = std::move(first);
  bool at_end = buffer.empty();
  // A first line over the limit may be no text at all (a gzip of zeros):
  // then that is what the error says.
  const auto too_long = [&] {
    if (parser.lines() == 0)
      if (std::string why = not_text_reason(buffer); !why.empty()) return trace_error(path, 0, why);
    return trace_error(path, parser.lines() + 1, detail::line_limit_reason(limits.max_line_bytes));
  };
  while (!at_end) {
    const std::size_t last_newline = buffer.rfind('\n');
    const std::size_t whole = last_newline == std::string::npos ? 0 : last_newline + 1;
    if (whole != 0) parser.feed(std::string_view(buffer).substr(0, whole));
    buffer.erase(0, whole);
    if (buffer.size() > limits.max_line_bytes) throw too_long();
    const std::size_t kept = buffer.size();
    buffer.resize(kept + block);
    const std::size_t got = source.read(buffer.data() + kept, block);
    buffer.resize(kept + got);
    at_end = got < block && buffer.find('\n', kept) == std::string::npos;
    if (at_end && !buffer.empty()) {
      if (buffer.size() > limits.max_line_bytes) throw too_long();
      parser.feed(buffer);
    }
  }
  return parser.finish();
}

}  // namespace

trace read_trace_file(const std::string& path, const trace_read_options& options) {
  const trace_limits& limits = options.limits;
  // A snapshot pickle is read as a stream, never whole.
  if (is_pytorch_snapshot_file(path)) return convert_pytorch_snapshot(path, options);
  text_source source(path, limits);
  // The first block of text tells the format.
  constexpr std::size_t first_block = std::size_t{1} << 20;
  std::string first(first_block, '\0');
  first.resize(source.read(first.data(), first.size()));
  switch (sniff_trace_format(first)) {
    case trace_format::rmm_log: {
      const auto parser = detail::make_rmm_log_parser(path, limits);
      return parse_lines(source, std::move(first), *parser, path, limits);
    }
    case trace_format::pytorch_snapshot: {
      // A pickle from a pipe (a file is read above): converted as it is read, the first block first.
      std::size_t at = 0;
      return detail::convert_pytorch_snapshot_stream(
          [&](char* buffer, std::size_t size) {
            if (at == first.size()) return source.read(buffer, size);
            const std::size_t n = std::min(size, first.size() - at);
            std::memcpy(buffer, first.data() + at, n);
            at += n;
            return n;
          },
          path, options);
    }
    case trace_format::ccalloc: break;
  }
  const auto parser = detail::make_trace_text_parser(path, limits);
  return parse_lines(source, std::move(first), *parser, path, limits);
}

}  // namespace ccalloc
