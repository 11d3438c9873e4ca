// The per-thread default stream of a thread that exits
// (src/core/detail/stream_registry.hpp): the thread's exit hands its handle
// to every device that met the stream, and the device's next world lock
// marks it gone and forgets it; a device destroyed before the thread exits
// is not touched.
#include "../src/core/detail/device_state.hpp"

#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/core/config.hpp>

#include <gtest/gtest.h>

#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <thread>

namespace {

using ccalloc::allocator_config;
using ccalloc::sim_backend;
using ccalloc::sim_options;
using ccalloc::stream_t;
using ccalloc::detail::device_state;
using ccalloc::detail::world_lock;

// Registers the calling thread's per-thread stream on `d`; returns its handle.
stream_t register_own_stream(sim_backend& sim, device_state& d) {
  const stream_t own = sim.resolve_stream(0, ccalloc::per_thread_stream_handle);
  (void)d.registry().stream_for(own);
  return own;
}

TEST(ThreadStreamEnd, AnExitedThreadsStreamIsForgottenAtTheNextWorldLock) {
  sim_backend sim(sim_options{1, std::size_t{1} << 30, std::size_t{2} << 20});
  device_state d(0, sim, allocator_config{});
  (void)d.registry().stream_for(0);  // a stream that stays
  stream_t ended = 0;
  std::thread t([&] { ended = register_own_stream(sim, d); });
  t.join();
  EXPECT_EQ(d.registry().ended_pending(), 1u);
  EXPECT_TRUE(d.registry().all().contains(ended)) << "forgotten before a world lock";
  { world_lock w(d); }
  EXPECT_EQ(d.registry().ended_pending(), 0u);
  EXPECT_FALSE(d.registry().all().contains(ended)) << "the exited thread's stream state is still there";
  EXPECT_TRUE(d.registry().all().contains(0));
  EXPECT_EQ(d.registry().gone_count(), 0u);
  EXPECT_EQ(d.registry().by_handle().size(), 1u);
}

// Streams of live threads, and streams made with create_stream, stay.
TEST(ThreadStreamEnd, OnlyExitedThreadsStreamsGo) {
  sim_backend sim(sim_options{1, std::size_t{1} << 30, std::size_t{2} << 20});
  device_state d(0, sim, allocator_config{});
  const stream_t made = sim.create_stream(0);
  (void)d.registry().stream_for(made);
  const stream_t mine = register_own_stream(sim, d);
  std::thread t([&] { (void)register_own_stream(sim, d); });
  t.join();
  { world_lock w(d); }
  EXPECT_EQ(d.registry().all().size(), 2u);
  EXPECT_TRUE(d.registry().all().contains(made));
  EXPECT_TRUE(d.registry().all().contains(mine));
}

// A thread that outlives the device: its exit finds the device gone and
// touches nothing of it (AddressSanitizer checks the rest).
TEST(ThreadStreamEnd, AThreadThatOutlivesTheDeviceLeavesItAlone) {
  sim_backend sim(sim_options{1, std::size_t{1} << 30, std::size_t{2} << 20});
  std::mutex m;
  std::condition_variable cv;
  bool registered = false, device_gone = false;
  auto d = std::make_unique<device_state>(0, sim, allocator_config{});
  std::thread t([&] {
    (void)register_own_stream(sim, *d);
    std::unique_lock lock(m);
    registered = true;
    cv.notify_all();
    cv.wait(lock, [&] { return device_gone; });
  });
  {
    std::unique_lock lock(m);
    cv.wait(lock, [&] { return registered; });
  }
  d.reset();
  {
    std::lock_guard lock(m);
    device_gone = true;
  }
  cv.notify_all();
  t.join();
  device_state again(0, sim, allocator_config{});  // the same device, a new state
  EXPECT_EQ(again.registry().ended_pending(), 0u);
}

}  // namespace
