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

trace read_trace_file(const std::string& path) { return read_trace_file(path, trace_read_options{}); }

trace read_trace_file(const std::string& path, const trace_read_options& options) {
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
    case trace_format::pytorch_snapshot: return convert_pytorch_snapshot_data(text, path, options);  // a pipe
    case trace_format::ccalloc: break;
  }
  return parse_trace_text(text, path);
}

}  // namespace ccalloc
