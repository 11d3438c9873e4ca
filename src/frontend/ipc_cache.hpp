// The per-process cache of opened IPC handles (SPEC F25). Private to the
// front end: caching_allocator owns one; src/frontend/ipc.cpp uses it.
//
// Invariants: every entry's mapping is live in the backend; refs >= 1;
// entries' address ranges [base, base + bytes) are disjoint; by_device[d] =
// number of expandable entries of device d.
#pragma once

#include <ccalloc/backend/device_backend.hpp>
#include <ccalloc/frontend/ipc_handle.hpp>

#include "ipc_lease.hpp"

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace ccalloc::detail {

struct ipc_cache {
  struct entry {
    ipc_kind kind = ipc_kind::plain;
    int device = 0;            // the handle's device (the memory's owner)
    int open_device = 0;       // plain: the device the segment was opened for (ipc_close_segment's)
    std::vector<int> accessors;  // expandable: devices other than `device` granted access, in grant order
    std::uintptr_t base = 0;   // plain: ipc_open_segment's result; expandable: the reservation
    std::size_t bytes = 0;     // plain: segment size; expandable: reservation size
    std::size_t page_bytes = 0;
    std::vector<physical_handle_t> imported;  // expandable: one per page, mapped in order
    std::uint64_t refs = 0;
    // The pointers open_ipc_handle returned for it -> opens not yet closed
    // (their sum is refs): close_ipc_handle takes only these.
    std::map<std::uintptr_t, std::uint64_t> opened;
    ipc_lease lease;            // expandable, version >= 2: the producer's lease, mapped here
    std::size_t lease_slot = 0;  // the slot this process holds in it while the entry is open
  };

  explicit ipc_cache(device_backend& b) : backend(b) {}
  ~ipc_cache();
  ipc_cache(const ipc_cache&) = delete;
  ipc_cache& operator=(const ipc_cache&) = delete;

  /// Gives `device` read/write access to every imported page of the
  /// expandable mapping `e` (cuMemSetAccess). Throws backend_error.
  void grant_pages(const entry& e, int device);
  /// Unmaps and releases what `e` holds, then gives its lease slot back
  /// (errors are dropped when `quiet`; the slot is kept when a step throws).
  void close(entry& e, bool quiet);
  /// True when `device` has an open expandable mapping (mutex held).
  [[nodiscard]] bool has_expandable(int device) const;

  device_backend& backend;
  mutable std::mutex mutex;
  std::map<std::string, entry> entries;  // key: what identifies the mapped memory (see ipc.cpp)
};

}  // namespace ccalloc::detail
