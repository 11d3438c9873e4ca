// Inter-process sharing (SPEC F25): the handle format and its parser, the
// simulated device's export/import of expandable pages, the front end's
// share/open/close with its cache, a real second process (fork, descriptors
// over a Unix socket with SCM_RIGHTS); copies across devices (F27, F28) and
// several devices at once.
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/core/config.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>
#include <ccalloc/frontend/ipc_handle.hpp>
#include <ccalloc/frontend/ipc_socket.hpp>

#include <gtest/gtest.h>

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace {

using namespace ccalloc;  // NOLINT: test file

constexpr std::size_t MiB = mib;
constexpr std::size_t page = 2 * MiB;
std::uintptr_t U(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

// The message of the invalid_argument_error that parsing `bytes` throws.
std::string parse_error(std::string_view bytes) {
  try {
    (void)parse_ipc_handle(bytes);
  } catch (const invalid_argument_error& e) {
    return e.what();
  }
  return "(parsed)";
}

// `bytes` with its version 3 checksum rewritten to match: a handle edited on
// purpose, to reach the rules the parser checks after the checksum.
std::string resealed(std::string bytes) {
  const std::uint32_t sum = ipc_handle_checksum(bytes);
  for (std::size_t i = 0; i < 4; ++i) bytes[20 + i] = static_cast<char>((sum >> (8 * i)) & 0xffU);
  return bytes;
}

ipc_handle plain_handle() {
  ipc_handle h;
  h.kind = ipc_kind::plain;
  h.device = 3;
  h.producer_pid = 4242;
  h.segment_id = 0x7f0012340000;
  h.segment_bytes = 20 * MiB;
  h.offset_bytes = 512;
  h.size_bytes = 1 * MiB;
  for (std::size_t i = 0; i < h.mem_handle.size(); ++i) h.mem_handle[i] = static_cast<std::uint8_t>(255 - i);
  return h;
}

ipc_handle expandable_handle() {
  ipc_handle h;
  h.kind = ipc_kind::expandable;
  h.device = 1;
  h.producer_pid = 7;
  h.segment_id = 0x7e0000000000;
  h.segment_bytes = 64 * MiB;
  h.page_bytes = page;
  h.offset_bytes = page + 512;  // pages 1..3
  h.size_bytes = 4 * MiB;
  h.first_page = 1;
  h.pages = {{0, 0}, {1, 2 * page}, {2, 8 * page}};
  h.lease_fd_index = 3;  // version 2: the lease's descriptor follows the pages'
  return h;
}

// --- format -------------------------------------------------------------------------

TEST(IpcHandle, RoundTripsBothKinds) {
  for (const ipc_handle& h : {plain_handle(), expandable_handle()}) {
    const std::string bytes = encode_ipc_handle(h);
    EXPECT_EQ(bytes.substr(0, 8), "ccIPChdl");
    EXPECT_EQ(bytes.size(), h.kind == ipc_kind::plain ? 128u : 64u + 24u + 12u * 3u + 8u);
    EXPECT_EQ(parse_ipc_handle(bytes), h);
  }
  EXPECT_EQ(plain_handle().fd_count(), 0u);
  EXPECT_EQ(expandable_handle().fd_count(), 4u);
  // Version 1 (no lease) still reads and writes as it was.
  ipc_handle v1 = expandable_handle();
  v1.version = 1;
  v1.lease_fd_index = 0;
  const std::string bytes = encode_ipc_handle(v1);
  EXPECT_EQ(bytes.size(), 64u + 24u + 12u * 3u);
  EXPECT_EQ(parse_ipc_handle(bytes), v1);
  EXPECT_FALSE(v1.has_lease());
  EXPECT_EQ(v1.fd_count(), 3u);
  v1.lease_fd_index = 3;
  EXPECT_THROW((void)encode_ipc_handle(v1), invalid_argument_error) << "a version 1 handle has no lease";
}

TEST(IpcHandle, FutureVersionAsksToUpgradeTheReader) {
  std::string bytes = encode_ipc_handle(plain_handle());
  bytes[8] = 9;  // version, little-endian
  EXPECT_EQ(parse_error(bytes),
            "ipc handle: ipc handle version 9 is newer than this ccalloc (3); upgrade the reader");
  bytes.resize(12);  // a newer layout may be shorter: the version is checked first
  EXPECT_NE(parse_error(bytes).find("version 9 is newer"), std::string::npos);
  bytes[8] = 0;
  EXPECT_NE(parse_error(bytes).find("version 0"), std::string::npos);
}

TEST(IpcHandle, MalformedInputsNameWhatIsWrong) {
  const std::string good = encode_ipc_handle(expandable_handle());
  auto with = [&](std::size_t at, char value) {
    std::string b = good;
    b[at] = value;
    return parse_error(resealed(b));
  };
  EXPECT_EQ(parse_error(""), "ipc handle: truncated: 0 bytes, the header needs 64");
  EXPECT_EQ(parse_error(good.substr(0, 40)), "ipc handle: truncated: 40 bytes, the header needs 64");
  EXPECT_EQ(parse_error("ccIPCxxx" + good.substr(8)), "ipc handle: bad magic (not a ccalloc IPC handle)");
  EXPECT_EQ(with(10, 7), "ipc handle: unknown kind 7 (accepted: 1 plain, 2 expandable)");
  EXPECT_EQ(with(11, 1), "ipc handle: reserved byte 11 is not 0");
  EXPECT_EQ(with(15, '\x80'), "ipc handle: device -2147483647 is negative");
  EXPECT_NE(parse_error(resealed(good + "x")).find("payload size 68 differs from the 69 bytes"), std::string::npos);
  EXPECT_NE(parse_error(resealed(good.substr(0, good.size() - 1))).find("truncated or trailing"), std::string::npos);
  // Unsealed, a changed byte or a truncated copy is refused by the checksum first.
  EXPECT_EQ(parse_error(good.substr(0, good.size() - 1)).rfind("ipc handle: checksum 0x", 0), 0u);
  std::string moved = good;
  moved[40] = static_cast<char>(moved[40] + 1);  // the block's offset, + 1 byte
  const std::string moved_error = parse_error(moved);
  EXPECT_EQ(moved_error.rfind("ipc handle: checksum 0x", 0), 0u) << moved_error;
  EXPECT_NE(moved_error.find("does not match the handle's bytes (0x"), std::string::npos) << moved_error;
  EXPECT_NE(moved_error.find("): the handle was changed after export (send the bytes unchanged, NUL bytes included)"),
            std::string::npos)
      << moved_error;
  // Resealed, the offset is refused for its alignment.
  EXPECT_EQ(parse_error(resealed(moved)),
            "ipc handle: block offset 2097665 is not a multiple of 512 (blocks start 512-byte aligned in their segment)");
  // Page size 3 MiB: not a power of two.
  EXPECT_NE(with(64 + 2, 0x30).find("is not a power of two"), std::string::npos);
  // First page 2 instead of 1.
  EXPECT_NE(with(72, 2).find("do not cover the block exactly"), std::string::npos);
  // fd index 3 for page 0.
  EXPECT_EQ(with(88, 3), "ipc handle: page 0: fd index 3 is not 0 (page i's descriptor is the i-th sent)");
  // Lease fd index 9 of 3 pages (it is the page count), reserved lease bytes.
  EXPECT_EQ(with(124, 9), "ipc handle: lease fd index 9 is not the page count 3 (the lease's descriptor follows the pages')");
  EXPECT_EQ(with(128, 1), "ipc handle: reserved lease bytes are not 0");
  // Block passes the end of its segment.
  ipc_handle h = plain_handle();
  h.offset_bytes = h.segment_bytes;
  EXPECT_THROW((void)encode_ipc_handle(h), invalid_argument_error) << "the encoder checks the same rules";
  h.offset_bytes = 0;
  h.size_bytes = 0;
  EXPECT_THROW((void)encode_ipc_handle(h), invalid_argument_error);
  // A plain handle with a payload of the wrong size.
  std::string p = encode_ipc_handle(plain_handle());
  p.pop_back();
  p[56] = 63;
  EXPECT_EQ(parse_error(resealed(p)), "ipc handle: a plain handle's payload is 64 bytes, not 63");
}

// Every single-bit flip of a valid 120-byte expandable handle of version 2
// (no checksum) is refused naming a field, or lies in a field the header
// documents as not checkable without the producer. In version 3 every flip
// is refused (the checksum).
TEST(IpcHandle, EveryBitFlipIsRefusedOrInADocumentedUncheckedField) {
  ipc_handle h = expandable_handle();
  h.version = 2;
  h.producer_pid = 31337;
  h.offset_bytes = page - 4096;  // pages 0..1
  h.size_bytes = 8192;
  h.first_page = 0;
  h.pages = {{0, 4 * page}, {1, 9 * page}};
  h.lease_fd_index = 2;
  const std::string good = encode_ipc_handle(h);
  ASSERT_EQ(good.size(), 120u);
  // [first, last] byte ranges whose flips may still parse (ipc_handle.hpp,
  // "Not checkable without the producer").
  struct field {
    std::size_t first, last;
    const char* name;
  };
  const std::vector<field> unchecked = {
      {12, 15, "device"},          {16, 19, "producer pid"}, {24, 31, "segment id"},
      {32, 39, "segment size"},    {40, 47, "block offset"}, {48, 55, "block size"},
      {92, 99, "page 0's file offset"}, {104, 111, "page 1's file offset"}};
  std::size_t refused = 0, accepted = 0;
  std::vector<std::size_t> refused_per_byte(good.size(), 0);
  for (std::size_t at = 0; at < good.size(); ++at) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string b = good;
      b[at] = static_cast<char>(b[at] ^ (1 << bit));
      try {
        (void)parse_ipc_handle(b);
        ++accepted;
        const bool documented = std::any_of(unchecked.begin(), unchecked.end(),
                                            [&](const field& f) { return at >= f.first && at <= f.last; });
        EXPECT_TRUE(documented) << "byte " << at << " bit " << bit << " parsed: not a documented unchecked field";
      } catch (const invalid_argument_error& e) {
        ++refused;
        ++refused_per_byte[at];
        EXPECT_EQ(std::string(e.what()).rfind("ipc handle: ", 0), 0u) << e.what();
      }
    }
  }
  // The flips the hostile-input trial opened: refused now, each naming its field.
  auto flip = [&](std::size_t at, int bit) {
    std::string b = good;
    b[at] = static_cast<char>(b[at] ^ (1 << bit));
    return parse_error(b);
  };
  EXPECT_EQ(refused_per_byte[19], 8u) << "pid above 2^22";
  EXPECT_NE(flip(19, 0).find("producer pid"), std::string::npos);
  EXPECT_EQ(refused_per_byte[24], 8u) << "segment id below the page size's alignment";
  EXPECT_NE(flip(24, 3).find("segment id"), std::string::npos);
  EXPECT_EQ(refused_per_byte[31], 7u) << "segment id outside 57 bits (bit 56 stays inside)";
  EXPECT_EQ(refused_per_byte[39], 7u) << "segment size outside 57 bits (bit 56 stays inside)";
  EXPECT_NE(flip(34, 0).find("segment size"), std::string::npos);
  EXPECT_EQ(refused_per_byte[88], 8u);
  EXPECT_NE(flip(88, 0).find("page 0: fd index 1 is not 0"), std::string::npos);
  EXPECT_EQ(refused_per_byte[100], 8u);
  EXPECT_NE(flip(100, 0).find("page 1: fd index 0 is not 1"), std::string::npos);
  for (std::size_t at : {0u, 8u, 10u, 11u, 20u, 56u, 64u, 72u, 80u, 84u, 112u, 116u})
    EXPECT_EQ(refused_per_byte[at], 8u) << "byte " << at;
  EXPECT_EQ(refused + accepted, 960u);
  EXPECT_GT(refused, 650u) << refused << " refused, " << accepted << " accepted";
  EXPECT_EQ(refused_per_byte[40], 8u) << "block offset no longer a multiple of 512";
  // Version 3: the same handle with a checksum; each of the 960 flips is refused.
  h.version = 3;
  const std::string sealed = encode_ipc_handle(h);
  ASSERT_EQ(sealed.size(), 120u);
  ASSERT_EQ(parse_ipc_handle(sealed), h);
  std::size_t sealed_refused = 0;
  for (std::size_t at = 0; at < sealed.size(); ++at) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string b = sealed;
      b[at] = static_cast<char>(b[at] ^ (1 << bit));
      const std::string error = parse_error(b);
      EXPECT_EQ(error.rfind("ipc handle: ", 0), 0u) << "byte " << at << " bit " << bit << ": " << error;
      sealed_refused += error != "(parsed)" ? 1 : 0;
    }
  }
  EXPECT_EQ(sealed_refused, 960u);
  h.version = 2;
  // A pid of 0 names the field too.
  h.producer_pid = 0;
  try {
    (void)encode_ipc_handle(h);
    ADD_FAILURE() << "pid 0 was encoded";
  } catch (const invalid_argument_error& e) {
    EXPECT_STREQ(e.what(), "ipc handle: producer pid 0 is not in [1, 4194304]");
  }
}

