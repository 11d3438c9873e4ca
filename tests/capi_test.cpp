// capi_test.cpp: the C API (include/ccalloc/ccalloc.h) on the simulated
// device: every function, its status codes and messages, and the PyTorch
// entry points on the process-wide allocator (which is the simulated device on
// a machine without a GPU, and the GPU otherwise; the checks below hold on
// both). The policies behind the calls are tested in allocator_test.cpp and
// expandable_test.cpp; here the expected figures come from the same rules:
// sizes round to 512 bytes; in the default configuration (expandable
// segments) each (stream, pool) has one address-space reservation as large as
// the device, and reserved bytes are the 2 MiB pages mapped in it; with plain
// segments (ccalloc::pytorch_policies, as PyTorch) requests of at most 1 MiB
// get a 2 MiB segment and requests of 1-10 MiB a 20 MiB one.
#include <ccalloc/ccalloc.h>

#include <ccalloc/base/errors.hpp>
#include <ccalloc/core/config.hpp>
#include <ccalloc/core/stats.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <unistd.h>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
/// The page size of expandable segments: the simulated device's granularity
/// (CUDA's on the GPUs ccalloc targets, the H200 among them).
constexpr std::size_t page_bytes = 2 * MiB;

std::string pointer_text(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}

/// A simulated-device allocator made through the C API, initialized,
/// destroyed at scope exit.
struct sim_allocator {
  ccalloc_allocator_t* handle = nullptr;
  explicit sim_allocator(std::size_t capacity_bytes = 0, const char* config = "", int devices = 1) {
    ccalloc_options_t o;
    ccalloc_options_init(&o);
    o.backend = CCALLOC_BACKEND_SIM;
    o.sim_capacity_bytes = capacity_bytes;
    o.sim_device_count = devices;
    o.config = config;
    EXPECT_EQ(ccalloc_create(&o, &handle), CCALLOC_OK) << ccalloc_last_error();
    EXPECT_EQ(ccalloc_init(handle, devices), CCALLOC_OK) << ccalloc_last_error();
  }
  ~sim_allocator() { ccalloc_destroy(handle); }
  sim_allocator(const sim_allocator&) = delete;
  sim_allocator& operator=(const sim_allocator&) = delete;
  operator ccalloc_allocator_t*() const { return handle; }  // NOLINT: test helper
};

std::int64_t stat(ccalloc_allocator_t* a, const char* name, int device = 0) {
  std::int64_t v = -12345;
  EXPECT_EQ(ccalloc_get_device_stat(a, device, name, &v), CCALLOC_OK) << ccalloc_last_error();
  return v;
}

void* must_malloc(ccalloc_allocator_t* a, std::size_t bytes, ccalloc_stream_t stream = nullptr, int device = 0) {
  void* p = nullptr;
  EXPECT_EQ(ccalloc_malloc(a, device, bytes, stream, &p), CCALLOC_OK) << ccalloc_last_error();
  return p;
}

/// Size in bytes of an expandable segment's reservation on `device`: the
/// device's total memory rounded up to whole pages.
std::size_t reservation_bytes(ccalloc_allocator_t* a, int device = 0) {
  std::size_t free_bytes = 0, total_bytes = 0;
  EXPECT_EQ(ccalloc_mem_get_info(a, device, &free_bytes, &total_bytes), CCALLOC_OK) << ccalloc_last_error();
  return (total_bytes + page_bytes - 1) / page_bytes * page_bytes;
}

/// Whether the process-wide allocator uses expandable segments: the default
/// (the simulated device has virtual memory, and so do the GPUs ccalloc
/// targets) unless CCALLOC_CONF sets expandable_segments:False.
bool process_wide_expandable() {
  std::size_t length = 0;
  EXPECT_EQ(ccalloc_get_config(nullptr, nullptr, 0, &length), CCALLOC_OK) << ccalloc_last_error();
  std::string text(length, '?');
  EXPECT_EQ(ccalloc_get_config(nullptr, text.data(), length + 1, &length), CCALLOC_OK) << ccalloc_last_error();
  return text.find("expandable_segments:False") == std::string::npos;
}

TEST(CApi, IdentityAndStatusNames) {
  EXPECT_STREQ(ccalloc_name(), "ccalloc");
  EXPECT_FALSE(std::string(ccalloc_version()).empty());
  EXPECT_NE(std::string(ccalloc_version()), "unknown");
  EXPECT_STREQ(ccalloc_status_name(CCALLOC_OK), "CCALLOC_OK");
  EXPECT_STREQ(ccalloc_status_name(CCALLOC_ERROR_OUT_OF_MEMORY), "CCALLOC_ERROR_OUT_OF_MEMORY");
  EXPECT_STREQ(ccalloc_status_name(CCALLOC_ERROR_CONFIG), "CCALLOC_ERROR_CONFIG");
  EXPECT_STREQ(ccalloc_status_name(static_cast<ccalloc_status_t>(99)), "CCALLOC_STATUS_UNKNOWN");
  EXPECT_TRUE(ccalloc_built_with_cuda() == 0 || ccalloc_built_with_cuda() == 1);
}

TEST(CApi, CreateInitAndDescribe) {
  ccalloc_options_t o;
  ccalloc_options_init(&o);
  EXPECT_EQ(o.struct_size, sizeof(ccalloc_options_t));
  EXPECT_EQ(o.backend, CCALLOC_BACKEND_DEFAULT);
  EXPECT_EQ(o.sim_device_count, 1);
  EXPECT_EQ(o.config, nullptr);
  o.backend = CCALLOC_BACKEND_SIM;
  o.sim_device_count = 2;
  o.sim_capacity_bytes = 256 * MiB;
  o.config = "";
  ccalloc_allocator_t* a = nullptr;
  ASSERT_EQ(ccalloc_create(&o, &a), CCALLOC_OK) << ccalloc_last_error();
  int flag = -1;
  EXPECT_EQ(ccalloc_initialized(a, &flag), CCALLOC_OK);
  EXPECT_EQ(flag, 0);
  int count = 0;
  EXPECT_EQ(ccalloc_device_count(a, &count), CCALLOC_OK);
  EXPECT_EQ(count, 2);
  const char* name = nullptr;
  EXPECT_EQ(ccalloc_backend_name(a, &name), CCALLOC_OK);
  EXPECT_STREQ(name, "sim");
  std::size_t free_bytes = 0, total_bytes = 0;
  EXPECT_EQ(ccalloc_mem_get_info(a, 1, &free_bytes, &total_bytes), CCALLOC_OK);
  EXPECT_EQ(total_bytes, 256 * MiB);
  EXPECT_EQ(free_bytes, 256 * MiB);
  EXPECT_EQ(ccalloc_mem_get_info(a, 2, &free_bytes, &total_bytes), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ccalloc_last_error()).find("device 2 is out of range"), std::string::npos);

  // Before init: a clear error.
  void* p = reinterpret_cast<void*>(0x1);
  EXPECT_EQ(ccalloc_malloc(a, 0, 512, nullptr, &p), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(p, reinterpret_cast<void*>(0x1)) << "outputs are unchanged on error";
  // The message names the C functions, not the C++ ones.
  EXPECT_EQ(std::string(ccalloc_last_error()),
            "ccalloc: malloc before ccalloc_init(): call ccalloc_init(alloc, device_count) first");

  EXPECT_EQ(ccalloc_init(a, 3), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(std::string(ccalloc_last_error()).starts_with("ccalloc: ccalloc_init(3): the 'sim' backend has"))
      << ccalloc_last_error();
  EXPECT_EQ(ccalloc_init(a, 0), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(ccalloc_init(a, 2), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(ccalloc_initialized(a, &flag), CCALLOC_OK);
  EXPECT_EQ(flag, 1);
  p = must_malloc(a, 4096, nullptr, 1);
  EXPECT_NE(p, nullptr);
  EXPECT_EQ(stat(a, "allocated_bytes.all.current", 1), 4096);
  EXPECT_EQ(stat(a, "allocated_bytes.all.current", 0), 0);
  EXPECT_EQ(ccalloc_mem_get_info(a, 1, &free_bytes, &total_bytes), CCALLOC_OK);
  EXPECT_EQ(free_bytes, 254 * MiB) << "one 2 MiB page of the small pool's reservation";
  ccalloc_destroy(a);  // with a live pointer: its memory goes back with the backend
  ccalloc_destroy(nullptr);  // no-op
}

TEST(CApi, CreateRejectsBadOptions) {
  ccalloc_allocator_t* a = reinterpret_cast<ccalloc_allocator_t*>(0x1);
  ccalloc_options_t o;
  ccalloc_options_init(&o);
  o.backend = CCALLOC_BACKEND_SIM;
  o.sim_device_count = 0;
  EXPECT_EQ(ccalloc_create(&o, &a), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ccalloc_last_error()).find("sim_device_count is 0"), std::string::npos);
  o.sim_device_count = 1;
  o.backend = static_cast<ccalloc_backend_kind_t>(7);
  EXPECT_EQ(ccalloc_create(&o, &a), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ccalloc_last_error()).find("unknown backend kind 7"), std::string::npos);
  o.backend = CCALLOC_BACKEND_SIM;
  o.config = "max_split_size_mb:lots";
  EXPECT_EQ(ccalloc_create(&o, &a), CCALLOC_ERROR_CONFIG);
  EXPECT_NE(std::string(ccalloc_last_error()).find("max_split_size_mb"), std::string::npos) << ccalloc_last_error();
  o.config = nullptr;
  o.struct_size = 3;
  EXPECT_EQ(ccalloc_create(&o, &a), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ccalloc_last_error()).find("ccalloc_options_init"), std::string::npos);
  EXPECT_EQ(a, reinterpret_cast<ccalloc_allocator_t*>(0x1)) << "no handle on failure";
  EXPECT_EQ(ccalloc_create(nullptr, nullptr), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ccalloc_last_error()).find("out is NULL"), std::string::npos);
  if (ccalloc_built_with_cuda() == 0) {
    o.struct_size = sizeof o;
    o.backend = CCALLOC_BACKEND_CUDA;
    EXPECT_EQ(ccalloc_create(&o, &a), CCALLOC_ERROR_BACKEND);
    EXPECT_NE(std::string(ccalloc_last_error()).find("without the CUDA backend"), std::string::npos);
  }
}

TEST(CApi, MallocDeleteAndStatisticsByPyTorchNames) {
  sim_allocator a;  // the default configuration: expandable segments
  // 1 MiB + 1 byte: rounds to 1 MiB + 512, large pool. The large pool's
  // reservation for the default stream is made, and one 2 MiB page of it is
  // mapped: that page is all that is reserved.
  void* p = must_malloc(a, MiB + 1);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 512, 0u);
  EXPECT_EQ(stat(a, "allocated_bytes.all.current"), static_cast<std::int64_t>(MiB + 512));
  EXPECT_EQ(stat(a, "allocated_bytes.large_pool.current"), static_cast<std::int64_t>(MiB + 512));
  EXPECT_EQ(stat(a, "requested_bytes.all.current"), static_cast<std::int64_t>(MiB + 1));
  EXPECT_EQ(stat(a, "reserved_bytes.all.current"), static_cast<std::int64_t>(page_bytes)) << "one page mapped";
  EXPECT_EQ(stat(a, "segment.large_pool.current"), 1) << "one reservation";
  EXPECT_EQ(stat(a, "segment.small_pool.current"), 0);
  EXPECT_EQ(stat(a, "allocation.all.current"), 1);
  EXPECT_EQ(stat(a, "num_device_alloc"), 1) << "one physical page";
  EXPECT_EQ(stat(a, "max_split_size"), -1);

  // All statistics at once, in ccalloc_stat_name order.
  const std::size_t n = ccalloc_stat_count();
  EXPECT_EQ(n, ccalloc::device_stats{}.to_map().size());
  std::vector<std::int64_t> values(n, -1);
  ASSERT_EQ(ccalloc_get_device_stats(a, 0, values.data(), values.size()), CCALLOC_OK) << ccalloc_last_error();
  std::vector<std::string> names;
  for (std::size_t i = 0; i < n; ++i) names.emplace_back(ccalloc_stat_name(i));
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  const auto at = [&](const std::string& key) {
    const auto it = std::find(names.begin(), names.end(), key);
    EXPECT_NE(it, names.end()) << key;
    return it == names.end() ? -1 : values[static_cast<std::size_t>(it - names.begin())];
  };
  EXPECT_EQ(at("reserved_bytes.all.peak"), static_cast<std::int64_t>(page_bytes));
  EXPECT_EQ(at("allocated_bytes.all.allocated"), static_cast<std::int64_t>(MiB + 512));
  EXPECT_EQ(at("num_ooms"), 0);
  EXPECT_EQ(ccalloc_stat_name(n), nullptr);
  EXPECT_EQ(ccalloc_get_device_stats(a, 0, values.data(), n - 1), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ccalloc_last_error()).find("less than ccalloc_stat_count()"), std::string::npos);
  std::int64_t v = 7;
  EXPECT_EQ(ccalloc_get_device_stat(a, 0, "reserved_bytes.all.highest", &v), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ccalloc_last_error()).find("'reserved_bytes.all.highest'"), std::string::npos);
  EXPECT_EQ(v, 7);
  EXPECT_EQ(ccalloc_get_device_stat(a, 1, "num_ooms", &v), CCALLOC_ERROR_INVALID_ARGUMENT);

  // Free: the block is cached, its page stays mapped until empty_cache.
  ASSERT_EQ(ccalloc_delete(a, p), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(stat(a, "allocated_bytes.all.current"), 0);
  EXPECT_EQ(stat(a, "reserved_bytes.all.current"), static_cast<std::int64_t>(page_bytes));
  std::size_t largest = 0;
  EXPECT_EQ(ccalloc_cache_info(a, 0, &largest), CCALLOC_OK);
  EXPECT_EQ(largest, page_bytes) << "the whole mapped page is free";

  // 12 MiB grows the same reservation: the cached page plus 5 new ones, so
  // 12 MiB reserved (plain segments would keep the whole 20 MiB segment).
  void* q = must_malloc(a, 12 * MiB);
  EXPECT_EQ(q, p) << "from the reservation's start, where the mapped page is";
  EXPECT_EQ(stat(a, "reserved_bytes.all.current"), static_cast<std::int64_t>(12 * MiB));
  EXPECT_EQ(stat(a, "num_device_alloc"), 6);
  EXPECT_EQ(stat(a, "segment.large_pool.current"), 1) << "still one reservation";
  EXPECT_EQ(ccalloc_cache_info(a, 0, &largest), CCALLOC_OK);
  EXPECT_EQ(largest, 0u) << "every mapped byte is in use";
  ASSERT_EQ(ccalloc_delete(a, q), CCALLOC_OK) << ccalloc_last_error();

  // empty_cache unmaps the 6 pages and releases the reservation left empty.
  EXPECT_EQ(ccalloc_empty_cache(a), CCALLOC_OK);
  EXPECT_EQ(stat(a, "reserved_bytes.all.current"), 0);
  EXPECT_EQ(stat(a, "reserved_bytes.all.peak"), static_cast<std::int64_t>(12 * MiB));
  EXPECT_EQ(stat(a, "num_device_free"), 6);
  EXPECT_EQ(stat(a, "segment.large_pool.current"), 0);
  EXPECT_EQ(ccalloc_cache_info(a, 0, &largest), CCALLOC_OK);
  EXPECT_EQ(largest, 0u);

  // Size 0: NULL and OK. Deleting NULL: OK.
  void* z = reinterpret_cast<void*>(0x1);
  EXPECT_EQ(ccalloc_malloc(a, 0, 0, nullptr, &z), CCALLOC_OK);
  EXPECT_EQ(z, nullptr);
  EXPECT_EQ(ccalloc_delete(a, nullptr), CCALLOC_OK);
}

