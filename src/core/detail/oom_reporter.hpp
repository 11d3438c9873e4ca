// Out-of-memory reporting of one device (SPEC B6, F17): the last rung of
// the fallback ladder. Owns the OOM observers, the snapshot writer (config
// oom_snapshot) and when it last wrote; builds the error's message from the
// device's figures (reached through device_state), records the OOM in the
// history, runs the observers outside the locks and throws
// out_of_memory_error (out_of_memory.cpp). The observers are guarded by
// device_mutex_ (the world lock holds it); the snapshot time by the world
// lock; the writer is set once, before the device is shared.
#pragma once

#include <ccalloc/core/device_caching_allocator.hpp>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace ccalloc::detail {

class device_state;
class world_lock;
struct alloc_params;

class oom_reporter {
 public:
  // Writes the device's snapshot to `path` and returns the sentence the
  // error message gets; called with no lock held; never throws.
  using snapshot_writer = std::function<std::string(const std::string& path)>;

  explicit oom_reporter(device_state& d) noexcept : d_(d) {}
  oom_reporter(const oom_reporter&) = delete;
  oom_reporter& operator=(const oom_reporter&) = delete;

  // Adds an observer (attach_oom_observer). [device]
  void attach(oom_observer observer) { observers_.push_back(std::move(observer)); }
  // A copy of the observers, to run once the locks are released. [device, or world]
  [[nodiscard]] std::vector<oom_observer> observers() const { return observers_; }
  // The public wrapper's writer (it owns the snapshot code). [none] before the device is shared
  void set_snapshot_writer(snapshot_writer writer) noexcept { snapshot_writer_ = std::move(writer); }
  // Counts the OOM, builds the message for request p, writes the snapshot
  // when one is due, runs the observers (the world lock released meanwhile)
  // and throws out_of_memory_error. [world] drops it for the observers
  [[noreturn]] void throw_out_of_memory(const alloc_params& p, world_lock& w);

 private:
  // The snapshot path to write now, or empty (none configured, or one was
  // written less than oom_snapshot_interval_s ago: `msg` then says so). [world]
  std::string claim_snapshot(std::string& msg);

  device_state& d_;
  std::vector<oom_observer> observers_;
  snapshot_writer snapshot_writer_;
  std::optional<std::uint64_t> last_snapshot_us_;  // steady clock, when the last was written [world]
};

}  // namespace ccalloc::detail