TEST(IpcHandle, SeedCorpusParsesAsExpected) {
  // fuzz/corpus/ipc_handle holds these encodings too: the fuzzer starts there.
  EXPECT_EQ(parse_ipc_handle(encode_ipc_handle(expandable_handle())).pages.size(), 3u);
}

// --- the simulated device's export and import -------------------------------------------

// A handle of the simulated device names its segment's memory file by the
// producer's process and descriptor number. Once the segment is freed,
// another memory file of the same size may take that number: the handle
// must not open it.
TEST(SimIpc, AFreedSegmentsHandleDoesNotOpenTheFileThatTookItsDescriptor) {
  sim_backend sim;
  void* base = sim.segment_malloc(0, 2 * MiB);
  const ipc_mem_handle handle = sim.ipc_export_segment(0, base);
  int fd = -1;  // the descriptor number the handle names (bytes 12..15: after the magic and the pid)
  std::memcpy(&fd, handle.bytes.data() + 12, sizeof fd);
  ASSERT_GE(fd, 0);
  sim.segment_free(0, base);  // the segment's memory file closes
  const int other = ::memfd_create("another-file", MFD_CLOEXEC);
  ASSERT_GE(other, 0);
  ASSERT_EQ(::ftruncate(other, static_cast<off_t>(2 * MiB)), 0);
  ASSERT_EQ(::dup2(other, fd), fd) << "another file of the same size at the freed segment's descriptor";
  if (other != fd) ::close(other);  // the lowest free number is often the freed one
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    sim_backend importer;
    try {
      (void)importer.ipc_open_segment(0, handle);
    } catch (const backend_error& e) {
      if (std::string(e.what()).find("another file than the exported segment's") != std::string::npos) ::_exit(0);
      std::fprintf(stderr, "%s\n", e.what());
      ::_exit(2);
    } catch (...) {
      ::_exit(3);
    }
    ::_exit(1);  // opened
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ::close(fd);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: opened another file, 2: another message, 3: another exception";
}

