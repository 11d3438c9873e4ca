// The C API of inter-process sharing (include/ccalloc/ccalloc.h, SPEC F25,
// C3) on the simulated device: share, send and receive over a Unix socket,
// open, the deferred free while a consumer holds the block, close, reclaim,
// and the status codes. The consumer is this process (an expandable block
// may be opened by its own process); tests/ipc_expandable_test.cpp covers
// two processes.
#include <ccalloc/ccalloc.h>

#include <gtest/gtest.h>

#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <string>

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

// A 64 MiB simulated device with expandable segments, initialized.
ccalloc_allocator_t* make_allocator() {
  ccalloc_options_t o;
  ccalloc_options_init(&o);
  o.backend = CCALLOC_BACKEND_SIM;
  o.sim_capacity_bytes = 64 * MiB;
  o.config = "expandable_segments:True";
  ccalloc_allocator_t* a = nullptr;
  EXPECT_EQ(ccalloc_create(&o, &a), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(ccalloc_init(a, 1), CCALLOC_OK);
  return a;
}

TEST(CapiIpc, ShareSendOpenDeferredFreeCloseReclaim) {
  ccalloc_allocator_t* a = make_allocator();
  ASSERT_NE(a, nullptr);
  void* p = nullptr;
  ASSERT_EQ(ccalloc_malloc(a, 0, 3 * MiB, nullptr, &p), CCALLOC_OK);
  std::memset(p, 0x5a, 3 * MiB);

  ccalloc_ipc_export_t ex{};
  ASSERT_EQ(ccalloc_share_ipc_handle(a, p, &ex), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(ex.fd_count, 3u) << "two pages and the lease";
  ccalloc_ipc_export_t again{};
  ASSERT_EQ(ccalloc_share_ipc_handle(a, p, &again), CCALLOC_OK);
  ASSERT_EQ(again.handle_bytes, ex.handle_bytes);
  EXPECT_EQ(std::memcmp(again.handle, ex.handle, ex.handle_bytes), 0) << "the same handle every time";
  ccalloc_ipc_export_free(&again, 1);
  EXPECT_EQ(again.handle, nullptr);

  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv), 0);
  // The emptied export is refused and sends nothing: the receive below gets ex.
  EXPECT_EQ(ccalloc_send_ipc_handle(sv[0], &again), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(ccalloc_last_error(),
               "ccalloc: send_ipc_handle: the export holds no handle (0 bytes: emptied by ccalloc_ipc_export_free, "
               "or never filled in by a share); send what a share returned");
  ASSERT_EQ(ccalloc_send_ipc_handle(sv[0], &ex), CCALLOC_OK) << ccalloc_last_error();
  ccalloc_ipc_export_free(&ex, 1);
  ccalloc_ipc_export_t got{};
  ASSERT_EQ(ccalloc_receive_ipc_handle(sv[1], &got), CCALLOC_OK) << ccalloc_last_error();
  ::close(sv[0]);
  ::close(sv[1]);
  void* q = nullptr;
  ASSERT_EQ(ccalloc_open_ipc_handle(a, got.handle, got.handle_bytes, got.fds, got.fd_count, -1, &q), CCALLOC_OK)
      << ccalloc_last_error();
  ccalloc_ipc_export_free(&got, 1);
  EXPECT_NE(q, p);
  EXPECT_EQ(static_cast<unsigned char*>(q)[3 * MiB - 1], 0x5a);

  std::size_t importers = 9;
  int owner_freed = 9;
  ASSERT_EQ(ccalloc_ipc_export_status(a, p, &importers, &owner_freed), CCALLOC_OK);
  EXPECT_EQ(importers, 1u);
  EXPECT_EQ(owner_freed, 0);
  ASSERT_EQ(ccalloc_delete(a, p), CCALLOC_OK);  // held: deferred
  ASSERT_EQ(ccalloc_ipc_export_status(a, p, &importers, &owner_freed), CCALLOC_OK);
  EXPECT_EQ(owner_freed, 1);
  std::size_t freed = 9;
  ASSERT_EQ(ccalloc_reclaim_ipc_exports(a, &freed), CCALLOC_OK);
  EXPECT_EQ(freed, 0u);
  static_cast<unsigned char*>(q)[0] = 0x11;  // still the consumer's to use

  ASSERT_EQ(ccalloc_close_ipc_handle(a, q), CCALLOC_OK);
  ASSERT_EQ(ccalloc_reclaim_ipc_exports(a, &freed), CCALLOC_OK);
  EXPECT_EQ(freed, 1u);
  EXPECT_EQ(ccalloc_ipc_export_status(a, p, &importers, nullptr), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ccalloc_last_error()).find("not an exported expandable block"), std::string::npos);
  EXPECT_EQ(ccalloc_close_ipc_handle(a, q), CCALLOC_ERROR_INVALID_ARGUMENT);
  ccalloc_destroy(a);
}

