// Locks and statistics publishing. world_lock takes every lock of a device
// in the lock order (see detail/device_state.hpp); a stream's statistics
// collected while stats_mutex_ was busy (stats_sink, detail/stats_sink.hpp)
// are merged into the device's by publish_pending_stats (every stream's:
// device_statistics::publish_all_pending).
#include <ccalloc/core/device_caching_allocator.hpp>

#include "detail/device_state.hpp"

#include <ccalloc/base/detail/assert.hpp>
#include <ccalloc/base/detail/locked_callback.hpp>
#include <ccalloc/base/detail/spin_mutex.hpp>
#include <ccalloc/base/errors.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace ccalloc::detail {

world_lock::world_lock(device_state& d) : d_(d) {
  // The announcing thread holds every lock of its device while a mapping
  // listener runs: a call from the listener back into an allocator would
  // wait for itself (and so would one from the other callbacks counted there).
  if (tls_mapping_listener_depth != 0 && tls_locked_callback != nullptr) [[unlikely]]
    throw invalid_argument_error(locked_callback_message("a call into the allocator (device " + std::to_string(d.device()) + ")"));
  if (tls_mapping_listener_depth != 0) [[unlikely]]
    throw invalid_argument_error("ccalloc: a mapping listener called into the allocator (device " + std::to_string(d.device()) +
                "), which the announcing thread holds locked; a listener must not call into any ccalloc "
                "allocator (ccalloc/core/mapping_events.hpp)");
  lock();
  drain_thread_caches(d_, *this);  // the world sees no parked block (detail/thread_cache.hpp)
  d_.registry().end_thread_streams(*this);  // exited threads' per-thread streams are gone
}
world_lock::~world_lock() {
  if (!locked_) return;
  d_.tags().forget_empty_tags(*this);
  d_.registry().forget_gone_streams(*this);
  unlock();
}

void world_lock::drop(stream_state* ss) noexcept {
  ss->mutex.unlock();
  std::erase(streams_, ss);
}

void world_lock::lock() {
  d_.registry().registry_mutex_.lock();
  try {
    // By stream handle (unique per device): the lock order, and the order of
    // every slow-path loop over the streams (streams()). The registry keeps
    // them in that order.
    streams_ = d_.registry().by_handle_;
  } catch (...) {  // out of host memory: nothing is locked, nothing changed
    d_.registry().registry_mutex_.unlock();
    throw;
  }
  // Whatever the holder changes (configuration, page fences, the slow path),
  // the blocks the thread caches hold stop being reusable
  // (block::reuse_version): each stream's pools change version once it is
  // locked (one pass: a stream's state is read once).
  for (stream_state* ss : streams_) {
    ss->mutex.lock();
    ss->pools.small.blocks.bump_version();
    ss->pools.large.blocks.bump_version();
  }
  d_.device_mutex().lock();
  d_.stats().mutex().lock();
  locked_ = true;
  ++tls_world_locks_held;  // a fork from a callback under it takes no lock (fork_handlers.hpp)
}

void world_lock::unlock() {
  locked_ = false;
  --tls_world_locks_held;
  d_.stats().mutex().unlock();
  d_.device_mutex().unlock();
  for (auto it = streams_.rbegin(); it != streams_.rend(); ++it) (*it)->mutex.unlock();
  d_.registry().registry_mutex_.unlock();
}