TEST(SimIpc, ExportImportSharesBytesAndChecksTheDescriptor) {
  sim_backend sim;
  EXPECT_TRUE(sim.capabilities().ipc_vm);
  EXPECT_TRUE(sim.capabilities().ipc);
  physical_handle_t h = 0;
  ASSERT_TRUE(sim.vm_create(0, page, &h));
  void* a = sim.vm_reserve(0, page);
  sim.vm_map(0, a, page, h);
  std::memset(a, 0x5a, page);
  const shareable_handle s = sim.vm_export_handle(0, h);
  ASSERT_GE(s.fd, 0);
  EXPECT_EQ(s.size_bytes, page);
  const physical_handle_t imported = sim.vm_import_handle(0, s);
  void* b = sim.vm_reserve(0, page);
  sim.vm_map(0, b, page, imported);
  EXPECT_NE(a, b);
  EXPECT_EQ(static_cast<unsigned char*>(b)[page - 1], 0x5a);
  static_cast<unsigned char*>(b)[7] = 0x11;
  EXPECT_EQ(static_cast<unsigned char*>(a)[7], 0x11) << "one memory, two mappings";
  const std::size_t used = sim.counters().used_bytes;
  EXPECT_EQ(used, page) << "the import draws on no capacity";
  EXPECT_EQ(sim.counters().vm_imports, 1u);

  // Bad descriptors and ranges.
  EXPECT_THROW((void)sim.vm_import_handle(0, shareable_handle{-1, 0, page}), backend_error);
  int pipefd[2];
  ASSERT_EQ(::pipe(pipefd), 0);
  try {
    (void)sim.vm_import_handle(0, shareable_handle{pipefd[0], 0, page});
    ADD_FAILURE() << "a pipe was imported";
  } catch (const backend_error& e) {
    EXPECT_NE(std::string(e.what()).find("not a memory file"), std::string::npos) << e.what();
  }
  ::close(pipefd[0]);
  ::close(pipefd[1]);
  try {
    (void)sim.vm_import_handle(0, shareable_handle{s.fd, 64 * page, page});
    ADD_FAILURE() << "a range past the file was imported";
  } catch (const backend_error& e) {
    EXPECT_NE(std::string(e.what()).find("passes the end of the file"), std::string::npos) << e.what();
  }
  ::close(s.fd);
  EXPECT_EQ(static_cast<unsigned char*>(b)[0], 0x5a) << "the import holds its own descriptor";

  sim.vm_unmap(0, b, page);
  sim.vm_release_handle(0, imported);
  sim.vm_release(0, b, page);
  sim.vm_unmap(0, a, page);
  sim.vm_release_handle(0, h);
  sim.vm_release(0, a, page);
  EXPECT_EQ(sim.counters().live_handles, 0u);
  EXPECT_EQ(sim.counters().used_bytes, 0u);
}

