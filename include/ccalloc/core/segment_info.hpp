// ccalloc/core/segment_info.hpp: what device_caching_allocator tells about
// its segments and blocks (segments(), expandable_segments(), segment_of()).
// Plain values. Included by device_caching_allocator.hpp.
#pragma once

#include <ccalloc/backend/device_backend.hpp>
#include <ccalloc/base/types.hpp>
#include <ccalloc/core/history.hpp>
#include <ccalloc/core/pools.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ccalloc {

/// The state of a block in a snapshot (PyTorch's names).
enum class block_state { active_allocated, active_pending_free, inactive };
/// "active_allocated", "active_pending_free" or "inactive".
[[nodiscard]] std::string_view to_string(block_state state) noexcept;

struct block_info {
  std::uintptr_t address = 0;
  std::size_t size_bytes = 0;
  std::size_t requested_bytes = 0;  ///< 0 when inactive
  block_state state = block_state::inactive;
  bool mapped = true;  ///< false: an unmapped range of an expandable segment (always inactive)
  context_ptr context;  ///< the recorder's context at malloc (history with record_context::state or more)
  std::string tag{"default"};  ///< its segment's tag (SPEC S1; core/tags.hpp)
};

/// A segment and its blocks. Invariants: blocks tile [address, address +
/// total_bytes) in address order (sizes sum to total_bytes); allocated_bytes
/// = sum of active_allocated sizes; active_bytes = allocated_bytes + sizes of
/// active_pending_free blocks; requested_bytes = sum over active blocks.
struct segment_info {
  int device = 0;
  std::uintptr_t address = 0;
  std::size_t total_bytes = 0;
  std::size_t allocated_bytes = 0;
  std::size_t active_bytes = 0;
  std::size_t requested_bytes = 0;
  stream_t stream = 0;
  bool is_small_pool = false;
  /// An expandable segment (SPEC B7): total_bytes is its address-space
  /// reservation, mapped_bytes the part backed by device memory.
  bool is_expandable = false;
  std::size_t mapped_bytes = 0;  ///< bytes backed by device memory (total_bytes for a plain segment)
  /// Deprecated: the same id as `pool`, as a pair; still filled in for code
  /// written before `pool` (no [[deprecated]]: GCC would then warn wherever a
  /// segment_info is constructed). Use `pool`.
  std::pair<std::uint64_t, std::uint64_t> pool_id{0, 0};
  context_ptr context;  ///< context of the malloc that created it, when history recorded one
  /// The private pool holding the segment ({0, 0}: the default pool). SPEC F20.
  mempool_id_t pool{};
  /// The tag of every block in it (SPEC S1: a segment holds one tag's
  /// blocks); paused: its pages are released (pause), mapped_bytes 0.
  std::string tag{"default"};
  bool paused = false;
  std::vector<block_info> blocks;  ///< in address order; sizes sum to total_bytes
};

/// One mapped run of a segment: its blocks [first_block, end_block), which
/// tile [address, address + size_bytes).
struct mapped_run {
  std::size_t first_block = 0;
  std::size_t end_block = 0;
  std::uintptr_t address = 0;
  std::size_t size_bytes = 0;
};

/// What of `seg` is mapped, as the mapping announcements (SPEC C1) describe
/// it: nothing for a paused segment (its pages are released; its blocks keep
/// mapped = true for resume), the whole of a plain segment, and each run of
/// mapped blocks of an expandable one. In address order. O(blocks).
[[nodiscard]] std::vector<mapped_run> mapped_runs(const segment_info& seg);

/// One expandable segment's sizes (SPEC F19).
struct expandable_segment_info {
  stream_t stream = 0;
  bool is_small_pool = false;
  std::uintptr_t address = 0;        ///< start of the reservation
  std::size_t reserved_address_bytes = 0;  ///< size of the address-space reservation
  std::size_t mapped_bytes = 0;      ///< bytes mapped to device memory now
};

/// The segment holding a live block, for sharing it with another process
/// (SPEC F25). Sizes in bytes.
struct block_segment {
  std::uintptr_t base = 0;       ///< segment base (reservation start when expandable)
  std::size_t size_bytes = 0;    ///< the allocation, or the whole reservation when expandable
  bool expandable = false;
  // Expandable segments only:
  std::size_t page_bytes = 0;                 ///< mapping unit
  std::size_t first_page = 0;                 ///< index of the first page the block touches
  std::vector<physical_handle_t> page_handles;  ///< the physical handles of the pages the block touches, in order
};

}  // namespace ccalloc
