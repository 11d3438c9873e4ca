// ccalloc/core/pools.hpp: private memory pools' value types (SPEC F20-F22):
// the pool id, a pool's own segment source, the stream filter of
// begin_allocate_to_pool, and a pool's usage. Included by
// device_caching_allocator.hpp, whose pool API uses them.
#pragma once

#include <ccalloc/base/types.hpp>

#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace ccalloc {

/// Identifies a private memory pool of a device (PyTorch's MempoolId_t, a
/// pair of integers: CUDA graphs use {0, n}, user pools {n, 0}). {0, 0} is the
/// default pool and never names a private pool. SPEC F20.
struct mempool_id_t {
  std::uint64_t first = 0;
  std::uint64_t second = 0;
  friend bool operator==(const mempool_id_t&, const mempool_id_t&) = default;
  friend auto operator<=>(const mempool_id_t&, const mempool_id_t&) = default;
};
/// "(first, second)", for messages.
[[nodiscard]] std::string to_string(const mempool_id_t& id);

/// A private pool's own source of segments (SPEC F20; PyTorch: a MemPool's
/// CUDAPluggableAllocator): `malloc(size_bytes)` returns device memory of at
/// least that many bytes, aligned to 512 bytes, usable on every stream, or
/// nullptr when out of memory (it may throw; the error reaches the caller of
/// malloc); `free(ptr)` returns it and may synchronize. Both are called with
/// the device's locks held: they must not call into this allocator. Segments
/// of such a pool are always plain (never expandable), and their bytes count
/// as reserved memory like any other segment. Empty functions: the backend's
/// segment_malloc / segment_free.
struct segment_allocator {
  std::function<void*(std::size_t size_bytes)> malloc;
  std::function<void(void* ptr)> free;
};

/// Chooses the streams whose allocations go to a private pool during
/// begin_allocate_to_pool .. end_allocate_to_pool. Called on the allocating
/// thread with a device lock held: it must be fast, must not throw, and
/// must not call into the allocator.
using stream_filter = std::function<bool(stream_t)>;

/// Bytes a private pool holds (per-pool statistics).
struct pool_usage {
  std::size_t segment_count = 0;
  std::size_t reserved_bytes = 0;   ///< plain segment sizes + mapped bytes of expandable ones
  std::size_t allocated_bytes = 0;  ///< sizes of allocated blocks
  std::size_t active_bytes = 0;     ///< allocated + blocks waiting on events or deferred frees
  std::size_t allocation_count = 0; ///< allocated blocks
  int use_count = 0;                ///< create_or_incref_pool minus release_pool
};

}  // namespace ccalloc