// --- the front end ------------------------------------------------------------------------

class IpcTest : public ::testing::Test {
 protected:
  void make(const std::string& conf = "", int devices = 1) {
    alloc.reset();
    sim_options o;
    o.capacity_bytes = 256 * MiB;
    o.device_count = devices;
    sim = std::make_shared<sim_backend>(o);
    alloc = std::make_unique<caching_allocator>(sim, allocator_config::parse(conf));
    alloc->init(devices);
  }
  void SetUp() override { make(); }
  static void close_all(const std::vector<int>& fds) {
    for (int fd : fds) ::close(fd);
  }

  std::shared_ptr<sim_backend> sim;
  std::unique_ptr<caching_allocator> alloc;
};

TEST_F(IpcTest, ExpandableBlockRoundTripsAndIsCached) {
  void* first = alloc->malloc(0, 3 * MiB, 0);
  void* p = alloc->malloc(0, 3 * MiB, 0);  // starts inside page 1, ends in page 2
  ASSERT_EQ(U(p), U(first) + 3 * MiB);
  std::memset(p, 0xab, 3 * MiB);
  ipc_export ex = alloc->share_ipc_handle(p);
  const ipc_handle h = parse_ipc_handle(ex.handle);
  EXPECT_EQ(h.kind, ipc_kind::expandable);
  EXPECT_EQ(h.offset_bytes, 3 * MiB);
  EXPECT_EQ(h.size_bytes, 3 * MiB);
  EXPECT_EQ(h.first_page, 1u);
  ASSERT_EQ(h.pages.size(), 2u);
  ASSERT_EQ(ex.fds.size(), 3u) << "two pages and the lease";
  EXPECT_EQ(h.lease_fd_index, 2u);
  EXPECT_EQ(h.producer_pid, static_cast<std::uint32_t>(::getpid()));

  void* q = alloc->open_ipc_handle(ex.handle, ex.fds);
  EXPECT_NE(q, p);
  EXPECT_EQ(U(q) % page, MiB) << "the block keeps its offset in its first page";
  EXPECT_EQ(std::memcmp(q, p, 3 * MiB), 0);
  static_cast<unsigned char*>(q)[100] = 0x01;
  EXPECT_EQ(static_cast<unsigned char*>(p)[100], 0x01);
  EXPECT_EQ(alloc->ipc_open_mappings(), 1u);
  const auto imports = sim->counters().vm_imports;

  // A second share of the same block: the same handle, the cached mapping, no new import.
  ipc_export again = alloc->share_ipc_handle(p);
  EXPECT_EQ(again.handle, ex.handle);
  EXPECT_EQ(alloc->open_ipc_handle(again.handle, again.fds), q);
  EXPECT_EQ(sim->counters().vm_imports, imports);
  EXPECT_EQ(alloc->ipc_open_mappings(), 1u);
  close_all(again.fds);
  close_all(ex.fds);

  // Opened twice: an interior pointer is no pointer open_ipc_handle returned,
  // and drops no reference (else the second holder's mapping would go early).
  for (std::size_t off : {std::size_t{1}, std::size_t{512}, 3 * MiB - 1})
    EXPECT_THROW(alloc->close_ipc_handle(static_cast<char*>(q) + off), invalid_argument_error) << off;
  EXPECT_THROW(alloc->close_ipc_handle(static_cast<char*>(q) - MiB), invalid_argument_error)
      << "the mapping's first page, before the block";
  alloc->close_ipc_handle(q);
  EXPECT_EQ(alloc->ipc_open_mappings(), 1u) << "one reference left";
  EXPECT_EQ(static_cast<unsigned char*>(q)[0], 0xab);
  alloc->close_ipc_handle(q);
  EXPECT_EQ(alloc->ipc_open_mappings(), 0u);
  EXPECT_THROW(alloc->close_ipc_handle(q), invalid_argument_error);
  EXPECT_THROW(alloc->free(q), invalid_argument_error) << "an opened pointer is not an allocation";
  EXPECT_EQ(sim->counters().live_reservations, 1u) << "only the producer's segment";
  alloc->free(p);
  alloc->free(first);
  alloc->device_allocator(0).check_invariants();
}

