// The IPC handle format: encoder and parser. See
// include/ccalloc/frontend/ipc_handle.hpp for the layout.
#include <ccalloc/base/errors.hpp>
#include <ccalloc/frontend/ipc_handle.hpp>

#include <algorithm>
#include <cstring>

namespace ccalloc {

namespace {

constexpr std::string_view magic = "ccIPChdl";
constexpr std::size_t header_bytes = 64;
constexpr std::size_t expandable_fixed_bytes = 24;
constexpr std::size_t page_entry_bytes = 12;
constexpr std::size_t lease_entry_bytes = 8;  // version 2, expandable
// A bound on the page count that keeps sizes far from overflow (2^32 pages
// of 2 MiB are 8 PiB).
constexpr std::uint64_t max_pages = std::uint64_t{1} << 32;
// Where version 3 keeps the checksum of the handle (bytes 20..23, reserved
// and 0 in versions 1 and 2).
constexpr std::size_t checksum_at = 20;
constexpr std::uint16_t first_checksummed_version = 3;
// Blocks start at multiples of 512 bytes from their segment's base (sizes
// round up to 512 bytes, SPEC B1).
constexpr std::uint64_t block_alignment = 512;

std::string hex32(std::uint32_t v) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string out = "0x";
  for (int shift = 28; shift >= 0; shift -= 4) out.push_back(digits[(v >> shift) & 0xfU]);
  return out;
}

[[noreturn]] void fail(const std::string& what) { throw invalid_argument_error("ipc handle: " + what); }

class writer {
 public:
  template <class T>
  void put(T value) {
    for (std::size_t i = 0; i < sizeof(T); ++i) out_.push_back(static_cast<char>((static_cast<std::uint64_t>(value) >> (8 * i)) & 0xff));
  }
  void bytes(const void* p, std::size_t n) { out_.append(static_cast<const char*>(p), n); }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

class reader {
 public:
  explicit reader(std::string_view in) : in_(in) {}
  template <class T>
  T get() {
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < sizeof(T); ++i)
      v |= static_cast<std::uint64_t>(static_cast<unsigned char>(in_[at_ + i])) << (8 * i);
    at_ += sizeof(T);
    return static_cast<T>(v);
  }
  void bytes(void* p, std::size_t n) {
    std::memcpy(p, in_.data() + at_, n);
    at_ += n;
  }

 private:
  std::string_view in_;
  std::size_t at_ = 0;
};

// The largest process id Linux hands out (PID_MAX_LIMIT on 64-bit systems).
constexpr std::uint32_t max_pid = std::uint32_t{1} << 22;
// Device addresses lie in a process's address space: 57 bits at most (x86-64
// with 5-level paging; 48 otherwise).
constexpr std::uint64_t address_limit = std::uint64_t{1} << 57;

// The rules shared by the encoder and the parser.
void validate(const ipc_handle& h) {
  if (h.version == 0 || h.version > ipc_handle_version)
    fail("version " + std::to_string(h.version) + " is not in [1, " + std::to_string(ipc_handle_version) + "]");
  if (h.device < 0) fail("device " + std::to_string(h.device) + " is negative");
  if (h.producer_pid == 0 || h.producer_pid > max_pid)
    fail("producer pid " + std::to_string(h.producer_pid) + " is not in [1, " + std::to_string(max_pid) + "]");
  if (h.segment_id == 0 || h.segment_id >= address_limit || h.segment_bytes > address_limit - h.segment_id)
    fail("segment id " + std::to_string(h.segment_id) + " (the segment's base address) with segment size " +
         std::to_string(h.segment_bytes) + " is not inside a 57-bit address space");
  if (h.size_bytes == 0) fail("block size is 0");
  if (h.offset_bytes > h.segment_bytes || h.size_bytes > h.segment_bytes - h.offset_bytes)
    fail("block [offset " + std::to_string(h.offset_bytes) + ", +" + std::to_string(h.size_bytes) +
         " bytes) passes the end of its segment (" + std::to_string(h.segment_bytes) + " bytes)");
  if (h.offset_bytes % block_alignment != 0)
    fail("block offset " + std::to_string(h.offset_bytes) +
         " is not a multiple of 512 (blocks start 512-byte aligned in their segment)");
  if (h.kind == ipc_kind::plain) {
    if (!h.pages.empty() || h.page_bytes != 0 || h.first_page != 0 || h.lease_fd_index != 0)
      fail("a plain handle has pages");
    return;
  }
  if (h.kind != ipc_kind::expandable)
    fail("unknown kind " + std::to_string(static_cast<unsigned>(h.kind)) + " (accepted: 1 plain, 2 expandable)");
  const std::uint64_t p = h.page_bytes;
  if (p == 0 || (p & (p - 1)) != 0) fail("page size " + std::to_string(p) + " is not a power of two");
  if (h.segment_bytes % p != 0)
    fail("segment size " + std::to_string(h.segment_bytes) + " is not a multiple of the page size " +
         std::to_string(p));
  if (h.segment_id % p != 0)
    fail("segment id " + std::to_string(h.segment_id) + " (the segment's base address) is not a multiple of the page size " +
         std::to_string(p));
  const std::uint64_t first = h.offset_bytes / p;
  const std::uint64_t last = (h.offset_bytes + h.size_bytes - 1) / p;
  if (h.first_page != first || h.pages.size() != last - first + 1)
    fail("pages [" + std::to_string(h.first_page) + ", +" + std::to_string(h.pages.size()) +
         ") do not cover the block exactly (it needs pages [" + std::to_string(first) + ", +" +
         std::to_string(last - first + 1) + ") of " + std::to_string(p) + " bytes)");
  for (std::size_t i = 0; i < h.pages.size(); ++i) {
    // Each page has a descriptor of its own, sent in page order.
    if (h.pages[i].fd_index != i)
      fail("page " + std::to_string(i) + ": fd index " + std::to_string(h.pages[i].fd_index) + " is not " +
           std::to_string(i) + " (page i's descriptor is the i-th sent)");
    if (h.pages[i].file_offset % p != 0)
      fail("page " + std::to_string(i) + ": file offset " + std::to_string(h.pages[i].file_offset) +
           " is not a multiple of the page size");
  }
  if (!h.has_lease() && h.lease_fd_index != 0) fail("a version 1 handle has no lease");
  if (h.has_lease() && h.lease_fd_index != h.pages.size())
    fail("lease fd index " + std::to_string(h.lease_fd_index) + " is not the page count " +
         std::to_string(h.pages.size()) + " (the lease's descriptor follows the pages')");
}

}  // namespace

// CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320) of `bytes` with the
// checksum field read as 0. It detects every error burst of up to 32 bits,
// so every corrupted byte; handles are ~128 bytes, so the bitwise form costs
// nothing next to the system calls of an open.
std::uint32_t ipc_handle_checksum(std::string_view bytes) {
  std::uint32_t crc = 0xffffffffU;
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    const bool in_field = i >= checksum_at && i < checksum_at + 4;
    crc ^= in_field ? 0U : static_cast<unsigned char>(bytes[i]);
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ (0xedb88320U & (0U - (crc & 1U)));
  }
  return ~crc;
}

std::size_t ipc_handle::fd_count() const noexcept {
  std::size_t n = 0;
  for (const ipc_page& p : pages) n = std::max<std::size_t>(n, std::size_t{p.fd_index} + 1);
  if (has_lease()) n = std::max<std::size_t>(n, std::size_t{lease_fd_index} + 1);
  return n;
}

std::string encode_ipc_handle(const ipc_handle& h) {
  validate(h);
  writer w;
  w.bytes(magic.data(), magic.size());
  w.put<std::uint16_t>(h.version);
  w.put<std::uint8_t>(static_cast<std::uint8_t>(h.kind));
  w.put<std::uint8_t>(0);
  w.put<std::uint32_t>(static_cast<std::uint32_t>(h.device));
  w.put<std::uint32_t>(h.producer_pid);
  w.put<std::uint32_t>(0);
  w.put<std::uint64_t>(h.segment_id);
  w.put<std::uint64_t>(h.segment_bytes);
  w.put<std::uint64_t>(h.offset_bytes);
  w.put<std::uint64_t>(h.size_bytes);
  if (h.kind == ipc_kind::plain) {
    w.put<std::uint64_t>(ipc_mem_handle_bytes);
    w.bytes(h.mem_handle.data(), h.mem_handle.size());
  } else {
    w.put<std::uint64_t>(expandable_fixed_bytes + page_entry_bytes * h.pages.size() +
                         (h.has_lease() ? lease_entry_bytes : 0));
    w.put<std::uint64_t>(h.page_bytes);
    w.put<std::uint64_t>(h.first_page);
    w.put<std::uint32_t>(static_cast<std::uint32_t>(h.pages.size()));
    w.put<std::uint32_t>(0);
    for (const ipc_page& p : h.pages) {
      w.put<std::uint32_t>(p.fd_index);
      w.put<std::uint64_t>(p.file_offset);
    }
    if (h.has_lease()) {
      w.put<std::uint32_t>(h.lease_fd_index);
      w.put<std::uint32_t>(0);
    }
  }
  std::string out = w.take();
  if (h.version >= first_checksummed_version) {
    const std::uint32_t sum = ipc_handle_checksum(out);
    for (std::size_t i = 0; i < 4; ++i) out[checksum_at + i] = static_cast<char>((sum >> (8 * i)) & 0xffU);
  }
  return out;
}

