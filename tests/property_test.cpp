// property_test.cpp (SPEC R2): seeded random operation sequences against the
// caching allocator on a small simulated device, checked after every step
// against the allocator's own structural check and an independent model.
//
// Operations: malloc (sizes log-uniform in [1 B, 64 MiB], some just short
// of whole 2 MiB pages, some exact repeats, on two allocation streams; with `threads` also on
// cudaStreamPerThread's handle from this thread and from a worker thread,
// and frees with work still queued on the block's own stream), free,
// record_stream on side streams
// with work queued on them, clock advances, empty_cache, memory fraction
// changes, invalid frees, 1 EiB requests, and out-of-memory errors (the device
// has 512 MiB, so they happen).
//
// The model keeps every live allocation [ptr, ptr + requested) and every
// "pending" block: freed, but used on a side stream whose work (as of the
// free) completes at time T. After every step:
//   - device_caching_allocator::check_invariants() (tiling, merging, pool
//     membership, stats recount);
//   - no two live allocations overlap, and no new allocation overlaps a
//     pending block while the clock is before its T;
//   - page fences (issue 15): work on a live block's own stream uses it
//     (declared with sim_backend::use_memory); no allocation on another
//     stream overlaps it before that work ends unless that stream's later
//     work runs after it (a device-side wait the allocator queued,
//     reuse_with_stream_wait: its busy-until time is at or past the end),
//     and no page of it is unmapped (the simulated device counts
//     unsafe_unmaps) before that work ends, nor used by another stream's
//     work at an overlapping time through another address (a page that
//     moved: unsafe_reuses);
//   - requested_bytes.all.current = requested sizes of live + pending blocks;
//     allocation.all.current = live count; active.all.current = live + pending;
//   - reserved <= device capacity, reserved <= the fraction cap (or, right
//     after lowering the cap below what live blocks hold, never grows);
//     in caching mode the device's used bytes equal reserved bytes;
//   - an out-of-memory error is justified: the segment the policy needed did
//     not fit under the cap or in the device's free memory, and no pending
//     block or cached whole segment was left that could have been released.
// At the end everything is freed, the clock passes all work, empty_cache
// returns every segment: reserved 0 and the device's used bytes 0.
//
// Tags, pause and resume (SPEC S1-S4): Property.TaggedScopesPausesAndResumes
// FromSeveralThreads below runs the sleep-and-wake property
// (sleep_wake_property.hpp: tagged scopes, pauses with and without kept
// contents and resumes from four threads, with the invariants "no page
// holds blocks of two tags", "paused bytes are mapped nowhere", "a resumed
// block's contents equal what was kept" and "no unsafe use"). The
// concurrent test program runs the same code under ThreadSanitizer
// (sleep_wake_property_test.cpp).
//
// Reproducing a failure: the model's choices depend only on the seed (never on
// addresses); the allocator's tie-breaks depend on the order of the addresses
// the simulated device gives, which are its own (sim_backend.hpp,
// "Addresses") and follow its malloc and free calls alone, whatever the
// host's address-space randomization or threads. So run the failing case alone, e.g.
//   ccalloc_tests --gtest_filter='Property/PropertyTest.*/gc_fraction'
// (ctest runs each case in its own process already).
//
// A pending block leaves the allocator's books exactly when the allocator
// looks at its events: at the start of each malloc (those complete by then),
// or when it synchronizes all events (empty_cache, a memory fraction below
// reserved, the out-of-memory retry), which num_sync_all_streams counts.
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/base/types.hpp>
#include <ccalloc/core/config.hpp>
#include <ccalloc/core/device_caching_allocator.hpp>
#include <ccalloc/core/stats.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>

#include "mapping_table.hpp"
#include "sleep_wake_property.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <iterator>
#include <map>
#include <optional>
#include <memory>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace {

using namespace ccalloc;  // NOLINT: test file

constexpr std::size_t device_capacity = 512 * mib;

struct prop_case {
  const char* name;
  const char* conf;
  bool no_caching;      // enable(false) before the first operation
  bool toggle_caching;  // enable(false) / enable(true) now and then
  std::uint64_t seed;
  std::size_t ops;
  bool pools = false;  // private pools: create/release, nested begin/end, live-allocation checks (F20-F23)
  // Per-thread default streams (issue 16): allocations on cudaStreamPerThread's
  // handle from this thread and from a second one, and work queued on a
  // block's own stream before its free (checked: no other stream gets the
  // block before that work completes).
  bool threads = false;
  // Short-lived side streams (issue 15): now and then a burst of
  // allocations on one of a few streams that are otherwise idle, used by
  // work on that stream and freed at once; their idle reservations pass
  // whole to other streams (checked: never before that work completes).
  bool bursts = false;
  // The recycling time budget (recycle_time_percent): the simulated device's
  // modelled host clock runs at 20 us per unit of its virtual clock, so the
  // budget empties and refills as the run goes.
  bool host_clock = false;
};

[[maybe_unused]] std::ostream& operator<<(std::ostream& os, const prop_case& c) {
  return os << c.name << " (\"" << c.conf << "\", seed " << c.seed << ", " << c.ops << " ops)";
}

// ---- the size policies (SPEC B1, B2), restated for the OOM check ---------------

std::size_t policy_round(const allocator_config& c, std::size_t size) {
  if (size < 512) return 512;
  const std::size_t divisions = c.divisions_for(size);
  if (divisions > 1 && size > 512 * divisions) {
    if (std::has_single_bit(size)) return size;
    const std::size_t step = std::bit_floor(size) / divisions;
    return (size + step - 1) / step * step;
  }
  return (size + 511) / 512 * 512;
}

std::size_t policy_segment(const allocator_config& c, std::size_t rounded, bool caching) {
  if (!caching) return rounded;
  if (rounded <= mib) return 2 * mib;
  if (rounded < 10 * mib) return c.large_segment_size_bytes;
  return (rounded + 2 * mib - 1) / (2 * mib) * (2 * mib);
}

std::size_t granule(std::size_t bytes) { return (bytes + 2 * mib - 1) / (2 * mib) * (2 * mib); }

// ---- the model -------------------------------------------------------------------

struct live_alloc {
  std::size_t size = 0;
  stream_t stream = 0;
  mempool_id_t pool{};             // where the model routed it
  std::vector<stream_t> recorded;  // side streams it was used on
  std::size_t order = 0;           // index in model_runner::live_order_
};

struct pending_block {
  std::uintptr_t ptr = 0;
  std::size_t size = 0;
  std::uint64_t done_at = 0;  // the clock time its last side-stream event completes
  std::vector<stream_t> recorded;  // for a free deferred during a capture: events come at its end
};

