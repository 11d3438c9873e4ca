// The private pools of one device (SPEC F20-F24): the pools by id, the
// begin_allocate_to_pool scopes that route allocations to them and the
// streams seen capturing (pool_scopes.hpp), and the frees deferred while a
// capture is underway. Owns those; reaches the device's streams, events and
// statistics through device_state's members (a deferred free or a
// checkpoint restore changes the device's blocks). The set of pools changes
// under the world lock and is read under the device lock or the world lock;
// the scopes have their own leaf lock; the methods say what they need.
#pragma once

#include <ccalloc/core/device_caching_allocator.hpp>
#include "block.hpp"
#include "pool_scopes.hpp"
#include "pools.hpp"

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

namespace ccalloc::detail {

class device_state;
class world_lock;

// Whether pool belongs to a private pool with users (its segments are never
// freed or unmapped). A tag's own pool is never live in this sense: its
// cache is ordinary cached memory (recycled, returned by empty_cache), as the
// default pools'. [stream]
[[nodiscard]] inline bool pool_is_live(const block_pool* pool) noexcept {
  return pool->priv != nullptr && pool->priv->use_count > 0 && !pool->priv->is_tag_pool();
}

class private_pool_registry {
 public:
  explicit private_pool_registry(device_state& d) noexcept : d_(d) {}
  private_pool_registry(const private_pool_registry&) = delete;
  private_pool_registry& operator=(const private_pool_registry&) = delete;

  // The pools by id. [device] or [world]; the set changes under [world]
  [[nodiscard]] const std::map<mempool_id_t, std::unique_ptr<private_pool>>& all() const noexcept { return pools_; }
  private_pool* find_pool(mempool_id_t id) const noexcept;                   // [device] or [world]
  // find_pool, else invalid_argument_error naming `what` and the id.
  private_pool& checked_pool(mempool_id_t id, const char* what) const;        // [device] or [world]
  // Adds a pool (create_or_incref_pool, a tag's pool). [world]
  private_pool& add(std::unique_ptr<private_pool> pp);
  // Deletes the pool `id` (a tag's pool forgotten: tag_sleep::forget_empty_tags);
  // the streams' pools in it are gone already. [world]
  void erase(mempool_id_t id) noexcept { pools_.erase(id); }
  // pp's pool on stream ss (made on first use), small or large. [world]
  static block_pool& pool_in(private_pool& pp, stream_state& ss, bool small);
  // The scopes of begin_allocate_to_pool and the streams seen capturing.
  [[nodiscard]] pool_scopes& scopes() noexcept { return scopes_; }
  [[nodiscard]] const pool_scopes& scopes() const noexcept { return scopes_; }

  // A graph capture runs where the allocator can see it: a pool scope is
  // active and a stream seen allocating during it still captures
  // (device_backend::is_capturing). Only then may the allocator not query or
  // wait for events, synchronize, or free device memory (CUDA's global
  // capture mode). A scoped pool outside a capture is ordinary allocation
  // (PyTorch has the opposite behaviour: pytorch/pytorch#159674). A capture
  // on a stream that has not allocated through this device since the scope
  // began is not seen. [none] takes the scopes' leaf lock while one is open
  [[nodiscard]] bool capture_underway() noexcept;
  // Called for each allocation while a pool scope is active: remembers
  // `stream` if it captures. [none] takes the scopes' leaf lock
  void note_if_capturing(stream_t stream);
  bool any_stream_capturing(const block* b);                                  // [stream]

  // Rung 5b (F22): a default-pool request takes a free block of a
  // set_use_on_oom pool. [world]
  bool try_use_on_oom_pools(alloc_params& p, const world_lock& w);
  // Cached whole segments of pools without users go back to the device;
  // pools without users, segments or scopes are deleted. [world]
  void release_dead_pools(const world_lock& w, bool keep_going = false);
  void delete_empty_dead_pools(const world_lock& w);

  // Frees of blocks used on other streams while a capture is underway: they
  // hold event_count = 1 (a placeholder) until flush_deferred_frees records
  // their events once no capture is underway.
  void defer_free(block* b);                                                   // [stream] takes device
  void flush_deferred_frees();                                                 // [world]
  [[nodiscard]] const std::vector<block*>& deferred_frees() const noexcept { return deferred_frees_; }  // [world]

  // Checkpoint restore (set_checkpoint_pool_state). [world]
  block* carve_allocated(segment& seg, std::uintptr_t ptr, std::size_t size, std::size_t requested);
  void free_allocated_locked(block* b);

 private:
  device_state& d_;
  std::map<mempool_id_t, std::unique_ptr<private_pool>> pools_;
  pool_scopes scopes_;
  std::vector<block*> deferred_frees_;
};

}  // namespace ccalloc::detail
