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

// The rest of thread_cache_take and thread_cache_park, out of line
// (thread_cache.cpp): the cache is on, or this thread has a record.
block* thread_cache_take_slow(device_state& s, thread_cache_record* r, std::size_t requested_bytes, stream_t stream);
bool thread_cache_park_slow(device_state& s, block* b);

// A parked block of this thread for (requested_bytes, stream), or nullptr
// (then this thread's parked blocks of `s` are freed, and the caller goes on
// with the normal malloc). With the cache off (the default) and no record
// of this thread: one relaxed load, inlined; the rest is out of line.
inline block* thread_cache_take(device_state& s, std::size_t requested_bytes, stream_t stream) {
  thread_cache_record* r = tls_last_record;
  if (r == nullptr && !s.thread_caches_.enabled.load(std::memory_order_relaxed)) [[likely]]
    return nullptr;
  return thread_cache_take_slow(s, r, requested_bytes, stream);
}

// Frees this thread's parked blocks of `s`, if any (a malloc that does not
// go through thread_cache_take: memory history).
inline void thread_cache_flush_own(device_state& s) {
  thread_cache_record* r = tls_last_record;
  if (r == nullptr || r->device_id != s.id_) r = thread_cache_find(s, false);
  if (r != nullptr && r->count.load(std::memory_order_relaxed) != 0) thread_cache_drain_own(s, *r);
}

// Parks `b` (the caller frees it) in this thread's cache; false: not
// cacheable or no room, free it the normal way. With the cache off (the
// default): one relaxed load, inlined; the rest is out of line.
inline bool thread_cache_park(device_state& s, block* b) {
  if (!s.thread_caches_.enabled.load(std::memory_order_relaxed)) [[likely]]
    return false;
  return thread_cache_park_slow(s, b);
}

}  // namespace ccalloc::detail
