// The thread cache's slow parts: finding or creating a thread's record,
// freeing parked blocks (the thread's own on a miss, every thread's under
// the world lock), thread exit and device teardown. The fast path is inline
// in detail/thread_cache_fast.hpp; the design is in detail/thread_cache.hpp.
#include <cstdio>
#include <ccalloc/base/detail/thread_object.hpp>
#include <ccalloc/base/printable_text.hpp>
#include <ccalloc/core/config.hpp>
#include <ccalloc/core/device_caching_allocator.hpp>

#include "detail/device_state.hpp"
#include "detail/stats_sink.hpp"
#include "detail/thread_cache.hpp"
#include "detail/thread_cache_fast.hpp"

#include <array>
#include <cctype>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace ccalloc::detail {

namespace {

void add_hits(thread_cache_hits& into, thread_cache_hits& from) noexcept {
  for (std::size_t k = 0; k < 2; ++k) {
    into.blocks[k] += from.blocks[k];
    into.bytes[k] += from.bytes[k];
    into.requested_bytes[k] += from.requested_bytes[k];
    into.split_blocks[k] += from.split_blocks[k];
    into.split_bytes[k] += from.split_bytes[k];
  }
  into.oversize += from.oversize;
  into.any = into.any || from.any;
  from = thread_cache_hits{};
}

// Each hit is one free and one allocation: the accumulated counts only.
void count_hits(device_stats& st, thread_cache_hits& h) noexcept {
  if (!h.any) return;
  for (std::size_t k = 0; k < 2; ++k) {
    const stat_group g = k == 0 ? stat_group::small_pool : stat_group::large_pool;
    count_through(st.allocation, g, h.blocks[k]);
    count_through(st.active, g, h.blocks[k]);
    count_through(st.allocated_bytes, g, h.bytes[k]);
    count_through(st.active_bytes, g, h.bytes[k]);
    count_through(st.requested_bytes, g, h.requested_bytes[k]);
    count_through(st.inactive_split, g, h.split_blocks[k]);
    count_through(st.inactive_split_bytes, g, h.split_bytes[k]);
  }
  st.num_thread_cache_hits += h.blocks[0] + h.blocks[1];
  st.oversize_allocations.allocated += h.oversize;
  st.oversize_allocations.freed += h.oversize;
  h = thread_cache_hits{};
}

// Set when this thread's records are gone (thread exit): frees and mallocs
// from later thread-local destructors take the normal path.
constinit thread_local bool tls_records_gone = false;

// The records of one thread, one per device it freed a block on.
struct thread_records {
  std::vector<std::unique_ptr<thread_cache_record>> records;
  thread_records() = default;
  thread_records(const thread_records&) = delete;
  thread_records& operator=(const thread_records&) = delete;
  // Thread exit: the parked blocks and hits go to their devices (orphans).
  ~thread_records() {
    tls_records_gone = true;
    tls_last_record = nullptr;
    for (auto& r : records) {
      thread_cache_core& core = *r->core;
      std::lock_guard core_lock(core.mutex);
      if (!core.alive) continue;
      std::lock_guard record_lock(r->lock);
      const std::uint32_t n = r->count.load(std::memory_order_relaxed);
      for (std::uint32_t i = 0; i < n; ++i) core.orphans.push_back(r->slots[i].b);
      r->count.store(0, std::memory_order_relaxed);
      add_hits(core.orphan_hits, r->hits);
      std::erase(core.records, r.get());
    }
  }
};

// Not a C++ thread_local: a thread's first malloc must not stop the process
// when the host's memory is exhausted (base/detail/thread_object.hpp).
using thread_records_of = thread_object<thread_records>;


}  // namespace

