// Mapping announcements (SPEC C1): names and the listener list of a device.
#include <ccalloc/core/mapping_events.hpp>

#include "detail/mapping_notifier.hpp"

#include <ccalloc/base/detail/spin_mutex.hpp>

#include <utility>

namespace ccalloc {

std::string_view to_string(mapping_change change) noexcept {
  switch (change) {
    case mapping_change::map: return "map";
    case mapping_change::unmap: return "unmap";
    case mapping_change::move: return "move";
    case mapping_change::unmap_completed: return "unmap_completed";
  }
  return "unknown";
}

std::string_view to_string(mapping_reason reason) noexcept {
  switch (reason) {
    case mapping_reason::segment_alloc: return "segment_alloc";
    case mapping_reason::segment_free: return "segment_free";
    case mapping_reason::pages_mapped: return "pages_mapped";
    case mapping_reason::pages_recycled: return "pages_recycled";
    case mapping_reason::pages_released: return "pages_released";
    case mapping_reason::pages_retired: return "pages_retired";
    case mapping_reason::reservation_moved: return "reservation_moved";
    case mapping_reason::deferred_unmap: return "deferred_unmap";
    case mapping_reason::pages_paused: return "pages_paused";
    case mapping_reason::pages_resumed: return "pages_resumed";
  }
  return "unknown";
}

namespace detail {

void mapping_notifier::attach(mapping_listener listener) {
  std::lock_guard lock(mutex_);
  auto next = listeners_ ? std::make_shared<std::vector<mapping_listener>>(*listeners_)
                         : std::make_shared<std::vector<mapping_listener>>();
  next->push_back(std::move(listener));
  listeners_ = std::move(next);
  active_.store(true, std::memory_order_relaxed);
}

void mapping_notifier::announce(mapping_event e) const noexcept {
  std::shared_ptr<const std::vector<mapping_listener>> listeners;
  {
    std::lock_guard lock(mutex_);
    listeners = listeners_;
  }
  if (!listeners) return;
  e.device = device_;
  // While the listeners run, this thread holds the device's locks: a call
  // back into the allocator is refused (tls_mapping_listener_depth).
  struct delivering {
    delivering() noexcept { ++tls_mapping_listener_depth; }
    ~delivering() { --tls_mapping_listener_depth; }
    delivering(const delivering&) = delete;
    delivering& operator=(const delivering&) = delete;
  } guard;
  for (const mapping_listener& l : *listeners) {
    try {
      l(e);
    } catch (...) {  // dropped (mapping_events.hpp): the allocator's state is unaffected
    }
  }
}

}  // namespace detail
}  // namespace ccalloc