/// A second thread that runs one call at a time for the model (synchronously),
/// so that cudaStreamPerThread's handle means another stream there.
class worker_thread {
 public:
  worker_thread() : thread_([this] { loop(); }) {}
  ~worker_thread() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  worker_thread(const worker_thread&) = delete;
  worker_thread& operator=(const worker_thread&) = delete;
  /// Runs `f` on the worker and returns when it is done; rethrows its exception.
  void run(const std::function<void()>& f) {
    std::unique_lock lock(mutex_);
    task_ = &f;
    error_ = nullptr;
    cv_.notify_all();
    cv_.wait(lock, [this] { return task_ == nullptr; });
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void loop() {
    std::unique_lock lock(mutex_);
    while (true) {
      cv_.wait(lock, [this] { return stop_ || task_ != nullptr; });
      if (stop_) return;
      try {
        (*task_)();
      } catch (...) {
        error_ = std::current_exception();
      }
      task_ = nullptr;
      cv_.notify_all();
    }
  }
  std::mutex mutex_;
  std::condition_variable cv_;
  const std::function<void()>* task_ = nullptr;
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

struct run_totals {
  std::size_t per_thread_mallocs = 0, busy_frees = 0, captures = 0, fitting_checks = 0, resyncs = 0;
  std::size_t mallocs = 0, ooms = 0, frees = 0, pending_frees = 0, records = 0, bad_frees = 0;
  std::size_t fraction_changes = 0, empty_caches = 0, reuse_checks = 0, toggles = 0;
  std::size_t pool_ops = 0, pool_allocs = 0, pool_misuse = 0, live_checks = 0, deferred_frees = 0;
  std::size_t uses = 0;
  std::size_t bursts = 0, adoptions = 0, destroyed_streams = 0;
  std::size_t pairs = 0;  // free + malloc of the same bytes right after a malloc (do_malloc)
  std::size_t quiet_pairs = 0;  // of those, while no freed block waited for events
  std::size_t waited_reuses = 0;  // allocations over memory another stream still uses, behind a device-side wait
};

// Memory that work on `stream` uses until `until` (do_use, or a block freed
// while its own stream still had work on it): only that stream may get its
// bytes back before then.
struct memory_use {
  std::uintptr_t ptr = 0;
  std::size_t size = 0;
  stream_t stream = 0;
  std::uint64_t until = 0;
};

class model_runner {
 public:
  explicit model_runner(const prop_case& c) : case_(c), rng_(c.seed) {
    sim_options o;
    o.capacity_bytes = device_capacity;
    if (c.host_clock) o.host_clock_mode = sim_options::host_clock::modeled;
    sim_ = std::make_shared<sim_backend>(o);
    config_ = allocator_config::parse(c.conf);
    alloc_ = std::make_unique<caching_allocator>(sim_, config_);
    alloc_->init(1);
    if (c.no_caching) alloc_->enable(false);
    caching_ = !c.no_caching;
    ever_uncached_ = c.no_caching;
    dev_ = &alloc_->device_allocator(0);
    // SPEC C1: a registration table kept from the mapping announcements. At
    // each announcement, what the table holds is mapped on the device (an
    // unmap comes before the device unmaps, a map after it maps).
    alloc_->attach_mapping_listener([this](const mapping_event& e) {
      if (e.change == mapping_change::unmap) check_registered_is_mapped(e);
      table_.apply(e);
      if (e.change == mapping_change::map) check_registered_is_mapped(e);
    });
    fraction_set_ = config_.memory_fraction_set;
    allowed_ = fraction_set_ ? static_cast<std::size_t>(config_.per_process_memory_fraction *
                                                        static_cast<double>(device_capacity))
                             : device_capacity;
    bound_ = allowed_;
    alloc_streams_ = {default_stream, sim_->create_stream(0)};
    for (int i = 0; i < 3; ++i) side_streams_.push_back(sim_->create_stream(0));
    if (c.threads) {
      main_per_thread_ = sim_->resolve_stream(0, per_thread_stream_handle);
      worker_.run([&] { worker_per_thread_ = sim_->resolve_stream(0, per_thread_stream_handle); });
    }
  }

  const run_totals& totals() const { return totals_; }

  /// One random operation. Returns "" or what went wrong.
  std::string step(std::size_t index) {
    const std::uint64_t before = sim_->now();
    std::string err = step_unsynced(index);
    // The device waited inside the operation (a segment free waits for the
    // whole device, as cudaFree does): events the allocator queried after
    // that wait completed even if they were due later than the model's
    // clock of the operation. Which ones it queried depends on its queue
    // order, so take the pending blocks it still holds from its books.
    if (err.empty() && sim_->now() != before && !advanced_) resync_pending();
    return err;
  }

  /// Keeps the model's pending blocks that the allocator still holds as
  /// pending (the others completed during a wait in the operation).
  void resync_pending() {
    std::map<std::uintptr_t, block_state> states;
    for (const auto& seg : dev_->segments())
      for (const auto& b : seg.blocks) states[b.address] = b.state;
    for (auto it = pending_.begin(); it != pending_.end();) {
      const auto st = states.find(it->ptr);
      if (it->done_at != UINT64_MAX && it->done_at <= sim_->now() &&
          (st == states.end() || st->second != block_state::active_pending_free)) {
        pending_requested_ -= it->size;
        it = pending_.erase(it);
        ++totals_.resyncs;
      } else {
        ++it;
      }
    }
  }

  std::string step_unsynced(std::size_t index) {
    step_ = index;
    advanced_ = false;
    if (case_.pools && rng_() % 100 < 5) return do_pool_op();
    if (case_.bursts && rng_() % 100 < 2) return do_burst();
    const std::size_t w_malloc = 100;
    const std::size_t w_free = 2 * live_.size();
    const std::size_t w_record = live_.empty() ? 0 : 14;
    const std::size_t w_other = 22;
    const std::size_t roll = rng_() % (w_malloc + w_free + w_record + w_other);
    if (roll < w_malloc) return do_malloc(pick_size());
    if (roll < w_malloc + w_free) return do_free(rng_() % live_.size());
    if (roll < w_malloc + w_free + w_record) return do_record();
    const std::size_t r = rng_() % 1000;
    if (r < 450) {
      sim_->advance_to(sim_->now() + 1 + rng_() % 25);
      sim_->set_host_time_us(sim_->now() * 20);  // ignored without host_clock
      advanced_ = true;  // the model's own clock move: nothing to resync
      return {};
    }
    if (r < 620) {
      const stream_t s = side_streams_[rng_() % side_streams_.size()];
      sim_->enqueue_work(0, s, sim_->now() + rng_() % 60);
      return {};
    }
    if (r < 700) return do_use();
    if (r < 715) return do_empty_cache();
    if (r < 735) return do_set_fraction();
    if (r < 935) return do_bad_free();
    if (r < 990 || !case_.toggle_caching) return do_huge_malloc();
    return do_toggle_caching();
  }

  /// The per-step model checks (and check_invariants when `structural`).
  std::string check(bool structural) {
    if (structural) {
      try {
        dev_->check_invariants();
      } catch (const std::exception& e) {
        return std::string("check_invariants: ") + e.what();
      }
    }
    const device_stats s = dev_->stats();
    const auto reserved = static_cast<std::size_t>(s.reserved_bytes[0].current);
    const std::size_t used = sim_->counters().used_bytes;
    std::ostringstream err;
    // SPEC C1: the table built from the announcements is what is mapped.
    if (const std::string e = table_.error(); !e.empty()) err << "mapping announcements: " << e << "; ";
    if (!late_announcement_.empty()) err << late_announcement_ << "; ";
    if (table_.ranges() != ccalloc::testing::mapped_ranges(*dev_))
      err << "the table of mapping announcements differs from the mapped ranges; ";
    // Page fences (issue 15): no page is unmapped while work that used it may run.
    if (sim_->counters().unsafe_unmaps != 0)
      err << sim_->counters().unsafe_unmaps << " page(s) unmapped while their stream's work could still use them; ";
    if (sim_->counters().unsafe_reuses != 0)
      err << sim_->counters().unsafe_reuses << " page(s) used by two streams' work at once (a use-after-reuse); ";
    if (reserved > device_capacity) err << "reserved " << reserved << " > capacity; ";
    if (reserved > bound_) err << "reserved " << reserved << " > cap " << bound_ << " (allowed " << allowed_ << "); ";
    bound_ = std::max(allowed_, reserved);
    if (!ever_uncached_ && used != reserved)
      err << "device used " << used << " != reserved " << reserved << " (segments are 2 MiB multiples); ";
    if (used < reserved) err << "device used " << used << " < reserved " << reserved << "; ";
    if (s.requested_bytes[0].current != static_cast<std::int64_t>(live_requested_ + pending_requested_))
      err << "requested_bytes.all.current " << s.requested_bytes[0].current << " != live " << live_requested_
          << " + pending " << pending_requested_ << "; ";
    if (s.allocation[0].current != static_cast<std::int64_t>(live_.size()))
      err << "allocation.all.current " << s.allocation[0].current << " != live " << live_.size() << "; ";
    if (s.active[0].current != static_cast<std::int64_t>(live_.size() + pending_.size()))
      err << "active.all.current " << s.active[0].current << " != live " << live_.size() << " + pending "
          << pending_.size() << "; ";
    // The accumulated counts (stored in a derived form: stat_storage.hpp):
    // every malloc that succeeded, every free (counted when called: a block
    // that waits for events stays active, no longer allocated).
    if (s.allocation[0].allocated != mallocs_done_ ||
        s.allocation[0].freed != mallocs_done_ - static_cast<std::int64_t>(live_.size()))
      err << "allocation.all allocated/freed " << s.allocation[0].allocated << "/" << s.allocation[0].freed
          << " != mallocs " << mallocs_done_ << " / those freed; ";
    if (s.requested_bytes[0].allocated != static_cast<std::int64_t>(requested_ever_))
      err << "requested_bytes.all.allocated " << s.requested_bytes[0].allocated << " != requested " << requested_ever_
          << "; ";
    for (const stat_array* a : {&s.allocation, &s.allocated_bytes, &s.active_bytes, &s.inactive_split, &s.segment})
      if ((*a)[0].allocated != (*a)[1].allocated + (*a)[2].allocated || (*a)[0].freed != (*a)[1].freed + (*a)[2].freed)
        err << "a counter's all.allocated/freed is not the sum of its pools'; ";
    if (s.allocated_bytes[0].current < static_cast<std::int64_t>(live_requested_))
      err << "allocated_bytes " << s.allocated_bytes[0].current << " < live requested " << live_requested_ << "; ";
    if (static_cast<std::size_t>(s.allocated_bytes[0].current) > reserved)
      err << "allocated_bytes " << s.allocated_bytes[0].current << " > reserved " << reserved << "; ";
    return err.str();
  }

  /// Frees everything, lets all work finish, empties the cache. Returns "" or
  /// what is left over.
  std::string finish() {
    if (capturing_) {
      sim_->end_capture(0, capture_stream_);
      capturing_ = false;
    }
    while (!active_.empty()) {
      alloc_->end_allocate_to_pool(0, active_.back().first);
      active_.pop_back();
      flush_model_deferred();
    }
    for (auto& [id, n] : use_)
      for (; n > 0; --n) alloc_->release_pool(0, id);
    while (!live_.empty()) {
      const std::string e = do_free(live_.size() - 1);
      if (!e.empty()) return "final free: " + e;
    }
    std::uint64_t end = sim_->now();
    for (stream_t s : side_streams_) end = std::max(end, sim_->busy_until(0, s));
    for (stream_t s : burst_streams_) end = std::max(end, sim_->busy_until(0, s));
    sim_->advance_to(end);
    alloc_->empty_cache();
    pending_.clear();
    pending_requested_ = 0;
    std::string e = check(true);
    if (!e.empty()) return "after empty_cache: " + e;
    const device_stats s = dev_->stats();
    std::ostringstream err;
    if (s.reserved_bytes[0].current != 0) err << "reserved " << s.reserved_bytes[0].current << " != 0; ";
    if (s.active_bytes[0].current != 0) err << "active_bytes " << s.active_bytes[0].current << " != 0; ";
    if (s.inactive_split[0].current != 0) err << "inactive_split " << s.inactive_split[0].current << " != 0; ";
    if (s.segment[0].current != 0) err << "segment " << s.segment[0].current << " != 0; ";
    if (sim_->counters().used_bytes != 0) err << "device used " << sim_->counters().used_bytes << " != 0; ";
    if (!dev_->segments().empty()) err << dev_->segments().size() << " segments left; ";
    return err.str();
  }

 private:
  std::string where() const {
    std::ostringstream os;
    os << "step " << step_ << " (clock " << sim_->now() << "): ";
    return os.str();
  }

  std::size_t pick_size() {
    if (!recent_sizes_.empty() && rng_() % 4 == 0) return recent_sizes_[rng_() % recent_sizes_.size()];
    // Just short of whole 2 MiB pages, by up to 1/64 of a page (issue 15:
    // carved on page boundaries inside cached blocks of expandable segments).
    if (rng_() % 8 == 0) return (1 + rng_() % 16) * 2 * mib - 512 * (1 + rng_() % 64);
    const double lg = std::uniform_real_distribution<double>(0.0, std::log(64.0 * double(mib)))(rng_);
    const auto size = std::max<std::size_t>(1, static_cast<std::size_t>(std::exp(lg)));
    if (recent_sizes_.size() < 16) recent_sizes_.push_back(size);
    else recent_sizes_[rng_() % 16] = size;
    return size;
  }

  /// Drops pending blocks the allocator has just processed: all of them if
  /// it synchronized every event, else those complete at `now`.
  void settle_pending(std::int64_t syncs_before, std::uint64_t now, bool processed_events) {
    const std::int64_t syncs = dev_->stats().num_sync_all_streams;
    const bool all = syncs != syncs_before;
    if (capturing_) processed_events = false;  // a capture is underway: no event is queried
    if (!all && !processed_events) return;
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (all || it->done_at <= now) {
        pending_requested_ -= it->size;
        it = pending_.erase(it);
      } else {
        ++it;
      }
    }
  }

  void count_malloc(std::size_t size) noexcept {
    ++mallocs_done_;
    requested_ever_ += size;
  }

  std::string do_malloc(std::size_t size, std::optional<stream_t> forced = std::nullopt) {
    ++totals_.mallocs;
    stream_t stream = rng_() % 5 == 0 ? alloc_streams_[1] : alloc_streams_[0];
    if (forced) stream = *forced;
    // cudaStreamPerThread's handle, here or on the worker: the model keys
    // the allocation by the stream it stands for there.
    int per_thread = 0;  // 0: no, 1: this thread, 2: the worker
    if (case_.threads && !forced && rng_() % 4 == 0) {
      per_thread = rng_() % 2 == 0 ? 1 : 2;
      stream = per_thread == 1 ? main_per_thread_ : worker_per_thread_;
      ++totals_.per_thread_mallocs;
    }
    const std::int64_t syncs = dev_->stats().num_sync_all_streams;
    const std::uint64_t now = sim_->now();
    const mempool_id_t routed = route(stream);
    const bool released = routed != mempool_id_t{} && use_[routed] == 0;
    const std::int64_t allocations_before = released ? dev_->stats().allocation[0].current : 0;
    void* p = nullptr;
    try {
      if (per_thread == 2)
        worker_.run([&] { p = alloc_->malloc(0, size, per_thread_stream_handle); });
      else
        p = alloc_->malloc(0, size, per_thread == 1 ? per_thread_stream_handle : stream);
      count_malloc(size);
      if (released) return where() + "an allocation routed to released pool " + to_string(routed) + " succeeded";
      // One malloc in eight on the thread's own stream is followed at once
      // by its free and a malloc of the same bytes on the same stream, with
      // no statistics read in between (a read takes the world lock, which
      // returns every parked block): the thread cache's hit path (issue 18).
      // The model keeps the second pointer; every check below applies to it
      // (an out-of-memory error of the second malloc is judged as any).
      if (per_thread == 0 && routed == mempool_id_t{} && !capturing_ && rng_() % 8 == 0) {
        alloc_->free(p);
        p = nullptr;
        p = alloc_->malloc(0, size, stream);
        count_malloc(size);
        ++totals_.pairs;
        if (pending_.empty()) ++totals_.quiet_pairs;
      }
    } catch (const invalid_argument_error& e) {
      if (!released) return where() + "malloc(" + std::to_string(size) + ") threw " + e.what();
      ++totals_.pool_misuse;
      settle_pending(syncs, now, true);  // it processed completed events before refusing
      if (dev_->stats().allocation[0].current != allocations_before)
        return where() + "a rejected allocation to a released pool changed the stats";
      return {};
    } catch (const out_of_memory_error& e) {
      ++totals_.ooms;
      settle_pending(syncs, now, true);
      if (e.requested_bytes != size) return where() + "OOM figures name another size";
      // While a capture is underway (or a live private pool caches memory)
      // the ladder may not wait, free or take pool memory: no policy check.
      if (case_.pools) return {};
      // Justified only if the segment the policy needs did not fit.
      // Expandable segments map whole pages: at most the rounded size in
      // pages plus one page shared with a neighbour.
      const std::size_t need = config_.expandable_segments && caching_
                                   ? granule(policy_round(config_, size))
                                   : policy_segment(config_, policy_round(config_, size), caching_);
      const bool over_cap = fraction_set_ && e.reserved_bytes + need > allowed_;
      const bool device_full = e.device_free_bytes < granule(need);
      if (!over_cap && !device_full) {
        std::ostringstream os;
        os << where() << "unjustified OOM for " << size << " bytes (segment " << need << "): reserved "
           << e.reserved_bytes << ", allowed " << allowed_ << ", device free " << e.device_free_bytes;
        return os.str();
      }
      // Before giving up the allocator waited for every event and returned
      // every cached whole segment (B6): none is left.
      for (const auto& seg : dev_->segments()) {
        for (const auto& b : seg.blocks)
          if (b.state == block_state::active_pending_free) return where() + "OOM with a block still pending";
        if (!seg.is_expandable && seg.blocks.size() == 1 && seg.blocks[0].state == block_state::inactive)
          return where() + "OOM although a whole cached segment of " + std::to_string(seg.total_bytes) +
                 " bytes was kept";
        // Nor a cached free block of this stream and pool that fits: the
        // ladder searches again after waiting for events (issue 16, item 1).
        if (caching_ && seg.stream == stream && seg.pool == mempool_id_t{} &&
            seg.is_small_pool == (policy_round(config_, size) <= mib)) {
          ++totals_.fitting_checks;
          const std::size_t rounded = policy_round(config_, size);
          const std::size_t max_split = config_.max_split_size_bytes;
          for (const auto& b : seg.blocks) {
            if (b.state != block_state::inactive || !b.mapped || b.size_bytes < rounded) continue;
            if (rounded < max_split && b.size_bytes >= max_split) continue;
            if (rounded >= max_split && b.size_bytes - rounded >= config_.max_non_split_rounding_bytes) continue;
            return where() + "OOM for " + std::to_string(size) + " bytes although a cached free block of " +
                   std::to_string(b.size_bytes) + " bytes of its stream and pool fits";
          }
        }
        if (seg.is_expandable)
          for (const auto& b : seg.blocks)
            if (b.mapped && b.state == block_state::inactive && granule(b.address + 1) + 2 * mib <= b.address + b.size_bytes)
              return where() + "OOM although a free whole page stayed mapped at " + std::to_string(b.address);
      }
      return {};
    } catch (const std::exception& e) {
      return where() + "malloc(" + std::to_string(size) + ") threw " + e.what();
    }
    settle_pending(syncs, now, true);
    if (p == nullptr) return where() + "malloc returned null";
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    if (a % 512 != 0) return where() + "pointer not 512-aligned";
    // No overlap with a live allocation.
    auto next = live_.upper_bound(a);
    if (next != live_.end() && next->first < a + size) return where() + "new allocation overlaps a live one (next)";
    if (next != live_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second.size > a) return where() + "new allocation overlaps a live one (prev)";
    }
    // No reuse of a pending block before its side-stream work completed.
    const std::uint64_t t = sim_->now();
    // Nor, on another stream, of memory whose own stream's work still uses it
    // (a block freed with work left on its own stream, do_use; page fences;
    // X2's adopted segments). A segment_free (cudaFree) waits
    // for the whole device on a real one: the uses before it are over.
    if (sim_->counters().segment_frees != seen_segment_frees_) {
      seen_segment_frees_ = sim_->counters().segment_frees;
      uses_.clear();
    }
    std::erase_if(uses_, [&](const memory_use& u) { return u.until <= t; });
    for (const auto& u : uses_) {
      ++totals_.reuse_checks;
      if (u.stream != stream && a < u.ptr + u.size && u.ptr < a + size && sim_->busy_until(0, stream) >= u.until) {
        ++totals_.waited_reuses;  // the stream's work on it runs after that use (a device-side wait)
        continue;
      }
      if (u.stream != stream && a < u.ptr + u.size && u.ptr < a + size) {
        std::ostringstream os;
        os << where() << "allocation [" << a << ", +" << size << ") on stream " << stream << " reuses ["
           << u.ptr << ", +" << u.size << ") that stream " << u.stream << "'s work uses until " << u.until
           << " (now " << t << ")";
        return os.str();
      }
    }
    for (const auto& pb : pending_) {
      ++totals_.reuse_checks;
      if (t < pb.done_at && a < pb.ptr + pb.size && pb.ptr < a + size) {
        std::ostringstream os;
        os << where() << "allocation [" << a << ", +" << size << ") reuses pending block [" << pb.ptr << ", +"
           << pb.size << ") before its stream work completes at " << pb.done_at;
        return os.str();
      }
    }
    live_.emplace(a, live_alloc{size, stream, routed, {}, live_order_.size()});
    if (routed != mempool_id_t{}) ++totals_.pool_allocs;
    live_order_.push_back(a);
    live_requested_ += size;
    return {};
  }

