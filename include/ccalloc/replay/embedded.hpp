// ccalloc/replay/embedded.hpp: the real trace bundled in the binary, the
// default input of `ccalloc replay` (data/traces/gpt2_train.trace.gz: GPT-2
// 124M training on an H200 with PyTorch 2.11).
#pragma once

#include <string_view>

namespace ccalloc::embedded {
/// The gzip-compressed trace bytes (static storage).
std::string_view default_trace_gz();
/// Its name, e.g. "gpt2_train".
std::string_view default_trace_name();
/// PyTorch's figures for it, a JSON object with the keys of
/// ../shared/traces/native_peaks.json (requested_peak, native_reserved_peak, ...).
std::string_view default_trace_native_peaks_json();
}  // namespace ccalloc::embedded
