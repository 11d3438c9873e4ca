// One device's state: construction, teardown (every segment back to the
// device) and the memory-fraction cap.
#include <ccalloc/core/device_caching_allocator.hpp>

#include "detail/device_state.hpp"
#include "detail/format.hpp"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

namespace ccalloc::detail {

namespace {
std::atomic<std::uint64_t> next_state_id{1};
}  // namespace

std::uint64_t fresh_state_key() noexcept { return next_state_id.fetch_add(1, std::memory_order_relaxed); }

device_state::device_state(int device, device_backend& backend, allocator_config config)
    : device_(device),
      backend_(backend),
      id_(fresh_state_key()),
      registry_(*this, id_),
      policy_(std::move(config)) {
  memory_.set_total(backend_.mem_get_info(device_).total_bytes);
  expandable_.check_supported(policy_.config());
  apply_thread_cache_setting(policy_.config());
  stats_.max_split_size = policy_.config().max_split_size_bytes == std::numeric_limits<std::size_t>::max()
                              ? -1
                              : static_cast<std::int64_t>(policy_.config().max_split_size_bytes);
  if (policy_.config().memory_fraction_set) {
    world_lock w(*this);
    set_memory_fraction(policy_.config().per_process_memory_fraction, w);
  }
}

void device_state::apply_thread_cache_setting(const allocator_config& config) {
  if (!config.thread_cache_set) return;
  thread_caches_.small_only.store(config.thread_cache == thread_cache_mode::small, std::memory_order_relaxed);
  thread_caches_.enabled.store(config.thread_cache != thread_cache_mode::off, std::memory_order_relaxed);
}

device_state::~device_state() {
  std::vector<event_t> fence_events;
  for (auto& [stream, ss] : registry_.all())
    for (const page_fences::fence& f : ss->fences.outstanding()) fence_events.push_back(f.event);
  events_.destroy_all(fence_events);
  // Deferred unmaps first (segment::retired): their handles may be mapped
  // in another segment too, released there (unless nothing took them).
  std::vector<physical_handle_t> given_up;  // released once every retired mapping is gone
  for (auto& [base, seg] : segments_)
    for (const segment::retired_page& r : seg->pages.retired()) {
      try {
        backend_.vm_unmap(device_, reinterpret_cast<void*>(base + r.index * seg->page_bytes), seg->page_bytes);
        if (r.release) given_up.push_back(r.handle);
      } catch (...) {  // teardown: the mapping stays with the device; the others still go
      }
    }
  for (physical_handle_t h : given_up) {
    try {
      backend_.vm_release_handle(device_, h);
    } catch (...) {  // teardown: as above
    }
  }
  for (auto& [base, seg] : segments_) {
    try {
      if (seg->expandable) {
        for (std::size_t i = 0; i < seg->pages.count(); ++i) {
          if (!seg->pages.mapped(i)) continue;
          backend_.vm_unmap(device_, reinterpret_cast<void*>(base + i * seg->page_bytes), seg->page_bytes);
          backend_.vm_release_handle(device_, seg->pages.handle(i));
        }
        backend_.vm_release(device_, reinterpret_cast<void*>(base), seg->size);
      } else {
        release_segment_memory(*seg);  // reads the head block's pool: before the blocks go
      }
    } catch (...) {  // teardown: this segment stays with the device; the others still go
    }
    for (block* b = seg->head; b != nullptr;) {
      block* next = b->next;
      delete b;
      b = next;
    }
  }
}

void device_state::record_stream(block* b, stream_t stream) {
  if (stream != b->stream) {  // the block's stream is fixed while it is allocated
    std::lock_guard registry(registry_.mutex());
    registry_.check_recorded_stream(stream);
  }
  std::lock_guard lock(b->pool->owner->mutex);
  refuse_record_stream_if_paused(*b);
  if (stream == b->stream) return;
  if (std::find(b->stream_uses.begin(), b->stream_uses.end(), stream) == b->stream_uses.end())
    b->stream_uses.push_back(stream);
  b->reuse_version = no_reuse_version;  // its free waits for events: never parked
}

void device_state::refuse_record_stream_if_paused(const block& b) const {
  if (b.seg->paused) [[unlikely]]  // written under the world lock, which holds b's stream's lock
    throw invalid_argument_error("ccalloc: record_stream of the block at " + std::to_string(b.ptr) +
                                 " on device " + std::to_string(device_) + ": its tag '" +
                                 tag_name(tag_of(*b.seg)) +
                                 "' is paused (its pages are released; no stream may use it until resume)");
}

}  // namespace ccalloc::detail