TEST(CapiIpc, HandleAsBytesAloneSizesThenOpens) {
  ccalloc_allocator_t* a = make_allocator();
  ASSERT_NE(a, nullptr);
  void* p = nullptr;
  ASSERT_EQ(ccalloc_malloc(a, 0, MiB, nullptr, &p), CCALLOC_OK);
  std::memset(p, 0x4d, MiB);
  std::size_t length = 0;
  ASSERT_EQ(ccalloc_share_ipc_handle_pidfd(a, p, nullptr, 0, &length), CCALLOC_OK) << ccalloc_last_error();
  ASSERT_GT(length, 8u + 4u);
  std::string bytes(length, '\0');
  std::size_t again = 0;
  ASSERT_EQ(ccalloc_share_ipc_handle_pidfd(a, p, bytes.data(), bytes.size(), &again), CCALLOC_OK);
  EXPECT_EQ(again, length);
  EXPECT_EQ(bytes.substr(0, 8), "ccIPCpfd");
  void* q = nullptr;
  const ccalloc_status_t opened = ccalloc_open_ipc_handle_pidfd(a, bytes.data(), bytes.size(), -1, &q);
  if (opened != CCALLOC_OK && std::string(ccalloc_last_error()).find("pidfd") != std::string::npos) {
    ccalloc_destroy(a);
    GTEST_SKIP() << "pidfd refused here: " << ccalloc_last_error();
  }
  ASSERT_EQ(opened, CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(static_cast<unsigned char*>(q)[MiB - 1], 0x4d);
  EXPECT_EQ(ccalloc_close_ipc_handle(a, q), CCALLOC_OK);
  EXPECT_EQ(ccalloc_share_ipc_handle_pidfd(a, p, nullptr, 4, &length), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(ccalloc_last_error(), "ccalloc: ccalloc_share_ipc_handle_pidfd: buffer (with capacity > 0) is NULL");
  EXPECT_EQ(ccalloc_open_ipc_handle_pidfd(a, "xy", 2, -1, &q), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(ccalloc_delete(a, p), CCALLOC_OK);
  ccalloc_destroy(a);
}

TEST(CapiIpc, BadArgumentsNameWhatIsWrong) {
  ccalloc_ipc_export_t ex{};
  EXPECT_EQ(ccalloc_share_ipc_handle(nullptr, nullptr, nullptr), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(ccalloc_last_error(), "ccalloc: ccalloc_share_ipc_handle: out is NULL");
  void* out = nullptr;
  EXPECT_EQ(ccalloc_open_ipc_handle(nullptr, "garbage", 7, nullptr, 0, -1, &out), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ccalloc_last_error()).find("ipc handle: "), std::string::npos) << ccalloc_last_error();
  EXPECT_EQ(ccalloc_open_ipc_handle(nullptr, "x", 1, nullptr, 2, -1, &out), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(ccalloc_last_error(), "ccalloc: ccalloc_open_ipc_handle: fds is NULL");
  EXPECT_EQ(ccalloc_send_ipc_handle(-1, &ex), CCALLOC_ERROR_INVALID_ARGUMENT) << "an empty export, before the socket";
  EXPECT_NE(std::string(ccalloc_last_error()).find("send_ipc_handle: the export holds no handle"), std::string::npos)
      << ccalloc_last_error();
  EXPECT_EQ(ccalloc_receive_ipc_handle(-1, &ex), CCALLOC_ERROR_BACKEND);
  EXPECT_NE(std::string(ccalloc_last_error()).find("recvmsg failed"), std::string::npos) << ccalloc_last_error();
  ccalloc_ipc_export_free(nullptr, 1);  // nothing
}

}  // namespace