  /// The index-th live allocation in the model's own order (independent of
  /// addresses, so that a seed replays the same operations).
  std::map<std::uintptr_t, live_alloc>::iterator live_at(std::size_t index) {
    return live_.find(live_order_[index]);
  }

  std::string do_free(std::size_t index) {
    ++totals_.frees;
    auto it = live_at(index);
    const std::uintptr_t ptr = it->first;
    const live_alloc la = it->second;
    std::uint64_t done = 0;
    for (stream_t s : la.recorded) done = std::max(done, sim_->busy_until(0, s));
    if (case_.threads && rng_() % 3 == 0) {
      // A kernel on the block's own stream uses it until then: the free is
      // stream-ordered, so only that stream may reuse it meanwhile.
      const std::uint64_t until = sim_->now() + 1 + rng_() % 50;
      sim_->enqueue_work(0, la.stream, until);
      uses_.push_back({ptr, la.size, la.stream, sim_->busy_until(0, la.stream)});
      ++totals_.busy_frees;
    }
    try {
      alloc_->free(reinterpret_cast<void*>(ptr));
    } catch (const std::exception& e) {
      return where() + "free threw " + e.what();
    }
    live_order_[la.order] = live_order_.back();
    live_.at(live_order_[la.order]).order = la.order;
    live_order_.pop_back();
    live_.erase(it);
    live_requested_ -= la.size;
    if (!la.recorded.empty()) {
      ++totals_.pending_frees;
      if (capturing_) {  // deferred: its events are recorded when the capture ends
        ++totals_.deferred_frees;
        pending_.push_back({ptr, la.size, UINT64_MAX, la.recorded});
      } else {
        pending_.push_back({ptr, la.size, done, {}});
      }
      pending_requested_ += la.size;
    }
    return {};
  }

