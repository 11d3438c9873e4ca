// ccalloc/core/allocation.hpp: what device_caching_allocator::malloc
// returns. Included by device_caching_allocator.hpp.
#pragma once

namespace ccalloc {

namespace detail {
struct block;
}  // namespace detail

/// What malloc returns: the pointer and the block that owns it (needed to free).
struct allocation {
  void* ptr = nullptr;
  detail::block* block = nullptr;
};

}  // namespace ccalloc
