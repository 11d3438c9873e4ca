// ccalloc/frontend/nccl_registration.hpp: keeps NCCL communicators'
// user-buffer registrations (ncclCommRegister / ncclCommDeregister) in step
// with what a caching_allocator has mapped (SPEC C2), for C++ runtimes
// without PyTorch.
//
// When to use: a runtime that hands ccalloc's memory to NCCL collectives and
// wants NCCL's zero-copy paths (registered buffers) while ccalloc maps,
// unmaps and moves pages (expandable segments).
//
// How: a mapping listener (ccalloc/core/mapping_events.hpp) of the
// allocator. A range that is mapped becomes *pending*; pending ranges that
// touch merge, so a burst of page maps costs one register call, not one per
// page. ensure(ptr, size) — call it before handing a buffer to NCCL —
// registers what the buffer needs with every communicator of its device, as
// one registration that covers the whole buffer (merging the registrations
// it spans). An unmap deregisters every registration that overlaps the
// range before the allocator unmaps it (synchronously, in the listener);
// the parts of those registrations that stay mapped become pending again.
// So no communicator ever holds a registration of memory that is unmapped,
// and a buffer passed after ensure() is registered for its whole length.
//
// Guarantees and cost: register calls happen in ensure() and
// add_communicator() only (never under the allocator's locks); deregister
// calls in the listener (under them: NCCL's deregistration must not call
// back into ccalloc, which it does not). Thread-safe: one mutex, taken by
// the listener, ensure() and the communicator functions.
//
// Lifetime: the registrar must outlive the allocator's use of it: the
// listener cannot be detached, so it stays attached to a registrar that is
// gone unless the allocator is destroyed first. ~nccl_registration
// deregisters everything it registered and stops reacting to announcements.
//
// Errors: an NCCL call that returns non-zero throws nccl_error from
// ensure() / add_communicator() (state unchanged for the failing range); a
// failing deregister in the listener is counted (failed_deregistrations)
// and the registration forgotten.
#pragma once

#include <ccalloc/core/mapping_events.hpp>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace ccalloc {

class caching_allocator;

/// An NCCL call failed (its return code in the message).
class nccl_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The two NCCL functions used, with NCCL's signatures (ncclComm_t is a
/// pointer, ncclResult_t an int-sized enum, 0 = ncclSuccess).
struct nccl_functions {
  int (*comm_register)(void* comm, void* buff, std::size_t size, void** handle) = nullptr;
  int (*comm_deregister)(void* comm, void* handle) = nullptr;

  /// dlopen()s `library` (default "libnccl.so.2") and looks both functions
  /// up. The library stays loaded for the life of the process. Throws
  /// nccl_error naming the library or the missing symbol.
  [[nodiscard]] static nccl_functions load(const std::string& library = "libnccl.so.2");
};

/// Counters (for tests and docs/perf.md).
struct nccl_registration_stats {
  std::uint64_t register_calls = 0;
  std::uint64_t deregister_calls = 0;
  std::uint64_t failed_deregistrations = 0;
  std::uint64_t ensure_calls = 0;
  std::uint64_t registered_bytes = 0;  ///< now, summed over communicators
};

class nccl_registration {
 public:
  /// Attaches a mapping listener to `alloc` (every device) and records what
  /// is mapped, under the same hold of each device's locks
  /// (caching_allocator::attach_mapping_listener with a list), so a map or
  /// unmap by another thread meanwhile is in the record or announced after
  /// it, never missed: each plain segment whole, each expandable segment's
  /// mapped pages merged into runs, paused tags' segments not at all (their
  /// pages come back with resume's announcements; mapped_runs). Safe while
  /// other threads allocate. Throws invalid_argument_error when a function
  /// of `nccl` is null.
  nccl_registration(caching_allocator& alloc, nccl_functions nccl);
  ~nccl_registration();
  nccl_registration(const nccl_registration&) = delete;
  nccl_registration& operator=(const nccl_registration&) = delete;

  /// Keeps `comm` (an ncclComm_t of `device`) registered from now on: what is
  /// mapped on `device` now (the allocator's segments) becomes pending, and
  /// is registered at the next ensure(). Adding the same comm twice, or a
  /// device that is not one of the backend's ("device D is out of range"), is
  /// an invalid_argument_error; nothing is kept then.
  void add_communicator(void* comm, int device);
  /// Deregisters everything `comm` holds and forgets it. Unknown comm: no-op.
  void remove_communicator(void* comm);

  /// Before a collective on [ptr, ptr + size_bytes) of `device`: registers it
  /// with every communicator of the device, as one registration that covers
  /// it. The range must be mapped (memory the allocator handed out; not a
  /// paused tag's) and `device` one of the backend's; otherwise
  /// invalid_argument_error ("device D is out of range", "size_bytes N runs
  /// past the end of the address space from ptr", "N bytes on device D are
  /// not mapped by the allocator"), nothing registered. size 0: nothing (a
  /// bad device still throws). Throws nccl_error.
  void ensure(int device, const void* ptr, std::size_t size_bytes);
  /// Registers every pending range now (e.g. after a step's allocations).
  void flush();

  [[nodiscard]] nccl_registration_stats stats() const;

 private:
  struct state;
  std::shared_ptr<state> state_;
};

}  // namespace ccalloc