// Around a fork (base/detail/fork_handlers.hpp). The device's world lock
// (rank device), without draining the thread caches: the child's first world
// lock drains them, the parked blocks of the parent's other threads included
// (their records stay listed in the child, their threads gone). Then the
// locks taken under it (rank device_inner): the thread caches' core and
// records (their order), the list of exited threads' streams, the capture scopes', the history's, the mapping
// listeners'. Out of host memory for the world lock's list of streams, the
// device stays unlocked for this fork (as without the handlers).
void device_state::register_fork_hooks() {
  fork_outer_.emplace(fork_rank::device,
                      fork_hooks{this,
                                 [](void* self) noexcept {
                                   try {
                                     static_cast<device_state*>(self)->fork_world_.lock();
                                   } catch (...) {
                                   }
                                 },
                                 [](void* self, bool) noexcept {
                                   world_lock& w = static_cast<device_state*>(self)->fork_world_;
                                   if (w.locked()) w.unlock();
                                 }});
  fork_inner_.emplace(fork_rank::device_inner,
                      fork_hooks{this,
                                 [](void* self) noexcept {
                                   device_state& d = *static_cast<device_state*>(self);
                                   thread_cache_core& core = *d.thread_caches().core();
                                   core.mutex.lock();
                                   for (thread_cache_record* r : core.records) r->lock.lock();
                                   d.registry().ended_mutex().lock();
                                   d.pools().scopes().fork_lock();
                                   d.history().fork_lock();
                                   d.mapping().fork_lock();
                                 },
                                 [](void* self, bool) noexcept {
                                   device_state& d = *static_cast<device_state*>(self);
                                   d.mapping().fork_unlock();
                                   d.history().fork_unlock();
                                   d.pools().scopes().fork_unlock();
                                   d.registry().ended_mutex().unlock();
                                   thread_cache_core& core = *d.thread_caches().core();
                                   for (thread_cache_record* r : core.records) r->lock.unlock();
                                   core.mutex.unlock();
                                 }});
}

void device_state::cancel_fork_hooks() noexcept {
  if (fork_inner_) fork_inner_->cancel();
  if (fork_outer_) fork_outer_->cancel();
}

void publish_pending_stats(device_stats& into, stream_state& s) noexcept {
  if (!s.has_pending_stats) return;
  s.has_pending_stats = false;
  device_stats& pending = s.pending_stats;
  auto merge = [](stat& to, stat& from) {
    const std::int64_t before = to.current;
    to.current += from.current;
    to.allocated += from.allocated;
    to.freed += from.freed;
    to.peak = std::max({to.peak, before + from.peak, to.current});
    from = stat{};
  };
  auto merge_array = [&](stat_array& to, stat_array& from) {
    for (std::size_t i = 0; i < stat_group_count; ++i) merge(to[i], from[i]);
  };
  merge_array(into.allocation, pending.allocation);
  merge_array(into.segment, pending.segment);
  merge_array(into.active, pending.active);
  merge_array(into.inactive_split, pending.inactive_split);
  merge_array(into.allocated_bytes, pending.allocated_bytes);
  merge_array(into.reserved_bytes, pending.reserved_bytes);
  merge_array(into.active_bytes, pending.active_bytes);
  merge_array(into.inactive_split_bytes, pending.inactive_split_bytes);
  merge_array(into.requested_bytes, pending.requested_bytes);
  merge(into.oversize_allocations, pending.oversize_allocations);
  merge(into.oversize_segments, pending.oversize_segments);
  for (auto field : {&device_stats::num_alloc_retries, &device_stats::num_ooms, &device_stats::num_sync_all_streams,
                     &device_stats::num_device_alloc, &device_stats::num_device_free,
                     &device_stats::num_device_synchronizations, &device_stats::num_pages_remapped,
                     &device_stats::num_pages_mapped, &device_stats::num_pages_unmapped,
                     &device_stats::bytes_moved_between_streams, &device_stats::num_stream_waits}) {
    into.*field += pending.*field;
    pending.*field = 0;
  }
}

namespace {

// True when no current value of `s` is negative (all published: a count or
// a byte total below zero is a bookkeeping mistake).
[[maybe_unused]] bool no_negative_current(const device_stats& s) noexcept {
  for (const stat_array* a : {&s.allocation, &s.segment, &s.active, &s.inactive_split, &s.allocated_bytes,
                              &s.reserved_bytes, &s.active_bytes, &s.inactive_split_bytes, &s.requested_bytes})
    for (const stat& x : *a)
      if (x.current < 0) return false;
  return s.oversize_allocations.current >= 0 && s.oversize_segments.current >= 0;
}

}  // namespace

void device_statistics::publish_all_pending(const world_lock& w) {
  for (stream_state* ss : w.streams()) publish_pending_stats(values_, *ss);
  CCALLOC_ASSERT(no_negative_current(values_));
}

}  // namespace ccalloc::detail
