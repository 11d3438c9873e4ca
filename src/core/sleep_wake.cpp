// Sleep and wake (SPEC S1-S4): tagged memory, pause and resume.
//
// A named tag's memory lives in its own private pool (tag_pool), whose
// segments are expandable reservations of their own: no page ever holds
// blocks of two tags, and a tag's pages can be released and mapped again
// without touching another tag's.
//
// pause(tags, keep_contents), under the world lock, for each tag not paused:
//   1. wait, stream-ordered, for the work queued before the pause on the
//      streams that used the tag's blocks: the events of its blocks freed
//      with record_stream, then one event recorded on each live stream that
//      owns or used one (event synchronizes, never the device);
//   2. return its cached free memory: every whole free page is unmapped and
//      released (unmap_block_pages), empty reservations go;
//   3. for each reservation left (blocks in use): host memory for the pages
//      under its live blocks first (keep_contents; nothing has changed if
//      there is none), copies on the owning stream, an event after them,
//      then every page unmapped and released; the reservation keeps its
//      addresses (segment::paused, segment::paused_runs).
// resume(tags): the pages of the paused runs are created and mapped at the
// same addresses (after the cached free memory of active tags is given
// back, when the device or the memory-fraction cap lacks room), contents
// copied back on the owning stream, so that work queued there after resume
// sees them; blocks freed while paused are freed then.
//
// Note [Paused blocks]: a paused tag's blocks stay allocated to their
// callers (allocated bytes keep them; reserved bytes do not). malloc under
// a paused tag is refused; free of a paused block is accepted and done at
// resume; record_stream of one is refused; empty_cache, garbage collection
// and page recycling never touch a paused reservation (its blocks are in no
// pool); pause during a graph capture is refused.
#include <ccalloc/core/device_caching_allocator.hpp>

#include <ccalloc/base/detail/bytes_text.hpp>

