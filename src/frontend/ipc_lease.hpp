// The lease of an exported range of expandable memory (SPEC C3): a small
// shared memory file through which the exporting process learns whether any
// process still has the range mapped. Private to the front end.
//
// Layout (one 4 KiB page, host byte order; the file never leaves the host):
// a header {magic, revoked flag, slot count} and 255 slots {pid, process
// start time}. An importing process claims a free slot when it maps the
// range (compare-and-swap of the pid from 0 to its own, then its start
// time) and clears it when it unmaps the range. The exporter counts the
// claimed slots whose process is still alive; a slot whose process has
// ended (no /proc/<pid>, a zombie, or a new process with the same pid but
// another start time) is cleared by the exporter: that is how a process
// killed without unmapping gives its hold back.
//
// Revocation: when the owner frees the block, the exporter sets `revoked`
// and then counts holders; an importer claims a slot and then reads
// `revoked` (releasing the slot and failing when it is set). Both orders are
// sequentially consistent atomics, so either the exporter sees the claim
// (and keeps the pages) or the importer sees the revocation (and maps
// nothing): never neither.
//
// Thread safety: acquire/release/holders may run concurrently in any
// processes; one ipc_lease object is used under its owner's lock.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ccalloc::detail {

class ipc_lease {
 public:
  /// Slots per lease: processes that may hold one export at once.
  static constexpr std::size_t slot_count = 255;
  /// Size of the lease file in bytes.
  static constexpr std::size_t file_bytes = 4096;

  ipc_lease() = default;
  ipc_lease(ipc_lease&& other) noexcept;
  ipc_lease& operator=(ipc_lease&& other) noexcept;
  ipc_lease(const ipc_lease&) = delete;
  ipc_lease& operator=(const ipc_lease&) = delete;
  ~ipc_lease();

  /// Exporter: a new lease in a new memory file (memfd_create). The object
  /// owns the file's descriptor (fd()). Throws backend_error naming the call
  /// that failed.
  [[nodiscard]] static ipc_lease create();
  /// Importer: maps the lease file `fd` (which stays the caller's). Throws
  /// backend_error when `fd` is not a lease file.
  [[nodiscard]] static ipc_lease open(int fd);

  /// The owned descriptor (create), -1 for an opened lease.
  [[nodiscard]] int fd() const noexcept { return fd_; }
  [[nodiscard]] bool valid() const noexcept { return file_ != nullptr; }

  /// Importer: claims a slot for this process; returns its index. Throws
  /// backend_error when the owner has revoked the lease (freed the block)
  /// or every slot is taken.
  [[nodiscard]] std::size_t acquire();
  /// Importer: clears the slot from acquire. Never throws.
  void release(std::size_t slot) noexcept;

  /// Exporter: no process may acquire from now on.
  void revoke() noexcept;
  /// Exporter: the number of slots held by live processes; clears the slots
  /// of processes that have ended (reported in *dead when not null).
  [[nodiscard]] std::size_t holders(std::size_t* dead = nullptr) noexcept;

 private:
  struct file;
  file* file_ = nullptr;
  int fd_ = -1;
};

/// The start time of process `pid` in clock ticks since boot (field 22 of
/// /proc/<pid>/stat), or 0 when the process does not exist or has ended
/// (zombie or dead). Never throws.
[[nodiscard]] std::uint64_t process_start_ticks(std::uint32_t pid) noexcept;

}  // namespace ccalloc::detail