TEST_F(IpcTest, PlainSegmentIsSharedInPlaceAndNotOpenedByItsOwnProcess) {
  make("expandable_segments:False");
  auto* p = static_cast<unsigned char*>(alloc->malloc(0, MiB, 0));
  p[12345] = 0x9d;
  ipc_export ex = alloc->share_ipc_handle(p);
  EXPECT_TRUE(ex.fds.empty());
  const ipc_handle h = parse_ipc_handle(ex.handle);
  EXPECT_EQ(h.kind, ipc_kind::plain);
  EXPECT_EQ(h.segment_bytes, 2 * MiB) << "the small pool's 2 MiB segment";
  EXPECT_EQ(h.offset_bytes, 0u);
  EXPECT_EQ(h.size_bytes, MiB);
  EXPECT_EQ(p[12345], 0x9d) << "moved into a memory file with its bytes";
  p[1] = 0x01;
  EXPECT_EQ(alloc->share_ipc_handle(p).handle, ex.handle) << "exported once";
  try {
    (void)alloc->open_ipc_handle(ex.handle);
    ADD_FAILURE() << "opened its own export";
  } catch (const backend_error& e) {
    EXPECT_NE(std::string(e.what()).find("comes from this process"), std::string::npos) << e.what();
  }
  EXPECT_EQ(alloc->ipc_open_mappings(), 0u);
  alloc->free(p);
  alloc->device_allocator(0).check_invariants();
}

TEST_F(IpcTest, OpenedExpandableMappingGrantsThePeersOfItsDevice) {
  make("", 2);
  alloc->enable_peer_access(1, 0);  // device 1 may access device 0's memory
  void* p = alloc->malloc(0, 3 * MiB, 0);
  ipc_export ex = alloc->share_ipc_handle(p);
  void* q = alloc->open_ipc_handle(ex.handle, ex.fds);
  close_all(ex.fds);
  EXPECT_TRUE(sim->peer_can_access(0, q, 1));
  EXPECT_TRUE(sim->peer_can_access(0, static_cast<char*>(q) + 2 * MiB, 1)) << "every page";
  alloc->close_ipc_handle(q);
  alloc->free(p);
}

TEST_F(IpcTest, ExpandableMappingOpenedForAnotherDeviceGrantsIt) {
  make("", 3);
  void* p = alloc->malloc(0, 3 * MiB, 0);
  ipc_export ex = alloc->share_ipc_handle(p);
  auto* q = static_cast<char*>(alloc->open_ipc_handle(ex.handle, ex.fds, 1));
  EXPECT_TRUE(sim->peer_can_access(0, q, 1));
  EXPECT_TRUE(sim->peer_can_access(0, q + 3 * MiB - 1, 1)) << "every page";
  EXPECT_FALSE(sim->peer_can_access(0, q, 2));
  EXPECT_FALSE(sim->peer_access_enabled(1, 0)) << "a mapping grant, not device-wide peer access";
  const auto imports = sim->counters().vm_imports;
  EXPECT_EQ(alloc->open_ipc_handle(ex.handle, ex.fds, 2), q) << "cached";
  EXPECT_EQ(sim->counters().vm_imports, imports);
  EXPECT_TRUE(sim->peer_can_access(0, q, 2)) << "the cached mapping is granted to the new device";
  EXPECT_TRUE(sim->peer_can_access(0, q + 3 * MiB - 1, 2));
  close_all(ex.fds);
  alloc->close_ipc_handle(q);
  alloc->close_ipc_handle(q);
  EXPECT_EQ(alloc->ipc_open_mappings(), 0u);
  alloc->free(p);
}

TEST_F(IpcTest, AccessDeviceMustExistAndReachTheOwner) {
  make("", 2);
  void* p = alloc->malloc(0, 3 * MiB, 0);
  ipc_export ex = alloc->share_ipc_handle(p);
  EXPECT_THROW((void)alloc->open_ipc_handle(ex.handle, ex.fds, 2), invalid_argument_error);
  EXPECT_THROW((void)alloc->open_ipc_handle(ex.handle, ex.fds, -2), invalid_argument_error) << "only -1 means the owner";
  EXPECT_EQ(alloc->ipc_open_mappings(), 0u);
  close_all(ex.fds);
  alloc->free(p);

  // Two devices without a peer-to-peer path.
  alloc.reset();
  sim_options o;
  o.capacity_bytes = 256 * MiB;
  o.device_count = 2;
  o.peer_access = false;
  sim = std::make_shared<sim_backend>(o);
  alloc = std::make_unique<caching_allocator>(sim, allocator_config::parse(""));
  alloc->init(2);
  p = alloc->malloc(0, 3 * MiB, 0);
  ex = alloc->share_ipc_handle(p);
  try {
    (void)alloc->open_ipc_handle(ex.handle, ex.fds, 1);
    ADD_FAILURE() << "opened for a device that cannot reach the owner";
  } catch (const backend_error& e) {
    EXPECT_STREQ(e.what(),
                 "ccalloc: open_ipc_handle: device 1 cannot access device 0 on the 'sim' backend (no peer-to-peer path)");
  }
  EXPECT_EQ(alloc->ipc_open_mappings(), 0u);
  EXPECT_EQ(sim->counters().vm_imports, 0u);
  void* q = alloc->open_ipc_handle(ex.handle, ex.fds);  // for the owner itself: fine
  EXPECT_EQ(alloc->ipc_open_mappings(), 1u);
  alloc->close_ipc_handle(q);
  close_all(ex.fds);
  alloc->free(p);
}

