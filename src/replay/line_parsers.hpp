// The text readers as line consumers (private to src/replay/): read_trace_file
// feeds them the decompressed text a block of whole lines at a time, so the
// text is never held whole (trace_file.cpp); parse_trace_text and
// parse_rmm_log feed them one block, the whole text.
#pragma once

#include <ccalloc/replay/trace.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

namespace ccalloc::detail {

/// An incremental reader of a line-based text format.
class line_parser {
 public:
  virtual ~line_parser() = default;
  /// Reads `lines`: whole lines, each ending in '\n', except that the last
  /// block fed may end without one. Throws trace_error naming the line.
  virtual void feed(std::string_view lines) = 0;
  /// The number of lines read so far.
  [[nodiscard]] virtual std::size_t lines() const noexcept = 0;
  /// The trace; call once, after the last feed.
  [[nodiscard]] virtual trace finish() = 0;
};

/// ccalloc's own format (trace_reader.cpp). `source` must outlive the parser.
[[nodiscard]] std::unique_ptr<line_parser> make_trace_text_parser(const std::string& source,
                                                                  const trace_limits& limits);
/// RMM logging_resource_adaptor logs (rmm_reader.cpp).
[[nodiscard]] std::unique_ptr<line_parser> make_rmm_log_parser(const std::string& source, const trace_limits& limits);

/// Converts the snapshot pickle that `read` yields (decompressed; it fills a
/// buffer and returns how many bytes, 0 at the end) as
/// convert_pytorch_snapshot does, reading it as a stream (snapshot_reader.cpp).
[[nodiscard]] trace convert_pytorch_snapshot_stream(const std::function<std::size_t(char*, std::size_t)>& read,
                                                    const std::string& source, const trace_read_options& options);

/// Feeds `parser` the whole of `text`: parse_trace_text and parse_rmm_log.
[[nodiscard]] inline trace parse_whole(line_parser& parser, std::string_view text) {
  parser.feed(text);
  return parser.finish();
}

}  // namespace ccalloc::detail
