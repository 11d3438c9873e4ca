// A device's out-of-memory reporting (src/core/detail/oom_reporter.hpp):
// the observers it keeps and runs, the error's figures and count, and the
// snapshot writer it calls at most once per oom_snapshot_interval_s. On a
// device_state of its own over a small simulated device; the writer is a
// stand-in that writes nothing.
#include "../src/core/detail/device_state.hpp"

#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/core/config.hpp>

#include <gtest/gtest.h>

#include <cstddef>
#include <string>
#include <vector>

namespace {

using ccalloc::allocator_config;
using ccalloc::out_of_memory_error;
using ccalloc::sim_backend;
using ccalloc::sim_options;
using ccalloc::detail::device_state;

constexpr std::size_t mib = std::size_t{1} << 20;

// A 64 MiB device; the request of 100 MiB never fits. Returns the error's message.
std::string fail_once(device_state& d, std::size_t* requested = nullptr, std::size_t* total = nullptr) {
  try {
    d.allocate(100 * mib, 0);
  } catch (const out_of_memory_error& e) {
    if (requested != nullptr) *requested = e.requested_bytes;
    if (total != nullptr) *total = e.device_total_bytes;
    return e.what();
  }
  ADD_FAILURE() << "no out_of_memory_error";
  return {};
}

TEST(OomReporter, RunsEveryObserverInOrderWithTheErrorsFiguresAndCountsIt) {
  sim_backend sim(sim_options{1, 64 * mib, 2 * mib});
  device_state d(0, sim, allocator_config::parse("expandable_segments:False"));
  std::vector<std::string> calls;
  d.oom().attach([&](int device, std::size_t requested, std::size_t total, std::size_t) {
    calls.push_back("a " + std::to_string(device) + " " + std::to_string(requested) + " " + std::to_string(total));
  });
  d.oom().attach([&](int, std::size_t, std::size_t, std::size_t) {
    calls.emplace_back("b");
    throw std::runtime_error("an observer's failure is dropped");
  });
  EXPECT_EQ(d.oom().observers().size(), 2u);
  std::size_t requested = 0;
  std::size_t total = 0;
  const std::string msg = fail_once(d, &requested, &total);
  EXPECT_EQ(requested, 100 * mib);
  EXPECT_EQ(total, 64 * mib);
  EXPECT_NE(msg.find("out of memory on device 0"), std::string::npos) << msg;
  const std::string first = "a 0 " + std::to_string(100 * mib) + " " + std::to_string(64 * mib);
  EXPECT_EQ(calls, (std::vector<std::string>{first, "b"}));
  EXPECT_EQ(d.stats().values().num_ooms, 1);
  fail_once(d);
  EXPECT_EQ(calls.size(), 4u);
  EXPECT_EQ(d.stats().values().num_ooms, 2);
}

TEST(OomReporter, WritesOneSnapshotPerIntervalAndSaysWhyNotOtherwise) {
  sim_backend sim(sim_options{1, 64 * mib, 2 * mib});
  device_state d(0, sim,
                 allocator_config::parse("expandable_segments:False,oom_snapshot:/nowhere/oom.pickle,"
                                         "oom_snapshot_interval_s:3600"));
  std::vector<std::string> written;
  d.oom().set_snapshot_writer([&](const std::string& path) {
    written.push_back(path);
    return std::string(" [snapshot sentence]");
  });
  const std::string first = fail_once(d);
  EXPECT_EQ(written, (std::vector<std::string>{"/nowhere/oom.pickle"}));
  EXPECT_NE(first.find(" [snapshot sentence]"), std::string::npos) << first;
  const std::string second = fail_once(d);
  EXPECT_EQ(written.size(), 1u);  // within the interval: none
  EXPECT_EQ(second.find(" [snapshot sentence]"), std::string::npos) << second;
  EXPECT_NE(second.find("No snapshot was written (oom_snapshot): the last one went to /nowhere/oom.pickle"),
            std::string::npos)
      << second;
}

TEST(OomReporter, WithoutAWriterNoSnapshotIsClaimed) {
  sim_backend sim(sim_options{1, 64 * mib, 2 * mib});
  device_state d(0, sim, allocator_config::parse("expandable_segments:False,oom_snapshot:/nowhere/oom.pickle"));
  const std::string msg = fail_once(d);
  EXPECT_EQ(msg.find("snapshot"), std::string::npos) << msg;
}

}  // namespace