// A handle corrupted in transit: each byte changed in turn (three ways) is
// either refused as an invalid argument, leaving nothing open, or opens the
// original block; none opens another offset (an unaligned pointer, wrong data).
TEST_F(IpcTest, EveryCorruptedByteOfAnExportedHandleIsRefusedOrOpensTheOriginal) {
  void* first = alloc->malloc(0, 1 * MiB, 0);
  void* p = alloc->malloc(0, 3 * MiB, 0);
  std::memset(p, 0x42, 3 * MiB);
  const ipc_export ex = alloc->share_ipc_handle(p);
  void* q = alloc->open_ipc_handle(ex.handle, ex.fds);
  ASSERT_EQ(std::memcmp(q, p, 3 * MiB), 0);
  const auto before = sim->counters();
  std::size_t refused = 0, tried = 0;
  for (std::size_t at = 0; at < ex.handle.size(); ++at) {
    for (unsigned mask : {0x01U, 0x80U, 0xffU}) {
      std::string b = ex.handle;
      b[at] = static_cast<char>(static_cast<unsigned char>(b[at]) ^ mask);
      ++tried;
      try {
        void* z = alloc->open_ipc_handle(b, ex.fds);
        EXPECT_EQ(z, q) << "byte " << at << " ^ " << mask << " opened another pointer";
        alloc->close_ipc_handle(z);
      } catch (const invalid_argument_error&) {
        ++refused;
      } catch (const std::exception& e) {
        ADD_FAILURE() << "byte " << at << " ^ " << mask << ": not an invalid argument: " << e.what();
      }
    }
  }
  EXPECT_EQ(refused, tried) << "every corrupted byte is caught by the checksum";
  EXPECT_EQ(alloc->ipc_open_mappings(), 1u);
  EXPECT_EQ(sim->counters().live_handles, before.live_handles);
  EXPECT_EQ(sim->counters().vm_imports, before.vm_imports) << "refused before any import";
  alloc->close_ipc_handle(q);
  close_all(ex.fds);
  alloc->free(p);
  alloc->free(first);
}

TEST_F(IpcTest, BadHandlesDevicesAndDescriptorsLeaveNothingOpen) {
  void* p = alloc->malloc(0, 5 * MiB, 0);
  EXPECT_THROW((void)alloc->share_ipc_handle(static_cast<char*>(p) + 512), invalid_argument_error);
  ipc_export ex = alloc->share_ipc_handle(p);
  ASSERT_EQ(ex.fds.size(), 4u);
  const auto before = sim->counters();
  // Wrong number of descriptors.
  try {
    (void)alloc->open_ipc_handle(ex.handle, std::span<const int>(ex.fds).first(2));
    ADD_FAILURE();
  } catch (const invalid_argument_error& e) {
    EXPECT_STREQ(e.what(), "ccalloc: open_ipc_handle: the handle needs 4 file descriptor(s), got 2");
  }
  // A descriptor that is not the memory file: the third page fails after two imports.
  int pipefd[2];
  ASSERT_EQ(::pipe(pipefd), 0);
  std::vector<int> bad = ex.fds;
  bad[2] = pipefd[0];
  EXPECT_THROW((void)alloc->open_ipc_handle(ex.handle, bad), backend_error);
  // A descriptor that is not a lease file where the lease goes.
  bad = ex.fds;
  bad[3] = pipefd[0];
  try {
    (void)alloc->open_ipc_handle(ex.handle, bad);
    ADD_FAILURE();
  } catch (const backend_error& e) {
    EXPECT_NE(std::string(e.what()).find("is not an ipc lease file"), std::string::npos) << e.what();
  }
  ::close(pipefd[0]);
  ::close(pipefd[1]);
  // A device this allocator has not initialized.
  ipc_handle h = parse_ipc_handle(ex.handle);
  h.device = 1;
  EXPECT_THROW((void)alloc->open_ipc_handle(encode_ipc_handle(h), ex.fds), invalid_argument_error);
  // Garbage.
  EXPECT_THROW((void)alloc->open_ipc_handle("not a handle"), invalid_argument_error);
  const auto after = sim->counters();
  EXPECT_EQ(alloc->ipc_open_mappings(), 0u);
  EXPECT_EQ(after.live_handles, before.live_handles);
  EXPECT_EQ(after.live_reservations, before.live_reservations);
  EXPECT_EQ(after.mapped_bytes, before.mapped_bytes);
  ASSERT_EQ(alloc->ipc_exports().size(), 1u);
  EXPECT_EQ(alloc->ipc_exports()[0].importers, 0u) << "a failed open gives its lease slot back";
  close_all(ex.fds);
  alloc->free(p);
  EXPECT_TRUE(alloc->ipc_exports().empty());
}