TEST(CApi, PyTorchPoliciesGivePlainSegments) {
  // ccalloc::pytorch_policies pins expandable_segments:False (among others):
  // this test is about plain segments and their sizes, which follow PyTorch's
  // allocator in its default configuration.
  sim_allocator a(0, ccalloc::pytorch_policies);
  // 1 MiB + 1 byte: large pool, one 20 MiB segment, one device malloc.
  void* p = must_malloc(a, MiB + 1);
  EXPECT_EQ(stat(a, "reserved_bytes.all.current"), static_cast<std::int64_t>(20 * MiB));
  EXPECT_EQ(stat(a, "segment.large_pool.current"), 1);
  EXPECT_EQ(stat(a, "num_device_alloc"), 1);
  // 2 MiB: split from the same segment; get_base_allocation gives the segment.
  void* q = must_malloc(a, 2 * MiB);
  void* base = nullptr;
  std::size_t size = 0;
  ASSERT_EQ(ccalloc_get_base_allocation(a, q, &base, &size), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(base, p) << "both in one 20 MiB segment, p first";
  EXPECT_EQ(size, 20 * MiB);
  EXPECT_EQ(stat(a, "num_device_alloc"), 1);
  // 3000 bytes: small pool, its own 2 MiB segment.
  void* r = must_malloc(a, 3000);
  ASSERT_EQ(ccalloc_get_base_allocation(a, r, &base, &size), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(base, r);
  EXPECT_EQ(size, 2 * MiB);
  EXPECT_EQ(stat(a, "reserved_bytes.all.current"), static_cast<std::int64_t>(22 * MiB));
  EXPECT_EQ(stat(a, "segment.all.current"), 2);
  EXPECT_EQ(stat(a, "num_device_alloc"), 2);
  for (void* x : {p, q, r}) ASSERT_EQ(ccalloc_delete(a, x), CCALLOC_OK) << ccalloc_last_error();
  // Cached whole: the largest free block is the 20 MiB segment.
  EXPECT_EQ(stat(a, "reserved_bytes.all.current"), static_cast<std::int64_t>(22 * MiB));
  std::size_t largest = 0;
  EXPECT_EQ(ccalloc_cache_info(a, 0, &largest), CCALLOC_OK);
  EXPECT_EQ(largest, 20 * MiB);
  EXPECT_EQ(ccalloc_empty_cache(a), CCALLOC_OK);
  EXPECT_EQ(stat(a, "reserved_bytes.all.current"), 0);
  EXPECT_EQ(stat(a, "num_device_free"), 2);
  EXPECT_EQ(stat(a, "segment.all.current"), 0);
}

TEST(CApi, BadPointersAreNamedAndChangeNothing) {
  sim_allocator a;
  void* p = must_malloc(a, 4096);
  ASSERT_EQ(ccalloc_delete(a, p), CCALLOC_OK);
  const std::int64_t freed = stat(a, "allocation.all.freed");
  EXPECT_EQ(ccalloc_delete(a, p), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ccalloc_last_error()).find(pointer_text(p)), std::string::npos) << ccalloc_last_error();
  EXPECT_EQ(stat(a, "allocation.all.freed"), freed);

  // A pointer of another allocator is unknown here.
  sim_allocator b;
  void* q = must_malloc(b, 4096);
  EXPECT_EQ(ccalloc_delete(a, q), CCALLOC_ERROR_INVALID_ARGUMENT);
  void* base = nullptr;
  std::size_t size = 0;
  EXPECT_EQ(ccalloc_get_base_allocation(a, q, &base, &size), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ccalloc_last_error()).find(pointer_text(q)), std::string::npos);
  EXPECT_EQ(ccalloc_delete(b, q), CCALLOC_OK) << ccalloc_last_error();

  // NULL outputs are named.
  EXPECT_EQ(ccalloc_malloc(a, 0, 512, nullptr, nullptr), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(ccalloc_last_error(), "ccalloc: ccalloc_malloc: out is NULL");
  EXPECT_EQ(ccalloc_cache_info(a, 0, nullptr), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(ccalloc_last_error(), "ccalloc: ccalloc_cache_info: largest_block_bytes is NULL");
  EXPECT_EQ(ccalloc_malloc(a, 1, 512, nullptr, &p), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ccalloc_last_error()).find("device 1 is not initialized"), std::string::npos);
}

TEST(CApi, LastErrorIsPerThread) {
  sim_allocator a;
  EXPECT_EQ(ccalloc_set_config(a, "no_such_key:1"), CCALLOC_ERROR_CONFIG);
  const std::string mine = ccalloc_last_error();
  EXPECT_NE(mine.find("no_such_key"), std::string::npos) << mine;
  std::string theirs_before, theirs_after;
  std::thread t([&] {
    theirs_before = ccalloc_last_error();
    EXPECT_EQ(ccalloc_set_memory_fraction(a, 0, -1.0), CCALLOC_ERROR_INVALID_ARGUMENT);
    theirs_after = ccalloc_last_error();
  });
  t.join();
  EXPECT_EQ(theirs_before, "");
  EXPECT_NE(theirs_after.find("outside [0, 1]"), std::string::npos) << theirs_after;
  EXPECT_EQ(std::string(ccalloc_last_error()), mine);
  // A successful call leaves the message as it was.
  EXPECT_EQ(ccalloc_empty_cache(a), CCALLOC_OK);
  EXPECT_EQ(std::string(ccalloc_last_error()), mine);
}

TEST(CApi, OutOfMemoryReportsAndCallsObservers) {
  sim_allocator a(64 * MiB);
  struct seen_t {
    int calls = 0;
    int device = -1;
    std::size_t requested = 0, allowed = 0, free_bytes = 0;
  } seen;
  const auto observer = [](void* user, int device, std::size_t requested, std::size_t allowed,
                           std::size_t free_bytes) {
    auto* s = static_cast<seen_t*>(user);
    ++s->calls;
    s->device = device;
    s->requested = requested;
    s->allowed = allowed;
    s->free_bytes = free_bytes;
  };
  EXPECT_EQ(ccalloc_attach_out_of_memory_observer(a, nullptr, nullptr), CCALLOC_ERROR_INVALID_ARGUMENT);
  ASSERT_EQ(ccalloc_attach_out_of_memory_observer(a, observer, &seen), CCALLOC_OK);
  void* p = reinterpret_cast<void*>(0x1);
  EXPECT_EQ(ccalloc_malloc(a, 0, 100 * MiB, nullptr, &p), CCALLOC_ERROR_OUT_OF_MEMORY);
  EXPECT_EQ(p, reinterpret_cast<void*>(0x1));
  EXPECT_NE(std::string(ccalloc_last_error()).find("out of memory"), std::string::npos) << ccalloc_last_error();
  EXPECT_EQ(seen.calls, 1);
  EXPECT_EQ(seen.device, 0);
  EXPECT_EQ(seen.requested, 100 * MiB);
  EXPECT_EQ(seen.allowed, 64 * MiB);
  EXPECT_EQ(seen.free_bytes, 64 * MiB);
  EXPECT_EQ(stat(a, "num_ooms"), 1);
  // 1 EiB fails at once, also an OOM.
  EXPECT_EQ(ccalloc_malloc(a, 0, std::size_t{1} << 60, nullptr, &p), CCALLOC_ERROR_OUT_OF_MEMORY);
  EXPECT_EQ(stat(a, "num_ooms"), 2);
  // The allocator keeps working.
  p = must_malloc(a, 40 * MiB);
  EXPECT_NE(p, nullptr);
  EXPECT_EQ(ccalloc_delete(a, p), CCALLOC_OK);
  // reset_accumulated_stats zeroes the event counters.
  EXPECT_EQ(ccalloc_reset_accumulated_stats(a, 0), CCALLOC_OK);
  EXPECT_EQ(stat(a, "num_ooms"), 0);
  EXPECT_EQ(stat(a, "allocation.all.allocated"), 0);
}

// An observer that allocates, and fails again, is not called for its own
// out-of-memory error: one call per failing request, not a recursion that
// ends when the stack does (the observer below stops itself at depth 8 so
// that the old behaviour fails the test instead of crashing it).
TEST(CApi, AnObserverThatRunsOutOfMemoryIsNotCalledAgain) {
  sim_allocator a(64 * MiB);
  struct seen_t {
    ccalloc_allocator_t* alloc = nullptr;
    int calls = 0;
    int depth = 0;
    std::vector<ccalloc_status_t> inner;
  } seen;
  seen.alloc = a;
  const auto observer = [](void* user, int, std::size_t, std::size_t, std::size_t) {
    auto* s = static_cast<seen_t*>(user);
    ++s->calls;
    if (s->depth == 8) return;
    ++s->depth;
    void* q = nullptr;
    s->inner.push_back(ccalloc_malloc(s->alloc, 0, 100 * MiB, nullptr, &q));
    --s->depth;
  };
  ASSERT_EQ(ccalloc_attach_out_of_memory_observer(a, observer, &seen), CCALLOC_OK);
  void* p = nullptr;
  EXPECT_EQ(ccalloc_malloc(a, 0, 100 * MiB, nullptr, &p), CCALLOC_ERROR_OUT_OF_MEMORY);
  EXPECT_EQ(seen.calls, 1);
  EXPECT_EQ(seen.inner, std::vector<ccalloc_status_t>{CCALLOC_ERROR_OUT_OF_MEMORY}) << "the observer's own malloc fails";
  EXPECT_EQ(stat(a, "num_ooms"), 2) << "both errors count";
  // The next failing request is observed again.
  EXPECT_EQ(ccalloc_malloc(a, 0, 100 * MiB, nullptr, &p), CCALLOC_ERROR_OUT_OF_MEMORY);
  EXPECT_EQ(seen.calls, 2);
}

TEST(CApi, MemoryFractionCapsReservedBytes) {
  sim_allocator a(64 * MiB);
  double f = -1;
  EXPECT_EQ(ccalloc_get_memory_fraction(a, 0, &f), CCALLOC_OK);
  EXPECT_EQ(f, 1.0);
  EXPECT_EQ(ccalloc_set_memory_fraction(a, 0, 0.5), CCALLOC_OK);
  EXPECT_EQ(ccalloc_get_memory_fraction(a, 0, &f), CCALLOC_OK);
  EXPECT_EQ(f, 0.5);
  EXPECT_EQ(ccalloc_set_memory_fraction(a, 0, 1.5), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ccalloc_last_error()).find("outside [0, 1]"), std::string::npos);
  EXPECT_EQ(ccalloc_get_memory_fraction(a, 0, &f), CCALLOC_OK);
  EXPECT_EQ(f, 0.5) << "unchanged after the rejected value";
  EXPECT_EQ(ccalloc_set_memory_fraction(a, 3, 0.5), CCALLOC_ERROR_INVALID_ARGUMENT);
  // 40 MiB fits the device (64 MiB) but not the cap (32 MiB).
  void* p = nullptr;
  EXPECT_EQ(ccalloc_malloc(a, 0, 40 * MiB, nullptr, &p), CCALLOC_ERROR_OUT_OF_MEMORY);
  p = must_malloc(a, 30 * MiB);
  EXPECT_NE(p, nullptr);
  EXPECT_EQ(ccalloc_delete(a, p), CCALLOC_OK);
}

