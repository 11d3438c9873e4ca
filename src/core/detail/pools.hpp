// Pools and stream states: a (stream, small or large, default or private)
// pool of free blocks, private pools, one stream's state and lock, and one
// request's parameters. Private to the core (src/core/).
#pragma once

#include <ccalloc/base/detail/spin_mutex.hpp>
#include <ccalloc/core/device_caching_allocator.hpp>
#include <ccalloc/core/stats.hpp>
#include <ccalloc/core/tags.hpp>
#include "block_index.hpp"
#include "page_fences.hpp"
#include "stat_storage.hpp"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

namespace ccalloc::detail {

struct stream_state;
struct private_pool;

// ---- pools: one (stream, small or large, default or private) ----------------------------

struct block_pool {
  explicit block_pool(bool small) : is_small(small) {}
  block_index blocks;
  bool is_small;
  bool no_split = false;          // the private pool's set_no_split (F22); false for default pools
  stream_state* owner = nullptr;  // the stream whose pool this is
  private_pool* priv = nullptr;   // the private pool it belongs to; nullptr: the default pool
  std::uint64_t get_free_blocks_call_count = 0;  // age clock for garbage collection
  std::size_t plain_segments = 0;  // plain (not expandable) segments whose blocks are in this pool [world]

  [[nodiscard]] std::uint64_t age(const block* b) const noexcept {
    return get_free_blocks_call_count - b->gc_count_base;
  }
};

// The two pools of one stream.
struct stream_pools {
  explicit stream_pools(stream_state* o) {
    small.owner = o;
    large.owner = o;
  }
  block_pool small{true};
  block_pool large{false};
};

// ---- private_pool (private_pools.cpp) --------------------------------------------------

// The first half of the id of a tag's own private pool (sleep_wake.cpp).
inline constexpr std::uint64_t tag_pool_id_first = ~std::uint64_t{0};

// A private pool (F20-F24): its id, users and options. Each stream that
// allocates to it gets its own stream_pools in stream_state::private_pools
// (blocks stay bound to their stream). Deleted (with those stream_pools) when
// its use count is 0 and it holds no segment; a tag's own pool when it holds
// no segment (tag_sleep::forget_empty_tags). [world]
struct private_pool {
  mempool_id_t id;
  // The tag its memory carries (tags.hpp): the tag in scope at its creation;
  // a tag's own pool (tag_sleep::tag_pool) has id {tag_pool_id_first, tag}.
  tag_id tag = default_tag_id;
  int use_count = 1;
  segment_allocator custom;     // empty: the backend's segments
  bool use_on_oom = false;
  bool no_split = false;
  // The segments it holds: segment_count = the length of the list from
  // segments_head (segment::pool_next), each one's head->pool->priv this
  // pool (check_invariants). A tag's pause walks them (not every segment).
  std::size_t segment_count = 0;
  segment* segments_head = nullptr;
  // A segment made in (attach) or given back from (detach) this pool. [world]
  void attach(segment& seg) noexcept {
    seg.pool_prev = nullptr;
    seg.pool_next = segments_head;
    if (segments_head != nullptr) segments_head->pool_prev = &seg;
    segments_head = &seg;
    ++segment_count;
  }
  void detach(segment& seg) noexcept {
    (seg.pool_prev != nullptr ? seg.pool_prev->pool_next : segments_head) = seg.pool_next;
    if (seg.pool_next != nullptr) seg.pool_next->pool_prev = seg.pool_prev;
    seg.pool_prev = seg.pool_next = nullptr;
    --segment_count;
  }
  // Allocations in flight to it (they may drop the world lock): not deleted
  // meanwhile. Incremented under the world lock, decremented without it.
  std::atomic<int> pinned{0};
  // A tag's own pool that held no segment when last looked at, listed for
  // tag_sleep::forget_empty_tags (each once: forget_listed). [world]
  bool forget_listed = false;
  private_pool* next_to_forget = nullptr;
  [[nodiscard]] bool is_tag_pool() const noexcept { return id.first == tag_pool_id_first && tag != default_tag_id; }
};

// Private pools by id (unique among live pools): an order that does not
// depend on host addresses.
struct private_pool_order {
  bool operator()(const private_pool* a, const private_pool* b) const noexcept { return a->id < b->id; }
};

// ---- stream_state: one stream's pools, lock and pending statistics --------------------

// Everything of one stream: its pools, its lock, and the statistics it could
// not publish because stats_mutex_ was busy (merged on the next publish).
// Cache-line aligned: each stream's hot fields (its lock, its spare-block
// list) are written by that stream's thread only; alignment keeps them off
// the lines of the stream states allocated next to it (no false sharing).
struct alignas(64) stream_state {
  explicit stream_state(stream_t s) : stream(s), pools(this) {}
  nap_lock mutex;  // one exchange and one store per uncontended lock + unlock
  stream_t stream;
  stream_pools pools;
  device_stats pending_stats;  // deltas: current may be negative; peak = max prefix
  bool has_pending_stats = false;
  std::uint32_t stats_backoff = 0;  // operations left before trying stats_mutex_ again
  std::vector<block*> spare_blocks;  // recycled block objects: no heap call per split
  // Blocks of this stream that became free so far (each takes the next
  // number as its block::free_seq): the count its page fences cover. [stream]
  std::uint64_t free_seq = 0;
  // Destroyed (device_caching_allocator::stream_destroyed): its work has
  // completed and nothing is recorded on it; malloc on it is refused. [world
  // to write; stream or device to read]
  bool gone = false;
  // Segments whose blocks are in its pools, default and private (plain and
  // expandable). A gone stream that holds none is forgotten: its state is
  // deleted when the world lock that saw it empty is released
  // (stream_registry::forget_gone_streams). [stream to write; world to read]
  std::size_t segments = 0;
  // Gone, and memory became free in its pools since its last release
  // (stream_registry::release_gone_caches). [stream to set; world]
  bool release_cached = false;
  // Its page fences (page_fences.hpp). [world]; record also [stream + device]
  page_fences fences;
  // Its frees of blocks of at least this many bytes record a page fence
  // (placement_policy::free_records_fence): a page, where the stream is not the
  // legacy default stream and another stream allocates too; else never
  // (SIZE_MAX). Set when the stream or the second stream registers. [stream]
  std::size_t fence_free_bytes = std::numeric_limits<std::size_t>::max();
  // This stream's pools inside private pools (F20), in the order of the
  // pools' ids (not their host addresses: release_dead_pools returns
  // segments in this order). [world]
  std::map<private_pool*, std::unique_ptr<stream_pools>, private_pool_order> private_pools;