// The child: its own device and allocator; receives the handle, opens it
// twice (one mapping), checks the parent's bytes, writes its answer, closes
// (plain segments: the simulated cudaIpcMemHandle_t names the parent's
// memory file, opened through /proc; expandable: the descriptors came over
// the socket).
// Returns the exit code: 0 when every check passed. The consumer has two
// devices: it opens the handle for `first_access` (the device whose kernels
// use the mapping), then again for the other device: an expandable mapping
// is shared (same pointer, access granted), a plain one is opened again for
// that device (its own pointer to the same bytes).
int consumer(int sock, int first_access) {
  std::string bytes;
  std::vector<int> fds;
  try {
    ipc_export got = receive_ipc_handle(sock);
    bytes = std::move(got.handle);
    fds = std::move(got.fds);
  } catch (const std::exception&) {
    return 10;
  }
  try {
    auto sim = std::make_shared<sim_backend>(sim_options{.device_count = 2});
    caching_allocator alloc(sim, allocator_config::parse(""));
    alloc.init(2);
    const int second_access = 1 - first_access;
    auto* q = static_cast<unsigned char*>(alloc.open_ipc_handle(bytes, fds, first_access));
    if (alloc.open_ipc_handle(bytes, fds, first_access) != q) return 11;
    auto* other = static_cast<unsigned char*>(alloc.open_ipc_handle(bytes, fds, second_access));
    for (int fd : fds) ::close(fd);
    const ipc_handle h = parse_ipc_handle(bytes);
    if (h.kind == ipc_kind::expandable) {
      if (other != q || alloc.ipc_open_mappings() != 1) return 11;
      if (!sim->peer_can_access(0, q, 1) || !sim->peer_can_access(0, q + h.size_bytes - 1, 1)) return 14;
    } else {
      if (other == q || alloc.ipc_open_mappings() != 2) return 11;
      if (other[h.size_bytes - 4096] != q[h.size_bytes - 4096]) return 12;
    }
    for (std::size_t i = 0; i < h.size_bytes; i += 4096)
      if (q[i] != static_cast<unsigned char>(i / 4096)) return 12;
    try {  // an interior pointer drops no reference
      alloc.close_ipc_handle(q + 512);
      return 16;
    } catch (const invalid_argument_error&) {
    }
    q[0] = 0xc7;  // the answer
    alloc.close_ipc_handle(other);  // a plain segment closes on the device it was opened for
    alloc.close_ipc_handle(q);
    alloc.close_ipc_handle(q);
    if (alloc.ipc_open_mappings() != 0 || sim->counters().live_handles != 0) return 13;
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer: %s\n", e.what());
    return 15;
  }
}

class IpcForkTest : public IpcTest, public ::testing::WithParamInterface<std::tuple<const char*, int>> {};

TEST_P(IpcForkTest, SecondProcessReadsTheBytesAndAnswers) {
  const auto [conf, first_access] = GetParam();
  make(conf);
  void* p = alloc->malloc(0, 7 * MiB, 0);
  auto* bytes = static_cast<unsigned char*>(p);
  for (std::size_t i = 0; i < 7 * MiB; i += 4096) bytes[i] = static_cast<unsigned char>(i / 4096);
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(sv[0]);
    ::_exit(consumer(sv[1], first_access));
  }
  ::close(sv[1]);
  // Exported after the fork: the child can see the descriptors only through the socket.
  ipc_export ex = alloc->share_ipc_handle(p);
  const bool expandable = parse_ipc_handle(ex.handle).kind == ipc_kind::expandable;
  EXPECT_EQ(expandable, alloc->config().expandable_segments);
  EXPECT_EQ(ex.fds.size(), expandable ? 5u : 0u) << "expandable: four pages and the lease";
  send_ipc_handle(sv[0], ex);
  close_all(ex.fds);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ::close(sv[0]);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "consumer exit codes: 10 receive, 11 cache, 12 bytes, 13 close, 14 access, 15 exception";
  EXPECT_EQ(bytes[0], 0xc7) << "the child's write is in the parent's block";
  alloc->free(p);
}

TEST_F(IpcTest, HandleOfAFreedPlainSegmentIsRejected) {
  make("expandable_segments:False");
  void* p = alloc->malloc(0, MiB, 0);
  const ipc_export ex = alloc->share_ipc_handle(p);
  alloc->free(p);
  alloc->empty_cache();  // the segment goes back to the device: its memory file closes
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto sim2 = std::make_shared<sim_backend>();
    caching_allocator other(sim2, allocator_config::parse(""));
    other.init(1);
    try {
      (void)other.open_ipc_handle(ex.handle);
    } catch (const backend_error& e) {
      ::_exit(std::string(e.what()).find("freed the segment") != std::string::npos ? 0 : 2);
    } catch (...) {
      ::_exit(3);
    }
    ::_exit(1);  // opened
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: opened a freed segment, 2: another message, 3: another exception";
}

INSTANTIATE_TEST_SUITE_P(BothKindsBothAccessDevices, IpcForkTest,
                         ::testing::Combine(::testing::Values("expandable_segments:True",
                                                              "expandable_segments:False"),
                                            ::testing::Values(0, 1)));

