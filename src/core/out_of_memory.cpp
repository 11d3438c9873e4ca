// Rung 6 of the fallback ladder (B6): the out-of-memory error. Builds the
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
}  // namespace

void device_state::throw_out_of_memory(const alloc_params& p, world_lock& w) {
  const memory_info info = backend_.mem_get_info(device_);
  ++stats_.num_ooms;
  const auto allocated = static_cast<std::size_t>(stats_.allocated_bytes[0].current);
  const std::size_t reserved = reserved_bytes_;
  std::size_t largest_free = 0;
  for (stream_state* ss : w.streams())
    for (block_pool* pool : {&ss->pools.small, &ss->pools.large})
      if (!pool->blocks.empty()) largest_free = std::max(largest_free, pool->blocks.largest()->size);

  // Pages of an expandable segment, or a segment (SPEC B7): what this request needed.
  // (p.pool is null for a request refused at once: 1 EiB or more.)
  const bool custom_segments = p.pool != nullptr && p.pool->priv != nullptr && p.pool->priv->custom.malloc;
  const bool pages = caching_ && config_.expandable_segments && page_bytes_ != 0 && !no_address_space_ &&
                     !custom_segments;
  // (Rounded up to pages without wrapping past SIZE_MAX: a refused request may be that large.)
  const bool too_large = p.pool == nullptr;
  const std::size_t needed =
      !pages || too_large ? p.alloc_size
      : p.size > std::numeric_limits<std::size_t>::max() - page_bytes_ + 1
          ? p.size
          : (p.size + page_bytes_ - 1) / page_bytes_ * page_bytes_;
  std::string msg = "ccalloc: out of memory on device " + std::to_string(device_) + ". Tried to allocate " +
                    format_bytes(p.requested_bytes) + " (" + std::to_string(p.requested_bytes) + " bytes; " +
                    (too_large ? "requests of " + format_bytes(max_request_bytes) + " or more are refused at once"
                     : pages   ? "needed to map " + format_bytes(needed) + " of pages"
                               : "needed a new segment of " + format_bytes(needed)) +
                    "). Device " + std::to_string(device_) + " has a total capacity of " +
                    format_bytes(info.total_bytes) + " of which " + format_bytes(info.free_bytes) + " is free.";
  if (set_fraction_)
    msg += " The per-process memory fraction " + format_double(fraction_) + " allows " +
           format_bytes(allowed_bytes_) + ".";
  // The device may refuse memory it reports free (another process took it
  // meanwhile, its free memory is fragmented, an injected fault): say so
  // rather than leave "X is free" unexplained.
  const bool under_fraction = !set_fraction_ || reserved_bytes_ + needed <= allowed_bytes_;
  if (info.free_bytes >= needed && under_fraction)
    msg += std::string(" The device refused the ") + (pages ? "pages" : "segment") +
           " although it reports that much free (its free memory may be fragmented or taken meanwhile by "
           "another process).";
  msg += " Of the memory held by ccalloc, " + format_bytes(allocated) + " is allocated and " +
         format_bytes(reserved - std::min(reserved, allocated)) +
         " is reserved but unallocated; the largest cached free block is " + format_bytes(largest_free) + ".";
  // Advice: only what would change the outcome in this configuration. The
  // ladder already waited for every event and returned every cached whole
  // segment and free page, so garbage_collection_threshold (which returns
  // the same memory, only sooner) never would.
  const std::size_t limit = set_fraction_ ? allowed_bytes_ : info.total_bytes;
  const bool fragmented = reserved > allocated && reserved - allocated > reserved / 10;
  std::vector<std::string> settings;
  if (fragmented && !pages) {
    // Free pages of partly used segments could go back to the device.
    if (page_bytes_ != 0 && !custom_segments)
      settings.emplace_back("expandable_segments:True so that the free pages of partly used segments are returned");
    // Large cached blocks would not be split for small requests (blocks of
    // expandable segments are never returned whole: no use there).
    if (config_.max_split_size_bytes == std::numeric_limits<std::size_t>::max())
      settings.emplace_back("max_split_size_mb:<MiB> so that large cached blocks are not split for small requests");
  }
  if (needed > limit) {
    msg += " The request alone is larger than the " +
           std::string(set_fraction_ ? "memory the fraction allows" : "device's memory") + ".";
  } else if (fragmented && needed > std::min(info.free_bytes + (reserved - allocated), limit - std::min(limit, allocated))) {
    // (Refused at once, the cache kept: allocate_slow.)
    msg += std::string(" Returning the cache would not make room: the request is larger than the device's free "
                       "memory and all that ccalloc holds beyond its allocations together; reduce the memory the "
                       "program holds at its peak") +
           (set_fraction_ ? ", or raise the memory fraction." : ".");
  } else if (!settings.empty()) {
    msg += " Reserved but unallocated memory is large (fragmentation): try CCALLOC_CONF=" + settings[0];
    for (std::size_t i = 1; i < settings.size(); ++i) msg += ", or " + settings[i];
    msg += ".";
  } else if (fragmented && pages) {
    msg += " Reserved but unallocated memory is large: it lies in pages shared with live blocks (every free whole "
           "page was unmapped already) or is cached by live private pools; reduce the memory the program holds at "
           "its peak, or free long-lived small allocations first.";
  } else {
    msg += std::string(" Reduce the memory the program holds at its peak (batch size, sequence length)") +
           (set_fraction_ ? ", or raise the memory fraction." : ".");
  }

  out_of_memory_error::figures f;
  f.device = device_;
  f.requested_bytes = p.requested_bytes;
  f.device_total_bytes = set_fraction_ ? allowed_bytes_ : info.total_bytes;
  f.device_free_bytes = info.free_bytes;
  f.allocated_bytes = allocated;
  f.reserved_bytes = reserved;
  if (history_.active()) [[unlikely]]
    history_.record_oom(info.free_bytes, p.requested_bytes, p.stream);
  // Observers run outside the locks (SPEC F17): they may call back into
  // ccalloc. An out-of-memory error inside an observer (it allocates, on
  // this thread) is not observed again: an observer that allocates on every
  // call would otherwise recurse until the thread's stack ran out.
  // Nor does it write another oom_snapshot: the outer error writes one.
  if (tls_observing_oom) throw out_of_memory_error(std::move(msg), f);
  // The out-of-memory snapshot (oom_snapshot): at most one per
  // oom_snapshot_interval_s per device, decided here under the lock so that
  // threads failing together write one; written below, unlocked.
  std::string snapshot_path;
  if (!config_.oom_snapshot_path.empty() && oom_snapshot_writer_) {
    const auto now_us = static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch())
            .count());
    const std::uint64_t since_s = last_oom_snapshot_us_ ? (now_us - *last_oom_snapshot_us_) / 1'000'000 : 0;
    if (!last_oom_snapshot_us_ || since_s >= config_.oom_snapshot_interval_s) {
      last_oom_snapshot_us_ = now_us;
      snapshot_path = config_.oom_snapshot_path;
    } else {
      msg += " No snapshot was written (oom_snapshot): the last one went to " + config_.oom_snapshot_path + " " +
             std::to_string(since_s) + " s ago, and oom_snapshot_interval_s is " +
             std::to_string(config_.oom_snapshot_interval_s) + ".";
    }
  }
  auto observers = observers_;
  w.unlock();
  if (!snapshot_path.empty()) {
    try {  // the writer never throws; appending its sentence may (host out of memory): the OOM error still goes out
      msg += oom_snapshot_writer_(snapshot_path);
    } catch (...) {
    }
  }
  // Every observer runs, and the caller still gets the out-of-memory error:
  // an exception from an observer is dropped (observers are notifications).
  struct observing {
    observing() noexcept { tls_observing_oom = true; }
    ~observing() { tls_observing_oom = false; }
    observing(const observing&) = delete;
    observing& operator=(const observing&) = delete;
  };
  {
    const observing scope;
    for (auto& o : observers) {
      try {
        o(device_, p.requested_bytes, f.device_total_bytes, f.device_free_bytes);
      } catch (...) {
      }
    }
  }
  throw out_of_memory_error(std::move(msg), f);
}

}  // namespace ccalloc::detail