  block* new_block() {
    if (spare_blocks.empty()) return new block;
    block* b = spare_blocks.back();
    spare_blocks.pop_back();
    return b;
  }
  /// At least n block objects spare: new_block will not allocate for the
  /// next n. May throw std::bad_alloc (then nothing else changed).
  void reserve_spare_blocks(std::size_t n) {
    spare_blocks.reserve(n);
    while (spare_blocks.size() < n) {
      auto b = std::make_unique<block>();
      spare_blocks.push_back(b.release());
    }
  }
  /// Never throws: a merge (inside a free) calls it.
  void delete_block(block* b) noexcept {
    // Reset what new_block's callers do not set (stream_uses keeps its capacity).
    b->requested_bytes = 0;
    b->prev = b->next = nullptr;
    b->allocated = false;
    b->mapped = true;
    b->counted_oversize = false;
    b->event_count = 0;
    b->gc_count_base = 0;
    b->free_seq = 0;
    b->free_seq_taken = false;
    b->reuse_version = no_reuse_version;
    b->stream_uses.clear();
    try {
      spare_blocks.push_back(b);
    } catch (const std::bad_alloc&) {
      delete b;  // no host memory for the list: the next new_block allocates
    }
  }
  ~stream_state() {
    for (block* b : spare_blocks) delete b;
  }
};

// ---- alloc_params: one request (hot_path.cpp, fallback_ladder.cpp) ----------------------

// A request in flight through the fallback ladder.
struct alloc_params {
  std::size_t requested_bytes = 0;  // caller's size
  std::size_t size = 0;             // rounded block size
  std::size_t alloc_size = 0;       // segment size if a new segment is needed
  stream_t stream = 0;
  stream_state* owner = nullptr;
  block_pool* pool = nullptr;
  block* found = nullptr;
};

}  // namespace ccalloc::detail