  // Work on a live block's own stream uses it (a kernel): declared to the
  // simulated device (use_memory) and kept by the model, which checks that
  // no other stream gets the memory, and the device that no page of it is
  // unmapped, before the work ends.
  std::string do_use() {
    if (live_.empty()) return {};
    ++totals_.uses;
    auto it = live_at(rng_() % live_.size());
    const stream_t s = it->second.stream;
    sim_->enqueue_work(0, s, sim_->now() + rng_() % 60);
    sim_->use_memory(0, reinterpret_cast<void*>(it->first), it->second.size, s);
    uses_.push_back({it->first, it->second.size, s, sim_->busy_until(0, s)});
    return {};
  }

  // A short-lived side stream's burst: 1-3 allocations on one of the burst
  // streams, each used by a kernel on that stream and freed at once (a
  // stream-ordered free: only that stream may reuse the bytes before the
  // kernel ends). Counts the expandable segments that changed stream since
  // the last burst (an idle reservation adopted).
  std::string do_burst() {
    ++totals_.bursts;
    if (burst_streams_.empty())
      for (int i = 0; i < 3; ++i) burst_streams_.push_back(sim_->create_stream(0));
    // (A segment given back since the last burst may have had its address
    // reserved again for another stream: start over then.)
    if (const std::int64_t freed = dev_->stats().segment[0].freed; freed != segments_freed_) {
      segments_freed_ = freed;
      segment_streams_.clear();
    }
    for (const auto& e : alloc_->expandable_segment_sizes(0)) {
      const auto [it, fresh] = segment_streams_.try_emplace(e.address, e.stream);
      if (!fresh && it->second != e.stream) {
        ++totals_.adoptions;
        it->second = e.stream;
      }
    }
    const stream_t s = burst_streams_[rng_() % burst_streams_.size()];
    const std::size_t n = 1 + rng_() % 3;
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t before = live_order_.size();
      if (std::string e = do_malloc(pick_size(), s); !e.empty()) return e;
      if (live_order_.size() == before || live_.at(live_order_.back()).stream != s) continue;  // OOM or routed away
      const std::uintptr_t ptr = live_order_.back();
      const std::size_t size = live_.at(ptr).size;
      sim_->enqueue_work(0, s, sim_->now() + 1 + rng_() % 60);
      sim_->use_memory(0, reinterpret_cast<void*>(ptr), size, s);
      uses_.push_back({ptr, size, s, sim_->busy_until(0, s)});
      if (std::string e = do_free(live_order_.size() - 1); !e.empty()) return e;
    }
    // Sometimes the burst's stream is destroyed once nothing of it is live
    // (legal in CUDA, its work still queued): the allocator must never
    // record on it again; the simulated device rejects a destroyed handle,
    // so a later record is an error of this test (the H200 crashed on it).
    if (rng_() % 4 == 0 &&
        std::none_of(live_.begin(), live_.end(), [&](const auto& kv) { return kv.second.stream == s; })) {
      sim_->destroy_stream(0, s);
      *std::find(burst_streams_.begin(), burst_streams_.end(), s) = sim_->create_stream(0);
      ++totals_.destroyed_streams;
    }
    return {};
  }

  std::string do_record() {
    ++totals_.records;
    auto it = live_at(rng_() % live_.size());
    if (rng_() % 10 == 0) {  // a use on its own stream: ignored
      alloc_->record_stream(reinterpret_cast<void*>(it->first), it->second.stream);
      return {};
    }
    const std::size_t uses = 1 + rng_() % 3;
    for (std::size_t i = 0; i < uses; ++i) {
      const stream_t s = side_streams_[rng_() % side_streams_.size()];
      sim_->enqueue_work(0, s, sim_->now() + rng_() % 40);
      alloc_->record_stream(reinterpret_cast<void*>(it->first), s);
      auto& rec = it->second.recorded;
      if (std::find(rec.begin(), rec.end(), s) == rec.end()) rec.push_back(s);
    }
    return {};
  }

  std::string do_empty_cache() {
    ++totals_.empty_caches;
    alloc_->empty_cache();
    if (capturing_) return {};  // nothing is waited for while capturing
    pending_.clear();
    pending_requested_ = 0;
    return {};
  }

  // ---- private pools (F20-F23) ----
  mempool_id_t route(stream_t s) const {
    for (auto it = active_.rbegin(); it != active_.rend(); ++it)
      if (it->second == 2 || alloc_streams_[it->second] == s) return it->first;
    return {};
  }

  // The capture ended: deferred frees record their events now.
  void flush_model_deferred() {
    if (capturing_ || !active_.empty()) return;
    for (auto& pb : pending_) {
      if (pb.done_at != UINT64_MAX) continue;
      pb.done_at = sim_->now();
      for (stream_t s : pb.recorded) pb.done_at = std::max(pb.done_at, sim_->busy_until(0, s));
      pb.recorded.clear();
    }
  }

  std::string do_pool_op() {
    ++totals_.pool_ops;
    static const std::array<mempool_id_t, 2> ids{mempool_id_t{1, 0}, mempool_id_t{0, 2}};
    const mempool_id_t id = ids[rng_() % ids.size()];
    const std::size_t op = rng_() % 6;
    auto expect_error = [&](auto f, const char* what) -> std::string {
      try {
        f();
      } catch (const invalid_argument_error&) {
        ++totals_.pool_misuse;
        return {};
      }
      return where() + what + " did not throw";
    };
    if (op == 0) {
      alloc_->create_or_incref_pool(0, id);
      ++use_[id];
    } else if (op == 1) {
      if (use_[id] == 0) return expect_error([&] { alloc_->release_pool(0, id); }, "releasing a released pool");
      alloc_->release_pool(0, id);
      --use_[id];
    } else if (op == 2) {
      if (use_[id] == 0)
        return expect_error([&] { alloc_->begin_allocate_to_pool(0, id, [](stream_t) { return true; }); },
                            "begin on a released pool");
      if (active_.size() >= 3 || capturing_) return {};
      const std::size_t which = rng_() % 3;  // stream 0, stream 1, or both
      const stream_t s = which == 2 ? 0 : alloc_streams_[which];
      // Half of the scopes of stream 1 alone are a real graph capture (the
      // simulated device then rejects every wait, query and device free);
      // the others are ordinary allocation into the pool (issue 16, item 3).
      const bool capture = which == 1 && active_.empty() && rng_() % 2 == 0;
      if (capture) {
        sim_->begin_capture(0, s);
        capturing_ = true;
        capture_stream_ = s;
        capture_pool_ = id;
        ++totals_.captures;
      }
      alloc_->begin_allocate_to_pool(0, id, [which, s](stream_t x) { return which == 2 || x == s; });
      active_.emplace_back(id, which);
      // A capture allocates on its stream first (that is how the allocator sees it).
      if (capture) return do_malloc(pick_size(), s);
    } else if (op == 3) {
      auto it = std::find_if(active_.rbegin(), active_.rend(), [&](const auto& e) { return e.first == id; });
      if (it == active_.rend()) return expect_error([&] { alloc_->end_allocate_to_pool(0, id); }, "ending an inactive pool");
      if (capturing_ && id == capture_pool_) {  // the capture ends, then its scope (as PyTorch does)
        sim_->end_capture(0, capture_stream_);
        capturing_ = false;
      }
      alloc_->end_allocate_to_pool(0, id);
      active_.erase(std::next(it).base());
      flush_model_deferred();
    } else {
      ++totals_.live_checks;
      std::vector<void*> mine;
      for (const auto& [a, la] : live_)
        if (la.pool == id) mine.push_back(reinterpret_cast<void*>(a));
      if (!alloc_->check_pool_live_allocations(0, id, mine))
        return where() + "check_pool_live_allocations(" + to_string(id) + ") is false for the model's " +
               std::to_string(mine.size()) + " allocations";
      if (!mine.empty() && alloc_->check_pool_live_allocations(0, id, {mine.begin() + 1, mine.end()}))
        return where() + "check_pool_live_allocations is true with one allocation missing";
      std::size_t sum = 0;
      sum += alloc_->get_pool_stats(0, {}).reserved_bytes;
      for (mempool_id_t p : dev_->pools()) sum += alloc_->get_pool_stats(0, p).reserved_bytes;
      if (static_cast<std::int64_t>(sum) != dev_->stats().reserved_bytes[0].current)
        return where() + "per-pool reserved bytes do not add up to reserved_bytes";
    }
    return {};
  }

  std::string do_set_fraction() {
    ++totals_.fraction_changes;
    static constexpr std::array<double, 5> fractions{0.25, 0.5, 0.75, 0.9, 1.0};
    const double f = fractions[rng_() % fractions.size()];
    const std::int64_t syncs = dev_->stats().num_sync_all_streams;
    try {
      alloc_->set_memory_fraction(f, 0);
    } catch (const std::exception& e) {
      return where() + "set_memory_fraction threw " + e.what();
    }
    settle_pending(syncs, sim_->now(), false);
    fraction_set_ = true;
    allowed_ = static_cast<std::size_t>(f * static_cast<double>(device_capacity));
    bound_ = std::max(allowed_, static_cast<std::size_t>(dev_->stats().reserved_bytes[0].current));
    return {};
  }

  std::string do_toggle_caching() {
    ++totals_.toggles;
    const std::int64_t syncs = dev_->stats().num_sync_all_streams;
    caching_ = !caching_;
    alloc_->enable(caching_);  // turning it off releases the cache (after syncing)
    ever_uncached_ = ever_uncached_ || !caching_;
    settle_pending(syncs, sim_->now(), false);
    if (alloc_->is_enabled() != caching_ || dev_->caching_enabled() != caching_)
      return where() + "enable() did not reach the device allocator";
    return {};
  }

  std::string do_bad_free() {
    ++totals_.bad_frees;
    void* bad = nullptr;
    if (!pending_.empty() && rng_() % 2 == 0) {
      bad = reinterpret_cast<void*>(pending_[rng_() % pending_.size()].ptr);  // freed already
    } else if (!live_.empty()) {
      bad = reinterpret_cast<void*>(live_order_[rng_() % live_.size()] + 1);  // interior: never a block start
    } else {
      return {};
    }
    const auto before = dev_->stats();
    try {
      alloc_->free(bad);
      return where() + "free of an invalid pointer did not throw";
    } catch (const invalid_argument_error&) {
    } catch (const std::exception& e) {
      return where() + "free of an invalid pointer threw the wrong type: " + e.what();
    }
    const auto after = dev_->stats();
    if (after.allocation[0].current != before.allocation[0].current ||
        after.requested_bytes[0].current != before.requested_bytes[0].current ||
        after.reserved_bytes[0].current != before.reserved_bytes[0].current ||
        after.allocation[0].freed != before.allocation[0].freed)
      return where() + "a rejected free changed the stats";
    return {};
  }

  std::string do_huge_malloc() {
    const std::size_t size = max_request_bytes + rng_() % 4096;
    const std::int64_t ooms = dev_->stats().num_ooms;
    try {
      (void)alloc_->malloc(0, size, alloc_streams_[0]);
      return where() + "a 1 EiB request succeeded";
    } catch (const out_of_memory_error&) {
    } catch (const std::exception& e) {
      return where() + "a 1 EiB request threw the wrong type: " + e.what();
    }
    if (dev_->stats().num_ooms != ooms + 1) return where() + "a 1 EiB request was not counted in num_ooms";
    return {};
  }

  prop_case case_;

 public:
  [[nodiscard]] std::int64_t thread_cache_hits() const { return dev_->stats().num_thread_cache_hits; }
  [[nodiscard]] std::int64_t stream_waits() const { return dev_->stats().num_stream_waits; }

 private:
  std::mt19937_64 rng_;
  // The device holds at least the table's bytes: mapped pages (expandable)
  // and live segments (plain; the property test has no custom allocators).
  void check_registered_is_mapped(const mapping_event& e) {
    const sim_counters c = sim_->counters();
    if (c.mapped_bytes + (c.used_bytes - c.handle_bytes) < table_.bytes() && late_announcement_.empty())
      late_announcement_ = std::string(to_string(e.change)) + " (" + std::string(to_string(e.reason)) +
                           ") announced while the device did not map what the table holds";
  }

  std::shared_ptr<sim_backend> sim_;
  ccalloc::testing::mapping_table table_;
  std::string late_announcement_;
  allocator_config config_;
  std::unique_ptr<caching_allocator> alloc_;
  device_caching_allocator* dev_ = nullptr;
  std::vector<stream_t> alloc_streams_;
  std::vector<stream_t> side_streams_;

  std::map<std::uintptr_t, live_alloc> live_;  // by address, for the overlap checks
  std::vector<std::uintptr_t> live_order_;      // the same pointers, in the model's order
  std::vector<pending_block> pending_;
  worker_thread worker_;
  stream_t main_per_thread_ = 0;    // resolve_stream(per_thread_stream_handle) here
  stream_t worker_per_thread_ = 0;  // and on the worker
  std::vector<memory_use> uses_;
  std::vector<stream_t> burst_streams_;                    // do_burst's streams
  std::map<std::uintptr_t, stream_t> segment_streams_;     // expandable segment -> stream at the last burst
  std::int64_t mallocs_done_ = 0;     // mallocs that succeeded
  std::size_t requested_ever_ = 0;    // their requested bytes
  std::int64_t segments_freed_ = 0;                        // segment.all.freed at the last burst
  std::uint64_t seen_segment_frees_ = 0;
  std::size_t live_requested_ = 0;
  std::size_t pending_requested_ = 0;
  std::vector<std::size_t> recent_sizes_;
  std::map<mempool_id_t, int> use_;                            // model use counts
  std::vector<std::pair<mempool_id_t, std::size_t>> active_;  // begin stack: pool, stream 0 / 1 / 2 = both
  bool advanced_ = false;   // the current step only moved the clock
  bool capturing_ = false;  // a real capture (sim begin_capture) on capture_stream_, scoped to capture_pool_
  stream_t capture_stream_ = 0;
  mempool_id_t capture_pool_{};

  bool caching_ = true;
  bool ever_uncached_ = false;  // no-caching segments are not 2 MiB multiples
  bool fraction_set_ = false;
  std::size_t allowed_ = 0;
  std::size_t bound_ = 0;  // reserved may not pass max(allowed, reserved when the cap was lowered)
  std::size_t step_ = 0;
  run_totals totals_;
};

