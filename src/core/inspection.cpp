// Inspection: read-only views of a device's memory (largest free block, a
// block's segment, expandable segment sizes, segments and blocks, per-pool
// usage) and the full invariant check (check_invariants, SPEC R2).
#include <ccalloc/core/device_caching_allocator.hpp>

#include "detail/device_state.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace ccalloc {

bool detail::segment_is_valid(const segment& seg) noexcept {
  if (seg.head == nullptr || seg.head->ptr != seg.base || seg.head->prev != nullptr) return false;
  std::size_t total = 0;
  for (const block* b = seg.head; b != nullptr; b = b->next) {
    if (b->seg != &seg || b->size == 0) return false;
    if (b->next != nullptr && (b->next->prev != b || b->next->ptr != b->ptr + b->size)) return false;
    total += b->size;
  }
  if (total != seg.size) return false;
  if (!seg.expandable) return true;
  return seg.page_bytes != 0 && seg.pages.count() * seg.page_bytes == seg.size && seg.pages.check();
}


using detail::block;
using detail::world_lock;

std::size_t device_caching_allocator::largest_free_block() const {
  world_lock w(*state_);
  std::size_t largest = 0;
  for (detail::stream_state* ss : w.streams())
    for (auto* pool : {&ss->pools.small, &ss->pools.large})
      if (!pool->blocks.empty()) largest = std::max(largest, pool->blocks.largest()->size);
  return largest;
}

// A live block's segment neither moves nor changes size: no lock needed.
std::pair<void*, std::size_t> device_caching_allocator::base_allocation(block* b) const {
  return {reinterpret_cast<void*>(b->seg->base), b->seg->size};
}

std::size_t device_caching_allocator::block_size(const block* b) const noexcept { return b->size; }

block_segment device_caching_allocator::segment_of(const block* b) const {
  std::lock_guard lock(state_->device_mutex());  // pages change under the device lock
  const detail::segment& seg = *b->seg;
  block_segment out;
  out.base = seg.base;
  out.size_bytes = seg.size;
  out.expandable = seg.expandable;
  if (seg.expandable) {
    out.page_bytes = seg.page_bytes;
    out.first_page = (b->ptr - seg.base) / seg.page_bytes;
    const std::size_t end_page = (b->ptr + b->size - seg.base + seg.page_bytes - 1) / seg.page_bytes;
    out.page_handles.assign(seg.pages.handles().begin() + static_cast<std::ptrdiff_t>(out.first_page),
                            seg.pages.handles().begin() + static_cast<std::ptrdiff_t>(end_page));
  }
  return out;
}

std::vector<expandable_segment_info> device_caching_allocator::expandable_segments() const {
  auto& s = *state_;
  world_lock w(s);
  std::vector<expandable_segment_info> out;
  for (auto& [base, seg] : s.segments()) {
    if (!seg->expandable) continue;
    expandable_segment_info e;
    e.stream = seg->head->stream;
    e.is_small_pool = seg->head->pool->is_small;
    e.address = base;
    e.reserved_address_bytes = seg->size;
    e.mapped_bytes = seg->mapped_bytes;
    out.push_back(e);
  }
  return out;
}

std::vector<segment_info> device_caching_allocator::segments() const {
  world_lock w(*state_);
  return segments_locked();
}

