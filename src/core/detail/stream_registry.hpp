// The streams of one device: a stream_state per stream met (its pools,
// lock, pending statistics and page fences), the thread-local cache of the
// last one a thread used, and the streams destroyed whose state has not
// gone yet. Owns the registry's lock and map; registry_mutex_ comes first
// in the lock order (device_state.hpp).
//
// A stream's state is forgotten only under the world lock
// (forget_gone_streams), which also changes the cache key. A thread reads
// its cached entry and locks the state it names without any lock of the
// registry, so a thread may be between the two (or between letting go of
// the stream's lock and taking the world lock: the slow path) when the
// state is forgotten: the state is deleted only once no thread's entry
// names it (stream_cache_entry), kept until then (the limbo, no longer in
// the registry). A thread that finds its state gone under the state's lock
// or the world lock looks its stream up again (live).
//
// A thread's per-thread default stream (per_thread_stream_handle, resolved
// to a handle of that thread alone, never reused) ends with the thread: the
// thread's exit hands its handle to every device that met the stream
// (ended_thread_streams, a thread_object's destructor: no lock but the
// list's), and the device's next world lock marks it gone as
// stream_destroyed does, waiting for its work first (from another thread,
// the backend waits for the device: cudaDeviceSynchronize on CUDA), so that
// its cached memory moves on and its state is forgotten.
#pragma once

#include <ccalloc/backend/device_backend.hpp>
#include <ccalloc/base/detail/spin_mutex.hpp>
#include "pools.hpp"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace ccalloc::detail {

class device_state;
class world_lock;

// One thread's cached (device, stream) -> state (stream_for). Written by its
// thread only: set under the registry lock of the state's device
// (registered_slot), cleared without one. Read by its thread on every
// malloc, and by a world lock holder deciding whether a forgotten state may
// be deleted: never while an entry names it. Atomic for those readers; the
// thread's own reads are relaxed loads (plain moves).
struct stream_cache_entry {
  std::atomic<std::uint64_t> owner_id{0};
  std::atomic<stream_t> stream{0};
  std::atomic<stream_state*> state{nullptr};
};

// What a device shares with the threads whose per-thread default stream it
// has met: the handles of those that have exited, for its next world lock.
// Outlives whichever goes last. mutex is a leaf: nothing is locked under it.
struct ended_thread_streams {
  std::mutex mutex;
  bool alive = true;             // false once the device is gone [mutex]
  std::vector<stream_t> ended;   // handles of exited threads [mutex]
  std::atomic<bool> any{false};  // ended is not empty (read without the lock)
};

class stream_registry {
 public:
  stream_registry(device_state& d, std::uint64_t cache_key)
      : d_(d), cache_key_(cache_key), ended_(std::make_shared<ended_thread_streams>()) {}
  ~stream_registry();  // threads that exit later no longer hand their stream to it
  stream_registry(const stream_registry&) = delete;
  stream_registry& operator=(const stream_registry&) = delete;

  // The state of `stream`, made on first use (checked with the backend:
  // throws invalid_argument_error for a stream that is not live). [none]
  // takes the registry's lock on a thread-cache miss (hot_path.cpp)
  stream_state& stream_for(stream_t stream);
  // Forgets the calling thread's cached entry (hot_path.cpp).
  static void forget_thread_stream() noexcept;
  // `ss` (met by this thread, now locked by w) if its stream is live; else
  // the live state its handle names now (made again meanwhile), or throws
  // invalid_argument_error: the stream was destroyed since the thread
  // looked it up (a malloc on a destroyed stream). [world]
  stream_state& live(const world_lock& w, stream_state& ss) const;
  // Throws the invalid_argument_error of a malloc on `stream`, not a live
  // stream of this device, after clearing the calling thread's cached entry
  // (the state it names may be forgotten). [any]
  [[noreturn]] void refuse_malloc(stream_t stream) const;
  // Throws invalid_argument_error naming `stream` unless it is a live stream
  // of this device (registry, then the backend), for record_stream. [registry]
  void check_recorded_stream(stream_t stream) const;
  // stream_destroyed (gone; then `destroy`, if any, under the same lock:
  // if it throws, the stream is live again) and stream_created (not gone).
  // [none] takes the world lock
  void set_stream_gone(stream_t stream, bool gone, const std::function<void()>& destroy = {});
  // Deletes the state of every gone stream that holds no segment (its
  // pending statistics published first), so that a destroyed stream costs
  // no host memory and no slow-path time once its memory has moved on.
  // It first returns the gone streams' cached memory that no other stream
  // may take over (release_gone_caches). world_lock's destructor calls it.
  // [world]
  void forget_gone_streams(world_lock& w) noexcept;
  // Marks gone the per-thread default streams of the threads that have
  // exited since the last call (their work waited for first); a stream whose
  // wait fails stays for the next world lock. world_lock's constructor calls
  // it. [world]
  void end_thread_streams(world_lock& w) noexcept;
  // Whether no other stream may adopt a gone stream's cached segments
  // (reuse_across_streams:False; for reservations also
  // trim_on_new_peak:False): they then go back to the device with it
  // (forget_gone_streams), and a free of its block takes the world lock
  // for that. [stream] or [world]: reads the configuration
  [[nodiscard]] bool gone_caches_unshared() const noexcept;
  // Exited threads' streams not yet marked gone (tests). [none]
  [[nodiscard]] std::size_t ended_pending() const;
  // Forgotten states not yet deleted: a thread's cached entry still names
  // them (tests). [registry] or [world]
  [[nodiscard]] std::size_t limbo_count() const noexcept { return limbo_.size(); }
  // The lock of the exited threads' list (a leaf), for the fork handlers.
  [[nodiscard]] std::mutex& ended_mutex() noexcept { return ended_->mutex; }

