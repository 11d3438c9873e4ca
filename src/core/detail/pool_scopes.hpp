// The begin_allocate_to_pool scopes of one device (SPEC F21-F22): which
// private pool a stream's allocations go to while a scope is open, and the
// streams seen capturing a graph meanwhile (private_pool_registry::capture_underway).
// Private to the core (src/core/).
#pragma once

#include <ccalloc/core/device_caching_allocator.hpp>

#include "pools.hpp"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <iterator>
#include <mutex>
#include <utility>
#include <vector>

namespace ccalloc::detail {

class pool_scopes {
 public:
  // Open scopes; one relaxed load (the hot path reads it). [none]
  [[nodiscard]] std::size_t depth() const noexcept { return count_.load(std::memory_order_relaxed); }
  [[nodiscard]] bool active() const noexcept { return depth() != 0; }

  // Opens a scope: allocations on the streams `filter` accepts go to pool
  // until it closes. [world]
  void open(private_pool* pool, stream_filter filter) {
    stack_.push_back({pool, std::move(filter)});
    count_.store(stack_.size(), std::memory_order_relaxed);
  }
  // Closes the newest scope of the pool with `id`; false (nothing changed)
  // when none is open. When the last scope closes, the capturing streams
  // are forgotten (their handles may be destroyed from then on). [world]
  bool close(mempool_id_t id) {
    auto it = std::find_if(stack_.rbegin(), stack_.rend(), [&](const entry& c) { return c.pool->id == id; });
    if (it == stack_.rend()) return false;
    stack_.erase(std::next(it).base());
    count_.store(stack_.size(), std::memory_order_relaxed);
    if (stack_.empty()) {
      std::lock_guard lock(mutex_);
      capturing_.clear();
    }
    return true;
  }
  // The pool of the newest open scope whose filter accepts `stream`, or
  // nullptr. [device] or [world]
  [[nodiscard]] private_pool* routed(stream_t stream) const {
    for (auto it = stack_.rbegin(); it != stack_.rend(); ++it)
      if (it->filter(stream)) return it->pool;
    return nullptr;
  }
  // Whether an open scope routes to `pool`. [world]
  [[nodiscard]] bool routes_to(const private_pool* pool) const noexcept {
    return std::any_of(stack_.begin(), stack_.end(), [&](const entry& c) { return c.pool == pool; });
  }

  // Remembers that `stream` captures (once). [none] takes the leaf lock
  void note_capturing(stream_t stream) {
    std::lock_guard lock(mutex_);
    if (std::find(capturing_.begin(), capturing_.end(), stream) == capturing_.end()) capturing_.push_back(stream);
  }
  // Whether a remembered stream still captures (`still(stream)`); those
  // that stopped are forgotten. [none] takes the leaf lock
  template <class StillCapturing>
  bool any_capturing(StillCapturing still) {
    std::lock_guard lock(mutex_);
    for (std::size_t i = 0; i < capturing_.size();) {
      if (still(capturing_[i])) return true;
      capturing_[i] = capturing_.back();  // the capture ended
      capturing_.pop_back();
    }
    return false;
  }

  // The fork handlers' hold of the leaf lock (base/detail/fork_handlers.hpp).
  void fork_lock() noexcept { mutex_.lock(); }
  void fork_unlock() noexcept { mutex_.unlock(); }

 private:
  struct entry {
    private_pool* pool;
    stream_filter filter;
  };
  std::vector<entry> stack_;         // oldest first [world]
  std::atomic<std::size_t> count_{0};  // stack_.size(), read without a lock
  std::mutex mutex_;                 // a leaf lock, for capturing_
  std::vector<stream_t> capturing_;  // streams seen capturing while a scope was open
};

}  // namespace ccalloc::detail
