// One device's state: construction, teardown (events, then every segment
// back to the device: segment_table::release_all) and record_stream.
#include <ccalloc/core/device_caching_allocator.hpp>

#include "detail/device_state.hpp"
#include "detail/format.hpp"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <mutex>
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
  thread_caches_.apply_setting(policy_.config());
  stats_.values().max_split_size = policy_.config().max_split_size_bytes == std::numeric_limits<std::size_t>::max()
                              ? -1
                              : static_cast<std::int64_t>(policy_.config().max_split_size_bytes);
  if (policy_.config().memory_fraction_set) {
    world_lock w(*this);
    set_memory_fraction(*this, policy_.config().per_process_memory_fraction, w);
  }
  register_fork_hooks();
}

device_state::~device_state() {
  cancel_fork_hooks();  // a fork under way finishes first; later ones no longer see this device
  std::vector<event_t> fence_events;
  for (auto& [stream, ss] : registry_.all())
    for (const page_fences::fence& f : ss->fences.outstanding()) fence_events.push_back(f.event);
  events_.destroy_all(fence_events);
  segments_.release_all();
}

void record_stream(device_state& d, block* b, stream_t stream) {
  // The registry's lock is held until the use is noted: a destroy of
  // `stream` (its world lock takes the registry's lock first) then comes
  // before the check, or after the use is noted and drops it. Let go in
  // between, a use of a stream destroyed meanwhile stayed noted, and the
  // block's free failed recording an event on it (the block kept).
  std::unique_lock registry(d.registry().mutex(), std::defer_lock);
  if (stream != b->stream) {  // the block's stream is fixed while it is allocated
    registry.lock();
    d.registry().check_recorded_stream(stream);
  }
  std::lock_guard lock(b->pool->owner->mutex);
  refuse_record_stream_if_paused(d, *b);
  if (stream == b->stream) return;
  if (std::find(b->stream_uses.begin(), b->stream_uses.end(), stream) == b->stream_uses.end()) {
    d.registry().note_stream_use();
    b->stream_uses.push_back(stream);
  }
  b->reuse_version = no_reuse_version;  // its free waits for events: never parked
}

void refuse_record_stream_if_paused(const device_state& d, const block& b) {
  if (b.seg->paused) [[unlikely]]  // written under the world lock, which holds b's stream's lock
    throw invalid_argument_error("ccalloc: record_stream of the block at " + std::to_string(b.ptr) +
                                 " on device " + std::to_string(d.device()) + ": its tag '" +
                                 tag_name(tag_of(*b.seg)) +
                                 "' is paused (its pages are released; no stream may use it until resume)");
}

}  // namespace ccalloc::detail