#include "detail/device_state.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace ccalloc {
namespace detail {


tag_sleep::tag_sleep(device_state& d) : d_(d), host_copies_(d.backend(), d.device()) {}

private_pool& tag_sleep::tag_pool(tag_id tag) {
  if (auto it = tag_pools_.find(tag); it != tag_pools_.end()) return *it->second;
  const mempool_id_t id{tag_pool_id_first, tag};
  auto pp = std::make_unique<private_pool>();
  pp->id = id;
  pp->tag = tag;
  private_pool* raw = pp.get();
  tag_pools_.emplace(tag, raw);  // first: on a throw below, the map holds a key to nothing yet
  try {
    d_.pools().add(std::move(pp));
  } catch (...) {
    tag_pools_.erase(tag);
    throw;
  }
  return *raw;
}

void tag_sleep::note_if_empty(private_pool& pp) noexcept {
  if (!pp.is_tag_pool() || pp.segment_count != 0 || pp.forget_listed) return;
  pp.forget_listed = true;
  pp.next_to_forget = to_forget_;
  to_forget_ = &pp;
}

// A tag's pool is referred to by its segments' blocks (none here), by the
// streams' pools in it (erased first), by tag_pools_, and by allocations in
// flight to it (pinned: kept, listed again for the next world lock).
void tag_sleep::forget_empty_tags(const world_lock& w) noexcept {
  private_pool* list = to_forget_;
  to_forget_ = nullptr;
  while (list != nullptr) {
    private_pool* pp = list;
    list = pp->next_to_forget;
    pp->next_to_forget = nullptr;
    pp->forget_listed = false;
    if (pp->segment_count != 0) continue;  // used again since it was listed
    if (pp->pinned.load(std::memory_order_acquire) != 0) {
      note_if_empty(*pp);
      continue;
    }
    for (stream_state* ss : w.streams()) ss->private_pools.erase(pp);
    tag_pools_.erase(pp->tag);
    d_.pools().erase(pp->id);  // pp with it
  }
}

// A named tag's segments are those of the private pools carrying it: its
// own pool (id {tag_pool_id_first, tag}) and pools made in its scope (CUDA
// graphs' pools, ids below every tag pool's): read from their lists, so a
// tag's pause costs what it holds, not what the device holds. In address
// order, as the device's map of segments gives them.
std::vector<segment*> tag_sleep::segments_of(tag_id tag) const {
  std::vector<segment*> out;
  if (tag == default_tag_id) {
    for (const auto& [base, seg] : d_.segments())
      if (tag_of(*seg) == tag) out.push_back(seg.get());
    return out;
  }
  auto add_pool = [&](const private_pool& pp) {
    for (segment* seg = pp.segments_head; seg != nullptr; seg = seg->pool_next) out.push_back(seg);
  };
  const auto& pools = d_.pools().all();
  const auto tag_pools = pools.lower_bound(mempool_id_t{tag_pool_id_first, 0});
  for (auto it = pools.begin(); it != tag_pools; ++it)
    if (it->second->tag == tag) add_pool(*it->second);
  if (const auto own = tag_pools_.find(tag); own != tag_pools_.end()) add_pool(*own->second);
  std::sort(out.begin(), out.end(), [](const segment* a, const segment* b) { return a->base < b->base; });
  return out;
}

tag_usage tag_sleep::usage_of(tag_id tag) const {
  tag_usage u;
  u.tag = tag_name(tag);
  u.paused = tag_paused(tag);
  for (const segment* seg : segments_of(tag)) {
    ++u.segments;
    u.reserved_bytes += seg->expandable ? seg->mapped_bytes : seg->size;
    for (const block* b = seg->head; b != nullptr; b = b->next)
      if (b->allocated) {
        u.allocated_bytes += b->size;
        ++u.blocks;
      }
    for (const auto& run : seg->paused_runs) {
      u.paused_bytes += run.pages * seg->page_bytes;
      if (run.host != nullptr) u.kept_bytes += run.pages * seg->page_bytes;
    }
  }
  return u;
}

namespace {

// A segment of a private pool other than a tag's own (a CUDA graph's pool,
// a MemPool) made under a tag pauses whole: its free blocks are not a cache
// to give back, since a graph replays into the blocks freed during its
// capture. Only a tag's own pool returns its free memory at a pause.
bool pauses_whole(const segment& seg) noexcept {
  const private_pool* pp = seg.head->pool->priv;
  return pp != nullptr && !pp->is_tag_pool();
}

// A block a pause takes out of its pool (a free one beside blocks in use,
// on mapped pages): nothing may place a block there while it is paused.
bool leaves_its_pool(const block& b) noexcept { return b.mapped && b.is_free() && b.pool->blocks.contains(&b); }

// The page runs to pause in seg (sorted, merged): under its allocated
// blocks, or every mapped page when the segment pauses whole.
std::vector<segment::paused_run> live_runs(const segment& seg) {
  std::vector<segment::paused_run> runs;
  const std::size_t page = seg.page_bytes;
  if (pauses_whole(seg)) {
    for (std::size_t i = 0; i < seg.pages.count(); ++i) {
      if (!seg.pages.mapped(i)) continue;
      if (!runs.empty() && runs.back().first_page + runs.back().pages == i) ++runs.back().pages;
      else runs.push_back({i, 1, nullptr});
    }
    return runs;
  }
  for (const block* b = seg.head; b != nullptr; b = b->next) {
    if (!b->allocated) continue;
    const std::size_t first = (b->ptr - seg.base) / page;
    const std::size_t last = (b->ptr + b->size - seg.base + page - 1) / page;  // exclusive
    if (!runs.empty() && runs.back().first_page + runs.back().pages >= first) {
      const std::size_t end = std::max(runs.back().first_page + runs.back().pages, last);
      runs.back().pages = end - runs.back().first_page;
    } else {
      runs.push_back({first, last - first, nullptr});
    }
  }
  return runs;
}

// The stream that queues a segment's copies: its owner, or the legacy
// default stream when the owner was destroyed.
stream_t copy_stream(const segment& seg) noexcept {
  const stream_state* owner = seg.head->pool->owner;
  return owner->gone ? default_stream : owner->stream;
}

}  // namespace

void tag_sleep::wait_for_stream(stream_t stream) {
  const event_t e = d_.events().get_event();
  d_.backend().record_event(d_.device(), e, stream);
  d_.backend().synchronize_event(d_.device(), e);
  d_.events().give_event(e);
}

// ---- pause --------------------------------------------------------------------------

// The tags of `tags` not paused yet, each once; throws for the default tag.
std::vector<tag_id> tag_sleep::tags_to_pause(const std::vector<tag_id>& tags, const std::string& where) const {
  std::vector<tag_id> todo;
  for (tag_id tag : tags) {
    if (tag == default_tag_id)
      throw invalid_argument_error(where + ": the default tag is never paused; allocate what is to sleep under a "
                                           "named tag (tag_scope, ccalloc_tag_begin, ccalloc.tag)");
    if (!tag_paused(tag) && std::find(todo.begin(), todo.end(), tag) == todo.end()) todo.push_back(tag);
  }
  return todo;
}

// The segments of the tags to pause; throws for one that is no reservation of pages.
std::vector<segment*> tag_sleep::pausable_segments(const std::vector<tag_id>& todo, const std::string& where) const {
  std::vector<segment*> segs;
  for (tag_id tag : todo)
    for (segment* seg : segments_of(tag)) {
      if (!seg->expandable || d_.expandable().page_bytes() == 0)
        throw invalid_argument_error(where + ": tag '" + tag_name(tag) + "' holds a segment at " +
                                     std::to_string(seg->base) +
                                     " that is not a reservation of pages (the backend '" + d_.backend().name() +
                                     "' has no virtual memory, the host's address space for reservations ran "
                                     "out, or a private pool has its own segment allocator); it cannot be paused");
      segs.push_back(seg);
    }
  return segs;
}

// Step 1: the events of the tags' blocks freed with record_stream, then
// the work queued on the streams that own or used their blocks.
void tag_sleep::wait_for_tag_work(const std::vector<segment*>& segs) {
  const std::set<const segment*> mine(segs.begin(), segs.end());
  d_.events().for_each_pending([&](event_t e, const block* b) {
    if (mine.count(b->seg) != 0) d_.backend().synchronize_event(d_.device(), e);
  });
  d_.events().process_events_locked(event_queue::all_streams);  // the tags' blocks whose events were waited for
  std::set<stream_t> streams;
  for (const segment* seg : segs) {
    streams.insert(copy_stream(*seg));
    for (const block* b = seg->head; b != nullptr; b = b->next)
      if (b->allocated)
        for (stream_t s : b->stream_uses) streams.insert(s);
  }
  if (!streams.empty()) {
    const event_t e = d_.events().get_event();
    for (stream_t s : streams) {
      d_.backend().record_event(d_.device(), e, s);
      d_.backend().synchronize_event(d_.device(), e);
    }
    d_.events().give_event(e);
  }
  for (segment* seg : segs) d_.expandable().settle_retired_in(*seg, 0, seg->pages.count(), true);
}

// Step 2: the tags' cached free memory goes back to the device.
void tag_sleep::return_tag_cache(const std::vector<segment*>& segs, sleep_result& r) {
  const std::size_t reserved_before = d_.memory().reserved();
  for (segment* seg : segs) {
    if (pauses_whole(*seg)) continue;
    std::vector<block*> free_mapped;
    for (block* b = seg->head; b != nullptr; b = b->next)
      if (b->mapped && b->is_free()) free_mapped.push_back(b);
    // From the highest address down: a block's unmapping merges only with
    // blocks at or above it, so the ones below stay valid.
    for (auto it = free_mapped.rbegin(); it != free_mapped.rend(); ++it)
      d_.expandable().unmap_block_pages(*it, 0, 0, nullptr, std::numeric_limits<std::size_t>::max());
  }
  d_.expandable().release_empty_expandable_segments();
  r.released_bytes += reserved_before - d_.memory().reserved();
}

// Step 3a: host memory for every kept run, before anything is copied; on
// a shortfall it throws, and pause_tags gives every buffer back.
void tag_sleep::take_host_copies(const std::vector<segment*>& segs, const std::string& where) {
  for (segment* seg : segs)
    for (auto& run : seg->paused_runs) {
      run.host = host_copies_.take(run.pages * seg->page_bytes);
      if (run.host != nullptr) continue;
      throw out_of_memory_error(
          where + ": the host has no " + format_bytes(run.pages * seg->page_bytes) +
              " of pinned memory to keep the contents of tag '" + tag_name(tag_of(*seg)) +
              "'; nothing was paused (pause without keep_contents drops the contents)",
          {d_.device(), run.pages * seg->page_bytes, d_.memory().total(), 0, 0, d_.memory().reserved()});
    }
}

// Step 3b: one reservation's kept runs copied out, then every page unmapped and released.
void tag_sleep::pause_segment(segment& seg, bool keep_contents, sleep_result& r) {
  const std::size_t page = seg.page_bytes;
  // Blocks in their pools (free partial pages beside blocks in use) leave
  // them: nothing may place a block there, nor unmap a page of it.
  for (block* b = seg.head; b != nullptr; b = b->next)
    if (leaves_its_pool(*b)) {
      seg.paused_free.push_back(b);
      d_.expandable().pool_erase_counted(b);
    }
  const stream_t stream = copy_stream(seg);
  if (keep_contents) {
    for (auto& run : seg.paused_runs) {
      d_.backend().copy_to_host_async(d_.device(), run.host,
                                     reinterpret_cast<const void*>(seg.base + run.first_page * page),
                                     run.pages * page, stream);
      r.copied_bytes += run.pages * page;
    }
    wait_for_stream(stream);  // the copies have read the pages
  }
  for (std::size_t i = 0; i < seg.pages.count();) {  // run by run of mapped pages
    const std::size_t n = seg.pages.mapped_run(i);
    if (n == 0) {
      ++i;
      continue;
    }
    if (d_.history().active()) [[unlikely]]
      d_.history().record_segment_unmap(seg.base + i * page, n * page, seg.head->stream);
    d_.mapping().announce(mapping_change::unmap, mapping_reason::pages_paused, seg.base + i * page, n * page,
                seg.head->stream, true);
    for (const std::size_t end = i + n; i < end; ++i) d_.expandable().give_back_page(seg, i);
    r.released_bytes += n * page;
  }
  // A page whose unmap the device refused is retired (give_back_page): a
  // paused reservation holds none, so its unmap is tried again now (a
  // second refusal throws, as the device's other errors here do).
  if (!seg.pages.retired().empty())
    d_.expandable().settle_retired_in(seg, 0, std::numeric_limits<std::size_t>::max(), true);
  for (const auto& run : seg.paused_runs) r.paused_bytes += run.pages * page;
  seg.paused = true;
}

sleep_result tag_sleep::pause_tags(const std::vector<tag_id>& tags, bool keep_contents, world_lock& w) {
  // Blocks whose events completed may be on their way back to their pools
  // (event_queue::process_events frees them under their stream's lock after
  // dropping the device lock): out of the event queues, they are neither
  // waited for nor paused below, and a free into a reservation paused
  // meanwhile would put unmapped pages in a pool. The pause waits until they
  // are back; with the world lock held again, no more can leave the queues.
  while (d_.events().wait_for_completions_in_flight(w)) {
  }
  sleep_result r;
  const std::optional<std::uint64_t> start_us = d_.backend().host_time_us();
  const std::string where = "ccalloc: pause on device " + std::to_string(d_.device());
  const std::vector<tag_id> todo = tags_to_pause(tags, where);
  if (todo.empty()) return r;
  if (d_.pools().capture_underway())
    throw invalid_argument_error(where + ": refused while a CUDA graph capture is underway (pages may not be "
                                         "unmapped during a capture); pause after the capture ends");
  std::vector<segment*> segs = pausable_segments(todo, where);
  wait_for_tag_work(segs);
  return_tag_cache(segs, r);
  segs.clear();  // step 2 may have released some
  for (tag_id tag : todo)
    for (segment* seg : segments_of(tag)) segs.push_back(seg);
  // Host memory for the books first: a failure up to the copies changes nothing.
  std::set<tag_id> marks(todo.begin(), todo.end());  // their nodes move into paused_tags_ at the end
  r.tags.reserve(todo.size());
  for (tag_id tag : todo) r.tags.push_back(tag_name(tag));
  for (segment* seg : segs) {
    std::size_t leaving = 0;  // blocks pause_segment takes out of their pools
    for (const block* b = seg->head; b != nullptr; b = b->next)
      leaving += leaves_its_pool(*b) ? 1 : 0;
    seg->paused_free.reserve(seg->paused_free.size() + leaving);
  }
  for (segment* seg : segs) seg->paused_runs = live_runs(*seg);
  try {
    if (keep_contents) take_host_copies(segs, where);
  } catch (...) {  // nothing was paused: no run stays noted (tag usage would count it as paused bytes)
    for (segment* seg : segs) {
      for (auto& run : seg->paused_runs) host_copies_.give(std::exchange(run.host, nullptr));
      seg->paused_runs.clear();
    }
    throw;
  }
  for (segment* seg : segs) {
    const tag_scope entries_tag(tag_of(*seg));  // its history entries name its tag
    pause_segment(*seg, keep_contents, r);
  }
  for (tag_id tag : todo) {
    paused_tags_.insert(marks.extract(tag));  // a node made above: no allocation here
    if (d_.history().active()) [[unlikely]] {
      const tag_usage u = usage_of(tag);
      d_.history().record(trace_entry_action::pause, u.kept_bytes, u.paused_bytes, 0, nullptr, tag);
    }
  }
  any_paused_.store(true, std::memory_order_relaxed);
  if (const std::optional<std::uint64_t> end_us = d_.backend().host_time_us(); start_us && end_us)
    r.host_time_us = *end_us - *start_us;
  return r;
}

// ---- resume -------------------------------------------------------------------------

// Kept contents are copied back chunk by chunk as their pages are mapped,
// so that the device copies one chunk while the host maps the next (on an
// H200 both take about 20 ms per GiB; docs/perf.md). 32 pages: 64 MiB.
constexpr std::size_t restore_chunk_pages = 32;

// Room first: ccalloc's own cached memory of active tags goes back when
// the device or the cap lacks `need` bytes.
void tag_sleep::make_room(std::size_t need, sleep_result& r, world_lock& w) {
  const auto lacks_room = [&] {
    if (d_.memory().over_cap(need)) return true;
    return need > d_.backend().mem_get_info(d_.device()).free_bytes;
  };
  if (need > 0 && lacks_room()) {
    const std::size_t before = d_.memory().reserved();
    d_.segments().release_cached_blocks(w, /*for_retry=*/true);
    r.cache_released_bytes = before - std::min(before, d_.memory().reserved());
  }
}
bool tag_sleep::map_paused_segment(segment& seg) {
  const std::size_t page = seg.page_bytes;
  // Pages a failed resume could not unmap (unmap_resumed_pages) are unmapped
  // first: nothing may be mapped over them (a refusal throws, nothing mapped).
  if (!seg.pages.retired().empty())
    d_.expandable().settle_retired_in(seg, 0, std::numeric_limits<std::size_t>::max(), true);
  const stat_group g = group_of(seg.head->pool);
  const stream_t stream = copy_stream(seg);
  // The books are the record of what is mapped (seg.pages): a page counts
  // as mapped the moment the device mapped it, so that a throw anywhere
  // below gives back exactly the pages mapped so far (a paused reservation
  // has none of its own).
  for (const auto& run : seg.paused_runs) {
    std::size_t chunk_first = run.first_page;
    for (std::size_t i = run.first_page; i < run.first_page + run.pages; ++i) {
      physical_handle_t h = 0;
      bool ok = false;
      try {
        ok = d_.backend().vm_create(d_.device(), page, &h);
        if (ok) {
          void* addr = reinterpret_cast<void*>(seg.base + i * page);
          try {
            d_.backend().vm_map(d_.device(), addr, page, h);
          } catch (...) {
            d_.backend().vm_release_handle(d_.device(), h);
            throw;
          }
          seg.pages.set_mapped(i, h);
          ++d_.stats().values().num_pages_mapped;
          ++d_.stats().values().num_device_alloc;
          seg.mapped_bytes += page;
          d_.memory().add_reserved(page);
          count_up(d_.stats().values().reserved_bytes, g, static_cast<std::int64_t>(page));
          for (int peer : d_.expandable().peers()) d_.backend().vm_set_access(d_.device(), addr, page, peer);
        }
        const std::size_t end = i + 1;
        if (ok && (end == run.first_page + run.pages || end - chunk_first >= restore_chunk_pages)) {
          if (run.host != nullptr)
            d_.backend().copy_from_host_async(d_.device(), reinterpret_cast<void*>(seg.base + chunk_first * page),
                                              static_cast<const char*>(run.host) + (chunk_first - run.first_page) * page,
                                              (end - chunk_first) * page, stream);
          chunk_first = end;
        }
      } catch (...) {
        unmap_resumed_pages(seg);
        throw;
      }
      if (!ok) {
        unmap_resumed_pages(seg);
        return false;
      }
    }
  }
  return true;
}

void tag_sleep::unmap_resumed_pages(segment& seg) noexcept {
  const auto kept = [](const segment::paused_run& run) { return run.host != nullptr; };
  if (std::any_of(seg.paused_runs.begin(), seg.paused_runs.end(), kept)) {
    try {
      wait_for_stream(copy_stream(seg));  // no copy may still write a page given back
    } catch (...) {  // the device refused the wait: the error being reported is another
    }
  }
  for (const auto& run : seg.paused_runs)
    for (std::size_t i = run.first_page; i < run.first_page + run.pages; ++i)
      if (seg.pages.mapped(i)) d_.expandable().give_back_page(seg, i);
  // A page whose unmap the device refused is retired (give_back_page),
  // given up and still counted as reserved: its unmap is tried again now,
  // as a pause does. Refused again, it stays retired in the paused
  // reservation until a later settle_retired (empty_cache) or the next
  // resume of the tag (map_paused_segment) unmaps it.
  if (!seg.pages.retired().empty()) {
    try {
      d_.expandable().settle_retired_in(seg, 0, std::numeric_limits<std::size_t>::max(), true);
    } catch (...) {  // the error being reported is another
    }
  }
}

void tag_sleep::finish_mapping(const std::vector<segment*>& segs) {
  for (segment* seg : segs) {  // the host copies must have been read before they go
    const auto kept = [](const segment::paused_run& run) { return run.host != nullptr; };
    if (std::any_of(seg->paused_runs.begin(), seg->paused_runs.end(), kept)) wait_for_stream(copy_stream(*seg));
  }
  std::size_t inserted = 0;  // blocks back in their pools, in the order below
  try {
    for (segment* seg : segs)
      for (block* b : seg->paused_free) {
        d_.expandable().pool_insert_counted(b);
        ++inserted;
      }
  } catch (...) {
    for (segment* seg : segs)
      for (block* b : seg->paused_free) {
        if (inserted == 0) break;
        d_.expandable().pool_erase_counted(b);
        --inserted;
      }
    throw;
  }
}

// A resume that could not map every page: the pages mapped so far go back
// (after the copies into them), the observers hear of it, and the error
// says what holds the device's memory. The tags stay paused.
void tag_sleep::fail_resume(const std::vector<tag_id>& todo, const std::vector<segment*>& mapped, std::size_t need,
                            const sleep_result& r, world_lock& w) {
  for (segment* seg : mapped) unmap_resumed_pages(*seg);
  std::string names;
  for (tag_id tag : todo) names += (names.empty() ? "'" : ", '") + tag_name(tag) + "'";
  const memory_info info = d_.backend().mem_get_info(d_.device());
  const std::size_t outside = info.total_bytes - std::min(info.total_bytes, info.free_bytes + d_.memory().reserved());
  std::string msg = "ccalloc: out of memory resuming tag " + names + " on device " + std::to_string(d_.device()) +
                    ": it needs " + format_bytes(need) + " of pages mapped again; the device has " +
                    format_bytes(info.free_bytes) + " free of " + format_bytes(info.total_bytes) +
                    "; ccalloc holds " + format_bytes(d_.memory().reserved()) + " reserved (";
  bool first = true;
  std::set<tag_id> seen;
  for (const auto& [base, seg] : d_.segments()) seen.insert(tag_of(*seg));
  for (tag_id tag : seen) {
    const tag_usage u = usage_of(tag);
    if (u.reserved_bytes == 0) continue;
    msg += (first ? "" : ", ") + u.tag + " " + format_bytes(u.reserved_bytes);
    first = false;
  }
  msg += std::string(first ? "nothing" : "") + ") after returning " + format_bytes(r.cache_released_bytes) +
         " of its cached memory; " + format_bytes(outside) + " is held outside ccalloc (other allocators, processes)";
  if (d_.memory().capped()) msg += "; the memory-fraction cap allows " + format_bytes(d_.memory().allowed());
  msg += ". The tag stays paused: free memory and call resume again";
  const out_of_memory_error::figures f{d_.device(), need,
                                        d_.memory().capped() ? d_.memory().allowed() : info.total_bytes,
                                        info.free_bytes, 0, d_.memory().reserved()};
  const auto observers = d_.oom().observers();
  w.unlock();
  for (const auto& o : observers) {
    try {
      o(d_.device(), need, f.device_total_bytes, f.device_free_bytes);
    } catch (...) {  // an observer's failure must not hide the out-of-memory error being thrown
    }
  }
  throw out_of_memory_error(msg, f);
}

void tag_sleep::restore_paused_segment(segment& seg, sleep_result& r) noexcept {
  const std::size_t page = seg.page_bytes;
  for (auto& run : seg.paused_runs) {
    d_.mapping().announce(mapping_change::map, mapping_reason::pages_resumed, seg.base + run.first_page * page,
                          run.pages * page, seg.head->stream, true);
    if (d_.history().active()) [[unlikely]] {
      try {
        d_.history().record_segment_map(seg.base + run.first_page * page, run.pages * page, seg.head->stream);
      } catch (...) {  // the history misses this map; the resume is done
      }
    }
    r.paused_bytes += run.pages * page;
    if (run.host != nullptr) r.copied_bytes += run.pages * page;
  }
  for (auto& run : seg.paused_runs) host_copies_.give(run.host);
  seg.paused_runs.clear();
  seg.paused = false;
  d_.expandable().note_maybe_empty(seg);  // a reservation that had no page to map again
  seg.paused_free.clear();
}

// Every step that may fail (host memory for the books, the device's pages,
// the waits) comes before the first that marks a segment resumed; a failure
// gives back every page mapped so far, so that the tags stay paused with
// the device and the books agreeing, and a later resume maps them again.
sleep_result tag_sleep::resume_tags(const std::vector<tag_id>& tags, world_lock& w) {
  sleep_result r;
  const std::optional<std::uint64_t> start_us = d_.backend().host_time_us();
  std::vector<tag_id> todo;
  for (tag_id tag : tags)
    if (tag_paused(tag) && std::find(todo.begin(), todo.end(), tag) == todo.end()) todo.push_back(tag);
  if (todo.empty()) return r;
  std::vector<segment*> segs;
  std::size_t need = 0;
  for (tag_id tag : todo)
    for (segment* seg : segments_of(tag))
      if (seg->paused) {
        segs.push_back(seg);
        for (const auto& run : seg->paused_runs) need += run.pages * seg->page_bytes;
      }
  std::vector<std::pair<tag_id, std::size_t>> resumed;  // bytes mapped again, for history
  resumed.reserve(todo.size());
  r.tags.reserve(todo.size());
  for (tag_id tag : todo) {
    resumed.emplace_back(tag, usage_of(tag).paused_bytes);
    r.tags.push_back(tag_name(tag));
  }
  std::vector<segment*> mapped;
  mapped.reserve(segs.size());
  make_room(need, r, w);
  bool ok = !(need > 0 && d_.memory().over_cap(need));
  try {
    for (segment* seg : segs) {
      if (!ok) break;
      ok = map_paused_segment(*seg);
      if (ok) mapped.push_back(seg);
    }
    if (ok) finish_mapping(segs);
  } catch (...) {
    for (segment* seg : mapped) unmap_resumed_pages(*seg);
    throw;
  }
  if (!ok) fail_resume(todo, mapped, need, r, w);
  for (segment* seg : segs) {
    const tag_scope entries_tag(tag_of(*seg));
    restore_paused_segment(*seg, r);
  }
  for (const auto& [tag, bytes] : resumed) {
    paused_tags_.erase(tag);
    if (d_.history().active()) [[unlikely]] {
      try {
        d_.history().record(trace_entry_action::resume, 0, bytes, 0, nullptr, tag);
      } catch (...) {  // the history misses this entry; the resume is done
      }
    }
  }
  any_paused_.store(!paused_tags_.empty(), std::memory_order_relaxed);
  d_.memory().raise_high_water();
  if (const std::optional<std::uint64_t> end_us = d_.backend().host_time_us(); start_us && end_us)
    r.host_time_us = *end_us - *start_us;
  return r;
}

}  // namespace detail