class PropertyTest : public ::testing::TestWithParam<prop_case> {};

TEST_P(PropertyTest, RandomOperationsKeepEveryInvariant) {
  const prop_case& c = GetParam();
  SCOPED_TRACE(::testing::Message() << "config \"" << c.conf << "\"" << (c.no_caching ? " + enable(false)" : "")
                                    << ", seed " << c.seed);
  model_runner run(c);
  for (std::size_t i = 0; i < c.ops; ++i) {
    std::string err = run.step(i);
    ASSERT_TRUE(err.empty()) << err;
    err = run.check(true);  // check_invariants() after every step too
    ASSERT_TRUE(err.empty()) << "after step " << i << ": " << err;
  }
  const std::string err = run.finish();
  ASSERT_TRUE(err.empty()) << err;

  const run_totals& t = run.totals();
  std::printf("[ property ] %s: %zu ops, %zu mallocs (%zu OOM), %zu frees (%zu pending), %zu records, "
              "%zu empty_cache, %zu fraction changes, %zu invalid frees, %zu caching toggles\n",
              c.name, c.ops, t.mallocs, t.ooms, t.frees, t.pending_frees, t.records, t.empty_caches,
              t.fraction_changes, t.bad_frees, t.toggles);
  std::printf("[ property ] %s: %zu OOMs checked for a fitting cached block, %zu pending blocks completed by a "
              "device wait inside an operation, %zu real captures\n",
              c.name, t.fitting_checks, t.resyncs, t.captures);
  // The scenario must exercise what it claims to.
  EXPECT_GT(t.ooms, 0u) << "no out-of-memory error happened";
  EXPECT_GT(t.pending_frees, 0u);
  EXPECT_GT(t.fraction_changes, 0u);
  if (c.threads) {
    std::printf("[ property ] %s: %zu allocations on per-thread default streams, %zu frees with own-stream work\n",
                c.name, t.per_thread_mallocs, t.busy_frees);
    EXPECT_GT(t.per_thread_mallocs, 0u);
    EXPECT_GT(t.busy_frees, 0u);
  }
  EXPECT_GT(t.uses, 0u);
  // The thread cache (on by default) serves such pairs wherever it may park
  // (not with caching off, garbage collection, or private pools only).
  const std::int64_t hits = run.thread_cache_hits();
  std::printf("[ property ] %s: %zu free + malloc pairs (%zu while no block waited for events), %lld thread "
              "cache hits\n", c.name, t.pairs, t.quiet_pairs, static_cast<long long>(hits));
  EXPECT_GT(t.pairs, 0u);
  if (std::string_view(c.name) == "default" || std::string_view(c.name) == "expandable" ||
      std::string_view(c.name) == "plain_threads") {
    EXPECT_GT(hits, 0) << "no pair was served by the thread cache";
  }
  std::printf("[ property ] %s: %lld device-side waits (reuse_with_stream_wait), %zu allocations over memory "
              "another stream's work still used, behind one\n",
              c.name, static_cast<long long>(run.stream_waits()), t.waited_reuses);
  if (c.bursts) {
    std::printf("[ property ] %s: %zu bursts on short-lived streams, %zu reservations seen changing stream, "
                "%zu streams destroyed after their last free\n",
                c.name, t.bursts, t.adoptions, t.destroyed_streams);
    EXPECT_GT(t.bursts, 0u);
    EXPECT_GT(t.destroyed_streams, 0u);
    EXPECT_GT(t.adoptions, 0u) << "no idle reservation was adopted";
  }
  if (c.pools) {
    std::printf("[ property ] %s: %zu pool ops, %zu allocations in pools, %zu rejected misuses, %zu live checks, "
                "%zu deferred frees\n", c.name, t.pool_ops, t.pool_allocs, t.pool_misuse, t.live_checks,
                t.deferred_frees);
    EXPECT_GT(t.pool_allocs, 0u);
    EXPECT_GT(t.pool_misuse, 0u);
    EXPECT_GT(t.live_checks, 0u);
    EXPECT_GT(t.deferred_frees, 0u);
    EXPECT_GT(t.captures, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Property, PropertyTest,
    ::testing::Values(
        prop_case{"default", "", false, false, 0x5eed0001, 400'000, false, true},
        prop_case{"oversize_rounding", "max_split_size_mb:64,roundup_power2_divisions:4", false, false, 0x5eed0002,
                  400'000},
        prop_case{"gc_fraction", "garbage_collection_threshold:0.6,per_process_memory_fraction:0.5,"
                  "reuse_with_stream_wait:True", false, false,
                  0x5eed0003, 300'000},
        prop_case{"no_caching", "", true, false, 0x5eed0004, 150'000},
        prop_case{"pytorch_exact", "trim_on_new_peak:False,reuse_across_streams:False", false, false, 0x5eed0005, 150'000},
        prop_case{"caching_toggled", "max_split_size_mb:40,trim_on_new_peak:False", false, true, 0x5eed0006,
                  150'000},
        prop_case{"release_lock", "release_lock_on_cudamalloc:True,per_process_memory_fraction:0.75,"
                  "roundup_power2_divisions:[1:2,>:8]", false, false, 0x5eed0007, 100'000},
        prop_case{"expandable", "expandable_segments:True,reuse_with_stream_wait:True", false, false, 0x5eed0008,
                  300'000, false, true},
        prop_case{"expandable_pytorch", "expandable_segments:True,trim_on_new_peak:False,reuse_across_streams:False",
                  false, false, 0x5eed0009, 150'000},
        prop_case{"expandable_toggled", "expandable_segments:True,max_split_size_mb:40,"
                  "roundup_power2_divisions:4", false, true, 0x5eed000a, 150'000},
        prop_case{"expandable_recycle_always",
                  "recycles_per_peak:1000000,per_process_memory_fraction:0.6,reuse_with_stream_wait:True", false,
                  false, 0x5eed000d, 150'000},
        prop_case{"pools_expandable", "", false, false, 0x5eed000b, 150'000, true},
        prop_case{"pools_plain", "expandable_segments:False,max_split_size_mb:40", false, false, 0x5eed000c, 100'000,
                  true, true},
        // Plain segments near a full device with per-thread streams and
        // record_stream (issue 16: OOM while a fitting block waited on an event).
        prop_case{"plain_threads", "expandable_segments:False", false, false, 0x5eed000e, 200'000, false, true},
        // Short-lived side streams whose idle reservations other streams
        // adopt (issue 15), with per-thread streams and busy frees.
        prop_case{"side_stream_bursts", "reuse_with_stream_wait:True", false, false, 0x5eed000f, 200'000, false, true,
                  true},
        // Recycling under a small time budget (issues 15, 18): it runs out and
        // refills, the mark rises in between, and large peaks found with the
        // bucket empty draw on the reserve (about 45 times in this run, seen
        // with a counter added for the purpose); with a cap, per-thread
        // streams and side-stream bursts. (The free-island placement,
        // lowest_fitting_block, moved a block about 6,000 times over all the
        // cases, most in default-configured ones.)
        prop_case{"recycle_time_budget",
                  "recycle_time_percent:2,per_process_memory_fraction:0.8,reuse_with_stream_wait:True", false, false,
                  0x5eed0010, 150'000, false, true, true, true},
        // No recycling for a new peak (recycle_time_percent:0): only the cap
        // and out of memory recycle, with private pools and the clock running.
        prop_case{"recycle_time_zero", "recycle_time_percent:0,per_process_memory_fraction:0.6", false, false,
                  0x5eed0011, 100'000, true, true, false, true}),
    [](const ::testing::TestParamInfo<prop_case>& param_info) { return std::string(param_info.param.name); });

// The sleep-and-wake property (sleep_wake_property.hpp): about 1 s.
TEST(Property, TaggedScopesPausesAndResumesFromSeveralThreads) {
  ccalloc_test::sleep_wake_property::check_tagged_pauses_and_resumes_from_several_threads();
}

}  // namespace
