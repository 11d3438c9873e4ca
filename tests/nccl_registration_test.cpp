// The NCCL registration helper (SPEC C2) against a stub NCCL that keeps the
// registrations it was given and checks that every buffer a "collective"
// is handed lies in one registration, and that no registration overlaps
// memory the allocator unmaps.
#include <ccalloc/backend/sim_backend.hpp>
#include <ccalloc/base/errors.hpp>
#include <ccalloc/core/config.hpp>
#include <ccalloc/core/tags.hpp>
#include <ccalloc/frontend/caching_allocator.hpp>
#include <ccalloc/frontend/nccl_registration.hpp>

#include <gtest/gtest.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

using namespace ccalloc;  // NOLINT: test file

constexpr std::size_t MiB = mib;

// The stub: per communicator, its registrations by handle.
struct stub_nccl {
  struct reg {
    void* comm;
    std::uintptr_t lo, hi;
  };
  std::map<std::uintptr_t, reg> regs;  // handle -> registration
  std::uintptr_t next_handle = 1;
  std::uint64_t registers = 0;
  int fail_next = 0;  // the next register returns this (0: succeeds)
  std::vector<std::string> errors;

  bool holds(void* comm, std::uintptr_t lo, std::uintptr_t hi) const {
    for (const auto& [h, r] : regs)
      if (r.comm == comm && r.lo <= lo && hi <= r.hi) return true;
    return false;
  }
  bool overlaps(std::uintptr_t lo, std::uintptr_t hi) const {
    for (const auto& [h, r] : regs)
      if (r.lo < hi && lo < r.hi) return true;
    return false;
  }
};
stub_nccl* stub = nullptr;

int stub_register(void* comm, void* buff, std::size_t size, void** handle) {
  ++stub->registers;
  if (stub->fail_next != 0) return std::exchange(stub->fail_next, 0);
  const auto lo = reinterpret_cast<std::uintptr_t>(buff);
  if (size == 0) stub->errors.push_back("register of 0 bytes");
  stub->regs[stub->next_handle] = {comm, lo, lo + size};
  *handle = reinterpret_cast<void*>(stub->next_handle++);
  return 0;
}
int stub_deregister(void* /*comm*/, void* handle) {
  if (stub->regs.erase(reinterpret_cast<std::uintptr_t>(handle)) != 1) stub->errors.push_back("unknown handle");
  return 0;
}

class NcclRegistrationTest : public ::testing::Test {
 protected:
  // `before` runs on the allocator before the registration exists.
  void make(const std::string& conf, const std::function<void()>& before = {}) {
    reg.reset();
    sim_options o;
    o.capacity_bytes = 512 * MiB;
    sim = std::make_shared<sim_backend>(o);
    alloc = std::make_unique<caching_allocator>(sim, allocator_config::parse(conf));
    alloc->init(1);
    if (before) before();
    reg = std::make_unique<nccl_registration>(*alloc, nccl_functions{&stub_register, &stub_deregister});
    // Attached after the registration's listener: sees the stub after it acted.
    alloc->attach_mapping_listener([this](const mapping_event& e) {
      if (e.change == mapping_change::unmap && stub->overlaps(e.addr, e.addr + e.size_bytes))
        stub->errors.push_back("a registration overlaps memory being unmapped (" + std::string(to_string(e.reason)) +
                               ")");
    });
  }
  void SetUp() override {
    stub = &nccl;
    make("");
  }
  void TearDown() override {
    reg.reset();
    EXPECT_TRUE(nccl.regs.empty()) << "the registration deregisters all it registered";
    alloc.reset();
    EXPECT_TRUE(nccl.errors.empty()) << nccl.errors.front();
    stub = nullptr;
  }
  // What a collective on [p, p + n) would do: ensure, then the stub checks.
  void collective(void* comm, void* p, std::size_t n) {
    reg->ensure(0, p, n);
    const auto lo = reinterpret_cast<std::uintptr_t>(p);
    if (!nccl.holds(comm, lo, lo + n)) nccl.errors.push_back("a buffer not registered for its whole length");
  }