namespace {
std::vector<tag_id> tag_ids(const std::vector<std::string>& names, const char* what) {
  std::vector<tag_id> ids;
  for (const std::string& n : names) {
    const std::optional<tag_id> id = find_tag(n);
    if (!id)
      throw invalid_argument_error(std::string("ccalloc: ") + what + ": no tag named '" +
                                   n + "' (unknown tag)");
    ids.push_back(*id);
  }
  return ids;
}
}  // namespace

sleep_result device_caching_allocator::pause(const std::vector<std::string>& tags, bool keep_contents) {
  auto& s = *state_;
  const std::vector<tag_id> ids = tag_ids(tags, "pause");
  detail::tracker_delivery deliver;  // the pause's entries reach trackers after the locks
  detail::world_lock w(s);
  return s.tags().pause_tags(ids, keep_contents, w);
}

sleep_result device_caching_allocator::resume(const std::vector<std::string>& tags) {
  auto& s = *state_;
  const std::vector<tag_id> ids = tag_ids(tags, "resume");
  detail::tracker_delivery deliver;  // the resume's entries reach trackers after the locks
  std::vector<detail::block*> frees;
  sleep_result r;
  {
    detail::world_lock w(s);
    // The frees deferred to this resume, and room for them, before anything
    // changes: once the tags are resumed, taking them allocates nothing. A
    // segment keeps them while it is paused (and until they are done).
    std::vector<detail::segment*> owing;
    std::size_t owed = 0;
    for (tag_id id : ids)
      for (detail::segment* seg : s.tags().segments_of(id))
        if (!seg->frees_while_paused.empty() && std::find(owing.begin(), owing.end(), seg) == owing.end()) {
          owing.push_back(seg);
          owed += seg->frees_while_paused.size();
        }
    frees.reserve(owed);
    r = s.tags().resume_tags(ids, w);
    for (detail::segment* seg : owing) {
      if (seg->paused) continue;
      frees.insert(frees.end(), seg->frees_while_paused.begin(), seg->frees_while_paused.end());
      seg->frees_while_paused.clear();  // keeps its capacity: a free that fails below goes back there
    }
  }
  for (std::size_t i = 0; i < frees.size(); ++i) {  // their pages are mapped again
    detail::block* b = frees[i];
    try {
      if (b->free_completed_at_resume) {  // freed with history on: its free completes now
        const tag_scope block_tag(detail::tag_of(*b));
        s.history().record_free_completed(b->ptr, b->requested_bytes, b->stream, detail::tag_of(*b));
        b->free_completed_at_resume = false;
      }
      s.free(b);
    } catch (...) {
      // Out of host memory: the frees not done stay owed by their segments
      // (within the capacity they had), done by the next resume of the tag.
      for (std::size_t j = i; j < frees.size(); ++j) {
        detail::block* owed_block = frees[j];
        std::lock_guard lock(owed_block->pool->owner->mutex);
        try {
          owed_block->seg->frees_while_paused.push_back(owed_block);
        } catch (...) {  // the segment was paused again and grew its list meanwhile: this block stays allocated
        }
      }
      throw;
    }
  }
  return r;
}

std::string device_caching_allocator::block_tag(const detail::block* block) const {
  return tag_name(detail::tag_of(*block));  // fixed for the segment's life
}

std::vector<std::string> device_caching_allocator::paused_tags() const {
  auto& s = *state_;
  detail::world_lock w(s);
  std::vector<std::string> out;
  for (tag_id t : s.tags().paused_tags()) out.push_back(tag_name(t));
  return out;
}

std::vector<tag_usage> device_caching_allocator::tag_stats() const {
  auto& s = *state_;
  detail::world_lock w(s);
  s.stats().publish_all_pending(w);
  std::set<tag_id> tags{default_tag_id};
  for (const auto& [base, seg] : s.segments()) tags.insert(detail::tag_of(*seg));
  for (const auto& [tag, pp] : s.tags().tag_pools()) tags.insert(tag);
  tags.insert(s.tags().paused_tags().begin(), s.tags().paused_tags().end());  // also one that holds nothing
  std::vector<tag_usage> out;
  for (tag_id t : tags) out.push_back(s.tags().usage_of(t));
  return out;
}

}  // namespace ccalloc
