// ccalloc/replay/trace.hpp: allocation traces (the recorded input of replay).
//
// A trace is the sequence of allocator events of a real program, one per
// line, as in ../shared/traces (PyTorch's trace-entry action names):
//
//     # time_us action addr size stream
//     1796001411612040 segment_alloc 140347686518784 155189248 0
//     1796001411612042 alloc 140347686518784 154389504 0
//
// Files may be gzip-compressed (detected by content, not by name). Lines
// starting with '#' and blank lines are skipped. Errors throw trace_error
// with "FILE:LINE: reason".
//
// read_trace_file also reads, told apart by content (sniff_trace_format):
// - RMM's logging_resource_adaptor CSV (`Thread,Time,Action,Pointer,Size,
//   Stream`; parse_rmm_log);
// - PyTorch memory snapshot pickles (torch.cuda.memory._dump_snapshot),
//   read by ccalloc's own plain-data pickle reader (no Python;
//   convert_pytorch_snapshot), with the allocation sites of their frames.
#pragma once

#include <ccalloc/base/errors.hpp>
#include <ccalloc/base/printable_text.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace ccalloc {

/// A file name safe to print on one line (printable_line: a newline or tab
/// in it as "\n" or "\t", other control bytes as "\xHH"), so that a name
/// holding one cannot make a message look like two. Pure; may throw
/// std::bad_alloc.
inline std::string printable_name(std::string_view name) { return printable_line(name); }

/// A malformed trace. what() is "FILE:LINE: reason", or "FILE: reason" when
/// the error is not tied to a line (the file cannot be opened, corrupt gzip
/// data), with control bytes of the file name (newlines included:
/// printable_name) and the reason (which may quote the trace) escaped
/// (printable_text); `file` is the name as given.
class trace_error : public error {
 public:
  trace_error(const std::string& source_file, std::size_t source_line, const std::string& reason)
      : error(printable_text(where(source_file, source_line) + reason)), file(source_file), line(source_line) {}
  std::string file;
  std::size_t line;  ///< 1-based; 0 when the error is not tied to a line

 private:
  // "FILE:LINE: " or "FILE: ", appended piece by piece (GCC 12's -Wrestrict
  // misreads ":" + std::to_string(...) at -O3).
  static std::string where(const std::string& source_file, std::size_t source_line) {
    std::string text = printable_name(source_file);
    if (source_line != 0) {
      text += ':';
      text += std::to_string(source_line);
    }
    text += ": ";
    return text;
  }
};

enum class trace_action : std::uint8_t {
  alloc,
  free_requested,
  free_completed,
  segment_alloc,
  segment_free,
  segment_map,
  segment_unmap,
  snapshot,
  oom,
  /// Sleep and wake (docs/trace-format.md, "Tags, pause and resume"): the
  /// allocations from here on are made under trace::tags[tag - 1] (tag 0:
  /// the default tag).
  tag,
  /// trace::tags[tag - 1] was paused, its contents kept when keep_contents;
  /// size = the bytes the recording paused.
  pause,
  /// trace::tags[tag - 1] was resumed; size = the bytes mapped again.
  resume,
};

/// PyTorch's name of an action ("free_requested").
[[nodiscard]] std::string_view to_string(trace_action action) noexcept;

struct trace_event {
  std::uint64_t time_us = 0;  ///< wall-clock microseconds of the recording
  trace_action action = trace_action::alloc;
  /// pause: the recording kept the tag's contents in host memory.
  bool keep_contents = false;
  /// tag, pause, resume: trace::tags[tag - 1], or 0 for the default tag.
  std::uint16_t tag = 0;
  /// The allocation site: trace::sites[site - 1], or 0 when the input has
  /// none (only PyTorch snapshots recorded with stacks have sites).
  std::uint32_t site = 0;
  std::uint64_t addr = 0;     ///< address the recording allocator used
  std::uint64_t size = 0;     ///< bytes: requested size (alloc, frees) or segment size
  std::uint64_t stream = 0;   ///< stream handle as recorded (0 = legacy default)
  std::uint64_t line = 0;     ///< 1-based line in the source, for error messages
};

struct trace {
  std::string source;  ///< file name, or "<embedded:NAME>"
  std::vector<trace_event> events;
  /// What a conversion added or dropped, for the user (e.g. "3 frees of
  /// pointers never allocated in the log were skipped"); empty for ccalloc's format.
  std::vector<std::string> notes;
  /// The distinct stacks of the events' `site`s, one frame a line, innermost
  /// first: "name (filename:line)".
  std::vector<std::string> sites;
  /// False when the events were converted from a file without lines (a
  /// PyTorch snapshot pickle): trace_event::line then counts lines of the
  /// conversion, which the user never sees, and pages do not show it.
  bool has_source_lines = true;
  /// The names of the tags that `tag`, `pause` and `resume` events name
  /// (trace_event::tag - 1), in the order of their first line.
  std::vector<std::string> tags;
};

