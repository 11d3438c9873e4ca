// ccalloc/frontend/ipc_handle.hpp: the IPC handle format (SPEC F25) and its
// parser. Pure C++: no device, no CUDA, no system call.
//
// What it is: the bytes caching_allocator::share_ipc_handle returns and
// open_ipc_handle reads in another process. A handle names one block of a
// producer's segment: the segment (how another process maps it) and where
// the block lies inside it. Two kinds, as PyTorch's shareIpcHandle:
//  - plain: a segment from one device malloc; the payload is the 64-byte
//    cudaIpcMemHandle_t of the segment (cudaIpcGetMemHandle);
//  - expandable: pages of an expandable segment (SPEC B7); the payload is the
//    page size and, per page covering the block, the index of its file
//    descriptor among the descriptors sent with the handle, plus an offset
//    in that file (0 on CUDA, where each page has its own descriptor from
//    cuMemExportToShareableHandle; the page's range of the device memory file
//    on the simulated device). File descriptors cannot travel inside bytes:
//    the caller sends them beside the handle (a Unix socket with SCM_RIGHTS,
//    or pidfd_getfd).
//
// Encoding, versions 1 to 3 (all integers little-endian, no padding; 64 + 64
// bytes for plain, 64 + 24 + 12 per page (+ 8 in version 2) for expandable):
//
//   offset size  field
//   0      8     magic "ccIPChdl"
//   8      2     format version (1, 2 or 3; this ccalloc writes 3)
//   10     1     kind: 1 plain, 2 expandable
//   11     1     reserved, 0
//   12     4     device (int32, >= 0)
//   16     4     producer process id (uint32, 1..2^22; the cache key, pidfd_getfd)
//   20     4     version 3: CRC-32 (IEEE, as zlib's crc32) of the whole handle with
//                these 4 bytes read as 0; versions 1 and 2: reserved, 0
//   24     8     segment id: the producer's segment base address
//   32     8     segment size in bytes (plain: the allocation; expandable: the reservation)
//   40     8     offset of the block's pointer from the segment base, bytes (a multiple of 512)
//   48     8     size of the block in bytes (> 0; offset + size <= segment size)
//   56     8     payload size in bytes (what follows)
//   64     ...   payload
//     plain:      64 bytes cudaIpcMemHandle_t
//     expandable: 8 page size (power of two), 8 index of the first page in the
//                 segment, 4 page count n (>= 1), 4 reserved 0, then n x
//                 {4 fd index (= the page's position i), 8 offset in that file (a multiple
//                 of the page size)}.
//                 The pages must cover [offset, offset + size) exactly:
//                 first page = offset / page size, last = (offset + size - 1) / page size.
//                 Version 2 adds, after the pages: 4 index of the lease descriptor
//                 (= page count), 4 reserved 0. The lease is a small shared memory
//                 file of the producer in which each importing process holds a slot
//                 while it has the range mapped (docs/design.md, "IPC of expandable
//                 memory"); a version 1 expandable handle has none.
//
// What the parser checks, field by field (a handle that breaks a rule is
// refused with a message naming the field): magic, version (1..3), kind
// (1, 2), every reserved byte 0, (version 3) the checksum, checked before the
// fields are believed, so that a handle changed anywhere after export (one
// corrupted byte, a truncated copy) is refused rather than opened at a wrong
// offset; then device >= 0, producer pid in [1, 2^22]
// (Linux's PID_MAX_LIMIT), segment id != 0 and segment id + segment size
// inside a 57-bit address space, block size > 0, offset a multiple of 512
// and offset + size <= segment size, the payload size matching the kind and the bytes present; for
// expandable handles also: page size a power of two, segment id and segment
// size multiples of it, the first page and the page count exactly those
// covering [offset, offset + size), page i's fd index = i, file offsets
// multiples of the page size, and (version 2) the lease fd index = the page
// count. open_ipc_handle checks the number of descriptors received against
// fd_count() and the backend checks each descriptor (the simulated device:
// a memory file the page's range lies inside).
// Not checkable without the producer, so taken as given in a handle whose
// checksum matches (one built by hand, or a version 1 or 2 handle): which process the
// pid names (pidfd_open fails for one that does not exist), the segment id's
// and the segment size's other bits (the segment id is the producer's
// address, used here only as part of the cache key; the segment size is
// informational beyond the rules above), the device index (the opening
// allocator refuses one it does not have), the block offset and size inside
// the pages the rules fix, the file offsets inside their files, and the
// 64 bytes of a plain handle's cudaIpcMemHandle_t (CUDA checks them).
//
// Compatibility: a reader accepts versions <= its own; a newer version is
// rejected with a message that says to upgrade the reader. New fields go into
// a new version.
//
// Thread safety: the functions are pure; call them from any thread.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace ccalloc {