ipc_handle parse_ipc_handle(std::string_view bytes) {
  if (bytes.size() < magic.size() + 2) {
    if (bytes.size() >= magic.size() && bytes.substr(0, magic.size()) != magic) fail("bad magic (not a ccalloc IPC handle)");
    fail("truncated: " + std::to_string(bytes.size()) + " bytes, the header needs " + std::to_string(header_bytes));
  }
  if (bytes.substr(0, magic.size()) != magic) fail("bad magic (not a ccalloc IPC handle)");
  reader r(bytes.substr(magic.size()));
  ipc_handle h;
  h.version = r.get<std::uint16_t>();
  // The version decides the layout: check it before the length.
  if (h.version > ipc_handle_version)
    fail("ipc handle version " + std::to_string(h.version) + " is newer than this ccalloc (" +
         std::to_string(ipc_handle_version) + "); upgrade the reader");
  if (h.version == 0) fail("version 0 is not a valid format version");
  if (bytes.size() < header_bytes)
    fail("truncated: " + std::to_string(bytes.size()) + " bytes, the header needs " + std::to_string(header_bytes));
  const auto kind = r.get<std::uint8_t>();
  if (kind != static_cast<std::uint8_t>(ipc_kind::plain) && kind != static_cast<std::uint8_t>(ipc_kind::expandable))
    fail("unknown kind " + std::to_string(kind) + " (accepted: 1 plain, 2 expandable)");
  h.kind = static_cast<ipc_kind>(kind);
  if (r.get<std::uint8_t>() != 0) fail("reserved byte 11 is not 0");
  h.device = static_cast<std::int32_t>(r.get<std::uint32_t>());
  h.producer_pid = r.get<std::uint32_t>();
  const auto stored_sum = r.get<std::uint32_t>();
  if (h.version < first_checksummed_version && stored_sum != 0) fail("reserved bytes 20..23 are not 0");
  if (h.version >= first_checksummed_version) {
    // Checked before any field is believed: a corrupted byte anywhere (the
    // block's offset, the segment size, a reserved byte) is refused here.
    const std::uint32_t sum = ipc_handle_checksum(bytes);
    if (sum != stored_sum)
      fail("checksum " + hex32(stored_sum) + " does not match the handle's bytes (" + hex32(sum) +
           "): the handle was changed after export (send the bytes unchanged, NUL bytes included)");
  }
  h.segment_id = r.get<std::uint64_t>();
  h.segment_bytes = r.get<std::uint64_t>();
  h.offset_bytes = r.get<std::uint64_t>();
  h.size_bytes = r.get<std::uint64_t>();
  const auto payload = r.get<std::uint64_t>();
  const std::size_t present = bytes.size() - header_bytes;
  if (payload != present)
    fail("payload size " + std::to_string(payload) + " differs from the " + std::to_string(present) +
         " bytes after the header (truncated or trailing bytes)");
  if (h.kind == ipc_kind::plain) {
    if (payload != ipc_mem_handle_bytes)
      fail("a plain handle's payload is " + std::to_string(ipc_mem_handle_bytes) + " bytes, not " +
           std::to_string(payload));
    r.bytes(h.mem_handle.data(), h.mem_handle.size());
  } else {
    if (payload < expandable_fixed_bytes)
      fail("truncated: an expandable payload needs at least " + std::to_string(expandable_fixed_bytes) +
           " bytes, got " + std::to_string(payload));
    h.page_bytes = r.get<std::uint64_t>();
    h.first_page = r.get<std::uint64_t>();
    const std::uint64_t count = r.get<std::uint32_t>();
    if (r.get<std::uint32_t>() != 0) fail("reserved bytes 84..87 are not 0");
    if (count == 0 || count >= max_pages) fail("page count " + std::to_string(count) + " is not in [1, 2^32)");
    const std::uint64_t expected =
        expandable_fixed_bytes + page_entry_bytes * count + (h.version >= 2 ? lease_entry_bytes : 0);
    if (payload != expected)
      fail("payload size " + std::to_string(payload) + " does not match " + std::to_string(count) + " page(s) (" +
           std::to_string(expected) + " bytes)");
    h.pages.resize(count);
    for (ipc_page& p : h.pages) {
      p.fd_index = r.get<std::uint32_t>();
      p.file_offset = r.get<std::uint64_t>();
    }
    if (h.version >= 2) {
      h.lease_fd_index = r.get<std::uint32_t>();
      if (r.get<std::uint32_t>() != 0) fail("reserved lease bytes are not 0");
    }
  }
  validate(h);
  return h;
}

}  // namespace ccalloc