/// Bounds the readers enforce on their input, so that a mistaken or hostile
/// file (a gzip bomb, /dev/zero, a binary file) fails at once with a
/// trace_error naming the bound instead of exhausting memory. The defaults
/// are far above real traces (the largest of ../shared/traces: 44 MB of
/// text, 0.8 million events); the CLI's --max-input-bytes, --max-events and
/// --max-line-bytes raise them.
struct trace_limits {
  /// Bytes of the file as read, and again of the text after gzip
  /// decompression: "larger than the input limit of <n> bytes ..." /
  /// "decompresses to more than <n> bytes, the input limit ...".
  std::uint64_t max_input_bytes = std::uint64_t{4} << 30;
  /// Events of a trace (rows of an RMM log; two events per free): 48 bytes
  /// of memory each. "more than <n> events, the limit ...".
  std::uint64_t max_events = 100'000'000;
  /// Bytes of one line, comments included (an event line is under 120):
  /// "a line of more than <n> bytes, the limit ...".
  std::uint64_t max_line_bytes = 65536;
};

/// Limits and progress for read_trace_file and convert_pytorch_snapshot.
/// A limit exceeded throws trace_error naming the limit and the flag that
/// raises it (docs/errors.md).
struct trace_read_options {
  /// Objects a snapshot pickle may make (each dict, list, string, number...;
  /// a memo reference is not counted). About 85 million for 1.5 million
  /// trace entries of 12 distinct frame objects each. ccalloc
  /// --max-pickle-objects.
  std::uint64_t max_pickle_objects = 500'000'000;
  /// Decompressed bytes of a snapshot pickle. ccalloc --max-pickle-bytes.
  std::uint64_t max_pickle_bytes = std::uint64_t{4} << 30;
  /// Bytes of memory the pickle reader may build (8 per value on its stack
  /// or in its memo, a container's items plus 24, a distinct string's text
  /// plus 64; counted as built, so an upper bound of its peak). A real
  /// snapshot takes about 2x its pickle bytes (docs/trace-format.md);
  /// a hostile one fails here instead of exhausting the host.
  /// ccalloc --max-pickle-memory.
  std::uint64_t max_pickle_memory_bytes = std::uint64_t{8} << 30;
  /// Which of a snapshot's device_traces to convert (the trace format holds
  /// one device): -1, the default, takes the device with the most entries
  /// (the lowest index among equals) and notes the other devices that have
  /// entries with their counts; 0 and up take that device (an index the
  /// snapshot has not is a trace_error naming the devices it has). ccalloc
  /// --snapshot-device N.
  std::int64_t snapshot_device = -1;
  /// Optional: told the bytes of the file read so far and the file's size
  /// (compressed bytes for gzip), every 16 MiB of pickle and once at the end.
  std::function<void(std::uint64_t done, std::uint64_t total)> progress;
  /// The text readers' bounds (ccalloc traces and RMM logs).
  trace_limits limits;
};

/// The inputs read_trace_file understands.
enum class trace_format {
  ccalloc,           ///< this file's format (docs/trace-format.md)
  rmm_log,           ///< RMM logging_resource_adaptor CSV
  pytorch_snapshot,  ///< a pickle from torch.cuda.memory._dump_snapshot
};
/// "ccalloc trace", "RMM log" or "PyTorch snapshot".
[[nodiscard]] std::string_view to_string(trace_format format) noexcept;
/// Tells the format of decompressed file contents: a pickle starts with the
/// protocol opcode 0x80 and a version in 2..5; an RMM log's first non-blank
/// line is comma-separated names, one of them an RMM column (Thread, Time,
/// Action, Pointer, Size, Stream; any order); anything else is read as
/// ccalloc's format.
[[nodiscard]] trace_format sniff_trace_format(std::string_view data) noexcept;


/// Why `data`, the start of a file or of its decompressed text, cannot be a
/// text trace or log, or "" when it may be: "not a text trace: looks like
/// UTF-16 text ...", "... gzip data compressed twice ...", "... xz / bzip2 /
/// zstd / lz4 / 7-Zip / compress / zip data ...", "... a pickle of protocol
/// <n> ..." (0x80 then a number outside 2..5), "... binary data (byte 0x<hh> at offset <n>)" (a
/// control character other than tab, CR, FF, VT, ESC in the first line). Looks
/// at the first 4096 bytes only.
[[nodiscard]] std::string not_text_reason(std::string_view data);

