// Rung 6 of the fallback ladder (B6): the out-of-memory error. Builds the
// message (what was asked, what the device and the cache hold, a hint),
// records the OOM in the history, calls the OOM observers outside the locks
// (F17) and throws out_of_memory_error.
#include <ccalloc/core/device_caching_allocator.hpp>

#include "detail/device_state.hpp"
#include "detail/format.hpp"

#include <algorithm>
#include <cstddef>
#include <string>
#include <utility>

namespace ccalloc::detail {

void device_state::throw_out_of_memory(const alloc_params& p, world_lock& w) {
  const memory_info info = backend_.mem_get_info(device_);
  ++stats_.num_ooms;
  const auto allocated = static_cast<std::size_t>(stats_.allocated_bytes[0].current);
  const std::size_t reserved = reserved_bytes_;
  std::size_t largest_free = 0;
  for (stream_state* ss : w.streams())
    for (block_pool* pool : {&ss->pools.small, &ss->pools.large})
      if (!pool->blocks.empty()) largest_free = std::max(largest_free, pool->blocks.largest()->size);

  std::string msg = "ccalloc: out of memory on device " + std::to_string(device_) + ". Tried to allocate " +
                    format_bytes(p.requested_bytes) + " (" + std::to_string(p.requested_bytes) +
                    " bytes; needed a new segment of " + format_bytes(p.alloc_size) + "). Device " +
                    std::to_string(device_) + " has a total capacity of " + format_bytes(info.total_bytes) +
                    " of which " + format_bytes(info.free_bytes) + " is free.";
  if (set_fraction_)
    msg += " The per-process memory fraction " + format_fraction(fraction_) + " allows " +
           format_bytes(allowed_bytes_) + ".";
  msg += " Of the memory held by ccalloc, " + format_bytes(allocated) + " is allocated and " +
         format_bytes(reserved - std::min(reserved, allocated)) +
         " is reserved but unallocated; the largest cached free block is " + format_bytes(largest_free) + ".";
  const std::size_t limit = set_fraction_ ? allowed_bytes_ : info.total_bytes;
  if (p.alloc_size > limit)
    msg += " The request alone is larger than the " +
           std::string(set_fraction_ ? "memory the fraction allows" : "device's memory") + ".";
  else if (reserved > allocated && reserved - allocated > reserved / 10)
    msg += " Reserved but unallocated memory is large (fragmentation): try CCALLOC_CONF="
           "max_split_size_mb:<MiB> so that large cached blocks are not split for small requests, or "
           "garbage_collection_threshold to return old cached blocks sooner.";
  else
    msg += " Reduce the memory the program holds at its peak (batch size, sequence length), or raise the "
           "memory fraction.";

  out_of_memory_error::figures f;
  f.device = device_;
  f.requested_bytes = p.requested_bytes;
  f.device_total_bytes = set_fraction_ ? allowed_bytes_ : info.total_bytes;
  f.device_free_bytes = info.free_bytes;
  f.allocated_bytes = allocated;
  f.reserved_bytes = reserved;
  if (history_.active()) [[unlikely]]
    history_.record_oom(info.free_bytes, p.requested_bytes, p.stream);
  // Observers run outside the locks (SPEC F17): they may call back into ccalloc.
  auto observers = observers_;
  w.unlock();
  // Every observer runs, and the caller still gets the out-of-memory error:
  // an exception from an observer is dropped (observers are notifications).
  for (auto& o : observers) {
    try {
      o(device_, p.requested_bytes, f.device_total_bytes, f.device_free_bytes);
    } catch (...) {
    }
  }
  throw out_of_memory_error(std::move(msg), f);
}

}  // namespace ccalloc::detail
