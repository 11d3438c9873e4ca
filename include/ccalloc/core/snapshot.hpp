// ccalloc/core/snapshot.hpp: a snapshot of the allocator's memory (SPEC F13)
// and its JSON and pickle forms (SPEC E4).
//
// caching_allocator::snapshot() fills a memory_snapshot: the segments of
// every device with their blocks, each device's trace (history), the
// annotations and the settings in force; the data of PyTorch's
// torch.cuda.memory._snapshot(). to_json() writes it with exactly the keys
// and nesting of PyTorch's dictionary, so that python/ccalloc/snapshot.py
// only has to turn it into a pickle for torch.cuda._memory_viz and the
// memory_viz web page. The writer uses the standard library only (the C API
// calls it).
#pragma once

#include <ccalloc/core/config.hpp>
#include <ccalloc/core/device_caching_allocator.hpp>
#include <ccalloc/core/history.hpp>

#include <string>
#include <string_view>
#include <vector>

namespace ccalloc {

/// PyTorch's snapshot dictionary as C++ data.
struct memory_snapshot {
  std::vector<segment_info> segments;                   ///< every device, by (device, address)
  std::vector<std::vector<trace_entry>> device_traces;  ///< [device], oldest first; empty lists without traces
  std::vector<annotation_entry> external_annotations;   ///< device by device, oldest first
  allocator_config config;                              ///< the settings in force
};

/// The snapshot as one JSON object with PyTorch's keys:
/// - "segments": [{device, address, total_size, allocated_size, active_size,
///   requested_size, stream, segment_type ("small" | "large"),
///   segment_pool_id ([a, b]; a tuple in the pickle), is_expandable, frames,
///   blocks: [{address, size, requested_size, state, frames}]}]
/// - "device_traces": per device [{action, addr (device_free for oom), size,
///   stream, time_us, frames, compile_context, user_metadata}]
/// - "allocator_settings": PyTorch's keys (PYTORCH_CUDA_ALLOC_CONF: the
///   canonical configuration string; max_split_size: -1 when unlimited; ...;
///   roundup_power2_divisions: {"1": n, "2": n, ..., "32768": n}), then
///   ccalloc's own (large_segment_size, max_non_split_rounding_size,
///   per_process_memory_fraction, trim_on_new_peak)
/// - "external_annotations": [{device, time_us, <key>: <value>...}]
/// Frames are [{name, filename, line}]. Integers are exact decimals; strings
/// are UTF-8 with JSON escapes (RFC 8259): control characters as \uXXXX or
/// their short escapes, and each byte that does not start a valid UTF-8
/// sequence replaced by U+FFFD (valid_utf8), so that the text is valid UTF-8
/// whatever bytes a frame, tag or metadata string holds. Pure function.
[[nodiscard]] std::string to_json(const memory_snapshot& snapshot);

/// `text` with each byte that does not start a valid UTF-8 sequence (RFC
/// 3629: lone continuation bytes, truncated sequences, overlong encodings,
/// surrogates, code points above U+10FFFF) replaced by U+FFFD, one per
/// byte that is not part of a valid sequence;
/// valid text is returned unchanged. to_json and to_pickle write every
/// string through it. Pure function.
[[nodiscard]] std::string valid_utf8(std::string_view text);

/// The snapshot as the bytes of the pickle torch.cuda.memory._dump_snapshot
/// writes (protocol 2): the dictionary to_json describes, with
/// segment_pool_id a tuple (what python/ccalloc/snapshot.py makes of the
/// JSON). torch.cuda._memory_viz, the memory_viz web page and `ccalloc
/// report` read it. Strings go through valid_utf8 (Python's unpickler
/// rejects invalid UTF-8). Frames come from each context's to_frames()
/// (exceptions it throws propagate). Pure function otherwise.
[[nodiscard]] std::string to_pickle(const memory_snapshot& snapshot);

}  // namespace ccalloc