TEST(CApi, ResetPeakStats) {
  sim_allocator a;
  void* p = must_malloc(a, 3 * MiB);
  void* q = must_malloc(a, 5 * MiB);
  ASSERT_EQ(ccalloc_delete(a, q), CCALLOC_OK);
  EXPECT_EQ(stat(a, "allocated_bytes.all.peak"), static_cast<std::int64_t>(8 * MiB));
  EXPECT_EQ(stat(a, "allocated_bytes.all.current"), static_cast<std::int64_t>(3 * MiB));
  EXPECT_EQ(ccalloc_reset_peak_stats(a, 0), CCALLOC_OK);
  EXPECT_EQ(stat(a, "allocated_bytes.all.peak"), static_cast<std::int64_t>(3 * MiB));
  EXPECT_EQ(ccalloc_reset_peak_stats(a, 1), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(ccalloc_delete(a, p), CCALLOC_OK);
}

TEST(CApi, ConfigurationSetGetAndErrors) {
  sim_allocator a(0, "max_split_size_mb:40");
  std::size_t length = 0;
  ASSERT_EQ(ccalloc_get_config(a, nullptr, 0, &length), CCALLOC_OK);
  std::string text(length, '?');
  ASSERT_EQ(ccalloc_get_config(a, text.data(), length + 1, &length), CCALLOC_OK);
  EXPECT_EQ(text.size(), length);
  EXPECT_NE(text.find("max_split_size_mb:40"), std::string::npos) << text;
  EXPECT_EQ(stat(a, "max_split_size"), static_cast<std::int64_t>(40 * MiB));

  ASSERT_EQ(ccalloc_set_config(a, "garbage_collection_threshold:0.5,per_process_memory_fraction:0.5"), CCALLOC_OK)
      << ccalloc_last_error();
  char small[8];
  std::memset(small, 'x', sizeof small);
  ASSERT_EQ(ccalloc_get_config(a, small, sizeof small, &length), CCALLOC_OK);
  EXPECT_GT(length, sizeof small) << "full length reported";
  EXPECT_EQ(std::strlen(small), sizeof small - 1) << "truncated and terminated";
  std::string full(length, '?');
  ASSERT_EQ(ccalloc_get_config(a, full.data(), length + 1, &length), CCALLOC_OK);
  EXPECT_EQ(std::string(small), full.substr(0, sizeof small - 1));
  EXPECT_NE(full.find("garbage_collection_threshold:0.5"), std::string::npos) << full;
  EXPECT_NE(full.find("max_split_size_mb:40"), std::string::npos) << "earlier keys kept: " << full;
  double f = 0;
  EXPECT_EQ(ccalloc_get_memory_fraction(a, 0, &f), CCALLOC_OK);
  EXPECT_EQ(f, 0.5);

  EXPECT_EQ(ccalloc_set_config(a, "roundup_power2_divisions:3"), CCALLOC_ERROR_CONFIG);
  EXPECT_NE(std::string(ccalloc_last_error()).find("roundup_power2_divisions"), std::string::npos);
  std::string after(length, '?');
  ASSERT_EQ(ccalloc_get_config(a, after.data(), length + 1, &length), CCALLOC_OK);
  EXPECT_EQ(after, full) << "unchanged after a bad string";
  EXPECT_EQ(ccalloc_set_config(a, nullptr), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(ccalloc_get_config(a, nullptr, 4, &length), CCALLOC_ERROR_INVALID_ARGUMENT);
}

// The C API's configuration warnings carry the CLI's prefix too.
TEST(CApi, ConfigurationWarningsUseTheCcallocWarningPrefix) {
  const std::string expected =
      "ccalloc: warning: ccalloc config: garbage_collection_threshold:0.6 is set without per_process_memory_fraction";
  testing::internal::CaptureStderr();
  { const sim_allocator a(0, "garbage_collection_threshold:0.6"); }
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(err.rfind(expected, 0), 0u) << err;
}

// Each set_config prints the warnings it adds, not again those of the
// settings before it.
TEST(CApi, SetConfigPrintsOnlyTheWarningsItAdds) {
  const sim_allocator a(0, "");
  const std::string gc = "ccalloc: warning: ccalloc config: garbage_collection_threshold:0.6 is set without";
  const std::string pinned = "ccalloc: warning: ccalloc config: pinned_num_register_threads:2 has no effect";
  const auto set = [&](const char* text) {
    testing::internal::CaptureStderr();
    EXPECT_EQ(ccalloc_set_config(a, text), CCALLOC_OK) << ccalloc_last_error();
    return testing::internal::GetCapturedStderr();
  };
  std::string err = set("garbage_collection_threshold:0.6");
  EXPECT_EQ(err.rfind(gc, 0), 0u) << err;
  err = set("pinned_num_register_threads:2");
  EXPECT_EQ(err.rfind(pinned, 0), 0u) << err;
  EXPECT_EQ(err.find("garbage_collection_threshold"), std::string::npos) << "printed again: " << err;
  err = set("roundup_power2_divisions:4");
  EXPECT_EQ(err, "") << "nothing new to warn about";
}

TEST(CApi, NoCachingMode) {
  sim_allocator a;
  int on = -1;
  EXPECT_EQ(ccalloc_is_enabled(a, &on), CCALLOC_OK);
  EXPECT_EQ(on, 1);
  ASSERT_EQ(ccalloc_enable(a, 0), CCALLOC_OK);
  EXPECT_EQ(ccalloc_is_enabled(a, &on), CCALLOC_OK);
  EXPECT_EQ(on, 0);
  void* p = must_malloc(a, 3 * MiB);
  EXPECT_EQ(stat(a, "reserved_bytes.all.current"), static_cast<std::int64_t>(3 * MiB)) << "a segment of the request's size";
  ASSERT_EQ(ccalloc_delete(a, p), CCALLOC_OK);
  EXPECT_EQ(stat(a, "reserved_bytes.all.current"), 0) << "straight back to the device";
  EXPECT_EQ(ccalloc_enable(a, 1), CCALLOC_OK);
  EXPECT_EQ(ccalloc_is_enabled(a, &on), CCALLOC_OK);
  EXPECT_EQ(on, 1);
}

TEST(CApi, StreamsRecordStreamAndBaseAllocation) {
  sim_allocator a;
  ccalloc_stream_t s = nullptr;
  ASSERT_EQ(ccalloc_stream_create(a, 0, &s), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_NE(s, nullptr);
  void* p = must_malloc(a, 2 * MiB, s);
  void* q = must_malloc(a, 2 * MiB, s);
  EXPECT_EQ(q, static_cast<char*>(p) + 2 * MiB) << "the next page of s's large-pool reservation";
  // The base allocation of an expandable segment is its whole reservation
  // (the simulated device's 141 GB rounded up to 2 MiB pages), p first.
  void* base = nullptr;
  std::size_t size = 0;
  ASSERT_EQ(ccalloc_get_base_allocation(a, q, &base, &size), CCALLOC_OK);
  EXPECT_EQ(base, p);
  EXPECT_EQ(size, reservation_bytes(a));
  EXPECT_EQ(size, std::size_t{67235} * page_bytes);
  // Used on the default stream too; the simulated stream has no work queued,
  // so the event completes at once and the block is reusable after the free.
  EXPECT_EQ(ccalloc_record_stream(a, p, nullptr), CCALLOC_OK);
  EXPECT_EQ(ccalloc_record_stream(a, static_cast<char*>(q) + 4096, nullptr), CCALLOC_OK) << "a view (SPEC X4)";
  EXPECT_EQ(ccalloc_record_stream(a, reinterpret_cast<void*>(0x1000), nullptr), CCALLOC_OK) << "not ours: ignored";
  EXPECT_EQ(ccalloc_record_stream(a, nullptr, nullptr), CCALLOC_OK);
  ASSERT_EQ(ccalloc_delete(a, p), CCALLOC_OK);
  ASSERT_EQ(ccalloc_delete(a, q), CCALLOC_OK);
  EXPECT_EQ(ccalloc_stream_synchronize(a, 0, s), CCALLOC_OK);
  void* again = must_malloc(a, 2 * MiB, s);
  EXPECT_EQ(again, p) << "reused on its stream once the events completed";
  EXPECT_EQ(stat(a, "active.all.current"), 1);
  // The default stream has a reservation of its own (one per stream and pool).
  void* other = must_malloc(a, 2 * MiB);
  ASSERT_EQ(ccalloc_get_base_allocation(a, other, &base, &size), CCALLOC_OK);
  EXPECT_EQ(base, other);
  EXPECT_NE(base, p);
  EXPECT_EQ(size, reservation_bytes(a));
  EXPECT_EQ(stat(a, "segment.large_pool.current"), 2);
  // A new page would set a new peak of reserved bytes, so the free page of
  // s's reservation (where q was) is unmapped there and mapped here instead
  // (trim_on_new_peak, default True): no new physical page, none freed.
  EXPECT_EQ(stat(a, "num_device_alloc"), 2);
  EXPECT_EQ(stat(a, "num_device_free"), 0);
  EXPECT_EQ(stat(a, "reserved_bytes.all.current"), static_cast<std::int64_t>(4 * MiB));
  EXPECT_EQ(stat(a, "reserved_bytes.all.peak"), static_cast<std::int64_t>(4 * MiB));
  EXPECT_EQ(ccalloc_delete(a, other), CCALLOC_OK);
  EXPECT_EQ(ccalloc_delete(a, again), CCALLOC_OK);
  EXPECT_EQ(ccalloc_stream_destroy(a, 0, s), CCALLOC_OK);
}

/// Every statistic of `device`, by name.
std::vector<std::pair<std::string, std::int64_t>> all_stats(ccalloc_allocator_t* a, int device = 0) {
  std::vector<std::int64_t> v(ccalloc_stat_count());
  EXPECT_EQ(ccalloc_get_device_stats(a, device, v.data(), v.size()), CCALLOC_OK) << ccalloc_last_error();
  std::vector<std::pair<std::string, std::int64_t>> out;
  for (std::size_t i = 0; i < v.size(); ++i) out.emplace_back(ccalloc_stat_name(i), v[i]);
  return out;
}

std::string stream_text(ccalloc_stream_t s) { return std::to_string(reinterpret_cast<std::uintptr_t>(s)); }

// A stream destroyed (ccalloc_stream_destroy) while blocks of it are live, or
// recorded on it: the destroy waits for its work, and the blocks are freed
// later without recording anything on it (it was "stream ... is not a
// stream", INVALID_ARGUMENT, and the block leaked).
TEST(CApi, BlocksOutliveTheirDestroyedStream) {
  for (const char* config : {"", "expandable_segments:False"}) {
    SCOPED_TRACE(config);
    sim_allocator a(0, config);
    ccalloc_stream_t s1 = nullptr, s2 = nullptr;
    ASSERT_EQ(ccalloc_stream_create(a, 0, &s1), CCALLOC_OK) << ccalloc_last_error();
    ASSERT_EQ(ccalloc_stream_create(a, 0, &s2), CCALLOC_OK) << ccalloc_last_error();
    void* p = must_malloc(a, 1000, s1);
    void* q = must_malloc(a, 3 * MiB, s1);
    ASSERT_EQ(ccalloc_record_stream(a, q, s2), CCALLOC_OK);
    ASSERT_EQ(ccalloc_stream_destroy(a, 0, s1), CCALLOC_OK) << ccalloc_last_error();
    EXPECT_EQ(ccalloc_delete(a, p), CCALLOC_OK) << ccalloc_last_error();
    EXPECT_EQ(ccalloc_delete(a, q), CCALLOC_OK) << ccalloc_last_error();
    EXPECT_EQ(stat(a, "allocated_bytes.all.current"), 0);
    // A malloc on the destroyed stream is refused, naming it; nothing changes
    // (q's event on s2 stays pending: the refused malloc processes nothing).
    const auto before = all_stats(a);
    void* r = nullptr;
    ASSERT_EQ(ccalloc_malloc(a, 0, 1000, s1, &r), CCALLOC_ERROR_INVALID_ARGUMENT);
    const std::string msg = ccalloc_last_error();
    EXPECT_NE(msg.find("malloc on stream " + stream_text(s1) + " of device 0, which is not a live stream"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("destroyed"), std::string::npos) << msg;
    EXPECT_EQ(all_stats(a), before);
    // A block of a live stream recorded on a stream that is then destroyed:
    // its free waits for no event (the destroy waited for the stream's
    // work), so the next malloc of its size on its stream gets it back.
    void* t = must_malloc(a, 2000);
    ASSERT_EQ(ccalloc_record_stream(a, t, s2), CCALLOC_OK);
    ASSERT_EQ(ccalloc_stream_destroy(a, 0, s2), CCALLOC_OK) << ccalloc_last_error();
    EXPECT_EQ(ccalloc_delete(a, t), CCALLOC_OK) << ccalloc_last_error();
    EXPECT_EQ(must_malloc(a, 2000), t);
    EXPECT_EQ(stat(a, "allocated_bytes.all.current"), 2048);
    EXPECT_EQ(ccalloc_delete(a, t), CCALLOC_OK);
    // Destroying it again, or the default stream, is refused.
    EXPECT_EQ(ccalloc_stream_destroy(a, 0, s2), CCALLOC_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(ccalloc_last_error()).find("stream " + stream_text(s2)), std::string::npos);
    EXPECT_EQ(ccalloc_stream_destroy(a, 0, nullptr), CCALLOC_ERROR_INVALID_ARGUMENT);
    EXPECT_EQ(ccalloc_empty_cache(a), CCALLOC_OK);
    EXPECT_EQ(stat(a, "reserved_bytes.all.current"), 0) << "every block came back to the cache";
  }
}

// A stream handle that was never created is refused at malloc, naming it
// (it was accepted, and its delete failed and leaked the block).
TEST(CApi, MallocOnAStreamNeverCreatedIsRefused) {
  sim_allocator a;
  const auto before = all_stats(a);
  auto* bogus = reinterpret_cast<ccalloc_stream_t>(std::uintptr_t{0x1234});
  void* p = reinterpret_cast<void*>(1);
  EXPECT_EQ(ccalloc_malloc(a, 0, 100, bogus, &p), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(ccalloc_last_error()),
            "ccalloc: malloc on stream 4660 of device 0, which is not a live stream of that device (never created, "
            "or destroyed)");
  EXPECT_EQ(all_stats(a), before);
  // Made now, it is accepted.
  ccalloc_stream_t s = nullptr;
  ASSERT_EQ(ccalloc_stream_create(a, 0, &s), CCALLOC_OK);
  void* q = must_malloc(a, 100, s);
  EXPECT_EQ(ccalloc_delete(a, q), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(ccalloc_stream_destroy(a, 0, s), CCALLOC_OK);
}

// record_stream on a stream that is not live for the block's device
// (destroyed, never created, another device's) is refused, naming the
// stream, and changes nothing: the block frees as usual afterwards (it was
// accepted, and every delete then failed on the stream and leaked the block;
// seventh session's hostile-input trial, D4). Views inside the block too.
TEST(CApi, RecordStreamOnAStreamThatIsNotLiveIsRefused) {
  for (const char* config : {"", "expandable_segments:False"}) {
    SCOPED_TRACE(config);
    sim_allocator a(0, config, 2);
    ccalloc_stream_t gone = nullptr, live = nullptr, other = nullptr;
    ASSERT_EQ(ccalloc_stream_create(a, 0, &gone), CCALLOC_OK) << ccalloc_last_error();
    ASSERT_EQ(ccalloc_stream_create(a, 0, &live), CCALLOC_OK) << ccalloc_last_error();
    ASSERT_EQ(ccalloc_stream_create(a, 1, &other), CCALLOC_OK) << ccalloc_last_error();
    ASSERT_EQ(ccalloc_delete(a, must_malloc(a, 1000, gone)), CCALLOC_OK);  // the allocator has met it
    ASSERT_EQ(ccalloc_stream_destroy(a, 0, gone), CCALLOC_OK) << ccalloc_last_error();
    auto* never = reinterpret_cast<ccalloc_stream_t>(std::uintptr_t{0x7777});
    void* q = must_malloc(a, 3 * MiB);
    const auto before = all_stats(a);
    const std::pair<ccalloc_stream_t, const char*> bad[] = {
        {gone, "(never created, destroyed, or of another device)"},
        {never, "(never created, destroyed, or of another device)"},
        {other, "(never created, destroyed, or of another device)"}};
    for (const auto& [s, why] : bad) {
      SCOPED_TRACE(stream_text(s));
      for (void* ptr : {q, static_cast<void*>(static_cast<char*>(q) + 4096)}) {  // the block, a view inside it
        EXPECT_EQ(ccalloc_record_stream(a, ptr, s), CCALLOC_ERROR_INVALID_ARGUMENT);
        EXPECT_EQ(std::string(ccalloc_last_error()), "ccalloc: record_stream on stream " + stream_text(s) +
                                                         " of device 0, which is not a live stream of that device " +
                                                         why);
      }
    }
    EXPECT_EQ(all_stats(a), before);
    // The block's own stream (the legacy default stream) and a live stream are accepted.
    EXPECT_EQ(ccalloc_record_stream(a, q, nullptr), CCALLOC_OK) << ccalloc_last_error();
    EXPECT_EQ(ccalloc_record_stream(a, q, live), CCALLOC_OK) << ccalloc_last_error();
    EXPECT_EQ(ccalloc_delete(a, q), CCALLOC_OK) << ccalloc_last_error();
    EXPECT_EQ(stat(a, "allocated_bytes.all.current"), 0);
    // A block of device 1 recorded on a stream of device 0.
    void* r = must_malloc(a, 4096, other, 1);
    EXPECT_EQ(ccalloc_record_stream(a, r, live), CCALLOC_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(ccalloc_last_error()).find("stream " + stream_text(live) + " of device 1, which is not"),
              std::string::npos)
        << ccalloc_last_error();
    EXPECT_EQ(ccalloc_delete(a, r), CCALLOC_OK) << ccalloc_last_error();
    EXPECT_EQ(ccalloc_empty_cache(a), CCALLOC_OK);
    EXPECT_EQ(stat(a, "reserved_bytes.all.current"), 0) << "every block came back to the cache";
    EXPECT_EQ(stat(a, "reserved_bytes.all.current", 1), 0);
    EXPECT_EQ(ccalloc_stream_destroy(a, 0, live), CCALLOC_OK);
    EXPECT_EQ(ccalloc_stream_destroy(a, 1, other), CCALLOC_OK);
  }
}

/// A malloc of `size` bytes that must fail with OUT_OF_MEMORY at once: its
/// message names the size, and no statistic but num_ooms moves. Returns
/// the message.
std::string refused_at_once(ccalloc_allocator_t* a, std::size_t size) {
  auto before = all_stats(a);
  void* p = nullptr;
  EXPECT_EQ(ccalloc_malloc(a, 0, size, nullptr, &p), CCALLOC_ERROR_OUT_OF_MEMORY);
  const std::string msg = ccalloc_last_error();
  EXPECT_NE(msg.find("(" + std::to_string(size) + " bytes; "), std::string::npos) << msg;
  for (auto& [name, value] : before)
    if (name == "num_ooms") ++value;
  EXPECT_EQ(all_stats(a), before) << "the cache kept, nothing counted but the OOM";
  return msg;
}

// Requests that can never fit fail at once: the cache is kept (no
// synchronization, nothing released), no counter but num_ooms moves, and
// the message names the size (SIZE_MAX no longer wraps to "0 bytes").
TEST(CApi, RequestsLargerThanTheDeviceFailAtOnceAndChangeNothing) {
  constexpr std::size_t GiB = std::size_t{1} << 30;
  const std::size_t sizes[] = {SIZE_MAX, (std::size_t{1} << 60) - 1, std::size_t{1} << 40, 8 * GiB + 1};
  for (const char* config : {"", "expandable_segments:False"}) {
    SCOPED_TRACE(config);
    sim_allocator a(8 * GiB, config);
    void* live = must_malloc(a, 1000);
    void* cached = must_malloc(a, 5 * MiB);
    ASSERT_EQ(ccalloc_delete(a, cached), CCALLOC_OK);
    for (const std::size_t size : sizes) {
      SCOPED_TRACE(size);
      const std::string msg = refused_at_once(a, size);
      EXPECT_EQ(msg.find("0 bytes of pages"), std::string::npos) << msg;
      if (size >= (std::size_t{1} << 60))
        EXPECT_NE(msg.find("requests of 1048576.00 TiB or more are refused at once"), std::string::npos) << msg;
      else
        EXPECT_NE(msg.find("The request alone is larger than the device's memory."), std::string::npos) << msg;
    }
    EXPECT_EQ(ccalloc_delete(a, live), CCALLOC_OK);
  }
}

// A large request that cannot fit even with the whole cache returned (the
// device's free memory plus the cached bytes) fails at once, the cache kept
// and nothing counted but the OOM (it was refused only after the cache was
// emptied and, with expandable segments, 924 pages mapped and unmapped;
// seventh session's hostile-input trial, D6). One that fits once the cache
// is returned is served (PyTorch's retry).
TEST(CApi, ARequestThatCannotFitWithTheCacheReturnedFailsAtOnce) {
  constexpr std::size_t GiB = std::size_t{1} << 30;
  for (const char* config : {"", "expandable_segments:False"}) {
    SCOPED_TRACE(config);
    sim_allocator a(GiB, config);
    void* live = must_malloc(a, 100 * MiB);
    ASSERT_EQ(ccalloc_delete(a, must_malloc(a, 300 * MiB)), CCALLOC_OK);  // 300 MiB cached
    for (const std::size_t size : {GiB, GiB - 100 * MiB + 1}) {
      SCOPED_TRACE(size);
      const std::string msg = refused_at_once(a, size);
      EXPECT_NE(msg.find(" Returning the cache would not make room: the request is larger than the device's free "
                         "memory and all that ccalloc holds beyond its allocations together"),
                std::string::npos)
          << msg;
    }
    void* p = must_malloc(a, GiB - 100 * MiB);  // the cache returned: it fits
    EXPECT_NE(p, nullptr);
    EXPECT_EQ(stat(a, "reserved_bytes.all.current"), static_cast<std::int64_t>(GiB));
    EXPECT_EQ(ccalloc_delete(a, p), CCALLOC_OK);
    EXPECT_EQ(ccalloc_delete(a, live), CCALLOC_OK);
  }
}

// With a memory fraction, a request above what it allows fails at once too;
// the fraction prints as written (0.05, not 0.050000000000000003).
TEST(CApi, RequestsAboveTheMemoryFractionFailAtOnce) {
  sim_allocator a(4 * (std::size_t{1} << 30));
  void* keep = must_malloc(a, 100 * MiB);
  ASSERT_EQ(ccalloc_set_memory_fraction(a, 0, 0.05), CCALLOC_OK);
  auto before = all_stats(a);
  void* p = nullptr;
  ASSERT_EQ(ccalloc_malloc(a, 0, 300 * MiB, nullptr, &p), CCALLOC_ERROR_OUT_OF_MEMORY);
  const std::string msg = ccalloc_last_error();
  EXPECT_NE(msg.find("The per-process memory fraction 0.05 allows 204.80 MiB."), std::string::npos) << msg;
  EXPECT_NE(msg.find("The request alone is larger than the memory the fraction allows."), std::string::npos) << msg;
  for (auto& [name, value] : before)
    if (name == "num_ooms") ++value;
  EXPECT_EQ(all_stats(a), before);
  // Fraction 0: even 512 bytes can never fit; the reservation counters stay.
  ASSERT_EQ(ccalloc_set_memory_fraction(a, 0, 0.0), CCALLOC_OK);
  before = all_stats(a);
  ASSERT_EQ(ccalloc_malloc(a, 0, 512, nullptr, &p), CCALLOC_ERROR_OUT_OF_MEMORY);
  for (auto& [name, value] : before)
    if (name == "num_ooms") ++value;
  EXPECT_EQ(all_stats(a), before);
  EXPECT_EQ(ccalloc_delete(a, keep), CCALLOC_OK);
}

TEST(CApi, RawAllocUsesTheCurrentStream) {
  // trim_on_new_peak off: p's cached segment stays, so addresses tell streams apart.
  sim_allocator a(0, "trim_on_new_peak:False");
  const ccalloc_stream_t before = ccalloc_current_stream();
  ccalloc_stream_t s = nullptr;
  ASSERT_EQ(ccalloc_stream_create(a, 0, &s), CCALLOC_OK);
  ccalloc_set_current_stream(s);
  EXPECT_EQ(ccalloc_current_stream(), s);
  void* p = nullptr;
  ASSERT_EQ(ccalloc_raw_alloc(a, 4096, &p), CCALLOC_OK) << ccalloc_last_error();
  ASSERT_EQ(ccalloc_delete(a, p), CCALLOC_OK);
  // Blocks are bound to their stream: a request on the default stream gets
  // another block, one on `s` gets p back.
  void* on_default = nullptr;
  ASSERT_EQ(ccalloc_raw_alloc_with_stream(a, 4096, nullptr, &on_default), CCALLOC_OK);
  EXPECT_NE(on_default, p);
  void* on_s = nullptr;
  ASSERT_EQ(ccalloc_raw_alloc(a, 4096, &on_s), CCALLOC_OK);
  EXPECT_EQ(on_s, p);
  EXPECT_EQ(ccalloc_delete(a, on_s), CCALLOC_OK);
  EXPECT_EQ(ccalloc_delete(a, on_default), CCALLOC_OK);
  ccalloc_set_current_stream(before);
  EXPECT_EQ(ccalloc_stream_destroy(a, 0, s), CCALLOC_OK);
}

// ---- the process-wide allocator and PyTorch's entry points ----------------------------

TEST(CApiPyTorch, AllocAndFreeOnTheProcessWideAllocator) {
  int count = 0;
  ASSERT_EQ(ccalloc_device_count(nullptr, &count), CCALLOC_OK);
  EXPECT_GE(count, 1);
  int flag = 0;
  EXPECT_EQ(ccalloc_initialized(nullptr, &flag), CCALLOC_OK);
  EXPECT_EQ(flag, 1) << "initialized for every device on first use";
  const char* name = nullptr;
  EXPECT_EQ(ccalloc_backend_name(nullptr, &name), CCALLOC_OK);
  EXPECT_TRUE(std::string(name) == "sim" || std::string(name) == "cuda") << name;

  const std::int64_t before = stat(nullptr, "allocation.all.current");
  void* p = ccalloc_plugin_alloc(3000, 0, nullptr);
  ASSERT_NE(p, nullptr) << ccalloc_last_error();
  EXPECT_EQ(stat(nullptr, "allocation.all.current"), before + 1);
  void* base = nullptr;
  std::size_t size = 0;
  EXPECT_EQ(ccalloc_get_base_allocation(nullptr, p, &base, &size), CCALLOC_OK);
  std::size_t torch_size = 0;
  EXPECT_EQ(ccalloc_torch_base_alloc(p, &torch_size), base);
  EXPECT_EQ(torch_size, size);
  EXPECT_LE(base, p);
  EXPECT_LT(p, static_cast<char*>(base) + size);
  if (process_wide_expandable())
    EXPECT_EQ(size, reservation_bytes(nullptr)) << "the small pool's reservation";
  else
    EXPECT_EQ(size, 2 * MiB) << "a small-pool segment";
  ccalloc_torch_record_stream(p, nullptr);
  ccalloc_plugin_free(p, 3000, 0, nullptr);
  EXPECT_EQ(stat(nullptr, "allocation.all.current"), before);

  EXPECT_EQ(ccalloc_plugin_alloc(0, 0, nullptr), nullptr);
  EXPECT_EQ(ccalloc_plugin_alloc(std::size_t{1} << 62, 0, nullptr), nullptr);
  EXPECT_NE(std::string(ccalloc_last_error()).find("out of memory"), std::string::npos) << ccalloc_last_error();
  EXPECT_EQ(ccalloc_plugin_alloc(512, 99, nullptr), nullptr);
  EXPECT_NE(std::string(ccalloc_last_error()).find("device 99"), std::string::npos) << ccalloc_last_error();

  // A bad free is reported on stderr and kept, never thrown.
  testing::internal::CaptureStderr();
  ccalloc_plugin_free(p, 3000, 0, nullptr);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find(pointer_text(p)), std::string::npos) << err;
  EXPECT_NE(std::string(ccalloc_last_error()).find(pointer_text(p)), std::string::npos);
}

// The names before ccalloc_plugin_alloc / ccalloc_plugin_free stay exported
// and do the same (deprecated: "ccalloc_free" is not the free of ccalloc_malloc).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
TEST(CApiPyTorch, DeprecatedAllocAndFreeNamesStillWork) {
  const std::int64_t before = stat(nullptr, "allocation.all.current");
  void* p = ccalloc_alloc(3000, 0, nullptr);
  ASSERT_NE(p, nullptr) << ccalloc_last_error();
  EXPECT_EQ(stat(nullptr, "allocation.all.current"), before + 1);
  ccalloc_free(p, 3000, 0, nullptr);
  EXPECT_EQ(stat(nullptr, "allocation.all.current"), before);
  EXPECT_EQ(ccalloc_alloc(512, 99, nullptr), nullptr);
  EXPECT_NE(std::string(ccalloc_last_error()).find("device 99"), std::string::npos) << ccalloc_last_error();
}
#pragma GCC diagnostic pop

TEST(CApiPyTorch, HooksThrowWhatPyTorchTurnsIntoRuntimeError) {
  ccalloc_torch_init(1);
  EXPECT_THROW((void)ccalloc_torch_alloc(std::size_t{1} << 62, 0, nullptr), ccalloc::out_of_memory_error);
  try {
    (void)ccalloc_torch_alloc(512, 99, nullptr);
    ADD_FAILURE() << "no exception";
  } catch (const std::runtime_error& e) {  // what PyTorch catches (as std::exception)
    EXPECT_NE(std::string(e.what()).find("device 99"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ccalloc_torch_set_memory_fraction(1.5, 0), ccalloc::invalid_argument_error);
  EXPECT_THROW((void)ccalloc_torch_base_alloc(reinterpret_cast<void*>(0x1000), nullptr), ccalloc::invalid_argument_error);

  // Large pool: one 2 MiB page of the large pool's reservation (expandable
  // segments, the default), or a 20 MiB segment (plain segments).
  const std::size_t cached = process_wide_expandable() ? page_bytes : 20 * MiB;
  void* p = ccalloc_torch_alloc(MiB + 1, 0, nullptr);
  ASSERT_NE(p, nullptr);
  ccalloc_torch_free(p, MiB + 1, 0, nullptr);
  double f = 0;
  ccalloc_torch_set_memory_fraction(0.75, 0);
  EXPECT_EQ(ccalloc_get_memory_fraction(nullptr, 0, &f), CCALLOC_OK);
  EXPECT_EQ(f, 0.75);
  ccalloc_torch_set_memory_fraction(1.0, 0);
  // p's page (or segment) is cached now; empty_cache returns it.
  std::size_t largest = 0;
  EXPECT_EQ(ccalloc_cache_info(nullptr, 0, &largest), CCALLOC_OK);
  EXPECT_GE(largest, cached);
  const std::int64_t frees = stat(nullptr, "num_device_free");
  const std::int64_t reserved = stat(nullptr, "reserved_bytes.all.current");
  ccalloc_torch_empty_cache();
  EXPECT_GT(stat(nullptr, "num_device_free"), frees);
  EXPECT_LE(stat(nullptr, "reserved_bytes.all.current"), reserved - static_cast<std::int64_t>(cached));
}

}  // namespace

namespace {

// SPEC F13/F14/E4 through C: history on, a snapshot in PyTorch's layout.
TEST(CApiHistory, RecordHistoryAndSnapshotJson) {
  ccalloc_options_t o;
  ccalloc_options_init(&o);
  o.backend = CCALLOC_BACKEND_SIM;
  o.sim_capacity_bytes = std::size_t{1} << 30;
  ccalloc_allocator_t* a = nullptr;
  ASSERT_EQ(ccalloc_create(&o, &a), CCALLOC_OK) << ccalloc_last_error();
  ASSERT_EQ(ccalloc_init(a, 1), CCALLOC_OK);
  EXPECT_EQ(ccalloc_record_history(a, 1, 0), CCALLOC_ERROR_INVALID_ARGUMENT);
  ASSERT_EQ(ccalloc_record_history(a, 1, 1000), CCALLOC_OK) << ccalloc_last_error();
  void* p = nullptr;
  ASSERT_EQ(ccalloc_malloc(a, 0, 5u << 20, nullptr, &p), CCALLOC_OK);
  size_t length = 0;
  ASSERT_EQ(ccalloc_snapshot_json(a, 1, nullptr, 0, &length), CCALLOC_OK) << ccalloc_last_error();
  ASSERT_GT(length, 0u);
  std::string text(length + 1, '\0');
  ASSERT_EQ(ccalloc_snapshot_json(a, 1, text.data(), text.size(), &length), CCALLOC_OK);
  text.resize(length);
  EXPECT_NE(text.find("\"segments\""), std::string::npos);
  EXPECT_NE(text.find("\"device_traces\""), std::string::npos);
  EXPECT_NE(text.find("\"action\":\"alloc\""), std::string::npos) << text.substr(0, 400);
  EXPECT_NE(text.find("\"size\":" + std::to_string(5u << 20)), std::string::npos);
  EXPECT_EQ(ccalloc_snapshot_json(a, 1, nullptr, 16, &length), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(ccalloc_delete(a, p), CCALLOC_OK);
  EXPECT_EQ(ccalloc_record_history(a, 0, 1000), CCALLOC_OK);
  ccalloc_destroy(a);
}

// Contexts from a C recorder: handles counted in and out, frames only when a
// snapshot is written.
struct c_recorder_t {
  int recorded = 0;
  int released = 0;
  int symbolized = 0;
};

TEST(CApiHistory, RecordHistoryExTakesContextsWhenClearAndSkipActions) {
  ccalloc_options_t o;
  ccalloc_options_init(&o);
  o.backend = CCALLOC_BACKEND_SIM;
  o.config = "expandable_segments:False";
  ccalloc_allocator_t* a = nullptr;
  ASSERT_EQ(ccalloc_create(&o, &a), CCALLOC_OK) << ccalloc_last_error();
  ASSERT_EQ(ccalloc_init(a, 1), CCALLOC_OK);
  c_recorder_t r;
  ccalloc_history_options_t h;
  ccalloc_history_options_init(&h);
  EXPECT_EQ(h.enabled, 1);
  EXPECT_EQ(h.when, CCALLOC_RECORD_CONTEXT_ALL);
  EXPECT_EQ(h.max_entries, SIZE_MAX);
  h.when = CCALLOC_RECORD_CONTEXT_ALLOC;
  h.skip_actions = "segment_alloc, free_completed";
  h.user_data = &r;
  h.record = [](void* user) -> void* {
    auto* rec = static_cast<c_recorder_t*>(user);
    return reinterpret_cast<void*>(static_cast<std::uintptr_t>(++rec->recorded));
  };
  h.release = [](void* user, void*) { ++static_cast<c_recorder_t*>(user)->released; };
  h.frames = [](void* user, void* context, ccalloc_frame_sink_fn sink, void* sink_data) {
    ++static_cast<c_recorder_t*>(user)->symbolized;
    const std::string name = "site" + std::to_string(reinterpret_cast<std::uintptr_t>(context));
    sink(sink_data, name.c_str(), "c.py", 11);
    sink(sink_data, nullptr, nullptr, 0);
  };
  ASSERT_EQ(ccalloc_record_history_ex(a, &h), CCALLOC_OK) << ccalloc_last_error();
  void* p = nullptr;
  ASSERT_EQ(ccalloc_malloc(a, 0, 4096, nullptr, &p), CCALLOC_OK);
  void* q = nullptr;
  ASSERT_EQ(ccalloc_malloc(a, 0, 4096, nullptr, &q), CCALLOC_OK);
  EXPECT_EQ(ccalloc_delete(a, q), CCALLOC_OK);  // alloc mode: no context at free
  EXPECT_EQ(r.recorded, 2);
  EXPECT_EQ(r.symbolized, 0);
  size_t length = 0;
  ASSERT_EQ(ccalloc_snapshot_json(a, 1, nullptr, 0, &length), CCALLOC_OK);
  EXPECT_GT(r.symbolized, 0);
  std::string text(length + 4096, '\0');
  ASSERT_EQ(ccalloc_snapshot_json(a, 1, text.data(), text.size(), &length), CCALLOC_OK);
  text.resize(length);
  EXPECT_NE(text.find(R"({"name":"site1","filename":"c.py","line":11},{"name":"","filename":"","line":0})"),
            std::string::npos) << text.substr(0, 600);
  EXPECT_NE(text.find(R"("action":"alloc")"), std::string::npos);
  EXPECT_EQ(text.find(R"("action":"segment_alloc")"), std::string::npos) << "skipped";
  EXPECT_EQ(text.find(R"("action":"free_completed")"), std::string::npos) << "skipped";
  EXPECT_NE(text.find(R"("action":"free_requested")"), std::string::npos);
  // Bad arguments change nothing.
  ccalloc_history_options_t bad = h;
  bad.skip_actions = "alloc,allok";
  EXPECT_EQ(ccalloc_record_history_ex(a, &bad), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(ccalloc_last_error(),
               "ccalloc: ccalloc_record_history_ex: unknown action 'allok' in skip_actions (accepted: alloc, "
               "free_requested, free_completed, segment_alloc, segment_free, segment_map, segment_unmap, snapshot, "
               "oom, empty_cache)");
  bad = h;
  bad.when = 4;
  EXPECT_EQ(ccalloc_record_history_ex(a, &bad), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(ccalloc_record_history_ex(a, nullptr), CCALLOC_ERROR_INVALID_ARGUMENT);
  // clear drops the entries; the live block keeps its context (site1).
  h.clear = 1;
  ASSERT_EQ(ccalloc_record_history_ex(a, &h), CCALLOC_OK);
  EXPECT_EQ(r.released, 1) << "site2 went with the entries; site1 is held by p";
  EXPECT_EQ(ccalloc_delete(a, p), CCALLOC_OK);
  EXPECT_EQ(ccalloc_record_history(a, 0, 1000), CCALLOC_OK);
  EXPECT_EQ(r.released, r.recorded) << "every handle given back";
  ccalloc_destroy(a);
}

}  // namespace

namespace {

// ---- private pools through C (SPEC F20, F21, E5) ------------------------------------------------
//
// A pool's segments from a C segment allocator (the shape of cudaMalloc /
// ncclMemAlloc): here host memory, which the simulated device's allocator
// only keeps addresses of. The functions record how they were called.

constexpr std::size_t KiB = std::size_t{1} << 10;

struct host_segments_t {
  ccalloc_allocator_t* alloc = nullptr;  ///< whose current device the functions read
  int mallocs = 0;
  int frees = 0;
  int malloc_code = 0;          ///< nonzero: the next mallocs fail with it
  bool null_on_success = false; ///< return 0 and no pointer
  int free_code = 0;            ///< nonzero: the next frees fail with it
  std::vector<int> devices;     ///< the current device during each call
  std::vector<std::size_t> sizes;
  std::vector<void*> live;
};
host_segments_t host_segments;

int current_device_of(ccalloc_allocator_t* a) {
  int d = -1;
  EXPECT_EQ(ccalloc_current_device(a, &d), CCALLOC_OK) << ccalloc_last_error();
  return d;
}

extern "C" int host_segment_malloc(void** ptr, size_t size_bytes) {
  host_segments_t& h = host_segments;
  ++h.mallocs;
  h.devices.push_back(current_device_of(h.alloc));
  h.sizes.push_back(size_bytes);
  if (h.malloc_code != 0) return h.malloc_code;
  if (h.null_on_success) return 0;
  *ptr = std::aligned_alloc(4096, size_bytes);  // sizes are multiples of 2 MiB
  if (*ptr == nullptr) return 2;
  h.live.push_back(*ptr);
  return 0;
}

extern "C" int host_segment_free(void* ptr) {
  host_segments_t& h = host_segments;
  ++h.frees;
  h.devices.push_back(current_device_of(h.alloc));
  if (h.free_code != 0) return h.free_code;
  const auto it = std::find(h.live.begin(), h.live.end(), ptr);
  if (it == h.live.end()) return 99;  // not ours: the test fails on the code
  h.live.erase(it);
  std::free(ptr);
  return 0;
}

/// Resets host_segments for a test on allocator `a`.
void use_host_segments(ccalloc_allocator_t* a) {
  for (void* p : host_segments.live) std::free(p);
  host_segments = host_segments_t{};
  host_segments.alloc = a;
}

ccalloc_mempool_id_t new_pool(ccalloc_allocator_t* a) {
  ccalloc_mempool_id_t id{0, 7};
  EXPECT_EQ(ccalloc_new_pool_id(a, &id), CCALLOC_OK) << ccalloc_last_error();
  return id;
}

ccalloc_pool_usage_t usage(ccalloc_allocator_t* a, int device, ccalloc_mempool_id_t id) {
  ccalloc_pool_usage_t u{};
  u.use_count = -1;
  EXPECT_EQ(ccalloc_pool_usage(a, device, id, &u), CCALLOC_OK) << ccalloc_last_error();
  return u;
}

int use_count(ccalloc_allocator_t* a, int device, ccalloc_mempool_id_t id) {
  int n = -1;
  EXPECT_EQ(ccalloc_pool_use_count(a, device, id, &n), CCALLOC_OK) << ccalloc_last_error();
  return n;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

/// Creates pool `P` on device 0 of `a` with the host_segments functions,
/// allocates 3 MiB in it and frees it: the pool then caches one 20 MiB
/// segment, which starts at the returned address.
void* pool_with_a_cached_segment(ccalloc_allocator_t* a, ccalloc_mempool_id_t P) {
  EXPECT_EQ(ccalloc_create_pool(a, 0, P, host_segment_malloc, host_segment_free), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(ccalloc_begin_allocate_to_pool(a, 0, P, nullptr, 0), CCALLOC_OK) << ccalloc_last_error();
  void* p = must_malloc(a, 3 * MiB);
  EXPECT_EQ(ccalloc_end_allocate_to_pool(a, 0, P), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(ccalloc_delete(a, p), CCALLOC_OK) << ccalloc_last_error();
  return p;
}

TEST(CApiPools, NewPoolIdsAreUserIdsAndUnique) {
  const ccalloc_mempool_id_t a = new_pool(nullptr);
  const ccalloc_mempool_id_t b = new_pool(nullptr);
  EXPECT_GE(a.first, 1u);
  EXPECT_EQ(a.second, 0u) << "user pools are {n, 0}, as PyTorch's MemPool";
  EXPECT_EQ(b.first, a.first + 1);
  EXPECT_EQ(b.second, 0u);
  EXPECT_EQ(ccalloc_new_pool_id(nullptr, nullptr), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(ccalloc_last_error(), "ccalloc_new_pool_id: out is NULL")) << ccalloc_last_error();
}

// Segments come from the pool's functions, with the pool's device current;
// allocations land in the pool only on the routed stream and only between
// begin and end; use counts keep the segments; release gives them back.
TEST(CApiPools, SegmentAllocatorOnThePoolsDeviceAndStreamRouting) {
  sim_allocator a(0, "", 2);
  use_host_segments(a);
  const ccalloc_mempool_id_t P = new_pool(a);
  ASSERT_EQ(current_device_of(a), 0);
  ASSERT_EQ(ccalloc_create_pool(a, 1, P, host_segment_malloc, host_segment_free), CCALLOC_OK)
      << ccalloc_last_error();
  EXPECT_EQ(use_count(a, 1, P), 1);
  EXPECT_EQ(use_count(a, 0, P), 0) << "pools are per device";
  EXPECT_EQ(host_segments.mallocs, 0) << "segments come on demand";
  ccalloc_stream_t side = nullptr;
  ASSERT_EQ(ccalloc_stream_create(a, 1, &side), CCALLOC_OK) << ccalloc_last_error();

  ASSERT_EQ(ccalloc_begin_allocate_to_pool(a, 1, P, nullptr, 0), CCALLOC_OK) << ccalloc_last_error();
  void* big = must_malloc(a, 3 * MiB, nullptr, 1);  // routed: a 20 MiB segment of the pool
  EXPECT_EQ(host_segments.mallocs, 1);
  ASSERT_EQ(host_segments.sizes.size(), 1u);
  EXPECT_EQ(host_segments.sizes[0], 20 * MiB);
  EXPECT_EQ(host_segments.devices, std::vector<int>{1}) << "device 1 was current during the call";
  EXPECT_EQ(current_device_of(a), 0) << "and device 0 is current again after it";
  EXPECT_EQ(big, host_segments.live.at(0)) << "the block starts the segment";
  ccalloc_pool_usage_t u = usage(a, 1, P);
  EXPECT_EQ(u.segment_count, 1u);
  EXPECT_EQ(u.reserved_bytes, 20 * MiB);
  EXPECT_EQ(u.allocated_bytes, 3 * MiB);
  EXPECT_EQ(u.active_bytes, 3 * MiB);
  EXPECT_EQ(u.allocation_count, 1u);
  EXPECT_EQ(u.use_count, 1);

  void* other = must_malloc(a, 3 * MiB, side, 1);  // another stream: the default pool
  void* small = must_malloc(a, 4 * KiB, nullptr, 1);  // routed: a 2 MiB small segment of the pool
  EXPECT_EQ(host_segments.mallocs, 2);
  EXPECT_EQ(host_segments.sizes.back(), 2 * MiB);
  u = usage(a, 1, P);
  EXPECT_EQ(u.segment_count, 2u);
  EXPECT_EQ(u.reserved_bytes, 22 * MiB);
  EXPECT_EQ(u.allocated_bytes, 3 * MiB + 4 * KiB);
  EXPECT_EQ(u.allocation_count, 2u);
  ASSERT_EQ(ccalloc_end_allocate_to_pool(a, 1, P), CCALLOC_OK) << ccalloc_last_error();
  void* after = must_malloc(a, 3 * MiB, nullptr, 1);  // the routing ended: the default pool
  EXPECT_EQ(usage(a, 1, P).allocated_bytes, 3 * MiB + 4 * KiB);
  EXPECT_EQ(host_segments.mallocs, 2);
  const ccalloc_pool_usage_t def = usage(a, 1, ccalloc_mempool_id_t{0, 0});
  EXPECT_EQ(def.allocated_bytes, 6 * MiB) << "`other` and `after`";
  EXPECT_EQ(def.allocation_count, 2u);
  EXPECT_EQ(def.use_count, 0);
  // The pool's bytes are the device's reserved bytes too; device 0 has none.
  EXPECT_EQ(stat(a, "reserved_bytes.all.current", 1),
            static_cast<std::int64_t>(22 * MiB + def.reserved_bytes));
  EXPECT_EQ(stat(a, "reserved_bytes.all.current", 0), 0);

  // A second reference keeps the first segment source (the NULLs are ignored).
  ASSERT_EQ(ccalloc_create_pool(a, 1, P, nullptr, nullptr), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(use_count(a, 1, P), 2);
  // All streams: the side stream's allocation lands in the pool now.
  ASSERT_EQ(ccalloc_begin_allocate_to_pool(a, 1, P, nullptr, 1), CCALLOC_OK) << ccalloc_last_error();
  void* side_big = must_malloc(a, 5 * MiB, side, 1);
  ASSERT_EQ(ccalloc_end_allocate_to_pool(a, 1, P), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(host_segments.mallocs, 3) << "a segment of the side stream, from the pool's functions";
  EXPECT_EQ(usage(a, 1, P).allocated_bytes, 8 * MiB + 4 * KiB);
  EXPECT_EQ(usage(a, 1, P).reserved_bytes, 42 * MiB);

  for (void* p : {big, small, side_big, other, after}) ASSERT_EQ(ccalloc_delete(a, p), CCALLOC_OK);
  u = usage(a, 1, P);
  EXPECT_EQ(u.allocated_bytes, 0u);
  EXPECT_EQ(u.reserved_bytes, 42 * MiB) << "cached in the pool";
  // With users, empty_cache keeps the pool's segments.
  ASSERT_EQ(ccalloc_empty_cache(a), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(usage(a, 1, P).reserved_bytes, 42 * MiB);
  EXPECT_EQ(host_segments.frees, 0);
  ASSERT_EQ(ccalloc_release_pool(a, 1, P), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(use_count(a, 1, P), 1);
  ASSERT_EQ(ccalloc_empty_cache(a), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(host_segments.frees, 0);
  ASSERT_EQ(ccalloc_release_pool(a, 1, P), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(use_count(a, 1, P), 0);
  EXPECT_EQ(usage(a, 1, P).use_count, 0) << "released, still holding its cached segments";
  ASSERT_EQ(ccalloc_empty_cache(a), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(host_segments.frees, 3);
  EXPECT_TRUE(host_segments.live.empty());
  EXPECT_EQ(host_segments.devices, (std::vector<int>{1, 1, 1, 1, 1, 1})) << "3 mallocs, 3 frees, all on device 1";
  EXPECT_EQ(current_device_of(a), 0);
  EXPECT_EQ(stat(a, "reserved_bytes.all.current", 1), 0);
  ccalloc_pool_usage_t gone{};
  EXPECT_EQ(ccalloc_pool_usage(a, 1, P, &gone), CCALLOC_ERROR_INVALID_ARGUMENT) << "the pool is gone";
  EXPECT_TRUE(contains(ccalloc_last_error(), "has no private pool")) << ccalloc_last_error();
  EXPECT_EQ(ccalloc_stream_destroy(a, 1, side), CCALLOC_OK);
}

// Without a segment source, the pool takes the backend's segments (plain
// ones here, with PyTorch's policies).
TEST(CApiPools, BackendSegmentsWithoutASegmentAllocator) {
  sim_allocator a(0, ccalloc::pytorch_policies);
  const ccalloc_mempool_id_t P = new_pool(a);
  ASSERT_EQ(ccalloc_create_pool(a, 0, P, nullptr, nullptr), CCALLOC_OK) << ccalloc_last_error();
  ASSERT_EQ(ccalloc_begin_allocate_to_pool(a, 0, P, nullptr, 0), CCALLOC_OK) << ccalloc_last_error();
  void* p = must_malloc(a, MiB + 1);
  ASSERT_EQ(ccalloc_end_allocate_to_pool(a, 0, P), CCALLOC_OK) << ccalloc_last_error();
  const ccalloc_pool_usage_t u = usage(a, 0, P);
  EXPECT_EQ(u.reserved_bytes, 20 * MiB);
  EXPECT_EQ(u.allocated_bytes, MiB + 512);
  EXPECT_EQ(stat(a, "num_device_alloc"), 1);
  EXPECT_EQ(usage(a, 0, ccalloc_mempool_id_t{0, 0}).reserved_bytes, 0u);
  ASSERT_EQ(ccalloc_delete(a, p), CCALLOC_OK);
  ASSERT_EQ(ccalloc_release_pool(a, 0, P), CCALLOC_OK);
  ASSERT_EQ(ccalloc_empty_cache(a), CCALLOC_OK);
  EXPECT_EQ(stat(a, "num_device_free"), 1);
  EXPECT_EQ(stat(a, "reserved_bytes.all.current"), 0);
}

// A failing segment malloc is the out-of-memory path: the status, the code
// in the message, nothing else changed.
TEST(CApiPools, FailingSegmentMallocIsOutOfMemoryAndChangesNothing) {
  sim_allocator a(64 * MiB);
  use_host_segments(a);
  const ccalloc_mempool_id_t P = new_pool(a);
  ASSERT_EQ(ccalloc_create_pool(a, 0, P, host_segment_malloc, host_segment_free), CCALLOC_OK);
  ASSERT_EQ(ccalloc_begin_allocate_to_pool(a, 0, P, nullptr, 0), CCALLOC_OK);
  host_segments.malloc_code = 7;
  const std::int64_t reserved = stat(a, "reserved_bytes.all.current");
  void* p = reinterpret_cast<void*>(0x1);
  EXPECT_EQ(ccalloc_malloc(a, 0, 3 * MiB, nullptr, &p), CCALLOC_ERROR_OUT_OF_MEMORY);
  EXPECT_EQ(p, reinterpret_cast<void*>(0x1));
  const std::string message = ccalloc_last_error();
  EXPECT_TRUE(contains(message, "out of memory")) << message;
  EXPECT_TRUE(contains(message, "The segment allocator of private pool (" + std::to_string(P.first) +
                                    ", 0) of device 0 returned 7")) << message;
  // The pool's own segment allocator refused, not the device: said first,
  // and no advice about the device's free memory or another process.
  const std::size_t said = message.find(
      "The request's private pool gets its segments from its own segment allocator, and that allocator refused the "
      "segment (the device was not asked).");
  ASSERT_NE(said, std::string::npos) << message;
  EXPECT_LT(said, message.find("Device 0 has a total capacity")) << message;
  EXPECT_FALSE(contains(message, "reports that much free")) << message;
  EXPECT_FALSE(contains(message, "another process")) << message;
  EXPECT_FALSE(contains(message, "Reduce the memory the program holds")) << message;
  EXPECT_FALSE(contains(message, ".;")) << message;
  EXPECT_TRUE(contains(message, "Give the pool's segment allocator more memory, or allocate this request outside the "
                                "pool. The segment allocator of private pool (")) << message;
  // Two calls: no graph capture runs, so a begin_allocate_to_pool does not
  // stop the allocator from freeing its cache and retrying once (issue 16;
  // during a capture it would not retry).
  EXPECT_EQ(host_segments.mallocs, 2);
  EXPECT_EQ(usage(a, 0, P).segment_count, 0u);
  EXPECT_EQ(stat(a, "reserved_bytes.all.current"), reserved);
  EXPECT_EQ(stat(a, "num_ooms"), 1);
  EXPECT_EQ(current_device_of(a), 0);

  host_segments.malloc_code = 0;
  host_segments.null_on_success = true;
  EXPECT_EQ(ccalloc_malloc(a, 0, 3 * MiB, nullptr, &p), CCALLOC_ERROR_OUT_OF_MEMORY);
  EXPECT_TRUE(contains(ccalloc_last_error(), "returned 0 with a NULL pointer")) << ccalloc_last_error();
  host_segments.null_on_success = false;
  p = must_malloc(a, 3 * MiB);  // works again
  EXPECT_EQ(usage(a, 0, P).allocated_bytes, 3 * MiB);
  ASSERT_EQ(ccalloc_end_allocate_to_pool(a, 0, P), CCALLOC_OK);
  // An out-of-memory error of the default pool later carries no stale code.
  void* q = reinterpret_cast<void*>(0x1);
  EXPECT_EQ(ccalloc_malloc(a, 0, 100 * MiB, nullptr, &q), CCALLOC_ERROR_OUT_OF_MEMORY);
  EXPECT_FALSE(contains(ccalloc_last_error(), "segment allocator")) << ccalloc_last_error();
  ASSERT_EQ(ccalloc_delete(a, p), CCALLOC_OK);
  ASSERT_EQ(ccalloc_release_pool(a, 0, P), CCALLOC_OK);
  ASSERT_EQ(ccalloc_empty_cache(a), CCALLOC_OK);
  EXPECT_TRUE(host_segments.live.empty());
}

// PyTorch's hook throws the same message (with the code) on the process-wide allocator.
TEST(CApiPools, TorchHookOutOfMemoryCarriesTheSegmentAllocatorsCode) {
  use_host_segments(nullptr);
  const ccalloc_mempool_id_t P = new_pool(nullptr);
  ASSERT_EQ(ccalloc_create_pool(nullptr, 0, P, host_segment_malloc, host_segment_free), CCALLOC_OK)
      << ccalloc_last_error();
  ccalloc_stream_t s = nullptr;
  ASSERT_EQ(ccalloc_stream_create(nullptr, 0, &s), CCALLOC_OK) << ccalloc_last_error();
  ASSERT_EQ(ccalloc_begin_allocate_to_pool(nullptr, 0, P, s, 0), CCALLOC_OK) << ccalloc_last_error();
  host_segments.malloc_code = 3;
  try {
    (void)ccalloc_torch_alloc(MiB, 0, s);
    ADD_FAILURE() << "no exception";
  } catch (const ccalloc::out_of_memory_error& e) {
    EXPECT_TRUE(contains(e.what(), "returned 3")) << e.what();
    EXPECT_EQ(e.requested_bytes, MiB) << "the figures are kept";
    EXPECT_EQ(e.device, 0);
  }
  ASSERT_EQ(ccalloc_end_allocate_to_pool(nullptr, 0, P), CCALLOC_OK);
  ASSERT_EQ(ccalloc_release_pool(nullptr, 0, P), CCALLOC_OK);
  EXPECT_EQ(use_count(nullptr, 0, P), 0);
  EXPECT_EQ(host_segments.frees, 0);
  EXPECT_EQ(ccalloc_stream_destroy(nullptr, 0, s), CCALLOC_OK);
}

// A segment free that fails does not stop empty_cache: the other pools of
// the device and the other devices give their cached segments back, and
// the first failure is reported.
TEST(CApiPools, EmptyCacheGoesOnPastASegmentFreeThatFails) {
  sim_allocator a(0, "expandable_segments:False", 2);
  use_host_segments(a);
  const ccalloc_mempool_id_t failing = new_pool(a);
  const ccalloc_mempool_id_t fine = new_pool(a);  // a larger id: released after `failing`
  void* p = pool_with_a_cached_segment(a, failing);
  ASSERT_EQ(ccalloc_create_pool(a, 0, fine, nullptr, nullptr), CCALLOC_OK) << ccalloc_last_error();
  ASSERT_EQ(ccalloc_begin_allocate_to_pool(a, 0, fine, nullptr, 0), CCALLOC_OK) << ccalloc_last_error();
  void* q = must_malloc(a, 3 * MiB);
  ASSERT_EQ(ccalloc_end_allocate_to_pool(a, 0, fine), CCALLOC_OK) << ccalloc_last_error();
  ASSERT_EQ(ccalloc_delete(a, q), CCALLOC_OK) << ccalloc_last_error();
  ASSERT_EQ(ccalloc_release_pool(a, 0, failing), CCALLOC_OK);
  ASSERT_EQ(ccalloc_release_pool(a, 0, fine), CCALLOC_OK);
  ASSERT_EQ(ccalloc_delete(a, must_malloc(a, MiB, nullptr, 1)), CCALLOC_OK) << ccalloc_last_error();
  ASSERT_EQ(stat(a, "reserved_bytes.all.current", 0), static_cast<std::int64_t>(40 * MiB));
  ASSERT_EQ(stat(a, "reserved_bytes.all.current", 1), static_cast<std::int64_t>(2 * MiB));
  host_segments.free_code = 5;
  EXPECT_EQ(ccalloc_empty_cache(a), CCALLOC_ERROR_BACKEND);
  const std::string message = ccalloc_last_error();
  EXPECT_TRUE(contains(message, "failed to free " + pointer_text(p) + ": its free returned 5")) << message;
  EXPECT_EQ(stat(a, "reserved_bytes.all.current", 0), static_cast<std::int64_t>(20 * MiB))
      << "only the segment whose free failed stays";
  EXPECT_EQ(usage(a, 0, failing).reserved_bytes, 20 * MiB);
  EXPECT_EQ(stat(a, "reserved_bytes.all.current", 1), 0) << "the next device's cache went back too";
  host_segments.free_code = 0;
  ASSERT_EQ(ccalloc_empty_cache(a), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(stat(a, "reserved_bytes.all.current", 0), 0);
  EXPECT_TRUE(host_segments.live.empty());
}

// A failing segment free is a backend error naming the code; the segment
// stays in the pool until a free succeeds.
TEST(CApiPools, FailingSegmentFreeIsReportedAndTheSegmentStays) {
  sim_allocator a;
  use_host_segments(a);
  const ccalloc_mempool_id_t P = new_pool(a);
  void* p = pool_with_a_cached_segment(a, P);
  ASSERT_EQ(ccalloc_release_pool(a, 0, P), CCALLOC_OK);
  host_segments.free_code = 5;
  EXPECT_EQ(ccalloc_empty_cache(a), CCALLOC_ERROR_BACKEND);
  const std::string message = ccalloc_last_error();
  EXPECT_TRUE(contains(message, "failed to free " + pointer_text(p) + ": its free returned 5")) << message;
  EXPECT_EQ(host_segments.frees, 1);
  const ccalloc_pool_usage_t u = usage(a, 0, P);
  EXPECT_EQ(u.reserved_bytes, 20 * MiB) << "still in the pool";
  EXPECT_EQ(u.use_count, 0);
  EXPECT_EQ(stat(a, "reserved_bytes.all.current"), static_cast<std::int64_t>(20 * MiB));
  host_segments.free_code = 0;
  ASSERT_EQ(ccalloc_empty_cache(a), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(host_segments.frees, 2);
  EXPECT_TRUE(host_segments.live.empty());
  EXPECT_EQ(stat(a, "reserved_bytes.all.current"), 0);
}

TEST(CApiPools, BadArgumentsAreNamedAndChangeNothing) {
  sim_allocator a;
  use_host_segments(a);
  const ccalloc_mempool_id_t P = new_pool(a);
  EXPECT_EQ(ccalloc_create_pool(a, 0, ccalloc_mempool_id_t{0, 0}, nullptr, nullptr),
            CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(ccalloc_last_error(), "names the default pool")) << ccalloc_last_error();
  EXPECT_EQ(ccalloc_create_pool(a, 0, P, host_segment_malloc, nullptr), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(ccalloc_last_error(), "ccalloc_create_pool: free_fn is NULL but the other")) << ccalloc_last_error();
  EXPECT_EQ(ccalloc_create_pool(a, 0, P, nullptr, host_segment_free), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(ccalloc_last_error(), "malloc_fn is NULL")) << ccalloc_last_error();
  EXPECT_EQ(use_count(a, 0, P), 0) << "no pool was created";
  EXPECT_EQ(ccalloc_create_pool(a, 1, P, nullptr, nullptr), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(ccalloc_last_error(), "device 1 is not initialized")) << ccalloc_last_error();
  EXPECT_EQ(ccalloc_pool_use_count(a, -1, P, nullptr), CCALLOC_ERROR_INVALID_ARGUMENT);
  int n = 0;
  EXPECT_EQ(ccalloc_pool_use_count(a, 2, P, &n), CCALLOC_ERROR_INVALID_ARGUMENT);

  EXPECT_EQ(ccalloc_release_pool(a, 0, P), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(ccalloc_last_error(), "release_pool: device 0 has no private pool")) << ccalloc_last_error();
  EXPECT_EQ(ccalloc_begin_allocate_to_pool(a, 0, P, nullptr, 0), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(ccalloc_end_allocate_to_pool(a, 0, P), CCALLOC_ERROR_INVALID_ARGUMENT);
  ccalloc_pool_usage_t u{};
  u.reserved_bytes = 12345;
  EXPECT_EQ(ccalloc_pool_usage(a, 0, P, &u), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(u.reserved_bytes, 12345u) << "outputs are unchanged on error";
  EXPECT_EQ(ccalloc_pool_usage(a, 0, P, nullptr), CCALLOC_ERROR_INVALID_ARGUMENT);

  ASSERT_EQ(ccalloc_create_pool(a, 0, P, host_segment_malloc, host_segment_free), CCALLOC_OK);
  EXPECT_EQ(ccalloc_end_allocate_to_pool(a, 0, P), CCALLOC_ERROR_INVALID_ARGUMENT) << "end without begin";
  EXPECT_TRUE(contains(ccalloc_last_error(), "is not active")) << ccalloc_last_error();
  ASSERT_EQ(ccalloc_begin_allocate_to_pool(a, 0, P, nullptr, 0), CCALLOC_OK);
  ASSERT_EQ(ccalloc_end_allocate_to_pool(a, 0, P), CCALLOC_OK);
  EXPECT_EQ(ccalloc_end_allocate_to_pool(a, 0, P), CCALLOC_ERROR_INVALID_ARGUMENT) << "ended twice";
  // A pool that holds a segment and was released: no second release, no routing.
  ASSERT_EQ(ccalloc_begin_allocate_to_pool(a, 0, P, nullptr, 0), CCALLOC_OK);
  void* p = must_malloc(a, 4 * KiB);
  ASSERT_EQ(ccalloc_end_allocate_to_pool(a, 0, P), CCALLOC_OK);
  ASSERT_EQ(ccalloc_release_pool(a, 0, P), CCALLOC_OK);
  EXPECT_EQ(ccalloc_release_pool(a, 0, P), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(ccalloc_last_error(), "was already released (use count 0)")) << ccalloc_last_error();
  EXPECT_EQ(ccalloc_begin_allocate_to_pool(a, 0, P, nullptr, 0), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(ccalloc_last_error(), "it takes no allocations")) << ccalloc_last_error();
  EXPECT_EQ(usage(a, 0, P).allocated_bytes, 4 * KiB) << "the live block is untouched";
  ASSERT_EQ(ccalloc_delete(a, p), CCALLOC_OK);
  ASSERT_EQ(ccalloc_empty_cache(a), CCALLOC_OK);
  EXPECT_TRUE(host_segments.live.empty());
  EXPECT_EQ(host_segments.mallocs, 1);
  EXPECT_EQ(host_segments.frees, 1);
}

// ccalloc_destroy returns a pool's cached segments through its free function.
TEST(CApiPools, DestroyFreesThePoolsSegments) {
  use_host_segments(nullptr);
  {
    sim_allocator a;  // the functions read the process-wide backend's device: `a` is being destroyed
    void* p = pool_with_a_cached_segment(a, new_pool(a));
    EXPECT_EQ(host_segments.live, std::vector<void*>{p});
  }
  EXPECT_EQ(host_segments.frees, 1);
  EXPECT_TRUE(host_segments.live.empty());
}

// NULL is never a live allocation: the pointer table must not hand back one
// of its empty slots (key 0) as an entry (get_base_allocation crashed).
TEST(CApi, NullIsNoLiveAllocation) {
  sim_allocator a;
  void* p = must_malloc(a, 4096);
  void* base = &base;
  std::size_t size = 7;
  EXPECT_EQ(ccalloc_get_base_allocation(a, nullptr, &base, &size), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ccalloc_last_error()).find("not a live allocation"), std::string::npos) << ccalloc_last_error();
  EXPECT_EQ(size, 7u);
  EXPECT_EQ(ccalloc_delete(a, nullptr), CCALLOC_OK);  // free(NULL) is a no-op
  EXPECT_EQ(ccalloc_record_stream(a, nullptr, nullptr), CCALLOC_OK);
  EXPECT_EQ(stat(a, "allocation.all.current"), 1);
  EXPECT_EQ(ccalloc_delete(a, p), CCALLOC_OK) << ccalloc_last_error();
}

}  // namespace

namespace {
std::vector<ccalloc_mapped_segment_t> mapped_segments(ccalloc_allocator_t* a, int device) {
  size_t n = 0;
  EXPECT_EQ(ccalloc_mapped_segments(a, device, nullptr, &n), CCALLOC_OK) << ccalloc_last_error();
  std::vector<ccalloc_mapped_segment_t> out(n + 1);  // one more than needed: *count says how many
  size_t m = out.size();
  EXPECT_EQ(ccalloc_mapped_segments(a, device, out.data(), &m), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_EQ(m, n);
  out.resize(m);
  return out;
}
std::size_t total_of(const std::vector<ccalloc_mapped_segment_t>& v) {
  std::size_t n = 0;
  for (const auto& r : v) n += r.total_bytes;
  return n;
}
bool covers(const std::vector<ccalloc_mapped_segment_t>& v, const void* p, std::size_t bytes) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  for (const auto& r : v)
    if (a >= r.address && a + bytes <= r.address + r.total_bytes) return true;
  return false;
}
}  // namespace

// What a registration hook reads (PyTorch's snapshot() segments): the
// mapped ranges, one per run of mapped pages of an expandable reservation,
// summing to the reserved bytes; paused ranges are not mapped.
TEST(CApi, MappedSegmentsAreTheMappedRangesAndSumToReserved) {
  sim_allocator a(1024 * MiB, "", 2);
  void* small = must_malloc(a, 1 * MiB);
  void* big = must_malloc(a, 40 * MiB);
  void* cached = must_malloc(a, 6 * MiB);
  void* other = must_malloc(a, 4 * MiB, nullptr, 1);
  ASSERT_EQ(ccalloc_delete(a, cached), CCALLOC_OK);  // stays mapped: cached
  const auto d0 = mapped_segments(a, 0);
  EXPECT_EQ(total_of(d0), static_cast<std::size_t>(stat(a, "reserved_bytes.all.current", 0)));
  EXPECT_TRUE(covers(d0, small, 1 * MiB));
  EXPECT_TRUE(covers(d0, big, 40 * MiB));
  EXPECT_TRUE(covers(d0, cached, 6 * MiB));
  EXPECT_FALSE(covers(d0, other, 4 * MiB));
  std::size_t allocated = 0;
  for (const auto& r : d0) {
    EXPECT_EQ(r.device, 0);
    EXPECT_EQ(r.is_expandable, 1);
    EXPECT_EQ(r.address % page_bytes, 0u);
    EXPECT_EQ(r.total_bytes % page_bytes, 0u);
    EXPECT_LE(r.allocated_bytes, r.active_bytes);
    EXPECT_LE(r.active_bytes, r.total_bytes);
    allocated += r.allocated_bytes;
  }
  EXPECT_EQ(allocated, static_cast<std::size_t>(stat(a, "allocated_bytes.all.current", 0)));
  const auto all = mapped_segments(a, -1);
  EXPECT_EQ(all.size(), d0.size() + mapped_segments(a, 1).size());
  EXPECT_TRUE(covers(all, other, 4 * MiB));
  EXPECT_EQ(all.back().device, 1);

  ASSERT_EQ(ccalloc_tag_begin("capi_mapped"), CCALLOC_OK);
  void* tagged = must_malloc(a, 8 * MiB);
  ASSERT_EQ(ccalloc_tag_end(), CCALLOC_OK);
  EXPECT_TRUE(covers(mapped_segments(a, 0), tagged, 8 * MiB));
  const char* tags[] = {"capi_mapped"};
  ccalloc_sleep_result_t r{};
  ASSERT_EQ(ccalloc_pause(a, 0, tags, 1, 0, &r), CCALLOC_OK) << ccalloc_last_error();
  const auto paused = mapped_segments(a, 0);
  EXPECT_FALSE(covers(paused, tagged, 1));
  EXPECT_EQ(total_of(paused), static_cast<std::size_t>(stat(a, "reserved_bytes.all.current", 0)));
  ASSERT_EQ(ccalloc_resume(a, 0, tags, 1, &r), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_TRUE(covers(mapped_segments(a, 0), tagged, 8 * MiB));

  size_t n = 1;
  EXPECT_EQ(ccalloc_mapped_segments(a, 0, nullptr, nullptr), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(ccalloc_mapped_segments(a, 0, nullptr, &n), CCALLOC_ERROR_INVALID_ARGUMENT);
  ccalloc_mapped_segment_t one{};
  EXPECT_EQ(ccalloc_mapped_segments(a, 2, &one, &n), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(ccalloc_last_error()).find("ccalloc: ccalloc_mapped_segments: device 2 is out of range"),
            std::string::npos)
      << ccalloc_last_error();
  for (void* p : {small, big, tagged, other}) EXPECT_EQ(ccalloc_delete(a, p), CCALLOC_OK);
}

// Runs `body` with stderr going to a file; exits with 0 when `what`
// appears there exactly once, else 10 + the count (for a death test's child).
[[noreturn]] void exit_with_count_of(const std::string& what, const std::function<void()>& body) {
  const std::string path = ::testing::TempDir() + "ccalloc_stderr_" + std::to_string(::getpid());
  if (std::freopen(path.c_str(), "w", stderr) == nullptr) std::_Exit(2);
  body();
  std::fflush(stderr);
  std::FILE* f = std::fopen(path.c_str(), "r");
  std::string text;
  for (int c = f ? std::fgetc(f) : EOF; c != EOF; c = std::fgetc(f)) text += static_cast<char>(c);
  if (f) std::fclose(f);
  std::remove(path.c_str());
  std::size_t n = 0;
  for (std::size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  std::_Exit(n == 1 ? 0 : static_cast<int>(10 + std::min<std::size_t>(n, 100)));
}

// CCALLOC_CONF is the process's: a bad value fails every call on the
// process-wide allocator, and ccalloc_plugin_free (which cannot return an
// error) says so once, not at every free; allocators made from a value
// that warns print the warning once, not once each. In a child process of
// its own (the process-wide allocator is made at its first use).
TEST(CApiDeathTest, CcallocConfIsReportedOncePerProcess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(exit_with_count_of("no_such_key",
                                 [] {
                                   ::setenv("CCALLOC_CONF", "no_such_key:1", 1);
                                   int x = 0;
                                   for (int i = 0; i < 3; ++i) ccalloc_plugin_free(&x, 0, 0, nullptr);
                                 }),
              ::testing::ExitedWithCode(0), "");
  EXPECT_EXIT(exit_with_count_of("garbage_collection_threshold:0.5 is set without per_process_memory_fraction",
                                 [] {
                                   ::setenv("CCALLOC_CONF", "garbage_collection_threshold:0.5", 1);
                                   ccalloc_options_t o;
                                   ccalloc_options_init(&o);
                                   o.backend = CCALLOC_BACKEND_SIM;
                                   for (int i = 0; i < 3; ++i) {
                                     ccalloc_allocator_t* a = nullptr;
                                     if (ccalloc_create(&o, &a) != CCALLOC_OK) std::_Exit(3);
                                     ccalloc_destroy(a);
                                   }
                                 }),
              ::testing::ExitedWithCode(0), "");
}

TEST(CApi, MappedSegmentsNamesABadDeviceWhateverOutIs) {
  sim_allocator a(256 * MiB);
  size_t n = 4;
  EXPECT_EQ(ccalloc_mapped_segments(a, 5, nullptr, &n), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(ccalloc_last_error(),
               "ccalloc: ccalloc_mapped_segments: device 5 is out of range (-1 for every device, or 0..0)");
  EXPECT_EQ(n, 4u) << "nothing written";
  EXPECT_EQ(ccalloc_mapped_segments(a, 0, nullptr, &n), CCALLOC_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(ccalloc_last_error(), "ccalloc: ccalloc_mapped_segments: out is NULL");
}

// A mapping listener that calls back into the allocator: every C entry point
// that would wait for the device's locks returns INVALID_ARGUMENT (the
// caller's error, as docs/errors.md says) naming the rule, with nothing
// changed; none returns INTERNAL.
struct reentering_listener {
  ccalloc_allocator_t* alloc = nullptr;
  bool ran = false;
  std::vector<std::pair<std::string, ccalloc_status_t>> results;
  std::vector<std::string> messages;
};
void reenter(void* user_data, const ccalloc_mapping_event_t* event) {
  auto& l = *static_cast<reentering_listener*>(user_data);
  if (l.ran || event->change != CCALLOC_MAPPING_MAP) return;
  l.ran = true;
  ccalloc_allocator_t* a = l.alloc;
  size_t length = 0;
  size_t largest = 0;
  size_t count = 0;
  ccalloc_sleep_result_t sleep{};
  const char* tags[] = {"default"};
  ccalloc_mempool_id_t pool{};
  (void)ccalloc_new_pool_id(a, &pool);
  double fraction = 0;
  int64_t value = 0;
  std::vector<int64_t> stats(4096);
  // (ccalloc_malloc and ccalloc_delete are left out: they take the stream's
  // lock first, which the announcing thread holds; they stop the process.)
  const std::vector<std::pair<std::string, std::function<ccalloc_status_t()>>> calls = {
      {"ccalloc_empty_cache", [&] { return ccalloc_empty_cache(a); }},
      {"ccalloc_init", [&] { return ccalloc_init(a, 1); }},
      {"ccalloc_enable", [&] { return ccalloc_enable(a, 0); }},
      {"ccalloc_set_config", [&] { return ccalloc_set_config(a, "max_split_size_mb:64"); }},
      {"ccalloc_record_history", [&] { return ccalloc_record_history(a, 1, 100); }},
      {"ccalloc_snapshot_json", [&] { return ccalloc_snapshot_json(a, 0, nullptr, 0, &length); }},
      {"ccalloc_mapped_segments", [&] { return ccalloc_mapped_segments(a, 0, nullptr, &count); }},
      {"ccalloc_cache_info", [&] { return ccalloc_cache_info(a, 0, &largest); }},
      {"ccalloc_pause", [&] { return ccalloc_pause(a, 0, tags, 1, 0, &sleep); }},
      {"ccalloc_create_pool", [&] { return ccalloc_create_pool(a, 0, pool, nullptr, nullptr); }},
      {"ccalloc_get_memory_fraction", [&] { return ccalloc_get_memory_fraction(a, 0, &fraction); }},
      {"ccalloc_set_memory_fraction", [&] { return ccalloc_set_memory_fraction(a, 0, 0.5); }},
      {"ccalloc_get_device_stats", [&] { return ccalloc_get_device_stats(a, 0, stats.data(), stats.size()); }},
      {"ccalloc_get_device_stat", [&] { return ccalloc_get_device_stat(a, 0, "allocated_bytes.all.current", &value); }},
      {"ccalloc_reset_peak_stats", [&] { return ccalloc_reset_peak_stats(a, 0); }},
      {"ccalloc_reset_accumulated_stats", [&] { return ccalloc_reset_accumulated_stats(a, 0); }},
      {"ccalloc_release_pool", [&] { return ccalloc_release_pool(a, 0, pool); }},
      {"ccalloc_resume", [&] { return ccalloc_resume(a, 0, tags, 1, &sleep); }},
  };
  for (const auto& [name, call] : calls) {
    l.results.emplace_back(name, call());
    l.messages.emplace_back(ccalloc_last_error());
  }
}

TEST(CApi, AMappingListenerThatCallsIntoTheAllocatorGetsInvalidArgument) {
  sim_allocator a(1024 * MiB);
  reentering_listener l;
  l.alloc = a;
  ASSERT_EQ(ccalloc_attach_mapping_listener(a, &reenter, &l), CCALLOC_OK) << ccalloc_last_error();
  void* p = must_malloc(a, 4 * MiB);
  ASSERT_TRUE(l.ran);
  for (std::size_t i = 0; i < l.results.size(); ++i) {
    EXPECT_EQ(l.results[i].second, CCALLOC_ERROR_INVALID_ARGUMENT)
        << l.results[i].first << ": " << ccalloc_status_name(l.results[i].second) << ": " << l.messages[i];
    EXPECT_NE(l.messages[i].find("a listener must not call into any ccalloc allocator"), std::string::npos)
        << l.results[i].first << ": " << l.messages[i];
    EXPECT_EQ(l.messages[i].find("internal error"), std::string::npos) << l.results[i].first << ": " << l.messages[i];
  }
  int enabled = 0;
  ASSERT_EQ(ccalloc_is_enabled(a, &enabled), CCALLOC_OK);
  EXPECT_EQ(enabled, 1) << "the refused ccalloc_enable changed nothing";
  EXPECT_EQ(stat(a, "allocation.all.current"), 1) << "only the caller's malloc";
  EXPECT_EQ(ccalloc_delete(a, p), CCALLOC_OK);
}

// History callbacks that call back into the allocator: `release` and
// `frames` may run where the allocator holds its locks (a context's last
// reference goes with the oldest entry of a full ring buffer, under the
// history's lock before this was refused; a snapshot made there waited for
// that lock forever), so their calls get INVALID_ARGUMENT naming them;
// `record` runs outside the locks, and its own calls work without calling
// it again.
struct reentering_recorder {
  ccalloc_allocator_t* alloc = nullptr;
  int recorded = 0, released = 0, framed = 0;
  ccalloc_status_t record_malloc = CCALLOC_OK, record_delete = CCALLOC_OK;
  std::vector<std::pair<std::string, ccalloc_status_t>> results;
  std::vector<std::string> messages;
  void call_back(const std::string& from) {
    ccalloc_allocator_t* a = alloc;
    size_t length = 0;
    std::vector<int64_t> stats(4096);
    const std::vector<std::pair<std::string, std::function<ccalloc_status_t()>>> calls = {
        {"ccalloc_snapshot_json", [&] { return ccalloc_snapshot_json(a, 1, nullptr, 0, &length); }},
        {"ccalloc_empty_cache", [&] { return ccalloc_empty_cache(a); }},
        {"ccalloc_get_device_stats", [&] { return ccalloc_get_device_stats(a, 0, stats.data(), stats.size()); }},
        {"ccalloc_record_history", [&] { return ccalloc_record_history(a, 1, 100); }},
    };
    for (const auto& [name, call] : calls) {
      results.emplace_back(from + " " + name, call());
      messages.emplace_back(ccalloc_last_error());
    }
  }
};

TEST(CApiHistory, ReleaseAndFramesCallbacksThatCallIntoTheAllocatorGetInvalidArgument) {
  sim_allocator a(1024 * MiB);
  reentering_recorder r;
  r.alloc = a;
  ccalloc_history_options_t h;
  ccalloc_history_options_init(&h);
  h.max_entries = 1;
  h.when = CCALLOC_RECORD_CONTEXT_ALLOC;
  h.user_data = &r;
  h.record = [](void* user) -> void* {
    auto& rec = *static_cast<reentering_recorder*>(user);
    if (rec.recorded++ == 0) {  // a malloc and delete of its own: recorded without calling record again
      void* p = nullptr;
      rec.record_malloc = ccalloc_malloc(rec.alloc, 0, 512, nullptr, &p);
      rec.record_delete = ccalloc_delete(rec.alloc, p);
    }
    return reinterpret_cast<void*>(static_cast<std::uintptr_t>(rec.recorded));
  };
  h.release = [](void* user, void*) {
    auto& rec = *static_cast<reentering_recorder*>(user);
    if (rec.released++ == 0) rec.call_back("release:");
  };
  h.frames = [](void* user, void*, ccalloc_frame_sink_fn sink, void* sink_data) {
    auto& rec = *static_cast<reentering_recorder*>(user);
    if (rec.framed++ == 0) rec.call_back("frames:");
    sink(sink_data, "f", "f.py", 1);
  };
  ASSERT_EQ(ccalloc_record_history_ex(a, &h), CCALLOC_OK) << ccalloc_last_error();
  // One entry kept: the free's entries push out the alloc's, the next
  // malloc's entry the free_completed holding the first context's last
  // reference.
  void* p = must_malloc(a, 4096);
  EXPECT_EQ(r.recorded, 1) << "record is not called again for its own malloc";
  EXPECT_EQ(r.record_malloc, CCALLOC_OK) << "a malloc from record works";
  EXPECT_EQ(r.record_delete, CCALLOC_OK);
  ASSERT_EQ(ccalloc_delete(a, p), CCALLOC_OK);
  void* q = must_malloc(a, 4096);
  void* q2 = must_malloc(a, 4096);
  EXPECT_GE(r.released, 1);
  size_t length = 0;
  ASSERT_EQ(ccalloc_snapshot_json(a, 1, nullptr, 0, &length), CCALLOC_OK) << ccalloc_last_error();
  EXPECT_GE(r.framed, 1);
  ASSERT_EQ(r.results.size(), 8u);
  for (std::size_t i = 0; i < r.results.size(); ++i) {
    const std::string& name = r.results[i].first;
    EXPECT_EQ(r.results[i].second, CCALLOC_ERROR_INVALID_ARGUMENT)
        << name << ": " << ccalloc_status_name(r.results[i].second) << ": " << r.messages[i];
    const std::string callback = name.starts_with("release")
                                     ? "called from the history's release function (ccalloc_history_options_t.release)"
                                     : "called from the history's frames function (ccalloc_history_options_t.frames)";
    EXPECT_NE(r.messages[i].find(callback), std::string::npos) << name << ": " << r.messages[i];
    EXPECT_NE(r.messages[i].find("it must not call into any ccalloc allocator"), std::string::npos)
        << name << ": " << r.messages[i];
  }
  // Nothing changed: history still keeps one entry, the allocator works.
  EXPECT_EQ(stat(a, "allocation.all.current"), 2);
  EXPECT_EQ(ccalloc_delete(a, q), CCALLOC_OK);
  EXPECT_EQ(ccalloc_delete(a, q2), CCALLOC_OK);
  EXPECT_EQ(ccalloc_empty_cache(a), CCALLOC_OK) << "outside the callbacks";
}

TEST(CApi, MappedSegmentsOfPlainSegmentsAreWholeSegments) {
  sim_allocator a(1024 * MiB, "expandable_segments:False");
  void* p = must_malloc(a, 30 * MiB);
  void* q = must_malloc(a, 100);
  const auto v = mapped_segments(a, 0);
  ASSERT_EQ(v.size(), 2u);
  EXPECT_EQ(total_of(v), static_cast<std::size_t>(stat(a, "reserved_bytes.all.current")));
  for (const auto& r : v) EXPECT_EQ(r.is_expandable, 0);
  EXPECT_EQ(v[0].is_large + v[1].is_large, 1);
  EXPECT_TRUE(covers(v, p, 30 * MiB));
  EXPECT_TRUE(covers(v, q, 100));
  EXPECT_EQ(ccalloc_delete(a, p), CCALLOC_OK);
  EXPECT_EQ(ccalloc_delete(a, q), CCALLOC_OK);
}