std::vector<segment_info> device_caching_allocator::segments_locked() const {
  auto& s = *state_;
  std::vector<segment_info> out;
  out.reserve(s.segments().size());
  for (auto& [base, seg] : s.segments()) {
    segment_info si;
    si.device = device_;
    si.address = base;
    si.total_bytes = seg->size;
    si.stream = seg->head->stream;
    si.is_small_pool = seg->head->pool->is_small;
    si.is_expandable = seg->expandable;
    si.mapped_bytes = seg->expandable ? seg->mapped_bytes : seg->size;
    if (s.history().enabled()) si.context = s.history().segment_context(base);
    si.tag = tag_name(detail::tag_of(*seg));
    si.paused = seg->paused;
    if (const detail::private_pool* pp = seg->head->pool->priv) {
      si.pool = pp->id;
      si.pool_id = {pp->id.first, pp->id.second};  // the deprecated alias of si.pool, still filled in
    }
    for (const block* b = seg->head; b != nullptr; b = b->next) {
      block_info bi;
      bi.address = b->ptr;
      bi.size_bytes = b->size;
      bi.requested_bytes = b->requested_bytes;
      bi.mapped = b->mapped;
      bi.tag = si.tag;
      bi.state = b->allocated ? block_state::active_allocated
                 : b->event_count > 0 ? block_state::active_pending_free
                                      : block_state::inactive;
      if (b->allocated) si.allocated_bytes += b->size;
      if (bi.state != block_state::inactive) {
        si.active_bytes += b->size;
        si.requested_bytes += b->requested_bytes;
        if (s.history().enabled()) bi.context = s.history().block_context(b->ptr);
      }
      si.blocks.push_back(bi);
    }
    out.push_back(std::move(si));
  }
  return out;
}

pool_usage device_caching_allocator::pool_stats(mempool_id_t id) const {
  auto& s = *state_;
  world_lock w(s);
  const detail::private_pool* pp = nullptr;
  pool_usage u;
  if (id != mempool_id_t{}) {
    pp = &s.pools().checked_pool(id, "pool_stats");
    u.use_count = pp->use_count;
  }
  for (auto& [base, seg] : s.segments()) {
    if (seg->head->pool->priv != pp) continue;
    ++u.segment_count;
    u.reserved_bytes += seg->expandable ? seg->mapped_bytes : seg->size;
    for (const block* b = seg->head; b != nullptr; b = b->next) {
      if (b->allocated) {
        u.allocated_bytes += b->size;
        ++u.allocation_count;
      }
      if (!b->is_free()) u.active_bytes += b->size;
    }
  }
  return u;
}

