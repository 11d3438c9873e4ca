// The statistics of one device (SPEC S1-S4): the figures (device_stats),
// the lock that guards them (stats_mutex_ in the lock order of
// device_state.hpp, innermost of the device's), and which thread published
// into them last (stats_sink backs off when threads take turns). Owns these
// only: each operation computes its own deltas, into the figures when it
// holds the lock (stats_sink) or else into its stream's pending deltas,
// merged here by publish_all_pending (publish_pending_stats). values()
// needs the lock, or the world lock that holds it.
#pragma once

#include <ccalloc/base/detail/spin_mutex.hpp>
#include <ccalloc/core/stats.hpp>

namespace ccalloc::detail {

class world_lock;

class device_statistics {
 public:
  device_statistics() = default;
  device_statistics(const device_statistics&) = delete;
  device_statistics& operator=(const device_statistics&) = delete;

  // stats_mutex_: taken by stats_sink (try_lock on the hot path) and by
  // world_lock.
  [[nodiscard]] spin_mutex& mutex() noexcept { return mutex_; }
  // The device's figures. [stats_mutex_, or world]
  [[nodiscard]] device_stats& values() noexcept { return values_; }
  [[nodiscard]] const device_stats& values() const noexcept { return values_; }
  // Notes that `thread` (an address per thread) publishes now; returns
  // whether another thread published last (then the publisher backs off:
  // threads share this device). [stats_mutex_]
  [[nodiscard]] bool switch_publisher(const void* thread) noexcept {
    if (last_publisher_ == thread) return false;
    const bool other = last_publisher_ != nullptr;
    last_publisher_ = thread;
    return other;
  }
  // Merges every stream's pending deltas into values(). [world]
  void publish_all_pending(const world_lock& w);

 private:
  spin_mutex mutex_;
  device_stats values_;
  const void* last_publisher_ = nullptr;  // the thread that published last
};

}  // namespace ccalloc::detail
