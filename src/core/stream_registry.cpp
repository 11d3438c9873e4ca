// The device's stream registry (stream_registry.hpp): a stream_state per
// stream met, the thread-local cache of the last one, destroyed streams.
#include <ccalloc/core/device_caching_allocator.hpp>

#include <ccalloc/base/detail/fork_handlers.hpp>
#include <ccalloc/base/detail/thread_object.hpp>

#include "detail/device_state.hpp"
#include "detail/stats_sink.hpp"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace ccalloc::detail {

// A use on a stream that is not live (destroyed, never created, another
// device's) is refused: the block's free would record an event on it, fail
// and keep the block. The block's own stream is ignored below, gone or not.
void stream_registry::check_recorded_stream(stream_t stream) const {
  // One message whether or not the allocator still has the stream's state
  // (a destroyed stream's goes once its memory moved on: forget_gone_streams).
  const auto known = streams_.find(stream);
  if (known != streams_.end() && !known->second->gone) return;
  if (d_.backend().is_stream(d_.device(), stream)) return;  // a destroyed handle made again is a new stream
  throw invalid_argument_error("ccalloc: record_stream on stream " + std::to_string(stream) + " of device " +
                               std::to_string(d_.device()) +
                               ", which is not a live stream of that device (never created, destroyed, or of "
                               "another device)");
}

// stream_destroyed (gone) and stream_created (not gone). A stream that
// goes: its queued work completes first (synchronize_stream, before anything
// changes), so its fences, every free on it so far and every use of a live
// block on it (record_stream) are complete: the uses are dropped (their
// frees record nothing on it), and frees of its own blocks fence nothing.
void stream_registry::set_stream_gone(stream_t stream, bool gone, const std::function<void()>& destroy) {
  if (!gone) {  // nothing to do (the usual case: a new handle) without the world lock
    std::lock_guard lock(registry_mutex_);
    const auto it = streams_.find(stream);
    if (it == streams_.end() || !it->second->gone) return;
  }
  world_lock w(d_);
  if (gone) {
    mark_gone(w, stream);
    if (destroy) {
      try {
        destroy();
      } catch (...) {  // the stream lives on
        revive(stream);
        throw;
      }
    }
    forget_thread_stream();  // this thread's next malloc on it finds it gone
    return;
  }
  revive(stream);
}

void stream_registry::revive(stream_t stream) noexcept {
  const auto it = streams_.find(stream);
  if (it == streams_.end() || !it->second->gone) return;
  it->second->gone = false;
  --gone_streams_;
}

void stream_registry::mark_gone(world_lock&, stream_t stream) {
  d_.backend().synchronize_stream(d_.device(), stream);  // may throw: nothing changed
  if (stream_uses_noted_.load(std::memory_order_relaxed))  // written under a stream lock, which w holds
    for (auto& [base, seg] : d_.segments())
      for (block* b = seg->head; b != nullptr; b = b->next)
        std::erase(b->stream_uses, stream);
  const auto it = streams_.find(stream);
  if (it == streams_.end()) return;
  stream_state& ss = *it->second;
  if (!ss.gone) ++gone_streams_;
  ss.gone = true;
  ss.fences.drop_outstanding([&](event_t e) { d_.events().give_event(e); });
  ss.fences.all_completed(ss.free_seq);
  ss.release_cached = true;  // release_gone_caches
  d_.expandable().note_gone_empty();  // its empty reservations go (release_gone_empty_reservations)
}

// Whether no other stream may take a gone stream's cached memory over:
// plain segments without reuse_across_streams (adopt_idle_segment),
// reservations without it or without trim_on_new_peak (idle_reservation).
bool stream_registry::gone_caches_unshared() const noexcept {
  const allocator_config& c = d_.policy().config();
  return !c.reuse_across_streams || !c.trim_on_new_peak;
}

// What no other stream may take over of a gone stream's cached memory
// (gone_caches_unshared) goes back to the device as emptyCache returns it
// (whole plain segments; the whole pages of free blocks in its
// reservations, then each reservation left empty), with the same
// statistics, history and mapping announcements, so that the stream's
// state is forgotten once its last block is freed. Its work has completed
// (mark_gone), so nothing waits; a block used on other streams
// (record_stream) reaches the pools only once their events complete. A
// device error leaves the rest for the next world lock; nothing while a
// capture is underway (no device frees then).
void stream_registry::release_gone_caches(world_lock& w) noexcept {
  if (!gone_caches_unshared() || d_.pools().capture_underway()) return;
  const bool plain = !d_.policy().config().reuse_across_streams;
  for (stream_state* ss : w.streams()) {
    if (!ss->gone || !ss->release_cached) continue;
    ss->release_cached = false;
    try {
      if (plain) {
        d_.segments().release_blocks(ss->pools.large);
        d_.segments().release_blocks(ss->pools.small);
      }
      if (ss->segments != 0) d_.expandable().release_stream_reservations(*ss);
    } catch (...) {
      ss->release_cached = true;  // tried again at the next world lock
    }
  }
}