namespace {
// The placement of a request that maps pages (best_own_run,
// from the unmapped blocks and the pool's index) is the one a walk over every
// block finds (best_own_run_by_scan), for each pool with expandable segments,
// at sizes around a page and around the lengths of its free runs.
// fail(what): reports a violation (check_invariants' own).
template <class Fail>
void check_expandable_placement(detail::device_state& s, const Fail& fail) {
  using run_choice = detail::run_choice;
  std::vector<detail::block_pool*> pools;
  for (auto& [base, seg] : s.segments())  // a paused tag's pools place nothing
    if (seg->expandable && !s.tags().tag_paused(detail::tag_of(*seg)) &&
        std::find(pools.begin(), pools.end(), seg->head->pool) == pools.end())
      pools.push_back(seg->head->pool);
  for (detail::block_pool* pool : pools) {
    const std::size_t page = s.expandable().page_bytes();
    std::vector<std::size_t> sizes = {detail::min_block_bytes, page - detail::min_block_bytes, page,
                                      page + detail::min_block_bytes, 3 * page};
    for (auto& [base, seg] : s.segments()) {
      if (!seg->expandable || seg->head->pool != pool) continue;
      std::size_t run = 0;
      for (const block* b = seg->head; b != nullptr && sizes.size() < 13; b = b->next) {
        run = b->is_free() ? run + b->size : 0;
        if (run != 0 && (b->next == nullptr || !b->next->is_free())) {
          sizes.push_back(run);
          sizes.push_back(std::max(run - detail::min_block_bytes, detail::min_block_bytes));
        }
      }
    }
    for (std::size_t size : sizes) {
      run_choice indexed;
      run_choice scanned;
      detail::best_own_run(s.expandable().reservations(), *pool, size, indexed);
      detail::best_own_run_by_scan(s.expandable().reservations(), *pool, size, scanned);
      if (indexed.seg != scanned.seg || indexed.first != scanned.first || indexed.pages != scanned.pages ||
          indexed.run != scanned.run || indexed.start != scanned.start || indexed.retired != scanned.retired)
        fail("the placement of a " + std::to_string(size) +
             "-byte request that maps pages differs from a scan of every block");
    }
  }
}
[[noreturn]] void fail(const std::string& what) { throw std::logic_error("ccalloc invariant violated: " + what); }

// Sleep and wake: a segment holds one tag's blocks (one pool); a paused one
// is a reservation with nothing mapped (paused bytes are mapped nowhere) and
// pages to map again under its allocated blocks.
void check_paused_state(detail::device_state& s, const detail::segment& seg) {
  if (seg.paused) {
    if (!seg.expandable) fail("a plain segment is paused");
    // Retired pages only given up (a failed resume's unmap the device refused twice).
    const auto kept = [](const auto& r) { return !r.release; };
    if (seg.mapped_bytes != 0 || std::any_of(seg.pages.retired().begin(), seg.pages.retired().end(), kept))
      fail("a paused reservation has mapped pages");
    if (!s.tags().tag_paused(detail::tag_of(seg))) fail("a paused reservation's tag is not paused");
    for (physical_handle_t h : seg.pages.handles())
      if (h != 0) fail("a paused reservation has a mapped page");
    for (const auto& run : seg.paused_runs)
      if (run.first_page + run.pages > seg.pages.count()) fail("a paused run lies outside its reservation");
  } else if (!seg.paused_runs.empty() || !seg.paused_free.empty() || !seg.frees_while_paused.empty()) {
    fail("an active segment keeps paused state");
  } else if (s.tags().tag_paused(detail::tag_of(seg)) && seg.mapped_bytes != 0) {
    fail("a paused tag holds a mapped page");
  }
}

// An expandable segment's page table against its mapped bytes and size;
// deferred unmaps (segment::retired) by index, each page unmapped in the
// books, its handle mapped nowhere else in this segment. Returns the
// number of retired pages; counts the given-up ones as reserved.
std::size_t check_page_table(const detail::segment& seg, stat_group g, device_stats& recount) {
  const std::size_t page = seg.page_bytes;
  std::size_t mapped_pages = 0;
  for (physical_handle_t h : seg.pages.handles()) mapped_pages += h != 0 ? 1 : 0;
  if (mapped_pages * page != seg.mapped_bytes) fail("expandable segment's mapped_bytes differs from its pages");
  if (seg.pages.count() * page != seg.size) fail("expandable segment's page table does not cover it");
  const auto& retired = seg.pages.retired();
  for (std::size_t k = 0; k < retired.size(); ++k) {
    const auto& r = retired[k];
    if (k > 0 && retired[k - 1].index >= r.index) fail("retired pages are not sorted by index");
    if (r.index >= seg.pages.count()) fail("a retired page lies outside its segment");
    else if (seg.pages.mapped(r.index)) fail("a retired page is mapped in the books");
    if (r.owner == nullptr || r.handle == 0) fail("a retired page has no stream or handle");
    if (r.release)  // given up, held by the device until its deferred unmap: reserved
      detail::count_up(recount.reserved_bytes, g, static_cast<std::int64_t>(page));
  }
  return retired.size();
}

// Block b's place against its segment's mapping: a paused reservation's
// blocks are in no pool (its free mapped ones wait in paused_free); an
// expandable segment's block is mapped or not as a whole; a plain
// segment's block is mapped.
void check_block_mapping(const detail::segment& seg, const block* b, bool in_pool) {
  if (seg.paused) {
    if (in_pool) fail("a block of a paused reservation is in a pool");
    if (b->mapped && b->is_free() &&
        std::find(seg.paused_free.begin(), seg.paused_free.end(), b) == seg.paused_free.end())
      fail("a free block of a paused reservation is not in its paused_free list");
  } else if (seg.expandable) {
    const std::size_t page = seg.page_bytes;
    const std::size_t first = (b->ptr - seg.base) / page;
    const std::size_t last = (b->ptr + b->size - seg.base + page - 1) / page;
    for (std::size_t i = first; i < last; ++i)
      if ((seg.pages.mapped(i)) != b->mapped)
        fail(b->mapped ? "a mapped block touches an unmapped page" : "an unmapped block covers a mapped page");
  } else if (!b->mapped) {
    fail("unmapped block in a plain segment");
  }
}

// An unmapped block: free, page-aligned, in no pool, merged with unmapped neighbours.
void check_unmapped_block(const detail::segment& seg, const block* b, bool in_pool) {
  if (!b->is_free()) fail("an unmapped block is in use");
  if ((b->ptr - seg.base) % seg.page_bytes != 0 || b->size % seg.page_bytes != 0)
    fail("an unmapped block is not page-aligned");
  if (in_pool) fail("an unmapped block is in a pool");
  if (b->next != nullptr && !b->next->mapped) fail("two unmapped neighbours are not merged");
}

// A mapped block: in its pool exactly when free, merged with free
// neighbours; counted into `recount`. Returns whether it is a pooled block.
bool check_mapped_block(const detail::segment& seg, const block* b, bool in_pool, stat_group g,
                        device_stats& recount) {
  const bool free_now = b->is_free();
  if (in_pool != free_now && !seg.paused) fail("pool membership does not match block state");
  if (free_now) {
    if (b->next != nullptr && b->next->is_free() && b->next->mapped) fail("two free neighbours are not merged");
    if (b->is_split() && !seg.paused) {  // paused_free blocks left the pools' counts
      detail::count_up(recount.inactive_split, g, 1);
      detail::count_up(recount.inactive_split_bytes, g, static_cast<std::int64_t>(b->size));
    }
    return !seg.paused;
  }
  detail::count_up(recount.active, g, 1);
  detail::count_up(recount.active_bytes, g, static_cast<std::int64_t>(b->size));
  detail::count_up(recount.requested_bytes, g, static_cast<std::int64_t>(b->requested_bytes));
  if (b->allocated) {
    detail::count_up(recount.allocation, g, 1);
    detail::count_up(recount.allocated_bytes, g, static_cast<std::int64_t>(b->size));
  }
  return false;
}

// The blocks of seg tile it in address order, link both ways, share its
// pool; busy_blocks and the unmapped list match them. Returns the number of
// its blocks that are in a pool.
std::size_t check_segment_blocks(const detail::segment& seg, stat_group g, device_stats& recount) {
  std::uintptr_t expect = seg.base;
  std::size_t pooled = 0;
  std::size_t busy = 0;
  for (const block* b = seg.head; b != nullptr; b = b->next) busy += b->is_free() ? 0 : 1;
  if (busy != seg.busy_blocks) fail("segment's busy_blocks differs from its blocks that are not free");
  std::vector<block*> unmapped;
  for (block* b = seg.head; b != nullptr; b = b->next) {
    if (b->ptr != expect) fail("blocks do not tile segment " + std::to_string(seg.base));
    if (b->seg != &seg) fail("block points to the wrong segment");
    if (b->next != nullptr && b->next->prev != b) fail("next->prev link broken");
    if (b->pool != seg.head->pool) fail("blocks of one segment in different pools");
    if (b->size == 0 || b->size % detail::min_block_bytes != 0) fail("block size not a positive multiple of 512");
    const bool in_pool = b->pool->blocks.contains(b);
    check_block_mapping(seg, b, in_pool);
    if (!b->mapped) {
      check_unmapped_block(seg, b, in_pool);
      unmapped.push_back(b);
    } else {
      pooled += check_mapped_block(seg, b, in_pool, g, recount) ? 1 : 0;
    }
    expect += b->size;
  }
  if (expect - seg.base != seg.size) fail("block sizes do not sum to the segment size");
  if (unmapped != seg.unmapped) fail("segment's list of unmapped blocks differs from its blocks");
  return pooled;
}

// One segment: its head, paused state, page table and blocks, counted into
// `recount`. Returns its pooled blocks; adds its retired pages to `retired`.
std::size_t check_segment(detail::device_state& s, std::uintptr_t base, const detail::segment& seg,
                          device_stats& recount, std::size_t& retired) {
  if (seg.head == nullptr || seg.head->ptr != base || seg.head->prev != nullptr)
    fail("segment head is not the block at the segment base");
  const stat_group g = group_of(seg.head->pool);
  detail::count_up(recount.segment, g, 1);
  detail::count_up(recount.reserved_bytes, g, static_cast<std::int64_t>(seg.expandable ? seg.mapped_bytes : seg.size));
  check_paused_state(s, seg);
  if (seg.expandable) retired += check_page_table(seg, g, recount);
  return check_segment_blocks(seg, g, recount);
}

// The streams' and pools' books against the segments: segment counts per
// stream and private pool, plain_segments per pool, gone streams, the
// private pools' stream pools. Returns the number of blocks the pools hold.
std::size_t check_stream_books(detail::device_state& s, const world_lock& w) {
  std::map<const detail::block_pool*, std::size_t> plain;
  std::map<const detail::stream_state*, std::size_t> held_by;
  for (auto& [base, seg] : s.segments()) {
    plain[seg->head->pool] += seg->expandable ? 0 : 1;
    ++held_by[seg->head->pool->owner];
  }
  const auto check_plain = [&](const detail::block_pool& pool) {
    const auto it = plain.find(&pool);
    if (pool.plain_segments != (it == plain.end() ? 0 : it->second))
      fail("a pool's plain_segments differs from its plain segments");
  };
  std::size_t gone = 0;
  std::size_t in_pools = 0;
  for (detail::stream_state* ss : w.streams()) {
    const auto it = held_by.find(ss);
    if (ss->segments != (it == held_by.end() ? 0 : it->second))
      fail("stream " + std::to_string(ss->stream) + "'s segment count differs from its segments");
    gone += ss->gone ? 1 : 0;
    in_pools += ss->pools.small.blocks.size() + ss->pools.large.blocks.size();
    check_plain(ss->pools.small);
    check_plain(ss->pools.large);
    for (auto& [pp, sp] : ss->private_pools) {
      check_plain(sp->small);
      check_plain(sp->large);
      if (s.pools().find_pool(pp->id) != pp) fail("a stream holds pools of a deleted private pool");
      if (sp->small.priv != pp || sp->large.priv != pp || sp->small.owner != ss || sp->large.owner != ss)
        fail("a private pool's stream pools point to the wrong pool or stream");
      in_pools += sp->small.blocks.size() + sp->large.blocks.size();
    }
  }
  if (gone != s.registry().gone_count()) fail("gone_streams_ differs from the gone stream states");
  const auto& by_handle = s.registry().by_handle();
  if (by_handle.size() != s.registry().all().size() ||
      !std::is_sorted(by_handle.begin(), by_handle.end(),
                      [](const detail::stream_state* a, const detail::stream_state* b) { return a->stream < b->stream; }) ||
      std::any_of(by_handle.begin(), by_handle.end(), [&](const detail::stream_state* ss) {
        const auto it = s.registry().all().find(ss->stream);
        return it == s.registry().all().end() || it->second.get() != ss;
      }))
    fail("the registry's streams by handle differ from its map of streams");
  std::size_t tag_pools = 0;
  for (const auto& [id, pp] : s.pools().all()) {
    if (!pp->is_tag_pool()) continue;
    ++tag_pools;
    const auto it = s.tags().tag_pools().find(pp->tag);
    if (it == s.tags().tag_pools().end() || it->second != pp.get()) fail("a tag's pool is missing from its tags' map");
  }
  if (tag_pools != s.tags().tag_pools().size()) fail("the tags' map holds a pool that was deleted");
  std::size_t reservations = 0;
  for (auto& [base, seg] : s.segments()) {
    if (!seg->expandable) continue;
    ++reservations;
    const auto at = s.expandable().reservations().find(base);
    if (at == s.expandable().reservations().end() || at->second != seg.get())
      fail("an expandable segment is missing from the reservations' map");
    if (seg->mapped_bytes == 0 && !seg->paused && !seg->maybe_empty)
      fail("a reservation with no page mapped is not noted for release_empty_expandable_segments");
  }
  if (reservations != s.expandable().reservations().size())
    fail("the reservations' map holds a segment that is not an expandable one");
  for (auto& [id, pp] : s.pools().all()) {
    std::size_t held = 0;
    for (auto& [base, seg] : s.segments()) held += seg->head->pool->priv == pp.get() ? 1 : 0;
    if (held != pp->segment_count) fail("private pool " + to_string(id) + "'s segment_count differs from its segments");
    std::size_t listed = 0;
    for (const detail::segment* seg = pp->segments_head; seg != nullptr && listed <= held;
         seg = seg->pool_next, ++listed)
      if (seg->head->pool->priv != pp.get() || (seg->pool_next != nullptr && seg->pool_next->pool_prev != seg))
        fail("private pool " + to_string(id) + "'s list of segments holds another pool's segment or is broken");
    if (listed != held) fail("private pool " + to_string(id) + "'s list of segments differs from its segments");
    if (pp->use_count < 0) fail("negative pool use count");
  }
  return in_pools;
}

// The device's counters (reservation, pending events, statistics) against
// a recount from the segments.
void check_counters(detail::device_state& s, const device_stats& recount) {
  for (const block* b : s.pools().deferred_frees())
    if (b->allocated || b->event_count != 1) fail("a deferred free is allocated or lacks its placeholder event");
  if (static_cast<std::int64_t>(s.memory().reserved()) != recount.reserved_bytes[0].current)
    fail("the reservation counter differs from the sum of segment sizes");
  if (!s.events().count_matches()) fail("pending_event_count_ differs from the queued events");
  const auto same = [](const stat_array& a, const stat_array& b, const char* name) {
    for (std::size_t i = 0; i < stat_group_count; ++i)
      if (a[i].current != b[i].current)
        fail(std::string(name) + "[" + std::to_string(i) + "].current is " + std::to_string(a[i].current) +
             " but a recount gives " + std::to_string(b[i].current));
  };
  const device_stats& st = s.stats().values();
  same(st.segment, recount.segment, "segment");
  same(st.reserved_bytes, recount.reserved_bytes, "reserved_bytes");
  same(st.allocation, recount.allocation, "allocation");
  same(st.allocated_bytes, recount.allocated_bytes, "allocated_bytes");
  same(st.active, recount.active, "active");
  same(st.active_bytes, recount.active_bytes, "active_bytes");
  same(st.requested_bytes, recount.requested_bytes, "requested_bytes");
  same(st.inactive_split, recount.inactive_split, "inactive_split");
  same(st.inactive_split_bytes, recount.inactive_split_bytes, "inactive_split_bytes");
}
}  // namespace

void device_caching_allocator::check_invariants() const {
  auto& s = *state_;
  world_lock w(s);
  s.stats().publish_all_pending(w);
  device_stats recount;
  std::size_t pooled = 0;
  std::size_t retired_total = 0;
  for (auto& [base, seg] : s.segments()) pooled += check_segment(s, base, *seg, recount, retired_total);
  if (retired_total != s.expandable().retired_pages())
    fail("expandable_.retired_pages() differs from the segments' retired pages");
  check_expandable_placement(s, fail);
  if (check_stream_books(s, w) != pooled) fail("pools hold blocks that are not free blocks of live segments");
  check_counters(s, recount);
  // The per-structure checks that CCALLOC_ASSERT_EXPENSIVE runs at state
  // transitions, composed here (after the specific checks above, which say
  // more about what is wrong). Not the recycling budget's bounds: a lowered
  // recycle_time_percent holds from its next refill.
  for (auto& [base, seg] : s.segments())
    if (!detail::segment_is_valid(*seg)) fail("a segment fails its own check (segment_is_valid)");
  for (detail::stream_state* ss : w.streams())
    if (!ss->fences.check()) fail("a stream's page fences fail their check (page_fences::check)");
}

}  // namespace ccalloc
