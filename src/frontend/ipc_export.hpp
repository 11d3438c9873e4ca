// The exporter's registry of shared expandable blocks (SPEC C3). Private to
// the front end: caching_allocator owns one; src/frontend/ipc_export.cpp
// implements it and the caching_allocator functions that use it.
//
// One entry per exported block, from its first share_ipc_handle until the
// block is really freed: the handle's bytes (so that every share of the
// block returns the same bytes), the page descriptors and the lease
// (ipc_lease.hpp) whose descriptors every share hands out again (as
// duplicates), and whether the owner has freed the block while importers
// held it (then the block stays allocated in the device allocator, so that
// its pages are neither recycled, unmapped nor released, until the lease
// says no live process holds it).
//
// Invariants: `count` == entries.size(); an entry's block is allocated in
// its device's allocator; owner_freed entries are no longer in the pointer
// map (free() of them throws "not live").
#pragma once

#include "ipc_lease.hpp"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace ccalloc::detail {

struct block;

struct ipc_exports {
  struct entry {
    int device = 0;
    block* blk = nullptr;
    std::size_t size_bytes = 0;
    std::string handle;    // the encoded handle, the same for every share
    std::vector<int> fds;  // owned: one per page, then the lease's (a duplicate of lease.fd())
    ipc_lease lease;
    bool owner_freed = false;
  };

  ipc_exports() = default;
  ipc_exports(const ipc_exports&) = delete;
  ipc_exports& operator=(const ipc_exports&) = delete;
  ~ipc_exports();

  /// Closes what `e` owns (its descriptors; the lease closes itself).
  static void close_fds(entry& e) noexcept;

  mutable std::mutex mutex;
  std::map<std::uintptr_t, entry> entries;  // key: the block's pointer
  std::atomic<std::size_t>* count = nullptr;  // the owner's counter, read by free() without the mutex
};

}  // namespace ccalloc::detail

namespace ccalloc {
class device_backend;
struct block_segment;
struct ipc_export;
struct ipc_handle;
}  // namespace ccalloc

namespace ccalloc::detail {

/// share_ipc_handle of an expandable block `blk` at `ptr` of `device`
/// (`h`: the handle's header fields filled in; `seg`: the block's
/// segment): the entry's handle and duplicates of its descriptors, the
/// entry created on the first share. Throws backend_error; nothing is
/// registered or left open then.
[[nodiscard]] ipc_export share_expandable(ipc_exports& exports, device_backend& backend, int device, block* blk,
                                          void* ptr, ipc_handle h, const block_segment& seg);

}  // namespace ccalloc::detail
