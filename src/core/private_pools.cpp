// Private pools (F20-F24): pools with their own segments, routing of
// allocations during a capture (begin/end_allocate_to_pool), deferred frees
// while capturing, the OOM fallback to set_use_on_oom pools, and pool
// checkpoints (get_checkpoint_state / set_checkpoint_pool_state).
#include <ccalloc/core/device_caching_allocator.hpp>

#include "detail/device_state.hpp"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace ccalloc {
namespace detail {

// ---- the device state's private pools ------------------------------------------------

private_pool* private_pool_registry::find_pool(mempool_id_t id) const noexcept {
  auto it = pools_.find(id);
  return it == pools_.end() ? nullptr : it->second.get();
}

private_pool& private_pool_registry::checked_pool(mempool_id_t id, const char* what) const {
  private_pool* pp = find_pool(id);
  if (pp == nullptr)
    throw invalid_argument_error(std::string("ccalloc: ") + what + ": device " + std::to_string(d_.device()) +
                                 " has no private pool " + to_string(id) +
                                 " (never created with create_or_incref_pool, or released and deleted)");
  return *pp;
}

private_pool& private_pool_registry::add(std::unique_ptr<private_pool> pp) {
  private_pool& added = *pp;
  const mempool_id_t id = pp->id;
  pools_.emplace(id, std::move(pp));
  return added;
}

block_pool& private_pool_registry::pool_in(private_pool& pp, stream_state& ss, bool small) {
  auto& slot = ss.private_pools[&pp];
  if (!slot) {
    slot = std::make_unique<stream_pools>(&ss);
    for (block_pool* bp : {&slot->small, &slot->large}) {
      bp->priv = &pp;
      bp->no_split = pp.no_split;
    }
  }
  return small ? slot->small : slot->large;
}

// Rung 5b (F22): a request of the default pool takes a free block of a
// set_use_on_oom pool (same stream and size class). The block stays in that pool.
bool private_pool_registry::try_use_on_oom_pools(alloc_params& p, const world_lock&) {
  if (p.pool->priv != nullptr || !d_.policy().caching()) return false;
  for (auto& [id, pp] : pools_) {
    if (!pp->use_on_oom) continue;
    auto it = p.owner->private_pools.find(pp.get());
    if (it == p.owner->private_pools.end()) continue;
    alloc_params q = p;
    q.pool = p.pool->is_small ? &it->second->small : &it->second->large;
    if (d_.get_free_block(q)) {
      p.pool = q.pool;
      p.found = q.found;
      return true;
    }
  }
  return false;
}

// Cached whole segments of pools without users go back to the device.
void private_pool_registry::release_dead_pools(const world_lock& w, bool keep_going) {
  for (stream_state* ss : w.streams())
    for (auto& [pp, sp] : ss->private_pools)
      if (pp->use_count == 0 || pp->is_tag_pool()) {  // a tag's pool caches as the default pools do
        d_.segments().release_blocks(sp->large, keep_going);
        d_.segments().release_blocks(sp->small, keep_going);
      }
}

void private_pool_registry::delete_empty_dead_pools(const world_lock& w) {
  for (auto it = pools_.begin(); it != pools_.end();) {
    private_pool* pp = it->second.get();
    if (pp->is_tag_pool()) {  // forgotten when this world lock is released
      d_.tags().note_if_empty(*pp);
      ++it;
      continue;
    }
    const bool active = scopes_.routes_to(pp);
    if (pp->use_count != 0 || pp->segment_count != 0 || active || pp->pinned.load(std::memory_order_acquire) != 0) {
      ++it;
      continue;
    }
    for (stream_state* ss : w.streams()) ss->private_pools.erase(pp);
    it = pools_.erase(it);
  }
}

bool private_pool_registry::capture_underway() noexcept {
  if (!scopes_.active()) return false;
  return scopes_.any_capturing([&](stream_t stream) {
    try {
      return d_.backend().is_capturing(d_.device(), stream);
    } catch (...) {  // if the backend cannot tell, stay on the safe side
      return true;
    }
  });
}

void private_pool_registry::note_if_capturing(stream_t stream) {
  try {
    if (!d_.backend().is_capturing(d_.device(), stream)) return;
  } catch (const backend_error&) {
    // CUDA refuses to say for the legacy stream while a blocking stream
    // captures (cudaErrorStreamCaptureImplicit): a capture runs, so stay on
    // the safe side until the scope ends.
  }
  scopes_.note_capturing(stream);
}

bool private_pool_registry::any_stream_capturing(const block* b) {
  if (!b->pool->owner->gone && d_.backend().is_capturing(d_.device(), b->stream)) return true;
  for (stream_t s : b->stream_uses)  // never a destroyed stream (set_stream_gone)
    if (d_.backend().is_capturing(d_.device(), s)) return true;
  return false;
}

// The free of a block used on other streams while capturing: it waits,
// counted as active, with a placeholder event, until flush_deferred_frees.
void private_pool_registry::defer_free(block* b) {
  std::lock_guard device_lock(d_.device_mutex());
  deferred_frees_.push_back(b);
  b->event_count = 1;
}

// Records the events of deferred frees (PyTorch:
// insert_events_deferred_until_no_capture) once no capture is underway; a
// block whose streams the backend still reports capturing stays deferred.
void private_pool_registry::flush_deferred_frees() {
  if (capture_underway() || deferred_frees_.empty()) return;
  std::vector<block*> todo;
  todo.swap(deferred_frees_);
  for (std::size_t i = 0; i < todo.size(); ++i) {
    block* b = todo[i];
    try {
      if (any_stream_capturing(b)) {
        deferred_frees_.push_back(b);
        continue;
      }
      b->event_count = 0;
      d_.events().insert_events_locked(b);  // on a throw: nothing recorded, stream_uses kept
    } catch (...) {
      b->event_count = 1;
      deferred_frees_.insert(deferred_frees_.end(), todo.begin() + static_cast<std::ptrdiff_t>(i), todo.end());
      throw;
    }
    if (b->event_count == 0) d_.free_block(b, d_.stats().values(), true);
  }
}

// Frees allocated block `b` as free() does, with the world lock held.
void private_pool_registry::free_allocated_locked(block* b) {
  if (!b->stream_uses.empty()) d_.events().insert_events_locked(b);
  d_.release_allocation(b, d_.stats().values(), true);
}

// Makes [ptr, ptr + size) of `seg`, which lies inside one free mapped block,
// an allocated block of its own (checkpoint restore).
block* private_pool_registry::carve_allocated(segment& seg, std::uintptr_t ptr, std::size_t size,
                                              std::size_t requested) {
  block* f = seg.head;
  while (f != nullptr && f->ptr + f->size <= ptr) f = f->next;
  if (f == nullptr || f->ptr > ptr || f->ptr + f->size < ptr + size || !f->is_free() || !f->mapped)
    throw std::logic_error("ccalloc: internal error: checkpoint block is not inside one free block");
  const stat_group g = group_of(f->pool);
  f->pool->blocks.erase(f);
  if (f->is_split()) {
    count_down(d_.stats().values().inactive_split, g, 1);
    count_down(d_.stats().values().inactive_split_bytes, g, static_cast<std::int64_t>(f->size));
  }
  block* lo = nullptr;
  if (f->ptr < ptr) {
    lo = f;
    f = d_.split_free_block(f, ptr);
  }
  block* hi = f->ptr + f->size > ptr + size ? d_.split_free_block(f, ptr + size) : nullptr;
  for (block* x : {lo, hi}) {
    if (x == nullptr) continue;
    x->gc_count_base = x->pool->get_free_blocks_call_count;
    x->pool->blocks.insert(x);
    count_up(d_.stats().values().inactive_split, g, 1);
    count_up(d_.stats().values().inactive_split_bytes, g, static_cast<std::int64_t>(x->size));
  }
  f->allocated = true;
  ++f->seg->busy_blocks;
  f->requested_bytes = requested;
  count_up(d_.stats().values().allocation, g, 1);
  count_up(d_.stats().values().allocated_bytes, g, static_cast<std::int64_t>(size));
  count_up(d_.stats().values().active, g, 1);
  count_up(d_.stats().values().active_bytes, g, static_cast<std::int64_t>(size));
  count_up(d_.stats().values().requested_bytes, g, static_cast<std::int64_t>(requested));
  f->counted_oversize = size >= d_.policy().config().max_split_size_bytes;
  if (f->counted_oversize) d_.stats().values().oversize_allocations.increase(1);
  return f;
}

}  // namespace detail