namespace {

// The devices that met the calling thread's per-thread default stream; at
// the thread's exit each is handed the stream's handle.
struct thread_stream_record {
  stream_t handle = 0;
  std::vector<std::shared_ptr<ended_thread_streams>> devices;
  thread_stream_record() = default;
  thread_stream_record(const thread_stream_record&) = delete;
  thread_stream_record& operator=(const thread_stream_record&) = delete;
  ~thread_stream_record() {
    for (const auto& d : devices) {
      std::lock_guard lock(d->mutex);
      if (!d->alive) continue;
      try {
        d->ended.push_back(handle);
      } catch (...) {  // host memory exhausted: the device keeps the state, as before
        continue;
      }
      d->any.store(true, std::memory_order_relaxed);
    }
  }
};

// Not a C++ thread_local: no destructor record is allocated at a thread's
// first use (base/detail/thread_object.hpp).
using thread_streams_of = thread_object<thread_stream_record>;

}  // namespace

stream_registry::~stream_registry() {
  std::lock_guard lock(ended_->mutex);
  ended_->alive = false;
  ended_->ended.clear();
}

void stream_registry::note_thread_stream(stream_t stream) {
  if (!device_backend::is_calling_thread_stream(stream)) return;
  thread_stream_record& r = thread_streams_of::get();
  r.handle = stream;
  if (std::find(r.devices.begin(), r.devices.end(), ended_) != r.devices.end()) return;
  // Devices that are gone take nothing: drop them here.
  std::erase_if(r.devices, [](const std::shared_ptr<ended_thread_streams>& d) {
    std::lock_guard lock(d->mutex);
    return !d->alive;
  });
  r.devices.push_back(ended_);
}

void stream_registry::end_thread_streams(world_lock& w) noexcept {
  if (!ended_->any.load(std::memory_order_relaxed)) [[likely]]
    return;
  std::vector<stream_t> ended;
  {
    std::lock_guard lock(ended_->mutex);
    ended.swap(ended_->ended);
    ended_->any.store(false, std::memory_order_relaxed);
  }
  for (std::size_t i = 0; i < ended.size(); ++i) {
    try {
      if (streams_.contains(ended[i])) mark_gone(w, ended[i]);
    } catch (...) {  // the wait failed: this stream and the rest wait for the next world lock
      ended.erase(ended.begin(), ended.begin() + static_cast<std::ptrdiff_t>(i));
      std::lock_guard lock(ended_->mutex);
      try {
        ended_->ended.insert(ended_->ended.end(), ended.begin(), ended.end());
      } catch (...) {  // host memory exhausted: those states stay, as a live stream's
      }
      ended_->any.store(!ended_->ended.empty(), std::memory_order_relaxed);
      return;
    }
  }
}

std::size_t stream_registry::ended_pending() const {
  std::lock_guard lock(ended_->mutex);
  return ended_->ended.size();
}

void stream_registry::refuse_malloc(stream_t stream) const {
  forget_thread_stream();
  throw invalid_argument_error("ccalloc: malloc on stream " + std::to_string(stream) + " of device " +
                               std::to_string(d_.device()) +
                               ", which is not a live stream of that device (never created, or destroyed)");
}

namespace {

// Every thread's cached stream entry (stream_cache_entry), for the world
// lock holders that decide whether a forgotten state may be deleted. The
// mutex is a leaf: nothing is locked under it (rank leaf around a fork).
struct cache_entries {
  std::mutex mutex;
  std::vector<const stream_cache_entry*> entries;  // [mutex]
  // Bumped whenever an entry stops naming a state or goes: a forgotten
  // state kept for an entry may be deleted now.
  std::atomic<std::uint64_t> changes{1};
  fork_registration fork{fork_rank::leaf,
                         fork_hooks{this, [](void* self) noexcept { static_cast<cache_entries*>(self)->mutex.lock(); },
                                    [](void* self, bool) noexcept {
                                      static_cast<cache_entries*>(self)->mutex.unlock();
                                    }}};
};

// Never destroyed: threads may exit after the static destructors have run.
cache_entries& all_cache_entries() {
  static cache_entries* const e = new cache_entries;
  return *e;
}

// A thread's enlistment of its entry: listed from its first registry lookup
// to its exit.
struct cache_enlistment {
  const stream_cache_entry* entry = nullptr;
  cache_enlistment() = default;
  cache_enlistment(const cache_enlistment&) = delete;
  cache_enlistment& operator=(const cache_enlistment&) = delete;
  ~cache_enlistment() {
    if (entry == nullptr) return;
    cache_entries& all = all_cache_entries();
    std::lock_guard lock(all.mutex);
    std::erase(all.entries, entry);
    all.changes.fetch_add(1, std::memory_order_release);
  }
};

}  // namespace

