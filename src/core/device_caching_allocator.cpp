// device_caching_allocator, the public face of one device's caching
// allocator: construction, configuration and control (fraction, caching,
// peers, OOM observers, emptyCache, statistics). malloc and free are in
// hot_path.cpp, the pool API in private_pools.cpp, inspection in
// inspection.cpp, history in device_history.cpp.
#include <ccalloc/core/device_caching_allocator.hpp>

#include "detail/device_state.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace ccalloc {

using detail::block;
using detail::world_lock;

device_caching_allocator::device_caching_allocator(int device, device_backend& backend, allocator_config config)
    : device_(device) {
  if (device < 0 || device >= backend.device_count())
    throw invalid_argument_error("ccalloc: device " + std::to_string(device) + " is out of range [0, " +
                                 std::to_string(backend.device_count()) + ")");
  state_ = std::make_unique<detail::device_state>(device, backend, std::move(config));
  state_->oom().set_snapshot_writer(
      [this](const std::string& path) { return detail::write_oom_snapshot(*this, path); });
}

device_caching_allocator::~device_caching_allocator() = default;

void device_caching_allocator::record_stream(block* b, stream_t stream) { detail::record_stream(*state_, b, stream); }

void device_caching_allocator::stream_destroyed(stream_t stream, const std::function<void()>& destroy) {
  state_->registry().set_stream_gone(stream, true, destroy);
}

void device_caching_allocator::stream_created(stream_t stream) { state_->registry().set_stream_gone(stream, false); }

bool device_caching_allocator::record_stream_containing(std::uintptr_t address, stream_t stream) {
  auto& s = *state_;
  world_lock w(s);
  const detail::segment* seg = s.segments().containing(address);
  if (seg == nullptr) return false;
  for (block* b = seg->head; b != nullptr; b = b->next) {
    if (address < b->ptr || address >= b->ptr + b->size) continue;
    if (!b->allocated) return false;
    if (stream != b->stream) s.registry().check_recorded_stream(stream);  // the world lock holds the registry's
    detail::refuse_record_stream_if_paused(s, *b);  // as record_stream of its start does
    if (stream != b->stream &&
        std::find(b->stream_uses.begin(), b->stream_uses.end(), stream) == b->stream_uses.end()) {
      s.registry().note_stream_use();
      b->stream_uses.push_back(stream);
    }
    return true;
  }
  return false;
}

void device_caching_allocator::empty_cache() {
  detail::tracker_delivery deliver;  // segment_free entries reach trackers after the locks
  world_lock w(*state_);
  state_->stats().publish_all_pending(w);
  if (state_->history().active()) [[unlikely]]
    state_->history().record(trace_entry_action::empty_cache, 0, state_->memory().reserved(), 0, nullptr);
  state_->segments().take_release_failure();  // an earlier one was reported already
  state_->segments().release_cached_blocks(w, /*for_retry=*/true);  // past a segment that fails: the others go back
  state_->tags().release_host_copies();                      // host buffers kept for the next pause
  if (std::exception_ptr failure = state_->segments().take_release_failure()) std::rethrow_exception(failure);
}

void device_caching_allocator::set_memory_fraction(double fraction) {
  detail::tracker_delivery deliver;  // it may release segments
  world_lock w(*state_);
  state_->stats().publish_all_pending(w);
  detail::set_memory_fraction(*state_, fraction, w);
}

double device_caching_allocator::memory_fraction() const {
  std::lock_guard lock(state_->device_mutex());
  return state_->memory().fraction();
}

void device_caching_allocator::set_config(const allocator_config& config) {
  detail::tracker_delivery deliver;  // a new fraction may release segments
  auto& s = *state_;
  s.expandable().check_supported(config);
  world_lock w(s);
  s.stats().publish_all_pending(w);
  // A fraction set at run time (set_memory_fraction) stays unless the new
  // configuration changes per_process_memory_fraction itself.
  const bool fraction_changed = config.memory_fraction_set &&
                                (!s.policy().config().memory_fraction_set ||
                                 config.per_process_memory_fraction != s.policy().config().per_process_memory_fraction);
  // The fraction first: if returning cached memory fails, nothing changes.
  if (fraction_changed) detail::set_memory_fraction(s, config.per_process_memory_fraction, w);
  // The thread_cache key applies when it changes (set_thread_cache_enabled
  // stays in force across configurations that keep it); the world lock
  // emptied every thread's cache.
  const bool thread_cache_changed = config.thread_cache_set != s.policy().config().thread_cache_set ||
                                    config.thread_cache != s.policy().config().thread_cache;
  s.policy().set_config(config);
  if (thread_cache_changed) s.thread_caches().apply_setting(config);
  s.stats().values().max_split_size = config.max_split_size_bytes == std::numeric_limits<std::size_t>::max()
                                ? -1
                                : static_cast<std::int64_t>(config.max_split_size_bytes);
}

allocator_config device_caching_allocator::config() const {
  world_lock w(*state_);
  return state_->policy().config();
}

void device_caching_allocator::set_caching_enabled(bool enabled) {
  detail::tracker_delivery deliver;  // turning caching off releases segments
  auto& s = *state_;
  world_lock w(s);
  s.stats().publish_all_pending(w);
  // The cache first: if returning it fails, the mode does not change.
  if (!enabled) s.segments().release_cached_blocks(w);
  s.policy().set_caching(enabled);
}

bool device_caching_allocator::caching_enabled() const {
  world_lock w(*state_);
  return state_->policy().caching();
}

device_stats device_caching_allocator::stats() const {
  world_lock w(*state_);
  state_->stats().publish_all_pending(w);
  return detail::stats_as_read(state_->stats().values());
}

void device_caching_allocator::reset_accumulated_stats() {
  world_lock w(*state_);
  state_->stats().publish_all_pending(w);
  detail::reset_accumulated_stored(state_->stats().values());
}

void device_caching_allocator::reset_peak_stats() {
  world_lock w(*state_);
  state_->stats().publish_all_pending(w);
  state_->stats().values().reset_peak();
}

void device_caching_allocator::attach_oom_observer(oom_observer observer) {
  std::lock_guard lock(state_->device_mutex());
  state_->oom().attach(std::move(observer));
}


void device_caching_allocator::enable_peer_access(int peer) {
  auto& s = *state_;
  if (peer < 0 || peer >= s.backend().device_count() || peer == device_)
    throw invalid_argument_error("ccalloc: enable_peer_access: peer device " + std::to_string(peer) +
                                 " is not another device of the backend (device " + std::to_string(device_) +
                                 ", devices [0, " + std::to_string(s.backend().device_count()) + "))");
  if (!s.backend().can_access_peer(peer, device_))
    throw backend_error("ccalloc: enable_peer_access: device " + std::to_string(peer) + " cannot access device " +
                        std::to_string(device_) + " on the '" + s.backend().name() +
                        "' backend (no peer-to-peer path)");
  world_lock w(s);
  const std::vector<int>& peers = s.expandable().peers();
  if (std::find(peers.begin(), peers.end(), peer) != peers.end()) return;
  for (auto& [base, seg] : s.segments()) {
    if (!seg->expandable) continue;
    for (std::size_t i = 0; i < seg->pages.count(); ++i)
      if (seg->pages.mapped(i))
        s.backend().vm_set_access(device_, reinterpret_cast<void*>(base + i * seg->page_bytes), seg->page_bytes, peer);
  }
  s.expandable().add_peer(peer);
}

std::vector<int> device_caching_allocator::peers() const {
  world_lock w(*state_);
  return state_->expandable().peers();
}

}  // namespace ccalloc