TEST(IpcSocket, CarriesMoreDescriptorsThanOneMessageHolds) {
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv), 0);
  int pipefd[2];
  ASSERT_EQ(::pipe(pipefd), 0);
  ipc_export ex;
  ex.handle = std::string("abc\0def", 7);
  ex.fds.assign(300, pipefd[1]);  // 300 > 253: two messages
  std::thread sender([&] { send_ipc_handle(sv[0], ex); });
  ipc_export got = receive_ipc_handle(sv[1]);
  sender.join();
  EXPECT_EQ(got.handle, ex.handle);
  ASSERT_EQ(got.fds.size(), 300u);
  ASSERT_EQ(::write(got.fds[299], "x", 1), 1) << "a working copy of the pipe's write end";
  char c = 0;
  EXPECT_EQ(::read(pipefd[0], &c, 1), 1);
  EXPECT_EQ(c, 'x');
  for (int fd : got.fds) ::close(fd);
  ::close(pipefd[0]);
  ::close(pipefd[1]);
  ::close(sv[0]);
  ::close(sv[1]);
}

TEST(IpcSocket, ReportsAClosedPeerAndOversizedHandles) {
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv), 0);
  ::close(sv[1]);
  try {
    (void)receive_ipc_handle(sv[0]);
    ADD_FAILURE() << "received from a closed peer";
  } catch (const backend_error& e) {
    EXPECT_STREQ(e.what(), "ccalloc: receive_ipc_handle: the peer closed the socket");
  }
  ipc_export big;
  big.handle.assign(65 * 1024, 'x');
  EXPECT_THROW(send_ipc_handle(sv[0], big), invalid_argument_error);
  ::close(sv[0]);
}

// --- copies and several devices ----------------------------------------------------------

TEST_F(IpcTest, MemcpyAsyncUsesAPeerCopyForExpandableMemoryWithoutP2P) {
  make("", 2);
  auto* a = static_cast<unsigned char*>(alloc->malloc(0, MiB, 0));
  auto* b = static_cast<unsigned char*>(alloc->malloc(1, MiB, 0));
  std::memset(a, 0x3c, MiB);
  alloc->memcpy_async(b, 1, a, 0, MiB, 0, /*p2p_enabled=*/false);
  EXPECT_EQ(sim->counters().memcpy_peer_async_calls, 1u);
  EXPECT_EQ(sim->counters().memcpy_async_calls, 0u);
  EXPECT_EQ(b[MiB - 1], 0x3c);
  alloc->memcpy_async(a, 0, b, 1, MiB, 0, /*p2p_enabled=*/true);
  alloc->memcpy_async(a, 0, a + 512, 0, 512, 0, /*p2p_enabled=*/false);  // one device
  EXPECT_EQ(sim->counters().memcpy_async_calls, 2u);
  EXPECT_EQ(sim->counters().memcpy_peer_async_calls, 1u);
  alloc->memcpy_async(a, 0, b, 1, 0, 0, false);
  EXPECT_EQ(sim->counters().memcpy_async_calls + sim->counters().memcpy_peer_async_calls, 3u) << "size 0: nothing";
  EXPECT_THROW(alloc->memcpy_async(a, 2, b, 1, 8, 0, false), invalid_argument_error);
  b[5] = 0x77;
  alloc->copy_data(a, b, 16);
  EXPECT_EQ(a[5], 0x77);
  EXPECT_EQ(sim->counters().copy_data_calls, 1u);
  alloc->free(a);
  alloc->free(b);
}

TEST_F(IpcTest, MemcpyAsyncIsAPlainCopyBetweenPlainSegments) {
  make("expandable_segments:False", 2);
  auto* a = static_cast<unsigned char*>(alloc->malloc(0, MiB, 0));
  auto* b = static_cast<unsigned char*>(alloc->malloc(1, MiB, 0));
  a[9] = 0x42;
  alloc->memcpy_async(b, 1, a, 0, 16, 0, /*p2p_enabled=*/false);
  EXPECT_EQ(sim->counters().memcpy_async_calls, 1u);
  EXPECT_EQ(sim->counters().memcpy_peer_async_calls, 0u);
  EXPECT_EQ(b[9], 0x42);
  alloc->free(a);
  alloc->free(b);
}

TEST_F(IpcTest, FourDevicesKeepTheirOwnPoolsAndStatistics) {
  make("", 4);
  std::vector<void*> ptrs;
  for (int d = 0; d < 4; ++d)
    for (int i = 0; i <= d; ++i) ptrs.push_back(alloc->malloc(d, (d + 1) * MiB, 0));
  for (int d = 0; d < 4; ++d) {
    const device_stats s = alloc->get_device_stats(d);
    EXPECT_EQ(s.allocated_bytes[0].current, static_cast<std::int64_t>((d + 1) * (d + 1) * MiB)) << "device " << d;
    EXPECT_EQ(s.allocation[0].current, d + 1) << "device " << d;
    EXPECT_EQ(alloc->expandable_segment_sizes(d).size(), 1u) << "device " << d;
  }
  for (void* p : ptrs) alloc->free(p);
  for (int d = 0; d < 4; ++d) {
    EXPECT_EQ(alloc->get_device_stats(d).allocated_bytes[0].current, 0);
    alloc->device_allocator(d).check_invariants();
  }
}

}  // namespace
