// stats_sink's members, inline: the hot path (hot_path.cpp) constructs one
// per malloc and free. The class and what it does are in device_state.hpp.
#pragma once

#include "device_state.hpp"

namespace ccalloc::detail {

CCALLOC_HOT_TLS inline thread_local char tls_thread_tag;  // its address identifies the thread

inline stats_sink::stats_sink(device_state& d, stream_state& s) noexcept : d_(d), s_(s) {
  if (d_.registry().single_stream()) [[likely]]
    return;  // the only stream: pending deltas are exact (see stream_registry::single_stream)
  if (s_.stats_backoff > 0) {
    --s_.stats_backoff;
    return;
  }
  if (!d_.stats().mutex().try_lock()) {
    s_.stats_backoff = 64;
    return;
  }
  locked_ = true;
  publish_pending_stats(d_.stats().values(), s_);
  // Another thread published last: threads are sharing this device, so
  // publish only every 64th operation from now on (see the class comment).
  if (d_.stats().switch_publisher(&tls_thread_tag)) s_.stats_backoff = 64;
}

inline stats_sink::~stats_sink() {
  if (locked_) d_.stats().mutex().unlock();
}

inline device_stats& stats_sink::get() noexcept {
  if (locked_) return d_.stats().values();
  s_.has_pending_stats = true;
  return s_.pending_stats;
}

}  // namespace ccalloc::detail
