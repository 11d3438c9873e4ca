// Expandable memory shared across processes (SPEC C3): one stable handle per
// exported block, the importer maps only the block's pages, the exporter
// keeps the pages while an importer holds them (its free waits, empty_cache
// keeps them), an importer killed without closing gives its hold back, and
// the importer's mapping outlives the exporter. Two real processes (fork)
// on the simulated device: its pages live in a memory file that the
// importer maps through the descriptors sent over a Unix socket.
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/core/config.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>
#include <ccalloc/frontend/ipc_handle.hpp>
#include <ccalloc/frontend/ipc_socket.hpp>

#include <gtest/gtest.h>

#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace {

using namespace ccalloc;  // NOLINT: test file

constexpr std::size_t MiB = mib;
constexpr std::size_t page = 2 * MiB;
std::uintptr_t U(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

void close_all(const std::vector<int>& fds) {
  for (int fd : fds) ::close(fd);
}

// One byte over the socket, and waiting for one (false: the peer is gone).
void signal_peer(int sock, char what) { (void)!::write(sock, &what, 1); }
bool wait_peer(int sock, char expected) {
  char got = 0;
  return ::read(sock, &got, 1) == 1 && got == expected;
}

std::unique_ptr<caching_allocator> make_allocator(const std::shared_ptr<sim_backend>& sim) {
  auto alloc = std::make_unique<caching_allocator>(sim, allocator_config::parse("expandable_segments:True"));
  alloc->init(sim->device_count());
  return alloc;
}

void fill(void* p, std::size_t bytes, unsigned char seed) {
  auto* b = static_cast<unsigned char*>(p);
  for (std::size_t i = 0; i < bytes; i += 4096) b[i] = static_cast<unsigned char>(seed + i / 4096);
}
bool filled(const void* p, std::size_t bytes, unsigned char seed) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < bytes; i += 4096)
    if (b[i] != static_cast<unsigned char>(seed + i / 4096)) return false;
  return true;
}

// The exporter's side: a device whose reservation holds a 20 MiB block
// before the exported one, so that the exported block (3 MiB at offset
// 21 MiB: pages 10 and 11) is a small part of a large reservation.
class IpcExpandableTest : public ::testing::Test {
 protected:
  void SetUp() override {
    sim_options o;
    o.capacity_bytes = 256 * MiB;
    sim = std::make_shared<sim_backend>(o);
    alloc = make_allocator(sim);
    before = alloc->malloc(0, 21 * MiB, 0);
    p = alloc->malloc(0, 3 * MiB, 0);
    fill(p, 3 * MiB, 1);
  }
  void TearDown() override {
    if (before != nullptr) alloc->free(before);
  }

  // Forks an importer that runs `body(sock)` and exits with its result;
  // sends it this process's handle of `p` first.
  template <class Body>
  pid_t fork_importer(Body body) {
    int sv[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv), 0);
    const pid_t child = ::fork();
    if (child == 0) {
      ::close(sv[0]);
      ::_exit(body(sv[1]));
    }
    ::close(sv[1]);
    sock = sv[0];
    ipc_export ex = alloc->share_ipc_handle(p);
    send_ipc_handle(sock, ex);
    close_all(ex.fds);
    return child;
  }
  int exit_code(pid_t child) {
    int status = 0;
    if (::waitpid(child, &status, 0) != child) return -1;
    ::close(sock);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 100 + WTERMSIG(status);
  }

  std::shared_ptr<sim_backend> sim;
  std::unique_ptr<caching_allocator> alloc;
  void* before = nullptr;
  void* p = nullptr;
  int sock = -1;
};