  stub_nccl nccl;
  std::shared_ptr<sim_backend> sim;
  std::unique_ptr<caching_allocator> alloc;
  std::unique_ptr<nccl_registration> reg;
  int comm_a = 0, comm_b = 0;  // their addresses are the communicators
};

TEST_F(NcclRegistrationTest, ABurstOfPagesIsRegisteredOnceAndEveryBufferIsCovered) {
  reg->add_communicator(&comm_a, 0);
  std::vector<void*> live;
  for (int i = 0; i < 16; ++i) live.push_back(alloc->malloc(0, 3 * MiB, 0));  // pages mapped one request at a time
  EXPECT_EQ(nccl.registers, 0u) << "nothing is registered before a buffer is needed";
  for (void* p : live) collective(&comm_a, p, 3 * MiB);
  EXPECT_EQ(reg->stats().register_calls, 1u) << "the 24 contiguous pages, one registration";
  EXPECT_EQ(reg->stats().registered_bytes, 48 * MiB);
  for (void* p : live) alloc->free(p);
}

TEST_F(NcclRegistrationTest, UnmappedPagesAreDeregisteredBeforeAndTheRestComesBack) {
  reg->add_communicator(&comm_a, 0);
  reg->add_communicator(&comm_b, 0);
  void* a = alloc->malloc(0, 20 * MiB, 0);
  void* b = alloc->malloc(0, 20 * MiB, 0);
  collective(&comm_a, a, 20 * MiB);
  collective(&comm_b, b, 20 * MiB);
  EXPECT_EQ(reg->stats().register_calls, 2u) << "one per communicator";
  alloc->free(a);
  alloc->empty_cache();  // a's pages go: the registrations covering them go first
  EXPECT_EQ(reg->stats().deregister_calls, 2u);
  collective(&comm_a, b, 20 * MiB);
  collective(&comm_b, b, 20 * MiB);
  EXPECT_EQ(reg->stats().registered_bytes, 40 * MiB) << "b's pages, with each communicator";
  alloc->free(b);
}

