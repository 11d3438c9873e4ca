// The thread cache's two fast operations, inline: hot_path.cpp calls them
// first in device_caching_allocator::malloc and free. Design, statistics and
// locks: thread_cache.hpp.
#pragma once

#include "device_state.hpp"
#include "thread_cache.hpp"

namespace ccalloc::detail {

// A hit: the block counts as freed and allocated again. [record lock]
inline void thread_cache_count_hit(thread_cache_record& r, const block* b, std::size_t requested) noexcept {
  const std::size_t k = b->pool->is_small ? 0 : 1;
  r.hits.blocks[k] += 1;
  r.hits.bytes[k] += static_cast<std::int64_t>(b->size);
  r.hits.requested_bytes[k] += static_cast<std::int64_t>(requested);
  if (b->counted_oversize) r.hits.oversize += 1;
  r.hits.any = true;
}

// A parked block of this thread for (requested_bytes, stream), or nullptr
// (then this thread's parked blocks of `s` are freed, and the caller goes on
// with the normal malloc).
inline block* thread_cache_take(device_state& s, std::size_t requested_bytes, stream_t stream) {
  thread_cache_record* r = tls_last_record;
  if (r == nullptr || r->device_id != s.id_) [[unlikely]] {
    if (!s.thread_caches_.enabled.load(std::memory_order_relaxed)) return nullptr;
    r = thread_cache_find(s, true);  // a thread that only allocates finds it at once next time
    if (r == nullptr) return nullptr;
  }
  if (r->count.load(std::memory_order_relaxed) == 0) return nullptr;
  // Pending events and captures go the normal way (events are processed
  // there; a capture may route to a private pool).
  if ((s.pending_event_count_.load(std::memory_order_relaxed) | s.capture_count_.load(std::memory_order_relaxed)) !=
      0) [[unlikely]] {
    thread_cache_drain_own(s, *r);
    return nullptr;
  }
  r->lock.lock();
  const std::uint32_t count = r->count.load(std::memory_order_relaxed);  // a world lock may have emptied it
  for (std::uint32_t i = count; i-- > 0;) {  // the most recently parked first
    thread_cache_record::slot& sl = r->slots[i];
    if (sl.stream == stream && sl.requested == requested_bytes) {
      block* b = sl.b;
      sl = r->slots[count - 1];
      r->count.store(count - 1, std::memory_order_relaxed);
      thread_cache_count_hit(*r, b, requested_bytes);
      r->lock.unlock();
      r->miss_streak = 0;
      return b;
    }
  }
  r->lock.unlock();
  if (count != 0) {
    if (r->miss_streak < thread_cache_miss_limit) ++r->miss_streak;
    thread_cache_drain_own(s, *r);
  }
  return nullptr;
}

// Frees this thread's parked blocks of `s`, if any (a malloc that does not
// go through thread_cache_take: memory history).
inline void thread_cache_flush_own(device_state& s) {
  thread_cache_record* r = tls_last_record;
  if (r == nullptr || r->device_id != s.id_) r = thread_cache_find(s, false);
  if (r != nullptr && r->count.load(std::memory_order_relaxed) != 0) thread_cache_drain_own(s, *r);
}

// Parks `b` (the caller frees it) in this thread's cache; false: not
// cacheable or no room, free it the normal way.
inline bool thread_cache_park(device_state& s, block* b) {
  if (!s.thread_caches_.enabled.load(std::memory_order_relaxed) || !b->stream_uses.empty() ||
      b->pool->priv != nullptr || !s.caching_ || s.capture_underway() ||
      (s.thread_caches_.small_only.load(std::memory_order_relaxed) && !b->pool->is_small)) [[unlikely]]
    return false;
  thread_cache_record* r = tls_last_record;
  if (r == nullptr || r->device_id != s.id_) [[unlikely]] {
    r = thread_cache_find(s, true);
    if (r == nullptr) return false;
  }
  if (r->miss_streak == thread_cache_miss_limit && ++r->probe % thread_cache_probe_every != 0) [[unlikely]]
    return false;  // this thread's frees are not being reused: the normal free
  // Full (only this thread fills it; a world lock may have emptied it since,
  // which costs one park): no lock needed to see it.
  if (r->count.load(std::memory_order_relaxed) == thread_cache_slots) [[unlikely]]
    return false;
  r->lock.lock();
  const std::uint32_t count = r->count.load(std::memory_order_relaxed);
  if (count == thread_cache_slots) [[unlikely]] {
    r->lock.unlock();
    return false;
  }
  r->slots[count] = {b, b->pool->owner->stream, b->requested_bytes};
  r->count.store(count + 1, std::memory_order_relaxed);
  r->lock.unlock();
  return true;
}

}  // namespace ccalloc::detail