// ---- public pool API (device_caching_allocator) ---------------------------------------

using detail::block;
using detail::world_lock;

// ---- private pools (F20-F24) ----------------------------------------------------------

std::string to_string(const mempool_id_t& id) {
  std::string text = "(";  // appended, not "(" + std::string: GCC 12's -Wrestrict misfires on that at -O3
  text.append(std::to_string(id.first)).append(", ").append(std::to_string(id.second)).append(")");
  return text;
}

void device_caching_allocator::create_or_incref_pool(mempool_id_t id, segment_allocator custom) {
  if (id == mempool_id_t{})
    throw invalid_argument_error("ccalloc: create_or_incref_pool: pool id (0, 0) names the default pool of device " +
                                 std::to_string(device_) + "; a private pool needs another id");
  if (static_cast<bool>(custom.malloc) != static_cast<bool>(custom.free))
    throw invalid_argument_error("ccalloc: create_or_incref_pool: the custom segment allocator of pool " +
                                 to_string(id) + " has only its " + (custom.malloc ? "malloc" : "free") +
                                 " function; give both or neither");
  auto& s = *state_;
  world_lock w(s);
  if (detail::private_pool* pp = s.pools().find_pool(id)) {
    ++pp->use_count;
    return;
  }
  if (id.first == detail::tag_pool_id_first)
    throw invalid_argument_error("ccalloc: create_or_incref_pool: pool ids (" +
                                 std::to_string(detail::tag_pool_id_first) +
                                 ", n) are the tags' own pools; choose another id");
  auto pp = std::make_unique<detail::private_pool>();
  pp->id = id;
  pp->tag = current_tag();  // its memory pauses and resumes with the tag in scope now
  pp->custom = std::move(custom);
  s.pools().add(std::move(pp));
}