thread_cache_registry::thread_cache_registry() {
  // On unless turned off: a hit hands out only the block the pools' best fit
  // would (block::reuse_version), so the addresses are the same with it and
  // without it. CCALLOC_THREAD_CACHE, spelled as the thread_cache key (one
  // parser), turns it off or limits it to the small pool.
  const char* env = std::getenv("CCALLOC_THREAD_CACHE");
  std::optional<thread_cache_mode> mode = thread_cache_mode::all;
  if (env != nullptr && *env != '\0') {
    mode = parse_thread_cache_mode(env);  // drops surrounding blanks, as the key's values
    if (!mode)
      std::fprintf(stderr,
                   "ccalloc: warning: CCALLOC_THREAD_CACHE='%s' is not one of off, small, all (also True/true/1, "
                   "False/false/0): the thread cache stays on (all)\n",
                   printable_text(env).c_str());
  }
  const thread_cache_mode m = mode.value_or(thread_cache_mode::all);
  small_only_.store(m == thread_cache_mode::small, std::memory_order_relaxed);
  enabled_.store(m != thread_cache_mode::off, std::memory_order_relaxed);
}

thread_cache_registry::~thread_cache_registry() {
  // The device's blocks go with its segments; the threads' records forget them.
  std::lock_guard core_lock(core_->mutex);
  core_->alive = false;
  for (thread_cache_record* r : core_->records) {
    std::lock_guard record_lock(r->lock);
    r->count.store(0, std::memory_order_relaxed);
    r->hits = thread_cache_hits{};
  }
  core_->records.clear();
  core_->orphans.clear();
}

thread_cache_record* thread_cache_find(device_state& d, bool create) {
  if (tls_records_gone) [[unlikely]]
    return nullptr;
  thread_records* found = thread_records_of::find();
  if (found == nullptr && !create) return nullptr;
  thread_records& mine = found != nullptr ? *found : thread_records_of::get();
  for (auto& r : mine.records) {
    if (r->device_id == d.id()) {
      tls_last_record = r.get();
      return r.get();
    }
  }
  if (!create || !d.thread_caches().enabled()) return nullptr;
  // Records of devices that are gone hold nothing: drop them here.
  std::erase_if(mine.records, [](const std::unique_ptr<thread_cache_record>& r) {
    std::lock_guard core_lock(r->core->mutex);
    return !r->core->alive;
  });
  auto r = std::make_unique<thread_cache_record>();
  r->device_id = d.id();
  r->core = d.thread_caches().core();
  {
    std::lock_guard core_lock(r->core->mutex);
    r->core->records.push_back(r.get());
  }
  mine.records.push_back(std::move(r));
  tls_last_record = mine.records.back().get();
  return tls_last_record;
}

void thread_cache_drain_own(device_state& d, thread_cache_record& r) {
  std::array<block*, thread_cache_slots> taken{};
  std::uint32_t n = 0;
  {
    std::lock_guard record_lock(r.lock);
    n = r.count.load(std::memory_order_relaxed);
    for (std::uint32_t i = 0; i < n; ++i) taken[i] = r.slots[i].b;
    r.count.store(0, std::memory_order_relaxed);
  }
  for (std::uint32_t i = 0; i < n; ++i) {  // the normal free (device_state::free)
    block* b = taken[i];
    stream_state& ss = *b->pool->owner;
    std::lock_guard lock(ss.mutex);
    stats_sink sink(d, ss);
    d.release_allocation(b, sink.get(), false);
  }
}

void drain_thread_caches(device_state& d, const world_lock& w) noexcept {
  thread_cache_core& core = *d.thread_caches().core();
  std::lock_guard core_lock(core.mutex);
  if (core.records.empty() && core.orphans.empty() && !core.orphan_hits.any) return;
  // The streams' pending statistics are older than these frees: first, so
  // that the peaks stay exact.
  d.stats().publish_all_pending(w);
  count_hits(d.stats().values(), core.orphan_hits);
  for (block* b : core.orphans) d.release_allocation(b, d.stats().values(), true);
  core.orphans.clear();
  for (thread_cache_record* r : core.records) {
    std::lock_guard record_lock(r->lock);
    count_hits(d.stats().values(), r->hits);
    const std::uint32_t n = r->count.load(std::memory_order_relaxed);
    for (std::uint32_t i = 0; i < n; ++i) d.release_allocation(r->slots[i].b, d.stats().values(), true);
    r->count.store(0, std::memory_order_relaxed);
  }
}

