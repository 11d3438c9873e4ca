// The mapping listeners of one device (SPEC C1; ccalloc/core/mapping_events.hpp).
//
// Used by device_state (a member): the code that maps or unmaps calls
// announce() at the change, with the device's locks held, when active().
// The listener list is copied on write: attach() takes mutex_, announce()
// takes it only to copy the list's pointer, then calls the listeners with
// no lock of its own held (a listener may attach another: this attach(),
// and caching_allocator::attach_mapping_listener, which does not take the
// configuration lock again when enable()/set_config() announce). While they
// run, tls_mapping_listener_depth (base/detail/spin_mutex.hpp) is nonzero on
// the announcing thread: the allocator refuses calls back into it instead
// of deadlocking (world_lock throws; a lock's slow path aborts).
#pragma once

#include <ccalloc/core/mapping_events.hpp>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace ccalloc::detail {

class mapping_notifier {
 public:
  explicit mapping_notifier(int device) : device_(device) {}

  /// A listener is attached: the allocator must call announce(). One relaxed load.
  [[nodiscard]] bool active() const noexcept { return active_.load(std::memory_order_relaxed); }

  void attach(mapping_listener listener);

  /// Calls every listener with `e` (device filled in). Never throws:
  /// listeners' exceptions are dropped, as is a failure to copy the list.
  [[gnu::cold]] void announce(mapping_event e) const noexcept;
  /// The change of [addr, addr + size_bytes) at the place it happens: one
  /// relaxed load when no listener is attached.
  void announce(mapping_change change, mapping_reason reason, std::uintptr_t addr, std::size_t size_bytes,
                stream_t stream, bool expandable) const noexcept {
    if (active()) [[unlikely]]
      announce({change, reason, device_, addr, size_bytes, stream, expandable});
  }

  /// The fork handlers' hold of the list's lock (base/detail/fork_handlers.hpp).
  void fork_lock() const noexcept { mutex_.lock(); }
  void fork_unlock() const noexcept { mutex_.unlock(); }

 private:
  int device_;
  std::atomic<bool> active_{false};
  mutable std::mutex mutex_;
  std::shared_ptr<const std::vector<mapping_listener>> listeners_;  // [mutex_]
};

}  // namespace ccalloc::detail
