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
  r.hits.split_blocks[k] += b->reuse_split_blocks;
  r.hits.split_bytes[k] += b->reuse_split_bytes;
  if (b->counted_oversize) r.hits.oversize += 1;
  r.hits.any = true;
}

// The rest of thread_cache_take and thread_cache_park, out of line
// (thread_cache.cpp): the cache is on, or this thread has a record.
block* thread_cache_take_slow(device_state& s, thread_cache_record* r, std::size_t requested_bytes, stream_t stream);
bool thread_cache_park_slow(device_state& s, block* b);

// Whether the pools would hand out `b` again: its pool has not changed
// since the best fit that handed it out (block::reuse_version).
inline bool thread_cache_still_reusable(const block* b) noexcept {
  return b->reuse_version == b->pool->blocks.version();
}

// Hands out the block of slot i of the `count` parked in r (a hit): the last
// slot takes its place. [record lock] Lets it go.
inline block* thread_cache_hand_out(thread_cache_record& r, std::uint32_t i, std::uint32_t count,
                                    std::size_t requested_bytes) noexcept {
  block* b = r.slots[i].b;
  if (i + 1 != count) r.slots[i] = r.slots[count - 1];
  r.count.store(count - 1, std::memory_order_relaxed);
  thread_cache_count_hit(r, b, requested_bytes);
  r.lock.unlock();
  r.miss_streak = 0;
  return b;
}

// A parked block of this thread for (requested_bytes, stream), or nullptr
// (then this thread's parked blocks of `s` are freed, and the caller goes on
// with the normal malloc). Inline: this thread's record of the device, with
// nothing parked (nullptr at once) or its newest block a hit; the rest
// (another device, other slots, events pending, a capture) out of line.
inline block* thread_cache_take(device_state& s, std::size_t requested_bytes, stream_t stream) {
  thread_cache_record* r = tls_last_record;
  if (r != nullptr && r->device_id == s.id()) [[likely]] {
    const std::uint32_t n = r->count.load(std::memory_order_relaxed);  // only this thread adds
    if (n == 0) return nullptr;
    const thread_cache_record::slot& newest = r->slots[n - 1];
    // The slots are this thread's to write: read without the lock. The
    // block is not: a world lock may free it meanwhile (then count is 0).
    if (newest.stream == stream && newest.requested == requested_bytes &&
        (s.events().pending_count() |
         s.pools().scopes().depth()) == 0) [[likely]] {
      r->lock.lock();
      if (r->count.load(std::memory_order_relaxed) == n && thread_cache_still_reusable(newest.b)) [[likely]]
        return thread_cache_hand_out(*r, n - 1, n, requested_bytes);
      r->lock.unlock();
    }
  } else if (r == nullptr && !s.thread_caches().enabled()) {
    return nullptr;
  }
  return thread_cache_take_slow(s, r, requested_bytes, stream);
}

// Frees this thread's parked blocks of `s`, if any (a malloc or free that
// does not go through thread_cache_take or thread_cache_park: memory history).
inline void thread_cache_flush_own(device_state& s) {
  thread_cache_record* r = tls_last_record;
  if (r == nullptr || r->device_id != s.id()) r = thread_cache_find(s, false);
  if (r != nullptr && r->count.load(std::memory_order_relaxed) != 0) thread_cache_drain_own(s, *r);
}

// Parks `b` (the caller frees it) in this thread's cache; false: not
// cacheable or no room, free it the normal way (this thread's parked blocks
// of `s` were freed first). Inline: the cache off, or this thread's record
// of the device empty and `b` reusable; the rest out of line.
inline bool thread_cache_park(device_state& s, block* b) {
  if (!s.thread_caches().enabled()) [[unlikely]]
    return false;
  thread_cache_record* r = tls_last_record;
  if (r != nullptr && r->device_id == s.id() && r->count.load(std::memory_order_relaxed) == 0) [[likely]] {
    // Nothing parked: nothing to free first when `b` goes to the pools. The
    // version also says that b is not record_stream'd, not of a private
    // pool, not large under thread_cache:small, and that caching is on
    // (device_state::note_reusable).
    if (!thread_cache_still_reusable(b) || s.pools().scopes().depth() != 0) return false;
    // This thread's frees are not being reused (thread_cache_record::miss_streak).
    if (r->miss_streak == thread_cache_miss_limit && ++r->probe % thread_cache_probe_every != 0) return false;
    r->lock.lock();
    r->slots[0] = {b, b->pool->owner->stream, b->requested_bytes};
    r->count.store(1, std::memory_order_relaxed);
    r->lock.unlock();
    return true;
  }
  return thread_cache_park_slow(s, b);
}

}  // namespace ccalloc::detail