void device_caching_allocator::release_pool(mempool_id_t id) {
  auto& s = *state_;
  world_lock w(s);
  detail::private_pool& pp = s.pools().checked_pool(id, "release_pool");
  if (pp.use_count == 0)
    throw invalid_argument_error("ccalloc: release_pool: private pool " + to_string(id) + " of device " +
                                 std::to_string(device_) + " was already released (use count 0)");
  --pp.use_count;
  if (pp.use_count == 0) s.pools().delete_empty_dead_pools(w);
}

int device_caching_allocator::get_pool_use_count(mempool_id_t id) const {
  auto& s = *state_;
  world_lock w(s);
  const detail::private_pool* pp = s.pools().find_pool(id);
  return pp == nullptr ? 0 : pp->use_count;
}

void device_caching_allocator::begin_allocate_to_pool(mempool_id_t id, stream_filter filter) {
  auto& s = *state_;
  if (!filter)
    throw invalid_argument_error("ccalloc: begin_allocate_to_pool: pool " + to_string(id) +
                                 ": the stream filter is empty");
  world_lock w(s);
  detail::private_pool& pp = s.pools().checked_pool(id, "begin_allocate_to_pool");
  if (pp.use_count == 0)
    throw invalid_argument_error("ccalloc: begin_allocate_to_pool: private pool " + to_string(id) + " of device " +
                                 std::to_string(device_) + " was released (use count 0); it takes no allocations");
  s.pools().scopes().open(&pp, std::move(filter));
}

void device_caching_allocator::end_allocate_to_pool(mempool_id_t id) {
  auto& s = *state_;
  world_lock w(s);
  if (!s.pools().scopes().close(id))
    throw invalid_argument_error("ccalloc: end_allocate_to_pool: private pool " + to_string(id) + " of device " +
                                 std::to_string(device_) + " is not active (no begin_allocate_to_pool to end)");
  if (!s.pools().scopes().active()) {
    s.stats().publish_all_pending(w);
    s.pools().flush_deferred_frees();
  }
  s.pools().delete_empty_dead_pools(w);
}