/// Kind of segment a handle points into.
enum class ipc_kind : std::uint8_t {
  plain = 1,       ///< a segment from one device malloc (cudaIpcMemHandle_t)
  expandable = 2,  ///< pages of an expandable segment (POSIX file descriptors)
};

/// The format version this ccalloc writes and the newest it reads.
inline constexpr std::uint16_t ipc_handle_version = 3;
/// Size in bytes of a cudaIpcMemHandle_t (CUDA_IPC_HANDLE_SIZE).
inline constexpr std::size_t ipc_mem_handle_bytes = 64;

/// One page of an expandable handle.
struct ipc_page {
  std::uint32_t fd_index = 0;     ///< index into the file descriptors sent with the handle
  std::uint64_t file_offset = 0;  ///< bytes into that file where the page starts
  friend bool operator==(const ipc_page&, const ipc_page&) = default;
};

/// A decoded handle (fields as in the encoding table above; sizes in bytes).
struct ipc_handle {
  std::uint16_t version = ipc_handle_version;
  ipc_kind kind = ipc_kind::plain;
  int device = 0;
  std::uint32_t producer_pid = 0;
  std::uint64_t segment_id = 0;      ///< the producer's segment base address
  std::uint64_t segment_bytes = 0;
  std::uint64_t offset_bytes = 0;    ///< block pointer - segment base
  std::uint64_t size_bytes = 0;      ///< block size
  // plain
  std::array<std::uint8_t, ipc_mem_handle_bytes> mem_handle{};  ///< cudaIpcMemHandle_t bytes
  // expandable
  std::uint64_t page_bytes = 0;
  std::uint64_t first_page = 0;      ///< index of pages[0] in the segment
  std::vector<ipc_page> pages;       ///< the pages covering the block, in order
  /// Version >= 2, expandable: index of the lease file's descriptor among
  /// those sent with the handle (= pages.size()).
  std::uint32_t lease_fd_index = 0;

  /// True for an expandable handle of version >= 2 (it carries a lease).
  [[nodiscard]] bool has_lease() const noexcept { return kind == ipc_kind::expandable && version >= 2; }
  /// Number of file descriptors the handle needs: max fd_index (and
  /// lease_fd_index) + 1 (0 for plain).
  [[nodiscard]] std::size_t fd_count() const noexcept;
  friend bool operator==(const ipc_handle&, const ipc_handle&) = default;
};

/// The version 3 checksum of the handle bytes `bytes`: CRC-32 (IEEE
/// polynomial, as zlib's crc32) of all of them with bytes 20..23 (where the
/// checksum is stored, little-endian) read as 0. encode_ipc_handle stores it;
/// parse_ipc_handle recomputes and compares it. Pure; any thread.
[[nodiscard]] std::uint32_t ipc_handle_checksum(std::string_view bytes);

/// Encodes `handle` in the layout of handle.version (1, 2 or 3; 3 stores the
/// checksum). Throws
/// invalid_argument_error when the handle breaks a rule of the format (the
/// same rules parse_ipc_handle checks), so that every encoded handle parses.
[[nodiscard]] std::string encode_ipc_handle(const ipc_handle& handle);

/// Decodes bytes from encode_ipc_handle. Throws invalid_argument_error whose
/// message starts with "ipc handle: " and names what is wrong: too short
/// ("truncated: 12 bytes, the header needs 64"), bad magic, a version newer
/// than this reader ("ipc handle version 9 is newer than this ccalloc (1);
/// upgrade the reader"), version 0, a version 3 checksum that does not match
/// ("checksum 0x... does not match the handle's bytes (0x...): the handle was
/// changed after export ..."), a block offset not a multiple of 512, unknown kind, nonzero reserved fields, a
/// negative device, a block outside its segment, a payload size that does
/// not match the kind or the bytes present, a page size that is not a power
/// of two, pages that do not cover the block, an fd index that is not the
/// page's position, a lease fd index that is not the page count, a producer
/// pid or segment outside the ranges above. Never reads past `bytes`.
[[nodiscard]] ipc_handle parse_ipc_handle(std::string_view bytes);

}  // namespace ccalloc