/// Parses an RMM logging_resource_adaptor log (decompressed): a header line
/// naming the columns Time, Action, Pointer, Size, Stream (in any order;
/// Thread and others not read; one missing is an error naming it), then one
/// row per call. Action `allocate` becomes
/// alloc; `free` (also spelled `deallocate`) becomes free_requested and
/// free_completed at once (RMM frees are stream-ordered, nothing waits);
/// `allocate failure` becomes oom. Time is RMM's time of day `HH:MM:SS.ffffff`
/// (a day is added when it wraps past midnight) or seconds since the epoch
/// (`1634567890.123456`); a time up to 1 s before the latest above it
/// (threads) is held at that time and counted in notes, more is an error.
/// Pointer and Stream are hex (`0x7f..`, or bare hex digits; `(nil)` is 0).
/// A free of a pointer the log never allocated is skipped and counted in
/// notes (a log started mid-run); a free on another stream than its
/// allocate's takes the allocation's stream, counted in notes. Throws trace_error
/// "SOURCE:LINE: reason" for a malformed row or an allocate at a live pointer.
[[nodiscard]] trace parse_rmm_log(std::string_view text, const std::string& source,
                                  const trace_limits& limits = {});

/// Converts the PyTorch snapshot pickle at `path` (plain or gzip, read as a
/// stream): the entries of device_traces[D] (D: options.snapshot_device;
/// by default the device with the most entries, the others that have
/// entries named in a note) become events in order (unknown actions are
/// dropped and counted in notes), with allocs and segments added at the
/// start for what the snapshot's segments hold that the trace never
/// allocated, and missing frees added (the rules of
/// tools/snapshot_to_trace.py, which does the same conversion to text).
/// The `pause` and `resume` entries and the entries' `tag`s of a snapshot
/// ccalloc wrote become `pause`, `resume` and `tag` events (a `tag` event
/// before each alloc whose tag differs from the previous alloc's, as
/// trace_writer writes them; a resume of a tag paused before the trace
/// began is dropped and counted in notes). An event's `line` is its
/// 1-based position in the converted trace. Entries' and blocks' `frames`
/// become `site`s.
///
/// Only plain data is read (dicts, lists, tuples, strings, bytes, numbers,
/// booleans, None, pickle protocols 2 to 5); nothing in the file is run.
/// Time and memory are linear in the pickle's size: equal strings and equal
/// containers are stored once, memo references are not copied, each
/// distinct segment is walked once. Throws trace_error(path, 0,
/// "a PyTorch snapshot that cannot be read: REASON"): a corrupt or truncated
/// pickle (REASON names the byte offset), an opcode that is not plain data,
/// a field missing or of the wrong type (REASON names it, e.g.
/// "device_traces[0][5]: missing 'addr'"), a bad tag name, a
/// snapshot_device the snapshot has not, a limit of `options` exceeded,
/// or the host out of memory.
[[nodiscard]] trace convert_pytorch_snapshot(const std::string& path, const trace_read_options& options = {});
/// The same for pickle bytes in memory (decompressed); `source` names them in errors.
[[nodiscard]] trace convert_pytorch_snapshot_data(std::string_view pickle_bytes, const std::string& source,
                                                  const trace_read_options& options = {});
/// True when `path` is a regular file (plain or gzip) that starts as a
/// pickle of protocol 2 to 5 does (0x80, version); false if it cannot be
/// read or is not a regular file (a pipe is not read here: read_trace_file
/// tells it by its first block and converts it as it reads on).
[[nodiscard]] bool is_pytorch_snapshot_file(const std::string& path) noexcept;

/// Reads a trace file (plain or gzip) in any of the trace_format formats,
/// by content. Throws trace_error for a missing or unreadable file
/// ("FILE:0: cannot open: <reason>"), a file that is no text (not_text_reason,
/// found in the first 64 KiB read: `/dev/zero` fails at once), one beyond
/// `options.limits` (or, for a PyTorch snapshot, its pickle limits), or a
/// malformed line.
[[nodiscard]] trace read_trace_file(const std::string& path, const trace_read_options& options = {});
/// The same with only the text readers' bounds set.
[[nodiscard]] trace read_trace_file(const std::string& path, const trace_limits& limits);
/// Parses trace text (already decompressed); `source` names it in errors.
/// Throws trace_error for text that is no text trace (not_text_reason), one
/// beyond `limits` or a malformed line.
[[nodiscard]] trace parse_trace_text(std::string_view text, const std::string& source,
                                     const trace_limits& limits = {});
/// Decompresses gzip data if it starts with the gzip magic, else returns it
/// unchanged. Throws trace_error(source, 0, ...) on corrupt gzip data or
/// when the text would exceed limits.max_input_bytes.
[[nodiscard]] std::string maybe_gunzip(std::string_view data, const std::string& source,
                                       const trace_limits& limits = {});

}  // namespace ccalloc