void device_caching_allocator::set_use_on_oom(mempool_id_t id, bool enabled) {
  world_lock w(*state_);
  state_->pools().checked_pool(id, "set_use_on_oom").use_on_oom = enabled;
}

void device_caching_allocator::set_no_split(mempool_id_t id, bool enabled) {
  auto& s = *state_;
  world_lock w(s);
  detail::private_pool& pp = s.pools().checked_pool(id, "set_no_split");
  pp.no_split = enabled;
  for (detail::stream_state* ss : w.streams())
    if (auto it = ss->private_pools.find(&pp); it != ss->private_pools.end())
      it->second->small.no_split = it->second->large.no_split = enabled;
}

bool device_caching_allocator::check_pool_live_allocations(mempool_id_t id,
                                                           const std::vector<void*>& expected) const {
  auto& s = *state_;
  world_lock w(s);
  const detail::private_pool* pp = s.pools().find_pool(id);
  std::vector<std::uintptr_t> live;
  if (pp != nullptr)
    for (auto& [base, seg] : s.segments())
      if (seg->head->pool->priv == pp)
        for (const block* b = seg->head; b != nullptr; b = b->next)
          if (b->allocated) live.push_back(b->ptr);
  std::vector<std::uintptr_t> want;
  for (void* p : expected) want.push_back(reinterpret_cast<std::uintptr_t>(p));
  std::sort(want.begin(), want.end());
  want.erase(std::unique(want.begin(), want.end()), want.end());
  std::sort(live.begin(), live.end());
  return live == want;
}

std::vector<mempool_id_t> device_caching_allocator::pools() const {
  world_lock w(*state_);
  std::vector<mempool_id_t> out;
  for (auto& [id, pp] : state_->pools().all()) out.push_back(id);
  return out;
}

pool_checkpoint device_caching_allocator::get_checkpoint_state(mempool_id_t id) const {
  auto& s = *state_;
  world_lock w(s);
  const detail::private_pool& pp = s.pools().checked_pool(id, "get_checkpoint_state");
  pool_checkpoint cp;
  cp.device = device_;
  cp.pool = id;
  for (auto& [base, seg] : s.segments()) {
    if (seg->head->pool->priv != &pp) continue;
    checkpoint_segment cs;
    cs.address = base;
    cs.total_bytes = seg->size;
    cs.stream = seg->head->stream;
    cs.is_small_pool = seg->head->pool->is_small;
    cs.is_expandable = seg->expandable;
    for (const block* b = seg->head; b != nullptr; b = b->next)
      cs.blocks.push_back({b->ptr, b->size, b->allocated ? b->requested_bytes : 0, b->allocated, b->mapped});
    cp.segments.push_back(std::move(cs));
  }
  return cp;
}

namespace {
// Throws invalid_argument_error (prefix `where`) unless segment i of the
// pool (seg) is the checkpoint's segment cs: same address, size, stream and
// kind, its blocks tiling it, each allocated one in mapped pages.
void check_checkpoint_segment(const std::string& where, const std::string& pool_text, std::size_t i,
                              const detail::segment& seg, const checkpoint_segment& cs) {
  if (seg.base != cs.address || seg.size != cs.total_bytes || seg.head->stream != cs.stream ||
      seg.head->pool->is_small != cs.is_small_pool || seg.expandable != cs.is_expandable)
    throw invalid_argument_error(where + "segment " + std::to_string(i) + " of " + pool_text + " (address " +
                                 std::to_string(seg.base) + ", " + std::to_string(seg.size) +
                                 " bytes) differs from the checkpoint's (address " + std::to_string(cs.address) +
                                 ", " + std::to_string(cs.total_bytes) + " bytes) or its stream or kind");
  std::uintptr_t expect = cs.address;
  for (const checkpoint_block& cb : cs.blocks) {
    if (cb.address != expect || cb.size_bytes == 0 || cb.size_bytes % detail::min_block_bytes != 0)
      throw invalid_argument_error(where + "the checkpoint's blocks do not tile segment " + std::to_string(i) +
                                   " (block at " + std::to_string(cb.address) + ")");
    expect += cb.size_bytes;
    if (!cb.allocated || !seg.expandable) continue;
    const std::size_t page = seg.page_bytes;
    for (std::size_t p = (cb.address - seg.base) / page; p < (cb.address + cb.size_bytes - seg.base + page - 1) / page;
         ++p)
      if (!seg.pages.mapped(p))
        throw invalid_argument_error(where + "block " + std::to_string(cb.address) + " of the checkpoint lies in " +
                                     "an unmapped range of expandable segment " + std::to_string(i));
  }
  if (expect != cs.address + cs.total_bytes)
    throw invalid_argument_error(where + "the checkpoint's blocks do not cover segment " + std::to_string(i));
}
}  // namespace

