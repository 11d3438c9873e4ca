// ccalloc/core/checkpoint.hpp: a private pool's checkpoint (SPEC F24;
// device_caching_allocator::get_checkpoint_state and
// set_checkpoint_pool_state). Plain values. Included by
// device_caching_allocator.hpp.
#pragma once

#include <ccalloc/base/types.hpp>
#include <ccalloc/core/allocation.hpp>
#include <ccalloc/core/pools.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ccalloc {

/// One block of a checkpoint (SPEC F24).
struct checkpoint_block {
  std::uintptr_t address = 0;
  std::size_t size_bytes = 0;
  std::size_t requested_bytes = 0;  ///< 0 when free
  bool allocated = false;           ///< held by the caller when taken (a block waiting on events is free)
  bool mapped = true;               ///< false: an unmapped range of an expandable segment
};
/// One segment of a checkpoint: where it is and how it was split.
struct checkpoint_segment {
  std::uintptr_t address = 0;
  std::size_t total_bytes = 0;
  stream_t stream = 0;
  bool is_small_pool = false;
  bool is_expandable = false;
  std::vector<checkpoint_block> blocks;  ///< in address order; sizes sum to total_bytes
};
/// A private pool's layout at one moment (get_checkpoint_state). A plain
/// value: it may be inspected, copied and kept; it owns nothing. SPEC F24
/// (PyTorch: PrivatePoolState).
struct pool_checkpoint {
  int device = -1;
  mempool_id_t pool{};
  std::vector<checkpoint_segment> segments;  ///< by address
};
/// What set_checkpoint_pool_state changed (PyTorch: CheckpointDelta).
struct checkpoint_restore_result {
  /// Blocks allocated in the checkpoint and free before the restore, now
  /// allocated again: the caller owns them (free each once).
  std::vector<allocation> blocks_created;
  /// Blocks allocated before the restore and free in the checkpoint (or
  /// split differently): the restore freed them; the caller must not free
  /// them again.
  std::vector<void*> freed_pointers;
};

}  // namespace ccalloc
