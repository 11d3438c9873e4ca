// The C++ API's parity with the C API and Python: new_pool_id (one counter
// for the process) and pool_scope (begin/end_allocate_to_pool as a scope).
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/ccalloc.h>
#include <ccalloc/frontend/caching_allocator.hpp>

#include <gtest/gtest.h>

#include <memory>

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

TEST(CppApi, NewPoolIdSharesTheCApisCounter) {
  const ccalloc::mempool_id_t a = ccalloc::caching_allocator::new_pool_id();
  ccalloc_mempool_id_t c{};
  ASSERT_EQ(ccalloc_new_pool_id(nullptr, &c), CCALLOC_OK);
  const ccalloc::mempool_id_t b = ccalloc::caching_allocator::new_pool_id();
  EXPECT_GE(a.first, 1u);
  EXPECT_EQ(a.second, 0u);
  EXPECT_EQ(c.first, a.first + 1) << "the C API draws from the same counter";
  EXPECT_EQ(c.second, 0u);
  EXPECT_EQ(b.first, a.first + 2);
}

TEST(CppApi, PoolScopeRoutesOneStreamUntilItEnds) {
  auto device = std::make_shared<ccalloc::sim_backend>();
  ccalloc::caching_allocator alloc(device, ccalloc::allocator_config::parse(""));
  alloc.init(1);
  const ccalloc::stream_t s = alloc.create_stream(0);
  const ccalloc::stream_t other = alloc.create_stream(0);
  const ccalloc::mempool_id_t pool = ccalloc::caching_allocator::new_pool_id();
  alloc.create_or_incref_pool(0, pool);
  void* in_pool = nullptr;
  void* elsewhere = nullptr;
  {
    ccalloc::pool_scope scope(alloc, 0, pool, s);
    in_pool = alloc.malloc(0, 4 * MiB, s);
    elsewhere = alloc.malloc(0, 4 * MiB, other);  // another stream: the default pool
  }
  void* after = alloc.malloc(0, 4 * MiB, s);  // the scope has ended
  EXPECT_EQ(alloc.get_pool_stats(0, pool).allocated_bytes, 4 * MiB);
  EXPECT_EQ(alloc.get_pool_stats(0, pool).allocation_count, 1u);
  alloc.free(in_pool);
  EXPECT_EQ(alloc.get_pool_stats(0, pool).allocated_bytes, 0u);
  alloc.free(elsewhere);
  alloc.free(after);
  alloc.release_pool(0, pool);
}

TEST(CppApi, PoolScopeOfAnUnknownDeviceThrowsAndRoutesNothing) {
  auto device = std::make_shared<ccalloc::sim_backend>();
  ccalloc::caching_allocator alloc(device, ccalloc::allocator_config::parse(""));
  alloc.init(1);
  const ccalloc::mempool_id_t pool = ccalloc::caching_allocator::new_pool_id();
  EXPECT_THROW(ccalloc::pool_scope(alloc, 3, pool, ccalloc::default_stream), ccalloc::invalid_argument_error);
}

}  // namespace