// An importer: receives the handle, opens it in a fresh allocator, checks
// what it maps, then follows `script` (see the tests). Exit codes: 0 passed,
// 10 receive, 11 open, 12 reserved more than the block's pages, 13 bytes,
// 14 the exporter's write not seen, 15 close, 16 the peer went away.
enum class script { close_at_the_end, hold_until_killed };
int importer(int sock, script what) {
  try {
    ipc_export got = receive_ipc_handle(sock);
    auto sim = std::make_shared<sim_backend>();
    auto alloc = make_allocator(sim);
    void* q = nullptr;
    try {
      q = alloc->open_ipc_handle(got.handle, got.fds);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "importer: %s\n", e.what());
      return 11;
    }
    close_all(got.fds);
    const ipc_handle h = parse_ipc_handle(got.handle);
    // Only the block's pages are reserved and mapped, never the reservation.
    if (sim->counters().reserved_address_bytes != h.pages.size() * h.page_bytes) return 12;
    if (sim->counters().mapped_bytes != h.pages.size() * h.page_bytes) return 12;
    if (!filled(q, h.size_bytes, 1)) return 13;
    fill(q, h.size_bytes, 50);  // the answer
    signal_peer(sock, 'o');     // opened and answered
    if (what == script::hold_until_killed) {
      for (;;) ::pause();
    }
    if (!wait_peer(sock, 'w')) return 16;  // the exporter wrote and freed its block
    if (!filled(q, h.size_bytes, 90)) return 14;
    alloc->close_ipc_handle(q);
    if (alloc->ipc_open_mappings() != 0 || sim->counters().reserved_address_bytes != 0) return 15;
    signal_peer(sock, 'c');
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "importer: %s\n", e.what());
    return 10;
  }
}

TEST_F(IpcExpandableTest, EveryShareOfABlockGivesTheSameHandle) {
  ipc_export a = alloc->share_ipc_handle(p);
  ipc_export b = alloc->share_ipc_handle(p);
  EXPECT_EQ(a.handle, b.handle);
  ASSERT_EQ(a.fds.size(), 3u) << "two pages and the lease";
  EXPECT_NE(a.fds, b.fds) << "each share hands out descriptors of its own";
  const ipc_handle h = parse_ipc_handle(a.handle);
  EXPECT_EQ(h.first_page, 10u);
  EXPECT_EQ(h.pages.size(), 2u);
  EXPECT_GE(h.segment_bytes, 24 * MiB) << "the block is a small part of its reservation";
  close_all(a.fds);
  close_all(b.fds);
  const std::vector<ipc_export_info> exports = alloc->ipc_exports();
  ASSERT_EQ(exports.size(), 1u);
  EXPECT_EQ(exports[0].ptr, p);
  EXPECT_EQ(exports[0].size_bytes, 3 * MiB);
  EXPECT_EQ(exports[0].importers, 0u);
  EXPECT_FALSE(exports[0].owner_freed);
  // Nobody holds it: the free is immediate and the export ends with it.
  alloc->free(p);
  EXPECT_TRUE(alloc->ipc_exports().empty());
  EXPECT_EQ(alloc->device_allocator(0).stats().allocated_bytes[0].current, 21 * MiB);
}

TEST_F(IpcExpandableTest, HandleOfABlockFreedBeforeItWasOpenedIsRefused) {
  ipc_export ex = alloc->share_ipc_handle(p);
  alloc->free(p);  // no importer yet: freed now, the export revoked
  const auto before_open = sim->counters();
  try {
    (void)alloc->open_ipc_handle(ex.handle, ex.fds);
    ADD_FAILURE() << "opened a revoked export";
  } catch (const backend_error& e) {
    EXPECT_NE(std::string(e.what()).find("the producer has freed the block"), std::string::npos) << e.what();
  }
  EXPECT_EQ(alloc->ipc_open_mappings(), 0u);
  EXPECT_EQ(sim->counters().live_reservations, before_open.live_reservations);
  EXPECT_EQ(sim->counters().vm_imports, before_open.vm_imports) << "refused before any page is imported";
  close_all(ex.fds);
}

