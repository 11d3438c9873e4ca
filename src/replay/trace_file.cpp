// trace_file.cpp: reading a trace file (include/ccalloc/replay/trace.hpp),
// above the three readers.
//
// Pipeline: read_trace_file = read the whole file -> maybe_gunzip (zlib, when
// the bytes start with the gzip magic 1f 8b) -> sniff_trace_format -> one
// reader: parse_trace_text (trace_reader.cpp, ccalloc's format),
// parse_rmm_log (rmm_reader.cpp) or convert_pytorch_snapshot
// (snapshot_reader.cpp; a snapshot pickle is recognized first and read as a
// stream instead). The readers never call back up here.
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
#include <limits>
#include <memory>
#include <string>
#include <string_view>

namespace ccalloc {

std::string_view to_string(trace_format format) noexcept {
  switch (format) {
    case trace_format::rmm_log: return "RMM log";
    case trace_format::pytorch_snapshot: return "PyTorch snapshot";
    case trace_format::ccalloc: break;
  }
  return "ccalloc trace";
}

trace_format sniff_trace_format(std::string_view data) noexcept {
  if (data.size() >= 2 && static_cast<unsigned char>(data[0]) == 0x80 && data[1] >= 2 && data[1] <= 5)
    return trace_format::pytorch_snapshot;
  std::size_t i = data.substr(0, 3) == "\xEF\xBB\xBF" ? 3 : 0;
  while (i < data.size() && (data[i] == ' ' || data[i] == '\t' || data[i] == '\r' || data[i] == '\n')) ++i;
  if (data.substr(i, 7) == "Thread,") return trace_format::rmm_log;
  return trace_format::ccalloc;
}

namespace detail {
namespace {

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
  inflater(const std::string& source, std::uint64_t max_bytes) : source_(source), max_bytes_(max_bytes) {
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
    // At most max_bytes_ + 1 bytes of room: one byte more than allowed shows
    // that the text goes beyond the limit.
    const std::uint64_t room_limit = max_bytes_ + 1;
    std::string out;
    out.resize(static_cast<std::size_t>(std::min<std::uint64_t>(gzip_output_guess(data), room_limit)));
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
      if (produced == out.size()) {
        if (produced >= room_limit) too_large();
        // Doubling up to 256 MiB, then 256 MiB more at a time: the buffer
        // stays within 1.25x of the text (resize writes every byte).
        const std::uint64_t grown = out.size() + std::min<std::uint64_t>(out.size(), std::uint64_t{256} << 20);
        out.resize(static_cast<std::size_t>(std::min<std::uint64_t>(grown, room_limit)));
      }
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
    if (produced > max_bytes_) too_large();
    out.resize(produced);
    return out;
  }

 private:
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
  z_stream stream_{};
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
  detail::inflater inflater(source, limits.max_input_bytes);
  return inflater.run(data);
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
  constexpr magic_name archives[] = {{"\xFD" "7zXZ", "xz"},   {"BZh", "bzip2"}, {"\x28\xB5\x2F\xFD", "zstd"},
                                     {"PK\x03\x04", "zip"}, {"\x89PNG", "PNG"}, {"\x7F" "ELF", "ELF (a program)"}};
  for (const auto& a : archives)
    if (starts(a.magic))
      return "not a text trace: looks like " + std::string(a.name) +
             " data; ccalloc reads plain text or gzip (decompress it first)";
  // UTF-16: a byte-order mark, or ASCII characters with NUL bytes between them.
  const bool bom = (byte(0) == 0xFF && byte(1) == 0xFE) || (byte(0) == 0xFE && byte(1) == 0xFF);
  const bool interleaved = data.size() >= 4 && ((byte(0) != 0 && byte(1) == 0 && byte(2) != 0 && byte(3) == 0) ||
                                                (byte(0) == 0 && byte(1) != 0 && byte(2) == 0 && byte(3) != 0));
  if (bom || interleaved)
    return "not a text trace: looks like UTF-16 text; convert it to UTF-8 (iconv -f UTF-16 -t UTF-8)";
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

trace read_trace_file(const std::string& path, const trace_read_options& options) {
  const trace_limits& limits = options.limits;
  // A snapshot pickle is read as a stream, never whole.
  if (is_pytorch_snapshot_file(path)) return convert_pytorch_snapshot(path, options);
  errno = 0;
  const std::unique_ptr<std::FILE, detail::file_closer> file(std::fopen(path.c_str(), "rb"));
  if (!file) {
    throw trace_error(path, 0, std::string("cannot open: ") + std::strerror(errno));
  }
  std::string data;
  std::array<char, 1 << 16> buffer;
  while (true) {
    const std::size_t got = std::fread(buffer.data(), 1, buffer.size(), file.get());
    // The first block tells a file that is no text (/dev/zero, a program)
    // before the rest is read; gzip data and pickles are checked after.
    if (data.empty() && got > 0) {
      const std::string_view head(buffer.data(), got);
      if (!looks_like_gzip(head) && sniff_trace_format(head) != trace_format::pytorch_snapshot) {
        std::string why = not_text_reason(head);
        if (!why.empty()) throw trace_error(path, 0, why);
      }
    }
    if (data.size() + got > limits.max_input_bytes)
      throw trace_error(path, 0,
                        "larger than the input limit of " + std::to_string(limits.max_input_bytes) +
                            " bytes (trace_limits::max_input_bytes; raise it with --max-input-bytes)");
    data.append(buffer.data(), got);
    if (got < buffer.size()) {
      if (std::ferror(file.get())) {
        throw trace_error(path, 0, std::string("cannot read: ") + std::strerror(errno));
      }
      break;
    }
  }
  const std::string text = maybe_gunzip(data, path, limits);
  data = std::string();  // the compressed bytes are no longer needed
  switch (sniff_trace_format(text)) {
    case trace_format::rmm_log: return parse_rmm_log(text, path, limits);
    case trace_format::pytorch_snapshot: return convert_pytorch_snapshot_data(text, path, options);  // a pipe
    case trace_format::ccalloc: break;
  }
  return parse_trace_text(text, path, limits);
}

}  // namespace ccalloc
