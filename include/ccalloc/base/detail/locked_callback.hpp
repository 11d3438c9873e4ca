// ccalloc/base/detail/locked_callback.hpp: the name of a callback other
// than a mapping listener that may run while its thread holds the
// allocator's locks, for the messages that refuse its calls back into the
// allocator. Not part of the public API.
//
// Such callbacks (the C API's history `release` and `frames` functions,
// ccalloc_history_options_t, which run where the last reference to a
// context is dropped, under the history's or the device's locks, and while
// a snapshot is written) are counted in tls_mapping_listener_depth
// (spin_mutex.hpp) and refused alike: the entry points that lock a device
// or change the configuration throw invalid_argument_error with
// locked_callback_message, and a lock found taken stops the process.
#pragma once

#include <ccalloc/base/detail/spin_mutex.hpp>

#include <string>

namespace ccalloc::detail {

// tls_locked_callback (spin_mutex.hpp, whose lock abort names it) holds
// the running callback's name.

/// The message of a call into the allocator (`what`) refused because the
/// callback tls_locked_callback names runs on this thread.
[[gnu::cold]] inline std::string locked_callback_message(const std::string& what) {
  return "ccalloc: " + what + ": called from " + tls_locked_callback +
         ", which may run while the calling thread holds the allocator's locks; it must not call into any ccalloc "
         "allocator (ccalloc/ccalloc.h: ccalloc_history_options_t)";
}

}  // namespace ccalloc::detail