TEST_F(IpcExpandableTest, OwnersFreeWaitsForTheImporterAndEmptyCacheKeepsThePages) {
  const pid_t child = fork_importer([](int s) { return importer(s, script::close_at_the_end); });
  ASSERT_TRUE(wait_peer(sock, 'o')) << "the importer did not open the handle";
  EXPECT_TRUE(filled(p, 3 * MiB, 50)) << "the importer's write is in the exporter's block";
  fill(p, 3 * MiB, 90);  // seen by the importer
  ASSERT_EQ(alloc->ipc_exports().size(), 1u);
  EXPECT_EQ(alloc->ipc_exports()[0].importers, 1u);

  alloc->free(p);  // held: deferred
  std::vector<ipc_export_info> exports = alloc->ipc_exports();
  ASSERT_EQ(exports.size(), 1u);
  EXPECT_TRUE(exports[0].owner_freed);
  EXPECT_EQ(exports[0].importers, 1u);
  EXPECT_THROW(alloc->free(p), invalid_argument_error) << "freed once already";
  EXPECT_THROW((void)alloc->share_ipc_handle(p), invalid_argument_error);
  alloc->free(before);
  before = nullptr;
  alloc->empty_cache();
  EXPECT_EQ(alloc->reclaim_ipc_exports(), 0u);
  EXPECT_EQ(alloc->device_allocator(0).stats().allocated_bytes[0].current, 3 * MiB) << "still allocated";
  EXPECT_EQ(sim->counters().mapped_bytes, 2 * page) << "empty_cache released all but the exported pages";
  // A new block cannot take the exported pages.
  void* other = alloc->malloc(0, 3 * MiB, 0);
  EXPECT_TRUE(U(other) + 3 * MiB <= U(p) || U(other) >= U(p) + 3 * MiB);
  alloc->free(other);

  signal_peer(sock, 'w');
  ASSERT_TRUE(wait_peer(sock, 'c')) << "the importer did not close";
  EXPECT_EQ(exit_code(child), 0) << "importer exit codes: 10 receive, 11 open, 12 reserved, 13 bytes, "
                                    "14 exporter's write, 15 close, 16 peer gone";
  EXPECT_EQ(alloc->reclaim_ipc_exports(), 1u);
  EXPECT_TRUE(alloc->ipc_exports().empty());
  alloc->empty_cache();
  EXPECT_EQ(sim->counters().mapped_bytes, 0u);
  EXPECT_EQ(sim->counters().used_bytes, 0u);
  alloc->device_allocator(0).check_invariants();
}

TEST_F(IpcExpandableTest, ImporterKilledWithoutClosingGivesItsHoldBack) {
  const pid_t child = fork_importer([](int s) { return importer(s, script::hold_until_killed); });
  ASSERT_TRUE(wait_peer(sock, 'o'));
  alloc->free(p);
  alloc->empty_cache();
  EXPECT_EQ(alloc->reclaim_ipc_exports(), 0u) << "the importer runs and holds the block";
  ASSERT_EQ(::kill(child, SIGKILL), 0);
  // Wait until it has ended but leave it unreaped: a zombie holds nothing.
  siginfo_t info{};
  ASSERT_EQ(::waitid(P_PID, static_cast<id_t>(child), &info, WEXITED | WNOWAIT), 0);
  EXPECT_EQ(alloc->ipc_exports().at(0).importers, 0u) << "a zombie is not a holder";
  EXPECT_EQ(alloc->reclaim_ipc_exports(), 1u);
  EXPECT_EQ(exit_code(child), 100 + SIGKILL);
  alloc->free(before);
  before = nullptr;
  alloc->empty_cache();
  EXPECT_EQ(sim->counters().used_bytes, 0u);
}

// Forks an exporter: the child makes an allocator with a 5 MiB block and
// then a `bytes`-byte block filled from `seed`, runs
// body(sock, alloc, p, before) and exits with its result. Returns the
// child's pid (-1 when fork failed); *sock is this process's end.
template <class Body>
pid_t fork_exporter(int* sock, std::size_t bytes, unsigned char seed, Body body) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv) != 0) return -1;
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(sv[0]);
    auto alloc = make_allocator(std::make_shared<sim_backend>());
    void* before = alloc->malloc(0, 5 * MiB, 0);
    void* p = alloc->malloc(0, bytes, 0);
    fill(p, bytes, seed);
    ::_exit(body(sv[1], alloc, p, before));
  }
  ::close(sv[1]);
  *sock = sv[0];
  return child;
}

// The exporter ends while the importer has the block open: the importer's
// mapping stays valid, bytes included (CUDA keeps exported memory alive
// while an importer holds it), and it closes without error. Two ways to
// end: the exporter frees the block and destroys its allocator (every page
// released) before exiting, or it is killed.
class IpcExporterExitTest : public ::testing::TestWithParam<bool> {};