// thread_cache_take (detail/thread_cache_fast.hpp) when the cache is on or
// this thread has a record: a parked block for (requested_bytes, stream), or
// nullptr after freeing this thread's parked blocks of `s`.
block* thread_cache_take_slow(device_state& s, thread_cache_record* r, std::size_t requested_bytes,
                              stream_t stream) {
  if (r == nullptr || r->device_id != s.id()) [[unlikely]] {
    if (!s.thread_caches().enabled()) return nullptr;
    r = thread_cache_find(s, true);  // a thread that only allocates finds it at once next time
    if (r == nullptr) return nullptr;
  }
  if (r->count.load(std::memory_order_relaxed) == 0) return nullptr;
  // Pending events and captures go the normal way (events are processed
  // there; a capture may route to a private pool).
  if ((s.events().pending_count() | s.pools().scopes().depth()) !=
      0) [[unlikely]] {
    thread_cache_drain_own(s, *r);
    return nullptr;
  }
  r->lock.lock();
  const std::uint32_t count = r->count.load(std::memory_order_relaxed);  // a world lock may have emptied it
  for (std::uint32_t i = count; i-- > 0;) {  // the most recently parked first
    thread_cache_record::slot& sl = r->slots[i];
    // The same stream and bytes, and the block's pool unchanged since the
    // best fit that handed it out: the pools would hand out this block.
    if (sl.stream == stream && sl.requested == requested_bytes && thread_cache_still_reusable(sl.b))
      return thread_cache_hand_out(*r, i, count, requested_bytes);
  }
  r->lock.unlock();
  if (count != 0) {
    if (r->miss_streak < thread_cache_miss_limit) ++r->miss_streak;
    thread_cache_drain_own(s, *r);
  }
  return nullptr;
}

// thread_cache_park (detail/thread_cache_fast.hpp) when the cache is on.
bool thread_cache_park_slow(device_state& s, block* b) {
  thread_cache_record* r = tls_last_record;
  if (r == nullptr || r->device_id != s.id()) [[unlikely]] {
    r = thread_cache_find(s, true);
    if (r == nullptr) return false;
  }
  // Parked only if its pool has not changed since the best fit that handed
  // it out (block::reuse_version), so that a hit is what the pools would do.
  const bool parkable =
      thread_cache_still_reusable(b) && b->stream_uses.empty() && b->pool->priv == nullptr &&
      s.policy().caching() && !s.pools().capture_underway() &&
      !(s.thread_caches().small_only() && !b->pool->is_small) &&
      !(r->miss_streak == thread_cache_miss_limit && ++r->probe % thread_cache_probe_every != 0) &&
      r->count.load(std::memory_order_relaxed) != thread_cache_slots;
  if (!parkable) {
    // The normal free follows: this thread's parked blocks go first, so that
    // the pools see the frees in the program's order.
    if (r->count.load(std::memory_order_relaxed) != 0) thread_cache_drain_own(s, *r);
    return false;
  }
  r->lock.lock();
  const std::uint32_t count = r->count.load(std::memory_order_relaxed);  // only this thread adds
  r->slots[count] = {b, b->pool->owner->stream, b->requested_bytes};
  r->count.store(count + 1, std::memory_order_relaxed);
  r->lock.unlock();
  return true;
}

void thread_cache_registry::apply_setting(const allocator_config& config) noexcept {
  if (!config.thread_cache_set) return;
  small_only_.store(config.thread_cache == thread_cache_mode::small, std::memory_order_relaxed);
  enabled_.store(config.thread_cache != thread_cache_mode::off, std::memory_order_relaxed);
}

}  // namespace ccalloc::detail

namespace ccalloc {

void device_caching_allocator::set_thread_cache_enabled(bool enabled) {
  detail::world_lock w(*state_);  // frees every parked block
  state_->thread_caches().set_enabled(enabled);
}

bool device_caching_allocator::thread_cache_enabled() const noexcept {
  return state_->thread_caches().enabled();
}

}  // namespace ccalloc
