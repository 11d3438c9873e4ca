// The cuda::mr adapter: CCCL's concepts checked at compile time, then a run
// on the simulated device through a CCCL resource ref (no GPU, no libcudart).
#include <ccalloc/adapters/cuda_memory_resource.hpp>
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/errors.hpp>

#include <gtest/gtest.h>

#include <memory>

namespace {

using ccalloc::cuda_memory_resource;

static_assert(cuda::mr::resource<cuda_memory_resource>);
static_assert(cuda::mr::async_resource<cuda_memory_resource>);
static_assert(cuda::mr::resource_with<cuda_memory_resource, cuda::mr::device_accessible>);
static_assert(cuda::mr::async_resource_with<cuda_memory_resource, cuda::mr::device_accessible>);
static_assert(!cuda::mr::resource_with<cuda_memory_resource, cuda::mr::host_accessible>,
              "device memory is not host accessible");

constexpr std::size_t MiB = std::size_t{1} << 20;

struct CudaMrTest : ::testing::Test {
  std::shared_ptr<ccalloc::sim_backend> device = std::make_shared<ccalloc::sim_backend>();
  ccalloc::caching_allocator alloc{device, ccalloc::allocator_config::parse("")};
  CudaMrTest() { alloc.init(1); }
  static cudaStream_t as_cuda(ccalloc::stream_t s) { return ccalloc::to_cuda_stream(s); }
};

TEST_F(CudaMrTest, AllocatesInStreamOrderThroughAResourceRef) {
  cuda_memory_resource resource(alloc, 0);
  cuda::mr::async_resource_ref<cuda::mr::device_accessible> ref{resource};
  const ccalloc::stream_t s = alloc.create_stream(0);
  void* p = ref.allocate_async(3 * MiB, 256, cuda::stream_ref{as_cuda(s)});
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 512, 0u);
  auto stats = alloc.get_device_stats(0).to_map();
  EXPECT_EQ(stats.at("requested_bytes.all.current"), static_cast<std::int64_t>(3 * MiB));
  ref.deallocate_async(p, 3 * MiB, 256, cuda::stream_ref{as_cuda(s)});
  EXPECT_EQ(alloc.get_device_stats(0).to_map().at("allocated_bytes.all.current"), 0);
  // The freed block comes back for the same size on the same stream.
  void* q = ref.allocate_async(3 * MiB, 256, cuda::stream_ref{as_cuda(s)});
  EXPECT_EQ(q, p);
  ref.deallocate_async(q, 3 * MiB, 256, cuda::stream_ref{as_cuda(s)});
}

TEST_F(CudaMrTest, AFreeOnAnotherStreamWaitsForThatStream) {
  cuda_memory_resource resource(alloc, 0);
  const ccalloc::stream_t a = alloc.create_stream(0);
  const ccalloc::stream_t b = alloc.create_stream(0);
  void* p = resource.allocate_async(4 * MiB, 512, cuda::stream_ref{as_cuda(a)});
  device->enqueue_work(0, b, device->now() + 1000);  // b is busy when p is freed on it
  resource.deallocate_async(p, 4 * MiB, 512, cuda::stream_ref{as_cuda(b)});
  void* q = resource.allocate_async(4 * MiB, 512, cuda::stream_ref{as_cuda(a)});
  EXPECT_NE(q, p) << "p is reused only after b's work";
  resource.deallocate_async(q, 4 * MiB, 512, cuda::stream_ref{as_cuda(a)});
}

TEST_F(CudaMrTest, StreamlessCallsUseTheCurrentStreamAndEqualityIsTheAllocator) {
  cuda_memory_resource resource(alloc, 0);
  void* p = resource.allocate(1 * MiB);
  ASSERT_NE(p, nullptr);
  resource.deallocate(p, 1 * MiB);
  EXPECT_EQ(alloc.get_device_stats(0).to_map().at("allocated_bytes.all.current"), 0);
  ccalloc::caching_allocator other{device, ccalloc::allocator_config::parse("")};
  EXPECT_TRUE(resource == cuda_memory_resource(alloc, 0));
  EXPECT_FALSE(resource == cuda_memory_resource(other, 0));
  EXPECT_FALSE(resource == cuda_memory_resource(alloc, 1));
}

TEST_F(CudaMrTest, AnAlignmentAbove512IsRefused) {
  cuda_memory_resource resource(alloc, 0);
  try {
    (void)resource.allocate(MiB, 1024);
    FAIL() << "expected invalid_argument_error";
  } catch (const ccalloc::invalid_argument_error& e) {
    EXPECT_STREQ(e.what(),
                 "ccalloc: cuda_memory_resource: alignment 1024 is not a power of two up to 512 (blocks start on 512 "
                 "bytes)");
  }
  EXPECT_THROW((void)resource.allocate(MiB, 3), ccalloc::invalid_argument_error);
  EXPECT_EQ(alloc.get_device_stats(0).to_map().at("reserved_bytes.all.current"), 0);
}

}  // namespace