void stream_registry::enlist_thread(const stream_cache_entry& entry) {
  cache_enlistment& me = thread_object<cache_enlistment>::get();
  if (me.entry != nullptr) [[likely]]
    return;
  cache_entries& all = all_cache_entries();
  std::lock_guard lock(all.mutex);
  all.entries.push_back(&entry);
  me.entry = &entry;
}

void stream_registry::note_entry_change() noexcept {
  all_cache_entries().changes.fetch_add(1, std::memory_order_release);
}

// An entry names a state only while its thread may use it: the thread
// replaces it (registered_slot, release) only once done with the state, so
// a state no entry names (read with acquire, under this device's registry
// lock, under which alone an entry comes to name one of its states) is
// reached by no thread and may be deleted.
void stream_registry::reclaim_limbo(bool fresh) noexcept {
  cache_entries& all = all_cache_entries();
  const std::uint64_t changes = all.changes.load(std::memory_order_acquire);
  if (!fresh && changes == limbo_checked_) return;
  limbo_checked_ = changes;
  std::vector<std::unique_ptr<stream_state>> unreached;
  {
    std::lock_guard lock(all.mutex);
    const auto named = [&](const stream_state* ss) {
      return std::any_of(all.entries.begin(), all.entries.end(), [&](const stream_cache_entry* e) {
        return e->state.load(std::memory_order_acquire) == ss;
      });
    };
    for (std::size_t i = 0; i < limbo_.size();) {
      if (named(limbo_[i].get())) {
        ++i;
        continue;
      }
      try {
        unreached.push_back(std::move(limbo_[i]));
      } catch (...) {  // no host memory for the list: deleted at a later look
        ++i;
        continue;
      }
      limbo_[i] = std::move(limbo_.back());
      limbo_.pop_back();
    }
  }
  // unreached's states are deleted here, the entries' lock let go.
}

// A gone stream's state goes once it holds no segment: nothing refers to it
// then (blocks belong to segments; parked blocks count as allocated; its
// fences went when it was destroyed; a retired page names the stream that
// freed it, and such a page keeps its segment, so none names it unless the
// segment moved: checked). It leaves the registry at once, and is deleted
// once no thread's cached entry names it (reclaim_limbo).
void stream_registry::forget_gone_streams(world_lock& w) noexcept {
  if (!limbo_.empty()) [[unlikely]]
    reclaim_limbo(false);
  if (gone_streams_ == 0) [[likely]]
    return;
  release_gone_caches(w);
  d_.expandable().release_gone_empty_reservations();
  const auto names_retired = [&](const stream_state* ss) {
    if (d_.expandable().retired_pages() == 0) return false;
    for (const auto& [base, seg] : d_.segments())
      for (const segment::retired_page& r : seg->pages.retired())
        if (r.owner == ss) return true;
    return false;
  };
  bool forgot = false;
  for (std::size_t i = 0; i < w.streams().size();) {
    stream_state* ss = w.streams()[i];
    if (!ss->gone || ss->segments != 0 || !ss->fences.empty() || names_retired(ss)) {
      ++i;
      continue;
    }
    try {
      limbo_.reserve(limbo_.size() + 1);  // the push_back below then cannot throw
    } catch (...) {  // no host memory: forgotten at a later world lock
      ++i;
      continue;
    }
    publish_pending_stats(d_.stats().values(), *ss);
    w.drop(ss);  // streams()[i] is the next one now
    --gone_streams_;
    by_handle_.erase(std::lower_bound(by_handle_.begin(), by_handle_.end(), ss->stream,
                                      [](const stream_state* a, stream_t h) { return a->stream < h; }));
    auto node = streams_.extract(ss->stream);
    limbo_.push_back(std::move(node.mapped()));
    forgot = true;
  }
  if (!forgot) return;
  cache_key_.store(fresh_state_key(), std::memory_order_relaxed);
  reclaim_limbo(true);
}

}  // namespace ccalloc::detail
