// Rung 6 of the fallback ladder (B6): the out-of-memory error
// (oom_reporter, detail/oom_reporter.hpp). Builds the
// message (what was asked, what the device and the cache hold, a hint),
// records the OOM in the history, writes the out-of-memory snapshot
// (oom_snapshot), calls the OOM observers outside the locks (F17) and throws
// out_of_memory_error.
#include <ccalloc/core/device_caching_allocator.hpp>

#include "detail/device_state.hpp"
#include "detail/format.hpp"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace ccalloc::detail {

namespace {
// The calling thread runs out-of-memory observers (of any device).
thread_local bool tls_observing_oom = false;

// What the message says about the request and the device, gathered under the world lock.
struct oom_facts {
  memory_info info;
  std::size_t allocated = 0;
  std::size_t reserved = 0;
  std::size_t largest_free = 0;
  bool custom_segments = false;  // the request's private pool has its own segment allocator
  bool pages = false;            // the request needed pages of an expandable segment (SPEC B7)
  bool too_large = false;        // refused at once (1 EiB or more): p.pool is null
  std::size_t needed = 0;        // the pages or the segment it needed
  std::size_t limit = 0;         // the fraction's bytes, else the device's
  bool fragmented = false;       // more than a tenth of the reserved bytes unallocated
};

oom_facts gather_oom_facts(device_state& d, const alloc_params& p, const world_lock& w) {
  oom_facts f;
  f.info = d.backend().mem_get_info(d.device());
  f.allocated = static_cast<std::size_t>(d.stats().values().allocated_bytes[0].current);
  f.reserved = d.memory().reserved();
  for (stream_state* ss : w.streams())
    for (block_pool* pool : {&ss->pools.small, &ss->pools.large})
      if (!pool->blocks.empty()) f.largest_free = std::max(f.largest_free, pool->blocks.largest()->size);
  f.custom_segments = p.pool != nullptr && p.pool->priv != nullptr && p.pool->priv->custom.malloc;
  f.pages = d.policy().caching() && d.policy().config().expandable_segments && d.expandable().page_bytes() != 0 &&
            !d.expandable().no_address_space() && !f.custom_segments;
  f.too_large = p.pool == nullptr;
  // (Rounded up to pages without wrapping past SIZE_MAX: a refused request may be that large.)
  const std::size_t page = d.expandable().page_bytes();
  f.needed = !f.pages || f.too_large ? p.alloc_size
             : p.size > std::numeric_limits<std::size_t>::max() - page + 1
                 ? p.size
                 : (p.size + page - 1) / page * page;
  f.limit = d.memory().capped() ? d.memory().allowed() : f.info.total_bytes;
  f.fragmented = f.reserved > f.allocated && f.reserved - f.allocated > f.reserved / 10;
  return f;
}

// What was asked, what the device and the cache hold.
std::string oom_situation(device_state& d, const alloc_params& p, const oom_facts& f) {
  std::string msg = "ccalloc: out of memory on device " + std::to_string(d.device()) + ". Tried to allocate " +
                    format_bytes(p.requested_bytes) + " (" + std::to_string(p.requested_bytes) + " bytes; " +
                    (f.too_large ? "requests of " + format_bytes(max_request_bytes) + " or more are refused at once"
                     : f.pages   ? "needed to map " + format_bytes(f.needed) + " of pages"
                                 : "needed a new segment of " + format_bytes(f.needed)) +
                    ")." +
                    // Said first: the device was not asked, its figures below are context only.
                    (f.custom_segments && !f.too_large
                         ? " The request's private pool gets its segments from its own segment allocator, and that "
                           "allocator refused the segment (the device was not asked)."
                         : "") +
                    " Device " + std::to_string(d.device()) + " has a total capacity of " +
                    format_bytes(f.info.total_bytes) + " of which " + format_bytes(f.info.free_bytes) + " is free.";
  if (d.memory().capped())
    msg += " The per-process memory fraction " + format_double(d.memory().fraction()) + " allows " +
           format_bytes(d.memory().allowed()) + ".";
  // The device may refuse memory it reports free (another process took it
  // meanwhile, its free memory is fragmented, an injected fault): say so
  // rather than leave "X is free" unexplained.
  const bool under_fraction = !d.memory().capped() || d.memory().reserved() + f.needed <= d.memory().allowed();
  if (f.info.free_bytes >= f.needed && under_fraction && !f.custom_segments)
    msg += std::string(" The device refused the ") + (f.pages ? "pages" : "segment") +
           " although it reports that much free (its free memory may be fragmented or taken meanwhile by "
           "another process).";
  msg += " Of the memory held by ccalloc, " + format_bytes(f.allocated) + " is allocated and " +
         format_bytes(f.reserved - std::min(f.reserved, f.allocated)) +
         " is reserved but unallocated; the largest cached free block is " + format_bytes(f.largest_free) + ".";
  return msg;
}

// Advice: only what would change the outcome in this configuration. The
// ladder already waited for every event and returned every cached whole
// segment and free page, so garbage_collection_threshold (which returns
// the same memory, only sooner) never would.
std::string oom_advice(device_state& d, const oom_facts& f) {
  std::vector<std::string> settings;
  if (f.fragmented && !f.pages) {
    // Free pages of partly used segments could go back to the device.
    if (d.expandable().page_bytes() != 0 && !f.custom_segments)
      settings.emplace_back("expandable_segments:True so that the free pages of partly used segments are returned");
    // Large cached blocks would not be split for small requests (blocks of
    // expandable segments are never returned whole: no use there).
    if (d.policy().config().max_split_size_bytes == std::numeric_limits<std::size_t>::max())
      settings.emplace_back("max_split_size_mb:<MiB> so that large cached blocks are not split for small requests");
  }
  const std::string or_fraction = d.memory().capped() ? ", or raise the memory fraction." : ".";
  if (f.custom_segments && !f.too_large && !f.fragmented)
    return " Give the pool's segment allocator more memory, or allocate this request outside the pool.";
  if (f.needed > f.limit)
    return " The request alone is larger than the " +
           std::string(d.memory().capped() ? "memory the fraction allows" : "device's memory") + ".";
  if (f.fragmented && f.needed > std::min(f.info.free_bytes + (f.reserved - f.allocated),
                                          f.limit - std::min(f.limit, f.allocated)))
    // (Refused at once, the cache kept: allocate_slow.)
    return std::string(" Returning the cache would not make room: the request is larger than the device's free "
                       "memory and all that ccalloc holds beyond its allocations together; reduce the memory the "
                       "program holds at its peak") +
           or_fraction;
  if (!settings.empty()) {
    std::string msg = " Reserved but unallocated memory is large (fragmentation): try CCALLOC_CONF=" + settings[0];
    for (std::size_t i = 1; i < settings.size(); ++i) msg += ", or " + settings[i];
    return msg + ".";
  }
  if (f.fragmented && f.pages)
    return " Reserved but unallocated memory is large: it lies in pages shared with live blocks (every free whole "
           "page was unmapped already) or is cached by live private pools; reduce the memory the program holds at "
           "its peak, or free long-lived small allocations first.";
  return std::string(" Reduce the memory the program holds at its peak (batch size, sequence length)") + or_fraction;
}

// Every observer runs, and the caller still gets the out-of-memory error:
// an exception from an observer is dropped (observers are notifications).
// Called with no lock held.
void run_oom_observers(const std::vector<oom_observer>& observers, int device, std::size_t requested_bytes,
                       const out_of_memory_error::figures& f) {
  struct observing {
    observing() noexcept { tls_observing_oom = true; }
    ~observing() { tls_observing_oom = false; }
    observing(const observing&) = delete;
    observing& operator=(const observing&) = delete;
  };
  const observing scope;
  for (const auto& o : observers) {
    try {
      o(device, requested_bytes, f.device_total_bytes, f.device_free_bytes);
    } catch (...) {  // dropped, as above
    }
  }
}
}  // namespace