TEST_F(NcclRegistrationTest, RandomTrafficNeverLeavesAStaleOrMissingRegistration) {
  make("trim_on_new_peak:True,reuse_across_streams:False");
  reg->add_communicator(&comm_a, 0);
  const stream_t s = sim->create_stream(0);
  std::mt19937_64 rng(7);
  std::vector<void*> live;
  for (int i = 0; i < 400; ++i) {
    const std::uint64_t r = rng() % 100;
    if (r < 50 || live.empty()) {
      try {
        live.push_back(alloc->malloc(0, (1 + rng() % 24) * MiB, rng() % 2 != 0 ? s : 0));
      } catch (const out_of_memory_error&) {
      }
    } else if (r < 85) {
      const std::size_t k = rng() % live.size();
      alloc->free(live[k]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    } else if (r < 90) {
      alloc->empty_cache();
    } else {
      void* p = live[rng() % live.size()];
      collective(&comm_a, p, MiB);
    }
  }
  for (void* p : live) alloc->free(p);
  EXPECT_GT(reg->stats().register_calls, 0u);
}

TEST_F(NcclRegistrationTest, PlainSegmentsAreRegisteredOneEach) {
  make("expandable_segments:False");
  reg->add_communicator(&comm_a, 0);
  void* a = alloc->malloc(0, 30 * MiB, 0);
  void* b = alloc->malloc(0, 30 * MiB, 0);
  collective(&comm_a, a, 30 * MiB);
  collective(&comm_a, b, 30 * MiB);
  EXPECT_EQ(reg->stats().register_calls, 2u) << "never one registration across two allocations";
  alloc->free(a);
  alloc->free(b);
  alloc->empty_cache();
  EXPECT_EQ(reg->stats().registered_bytes, 0u);
}

TEST_F(NcclRegistrationTest, ErrorsLeaveTheRegistrationsAsTheyWere) {
  reg->add_communicator(&comm_a, 0);
  EXPECT_THROW(reg->add_communicator(&comm_a, 0), invalid_argument_error);
  void* a = alloc->malloc(0, 4 * MiB, 0);
  nccl.fail_next = 3;
  EXPECT_THROW(reg->ensure(0, a, 4 * MiB), nccl_error);
  EXPECT_EQ(reg->stats().registered_bytes, 0u);
  collective(&comm_a, a, 4 * MiB);
  int outside = 0;
  EXPECT_THROW(reg->ensure(0, &outside, sizeof outside), invalid_argument_error);
  EXPECT_THROW(nccl_registration(*alloc, nccl_functions{}), invalid_argument_error);
  EXPECT_THROW((void)nccl_functions::load("libccalloc-no-such-nccl.so"), nccl_error);
  reg->remove_communicator(&comm_a);
  EXPECT_TRUE(nccl.regs.empty());
  alloc->free(a);
}

TEST_F(NcclRegistrationTest, APlainSegmentSplitBeforeTheRegistrationIsOneRange) {
  void* a = nullptr;
  void* b = nullptr;
  make("expandable_segments:False", [&] {
    a = alloc->malloc(0, 4 * MiB, 0);  // both from one 20 MiB segment, split in three blocks
    b = alloc->malloc(0, 4 * MiB, 0);
  });
  ASSERT_EQ(alloc->snapshot(false).segments.size(), 1u);
  reg->add_communicator(&comm_a, 0);
  alloc->free(a);
  alloc->free(b);
  void* c = alloc->malloc(0, 12 * MiB, 0);  // spans the three former blocks
  ASSERT_EQ(c, a);
  collective(&comm_a, c, 12 * MiB);
  EXPECT_EQ(reg->stats().register_calls, 1u);
  EXPECT_EQ(reg->stats().registered_bytes, 20 * MiB) << "the whole segment, once";
  reg->flush();
  EXPECT_EQ(reg->stats().register_calls, 1u) << "nothing else is mapped";
  alloc->free(c);
  alloc->empty_cache();
  EXPECT_EQ(reg->stats().registered_bytes, 0u);
}

TEST_F(NcclRegistrationTest, APausedTagBeforeTheRegistrationIsNotMapped) {
  void* w = nullptr;
  make("expandable_segments:True", [&] {
    {
      tag_scope scope("weights");
      w = alloc->malloc(0, 8 * MiB, 0);
    }
    alloc->pause({"weights"}, false);
  });
  reg->add_communicator(&comm_a, 0);
  EXPECT_THROW(reg->ensure(0, w, 8 * MiB), invalid_argument_error) << "its pages are released";
  reg->flush();
  EXPECT_EQ(reg->stats().register_calls, 0u);
  EXPECT_TRUE(nccl.regs.empty());
  alloc->resume({"weights"});
  collective(&comm_a, w, 8 * MiB);
  EXPECT_EQ(reg->stats().registered_bytes, 8 * MiB);
  alloc->free(w);
}

TEST_F(NcclRegistrationTest, ABadDeviceOrAnOverflowingSizeIsRefusedAndChangesNothing) {
  reg->add_communicator(&comm_a, 0);
  auto* p = static_cast<char*>(alloc->malloc(0, 4 * MiB, 0));
  const auto before = reg->stats();
  for (int device : {7, -1, 1}) {
    try {
      reg->ensure(device, p, 1);
      ADD_FAILURE() << "device " << device << " accepted";
    } catch (const invalid_argument_error& e) {
      EXPECT_NE(std::string(e.what()).find("device " + std::to_string(device) + " is out of range"),
                std::string::npos)
          << e.what();
    }
  }
  try {
    reg->ensure(0, p + 1, SIZE_MAX);
    ADD_FAILURE() << "an overflowing size accepted";
  } catch (const invalid_argument_error& e) {
    EXPECT_NE(std::string(e.what()).find("runs past the end of the address space"), std::string::npos) << e.what();
  }
  EXPECT_EQ(reg->stats().register_calls, before.register_calls);
  EXPECT_EQ(reg->stats().registered_bytes, 0u);
  EXPECT_TRUE(nccl.regs.empty());
  collective(&comm_a, p, 4 * MiB);  // still works
  alloc->free(p);
}

TEST_F(NcclRegistrationTest, AddCommunicatorRefusesADeviceOutOfRangeAndChangesNothing) {
  for (int device : {1, -1, 1000}) {
    try {
      reg->add_communicator(&comm_a, device);
      ADD_FAILURE() << "device " << device << " accepted";
    } catch (const invalid_argument_error& e) {
      EXPECT_NE(std::string(e.what()).find("add_communicator: device " + std::to_string(device) + " is out of range"),
                std::string::npos)
          << e.what();
    }
  }
  // Nothing was kept: the communicator can be added now, on its device.
  EXPECT_NO_THROW(reg->add_communicator(&comm_a, 0));
  auto* p = alloc->malloc(0, 4 * MiB, 0);
  collective(&comm_a, p, 4 * MiB);
  alloc->free(p);
}

// The registrar lists what is mapped and starts hearing announcements as one
// step: segments mapped and unmapped by another thread while registrars are
// constructed are each in every registrar's table exactly when mapped.
TEST_F(NcclRegistrationTest, RegistrarsMadeWhileAnotherThreadMapsSeeEveryChange) {
  std::vector<std::unique_ptr<nccl_registration>> regs;
  std::vector<std::unique_ptr<int>> comms;  // their addresses are the communicators
  std::vector<void*> held;
  // Every registrar's table, flushed to a communicator of its own, equals
  // the mapped segments.
  auto check = [&](const char* phase) {
    std::set<std::pair<std::uintptr_t, std::uintptr_t>> mapped;
    for (const segment_info& s : alloc->device_allocator(0).segments())
      for (const mapped_run& r : mapped_runs(s)) mapped.insert({r.address, r.address + r.size_bytes});
    for (auto& r : regs) {
      void* comm = comms.emplace_back(std::make_unique<int>()).get();
      r->add_communicator(comm, 0);
      r->flush();
      std::set<std::pair<std::uintptr_t, std::uintptr_t>> table;
      for (const auto& [h, x] : nccl.regs)
        if (x.comm == comm) table.insert({x.lo, x.hi});
      r->remove_communicator(comm);
      EXPECT_EQ(table, mapped) << phase << ": a registrar missed a change";
    }
  };
  // Runs `body` on another thread while registrars are made here (100 at
  // most, which bounds the test's time).
  auto race = [&](const std::function<void()>& body) {
    std::atomic<bool> done{false};
    std::thread t([&] {
      body();
      done = true;
    });
    for (int made = 0; !done && made < 100; ++made)
      regs.push_back(std::make_unique<nccl_registration>(*alloc, nccl_functions{&stub_register, &stub_deregister}));
    t.join();
  };
  for (int round = 0; round < 10 && !HasFailure(); ++round) {
    race([&] {  // maps 2 MiB small-pool segments, one each second malloc
      for (int i = 0; i < 200; ++i) held.push_back(alloc->malloc(0, 1 * MiB, 0));
    });
    check("mapping");
    race([&] {  // unmaps them, one segment at a time
      for (std::size_t i = 0; i < held.size(); i += 2) {
        alloc->free(held[i]);
        alloc->free(held[i + 1]);
        alloc->empty_cache();
      }
    });
    held.clear();
    check("unmapping");
    regs.clear();
  }
}

}  // namespace