  // Every stream state, by handle. [registry] or [world]
  [[nodiscard]] const std::unordered_map<stream_t, std::unique_ptr<stream_state>>& all() const noexcept {
    return streams_;
  }
  // Every stream state in the order of their handles (the lock order):
  // kept so, as states come and go, so that the world lock need not sort
  // them. [registry] or [world]
  [[nodiscard]] const std::vector<stream_state*>& by_handle() const noexcept { return by_handle_; }
  [[nodiscard]] std::size_t gone_count() const noexcept { return gone_streams_; }  // [registry] or [world]
  // Notes that a block recorded a use on another stream (record_stream):
  // until then a destroyed stream is named by no block's stream_uses, and
  // set_stream_gone does not read every block. [stream] of the block
  void note_stream_use() noexcept { stream_uses_noted_.store(true, std::memory_order_relaxed); }
  // The registry's lock (first in the lock order), for a caller that reads
  // it without the world lock (record_stream).
  [[nodiscard]] spin_mutex& mutex() noexcept { return registry_mutex_; }
  // True while the device has at most one stream state: its statistics then
  // stay in its pending deltas without any lock and are published by
  // readers (exact: nothing else changes the device's values meanwhile).
  // Cleared, after publishing, when a second stream appears. Read under a
  // stream lock (relaxed).
  [[nodiscard]] bool single_stream() const noexcept { return single_stream_.load(std::memory_order_relaxed); }

 private:
  friend class world_lock;  // it takes registry_mutex_ and collects every state in the lock order
  stream_state& registered_slot(stream_t stream);     // [registry] hot_path.cpp
  stream_state& registered_stream(stream_t stream);   // a thread-cache miss; hot_path.cpp
  // When `stream` is the calling thread's per-thread default stream, makes
  // the thread's exit hand it to this device (throws std::bad_alloc).
  void note_thread_stream(stream_t stream);
  // stream_destroyed's work under the world lock: waits for the stream's
  // work (may throw: nothing changed), then drops its fences and uses.
  void mark_gone(world_lock& w, stream_t stream);
  // Clears the gone mark of `stream` (stream_created, a destroy that failed). [world]
  void revive(stream_t stream) noexcept;
  // The cached memory of gone streams that no other stream may take over
  // (gone_caches_unshared) back to the device, as emptyCache returns it;
  // device errors leave it for the next world lock. [world]
  void release_gone_caches(world_lock& w) noexcept;
  // Deletes the forgotten states that no thread's cached entry names any
  // more; `fresh`: some were just added (else only when an entry changed
  // since the last look). [world]
  void reclaim_limbo(bool fresh) noexcept;
  // Enlists the calling thread's cached entry, once, for reclaim_limbo
  // (throws std::bad_alloc). [none]
  static void enlist_thread(const stream_cache_entry& entry);
  // Makes the calling thread's cached entry name `ss` (of this device). [registry]
  void name_in_thread_cache(stream_state& ss) const noexcept;
  // Notes that a thread's entry stopped naming a state (reclaim_limbo looks
  // again). [none]
  static void note_entry_change() noexcept;

  device_state& d_;
  spin_mutex registry_mutex_;
  std::unordered_map<stream_t, std::unique_ptr<stream_state>> streams_;
  std::vector<stream_state*> by_handle_;  // streams_' states, by handle
  std::size_t gone_streams_ = 0;  // states in streams_ with gone set
  // Keys the thread-local stream cache (stream_for): unique per instance,
  // and drawn again whenever a stream state is deleted. Written under the
  // registry lock; read on the fast path (relaxed).
  std::atomic<std::uint64_t> cache_key_;
  std::atomic<bool> single_stream_{true};
  std::atomic<bool> stream_uses_noted_{false};  // note_stream_use was called (never cleared)
  std::shared_ptr<ended_thread_streams> ended_;  // shared with the threads that met it
  // Forgotten states that a thread's cached entry still named when they were
  // forgotten: deleted once none does (reclaim_limbo). [world]
  std::vector<std::unique_ptr<stream_state>> limbo_;
  std::uint64_t limbo_checked_ = 0;  // the entries' change count at the last look [world]
};

}  // namespace ccalloc::detail