// The out-of-memory snapshot (oom_snapshot): at most one per
// oom_snapshot_interval_s per device, decided under the world lock so that
// threads failing together write one. Returns the path to write (empty:
// none); says in `msg` why none is written when the interval holds it back.
std::string oom_reporter::claim_snapshot(std::string& msg) {
  if (d_.policy().config().oom_snapshot_path.empty() || !snapshot_writer_) return {};
  const auto now_us = static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
  const std::uint64_t since_s = last_snapshot_us_ ? (now_us - *last_snapshot_us_) / 1'000'000 : 0;
  if (!last_snapshot_us_ || since_s >= d_.policy().config().oom_snapshot_interval_s) {
    last_snapshot_us_ = now_us;
    return d_.policy().config().oom_snapshot_path;
  }
  msg += " No snapshot was written (oom_snapshot): the last one went to " + d_.policy().config().oom_snapshot_path +
         " " + std::to_string(since_s) + " s ago, and oom_snapshot_interval_s is " +
         std::to_string(d_.policy().config().oom_snapshot_interval_s) + ".";
  return {};
}

void oom_reporter::throw_out_of_memory(const alloc_params& p, world_lock& w) {
  ++d_.stats().values().num_ooms;
  const oom_facts facts = gather_oom_facts(d_, p, w);
  std::string msg = oom_situation(d_, p, facts) + oom_advice(d_, facts);
  out_of_memory_error::figures f;
  f.device = d_.device();
  f.requested_bytes = p.requested_bytes;
  f.device_total_bytes = facts.limit;
  f.device_free_bytes = facts.info.free_bytes;
  f.allocated_bytes = facts.allocated;
  f.reserved_bytes = facts.reserved;
  if (d_.history().active()) [[unlikely]]
    d_.history().record_oom(facts.info.free_bytes, p.requested_bytes, p.stream);
  // Observers run outside the locks (SPEC F17): they may call back into
  // ccalloc. An out-of-memory error inside an observer (it allocates, on
  // this thread) is not observed again: an observer that allocates on every
  // call would otherwise recurse until the thread's stack ran out.
  // Nor does it write another oom_snapshot: the outer error writes one.
  if (tls_observing_oom) throw out_of_memory_error(std::move(msg), f);
  const std::string snapshot_path = claim_snapshot(msg);
  auto observers = observers_;
  w.unlock();
  if (!snapshot_path.empty()) {
    try {  // the writer never throws; appending its sentence may (host out of memory): the OOM error still goes out
      msg += snapshot_writer_(snapshot_path);
    } catch (...) {
    }
  }
  run_oom_observers(observers, d_.device(), p.requested_bytes, f);
  throw out_of_memory_error(std::move(msg), f);
}

}  // namespace ccalloc::detail