TEST_P(IpcExporterExitTest, ImportersMappingOutlivesTheExporter) {
  const bool killed = GetParam();
  int sock = -1;
  const pid_t child = fork_exporter(&sock, 6 * MiB, 7, [killed](int s, auto& alloc, void* p, void* before) {
    ipc_export ex = alloc->share_ipc_handle(p);
    send_ipc_handle(s, ex);
    close_all(ex.fds);
    if (!wait_peer(s, 'o')) return 16;
    if (killed) ::raise(SIGKILL);
    alloc->free(p);
    alloc->free(before);
    alloc.reset();  // releases every page, the exported ones too
    return 0;
  });
  ASSERT_GE(child, 0);
  auto sim = std::make_shared<sim_backend>();
  auto alloc = make_allocator(sim);
  ipc_export got = receive_ipc_handle(sock);
  void* q = alloc->open_ipc_handle(got.handle, got.fds);
  close_all(got.fds);
  signal_peer(sock, 'o');
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ::close(sock);
  if (killed) {
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  } else {
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0);
  }
  EXPECT_TRUE(filled(q, 6 * MiB, 7)) << "the bytes survive the exporter";
  fill(q, 6 * MiB, 8);
  EXPECT_TRUE(filled(q, 6 * MiB, 8));
  alloc->close_ipc_handle(q);
  EXPECT_EQ(alloc->ipc_open_mappings(), 0u);
  EXPECT_EQ(sim->counters().live_handles, 0u);
  EXPECT_EQ(sim->counters().live_reservations, 0u);
}

// The handle as bytes alone (share_ipc_handle_pidfd): the importer takes
// the exporter's descriptors with pidfd_getfd. The exporter is the child
// (an ancestor may take a descendant's descriptors under every ptrace
// policy); once it has freed the block, the same bytes are refused.
TEST(IpcPidfd, HandleAsBytesAloneOpensInAnotherProcessUntilTheBlockIsFreed) {
  int sock = -1;
  const pid_t child = fork_exporter(&sock, 3 * MiB, 21, [](int s, auto& alloc, void* p, void* before) {
    const std::string bytes = alloc->share_ipc_handle_pidfd(p);
    if (alloc->share_ipc_handle_pidfd(p) != bytes) return 2;  // stable too
    if (::send(s, bytes.data(), bytes.size(), 0) != static_cast<ssize_t>(bytes.size())) return 3;
    if (!wait_peer(s, 'o')) return 4;  // opened, checked and closed
    alloc->free(p);                    // nobody holds it: freed, its descriptors closed
    alloc->free(before);
    signal_peer(s, 'f');
    return wait_peer(s, 'x') ? 0 : 5;
  });
  ASSERT_GE(child, 0);
  std::string bytes(64 * 1024, '\0');
  const ssize_t got = ::recv(sock, bytes.data(), bytes.size(), 0);
  ASSERT_GT(got, 0);
  bytes.resize(static_cast<std::size_t>(got));
  EXPECT_EQ(bytes.substr(0, 8), "ccIPCpfd");
  auto sim = std::make_shared<sim_backend>();
  auto alloc = make_allocator(sim);
  void* q = nullptr;
  try {
    q = alloc->open_ipc_handle_pidfd(bytes);
  } catch (const backend_error& e) {
    signal_peer(sock, 'o');
    signal_peer(sock, 'x');
    ::waitpid(child, nullptr, 0);
    if (std::string(e.what()).find("pidfd_open") != std::string::npos ||
        std::string(e.what()).find("Operation not permitted") != std::string::npos)
      GTEST_SKIP() << "this kernel or sandbox refuses pidfd: " << e.what();
    FAIL() << e.what();
  }
  EXPECT_TRUE(filled(q, 3 * MiB, 21));
  EXPECT_EQ(sim->counters().reserved_address_bytes, 2 * page) << "only the block's pages";
  EXPECT_EQ(alloc->open_ipc_handle_pidfd(bytes), q) << "the cached mapping";
  alloc->close_ipc_handle(q);
  alloc->close_ipc_handle(q);
  signal_peer(sock, 'o');
  ASSERT_TRUE(wait_peer(sock, 'f'));
  try {
    (void)alloc->open_ipc_handle_pidfd(bytes);
    ADD_FAILURE() << "opened the bytes of a freed block";
  } catch (const backend_error& e) {
    EXPECT_NE(std::string(e.what()).find("the exporter has freed the block"), std::string::npos) << e.what();
  }
  EXPECT_EQ(alloc->ipc_open_mappings(), 0u);
  EXPECT_THROW((void)alloc->open_ipc_handle_pidfd("ccIPCpfd"), invalid_argument_error);
  EXPECT_THROW((void)alloc->open_ipc_handle_pidfd(bytes.substr(0, 20)), invalid_argument_error);
  signal_peer(sock, 'x');
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ::close(sock);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

INSTANTIATE_TEST_SUITE_P(FreedOrKilled, IpcExporterExitTest, ::testing::Values(false, true),
                         [](const auto& param_info) { return param_info.param ? "Killed" : "FreedAndDestroyed"; });

}  // namespace