checkpoint_restore_result device_caching_allocator::set_checkpoint_pool_state(const pool_checkpoint& state) {
  auto& s = *state_;
  const std::string where = "ccalloc: set_checkpoint_pool_state: ";
  if (state.device != device_)
    throw invalid_argument_error(where + "the checkpoint is of device " + std::to_string(state.device) +
                                 ", not of device " + std::to_string(device_));
  world_lock w(s);
  detail::private_pool& pp = s.pools().checked_pool(state.pool, "set_checkpoint_pool_state");
  if (s.pools().scopes().active())
    throw invalid_argument_error(where + "a begin_allocate_to_pool is active on device " + std::to_string(device_) +
                                 " (a capture is underway); restore after end_allocate_to_pool");
  // 1. Validate everything before changing anything.
  std::vector<detail::segment*> segs;
  for (auto& [base, seg] : s.segments())
    if (seg->head->pool->priv == &pp) segs.push_back(seg.get());
  const std::string pool_text = "private pool " + to_string(state.pool) + " of device " + std::to_string(device_);
  if (segs.size() != state.segments.size())
    throw invalid_argument_error(where + pool_text + " holds " + std::to_string(segs.size()) +
                                 " segments but the checkpoint has " + std::to_string(state.segments.size()) +
                                 " (a checkpoint of another pool, or segments were freed or added since)");
  for (std::size_t i = 0; i < segs.size(); ++i)
    check_checkpoint_segment(where, pool_text, i, *segs[i], state.segments[i]);
  // 2. Free what the checkpoint does not hold allocated, wait for events.
  s.stats().publish_all_pending(w);
  checkpoint_restore_result result;
  std::vector<std::vector<const checkpoint_block*>> to_create(segs.size());
  for (std::size_t i = 0; i < segs.size(); ++i) {
    const checkpoint_segment& cs = state.segments[i];
    std::vector<const checkpoint_block*> wanted;
    for (const checkpoint_block& cb : cs.blocks)
      if (cb.allocated) wanted.push_back(&cb);
    std::vector<block*> to_free;
    std::size_t k = 0;
    for (block* b = segs[i]->head; b != nullptr; b = b->next) {
      while (k < wanted.size() && wanted[k]->address < b->ptr) to_create[i].push_back(wanted[k++]);
      const bool kept = k < wanted.size() && wanted[k]->address == b->ptr && wanted[k]->size_bytes == b->size;
      if (b->allocated && kept) {
        ++k;
        continue;
      }
      if (b->allocated) to_free.push_back(b);
    }
    while (k < wanted.size()) to_create[i].push_back(wanted[k++]);
    for (block* b : to_free) {
      result.freed_pointers.push_back(reinterpret_cast<void*>(b->ptr));
      s.pools().free_allocated_locked(b);
    }
  }
  s.pools().flush_deferred_frees();
  s.events().synchronize_and_free_events();
  // 3. Create the blocks the checkpoint holds allocated.
  for (std::size_t i = 0; i < segs.size(); ++i)
    for (const checkpoint_block* cb : to_create[i]) {
      block* b = s.pools().carve_allocated(*segs[i], cb->address, cb->size_bytes, cb->requested_bytes);
      result.blocks_created.push_back({reinterpret_cast<void*>(b->ptr), b});
    }
  return result;
}

}  // namespace ccalloc
